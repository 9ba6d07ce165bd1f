#pragma once
// Private to graph/src: a window of a concatenation of tensors that are not concatenated in
// memory (a gradient bucket's weights' gradients, a reduce-scatter's chunk sums), walked as the
// runs of each part that hold it. The collectives' kernels (collectives.cpp) and the optimizer
// kernels (passes/variable_kernel.h) read windows so.
#include <algorithm>
#include <cstdint>
#include <span>

namespace baton::detail {

/// Calls f(run, at) for each run of elements [offset, offset + count) of the concatenation of
/// `parts`, in order, `at` being where the run starts in the window; returns how many of the
/// window's elements the parts hold.
template <class T, class Parts, class F>
std::size_t for_each_run(const Parts& parts, std::int64_t offset, std::size_t count, F&& f) {
  const std::int64_t end = offset + static_cast<std::int64_t>(count);
  std::int64_t at = 0;  // where the current part starts in the concatenation
  std::size_t held = 0;
  for (std::span<const T> part : parts) {
    if (at >= end) break;
    const std::int64_t lo = std::max(offset, at);
    const std::int64_t hi = std::min(end, at + static_cast<std::int64_t>(part.size()));
    if (lo < hi) {
      f(part.subspan(static_cast<std::size_t>(lo - at), static_cast<std::size_t>(hi - lo)),
        static_cast<std::size_t>(lo - offset));
      held += static_cast<std::size_t>(hi - lo);
    }
    at += static_cast<std::int64_t>(part.size());
  }
  return held;
}

}  // namespace baton::detail
