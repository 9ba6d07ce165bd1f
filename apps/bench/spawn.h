#pragma once
// Child processes for the benchmarks that need several: ucx_perftest and mpirun as references,
// and the ranks of a baton job (the benchmark hosts the rendezvous server and starts the ranks
// as children of itself). Every wait has a deadline; a child past it is killed.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "baton/transport/control.h"

namespace baton::bench {

using Clock = std::chrono::steady_clock;
/// Environment changes for a child: an empty value unsets the variable.
using Env = std::map<std::string, std::string>;

struct Child {
  pid_t pid = -1;
  int out = -1;  // its stdout, or -1
};

inline Child spawn(const std::vector<std::string>& argv, const Env& env, bool capture) {
  int fds[2] = {-1, -1};
  if (capture && pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    for (const auto& [k, v] : env) {
      if (v.empty()) unsetenv(k.c_str());
      else setenv(k.c_str(), v.c_str(), 1);
    }
    if (capture) {
      dup2(fds[1], STDOUT_FILENO);
    } else {
      int devnull = open("/dev/null", O_WRONLY);
      dup2(devnull, STDOUT_FILENO);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    fmt::print(stderr, "cannot execute '{}': {}\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  if (capture) close(fds[1]);
  return Child{pid, capture ? fds[0] : -1};
}

/// Reads the child's stdout until EOF and waits for it; kills it at the deadline.
/// Returns {exit status (-1 if killed), output}. With `usage`, the child's resource use as the
/// kernel accounted it (wait4: ru_maxrss is its peak resident memory in KiB).
inline std::pair<int, std::string> finish(Child c, Clock::time_point deadline, rusage* usage = nullptr) {
  std::string text;
  if (c.out >= 0) {
    char buf[4096];
    while (true) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) break;
      pollfd p{c.out, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::min<long>(left, 1000))) <= 0) continue;
      ssize_t n = read(c.out, buf, sizeof buf);
      if (n <= 0) break;
      text.append(buf, static_cast<std::size_t>(n));
    }
    close(c.out);
  }
  int status = 0;
  rusage ignored{};
  rusage* ru = usage != nullptr ? usage : &ignored;
  while (true) {
    pid_t r = wait4(c.pid, &status, WNOHANG, ru);
    if (r == c.pid) break;
    if (Clock::now() > deadline) {
      kill(c.pid, SIGKILL);
      wait4(c.pid, &status, 0, ru);
      return {-1, text};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text};
}

inline std::uint16_t free_port() {
  // Bind port 0, read the port, close: a small race with other programs, fine on a test host.
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  close(s);
  return ntohs(a.sin_port);
}

/// Where a benchmark job's ranks run. By default all on this host; with `hosts`, rank r runs in
/// network namespace hosts[r / ranks_per_host] (NamespacePair: "hosts" joined by a veth pair)
/// and the rendezvous server listens at server_address inside hosts[0].
struct JobLayout {
  std::vector<std::string> hosts;  // namespaces; empty: this host
  int ranks_per_host = 0;          // with hosts
  std::string server_address = "127.0.0.1";
};

/// Calls `make` with this thread in network namespace `ns` (ip netns's), then returns it to
/// its own: a socket keeps the namespace it was made in.
template <class F>
auto in_namespace(const std::string& ns, F&& make) {
  const int own = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  const int there = open(("/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
  if (own < 0 || there < 0 || setns(there, CLONE_NEWNET) != 0) {
    if (own >= 0) close(own);
    if (there >= 0) close(there);
    throw std::runtime_error(fmt::format("cannot enter network namespace {}: {}", ns, std::strerror(errno)));
  }
  close(there);
  struct Back {
    int fd;
    ~Back() {
      setns(fd, CLONE_NEWNET);
      close(fd);
    }
  } back{own};
  return make();
}

/// Runs `world` ranks of `self args` as one job (this process hosts its rendezvous server) and
/// returns the stdout of each rank whose index is in `capture` (the others' is discarded), by
/// rank; nullopt if a rank failed or ran past `limit`.
inline std::optional<std::map<int, std::string>> run_job_outputs(const std::string& self,
                                                                 const std::vector<std::string>& args, int world,
                                                                 const std::vector<int>& capture, const Env& env_in,
                                                                 std::chrono::seconds limit = std::chrono::seconds(300),
                                                                 const JobLayout& layout = {}) {
  transport::ServerSettings ss;
  ss.bind_host = layout.server_address;
  ss.token = transport::random_token();
  ss.world_size = static_cast<std::uint32_t>(world);
  auto server = layout.hosts.empty()
                    ? std::make_unique<transport::RendezvousServer>(ss)
                    : in_namespace(layout.hosts.front(), [&] { return std::make_unique<transport::RendezvousServer>(ss); });
  auto captured = [&](int r) { return std::find(capture.begin(), capture.end(), r) != capture.end(); };
  const int local_world = layout.hosts.empty() ? world : layout.ranks_per_host;
  std::vector<Child> kids;
  for (int r = 0; r < world; ++r) {
    Env env = env_in;
    env["BATON_RANK"] = std::to_string(r);
    env["BATON_WORLD_SIZE"] = std::to_string(world);
    env["BATON_LOCAL_RANK"] = std::to_string(r % local_world);
    env["BATON_LOCAL_WORLD_SIZE"] = std::to_string(local_world);  // as baton-launch says
    env["BATON_MASTER"] = fmt::format("{}:{}", layout.server_address, server->port());
    env["BATON_JOB_TOKEN"] = ss.token;
    std::vector<std::string> argv;
    if (!layout.hosts.empty()) {
      argv = {"ip", "netns", "exec", layout.hosts.at(static_cast<std::size_t>(r / local_world))};
    }
    argv.push_back(self);
    argv.insert(argv.end(), args.begin(), args.end());
    kids.push_back(spawn(argv, env, captured(r)));
  }
  const auto deadline = Clock::now() + limit;
  std::map<int, std::string> outputs;
  bool ok = true;
  // Captured ranks print a line or two at the end, far below a pipe's capacity: reading them
  // one after the other cannot block a rank on a full pipe.
  for (int r = 0; r < world; ++r) {
    auto [code, out] = finish(kids[static_cast<std::size_t>(r)], deadline);
    if (captured(r)) outputs[r] = std::move(out);
    if (code != 0) {
      fmt::print(stderr, "rank {} of the benchmark job exited {}\n", r, code);
      ok = false;
    }
  }
  if (!ok) return std::nullopt;
  return outputs;
}

/// run_job_outputs() for one rank's stdout.
inline std::optional<std::string> run_job_of(const std::string& self, const std::vector<std::string>& args, int world,
                                             int report_rank, const Env& env_in,
                                             std::chrono::seconds limit = std::chrono::seconds(300)) {
  auto outputs = run_job_outputs(self, args, world, {report_rank}, env_in, limit);
  if (!outputs) return std::nullopt;
  return (*outputs)[report_rank];
}

}  // namespace baton::bench
