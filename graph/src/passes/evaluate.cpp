// evaluate(): the graph run once, without training, on a plan of one device.
#include <fmt/format.h>

#include "baton/actors/runtime.h"
#include "lowering.h"

namespace baton {

using passes::detail::ConstantSource;
using passes::detail::copy_tensor;
using passes::detail::PlanBuilder;

std::vector<Tensor> evaluate(Graph& g, const std::map<std::string, Tensor>& feeds,
                             const std::vector<Value>& fetches, const ParameterStore& params) {
  std::vector<bool> need = passes::detail::needed_nodes(g, fetches);
  Plan plan;
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  PlanBuilder b{g, plan, kernels};
  for (int id = 0; id < g.size(); ++id) {
    if (!need[static_cast<std::size_t>(id)]) continue;
    const Node& n = g.node(id);
    if (n.op == "input" || n.op == "variable") {
      Tensor value;
      if (n.op == "input") {
        auto it = feeds.find(n.name);
        if (it == feeds.end())
          throw GraphError(fmt::format("evaluate: input '{}' is not fed", n.name));
        value = it->second;
      } else {
        value = params.at(n.name);
      }
      if (value.shape() != n.shape || value.dtype() != n.dtype) {
        throw GraphError(fmt::format("evaluate: '{}' is {}{} but was given {}", n.name,
                                     name(n.dtype), to_string(n.shape), value.describe()));
      }
      std::string op = "const." + n.name;
      b.kernels.add(op, DeviceType::cpu, n.dtype, [value](const KernelConfig&) {
        return std::make_unique<ConstantSource>(value);
      });
      b.source_actor(op, op, n.dtype, {b.node_register(id, 1)}, 1, b.at(0));
    } else if (n.op == "fill" && n.inputs.empty()) {
      b.source_actor(n.name, "fill", n.dtype, {b.node_register(id, 1)}, 1, b.at(0), n.attrs);
    } else {
      b.op_actor(id, 0, 1);
    }
  }
  auto results = std::make_shared<std::vector<Tensor>>(fetches.size());
  for (std::size_t i = 0; i < fetches.size(); ++i) {
    const Node& n = fetches[i].node();
    std::string op = fmt::format("fetch.{}", i);
    b.kernels.add_fn(op, DeviceType::cpu, n.dtype, [results, i](KernelContext& ctx) {
      const Tensor& t = *ctx.inputs[0];
      Tensor copy = Tensor::empty(t.shape(), t.dtype());
      copy_tensor(t, copy);
      (*results)[i] = std::move(copy);
    });
    b.plan.add_actor(
        {.name = op, .op = op, .dtype = n.dtype, .inputs = {{b.reg_of.at(fetches[i].id())}}});
  }
  // The ops in one lane, in topological order, so that the memory pass can pack their
  // registers: an evaluation of many rows needs its activations only while they are read.
  std::int32_t rank = 0;
  for (ActorDesc& a : plan.actors) {
    if (a.kind == ActorKind::compute && !a.outputs.empty())
      a.order = ActOrder{.lane = 0, .units = {0}, .period = 1, .rank = rank++};
  }
  plan = passes::memory(plan, TrainConfig{});
  RuntimeSettings s;
  s.mode = ExecutionMode::deterministic;
  Runtime rt(std::move(plan), kernels, s);
  rt.run();
  return std::move(*results);
}

}  // namespace baton
