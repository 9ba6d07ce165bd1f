#pragma once
// Private to kernels/src/cuda: the fused ops' CUDA kernels (fused.cpp), registered by
// add_cuda_kernels.
namespace baton {
class KernelRegistry;
struct KernelContext;
}

namespace baton::cuda {

/// bias_gelu, bias_gelu_grad, attention and attention_grad for cuda/f32 and cuda/bf16.
void add_fused_kernels(KernelRegistry& reg);

/// rms_norm, rms_norm_grad, rms_norm_grad_weight, rope and rope_grad for cuda/f32 (llm.cpp; bf16
/// through float32 copies).
void add_llm_kernels(KernelRegistry& reg);

/// rope_at and paged_attention, serving's decode ops, for cuda/f32 (decode.cpp; bf16 through
/// float32 copies).
void add_decode_kernels(KernelRegistry& reg);

/// matmul_bias, matmul_bias_gelu, matmul_dgelu_bgrad and matmul_bias_grad for cuda/f32 and
/// cuda/bf16: cuBLASLt's products with the bias, GELU, GELU-gradient and bias-gradient
/// epilogues (linear.cpp).
void add_linear_kernels(KernelRegistry& reg);

/// matmul_bias as the two ops it fuses, cuBLAS's product and baton's add kernel (ops.cpp): where
/// cuBLASLt does not take the shape.
void matmul_bias_apart(KernelContext& ctx, bool trans_b);

/// matmul_bias_gelu as the ops it fuses: matmul_bias_apart into its second output (pre, the
/// product plus the bias), then the gelu kernel (the form `tanh` names) from pre into y.
void matmul_bias_gelu_apart(KernelContext& ctx, bool trans_b, bool tanh);

/// matmul_dgelu_bgrad as the ops it fuses: cuBLAS's product into dh, the gelu_grad kernel of
/// pre in place, then sum_to's reduction of dh into db.
void matmul_dgelu_bgrad_apart(KernelContext& ctx, bool trans_b, bool tanh);

/// matmul_bias_grad as the two ops it fuses, cuBLAS's product and baton's sum_to kernel
/// (ops.cpp): where cuBLASLt does not take the shape.
void matmul_bias_grad_apart(KernelContext& ctx);

}  // namespace baton::cuda
