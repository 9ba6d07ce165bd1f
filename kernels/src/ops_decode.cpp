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

#include <cblas.h>
#include <fmt/format.h>

#include "baton/kernels/ops.h"
#include "decode_args.h"
#include "kernel_args.h"

namespace baton {

namespace {

using detail::check_dtype;
using detail::in_data;
using detail::need_input;
using detail::need_output;
using detail::out_data;

std::size_t to_size(std::int64_t n) { return static_cast<std::size_t>(n); }

// y = alpha op(A) x + beta y, A [m, n] row-major with leading dimension lda; op(A) = A^T if
// `trans` (then x has m elements and y n).
void gemv(bool trans, int m, int n, float alpha, const float* a, int lda, const float* x, float beta, float* y) {
  cblas_sgemv(CblasRowMajor, trans ? CblasTrans : CblasNoTrans, m, n, alpha, a, lda, x, 1, beta, y, 1);
}
void gemv(bool trans, int m, int n, double alpha, const double* a, int lda, const double* x, double beta, double* y) {
  cblas_dgemv(CblasRowMajor, trans ? CblasTrans : CblasNoTrans, m, n, alpha, a, lda, x, 1, beta, y, 1);
}

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
    detail::check_rope_at(x, pos, y);
    const Shape& s = x.shape();
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
// attention). The products by BLAS in T, the softmax's exponentials and sum in double.
template <class T>
void paged_attention(KernelContext& ctx, double scale_attr) {
  const char* op = "paged_attention";
  const detail::PagedAttentionArgs a = detail::paged_attention_args(ctx, scale_attr);
  const Tensor &q = *a.q, &k = *a.k, &v = *a.v, &slots = *a.slots, &positions = *a.positions, &table = *a.table;
  Tensor &k_cache = *a.k_cache, &v_cache = *a.v_cache, &o = *a.o;
  const std::int64_t rows = a.rows, blocks = a.blocks, block_size = a.block_size, kv_heads = a.kv_heads, d = a.d;
  const std::int64_t heads = a.heads, rep = heads / kv_heads;
  const std::int64_t n_slots = a.n_slots, per_slot = a.per_slot;
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
  const double scale = a.scale;
  // Per row and head: the scores over its slot's positions block by block (a matrix-vector
  // product of the block's keys, strided by the kv heads, with the query), the softmax, then the
  // values weighted the same way: BLAS's gemv on each block's contiguous positions.
  std::vector<T> score, weight;
  std::vector<std::size_t> block_at;  // where each block of the slot begins in the caches
  const auto ld = static_cast<int>(kv_heads * d);
  for (std::int64_t r = 0; r < rows; ++r) {
    T* out_row = out + to_size(r * heads * d);
    if (sp[r] < 0) {
      std::fill_n(out_row, to_size(heads * d), T(0));
      continue;
    }
    const std::int64_t len = pp[r] + 1, n_blocks = (len + block_size - 1) / block_size;
    block_at.resize(to_size(n_blocks));
    for (std::int64_t b = 0; b < n_blocks; ++b) block_at[to_size(b)] = at(r, sp[r], b * block_size);
    at(r, sp[r], len - 1);  // the last position's block is checked too
    score.resize(to_size(len));
    weight.resize(to_size(len));
    for (std::int64_t h = 0; h < heads; ++h) {
      const T* qr = qp + to_size((r * heads + h) * d);
      const std::size_t kvh = to_size((h / rep) * d);
      for (std::int64_t b = 0; b < n_blocks; ++b) {
        const int n = static_cast<int>(std::min(block_size, len - b * block_size));
        gemv(false, n, static_cast<int>(d), static_cast<T>(scale), kc + block_at[to_size(b)] + kvh, ld, qr, T(0),
             score.data() + b * block_size);
      }
      const T best = *std::max_element(score.begin(), score.end());
      double total = 0;
      for (std::int64_t j = 0; j < len; ++j) {
        const double w = std::exp(static_cast<double>(score[to_size(j)]) - static_cast<double>(best));
        weight[to_size(j)] = static_cast<T>(w);
        total += w;
      }
      T* orow = out_row + to_size(h * d);
      std::fill_n(orow, to_size(d), T(0));
      for (std::int64_t b = 0; b < n_blocks; ++b) {
        const int n = static_cast<int>(std::min(block_size, len - b * block_size));
        gemv(true, n, static_cast<int>(d), static_cast<T>(1.0 / total), vc + block_at[to_size(b)] + kvh, ld,
             weight.data() + b * block_size, T(1), orow);
      }
    }
  }
}

template <class T>
void add_for(KernelRegistry& reg) {
  constexpr DType dt = dtype_of<T>();
  reg.add("rope_at", DeviceType::cpu, dt,
          [](const KernelConfig& cfg) { return std::make_unique<RopeAtKernel<T>>(detail::rope_at_base(cfg)); });
  reg.add("paged_attention", DeviceType::cpu, dt, [](const KernelConfig& cfg) {
    const double scale = cfg.attrs.get_double("scale", 0.0);
    return kernel_of([scale](KernelContext& c) { paged_attention<T>(c, scale); })(cfg);
  });
}

}  // namespace

namespace detail {

double rope_at_base(const KernelConfig& cfg) {
  const double base = cfg.attrs.get_double("base", 10000.0);
  if (!(base > 0.0 && std::isfinite(base))) {
    throw std::invalid_argument(fmt::format("rope_at (actor '{}'): base must be finite and > 0, got {}", cfg.actor, base));
  }
  return base;
}

void check_rope_at(const Tensor& x, const Tensor& positions, const Tensor& y) {
  const char* op = "rope_at";
  check_dtype(positions, DType::i32, op, "positions");
  const Shape& s = x.shape();
  if (s.size() != 3 || s[2] % 2 != 0 || positions.shape() != Shape{s[0]} || y.shape() != s) {
    throw std::invalid_argument(fmt::format("{}: x {} must be [R, H, D] with D even, positions [R] ({})", op,
                                            x.describe(), positions.describe()));
  }
}

PagedAttentionArgs paged_attention_args(KernelContext& ctx, double scale_attr) {
  const char* op = "paged_attention";
  PagedAttentionArgs a;
  a.q = &need_input(ctx, 0, op, "q");
  a.k = &need_input(ctx, 1, op, "k");
  a.v = &need_input(ctx, 2, op, "v");
  a.slots = &need_input(ctx, 3, op, "slots");
  a.positions = &need_input(ctx, 4, op, "positions");
  a.table = &need_input(ctx, 5, op, "block_table");
  // The caches are written: the op's state, passed as inputs so that several programs (a step's
  // row counts) share one cache.
  a.k_cache = const_cast<Tensor*>(&need_input(ctx, 6, op, "k_cache"));
  a.v_cache = const_cast<Tensor*>(&need_input(ctx, 7, op, "v_cache"));
  a.o = &need_output(ctx, 0, op, "o");
  for (const Tensor* t : {a.slots, a.positions, a.table}) check_dtype(*t, DType::i32, op, "an index input");
  const Shape& qs = a.q->shape();
  const Shape& cs = a.k_cache->shape();
  const std::int64_t rows = qs.size() == 3 ? qs[0] : -1;
  if (qs.size() != 3 || cs.size() != 4 || a.v_cache->shape() != cs || a.k->shape() != Shape{rows, cs[2], cs[3]} ||
      a.v->shape() != a.k->shape() || qs[2] != cs[3] || cs[2] == 0 || qs[1] % cs[2] != 0 ||
      a.slots->shape() != Shape{rows} || a.positions->shape() != Shape{rows} || a.table->shape().size() != 2 ||
      a.o->shape() != qs) {
    throw std::invalid_argument(fmt::format(
        "{}: q {} must be [R, H, D], k {} and v {} [R, Hkv, D] with H a multiple of Hkv, slots {} and positions {} "
        "[R], block_table {} [S, M], k_cache {} and v_cache {} [blocks, block_size, Hkv, D]",
        op, a.q->describe(), a.k->describe(), a.v->describe(), a.slots->describe(), a.positions->describe(),
        a.table->describe(), a.k_cache->describe(), a.v_cache->describe()));
  }
  a.rows = rows;
  a.heads = qs[1];
  a.blocks = cs[0];
  a.block_size = cs[1];
  a.kv_heads = cs[2];
  a.d = cs[3];
  a.n_slots = a.table->shape()[0];
  a.per_slot = a.table->shape()[1];
  a.scale = scale_attr > 0 ? scale_attr : 1.0 / std::sqrt(static_cast<double>(a.d));
  return a;
}

}  // namespace detail

void add_cpu_decode_ops(KernelRegistry& reg) {
  add_for<float>(reg);
  add_for<double>(reg);
}

}  // namespace baton
