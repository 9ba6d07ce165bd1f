#pragma once
// Strided loops over a contiguous tensor, shared by the elementwise, broadcast, reduction and
// transpose kernels. The caller describes each operand by its strides along the walked shape
// (0 along a broadcast axis); make_loop drops axes of extent 1 and merges neighbouring axes
// that every operand walks contiguously, so a same-shape add is one flat run, a bias add is
// rows of contiguous runs, and only the innermost run is a plain indexed loop, which the
// compiler vectorises.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "baton/kernels/tensor.h"

namespace baton::detail {

using Strides = std::vector<std::int64_t>;

/// Row-major strides of a contiguous tensor of `shape`.
inline Strides contiguous_strides(const Shape& shape) {
  Strides s(shape.size());
  std::int64_t step = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    s[i] = step;
    step *= shape[i];
  }
  return s;
}

/// True if `from` repeats to `to` by numpy's rules: aligned at the last axis, each extent of
/// `from` equal to that of `to` or 1, missing leading axes repeated.
inline bool broadcasts_to(const Shape& from, const Shape& to) {
  if (from.size() > to.size()) return false;
  const std::size_t lead = to.size() - from.size();
  for (std::size_t i = 0; i < from.size(); ++i) {
    if (from[i] != to[lead + i] && from[i] != 1) return false;
  }
  return true;
}

/// numpy's broadcast of two shapes; nullopt when they are incompatible.
inline std::optional<Shape> broadcast_shapes(const Shape& a, const Shape& b) {
  const std::size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (std::size_t i = 0; i < rank; ++i) {
    const std::int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    const std::int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    if (da != db && da != 1 && db != 1) return std::nullopt;
    out[i] = da == 1 ? db : da;
  }
  return out;
}

/// Strides that read `from` while walking `to` (precondition: broadcasts_to(from, to)).
inline Strides broadcast_strides(const Shape& from, const Shape& to) {
  const Strides own = contiguous_strides(from);
  const std::size_t lead = to.size() - from.size();
  Strides s(to.size(), 0);
  for (std::size_t i = 0; i < from.size(); ++i) {
    if (from[i] == to[lead + i]) s[lead + i] = own[i];
  }
  return s;
}

/// A loop nest over a contiguous shape with two strided operands. `shape` has at least one
/// axis; its last axis is the inner run.
struct StridedLoop {
  Shape shape;
  Strides a;
  Strides b;

  std::int64_t inner() const { return shape.back(); }
  std::int64_t inner_a() const { return a.back(); }
  std::int64_t inner_b() const { return b.back(); }
};

/// Simplifies the walk of `shape` (every extent > 0) with operand strides `a` and `b`.
inline StridedLoop make_loop(const Shape& shape, const Strides& a, const Strides& b) {
  StridedLoop loop;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 1) continue;
    if (!loop.shape.empty() && loop.a.back() == a[i] * shape[i] &&
        loop.b.back() == b[i] * shape[i]) {
      loop.shape.back() *= shape[i];
      loop.a.back() = a[i];
      loop.b.back() = b[i];
    } else {
      loop.shape.push_back(shape[i]);
      loop.a.push_back(a[i]);
      loop.b.push_back(b[i]);
    }
  }
  if (loop.shape.empty()) loop = {{1}, {0}, {0}};
  return loop;
}

/// Calls fn(offset, a_offset, b_offset) at the start of every inner run, in order; `offset` is
/// the run's position in the contiguous walked tensor (a multiple of loop.inner()).
template <class Fn>
void for_each_run(const StridedLoop& loop, Fn&& fn) {
  const std::size_t outer_rank = loop.shape.size() - 1;
  std::int64_t outer = 1;
  for (std::size_t d = 0; d < outer_rank; ++d) outer *= loop.shape[d];
  std::vector<std::int64_t> index(outer_rank, 0);
  std::int64_t off_a = 0;
  std::int64_t off_b = 0;
  for (std::int64_t run = 0; run < outer; ++run) {
    fn(run * loop.inner(), off_a, off_b);
    for (std::size_t d = outer_rank; d-- > 0;) {
      off_a += loop.a[d];
      off_b += loop.b[d];
      if (++index[d] < loop.shape[d]) break;
      off_a -= loop.a[d] * loop.shape[d];
      off_b -= loop.b[d] * loop.shape[d];
      index[d] = 0;
    }
  }
}

/// Square tiles of the cache-friendly transpose. Small, because power-of-two extents (the
/// common case) put every strided line of a tile in one L1 set: 8 lines fit its 8 ways, where
/// 32 x 32 tiles ran 5x slower on [512, 1024] (and only 1.2x faster on [509, 1021]).
inline constexpr std::int64_t transpose_tile = 8;

/// Copies the walk of operand a (the source) into the contiguous dst. When the source's
/// contiguous axis is the walk's second-to-last (a transpose of the last two axes), copies in
/// square tiles, so the strided reads reuse their cache lines instead of missing on each.
template <class T>
void gather(const StridedLoop& loop, const T* src, T* dst) {
  const std::size_t rank = loop.shape.size();
  const std::int64_t sx = loop.inner_a();
  if (rank >= 2 && loop.a[rank - 2] == 1 && sx > 1) {
    const std::int64_t rows = loop.shape[rank - 2];
    const std::int64_t cols = loop.inner();
    StridedLoop blocks{Shape(loop.shape.begin(), loop.shape.end() - 2),
                       Strides(loop.a.begin(), loop.a.end() - 2), Strides(rank - 2, 0)};
    blocks.shape.push_back(1);
    blocks.a.push_back(0);
    blocks.b.push_back(0);
    for_each_run(blocks, [&](std::int64_t block, std::int64_t from, std::int64_t) {
      const T* s = src + from;
      T* d = dst + block * rows * cols;
      for (std::int64_t i0 = 0; i0 < rows; i0 += transpose_tile) {
        for (std::int64_t j0 = 0; j0 < cols; j0 += transpose_tile) {
          const std::int64_t i1 = std::min(i0 + transpose_tile, rows);
          const std::int64_t j1 = std::min(j0 + transpose_tile, cols);
          for (std::int64_t i = i0; i < i1; ++i) {
            for (std::int64_t j = j0; j < j1; ++j) d[i * cols + j] = s[i + j * sx];
          }
        }
      }
    });
    return;
  }
  for_each_run(loop, [&](std::int64_t o, std::int64_t from, std::int64_t) {
    const T* s = src + from;
    T* d = dst + o;
    if (sx == 0) {
      std::fill_n(d, loop.inner(), *s);
    } else {
      for (std::int64_t i = 0; i < loop.inner(); ++i) d[i] = s[i * sx];
    }
  });
}

/// out[i] = op(a[i * sa], b[i * sb]) for i < n, with the common stride patterns (0 = one
/// repeated value, 1 = contiguous) as separate loops so each vectorises.
template <class T, class Op>
inline void elementwise_run(const T* a, std::int64_t sa, const T* b, std::int64_t sb, T* out,
                            std::int64_t n, Op op) {
  if (sa == 1 && sb == 1) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = op(a[i], b[i]);
  } else if (sa == 1 && sb == 0) {
    const T y = *b;
    for (std::int64_t i = 0; i < n; ++i) out[i] = op(a[i], y);
  } else if (sa == 0 && sb == 1) {
    const T x = *a;
    for (std::int64_t i = 0; i < n; ++i) out[i] = op(x, b[i]);
  } else {
    for (std::int64_t i = 0; i < n; ++i) out[i] = op(a[i * sa], b[i * sb]);
  }
}

/// out = op(a, b) with numpy broadcasting; the caller has checked that out_shape is the
/// broadcast of a_shape and b_shape. `out` may be `a` or `b` when that operand has out's shape.
template <class T, class Op>
void broadcast_binary(const T* a, const Shape& a_shape, const T* b, const Shape& b_shape, T* out,
                      const Shape& out_shape, Op op) {
  const std::int64_t n = numel(out_shape);
  if (n == 0) return;
  const std::int64_t na = numel(a_shape);
  const std::int64_t nb = numel(b_shape);
  // Fast paths without building a loop: same sizes, a scalar operand, and b a suffix of a
  // (the bias add: b repeats along a's leading axes).
  if (na == n && nb == n) return elementwise_run(a, 1, b, 1, out, n, op);
  if (na == n && nb == 1) return elementwise_run(a, 1, b, 0, out, n, op);
  if (na == 1 && nb == n) return elementwise_run(a, 0, b, 1, out, n, op);
  if (na == n && nb > 0 && n % nb == 0 && b_shape.size() <= out_shape.size() &&
      std::equal(b_shape.begin(), b_shape.end(), out_shape.end() - std::ssize(b_shape))) {
    for (std::int64_t row = 0; row < n; row += nb) {
      elementwise_run(a + row, 1, b, 1, out + row, nb, op);
    }
    return;
  }
  const StridedLoop loop = make_loop(out_shape, broadcast_strides(a_shape, out_shape),
                                     broadcast_strides(b_shape, out_shape));
  for_each_run(loop, [&](std::int64_t o, std::int64_t oa, std::int64_t ob) {
    elementwise_run(a + oa, loop.inner_a(), b + ob, loop.inner_b(), out + o, loop.inner(), op);
  });
}

}  // namespace baton::detail
