// Parallel training must equal sequential training (DESIGN.md section 8): the same model, seed
// and global batch, step by step, within float tolerance.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "equivalence.h"
#include "loopback_run.h"
#include "test_util.h"
#include "models.h"

using namespace baton;

namespace {

struct Run : test::TrainedRun {
  Plan plan;
};

struct Setup {
  std::int64_t dp = 1;
  int pp = 1;
  std::string schedule = "1f1b";
  std::int64_t microbatches = 1;  // per replica
  int threads = 1;
  std::int64_t steps = 10;
  OptimizerConfig opt = optim::sgd(0.1, 0.9);
  std::int64_t bucket_bytes = 25 << 20;
  std::vector<Placement> places;  // empty: in-process devices
  bool loopback_ranks = false;    // places are ranks: run them as runtimes joined by a LoopbackHub
  DType dtype = DType::f32;       // of the input and the weights
  std::int64_t hidden = 16;       // the MLP's hidden width
  std::vector<std::uint32_t> rank_hosts;  // TrainConfig::rank_hosts
};

/// The losses, the weights (replica 0's) and the plan of a finished job.
Run collect(const TrainingJob& job) {
  Run out;
  static_cast<test::TrainedRun&>(out) = test::trained(job);
  out.plan = job.plan;
  return out;
}

constexpr std::int64_t mlp_batch = 32;

/// A small MLP on synthetic data, global batch 32 split into dp x M micro-batches.
Run train(const Setup& s) {
  constexpr std::int64_t batch = mlp_batch, width = 12, classes = 4;
  auto dataset = std::make_shared<const baton::data::Dataset>(baton::data::synthetic(256, width, classes, 99));
  Graph g(5);
  const std::int64_t pieces = s.dp * s.microbatches;
  const std::int64_t mb = batch / pieces;
  auto x = g.input("x", {mb, width}, s.dtype);
  auto y = g.input("label", {mb}, i32);
  auto w1 = g.variable("w1", {width, s.hidden}, init::kaiming(), s.dtype);
  auto b1 = g.variable("b1", {s.hidden}, init::zeros(), s.dtype);
  auto w2 = g.variable("w2", {s.hidden, classes}, init::kaiming(), s.dtype);
  auto b2 = g.variable("b2", {classes}, init::zeros(), s.dtype);
  auto loss = softmax_cross_entropy(matmul(relu(matmul(x, w1) + b1), w2) + b2, y);
  TrainConfig cfg;
  cfg.steps = s.steps;
  cfg.microbatches = s.microbatches;
  cfg.dp = static_cast<int>(s.dp);
  cfg.bucket_bytes = s.bucket_bytes;
  cfg.pp = s.pp;
  cfg.schedule = s.schedule;
  cfg.replica_places = s.places;
  cfg.optimizer = s.opt;
  cfg.threads = s.threads;
  cfg.rank_hosts = s.rank_hosts;
  cfg.data = {{"synthetic", baton::data::batch_source(dataset, batch, pieces, 7), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  if (!s.loopback_ranks) {
    Runtime rt(job.plan, job.kernels, rs);
    rt.run();
  } else {
    for (const auto& r : test::run_on_loopback(insert_transfers(job.plan), job.kernels, rs)) {
      REQUIRE_MESSAGE(r.error.empty(), r.error);
    }
  }
  return collect(job);
}

// Every parallel-equals-sequential test runs in f64, where the reordered sums' rounding is
// 2^29 times smaller and a wrong sum cannot hide in it, and in f32, the dtype training uses.
constexpr DType both_dtypes[] = {DType::f64, DType::f32};

/// One device's run `one` against the reorganised run `other` of the MLP above: the tolerance of
/// test::Reordering for the setup's dtype, steps and optimizer (the longest sum is the batch).
void check_same(const Run& one, const Run& other, const Setup& s) {
  test::check_same_training(one, other,
                            test::tolerance({.dtype = s.dtype, .steps = s.steps, .longest_sum = mlp_batch, .lr = s.opt.lr}));
}

}  // namespace

TEST_CASE("Parallel.DataParallelEqualsOneDevice" * doctest::timeout(120)) {
  for (DType dtype : both_dtypes) {
    for (auto opt : {optim::sgd(0.1, 0.9), optim::adam(0.01)}) {
      for (std::int64_t dp : {2, 4}) {
        for (std::int64_t m : {1, 2}) {
          CAPTURE(dtype);
          CAPTURE(dp);
          CAPTURE(m);
          const Setup many{.dp = dp, .microbatches = m, .opt = opt, .dtype = dtype};
          Run one = train({.dp = 1, .microbatches = dp * m, .opt = opt, .dtype = dtype});
          REQUIRE(one.losses.size() == 10);
          CHECK(one.losses.back() < one.losses.front());
          check_same(one, train(many), many);
        }
      }
    }
  }
}

TEST_CASE("Parallel.DataParallelWithClippingAndTwoThreadsPerReplica" * doctest::timeout(120)) {
  auto opt = optim::adamw(0.02);
  opt.clip_norm = 0.5;
  for (DType dtype : both_dtypes) {
    CAPTURE(dtype);
    const Setup many{.dp = 2, .microbatches = 2, .threads = 2, .opt = opt, .dtype = dtype};
    check_same(train({.dp = 1, .microbatches = 4, .threads = 2, .opt = opt, .dtype = dtype}), train(many), many);
  }
}

TEST_CASE("Parallel.DataParallelAcrossRanksEqualsOneDevice" * doctest::timeout(120)) {
  // Replica r on rank r: the all-reduce's chunks cross ranks through transfer actors.
  for (auto [dp, dtype] : {std::pair{2, DType::f64}, {2, DType::f32}, {4, DType::f64}, {4, DType::f32}}) {
    CAPTURE(dp);
    CAPTURE(dtype);
    std::vector<Placement> places;
    for (std::int64_t r = 0; r < dp; ++r) places.push_back({.rank = static_cast<std::uint16_t>(r)});
    Run one = train({.dp = 1, .microbatches = dp * 2, .dtype = dtype});
    const Setup on_ranks{.dp = dp, .microbatches = 2, .places = places, .loopback_ranks = true, .dtype = dtype};
    Run ranks = train(on_ranks);
    check_same(one, ranks, on_ranks);
    int transfers = 0;
    for (const auto& a : insert_transfers(ranks.plan).actors) transfers += a.kind == ActorKind::transfer;
    CHECK(transfers > 0);
  }
}

TEST_CASE("Parallel.DataParallelOverTwoHostsAllReducesHierarchicallyAndEqualsOneDevice" * doctest::timeout(120)) {
  // Four replicas on two hosts (TrainConfig::rank_hosts): one replica per rank, or two ranks
  // with two in-process devices each. Hidden width 128: the one bucket (2052 elements) is above
  // the direct form's 8 KiB, so it goes by the ring, hence by the hierarchy.
  std::vector<Placement> ranks, devices;
  for (std::uint16_t r = 0; r < 4; ++r) ranks.push_back({.rank = r});
  for (std::uint16_t r = 0; r < 2; ++r) {
    for (std::uint8_t d = 0; d < 2; ++d) devices.push_back({.rank = r, .device = Device{DeviceType::cpu, d}});
  }
  for (DType dtype : both_dtypes) {
    for (const auto& [places, hosts] : {std::pair{ranks, std::vector<std::uint32_t>{0, 0, 1, 1}},
                                        std::pair{devices, std::vector<std::uint32_t>{0, 1}}}) {
      CAPTURE(dtype);
      CAPTURE(hosts.size());
      Run one = train({.dp = 1, .microbatches = 8, .dtype = dtype, .hidden = 128});
      const Setup hier{.dp = 4, .microbatches = 2, .places = places, .loopback_ranks = true, .dtype = dtype,
                       .hidden = 128, .rank_hosts = hosts};
      Run many = train(hier);
      check_same(one, many, hier);
      // Across hosts, per local index j, an all-reduce of the hosts' chunk j (actors
      // "<bucket>.x<j>.*"; by the ring or, for f32's 4 KiB chunks here, direct), counted with
      // the bucket's all-reduce.
      std::set<std::string> across;
      for (const ActorDesc& a : many.plan.actors) {
        // A transfer counts with the actor whose register it moves; a reducing one (a hop of the
        // ring from another rank) is that actor.
        if (a.kind == ActorKind::transfer && !reduces(a)) continue;
        for (const char* j : {".x0.", ".x1."}) {
          if (a.name.find(j) != std::string::npos) {
            across.insert(j);
            INFO(a.name);
            CHECK(a.attrs.get_string("allreduce", "").rfind("grad.", 0) == 0);
          }
        }
      }
      CHECK(across.size() == 2);
    }
  }
}

TEST_CASE("Parallel.ABucketUnder128KiBGoesDirectOnOneHostAndByTheRingAcrossHosts" * doctest::timeout(120)) {
  // Hidden width 128: one bucket of 2180 f32 (8.7 KiB), above the 8 KiB crossover measured
  // through the data plane and below the 128 KiB of ranks that read one another's pieces in
  // place (collectives.h). Two ranks on one host: direct (a sum per replica); on two hosts: the
  // ring, a hop per chunk, from the other rank: one that adds as it receives (transfer.add)
  // where the chunk lies in one weight's gradient, a transfer and an add where it spans two
  // (the bucket is read in parts, where the gradients lie).
  const std::vector<Placement> ranks{{.rank = 0}, {.rank = 1}};
  for (const auto& [hosts, direct] : {std::pair{std::vector<std::uint32_t>{0, 0}, true},
                                      std::pair{std::vector<std::uint32_t>{0, 1}, false}}) {
    CAPTURE(direct);
    const Run r = train({.dp = 2, .steps = 2, .places = ranks, .loopback_ranks = true, .hidden = 128,
                         .rank_hosts = hosts});
    std::map<std::string, int> ops;
    for (const ActorDesc& a : r.plan.actors) {
      if (a.attrs.get_string("allreduce", "").starts_with("grad.")) ++ops[a.op];
    }
    CHECK(ops["allreduce.sum"] == (direct ? 2 : 0));
    CHECK(ops["transfer.add"] + ops["allreduce.add"] == (direct ? 0 : 2));
    CHECK(ops["transfer.add"] == (direct ? 0 : 1));
  }
}

TEST_CASE("Parallel.DataParallelPlanHasTheAllReduceInBuckets") {
  auto count = [](const Run& r, const std::string& op) {
    int n = 0;
    for (const auto& a : r.plan.actors) n += a.op == op;
    return n;
  };
  // One reduction per weight (bucket_bytes 0): 4 weights and the loss, 2 replicas. A gradient
  // under gradient_direct_below_bytes (all four here) is reduce-scattered directly: one sum
  // actor per replica, its chunk; a bigger one by the ring's chains (collectives.h), with no
  // gather, since the variables read the sums where they lie. The loss's all-reduce takes the
  // default settings, the ring with one segment per chunk: an add per chunk, a gather (concat)
  // per replica, no slice (the replicas are devices of one rank).
  Run per_weight = train({.dp = 2, .microbatches = 1, .steps = 1, .bucket_bytes = 0});
  int direct = 0;  // reductions by the direct algorithm: replica 0's sum actors
  for (const auto& a : per_weight.plan.actors) direct += a.op == "allreduce.sum" && !a.name.ends_with("@dp1");
  const int ring = 5 - direct;
  CHECK(direct == 4);  // the weights
  CHECK(ring == 1);    // the loss
  CHECK(count(per_weight, "allreduce.split") == 0);
  CHECK(count(per_weight, "allreduce.slice") == 0);
  CHECK(count(per_weight, "allreduce.sum") == 2 * direct);
  CHECK(count(per_weight, "allreduce.add") == 2 * ring);
  CHECK(count(per_weight, "allreduce.concat") == 2 * ring);
  // DDP's 25 MB: the 4 weights share one bucket, reduce-scattered (it is under
  // gradient_direct_below_bytes: direct, a sum actor per replica, each its chunk, read from the
  // weights' gradients where they lie: no pack); the loss (not a gradient) goes by the ring: an
  // add per chunk and a gather per replica. On CPU devices nothing gathers or unpacks the
  // bucket's sums: each variable reads its window of them where they lie (chunk 0 on replica
  // 0, chunk 1 on replica 1).
  Run bucketed = train({.dp = 2, .microbatches = 1, .steps = 1});
  CHECK(count(bucketed, "allreduce.add") == 2);
  CHECK(count(bucketed, "allreduce.split") == 0);
  CHECK(count(bucketed, "allreduce.concat") == 2);  // the loss's gathers
  CHECK(count(bucketed, "allreduce.sum") == 2);
  for (const auto& a : bucketed.plan.actors) {
    if (!a.op.starts_with("variable.")) continue;
    CAPTURE(a.name);
    for (const InputPort& in : a.inputs) CHECK(bucketed.plan.registers[in.reg].name.starts_with("grad.bucket0.sum"));
  }
  // Replica r's actors run on in-process device cpu:r.
  for (const auto& a : bucketed.plan.actors) {
    if (a.name.ends_with("@dp1")) CHECK(a.where.device.index == 1);
  }
  // Buckets change how the sums travel, not what they are.
  Run a = train({.dp = 2, .microbatches = 2, .opt = optim::adam(0.01), .bucket_bytes = 0});
  Run b = train({.dp = 2, .microbatches = 2, .opt = optim::adam(0.01)});
  Run c = train({.dp = 2, .microbatches = 2, .opt = optim::adam(0.01), .bucket_bytes = 300});  // some buckets
  CHECK(a.losses == b.losses);
  CHECK(a.weights == b.weights);
  CHECK(a.weights == c.weights);
  // More replicas than a weight has elements (b2's 4 over 8): its reduce-scatter has empty
  // chunks (sums of nothing, which no variable reads), and the job runs to its end, the same.
  Run d = train({.dp = 8, .microbatches = 1, .opt = optim::adam(0.01), .bucket_bytes = 0});
  Run e = train({.dp = 8, .microbatches = 1, .opt = optim::adam(0.01)});
  REQUIRE(d.losses.size() == e.losses.size());
  CHECK(d.losses == e.losses);
  CHECK(d.weights == e.weights);
}

TEST_CASE("Parallel.BadDataParallelConfigsFailBeforeRunning") {
  Graph g(1);
  auto x = g.input("x", {4, 3});
  auto w = g.variable("w", {3, 1}, init::zeros());
  auto loss = mean(matmul(x, w));
  TrainConfig cfg;
  cfg.dp = 0;
  CHECK_THROWS_WITH_AS(compile_training(g, loss, cfg), doctest::Contains("dp must be >= 1"), GraphError);
  cfg.dp = 2;
  cfg.replica_places = {Placement{}};
  CHECK_THROWS_WITH_AS(compile_training(g, loss, cfg), doctest::Contains("is 2 but 1 replica places"), GraphError);
}

TEST_CASE("Parallel.PipelineEqualsOneDevice" * doctest::timeout(120)) {
  for (DType dtype : both_dtypes) {
    for (const char* schedule : {"gpipe", "1f1b"}) {
      for (int pp : {2, 4}) {
        CAPTURE(dtype);
        CAPTURE(schedule);
        CAPTURE(pp);
        Run one = train({.microbatches = 4, .opt = optim::adam(0.01), .dtype = dtype});
        const Setup s{.pp = pp, .schedule = schedule, .microbatches = 4, .opt = optim::adam(0.01), .dtype = dtype};
        Run piped = train(s);
        check_same(one, piped, s);
        // Every stage has work, on its own device.
        std::set<int> devices;
        for (const auto& a : piped.plan.actors) devices.insert(a.where.device.index);
        CHECK(devices.size() == static_cast<std::size_t>(pp));
      }
    }
  }
}

TEST_CASE("Parallel.PipelineScheduleIsTheActivationDepth") {
  for (const char* schedule : {"gpipe", "1f1b"}) {
    Run r = train({.pp = 2, .schedule = schedule, .microbatches = 4, .steps = 1});
    // A forward op's register on stage s has M slots (gpipe) or pp - s (1f1b).
    int checked = 0;
    for (const auto& a : r.plan.actors) {
      if (a.op == "softmax_cross_entropy") break;  // the forward ops come first in the plan
      if (a.op != "relu" && a.op != "matmul" && a.op != "matmul_bias") continue;  // x w + b: one actor
      ++checked;
      const auto& reg = r.plan.registers[a.outputs[0]];
      const int stage = a.where.device.index;
      CAPTURE(a.name);
      CHECK(reg.slots == (std::string(schedule) == "gpipe" ? 4 : 2 - stage));
    }
    CHECK(checked == 3);
  }
}

TEST_CASE("Parallel.DataTimesPipelineEqualsOneDevice" * doctest::timeout(120)) {
  std::vector<Placement> places;  // 2 replicas x 2 stages over 2 ranks: a replica per rank
  for (std::uint16_t r = 0; r < 2; ++r) {
    for (std::uint8_t s = 0; s < 2; ++s) places.push_back({.rank = r, .device = Device{DeviceType::cpu, s}});
  }
  for (DType dtype : both_dtypes) {
    CAPTURE(dtype);
    Run one = train({.microbatches = 4, .opt = optim::sgd(0.1, 0.9), .dtype = dtype});
    const Setup hybrid{.dp = 2, .pp = 2, .microbatches = 2, .opt = optim::sgd(0.1, 0.9), .dtype = dtype};
    check_same(one, train(hybrid), hybrid);
    const Setup ranks{.dp = 2, .pp = 2, .microbatches = 2, .opt = optim::sgd(0.1, 0.9), .places = places,
                      .loopback_ranks = true, .dtype = dtype};
    check_same(one, train(ranks), ranks);
  }
}

TEST_CASE("Parallel.BadPipelineConfigsFailBeforeRunning") {
  Graph g(1);
  auto x = g.input("x", {4, 3});
  auto w = g.variable("w", {3, 1}, init::zeros());
  auto loss = mean(matmul(x, w));
  TrainConfig cfg;
  cfg.pp = 5;  // two forward ops
  CHECK_THROWS_WITH_AS(compile_training(g, loss, cfg), doctest::Contains("5-stage pipeline needs at least 5 ops"),
                       GraphError);
  cfg.pp = 2;
  cfg.schedule = "zigzag";
  CHECK_THROWS_WITH_AS(compile_training(g, loss, cfg), doctest::Contains("schedule 'zigzag'"), GraphError);
}

TEST_CASE("Parallel.SmallGptPipelineAndDataParallelEqualOneDevice" * doctest::timeout(120)) {
  const std::string path = "/usr/share/common-licenses/GPL-3";
  if (!std::filesystem::exists(path)) return test::skip(test::Missing::system_file, path + " is missing (Debian: base-files)");
  auto corpus = std::make_shared<const baton::data::TextCorpus>(baton::data::load_text(path));
  const std::int64_t batch = 8, seq = 16, steps = 5;
  const OptimizerConfig adam = optim::adam(3e-3);
  auto gpt_run = [&](int dp, int pp, std::int64_t m, DType dtype) {
    const std::int64_t pieces = dp * m;
    models::GptShape shape{
        .vocab = corpus->vocab_size(), .seq = seq, .d_model = 32, .heads = 2, .layers = 2, .dtype = dtype};
    Graph g(3);
    Value logits = models::gpt(g, batch / pieces, shape);
    Value loss = softmax_cross_entropy(logits, g.find("targets"));
    TrainConfig cfg;
    cfg.steps = steps;
    cfg.microbatches = m;
    cfg.dp = dp;
    cfg.pp = pp;
    cfg.optimizer = adam;
    cfg.data = {{"text", baton::data::text_source(corpus, batch, pieces, seq, 3), {"tokens", "targets"}}};
    TrainingJob job = compile_training(g, loss, cfg);
    Runtime rt(job.plan, job.kernels);
    rt.run();
    return collect(job);
  };
  for (DType dtype : both_dtypes) {
    CAPTURE(dtype);
    // The longest sums are the weight gradients' over the batch's batch x seq positions.
    const double tol = test::tolerance({.dtype = dtype, .steps = steps, .longest_sum = batch * seq, .lr = adam.lr});
    Run one = gpt_run(1, 1, 2, dtype);
    REQUIRE(one.losses.size() == steps);
    test::check_same_training(one, gpt_run(1, 2, 2, dtype), tol);
    test::check_same_training(one, gpt_run(2, 1, 1, dtype), tol);
    test::check_same_training(one, gpt_run(2, 2, 1, dtype), tol);
  }
}

namespace {

/// Concatenates tensors of one dtype along an axis (0: rows, 1: columns; 1-D tensors along
/// their one axis) into `whole`.
void concat(const std::vector<const Tensor*>& parts, int axis, Tensor& whole) {
  const std::size_t es = size_of(whole.dtype());
  auto* out = static_cast<std::byte*>(whole.raw());
  if (parts[0]->shape().size() == 1 || axis == 0) {
    for (const Tensor* t : parts) {
      out = std::copy_n(static_cast<const std::byte*>(t->raw()), static_cast<std::size_t>(t->numel()) * es, out);
    }
    return;
  }
  const std::int64_t rows = parts[0]->shape()[0];
  for (std::int64_t r = 0; r < rows; ++r) {
    for (const Tensor* t : parts) {
      const auto row = static_cast<std::size_t>(t->shape()[1]) * es;
      out = std::copy_n(static_cast<const std::byte*>(t->raw()) + static_cast<std::size_t>(r) * row, row, out);
    }
  }
}

/// One device's view of a tensor-parallel model's weights: each "<name>.tp<k>" family put back
/// together, stacked where `row_split(name)` (the second layer of a Megatron pair), side by side
/// otherwise; the rest copied (the runs compared must not train the same tensors).
std::map<std::string, Tensor> assembled(const ParameterStore& p, std::int64_t tp,
                                        bool (*row_split)(const std::string& base)) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : p.values()) {
    auto pos = name.rfind(".tp");
    if (pos == std::string::npos) {
      Tensor copy = Tensor::empty(t.shape(), t.dtype());
      concat({&t}, 0, copy);
      out[name] = copy;
      continue;
    }
    const std::string base = name.substr(0, pos);
    if (out.count(base)) continue;
    std::vector<const Tensor*> parts;
    for (std::int64_t k = 0; k < tp; ++k) parts.push_back(&p.at(fmt::format("{}.tp{}", base, k)));
    const bool rows = row_split(base);
    Shape shape = t.shape();
    shape[rows || shape.size() == 1 ? 0 : 1] *= tp;
    Tensor whole = Tensor::empty(shape, t.dtype());
    concat(parts, rows ? 0 : 1, whole);
    out[base] = whole;
  }
  return out;
}

/// models::mlp's pairs: fc<l>.w by columns (l even), fc<l+1>.w by rows.
bool mlp_row_split(const std::string& base) {
  return base.ends_with(".w") && base.rfind("fc", 0) == 0 && std::stoi(base.substr(2)) % 2 == 1;
}

/// models::gpt's blocks: attn.wo and mlp.w2 by rows, wq, wk, wv, w1, b1 by columns; its
/// vocabulary: the token table wte by rows, the head by columns.
bool gpt_row_split(const std::string& base) {
  return base.ends_with("attn.wo") || base.ends_with("mlp.w2") || base == "wte";
}

constexpr std::int64_t tp_steps = 10;
const OptimizerConfig tp_adam = optim::adam(0.01);

Run train_tp(std::int64_t tp, int dp, int pp, DType dtype, std::shared_ptr<ParameterStore> start = nullptr) {
  constexpr std::int64_t batch = mlp_batch;
  auto dataset = std::make_shared<const baton::data::Dataset>(baton::data::synthetic(256, 12, 4, 99));
  const models::MlpShape shape{.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = tp, .dtype = dtype};
  const std::int64_t m = 2, pieces = dp * m;
  Graph g(5);
  Value logits = models::mlp(g, batch / pieces, shape);  // before find("label"): it makes the input
  Value loss = softmax_cross_entropy(logits, g.find("label"));
  TrainConfig cfg;
  cfg.steps = tp_steps;
  cfg.microbatches = m;
  cfg.dp = dp;
  cfg.pp = pp;
  cfg.tp = static_cast<int>(tp);
  cfg.optimizer = tp_adam;
  cfg.data = {{"synthetic", baton::data::batch_source(dataset, batch, pieces, 7), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg, std::move(start));
  Runtime rt(job.plan, job.kernels);
  rt.run();
  Run out = collect(job);
  out.weights.clear();
  for (auto& [name, t] : assembled(*job.params, tp, mlp_row_split)) out.weights[name] = test::widened(t);
  return out;
}

/// The tolerance of train_tp's runs in `dtype`.
double tp_tolerance(DType dtype) {
  return test::tolerance({.dtype = dtype, .steps = tp_steps, .longest_sum = mlp_batch, .lr = tp_adam.lr});
}

}  // namespace

TEST_CASE("Parallel.TensorParallelEqualsOneDevice" * doctest::timeout(120)) {
  // The tensor-parallel model's initial shards, put together, are the one-device model's
  // initial weights: then both must train alike.
  for (DType dtype : both_dtypes) {
    for (std::int64_t tp : {2, 4}) {
      CAPTURE(dtype);
      CAPTURE(tp);
      Graph shards(5);
      models::mlp(shards, 8, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = tp, .dtype = dtype});
      auto sharded_start = ParameterStore::initialize(shards);
      Graph whole(5);
      models::mlp(whole, 8, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .dtype = dtype});
      auto one_start = ParameterStore::initialize(whole);
      for (auto& [name, full] : assembled(*sharded_start, tp, mlp_row_split)) {
        Tensor& t = one_start->at(name);
        REQUIRE(t.shape() == full.shape());
        REQUIRE(t.dtype() == dtype);
        concat({&full}, 0, t);
      }
      Run one = train_tp(1, 1, 1, dtype, one_start);
      Run split = train_tp(tp, 1, 1, dtype, sharded_start);
      test::check_same_training(one, split, tp_tolerance(dtype));
    }
  }
}

TEST_CASE("Parallel.TensorParallelPlacesShardsAndCombinesWithDataAndPipeline" * doctest::timeout(120)) {
  Graph g(5);
  Value logits = models::mlp(g, 8, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = 2});
  Value loss = softmax_cross_entropy(logits, g.find("label"));
  auto data = std::make_shared<const baton::data::Dataset>(baton::data::synthetic(64, 12, 4, 1));
  TrainConfig cfg;
  cfg.tp = 2;
  cfg.data = {{"synthetic", baton::data::batch_source(data, 8, 1, 7), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  // Shard 1's weights, and the backward of what they touch, run on device 1.
  int on_one = 0;
  for (const auto& a : job.plan.actors) {
    if (a.name.find(".tp1") != std::string::npos) CHECK(a.where.device.index == 1);
    on_one += a.where.device.index == 1;
  }
  CHECK(on_one > 8);
  // tp with dp and pp: the same result as tp alone (same shards, same start).
  for (DType dtype : both_dtypes) {
    CAPTURE(dtype);
    Graph s(5);
    models::mlp(s, 8, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = 2, .dtype = dtype});
    auto start = ParameterStore::initialize(s);
    auto copy_of = [&] {
      auto p = std::make_shared<ParameterStore>();
      for (const auto& [name, t] : start->values()) {
        Tensor c = Tensor::empty(t.shape(), t.dtype());
        concat({&t}, 0, c);
        p->set(name, c);
      }
      return p;
    };
    const double tol = tp_tolerance(dtype);
    Run tp_only = train_tp(2, 1, 1, dtype, copy_of());
    test::check_same_training(tp_only, train_tp(2, 2, 1, dtype, copy_of()), tol);
    test::check_same_training(tp_only, train_tp(2, 1, 2, dtype, copy_of()), tol);
    test::check_same_training(tp_only, train_tp(2, 2, 2, dtype, copy_of()), tol);
  }
}

TEST_CASE("Parallel.BadTensorParallelConfigsFailBeforeRunning") {
  Graph g(1);
  auto x = g.input("x", {4, 3});
  auto w = g.variable("w", {3, 1}, init::zeros());
  auto loss = mean(matmul(x, w));
  TrainConfig cfg;
  cfg.tp = 2;  // nothing in the model is sharded
  CHECK_THROWS_WITH_AS(compile_training(g, loss, cfg), doctest::Contains("no node of the model is on a shard"), GraphError);
  Graph h(1);
  CHECK_THROWS_WITH_AS(models::mlp(h, 4, {.hidden = 10, .tp = 4}), doctest::Contains("not divisible by tp 4"), GraphError);
}


TEST_CASE("Parallel.SmallGptTensorParallelEqualsOneDevice" * doctest::timeout(180)) {
  // Megatron's split of every block and of the vocabulary (the token table by rows, the head by
  // columns, the loss computed from the shards' logits without gathering them) against one
  // device, started from the shards put together. The shards' partial sums (of products, of
  // embeddings, of exp() in the loss) are added in another order: test::Reordering's tolerance.
  const std::string path = "/usr/share/common-licenses/GPL-3";
  if (!std::filesystem::exists(path)) return test::skip(test::Missing::system_file, path + " is missing (Debian: base-files)");
  auto corpus = std::make_shared<const baton::data::TextCorpus>(baton::data::load_text(path));
  const std::int64_t batch = 8, seq = 16, steps = 20;
  const OptimizerConfig adam = optim::adam(3e-3);
  DType dtype = DType::f32;
  auto shape = [&](std::int64_t tp) {
    return models::GptShape{
        .vocab = corpus->vocab_size(), .seq = seq, .d_model = 32, .heads = 4, .layers = 2, .tp = tp, .dtype = dtype};
  };
  // ranks: shard k on rank k (runtimes joined by a LoopbackHub), the shards' sums and maxima
  // crossing ranks through transfer actors.
  auto run = [&](std::int64_t tp, int dp, bool ranks, std::shared_ptr<ParameterStore> start, Plan* plan = nullptr) {
    Graph g(3);
    Value loss = models::gpt_with_loss(g, batch / dp, shape(tp)).loss;
    TrainConfig cfg;
    cfg.steps = steps;
    cfg.tp = static_cast<int>(tp);
    cfg.dp = dp;
    cfg.optimizer = adam;
    cfg.data = {{"text", baton::data::text_source(corpus, batch, dp, seq, 3), {"tokens", "targets"}}};
    for (int k = 0; ranks && k < tp; ++k) cfg.replica_places.push_back({.rank = static_cast<std::uint16_t>(k)});
    TrainingJob job = compile_training(g, loss, cfg, std::move(start));
    if (plan != nullptr) *plan = job.plan;
    if (ranks) {
      for (const auto& r : test::run_on_loopback(insert_transfers(job.plan), job.kernels)) {
        REQUIRE_MESSAGE(r.error.empty(), r.error);
      }
    } else {
      Runtime rt(job.plan, job.kernels);
      rt.run();
    }
    Run out;
    out.losses = job.losses->per_step();
    for (auto& [name, t] : assembled(*job.params, tp, gpt_row_split)) out.weights[name] = test::widened(t);
    return out;
  };
  REQUIRE(corpus->vocab_size() % 4 == 0);
  // f64 for each layout; f32 for two of them (tp 4, and tp 2 across ranks), to keep the time.
  for (auto [tp, dp, ranks, dt] :
       {std::tuple{2, 1, false, DType::f64}, std::tuple{4, 1, false, DType::f64}, std::tuple{2, 2, false, DType::f64},
        std::tuple{2, 1, true, DType::f64}, std::tuple{4, 1, false, DType::f32}, std::tuple{2, 1, true, DType::f32}}) {
    dtype = dt;
    CAPTURE(dtype);
    CAPTURE(tp);
    CAPTURE(dp);
    CAPTURE(ranks);
    Graph shards(3);
    models::gpt(shards, batch, shape(tp));
    auto sharded_start = ParameterStore::initialize(shards);
    auto one_start = std::make_shared<ParameterStore>();
    for (auto& [name, t] : assembled(*sharded_start, tp, gpt_row_split)) one_start->set(name, t);
    REQUIRE(one_start->at("wte").shape() == Shape{corpus->vocab_size(), 32});
    REQUIRE(one_start->at("head.w").shape() == Shape{32, corpus->vocab_size()});
    Run one = run(1, 1, false, one_start);
    Plan plan;
    Run split = run(tp, dp, ranks, sharded_start, &plan);
    REQUIRE(one.losses.size() == static_cast<std::size_t>(steps));
    // The longest sums are the weight gradients' over batch x seq positions.
    test::check_same_training(
        one, split, test::tolerance({.dtype = dtype, .steps = steps, .longest_sum = batch * seq, .lr = adam.lr}));
    // Shard k's vocabulary lives on device k (of replica 0) and the logits are never gathered:
    // no register holds a row of all V of them.
    for (const auto& a : plan.actors) {
      if (a.name.starts_with("variable.wte.tp") || a.name.starts_with("variable.head.w.tp")) {
        CHECK((ranks ? a.where.rank : a.where.device.index % tp) == std::stoi(a.name.substr(a.name.rfind("tp") + 2)));
      }
    }
    for (const auto& r : plan.registers) {
      INFO(r.name);
      CHECK((r.shape.size() != 2 || r.shape[1] != corpus->vocab_size()));
    }
    if (ranks) {
      int transfers = 0;
      for (const auto& a : insert_transfers(plan).actors) transfers += a.kind == ActorKind::transfer;
      CHECK(transfers > 0);
    }
  }
}

TEST_CASE("Parallel.GptVocabularyNotDivisibleByTpFailsBeforeRunning") {
  Graph g(1);
  auto msg = baton::test::thrown_message<GraphError>(
      [&] { models::gpt_with_loss(g, 2, {.vocab = 30, .seq = 4, .d_model = 8, .heads = 4, .tp = 4}); });
  CHECK(baton::test::contains(msg, "vocab 30 is not divisible by tp 4"));
  Graph h(1);
  CHECK_NOTHROW(models::gpt_with_loss(h, 2, {.vocab = 32, .seq = 4, .d_model = 8, .heads = 4, .tp = 4}));
}

// ---- models::llama: Llama's decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) -----------

namespace {

const std::string llama_text = "/usr/share/common-licenses/GPL-3";

/// A tiny Llama over GPL-3's characters: 4 query heads sharing `kv_heads` kv heads.
models::LlamaShape tiny_llama(const baton::data::TextCorpus& corpus, std::int64_t kv_heads, DType dtype,
                              std::int64_t tp = 1) {
  return models::LlamaShape{.vocab = corpus.vocab_size(), .seq = 16, .d_model = 32, .heads = 4,
                            .kv_heads = kv_heads, .ffn_hidden = 64, .layers = 2, .tp = tp, .dtype = dtype};
}

/// models::llama's Megatron pairs: o_proj and down_proj by rows, q, k, v, gate, up by columns;
/// the token table by rows, the head by columns.
bool llama_row_split(const std::string& base) {
  return base.ends_with("self_attn.o_proj.weight") || base.ends_with("mlp.down_proj.weight") ||
         base == "model.embed_tokens.weight";
}

}  // namespace

TEST_CASE("Parallel.SmallLlamaLearnsBelowTheUnigramEntropy" * doctest::timeout(120)) {
  if (!std::filesystem::exists(llama_text)) {
    return test::skip(test::Missing::system_file, llama_text + " is missing (Debian: base-files)");
  }
  auto corpus = std::make_shared<const baton::data::TextCorpus>(baton::data::load_text(llama_text));
  const double unigram = corpus->unigram_entropy_nats();
  // Grouped-query attention spelt out and untied; multi-query, fused attention and tied
  // embeddings: each must learn more than the characters' frequencies (the unigram entropy is
  // the best loss a model that ignores the context can reach).
  for (auto [kv_heads, attention, tied] : {std::tuple{2, models::GptShape::Attention::naive, false},
                                           std::tuple{1, models::GptShape::Attention::fused, true}}) {
    CAPTURE(kv_heads);
    CAPTURE(tied);
    models::LlamaShape shape = tiny_llama(*corpus, kv_heads, DType::f32);
    shape.attention = attention;
    shape.tie_embeddings = tied;
    const std::int64_t batch = 16, steps = 150;
    Graph g(3);
    Value loss = models::llama_with_loss(g, batch, shape).loss;
    TrainConfig cfg;
    cfg.steps = steps;
    cfg.optimizer = optim::adam(3e-3);
    cfg.data = {{"text", baton::data::text_source(corpus, batch, 1, shape.seq, 3), {"tokens", "targets"}}};
    TrainingJob job = compile_training(g, loss, cfg);
    CHECK(job.params->values().count("lm_head.weight") == (tied ? 0u : 1u));
    CHECK(job.params->at("model.layers.1.self_attn.k_proj.weight").shape() == Shape{32, kv_heads * 8});
    Runtime rt(job.plan, job.kernels);
    rt.run();
    const std::vector<double> losses = job.losses->per_step();
    REQUIRE(losses.size() == static_cast<std::size_t>(steps));
    double last = 0;
    for (std::size_t i = losses.size() - 10; i < losses.size(); ++i) last += losses[i] / 10;
    CAPTURE(losses.front());
    CAPTURE(last);
    CAPTURE(unigram);
    CHECK(losses.front() > unigram);  // a fresh model is near ln(vocab), above the unigram entropy
    CHECK(last < unigram);
  }
}

TEST_CASE("Parallel.SmallLlamaPipelineAndDataParallelEqualOneDevice" * doctest::timeout(180)) {
  if (!std::filesystem::exists(llama_text)) {
    return test::skip(test::Missing::system_file, llama_text + " is missing (Debian: base-files)");
  }
  auto corpus = std::make_shared<const baton::data::TextCorpus>(baton::data::load_text(llama_text));
  const std::int64_t batch = 8, seq = 16, steps = 5;
  const OptimizerConfig adam = optim::adam(3e-3);
  auto llama_run = [&](int dp, int pp, std::int64_t m, DType dtype) {
    const std::int64_t pieces = dp * m;
    Graph g(3);
    Value loss = models::llama_with_loss(g, batch / pieces, tiny_llama(*corpus, 2, dtype)).loss;
    TrainConfig cfg;
    cfg.steps = steps;
    cfg.microbatches = m;
    cfg.dp = dp;
    cfg.pp = pp;
    cfg.schedule = "1f1b";
    cfg.optimizer = adam;
    cfg.data = {{"text", baton::data::text_source(corpus, batch, pieces, seq, 3), {"tokens", "targets"}}};
    TrainingJob job = compile_training(g, loss, cfg);
    Runtime rt(job.plan, job.kernels);
    rt.run();
    return collect(job);
  };
  for (DType dtype : both_dtypes) {
    CAPTURE(dtype);
    // The longest sums are the weight gradients' (and the RMSNorm scales') over the batch's
    // batch x seq positions.
    const double tol = test::tolerance({.dtype = dtype, .steps = steps, .longest_sum = batch * seq, .lr = adam.lr});
    Run one = llama_run(1, 1, 2, dtype);
    REQUIRE(one.losses.size() == steps);
    test::check_same_training(one, llama_run(1, 2, 2, dtype), tol);
    test::check_same_training(one, llama_run(2, 1, 1, dtype), tol);
    test::check_same_training(one, llama_run(2, 2, 1, dtype), tol);
  }
}

TEST_CASE("Parallel.SmallLlamaTensorParallelEqualsOneDevice" * doctest::timeout(180)) {
  // Megatron's split of every block (q, k, v, gate, up by columns; o, down by rows) and of the
  // vocabulary against one device started from the shards put together, as the GPT's test. kv
  // heads 2 over tp 2: each shard its own kv head; kv heads 1 over tp 2, or 2 over tp 4: k_proj
  // and v_proj whole, each shard slicing the repeated heads its query heads read (over tp 4,
  // shards 0 and 1 read kv head 0, shards 2 and 3 kv head 1).
  if (!std::filesystem::exists(llama_text)) {
    return test::skip(test::Missing::system_file, llama_text + " is missing (Debian: base-files)");
  }
  auto corpus = std::make_shared<const baton::data::TextCorpus>(baton::data::load_text(llama_text));
  REQUIRE(corpus->vocab_size() % 4 == 0);
  const std::int64_t batch = 8, seq = 16, steps = 10;
  const OptimizerConfig adam = optim::adam(3e-3);
  auto run = [&](const models::LlamaShape& shape, int dp, int pp, std::shared_ptr<ParameterStore> start) {
    Graph g(3);
    Value loss = models::llama_with_loss(g, batch / dp, shape).loss;
    TrainConfig cfg;
    cfg.steps = steps;
    cfg.tp = static_cast<int>(shape.tp);
    cfg.dp = dp;
    cfg.pp = pp;
    cfg.optimizer = adam;
    cfg.data = {{"text", baton::data::text_source(corpus, batch, dp, seq, 3), {"tokens", "targets"}}};
    TrainingJob job = compile_training(g, loss, cfg, std::move(start));
    Runtime rt(job.plan, job.kernels);
    rt.run();
    Run out;
    out.losses = job.losses->per_step();
    for (auto& [name, t] : assembled(*job.params, shape.tp, llama_row_split)) out.weights[name] = test::widened(t);
    return out;
  };
  // Fused attention: the kv heads read in place (grouped-query heads) on one device and by each
  // shard: its own kv head (kv heads 2 over tp 2), or the one kv head all its query heads read
  // (kv heads 1 over tp 2, 2 over tp 4).
  constexpr auto naive = models::GptShape::Attention::naive, fused = models::GptShape::Attention::fused;
  for (auto [tp, kv_heads, tied, dp, pp, dtype, attention] :
       {std::tuple{2, 2, false, 1, 1, DType::f64, naive}, std::tuple{2, 1, true, 1, 1, DType::f64, naive},
        std::tuple{4, 2, false, 1, 1, DType::f64, naive}, std::tuple{2, 2, false, 2, 1, DType::f64, naive},
        std::tuple{2, 2, false, 1, 2, DType::f64, naive}, std::tuple{2, 2, false, 1, 1, DType::f32, naive},
        std::tuple{2, 2, false, 1, 1, DType::f64, fused}, std::tuple{2, 1, false, 1, 1, DType::f64, fused},
        std::tuple{4, 2, false, 1, 1, DType::f64, fused}}) {
    CAPTURE(tp);
    CAPTURE(kv_heads);
    CAPTURE(tied);
    CAPTURE(dp);
    CAPTURE(pp);
    CAPTURE(dtype);
    CAPTURE(attention == fused);
    models::LlamaShape shape = tiny_llama(*corpus, kv_heads, dtype, tp);
    shape.tie_embeddings = tied;
    shape.attention = attention;
    Graph shards(3);
    models::llama(shards, batch, shape);
    auto sharded_start = ParameterStore::initialize(shards);
    CHECK(sharded_start->values().count("model.layers.0.self_attn.k_proj.weight") == (kv_heads % tp != 0 ? 1u : 0u));
    auto one_start = std::make_shared<ParameterStore>();
    for (auto& [name, t] : assembled(*sharded_start, tp, llama_row_split)) one_start->set(name, t);
    REQUIRE(one_start->at("model.embed_tokens.weight").shape() == Shape{corpus->vocab_size(), 32});
    REQUIRE(one_start->at("model.layers.1.mlp.down_proj.weight").shape() == Shape{64, 32});
    models::LlamaShape whole = shape;
    whole.tp = 1;
    Run one = run(whole, 1, 1, one_start);
    Run split = run(shape, dp, pp, sharded_start);
    REQUIRE(one.losses.size() == static_cast<std::size_t>(steps));
    test::check_same_training(
        one, split, test::tolerance({.dtype = dtype, .steps = steps, .longest_sum = batch * seq, .lr = adam.lr}));
  }
}

TEST_CASE("Parallel.LlamaShapesItCannotTakeFailBeforeRunning") {
  const models::LlamaShape ok{.vocab = 32, .seq = 4, .d_model = 16, .heads = 4, .kv_heads = 2, .ffn_hidden = 8};
  auto fails = [](models::LlamaShape s) {
    Graph g(1);
    return test::thrown_message<GraphError>([&] { models::llama_with_loss(g, 2, s); });
  };
  models::LlamaShape s = ok;
  s.kv_heads = 3;
  CHECK(test::contains(fails(s), "kv_heads 3 must divide heads 4"));
  s = ok;
  s.d_model = 12;  // head size 3: RoPE rotates pairs
  CHECK(test::contains(fails(s), "head size d_model / heads = 3 must be even"));
  s = ok;
  s.tp = 4;
  s.ffn_hidden = 6;
  CHECK(test::contains(fails(s), "ffn_hidden 6 is not divisible by tp 4"));
  s = ok;
  s.tp = 3;
  CHECK(test::contains(fails(s), "heads 4 is not divisible by tp 3"));
  s = ok;
  s.vocab = 30;
  s.tp = 4;
  CHECK(test::contains(fails(s), "vocab 30 is not divisible by tp 4"));
  Graph g(1);
  CHECK_NOTHROW(models::llama_with_loss(g, 2, ok));
}
