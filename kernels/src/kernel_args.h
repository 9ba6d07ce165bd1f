#pragma once
// Private to kernels/src: how a kernel fetches the tensors it relies on, with an error naming
// the op (and the tensor's role, where given) when one is missing.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "baton/kernels/kernel.h"
#include "baton/kernels/ops.h"

namespace baton::detail {

inline const Tensor& need_input(const KernelContext& ctx, std::size_t i, const char* op,
                                const char* role = nullptr) {
  if (ctx.inputs.size() <= i || ctx.inputs[i] == nullptr || !ctx.inputs[i]->defined()) {
    throw std::invalid_argument(role == nullptr ? fmt::format("{}: input {} is missing", op, i)
                                                : fmt::format("{}: input {} ({}) is missing", op, i, role));
  }
  return *ctx.inputs[i];
}

inline Tensor& need_output(const KernelContext& ctx, std::size_t i, const char* op,
                           const char* role = nullptr) {
  if (ctx.outputs.size() <= i || ctx.outputs[i] == nullptr || !ctx.outputs[i]->defined()) {
    throw std::invalid_argument(role == nullptr ? fmt::format("{}: output {} is missing", op, i)
                                                : fmt::format("{}: output {} ({}) is missing", op, i, role));
  }
  return *ctx.outputs[i];
}

/// Throws naming the op and the tensor's role unless `t` is of dtype `want`.
inline void check_dtype(const Tensor& t, DType want, const char* op, const char* role) {
  if (t.dtype() != want) {
    throw std::invalid_argument(fmt::format("{}: {} must be {}, got {}", op, role, name(want), t.describe()));
  }
}

/// The elements of a tensor of element type T (checked, naming op and role).
template <class T>
const T* in_data(const Tensor& t, const char* op, const char* role) {
  check_dtype(t, dtype_of<T>(), op, role);
  return static_cast<const T*>(t.raw());
}

template <class T>
T* out_data(Tensor& t, const char* op, const char* role) {
  check_dtype(t, dtype_of<T>(), op, role);
  return static_cast<T*>(t.raw());
}

inline void check_same_shape(const char* op, const Tensor& a, const char* a_role, const Tensor& b, const char* b_role) {
  if (a.shape() != b.shape()) {
    throw std::invalid_argument(fmt::format("{}: {} {} and {} {} must have the same shape", op, a_role, a.describe(),
                                            b_role, b.describe()));
  }
}

/// bf16 (bf16.cpp): the float32 kernel `inner` run on float32 copies of an actor's bf16 inputs
/// and outputs, on `device` (KernelRegistry::create's fallback where an op has no bf16 kernel).
std::unique_ptr<Kernel> via_float32(std::unique_ptr<Kernel> inner, Device device);
/// "cast" between f32, f64 and bf16 on the CPU (and f32 / bf16 on CUDA devices).
void add_cast_kernels(KernelRegistry& reg);
/// Element-wise conversion between f32, f64 and bf16 host tensors of one size (bf16: rounded
/// to nearest even). Throws naming both for other dtypes.
void convert_on_host(const Tensor& src, Tensor& dst);

/// The extents of c = op(a) op(b), batched over a's leading axes (b shared when it is 2-D),
/// after checking that a, b and c fit together; every kernel of "matmul" (CPU, CUDA) reads them
/// here, so they all accept and refuse the same shapes with the same words.
struct MatmulDims {
  std::int64_t m = 0, k = 0, n = 0;
  /// Products in the batch (1 without batch axes).
  std::int64_t batches = 1;
  /// b is 2-D: one weight for every batch entry.
  bool shared_b = false;
};

inline MatmulDims matmul_dims(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b) {
  const Shape& as = a.shape();
  const Shape& bs = b.shape();
  auto fail = [&](const std::string& why) {
    return std::invalid_argument(fmt::format("matmul (trans_a={}, trans_b={}): a {}, b {}, c {}: {}", int(trans_a),
                                             int(trans_b), a.describe(), b.describe(), c.describe(), why));
  };
  if (as.size() < 2 || bs.size() < 2) throw fail("a and b need at least two axes");
  const std::size_t ra = as.size(), rb = bs.size();
  MatmulDims d;
  d.m = trans_a ? as[ra - 1] : as[ra - 2];
  d.k = trans_a ? as[ra - 2] : as[ra - 1];
  const std::int64_t kb = trans_b ? bs[rb - 1] : bs[rb - 2];
  d.n = trans_b ? bs[rb - 2] : bs[rb - 1];
  if (d.k != kb) throw fail(fmt::format("inner extents differ ({} vs {})", d.k, kb));
  const Shape batch(as.begin(), as.end() - 2);
  d.shared_b = rb == 2;
  if (!d.shared_b && !std::equal(batch.begin(), batch.end(), bs.begin(), bs.end() - 2)) {
    throw fail("b's batch axes must be absent or equal a's");
  }
  Shape want = batch;
  want.push_back(d.m);
  want.push_back(d.n);
  if (c.shape() != want) throw fail(fmt::format("c should be {}", to_string(want)));
  for (auto e : batch) d.batches *= e;
  return d;
}

/// The extents of matmul_bias (y = matmul(x, w, trans_b) + b, a Linear layer's forward: x
/// [..., K], w [K, N] (or [N, K] with trans_b), b [N], y [..., N]), every kernel's checks. x and w
/// share a dtype, b and y share one; y's is x's, or f32 where x is bf16 (a bf16 product whose
/// result autocast widens before the bias is added).
struct LinearDims {
  std::int64_t rows = 0, k = 0, n = 0;
};

inline LinearDims linear_dims(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y, bool trans_b,
                              const char* op) {
  const Shape& xs = x.shape();
  auto fail = [&](const std::string& why) {
    return std::invalid_argument(fmt::format("{} (trans_b={}): x {}, w {}, b {}, y {}: {}", op, int(trans_b),
                                             x.describe(), w.describe(), b.describe(), y.describe(), why));
  };
  if (xs.size() < 2) throw fail("x needs at least two axes");
  if (w.shape().size() != 2) throw fail("w must be 2-D");
  LinearDims d{.rows = 0, .k = xs.back(), .n = trans_b ? w.shape()[0] : w.shape()[1]};
  const std::int64_t kw = trans_b ? w.shape()[1] : w.shape()[0];
  if (kw != d.k) throw fail(fmt::format("inner extents differ ({} vs {})", d.k, kw));
  d.rows = 1;
  for (std::size_t i = 0; i + 1 < xs.size(); ++i) d.rows *= xs[i];
  Shape want(xs.begin(), xs.end() - 1);
  want.push_back(d.n);
  if (y.shape() != want) throw fail(fmt::format("y should be {}", to_string(want)));
  if (b.shape() != Shape{d.n}) throw fail(fmt::format("b should be [{}]", d.n));
  if (x.dtype() != w.dtype() || b.dtype() != y.dtype() ||
      (y.dtype() != x.dtype() && !(x.dtype() == DType::bf16 && y.dtype() == DType::f32)))
    throw fail("x and w share a dtype, b and y share one: x's, or f32 for bf16 x");
  for (std::int64_t e : {d.rows, d.k, d.n}) {
    if (e > INT_MAX) throw fail("an extent exceeds BLAS's 32-bit int");
  }
  return d;
}

/// matmul_bias's operands (x, w, b; y) from an act's context, checked by linear_dims.
struct LinearArgs {
  const Tensor& x;
  const Tensor& w;
  const Tensor& b;
  Tensor& y;
  LinearDims dims;
};

inline LinearArgs linear_args(const KernelContext& ctx, bool trans_b, const char* op) {
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& w = need_input(ctx, 1, op, "w");
  const Tensor& b = need_input(ctx, 2, op, "b");
  Tensor& y = need_output(ctx, 0, op, "y");
  return {x, w, b, y, linear_dims(x, w, b, y, trans_b, op)};
}

/// matmul_dgelu_bgrad's operands: the data gradient of a product that read GELU's output,
/// dh = gelu'(pre) (dy w^T, or dy w with trans_b false), and the bias gradient db = dh summed over
/// the rows. dy [..., k], w [n, k] (trans_b) or [k, n], pre and dh [..., n], db [n]; one dtype.
struct DgeluArgs {
  const Tensor& dy;
  const Tensor& w;
  const Tensor& pre;
  Tensor& dh;
  Tensor& db;
  LinearDims dims;
};

inline DgeluArgs dgelu_args(const KernelContext& ctx, bool trans_b, const char* op) {
  const Tensor& dy = need_input(ctx, 0, op, "dy");
  const Tensor& w = need_input(ctx, 1, op, "w");
  const Tensor& pre = need_input(ctx, 2, op, "pre");
  Tensor& dh = need_output(ctx, 0, op, "dh");
  Tensor& db = need_output(ctx, 1, op, "db");
  const LinearDims d = linear_dims(dy, w, db, dh, trans_b, op);
  if (pre.shape() != dh.shape() || pre.dtype() != dh.dtype() || dh.dtype() != dy.dtype()) {
    throw std::invalid_argument(fmt::format("{}: dy {}, pre {} and dh {} must share a dtype, pre and dh a shape", op,
                                            dy.describe(), pre.describe(), dh.describe()));
  }
  return {dy, w, pre, dh, db, d};
}

/// The extents of matmul_bias_grad (dw = x^T dy over every row, db = dy summed over the rows):
/// x [..., k] and dy [..., n] with the same number of rows, dw [k, n], db [n]; every kernel of
/// the op (CPU, CUDA) checks them here. Extents that BLAS's 32-bit ints cannot hold are refused.
struct LinearGradDims {
  std::int64_t rows = 0, k = 0, n = 0;
};

inline LinearGradDims linear_grad_dims(const Tensor& x, const Tensor& dy, const Tensor& dw, const Tensor& db,
                                       const char* op) {
  const Shape& xs = x.shape();
  const Shape& ys = dy.shape();
  auto fail = [&](const std::string& why) {
    return std::invalid_argument(fmt::format("{}: x {}, dy {}, dw {}, db {}: {}", op, x.describe(), dy.describe(),
                                             dw.describe(), db.describe(), why));
  };
  if (xs.empty() || ys.empty()) throw fail("x and dy need at least one axis");
  LinearGradDims d{.rows = 0, .k = xs.back(), .n = ys.back()};
  d.rows = d.k == 0 ? 0 : x.numel() / d.k;
  const std::int64_t dy_rows = d.n == 0 ? 0 : dy.numel() / d.n;
  if (d.k > 0 && d.n > 0 && d.rows != dy_rows) throw fail(fmt::format("{} rows of x, {} of dy", d.rows, dy_rows));
  if (d.k == 0 || d.n == 0) d.rows = std::max(d.rows, dy_rows);
  if (dw.shape() != Shape{d.k, d.n}) throw fail(fmt::format("dw should be [{}, {}]", d.k, d.n));
  if (db.shape() != Shape{d.n}) throw fail(fmt::format("db should be [{}]", d.n));
  if (x.dtype() != dy.dtype() || dw.dtype() != dy.dtype() || db.dtype() != dy.dtype()) throw fail("dtypes differ");
  for (std::int64_t e : {d.rows, d.k, d.n}) {
    if (e > INT_MAX) throw fail("an extent exceeds BLAS's 32-bit int");
  }
  return d;
}

/// matmul_bias_grad's operands (x, dy; dw, db) from an act's context, checked by linear_grad_dims.
struct LinearGradArgs {
  const Tensor& x;
  const Tensor& dy;
  Tensor& dw;
  Tensor& db;
  LinearGradDims dims;
};

inline LinearGradArgs linear_grad_args(const KernelContext& ctx, const char* op) {
  const Tensor& x = need_input(ctx, 0, op, "x");
  const Tensor& dy = need_input(ctx, 1, op, "dy");
  Tensor& dw = need_output(ctx, 0, op, "dw");
  Tensor& db = need_output(ctx, 1, op, "db");
  return {x, dy, dw, db, linear_grad_dims(x, dy, dw, db, op)};
}

/// An axis in [-rank, rank) as an index in [0, rank); throws naming the op and the tensor.
inline std::size_t normalise_axis(std::int64_t axis, std::size_t rank, const char* op, const Tensor& t) {
  const auto r = static_cast<std::int64_t>(rank);
  if (axis < -r || axis >= r) {
    throw std::invalid_argument(fmt::format("{}: axis {} is out of range for {}", op, axis, t.describe()));
  }
  return static_cast<std::size_t>(axis < 0 ? axis + r : axis);
}

/// The product of s[begin, end).
inline std::int64_t product(const Shape& s, std::size_t begin, std::size_t end) {
  std::int64_t n = 1;
  for (std::size_t i = begin; i < end; ++i) n *= s[i];
  return n;
}

/// y = concat(inputs, axis) as rows: `outer` rows of y, each the inputs' runs of x.shape[axis]
/// x `inner` elements side by side. Every kernel of "concat" (CPU, CUDA) checks the shapes here.
struct ConcatDims {
  std::size_t axis = 0;
  std::int64_t outer = 1, inner = 1;
};

inline ConcatDims concat_dims(const KernelContext& ctx, const Tensor& y, std::int64_t axis) {
  const Shape& ys = y.shape();
  auto fail = [&](const std::string& why) {
    std::string inputs;
    for (const Tensor* x : ctx.inputs) inputs += (inputs.empty() ? "" : ", ") + x->describe();
    return std::invalid_argument(fmt::format("concat (axis {}): inputs [{}], y {}: {}", axis, inputs, y.describe(), why));
  };
  if (ctx.inputs.empty() || ys.empty()) throw fail("needs inputs and an output with axes");
  ConcatDims d;
  d.axis = normalise_axis(axis, ys.size(), "concat", y);
  std::int64_t total = 0;
  for (std::size_t k = 0; k < ctx.inputs.size(); ++k) {
    const Shape& xs = ctx.inputs[k]->shape();
    bool fits = xs.size() == ys.size();
    for (std::size_t i = 0; fits && i < ys.size(); ++i) fits = i == d.axis || xs[i] == ys[i];
    if (!fits) throw fail(fmt::format("input {} differs from y off the axis", k));
    total += xs[d.axis];
  }
  if (total != ys[d.axis]) throw fail(fmt::format("the inputs add up to {} along the axis", total));
  d.outer = product(ys, 0, d.axis);
  d.inner = product(ys, d.axis + 1, ys.size());
  return d;
}

/// The extents of attention(q, k, v) -> o and attention_grad(q, k, v, o, do) -> [dq dk dv]:
/// q [..., H, T, D]; k and v share one shape, q's or, for grouped-query heads (Llama's GQA),
/// [..., Hkv, T, D] with H a multiple of Hkv, query head h reading key and value head
/// h / (H / Hkv) (as torch's SDPA with enable_gqa). `heads` is the product of q's leading axes
/// (batch x heads), each attending over its own T x T scores, `kv_heads` that of k's; flat query
/// head i reads flat kv head i / group(). Every kernel of both ops (CPU, CUDA) checks its tensors
/// here, so they refuse the same shapes with the same words.
struct AttentionDims {
  std::int64_t heads = 0, kv_heads = 0, t = 0, d = 0;
  /// Query heads per key and value head (1 without grouped-query heads).
  std::int64_t group() const { return kv_heads > 0 ? heads / kv_heads : 1; }
};

inline AttentionDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  const Shape& s = q.shape();
  const std::string mismatch = s.size() < 2 ? "q must be [..., T, D]" : attention_kv_mismatch(s, k.shape());
  if (!mismatch.empty() || v.shape() != k.shape()) {
    throw std::invalid_argument(fmt::format("{}: q {}, k {} and v {}: {}", op, q.describe(), k.describe(),
                                            v.describe(), mismatch.empty() ? "v must have k's shape" : mismatch));
  }
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    throw std::invalid_argument(fmt::format("{}: q {}, k {} and v {} differ in dtype", op, q.describe(), k.describe(),
                                            v.describe()));
  }
  AttentionDims a;
  a.t = s[s.size() - 2];
  a.d = s.back();
  a.heads = product(s, 0, s.size() - 2);
  a.kv_heads = product(k.shape(), 0, s.size() - 2);
  return a;
}

/// Where attention_grad writes dq, dk and dv: one output [..., T, 3 D] with the three side by
/// side along the last axis (the graph's node), or three outputs of q's, k's and v's element
/// counts (the plan's, when the node's only readers are the slices that take them apart:
/// PlanBuilder::op_actor). Row i of flat query head h of dq starts at dq + (h T + i) ld
/// elements; row i of flat kv head h of dk and dv likewise. Grouped-query heads: one flat output
/// [numel(q) + 2 numel(k)] (dq, dk, dv one after another) or the three outputs; ld is D.
struct AttentionGradOut {
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  std::int64_t ld = 0;  // elements from one row to the next: 3 D packed, D apart
};

inline AttentionGradOut attention_grad_out(const KernelContext& ctx, const Tensor& q, const Tensor& k, const char* op) {
  const std::int64_t d = q.shape().empty() ? 0 : q.shape().back();
  const auto bytes = static_cast<std::int64_t>(size_of(q.dtype()));
  auto check_dtype = [&](const Tensor& t) {
    if (t.dtype() != q.dtype()) {
      throw std::invalid_argument(fmt::format("{}: {} must have q's dtype ({})", op, t.describe(), name(q.dtype())));
    }
  };
  if (ctx.outputs.size() == 3) {
    AttentionGradOut out;
    void** at[] = {&out.dq, &out.dk, &out.dv};
    const char* names[] = {"dq", "dk", "dv"};
    const Tensor* like[] = {&q, &k, &k};  // v has k's shape (attention_dims)
    const char* of[] = {"q", "k", "v"};
    for (std::size_t i = 0; i < 3; ++i) {
      Tensor& t = need_output(ctx, i, op, names[i]);
      if (t.numel() != like[i]->numel()) {
        throw std::invalid_argument(fmt::format("{}: {} {} must have {}'s {} elements ({})", op, names[i], t.describe(),
                                                of[i], like[i]->numel(), to_string(like[i]->shape())));
      }
      check_dtype(t);
      *at[i] = t.raw();
    }
    out.ld = d;
    return out;
  }
  Tensor& grads = need_output(ctx, 0, op, "dqkv");
  const Shape packed = attention_grad_shape(q.shape(), k.shape());
  if (grads.shape() != packed) {
    throw std::invalid_argument(fmt::format("{}: dqkv {} must be {} ({}), or three outputs of q's, k's and v's sizes",
                                            op, grads.describe(), to_string(packed),
                                            k.shape() == q.shape() ? "dq, dk and dv side by side"
                                                                   : "dq, dk and dv one after another"));
  }
  check_dtype(grads);
  auto* base = static_cast<char*>(grads.raw());
  if (k.shape() != q.shape()) {
    const std::int64_t nq = q.numel() * bytes, nk = k.numel() * bytes;
    return {base, base + nq, base + nq + nk, d};
  }
  return {base, base + d * bytes, base + 2 * d * bytes, 3 * d};
}

/// attention's saved stats (its second output, attention_grad's sixth input; ops.h): throws
/// naming `op` unless `stats` has one element per row of q.
inline void check_attention_stats(const Tensor& stats, const Tensor& q, const char* op) {
  if (stats.shape() != attention_stats_shape(q.shape())) {
    throw std::invalid_argument(fmt::format("{}: stats {} must be {} (one per row of q {})", op, stats.describe(),
                                            to_string(attention_stats_shape(q.shape())), q.describe()));
  }
}

/// The attention's attributes: `causal` (0 or 1, default 1: key j is hidden from query i when
/// j > i) and `scale` (the scores' factor; absent: 1 / sqrt(D), as torch's SDPA).
struct AttentionAttrs {
  /// Which implementation a CUDA device runs (attr kernel): cuDNN's fused attention where it
  /// loads and takes the shape, else baton's own (auto); cuDNN or fail (cudnn); baton's own
  /// (fused). The CPU has one implementation and takes auto and fused.
  enum class Kernel : std::uint8_t { automatic, cudnn, fused };
  bool causal = true;
  double scale = 0;  // NaN until resolved for a D
  Kernel kernel = Kernel::automatic;
  static AttentionAttrs read(const Attrs& attrs, std::string_view actor, const char* op) {
    AttentionAttrs a;
    const std::string k = attrs.get_string("kernel", "auto");
    if (k == "auto") {
      a.kernel = Kernel::automatic;
    } else if (k == "cudnn") {
      a.kernel = Kernel::cudnn;
    } else if (k == "fused") {
      a.kernel = Kernel::fused;
    } else {
      throw std::invalid_argument(fmt::format("{} (actor '{}'): attribute kernel must be auto, cudnn or fused, not '{}'", op, actor, k));
    }
    const std::int64_t c = attrs.get_int("causal", 1);
    if (c != 0 && c != 1) {
      throw std::invalid_argument(fmt::format("{} (actor '{}'): attribute causal must be 0 or 1, not {}", op, actor, c));
    }
    a.causal = c == 1;
    a.scale = attrs.get_double("scale", std::numeric_limits<double>::quiet_NaN());
    if (!std::isnan(a.scale) && !std::isfinite(a.scale)) {
      throw std::invalid_argument(fmt::format("{} (actor '{}'): attribute scale must be finite, not {}", op, actor, a.scale));
    }
    return a;
  }
  double scale_for(std::int64_t d) const { return std::isnan(scale) ? 1.0 / std::sqrt(static_cast<double>(d)) : scale; }
};

/// GELU's form, from the string attribute "approximate" of gelu, gelu_grad, bias_gelu and
/// bias_gelu_grad (torch's argument of that name): "none" (absent too) is the exact erf form,
/// "tanh" the tanh approximation (GPT-2's gelu_new, Megatron's bias_gelu); true for "tanh".
inline bool gelu_tanh(const KernelConfig& cfg, const char* op) {
  std::string form;
  try {
    form = cfg.attrs.get_string("approximate", "none");
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): {}", op, cfg.actor, e.what()));
  }
  if (form == "none") return false;
  if (form == "tanh") return true;
  throw std::invalid_argument(
      fmt::format("{} (actor '{}'): attribute approximate must be \"none\" or \"tanh\", not \"{}\"", op, cfg.actor, form));
}

/// bias_gelu(x [..., F], b [F]) and its gradient: checks that b is one bias per column of x
/// and returns F.
inline std::int64_t bias_columns(const Tensor& x, const Tensor& b, const char* op) {
  if (x.shape().empty() || b.shape() != Shape{x.shape().back()}) {
    throw std::invalid_argument(fmt::format("{}: b {} must be [F] for x {} of shape [..., F]", op, b.describe(),
                                            x.describe()));
  }
  return x.shape().back();
}

}  // namespace baton::detail
