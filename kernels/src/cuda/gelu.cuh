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

/// The tanh form (torch's gelu(approximate="tanh")): the CPU's GeluTanh (ops_nn.cpp), the same
/// operations in the same order; tanhf is within 2 ulp of the CPU's.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float inner = static_cast<float>(0.79788456080286535588) * (x + 0.044715f * (x * x * x));
  return 0.5f * x * (1.f + tanhf(inner));
}

/// d/dx of gelu_tanh, times dy (the CPU's GeluTanhGrad).
__device__ __forceinline__ float gelu_tanh_grad(float x, float dy) {
  const float k = static_cast<float>(0.79788456080286535588);
  const float x2 = x * x;
  const float t = tanhf(k * (x + 0.044715f * (x2 * x)));
  const float left = 0.5f * x;
  const float right = 1.f + t;
  const float d_right = left * ((1.f - t * t) * (k * (1.f + static_cast<float>(3 * 0.044715) * x2)));
  return dy * (0.5f * right + d_right);
}

/// GELU in the form `tanh_form` names, and its gradient.
template <bool tanh_form>
__device__ __forceinline__ float gelu_of(float x) {
  if constexpr (tanh_form) {
    return gelu_tanh(x);
  } else {
    return gelu(x);
  }
}
template <bool tanh_form>
__device__ __forceinline__ float gelu_grad_of(float x, float dy) {
  if constexpr (tanh_form) {
    return gelu_tanh_grad(x, dy);
  } else {
    return gelu_grad(x, dy);
  }
}

}  // namespace baton::cuda::launch::act
