// The kernels a GPU needs (step 11): native bf16 kernels, bias + GELU, the fused attention and
// the multi-tensor optimizer steps.
//
// CPU halves (every build, every machine): the fused attention's CPU kernels against the unfused
// composition (matmul, scale, causal_mask, softmax, matmul) in float64 to 1e-12, its gradient
// against central finite differences in float64 and against the unfused ops' autodiff, the
// graph op's shape rules, bias_gelu against gelu(x + b) bit for bit, and the GPT with the fused
// ops against the GPT without them.
//
// GPU halves (tests named CudaKernels.*; without a GPU they print "...; CUDA tests skipped" and
// CTest reports them skipped): every new CUDA kernel against the CPU kernel on fresh random
// inputs, GPU outputs poisoned with NaN first. Errors are max |gpu - cpu| / max |cpu| over the
// elements; a failure prints the worst element's index and both values.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "baton/kernels/optim.h"
#include "models.h"

#include "test_util.h"

using namespace baton;
using test::cuda_usable;

namespace {

std::mt19937& rng() {
  static std::mt19937 g(std::random_device{}());
  return g;
}

// Uniform in [lo, hi), in `dt` (bf16: the float rounded to nearest even).
Tensor random_tensor(DType dt, const Shape& s, double lo = -2, double hi = 2) {
  Tensor t = Tensor::empty(s, dt);
  std::uniform_real_distribution<double> u(lo, hi);
  switch (dt) {
    case DType::f64:
      for (double& x : t.data<double>()) x = u(rng());
      break;
    case DType::f32:
      for (float& x : t.data<float>()) x = static_cast<float>(u(rng()));
      break;
    case DType::bf16:
      for (bfloat16& x : t.data<bfloat16>()) x = to_bf16(static_cast<float>(u(rng())));
      break;
    default:
      FAIL("random_tensor: a float dtype, not " << name(dt));
  }
  return t;
}

std::vector<double> values(const Tensor& t) {
  std::vector<double> v;
  switch (t.dtype()) {
    case DType::f64:
      for (double x : t.data<double>()) v.push_back(x);
      break;
    case DType::f32:
      for (float x : t.data<float>()) v.push_back(x);
      break;
    case DType::bf16:
      for (bfloat16 x : t.data<bfloat16>()) v.push_back(to_float(x));
      break;
    default:
      FAIL("values: a float dtype, not " << name(t.dtype()));
  }
  return v;
}

/// How far `got` is from `want`: max |got - want| / max |want| (the largest finite |want|), and
/// where. A NaN on one side only, or an infinity the other does not have, is an infinite error.
struct Difference {
  double error = 0;
  std::size_t worst = 0;
  double got = 0, want = 0, scale = 0;
  std::string str() const {
    return fmt::format("relative error {:.3g} (max |want| {:.4g}); worst element {}: got {:.8g}, want {:.8g}", error,
                       scale, worst, got, want);
  }
};

Difference difference(const Tensor& got, const Tensor& want) {
  const auto g = values(got), w = values(want);
  REQUIRE(g.size() == w.size());
  Difference d;
  for (double x : w) {
    if (std::isfinite(x)) d.scale = std::max(d.scale, std::abs(x));
  }
  double worst_abs = -1;
  for (std::size_t i = 0; i < w.size(); ++i) {
    double e;
    if (std::isnan(g[i]) != std::isnan(w[i]) || ((std::isinf(g[i]) || std::isinf(w[i])) && g[i] != w[i])) {
      e = INFINITY;
    } else if (std::isnan(w[i]) || std::isinf(w[i])) {
      e = 0;
    } else {
      e = std::abs(g[i] - w[i]);
    }
    if (e > worst_abs) {
      worst_abs = e;
      d.worst = i;
      d.got = g[i];
      d.want = w[i];
    }
  }
  d.error = worst_abs <= 0 ? 0 : (d.scale == 0 || std::isinf(worst_abs) ? worst_abs : worst_abs / d.scale);
  return d;
}

#define CHECK_CLOSE(got, want, tolerance)                 \
  do {                                                    \
    const Difference diff_ = difference((got), (want));   \
    INFO(diff_.str());                                    \
    CHECK(diff_.error <= (tolerance));                    \
  } while (false)

const KernelRegistry& registry() {
  static const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  return reg;
}

// Runs `op` on the CPU (the registry's kernel for `dt`; bf16: the float32 kernel on converted
// copies) into fresh outputs poisoned with NaN.
std::vector<Tensor> run_cpu(const std::string& op, DType dt, const Attrs& attrs, const std::vector<Tensor>& inputs,
                            const std::vector<Shape>& outputs) {
  auto kernel = registry().create(op, KernelConfig{"cpu." + op, Device{}, dt, attrs});
  std::vector<const Tensor*> in;
  for (const Tensor& t : inputs) in.push_back(&t);
  std::vector<Tensor> out;
  for (const Shape& s : outputs) {
    out.push_back(Tensor::empty(s, dt));
    std::memset(out.back().raw(), 0xff, out.back().nbytes());  // NaN in every float dtype
  }
  std::vector<Tensor*> out_p;
  for (Tensor& t : out) out_p.push_back(&t);
  KernelContext ctx{in, out_p, 0};
  kernel->compute(ctx);
  return out;
}

Tensor run1(const std::string& op, DType dt, const Attrs& attrs, const std::vector<Tensor>& inputs, const Shape& out) {
  return run_cpu(op, dt, attrs, inputs, {out})[0];
}

Tensor to_dtype(const Tensor& t, DType dt) {
  if (t.dtype() == dt) return t;
  return run1("cast", dt, {}, {t}, t.shape());
}

// The unfused attention of the graph's ops, kernel by kernel on the CPU.
Tensor naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  const DType dt = q.dtype();
  const Shape& s = q.shape();
  Shape scores = s;
  scores.back() = s[s.size() - 2];
  Tensor x = run1("matmul", dt, Attrs{{"trans_a", std::int64_t{0}}, {"trans_b", std::int64_t{1}}}, {q, k}, scores);
  x = run1("scale", dt, Attrs{{"value", scale}}, {x}, scores);
  if (causal) x = run1("causal_mask", dt, Attrs{{"value", -std::numeric_limits<double>::infinity()}}, {x}, scores);
  x = run1("softmax", dt, {}, {x}, scores);
  return run1("matmul", dt, Attrs{{"trans_a", std::int64_t{0}}, {"trans_b", std::int64_t{0}}}, {x, v}, s);
}

Attrs attention_attrs(bool causal, double scale) {
  return Attrs{{"causal", std::int64_t{causal ? 1 : 0}}, {"scale", scale}};
}

Shape packed(Shape s) {
  s.back() *= 3;
  return s;
}

// Columns [part d, (part + 1) d) of every row of a packed [..., T, 3 d] gradient.
Tensor unpack(const Tensor& grads, int part) {
  return run1("slice", grads.dtype(), Attrs{{"axis", std::int64_t{-1}}, {"start", part * (grads.shape().back() / 3)}},
              {grads}, [&] {
                Shape s = grads.shape();
                s.back() /= 3;
                return s;
              }());
}

double dot(const Tensor& a, const Tensor& b) {
  const auto x = values(a), y = values(b);
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

struct AttentionCase {
  Shape shape;  // [..., T, D]
  bool causal;
  double scale;
};

std::vector<AttentionCase> cpu_cases() {
  std::vector<AttentionCase> cases;
  // T = 1 and T past a block (32 query rows, 64 keys), D small and odd; a custom scale.
  for (const Shape& s : {Shape{2, 3, 1, 4}, Shape{2, 1, 5, 3}, Shape{1, 2, 17, 8}, Shape{2, 70, 16}, Shape{130, 5}}) {
    for (bool causal : {true, false}) cases.push_back({s, causal, 1.0 / std::sqrt(static_cast<double>(s.back()))});
  }
  cases.push_back({{2, 2, 33, 6}, true, 0.7});
  return cases;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CPU: the fused attention

// Both in double: every score, exponential and sum of the two agrees to rounding (a few 1e-16
// relative per operation, over sums of at most T D terms); 1e-12 leaves three orders of margin.
TEST_CASE("Attention.Cpu.MatchesTheUnfusedOpsInFloat64") {
  for (const AttentionCase& c : cpu_cases()) {
    CAPTURE(to_string(c.shape));
    CAPTURE(c.causal);
    const Tensor q = random_tensor(f64, c.shape), k = random_tensor(f64, c.shape), v = random_tensor(f64, c.shape);
    const Tensor fused = run1("attention", f64, attention_attrs(c.causal, c.scale), {q, k, v}, c.shape);
    CHECK_CLOSE(fused, naive_attention(q, k, v, c.causal, c.scale), 1e-12);
  }
}

// The gradient kernel against central differences of sum(dO * attention(q, k, v)) in float64:
// h = 1e-6 gives a truncation error near 1e-12 and a rounding error near 1e-10 for these
// magnitudes, so 1e-6 relative plus 1e-8 absolute per element (as test_ops_nn.cpp).
TEST_CASE("Attention.Cpu.GradientMatchesFiniteDifferences") {
  for (const AttentionCase& c : {AttentionCase{{2, 7, 3}, true, 1 / std::sqrt(3.0)}, AttentionCase{{1, 2, 6, 4}, false, 0.8},
                                 AttentionCase{{1, 70, 2}, true, 1.1}}) {
    CAPTURE(to_string(c.shape));
    CAPTURE(c.causal);
    std::vector<Tensor> qkv{random_tensor(f64, c.shape), random_tensor(f64, c.shape), random_tensor(f64, c.shape)};
    const Tensor dout = random_tensor(f64, c.shape);
    const Attrs attrs = attention_attrs(c.causal, c.scale);
    const Tensor o = run1("attention", f64, attrs, qkv, c.shape);
    const Tensor grads = run1("attention_grad", f64, attrs, {qkv[0], qkv[1], qkv[2], o, dout}, packed(c.shape));
    for (int part = 0; part < 3; ++part) {
      CAPTURE(part);
      const Tensor analytic = unpack(grads, part);
      auto x = qkv[static_cast<std::size_t>(part)].data<double>();
      const auto a = analytic.data<double>();
      // Every element for the small cases, every 7th for the long one.
      const std::size_t step = x.size() > 100 ? 7 : 1;
      for (std::size_t i = 0; i < x.size(); i += step) {
        const double keep = x[i], h = 1e-6;
        x[i] = keep + h;
        const double up = dot(dout, run1("attention", f64, attrs, qkv, c.shape));
        x[i] = keep - h;
        const double down = dot(dout, run1("attention", f64, attrs, qkv, c.shape));
        x[i] = keep;
        const double numeric = (up - down) / (2 * h);
        INFO("element " << i << ": analytic " << a[i] << ", numeric " << numeric);
        CHECK(std::abs(a[i] - numeric) <= 1e-6 * std::abs(numeric) + 1e-8);
      }
    }
  }
}

namespace {

// dq, dk, dv and o of sum(r * attention(q, k, v)) by autodiff through the graph (evaluate) in
// double, from feeds q, k, v and r: the fused op (its gradient op and the slices that unpack
// it), or the unfused ops, k and v repeated to q's heads first where they have fewer
// (reshape, broadcast_to, reshape: transformers' repeat_kv).
std::vector<Tensor> attention_grads(const Shape& qs, const Shape& kvs, bool causal, double scale, bool fused,
                                    const std::map<std::string, Tensor>& feeds) {
  Graph g(1);
  Value q = g.input("q", qs, f64), k = g.input("k", kvs, f64), v = g.input("v", kvs, f64);
  Value o;
  if (fused) {
    o = attention(q, k, v, {.causal = causal, .scale = scale});
  } else {
    auto repeat = [&](Value x) {
      if (kvs == qs) return x;
      Shape five = x.shape();
      five.insert(five.end() - 2, 1);
      Shape wide = five;
      wide[wide.size() - 3] = qs[qs.size() - 3] / kvs[kvs.size() - 3];
      return reshape(broadcast_to(reshape(x, five), wide), qs);
    };
    Value s = matmul(q, repeat(k), false, true) * scale;
    o = matmul(softmax(causal ? causal_mask(s) : s), repeat(v));
  }
  Value loss = sum(o * g.input("r", qs, f64));
  std::vector<Value> fetch = gradients(loss, {q, k, v});
  CHECK(fetch[1].shape() == kvs);
  CHECK(fetch[2].shape() == kvs);
  fetch.push_back(o);
  auto params = ParameterStore::initialize(g);
  return evaluate(g, feeds, fetch, *params);
}

}  // namespace

// The fused gradient against autodiff through the unfused ops, both in double through the
// graph (evaluate): the graph's attention, its gradient op and the slices that unpack it. Both
// are exact formulas evaluated in double: 1e-12 as above.
TEST_CASE("Attention.Cpu.GradientMatchesTheUnfusedOpsAutodiff") {
  for (const AttentionCase& c : cpu_cases()) {
    CAPTURE(to_string(c.shape));
    CAPTURE(c.causal);
    std::map<std::string, Tensor> feeds{{"q", random_tensor(f64, c.shape)}, {"k", random_tensor(f64, c.shape)},
                                        {"v", random_tensor(f64, c.shape)}, {"r", random_tensor(f64, c.shape)}};
    const auto fused = attention_grads(c.shape, c.shape, c.causal, c.scale, true, feeds);
    const auto naive = attention_grads(c.shape, c.shape, c.causal, c.scale, false, feeds);
    for (std::size_t i = 0; i < 4; ++i) {
      CAPTURE(i);  // dq, dk, dv, o
      CHECK_CLOSE(fused[i], naive[i], 1e-12);
    }
  }
}

// The f32 kernels accumulate in double and round once: within an ulp or two of the f64 result
// (relative 1.2e-7 each); 1e-6 relative to the largest element.
TEST_CASE("Attention.Cpu.Float32AgreesWithFloat64") {
  for (const AttentionCase& c : cpu_cases()) {
    CAPTURE(to_string(c.shape));
    CAPTURE(c.causal);
    const Attrs attrs = attention_attrs(c.causal, c.scale);
    std::vector<Tensor> in32;
    for (int i = 0; i < 4; ++i) in32.push_back(random_tensor(f32, c.shape));
    std::vector<Tensor> in64;
    for (const Tensor& t : in32) in64.push_back(to_dtype(t, f64));
    const Tensor o32 = run1("attention", f32, attrs, {in32[0], in32[1], in32[2]}, c.shape);
    const Tensor o64 = run1("attention", f64, attrs, {in64[0], in64[1], in64[2]}, c.shape);
    CHECK_CLOSE(to_dtype(o32, f64), o64, 1e-6);
    // The gradient at the f32 output (rounded the same way in both).
    const Tensor o = to_dtype(o32, f64);
    const Tensor g32 = run1("attention_grad", f32, attrs, {in32[0], in32[1], in32[2], o32, in32[3]}, packed(c.shape));
    const Tensor g64 = run1("attention_grad", f64, attrs, {in64[0], in64[1], in64[2], o, in64[3]}, packed(c.shape));
    CHECK_CLOSE(to_dtype(g32, f64), g64, 1e-6);
  }
}

// log sum_j exp(scale q_i . k_j) over the keys row i sees, in double from the inputs' values.
Tensor row_log_sum_exp(const Tensor& q, const Tensor& k, bool causal, double scale) {
  const Shape& s = q.shape();
  const auto t = static_cast<std::size_t>(s[s.size() - 2]), d = static_cast<std::size_t>(s.back());
  const auto qv = values(q), kv = values(k);
  Tensor out = Tensor::empty(attention_stats_shape(s), f64);
  auto o = out.data<double>();
  for (std::size_t row = 0; row < o.size(); ++row) {
    const std::size_t head = row / t, i = row % t;
    double m = -INFINITY;
    std::vector<double> sc;
    for (std::size_t j = 0; j < (causal ? i + 1 : t); ++j) {
      double dot_ij = 0;
      for (std::size_t c = 0; c < d; ++c) dot_ij += qv[(head * t + i) * d + c] * kv[(head * t + j) * d + c];
      sc.push_back(scale * dot_ij);
      m = std::max(m, sc.back());
    }
    double sum = 0;
    for (double x : sc) sum += std::exp(x - m);
    o[row] = m + std::log(sum);
  }
  return out;
}

// The forward's second output is each row's log-sum-exp (what cuDNN calls its stats), and the
// backward given it computes what it computes when it recomputes them. f64: both are exact
// formulas evaluated in double (1e-12, as above). f32: the stats are rounded to float (half an
// ulp of |lse| <= 16 here: 1e-6 absolute in the exponent, so 1e-6 relative in each p) where the
// recomputed ones stay double, and the outputs round once: 1e-5 relative to the largest.
TEST_CASE("Attention.Cpu.TheForwardsStatsAreEachRowsLogSumExpAndSpareTheBackwardItsSoftmax") {
  for (DType dt : {f64, f32}) {
    for (const AttentionCase& c : cpu_cases()) {
      CAPTURE(name(dt));
      CAPTURE(to_string(c.shape));
      CAPTURE(c.causal);
      const Attrs attrs = attention_attrs(c.causal, c.scale);
      std::vector<Tensor> in;
      for (int i = 0; i < 4; ++i) in.push_back(random_tensor(dt, c.shape));
      const auto fwd = run_cpu("attention", dt, attrs, {in[0], in[1], in[2]}, {c.shape, attention_stats_shape(c.shape)});
      CHECK(difference(fwd[0], run1("attention", dt, attrs, {in[0], in[1], in[2]}, c.shape)).error == 0);
      CHECK_CLOSE(to_dtype(fwd[1], f64), row_log_sum_exp(in[0], in[1], c.causal, c.scale), dt == f64 ? 1e-12 : 1e-6);
      const Tensor with = run1("attention_grad", dt, attrs, {in[0], in[1], in[2], fwd[0], in[3], fwd[1]}, packed(c.shape));
      const Tensor without = run1("attention_grad", dt, attrs, {in[0], in[1], in[2], fwd[0], in[3]}, packed(c.shape));
      CHECK_CLOSE(with, without, dt == f64 ? 1e-12 : 1e-5);
    }
  }
}

// attention_grad writes dq, dk and dv side by side in one [..., T, 3 D] output (the graph's node)
// or into three outputs of q's shape (the plan's, when only the slices read it): the same bits;
// anything else is refused naming what it wanted.
TEST_CASE("Attention.Cpu.TheGradientWritesDqDkDvSideBySideOrApart") {
  for (DType dt : {f64, f32}) {
    for (const AttentionCase& c : cpu_cases()) {
      CAPTURE(name(dt));
      CAPTURE(to_string(c.shape));
      const Attrs attrs = attention_attrs(c.causal, c.scale);
      std::vector<Tensor> in;
      for (int i = 0; i < 4; ++i) in.push_back(random_tensor(dt, c.shape));
      const Tensor o = run1("attention", dt, attrs, {in[0], in[1], in[2]}, c.shape);
      const std::vector<Tensor> args{in[0], in[1], in[2], o, in[3]};
      const Tensor side_by_side = run1("attention_grad", dt, attrs, args, packed(c.shape));
      const auto apart = run_cpu("attention_grad", dt, attrs, args, {c.shape, c.shape, c.shape});
      for (int part = 0; part < 3; ++part) {
        CAPTURE(part);
        CHECK(difference(apart[static_cast<std::size_t>(part)], unpack(side_by_side, part)).error == 0);
      }
    }
  }
  const Shape s{2, 5, 8};
  const std::vector<Tensor> args{random_tensor(f32, s), random_tensor(f32, s), random_tensor(f32, s),
                                 random_tensor(f32, s), random_tensor(f32, s)};
  const Attrs attrs = attention_attrs(true, 0.5);
  CHECK_THROWS_WITH_AS(run_cpu("attention_grad", f32, attrs, args, {s, s, Shape{2, 5, 9}}),
                       doctest::Contains("must have v's 80 elements ([2, 5, 8])"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(run_cpu("attention_grad", f32, attrs, args, {Shape{2, 5, 8}}),
                       doctest::Contains("or three outputs of q's, k's and v's sizes"), std::invalid_argument);
}

// The plan carries the stats from each attention actor to its gradient's actor: a second output
// register [batch, heads, T] (f32) of as many slots as the output's, read as the sixth input;
// naive attention and a forward-only plan have none.
TEST_CASE("Attention.Plan.TheForwardSavesItsStatsForItsGradient" * doctest::timeout(60)) {
  auto corpus = std::make_shared<data::TextCorpus>();
  corpus->vocab.assign(24, static_cast<unsigned char>('x'));
  for (int i = 0; i < 1024; ++i) corpus->ids.push_back(i % 24);
  for (auto attention : {models::GptShape::Attention::fused, models::GptShape::Attention::naive}) {
    const bool fused = attention == models::GptShape::Attention::fused;
    CAPTURE(fused);
    Graph g(3);
    models::Outputs out = models::gpt_with_loss(
        g, 4, {.vocab = 24, .seq = 16, .d_model = 16, .heads = 2, .layers = 2, .attention = attention});
    TrainConfig cfg;
    cfg.steps = 2;
    cfg.optimizer = optim::adam(1e-3);
    cfg.data = {{"text", data::text_source(corpus, 4, 1, 16, 3), {"tokens", "targets"}}};
    TrainingJob job = compile_training(g, out.loss, cfg);
    int forwards = 0, backwards = 0;
    for (const ActorDesc& a : job.plan.actors) {
      if (a.op == "attention") {
        ++forwards;
        REQUIRE(a.outputs.size() == 2);
        const RegisterDesc& stats = job.plan.registers[a.outputs[1]];
        CHECK(stats.name.ends_with(".saved"));
        CHECK(stats.shape == Shape{4, 2, 16});
        CHECK(stats.dtype == f32);
        CHECK(stats.slots == job.plan.registers[a.outputs[0]].slots);
        REQUIRE(stats.consumers.size() == 1);
        const ActorDesc& grad = job.plan.actors[stats.consumers[0]];
        CHECK(grad.op == "attention_grad");
        REQUIRE(grad.inputs.size() == 6);
        CHECK(grad.inputs[5].reg == a.outputs[1]);
        // dq, dk and dv in registers of their own, of q's shape, read where the slices' readers
        // read them: no slice actor copies them out.
        REQUIRE(grad.outputs.size() == 3);
        for (RegisterIndex r : grad.outputs) {
          CHECK(job.plan.registers[r].shape == Shape{4, 2, 16, 8});
          for (ActorIndex reader : job.plan.registers[r].consumers) CHECK(job.plan.actors[reader].op != "slice");
        }
      }
      if (a.op == "attention_grad") ++backwards;
    }
    CHECK(forwards == (fused ? 2 : 0));
    CHECK(backwards == forwards);
    // It trains (the CPU kernels write and read the stats).
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(30'000);
    Runtime(job.plan, job.kernels, rs).run();
    CHECK(job.losses->per_step().size() == 2);
  }
}

TEST_CASE("Attention.Graph.ChecksShapesAndNamesTheOp") {
  Graph g;
  Value q = g.input("q", {2, 4, 8, 16}), k = g.input("k", {2, 4, 8, 16}), v = g.input("v", {2, 4, 8, 16});
  Value o = attention(q, k, v);
  CHECK(o.shape() == Shape{2, 4, 8, 16});
  CHECK(o.dtype() == f32);
  CHECK(o.node().attrs.get_int("causal", -1) == 1);
  CHECK(o.node().attrs.get_double("scale", 0) == doctest::Approx(0.25));
  CHECK(attention(q, k, v, {.causal = false, .scale = 2.0}).node().attrs.get_double("scale", 0) == 2.0);
  auto error = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const GraphError& e) {
      return e.what();
    }
    return "no error";
  };
  Value k_short = g.input("k_short", {2, 4, 7, 16});
  CHECK(test::contains(error([&] { attention(q, k_short, v); }),
                       "attention(q f32[2, 4, 8, 16], k_short f32[2, 4, 7, 16], v f32[2, 4, 8, 16]): k and v may "
                       "differ from q only in their heads"));
  Value flat = g.input("flat", {16});
  CHECK(test::contains(error([&] { attention(flat, flat, flat); }), "at least 2 axes"));
  Value ids = g.input("ids", {2, 4, 8, 16}, i32);
  CHECK(test::contains(error([&] { attention(q, k, ids); }), "must be a float"));
  CHECK(test::contains(error([&] { attention(q, k, v, {.scale = std::numeric_limits<double>::infinity()}); }),
                       "is not finite"));
  // Under autocast it computes in bf16, like torch's SDPA; its gradient comes back in f32.
  Value o_bf;
  {
    auto bf = g.autocast();
    o_bf = attention(q, k, v);
  }
  CHECK(o_bf.dtype() == bf16);
  Value loss = sum(cast(o_bf, f32) * g.input("r", {2, 4, 8, 16}));
  const auto grads = gradients(loss, {q, k, v});
  for (const Value& d : grads) {
    CHECK(d.dtype() == f32);
    CHECK(d.shape() == q.shape());
  }
  // One gradient op for the three inputs.
  int grad_ops = 0;
  for (int id = 0; id < g.size(); ++id) grad_ops += g.node(id).op == "attention_grad";
  CHECK(grad_ops == 1);
}

// Megatron's attention block with the fused ops, sharded from annotations (wq, wk, wv and w1,
// b1 by columns; wo and w2 by rows): the heads axis carries the split through attention and the
// columns through bias_gelu, so each half needs one all-reduce, and values and gradients equal
// the logical graph's (float64: the same sums in another grouping, 1e-10).
TEST_CASE("Attention.Sharding.SplitByHeadsAndColumnsAsTheUnfusedBlock") {
  const std::int64_t b = 2, t = 5, d = 8, nh = 4, dh = d / nh;
  const Sbp cols = sbp::split(1), rows = sbp::split(0);
  for (int tp : {2, 4}) {
    CAPTURE(tp);
    Graph logical(9);
    auto x = logical.input("x", {b, t, d}, f64);
    auto w = [&](const char* name, Shape s, Sbp sig) {
      return logical.variable(name, std::move(s), init::normal(0.0, 0.3), sig, f64);
    };
    auto wq = w("wq", {d, d}, cols), wk = w("wk", {d, d}, cols), wv = w("wv", {d, d}, cols), wo = w("wo", {d, d}, rows);
    auto w1 = w("w1", {d, 2 * d}, cols), b1 = w("b1", {2 * d}, rows), w2 = w("w2", {2 * d, d}, rows);
    auto heads = [&](Value v) { return transpose(reshape(matmul(x, v), {b, t, nh, dh}), {0, 2, 1, 3}); };
    auto o = reshape(transpose(attention(heads(wq), heads(wk), heads(wv)), {0, 2, 1, 3}), {b, t, d});
    auto h = x + matmul(o, wo);
    Value y = (h + matmul(bias_gelu(matmul(h, w1), b1), w2)).named("y");
    Graph physical(9);
    ShardedGraph sharded = shard_graph(logical, physical, tp);
    REQUIRE(sharded.movements().size() == 2);
    for (const auto& m : sharded.movements()) CHECK(m.kind == Movement::all_reduce);

    Tensor feed = random_tensor(f64, {b, t, d});
    auto lp = ParameterStore::initialize(logical);
    auto pp = ParameterStore::initialize(physical);
    Value whole = sharded.whole(y);
    std::vector<Value> vars = physical.variables();
    std::vector<Value> fetch = gradients(sum(whole * whole), vars);
    fetch.push_back(whole);
    auto got = evaluate(physical, {{"x", feed}}, fetch, *pp);
    const std::vector<Value> weights{wq, wk, wv, wo, w1, b1, w2};
    std::vector<Value> want_fetch = gradients(sum(y * y), weights);
    want_fetch.push_back(y);
    auto want = evaluate(logical, {{"x", feed}}, want_fetch, *lp);
    CHECK_CLOSE(got.back(), want.back(), 1e-10);
    std::map<std::string, Tensor> grads;
    for (std::size_t i = 0; i < vars.size(); ++i) grads[vars[i].name()] = got[i];
    auto joined = join_parts(physical, grads);
    for (std::size_t i = 0; i < weights.size(); ++i) {
      CAPTURE(weights[i].name());
      REQUIRE(joined.count(weights[i].name()));
      CHECK_CLOSE(joined.at(weights[i].name()), want[i], 1e-10);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// CPU: bias + GELU

// ---------------------------------------------------------------------------------------------
// Grouped-query heads (Llama's GQA): k and v with fewer heads than q, read in place

namespace {

// k [..., Hkv, T, D] repeated to [..., Hkv rep, T, D], kv head j as heads [j rep, (j + 1) rep)
// (transformers' repeat_kv): what attention() spares the models.
Tensor repeat_heads(const Tensor& k, std::int64_t rep) {
  Shape s = k.shape();
  const std::size_t h = s.size() - 3;
  const auto block = static_cast<std::size_t>(s[h + 1] * s[h + 2]) * size_of(k.dtype());
  std::int64_t outer = 1;
  for (std::size_t i = 0; i < h; ++i) outer *= s[i];
  const std::int64_t heads = s[h];
  s[h] *= rep;
  Tensor out = Tensor::empty(s, k.dtype());
  const auto* from = static_cast<const char*>(k.raw());
  auto* to = static_cast<char*>(out.raw());
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t j = 0; j < heads; ++j) {
      for (std::int64_t r = 0; r < rep; ++r) {
        std::memcpy(to + static_cast<std::size_t>((o * heads + j) * rep + r) * block,
                    from + static_cast<std::size_t>(o * heads + j) * block, block);
      }
    }
  }
  return out;
}

// The gradient of repeat_heads: each kv head's `rep` heads of `g` summed, in double (f64).
Tensor sum_groups(const Tensor& g, const Shape& kv, std::int64_t rep) {
  const auto x = values(g);
  Tensor out = Tensor::zeros(kv, f64);
  auto o = out.data<double>();
  const std::size_t head = static_cast<std::size_t>(kv[kv.size() - 1] * kv[kv.size() - 2]);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::size_t flat_head = i / head;
    o[flat_head / static_cast<std::size_t>(rep) * head + i % head] += x[i];
  }
  return out;
}

// Elements [start, start + count) of a flat tensor, as f64.
Tensor flat_piece(const Tensor& t, std::int64_t start, std::int64_t count) {
  const auto x = values(t);
  Tensor out = Tensor::empty({count}, f64);
  std::copy_n(x.begin() + start, count, out.data<double>().begin());
  return out;
}

struct GqaCase {
  Shape q, kv;
  bool causal;
};

std::vector<GqaCase> gqa_cases() {
  // Two query heads a kv head, four (and T past a block), multi-query (one kv head), one axis
  // of heads alone ([H, T, D]); causal and not.
  return {{{2, 4, 17, 8}, {2, 2, 17, 8}, true},
          {{1, 8, 70, 4}, {1, 2, 70, 4}, true},
          {{2, 6, 9, 3}, {2, 1, 9, 3}, false},
          {{4, 33, 6}, {2, 33, 6}, true}};
}

}  // namespace

// Attention with grouped-query heads is attention over the repeated keys and values: the
// forward and dq are the same computation on the same values in the same order (the same
// bits); dk and dv are the sums of the repeated heads' gradients over each group. f64: exact
// formulas in double (1e-12). f32: the kernel adds the group's heads in double and rounds once,
// where the reference rounds each head's to float first: at most `rep` half-ulps, 1e-6 relative
// to the largest. The flat packed output and three apart give the same bits.
TEST_CASE("Attention.Cpu.GroupedQueryHeadsAreAttentionOverTheRepeatedKeysAndValues") {
  for (DType dt : {f64, f32}) {
    for (const GqaCase& c : gqa_cases()) {
      CAPTURE(name(dt));
      CAPTURE(to_string(c.q));
      CAPTURE(to_string(c.kv));
      const std::int64_t rep = c.q[c.q.size() - 3] / c.kv[c.kv.size() - 3];
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.q.back()));
      const Attrs attrs = attention_attrs(c.causal, scale);
      const Tensor q = random_tensor(dt, c.q), k = random_tensor(dt, c.kv), v = random_tensor(dt, c.kv);
      const Tensor dout = random_tensor(dt, c.q);
      const Tensor k_rep = repeat_heads(k, rep), v_rep = repeat_heads(v, rep);
      const auto fwd = run_cpu("attention", dt, attrs, {q, k, v}, {c.q, attention_stats_shape(c.q)});
      const auto fwd_rep = run_cpu("attention", dt, attrs, {q, k_rep, v_rep}, {c.q, attention_stats_shape(c.q)});
      CHECK(difference(fwd[0], fwd_rep[0]).error == 0);
      CHECK(difference(fwd[1], fwd_rep[1]).error == 0);
      const std::vector<Tensor> args{q, k, v, fwd[0], dout, fwd[1]};
      const Tensor flat = run1("attention_grad", dt, attrs, args, attention_grad_shape(c.q, c.kv));
      REQUIRE(flat.shape() == Shape{numel(c.q) + 2 * numel(c.kv)});
      const auto apart = run_cpu("attention_grad", dt, attrs, args, {c.q, c.kv, c.kv});
      const Tensor want = run1("attention_grad", dt, attrs, {q, k_rep, v_rep, fwd[0], dout, fwd[1]}, packed(c.q));
      CHECK(difference(apart[0], unpack(want, 0)).error == 0);
      const double tol = dt == f64 ? 1e-12 : 1e-6;
      CHECK_CLOSE(apart[1], sum_groups(unpack(want, 1), c.kv, rep), tol);
      CHECK_CLOSE(apart[2], sum_groups(unpack(want, 2), c.kv, rep), tol);
      const std::int64_t nq = numel(c.q), nk = numel(c.kv);
      CHECK(difference(flat_piece(flat, 0, nq), apart[0]).error == 0);
      CHECK(difference(flat_piece(flat, nq, nk), apart[1]).error == 0);
      CHECK(difference(flat_piece(flat, nq + nk, nk), apart[2]).error == 0);
    }
  }
  // Shapes that do not go together are refused naming what is wrong.
  const Shape q{1, 4, 8, 4};
  const Tensor a = random_tensor(f32, q), three = random_tensor(f32, {1, 3, 8, 4}), longer = random_tensor(f32, {1, 2, 9, 4});
  const Attrs attrs = attention_attrs(true, 0.5);
  CHECK_THROWS_WITH_AS(run1("attention", f32, attrs, {a, three, three}, q), doctest::Contains("not a multiple of k's and v's 3"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(run1("attention", f32, attrs, {a, longer, longer}, q), doctest::Contains("only in their heads"),
                       std::invalid_argument);
  const Tensor two = random_tensor(f32, {1, 2, 8, 4});
  CHECK_THROWS_WITH_AS(run_cpu("attention_grad", f32, attrs, {a, two, two, a, a}, {q, q, q}),
                       doctest::Contains("must have k's 64 elements"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(run_cpu("attention_grad", f32, attrs, {a, two, two, a, a}, {packed(q)}),
                       doctest::Contains("must be [256] (dq, dk and dv one after another)"), std::invalid_argument);
}

// The graph's attention takes grouped-query heads, and autodiff's gradients through it (one
// attention_grad, its flat output sliced and reshaped) equal those through the unfused ops over
// repeated keys and values (reshape, broadcast_to, reshape: transformers' repeat_kv), in double
// (exact formulas in another order: 1e-12).
TEST_CASE("Attention.Graph.GroupedQueryHeadsGradientsMatchTheRepeatedUnfusedOps") {
  for (const GqaCase& c : gqa_cases()) {
    CAPTURE(to_string(c.q));
    CAPTURE(to_string(c.kv));
    std::map<std::string, Tensor> feeds{{"q", random_tensor(f64, c.q)}, {"k", random_tensor(f64, c.kv)},
                                        {"v", random_tensor(f64, c.kv)}, {"r", random_tensor(f64, c.q)}};
    const auto fused = attention_grads(c.q, c.kv, c.causal, 0.6, true, feeds);
    const auto naive = attention_grads(c.q, c.kv, c.causal, 0.6, false, feeds);
    for (std::size_t i = 0; i < 4; ++i) {
      CAPTURE(i);  // dq, dk, dv, o
      CHECK_CLOSE(fused[i], naive[i], 1e-12);
    }
  }
  Graph g;
  Value q = g.input("q", {2, 4, 8, 16}), k3 = g.input("k3", {2, 3, 8, 16}), k2 = g.input("k2", {2, 2, 8, 16});
  auto error = [](auto&& f) { return test::thrown_message<GraphError>(f); };
  CHECK(attention(q, k2, k2).shape() == q.shape());
  CHECK(test::contains(error([&] { attention(q, k3, k3); }), "q's 4 heads are not a multiple of k's and v's 3"));
  CHECK(test::contains(error([&] { attention(q, k2, k3); }), "v must have k's shape"));
  Value none = g.input("none", {2, 0, 8, 16});
  CHECK(test::contains(error([&] { attention(none, k2, k2); }), "k and v have more heads (2) than q (0)"));
  Value q2 = g.input("q2", {8, 16}), k1 = g.input("k1", {4, 16});
  CHECK(test::contains(error([&] { attention(q2, k1, k1); }), "or [..., Hkv, T, D]"));
}

// The Llama with fused attention hands attention its kv heads as they are: no repeat (no
// broadcast_to actor), dk and dv come out of attention_grad at k's size into registers of their
// own, and it trains as the Llama that repeats them (naive attention) in float64 (the same
// formulas in another order: 1e-9 relative over 3 Adam steps).
TEST_CASE("Attention.Plan.TheLlamaReadsGroupedKvHeadsWithoutRepeatingThem" * doctest::timeout(120)) {
  auto corpus = std::make_shared<data::TextCorpus>();
  corpus->vocab.assign(32, static_cast<unsigned char>('x'));
  std::mt19937 gen(11);
  for (int i = 0; i < 4096; ++i) corpus->ids.push_back(static_cast<std::int32_t>(gen() % 32));
  auto run = [&](models::GptShape::Attention attention, bool inspect) {
    Graph g(5);
    const models::LlamaShape shape{.vocab = 32, .seq = 16, .d_model = 32, .heads = 4, .kv_heads = 2, .ffn_hidden = 32,
                                   .layers = 2, .attention = attention, .dtype = f64};
    models::Outputs out = models::llama_with_loss(g, 4, shape);
    TrainConfig cfg;
    cfg.steps = 3;
    cfg.optimizer = optim::adam(3e-3);
    cfg.data = {{"text", data::text_source(corpus, 4, 1, 16, 3), {"tokens", "targets"}}};
    TrainingJob job = compile_training(g, out.loss, cfg);
    if (inspect) {
      int grads = 0;
      for (const ActorDesc& a : job.plan.actors) {
        CHECK(a.op != "broadcast_to");
        if (a.op == "attention") CHECK(job.plan.registers[a.inputs[1].reg].shape == Shape{4, 2, 16, 8});
        if (a.op != "attention_grad") continue;
        ++grads;
        REQUIRE(a.outputs.size() == 3);
        CHECK(numel(job.plan.registers[a.outputs[0]].shape) == 4 * 4 * 16 * 8);
        CHECK(numel(job.plan.registers[a.outputs[1]].shape) == 4 * 2 * 16 * 8);
        CHECK(numel(job.plan.registers[a.outputs[2]].shape) == 4 * 2 * 16 * 8);
        for (RegisterIndex r : a.outputs) {
          for (ActorIndex reader : job.plan.registers[r].consumers) CHECK(job.plan.actors[reader].op != "slice");
        }
      }
      CHECK(grads == 2);
    }
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(30'000);
    Runtime(job.plan, job.kernels, rs).run();
    return job.losses->per_step();
  };
  const auto grouped = run(models::GptShape::Attention::fused, true);
  const auto repeated = run(models::GptShape::Attention::naive, false);
  REQUIRE(grouped.size() == 3);
  REQUIRE(repeated.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(grouped[i] == doctest::Approx(repeated[i]).epsilon(1e-9));
  }
}

// gelu(x + b) fused: the sum rounded to the element type as the add's output is, then the gelu
// kernel's formula: the same bits as the two ops, forward and backward.
TEST_CASE("BiasGelu.Cpu.IsGeluOfTheSumBitForBit") {
  for (const Attrs& a : {Attrs{}, Attrs{{"approximate", std::string("tanh")}}}) {
    for (DType dt : {f32, f64}) {
      CAPTURE(a.str());
      CAPTURE(name(dt));
      const Shape s{3, 5, 37};
      const Tensor x = random_tensor(dt, s, -4, 4), b = random_tensor(dt, {37}), dy = random_tensor(dt, s);
      const Tensor sum = run1("add", dt, {}, {x, b}, s);
      CHECK_CLOSE(run1("bias_gelu", dt, a, {x, b}, s), run1("gelu", dt, a, {sum}, s), 0.0);
      CHECK_CLOSE(run1("bias_gelu_grad", dt, a, {x, b, dy}, s), run1("gelu_grad", dt, a, {sum, dy}, s), 0.0);
    }
  }
  // The two forms differ (by up to about 5e-4 near |x| = 2): the attribute reaches the kernel.
  const Tensor x = random_tensor(f64, {64}, -4, 4), b = random_tensor(f64, {64});
  const auto erf = values(run1("bias_gelu", f64, {}, {x, b}, {64}));
  const auto tanh = values(run1("bias_gelu", f64, Attrs{{"approximate", std::string("tanh")}}, {x, b}, {64}));
  double most = 0;
  for (std::size_t i = 0; i < erf.size(); ++i) most = std::max(most, std::abs(erf[i] - tanh[i]));
  CHECK(most > 1e-5);
  CHECK(most < 1e-3);
  CHECK_THROWS_WITH_AS(run1("bias_gelu", f32, Attrs{{"approximate", std::string("sigmoid")}},
                            {random_tensor(f32, {4, 6}), random_tensor(f32, {6})}, {4, 6}),
                       doctest::Contains("attribute approximate must be \"none\" or \"tanh\", not \"sigmoid\""),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(run1("bias_gelu", f32, {}, {random_tensor(f32, {4, 6}), random_tensor(f32, {5})}, {4, 6}),
                       doctest::Contains("must be [F] for x f32[4, 6]"), std::invalid_argument);
}

TEST_CASE("BiasGelu.Graph.GradientsMatchTheUnfusedOps") {
  // Through autodiff: d/dx and d/db (the column sums) equal the unfused graph's, bit for bit in
  // f32 and f64 (the same kernels' arithmetic in the same order).
  for (DType dt : {f32, f64}) {
    CAPTURE(name(dt));
    const Shape s{6, 11};
    std::map<std::string, Tensor> feeds{{"x", random_tensor(dt, s)}, {"b", random_tensor(dt, {11})},
                                        {"r", random_tensor(dt, s)}};
    auto run = [&](bool fused, GeluApprox form) {
      Graph g(1);
      Value x = g.input("x", s, dt), b = g.input("b", {11}, dt);
      Value y = fused ? bias_gelu(x, b, form) : gelu(x + b, form);
      Value loss = sum(y * g.input("r", s, dt));
      std::vector<Value> fetch = gradients(loss, {x, b});
      fetch.push_back(y);
      auto params = ParameterStore::initialize(g);
      return evaluate(g, feeds, fetch, *params);
    };
    for (GeluApprox form : {GeluApprox::none, GeluApprox::tanh}) {
      CAPTURE(static_cast<int>(form));
      const auto fused = run(true, form), naive = run(false, form);
      for (std::size_t i = 0; i < 3; ++i) {
        CAPTURE(i);  // dx, db, y
        CHECK_CLOSE(fused[i], naive[i], 0.0);
      }
    }
  }
  Graph g;
  Value x = g.input("x", {4, 8}), w = g.input("w", {8, 8}), b = g.input("b", {8});
  CHECK_THROWS_WITH_AS(bias_gelu(x, g.input("b7", {7})), doctest::Contains("b must be one bias per column of x: [8]"),
                       GraphError);
  // Under autocast the bias joins the product's bf16, as torch's Linear casts its bias.
  auto bf = g.autocast();
  Value y = bias_gelu(matmul(x, w), b);
  CHECK(y.dtype() == bf16);
}

// ---------------------------------------------------------------------------------------------
// CPU: the GPT with the fused ops

namespace {

struct GptRun {
  std::vector<Tensor> grads;  // of every variable, in g.variables() order
  double loss = 0;
};

GptRun gpt_loss_and_grads(models::GptShape shape, std::int64_t batch, const std::map<std::string, Tensor>& feeds) {
  Graph g(11);
  models::Outputs out = models::gpt_with_loss(g, batch, shape);
  std::vector<Value> fetch = gradients(out.loss, g.variables());
  fetch.push_back(out.loss);
  auto params = ParameterStore::initialize(g);
  std::vector<Tensor> got = evaluate(g, feeds, fetch, *params);
  GptRun r;
  r.loss = got.back().data<float>()[0];
  got.pop_back();
  r.grads = std::move(got);
  return r;
}

std::map<std::string, Tensor> gpt_feeds(std::int64_t vocab, std::int64_t batch, std::int64_t seq) {
  Tensor tokens = Tensor::empty({batch, seq}, i32), targets = Tensor::empty({batch * seq}, i32);
  std::uniform_int_distribution<int> u(0, static_cast<int>(vocab) - 1);
  for (auto& t : tokens.data<std::int32_t>()) t = u(rng());
  for (auto& t : targets.data<std::int32_t>()) t = u(rng());
  return {{"tokens", tokens}, {"targets", targets}};
}

}  // namespace

// The same weights and tokens: the fused MLP activation gives the unfused GPT's loss and
// gradients bit for bit (f32); the fused attention gives them to float32 rounding (its sums run
// in double, the unfused ops' in float: 1e-4 relative to the largest gradient of each weight).
TEST_CASE("Gpt.FusedOpsGiveTheUnfusedLossAndGradients" * doctest::timeout(120)) {
  const models::GptShape base{.vocab = 40, .seq = 12, .d_model = 16, .heads = 2, .layers = 2};
  const auto feeds = gpt_feeds(base.vocab, 3, base.seq);
  models::GptShape unfused = base, bias_gelu_only = base, all = base;
  unfused.fused_bias_gelu = false;
  all.attention = models::GptShape::Attention::fused;
  const GptRun a = gpt_loss_and_grads(unfused, 3, feeds);
  const GptRun b = gpt_loss_and_grads(bias_gelu_only, 3, feeds);
  const GptRun c = gpt_loss_and_grads(all, 3, feeds);
  CHECK(b.loss == a.loss);
  REQUIRE(a.grads.size() == b.grads.size());
  REQUIRE(a.grads.size() == c.grads.size());
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    CAPTURE(i);
    CHECK_CLOSE(b.grads[i], a.grads[i], 0.0);
    CHECK_CLOSE(c.grads[i], a.grads[i], 1e-4);
  }
  CHECK(c.loss == doctest::Approx(a.loss).epsilon(1e-6));
}

// The whole path (compiler, runtime, Adam) with the fused attention on the CPU: ten steps give
// the unfused run's losses to float32 rounding compounded over the steps.
TEST_CASE("Gpt.FusedAttentionTrainsAsTheUnfusedOnTheCpu" * doctest::timeout(120)) {
  auto corpus = std::make_shared<data::TextCorpus>();
  corpus->vocab.assign(24, static_cast<unsigned char>('x'));
  std::mt19937 gen(5);
  for (int i = 0; i < 4096; ++i) corpus->ids.push_back(static_cast<std::int32_t>(gen() % 24));
  auto run = [&](models::GptShape::Attention attention) {
    Graph g(3);
    models::Outputs out = models::gpt_with_loss(
        g, 4, {.vocab = 24, .seq = 16, .d_model = 16, .heads = 2, .layers = 1, .attention = attention});
    TrainConfig cfg;
    cfg.steps = 10;
    cfg.optimizer = optim::adam(3e-3);
    cfg.data = {{"text", data::text_source(corpus, 4, 1, 16, 3), {"tokens", "targets"}}};
    TrainingJob job = compile_training(g, out.loss, cfg);
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(30'000);
    Runtime(job.plan, job.kernels, rs).run();
    return job.losses->per_step();
  };
  const auto naive = run(models::GptShape::Attention::naive), fused = run(models::GptShape::Attention::fused);
  REQUIRE(naive.size() == 10);
  REQUIRE(fused.size() == 10);
  for (std::size_t i = 0; i < naive.size(); ++i) {
    CAPTURE(i);
    CHECK(fused[i] == doctest::Approx(naive[i]).epsilon(1e-4));
  }
}

// ---------------------------------------------------------------------------------------------
// GPU halves

namespace {

// One device, its stream and memory, for running single kernels outside a runtime.
struct Gpu {
  std::unique_ptr<cuda::Stream> stream = cuda::Stream::create(Device::parse("cuda:0"), "test_cuda_kernels");
  std::unique_ptr<Allocator> memory = cuda::make_device_allocator(Device::parse("cuda:0"));

  Tensor to_device(const Tensor& host) {
    Tensor d = Tensor::empty(host.shape(), host.dtype(), *memory);
    cuda::copy(d, host, *stream);
    return d;
  }
  Tensor to_host(const Tensor& dev) {
    Tensor h = Tensor::empty(dev.shape(), dev.dtype());
    cuda::copy(h, dev, *stream);
    stream->synchronize();
    return h;
  }
  // Every byte 0xff: NaN in f32, f64 and bf16, so an element a kernel forgot shows.
  Tensor poisoned(const Shape& s, DType t) {
    Tensor h = Tensor::empty(s, t);
    std::memset(h.raw(), 0xff, h.nbytes());
    return to_device(h);
  }
  // Runs `op` for `dt` on cuda:0 on copies of `inputs`; returns the outputs on the host. The
  // outputs are of `dt` unless `out_dtypes` names each one's.
  std::vector<Tensor> run(const std::string& op, DType dt, const Attrs& attrs, const std::vector<Tensor>& inputs,
                          const std::vector<Shape>& outputs, const std::vector<DType>& out_dtypes = {}) {
    auto kernel = registry().create(op, KernelConfig{"cuda." + op, Device::parse("cuda:0"), dt, attrs});
    std::vector<Tensor> dev_in;
    for (const Tensor& t : inputs) dev_in.push_back(to_device(t));
    std::vector<const Tensor*> in;
    for (const Tensor& t : dev_in) in.push_back(&t);
    std::vector<Tensor> out;
    for (std::size_t i = 0; i < outputs.size(); ++i) out.push_back(poisoned(outputs[i], out_dtypes.empty() ? dt : out_dtypes[i]));
    std::vector<Tensor*> out_p;
    for (Tensor& t : out) out_p.push_back(&t);
    KernelContext ctx{in, out_p, 0, stream.get()};
    kernel->compute(ctx);
    std::vector<Tensor> back;
    for (const Tensor& t : out) back.push_back(to_host(t));
    return back;
  }
  Tensor run1(const std::string& op, DType dt, const Attrs& attrs, const std::vector<Tensor>& inputs, const Shape& out) {
    return run(op, dt, attrs, inputs, {out})[0];
  }
};

// `op` on cuda:0 against the CPU's kernel for the same dtype, every output within `tolerance`.
void check_against_cpu(Gpu& gpu, const std::string& op, DType dt, const Attrs& attrs, const std::vector<Tensor>& inputs,
                       const std::vector<Shape>& outputs, double tolerance) {
  CAPTURE(op);
  CAPTURE(name(dt));
  CAPTURE(attrs.str());
  const auto want = run_cpu(op, dt, attrs, inputs, outputs);
  const auto got = gpu.run(op, dt, attrs, inputs, outputs);
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    CAPTURE(o);
    CHECK_CLOSE(got[o], want[o], tolerance);
  }
}

}  // namespace

// The native bf16 kernels against the CPU's bf16 (its float32 kernel on converted copies, one
// rounding at the end). Both compute in float32 from the same bf16 inputs; the float32 results
// agree to 1e-5 (Cuda.Kernels.MatchCpu) and then round to bf16, where a result near a rounding
// boundary may land one bf16 ulp (2^-8 of its magnitude, 2^-7 at worst) apart: 1e-2 relative to
// the largest element. The byte moves must agree exactly.
TEST_CASE("CudaKernels.Bf16.MatchCpu" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  const double rounding = 1e-2, exact = 0.0;
  auto r = [](const Shape& s, double lo = -2, double hi = 2) { return random_tensor(bf16, s, lo, hi); };
  SUBCASE("casts round as the CPU does, bit for bit (four at a time, and one at a time)") {
    for (std::int64_t n : {4096, 4099}) {
      check_against_cpu(gpu, "cast", bf16, {}, {random_tensor(f32, {n}, -300, 300)}, {{n}}, exact);
      check_against_cpu(gpu, "cast", f32, {}, {r({n}, -300, 300)}, {{n}}, exact);
    }
  }
  SUBCASE("elementwise with broadcasting") {
    for (const char* op : {"add", "sub", "mul", "maximum"}) {
      check_against_cpu(gpu, op, bf16, {}, {r({5, 7}), r({5, 7})}, {{5, 7}}, rounding);
      check_against_cpu(gpu, op, bf16, {}, {r({4, 5, 7}), r({7})}, {{4, 5, 7}}, rounding);        // a bias
      check_against_cpu(gpu, op, bf16, {}, {r({7}), r({4, 5, 7})}, {{4, 5, 7}}, rounding);        // on the left
      check_against_cpu(gpu, op, bf16, {}, {r({4, 1, 7}), r({5, 1})}, {{4, 5, 7}}, rounding);     // strided
      check_against_cpu(gpu, op, bf16, {}, {r({300, 1000}), r({1000})}, {{300, 1000}}, rounding);  // many blocks
    }
    check_against_cpu(gpu, "div", bf16, {}, {r({6, 9}), r({9}, 0.5, 2)}, {{6, 9}}, rounding);
  }
  SUBCASE("activations, their gradients and scale") {
    const Shape s{13, 37};
    for (const char* op : {"relu", "gelu", "tanh", "sigmoid"}) check_against_cpu(gpu, op, bf16, {}, {r(s, -4, 4)}, {s}, rounding);
    for (const char* op : {"relu_grad", "gelu_grad"}) check_against_cpu(gpu, op, bf16, {}, {r(s, -4, 4), r(s)}, {s}, rounding);
    for (const char* op : {"tanh_grad", "sigmoid_grad"}) check_against_cpu(gpu, op, bf16, {}, {r(s, 0, 1), r(s)}, {s}, rounding);
    check_against_cpu(gpu, "scale", bf16, Attrs{{"value", 0.37}}, {r({100})}, {{100}}, rounding);
    check_against_cpu(gpu, "fill", bf16, Attrs{{"value", -1.5}}, {}, {{3, 3}}, exact);
  }
  SUBCASE("layer norm, softmax and log-softmax, forward and backward") {
    // Rows of 1, 2, 4 and 8 elements a thread held in registers (layer norm), and longer.
    for (std::int64_t cols : {7, 300, 1000, 2048, 2049}) {
      const Shape s{17, cols};
      check_against_cpu(gpu, "softmax", bf16, {}, {r(s, -5, 5)}, {s}, rounding);
      check_against_cpu(gpu, "log_softmax", bf16, {}, {r(s, -5, 5)}, {s}, rounding);
      check_against_cpu(gpu, "softmax_grad", bf16, {}, {r(s, 0, 1), r(s)}, {s}, rounding);
      check_against_cpu(gpu, "log_softmax_grad", bf16, {}, {r(s, -3, 0), r(s)}, {s}, rounding);
      check_against_cpu(gpu, "layer_norm", bf16, Attrs{{"eps", 1e-5}}, {r(s, -3, 5)}, {s}, rounding);
      check_against_cpu(gpu, "layer_norm_grad", bf16, Attrs{{"eps", 1e-5}}, {r(s, -3, 5), r(s)}, {s}, rounding);
    }
    check_against_cpu(gpu, "causal_mask", bf16, Attrs{{"value", -1e9}}, {r({2, 6, 6})}, {{2, 6, 6}}, exact);
  }
  SUBCASE("byte moves and sum_to") {
    auto ints = [](std::int64_t axis, std::int64_t start) { return Attrs{{"axis", axis}, {"start", start}}; };
    check_against_cpu(gpu, "transpose", bf16, Attrs{{"perm", std::vector<std::int64_t>{0, 2, 1, 3}}}, {r({2, 3, 4, 5})},
                      {{2, 4, 3, 5}}, exact);
    check_against_cpu(gpu, "reshape", bf16, {}, {r({6, 4})}, {{4, 6}}, exact);
    check_against_cpu(gpu, "stop_gradient", bf16, {}, {r({6, 4})}, {{6, 4}}, exact);
    check_against_cpu(gpu, "copy", bf16, {}, {r({33})}, {{33}}, exact);
    check_against_cpu(gpu, "broadcast_to", bf16, {}, {r({4, 1})}, {{2, 4, 3}}, exact);
    check_against_cpu(gpu, "slice", bf16, ints(1, 2), {r({5, 7, 3})}, {{5, 3, 3}}, exact);
    check_against_cpu(gpu, "slice", bf16, ints(-1, 5), {r({6, 11})}, {{6, 4}}, exact);
    check_against_cpu(gpu, "slice_grad", bf16, ints(1, 2), {r({5, 3, 3})}, {{5, 7, 3}}, exact);
    check_against_cpu(gpu, "concat", bf16, Attrs{{"axis", std::int64_t{1}}}, {r({4, 2, 3}), r({4, 5, 3})}, {{4, 7, 3}},
                      exact);
    // Sums in double, rounded once: the bf16 rounding alone.
    check_against_cpu(gpu, "sum_to", bf16, {}, {r({64, 10})}, {{10}}, rounding);
    check_against_cpu(gpu, "sum_to", bf16, {}, {r({3000, 40})}, {{40}}, rounding);
    check_against_cpu(gpu, "sum_to", bf16, {}, {r({3, 4, 5})}, {{3, 1, 5}}, rounding);
  }
  SUBCASE("embedding") {
    Tensor ids = Tensor::empty({4, 9}, i32);
    std::uniform_int_distribution<int> u(0, 49);
    for (auto& x : ids.data<std::int32_t>()) x = u(rng());
    check_against_cpu(gpu, "embedding", bf16, {}, {r({50, 16}), ids}, {{4, 9, 16}}, exact);
  }
  SUBCASE("registered as bf16 kernels, not the float32 fallback") {
    for (const char* op : {"add", "gelu", "gelu_grad", "layer_norm", "layer_norm_grad", "softmax", "softmax_grad",
                           "transpose", "reshape", "slice", "concat", "sum_to", "broadcast_to", "scale", "bias_gelu",
                           "bias_gelu_grad", "attention", "attention_grad"}) {
      CAPTURE(std::string(op));
      // describe() starts its first op without a newline: put one before it.
      CHECK(test::contains("\n" + registry().describe(), fmt::format("\n{}:", op)));
      const std::string line = [&] {
        const std::string all = "\n" + registry().describe() + "\n";
        const auto at = all.find(fmt::format("\n{}:", op));
        return all.substr(at + 1, all.find('\n', at + 1) - at - 1);
      }();
      CHECK(test::contains(line, "cuda/bf16"));
    }
  }
}

// bias_gelu on the GPU: f32 gives the GPU's own gelu(add(x, b)) bit for bit (the same
// arithmetic) and the CPU's to 1e-5 (the f32 kernels' agreement); bf16 within one bf16 rounding
// of the CPU's (1e-2, see CudaKernels.Bf16.MatchCpu).
TEST_CASE("CudaKernels.BiasGelu.MatchCpu" * doctest::timeout(60)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  // Both forms: the exact erf GELU and the tanh approximation (attribute "approximate").
  for (const Attrs& a : {Attrs{}, Attrs{{"approximate", std::string("tanh")}}}) {
    CAPTURE(a.str());
    for (const Shape& s : {Shape{3, 5, 37}, Shape{257, 1024}}) {
      const Shape bias{s.back()};
      const Tensor x = random_tensor(f32, s, -4, 4), b = random_tensor(f32, bias), dy = random_tensor(f32, s);
      check_against_cpu(gpu, "bias_gelu", f32, a, {x, b}, {s}, 1e-5);
      check_against_cpu(gpu, "bias_gelu_grad", f32, a, {x, b, dy}, {s}, 1e-5);
      check_against_cpu(gpu, "gelu", f32, a, {x}, {s}, 1e-5);
      check_against_cpu(gpu, "gelu_grad", f32, a, {x, dy}, {s}, 1e-5);
      const Tensor sum = gpu.run1("add", f32, {}, {x, b}, s);
      CHECK_CLOSE(gpu.run1("bias_gelu", f32, a, {x, b}, s), gpu.run1("gelu", f32, a, {sum}, s), 0.0);
      CHECK_CLOSE(gpu.run1("bias_gelu_grad", f32, a, {x, b, dy}, s), gpu.run1("gelu_grad", f32, a, {sum, dy}, s), 0.0);
      const Tensor xb = to_dtype(x, bf16), bb = to_dtype(b, bf16), dyb = to_dtype(dy, bf16);
      check_against_cpu(gpu, "bias_gelu", bf16, a, {xb, bb}, {s}, 1e-2);
      check_against_cpu(gpu, "bias_gelu_grad", bf16, a, {xb, bb, dyb}, {s}, 1e-2);
    }
  }
}

// The packed kernels (kernels/src/cuda/vec.cuh: a thread per 16 bytes where the pointers and
// sizes allow) give the one-element kernels' bits: the same inputs with one element more take
// the one-element path, and the elements both have must be the same bytes. The transposes and
// broadcasts that move whole rows of packs (the attention heads' permute) against the CPU,
// exactly, with shapes whose rows are and are not whole packs.
TEST_CASE("CudaKernels.Packed.GiveTheOneElementKernelsBits" * doctest::timeout(60)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  const std::int64_t n = 4096;  // whole packs: 4 float32 or 8 bf16 elements each
  auto prefix = [](const Tensor& t, std::int64_t count) {
    Tensor r = Tensor::empty({count}, t.dtype());
    std::memcpy(r.raw(), t.raw(), r.nbytes());
    return r;
  };
  auto same_bits = [&](const Tensor& packed, const Tensor& single) {
    REQUIRE(packed.numel() == n);
    const auto a = values(packed), b = values(single);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(double)) != 0;
    CHECK(differ == 0);
  };
  for (DType dt : {f32, bf16}) {
    CAPTURE(name(dt));
    const Tensor x1 = random_tensor(dt, {n + 1}, -4, 4), y1 = random_tensor(dt, {n + 1}, 0.5, 2);
    const Tensor p1 = random_tensor(dt, {n + 1}, 0.05, 0.95);  // tanh and sigmoid outputs
    const Tensor x = prefix(x1, n), y = prefix(y1, n), p = prefix(p1, n);
    for (const char* op : {"add", "sub", "mul", "div", "maximum"}) {
      CAPTURE(op);
      same_bits(gpu.run1(op, dt, {}, {x, y}, {n}), gpu.run1(op, dt, {}, {x1, y1}, {n + 1}));
    }
    for (const char* op : {"relu", "gelu", "tanh", "sigmoid"}) {
      CAPTURE(op);
      same_bits(gpu.run1(op, dt, {}, {x}, {n}), gpu.run1(op, dt, {}, {x1}, {n + 1}));
    }
    same_bits(gpu.run1("scale", dt, Attrs{{"value", 0.37}}, {x}, {n}),
              gpu.run1("scale", dt, Attrs{{"value", 0.37}}, {x1}, {n + 1}));
    for (const char* op : {"relu_grad", "gelu_grad"}) {
      CAPTURE(op);
      same_bits(gpu.run1(op, dt, {}, {x, y}, {n}), gpu.run1(op, dt, {}, {x1, y1}, {n + 1}));
    }
    for (const char* op : {"tanh_grad", "sigmoid_grad"}) {
      CAPTURE(op);
      same_bits(gpu.run1(op, dt, {}, {p, y}, {n}), gpu.run1(op, dt, {}, {p1, y1}, {n + 1}));
    }
    // A bias of 64 columns (whole packs) against one of 63 (not): each against the CPU, and the
    // packed bias_gelu against the packed gelu(add) bit for bit (float32: the same arithmetic).
    const double tolerance = dt == f32 ? 1e-5 : 1e-2;
    for (std::int64_t cols : {64, 63}) {
      CAPTURE(cols);
      const Shape s{32, cols};
      const Tensor a = random_tensor(dt, s, -4, 4), b = random_tensor(dt, {cols}), g = random_tensor(dt, s);
      check_against_cpu(gpu, "add", dt, {}, {a, b}, {s}, tolerance);
      check_against_cpu(gpu, "mul", dt, {}, {b, a}, {s}, tolerance);
      check_against_cpu(gpu, "bias_gelu", dt, {}, {a, b}, {s}, tolerance);
      check_against_cpu(gpu, "bias_gelu_grad", dt, {}, {a, b, g}, {s}, tolerance);
      if (dt == f32) {
        const Tensor sum = gpu.run1("add", dt, {}, {a, b}, s);
        CHECK_CLOSE(gpu.run1("bias_gelu", dt, {}, {a, b}, s), gpu.run1("gelu", dt, {}, {sum}, s), 0.0);
        CHECK_CLOSE(gpu.run1("bias_gelu_grad", dt, {}, {a, b, g}, s), gpu.run1("gelu_grad", dt, {}, {sum, g}, s), 0.0);
      }
    }
    const Attrs heads{{"perm", std::vector<std::int64_t>{0, 2, 1, 3}}};
    auto r = [&](const Shape& s) { return random_tensor(dt, s); };
    check_against_cpu(gpu, "transpose", dt, heads, {r({2, 16, 4, 64})}, {{2, 4, 16, 64}}, 0.0);  // rows of packs
    check_against_cpu(gpu, "transpose", dt, heads, {r({2, 5, 3, 12})}, {{2, 3, 5, 12}}, 0.0);  // f32 packs, bf16 not
    check_against_cpu(gpu, "transpose", dt, Attrs{{"perm", std::vector<std::int64_t>{1, 0, 2}}}, {r({3, 5, 16})},
                      {{5, 3, 16}}, 0.0);
    check_against_cpu(gpu, "transpose", dt, Attrs{{"perm", std::vector<std::int64_t>{1, 0}}}, {r({24, 40})},
                      {{40, 24}}, 0.0);  // the last axis moves: one element a thread
    check_against_cpu(gpu, "broadcast_to", dt, {}, {r({1, 64})}, {{8, 64}}, 0.0);
    check_against_cpu(gpu, "broadcast_to", dt, {}, {r({8, 1, 32})}, {{8, 3, 32}}, 0.0);
    check_against_cpu(gpu, "broadcast_to", dt, {}, {r({64})}, {{8, 64}}, 0.0);
  }
}

// The graphs of cuDNN's attention, built and finalized by cuDNN without a device: every tensor
// and operation descriptor, and the operation graphs (cuDNN 9.8 and later), for the shapes the
// GPU tests and the benchmark use, on Hopper (90) and Ampere (80). What is left for a GPU: the
// engines' heuristics and plans, and the numbers (CudaKernels.Attention.Cudnn*).
TEST_CASE("Cudnn.AttentionGraphsFinalizeWithoutADevice") {
  if (!test::cuda_built()) return;
  if (const cuda::CudnnAttention& c = cuda::cudnn_attention(); !c.ok) {
    test::skip(test::Missing::cudnn, c.reason + "; cuDNN tests skipped");
    return;
  }
  struct Case {
    std::int64_t b, h, s, d;
    bool causal;
  };
  for (const Case& c : {Case{1, 1, 2, 64, true}, Case{2, 3, 17, 64, true}, Case{1, 2, 100, 64, false},
                        Case{2, 1, 257, 128, true}, Case{2, 2, 64, 32, true}, Case{32, 16, 1024, 64, true}}) {
    for (int sm : {90, 80}) {
      CAPTURE(sm);
      INFO("b " << c.b << " h " << c.h << " s " << c.s << " d " << c.d << (c.causal ? " causal" : " full"));
      CHECK(cuda::cudnn_attention_check(c.b, c.h, c.s, c.d, c.causal, sm) == "");
    }
  }
  // Grouped-query heads (the Llama's: 2 and 4 query heads a kv head, and multi-query), whose
  // backward adds each group's heads' dK and dV in a reduction node.
  for (const Case& c : {Case{2, 4, 64, 64, true}, Case{1, 8, 100, 128, true}, Case{32, 16, 1024, 64, true}}) {
    for (std::int64_t h_kv : {c.h / 2, c.h / 4, std::int64_t{1}}) {
      INFO("b " << c.b << " h " << c.h << " h_kv " << h_kv << " s " << c.s << " d " << c.d);
      CHECK(cuda::cudnn_attention_check(c.b, c.h, c.s, c.d, c.causal, 90, h_kv) == "");
    }
  }
  // A shape cuDNN's attention does not take is refused with the reason.
  CHECK(!cuda::cudnn_attention_check(1, 1, 16, 12, true).empty());
  CHECK(!cuda::cudnn_attention_check(1, 4, 16, 64, true, 90, 3).empty());
}

// Whether cuDNN's fused attention can run here; if not, skips ("<reason>; cuDNN tests skipped").
bool cudnn_usable() {
  if (!cuda_usable()) return false;
  const cuda::CudnnAttention& c = cuda::cudnn_attention();
  if (!c.ok) test::skip(test::Missing::cudnn, c.reason + "; cuDNN tests skipped");
  return c.ok;
}

// Runs attention (outputs o and its stats) or attention_grad (inputs q, k, v, o, do, stats) on
// cuda:0 with attrs' kernel; the stats are f32 whatever the tensors' dtype.
std::vector<Tensor> run_attention_gpu(Gpu& gpu, bool backward, DType dt, const Attrs& attrs,
                                      const std::vector<Tensor>& inputs, const Shape& q) {
  if (backward) return gpu.run("attention_grad", dt, attrs, inputs, {packed(q)});
  return gpu.run("attention", dt, attrs, inputs, {q, attention_stats_shape(q)}, {dt, f32});
}

// The fused attention on the GPU against the CPU kernel on the same inputs (bf16: the CPU's
// float32 kernel on the exact float32 values of the bf16 inputs, rounded once at the end).
//  - f32: float32 FMAs, sums over D and over T in another order than the CPU's double sums, and
//    exp2f (2 ulp) of scores pre-scaled by log2 e rounded to float: relative errors near 1e-6;
//    1e-4 relative to the largest element still catches any misplaced tile (errors of order 1).
//  - bf16: the probabilities P and dS are rounded to bf16 (2^-9 relative) before their products
//    on the tensor cores, as FlashAttention does, and the outputs are rounded to bf16 (2^-9):
//    forward 2e-2; the gradients sum T such products and D = rowsum(dO * O) cancels against dP,
//    so 4e-2.
TEST_CASE("CudaKernels.Attention.MatchCpu" * doctest::timeout(300)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  struct Case {
    Shape shape;
    bool causal;
  };
  // T: one row, less than a tile, tiles and a ragged end; D: every compiled head size (16, 32,
  // 64, 128, 16-byte rows read 16 bytes at a time) and padded ones (8, 40: element by element).
  const std::vector<Case> cases{{{1, 1, 1, 16}, true},   {{2, 3, 17, 8}, true},    {{2, 2, 64, 64}, true},
                                {{1, 2, 100, 64}, false}, {{2, 1, 257, 40}, true},  {{1, 3, 130, 32}, true},
                                {{1, 1, 200, 128}, true}, {{1, 2, 96, 128}, false}, {{3, 77, 16}, true}};
  for (DType dt : {f32, bf16}) {
    const double fwd_tol = dt == f32 ? 1e-4 : 2e-2, bwd_tol = dt == f32 ? 1e-4 : 4e-2;
    for (const Case& c : cases) {
      CAPTURE(name(dt));
      CAPTURE(to_string(c.shape));
      CAPTURE(c.causal);
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.back()));
      Attrs attrs = attention_attrs(c.causal, scale);
      attrs.set("kernel", std::string("fused"));  // baton's kernels (auto could pick cuDNN's)
      const Tensor q = random_tensor(dt, c.shape), k = random_tensor(dt, c.shape), v = random_tensor(dt, c.shape);
      const Tensor dout = random_tensor(dt, c.shape);
      check_against_cpu(gpu, "attention", dt, attrs, {q, k, v}, {c.shape}, fwd_tol);
      // The gradient from the same o (the CPU's) on both sides.
      const Tensor o = run1("attention", dt, attrs, {q, k, v}, c.shape);
      const auto want = run_cpu("attention_grad", dt, attrs, {q, k, v, o, dout}, {packed(c.shape)})[0];
      const auto got = gpu.run1("attention_grad", dt, attrs, {q, k, v, o, dout}, packed(c.shape));
      for (int part = 0; part < 3; ++part) {
        CAPTURE(part);  // dq, dk, dv
        CHECK_CLOSE(unpack(got, part), unpack(want, part), bwd_tol);
      }
      // Again with the forward's stats (as a training plan saves them), which the dq kernel reads
      // instead of recomputing: the exact row log-sum-exp rounded to float, so the same tolerance.
      const Tensor stats = to_dtype(row_log_sum_exp(q, k, c.causal, scale), f32);
      const auto saved = run_attention_gpu(gpu, true, dt, attrs, {q, k, v, o, dout, stats}, c.shape);
      for (int part = 0; part < 3; ++part) {
        CAPTURE(part);
        CHECK_CLOSE(unpack(saved[0], part), unpack(want, part), bwd_tol);
      }
      // dq, dk and dv into tensors of their own (a training plan's three outputs): the same bits.
      const auto apart = gpu.run("attention_grad", dt, attrs, {q, k, v, o, dout, stats}, {c.shape, c.shape, c.shape});
      for (int part = 0; part < 3; ++part) {
        CAPTURE(part);
        CHECK(difference(apart[static_cast<std::size_t>(part)], unpack(saved[0], part)).error == 0);
      }
    }
  }
}

// A head size past the kernels' 128 is refused on the host, naming the tensor.
TEST_CASE("CudaKernels.Attention.RefusesHeadsPast128") {
  if (!test::cuda_built()) return;
  const Tensor q = random_tensor(f32, {1, 4, 130});
  Tensor o = Tensor::zeros({1, 4, 130}, f32);
  auto kernel = registry().create("attention", KernelConfig{"big", Device::parse("cuda:0"), f32, attention_attrs(true, 0.1)});
  const Tensor* in[] = {&q, &q, &q};
  Tensor* out[] = {&o};
  KernelContext ctx{in, out, 0};
  CHECK_THROWS_WITH_AS(kernel->compute(ctx), doctest::Contains("the CUDA kernels take D <= 128"), std::invalid_argument);
}

// cuDNN is looked for at run time on every machine, GPU or not (dlopen, its functions by dlsym,
// its version call): found, it is cuDNN 9 with a version; not found, the reason says why. The
// build machines carry the toolkit's cuDNN 9.19, so there this finds it when the loader's path
// has it.
TEST_CASE("Cudnn.IsFoundAtRunTimeOrSaysWhyNot") {
  if (!test::cuda_built()) return;
  const cuda::CudnnAttention& c = cuda::cudnn_attention();
  MESSAGE("cuDNN: " << (c.ok ? c.version : "unavailable: " + c.reason));
  if (c.ok) {
    CHECK(c.version.starts_with("9."));
    CHECK(c.reason.empty());
  } else {
    CHECK(!c.reason.empty());
  }
  CHECK(&cuda::cudnn_attention() == &c);  // asked once
}

// cuDNN's fused attention (attr kernel cudnn) against the CPU's float64 kernels on the same bf16
// inputs, and against baton's own CUDA kernels: o, the stats and dq, dk, dv. bf16 rounds P
// before P V and the products' inputs: the tolerances of the bf16 cases above (2e-2 forward,
// 4e-2 backward, relative to the largest element); the stats are float32 sums of float32
// scores (1e-3). The head sizes cuDNN's engines take (32, 64, 128; multiples of 8), T of two
// rows, of less than a tile, of tiles and of a ragged end.
TEST_CASE("CudaKernels.Attention.CudnnMatchesTheCpuAndBatonsKernels" * doctest::timeout(300)) {
  if (!cudnn_usable()) return;
  Gpu gpu;
  struct Case {
    Shape shape;
    bool causal;
  };
  // (T = 1 is not among them: cuDNN's backward refuses one row, and kernel auto then runs baton's.)
  const std::vector<Case> cases{{{1, 1, 2, 64}, true},   {{2, 3, 17, 64}, true},   {{2, 2, 128, 64}, true},
                                {{1, 2, 100, 64}, false}, {{2, 1, 257, 128}, true}, {{1, 4, 512, 128}, true},
                                {{2, 2, 64, 32}, true}};
  for (const Case& c : cases) {
    CAPTURE(to_string(c.shape));
    CAPTURE(c.causal);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.back()));
    Attrs cudnn = attention_attrs(c.causal, scale), fused = cudnn;
    cudnn.set("kernel", std::string("cudnn"));
    fused.set("kernel", std::string("fused"));
    std::vector<Tensor> in;  // q, k, v, do in bf16, and their float64 values
    std::vector<Tensor> in64;
    for (int i = 0; i < 4; ++i) {
      in.push_back(random_tensor(bf16, c.shape));
      in64.push_back(to_dtype(to_dtype(in.back(), f32), f64));
    }
    const Attrs plain = attention_attrs(c.causal, scale);
    const auto want = run_cpu("attention", f64, plain, {in64[0], in64[1], in64[2]}, {c.shape, attention_stats_shape(c.shape)});
    const auto got = run_attention_gpu(gpu, false, bf16, cudnn, {in[0], in[1], in[2]}, c.shape);
    const auto ours = run_attention_gpu(gpu, false, bf16, fused, {in[0], in[1], in[2]}, c.shape);
    CHECK_CLOSE(got[0], want[0], 2e-2);
    CHECK_CLOSE(got[1], want[1], 1e-3);
    CHECK_CLOSE(got[0], ours[0], 2e-2);
    CHECK_CLOSE(got[1], ours[1], 1e-3);
    // The gradient from the same o and stats (the CPU's, rounded as the GPU's would be).
    const Tensor o = to_dtype(to_dtype(want[0], f32), bf16), stats = to_dtype(want[1], f32);
    const Tensor grads64 = run1("attention_grad", f64, plain, {in64[0], in64[1], in64[2], want[0], in64[3]}, packed(c.shape));
    const auto grads = run_attention_gpu(gpu, true, bf16, cudnn, {in[0], in[1], in[2], o, in[3], stats}, c.shape);
    const auto grads_ours = run_attention_gpu(gpu, true, bf16, fused, {in[0], in[1], in[2], o, in[3], stats}, c.shape);
    // cuDNN's deterministic backward into dq, dk and dv apart (the plan's layout): the same bits.
    const auto apart = gpu.run("attention_grad", bf16, cudnn, {in[0], in[1], in[2], o, in[3], stats},
                               {c.shape, c.shape, c.shape});
    for (int part = 0; part < 3; ++part) {
      CAPTURE(part);  // dq, dk, dv
      CHECK_CLOSE(unpack(grads[0], part), unpack(grads64, part), 4e-2);
      CHECK_CLOSE(unpack(grads[0], part), unpack(grads_ours[0], part), 4e-2);
      CHECK(difference(apart[static_cast<std::size_t>(part)], unpack(grads[0], part)).error == 0);
    }
  }
}

// Grouped-query heads on the GPU against the CPU's kernel on the same inputs (bf16: its float32
// kernel on their exact values): baton's kernels in f32 and bf16, and cuDNN's (bf16) where it
// loads; the tolerances of the cases above. dk and dv are each group's heads added up (the CPU
// in double; baton's kernel in float as it walks the group's query rows; cuDNN in its reduction
// node). The flat output and three apart: the same bits.
TEST_CASE("CudaKernels.Attention.GroupedQueryHeadsMatchCpu" * doctest::timeout(300)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  const bool with_cudnn = cuda::cudnn_attention().ok;
  if (!with_cudnn) MESSAGE("cuDNN unavailable (" << cuda::cudnn_attention().reason << "): baton's kernels only");
  struct Case {
    Shape q, kv;
  };
  const std::vector<Case> cases{{{2, 4, 17, 64}, {2, 2, 17, 64}}, {{1, 8, 130, 64}, {1, 2, 130, 64}},
                                {{2, 4, 64, 32}, {2, 1, 64, 32}}, {{1, 4, 100, 128}, {1, 2, 100, 128}}};
  for (DType dt : {f32, bf16}) {
    const double fwd_tol = dt == f32 ? 1e-4 : 2e-2, bwd_tol = dt == f32 ? 1e-4 : 4e-2;
    for (const char* kernel : {"fused", "cudnn"}) {
      if (std::string(kernel) == "cudnn" && (dt != bf16 || !with_cudnn)) continue;
      for (const Case& c : cases) {
        CAPTURE(name(dt));
        CAPTURE(kernel);
        CAPTURE(to_string(c.q));
        CAPTURE(to_string(c.kv));
        const double scale = 1.0 / std::sqrt(static_cast<double>(c.q.back()));
        const Attrs plain = attention_attrs(true, scale);
        Attrs attrs = plain;
        attrs.set("kernel", std::string(kernel));
        const Tensor q = random_tensor(dt, c.q), k = random_tensor(dt, c.kv), v = random_tensor(dt, c.kv);
        const Tensor dout = random_tensor(dt, c.q);
        const auto want = run_cpu("attention", dt, plain, {q, k, v}, {c.q, attention_stats_shape(c.q)});
        const auto got = run_attention_gpu(gpu, false, dt, attrs, {q, k, v}, c.q);
        CHECK_CLOSE(got[0], want[0], fwd_tol);
        CHECK_CLOSE(got[1], want[1], dt == f32 ? 1e-4 : 1e-3);
        const std::vector<Tensor> args{q, k, v, want[0], dout, to_dtype(want[1], f32)};
        const auto want_grads = run_cpu("attention_grad", dt, plain, args, {c.q, c.kv, c.kv});
        const auto apart = gpu.run("attention_grad", dt, attrs, args, {c.q, c.kv, c.kv});
        const auto flat = gpu.run("attention_grad", dt, attrs, args, {attention_grad_shape(c.q, c.kv)});
        const std::int64_t nq = numel(c.q), nk = numel(c.kv);
        const std::int64_t start[] = {0, nq, nq + nk}, count[] = {nq, nk, nk};
        for (std::size_t part = 0; part < 3; ++part) {
          CAPTURE(part);  // dq, dk, dv
          CHECK_CLOSE(apart[part], want_grads[part], bwd_tol);
          CHECK(difference(flat_piece(flat[0], start[part], count[part]), apart[part]).error == 0);
        }
      }
    }
  }
}

// kernel cudnn where cuDNN cannot serve says why, naming the actor: float32 tensors, a head size
// that is not a multiple of 8; kernel auto there runs baton's kernel instead (tested above: the
// MatchCpu cases, f32 and D = 40, run with no kernel attr).
TEST_CASE("CudaKernels.Attention.CudnnRefusesWhatItCannotServe") {
  if (!cudnn_usable()) return;
  Gpu gpu;
  Attrs cudnn = attention_attrs(true, 0.25);
  cudnn.set("kernel", std::string("cudnn"));
  CHECK_THROWS_WITH_AS(run_attention_gpu(gpu, false, f32, cudnn, {random_tensor(f32, {1, 2, 8, 16}), random_tensor(f32, {1, 2, 8, 16}),
                                                                  random_tensor(f32, {1, 2, 8, 16})}, {1, 2, 8, 16}),
                       doctest::Contains("cuda.attention"), std::invalid_argument);
  const Shape odd{1, 2, 8, 12};
  CHECK_THROWS_WITH_AS(run_attention_gpu(gpu, false, bf16, cudnn, {random_tensor(bf16, odd), random_tensor(bf16, odd),
                                                                   random_tensor(bf16, odd)}, odd),
                       doctest::Contains("multiple of 8"), std::invalid_argument);
}

// The multi-tensor steps against the one-tensor steps on the GPU (the same arithmetic per
// element: the same bits) and the CPU's (IEEE float operations in the same order: the same bits
// expected; 1e-6 relative to the largest weight allows a compiler's FMA contraction on the CPU).
// Sizes: empty, one element, chunk edges (65536, 65537), more than 36 tensors (several
// launches) and one tensor of more than 320 chunks (split across launches).
TEST_CASE("CudaKernels.MultiTensorOptimizers.MatchOneTensorSteps" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  std::vector<std::int64_t> sizes{0, 1, 1000, 65536, 65537, 200'000};
  for (int i = 0; i < 40; ++i) sizes.push_back(100 + 37 * i);
  sizes.push_back(321 * 65536 + 5);
  struct Weight {
    Tensor w, m, v;             // host, stepped by the CPU
    Tensor dw, dm, dv;          // device, stepped by adam_step_multi
    Tensor sw, sm, sv;          // device, stepped by adam_step one at a time
  };
  for (bool decoupled : {false, true}) {
    CAPTURE(decoupled);
    const AdamConfig cfg{.lr = 1e-2, .weight_decay = 0.1, .decoupled = decoupled};
    std::vector<Weight> ws;
    for (std::int64_t n : sizes) {
      Weight x;
      x.w = random_tensor(f32, {n});
      x.m = Tensor::zeros({n}, f32);
      x.v = Tensor::zeros({n}, f32);
      x.dw = gpu.to_device(x.w), x.dm = gpu.to_device(x.m), x.dv = gpu.to_device(x.v);
      x.sw = gpu.to_device(x.w), x.sm = gpu.to_device(x.m), x.sv = gpu.to_device(x.v);
      ws.push_back(std::move(x));
    }
    for (std::int64_t step = 1; step <= 3; ++step) {
      std::vector<cuda::AdamSlice> slices;
      std::vector<Tensor> grads;
      for (Weight& x : ws) {
        const Tensor g = random_tensor(f32, x.w.shape());
        grads.push_back(gpu.to_device(g));
        adam_step(x.w.data<float>(), g.data<float>(), x.m.data<float>(), x.v.data<float>(), cfg, step, cfg.lr);
        cuda::adam_step(x.sw.data<float>().data(), grads.back().data<float>().data(), x.sm.data<float>().data(),
                        x.sv.data<float>().data(), x.w.numel(), cfg, step, cfg.lr, *gpu.stream);
        slices.push_back({x.dw.data<float>().data(), grads.back().data<float>().data(), x.dm.data<float>().data(),
                          x.dv.data<float>().data(), x.w.numel()});
      }
      cuda::adam_step_multi(slices, cfg, step, cfg.lr, *gpu.stream);
      gpu.stream->synchronize();
    }
    for (std::size_t i = 0; i < ws.size(); ++i) {
      CAPTURE(sizes[i]);
      CHECK_CLOSE(gpu.to_host(ws[i].dw), gpu.to_host(ws[i].sw), 0.0);
      CHECK_CLOSE(gpu.to_host(ws[i].dm), gpu.to_host(ws[i].sm), 0.0);
      CHECK_CLOSE(gpu.to_host(ws[i].dv), gpu.to_host(ws[i].sv), 0.0);
      CHECK_CLOSE(gpu.to_host(ws[i].dw), ws[i].w, 1e-6);
      CHECK_CLOSE(gpu.to_host(ws[i].dv), ws[i].v, 1e-6);
    }
  }
  for (double momentum : {0.0, 0.9}) {
    for (bool nesterov : {false, true}) {
      if (nesterov && momentum == 0.0) continue;
      CAPTURE(momentum);
      CAPTURE(nesterov);
      const SgdConfig cfg{.lr = 0.1, .momentum = momentum, .weight_decay = 0.01, .nesterov = nesterov};
      std::vector<Tensor> w, buf, dw, dbuf, sw, sbuf;
      for (std::int64_t n : sizes) {
        w.push_back(random_tensor(f32, {n}));
        buf.push_back(Tensor::zeros({n}, f32));
        dw.push_back(gpu.to_device(w.back()));
        dbuf.push_back(gpu.to_device(buf.back()));
        sw.push_back(gpu.to_device(w.back()));
        sbuf.push_back(gpu.to_device(buf.back()));
      }
      for (std::int64_t step = 1; step <= 3; ++step) {
        std::vector<cuda::SgdSlice> slices;
        std::vector<Tensor> grads;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          const Tensor g = random_tensor(f32, w[i].shape());
          grads.push_back(gpu.to_device(g));
          sgd_step(w[i].data<float>(), g.data<float>(), buf[i].data<float>(), cfg, step, cfg.lr);
          cuda::sgd_step(sw[i].data<float>().data(), grads.back().data<float>().data(), sbuf[i].data<float>().data(),
                         w[i].numel(), cfg, step, cfg.lr, *gpu.stream);
          slices.push_back({dw[i].data<float>().data(), grads.back().data<float>().data(), dbuf[i].data<float>().data(),
                            w[i].numel()});
        }
        cuda::sgd_step_multi(slices, cfg, step, cfg.lr, *gpu.stream);
        gpu.stream->synchronize();
      }
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        CAPTURE(sizes[i]);
        CHECK_CLOSE(gpu.to_host(dw[i]), gpu.to_host(sw[i]), 0.0);
        CHECK_CLOSE(gpu.to_host(dw[i]), w[i], 1e-6);
      }
    }
  }
}

// Serving's decode ops on cuda:0 against the CPU's kernels (f32). rope_at: rows at their own
// positions (a negative one is a padding row's, rotated by 0). paged_attention: a step of 8
// rows, a prompt's chunk of four rows of slot 0 (positions 2..5, so they see each other
// causally and two positions of an earlier step), a decoding row of slot 2 at position 13 whose
// blocks are scattered in the cache, grouped-query heads (4 for 2 kv heads), two padding rows;
// head sizes 16 and 64; the caches start from random values (earlier steps' keys and values).
// The output and both caches after the step: the caches bit for bit (copies), the output to
// 1e-5 of its scale (the scores' dot products and the weighted sums in float in another order
// than BLAS's gemv, over at most 16 positions and 64 elements; the softmax in double on both).
TEST_CASE("CudaKernels.Decode.MatchCpu" * doctest::timeout(60)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  const Tensor x = random_tensor(f32, {5, 3, 8});
  Tensor pos = Tensor::empty({5}, DType::i32);
  const std::int32_t ps[5] = {0, 7, -1, 300, 12};
  std::memcpy(pos.raw(), ps, sizeof ps);
  check_against_cpu(gpu, "rope_at", f32, Attrs{{"base", 500.0}}, {x, pos}, {{5, 3, 8}}, 1e-6);
  for (std::int64_t d : {16, 64}) {
    CAPTURE(d);
    const std::int64_t rows = 8, heads = 4, kv = 2, blocks = 20, bs = 4, n_slots = 3, per_slot = 6;
    const Tensor q = random_tensor(f32, {rows, heads, d}), k = random_tensor(f32, {rows, kv, d}),
                 v = random_tensor(f32, {rows, kv, d});
    const Tensor k_cache = random_tensor(f32, {blocks, bs, kv, d}), v_cache = random_tensor(f32, {blocks, bs, kv, d});
    auto ints = [](const Shape& s, std::vector<std::int32_t> values) {
      Tensor t = Tensor::empty(s, DType::i32);
      std::memcpy(t.raw(), values.data(), values.size() * sizeof(std::int32_t));
      return t;
    };
    const Tensor slots = ints({rows}, {0, 0, -1, 0, 0, 2, -1, 2});
    const Tensor positions = ints({rows}, {2, 3, 0, 4, 5, 13, 0, 12});
    const Tensor table = ints({n_slots, per_slot}, {7, 1, 12, -1, -1, -1,  //
                                                    -1, -1, -1, -1, -1, -1,  //
                                                    19, 3, 11, 5, -1, -1});
    const Attrs attrs;
    // The CPU: on copies of the caches, which it writes.
    Tensor kc_cpu = Tensor::empty(k_cache.shape(), f32), vc_cpu = Tensor::empty(v_cache.shape(), f32);
    std::memcpy(kc_cpu.raw(), k_cache.raw(), k_cache.nbytes());
    std::memcpy(vc_cpu.raw(), v_cache.raw(), v_cache.nbytes());
    Tensor o_cpu = Tensor::empty(q.shape(), f32);
    {
      auto kernel = registry().create("paged_attention", KernelConfig{"cpu.paged_attention", Device{}, f32, attrs});
      std::vector<const Tensor*> in{&q, &k, &v, &slots, &positions, &table, &kc_cpu, &vc_cpu};
      std::vector<Tensor*> out{&o_cpu};
      KernelContext ctx{in, out, 0};
      kernel->compute(ctx);
    }
    // The GPU.
    std::vector<Tensor> dev;
    for (const Tensor* t : {&q, &k, &v, &slots, &positions, &table, &k_cache, &v_cache}) dev.push_back(gpu.to_device(*t));
    Tensor o_gpu = gpu.poisoned(q.shape(), f32);
    {
      auto kernel = registry().create("paged_attention", KernelConfig{"cuda.paged_attention", Device::parse("cuda:0"), f32, attrs});
      std::vector<const Tensor*> in;
      for (const Tensor& t : dev) in.push_back(&t);
      std::vector<Tensor*> out{&o_gpu};
      KernelContext ctx{in, out, 0, gpu.stream.get()};
      kernel->compute(ctx);
    }
    CHECK_CLOSE(gpu.to_host(o_gpu), o_cpu, 1e-5);
    const Tensor kc_gpu = gpu.to_host(dev[6]), vc_gpu = gpu.to_host(dev[7]);
    CHECK(std::memcmp(kc_gpu.raw(), kc_cpu.raw(), kc_cpu.nbytes()) == 0);
    CHECK(std::memcmp(vc_gpu.raw(), vc_cpu.raw(), vc_cpu.nbytes()) == 0);
    // The padding rows are zeros on both.
    const Tensor o_host = gpu.to_host(o_gpu);
    for (std::int64_t j = 0; j < heads * d; ++j) {
      CHECK(o_host.data<float>()[static_cast<std::size_t>(2 * heads * d + j)] == 0.f);
      CHECK(o_host.data<float>()[static_cast<std::size_t>(6 * heads * d + j)] == 0.f);
    }
  }
}

// What the variable groups of the updates pass ask of the multi-tensor steps beyond the plain
// step: the new weights also written into each weight's copy (f32 or bf16, some weights none),
// and the clipping factor applied to the gradients inside the step. Against the one-tensor
// path the variable actor takes (the gradient copied and scaled by cuda::scale, then the step
// writing its copy): the same bits, weights, slots and copies.
TEST_CASE("CudaKernels.MultiTensorOptimizers.WriteTheCopiesAndScaleTheGradientsAsOneTensorSteps" *
          doctest::timeout(120)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  std::vector<std::int64_t> sizes{1, 1000, 65537};
  for (int i = 0; i < 40; ++i) sizes.push_back(100 + 37 * i);
  const DType copy_of[3] = {f32, bf16, DType::i32};  // i32: no copy
  auto raw = [&](const Tensor& t) {
    const Tensor h = gpu.to_host(t);
    const auto* p = static_cast<const unsigned char*>(h.raw());
    return std::vector<unsigned char>(p, p + h.nbytes());
  };
  for (bool adam : {true, false}) {
    CAPTURE(adam);
    const AdamConfig acfg{.lr = 1e-2, .weight_decay = 0.1, .decoupled = true};
    const SgdConfig scfg{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = false};
    struct Weight {
      Tensor mw, mm, mv, mc;  // stepped by the multi-tensor step
      Tensor sw, sm, sv, sc;  // by the one-tensor step
      bool copy = false;
    };
    std::vector<Weight> ws;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::int64_t n = sizes[i];
      const Tensor w = random_tensor(f32, {n});
      const Tensor zero = Tensor::zeros({n}, f32);
      Weight x{gpu.to_device(w), gpu.to_device(zero), gpu.to_device(zero), {},
               gpu.to_device(w), gpu.to_device(zero), gpu.to_device(zero), {}};
      const DType c = copy_of[i % 3];
      x.copy = c != DType::i32;
      if (x.copy) {
        x.mc = gpu.to_device(Tensor::zeros({n}, c));
        x.sc = gpu.to_device(Tensor::zeros({n}, c));
      }
      ws.push_back(std::move(x));
    }
    for (std::int64_t step = 1; step <= 3; ++step) {
      const float factor = step == 2 ? 0.37f : 1.0f;  // step 2 clips
      std::vector<cuda::AdamSlice> as;
      std::vector<cuda::SgdSlice> ss;
      std::vector<Tensor> grads;
      for (Weight& x : ws) {
        grads.push_back(gpu.to_device(random_tensor(f32, x.mw.shape())));
        const Tensor& g = grads.back();
        Tensor scaled = gpu.to_device(Tensor::zeros(g.shape(), f32));
        cuda::copy(scaled, g, *gpu.stream);
        if (factor != 1.0f) cuda::scale(scaled.data<float>().data(), scaled.numel(), factor, *gpu.stream);
        Tensor* sc = x.copy ? &x.sc : nullptr;
        Tensor* mc = x.copy ? &x.mc : nullptr;
        if (adam) {
          cuda::adam_step(x.sw.data<float>().data(), scaled.data<float>().data(), x.sm.data<float>().data(),
                          x.sv.data<float>().data(), x.sw.numel(), acfg, step, acfg.lr, *gpu.stream, sc);
          as.push_back({x.mw.data<float>().data(), g.data<float>().data(), x.mm.data<float>().data(),
                        x.mv.data<float>().data(), x.mw.numel(), mc});
        } else {
          cuda::sgd_step(x.sw.data<float>().data(), scaled.data<float>().data(), x.sm.data<float>().data(),
                         x.sw.numel(), scfg, step, scfg.lr, *gpu.stream, sc);
          ss.push_back({x.mw.data<float>().data(), g.data<float>().data(), x.mm.data<float>().data(), x.mw.numel(), mc});
        }
        gpu.stream->synchronize();  // `scaled` is freed at the end of this iteration
      }
      if (adam) {
        cuda::adam_step_multi(as, acfg, step, acfg.lr, *gpu.stream, factor);
      } else {
        cuda::sgd_step_multi(ss, scfg, step, scfg.lr, *gpu.stream, factor);
      }
      gpu.stream->synchronize();
    }
    for (std::size_t i = 0; i < ws.size(); ++i) {
      CAPTURE(sizes[i]);
      CHECK(raw(ws[i].mw) == raw(ws[i].sw));
      CHECK(raw(ws[i].mm) == raw(ws[i].sm));
      if (adam) CHECK(raw(ws[i].mv) == raw(ws[i].sv));
      if (ws[i].copy) CHECK(raw(ws[i].mc) == raw(ws[i].sc));
    }
  }
}

// Five Adam steps of a small GPT on cuda:0 (the same data, weights and seed every call): the
// losses.
static std::vector<double> gpt_losses_on_gpu(models::GptShape::Attention attention, bool fused_bias_gelu, DType precision) {
  auto corpus = std::make_shared<data::TextCorpus>();
  corpus->vocab.assign(64, static_cast<unsigned char>('x'));
  std::mt19937 gen(5);
  for (int i = 0; i < 1 << 16; ++i) corpus->ids.push_back(static_cast<std::int32_t>(gen() % 64));
  Graph g(3);
  models::Outputs out;
  {
    auto mixed = g.autocast(precision);
    out = models::gpt_with_loss(g, 4,
                                {.vocab = 64, .seq = 128, .d_model = 128, .heads = 2, .layers = 2,
                                 .attention = attention, .fused_bias_gelu = fused_bias_gelu});
  }
  TrainConfig cfg;
  cfg.steps = 5;
  cfg.optimizer = optim::adam(1e-3);
  cfg.replica_places = {Placement{.device = Device::parse("cuda:0")}};
  cfg.data = {{"text", data::text_source(corpus, 4, 1, 128, 3), {"tokens", "targets"}}};
  TrainingJob job = compile_training(g, out.loss, cfg);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(60'000);
  Runtime(job.plan, job.kernels, rs).run();
  return job.losses->per_step();
}

// The GPT on cuda:0 with the fused attention and bias + GELU against the unfused GPT on cuda:0:
// five Adam steps, f32 (float32 rounding compounded over the steps: 1e-3 relative) and bf16
// (the naive path keeps its scores in float32 after the bf16 products, the fused one rounds P
// to bf16: 2e-2).
TEST_CASE("CudaKernels.Gpt.FusedTrainsAsUnfusedOnTheGpu" * doctest::timeout(300)) {
  if (!cuda_usable()) return;
  auto run = [&](bool fused, DType precision) {
    return gpt_losses_on_gpu(fused ? models::GptShape::Attention::fused : models::GptShape::Attention::naive, fused,
                             precision);
  };
  for (DType precision : {f32, bf16}) {
    CAPTURE(name(precision));
    const auto naive = run(false, precision), fused = run(true, precision);
    REQUIRE(naive.size() == 5);
    REQUIRE(fused.size() == 5);
    for (std::size_t i = 0; i < 5; ++i) {
      CAPTURE(i);
      MESSAGE("step " << i << ": naive " << naive[i] << ", fused " << fused[i]);
      CHECK(fused[i] == doctest::Approx(naive[i]).epsilon(precision == f32 ? 1e-3 : 2e-2));
    }
  }
}

// The GPT with cuDNN's attention against the same GPT with baton's fused kernels, bf16, five
// Adam steps: both round P to bf16, in other orders (2e-2 relative, as the bf16 case above).
TEST_CASE("CudaKernels.Gpt.CudnnAttentionTrainsAsBatonsFusedKernels" * doctest::timeout(300)) {
  if (!cudnn_usable()) return;
  const auto ours = gpt_losses_on_gpu(models::GptShape::Attention::fused, true, bf16);
  const auto cudnn = gpt_losses_on_gpu(models::GptShape::Attention::cudnn, true, bf16);
  REQUIRE(ours.size() == 5);
  REQUIRE(cudnn.size() == 5);
  for (std::size_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    MESSAGE("step " << i << ": baton's fused " << ours[i] << ", cudnn " << cudnn[i]);
    CHECK(cudnn[i] == doctest::Approx(ours[i]).epsilon(2e-2));
  }
}

// The Llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) on cuda:0 against the
// same job on the CPU: five Adam steps in f32, the same data and initial weights. What differs
// is the order of the sums in the products and reductions (cuBLAS's, the block reductions'):
// float32 rounding compounded over the steps, 1e-3 relative as the GPT's test above.
TEST_CASE("CudaTraining.LlamaTrainsAsOnTheCpu" * doctest::timeout(300)) {
  if (!cuda_usable()) return;
  auto corpus = std::make_shared<data::TextCorpus>();
  corpus->vocab.assign(64, static_cast<unsigned char>('x'));
  std::mt19937 gen(7);
  for (int i = 0; i < 1 << 14; ++i) corpus->ids.push_back(static_cast<std::int32_t>(gen() % 64));
  auto run = [&](const char* device) {
    Graph g(3);
    models::Outputs out = models::llama_with_loss(
        g, 4, {.vocab = 64, .seq = 64, .d_model = 64, .heads = 4, .kv_heads = 2, .ffn_hidden = 128, .layers = 2});
    TrainConfig cfg;
    cfg.steps = 5;
    cfg.optimizer = optim::adam(1e-3);
    cfg.replica_places = {Placement{.device = Device::parse(device)}};
    cfg.data = {{"text", data::text_source(corpus, 4, 1, 64, 3), {"tokens", "targets"}}};
    TrainingJob job = compile_training(g, out.loss, cfg);
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(60'000);
    Runtime(job.plan, job.kernels, rs).run();
    return job.losses->per_step();
  };
  const auto cpu = run("cpu:0"), gpu = run("cuda:0");
  REQUIRE(cpu.size() == 5);
  REQUIRE(gpu.size() == 5);
  for (std::size_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    MESSAGE("step " << i << ": cpu " << cpu[i] << ", cuda " << gpu[i]);
    CHECK(gpu[i] == doctest::Approx(cpu[i]).epsilon(1e-3));
  }
}
