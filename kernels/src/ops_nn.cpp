// The neural-network ops of ops.h on the CPU, for f32 and f64. Row-wise reductions (softmax's
// sum, layer norm's moments, the losses) accumulate in double for both element types, so an f32
// kernel is as accurate as its element type allows; the elementwise work stays in the element
// type, in plain loops over contiguous memory.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels/ops.h"
#include "gelu.h"
#include "kernel_args.h"
#include "baton/kernels/vmath.h"

namespace baton {

namespace {

// ---------------------------------------------------------------------------------------------
// Checking what a kernel relies on

using detail::need_input;
using detail::need_output;
using detail::check_dtype;
using detail::check_same_shape;
using detail::in_data;
using detail::out_data;

void check_scalar(const char* op, const Tensor& t, const char* role) {
  if (!t.shape().empty()) {
    throw std::invalid_argument(
        fmt::format("{}: {} must be a scalar [], got {}", op, role, t.describe()));
  }
}

std::size_t to_size(std::int64_t n) {
  return static_cast<std::size_t>(n);
}

// A tensor seen as rows over its last axis.
struct Rows {
  std::size_t rows = 0;
  std::size_t cols = 0;
};

Rows last_axis_rows(const char* op, const Tensor& x, const char* role) {
  if (x.shape().empty()) {
    throw std::invalid_argument(
        fmt::format("{}: {} needs at least one axis, got {}", op, role, x.describe()));
  }
  Rows r;
  r.cols = to_size(x.shape().back());
  r.rows = r.cols == 0 ? 0 : to_size(x.numel()) / r.cols;
  return r;
}

// Reads a kernel's attributes, naming the op and actor if one has the wrong type.
template <class F>
auto read_attrs(const KernelConfig& cfg, const char* op, F&& read) {
  try {
    return read();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): {}", op, cfg.actor, e.what()));
  }
}

// ---------------------------------------------------------------------------------------------
// Elementwise activations and their gradients (GELU's formulas: gelu.h)

struct Relu {
  static constexpr const char* name = "relu";
  // std::max(x, 0) keeps a NaN a NaN, as torch.relu does.
  template <class T>
  static T f(T x) {
    return std::max(x, T(0));
  }
};

struct Gelu {
  static constexpr const char* name = "gelu";
  // The erf form. float32 tensors go through vmath (the same formula, a vector at a time), the
  // others through f.
  template <class T>
  static T f(T x) {
    return detail::gelu_erf(x);
  }
  static void block(const float* x, float* y, std::size_t n) { vmath::gelu(x, nullptr, 1, y, n); }
};

struct GeluTanh {  // torch's gelu(approximate="tanh")
  static constexpr const char* name = "gelu";
  template <class T>
  static T f(T x) {
    return detail::gelu_tanh(x);
  }
};

struct Tanh {
  static constexpr const char* name = "tanh";
  template <class T>
  static T f(T x) {
    return std::tanh(x);
  }
};

struct Sigmoid {
  static constexpr const char* name = "sigmoid";
  // exp(-|x|) never overflows; the two branches are the same function.
  template <class T>
  static T f(T x) {
    T z = std::exp(-std::abs(x));
    T r = T(1) / (T(1) + z);
    return x >= T(0) ? r : z * r;
  }
};

struct ReluGrad {
  static constexpr const char* name = "relu_grad";
  static constexpr const char* in0 = "x";
  template <class T>
  static T f(T x, T dy) {
    return x > T(0) ? dy : T(0);
  }
};

struct GeluGrad {
  static constexpr const char* name = "gelu_grad";
  static constexpr const char* in0 = "x";
  template <class T>
  static T f(T x, T dy) {
    return detail::gelu_erf_grad(x, dy);
  }
  static void block(const float* x, const float* dy, float* dx, std::size_t n) {
    vmath::gelu_grad(x, nullptr, 1, dy, dx, n);
  }
};

struct GeluTanhGrad {
  static constexpr const char* name = "gelu_grad";
  static constexpr const char* in0 = "x";
  template <class T>
  static T f(T x, T dy) {
    return detail::gelu_tanh_grad(x, dy);
  }
};

struct TanhGrad {
  static constexpr const char* name = "tanh_grad";
  static constexpr const char* in0 = "y";
  template <class T>
  static T f(T y, T dy) {
    return dy * (T(1) - y * y);
  }
};

struct SigmoidGrad {
  static constexpr const char* name = "sigmoid_grad";
  static constexpr const char* in0 = "y";
  template <class T>
  static T f(T y, T dy) {
    return dy * y * (T(1) - y);
  }
};

template <class T, class Op>
void unary_kernel(KernelContext& ctx) {
  const Tensor& x = need_input(ctx, 0, Op::name, "x");
  Tensor& y = need_output(ctx, 0, Op::name, "y");
  check_same_shape(Op::name, x, "x", y, "y");
  const T* xp = in_data<T>(x, Op::name, "x");
  T* yp = out_data<T>(y, Op::name, "y");
  const std::size_t n = to_size(x.numel());
  if constexpr (std::is_same_v<T, float> && requires { Op::block(xp, yp, n); }) {
    Op::block(xp, yp, n);  // a vector at a time (baton/kernels/vmath.h)
  } else {
    for (std::size_t i = 0; i < n; ++i) yp[i] = Op::f(xp[i]);
  }
}

template <class T, class Op>
void grad_kernel(KernelContext& ctx) {
  const Tensor& a = need_input(ctx, 0, Op::name, Op::in0);
  const Tensor& dy = need_input(ctx, 1, Op::name, "dy");
  Tensor& dx = need_output(ctx, 0, Op::name, "dx");
  check_same_shape(Op::name, a, Op::in0, dy, "dy");
  check_same_shape(Op::name, a, Op::in0, dx, "dx");
  const T* ap = in_data<T>(a, Op::name, Op::in0);
  const T* dyp = in_data<T>(dy, Op::name, "dy");
  T* dxp = out_data<T>(dx, Op::name, "dx");
  const std::size_t n = to_size(a.numel());
  if constexpr (std::is_same_v<T, float> && requires { Op::block(ap, dyp, dxp, n); }) {
    Op::block(ap, dyp, dxp, n);
  } else {
    for (std::size_t i = 0; i < n; ++i) dxp[i] = Op::f(ap[i], dyp[i]);
  }
}

// bias_gelu(x, b) = gelu(x + b), b one bias per column of x [..., F]; its gradient with respect
// to x is gelu_grad(x + b, dy) (the bias's is that summed over the rows: sum_to, in the graph).
// The sum is rounded to T as the unfused add would round it, so that the fused op gives the
// unfused ops' bits.
template <class T, bool TanhForm>
void bias_gelu_kernel(KernelContext& ctx) {
  const char* op = "bias_gelu";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& b = need_input(ctx, 1, op, "b");
  Tensor& y = need_output(ctx, 0, op, "y");
  const auto f = to_size(detail::bias_columns(x, b, op));
  check_same_shape(op, x, "x", y, "y");
  const T* xp = in_data<T>(x, op, "x");
  const T* bp = in_data<T>(b, op, "b");
  T* yp = out_data<T>(y, op, "y");
  const std::size_t n = to_size(x.numel());
  if constexpr (TanhForm) {
    for (std::size_t i = 0; i < n; ++i) yp[i] = GeluTanh::f(static_cast<T>(xp[i] + bp[i % f]));
  } else if constexpr (std::is_same_v<T, float>) {
    vmath::gelu(xp, bp, f, yp, n);
  } else {
    for (std::size_t i = 0; i < n; ++i) yp[i] = Gelu::f(static_cast<T>(xp[i] + bp[i % f]));
  }
}

template <class T, bool TanhForm>
void bias_gelu_grad_kernel(KernelContext& ctx) {
  const char* op = "bias_gelu_grad";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& b = need_input(ctx, 1, op, "b");
  const Tensor& dy = need_input(ctx, 2, op, "dy");
  Tensor& dx = need_output(ctx, 0, op, "dx");
  const auto f = to_size(detail::bias_columns(x, b, op));
  check_same_shape(op, x, "x", dy, "dy");
  check_same_shape(op, x, "x", dx, "dx");
  const T* xp = in_data<T>(x, op, "x");
  const T* bp = in_data<T>(b, op, "b");
  const T* dyp = in_data<T>(dy, op, "dy");
  T* dxp = out_data<T>(dx, op, "dx");
  const std::size_t n = to_size(x.numel());
  if constexpr (TanhForm) {
    for (std::size_t i = 0; i < n; ++i) dxp[i] = GeluTanhGrad::f(static_cast<T>(xp[i] + bp[i % f]), dyp[i]);
  } else if constexpr (std::is_same_v<T, float>) {
    vmath::gelu_grad(xp, bp, f, dyp, dxp, n);
  } else {
    for (std::size_t i = 0; i < n; ++i) dxp[i] = GeluGrad::f(static_cast<T>(xp[i] + bp[i % f]), dyp[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Softmax and log-softmax over the last axis

// The sum of term(j) for j in [0, n), in double, over four partial sums (j mod 4) added as
// (s0 + s1) + (s2 + s3): four independent chains of additions instead of one, which left a
// row's sum waiting on each add in turn (layer norm was 22 of the CPU GPT's 355 ms a step),
// and a fixed order, so the same bits on every machine and every run.
template <class Term>
double row_sum(std::size_t n, Term&& term) {
  double s[4] = {0, 0, 0, 0};
  std::size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    s[0] += term(j);
    s[1] += term(j + 1);
    s[2] += term(j + 2);
    s[3] += term(j + 3);
  }
  for (; j < n; ++j) s[j % 4] += term(j);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

template <class T>
T row_max(const T* x, std::size_t n) {
  T m = n > 0 ? x[0] : T(0);
  for (std::size_t j = 1; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// The shared frame of the four row-wise ops: check the tensors, then run `row` on each row of
// the last axis. Forward: row(x, y, cols); gradient: row(y, dy, dx, cols).
template <class T, class Row>
void rowwise_kernel(KernelContext& ctx, const char* op, Row&& row) {
  const Tensor& x = need_input(ctx, 0, op, "x");
  Tensor& y = need_output(ctx, 0, op, "y");
  check_same_shape(op, x, "x", y, "y");
  auto [rows, cols] = last_axis_rows(op, x, "x");
  const T* xp = in_data<T>(x, op, "x");
  T* yp = out_data<T>(y, op, "y");
  for (std::size_t r = 0; r < rows; ++r) row(xp + r * cols, yp + r * cols, cols);
}

template <class T, class Row>
void rowwise_grad_kernel(KernelContext& ctx, const char* op, Row&& row) {
  const Tensor& y = need_input(ctx, 0, op, "y");
  const Tensor& dy = need_input(ctx, 1, op, "dy");
  Tensor& dx = need_output(ctx, 0, op, "dx");
  check_same_shape(op, y, "y", dy, "dy");
  check_same_shape(op, y, "y", dx, "dx");
  auto [rows, cols] = last_axis_rows(op, y, "y");
  const T* yp = in_data<T>(y, op, "y");
  const T* dyp = in_data<T>(dy, op, "dy");
  T* dxp = out_data<T>(dx, op, "dx");
  for (std::size_t r = 0; r < rows; ++r) row(yp + r * cols, dyp + r * cols, dxp + r * cols, cols);
}

// y[j] = exp(x[j] - shift): float32 a vector at a time (baton/kernels/vmath.h). y may be x.
template <class T>
void exp_shifted(const T* x, T shift, T* y, std::size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    vmath::exp_shifted(x, shift, y, n);
  } else {
    for (std::size_t j = 0; j < n; ++j) y[j] = std::exp(x[j] - shift);
  }
}

template <class T>
void softmax_kernel(KernelContext& ctx) {
  rowwise_kernel<T>(ctx, "softmax", [](const T* xr, T* yr, std::size_t cols) {
    const T mx = row_max(xr, cols);
    exp_shifted(xr, mx, yr, cols);
    const double sum = row_sum(cols, [&](std::size_t j) { return static_cast<double>(yr[j]); });
    const T inv = static_cast<T>(1.0 / sum);
    for (std::size_t j = 0; j < cols; ++j) yr[j] *= inv;
  });
}

template <class T>
void log_softmax_kernel(KernelContext& ctx) {
  rowwise_kernel<T>(ctx, "log_softmax", [](const T* xr, T* yr, std::size_t cols) {
    const T mx = row_max(xr, cols);
    exp_shifted(xr, mx, yr, cols);  // yr as scratch: overwritten below
    const double sum = row_sum(cols, [&](std::size_t j) { return static_cast<double>(yr[j]); });
    const double lse = static_cast<double>(mx) + std::log(sum);
    for (std::size_t j = 0; j < cols; ++j) yr[j] = static_cast<T>(static_cast<double>(xr[j]) - lse);
  });
}

// dx = y * (dy - sum(dy * y)): the softmax Jacobian (diag(y) - y y^T) applied to dy.
template <class T>
void softmax_grad_kernel(KernelContext& ctx) {
  rowwise_grad_kernel<T>(ctx, "softmax_grad", [](const T* yr, const T* dyr, T* dxr, std::size_t cols) {
    const double dot = row_sum(cols, [&](std::size_t j) { return static_cast<double>(yr[j]) * dyr[j]; });
    const T d = static_cast<T>(dot);
    for (std::size_t j = 0; j < cols; ++j) dxr[j] = yr[j] * (dyr[j] - d);
  });
}

// dx = dy - softmax(x) * sum(dy), with softmax(x) = exp(y).
template <class T>
void log_softmax_grad_kernel(KernelContext& ctx) {
  rowwise_grad_kernel<T>(ctx, "log_softmax_grad", [](const T* yr, const T* dyr, T* dxr, std::size_t cols) {
    const double sum = row_sum(cols, [&](std::size_t j) { return static_cast<double>(dyr[j]); });
    const T s = static_cast<T>(sum);
    exp_shifted(yr, T(0), dxr, cols);
    for (std::size_t j = 0; j < cols; ++j) dxr[j] = dyr[j] - dxr[j] * s;
  });
}

// ---------------------------------------------------------------------------------------------
// Losses

// Checks logits [N, C] and labels i32 [N]; returns the labels.
const std::int32_t* check_logits_labels(const char* op, const Tensor& logits,
                                        const Tensor& labels) {
  if (logits.shape().size() != 2) {
    throw std::invalid_argument(
        fmt::format("{}: logits must be [N, C], got {}", op, logits.describe()));
  }
  check_dtype(labels, DType::i32, op, "labels");
  if (labels.shape() != Shape{logits.dim(0)}) {
    throw std::invalid_argument(fmt::format("{}: labels {} must be [N] for logits {}", op,
                                            labels.describe(), logits.describe()));
  }
  return static_cast<const std::int32_t*>(labels.raw());
}

std::size_t checked_label(const char* op, const std::int32_t* labels, std::size_t row,
                          std::size_t classes) {
  const std::int32_t label = labels[row];
  if (label < 0 || static_cast<std::size_t>(label) >= classes) {
    throw std::invalid_argument(
        fmt::format("{}: label {} at row {} is outside [0, {})", op, label, row, classes));
  }
  return static_cast<std::size_t>(label);
}

// loss = mean over rows of logsumexp(logits[i]) - logits[i, label[i]].
template <class T>
void cross_entropy_kernel(KernelContext& ctx) {
  const char* op = "softmax_cross_entropy";
  const Tensor& logits = need_input(ctx, 0, op, "logits");
  const Tensor& labels = need_input(ctx, 1, op, "labels");
  Tensor& loss = need_output(ctx, 0, op, "loss");
  const std::int32_t* lp = check_logits_labels(op, logits, labels);
  check_scalar(op, loss, "loss");
  const T* xp = in_data<T>(logits, op, "logits");
  T* out = out_data<T>(loss, op, "loss");
  const std::size_t rows = to_size(logits.dim(0));
  const std::size_t cols = to_size(logits.dim(1));
  double total = 0;
  std::vector<T> row(cols);  // a row's exp(x - max)
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t label = checked_label(op, lp, r, cols);
    const T* xr = xp + r * cols;
    const T mx = row_max(xr, cols);
    exp_shifted(xr, mx, row.data(), cols);
    const double sum = row_sum(cols, [&](std::size_t j) { return static_cast<double>(row[j]); });
    total += static_cast<double>(mx) + std::log(sum) - static_cast<double>(xr[label]);
  }
  // An empty batch gives NaN (0 / 0), as torch's mean reduction does.
  out[0] = static_cast<T>(total / static_cast<double>(rows));
}

// dlogits = (softmax(logits) - onehot(labels)) * dloss / N.
template <class T>
void cross_entropy_grad_kernel(KernelContext& ctx) {
  const char* op = "softmax_cross_entropy_grad";
  const Tensor& logits = need_input(ctx, 0, op, "logits");
  const Tensor& labels = need_input(ctx, 1, op, "labels");
  const Tensor& dloss = need_input(ctx, 2, op, "dloss");
  Tensor& dlogits = need_output(ctx, 0, op, "dlogits");
  const std::int32_t* lp = check_logits_labels(op, logits, labels);
  check_scalar(op, dloss, "dloss");
  check_same_shape(op, logits, "logits", dlogits, "dlogits");
  const T* xp = in_data<T>(logits, op, "logits");
  const T* gp = in_data<T>(dloss, op, "dloss");
  T* dxp = out_data<T>(dlogits, op, "dlogits");
  const std::size_t rows = to_size(logits.dim(0));
  const std::size_t cols = to_size(logits.dim(1));
  const double g = static_cast<double>(gp[0]) / static_cast<double>(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t label = checked_label(op, lp, r, cols);
    const T* xr = xp + r * cols;
    T* dxr = dxp + r * cols;
    const T mx = row_max(xr, cols);
    exp_shifted(xr, mx, dxr, cols);
    const double sum = row_sum(cols, [&](std::size_t j) { return static_cast<double>(dxr[j]); });
    const T scale = static_cast<T>(g / sum);
    for (std::size_t j = 0; j < cols; ++j) dxr[j] *= scale;
    dxr[label] -= static_cast<T>(g);
  }
}

template <class T>
void mse_kernel(KernelContext& ctx) {
  const char* op = "mse";
  const Tensor& pred = need_input(ctx, 0, op, "pred");
  const Tensor& target = need_input(ctx, 1, op, "target");
  Tensor& loss = need_output(ctx, 0, op, "loss");
  check_same_shape(op, pred, "pred", target, "target");
  check_scalar(op, loss, "loss");
  const T* pp = in_data<T>(pred, op, "pred");
  const T* tp = in_data<T>(target, op, "target");
  T* out = out_data<T>(loss, op, "loss");
  const std::size_t n = to_size(pred.numel());
  double total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(pp[i]) - static_cast<double>(tp[i]);
    total += d * d;
  }
  out[0] = static_cast<T>(total / static_cast<double>(n));
}

template <class T>
void mse_grad_kernel(KernelContext& ctx) {
  const char* op = "mse_grad";
  const Tensor& pred = need_input(ctx, 0, op, "pred");
  const Tensor& target = need_input(ctx, 1, op, "target");
  const Tensor& dloss = need_input(ctx, 2, op, "dloss");
  Tensor& dpred = need_output(ctx, 0, op, "dpred");
  check_same_shape(op, pred, "pred", target, "target");
  check_same_shape(op, pred, "pred", dpred, "dpred");
  check_scalar(op, dloss, "dloss");
  const T* pp = in_data<T>(pred, op, "pred");
  const T* tp = in_data<T>(target, op, "target");
  const T* gp = in_data<T>(dloss, op, "dloss");
  T* dp = out_data<T>(dpred, op, "dpred");
  const std::size_t n = to_size(pred.numel());
  const T scale = static_cast<T>(2.0 * static_cast<double>(gp[0]) / static_cast<double>(n));
  for (std::size_t i = 0; i < n; ++i) dp[i] = scale * (pp[i] - tp[i]);
}

// ---------------------------------------------------------------------------------------------
// Layer norm over the last axis, without the affine part

struct Moments {
  double mean = 0;
  double rstd = 0;  // 1 / sqrt(var + eps), var the biased variance (as torch's layer_norm)
};

template <class T>
Moments row_moments(const T* x, std::size_t n, double eps) {
  const double mean = row_sum(n, [&](std::size_t j) { return static_cast<double>(x[j]); }) / static_cast<double>(n);
  const double sq = row_sum(n, [&](std::size_t j) {
    const double d = static_cast<double>(x[j]) - mean;
    return d * d;
  });
  return {mean, 1.0 / std::sqrt(sq / static_cast<double>(n) + eps)};
}

double read_eps(const KernelConfig& cfg, const char* op) {
  const double eps = read_attrs(cfg, op, [&] { return cfg.attrs.get_double("eps", 1e-5); });
  if (!(eps >= 0.0)) {
    throw std::invalid_argument(
        fmt::format("{} (actor '{}'): attribute eps must be >= 0, got {}", op, cfg.actor, eps));
  }
  return eps;
}

template <class T>
class LayerNormKernel final : public Kernel {
 public:
  explicit LayerNormKernel(double eps) : eps_(eps) {}
  void compute(KernelContext& ctx) override {
    const char* op = "layer_norm";
    const Tensor& x = need_input(ctx, 0, op, "x");
    Tensor& y = need_output(ctx, 0, op, "y");
    check_same_shape(op, x, "x", y, "y");
    auto [rows, cols] = last_axis_rows(op, x, "x");
    const T* xp = in_data<T>(x, op, "x");
    T* yp = out_data<T>(y, op, "y");
    for (std::size_t r = 0; r < rows; ++r) {
      const T* xr = xp + r * cols;
      T* yr = yp + r * cols;
      const Moments m = row_moments(xr, cols, eps_);
      for (std::size_t j = 0; j < cols; ++j) {
        yr[j] = static_cast<T>((static_cast<double>(xr[j]) - m.mean) * m.rstd);
      }
    }
  }

 private:
  double eps_;
};

// dx = rstd * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = (x - mean) * rstd.
template <class T>
class LayerNormGradKernel final : public Kernel {
 public:
  explicit LayerNormGradKernel(double eps) : eps_(eps) {}
  void compute(KernelContext& ctx) override {
    const char* op = "layer_norm_grad";
    const Tensor& x = need_input(ctx, 0, op, "x");
    const Tensor& dy = need_input(ctx, 1, op, "dy");
    Tensor& dx = need_output(ctx, 0, op, "dx");
    check_same_shape(op, x, "x", dy, "dy");
    check_same_shape(op, x, "x", dx, "dx");
    auto [rows, cols] = last_axis_rows(op, x, "x");
    const T* xp = in_data<T>(x, op, "x");
    const T* dyp = in_data<T>(dy, op, "dy");
    T* dxp = out_data<T>(dx, op, "dx");
    const double inv_n = 1.0 / static_cast<double>(cols);
    for (std::size_t r = 0; r < rows; ++r) {
      const T* xr = xp + r * cols;
      const T* dyr = dyp + r * cols;
      T* dxr = dxp + r * cols;
      const Moments m = row_moments(xr, cols, eps_);
      const double sum_dy = row_sum(cols, [&](std::size_t j) { return static_cast<double>(dyr[j]); });
      const double sum_dy_xhat = row_sum(cols, [&](std::size_t j) {
        const double xhat = (static_cast<double>(xr[j]) - m.mean) * m.rstd;
        return dyr[j] * xhat;
      });
      const double mean_dy = sum_dy * inv_n;
      const double mean_dy_xhat = sum_dy_xhat * inv_n;
      for (std::size_t j = 0; j < cols; ++j) {
        const double xhat = (static_cast<double>(xr[j]) - m.mean) * m.rstd;
        dxr[j] = static_cast<T>(m.rstd * (dyr[j] - mean_dy - xhat * mean_dy_xhat));
      }
    }
  }

 private:
  double eps_;
};

// ---------------------------------------------------------------------------------------------
// Embedding

// Checks that `rows` is ids' shape followed by [D].
void check_rows_of_ids(const char* op, const Tensor& ids, const Tensor& rows, const char* role,
                       std::int64_t d) {
  Shape want = ids.shape();
  want.push_back(d);
  if (rows.shape() != want) {
    throw std::invalid_argument(
        fmt::format("{}: {} {} must be ids' shape followed by [{}] ({}), ids {}", op, role,
                    rows.describe(), d, to_string(want), ids.describe()));
  }
}

std::size_t checked_id(const char* op, const std::int32_t* ids, std::size_t i, std::size_t vocab) {
  const std::int32_t id = ids[i];
  if (id < 0 || static_cast<std::size_t>(id) >= vocab) {
    throw std::invalid_argument(
        fmt::format("{}: id {} at position {} is outside [0, {})", op, id, i, vocab));
  }
  return static_cast<std::size_t>(id);
}

void check_table(const char* op, const Tensor& table, const char* role) {
  if (table.shape().size() != 2) {
    throw std::invalid_argument(
        fmt::format("{}: {} must be [V, D], got {}", op, role, table.describe()));
  }
}

// The rows a table holds: the whole vocabulary (no attributes: an id outside the table is an
// error), or one tensor-parallel shard of it (attributes vocab and vocab_start: rows
// [start, start + table rows) of a vocabulary [0, vocab); ids of other shards are not an error,
// they give zero rows and no gradient, as in Megatron-LM's VocabParallelEmbedding).
struct VocabRange {
  std::int64_t start = 0;
  std::int64_t vocab = -1;  // -1: the table's own rows

  bool sharded() const { return vocab >= 0; }
  // Checks that t, holding `entries` of the vocabulary (a table's rows, logits' columns), fits;
  // returns the size of the whole vocabulary.
  std::size_t check(const char* op, std::int64_t entries, const Tensor& t, const char* role) const {
    if (!sharded()) return to_size(entries);
    if (start + entries > vocab) {
      throw std::invalid_argument(
          fmt::format("{}: {} {} holds entries [{}, {}) of a vocabulary of only {}", op, role,
                      t.describe(), start, start + entries, vocab));
    }
    return to_size(vocab);
  }
};

VocabRange read_vocab_range(const KernelConfig& cfg, const char* op) {
  VocabRange r;
  read_attrs(cfg, op, [&] {
    r.start = cfg.attrs.get_int("vocab_start", 0);
    r.vocab = cfg.attrs.get_int("vocab", -1);
    return 0;
  });
  if (cfg.attrs.has("vocab_start") != cfg.attrs.has("vocab") ||
      (r.sharded() && (r.start < 0 || r.vocab < 1))) {
    throw std::invalid_argument(
        fmt::format("{} (actor '{}'): a shard of a vocabulary needs both attributes vocab >= 1 and "
                    "vocab_start >= 0, got {}",
                    op, cfg.actor, cfg.attrs.str()));
  }
  return r;
}

template <class T>
class EmbeddingKernel final : public Kernel {
 public:
  explicit EmbeddingKernel(VocabRange range) : range_(range) {}
  void compute(KernelContext& ctx) override {
    const char* op = "embedding";
    const Tensor& table = need_input(ctx, 0, op, "table");
    const Tensor& ids = need_input(ctx, 1, op, "ids");
    Tensor& y = need_output(ctx, 0, op, "y");
    check_table(op, table, "table");
    check_dtype(ids, DType::i32, op, "ids");
    check_rows_of_ids(op, ids, y, "y", table.dim(1));
    const std::size_t vocab = range_.check(op, table.dim(0), table, "table");
    const T* tp = in_data<T>(table, op, "table");
    const auto* ip = static_cast<const std::int32_t*>(ids.raw());
    T* yp = out_data<T>(y, op, "y");
    const auto start = to_size(range_.start);
    const std::size_t rows = to_size(table.dim(0));
    const std::size_t d = to_size(table.dim(1));
    const std::size_t n = to_size(ids.numel());
    for (std::size_t i = 0; i < n; ++i) {
      // Unsigned: an id below start wraps past rows.
      const std::size_t row = checked_id(op, ip, i, vocab) - start;
      if (row < rows) {
        if (d != 0) std::memcpy(yp + i * d, tp + row * d, d * sizeof(T));
      } else {
        std::fill(yp + i * d, yp + (i + 1) * d, T(0));
      }
    }
  }

 private:
  VocabRange range_;
};

// Scatter-add: dtable[id] += dy row, for every position; rows no id names stay zero.
template <class T>
class EmbeddingGradKernel final : public Kernel {
 public:
  explicit EmbeddingGradKernel(VocabRange range) : range_(range) {}
  void compute(KernelContext& ctx) override {
    const char* op = "embedding_grad";
    const Tensor& ids = need_input(ctx, 0, op, "ids");
    const Tensor& dy = need_input(ctx, 1, op, "dy");
    Tensor& dtable = need_output(ctx, 0, op, "dtable");
    check_table(op, dtable, "dtable");
    check_dtype(ids, DType::i32, op, "ids");
    check_rows_of_ids(op, ids, dy, "dy", dtable.dim(1));
    const std::size_t vocab = range_.check(op, dtable.dim(0), dtable, "dtable");
    const auto* ip = static_cast<const std::int32_t*>(ids.raw());
    const T* dyp = in_data<T>(dy, op, "dy");
    T* gp = out_data<T>(dtable, op, "dtable");
    const auto start = to_size(range_.start);
    const std::size_t rows = to_size(dtable.dim(0));
    const std::size_t d = to_size(dtable.dim(1));
    const std::size_t n = to_size(ids.numel());
    std::fill(gp, gp + rows * d, T(0));
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t r = checked_id(op, ip, i, vocab) - start;
      if (r >= rows) continue;  // another shard's row
      T* row = gp + r * d;
      const T* src = dyp + i * d;
      for (std::size_t j = 0; j < d; ++j) row[j] += src[j];
    }
  }

 private:
  VocabRange range_;
};

// ---------------------------------------------------------------------------------------------
// Vocabulary-parallel cross-entropy (Megatron-LM's vocab_parallel_cross_entropy)
//
// Shard k holds logits [N, C_k], classes [start, start + C_k) of [0, vocab). With M the row
// maxima over every shard, the shards' stats summed give S = sum_j exp(l_j - M) and T = l_label,
// and loss = mean(log S + M - T): the cross-entropy, without gathering the logits.

// Checks that `per_row` is [N, cols] ([N] if cols is 0) for logits [N, C].
void check_per_row(const char* op, const Tensor& logits, const Tensor& per_row, const char* role,
                   std::int64_t cols) {
  const Shape want = cols == 0 ? Shape{logits.dim(0)} : Shape{logits.dim(0), cols};
  if (per_row.shape() != want) {
    throw std::invalid_argument(fmt::format("{}: {} {} must be {} for logits {}", op, role,
                                            per_row.describe(), to_string(want),
                                            logits.describe()));
  }
}

// stats [N, 2]: (sum_j exp(logits[i, j] - row_max[i]), logits[i, label - start] or 0).
template <class T>
class VocabCeStatsKernel final : public Kernel {
 public:
  explicit VocabCeStatsKernel(VocabRange range) : range_(range) {}
  void compute(KernelContext& ctx) override {
    const char* op = "vocab_parallel_ce_stats";
    const Tensor& logits = need_input(ctx, 0, op, "logits");
    const Tensor& labels = need_input(ctx, 1, op, "labels");
    const Tensor& row_max = need_input(ctx, 2, op, "row_max");
    Tensor& stats = need_output(ctx, 0, op, "stats");
    const std::int32_t* lp = check_logits_labels(op, logits, labels);
    check_per_row(op, logits, row_max, "row_max", 0);
    check_per_row(op, logits, stats, "stats", 2);
    const std::size_t vocab = range_.check(op, logits.dim(1), logits, "logits");
    const T* xp = in_data<T>(logits, op, "logits");
    const T* mp = in_data<T>(row_max, op, "row_max");
    T* sp = out_data<T>(stats, op, "stats");
    const std::size_t rows = to_size(logits.dim(0));
    const std::size_t cols = to_size(logits.dim(1));
    std::vector<T> row(cols);  // a row's exp(x - max)
    for (std::size_t r = 0; r < rows; ++r) {
      const std::size_t col = checked_label(op, lp, r, vocab) - to_size(range_.start);
      const T* xr = xp + r * cols;
      exp_shifted(xr, mp[r], row.data(), cols);
      const double sum = row_sum(cols, [&](std::size_t j) { return static_cast<double>(row[j]); });
      sp[2 * r] = static_cast<T>(sum);
      sp[2 * r + 1] = col < cols ? xr[col] : T(0);
    }
  }

 private:
  VocabRange range_;
};

// dlogits = exp(logits - row_max) * dstats[:, 0] + onehot(label - start) * dstats[:, 1].
template <class T>
class VocabCeStatsGradKernel final : public Kernel {
 public:
  explicit VocabCeStatsGradKernel(VocabRange range) : range_(range) {}
  void compute(KernelContext& ctx) override {
    const char* op = "vocab_parallel_ce_stats_grad";
    const Tensor& logits = need_input(ctx, 0, op, "logits");
    const Tensor& labels = need_input(ctx, 1, op, "labels");
    const Tensor& row_max = need_input(ctx, 2, op, "row_max");
    const Tensor& dstats = need_input(ctx, 3, op, "dstats");
    Tensor& dlogits = need_output(ctx, 0, op, "dlogits");
    const std::int32_t* lp = check_logits_labels(op, logits, labels);
    check_per_row(op, logits, row_max, "row_max", 0);
    check_per_row(op, logits, dstats, "dstats", 2);
    check_same_shape(op, logits, "logits", dlogits, "dlogits");
    const std::size_t cols = to_size(logits.dim(1));
    const std::size_t vocab = range_.check(op, logits.dim(1), logits, "logits");
    const T* xp = in_data<T>(logits, op, "logits");
    const T* mp = in_data<T>(row_max, op, "row_max");
    const T* gp = in_data<T>(dstats, op, "dstats");
    T* dxp = out_data<T>(dlogits, op, "dlogits");
    const std::size_t rows = to_size(logits.dim(0));
    for (std::size_t r = 0; r < rows; ++r) {
      const std::size_t col = checked_label(op, lp, r, vocab) - to_size(range_.start);
      const T* xr = xp + r * cols;
      T* dxr = dxp + r * cols;
      const T d_sum = gp[2 * r];
      exp_shifted(xr, mp[r], dxr, cols);
      for (std::size_t j = 0; j < cols; ++j) dxr[j] *= d_sum;
      if (col < cols) dxr[col] += gp[2 * r + 1];
    }
  }

 private:
  VocabRange range_;
};

// loss = mean over rows of log(stats[i, 0]) + row_max[i] - stats[i, 1].
template <class T>
void vocab_ce_loss_kernel(KernelContext& ctx) {
  const char* op = "vocab_parallel_ce_loss";
  const Tensor& stats = need_input(ctx, 0, op, "stats");
  const Tensor& row_max = need_input(ctx, 1, op, "row_max");
  Tensor& loss = need_output(ctx, 0, op, "loss");
  if (stats.shape().size() != 2 || stats.dim(1) != 2 || row_max.shape() != Shape{stats.dim(0)}) {
    throw std::invalid_argument(
        fmt::format("{}: stats must be [N, 2] and row_max [N], got {} and {}", op, stats.describe(),
                    row_max.describe()));
  }
  check_scalar(op, loss, "loss");
  const T* sp = in_data<T>(stats, op, "stats");
  const T* mp = in_data<T>(row_max, op, "row_max");
  const std::size_t rows = to_size(stats.dim(0));
  double total = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    total += std::log(static_cast<double>(sp[2 * r])) + static_cast<double>(mp[r]) -
             static_cast<double>(sp[2 * r + 1]);
  }
  out_data<T>(loss, op, "loss")[0] = static_cast<T>(total / static_cast<double>(rows));
}

// dstats = (dloss / (N stats[i, 0]), -dloss / N) per row.
template <class T>
void vocab_ce_loss_grad_kernel(KernelContext& ctx) {
  const char* op = "vocab_parallel_ce_loss_grad";
  const Tensor& stats = need_input(ctx, 0, op, "stats");
  const Tensor& dloss = need_input(ctx, 1, op, "dloss");
  Tensor& dstats = need_output(ctx, 0, op, "dstats");
  if (stats.shape().size() != 2 || stats.dim(1) != 2) {
    throw std::invalid_argument(
        fmt::format("{}: stats must be [N, 2], got {}", op, stats.describe()));
  }
  check_scalar(op, dloss, "dloss");
  check_same_shape(op, stats, "stats", dstats, "dstats");
  const T* sp = in_data<T>(stats, op, "stats");
  T* dp = out_data<T>(dstats, op, "dstats");
  const std::size_t rows = to_size(stats.dim(0));
  const double g =
      static_cast<double>(in_data<T>(dloss, op, "dloss")[0]) / static_cast<double>(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    dp[2 * r] = static_cast<T>(g / static_cast<double>(sp[2 * r]));
    dp[2 * r + 1] = static_cast<T>(-g);
  }
}

// ---------------------------------------------------------------------------------------------
// Causal mask

template <class T>
class CausalMaskKernel final : public Kernel {
 public:
  explicit CausalMaskKernel(double value) : value_(static_cast<T>(value)) {}
  void compute(KernelContext& ctx) override {
    const char* op = "causal_mask";
    const Tensor& x = need_input(ctx, 0, op, "x");
    Tensor& y = need_output(ctx, 0, op, "y");
    check_same_shape(op, x, "x", y, "y");
    const Shape& s = x.shape();
    if (s.size() < 2 || s[s.size() - 1] != s[s.size() - 2]) {
      throw std::invalid_argument(
          fmt::format("{}: x must be [..., T, T], got {}", op, x.describe()));
    }
    const T* xp = in_data<T>(x, op, "x");
    T* yp = out_data<T>(y, op, "y");
    const std::size_t t = to_size(s.back());
    const std::size_t matrices = t == 0 ? 0 : to_size(x.numel()) / (t * t);
    for (std::size_t m = 0; m < matrices; ++m) {
      for (std::size_t i = 0; i < t; ++i) {
        const T* xr = xp + (m * t + i) * t;
        T* yr = yp + (m * t + i) * t;
        for (std::size_t j = 0; j <= i; ++j) yr[j] = xr[j];
        for (std::size_t j = i + 1; j < t; ++j) yr[j] = value_;
      }
    }
  }

 private:
  T value_;
};

// ---------------------------------------------------------------------------------------------
// Dropout

// The splitmix64 finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014): a bijective 64-bit mix, so a counter through it is a
// counter-based generator, and any element's bits are computable alone.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

constexpr std::uint64_t golden_gamma = 0x9e3779b97f4a7c15ULL;

template <class T>
class DropoutKernel final : public Kernel {
 public:
  DropoutKernel(double p, std::int64_t seed)
      : seed_key_(mix64(static_cast<std::uint64_t>(seed) + golden_gamma)),
        // An element is kept when the top 53 bits of its hash, as an integer, reach p * 2^53:
        // probability 1 - p, exactly 1 for p = 0 and 0 for p = 1.
        threshold_(static_cast<std::uint64_t>(std::ceil(p * 9007199254740992.0))),
        scale_(p < 1.0 ? static_cast<T>(1.0 / (1.0 - p)) : T(0)) {}

  void compute(KernelContext& ctx) override {
    const char* op = "dropout";
    const Tensor& x = need_input(ctx, 0, op, "x");
    Tensor& y = need_output(ctx, 0, op, "y");
    check_same_shape(op, x, "x", y, "y");
    const T* xp = in_data<T>(x, op, "x");
    T* yp = out_data<T>(y, op, "y");
    const std::size_t n = to_size(x.numel());
    // Element i of piece `piece` draws splitmix64's output i of a stream keyed by (seed, piece).
    const std::uint64_t key = mix64(seed_key_ ^ static_cast<std::uint64_t>(ctx.piece));
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t bits = mix64(key + (static_cast<std::uint64_t>(i) + 1) * golden_gamma);
      yp[i] = (bits >> 11) >= threshold_ ? xp[i] * scale_ : T(0);
    }
  }

 private:
  std::uint64_t seed_key_;
  std::uint64_t threshold_;
  T scale_;
};

// ---------------------------------------------------------------------------------------------
// Registration

template <class T>
void add_nn_ops_for(KernelRegistry& reg) {
  constexpr DeviceType cpu = DeviceType::cpu;
  constexpr DType dt = dtype_of<T>();
  reg.add_fn("relu", cpu, dt, unary_kernel<T, Relu>);
  // GELU in the form its "approximate" attribute names (erf, or tanh).
  auto by_form = [&reg](const char* op, KernelFactory erf, KernelFactory tanh) {
    reg.add(op, cpu, dt, [op, erf, tanh](const KernelConfig& cfg) {
      return detail::gelu_tanh(cfg, op) ? tanh(cfg) : erf(cfg);
    });
  };
  by_form("gelu", kernel_of(unary_kernel<T, Gelu>), kernel_of(unary_kernel<T, GeluTanh>));
  reg.add_fn("tanh", cpu, dt, unary_kernel<T, Tanh>);
  reg.add_fn("sigmoid", cpu, dt, unary_kernel<T, Sigmoid>);
  reg.add_fn("relu_grad", cpu, dt, grad_kernel<T, ReluGrad>);
  by_form("gelu_grad", kernel_of(grad_kernel<T, GeluGrad>), kernel_of(grad_kernel<T, GeluTanhGrad>));
  reg.add_fn("tanh_grad", cpu, dt, grad_kernel<T, TanhGrad>);
  reg.add_fn("sigmoid_grad", cpu, dt, grad_kernel<T, SigmoidGrad>);
  by_form("bias_gelu", kernel_of(bias_gelu_kernel<T, false>), kernel_of(bias_gelu_kernel<T, true>));
  by_form("bias_gelu_grad", kernel_of(bias_gelu_grad_kernel<T, false>), kernel_of(bias_gelu_grad_kernel<T, true>));
  reg.add_fn("softmax", cpu, dt, softmax_kernel<T>);
  reg.add_fn("log_softmax", cpu, dt, log_softmax_kernel<T>);
  reg.add_fn("softmax_grad", cpu, dt, softmax_grad_kernel<T>);
  reg.add_fn("log_softmax_grad", cpu, dt, log_softmax_grad_kernel<T>);
  reg.add_fn("softmax_cross_entropy", cpu, dt, cross_entropy_kernel<T>);
  reg.add_fn("softmax_cross_entropy_grad", cpu, dt, cross_entropy_grad_kernel<T>);
  reg.add_fn("mse", cpu, dt, mse_kernel<T>);
  reg.add_fn("mse_grad", cpu, dt, mse_grad_kernel<T>);
  reg.add("embedding", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<EmbeddingKernel<T>>(read_vocab_range(cfg, "embedding"));
  });
  reg.add("embedding_grad", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<EmbeddingGradKernel<T>>(read_vocab_range(cfg, "embedding_grad"));
  });
  reg.add("vocab_parallel_ce_stats", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<VocabCeStatsKernel<T>>(
        read_vocab_range(cfg, "vocab_parallel_ce_stats"));
  });
  reg.add("vocab_parallel_ce_stats_grad", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<VocabCeStatsGradKernel<T>>(
        read_vocab_range(cfg, "vocab_parallel_ce_stats_grad"));
  });
  reg.add_fn("vocab_parallel_ce_loss", cpu, dt, vocab_ce_loss_kernel<T>);
  reg.add_fn("vocab_parallel_ce_loss_grad", cpu, dt, vocab_ce_loss_grad_kernel<T>);
  reg.add("layer_norm", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<LayerNormKernel<T>>(read_eps(cfg, "layer_norm"));
  });
  reg.add("layer_norm_grad", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<LayerNormGradKernel<T>>(read_eps(cfg, "layer_norm_grad"));
  });
  reg.add("causal_mask", cpu, dt, [](const KernelConfig& cfg) {
    const double value = read_attrs(cfg, "causal_mask", [&] {
      return cfg.attrs.get_double("value", -std::numeric_limits<double>::infinity());
    });
    return std::make_unique<CausalMaskKernel<T>>(value);
  });
  reg.add("dropout", cpu, dt, [](const KernelConfig& cfg) {
    const char* op = "dropout";
    // torch.nn.Dropout's default p.
    const double p = read_attrs(cfg, op, [&] { return cfg.attrs.get_double("p", 0.5); });
    const std::int64_t seed = read_attrs(cfg, op, [&] { return cfg.attrs.get_int("seed", 0); });
    if (!(p >= 0.0 && p <= 1.0)) {
      throw std::invalid_argument(
          fmt::format("{} (actor '{}'): attribute p must be in [0, 1], got {}", op, cfg.actor, p));
    }
    return std::make_unique<DropoutKernel<T>>(p, seed);
  });
}

}  // namespace

void add_cpu_nn_ops(KernelRegistry& reg) {
  add_nn_ops_for<float>(reg);
  add_nn_ops_for<double>(reg);
  add_cpu_attention_ops(reg);
  add_cpu_llm_ops(reg);
  add_cpu_decode_ops(reg);
}

}  // namespace baton
