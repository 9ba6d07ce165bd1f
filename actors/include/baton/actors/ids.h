#pragma once
/// Actor ids: rank, device, stream and index packed into 64 bits, so routing a message is a
/// decode, not a lookup.
#include <compare>
#include <cstdint>
#include <string>

#include "baton/kernels/device.h"

namespace baton {

/// Bits 48..63 rank, 40..47 device code (Device::code()), 32..39 stream, 0..31 the actor's
/// index in its rank's plan.
struct ActorId {
  std::uint64_t bits = ~std::uint64_t{0};

  static constexpr ActorId make(std::uint16_t rank, Device device, std::uint8_t stream,
                                std::uint32_t index) {
    return ActorId{(std::uint64_t{rank} << 48) | (std::uint64_t{device.code()} << 40) |
                   (std::uint64_t{stream} << 32) | index};
  }
  constexpr std::uint16_t rank() const { return static_cast<std::uint16_t>(bits >> 48); }
  constexpr Device device() const { return Device::from_code(static_cast<std::uint8_t>(bits >> 40)); }
  constexpr std::uint8_t stream() const { return static_cast<std::uint8_t>(bits >> 32); }
  constexpr std::uint32_t index() const { return static_cast<std::uint32_t>(bits); }
  constexpr bool valid() const { return bits != ~std::uint64_t{0}; }

  /// "r0/cpu:0/s1/#7"
  std::string str() const;
  friend constexpr auto operator<=>(const ActorId&, const ActorId&) = default;
};

}  // namespace baton
