// Vectorised float32 GELU and exp (baton/kernels/vmath.h): the paths and the choice among them.
// The loops are vmath_impl.h's templates, one per instruction set: SSE2 here (every x86-64 has
// it), AVX in vmath_avx.cpp (compiled with -mavx, called only where the CPU has AVX). Each walks
// the elements a vector at a time, staging a vector through a small array where the bias's
// columns wrap or the last vector is partial (its missing lanes are zeros, computed and dropped),
// so every element goes through the same vector function whatever its position.
#include "baton/kernels/vmath.h"

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#if defined(__x86_64__) && defined(BATON_HAS_SLEEF)
#include <immintrin.h>
#include <sleef.h>

#include "vmath_impl.h"
#define BATON_VMATH_X86 1

namespace baton::vmath::detail {
void gelu_avx(const float* x, const float* b, std::size_t cols, const float* dy, float* out, std::size_t n);
void exp_avx(const float* x, float shift, float* y, std::size_t n);
}  // namespace baton::vmath::detail
#endif

namespace baton::vmath {

namespace {

#ifdef BATON_VMATH_X86
using detail::inv_sqrt2;
using detail::inv_sqrt_2pi;
#else
constexpr float inv_sqrt2 = static_cast<float>(0.70710678118654752440);
constexpr float inv_sqrt_2pi = static_cast<float>(0.39894228040143267794);
#endif

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

struct Sse2 {
  using V = __m128;
  static V exp(V a) { return Sleef_cinz_expf4_u10sse2(a); }
};

void sse2(const float* x, const float* b, std::size_t cols, const float* dy, float* out, std::size_t n) {
  detail::run<Sse2>(x, b, cols, dy, out, n);
}

void exp_sse2(const float* x, float shift, float* y, std::size_t n) { detail::run_exp<Sse2>(x, shift, y, n); }

using detail::exp_avx;
constexpr auto avx = detail::gelu_avx;

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

/// BATON_VMATH's choice (to compare paths in a benchmark), or null where it is unset.
const char* forced_path() {
  const char* forced = std::getenv("BATON_VMATH");
  return forced != nullptr && *forced != 0 ? forced : nullptr;
}

/// The machine's best path, or BATON_VMATH's; a path this machine or build lacks is an error
/// naming it.
Fn choose() {
  const char* forced = forced_path();
  if (forced == nullptr) return by_name(best_path());
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
  const char* forced = forced_path();
  return forced != nullptr && by_name(forced) != nullptr ? forced : best_path();
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
