#include "engine.h"

#include <algorithm>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>

#include "sample.h"

namespace baton::serve {

struct Engine::Live {
  std::uint64_t id = 0;
  Request req;
  std::mt19937_64 rng;
  std::int64_t slot = -1;
  std::vector<std::int32_t> blocks;
  std::vector<std::int32_t> tokens;  // the prompt, then what was generated
  std::int64_t fed = 0;              // tokens whose keys and values are in the cache
  std::vector<std::int32_t> generated;
  std::vector<std::int32_t> tail;  // the prompt's last ids, decoded before the completion
  std::string base;                // their text
  std::size_t sent = 0;            // bytes of the completion's text sent
  std::atomic<bool> cancelled{false};
  std::int64_t group = 0;  // which of the pipeline's groups of requests it steps with
  bool in_flight = false;  // a step of its rows is launched and not collected (under mutex_)
};

// A step launched and not yet collected: whose rows it holds, and which rows' logits it draws.
struct Engine::Launched {
  struct Take {
    std::shared_ptr<Live> r;  // held: finishing a request drops the engine's own reference
    std::int64_t first_row, rows;
  };
  std::vector<Take> takes;
  std::vector<std::int64_t> logit_row;  // per take: its row of the logits, or -1 (a prompt's chunk)
  std::int64_t used = 0;
  double seconds = 0;  // this process's time in it so far
};

namespace {
std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
}  // namespace

Engine::Engine(EngineSettings settings) : settings_(std::move(settings)) {
  const EngineSettings& s = settings_;
  const DecodeModel& m = s.model;
  if (!s.params) throw std::invalid_argument("baton-serve: no weights");
  // The batch's limits are serve_shape's to check (every rank of a pipeline computes it).
  if (s.max_queue < 0) throw std::invalid_argument(fmt::format("--max-queue {} must be >= 0", s.max_queue));
  shape_ = serve_shape(m, s.max_batch, s.max_batch_tokens, s.block_size, s.kv_cache_bytes,
                       s.cache_layers > 0 ? s.cache_layers : m.layers());
  shape_.device = s.device;
  shape_.graphs = s.graphs;
  runner_ = s.runner ? s.runner(shape_) : std::make_unique<LocalPipeline>(m, s.pp, shape_, s.params);
  groups_ = runner_->groups();
  for (std::int64_t i = shape_.cache_blocks; i-- > 0;) free_blocks_.push_back(static_cast<std::int32_t>(i));
  for (std::int64_t i = s.max_batch; i-- > 0;) free_slots_.push_back(i);
  weights_ = s.weights;
  if (s.log) {
    s.log(fmt::format("KV cache: {} blocks of {} positions, {} tokens ({:.1f} MiB in this process); {} requests at "
                      "most in a batch, {} rows a step; the steps' buffers {:.1f} MiB ({} programs a stage); {}",
                      shape_.cache_blocks, s.block_size, cache_tokens(),
                      static_cast<double>(runner_->cache_bytes()) / (1 << 20), s.max_batch, s.max_batch_tokens,
                      static_cast<double>(runner_->buffer_bytes()) / (1 << 20), shape_.buckets.size(),
                      runner_->describe()));
  }
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

ModelInfo Engine::info() const {
  return ModelInfo{.id = settings_.model_id, .context = settings_.model.context(), .vocab = settings_.model.vocab(),
                   .text = settings_.codec != nullptr, .created = settings_.created};
}

std::vector<std::int32_t> Engine::encode(const std::string& text) const {
  if (!settings_.codec) {
    throw std::invalid_argument(
        "this model has no tokenizer: give the prompt as an array of token ids (serve a checkpoint of text or token "
        "data, or pass --tokenizer)");
  }
  return settings_.codec->encode(text);
}

std::string Engine::check(const Request& r) const {
  const std::int64_t context = settings_.model.context(), vocab = settings_.model.vocab();
  if (r.prompt.empty()) return "prompt: it is empty (it needs at least one token)";
  for (std::size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= vocab)
      return fmt::format("prompt: token {} is id {}, outside the vocabulary [0, {})", i, r.prompt[i], vocab);
  }
  if (r.max_tokens < 1) return fmt::format("max_tokens: must be >= 1, not {}", r.max_tokens);
  const auto n = static_cast<std::int64_t>(r.prompt.size());
  if (n + r.max_tokens > context) {
    return fmt::format(
        "prompt: this model's context is {} tokens, but the prompt has {} and max_tokens asks for {} more ({} in all)",
        context, n, r.max_tokens, n + r.max_tokens);
  }
  if (!r.stop.empty() && !settings_.codec) return "stop: stop strings need a model with a tokenizer";
  for (const std::string& s : r.stop) {
    if (s.empty()) return "stop: a stop string is empty";
  }
  if (!(r.sampling.temperature >= 0) || !(r.sampling.top_p > 0 && r.sampling.top_p <= 1))
    return "temperature must be >= 0 and top_p in (0, 1]";
  return {};
}

Backend::Admission Engine::submit(Request r, std::uint64_t& id) {
  auto live = std::make_shared<Live>();
  {
    std::lock_guard lock(mutex_);
    if (draining_ || stopping_ || !failure_.empty()) return Admission::draining;
    if (static_cast<std::int64_t>(waiting_.size()) >= settings_.max_queue) return Admission::queue_full;
    live->id = id = next_id_++;
    live->rng.seed(r.sampling.seed);
    live->tokens = r.prompt;
    const std::size_t keep = std::min<std::size_t>(r.prompt.size(), 8);
    live->tail.assign(r.prompt.end() - static_cast<std::ptrdiff_t>(keep), r.prompt.end());
    live->req = std::move(r);
    by_id_[live->id] = live;
    waiting_.push_back(live);
  }
  changed_.notify_all();
  return Admission::accepted;
}

void Engine::cancel(std::uint64_t id) {
  {
    std::lock_guard lock(mutex_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return;
    it->second->cancelled = true;
  }
  changed_.notify_all();
}

Stats Engine::stats() const {
  std::lock_guard lock(mutex_);
  return Stats{.running = static_cast<std::int64_t>(running_.size()),
               .waiting = static_cast<std::int64_t>(waiting_.size()),
               .kv_cache_usage = 1.0 - static_cast<double>(free_blocks_.size()) / static_cast<double>(shape_.cache_blocks),
               .kv_cache_tokens = cache_tokens(),
               .steps = steps_,
               .weights = weights_,
               .swapping = pending_params_ != nullptr,
               .busy_seconds = busy_seconds_,
               .generated_tokens = generated_,
               .batch_rows = last_rows_,
               .stage_busy_seconds = stage_busy_};
}

std::string Engine::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

void Engine::drain(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  draining_ = true;
  changed_.notify_all();
  if (!changed_.wait_until(lock, deadline, [&] { return running_.empty() && waiting_.empty(); })) {
    for (auto& [id, live] : by_id_) live->cancelled = true;
    changed_.notify_all();
    changed_.wait_for(lock, std::chrono::seconds(10), [&] { return running_.empty() && waiting_.empty(); });
  }
}

void Engine::swap_weights(std::shared_ptr<const ParameterStore> params, const std::string& label,
                          std::chrono::steady_clock::time_point deadline) {
  if (!params) throw std::invalid_argument("swap_weights: no weights");
  // Checked here, before admission pauses: a program that refuses them keeps its old ones.
  if (const std::string why = runner_->swap_refused(); !why.empty()) throw std::invalid_argument(why);
  if (const std::string why = check_weights(settings_.model, *params); !why.empty()) {
    throw std::invalid_argument("the new weights " + why);
  }
  std::unique_lock lock(mutex_);
  const std::uint64_t before = swaps_;
  pending_params_ = std::move(params);
  pending_label_ = label;
  changed_.notify_all();
  if (!changed_.wait_until(lock, deadline, [&] { return swaps_ != before || !failure_.empty(); })) {
    pending_params_.reset();
    throw std::runtime_error(fmt::format("the weights '{}' were not swapped in: the running requests did not finish "
                                         "in time (the old weights stay)",
                                         label));
  }
  if (swaps_ == before) throw std::runtime_error("the engine failed: " + failure_);
}

std::int64_t Engine::blocks_for(const Live& r) const {
  return ceil_div(static_cast<std::int64_t>(r.req.prompt.size()) + r.req.max_tokens, settings_.block_size);
}

bool Engine::admit_locked() {
  bool any = false;
  if (pending_params_ || !failure_.empty()) return false;
  if (!settings_.continuous && !running_.empty()) return false;
  while (!waiting_.empty() && !free_slots_.empty()) {
    Live& r = *waiting_.front();
    const std::int64_t need = blocks_for(r);
    if (need > static_cast<std::int64_t>(free_blocks_.size())) break;  // first come, first served: it waits
    r.slot = free_slots_.back();
    free_slots_.pop_back();
    r.blocks.assign(free_blocks_.end() - need, free_blocks_.end());
    free_blocks_.resize(free_blocks_.size() - static_cast<std::size_t>(need));
    // The group with the fewest requests: the pipeline's groups stay even.
    std::vector<std::int64_t> load(static_cast<std::size_t>(groups_), 0);
    for (const auto& x : running_) ++load[static_cast<std::size_t>(x->group)];
    r.group = std::min_element(load.begin(), load.end()) - load.begin();
    running_.push_back(waiting_.front());
    waiting_.pop_front();
    any = true;
  }
  return any;
}

void Engine::loop() {
  std::vector<std::shared_ptr<Live>> batch, ended, started;
  for (;;) {
    bool launch = false;
    {
      std::unique_lock lock(mutex_);
      // Requests whose clients left: out of the queue and the batch, their blocks freed (once
      // no step in flight still writes their cache).
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if ((*it)->cancelled || stopping_) {
          ended.push_back(*it);
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto& r : running_) {
        if (stopping_ || (r->cancelled && !r->in_flight)) ended.push_back(r);
      }
      if (!ended.empty()) {
        const bool stopping = stopping_;
        lock.unlock();
        for (auto& r : ended) finish(*r, stopping ? Finish::failed : Finish::cancelled, stopping ? "the server stopped" : "");
        ended.clear();
        continue;
      }
      if (stopping_) return;
      if (!failed_from_outside_.empty()) {
        const std::string why = failed_from_outside_;
        lock.unlock();
        fail_all(why);
        return;
      }
      if (pending_params_ && running_.empty()) {
        try {
          runner_->set_params(pending_params_);
          weights_ = pending_label_;
          ++swaps_;
          if (settings_.log) settings_.log(fmt::format("weights swapped in: {}", weights_));
        } catch (const std::exception& e) {
          failure_ = fmt::format("swapping in the weights '{}' failed: {}", pending_label_, e.what());
        }
        pending_params_.reset();
        changed_.notify_all();
      }
      const std::size_t before = running_.size();
      admit_locked();
      started.assign(running_.begin() + static_cast<std::ptrdiff_t>(before), running_.end());
      if (running_.empty()) {
        changed_.notify_all();  // drain() and swap_weights() wait for this
        changed_.wait_for(lock, std::chrono::milliseconds(200));
        continue;
      }
      // Launch the next group that has requests and no step in flight, while fewer than groups_
      // steps are; else collect the oldest.
      batch.clear();
      if (static_cast<std::int64_t>(in_flight_.size()) < groups_) {
        for (std::int64_t k = 0; k < groups_ && batch.empty(); ++k) {
          const std::int64_t g = (next_group_ + k) % groups_;
          for (auto& r : running_) {
            if (r->group == g && !r->in_flight && !r->cancelled) batch.push_back(r);
          }
          if (!batch.empty()) next_group_ = (g + 1) % groups_;
        }
      }
      launch = !batch.empty();
      for (auto& r : batch) r->in_flight = true;
      if (!launch && in_flight_.empty()) {  // only cancelled requests left: the top of the loop ends them
        continue;
      }
    }
    for (auto& r : started) {
      if (r->req.events.started) r->req.events.started();
    }
    started.clear();
    try {
      if (launch) {
        launch_step(batch);
        // One group (one stage, or stages in this process): nothing runs while this step is out,
        // so it is collected at once.
        if (groups_ == 1) collect_step();
      } else {
        collect_step();
      }
    } catch (const std::exception& e) {
      fail_all(fmt::format("a decode step failed: {}", e.what()));
      return;
    }
  }
}

void Engine::launch_step(std::vector<std::shared_ptr<Live>>& batch) {
  const auto began = std::chrono::steady_clock::now();
  Launched l;
  // Decoding requests first, one row each; then prompt chunks in the rows left.
  std::stable_partition(batch.begin(), batch.end(),
                        [](const auto& r) { return static_cast<std::int64_t>(r->tokens.size()) - r->fed == 1; });
  for (auto& r : batch) {
    const std::int64_t pending = static_cast<std::int64_t>(r->tokens.size()) - r->fed;
    const std::int64_t n = std::min(pending, settings_.max_batch_tokens - l.used);
    if (n <= 0) {
      std::lock_guard lock(mutex_);
      r->in_flight = false;  // no room this step
      continue;
    }
    l.takes.push_back({r, l.used, n});
    l.used += n;
  }
  const std::int64_t used = l.used;
  const std::int64_t rows = *std::find_if(shape_.buckets.begin(), shape_.buckets.end(), [&](std::int64_t x) { return x >= used; });
  const std::int64_t bps = shape_.blocks_per_slot;
  StepRows& in = rows_;
  in.rows = rows;
  in.tokens.assign(static_cast<std::size_t>(rows), 0);
  in.positions.assign(static_cast<std::size_t>(rows), 0);
  in.slots.assign(static_cast<std::size_t>(rows), -1);
  in.table.resize(static_cast<std::size_t>(shape_.slots * bps));  // rows of slots not in the step are not read
  in.sample_rows.assign(static_cast<std::size_t>(std::min(rows, shape_.slots)), 0);
  for (const auto& t : l.takes) {
    for (std::int64_t i = 0; i < t.rows; ++i) {
      const std::int64_t pos = t.r->fed + i;
      const auto at = static_cast<std::size_t>(t.first_row + i);
      in.tokens[at] = t.r->tokens[static_cast<std::size_t>(pos)];
      in.positions[at] = static_cast<std::int32_t>(pos);
      in.slots[at] = static_cast<std::int32_t>(t.r->slot);
    }
    const auto row = in.table.begin() + t.r->slot * bps;
    std::fill_n(row, bps, -1);
    std::copy(t.r->blocks.begin(), t.r->blocks.end(), row);
  }
  // The rows whose logits are drawn from: each request's last row, if the step reaches its end.
  l.logit_row.assign(l.takes.size(), -1);
  std::int64_t k = 0;
  for (std::size_t i = 0; i < l.takes.size(); ++i) {
    if (l.takes[i].r->fed + l.takes[i].rows < static_cast<std::int64_t>(l.takes[i].r->tokens.size())) continue;
    in.sample_rows[static_cast<std::size_t>(k)] = static_cast<std::int32_t>(l.takes[i].first_row + l.takes[i].rows - 1);
    l.logit_row[i] = k++;
  }
  runner_->launch(in);
  l.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  in_flight_.push_back(std::move(l));
}

void Engine::collect_step() {
  const auto began = std::chrono::steady_clock::now();
  Launched l = std::move(in_flight_.front());
  in_flight_.erase(in_flight_.begin());
  const Tensor& logits = runner_->collect();
  {
    std::lock_guard lock(mutex_);
    for (const auto& t : l.takes) t.r->in_flight = false;
  }
  const std::int64_t vocab = settings_.model.vocab();
  std::int64_t sampled = 0;
  std::vector<float> row(static_cast<std::size_t>(vocab));
  for (std::size_t i = 0; i < l.takes.size(); ++i) {
    const auto& t = l.takes[i];
    t.r->fed += t.rows;
    if (l.logit_row[i] < 0) continue;  // a prompt's chunk, not its end
    const std::int64_t at = l.logit_row[i] * vocab;
    if (logits.dtype() == DType::f64) {
      const double* src = static_cast<const double*>(logits.raw()) + at;
      for (std::int64_t v = 0; v < vocab; ++v) row[static_cast<std::size_t>(v)] = static_cast<float>(src[v]);
    } else {
      const float* src = static_cast<const float*>(logits.raw()) + at;
      std::copy_n(src, vocab, row.begin());
    }
    const Sampling& s = t.r->req.sampling;
    const double u = sample::uniform(t.r->rng());  // drawn even when greedy: the stream stays in step
    emit(*t.r, sample::draw(row.data(), vocab, s.temperature, s.top_p, u));
    ++sampled;
  }
  std::lock_guard lock(mutex_);
  ++steps_;
  generated_ += sampled;
  last_rows_ = l.used;
  stage_busy_ = runner_->stage_busy_seconds();
  busy_seconds_ += l.seconds + std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
}

void Engine::emit(Live& r, std::int32_t token) {
  r.generated.push_back(token);
  r.tokens.push_back(token);
  const Codec* codec = settings_.codec.get();
  const bool eos = codec != nullptr && token == codec->eos();
  const bool last = static_cast<std::int64_t>(r.generated.size()) >= r.req.max_tokens ||
                    static_cast<std::int64_t>(r.tokens.size()) >= settings_.model.context();
  std::string piece;
  std::optional<Finish> end;
  if (codec == nullptr) {
    piece = fmt::format(" {}", token);
    if (last) end = Finish::length;
  } else {
    if (r.base.empty() && !r.tail.empty()) r.base = codec->decode(r.tail);
    std::vector<std::int32_t> ids = r.tail;
    ids.insert(ids.end(), r.generated.begin(), r.generated.end() - (eos ? 1 : 0));
    std::string full = codec->decode(ids);
    full = full.compare(0, r.base.size(), r.base) == 0 ? full.substr(r.base.size()) : codec->decode(r.generated);
    // The earliest stop string in what was not sent yet (what was sent holds none: its possible
    // beginnings were held back).
    std::size_t stop_at = std::string::npos;
    for (const std::string& s : r.req.stop) {
      const std::size_t from = r.sent >= s.size() ? r.sent - s.size() + 1 : 0;
      stop_at = std::min(stop_at, full.find(s, from));
    }
    std::size_t upto = full.size();
    if (stop_at != std::string::npos) {
      upto = stop_at;
      end = Finish::stop;
    } else if (eos) {
      end = Finish::stop;
    } else if (last) {
      end = Finish::length;
    } else {
      upto = stable_prefix(full);
      // Hold back a tail that may be the beginning of a stop string.
      std::size_t hold = 0;
      for (const std::string& s : r.req.stop) {
        for (std::size_t k = std::min(s.size() - 1, upto); k > hold; --k) {
          if (full.compare(upto - k, k, s, 0, k) == 0) {
            hold = k;
            break;
          }
        }
      }
      upto -= hold;
    }
    if (upto > r.sent) piece = full.substr(r.sent, upto - r.sent);
  }
  r.sent += piece.size();
  if (r.req.events.token) r.req.events.token(token, piece);
  if (end) finish(r, *end);
}

void Engine::finish(Live& r, Finish why, const std::string& error) {
  {
    std::lock_guard lock(mutex_);
    if (r.slot >= 0) {
      free_slots_.push_back(r.slot);
      free_blocks_.insert(free_blocks_.end(), r.blocks.begin(), r.blocks.end());
      r.slot = -1;
      r.blocks.clear();
    }
    std::erase_if(running_, [&](const auto& x) { return x.get() == &r; });
    std::erase_if(waiting_, [&](const auto& x) { return x.get() == &r; });
    by_id_.erase(r.id);
  }
  changed_.notify_all();
  if (r.req.events.finish) {
    r.req.events.finish(why,
                        Usage{.prompt_tokens = static_cast<std::int64_t>(r.req.prompt.size()),
                              .completion_tokens = static_cast<std::int64_t>(r.generated.size())},
                        error);
  }
}

void Engine::fail(const std::string& reason) {
  {
    std::lock_guard lock(mutex_);
    if (failed_from_outside_.empty()) failed_from_outside_ = reason;
  }
  changed_.notify_all();
}

void Engine::fail_all(const std::string& reason) {
  std::vector<std::shared_ptr<Live>> all;
  {
    std::lock_guard lock(mutex_);
    failure_ = reason;
    all.assign(running_.begin(), running_.end());
    all.insert(all.end(), waiting_.begin(), waiting_.end());
  }
  if (settings_.log) settings_.log("the engine failed: " + reason);
  for (auto& r : all) finish(*r, Finish::failed, reason);
}

}  // namespace baton::serve
