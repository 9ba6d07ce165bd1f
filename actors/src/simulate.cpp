// The plan on a virtual clock (simulate.h): the dry run's actors, one act per dispatch, each
// dispatch at the virtual time its message arrives or its resource is free, whichever is later.
#include "baton/actors/simulate.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <queue>
#include <stdexcept>
#include <tuple>

#include "internal.h"

namespace baton {

namespace {

// The rank a transfer pulls from: the producer of its first input on another rank.
std::uint16_t transfer_source_rank(const Plan& plan, const ActorDesc& a) {
  for (const InputPort& in : a.inputs) {
    const ActorIndex p = plan.registers[in.reg].producer;
    if (p != no_actor && plan.actors[p].where.rank != a.where.rank) return plan.actors[p].where.rank;
  }
  return a.where.rank;
}

struct Event {
  double at = 0;
  std::uint64_t seq = 0;  // send order: messages of one time arrive first come, first served
  Message m;
  std::int64_t sender = -1;  // the act that sent it (an index into the recorded acts), -1: none
  bool operator>(const Event& o) const { return std::tie(at, seq) > std::tie(o.at, o.seq); }
};

}  // namespace

std::vector<std::int32_t> default_resources(const Plan& plan, std::vector<std::string>* names) {
  std::map<std::tuple<int, std::uint16_t, Device, std::uint16_t>, std::int32_t> ids;
  std::vector<std::int32_t> out(plan.actors.size());
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    const ActorDesc& a = plan.actors[i];
    // A transfer's key: (1, from rank, the device slot unused, to rank).
    const auto key = a.kind == ActorKind::transfer
                         ? std::tuple{1, transfer_source_rank(plan, a), Device{}, std::uint16_t{a.where.rank}}
                         : std::tuple{0, a.where.rank, a.where.device, std::uint16_t{a.where.stream}};
    const auto [it, added] = ids.try_emplace(key, static_cast<std::int32_t>(ids.size()));
    out[i] = it->second;
    if (added && names != nullptr) {
      names->push_back(a.kind == ActorKind::transfer
                           ? fmt::format("link r{}->r{}", std::get<1>(key), std::get<3>(key))
                           : fmt::format("r{} {} s{}", a.where.rank, a.where.device.str(), a.where.stream));
    }
  }
  return out;
}

Simulation simulate(const Plan& plan, const SimulationOptions& options) {
  if (options.act_seconds.size() != plan.actors.size()) {
    throw std::invalid_argument(fmt::format("simulate: {} act times for {} actors", options.act_seconds.size(),
                                            plan.actors.size()));
  }
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    if (!(options.act_seconds[i] >= 0)) {
      throw std::invalid_argument(
          fmt::format("simulate: actor '{}' takes {} s an act", plan.actors[i].name, options.act_seconds[i]));
    }
  }
  Simulation sim;
  std::vector<std::string> names;
  if (options.resource.empty()) {
    sim.resource_of = default_resources(plan, &names);
  } else {
    if (options.resource.size() != plan.actors.size()) {
      throw std::invalid_argument(
          fmt::format("simulate: {} resources for {} actors", options.resource.size(), plan.actors.size()));
    }
    sim.resource_of = options.resource;
    const std::int32_t most = plan.actors.empty() ? -1 : *std::max_element(sim.resource_of.begin(), sim.resource_of.end());
    if (std::any_of(sim.resource_of.begin(), sim.resource_of.end(), [](std::int32_t r) { return r < 0; })) {
      throw std::invalid_argument("simulate: a resource id below 0");
    }
    for (std::int32_t r = 0; r <= most; ++r) names.push_back(fmt::format("resource {}", r));
  }
  sim.resource_names = names;
  sim.busy.assign(names.size(), 0.0);
  sim.act_count.assign(plan.actors.size(), 0);

  RuntimeSettings s;
  s.mode = ExecutionMode::deterministic;
  s.time_accounting = false;
  detail::Core core(plan, nullptr, s, /*dry_run=*/true);
  core.simulated = true;
  core.sim_seconds = &options.act_seconds;
  if (options.record_acts) core.sim_acts = &sim.acts;
  core.instantiate();
  if (core.workers.empty()) return sim;
  detail::Worker& worker = *core.workers[0];

  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  std::uint64_t seq = 0;
  for (auto& a : core.actors) {
    if (a) events.push(Event{0.0, seq++, Message{a->id(), a->id(), 0, 0, 0, MsgKind::start, 0}});
  }
  std::vector<double> free_at(names.size(), 0.0);
  std::vector<std::int64_t> last_act(names.size(), -1);  // by resource: its latest act
  std::vector<Message> sent;
  while (!events.empty() && !core.failed()) {
    Event e = events.top();
    events.pop();
    const auto r = static_cast<std::size_t>(sim.resource_of[e.m.dst.index()]);
    if (free_at[r] > e.at) {
      // Its worker (or stream, or link) is busy: the message waits in its queue, in its place,
      // and what it waited for last is the resource.
      e.at = free_at[r];
      e.sender = last_act[r];
      events.push(e);
      continue;
    }
    core.sim_now = e.at;
    core.sim_acted = no_actor;
    sent.clear();
    worker.dispatch_simulated(e.m, sent);
    const double end = core.sim_now;
    std::int64_t by = e.sender;
    if (core.sim_acted != no_actor) {
      sim.busy[r] += end - e.at;
      free_at[r] = end;
      sim.makespan = std::max(sim.makespan, end);
      ++sim.act_count[core.sim_acted];
      if (options.record_acts) {
        // This dispatch's act is the one just recorded.
        by = static_cast<std::int64_t>(sim.acts.size()) - 1;
        sim.acts.back().after = e.sender;
        last_act[r] = by;
      }
      // It stopped after the act (one per dispatch): ask it again once the act has ended.
      const ActorId id = core.actors[core.sim_acted]->id();
      events.push(Event{end, seq++, Message{id, id, 0, 0, 0, MsgKind::start, 0}, by});
    }
    for (const Message& m : sent) events.push(Event{end, seq++, m, by});
  }
  if (core.failed()) {
    std::lock_guard lock(core.mutex);
    sim.stalled = true;
    sim.stall = core.error;
  }
  for (auto& a : core.actors) {
    if (!a || a->retired()) continue;
    sim.stalled = true;
    sim.stall += fmt::format("\n  '{}' after {} acts: {}", a->name(), a->acts(), a->describe_wait());
  }
  return sim;
}

std::vector<std::int64_t> Simulation::critical_path() const {
  std::vector<std::int64_t> path;
  std::int64_t at = -1;
  for (std::size_t i = 0; i < acts.size(); ++i) {
    if (at < 0 || acts[i].end > acts[static_cast<std::size_t>(at)].end) at = static_cast<std::int64_t>(i);
  }
  // Each act's cause was recorded before it, so the walk ends.
  for (; at >= 0; at = acts[static_cast<std::size_t>(at)].after) path.push_back(at);
  std::reverse(path.begin(), path.end());
  return path;
}

}  // namespace baton
