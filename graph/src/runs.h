#pragma once
// Private to graph/src: a window of a concatenation of tensors that are not concatenated in
// memory (a gradient bucket's weights' gradients, a reduce-scatter's chunk sums), walked as the
// runs of each part that hold it. The collectives' kernels (collectives.cpp) and the optimizer
// kernels (passes/variable_kernel.h) read windows so.
#include <algorithm>
#include <cstdint>
#include <span>

namespace baton::detail {

/// The identity projection: `parts` already holds spans.
struct AsSpan {
  template <class S>
  const S& operator()(const S& s) const {
    return s;
  }
};

/// Calls f(run, at) for each run of elements [offset, offset + count) of the concatenation of
/// `parts` (each seen as a span through `span_of`), in order, `at` being where the run starts in
/// the window; returns how many of the window's elements the parts hold. A projection rather
/// than a std::views::transform over the parts: clang 14 (CI's fuzz stage) cannot instantiate
/// libstdc++ 12's transform_view.
template <class T, class Parts, class F, class SpanOf = AsSpan>
std::size_t for_each_run(const Parts& parts, std::int64_t offset, std::size_t count, F&& f, SpanOf span_of = {}) {
  const std::int64_t end = offset + static_cast<std::int64_t>(count);
  std::int64_t at = 0;  // where the current part starts in the concatenation
  std::size_t held = 0;
  for (const auto& element : parts) {
    const std::span<const T> part = span_of(element);
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
