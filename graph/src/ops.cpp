// The DSL's ops: shape and dtype inference at build time, with errors that name the op, its
// inputs and their shapes.
#include "baton/graph/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "baton/kernels/ops.h"

namespace baton {

namespace {

[[noreturn]] void fail(const char* op, const std::vector<Value>& inputs, const std::string& why) {
  std::string args;
  for (const auto& v : inputs) args += fmt::format("{}{}", args.empty() ? "" : ", ", v.describe());
  throw GraphError(fmt::format("{}({}): {}", op, args, why));
}

void need_float(const char* op, const std::vector<Value>& inputs) {
  for (const auto& v : inputs) {
    if (!is_floating(v.dtype())) fail(op, inputs, fmt::format("'{}' must be a float (f32, f64 or bf16)", v.name()));
  }
}

void same_dtype(const char* op, const std::vector<Value>& inputs) {
  for (const auto& v : inputs) {
    if (v.dtype() != inputs[0].dtype()) fail(op, inputs, "inputs differ in dtype");
  }
}

// Graph::autocast: how each op's float inputs are cast while one lives.
enum class Precision : std::uint8_t { low, f32, widest };

std::vector<Value> autocast(Precision p, std::vector<Value> in) {
  if (in.empty()) return in;
  Graph& g = in[0].graph();
  const std::optional<DType> low = g.autocast_dtype();
  if (!low) return in;
  DType to = p == Precision::low ? *low : DType::f32;
  if (p == Precision::widest) {
    bool mixed = false;
    std::optional<DType> widest;
    for (const Value& v : in) {
      if (!is_floating(v.dtype())) continue;
      if (widest && *widest != v.dtype()) mixed = true;
      if (!widest || size_of(v.dtype()) > size_of(*widest)) widest = v.dtype();
    }
    if (!mixed) return in;
    to = *widest;
  }
  for (Value& v : in) {
    if (is_floating(v.dtype()) && v.dtype() != DType::f64) v = g.cast_once(v, to);
  }
  return in;
}

Value unary(const char* op, Value x, Attrs attrs = {}) {
  need_float(op, {x});
  return x.graph().add(op, {x}, std::move(attrs), x.shape(), x.dtype());
}

Value binary(const char* op, Value a, Value b) {
  const std::vector<Value> in = autocast(Precision::widest, {a, b});
  a = in[0];
  b = in[1];
  need_float(op, {a, b});
  same_dtype(op, {a, b});
  Shape s = broadcast_shapes(a.shape(), b.shape(), op, a, b);
  return a.graph().add(op, {a, b}, {}, std::move(s), a.dtype());
}

std::int64_t norm_axis(std::int64_t axis, std::size_t rank, const char* op, const std::vector<Value>& in) {
  auto r = static_cast<std::int64_t>(rank);
  std::int64_t a = axis < 0 ? axis + r : axis;
  if (a < 0 || a >= r) fail(op, in, fmt::format("axis {} is out of range for rank {}", axis, r));
  return a;
}

}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op, const Value& va, const Value& vb) {
  const std::size_t r = std::max(a.size(), b.size());
  Shape out(r);
  for (std::size_t i = 0; i < r; ++i) {
    std::int64_t da = i < r - a.size() ? 1 : a[i - (r - a.size())];
    std::int64_t db = i < r - b.size() ? 1 : b[i - (r - b.size())];
    if (da != db && da != 1 && db != 1) {
      fail(op, {va, vb}, fmt::format("shapes {} and {} do not broadcast", to_string(a), to_string(b)));
    }
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Value cast(Value x, DType to) {
  need_float("cast", {x});
  if (!is_floating(to)) fail("cast", {x}, fmt::format("to {}: only f32, f64 and bf16", name(to)));
  if (x.dtype() == to) return x;
  return x.graph().add("cast", {x}, {}, x.shape(), to);
}

Value matmul(Value a, Value b, bool trans_a, bool trans_b) {
  const char* op = "matmul";
  const std::vector<Value> in = autocast(Precision::low, {a, b});
  a = in[0];
  b = in[1];
  need_float(op, {a, b});
  same_dtype(op, {a, b});
  if (a.rank() < 2 || b.rank() < 2) fail(op, {a, b}, "both inputs need at least 2 dimensions");
  std::int64_t m = trans_a ? a.dim(-1) : a.dim(-2);
  std::int64_t ka = trans_a ? a.dim(-2) : a.dim(-1);
  std::int64_t kb = trans_b ? b.dim(-1) : b.dim(-2);
  std::int64_t n = trans_b ? b.dim(-2) : b.dim(-1);
  if (ka != kb) fail(op, {a, b}, fmt::format("inner dimensions {} and {} differ", ka, kb));
  Shape batch_a(a.shape().begin(), a.shape().end() - 2);
  Shape batch_b(b.shape().begin(), b.shape().end() - 2);
  if (!batch_b.empty() && batch_b != batch_a) {
    fail(op, {a, b}, "b must be 2-D (a shared weight) or have a's batch dimensions");
  }
  Shape out = batch_a;
  out.push_back(m);
  out.push_back(n);
  return a.graph().add(op, {a, b}, Attrs{{"trans_a", std::int64_t{trans_a}}, {"trans_b", std::int64_t{trans_b}}},
                       std::move(out), a.dtype());
}

Value operator+(Value a, Value b) { return binary("add", a, b); }
Value operator-(Value a, Value b) { return binary("sub", a, b); }
Value operator*(Value a, Value b) { return binary("mul", a, b); }
Value operator/(Value a, Value b) { return binary("div", a, b); }
Value scale(Value x, double s) { return unary("scale", x, Attrs{{"value", s}}); }
Value operator*(Value a, double s) { return scale(a, s); }
Value operator*(double s, Value a) { return scale(a, s); }
Value operator/(Value a, double s) { return scale(a, 1.0 / s); }
Value operator-(Value a) { return scale(a, -1.0); }

Value relu(Value x) { return unary("relu", x); }
namespace {
Attrs gelu_attrs(GeluApprox approximate) {
  return approximate == GeluApprox::tanh ? Attrs{{"approximate", std::string("tanh")}} : Attrs{};
}
}  // namespace

Value gelu(Value x, GeluApprox approximate) { return unary("gelu", x, gelu_attrs(approximate)); }
Value tanh(Value x) { return unary("tanh", x); }
Value sigmoid(Value x) { return unary("sigmoid", x); }
Value exp(Value x) { return unary("exp", autocast(Precision::f32, {x})[0]); }
Value log(Value x) { return unary("log", autocast(Precision::f32, {x})[0]); }
Value sqrt(Value x) { return unary("sqrt", x); }
Value rsqrt(Value x) { return unary("rsqrt", autocast(Precision::f32, {x})[0]); }
Value pow(Value x, double exponent) {
  if (!std::isfinite(exponent)) fail("pow", {x}, fmt::format("exponent {} is not finite", exponent));
  return unary("pow", autocast(Precision::f32, {x})[0], Attrs{{"exponent", exponent}});
}
Value silu(Value x) { return unary("silu", x); }
Value bias_gelu(Value x, Value b, GeluApprox approximate) {
  const char* op = "bias_gelu";
  const std::vector<Value> in = autocast(Precision::low, {x, b});
  x = in[0];
  b = in[1];
  need_float(op, {x, b});
  same_dtype(op, {x, b});
  if (x.rank() < 1 || b.shape() != Shape{x.dim(-1)}) {
    fail(op, {x, b}, fmt::format("b must be one bias per column of x: [{}]", x.rank() < 1 ? 0 : x.dim(-1)));
  }
  return x.graph().add(op, {x, b}, gelu_attrs(approximate), x.shape(), x.dtype());
}

Value softmax(Value x) {
  x = autocast(Precision::f32, {x})[0];
  if (x.rank() < 1) fail("softmax", {x}, "needs at least 1 dimension");
  return unary("softmax", x);
}
Value log_softmax(Value x) {
  x = autocast(Precision::f32, {x})[0];
  if (x.rank() < 1) fail("log_softmax", {x}, "needs at least 1 dimension");
  return unary("log_softmax", x);
}

Value softmax_cross_entropy(Value logits, Value labels) {
  const char* op = "softmax_cross_entropy";
  logits = autocast(Precision::f32, {logits})[0];
  need_float(op, {logits});
  if (labels.dtype() != DType::i32) fail(op, {logits, labels}, "labels must be i32 class indices");
  if (logits.rank() != 2) fail(op, {logits, labels}, "logits must be [N, C]");
  if (labels.shape() != Shape{logits.dim(0)}) fail(op, {logits, labels}, "labels must be [N], one per row of logits");
  return logits.graph().add(op, {logits, labels}, {}, Shape{}, logits.dtype());
}

Value mse(Value prediction, Value target) {
  const char* op = "mse";
  const std::vector<Value> in = autocast(Precision::f32, {prediction, target});
  prediction = in[0];
  target = in[1];
  need_float(op, {prediction, target});
  same_dtype(op, {prediction, target});
  if (prediction.shape() != target.shape()) fail(op, {prediction, target}, "shapes differ");
  return prediction.graph().add(op, {prediction, target}, {}, Shape{}, prediction.dtype());
}

Value reshape(Value x, Shape shape) {
  std::int64_t known = 1;
  int inferred = -1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (inferred >= 0) fail("reshape", {x}, "more than one extent is -1");
      inferred = static_cast<int>(i);
    } else if (shape[i] < 0) {
      fail("reshape", {x}, fmt::format("bad target shape {}", to_string(shape)));
    } else {
      known *= shape[i];
    }
  }
  const std::int64_t total = numel(x.shape());
  if (inferred >= 0) {
    if (known == 0 || total % known != 0) {
      fail("reshape", {x}, fmt::format("cannot infer -1 in {} from {} elements", to_string(shape), total));
    }
    shape[static_cast<std::size_t>(inferred)] = total / known;
  }
  if (numel(shape) != total) {
    fail("reshape", {x}, fmt::format("{} has {} elements, not {}", to_string(shape), numel(shape), total));
  }
  return x.graph().add("reshape", {x}, {}, std::move(shape), x.dtype());
}

Value transpose(Value x, std::vector<std::int64_t> perm) {
  const auto r = static_cast<std::size_t>(x.rank());
  if (perm.size() != r) fail("transpose", {x}, fmt::format("perm has {} entries for rank {}", perm.size(), r));
  std::vector<bool> seen(r, false);
  Shape out(r);
  for (std::size_t i = 0; i < r; ++i) {
    auto p = norm_axis(perm[i], r, "transpose", {x});
    if (seen[static_cast<std::size_t>(p)]) fail("transpose", {x}, "perm repeats an axis");
    seen[static_cast<std::size_t>(p)] = true;
    perm[i] = p;
    out[i] = x.shape()[static_cast<std::size_t>(p)];
  }
  return x.graph().add("transpose", {x}, Attrs{{"perm", perm}}, std::move(out), x.dtype());
}

namespace {
Value reduce(const char* op, Value x, std::vector<std::int64_t> axes, bool keepdims) {
  need_float(op, {x});
  const auto r = x.shape().size();
  if (axes.empty()) {
    for (std::size_t i = 0; i < r; ++i) axes.push_back(static_cast<std::int64_t>(i));
  }
  for (auto& a : axes) a = norm_axis(a, r, op, {x});
  std::sort(axes.begin(), axes.end());
  if (std::adjacent_find(axes.begin(), axes.end()) != axes.end()) fail(op, {x}, "an axis is repeated");
  Shape out;
  for (std::size_t i = 0; i < r; ++i) {
    bool reduced = std::binary_search(axes.begin(), axes.end(), static_cast<std::int64_t>(i));
    if (!reduced) {
      out.push_back(x.shape()[i]);
    } else if (keepdims) {
      out.push_back(1);
    }
  }
  return x.graph().add(op, {x}, Attrs{{"axes", axes}, {"keepdims", std::int64_t{keepdims}}}, std::move(out),
                       x.dtype());
}
}  // namespace

Value sum(Value x, std::vector<std::int64_t> axes, bool keepdims) {
  return reduce("sum", autocast(Precision::f32, {x})[0], std::move(axes), keepdims);
}
Value mean(Value x, std::vector<std::int64_t> axes, bool keepdims) {
  return reduce("mean", autocast(Precision::f32, {x})[0], std::move(axes), keepdims);
}
Value max(Value x, std::vector<std::int64_t> axes, bool keepdims) {
  return reduce("max", x, std::move(axes), keepdims);
}
Value maximum(Value a, Value b) { return binary("maximum", a, b); }
Value stop_gradient(Value x) { return unary("stop_gradient", x); }

Value layer_norm(Value x, double eps) {
  x = autocast(Precision::f32, {x})[0];
  if (x.rank() < 1) fail("layer_norm", {x}, "needs at least 1 dimension");
  return unary("layer_norm", x, Attrs{{"eps", eps}});
}

Value layer_norm(Value x, Value gamma, Value beta, double eps) {
  Shape last{x.rank() >= 1 ? x.dim(-1) : 0};
  if (gamma.shape() != last || beta.shape() != last) {
    fail("layer_norm", {x, gamma, beta}, fmt::format("gamma and beta must be {}", to_string(last)));
  }
  return layer_norm(x, eps) * gamma + beta;
}

Value rms_norm(Value x, Value w, double eps) {
  const char* op = "rms_norm";
  const std::vector<Value> in = autocast(Precision::f32, {x, w});
  x = in[0];
  w = in[1];
  need_float(op, {x, w});
  same_dtype(op, {x, w});
  if (x.rank() < 1 || x.dim(-1) == 0) fail(op, {x, w}, "x must be [..., D] with D > 0");
  if (w.shape() != Shape{x.dim(-1)}) fail(op, {x, w}, fmt::format("w must be one scale per feature: [{}]", x.dim(-1)));
  // eps = 0 divides by zero on an all-zero row (padding); a NaN would slip through a > test.
  if (!(eps > 0.0 && std::isfinite(eps))) fail(op, {x, w}, fmt::format("eps = {} must be finite and > 0", eps));
  return x.graph().add(op, {x, w}, Attrs{{"eps", eps}}, x.shape(), x.dtype());
}

Value rope(Value x, double base) {
  const char* op = "rope";
  need_float(op, {x});
  if (x.rank() < 2) fail(op, {x}, "x must be [..., T, D] (at least 2 axes: positions, features)");
  if (x.dim(-1) == 0 || x.dim(-1) % 2 != 0) {
    fail(op, {x}, fmt::format("the head size D = {} must be even and > 0 (features rotate in pairs)", x.dim(-1)));
  }
  if (!(base > 0.0 && std::isfinite(base))) fail(op, {x}, fmt::format("base = {} must be finite and > 0", base));
  return unary(op, x, Attrs{{"base", base}});
}

Value swiglu(Value x, Value w1, Value w3, Value w2) {
  if (w1.rank() != 2 || w3.shape() != w1.shape() || w2.rank() != 2 || w2.dim(0) != w1.dim(1)) {
    fail("swiglu", {x, w1, w3, w2}, "w1 and w3 must be [D, F] and w2 [F, D]");
  }
  return matmul(silu(matmul(x, w1)) * matmul(x, w3), w2);
}

Value embedding(Value table, Value ids) {
  const char* op = "embedding";
  table = autocast(Precision::low, {table})[0];
  need_float(op, {table});
  if (table.rank() != 2) fail(op, {table, ids}, "table must be [V, D]");
  if (ids.dtype() != DType::i32) fail(op, {table, ids}, "ids must be i32");
  Shape out = ids.shape();
  out.push_back(table.dim(1));
  return table.graph().add(op, {table, ids}, {}, std::move(out), table.dtype());
}

Value causal_mask(Value scores) {
  if (scores.rank() < 2 || scores.dim(-1) != scores.dim(-2)) fail("causal_mask", {scores}, "scores must be [..., T, T]");
  return unary("causal_mask", scores, Attrs{{"value", -std::numeric_limits<double>::infinity()}});
}

Value attention(Value q, Value k, Value v, const AttentionOptions& options) {
  const char* op = "attention";
  const std::vector<Value> in = autocast(Precision::low, {q, k, v});
  q = in[0];
  k = in[1];
  v = in[2];
  need_float(op, {q, k, v});
  same_dtype(op, {q, k, v});
  if (q.rank() < 2) fail(op, {q, k, v}, "q, k and v must be [..., T, D] (at least 2 axes)");
  if (const std::string why = attention_kv_mismatch(q.shape(), k.shape()); !why.empty()) fail(op, {q, k, v}, why);
  if (v.shape() != k.shape()) fail(op, {q, k, v}, "v must have k's shape");
  if (q.dim(-1) == 0) fail(op, {q, k, v}, "the head size D is 0");
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.dim(-1))));
  if (!std::isfinite(scale)) fail(op, {q, k, v}, fmt::format("scale {} is not finite", scale));
  if (options.kernel != "auto" && options.kernel != "cudnn" && options.kernel != "fused") {
    fail(op, {q, k, v}, fmt::format("kernel must be auto, cudnn or fused, not '{}'", options.kernel));
  }
  Attrs attrs{{"causal", std::int64_t{options.causal}}, {"scale", scale}};
  if (options.kernel != "auto") attrs.set("kernel", options.kernel);  // absent: auto
  return q.graph().add(op, {q, k, v}, std::move(attrs), q.shape(), q.dtype());
}

Value rope_at(Value x, Value positions, double base) {
  const char* op = "rope_at";
  need_float(op, {x});
  if (x.rank() != 3 || x.dim(-1) == 0 || x.dim(-1) % 2 != 0) {
    fail(op, {x, positions}, "x must be [R, H, D] with the head size D even and > 0 (features rotate in pairs)");
  }
  if (positions.dtype() != DType::i32 || positions.shape() != Shape{x.dim(0)}) {
    fail(op, {x, positions}, fmt::format("positions must be i32 [{}], one per row", x.dim(0)));
  }
  if (!(base > 0.0 && std::isfinite(base))) fail(op, {x, positions}, fmt::format("base = {} must be finite and > 0", base));
  return x.graph().add(op, {x, positions}, Attrs{{"base", base}}, x.shape(), x.dtype());
}

Value paged_attention(Value q, Value k, Value v, Value slots, Value positions, Value block_table, Value k_cache,
                      Value v_cache, std::optional<double> scale) {
  const char* op = "paged_attention";
  const std::vector<Value> all{q, k, v, slots, positions, block_table, k_cache, v_cache};
  need_float(op, {q, k, v, k_cache, v_cache});
  same_dtype(op, {q, k, v, k_cache, v_cache});
  if (q.rank() != 3 || k.rank() != 3 || k.shape() != v.shape() || k.dim(0) != q.dim(0) || k.dim(2) != q.dim(2) ||
      k.dim(1) < 1 || q.dim(1) % k.dim(1) != 0 || q.dim(2) < 1) {
    fail(op, all, "q must be [R, H, D], k and v [R, Hkv, D] with H a multiple of Hkv");
  }
  if (k_cache.rank() != 4 || v_cache.shape() != k_cache.shape() || k_cache.dim(2) != k.dim(1) ||
      k_cache.dim(3) != k.dim(2)) {
    fail(op, all, "k_cache and v_cache must be [blocks, block_size, Hkv, D]");
  }
  const Shape rows{q.dim(0)};
  if (slots.dtype() != DType::i32 || positions.dtype() != DType::i32 || block_table.dtype() != DType::i32 ||
      slots.shape() != rows || positions.shape() != rows || block_table.rank() != 2) {
    fail(op, all, "slots and positions must be i32 [R], block_table i32 [S, M]");
  }
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.dim(2))));
  if (!(s > 0.0 && std::isfinite(s))) fail(op, all, fmt::format("scale {} must be finite and > 0", s));
  return q.graph().add(op, all, Attrs{{"scale", s}}, q.shape(), q.dtype());
}

Value dropout(Value x, double p) {
  if (!(p >= 0.0 && p < 1.0)) fail("dropout", {x}, fmt::format("p = {} is not in [0, 1)", p));
  // The mask's seed: the graph's seed and this node's position, so runs repeat exactly.
  auto seed = static_cast<std::int64_t>((x.graph().seed() * 0x9E3779B97F4A7C15ull) ^ static_cast<std::uint64_t>(x.graph().size()));
  return unary("dropout", x, Attrs{{"p", p}, {"seed", seed}});
}

Value slice(Value x, std::int64_t axis, std::int64_t start, std::int64_t end) {
  auto a = norm_axis(axis, x.shape().size(), "slice", {x});
  std::int64_t extent = x.shape()[static_cast<std::size_t>(a)];
  if (start < 0 || end > extent || start >= end) {
    fail("slice", {x}, fmt::format("[{}, {}) is not a non-empty range inside 0..{} on axis {}", start, end, extent, a));
  }
  Shape out = x.shape();
  out[static_cast<std::size_t>(a)] = end - start;
  return x.graph().add("slice", {x}, Attrs{{"axis", a}, {"start", start}}, std::move(out), x.dtype());
}

Value concat(const std::vector<Value>& inputs, std::int64_t axis) {
  if (inputs.empty()) throw GraphError("concat() of nothing");
  const std::vector<Value> xs = autocast(Precision::widest, inputs);
  same_dtype("concat", xs);
  auto a = norm_axis(axis, xs[0].shape().size(), "concat", xs);
  Shape out = xs[0].shape();
  out[static_cast<std::size_t>(a)] = 0;
  for (const auto& v : xs) {
    Shape s = v.shape();
    if (s.size() != out.size()) fail("concat", xs, "inputs differ in rank");
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (static_cast<std::int64_t>(i) != a && s[i] != xs[0].shape()[i]) fail("concat", xs, "shapes differ off the axis");
    }
    out[static_cast<std::size_t>(a)] += s[static_cast<std::size_t>(a)];
  }
  return xs[0].graph().add("concat", xs, Attrs{{"axis", a}}, std::move(out), xs[0].dtype());
}

Value sum_to(Value x, Shape shape) {
  if (x.shape() == shape) return x;
  Shape b = broadcast_shapes(shape, x.shape(), "sum_to", x, x);
  if (b != x.shape()) fail("sum_to", {x}, fmt::format("{} does not broadcast to {}", to_string(shape), to_string(x.shape())));
  return x.graph().add("sum_to", {x}, {}, std::move(shape), x.dtype());
}

Value broadcast_to(Value x, Shape shape) {
  if (x.shape() == shape) return x;
  Shape b = broadcast_shapes(x.shape(), shape, "broadcast_to", x, x);
  if (b != shape) fail("broadcast_to", {x}, fmt::format("does not broadcast to {}", to_string(shape)));
  return x.graph().add("broadcast_to", {x}, {}, std::move(shape), x.dtype());
}

}  // namespace baton
