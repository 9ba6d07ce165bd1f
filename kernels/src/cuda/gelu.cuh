#pragma once
// Private to the .cu files of kernels/src/cuda: GELU and its gradient for the gelu, gelu_grad,
// bias_gelu and bias_gelu_grad kernels (one formula, so the fused ops give the unfused ones'
// bits). In float, as the CPU's kernels compute them in the element type (ops_nn.cpp: erfc keeps
// the negative tail's relative accuracy, where 1 + erf cancels), with the same operations in the
// same order (-fmad=false); CUDA's erfcf and expf are within 2-4 ulp of the CPU's libm. Double
// erf and exp, as these kernels had, made the MLP's gelu_grad a compute-bound 12 ms of a GPT
// step on an H200.
namespace baton::cuda::launch::act {

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * erfcf(-x * static_cast<float>(0.70710678118654752440));
}

/// d/dx x Phi(x) = Phi(x) + x phi(x), times dy.
__device__ __forceinline__ float gelu_grad(float x, float dy) {
  const float cdf = 0.5f * erfcf(-x * static_cast<float>(0.70710678118654752440));
  const float pdf = static_cast<float>(0.39894228040143267794) * expf(-0.5f * x * x);
  return dy * (cdf + x * pdf);
}

}  // namespace baton::cuda::launch::act
