// TraceObserver: one rank's recording. A thread of its own drains the workers' activity rings
// and samples the registers a few times a second, off the hot path; records go into a
// TraceRecorder (kept here) or onto the telemetry channel (TraceStream).
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include <boost/json.hpp>
#include <fmt/format.h>

#include "baton/observe/trace.h"
#include "baton/transport/control.h"

namespace baton::observe {

namespace {

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return {};
  return name;
}

}  // namespace

/// A drain this large (an eighth of a worker's ring) means the rings fill fast.
constexpr std::size_t busy_drain = 8192;
constexpr std::chrono::milliseconds busy_period{5};

struct TraceObserver::Impl {
  TraceOptions options;
  bool keep = false;
  TraceRecorder recorder;

  std::mutex mutex;  // the drain thread, consume() and on_finish take turns
  std::condition_variable wake;
  bool stopping = false;
  std::thread thread;

  Runtime* runtime = nullptr;
  transport::ControlClient* control = nullptr;
  TraceRank rank;
  std::unordered_map<std::string, RegisterIndex> register_index;
  std::vector<std::int32_t> last_in_use;  // by register; -1: never sampled
  std::vector<ActRecord> batch;
  std::size_t last_drained = 0;
  std::vector<OccupancySample> samples;

  // What is being recorded: the whole run, or a session the server asked for.
  bool recording = false;
  std::uint32_t session = 0;
  std::chrono::steady_clock::time_point session_until{};
  std::optional<std::pair<std::uint32_t, std::chrono::milliseconds>> requested;
  std::unique_ptr<TraceStream> stream;  // null: keep
  std::atomic<std::uint64_t> recorded{0};
  std::atomic<bool> recording_now{false};  // `recording`, for other threads
  std::uint64_t over_cap = 0;

  bool streaming() const { return !keep && (control != nullptr || options.send); }

  void start_recording(std::uint32_t id) {
    runtime->set_activity_log(true);  // first: it throws if the runtime has no rings
    session = id;
    recording = true;
    recording_now.store(true);
    std::fill(last_in_use.begin(), last_in_use.end(), -1);
    if (streaming()) {
      TraceStream::Send send = options.send;
      if (!send) send = [c = control](const std::string& body) { c->send_telemetry(trace_kind, body); };
      stream = std::make_unique<TraceStream>(std::move(send), id, transport::max_telemetry_bytes - 1024);
      stream->begin(rank, runtime->plan(), control != nullptr ? control->clock_rtt_ns() : 0);
    }
  }

  void take(std::span<const ActRecord> records) {
    if (!recording || records.empty()) return;
    if (!streaming()) {
      recorder.add_acts(rank.rank, records);
    } else {
      // The cap holds on this side too, so a long run does not flood the launcher.
      const std::uint64_t sent = recorded.load(std::memory_order_relaxed);
      const std::size_t room = sent >= options.limits.max_events ? 0 : options.limits.max_events - sent;
      const std::size_t n = std::min(room, records.size());
      stream->acts(records.first(n));
      over_cap += records.size() - n;
    }
    recorded.fetch_add(records.size(), std::memory_order_relaxed);
  }

  void sample() {
    samples.clear();
    const std::uint64_t now = steady_ns();
    for (const RegisterMetrics& r : runtime->snapshot().registers) {
      auto it = register_index.find(r.name);
      if (it == register_index.end()) continue;
      const auto in_use = static_cast<std::int32_t>(r.written - r.freed);
      std::int32_t& last = last_in_use[it->second];
      if (in_use == last) continue;  // a counter holds its value until the next sample
      last = in_use;
      samples.push_back({now, it->second, in_use});
    }
    if (samples.empty()) return;
    if (streaming()) {
      stream->occupancy(samples);
    } else {
      recorder.add_occupancy(rank.rank, samples);
    }
  }

  /// The drain thread's turn (and on_finish's last one). Mutex held.
  void tick() {
    if (requested && !recording) {
      start_recording(requested->first);
      session_until = std::chrono::steady_clock::now() + requested->second;
    }
    requested.reset();
    if (options.drain) {
      batch.clear();
      last_drained = runtime->drain_activity(batch);
      take(batch);
    }
    if (recording) sample();
    if (recording && !options.whole_run && std::chrono::steady_clock::now() >= session_until) end_recording({});
  }

  void end_recording(const std::string& error) {
    if (!recording) return;
    if (!options.whole_run && options.drain) {  // else the rings' reader needs the log on
      runtime->set_activity_log(false);
      {  // what was logged before the switch
        batch.clear();
        runtime->drain_activity(batch);
        take(batch);
      }
    }
    recording = false;
    recording_now.store(false);
    const std::uint64_t dropped = runtime->activity_dropped() + over_cap;
    if (streaming()) {
      stream->end(dropped, error);
      stream.reset();
    } else {
      rank.dropped = dropped;
      rank.finished = true;
      rank.error = error;
      recorder.add_rank(rank);
    }
  }

  void loop() {
    std::unique_lock lock(mutex);
    while (!stopping) {
      // Tiny acts (a few microseconds) fill a 64 Ki ring within the period: come back sooner
      // while the last drain was large, rather than lose records.
      const auto wait = last_drained >= busy_drain ? std::min<std::chrono::milliseconds>(options.period, busy_period)
                                                   : options.period;
      wake.wait_for(lock, wait, [&] { return stopping || requested.has_value(); });
      if (stopping) break;
      try {
        tick();
      } catch (const std::exception& e) {
        // Tracing must not end the run: say why it stopped and stop recording.
        fmt::print(stderr, "baton: trace recording stopped on rank {}: {}\n", rank.rank, e.what());
        recording = false;
        recording_now.store(false);
        stream.reset();
      }
    }
  }
};

TraceObserver::TraceObserver(TraceOptions options, bool keep) : impl_(std::make_unique<Impl>()) {
  impl_->options = options;
  impl_->keep = keep;
  impl_->recorder = TraceRecorder(options.limits);
}

TraceObserver::~TraceObserver() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void TraceObserver::on_start(Runtime& runtime, transport::ControlClient* control) {
  Impl& s = *impl_;
  std::lock_guard lock(s.mutex);
  s.runtime = &runtime;
  s.control = control;
  const Plan& plan = runtime.plan();
  // Which rank this runtime plays: its snapshot lists the actors it instantiated.
  const MetricsSnapshot first = runtime.snapshot();
  s.rank.rank = first.actors.empty() ? 0 : first.actors.front().where.rank;
  s.rank.host = host_name();
  s.rank.workers = runtime.worker_names();
  s.rank.clock_offset_ns = control != nullptr ? control->clock_offset_ns() : 0;
  s.rank.clock_uncertainty_ns = control != nullptr ? control->clock_rtt_ns() / 2 : 0;
  if (s.keep) {  // one file per rank: its own clock
    s.rank.clock_offset_ns = 0;
    s.rank.clock_uncertainty_ns = 0;
  }
  for (std::size_t r = 0; r < plan.registers.size(); ++r) {
    s.register_index.emplace(plan.registers[r].name, static_cast<RegisterIndex>(r));
  }
  s.last_in_use.assign(plan.registers.size(), -1);
  if (!s.streaming()) {
    s.recorder.add_plan(plan);
    s.recorder.add_rank(s.rank);
  }
  try {
    if (s.options.whole_run) {
      s.start_recording(0);
    } else if (s.options.drain) {  // else the rings' reader (the dashboard) needs the log on
      runtime.set_activity_log(false);
    }
  } catch (const std::logic_error& e) {
    throw std::logic_error(fmt::format("tracing needs the activity log: set JobSettings::runtime.activity_log ({})", e.what()));
  }
  s.stopping = false;
  s.thread = std::thread([this] { impl_->loop(); });
}

void TraceObserver::on_finish(Runtime& runtime, const std::string& error) {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    s.stopping = true;
  }
  s.wake.notify_all();
  if (s.thread.joinable()) s.thread.join();
  std::lock_guard lock(s.mutex);
  if (s.runtime != &runtime) return;
  try {
    if (s.recording) {
      if (s.options.drain) {
        s.batch.clear();
        runtime.drain_activity(s.batch);
        s.take(s.batch);
      }
      s.sample();
    }
    s.end_recording(error);
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton: the end of the trace was lost on rank {}: {}\n", s.rank.rank, e.what());
  }
  s.runtime = nullptr;
  s.control = nullptr;
}

void TraceObserver::on_command(const std::string& kind, const std::string& body) {
  if (kind != trace_kind) return;
  std::uint32_t session = 0;
  double seconds = 0;
  try {
    const auto o = boost::json::parse(body).as_object();
    session = o.at("session").to_number<std::uint32_t>();
    seconds = o.at("seconds").to_number<double>();
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton: ignored a trace command '{}': {}\n", body, e.what());
    return;
  }
  if (!(seconds > 0) || seconds > 3600) return;
  {
    std::lock_guard lock(impl_->mutex);
    if (impl_->options.whole_run || impl_->recording) return;  // already recording
    impl_->requested = {session, std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000))};
  }
  impl_->wake.notify_all();
}

void TraceObserver::consume(const std::vector<ActRecord>& records, const Runtime& runtime) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->runtime != &runtime) return;
  impl_->take(records);
}

const TraceRecorder& TraceObserver::recorder() const { return impl_->recorder; }

std::uint64_t TraceObserver::recorded() const { return impl_->recorded.load(std::memory_order_relaxed); }

bool TraceObserver::recording() const { return impl_->recording_now.load(); }

}  // namespace baton::observe
