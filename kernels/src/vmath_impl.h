#pragma once
// Private to vmath.cpp and vmath_avx.cpp: the vector loops of baton/kernels/vmath.h as templates
// over an instruction set `Isa` (Isa::V a GCC vector type, __m128 or __m256, so the arithmetic
// is the element type's, lane by lane, in the scalar formula's order: no contraction into FMAs
// under -std=c++20; Isa::exp(V) SLEEF's exp of that width). Each .cpp instantiates its own
// instruction set: vmath_avx.cpp, compiled with -mavx, the AVX one; vmath.cpp the SSE2 one. This
// header includes no C++ library header with inline functions, so nothing compiled for AVX can
// stand in for a function another file compiled without it.
#include <cstddef>

namespace baton::vmath::detail {

constexpr float inv_sqrt2 = static_cast<float>(0.70710678118654752440);
constexpr float inv_sqrt_2pi = static_cast<float>(0.39894228040143267794);

// erfc(z) lane by lane: t exp(-z^2 + P(t)), t = 1 / (1 + |z| / 2), P a Chebyshev fit of degree
// 9 whose fractional error is below 1.2e-7 for every z >= 0 (Numerical Recipes' erfcc; the
// error is relative, so the negative tail of GELU, where erfc is tiny, keeps its digits), and
// erfc(z) = 2 - erfc(-z) below 0. One SLEEF exp per lane: SLEEF's own erfc took 16 ns an
// element here, this about 2.
template <class Isa>
[[gnu::always_inline]] inline typename Isa::V erfc(typename Isa::V z) {
  using V = typename Isa::V;
  const V a = z < 0 ? -z : z;
  const V t = 1.0f / (1.0f + 0.5f * a);
  // Estrin's scheme (pairs, then pairs of pairs): a quarter of Horner's dependent chain, which
  // left the vector unit waiting on each multiply-add in turn.
  const V t2 = t * t, t4 = t2 * t2, t8 = t4 * t4;
  const V c01 = -1.26551223f + t * 1.00002368f, c23 = 0.37409196f + t * 0.09678418f;
  const V c45 = -0.18628806f + t * 0.27886807f, c67 = -1.13520398f + t * 1.48851587f;
  const V c89 = -0.82215223f + t * 0.17087277f;
  const V p = (c01 + t2 * c23) + t4 * (c45 + t2 * c67) + t8 * c89;
  const V r = t * Isa::exp(-a * a + p);
  return z < 0 ? 2.0f - r : r;
}

// dy == nullptr: GELU, else its gradient times dy.
template <class Isa>
[[gnu::always_inline]] inline void run(const float* x, const float* b, std::size_t cols, const float* dy, float* out,
                                       std::size_t n) {
  using V = typename Isa::V;
  constexpr std::size_t w = sizeof(V) / sizeof(float);
  std::size_t j = 0;  // the bias column of element i
  for (std::size_t i = 0; i < n; i += w) {
    const std::size_t m = n - i < w ? n - i : w;
    V v, d{};
    if (m == w && (b == nullptr || j + w <= cols)) {  // a whole vector, its bias not wrapping
      __builtin_memcpy(&v, x + i, sizeof v);
      if (b != nullptr) {
        V bv;
        __builtin_memcpy(&bv, b + j, sizeof bv);
        v = v + bv;
        j = j + w == cols ? 0 : j + w;
      }
      if (dy != nullptr) __builtin_memcpy(&d, dy + i, sizeof d);
    } else {  // staged through arrays: the bias wraps, or the last, partial vector (zeros)
      float z[w] = {}, g[w] = {};
      for (std::size_t k = 0; k < m; ++k) {
        z[k] = b != nullptr ? x[i + k] + b[j] : x[i + k];
        if (b != nullptr && ++j == cols) j = 0;
        if (dy != nullptr) g[k] = dy[i + k];
      }
      __builtin_memcpy(&v, z, sizeof v);
      __builtin_memcpy(&d, g, sizeof d);
    }
    V r;
    if (dy == nullptr) {
      r = 0.5f * v * erfc<Isa>(-v * inv_sqrt2);
    } else {
      const V cdf = 0.5f * erfc<Isa>(-v * inv_sqrt2);
      const V pdf = inv_sqrt_2pi * Isa::exp(-0.5f * v * v);
      r = d * (cdf + v * pdf);
    }
    if (m == w) {
      __builtin_memcpy(out + i, &r, sizeof r);
    } else {
      float o[w];
      __builtin_memcpy(o, &r, sizeof r);
      for (std::size_t k = 0; k < m; ++k) out[i + k] = o[k];
    }
  }
}

// y[i] = exp(x[i] - shift), a vector at a time (the last one staged through an array).
template <class Isa>
[[gnu::always_inline]] inline void run_exp(const float* x, float shift, float* y, std::size_t n) {
  using V = typename Isa::V;
  constexpr std::size_t w = sizeof(V) / sizeof(float);
  for (std::size_t i = 0; i < n; i += w) {
    const std::size_t m = n - i < w ? n - i : w;
    float z[w] = {};
    V v;
    if (m == w) {
      __builtin_memcpy(&v, x + i, sizeof v);
    } else {
      for (std::size_t k = 0; k < m; ++k) z[k] = x[i + k];
      __builtin_memcpy(&v, z, sizeof v);
    }
    const V r = Isa::exp(v - shift);
    if (m == w) {
      __builtin_memcpy(y + i, &r, sizeof r);
    } else {
      __builtin_memcpy(z, &r, sizeof r);
      for (std::size_t k = 0; k < m; ++k) y[i + k] = z[k];
    }
  }
}


}  // namespace baton::vmath::detail
