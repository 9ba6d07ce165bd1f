#pragma once
// The job model's state, shared by job_model.cpp (ingest, JSON views) and prometheus.cpp.
// Everything here is guarded by JobModel::Impl::mutex.
#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <boost/json.hpp>

#include "baton/actors/metrics.h"
#include "baton/observe/job_model.h"

namespace baton::observe::detail {

namespace json = boost::json;

/// Indices beyond these are a corrupt message, not a big job: they would make us allocate.
inline constexpr std::size_t max_index = 1u << 20;
inline constexpr std::uint32_t max_rank = 1u << 16;

struct PlanActor {
  std::string name, kind, op, role, device;
  int stage = -1;
  std::uint32_t rank = 0;
  int stream = 0;
  std::vector<std::pair<std::uint32_t, int>> inputs;  // register, delay
  std::vector<std::uint32_t> outputs;
};

struct PlanRegister {
  std::string name, shape, dtype;
  int slots = 0;
  std::uint64_t bytes = 0;  // one piece
  std::int64_t producer = -1;
  std::vector<std::uint32_t> consumers;
};

struct PlanView {
  std::string hash;
  std::vector<PlanActor> actors;
  std::vector<PlanRegister> registers;
  std::vector<bool> parts_seen;
  bool complete = false;
  std::vector<int> depth;  // longest same-piece chain from a source
};

struct Counters {
  std::uint64_t acts = 0, bytes_in = 0, bytes_out = 0;
  std::array<double, 4> time{};  // busy, starved, back-pressured, transferring (seconds)
  double kernel = 0;
};

struct ActorState {
  bool seen = false;
  std::uint32_t rank = 0;
  Counters now;
  double at_elapsed = 0;  // the rank's elapsed time at `now`
  int activity = 1;       // ActorActivity
  // Over the last interval (between its last two samples).
  double interval_s = 0;
  double d_acts = 0;
  std::array<double, 4> d_time{};
  double d_kernel = 0;
  double acts_per_s = 0, in_per_s = 0, out_per_s = 0;

  /// The share of the last interval's wall time spent in bucket b.
  double share(std::size_t b) const { return interval_s > 0 ? d_time[b] / interval_s : 0; }
  double busy_share() const { return share(0); }
  /// After it retired an actor books no more time: the rest of the interval is its retirement.
  double retired_share() const {
    if (activity != static_cast<int>(ActorActivity::retired)) return 0;
    double sum = 0;
    for (std::size_t b = 0; b < 4; ++b) sum += share(b);
    return sum < 1 ? 1 - sum : 0;
  }
};

struct RegisterState {
  bool seen = false;
  std::uint32_t rank = 0;
  std::int64_t written = 0, freed = 0;
  int max_outstanding = 0, slots = 0;
  double written_per_s = 0;
  double occupancy = 0;  // moving average of in-use slots / slots
  double at_elapsed = 0;
};

struct WindowPoint {
  double elapsed;
  std::int64_t samples, step;
};

struct RankState {
  bool hello = false;
  std::string host, plan_hash;
  std::uint32_t world_size = 0;
  std::vector<std::string> workers;
  double last_seen_s = 0;
  bool finished = false;
  std::string error;
  std::string left;  // why it left the job (JobModel::rank_left); empty: it did not
  std::int64_t left_at_step = 0;
  std::vector<std::string> returns;  // each time it left and came back (rank_rejoined), in words
  double elapsed_s = 0;
  std::uint64_t dropped = 0, samples_complete = 0, seq = 0;
  std::size_t actors = 0;
  std::int64_t step = 0, samples = 0;
  double loss = 0, lr = 0;
  std::deque<WindowPoint> window;
  double samples_per_s = 0, step_time_s = 0;
  double acts_per_s = 0, in_per_s = 0, out_per_s = 0;
  std::array<double, 4> shares{};
};

struct HistoryPoint {
  double t = 0;
  double samples_per_s = 0, acts_per_s = 0;
  std::int64_t step = 0;
  std::vector<float> rank_acts;
  std::vector<float> actor_acts;
};

struct LossPoint {
  std::int64_t step;
  double loss, lr;
};

struct LaneKey {
  std::uint32_t rank;
  int stage;
  std::uint8_t device;
  friend bool operator<(const LaneKey& a, const LaneKey& b) {
    return std::tie(a.rank, a.stage, a.device) < std::tie(b.rank, b.stage, b.device);
  }
};

struct Box {
  int phase;  // 0 forward, 1 backward
  std::int64_t piece;
  double start, end;  // seconds since the model's epoch
};

struct Lane {
  std::deque<Box> boxes;
};

struct Bottleneck {
  std::size_t actor;
  int depth;
  bool strong;
};

struct BusyWorker {
  std::string name;  // "cpu:1/s0"
  std::uint32_t rank;
  int stage;
  double busy;  // its actors' busy shares, summed
  std::size_t actors;
  std::size_t busiest_actor;
};

struct Model {
  JobModelSettings settings;
  std::chrono::steady_clock::time_point epoch;
  std::int64_t epoch_ns = 0;
  std::uint64_t version = 0;
  std::uint64_t bad_messages = 0;
  std::string last_error;
  std::uint32_t learnt_world_size = 0;
  bool outcome_known = false, outcome_ok = false;
  std::string outcome_reason;

  PlanView plan;
  std::vector<RankState> ranks;
  std::vector<ActorState> actors;
  std::vector<RegisterState> registers;
  std::deque<HistoryPoint> history;
  std::vector<LossPoint> loss_curve;
  std::int64_t loss_stride = 1;
  std::map<LaneKey, Lane> lanes;

  double now_s() const;
  RankState& rank_state(std::uint32_t rank);
  ActorState& actor_state(std::size_t i);
  RegisterState& register_state(std::size_t i);

  void ingest_hello(std::uint32_t rank, const json::object& o);
  void ingest_plan(const json::object& o);
  void ingest_metrics(std::uint32_t rank, const json::object& o);
  void ingest_steps(std::uint32_t rank, const json::object& o);
  void ingest_timeline(std::uint32_t rank, const json::object& o);
  void ingest_finish(std::uint32_t rank, const json::object& o);
  void compute_depths();
  void finish_sample(std::uint32_t rank, std::uint64_t seq);
  void take_history_point(double t);

  std::uint32_t world_size() const;
  JobStatus status() const;
  const RankState* training_rank() const;
  std::optional<Bottleneck> bottleneck() const;
  std::optional<BusyWorker> busiest_worker() const;
  std::string actor_name(std::size_t i) const;
  std::string register_name(std::size_t i) const;
  std::string host_of(std::uint32_t rank) const;
  json::object actor_json(std::size_t i) const;

  std::string plan_json() const;
  std::string state_json() const;
  std::string history_json(std::size_t points) const;
  std::string timeline_json() const;
  std::string prometheus() const;
};

std::string_view status_name(JobStatus s);
const json::object& as_object(const json::value& v, const char* what);

}  // namespace baton::observe::detail

namespace baton::observe {

struct JobModel::Impl {
  mutable std::mutex mutex;
  detail::Model m;
};

}  // namespace baton::observe
