#pragma once
// Knobs the benchmarks take from the environment, for experiments: the driver and the ranks it
// spawns (which inherit the environment) read them alike, so the JSON lines say what ran.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "baton/actors/settings.h"

namespace baton::bench {

/// RuntimeSettings::inline_payload_bytes: BATON_BENCH_INLINE=B (pieces up to B bytes go with
/// their requests; 0: every piece is offered and pulled), or the default.
inline std::size_t inline_payload_bytes() {
  const char* s = std::getenv("BATON_BENCH_INLINE");
  return s != nullptr ? static_cast<std::size_t>(std::atoll(s)) : RuntimeSettings{}.inline_payload_bytes;
}

/// RuntimeSettings::shared_registers: BATON_BENCH_SHARED=0 (every piece through the data plane,
/// none read in place), or the default.
inline bool shared_registers() {
  const char* s = std::getenv("BATON_BENCH_SHARED");
  return s != nullptr ? std::atoi(s) != 0 : RuntimeSettings{}.shared_registers;
}

/// RuntimeSettings::idle_polling: BATON_BENCH_IDLE=park|busy_poll|automatic, or the default.
inline IdlePolling idle_polling() {
  const char* s = std::getenv("BATON_BENCH_IDLE");
  if (s == nullptr) return RuntimeSettings{}.idle_polling;
  const std::string_view idle = s;
  return idle == "park" ? IdlePolling::park : idle == "busy_poll" ? IdlePolling::busy_poll : IdlePolling::automatic;
}

/// RuntimeSettings::hold_messages_ns: BATON_BENCH_HOLD=NS (0: every message to another rank
/// goes at once, alone), or the default.
inline std::uint32_t hold_messages_ns() {
  const char* s = std::getenv("BATON_BENCH_HOLD");
  return s != nullptr ? static_cast<std::uint32_t>(std::atoll(s)) : RuntimeSettings{}.hold_messages_ns;
}

/// All four, for a benchmark's settings.
inline void apply_knobs(RuntimeSettings& s) {
  s.inline_payload_bytes = inline_payload_bytes();
  s.shared_registers = shared_registers();
  s.idle_polling = idle_polling();
  s.hold_messages_ns = hold_messages_ns();
}

}  // namespace baton::bench
