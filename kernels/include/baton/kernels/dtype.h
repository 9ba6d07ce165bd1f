#pragma once
/// Element types of tensors and registers.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace baton {

/// The element type of a tensor. Kernels are registered per dtype.
enum class DType : std::uint8_t { f32, f64, i32, i64, u8 };

inline constexpr DType f32 = DType::f32;
inline constexpr DType f64 = DType::f64;
inline constexpr DType i32 = DType::i32;
inline constexpr DType i64 = DType::i64;
inline constexpr DType u8 = DType::u8;

/// Bytes per element.
constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
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

}  // namespace baton
