#pragma once
// Private to kernels/src/cuda: the launchers of the fused kernels (fused.cu, attention.cu),
// called from fused.cpp. Plain pointers as in launch.h; tensors dense and row-major in device
// memory; each returns the launch's cudaError_t.
#include <cuda_runtime.h>

#include "launch.h"

namespace baton::cuda::launch {

/// y = gelu(x + b[i % cols]) over n elements, x + b rounded to float as the unfused add's, then
/// the gelu kernel's arithmetic (the tanh form where `tanh`): the bits of gelu(add(x, b)).
cudaError_t bias_gelu(const float* x, const float* b, float* y, long long n, long long cols, bool tanh,
                      cudaStream_t s);
cudaError_t bias_gelu(const Bf16* x, const Bf16* b, Bf16* y, long long n, long long cols, bool tanh, cudaStream_t s);
/// dx = gelu'(x + b[i % cols]) dy: the bits of gelu_grad(add(x, b), dy).
cudaError_t bias_gelu_grad(const float* x, const float* b, const float* dy, float* dx, long long n, long long cols,
                           bool tanh, cudaStream_t s);
cudaError_t bias_gelu_grad(const Bf16* x, const Bf16* b, const Bf16* dy, Bf16* dx, long long n, long long cols,
                           bool tanh, cudaStream_t s);

/// The largest head size D the attention kernels take (they are compiled for 16, 32, 64 and
/// 128 and pad a smaller D with zeros).
constexpr long long attention_max_d = 128;

/// o = softmax(scale q k^T, causally masked) v for `heads` independent heads of t rows of d
/// (q, o [heads, t, d]; k, v [heads / group, t, d]: query head h reads kv head h / group, 1
/// without grouped-query heads), FlashAttention-2's forward: per block of query rows, blocks of
/// keys with an online softmax, float32 accumulation; bf16 products on tensor cores (WMMA).
/// `lse` (may be null): each row's natural log-sum-exp of its scaled scores, [heads, t].
cudaError_t attention(const float* q, const float* k, const float* v, float* o, float* lse, long long heads,
                      long long group, long long t, long long d, double scale, bool causal, cudaStream_t s);
cudaError_t attention(const Bf16* q, const Bf16* k, const Bf16* v, Bf16* o, float* lse, long long heads,
                      long long group, long long t, long long d, double scale, bool causal, cudaStream_t s);

/// Where attention_grad writes (the element type's): row i of head h of dq at dq + (h t + i) ld,
/// of kv head h of dk and dv likewise; ld 3 d with the three side by side in one [heads, t, 3 d]
/// tensor, d in tensors of their own (always with grouped-query heads).
struct GradRows {
  void* dq;
  void* dk;
  void* dv;
  long long ld;
};

/// The gradients of attention into `out`, FlashAttention-2's backward without atomics: one
/// kernel per block of query rows takes their log-sum-exp (`lse`, the forward's [heads, t],
/// natural log; null: recomputed, one more Q K^T pass) and D = rowsum(do * o) and accumulates dq;
/// a second, per block of keys of a kv head, accumulates dk and dv over the head's `group`
/// query heads in turn. `scratch`: device memory of attention_grad_scratch(heads, t) bytes.
cudaError_t attention_grad(const float* q, const float* k, const float* v, const float* o, const float* dout,
                           GradRows out, const float* lse, void* scratch, long long heads, long long group, long long t,
                           long long d, double scale, bool causal, cudaStream_t s);
cudaError_t attention_grad(const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* o, const Bf16* dout, GradRows out,
                           const float* lse, void* scratch, long long heads, long long group, long long t, long long d,
                           double scale, bool causal, cudaStream_t s);
inline size_t attention_grad_scratch(long long heads, long long t) {
  return static_cast<size_t>(2 * heads * t) * sizeof(float);
}

/// One tensor of a multi-tensor optimizer step: n float32 elements each, and where the step
/// also writes the new weights (WeightCopy: float32, bfloat16, or nowhere).
struct AdamPointers {
  float* w;
  const float* g;
  float* m;
  float* v;
  long long n;
  WeightCopy copy;
};
struct SgdPointers {
  float* w;
  const float* g;
  float* buf;  // null without momentum
  long long n;
  WeightCopy copy;
};

/// adam() over `count` tensors in few launches: each launch takes up to multi_tensors tensors
/// and multi_blocks chunks of multi_chunk elements, their pointers in the kernel's arguments (as
/// PyTorch's multi_tensor_apply), so no descriptor table has to reach the device first. Each
/// element's arithmetic is adam()'s.
constexpr int multi_tensors = 36;
constexpr int multi_blocks = 320;
constexpr long long multi_chunk = 65536;
/// `grad_scale`: each gradient element is multiplied by it first, rounded to float (the clipping
/// factor: the bits of scale() on the gradient, then the step); 1 reads the gradients as they are.
cudaError_t adam_multi(const AdamPointers* tensors, long long count, const AdamConstants& k, float grad_scale,
                       cudaStream_t s);
/// sgd() over `count` tensors, as adam_multi; every element's arithmetic is sgd()'s.
cudaError_t sgd_multi(const SgdPointers* tensors, long long count, double lr, double momentum, double weight_decay,
                      bool nesterov, bool first, float grad_scale, cudaStream_t s);

}  // namespace baton::cuda::launch
