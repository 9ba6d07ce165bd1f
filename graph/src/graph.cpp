#include "baton/graph/graph.h"

#include <fmt/format.h>

#include "baton/graph/ops.h"

namespace baton {

Graph& Value::graph() const {
  if (graph_ == nullptr) throw GraphError("use of an invalid (default-constructed) Value");
  return *graph_;
}
const Node& Value::node() const { return graph().node(id_); }

std::int64_t Value::dim(int i) const {
  const auto& s = shape();
  int r = static_cast<int>(s.size());
  int k = i < 0 ? i + r : i;
  if (k < 0 || k >= r) throw GraphError(fmt::format("dimension {} of {} does not exist", i, describe()));
  return s[static_cast<std::size_t>(k)];
}

Value Value::named(std::string name) const {
  Graph& g = graph();
  if (g.find(name).valid() && g.find(name).id() != id_) {
    throw GraphError(fmt::format("cannot rename '{}' to '{}': the name is taken", this->name(), name));
  }
  g.node_mut(id_).name = std::move(name);
  return *this;
}

std::string Value::describe() const {
  if (!valid()) return "<invalid>";
  return fmt::format("{} {}{}", name(), baton::name(dtype()), to_string(shape()));
}

Graph::Autocast Graph::autocast(DType low) {
  if (low != DType::bf16 && low != DType::f32) {
    throw GraphError(fmt::format("autocast to {}: bf16, or f32 for none", name(low)));
  }
  return Autocast(*this, low == DType::f32 ? std::nullopt : std::optional<DType>(low));
}

Value Graph::cast_once(Value v, DType to) {
  if (v.dtype() == to) return v;
  const auto key = std::make_pair(v.id(), to);
  if (auto it = casts_.find(key); it != casts_.end()) return value(it->second);
  Value c = cast(v, to);
  casts_[key] = c.id();
  return c;
}

std::string Graph::unique_name(const std::string& base) {
  std::string n;
  do {
    n = fmt::format("{}_{}", base, counter_++);
  } while (find(n).valid());
  return n;
}

Value Graph::find(const std::string& name) {
  for (int i = 0; i < size(); ++i) {
    if (nodes_[static_cast<std::size_t>(i)].name == name) return Value(this, i);
  }
  return {};
}

Value Graph::add(std::string op, std::vector<Value> inputs, Attrs attrs, Shape shape, DType dtype) {
  Node n;
  for (const Value& v : inputs) {
    if (!v.valid() || &v.graph() != this) {
      throw GraphError(fmt::format("{}: an input belongs to another graph or is invalid", op));
    }
    n.inputs.push_back(v.id());
  }
  n.name = unique_name(op);
  n.op = std::move(op);
  n.attrs = std::move(attrs);
  n.shape = std::move(shape);
  n.dtype = dtype;
  n.tp_shard = shard_;
  n.block = block_;
  n.attention_core = attention_core_;
  (void)numel(n.shape);  // rejects negative extents and overflow
  nodes_.push_back(std::move(n));
  return Value(this, size() - 1);
}

Value Graph::input(std::string name, Shape shape, DType dtype) {
  if (find(name).valid()) throw GraphError(fmt::format("input '{}': the name is taken", name));
  Value v = add("input", {}, {}, std::move(shape), dtype);
  return v.named(std::move(name));
}

Value Graph::variable(std::string name, Shape shape, Init init, DType dtype) {
  if (find(name).valid()) throw GraphError(fmt::format("variable '{}': the name is taken", name));
  if (dtype != DType::f32 && dtype != DType::f64) {
    throw GraphError(fmt::format("variable '{}': weights are f32 or f64, not {}", name, baton::name(dtype)));
  }
  Value v = add("variable", {}, {}, std::move(shape), dtype);
  Node& n = node_mut(v.id());
  n.init = init;
  n.trainable = true;
  return v.named(std::move(name));
}

Value Graph::variable(std::string name, Shape shape, Init init, Sbp sbp, DType dtype) {
  return set_sbp(variable(std::move(name), std::move(shape), init, dtype), sbp);
}

Value Graph::set_sbp(Value v, Sbp s) {
  if (!v.valid() || &v.graph() != this) throw GraphError("set_sbp: the value belongs to another graph or is invalid");
  if (s.is_split()) {
    const int r = v.rank();
    const int a = s.axis < 0 ? s.axis + r : s.axis;
    if (a < 0 || a >= r) {
      throw GraphError(fmt::format("set_sbp({}, {}): the tensor has no axis {} (its rank is {})", v.describe(),
                                   to_string(s), s.axis, r));
    }
    s.axis = a;
  } else {
    s.axis = -1;
  }
  node_mut(v.id()).sbp = s;
  return v;
}

Value Graph::constant(double value, Shape shape, DType dtype) {
  return add("fill", {}, Attrs{{"value", value}}, std::move(shape), dtype);
}

std::vector<Value> Graph::variables() {
  std::vector<Value> out;
  for (int i = 0; i < size(); ++i) {
    if (node(i).op == "variable") out.emplace_back(this, i);
  }
  return out;
}

std::vector<Value> Graph::inputs() {
  std::vector<Value> out;
  for (int i = 0; i < size(); ++i) {
    if (node(i).op == "input") out.emplace_back(this, i);
  }
  return out;
}

std::string Graph::to_text() const {
  std::string out;
  for (const Node& n : nodes_) {
    std::string args;
    for (int in : n.inputs) args += fmt::format("{}{}", args.empty() ? "" : ", ", node(in).name);
    std::string attrs = n.attrs.str();
    std::string extra;
    if (n.sbp) extra += fmt::format(" sbp={}", to_string(*n.sbp));
    if (n.part_of) {
      extra += fmt::format(" (part {}/{} of {}{} on axis {})", n.part_of->index, n.part_of->parts, n.part_of->name,
                           to_string(n.part_of->shape), n.part_of->axis);
    }
    out += fmt::format("{} = {}({}){} {}{}{}\n", n.name, n.op, args, attrs.empty() ? "" : " " + attrs,
                       name(n.dtype), to_string(n.shape), extra);
  }
  return out;
}

std::string Graph::to_dot() const {
  std::string out = "digraph graph_ {\n  rankdir=TB;\n  node [fontname=\"monospace\"];\n";
  for (int i = 0; i < size(); ++i) {
    const Node& n = node(i);
    bool leaf = n.op == "input" || n.op == "variable" || n.op == "fill";
    out += fmt::format("  n{} [label=\"{}\\n{} {}{}\", shape={}];\n", i, n.name, n.op, name(n.dtype),
                       to_string(n.shape), leaf ? "ellipse" : "box");
    for (int in : n.inputs) out += fmt::format("  n{} -> n{};\n", in, i);
  }
  out += "}\n";
  return out;
}

}  // namespace baton
