// The fused ops' CUDA kernels (bias_gelu and its gradient, attention and its gradient; float32
// and bfloat16) and the multi-tensor optimizer steps. Shapes are checked on the host with the
// CPU kernels' words (kernel_args.h); then the work is only enqueued on the actor's stream.
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "../kernel_args.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/kernel.h"
#include "common.h"
#include "fused.h"
#include "kernel_util.h"
#include "launch_fused.h"

namespace baton::cuda {

namespace {

using baton::detail::AttentionAttrs;
using baton::detail::AttentionDims;
using baton::detail::need_input;
using baton::detail::need_output;
using util::launched;
using util::stream_of;

template <class E>
constexpr DType dtype_for() {
  return std::is_same_v<E, launch::Bf16> ? DType::bf16 : DType::f32;
}

template <class E>
const E* in_as(const Tensor& t, const char* op, const char* role) {
  if (t.dtype() != dtype_for<E>()) {
    throw std::invalid_argument(fmt::format("{}: {} is {}, expected {}", op, role, t.describe(), name(dtype_for<E>())));
  }
  return static_cast<const E*>(t.raw());
}

template <class E>
E* out_as(Tensor& t, const char* op, const char* role) {
  if (t.dtype() != dtype_for<E>()) {
    throw std::invalid_argument(fmt::format("{}: {} is {}, expected {}", op, role, t.describe(), name(dtype_for<E>())));
  }
  return static_cast<E*>(t.raw());
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* op) {
  if (a.shape() != b.shape()) {
    throw std::invalid_argument(fmt::format("{}: {} and {} differ in shape", op, a.describe(), b.describe()));
  }
}

template <class E>
void bias_gelu(KernelContext& ctx) {
  const char* op = "bias_gelu";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& b = need_input(ctx, 1, op, "b");
  Tensor& y = need_output(ctx, 0, op, "y");
  const std::int64_t cols = baton::detail::bias_columns(x, b, op);
  check_same_shape(x, y, op);
  launched(launch::bias_gelu(in_as<E>(x, op, "x"), in_as<E>(b, op, "b"), out_as<E>(y, op, "y"), x.numel(), cols,
                             stream_of(ctx, op)),
           op, ctx);
}

template <class E>
void bias_gelu_grad(KernelContext& ctx) {
  const char* op = "bias_gelu_grad";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& b = need_input(ctx, 1, op, "b");
  const Tensor& dy = need_input(ctx, 2, op, "dy");
  Tensor& dx = need_output(ctx, 0, op, "dx");
  const std::int64_t cols = baton::detail::bias_columns(x, b, op);
  check_same_shape(x, dy, op);
  check_same_shape(x, dx, op);
  launched(launch::bias_gelu_grad(in_as<E>(x, op, "x"), in_as<E>(b, op, "b"), in_as<E>(dy, op, "dy"),
                                  out_as<E>(dx, op, "dx"), x.numel(), cols, stream_of(ctx, op)),
           op, ctx);
}

// The head sizes and lengths the kernels take (attention.cu), checked here so that the error
// names the actor's tensors rather than cudaErrorInvalidValue.
void check_attention_limits(const AttentionDims& a, const Tensor& q, const char* op) {
  if (a.d > launch::attention_max_d) {
    throw std::invalid_argument(fmt::format("{}: q {} has heads of {}; the CUDA kernels take D <= {}", op, q.describe(),
                                            a.d, launch::attention_max_d));
  }
  if (a.t > INT_MAX / 2 || a.heads > INT_MAX) {
    throw std::invalid_argument(fmt::format("{}: q {} exceeds the CUDA kernels' 32-bit extents", op, q.describe()));
  }
}

template <class E>
class AttentionKernel final : public Kernel {
 public:
  explicit AttentionKernel(AttentionAttrs attrs) : attrs_(attrs) {}
  void compute(KernelContext& ctx) override {
    const char* op = "attention";
    const Tensor& q = need_input(ctx, 0, op, "q");
    const Tensor& k = need_input(ctx, 1, op, "k");
    const Tensor& v = need_input(ctx, 2, op, "v");
    Tensor& o = need_output(ctx, 0, op, "o");
    const AttentionDims a = baton::detail::attention_dims(q, k, v, op);
    check_same_shape(q, o, op);
    check_attention_limits(a, q, op);
    launched(launch::attention(in_as<E>(q, op, "q"), in_as<E>(k, op, "k"), in_as<E>(v, op, "v"), out_as<E>(o, op, "o"),
                               nullptr, a.heads, a.t, a.d, attrs_.scale_for(a.d), attrs_.causal, stream_of(ctx, op)),
             op, ctx);
  }

 private:
  AttentionAttrs attrs_;
};

template <class E>
class AttentionGradKernel final : public Kernel {
 public:
  explicit AttentionGradKernel(AttentionAttrs attrs) : attrs_(attrs) {}
  void compute(KernelContext& ctx) override {
    const char* op = "attention_grad";
    const Tensor& q = need_input(ctx, 0, op, "q");
    const Tensor& k = need_input(ctx, 1, op, "k");
    const Tensor& v = need_input(ctx, 2, op, "v");
    const Tensor& o = need_input(ctx, 3, op, "o");
    const Tensor& dout = need_input(ctx, 4, op, "do");
    Tensor& grads = need_output(ctx, 0, op, "dqkv");
    const AttentionDims a = baton::detail::attention_dims(q, k, v, op);
    check_same_shape(q, o, op);
    check_same_shape(q, dout, op);
    if (grads.shape() != baton::detail::attention_grad_shape(q.shape())) {
      throw std::invalid_argument(fmt::format("{}: dqkv {} must be {} (dq, dk and dv side by side)", op, grads.describe(),
                                              to_string(baton::detail::attention_grad_shape(q.shape()))));
    }
    check_attention_limits(a, q, op);
    cudaStream_t s = stream_of(ctx, op);
    const std::size_t bytes = launch::attention_grad_scratch(a.heads, a.t);
    void* scratch = bytes == 0 ? nullptr : scratch_.get(bytes, ctx);
    launched(launch::attention_grad(in_as<E>(q, op, "q"), in_as<E>(k, op, "k"), in_as<E>(v, op, "v"),
                                    in_as<E>(o, op, "o"), in_as<E>(dout, op, "do"), out_as<E>(grads, op, "dqkv"),
                                    scratch, a.heads, a.t, a.d, attrs_.scale_for(a.d), attrs_.causal, s),
             op, ctx);
  }

 private:
  AttentionAttrs attrs_;
  util::Scratch scratch_;  // the rows' log-sum-exp and D, from the dq kernel to the dk/dv kernel
};

template <class E>
void add_for(KernelRegistry& reg) {
  constexpr auto cuda = DeviceType::cuda;
  constexpr DType dt = dtype_for<E>();
  reg.add_fn("bias_gelu", cuda, dt, bias_gelu<E>);
  reg.add_fn("bias_gelu_grad", cuda, dt, bias_gelu_grad<E>);
  reg.add("attention", cuda, dt, [](const KernelConfig& cfg) {
    return std::make_unique<AttentionKernel<E>>(AttentionAttrs::read(cfg.attrs, cfg.actor, "attention"));
  });
  reg.add("attention_grad", cuda, dt, [](const KernelConfig& cfg) {
    return std::make_unique<AttentionGradKernel<E>>(AttentionAttrs::read(cfg.attrs, cfg.actor, "attention_grad"));
  });
}

}  // namespace

void add_fused_kernels(KernelRegistry& reg) {
  add_for<float>(reg);
  add_for<launch::Bf16>(reg);
}

void adam_step_multi(std::span<const AdamSlice> tensors, const AdamConfig& cfg, std::int64_t step, double lr,
                     Stream& stream) {
  if (step < 1) throw std::invalid_argument(fmt::format("{}: adam_step_multi at step {} (steps count from 1)", stream.owner(), step));
  // The constants exactly as adam_step (ops.cpp) and baton/kernels/optim.cpp make them.
  const double t = static_cast<double>(step);
  const launch::AdamConstants k{static_cast<float>(cfg.beta1),
                                static_cast<float>(cfg.beta2),
                                static_cast<float>(1.0 - cfg.beta1),
                                static_cast<float>(1.0 - cfg.beta2),
                                static_cast<float>(lr / (1.0 - std::pow(cfg.beta1, t))),
                                static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(cfg.beta2, t))),
                                static_cast<float>(cfg.eps),
                                static_cast<float>(cfg.decoupled ? 1.0 - lr * cfg.weight_decay : 1.0),
                                static_cast<float>(cfg.decoupled ? 0.0 : cfg.weight_decay)};
  std::vector<launch::AdamPointers> list;
  list.reserve(tensors.size());
  for (const AdamSlice& a : tensors) {
    if (a.n < 0) throw std::invalid_argument(fmt::format("{}: adam_step_multi: a tensor of {} elements", stream.owner(), a.n));
    list.push_back({a.w, a.g, a.m, a.v, a.n});
  }
  stream.bind();
  check(launch::adam_multi(list.data(), static_cast<long long>(list.size()), k, stream.impl().stream), "adam_multi",
        stream.owner());
}

void sgd_step_multi(std::span<const SgdSlice> tensors, const SgdConfig& cfg, std::int64_t step, double lr,
                    Stream& stream) {
  if (step < 1) throw std::invalid_argument(fmt::format("{}: sgd_step_multi at step {} (steps count from 1)", stream.owner(), step));
  if (cfg.nesterov && !(cfg.momentum > 0.0)) throw std::invalid_argument(stream.owner() + ": nesterov needs a positive momentum");
  std::vector<launch::SgdPointers> list;
  list.reserve(tensors.size());
  for (const SgdSlice& a : tensors) {
    if (a.n < 0) throw std::invalid_argument(fmt::format("{}: sgd_step_multi: a tensor of {} elements", stream.owner(), a.n));
    list.push_back({a.w, a.g, cfg.momentum != 0.0 ? a.momentum_buf : nullptr, a.n});
  }
  stream.bind();
  check(launch::sgd_multi(list.data(), static_cast<long long>(list.size()), lr, cfg.momentum, cfg.weight_decay,
                          cfg.nesterov, step == 1, stream.impl().stream),
        "sgd_multi", stream.owner());
}

}  // namespace baton::cuda
