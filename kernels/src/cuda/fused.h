#pragma once
// Private to kernels/src/cuda: the fused ops' CUDA kernels (fused.cpp), registered by
// add_cuda_kernels.
namespace baton {
class KernelRegistry;
}

namespace baton::cuda {

/// bias_gelu, bias_gelu_grad, attention and attention_grad for cuda/f32 and cuda/bf16.
void add_fused_kernels(KernelRegistry& reg);

/// rms_norm, rms_norm_grad, rms_norm_grad_weight, rope and rope_grad for cuda/f32 (llm.cpp; bf16
/// through float32 copies).
void add_llm_kernels(KernelRegistry& reg);

}  // namespace baton::cuda
