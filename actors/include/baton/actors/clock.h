#pragma once
/// A cheap monotonic tick counter for per-actor time accounting on the hot path.
#include <chrono>
#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

namespace baton {

/// Ticks: the TSC on x86 (about 10 ns to read, against about 25 ns for steady_clock on these
/// machines), steady_clock nanoseconds elsewhere. Convert with ns_per_tick().
inline std::uint64_t ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

/// Nanoseconds per tick, measured once per process against steady_clock (about 2 ms, on the
/// first call).
double ns_per_tick();

}  // namespace baton
