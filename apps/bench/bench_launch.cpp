// baton-bench-launch: how long a job takes from the command to its end when it is one step of
// training, under each way users start one: mpirun and srun (on a one-node Slurm cluster) against
// baton-launch alone, the peer measured in the same run, interleaved. The job is what every
// launcher must do before the first step: start 2 ranks, form the job (rendezvous, UCX
// addresses, plan hashes), compile the plan, then one data-parallel step of the digits-sized MLP
// on synthetic data, and end. What differs is the launcher's own start (mpirun's daemons, srun's
// request to slurmctld and slurmd's slurmstepd) and its end.
//
// The Slurm case runs against the cluster $SLURM_CONF names, or, as root, starts one of its own
// with tests/slurm/cluster.sh (and stops it at the end). Without mpirun, or without a cluster
// and root, that case skips saying why (a failure under CI=true: apps/bench/skip.h).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "capture.h"
#include "json_line.h"
#include "skip.h"
#include "spawn.h"

namespace bench = baton::bench;
using bench::Clock;

namespace {

const std::vector<std::string> job_args{"--model", "mlp",  "--data", "synthetic", "--steps", "1",
                                        "--batch", "64",   "--dp",   "2"};

/// One run of `argv` (a launcher around baton-train); its wall seconds, or why it failed.
double run_once(const std::vector<std::string>& argv, const bench::Env& env, const std::string& what) {
  const auto t0 = Clock::now();
  auto [code, out] = bench::finish(bench::spawn(argv, env, true), t0 + std::chrono::seconds(120));
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (code != 0) {
    throw std::runtime_error(fmt::format("{}: the job failed (exit {}): {}", what, code, out.substr(0, 600)));
  }
  return s;
}

/// A Slurm cluster for the srun case: the one $SLURM_CONF names, or one started here.
class SlurmCluster {
 public:
  SlurmCluster() {
    if (const char* conf = std::getenv("SLURM_CONF"); conf != nullptr && *conf != '\0') {
      conf_ = conf;
      return;
    }
    const std::string script = std::string(BATON_SOURCE_DIR) + "/tests/slurm/cluster.sh";
    if (::geteuid() != 0) {
      why_not_ = "no $SLURM_CONF, and starting a cluster needs root";
      return;
    }
    if (!std::filesystem::exists(script)) {
      why_not_ = script + " is missing";
      return;
    }
    state_ = (std::filesystem::temp_directory_path() / fmt::format("baton-bench-launch-{}.state", ::getpid())).string();
    script_ = script;
    const int code = std::system(fmt::format("'{}' start '{}' >&2", script, state_).c_str());
    std::ifstream in(state_);
    for (std::string line; std::getline(in, line);) {
      if (line.starts_with("SLURM_CONF=")) conf_ = line.substr(11);
      if (line.starts_with("unavailable=")) why_not_ = line.substr(12);
    }
    if (conf_.empty() && why_not_.empty()) why_not_ = fmt::format("{} start failed (exit {})", script, code);
  }
  ~SlurmCluster() {
    if (!script_.empty()) std::system(fmt::format("'{}' stop '{}' >&2", script_, state_).c_str());
  }
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  bool ok() const { return !conf_.empty(); }
  const std::string& conf() const { return conf_; }
  const std::string& why_not() const { return why_not_; }

 private:
  std::string conf_, why_not_, state_, script_;
};

struct Launcher {
  std::string name;   // the case
  std::string shown;  // how a user types it
  std::function<std::vector<std::string>()> argv;
  std::function<bench::Env()> env;
};

std::string find_program(const char* name) {
  for (const char* dir : {"/usr/bin", "/usr/local/bin"}) {
    const std::string p = fmt::format("{}/{}", dir, name);
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  // The ranks keep both cores busy while they form; the launchers' daemons are idle meanwhile.
  bench::load().start(argc, argv, 2);
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "-h" || a == "--help") {
      fmt::print(
          "usage: baton-bench-launch [--quick]\n"
          "  The time of a one-step 2-rank job under mpirun and srun against baton-launch's.\n"
          "  --quick  two runs each instead of five (ctest's smoke)\n{}",
          bench::allow_load_usage);
      return 0;
    } else {
      fmt::print(stderr, "baton-bench-launch: unknown argument '{}' (--help lists them)\n", a);
      return 2;
    }
  }
  const std::string bin = bench::executable_dir();
  const std::string launch = bin + "/baton-launch", train = bin + "/baton-train";
  const int runs = quick ? 2 : 5;
  const std::string mpirun = find_program("mpirun");
  const std::string srun = find_program("srun");
  int rc = 0;
  std::optional<SlurmCluster> cluster;
  if (!srun.empty()) cluster.emplace();

  // Every launcher gets a master port of its own per run: the default 29500 may be taken.
  auto master_env = [] { return bench::Env{{"BATON_MASTER", fmt::format("127.0.0.1:{}", bench::free_port())}}; };
  auto with_job = [&](std::vector<std::string> head) {
    head.push_back(train);
    head.insert(head.end(), job_args.begin(), job_args.end());
    return head;
  };
  const Launcher baton_launch{"baton-launch", "baton-launch --nproc-per-node 2 -- baton-train ...",
                              [&] { return with_job({launch, "--nproc-per-node", "2", "--"}); },
                              [] { return bench::Env{}; }};
  std::vector<Launcher> peers;
  if (mpirun.empty()) {
    rc = std::max(rc, bench::skip("baton-bench-launch: launch_mpirun", "mpirun is not installed (Debian: openmpi-bin)"));
  } else {
    peers.push_back({"launch_mpirun", "mpirun -np 2 baton-launch -- baton-train ...",
                     [&] {
                       return with_job({mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x",
                                        "BATON_MASTER", launch, "--"});
                     },
                     master_env});
  }
  if (srun.empty()) {
    rc = std::max(rc, bench::skip("baton-bench-launch: launch_srun", "srun is not installed (Debian: slurm-wlm)"));
  } else if (!cluster->ok()) {
    rc = std::max(rc, bench::skip("baton-bench-launch: launch_srun", cluster->why_not()));
  } else {
    peers.push_back({"launch_srun", "srun -n 2 baton-launch -- baton-train ...",
                     [&] { return with_job({srun, "-n", "2", "-J", "baton-bench-launch", launch, "--"}); },
                     [&] {
                       auto env = master_env();
                       env["SLURM_CONF"] = cluster->conf();
                       return env;
                     }});
  }

  for (const Launcher& peer : peers) {
    try {
      // Interleaved, so that a slow spell of the machine hits both alike; the first run of
      // each warms the page cache and is not kept.
      std::vector<double> own, theirs;
      for (int r = 0; r <= runs; ++r) {
        const double a = run_once(baton_launch.argv(), baton_launch.env(), baton_launch.name);
        const double b = run_once(peer.argv(), peer.env(), peer.name);
        if (r == 0) continue;
        own.push_back(a);
        theirs.push_back(b);
      }
      std::sort(own.begin(), own.end());
      std::sort(theirs.begin(), theirs.end());
      bench::JsonLine("launch", peer.name)
          .add("value", theirs.front())
          .add("unit", "s")
          .better(bench::Better::lower)
          .add("reference", own.front())
          .compare("ratio", theirs.front(), own.front())
          .add("reference_is", baton_launch.shown)
          .add("launcher", peer.shown)
          .add("what", "a one-step 2-rank dp job from the command to its end: start, rendezvous, plan, one step")
          .add("stat", fmt::format("best of {}", runs))
          .add("median", theirs[theirs.size() / 2])
          .add("reference_median", own[own.size() / 2])
          .print();
      fmt::print(stderr, "{}: {:.3f} s against baton-launch's {:.3f} s (best of {})\n", peer.name, theirs.front(),
                 own.front(), runs);
    } catch (const std::exception& e) {
      fmt::print(stderr, "baton-bench-launch: {}\n", e.what());
      rc = 1;
    }
  }
  return rc;
}
