// ZeRO (TrainConfig::zero, graph/src/passes/lower_zero.cpp): the optimizer state (1), the
// gradients (2) and the weights (3) split over the data-parallel replicas. Each replica's optimizer gets the same
// sums plain data parallelism gives it and applies the same elementwise update to its shard,
// so losses and weights must equal plain dp bit for bit, whatever the OpenBLAS kernels (both
// runs use the same ones); and each replica must keep 1/dp of the split state.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>

#include "baton/actors.h"
#include "baton/actors/plan_memory.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "equivalence.h"
#include "loopback_run.h"

using namespace baton;

namespace {

struct Setup {
  int dp = 2;
  int zero = 0;
  int pp = 1;
  std::int64_t microbatches = 2;  // per replica
  int threads = 1;
  std::int64_t steps = 6;
  std::int64_t first_step = 0;
  OptimizerConfig opt = optim::adam(0.01);
  std::int64_t bucket_bytes = 25 << 20;
  DType dtype = DType::f32;
  bool ranks = false;  // replica r on rank r, run as runtimes joined by a LoopbackHub
  bool place_per_rank = false;  // with ranks: each stage of each replica on a rank of its own
  std::string grad_compression = "none";
  std::int64_t snapshot_every = 0;
  std::function<void(VariableSnapshot)> on_snapshot;
  std::shared_ptr<ParameterStore> params;                 // null: initialised from the seed
  std::shared_ptr<const OptimizerState> optimizer_state;  // a resumed job's
  std::int64_t memory_budget = 0;                         // TrainConfig::memory_budget
};

struct Job {
  TrainingJob job;
  Graph graph{11};
};

/// An MLP 48 -> 64 -> 64 -> 5 on synthetic data, global batch 32: its first two weights are
/// 12 and 16 KiB in f32, above the 8 KiB below which a bucket is summed directly, so both the
/// ring (segments, chains of adds) and the direct sums are exercised.
std::unique_ptr<Job> compile(const Setup& s) {
  constexpr std::int64_t batch = 32, width = 48, hidden = 64, classes = 5;
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(256, width, classes, 5));
  auto out = std::make_unique<Job>();
  Graph& g = out->graph;
  const std::int64_t pieces = s.dp * s.microbatches;
  auto x = g.input("x", {batch / pieces, width}, s.dtype);
  auto y = g.input("label", {batch / pieces}, i32);
  auto w1 = g.variable("w1", {width, hidden}, init::kaiming(), s.dtype);
  auto b1 = g.variable("b1", {hidden}, init::zeros(), s.dtype);
  auto w2 = g.variable("w2", {hidden, hidden}, init::kaiming(), s.dtype);
  auto b2 = g.variable("b2", {hidden}, init::zeros(), s.dtype);
  auto w3 = g.variable("w3", {hidden, classes}, init::kaiming(), s.dtype);
  auto b3 = g.variable("b3", {classes}, init::zeros(), s.dtype);
  auto h = relu(matmul(relu(matmul(x, w1) + b1), w2) + b2);
  auto loss = softmax_cross_entropy(matmul(h, w3) + b3, y);
  TrainConfig cfg;
  cfg.steps = s.steps;
  cfg.first_step = s.first_step;
  cfg.microbatches = s.microbatches;
  cfg.dp = s.dp;
  cfg.zero = s.zero;
  cfg.pp = s.pp;
  cfg.threads = s.threads;
  cfg.bucket_bytes = s.bucket_bytes;
  cfg.optimizer = s.opt;
  cfg.grad_compression = s.grad_compression;
  cfg.snapshot_every = s.snapshot_every;
  cfg.on_snapshot = s.on_snapshot;
  cfg.optimizer_state = s.optimizer_state;
  cfg.memory_budget = s.memory_budget;
  if (s.ranks) {
    for (int r = 0; r < s.dp * s.pp; ++r)
      cfg.replica_places.push_back({.rank = static_cast<std::uint16_t>(s.place_per_rank ? r : r / s.pp)});
  }
  cfg.data = {{"synthetic", data::batch_source(dataset, batch, pieces, 3), {"x", "label"}}};
  out->job = compile_training(g, loss, cfg, s.params);
  return out;
}

test::TrainedRun train(const Setup& s) {
  auto j = compile(s);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  if (!s.ranks) {
    Runtime rt(j->job.plan, j->job.kernels, rs);
    rt.run();
  } else {
    for (const auto& r : test::run_on_loopback(insert_transfers(j->job.plan), j->job.kernels, rs)) {
      REQUIRE_MESSAGE(r.error.empty(), r.error);
    }
  }
  return test::trained(j->job);
}

void check_identical(const test::TrainedRun& a, const test::TrainedRun& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) {
    CAPTURE(i);
    CHECK(a.losses[i] == b.losses[i]);
  }
  REQUIRE(a.weights.size() == b.weights.size());
  for (const auto& [name, w] : a.weights) {
    CAPTURE(name);
    REQUIRE(b.weights.count(name) == 1);
    CHECK(w == b.weights.at(name));
  }
}

/// Each of `stages` trains as `plain` (plain dp) does, bit for bit; `also` looks at each job.
void check_stages_equal_plain(const Setup& plain, std::initializer_list<int> stages,
                              const std::function<void(const Setup&)>& also = {}) {
  const test::TrainedRun want = train(plain);
  for (int zero : stages) {
    CAPTURE(zero);
    Setup z = plain;
    z.zero = zero;
    check_identical(want, train(z));
    if (also) also(z);
  }
}

/// The plan's peak bytes of `category` on each device, summed over the devices.
std::int64_t bytes_of(const Plan& plan, MemoryCategory category) {
  std::int64_t sum = 0;
  for (const DeviceMemory& m : memory_report(plan)) sum += m.bytes[static_cast<std::size_t>(category)];
  return sum;
}

}  // namespace

TEST_CASE("Zero.EqualsPlainDataParallelBitForBit" * doctest::timeout(180)) {
  for (DType dtype : {DType::f32, DType::f64}) {
    for (int dp : {2, 4}) {
      for (const OptimizerConfig& opt : {optim::adam(0.01), optim::sgd(0.02, 0.9), optim::adamw(0.01)}) {
        // One bucket of everything, and a bucket per weight (ring for the big ones, direct sums
        // for the small ones, and chunks of a few elements: b3 has 5 over 4 replicas).
        for (std::int64_t bucket_bytes : {std::int64_t{25} << 20, std::int64_t{0}}) {
          CAPTURE(dtype);
          CAPTURE(dp);
          CAPTURE(name(opt.kind));
          CAPTURE(bucket_bytes);
          const Setup plain{.dp = dp, .opt = opt, .bucket_bytes = bucket_bytes, .dtype = dtype};
          const test::TrainedRun want = train(plain);
          // It learns (SGD with momentum at this rate wanders for its first steps on this data).
          if (opt.kind != OptimizerConfig::Kind::sgd) CHECK(want.losses.back() < want.losses.front());
          for (int zero : {1, 2, 3}) {
            CAPTURE(zero);
            Setup z = plain;
            z.zero = zero;
            check_identical(want, train(z));
          }
        }
      }
    }
  }
}

TEST_CASE("Zero.WithClippingTwoThreadsPipelineAndRanks" * doctest::timeout(180)) {
  auto clipped = optim::adamw(0.02);
  clipped.clip_norm = 0.5;
  SUBCASE("clipping, two threads per replica") {
    // Zero 2 makes the global norm from every replica's sum of squares of its chunks (in double,
    // chunk by chunk) where plain dp sums the squares weight by weight: the factor may differ
    // in its last bit, so this compares within the reordering tolerance as well as exactly where
    // the factor's order is the same (zero 1). Zero 3 clips as zero 2 does.
    for (int zero : {1, 2, 3}) {
      CAPTURE(zero);
      const Setup plain{.dp = 2, .threads = 2, .opt = clipped};
      Setup z = plain;
      z.zero = zero;
      const auto want = train(plain);
      const auto got = train(z);
      if (zero == 1) check_identical(want, got);
      test::check_same_training(want, got,
                                test::tolerance({.dtype = DType::f32, .steps = 6, .longest_sum = 32, .lr = 0.02}));
    }
  }
  SUBCASE("pipeline of two stages: a bucket per stage") {
    check_stages_equal_plain({.dp = 2, .pp = 2, .microbatches = 4}, {2, 3});
  }
  SUBCASE("dp 2 x pp 2, each place a rank: replica 0's first stage is not on the reporting rank") {
    // Zero 3's trained shards of stage 0 then reach the store each kept to its last step.
    check_stages_equal_plain({.dp = 2, .pp = 2, .microbatches = 2, .ranks = true, .place_per_rank = true}, {1, 3},
                             [](const Setup& z) {
                               if (z.zero != 3) return;
                               const Plan p = compile(z)->job.plan;
                               CHECK(std::any_of(p.actors.begin(), p.actors.end(),
                                                 [](const ActorDesc& a) { return a.name.ends_with(".store.last"); }));
                             });
  }
  SUBCASE("replica r on rank r: the shards cross ranks") {
    check_stages_equal_plain({.dp = 2, .ranks = true}, {1, 2, 3});
  }
}

// ZeRO 1 with gradient compression all-reduces each bucket in 16 bits as plain dp does (stage 2
// refuses compression), with the same settings, so the same sums reach each replica's shard of
// the update: bit for bit plain dp's, compressed alike, in one process and across ranks.
TEST_CASE("Zero.OneWithCompressedGradientsEqualsCompressedPlainDataParallel" * doctest::timeout(180)) {
  for (const char* compression : {"bf16", "fp16"}) {
    for (int dp : {2, 4}) {
      for (bool ranks : {false, true}) {
        if (ranks && dp == 4) continue;
        CAPTURE(compression);
        CAPTURE(dp);
        CAPTURE(ranks);
        const Setup plain{.dp = dp, .ranks = ranks, .grad_compression = compression};
        // The sums do travel in the wire dtype.
        const DType wire = std::string(compression) == "bf16" ? DType::bf16 : DType::f16;
        const auto j = compile(plain);
        CHECK(std::any_of(j->job.plan.registers.begin(), j->job.plan.registers.end(),
                          [&](const RegisterDesc& r) { return r.dtype == wire; }));
        const test::TrainedRun want = train(plain);
        CHECK(want.losses.back() < want.losses.front());
        Setup z = plain;
        z.zero = 1;
        check_identical(want, train(z));
      }
    }
  }
}

TEST_CASE("Zero.EachReplicaKeepsItsShareOfTheState") {
  for (int dp : {2, 4}) {
    CAPTURE(dp);
    const Plan plain = compile({.dp = dp})->job.plan;
    const Plan z1 = compile({.dp = dp, .zero = 1})->job.plan;
    const Plan z2 = compile({.dp = dp, .zero = 2})->job.plan;
    // Adam's two slots of every weight: 4 bytes x 2 x the model's elements on each replica
    // without ZeRO; split over the replicas with it (chunks differ by at most one element).
    const std::int64_t elements = 48 * 64 + 64 + 64 * 64 + 64 + 64 * 5 + 5;
    CHECK(bytes_of(plain, MemoryCategory::optimizer_state) == dp * 8 * elements);
    CHECK(bytes_of(z1, MemoryCategory::optimizer_state) == 8 * elements);
    CHECK(bytes_of(z2, MemoryCategory::optimizer_state) == 8 * elements);
    // The gradients: on CPU devices plain dp already reduce-scatters each bucket from the
    // weights' gradients where they lie and reads the sums where they lie (no replica holds the
    // whole summed bucket), and both stages do the same (the shards update their segments in
    // place, keeping no copy): the same bytes in all three.
    CHECK(bytes_of(z1, MemoryCategory::gradients) == bytes_of(plain, MemoryCategory::gradients));
    CHECK(bytes_of(z2, MemoryCategory::gradients) == bytes_of(plain, MemoryCategory::gradients));
    // The weights: plain dp keeps a master copy in each variable actor, which is also the step
    // register the micro-batches read (RegisterDesc::kernel_memory); ZeRO keeps each replica's
    // whole step register (zero 3 would split it) and its shard's output register, where the
    // update is made: more weight bytes than plain dp on CPU devices, fewer in all.
    CHECK(bytes_of(plain, MemoryCategory::weights) == dp * 4 * elements);
    CHECK(bytes_of(z1, MemoryCategory::weights) == (dp + 1) * 4 * elements);
    CHECK(bytes_of(z2, MemoryCategory::weights) == (dp + 1) * 4 * elements);
    // Zero 3 keeps each weight once over all the replicas, as the shards' masters, and holds a
    // whole weight only from its gather to its last reader in the pass that gathered it: the
    // memory pass knows those lives (the gathers act in their pass's lane) and shares their
    // bytes. So a replica's weights at its peak are its shard and at most the weights then
    // gathered, here the largest (w2, 64 x 64) with its bias (64), which the layer's one
    // matmul_bias actor reads together (the epilogues pass): below plain dp's whole copy at dp 4
    // (at dp 2 this MLP's w2 is half the model).
    const Plan z3 = compile({.dp = dp, .zero = 3})->job.plan;
    CHECK(bytes_of(z3, MemoryCategory::optimizer_state) == 8 * elements);
    for (const DeviceMemory& m : memory_report(z3)) {
      CAPTURE(m.device.str());
      const std::int64_t shard = 4 * ((elements + dp - 1) / dp);
      CHECK(m.bytes[static_cast<std::size_t>(MemoryCategory::weights)] <= shard + 4 * (64 * 64 + 64));
    }
    std::int64_t masters = 0;
    for (const ActorDesc& a : z3.actors) {
      for (const KeptBytes& k : a.kept) masters += k.category == MemoryCategory::weights ? k.bytes : 0;
    }
    CHECK(masters == 4 * elements);
    if (dp == 4) CHECK(bytes_of(z3, MemoryCategory::weights) < bytes_of(plain, MemoryCategory::weights));
    const auto lives = slot_lives(z3);
    std::size_t gathered = 0;
    for (RegisterIndex r = 0; r < z3.registers.size(); ++r) {
      if (z3.registers[r].name.find(".gathered") == std::string::npos) continue;
      ++gathered;
      CAPTURE(z3.registers[r].name);
      for (const SlotLife& life : lives[r]) CHECK_FALSE(life.always());
      CHECK(z3.registers[r].arena >= 0);
    }
    // Every weight of every replica for the forward pass, and those the backward pass reads for
    // the gradients of activations (w2 and w3; not the biases, nor w1, whose input is data).
    CHECK(gathered == static_cast<std::size_t>(dp) * (6 + 2));
  }
}

TEST_CASE("Zero.ThreeOverRanksPullsEachShardInTheLaneAheadOfItsGather" * doctest::timeout(120)) {
  // Replica r on rank r: a shard of another rank is pulled once per micro-batch and pass by a
  // transfer in the pass's lane, behind the gather before the first that needs it (prefetch:
  // it crosses while that gather's weight computes), so the memory plan
  // knows its life as it knows the gathered weights'; no register of any rank holds weights for
  // the whole job but the shards' masters (the optimizers' own memory), the trained shards reach
  // the reporting rank through replica 0's forward pulls, and training is plain dp's bit for bit.
  for (int dp : {2, 4}) {
    CAPTURE(dp);
    const Plan plain = insert_transfers(compile({.dp = dp, .ranks = true})->job.plan);
    const Plan z3 = insert_transfers(compile({.dp = dp, .zero = 3, .ranks = true})->job.plan);
    const auto lives = slot_lives(z3);
    std::size_t pulls = 0;
    for (const ActorDesc& a : z3.actors) {
      if (a.kind != ActorKind::transfer || a.name.find(".pull") == std::string::npos) continue;
      ++pulls;
      CAPTURE(a.name);
      CHECK(a.order.lane >= 0);
      for (const SlotLife& life : lives[a.outputs[0]]) CHECK_FALSE(life.always());
      CHECK(z3.registers[a.outputs[0]].arena >= 0);
    }
    // Prefetched: where a gather comes before the first that needs a pull, the pull stands in
    // the lane behind it, so acts of the weight it gathered (its readers) come between.
    std::size_t prefetched = 0;
    for (const ActorDesc& t : z3.actors) {
      if (t.kind != ActorKind::transfer || t.name.find(".pull") == std::string::npos) continue;
      const ActorDesc* reader = nullptr;  // the first gather reading it (the store's sink comes first)
      for (ActorIndex c : z3.registers[t.outputs[0]].consumers) {
        if (z3.actors[c].op.starts_with("zero3.gather.") && (reader == nullptr || z3.actors[c].order.rank < reader->order.rank))
          reader = &z3.actors[c];
      }
      REQUIRE(reader != nullptr);
      CHECK(t.order.rank < reader->order.rank);
      prefetched += std::count_if(z3.actors.begin(), z3.actors.end(), [&](const ActorDesc& a) {
        return a.order.lane == t.order.lane && a.order.units == t.order.units && t.order.rank < a.order.rank &&
               a.order.rank < reader->order.rank && !a.op.starts_with("zero3.") && a.kind == ActorKind::compute;
      }) > 0;
    }
    CHECK(prefetched > 0);
    // Each replica pulls every other rank's shard for its forward pass, and for its backward
    // pass where the backward reads weights it holds (w2 and w3 lie in every shard here but the
    // last at dp 4).
    CHECK(pulls >= static_cast<std::size_t>(dp * (dp - 1)));
    for (RegisterIndex r = 0; r < z3.registers.size(); ++r) {
      const RegisterMemory m = register_memory(z3, r);
      if (!m.allocated || register_category(z3, r) != MemoryCategory::weights) continue;
      CAPTURE(z3.registers[r].name);
      for (const SlotLife& life : lives[r]) CHECK_FALSE(life.always());
    }
    // Less memory on every rank than plain dp (the optimizer state divides by dp; the weights
    // held at the peak are the shard and what is gathered then: this MLP's w2 is half the model).
    const auto plain_report = memory_report(plain), z3_report = memory_report(z3);
    REQUIRE(plain_report.size() == z3_report.size());
    for (std::size_t i = 0; i < z3_report.size(); ++i) {
      CAPTURE(z3_report[i].rank);
      CHECK(z3_report[i].total() < plain_report[i].total());
    }
    const Setup plain_run{.dp = dp, .ranks = true};
    Setup z = plain_run;
    z.zero = 3;
    check_identical(train(plain_run), train(z));
  }
}

TEST_CASE("Zero.ThreeFitsADeviceBudgetThatPlainDataParallelDoesNot") {
  // --device-memory is checked against the plan before anything runs: the budget of zero 3's
  // busiest rank refuses plain dp (naming the budget) and admits zero 3.
  auto peak = [](const Plan& plan) {
    std::int64_t most = 0;
    for (const DeviceMemory& m : memory_report(plan)) most = std::max(most, m.total());
    return most;
  };
  const std::int64_t budget = peak(insert_transfers(compile({.dp = 4, .zero = 3, .ranks = true})->job.plan));
  CHECK(budget < peak(insert_transfers(compile({.dp = 4, .ranks = true})->job.plan)));
  CHECK_NOTHROW(compile({.dp = 4, .zero = 3, .ranks = true, .memory_budget = budget}));
  try {
    compile({.dp = 4, .ranks = true, .memory_budget = budget});
    FAIL("plain dp compiled within zero 3's budget");
  } catch (const GraphError& e) {
    CHECK(std::string(e.what()).find("but the memory budget is") != std::string::npos);
  }
}

TEST_CASE("Zero.ResumesFromACheckpointOfPlainDataParallel" * doctest::timeout(120)) {
  // The saved state is whole tensors; a zero job takes each shard's window of them: the resumed
  // run goes on as the uninterrupted plain one, bit for bit.
  const Setup plain{.dp = 2, .steps = 8};
  const auto want = train(plain);
  std::map<std::string, VariableSnapshot> at3;
  Setup first = plain;
  first.snapshot_every = 3;
  first.on_snapshot = [&at3](VariableSnapshot s) {
    if (s.step == 3) at3[s.name] = std::move(s);
  };
  auto j = compile(first);
  {
    Runtime rt(j->job.plan, j->job.kernels);
    rt.run();
  }
  REQUIRE(at3.size() == 6);
  auto copy = [](const Tensor& t) {
    Tensor out = Tensor::empty(t.shape(), t.dtype());
    std::copy(t.data<float>().begin(), t.data<float>().end(), out.data<float>().begin());
    return out;
  };
  for (int zero : {1, 2, 3}) {
    CAPTURE(zero);
    auto params = ParameterStore::initialize(j->graph);  // the resumed run writes its weights here
    auto state = std::make_shared<OptimizerState>();
    for (const auto& [name, s] : at3) {
      params->at(name) = copy(s.weight);
      for (const auto& [slot, t] : s.slots) (*state)[name][slot] = copy(t);
    }
    Setup resumed = plain;
    resumed.zero = zero;
    resumed.first_step = 3;
    resumed.params = params;
    resumed.optimizer_state = state;
    const auto got = train(resumed);
    REQUIRE(got.losses.size() == 5);
    for (std::size_t i = 0; i < 5; ++i) CHECK(got.losses[i] == want.losses[i + 3]);
    for (const auto& [name, w] : want.weights) {
      CAPTURE(name);
      CHECK(got.weights.at(name) == w);
    }
  }
}

TEST_CASE("Zero.WhatItCannotDoIsRefusedBeforeRunning") {
  auto refused = [](const Setup& s, const std::string& words) {
    CAPTURE(words);
    try {
      compile(s);
      FAIL("compiled");
    } catch (const GraphError& e) {
      CHECK(std::string(e.what()).find(words) != std::string::npos);
    }
  };
  refused({.zero = 5}, "zero 5");
  refused({.zero = 3, .grad_compression = "bf16"}, "with zero 3");
  // dp 1: nothing to split, plain training.
  CHECK_NOTHROW(compile({.dp = 1, .zero = 2}));
}
