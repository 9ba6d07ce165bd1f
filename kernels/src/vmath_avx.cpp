// The AVX instantiation of vmath_impl.h's loops (8 lanes). CMake compiles this file alone with
// -mavx; vmath.cpp calls it only where the CPU has AVX. Built only on x86-64 with SLEEF.
#include <immintrin.h>
#include <sleef.h>

#include "vmath_impl.h"

#ifndef __AVX__
#error "vmath_avx.cpp is compiled with -mavx (kernels/CMakeLists.txt)"
#endif

namespace baton::vmath::detail {

namespace {

struct Avx {
  using V = __m256;
  static V exp(V a) { return Sleef_cinz_expf8_u10avx(a); }
};

}  // namespace

void gelu_avx(const float* x, const float* b, std::size_t cols, const float* dy, float* out, std::size_t n) {
  run<Avx>(x, b, cols, dy, out, n);
}

void exp_avx(const float* x, float shift, float* y, std::size_t n) { run_exp<Avx>(x, shift, y, n); }

}  // namespace baton::vmath::detail
