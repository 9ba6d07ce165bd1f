// The tensor ops of ops.h for cpu/f32 and cpu/f64. Output shapes come from the plan; each
// kernel checks the shapes it relies on and names the op and the tensors when they disagree.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <cblas.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/kernels/blas_choice.h"
#include "baton/kernels/ops.h"
#include "broadcast.h"
#include "gelu.h"
#include "kernel_args.h"

namespace baton {

namespace {

using detail::Strides;

using detail::need_input;
using detail::need_output;

std::int64_t required_int(const KernelConfig& cfg, const char* op, const char* name) {
  if (!cfg.attrs.has(name)) {
    throw std::invalid_argument(
        fmt::format("{} (actor '{}') needs an integer attribute '{}'", op, cfg.actor, name));
  }
  return cfg.attrs.get_int(name, 0);
}

double required_double(const KernelConfig& cfg, const char* op, const char* name) {
  if (!cfg.attrs.has(name)) {
    throw std::invalid_argument(
        fmt::format("{} (actor '{}') needs a number attribute '{}'", op, cfg.actor, name));
  }
  return cfg.attrs.get_double(name, 0.0);
}

// An int-list attribute; absent gives `fallback`, or throws when there is none.
std::vector<std::int64_t> int_list(const KernelConfig& cfg, const char* op, const char* name,
                                   const std::vector<std::int64_t>* fallback) {
  auto it = cfg.attrs.values().find(name);
  if (it == cfg.attrs.values().end()) {
    if (fallback != nullptr) return *fallback;
    throw std::invalid_argument(
        fmt::format("{} (actor '{}') needs an int-list attribute '{}'", op, cfg.actor, name));
  }
  if (const auto* v = std::get_if<std::vector<std::int64_t>>(&it->second)) return *v;
  throw std::invalid_argument(
      fmt::format("{} (actor '{}'): attribute '{}' is not an int list", op, cfg.actor, name));
}

bool flag(const KernelConfig& cfg, const char* op, const char* name) {
  auto v = cfg.attrs.get_int(name, 0);
  if (v != 0 && v != 1) {
    throw std::invalid_argument(fmt::format(
        "{} (actor '{}'): attribute '{}' must be 0 or 1, not {}", op, cfg.actor, name, v));
  }
  return v == 1;
}

using detail::normalise_axis;
using detail::product;

// ---- matmul ----------------------------------------------------------------------------------

template <class T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, const T* a, int lda, const T* b, int ldb,
          T* c) {
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, std::max(n, 1));
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, 1.0, a, lda, b, ldb, 0.0, c, std::max(n, 1));
  }
}

template <class T>
class MatmulKernel final : public Kernel {
 public:
  MatmulKernel(bool trans_a, bool trans_b) : trans_a_(trans_a), trans_b_(trans_b) {}

  void compute(KernelContext& ctx) override {
    const Tensor& a = need_input(ctx, 0, "matmul");
    const Tensor& b = need_input(ctx, 1, "matmul");
    Tensor& c = need_output(ctx, 0, "matmul");
    const Shape& as = a.shape();
    const Shape& bs = b.shape();
    const std::size_t ra = as.size();
    const std::size_t rb = bs.size();
    const detail::MatmulDims dims = detail::matmul_dims(a, b, c, trans_a_, trans_b_);
    const std::int64_t m = dims.m, k = dims.k, n = dims.n, batches = dims.batches;
    const bool shared_b = dims.shared_b;
    const std::int64_t rows = shared_b && !trans_a_ ? batches * m : m;
    for (std::int64_t d : {rows, n, k, as[ra - 1], bs[rb - 1]}) {
      if (d > INT_MAX) {
        throw std::invalid_argument(fmt::format("matmul: a {}, b {}: an extent exceeds BLAS's 32-bit int",
                                                a.describe(), b.describe()));
      }
    }

    const T* pa = a.data<T>().data();
    const T* pb = b.data<T>().data();
    T* pc = c.data<T>().data();
    if (c.numel() == 0) return;
    if (k == 0) {  // BLAS rejects a zero leading dimension; the empty product is 0
      std::fill_n(pc, c.numel(), T(0));
      return;
    }
    const int lda = static_cast<int>(as[ra - 1]);
    const int ldb = static_cast<int>(bs[rb - 1]);
    if (shared_b && !trans_a_) {
      // One weight for every batch entry: the batch folds into M, one large gemm.
      gemm<T>(false, trans_b_, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k), pa,
              lda, pb, ldb, pc);
      return;
    }
    const std::int64_t a_step = m * k;
    const std::int64_t b_step = shared_b ? 0 : k * n;
    for (std::int64_t i = 0; i < batches; ++i) {
      gemm<T>(trans_a_, trans_b_, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              pa + i * a_step, lda, pb + i * b_step, ldb, pc + i * m * n);
    }
  }

 private:
  bool trans_a_;
  bool trans_b_;
};

// ---- elementwise and broadcasting ------------------------------------------------------------

template <class T, class Op>
void binary_kernel(KernelContext& ctx, const char* op_name, Op op = Op{}) {
  const Tensor& a = need_input(ctx, 0, op_name);
  const Tensor& b = need_input(ctx, 1, op_name);
  Tensor& c = need_output(ctx, 0, op_name);
  auto want = detail::broadcast_shapes(a.shape(), b.shape());
  if (!want || *want != c.shape()) {
    throw std::invalid_argument(fmt::format(
        "{}: a {} and b {} {} c {}", op_name, a.describe(), b.describe(),
        want ? fmt::format("broadcast to {}, not", to_string(*want)) : "do not broadcast; into",
        c.describe()));
  }
  detail::broadcast_binary(a.data<T>().data(), a.shape(), b.data<T>().data(), b.shape(),
                           c.data<T>().data(), c.shape(), op);
}

template <class T>
void broadcast_to_kernel(KernelContext& ctx) {
  const Tensor& x = need_input(ctx, 0, "broadcast_to");
  Tensor& y = need_output(ctx, 0, "broadcast_to");
  if (!detail::broadcasts_to(x.shape(), y.shape())) {
    throw std::invalid_argument(
        fmt::format("broadcast_to: x {} does not broadcast to y {}", x.describe(), y.describe()));
  }
  if (y.numel() == 0) return;
  const T* px = x.data<T>().data();
  T* py = y.data<T>().data();
  const auto loop = detail::make_loop(y.shape(), detail::broadcast_strides(x.shape(), y.shape()),
                                      Strides(y.shape().size(), 0));
  detail::gather(loop, px, py);
}

// ---- reductions ------------------------------------------------------------------------------

// Sums x into acc (zeroed, of y_shape's numel), where y_shape broadcasts to x's shape. Sums are
// accumulated in double whatever T is, so an f32 sum over many elements keeps its digits.
template <class T>
void sum_into(const T* x, const Shape& x_shape, double* acc, const Shape& y_shape) {
  if (numel(x_shape) == 0) return;
  const auto loop = detail::make_loop(x_shape, detail::broadcast_strides(y_shape, x_shape),
                                      Strides(x_shape.size(), 0));
  const std::int64_t n = loop.inner();
  detail::for_each_run(loop, [&](std::int64_t ox, std::int64_t oy, std::int64_t) {
    const T* src = x + ox;
    if (loop.inner_a() == 1) {
      double* dst = acc + oy;
      for (std::int64_t i = 0; i < n; ++i) dst[i] += static_cast<double>(src[i]);
      return;
    }
    // A run summed into one value: eight partial sums break the dependency chain.
    double part[8] = {};
    std::int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(src[i + j]);
    }
    for (; i < n; ++i) part[0] += static_cast<double>(src[i]);
    acc[oy] +=
        ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  });
}

// The larger of two values, or NaN if either is (as torch.maximum and torch.amax).
template <class T>
T nan_max(T a, T b) {
  return !std::isnan(a) && (b > a || std::isnan(b)) ? b : a;
}

// Maxima of x into acc (filled with -infinity, of y_shape's numel), where y_shape broadcasts to
// x's shape; the same walk as sum_into.
template <class T>
void max_into(const T* x, const Shape& x_shape, double* acc, const Shape& y_shape) {
  if (numel(x_shape) == 0) return;
  const auto loop = detail::make_loop(x_shape, detail::broadcast_strides(y_shape, x_shape),
                                      Strides(x_shape.size(), 0));
  const std::int64_t n = loop.inner();
  detail::for_each_run(loop, [&](std::int64_t ox, std::int64_t oy, std::int64_t) {
    const T* src = x + ox;
    if (loop.inner_a() == 1) {
      double* dst = acc + oy;
      for (std::int64_t i = 0; i < n; ++i) dst[i] = nan_max(dst[i], static_cast<double>(src[i]));
      return;
    }
    double m = acc[oy];
    for (std::int64_t i = 0; i < n; ++i) m = nan_max(m, static_cast<double>(src[i]));
    acc[oy] = m;
  });
}

// sum_to, sum, mean and max: x reduced onto a shape that broadcasts back to x's ("kept" shape:
// the reduced axes as 1), a mean divided by the number of elements summed into each output.
template <class T>
class ReduceKernel final : public Kernel {
 public:
  enum class Mode { sum_to, sum, mean, max };
  ReduceKernel(Mode mode, std::vector<std::int64_t> axes, bool keepdims)
      : mode_(mode), axes_(std::move(axes)), keepdims_(keepdims) {}

  void compute(KernelContext& ctx) override {
    const char* op = mode_ == Mode::sum_to ? "sum_to"
                     : mode_ == Mode::sum  ? "sum"
                     : mode_ == Mode::mean ? "mean"
                                           : "max";
    const Tensor& x = need_input(ctx, 0, op);
    Tensor& y = need_output(ctx, 0, op);
    const Shape kept = mode_ == Mode::sum_to ? y.shape() : kept_shape(x, y, op);
    if (!detail::broadcasts_to(kept, x.shape())) {
      throw std::invalid_argument(
          fmt::format("sum_to: y {} does not broadcast to x {}", y.describe(), x.describe()));
    }
    if (mode_ == Mode::max) {
      // The maximum of nothing is -infinity (numpy refuses; torch.amax too).
      acc_.assign(static_cast<std::size_t>(y.numel()), -std::numeric_limits<double>::infinity());
      max_into(x.data<T>().data(), x.shape(), acc_.data(), kept);
    } else {
      acc_.assign(static_cast<std::size_t>(y.numel()), 0.0);
      sum_into(x.data<T>().data(), x.shape(), acc_.data(), kept);
    }
    // numel(x) / numel(y) elements fall on each output (0 / 0 = NaN for a mean of nothing).
    const double count =
        y.numel() == 0 ? 1.0 : static_cast<double>(x.numel()) / static_cast<double>(y.numel());
    const double factor = mode_ == Mode::mean ? 1.0 / count : 1.0;
    T* py = y.data<T>().data();
    for (std::size_t i = 0; i < acc_.size(); ++i) py[i] = static_cast<T>(acc_[i] * factor);
  }

 private:
  // x's shape with the reduced axes as 1; checks that y is that shape (keepdims) or that
  // shape without them.
  Shape kept_shape(const Tensor& x, const Tensor& y, const char* op) const {
    const std::size_t rank = x.shape().size();
    std::vector<bool> reduced(rank, axes_.empty());
    for (std::int64_t a : axes_) {
      std::size_t i = normalise_axis(a, rank, op, x);
      if (reduced[i]) {
        throw std::invalid_argument(
            fmt::format("{}: axis {} listed twice for {}", op, a, x.describe()));
      }
      reduced[i] = true;
    }
    Shape kept = x.shape();
    Shape dropped;
    for (std::size_t i = 0; i < rank; ++i) {
      if (reduced[i]) {
        kept[i] = 1;
      } else {
        dropped.push_back(x.shape()[i]);
      }
    }
    if (y.shape() != (keepdims_ ? kept : dropped)) {
      throw std::invalid_argument(fmt::format("{} (keepdims={}): x {} reduces to {}, not y {}", op,
                                              int(keepdims_), x.describe(),
                                              to_string(keepdims_ ? kept : dropped), y.describe()));
    }
    return kept;
  }

  Mode mode_;
  std::vector<std::int64_t> axes_;
  bool keepdims_;
  std::vector<double> acc_;  // scratch, kept between acts
};

// ---- constants and copies --------------------------------------------------------------------

template <class T>
class ScaleKernel final : public Kernel {
 public:
  explicit ScaleKernel(double value) : value_(static_cast<T>(value)) {}
  void compute(KernelContext& ctx) override {
    const Tensor& x = need_input(ctx, 0, "scale");
    Tensor& y = need_output(ctx, 0, "scale");
    if (x.shape() != y.shape()) {
      throw std::invalid_argument(
          fmt::format("scale: x {} and y {} differ", x.describe(), y.describe()));
    }
    const T* px = x.data<T>().data();
    T* py = y.data<T>().data();
    const T v = value_;
    for (std::int64_t i = 0; i < y.numel(); ++i) py[i] = px[i] * v;
  }

 private:
  T value_;
};

template <class T>
class FillKernel final : public Kernel {
 public:
  explicit FillKernel(double value) : value_(static_cast<T>(value)) {}
  void compute(KernelContext& ctx) override {
    Tensor& y = need_output(ctx, 0, "fill");
    std::fill_n(y.data<T>().data(), y.numel(), value_);
  }

 private:
  T value_;
};

template <class T>
void reshape_kernel(KernelContext& ctx) {
  const Tensor& x = need_input(ctx, 0, "reshape");
  Tensor& y = need_output(ctx, 0, "reshape");
  if (x.numel() != y.numel()) {
    throw std::invalid_argument(
        fmt::format("reshape: x {} and y {} differ in size", x.describe(), y.describe()));
  }
  const T* px = x.data<T>().data();
  T* py = y.data<T>().data();
  if (px != py) std::copy_n(px, x.numel(), py);
}

template <class T>
class TransposeKernel final : public Kernel {
 public:
  explicit TransposeKernel(std::vector<std::int64_t> perm) : perm_(std::move(perm)) {}

  void compute(KernelContext& ctx) override {
    const Tensor& x = need_input(ctx, 0, "transpose");
    Tensor& y = need_output(ctx, 0, "transpose");
    const Shape& xs = x.shape();
    const std::size_t rank = xs.size();
    auto fail = [&](const char* why) {
      return std::invalid_argument(fmt::format("transpose (perm [{}]): x {}, y {}: {}",
                                               fmt::join(perm_, ", "), x.describe(), y.describe(),
                                               why));
    };
    if (perm_.size() != rank) throw fail("perm must list every axis of x once");
    const Strides x_strides = detail::contiguous_strides(xs);
    Strides read(rank);
    Shape want(rank);
    std::vector<bool> seen(rank, false);
    for (std::size_t i = 0; i < rank; ++i) {
      const std::int64_t p = perm_[i];
      if (p < 0 || p >= static_cast<std::int64_t>(rank) || seen[static_cast<std::size_t>(p)]) {
        throw fail("perm must list every axis of x once");
      }
      seen[static_cast<std::size_t>(p)] = true;
      want[i] = xs[static_cast<std::size_t>(p)];
      read[i] = x_strides[static_cast<std::size_t>(p)];
    }
    if (y.shape() != want) throw fail("y's shape must be x's permuted");
    if (y.numel() == 0) return;
    const T* px = x.data<T>().data();
    T* py = y.data<T>().data();
    const auto loop = detail::make_loop(want, read, Strides(rank, 0));
    detail::gather(loop, px, py);
  }

 private:
  std::vector<std::int64_t> perm_;
};

// ---- slices and concatenation ----------------------------------------------------------------

// Checks that `part` is `whole` cut to part's extent along `axis` at `start`; returns the axis.
std::size_t check_window(const char* op, std::int64_t axis, std::int64_t start, const Tensor& whole,
                         const Tensor& part) {
  const Shape& ws = whole.shape();
  const Shape& ps = part.shape();
  const bool grad = std::string_view(op) == "slice_grad";
  auto fail = [&](const char* why) {
    return std::invalid_argument(fmt::format("{} (axis {}, start {}): {} {} and {} {}: {}", op,
                                             axis, start, grad ? "dx" : "x", whole.describe(),
                                             grad ? "dy" : "y", part.describe(), why));
  };
  if (ws.size() != ps.size() || ws.empty()) throw fail("ranks differ or are 0");
  const std::size_t ax = normalise_axis(axis, ws.size(), op, whole);
  for (std::size_t i = 0; i < ws.size(); ++i) {
    if (i != ax && ws[i] != ps[i]) throw fail("extents differ off the axis");
  }
  if (start < 0 || start + ps[ax] > ws[ax]) throw fail("the window leaves the axis");
  return ax;
}

template <class T>
class SliceKernel final : public Kernel {
 public:
  SliceKernel(bool grad, std::int64_t axis, std::int64_t start)
      : grad_(grad), axis_(axis), start_(start) {}

  void compute(KernelContext& ctx) override {
    const char* op = grad_ ? "slice_grad" : "slice";
    const Tensor& in = need_input(ctx, 0, op);
    Tensor& out = need_output(ctx, 0, op);
    const Tensor& whole = grad_ ? out : in;
    const Tensor& part = grad_ ? in : out;
    const std::size_t ax = check_window(op, axis_, start_, whole, part);
    const Shape& ws = whole.shape();
    const std::int64_t outer = product(ws, 0, ax);
    const std::int64_t inner = product(ws, ax + 1, ws.size());
    const std::int64_t whole_run = ws[ax] * inner;
    const std::int64_t part_run = part.shape()[ax] * inner;
    const std::int64_t offset = start_ * inner;
    const T* src = in.data<T>().data();
    T* dst = out.data<T>().data();
    if (grad_) std::fill_n(dst, out.numel(), T(0));
    for (std::int64_t o = 0; o < outer; ++o) {
      if (grad_) {
        std::copy_n(src + o * part_run, part_run, dst + o * whole_run + offset);
      } else {
        std::copy_n(src + o * whole_run + offset, part_run, dst + o * part_run);
      }
    }
  }

 private:
  bool grad_;
  std::int64_t axis_;
  std::int64_t start_;
};

template <class T>
class ConcatKernel final : public Kernel {
 public:
  explicit ConcatKernel(std::int64_t axis) : axis_(axis) {}

  void compute(KernelContext& ctx) override {
    Tensor& y = need_output(ctx, 0, "concat");
    const Shape& ys = y.shape();
    for (std::size_t k = 0; k < ctx.inputs.size(); ++k) (void)need_input(ctx, k, "concat");
    const detail::ConcatDims d = detail::concat_dims(ctx, y, axis_);
    const std::size_t ax = d.axis;
    const std::int64_t outer = d.outer, inner = d.inner;
    T* dst = y.data<T>().data();
    std::int64_t offset = 0;  // of the current input's window within a row of y
    for (const Tensor* x : ctx.inputs) {
      const std::int64_t run = x->shape()[ax] * inner;
      const T* src = x->data<T>().data();
      for (std::int64_t o = 0; o < outer; ++o) {
        std::copy_n(src + o * run, run, dst + o * ys[ax] * inner + offset);
      }
      offset += run;
    }
  }

 private:
  std::int64_t axis_;
};

// ---- registration ----------------------------------------------------------------------------

// matmul_bias_grad: a Linear layer's weight and bias gradients from one read of dy, the plan's
// fusion of matmul(x, dy, trans_a) and sum_to(dy, [N]) (graph/src/passes/epilogues.cpp). x
// [..., K] and dy [..., N] have the same rows; dw [K, N] = x^T dy over all of them, db [N] their
// sum. The same gemm call and the same reduction as the two ops apart, so the same bits.
template <class T>
class MatmulBiasGradKernel final : public Kernel {
 public:
  void compute(KernelContext& ctx) override {
    const auto [x, dy, dw, db, d] = detail::linear_grad_args(ctx, "matmul_bias_grad");
    if (dw.numel() > 0) {
      if (d.rows == 0) {
        std::fill_n(dw.data<T>().data(), dw.numel(), T(0));
      } else {
        gemm<T>(true, false, static_cast<int>(d.k), static_cast<int>(d.n), static_cast<int>(d.rows),
                x.data<T>().data(), static_cast<int>(d.k), dy.data<T>().data(), static_cast<int>(d.n),
                dw.data<T>().data());
      }
    }
    const Tensor* in[] = {&dy};
    Tensor* out[] = {&db};
    KernelContext sum{in, out, ctx.piece, ctx.stream, ctx.async_stream};
    sum_.compute(sum);
  }

 private:
  ReduceKernel<T> sum_{ReduceKernel<T>::Mode::sum_to, {}, true};
};

// matmul_bias: a Linear layer's forward, y = matmul(x, w, trans_b) + b, the plan's fusion of the
// product and the bias's add (graph/src/passes/epilogues.cpp; on CUDA one cuBLASLt product with
// the bias epilogue). On the CPU the two ops' own arithmetic one after the other, so the same bits
// as the plan without the fusion: the same gemm call as matmul's (x's batch folded into its
// rows), then y[r, j] + b[j] as add's broadcast does it. For bf16 x and w the same as the two
// ops' float32 fallbacks (KernelRegistry): the product in float32 on widened copies, rounded to
// bf16 once (the product's register), then widened, the bias added in float32 and, where y is
// bf16, rounded again (add's register); where y is f32 (autocast's cast of the product before a
// float32 add) that second rounding is not there.
template <class T>
void add_bias_rows(T* y, const T* b, std::int64_t rows, std::int64_t n) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < n; ++j) y[r * n + j] = y[r * n + j] + b[j];
  }
}

// matmul_bias_gelu: the same with GELU after the bias, y = gelu(x w + b) in the form of the
// attribute "approximate", and a second output pre = x w + b, the pre-activation the backward's
// gelu_grad reads (cuBLASLt's GELU_AUX_BIAS epilogue on CUDA). On the CPU the ops' arithmetic
// again: pre is the product plus the bias rounded to the element type (add's register, which is
// what bias_gelu's sum is rounded to), y is the gelu kernel's of it (gelu.h). For bf16 y is
// bias_gelu's float32 result rounded once (its float32 fallback's), and pre the float32 sum
// rounded to bf16, which the plan without the fusion never rounds: the backward then reads a
// pre-activation one bf16 rounding away from the one it read before (CUDA's aux is bf16 too).
enum class Activation { none, gelu_erf, gelu_tanh };

/// y = the activation of pre, elementwise (nothing for none).
template <class T>
void activate(Activation act, const T* pre, T* y, std::int64_t n) {
  if (act != Activation::none) detail::gelu_elements(pre, y, static_cast<std::size_t>(n), act == Activation::gelu_tanh);
}

const char* op_of(Activation act) { return act == Activation::none ? "matmul_bias" : "matmul_bias_gelu"; }

/// matmul_bias_gelu's second output (pre), checked against y.
Tensor& pre_output(const KernelContext& ctx, const Tensor& y) {
  Tensor& pre = need_output(ctx, 1, "matmul_bias_gelu", "pre");
  if (pre.shape() != y.shape() || pre.dtype() != y.dtype()) {
    throw std::invalid_argument(
        fmt::format("matmul_bias_gelu: pre {} must have y's shape and dtype ({})", pre.describe(), y.describe()));
  }
  return pre;
}

template <class T>
class MatmulBiasKernel final : public Kernel {
 public:
  MatmulBiasKernel(bool trans_b, Activation act) : trans_b_(trans_b), act_(act), product_(false, trans_b) {}
  void compute(KernelContext& ctx) override {
    const char* op = op_of(act_);
    const auto [x, w, b, y, d] = detail::linear_args(ctx, trans_b_, op);
    if (x.dtype() != dtype_of<T>() || y.dtype() != x.dtype()) {
      throw std::invalid_argument(fmt::format("{}: x {} and y {} must be {}", op, x.describe(), y.describe(),
                                              name(dtype_of<T>())));
    }
    Tensor& sum = act_ == Activation::none ? y : pre_output(ctx, y);
    const Tensor* in[] = {&x, &w};
    Tensor* out[] = {&sum};
    KernelContext product{in, out, ctx.piece, ctx.stream, ctx.async_stream};
    product_.compute(product);
    add_bias_rows(sum.data<T>().data(), b.data<T>().data(), d.rows, d.n);
    activate(act_, sum.data<T>().data(), y.data<T>().data(), y.numel());
  }

 private:
  bool trans_b_;
  Activation act_;
  MatmulKernel<T> product_;
};

class MatmulBiasBf16Kernel final : public Kernel {
 public:
  MatmulBiasBf16Kernel(bool trans_b, Activation act) : trans_b_(trans_b), act_(act), product_(false, trans_b) {}
  void compute(KernelContext& ctx) override {
    const char* op = op_of(act_);
    const auto [x, w, b, y, d] = detail::linear_args(ctx, trans_b_, op);
    if (x.dtype() != DType::bf16 || (act_ != Activation::none && y.dtype() != DType::bf16)) {
      throw std::invalid_argument(fmt::format("{}: x {} and y {} must be bf16{}", op, x.describe(), y.describe(),
                                              act_ == Activation::none ? " (or y f32)" : ""));
    }
    detail::convert_on_host(x, f32_like(xf_, x));
    detail::convert_on_host(w, f32_like(wf_, w));
    Tensor& yf = f32_like(yf_, y);
    const Tensor* in[] = {&xf_, &wf_};
    Tensor* out[] = {&yf};
    KernelContext product{in, out, ctx.piece, ctx.stream, ctx.async_stream};
    product_.compute(product);
    float* p = yf.data<float>().data();
    const std::int64_t n = yf.numel();
    for (std::int64_t i = 0; i < n; ++i) p[i] = to_float(to_bf16(p[i]));  // the product's register
    if (y.dtype() == DType::f32) {
      std::copy_n(p, n, y.data<float>().data());
      add_bias_rows(y.data<float>().data(), b.data<float>().data(), d.rows, d.n);
      return;
    }
    detail::convert_on_host(b, f32_like(bf_, b));
    add_bias_rows(p, bf_.data<float>().data(), d.rows, d.n);
    bfloat16* q = y.data<bfloat16>().data();
    if (act_ != Activation::none) {
      bfloat16* pre = pre_output(ctx, y).data<bfloat16>().data();
      for (std::int64_t i = 0; i < n; ++i) pre[i] = to_bf16(p[i]);
      activate(act_, p, p, n);  // in float32, as bias_gelu's float32 fallback
    }
    for (std::int64_t i = 0; i < n; ++i) q[i] = to_bf16(p[i]);
  }

 private:
  /// `slot`, an f32 tensor of `like`'s shape: made once per actor (its shapes do not change).
  static Tensor& f32_like(Tensor& slot, const Tensor& like) {
    if (!slot.defined() || slot.shape() != like.shape()) slot = Tensor::empty(like.shape(), DType::f32);
    return slot;
  }

  bool trans_b_;
  Activation act_;
  MatmulKernel<float> product_;
  Tensor xf_, wf_, yf_, bf_;  // float32 copies, kept between acts as ViaFloat32 keeps its own
};

// matmul_dgelu_bgrad: the backward of a GELU product's consumer, fused (the epilogues pass;
// cuBLASLt's DGELU_BGRAD on CUDA): the data gradient of the next product, dfc = dy w^T, times
// gelu'(pre), and the GELU's bias gradient, that summed over the rows. On the CPU the three ops'
// arithmetic in turn (matmul's gemm, gelu_grad's formula, sum_to's reduction): the same bits.
template <class T>
class MatmulDgeluBgradKernel final : public Kernel {
 public:
  MatmulDgeluBgradKernel(bool trans_b, bool tanh) : trans_b_(trans_b), tanh_(tanh), product_(false, trans_b) {}
  void compute(KernelContext& ctx) override {
    const auto [dy, w, pre, dh, db, d] = detail::dgelu_args(ctx, trans_b_, "matmul_dgelu_bgrad");
    const Tensor* in[] = {&dy, &w};
    Tensor* out[] = {&dh};
    KernelContext product{in, out, ctx.piece, ctx.stream, ctx.async_stream};
    product_.compute(product);
    T* g = dh.data<T>().data();
    detail::gelu_grad_elements(pre.data<T>().data(), g, g, static_cast<std::size_t>(dh.numel()), tanh_);
    const Tensor* sum_in[] = {&dh};
    Tensor* sum_out[] = {&db};
    KernelContext sum{sum_in, sum_out, ctx.piece, ctx.stream, ctx.async_stream};
    sum_.compute(sum);
  }

 private:
  bool trans_b_, tanh_;
  MatmulKernel<T> product_;
  ReduceKernel<T> sum_{ReduceKernel<T>::Mode::sum_to, {}, true};
};

/// matmul_bias_gelu's activation, from its "approximate" attribute.
Activation gelu_of(const KernelConfig& cfg) {
  return detail::gelu_tanh(cfg, "matmul_bias_gelu") ? Activation::gelu_tanh : Activation::gelu_erf;
}

template <class T>
void add_ops(KernelRegistry& reg) {
  constexpr DType dt = dtype_of<T>();
  constexpr auto cpu = DeviceType::cpu;
  using Mode = typename ReduceKernel<T>::Mode;

  reg.add("matmul", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<MatmulKernel<T>>(flag(cfg, "matmul", "trans_a"),
                                             flag(cfg, "matmul", "trans_b"));
  });
  reg.add_fn("add", cpu, dt, [](KernelContext& c) { binary_kernel<T, std::plus<T>>(c, "add"); });
  reg.add_fn("sub", cpu, dt, [](KernelContext& c) { binary_kernel<T, std::minus<T>>(c, "sub"); });
  reg.add_fn("mul", cpu, dt,
             [](KernelContext& c) { binary_kernel<T, std::multiplies<T>>(c, "mul"); });
  reg.add_fn("div", cpu, dt, [](KernelContext& c) { binary_kernel<T, std::divides<T>>(c, "div"); });
  reg.add_fn("maximum", cpu, dt, [](KernelContext& c) {
    binary_kernel<T>(c, "maximum", [](T a, T b) { return nan_max(a, b); });
  });
  reg.add_fn("broadcast_to", cpu, dt, broadcast_to_kernel<T>);
  reg.add_fn("reshape", cpu, dt, reshape_kernel<T>);
  // A copy; only autodiff tells it from reshape.
  reg.add_fn("stop_gradient", cpu, dt, reshape_kernel<T>);
  reg.add("sum_to", cpu, dt, [](const KernelConfig&) {
    return std::make_unique<ReduceKernel<T>>(Mode::sum_to, std::vector<std::int64_t>{}, true);
  });
  reg.add("matmul_bias_grad", cpu, dt, [](const KernelConfig&) { return std::make_unique<MatmulBiasGradKernel<T>>(); });
  reg.add("matmul_bias", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<MatmulBiasKernel<T>>(flag(cfg, "matmul_bias", "trans_b"), Activation::none);
  });
  reg.add("matmul_bias_gelu", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<MatmulBiasKernel<T>>(flag(cfg, "matmul_bias_gelu", "trans_b"), gelu_of(cfg));
  });
  // bf16: the float32 kernel on widened copies (KernelRegistry), the product not rounded to bf16
  // before gelu' as the unfused plan rounds it (one bf16 rounding apart).
  reg.add("matmul_dgelu_bgrad", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<MatmulDgeluBgradKernel<T>>(flag(cfg, "matmul_dgelu_bgrad", "trans_b"),
                                                       detail::gelu_tanh(cfg, "matmul_dgelu_bgrad"));
  });
  for (auto [op, mode] :
       {std::pair{"sum", Mode::sum}, std::pair{"mean", Mode::mean}, std::pair{"max", Mode::max}}) {
    reg.add(op, cpu, dt, [op = op, mode = mode](const KernelConfig& cfg) {
      const std::vector<std::int64_t> all;
      return std::make_unique<ReduceKernel<T>>(mode, int_list(cfg, op, "axes", &all),
                                               flag(cfg, op, "keepdims"));
    });
  }
  reg.add("scale", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<ScaleKernel<T>>(required_double(cfg, "scale", "value"));
  });
  reg.add("fill", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<FillKernel<T>>(required_double(cfg, "fill", "value"));
  });
  reg.add("transpose", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<TransposeKernel<T>>(int_list(cfg, "transpose", "perm", nullptr));
  });
  for (auto [op, grad] : {std::pair{"slice", false}, std::pair{"slice_grad", true}}) {
    reg.add(op, cpu, dt, [op = op, grad = grad](const KernelConfig& cfg) {
      return std::make_unique<SliceKernel<T>>(grad, required_int(cfg, op, "axis"),
                                              required_int(cfg, op, "start"));
    });
  }
  reg.add("concat", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<ConcatKernel<T>>(required_int(cfg, "concat", "axis"));
  });
}

// Kernels run one per actor thread, so BLAS's own threads would only contend with the other
// actors; BATON_BLAS_THREADS overrides. OpenBLAS's setting is process-wide: set it once.
std::once_flag blas_configured;
void configure_blas_threads() {
  std::call_once(blas_configured, [] {
    // Links blas_choice.cpp, whose constructor chose the kernels before main (blas_choice.h).
    if (blas::linked != 1) std::abort();
    int threads = 1;
    if (const char* env = std::getenv("BATON_BLAS_THREADS"); env != nullptr && *env != '\0') {
      threads = std::max(1, std::atoi(env));
    }
    openblas_set_num_threads(threads);
  });
}

}  // namespace

void set_blas_threads(int threads) {
  if (threads < 1) throw std::invalid_argument(fmt::format("BLAS threads must be at least 1, not {}", threads));
  configure_blas_threads();  // first, so that it cannot undo this later
  openblas_set_num_threads(threads);
}

int blas_threads() {
  configure_blas_threads();
  return openblas_get_num_threads();
}

void add_cpu_tensor_ops(KernelRegistry& reg) {
  configure_blas_threads();
  add_ops<float>(reg);
  add_ops<double>(reg);
  reg.add("matmul_bias", DeviceType::cpu, DType::bf16, [](const KernelConfig& cfg) {
    return std::make_unique<MatmulBiasBf16Kernel>(flag(cfg, "matmul_bias", "trans_b"), Activation::none);
  });
  reg.add("matmul_bias_gelu", DeviceType::cpu, DType::bf16, [](const KernelConfig& cfg) {
    return std::make_unique<MatmulBiasBf16Kernel>(flag(cfg, "matmul_bias_gelu", "trans_b"), gelu_of(cfg));
  });
}

}  // namespace baton
