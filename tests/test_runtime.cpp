// The runtime's contract: the exact handshake order in deterministic mode, termination in every
// shape (zero pieces, one, a source that ends early, a kernel that throws), micro-batching with
// repeat and accumulate, cycles with delays, and the per-actor accounting.
#include <unistd.h>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "baton/actors.h"
#include "baton/kernels.h"
#include "checking_kernels.h"

using namespace baton;

namespace {

std::vector<std::string> handshake_strings(const Runtime& rt) {
  std::vector<std::string> out;
  for (const auto& e : rt.handshakes()) out.push_back(e.str());
  return out;
}

// source A -> B (copy) -> C (sink), one register per edge with `slots` slots.
Plan chain3(int slots, std::int64_t pieces) {
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {1}, .dtype = i64, .slots = slots});
  auto b = p.add_register({.name = "b", .shape = {1}, .dtype = i64, .slots = slots});
  p.add_actor({.name = "A", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64, .outputs = {a}, .pieces = pieces});
  p.add_actor({.name = "B", .op = "copy", .dtype = i64, .inputs = {{a}}, .outputs = {b}});
  p.add_actor({.name = "C", .op = "noop", .dtype = i64, .inputs = {{b}}});
  return p;
}

const ActorMetrics& actor_named(const RunReport& r, const std::string& name) {
  for (const auto& a : r.metrics.actors) {
    if (a.name == name) return a;
  }
  FAIL("no actor " << name);
  throw std::logic_error("unreachable");
}

RuntimeSettings threaded(std::chrono::milliseconds stall = std::chrono::milliseconds(10'000)) {
  RuntimeSettings s;
  s.stall_timeout = stall;
  return s;
}

RuntimeSettings deterministic(bool record = false) {
  RuntimeSettings s;
  s.mode = ExecutionMode::deterministic;
  s.record_handshakes = record;
  return s;
}

// Records what each act saw on input 0 (first element, and the data pointer).
struct Recorder {
  std::mutex mutex;
  std::vector<std::int64_t> values;
  std::set<const void*> pointers;
};

void add_recorder(KernelRegistry& reg, const std::string& op, Recorder& rec) {
  reg.add_fn(op, DeviceType::cpu, i64, [&rec](KernelContext& ctx) {
    std::lock_guard lock(rec.mutex);
    if (!ctx.inputs.empty() && ctx.inputs[0] != nullptr) {
      rec.values.push_back(ctx.inputs[0]->data<std::int64_t>()[0]);
      rec.pointers.insert(ctx.inputs[0]->raw());
    }
    for (Tensor* out : ctx.outputs) {
      rec.pointers.insert(out->raw());
      if (!ctx.inputs.empty() && ctx.inputs[0] != nullptr) {
        auto src = ctx.inputs[0]->data<std::int64_t>();
        std::copy(src.begin(), src.end(), out->data<std::int64_t>().begin());
      }
    }
  });
}

}  // namespace

TEST_CASE("Runtime.Deterministic.HandshakeOrderOneSlot") {
  auto kernels = KernelRegistry::with_builtin_kernels();
  Runtime rt(chain3(1, 2), kernels, deterministic(true));
  rt.run();
  // With one slot A may not write piece 1 before B has acked piece 0; B requests C before it
  // acks A; end of stream follows the last request on each edge.
  std::vector<std::string> expected = {
      "request A->B a[0]#0",       "request B->C b[0]#0", "ack B->A a[0]#0",
      "ack C->B b[0]#0",           "request A->B a[0]#1", "end_of_stream A->B a[0]#2",
      "request B->C b[0]#1",       "ack B->A a[0]#1",     "end_of_stream B->C b[0]#2",
      "ack C->B b[0]#1",
  };
  CHECK(handshake_strings(rt) == expected);
}

TEST_CASE("Runtime.Deterministic.HandshakeOrderTwoSlots") {
  auto kernels = KernelRegistry::with_builtin_kernels();
  Runtime rt(chain3(2, 3), kernels, deterministic(true));
  rt.run();
  // Two slots: A writes pieces 0 and 1 (slots 0 and 1) before any ack, and piece 2 reuses
  // slot 0 only after B acked piece 0.
  std::vector<std::string> expected = {
      "request A->B a[0]#0", "request A->B a[1]#1", "request B->C b[0]#0",
      "ack B->A a[0]#0",     "request B->C b[1]#1", "ack B->A a[1]#1",
      "ack C->B b[0]#0",     "request A->B a[0]#2", "end_of_stream A->B a[0]#3",
      "ack C->B b[1]#1",     "request B->C b[0]#2", "ack B->A a[0]#2",
      "end_of_stream B->C b[0]#3", "ack C->B b[0]#2",
  };
  CHECK(handshake_strings(rt) == expected);
}

TEST_CASE("Runtime.Deterministic.SameOrderEveryRun") {
  auto kernels = KernelRegistry::with_builtin_kernels();
  Runtime first(chain3(2, 50), kernels, deterministic(true));
  first.run();
  Runtime second(chain3(2, 50), kernels, deterministic(true));
  second.run();
  CHECK(handshake_strings(first) == handshake_strings(second));
  CHECK(first.handshakes().size() == 50 * 4 + 2);
}

TEST_CASE("Runtime.Termination.ZeroAndOnePiece" * doctest::timeout(30)) {
  auto kernels = KernelRegistry::with_builtin_kernels();
  for (std::int64_t pieces : {0, 1}) {
    for (auto settings : {threaded(), deterministic()}) {
      Runtime rt(chain3(2, pieces), kernels, settings);
      auto report = rt.run();
      CHECK(actor_named(report, "A").acts == static_cast<std::uint64_t>(pieces));
      CHECK(actor_named(report, "C").acts == static_cast<std::uint64_t>(pieces));
      for (const auto& a : report.metrics.actors) CHECK(a.activity == ActorActivity::retired);
    }
  }
}

TEST_CASE("Runtime.Termination.SourceEndsEarly" * doctest::timeout(30)) {
  // long (1'000'000 pieces) and short (10 pieces) meet in an add: the add ends after 10 and
  // detaches from long's register, so long stops too instead of filling its slots forever.
  auto kernels = KernelRegistry::with_builtin_kernels();
  for (auto settings : {threaded(), deterministic()}) {
    Plan p;
    auto rl = p.add_register({.name = "long.out", .shape = {4}, .dtype = i64, .slots = 3});
    auto rs = p.add_register({.name = "short.out", .shape = {4}, .dtype = i64, .slots = 2});
    auto rsum = p.add_register({.name = "sum", .shape = {4}, .dtype = i64, .slots = 2});
    p.add_actor({.name = "long", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
                 .where = {.stream = 0}, .outputs = {rl}, .pieces = 1'000'000});
    p.add_actor({.name = "short", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
                 .where = {.stream = 1}, .outputs = {rs}, .pieces = 10});
    p.add_actor({.name = "add", .op = "add", .dtype = i64, .where = {.stream = 1}, .inputs = {{rl}, {rs}},
                 .outputs = {rsum}});
    p.add_actor({.name = "sink", .op = "noop", .dtype = i64, .where = {.stream = 0}, .inputs = {{rsum}}});
    Runtime rt(p, kernels, settings);
    auto report = rt.run();
    CHECK(actor_named(report, "add").acts == 10);
    CHECK(actor_named(report, "sink").acts == 10);
    // long may run ahead by its slots, and a few pieces more in flight, but no further.
    CHECK(actor_named(report, "long").acts <= 10 + 3 + 1);
  }
}

TEST_CASE("Runtime.Failure.ThrowingKernelEndsTheRunEverywhere" * doctest::timeout(30)) {
  auto kernels = KernelRegistry::with_builtin_kernels();
  kernels.add_fn("throw_at_37", DeviceType::cpu, i64, [](KernelContext& ctx) {
    if (ctx.piece == 37) throw std::runtime_error("synthetic failure");
    auto in = ctx.inputs[0]->data<std::int64_t>();
    std::copy(in.begin(), in.end(), ctx.outputs[0]->data<std::int64_t>().begin());
  });
  for (auto settings : {threaded(), deterministic()}) {
    Plan p;
    auto a = p.add_register({.name = "a", .shape = {8}, .dtype = i64, .slots = 2});
    auto b = p.add_register({.name = "b", .shape = {8}, .dtype = i64, .slots = 2});
    auto c = p.add_register({.name = "c", .shape = {8}, .dtype = i64, .slots = 2});
    p.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
                 .where = {.stream = 0}, .outputs = {a}, .pieces = 10'000'000});
    p.add_actor({.name = "faulty", .op = "throw_at_37", .dtype = i64, .where = {.stream = 1},
                 .inputs = {{a}}, .outputs = {b}});
    p.add_actor({.name = "after", .op = "copy", .dtype = i64, .where = {.stream = 2}, .inputs = {{b}},
                 .outputs = {c}});
    p.add_actor({.name = "sink", .op = "noop", .dtype = i64, .where = {.stream = 0}, .inputs = {{c}}});
    Runtime rt(p, kernels, settings);
    auto t0 = std::chrono::steady_clock::now();
    std::string error;
    try {
      rt.run();
    } catch (const JobError& e) {
      error = e.what();
    }
    CHECK(error.find("actor 'faulty'") != std::string::npos);
    CHECK(error.find("piece 37") != std::string::npos);
    CHECK(error.find("synthetic failure") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
    // The source of 10^7 pieces was stopped, not run to the end.
    auto snap = rt.snapshot();
    for (const auto& m : snap.actors) {
      if (m.name == "src") CHECK(m.acts < 1'000'000);
    }
  }
}

TEST_CASE("Runtime.Failure.StallWatchdogNamesTheWaitingActors" * doctest::timeout(30)) {
  // A kernel that stops making progress (here: sleeps far longer than the stall timeout) is
  // reported with what every unfinished actor waits for, instead of hanging the job.
  auto kernels = KernelRegistry::with_builtin_kernels();
  kernels.add_fn("stuck_at_3", DeviceType::cpu, i64, [](KernelContext& ctx) {
    if (ctx.piece == 3) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  });
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {1}, .dtype = i64, .slots = 1});
  p.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
               .where = {.stream = 0}, .outputs = {a}, .pieces = 100});
  p.add_actor({.name = "slow", .op = "stuck_at_3", .dtype = i64, .where = {.stream = 1}, .inputs = {{a}}});
  Runtime rt(p, kernels, threaded(std::chrono::milliseconds(300)));
  std::string error;
  try {
    rt.run();
  } catch (const JobError& e) {
    error = e.what();
  }
  CHECK(error.find("stall timeout") != std::string::npos);
  CHECK(error.find("'src'") != std::string::npos);
  CHECK(error.find("back-pressured") != std::string::npos);
}

TEST_CASE("Runtime.Microbatching.RepeatAndAccumulate" * doctest::timeout(30)) {
  // Per step s: a weight w_s = s, repeated over M micro-batches x_k = k (k = s*M + j), summed
  // after an add: sum_j (s*M + j + s) = M*s*M + M*(M-1)/2 + M*s.
  constexpr std::int64_t steps = 6, M = 4;
  for (auto settings : {threaded(), deterministic()}) {
    auto kernels = KernelRegistry::with_builtin_kernels();
    Recorder weights_written, add_saw, sums;
    add_recorder(kernels, "record_w", weights_written);
    add_recorder(kernels, "record_sum", sums);
    kernels.add_fn("add_recording", DeviceType::cpu, i64, [&add_saw](KernelContext& ctx) {
      {
        std::lock_guard lock(add_saw.mutex);
        add_saw.pointers.insert(ctx.inputs[1]->raw());
      }
      auto x = ctx.inputs[0]->data<std::int64_t>();
      auto w = ctx.inputs[1]->data<std::int64_t>();
      auto out = ctx.outputs[0]->data<std::int64_t>();
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = x[i] + w[i];
    });
    Plan p;
    auto rw0 = p.add_register({.name = "w0", .shape = {3}, .dtype = i64, .slots = 2});
    auto rw = p.add_register({.name = "w", .shape = {3}, .dtype = i64, .slots = 2});
    auto rwr = p.add_register({.name = "w.repeated", .shape = {3}, .dtype = i64, .slots = 2});
    auto rx = p.add_register({.name = "x", .shape = {3}, .dtype = i64, .slots = 2});
    auto ry = p.add_register({.name = "y", .shape = {3}, .dtype = i64, .slots = 2});
    auto rs = p.add_register({.name = "y.sum", .shape = {3}, .dtype = i64, .slots = 1});
    p.add_actor({.name = "wsrc", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
                 .where = {.stream = 0}, .outputs = {rw0}, .pieces = steps});
    p.add_actor({.name = "w", .op = "record_w", .dtype = i64, .where = {.stream = 0}, .inputs = {{rw0}},
                 .outputs = {rw}});
    p.add_actor({.name = "repeat", .kind = ActorKind::repeat, .dtype = i64, .where = {.stream = 1},
                 .inputs = {{rw}}, .outputs = {rwr}, .group = M});
    p.add_actor({.name = "x", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
                 .where = {.stream = 0}, .outputs = {rx}, .pieces = steps * M});
    p.add_actor({.name = "add", .op = "add_recording", .dtype = i64, .where = {.stream = 1},
                 .inputs = {{rx}, {rwr}}, .outputs = {ry}});
    p.add_actor({.name = "acc", .kind = ActorKind::accumulate, .dtype = i64, .where = {.stream = 2},
                 .inputs = {{ry}}, .outputs = {rs}, .group = M});
    p.add_actor({.name = "sink", .op = "record_sum", .dtype = i64, .where = {.stream = 0}, .inputs = {{rs}}});
    Runtime rt(p, kernels, settings);
    auto report = rt.run();
    std::vector<std::int64_t> expected;
    for (std::int64_t s = 0; s < steps; ++s) expected.push_back(M * s * M + M * (M - 1) / 2 + M * s);
    CHECK(sums.values == expected);
    CHECK(actor_named(report, "repeat").acts == steps * M);
    CHECK(actor_named(report, "acc").acts == steps * M);
    // No copy: every weight the add read lives in a slot the weight actor wrote.
    for (const void* ptr : add_saw.pointers) {
      bool written_by_w = false;
      for (const void* w : weights_written.pointers) written_by_w |= (w == ptr);
      CHECK(written_by_w);
    }
  }
}

TEST_CASE("Runtime.Microbatching.PartialGroupIsAnError" * doctest::timeout(30)) {
  auto kernels = KernelRegistry::with_builtin_kernels();
  Plan p;
  auto rx = p.add_register({.name = "x", .shape = {2}, .dtype = f32, .slots = 2});
  auto rs = p.add_register({.name = "x.sum", .shape = {2}, .dtype = f32, .slots = 1});
  p.add_actor({.name = "x", .kind = ActorKind::source, .op = "fill_piece", .outputs = {rx}, .pieces = 10});
  p.add_actor({.name = "acc", .kind = ActorKind::accumulate, .inputs = {{rx}}, .outputs = {rs}, .group = 4});
  p.add_actor({.name = "sink", .op = "noop", .inputs = {{rs}}});
  Runtime rt(p, kernels, threaded());
  CHECK_THROWS_WITH_AS(rt.run(), doctest::Contains("accumulate actor 'acc' ended inside a group: 2 of 4"),
                       JobError);
}

TEST_CASE("Runtime.Cycle.DelayedInputCarriesStateAcrossPieces" * doctest::timeout(30)) {
  // state -> update -> state with a delay of one piece on update -> state: the shape of
  // variable -> ... -> optimizer -> variable. update_k = state_k + x_k and state_k =
  // update_{k-1} (0 at k = 0), so update_k is the running sum k(k+1)/2.
  constexpr std::int64_t pieces = 200;
  for (auto settings : {threaded(), deterministic()}) {
    auto kernels = KernelRegistry::with_builtin_kernels();
    Recorder sums;
    add_recorder(kernels, "record", sums);
    kernels.add_fn("carry", DeviceType::cpu, i64, [](KernelContext& ctx) {
      auto out = ctx.outputs[0]->data<std::int64_t>();
      if (ctx.inputs[0] == nullptr) {
        std::fill(out.begin(), out.end(), 0);
      } else {
        auto in = ctx.inputs[0]->data<std::int64_t>();
        std::copy(in.begin(), in.end(), out.begin());
      }
    });
    Plan p;
    auto rx = p.add_register({.name = "x", .shape = {2}, .dtype = i64, .slots = 2});
    auto rstate = p.add_register({.name = "state", .shape = {2}, .dtype = i64, .slots = 1});
    auto rupd = p.add_register({.name = "update", .shape = {2}, .dtype = i64, .slots = 1});
    p.add_actor({.name = "x", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
                 .where = {.stream = 0}, .outputs = {rx}, .pieces = pieces});
    p.add_actor({.name = "state", .op = "carry", .dtype = i64, .where = {.stream = 1},
                 .inputs = {{rupd, 1}}, .outputs = {rstate}});
    p.add_actor({.name = "update", .op = "add", .dtype = i64, .where = {.stream = 0},
                 .inputs = {{rstate}, {rx}}, .outputs = {rupd}});
    p.add_actor({.name = "sink", .op = "record", .dtype = i64, .where = {.stream = 1}, .inputs = {{rupd}}});
    Runtime rt(p, kernels, settings);
    auto report = rt.run();
    REQUIRE(sums.values.size() == pieces);
    for (std::int64_t k = 0; k < pieces; ++k) CHECK(sums.values[static_cast<std::size_t>(k)] == k * (k + 1) / 2);
    CHECK(actor_named(report, "state").acts == pieces + 1);  // the last state is the final one
  }
}

// Sampled time accounting (the default, RuntimeSettings::time_sample_hz) against a busy loop
// of known length: a stage spins 200 us per act for 1,500 acts, 0.3 s of kernel by the wall
// clock (spin_ns waits on steady_clock, so a preemption inside it does not lengthen it). The
// sampler books each interval to what the actor was doing when it looked, so its error is a
// few sampling periods (1 ms) at the edges of the states plus the intervals it lost to being
// late; 10% of 0.3 s is 30 periods: it holds on a loaded machine and under the sanitizers, and
// a sampler that booked nothing, booked the wrong state, or counted an interval twice would
// miss it (by 100%, by the whole kernel share, by double). Exact accounting (time_sample_hz 0),
// which reads the clock around the kernel, is bounded below by the spin itself.
TEST_CASE("Runtime.Metrics.SampledTimeIsWithinItsErrorOfAMeasuredBusyLoop" * doctest::timeout(60)) {
  auto kernels = KernelRegistry::with_builtin_kernels();
  constexpr std::int64_t acts = 1500;
  constexpr double spin_s = 200e-6;
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {16}, .dtype = f32, .slots = 2});
  auto b = p.add_register({.name = "b", .shape = {16}, .dtype = f32, .slots = 2});
  p.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .where = {.stream = 0},
               .outputs = {a}, .pieces = acts});
  p.add_actor({.name = "spin", .op = "spin_ns", .where = {.stream = 1}, .inputs = {{a}}, .outputs = {b},
               .attrs = {{"ns", std::int64_t{200'000}}}});
  p.add_actor({.name = "sink", .op = "noop", .where = {.stream = 0}, .inputs = {{b}}});
  const double spun = acts * spin_s;
  SUBCASE("sampled") {
    Runtime rt(p, kernels, threaded());
    auto report = rt.run();
    // Sampling needs a real-time priority for its thread (root, as CI runs; CAP_SYS_NICE); the
    // run accounts exactly where it cannot have one, and the same bounds hold.
    if (geteuid() == 0) CHECK(report.time_accounting == "sampled at 1000 Hz");
    const auto& spin = actor_named(report, "spin");
    INFO(report.time_accounting, ": kernel_s ", spin.kernel_s, " busy_s ", spin.busy_s, " lifetime ", spin.lifetime_s(), " wall ", report.wall_s);
    CHECK(spin.kernel_s == doctest::Approx(spun).epsilon(0.10));
    CHECK(spin.busy_s >= spin.kernel_s);
    CHECK(spin.busy_s <= report.wall_s * 1.01);
    // Downstream of the bottleneck the sink waits for it: its starved time is most of its life.
    const auto& sink = actor_named(report, "sink");
    CHECK(sink.starved_s > 0.5 * sink.lifetime_s());
    for (const auto& m : report.metrics.actors) {
      CHECK(m.lifetime_s() <= report.wall_s * 1.01);
      CHECK(m.lifetime_s() >= 0.8 * spun);  // every actor lived through the whole run
    }
  }
  SUBCASE("exact") {
    RuntimeSettings s = threaded();
    s.time_sample_hz = 0;
    Runtime rt(p, kernels, s);
    auto report = rt.run();
    const auto& spin = actor_named(report, "spin");
    CHECK(spin.kernel_s >= spun);
    CHECK(spin.kernel_s <= report.wall_s);
    CHECK(spin.busy_s >= spin.kernel_s);
  }
}

TEST_CASE("Runtime.Metrics.TimeBucketsSumToLifetime" * doctest::timeout(30)) {
  auto kernels = KernelRegistry::with_builtin_kernels();
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {64}, .dtype = f32, .slots = 2});
  auto b = p.add_register({.name = "b", .shape = {64}, .dtype = f32, .slots = 2});
  p.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .where = {.stream = 0},
               .outputs = {a}, .pieces = 2000});
  p.add_actor({.name = "slow", .op = "spin_ns", .where = {.stream = 1}, .inputs = {{a}}, .outputs = {b},
               .attrs = {{"ns", std::int64_t{20'000}}}});
  p.add_actor({.name = "sink", .op = "noop", .where = {.stream = 0}, .inputs = {{b}}});
  // Exact accounting (the clock read at every change): the bounds below are exact ones. The
  // sampled default's error is the test above's.
  RuntimeSettings exact = threaded();
  exact.time_sample_hz = 0;
  Runtime rt(p, kernels, exact);
  auto report = rt.run();
  for (const auto& m : report.metrics.actors) {
    CHECK(m.acts == 2000);
    CHECK(m.lifetime_s() > 0.0);
    CHECK(m.lifetime_s() <= report.wall_s * 1.01);
  }
  const auto& slow = actor_named(report, "slow");
  const auto& src = actor_named(report, "src");
  const auto& sink = actor_named(report, "sink");
  // The spinning stage is the bottleneck: it was busy at least as long as it spun; upstream
  // waits on it, downstream starves. (Lower bounds and comparisons only: on a loaded machine
  // the shares move, but not these.)
  CHECK(slow.busy_s >= 2000 * 20e-6);
  CHECK(src.backpressured_s > src.busy_s);
  CHECK(sink.starved_s > sink.busy_s);
  CHECK(slow.bytes_in == 2000 * 64 * 4);
  CHECK(slow.bytes_out == 2000 * 64 * 4);
  for (const auto& r : report.metrics.registers) {
    CHECK(r.written == 2000);
    CHECK(r.freed == 2000);
    CHECK(r.max_outstanding <= r.slots);
  }
}

TEST_CASE("Runtime.TwoRuntimesInOneProcess" * doctest::timeout(30)) {
  auto kernels = test::checking_registry();
  std::atomic<int> finished{0};
  auto job = [&] {
    Runtime rt(chain3(2, 20'000), kernels, threaded());
    auto report = rt.run();
    if (actor_named(report, "C").acts == 20'000) ++finished;
  };
  std::thread t1(job), t2(job);
  t1.join();
  t2.join();
  CHECK(finished == 2);
}

TEST_CASE("Runtime.RunTwiceIsRefused") {
  auto kernels = KernelRegistry::with_builtin_kernels();
  Runtime rt(chain3(1, 3), kernels, deterministic());
  rt.run();
  CHECK_THROWS_AS(rt.run(), std::logic_error);
}

TEST_CASE("Runtime.RecordingNeedsDeterministicMode") {
  auto kernels = KernelRegistry::with_builtin_kernels();
  RuntimeSettings s;
  s.record_handshakes = true;
  CHECK_THROWS_AS(Runtime(chain3(1, 3), kernels, s), std::invalid_argument);
}

TEST_CASE("Runtime.Drain.AnActorThatDrainsKeepsConsumingAfterItsReadersStop" * doctest::timeout(30)) {
  // Regression: a variable stopped as soon as the forward pass stopped reading its weights, and
  // so never applied the last step's gradient. `state` reads 50 updates (delay 1) while its only
  // reader stops after 5 pieces: with stops_when_unread = false it still takes all 50.
  for (bool drains : {true, false}) {
    auto kernels = KernelRegistry::with_builtin_kernels();
    std::atomic<int> updates_seen{0};
    kernels.add_fn("count_updates", DeviceType::cpu, i64, [&updates_seen](KernelContext& ctx) {
      if (ctx.inputs[0] != nullptr) ++updates_seen;
    });
    Plan p;
    auto rl = p.add_register({.name = "updates", .shape = {1}, .dtype = i64, .slots = 2});
    auto rs = p.add_register({.name = "short", .shape = {1}, .dtype = i64, .slots = 2});
    auto rstate = p.add_register({.name = "state", .shape = {1}, .dtype = i64, .slots = 1});
    auto rsum = p.add_register({.name = "sum", .shape = {1}, .dtype = i64, .slots = 2});
    p.add_actor({.name = "updates", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
                 .outputs = {rl}, .pieces = 50});
    p.add_actor({.name = "short", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64,
                 .outputs = {rs}, .pieces = 5});
    p.add_actor({.name = "state", .op = "count_updates", .dtype = i64, .inputs = {{rl, 1}}, .outputs = {rstate},
                 .stops_when_unread = !drains});
    p.add_actor({.name = "reader", .op = "add", .dtype = i64, .inputs = {{rstate}, {rs}}, .outputs = {rsum}});
    p.add_actor({.name = "sink", .op = "noop", .dtype = i64, .inputs = {{rsum}}});
    for (auto settings : {threaded(), deterministic()}) {
      updates_seen = 0;
      Runtime rt(p, kernels, settings);
      auto report = rt.run();
      CHECK(actor_named(report, "reader").acts == 5);
      if (drains) {
        CHECK(updates_seen == 50);
        CHECK(actor_named(report, "state").acts == 51);
      } else {
        CHECK(updates_seen < 50);
      }
    }
  }
}

TEST_CASE("Runtime.ActivityLog.RecordsEveryActInOrderPerActor" * doctest::timeout(30)) {
  RuntimeSettings s = threaded();
  s.activity_log = true;
  Runtime rt(chain3(2, 50), KernelRegistry::with_builtin_kernels(), s);
  const std::uint64_t before = steady_ns();
  rt.run();
  const std::uint64_t after = steady_ns();
  std::vector<ActRecord> log;
  CHECK(rt.drain_activity(log) == 150);
  CHECK(rt.activity_dropped() == 0);
  const auto names = rt.worker_names();
  std::map<ActorIndex, std::int64_t> next;
  for (const auto& r : log) {
    CHECK(r.piece == next[r.actor]++);  // per worker in order, and each actor has one worker
    CHECK(r.start_ns >= before);
    CHECK(r.end_ns >= r.start_ns);
    CHECK(r.end_ns <= after);
    CHECK(r.worker < names.size());
  }
  CHECK(next.size() == 3);
  CHECK(rt.drain_activity(log) == 0);  // drained once

  Runtime off(chain3(2, 5), KernelRegistry::with_builtin_kernels(), threaded());
  CHECK_THROWS_AS(off.set_activity_log(true), std::logic_error);
  off.run();
  CHECK(off.drain_activity(log) == 0);
}

TEST_CASE("Runtime.MeasuredMemory.ASlotIsInUseFromItsWriteToItsLastRelease" * doctest::timeout(60)) {
  auto reg = KernelRegistry::with_builtin_kernels();
  // Off by default: nothing measured.
  CHECK(Runtime(chain3(1, 10), reg, deterministic()).run().memory.empty());
  // One slot per register, one thread in a fixed order: B publishes b before it releases a (a
  // reader's request goes out before its writer hears of space), so both 8-byte slots are in use
  // at once, and never more.
  RuntimeSettings one = deterministic();
  one.measure_memory = true;
  const RunReport d = Runtime(chain3(1, 10), reg, one).run();
  REQUIRE(d.memory.size() == 1);
  CHECK(d.memory[0].peak_bytes == 16);
  // Three workers (A, B, C on cpu:0, 1, 2), 2 slots per register: each device counts the
  // register its actor writes, at least one slot and at most both.
  Plan p = chain3(2, 2000);
  for (int i = 0; i < 3; ++i) p.actors[static_cast<std::size_t>(i)].where.device = Device{DeviceType::cpu, static_cast<std::uint8_t>(i)};
  RuntimeSettings many = threaded();
  many.measure_memory = true;
  const RunReport t = Runtime(p, reg, many).run();
  std::map<std::string, std::int64_t> peak;
  for (const MeasuredMemory& m : t.memory) peak[m.device.str()] = m.peak_bytes;
  CHECK(peak.size() == 2);  // C writes nothing: its device has nothing to count
  CHECK(peak["cpu:0"] >= 8);
  CHECK(peak["cpu:0"] <= 16);
  CHECK(peak["cpu:1"] >= 8);
  CHECK(peak["cpu:1"] <= 16);
}

// A view (a repeat of group 1) reads nothing and copies nothing: its readers read its input's
// slot, so that slot is in use until they have released it, and no longer, whenever the view's
// own worker gets round to acking its input (the plan's lives say the same: plan_memory.h).
TEST_CASE("Runtime.MeasuredMemory.AViewsInputIsInUseUntilTheViewsReadersAreDone" * doctest::timeout(60)) {
  auto reg = KernelRegistry::with_builtin_kernels();
  for (const bool threads : {false, true}) {
    CAPTURE(threads);
    // A -> a -> V (view) -> v -> B -> b -> C -> c -> D, one slot each, 8 bytes a slot.
    Plan p;
    RegisterIndex r[4];
    const char* names[] = {"a", "v", "b", "c"};
    for (int i = 0; i < 4; ++i) r[i] = p.add_register({.name = names[i], .shape = {1}, .dtype = i64, .slots = 1});
    p.add_actor({.name = "A", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64, .outputs = {r[0]}, .pieces = 400});
    p.add_actor({.name = "V", .kind = ActorKind::repeat, .op = "view", .dtype = i64, .inputs = {{r[0]}}, .outputs = {r[1]}, .group = 1});
    p.add_actor({.name = "B", .op = "copy", .dtype = i64, .inputs = {{r[1]}}, .outputs = {r[2]}});
    p.add_actor({.name = "C", .op = "copy", .dtype = i64, .inputs = {{r[2]}}, .outputs = {r[3]}});
    p.add_actor({.name = "D", .op = "noop", .dtype = i64, .inputs = {{r[3]}}});
    RuntimeSettings s = threads ? threaded() : deterministic();
    s.measure_memory = true;
    const RunReport report = Runtime(p, reg, s).run();
    REQUIRE(report.memory.size() == 1);
    // Every writer's slot and its reader's: a and b at B's act, b and c at C's; with the view's
    // input counted until the view's worker acked it, a, b and c could all be counted at C's.
    // With three workers on one device (threads), A may write a again while C reads b and
    // D reads c: at most a, b and c.
    CHECK(report.memory[0].peak_bytes >= 16);
    CHECK(report.memory[0].peak_bytes <= (threads ? 24 : 16));
  }
}

namespace {

/// A counter that keeps its value in its own memory and offers it as its output
/// (Kernel::owned_output): act k adds 1 to it in place. `offer`: a tensor of this shape (or none).
class OwnCounter final : public Kernel {
 public:
  explicit OwnCounter(Shape offer) : value_(Tensor::zeros({1}, i64)), offer_(std::move(offer)) {
    if (!offer_.empty() && offer_ != Shape{1}) value_ = Tensor::zeros(offer_, i64);
  }
  void compute(KernelContext& ctx) override {
    value_.data<std::int64_t>()[0] += 1;
    if (ctx.outputs[0]->raw() != value_.raw()) std::memcpy(ctx.outputs[0]->raw(), value_.raw(), 8);
  }
  Tensor owned_output(std::size_t) override { return offer_.empty() ? Tensor() : value_; }

 private:
  Tensor value_;
  Shape offer_;
};

}  // namespace

// A register whose one slot is its producer's kernel's memory (RegisterDesc::kernel_memory: a
// weight its optimizer updates in place): the reader reads the kernel's tensor itself, and the
// kernel writes it again only once the reader has acked the last value.
TEST_CASE("Runtime.KernelMemory.AReaderReadsTheKernelsOwnTensorBetweenItsWrites" * doctest::timeout(60)) {
  for (const bool threads : {false, true}) {
    CAPTURE(threads);
    for (const Shape& offer : {Shape{1}, Shape{}, Shape{2}}) {
      CAPTURE(offer.size());
      Plan p;
      auto tick = p.add_register({.name = "tick", .shape = {1}, .dtype = i64, .slots = 2});
      auto count = p.add_register({.name = "count", .shape = {1}, .dtype = i64, .slots = 1, .kernel_memory = true});
      p.add_actor({.name = "T", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64, .outputs = {tick}, .pieces = 300});
      p.add_actor({.name = "K", .op = "own_counter", .dtype = i64, .inputs = {{tick}}, .outputs = {count}});
      p.add_actor({.name = "R", .op = "record", .dtype = i64, .inputs = {{count}}});
      auto reg = KernelRegistry::with_builtin_kernels();
      reg.add("own_counter", DeviceType::cpu, i64, [offer](const KernelConfig&) { return std::make_unique<OwnCounter>(offer); });
      auto seen = std::make_shared<std::vector<std::int64_t>>();
      auto where = std::make_shared<std::set<const void*>>();
      reg.add_fn("record", DeviceType::cpu, i64, [seen, where](KernelContext& ctx) {
        seen->push_back(ctx.inputs[0]->data<std::int64_t>()[0]);
        where->insert(ctx.inputs[0]->raw());
      });
      if (offer == Shape{2}) {
        // A tensor of another shape than the register's: refused, naming both.
        CHECK_THROWS_WITH_AS(Runtime(p, reg, threads ? threaded() : deterministic()).run(),
                             doctest::Contains("actor 'K' offers a i64[2]"), PlanError);
        continue;
      }
      Runtime(p, reg, threads ? threaded() : deterministic()).run();
      REQUIRE(seen->size() == 300);
      for (std::size_t i = 0; i < seen->size(); ++i) CHECK((*seen)[i] == static_cast<std::int64_t>(i + 1));
      CHECK(where->size() == 1);  // one slot: the kernel's tensor, or one the runtime allocated
    }
  }
  // One slot, no arena, a compute actor: else refused.
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {1}, .dtype = i64, .slots = 2, .kernel_memory = true});
  p.add_actor({.name = "A", .kind = ActorKind::source, .op = "fill_piece", .dtype = i64, .outputs = {a}, .pieces = 3});
  p.add_actor({.name = "B", .op = "noop", .dtype = i64, .inputs = {{a}}});
  CHECK_THROWS_WITH_AS(validate(p, KernelRegistry::with_builtin_kernels()),
                       doctest::Contains("register 'a' is its producer's kernel's memory, which needs one slot (2)"),
                       PlanError);
}
