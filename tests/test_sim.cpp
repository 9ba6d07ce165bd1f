// The sim device (baton/kernels/sim.h): an asynchronous stream on the CPU, and the runtime's
// stream-ordered handshakes on it (DESIGN.md section 3, EdgeSync in plan.h). These are the twins
// of the CUDA runtime tests (test_cuda.cpp), and they run everywhere: in CI, under TSan.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/graph/collectives.h"
#include "baton/graph/program.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "models.h"

#include "test_util.h"

using namespace baton;
using namespace std::chrono_literals;

namespace {

const Device sim0 = Device::parse("sim:0");
const Device sim1 = Device::parse("sim:1");

std::unique_ptr<sim::Stream> make_stream(Device d = sim0, std::string_view owner = "test") {
  return sim::Stream::create(d, owner);
}

/// Waits (bounded) until `pred` holds; false if it did not within `limit`.
template <class P>
bool eventually(P pred, std::chrono::milliseconds limit = 10'000ms) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(100us);
  }
  return true;
}

}  // namespace

TEST_CASE("Sim.Stream.RunsWorkInOrderAndFailsStickily" * doctest::timeout(60)) {
  auto s = make_stream();
  std::vector<int> order;  // written by the stream's thread only, read after synchronize()
  for (int i = 0; i < 100; ++i) s->enqueue([&order, i] { order.push_back(i); });
  s->synchronize();
  REQUIRE(order.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
  CHECK(s->idle());
  CHECK(s->failure().empty());

  // A failure is sticky, as a CUDA fault is: nothing after it runs, callbacks included.
  std::atomic<int> ran_after{0};
  std::atomic<int> callbacks{0};
  s->enqueue([] { throw std::runtime_error("the kernel broke"); });
  s->enqueue([&] { ++ran_after; });
  s->when_reached([](void* p) { ++*static_cast<std::atomic<int>*>(p); }, &callbacks);
  CHECK(eventually([&] { return s->idle(); }));
  CHECK(test::contains(s->failure(), "the kernel broke"));
  CHECK(test::contains(s->failure(), "test"));
  CHECK(ran_after == 0);
  CHECK(callbacks == 0);
  CHECK_THROWS_WITH_AS(s->synchronize(), doctest::Contains("the kernel broke"), std::runtime_error);
}

// Capture, as CUDA's stream capture: what is enqueued between begin_capture and end_capture is
// recorded, not run; each launch enqueues it again, in order, after what came before; a
// synchronize (or an event) during the capture throws and invalidates it, and the stream then
// works as before.
TEST_CASE("Sim.Stream.ACaptureRunsNothingUntilLaunchedAndReplaysInOrder" * doctest::timeout(60)) {
  auto s = sim::Stream::create(Device::parse("sim:0"), "capture test");
  std::vector<int> seen;  // written by the stream's thread only
  s->enqueue([&] { seen.push_back(0); });
  s->begin_capture();
  s->enqueue([&] { seen.push_back(1); });
  s->enqueue([&] { seen.push_back(2); });
  std::unique_ptr<StreamGraph> g = s->end_capture();
  s->synchronize();
  CHECK(seen == std::vector<int>{0});  // recorded, not run
  s->launch(*g);
  s->enqueue([&] { seen.push_back(3); });
  s->launch(*g);
  s->synchronize();
  CHECK(seen == std::vector<int>{0, 1, 2, 3, 1, 2});
  // What cannot be captured.
  s->begin_capture();
  s->enqueue([&] { seen.push_back(9); });
  CHECK_THROWS_WITH_AS(s->synchronize(), doctest::Contains("synchronize during a capture"), std::runtime_error);
  CHECK_THROWS_WITH_AS(s->end_capture(), doctest::Contains("the capture is invalid"), std::runtime_error);
  auto ev = s->make_event();
  s->begin_capture();
  CHECK_THROWS_AS(s->record(*ev), std::runtime_error);
  CHECK_THROWS_AS(s->end_capture(), std::runtime_error);
  // The stream after the failed captures: as before, nothing of theirs ran.
  s->enqueue([&] { seen.push_back(4); });
  s->synchronize();
  CHECK(seen == std::vector<int>{0, 1, 2, 3, 1, 2, 4});
  CHECK(s->failure().empty());
}

// A Program whose kernels cannot all be captured (here a relu that waits for its stream on the
// host, as a kernel reading a value back would): the capture at the second run fails, the
// program says why (graph_status) and runs its kernels one by one from then on, the results
// right every run; a program without it captures and launches the graph.
TEST_CASE("Sim.Program.ACaptureThatFailsRunsTheKernelsOneByOne" * doctest::timeout(60)) {
  for (bool syncing : {false, true}) {
    CAPTURE(syncing);
    KernelRegistry reg = KernelRegistry::with_builtin_kernels();
    if (syncing) {
      reg.add_fn("relu", DeviceType::sim, f32, [](KernelContext& ctx) {
        auto* s = dynamic_cast<sim::Stream*>(ctx.async_stream);
        REQUIRE(s != nullptr);
        const Tensor x = *ctx.inputs[0];
        Tensor y = *ctx.outputs[0];
        s->enqueue([x, y]() mutable {
          for (std::size_t i = 0; i < y.data<float>().size(); ++i) y.data<float>()[i] = std::max(0.f, x.data<float>()[i]);
        });
        s->synchronize();
      });
    }
    Graph g;
    Value y = relu(g.input("x", {4}));
    Program p(g, {y}, std::make_shared<ParameterStore>(), {}, reg, Device::parse("sim:0"));
    p.use_graphs(true);
    CHECK(p.graph_status() == "waiting");
    for (int run = 0; run < 4; ++run) {
      auto x = p.input("x").data<float>();
      for (std::size_t i = 0; i < 4; ++i) x[i] = static_cast<float>(run) - static_cast<float>(i);
      const Tensor& out = p.run()[0];
      for (std::size_t i = 0; i < 4; ++i) CHECK(out.data<float>()[i] == std::max(0.f, static_cast<float>(run) - static_cast<float>(i)));
    }
    if (syncing) {
      CHECK(p.graph_status().starts_with("refused: "));
      CHECK(test::contains(p.graph_status(), "synchronize during a capture"));
      CHECK(p.graph_launches() == 0);
    } else {
      CHECK(p.graph_status() == "captured");
      CHECK(p.graph_launches() == 3);
    }
  }
}

TEST_CASE("Sim.Stream.CallbacksComeWhenTheWorkBeforeThemIsDone" * doctest::timeout(60)) {
  auto s = make_stream();
  std::atomic<bool> done{false};
  struct Seen {
    std::atomic<bool>* done;
    std::atomic<int> calls{0};
    std::atomic<bool> early{false};
  } seen{&done};
  s->enqueue([&] {
    std::this_thread::sleep_for(20ms);
    done = true;
  });
  s->when_reached(
      [](void* p) {
        auto* v = static_cast<Seen*>(p);
        if (!v->done->load()) v->early = true;
        ++v->calls;
      },
      &seen);
  CHECK(eventually([&] { return seen.calls.load() == 1; }));
  CHECK_FALSE(seen.early.load());
}

TEST_CASE("Sim.Stream.EventsOrderTwoStreams" * doctest::timeout(60)) {
  auto a = make_stream(sim0, "a");
  auto b = make_stream(sim1, "b");
  auto e = a->make_event();
  // Waiting for an event never recorded waits for nothing.
  std::atomic<bool> b_ran{false};
  b->wait(*e);
  b->enqueue([&] { b_ran = true; });
  b->synchronize();
  CHECK(b_ran.load());

  // b's work after the wait runs only once a's work before the record has: a blocks until told,
  // so without the event b would run first.
  std::atomic<bool> release_a{false}, a_done{false}, b_saw_a{false}, b_done{false};
  a->enqueue([&] {
    (void)eventually([&] { return release_a.load(); });
    a_done = true;
  });
  a->record(*e);
  a->enqueue([] {});  // recorded after: not waited for
  b->wait(*e);
  b->enqueue([&] {
    b_saw_a = a_done.load();
    b_done = true;
  });
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(b_done.load());  // still waiting for a
  // A later record does not change what the earlier wait waits for.
  a->record(*e);
  release_a = true;
  b->synchronize();
  CHECK(b_saw_a.load());

  // A wait on a stream that failed fails the waiting stream too (CUDA would never get past it).
  auto c = make_stream(sim0, "c");
  auto f = c->make_event();
  c->enqueue([] { throw std::runtime_error("c broke"); });
  c->record(*f);
  b->wait(*f);
  CHECK_THROWS_WITH_AS(b->synchronize(), doctest::Contains("c broke"), std::runtime_error);
}

TEST_CASE("Sim.Stream.DestroyingAStreamThatOthersWaitForIsSafe" * doctest::timeout(60)) {
  auto b = make_stream(sim1, "b");
  {
    auto a = make_stream(sim0, "a");
    auto e = a->make_event();
    a->enqueue([] { std::this_thread::sleep_for(50ms); });
    a->record(*e);
    b->wait(*e);
  }  // a stops with its work undone: b's wait must end, not hang or read freed memory
  CHECK_THROWS_WITH_AS(b->synchronize(), doctest::Contains("stopped"), std::runtime_error);
}

namespace {

/// Registers "test.slow_scale" for sim: y = 2 x, written one element at a time with a pause, so
/// that a reader that came too early sees a mix of old and new values.
void add_slow_kernels(KernelRegistry& reg) {
  reg.add_fn("test.slow_scale", DeviceType::cpu, f32, [](KernelContext& ctx) {
    auto x = ctx.inputs[0]->data<float>();
    auto y = ctx.outputs[0]->data<float>();
    for (std::size_t i = 0; i < x.size(); ++i) {
      y[i] = 2.f * x[i];
      if (i % 256 == 0) std::this_thread::sleep_for(1us);
    }
  });
}

/// A sink that checks every element of a piece is the same value and collects it.
void add_collector(KernelRegistry& reg, std::vector<float>& seen) {
  reg.add_fn("test.collect", DeviceType::cpu, f32, [&seen](KernelContext& ctx) {
    auto x = ctx.inputs[0]->data<float>();
    for (float v : x) {
      if (v != x[0])
        throw std::runtime_error(
            fmt::format("piece {}: mixed values {} and {}", ctx.piece, x[0], v));
    }
    seen.push_back(x[0]);
  });
}

// source (cpu) -> slow scale x2 (sim:0 s0) -> relu (sim:0 s0) -> scale (sim:0 s1: an event edge)
// -> collect (cpu): insert_device_copies puts a to_device and a to_host copy in between.
Plan host_device_host(std::int64_t pieces, std::int32_t slots) {
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {4096}, .dtype = f32, .slots = slots});
  auto b = p.add_register({.name = "b", .shape = {4096}, .dtype = f32, .slots = slots});
  auto c = p.add_register({.name = "c", .shape = {4096}, .dtype = f32, .slots = slots});
  auto d = p.add_register({.name = "d", .shape = {4096}, .dtype = f32, .slots = slots});
  p.add_actor({.name = "src",
               .kind = ActorKind::source,
               .op = "fill_piece",
               .outputs = {a},
               .pieces = pieces,
               .attrs = Attrs{{"offset", std::int64_t{-3}}}});
  p.add_actor({.name = "twice",
               .op = "test.slow_scale",
               .where = {.device = sim0},
               .inputs = {{a}},
               .outputs = {b}});
  p.add_actor(
      {.name = "relu", .op = "relu", .where = {.device = sim0}, .inputs = {{b}}, .outputs = {c}});
  p.add_actor({.name = "again",
               .op = "test.slow_scale",
               .where = {.device = sim0, .stream = 1},
               .inputs = {{c}},
               .outputs = {d}});
  p.add_actor({.name = "sink", .op = "test.collect", .inputs = {{d}}});
  return insert_device_copies(p);
}

const ActorDesc& actor_named(const Plan& p, const std::string& name) {
  for (const auto& a : p.actors) {
    if (a.name == name) return a;
  }
  throw std::invalid_argument("no actor " + name);
}

ActorIndex index_of(const Plan& p, const std::string& name) {
  return static_cast<ActorIndex>(&actor_named(p, name) - p.actors.data());
}

}  // namespace

TEST_CASE("Sim.Plan.EdgesSayHowTheySynchronize") {
  const Plan plan = host_device_host(10, 2);
  auto sync_of = [&](const std::string& consumer) {
    const ActorDesc& a = actor_named(plan, consumer);
    return edge_sync(plan, a.inputs[0].reg, index_of(plan, consumer));
  };
  // Copies on the copy stream, as for CUDA.
  CHECK(actor_named(plan, "a@sim:0").op == "to_device");
  CHECK(actor_named(plan, "d@cpu:0").op == "to_host");
  CHECK(sync_of("a@sim:0") == EdgeSync::from_host);  // a host writer: the copy acks when it ran
  CHECK(sync_of("twice") == EdgeSync::event);        // copy stream -> compute stream
  CHECK(sync_of("relu") == EdgeSync::same_stream);
  CHECK(sync_of("again") == EdgeSync::event);  // stream 0 -> stream 1
  CHECK(sync_of("d@cpu:0") == EdgeSync::event);
  CHECK(sync_of("sink") == EdgeSync::to_host);  // the host reads what a stream wrote
  CHECK(test::contains(plan.to_text(), "sync=[same_stream]"));
  CHECK(test::contains(plan.to_text(), "sync=[to_host]"));
}

// The twin of Cuda.Runtime.CopyActorsMoveEveryPieceInOrder: every piece arrives complete and in
// order through two streams and the copies, with 1 and 2 slots per register (a request or an
// ack that went out before the stream ran what it stands for shows as a mixed or stale piece).
TEST_CASE("Sim.Runtime.CopyActorsMoveEveryPieceInOrder" * doctest::timeout(120)) {
  for (std::int32_t slots : {1, 2}) {
    const Plan plan = host_device_host(200, slots);
    for (auto mode : {ExecutionMode::threaded, ExecutionMode::deterministic}) {
      for (bool stream_order : {true, false}) {
        if (mode == ExecutionMode::deterministic && !stream_order) continue;
        CAPTURE(slots);
        CAPTURE(static_cast<int>(mode));
        CAPTURE(stream_order);
        KernelRegistry reg = KernelRegistry::with_builtin_kernels();
        add_slow_kernels(reg);
        std::vector<float> seen;
        add_collector(reg, seen);
        RuntimeSettings s;
        s.mode = mode;
        s.stream_order = stream_order;
        s.stall_timeout = 30'000ms;
        Runtime rt(plan, reg, s);
        rt.run();
        REQUIRE(seen.size() == 200);
        for (std::size_t i = 0; i < seen.size(); ++i) {
          CHECK(seen[i] == 4.f * std::max(0.f, static_cast<float>(i) - 3));
        }
      }
    }
  }
}

// A writer on one stream must not write a slot again before a reader on another stream has run
// its read of it (the event the reader left with its ack): here the writer is fast and the
// reader slow, with one slot, so a writer that did not wait would change the piece under it.
TEST_CASE("Sim.Runtime.AWriterWaitsForItsReadersOnOtherStreams" * doctest::timeout(120)) {
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {4096}, .dtype = f32, .slots = 2});
  auto b = p.add_register({.name = "b", .shape = {4096}, .dtype = f32, .slots = 1});
  auto c = p.add_register({.name = "c", .shape = {4096}, .dtype = f32, .slots = 2});
  p.add_actor({.name = "src",
               .kind = ActorKind::source,
               .op = "fill_piece",
               .outputs = {a},
               .pieces = 100});
  p.add_actor(
      {.name = "fast", .op = "relu", .where = {.device = sim0}, .inputs = {{a}}, .outputs = {b}});
  p.add_actor({.name = "slow",
               .op = "test.slow_scale",
               .where = {.device = sim0, .stream = 1},
               .inputs = {{b}},
               .outputs = {c}});
  p.add_actor({.name = "sink", .op = "test.collect", .inputs = {{c}}});
  const Plan plan = insert_device_copies(p);
  CHECK(edge_sync(plan, b, index_of(plan, "slow")) == EdgeSync::event);
  KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  add_slow_kernels(reg);
  std::vector<float> seen;
  add_collector(reg, seen);
  RuntimeSettings s;
  s.stall_timeout = 30'000ms;
  Runtime rt(plan, reg, s);
  rt.run();
  REQUIRE(seen.size() == 100);
  for (std::size_t i = 0; i < seen.size(); ++i) CHECK(seen[i] == 2.f * static_cast<float>(i));
}

// The point of stream order: a consumer on the same stream enqueues its act while the
// producer's is still running (the host does not sit between kernels). The producer's kernel
// blocks until the consumer's act has been enqueued; under the old rule (requests only once the
// stream had run the act) it would wait for its deadline and the test fail.
TEST_CASE("Sim.Runtime.AConsumerOnTheSameStreamEnqueuesBeforeTheProducerRan" *
          doctest::timeout(60)) {
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {16}, .dtype = f32, .slots = 1});
  auto b = p.add_register({.name = "b", .shape = {16}, .dtype = f32, .slots = 1});
  auto c = p.add_register({.name = "c", .shape = {16}, .dtype = f32, .slots = 1});
  p.add_actor(
      {.name = "src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {a}, .pieces = 20});
  p.add_actor({.name = "producer",
               .op = "test.producer",
               .where = {.device = sim0},
               .inputs = {{a}},
               .outputs = {b}});
  p.add_actor({.name = "consumer",
               .op = "test.consumer",
               .where = {.device = sim0},
               .inputs = {{b}},
               .outputs = {c}});
  p.add_actor({.name = "sink", .op = "noop", .inputs = {{c}}});
  const Plan plan = insert_device_copies(p);
  KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  std::atomic<std::int64_t> consumer_enqueued{-1};
  std::atomic<int> producer_waited_out{0};
  reg.add("test.producer", DeviceType::sim, f32, [&](const KernelConfig& cfg) {
    struct Producer final : Kernel {
      std::atomic<std::int64_t>* enqueued;
      std::atomic<int>* waited_out;
      std::unique_ptr<Kernel> copy;
      void compute(KernelContext& ctx) override {
        auto* s = dynamic_cast<sim::Stream*>(ctx.async_stream);
        if (s == nullptr) throw std::logic_error("no sim stream");
        const std::int64_t piece = ctx.piece;
        const Tensor* in = ctx.inputs[0];
        Tensor* out = ctx.outputs[0];
        s->enqueue([=, this] {
          std::memcpy(out->raw(), in->raw(), in->nbytes());
          // Runs on the stream: the consumer of this piece should already be enqueued.
          if (!eventually([&] { return enqueued->load() >= piece; }, 5'000ms)) ++*waited_out;
        });
      }
    };
    auto k = std::make_unique<Producer>();
    k->enqueued = &consumer_enqueued;
    k->waited_out = &producer_waited_out;
    (void)cfg;
    return k;
  });
  reg.add("test.consumer", DeviceType::sim, f32, [&](const KernelConfig&) {
    struct Consumer final : Kernel {
      std::atomic<std::int64_t>* enqueued;
      void compute(KernelContext& ctx) override {
        auto* s = dynamic_cast<sim::Stream*>(ctx.async_stream);
        if (s == nullptr) throw std::logic_error("no sim stream");
        const Tensor* in = ctx.inputs[0];
        Tensor* out = ctx.outputs[0];
        s->enqueue([=] { std::memcpy(out->raw(), in->raw(), in->nbytes()); });
        enqueued->store(ctx.piece);  // on the worker, at enqueue time
      }
    };
    auto k = std::make_unique<Consumer>();
    k->enqueued = &consumer_enqueued;
    return k;
  });
  CHECK(edge_sync(plan, actor_named(plan, "consumer").inputs[0].reg, index_of(plan, "consumer")) ==
        EdgeSync::same_stream);
  RuntimeSettings s;
  s.stall_timeout = 30'000ms;
  Runtime rt(plan, reg, s);
  rt.run();
  CHECK(consumer_enqueued.load() == 19);
  CHECK(producer_waited_out.load() == 0);
}

// Copies onto a device from two others go on two streams (peer_copy_stream), so that a copy
// whose stream waits for one device's kernel does not hold up a copy from the other. Here the
// kernel on sim:0 blocks until the consumer of sim:2's register on sim:1 has run; sim:2's act
// comes 200 ms after sim:0's, so on one shared copy stream sim:2's copy would queue behind the
// wait for sim:0's kernel, which waits for it: the kernel would give up after 5 s (a deadlock
// in all but name; in a 1F1B pipeline, a gradient's copy behind the next activation's).
TEST_CASE("Sim.Runtime.ACopyWaitingForOneDeviceHoldsUpNoCopyFromAnother" * doctest::timeout(60)) {
  const Device sim2 = Device::parse("sim:2");
  Plan p;
  auto reg = [&](std::string name) { return p.add_register({.name = std::move(name), .shape = {16}, .dtype = f32}); };
  const RegisterIndex a0 = reg("a0"), x0 = reg("x0"), a2 = reg("a2"), late = reg("late"), x2 = reg("x2");
  p.add_actor({.name = "src0", .kind = ActorKind::source, .op = "fill_piece", .outputs = {a0}, .pieces = 1});
  p.add_actor({.name = "gate", .op = "test.gate", .where = {.device = sim0}, .inputs = {{a0}}, .outputs = {x0}});
  p.add_actor({.name = "from0", .op = "noop", .where = {.device = sim1}, .inputs = {{x0}}});
  p.add_actor({.name = "src2", .kind = ActorKind::source, .op = "fill_piece", .outputs = {a2}, .pieces = 1});
  p.add_actor({.name = "later", .op = "test.host_sleep", .inputs = {{a2}}, .outputs = {late}});
  p.add_actor({.name = "fast", .op = "relu", .where = {.device = sim2}, .inputs = {{late}}, .outputs = {x2}});
  // On a stream of its own: sim:1's stream 0 waits for the gate too (from0 reads its copy).
  p.add_actor({.name = "signal", .op = "test.signal", .where = {.device = sim1, .stream = 1}, .inputs = {{x2}}});
  const Plan plan = insert_device_copies(p);
  const ActorDesc& copy0 = actor_named(plan, "x0@sim:1");
  const ActorDesc& copy2 = actor_named(plan, "x2@sim:1");
  CHECK(copy0.where.stream == peer_copy_stream(sim0));
  CHECK(copy2.where.stream == peer_copy_stream(sim2));
  CHECK(copy0.where.stream != copy2.where.stream);
  CHECK(actor_named(plan, "a0@sim:0").where.stream == device_copy_stream);  // host -> device

  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  std::atomic<bool> signalled{false};
  std::atomic<int> gave_up{0};
  kernels.add_fn("test.host_sleep", DeviceType::cpu, f32, [](KernelContext& ctx) {
    std::this_thread::sleep_for(200ms);
    std::memcpy(ctx.outputs[0]->raw(), ctx.inputs[0]->raw(), ctx.inputs[0]->nbytes());
  });
  kernels.add_fn("test.gate", DeviceType::sim, f32, [&](KernelContext& ctx) {
    auto* s = dynamic_cast<sim::Stream*>(ctx.async_stream);
    if (s == nullptr) throw std::logic_error("no sim stream");
    const Tensor* in = ctx.inputs[0];
    Tensor* out = ctx.outputs[0];
    s->enqueue([=, &signalled, &gave_up] {
      if (!eventually([&] { return signalled.load(); }, 5'000ms)) ++gave_up;
      std::memcpy(out->raw(), in->raw(), in->nbytes());
    });
  });
  kernels.add_fn("test.signal", DeviceType::sim, f32, [&](KernelContext& ctx) {
    auto* s = dynamic_cast<sim::Stream*>(ctx.async_stream);
    if (s == nullptr) throw std::logic_error("no sim stream");
    s->enqueue([&signalled] { signalled.store(true); });
  });
  RuntimeSettings settings;
  settings.stall_timeout = 30'000ms;
  Runtime rt(plan, kernels, settings);
  rt.run();
  CHECK(signalled.load());
  CHECK(gave_up.load() == 0);
}

// The twin of Cuda.Runtime.DeviceFaultFailsTheJob: a kernel that fails on the stream at its last
// act fails the job, naming the failure and the actors on that stream, with the stall watchdog
// off (nothing else would end the wait: the failed stream runs no more callbacks).
TEST_CASE("Sim.Runtime.AStreamFailureFailsTheJob" * doctest::timeout(60)) {
  Plan p;
  auto r = p.add_register({.name = "r", .shape = {1024}, .dtype = f32, .slots = 2});
  auto h = p.add_register({.name = "h", .shape = {1024}, .dtype = f32, .slots = 2});
  p.add_actor({.name = "faulty",
               .kind = ActorKind::source,
               .op = "test.fault",
               .where = {.device = sim0},
               .outputs = {r},
               .pieces = 3});
  p.add_actor(
      {.name = "middle", .op = "copy", .where = {.device = sim0}, .inputs = {{r}}, .outputs = {h}});
  p.add_actor({.name = "sink", .op = "noop", .inputs = {{h}}});
  KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  reg.add_fn("test.fault", DeviceType::cpu, f32, [](KernelContext& ctx) {
    if (ctx.piece == 2) throw std::runtime_error("illegal address (simulated)");
  });
  for (auto mode : {ExecutionMode::threaded, ExecutionMode::deterministic}) {
    CAPTURE(static_cast<int>(mode));
    RuntimeSettings s;
    s.mode = mode;
    s.stall_timeout = 0ms;
    Runtime rt(insert_device_copies(p), reg, s);
    const std::string why = test::thrown_message<JobError>([&] { rt.run(); });
    CHECK(test::contains(why, "illegal address (simulated)"));
    if (mode == ExecutionMode::threaded)
      CHECK((test::contains(why, "'faulty'") || test::contains(why, "'middle'")));
  }
}

// The twin of Cuda.Collectives.AllReduceAmongStreamsOfOneDevice: the actors' all-reduce among
// members on three streams of two sim devices (event edges between them), fed from the host:
// every member gets every piece's exact sum (small integers: float sums are exact).
TEST_CASE("Sim.Collectives.AllReduceAmongStreams" * doctest::timeout(120)) {
  const std::int64_t elements = 4099, pieces = 6, n = 3;
  auto value = [](std::int64_t member, std::int64_t piece, std::int64_t i) {
    return static_cast<float>((member + 1) * 1000 + i % 977 + piece * 7);
  };
  for (auto algorithm : {AllReduceAlgorithm::ring, AllReduceAlgorithm::two_hop}) {
    for (auto mode : {ExecutionMode::threaded, ExecutionMode::deterministic}) {
      CAPTURE(static_cast<int>(algorithm));
      CAPTURE(static_cast<int>(mode));
      Plan plan;
      std::vector<AllReduceMember> members;
      for (std::int64_t j = 0; j < n; ++j) {
        const std::string suffix = fmt::format("@m{}", j);
        auto r = plan.add_register({.name = "grad" + suffix, .shape = {elements}, .dtype = f32});
        plan.add_actor({.name = "fill" + suffix,
                        .kind = ActorKind::source,
                        .op = "test.fill",
                        .outputs = {r},
                        .pieces = pieces,
                        .attrs = {{"member", j}}});
        members.push_back(
            {Placement{.device = j == 2 ? sim1 : sim0, .stream = static_cast<std::uint8_t>(j)}, r,
             suffix});
      }
      std::vector<RegisterIndex> results =
          add_allreduce(plan, "ar", members, {elements}, f32, 2, {.algorithm = algorithm});
      for (std::int64_t j = 0; j < n; ++j) {
        plan.add_actor({.name = fmt::format("check@m{}", j),
                        .op = "test.check",
                        .inputs = {{results[static_cast<std::size_t>(j)]}},
                        .attrs = {{"member", j}}});
      }
      plan = insert_device_copies(plan);
      KernelRegistry reg = KernelRegistry::with_builtin_kernels();
      add_collective_kernels(reg);
      reg.add("test.fill", DeviceType::cpu, f32,
              [&](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
                const std::int64_t member = cfg.attrs.get_int("member", -1);
                struct Fill final : Kernel {
                  std::int64_t member;
                  decltype(value) v;
                  Fill(std::int64_t m, decltype(value) f) : member(m), v(f) {}
                  void compute(KernelContext& ctx) override {
                    auto y = ctx.outputs[0]->data<float>();
                    for (std::size_t i = 0; i < y.size(); ++i)
                      y[i] = v(member, ctx.piece, static_cast<std::int64_t>(i));
                  }
                };
                return std::make_unique<Fill>(member, value);
              });
      std::mutex m;
      std::vector<std::string> wrong;
      std::vector<std::int64_t> checked(static_cast<std::size_t>(n), 0);
      reg.add(
          "test.check", DeviceType::cpu, f32,
          [&](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
            const std::int64_t member = cfg.attrs.get_int("member", -1);
            struct Check final : Kernel {
              std::function<void(KernelContext&)> fn;
              void compute(KernelContext& ctx) override { fn(ctx); }
            };
            auto k = std::make_unique<Check>();
            k->fn = [&, member](KernelContext& ctx) {
              auto in = ctx.inputs[0]->data<float>();
              std::lock_guard lock(m);
              ++checked[static_cast<std::size_t>(member)];
              for (std::size_t i = 0; i < in.size(); ++i) {
                float want = 0;
                for (std::int64_t j = 0; j < n; ++j)
                  want += value(j, ctx.piece, static_cast<std::int64_t>(i));
                if (in[i] != want && wrong.size() < 5) {
                  wrong.push_back(fmt::format("member {} piece {} element {}: {}, the sum is {}",
                                              member, ctx.piece, i, in[i], want));
                }
              }
            };
            return k;
          });
      RuntimeSettings s;
      s.mode = mode;
      s.stall_timeout = 30'000ms;
      Runtime rt(plan, reg, s);
      rt.run();
      CHECK_MESSAGE(wrong.empty(), fmt::format("{}", fmt::join(wrong, "; ")));
      for (std::int64_t c : checked) CHECK(c == pieces);
    }
  }
}

namespace {

struct SimSetup {
  int dp = 1, pp = 1, tp = 1;
  std::string schedule = "1f1b";
  std::int64_t microbatches = 2;  // per replica
  int threads = 1;
  OptimizerConfig opt = optim::adam(0.01);
  int virtual_stages = 1;
  bool multi_tensor = true;  // TrainConfig::multi_tensor_updates
  std::string collectives = "actors";
  bool graphs = true;  // TrainConfig::cuda_graphs
};

struct Trained {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
  int groups = 0;              // actors stepping a device's weights together (the updates pass)
  int grouped_weights = 0;     // the weights they write
  int single_variables = 0;    // trained weights stepped by an actor of their own
  int snapshots = 0;           // variable states handed over at checkpoint steps
  int segments = 0;            // actors running a run of ops as one act (the segments pass)
  int segment_members = 0;     // the ops they run
  std::int64_t graph_launches = 0, graph_refusals = 0;  // passes::segment_graphs() during the run
  std::int64_t registers = 0;  // the plan's register bytes on its busiest device
};

/// `got` trained as `want`: `steps` losses and every weight, bit for bit.
void check_trains_as(const Trained& got, const Trained& want, std::size_t steps) {
  REQUIRE(want.losses.size() == steps);
  CHECK(got.losses == want.losses);
  for (const auto& [name, w] : want.weights) {
    CAPTURE(name);
    CHECK(w == got.weights.at(name));
  }
}

/// The MLP 12-16-16-4 (tp splits its hidden pair Megatron's way) on synthetic data, 8 steps of a
/// global batch of 32, on `type` devices: place i is device i of that type.
Trained train_mlp(const SimSetup& s, DeviceType type) {
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(256, 12, 4, 99));
  const std::int64_t pieces = s.dp * s.microbatches;
  Graph g(5);
  Value logits = models::mlp(g, 32 / pieces,
                             {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = s.tp});
  Value loss = softmax_cross_entropy(logits, g.find("label")).named("loss");
  TrainConfig cfg;
  cfg.steps = 8;
  cfg.microbatches = s.microbatches;
  cfg.dp = s.dp;
  cfg.pp = s.pp;
  cfg.tp = s.tp;
  cfg.schedule = s.schedule;
  cfg.threads = s.threads;
  cfg.optimizer = s.opt;
  cfg.collectives = type == DeviceType::sim ? s.collectives : "actors";  // NCCL's stand-in runs on sim devices
  cfg.virtual_stages = s.virtual_stages;
  cfg.multi_tensor_updates = s.multi_tensor;
  cfg.cuda_graphs = s.graphs;
  for (int i = 0; i < s.dp * s.pp * s.tp; ++i) {
    cfg.replica_places.push_back(Placement{.device = Device{type, static_cast<std::uint8_t>(i)}});
  }
  cfg.data = {{"synthetic", data::batch_source(dataset, 32, pieces, 7), {"x", "label"}}};
  Trained out;
  std::mutex m;
  cfg.snapshot_every = 3;
  cfg.on_snapshot = [&](VariableSnapshot) {
    std::lock_guard lock(m);
    ++out.snapshots;
  };
  TrainingJob job = compile_training(g, loss, cfg);
  for (const ActorDesc& a : job.plan.actors) {
    if (a.name.starts_with("variables.")) {
      ++out.groups;
      out.grouped_weights += static_cast<int>(a.outputs.size());
    } else if (a.op.starts_with("variable.") && !a.inputs.empty()) {
      ++out.single_variables;
    } else if (a.name.starts_with("segment.")) {
      ++out.segments;
      out.segment_members += static_cast<int>(a.attrs.get_int("members", 0));
    }
  }
  RuntimeSettings rs;
  rs.stall_timeout = 30'000ms;
  const passes::SegmentGraphs before = passes::segment_graphs();
  Runtime(job.plan, job.kernels, rs).run();
  out.graph_launches = passes::segment_graphs().launched - before.launched;
  out.graph_refusals = passes::segment_graphs().refused - before.refused;
  out.losses = job.losses->per_step();
  for (auto& [name, t] : job.params->values()) {
    auto d = t.data<float>();
    out.weights[name] = std::vector<float>(d.begin(), d.end());
  }
  return out;
}

}  // namespace

// Training on sim devices runs the CPU's kernels in the CPU's order, only through streams,
// events and copies: the losses and weights must be the CPU run's, bit for bit, in every
// parallel mode. A handshake that let a kernel read a slot before it was written, or write one
// still being read, shows as a difference (the MLP's values change every step).
TEST_CASE("Sim.Training.EveryParallelModeTrainsAsOnTheCpu" * doctest::timeout(300)) {
  std::vector<SimSetup> setups = {
      {},
      {.threads = 2},
      {.dp = 2},
      {.pp = 2, .schedule = "1f1b", .microbatches = 4},
      {.pp = 2, .schedule = "gpipe", .microbatches = 4, .threads = 2},
      {.tp = 2},
      {.dp = 2, .pp = 2, .microbatches = 2},
  };
  for (const SimSetup& s : setups) {
    CAPTURE(s.dp);
    CAPTURE(s.pp);
    CAPTURE(s.tp);
    CAPTURE(s.schedule);
    CAPTURE(s.threads);
    const Trained cpu = train_mlp(s, DeviceType::cpu);
    const Trained sim = train_mlp(s, DeviceType::sim);
    REQUIRE(cpu.losses.size() == 8);
    CHECK(cpu.losses == sim.losses);
    for (const auto& [name, w] : cpu.weights) {
      CAPTURE(name);
      CHECK(w == sim.weights.at(name));
    }
  }
}

// The updates pass: on sim devices each device's trained weights are stepped by one actor (on
// CUDA one multi-tensor launch; on sim the CPU's variable kernels in turn), which changes when a
// weight steps (once the device's last gradient of the step is in) but not what it computes.
// So the losses, the trained weights and the checkpoint hand-overs must be those of one actor
// per weight and of the CPU, bit for bit, in every mode whose devices hold several weights: a
// group that read a member's gradient or clipping factor from the wrong input, wrote the wrong
// register or deadlocked a schedule shows here. The CPU keeps an actor per weight (its weights
// are updated in place where the readers read them).
TEST_CASE("Sim.Training.ADevicesWeightsStepTogetherAsEachOnItsOwn" * doctest::timeout(300)) {
  OptimizerConfig clipped = optim::adam(0.01);
  clipped.clip_norm = 0.05;  // small: most steps clip
  OptimizerConfig momentum = optim::sgd(0.05);
  momentum.momentum = 0.9;
  momentum.clip_norm = 0.5;
  std::vector<SimSetup> setups = {
      {},
      {.opt = clipped},
      {.opt = momentum},
      {.dp = 2, .opt = clipped},
      {.tp = 2, .collectives = "nccl"},
      {.pp = 2, .schedule = "interleaved", .microbatches = 4, .virtual_stages = 2},
      {.pp = 2, .schedule = "zb-h1", .microbatches = 4, .opt = clipped},
      {.tp = 2, .opt = clipped},
  };
  for (SimSetup s : setups) {
    CAPTURE(s.dp);
    CAPTURE(s.pp);
    CAPTURE(s.tp);
    CAPTURE(s.schedule);
    CAPTURE(s.collectives);
    CAPTURE(s.opt.clip_norm);
    const Trained cpu = train_mlp(s, DeviceType::cpu);
    const Trained grouped = train_mlp(s, DeviceType::sim);
    s.multi_tensor = false;
    const Trained apart = train_mlp(s, DeviceType::sim);
    // The plans: one group per device (each holds two or more weights), every trained weight in one.
    const int devices = s.dp * s.pp * s.tp;
    CHECK(cpu.groups == 0);
    CHECK(grouped.groups == devices);
    CHECK(grouped.single_variables == 0);
    CHECK(grouped.grouped_weights == apart.single_variables);
    CHECK(apart.groups == 0);
    CHECK(apart.single_variables == cpu.single_variables);
    // The numbers.
    REQUIRE(cpu.losses.size() == 8);
    CHECK(grouped.losses == cpu.losses);
    CHECK(apart.losses == cpu.losses);
    for (const auto& [name, w] : cpu.weights) {
      CAPTURE(name);
      CHECK(w == grouped.weights.at(name));
    }
    // Replica 0's weights hand over their state at steps 3, 6 and 8.
    CHECK(grouped.snapshots == apart.snapshots);
    CHECK(grouped.snapshots > 0);
  }
}

// The segments pass (passes.h) runs each device's runs of forward and backward ops as one actor,
// whose act is captured at the second sight of its slots and launched as one graph from then on
// (on sim devices the recorded closures, replayed with their captured tensors). The same kernels
// on the same memory: the losses and weights must be one actor per op's and the CPU's, bit for
// bit, in every mode. A member that read the wrong tensor, a graph replayed on another piece's
// slots, a segment that waited for itself or a schedule it broke shows here.
TEST_CASE("Sim.Training.SegmentsAsGraphsTrainAsOneActorPerOp" * doctest::timeout(300)) {
  OptimizerConfig clipped = optim::adam(0.01);
  clipped.clip_norm = 0.05;
  std::vector<SimSetup> setups = {
      {},
      {.microbatches = 4, .opt = clipped},
      {.dp = 2},
      {.tp = 2, .collectives = "nccl"},
      {.tp = 2},
      {.pp = 2, .schedule = "1f1b", .microbatches = 4},
      {.pp = 2, .schedule = "interleaved", .microbatches = 4, .virtual_stages = 2},
      {.pp = 2, .schedule = "zb-h1", .microbatches = 4, .opt = clipped},
      {.dp = 2, .pp = 2, .microbatches = 2, .threads = 2},
  };
  for (SimSetup s : setups) {
    CAPTURE(s.dp);
    CAPTURE(s.pp);
    CAPTURE(s.tp);
    CAPTURE(s.schedule);
    CAPTURE(s.collectives);
    const Trained cpu = train_mlp(s, DeviceType::cpu);
    const Trained graphs = train_mlp(s, DeviceType::sim);
    s.graphs = false;
    const Trained apart = train_mlp(s, DeviceType::sim);
    CHECK(cpu.segments == 0);
    CHECK(apart.segments == 0);
    CHECK(graphs.segments > 0);
    CHECK(graphs.segment_members >= 2 * graphs.segments);
    // 8 steps: every segment's slots come round again, so its acts launch graphs.
    CHECK(graphs.graph_launches > 0);
    CHECK(graphs.graph_refusals == 0);
    CHECK(apart.graph_launches == 0);
    check_trains_as(graphs, cpu, 8);
    check_trains_as(apart, cpu, 8);
  }
}

// The segments pass on a small GPT (fused attention and its saved statistics, layer norms, the
// tanh GELU's epilogue actors, reshapes read through views, the embedding and its gradient,
// cross-entropy), with the memory plan's slots shared and written in place: on sim devices,
// with and without segments, bit for bit the CPU's losses and weights, on one device and as a
// 2-stage 1F1B pipeline; and the plan's register memory that of one actor per op.
TEST_CASE("Sim.Training.AGptAsSegmentsTrainsAsOnTheCpu" * doctest::timeout(300)) {
  auto corpus = std::make_shared<data::TextCorpus>();
  corpus->vocab.assign(24, static_cast<unsigned char>('x'));
  std::mt19937 gen(5);
  for (int i = 0; i < 2048; ++i) corpus->ids.push_back(static_cast<std::int32_t>(gen() % 24));
  auto train = [&](DeviceType type, int pp, bool graphs) {
    Graph g(3);
    models::Outputs out = models::gpt_with_loss(g, 2,  // rows per micro-batch
                                                {.vocab = 24, .seq = 16, .d_model = 16, .heads = 2, .layers = 2,
                                                 .attention = models::GptShape::Attention::fused,
                                                 .gelu = GeluApprox::tanh});
    TrainConfig cfg;
    cfg.steps = 4;
    cfg.microbatches = 2;
    cfg.pp = pp;
    cfg.optimizer = optim::adam(3e-3);
    cfg.cuda_graphs = graphs;
    cfg.data = {{"text", data::text_source(corpus, 4, 2, 16, 3), {"tokens", "targets"}}};
    for (int i = 0; i < pp; ++i) cfg.replica_places.push_back(Placement{.device = Device{type, static_cast<std::uint8_t>(i)}});
    TrainingJob job = compile_training(g, out.loss, cfg);
    Trained r;
    for (const ActorDesc& a : job.plan.actors) r.segments += a.name.starts_with("segment.");
    for (const DeviceMemory& m : memory_report(job.plan)) {
      if (m.device.type == type) r.registers = std::max(r.registers, m.registers);
    }
    RuntimeSettings rs;
    rs.stall_timeout = 30'000ms;
    Runtime(job.plan, job.kernels, rs).run();
    r.losses = job.losses->per_step();
    for (auto& [name, t] : job.params->values()) {
      auto d = t.data<float>();
      r.weights[name] = std::vector<float>(d.begin(), d.end());
    }
    return r;
  };
  for (int pp : {1, 2}) {
    CAPTURE(pp);
    const Trained cpu = train(DeviceType::cpu, pp, true);
    const Trained graphs = train(DeviceType::sim, pp, true);
    const Trained apart = train(DeviceType::sim, pp, false);
    CHECK(cpu.segments == 0);
    CHECK(graphs.segments >= 2 * pp);  // a forward and a backward run per stage at least
    CHECK(apart.segments == 0);
    // The memory pass times each register at its member's kernel (ActorDesc::steps), so the
    // segments' temporaries share bytes as the actors' did: the same register bytes, but for a
    // member's in-place write over an earlier member's output, which a segment gives up (a slot
    // more; none here).
    CHECK(graphs.registers > 0);
    CHECK(graphs.registers <= apart.registers + apart.registers / 10);
    check_trains_as(graphs, cpu, 4);
    check_trains_as(apart, cpu, 4);
  }
}

// RuntimeSettings::device_time: an actor on a stream books the time its kernels ran there
// (timing events around each act), not the time it took to enqueue them. Each kernel sleeps
// 2 ms on the stream, and a sleep is never shorter than asked: at least 20 ms for 10 acts.
TEST_CASE("Sim.Runtime.DeviceTimeIsTheTimeOnTheStream" * doctest::timeout(60)) {
  Plan p;
  auto a = p.add_register({.name = "a", .shape = {4}, .dtype = f32, .slots = 2});
  auto b = p.add_register({.name = "b", .shape = {4}, .dtype = f32, .slots = 2});
  p.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .where = {.device = sim0}, .outputs = {a},
               .pieces = 10});
  p.add_actor({.name = "slow", .op = "sleep_ns", .where = {.device = sim0}, .inputs = {{a}}, .outputs = {b},
               .attrs = {{"ns", std::int64_t{2'000'000}}}});
  p.add_actor({.name = "sink", .op = "noop", .where = {.device = sim0}, .inputs = {{b}}});
  for (bool timed : {true, false}) {
    CAPTURE(timed);
    RuntimeSettings s;
    s.device_time = timed;
    s.stall_timeout = 30'000ms;
    Runtime rt(p, KernelRegistry::with_builtin_kernels(), s);
    const RunReport report = rt.run();
    double slow = -1;
    for (const auto& m : report.metrics.actors) {
      if (m.name == "slow") slow = m.device_s;
    }
    if (timed) {
      CHECK(slow >= 10 * 2e-3);
    } else {
      CHECK(slow == 0);
    }
  }
}
