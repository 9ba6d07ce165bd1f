#pragma once
/// Element types of tensors and registers.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace baton {

/// The element type of a tensor. Kernels are registered per dtype.
enum class DType : std::uint8_t { f32, f64, i32, i64, u8, bf16 };

inline constexpr DType f32 = DType::f32;
inline constexpr DType f64 = DType::f64;
inline constexpr DType i32 = DType::i32;
inline constexpr DType i64 = DType::i64;
inline constexpr DType u8 = DType::u8;
inline constexpr DType bf16 = DType::bf16;

/// Bytes per element.
constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::bf16: return 2;
  }
  return 0;
}

/// f32, f64 and bf16: the dtypes of values that have gradients.
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

}  // namespace baton
