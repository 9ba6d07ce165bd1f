#pragma once
// Private to kernels/src: GELU's two forms on the CPU, one formula each for every kernel that
// computes them (gelu, bias_gelu and their gradients in ops_nn.cpp; matmul_bias_gelu in
// ops_tensor.cpp), so that a fused kernel gives the unfused ops' bits.
#include <cmath>
#include <cstddef>
#include <type_traits>

#include "baton/kernels/vmath.h"

namespace baton::detail {

inline constexpr double gelu_inv_sqrt2 = 0.70710678118654752440;
inline constexpr double gelu_inv_sqrt_2pi = 0.39894228040143267794;
inline constexpr double gelu_sqrt_2_over_pi = 0.79788456080286535588;
inline constexpr double gelu_kappa = 0.044715;

/// 0.5 x (1 + erf(x / sqrt 2)) written with erfc, which keeps its relative accuracy in the
/// negative tail where 1 + erf(.) cancels.
template <class T>
T gelu_erf(T x) {
  return T(0.5) * x * std::erfc(-x * T(gelu_inv_sqrt2));
}

/// d/dx x Phi(x) = Phi(x) + x phi(x), times dy.
template <class T>
T gelu_erf_grad(T x, T dy) {
  T cdf = T(0.5) * std::erfc(-x * T(gelu_inv_sqrt2));
  T pdf = T(gelu_inv_sqrt_2pi) * std::exp(T(-0.5) * x * x);
  return dy * (cdf + x * pdf);
}

/// The tanh approximation, torch's gelu(approximate="tanh") (GPT-2's gelu_new, Megatron's
/// bias_gelu): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in the element type with
/// torch's CPU kernel's operations in its order.
template <class T>
T gelu_tanh(T x) {
  const T inner = T(gelu_sqrt_2_over_pi) * (x + T(gelu_kappa) * (x * x * x));
  return T(0.5) * x * (T(1) + std::tanh(inner));
}

/// d/dx of gelu_tanh: 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2 / pi) (1 + 3 kappa x^2), t the tanh;
/// times dy.
template <class T>
T gelu_tanh_grad(T x, T dy) {
  const T x2 = x * x;
  const T t = std::tanh(T(gelu_sqrt_2_over_pi) * (x + T(gelu_kappa) * (x2 * x)));
  const T left = T(0.5) * x;
  const T right = T(1) + t;
  const T d_right = left * ((T(1) - t * t) * (T(gelu_sqrt_2_over_pi) * (T(1) + T(3 * gelu_kappa) * x2)));
  return dy * (T(0.5) * right + d_right);
}

/// y[i] = gelu(x[i]) over n elements in the form `tanh` names, as the gelu kernel computes it
/// (float32's erf form a vector at a time through vmath). y may be x.
template <class T>
void gelu_elements(const T* x, T* y, std::size_t n, bool tanh) {
  if (tanh) {
    for (std::size_t i = 0; i < n; ++i) y[i] = gelu_tanh(x[i]);
  } else if constexpr (std::is_same_v<T, float>) {
    vmath::gelu(x, nullptr, 1, y, n);
  } else {
    for (std::size_t i = 0; i < n; ++i) y[i] = gelu_erf(x[i]);
  }
}

/// dx[i] = gelu'(x[i]) dy[i] over n elements in the form `tanh` names, as the gelu_grad kernel
/// computes it (float32's erf form through vmath). dx may be x or dy.
template <class T>
void gelu_grad_elements(const T* x, const T* dy, T* dx, std::size_t n, bool tanh) {
  if (tanh) {
    for (std::size_t i = 0; i < n; ++i) dx[i] = gelu_tanh_grad(x[i], dy[i]);
  } else if constexpr (std::is_same_v<T, float>) {
    vmath::gelu_grad(x, nullptr, 1, dy, dx, n);
  } else {
    for (std::size_t i = 0; i < n; ++i) dx[i] = gelu_erf_grad(x[i], dy[i]);
  }
}

}  // namespace baton::detail
