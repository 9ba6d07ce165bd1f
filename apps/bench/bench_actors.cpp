// baton-bench-actors: what the actor runtime costs. Each case builds a plan, runs it on a fresh
// baton::Runtime (default settings, threaded mode) and prints one JSON line to stdout; where a
// raw reference exists (the same protocol hand-written without the runtime) it is measured in
// the same run and printed next to it. The chain cases (chain_noop, metg) also run the same
// 4-stage chain, with the same kernels, pieces and threads, on TBB's flow graph and on CAF
// actors (actor_peers.h), interleaved with baton's runs. Human-readable notes go to stderr.
//
//   baton-bench-actors            every case, ~120 ms per measured run, best of 3
//   baton-bench-actors --quick    10x fewer pieces and a short METG sweep (the CTest smoke run)
//   baton-bench-actors --case cross_thread
//   baton-bench-actors --case trace        what recording a trace costs (activity log + drain)
//   baton-bench-actors --case metg --require-peers   exit 77 unless TBB and CAF were built in
//
// METG is Task Bench's "minimum effective task granularity" (Slaughter et al., SC'20): the
// smallest task at which the system still reaches 50% of the ideal throughput (the same tasks
// run back to back on the same number of cores). Each system gets its own METG from the same
// sweep; "ratio_<peer>" = the peer's METG / baton's (above 1: baton runs finer tasks). Every
// ratio says how many times better baton is (json_line.h): above 1, baton is better.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <boost/lockfree/queue.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "actor_peers.h"
#include "json_line.h"
#include "skip.h"
#include "baton/actors.h"
#include "baton/kernels.h"
#include "baton/observe/trace.h"
#include "baton/observe/collector.h"
#include "baton/observe/job_model.h"

namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
  bool quick = false;
  bool require_peers = false;  // exit 77 (CTest's skip) if TBB or CAF was not built in
  std::string only;            // run cases whose name starts with this
};

constexpr std::string_view case_names[] = {"same_thread_hop",
                                           "cross_thread_stream_slots1",
                                           "cross_thread_stream_slots2",
                                           "cross_thread_stream_slots4",
                                           "cross_thread_hop_latency",
                                           "chain_noop",
                                           "metg",
                                           "trace_overhead_noop",
                                           "trace_overhead_spin2us",
                                           "metrics_overhead"};

[[noreturn]] void usage(int code) {
  std::FILE* f = code == 0 ? stdout : stderr;
  fmt::print(f,
             "usage: baton-bench-actors [--quick] [--case NAME] [--require-peers] [--allow-load] [--help]\n"
             "  Measures the actor runtime and prints one JSON line per case to stdout.\n"
             "  --quick          10x fewer pieces and a shorter METG sweep (smoke test)\n"
             "  --case NAME      run only the cases whose name starts with NAME\n"
             "  --require-peers  exit 77 if the TBB flow graph or CAF peer was not built in\n"
             "{}"
             "  cases: {}\n",
             baton::bench::allow_load_usage, fmt::join(case_names, ", "));
  std::exit(code);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "-h" || a == "--help") {
      usage(0);
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--require-peers") {
      o.require_peers = true;
    } else if (a == "--case") {
      if (i + 1 >= argc) {
        fmt::print(stderr, "baton-bench-actors: --case needs a NAME\n");
        usage(2);
      }
      o.only = argv[++i];
    } else if (a.starts_with("--case=")) {
      o.only = std::string(a.substr(7));
    } else {
      fmt::print(stderr, "baton-bench-actors: unknown argument '{}'\n", a);
      usage(2);
    }
  }
  if (!o.only.empty() && std::none_of(std::begin(case_names), std::end(case_names),
                                      [&](std::string_view n) { return n.starts_with(o.only); })) {
    fmt::print(stderr, "baton-bench-actors: no case starts with '{}'\n", o.only);
    usage(2);
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// Knobs

/// Measured runs per case; the best is reported (and the median alongside).
constexpr int repeats = 3;
/// How long one measured run should last: long enough that thread start and the pipeline's
/// fill and drain are noise.
constexpr double target_run_s = 0.12;
/// --quick runs that much shorter (10x fewer pieces).
constexpr double quick_factor = 0.1;
/// A raw reference that has not finished by then has lost a message: give up on it.
constexpr double reference_timeout_s = 30.0;
/// Upper bound on the pieces of any run, whatever the calibration says.
constexpr std::int64_t max_pieces = 100'000'000;

// ---------------------------------------------------------------------------------------------
// JSON lines: flat objects of strings and finite numbers, one per line on stdout.

using baton::bench::Better;

/// This benchmark's lines (see json_line.h).
struct JsonLine : baton::bench::JsonLine {
  explicit JsonLine(std::string_view case_name) : baton::bench::JsonLine("actors", case_name) {}
};

// ---------------------------------------------------------------------------------------------
// Measuring

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// One run of a case: its wall time and what the runtime counted.
struct Sample {
  double wall_s = 0;
  std::uint64_t messages = 0;
  std::uint64_t parks = 0;
};

/// Runs a case once with the given number of pieces.
using Runner = std::function<Sample(std::int64_t pieces)>;

/// A measured case: the piece count, its best (shortest) and its median run.
struct Measured {
  std::int64_t pieces = 0;
  Sample best;
  Sample median;
};

/// Finds how many pieces make a run last about `target_s`: pilot runs grow the count until one
/// lasts a tenth of the target, then scale linearly. The pilots double as warm-up.
std::int64_t calibrate(const Runner& run_pieces, std::int64_t start, double target_s, std::int64_t min_pieces) {
  std::int64_t n = std::max<std::int64_t>(start, 1);
  double wall = run_pieces(n).wall_s;
  for (int i = 0; i < 32 && wall < target_s / 10 && n < max_pieces; ++i) {
    double grow = std::clamp(target_s / 10 / std::max(wall, 1e-6) * 1.5, 2.0, 16.0);
    n = std::min<std::int64_t>(max_pieces, static_cast<std::int64_t>(static_cast<double>(n) * grow));
    wall = run_pieces(n).wall_s;
  }
  double scaled = static_cast<double>(n) * target_s / std::max(wall, 1e-9);
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(scaled), min_pieces, max_pieces);
}

// ---------------------------------------------------------------------------------------------
// Plans and runs on baton

struct Stage {
  std::string name;
  std::uint8_t stream = 0;
  std::string op = "noop";
  baton::Attrs attrs;
};

/// A chain: stages[0] is the source, the last stage the sink; zero-byte f32 registers with
/// `slots` slots between neighbours.
baton::Plan chain_plan(const std::vector<Stage>& stages, std::int64_t pieces, int slots) {
  using namespace baton;
  Plan plan;
  RegisterIndex prev = 0;
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const Stage& s = stages[i];
    ActorDesc a{.name = s.name, .op = s.op, .where = {.stream = s.stream}, .attrs = s.attrs};
    if (i == 0) {
      a.kind = ActorKind::source;
      a.pieces = pieces;
    } else {
      a.inputs = {{prev}};
    }
    if (i + 1 < stages.size()) {
      prev = plan.add_register({.name = s.name + ".out", .shape = {0}, .dtype = f32, .slots = slots});
      a.outputs = {prev};
    }
    plan.add_actor(std::move(a));
  }
  return plan;
}

/// Runs the plan once on a fresh Runtime and checks that the sink saw every piece.
/// What one read of baton::ticks() costs here, in ns (the best of 5 runs of 10^6 reads).
double clock_read_ns() {
  static const double ns = [] {
    constexpr int reads = 1'000'000;
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      std::uint64_t sum = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reads; ++i) sum += baton::ticks();
      const double took = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      asm volatile("" : : "r"(sum) : "memory");  // the reads are used: the loop stays
      best = std::min(best, took / reads);
    }
    return best;
  }();
  return ns;
}

Sample run_baton(const baton::Plan& plan, const baton::KernelRegistry& kernels,
                 const baton::RuntimeSettings& settings = {}) {
  baton::Runtime rt(plan, kernels, settings);
  baton::RunReport report = rt.run();
  const auto& sink = plan.actors.back();
  const std::int64_t expected = plan.actors.front().pieces;
  for (const auto& a : report.metrics.actors) {
    if (a.name == sink.name && a.acts != static_cast<std::uint64_t>(expected)) {
      throw std::runtime_error(fmt::format("sink '{}' acted {} times for {} pieces", sink.name, a.acts, expected));
    }
  }
  return {report.wall_s, report.messages, report.parks};
}

/// The same, with the activity log on and a TraceObserver draining it into a recorder (what
/// baton-train --trace does); the records it kept and the ones lost to full rings come back.
struct TracedSample {
  Sample sample;
  std::uint64_t recorded = 0;
  std::uint64_t dropped = 0;
};
TracedSample run_baton_traced(const baton::Plan& plan, const baton::KernelRegistry& kernels) {
  baton::RuntimeSettings settings;
  settings.activity_log = true;
  baton::Runtime rt(plan, kernels, settings);
  baton::observe::TraceObserver tracer;
  tracer.on_start(rt, nullptr);
  baton::RunReport report;
  try {
    report = rt.run();
  } catch (...) {
    tracer.on_finish(rt, "failed");
    throw;
  }
  tracer.on_finish(rt, {});
  return {{report.wall_s, report.messages, report.parks}, tracer.recorded(), rt.activity_dropped()};
}

// ---------------------------------------------------------------------------------------------
// Raw references: the same protocols without the runtime.

/// The same credit protocol as a same-thread chain of K actors (request downstream and ack
/// upstream per hop, `slots` credits per edge), hand-coded over one baton::LocalQueue with a
/// switch dispatch on one thread. No kernels, no metrics, no end-of-stream.
Sample raw_same_thread_chain(int k, std::int64_t pieces, int slots) {
  struct RawStage {
    std::int64_t received = 0;  // requests seen from upstream
    std::int64_t acts = 0;      // pieces processed (and published downstream)
    std::int64_t freed = 0;     // pieces acked by downstream
  };
  const auto t0 = Clock::now();
  std::vector<RawStage> st(static_cast<std::size_t>(k));
  baton::LocalQueue queue(1024);
  std::uint64_t messages = 0;
  auto can_act = [&](std::size_t i) {
    const RawStage& s = st[i];
    const bool has_input = i == 0 ? s.acts < pieces : s.received > s.acts;
    const bool has_slot = i + 1 == st.size() || s.acts - s.freed < slots;
    return has_input && has_slot;
  };
  auto advance = [&](std::size_t i) {
    while (can_act(i)) {
      const std::int64_t p = st[i].acts++;
      const auto slot = static_cast<std::uint16_t>(p % slots);
      if (i + 1 < st.size()) {
        queue.push(baton::Message{baton::ActorId{i}, baton::ActorId{i + 1}, p, 0, slot, baton::MsgKind::request, 0});
      }
      if (i > 0) {
        queue.push(baton::Message{baton::ActorId{i}, baton::ActorId{i - 1}, p, 0, slot, baton::MsgKind::ack, 0});
      }
    }
  };
  advance(0);
  // Two messages per hop per piece; anything beyond that is a bug here.
  const std::uint64_t bound = 2 * static_cast<std::uint64_t>(k) * static_cast<std::uint64_t>(pieces) + 16;
  while (auto m = queue.pop()) {
    if (++messages > bound) throw std::logic_error("raw same-thread chain: too many messages");
    const auto dst = static_cast<std::size_t>(m->dst.bits);
    switch (m->kind) {
      case baton::MsgKind::request: st[dst].received = m->piece + 1; break;
      case baton::MsgKind::ack: st[dst].freed = m->piece + 1; break;
      default: break;
    }
    advance(dst);
  }
  if (st.back().acts != pieces) throw std::logic_error("raw same-thread chain lost pieces");
  return {seconds_since(t0), messages, 0};
}

using RawQueue = boost::lockfree::queue<baton::Message>;

/// Polls a queue until it yields a message, never sleeping: the first `spin_polls` polls (the
/// runtime's default before its workers park) with a CPU pause between them, later ones with a
/// sched_yield, so that on a busy machine the thread gives its core to the one it waits for
/// instead of burning a whole time slice. With two free cores the yield never comes into play.
/// Returns false once `stop` is set or the deadline passes (then sets `stop`, so that the other
/// thread gives up too).
bool spin_pop(RawQueue& q, baton::Message& m, std::atomic<bool>& stop, Clock::time_point deadline) {
  static const int spin_polls = baton::RuntimeSettings{}.spin_polls;
  for (std::uint64_t polls = 1;; ++polls) {
    if (q.pop(m)) return true;
    if (polls < static_cast<std::uint64_t>(spin_polls)) {
      cpu_pause();
    } else {
      std::this_thread::yield();
    }
    if ((polls & 1023) == 0 && (stop.load(std::memory_order_relaxed) || Clock::now() > deadline)) {
      stop.store(true, std::memory_order_relaxed);
      return false;
    }
  }
}

void push_or_throw(RawQueue& q, const baton::Message& m) {
  if (!q.push(m)) throw std::bad_alloc();
}

baton::Message raw_msg(std::int64_t piece, int slots, baton::MsgKind kind) {
  return baton::Message{baton::ActorId{0}, baton::ActorId{1}, piece, 0,
                        static_cast<std::uint16_t>(piece % slots), kind, 0};
}

/// Credit-based streaming between two spinning threads over two boost::lockfree::queue
/// (capacity as a baton mailbox): the producer sends a request per piece with at most `slots`
/// un-acked; the consumer acks each piece. Wall time includes starting and joining the threads,
/// as RunReport::wall_s does.
Sample raw_cross_thread_stream(std::int64_t pieces, int slots) {
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(reference_timeout_s));
  RawQueue to_consumer(1024);
  RawQueue to_producer(1024);
  std::atomic<bool> stop{false};
  std::atomic<bool> bad_order{false};
  std::thread consumer([&] {
    baton::Message m;
    for (std::int64_t p = 0; p < pieces; ++p) {
      if (!spin_pop(to_consumer, m, stop, deadline)) return;
      if (m.piece != p) bad_order = true;
      push_or_throw(to_producer, raw_msg(p, slots, baton::MsgKind::ack));
    }
  });
  std::thread producer([&] {
    baton::Message m;
    std::int64_t acked = 0;
    for (std::int64_t p = 0; p < pieces; ++p) {
      while (p - acked >= slots) {
        if (!spin_pop(to_producer, m, stop, deadline)) return;
        if (m.piece != acked) bad_order = true;
        acked = m.piece + 1;
      }
      push_or_throw(to_consumer, raw_msg(p, slots, baton::MsgKind::request));
    }
    while (acked < pieces) {
      if (!spin_pop(to_producer, m, stop, deadline)) return;
      acked = m.piece + 1;
    }
  });
  producer.join();
  consumer.join();
  if (stop) throw std::runtime_error("raw cross-thread stream timed out");
  if (bad_order) throw std::logic_error("raw cross-thread stream: messages out of order");
  return {seconds_since(t0), 2 * static_cast<std::uint64_t>(pieces), 0};
}

/// Ping-pong between two spinning threads over two boost::lockfree::queue: `rounds` round trips.
Sample raw_ping_pong(std::int64_t rounds) {
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(reference_timeout_s));
  RawQueue ping(1024);
  RawQueue pong(1024);
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    baton::Message m;
    for (std::int64_t i = 0; i < rounds; ++i) {
      if (!spin_pop(ping, m, stop, deadline)) return;
      m.kind = baton::MsgKind::ack;
      push_or_throw(pong, m);
    }
  });
  std::thread caller([&] {
    baton::Message m;
    for (std::int64_t i = 0; i < rounds; ++i) {
      push_or_throw(ping, raw_msg(i, 1, baton::MsgKind::request));
      if (!spin_pop(pong, m, stop, deadline)) return;
    }
  });
  caller.join();
  echo.join();
  if (stop) throw std::runtime_error("raw ping-pong timed out");
  return {seconds_since(t0), 2 * static_cast<std::uint64_t>(rounds), 0};
}

// ---------------------------------------------------------------------------------------------
// Cases

struct Bench {
  Options opt;
  baton::KernelRegistry kernels = baton::KernelRegistry::with_builtin_kernels();

  double target_s() const { return opt.quick ? target_run_s * quick_factor : target_run_s; }

  /// Calibrates each runner's piece count, then runs them in turn for `repeats` rounds (baton
  /// and its reference interleaved, so that a slow spell of the machine hits both alike) and
  /// keeps each one's best and median run. With `same_pieces` every runner gets the largest of
  /// the counts (the same tasks for every system, each run at least the target long).
  std::vector<Measured> measure(const std::vector<Runner>& runners, std::int64_t start,
                                std::int64_t min_pieces, double run_s = 0, bool same_pieces = false) const {
    const double target = run_s > 0 ? run_s : target_s();
    std::vector<Measured> out(runners.size());
    auto equalize = [&] {
      if (!same_pieces) return;
      std::int64_t most = 0;
      for (const auto& m : out) most = std::max(most, m.pieces);
      for (auto& m : out) m.pieces = most;
    };
    for (std::size_t i = 0; i < runners.size(); ++i) {
      out[i].pieces = calibrate(runners[i], start, target, min_pieces);
    }
    equalize();
    for (int attempt = 0; attempt < 3; ++attempt) {
      std::vector<std::vector<Sample>> samples(runners.size());
      for (int r = 0; r < repeats; ++r) {
        for (std::size_t i = 0; i < runners.size(); ++i) samples[i].push_back(runners[i](out[i].pieces));
      }
      bool again = false;
      for (std::size_t i = 0; i < runners.size(); ++i) {
        auto& v = samples[i];
        std::sort(v.begin(), v.end(), [](const Sample& x, const Sample& y) { return x.wall_s < y.wall_s; });
        out[i].best = v.front();
        out[i].median = v[v.size() / 2];
        // A pilot slowed down by a hiccup (a park, another process) leaves the runs far too
        // short: scale again from the best run and measure again.
        if (attempt < 2 && out[i].best.wall_s < 0.7 * target && out[i].pieces < max_pieces) {
          const double scaled = static_cast<double>(out[i].pieces) * target / std::max(out[i].best.wall_s, 1e-9);
          const auto n = std::clamp<std::int64_t>(static_cast<std::int64_t>(scaled), min_pieces, max_pieces);
          again = again || n > out[i].pieces || (!same_pieces && n != out[i].pieces);
          out[i].pieces = same_pieces ? std::max(n, out[i].pieces) : n;
        }
      }
      equalize();
      if (!again) break;
    }
    return out;
  }

  void same_thread_hop() const {
    constexpr int k = 8;
    constexpr int slots = 2;
    std::vector<Stage> stages{{"source", 0}};
    for (int i = 1; i <= k - 2; ++i) stages.push_back({fmt::format("c{}", i), 0});
    stages.push_back({"sink", 0});
    auto baton_run = [&](std::int64_t n) { return run_baton(chain_plan(stages, n, slots), kernels); };
    auto raw_run = [&](std::int64_t n) { return raw_same_thread_chain(k, n, slots); };
    // The same chain without time accounting (RuntimeSettings::time_accounting), and with the
    // exact accounting (time_sample_hz 0), where an act reads the clock three times (busy from,
    // kernel end, busy until) and what a read costs depends on the machine (a virtual machine's
    // TSC can be slow); the default samples (no clock read on the hot path).
    baton::RuntimeSettings untimed;
    untimed.time_accounting = false;
    auto untimed_run = [&](std::int64_t n) { return run_baton(chain_plan(stages, n, slots), kernels, untimed); };
    baton::RuntimeSettings exact;
    exact.time_sample_hz = 0;
    auto exact_run = [&](std::int64_t n) { return run_baton(chain_plan(stages, n, slots), kernels, exact); };
    const auto m = measure({baton_run, raw_run, untimed_run, exact_run}, 100, 100);
    const Measured& stats = m[0];
    const Measured& ref = m[1];
    const std::int64_t pieces = stats.pieces;
    const std::int64_t ref_pieces = ref.pieces;
    const double hops = static_cast<double>(k - 1);
    const double ns = stats.best.wall_s * 1e9 / (static_cast<double>(pieces) * hops);
    const double ref_ns = ref.best.wall_s * 1e9 / (static_cast<double>(ref_pieces) * hops);
    const double untimed_ns = m[2].best.wall_s * 1e9 / (static_cast<double>(m[2].pieces) * hops);
    const double exact_ns = m[3].best.wall_s * 1e9 / (static_cast<double>(m[3].pieces) * hops);
    JsonLine("same_thread_hop")
        .add("value", ns)
        .add("unit", "ns/hop")
        .better(Better::lower)
        .add("reference", ref_ns)
        .compare("ratio", ns, ref_ns)
        .add("reference_is",
             "same credit protocol (request + ack per hop, 2 slots) hand-coded over one "
             "baton::LocalQueue with a switch dispatch, one thread, no kernels or metrics")
        .add("stat", "best of 3")
        .add("median", stats.median.wall_s * 1e9 / (static_cast<double>(pieces) * hops))
        .add("actors", k)
        .add("pieces", pieces)
        .add("slots", slots)
        .add("threads", 1)
        .add("wall_s", stats.best.wall_s)
        .add("messages_per_piece", static_cast<double>(stats.best.messages) / static_cast<double>(pieces))
        .add("parks", stats.best.parks)
        .add("reference_pieces", ref_pieces)
        .add("without_time_accounting", untimed_ns)
        .add("exact_time_accounting", exact_ns)
        .add("clock_read_ns", clock_read_ns())
        .print();
    fmt::print(stderr,
               "same_thread_hop: {:.1f} ns/hop over {} pieces (raw LocalQueue chain {:.1f} ns/hop); without time "
               "accounting {:.1f} ns/hop, with exact accounting {:.1f}; one read of baton::ticks() {:.1f} ns\n",
               ns, pieces, ref_ns, untimed_ns, exact_ns, clock_read_ns());
  }

  void cross_thread_stream(int slots) const {
    const std::string case_name = fmt::format("cross_thread_stream_slots{}", slots);
    std::vector<Stage> stages{{"source", 0}, {"a", 0}, {"b", 1}, {"sink", 1}};
    auto baton_run = [&](std::int64_t n) { return run_baton(chain_plan(stages, n, slots), kernels); };
    auto raw_run = [&](std::int64_t n) { return raw_cross_thread_stream(n, slots); };
    const auto m = measure({baton_run, raw_run}, 100, 200);
    const Measured& stats = m[0];
    const Measured& ref = m[1];
    const std::int64_t pieces = stats.pieces;
    const std::int64_t ref_pieces = ref.pieces;
    const double rate = static_cast<double>(pieces) / stats.best.wall_s;
    const double ref_rate = static_cast<double>(ref_pieces) / ref.best.wall_s;
    JsonLine(case_name)
        .add("value", rate)
        .add("unit", "pieces/s")
        .better(Better::higher)
        .add("reference", ref_rate)
        .compare("ratio", rate, ref_rate)
        .add("reference_is",
             "credit-based stream (request per piece, at most `slots` un-acked, ack per piece) over two "
             "boost::lockfree::queue<baton::Message> between two spinning std::threads")
        .add("stat", "best of 3")
        .add("median", static_cast<double>(pieces) / stats.median.wall_s)
        .add("pieces", pieces)
        .add("slots", slots)
        .add("threads", 2)
        .add("wall_s", stats.best.wall_s)
        .add("ns_per_piece", stats.best.wall_s * 1e9 / static_cast<double>(pieces))
        .add("messages_per_piece", static_cast<double>(stats.best.messages) / static_cast<double>(pieces))
        .add("parks", stats.best.parks)
        .add("reference_pieces", ref_pieces)
        .print();
    fmt::print(stderr, "{}: {:.3g} pieces/s (raw two-queue stream {:.3g} pieces/s), {} parks\n", case_name, rate,
               ref_rate, stats.best.parks);
  }

  void cross_thread_hop_latency() const {
    std::vector<Stage> stages{{"source", 0}, {"sink", 1}};
    auto baton_run = [&](std::int64_t n) { return run_baton(chain_plan(stages, n, 1), kernels); };
    const auto m = measure({baton_run, raw_ping_pong}, 100, 100);
    const Measured& stats = m[0];
    const Measured& ref = m[1];
    const std::int64_t pieces = stats.pieces;
    const std::int64_t rounds = ref.pieces;
    const double ns = stats.best.wall_s * 1e9 / static_cast<double>(pieces) / 2;
    const double ref_ns = ref.best.wall_s * 1e9 / static_cast<double>(rounds) / 2;
    JsonLine("cross_thread_hop_latency")
        .add("value", ns)
        .add("unit", "ns")
        .better(Better::lower)
        .add("reference", ref_ns)
        .compare("ratio", ns, ref_ns)
        .add("reference_is",
             "ping-pong over two boost::lockfree::queue<baton::Message> between two spinning std::threads, "
             "one-way = round trip / 2")
        .add("stat", "best of 3")
        .add("median", stats.median.wall_s * 1e9 / static_cast<double>(pieces) / 2)
        .add("pieces", pieces)
        .add("slots", 1)
        .add("threads", 2)
        .add("wall_s", stats.best.wall_s)
        .add("parks", stats.best.parks)
        .add("reference_pieces", rounds)
        .print();
    fmt::print(stderr, "cross_thread_hop_latency: {:.0f} ns one way (raw ping-pong {:.0f} ns), {} parks\n", ns,
               ref_ns, stats.best.parks);
  }

  /// What a trace costs: the same chain with and without the activity log and a trace drain
  /// thread (runs interleaved). The noop chain is the worst case (acts of ~100 ns, where two
  /// clock reads and a ring push per act show); 2 us kernels are closer to small training ops.
  void trace_overhead(const std::string& case_name, const std::string& op, std::int64_t spin_ns) const {
    baton::Attrs attrs;
    if (spin_ns > 0) attrs = {{"ns", spin_ns}};
    std::vector<Stage> stages{{"source", 0}, {"a", 0, op, attrs}, {"b", 1, op, attrs}, {"sink", 1}};
    TracedSample last;
    auto plain = [&](std::int64_t n) { return run_baton(chain_plan(stages, n, 2), kernels); };
    auto traced = [&](std::int64_t n) {
      last = run_baton_traced(chain_plan(stages, n, 2), kernels);
      return last.sample;
    };
    const auto m = measure({plain, traced}, 100, 200);
    const double rate = static_cast<double>(m[0].pieces) / m[0].best.wall_s;
    const double traced_rate = static_cast<double>(m[1].pieces) / m[1].best.wall_s;
    const double acts = 4.0 * static_cast<double>(m[1].pieces);
    // The traced chain is the figure and the plain one its reference: "ratio" is the throughput
    // tracing keeps (1 - ratio is what it costs).
    JsonLine(case_name)
        .add("value", traced_rate)
        .add("unit", "pieces/s (traced)")
        .better(Better::higher)
        .add("reference", rate)
        .compare("ratio", traced_rate, rate)
        .add("reference_is", "the same chain without the activity log (pieces/s)")
        .add("goal", "ratio >= 0.90")
        .add("stat", "best of 3")
        .compare("median_ratio", static_cast<double>(m[1].pieces) / m[1].median.wall_s,
                 static_cast<double>(m[0].pieces) / m[0].median.wall_s)
        .add("op", op)
        .add("spin_ns", spin_ns)
        .add("pieces", m[1].pieces)
        .add("actors", 4)
        .add("threads", 2)
        .add("ns_per_act_traced", m[1].best.wall_s * 1e9 * 2 / acts)  // two workers share the acts
        .add("recorded", static_cast<double>(last.recorded))
        .add("dropped", static_cast<double>(last.dropped))
        .print();
    fmt::print(stderr, "{}: {:.3g} pieces/s traced vs {:.3g} plain ({:+.1f}%), last traced run kept {} acts, lost {}\n",
               case_name, traced_rate, rate, 100.0 * (traced_rate / rate - 1.0), last.recorded, last.dropped);
  }

  /// What the dashboard's metrics cost a pipeline: per-actor time accounting, a collector
  /// sampling at 2 Hz into a job model (snapshot, JSON, ingest) and the activity log it drains
  /// for the pipeline timeline, against all of them off; and each step on its own, to say where
  /// the cost is. A 4-actor chain, source and sink included, on one worker thread (no
  /// cross-thread hand-off to make the rate hostage to the scheduler of a busy 2-core machine),
  /// with `grain_us` of spin per act; noop kernels (grain 0) show the per-act cost bare. Runs
  /// last ~2 s so that the collector samples several times in each (--quick: 0.25 s at 20 Hz).
  void metrics_overhead(double grain_us) const {
    const std::string case_name =
        grain_us > 0 ? fmt::format("metrics_overhead_{}us", grain_us) : std::string("metrics_overhead_noop");
    const std::string op = grain_us > 0 ? "spin_ns" : "noop";
    const baton::Attrs attrs =
        grain_us > 0 ? baton::Attrs{{"ns", static_cast<std::int64_t>(std::llround(grain_us * 1000))}} : baton::Attrs{};
    std::vector<Stage> stages{{"source", 0, op, attrs}, {"a", 0, op, attrs}, {"b", 0, op, attrs}, {"sink", 0, op, attrs}};
    constexpr int slots = 2;
    const auto interval = opt.quick ? std::chrono::milliseconds(50) : std::chrono::milliseconds(500);
    const double run_s = opt.quick ? 0.25 : 2.0;
    std::atomic<std::uint64_t> collector_samples{0};
    struct Variant {
      const char* name;
      bool accounting, collector, activity_log;
    };
    const std::vector<Variant> variants{{"off", false, false, false},
                                        {"time_accounting", true, false, false},
                                        {"accounting_and_collector", true, true, false},
                                        {"dashboard", true, true, true}};
    std::vector<Runner> runners;
    for (const Variant& v : variants) {
      runners.push_back([&, v](std::int64_t n) {
        const baton::Plan plan = chain_plan(stages, n, slots);
        baton::RuntimeSettings rs;
        rs.time_accounting = v.accounting;
        rs.activity_log = v.activity_log;
        baton::Runtime rt(plan, kernels, rs);
        if (!v.collector) {
          const auto report = rt.run();
          return Sample{report.wall_s, report.messages, report.parks};
        }
        baton::observe::JobModel model;
        baton::observe::Collector collector({.interval = interval});
        collector.feed(model);
        collector.on_start(rt, nullptr);
        const auto report = rt.run();
        collector.on_finish(rt, {});
        collector_samples += collector.samples();
        if (model.bad_messages() != 0) throw std::logic_error("the job model refused the collector's telemetry");
        return Sample{report.wall_s, report.messages, report.parks};
      });
    }
    const auto m = measure(runners, 100, 200, run_s);
    auto rate = [&](std::size_t i, bool median = false) {
      return static_cast<double>(m[i].pieces) / (median ? m[i].median.wall_s : m[i].best.wall_s);
    };
    // The metrics (time accounting and the collector) against everything off; then the
    // collector against the default runtime (which accounts time anyway), and the activity log
    // the pipeline timeline adds.
    constexpr std::size_t off = 0, accounting = 1, metrics = 2, timeline = 3;
    JsonLine(case_name)
        .add("value", rate(metrics))
        .add("unit", "pieces/s")
        .better(Better::higher)
        .add("reference", rate(off))
        .compare("ratio", rate(metrics), rate(off))
        .add("goal", "ratio >= 0.97")
        .add("reference_is", "the same pipeline with time accounting, the collector and the activity log off")
        .add("stat", "best of 3")
        .compare("median_ratio", rate(metrics, true), rate(off, true))
        .compare("ratio_time_accounting", rate(accounting), rate(off))
        .compare("ratio_collector_vs_default_runtime", rate(metrics), rate(accounting))
        .compare("ratio_with_activity_log", rate(timeline), rate(off))
        .compare("median_ratio_with_activity_log", rate(timeline, true), rate(off, true))
        .add("grain_us", grain_us)
        .add("collector_hz", 1000.0 / static_cast<double>(interval.count()))
        .add("collector_samples", collector_samples.load())
        .add("pieces", m[metrics].pieces)
        .add("reference_pieces", m[off].pieces)
        .add("threads", 1)
        .add("wall_s", m[metrics].best.wall_s)
        .print();
    auto pct = [&](std::size_t a, std::size_t b, bool median = false) { return 100 * (1 - rate(a, median) / rate(b, median)); };
    fmt::print(stderr,
               "{}: {:.4g} pieces/s bare; metrics (time accounting + collector) cost {:.1f}% (median runs {:.1f}%): "
               "time accounting {:.1f}%, the collector {:.1f}% on top; the activity log for the timeline {:.1f}% more "
               "({:.1f}% in all)\n",
               case_name, rate(off), pct(metrics, off), pct(metrics, off, true), pct(accounting, off),
               pct(metrics, accounting), pct(timeline, metrics), pct(timeline, off));
  }

  /// Microseconds one spin_ns task with these attributes takes when run alone, back to back: the
  /// median call, so that a call stretched by the scheduler (a busy machine) does not inflate
  /// Task Bench's ideal. One clock read per call, as the mean over the calls took before.
  double time_task_us(const baton::Attrs& attrs) const {
    baton::KernelConfig cfg{"metg-probe", baton::Device{}, baton::DType::f32, attrs};
    auto kernel = kernels.create("spin_ns", cfg);
    baton::KernelContext ctx{};
    const auto budget = std::chrono::milliseconds(opt.quick ? 2 : 20);
    std::vector<double> calls_us;
    calls_us.reserve(1 << 16);
    const auto t0 = std::chrono::steady_clock::now();
    auto last = t0;
    while (last - t0 < budget || calls_us.size() < 11) {
      kernel->compute(ctx);
      const auto now = std::chrono::steady_clock::now();
      calls_us.push_back(std::chrono::duration<double, std::micro>(now - last).count());
      last = now;
    }
    auto mid = calls_us.begin() + static_cast<std::ptrdiff_t>(calls_us.size() / 2);
    std::nth_element(calls_us.begin(), mid, calls_us.end());
    return *mid;
  }

  /// The peers of the chain cases, each on `threads` threads; a peer that was not built in is
  /// named in `missing` with the reason.
  struct Peers {
    std::vector<std::unique_ptr<baton::bench::PeerChain>> chains;
    std::vector<std::pair<std::string, std::string>> missing;  // {name, why}
  };
  static Peers make_peers(int threads, int slots, int stages) {
    Peers p;
    // TBB bounds the pieces in flight over the whole chain: as many as baton's registers hold.
    if (auto why = baton::bench::tbb_missing(); why.empty()) {
      p.chains.push_back(baton::bench::make_tbb_chain(threads, slots * (stages - 1)));
    } else {
      p.missing.emplace_back("tbb_flow_graph", why);
    }
    if (auto why = baton::bench::caf_missing(); why.empty()) {
      p.chains.push_back(baton::bench::make_caf_chain(threads, slots));
    } else {
      p.missing.emplace_back("caf", why);
    }
    return p;
  }

  /// The work of each stage as a peer runs it: an instance of the same kernel baton's actor runs.
  std::vector<baton::bench::StageWork> stage_work(const std::vector<Stage>& stages) const {
    std::vector<baton::bench::StageWork> out;
    for (const Stage& s : stages) {
      baton::KernelConfig cfg{s.name, baton::Device{}, baton::DType::f32, s.attrs};
      std::shared_ptr<baton::Kernel> kernel = kernels.create(s.op, cfg);
      out.push_back([kernel] {
        baton::KernelContext ctx{};
        kernel->compute(ctx);
      });
    }
    return out;
  }

  static Runner peer_runner(baton::bench::PeerChain& chain, const std::vector<baton::bench::StageWork>& work) {
    return [&chain, &work](std::int64_t n) {
      const auto r = chain.run(work, n, reference_timeout_s);
      return Sample{r.wall_s, 0, 0};
    };
  }

  /// The chain of metg() with no work: what a piece's four acts and three hops cost each system
  /// when there is nothing else to do (the hop cost that sets METG).
  void chain_noop() const {
    constexpr int stages_n = 4, threads = 2, slots = 2;
    const std::vector<Stage> stages{{"source", 0}, {"s1", 0}, {"s2", 1}, {"s3", 1}};
    Peers peers = make_peers(threads, slots, stages_n);
    const auto work = stage_work(stages);
    std::vector<Runner> runners{[&](std::int64_t n) { return run_baton(chain_plan(stages, n, slots), kernels); }};
    for (auto& c : peers.chains) runners.push_back(peer_runner(*c, work));
    const auto m = measure(runners, 100, 200, 0, true);
    auto rate = [&](std::size_t i) { return static_cast<double>(m[i].pieces) / m[i].best.wall_s; };
    JsonLine line("chain_noop");
    line.add("value", rate(0)).add("unit", "pieces/s").better(Better::higher);
    // The headline ratio is against the faster peer.
    std::size_t best = 0;
    for (std::size_t i = 1; i < m.size(); ++i) {
      if (best == 0 || rate(i) > rate(best)) best = i;
    }
    if (best > 0) {
      line.add("reference", rate(best)).compare("ratio", rate(0), rate(best));
      line.add("reference_is", fmt::format("the faster peer: {}", peers.chains[best - 1]->name()));
    }
    // Every system ran the same pieces (measure(..., same_pieces)).
    line.add("stat", "best of 3").add("ns_per_piece", 1e9 / rate(0)).add("pieces", m[0].pieces);
    std::string notes;
    for (std::size_t i = 1; i < m.size(); ++i) {
      const auto& name = peers.chains[i - 1]->name();
      line.add(name, rate(i)).compare("ratio_" + name, rate(0), rate(i)).add(name + "_ns_per_piece", 1e9 / rate(i));
      line.add(name + "_is", peers.chains[i - 1]->describe());
      notes += fmt::format(", {} {:.3g}", name, rate(i));
    }
    for (const auto& [name, why] : peers.missing) line.add(name + "_missing", why);
    line.add("stages", stages_n).add("slots", slots).add("threads", threads).add("wall_s", m[0].best.wall_s);
    line.add("parks", m[0].best.parks).print();
    fmt::print(stderr, "chain_noop: baton {:.3g} pieces/s{} (4 noop stages, 2 threads)\n", rate(0), notes);
  }

  /// METG from a sweep (grains in decreasing order): the smallest grain at >= 50%, interpolating
  /// log(grain) linearly in efficiency between the last grain that reached it and the first (going
  /// down) that did not. Returns {METG, how it was bounded}.
  static std::pair<double, std::string> metg_of(const std::vector<double>& grains_us, const std::vector<double>& eff) {
    std::size_t first_fail = 0;
    while (first_fail < eff.size() && eff[first_fail] >= 0.5) ++first_fail;
    if (first_fail == eff.size()) {
      return {grains_us.back(), "every grain reached 50%: METG is at most the smallest grain tried"};
    }
    if (first_fail == 0) return {grains_us.front(), "no grain reached 50%: METG is above the largest grain tried"};
    const double hi = grains_us[first_fail - 1];
    const double lo = grains_us[first_fail];
    const double e_hi = eff[first_fail - 1];
    const double e_lo = eff[first_fail];
    const double f = (e_hi - 0.5) / (e_hi - e_lo);
    return {std::exp(std::log(hi) + f * (std::log(lo) - std::log(hi))), "interpolated"};
  }

  void metg() const {
    constexpr int stages_n = 4;
    constexpr int threads = 2;
    constexpr int slots = 2;
    std::vector<double> grains_us =
        opt.quick ? std::vector<double>{100, 10, 2, 0.5} : std::vector<double>{200, 100, 50, 20, 10, 5, 2, 1, 0.5, 0.25};
    const std::size_t swept = grains_us.size();
    // If the finest grain still reaches 50% on some system, go on down (a few steps at most) to
    // bracket its METG.
    constexpr double finer_us[] = {0.25, 0.1, 0.05};
    const std::int64_t min_pieces = opt.quick ? 50 : 200;
    Peers peers = make_peers(threads, slots, stages_n);
    const std::size_t systems = 1 + peers.chains.size();
    std::vector<std::vector<double>> eff(systems);  // [system][grain]
    std::vector<double> measured_us;
    for (std::size_t g = 0; g < grains_us.size(); ++g) {
      const double grain_us = grains_us[g];
      const auto ns = static_cast<std::int64_t>(std::llround(grain_us * 1000));
      const baton::Attrs spin{{"ns", ns}};
      std::vector<Stage> stages{{"source", 0, "spin_ns", spin},
                                {"s1", 0, "spin_ns", spin},
                                {"s2", 1, "spin_ns", spin},
                                {"s3", 1, "spin_ns", spin}};
      const auto work = stage_work(stages);
      std::vector<Runner> runners{[&](std::int64_t n) { return run_baton(chain_plan(stages, n, slots), kernels); }};
      for (auto& c : peers.chains) runners.push_back(peer_runner(*c, work));
      // Task Bench's ideal: the same task run alone, back to back, on one core. The spin kernel
      // reads the clock, so a nominal 0.25 us task really takes a little longer; timing it
      // keeps that overshoot out of every system's efficiency.
      const double task_us = time_task_us(spin);
      const double ideal_per_piece_s = stages_n * task_us * 1e-6 / threads;
      const auto m = measure(runners, 50, min_pieces, 0, true);
      auto efficiency = [&](std::size_t i, bool median = false) {
        const double wall = median ? m[i].median.wall_s : m[i].best.wall_s;
        return static_cast<double>(m[i].pieces) * ideal_per_piece_s / wall;
      };
      for (std::size_t i = 0; i < systems; ++i) eff[i].push_back(efficiency(i));
      measured_us.push_back(task_us);
      JsonLine line("metg_grain");
      // Each system's efficiency is its own figure (against the ideal timed here), not a
      // comparison of baton with a peer: the peers' go beside baton's as plain keys.
      line.add("value", efficiency(0)).add("unit", "efficiency (fraction of Task Bench's ideal)");
      line.better(Better::higher).add("grain_us", task_us);
      line.add("nominal_grain_us", grain_us).add("stat", "best of 3");
      line.add("median", efficiency(0, true)).add("pieces", m[0].pieces).add("stages", stages_n);
      line.add("slots", slots).add("threads", threads).add("wall_s", m[0].best.wall_s).add("parks", m[0].best.parks);
      std::string notes;
      for (std::size_t i = 1; i < systems; ++i) {
        const auto& name = peers.chains[i - 1]->name();
        line.add("efficiency_" + name, efficiency(i)).add(name + "_median", efficiency(i, true));
        notes += fmt::format("  {} {:5.1f}%", name, 100 * efficiency(i));
      }
      line.print();
      fmt::print(stderr, "metg: grain {:>6} us  baton {:5.1f}%{}  ({} pieces, {:.3f} s)\n", grain_us,
                 100 * efficiency(0), notes, m[0].pieces, m[0].best.wall_s);
      const bool any_above =
          std::any_of(eff.begin(), eff.end(), [](const std::vector<double>& e) { return e.back() >= 0.5; });
      if (g + 1 == grains_us.size() && any_above) {
        for (double finer : finer_us) {
          if (finer < grain_us) {
            grains_us.push_back(finer);
            break;
          }
        }
      }
    }
    const auto [value, bound] = metg_of(measured_us, eff[0]);
    JsonLine line("metg");
    line.add("value", value).add("unit", "us").better(Better::lower).add("bound", bound);
    // The headline ratio is against the peer with the finer METG. A METG the sweep only bounds
    // (every grain or no grain reached 50%) gives no ratio: a ratio of bounds says nothing.
    const std::string interpolated = "interpolated";
    std::size_t best = 0;
    std::vector<std::pair<double, std::string>> peer_metg(systems, {value, bound});
    for (std::size_t i = 1; i < systems; ++i) {
      peer_metg[i] = metg_of(measured_us, eff[i]);
      if (best == 0 || peer_metg[i].first < peer_metg[best].first) best = i;
    }
    auto comparable = [&](std::size_t i) { return bound == interpolated && peer_metg[i].second == interpolated; };
    if (best > 0) {
      line.add("reference", peer_metg[best].first);
      if (comparable(best)) line.compare("ratio", value, peer_metg[best].first);
      line.add("reference_is", fmt::format("the peer with the finer METG: {}", peers.chains[best - 1]->name()));
    }
    std::string notes;
    for (std::size_t i = 1; i < systems; ++i) {
      const auto& name = peers.chains[i - 1]->name();
      const auto& [v, b] = peer_metg[i];
      line.add(name, v);
      if (comparable(i)) {
        line.compare("ratio_" + name, value, v);
      } else {
        line.add("no_ratio_" + name, "baton's or this peer's METG is only bounded by the sweep");
      }
      line.add(name + "_bound", b).add(name + "_is", peers.chains[i - 1]->describe());
      notes += fmt::format(", {} {:.3g} us ({})", name, v, b);
    }
    for (const auto& [name, why] : peers.missing) line.add(name + "_missing", why);
    line.add("efficiency_threshold", 0.5).add("stages", stages_n).add("slots", slots).add("threads", threads);
    line.add("grains", static_cast<std::int64_t>(grains_us.size()));
    line.add("grains_beyond_sweep", static_cast<std::int64_t>(grains_us.size() - swept));
    line.print();
    fmt::print(stderr, "metg: baton {:.3g} us at 50% efficiency ({}){}\n", value, bound, notes);
  }
};

}  // namespace

int main(int argc, char** argv) {
  baton::bench::load().start(argc, argv, 2);  // two worker threads in most cases
  const Options opt = parse(argc, argv);
  if (opt.require_peers) {
    for (const auto& why : {baton::bench::tbb_missing(), baton::bench::caf_missing()}) {
      if (!why.empty()) return baton::bench::skip("baton-bench-actors --require-peers", "a peer is missing: " + why);
    }
  }
  const auto t0 = Clock::now();
  (void)baton::ns_per_tick();  // its one-off 2 ms calibration, outside every measurement
  Bench bench{opt};
  const std::vector<std::pair<std::string_view, std::function<void()>>> cases{
      {"same_thread_hop", [&] { bench.same_thread_hop(); }},
      {"cross_thread_stream_slots1", [&] { bench.cross_thread_stream(1); }},
      {"cross_thread_stream_slots2", [&] { bench.cross_thread_stream(2); }},
      {"cross_thread_stream_slots4", [&] { bench.cross_thread_stream(4); }},
      {"cross_thread_hop_latency", [&] { bench.cross_thread_hop_latency(); }},
      {"chain_noop", [&] { bench.chain_noop(); }},
      {"metg", [&] { bench.metg(); }},
      {"trace_overhead_noop", [&] { bench.trace_overhead("trace_overhead_noop", "noop", 0); }},
      {"trace_overhead_spin2us", [&] { bench.trace_overhead("trace_overhead_spin2us", "spin_ns", 2000); }},
      {"metrics_overhead", [&] {
         bench.metrics_overhead(0);
         bench.metrics_overhead(1);
         bench.metrics_overhead(10);
       }},
  };
  fmt::print(stderr, "baton-bench-actors: {} mode, {} hardware threads, best of {} runs of ~{:.0f} ms\n",
             opt.quick ? "quick" : "full", std::thread::hardware_concurrency(), repeats, bench.target_s() * 1e3);
  int failed = 0;
  for (const auto& [name, run] : cases) {
    if (!name.starts_with(opt.only)) continue;
    try {
      run();
    } catch (const std::exception& e) {
      fmt::print(stderr, "baton-bench-actors: case {} failed: {}\n", name, e.what());
      ++failed;
    }
  }
  fmt::print(stderr, "baton-bench-actors: done in {:.1f} s{}\n", seconds_since(t0),
             failed ? fmt::format(", {} case(s) failed", failed) : std::string());
  return failed ? 1 : 0;
}
