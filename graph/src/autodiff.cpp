// Reverse-mode autodiff on the logical graph. Node ids are a topological order (a node's inputs
// always come before it), so one backward sweep in decreasing id order visits every node after
// all of its consumers.
#include "baton/graph/autodiff.h"

#include <fmt/format.h>

#include "baton/graph/ops.h"

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

[[noreturn]] void no_gradient(const Node& n, std::size_t input, const Graph& g) {
  throw GraphError(fmt::format("op '{}' ('{}') has no gradient with respect to its input {} ('{}'), which the loss "
                               "needs to differentiate",
                               n.op, n.name, input, g.node(n.inputs[input]).name));
}

// The gradient of node `y` = op(inputs) with respect to input `i`, given dy.
Value input_gradient(Value y, std::size_t i, Value dy) {
  Graph& g = y.graph();
  const Node n = y.node();  // a copy: the ops below add nodes, which may move the node vector
  const std::string& op = n.op;
  auto in = [&](std::size_t k) { return g.value(n.inputs[k]); };
  Value x = in(i);

  if (op == "cast") return cast(dy, x.dtype());
  if (op == "add") return sum_to(dy, x.shape());
  if (op == "sub") return sum_to(i == 0 ? dy : -dy, x.shape());
  if (op == "mul") return sum_to(dy * in(1 - i), x.shape());
  if (op == "div") {
    if (i == 0) return sum_to(dy / in(1), x.shape());
    return sum_to(-(dy * y / in(1)), x.shape());
  }
  if (op == "scale") return scale(dy, n.attrs.get_double("value", 1.0));
  if (op == "matmul") {
    const bool ta = n.attrs.get_int("trans_a", 0) != 0;
    const bool tb = n.attrs.get_int("trans_b", 0) != 0;
    Value a = in(0), b = in(1);
    const bool shared_b = b.rank() == 2 && a.rank() > 2;
    if (i == 0) {
      if (!ta) return matmul(dy, b, false, !tb);
      if (shared_b) no_gradient(n, i, g);
      return matmul(b, dy, tb, true);
    }
    if (shared_b) {
      if (ta) no_gradient(n, i, g);
      // dB sums over every batch row: fold the batch into the rows first.
      Value a2 = reshape(a, {-1, a.dim(-1)});
      Value dy2 = reshape(dy, {-1, dy.dim(-1)});
      return tb ? matmul(dy2, a2, true, false) : matmul(a2, dy2, true, false);
    }
    return tb ? matmul(dy, a, true, ta) : matmul(a, dy, !ta, false);
  }
  if (op == "relu" || op == "gelu") return add_grad_op(op == "relu" ? "relu_grad" : "gelu_grad", {x, dy}, {}, x);
  if (op == "bias_gelu") {
    // One node for both inputs: d/dx, and its column sums for the bias.
    Value dx = shared_grad_op("bias_gelu_grad", {in(0), in(1), dy}, {}, in(0).shape(), in(0).dtype(), y);
    return i == 0 ? dx : sum_to(dx, x.shape());
  }
  if (op == "attention") {
    // One node gives dq, dk and dv side by side along the last axis; input i's is its slice.
    const std::int64_t d = x.dim(-1);
    Shape packed = x.shape();
    packed.back() *= 3;
    Value grads = shared_grad_op("attention_grad", {in(0), in(1), in(2), y, dy}, n.attrs, packed, x.dtype(), y);
    const auto k = static_cast<std::int64_t>(i);
    return slice(grads, -1, k * d, (k + 1) * d);
  }
  if (op == "tanh" || op == "sigmoid") return add_grad_op(op == "tanh" ? "tanh_grad" : "sigmoid_grad", {y, dy}, {}, x);
  if (op == "exp") return dy * y;
  if (op == "log") return dy / x;  // NaN where x < 0, as the forward
  if (op == "sqrt" || op == "rsqrt") return add_grad_op(op == "sqrt" ? "sqrt_grad" : "rsqrt_grad", {y, dy}, {}, x);
  if (op == "silu") return add_grad_op("silu_grad", {x, dy}, {}, x);
  if (op == "pow") return add_grad_op("pow_grad", {x, dy}, n.attrs, x);
  if (op == "rms_norm") {
    if (i == 0) return add_grad_op("rms_norm_grad", {in(0), in(1), dy}, n.attrs, x);
    return add_grad_op("rms_norm_grad_weight", {in(0), dy}, n.attrs, x);
  }
  if (op == "rope") return add_grad_op("rope_grad", {dy}, n.attrs, x);
  if (op == "softmax" || op == "log_softmax") {
    return add_grad_op(op == "softmax" ? "softmax_grad" : "log_softmax_grad", {y, dy}, {}, x);
  }
  if (op == "softmax_cross_entropy") {
    if (i == 1) no_gradient(n, i, g);
    return add_grad_op("softmax_cross_entropy_grad", {in(0), in(1), dy}, {}, x);
  }
  if (op == "mse") {
    Value d = add_grad_op("mse_grad", {in(0), in(1), dy}, {}, in(0));
    return i == 0 ? d : -d;
  }
  if (op == "reshape") return reshape(dy, x.shape());
  if (op == "transpose") {
    auto perm = std::get<std::vector<std::int64_t>>(n.attrs.values().at("perm"));
    std::vector<std::int64_t> inverse(perm.size());
    for (std::size_t k = 0; k < perm.size(); ++k) inverse[static_cast<std::size_t>(perm[k])] = static_cast<std::int64_t>(k);
    return transpose(dy, inverse);
  }
  if (op == "sum" || op == "mean") {
    auto axes = std::get<std::vector<std::int64_t>>(n.attrs.values().at("axes"));
    Shape kept = x.shape();
    std::int64_t count = 1;
    for (auto a : axes) {
      count *= kept[static_cast<std::size_t>(a)];
      kept[static_cast<std::size_t>(a)] = 1;
    }
    Value d = broadcast_to(dy.shape() == kept ? dy : reshape(dy, kept), x.shape());
    return op == "mean" ? scale(d, 1.0 / static_cast<double>(count)) : d;
  }
  if (op == "layer_norm") return add_grad_op("layer_norm_grad", {x, dy}, Attrs{{"eps", n.attrs.get_double("eps", 1e-5)}}, x);
  if (op == "embedding") {
    if (i == 1) no_gradient(n, i, g);
    return add_grad_op("embedding_grad", {in(1), dy}, n.attrs, x);  // a vocabulary shard's rows
  }
  // The row maximum (input 2 of the stats, 1 of the loss) only shifts the exponents; the loss
  // does not depend on it, and vocab_parallel_cross_entropy passes it through stop_gradient.
  if (op == "vocab_parallel_ce_stats") {
    if (i != 0) no_gradient(n, i, g);
    return add_grad_op("vocab_parallel_ce_stats_grad", {in(0), in(1), in(2), dy}, n.attrs, x);
  }
  if (op == "vocab_parallel_ce_loss") {
    if (i != 0) no_gradient(n, i, g);
    return add_grad_op("vocab_parallel_ce_loss_grad", {in(0), dy}, {}, x);
  }
  if (op == "causal_mask") return add_grad_op("causal_mask", {dy}, Attrs{{"value", 0.0}}, x);
  if (op == "dropout") return add_grad_op("dropout", {dy}, n.attrs, x);
  if (op == "slice") {
    return add_grad_op("slice_grad", {dy}, Attrs{{"axis", n.attrs.get_int("axis", 0)}, {"start", n.attrs.get_int("start", 0)}}, x);
  }
  if (op == "concat") {
    const auto axis = n.attrs.get_int("axis", 0);
    std::int64_t offset = 0;
    for (std::size_t k = 0; k < i; ++k) offset += g.node(n.inputs[k]).shape[static_cast<std::size_t>(axis)];
    return slice(dy, axis, offset, offset + x.shape()[static_cast<std::size_t>(axis)]);
  }
  if (op == "sum_to") return broadcast_to(dy, x.shape());
  if (op == "broadcast_to") return sum_to(dy, x.shape());
  no_gradient(n, i, g);
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
