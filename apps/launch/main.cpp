// baton-launch: starts the ranks of a baton job, on this host or on several (modelled on
// torchrun and mpirun).
//
//   baton-launch --nproc-per-node 4 -- baton-train --model mlp
//   baton-launch --nnodes 2 --node-rank 0 --master node0:29500 --nproc-per-node 4 -- prog   (on
//   node0) baton-launch --nnodes 2 --node-rank 1 --master node0:29500 --nproc-per-node 4 -- prog
//   (on node1) baton-launch --hostfile hosts.txt -- prog           (ssh starts a launcher on every
//   other host) srun -N 2 --ntasks-per-node 1 baton-launch --nproc-per-node 4 -- prog   (adopts
//   Slurm's layout)
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "job.h"
#include "plan.h"

namespace {

using namespace baton::launch;

constexpr const char* footer = R"(
Every rank gets BATON_RANK (node_rank * nproc_per_node + local rank), BATON_WORLD_SIZE,
BATON_LOCAL_RANK, BATON_LOCAL_WORLD_SIZE, BATON_NODE_RANK, BATON_MASTER (host:port of the
job's rendezvous server, run by the launcher of node 0) and BATON_JOB_TOKEN. Each line a rank
writes is prefixed with "[RANK] ". SIGINT, SIGTERM and SIGHUP are forwarded to the ranks. When a
rank fails (non-zero exit, a signal) or the job is aborted on another node, the other ranks get
SIGTERM, then SIGKILL 3 s later; baton-launch exits with the failed rank's code (128 + signal if
it was killed).

Several nodes:
  --nnodes K --node-rank I --master HOST:PORT   one launcher per node, started by you; node 0
                                                serves the job at HOST:PORT
  --hosts h1,h2 | --hostfile FILE               run on h1 (this machine); ssh starts the others
                                                (FILE: one host per line, "slots=N" optional)
  under srun or mpirun (one launcher per task)  the layout is the scheduler's; --master defaults
                                                to $BATON_MASTER, else the first node:29500

Environment:
  BATON_BIND_TO    core or none, when --bind-to is not given
  BATON_JOB_TOKEN  the job token when --token is not given (default: a fresh one)
  BATON_MASTER     the master when --master is not given (several nodes)
  BATON_SSH        the ssh command for --hosts (default "ssh"), e.g. "ssh -p 2222")";

/// A launcher started with a closed stdout (or stdin) would hand that descriptor number to its
/// first pipe; the ranks' output would then go astray.
void ensure_standard_descriptors() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0) {
      const int null = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
      if (null >= 0 && null != fd) {
        ::dup2(null, fd);
        ::close(null);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ensure_standard_descriptors();
  CommandLine cli;
  std::int64_t nproc_per_node = 1, nnodes = 1, node_rank = 0;
  double finish_timeout_s = 300;
  double join_timeout_s = 120;
  baton::launch::DashboardOptions dashboard;
  double dashboard_linger_s = 0;
  std::int64_t max_restarts = 0;
  CLI::App app{
      "baton-launch: start the ranks of a baton job on this host or on several\n\n"
      "  baton-launch [OPTIONS] -- PROGRAM [ARGS...]\n"};
  app.name("baton-launch");
  app.footer(footer);
  app.prefix_command();  // PROGRAM and everything after it belong to the program
  app.add_option("--nproc-per-node,--nproc_per_node", nproc_per_node,
                 "ranks on this node (default 1)");
  app.add_option("--nnodes", nnodes, "nodes in the job (default 1)");
  app.add_option("--node-rank,--node_rank", node_rank,
                 "this node's index, 0 to nnodes-1 (default 0)");
  app.add_option("--master", cli.master, "HOST:PORT of node 0's rendezvous server");
  app.add_option("--hosts", cli.hosts,
                 "h1,h2,...: this machine (h1) and the hosts to ssh to; h:N gives N slots");
  app.add_option("--hostfile", cli.hostfile,
                 "a file of hosts, one a line (\"host slots=N\"; # comments)");
  app.add_option("--bind", cli.bind,
                 "ADDR: the interface node 0's rendezvous server listens on (default: loopback for one "
                 "node, every interface for several)");
  std::string bind_to;
  app.add_option("--bind-to", bind_to,
                 "core: each rank's threads on a block of this host's cores of its own (as mpirun --bind-to "
                 "core); none: where the scheduler puts them (default; sets BATON_BIND_TO for the ranks)")
      ->check(CLI::IsMember({"core", "none"}));
  app.add_option("--token", cli.token,
                 "the job token (default $BATON_JOB_TOKEN, else a fresh one)");
  app.add_option(
         "--finish-timeout", finish_timeout_s,
         "node 0 of several: seconds to wait for the other nodes after its own ranks are done")
      ->check(CLI::PositiveNumber);
  app.add_option("--join-timeout", join_timeout_s,
                 "seconds for the job to form: every rank and node joined, the master reached (default 120)")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-restarts", max_restarts,
                 "K: start a parameter-server worker rank that leaves (--sync ps --staleness S > 0) again, at "
                 "most K times each; it comes back at the servers' step (default 0: it stays gone)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--trace", cli.trace,
                 "FILE: the ranks record their acts; node 0 writes one Chrome trace of them all "
                 "(open it in ui.perfetto.dev or chrome://tracing)");
  app.add_option("--dashboard", dashboard.listen,
                 "serve a live dashboard of the whole job at HOST:PORT (:PORT or PORT: on 127.0.0.1; port 0: "
                 "any free one); node 0 serves it");
  double stop_grace_s = 0;
  app.add_option("--stop-grace", stop_grace_s,
                 "seconds the ranks have to stop on their own after SIGTERM or Ctrl-C to the launcher (a server "
                 "draining: baton-serve), the job ending as their exits say; default 0: the job ends at once")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dashboard-linger", dashboard_linger_s,
                 "keep the dashboard up this many seconds after the job ends")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (const auto dir = std::filesystem::path(cli.trace).parent_path(); !dir.empty() && !std::filesystem::is_directory(dir)) {
    fmt::print(stderr, "baton-launch: --trace {}: there is no directory '{}'\n", cli.trace, dir.string());
    return 2;
  }
  // The ranks (and, through the environment ssh forwards, other nodes' launchers) read it.
  if (!bind_to.empty()) setenv("BATON_BIND_TO", bind_to.c_str(), 1);
  dashboard.linger = std::chrono::milliseconds(static_cast<std::int64_t>(dashboard_linger_s * 1000));
  if (app.count("--nproc-per-node")) cli.nproc_per_node = nproc_per_node;
  if (app.count("--nnodes")) cli.nnodes = nnodes;
  if (app.count("--node-rank")) cli.node_rank = node_rank;
  cli.finish_timeout =
      std::chrono::milliseconds(static_cast<std::int64_t>(finish_timeout_s * 1000));
  cli.join_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(join_timeout_s * 1000));
  cli.program = app.remaining();
  if (!cli.program.empty() && cli.program.front() == "--") {
    cli.program.erase(cli.program.begin());
  } else if (!cli.program.empty() && cli.program.front().size() > 1 &&
             cli.program.front()[0] == '-') {
    // CLI11 hands an option it does not know to the program; it is more likely a typo.
    fmt::print(stderr,
               "baton-launch: unknown option '{}' (the program and its arguments go after --)\n"
               "Run with --help for more information.\n",
               cli.program.front());
    return 2;
  }

  Plan plan;
  try {
    plan = resolve_plan(cli, process_environment(), this_machine());
  } catch (const UsageError& e) {
    fmt::print(stderr, "baton-launch: {}\nRun with --help for more information.\n", e.what());
    return 2;
  }
  // Under srun or mpirun, say once (task 0) what was adopted: a user whose job does not form
  // sees at a glance whether the scheduler's layout was read as they meant.
  plan.max_restarts = static_cast<std::uint32_t>(max_restarts);
  if (!plan.scheduler.empty() && plan.node_rank == 0) {
    fmt::print(stderr, "baton-launch: {}'s layout: {} task{} of {} rank{} each, {} rank{} in all; master {}\n",
               plan.scheduler, plan.nnodes, plan.nnodes == 1 ? "" : "s", plan.nproc_per_node,
               plan.nproc_per_node == 1 ? "" : "s", plan.world_size(), plan.world_size() == 1 ? "" : "s",
               plan.master.empty() ? "(this process alone)" : plan.master);
  }
  if (!dashboard.listen.empty() && plan.node_rank != 0) {
    fmt::print(stderr, "baton-launch: --dashboard: node {} leaves the dashboard to node 0\n", plan.node_rank);
    dashboard.listen.clear();
  }
  try {
    Supervision supervision;
    supervision.stop_grace = std::chrono::milliseconds(static_cast<std::int64_t>(stop_grace_s * 1000));
    return run_job(plan, supervision, dashboard);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "baton-launch: {}\n", e.what());
    return 1;
  }
}
