// baton under a real Slurm cluster: one node, with munged, slurmctld and slurmd started by the
// CTest fixture (tests/slurm/cluster.sh, slurm.cluster.start / slurm.cluster.stop). Each test
// runs srun or sbatch as a user would, against the fixture's slurm.conf (SLURM_CONF from the
// state file BATON_SLURM_STATE names), and baton-launch adopts Slurm's layout in every task.
#include <doctest/doctest.h>

#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "mp/proc.h"
#include "serve/raw_http.h"
#include "skip.h"

using namespace std::chrono_literals;
using baton::test::json_number;
using baton::test::Proc;

namespace {

namespace fs = std::filesystem;

const std::string bin = BATON_BIN_DIR;
const std::string source_dir = BATON_SOURCE_DIR;

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

/// The fixture's cluster: SLURM_CONF, or why there is none (then the test has skipped).
struct Cluster {
  std::string conf;
  std::string dir;
};

std::optional<Cluster> cluster() {
  const char* state = std::getenv("BATON_SLURM_STATE");
  if (state == nullptr) {
    baton::test::skip(baton::test::Missing::slurm,
                      "BATON_SLURM_STATE is not set: run the Slurm tests through ctest, which starts the cluster");
    return std::nullopt;
  }
  std::ifstream in(state);
  std::map<std::string, std::string> values;
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) values[line.substr(0, eq)] = line.substr(eq + 1);
  }
  if (values.count("unavailable")) {
    baton::test::skip(baton::test::Missing::slurm, "no Slurm cluster here: " + values["unavailable"]);
    return std::nullopt;
  }
  if (!values.count("SLURM_CONF")) {
    FAIL_CHECK("the Slurm fixture left no cluster in ", state, " (did slurm.cluster.start fail? its output says why)");
    return std::nullopt;
  }
  return Cluster{values["SLURM_CONF"], values["dir"]};
}

/// A word no other process carries: marks this test's ranks in their environment.
std::string fresh_mark() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

/// The environment of every srun and sbatch here: the fixture's cluster, a master port of our
/// own, and a mark that finds this test's ranks in /proc.
std::map<std::string, std::string> slurm_env(const Cluster& c, const std::string& mark) {
  return {{"SLURM_CONF", c.conf},
          {"BATON_MASTER", fmt::format("127.0.0.1:{}", baton::test::free_port())},
          {"BATON_TEST_MARK", mark},
          // Whatever Slurm job this test itself may run under must not leak into the new one.
          {"SLURM_JOB_ID", ""},
          {"SLURM_JOBID", ""},
          {"SLURM_STEP_ID", ""},
          {"SLURM_PROCID", ""},
          {"SLURM_NTASKS", ""}};
}

/// The pids of baton-train processes whose environment holds BATON_TEST_MARK=mark, by BATON_RANK.
std::map<int, pid_t> marked_ranks(const std::string& mark) {
  std::map<int, pid_t> found;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const auto name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream cmd(entry.path() / "cmdline", std::ios::binary);
    std::string argv0;
    std::getline(cmd, argv0, '\0');
    if (!argv0.ends_with("baton-train")) continue;
    std::ifstream environ(entry.path() / "environ", std::ios::binary);
    std::optional<int> rank;
    bool marked = false;
    for (std::string var; std::getline(environ, var, '\0');) {
      if (var == "BATON_TEST_MARK=" + mark) marked = true;
      if (var.starts_with("BATON_RANK=")) rank = std::atoi(var.c_str() + 11);
    }
    if (marked && rank && baton::test::process_alive(std::stoi(name))) found[*rank] = std::stoi(name);
  }
  return found;
}

/// Waits until `n` marked ranks run (or the deadline); returns them.
std::map<int, pid_t> wait_for_ranks(const std::string& mark, std::size_t n, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto ranks = marked_ranks(mark);
  while (ranks.size() < n && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(100ms);
    ranks = marked_ranks(mark);
  }
  return ranks;
}

/// The job id of the job named `name` in the fixture's cluster, from squeue; empty if none.
std::string job_id(const Cluster& c, const std::string& name) {
  Proc q({"squeue", "-h", "-n", name, "-o", "%i"}, {{"SLURM_CONF", c.conf}});
  if (q.wait(20s) != 0) return "";
  std::string id = q.out();
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

/// Cancels the cluster's jobs named `name` when it goes, whatever the test did, and waits (10 s
/// at most) until squeue no longer lists them: a job a failed check left running would hold the
/// node's CPUs, and the next test's job would wait for them.
class CancelOnExit {
 public:
  CancelOnExit(const Cluster& c, std::string name) : conf_(c.conf), name_(std::move(name)) {}
  ~CancelOnExit() {
    Proc cancel({"scancel", "-n", name_}, {{"SLURM_CONF", conf_}});
    cancel.wait(20s);
    for (int i = 0; i < 100; ++i) {
      Proc q({"squeue", "-h", "-n", name_, "-o", "%i"}, {{"SLURM_CONF", conf_}});
      if (q.wait(10s) == 0 && q.out().empty()) return;
      std::this_thread::sleep_for(100ms);
    }
  }
  CancelOnExit(const CancelOnExit&) = delete;
  CancelOnExit& operator=(const CancelOnExit&) = delete;

 private:
  std::string conf_, name_;
};

// A short training both sides run: the MLP on synthetic data, plain SGD, 30 steps (tests/mp's).
const std::vector<std::string> train_args{"--model", "mlp", "--data", "synthetic", "--steps", "30", "--batch", "64",
                                          "--optimizer", "sgd", "--lr", "0.05", "--json"};

std::vector<std::string> with(std::vector<std::string> head, const std::vector<std::string>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

/// What two in-process replicas (baton-train --dp 2 in one process) reach: the reference every
/// rank layout must give. dp over ranks sums the same gradients in the same order, so the
/// tolerance is the one tests/mp uses for baton-launch: 1e-5 relative.
double in_process_loss() {
  Proc local(with(with({bin + "/baton-train"}, train_args), {"--dp", "2"}));
  REQUIRE(local.wait(60s) == 0);
  const double loss = json_number(local.out(), "final_loss");
  REQUIRE(std::isfinite(loss));
  return loss;
}

/// srun of a 2-rank dp job named `name` that trains until something ends it (scancel, a kill).
std::vector<std::string> endless_job(const std::string& name) {
  return {"srun", "-n", "2", "-J", name, bin + "/baton-launch", "--", bin + "/baton-train", "--model", "mlp",
          "--data", "synthetic", "--steps", "100000000", "--batch", "64", "--dp", "2"};
}

bool same_loss(double a, double b) { return std::abs(a - b) <= 1e-5 * std::max(1.0, std::abs(a)); }

}  // namespace

TEST_CASE("Slurm: srun -n 2 baton-launch -- baton-train --dp 2 gives the final loss of two in-process replicas" *
          doctest::timeout(180)) {
  const auto c = cluster();
  if (!c) return;
  const double reference = in_process_loss();
  const auto mark = fresh_mark();
  const CancelOnExit cleanup(*c, "baton-srun-dp2-" + mark);
  Proc job(with({"srun", "-n", "2", "-J", "baton-srun-dp2-" + mark, "--kill-on-bad-exit=1", bin + "/baton-launch", "--",
                 bin + "/baton-train"},
                with(train_args, {"--dp", "2"})),
           slurm_env(*c, mark));
  const int code = job.wait(120s);
  INFO(job.all());
  REQUIRE(code == 0);
  const double loss = json_number(job.out(), "final_loss");
  INFO("srun: ", loss, ", in-process: ", reference);
  CHECK(same_loss(loss, reference));
  CHECK(json_number(job.out(), "ranks") == 2);
  // Each task's launcher adopted Slurm's layout: one rank a task, the job's rendezvous.
  CHECK(contains(job.err(), "baton-launch: Slurm's layout: 2 tasks of 1 rank each, 2 ranks in all; master 127.0.0.1:"));
  // srun's step says both tasks are on this node: the ranks know they share a host, so the data
  // plane leaves TCP out, as under baton-launch alone.
  CHECK(contains(job.err(), "data plane: TLS=^cma,tcp, RNDV_THRESH=1048576 (every rank on this host)"));
  CHECK(marked_ranks(mark).empty());
}

TEST_CASE("Slurm: the sbatch script of docs/examples runs to completion and its output file holds the result" *
          doctest::timeout(240)) {
  const auto c = cluster();
  if (!c) return;
  const double reference = in_process_loss();
  const std::string script = source_dir + "/docs/examples/train.sbatch";
  REQUIRE(fs::exists(script));
  const fs::path work = fs::path(c->dir) / fmt::format("sbatch-{}", fresh_mark());
  fs::create_directories(work);
  const auto output = work / "train.out";
  const auto mark = fresh_mark();
  const std::string name = "baton-sbatch-" + mark;
  const CancelOnExit cleanup(*c, name);
  auto env = slurm_env(*c, mark);
  env["BATON_BIN"] = bin;
  // As the docs say: sbatch SCRIPT [baton-train arguments]; --wait returns when the job ends,
  // with its exit status.
  Proc submit(with({"sbatch", "--wait", "-J", name, "--chdir", work.string(), "--output", output.string(), script},
                   train_args),
              env);
  const int code = submit.wait(200s);
  std::ifstream in(output);
  std::stringstream text;
  text << in.rdbuf();
  INFO("sbatch: ", submit.all(), "\noutput file ", output.string(), ":\n", text.str());
  CHECK(code == 0);
  CHECK(contains(submit.out(), "Submitted batch job"));
  const double loss = json_number(text.str(), "final_loss");
  INFO("sbatch: ", loss, ", in-process: ", reference);
  CHECK(same_loss(loss, reference));
  CHECK(json_number(text.str(), "ranks") == 2);
}

TEST_CASE("Slurm: scancel of a running job step ends every rank within 10 s" * doctest::timeout(180)) {
  const auto c = cluster();
  if (!c) return;
  const auto mark = fresh_mark();
  const std::string name = "baton-scancel-" + mark;
  const CancelOnExit cleanup(*c, name);
  Proc job(endless_job(name), slurm_env(*c, mark));
  const auto ranks = wait_for_ranks(mark, 2, 60s);
  INFO(job.all());
  REQUIRE(ranks.size() == 2);
  // Mid-run: past the rendezvous (the ranks' output is buffered in a pipe, so time, not a line,
  // says so; tests/mp does the same).
  std::this_thread::sleep_for(2s);
  const auto id = job_id(*c, name);
  REQUIRE_FALSE(id.empty());
  const auto t0 = std::chrono::steady_clock::now();
  Proc cancel({"scancel", id + ".0"}, {{"SLURM_CONF", c->conf}});
  CHECK(cancel.wait(20s) == 0);
  // Every rank gone, and srun returned, within 10 s of scancel.
  std::map<int, pid_t> left = ranks;
  while (std::chrono::steady_clock::now() - t0 < 10s) {
    std::erase_if(left, [](const auto& r) { return !baton::test::process_alive(r.second); });
    if (left.empty()) break;
    std::this_thread::sleep_for(50ms);
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO("ranks still running ", std::chrono::duration<double>(took).count(), " s after scancel: ", left.size());
  CHECK(left.empty());
  const int code = job.wait(10s);
  INFO(job.all());
  CHECK(code != 0);
  CHECK(code != -1);  // srun ended by itself
  CHECK(contains(job.all(), "CANCELLED"));
}

TEST_CASE("Slurm: a rank killed under srun ends the step non-zero with the reason, as under baton-launch" *
          doctest::timeout(180)) {
  const auto c = cluster();
  if (!c) return;
  const auto mark = fresh_mark();
  const CancelOnExit cleanup(*c, "baton-kill-" + mark);
  Proc job(endless_job("baton-kill-" + mark), slurm_env(*c, mark));
  const auto ranks = wait_for_ranks(mark, 2, 60s);
  INFO(job.all());
  REQUIRE(ranks.size() == 2);
  std::this_thread::sleep_for(2s);  // mid-run
  const pid_t victim = ranks.at(1);
  REQUIRE(::kill(victim, SIGKILL) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  const int code = job.wait(30s);
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(job.all());
  CHECK(code != 0);
  CHECK(code != -1);  // srun ended by itself
  CHECK(took < 10s);
  // The launcher of task 1 names its rank and what ended it; the other rank's says the job was
  // aborted, naming rank 1.
  CHECK(contains(job.all(), fmt::format("rank 1 (host ")));
  CHECK(contains(job.all(), "killed by signal 9 (SIGKILL)"));
  for (const auto& [rank, pid] : ranks) {
    CAPTURE(rank);
    CHECK_FALSE(baton::test::process_alive(pid));
  }
}

// A parameter-server job under --staleness (docs/parameter-servers.md) under srun: 2 tasks of 2
// ranks, workers 0-2 and the server rank 3; worker rank 2, beside the server in task 1, is
// killed. Its launcher reports the departure and keeps the server, exits 0 when that finishes,
// and the step ends 0 with the job's result: srun (--kill-on-bad-exit=1 too) sees no bad exit.
TEST_CASE("Slurm: a parameter-server worker killed under srun leaves and the step finishes 0" * doctest::timeout(240)) {
  const auto c = cluster();
  if (!c) return;
  const auto mark = fresh_mark();
  const std::string name = "baton-ps-leave-" + mark;
  const CancelOnExit cleanup(*c, name);
  Proc job({"srun", "-n", "2", "-J", name, "--kill-on-bad-exit=1", bin + "/baton-launch", "--nproc-per-node", "2", "--",
            bin + "/baton-train", "--model", "mlp", "--data", "synthetic", "--dp", "3", "--sync", "ps", "--servers",
            "1", "--staleness", "2", "--steps", "6000", "--batch", "192", "--hidden", "256"},
           slurm_env(*c, mark));
  const auto ranks = wait_for_ranks(mark, 4, 60s);
  INFO(job.all());
  REQUIRE(ranks.size() == 4);
  std::this_thread::sleep_for(4s);  // mid-run: past the rendezvous (the output is buffered: time says so)
  REQUIRE(::kill(ranks.at(2), SIGKILL) == 0);
  const int code = job.wait(200s);
  INFO(job.all());
  CHECK(code == 0);
  CHECK(contains(job.all(), "left the job: it was killed by signal 9 (SIGKILL); the job goes on without it"));
  CHECK(contains(job.all(), "rank 2 (a worker) left the job at step"));
  CHECK(contains(job.all(), "done: 6000 steps"));
}

// baton-serve cut into 2 pipeline stages, one per Slurm task (srun -n 2 baton-launch --stop-grace
// -- baton-serve): it answers what one process answers (the same bits: the cut copies the hidden
// state whole), and scancel --signal=TERM of the step drains it: rank 0 finishes, tells rank 1
// to stop, and the step ends 0. Slurm signals every process of a task and the launcher forwards
// the signal too: rank 0 takes the two as one request (a drain, not a stop).
TEST_CASE("Slurm: baton-serve as two pipeline stages under srun answers as one process and drains on scancel" *
          doctest::timeout(240)) {
  const auto c = cluster();
  if (!c) return;
  const std::string key = "slurm-test-key-0123456789";
  const auto mark = fresh_mark();
  const fs::path work = fs::path(c->dir) / fmt::format("serve-{}", mark);
  fs::create_directories(work);
  {
    std::ofstream out(work / "fox.txt");
    for (int i = 0; i < 100; ++i) out << "the quick brown fox jumps over the lazy dog. ";
  }
  const std::string ckpt = (work / "ckpt").string();
  Proc train({bin + "/baton-train", "--model", "gpt", "--data", "text:" + (work / "fox.txt").string(), "--steps", "120",
              "--batch", "16", "--seq", "32", "--d-model", "32", "--heads", "4", "--layers", "2", "--checkpoint-dir",
              ckpt});
  REQUIRE(train.wait(120s) == 0);
  const std::string body = R"({"model":"gpt","prompt":"the quick","max_tokens":20,"temperature":0})";
  auto serving = [](Proc& p) {
    return p.read_until([](const std::string& out, const std::string& err) {
      return contains(out + err, "serving '") || contains(out + err, "error:");
    }, 90s);
  };
  std::string alone;
  {
    const auto port = baton::test::free_port();
    Proc one({bin + "/baton-serve", "--checkpoint", ckpt, "--listen", fmt::format("127.0.0.1:{}", port), "--api-key", key});
    REQUIRE(serving(one));
    alone = baton::test::completion_text(baton::test::raw_http_request(port, key, "POST", "/v1/completions", body));
    one.signal(SIGTERM);
    CHECK(one.wait(30s) == 0);
  }
  REQUIRE(alone.size() == 20);
  const std::string name = "baton-serve-" + mark;
  const CancelOnExit cleanup(*c, name);
  const auto port = baton::test::free_port();
  Proc job({"srun", "-n", "2", "-J", name, bin + "/baton-launch", "--stop-grace", "60", "--", bin + "/baton-serve",
            "--checkpoint", ckpt, "--listen", fmt::format("127.0.0.1:{}", port), "--api-key", key},
           slurm_env(*c, mark));
  const bool up = serving(job);
  INFO(job.all());
  REQUIRE(up);
  CHECK(contains(job.err(), "2 stages on 2 ranks"));
  CHECK(baton::test::completion_text(baton::test::raw_http_request(port, key, "POST", "/v1/completions", body)) == alone);
  const auto id = job_id(*c, name);
  REQUIRE_FALSE(id.empty());
  Proc cancel({"scancel", "--signal=TERM", id + ".0"}, {{"SLURM_CONF", c->conf}});
  CHECK(cancel.wait(20s) == 0);
  const int code = job.wait(60s);
  INFO(job.all());
  CHECK(code == 0);
  CHECK(contains(job.all(), "drained"));
  CHECK(contains(job.all(), "stopped (rank 0 said so)"));
}
