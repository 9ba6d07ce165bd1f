#pragma once
/// Traces of a run in the Chrome trace-event format, which chrome://tracing and Perfetto
/// (ui.perfetto.dev) open: one process per rank (pid rank + 1: Perfetto treats pid 0 as the
/// kernel's idle task), one thread per worker (tid worker + 1), a slice per act (ph X,
/// named after the actor, its role as category), register occupancy as counters (ph C), and
/// arrows (flow events, ph s/f) for the requests that cross from one worker or rank to another.
/// Transfer actors' pulls overlap their worker's acts and one another, and a track must nest:
/// they go on lanes beside their worker ("cpu:0/s0 pulls", tid 1000 * lane + worker + 1).
///
/// The hot path only appends to the workers' lock-free activity rings (activity.h); a drain
/// thread empties them a few times a second into a TraceRecorder (a job of one rank) or onto
/// the telemetry channel, where the launcher's TraceCollector merges the ranks on the rendezvous
/// server's clock. The file is written at the end, to local disk.
///
///   baton::observe::TraceObserver tracer;                 // keeps the records here
///   baton::JobSettings js;
///   js.runtime.activity_log = true;
///   js.observer = &tracer;
///   baton::run_job(plan, kernels, env, js);
///   tracer.recorder().write_file("run.trace.json");
///
/// Arrows are derived, not recorded: act k of a consumer reads piece k / ratio - delay of each
/// input (ratio: a repeat's group), and piece q of a register was written by its producer's act
/// q (an accumulate's act q * group + group - 1). So the plan and the act records say which act
/// requested which, and the hot path logs nothing more than one record per act.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "baton/actors/activity.h"
#include "baton/actors/job.h"
#include "baton/actors/plan.h"

namespace baton::transport {
struct Telemetry;
}

namespace baton::observe {

/// The environment variable baton-launch --trace sets for its ranks ("1"): stream the run's
/// records to the launcher as "trace" telemetry.
inline constexpr const char* trace_env = "BATON_TRACE";
/// The telemetry kind (and server command) of traces.
inline constexpr const char* trace_kind = "trace";

/// Bounds on one trace.
struct TraceLimits {
  /// Events in the file at most (slices, counter samples, arrows; names and metadata not
  /// counted): about 150 bytes each in the file and 40 in memory. The first ones are kept;
  /// the file's metadata ("otherData") says how many of each kind were left out.
  std::size_t max_events = 2'000'000;
};

/// What a trace says of one rank.
struct TraceRank {
  std::uint32_t rank = 0;
  std::string host;
  /// Runtime::worker_names(): ActRecord::worker indexes it. One thread track each.
  std::vector<std::string> workers;
  /// Added to this rank's times to put them on the trace's clock (the rendezvous server's
  /// steady clock), and how far off the result may be (half the round trip the offset was
  /// measured with; 0 where the rank shares the server's clock).
  std::int64_t clock_offset_ns = 0;
  std::int64_t clock_uncertainty_ns = 0;
  /// Records this rank lost: its rings were full, or it reached the cap.
  std::uint64_t dropped = 0;
  /// The rank said its run ended (error: why it failed; empty if it succeeded).
  bool finished = false;
  std::string error;
};

/// A register's occupancy at one moment: pieces written and not yet freed by every consumer.
struct OccupancySample {
  std::uint64_t t_ns = 0;  // the rank's steady clock, as ActRecord
  RegisterIndex reg = 0;
  std::int32_t in_use = 0;
};

/// The records of one run, from one rank or many, and the Chrome trace they make. Not
/// thread-safe: one thread fills it, then writes it.
class TraceRecorder {
 public:
  explicit TraceRecorder(TraceLimits limits = {});
  ~TraceRecorder();
  TraceRecorder(TraceRecorder&&) noexcept;
  TraceRecorder& operator=(TraceRecorder&&) noexcept;

  /// The plan the ranks ran (after insert_transfers): names, roles, stages and the edges the
  /// arrows follow. Actors and registers with an empty name are unknown: a later call may fill
  /// them in (each rank may describe only its own actors).
  void add_plan(const Plan& plan);
  /// Describes a rank (again: replaces what was said).
  void add_rank(TraceRank rank);
  /// Act records of a rank, on its own clock. Past the cap they are counted, not kept.
  void add_acts(std::uint32_t rank, std::span<const ActRecord> acts);
  void add_occupancy(std::uint32_t rank, std::span<const OccupancySample> samples);
  /// Act records kept so far.
  std::size_t acts() const;
  /// A line for the file's metadata ("otherData": {"notes": [...]}): what a reader should know.
  void add_note(std::string note);

  /// The trace as Chrome trace-event JSON: {"traceEvents": [...], "displayTimeUnit": "ns",
  /// "otherData": {...}}. Times in microseconds from the earliest event, on the common clock.
  /// With gradient all-reduces among the acts (data parallelism), otherData has
  /// "allreduce_overlap": {"fraction", "allreduce_s", "by_allreduce": {name: fraction}}: the
  /// share of their time the backward pass ran beside them (collective_overlap, on the common
  /// clock), in all and for each all-reduce (a gradient bucket).
  void write(std::FILE* out) const;
  /// Writes `path` (via a temporary file beside it, so a reader never sees half a trace).
  /// Throws std::runtime_error naming the path and the reason.
  void write_file(const std::string& path) const;
  std::string json() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct TraceOptions {
  TraceLimits limits;
  /// How often the drain thread empties the workers' activity rings and samples the registers'
  /// occupancy. A ring holds 64 Ki records: at 50 ms a worker would need 1.3 M acts/s to fill
  /// one. Each sample reads Runtime::snapshot() (tens of microseconds for a large plan).
  std::chrono::milliseconds period{50};
  /// Empty the activity rings itself. False when another reader (the dashboard's collector)
  /// drains them and hands each batch to TraceObserver::consume: a ring has one reader.
  bool drain = true;
  /// Record the whole run. False: only when the server asks (the command "trace" with body
  /// {"session": N, "seconds": S}, e.g. the dashboard's "record N seconds"); the runtime's
  /// activity log is off in between (unless another reader owns the rings: drain false).
  bool whole_run = true;
  /// Where streamed "trace" bodies go instead of the control plane (a TraceCollector in this
  /// process: the dashboard's "record" button in a job of one rank). Set: the records stream
  /// here even without a control client.
  std::function<void(const std::string& body)> send;
};

/// One rank's recording: a JobObserver with a drain thread. Without a control client (a job of
/// one rank, or `keep` below) it keeps the records in recorder(); in a job of many ranks it
/// streams them as "trace" telemetry, for the launcher's TraceCollector.
///
/// The runtime needs RuntimeSettings::activity_log (the rings exist only then).
class TraceObserver : public JobObserver {
 public:
  /// keep: keep the records here even in a job of many ranks (one file per rank).
  explicit TraceObserver(TraceOptions options = {}, bool keep = false);
  ~TraceObserver() override;
  TraceObserver(const TraceObserver&) = delete;
  TraceObserver& operator=(const TraceObserver&) = delete;

  void on_start(Runtime& runtime, transport::ControlClient* control) override;
  void on_finish(Runtime& runtime, const std::string& error) override;
  void on_command(const std::string& kind, const std::string& body) override;
  /// Records drained by someone else (TraceOptions::drain false), on their thread, between
  /// on_start and on_finish.
  void consume(const std::vector<ActRecord>& records, const Runtime& runtime);

  /// The records kept (when not streaming). Complete once on_finish has returned.
  const TraceRecorder& recorder() const;
  /// Act records this rank recorded (kept or sent).
  std::uint64_t recorded() const;
  /// Recording now (the whole run, or a session the server asked for). Any thread.
  bool recording() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// One rank's side of a streamed trace: turns its description and records into "trace"
/// telemetry bodies (JSON, each at most `max_body` bytes) and hands them to `send`. The
/// TraceObserver uses it with ControlClient::send_telemetry; tests plug in a TraceCollector.
class TraceStream {
 public:
  using Send = std::function<void(const std::string& body)>;
  TraceStream(Send send, std::uint32_t session, std::size_t max_body);
  ~TraceStream();
  TraceStream(TraceStream&&) noexcept;
  TraceStream& operator=(TraceStream&&) noexcept;

  /// First: the rank, its clock against the server's (ControlClient::clock_offset_ns and
  /// clock_rtt_ns) and its part of the plan (the actors on this rank and what they write).
  void begin(const TraceRank& rank, const Plan& plan, std::int64_t clock_rtt_ns);
  void acts(std::span<const ActRecord> records);
  void occupancy(std::span<const OccupancySample> samples);
  /// Last: what the rank lost, and how its run ended.
  void end(std::uint64_t dropped, const std::string& error);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The launcher's side: gathers the ranks' "trace" telemetry and merges it into one trace. Put
/// the clocks together from what each rank measured: a rank on the server's host (same boot,
/// offset within its measuring error of 0) shares the server's CLOCK_MONOTONIC exactly; others
/// get their measured offset and half its round trip as uncertainty.
class TraceCollector {
 public:
  explicit TraceCollector(TraceLimits limits = {});
  ~TraceCollector();
  TraceCollector(const TraceCollector&) = delete;
  TraceCollector& operator=(const TraceCollector&) = delete;

  /// Any thread (ServerSettings::on_telemetry): keeps the bodies of kind "trace", ignores the
  /// rest. Cheap: the text is parsed when the trace is merged. Past about 64 bytes per event of
  /// the cap, act records are dropped (and counted).
  void on_telemetry(const transport::Telemetry& t);
  /// Ranks that have ended `session` (0: the whole run).
  std::size_t finished(std::uint32_t session = 0) const;
  /// Ranks heard from in `session`.
  std::size_t ranks(std::uint32_t session = 0) const;
  /// Parses what arrived for `session` into one trace. A part that does not parse is counted
  /// in the metadata and skipped.
  TraceRecorder merge(std::uint32_t session = 0) const;
  /// Forgets a session (after it was written).
  void forget(std::uint32_t session);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The dashboard's "record N seconds": asks the ranks for a session (`start(session, seconds)`:
/// a server command, or TraceObserver::on_command in a job of one rank), waits on a thread of
/// its own until `ranks` of them have ended it in `collector` (or N + 10 s have passed), and
/// hands the merged trace on. One recording at a time. Fits DashboardSettings::trace:
///
///   settings.trace = [&](double s, auto done) { on_demand.record(s, std::move(done)); };
class TraceOnDemand {
 public:
  using Start = std::function<void(std::uint32_t session, double seconds)>;
  TraceOnDemand(TraceCollector& collector, Start start, std::size_t ranks);
  /// Stops waiting: a recording in progress is never answered (destroy whoever asks, the HTTP
  /// server, first).
  ~TraceOnDemand();
  TraceOnDemand(const TraceOnDemand&) = delete;
  TraceOnDemand& operator=(const TraceOnDemand&) = delete;

  void record(double seconds, std::function<void(bool ok, std::string body)> done);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::observe
