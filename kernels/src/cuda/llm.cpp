// The LLM ops' row-wise and positional kernels on CUDA devices (launchers in llm.cu): RMSNorm
// and its gradients, the rotary embedding and its gradient, f32 (bf16 through float32 copies,
// as KernelRegistry::create falls back). The CPU's are in ops_llm.cpp; shapes are checked here,
// on the host, with the CPU's words, before anything is enqueued.
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "../kernel_args.h"
#include "baton/kernels/kernel.h"
#include "common.h"
#include "fused.h"
#include "kernel_util.h"
#include "launch.h"

namespace baton::cuda {

namespace {

using detail::check_same_shape;
using detail::in_data;
using detail::need_input;
using detail::need_output;
using detail::out_data;
using util::launched;
using util::Scratch;
using util::stream_of;

double read_positive(const KernelConfig& cfg, const char* op, const char* attr, double fallback) {
  const double v = cfg.attrs.get_double(attr, fallback);
  if (!(v > 0.0) || !std::isfinite(v)) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): {} {} must be finite and > 0", op, cfg.actor, attr, v));
  }
  return v;
}

/// x [..., D] and w [D]: rows and D, as ops_llm.cpp's rms_dims.
std::pair<long long, long long> rms_dims(const Tensor& x, const Tensor* w, const char* op) {
  if (x.shape().empty() || x.shape().back() == 0) {
    throw std::invalid_argument(fmt::format("{}: x {} must be [..., D] with D > 0", op, x.describe()));
  }
  const long long cols = x.shape().back();
  if (w != nullptr && w->shape() != Shape{x.shape().back()}) {
    throw std::invalid_argument(
        fmt::format("{}: w {} must be [D] = [{}] for x {}", op, w->describe(), cols, x.describe()));
  }
  return {x.numel() / cols, cols};
}

class RmsNormKernel final : public Kernel {
 public:
  RmsNormKernel(double eps, int which) : eps_(eps), which_(which) {}
  void compute(KernelContext& ctx) override {
    if (which_ == 0) return forward(ctx);
    if (which_ == 1) return grad(ctx);
    grad_weight(ctx);
  }

 private:
  void forward(KernelContext& ctx) {
    const char* op = "rms_norm";
    const Tensor& x = need_input(ctx, 0, op, "x");
    const Tensor& w = need_input(ctx, 1, op, "w");
    Tensor& y = need_output(ctx, 0, op, "y");
    check_same_shape(op, x, "x", y, "y");
    const auto [rows, cols] = rms_dims(x, &w, op);
    launched(launch::rms_norm(in_data<float>(x, op, "x"), in_data<float>(w, op, "w"), out_data<float>(y, op, "y"), rows,
                              cols, eps_, stream_of(ctx, op)),
             op, ctx);
  }
  void grad(KernelContext& ctx) {
    const char* op = "rms_norm_grad";
    const Tensor& x = need_input(ctx, 0, op, "x");
    const Tensor& w = need_input(ctx, 1, op, "w");
    const Tensor& dy = need_input(ctx, 2, op, "dy");
    Tensor& dx = need_output(ctx, 0, op, "dx");
    check_same_shape(op, x, "x", dy, "dy");
    check_same_shape(op, x, "x", dx, "dx");
    const auto [rows, cols] = rms_dims(x, &w, op);
    launched(launch::rms_norm_grad(in_data<float>(x, op, "x"), in_data<float>(w, op, "w"), in_data<float>(dy, op, "dy"),
                                   out_data<float>(dx, op, "dx"), rows, cols, eps_, stream_of(ctx, op)),
             op, ctx);
  }
  void grad_weight(KernelContext& ctx) {
    const char* op = "rms_norm_grad_weight";
    const Tensor& x = need_input(ctx, 0, op, "x");
    const Tensor& dy = need_input(ctx, 1, op, "dy");
    Tensor& dw = need_output(ctx, 0, op, "dw");
    check_same_shape(op, x, "x", dy, "dy");
    const auto [rows, cols] = rms_dims(x, &dw, op);
    cudaStream_t s = stream_of(ctx, op);
    auto* rstd = static_cast<double*>(scratch_.get(static_cast<std::size_t>(std::max(rows, 1LL)) * sizeof(double), ctx));
    launched(launch::rms_norm_grad_weight(in_data<float>(x, op, "x"), in_data<float>(dy, op, "dy"), rstd,
                                          out_data<float>(dw, op, "dw"), rows, cols, eps_, s),
             op, ctx);
  }

  double eps_;
  int which_;  // 0 rms_norm, 1 rms_norm_grad, 2 rms_norm_grad_weight
  Scratch scratch_;
};

/// The rotation tables are made on the host exactly as ops_llm.cpp's RopeKernel makes them (in
/// float: inv_freq = 1 / base^(2i/D), angle t inv_freq rounded to float, cos and sin in double
/// rounded once) and copied to the device once per (T, D).
class RopeKernel final : public Kernel {
 public:
  RopeKernel(double base, bool inverse, const char* op) : base_(static_cast<float>(base)), inverse_(inverse), op_(op) {}
  void compute(KernelContext& ctx) override {
    const Tensor& x = need_input(ctx, 0, op_, inverse_ ? "dy" : "x");
    Tensor& y = need_output(ctx, 0, op_, inverse_ ? "dx" : "y");
    check_same_shape(op_, x, "input", y, "output");
    const Shape& s = x.shape();
    if (s.size() < 2 || s.back() % 2 != 0) {
      throw std::invalid_argument(fmt::format("{}: input {} must be [..., T, D] with D even", op_, x.describe()));
    }
    const long long t_len = s[s.size() - 2], d = s.back(), half = d / 2;
    if (t_len == 0 || d == 0) return;
    const long long blocks = x.numel() / (t_len * d);
    cudaStream_t stream = stream_of(ctx, op_);
    float* tables = static_cast<float*>(scratch_.get(static_cast<std::size_t>(2 * t_len * half) * sizeof(float), ctx));
    if (t_len != table_t_ || half != table_half_) {
      fill_tables(t_len, half);
      check(cudaMemcpyAsync(tables, host_.data(), host_.size() * sizeof(float), cudaMemcpyHostToDevice, stream),
                  op_, ctx.stream->owner());
      table_t_ = t_len;
      table_half_ = half;
    }
    launched(launch::rope(in_data<float>(x, op_, "input"), tables, tables + t_len * half, out_data<float>(y, op_, "output"),
                          blocks, t_len, half, stream),
             op_, ctx);
  }

 private:
  void fill_tables(long long t_len, long long half) {
    host_.assign(static_cast<std::size_t>(2 * t_len * half), 0.f);
    float* cos_t = host_.data();
    float* sin_t = host_.data() + t_len * half;
    const auto d = static_cast<float>(2 * half);
    for (long long i = 0; i < half; ++i) {
      const float inv_freq = 1.f / std::pow(base_, static_cast<float>(2 * i) / d);
      for (long long t = 0; t < t_len; ++t) {
        const auto angle = static_cast<double>(static_cast<float>(t) * inv_freq);
        cos_t[t * half + i] = static_cast<float>(std::cos(angle));
        sin_t[t * half + i] = static_cast<float>(inverse_ ? -std::sin(angle) : std::sin(angle));
      }
    }
  }

  float base_;
  bool inverse_;
  const char* op_;
  std::vector<float> host_;  // cos then sin, [T, D/2] each; kept while the copy may read it
  long long table_t_ = 0, table_half_ = 0;
  Scratch scratch_;
};

}  // namespace

void add_llm_kernels(KernelRegistry& reg) {
  constexpr auto cuda = DeviceType::cuda;
  const char* norms[] = {"rms_norm", "rms_norm_grad", "rms_norm_grad_weight"};
  for (int which = 0; which < 3; ++which) {
    const char* op = norms[which];
    reg.add(op, cuda, DType::f32, [op, which](const KernelConfig& cfg) {
      return std::make_unique<RmsNormKernel>(read_positive(cfg, op, "eps", 1e-6), which);
    });
  }
  for (const char* op : {"rope", "rope_grad"}) {
    reg.add(op, cuda, DType::f32, [op](const KernelConfig& cfg) {
      return std::make_unique<RopeKernel>(read_positive(cfg, op, "base", 10000.0), std::string_view(op) == "rope_grad", op);
    });
  }
}

}  // namespace baton::cuda
