#pragma once
/// A job of one or many ranks (processes, possibly on many hosts): the control plane, the data
/// plane and the runtime put together, as DESIGN.md sections 3-4 describe.
///
///   int main() {
///     baton::Plan plan = build_plan();           // the same on every rank (SPMD)
///     auto env = baton::JobEnvironment::from_env();  // BATON_RANK, ... (set by baton-launch)
///     baton::RunReport report = baton::run_job(plan, kernels, env);
///   }
///
/// Every rank compiles the same plan; the rendezvous server checks that by hash. A rank that
/// fails (a kernel throws, the plan is refused, the process dies) ends the job on every rank
/// with its reason: run_job() throws on all of them.
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "baton/actors/plan.h"
#include "baton/actors/runtime.h"
#include "baton/actors/settings.h"
#include "baton/kernels/kernel.h"
#include "baton/transport/data_plane.h"

namespace baton::transport {
class ControlClient;
}

namespace baton {

/// Watches one rank's run (the dashboard's collector, the trace recorder): run_job calls it on
/// its own thread. An observer that needs to do work while the run goes starts its own thread in
/// on_start and stops it in on_finish.
class JobObserver {
 public:
  virtual ~JobObserver() = default;
  /// The runtime is about to run (every rank has joined and connected). `control` is this
  /// rank's connection to the rendezvous server (send_telemetry, clock_offset_ns), or null in a
  /// job of one rank. Both stay valid until on_finish returns.
  virtual void on_start(Runtime& runtime, transport::ControlClient* control) = 0;
  /// The run ended: `error` is empty when it succeeded, else the reason. Called before the
  /// final barrier, so what the observer sends still reaches the server.
  virtual void on_finish(Runtime& runtime, const std::string& error) = 0;
  /// A command from the server (RendezvousServer::send_command), on the control client's
  /// thread, at any time after join. Keep it short.
  virtual void on_command(const std::string& kind, const std::string& body) {
    (void)kind;
    (void)body;
  }
};

/// Several observers of one run, called in order (on_finish in reverse).
///
///   baton::JobObservers both({&dashboard_collector, &trace_recorder});
///   js.observer = &both;
class JobObservers final : public JobObserver {
 public:
  explicit JobObservers(std::vector<JobObserver*> observers) : observers_(std::move(observers)) {}
  void on_start(Runtime& runtime, transport::ControlClient* control) override {
    for (JobObserver* o : observers_) o->on_start(runtime, control);
  }
  void on_finish(Runtime& runtime, const std::string& error) override {
    for (auto it = observers_.rbegin(); it != observers_.rend(); ++it) (*it)->on_finish(runtime, error);
  }
  void on_command(const std::string& kind, const std::string& body) override {
    for (JobObserver* o : observers_) o->on_command(kind, body);
  }

 private:
  std::vector<JobObserver*> observers_;
};

/// Where this process stands in its job: what baton-launch puts in the environment.
struct JobEnvironment {
  std::uint32_t rank = 0;
  std::uint32_t world_size = 1;
  std::uint32_t local_rank = 0;
  std::string master;  // host:port of the rendezvous server
  std::string token;
  /// Ranks of the job on this host (BATON_LOCAL_WORLD_SIZE); 0: not known. Where it equals
  /// world_size, run_job leaves TCP out of the data plane (see run_job).
  std::uint32_t local_world_size = 0;
  /// BATON_BIND_TO=core (baton-launch --bind-to core): run_job puts this rank's threads on a
  /// block of this host's cores of its own (the cores the process may use, split evenly among
  /// the local ranks, in local rank order), as mpirun --bind-to core does. Without it the
  /// scheduler may put two ranks on one core and leave another idle: one hop between two ranks
  /// on 2 cores measured 0.6-0.8 us or 2.4-2.9 us depending on where they landed.
  bool bind_to_core = false;
  /// BATON_SHARED_REGISTERS=0: no piece is read in place in another rank's memory
  /// (RuntimeSettings::shared_registers off for run_job), for hosts where ranks cannot open
  /// one another's /proc/<pid>/fd (other PID namespaces, /proc mounted with hidepid).
  bool shared_registers = true;
  /// BATON_HOLD_MESSAGES_NS=N (0-65535): RuntimeSettings::hold_messages_ns for run_job (0: every
  /// message to another rank goes at once, alone); unset: the settings' own.
  std::optional<std::uint32_t> hold_messages_ns;
  /// BATON_REJOIN=1 (baton-launch --max-restarts): this process is a rank that left the job,
  /// started again to come back (ControlClient::rejoin; JobSettings::rejoin_plan).
  bool rejoin = false;

  /// BATON_RANK, BATON_WORLD_SIZE, BATON_LOCAL_RANK, BATON_LOCAL_WORLD_SIZE, BATON_MASTER,
  /// BATON_JOB_TOKEN, BATON_BIND_TO, BATON_SHARED_REGISTERS, BATON_HOLD_MESSAGES_NS, BATON_REJOIN. Without BATON_WORLD_SIZE: a job of one rank. Throws std::invalid_argument naming the variable and
  /// its value if one is malformed or missing for a job of several ranks.
  static JobEnvironment from_env();
  bool distributed() const { return world_size > 1; }
  /// The host of each rank (index: rank; hosts numbered from 0) as baton-launch numbers ranks:
  /// node by node, local_world_size on each, so rank r is on host r / local_world_size. Empty
  /// where local_world_size is not known or does not divide world_size (TrainConfig::rank_hosts).
  std::vector<std::uint32_t> rank_hosts() const;
};

struct JobSettings {
  /// rank and link are set by run_job.
  RuntimeSettings runtime;
  transport::DataPlaneSettings data;
  /// Reaching the server and hearing from every other rank.
  std::chrono::milliseconds join_timeout{120'000};
  /// The start barrier (every rank has connected its data plane).
  std::chrono::milliseconds start_timeout{120'000};
  /// The final barrier: the slowest rank may still be running its last pieces.
  std::chrono::milliseconds finish_timeout{600'000};
  /// Watches the run (not owned; must outlive run_job). Null: nobody.
  JobObserver* observer = nullptr;
  /// This rank may leave the job once it has formed without ending it (transport::RankInfo::
  /// may_leave: a parameter-server worker under bounded staleness). On the others, a rank that
  /// may leave and leaves is Runtime::rank_left, not an abort.
  bool may_leave = false;
  /// Called (on the control client's thread) when another rank left the job; null: nobody.
  std::function<void(std::uint32_t rank, const std::string& reason)> on_left;
  /// Called (on the control client's thread) when a rank that left came back at a step.
  std::function<void(std::uint32_t rank, std::int64_t step)> on_rejoined;
  /// For a rank that comes back (JobEnvironment::rejoin): its plan from step `step` on
  /// (TrainConfig::first_step and rejoin) and its kernels, which must outlive run_job. run_job
  /// calls it once the others hold, and runs that plan instead of the one it was given. Unset: a
  /// process started to come back fails saying the program cannot.
  std::function<std::pair<Plan, const KernelRegistry*>(std::int64_t step)> rejoin_plan;
};

/// Applies insert_transfers(), joins the job (checking every rank compiled the same plan),
/// connects the data plane, runs this rank's actors and finishes with every rank. A job of one
/// rank runs the plan directly. Throws PlanError (a plan this rank refuses, or one with actors
/// on ranks the job does not have), JobError (this run failed, or another rank did: the
/// message names it), transport::TransportError (the job could not be joined: refused,
/// timed out).
/// The data plane's settings run_job uses (data_plane_for_job). RunReport::data_plane says which.
RunReport run_job(const Plan& plan, const KernelRegistry& kernels, const JobEnvironment& env,
                  JobSettings settings = {});

/// env.bind_to_core: puts every thread of this process (those to come too) on this local
/// rank's block of the cores the process may use; returns what it did ("cores 2-3 of 0-7, local
/// rank 1 of 4"), or why not. Not bound: "". `own_cores` (if given): how many cores the rank got
/// to itself (0: not bound, or more local ranks than cores, so they share).
std::string bind_to_cores(const JobEnvironment& env, std::uint32_t* own_cores = nullptr);

/// The data plane's transports for a job: `base.transports`, else UCX_TLS, else, when every
/// rank is on this host (env.local_world_size == world_size), every transport but CMA and TCP:
/// UCX would otherwise run its rendezvous between processes of the host over TCP loopback
/// (measured, baton-bench-transport with BATON_BENCH_SHM_TLS=^cma,tcp on 2 cores: 1 MiB 11.5
/// GB/s against about 4 with TCP); else every transport but CMA (ucx_configuration). `why`,
/// if given, gets " (every rank on this host)" when the last rule chose.
transport::DataPlaneSettings data_plane_for_job(const JobEnvironment& env, transport::DataPlaneSettings base,
                                                std::string* why = nullptr);

}  // namespace baton
