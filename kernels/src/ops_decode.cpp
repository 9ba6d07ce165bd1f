// Decoding ops on the CPU, f32 and f64: what a serving step needs beyond the training ops.
//  - rope_at: RoPE at explicit positions (a decode step's rows are tokens of many requests,
//    each at its own position), the same angles as rope (ops_llm.cpp) computes for its index.
//  - paged_attention: causal attention of a step's rows over a KV cache in blocks (vLLM's
//    PagedAttention, Kwon et al. 2023), the caches written in place.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels/ops.h"
#include "kernel_args.h"

namespace baton {

namespace {

using detail::check_dtype;
using detail::in_data;
using detail::need_input;
using detail::need_output;
using detail::out_data;

std::size_t to_size(std::int64_t n) { return static_cast<std::size_t>(n); }

// x [R, H, D] rotated row r by positions[r] (rotate_half layout, as rope).
template <class T>
class RopeAtKernel final : public Kernel {
 public:
  explicit RopeAtKernel(double base) : base_(static_cast<T>(base)) {}

  void compute(KernelContext& ctx) override {
    const char* op = "rope_at";
    const Tensor& x = need_input(ctx, 0, op, "x");
    const Tensor& pos = need_input(ctx, 1, op, "positions");
    Tensor& y = need_output(ctx, 0, op, "y");
    check_dtype(pos, DType::i32, op, "positions");
    const Shape& s = x.shape();
    if (s.size() != 3 || s[2] % 2 != 0 || pos.shape() != Shape{s[0]} || y.shape() != s) {
      throw std::invalid_argument(fmt::format("{}: x {} must be [R, H, D] with D even, positions [R] ({})", op,
                                              x.describe(), pos.describe()));
    }
    const std::size_t rows = to_size(s[0]), heads = to_size(s[1]), d = to_size(s[2]), half = d / 2;
    const T* xp = in_data<T>(x, op, "x");
    const auto* pp = static_cast<const std::int32_t*>(pos.raw());
    T* yp = out_data<T>(y, op, "y");
    if (inv_freq_.size() != half) {
      inv_freq_.resize(half);
      const T dd = static_cast<T>(d);
      for (std::size_t i = 0; i < half; ++i) inv_freq_[i] = T(1) / std::pow(base_, static_cast<T>(2 * i) / dd);
    }
    std::vector<T> c(half), sn(half);
    for (std::size_t r = 0; r < rows; ++r) {
      // A padding row (negative position) is rotated by 0: its output is never read.
      const T t = static_cast<T>(std::max(pp[r], 0));
      for (std::size_t i = 0; i < half; ++i) {
        // As rope: the angle rounded to T, its cosine and sine in double.
        const auto angle = static_cast<double>(t * inv_freq_[i]);
        c[i] = static_cast<T>(std::cos(angle));
        sn[i] = static_cast<T>(std::sin(angle));
      }
      for (std::size_t h = 0; h < heads; ++h) {
        const T* xr = xp + (r * heads + h) * d;
        T* yr = yp + (r * heads + h) * d;
        for (std::size_t i = 0; i < half; ++i) {
          const T lo = xr[i], hi = xr[i + half];
          yr[i] = lo * c[i] - hi * sn[i];
          yr[i + half] = hi * c[i] + lo * sn[i];
        }
      }
    }
  }

 private:
  T base_;
  std::vector<T> inv_freq_;
};

// Inputs q [R, H, D], k and v [R, Hkv, D], slots i32 [R] (the row's request slot; < 0: a padding
// row), positions i32 [R] (the row's token position in its request), block_table i32 [S, M]
// (slot s's i-th block of block_size positions), k_cache and v_cache [blocks, block_size, Hkv,
// D]. Each live row first writes its k and v at its position in the caches (in place: the caches
// are the layer's state, as a variable's value is, written only by this op); then every live row
// attends to positions 0..its own of its slot, so rows of one request in one step (a prompt's
// chunk) see each other causally. Query head h reads kv head h / (H / Hkv) (grouped-query
// attention). Scores, softmax and the weighted sum in double.
template <class T>
void paged_attention(KernelContext& ctx, double scale_attr) {
  const char* op = "paged_attention";
  const Tensor& q = need_input(ctx, 0, op, "q");
  const Tensor& k = need_input(ctx, 1, op, "k");
  const Tensor& v = need_input(ctx, 2, op, "v");
  const Tensor& slots = need_input(ctx, 3, op, "slots");
  const Tensor& positions = need_input(ctx, 4, op, "positions");
  const Tensor& table = need_input(ctx, 5, op, "block_table");
  // The caches are written: the op's state, passed as inputs so that several programs (a step's
  // row counts) share one cache.
  auto& k_cache = const_cast<Tensor&>(need_input(ctx, 6, op, "k_cache"));
  auto& v_cache = const_cast<Tensor&>(need_input(ctx, 7, op, "v_cache"));
  Tensor& o = need_output(ctx, 0, op, "o");
  for (const auto* t : {&slots, &positions, &table}) check_dtype(*t, DType::i32, op, "an index input");
  const Shape& qs = q.shape();
  const Shape& cs = k_cache.shape();
  const std::int64_t rows = qs.size() == 3 ? qs[0] : -1;
  if (qs.size() != 3 || cs.size() != 4 || v_cache.shape() != cs || k.shape() != Shape{rows, cs[2], cs[3]} ||
      v.shape() != k.shape() || qs[2] != cs[3] || qs[1] % cs[2] != 0 || slots.shape() != Shape{rows} ||
      positions.shape() != Shape{rows} || table.shape().size() != 2 || o.shape() != qs) {
    throw std::invalid_argument(fmt::format(
        "{}: q {} must be [R, H, D], k {} and v {} [R, Hkv, D] with H a multiple of Hkv, slots {} and positions {} "
        "[R], block_table {} [S, M], k_cache {} and v_cache {} [blocks, block_size, Hkv, D]",
        op, q.describe(), k.describe(), v.describe(), slots.describe(), positions.describe(), table.describe(),
        k_cache.describe(), v_cache.describe()));
  }
  const std::int64_t blocks = cs[0], block_size = cs[1], kv_heads = cs[2], d = cs[3];
  const std::int64_t heads = qs[1], rep = heads / kv_heads;
  const std::int64_t n_slots = table.shape()[0], per_slot = table.shape()[1];
  const T* qp = in_data<T>(q, op, "q");
  const T* kp = in_data<T>(k, op, "k");
  const T* vp = in_data<T>(v, op, "v");
  T* kc = out_data<T>(k_cache, op, "k_cache");
  T* vc = out_data<T>(v_cache, op, "v_cache");
  const auto* sp = static_cast<const std::int32_t*>(slots.raw());
  const auto* pp = static_cast<const std::int32_t*>(positions.raw());
  const auto* tp = static_cast<const std::int32_t*>(table.raw());
  T* out = out_data<T>(o, op, "o");
  const std::size_t row_kv = to_size(kv_heads * d);
  // Where position `p` of slot `s` lies in the caches, checked.
  auto at = [&](std::int64_t r, std::int64_t s, std::int64_t p) -> std::size_t {
    if (s >= n_slots || p < 0 || p / block_size >= per_slot) {
      throw std::invalid_argument(fmt::format("{}: row {} asks for slot {} position {}, outside the block table {}", op,
                                              r, s, p, table.describe()));
    }
    const std::int32_t block = tp[s * per_slot + p / block_size];
    if (block < 0 || block >= blocks) {
      throw std::invalid_argument(fmt::format("{}: slot {} position {} is in block {}, outside the cache's {} blocks",
                                              op, s, p, block, blocks));
    }
    return (to_size(block) * to_size(block_size) + to_size(p % block_size)) * row_kv;
  };
  for (std::int64_t r = 0; r < rows; ++r) {
    if (sp[r] < 0) continue;
    const std::size_t dst = at(r, sp[r], pp[r]);
    std::copy_n(kp + to_size(r) * row_kv, row_kv, kc + dst);
    std::copy_n(vp + to_size(r) * row_kv, row_kv, vc + dst);
  }
  const double scale = scale_attr > 0 ? scale_attr : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> score, acc(to_size(d));
  std::vector<std::size_t> where;
  for (std::int64_t r = 0; r < rows; ++r) {
    T* out_row = out + to_size(r * heads * d);
    if (sp[r] < 0) {
      std::fill_n(out_row, to_size(heads * d), T(0));
      continue;
    }
    const std::int64_t len = pp[r] + 1;
    where.resize(to_size(len));
    for (std::int64_t j = 0; j < len; ++j) where[to_size(j)] = at(r, sp[r], j);
    score.resize(to_size(len));
    for (std::int64_t h = 0; h < heads; ++h) {
      const T* qr = qp + to_size((r * heads + h) * d);
      const std::size_t kvh = to_size((h / rep) * d);
      double best = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < len; ++j) {
        const T* kr = kc + where[to_size(j)] + kvh;
        double dot = 0;
        for (std::int64_t i = 0; i < d; ++i) dot += static_cast<double>(qr[i]) * static_cast<double>(kr[i]);
        score[to_size(j)] = dot * scale;
        best = std::max(best, score[to_size(j)]);
      }
      double total = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t j = 0; j < len; ++j) {
        const double w = std::exp(score[to_size(j)] - best);
        total += w;
        const T* vr = vc + where[to_size(j)] + kvh;
        for (std::int64_t i = 0; i < d; ++i) acc[to_size(i)] += w * static_cast<double>(vr[i]);
      }
      T* orow = out_row + to_size(h * d);
      for (std::int64_t i = 0; i < d; ++i) orow[i] = static_cast<T>(acc[to_size(i)] / total);
    }
  }
}

template <class T>
void add_for(KernelRegistry& reg) {
  constexpr DType dt = dtype_of<T>();
  reg.add("rope_at", DeviceType::cpu, dt, [](const KernelConfig& cfg) {
    const double base = cfg.attrs.get_double("base", 10000.0);
    if (!(base > 0.0 && std::isfinite(base))) {
      throw std::invalid_argument(fmt::format("rope_at (actor '{}'): base must be finite and > 0, got {}", cfg.actor, base));
    }
    return std::make_unique<RopeAtKernel<T>>(base);
  });
  reg.add("paged_attention", DeviceType::cpu, dt, [](const KernelConfig& cfg) {
    const double scale = cfg.attrs.get_double("scale", 0.0);
    return kernel_of([scale](KernelContext& c) { paged_attention<T>(c, scale); })(cfg);
  });
}

}  // namespace

void add_cpu_decode_ops(KernelRegistry& reg) {
  add_for<float>(reg);
  add_for<double>(reg);
}

}  // namespace baton
