#pragma once
/// Devices: where a tensor lives and where a kernel runs.
#include <compare>
#include <cstdint>
#include <string>
#include <string_view>

namespace baton {

/// cpu: the host. cuda: an NVIDIA GPU. sim: a simulated asynchronous device (baton/kernels/sim.h),
/// host memory with a CUDA-like stream, so that the runtime's stream logic runs without a GPU.
enum class DeviceType : std::uint8_t { cpu = 0, cuda = 1, sim = 2 };

/// Devices whose kernels only enqueue work on a stream (baton/kernels/stream.h).
constexpr bool is_async(DeviceType t) { return t == DeviceType::cuda || t == DeviceType::sim; }

/// A device on one rank: "cpu:0", "cuda:1", "sim:0". Several CPU devices in one process stand in
/// for several accelerators (each gets its own worker threads and memory accounting).
struct Device {
  DeviceType type = DeviceType::cpu;
  std::uint8_t index = 0;

  /// Devices per type that fit in an actor id's device bits (see actors/ids.h).
  static constexpr int max_index = 63;

  /// Parses "cpu", "cpu:3", "cuda:0", "sim:1". Throws std::invalid_argument naming the text.
  static Device parse(std::string_view text);
  std::string str() const;
  /// Packs type and index into 8 bits: 2 bits of type, 6 of index.
  constexpr std::uint8_t code() const {
    return static_cast<std::uint8_t>((static_cast<unsigned>(type) << 6) | (index & 0x3f));
  }
  static constexpr Device from_code(std::uint8_t c) {
    return Device{static_cast<DeviceType>(c >> 6), static_cast<std::uint8_t>(c & 0x3f)};
  }
  friend constexpr auto operator<=>(const Device&, const Device&) = default;
};

std::string_view name(DeviceType t);

}  // namespace baton
