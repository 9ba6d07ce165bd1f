// The rank-side collector: samples the runtime's counters and drains its activity log on its
// own thread, and ships both as dashboard telemetry (telemetry.h).
#include "baton/observe/collector.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include <boost/json.hpp>
#include <fmt/format.h>

#include "baton/actors/runtime.h"
#include "baton/observe/job_model.h"
#include "baton/transport/control.h"

namespace baton::observe {

namespace json = boost::json;

namespace {

/// Bodies stay well under the channel's limit: the header fields and the brackets around the
/// entries need a little room too.
constexpr std::size_t body_budget = transport::max_telemetry_bytes - 4096;

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

/// Packs serialized entries into as few bodies as fit the budget: each body is
/// `{<header>,"part":k,"parts":n,"<field>":[entries...]}`. An empty list still makes one body
/// (the header alone carries news: the sample's time).
std::vector<std::string> split_bodies(const std::string& header, const std::string& field,
                                      const std::vector<std::string>& entries) {
  std::vector<std::vector<const std::string*>> groups(1);
  std::size_t size = header.size() + field.size() + 64;
  for (const auto& e : entries) {
    if (size + e.size() + 1 > body_budget && !groups.back().empty()) {
      groups.emplace_back();
      size = header.size() + field.size() + 64;
    }
    groups.back().push_back(&e);
    size += e.size() + 1;
  }
  std::vector<std::string> bodies;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::string body = "{" + header;
    body += fmt::format(",\"part\":{},\"parts\":{},\"{}\":[", g, groups.size(), field);
    for (std::size_t i = 0; i < groups[g].size(); ++i) {
      if (i) body += ',';
      body += *groups[g][i];
    }
    body += "]}";
    bodies.push_back(std::move(body));
  }
  return bodies;
}

/// The timeline's row for an actor's acts: 0 forward, 1 backward, 2 a gradient all-reduce's
/// (collectives.h: attribute "allreduce", the loss's left out); -1 none.
int phase_of(const ActorDesc& a) {
  if (a.role == ActorRole::forward) return 0;
  if (a.role == ActorRole::backward) return 1;
  if (a.role == ActorRole::collective) {
    const std::string group = a.attrs.get_string("allreduce", "");
    return group.empty() || group == "loss" ? -1 : 2;
  }
  return -1;
}

}  // namespace

struct Collector::Impl {
  CollectorSettings settings;
  std::vector<TelemetrySink> sinks;
  std::vector<ActivitySink> activity_sinks;
  std::vector<std::function<void()>> hooks;

  std::mutex steps_mutex;
  std::vector<StepScalars> pending_steps;
  StepScalars last_step;

  // Set by on_start, read by the collector thread.
  Runtime* runtime = nullptr;
  transport::ControlClient* control = nullptr;  // during the run only
  std::uint32_t rank = 0;
  std::int64_t clock_offset_ns = 0;
  std::vector<ActorIndex> local_actors;  // snapshot order -> plan index
  std::uint64_t seq = 0;
  std::atomic<std::uint64_t> samples{0};
  std::vector<ActRecord> records;
  using BoxKey = std::tuple<std::int32_t, std::uint8_t, int, std::int64_t>;  // stage, device, phase, piece
  std::map<BoxKey, std::pair<std::uint64_t, std::uint64_t>> boxes;           // folded since the last sample
  std::vector<std::int8_t> phases;  // phase_of each actor of the plan, made at the first drain

  std::mutex stop_mutex;
  std::condition_variable stop_cv;
  bool stopping = false;
  std::thread thread;

  void send(std::string_view kind, const std::string& body) {
    const std::string k(kind);
    if (control != nullptr) {
      try {
        control->send_telemetry(k, body);
      } catch (const std::exception&) {
      }
    }
    for (const auto& sink : sinks) {
      try {
        sink(k, body);
      } catch (const std::exception&) {
        // A closed channel loses a sample; the next one carries the cumulative counters.
      }
    }
  }

  void send_hello() {
    const Plan& plan = runtime->plan();
    std::uint32_t world = 1;
    for (const auto& a : plan.actors) world = std::max<std::uint32_t>(world, a.where.rank + 1u);
    json::object o;
    o["rank"] = rank;
    o["host"] = host_name();
    o["world_size"] = world;
    o["plan_hash"] = fmt::format("{:016x}", plan.hash());
    json::array workers;
    for (const auto& w : runtime->worker_names()) workers.emplace_back(w);
    o["workers"] = std::move(workers);
    o["actors"] = local_actors.size();
    send(kind::hello, json::serialize(o));
  }

  /// Every rank compiled the same plan (the rendezvous server checked the hash): rank 0 sends it.
  void send_plan() {
    const Plan& plan = runtime->plan();
    std::vector<std::string> entries;
    for (std::size_t i = 0; i < plan.actors.size(); ++i) {
      const ActorDesc& a = plan.actors[i];
      json::object o;
      o["t"] = "a";
      o["i"] = i;
      o["name"] = a.name;
      o["kind"] = std::string(name(a.kind));
      o["op"] = a.op;
      o["role"] = std::string(name(a.role));
      o["stage"] = a.stage;
      o["rank"] = a.where.rank;
      o["device"] = a.where.device.str();
      o["device_code"] = a.where.device.code();
      o["stream"] = a.where.stream;
      json::array inputs;
      for (const auto& in : a.inputs) inputs.emplace_back(json::array{in.reg, in.delay});
      o["inputs"] = std::move(inputs);
      json::array outputs;
      for (RegisterIndex r : a.outputs) outputs.emplace_back(r);
      o["outputs"] = std::move(outputs);
      entries.push_back(json::serialize(o));
    }
    for (std::size_t i = 0; i < plan.registers.size(); ++i) {
      const RegisterDesc& r = plan.registers[i];
      json::object o;
      o["t"] = "r";
      o["i"] = i;
      o["name"] = r.name;
      o["slots"] = r.slots;
      o["bytes"] = static_cast<std::uint64_t>(numel(r.shape)) * size_of(r.dtype);
      o["shape"] = to_string(r.shape);
      o["dtype"] = std::string(name(r.dtype));
      o["producer"] = r.producer == no_actor ? -1 : static_cast<std::int64_t>(r.producer);
      json::array consumers;
      for (ActorIndex c : r.consumers) consumers.emplace_back(c);
      o["consumers"] = std::move(consumers);
      entries.push_back(json::serialize(o));
    }
    const std::string header = fmt::format("\"hash\":\"{:016x}\",\"actors\":{},\"registers\":{}", plan.hash(),
                                           plan.actors.size(), plan.registers.size());
    for (const auto& body : split_bodies(header, "entries", entries)) send(kind::plan, body);
  }

  void send_steps() {
    std::vector<StepScalars> steps;
    {
      std::lock_guard lock(steps_mutex);
      steps.swap(pending_steps);
    }
    if (steps.empty()) return;
    if (steps.size() > settings.max_steps_per_sample) {
      steps.erase(steps.begin(), steps.end() - static_cast<std::ptrdiff_t>(settings.max_steps_per_sample));
    }
    std::vector<std::string> entries;
    entries.reserve(steps.size());
    for (const auto& s : steps) {
      entries.push_back(json::serialize(json::array{s.step, s.loss, s.lr, s.samples}));
    }
    for (const auto& body : split_bodies("\"kind\":\"steps\"", "steps", entries)) send(kind::steps, body);
  }

  void send_metrics() {
    const MetricsSnapshot snap = runtime->snapshot();
    const Plan& plan = runtime->plan();
    std::vector<std::string> entries;
    entries.reserve(snap.actors.size() + snap.registers.size());
    std::size_t reg_k = 0;
    for (std::size_t k = 0; k < snap.actors.size() && k < local_actors.size(); ++k) {
      const ActorMetrics& m = snap.actors[k];
      const ActorIndex i = local_actors[k];
      entries.push_back(json::serialize(json::array{"a", i, m.acts, m.bytes_in, m.bytes_out, m.busy_s, m.starved_s,
                                                    m.backpressured_s, m.transferring_s, m.kernel_s,
                                                    static_cast<int>(m.activity)}));
      // The snapshot lists each actor's outputs in the plan's order, after all actors.
      for (RegisterIndex r : plan.actors[i].outputs) {
        if (reg_k >= snap.registers.size()) break;
        const RegisterMetrics& rm = snap.registers[reg_k++];
        entries.push_back(
            json::serialize(json::array{"r", r, rm.written, rm.freed, rm.max_outstanding, rm.slots}));
      }
    }
    StepScalars last;
    {
      std::lock_guard lock(steps_mutex);
      last = last_step;
    }
    const std::string header = fmt::format(
        "\"seq\":{},\"elapsed_s\":{},\"dropped\":{},\"step\":{},\"samples\":{},\"loss\":{},\"lr\":{}", seq++,
        snap.elapsed_s, runtime->activity_dropped(), last.step, last.samples,
        json::serialize(json::value(last.loss)), json::serialize(json::value(last.lr)));
    for (const auto& body : split_bodies(header, "entries", entries)) send(kind::metrics, body);
  }

  /// Drains the activity log, hands the records to the sinks, and folds them into the pipeline
  /// timeline's boxes: one per (stage, device, forward or backward, micro-batch), and with data
  /// parallelism one per (stage, device, step) for the gradients' all-reduces (phase 2), each
  /// spanning its first act to its last. Runs more often than a sample, so that the workers' rings (64 Ki
  /// records) do not fill up between two: a full ring drops the newest records.
  void drain() {
    records.clear();
    runtime->drain_activity(records);
    if (records.empty()) return;
    for (const auto& s : activity_sinks) {
      try {
        s(records, *runtime);
      } catch (const std::exception&) {
        // A consumer's failure is its own; the dashboard goes on.
      }
    }
    if (!settings.timeline) return;
    const Plan& plan = runtime->plan();
    if (phases.size() != plan.actors.size()) {
      phases.clear();
      for (const ActorDesc& a : plan.actors) phases.push_back(static_cast<std::int8_t>(phase_of(a)));
    }
    for (const ActRecord& r : records) {
      if (r.actor >= plan.actors.size()) continue;
      const ActorDesc& a = plan.actors[r.actor];
      const int phase = phases[r.actor];
      if (phase < 0) continue;
      auto [it, fresh] =
          boxes.try_emplace(BoxKey{std::max(a.stage, 0), a.where.device.code(), phase, r.piece}, r.start_ns, r.end_ns);
      if (!fresh) {
        it->second.first = std::min(it->second.first, r.start_ns);
        it->second.second = std::max(it->second.second, r.end_ns);
      }
    }
  }

  /// Sends the boxes folded since the last sample (the newest, if there are too many). A box cut
  /// by a sample's boundary goes out twice, in part; the model merges the parts.
  void send_timeline() {
    if (boxes.empty()) return;
    std::vector<std::pair<BoxKey, std::pair<std::uint64_t, std::uint64_t>>> list(boxes.begin(), boxes.end());
    boxes.clear();
    if (list.size() > settings.max_boxes_per_sample) {
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.second.second < b.second.second; });
      list.erase(list.begin(), list.end() - static_cast<std::ptrdiff_t>(settings.max_boxes_per_sample));
    }
    std::vector<std::string> entries;
    entries.reserve(list.size());
    for (const auto& [key, span] : list) {
      const auto& [stage, device, phase, piece] = key;
      entries.push_back(json::serialize(json::array{stage, device, phase, piece,
                                                    static_cast<std::int64_t>(span.first) + clock_offset_ns,
                                                    static_cast<std::int64_t>(span.second) + clock_offset_ns}));
    }
    for (const auto& body : split_bodies("\"kind\":\"timeline\"", "boxes", entries)) send(kind::timeline, body);
  }

  void sample() {
    for (const auto& hook : hooks) {
      try {
        hook();
      } catch (const std::exception&) {
      }
    }
    drain();
    send_timeline();
    send_steps();
    send_metrics();
    samples.fetch_add(1, std::memory_order_relaxed);
  }

  void loop() {
    using Clock = std::chrono::steady_clock;
    const auto drain_every = std::min(settings.drain_interval, settings.interval);
    auto next_sample = Clock::now() + settings.interval;
    std::unique_lock lock(stop_mutex);
    while (!stopping) {
      const auto wake = std::min(Clock::now() + drain_every, next_sample);
      if (stop_cv.wait_until(lock, wake, [&] { return stopping; })) break;
      lock.unlock();
      if (Clock::now() >= next_sample) {
        sample();
        // Behind (a slow sample, a descheduled thread): the next one a full interval on.
        next_sample += settings.interval;
        if (next_sample <= Clock::now()) next_sample = Clock::now() + settings.interval;
      } else {
        drain();
      }
      lock.lock();
    }
  }
};

Collector::Collector(CollectorSettings settings) : impl_(std::make_unique<Impl>()) {
  impl_->settings = settings;
}

Collector::~Collector() {
  {
    std::lock_guard lock(impl_->stop_mutex);
    impl_->stopping = true;
  }
  impl_->stop_cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void Collector::feed(JobModel& model) {
  impl_->sinks.push_back([m = &model, this](const std::string& kind, const std::string& body) {
    m->ingest(impl_->rank, kind, body);
  });
}

void Collector::feed(TelemetrySink sink) { impl_->sinks.push_back(std::move(sink)); }

void Collector::add_activity_sink(ActivitySink sink) { impl_->activity_sinks.push_back(std::move(sink)); }

void Collector::before_sample(std::function<void()> hook) { impl_->hooks.push_back(std::move(hook)); }

void Collector::record_step(const StepScalars& step) {
  std::lock_guard lock(impl_->steps_mutex);
  impl_->pending_steps.push_back(step);
  // Nobody drains before the run starts, or if the collector never started: stay bounded.
  if (impl_->pending_steps.size() > 4 * impl_->settings.max_steps_per_sample) {
    impl_->pending_steps.erase(impl_->pending_steps.begin(),
                               impl_->pending_steps.begin() +
                                   static_cast<std::ptrdiff_t>(impl_->settings.max_steps_per_sample));
  }
  if (step.step >= impl_->last_step.step) impl_->last_step = step;
}

void Collector::on_start(Runtime& runtime, transport::ControlClient* control) {
  Impl& s = *impl_;
  s.runtime = &runtime;
  const Plan& plan = runtime.plan();
  // The runtime's rank: the actors it instantiated are the plan's actors on it, in order.
  std::uint32_t rank = 0;
  if (control != nullptr) {
    s.clock_offset_ns = control->clock_offset_ns();
    if (s.settings.send_to_control) s.control = control;
  }
  // Which rank this runtime plays: its snapshot names its actors.
  const MetricsSnapshot first = runtime.snapshot();
  if (!first.actors.empty()) rank = first.actors.front().where.rank;
  s.rank = rank;
  s.local_actors = plan.actors_on(static_cast<std::uint16_t>(rank));
  s.send_hello();
  if (rank == 0) s.send_plan();
  {
    std::lock_guard lock(s.stop_mutex);
    s.stopping = false;
  }
  s.thread = std::thread([&s] { s.loop(); });
}

void Collector::on_finish(Runtime& runtime, const std::string& error) {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.stop_mutex);
    s.stopping = true;
  }
  s.stop_cv.notify_all();
  if (s.thread.joinable()) s.thread.join();
  if (s.runtime != &runtime) return;
  // The last counters (every actor retired) and the last steps.
  s.sample();
  json::object o;
  o["error"] = error;
  s.send(kind::finish, json::serialize(o));
  s.control = nullptr;
  s.runtime = nullptr;
}

void Collector::flush() {
  if (impl_->runtime == nullptr) impl_->send_steps();
}

std::uint64_t Collector::samples() const { return impl_->samples.load(std::memory_order_relaxed); }

}  // namespace baton::observe
