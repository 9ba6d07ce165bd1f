// The updates pass (passes.h): the trained weights of one device stepped by one actor, as a
// fused optimizer steps them (PyTorch's foreach and fused Adam, Apex's multi_tensor_apply).
//
// Why. lower gives each trained weight a variable actor that applies its optimizer once its
// summed gradient is in. On a CUDA device that is one launch per weight per step, most of them
// over a bias or a norm's scale of a few thousand elements (the benchmark's GPT has about a
// hundred weights), each with its own read-back of the clipping factor. One actor per device
// steps them all with cuda::adam_step_multi / sgd_step_multi: a few launches and one read-back
// (device_variables.cpp, CudaVariableGroup), the same arithmetic element for element.
//
// What it costs. A device's weights step once all of its gradients of the step are in. On one
// device that is when the backward pass ends anyway: the first layer's gradient, which the next
// step's forward pass needs first, comes last. In a pipeline each device steps its own stage's
// weights (an interleaved schedule's chunks on a device too: the flush at each step's end
// means the first chunk's backward ends the step there). Under dp a device steps after its last
// bucket is reduced instead of bucket by bucket, as DDP followed by optimizer.step() does.
//
// When. Trained variable actors (op "variable.*", lower_variables.cpp) on a CUDA or sim device
// (sim devices run the members' CPU kernels in turn on the sim stream, so CI runs the plan),
// with TrainConfig::multi_tensor_updates, each step's gradient applied at once (weight delay 1:
// not 2BW, a parameter server's staleness, or a parameter server at all, whose workers come and
// go), grouped by (rank, device, stream, dtype, clipping factor), two or more to a group. The
// group's actor reads every member's gradient parts in member order and then the clipping
// factor, and writes every member's weight register, which keep their names and readers.
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "../device_variables.h"
#include "baton/graph/passes.h"
#include "lowering.h"

namespace baton::passes {

namespace {

bool is_clip(const Plan& plan, RegisterIndex r) {
  const ActorIndex p = plan.registers[r].producer;
  return p != no_actor && plan.actors[p].op.starts_with("optim.clip");
}

/// Whether actor `a` is a trained variable the pass may fold (ok), and the register of its
/// clipping factor (its last input) if it reads one.
struct Foldable {
  bool ok = false;
  std::optional<RegisterIndex> clip;
};
Foldable foldable(const Plan& plan, const ActorDesc& a) {
  const bool candidate =
      a.kind == ActorKind::compute && a.role == ActorRole::update && a.op.starts_with("variable.") &&
      !a.inputs.empty() && a.outputs.size() == 1 && is_async(a.where.device.type) && a.pieces == 0 &&
      std::all_of(a.inputs.begin(), a.inputs.end(), [](const InputPort& in) { return in.delay == 1; });
  if (!candidate) return {};
  Foldable f{.ok = true};
  for (std::size_t i = 0; i < a.inputs.size(); ++i) {
    if (!is_clip(plan, a.inputs[i].reg)) continue;
    // The factor is a variable's last input, after at least one gradient part.
    if (i + 1 != a.inputs.size() || i == 0) return {};
    f.clip = a.inputs[i].reg;
  }
  return f;
}

}  // namespace

Plan updates(const Plan& plan, KernelRegistry& kernels, const TrainConfig& cfg) {
  if (!cfg.multi_tensor_updates || cfg.sync == "ps" || detail::weight_delay(cfg) != 1) return plan;
  // (rank, device, stream, dtype, clip register + 1 or 0, first piece) -> members in plan order
  using Key = std::tuple<std::uint16_t, Device, std::uint8_t, DType, std::int64_t, std::int64_t>;
  std::map<Key, std::vector<ActorIndex>> groups;
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    const ActorDesc& a = plan.actors[i];
    const Foldable f = foldable(plan, a);
    if (!f.ok) continue;
    groups[{a.where.rank, a.where.device, a.where.stream, a.dtype, f.clip ? static_cast<std::int64_t>(*f.clip) + 1 : 0,
            a.first_piece}]
        .push_back(i);
  }
  std::erase_if(groups, [](const auto& g) { return g.second.size() < 2; });
  if (groups.empty()) return plan;

  // The members' kernels are made from the registry as it is now (it holds their ops).
  auto registry = std::make_shared<const KernelRegistry>(kernels);
  std::map<ActorIndex, std::vector<ActorDesc>> replace;
  std::set<ActorIndex> drop;
  std::set<std::string> names;
  for (const auto& [key, members] : groups) {
    const ActorDesc& first = plan.actors[members.front()];
    const bool clip = std::get<4>(key) != 0;
    const std::string name =
        detail::unique_name(names, fmt::format("variables.r{}.{}", first.where.rank, first.where.device.str()));
    ActorDesc group{.name = name,
                    .op = name,
                    .dtype = first.dtype,
                    .where = first.where,
                    .first_piece = first.first_piece,
                    .stops_when_unread = false,
                    .role = ActorRole::update,
                    .stage = first.stage};
    std::vector<baton::detail::GroupMember> folded;
    std::map<MemoryCategory, std::int64_t> kept;
    for (ActorIndex m : members) {
      const ActorDesc& a = plan.actors[m];
      const std::size_t parts = a.inputs.size() - (clip ? 1 : 0);
      group.inputs.insert(group.inputs.end(), a.inputs.begin(), a.inputs.begin() + static_cast<std::ptrdiff_t>(parts));
      group.outputs.push_back(a.outputs[0]);
      if (a.stage != group.stage) group.stage = -1;  // a device's chunks of an interleaved pipeline
      for (const KeptBytes& k : a.kept) {
        // On CUDA the group applies the clipping factor inside the step: no scaled copy of the
        // gradient (a sim device runs the CPU's kernels, which keep theirs).
        if (k.category == MemoryCategory::gradients && first.where.device.type == DeviceType::cuda) continue;
        kept[k.category] += k.bytes;
      }
      folded.push_back({a.name, a.op, parts});
      drop.insert(m);
    }
    if (clip) group.inputs.push_back(plan.actors[members.front()].inputs.back());
    for (const auto& [category, bytes] : kept) group.kept.push_back({category, bytes});
    // A sim device runs the CPU kernel on its stream (KernelRegistry::create).
    const DeviceType on = first.where.device.type == DeviceType::cuda ? DeviceType::cuda : DeviceType::cpu;
    kernels.add(name, on, first.dtype, baton::detail::variable_group(registry, std::move(folded), clip));
    // The group takes its last member's place in the plan.
    drop.erase(members.back());
    replace[members.back()] = {std::move(group)};
  }
  return detail::rebuilt(plan, replace, drop);
}

}  // namespace baton::passes
