// The static memory plan (plan_memory.h, the memory pass in passes.h): slot lives from the
// lanes' order, arenas whose shared bytes are never live twice at once (validate() refuses
// anything else), the plan's memory report and budget, and training with slots packed into
// arenas that are poisoned between lives, equal bit for bit to training with memory of its own.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "loopback_run.h"
#include "models.h"
#include "poison.h"
#include "test_util.h"

using namespace baton;

namespace {

/// src -> a -> b -> c -> d -> sink: a copy chain whose four copies act in one lane (in that
/// order, one act each per period), each output with `slots` slots. The sink records what
/// arrives. Registers: 0 src.out, 1 a.out, 2 b.out, 3 c.out, 4 d.out.
struct Chain {
  Plan plan;
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  std::shared_ptr<std::vector<float>> seen = std::make_shared<std::vector<float>>();
  explicit Chain(std::int32_t slots = 1, std::int64_t pieces = 20) {
    const Shape shape{64};  // 256 bytes: one arena_alignment
    std::vector<RegisterIndex> r;
    for (const char* n : {"src.out", "a.out", "b.out", "c.out", "d.out"}) {
      r.push_back(plan.add_register({.name = n, .shape = shape, .slots = slots}));
    }
    plan.add_actor({.name = "src",
                    .kind = ActorKind::source,
                    .op = "fill_piece",
                    .outputs = {r[0]},
                    .pieces = pieces});
    const char* names[] = {"a", "b", "c", "d"};
    for (int i = 0; i < 4; ++i) {
      plan.add_actor({.name = names[i],
                      .op = "copy",
                      .inputs = {{r[static_cast<std::size_t>(i)]}},
                      .outputs = {r[static_cast<std::size_t>(i + 1)]},
                      .order = ActOrder{.lane = 0, .units = {0}, .period = 1, .rank = i}});
    }
    kernels.add_fn("record", DeviceType::cpu, DType::f32, [seen = seen](KernelContext& ctx) {
      for (float v : ctx.inputs[0]->data<float>()) seen->push_back(v);
    });
    plan.add_actor({.name = "sink", .op = "record", .inputs = {{r[4]}}});
  }
  /// Puts every register of `regs` (each slot at the offset given) into one arena on cpu:0.
  void place(const std::vector<std::pair<RegisterIndex, std::vector<std::int64_t>>>& regs,
             std::int64_t bytes) {
    plan.arenas = {{.rank = 0, .device = Device{}, .bytes = bytes}};
    for (const auto& [reg, offsets] : regs) {
      plan.registers[reg].arena = 0;
      plan.registers[reg].offsets = offsets;
    }
  }
};

std::string problems_of(const Plan& plan, const KernelRegistry& kernels) {
  try {
    validate(plan, kernels);
  } catch (const PlanError& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("MemoryPlan.ALifeInALaneRunsFromItsWriteToItsLastRead") {
  Chain c;
  const auto lives = slot_lives(c.plan);
  // The source acts when it likes: its register is live the whole job.
  CHECK(lives[0][0].always());
  // a, b, c, d are positions 0..3 of a period of 4 acts; a.out is written at 0 and read at 1.
  REQUIRE_FALSE(lives[1][0].always());
  CHECK(lives[1][0].lane_acts == 4);
  CHECK(lives[1][0].spans == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 1}});
  CHECK(lives[3][0].spans == std::vector<std::pair<std::int64_t, std::int64_t>>{{2, 3}});
  // b reads a.out in the act that writes b.out: they meet; a.out and c.out never do.
  CHECK(may_overlap(lives[1][0], lives[2][0]));
  CHECK_FALSE(may_overlap(lives[1][0], lives[3][0]));
  CHECK(may_overlap(lives[0][0], lives[3][0]));
  // The sink is in no lane: what it reads is live whenever it likes.
  CHECK(lives[4][0].always());
  // Two slots: piece p is in slot p % 2, so slot 0 holds the even periods' pieces and slot 1
  // the odd ones': the pattern repeats after two periods, and the two never meet.
  Chain two(2);
  const auto l2 = slot_lives(two.plan);
  CHECK(l2[1][0].period == 2);
  CHECK(l2[1][0].spans == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 1}});
  CHECK(l2[1][1].spans == std::vector<std::pair<std::int64_t, std::int64_t>>{{4, 5}});
  CHECK_FALSE(may_overlap(l2[1][0], l2[1][1]));
  CHECK(may_overlap(l2[1][0], l2[2][0]));
  CHECK(may_overlap(l2[1][0], l2[2][1]) == false);  // b.out slot 1 lives in the odd periods
}

TEST_CASE("MemoryPlan.ALifeIsTheWholeJobWhereNoLaneProvesOtherwise") {
  // A reader outside the lane, a reader with a delay, or a lane of another worker: always.
  for (int variant = 0; variant < 3; ++variant) {
    CAPTURE(variant);
    Chain c;
    ActorDesc& b = c.plan.actors[2];
    if (variant == 0) b.order = ActOrder{};
    if (variant == 1) b.inputs[0].delay = 1;
    if (variant == 2) b.order.lane = 1;
    const auto lives = slot_lives(c.plan);
    CHECK(lives[1][0].always());        // a.out, read by b
    CHECK_FALSE(lives[3][0].always());  // c.out: written by c and read by d, both in lane 0
  }
}

TEST_CASE("MemoryPlan.ValidateRefusesSharedBytesThatMayBeLiveAtOnce" * doctest::timeout(30)) {
  {
    // a.out and c.out share their bytes: never live at once, so the chain still delivers every
    // piece intact.
    Chain c(1, 50);
    c.place({{1, {0}}, {2, {256}}, {3, {0}}}, 512);
    CHECK(problems_of(c.plan, c.kernels).empty());
    RuntimeSettings s;
    s.mode = ExecutionMode::deterministic;
    Runtime(c.plan, c.kernels, s).run();
    REQUIRE(c.seen->size() == 50 * 64);
    for (std::size_t i = 0; i < c.seen->size(); ++i)
      CHECK((*c.seen)[i] == static_cast<float>(i / 64));
  }
  {
    // b reads a.out while it writes b.out: refused, both named.
    Chain c;
    c.place({{1, {0}}, {2, {0}}}, 256);
    const std::string why = problems_of(c.plan, c.kernels);
    CHECK(test::contains(
        why, "registers 'a.out' (slot 0) and 'b.out' (slot 0) share bytes [0, 256) of arena 0"));
  }
  {
    // Out of the arena, misaligned, a missing arena, offsets for the wrong number of slots.
    Chain c(2);
    c.place({{1, {0, 256}}, {2, {512, 700}}, {3, {1024}}}, 768);
    c.plan.registers[4].arena = 3;
    c.plan.registers[4].offsets = {0, 0};
    const std::string why = problems_of(c.plan, c.kernels);
    CHECK(test::contains(why, "'b.out' slot 1 at offset 700"));
    CHECK(test::contains(why, "'c.out' has 2 slots but 1 offsets"));
    CHECK(test::contains(why, "placed in arena 3, which does not exist"));
  }
  {
    // An arena on another device than the producer's.
    Chain c;
    c.place({{1, {0}}}, 256);
    c.plan.arenas[0].device = Device{DeviceType::cpu, 1};
    CHECK(test::contains(problems_of(c.plan, c.kernels),
                         "'a.out' lives on r0/cpu:0 but is placed in arena 0 on r0/cpu:1"));
  }
}

namespace {

/// The chain with b's and c's copies made an elementwise "plus_one" that may write its output in
/// place of its input (b.out over a.out, c.out over b.out).
Chain in_place_chain(std::int64_t pieces = 40) {
  Chain c(1, pieces);
  c.kernels.add_fn("plus_one", DeviceType::cpu, DType::f32, [](KernelContext& ctx) {
    auto in = ctx.inputs[0]->data<float>();
    auto out = ctx.outputs[0]->data<float>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = in[i] + 1.0F;
  });
  for (std::size_t i : {2, 3}) {
    c.plan.actors[i].op = "plus_one";
    c.plan.actors[i].in_place = {{.output = 0, .input = 0}};
  }
  return c;
}

/// Whether register `out`'s slot 0 has the very bytes of `in`'s slot 0.
bool same_bytes(const Plan& p, RegisterIndex in, RegisterIndex out) {
  const RegisterDesc &a = p.registers[in], &b = p.registers[out];
  return a.arena >= 0 && a.arena == b.arena && a.offsets.at(0) == b.offsets.at(0);
}

}  // namespace

// An elementwise op that reads its input's piece last may write its output into the same bytes
// (ActorDesc::in_place): the memory pass places it there, validate() accepts exactly that (the
// same offset and size, the two lives touching only at the act), and the report counts the bytes
// once.
TEST_CASE("MemoryPlan.AnElementwiseOpWritesInPlaceOfTheInputItReadsLast" * doctest::timeout(60)) {
  TrainConfig on, off;
  off.in_place = false;
  for (const ExecutionMode mode : {ExecutionMode::deterministic, ExecutionMode::threaded}) {
    CAPTURE(static_cast<int>(mode));
    Chain c = in_place_chain();
    const Plan placed = passes::memory(c.plan, on);
    // a.out -> b -> b.out -> c -> c.out: one set of bytes, written over twice an act.
    CHECK(same_bytes(placed, 1, 2));
    CHECK(same_bytes(placed, 2, 3));
    CHECK(problems_of(placed, c.kernels).empty());
    RuntimeSettings s;
    s.mode = mode;
    s.measure_memory = true;
    const RunReport report = Runtime(placed, c.kernels, s).run();
    REQUIRE(c.seen->size() == 40 * 64);
    for (std::size_t i = 0; i < c.seen->size(); ++i) REQUIRE((*c.seen)[i] == static_cast<float>(i / 64 + 2));
    // The run had the shared bytes in use once at a time, as the plan counts them.
    const auto planned = memory_report(placed);
    REQUIRE(planned.size() == 1);
    REQUIRE(report.memory.size() == 1);
    CHECK(report.memory[0].peak_bytes <= planned[0].registers_at_peak());
    // Without the permission (or with in_place off) every output has bytes of its own.
    const Plan own = passes::memory(c.plan, off);
    CHECK_FALSE(same_bytes(own, 1, 2));
    CHECK(own.actors[2].in_place.empty());
    // src.out and d.out (read outside the lane) 512 bytes, and in the lane a.out, b.out and
    // c.out: 256 bytes at any moment in place, else an act's input and output.
    CHECK(planned[0].registers_at_peak() == 768);
    CHECK(memory_report(own)[0].registers_at_peak() == 1024);
    CHECK(placed.arenas.at(0).bytes == 768);
    CHECK(own.arenas.at(0).bytes == 1024);
  }
  {
    // The same bytes without the permission: refused, both named.
    Chain c = in_place_chain();
    Plan p = passes::memory(c.plan, on);
    REQUIRE(same_bytes(p, 1, 2));
    p.actors[2].in_place.clear();
    CHECK(test::contains(problems_of(p, c.kernels), "registers 'a.out' (slot 0) and 'b.out' (slot 0) share bytes"));
  }
  {
    // Bytes that overlap but are not the same (an offset of half a slot): refused even with it.
    Chain c = in_place_chain();
    for (RegisterIndex r = 0; r < c.plan.registers.size(); ++r) c.plan.registers[r].shape = {128};
    c.place({{1, {0}}, {2, {256}}}, 1024);
    CHECK(test::contains(problems_of(c.plan, c.kernels), "registers 'a.out' (slot 0) and 'b.out' (slot 0) share bytes [256, 512)"));
  }
  {
    // a.out read again after b (by d, later in the lane): b is not its last reader, so the pass
    // gives b.out bytes of its own, and the same bytes are refused.
    Chain c = in_place_chain();
    c.plan.actors[4].inputs.push_back({1});
    c.plan.registers[1].consumers.push_back(4);
    c.kernels.add_fn("copy_first", DeviceType::cpu, DType::f32, [](KernelContext& ctx) {
      std::memcpy(ctx.outputs[0]->raw(), ctx.inputs[0]->raw(), ctx.outputs[0]->nbytes());
    });
    c.plan.actors[4].op = "copy_first";
    CHECK_FALSE(same_bytes(passes::memory(c.plan, on), 1, 2));
    c.place({{1, {0}}, {2, {0}}}, 256);
    CHECK(test::contains(problems_of(c.plan, c.kernels), "registers 'a.out' (slot 0) and 'b.out' (slot 0) share bytes"));
  }
  {
    // A permission validate() refuses: out of range, another shape.
    Chain c = in_place_chain();
    c.plan.actors[1].in_place = {{.output = 1, .input = 0}};
    c.plan.actors[3].in_place = {{.output = 0, .input = 0}};
    c.plan.registers[3].shape = {32};
    const std::string why = problems_of(c.plan, c.kernels);
    CHECK(test::contains(why, "actor 'a' computes output 1 in place of input 0, but has 1 outputs and 1 inputs"));
    CHECK(test::contains(why, "actor 'c' computes 'c.out' (f32[32]) in place of 'b.out' (f32[64])"));
  }
}

// A view (plan.h: a repeat of group 1, what a reshape lowers to) copies nothing: its readers read
// the input's slot, so the input lives until they are done, and the view has no bytes to place.
TEST_CASE("MemoryPlan.AViewsReadersKeepItsInputAliveAndTheViewAllocatesNothing" * doctest::timeout(30)) {
  auto with_view = [] {
    auto c = std::make_unique<Chain>(1, 30);
    // d adds a view of a.out, seen as 8 x 8, to c.out: a.out is now read at position 3.
    const RegisterIndex v = c->plan.add_register({.name = "a.view", .shape = {8, 8}});
    c->plan.add_actor({.name = "a.reshape", .kind = ActorKind::repeat, .op = "view", .inputs = {{1}},
                       .outputs = {v}, .group = 1});
    c->kernels.add_fn("add_flat", DeviceType::cpu, DType::f32, [](KernelContext& ctx) {
      auto x = ctx.inputs[0]->data<float>(), y = ctx.inputs[1]->data<float>();
      auto out = ctx.outputs[0]->data<float>();
      REQUIRE(ctx.inputs[1]->shape() == Shape{8, 8});  // the view's own shape
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = x[i] + y[i];
    });
    ActorDesc& d = c->plan.actors[4];
    REQUIRE(d.name == "d");
    d.op = "add_flat";
    d.inputs.push_back({v});
    c->plan.registers[v].consumers.push_back(4);  // what add_actor would have recorded
    return c;
  };
  {
    auto c = with_view();
    const auto lives = slot_lives(c->plan);
    CHECK(lives[1][0].spans == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 3}});
    CHECK(may_overlap(lives[1][0], lives[3][0]));  // a.out now meets c.out (read together by d)
    CHECK_FALSE(register_memory(c->plan, 5).allocated);
    CHECK(aliased_register(c->plan, 5) == 1);
    // So a.out and c.out may no longer share bytes.
    c->place({{1, {0}}, {3, {0}}}, 256);
    CHECK(test::contains(problems_of(c->plan, c->kernels),
                         "registers 'a.out' (slot 0) and 'c.out' (slot 0) share bytes"));
  }
  for (auto mode : {ExecutionMode::threaded, ExecutionMode::deterministic}) {
    CAPTURE(static_cast<int>(mode));
    auto c = with_view();
    c->place({{1, {0}}, {2, {256}}, {3, {512}}}, 768);  // b.out between them, as apart as they must be
    REQUIRE(problems_of(c->plan, c->kernels).empty());
    RuntimeSettings s;
    s.mode = mode;
    s.stall_timeout = std::chrono::milliseconds(20'000);
    Runtime(c->plan, c->kernels, s).run();
    REQUIRE(c->seen->size() == 30 * 64);
    for (std::size_t i = 0; i < c->seen->size(); ++i) CHECK((*c->seen)[i] == 2.0f * static_cast<float>(i / 64));
  }
}

namespace {

/// A 2-layer GPT (d 16, T 8) over a 16-character corpus, 4 rows a micro-batch, compiled with
/// `cfg` (its dp and micro-batches; the data source is set here).
TrainingJob tiny_gpt(TrainConfig cfg) {
  Graph g(3);
  auto corpus = std::make_shared<data::TextCorpus>();
  for (int c = 0; c < 16; ++c) corpus->vocab.push_back(static_cast<unsigned char>('a' + c));
  for (int i = 0; i < 300; ++i) corpus->ids.push_back((i * 5 + i / 7) % 16);
  Value loss = models::gpt_with_loss(g, 4, {.vocab = 16, .seq = 8, .d_model = 16, .heads = 2, .layers = 2}).loss;
  const std::int64_t pieces = cfg.dp * cfg.microbatches;
  cfg.data = {{"text", data::text_source(corpus, 4 * pieces, pieces, 8, 5), {"tokens", "targets"}}};
  return compile_training(g, loss, cfg);
}

}  // namespace

// The compiler gives the built-in elementwise ops on the CPU the permission, and the memory pass
// uses it in a GPT's backward pass (what the poisoned arenas below then train bit for bit).
TEST_CASE("MemoryPlan.TheGptsElementwiseOpsComputeInPlace") {
  TrainConfig cfg;
  cfg.microbatches = 2;
  const TrainingJob job = tiny_gpt(cfg);
  std::size_t allowed = 0, used = 0;
  for (const ActorDesc& a : job.plan.actors) {
    for (const InPlace& p : a.in_place) {
      ++allowed;
      CHECK((a.op == "add" || a.op == "mul" || a.op == "scale" || a.op.ends_with("gelu_grad") || a.op == "bias_gelu" ||
             a.op == "sub" || a.op == "div" || a.op.ends_with("_grad") || a.op == "gelu" || a.op == "relu"));
      used += same_bytes(job.plan, a.inputs[p.input].reg, a.outputs[p.output]) ? 1 : 0;
    }
  }
  MESSAGE(allowed << " permissions, " << used << " used");
  CHECK(allowed > 0);
  CHECK(used > 0);
  CHECK_NOTHROW(validate(job.plan, job.kernels));
  cfg.in_place = false;
  const TrainingJob own = tiny_gpt(cfg);
  for (const ActorDesc& a : own.plan.actors) CHECK(a.in_place.empty());
}

// A trained weight on a CPU device is held once: its optimizer's master is the register its
// readers read (RegisterDesc::kernel_memory), so the plan counts the weights' bytes once, and
// the runtime allocates nothing for them.
TEST_CASE("MemoryPlan.ATrainedWeightIsHeldOnceByItsOptimizer") {
  for (int dp : {1, 2}) {
    CAPTURE(dp);
    TrainConfig cfg;
    cfg.dp = dp;
    cfg.optimizer = optim::adam(0.01);
    const TrainingJob job = tiny_gpt(cfg);
    std::int64_t params = 0;
    for (const auto& [name, t] : job.params->values()) params += static_cast<std::int64_t>(t.nbytes());
    std::size_t steps = 0;
    for (RegisterIndex r = 0; r < job.plan.registers.size(); ++r) {
      const RegisterDesc& reg = job.plan.registers[r];
      if (reg.name.find(".step") == std::string::npos) continue;  // "wte.step", "dp1.wte.step", ...
      ++steps;
      CHECK(reg.kernel_memory);
      CHECK_FALSE(register_memory(job.plan, r).allocated);
      CHECK(reg.arena < 0);
    }
    CHECK(steps == static_cast<std::size_t>(dp) * job.params->values().size());
    std::int64_t weights = 0, adam = 0;
    for (const DeviceMemory& m : memory_report(job.plan)) {
      weights += m.bytes[static_cast<std::size_t>(MemoryCategory::weights)];
      adam += m.bytes[static_cast<std::size_t>(MemoryCategory::optimizer_state)];
    }
    CHECK(weights == dp * params);  // was 2 dp params: the master and the step's copy
    CHECK(adam == 2 * dp * params);
    CHECK_NOTHROW(validate(job.plan, job.kernels));
  }
}

// The compiler lowers a reshape whose input is on its own device to a view, and a reshape
// across devices (a pipeline cut) to a copy that the transfer passes then move.
TEST_CASE("MemoryPlan.AReshapeOnItsInputsDeviceLowersToAView") {
  for (int pp : {1, 2}) {
    CAPTURE(pp);
    TrainConfig cfg;
    cfg.pp = pp;
    cfg.microbatches = 2;
    const TrainingJob job = tiny_gpt(cfg);
    std::size_t views = 0, reshape_copies = 0;
    for (const ActorDesc& a : job.plan.actors) {
      if (a.op == "reshape") ++reshape_copies;
      if (a.op != "view") continue;
      ++views;
      CHECK(is_view(a));
      const ActorDesc& writer = job.plan.actors[job.plan.registers[a.inputs[0].reg].producer];
      CHECK(writer.where == a.where);
      CHECK_FALSE(register_memory(job.plan, a.outputs[0]).allocated);
    }
    CHECK(views > 0);
    if (pp == 1) CHECK(reshape_copies == 0);
    CHECK_NOTHROW(validate(job.plan, job.kernels));
  }
}

TEST_CASE("MemoryPlan.WithOneMicroBatchAWeightsGradientIsAViewOfDwInOneSlot") {
  for (std::int64_t m : {1, 2}) {
    for (int dp : {1, 2}) {
      CAPTURE(m);
      CAPTURE(dp);
      TrainConfig cfg;
      cfg.dp = dp;
      cfg.microbatches = m;
      const TrainingJob job = tiny_gpt(cfg);
      std::size_t views = 0, sums = 0;
      for (const ActorDesc& a : job.plan.actors) {
        if (!a.name.starts_with("grad.")) continue;
        if (a.kind == ActorKind::accumulate) {
          ++sums;
          CHECK(register_memory(job.plan, a.outputs[0]).allocated);
        }
        if (a.kind != ActorKind::repeat) continue;
        ++views;
        // dW, as the backward pass writes it, is the only copy of the weight's gradient on its
        // device before the all-reduce: the summed gradient has no bytes, dW one slot.
        CHECK(is_view(a));
        CHECK_FALSE(register_memory(job.plan, a.outputs[0]).allocated);
        CHECK(job.plan.registers[a.inputs[0].reg].slots == 1);
      }
      // Every trained weight of every replica: a view with one micro-batch, a sum with two.
      std::size_t trained = 0;
      for (const ActorDesc& a : job.plan.actors) trained += a.op.starts_with("variable.");
      CHECK(trained == static_cast<std::size_t>(dp) * job.params->values().size());
      CHECK(views == (m == 1 ? trained : 0u));
      CHECK(sums == (m == 1 ? 0u : trained));
      CHECK_NOTHROW(validate(job.plan, job.kernels));
    }
  }
}

namespace {

struct Mode {
  std::string name;
  int dp = 1, pp = 1, tp = 1;
  std::string schedule = "1f1b";
  std::int64_t m = 1;  // micro-batches per replica
  int threads = 1;
  bool gpt = false;
  OptimizerConfig opt = optim::sgd(0.1, 0.9);
  bool ranks = false;  // each place a rank of its own, joined by a loopback data plane
  int zero = 0;
};

struct Trained {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
  std::int64_t slot_bytes = 0;   // of the slots the plan placed in arenas (aligned)
  std::int64_t arena_bytes = 0;  // of its arenas
  /// By device ("r0/cpu:1"): the register bytes in use at the run's peak, as measured
  /// (RuntimeSettings::measure_memory), and as the plan accounts for them (memory_report
  /// without what kernels keep). Not for runs over ranks.
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> measured_and_planned;
};

Trained train(const Mode& mode, bool planned) {
  constexpr std::int64_t batch = 24, steps = 4;
  const std::int64_t pieces = mode.dp * mode.m;
  Graph g(11);
  Value loss;
  TrainConfig cfg;
  if (mode.gpt) {
    auto corpus = std::make_shared<data::TextCorpus>();
    for (int c = 0; c < 16; ++c) corpus->vocab.push_back(static_cast<unsigned char>('a' + c));
    for (int i = 0; i < 500; ++i) corpus->ids.push_back((i * 7 + i / 13) % 16);
    loss = models::gpt_with_loss(
               g, batch / pieces,
               {.vocab = 16, .seq = 8, .d_model = 16, .heads = 2, .layers = 2, .tp = mode.tp})
               .loss;
    cfg.data = {{"text", data::text_source(corpus, batch, pieces, 8, 5), {"tokens", "targets"}}};
  } else {
    auto dataset = std::make_shared<const data::Dataset>(data::synthetic(240, 12, 4, 7));
    Value logits = models::mlp(
        g, batch / pieces, {.inputs = 12, .hidden = 16, .layers = 3, .classes = 4, .tp = mode.tp});
    loss = softmax_cross_entropy(logits, g.find("label"));
    cfg.data = {{"synthetic", data::batch_source(dataset, batch, pieces, 9), {"x", "label"}}};
  }
  cfg.steps = steps;
  cfg.microbatches = mode.m;
  cfg.dp = mode.dp;
  cfg.pp = mode.pp;
  cfg.tp = mode.tp;
  cfg.schedule = mode.schedule;
  cfg.zero = mode.zero;
  cfg.threads = mode.threads;
  cfg.optimizer = mode.opt;
  cfg.bucket_bytes = 256;  // several buckets
  cfg.memory_plan = planned;
  if (mode.ranks) {
    for (int r = 0; r < mode.dp * mode.pp * mode.tp; ++r)
      cfg.replica_places.push_back({.rank = static_cast<std::uint16_t>(r)});
  }
  TrainingJob job = compile_training(g, loss, cfg);
  Trained out;
  for (const RegisterDesc& r : job.plan.registers) {
    // Each slot rounded up to the arena's alignment, as the pass places them.
    const std::int64_t slot =
        (baton::slot_bytes(r) + arena_alignment - 1) / arena_alignment * arena_alignment;
    if (r.arena >= 0) out.slot_bytes += slot * r.slots;
  }
  for (const ArenaDesc& a : job.plan.arenas) out.arena_bytes += a.bytes;
  if (planned) test::poison_outputs(job);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  rs.measure_memory = true;
  if (mode.ranks) {
    for (const auto& r : test::run_on_loopback(job.plan, job.kernels, rs))
      REQUIRE_MESSAGE(r.error.empty(), r.error);
  } else {
    const RunReport report = Runtime(job.plan, job.kernels, rs).run();
    for (const DeviceMemory& m : memory_report(job.plan)) {
      out.measured_and_planned[fmt::format("r{}/{}", m.rank, m.device.str())] = {0, m.registers_at_peak()};
    }
    for (const MeasuredMemory& m : report.memory) {
      out.measured_and_planned[fmt::format("r0/{}", m.device.str())].first = m.peak_bytes;
    }
  }
  out.losses = job.losses->per_step();
  for (auto& [name, t] : job.params->values()) {
    auto d = t.data<float>();
    out.weights[name] = std::vector<float>(d.begin(), d.end());
  }
  return out;
}

}  // namespace

TEST_CASE("MemoryPlan.PoisonedArenasTrainBitForBitAsSlotsOfTheirOwn" * doctest::timeout(240)) {
  const std::vector<Mode> modes{
      {.name = "one device"},
      {.name = "one device, 3 micro-batches, adam", .m = 3, .opt = optim::adam(0.01)},
      {.name = "dp 2, one micro-batch (gradients are views of dW)", .dp = 2},
      {.name = "gpt pp 2, one micro-batch", .pp = 2, .gpt = true, .opt = optim::adam(0.01)},
      {.name = "two threads", .m = 2, .threads = 2},
      {.name = "dp 2", .dp = 2, .m = 2},
      {.name = "pp 2 gpipe", .pp = 2, .schedule = "gpipe", .m = 4},
      {.name = "pp 3 1f1b", .pp = 3, .m = 4},
      {.name = "tp 2", .tp = 2, .m = 2},
      {.name = "dp 2 x pp 2", .dp = 2, .pp = 2, .m = 2},
      {.name = "pp 2 x tp 2, two threads", .pp = 2, .tp = 2, .m = 2, .threads = 2},
      {.name = "gpt", .m = 2, .gpt = true, .opt = optim::adam(0.01)},
      {.name = "gpt tp 2 x pp 2", .pp = 2, .tp = 2, .m = 2, .gpt = true, .opt = optim::adam(0.01)},
      {.name = "pp 2 over two ranks", .pp = 2, .m = 3, .ranks = true},
      {.name = "dp 2 over two ranks", .dp = 2, .m = 2, .ranks = true},
      // ZeRO 3's gathered weights share bytes with activations between their gathers.
      {.name = "dp 2 zero 3", .dp = 2, .m = 2, .opt = optim::adam(0.01), .zero = 3},
      {.name = "gpt dp 2 zero 3, two threads", .dp = 2, .m = 2, .threads = 2, .gpt = true, .opt = optim::adam(0.01), .zero = 3},
      {.name = "dp 2 x pp 2 zero 3", .dp = 2, .pp = 2, .m = 2, .zero = 3},
      {.name = "dp 2 zero 3 over two ranks", .dp = 2, .m = 2, .ranks = true, .zero = 3},
  };
  for (const Mode& mode : modes) {
    CAPTURE(mode.name);
    const Trained own = train(mode, false);
    const Trained packed = train(mode, true);
    CHECK(own.arena_bytes == 0);
    // Sharing happened: the arenas hold the planned slots in less than their sum.
    CHECK(packed.arena_bytes < packed.slot_bytes);
    MESSAGE(mode.name << ": " << packed.slot_bytes << " bytes of slots in " << packed.arena_bytes
                      << " bytes of arena");
    // Bit for bit: the same kernels on the same inputs in the same order. Slots of their own
    // are 64-byte aligned and arena slots 256-byte aligned, so even code that picks its path by
    // alignment (up to AVX-512's 64 bytes) takes the same one (checked under OPENBLAS_CORETYPE
    // Haswell, Zen, SkylakeX and Sandybridge).
    REQUIRE(own.losses.size() == 4);
    CHECK(packed.losses == own.losses);
    for (const auto& [name, w] : own.weights) {
      CAPTURE(name);
      CHECK(packed.weights.at(name) == w);
    }
    CHECK(std::isfinite(own.losses.back()));
  }
}

TEST_CASE("MemoryPlan.CudaRegistersGoInTheDevicesArenaAndPageLockedOnesHaveTheirOwn") {
  if (!test::cuda_built()) return;  // compiling refuses CUDA actors without CUDA kernels
  Graph g(2);
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(64, 12, 4, 7));
  Value logits = models::mlp(g, 8, {.inputs = 12, .hidden = 32, .layers = 2, .classes = 4});
  Value loss = softmax_cross_entropy(logits, g.find("label"));
  TrainConfig cfg;
  cfg.microbatches = 2;
  cfg.replica_places = {Placement{.device = Device{DeviceType::cuda, 0}}};
  cfg.data = {{"synthetic", data::batch_source(dataset, 16, 2, 9), {"x", "label"}}};
  const TrainingJob job = compile_training(g, loss, cfg);
  int on_device = 0, pinned = 0;
  for (RegisterIndex r = 0; r < job.plan.registers.size(); ++r) {
    const RegisterDesc& reg = job.plan.registers[r];
    const RegisterMemory mem = register_memory(job.plan, r);
    CAPTURE(reg.name);
    if (mem.pinned) {
      ++pinned;
      CHECK(reg.arena == -1);
    } else if (mem.allocated && reg.arena >= 0) {
      const ArenaDesc& arena = job.plan.arenas[static_cast<std::size_t>(reg.arena)];
      CHECK(arena.device == mem.device);
      on_device += mem.device.type == DeviceType::cuda;
    }
  }
  CHECK(pinned > 0);  // the data and the loss cross between host and device
  CHECK(on_device > 0);
  CHECK_NOTHROW(validate(job.plan, job.kernels));
}

TEST_CASE("MemoryPlan.ThePlanReportsItsBytesByCategoryAndABudgetRefusesWhatDoesNotFit") {
  auto compile = [](std::int64_t budget, bool planned) {
    Graph g(2);
    auto dataset = std::make_shared<const data::Dataset>(data::synthetic(64, 12, 4, 7));
    Value logits = models::mlp(g, 8, {.inputs = 12, .hidden = 32, .layers = 2, .classes = 4});
    Value loss = softmax_cross_entropy(logits, g.find("label"));
    TrainConfig cfg;
    cfg.optimizer = optim::adam(0.01);
    cfg.microbatches = 2;
    cfg.memory_budget = budget;
    cfg.memory_plan = planned;
    cfg.data = {{"synthetic", data::batch_source(dataset, 16, 2, 9), {"x", "label"}}};
    return compile_training(g, loss, cfg);
  };
  const TrainingJob job = compile(0, true);
  const auto report = memory_report(job.plan);
  REQUIRE(report.size() == 1);
  const DeviceMemory& m = report[0];
  std::int64_t params = 0;
  for (const auto& [name, t] : job.params->values()) params += t.numel() * 4;
  auto bytes = [&](MemoryCategory c) { return m.bytes[static_cast<std::size_t>(c)]; };
  // Weights: the master copies, which are each weight's once-a-step register too
  // (RegisterDesc::kernel_memory); Adam's two slots each.
  CHECK(bytes(MemoryCategory::weights) == params);
  CHECK(bytes(MemoryCategory::optimizer_state) == 2 * params);
  CHECK(bytes(MemoryCategory::activations) > 0);
  CHECK(bytes(MemoryCategory::gradients) > 0);
  CHECK(m.total() == m.registers + 3 * params);  // what the runtime allocates, and the kernels keep
  CHECK(m.slack >= 0);
  CHECK_FALSE(m.largest.empty());
  const std::int64_t unplanned = memory_report(compile(0, false).plan)[0].total();
  CHECK(m.total() < unplanned);
  CHECK(test::contains(to_text(report), "r0/cpu:0 peak "));
  // A budget below the peak is refused before anything runs, naming the largest consumer.
  const std::string why = test::thrown_message<GraphError>([&] { compile(m.total() - 1, true); });
  CHECK(test::contains(why, "but the memory budget is"));
  CHECK(test::contains(why, m.largest[0].name));
  CHECK_NOTHROW(compile(m.total(), true));
}

TEST_CASE("MemoryPlan.TheMeasuredHighWaterMarkAgreesWithThePlan" * doctest::timeout(240)) {
  // The plan's account of each device's register memory at its peak (memory_report, from slot
  // lives alone) against the most register bytes a run had in use at once: a slot in use from
  // the act that writes it until its last reader has released it.
  const std::vector<Mode> modes{
      {.name = "one device"},
      {.name = "one device, 3 micro-batches, adam", .m = 3, .opt = optim::adam(0.01)},
      {.name = "two threads", .m = 2, .threads = 2},
      {.name = "dp 2", .dp = 2, .m = 2},
      {.name = "pp 2 gpipe", .pp = 2, .schedule = "gpipe", .m = 4},
      {.name = "pp 3 1f1b", .pp = 3, .m = 4},
      {.name = "tp 2", .tp = 2, .m = 2},
      {.name = "gpt", .m = 2, .gpt = true, .opt = optim::adam(0.01)},
      {.name = "gpt tp 2 x pp 2", .pp = 2, .tp = 2, .m = 2, .gpt = true, .opt = optim::adam(0.01)},
      {.name = "gpt dp 2 zero 3", .dp = 2, .m = 2, .gpt = true, .opt = optim::adam(0.01), .zero = 3},
  };
  for (const Mode& mode : modes) {
    CAPTURE(mode.name);
    const Trained run = train(mode, true);
    REQUIRE_FALSE(run.measured_and_planned.empty());
    for (const auto& [device, mp] : run.measured_and_planned) {
      CAPTURE(device);
      const auto [measured, planned] = mp;
      MESSAGE(mode.name << " " << device << ": measured " << measured << " planned " << planned);
      CHECK(measured > 0);
      CHECK(measured <= planned);
    }
  }
}
