#include "baton/actors/plan.h"

#include <algorithm>
#include <map>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace baton {

std::string_view name(ActorKind k) {
  switch (k) {
    case ActorKind::source: return "source";
    case ActorKind::compute: return "compute";
    case ActorKind::repeat: return "repeat";
    case ActorKind::accumulate: return "accumulate";
    case ActorKind::transfer: return "transfer";
  }
  return "?";
}

std::string_view name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::weights: return "weights";
    case MemoryCategory::optimizer_state: return "optimizer_state";
    case MemoryCategory::activations: return "activations";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::other: return "other";
  }
  return "?";
}

RegisterIndex Plan::add_register(RegisterDesc r) {
  registers.push_back(std::move(r));
  return static_cast<RegisterIndex>(registers.size() - 1);
}

bool reduces(const ActorDesc& a) { return a.kind == ActorKind::transfer && a.adds; }

std::string_view name(ActorRole r) {
  switch (r) {
    case ActorRole::other: return "other";
    case ActorRole::data: return "data";
    case ActorRole::forward: return "forward";
    case ActorRole::backward: return "backward";
    case ActorRole::update: return "update";
    case ActorRole::collective: return "collective";
    case ActorRole::transfer: return "transfer";
  }
  return "?";
}

ActorIndex Plan::add_actor(ActorDesc a) {
  auto index = static_cast<ActorIndex>(actors.size());
  auto check = [&](RegisterIndex r, const char* role) {
    if (r >= registers.size()) {
      throw std::invalid_argument(fmt::format("actor '{}': {} register #{} does not exist ({} registers)",
                                              a.name, role, r, registers.size()));
    }
  };
  for (const auto& in : a.inputs) check(in.reg, "input");
  for (auto out : a.outputs) check(out, "output");
  for (const auto& in : a.inputs) {
    auto& consumers = registers[in.reg].consumers;
    if (std::find(consumers.begin(), consumers.end(), index) == consumers.end()) {
      consumers.push_back(index);
    }
  }
  for (auto out : a.outputs) registers[out].producer = index;
  actors.push_back(std::move(a));
  return index;
}

namespace {
std::string placement_str(const Placement& p) {
  return fmt::format("r{}/{}/s{}", p.rank, p.device.str(), p.stream);
}
}  // namespace

std::string_view name(EdgeSync s) {
  switch (s) {
    case EdgeSync::host: return "host";
    case EdgeSync::to_host: return "to_host";
    case EdgeSync::from_host: return "from_host";
    case EdgeSync::same_stream: return "same_stream";
    case EdgeSync::event: return "event";
    case EdgeSync::alias: return "alias";
  }
  return "?";
}

bool on_stream(const ActorDesc& a) {
  return is_async(a.where.device.type) && a.kind != ActorKind::repeat && a.kind != ActorKind::transfer;
}

bool is_view(const ActorDesc& a) {
  return a.kind == ActorKind::repeat && a.group == 1 && a.inputs.size() == 1 && a.inputs[0].delay == 0;
}

RegisterIndex aliased_register(const Plan& plan, RegisterIndex reg) {
  // Bounded, as data_writer.
  for (std::size_t hops = 0; hops <= plan.actors.size() && reg < plan.registers.size(); ++hops) {
    const ActorIndex p = plan.registers[reg].producer;
    if (p >= plan.actors.size()) return reg;
    const ActorDesc& a = plan.actors[p];
    if (a.kind != ActorKind::repeat || a.inputs.empty()) return reg;
    reg = a.inputs[0].reg;
  }
  return reg;
}

namespace {

bool copied_to_cuda(const Plan& plan, RegisterIndex reg, std::size_t depth) {
  if (depth > plan.actors.size() || reg >= plan.registers.size()) return false;
  for (ActorIndex c : plan.registers[reg].consumers) {
    if (c >= plan.actors.size()) continue;
    const ActorDesc& a = plan.actors[c];
    if (a.copy == CopyDirection::to_device && a.where.device.type == DeviceType::cuda) return true;
    if (is_view(a) && a.outputs.size() == 1 && copied_to_cuda(plan, a.outputs[0], depth + 1)) return true;
  }
  return false;
}

}  // namespace

bool copied_to_cuda(const Plan& plan, RegisterIndex reg) { return copied_to_cuda(plan, reg, 0); }

ActorIndex data_writer(const Plan& plan, RegisterIndex reg) {
  // Bounded: a cycle of repeats (which validate() would refuse anyway) cannot loop forever.
  for (std::size_t hops = 0; hops <= plan.actors.size() && reg < plan.registers.size(); ++hops) {
    const ActorIndex p = plan.registers[reg].producer;
    if (p >= plan.actors.size()) return no_actor;
    const ActorDesc& a = plan.actors[p];
    if (a.kind != ActorKind::repeat || a.inputs.empty()) return p;
    reg = a.inputs[0].reg;
  }
  return no_actor;
}

namespace {

/// A collective whose kernel waits on its stream until its peers call it too (NCCL's).
bool waits_for_peers(const ActorDesc& a) { return a.op.starts_with("nccl."); }

/// Two streams whose events can order each other: same rank, same kind of device.
bool same_kind(const ActorDesc& a, const ActorDesc& b) {
  return a.where.rank == b.where.rank && a.where.device.type == b.where.device.type;
}

/// Whether every reader of the repeat `r`'s output (through further repeats) is on a stream
/// that can wait on an event of `writer`'s.
bool readers_on_streams(const Plan& plan, ActorIndex r, const ActorDesc& writer, std::size_t depth) {
  if (depth > plan.actors.size()) return false;
  for (RegisterIndex out : plan.actors[r].outputs) {
    if (out >= plan.registers.size()) return false;
    for (ActorIndex c : plan.registers[out].consumers) {
      if (c >= plan.actors.size()) return false;
      const ActorDesc& a = plan.actors[c];
      if (a.kind == ActorKind::repeat) {
        if (!readers_on_streams(plan, c, writer, depth + 1)) return false;
      } else if (!on_stream(a) || !same_kind(a, writer)) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

EdgeSync edge_sync(const Plan& plan, RegisterIndex reg, ActorIndex consumer) {
  const ActorIndex w = data_writer(plan, reg);
  if (w == no_actor || consumer >= plan.actors.size()) return EdgeSync::host;
  const ActorDesc& writer = plan.actors[w];
  const ActorDesc& reader = plan.actors[consumer];
  const bool writes_on_stream = on_stream(writer);
  if (reader.kind == ActorKind::repeat) {
    if (!writes_on_stream) return EdgeSync::host;
    if (waits_for_peers(writer)) return EdgeSync::to_host;
    return readers_on_streams(plan, consumer, writer, 0) ? EdgeSync::alias : EdgeSync::to_host;
  }
  const bool reads_on_stream = on_stream(reader);
  if (!writes_on_stream) return reads_on_stream ? EdgeSync::from_host : EdgeSync::host;
  if (!reads_on_stream || !same_kind(reader, writer) || waits_for_peers(writer) || waits_for_peers(reader)) {
    // A collective that waits on its stream for its peers (NCCL's) is seen from the other
    // streams as the host sees it: were a compute stream to wait on its event, that stream
    // would stop until every peer came, and a peer may need this device's later work first
    // (tensor parallelism's sums couple a replica's devices; each of data parallelism's
    // per-place groups then waits on another device of the replica): a cycle through the
    // devices, a hang. Host-side, only the actors that read the sum wait for it.
    // A reader on a stream of another kind (a sim device reading CUDA memory) sees the data
    // as the host does: once the writer's stream has reached the write. Its own reads then
    // end before its stream is reached, which it waits for before acking (from_host's rule
    // applies on its side: see the runtime).
    return EdgeSync::to_host;
  }
  return reader.where == writer.where ? EdgeSync::same_stream : EdgeSync::event;
}

std::string Plan::to_text() const {
  std::string out;
  for (std::size_t i = 0; i < arenas.size(); ++i) {
    out += fmt::format("arena {} r{}/{} bytes={}\n", i, arenas[i].rank, arenas[i].device.str(), arenas[i].bytes);
  }
  for (std::size_t i = 0; i < registers.size(); ++i) {
    const auto& r = registers[i];
    std::string consumers;
    for (auto c : r.consumers) consumers += fmt::format("{}{}", consumers.empty() ? "" : ",", c);
    out += fmt::format("register {} {} {}{} slots={} producer={} consumers=[{}]", i, r.name,
                       name(r.dtype), to_string(r.shape), r.slots,
                       r.producer == no_actor ? std::string("none") : std::to_string(r.producer),
                       consumers);
    if (r.arena >= 0 || !r.offsets.empty()) out += fmt::format(" arena={}@[{}]", r.arena, fmt::join(r.offsets, ","));
    if (r.kernel_memory) out += " kernel_memory";
    std::string syncs;
    bool crosses_a_stream = false;
    for (auto c : r.consumers) {
      const EdgeSync e = edge_sync(*this, static_cast<RegisterIndex>(i), c);
      crosses_a_stream = crosses_a_stream || e != EdgeSync::host;
      syncs += fmt::format("{}{}", syncs.empty() ? "" : ",", name(e));
    }
    if (crosses_a_stream) out += fmt::format(" sync=[{}]", syncs);
    out += '\n';
  }
  for (std::size_t i = 0; i < actors.size(); ++i) {
    const auto& a = actors[i];
    std::string ins;
    for (const auto& in : a.inputs) {
      ins += fmt::format("{}{}", ins.empty() ? "" : ",", in.reg);
      if (in.delay != 0) ins += fmt::format("@-{}", in.delay);
    }
    std::string outs;
    for (auto o : a.outputs) outs += fmt::format("{}{}", outs.empty() ? "" : ",", o);
    out += fmt::format("actor {} {} {} op={} {} at {} in=[{}] out=[{}]", i, a.name, name(a.kind), a.op,
                       name(a.dtype), placement_str(a.where), ins, outs);
    if (a.kind == ActorKind::source) out += fmt::format(" pieces={}", a.pieces);
    if (a.first_piece != 0) out += fmt::format(" first_piece={}", a.first_piece);
    if (a.kind == ActorKind::repeat || a.kind == ActorKind::accumulate) {
      out += fmt::format(" group={}", a.group);
    }
    if (a.window >= 0) out += fmt::format(" window={}", a.window);
    if (!a.stops_when_unread) out += " drains";
    if (a.role != ActorRole::other) out += fmt::format(" role={}", name(a.role));
    if (a.stage >= 0) out += fmt::format(" stage={}", a.stage);
    if (a.weight_gradient) out += " weight_gradient";
    if (a.at_end) out += " at_end";
    if (a.copy != CopyDirection::none) out += a.copy == CopyDirection::to_host ? " copy=to_host" : " copy=to_device";
    if (a.adds) out += " adds";
    if (a.memory) out += fmt::format(" memory={}", name(*a.memory));
    if (a.reports_loss) out += " reports_loss";
    if (a.order.lane >= 0) {
      out += fmt::format(" order=lane{}:rank{}:units[{}]/{}", a.order.lane, a.order.rank,
                         fmt::join(a.order.units, ","), a.order.period);
      if (!a.order.lead.empty()) out += fmt::format(":lead[{}]", fmt::join(a.order.lead, ","));
    }
    if (!a.kept.empty()) {
      std::string kept;
      for (const KeptBytes& k : a.kept) kept += fmt::format("{}{}:{}", kept.empty() ? "" : ",", name(k.category), k.bytes);
      out += fmt::format(" kept=[{}]", kept);
    }
    if (!a.in_place.empty()) {
      std::string pairs;
      for (const InPlace& p : a.in_place) pairs += fmt::format("{}{}<-{}", pairs.empty() ? "" : ",", p.output, p.input);
      out += fmt::format(" in_place=[{}]", pairs);
    }
    if (!a.steps.empty()) {
      std::string outs_steps;
      for (std::size_t o = 0; o < a.steps.output_written.size() && o < a.steps.output_read.size(); ++o) {
        outs_steps += fmt::format("{}{}-{}", outs_steps.empty() ? "" : ",", a.steps.output_written[o], a.steps.output_read[o]);
      }
      out += fmt::format(" steps=in[{}]out[{}]", fmt::join(a.steps.input_read, ","), outs_steps);
    }
    if (!a.attrs.values().empty()) {
      out += ' ';
      out += a.attrs.str();
    }
    out += '\n';
  }
  return out;
}

std::string Plan::to_dot() const {
  std::string out = "digraph plan {\n  rankdir=LR;\n  node [shape=box, fontname=\"monospace\"];\n";
  std::map<std::string, std::vector<std::size_t>> clusters;
  for (std::size_t i = 0; i < actors.size(); ++i) clusters[placement_str(actors[i].where)].push_back(i);
  int c = 0;
  for (const auto& [place, members] : clusters) {
    out += fmt::format("  subgraph cluster_{} {{\n    label=\"{}\";\n", c++, place);
    for (auto i : members) {
      const auto& a = actors[i];
      out += fmt::format("    a{} [label=\"{}\\n{} {}\"];\n", i, a.name, name(a.kind), a.op);
    }
    out += "  }\n";
  }
  for (std::size_t r = 0; r < registers.size(); ++r) {
    const auto& reg = registers[r];
    if (reg.producer == no_actor) continue;
    for (auto consumer : reg.consumers) {
      std::string delay;
      for (const auto& in : actors[consumer].inputs) {
        if (in.reg == r && in.delay != 0) delay = fmt::format(" @-{}", in.delay);
      }
      out += fmt::format("  a{} -> a{} [label=\"{} {}{} x{}{}\"];\n", reg.producer, consumer, reg.name,
                         name(reg.dtype), to_string(reg.shape), reg.slots, delay);
    }
  }
  out += "}\n";
  return out;
}

std::uint64_t Plan::hash() const {
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char ch : to_text()) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<ActorIndex> Plan::actors_on(std::uint16_t rank) const {
  std::vector<ActorIndex> out;
  for (std::size_t i = 0; i < actors.size(); ++i) {
    if (actors[i].where.rank == rank) out.push_back(static_cast<ActorIndex>(i));
  }
  return out;
}

namespace {

/// Puts `mover` (a transfer or a device copy, its kind, op and placement set) between register
/// r and `consumers`: they read its output, a copy of r named "<r>@<suffix>", instead of r.
void reroute(Plan& out, RegisterIndex r, const std::vector<ActorIndex>& consumers, const std::string& suffix,
             ActorDesc mover) {
  RegisterDesc copy = out.registers[r];
  copy.name = fmt::format("{}@{}", copy.name, suffix);
  copy.producer = no_actor;
  copy.consumers.clear();
  // Not placed, and neither is r once its readers change: their lives are the memory pass's to
  // work out (it runs after the movers); left in place they could overlap.
  copy.arena = -1;
  copy.offsets.clear();
  // The mover writes slots of its own, whatever memory the producer's kernel keeps for r.
  copy.kernel_memory = false;
  out.registers[r].arena = -1;
  out.registers[r].offsets.clear();
  const RegisterIndex local = out.add_register(copy);
  mover.name = copy.name;
  mover.dtype = copy.dtype;
  mover.role = ActorRole::transfer;
  mover.stage = out.actors[consumers.front()].stage;
  mover.inputs = {InputPort{r, 0}};
  mover.outputs = {local};
  out.add_actor(std::move(mover));
  auto& readers = out.registers[r].consumers;
  for (ActorIndex c : consumers) {
    readers.erase(std::find(readers.begin(), readers.end(), c));
    for (InputPort& in : out.actors[c].inputs) {
      if (in.reg == r) in.reg = local;
    }
    out.registers[local].consumers.push_back(c);
  }
}

}  // namespace

Plan insert_transfers(const Plan& plan) {
  Plan out = plan;
  const auto n_registers = static_cast<RegisterIndex>(plan.registers.size());
  for (RegisterIndex r = 0; r < n_registers; ++r) {
    const ActorIndex producer = out.registers[r].producer;
    if (producer == no_actor || producer >= out.actors.size()) continue;  // validate() reports it
    const std::uint16_t home = out.actors[producer].where.rank;
    // The consumers on other ranks, by rank, in the register's order; transfers already there
    // stay as they are.
    std::map<std::uint16_t, std::vector<ActorIndex>> remote;
    for (ActorIndex c : out.registers[r].consumers) {
      if (c >= out.actors.size()) continue;
      const ActorDesc& a = out.actors[c];
      if (a.where.rank != home && a.kind != ActorKind::transfer) remote[a.where.rank].push_back(c);
    }
    for (const auto& [rank, consumers] : remote) {
      ActorDesc t;
      t.kind = ActorKind::transfer;
      t.op = "transfer";
      t.where = out.actors[consumers.front()].where;
      reroute(out, r, consumers, fmt::format("r{}", rank), std::move(t));
    }
  }
  return out;
}

namespace {

/// One pass of insert_device_copies(): a copy actor per (register, consuming device) where a
/// register crosses between host and a CUDA device on its producer's rank, and a to_host copy
/// for a register made on a CUDA device and read on another rank (by a transfer, or by an
/// actor a transfer will be put before), so that what crosses ranks is host memory.
Plan device_copies(const Plan& plan) {
  Plan out = plan;
  const auto n_registers = static_cast<RegisterIndex>(plan.registers.size());
  for (RegisterIndex r = 0; r < n_registers; ++r) {
    const ActorIndex producer = out.registers[r].producer;
    if (producer == no_actor || producer >= out.actors.size()) continue;  // validate() reports it
    const Placement home = out.actors[producer].where;
    if (out.actors[producer].copy != CopyDirection::none) continue;  // a copy already
    std::map<Device, std::vector<ActorIndex>> elsewhere;
    for (ActorIndex c : out.registers[r].consumers) {
      if (c >= out.actors.size()) continue;
      const ActorDesc& a = out.actors[c];
      if (a.copy != CopyDirection::none) continue;  // a copy already
      const bool remote = a.where.rank != home.rank || a.kind == ActorKind::transfer;
      if (remote) {
        // Staged through the producer's host side: UCX here moves host memory only.
        if (is_async(home.device.type)) elsewhere[Device{DeviceType::cpu, home.device.index}].push_back(c);
        continue;
      }
      if (a.where.device == home.device) continue;
      if (!is_async(a.where.device.type) && !is_async(home.device.type)) continue;
      elsewhere[a.where.device].push_back(c);
    }
    for (const auto& [device, consumers] : elsewhere) {
      const bool to_host = !is_async(device.type);
      ActorDesc t;
      t.op = to_host ? "to_host" : "to_device";
      t.copy = to_host ? CopyDirection::to_host : CopyDirection::to_device;
      const bool peer = !to_host && is_async(home.device.type);  // device -> device
      t.where = Placement{home.rank, to_host ? home.device : device,
                          peer ? peer_copy_stream(home.device) : device_copy_stream};
      reroute(out, r, consumers, device.str(), std::move(t));
    }
  }
  return out;
}

}  // namespace

Plan insert_device_copies(const Plan& plan) {
  Plan out = device_copies(plan);
  // Registers between ranks where a CUDA device is at either end: the transfers are made here,
  // on the host side of the consuming rank, and copied onto its device from there.
  bool cross_rank_cuda = false;
  for (const RegisterDesc& reg : out.registers) {
    if (reg.producer == no_actor || reg.producer >= out.actors.size()) continue;
    const Placement& home = out.actors[reg.producer].where;
    for (ActorIndex c : reg.consumers) {
      if (c >= out.actors.size()) continue;
      const Placement& there = out.actors[c].where;
      if (there.rank != home.rank && is_async(there.device.type)) cross_rank_cuda = true;
    }
  }
  if (!cross_rank_cuda) return out;
  out = insert_transfers(out);
  for (ActorDesc& a : out.actors) {
    if (a.kind == ActorKind::transfer && is_async(a.where.device.type)) {
      a.where.device = Device{DeviceType::cpu, a.where.device.index};
    }
  }
  return device_copies(out);
}

}  // namespace baton
