#include <charconv>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "baton/kernels/device.h"
#include "baton/kernels/dtype.h"
#include "baton/kernels/stream.h"

namespace baton {

std::string_view name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view s) {
  for (DType t : {DType::f32, DType::f64, DType::i32, DType::i64, DType::u8, DType::bf16, DType::f16}) {
    if (name(t) == s) return t;
  }
  return std::nullopt;
}

std::string_view name(DeviceType t) {
  switch (t) {
    case DeviceType::cpu: return "cpu";
    case DeviceType::cuda: return "cuda";
    case DeviceType::sim: return "sim";
  }
  return "?";
}

Device Device::parse(std::string_view text) {
  auto colon = text.find(':');
  std::string_view kind = text.substr(0, colon);
  Device d;
  if (kind == "cpu") {
    d.type = DeviceType::cpu;
  } else if (kind == "cuda") {
    d.type = DeviceType::cuda;
  } else if (kind == "sim") {
    d.type = DeviceType::sim;
  } else {
    throw std::invalid_argument(
        fmt::format("unknown device '{}': expected cpu[:N], cuda[:N] or sim[:N]", text));
  }
  if (colon == std::string_view::npos) return d;
  std::string_view idx = text.substr(colon + 1);
  int value = -1;
  auto [end, ec] = std::from_chars(idx.data(), idx.data() + idx.size(), value);
  if (ec != std::errc{} || end != idx.data() + idx.size() || value < 0 || value > max_index) {
    throw std::invalid_argument(fmt::format(
        "bad device index in '{}': expected an integer in 0..{}", text, max_index));
  }
  d.index = static_cast<std::uint8_t>(value);
  return d;
}

std::string Device::str() const { return fmt::format("{}:{}", name(type), index); }

void AsyncStream::begin_capture() {
  throw std::runtime_error(fmt::format("{}: this stream cannot capture its work into a graph", owner()));
}
std::unique_ptr<StreamGraph> AsyncStream::end_capture() {
  throw std::runtime_error(fmt::format("{}: this stream cannot capture its work into a graph", owner()));
}
void AsyncStream::launch(StreamGraph&) {
  throw std::runtime_error(fmt::format("{}: this stream cannot launch a graph", owner()));
}

}  // namespace baton
