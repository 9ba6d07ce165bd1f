#pragma once
/// The safetensors file format (github.com/huggingface/safetensors), which PyTorch, JAX, NumPy
/// and Rust tools read: an 8-byte little-endian header length N, N bytes of JSON
///
///   {"w1": {"dtype": "F32", "shape": [64, 256], "data_offsets": [0, 65536]}, ...,
///    "__metadata__": {"step": "10", ...}}
///
/// then the tensors' bytes, back to back, little-endian, row-major (offsets count from the end
/// of the header). baton writes and reads F32, F64, BF16, I32, I64 and U8, and reads F16 too
/// (published half-precision checkpoints), as f32: every half is a float exactly, and baton has
/// no half tensors. Other dtypes (F8_*, I8, I16, U16, BOOL, ...) are refused, naming the tensor.
///
///   baton::safetensors::write("w.safetensors.tmp", {{"w1", w1}}, {{"step", "10"}});
///   auto file = baton::safetensors::read("w.safetensors");   // file.tensors[0].second ...
///
/// Reading checks everything before it allocates for a tensor: the header length against the
/// file's size and a cap, the JSON, every dtype, shape and offset pair (in range, matching the
/// shape, the tensors back to back without gaps or overlaps, to the end of the file). Each
/// error is one line naming the file and, where there is one, the tensor.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "baton/kernels/tensor.h"

namespace baton::safetensors {

/// Headers longer than this are refused (the reference implementation's cap is 100 MB too).
inline constexpr std::uint64_t max_header_bytes = 100u << 20;

struct Contents {
  /// In the order of their bytes in the file.
  std::vector<std::pair<std::string, Tensor>> tensors;
  /// The header's "__metadata__" (string values only, as the format says).
  std::map<std::string, std::string> metadata;

  /// The tensor called `name`, or null.
  const Tensor* find(const std::string& name) const;
};

/// Writes `tensors`, in this order, and `metadata` to `path` (created or truncated) and fsyncs
/// it, so that a rename afterwards publishes a complete file. Throws std::runtime_error naming
/// the file for a dtype the format has no name for, a duplicate or reserved name, or an I/O error.
void write(const std::filesystem::path& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata = {});

/// Reads and checks a whole file. Throws std::runtime_error "<path>: <what is wrong>".
/// F16 tensors come back as f32 (half_to_float); every other dtype as stored.
Contents read(const std::filesystem::path& path);

/// IEEE 754 binary16 bits -> the float of the same value (exact: subnormals, signed zeros,
/// infinities; a NaN stays a NaN).
float half_to_float(std::uint16_t bits);

}  // namespace baton::safetensors
