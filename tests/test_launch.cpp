// baton-launch: its pieces (host files, shell quoting, scheduler layouts, line prefixes) and
// the launcher itself, started as a process with `sh -c` programs as its ranks.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "output.h"
#include "plan.h"
#include "process.h"
#include "skip.h"

extern char** environ;

namespace {

using namespace baton::launch;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

const std::string launcher_path = BATON_BIN_DIR "/baton-launch";
const std::string rank_path =
    BATON_BIN_DIR "/baton-launch-rank";  // a rank that joins the control plane

// --- running the launcher --------------------------------------------------------------------

/// The environment the launcher runs in: ours, without anything that would make it adopt a
/// scheduler or pick up a master or token, plus `extra`.
std::vector<std::string> launcher_environment(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string entry(*e);
    if (entry.rfind("OMPI_", 0) == 0 || entry.rfind("SLURM_", 0) == 0 ||
        entry.rfind("PMIX_", 0) == 0 || entry.rfind("BATON_", 0) == 0) {
      continue;
    }
    env.push_back(entry);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

struct Finished {
  int status = -1;
  std::string out, err;
  double seconds = 0;

  bool exited() const { return WIFEXITED(status); }
  int code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
};

/// A process under test (the launcher, or mpirun around it), with its output collected.
class Process {
 public:
  explicit Process(std::vector<std::string> argv, const std::vector<std::string>& extra_env = {})
      : started_(Clock::now()) {
    child_ = spawn(SpawnRequest{std::move(argv), launcher_environment(extra_env)});
  }
  ~Process() {
    if (!status_) {
      ::kill(-child_.pid, SIGKILL);
      ::kill(child_.pid, SIGKILL);
      ::waitpid(child_.pid, nullptr, 0);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return child_.pid; }
  const std::string& out() const { return out_; }

  /// Reads output until `pattern` matches stdout `count` times, or `timeout` passes.
  bool wait_for_stdout(const std::string& text, int count, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      if (occurrences(out_, text) >= count) return true;
      pump(50ms);
      if (status_ && !child_.out && !child_.err) break;
    }
    return occurrences(out_, text) >= count;
  }

  /// Waits for the process to exit and its pipes to close; kills it after `timeout`.
  Finished finish(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while ((!status_ || child_.out || child_.err) && Clock::now() < deadline) pump(50ms);
    if (!status_) {
      FAIL_CHECK("the launcher did not exit within ", timeout.count(), " ms; stdout so far:\n",
                 out_, "\nstderr:\n", err_);
      ::kill(-child_.pid, SIGKILL);
      ::kill(child_.pid, SIGKILL);
      int status = 0;
      ::waitpid(child_.pid, &status, 0);
      status_ = status;
      stopped_ = Clock::now();
    }
    return Finished{*status_, out_, err_,
                    std::chrono::duration<double>(*stopped_ - started_).count()};
  }

 private:
  static int occurrences(const std::string& haystack, const std::string& needle) {
    int n = 0;
    for (auto at = haystack.find(needle); at != std::string::npos;
         at = haystack.find(needle, at + 1))
      ++n;
    return n;
  }

  void pump(std::chrono::milliseconds wait) {
    pollfd fds[2] = {{child_.out.get(), POLLIN, 0}, {child_.err.get(), POLLIN, 0}};
    ::poll(fds, 2, static_cast<int>(wait.count()));
    read_from(child_.out, out_);
    read_from(child_.err, err_);
    if (!status_) {
      int status = 0;
      if (::waitpid(child_.pid, &status, WNOHANG) == child_.pid) {
        status_ = status;
        stopped_ = Clock::now();
      }
    }
  }

  static void read_from(Fd& fd, std::string& into) {
    if (!fd) return;
    char buffer[65536];
    for (;;) {
      const ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
      if (n > 0) {
        into.append(buffer, static_cast<std::size_t>(n));
        continue;
      }
      if (n == 0) fd.reset();
      return;
    }
  }

  Clock::time_point started_;
  std::optional<Clock::time_point> stopped_;
  Spawned child_;
  std::optional<int> status_;
  std::string out_, err_;
};

std::vector<std::string> launch_args(std::vector<std::string> options, const std::string& script) {
  std::vector<std::string> argv{launcher_path};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.insert(argv.end(), {"--", "sh", "-c", script});
  return argv;
}

Finished launch(std::vector<std::string> options, const std::string& script,
                const std::vector<std::string>& extra_env = {},
                std::chrono::milliseconds timeout = 40s) {
  Process p(launch_args(std::move(options), script), extra_env);
  return p.finish(timeout);
}

/// Every line of `text` that starts with "[R] ", as R -> the rest of the lines.
std::map<int, std::vector<std::string>> lines_by_rank(const std::string& text) {
  std::map<int, std::vector<std::string>> out;
  static const std::regex line(R"(^\[(\d+)\] (.*)$)");
  std::size_t start = 0;
  while (start < text.size()) {
    auto end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string one = text.substr(start, end - start);
    std::smatch m;
    if (std::regex_match(one, m, line)) out[std::stoi(m[1])].push_back(m[2]);
    start = end + 1;
  }
  return out;
}

/// "KEY=value" words of a line.
std::map<std::string, std::string> fields(const std::string& line) {
  std::map<std::string, std::string> out;
  std::size_t start = 0;
  while (start < line.size()) {
    auto end = line.find(' ', start);
    if (end == std::string::npos) end = line.size();
    const std::string word = line.substr(start, end - start);
    if (const auto eq = word.find('='); eq != std::string::npos)
      out[word.substr(0, eq)] = word.substr(eq + 1);
    start = end + 1;
  }
  return out;
}

/// The process has exited (a zombie whose parent is gone counts: it runs no more).
bool pid_is_gone(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string pid_text, command, state;
  stat >> pid_text >> command >> state;
  return !stat || state == "Z" || state == "X";
}

/// Pids printed by the ranks as "pid N".
std::vector<pid_t> printed_pids(const std::string& out) {
  std::vector<pid_t> pids;
  static const std::regex pid_line(R"(\] pid (\d+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), pid_line);
       it != std::sregex_iterator(); ++it) {
    pids.push_back(static_cast<pid_t>(std::stoi((*it)[1])));
  }
  return pids;
}

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  socklen_t size = sizeof address;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
  ::close(fd);
  return ntohs(address.sin_port);
}

const char* env_script =
    "echo RANK=$BATON_RANK WORLD=$BATON_WORLD_SIZE LOCAL=$BATON_LOCAL_RANK "
    "LOCAL_WORLD=$BATON_LOCAL_WORLD_SIZE "
    "NODE=$BATON_NODE_RANK MASTER=$BATON_MASTER TOKEN=$BATON_JOB_TOKEN";

/// A temporary directory, removed with its files at the end.
struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/baton-launch-test-XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() { (void)!std::system(fmt::format("rm -rf '{}'", path).c_str()); }
  std::string write(const std::string& name, const std::string& text,
                    bool executable = false) const {
    const std::string file = path + "/" + name;
    std::ofstream(file) << text;
    if (executable) ::chmod(file.c_str(), 0755);
    return file;
  }
};

/// An ssh stand-in: drops the options and the host and runs the command with sh -c, as sshd
/// would; it also records its arguments.
std::string write_fake_ssh(const TempDir& dir) {
  return dir.write(
      "fake-ssh",
      "#!/bin/sh\n"
      "for a in \"$@\"; do printf '%s\\n' \"$a\"; done >> \"$(dirname \"$0\")/ssh-args\"\n"
      "while [ $# -gt 1 ]; do shift; done\n"
      "exec sh -c \"$1\"\n",
      true);
}

}  // namespace

// --- the pieces --------------------------------------------------------------------------------

TEST_CASE("Launch.Hostfile.ReadsHostsSlotsAndComments" * doctest::timeout(60)) {
  const auto hosts = parse_hostfile(
      "# the cluster\nnode1 slots=4\n\n  node2   slots=4 max_slots=8  # fast\nnode3\n",
      "hosts.txt");
  REQUIRE(hosts.size() == 3);
  CHECK(hosts[0].host == "node1");
  CHECK(hosts[0].slots == 4u);
  CHECK(hosts[1].host == "node2");
  CHECK(hosts[1].slots == 4u);
  CHECK(hosts[2].host == "node3");
  CHECK_FALSE(hosts[2].slots.has_value());
  CHECK_THROWS_WITH_AS(parse_hostfile("a\nb slots=x\n", "hosts.txt"),
                       "hosts.txt:2: 'slots=x' must be a positive number", UsageError);
  CHECK_THROWS_WITH_AS(parse_hostfile("a cpus=3\n", "f"),
                       "f:1: 'cpus=3' is not understood (expected HOST [slots=N])", UsageError);

  const auto list = parse_host_list("a:2,b:2");
  REQUIRE(list.size() == 2);
  CHECK(list[1].host == "b");
  CHECK(list[1].slots == 2u);
  CHECK(parse_host_list("fe80::1,h").at(0).host == "fe80::1");
  CHECK_THROWS_AS(parse_host_list("a,,b"), UsageError);
}

TEST_CASE("Launch.ShellQuote.SurvivesTheShell" * doctest::timeout(60)) {
  CHECK(shell_quote("plain-word_1.2/x=y") == "plain-word_1.2/x=y");
  CHECK(shell_quote("") == "''");
  CHECK(shell_quote("it's") == "'it'\\''s'");
  const std::vector<std::string> words = {"a b",         "it's",      "\"dq\"", "$HOME", "`x`",
                                          "back\\slash", "tab\there", "*",      ""};
  std::string command = "printf '%s\\n'";
  for (const auto& w : words) command += " " + shell_quote(w);
  Process p({"sh", "-c", command});
  const auto done = p.finish(10s);
  std::string expected;
  for (const auto& w : words) expected += w + "\n";
  CHECK(done.out == expected);
}

TEST_CASE("Launch.LinePrefixer.PrefixesWholeLinesAndFlushesTheRest" * doctest::timeout(60)) {
  LinePrefixer lines("[7] ", 8);
  std::string out;
  lines.feed("one\ntw", out);
  CHECK(out == "[7] one\n");
  lines.feed("o\nthree", out);
  CHECK(out == "[7] one\n[7] two\n");
  lines.feed("45678901", out);  // a line longer than 8 is cut
  CHECK(out == "[7] one\n[7] two\n[7] three456\n");
  lines.finish(out);
  CHECK(out == "[7] one\n[7] two\n[7] three456\n[7] 78901\n");
}

TEST_CASE("Launch.Scheduler.AdoptsOpenMpiAndSlurmLayouts" * doctest::timeout(60)) {
  std::map<std::string, std::string> vars;
  const Environment env = [&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  const ThisMachine machine{[](const std::string& h) { return h == "localhost"; }, "thishost"};
  CommandLine cli;
  cli.program = {"prog"};

  SUBCASE("no scheduler: one node, a free port on loopback") {
    const Plan plan = resolve_plan(cli, env, machine);
    CHECK(plan.nnodes == 1);
    CHECK(plan.bind_port == 0);
    CHECK(plan.bind_host == "127.0.0.1");
  }
  SUBCASE("mpirun: one launcher per task, a token from the job id") {
    vars = {{"OMPI_COMM_WORLD_RANK", "1"},
            {"OMPI_COMM_WORLD_SIZE", "2"},
            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
            {"OMPI_MCA_ess_base_jobid", "12345"}};
    const Plan plan = resolve_plan(cli, env, machine);
    CHECK(plan.scheduler == "OpenMPI");
    CHECK(plan.nnodes == 2);
    CHECK(plan.node_rank == 1);
    CHECK(plan.nproc_per_node == 1);
    CHECK(plan.first_rank() == 1);
    CHECK(plan.local_rank_base == 1);
    CHECK(plan.local_world_size == 2);
    CHECK(plan.master == "127.0.0.1:29500");
    CHECK(plan.token == "openmpi-job-12345");
    CHECK_FALSE(plan.hand_out_token);
  }
  SUBCASE("mpirun with BATON_MASTER and no job id: the server hands the token out") {
    vars = {{"OMPI_COMM_WORLD_RANK", "0"},
            {"OMPI_COMM_WORLD_SIZE", "3"},
            {"BATON_MASTER", "10.0.0.1:4000"}};
    const Plan plan = resolve_plan(cli, env, machine);
    CHECK(plan.master == "10.0.0.1:4000");
    CHECK(plan.bind_port == 4000);
    CHECK(plan.bind_host == "0.0.0.0");
    CHECK(plan.token.empty());
    CHECK(plan.hand_out_token);
  }
  SUBCASE("srun: the step's first node is the master") {
    vars = {{"SLURM_PROCID", "3"},
            {"SLURM_NTASKS", "4"},
            {"SLURM_LOCALID", "1"},
            {"SLURM_STEP_ID", "0"},
            {"SLURM_JOB_ID", "777"},
            {"SLURM_NTASKS_PER_NODE", "2"},
            {"SLURM_STEP_NODELIST", "gpu[07-08,11],cpu1"}};
    cli.nproc_per_node = 2;
    const Plan plan = resolve_plan(cli, env, machine);
    CHECK(plan.scheduler == "Slurm");
    CHECK(plan.nnodes == 4);
    CHECK(plan.node_rank == 3);
    CHECK(plan.first_rank() == 6);
    CHECK(plan.world_size() == 8);
    CHECK(plan.local_rank_base == 2);
    CHECK(plan.local_world_size == 4);
    CHECK(plan.master == "gpu07:29500");
    CHECK(plan.token == "slurm-job-777.0");
  }
  SUBCASE("srun without --ntasks-per-node: the step's own tasks per node give the local size") {
    vars = {{"SLURM_PROCID", "1"},
            {"SLURM_NTASKS", "2"},
            {"SLURM_LOCALID", "1"},
            {"SLURM_STEP_ID", "0"},
            {"SLURM_JOB_ID", "9"},
            {"SLURM_STEP_TASKS_PER_NODE", "2"},
            {"SLURM_STEP_NODELIST", "vm"}};
    const Plan plan = resolve_plan(cli, env, machine);
    CHECK(plan.local_rank_base == 1);
    CHECK(plan.local_world_size == 2);  // both ranks on one host: shared memory, no TCP
    vars["SLURM_STEP_TASKS_PER_NODE"] = "4(x3)";
    CHECK(resolve_plan(cli, env, machine).local_world_size == 4);
    vars["SLURM_STEP_TASKS_PER_NODE"] = "2,1";  // uneven: unknown, each task alone
    CHECK(resolve_plan(cli, env, machine).local_world_size == 1);
  }
  SUBCASE("a Slurm batch script (no step) is not one task of many") {
    vars = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "777"}};
    CHECK(resolve_plan(cli, env, machine).nnodes == 1);
  }
  SUBCASE("--nnodes 1 opts out of adoption") {
    vars = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}};
    cli.nnodes = 1;
    CHECK(resolve_plan(cli, env, machine).nnodes == 1);
  }
  CHECK(first_slurm_host("n1") == "n1");
  CHECK(first_slurm_host("n[1-4]-ib,m") == "n1-ib");
}

TEST_CASE("Launch.Plan.RejectsBadInputByName" * doctest::timeout(60)) {
  const Environment env = [](const std::string&) -> std::optional<std::string> {
    return std::nullopt;
  };
  const ThisMachine machine{
      [](const std::string& h) { return h == "localhost" || h == "thishost"; }, "thishost"};
  CommandLine cli;
  cli.program = {"prog"};
  const auto error = [&](const CommandLine& c) {
    try {
      resolve_plan(c, env, machine);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  {
    CommandLine c = cli;
    c.program.clear();
    CHECK(error(c).find("no program to run") != std::string::npos);
  }
  {
    CommandLine c = cli;
    c.nproc_per_node = 0;
    CHECK(error(c) == "--nproc-per-node must be between 1 and 65535, not 0");
  }
  {
    CommandLine c = cli;
    c.nnodes = 2;
    c.node_rank = 2;
    c.master = "h:1";
    CHECK(error(c) == "--node-rank 2 is out of range: --nnodes 2 gives nodes 0 to 1");
  }
  {
    CommandLine c = cli;
    c.nnodes = 2;
    CHECK(error(c).find("--nnodes 2 needs --master HOST:PORT") == 0);
  }
  {
    CommandLine c = cli;
    c.nnodes = 2;
    c.master = "nocolon";
    CHECK(error(c).find("--master 'nocolon' is not HOST:PORT") == 0);
  }
  {
    CommandLine c = cli;
    c.hosts = "elsewhere,thishost";
    CHECK(error(c).find("the first host, 'elsewhere', is not this machine") != std::string::npos);
  }
  {
    CommandLine c = cli;
    c.hosts = "thishost:2,other:4";
    CHECK(error(c).find("the hosts have different slots (2, 4)") != std::string::npos);
  }
  {
    CommandLine c = cli;
    c.hostfile = "/nonexistent/hosts";
    CHECK(error(c) == "--hostfile: cannot read '/nonexistent/hosts': No such file or directory");
  }
  {
    CommandLine c = cli;
    c.hosts = "thishost,other";
    c.nnodes = 2;
    CHECK(error(c) == "--hosts decides the nodes: leave out --nnodes and --node-rank");
  }
  {
    CommandLine c = cli;
    c.hosts = "localhost:2,other:2";
    const Plan plan = resolve_plan(c, env, machine);
    CHECK(plan.nnodes == 2);
    CHECK(plan.nproc_per_node == 2);
    CHECK(plan.remote_hosts == std::vector<std::string>{"other"});
    CHECK(plan.master_host == "thishost");  // "localhost" would mean "other" itself there
    CHECK(plan.bind_host == "0.0.0.0");
  }
  {
    CommandLine c = cli;
    c.hosts = "localhost:2,other:2";
    c.bind = "10.1.2.3";  // the user names the interface: not every interface
    CHECK(resolve_plan(c, env, machine).bind_host == "10.1.2.3");
    c.bind = "a b";
    CHECK(error(c) == "--bind 'a b': expected an address or host name (e.g. 10.0.0.1, ::1, node0)");
  }
}

TEST_CASE("Launch.RemoteCommand.QuotesEveryWord" * doctest::timeout(60)) {
  Plan plan;
  plan.nnodes = 3;
  plan.nproc_per_node = 2;
  plan.program = {"prog", "a b", "it's"};
  CHECK(remote_command(plan, 2, "h0:5000", "tok", "/opt/baton launch", "/home/me") ==
        "cd /home/me && exec '/opt/baton launch' --nnodes 3 --node-rank 2 --master h0:5000 --token "
        "tok "
        "--nproc-per-node 2 -- prog 'a b' 'it'\\''s'");
  const Environment env = [](const std::string& name) -> std::optional<std::string> {
    if (name == "BATON_SSH") return std::string("ssh -p 2222");
    return std::nullopt;
  };
  CHECK(ssh_prefix(env) == std::vector<std::string>{"ssh", "-p", "2222", "-o", "BatchMode=yes",
                                                    "-o", "StrictHostKeyChecking=accept-new"});
}

TEST_CASE("Launch.RemoteCommand.CarriesUcxAndBatonSettings" * doctest::timeout(60)) {
  const auto forward = forwarded_environment(
      {"UCX_TLS=tcp", "BATON_RANK=3", "PATH=/bin", "BATON_JOIN_TIMEOUT=5 s", "BATON_SSH=ssh -p 1", "UCX_X"});
  CHECK(forward == std::vector<std::string>{"UCX_TLS=tcp", "BATON_JOIN_TIMEOUT=5 s"});
  Plan plan;
  plan.nnodes = 2;
  plan.program = {"prog"};
  CHECK(remote_command(plan, 1, "h0:5000", "tok", "/opt/bl", "/w", forward) ==
        "cd /w && exec env UCX_TLS=tcp 'BATON_JOIN_TIMEOUT=5 s' /opt/bl --nnodes 2 --node-rank 1 --master h0:5000 "
        "--token tok --nproc-per-node 1 -- prog");
}

// --- the launcher, end to end ----------------------------------------------------------------

TEST_CASE("Launch.TwoRanksGetTheirEnvironmentAndPrefixedOutput" * doctest::timeout(60)) {
  const auto done = launch({"--nproc-per-node", "2"},
                           std::string(env_script) + "; echo to-stderr >&2; printf 'no newline'");
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 0);
  const auto out = lines_by_rank(done.out);
  const auto err = lines_by_rank(done.err);
  REQUIRE(out.size() == 2);
  std::set<std::string> tokens;
  for (int rank : {0, 1}) {
    REQUIRE(out.count(rank));
    REQUIRE(out.at(rank).size() == 2);
    const auto f = fields(out.at(rank)[0]);
    CHECK(f.at("RANK") == std::to_string(rank));
    CHECK(f.at("WORLD") == "2");
    CHECK(f.at("LOCAL") == std::to_string(rank));
    CHECK(f.at("LOCAL_WORLD") == "2");
    CHECK(f.at("NODE") == "0");
    CHECK(std::regex_match(f.at("MASTER"), std::regex(R"(127\.0\.0\.1:\d+)")));
    CHECK(f.at("MASTER") != "127.0.0.1:0");
    CHECK(f.at("TOKEN").size() >= 16);
    tokens.insert(f.at("TOKEN"));
    CHECK(out.at(rank)[1] == "no newline");  // the partial last line, flushed at EOF
    REQUIRE(err.count(rank));
    CHECK(err.at(rank) == std::vector<std::string>{"to-stderr"});
  }
  CHECK(tokens.size() == 1);
}

TEST_CASE("Launch.RankExitCodeEndsTheJob" * doctest::timeout(60)) {
  const auto done =
      launch({"--nproc-per-node", "2"},
             "if [ $BATON_RANK = 1 ]; then sleep 0.3; exit 3; fi; echo pid $$; sleep 100");
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 3);
  CHECK(done.seconds < 10);
  CHECK(std::regex_search(
      done.err, std::regex(R"(baton-launch: rank 1 \(host [^,]+, pid \d+\) exited with code 3)")));
  const auto pids = printed_pids(done.out);
  REQUIRE(pids.size() == 1);
  CHECK(pid_is_gone(pids[0]));
}

TEST_CASE("Launch.KilledRankIsNamedWithItsSignal" * doctest::timeout(60)) {
  const auto done =
      launch({"--nproc-per-node", "2"},
             "echo pid $$; if [ $BATON_RANK = 1 ]; then sleep 0.3; kill -9 $$; fi; sleep 100");
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 128 + 9);
  CHECK(done.seconds < 10);
  CHECK(std::regex_search(
      done.err,
      std::regex(R"(rank 1 \(host [^,]+, pid \d+\) was killed by signal 9 \(SIGKILL\))")));
  const auto pids = printed_pids(done.out);
  REQUIRE(pids.size() == 2);
  for (pid_t pid : pids) CHECK(pid_is_gone(pid));
}

TEST_CASE("Launch.SigtermIsForwardedToEveryRank" * doctest::timeout(60)) {
  Process p(
      launch_args({"--nproc-per-node", "2"},
                  "trap 'echo got TERM; exit 0' TERM; echo ready; while true; do sleep 0.1; done"));
  REQUIRE(p.wait_for_stdout("ready", 2, 20s));
  ::kill(p.pid(), SIGTERM);
  const auto done = p.finish(20s);
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 128 + SIGTERM);
  const auto out = lines_by_rank(done.out);
  for (int rank : {0, 1}) {
    REQUIRE(out.count(rank));
    CHECK(out.at(rank).back() == "got TERM");
  }
  CHECK(done.err.find("baton-launch: received SIGTERM") != std::string::npos);
}

TEST_CASE("Launch.RankIgnoringSigtermIsKilledAfterTheGrace" * doctest::timeout(60)) {
  Process p(launch_args({"--nproc-per-node", "2"},
                        "trap '' TERM; echo pid $$; echo ready; while true; do sleep 0.1; done"));
  REQUIRE(p.wait_for_stdout("ready", 2, 20s));
  const auto signalled = Clock::now();
  ::kill(p.pid(), SIGTERM);
  const auto done = p.finish(20s);
  const double seconds = std::chrono::duration<double>(Clock::now() - signalled).count();
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 128 + SIGTERM);
  CHECK(seconds > 2);
  CHECK(seconds < 10);
  for (pid_t pid : printed_pids(done.out)) CHECK(pid_is_gone(pid));
}

TEST_CASE("Launch.StopGraceLetsTheRanksStopOnTheirOwn" * doctest::timeout(60)) {
  // --stop-grace (a server draining): the ranks get SIGTERM and stop on their own, 1 s later
  // here; every rank exits 0, so the job does.
  Process p(launch_args({"--nproc-per-node", "2", "--stop-grace", "20"},
                        "trap 'sleep 1; echo drained; exit 0' TERM; echo ready; while true; do sleep 0.1; done"));
  REQUIRE(p.wait_for_stdout("ready", 2, 20s));
  ::kill(p.pid(), SIGTERM);
  const auto done = p.finish(30s);
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 0);
  const auto out = lines_by_rank(done.out);
  for (int rank : {0, 1}) {
    REQUIRE(out.count(rank));
    CHECK(out.at(rank).back() == "drained");
  }
  CHECK(done.err.find("have 20 s to stop on their own") != std::string::npos);
}

TEST_CASE("Launch.StopGraceEndsTheJobWhenARankDoesNotStop" * doctest::timeout(60)) {
  // A rank that ignores SIGTERM: at the end of --stop-grace the job ends as for any failure
  // (SIGKILL after the term grace), with the signal's exit code and the reason.
  Process p(launch_args({"--nproc-per-node", "2", "--stop-grace", "1"},
                        "trap '' TERM; echo pid $$; echo ready; while true; do sleep 0.1; done"));
  REQUIRE(p.wait_for_stdout("ready", 2, 20s));
  const auto signalled = Clock::now();
  ::kill(p.pid(), SIGTERM);
  const auto done = p.finish(30s);
  const double seconds = std::chrono::duration<double>(Clock::now() - signalled).count();
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 128 + SIGTERM);
  CHECK(seconds > 1);
  CHECK(seconds < 15);
  CHECK(done.err.find("did not stop within --stop-grace 1 s of SIGTERM") != std::string::npos);
  for (pid_t pid : printed_pids(done.out)) CHECK(pid_is_gone(pid));
}

TEST_CASE("Launch.RanksDieWithTheLauncher" * doctest::timeout(60)) {
  Process p(launch_args({"--nproc-per-node", "2"}, "echo pid $$; exec sleep 100"));
  REQUIRE(p.wait_for_stdout("pid", 2, 20s));
  const auto pids = printed_pids(p.out());
  REQUIRE(pids.size() == 2);
  ::kill(p.pid(), SIGKILL);  // no chance to clean up: PR_SET_PDEATHSIG must do it
  p.finish(20s);
  const auto deadline = Clock::now() + 10s;
  while (Clock::now() < deadline && !(pid_is_gone(pids[0]) && pid_is_gone(pids[1]))) {
    std::this_thread::sleep_for(50ms);
  }
  CHECK(pid_is_gone(pids[0]));
  CHECK(pid_is_gone(pids[1]));
}

TEST_CASE("Launch.ProgramNotFoundIsReported" * doctest::timeout(60)) {
  Process p({launcher_path, "--nproc-per-node", "2", "--", "baton-no-such-program", "x"});
  const auto done = p.finish(20s);
  INFO("stderr:\n", done.err);
  CHECK(done.code() == 127);
  CHECK(done.err.find("rank 0 (host ") != std::string::npos);
  CHECK(done.err.find("cannot execute 'baton-no-such-program': No such file or directory") !=
        std::string::npos);
}

TEST_CASE("Launch.BadCommandLinesGetClearErrors" * doctest::timeout(60)) {
  const auto run = [](std::vector<std::string> args) {
    args.insert(args.begin(), launcher_path);
    Process p(args);
    return p.finish(20s);
  };
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "no program to run"},
      {{"--nproc-per-node", "0", "--", "true"},
       "--nproc-per-node must be between 1 and 65535, not 0"},
      {{"--nnodes", "2", "--node-rank", "5", "--master", "127.0.0.1:1", "--", "true"},
       "--node-rank 5 is out of range"},
      {{"--nnodes", "2", "--master", "127.0.0.1", "--", "true"},
       "--master '127.0.0.1' is not HOST:PORT"},
      {{"--hostfile", "/nonexistent/hostfile", "--", "true"},
       "cannot read '/nonexistent/hostfile'"},
      {{"--nproc", "2", "--", "true"}, "unknown option '--nproc'"},
  };
  for (const auto& [args, message] : cases) {
    const auto done = run(args);
    INFO("args: ", fmt::format("{}", fmt::join(args, " ")), "\nstderr:\n", done.err);
    CHECK(done.code() == 2);
    CHECK(done.err.find(message) != std::string::npos);
  }
}

TEST_CASE("Launch.MasterPortInUseIsNamed" * doctest::timeout(60)) {
  // Hold a listening socket on a port, then ask the launcher to serve there.
  const int holder = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(holder, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  REQUIRE(::listen(holder, 1) == 0);
  socklen_t size = sizeof address;
  ::getsockname(holder, reinterpret_cast<sockaddr*>(&address), &size);
  const int port = ntohs(address.sin_port);
  const auto done = launch({"--master", fmt::format("127.0.0.1:{}", port)}, "echo ran");
  ::close(holder);
  INFO("stderr:\n", done.err);
  CHECK(done.code() == 1);
  CHECK(done.err.find(fmt::format("127.0.0.1:{}", port)) != std::string::npos);
  CHECK(done.err.find("rendezvous server") != std::string::npos);
  CHECK(done.out.find("ran") == std::string::npos);
}

TEST_CASE("Launch.SlowReaderDoesNotHoldUpTheEndOfAFailedJob" * doctest::timeout(60)) {
  // Rank 0 writes without end; nobody reads the launcher's stdout for a while. Rank 1's
  // failure must still end the job on time.
  Process p(
      launch_args({"--nproc-per-node", "2"},
                  "if [ $BATON_RANK = 1 ]; then sleep 0.5; exit 4; fi; yes 'a line of output'"));
  std::this_thread::sleep_for(3s);
  const auto done = p.finish(20s);
  INFO("stderr:\n", done.err);
  CHECK(done.code() == 4);
  CHECK(done.seconds < 15);
  CHECK(done.err.find("rank 1 (host") != std::string::npos);
}

TEST_CASE("Launch.HostsStartTheOtherNodesOverSsh" * doctest::timeout(60)) {
  TempDir dir;
  const std::string ssh = write_fake_ssh(dir);
  Process p({launcher_path, "--hosts", "localhost:2,127.0.0.2:2", "--", "sh", "-c",
             std::string(env_script) + " ARGS=\"$1|$2|$3\"", "argv0", "two words",
             "it's \"quoted\"", "$HOME"},
            {"BATON_SSH=" + ssh + " -p 2222"});
  const auto done = p.finish(40s);
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 0);
  const auto out = lines_by_rank(done.out);
  REQUIRE(out.size() == 4);
  std::set<std::string> tokens, masters;
  for (int rank = 0; rank < 4; ++rank) {
    REQUIRE(out.count(rank));
    const std::string& line = out.at(rank).at(0);
    const auto f = fields(line);
    CHECK(f.at("RANK") == std::to_string(rank));
    CHECK(f.at("WORLD") == "4");
    CHECK(f.at("NODE") == std::to_string(rank / 2));
    CHECK(f.at("LOCAL") == std::to_string(rank % 2));
    tokens.insert(f.at("TOKEN"));
    masters.insert(f.at("MASTER"));
    CHECK(line.find("ARGS=two words|it's \"quoted\"|$HOME") != std::string::npos);
  }
  CHECK(tokens.size() == 1);
  CHECK(masters.size() == 1);
  // The ssh command line: our options, then the host, then one command word.
  std::ifstream recorded(dir.path + "/ssh-args");
  std::vector<std::string> args;
  for (std::string line; std::getline(recorded, line);) args.push_back(line);
  REQUIRE(args.size() >= 8);
  CHECK(args[0] == "-p");
  CHECK(args[1] == "2222");
  CHECK(args[2] == "-o");
  CHECK(args[3] == "BatchMode=yes");
  CHECK(args[5] == "StrictHostKeyChecking=accept-new");
  CHECK(args[6] == "127.0.0.2");
  CHECK(args[7].find("--nnodes 2 --node-rank 1 --master 127.0.0.1:") != std::string::npos);
}

TEST_CASE("Launch.FailureOnAnSshNodeEndsTheJob" * doctest::timeout(60)) {
  TempDir dir;
  const std::string ssh = write_fake_ssh(dir);
  Process p(
      launch_args({"--hosts", "127.0.0.1,127.0.0.2"},
                  "echo pid $$; if [ $BATON_RANK = 1 ]; then sleep 0.5; exit 6; fi; sleep 100"),
      {"BATON_SSH=" + ssh});
  const auto done = p.finish(40s);
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() != 0);
  CHECK(done.seconds < 15);
  CHECK(done.err.find("rank 1 (host") != std::string::npos);
  CHECK(done.err.find("exited with code 6") != std::string::npos);
  for (pid_t pid : printed_pids(done.out)) CHECK(pid_is_gone(pid));
}

TEST_CASE("Launch.TwoLaunchersMakeOneJob" * doctest::timeout(60)) {
  const std::string master = fmt::format("127.0.0.1:{}", free_port());
  const auto args = [&](int node) {
    return launch_args({"--nnodes", "2", "--node-rank", std::to_string(node), "--master", master,
                        "--nproc-per-node", "2"},
                       env_script);
  };
  Process node0(args(0));
  Process node1(args(1));
  const auto done1 = node1.finish(30s);
  const auto done0 = node0.finish(20s);
  INFO("node 0 stdout:\n", done0.out, "\nnode 0 stderr:\n", done0.err, "\nnode 1 stdout:\n",
       done1.out, "\nnode 1 stderr:\n", done1.err);
  CHECK(done0.code() == 0);
  CHECK(done1.code() == 0);
  std::map<int, std::vector<std::string>> all = lines_by_rank(done0.out);
  for (auto& [rank, lines] : lines_by_rank(done1.out)) all[rank] = lines;
  REQUIRE(all.size() == 4);
  std::set<std::string> tokens;
  for (int rank = 0; rank < 4; ++rank) {
    REQUIRE(all.count(rank));
    const auto f = fields(all.at(rank).at(0));
    CHECK(f.at("RANK") == std::to_string(rank));
    CHECK(f.at("WORLD") == "4");
    CHECK(f.at("MASTER") == master);
    tokens.insert(f.at("TOKEN"));
  }
  CHECK(tokens.size() == 1);
}

TEST_CASE("Launch.FailureOnAnotherNodeAbortsThisOne" * doctest::timeout(60)) {
  const std::string master = fmt::format("127.0.0.1:{}", free_port());
  const auto args = [&](int node) {
    return launch_args(
        {"--nnodes", "2", "--node-rank", std::to_string(node), "--master", master},
        "echo pid $$; if [ $BATON_RANK = 1 ]; then sleep 0.5; exit 5; fi; sleep 100");
  };
  Process node0(args(0));
  Process node1(args(1));
  const auto done1 = node1.finish(30s);
  const auto done0 = node0.finish(20s);
  INFO("node 0 stdout:\n", done0.out, "\nnode 0 stderr:\n", done0.err, "\nnode 1 stdout:\n",
       done1.out, "\nnode 1 stderr:\n", done1.err);
  CHECK(done1.code() == 5);
  CHECK(done0.code() != 0);
  CHECK(done0.seconds < 15);
  CHECK(done0.err.find("baton-launch: job aborted: ") != std::string::npos);
  for (pid_t pid : printed_pids(done0.out)) CHECK(pid_is_gone(pid));
}

TEST_CASE("Launch.AdoptsTheLayoutOfMpirun" * doctest::timeout(60)) {
  std::string mpirun;
  for (const char* candidate : {"/usr/bin/mpirun", "/usr/local/bin/mpirun"}) {
    if (::access(candidate, X_OK) == 0) {
      mpirun = candidate;
      break;
    }
  }
  if (mpirun.empty()) return baton::test::skip(baton::test::Missing::mpirun, "mpirun is not installed (Debian: openmpi-bin)");
  Process p({mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "BATON_MASTER",
             launcher_path, "--", "sh", "-c", "echo $BATON_RANK $BATON_WORLD_SIZE"},
            {fmt::format("BATON_MASTER=127.0.0.1:{}", free_port())});
  const auto done = p.finish(50s);
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 0);
  const auto out = lines_by_rank(done.out);
  REQUIRE(out.size() == 2);
  CHECK(out.at(0).at(0) == "0 2");
  CHECK(out.at(1).at(0) == "1 2");
}

TEST_CASE("Launch.RanksJoinTheControlPlaneWithTheirVariables" * doctest::timeout(60)) {
  Process p({launcher_path, "--nproc-per-node", "3", "--", rank_path, "ok"});
  const auto done = p.finish(40s);
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 0);
  const auto out = lines_by_rank(done.out);
  REQUIRE(out.size() == 3);
  for (int rank = 0; rank < 3; ++rank) {
    CHECK(out.at(rank) ==
          std::vector<std::string>{fmt::format("joined rank={} table=3", rank), "finished"});
  }
}

TEST_CASE("Launch.TwoLaunchersServeRanksThatUseTheControlPlane" * doctest::timeout(60)) {
  const std::string master = fmt::format("127.0.0.1:{}", free_port());
  const auto args = [&](int node) {
    return std::vector<std::string>{launcher_path,
                                    "--nnodes",
                                    "2",
                                    "--node-rank",
                                    std::to_string(node),
                                    "--master",
                                    master,
                                    "--nproc-per-node",
                                    "2",
                                    "--",
                                    rank_path,
                                    "ok"};
  };
  Process node1(args(1));  // the later node may start first: it retries until node 0 serves
  std::this_thread::sleep_for(300ms);
  Process node0(args(0));
  const auto done1 = node1.finish(30s);
  const auto done0 = node0.finish(20s);
  INFO("node 0 stdout:\n", done0.out, "\nnode 0 stderr:\n", done0.err, "\nnode 1 stdout:\n",
       done1.out, "\nnode 1 stderr:\n", done1.err);
  CHECK(done0.code() == 0);
  CHECK(done1.code() == 0);
  auto all = lines_by_rank(done0.out);
  for (auto& [rank, lines] : lines_by_rank(done1.out)) all[rank] = lines;
  REQUIRE(all.size() == 4);
  for (int rank = 0; rank < 4; ++rank) {
    CHECK(all.at(rank) ==
          std::vector<std::string>{fmt::format("joined rank={} table=4", rank), "finished"});
  }
}

TEST_CASE("Launch.FailureReportedOverTheControlPlaneEndsTheJob" * doctest::timeout(60)) {
  Process p(
      {launcher_path, "--nproc-per-node", "3", "--", rank_path, "fail", "1", "out of patience"});
  const auto done = p.finish(40s);
  INFO("stdout:\n", done.out, "\nstderr:\n", done.err);
  CHECK(done.code() == 1);
  CHECK(done.seconds < 15);
  CHECK(std::regex_search(
      done.err,
      std::regex(R"(baton-launch: job aborted: rank 1 \(host [^)]+\): out of patience)")));
}
