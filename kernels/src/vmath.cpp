// Vectorised float32 GELU and exp (baton/kernels/vmath.h). One template walks the elements a vector
// at a time, staging each vector through a small array (the bias's columns wrap anywhere, and
// the last vector may be partial: its missing lanes are zeros, computed and dropped), so that
// every element goes through the same vector function whatever its position. The AVX
// instantiation is compiled for AVX alone (a target attribute, not a flag for the whole file,
// so nothing else here needs AVX) and chosen at run time.
#include "baton/kernels/vmath.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

#if defined(__x86_64__) && defined(BATON_HAS_SLEEF)
#include <immintrin.h>
#include <sleef.h>
// sleef.h declares its __m256 functions only where the whole file is compiled for AVX.
extern "C" __m256 Sleef_cinz_expf8_u10avx(__m256);
#define BATON_VMATH_X86 1
// GCC notes that an __m256 passed by value changes the ABI where AVX is not enabled: the
// functions that take one are only ever called from the AVX function (target "avx").
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace baton::vmath {

namespace {

constexpr float inv_sqrt2 = static_cast<float>(0.70710678118654752440);
constexpr float inv_sqrt_2pi = static_cast<float>(0.39894228040143267794);

/// The scalar formula (ops_nn.cpp's Gelu and GeluGrad for float), for builds without SLEEF.
void scalar(const float* x, const float* b, std::size_t cols, const float* dy, float* out, std::size_t n) {
  std::size_t j = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float z = b != nullptr ? x[i] + b[j] : x[i];
    if (b != nullptr && ++j == cols) j = 0;
    if (dy == nullptr) {
      out[i] = 0.5f * z * std::erfc(-z * inv_sqrt2);
    } else {
      const float cdf = 0.5f * std::erfc(-z * inv_sqrt2);
      const float pdf = inv_sqrt_2pi * std::exp(-0.5f * z * z);
      out[i] = dy[i] * (cdf + z * pdf);
    }
  }
}

void exp_scalar(const float* x, float shift, float* y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] = std::exp(x[i] - shift);
}

#ifdef BATON_VMATH_X86

// The vector functions by instruction set: V a GCC vector type (__m128, __m256), so the
// arithmetic in run() is the element type's, lane by lane, in the scalar formula's order (no
// contraction into FMAs under -std=c++20).
struct Avx {
  using V = __m256;
  [[gnu::target("avx")]] static V exp(V a) { return Sleef_cinz_expf8_u10avx(a); }
};
struct Sse2 {
  using V = __m128;
  [[gnu::always_inline]] static inline V exp(V a) { return Sleef_cinz_expf4_u10sse2(a); }
};

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
      std::memcpy(&v, x + i, sizeof v);
      if (b != nullptr) {
        V bv;
        std::memcpy(&bv, b + j, sizeof bv);
        v = v + bv;
        j = j + w == cols ? 0 : j + w;
      }
      if (dy != nullptr) std::memcpy(&d, dy + i, sizeof d);
    } else {  // staged through arrays: the bias wraps, or the last, partial vector (zeros)
      float z[w] = {}, g[w] = {};
      for (std::size_t k = 0; k < m; ++k) {
        z[k] = b != nullptr ? x[i + k] + b[j] : x[i + k];
        if (b != nullptr && ++j == cols) j = 0;
        if (dy != nullptr) g[k] = dy[i + k];
      }
      std::memcpy(&v, z, sizeof v);
      std::memcpy(&d, g, sizeof d);
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
      std::memcpy(out + i, &r, sizeof r);
    } else {
      float o[w];
      std::memcpy(o, &r, sizeof r);
      for (std::size_t k = 0; k < m; ++k) out[i + k] = o[k];
    }
  }
}

[[gnu::target("avx")]] void avx(const float* x, const float* b, std::size_t cols, const float* dy, float* out,
                                std::size_t n) {
  run<Avx>(x, b, cols, dy, out, n);
}

void sse2(const float* x, const float* b, std::size_t cols, const float* dy, float* out, std::size_t n) {
  run<Sse2>(x, b, cols, dy, out, n);
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
      std::memcpy(&v, x + i, sizeof v);
    } else {
      for (std::size_t k = 0; k < m; ++k) z[k] = x[i + k];
      std::memcpy(&v, z, sizeof v);
    }
    const V r = Isa::exp(v - shift);
    if (m == w) {
      std::memcpy(y + i, &r, sizeof r);
    } else {
      std::memcpy(z, &r, sizeof r);
      for (std::size_t k = 0; k < m; ++k) y[i + k] = z[k];
    }
  }
}

[[gnu::target("avx")]] void exp_avx(const float* x, float shift, float* y, std::size_t n) {
  run_exp<Avx>(x, shift, y, n);
}

void exp_sse2(const float* x, float shift, float* y, std::size_t n) { run_exp<Sse2>(x, shift, y, n); }

#endif

using Fn = void (*)(const float*, const float*, std::size_t, const float*, float*, std::size_t);
using ExpFn = void (*)(const float*, float, float*, std::size_t);

/// exp's function on the path that GELU's runs on (by_name's function).
ExpFn exp_of(Fn gelu) {
#ifdef BATON_VMATH_X86
  if (gelu == avx) return exp_avx;
  if (gelu == sse2) return exp_sse2;
#endif
  return gelu == scalar ? exp_scalar : nullptr;
}

/// The function for a path's name, or null where there is none here.
Fn by_name(std::string_view path) {
#ifdef BATON_VMATH_X86
  if (path == "avx") return __builtin_cpu_supports("avx") ? avx : nullptr;
  if (path == "sse2") return sse2;
#endif
  if (path == "scalar") return scalar;
  return nullptr;
}

const char* best_path() {
#ifdef BATON_VMATH_X86
  return __builtin_cpu_supports("avx") ? "avx" : "sse2";
#else
  return "scalar";
#endif
}

/// The machine's best path, or BATON_VMATH's choice (to compare paths in a benchmark); a path
/// this machine or build lacks is an error naming it.
Fn choose() {
  const char* forced = std::getenv("BATON_VMATH");
  if (forced == nullptr || *forced == 0) return by_name(best_path());
  if (Fn fn = by_name(forced); fn != nullptr) return fn;
  throw std::invalid_argument(std::string("BATON_VMATH=") + forced +
                              ": not a path of this machine and build (avx, sse2 or scalar; see vmath.h)");
}

Fn best() {
  static const Fn fn = choose();
  return fn;
}

}  // namespace

void exp_shifted(const float* x, float shift, float* y, std::size_t n) {
  static const ExpFn fn = exp_of(best());
  fn(x, shift, y, n);
}

bool exp_shifted_on(const char* path, const float* x, float shift, float* y, std::size_t n) {
  const ExpFn fn = exp_of(by_name(path));
  if (fn != nullptr) fn(x, shift, y, n);
  return fn != nullptr;
}

void gelu(const float* x, const float* b, std::size_t cols, float* y, std::size_t n) {
  best()(x, b, cols, nullptr, y, n);
}

void gelu_grad(const float* x, const float* b, std::size_t cols, const float* dy, float* dx, std::size_t n) {
  best()(x, b, cols, dy, dx, n);
}

const char* path() {
  const char* forced = std::getenv("BATON_VMATH");
  return forced != nullptr && *forced != 0 && by_name(forced) != nullptr ? forced : best_path();
}

bool gelu_on(const char* path, const float* x, const float* b, std::size_t cols, float* y, std::size_t n) {
  const Fn fn = by_name(path);
  if (fn != nullptr) fn(x, b, cols, nullptr, y, n);
  return fn != nullptr;
}

bool gelu_grad_on(const char* path, const float* x, const float* b, std::size_t cols, const float* dy, float* dx,
                  std::size_t n) {
  const Fn fn = by_name(path);
  if (fn != nullptr) fn(x, b, cols, dy, dx, n);
  return fn != nullptr;
}

}  // namespace baton::vmath
