// Reverse-mode autodiff on the logical graph. Node ids are a topological order (a node's inputs
// always come before it), so one backward sweep in decreasing id order visits every node after
// all of its consumers.
#include "baton/graph/autodiff.h"

#include <fmt/format.h>

#include "baton/graph/op_registry.h"
#include "baton/graph/ops.h"
#include "baton/kernels/ops.h"
#include "builtin_gradients.h"

namespace baton {

namespace {

Value add_grad_op(const char* op, std::vector<Value> inputs, Attrs attrs, const Value& like) {
  return like.graph().add(op, std::move(inputs), std::move(attrs), like.shape(), like.dtype());
}

// The node op(inputs, attrs) if one was made already (by the gradient of another input of the
// same forward node `y`, so after it), else a new one: ops whose one node gives the gradients of
// several inputs.
Value shared_grad_op(const char* op, std::vector<Value> inputs, const Attrs& attrs, Shape shape, DType dtype,
                     const Value& y) {
  Graph& g = inputs[0].graph();
  for (int id = g.size() - 1; id > y.id(); --id) {
    const Node& n = g.node(id);
    if (n.op != op || n.inputs.size() != inputs.size() || !(n.attrs == attrs)) continue;
    bool same = true;
    for (std::size_t k = 0; k < inputs.size() && same; ++k) same = n.inputs[k] == inputs[k].id();
    if (same) return g.value(id);
  }
  return g.add(op, std::move(inputs), attrs, std::move(shape), dtype);
}

}  // namespace

namespace detail {

// The built-in ops' gradient rules, for the op table (op_registry.cpp): each gives
// dL/d(inputs[input]) of y = op(inputs) from dL/dy.
namespace {

/// The table being filled: rule() for any op, unary() for y = f(x) whose gradient is one op on
/// (x or y, dy), with the forward node's attributes or none.
struct Rules {
  std::vector<std::pair<std::string, GradientRule>> list;
  void rule(std::initializer_list<const char*> ops, const GradientRule& f) {
    for (const char* op : ops) list.emplace_back(op, f);
  }
  void unary(const char* op, const char* grad_op, bool of_y, bool with_attrs) {
    rule({op}, [=](const GradientArgs& a) {
      return add_grad_op(grad_op, {of_y ? a.y : a.x(), a.dy}, with_attrs ? a.attrs : Attrs{}, a.x());
    });
  }
};

// Arithmetic and matrix products.
void arithmetic_rules(Rules& r) {
  auto rule = [&](std::initializer_list<const char*> ops, const GradientRule& f) { r.rule(ops, f); };
  rule({"cast"}, [](const GradientArgs& a) { return cast(a.dy, a.x().dtype()); });
  rule({"add"}, [](const GradientArgs& a) { return sum_to(a.dy, a.x().shape()); });
  rule({"sub"}, [](const GradientArgs& a) { return sum_to(a.input == 0 ? a.dy : -a.dy, a.x().shape()); });
  rule({"mul"}, [](const GradientArgs& a) { return sum_to(a.dy * a.inputs[1 - a.input], a.x().shape()); });
  rule({"div"}, [](const GradientArgs& a) {
    if (a.input == 0) return sum_to(a.dy / a.inputs[1], a.x().shape());
    return sum_to(-(a.dy * a.y / a.inputs[1]), a.x().shape());
  });
  rule({"scale"}, [](const GradientArgs& a) { return scale(a.dy, a.attrs.get_double("value", 1.0)); });
  rule({"matmul"}, [](const GradientArgs& a) {
    const bool ta = a.attrs.get_int("trans_a", 0) != 0;
    const bool tb = a.attrs.get_int("trans_b", 0) != 0;
    const Value& x = a.inputs[0];
    const Value& b = a.inputs[1];
    const Value& dy = a.dy;
    const bool shared_b = b.rank() == 2 && x.rank() > 2;
    if (a.input == 0) {
      if (!ta) return matmul(dy, b, false, !tb);
      if (shared_b) a.none();
      return matmul(b, dy, tb, true);
    }
    if (shared_b) {
      if (ta) a.none();
      // dB sums over every batch row: fold the batch into the rows first.
      Value a2 = reshape(x, {-1, x.dim(-1)});
      Value dy2 = reshape(dy, {-1, dy.dim(-1)});
      return tb ? matmul(dy2, a2, true, false) : matmul(a2, dy2, true, false);
    }
    return tb ? matmul(dy, x, true, ta) : matmul(x, dy, !ta, false);
  });
}

// Activations, normalisation, attention and losses.
void nn_rules(Rules& r) {
  auto rule = [&](std::initializer_list<const char*> ops, const GradientRule& f) { r.rule(ops, f); };
  auto unary = [&](const char* op, const char* grad_op, bool of_y, bool with_attrs) {
    r.unary(op, grad_op, of_y, with_attrs);
  };
  unary("relu", "relu_grad", false, false);
  unary("gelu", "gelu_grad", false, true);  // with its form ("approximate")
  rule({"bias_gelu"}, [](const GradientArgs& a) {
    // One node for both inputs: d/dx, and its column sums for the bias.
    const Value& x = a.inputs[0];
    Value dx = shared_grad_op("bias_gelu_grad", {x, a.inputs[1], a.dy}, a.attrs, x.shape(), x.dtype(), a.y);
    return a.input == 0 ? dx : sum_to(dx, a.x().shape());
  });
  rule({"attention"}, [](const GradientArgs& a) {
    // One node gives dq, dk and dv side by side along the last axis; input i's is its slice.
    // Grouped-query heads (k with fewer heads than q): one after another, flat (dk and dv summed
    // over each kv head's query heads by the kernel); input i's is its slice, reshaped.
    const Shape& q = a.inputs[0].shape();
    const Shape& k = a.inputs[1].shape();
    Value grads = shared_grad_op("attention_grad", {a.inputs[0], a.inputs[1], a.inputs[2], a.y, a.dy}, a.attrs,
                                 attention_grad_shape(q, k), a.x().dtype(), a.y);
    const auto i = static_cast<std::int64_t>(a.input);
    if (k == q) {
      const std::int64_t d = a.x().dim(-1);
      return slice(grads, -1, i * d, (i + 1) * d);
    }
    const std::int64_t nq = numel(q), nk = numel(k);
    const std::int64_t start = i == 0 ? 0 : nq + (i - 1) * nk;
    return reshape(slice(grads, 0, start, start + (i == 0 ? nq : nk)), a.x().shape());
  });
  unary("tanh", "tanh_grad", true, false);
  unary("sigmoid", "sigmoid_grad", true, false);
  rule({"exp"}, [](const GradientArgs& a) { return a.dy * a.y; });
  rule({"log"}, [](const GradientArgs& a) { return a.dy / a.x(); });  // NaN where x < 0, as the forward
  unary("sqrt", "sqrt_grad", true, false);
  unary("rsqrt", "rsqrt_grad", true, false);
  unary("silu", "silu_grad", false, false);
  unary("pow", "pow_grad", false, true);
  rule({"rms_norm"}, [](const GradientArgs& a) {
    if (a.input == 0) return add_grad_op("rms_norm_grad", {a.inputs[0], a.inputs[1], a.dy}, a.attrs, a.x());
    return add_grad_op("rms_norm_grad_weight", {a.inputs[0], a.dy}, a.attrs, a.x());
  });
  rule({"rope"}, [](const GradientArgs& a) { return add_grad_op("rope_grad", {a.dy}, a.attrs, a.x()); });
  unary("softmax", "softmax_grad", true, false);
  unary("log_softmax", "log_softmax_grad", true, false);
  rule({"softmax_cross_entropy"}, [](const GradientArgs& a) {
    if (a.input == 1) a.none();
    return add_grad_op("softmax_cross_entropy_grad", {a.inputs[0], a.inputs[1], a.dy}, {}, a.x());
  });
  rule({"mse"}, [](const GradientArgs& a) {
    Value d = add_grad_op("mse_grad", {a.inputs[0], a.inputs[1], a.dy}, {}, a.inputs[0]);
    return a.input == 0 ? d : -d;
  });
}

// Shapes and reductions, and the rest: layer norm, embeddings, the vocabulary-parallel loss,
// masks, dropout, slices and concatenation.
void shape_rules(Rules& r) {
  auto rule = [&](std::initializer_list<const char*> ops, const GradientRule& f) { r.rule(ops, f); };
  rule({"reshape"}, [](const GradientArgs& a) { return reshape(a.dy, a.x().shape()); });
  rule({"transpose"}, [](const GradientArgs& a) {
    auto perm = std::get<std::vector<std::int64_t>>(a.attrs.values().at("perm"));
    std::vector<std::int64_t> inverse(perm.size());
    for (std::size_t k = 0; k < perm.size(); ++k) inverse[static_cast<std::size_t>(perm[k])] = static_cast<std::int64_t>(k);
    return transpose(a.dy, inverse);
  });
  rule({"sum", "mean"}, [](const GradientArgs& a) {
    auto axes = std::get<std::vector<std::int64_t>>(a.attrs.values().at("axes"));
    Shape kept = a.x().shape();
    std::int64_t count = 1;
    for (auto ax : axes) {
      count *= kept[static_cast<std::size_t>(ax)];
      kept[static_cast<std::size_t>(ax)] = 1;
    }
    Value d = broadcast_to(a.dy.shape() == kept ? a.dy : reshape(a.dy, kept), a.x().shape());
    return a.y.node().op == "mean" ? scale(d, 1.0 / static_cast<double>(count)) : d;
  });
  rule({"layer_norm"}, [](const GradientArgs& a) {
    return add_grad_op("layer_norm_grad", {a.x(), a.dy}, Attrs{{"eps", a.attrs.get_double("eps", 1e-5)}}, a.x());
  });
  rule({"embedding"}, [](const GradientArgs& a) {
    if (a.input == 1) a.none();
    return add_grad_op("embedding_grad", {a.inputs[1], a.dy}, a.attrs, a.x());  // a vocabulary shard's rows
  });
  // The row maximum (input 2 of the stats, 1 of the loss) only shifts the exponents; the loss
  // does not depend on it, and vocab_parallel_cross_entropy passes it through stop_gradient.
  rule({"vocab_parallel_ce_stats"}, [](const GradientArgs& a) {
    if (a.input != 0) a.none();
    return add_grad_op("vocab_parallel_ce_stats_grad", {a.inputs[0], a.inputs[1], a.inputs[2], a.dy}, a.attrs, a.x());
  });
  rule({"vocab_parallel_ce_loss"}, [](const GradientArgs& a) {
    if (a.input != 0) a.none();
    return add_grad_op("vocab_parallel_ce_loss_grad", {a.inputs[0], a.dy}, {}, a.x());
  });
  rule({"causal_mask"}, [](const GradientArgs& a) { return add_grad_op("causal_mask", {a.dy}, Attrs{{"value", 0.0}}, a.x()); });
  rule({"dropout"}, [](const GradientArgs& a) { return add_grad_op("dropout", {a.dy}, a.attrs, a.x()); });
  rule({"slice"}, [](const GradientArgs& a) {
    return add_grad_op("slice_grad", {a.dy},
                       Attrs{{"axis", a.attrs.get_int("axis", 0)}, {"start", a.attrs.get_int("start", 0)}}, a.x());
  });
  rule({"concat"}, [](const GradientArgs& a) {
    const auto axis = a.attrs.get_int("axis", 0);
    std::int64_t offset = 0;
    for (std::size_t k = 0; k < a.input; ++k) offset += a.inputs[k].shape()[static_cast<std::size_t>(axis)];
    return slice(a.dy, axis, offset, offset + a.x().shape()[static_cast<std::size_t>(axis)]);
  });
  rule({"sum_to"}, [](const GradientArgs& a) { return broadcast_to(a.dy, a.x().shape()); });
  rule({"broadcast_to"}, [](const GradientArgs& a) { return sum_to(a.dy, a.x().shape()); });
}

}  // namespace

std::vector<std::pair<std::string, GradientRule>> builtin_gradient_rules() {
  Rules r;
  arithmetic_rules(r);
  nn_rules(r);
  shape_rules(r);
  return std::move(r.list);
}

}  // namespace detail

namespace {

// The gradient of node `y` = op(inputs) with respect to input `i`, given dy: the op's rule in
// the op table (op_registry.h), built-in or registered.
Value input_gradient(Value y, std::size_t i, Value dy) {
  Graph& g = y.graph();
  const Node n = y.node();  // a copy: the rule adds nodes, which may move the node vector
  std::vector<Value> inputs;
  for (int id : n.inputs) inputs.push_back(g.value(id));
  const GradientArgs a{.y = y, .inputs = inputs, .attrs = n.attrs, .input = i, .dy = dy};
  const OpDef* def = find_op(n.op);
  if (def == nullptr || !def->gradient) a.none();
  return def->gradient(a);
}

}  // namespace

std::vector<Value> gradients(Value loss, const std::vector<Value>& wrt, double seed) {
  Graph& g = loss.graph();
  if (!loss.shape().empty()) {
    throw GraphError(fmt::format("the loss must be a scalar; {} is not (reduce it with mean() or sum())", loss.describe()));
  }
  const int end = loss.id() + 1;
  // The backward ops follow the forward ops' dtypes (each gradient cast back to its value's),
  // not a policy of their own.
  auto no_autocast = g.autocast(DType::f32);
  // Which nodes lie on a path from some w to the loss.
  std::vector<bool> depends(static_cast<std::size_t>(end), false);
  for (const Value& w : wrt) {
    if (&w.graph() != &g) throw GraphError("gradients(): a variable belongs to another graph");
    if (w.id() < end) depends[static_cast<std::size_t>(w.id())] = true;
  }
  for (int id = 0; id < end; ++id) {
    if (g.node(id).op == "stop_gradient") continue;  // nothing flows back through it
    for (int in : g.node(id).inputs) {
      if (depends[static_cast<std::size_t>(in)]) depends[static_cast<std::size_t>(id)] = true;
    }
  }
  std::vector<Value> grad(static_cast<std::size_t>(end));
  grad[static_cast<std::size_t>(loss.id())] = g.constant(seed, {}, loss.dtype()).named(fmt::format("d{}", loss.name()));
  for (int id = end - 1; id >= 0; --id) {
    Value dy = grad[static_cast<std::size_t>(id)];
    if (!dy.valid() || !depends[static_cast<std::size_t>(id)]) continue;
    const std::vector<int> inputs = g.node(id).inputs;  // copy: adding nodes may move the vector
    const int first_new = g.size();
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      const auto in = static_cast<std::size_t>(inputs[k]);
      if (!depends[in]) continue;
      Value d = input_gradient(g.value(id), k, dy);
      // A gradient has its value's dtype (under autocast an op may have computed in another).
      if (d.dtype() != g.node(inputs[k]).dtype) d = cast(d, g.node(inputs[k]).dtype);
      grad[in] = grad[in].valid() ? grad[in] + d : d;
    }
    for (int made = first_new; made < g.size(); ++made) g.node_mut(made).grad_of = id;
  }
  std::vector<Value> out;
  for (const Value& w : wrt) out.push_back(w.id() < end ? grad[static_cast<std::size_t>(w.id())] : Value{});
  return out;
}

}  // namespace baton
