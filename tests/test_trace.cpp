// Traces: the Chrome trace of a run parses as JSON, has a track per worker and an event per
// act, and its events obey what the runtime enforces: an act starts after the acts it reads
// from ended, a producer waits for a free slot, and a pipeline stage keeps at most its depth of
// micro-batches in flight (1F1B). The rules are derived here from the plan, independently of
// the recorder's own bookkeeping.
#include <doctest/doctest.h>
#include <unistd.h>

#include <boost/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "baton/observe/trace.h"
#include "baton/transport/control.h"
#include "baton/transport/loopback.h"

using namespace baton;
namespace json = boost::json;
using namespace std::chrono_literals;

namespace {

// ---------------------------------------------------------------------------------------------
// Reading a trace back

std::int64_t ns_of(const json::value& v) { return std::llround(v.to_number<double>() * 1000.0); }

struct Slice {
  int pid = 0, tid = 0;
  std::int64_t ts = 0, dur = 0;
  std::string name, cat;
  std::int64_t piece = 0;
  json::object args;
  std::int64_t end() const { return ts + dur; }
};

struct FlowEnd {
  int pid = 0, tid = 0;
  std::int64_t ts = 0;
  std::string cat, name;
  bool bind_enclosing = false;
};

struct Counter {
  int pid = 0;
  std::int64_t ts = 0;
  std::string name;
  std::int64_t value = 0;
};

struct ParsedTrace {
  std::map<int, std::string> processes;               // pid -> name
  std::map<std::pair<int, int>, std::string> threads;  // (pid, tid) -> name
  std::vector<Slice> slices;
  std::map<std::uint64_t, FlowEnd> flow_starts, flow_ends;
  int duplicate_flow_ids = 0;
  std::vector<Counter> counters;
  json::object other;
  /// actor name -> its slices by piece (null where a piece is missing)
  std::map<std::string, std::vector<const Slice*>> acts;

  /// The worker a track belongs to: its own, or the one whose pulls it shows.
  std::string worker(int pid, int tid) const {
    const std::string& name = threads.at({pid, tid});
    return fmt::format("{}/{}", pid, name.substr(0, name.find(" pulls")));
  }
  const Slice* act(const std::string& actor, std::int64_t piece) const {
    auto it = acts.find(actor);
    if (it == acts.end() || piece < 0 || static_cast<std::size_t>(piece) >= it->second.size()) return nullptr;
    return it->second[static_cast<std::size_t>(piece)];
  }
  std::int64_t uncertainty(int pid) const {
    for (const auto& r : other.at("ranks").as_array()) {
      if (r.at("rank").to_number<int>() + 1 == pid) return r.at("clock_uncertainty_ns").to_number<std::int64_t>();
    }
    return 0;
  }
};

ParsedTrace parse_trace(const std::string& text) {
  ParsedTrace t;
  const json::value root = json::parse(text);  // throws if it is not JSON
  for (const auto& e : root.at("traceEvents").as_array()) {
    const auto& o = e.as_object();
    const std::string ph = json::value_to<std::string>(o.at("ph"));
    const int pid = o.at("pid").to_number<int>();
    if (ph == "M") {
      const std::string what = json::value_to<std::string>(o.at("name"));
      if (what == "process_name") t.processes[pid] = json::value_to<std::string>(o.at("args").at("name"));
      if (what == "thread_name") {
        t.threads[{pid, o.at("tid").to_number<int>()}] = json::value_to<std::string>(o.at("args").at("name"));
      }
    } else if (ph == "X") {
      Slice s;
      s.pid = pid;
      s.tid = o.at("tid").to_number<int>();
      s.ts = ns_of(o.at("ts"));
      s.dur = ns_of(o.at("dur"));
      s.name = json::value_to<std::string>(o.at("name"));
      s.cat = json::value_to<std::string>(o.at("cat"));
      s.args = o.at("args").as_object();
      s.piece = s.args.at("piece").to_number<std::int64_t>();
      t.slices.push_back(std::move(s));
    } else if (ph == "s" || ph == "f") {
      FlowEnd f;
      f.pid = pid;
      f.tid = o.at("tid").to_number<int>();
      f.ts = ns_of(o.at("ts"));
      f.cat = json::value_to<std::string>(o.at("cat"));
      f.name = json::value_to<std::string>(o.at("name"));
      f.bind_enclosing = o.contains("bp") && o.at("bp") == "e";
      auto& map = ph == "s" ? t.flow_starts : t.flow_ends;
      if (!map.emplace(o.at("id").to_number<std::uint64_t>(), f).second) ++t.duplicate_flow_ids;
    } else if (ph == "C") {
      Counter c;
      c.pid = pid;
      c.ts = ns_of(o.at("ts"));
      c.name = json::value_to<std::string>(o.at("name"));
      c.value = o.at("args").at("slots in use").to_number<std::int64_t>();
      t.counters.push_back(std::move(c));
    }
  }
  t.other = root.at("otherData").as_object();
  for (const Slice& s : t.slices) {
    auto& v = t.acts[s.name];
    if (v.size() <= static_cast<std::size_t>(s.piece)) v.resize(static_cast<std::size_t>(s.piece) + 1, nullptr);
    v[static_cast<std::size_t>(s.piece)] = &s;
  }
  return t;
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---------------------------------------------------------------------------------------------
// The rules a trace of a finished run obeys

/// The act of `p` that published piece q (an accumulate publishes at the end of its group).
std::int64_t writer(const ActorDesc& p, std::int64_t q) {
  return p.kind == ActorKind::accumulate ? q * p.group + p.group - 1 : q;
}

/// Every actor that acted has one slice per act, pieces 0..acts-1, on a named track; no slice
/// has a negative duration; the slices of one track do not overlap (a worker runs one act at a
/// time; pulls have lanes of their own); every act starts after the acts that wrote what it reads ended
/// (within `slack` ns: clock uncertainty across ranks); a producer writes piece p + slots only
/// after every consumer finished reading piece p.
void check_acts_follow_the_plan(const Plan& plan, const ParsedTrace& t, const std::map<std::string, std::uint64_t>& acts,
                                std::int64_t slack = 0) {
  std::uint64_t total = 0;
  for (const auto& [name, n] : acts) {
    total += n;
    if (n == 0) continue;
    CAPTURE(name);
    auto it = t.acts.find(name);
    REQUIRE(it != t.acts.end());
    CHECK(it->second.size() == n);
    for (const Slice* s : it->second) REQUIRE(s != nullptr);
  }
  CHECK(t.slices.size() == total);
  std::map<std::pair<int, int>, std::vector<const Slice*>> per_thread;
  for (const Slice& s : t.slices) {
    CHECK(s.dur >= 0);
    REQUIRE(t.threads.count({s.pid, s.tid}) == 1);
    CHECK((s.cat == "transfer") == (t.threads.at({s.pid, s.tid}).find(" pulls") != std::string::npos));
    per_thread[{s.pid, s.tid}].push_back(&s);
  }
  for (auto& [thread, slices] : per_thread) {
    std::sort(slices.begin(), slices.end(), [](auto* a, auto* b) { return a->ts < b->ts; });
    for (std::size_t i = 1; i < slices.size(); ++i) {
      INFO(slices[i - 1]->name << "#" << slices[i - 1]->piece << " then " << slices[i]->name << "#" << slices[i]->piece);
      CHECK(slices[i]->ts >= slices[i - 1]->end());
    }
  }
  // Dataflow: act k of a consumer reads piece k / ratio - delay of each input.
  std::int64_t edges = 0;
  for (const ActorDesc& c : plan.actors) {
    const std::int64_t ratio = c.kind == ActorKind::repeat ? c.group : 1;
    for (const InputPort& port : c.inputs) {
      const ActorDesc& p = plan.actors[plan.registers[port.reg].producer];
      auto it = t.acts.find(c.name);
      if (it == t.acts.end()) continue;
      for (const Slice* s : it->second) {
        const std::int64_t q = s->piece / ratio - port.delay;
        if (q < 0) continue;
        const Slice* w = t.act(p.name, writer(p, q));
        INFO(c.name << "#" << s->piece << " reads " << p.name << "#" << writer(p, q));
        REQUIRE(w != nullptr);
        CHECK(s->ts + slack >= w->end());
        ++edges;
      }
    }
  }
  CHECK(edges > 0);
  // Slots: piece p + slots is written only once piece p is freed (every reader acked it).
  std::int64_t waits = 0;
  for (const RegisterDesc& r : plan.registers) {
    const ActorDesc& p = plan.actors[r.producer];
    if (p.kind != ActorKind::compute && p.kind != ActorKind::source) continue;
    bool simple = true;
    for (ActorIndex c : r.consumers) simple = simple && plan.actors[c].kind != ActorKind::repeat;
    if (!simple) continue;
    auto it = t.acts.find(p.name);
    if (it == t.acts.end()) continue;
    for (std::int64_t piece = 0; piece + r.slots < static_cast<std::int64_t>(it->second.size()); ++piece) {
      const Slice* later = t.act(p.name, piece + r.slots);
      for (ActorIndex ci : r.consumers) {
        const ActorDesc& c = plan.actors[ci];
        for (const InputPort& port : c.inputs) {
          if (port.reg != static_cast<RegisterIndex>(&r - plan.registers.data())) continue;
          const Slice* reader = t.act(c.name, piece + port.delay);
          if (reader == nullptr) continue;  // it stopped reading: nothing to wait for
          INFO(p.name << "#" << piece + r.slots << " waits for " << c.name << "#" << reader->piece << " (" << r.name
                      << ", " << r.slots << " slots)");
          CHECK(later->ts + slack >= reader->end());
          ++waits;
        }
      }
    }
  }
  CHECK(waits > 0);
}

/// Arrows: every start has its end (same category and name), on another worker, the end not
/// before the start (within the clocks' uncertainty), each end inside a slice of its thread;
/// and there is one for every request that crossed workers, as the plan and the slices say.
void check_flows(const Plan& plan, const ParsedTrace& t) {
  CHECK(t.duplicate_flow_ids == 0);
  CHECK(t.flow_starts.size() == t.flow_ends.size());
  auto inside_a_slice = [&](const FlowEnd& f) {
    for (const Slice& s : t.slices) {
      if (s.pid == f.pid && s.tid == f.tid && s.ts <= f.ts && f.ts <= s.end()) return true;
    }
    return false;
  };
  for (const auto& [id, s] : t.flow_starts) {
    CAPTURE(id);
    auto it = t.flow_ends.find(id);
    REQUIRE(it != t.flow_ends.end());
    const FlowEnd& f = it->second;
    CHECK(f.cat == s.cat);
    CHECK(f.name == s.name);
    CHECK(f.bind_enclosing);
    CHECK(t.worker(s.pid, s.tid) != t.worker(f.pid, f.tid));
    CHECK(f.ts + t.uncertainty(s.pid) + t.uncertainty(f.pid) >= s.ts);
    CHECK(inside_a_slice(s));
    CHECK(inside_a_slice(f));
  }
  std::size_t expected = 0;
  for (const ActorDesc& c : plan.actors) {
    const std::int64_t ratio = c.kind == ActorKind::repeat ? c.group : 1;
    std::set<RegisterIndex> seen;
    for (const InputPort& port : c.inputs) {
      if (!seen.insert(port.reg).second) continue;
      const ActorDesc& p = plan.actors[plan.registers[port.reg].producer];
      auto it = t.acts.find(c.name);
      if (it == t.acts.end()) continue;
      for (const Slice* s : it->second) {
        const std::int64_t q = s->piece / ratio - port.delay;
        const Slice* w = q < 0 ? nullptr : t.act(p.name, writer(p, q));
        if (w != nullptr && t.worker(w->pid, w->tid) != t.worker(s->pid, s->tid)) ++expected;
      }
    }
  }
  CHECK(expected > 0);
  CHECK(t.flow_starts.size() == expected);
}

void check_counters(const Plan& plan, const ParsedTrace& t) {
  CHECK(!t.counters.empty());
  std::map<std::string, std::int32_t> slots;
  for (const auto& r : plan.registers) slots[r.name] = r.slots;
  for (const Counter& c : t.counters) {
    CAPTURE(c.name);
    REQUIRE(slots.count(c.name) == 1);
    CHECK(c.value >= 0);
    CHECK(c.value <= slots[c.name]);
  }
}

// ---------------------------------------------------------------------------------------------
// A small MLP trained as a pipeline (as in test_parallel.cpp)

TrainingJob mlp_job(int pp, const std::string& schedule, std::int64_t microbatches, std::int64_t steps,
                    std::vector<Placement> places = {}, int dp = 1, std::int64_t bucket_bytes = 25 << 20) {
  constexpr std::int64_t batch = 32, width = 12, classes = 4;
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(256, width, classes, 99));
  Graph g(5);
  const std::int64_t mb = batch / (microbatches * dp);
  auto x = g.input("x", {mb, width});
  auto y = g.input("label", {mb}, i32);
  auto w1 = g.variable("w1", {width, 16}, init::kaiming());
  auto b1 = g.variable("b1", {16}, init::zeros());
  auto w2 = g.variable("w2", {16, classes}, init::kaiming());
  auto b2 = g.variable("b2", {classes}, init::zeros());
  auto loss = softmax_cross_entropy(matmul(relu(matmul(x, w1) + b1), w2) + b2, y);
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = microbatches;
  cfg.pp = pp;
  cfg.dp = dp;
  cfg.bucket_bytes = bucket_bytes;
  cfg.schedule = schedule;
  cfg.replica_places = std::move(places);
  cfg.optimizer = optim::sgd(0.1, 0.9);
  cfg.data = {{"synthetic", data::batch_source(dataset, batch, microbatches * dp, 7), {"x", "label"}}};
  return compile_training(g, loss, cfg);
}

std::map<std::string, std::uint64_t> acts_of(const RunReport& report) {
  std::map<std::string, std::uint64_t> acts;
  for (const auto& a : report.metrics.actors) acts[a.name] = a.acts;
  return acts;
}

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() / fmt::format("baton-test-{}-{}", ::getpid(), name);
}

}  // namespace

TEST_CASE("Trace.PipelineTraceFollowsTheSchedule" * doctest::timeout(120)) {
  constexpr int pp = 2;
  constexpr std::int64_t m = 4, steps = 6;
  for (const std::string schedule : {"1f1b", "gpipe"}) {
    CAPTURE(schedule);
    TrainingJob job = mlp_job(pp, schedule, m, steps);
    observe::TraceOptions options;
    options.period = 2ms;  // samples of the registers while it runs
    observe::TraceObserver tracer(options);
    JobSettings js;
    js.runtime.activity_log = true;
    js.runtime.stall_timeout = 20s;
    js.observer = &tracer;
    const RunReport report = run_job(job.plan, job.kernels, JobEnvironment{}, js);
    const auto path = temp_path("pipeline.trace.json");
    tracer.recorder().write_file(path.string());
    const ParsedTrace t = parse_trace(read_file(path));
    std::filesystem::remove(path);

    CHECK(t.other.at("truncated") == false);
    CHECK_FALSE(t.other.contains("allreduce_overlap"));  // no gradient all-reduce without dp
    REQUIRE(t.other.at("ranks").as_array().size() == 1);
    CHECK(t.other.at("ranks").at(0).at("dropped") == 0);
    CHECK(t.other.at("ranks").at(0).at("finished") == true);
    CHECK(t.other.at("microbatches") == m);
    // One process (rank 0), one named thread per worker: a device per stage.
    REQUIRE(t.processes.size() == 1);
    CHECK(t.processes.begin()->first == 1);
    CHECK(t.processes.begin()->second.starts_with("rank 0"));
    std::set<std::string> workers;
    for (const auto& [thread, name] : t.threads) workers.insert(name);
    CHECK(t.threads.size() == 2);
    CHECK(workers == std::set<std::string>{"cpu:0/s0", "cpu:1/s0"});

    check_acts_follow_the_plan(job.plan, t, acts_of(report));
    check_flows(job.plan, t);
    check_counters(job.plan, t);

    // Each stage does its M forwards and M backwards of every step, micro-batch by micro-batch.
    const std::int64_t pieces = m * steps;
    std::map<int, std::map<std::int64_t, std::int64_t>> forward_start, backward_end;  // stage -> piece -> ns
    for (const Slice& s : t.slices) {
      if (s.cat != "forward" && s.cat != "backward") continue;
      const int stage = s.args.at("stage").to_number<int>();
      CHECK(s.args.at("step").to_number<std::int64_t>() == s.piece / m);
      CHECK(s.args.at("micro-batch").to_number<std::int64_t>() == s.piece % m);
      auto& slot = s.cat == "forward" ? forward_start[stage] : backward_end[stage];
      auto [it, fresh] = slot.emplace(s.piece, s.cat == "forward" ? s.ts : s.end());
      if (!fresh) it->second = std::min(it->second, s.cat == "forward" ? s.ts : s.end());
    }
    for (int stage = 0; stage < pp; ++stage) {
      CAPTURE(stage);
      REQUIRE(forward_start[stage].size() == static_cast<std::size_t>(pieces));
      REQUIRE(backward_end[stage].size() == static_cast<std::size_t>(pieces));
      CHECK(forward_start[stage].rbegin()->first == pieces - 1);
      CHECK(backward_end[stage].rbegin()->first == pieces - 1);
      // The schedule is the depth of the stage's registers: 1F1B keeps pp - stage micro-batches
      // in flight, GPipe M. Micro-batch i + depth starts its forward only once the stage has
      // finished a backward op of micro-batch i (which frees the slot it was waiting for).
      const std::int64_t depth = schedule == "1f1b" ? pp - stage : m;
      for (std::int64_t i = 0; i + depth < pieces; ++i) {
        INFO("forward " << i + depth << " vs backward " << i);
        CHECK(forward_start[stage][i + depth] >= backward_end[stage][i]);
      }
    }
  }
}

TEST_CASE("Trace.TwoRanksMergeIntoOneTraceOnOneClock" * doctest::timeout(120)) {
  // Stage 0 on rank 0, stage 1 on rank 1: activations and gradients cross through transfer
  // actors. Each rank's records travel as "trace" telemetry bodies into one collector.
  const std::vector<Placement> places{{.rank = 0}, {.rank = 1}};
  TrainingJob job = mlp_job(2, "1f1b", 4, 5, places);
  const Plan plan = insert_transfers(job.plan);
  transport::LoopbackHub hub(2);
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (std::uint16_t r = 0; r < 2; ++r) {
    RuntimeSettings s;
    s.rank = r;
    s.link = &hub.link(r);
    s.activity_log = true;
    s.stall_timeout = 20s;
    runtimes.push_back(std::make_unique<Runtime>(plan, job.kernels, s));
  }
  hub.start();
  std::vector<RunReport> reports(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (std::uint16_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        reports[r] = runtimes[r]->run();
      } catch (const std::exception& e) {
        errors[r] = e.what();
        runtimes[1 - r]->abort(e.what());
      }
    });
  }
  for (auto& th : threads) th.join();
  hub.stop();
  REQUIRE_MESSAGE(errors[0].empty(), errors[0]);
  REQUIRE_MESSAGE(errors[1].empty(), errors[1]);

  observe::TraceCollector collector;
  std::map<std::string, std::uint64_t> acts;
  for (std::uint32_t r = 0; r < 2; ++r) {
    std::vector<ActRecord> records;
    runtimes[r]->drain_activity(records);
    // Small bodies, so that the records of a rank really travel in many parts.
    observe::TraceStream stream(
        [&, r](const std::string& body) {
          REQUIRE(body.size() <= 4096);
          collector.on_telemetry(transport::Telemetry{r, observe::trace_kind, body});
        },
        0, 4096);
    stream.begin(observe::TraceRank{.rank = r, .host = "testhost", .workers = runtimes[r]->worker_names()}, plan, 0);
    stream.acts(records);
    stream.end(runtimes[r]->activity_dropped(), "");
    for (const auto& [name, n] : acts_of(reports[r])) acts[name] += n;
  }
  CHECK(collector.ranks() == 2);
  CHECK(collector.finished() == 2);
  const ParsedTrace t = parse_trace(collector.merge().json());

  CHECK(t.processes == std::map<int, std::string>{{1, "rank 0 (testhost)"}, {2, "rank 1 (testhost)"}});
  const auto& ranks = t.other.at("ranks").as_array();
  REQUIRE(ranks.size() == 2);
  for (const auto& r : ranks) {
    CHECK(r.at("finished") == true);
    CHECK(r.at("clock_uncertainty_ns") == 0);  // one process: one clock
  }
  int transfers_on[3] = {0, 0, 0};
  for (const Slice& s : t.slices) {
    if (s.cat == "transfer") ++transfers_on[s.pid];
  }
  CHECK(transfers_on[1] > 0);  // gradients come back to stage 0
  CHECK(transfers_on[2] > 0);  // activations go to stage 1
  check_acts_follow_the_plan(plan, t, acts);
  check_flows(plan, t);
  int across = 0;
  for (const auto& [id, s] : t.flow_starts) across += s.pid != t.flow_ends.at(id).pid;
  CHECK(across > 0);
}

TEST_CASE("Trace.EachRanksClockOffsetMovesItsEvents") {
  // Rank 0 shares this machine's boot (and its measured offset is within its error of 0): its
  // clock is ours. Rank 1 is "elsewhere", 5 s ahead of the server, measured with a 2 ms round
  // trip: its events move back by 5 s and carry 1 ms of uncertainty.
  std::string boot;
  std::getline(std::ifstream("/proc/sys/kernel/random/boot_id"), boot);
  REQUIRE(!boot.empty());
  observe::TraceCollector collector;
  auto send = [&](std::uint32_t rank, const std::string& body) {
    collector.on_telemetry(transport::Telemetry{rank, observe::trace_kind, body});
  };
  Plan plan;
  auto out = plan.add_register({.name = "a.out", .shape = {1}, .slots = 2});
  plan.add_actor({.name = "a", .kind = ActorKind::source, .op = "fill_piece", .where = {.rank = 0}, .outputs = {out}, .pieces = 1});
  plan.add_actor({.name = "b", .op = "noop", .where = {.rank = 1}, .inputs = {{out}}});
  send(0, fmt::format(R"({{"part":"meta","session":0,"rank":0,"host":"h0","boot_id":"{}","clock_offset_ns":400,)"
                      R"("clock_rtt_ns":10000,"workers":["cpu:0/s0"]}})",
                      boot));
  send(1, R"({"part":"meta","session":0,"rank":1,"host":"h1","boot_id":"elsewhere","clock_offset_ns":-5000000000,)"
          R"("clock_rtt_ns":2000000,"workers":["cpu:0/s0"]})");
  for (std::uint32_t r = 0; r < 2; ++r) {
    // The plan, the records and the end; the meta sent above says where the rank is.
    observe::TraceStream stream(
        [&, r](const std::string& body) {
          if (!body.starts_with(R"({"part":"meta")")) send(r, body);
        },
        0, 1 << 16);
    stream.begin(observe::TraceRank{.rank = r}, plan, 0);
    const ActRecord record = r == 0 ? ActRecord{0, 0, 1'000'000, 2'000'000, 0} : ActRecord{1, 0, 5'003'000'000, 5'003'500'000, 0};
    stream.acts(std::span(&record, 1));
    stream.end(0, "");
  }
  const ParsedTrace t = parse_trace(collector.merge().json());
  const auto& ranks = t.other.at("ranks").as_array();
  REQUIRE(ranks.size() == 2);
  CHECK(ranks[0].at("clock_offset_ns") == 0);
  CHECK(ranks[0].at("clock_uncertainty_ns") == 0);
  CHECK(ranks[1].at("clock_offset_ns") == -5'000'000'000LL);
  CHECK(ranks[1].at("clock_uncertainty_ns") == 1'000'000);
  REQUIRE(t.act("a", 0) != nullptr);
  REQUIRE(t.act("b", 0) != nullptr);
  CHECK(t.act("a", 0)->ts == 0);  // the earliest event is the origin
  CHECK(t.act("b", 0)->ts == 2'000'000);  // 5.003 s - 5 s - 1 ms
  CHECK(t.act("b", 0)->dur == 500'000);
  REQUIRE(t.flow_starts.size() == 1);  // b read a's piece 0 across ranks
  CHECK(t.flow_starts.begin()->second.pid == 1);
  CHECK(t.flow_ends.begin()->second.pid == 2);
  check_flows(plan, t);
}

TEST_CASE("Trace.TheCapCutsTheFileAndSaysSo") {
  Plan plan;
  auto out = plan.add_register({.name = "src.out", .shape = {1}});
  plan.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {out}, .pieces = 25});
  plan.add_actor({.name = "sink", .op = "noop", .where = {.stream = 1}, .inputs = {{out}}});
  observe::TraceRecorder recorder(observe::TraceLimits{.max_events = 30});
  recorder.add_plan(plan);
  recorder.add_rank(observe::TraceRank{.rank = 0, .workers = {"cpu:0/s0", "cpu:0/s1"}});
  std::vector<ActRecord> src, sink;
  for (std::int64_t k = 0; k < 25; ++k) {
    const auto t0 = static_cast<std::uint64_t>(k) * 1000;
    src.push_back(ActRecord{0, k, t0, t0 + 100, 0});
    sink.push_back(ActRecord{1, k, t0 + 200, t0 + 300, 1});
  }
  recorder.add_acts(0, src);
  recorder.add_acts(0, sink);
  CHECK(recorder.acts() == 30);
  const ParsedTrace t = parse_trace(recorder.json());
  CHECK(t.slices.size() == 30);
  CHECK(t.flow_starts.empty());  // no room left for arrows
  CHECK(t.other.at("truncated") == true);
  CHECK(t.other.at("left_out").at("acts") == 20);
  CHECK(t.other.at("left_out").at("flows") == 5);  // the 5 sink acts kept read 5 source pieces
  CHECK(json::value_to<std::string>(t.other.at("notes").at(0)).starts_with("cut at 30 events"));
}

TEST_CASE("Trace.RecordingOnDemandKeepsOnlyTheWindow" * doctest::timeout(60)) {
  // The dashboard's "record N seconds": the log is off until the command comes, on for the
  // window, off again.
  Plan plan;
  auto x = plan.add_register({.name = "x", .shape = {16}, .slots = 2});
  auto y = plan.add_register({.name = "y", .shape = {16}, .slots = 2});
  plan.add_actor({.name = "source", .kind = ActorKind::source, .op = "fill_piece", .outputs = {x}, .pieces = 50'000'000});
  plan.add_actor({.name = "work", .op = "spin_ns", .where = {.stream = 1}, .inputs = {{x}}, .outputs = {y},
                  .attrs = {{"ns", std::int64_t{20'000}}}});
  plan.add_actor({.name = "sink", .op = "noop", .where = {.stream = 1}, .inputs = {{y}}});
  RuntimeSettings rs;
  rs.activity_log = true;
  Runtime rt(plan, KernelRegistry::with_builtin_kernels(), rs);
  observe::TraceOptions options;
  options.whole_run = false;
  options.period = 2ms;
  observe::TraceObserver tracer(options);
  tracer.on_start(rt, nullptr);
  std::string error;
  std::thread runner([&] {
    try {
      rt.run();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  auto acts_of_work = [&] {
    for (const auto& a : rt.snapshot().actors) {
      if (a.name == "work") return a.acts;
    }
    return std::uint64_t{0};
  };
  auto wait_for = [](const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (!done() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    return done();
  };
  const bool warmed_up = wait_for([&] { return acts_of_work() >= 200; });
  CHECK(tracer.recorded() == 0);
  tracer.on_command("trace", R"({"session": 7, "seconds": 0.05})");
  const bool started = wait_for([&] { return tracer.recording(); });
  const bool ended = started && wait_for([&] { return !tracer.recording(); });
  rt.abort("the test has its window");
  runner.join();
  tracer.on_finish(rt, error);
  REQUIRE(warmed_up);
  REQUIRE(started);
  REQUIRE(ended);
  CHECK(error.find("the test has its window") != std::string::npos);

  const ParsedTrace t = parse_trace(tracer.recorder().json());
  REQUIRE(t.acts.count("work") == 1);
  const auto& work = t.acts.at("work");
  std::int64_t first = -1, kept = 0;
  for (const Slice* s : work) {
    if (s == nullptr) {
      CHECK(first < 0);  // the pieces before the window, and none missing inside it
      continue;
    }
    if (first < 0) first = s->piece;
    ++kept;
  }
  CHECK(first >= 200);
  CHECK(kept > 0);
  CHECK(static_cast<std::uint64_t>(kept) <= tracer.recorded());
  CHECK(t.other.at("ranks").at(0).at("finished") == true);
  CHECK(t.other.at("ranks").at(0).at("error") == "");  // the window closed before the abort
}

TEST_CASE("Trace.TheServerAsksForAWindowAndGetsItOverTheControlPlane" * doctest::timeout(60)) {
  // What the dashboard's "record N seconds" does: the server sends the command, the rank streams
  // that window as telemetry, the collector merges it.
  observe::TraceCollector collector;
  transport::ServerSettings ss;
  ss.bind_host = "127.0.0.1";
  ss.token = "0123456789abcdef0123456789abcdef";
  ss.world_size = 1;
  ss.on_telemetry = [&](transport::Telemetry t) { collector.on_telemetry(t); };
  transport::RendezvousServer server(ss);
  transport::ControlClient client(transport::ClientSettings{
      .master = fmt::format("127.0.0.1:{}", server.port()), .token = ss.token, .rank = 0, .world_size = 1,
      .join_timeout = 10s});
  observe::TraceOptions options;
  options.whole_run = false;
  options.period = 2ms;
  observe::TraceObserver tracer(options);
  client.on_command([&](const std::string& kind, const std::string& body) { tracer.on_command(kind, body); });
  client.join(transport::RankInfo{});

  Plan plan;
  auto x = plan.add_register({.name = "x", .shape = {16}, .slots = 2});
  plan.add_actor({.name = "source", .kind = ActorKind::source, .op = "fill_piece", .outputs = {x}, .pieces = 50'000'000});
  plan.add_actor({.name = "work", .op = "spin_ns", .where = {.stream = 1}, .inputs = {{x}},
                  .attrs = {{"ns", std::int64_t{20'000}}}});
  RuntimeSettings rs;
  rs.activity_log = true;
  Runtime rt(plan, KernelRegistry::with_builtin_kernels(), rs);
  tracer.on_start(rt, &client);
  std::string error;
  std::thread runner([&] {
    try {
      rt.run();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  auto wait_for = [](const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (!done() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    return done();
  };
  const bool warmed_up = wait_for([&] { return rt.snapshot().total_acts() >= 400; });
  server.send_command("trace", R"({"session": 3, "seconds": 0.05})");
  const bool ended = wait_for([&] { return collector.finished(3) == 1; });
  rt.abort("the test has its window");
  runner.join();
  tracer.on_finish(rt, error);
  REQUIRE(warmed_up);
  REQUIRE(ended);

  CHECK(collector.ranks(0) == 0);  // no whole-run trace was asked for
  const ParsedTrace t = parse_trace(collector.merge(3).json());
  CHECK(t.processes.size() == 1);
  CHECK(t.threads.size() == 2);
  REQUIRE(t.acts.count("work") == 1);
  std::int64_t first = -1, kept = 0;
  for (const Slice* s : t.acts.at("work")) {
    if (s == nullptr) {
      CHECK(first < 0);  // before the window; none missing inside it
      continue;
    }
    if (first < 0) first = s->piece;
    ++kept;
  }
  CHECK(first >= 100);
  CHECK(kept > 0);
  const auto& rank = t.other.at("ranks").at(0);
  CHECK(rank.at("finished") == true);
  CHECK(rank.at("error") == "");
  CHECK(rank.at("clock_uncertainty_ns") == 0);  // the server's host: its clock
}

// With data parallelism the trace says how much of the gradients' all-reduces ran beside the
// backward pass (collective_overlap over the acts it holds), in all and per all-reduce: here one
// per weight (bucket_bytes 0), so four.
TEST_CASE("Trace.DataParallelTraceSaysHowMuchOfEachAllReduceOverlapsTheBackwardPass" * doctest::timeout(60)) {
  TrainingJob job = mlp_job(1, "1f1b", 2, 8, {}, /*dp=*/2, /*bucket_bytes=*/0);
  observe::TraceObserver tracer;
  JobSettings js;
  js.runtime.activity_log = true;
  js.observer = &tracer;
  run_job(job.plan, job.kernels, JobEnvironment{}, js);
  const ParsedTrace t = parse_trace(tracer.recorder().json());
  REQUIRE(t.other.contains("allreduce_overlap"));
  const auto& o = t.other.at("allreduce_overlap").as_object();
  CHECK(o.at("fraction").to_number<double>() >= 0.0);
  CHECK(o.at("fraction").to_number<double>() <= 1.0);
  CHECK(o.at("allreduce_s").to_number<double>() > 0.0);
  std::set<std::string> names;
  for (const auto& [name, f] : o.at("by_allreduce").as_object()) {
    names.insert(std::string(name));
    CHECK(f.to_number<double>() >= 0.0);
    CHECK(f.to_number<double>() <= 1.0);
  }
  CHECK(names == std::set<std::string>{"grad.b1", "grad.b2", "grad.w1", "grad.w2"});
}
