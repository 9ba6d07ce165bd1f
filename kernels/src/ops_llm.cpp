// The math ops of current LLMs on the CPU, f32 and f64 (bf16 through the float32 kernels, as
// KernelRegistry::create falls back): exp, log, sqrt, rsqrt, pow, SiLU and their gradients,
// Llama's RMSNorm and the rotary position embedding. Elementwise work stays in the element
// type; RMSNorm's row reductions and its weight gradient's column sums accumulate in double,
// as layer_norm's do (ops_nn.cpp).
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels/ops.h"
#include "kernel_args.h"

namespace baton {

namespace {

using detail::need_input;
using detail::need_output;
using detail::check_dtype;
using detail::check_same_shape;
using detail::in_data;
using detail::out_data;

std::size_t to_size(std::int64_t n) {
  return static_cast<std::size_t>(n);
}

// A kernel that runs a function with what its factory read from the attributes.
class FnKernel final : public Kernel {
 public:
  explicit FnKernel(std::function<void(KernelContext&)> fn) : fn_(std::move(fn)) {}
  void compute(KernelContext& ctx) override { fn_(ctx); }

 private:
  std::function<void(KernelContext&)> fn_;
};

// Reads a double attribute, naming the op and actor if it has the wrong type or fails `ok`.
template <class Ok>
double read_double(const KernelConfig& cfg, const char* op, const char* attr, double fallback,
                   Ok&& ok, const char* want) {
  double v = 0;
  try {
    v = cfg.attrs.get_double(attr, fallback);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): {}", op, cfg.actor, e.what()));
  }
  if (!ok(v)) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): attribute {} must be {}, got {}", op,
                                            cfg.actor, attr, want, v));
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Elementwise: y = f(x), and the gradients that need a kernel of their own

// A log, sqrt or rsqrt of a negative number is NaN (and of 0: -inf, 0, +inf), as in torch: the
// kernels do not check the domain, a NaN loss says it.
template <class T>
T sigmoid(T x) {
  // exp(-|x|) never overflows; the two branches are the same function (ops_nn.cpp's Sigmoid).
  const T z = std::exp(-std::abs(x));
  const T r = T(1) / (T(1) + z);
  return x >= T(0) ? r : z * r;
}

template <class T, class F>
void map_kernel(KernelContext& ctx, const char* op, F&& f) {
  const Tensor& x = need_input(ctx, 0, op, "x");
  Tensor& y = need_output(ctx, 0, op, "y");
  check_same_shape(op, x, "x", y, "y");
  const T* xp = in_data<T>(x, op, "x");
  T* yp = out_data<T>(y, op, "y");
  const std::size_t n = to_size(x.numel());
  for (std::size_t i = 0; i < n; ++i) yp[i] = f(xp[i]);
}

// dx = f(a, dy), a the forward's input x or output y (`a_role`).
template <class T, class F>
void map_grad_kernel(KernelContext& ctx, const char* op, const char* a_role, F&& f) {
  const Tensor& a = need_input(ctx, 0, op, a_role);
  const Tensor& dy = need_input(ctx, 1, op, "dy");
  Tensor& dx = need_output(ctx, 0, op, "dx");
  check_same_shape(op, a, a_role, dy, "dy");
  check_same_shape(op, a, a_role, dx, "dx");
  const T* ap = in_data<T>(a, op, a_role);
  const T* dyp = in_data<T>(dy, op, "dy");
  T* dxp = out_data<T>(dx, op, "dx");
  const std::size_t n = to_size(a.numel());
  for (std::size_t i = 0; i < n; ++i) dxp[i] = f(ap[i], dyp[i]);
}

template <class T>
void add_elementwise(KernelRegistry& reg) {
  constexpr DeviceType cpu = DeviceType::cpu;
  constexpr DType dt = dtype_of<T>();
  reg.add_fn("exp", cpu, dt,
             [](KernelContext& c) { map_kernel<T>(c, "exp", [](T x) { return std::exp(x); }); });
  reg.add_fn("log", cpu, dt,
             [](KernelContext& c) { map_kernel<T>(c, "log", [](T x) { return std::log(x); }); });
  reg.add_fn("sqrt", cpu, dt,
             [](KernelContext& c) { map_kernel<T>(c, "sqrt", [](T x) { return std::sqrt(x); }); });
  reg.add_fn("rsqrt", cpu, dt, [](KernelContext& c) {
    map_kernel<T>(c, "rsqrt", [](T x) { return T(1) / std::sqrt(x); });
  });
  reg.add_fn("silu", cpu, dt, [](KernelContext& c) {
    map_kernel<T>(c, "silu", [](T x) { return x * sigmoid(x); });
  });
  // d sqrt(x) = 1 / (2 sqrt(x)) = 0.5 / y; d x^-1/2 = -x^-3/2 / 2 = -0.5 y^3.
  reg.add_fn("sqrt_grad", cpu, dt, [](KernelContext& c) {
    map_grad_kernel<T>(c, "sqrt_grad", "y", [](T y, T dy) { return T(0.5) * dy / y; });
  });
  reg.add_fn("rsqrt_grad", cpu, dt, [](KernelContext& c) {
    map_grad_kernel<T>(c, "rsqrt_grad", "y", [](T y, T dy) { return T(-0.5) * dy * y * y * y; });
  });
  // d x sigmoid(x) = s + x s (1 - s), s = sigmoid(x).
  reg.add_fn("silu_grad", cpu, dt, [](KernelContext& c) {
    map_grad_kernel<T>(c, "silu_grad", "x", [](T x, T dy) {
      const T s = sigmoid(x);
      return dy * s * (T(1) + x * (T(1) - s));
    });
  });
  auto finite = [](double p) { return std::isfinite(p); };
  reg.add("pow", cpu, dt, [finite](const KernelConfig& cfg) {
    const auto p = static_cast<T>(read_double(cfg, "pow", "exponent", 1.0, finite, "finite"));
    return std::make_unique<FnKernel>(
        [p](KernelContext& c) { map_kernel<T>(c, "pow", [p](T x) { return std::pow(x, p); }); });
  });
  // d x^p = p x^(p-1); at x = 0 that is 0 for p > 1, p for p = 1 (pow(0, 0) = 1) and inf below.
  reg.add("pow_grad", cpu, dt, [finite](const KernelConfig& cfg) {
    const auto p = static_cast<T>(read_double(cfg, "pow_grad", "exponent", 1.0, finite, "finite"));
    return std::make_unique<FnKernel>([p](KernelContext& c) {
      map_grad_kernel<T>(c, "pow_grad", "x",
                         [p](T x, T dy) { return dy * p * std::pow(x, p - T(1)); });
    });
  });
}

// ---------------------------------------------------------------------------------------------
// RMSNorm over the last axis (Zhang and Sennrich, 2019; Llama's LlamaRMSNorm):
//   y = x r w,  r = 1 / sqrt(mean(x^2) + eps)
// and its gradients, with xhat = x r and g = dy w:
//   dx = r (g - xhat mean(g xhat)),   dw = sum over rows of dy xhat.

struct RmsDims {
  std::size_t rows = 0, cols = 0;
};

// x [..., D] and w [D].
RmsDims rms_dims(const Tensor& x, const Tensor* w, const char* op) {
  if (x.shape().empty() || x.shape().back() == 0) {
    throw std::invalid_argument(
        fmt::format("{}: x {} must be [..., D] with D > 0", op, x.describe()));
  }
  RmsDims d;
  d.cols = to_size(x.shape().back());
  d.rows = to_size(x.numel()) / d.cols;
  if (w != nullptr && w->shape() != Shape{x.shape().back()}) {
    throw std::invalid_argument(fmt::format("{}: w {} must be [D] = [{}] for x {}", op,
                                            w->describe(), x.shape().back(), x.describe()));
  }
  return d;
}

template <class T>
double row_rstd(const T* x, std::size_t n, double eps) {
  double sq = 0;
  for (std::size_t j = 0; j < n; ++j) sq += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  return 1.0 / std::sqrt(sq / static_cast<double>(n) + eps);
}

template <class T>
void rms_norm(KernelContext& ctx, double eps) {
  const char* op = "rms_norm";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& w = need_input(ctx, 1, op, "w");
  Tensor& y = need_output(ctx, 0, op, "y");
  check_same_shape(op, x, "x", y, "y");
  const auto [rows, cols] = rms_dims(x, &w, op);
  const T* xp = in_data<T>(x, op, "x");
  const T* wp = in_data<T>(w, op, "w");
  T* yp = out_data<T>(y, op, "y");
  for (std::size_t r = 0; r < rows; ++r) {
    const T* xr = xp + r * cols;
    T* yr = yp + r * cols;
    const double rstd = row_rstd(xr, cols, eps);
    for (std::size_t j = 0; j < cols; ++j) {
      yr[j] = static_cast<T>(static_cast<double>(xr[j]) * rstd * static_cast<double>(wp[j]));
    }
  }
}

template <class T>
void rms_norm_grad(KernelContext& ctx, double eps) {
  const char* op = "rms_norm_grad";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& w = need_input(ctx, 1, op, "w");
  const Tensor& dy = need_input(ctx, 2, op, "dy");
  Tensor& dx = need_output(ctx, 0, op, "dx");
  check_same_shape(op, x, "x", dy, "dy");
  check_same_shape(op, x, "x", dx, "dx");
  const auto [rows, cols] = rms_dims(x, &w, op);
  const T* xp = in_data<T>(x, op, "x");
  const T* wp = in_data<T>(w, op, "w");
  const T* dyp = in_data<T>(dy, op, "dy");
  T* dxp = out_data<T>(dx, op, "dx");
  for (std::size_t r = 0; r < rows; ++r) {
    const T* xr = xp + r * cols;
    const T* dyr = dyp + r * cols;
    T* dxr = dxp + r * cols;
    const double rstd = row_rstd(xr, cols, eps);
    double sum_g_xhat = 0;
    for (std::size_t j = 0; j < cols; ++j) {
      sum_g_xhat += static_cast<double>(dyr[j]) * static_cast<double>(wp[j]) *
                    static_cast<double>(xr[j]) * rstd;
    }
    const double mean_g_xhat = sum_g_xhat / static_cast<double>(cols);
    for (std::size_t j = 0; j < cols; ++j) {
      const double g = static_cast<double>(dyr[j]) * static_cast<double>(wp[j]);
      const double xhat = static_cast<double>(xr[j]) * rstd;
      dxr[j] = static_cast<T>(rstd * (g - xhat * mean_g_xhat));
    }
  }
}

template <class T>
void rms_norm_grad_weight(KernelContext& ctx, double eps) {
  const char* op = "rms_norm_grad_weight";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& dy = need_input(ctx, 1, op, "dy");
  Tensor& dw = need_output(ctx, 0, op, "dw");
  check_same_shape(op, x, "x", dy, "dy");
  const auto [rows, cols] = rms_dims(x, &dw, op);
  const T* xp = in_data<T>(x, op, "x");
  const T* dyp = in_data<T>(dy, op, "dy");
  T* dwp = out_data<T>(dw, op, "dw");
  std::vector<double> acc(cols, 0.0);
  for (std::size_t r = 0; r < rows; ++r) {
    const T* xr = xp + r * cols;
    const T* dyr = dyp + r * cols;
    const double rstd = row_rstd(xr, cols, eps);
    for (std::size_t j = 0; j < cols; ++j)
      acc[j] += static_cast<double>(dyr[j]) * static_cast<double>(xr[j]) * rstd;
  }
  for (std::size_t j = 0; j < cols; ++j) dwp[j] = static_cast<T>(acc[j]);
}

double read_eps(const KernelConfig& cfg, const char* op) {
  // Llama's default; eps = 0 would divide by zero on an all-zero row (a padding row).
  return read_double(
      cfg, op, "eps", 1e-6, [](double e) { return e > 0.0 && std::isfinite(e); }, "finite and > 0");
}

// ---------------------------------------------------------------------------------------------
// Rotary position embedding (Su et al., "RoFormer", 2021) in Hugging Face's "rotate_half"
// layout: x [..., T, D], position t = the index on axis -2, pair (i, i + D/2) for i < D/2
// rotated by the angle t theta_i, theta_i = base^(-2i/D):
//   y_i = x_i cos - x_{i+D/2} sin,   y_{i+D/2} = x_{i+D/2} cos + x_i sin.
// The rotation is orthogonal, so the gradient is the rotation by the negated angle (rope_grad).
// The angles are computed as transformers' LlamaRotaryEmbedding computes them, in the element
// type: inv_freq = 1 / base^(2i/D) and t inv_freq rounded to T (float32 for f32 and bf16), so
// positions in the thousands rotate as in PyTorch; cos and sin then in double.

template <class T>
class RopeKernel final : public Kernel {
 public:
  RopeKernel(double base, bool inverse, const char* op)
      : base_(static_cast<T>(base)), inverse_(inverse), op_(op) {}

  void compute(KernelContext& ctx) override {
    const Tensor& x = need_input(ctx, 0, op_, inverse_ ? "dy" : "x");
    Tensor& y = need_output(ctx, 0, op_, inverse_ ? "dx" : "y");
    check_same_shape(op_, x, "input", y, "output");
    const Shape& s = x.shape();
    if (s.size() < 2 || s.back() % 2 != 0) {
      throw std::invalid_argument(
          fmt::format("{}: input {} must be [..., T, D] with D even", op_, x.describe()));
    }
    const std::size_t t_len = to_size(s[s.size() - 2]);
    const std::size_t d = to_size(s.back());
    const std::size_t half = d / 2;
    if (t_len == 0 || d == 0) return;
    const std::size_t blocks = to_size(x.numel()) / (t_len * d);
    fill_table(t_len, half);
    const T* xp = in_data<T>(x, op_, "input");
    T* yp = out_data<T>(y, op_, "output");
    for (std::size_t b = 0; b < blocks; ++b) {
      for (std::size_t t = 0; t < t_len; ++t) {
        const T* xr = xp + (b * t_len + t) * d;
        T* yr = yp + (b * t_len + t) * d;
        const T* c = cos_.data() + t * half;
        const T* sn = sin_.data() + t * half;
        for (std::size_t i = 0; i < half; ++i) {
          const T lo = xr[i], hi = xr[i + half];
          yr[i] = lo * c[i] - hi * sn[i];
          yr[i + half] = hi * c[i] + lo * sn[i];
        }
      }
    }
  }

 private:
  // The table depends only on (T, D): kept from piece to piece.
  void fill_table(std::size_t t_len, std::size_t half) {
    if (t_len == table_t_ && half == table_half_) return;
    cos_.resize(t_len * half);
    sin_.resize(t_len * half);
    const T d = static_cast<T>(2 * half);
    for (std::size_t i = 0; i < half; ++i) {
      const T inv_freq = T(1) / std::pow(base_, static_cast<T>(2 * i) / d);
      for (std::size_t t = 0; t < t_len; ++t) {
        const auto angle = static_cast<double>(static_cast<T>(t) * inv_freq);
        cos_[t * half + i] = static_cast<T>(std::cos(angle));
        sin_[t * half + i] = static_cast<T>(inverse_ ? -std::sin(angle) : std::sin(angle));
      }
    }
    table_t_ = t_len;
    table_half_ = half;
  }

  T base_;
  bool inverse_;
  const char* op_;
  std::vector<T> cos_, sin_;
  std::size_t table_t_ = 0, table_half_ = 0;
};

double read_base(const KernelConfig& cfg, const char* op) {
  return read_double(
      cfg, op, "base", 10000.0, [](double b) { return b > 0.0 && std::isfinite(b); },
      "finite and > 0");
}

template <class T>
void add_llm_ops_for(KernelRegistry& reg) {
  constexpr DeviceType cpu = DeviceType::cpu;
  constexpr DType dt = dtype_of<T>();
  add_elementwise<T>(reg);
  reg.add("rms_norm", cpu, dt, [](const KernelConfig& cfg) {
    const double eps = read_eps(cfg, "rms_norm");
    return std::make_unique<FnKernel>([eps](KernelContext& c) { rms_norm<T>(c, eps); });
  });
  reg.add("rms_norm_grad", cpu, dt, [](const KernelConfig& cfg) {
    const double eps = read_eps(cfg, "rms_norm_grad");
    return std::make_unique<FnKernel>([eps](KernelContext& c) { rms_norm_grad<T>(c, eps); });
  });
  reg.add("rms_norm_grad_weight", cpu, dt, [](const KernelConfig& cfg) {
    const double eps = read_eps(cfg, "rms_norm_grad_weight");
    return std::make_unique<FnKernel>([eps](KernelContext& c) { rms_norm_grad_weight<T>(c, eps); });
  });
  reg.add("rope", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<RopeKernel<T>>(read_base(cfg, "rope"), false, "rope");
  });
  reg.add("rope_grad", cpu, dt, [](const KernelConfig& cfg) {
    return std::make_unique<RopeKernel<T>>(read_base(cfg, "rope_grad"), true, "rope_grad");
  });
}

}  // namespace

void add_cpu_llm_ops(KernelRegistry& reg) {
  add_llm_ops_for<float>(reg);
  add_llm_ops_for<double>(reg);
}

}  // namespace baton
