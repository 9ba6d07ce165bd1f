#include "pipeline.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "baton/graph/op_registry.h"
#include "baton/kernels/allocator.h"
#include "baton/kernels/cuda.h"

#include <fmt/format.h>

namespace baton::serve {

namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The row buckets: 2, 4, 8, ... below max, then max.
std::vector<std::int64_t> bucket_rows(std::int64_t max) {
  std::vector<std::int64_t> rows;
  for (std::int64_t r = 2; r < max; r *= 2) rows.push_back(r);
  rows.push_back(max);
  return rows;
}

// FNV-1a over 64-bit words.
struct Hasher {
  std::uint64_t h = 1469598103934665603ull;
  void add(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
};

// The step packet: a header of int64s, then the rows' int32 arrays, then (8-aligned) the
// seconds of the stages before, then the hidden state.
struct StepHeader {
  std::int64_t rows, table, samples, times, hidden_bytes;
};

void put(std::vector<std::byte>& out, const void* data, std::size_t n) {
  const auto* p = static_cast<const std::byte*>(data);
  out.insert(out.end(), p, p + n);
}

template <typename T>
void put_vector(std::vector<std::byte>& out, const std::vector<T>& v) {
  put(out, v.data(), v.size() * sizeof(T));
}

std::size_t align8(std::size_t n) { return (n + 7) / 8 * 8; }

void pack_step(std::vector<std::byte>& out, const StepRows& r, const std::vector<double>& times, const void* hidden,
               std::size_t hidden_bytes) {
  out.clear();
  const StepHeader h{r.rows, static_cast<std::int64_t>(r.table.size()), static_cast<std::int64_t>(r.sample_rows.size()),
                     static_cast<std::int64_t>(times.size()), static_cast<std::int64_t>(hidden_bytes)};
  put(out, &h, sizeof h);
  put_vector(out, r.tokens);
  put_vector(out, r.positions);
  put_vector(out, r.slots);
  put_vector(out, r.table);
  put_vector(out, r.sample_rows);
  out.resize(align8(out.size()));
  put_vector(out, times);
  put(out, hidden, hidden_bytes);
}

// Reads a step packet into `r` and `times` and returns where its hidden state lies (none for the
// first stage's shards). Throws std::runtime_error for a packet that does not add up.
const std::byte* unpack_step(const std::vector<std::byte>& in, StepRows& r, std::vector<double>& times,
                             std::size_t& hidden_bytes) {
  StepHeader h{};
  if (in.size() < sizeof h) throw std::runtime_error(fmt::format("a step packet of {} bytes: too short", in.size()));
  std::memcpy(&h, in.data(), sizeof h);
  if (h.rows < 1 || h.table < 0 || h.samples < 0 || h.times < 0 || h.hidden_bytes < 0) {
    throw std::runtime_error(fmt::format("a step packet of rows {}, table {}, samples {}, times {}, hidden bytes {}",
                                         h.rows, h.table, h.samples, h.times, h.hidden_bytes));
  }
  std::size_t at = sizeof h;
  const std::size_t ints = static_cast<std::size_t>(3 * h.rows + h.table + h.samples);
  const std::size_t times_at = align8(at + ints * 4);
  const std::size_t hidden_at = times_at + static_cast<std::size_t>(h.times) * sizeof(double);
  if (in.size() != hidden_at + static_cast<std::size_t>(h.hidden_bytes)) {
    throw std::runtime_error(fmt::format("a step packet of {} bytes, where its header says {}", in.size(),
                                         hidden_at + static_cast<std::size_t>(h.hidden_bytes)));
  }
  auto take = [&](std::vector<std::int32_t>& v, std::int64_t n) {
    v.resize(static_cast<std::size_t>(n));
    if (!v.empty()) std::memcpy(v.data(), in.data() + at, v.size() * 4);  // (memcpy of null: UB even for 0 bytes)
    at += v.size() * 4;
  };
  r.rows = h.rows;
  take(r.tokens, h.rows);
  take(r.positions, h.rows);
  take(r.slots, h.rows);
  take(r.table, h.table);
  take(r.sample_rows, h.samples);
  times.resize(static_cast<std::size_t>(h.times));
  if (!times.empty()) std::memcpy(times.data(), in.data() + times_at, times.size() * sizeof(double));
  hidden_bytes = static_cast<std::size_t>(h.hidden_bytes);
  return in.data() + hidden_at;
}

template <typename T>
void write_input(Program& p, const char* name, const std::vector<T>& v) {
  Tensor& t = p.input(name);
  if (static_cast<std::size_t>(t.numel()) != v.size()) {
    throw std::runtime_error(fmt::format("the step's '{}' has {} values, its program {}", name, v.size(), t.numel()));
  }
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * sizeof(T));
}

// The group whose partial sums serve.tp_sum adds: the stage running on this thread.
thread_local TpGroup* current_group = nullptr;

struct TpScope {
  explicit TpScope(TpGroup* g) : before(current_group) { current_group = g; }
  ~TpScope() { current_group = before; }
  TpScope(const TpScope&) = delete;
  TpScope& operator=(const TpScope&) = delete;
  TpGroup* before;
};

void tp_sum_kernel(KernelContext& c) {
  const Tensor& in = *c.inputs[0];
  Tensor& out = *c.outputs[0];
  std::memcpy(out.raw(), in.raw(), in.nbytes());
  if (current_group == nullptr) throw std::runtime_error("serve.tp_sum ran outside a tensor-parallel stage");
  current_group->all_reduce(out);
}

}  // namespace

void register_tp_sum() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_op({.name = tp_sum_op,
                 .infer = [](const OpInputs& in) { return TensorType{in[0].shape(), in[0].dtype()}; },
                 .gradient = {},
                 .kernels = {{DeviceType::cpu, DType::f32, kernel_of(tp_sum_kernel)},
                             {DeviceType::cpu, DType::f64, kernel_of(tp_sum_kernel)}},
                 .elementwise = false});
  });
}

TpGroup::TpGroup(StageLink& link, std::vector<std::uint32_t> members, std::size_t me, std::chrono::milliseconds timeout)
    : link_(link), members_(std::move(members)), me_(me), timeout_(timeout) {
  if (me_ >= members_.size()) throw std::invalid_argument("TpGroup: this rank is not a member");
}

std::unique_ptr<TpGroup> TpGroup::of_stage(StageLink& link, std::int64_t stage, std::int64_t shard, std::int64_t tp,
                                           std::chrono::milliseconds timeout) {
  std::vector<std::uint32_t> members;
  for (std::int64_t t = 0; t < tp; ++t) members.push_back(static_cast<std::uint32_t>(stage * tp + t));
  return std::make_unique<TpGroup>(link, std::move(members), static_cast<std::size_t>(shard), timeout);
}

void TpGroup::all_reduce(Tensor& t) {
  if (t.dtype() != DType::f32 && t.dtype() != DType::f64) {
    throw std::runtime_error(fmt::format("serve.tp_sum: {} partial sums (f32 and f64 only)", name(t.dtype())));
  }
  const std::uint64_t round = ++round_;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::vector<std::byte>& mine = sent_[round % 2];
  mine.assign(static_cast<const std::byte*>(t.raw()), static_cast<const std::byte*>(t.raw()) + t.nbytes());
  for (std::size_t i = 0; i < members_.size(); ++i) {
    if (i != me_) link_.send(members_[i], StageLink::partial, round, mine);
  }
  // Every part in shard order, added in that order: every member gets the same bits.
  const auto n = static_cast<std::size_t>(t.numel());
  sum_.assign(n, 0.0);
  std::vector<std::byte> part;
  for (std::size_t i = 0; i < members_.size(); ++i) {
    const std::byte* bytes = mine.data();
    if (i != me_) {
      const std::uint32_t from = members_[i];
      part = link_
                 .receive([&](const StageLink::Packet& p) {
                   return p.from == from && p.kind == StageLink::partial && p.seq == round;
                 },
                          deadline, fmt::format("the partial sums of rank {} (tensor-parallel round {})", from, round))
                 .bytes;
      if (part.size() != t.nbytes()) {
        throw std::runtime_error(fmt::format("rank {} sent {} bytes of partial sums, not {}", from, part.size(), t.nbytes()));
      }
      bytes = part.data();
    }
    if (t.dtype() == DType::f32) {
      const auto* v = reinterpret_cast<const float*>(bytes);
      auto* acc = static_cast<float*>(t.raw());
      for (std::size_t k = 0; k < n; ++k) acc[k] = i == 0 ? v[k] : acc[k] + v[k];
    } else {
      const auto* v = reinterpret_cast<const double*>(bytes);
      auto* acc = static_cast<double*>(t.raw());
      for (std::size_t k = 0; k < n; ++k) acc[k] = i == 0 ? v[k] : acc[k] + v[k];
    }
  }
}

std::uint64_t ServeShape::hash(const DecodeModel& m, std::int64_t pp, std::int64_t tp) const {
  Hasher h;
  for (std::int64_t v : {static_cast<std::int64_t>(m.kind), m.vocab(), m.width(), m.layers(), m.kv_heads(),
                         m.head_dim(), m.context(), static_cast<std::int64_t>(m.dtype()), pp, tp, slots, blocks_per_slot,
                         block_size, cache_blocks}) {
    h.add(static_cast<std::uint64_t>(v));
  }
  for (std::int64_t b : buckets) h.add(static_cast<std::uint64_t>(b));
  return h.h;
}

ServeShape serve_shape(const DecodeModel& m, std::int64_t max_batch, std::int64_t max_batch_tokens,
                       std::int64_t block_size, std::int64_t kv_cache_bytes, std::int64_t cache_layers,
                       std::int64_t tp) {
  if (max_batch < 1 || max_batch_tokens < 1 || block_size < 1) {
    throw std::invalid_argument(fmt::format("--max-batch {}, --max-batch-tokens {} and --block-size {} must be >= 1",
                                            max_batch, max_batch_tokens, block_size));
  }
  if (max_batch > max_batch_tokens) {
    throw std::invalid_argument(fmt::format(
        "--max-batch {} is more than --max-batch-tokens {}: every running request needs a row in each step", max_batch,
        max_batch_tokens));
  }
  ServeShape s;
  s.slots = max_batch;
  s.block_size = block_size;
  s.blocks_per_slot = ceil_div(m.context(), block_size);
  if (tp < 1 || m.kv_heads() % tp != 0) {
    throw std::invalid_argument(fmt::format("--tp {}: the model's {} kv heads are not a multiple of it", tp, m.kv_heads()));
  }
  const std::int64_t block_bytes = cache_layers * 2 * block_size * (m.kv_heads() / tp) * m.head_dim() *
                                   static_cast<std::int64_t>(size_of(m.dtype()));
  s.cache_blocks = std::min(kv_cache_bytes / block_bytes, max_batch * s.blocks_per_slot);
  if (s.cache_blocks < s.blocks_per_slot) {
    throw std::invalid_argument(fmt::format(
        "the KV cache of {} bytes holds {} blocks of {} positions ({} bytes each over {} layers), fewer than one "
        "request of the whole context ({} positions) needs: give it at least {} bytes",
        kv_cache_bytes, kv_cache_bytes / block_bytes, block_size, block_bytes, cache_layers, m.context(),
        s.blocks_per_slot * block_bytes));
  }
  s.buckets = bucket_rows(max_batch_tokens);
  return s;
}

namespace {

// Shard `t` of `tp` of a whole weight, in the shape the stage's graph gives it: by columns
// (rows whole) or by rows; GPT-2's packed q, k, v ("c_attn") by each third.
Tensor shard_of(const std::string& name, const Tensor& full, const Shape& want, std::int64_t tp, std::int64_t t) {
  if (full.shape() == want) return full;
  const Shape& have = full.shape();
  const std::size_t es = size_of(full.dtype());
  const bool packed = name.ends_with("attn.c_attn.weight") || name.ends_with("attn.c_attn.bias");
  const std::int64_t chunks = packed ? 3 : 1;
  Tensor out = Tensor::empty(want, full.dtype());
  const auto* src = static_cast<const std::byte*>(full.raw());
  auto* dst = static_cast<std::byte*>(out.raw());
  const std::int64_t cols_have = have.size() == 2 ? have[1] : have[0], cols_want = want.size() == 2 ? want[1] : want[0];
  const std::int64_t rows = have.size() == 2 ? have[0] : 1;
  if (have.size() == want.size() && (have.size() == 1 || have[0] == want[0]) && cols_want * tp == cols_have) {
    // By columns: in each of the chunks, this shard's block.
    const std::int64_t per = cols_have / chunks, block = per / tp;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < chunks; ++c) {
        std::memcpy(dst + static_cast<std::size_t>((r * cols_want + c * block)) * es,
                    src + static_cast<std::size_t>(r * cols_have + c * per + t * block) * es,
                    static_cast<std::size_t>(block) * es);
      }
    }
    return out;
  }
  if (have.size() == 2 && want.size() == 2 && have[1] == want[1] && want[0] * tp == have[0] && !packed) {
    std::memcpy(dst, src + static_cast<std::size_t>(t * want[0] * have[1]) * es, out.nbytes());
    return out;
  }
  throw std::invalid_argument(fmt::format("'{}' is {}: no shard {} of {} of it has the stage's shape {}", name,
                                          full.describe(), t, tp, to_string(want)));
}

}  // namespace

std::shared_ptr<ParameterStore> stage_weights(const DecodeModel& m, std::pair<std::int64_t, std::int64_t> layers,
                                              const ParameterStore& all, std::int64_t tp, std::int64_t tp_rank) {
  Graph g;
  decode_step(g, m, StepShape{.first_layer = layers.first, .end_layer = layers.second, .tp = tp, .tp_rank = tp_rank});
  auto mine = std::make_shared<ParameterStore>();
  const auto wanted = ParameterStore::initialize(g);  // held: a range-for would not keep it alive
  for (const auto& [name, t] : wanted->values()) {
    if (!all.contains(name)) throw std::invalid_argument(fmt::format("the weights have no '{}'", name));
    mine->set(name, shard_of(name, all.at(name), t.shape(), tp, tp_rank));
  }
  return mine;
}

std::string check_weights(const DecodeModel& m, const ParameterStore& params) {
  Graph g;
  decode_step(g, m, StepShape{});
  for (int id = 0; id < g.size(); ++id) {
    const Node& n = g.node(id);
    if (n.op != "variable") continue;
    if (!params.contains(n.name)) return fmt::format("lack '{}'", n.name);
    const Tensor& t = params.at(n.name);
    if (t.shape() != n.shape || t.dtype() != n.dtype) {
      return fmt::format("'{}' is {}, the model's {}{}", n.name, t.describe(), name(n.dtype), to_string(n.shape));
    }
  }
  return {};
}

Stage::Stage(const DecodeModel& m, std::pair<std::int64_t, std::int64_t> layers, const ServeShape& shape,
             std::shared_ptr<const ParameterStore> params, std::int64_t tp, std::int64_t tp_rank, TpGroup* group)
    : model_(m), layers_(layers), group_(group) {
  if (tp > 1 && (group == nullptr || group->size() != static_cast<std::size_t>(tp))) {
    throw std::invalid_argument(fmt::format("a stage of tp {} needs its group of {} ranks", tp, tp));
  }
  const Shape cache{shape.cache_blocks, shape.block_size, m.kv_heads() / tp, m.head_dim()};
  std::map<std::string, Tensor> caches;  // one cache for every program
  // On a GPU the caches are device memory (the programs' kernels write them in place there),
  // zeroed once from a host block of zeros.
  cache_memory_ = Program::device_allocator(shape.device);
  std::unique_ptr<cuda::Stream> upload;
  Tensor zeros;
  if (cache_memory_) {
    upload = cuda::Stream::create(shape.device, "baton-serve KV cache");
    zeros = Tensor::zeros(cache, m.dtype());
  }
  for (std::int64_t l = layers.first; l < layers.second; ++l) {
    for (const char* kv : {"k", "v"}) {
      Tensor t;
      if (cache_memory_) {
        t = Tensor::empty(cache, m.dtype(), *cache_memory_);
        cuda::copy(t, zeros, *upload);
      } else {
        t = Tensor::zeros(cache, m.dtype());
      }
      cache_bytes_ += t.nbytes();
      caches[fmt::format("cache.{}.{}", kv, l)] = t;
      caches_.push_back(std::move(t));
    }
  }
  if (upload) upload->synchronize();
  for (std::int64_t rows : shape.buckets) {
    Bucket b;
    b.rows = rows;
    b.graph = std::make_unique<Graph>();
    Value out = decode_step(*b.graph, m,
                            StepShape{.rows = rows, .slots = shape.slots, .blocks_per_slot = shape.blocks_per_slot,
                                      .block_size = shape.block_size, .cache_blocks = shape.cache_blocks,
                                      .first_layer = layers.first, .end_layer = layers.second, .tp = tp,
                                      .tp_rank = tp_rank});
    try {
      b.program = std::make_unique<Program>(*b.graph, std::vector<Value>{out}, params, caches,
                                            KernelRegistry::with_builtin_kernels(), shape.device);
      b.program->use_graphs(shape.graphs);
    } catch (const GraphError& e) {
      throw std::invalid_argument(fmt::format("the weights do not fit the {} model: {}", m.name(), e.what()));
    }
    buffer_bytes_ += b.program->buffer_bytes();
    buckets_.push_back(std::move(b));
  }
}

const Tensor& Stage::run(const StepRows& rows, const void* hidden, std::size_t hidden_bytes) {
  auto it = std::find_if(buckets_.begin(), buckets_.end(), [&](const Bucket& b) { return b.rows == rows.rows; });
  if (it == buckets_.end()) throw std::runtime_error(fmt::format("no step program of {} rows", rows.rows));
  Program& p = *it->program;
  if (first()) {
    write_input(p, "tokens", rows.tokens);
  } else {
    Tensor& h = p.input("hidden");
    if (h.nbytes() != hidden_bytes) {
      throw std::runtime_error(
          fmt::format("the hidden state from the stage before has {} bytes, this stage takes {}", hidden_bytes, h.nbytes()));
    }
    if (hidden_bytes > 0) std::memcpy(h.raw(), hidden, hidden_bytes);
  }
  write_input(p, "positions", rows.positions);
  write_input(p, "slots", rows.slots);
  write_input(p, "block_table", rows.table);
  if (last()) write_input(p, "sample_rows", rows.sample_rows);
  const TpScope scope(group_);
  const auto began = std::chrono::steady_clock::now();
  const Tensor& out = p.run()[0];
  last_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  return out;
}

void Stage::set_params(std::shared_ptr<const ParameterStore> params) {
  try {
    for (Bucket& b : buckets_) b.program->set_params(params);
  } catch (const GraphError& e) {
    throw std::invalid_argument(fmt::format("the weights do not fit the {} model: {}", model_.name(), e.what()));
  }
}

LocalPipeline::LocalPipeline(const DecodeModel& m, std::int64_t pp, const ServeShape& shape,
                             std::shared_ptr<const ParameterStore> params) {
  for (const auto& layers : stage_layers(m.layers(), pp)) stages_.push_back(std::make_unique<Stage>(m, layers, shape, params));
}

void LocalPipeline::launch(const StepRows& rows) {
  const Tensor* out = nullptr;
  busy_.resize(stages_.size());
  for (std::size_t i = 0; i < stages_.size(); ++i) {
    out = &stages_[i]->run(rows, out ? out->raw() : nullptr, out ? out->nbytes() : 0);
    busy_[i] += stages_[i]->last_seconds();
  }
  out_ = out;
}

const Tensor& LocalPipeline::collect() {
  if (out_ == nullptr) throw std::logic_error("LocalPipeline::collect: no step launched");
  const Tensor* out = out_;
  out_ = nullptr;
  return *out;
}

void LocalPipeline::set_params(std::shared_ptr<const ParameterStore> params) {
  // Checked on every stage before any changes: a bad set leaves the old weights everywhere.
  for (auto& s : stages_) s->set_params(params);
}

std::size_t LocalPipeline::buffer_bytes() const {
  std::size_t n = 0;
  for (const auto& s : stages_) n += s->buffer_bytes();
  return n;
}

std::size_t LocalPipeline::cache_bytes() const {
  std::size_t n = 0;
  for (const auto& s : stages_) n += s->cache_bytes();
  return n;
}

std::string LocalPipeline::describe() const {
  return stages_.size() == 1 ? "one stage" : fmt::format("{} stages in this process", stages_.size());
}

// ---- StageLink ----

namespace {
struct Wire {
  std::uint32_t kind;
  std::uint32_t reserved;
  std::uint64_t seq;
  std::uint64_t bytes;
};
static_assert(sizeof(Wire) <= transport::Link::max_message);
// A payload's tag: its kind and number (a rank may have a step and a partial sum of the same
// number in flight to one peer), in the 48 bits UCX's tags leave: 40 for the number (a step adds
// 2 per layer to the partial sums' count: 10^12 steps before it wraps).
std::uint64_t tag_of(StageLink::Kind kind, std::uint64_t seq) {
  return (static_cast<std::uint64_t>(kind) << 40) | (seq & ((std::uint64_t{1} << 40) - 1));
}
}  // namespace

StageLink::StageLink(transport::Link& link) : link_(link) { link_.set_handler(this); }

void StageLink::send(std::uint32_t to, Kind kind, std::uint64_t seq, const std::vector<std::byte>& bytes) {
  {
    std::lock_guard lock(mutex_);
    if (!failure_.empty()) throw transport::TransportError(failure_);
  }
  const Wire w{kind, 0, seq, bytes.size()};
  link_.send(to, &w, sizeof w);
  if (!bytes.empty()) link_.send_payload(to, tag_of(kind, seq), bytes.data(), bytes.size());
}

void StageLink::on_message(std::uint32_t from_rank, const void* data, std::size_t size) {
  Wire w{};
  if (size != sizeof w) {
    on_link_error(fmt::format("rank {} sent a message of {} bytes, not a stage's ({})", from_rank, size, sizeof w));
    return;
  }
  std::memcpy(&w, data, sizeof w);
  Packet p{.from = from_rank, .kind = static_cast<Kind>(w.kind), .seq = w.seq, .bytes = {}};
  std::unique_lock lock(mutex_);
  if (w.bytes == 0) {
    inbox_.push_back(std::move(p));
    lock.unlock();
    ready_.notify_all();
    return;
  }
  const std::uint64_t cookie = next_cookie_++;
  Packet& slot = pending_[cookie] = std::move(p);
  slot.bytes.resize(w.bytes);
  void* dest = slot.bytes.data();
  lock.unlock();
  link_.receive_payload(from_rank, tag_of(static_cast<Kind>(w.kind), w.seq), dest, w.bytes, cookie);
}

void StageLink::on_payload(std::uint64_t cookie) {
  {
    std::lock_guard lock(mutex_);
    auto it = pending_.find(cookie);
    if (it == pending_.end()) return;
    inbox_.push_back(std::move(it->second));
    pending_.erase(it);
  }
  ready_.notify_all();
}

void StageLink::on_link_error(const std::string& reason) { abort(reason); }

void StageLink::abort(const std::string& reason) {
  {
    std::lock_guard lock(mutex_);
    if (failure_.empty()) failure_ = reason.empty() ? "the pipeline's link failed" : reason;
  }
  ready_.notify_all();
}

std::string StageLink::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

StageLink::Packet StageLink::receive(const std::function<bool(const Packet&)>& wanted,
                                     std::chrono::steady_clock::time_point deadline, const std::string& awaiting) {
  std::unique_lock lock(mutex_);
  // In slices of a second: a far deadline (a stage waits for the next request for hours) stays
  // clear of the clocks' overflow.
  for (;;) {
    if (!failure_.empty()) throw transport::TransportError(failure_);
    const auto it = std::find_if(inbox_.begin(), inbox_.end(), wanted);
    if (it != inbox_.end()) {
      Packet p = std::move(*it);
      inbox_.erase(it);
      return p;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) throw transport::TransportError(fmt::format("{} did not come in time", awaiting));
    ready_.wait_for(lock, std::min<std::chrono::steady_clock::duration>(deadline - now, std::chrono::seconds(1)));
  }
}

// ---- RankPipeline ----

RankPipeline::RankPipeline(std::unique_ptr<Stage> stage, std::int64_t pp, std::int64_t tp, StageLink& link,
                           const DecodeModel& m, std::int64_t samples, std::chrono::milliseconds step_timeout)
    : stage_(std::move(stage)), pp_(pp), tp_(tp), link_(link), model_(m), samples_(samples), step_timeout_(step_timeout) {
  if (!stage_->first() || pp_ * tp_ < 2) {
    throw std::invalid_argument("RankPipeline: rank 0 runs the first stage of a job of 2 ranks or more");
  }
}

void RankPipeline::launch(const StepRows& rows) {
  if (static_cast<std::int64_t>(flights_.size()) >= pp_) {
    throw std::logic_error(fmt::format("RankPipeline: a step launched with {} in flight already", flights_.size()));
  }
  const std::uint64_t seq = ++seq_;
  flights_.push_back({seq, std::min(rows.rows, samples_), std::chrono::steady_clock::now() + step_timeout_, 0.0});
  const auto ring = static_cast<std::size_t>(seq % static_cast<std::uint64_t>(pp_));
  step_out_.resize(static_cast<std::size_t>(pp_));
  hidden_out_.resize(static_cast<std::size_t>(pp_));
  if (tp_ > 1) {
    // Stage 0's other shards need the step's rows before this one's first partial sum.
    pack_step(step_out_[ring], rows, {}, nullptr, 0);
    for (std::int64_t t = 1; t < tp_; ++t) link_.send(static_cast<std::uint32_t>(t), StageLink::step, seq, step_out_[ring]);
  }
  const Tensor& y = stage_->run(rows, nullptr, 0);
  flights_.back().first_seconds = stage_->last_seconds();
  if (stage_->last()) {  // pp 1: the head ran here (whole on every shard)
    local_ = &y;
    return;
  }
  pack_step(hidden_out_[ring], rows, {stage_->last_seconds()}, y.raw(), y.nbytes());
  link_.send(static_cast<std::uint32_t>(tp_), StageLink::step, seq, hidden_out_[ring]);  // stage 1, shard 0
}

const Tensor& RankPipeline::collect() {
  if (flights_.empty()) throw std::logic_error("RankPipeline::collect: no step launched");
  const Flight f = flights_.front();
  flights_.pop_front();
  busy_.resize(static_cast<std::size_t>(pp_));
  if (stage_->last()) {
    busy_[0] += f.first_seconds;
    const Tensor* y = local_;
    local_ = nullptr;
    return *y;
  }
  const auto last = static_cast<std::uint32_t>((pp_ - 1) * tp_);
  StageLink::Packet p = link_.receive(
      [&](const StageLink::Packet& q) { return q.from == last && q.kind == StageLink::logits; }, f.deadline,
      fmt::format("the logits of step {} from rank {} (--step-timeout {} s)", f.seq, last,
                  std::chrono::duration<double>(step_timeout_).count()));
  if (p.seq != f.seq) {
    throw std::runtime_error(fmt::format("rank {} sent the logits of step {} where step {}'s were due", p.from, p.seq, f.seq));
  }
  if (logits_.numel() != f.samples * model_.vocab()) logits_ = Tensor::empty({f.samples, model_.vocab()}, model_.dtype());
  // The logits, then (8-aligned) every stage's seconds.
  const std::size_t times_at = align8(logits_.nbytes());
  if (p.bytes.size() != times_at + busy_.size() * sizeof(double)) {
    throw std::runtime_error(fmt::format("the logits of step {} came in {} bytes, not {}", f.seq, p.bytes.size(),
                                         times_at + busy_.size() * sizeof(double)));
  }
  std::memcpy(logits_.raw(), p.bytes.data(), logits_.nbytes());
  for (std::size_t i = 0; i < busy_.size(); ++i) {
    double t = 0;
    std::memcpy(&t, p.bytes.data() + times_at + i * sizeof(double), sizeof t);
    busy_[i] += t;
  }
  return logits_;
}

void RankPipeline::set_params(std::shared_ptr<const ParameterStore> params) {
  (void)params;
  throw std::invalid_argument(swap_refused());
}

std::string RankPipeline::swap_refused() const {
  return "new weights for a pipeline across ranks are not supported yet (--watch serves from one rank)";
}

std::string RankPipeline::describe() const {
  return tp_ == 1 ? fmt::format("{} stages on {} ranks", pp_, pp_)
                  : fmt::format("{} stage{} of {} tensor-parallel shards on {} ranks", pp_, pp_ == 1 ? "" : "s", tp_,
                                pp_ * tp_);
}

void stop_stages(StageLink& link, std::int64_t world_size) {
  if (!link.failure().empty()) return;
  try {
    for (std::int64_t r = 1; r < world_size; ++r) link.send(static_cast<std::uint32_t>(r), StageLink::stop, 0, {});
  } catch (const std::exception&) {
    // The job is ending anyway; the control plane tells the others.
  }
}

void serve_stage(Stage& stage, StageLink& link, std::uint32_t rank, std::int64_t pp, std::int64_t tp) {
  if (rank == 0 || static_cast<std::int64_t>(rank) >= pp * tp) {
    throw std::invalid_argument(fmt::format("serve_stage: rank {} of {} runs no later stage", rank, pp * tp));
  }
  const std::int64_t s = rank / tp, t = rank % tp;
  const auto from = static_cast<std::uint32_t>(s == 0 ? 0 : (s - 1) * tp + t);
  StepRows rows;
  std::vector<double> times;  // the seconds of the stages so far, this one's last
  // What this rank sent, until the next stage (or rank 0) has pulled it: one buffer per step in
  // flight (pp at most; the step pp later comes only once this one's logits reached rank 0).
  std::vector<std::vector<std::byte>> outs(static_cast<std::size_t>(pp));
  for (;;) {
    // Idle for as long as no request comes: the control plane's heartbeats and aborts, not a
    // deadline, tell a dead job from a quiet one.
    StageLink::Packet p = link.receive(
        [&](const StageLink::Packet& q) {
          return (q.kind == StageLink::stop && q.from == 0) || (q.kind == StageLink::step && q.from == from);
        },
        std::chrono::steady_clock::now() + std::chrono::hours(24 * 365), "the next step");
    if (p.kind == StageLink::stop) return;
    std::size_t hidden_bytes = 0;
    const std::byte* hidden = unpack_step(p.bytes, rows, times, hidden_bytes);
    const Tensor& y = stage.run(rows, s == 0 ? nullptr : hidden, s == 0 ? 0 : hidden_bytes);
    times.push_back(stage.last_seconds());  // stage 0's other shards: from an empty list
    std::vector<std::byte>& out = outs[static_cast<std::size_t>(p.seq % static_cast<std::uint64_t>(pp))];
    if (stage.last()) {
      if (t != 0) continue;  // shard 0 answers for the stage
      out.assign(static_cast<const std::byte*>(y.raw()), static_cast<const std::byte*>(y.raw()) + y.nbytes());
      out.resize(align8(out.size()));
      put_vector(out, times);
      link.send(0, StageLink::logits, p.seq, out);
    } else {
      pack_step(out, rows, times, y.raw(), y.nbytes());
      link.send(static_cast<std::uint32_t>((s + 1) * tp + t), StageLink::step, p.seq, out);
    }
  }
}

}  // namespace baton::serve
