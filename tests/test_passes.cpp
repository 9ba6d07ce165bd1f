// The compiler's passes (passes.h), each on its own: what it takes, what it gives, what it
// refuses; and the pipeline as compile_training runs it.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "models.h"
#include "test_util.h"

using namespace baton;

namespace {

/// x -> relu(x w1 + b1) w2 -> loss, plus a variable the loss does not read and a frozen one.
struct Mlp {
  Graph g{3};
  Value loss;
  TrainConfig cfg;
  explicit Mlp(std::int64_t batch = 8) {
    auto x = g.input("x", {batch, 6});
    auto y = g.input("label", {batch}, i32);
    auto w1 = g.variable("w1", {6, 8});
    auto b1 = g.variable("b1", {8}, init::zeros());
    auto w2 = g.variable("w2", {8, 3});
    auto frozen = g.variable("frozen", {3}, init::ones());
    g.node_mut(frozen.id()).trainable = false;
    (void)g.variable("unused", {5});
    loss = softmax_cross_entropy(matmul(relu(matmul(x, w1) + b1), w2) + frozen, y).named("loss");
    auto data = std::make_shared<const data::Dataset>(data::synthetic(64, 6, 3, 1));
    cfg.data = {{"synthetic", data::batch_source(data, batch, 1, 2), {"x", "label"}}};
  }
};

const ActorDesc* find_actor(const Plan& p, const std::string& name) {
  for (const ActorDesc& a : p.actors) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("Passes.NamesAreThePipelineInOrder") {
  const std::vector<std::string_view> want{"autodiff", "sbp",   "stages",        "recompute", "replicas", "sync",
                                           "lower",    "updates", "epilogues", "tp_collectives", "device_copies",
                                           "transfers", "nccl_p2p", "segments", "lanes", "memory"};
  const auto& got = passes::names();
  REQUIRE(got.size() >= want.size());
  CHECK(std::vector<std::string_view>(
            got.begin(), got.begin() + static_cast<std::ptrdiff_t>(want.size())) == want);
}

TEST_CASE("Passes.AutodiffDifferentiatesTheTrainedVariablesTheLossReads") {
  Mlp m;
  m.cfg.microbatches = 2;
  m.cfg.dp = 2;
  const passes::Differentiated d = passes::autodiff(m.g, m.loss, m.cfg);
  std::vector<std::string> trained;
  for (const auto& [v, grad] : d.trained) {
    trained.push_back(v.name());
    CHECK(grad.shape() == v.shape());
    CHECK(d.need[static_cast<std::size_t>(grad.id())]);
  }
  // Neither the frozen weight nor the one the loss does not read; in graph order.
  CHECK(trained == std::vector<std::string>{"w1", "b1", "w2"});
  CHECK_FALSE(d.need[static_cast<std::size_t>(m.g.find("unused").id())]);
  CHECK(d.need[static_cast<std::size_t>(m.g.find("frozen").id())]);
  // The seed of the backward pass is 1 / (dp M): gradients of the global batch's mean loss.
  const std::string text = d.to_text();
  CHECK(test::contains(text, "{value=0.25}"));
  CHECK(test::contains(text, "loss = softmax_cross_entropy("));
  CHECK(test::contains(text, "trained w2 <- "));
  CHECK_FALSE(test::contains(text, "unused"));
  Graph other;
  CHECK_THROWS_AS(passes::autodiff(other, m.loss, m.cfg), GraphError);
  CHECK_THROWS_WITH_AS(passes::autodiff(m.g, m.g.find("w1"), m.cfg),
                       doctest::Contains("must be a scalar"), GraphError);
}

TEST_CASE("Passes.SbpPutsBackwardNodesOnTheShardOfWhatTheyDifferentiate") {
  Graph g(1);
  auto loss = models::gpt_with_loss(
                  g, 2, {.vocab = 16, .seq = 8, .d_model = 16, .heads = 2, .layers = 1, .tp = 2})
                  .loss;
  TrainConfig cfg;
  cfg.tp = 2;
  const passes::Differentiated d = passes::autodiff(g, loss, cfg);
  const passes::Shards s = passes::sbp(g, d, 2);
  int on_one = 0, backward_on_one = 0, backward_on_zero = 0;
  for (int id = 0; id < g.size(); ++id) {
    if (!d.need[static_cast<std::size_t>(id)]) continue;
    const Node& n = g.node(id);
    CHECK(s.at(id) >= 0);
    CHECK(s.at(id) < 2);
    if (id <= loss.id()) CHECK(s.at(id) == std::max(0, n.tp_shard));
    // A backward node runs where the forward node it differentiates runs (so shard 1's weight
    // and activation gradients are computed on shard 1, shard 0's on shard 0); one without
    // (the loss's seed) on the highest shard of its inputs.
    if (id > loss.id() && n.tp_shard < 0) {
      if (n.grad_of >= 0) {
        CHECK(s.at(id) == s.at(n.grad_of));
        (s.at(id) == 1 ? backward_on_one : backward_on_zero)++;
      } else {
        int highest = 0;
        for (int in : n.inputs) highest = std::max(highest, s.at(in));
        CHECK(s.at(id) == highest);
      }
    }
    on_one += s.at(id) == 1;
  }
  CHECK(on_one > 0);
  // The backward is split between the shards, as the forward is (it was all on shard 1 once:
  // every backward node reads dy, which came from the vocabulary-parallel loss on shard 1).
  CHECK(backward_on_one > 0);
  CHECK(backward_on_zero > 0);
  CHECK(test::contains(s.to_text(g, d), "tp 2\n"));
  // Without tensor parallelism every node is on shard 0; tp 2 of a model with no shards is refused.
  Mlp m;
  const passes::Differentiated dm = passes::autodiff(m.g, m.loss, m.cfg);
  CHECK(passes::sbp(m.g, dm, 1).at(m.loss.id()) == 0);
  CHECK_THROWS_WITH_AS(passes::sbp(m.g, dm, 2),
                       doctest::Contains("no node of the model is on a shard above 0"), GraphError);
}

TEST_CASE("Passes.StagesCutTheForwardPassAndKeepEachGradientWithItsOp") {
  Mlp m;
  m.cfg.pp = 2;
  m.cfg.microbatches = 4;
  const passes::Differentiated d = passes::autodiff(m.g, m.loss, m.cfg);
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    m.cfg.schedule = schedule;
    const passes::Stages st = passes::stages(m.g, d, m.cfg, *ParameterStore::initialize(m.g));
    CHECK(st.at(m.g.find("w1").id()) == 0);
    CHECK(st.at(m.loss.id()) == 1);
    int last = 0;
    for (int id = 0; id <= m.loss.id(); ++id) {
      if (!d.need[static_cast<std::size_t>(id)] || m.g.node(id).op == "variable" ||
          m.g.node(id).op == "input")
        continue;
      CHECK(st.at(id) >= last);  // forward ops in order
      last = st.at(id);
    }
    for (int id = m.loss.id() + 1; id < m.g.size(); ++id) {
      const int of = m.g.node(id).grad_of;
      if (d.need[static_cast<std::size_t>(id)] && of >= 0) CHECK(st.at(id) == st.at(of));
    }
    // The schedule's depth: GPipe keeps all M micro-batches, 1F1B pp - s.
    const std::vector<std::int32_t> want =
        schedule == "gpipe" ? std::vector<std::int32_t>{4, 4} : std::vector<std::int32_t>{2, 1};
    CHECK(st.forward_slots == want);
  }
  m.cfg.pp = 1;
  const passes::Stages one = passes::stages(m.g, d, m.cfg, *ParameterStore::initialize(m.g));
  CHECK(one.of.empty());
  CHECK(one.forward_slots == std::vector<std::int32_t>{m.cfg.activation_slots});
  m.cfg.pp = 40;
  CHECK_THROWS_WITH_AS(passes::stages(m.g, d, m.cfg, *ParameterStore::initialize(m.g)),
                       doctest::Contains("a 40-stage pipeline needs at least 40 ops"), GraphError);
}

TEST_CASE("Passes.ReplicasPlaceEachStageAndBucketTheGradients") {
  Mlp m;
  m.cfg.dp = 2;
  m.cfg.pp = 2;
  const passes::Differentiated d = passes::autodiff(m.g, m.loss, m.cfg);
  const passes::Shards sh = passes::sbp(m.g, d, 1);
  const passes::Stages st = passes::stages(m.g, d, m.cfg, *ParameterStore::initialize(m.g));
  const passes::Replicas reps = passes::replicate(d, sh, st, m.cfg);
  REQUIRE(reps.places.size() == 2);
  // Replica r's stage s on in-process device r * pp + s.
  CHECK(reps.places[1][0].device == Device{DeviceType::cpu, 2});
  CHECK(reps.places[1][1].device == Device{DeviceType::cpu, 3});
  CHECK(reps.suffix(1) == "@dp1");
  // Buckets of one place each (the weights of both stages are small), in reverse order of the
  // weights: the last stage's first.
  REQUIRE(reps.buckets.size() == 2);
  std::vector<std::string> order;
  for (const auto& b : reps.buckets) {
    CHECK_FALSE(b.nccl);
    for (const Value& v : b.weights) {
      CHECK(st.at(v.id()) == b.place);
      order.push_back(v.name());
    }
  }
  CHECK(order == std::vector<std::string>{"w2", "b1", "w1"});
  CHECK(reps.buckets[0].place == 1);
  m.cfg.bucket_bytes = 0;
  CHECK(passes::replicate(d, sh, st, m.cfg).buckets.size() == 3);  // a bucket per weight
  CHECK(test::contains(reps.to_text(), "replica 1: r0/cpu:2 r0/cpu:3"));
}

TEST_CASE("Passes.LowerMakesEveryReplicasActorsAndTheTransfersPassOnlyCrossesRanks") {
  Mlp m;
  m.cfg.pp = 2;
  m.cfg.microbatches = 2;
  m.cfg.replica_places = {Placement{.rank = 0}, Placement{.rank = 1}};
  const passes::Differentiated d = passes::autodiff(m.g, m.loss, m.cfg);
  const passes::Shards sh = passes::sbp(m.g, d, 1);
  const passes::Stages st = passes::stages(m.g, d, m.cfg, *ParameterStore::initialize(m.g));
  const passes::Replicas reps = passes::replicate(d, sh, st, m.cfg);
  const TrainingJob job =
      passes::lower(m.g, d, sh, st, reps, m.cfg, ParameterStore::initialize(m.g));
  // One actor per needed op, a variable and a repeat per weight, an accumulate per trained one.
  for (const char* name : {"loss", "variable.w1", "w1.repeat", "grad.w2.accumulate",
                           "variable.frozen", "loss.report"}) {
    CAPTURE(name);
    CHECK(find_actor(job.plan, name) != nullptr);
  }
  CHECK(find_actor(job.plan, "variable.unused") == nullptr);
  CHECK(find_actor(job.plan, "w1.repeat")->where.rank == 0);
  CHECK(find_actor(job.plan, "loss")->where.rank == 1);
  // Lowered, the plan reads across ranks directly; the transfers pass puts a transfer on the
  // reading side of each such register, and nothing more the second time.
  auto crossings = [](const Plan& p) {
    int n = 0;
    for (const ActorDesc& a : p.actors) {
      for (const InputPort& in : a.inputs)
        n += a.kind != ActorKind::transfer &&
             p.actors[p.registers[in.reg].producer].where.rank != a.where.rank;
    }
    return n;
  };
  CHECK(crossings(job.plan) > 0);
  const Plan moved = passes::transfers(job.plan);
  CHECK(crossings(moved) == 0);
  CHECK(passes::transfers(moved) == moved);
  // Host devices only: the device copies pass leaves the plan as it is; lanes order the stages.
  CHECK(passes::device_copies(moved, job.kernels) == moved);
  const Plan laned = passes::lanes(moved, m.cfg);
  CHECK(find_actor(laned, "loss")->order.lane >= 0);
  CHECK(find_actor(laned, "w1.repeat")->order.lane < 0);
  CHECK(find_actor(moved, "loss")->order.lane < 0);
}

TEST_CASE("Passes.ThePipelineIsCompileTrainingAndPrintsAfterEachPass") {
  Mlp m;
  m.cfg.microbatches = 2;
  m.cfg.pp = 2;
  std::vector<std::string> printed;
  std::string lowered;
  m.cfg.print_after = {"all"};
  m.cfg.print_ir = [&](std::string_view pass, const std::string& ir) {
    printed.emplace_back(pass);
    CHECK_FALSE(ir.empty());
    if (pass == "memory") lowered = ir;
  };
  const TrainingJob job = compile_training(m.g, m.loss, m.cfg);
  const auto& names = passes::names();
  CHECK(printed == std::vector<std::string>(names.begin(), names.end()));
  CHECK(lowered.starts_with(job.plan.to_text()));  // and the memory report after it
  // The same passes by hand give the same plan (compile_training adds nothing of its own).
  Mlp again;
  again.cfg.microbatches = 2;
  again.cfg.pp = 2;
  const passes::Differentiated d = passes::autodiff(again.g, again.loss, again.cfg);
  const passes::Shards sh = passes::sbp(again.g, d, 1);
  const passes::Stages st =
      passes::stages(again.g, d, again.cfg, *ParameterStore::initialize(again.g));
  const passes::Replicas reps = passes::replicate(d, sh, st, again.cfg);
  TrainingJob by_hand =
      passes::lower(again.g, d, sh, st, reps, again.cfg, ParameterStore::initialize(again.g));
  const Plan p = passes::memory(
      passes::lanes(passes::segments(passes::transfers(passes::device_copies(
                                         passes::epilogues(passes::updates(by_hand.plan, by_hand.kernels, again.cfg),
                                                           by_hand.kernels, again.cfg),
                                         by_hand.kernels)),
                                     by_hand.kernels, again.cfg),
                    again.cfg),
      again.cfg);
  CHECK(p.to_text() == job.plan.to_text());
  // Only what is asked for; an unknown pass is refused, naming the passes.
  Mlp one;
  printed.clear();
  one.cfg.print_after = {"stages", "lower"};
  one.cfg.print_ir = m.cfg.print_ir;
  (void)compile_training(one.g, one.loss, one.cfg);
  CHECK(printed == std::vector<std::string>{"stages", "lower"});
  one.cfg.print_after = {"inline"};
  CHECK_THROWS_WITH_AS(compile_training(one.g, one.loss, one.cfg),
                       doctest::Contains("print after 'inline': no such pass"), GraphError);
}

// Gradient synchronisation is one strategy chosen once (GradientSync, sync.cpp): --print-after
// sync names it and lists the actors it added, and those are the strategy's own (the
// all-reduce's ring, ZeRO's sharded optimizers, the servers' variables), not the model's.
TEST_CASE("Passes.GradientSyncIsOneStrategyShownAfterItsPass") {
  struct Case {
    const char* what;
    int zero;
    const char* sync;
    const char* names;  // in the description
    const char* added;  // an actor name it adds, in part
  };
  for (const Case& c : {Case{"all-reduce", 0, "allreduce", "all-reduce over 2 replicas", "allreduce."},
                        Case{"zero 2", 2, "allreduce", "ZeRO stage 2 over 2 replicas", "zero"},
                        Case{"zero 3", 3, "allreduce", "ZeRO stage 3 over 2 replicas", "zero"},
                        Case{"servers", 0, "ps", "parameter servers: 1 server, staleness 0", "@ps0"}}) {
    CAPTURE(c.what);
    Mlp m(4);
    m.cfg.dp = 2;
    m.cfg.zero = c.zero;
    m.cfg.sync = c.sync;
    std::string text;
    m.cfg.print_after = {"sync"};
    m.cfg.print_ir = [&](std::string_view pass, const std::string& ir) {
      CHECK(pass == "sync");
      text = ir;
    };
    const TrainingJob job = compile_training(m.g, m.loss, m.cfg);
    CAPTURE(text);
    CHECK(text.starts_with(std::string("gradient sync: ") + c.names + "\n"));
    CHECK(text.find(c.added) != std::string::npos);
    // Every actor listed is in the plan, and no model op (the forward's matmuls) is among them.
    std::size_t listed = 0;
    for (std::size_t at = text.find("\n  "); at != std::string::npos; at = text.find("\n  ", at + 1)) {
      const std::string name = text.substr(at + 3, text.find(' ', at + 3) - (at + 3));
      CHECK(find_actor(job.plan, name) != nullptr);
      CHECK_FALSE(name.starts_with("matmul"));
      ++listed;
    }
    CHECK(listed > 0);
  }
}

TEST_CASE("Passes.MemoryPlacesEverySlotTheRuntimeAllocatesAndLanesOrderTheOneStage") {
  Mlp m;
  m.cfg.microbatches = 2;
  m.cfg.memory_plan = false;
  const TrainingJob job = compile_training(m.g, m.loss, m.cfg);
  // Without the memory plan: no arenas, and a plan without stages has no lanes.
  CHECK(job.plan.arenas.empty());
  CHECK(find_actor(job.plan, "loss")->order.lane < 0);
  TrainConfig on = m.cfg;
  on.memory_plan = true;
  const Plan laned = passes::lanes(job.plan, on);
  CHECK(find_actor(laned, "loss")->order.lane >= 0);
  CHECK(find_actor(laned, "variable.w1")->order.lane < 0);
  const Plan placed = passes::memory(laned, on);
  REQUIRE(placed.arenas.size() == 1);
  for (RegisterIndex r = 0; r < placed.registers.size(); ++r) {
    const RegisterDesc& reg = placed.registers[r];
    CAPTURE(reg.name);
    const bool allocated = register_memory(placed, r).allocated && slot_bytes(reg) > 0;
    CHECK((reg.arena == 0) == allocated);
    if (allocated) CHECK(reg.offsets.size() == static_cast<std::size_t>(reg.slots));
  }
  CHECK(passes::memory(placed, on) == placed);  // placing again places the same way
  CHECK_NOTHROW(validate(placed, job.kernels));
}

// The segments pass (passes.h) on a plan written by hand, on sim device 0: a feeds x (a stream
// actor the pass leaves alone: no pass of training's), which feeds c; b reads only the source. a and b
// fold into one actor; c may not join them (the segment would wait for x, which waits for it),
// so it starts a run of its own with d, which ends there because the host reads d's output.
// The plan runs, and every sink sees every piece's value, so the folded kernels read and wrote
// the right slots, eagerly and (after the second sight of their slots) as replayed graphs.
TEST_CASE("Passes.SegmentsFoldRunsThatNeverWaitForThemselves" * doctest::timeout(60)) {
  const Device sim0{DeviceType::sim, 0};
  Plan p;
  auto reg = [&](const char* name) { return p.add_register({.name = name, .shape = {4}, .dtype = f32, .slots = 2}); };
  const RegisterIndex src = reg("src"), ra = reg("a"), rx = reg("x"), rb = reg("b"), rc = reg("c"), rd = reg("d");
  p.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {src}, .pieces = 12});
  auto op = [&](const char* name, const char* kernel, std::vector<InputPort> in, RegisterIndex out) {
    p.add_actor({.name = name, .op = kernel, .where = {.device = sim0}, .inputs = std::move(in), .outputs = {out},
                 .role = ActorRole::forward, .stage = 0});
  };
  op("a", "copy", {{src}}, ra);
  op("x", "copy", {{ra}}, rx);
  p.actors.back().role = ActorRole::other;
  op("b", "copy", {{src}}, rb);
  op("c", "copy", {{rx}}, rc);
  op("d", "add", {{rc}, {rb}}, rd);
  std::vector<std::vector<float>> seen;
  std::mutex m;
  p.add_actor({.name = "sink", .op = "collect", .inputs = {{rd}}});
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  kernels.add_fn("collect", DeviceType::cpu, f32, [&](KernelContext& ctx) {
    auto v = ctx.inputs[0]->data<float>();
    std::lock_guard lock(m);
    seen.emplace_back(v.begin(), v.end());
  });
  TrainConfig cfg;
  const passes::SegmentGraphs before = passes::segment_graphs();
  const Plan folded = passes::segments(p, kernels, cfg);
  std::vector<std::string> names;
  for (const ActorDesc& a : folded.actors) names.push_back(a.name);
  CAPTURE(folded.to_text());
  // a and b as one (first in topological order: a), c and d as another; x as it was.
  CHECK(names == std::vector<std::string>{"src", "segment.a", "x", "segment.c", "sink"});
  const ActorDesc* ab = find_actor(folded, "segment.a");
  REQUIRE(ab != nullptr);
  CHECK(ab->attrs.get_int("members", 0) == 2);
  CHECK(ab->outputs.size() == 2);  // a's and b's registers, which keep their outside readers
  const ActorDesc* cd = find_actor(folded, "segment.c");
  REQUIRE(cd != nullptr);
  CHECK(cd->attrs.get_int("members", 0) == 2);
  CHECK(cd->inputs.size() == 2);   // x and b; c's output is d's from within
  CHECK(find_actor(folded, "c") == nullptr);
  // Its act's steps, for the memory plan: c (step 0) reads x and writes c; d (step 1) reads b
  // and c, and writes d.
  CHECK(cd->steps.input_read == std::vector<std::int32_t>{0, 1});
  CHECK(cd->steps.output_written == std::vector<std::int32_t>{0, 1});
  CHECK(cd->steps.output_read == std::vector<std::int32_t>{1, 1});
  {
    Plan bad = folded;
    for (ActorDesc& a : bad.actors) {
      if (a.name == "segment.c") a.steps.output_read[1] = 0;
    }
    CHECK_THROWS_WITH_AS(validate(bad, kernels), doctest::Contains("reads output 1 at step 0 of its act, before step 1"),
                         PlanError);
  }
  // Off: the plan as it was.
  cfg.cuda_graphs = false;
  CHECK(passes::segments(p, kernels, cfg) == p);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::seconds(30);
  Runtime(folded, kernels, rs).run();
  // Piece k: a = b = x = c = k, d = c + b = 2k.
  REQUIRE(seen.size() == 12);
  for (std::size_t k = 0; k < seen.size(); ++k) {
    CAPTURE(k);
    CHECK(seen[k] == std::vector<float>(4, 2.0f * static_cast<float>(k)));
  }
  CHECK(passes::segment_graphs().launched > before.launched);
  CHECK(passes::segment_graphs().refused == before.refused);
}
