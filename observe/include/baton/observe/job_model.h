#pragma once
/// The job model: everything the dashboard shows about one job, for all its ranks. It reads
/// the collectors' telemetry (telemetry.h) and keeps the plan, each actor's and register's
/// latest counters and rates, a bounded history for the charts, the loss curve, and the recent
/// pipeline-timeline boxes of each stage. Its views are JSON text (for the HTTP API) and the
/// Prometheus text format (/metrics). Thread-safe: ingest from the control plane's thread,
/// read from the HTTP server's.
///
///   baton::observe::JobModel model;
///   server_settings.on_telemetry = [&](transport::Telemetry t) {
///     model.ingest(t.rank, t.kind, t.body);
///   };
///   baton::observe::DashboardServer http(model, {.listen = "127.0.0.1:8080"});
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace baton::observe {

struct JobModelSettings {
  /// Points of the throughput charts kept (one per sample, about 2 a second: 10 minutes).
  std::size_t history_points = 1200;
  /// Points of the loss curve kept; beyond, every other point is dropped (the curve keeps its
  /// whole span at half the resolution).
  std::size_t loss_points = 4096;
  /// Boxes kept per timeline lane (a stage on one device), forward and backward together.
  std::size_t boxes_per_lane = 600;
  /// Actors whose acts/s series history_json returns (the busiest over the last interval), so
  /// that a plan of thousands of actors does not make the answer that big.
  std::size_t history_actors = 16;
  /// The job's size, if known up front (the launcher knows it); else learnt from the ranks.
  std::uint32_t world_size = 0;
  /// A name for the page's title (the program, the model).
  std::string title = "baton job";
};

/// How the job stands, as far as the model knows.
enum class JobStatus : std::uint8_t { waiting, running, finished, failed };

class JobModel {
 public:
  explicit JobModel(JobModelSettings settings = {});
  ~JobModel();
  JobModel(const JobModel&) = delete;
  JobModel& operator=(const JobModel&) = delete;

  /// One telemetry message from `rank`. Kinds that are not the dashboard's are ignored; a
  /// malformed body is counted and its error kept (last_error), never thrown: a bad message
  /// must not take the launcher down. Returns whether it was used.
  bool ingest(std::uint32_t rank, std::string_view kind, std::string_view body);
  /// The launcher's verdict (it knows about ranks that died without a word).
  void set_outcome(bool ok, const std::string& reason);
  /// Rank `rank` left the job and the job goes on without it (a parameter-server worker under
  /// bounded staleness): its row says "left", and the page says who, when (the job's step as
  /// the model knows it) and why.
  void rank_left(std::uint32_t rank, const std::string& reason);
  /// Rank `rank`, which left, came back (baton-launch --max-restarts) and trains from step
  /// `step` + 1: its row runs again, and the page says it came back.
  void rank_rejoined(std::uint32_t rank, std::int64_t step);

  /// Bumps with every complete sample of some rank's counters (the live updates' trigger).
  std::uint64_t version() const;
  JobStatus status() const;
  /// Ranks that have said hello.
  std::size_t ranks_seen() const;
  /// Messages that could not be read, and why the last one could not.
  std::uint64_t bad_messages() const;
  std::string last_error() const;

  /// /api/plan: {title, hash, world_size, actors: [...], registers: [...]}.
  std::string plan_json() const;
  /// /api/state: status, training scalars, ranks, actors (rates and time shares over the last
  /// interval), registers (occupancy), edges (bytes/s), the bottleneck hint.
  std::string state_json() const;
  /// /api/history: the charts' series (at most `points` of them, the newest).
  std::string history_json(std::size_t points = 600) const;
  /// /api/timeline: per lane (rank, device, stage), the recent forward / backward boxes.
  std::string timeline_json() const;
  /// /metrics: the Prometheus text exposition format (version 0.0.4). Labels: rank, host,
  /// actor, op, role, state, register; never piece numbers.
  std::string prometheus() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::observe
