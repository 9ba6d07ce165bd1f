#pragma once
/// The plan run on a virtual clock: the runtime's own actors, registers, credits and lanes (the
/// dry run's: every rank's actors in one process, no kernels, no memory), each act taking the
/// virtual time a cost model gives it instead of doing work. What the plan would do on devices
/// that are not here (a stall from too few slots, a pipeline's bubble, a collective that is not
/// hidden behind the backward pass) is what the simulation shows, because it runs the same
/// handshakes the runtime runs (docs/planning.md).
///
///   baton::SimulationOptions o;
///   o.act_seconds.assign(plan.actors.size(), 0.0);
///   o.act_seconds[forward] = 1e-3;
///   baton::Simulation s = baton::simulate(plan, o);
///   // s.makespan, s.busy[s.resource_of[forward]], s.acts ...
///
/// The timing model: every actor's acts occupy one *resource* (ActorDesc placement's worker by
/// default: a (rank, device, stream), i.e. a CPU worker thread or an accelerator's stream; a
/// transfer the link from its producer's rank to its own), whose acts run one at a time in the
/// order the runtime's worker would dispatch them; a message (request, ack, a lane's turn)
/// arrives when the act that sends it ends, and waits while its receiver's resource is busy.
/// Handshake messages take no time themselves (they are ~0.1 us in one process; a transfer's
/// cost carries its link's latency).
#include <cstdint>
#include <string>
#include <vector>

#include "baton/actors/plan.h"

namespace baton {

struct SimulationOptions {
  /// By plan actor: the virtual seconds each of its acts takes (size == plan.actors.size()).
  std::vector<double> act_seconds;
  /// By plan actor: the resource its acts occupy (0-based ids; acts of one resource never
  /// overlap). Empty: default_resources(plan).
  std::vector<std::int32_t> resource;
  /// Keep every act's start and end (Simulation::acts); off for a large plan's search.
  bool record_acts = true;
};

struct SimulatedAct {
  ActorIndex actor = no_actor;
  std::int64_t act = 0;  // its act number (0-based)
  double start = 0, end = 0;
  /// What it started after (an index into Simulation::acts; -1: nothing, it started at 0): the
  /// act whose message (a request, an ack, a lane's turn) let it act last, or the act before it
  /// on its resource where that ended later. Followed back from the last act, the critical path.
  std::int64_t after = -1;
};

struct Simulation {
  /// The virtual time at which the last act ended.
  double makespan = 0;
  /// Every act, in the order they started (SimulationOptions::record_acts).
  std::vector<SimulatedAct> acts;
  /// By plan actor: its resource; by resource: the seconds it was busy and a name
  /// ("r0 cpu:1 s0", "link r0->r1").
  std::vector<std::int32_t> resource_of;
  std::vector<double> busy;
  std::vector<std::string> resource_names;
  /// By plan actor: the acts it made.
  std::vector<std::int64_t> act_count;
  /// The run stopped with actors that can never act again (the handshakes deadlock: a slot too
  /// few, a cycle without a delay): `stall` names each and what it waits for, as the runtime's
  /// stall report does. False: every actor finished.
  bool stalled = false;
  std::string stall;
  /// The critical path: from the first act to the last, each the `after` of the next
  /// (indices into acts; empty without record_acts).
  std::vector<std::int64_t> critical_path() const;
  /// The share of `r`'s time it was idle over the makespan.
  double idle(std::int32_t r) const { return makespan > 0 ? 1.0 - busy[static_cast<std::size_t>(r)] / makespan : 0.0; }
};

/// The resources simulate() uses by default, by plan actor, and their names: one per (rank,
/// device, stream) for every actor but transfers, and one per (producer's rank, rank) link for
/// transfers.
std::vector<std::int32_t> default_resources(const Plan& plan, std::vector<std::string>* names = nullptr);

/// Runs the plan on the virtual clock until every actor has finished or nothing can move.
/// The plan must pass validate()'s structure checks (it is not checked again here). Throws
/// std::invalid_argument for options of the wrong size or a negative time.
Simulation simulate(const Plan& plan, const SimulationOptions& options);

}  // namespace baton
