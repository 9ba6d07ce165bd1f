// Fusions the compiler makes in the plan, each checked to train bit for bit as the plan without
// it (the same kernels' arithmetic on the same inputs), in the parallel modes that could break it.
//
// WeightCasts: a variable actor that emits its weight in bf16 (TrainConfig::fuse_weight_casts):
// under bf16 autocast every matrix product reads its weight through a cast; the plan drops those
// casts and has the optimizer write the rounded copy itself (on CUDA in the same kernel as the
// step). The casts that remain are the ones that must (a weight whose final f32 value crosses
// to the reporting rank).
//
// BiasGradients: the epilogues pass (TrainConfig::fuse_bias_gradients) computes a Linear
// layer's weight gradient and bias gradient in one matmul_bias_grad actor (on CUDA one cuBLASLt
// product with the bias-gradient epilogue).
//
// BiasAdds: the same pass (TrainConfig::fuse_bias_adds) computes a Linear layer's forward
// product and its bias's add, matmul(x, w) + b, in one matmul_bias actor (on CUDA one cuBLASLt
// product with the bias epilogue); under autocast the bf16 product's cast to f32 goes too.
//
// GeluProducts: with GELU's tanh form (--gelu tanh) the same pass makes the MLP's first product,
// its bias and GELU, bias_gelu(matmul(x, w1), b1), one matmul_bias_gelu actor that also writes
// the pre-activation for the backward (cuBLASLt's GELU_AUX_BIAS on CUDA), whose bias_gelu_grad
// becomes gelu_grad of it.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "loopback_run.h"
#include "models.h"
#include "test_util.h"

using namespace baton;

namespace {

struct Setup {
  std::string name;
  int dp = 1, pp = 1, tp = 1;
  std::string schedule = "1f1b";
  std::int64_t m = 2;  // micro-batches per replica
  std::string recompute = "none";
  bool ranks = false;  // each place a rank of its own, joined by a loopback data plane
  bool bf16 = true;    // under autocast
  bool gpt2 = false;   // models::gpt2 (a bias on every product) instead of models::gpt
  bool tanh = false;   // the GPT's MLP with GELU's tanh form
};

/// Which fusions a job's plan makes.
struct Fuse {
  bool casts = true, bias = true, adds = true;
};

struct Job {
  Graph g{5};
  Value loss;
  TrainingJob job;
  Job(const Setup& s, Fuse fuse) {
    const std::int64_t batch = 8, pieces = s.dp * s.m;
    auto corpus = std::make_shared<data::TextCorpus>();
    for (int c = 0; c < 16; ++c) corpus->vocab.push_back(static_cast<unsigned char>('a' + c));
    for (int i = 0; i < 600; ++i) corpus->ids.push_back((i * 5 + i / 11) % 16);
    {
      auto mixed = g.autocast(s.bf16 ? DType::bf16 : DType::f32);
      loss = s.gpt2 ? models::gpt2_with_loss(g, batch / pieces,
                                             {.vocab = 16, .seq = 8, .d_model = 16, .heads = 2, .layers = 2})
                          .loss
                    : models::gpt_with_loss(g, batch / pieces,
                                            {.vocab = 16, .seq = 8, .d_model = 16, .heads = 2, .layers = 2, .tp = s.tp,
                                             .fused_bias_gelu = true,
                                             .gelu = s.tanh ? GeluApprox::tanh : GeluApprox::none})
                          .loss;
    }
    TrainConfig cfg;
    cfg.data = {{"text", data::text_source(corpus, batch, pieces, 8, 3), {"tokens", "targets"}}};
    cfg.steps = 3;
    cfg.microbatches = s.m;
    cfg.dp = s.dp;
    cfg.pp = s.pp;
    cfg.tp = s.tp;
    cfg.schedule = s.schedule;
    cfg.recompute = s.recompute;
    cfg.optimizer = optim::adam(0.01);
    cfg.fuse_weight_casts = fuse.casts;
    cfg.fuse_bias_gradients = fuse.bias;
    cfg.fuse_bias_adds = fuse.adds;
    if (s.ranks) {
      for (int r = 0; r < s.dp * s.pp * s.tp; ++r) cfg.replica_places.push_back({.rank = static_cast<std::uint16_t>(r)});
    }
    job = compile_training(g, loss, cfg);
  }
};

using test::count_op;

struct Trained {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
};

Trained run(Job& j, bool ranks) {
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  if (ranks) {
    for (const auto& r : test::run_on_loopback(j.job.plan, j.job.kernels, rs)) REQUIRE_MESSAGE(r.error.empty(), r.error);
  } else {
    Runtime(j.job.plan, j.job.kernels, rs).run();
  }
  Trained out{j.job.losses->per_step(), {}};
  for (auto& [name, t] : j.job.params->values()) {
    REQUIRE(t.dtype() == DType::f32);  // the masters stay f32
    auto d = t.data<float>();
    out.weights[name] = std::vector<float>(d.begin(), d.end());
  }
  return out;
}

/// The step registers of the variable actors, by weight name: "name" -> dtype.
std::map<std::string, DType> step_dtypes(const Plan& plan) {
  std::map<std::string, DType> out;
  for (const ActorDesc& a : plan.actors) {
    if (!a.op.starts_with("variable.") || a.outputs.empty()) continue;
    out[a.op.substr(9)] = plan.registers[a.outputs[0]].dtype;
  }
  return out;
}

/// Trains `a` and `b` and checks that they agree bit for bit.
void check_same_training(Job& a, Job& b, bool ranks) {
  const Trained x = run(a, ranks), y = run(b, ranks);
  REQUIRE(x.losses.size() == 3);
  CHECK(std::isfinite(x.losses.back()));
  CHECK(y.losses == x.losses);
  REQUIRE(y.weights.size() == x.weights.size());
  for (const auto& [name, w] : x.weights) {
    CAPTURE(name);
    CHECK(y.weights.at(name) == w);
  }
}

/// Trains `a` and `b` and checks that their losses agree to one more bf16 rounding of a GELU
/// product's stored pre-activation (GeluProducts.*): bf16 keeps 8 bits, so the rounding moves
/// each GELU gradient by at most 2^-8 of it; three Adam steps of lr 0.01 on a loss near ln 16
/// stay within 1%.
void check_close_training(Job& a, Job& b, bool ranks) {
  const Trained x = run(a, ranks), y = run(b, ranks);
  REQUIRE(x.losses.size() == y.losses.size());
  for (std::size_t i = 0; i < x.losses.size(); ++i) {
    CAPTURE(i);
    CHECK(std::isfinite(y.losses[i]));
    CHECK(std::abs(y.losses[i] - x.losses[i]) <= 1e-2 * std::abs(x.losses[i]));
  }
}

void check_bit_for_bit(const std::vector<Setup>& setups) {
  for (const Setup& s : setups) {
    CAPTURE(s.name);
    Job casts(s, {.casts = false}), fused(s, {.casts = true});
    const int before = count_op(casts.job.plan, "cast"), after = count_op(fused.job.plan, "cast");
    MESSAGE(s.name << ": " << before << " cast actors with the casts, " << after << " without");
    CHECK(after < before);
    // Every product's weight (the blocks' wq, wk, wv, wo, w1, w2 and the head; the token table,
    // which the embedding reads in bf16; b1, which bias_gelu casts) comes out of its variable in
    // bf16 wherever its final value need not cross ranks; the layer norms' weights and the
    // residual's b2 and the positions, read in f32, stay f32.
    int low = 0;
    for (const auto& [weight, dt] : step_dtypes(fused.job.plan)) {
      CAPTURE(weight);
      if (weight.find("ln") != std::string::npos || weight.find("b2") != std::string::npos ||
          weight.starts_with("wpe")) {
        CHECK(dt == DType::f32);
      }
      low += dt == DType::bf16;
    }
    CHECK(low > 0);
    CHECK_NOTHROW(validate(fused.job.plan, fused.job.kernels));
    // Bit for bit: the variable rounds the master exactly as the cast kernel did.
    check_same_training(casts, fused, s.ranks);
  }
}

/// The bias-gradient fusion on and off: fewer actors, the same training bit for bit.
void check_bias_fusion(const std::vector<Setup>& setups) {
  for (const Setup& s : setups) {
    CAPTURE(s.name);
    Job apart(s, {.bias = false}), fused(s, {.bias = true});
    const int n = count_op(fused.job.plan, "matmul_bias_grad");
    MESSAGE(s.name << ": " << n << " matmul_bias_grad actors; sum_to " << count_op(apart.job.plan, "sum_to") << " -> "
                   << count_op(fused.job.plan, "sum_to") << ", actors " << apart.job.plan.actors.size() << " -> "
                   << fused.job.plan.actors.size());
    CHECK(count_op(apart.job.plan, "matmul_bias_grad") == 0);
    // Each block's MLP has two biases (b1 inside bias_gelu, b2 on the residual): every replica
    // fuses b1's (b2's too in f32 without recomputation; under bf16 b2 is added in f32 and its
    // product reads a bf16 cast of the gradient, and under full recomputation the product's x
    // is a clone made after the sum). Under tp each shard's b1 fuses in f32 (shard k > 0's
    // weight-gradient product reads x, ln2, through a copy made after the sum: the fused actor
    // takes the product's place); in bf16 at least shard 0's.
    if (s.tp == 1) {
      CHECK(n >= 2 * s.dp);
    } else {
      CHECK(n >= s.dp);
    }
    CHECK(count_op(fused.job.plan, "sum_to") == count_op(apart.job.plan, "sum_to") - n);
    CHECK(count_op(fused.job.plan, "matmul") == count_op(apart.job.plan, "matmul") - n);
    CHECK(fused.job.plan.actors.size() + static_cast<std::size_t>(n) <= apart.job.plan.actors.size());
    for (const ActorDesc& a : fused.job.plan.actors) {
      if (a.op != "matmul_bias_grad") continue;
      CAPTURE(a.name);
      REQUIRE(a.inputs.size() == 2);
      REQUIRE(a.outputs.size() == 2);
      const RegisterDesc& dy = fused.job.plan.registers[a.inputs[1].reg];
      CHECK(fused.job.plan.registers[a.outputs[1]].shape == Shape{dy.shape.back()});
    }
    CHECK_NOTHROW(validate(fused.job.plan, fused.job.kernels));
    check_same_training(apart, fused, s.ranks);
  }
}

/// The forward bias fusion on and off: fewer actors, the same training bit for bit.
void check_bias_add_fusion(const std::vector<Setup>& setups) {
  for (const Setup& s : setups) {
    CAPTURE(s.name);
    Job apart(s, {.adds = false}), fused(s, {.adds = true});
    const int n = count_op(fused.job.plan, "matmul_bias");
    const int casts = count_op(apart.job.plan, "cast") - count_op(fused.job.plan, "cast");
    MESSAGE(s.name << ": " << n << " matmul_bias actors; matmul " << count_op(apart.job.plan, "matmul") << " -> "
                   << count_op(fused.job.plan, "matmul") << ", cast -" << casts << ", actors "
                   << apart.job.plan.actors.size() << " -> " << fused.job.plan.actors.size());
    CHECK(count_op(apart.job.plan, "matmul_bias") == 0);
    // Every replica's forward fuses (and, under recomputation, its recomputed forward too): the
    // GPT's b2 in each block (b1 is inside bias_gelu; under tp the shards' products are summed
    // before b2 is added, so nothing fuses there); GPT-2's three projections in each block with a
    // plain bias (its c_fc's bias is in bias_gelu, tanh: the GELU product, GeluProducts.*).
    const int per_replica = s.tp > 1 ? 0 : s.gpt2 ? 3 * 2 : 2;
    const int gelu = count_op(fused.job.plan, "matmul_bias_gelu");
    CHECK(gelu == (s.gpt2 ? 2 * s.dp * (s.recompute == "full" ? 2 : 1) : 0));
    CHECK(n >= per_replica * s.dp);
    if (s.tp > 1) CHECK(n == 0);
    CHECK(count_op(fused.job.plan, "add") == count_op(apart.job.plan, "add") - n);
    // (the GELU product's backward drops the data gradient's product and makes the weight
    // gradient's matmul_bias_grad a plain product: one for one)
    CHECK(count_op(fused.job.plan, "matmul") == count_op(apart.job.plan, "matmul") - n - gelu);
    // Under autocast the bf16 product's widening goes with it (the bias is f32).
    CHECK(casts == (s.bf16 ? n : 0));
    if (gelu == 0) {
      CHECK(fused.job.plan.actors.size() + static_cast<std::size_t>(n + casts) == apart.job.plan.actors.size());
    } else {
      CHECK(fused.job.plan.actors.size() + static_cast<std::size_t>(n + casts) <= apart.job.plan.actors.size());
    }
    for (const ActorDesc& a : fused.job.plan.actors) {
      if (a.op != "matmul_bias") continue;
      CAPTURE(a.name);
      REQUIRE(a.inputs.size() == 3);
      REQUIRE(a.outputs.size() == 1);
      const RegisterDesc& x = fused.job.plan.registers[a.inputs[0].reg];
      const RegisterDesc& y = fused.job.plan.registers[a.outputs[0]];
      CHECK(fused.job.plan.registers[a.inputs[2].reg].shape == Shape{y.shape.back()});
      CHECK(x.dtype == (s.bf16 ? DType::bf16 : DType::f32));
      CHECK(y.dtype == DType::f32);
    }
    CHECK_NOTHROW(validate(fused.job.plan, fused.job.kernels));
    if (s.bf16 && gelu > 0) {
      check_close_training(apart, fused, s.ranks);  // GPT-2's c_fc: a GELU product in bf16
    } else {
      check_same_training(apart, fused, s.ranks);
    }
  }
}

/// The GELU product fusion on and off (the tanh form): fewer actors, the same training bit for
/// bit in f32; in bf16 the backward reads the pre-activation rounded to bf16 once more (the
/// stored aux output, as on CUDA), so there the losses agree to that rounding.
void check_gelu_product_fusion(const std::vector<Setup>& setups) {
  for (const Setup& s : setups) {
    CAPTURE(s.name);
    REQUIRE(s.tanh);
    Job apart(s, {.adds = false}), fused(s, {.adds = true});
    const Plan& a = apart.job.plan;
    const Plan& f = fused.job.plan;
    const int n = count_op(f, "matmul_bias_gelu"), back = count_op(f, "matmul_dgelu_bgrad");
    MESSAGE(s.name << ": " << n << " matmul_bias_gelu and " << back << " matmul_dgelu_bgrad actors; bias_gelu "
                   << count_op(a, "bias_gelu") << " -> "
                   << count_op(f, "bias_gelu") << ", bias_gelu_grad " << count_op(a, "bias_gelu_grad") << " -> "
                   << count_op(f, "bias_gelu_grad") << ", actors " << a.actors.size() << " -> " << f.actors.size());
    CHECK(count_op(a, "matmul_bias_gelu") == 0);
    // Each block's first MLP product in every replica (each shard's under tp: the shards' products
    // are apart until the second product's sum), and the recomputed forward's too.
    CHECK(n >= 2 * s.dp * s.tp * (s.recompute == "full" ? 2 : 1));
    CHECK(count_op(f, "bias_gelu") == 0);
    CHECK(count_op(f, "bias_gelu_grad") == 0);
    // Each backward bias_gelu_grad became a gelu_grad, or went into a matmul_dgelu_bgrad with the
    // next product's data gradient and b1's gradient: in every setup here but the zero-bubble
    // one, whose bias gradients are W work (the data gradient's product is B work).
    CHECK(count_op(f, "gelu_grad") + back == count_op(a, "gelu_grad") + count_op(a, "bias_gelu_grad"));
    if (s.schedule == "zb-h1") {
      CHECK(back == 0);
    } else {
      CHECK(back == count_op(a, "bias_gelu_grad"));
      CHECK(count_op(f, "sum_to") + count_op(f, "matmul_bias_grad") + back ==
            count_op(a, "sum_to") + count_op(a, "matmul_bias_grad"));
    }
    for (const ActorDesc& x : f.actors) {
      if (x.op == "gelu_grad" || x.op == "matmul_bias_gelu" || x.op == "matmul_dgelu_bgrad") {
        CAPTURE(x.name);
        CHECK(x.attrs.get_string("approximate", "none") == "tanh");
      }
      if (x.op != "matmul_bias_gelu") continue;
      REQUIRE(x.inputs.size() == 3);
      REQUIRE(x.outputs.size() == 2);
      const RegisterDesc& y = f.registers[x.outputs[0]];
      const RegisterDesc& pre = f.registers[x.outputs[1]];
      CHECK(pre.shape == y.shape);
      CHECK(pre.dtype == y.dtype);
      CHECK(f.registers[x.inputs[2].reg].shape == Shape{y.shape.back()});
      // The backward reads the pre-activation: a gelu_grad, or a matmul_dgelu_bgrad as its third
      // input.
      for (ActorIndex c : pre.consumers) {
        const ActorDesc& r = f.actors[c];
        CHECK((r.op == "gelu_grad" || (r.op == "matmul_dgelu_bgrad" && r.inputs[2].reg == x.outputs[1])));
      }
    }
    CHECK_NOTHROW(validate(f, fused.job.kernels));
    if (!s.bf16) {
      check_same_training(apart, fused, s.ranks);
    } else {
      check_close_training(apart, fused, s.ranks);
    }
  }
}

}  // namespace

TEST_CASE("GeluProducts.OneActorComputesProductBiasAndGeluAndTrainsAsTheOps" * doctest::timeout(240)) {
  check_gelu_product_fusion({{.name = "f32, one device, 2 micro-batches", .bf16 = false, .tanh = true},
                             {.name = "bf16, one device", .tanh = true},
                             {.name = "f32, full recomputation", .recompute = "full", .bf16 = false, .tanh = true},
                             {.name = "f32, dp 2", .dp = 2, .bf16 = false, .tanh = true},
                             {.name = "f32, tp 2", .tp = 2, .bf16 = false, .tanh = true},
                             {.name = "f32, pp 2 zb-h1", .pp = 2, .schedule = "zb-h1", .m = 4, .bf16 = false, .tanh = true},
                             {.name = "f32, pp 2 1f1b over two ranks", .pp = 2, .m = 2, .ranks = true, .bf16 = false,
                              .tanh = true}});
}

TEST_CASE("BiasAdds.OneActorComputesProductAndBiasAndTrainsBitForBit" * doctest::timeout(240)) {
  check_bias_add_fusion({{.name = "f32, one device, 2 micro-batches", .bf16 = false},
                         {.name = "bf16, one device"},
                         {.name = "f32, GPT-2", .bf16 = false, .gpt2 = true},
                         {.name = "bf16, GPT-2", .gpt2 = true},
                         {.name = "bf16, full recomputation", .recompute = "full"},
                         {.name = "f32, dp 2", .dp = 2, .bf16 = false},
                         {.name = "bf16, tp 2", .tp = 2}});
}

TEST_CASE("BiasAdds.FuseInPipelinesAndOverRanks" * doctest::timeout(240)) {
  check_bias_add_fusion({{.name = "bf16, pp 2 zb-h1", .pp = 2, .schedule = "zb-h1", .m = 4},
                         {.name = "bf16, pp 2 1f1b over two ranks", .pp = 2, .m = 2, .ranks = true}});
}

TEST_CASE("WeightCasts.VariablesEmitBf16AndTrainBitForBitAsWithCasts" * doctest::timeout(240)) {
  check_bit_for_bit({{.name = "one device, 2 micro-batches"},
                     {.name = "full recomputation", .recompute = "full"},
                     {.name = "dp 2", .dp = 2},
                     {.name = "tp 2", .tp = 2},
                     {.name = "pp 2 gpipe", .pp = 2, .schedule = "gpipe", .m = 4}});
}

TEST_CASE("WeightCasts.OnlyTheWeightsWhoseFinalValueCrossesRanksKeepTheirCasts" * doctest::timeout(240)) {
  // Two stages on two ranks: the loss (and so the reporting rank) is stage 1's. Replica 0's
  // stage-0 weights send their last f32 value to it, so their variables stay f32 and keep the
  // casts; stage 1's emit bf16.
  const Setup s{.name = "pp 2 over two ranks", .pp = 2, .m = 2, .ranks = true};
  Job fused(s, {});
  std::map<std::uint16_t, int> low_on, f32_products_on;
  for (const ActorDesc& a : fused.job.plan.actors) {
    if (!a.op.starts_with("variable.")) continue;
    const std::string weight = a.op.substr(9);
    const bool product = weight.find(".attn.w") != std::string::npos || weight.find("mlp.w") != std::string::npos ||
                         weight.starts_with("head.w");
    const DType dt = fused.job.plan.registers[a.outputs[0]].dtype;
    low_on[a.where.rank] += dt == DType::bf16;
    f32_products_on[a.where.rank] += product && dt == DType::f32;
  }
  CHECK(low_on[0] == 0);
  CHECK(f32_products_on[0] > 0);
  CHECK(low_on[1] > 0);
  CHECK(f32_products_on[1] == 0);
  check_bit_for_bit({s, {.name = "pp 2 x dp 2 over four ranks", .dp = 2, .pp = 2, .m = 2, .ranks = true}});
}

TEST_CASE("BiasGradients.OneActorComputesBothAndTrainsBitForBit" * doctest::timeout(240)) {
  check_bias_fusion({{.name = "f32, one device, 2 micro-batches", .bf16 = false},
                     {.name = "bf16, one device"},
                     {.name = "f32, full recomputation", .recompute = "full", .bf16 = false},
                     {.name = "f32, dp 2", .dp = 2, .bf16 = false},
                     {.name = "bf16, tp 2", .tp = 2}});
}

TEST_CASE("BiasGradients.FuseInPipelinesWithSplitBackwardsAndOverRanks" * doctest::timeout(240)) {
  check_bias_fusion({{.name = "f32, pp 2 zb-h1 (W work apart)", .pp = 2, .schedule = "zb-h1", .m = 4, .bf16 = false},
                     {.name = "bf16, pp 2 1f1b over two ranks", .pp = 2, .m = 2, .ranks = true}});
}
