// The job model: the collectors' telemetry in, the dashboard's JSON views out. Prometheus
// rendering lives in prometheus.cpp; both share the state declared in job_model_impl.h.
#include "job_model_impl.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

#include "baton/kernels/device.h"
#include "baton/observe/telemetry.h"

namespace baton::observe {

namespace detail {

const json::object& as_object(const json::value& v, const char* what) {
  if (!v.is_object()) throw std::invalid_argument(fmt::format("{} is not a JSON object", what));
  return v.get_object();
}

namespace {

const json::value& field(const json::object& o, std::string_view key) {
  const json::value* v = o.if_contains(key);
  if (v == nullptr) throw std::invalid_argument(fmt::format("no field '{}'", key));
  return *v;
}

double number(const json::value& v) {
  if (v.is_double()) return v.get_double();
  if (v.is_int64()) return static_cast<double>(v.get_int64());
  if (v.is_uint64()) return static_cast<double>(v.get_uint64());
  if (v.is_null()) return NAN;  // a NaN loss is serialized as null
  throw std::invalid_argument("a number was expected");
}

std::int64_t integer(const json::value& v) {
  if (v.is_int64()) return v.get_int64();
  if (v.is_uint64()) return static_cast<std::int64_t>(v.get_uint64());
  if (v.is_double()) return static_cast<std::int64_t>(v.get_double());
  throw std::invalid_argument("an integer was expected");
}

std::uint64_t unsigned_integer(const json::value& v) {
  if (v.is_uint64()) return v.get_uint64();
  if (v.is_int64() && v.get_int64() >= 0) return static_cast<std::uint64_t>(v.get_int64());
  if (v.is_double() && v.get_double() >= 0) return static_cast<std::uint64_t>(v.get_double());
  throw std::invalid_argument("a non-negative integer was expected");
}

std::string text(const json::value& v) {
  if (!v.is_string()) throw std::invalid_argument("a string was expected");
  return std::string(v.get_string());
}

double num_field(const json::object& o, std::string_view key, double fallback = 0) {
  const json::value* v = o.if_contains(key);
  return v == nullptr ? fallback : number(*v);
}

/// A JSON number, or null for NaN and infinities (JSON has neither).
json::value finite(double x) { return std::isfinite(x) ? json::value(x) : json::value(nullptr); }

/// Rounds a rate or share for the page: the wire has no use for 17 digits.
json::value rounded(double x, int digits = 4) {
  if (!std::isfinite(x)) return nullptr;
  if (x == 0) return 0.0;
  const double scale = std::pow(10.0, digits - 1 - static_cast<int>(std::floor(std::log10(std::fabs(x)))));
  return std::round(x * scale) / scale;
}

constexpr std::array<const char*, 4> share_names = {"busy", "starved", "backpressured", "transferring"};

/// /api/state's ranks: a row for each rank heard from, and a line for each that left the job.
void put_ranks(json::object& o, const std::vector<RankState>& ranks, double now) {
  json::array rs;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const RankState& r = ranks[i];
    if (!r.hello && r.samples_complete == 0) continue;
    json::object x;
    x["rank"] = i;
    x["host"] = r.host;
    x["actors"] = r.actors;
    x["workers"] = r.workers.size();
    x["acts_per_s"] = rounded(r.acts_per_s);
    x["in_per_s"] = rounded(r.in_per_s);
    x["out_per_s"] = rounded(r.out_per_s);
    for (std::size_t b = 0; b < 4; ++b) x[share_names[b]] = rounded(r.shares[b]);
    x["samples_per_s"] = rounded(r.samples_per_s);
    x["step_time_s"] = rounded(r.step_time_s);
    x["step"] = r.step;
    x["loss"] = finite(r.loss);
    x["lr"] = finite(r.lr);
    x["elapsed_s"] = rounded(r.elapsed_s, 6);
    x["last_seen_s"] = rounded(now - r.last_seen_s);
    x["dropped"] = r.dropped;
    x["status"] = !r.left.empty() ? "left" : !r.error.empty() ? "failed" : r.finished ? "finished" : "running";
    rs.push_back(std::move(x));
  }
  o["ranks"] = std::move(rs);
  json::array left;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    for (const std::string& back : ranks[i].returns) left.push_back(json::string(fmt::format("rank {} {}", i, back)));
    if (ranks[i].left.empty()) continue;
    left.push_back(json::string(fmt::format("rank {} left at step {}: {}; the job goes on without it", i,
                                            ranks[i].left_at_step, ranks[i].left)));
  }
  o["left"] = std::move(left);
}

}  // namespace

double Model::now_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch).count();
}

RankState& Model::rank_state(std::uint32_t rank) {
  if (rank >= ranks.size()) ranks.resize(rank + 1);
  RankState& r = ranks[rank];
  r.last_seen_s = now_s();
  return r;
}

ActorState& Model::actor_state(std::size_t i) {
  if (i > max_index) throw std::invalid_argument(fmt::format("actor index {} is out of range", i));
  if (i >= actors.size()) actors.resize(i + 1);
  return actors[i];
}

RegisterState& Model::register_state(std::size_t i) {
  if (i > max_index) throw std::invalid_argument(fmt::format("register index {} is out of range", i));
  if (i >= registers.size()) registers.resize(i + 1);
  return registers[i];
}

void Model::ingest_hello(std::uint32_t rank, const json::object& o) {
  RankState& r = rank_state(rank);
  r.hello = true;
  r.host = text(field(o, "host"));
  r.world_size = static_cast<std::uint32_t>(unsigned_integer(field(o, "world_size")));
  r.plan_hash = text(field(o, "plan_hash"));
  r.workers.clear();
  for (const auto& w : field(o, "workers").as_array()) r.workers.push_back(text(w));
  if (settings.world_size == 0) learnt_world_size = std::max(learnt_world_size, r.world_size);
}

void Model::ingest_plan(const json::object& o) {
  const std::string hash = text(field(o, "hash"));
  const auto n_actors = static_cast<std::size_t>(unsigned_integer(field(o, "actors")));
  const auto n_registers = static_cast<std::size_t>(unsigned_integer(field(o, "registers")));
  const auto parts = static_cast<std::size_t>(unsigned_integer(field(o, "parts")));
  const auto part = static_cast<std::size_t>(unsigned_integer(field(o, "part")));
  if (n_actors > max_index || n_registers > max_index || parts == 0 || part >= parts || parts > max_index) {
    throw std::invalid_argument("a plan part with sizes out of range");
  }
  if (hash != plan.hash || plan.actors.size() != n_actors || plan.registers.size() != n_registers) {
    plan = PlanView{};
    plan.hash = hash;
    plan.actors.resize(n_actors);
    plan.registers.resize(n_registers);
    plan.parts_seen.assign(parts, false);
  }
  if (plan.parts_seen.size() != parts) plan.parts_seen.assign(parts, false);
  for (const auto& e : field(o, "entries").as_array()) {
    const json::object& x = as_object(e, "a plan entry");
    const auto i = static_cast<std::size_t>(unsigned_integer(field(x, "i")));
    if (text(field(x, "t")) == "a") {
      if (i >= n_actors) throw std::invalid_argument(fmt::format("plan actor {} of {}", i, n_actors));
      PlanActor& a = plan.actors[i];
      a.name = text(field(x, "name"));
      a.kind = text(field(x, "kind"));
      a.op = text(field(x, "op"));
      a.role = text(field(x, "role"));
      a.stage = static_cast<int>(integer(field(x, "stage")));
      a.rank = static_cast<std::uint32_t>(unsigned_integer(field(x, "rank")));
      a.device = text(field(x, "device"));
      a.stream = static_cast<int>(integer(field(x, "stream")));
      a.inputs.clear();
      for (const auto& in : field(x, "inputs").as_array()) {
        const auto& pair = in.as_array();
        a.inputs.emplace_back(static_cast<std::uint32_t>(unsigned_integer(pair.at(0))),
                              static_cast<int>(integer(pair.at(1))));
      }
      a.outputs.clear();
      for (const auto& out : field(x, "outputs").as_array()) {
        a.outputs.push_back(static_cast<std::uint32_t>(unsigned_integer(out)));
      }
    } else {
      if (i >= n_registers) throw std::invalid_argument(fmt::format("plan register {} of {}", i, n_registers));
      PlanRegister& r = plan.registers[i];
      r.name = text(field(x, "name"));
      r.slots = static_cast<int>(integer(field(x, "slots")));
      r.bytes = unsigned_integer(field(x, "bytes"));
      r.shape = text(field(x, "shape"));
      r.dtype = text(field(x, "dtype"));
      r.producer = integer(field(x, "producer"));
      r.consumers.clear();
      for (const auto& c : field(x, "consumers").as_array()) {
        r.consumers.push_back(static_cast<std::uint32_t>(unsigned_integer(c)));
      }
    }
  }
  plan.parts_seen[part] = true;
  plan.complete = std::all_of(plan.parts_seen.begin(), plan.parts_seen.end(), [](bool b) { return b; });
  if (plan.complete) compute_depths();
}

/// Each actor's depth: the longest chain of same-piece edges (delay 0) from a source to it. The
/// bottleneck hint prefers the downstream-most busy actor. Delayed edges (the weight's loop from
/// optimizer back to variable) are left out, which leaves a DAG; Kahn's algorithm walks it.
void Model::compute_depths() {
  const std::size_t n = plan.actors.size();
  plan.depth.assign(n, 0);
  std::vector<std::vector<std::uint32_t>> next(n);
  std::vector<int> indegree(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    for (const auto& [reg, delay] : plan.actors[i].inputs) {
      if (delay != 0 || reg >= plan.registers.size()) continue;
      const std::int64_t p = plan.registers[reg].producer;
      if (p < 0 || static_cast<std::size_t>(p) >= n || static_cast<std::size_t>(p) == i) continue;
      next[static_cast<std::size_t>(p)].push_back(static_cast<std::uint32_t>(i));
      ++indegree[i];
    }
  }
  std::vector<std::uint32_t> ready;
  for (std::size_t i = 0; i < n; ++i) {
    if (indegree[i] == 0) ready.push_back(static_cast<std::uint32_t>(i));
  }
  while (!ready.empty()) {
    const std::uint32_t a = ready.back();
    ready.pop_back();
    for (std::uint32_t b : next[a]) {
      plan.depth[b] = std::max(plan.depth[b], plan.depth[a] + 1);
      if (--indegree[b] == 0) ready.push_back(b);
    }
  }
}

void Model::ingest_metrics(std::uint32_t rank, const json::object& o) {
  RankState& r = rank_state(rank);
  const double elapsed = number(field(o, "elapsed_s"));
  const auto seq = unsigned_integer(field(o, "seq"));
  const auto part = unsigned_integer(field(o, "part"));
  const auto parts = unsigned_integer(field(o, "parts"));
  for (const auto& e : field(o, "entries").as_array()) {
    const json::array& x = e.as_array();
    const std::string t = text(x.at(0));
    if (t == "a") {
      ActorState& a = actor_state(static_cast<std::size_t>(unsigned_integer(x.at(1))));
      Counters c;
      c.acts = unsigned_integer(x.at(2));
      c.bytes_in = unsigned_integer(x.at(3));
      c.bytes_out = unsigned_integer(x.at(4));
      for (std::size_t b = 0; b < 4; ++b) c.time[b] = number(x.at(5 + b));
      c.kernel = number(x.at(9));
      a.activity = static_cast<int>(integer(x.at(10)));
      a.rank = rank;
      const double dt = elapsed - a.at_elapsed;
      if (a.seen && dt > 0) {
        a.interval_s = dt;
        a.d_acts = static_cast<double>(c.acts - std::min(c.acts, a.now.acts));
        a.acts_per_s = a.d_acts / dt;
        a.in_per_s = static_cast<double>(c.bytes_in - std::min(c.bytes_in, a.now.bytes_in)) / dt;
        a.out_per_s = static_cast<double>(c.bytes_out - std::min(c.bytes_out, a.now.bytes_out)) / dt;
        for (std::size_t b = 0; b < 4; ++b) a.d_time[b] = std::max(0.0, c.time[b] - a.now.time[b]);
        a.d_kernel = std::max(0.0, c.kernel - a.now.kernel);
      } else if (!a.seen) {
        // The first sample: the whole run so far is the interval.
        a.interval_s = elapsed;
        a.d_acts = static_cast<double>(c.acts);
        a.acts_per_s = elapsed > 0 ? a.d_acts / elapsed : 0;
        a.in_per_s = elapsed > 0 ? static_cast<double>(c.bytes_in) / elapsed : 0;
        a.out_per_s = elapsed > 0 ? static_cast<double>(c.bytes_out) / elapsed : 0;
        a.d_time = c.time;
        a.d_kernel = c.kernel;
      }
      a.now = c;
      a.at_elapsed = elapsed;
      a.seen = true;
    } else if (t == "r") {
      RegisterState& g = register_state(static_cast<std::size_t>(unsigned_integer(x.at(1))));
      const std::int64_t written = integer(x.at(2));
      const std::int64_t freed = integer(x.at(3));
      const double dt = elapsed - g.at_elapsed;
      if (g.seen && dt > 0) {
        g.written_per_s = static_cast<double>(written - std::min(written, g.written)) / dt;
      } else if (!g.seen && elapsed > 0) {
        g.written_per_s = static_cast<double>(written) / elapsed;
      }
      g.written = written;
      g.freed = freed;
      g.max_outstanding = static_cast<int>(integer(x.at(4)));
      g.slots = static_cast<int>(integer(x.at(5)));
      g.rank = rank;
      const double in_use = g.slots > 0 ? static_cast<double>(written - freed) / g.slots : 0;
      // A moving average over samples: one sample of a pipe is the luck of the moment.
      g.occupancy = g.seen ? 0.7 * g.occupancy + 0.3 * in_use : in_use;
      g.at_elapsed = elapsed;
      g.seen = true;
    }
  }
  r.dropped = unsigned_integer(field(o, "dropped"));
  if (const std::int64_t step = integer(field(o, "step")); step >= r.step) {
    r.step = step;
    r.samples = integer(field(o, "samples"));
    r.loss = num_field(o, "loss", NAN);
    r.lr = num_field(o, "lr", NAN);
  }
  r.elapsed_s = elapsed;
  if (part + 1 == parts) finish_sample(rank, seq);
}

/// A rank's sample is complete: roll its actors up, update its training rates, bump the
/// version and take a history point.
void Model::finish_sample(std::uint32_t rank, std::uint64_t seq) {
  RankState& r = ranks[rank];
  r.samples_complete++;
  r.seq = seq;
  double life = 0, acts = 0, in = 0, out = 0;
  std::array<double, 4> time{};
  std::size_t n = 0;
  for (const ActorState& a : actors) {
    if (!a.seen || a.rank != rank) continue;
    ++n;
    life += a.interval_s;
    for (std::size_t b = 0; b < 4; ++b) time[b] += a.d_time[b];
    acts += a.acts_per_s;
    in += a.in_per_s;
    out += a.out_per_s;
  }
  r.actors = n;
  r.acts_per_s = acts;
  r.in_per_s = in;
  r.out_per_s = out;
  for (std::size_t b = 0; b < 4; ++b) r.shares[b] = life > 0 ? time[b] / life : 0;
  // Training rates over a window of a few samples: steps may take longer than one interval.
  r.window.push_back({r.elapsed_s, r.samples, r.step});
  while (r.window.size() > 5) r.window.pop_front();
  if (r.window.size() >= 2) {
    const auto& first = r.window.front();
    const auto& last = r.window.back();
    const double dt = last.elapsed - first.elapsed;
    if (dt > 0) r.samples_per_s = static_cast<double>(last.samples - first.samples) / dt;
    if (last.step > first.step) r.step_time_s = dt / static_cast<double>(last.step - first.step);
  }
  ++version;
  const double t = now_s();
  if (history.empty() || t - history.back().t >= 0.3) take_history_point(t);
}

void Model::take_history_point(double t) {
  HistoryPoint p;
  p.t = t;
  const RankState* lead = training_rank();
  if (lead != nullptr) {
    p.samples_per_s = lead->samples_per_s;
    p.step = lead->step;
  }
  p.rank_acts.resize(ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    p.rank_acts[i] = static_cast<float>(ranks[i].acts_per_s);
    p.acts_per_s += ranks[i].acts_per_s;
  }
  p.actor_acts.resize(actors.size());
  for (std::size_t i = 0; i < actors.size(); ++i) p.actor_acts[i] = static_cast<float>(actors[i].acts_per_s);
  history.push_back(std::move(p));
  while (history.size() > settings.history_points) history.pop_front();
}

/// The rank whose training scalars stand for the job: the one furthest on (every rank reports
/// the job's samples; ranks without the loss actor report no steps).
const RankState* Model::training_rank() const {
  const RankState* best = nullptr;
  for (const auto& r : ranks) {
    if (r.samples_complete == 0) continue;
    if (best == nullptr || r.step > best->step) best = &r;
  }
  return best;
}

void Model::ingest_steps(std::uint32_t rank, const json::object& o) {
  RankState& r = rank_state(rank);
  for (const auto& e : field(o, "steps").as_array()) {
    const json::array& x = e.as_array();
    const std::int64_t step = integer(x.at(0));
    if (step > r.step) {
      // Steps may come after the rank's last sample (the run's end): they are the news.
      r.step = step;
      r.loss = number(x.at(1));
      r.lr = number(x.at(2));
      r.samples = integer(x.at(3));
    }
    if (!loss_curve.empty() && step <= loss_curve.back().step) continue;
    if (step % loss_stride != 0) continue;
    loss_curve.push_back({step, number(x.at(1)), number(x.at(2))});
    if (loss_curve.size() > settings.loss_points) {
      // Keep the span, halve the resolution: every point whose step is a multiple of the new stride.
      loss_stride *= 2;
      std::erase_if(loss_curve, [&](const LossPoint& p) { return p.step % loss_stride != 0; });
    }
  }
}

void Model::ingest_timeline(std::uint32_t rank, const json::object& o) {
  for (const auto& e : field(o, "boxes").as_array()) {
    const json::array& x = e.as_array();
    const int stage = static_cast<int>(integer(x.at(0)));
    const auto device = static_cast<std::uint8_t>(unsigned_integer(x.at(1)));
    const int phase = static_cast<int>(integer(x.at(2)));
    const std::int64_t piece = integer(x.at(3));
    const double start = static_cast<double>(integer(x.at(4)) - epoch_ns) * 1e-9;
    const double end = static_cast<double>(integer(x.at(5)) - epoch_ns) * 1e-9;
    Lane& lane = lanes[LaneKey{rank, stage, device}];
    // A box cut by the rank's sample boundary arrives in two parts: merge with a recent one.
    bool merged = false;
    const std::size_t look = std::min<std::size_t>(lane.boxes.size(), 64);
    for (std::size_t k = 0; k < look; ++k) {
      Box& b = lane.boxes[lane.boxes.size() - 1 - k];
      if (b.phase == phase && b.piece == piece) {
        b.start = std::min(b.start, start);
        b.end = std::max(b.end, end);
        merged = true;
        break;
      }
    }
    if (!merged) lane.boxes.push_back({phase, piece, start, end});
    while (lane.boxes.size() > settings.boxes_per_lane) lane.boxes.pop_front();
  }
}

void Model::ingest_finish(std::uint32_t rank, const json::object& o) {
  RankState& r = rank_state(rank);
  r.finished = true;
  r.error = text(field(o, "error"));
  ++version;
}

std::uint32_t Model::world_size() const {
  return settings.world_size != 0 ? settings.world_size : std::max<std::uint32_t>(learnt_world_size, 1);
}

JobStatus Model::status() const {
  if (outcome_known && !outcome_ok) return JobStatus::failed;
  bool any = false, all_done = true;
  for (std::uint32_t i = 0; i < world_size(); ++i) {
    if (i >= ranks.size() || !ranks[i].hello) {
      all_done = false;
      continue;
    }
    any = true;
    if (!ranks[i].error.empty()) return JobStatus::failed;
    if (!ranks[i].finished) all_done = false;
  }
  if (outcome_known) return JobStatus::finished;
  if (!any) return JobStatus::waiting;
  return all_done ? JobStatus::finished : JobStatus::running;
}

std::string_view status_name(JobStatus s) {
  switch (s) {
    case JobStatus::waiting: return "waiting";
    case JobStatus::running: return "running";
    case JobStatus::finished: return "finished";
    case JobStatus::failed: return "failed";
  }
  return "?";
}

std::string Model::actor_name(std::size_t i) const {
  if (i < plan.actors.size() && !plan.actors[i].name.empty()) return plan.actors[i].name;
  return fmt::format("actor {}", i);
}

std::string Model::register_name(std::size_t i) const {
  if (i < plan.registers.size() && !plan.registers[i].name.empty()) return plan.registers[i].name;
  return fmt::format("register {}", i);
}

std::string Model::host_of(std::uint32_t rank) const {
  return rank < ranks.size() && !ranks[rank].host.empty() ? ranks[rank].host : "?";
}

/// The actor that limits the job: busy most of the time and rarely back-pressured (nothing
/// after it holds it up), the downstream-most of those (upstream of it, actors wait for free
/// slots; downstream, for input). Flink's back-pressure monitor reasons the same way.
std::optional<Bottleneck> Model::bottleneck() const {
  std::optional<Bottleneck> best;
  auto consider = [&](std::size_t i, bool strong) {
    const ActorState& a = actors[i];
    const int depth = i < plan.depth.size() ? plan.depth[i] : 0;
    if (!best || (strong && !best->strong) ||
        (strong == best->strong &&
         (strong ? std::tie(depth, a.d_time[0]) > std::tie(best->depth, actors[best->actor].d_time[0])
                 : a.busy_share() > actors[best->actor].busy_share()))) {
      best = Bottleneck{i, depth, strong};
    }
  };
  for (std::size_t i = 0; i < actors.size(); ++i) {
    const ActorState& a = actors[i];
    if (!a.seen || a.activity == static_cast<int>(ActorActivity::retired) || a.interval_s <= 0) continue;
    const double busy = a.busy_share(), bp = a.share(2);
    if (bp > 0.1) continue;
    if (busy >= 0.5) {
      consider(i, true);
    } else if (busy >= 0.2) {
      consider(i, false);
    }
  }
  return best;
}

/// The worker thread (rank, device, stream) whose actors were busy the largest share of the
/// last interval, summed: actors on one worker share its thread, so the sum is that thread's.
std::optional<BusyWorker> Model::busiest_worker() const {
  struct Sum {
    double busy = 0, top = -1;
    std::size_t top_actor = 0, actors = 0;
    int stage = -1;
  };
  std::map<std::tuple<std::uint32_t, std::string, int>, Sum> sums;
  for (std::size_t i = 0; i < actors.size() && i < plan.actors.size(); ++i) {
    const ActorState& a = actors[i];
    if (!a.seen || a.interval_s <= 0 || a.activity == static_cast<int>(ActorActivity::retired)) continue;
    const PlanActor& p = plan.actors[i];
    Sum& s = sums[{p.rank, p.device, p.stream}];
    s.busy += a.busy_share();
    ++s.actors;
    s.stage = std::max(s.stage, p.stage);
    if (a.busy_share() > s.top) {
      s.top = a.busy_share();
      s.top_actor = i;
    }
  }
  std::optional<BusyWorker> best;
  for (const auto& [key, s] : sums) {
    if (!best || s.busy > best->busy) {
      const auto& [rank, device, stream] = key;
      best = BusyWorker{fmt::format("{}/s{}", device, stream), rank, s.stage, std::min(s.busy, 1.0), s.actors,
                        s.top_actor};
    }
  }
  return best;
}

json::object Model::actor_json(std::size_t i) const {
  const ActorState& a = actors[i];
  json::object o;
  o["i"] = i;
  o["name"] = actor_name(i);
  o["rank"] = a.rank;
  if (i < plan.actors.size()) {
    const PlanActor& p = plan.actors[i];
    o["device"] = p.device;
    o["stream"] = p.stream;
    o["role"] = p.role;
    o["stage"] = p.stage;
    o["op"] = p.op;
    o["kind"] = p.kind;
  }
  o["acts"] = a.now.acts;
  o["acts_per_s"] = rounded(a.acts_per_s);
  o["in_per_s"] = rounded(a.in_per_s);
  o["out_per_s"] = rounded(a.out_per_s);
  double sum = 0;
  std::size_t dominant = 0;
  for (std::size_t b = 0; b < 4; ++b) {
    const double s = a.share(b);
    o[share_names[b]] = rounded(s);
    sum += s;
    if (s > a.share(dominant)) dominant = b;
  }
  const bool retired = a.activity == static_cast<int>(ActorActivity::retired);
  o["retired"] = rounded(a.retired_share());
  o["kernel"] = rounded(a.interval_s > 0 ? a.d_kernel / a.interval_s : 0);
  o["busy_s"] = rounded(a.now.time[0], 6);
  o["activity"] = std::string(name(static_cast<ActorActivity>(std::clamp(a.activity, 0, 4))));
  o["dominant"] = retired && sum < 0.5 ? "retired" : share_names[dominant];
  return o;
}

std::string Model::state_json() const {
  json::object o;
  o["version"] = version;
  o["t"] = rounded(now_s(), 6);
  o["title"] = settings.title;
  o["status"] = std::string(status_name(status()));
  std::string error = outcome_known && !outcome_ok ? outcome_reason : std::string();
  for (std::size_t i = 0; i < ranks.size() && error.empty(); ++i) {
    if (!ranks[i].error.empty()) error = fmt::format("rank {}: {}", i, ranks[i].error);
  }
  o["error"] = error;
  o["world_size"] = world_size();
  o["plan_complete"] = plan.complete;
  o["bad_messages"] = bad_messages;
  if (const RankState* lead = training_rank(); lead != nullptr && lead->step > 0) {
    json::object t;
    t["step"] = lead->step;
    t["loss"] = finite(lead->loss);
    t["lr"] = finite(lead->lr);
    t["samples"] = lead->samples;
    t["samples_per_s"] = rounded(lead->samples_per_s);
    t["step_time_s"] = rounded(lead->step_time_s);
    o["training"] = std::move(t);
  } else {
    o["training"] = nullptr;
  }
  put_ranks(o, ranks, now_s());
  json::array as;
  for (std::size_t i = 0; i < actors.size(); ++i) {
    if (actors[i].seen) as.push_back(actor_json(i));
  }
  o["actors"] = std::move(as);
  json::array regs, edges;
  for (std::size_t i = 0; i < registers.size(); ++i) {
    const RegisterState& g = registers[i];
    if (!g.seen) continue;
    const PlanRegister* p = i < plan.registers.size() ? &plan.registers[i] : nullptr;
    const double bytes_per_s = p != nullptr ? g.written_per_s * static_cast<double>(p->bytes) : 0;
    json::object x;
    x["i"] = i;
    x["name"] = register_name(i);
    x["rank"] = g.rank;
    x["producer"] = p != nullptr ? p->producer : -1;
    x["slots"] = g.slots;
    x["in_use"] = g.written - g.freed;
    x["max_in_use"] = g.max_outstanding;
    x["occupancy"] = rounded(g.occupancy);
    x["written"] = g.written;
    x["written_per_s"] = rounded(g.written_per_s);
    x["bytes_per_s"] = rounded(bytes_per_s);
    regs.push_back(std::move(x));
    if (p != nullptr && p->producer >= 0) {
      for (std::uint32_t c : p->consumers) {
        json::object e;
        e["reg"] = i;
        e["from"] = p->producer;
        e["to"] = c;
        e["bytes_per_s"] = rounded(bytes_per_s);
        edges.push_back(std::move(e));
      }
    }
  }
  o["registers"] = std::move(regs);
  o["edges"] = std::move(edges);
  const std::optional<Bottleneck> b = bottleneck();
  const std::optional<BusyWorker> w = busiest_worker();
  auto op_of = [&](std::size_t i) {
    return i < plan.actors.size() && !plan.actors[i].op.empty() && plan.actors[i].op != plan.actors[i].name
               ? fmt::format(", {}", plan.actors[i].op)
               : std::string();
  };
  // What every hint says of the actor it names.
  auto hint = [&](std::size_t i, bool confident) {
    const ActorState& a = actors[i];
    json::object x;
    x["i"] = i;
    x["name"] = actor_name(i);
    x["rank"] = a.rank;
    x["busy"] = rounded(a.busy_share());
    x["backpressured"] = rounded(a.share(2));
    x["confident"] = confident;
    return x;
  };
  if (b && b->strong) {
    const ActorState& a = actors[b->actor];
    json::object x = hint(b->actor, true);
    x["text"] = fmt::format(
        "{} (rank {}{}) is busy {:.0f}% of the time and back-pressured only {:.0f}%: it sets the pace. Actors "
        "upstream wait for its free slots, those downstream for its output: make it faster or split it.",
        actor_name(b->actor), a.rank, op_of(b->actor), 100 * a.busy_share(), 100 * a.share(2));
    o["bottleneck"] = std::move(x);
  } else if (w && w->busy >= 0.5) {
    // No single actor saturates, but a worker thread does: its actors together set the pace
    // (a pipeline stage with many small ops).
    const ActorState& a = actors[w->busiest_actor];
    json::object x = hint(w->busiest_actor, true);
    x["worker"] = w->name;
    x["worker_busy"] = rounded(w->busy);
    x["text"] = fmt::format(
        "the worker {} (rank {}{}) is busy {:.0f}% of the time: its {} actors together set the pace; the busiest "
        "is {} ({:.0f}%). Give that stage less work (rebalance) or another device.",
        w->name, w->rank, w->stage >= 0 ? fmt::format(", stage {}", w->stage) : std::string(), 100 * w->busy,
        w->actors, actor_name(w->busiest_actor), 100 * a.busy_share());
    o["bottleneck"] = std::move(x);
  } else if (b) {
    const ActorState& a = actors[b->actor];
    json::object x = hint(b->actor, false);
    x["text"] = fmt::format(
        "{} (rank {}{}) is busy {:.0f}% of the time and back-pressured only {:.0f}%. Nothing is saturated; it is "
        "the busiest actor that nothing holds up.",
        actor_name(b->actor), a.rank, op_of(b->actor), 100 * a.busy_share(), 100 * a.share(2));
    o["bottleneck"] = std::move(x);
  } else {
    o["bottleneck"] = nullptr;
  }
  return json::serialize(o);
}

std::string Model::plan_json() const {
  json::object o;
  o["title"] = settings.title;
  o["hash"] = plan.hash;
  o["complete"] = plan.complete;
  o["world_size"] = world_size();
  json::array as;
  for (std::size_t i = 0; i < plan.actors.size(); ++i) {
    const PlanActor& a = plan.actors[i];
    json::object x;
    x["i"] = i;
    x["name"] = a.name;
    x["kind"] = a.kind;
    x["op"] = a.op;
    x["role"] = a.role;
    x["stage"] = a.stage;
    x["rank"] = a.rank;
    x["device"] = a.device;
    x["stream"] = a.stream;
    x["depth"] = i < plan.depth.size() ? plan.depth[i] : 0;
    json::array in, out;
    for (const auto& [reg, delay] : a.inputs) in.push_back(json::array{reg, delay});
    for (auto reg : a.outputs) out.push_back(reg);
    x["inputs"] = std::move(in);
    x["outputs"] = std::move(out);
    as.push_back(std::move(x));
  }
  o["actors"] = std::move(as);
  json::array rs;
  for (std::size_t i = 0; i < plan.registers.size(); ++i) {
    const PlanRegister& r = plan.registers[i];
    json::object x;
    x["i"] = i;
    x["name"] = r.name;
    x["slots"] = r.slots;
    x["bytes"] = r.bytes;
    x["shape"] = r.shape;
    x["dtype"] = r.dtype;
    x["producer"] = r.producer;
    json::array c;
    for (auto k : r.consumers) c.push_back(k);
    x["consumers"] = std::move(c);
    rs.push_back(std::move(x));
  }
  o["registers"] = std::move(rs);
  json::array hosts;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    json::object x;
    x["rank"] = i;
    x["host"] = ranks[i].host;
    json::array w;
    for (const auto& name : ranks[i].workers) w.push_back(json::string(name));
    x["workers"] = std::move(w);
    hosts.push_back(std::move(x));
  }
  o["ranks"] = std::move(hosts);
  return json::serialize(o);
}

std::string Model::history_json(std::size_t points) const {
  const std::size_t n = std::min(points, history.size());
  const std::size_t from = history.size() - n;
  json::object o;
  json::array t, sps, aps, step;
  for (std::size_t k = from; k < history.size(); ++k) {
    const HistoryPoint& p = history[k];
    t.push_back(rounded(p.t, 6));
    sps.push_back(rounded(p.samples_per_s));
    aps.push_back(rounded(p.acts_per_s));
    step.push_back(p.step);
  }
  o["t"] = std::move(t);
  o["samples_per_s"] = std::move(sps);
  o["acts_per_s"] = std::move(aps);
  o["step"] = std::move(step);
  json::array rank_series;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    json::array s;
    for (std::size_t k = from; k < history.size(); ++k) {
      const auto& v = history[k].rank_acts;
      s.push_back(r < v.size() ? rounded(v[r]) : json::value(nullptr));
    }
    json::object x;
    x["rank"] = r;
    x["acts_per_s"] = std::move(s);
    rank_series.push_back(std::move(x));
  }
  o["ranks"] = std::move(rank_series);
  // The busiest actors' rates (by busy time over the last interval): the ones worth a line.
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < actors.size(); ++i) {
    if (actors[i].seen) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return actors[a].busy_share() > actors[b].busy_share();
  });
  if (order.size() > settings.history_actors) order.resize(settings.history_actors);
  json::array actor_series;
  for (std::size_t i : order) {
    json::array s;
    for (std::size_t k = from; k < history.size(); ++k) {
      const auto& v = history[k].actor_acts;
      s.push_back(i < v.size() ? rounded(v[i]) : json::value(nullptr));
    }
    json::object x;
    x["i"] = i;
    x["name"] = actor_name(i);
    x["acts_per_s"] = std::move(s);
    actor_series.push_back(std::move(x));
  }
  o["actors"] = std::move(actor_series);
  json::array ls, ll, lr;
  for (const auto& p : loss_curve) {
    ls.push_back(p.step);
    ll.push_back(finite(p.loss));
    lr.push_back(finite(p.lr));
  }
  json::object loss;
  loss["step"] = std::move(ls);
  loss["loss"] = std::move(ll);
  loss["lr"] = std::move(lr);
  o["loss"] = std::move(loss);
  return json::serialize(o);
}

std::string Model::timeline_json() const {
  json::object o;
  o["t"] = rounded(now_s(), 6);
  json::array ls;
  std::vector<const std::pair<const LaneKey, Lane>*> order;
  for (const auto& entry : lanes) order.push_back(&entry);
  // Stages top to bottom, as pipeline diagrams draw them; then rank and device.
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return std::tie(a->first.stage, a->first.rank, a->first.device) <
           std::tie(b->first.stage, b->first.rank, b->first.device);
  });
  for (const auto* entry : order) {
    const auto& [key, lane] = *entry;
    json::object x;
    x["rank"] = key.rank;
    x["stage"] = key.stage;
    const std::string device = Device::from_code(key.device).str();
    x["device"] = device;
    x["label"] = fmt::format("stage {} · rank {} {}", key.stage, key.rank, device);
    json::array boxes;
    for (const Box& b : lane.boxes) {
      boxes.push_back(json::array{b.phase, b.piece, rounded(b.start, 9), rounded(b.end, 9)});
    }
    x["boxes"] = std::move(boxes);
    ls.push_back(std::move(x));
  }
  o["lanes"] = std::move(ls);
  return json::serialize(o);
}

}  // namespace detail

JobModel::JobModel(JobModelSettings settings) : impl_(std::make_unique<Impl>()) {
  impl_->m.settings = std::move(settings);
  impl_->m.epoch = std::chrono::steady_clock::now();
  impl_->m.epoch_ns = static_cast<std::int64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(impl_->m.epoch.time_since_epoch()).count());
}

JobModel::~JobModel() = default;

bool JobModel::ingest(std::uint32_t rank, std::string_view kind, std::string_view body) {
  if (!is_dashboard_kind(kind)) return false;
  // Parsed outside the lock: the HTTP thread reads meanwhile.
  boost::system::error_code ec;
  detail::json::value v = detail::json::parse(body, ec);
  std::lock_guard lock(impl_->mutex);
  detail::Model& m = impl_->m;
  try {
    if (ec) throw std::invalid_argument(fmt::format("not JSON: {}", ec.message()));
    if (rank > detail::max_rank) throw std::invalid_argument("rank out of range");
    const detail::json::object& o = detail::as_object(v, "the body");
    if (kind == kind::hello) {
      m.ingest_hello(rank, o);
    } else if (kind == kind::plan) {
      m.ingest_plan(o);
    } else if (kind == kind::metrics) {
      m.ingest_metrics(rank, o);
    } else if (kind == kind::steps) {
      m.ingest_steps(rank, o);
    } else if (kind == kind::timeline) {
      m.ingest_timeline(rank, o);
    } else if (kind == kind::finish) {
      m.ingest_finish(rank, o);
    } else {
      throw std::invalid_argument("unknown kind");
    }
    return true;
  } catch (const std::exception& e) {
    ++m.bad_messages;
    m.last_error = fmt::format("{} from rank {}: {}", kind, rank, e.what());
    return false;
  }
}

void JobModel::rank_left(std::uint32_t rank, const std::string& reason) {
  std::lock_guard lock(impl_->mutex);
  const detail::RankState* lead = impl_->m.training_rank();
  const std::int64_t step = lead != nullptr ? lead->step : 0;
  detail::RankState& r = impl_->m.rank_state(rank);
  if (!r.left.empty()) return;
  r.left = reason.empty() ? "it left" : reason;
  r.left_at_step = step;
  ++impl_->m.version;
}

void JobModel::rank_rejoined(std::uint32_t rank, std::int64_t step) {
  std::lock_guard lock(impl_->mutex);
  detail::RankState& r = impl_->m.rank_state(rank);
  if (r.left.empty()) return;
  r.returns.push_back(fmt::format("left at step {} ({}) and came back: it trains from step {} on", r.left_at_step,
                                  r.left, step + 1));
  r.left.clear();
  r.error.clear();
  r.finished = false;
  ++impl_->m.version;
}

void JobModel::set_outcome(bool ok, const std::string& reason) {
  std::lock_guard lock(impl_->mutex);
  impl_->m.outcome_known = true;
  impl_->m.outcome_ok = ok;
  impl_->m.outcome_reason = reason;
  ++impl_->m.version;
}

std::uint64_t JobModel::version() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.version;
}

JobStatus JobModel::status() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.status();
}

std::size_t JobModel::ranks_seen() const {
  std::lock_guard lock(impl_->mutex);
  return static_cast<std::size_t>(
      std::count_if(impl_->m.ranks.begin(), impl_->m.ranks.end(), [](const auto& r) { return r.hello; }));
}

std::uint64_t JobModel::bad_messages() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.bad_messages;
}

std::string JobModel::last_error() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.last_error;
}

std::string JobModel::plan_json() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.plan_json();
}

std::string JobModel::state_json() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.state_json();
}

std::string JobModel::history_json(std::size_t points) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.history_json(points);
}

std::string JobModel::timeline_json() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.timeline_json();
}

std::string JobModel::prometheus() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->m.prometheus();
}

}  // namespace baton::observe
