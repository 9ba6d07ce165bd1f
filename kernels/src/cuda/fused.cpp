// The fused ops' CUDA kernels (bias_gelu and its gradient, attention and its gradient; float32
// and bfloat16) and the multi-tensor optimizer steps. Shapes are checked on the host with the
// CPU kernels' words (kernel_args.h); then the work is only enqueued on the actor's stream.
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../kernel_args.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/kernel.h"
#include "common.h"
#include "cudnn_sdpa.h"
#include "fused.h"
#include "kernel_util.h"
#include "launch_fused.h"

namespace baton::cuda {

const CudnnAttention& cudnn_attention() {
  static const CudnnAttention a = [] {
    CudnnAttention r;
    r.reason = cudnn::unavailable_reason();
    r.ok = r.reason.empty();
    r.version = cudnn::version();
    return r;
  }();
  return a;
}

std::string cudnn_attention_check(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, bool causal, int sm,
                                  std::int64_t h_kv) {
  // Both layouts of the backward's gradients: side by side (the graph's node) and apart (the
  // plan's; grouped-query heads have only that one).
  const bool grouped = h_kv > 0 && h_kv != h;
  const std::vector<std::int64_t> layouts = grouped ? std::vector<std::int64_t>{d} : std::vector<std::int64_t>{0, d};
  for (std::int64_t ld : layouts) {
    std::string why = cudnn::check_graphs({.b = b,
                                           .h = h,
                                           .s = s,
                                           .d = d,
                                           .h_kv = h_kv,
                                           .scale = 1.0 / std::sqrt(static_cast<double>(d)),
                                           .causal = causal,
                                           .elem = cudnn::Elem::bf16,
                                           .grad_ld = ld},
                                          sm);
    if (!why.empty()) return ld == 0 ? why : "with dq, dk and dv apart: " + why;
  }
  return "";
}

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
void bias_gelu(KernelContext& ctx, bool tanh) {
  const char* op = "bias_gelu";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& b = need_input(ctx, 1, op, "b");
  Tensor& y = need_output(ctx, 0, op, "y");
  const std::int64_t cols = baton::detail::bias_columns(x, b, op);
  check_same_shape(x, y, op);
  launched(launch::bias_gelu(in_as<E>(x, op, "x"), in_as<E>(b, op, "b"), out_as<E>(y, op, "y"), x.numel(), cols, tanh,
                             stream_of(ctx, op)),
           op, ctx);
}

template <class E>
void bias_gelu_grad(KernelContext& ctx, bool tanh) {
  const char* op = "bias_gelu_grad";
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& b = need_input(ctx, 1, op, "b");
  const Tensor& dy = need_input(ctx, 2, op, "dy");
  Tensor& dx = need_output(ctx, 0, op, "dx");
  const std::int64_t cols = baton::detail::bias_columns(x, b, op);
  check_same_shape(x, dy, op);
  check_same_shape(x, dx, op);
  launched(launch::bias_gelu_grad(in_as<E>(x, op, "x"), in_as<E>(b, op, "b"), in_as<E>(dy, op, "dy"),
                                  out_as<E>(dx, op, "dx"), x.numel(), cols, tanh, stream_of(ctx, op)),
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

// The forward's saved stats (its second output, [..., T] f32), null where the plan gives none.
float* stats_out(KernelContext& ctx, const Tensor& q, const char* op) {
  if (ctx.outputs.size() < 2 || ctx.outputs[1] == nullptr) return nullptr;
  Tensor& s = *ctx.outputs[1];
  baton::detail::check_attention_stats(s, q, op);
  return out_as<float>(s, op, "stats");
}

// The backward's sixth input, the forward's stats; null where it has none.
const float* stats_in(const KernelContext& ctx, const Tensor& q, const char* op) {
  if (ctx.inputs.size() < 6 || ctx.inputs[5] == nullptr) return nullptr;
  const Tensor& s = *ctx.inputs[5];
  baton::detail::check_attention_stats(s, q, op);
  return in_as<float>(s, op, "stats");
}

// cuDNN's problem for q [..., T, D]: the first axis as its batch, the rest of the leading axes as
// heads (one contiguous [b, h, T, D] either way); with grouped-query heads axis -3 as the heads
// and k's axis -3 as its key and value heads (the only axis where k differs from q:
// kernel_args.h attention_dims), the axes before it as the batch.
cudnn::SdpaShape sdpa_shape(const Tensor& q, const AttentionDims& a, const AttentionAttrs& attrs) {
  const Shape& s = q.shape();
  // Grouped-query heads: axis -3 holds the heads that group, every axis before it the batch.
  const std::int64_t b = a.kv_heads != a.heads ? a.heads / s[s.size() - 3] : s.size() >= 3 ? s[0] : 1;
  return {.b = b, .h = a.heads / b, .s = a.t, .d = a.d, .h_kv = a.kv_heads / b, .scale = attrs.scale_for(a.d),
          .causal = attrs.causal, .elem = cudnn::Elem::bf16};
}

// Whether an attention kernel of element type E with `attrs` runs cuDNN for this problem: kernel
// fused never; cudnn always (or a clear error: cuDNN missing, float32, a head size its engines do
// not take); auto where cuDNN loaded, the tensors are bf16 and D a multiple of 8 up to 128 (what
// cuDNN 9's flash attention engines take on every GPU since Ampere).
template <class E>
bool wants_cudnn(const AttentionAttrs& attrs, const AttentionDims& a, const char* op, std::string_view actor) {
  if (attrs.kernel == AttentionAttrs::Kernel::fused) return false;
  const CudnnAttention& c = cudnn_attention();
  const bool fits = std::is_same_v<E, launch::Bf16> && a.d % 8 == 0 && a.d <= 128;
  if (attrs.kernel == AttentionAttrs::Kernel::automatic) return c.ok && fits;
  if (!c.ok) throw std::runtime_error(fmt::format("{} (actor '{}'): kernel cudnn, but cuDNN cannot be used: {}", op, actor, c.reason));
  if (!fits) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): cuDNN's fused attention takes bf16 with a head size that is a "
                                            "multiple of 8 up to 128, not {} with D = {} (use --precision bf16, or "
                                            "--attention fused)",
                                            op, actor, std::is_same_v<E, launch::Bf16> ? "bf16" : "f32", a.d));
  }
  return true;
}

// Under kernel auto, a shape cuDNN's engines refuse falls back to baton's kernel, said once per
// actor; under kernel cudnn the error stands.
[[nodiscard]] bool fall_back(const AttentionAttrs& attrs, const std::exception& e, std::string_view actor) {
  if (attrs.kernel != AttentionAttrs::Kernel::automatic) return false;
  fmt::print(stderr, "{}: cuDNN's fused attention refused this shape ({}); baton's fused kernel runs instead\n", actor,
             e.what());
  return true;
}

template <class E>
class AttentionKernel final : public Kernel {
 public:
  AttentionKernel(AttentionAttrs attrs, std::string actor) : attrs_(attrs), actor_(std::move(actor)) {}
  void compute(KernelContext& ctx) override {
    const char* op = "attention";
    const Tensor& q = need_input(ctx, 0, op, "q");
    const Tensor& k = need_input(ctx, 1, op, "k");
    const Tensor& v = need_input(ctx, 2, op, "v");
    Tensor& o = need_output(ctx, 0, op, "o");
    const AttentionDims a = baton::detail::attention_dims(q, k, v, op);
    check_same_shape(q, o, op);
    float* stats = stats_out(ctx, q, op);
    if (!refused_ && wants_cudnn<E>(attrs_, a, op, actor_)) {
      try {
        run_cudnn(q, k, v, o, stats, a, ctx, stream_of(ctx, op));
        return;
      } catch (const std::runtime_error& e) {
        if (!fall_back(attrs_, e, actor_)) throw;
        refused_ = true;
        sdpa_.reset();
      }
    }
    check_attention_limits(a, q, op);  // on the host, before the stream (a test runs it without one)
    cudaStream_t s = stream_of(ctx, op);
    launched(launch::attention(in_as<E>(q, op, "q"), in_as<E>(k, op, "k"), in_as<E>(v, op, "v"), out_as<E>(o, op, "o"),
                               stats, a.heads, a.group(), a.t, a.d, attrs_.scale_for(a.d), attrs_.causal, s),
             op, ctx);
  }

 private:
  void run_cudnn(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, float* stats, const AttentionDims& a,
                 const KernelContext& ctx, cudaStream_t s) {
    const cudnn::SdpaShape shape = sdpa_shape(q, a, attrs_);
    if (!sdpa_ || !(sdpa_->shape() == shape)) {
      sdpa_.reset();  // one graph per shape: the plan's shapes are fixed, so it is built once
      sdpa_ = std::make_unique<cudnn::SdpaForward>(shape, actor_);
    }
    // Without a saved-stats output (a forward-only plan) cuDNN still writes them: to scratch.
    if (stats == nullptr) stats = static_cast<float*>(stats_scratch_.get(sizeof(float) * static_cast<std::size_t>(a.heads * a.t), ctx));
    const std::size_t ws = sdpa_->workspace_bytes();
    sdpa_->run(q.raw(), k.raw(), v.raw(), o.raw(), stats, ws == 0 ? nullptr : workspace_.get(ws, ctx), s);
  }

  AttentionAttrs attrs_;
  std::string actor_;
  bool refused_ = false;  // cuDNN refused the shape under kernel auto: baton's kernel from now on
  std::unique_ptr<cudnn::SdpaForward> sdpa_;
  util::Scratch workspace_, stats_scratch_;
};

template <class E>
class AttentionGradKernel final : public Kernel {
 public:
  AttentionGradKernel(AttentionAttrs attrs, std::string actor) : attrs_(attrs), actor_(std::move(actor)) {}
  void compute(KernelContext& ctx) override {
    const char* op = "attention_grad";
    const Tensor& q = need_input(ctx, 0, op, "q");
    const Tensor& k = need_input(ctx, 1, op, "k");
    const Tensor& v = need_input(ctx, 2, op, "v");
    const Tensor& o = need_input(ctx, 3, op, "o");
    const Tensor& dout = need_input(ctx, 4, op, "do");
    const AttentionDims a = baton::detail::attention_dims(q, k, v, op);
    check_same_shape(q, o, op);
    check_same_shape(q, dout, op);
    const baton::detail::AttentionGradOut grads = baton::detail::attention_grad_out(ctx, q, k, op);
    const float* stats = stats_in(ctx, q, op);
    if (!refused_ && wants_cudnn<E>(attrs_, a, op, actor_)) {
      // cuDNN's backward reads the forward's log-sum-exp; without it (a kernel run outside a
      // training plan) baton's kernel recomputes it under auto.
      if (stats == nullptr && attrs_.kernel == AttentionAttrs::Kernel::cudnn) {
        throw std::invalid_argument(fmt::format("{} (actor '{}'): kernel cudnn needs the forward's stats as a sixth input "
                                                "(a training plan gives them)", op, actor_));
      }
      if (stats != nullptr) {
        try {
          run_cudnn(q, k, v, o, dout, stats, grads, a, ctx, stream_of(ctx, op));
          return;
        } catch (const std::runtime_error& e) {
          if (!fall_back(attrs_, e, actor_)) throw;
          refused_ = true;
          sdpa_.reset();
        }
      }
    }
    check_attention_limits(a, q, op);
    cudaStream_t s = stream_of(ctx, op);
    // baton's backward reads the saved stats where there are some, else recomputes them.
    const std::size_t bytes = launch::attention_grad_scratch(a.heads, a.t);
    void* scratch = bytes == 0 ? nullptr : scratch_.get(bytes, ctx);
    launched(launch::attention_grad(in_as<E>(q, op, "q"), in_as<E>(k, op, "k"), in_as<E>(v, op, "v"),
                                    in_as<E>(o, op, "o"), in_as<E>(dout, op, "do"),
                                    launch::GradRows{grads.dq, grads.dk, grads.dv, grads.ld}, stats, scratch, a.heads,
                                    a.group(), a.t, a.d, attrs_.scale_for(a.d), attrs_.causal, s),
             op, ctx);
  }

 private:
  void run_cudnn(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& dout,
                 const float* stats, const baton::detail::AttentionGradOut& grads, const AttentionDims& a,
                 const KernelContext& ctx, cudaStream_t s) {
    cudnn::SdpaShape shape = sdpa_shape(q, a, attrs_);
    shape.grad_ld = grads.ld;
    if (!sdpa_ || !(sdpa_->shape() == shape)) {
      sdpa_.reset();
      sdpa_ = std::make_unique<cudnn::SdpaBackward>(shape, actor_);
    }
    const std::size_t ws = sdpa_->workspace_bytes();
    sdpa_->run(q.raw(), k.raw(), v.raw(), o.raw(), dout.raw(), stats, grads.dq, grads.dk, grads.dv,
               ws == 0 ? nullptr : workspace_.get(ws, ctx), s);
  }

  AttentionAttrs attrs_;
  std::string actor_;
  bool refused_ = false;
  std::unique_ptr<cudnn::SdpaBackward> sdpa_;
  util::Scratch scratch_;  // the rows' log-sum-exp and D, from the dq kernel to the dk/dv kernel
  util::Scratch workspace_;
};

template <class E>
void add_for(KernelRegistry& reg) {
  constexpr auto cuda = DeviceType::cuda;
  constexpr DType dt = dtype_for<E>();
  // GELU's form from the "approximate" attribute (erf, or tanh).
  reg.add("bias_gelu", cuda, dt, [](const KernelConfig& cfg) {
    const bool tanh = baton::detail::gelu_tanh(cfg, "bias_gelu");
    return kernel_of([tanh](KernelContext& c) { bias_gelu<E>(c, tanh); })(cfg);
  });
  reg.add("bias_gelu_grad", cuda, dt, [](const KernelConfig& cfg) {
    const bool tanh = baton::detail::gelu_tanh(cfg, "bias_gelu_grad");
    return kernel_of([tanh](KernelContext& c) { bias_gelu_grad<E>(c, tanh); })(cfg);
  });
  reg.add("attention", cuda, dt, [](const KernelConfig& cfg) {
    return std::make_unique<AttentionKernel<E>>(AttentionAttrs::read(cfg.attrs, cfg.actor, "attention"), std::string(cfg.actor));
  });
  reg.add("attention_grad", cuda, dt, [](const KernelConfig& cfg) {
    return std::make_unique<AttentionGradKernel<E>>(AttentionAttrs::read(cfg.attrs, cfg.actor, "attention_grad"),
                                                    std::string(cfg.actor));
  });
}

}  // namespace

void add_fused_kernels(KernelRegistry& reg) {
  add_for<float>(reg);
  add_for<launch::Bf16>(reg);
}

void adam_step_multi(std::span<const AdamSlice> tensors, const AdamConfig& cfg, std::int64_t step, double lr,
                     Stream& stream, float grad_scale) {
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
    list.push_back({a.w, a.g, a.m, a.v, a.n, weight_copy(a.copy, a.n, stream)});
  }
  stream.bind();
  check(launch::adam_multi(list.data(), static_cast<long long>(list.size()), k, grad_scale, stream.impl().stream),
        "adam_multi", stream.owner());
}

void sgd_step_multi(std::span<const SgdSlice> tensors, const SgdConfig& cfg, std::int64_t step, double lr,
                    Stream& stream, float grad_scale) {
  if (step < 1) throw std::invalid_argument(fmt::format("{}: sgd_step_multi at step {} (steps count from 1)", stream.owner(), step));
  if (cfg.nesterov && !(cfg.momentum > 0.0)) throw std::invalid_argument(stream.owner() + ": nesterov needs a positive momentum");
  std::vector<launch::SgdPointers> list;
  list.reserve(tensors.size());
  for (const SgdSlice& a : tensors) {
    if (a.n < 0) throw std::invalid_argument(fmt::format("{}: sgd_step_multi: a tensor of {} elements", stream.owner(), a.n));
    list.push_back({a.w, a.g, cfg.momentum != 0.0 ? a.momentum_buf : nullptr, a.n, weight_copy(a.copy, a.n, stream)});
  }
  stream.bind();
  check(launch::sgd_multi(list.data(), static_cast<long long>(list.size()), lr, cfg.momentum, cfg.weight_decay,
                          cfg.nesterov, step == 1, grad_scale, stream.impl().stream),
        "sgd_multi", stream.owner());
}

}  // namespace baton::cuda
