// The neural-network ops of ops.h and the optimizer math of optim.h. Every forward kernel is
// checked against a straightforward float64 loop written here, on fresh random inputs of several
// shapes, with outputs poisoned with NaN first; every gradient kernel is checked in f64 against
// central finite differences of its forward kernel; the optimizers against torch.optim's
// formulas, stepped by hand.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "test_util.h"
#include "baton/kernels.h"
#include "baton/kernels/optim.h"

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
constexpr double infinity = std::numeric_limits<double>::infinity();

const KernelRegistry& registry() {
  static const KernelRegistry reg = [] {
    KernelRegistry r;
    baton::add_cpu_nn_ops(r);
    return r;
  }();
  return reg;
}

// Runs `op` as a cpu actor named "k".
void run(std::string_view op, DType dtype, const std::vector<const Tensor*>& inputs,
         const std::vector<Tensor*>& outputs, const Attrs& attrs = {}, std::int64_t piece = 0) {
  auto kernel = registry().create(op, KernelConfig{"k", Device{}, dtype, attrs});
  KernelContext ctx{inputs, outputs, piece};
  kernel->compute(ctx);
}

template <class T>
void poison(Tensor& t) {
  for (auto& x : t.data<T>()) x = static_cast<T>(quiet_nan);
}

// Runs `op` on `inputs` into a fresh NaN-poisoned output of `out_shape` and returns it.
template <class T>
Tensor apply(std::string_view op, const std::vector<Tensor>& inputs, const Shape& out_shape,
             const Attrs& attrs = {}, std::int64_t piece = 0) {
  Tensor out = Tensor::empty(out_shape, baton::dtype_of<T>());
  poison<T>(out);
  std::vector<const Tensor*> in;
  for (const Tensor& t : inputs) in.push_back(&t);
  run(op, baton::dtype_of<T>(), in, {&out}, attrs, piece);
  return out;
}

template <class T>
Tensor random_tensor(const Shape& shape, std::mt19937& rng, double stddev = 1.0) {
  Tensor t = Tensor::empty(shape, baton::dtype_of<T>());
  std::normal_distribution<double> dist(0.0, stddev);
  for (auto& x : t.data<T>()) x = static_cast<T>(dist(rng));
  return t;
}

template <class T>
Tensor make_tensor(const Shape& shape, const std::vector<double>& values) {
  Tensor t = Tensor::empty(shape, baton::dtype_of<T>());
  REQUIRE(values.size() == t.data<T>().size());
  for (std::size_t i = 0; i < values.size(); ++i) t.data<T>()[i] = static_cast<T>(values[i]);
  return t;
}

Tensor make_ids(const Shape& shape, const std::vector<std::int32_t>& values) {
  Tensor t = Tensor::empty(shape, DType::i32);
  REQUIRE(values.size() == t.data<std::int32_t>().size());
  std::copy(values.begin(), values.end(), t.data<std::int32_t>().begin());
  return t;
}

Tensor random_ids(const Shape& shape, std::int32_t upper, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, DType::i32);
  std::uniform_int_distribution<std::int32_t> dist(0, upper - 1);
  for (auto& x : t.data<std::int32_t>()) x = dist(rng);
  return t;
}

std::vector<double> values(const Tensor& t) {
  if (t.dtype() == DType::f32) {
    auto d = t.data<float>();
    return {d.begin(), d.end()};
  }
  auto d = t.data<double>();
  return {d.begin(), d.end()};
}

std::size_t last_dim(const Shape& s) {
  return static_cast<std::size_t>(s.back());
}

// |got - want| <= rel * |want| + abs for every element; reports the first that is not.
void check_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                 double abs) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = got.size();
  for (std::size_t i = 0; i < got.size() && bad == got.size(); ++i) {
    const bool same_inf = std::isinf(want[i]) && got[i] == want[i];
    if (!same_inf && !(std::abs(got[i] - want[i]) <= rel * std::abs(want[i]) + abs)) bad = i;
  }
  if (bad < got.size()) {
    CAPTURE(bad);
    CAPTURE(got[bad]);
    CAPTURE(want[bad]);
    FAIL_CHECK("element differs from the reference");
  }
}

// Forward kernels against float64 references. The kernels' reductions are rows of at most a
// few dozen terms (softmax and layer norm over <= 16 columns, cross-entropy over <= 10 classes),
// so a float32 result carries at most about n u = 16 x 6e-8 = 1e-6 relative from the sums plus
// a few ulp from exp, log, tanh and sqrt: 1e-5 relative leaves a factor of 5 or more; the 1e-6
// absolute floor is for results near 0 that come out of a cancellation (x - mean, log-sum-exp
// minus a logit), where the error is absolute, about n u |terms| with |terms| <= ~10. In f64
// the same sums with u = 1.1e-16: 1e-12.
template <class T>
void check_forward(const Tensor& got, const std::vector<double>& want) {
  if constexpr (std::is_same_v<T, float>) {
    check_close(values(got), want, 1e-5, 1e-6);
  } else {
    check_close(values(got), want, 1e-12, 1e-12);
  }
}

// Gradient kernels against central differences, in f64. The difference quotient (h = 1e-6)
// errs by its truncation, h^2 |f'''| / 6 ~ 1e-12 for these smooth ops of O(1) inputs, and by
// the rounding of f, about u |f| / h ~ 1e-16 x 10 / 1e-6 = 1e-9: hence 1e-8 absolute, and 1e-6
// relative for the larger gradients.
void check_gradient(const Tensor& got, const std::vector<double>& finite_differences) {
  check_close(values(got), finite_differences, 1e-6, 1e-8);
}

// Central differences (h = 1e-6) of the scalar f() with respect to every element of `x`,
// which f reads; x is perturbed in place and restored.
std::vector<double> finite_differences(Tensor& x, const std::function<double()>& f) {
  constexpr double h = 1e-6;
  auto d = x.data<double>();
  std::vector<double> grad(d.size());
  for (std::size_t i = 0; i < d.size(); ++i) {
    const double orig = d[i];
    d[i] = orig + h;
    const double up = f();
    d[i] = orig - h;
    const double down = f();
    d[i] = orig;
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}

double dot(const Tensor& a, const Tensor& b) {
  auto x = values(a);
  auto y = values(b);
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// d/d inputs[which] of sum(dy * op(inputs)), by central differences.
std::vector<double> vjp_by_differences(std::string_view op, std::vector<Tensor> inputs,
                                       std::size_t which, const Tensor& dy, const Attrs& attrs = {},
                                       std::int64_t piece = 0) {
  return finite_differences(
      inputs[which], [&] { return dot(dy, apply<double>(op, inputs, dy.shape(), attrs, piece)); });
}

const std::vector<Shape> row_shapes = {{4, 7}, {2, 3, 5}, {1, 1}, {3, 33}, {0, 3}};

// ---------------------------------------------------------------------------------------------
// float64 references

double ref_gelu(double x) {
  return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
}
// torch's gelu(approximate="tanh"), in double.
double ref_gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}
double ref_sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
double ref_relu(double x) {
  return x > 0 ? x : 0.0;
}
double ref_tanh(double x) {
  return std::tanh(x);
}

// Applies row(in, out) to every row of the last axis.
template <class F>
std::vector<double> by_rows(const std::vector<double>& x, std::size_t cols, F row) {
  std::vector<double> y(x.size());
  for (std::size_t r = 0; cols != 0 && r < x.size() / cols; ++r) {
    row(&x[r * cols], &y[r * cols], cols);
  }
  return y;
}

void ref_softmax_row(const double* x, double* y, std::size_t n) {
  double m = x[0];
  for (std::size_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  double s = 0;
  for (std::size_t j = 0; j < n; ++j) s += std::exp(x[j] - m);
  for (std::size_t j = 0; j < n; ++j) y[j] = std::exp(x[j] - m) / s;
}

void ref_log_softmax_row(const double* x, double* y, std::size_t n) {
  double m = x[0];
  for (std::size_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  double s = 0;
  for (std::size_t j = 0; j < n; ++j) s += std::exp(x[j] - m);
  for (std::size_t j = 0; j < n; ++j) y[j] = x[j] - m - std::log(s);
}

std::vector<double> ref_layer_norm(const std::vector<double>& x, std::size_t cols, double eps) {
  return by_rows(x, cols, [eps](const double* in, double* out, std::size_t n) {
    double mean = 0;
    for (std::size_t j = 0; j < n; ++j) mean += in[j] / static_cast<double>(n);
    double var = 0;
    for (std::size_t j = 0; j < n; ++j)
      var += (in[j] - mean) * (in[j] - mean) / static_cast<double>(n);
    for (std::size_t j = 0; j < n; ++j) out[j] = (in[j] - mean) / std::sqrt(var + eps);
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Registration

TEST_CASE("Ops.NN.EveryOpIsRegisteredForCpuF32AndF64") {
  for (const char* op : {"relu",
                         "gelu",
                         "tanh",
                         "sigmoid",
                         "relu_grad",
                         "gelu_grad",
                         "tanh_grad",
                         "sigmoid_grad",
                         "softmax",
                         "log_softmax",
                         "softmax_grad",
                         "log_softmax_grad",
                         "softmax_cross_entropy",
                         "softmax_cross_entropy_grad",
                         "mse",
                         "mse_grad",
                         "layer_norm",
                         "layer_norm_grad",
                         "embedding",
                         "embedding_grad",
                         "causal_mask",
                         "dropout"}) {
    CAPTURE(op);
    CHECK(registry().contains(op, DeviceType::cpu, DType::f32));
    CHECK(registry().contains(op, DeviceType::cpu, DType::f64));
  }
  auto builtin = KernelRegistry::with_builtin_kernels();
  CHECK(builtin.contains("softmax_cross_entropy", DeviceType::cpu, DType::f32));
}

// ---------------------------------------------------------------------------------------------
// Activations

TEST_CASE_TEMPLATE("Ops.Activations.MatchReference", T, float, double) {
  std::mt19937 rng(11);
  struct Case {
    const char* op;
    double (*ref)(double);
  };
  for (Case c : {Case{"relu", ref_relu}, Case{"gelu", ref_gelu}, Case{"tanh", ref_tanh},
                 Case{"sigmoid", ref_sigmoid}}) {
    for (const Shape& shape : {Shape{}, Shape{4, 7}, Shape{2, 3, 5}, Shape{1000}}) {
      CAPTURE(c.op);
      CAPTURE(baton::to_string(shape));
      Tensor x = random_tensor<T>(shape, rng, 3.0);
      Tensor y = apply<T>(c.op, {x}, shape);
      std::vector<double> want;
      for (double v : values(x)) want.push_back(c.ref(v));
      check_forward<T>(y, want);
    }
  }
}

// GELU's tanh form (attribute approximate "tanh"): torch's formula, forward within the element
// type's rounding (check_forward), gradient by central differences; large inputs stay finite
// (tanh saturates); an unknown form is refused by name.
TEST_CASE_TEMPLATE("Ops.Activations.GeluTanhIsTorchsApproximation", T, float, double) {
  std::mt19937 rng(13);
  const Attrs tanh_form{{"approximate", std::string("tanh")}};
  for (const Shape& shape : {Shape{}, Shape{4, 7}, Shape{1000}}) {
    CAPTURE(baton::to_string(shape));
    Tensor x = random_tensor<T>(shape, rng, 4.0);
    std::vector<double> want;
    for (double v : values(x)) want.push_back(ref_gelu_tanh(v));
    check_forward<T>(apply<T>("gelu", {x}, shape, tanh_form), want);
  }
  Tensor big = make_tensor<T>({6}, {-1000, -100, -30, 30, 100, 1000});
  check_forward<T>(apply<T>("gelu", {big}, {6}, tanh_form), {0, 0, 0, 30, 100, 1000});
  if constexpr (std::is_same_v<T, double>) {
    for (const Shape& shape : {Shape{5}, Shape{3, 4}}) {
      Tensor x = random_tensor<double>(shape, rng, 3.0);
      Tensor dy = random_tensor<double>(shape, rng);
      Tensor dx = apply<double>("gelu_grad", {x, dy}, shape, tanh_form);
      check_gradient(dx, vjp_by_differences("gelu", {x}, 0, dy, tanh_form));
    }
  }
  CHECK_THROWS_WITH_AS(apply<T>("gelu", {make_tensor<T>({1}, {1})}, {1}, Attrs{{"approximate", std::string("fast")}}),
                       doctest::Contains("attribute approximate must be \"none\" or \"tanh\", not \"fast\""),
                       std::invalid_argument);
}

TEST_CASE_TEMPLATE("Ops.Activations.StayFiniteForLargeInputs", T, float, double) {
  Tensor x = make_tensor<T>({6}, {-1000, -100, -30, 30, 100, 1000});
  check_forward<T>(apply<T>("sigmoid", {x}, {6}),
                   {0, ref_sigmoid(-100), ref_sigmoid(-30), ref_sigmoid(30), 1, 1});
  check_forward<T>(apply<T>("tanh", {x}, {6}), {-1, -1, -1, 1, 1, 1});
  check_forward<T>(apply<T>("gelu", {x}, {6}), {0, 0, 0, 30, 100, 1000});
  check_forward<T>(apply<T>("relu", {x}, {6}), {0, 0, 0, 30, 100, 1000});
}

TEST_CASE("Ops.Activations.GradientsMatchFiniteDifferences") {
  std::mt19937 rng(12);
  for (const Shape& shape : {Shape{5}, Shape{3, 4}, Shape{2, 2, 3}}) {
    CAPTURE(baton::to_string(shape));
    Tensor x = random_tensor<double>(shape, rng, 2.0);
    // relu's kink at 0 has no derivative to difference.
    for (auto& v : x.data<double>()) {
      if (std::abs(v) < 1e-2) v = 0.5;
    }
    Tensor dy = random_tensor<double>(shape, rng);
    for (const char* op : {"relu", "gelu"}) {
      CAPTURE(op);
      Tensor dx = apply<double>(std::string(op) + "_grad", {x, dy}, shape);
      check_gradient(dx, vjp_by_differences(op, {x}, 0, dy));
    }
    // tanh and sigmoid take the forward output y.
    for (const char* op : {"tanh", "sigmoid"}) {
      CAPTURE(op);
      Tensor y = apply<double>(op, {x}, shape);
      Tensor dx = apply<double>(std::string(op) + "_grad", {y, dy}, shape);
      check_gradient(dx, vjp_by_differences(op, {x}, 0, dy));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Softmax and log-softmax

TEST_CASE_TEMPLATE("Ops.Softmax.MatchesReference", T, float, double) {
  std::mt19937 rng(21);
  for (const Shape& shape : row_shapes) {
    CAPTURE(baton::to_string(shape));
    Tensor x = random_tensor<T>(shape, rng, 3.0);
    check_forward<T>(apply<T>("softmax", {x}, shape),
                     by_rows(values(x), last_dim(shape), ref_softmax_row));
    check_forward<T>(apply<T>("log_softmax", {x}, shape),
                     by_rows(values(x), last_dim(shape), ref_log_softmax_row));
  }
}

TEST_CASE_TEMPLATE("Ops.Softmax.StableForLargeLogits", T, float, double) {
  // exp(1000) overflows even a double: only the max subtraction keeps these finite.
  Tensor x = make_tensor<T>({2, 3}, {1000, 1001, 1002, -1000, -1001, -1002});
  const double e1 = std::exp(-1.0);
  const double e2 = std::exp(-2.0);
  const double s = 1 + e1 + e2;
  check_forward<T>(apply<T>("softmax", {x}, {2, 3}),
                   {e2 / s, e1 / s, 1 / s, 1 / s, e1 / s, e2 / s});
  const double ls = std::log(s);
  check_forward<T>(apply<T>("log_softmax", {x}, {2, 3}),
                   {-2 - ls, -1 - ls, -ls, -ls, -1 - ls, -2 - ls});
}

TEST_CASE("Ops.Softmax.GradientMatchesFiniteDifferences") {
  std::mt19937 rng(22);
  for (const Shape& shape : {Shape{3, 5}, Shape{2, 2, 4}, Shape{1, 1}}) {
    CAPTURE(baton::to_string(shape));
    Tensor x = random_tensor<double>(shape, rng, 2.0);
    Tensor dy = random_tensor<double>(shape, rng);
    Tensor y = apply<double>("softmax", {x}, shape);
    check_gradient(apply<double>("softmax_grad", {y, dy}, shape),
                   vjp_by_differences("softmax", {x}, 0, dy));
  }
}

TEST_CASE("Ops.LogSoftmax.GradientMatchesFiniteDifferences") {
  std::mt19937 rng(23);
  for (const Shape& shape : {Shape{3, 5}, Shape{2, 2, 4}, Shape{1, 1}}) {
    CAPTURE(baton::to_string(shape));
    Tensor x = random_tensor<double>(shape, rng, 2.0);
    Tensor dy = random_tensor<double>(shape, rng);
    Tensor y = apply<double>("log_softmax", {x}, shape);
    check_gradient(apply<double>("log_softmax_grad", {y, dy}, shape),
                   vjp_by_differences("log_softmax", {x}, 0, dy));
  }
}

// ---------------------------------------------------------------------------------------------
// Losses

TEST_CASE_TEMPLATE("Ops.SoftmaxCrossEntropy.MatchesReference", T, float, double) {
  std::mt19937 rng(31);
  for (const Shape& shape : {Shape{4, 7}, Shape{1, 1}, Shape{16, 10}, Shape{3, 100}}) {
    CAPTURE(baton::to_string(shape));
    Tensor logits = random_tensor<T>(shape, rng, 3.0);
    Tensor labels = random_ids({shape[0]}, static_cast<std::int32_t>(shape[1]), rng);
    const std::size_t cols = last_dim(shape);
    auto logp = by_rows(values(logits), cols, ref_log_softmax_row);
    double loss = 0;
    for (std::size_t r = 0; r < labels.data<std::int32_t>().size(); ++r) {
      loss -= logp[r * cols + static_cast<std::size_t>(labels.data<std::int32_t>()[r])];
    }
    loss /= static_cast<double>(shape[0]);
    check_forward<T>(apply<T>("softmax_cross_entropy", {logits, labels}, {}), {loss});
  }
}

TEST_CASE("Ops.SoftmaxCrossEntropy.GradientMatchesFiniteDifferences") {
  std::mt19937 rng(32);
  for (const Shape& shape : {Shape{4, 5}, Shape{1, 3}, Shape{6, 2}}) {
    CAPTURE(baton::to_string(shape));
    Tensor logits = random_tensor<double>(shape, rng, 2.0);
    Tensor labels = random_ids({shape[0]}, static_cast<std::int32_t>(shape[1]), rng);
    const double g = 0.7;
    Tensor dloss = make_tensor<double>({}, {g});
    Tensor dlogits = apply<double>("softmax_cross_entropy_grad", {logits, labels, dloss}, shape);
    auto fd = finite_differences(logits, [&] {
      return values(apply<double>("softmax_cross_entropy", {logits, labels}, {}))[0];
    });
    for (auto& v : fd) v *= g;
    check_gradient(dlogits, fd);
  }
}

TEST_CASE("Ops.SoftmaxCrossEntropy.LabelOutsideClassesThrowsNamingRowAndLabel") {
  Tensor logits = make_tensor<float>({3, 5}, std::vector<double>(15, 0.0));
  Tensor dloss = make_tensor<float>({}, {1.0});
  for (auto [labels, row, label] : {std::tuple{std::vector<std::int32_t>{0, 5, 1}, 1, 5},
                                    std::tuple{std::vector<std::int32_t>{-1, 0, 1}, 0, -1},
                                    std::tuple{std::vector<std::int32_t>{0, 4, 99}, 2, 99}}) {
    Tensor l = make_ids({3}, labels);
    for (const char* op : {"softmax_cross_entropy", "softmax_cross_entropy_grad"}) {
      CAPTURE(op);
      std::string msg = thrown_message<std::invalid_argument>([&] {
        if (std::string_view(op) == "softmax_cross_entropy") {
          (void)apply<float>(op, {logits, l}, {});
        } else {
          (void)apply<float>(op, {logits, l, dloss}, {3, 5});
        }
      });
      CHECK(contains(msg, op));
      CHECK(contains(msg, "label " + std::to_string(label)));
      CHECK(contains(msg, "row " + std::to_string(row)));
    }
  }
}

TEST_CASE_TEMPLATE("Ops.Mse.MatchesReference", T, float, double) {
  std::mt19937 rng(33);
  for (const Shape& shape : {Shape{}, Shape{4, 7}, Shape{2, 3, 5}, Shape{1000}}) {
    CAPTURE(baton::to_string(shape));
    Tensor pred = random_tensor<T>(shape, rng);
    Tensor target = random_tensor<T>(shape, rng);
    auto p = values(pred);
    auto t = values(target);
    double loss = 0;
    for (std::size_t i = 0; i < p.size(); ++i) loss += (p[i] - t[i]) * (p[i] - t[i]);
    loss /= static_cast<double>(p.size());
    check_forward<T>(apply<T>("mse", {pred, target}, {}), {loss});
  }
}

TEST_CASE("Ops.Mse.GradientMatchesFiniteDifferences") {
  std::mt19937 rng(34);
  for (const Shape& shape : {Shape{}, Shape{3, 4}, Shape{2, 2, 3}}) {
    CAPTURE(baton::to_string(shape));
    Tensor pred = random_tensor<double>(shape, rng);
    Tensor target = random_tensor<double>(shape, rng);
    const double g = -1.3;
    Tensor dloss = make_tensor<double>({}, {g});
    Tensor dpred = apply<double>("mse_grad", {pred, target, dloss}, shape);
    auto fd = finite_differences(pred, [&] {
      return values(apply<double>("mse", {pred, target}, {}))[0];
    });
    for (auto& v : fd) v *= g;
    check_gradient(dpred, fd);
  }
}

// ---------------------------------------------------------------------------------------------
// Layer norm

TEST_CASE_TEMPLATE("Ops.LayerNorm.MatchesReference", T, float, double) {
  std::mt19937 rng(41);
  for (const Shape& shape : {Shape{4, 7}, Shape{2, 3, 16}, Shape{3, 64}, Shape{5, 1}}) {
    for (double eps : {1e-5, 0.5}) {
      CAPTURE(baton::to_string(shape));
      CAPTURE(eps);
      // An offset and scale the normalisation removes.
      Tensor x = random_tensor<T>(shape, rng, 4.0);
      for (auto& v : x.data<T>()) v += T(3);
      Attrs attrs;
      if (eps != 1e-5) attrs.set("eps", eps);  // 1e-5 is the default
      check_forward<T>(apply<T>("layer_norm", {x}, shape, attrs),
                       ref_layer_norm(values(x), last_dim(shape), eps));
    }
  }
}

TEST_CASE("Ops.LayerNorm.GradientMatchesFiniteDifferences") {
  std::mt19937 rng(42);
  for (const Shape& shape : {Shape{3, 5}, Shape{2, 2, 6}, Shape{1, 2}}) {
    for (double eps : {1e-5, 0.5}) {
      CAPTURE(baton::to_string(shape));
      CAPTURE(eps);
      Attrs attrs{{"eps", eps}};
      Tensor x = random_tensor<double>(shape, rng, 2.0);
      Tensor dy = random_tensor<double>(shape, rng);
      check_gradient(apply<double>("layer_norm_grad", {x, dy}, shape, attrs),
                     vjp_by_differences("layer_norm", {x}, 0, dy, attrs));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST_CASE_TEMPLATE("Ops.Embedding.MatchesReference", T, float, double) {
  std::mt19937 rng(51);
  for (const Shape& ids_shape : {Shape{5}, Shape{2, 3}, Shape{}, Shape{2, 2, 2}}) {
    CAPTURE(baton::to_string(ids_shape));
    const std::int64_t vocab = 11;
    const std::int64_t d = 6;
    Tensor table = random_tensor<T>({vocab, d}, rng);
    Tensor ids = random_ids(ids_shape, static_cast<std::int32_t>(vocab), rng);
    Shape out_shape = ids_shape;
    out_shape.push_back(d);
    auto t = values(table);
    std::vector<double> want;
    for (std::int32_t id : ids.data<std::int32_t>()) {
      for (std::int64_t j = 0; j < d; ++j) want.push_back(t[static_cast<std::size_t>(id * d + j)]);
    }
    check_forward<T>(apply<T>("embedding", {table, ids}, out_shape), want);
  }
}

TEST_CASE("Ops.Embedding.GradientMatchesFiniteDifferences") {
  std::mt19937 rng(52);
  // Repeated ids accumulate; id 3 and 5 never occur, so their rows stay zero.
  Tensor ids = make_ids({2, 3}, {0, 2, 0, 4, 1, 2});
  Tensor table = random_tensor<double>({6, 4}, rng);
  Tensor dy = random_tensor<double>({2, 3, 4}, rng);
  Tensor dtable = apply<double>("embedding_grad", {ids, dy}, {6, 4});
  check_gradient(dtable, vjp_by_differences("embedding", {table, ids}, 0, dy));
  for (std::size_t j = 0; j < 4; ++j) {
    CHECK(dtable.data<double>()[3 * 4 + j] == 0.0);
    CHECK(dtable.data<double>()[5 * 4 + j] == 0.0);
  }
}

TEST_CASE("Ops.Embedding.IdOutsideVocabularyThrowsNamingIt") {
  Tensor table = make_tensor<float>({8, 2}, std::vector<double>(16, 1.0));
  for (std::int32_t bad : {8, -1, 1000}) {
    CAPTURE(bad);
    Tensor ids = make_ids({3}, {0, bad, 1});
    std::string msg = thrown_message<std::invalid_argument>([&] {
      (void)apply<float>("embedding", {table, ids}, {3, 2});
    });
    CHECK(contains(msg, "embedding"));
    CHECK(contains(msg, "id " + std::to_string(bad)));
    CHECK(contains(msg, "[0, 8)"));
    Tensor dy = make_tensor<float>({3, 2}, std::vector<double>(6, 1.0));
    msg = thrown_message<std::invalid_argument>([&] {
      (void)apply<float>("embedding_grad", {ids, dy}, {8, 2});
    });
    CHECK(contains(msg, "embedding_grad"));
    CHECK(contains(msg, "id " + std::to_string(bad)));
  }
}

// ---------------------------------------------------------------------------------------------
// Causal mask

TEST_CASE_TEMPLATE("Ops.CausalMask.ReplacesAboveTheDiagonal", T, float, double) {
  std::mt19937 rng(61);
  for (const Shape& shape : {Shape{4, 4}, Shape{2, 3, 5, 5}, Shape{1, 1}}) {
    for (double value : {-infinity, -1e9, 0.0}) {
      CAPTURE(baton::to_string(shape));
      CAPTURE(value);
      Tensor x = random_tensor<T>(shape, rng);
      Tensor y = apply<T>("causal_mask", {x}, shape, Attrs{{"value", value}});
      const std::size_t t = last_dim(shape);
      auto xv = values(x);
      std::vector<double> want(xv.size());
      for (std::size_t k = 0; k < xv.size(); ++k) {
        const std::size_t i = (k / t) % t;
        const std::size_t j = k % t;
        want[k] = j > i ? static_cast<double>(static_cast<T>(value)) : xv[k];
      }
      check_forward<T>(y, want);
    }
  }
}

TEST_CASE_TEMPLATE("Ops.CausalMask.ThenSoftmaxGivesZerosAboveTheDiagonal", T, float, double) {
  std::mt19937 rng(62);
  const Shape shape{2, 6, 6};
  Tensor x = random_tensor<T>(shape, rng, 3.0);
  Tensor masked = apply<T>("causal_mask", {x}, shape);  // value defaults to -infinity
  Tensor y = apply<T>("softmax", {masked}, shape);
  auto p = values(y);
  for (std::size_t row = 0; row < 12; ++row) {
    const std::size_t i = row % 6;
    double sum = 0;
    for (std::size_t j = 0; j < 6; ++j) {
      const double v = p[row * 6 + j];
      if (j > i) CHECK(v == 0.0);
      sum += v;
    }
    // A row of at most 6 probabilities: its f32 sum is 1 within 6 u = 4e-7 (1e-6 for both dtypes;
    // f64 is far inside). Row 0 has one unmasked entry: exp(0) / exp(0), 1 within one rounding.
    CHECK(sum == doctest::Approx(1.0).epsilon(1e-6));
    if (i == 0) CHECK(p[row * 6] == doctest::Approx(1.0).epsilon(1e-7));
  }
}

// ---------------------------------------------------------------------------------------------
// Dropout

TEST_CASE_TEMPLATE("Ops.Dropout.MaskIsAFunctionOfSeedPieceAndIndex", T, float, double) {
  std::mt19937 rng(71);
  const Shape shape{64, 64};
  const std::int64_t n = 64 * 64;
  Tensor x = random_tensor<T>(shape, rng);
  const Attrs attrs{{"p", 0.5}, {"seed", std::int64_t{7}}};
  auto a = values(apply<T>("dropout", {x}, shape, attrs, 3));
  auto same = values(apply<T>("dropout", {x}, shape, attrs, 3));
  auto other_piece = values(apply<T>("dropout", {x}, shape, attrs, 4));
  auto other_seed =
      values(apply<T>("dropout", {x}, shape, Attrs{{"p", 0.5}, {"seed", std::int64_t{8}}}, 3));
  CHECK(a == same);
  auto differing = [&](const std::vector<double>& b) {
    std::int64_t count = 0;
    for (std::size_t i = 0; i < a.size(); ++i) count += (a[i] == 0.0) != (b[i] == 0.0);
    return count;
  };
  // Independent masks differ in about half the places (2 p (1 - p) = 0.5).
  CHECK(differing(other_piece) > n / 3);
  CHECK(differing(other_seed) > n / 3);
  // A prefix of a longer tensor draws the same mask: index i's draw does not depend on the size.
  Tensor longer = random_tensor<T>({2 * n}, rng);
  for (std::int64_t i = 0; i < n; ++i) {
    longer.data<T>()[static_cast<std::size_t>(i)] = x.data<T>()[static_cast<std::size_t>(i)];
  }
  auto l = values(apply<T>("dropout", {longer}, {2 * n}, attrs, 3));
  CHECK(std::vector<double>(l.begin(), l.begin() + n) == a);
}

TEST_CASE_TEMPLATE("Ops.Dropout.KeepsOneMinusPAndScales", T, float, double) {
  std::mt19937 rng(72);
  const std::int64_t n = 100'000;
  Tensor x = random_tensor<T>({n}, rng);
  for (auto& v : x.data<T>()) {
    if (v == T(0)) v = T(1);
  }
  for (double p : {0.1, 0.3, 0.9}) {
    CAPTURE(p);
    Tensor y = apply<T>("dropout", {x}, {n}, Attrs{{"p", p}, {"seed", std::int64_t{1}}}, 5);
    auto xv = values(x);
    auto yv = values(y);
    const double scale = static_cast<double>(static_cast<T>(1.0 / (1.0 - p)));
    std::int64_t kept = 0;
    std::vector<double> want(yv.size());
    for (std::size_t i = 0; i < yv.size(); ++i) {
      const bool keep = yv[i] != 0.0;
      kept += keep;
      want[i] = keep ? xv[i] * scale : 0.0;
    }
    check_forward<T>(y, want);
    const double expected = static_cast<double>(n) * (1 - p);
    const double sigma = std::sqrt(static_cast<double>(n) * p * (1 - p));
    CHECK(std::abs(static_cast<double>(kept) - expected) < 5 * sigma);
  }
}

TEST_CASE_TEMPLATE("Ops.Dropout.ZeroPIsIdentityAndOnePDropsAll", T, float, double) {
  std::mt19937 rng(73);
  Tensor x = random_tensor<T>({3, 50}, rng);
  CHECK(values(apply<T>("dropout", {x}, {3, 50}, Attrs{{"p", 0.0}, {"seed", std::int64_t{9}}},
                        2)) == values(x));
  CHECK(values(apply<T>("dropout", {x}, {3, 50}, Attrs{{"p", 1.0}, {"seed", std::int64_t{9}}},
                        2)) == std::vector<double>(150, 0.0));
}

TEST_CASE("Ops.Dropout.OfTheUpstreamGradientIsTheGradient") {
  std::mt19937 rng(74);
  const Shape shape{4, 5};
  const Attrs attrs{{"p", 0.4}, {"seed", std::int64_t{123}}};
  const std::int64_t piece = 17;
  Tensor x = random_tensor<double>(shape, rng);
  Tensor dy = random_tensor<double>(shape, rng);
  Tensor dx = apply<double>("dropout", {dy}, shape, attrs, piece);
  check_gradient(dx, vjp_by_differences("dropout", {x}, 0, dy, attrs, piece));
  // And the same elements survive in the forward output and the gradient.
  auto y = values(apply<double>("dropout", {x}, shape, attrs, piece));
  auto g = values(dx);
  for (std::size_t i = 0; i < y.size(); ++i) CHECK((y[i] == 0.0) == (g[i] == 0.0));
}

// ---------------------------------------------------------------------------------------------
// Mistakes fail with the op and the shapes

TEST_CASE("Ops.NN.ShapeMismatchThrowsNamingOpAndShapes") {
  struct Case {
    const char* op;
    std::vector<Tensor> inputs;
    Shape out;
    std::vector<std::string> expected;
  };
  Tensor x23 = Tensor::zeros({2, 3}, DType::f32);
  Tensor x32 = Tensor::zeros({3, 2}, DType::f32);
  Tensor x234 = Tensor::zeros({2, 3, 4}, DType::f32);
  Tensor scalar = Tensor::zeros({}, DType::f32);
  std::vector<Case> cases = {
      {"softmax", {x23}, {3, 2}, {"softmax", "f32[2, 3]", "f32[3, 2]"}},
      {"relu", {x23}, {6}, {"relu", "[2, 3]", "[6]"}},
      {"relu_grad", {x23, x32}, {2, 3}, {"relu_grad", "[2, 3]", "[3, 2]"}},
      {"log_softmax_grad", {x23, x23}, {2, 2}, {"log_softmax_grad", "dx", "[2, 2]"}},
      {"layer_norm", {scalar}, {}, {"layer_norm", "at least one axis", "f32[]"}},
      {"softmax_cross_entropy",
       {x23, Tensor::zeros({3}, DType::i32)},
       {},
       {"softmax_cross_entropy", "labels", "i32[3]", "f32[2, 3]"}},
      {"softmax_cross_entropy",
       {x234, Tensor::zeros({2}, DType::i32)},
       {},
       {"softmax_cross_entropy", "[N, C]", "[2, 3, 4]"}},
      {"softmax_cross_entropy",
       {x23, Tensor::zeros({2}, DType::i32)},
       {1},
       {"softmax_cross_entropy", "loss", "scalar", "[1]"}},
      {"mse", {x23, x32}, {}, {"mse", "[2, 3]", "[3, 2]"}},
      {"mse_grad", {x23, x23, x23}, {2, 3}, {"mse_grad", "dloss", "[2, 3]"}},
      {"causal_mask", {x234}, {2, 3, 4}, {"causal_mask", "[..., T, T]", "[2, 3, 4]"}},
      {"embedding",
       {x23, Tensor::zeros({4}, DType::i32)},
       {4, 2},
       {"embedding", "[4, 2]", "[4, 3]"}},
      {"embedding_grad",
       {Tensor::zeros({4}, DType::i32), x23},
       {5, 3},
       {"embedding_grad", "dy", "[2, 3]", "[4, 3]"}},
      {"dropout", {x23}, {3, 2}, {"dropout", "[2, 3]", "[3, 2]"}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.op);
    std::string msg =
        thrown_message<std::invalid_argument>([&] { (void)apply<float>(c.op, c.inputs, c.out); });
    CAPTURE(msg);
    for (const std::string& part : c.expected) CHECK(contains(msg, part));
  }
}

TEST_CASE("Ops.NN.WrongDtypeOrMissingInputThrows") {
  Tensor x = Tensor::zeros({2, 3}, DType::f64);
  std::string msg = thrown_message<std::invalid_argument>([&] {
    (void)apply<float>("softmax", {x}, {2, 3});
  });
  CHECK(contains(msg, "softmax"));
  CHECK(contains(msg, "must be f32"));
  CHECK(contains(msg, "f64[2, 3]"));

  Tensor logits = Tensor::zeros({2, 3}, DType::f32);
  Tensor float_labels = Tensor::zeros({2}, DType::f32);
  msg = thrown_message<std::invalid_argument>([&] {
    (void)apply<float>("softmax_cross_entropy", {logits, float_labels}, {});
  });
  CHECK(contains(msg, "labels must be i32"));

  Tensor ids = Tensor::zeros({2}, DType::i64);
  msg = thrown_message<std::invalid_argument>([&] {
    (void)apply<float>("embedding", {logits, ids}, {2, 3});
  });
  CHECK(contains(msg, "ids must be i32"));

  // An input with no piece yet (a null slot) is named.
  Tensor out = Tensor::zeros({2, 3}, DType::f32);
  msg = thrown_message<std::invalid_argument>([&] {
    run("relu_grad", DType::f32, {&logits, nullptr}, {&out});
  });
  CHECK(contains(msg, "relu_grad: input 1 (dy) is missing"));
}

TEST_CASE("Ops.NN.BadAttributesThrowNamingOpAndActor") {
  auto create = [](const char* op, const Attrs& attrs) {
    return thrown_message<std::invalid_argument>([&] {
      (void)registry().create(op, KernelConfig{"drop1", Device{}, DType::f32, attrs});
    });
  };
  for (double p : {-0.1, 1.5, quiet_nan}) {
    CAPTURE(p);
    std::string msg = create("dropout", Attrs{{"p", p}});
    CHECK(contains(msg, "dropout (actor 'drop1')"));
    CHECK(contains(msg, "p must be in [0, 1]"));
  }
  std::string msg = create("dropout", Attrs{{"p", std::string("half")}});
  CHECK(contains(msg, "dropout (actor 'drop1')"));
  CHECK(contains(msg, "'p'"));
  msg = create("layer_norm", Attrs{{"eps", -1.0}});
  CHECK(contains(msg, "layer_norm (actor 'drop1')"));
  CHECK(contains(msg, "eps"));
  msg = create("causal_mask", Attrs{{"value", std::string("-infinity")}});
  CHECK(contains(msg, "causal_mask (actor 'drop1')"));
}

// ---------------------------------------------------------------------------------------------
// Optimizers, against torch.optim's formulas (PyTorch 1.13) stepped by hand in double

namespace {

const std::vector<double> w0 = {0.5, -1.0, 2.0, 0.0};
const std::vector<std::vector<double>> grads = {
    {0.1, -0.2, 0.3, 0.05}, {-0.4, 0.1, 0.2, 0.0}, {0.3, 0.3, -0.1, -0.2}};

// got within tol of want, relative to max(1, |want|) (Approx's scale 1). The optimizer tests
// below take a few element-wise steps in double of values below 10, so a double result is
// within a few roundings, 1e-15 .. 1e-13 (sqrt and the bias corrections add one each per step);
// an f32 run within a few f32 roundings, 1e-6.
void check_values(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(tol).scale(1.0));
  }
}

}  // namespace

TEST_CASE("Optim.Sgd.MatchesTorchFormulasForThreeSteps") {
  for (baton::SgdConfig cfg :
       {baton::SgdConfig{}, baton::SgdConfig{.momentum = 0.9},
        baton::SgdConfig{.momentum = 0.9, .weight_decay = 0.1},
        baton::SgdConfig{.momentum = 0.8, .weight_decay = 0.05, .nesterov = true},
        baton::SgdConfig{.weight_decay = 0.2}}) {
    CAPTURE(cfg.momentum);
    CAPTURE(cfg.weight_decay);
    CAPTURE(cfg.nesterov);
    std::vector<double> w = w0;
    std::vector<double> buf(w.size(), quiet_nan);  // the first step must not read it
    std::vector<double> want = w0;
    std::vector<double> want_buf(w.size());
    const double lrs[] = {0.1, 0.05, 0.2};  // the scheduled lr differs per step
    for (std::int64_t step = 1; step <= 3; ++step) {
      const double lr = lrs[step - 1];
      const auto& g = grads[static_cast<std::size_t>(step - 1)];
      baton::sgd_step(std::span<double>(w), std::span<const double>(g), std::span<double>(buf), cfg,
                      step, lr);
      for (std::size_t i = 0; i < want.size(); ++i) {
        double d = g[i] + cfg.weight_decay * want[i];
        if (cfg.momentum != 0) {
          want_buf[i] = step == 1 ? d : cfg.momentum * want_buf[i] + d;
          d = cfg.nesterov ? d + cfg.momentum * want_buf[i] : want_buf[i];
        }
        want[i] -= lr * d;
      }
      CAPTURE(step);
      check_values(w, want, 1e-14);
    }
  }
  // One step by hand: plain SGD moves by lr * g. The hand values are decimal, not binary,
  // fractions: Approx's default (1.2e-5 relative) only allows for that; a wrong formula misses by
  // far more (0.05 and more here).
  std::vector<double> w = {1.0, -2.0};
  std::vector<double> g = {0.5, -0.25};
  baton::sgd_step(std::span<double>(w), std::span<const double>(g), {}, baton::SgdConfig{}, 1, 0.1);
  CHECK(w[0] == doctest::Approx(0.95));
  CHECK(w[1] == doctest::Approx(-1.975));
  // Momentum 0.9, second step: b = 0.9 * 0.5 + 0.5 = 0.95; w = 0.95 - 0.1 * 0.95 = 0.855.
  std::vector<double> buf(2);
  w = {1.0, -2.0};
  baton::SgdConfig momentum{.momentum = 0.9};
  baton::sgd_step(std::span<double>(w), std::span<const double>(g), std::span<double>(buf),
                  momentum, 1, 0.1);
  baton::sgd_step(std::span<double>(w), std::span<const double>(g), std::span<double>(buf),
                  momentum, 2, 0.1);
  CHECK(buf[0] == doctest::Approx(0.95));
  CHECK(w[0] == doctest::Approx(0.855));
}

namespace {

// torch.optim.Adam / AdamW's update for one element sequence, in double.
std::vector<double> reference_adam(const baton::AdamConfig& cfg, const std::vector<double>& lrs) {
  std::vector<double> w = w0;
  std::vector<double> m(w.size(), 0.0);
  std::vector<double> v(w.size(), 0.0);
  for (std::size_t s = 0; s < lrs.size(); ++s) {
    const double t = static_cast<double>(s + 1);
    const double lr = lrs[s];
    for (std::size_t i = 0; i < w.size(); ++i) {
      double g = grads[s][i];
      if (cfg.decoupled) {
        w[i] *= 1 - lr * cfg.weight_decay;
      } else {
        g += cfg.weight_decay * w[i];
      }
      m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * g;
      v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(cfg.beta1, t));
      const double v_hat = v[i] / (1 - std::pow(cfg.beta2, t));
      w[i] -= lr * m_hat / (std::sqrt(v_hat) + cfg.eps);
    }
  }
  return w;
}

template <class T>
std::vector<double> run_adam(const baton::AdamConfig& cfg, const std::vector<double>& lrs) {
  std::vector<T> w(w0.begin(), w0.end());
  std::vector<T> m(w.size(), T(0));
  std::vector<T> v(w.size(), T(0));
  for (std::size_t s = 0; s < lrs.size(); ++s) {
    std::vector<T> g(grads[s].begin(), grads[s].end());
    baton::adam_step(std::span<T>(w), std::span<const T>(g), std::span<T>(m), std::span<T>(v), cfg,
                     static_cast<std::int64_t>(s + 1), lrs[s]);
  }
  return {w.begin(), w.end()};
}

}  // namespace

TEST_CASE("Optim.Adam.MatchesTorchFormulasForThreeSteps") {
  const std::vector<double> lrs = {1e-2, 2e-2, 5e-3};
  for (baton::AdamConfig cfg :
       {baton::AdamConfig{}, baton::AdamConfig{.beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6},
        baton::AdamConfig{.weight_decay = 0.1},
        baton::AdamConfig{.weight_decay = 0.1, .decoupled = true}}) {
    CAPTURE(cfg.weight_decay);
    CAPTURE(cfg.decoupled);
    auto want = reference_adam(cfg, lrs);
    check_values(run_adam<double>(cfg, lrs), want, 1e-13);
    check_values(run_adam<float>(cfg, lrs), want, 1e-6);
  }
  // The first bias-corrected step is lr * g / (|g| + eps), whatever the betas.
  std::vector<double> w = {1.0, 1.0};
  std::vector<double> g = {0.3, -2.0};
  std::vector<double> m(2, 0.0);
  std::vector<double> v(2, 0.0);
  baton::adam_step(std::span<double>(w), std::span<const double>(g), std::span<double>(m),
                   std::span<double>(v), baton::AdamConfig{}, 1, 0.1);
  // One step in double: a handful of roundings of values below 2 (1e-14).
  CHECK(w[0] == doctest::Approx(1.0 - 0.1 * 0.3 / (0.3 + 1e-8)).epsilon(1e-14));
  CHECK(w[1] == doctest::Approx(1.0 + 0.1 * 2.0 / (2.0 + 1e-8)).epsilon(1e-14));
  CHECK(m[0] == doctest::Approx(0.1 * 0.3).epsilon(1e-14));
  CHECK(v[1] == doctest::Approx(0.001 * 4.0).epsilon(1e-14));
}

TEST_CASE("Optim.AdamW.DecaysTheWeightInsteadOfAddingL2ToTheGradient") {
  const double lr = 0.01;
  const double wd = 0.1;
  std::vector<double> g = {0.3, -0.2, 0.0};
  auto step = [&](const baton::AdamConfig& cfg, const std::vector<double>& grad) {
    std::vector<double> w = {1.0, -2.0, 0.5};
    std::vector<double> m(3, 0.0);
    std::vector<double> v(3, 0.0);
    baton::adam_step(std::span<double>(w), std::span<const double>(grad), std::span<double>(m),
                     std::span<double>(v), cfg, 1, lr);
    return w;
  };
  auto plain = step(baton::AdamConfig{}, g);
  auto adamw = step(baton::AdamConfig{.weight_decay = wd, .decoupled = true}, g);
  auto adam_l2 = step(baton::AdamConfig{.weight_decay = wd}, g);
  const std::vector<double> w_start = {1.0, -2.0, 0.5};
  std::vector<double> want_adamw(3);
  std::vector<double> g_l2(3);
  for (std::size_t i = 0; i < 3; ++i) {
    // AdamW: the same Adam step, from w * (1 - lr * wd).
    want_adamw[i] = plain[i] - lr * wd * w_start[i];
    g_l2[i] = g[i] + wd * w_start[i];
  }
  check_values(adamw, want_adamw, 1e-14);
  // Adam's weight decay is plain Adam fed g + wd * w.
  check_values(adam_l2, step(baton::AdamConfig{}, g_l2), 1e-15);
  // With a zero gradient, AdamW still shrinks the weight; Adam+L2's first step moves it by ~lr.
  CHECK(adamw[2] == doctest::Approx(0.5 * (1 - lr * wd)).epsilon(1e-14));
  // ~lr, not exactly: Adam's first step is lr g / (|g| + eps), eps = 1e-8 against g = wd w = 5e-3
  // here, so it falls short of lr by a relative 2e-6 of lr, below 1e-6 of the weight.
  CHECK(adam_l2[2] == doctest::Approx(0.5 - lr).epsilon(1e-6));
}

TEST_CASE("Optim.Steps.RejectMismatchedSizesAndStepZero") {
  std::vector<float> w(3);
  std::vector<float> g(3);
  std::vector<float> short_buf(2);
  std::vector<float> buf(3);
  std::string msg = thrown_message<std::invalid_argument>([&] {
    baton::sgd_step(std::span<float>(w), std::span<const float>(short_buf.data(), 2),
                    std::span<float>(buf), baton::SgdConfig{}, 1, 0.1);
  });
  CHECK(contains(msg, "sgd_step"));
  CHECK(contains(msg, "gradient"));
  msg = thrown_message<std::invalid_argument>([&] {
    baton::sgd_step(std::span<float>(w), std::span<const float>(g), std::span<float>(short_buf),
                    baton::SgdConfig{.momentum = 0.9}, 1, 0.1);
  });
  CHECK(contains(msg, "momentum buffer"));
  msg = thrown_message<std::invalid_argument>([&] {
    baton::sgd_step(std::span<float>(w), std::span<const float>(g), std::span<float>(buf),
                    baton::SgdConfig{.nesterov = true}, 1, 0.1);
  });
  CHECK(contains(msg, "nesterov"));
  msg = thrown_message<std::invalid_argument>([&] {
    baton::adam_step(std::span<float>(w), std::span<const float>(g), std::span<float>(buf),
                     std::span<float>(buf), baton::AdamConfig{}, 0, 0.1);
  });
  CHECK(contains(msg, "adam_step"));
  CHECK(contains(msg, "step counts from 1"));
  msg = thrown_message<std::invalid_argument>([&] {
    baton::adam_step(std::span<float>(w), std::span<const float>(g), std::span<float>(buf),
                     std::span<float>(short_buf), baton::AdamConfig{}, 1, 0.1);
  });
  CHECK(contains(msg, "v has 2 elements"));
}

TEST_CASE("Optim.LrSchedule.WarmsUpLinearlyThenFollowsTheCosine") {
  // 10 warm-up steps, then 100 steps of cosine. Closed forms in double: Approx's default
  // (1.2e-5 relative) is far above their few roundings, and far below a step off (>= 1e-2).
  CHECK(baton::lr_schedule(1.0, 0, 10, 110) == 0.0);
  CHECK(baton::lr_schedule(1.0, 5, 10, 110) == doctest::Approx(0.5));
  CHECK(baton::lr_schedule(2.0, 9, 10, 110) == doctest::Approx(1.8));
  CHECK(baton::lr_schedule(1.0, 10, 10, 110) == doctest::Approx(1.0));  // end of warm-up
  CHECK(baton::lr_schedule(1.0, 60, 10, 110) == doctest::Approx(0.5));  // cos(pi / 2) = 0
  CHECK(baton::lr_schedule(1.0, 35, 10, 110) ==
        doctest::Approx(0.5 * (1 + std::cos(std::numbers::pi * 0.25))));
  CHECK(baton::lr_schedule(1.0, 110, 10, 110) == doctest::Approx(0.0).scale(1.0));
  CHECK(baton::lr_schedule(1.0, 500, 10, 110) == doctest::Approx(0.0).scale(1.0));  // clamped
  // min_ratio is the floor the cosine decays to.
  CHECK(baton::lr_schedule(3e-4, 60, 10, 110, 0.1) == doctest::Approx(3e-4 * (0.1 + 0.9 * 0.5)));
  CHECK(baton::lr_schedule(3e-4, 110, 10, 110, 0.1) == doctest::Approx(3e-5));
  CHECK(baton::lr_schedule(3e-4, 1000, 10, 110, 0.1) == doctest::Approx(3e-5));
  // No warm-up: the cosine starts at base_lr.
  CHECK(baton::lr_schedule(1.0, 0, 0, 100) == doctest::Approx(1.0));
  CHECK_THROWS_AS((void)baton::lr_schedule(1.0, -1, 10, 110), std::invalid_argument);
}

TEST_CASE("Optim.ClipFactor.MatchesClipGradNorm") {
  // One division in double: within one rounding (1e-16), 1e-15 allows for the order of the sum.
  CHECK(baton::clip_factor(10.0, 1.0) == doctest::Approx(1.0 / (10.0 + 1e-6)).epsilon(1e-15));
  CHECK(baton::clip_factor(2.0, 5.0) == 1.0);
  CHECK(baton::clip_factor(0.0, 1.0) == 1.0);
  CHECK(baton::clip_factor(1.0, 1.0) < 1.0);  // the 1e-6 in the denominator
  CHECK(baton::clip_factor(infinity, 1.0) == 0.0);
  CHECK(std::isnan(baton::clip_factor(quiet_nan, 1.0)));
}
