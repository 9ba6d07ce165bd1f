// The tp_collectives pass (passes.h): tensor parallelism's partial sums as NCCL all-reduces
// where the shards are GPUs.
//
// shard_graph sums the shards' partial products as a chain of adds (sharding.cpp, marked
// "tp_sum" k of "tp"): shard 1 adds shard 0's part to its own, shard 2 adds its own to that,
// and so on; the sum is one tensor on the last shard that every reader reads. device_copies
// then copies each part to the next shard's device and the sum to each other shard's device,
// and between ranks every one of those goes through host memory. Where every shard is a GPU
// of its own, the chain becomes one NCCL all-reduce, as Megatron's row-parallel layers do: one
// nccl.allreduce actor per shard reads that shard's part and writes the sum on its own device,
// and each reader of the sum reads the copy on its own device (a reader on none of them, the
// last shard's). TrainConfig::collectives decides: "actors" keeps the chains, "auto" converts
// them where every shard is on a CUDA device of its own and baton has NCCL, "nccl" converts
// every chain or says why it cannot. On `sim` devices, with "nccl" only, the sim's NCCL
// (kernels/src/sim_nccl.cpp) stands in, so that CI runs the rewrite and its order.
//
// Order. NCCL pairs the calls on a communicator by their order, and a call that waits for its
// peers holds its stream. So the all-reduces run on a stream of their own (tp_nccl_stream), in
// a lane per (rank, device) that walks them in one order on every shard: the actors are added
// in plan order, all of one sum's members at the sum's place, and the lanes pass gives them
// their stage's schedule (a forward's sums with that micro-batch's forward, a backward's with
// its backward) and ranks in plan order, the same sequence on every member. Without the lanes
// pass (one stage, no memory plan) the lane this pass gives stands: each micro-batch's forward
// sums, then its backward sums.
//
// Sums. NCCL adds in its own order. For two shards that is the chain's sum (a + b = b + a);
// for more the last bits may differ from the chain's. The sim's NCCL adds in member order, the
// chain's order, so the sim runs match the CPU's bit for bit.
//
// Not converted: a chain whose parts share a device or a rank's device with another tp group
// (two communicators on one stream could wait for each other), dtypes NCCL's kernels lack.
// Reduce-scatters (sequence parallelism's sums, split on an axis) stay chains.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <variant>

#include <fmt/format.h>

#include "baton/graph/collectives.h"
#include "baton/graph/passes.h"
#include "baton/kernels/nccl.h"
#include "lowering.h"

namespace baton::passes {

namespace {

struct Chain {
  std::vector<ActorIndex> adds;        // link 1 .. tp-1, the last writes the sum
  std::vector<RegisterIndex> parts;    // shard k's part, k = 0 .. tp-1
  std::vector<Placement> places;       // where each part is written (stream: tp_nccl_stream)
};

std::int64_t link_of(const ActorDesc& a) {
  if (a.kind != ActorKind::compute || a.op != "add" || a.inputs.size() != 2 || a.outputs.size() != 1) return 0;
  return a.attrs.get_int("tp_sum", 0);
}

/// The chain whose last add is `last`, or why there is none.
std::variant<Chain, std::string> chain_ending_at(const Plan& plan, ActorIndex last) {
  const ActorDesc& end = plan.actors[last];
  const std::int64_t tp = end.attrs.get_int("tp", 0);
  Chain c;
  c.adds.resize(static_cast<std::size_t>(tp - 1));
  c.parts.resize(static_cast<std::size_t>(tp));
  ActorIndex at = last;
  for (std::int64_t k = tp - 1; k >= 1; --k) {
    const ActorDesc& a = plan.actors[at];
    if (link_of(a) != k || a.attrs.get_int("tp", 0) != tp) return "its adds are not one chain";
    if (a.inputs[0].delay != 0 || a.inputs[1].delay != 0) return "an add reads an earlier piece";
    c.adds[static_cast<std::size_t>(k - 1)] = at;
    c.parts[static_cast<std::size_t>(k)] = a.inputs[1].reg;
    const RegisterIndex so_far = a.inputs[0].reg;
    if (k == 1) {
      c.parts[0] = so_far;
      break;
    }
    const RegisterDesc& r = plan.registers[so_far];
    if (r.consumers.size() != 1 || r.producer >= plan.actors.size()) return "a partial sum has other readers";
    at = r.producer;
  }
  for (RegisterIndex part : c.parts) {
    const ActorIndex p = plan.registers[part].producer;
    if (p >= plan.actors.size()) return "a part has no producer";
    Placement where = plan.actors[p].where;
    where.stream = detail::tp_nccl_stream;
    c.places.push_back(where);
  }
  return c;
}

/// Why NCCL cannot sum this chain's parts (empty: it can).
std::string refusal(const Plan& plan, const KernelRegistry& kernels, const Chain& c, const TrainConfig& cfg) {
  const DeviceType type = c.places[0].device.type;
  const bool same_type = std::all_of(c.places.begin(), c.places.end(),
                                     [&](const Placement& p) { return p.device.type == type; });
  if (!same_type || (type != DeviceType::cuda && type != DeviceType::sim)) {
    return "its shards are not all on CUDA devices";
  }
  if (type == DeviceType::sim && cfg.collectives != "nccl") return "sim devices take NCCL's stand-in only when asked";
  if (type == DeviceType::cuda && !nccl::built_with_nccl()) return "baton was built without NCCL";
  for (std::size_t i = 0; i < c.places.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (c.places[i].rank == c.places[j].rank && c.places[i].device == c.places[j].device) {
        return fmt::format("shards {} and {} are both on rank {} {} (NCCL needs one GPU per member)", j, i,
                           c.places[i].rank, c.places[i].device.str());
      }
    }
  }
  const DType dt = plan.registers[c.parts[0]].dtype;
  if (!kernels.contains("nccl.allreduce", type, dt)) return fmt::format("NCCL has no {} all-reduce here", name(dt));
  return "";
}

std::string group_of(const Chain& c) {
  std::string g = "tp";
  for (const Placement& p : c.places) g += fmt::format(".r{}{}", p.rank, p.device.str());
  return g;
}

}  // namespace

Plan tp_collectives(const Plan& plan, const KernelRegistry& kernels, const TrainConfig& cfg) {
  if (cfg.tp < 2 || cfg.collectives == "actors") return plan;
  std::vector<std::pair<ActorIndex, Chain>> chains;
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    const ActorDesc& a = plan.actors[i];
    const std::int64_t k = link_of(a);
    if (k < 1 || k + 1 != a.attrs.get_int("tp", 0)) continue;
    auto c = chain_ending_at(plan, i);
    std::string why = std::holds_alternative<std::string>(c) ? std::get<std::string>(c)
                                                              : refusal(plan, kernels, std::get<Chain>(c), cfg);
    if (!why.empty()) {
      if (cfg.collectives == "nccl") {
        throw GraphError(fmt::format("collectives 'nccl': the tensor-parallel sum '{}' cannot be an NCCL all-reduce: {} "
                                     "(use --collectives auto or actors)",
                                     plan.registers[a.outputs[0]].name, why));
      }
      continue;
    }
    chains.emplace_back(i, std::get<Chain>(std::move(c)));
  }
  // A device in two groups keeps its chains: two communicators' calls on one stream would have
  // to come in one order on every member of both.
  std::map<std::pair<std::uint16_t, Device>, std::set<std::string>> groups_at;
  for (const auto& [i, c] : chains) {
    for (const Placement& p : c.places) groups_at[{p.rank, p.device}].insert(group_of(c));
  }
  std::erase_if(chains, [&](const std::pair<ActorIndex, Chain>& e) {
    const bool shared = std::any_of(e.second.places.begin(), e.second.places.end(), [&](const Placement& p) {
      return groups_at.at({p.rank, p.device}).size() > 1;
    });
    if (shared && cfg.collectives == "nccl") {
      throw GraphError(fmt::format("collectives 'nccl': the tensor-parallel sum '{}' has a device that another "
                                   "tensor-parallel group uses too (use --collectives auto or actors)",
                                   plan.registers[plan.actors[e.first].outputs[0]].name));
    }
    return shared;
  });
  if (chains.empty()) return plan;

  Plan work = plan;
  std::map<ActorIndex, std::vector<ActorDesc>> replace;
  std::set<ActorIndex> drop;
  std::map<std::int32_t, std::int32_t> in_lane;  // the fallback lanes' ranks so far
  for (const auto& [last, c] : chains) {
    const ActorDesc end = plan.actors[last];
    const RegisterDesc& sum = plan.registers[end.outputs[0]];
    std::string base = sum.name;
    if (auto at = base.find(".allreduce"); at != std::string::npos) base.erase(at, std::string_view(".allreduce").size());
    std::vector<AllReduceMember> members;
    for (std::size_t k = 0; k < c.parts.size(); ++k) members.push_back({c.places[k], c.parts[k], fmt::format(".tp{}", k)});
    const ActorIndex first_new = work.actors.size();
    const std::vector<RegisterIndex> out =
        add_nccl_allreduce(work, base, members, sum.shape, sum.dtype, sum.slots, group_of(c));
    std::vector<ActorDesc>& at = replace[last];
    for (ActorIndex n = first_new; n < work.actors.size(); ++n) {
      ActorDesc a = work.actors[n];
      a.role = end.role;
      a.stage = end.stage;
      const std::int32_t lane = 2 * detail::nccl_lane_base + a.where.rank * 256 + a.where.device.code();
      a.order = ActOrder{.lane = lane,
                         .units = {end.role == ActorRole::forward ? 0 : 1},
                         .period = 2,
                         .rank = in_lane[lane]++};
      at.push_back(std::move(a));
      drop.insert(n);
    }
    for (ActorIndex add : c.adds) {
      if (add != last) drop.insert(add);
    }
    // Each reader of the sum reads the copy on its own device.
    for (ActorIndex r : sum.consumers) {
      const ActorDesc& reader = plan.actors[r];
      RegisterIndex mine = out.back();
      for (std::size_t k = 0; k < c.places.size(); ++k) {
        if (c.places[k].rank == reader.where.rank && c.places[k].device == reader.where.device) mine = out[k];
      }
      for (InputPort& in : work.actors[r].inputs) {
        if (in.reg == end.outputs[0]) in.reg = mine;
      }
    }
  }
  // `work` has the readers' new ports, and the appended actors, dropped, at their sums' places.
  return detail::rebuilt(work, replace, drop);
}

}  // namespace baton::passes
