// The autodiff pass: the rules live in graph/src/autodiff.cpp (gradients()); this pass picks
// what to differentiate and what the plan needs.
#include <fmt/format.h>

#include "baton/graph/autodiff.h"
#include "lowering.h"

namespace baton::passes {

void detail::check_loss(const Graph& g, const Value& loss) {
  if (!loss.valid() || &loss.graph() != &g)
    throw GraphError("compile_training: the loss is not a value of this graph");
  if (!loss.shape().empty())
    throw GraphError(fmt::format("the loss must be a scalar; {} is not", loss.describe()));
}

Differentiated autodiff(Graph& g, Value loss, const TrainConfig& cfg) {
  detail::check_loss(g, loss);
  const int loss_id = loss.id();
  std::vector<Value> vars;
  for (Value v : g.variables()) {
    if (v.node().trainable && v.id() < loss_id) vars.push_back(v);
  }
  // The mean loss over the global batch: dp x M micro-batches.
  const double scale = 1.0 / static_cast<double>(cfg.microbatches * cfg.dp);
  std::vector<Value> grads = gradients(loss, vars, scale);
  Differentiated d{.loss = loss};
  std::vector<Value> targets{loss};
  for (std::size_t i = 0; i < vars.size(); ++i) {
    if (grads[i].valid()) {
      targets.push_back(grads[i]);
      d.trained.emplace_back(vars[i], grads[i]);
    }
  }
  d.need = detail::needed_nodes(g, targets);
  return d;
}

std::string Differentiated::to_text() const {
  const Graph& g = loss.graph();
  std::string out;
  for (int id = 0; id < g.size(); ++id) {
    if (!need[static_cast<std::size_t>(id)]) continue;
    const Node& n = g.node(id);
    std::string args;
    for (int in : n.inputs) args += fmt::format("{}{}", args.empty() ? "" : ", ", g.node(in).name);
    const std::string attrs = n.attrs.str();
    out +=
        fmt::format("{} = {}({}){} {}{}{}\n", n.name, n.op, args, attrs.empty() ? "" : " " + attrs,
                    name(n.dtype), to_string(n.shape), id == loss.id() ? " (loss)" : "");
  }
  for (const auto& [v, grad] : trained)
    out += fmt::format("trained {} <- {}\n", v.name(), grad.name());
  return out;
}

}  // namespace baton::passes
