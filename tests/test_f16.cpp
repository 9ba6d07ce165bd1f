// IEEE binary16 (DType::f16), the dtype gradients travel in under --grad-compression fp16: its
// rounding against two references that share no code with dtype.h's bit manipulation: the
// definition (the nearest of the ordered binary16 values, ties to the even one, computed in
// double), and, where the compiler has it, _Float16's own conversion (libgcc's, on x86-64).
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels.h"

using namespace baton;

namespace {

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// binary16's value by its definition (IEEE 754-2008, 3.4): (-1)^s 2^(e-15) (1 + m/1024), or
/// m 2^-24 where e is 0.
double half_value(std::uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const double magnitude = exponent == 0    ? std::ldexp(mantissa, -24)
                           : exponent == 31 ? (mantissa == 0 ? INFINITY : NAN)
                                            : std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  return (h >> 15) != 0 ? -magnitude : magnitude;
}

/// The positive finite binary16 values in order (their bits 0 .. 0x7bff are ordered as they
/// are), and 65536 after them: the value that rounding treats as the next step, which is
/// infinity (IEEE 754 4.3.1: rounding to nearest, a value at least halfway past 65504 overflows).
const std::vector<double>& ladder() {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (std::uint32_t h = 0; h <= 0x7bff; ++h) v.push_back(half_value(static_cast<std::uint16_t>(h)));
    v.push_back(65536.0);
    return v;
  }();
  return values;
}

/// The binary16 that round-to-nearest-even gives for x, by the definition: the two values of the
/// ladder around |x|, the nearer one, ties to the even bit pattern.
std::uint16_t reference_f16(float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0x7e00;  // any NaN: compared as "is a NaN" below
  const double a = std::abs(static_cast<double>(x));
  const auto& v = ladder();
  if (a >= v.back()) return sign | 0x7c00;
  const auto above = std::upper_bound(v.begin(), v.end(), a);  // first value > a
  auto k = static_cast<std::uint32_t>(above - v.begin() - 1);    // v[k] <= a < v[k + 1]
  const double down = a - v[k], up = v[k + 1] - a;
  if (up < down || (up == down && (k & 1u) != 0)) ++k;
  return static_cast<std::uint16_t>(sign | (k == 0x7c00 ? 0x7c00 : k));  // past 65504: infinity
}

/// Where to_f16 and the reference part, the first few, for the message.
struct Mismatches {
  std::size_t count = 0;
  std::string first;
  void check(float x, std::uint16_t got, std::uint16_t want) {
    const bool both_nan = std::isnan(x) && (got & 0x7c00) == 0x7c00 && (got & 0x3ff) != 0;
    if (got == want || both_nan) return;
    if (++count <= 5) first += fmt::format(" {} ({:#010x}): {:#06x} not {:#06x};", x, std::bit_cast<std::uint32_t>(x), got, want);
  }
};

}  // namespace

TEST_CASE("F16.IsAStorageDtypeOfTwoBytes") {
  CHECK(size_of(DType::f16) == 2);
  CHECK(name(DType::f16) == "f16");
  CHECK(parse_dtype("f16") == DType::f16);
  CHECK(dtype_of<float16>() == DType::f16);
  CHECK_FALSE(is_floating(DType::f16));  // no op computes in it
  Tensor t = Tensor::empty({3}, DType::f16);
  CHECK(t.nbytes() == 6);
}

TEST_CASE("F16.EveryHalfWidensExactlyAndRoundsBackToItself") {
  std::size_t wrong = 0;
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = to_float(float16{bits});
    const double want = half_value(bits);
    if (std::isnan(want)) {
      wrong += !std::isnan(f);
      wrong += !std::isnan(to_float(to_f16(f)));
      continue;
    }
    wrong += static_cast<double>(f) != want || std::signbit(f) != ((bits >> 15) != 0);
    wrong += to_f16(f).bits != bits;  // -0 included: the sign survives
  }
  CHECK(wrong == 0);
  CHECK(to_float(float16{0x7bff}) == 65504.0f);
  CHECK(to_float(float16{0x0001}) == std::ldexp(1.0f, -24));
  CHECK(to_float(float16{0x0400}) == std::ldexp(1.0f, -14));
}

TEST_CASE("F16.RoundsToNearestEvenAsTheDefinitionSays") {
  Mismatches m;
  // Every boundary: for each pair of neighbouring halves (both signs, the overflow to infinity
  // and the underflow to zero included), their midpoint (a tie: exact in a float, which has 13
  // more bits) and the floats just above and below it.
  const auto& v = ladder();
  for (std::size_t k = 0; k + 1 < v.size(); ++k) {
    const auto mid = static_cast<float>((v[k] + v[k + 1]) / 2);
    REQUIRE(static_cast<double>(mid) == (v[k] + v[k + 1]) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      for (float s : {x, -x}) m.check(s, to_f16(s).bits, reference_f16(s));
    }
  }
  // A sweep over every 4099th float bit pattern (all exponents, signs, subnormals, infinities
  // and NaNs), about a million.
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
    const float x = from_bits(static_cast<std::uint32_t>(u));
    m.check(x, to_f16(x).bits, reference_f16(x));
  }
  CHECK_MESSAGE(m.count == 0, m.count << " floats round wrongly:" << m.first);
  // A few by name: ties to even at 1 (1 + 2^-11 is halfway to 1 + 2^-10), the overflow
  // threshold, the smallest subnormal's half (a tie to zero) and just above it.
  CHECK(to_f16(1.0f + std::ldexp(1.0f, -11)).bits == 0x3c00);
  CHECK(to_f16(1.0f + 3 * std::ldexp(1.0f, -11)).bits == 0x3c02);
  CHECK(to_f16(65519.996f).bits == 0x7bff);
  CHECK(to_f16(65520.0f).bits == 0x7c00);
  CHECK(to_f16(std::numeric_limits<float>::max()).bits == 0x7c00);
  CHECK(to_f16(-std::numeric_limits<float>::infinity()).bits == 0xfc00);
  CHECK(to_f16(std::ldexp(1.0f, -25)).bits == 0x0000);
  CHECK(to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)).bits == 0x0001);
  CHECK(std::isnan(to_float(to_f16(from_bits(0x7f800001u)))));  // a NaN whose payload is in the low bits
}

#if defined(__FLT16_MAX__)
// The compiler's own conversion (libgcc's __truncsfhf2 on x86-64 without F16C): a second,
// independent implementation, over the same sweep and every boundary.
TEST_CASE("F16.RoundsAsTheCompilersFloat16Does") {
  auto compiler = [](float x) {
    const auto h = static_cast<_Float16>(x);
    std::uint16_t bits;
    std::memcpy(&bits, &h, sizeof bits);
    return bits;
  };
  Mismatches m;
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
    const float x = from_bits(static_cast<std::uint32_t>(u));
    m.check(x, to_f16(x).bits, compiler(x));
  }
  const auto& v = ladder();
  for (std::size_t k = 0; k + 1 < v.size(); ++k) {
    const auto mid = static_cast<float>((v[k] + v[k + 1]) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      for (float s : {x, -x}) m.check(s, to_f16(s).bits, compiler(s));
    }
  }
  CHECK_MESSAGE(m.count == 0, m.count << " floats round unlike _Float16:" << m.first);
}
#endif

// The bulk conversions the wire kernels use (kernels/src/half.cpp: x86's F16C instructions 8 at a
// time where the CPU has them, the scalar functions for the tail and elsewhere) give the scalar
// functions' results element for element: over the sweep and every boundary, at lengths that
// leave tails of every size.
TEST_CASE("F16.BulkConversionsEqualTheScalarOnes") {
  std::vector<float> in;
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) in.push_back(from_bits(static_cast<std::uint32_t>(u)));
  const auto& v = ladder();
  for (std::size_t k = 0; k + 1 < v.size(); ++k) {
    const auto mid = static_cast<float>((v[k] + v[k + 1]) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) in.insert(in.end(), {x, -x});
  }
  for (std::size_t tail = 0; tail < 8; ++tail) {
    CAPTURE(tail);
    const std::size_t n = in.size() - tail;
    std::vector<float16> half(n);
    std::vector<bfloat16> brain(n);
    to_f16(std::span<const float>(in.data(), n), half);
    to_bf16(std::span<const float>(in.data(), n), brain);
    std::vector<float> back(n), back_bf(n);
    to_float(half, back);
    to_float(brain, back_bf);
    Mismatches m;
    std::size_t wrong_widen = 0, wrong_bf16 = 0;
    for (std::size_t i = 0; i < n; ++i) {
      m.check(in[i], half[i].bits, to_f16(in[i]).bits);
      const float want = to_float(half[i]);
      wrong_widen += !(std::bit_cast<std::uint32_t>(back[i]) == std::bit_cast<std::uint32_t>(want) ||
                       (std::isnan(back[i]) && std::isnan(want)));
      wrong_bf16 += brain[i].bits != to_bf16(in[i]).bits ||
                    std::bit_cast<std::uint32_t>(back_bf[i]) != std::bit_cast<std::uint32_t>(to_float(brain[i]));
    }
    CHECK_MESSAGE(m.count == 0, m.count << " floats round unlike to_f16:" << m.first);
    CHECK(wrong_widen == 0);
    CHECK(wrong_bf16 == 0);
  }
  std::vector<float16> two(2);
  CHECK_THROWS_AS(to_f16(std::span<const float>(in.data(), 3), two), std::invalid_argument);
}
