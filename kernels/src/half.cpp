// Bulk conversions between float32 and the 16-bit float types, for the kernels that move
// gradients on the wire in 16 bits (--grad-compression, graph/src/collectives.cpp). Element by
// element, to_f16's branches (subnormals, overflow, ties) cost more than the add they follow:
// measured, dp 2 of the MLP with fp16 on the wire ran at 0.85x one device where bf16 ran at
// 1.03x. x86's F16C instructions convert 8 floats at once with the same rounding (to nearest,
// ties to even), so they are used where the CPU has them (chosen once, at run time: Debian
// builds for baseline x86-64); elsewhere, and for the tail, the scalar functions of dtype.h.
#include <cstddef>
#include <span>
#include <stdexcept>

#include <fmt/format.h>

#include "baton/kernels/dtype.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define BATON_HAVE_F16C_PATH 1
#endif

namespace baton {

namespace {

void check_sizes(std::size_t in, std::size_t out, const char* what) {
  if (in != out) throw std::invalid_argument(fmt::format("{}: {} elements into {}", what, in, out));
}

#ifdef BATON_HAVE_F16C_PATH
/// CPUID leaf 1 (AVX, F16C, and OSXSAVE so that XGETBV may be asked whether the OS saves the
/// ymm registers). Not __builtin_cpu_supports: clang 14 (the fuzz stage's) knows no "f16c".
bool cpu_has_f16c() {
  static const bool yes = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
    const bool osxsave = ((ecx >> 27) & 1u) != 0, avx = ((ecx >> 28) & 1u) != 0, f16c = ((ecx >> 29) & 1u) != 0;
    if (!osxsave || !avx || !f16c) return false;
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0u));
    return (lo & 6u) == 6u;  // xmm and ymm state enabled
  }();
  return yes;
}

__attribute__((target("avx,f16c"))) std::size_t narrow_f16c(const float* in, float16* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  return i;
}

__attribute__((target("avx,f16c"))) std::size_t widen_f16c(const float16* in, float* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  return i;
}
#endif

}  // namespace

void to_f16(std::span<const float> in, std::span<float16> out) {
  check_sizes(in.size(), out.size(), "to_f16");
  std::size_t i = 0;
#ifdef BATON_HAVE_F16C_PATH
  if (cpu_has_f16c()) i = narrow_f16c(in.data(), out.data(), in.size());
#endif
  for (; i < in.size(); ++i) out[i] = to_f16(in[i]);
}

void to_float(std::span<const float16> in, std::span<float> out) {
  check_sizes(in.size(), out.size(), "to_float (f16)");
  std::size_t i = 0;
#ifdef BATON_HAVE_F16C_PATH
  if (cpu_has_f16c()) i = widen_f16c(in.data(), out.data(), in.size());
#endif
  for (; i < in.size(); ++i) out[i] = to_float(in[i]);
}

void to_bf16(std::span<const float> in, std::span<bfloat16> out) {
  check_sizes(in.size(), out.size(), "to_bf16");
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = to_bf16(in[i]);
}

void to_float(std::span<const bfloat16> in, std::span<float> out) {
  check_sizes(in.size(), out.size(), "to_float (bf16)");
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = to_float(in[i]);
}

}  // namespace baton
