// The SBP sharding pass: which tensor-parallel shard computes each node (passes.h).
#include <algorithm>

#include <fmt/format.h>

#include "baton/graph/passes.h"

namespace baton::passes {

Shards sbp(const Graph& g, const Differentiated& d, int tp) {
  Shards out{.tp = tp};
  if (tp <= 1) return out;
  const int loss_id = d.loss.id();
  out.of.assign(static_cast<std::size_t>(g.size()), 0);
  bool any = false;
  for (int id = 0; id < g.size(); ++id) {
    if (!d.need[static_cast<std::size_t>(id)]) continue;
    const Node& n = g.node(id);
    if (n.tp_shard >= tp) {
      throw GraphError(
          fmt::format("'{}' is on tensor-parallel shard {} but tp is {}", n.name, n.tp_shard, tp));
    }
    if (id <= loss_id || n.tp_shard >= 0) {
      out.of[static_cast<std::size_t>(id)] = std::max(0, n.tp_shard);
      any = any || n.tp_shard > 0;
    } else if (n.grad_of >= 0 && n.grad_of < id) {
      // The backward step of a forward op runs on that op's shard: the gradients of shard k's
      // weights and activations are computed where they live (dy comes to them).
      out.of[static_cast<std::size_t>(id)] = out.of[static_cast<std::size_t>(n.grad_of)];
    } else {
      int s = 0;
      for (int in : n.inputs) s = std::max(s, out.of[static_cast<std::size_t>(in)]);
      out.of[static_cast<std::size_t>(id)] = s;
    }
  }
  if (!any) {
    throw GraphError(fmt::format(
        "tp is {} but no node of the model is on a shard above 0 (annotate its weights with "
        "sbp::split and shard it with shard_graph, as models::mlp does, or build it with "
        "Graph::shard scopes, as models::gpt does)",
        tp));
  }
  return out;
}

std::string Shards::to_text(const Graph& g, const Differentiated& d) const {
  std::string out = fmt::format("tp {}\n", tp);
  for (int id = 0; id < g.size(); ++id) {
    if (d.need[static_cast<std::size_t>(id)])
      out += fmt::format("{} shard={}\n", g.node(id).name, at(id));
  }
  return out;
}

}  // namespace baton::passes
