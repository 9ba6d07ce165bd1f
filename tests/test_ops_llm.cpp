// The math ops of current LLMs (ops_llm.cpp; exp, log, sqrt, rsqrt, pow, silu, rms_norm, rope,
// the swiglu block): every forward kernel against a float64 loop written here, on random inputs
// with the outputs poisoned with NaN first; every gradient kernel in f64 against central finite
// differences of its forward kernel; the DSL's gradients through autodiff and evaluate() against
// finite differences of the whole graph; bad shapes and attributes refused with the op named; a
// Llama-shaped block trained through a compiled plan.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "test_util.h"

namespace {

using baton::test::contains;
using baton::test::thrown_message;

using baton::Attrs;
using baton::Device;
using baton::DeviceType;
using baton::DType;
using baton::KernelConfig;
using baton::KernelContext;
using baton::KernelRegistry;
using baton::Shape;
using baton::Tensor;

constexpr double quiet_nan = std::numeric_limits<double>::quiet_NaN();

const KernelRegistry& registry() {
  static const KernelRegistry reg = [] {
    KernelRegistry r;
    baton::add_cpu_nn_ops(r);
    return r;
  }();
  return reg;
}

// Runs `op` as a cpu actor named "k" on `inputs` into a fresh NaN-poisoned output of `out_shape`.
template <class T>
Tensor apply(std::string_view op, const std::vector<Tensor>& inputs, const Shape& out_shape,
             const Attrs& attrs = {}) {
  Tensor out = Tensor::empty(out_shape, baton::dtype_of<T>());
  for (auto& x : out.data<T>()) x = static_cast<T>(quiet_nan);
  std::vector<const Tensor*> in;
  for (const Tensor& t : inputs) in.push_back(&t);
  auto kernel = registry().create(op, KernelConfig{"k", Device{}, baton::dtype_of<T>(), attrs});
  std::vector<Tensor*> outs{&out};
  KernelContext ctx{in, outs, 0};
  kernel->compute(ctx);
  return out;
}

template <class T>
Tensor random_tensor(const Shape& shape, std::mt19937& rng, double lo, double hi) {
  Tensor t = Tensor::empty(shape, baton::dtype_of<T>());
  std::uniform_real_distribution<double> dist(lo, hi);
  for (auto& x : t.data<T>()) x = static_cast<T>(dist(rng));
  return t;
}

template <class T>
Tensor normal_tensor(const Shape& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, baton::dtype_of<T>());
  std::normal_distribution<double> dist(0.0, 1.0);
  for (auto& x : t.data<T>()) x = static_cast<T>(dist(rng));
  return t;
}

// The elements as doubles (the exact values of an f32 tensor's floats).
std::vector<double> values(const Tensor& t) {
  if (t.dtype() == DType::f32) {
    auto d = t.data<float>();
    return {d.begin(), d.end()};
  }
  auto d = t.data<double>();
  return {d.begin(), d.end()};
}

// |got - want| <= rel |want| + abs for every element; reports the first that is not.
void check_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                 double abs) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= rel * std::abs(want[i]) + abs)) {
      CAPTURE(i);
      CAPTURE(got[i]);
      CAPTURE(want[i]);
      FAIL_CHECK("element differs from the reference");
      return;
    }
  }
}

// Central differences (h = 1e-6) of sum(dy * op(inputs)) with respect to inputs[which], in f64.
std::vector<double> vjp_by_differences(std::string_view op, std::vector<Tensor> inputs,
                                       std::size_t which, const Tensor& dy,
                                       const Attrs& attrs = {}) {
  constexpr double h = 1e-6;
  auto f = [&] {
    const auto y = values(apply<double>(op, inputs, dy.shape(), attrs));
    const auto w = values(dy);
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * w[i];
    return s;
  };
  auto d = inputs[which].data<double>();
  std::vector<double> grad(d.size());
  for (std::size_t i = 0; i < d.size(); ++i) {
    const double keep = d[i];
    d[i] = keep + h;
    const double up = f();
    d[i] = keep - h;
    const double down = f();
    d[i] = keep;
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}

// Gradient kernels against central differences in f64. The quotient (h = 1e-6) errs by its
// truncation, h^2 |f'''| / 6 ~ 1e-12 for these smooth ops on inputs kept away from their poles
// (log, sqrt, rsqrt and negative powers see x in [0.5, 2]), and by the rounding of the
// weighted sum, ~1e-16 x 10 / 1e-6 = 1e-9: hence 1e-8 absolute plus 1e-6 relative.
void check_gradient(const Tensor& got, const std::vector<double>& finite_differences) {
  check_close(values(got), finite_differences, 1e-6, 1e-8);
}

const std::vector<Shape> shapes = {{}, {4, 7}, {2, 3, 5}, {1000}, {0, 3}};
const std::vector<Shape> row_shapes = {{4, 7}, {2, 3, 5}, {1, 1}, {3, 33}, {0, 3}};

double ref_silu(double x) {
  return x / (1.0 + std::exp(-x));
}

// rotate_half as transformers writes it: q * cos + rotate_half(q) * sin, with cos and sin of
// cat(freqs, freqs) and rotate_half(x) = cat(-x[D/2:], x[:D/2]); in double.
std::vector<double> ref_rope(const std::vector<double>& x, const Shape& s, double base) {
  const auto t_len = static_cast<std::size_t>(s[s.size() - 2]);
  const auto d = static_cast<std::size_t>(s.back());
  const std::size_t half = d / 2;
  std::vector<double> y(x.size());
  for (std::size_t row = 0; row < x.size() / d; ++row) {
    const double t = static_cast<double>(row % t_len);
    const double* xr = &x[row * d];
    for (std::size_t j = 0; j < d; ++j) {
      const double inv_freq =
          std::pow(base, -static_cast<double>(2 * (j % half)) / static_cast<double>(d));
      const double rotated = j < half ? -xr[j + half] : xr[j - half];
      y[row * d + j] = xr[j] * std::cos(t * inv_freq) + rotated * std::sin(t * inv_freq);
    }
  }
  return y;
}

std::vector<double> ref_rms_norm(const std::vector<double>& x, const std::vector<double>& w,
                                 double eps) {
  const std::size_t d = w.size();
  std::vector<double> y(x.size());
  for (std::size_t r = 0; r < x.size() / d; ++r) {
    double ms = 0;
    for (std::size_t j = 0; j < d; ++j) ms += x[r * d + j] * x[r * d + j] / static_cast<double>(d);
    for (std::size_t j = 0; j < d; ++j) y[r * d + j] = x[r * d + j] / std::sqrt(ms + eps) * w[j];
  }
  return y;
}

}  // namespace

TEST_CASE("Ops.Llm.EveryOpIsRegisteredForCpuF32AndF64") {
  for (const char* op :
       {"exp", "log", "sqrt", "rsqrt", "pow", "silu", "sqrt_grad", "rsqrt_grad", "pow_grad",
        "silu_grad", "rms_norm", "rms_norm_grad", "rms_norm_grad_weight", "rope", "rope_grad"}) {
    CAPTURE(op);
    CHECK(registry().contains(op, DeviceType::cpu, DType::f32));
    CHECK(registry().contains(op, DeviceType::cpu, DType::f64));
    // bf16 runs the float32 kernel on float32 copies (KernelRegistry::create's fallback).
    CHECK(registry().contains(op, DeviceType::cpu, DType::bf16));
  }
}

TEST_CASE("Ops.Llm.WithoutACudaKernelTheErrorNamesOpAndDevice") {
  // An op with CPU kernels only (here one registered for the test; the LLM ops have CUDA ones
  // now): asking for a CUDA kernel must say which op and device is missing and what exists, not
  // fail somewhere inside.
  auto reg = KernelRegistry::with_builtin_kernels();
  reg.add_fn("test.cpu_only", DeviceType::cpu, DType::f32, [](KernelContext&) {});
  const std::string msg = thrown_message<std::invalid_argument>([&] {
    (void)reg.create("test.cpu_only", KernelConfig{"blk0.norm", Device{DeviceType::cuda, 0}, DType::f32, {}});
  });
  CHECK(contains(msg, "no kernel 'test.cpu_only' for cuda/f32"));
  CHECK(contains(msg, "blk0.norm"));
  CHECK(contains(msg, "cpu/f32"));
}

// ---------------------------------------------------------------------------------------------
// Elementwise

namespace {
struct UnaryCase {
  const char* op;
  std::function<double(double)> ref;
  double lo, hi;  // the inputs' range (in the domain, away from poles)
  Attrs attrs;
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"exp", [](double x) { return std::exp(x); }, -5.0, 5.0, {}},
      {"log", [](double x) { return std::log(x); }, 0.5, 2.0, {}},
      {"sqrt", [](double x) { return std::sqrt(x); }, 0.5, 2.0, {}},
      {"rsqrt", [](double x) { return 1.0 / std::sqrt(x); }, 0.5, 2.0, {}},
      {"silu", ref_silu, -6.0, 6.0, {}},
      {"pow", [](double x) { return x * x; }, -2.0, 2.0, Attrs{{"exponent", 2.0}}},
      {"pow", [](double x) { return x * x * x; }, -2.0, 2.0, Attrs{{"exponent", 3.0}}},
      {"pow", [](double x) { return std::pow(x, -1.5); }, 0.5, 2.0, Attrs{{"exponent", -1.5}}},
  };
}
}  // namespace

TEST_CASE_TEMPLATE("Ops.Llm.ElementwiseMatchReference", T, float, double) {
  // One libm call (and for silu two roundings more) per element on exact inputs: float32
  // results within a few ulp, 2^-23 x 4 = 5e-7 relative, so 1e-6; 1e-7 absolute for log near
  // x = 1, where the result is near 0. In f64 the same, 1e-14.
  const double rel = std::is_same_v<T, float> ? 1e-6 : 1e-14;
  const double abs = std::is_same_v<T, float> ? 1e-7 : 1e-15;
  std::mt19937 rng(3);
  for (const UnaryCase& c : unary_cases()) {
    for (const Shape& shape : shapes) {
      CAPTURE(c.op);
      CAPTURE(c.attrs.str());
      CAPTURE(baton::to_string(shape));
      Tensor x = random_tensor<T>(shape, rng, c.lo, c.hi);
      std::vector<double> want;
      for (double v : values(x)) want.push_back(c.ref(v));
      check_close(values(apply<T>(c.op, {x}, shape, c.attrs)), want, rel, abs);
    }
  }
}

TEST_CASE_TEMPLATE("Ops.Llm.ElementwiseOutsideTheDomainGiveNanAndInfinity", T, float, double) {
  // Documented behaviour, as torch: no error, the values of the math.
  Tensor x = Tensor::empty({2}, baton::dtype_of<T>());
  x.data<T>()[0] = T(-1);
  x.data<T>()[1] = T(0);
  auto lg = values(apply<T>("log", {x}, {2}));
  CHECK(std::isnan(lg[0]));
  CHECK(lg[1] == -std::numeric_limits<double>::infinity());
  CHECK(std::isnan(values(apply<T>("sqrt", {x}, {2}))[0]));
  CHECK(values(apply<T>("rsqrt", {x}, {2}))[1] == std::numeric_limits<double>::infinity());
  // silu must not overflow where exp(-x) does.
  x.data<T>()[0] = T(-1000);
  x.data<T>()[1] = T(1000);
  auto s = values(apply<T>("silu", {x}, {2}));
  CHECK(s[0] == doctest::Approx(0.0));
  CHECK(s[1] == 1000.0);
}

TEST_CASE("Ops.Llm.ElementwiseGradientsMatchFiniteDifferences") {
  std::mt19937 rng(5);
  for (const UnaryCase& c : unary_cases()) {
    for (const Shape& shape : {Shape{3, 4}, Shape{2, 2, 5}}) {
      CAPTURE(c.op);
      CAPTURE(c.attrs.str());
      Tensor x = random_tensor<double>(shape, rng, c.lo, c.hi);
      Tensor dy = random_tensor<double>(shape, rng, -1.0, 1.0);
      const auto fd = vjp_by_differences(c.op, {x}, 0, dy, c.attrs);
      const std::string op = c.op;
      if (op == "exp") {
        // autodiff: dy * y
        Tensor y = apply<double>("exp", {x}, shape);
        std::vector<double> got;
        for (std::size_t i = 0; i < fd.size(); ++i) got.push_back(values(dy)[i] * values(y)[i]);
        check_close(got, fd, 1e-6, 1e-8);
      } else if (op == "log") {
        // autodiff: dy / x
        std::vector<double> got;
        for (std::size_t i = 0; i < fd.size(); ++i) got.push_back(values(dy)[i] / values(x)[i]);
        check_close(got, fd, 1e-6, 1e-8);
      } else if (op == "sqrt" || op == "rsqrt") {
        Tensor y = apply<double>(op, {x}, shape);  // these take the forward's output
        check_gradient(apply<double>(op + "_grad", {y, dy}, shape), fd);
      } else {
        check_gradient(apply<double>(op + "_grad", {x, dy}, shape, c.attrs), fd);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

TEST_CASE_TEMPLATE("Ops.Llm.RmsNormMatchesReference", T, float, double) {
  // The mean of squares accumulates in double and the result rounds once to T: float32 within
  // an ulp or two of the exact value, 1e-6 relative; f64 within rounding of <= 33-term sums.
  const double rel = std::is_same_v<T, float> ? 1e-6 : 1e-13;
  std::mt19937 rng(7);
  for (const Shape& shape : row_shapes) {
    for (double eps : {1e-6, 1e-2}) {
      CAPTURE(baton::to_string(shape));
      CAPTURE(eps);
      Tensor x = normal_tensor<T>(shape, rng);
      Tensor w = random_tensor<T>({shape.back()}, rng, 0.5, 1.5);
      const Attrs attrs{{"eps", eps}};
      check_close(values(apply<T>("rms_norm", {x, w}, shape, attrs)),
                  ref_rms_norm(values(x), values(w), eps), rel, 1e-12);
    }
  }
  // An all-zero row (padding) gives zeros, not NaN: eps > 0 keeps the divisor away from 0.
  Tensor zeros = Tensor::zeros({2, 4}, baton::dtype_of<T>());
  Tensor ones = random_tensor<T>({4}, rng, 1.0, 1.0);
  for (double v : values(apply<T>("rms_norm", {zeros, ones}, {2, 4}, Attrs{{"eps", 1e-6}})))
    CHECK(v == 0.0);
}

TEST_CASE("Ops.Llm.RmsNormGradientsMatchFiniteDifferences") {
  std::mt19937 rng(9);
  for (const Shape& shape : {Shape{4, 7}, Shape{2, 3, 5}, Shape{1, 1}, Shape{3, 33}}) {
    for (double eps : {1e-6, 0.5}) {
      CAPTURE(baton::to_string(shape));
      CAPTURE(eps);
      const Attrs attrs{{"eps", eps}};
      Tensor x = normal_tensor<double>(shape, rng);
      Tensor w = random_tensor<double>({shape.back()}, rng, 0.5, 1.5);
      Tensor dy = normal_tensor<double>(shape, rng);
      check_gradient(apply<double>("rms_norm_grad", {x, w, dy}, shape, attrs),
                     vjp_by_differences("rms_norm", {x, w}, 0, dy, attrs));
      check_gradient(apply<double>("rms_norm_grad_weight", {x, dy}, {shape.back()}, attrs),
                     vjp_by_differences("rms_norm", {x, w}, 1, dy, attrs));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Rotary position embedding

TEST_CASE_TEMPLATE("Ops.Llm.RopeRotatesHalvesAsTransformersDoes", T, float, double) {
  // The layout by hand: D = 4, base 10000: theta = (1, 1/100). At t = 1, x = e_0 turns into
  // (cos 1, 0, sin 1, 0): the partner of feature 0 is feature D/2 = 2, not feature 1 (the
  // interleaved layout would put sin 1 at index 1). At t = 0 nothing turns.
  Tensor x = Tensor::zeros({2, 4}, baton::dtype_of<T>());
  x.data<T>()[0] = T(1);
  x.data<T>()[4] = T(1);
  x.data<T>()[5] = T(1);
  const auto y = values(apply<T>("rope", {x}, {2, 4}, Attrs{{"base", 10000.0}}));
  const double tol = std::is_same_v<T, float> ? 1e-7 : 1e-15;  // one rounding of cos and sin
  check_close(y, {1, 0, 0, 0, std::cos(1.0), std::cos(0.01), std::sin(1.0), std::sin(0.01)}, 0,
              tol);
}

TEST_CASE_TEMPLATE("Ops.Llm.RopeMatchesReference", T, float, double) {
  // f64: the same angles up to an ulp of base^(-2i/D) times t <= 15: 1e-12. f32 computes the
  // angles as transformers does, t inv_freq rounded to float32, each off the exact angle by at
  // most ~3 ulp of an angle <= 15 (inv_freq's rounding, the product's): 15 x 3 x 6e-8 = 3e-6
  // rad, times |x_i| + |x_{i+D/2}| <= ~8 for normal inputs: 3e-5 absolute. A wrong layout or
  // sign is off by O(1).
  const double abs = std::is_same_v<T, float> ? 3e-5 : 1e-12;
  std::mt19937 rng(13);
  for (const Shape& shape : {Shape{3, 8}, Shape{2, 3, 16, 6}, Shape{1, 2}, Shape{4, 0, 4}}) {
    for (double base : {10000.0, 500000.0, 2.0}) {
      CAPTURE(baton::to_string(shape));
      CAPTURE(base);
      Tensor x = normal_tensor<T>(shape, rng);
      check_close(values(apply<T>("rope", {x}, shape, Attrs{{"base", base}})),
                  ref_rope(values(x), shape, base), 0, abs);
    }
  }
}

TEST_CASE("Ops.Llm.RopeGradientIsTheInverseRotation") {
  std::mt19937 rng(17);
  for (const Shape& shape : {Shape{5, 4}, Shape{2, 2, 6, 8}}) {
    CAPTURE(baton::to_string(shape));
    const Attrs attrs{{"base", 100.0}};
    Tensor x = normal_tensor<double>(shape, rng);
    Tensor dy = normal_tensor<double>(shape, rng);
    check_gradient(apply<double>("rope_grad", {dy}, shape, attrs),
                   vjp_by_differences("rope", {x}, 0, dy, attrs));
    // A rotation's transpose is its inverse: rope_grad(rope(x)) = x to rounding (a few ulp).
    Tensor back =
        apply<double>("rope_grad", {apply<double>("rope", {x}, shape, attrs)}, shape, attrs);
    check_close(values(back), values(x), 0, 1e-14);
  }
}

TEST_CASE("Ops.Llm.BadShapesAndAttributesThrowNamingTheOp") {
  Tensor x = Tensor::zeros({2, 5}, DType::f64);
  CHECK(contains(thrown_message<std::invalid_argument>([&] {
                   (void)apply<double>("rope", {x}, {2, 5});
                 }),
                 "rope: input f64[2, 5]"));
  Tensor v = Tensor::zeros({4}, DType::f64);
  CHECK(contains(
      thrown_message<std::invalid_argument>([&] { (void)apply<double>("rope", {v}, {4}); }),
      "rope"));
  Tensor w = Tensor::zeros({4}, DType::f64);
  const std::string bad_w = thrown_message<std::invalid_argument>([&] {
    (void)apply<double>("rms_norm", {x, w}, {2, 5});
  });
  CHECK(contains(bad_w, "rms_norm: w f64[4]"));
  CHECK(contains(bad_w, "must be [D] = [5]"));
  Tensor w5 = Tensor::zeros({5}, DType::f64);
  for (double eps : {0.0, -1e-6, quiet_nan}) {
    CAPTURE(eps);
    CHECK(contains(thrown_message<std::invalid_argument>([&] {
                     (void)apply<double>("rms_norm", {x, w5}, {2, 5}, Attrs{{"eps", eps}});
                   }),
                   "rms_norm (actor 'k'): attribute eps must be finite and > 0"));
  }
  Tensor x4 = Tensor::zeros({2, 4}, DType::f64);
  CHECK(contains(thrown_message<std::invalid_argument>([&] {
                   (void)apply<double>("rope_grad", {x4}, {2, 4}, Attrs{{"base", 0.0}});
                 }),
                 "rope_grad (actor 'k'): attribute base must be finite and > 0"));
  CHECK(contains(thrown_message<std::invalid_argument>([&] {
                   (void)apply<double>(
                       "pow", {x4}, {2, 4},
                       Attrs{{"exponent", std::numeric_limits<double>::infinity()}});
                 }),
                 "pow (actor 'k'): attribute exponent must be finite"));
  const std::string bad_y = thrown_message<std::invalid_argument>([&] {
    (void)apply<double>("exp", {x4}, {2, 5});
  });
  CHECK(contains(bad_y, "exp: x f64[2, 4]"));
  CHECK(contains(bad_y, "y f64[2, 5]"));
  CHECK(contains(bad_y, "must have the same shape"));
  CHECK(contains(thrown_message<std::invalid_argument>([&] {
                   (void)apply<float>("silu", {x4}, {2, 4});
                 }),
                 "silu: x must be f32"));
}

// ---------------------------------------------------------------------------------------------
// The DSL: shape rules, autodiff through evaluate()

namespace {

using baton::Graph;
using baton::GraphError;
using baton::Value;

template <class F>
std::string graph_error(F&& f) {
  try {
    f();
  } catch (const GraphError& e) {
    return e.what();
  }
  return {};
}

Tensor uniform_f64(const Shape& s, std::uint32_t seed, double lo, double hi) {
  std::mt19937 rng(seed);
  return random_tensor<double>(s, rng, lo, hi);
}

double scalar(const Tensor& t) {
  return t.data<double>()[0];
}

// d(loss)/d(w) for every variable of g, through gradients() and evaluate(), against central
// differences of evaluate(loss) in f64. The variables are uniform in [lo, hi].
void check_graph_gradients(const std::string& what, Graph& g, Value loss,
                           const std::map<std::string, Tensor>& feeds, double lo = -0.9,
                           double hi = 0.9) {
  INFO(what);
  auto params = baton::ParameterStore::initialize(g);
  std::uint32_t seed = 1;
  for (auto& [name, t] : params->values())
    params->set(name, uniform_f64(t.shape(), seed++, lo, hi));
  std::vector<Value> vars = g.variables();
  std::vector<Value> grads = baton::gradients(loss, vars);
  std::vector<Tensor> analytic = baton::evaluate(g, feeds, grads, *params);
  const double h = 1e-6;
  for (std::size_t v = 0; v < vars.size(); ++v) {
    Tensor& w = params->at(vars[v].name());
    auto wd = w.data<double>();
    auto ad = analytic[v].data<double>();
    REQUIRE(ad.size() == wd.size());
    for (std::size_t i = 0; i < wd.size(); ++i) {
      const double keep = wd[i];
      wd[i] = keep + h;
      const double up = scalar(baton::evaluate(g, feeds, {loss}, *params)[0]);
      wd[i] = keep - h;
      const double down = scalar(baton::evaluate(g, feeds, {loss}, *params)[0]);
      wd[i] = keep;
      const double numeric = (up - down) / (2 * h);
      INFO(vars[v].name() << "[" << i << "]: analytic " << ad[i] << ", numeric " << numeric);
      // As test_graph.cpp's check: truncation h^2 |L'''| / 6 ~ 1e-12, the loss's rounding over
      // 2h ~ 1e-9; 1e-6 absolute plus 1e-5 relative is far above both, far below a wrong term.
      CHECK(std::abs(ad[i] - numeric) <= 1e-6 + 1e-5 * std::abs(numeric));
    }
  }
}

// loss = sum(y * r) with a fixed random r fed as an input.
Value weighted_sum(Graph& g, Value y, std::map<std::string, Tensor>& feeds) {
  const std::string name = "r" + std::to_string(feeds.size());
  feeds[name] = uniform_f64(y.shape(), static_cast<std::uint32_t>(feeds.size() + 7), -1.0, 1.0);
  return baton::sum(y * g.input(name, y.shape(), DType::f64));
}

}  // namespace

TEST_CASE("Autodiff.LlmOpsMatchFiniteDifferences") {
  using Fn = std::function<Value(Value)>;
  // x in [-0.9, 0.9]; the ops with a pole at 0 see 1 + x^2, in [1, 1.81].
  auto positive = [](Value x) { return x * x + x.graph().constant(1.0, x.shape(), DType::f64); };
  std::vector<std::pair<std::string, Fn>> cases = {
      {"exp", [](Value x) { return baton::exp(x); }},
      {"log", [&](Value x) { return baton::log(positive(x)); }},
      {"sqrt", [&](Value x) { return baton::sqrt(positive(x)); }},
      {"rsqrt", [&](Value x) { return baton::rsqrt(positive(x)); }},
      {"pow 3", [](Value x) { return baton::pow(x, 3.0); }},
      {"pow -1.5", [&](Value x) { return baton::pow(positive(x), -1.5); }},
      {"silu", [](Value x) { return baton::silu(x); }},
      {"rope", [](Value x) { return baton::rope(x, 50.0); }},
      {"rms_norm without a weight variable",
       [](Value x) {
         return baton::rms_norm(x, x.graph().constant(1.5, {x.dim(-1)}, DType::f64), 1e-3);
       }},
  };
  for (auto& [name, fn] : cases) {
    Graph g(11);
    std::map<std::string, Tensor> feeds;
    auto x = g.variable("x", {2, 4, 4}, baton::init::zeros(), DType::f64);
    check_graph_gradients(name, g, weighted_sum(g, fn(x), feeds), feeds);
  }
  {
    Graph g;
    std::map<std::string, Tensor> feeds;
    auto x = g.variable("x", {3, 2, 6}, baton::init::zeros(), DType::f64);
    auto w = g.variable("w", {6}, baton::init::ones(), DType::f64);
    check_graph_gradients("rms_norm, x and w", g,
                          weighted_sum(g, baton::rms_norm(x, w, 1e-5), feeds), feeds);
  }
  {
    // Llama's attention input: RMSNorm, then q and k rotated per head, [b, heads, t, dh].
    Graph g;
    std::map<std::string, Tensor> feeds;
    auto x = g.variable("x", {1, 3, 4}, baton::init::zeros(), DType::f64);
    auto w = g.variable("w", {4}, baton::init::ones(), DType::f64);
    auto wq = g.variable("wq", {4, 4}, baton::init::zeros(), DType::f64);
    auto q = baton::transpose(
        baton::reshape(baton::matmul(baton::rms_norm(x, w), wq), {1, 3, 2, 2}), {0, 2, 1, 3});
    check_graph_gradients("rms_norm -> matmul -> rope", g, weighted_sum(g, baton::rope(q), feeds),
                          feeds);
  }
  {
    Graph g;
    std::map<std::string, Tensor> feeds;
    auto x = g.variable("x", {2, 3, 4}, baton::init::zeros(), DType::f64);
    auto w1 = g.variable("w1", {4, 6}, baton::init::zeros(), DType::f64);
    auto w3 = g.variable("w3", {4, 6}, baton::init::zeros(), DType::f64);
    auto w2 = g.variable("w2", {6, 4}, baton::init::zeros(), DType::f64);
    check_graph_gradients("swiglu", g, weighted_sum(g, baton::swiglu(x, w1, w3, w2), feeds), feeds);
  }
}

TEST_CASE("Graph.SwigluMatchesADirectComputation") {
  Graph g;
  auto x = g.input("x", {3, 4}, DType::f64);
  auto w1 = g.variable("w1", {4, 5}, baton::init::zeros(), DType::f64);
  auto w3 = g.variable("w3", {4, 5}, baton::init::zeros(), DType::f64);
  auto w2 = g.variable("w2", {5, 4}, baton::init::zeros(), DType::f64);
  Value y = baton::swiglu(x, w1, w3, w2);
  CHECK(y.shape() == Shape{3, 4});
  auto params = baton::ParameterStore::initialize(g);
  std::uint32_t seed = 1;
  for (auto& [name, t] : params->values()) params->set(name, uniform_f64(t.shape(), seed++, -1, 1));
  const Tensor xv = uniform_f64({3, 4}, 99, -2, 2);
  const auto got = values(baton::evaluate(g, {{"x", xv}}, {y}, *params)[0]);
  const auto xs = values(xv), a = values(params->at("w1")), b = values(params->at("w3")),
             c = values(params->at("w2"));
  std::vector<double> want(12, 0.0);
  for (std::size_t r = 0; r < 3; ++r) {
    for (std::size_t f = 0; f < 5; ++f) {
      double gate = 0, up = 0;
      for (std::size_t k = 0; k < 4; ++k) {
        gate += xs[r * 4 + k] * a[k * 5 + f];
        up += xs[r * 4 + k] * b[k * 5 + f];
      }
      for (std::size_t o = 0; o < 4; ++o) want[r * 4 + o] += ref_silu(gate) * up * c[f * 4 + o];
    }
  }
  // Sums of 4 and 5 products of O(1) terms in f64 (BLAS may order them otherwise): 1e-13.
  check_close(got, want, 0, 1e-13);
}

TEST_CASE("Graph.LlmOpMistakesNameTheOpShapesAndAttributes") {
  Graph g;
  auto x = g.input("x", {2, 3, 5}, DType::f32);
  auto w = g.variable("w", {4}, baton::init::ones(), DType::f32);
  auto w5 = g.variable("w5", {5}, baton::init::ones(), DType::f32);
  auto ids = g.input("ids", {2}, DType::i32);
  std::string e = graph_error([&] { baton::rms_norm(x, w); });
  CHECK(contains(e, "rms_norm("));
  CHECK(contains(e, "[2, 3, 5]"));
  CHECK(contains(e, "w must be one scale per feature: [5]"));
  for (double eps : {0.0, -1.0, quiet_nan}) {
    CAPTURE(eps);
    CHECK(contains(graph_error([&] { baton::rms_norm(x, w5, eps); }), "must be finite and > 0"));
  }
  e = graph_error([&] { baton::rope(x); });
  CHECK(contains(e, "rope("));
  CHECK(contains(e, "D = 5 must be even"));
  CHECK(contains(graph_error([&] { baton::rope(g.input("v", {4}, DType::f32)); }),
                 "at least 2 axes"));
  CHECK(contains(graph_error([&] {
                   baton::rope(g.input("q", {2, 4}, DType::f32), 0.0);
                 }),
                 "base = 0 must be finite and > 0"));
  CHECK(contains(graph_error([&] { baton::pow(x, std::numeric_limits<double>::infinity()); }),
                 "pow(x f32[2, 3, 5]): exponent inf is not finite"));
  CHECK(contains(graph_error([&] { baton::exp(ids); }), "exp("));
  CHECK(contains(graph_error([&] { baton::swiglu(x, w, w, w); }), "swiglu("));
}

TEST_CASE("Graph.LlmOpsUnderAutocastComputeWhereTorchDoes") {
  // torch.autocast runs exp, log, rsqrt and pow in float32; sqrt and silu in the input's dtype;
  // transformers' RMSNorm computes in float32.
  Graph g;
  auto x = g.input("x", {2, 4}, DType::bf16);
  auto w = g.variable("w", {4}, baton::init::ones(), DType::f32);
  auto bf = g.autocast();
  CHECK(baton::exp(x).dtype() == DType::f32);
  CHECK(baton::log(x).dtype() == DType::f32);
  CHECK(baton::rsqrt(x).dtype() == DType::f32);
  CHECK(baton::pow(x, 2.0).dtype() == DType::f32);
  CHECK(baton::sqrt(x).dtype() == DType::bf16);
  CHECK(baton::silu(x).dtype() == DType::bf16);
  CHECK(baton::rope(x).dtype() == DType::bf16);
  CHECK(baton::rms_norm(x, w).dtype() == DType::f32);
}

TEST_CASE("Training.ALlamaShapedBlockLearns" * doctest::timeout(120)) {
  // The new ops inside a compiled training plan (actors, micro-batches, Adam), not just
  // evaluate(): one pre-norm block as Llama's (RMSNorm, q and k rotated, causal attention,
  // SwiGLU, residuals) over rows of synthetic data read as 4 positions of 4 features.
  constexpr std::int64_t batch = 32, t = 4, d = 4, classes = 4, hidden = 8;
  auto data =
      std::make_shared<const baton::data::Dataset>(baton::data::synthetic(256, t * d, classes, 99));
  for (std::int64_t microbatches : {1, 2}) {
    CAPTURE(microbatches);
    Graph g(5);
    const std::int64_t mb = batch / microbatches;
    auto x = g.input("x", {mb, t * d}, DType::f32);
    auto label = g.input("label", {mb}, DType::i32);
    auto w = [&](const std::string& n, Shape s) {
      return g.variable(n, std::move(s), baton::init::kaiming(), DType::f32);
    };
    auto ones = [&](const std::string& n) {
      return g.variable(n, {d}, baton::init::ones(), DType::f32);
    };
    Value h = baton::reshape(x, {mb, t, d});
    Value n1 = baton::rms_norm(h, ones("norm1"));
    auto heads = [&](Value v) { return baton::reshape(v, {mb, 1, t, d}); };
    Value q = baton::rope(heads(baton::matmul(n1, w("wq", {d, d}))));
    Value k = baton::rope(heads(baton::matmul(n1, w("wk", {d, d}))));
    Value v = heads(baton::matmul(n1, w("wv", {d, d})));
    h = h + baton::matmul(baton::reshape(baton::attention(q, k, v), {mb, t, d}), w("wo", {d, d}));
    h = h + baton::swiglu(baton::rms_norm(h, ones("norm2")), w("w1", {d, hidden}),
                          w("w3", {d, hidden}), w("w2", {hidden, d}));
    Value logits = baton::matmul(baton::reshape(h, {mb, t * d}), w("head", {t * d, classes}));
    Value loss = baton::softmax_cross_entropy(logits, label);
    baton::TrainConfig cfg;
    cfg.steps = 30;
    cfg.microbatches = microbatches;
    cfg.optimizer = baton::optim::adam(0.01);
    cfg.data = {
        {"synthetic", baton::data::batch_source(data, batch, microbatches, 7), {"x", "label"}}};
    baton::TrainingJob job = baton::compile_training(g, loss, cfg);
    baton::RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(20'000);
    baton::Runtime rt(job.plan, job.kernels, rs);
    rt.run();
    const std::vector<double> losses = job.losses->per_step();
    REQUIRE(losses.size() == 30);
    for (double l : losses) REQUIRE(std::isfinite(l));
    // ln 4 = 1.39 at chance; the mean of the last 5 steps well below the first step's loss.
    const double last = (losses[25] + losses[26] + losses[27] + losses[28] + losses[29]) / 5;
    CAPTURE(losses.front());
    CAPTURE(last);
    CHECK(last < 0.7 * losses.front());
  }
}
