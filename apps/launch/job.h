#pragma once
/// The launcher's part of a job: the rendezvous server (node 0) or a launcher client (other
/// nodes), this node's ranks, the other nodes' launchers over ssh (--hosts), and one event
/// loop that forwards output and signals and ends everything when anything fails.
#include <chrono>
#include <cstddef>
#include <string>

#include "plan.h"

namespace baton::launch {

/// The knobs of supervision, with their defaults.
struct Supervision {
  /// After the first failure, how long the other ranks have between SIGTERM and SIGKILL.
  std::chrono::milliseconds term_grace{3'000};
  /// A signal to the launcher (SIGTERM, SIGINT, SIGHUP; --stop-grace). 0: it ends the job at
  /// once (the ranks get the signal and the job's abort, SIGKILL after term_grace). More: the
  /// ranks get the signal and this long to exit on their own, the job ending as their exits say
  /// (0 if every rank exits 0: a server that drained its requests, baton-serve); a rank still
  /// running then, or a second signal, ends the job as above.
  std::chrono::milliseconds stop_grace{0};
  /// After the first failure, how long the other nodes' launchers (--hosts: ssh children) have
  /// to end on their own, having heard the abort from the rendezvous server, before ssh gets
  /// SIGTERM (and SIGKILL term_grace later).
  std::chrono::milliseconds node_grace{7'000};
  /// After the first failure, the launcher exits by then even if a child was not reaped.
  std::chrono::milliseconds give_up_after{11'000};
  /// A child's pipes are read until EOF, but only this long after it exited: something it
  /// started in the background may hold them open.
  std::chrono::milliseconds drain_after_exit{2'000};
  /// How often node 0 looks at the rendezvous server's outcome; also the longest poll().
  std::chrono::milliseconds control_poll{100};
  /// Bytes queued for our stdout or stderr beyond which the ranks' pipes of that stream are
  /// not read (so a slow reader slows the ranks' writes instead of growing our memory).
  std::size_t output_high_water = std::size_t{4} << 20;
  /// At exit, how long the last output may wait for a slow reader.
  std::chrono::milliseconds final_flush{5'000};
};

/// The live dashboard of the whole job (--dashboard): node 0's launcher serves it from the
/// ranks' telemetry, which it asks for by giving every rank BATON_DASHBOARD=1.
struct DashboardOptions {
  /// HOST:PORT (observe::parse_listen); empty: no dashboard. Other nodes ignore it.
  std::string listen;
  /// After the job, keep serving this long (Ctrl-C ends it sooner).
  std::chrono::milliseconds linger{0};
};

/// Runs this launcher's part of `plan` to the end and returns the launcher's exit code: 0 if
/// every rank exited 0; else the first failing rank's exit code, 128 + its signal, or 1.
/// Throws transport::TransportError if the control plane cannot be set up (a port in use,
/// node 0 unreachable), observe::DashboardError if the dashboard cannot (a bad address, a
/// port in use), before any rank has started.
int run_job(const Plan& plan, const Supervision& supervision = {}, const DashboardOptions& dashboard = {});

}  // namespace baton::launch
