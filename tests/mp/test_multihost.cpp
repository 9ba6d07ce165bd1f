// Many hosts, simulated: network namespaces joined by a veth pair, one baton-launch per
// namespace (--nnodes/--node-rank, as torchrun), and the ssh path (--hosts) against an sshd
// this test starts inside one of them. Needs root (CI runs as root); skips (test::skip: a
// failure under CI=true) where namespaces cannot be made. UCX_TLS=tcp: namespaces do not stop UCX from choosing
// shared memory between processes of one machine. Traffic stays inside the namespaces.
#include <doctest/doctest.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "proc.h"
#include "skip.h"

using namespace std::chrono_literals;
using baton::test::Proc;
using baton::test::json_number;

namespace {

const std::string bin = BATON_BIN_DIR;

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

int sh(const std::string& cmd) {
  int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/// Two namespaces, "a" at 10.R.0.1 and "b" at 10.R.0.2, joined by a veth pair; removed (with
/// the pair) by the destructor.
struct TwoHosts {
  std::string a, b, addr_a, addr_b, veth_a, why_not;
  baton::test::Missing missing = baton::test::Missing::network_namespaces;  // what why_not lacks
  bool ok = false;

  TwoHosts() {
    if (geteuid() != 0) {
      why_not = "needs root to create network namespaces";
      missing = baton::test::Missing::root;
      return;
    }
    if (sh("command -v ip") != 0) {
      why_not = "needs the ip command (iproute2)";
      return;
    }
    const int id = static_cast<int>(getpid() % 200) + 20;
    a = fmt::format("baton{}a", getpid());
    b = fmt::format("baton{}b", getpid());
    addr_a = fmt::format("10.{}.0.1", id);
    addr_b = fmt::format("10.{}.0.2", id);
    const std::string va = fmt::format("bv{}a", getpid() % 100000), vb = fmt::format("bv{}b", getpid() % 100000);
    veth_a = va;
    const std::vector<std::string> steps = {
        fmt::format("ip netns add {}", a),
        fmt::format("ip netns add {}", b),
        fmt::format("ip link add {} type veth peer name {}", va, vb),
        fmt::format("ip link set {} netns {}", va, a),
        fmt::format("ip link set {} netns {}", vb, b),
        fmt::format("ip -n {} addr add {}/24 dev {}", a, addr_a, va),
        fmt::format("ip -n {} addr add {}/24 dev {}", b, addr_b, vb),
        fmt::format("ip -n {} link set {} up", a, va),
        fmt::format("ip -n {} link set {} up", b, vb),
        fmt::format("ip -n {} link set lo up", a),
        fmt::format("ip -n {} link set lo up", b),
    };
    for (const auto& s : steps) {
      if (sh(s) != 0) {
        why_not = fmt::format("'{}' failed (no permission for network namespaces here?)", s);
        return;
      }
    }
    ok = sh(fmt::format("ip netns exec {} ping -c 1 -W 2 {}", a, addr_b)) == 0 ||
         sh("command -v ping") != 0;  // no ping installed: trust the set-up
    if (!ok) why_not = "the veth pair does not carry traffic";
  }
  ~TwoHosts() {
    if (!a.empty()) sh("ip netns del " + a);
    if (!b.empty()) sh("ip netns del " + b);
  }
  std::vector<std::string> in(const std::string& ns, std::vector<std::string> argv) const {
    std::vector<std::string> full{"ip", "netns", "exec", ns};
    full.insert(full.end(), argv.begin(), argv.end());
    return full;
  }
};

std::uint16_t pick_port() { return static_cast<std::uint16_t>(20000 + getpid() % 20000); }

/// A long job (a chain of 10^6 slow pieces, rank 0 on host a, rank 1 on host b, over TCP), one
/// launcher per host; returns once rank 1 runs, pieces have flowed for 1.5 s, and its pid is
/// known (for the tests that break the job).
struct LongJob {
  std::unique_ptr<Proc> node0, node1;
  std::string master;
  pid_t rank1 = -1;

  LongJob(const TwoHosts& hosts, int port_offset, const std::string& token) {
    master = fmt::format("{}:{}", hosts.addr_a, pick_port() + port_offset);
    auto launcher = [&](const std::string& ns, int node) {
      return hosts.in(ns, {bin + "/baton-launch", "--nnodes", "2", "--node-rank", std::to_string(node), "--master",
                           master, "--token", token, "--", bin + "/baton-xrank-check", "--topology", "chain",
                           "--pieces", "1000000", "--sleep-us", "200"});
    };
    node0 = std::make_unique<Proc>(launcher(hosts.a, 0), std::map<std::string, std::string>{{"UCX_TLS", "tcp"}});
    node1 = std::make_unique<Proc>(launcher(hosts.b, 1), std::map<std::string, std::string>{{"UCX_TLS", "tcp"}});
    REQUIRE_MESSAGE(
        node1->read_until([](const std::string& out, const std::string&) { return contains(out, "rank 1 pid "); }, 60s),
        node1->all());
    std::this_thread::sleep_for(1500ms);  // mid-run: pieces flowing between the hosts
    const auto pos = node1->out().find("rank 1 pid ");
    rank1 = static_cast<pid_t>(std::stol(node1->out().substr(pos + 11)));
  }
};

}  // namespace

TEST_CASE("multi-host: one launcher per namespace (--nnodes/--node-rank) runs a cross-rank plan over TCP" *
          doctest::timeout(180)) {
  TwoHosts hosts;
  if (!hosts.ok) return baton::test::skip(hosts.missing, hosts.why_not);
  const std::string master = fmt::format("{}:{}", hosts.addr_a, pick_port());
  auto launcher = [&](const std::string& ns, int node) {
    return hosts.in(ns, {bin + "/baton-launch", "--nnodes", "2", "--node-rank", std::to_string(node), "--master",
                         master, "--nproc-per-node", "2", "--token", "netns-test-token", "--", bin + "/baton-xrank-check",
                         "--topology", "ring", "--pieces", "300", "--elements", "8192"});
  };
  Proc node0(launcher(hosts.a, 0), {{"UCX_TLS", "tcp"}});
  Proc node1(launcher(hosts.b, 1), {{"UCX_TLS", "tcp"}});
  int c1 = node1.wait(120s);
  int c0 = node0.wait(30s);
  INFO("node 0:\n" << node0.all() << "\nnode 1:\n" << node1.all());
  CHECK(c0 == 0);
  CHECK(c1 == 0);
  CHECK(contains(node0.out(), "rank 0 ok:"));
  CHECK(contains(node0.out(), "rank 1 ok:"));
  CHECK(contains(node1.out(), "rank 2 ok:"));
  CHECK(contains(node1.out(), "rank 3 ok:"));
}

TEST_CASE("multi-host: a rank killed on the other host ends the job on both" * doctest::timeout(180)) {
  TwoHosts hosts;
  if (!hosts.ok) return baton::test::skip(hosts.missing, hosts.why_not);
  LongJob job(hosts, 1, "netns-kill-token");
  Proc& node0 = *job.node0;
  Proc& node1 = *job.node1;
  REQUIRE(::kill(job.rank1, SIGKILL) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  int c1 = node1.wait(30s);
  int c0 = node0.wait(30s);
  INFO("node 0:\n" << node0.all() << "\nnode 1:\n" << node1.all());
  CHECK(c0 > 0);
  CHECK(c1 > 0);
  CHECK(std::chrono::steady_clock::now() - t0 < 12s);
  CHECK(contains(node0.err(), "rank 1"));
  CHECK(contains(node1.err(), "rank 1"));
}

TEST_CASE("multi-host: a network partition (link down) is found by heartbeats and ends the job on both sides" *
          doctest::timeout(180)) {
  TwoHosts hosts;
  if (!hosts.ok) return baton::test::skip(hosts.missing, hosts.why_not);
  LongJob job(hosts, 2, "netns-partition-token");
  Proc& node0 = *job.node0;
  Proc& node1 = *job.node1;
  const std::string& master = job.master;
  // Pull the cable: nothing crosses any more, and neither side gets a reset or an end of file.
  REQUIRE(sh(fmt::format("ip -n {} link set {} down", hosts.a, hosts.veth_a)) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  int c1 = node1.wait(60s);
  int c0 = node0.wait(60s);
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO("node 0:\n" << node0.all() << "\nnode 1:\n" << node1.all());
  CHECK(c0 > 0);
  CHECK(c1 > 0);
  CHECK(c0 < 128);
  CHECK(c1 < 128);
  // The heartbeat timeout is 10 s; the rest is the ranks' SIGTERM grace.
  CHECK(took < 25s);
  // Node 0's server names the silent side; node 1 says it lost the server.
  CHECK(contains(node0.err(), "sent nothing for 10 s"));
  CHECK(contains(node1.err(), "rendezvous server at " + master));
}

TEST_CASE("multi-host: --hosts starts the other host's launcher over ssh" * doctest::timeout(180)) {
  TwoHosts hosts;
  if (!hosts.ok) return baton::test::skip(hosts.missing, hosts.why_not);
  if (sh("test -x /usr/sbin/sshd && command -v ssh && command -v ssh-keygen") != 0) {
    return baton::test::skip(baton::test::Missing::sshd, "needs openssh-server and openssh-client");
  }
  // A private sshd inside namespace b: its own host key, root's login by a key made here.
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("baton-ssh-{}", getpid());
  std::filesystem::create_directories(dir);
  struct Cleanup {
    std::filesystem::path d;
    ~Cleanup() { std::filesystem::remove_all(d); }
  } cleanup{dir};
  const std::string d = dir.string();
  REQUIRE(sh(fmt::format("ssh-keygen -q -t ed25519 -N '' -f {}/host_key", d)) == 0);
  REQUIRE(sh(fmt::format("ssh-keygen -q -t ed25519 -N '' -f {}/id", d)) == 0);
  REQUIRE(sh(fmt::format("cp {}/id.pub {}/authorized_keys && chmod 700 {} && chmod 600 {}/authorized_keys", d, d, d,
                         d)) == 0);
  std::filesystem::create_directories("/run/sshd");
  const int port = 2200 + static_cast<int>(getpid() % 500);
  {
    std::ofstream cfg(dir / "sshd_config");
    cfg << "Port " << port << "\nListenAddress " << hosts.addr_b << "\nHostKey " << d << "/host_key\n"
        << "AuthorizedKeysFile " << d << "/authorized_keys\nPermitRootLogin prohibit-password\n"
        << "PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile " << d << "/sshd.pid\n";
  }
  Proc sshd(hosts.in(hosts.b, {"/usr/sbin/sshd", "-D", "-e", "-f", d + "/sshd_config"}));
  std::this_thread::sleep_for(500ms);
  const std::string ssh = fmt::format(
      "ssh -p {} -i {}/id -o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no -o LogLevel=ERROR", port, d);
  Proc job(hosts.in(hosts.a, {bin + "/baton-launch", "--hosts", hosts.addr_a + "," + hosts.addr_b, "--nproc-per-node",
                              "2", "--", bin + "/baton-xrank-check", "--topology", "fanout", "--pieces", "200"}),
           {{"UCX_TLS", "tcp"}, {"BATON_SSH", ssh}});
  int code = job.wait(120s);
  INFO(job.all() << "\nsshd:\n" << sshd.err());
  CHECK(code == 0);
  for (int r = 0; r < 4; ++r) CHECK(contains(job.out(), fmt::format("rank {} ok:", r)));
  sshd.kill_group(SIGTERM);
  sshd.wait(5s);
}

// Data parallelism over two hosts of two ranks each: the gradient buckets are all-reduced
// within each host, across the hosts, and within again (AllReduceSettings::rank_hosts, from
// baton-launch's BATON_LOCAL_WORLD_SIZE), every rank says so, and the training equals the flat
// ring's and one process's (the same sums in another order: the 1e-5 of the one-host dp test).
TEST_CASE("multi-host: baton-train --dp 4 over two hosts of two ranks all-reduces hierarchically" *
          doctest::timeout(240)) {
  TwoHosts hosts;
  if (!hosts.ok) return baton::test::skip(hosts.missing, hosts.why_not);
  const std::vector<std::string> train{bin + "/baton-train", "--model", "mlp", "--data", "synthetic", "--steps", "30",
                                       "--batch", "64", "--optimizer", "sgd", "--lr", "0.05", "--json", "--dp", "4"};
  struct Result {
    std::string out, err;
    double loss;
  };
  auto run = [&](const std::string& allreduce, int port_offset) {
    const std::string master = fmt::format("{}:{}", hosts.addr_a, pick_port() + port_offset);
    auto launcher = [&](const std::string& ns, int node) {
      std::vector<std::string> argv{bin + "/baton-launch", "--nnodes", "2", "--node-rank", std::to_string(node),
                                    "--master", master, "--nproc-per-node", "2", "--token", "netns-dp-token", "--"};
      argv.insert(argv.end(), train.begin(), train.end());
      argv.insert(argv.end(), {"--allreduce", allreduce});
      return hosts.in(ns, argv);
    };
    Proc node0(launcher(hosts.a, 0), {{"UCX_TLS", "tcp"}});
    Proc node1(launcher(hosts.b, 1), {{"UCX_TLS", "tcp"}});
    const int c1 = node1.wait(120s);
    const int c0 = node0.wait(30s);
    INFO("node 0:\n" << node0.all() << "\nnode 1:\n" << node1.all());
    REQUIRE(c0 == 0);
    REQUIRE(c1 == 0);
    return Result{node0.out() + node1.out(), node0.err() + node1.err(), json_number(node0.out(), "final_loss")};
  };
  const Result hier = run("auto", 10);
  const Result flat = run("flat", 11);
  std::vector<std::string> one_argv = train;
  one_argv.at(one_argv.size() - 1) = "1";
  one_argv.insert(one_argv.end(), {"--microbatches", "4"});
  Proc one(one_argv);
  REQUIRE(one.wait(60s) == 0);
  const double o = json_number(one.out(), "final_loss");
  INFO(o << " " << hier.loss << " " << flat.loss << "\n" << hier.err);
  CHECK(std::abs(o - hier.loss) <= 1e-5 * std::max(1.0, std::abs(o)));
  CHECK(std::abs(o - flat.loss) <= 1e-5 * std::max(1.0, std::abs(o)));
  for (int r = 0; r < 4; ++r) {
    CHECK(contains(hier.err, fmt::format("baton-train: r{}: ", r)));
    CHECK(contains(flat.err, fmt::format("baton-train: r{}: ", r)));
  }
  std::size_t said = 0;
  for (auto at = hier.err.find("; all-reduce: hierarchical, 2 hosts x 2 replicas"); at != std::string::npos;
       at = hier.err.find("; all-reduce: hierarchical, 2 hosts x 2 replicas", at + 1)) {
    ++said;
  }
  CHECK(said == 4);
  CHECK_FALSE(contains(flat.err, "hierarchical"));
}

namespace {

/// The pid of the process whose environment says BATON_RANK=`rank` and BATON_JOB_TOKEN=`token`
/// (a rank of this test's job, in whichever namespace), or -1.
pid_t rank_pid(int rank, const std::string& token) {
  pid_t found = -1;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return found;
  while (const dirent* e = ::readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atol(e->d_name));
    if (pid <= 0) continue;
    const auto vars = baton::test::environment_of(pid);
    const auto has = [&](const std::string& v) { return std::find(vars.begin(), vars.end(), v) != vars.end(); };
    if (has(fmt::format("BATON_RANK={}", rank)) && has("BATON_JOB_TOKEN=" + token)) found = pid;
  }
  ::closedir(d);
  return found;
}

}  // namespace

// A parameter-server worker under --staleness lost on the node that does not run the
// rendezvous server: that node's launcher reports it and keeps its other ranks (the server, here),
// and the job finishes on both nodes (docs/parameter-servers.md).
TEST_CASE("multi-host: a parameter-server worker killed on the other host leaves and the job finishes on both" *
          doctest::timeout(240)) {
  TwoHosts hosts;
  if (!hosts.ok) return baton::test::skip(hosts.missing, hosts.why_not);
  const std::string token = "netns-ps-leave-token";
  const std::string master = fmt::format("{}:{}", hosts.addr_a, pick_port() + 20);
  // Ranks 0, 1 on host a; 2, 3 on host b: workers 0-2, the server rank 3.
  auto launcher = [&](const std::string& ns, int node) {
    return hosts.in(ns, {bin + "/baton-launch", "--nnodes", "2", "--node-rank", std::to_string(node), "--master",
                         master, "--nproc-per-node", "2", "--token", token, "--", bin + "/baton-train", "--model",
                         "mlp", "--data", "synthetic", "--dp", "3", "--sync", "ps", "--servers", "1", "--staleness",
                         "2", "--steps", "2000", "--batch", "192", "--hidden", "256"});
  };
  Proc node0(launcher(hosts.a, 0), {{"UCX_TLS", "tcp"}});
  Proc node1(launcher(hosts.b, 1), {{"UCX_TLS", "tcp"}});
  // The server (rank 3, on host b) prints progress every tenth of the run.
  REQUIRE_MESSAGE(node1.read_until([](const std::string& out, const std::string&) { return contains(out, "/2000"); },
                                   120s),
                  node1.all());
  const pid_t victim = rank_pid(2, token);
  REQUIRE(victim > 0);
  REQUIRE(::kill(victim, SIGKILL) == 0);
  const int c1 = node1.wait(180s);
  const int c0 = node0.wait(30s);
  INFO("node 0:\n" << node0.all() << "\nnode 1:\n" << node1.all());
  CHECK(c1 == 0);
  CHECK(c0 == 0);
  CHECK(contains(node1.err(), "rank 2 (a worker) left the job at step"));
  CHECK(contains(node1.out(), "done: 2000 steps"));
}

// --max-restarts 1 over two hosts (TCP only, so the weights and gradients of a worker on the
// other host are pulled, not read in place): a worker killed beside the server (its node's
// launcher, not the rendezvous server's, starts it again) and then one on the other host (node
// 0's launcher) both come back at the servers' step, and the job finishes 0 on both nodes.
TEST_CASE("multi-host: parameter-server workers killed on either host come back under --max-restarts 1" *
          doctest::timeout(240)) {
  TwoHosts hosts;
  if (!hosts.ok) return baton::test::skip(hosts.missing, hosts.why_not);
  const std::string token = "netns-ps-rejoin-token";
  const std::string master = fmt::format("{}:{}", hosts.addr_a, pick_port() + 21);
  auto launcher = [&](const std::string& ns, int node) {
    return hosts.in(ns, {bin + "/baton-launch", "--nnodes", "2", "--node-rank", std::to_string(node), "--master",
                         master, "--nproc-per-node", "2", "--token", token, "--max-restarts", "1", "--",
                         bin + "/baton-train", "--model", "mlp", "--data", "synthetic", "--dp", "3", "--sync", "ps",
                         "--servers", "1", "--staleness", "2", "--steps", "3000", "--batch", "192", "--hidden", "256"});
  };
  Proc node0(launcher(hosts.a, 0), {{"UCX_TLS", "tcp"}});
  Proc node1(launcher(hosts.b, 1), {{"UCX_TLS", "tcp"}});
  REQUIRE_MESSAGE(node1.read_until([](const std::string& out, const std::string&) { return contains(out, "/3000"); },
                                   120s),
                  node1.all());
  for (const std::uint32_t victim : {2u, 0u}) {
    CAPTURE(victim);
    const pid_t pid = rank_pid(victim, token);
    REQUIRE(pid > 0);
    REQUIRE(::kill(pid, SIGKILL) == 0);
    const std::string back = fmt::format("rank {} (a worker) came back", victim);
    REQUIRE_MESSAGE(node1.read_until([&](const std::string&, const std::string& err) { return contains(err, back); },
                                     120s),
                    node0.all() << "\n" << node1.all());
  }
  const int c1 = node1.wait(180s);
  const int c0 = node0.wait(30s);
  INFO("node 0:\n" << node0.all() << "\nnode 1:\n" << node1.all());
  CHECK(c1 == 0);
  CHECK(c0 == 0);
  CHECK(contains(node1.err(), "baton-launch: starting rank 2 again (1 of --max-restarts 1)"));
  CHECK(contains(node0.err(), "baton-launch: starting rank 0 again (1 of --max-restarts 1)"));
  CHECK(contains(node1.err(), "workers came back during the run: rank 2 from step"));
  CHECK(contains(node1.out(), "done: 3000 steps"));
}
