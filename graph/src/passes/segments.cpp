// The segments pass (passes.h): a device's runs of ops as one actor each, whose act is a CUDA
// graph (segments.h), as PyTorch's CUDA graphs and Megatron's full-iteration graphs capture a
// step.
//
// Why. Each op of a training step is an actor on its device's stream: an act is a handshake
// with its neighbours on the host and a launch or a few. At small batches the GPU runs a launch
// in less time than the host takes to enqueue it, and the step is as slow as the host. The
// plan is static, so the same runs of launches come every step: one actor per run, its act
// launched as one captured graph, costs one handshake and one launch.
//
// Which actors. Compute actors of the forward or backward pass on a CUDA or sim device, reading
// nothing late (no delay), with no lane yet (the lanes pass, after this one, orders the
// segments as it ordered their members), not copies, collectives (NCCL waits for its peers),
// the loss's report, or ops that are functions of the piece number (dropout), which a replay
// would repeat. A run is a set of such actors of one stream, one pass (forward, backward or
// weight gradients), one pipeline stage and one first piece, taken in a topological order:
//
//   - it ends after an actor one of whose outputs is read off its stream (a copy to the host or
//     to another device, a collective, another rank): what waits there (the loss's report, the
//     next stage, a gradient's all-reduce) does not wait for the rest of the run;
//   - an actor joins only if nothing it reads depends on the run through an actor outside it
//     (otherwise the run would wait for itself: a deadlock);
//   - a run of one actor stays as it was.
//
// What stays. Every register keeps its name, slots and outside readers. The segment lists
// the step of its act (the member's kernel) that writes each output and last reads each input
// and output (ActorDesc::steps), so the memory pass times each register at its kernel, not at
// the act: what one member leaves behind shares bytes with what a later one writes, as between
// the actors before. A member's permission to write in place of a segment input
// (ActorDesc::in_place) carries over where no later member reads those bytes; in place of an
// earlier member's output it is lost (a slot more while the two kernels run). A member reading
// an earlier member's output through a view (a reshape without a copy) reads it through a
// view of the output in the act; a view actor only members read goes. The order of acts within
// a lane is the segments' (each where its members were). Off (TrainConfig::cuda_graphs false),
// the plan is unchanged.
#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "../segments.h"
#include "baton/graph/passes.h"
#include "lowering.h"

namespace baton::passes {

namespace {

bool member_ok(const Plan& plan, const ActorDesc& a) {
  if (a.kind != ActorKind::compute || !on_stream(a) || a.outputs.empty()) return false;
  if (a.role != ActorRole::forward && a.role != ActorRole::backward) return false;
  if (a.copy != CopyDirection::none || a.reports_loss || a.at_end || a.memory || a.order.lane >= 0 ||
      !a.order.lead.empty()) {
    return false;
  }
  // Collectives (NCCL's wait for their peers), point-to-point moves, ZeRO's lanes, and dropout,
  // whose mask is a function of the piece number a captured graph would replay.
  if (a.op.starts_with("nccl.") || a.op.starts_with("p2p.") || a.op.starts_with("zero") || a.op == "dropout") {
    return false;
  }
  for (const InputPort& in : a.inputs) {
    if (in.delay != 0) return false;
  }
  for (RegisterIndex r : a.outputs) {
    if (plan.registers[r].kernel_memory) return false;
  }
  return true;
}

/// Whether some reader of `reg` (or of a view of it) is not a stream actor at `where`.
bool read_elsewhere(const Plan& plan, RegisterIndex reg, const Placement& where, std::size_t depth = 0) {
  if (depth > plan.actors.size()) return true;
  for (ActorIndex c : plan.registers[reg].consumers) {
    const ActorDesc& a = plan.actors[c];
    if (is_view(a)) {
      if (a.outputs.size() != 1 || read_elsewhere(plan, a.outputs[0], where, depth + 1)) return true;
      continue;
    }
    if (!on_stream(a) || !(a.where == where)) return true;
  }
  return false;
}

/// The register whose bytes `reg` are through view actors (a reshape without a copy), or itself.
RegisterIndex through_views(const Plan& plan, RegisterIndex reg) {
  for (std::size_t depth = 0; depth <= plan.actors.size(); ++depth) {
    const ActorIndex p = plan.registers[reg].producer;
    if (p == no_actor || !is_view(plan.actors[p])) break;
    reg = plan.actors[p].inputs[0].reg;
  }
  return reg;
}

/// The producers of what `a` reads now (no delay); with `through_view`, looking through views
/// (which only alias: a member reads the bytes of an earlier member's output through a view
/// inside the segment's act, not through the view actor).
std::vector<ActorIndex> predecessors(const Plan& plan, ActorIndex a, bool through_view = false) {
  std::vector<ActorIndex> out;
  for (const InputPort& in : plan.actors[a].inputs) {
    if (in.delay != 0) continue;
    const ActorIndex p = plan.registers[through_view ? through_views(plan, in.reg) : in.reg].producer;
    if (p != no_actor && p != a) out.push_back(p);
  }
  return out;
}

/// The actors in a topological order of their undelayed reads, ties in plan order; empty if
/// there is none (a cycle without a delay, which validate() refuses anyway).
std::vector<ActorIndex> topological(const Plan& plan) {
  const std::size_t n = plan.actors.size();
  std::vector<std::vector<ActorIndex>> next(n);
  std::vector<std::size_t> waiting(n, 0);
  for (ActorIndex a = 0; a < n; ++a) {
    for (ActorIndex p : predecessors(plan, a)) {
      next[p].push_back(a);
      ++waiting[a];
    }
  }
  std::priority_queue<ActorIndex, std::vector<ActorIndex>, std::greater<>> ready;
  for (ActorIndex a = 0; a < n; ++a) {
    if (waiting[a] == 0) ready.push(a);
  }
  std::vector<ActorIndex> out;
  while (!ready.empty()) {
    const ActorIndex a = ready.top();
    ready.pop();
    out.push_back(a);
    for (ActorIndex c : next[a]) {
      if (--waiting[c] == 0) ready.push(c);
    }
  }
  if (out.size() != n) out.clear();
  return out;
}

/// The plan with its actors in a topological order (ties in their order now): a segment takes
/// its last member's place, and an outside actor that read an earlier member comes after it.
Plan reordered(const Plan& plan) {
  const std::vector<ActorIndex> order = topological(plan);
  if (order.empty()) return plan;
  Plan out;
  for (RegisterDesc r : plan.registers) {
    r.producer = no_actor;
    r.consumers.clear();
    out.add_register(std::move(r));
  }
  for (ActorIndex a : order) out.add_actor(plan.actors[a]);
  out.arenas = plan.arenas;
  return out;
}

/// What may share a run with an actor: its stream, its pass, its stage, its first piece.
using RunKey = std::tuple<std::uint16_t, Device, std::uint8_t, ActorRole, bool, std::int32_t, std::int64_t>;
RunKey run_key(const ActorDesc& a) {
  return {a.where.rank, a.where.device, a.where.stream, a.role, a.weight_gradient, a.stage, a.first_piece};
}

/// The runs of member_ok actors to fold (two or more each, in topological order).
std::vector<std::vector<ActorIndex>> find_runs(const Plan& plan, const std::vector<ActorIndex>& order) {
  struct Open {
    std::int64_t id = -1;
    RunKey key;
    std::vector<ActorIndex> members;
    std::set<ActorIndex> reached;  // outside actors that depend on a member
  };
  std::vector<std::vector<ActorIndex>> runs;
  std::map<std::tuple<std::uint16_t, Device, std::uint8_t>, Open> open;  // by stream
  std::vector<std::int64_t> run_of(plan.actors.size(), -1);
  std::int64_t next_id = 0;
  auto close = [&](Open& o) {
    if (o.members.size() >= 2) runs.push_back(o.members);
    o = Open{};
  };
  for (ActorIndex a : order) {
    const ActorDesc& d = plan.actors[a];
    if (is_view(d)) continue;  // its readers look through it
    const std::vector<ActorIndex> preds = predecessors(plan, a, /*through_view=*/true);
    Open* joined = nullptr;
    if (member_ok(plan, d)) {
      Open& o = open[{d.where.rank, d.where.device, d.where.stream}];
      const bool cut = std::any_of(preds.begin(), preds.end(), [&](ActorIndex p) { return o.reached.contains(p); });
      if (o.members.empty() || o.key != run_key(d) || cut) {
        close(o);
        o.id = next_id++;
        o.key = run_key(d);
      }
      o.members.push_back(a);
      run_of[a] = o.id;
      joined = &o;
    }
    // Every other open run that `a` depends on (through a member or an actor that does).
    for (auto& entry : open) {
      Open& o = entry.second;
      if (&o == joined || o.members.empty()) continue;
      const bool reached = std::any_of(preds.begin(), preds.end(),
                                       [&](ActorIndex p) { return run_of[p] == o.id || o.reached.contains(p); });
      if (reached) o.reached.insert(a);
    }
    if (joined != nullptr &&
        std::any_of(d.outputs.begin(), d.outputs.end(), [&](RegisterIndex r) { return read_elsewhere(plan, r, d.where); })) {
      close(*joined);
    }
  }
  for (auto& [stream, o] : open) close(o);
  return runs;
}

}  // namespace

Plan segments(const Plan& plan, KernelRegistry& kernels, const TrainConfig& cfg) {
  if (!cfg.cuda_graphs) return plan;
  const std::vector<ActorIndex> order = topological(plan);
  if (order.empty()) return plan;
  const std::vector<std::vector<ActorIndex>> runs = find_runs(plan, order);
  if (runs.empty()) return plan;

  auto registry = std::make_shared<const KernelRegistry>(kernels);
  std::set<std::string> names;
  for (const ActorDesc& a : plan.actors) names.insert(a.name);
  std::map<ActorIndex, std::vector<ActorDesc>> replace;
  std::set<ActorIndex> drop;
  for (const std::vector<ActorIndex>& run : runs) {
    const ActorDesc& first = plan.actors[run.front()];
    const std::string name = detail::unique_name(names, "segment." + first.name);
    ActorDesc seg{.name = name,
                  .op = name,
                  .dtype = first.dtype,
                  .where = first.where,
                  .first_piece = first.first_piece,
                  .attrs = Attrs{{"members", static_cast<std::int64_t>(run.size())}},
                  .role = first.role,
                  .stage = first.stage,
                  .weight_gradient = first.weight_gradient};
    std::map<RegisterIndex, std::size_t> input_of, output_of;
    std::vector<baton::detail::SegmentMember> members;
    std::map<MemoryCategory, std::int64_t> kept;
    for (ActorIndex m : run) {
      const ActorDesc& a = plan.actors[m];
      const auto step = static_cast<std::int32_t>(members.size());
      baton::detail::SegmentMember member{.actor = a.name, .op = a.op, .dtype = a.dtype, .attrs = a.attrs};
      for (const InputPort& in : a.inputs) {
        const RegisterIndex bytes = through_views(plan, in.reg);
        if (auto it = output_of.find(bytes); it != output_of.end()) {
          member.inputs.push_back({.from_output = true,
                                   .index = it->second,
                                   .view = bytes == in.reg ? std::nullopt : std::optional(plan.registers[in.reg].shape)});
          seg.steps.output_read[it->second] = step;
          continue;
        }
        auto [it, fresh] = input_of.emplace(in.reg, seg.inputs.size());
        if (fresh) {
          seg.inputs.push_back(in);
          seg.steps.input_read.push_back(step);
        }
        seg.steps.input_read[it->second] = step;
        member.inputs.push_back({.from_output = false, .index = it->second});
      }
      for (RegisterIndex r : a.outputs) {
        output_of.emplace(r, seg.outputs.size());
        member.outputs.push_back(seg.outputs.size());
        seg.outputs.push_back(r);
        seg.steps.output_written.push_back(step);
        seg.steps.output_read.push_back(step);
      }
      for (const KeptBytes& k : a.kept) kept[k.category] += k.bytes;
      if (!a.stops_when_unread) seg.stops_when_unread = false;
      members.push_back(std::move(member));
    }
    for (const auto& [category, bytes] : kept) seg.kept.push_back({category, bytes});
    // In place: member j may write output o over input i's bytes (a segment input) only where no
    // later member reads those bytes (the register, or another view of the bytes it aliases).
    for (std::size_t j = 0; j < run.size(); ++j) {
      const ActorDesc& a = plan.actors[run[j]];
      for (const InPlace& p : a.in_place) {
        const baton::detail::SegmentSource src = members[j].inputs.at(p.input);
        if (src.from_output) continue;
        const RegisterIndex bytes = aliased_register(plan, seg.inputs[src.index].reg);
        bool read_later = false;
        for (std::size_t later = j + 1; later < run.size() && !read_later; ++later) {
          for (const InputPort& in : plan.actors[run[later]].inputs) {
            if (aliased_register(plan, in.reg) == bytes) read_later = true;
          }
        }
        if (read_later) continue;
        seg.in_place.push_back(
            {.output = static_cast<std::uint32_t>(members[j].outputs.at(p.output)), .input = static_cast<std::uint32_t>(src.index)});
      }
    }
    kernels.add(name, first.where.device.type, first.dtype, baton::detail::segment_kernel(registry, std::move(members)));
    for (ActorIndex m : run) drop.insert(m);
    drop.erase(run.back());
    replace[run.back()] = {std::move(seg)};
  }
  Plan folded = detail::rebuilt(plan, replace, drop);
  // Views that only members read (now through views inside the segments' acts) read for no one.
  std::set<std::string> read_views;  // views someone read before the pass
  for (const ActorDesc& a : plan.actors) {
    if (is_view(a) && !plan.registers[a.outputs[0]].consumers.empty()) read_views.insert(a.name);
  }
  for (bool again = true; again;) {
    again = false;
    std::set<ActorIndex> unread;
    for (ActorIndex i = 0; i < folded.actors.size(); ++i) {
      const ActorDesc& a = folded.actors[i];
      if (is_view(a) && folded.registers[a.outputs[0]].consumers.empty() && read_views.contains(a.name)) unread.insert(i);
    }
    if (!unread.empty()) {
      folded = detail::rebuilt(folded, {}, unread);
      again = true;
    }
  }
  return reordered(folded);
}

}  // namespace baton::passes
