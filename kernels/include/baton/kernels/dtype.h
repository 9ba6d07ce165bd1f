#pragma once
/// Element types of tensors and registers.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>

namespace baton {

/// The element type of a tensor. Kernels are registered per dtype.
/// f16 (IEEE binary16) is a storage dtype only, as gradients travel on the wire
/// (`--grad-compression fp16`): no op computes in it, and is_floating() leaves it out.
enum class DType : std::uint8_t { f32, f64, i32, i64, u8, bf16, f16 };

inline constexpr DType f32 = DType::f32;
inline constexpr DType f64 = DType::f64;
inline constexpr DType i32 = DType::i32;
inline constexpr DType i64 = DType::i64;
inline constexpr DType u8 = DType::u8;
inline constexpr DType bf16 = DType::bf16;
inline constexpr DType f16 = DType::f16;

/// Bytes per element.
constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::bf16: return 2;
    case DType::f16: return 2;
  }
  return 0;
}

/// f32, f64 and bf16: the dtypes of values that have gradients (not f16: storage only).
constexpr bool is_floating(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16; }

/// bfloat16: the upper half of a float32 (8 exponent bits, 7 mantissa bits). Storage only:
/// kernels compute in float32 and round once when they store (to_bf16).
struct bfloat16 {
  std::uint16_t bits = 0;
};

/// Exact: every bfloat16 is a float32.
inline float to_float(bfloat16 x) {
  const std::uint32_t u = static_cast<std::uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// Rounds to the nearest bfloat16, ties to even (as torch and CUDA's __float2bfloat16 do); a
/// NaN stays a (quiet) NaN, infinities stay infinite.
inline bfloat16 to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bfloat16{static_cast<std::uint16_t>(u >> 16)};
}

/// float16, IEEE 754 binary16 (5 exponent bits, 10 mantissa bits: 2^-24 to 65504). Storage
/// only, like bfloat16: what crosses the wire under `--grad-compression fp16` and what
/// safetensors' F16 holds; kernels widen it to float32 (exact) and round once when they store.
struct float16 {
  std::uint16_t bits = 0;
};

/// Exact: every binary16 is a float32 (subnormals included; a NaN keeps its payload's top bits).
inline float to_float(float16 x) {
  const std::uint32_t sign = static_cast<std::uint32_t>(x.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (x.bits >> 10) & 0x1fu, mantissa = x.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in a float
    const float f = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -f : f;
  }
  // Normal: the exponent rebiased from 15 to 127; infinity and NaN keep all ones.
  const std::uint32_t e = exponent == 0x1f ? 0xffu : exponent + (127 - 15);
  const std::uint32_t u = sign | (e << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// Rounds to the nearest binary16, ties to even (as IEEE 754, torch's .half() and CUDA's
/// __float2half_rn): from 65520 up (halfway past 65504, the largest half) to infinity, below
/// 2^-14 to a subnormal, at or below 2^-25 to zero; a NaN stays a (quiet) NaN.
inline float16 to_f16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return float16{static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};
  if (a >= 0x477ff000u) return float16{static_cast<std::uint16_t>(sign | 0x7c00u)};  // 65520 and up, infinity
  std::uint32_t h, rest, half;
  if (a >= 0x38800000u) {  // normal: rebias the exponent (127 -> 15), drop 13 mantissa bits
    h = (a - 0x38000000u) >> 13;
    rest = a & 0x1fffu;
    half = 0x1000u;
  } else if (a > 0x33000000u) {  // subnormal: the 24-bit significand shifted down to units of 2^-24
    const std::uint32_t significand = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - (a >> 23);  // 14 .. 24
    h = significand >> shift;
    rest = significand & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
  } else {
    return float16{sign};  // 2^-25 or less: ties to even, zero
  }
  if (rest > half || (rest == half && (h & 1u) != 0)) ++h;  // a carry moves into the exponent, rightly
  return float16{static_cast<std::uint16_t>(sign | h)};
}

/// Bulk forms of to_f16, to_bf16 and the widenings (kernels/src/half.cpp): the same results
/// element for element, several at a time (x86's F16C instructions for f16 where the CPU has
/// them). `in` and `out` have the same size (std::invalid_argument otherwise).
void to_f16(std::span<const float> in, std::span<float16> out);
void to_float(std::span<const float16> in, std::span<float> out);
void to_bf16(std::span<const float> in, std::span<bfloat16> out);
void to_float(std::span<const bfloat16> in, std::span<float> out);

/// "f32", "i64", ...
std::string_view name(DType t);
/// Inverse of name(); nullopt for an unknown name.
std::optional<DType> parse_dtype(std::string_view s);

/// The DType of a C++ element type: dtype_of<float>() == DType::f32.
template <class T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<std::int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<std::uint8_t>() { return DType::u8; }
template <> constexpr DType dtype_of<bfloat16>() { return DType::bf16; }
template <> constexpr DType dtype_of<float16>() { return DType::f16; }

}  // namespace baton
