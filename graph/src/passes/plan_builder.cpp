// What the lowering pass and evaluate() share (lowering.h).
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string_view>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "baton/kernels/ops.h"
#include "lowering.h"

namespace baton::passes::detail {

DType kernel_dtype(const Graph& g, const Node& n) {
  if (is_floating(n.dtype)) return n.dtype;
  for (int in : n.inputs) {
    if (is_floating(g.node(in).dtype)) return g.node(in).dtype;
  }
  return DType::f32;
}

void copy_tensor(const Tensor& from, Tensor& to) {
  if (from.nbytes() != to.nbytes()) {
    throw std::invalid_argument(fmt::format("copy of {} into {}", from.describe(), to.describe()));
  }
  std::memcpy(to.raw(), from.raw(), from.nbytes());
}

std::vector<bool> needed_nodes(const Graph& g, const std::vector<Value>& targets) {
  std::vector<bool> need(static_cast<std::size_t>(g.size()), false);
  for (const Value& t : targets) need[static_cast<std::size_t>(t.id())] = true;
  for (int id = g.size() - 1; id >= 0; --id) {
    if (!need[static_cast<std::size_t>(id)]) continue;
    for (int in : g.node(id).inputs) need[static_cast<std::size_t>(in)] = true;
  }
  return need;
}

std::vector<InPlace> in_place_inputs(const Graph& g, const Node& n, const Placement& where) {
  // The CPU kernels of these ops compute element i of the output from element i of each
  // same-shaped input alone, in one pass (a broadcast operand such as a bias is read, never
  // written over), so the output may share an input's bytes exactly; checked for each op,
  // float and double only (kernels/src/ops_tensor.cpp, ops_nn.cpp, broadcast.h). Not yet:
  // CUDA kernels (not run with aliased operands on a GPU so far) and registered ops (their
  // kernels may not allow it).
  static const std::set<std::string, std::less<>> ops{
      "add",       "sub",          "mul",       "div",       "maximum",      "scale",
      "relu",      "gelu",         "tanh",      "sigmoid",   "relu_grad",    "gelu_grad",
      "tanh_grad", "sigmoid_grad", "bias_gelu", "bias_gelu_grad"};
  std::vector<InPlace> out;
  if (where.device.type != DeviceType::cpu || (n.dtype != DType::f32 && n.dtype != DType::f64) ||
      !ops.contains(n.op))
    return out;
  for (std::size_t i = 0; i < n.inputs.size(); ++i) {
    const Node& in = g.node(n.inputs[i]);
    if (in.shape == n.shape && in.dtype == n.dtype) out.push_back({.output = 0, .input = static_cast<std::uint32_t>(i)});
  }
  return out;
}

Placement PlanBuilder::at(std::uint8_t stream, int place) const {
  Placement p = places[static_cast<std::size_t>(place)];
  p.stream = stream;
  return p;
}

Placement PlanBuilder::host(std::uint8_t stream, int place) const {
  Placement p = at(stream, place);
  if (is_async(p.device.type)) p.device = Device{DeviceType::cpu, p.device.index};
  return p;
}

RegisterIndex PlanBuilder::add_register(const std::string& name, const Shape& shape, DType dtype,
                                        std::int32_t slots) {
  return plan.add_register({.name = named(name), .shape = shape, .dtype = dtype, .slots = slots});
}

RegisterIndex PlanBuilder::node_register(int id, std::int32_t slots) {
  const Node& n = g.node(id);
  RegisterIndex r = add_register(n.name, n.shape, n.dtype, slots);
  reg_of[id] = r;
  return r;
}

RegisterIndex PlanBuilder::input_reg(int id, int in) const {
  if (id > loss_id) {
    if (auto it = backward_reg_of.find(in); it != backward_reg_of.end()) return it->second;
  }
  return reg_of.at(in);
}

void PlanBuilder::op_actor(int id, std::uint8_t stream, std::int32_t slots) {
  const Node& n = g.node(id);
  const ActorRole role = id <= loss_id ? ActorRole::forward : ActorRole::backward;
  if (n.op == "reshape") {
    // A reshape of a register on the same device is a view of it (plan.h): no copy, no bytes
    // of its own. Across devices or ranks it stays a copy, which the copy and transfer passes
    // then move.
    const RegisterIndex in = input_reg(id, n.inputs[0]);
    const ActorIndex producer = plan.registers[in].producer;
    const Placement here = at(stream, place(id));
    if (producer < plan.actors.size() && plan.actors[producer].where.rank == here.rank &&
        plan.actors[producer].where.device == here.device) {
      const RegisterIndex out = node_register(id, slots);
      plan.add_actor({.name = named(n.name),
                      .kind = ActorKind::repeat,
                      .op = "view",
                      .dtype = n.dtype,
                      .where = here,
                      .inputs = {{in}},
                      .outputs = {out},
                      .group = 1,
                      .role = role,
                      .stage = stages == nullptr ? -1 : stage(id)});
      return;
    }
  }
  if (written_by_input.contains(id)) return;  // its register is its input's actor's output
  std::vector<InputPort> inputs;
  for (int in : n.inputs) inputs.push_back({input_reg(id, in)});
  if (auto saved = saved_for(id)) inputs.push_back({*saved});
  std::vector<RegisterIndex> outs;
  if (const std::vector<int> pieces = split_outputs(id); !pieces.empty()) {
    // One register per piece, named and shaped as the slice that reads it, which lowers to nothing.
    for (int slice : pieces) {
      outs.push_back(node_register(slice, slots));
      written_by_input.insert(slice);
    }
    reg_of[id] = outs.front();
  } else {
    outs.push_back(node_register(id, slots));
  }
  const Placement where = at(stream, place(id));
  plan.add_actor({.name = named(n.name),
                  .kind = ActorKind::compute,
                  .op = n.op,
                  .dtype = kernel_dtype(g, n),
                  .where = where,
                  .inputs = std::move(inputs),
                  .outputs = std::move(outs),
                  .first_piece = first_piece,
                  .attrs = n.attrs,
                  .role = role,
                  .stage = stages == nullptr ? -1 : stage(id),
                  .weight_gradient = weight_work != nullptr && (*weight_work)[static_cast<std::size_t>(id)],
                  .in_place = in_place_inputs(g, n, where)});
}

// The ops whose kernels write their output either whole or in pieces along the last axis, one
// output each (kernel_args.h's attention_grad_out): their readers' slices then cost nothing.
struct SplitOp {
  std::string_view op;
  std::size_t pieces;
};
constexpr SplitOp split_ops[] = {{"attention_grad", 3}};

std::vector<int> PlanBuilder::split_outputs(int id) const {
  const Node& n = g.node(id);
  const auto op = std::find_if(std::begin(split_ops), std::end(split_ops), [&](const SplitOp& o) { return o.op == n.op; });
  if (op == std::end(split_ops) || n.shape.empty()) return {};
  const std::size_t last = n.shape.size() - 1;
  std::vector<int> readers;
  for (int c = id + 1; c < g.size(); ++c) {
    const Node& r = g.node(c);
    if (std::find(r.inputs.begin(), r.inputs.end(), id) == r.inputs.end()) continue;
    if (need != nullptr && !(*need)[static_cast<std::size_t>(c)]) continue;
    if (r.op != "slice" || r.inputs.size() != 1 || r.attrs.get_int("axis", -1) != static_cast<std::int64_t>(last) ||
        place(c) != place(id))
      return {};
    readers.push_back(c);
  }
  // Exactly op->pieces slices that cover the axis end to end, each piece once (equal pieces
  // [k w, (k + 1) w) for attention_grad's side-by-side form, q's then k's and v's sizes for its
  // flat one: the kernel checks each output's size).
  if (readers.size() != op->pieces) return {};
  auto start = [&](int c) { return g.node(c).attrs.get_int("start", -1); };
  std::sort(readers.begin(), readers.end(), [&](int a, int b) { return start(a) < start(b); });
  std::int64_t at = 0;
  for (int c : readers) {
    if (start(c) != at || g.node(c).shape[last] < 1) return {};
    at += g.node(c).shape[last];
  }
  if (at != n.shape[last]) return {};
  return readers;
}

// A tensor a forward kernel can write beside its output for the gradient op that reads that
// output, so the backward recomputes nothing (PyTorch's saved tensors): attention's rows'
// log-sum-exp, which attention_grad reads as its last input. The graph has one output per node;
// the saved tensor lives only in the plan: when the gradient actor is lowered, the forward's
// actor (already lowered: ids are topological) gets a second output register, of the forward
// output's slots, so it lives exactly as long as the output the backward reads beside it.
struct SavedTensor {
  std::string_view op, grad_op;
  std::size_t grad_input;  // the gradient op's input that is the forward's output
  Shape (*shape)(const Shape& output);
};
constexpr SavedTensor saved_tensors[] = {{"attention", "attention_grad", 3, attention_stats_shape}};

std::optional<RegisterIndex> PlanBuilder::saved_for(int id) {
  const Node& n = g.node(id);
  for (const SavedTensor& st : saved_tensors) {
    if (n.op != st.grad_op || n.inputs.size() <= st.grad_input) continue;
    const int fwd = n.inputs[st.grad_input];
    const Node& f = g.node(fwd);
    if (f.op != st.op) return std::nullopt;
    if (auto it = saved_reg_of.find(fwd); it != saved_reg_of.end()) return it->second;
    const RegisterIndex out = input_reg(id, fwd);
    const ActorIndex producer = plan.registers[out].producer;
    if (producer >= plan.actors.size() || plan.actors[producer].op != st.op ||
        plan.actors[producer].outputs.size() != 1)
      return std::nullopt;
    // f32 statistics for f32 and the low precisions (cuDNN's and the fused kernels'), f64 for f64.
    const RegisterIndex saved = add_register(f.name + ".saved", st.shape(f.shape),
                                             f.dtype == DType::f64 ? DType::f64 : DType::f32,
                                             plan.registers[out].slots);
    plan.actors[producer].outputs.push_back(saved);
    plan.registers[saved].producer = producer;
    saved_reg_of[fwd] = saved;
    return saved;
  }
  return std::nullopt;
}

void PlanBuilder::source_actor(const std::string& name, const std::string& op, DType dtype,
                               std::vector<RegisterIndex> outputs, std::int64_t pieces,
                               const Placement& where, Attrs attrs, ActorRole role) {
  plan.add_actor({.name = named(name),
                  .kind = ActorKind::source,
                  .op = op,
                  .dtype = dtype,
                  .where = where,
                  .outputs = std::move(outputs),
                  .pieces = pieces,
                  .first_piece = first_piece,
                  .attrs = std::move(attrs),
                  .role = role});
}

std::string unique_name(std::set<std::string>& taken, const std::string& base) {
  std::string name = base;
  for (int k = 2; taken.contains(name); ++k) name = fmt::format("{}.{}", base, k);
  taken.insert(name);
  return name;
}

Plan rebuilt(const Plan& plan, const std::map<ActorIndex, std::vector<ActorDesc>>& replace,
             const std::set<ActorIndex>& drop) {
  Plan out;
  constexpr RegisterIndex none = std::numeric_limits<RegisterIndex>::max();
  std::vector<RegisterIndex> reg_at(plan.registers.size(), none);
  // The registers only the dropped and replaced actors wrote: every output of one that no
  // replacement writes in its place.
  std::set<RegisterIndex> gone, rewritten;
  for (const auto& [i, actors] : replace) {
    for (const ActorDesc& a : actors) rewritten.insert(a.outputs.begin(), a.outputs.end());
  }
  auto unwritten = [&](ActorIndex a) {
    for (RegisterIndex r : plan.actors[a].outputs) {
      if (!rewritten.contains(r)) gone.insert(r);
    }
  };
  for (ActorIndex a : drop) unwritten(a);
  for (const auto& [i, actors] : replace) unwritten(i);
  for (RegisterIndex r = 0; r < plan.registers.size(); ++r) {
    if (gone.contains(r)) continue;
    RegisterDesc d = plan.registers[r];
    d.producer = no_actor;
    d.consumers.clear();
    reg_at[r] = out.add_register(std::move(d));
  }
  auto add = [&](ActorDesc a) {
    for (InputPort& in : a.inputs) in.reg = reg_at.at(in.reg);
    for (RegisterIndex& o : a.outputs) o = reg_at.at(o);
    out.add_actor(std::move(a));
  };
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    if (drop.contains(i)) continue;
    if (auto it = replace.find(i); it != replace.end()) {
      for (const ActorDesc& a : it->second) add(a);
    } else {
      add(plan.actors[i]);
    }
  }
  out.arenas = plan.arenas;
  return out;
}

}  // namespace baton::passes::detail
