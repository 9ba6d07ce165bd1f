#include "job.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <concepts>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "baton/observe/trace.h"
#include "baton/observe/dashboard.h"
#include "baton/observe/job_model.h"
#include "baton/observe/telemetry.h"
#include "baton/transport/control.h"
#include "baton/transport/link.h"
#include "output.h"
#include "process.h"

extern char** environ;

namespace baton::launch {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

/// The variables baton-launch sets for every rank (any inherited value is replaced).
constexpr std::array<const char*, 8> rank_variables = {
    "BATON_RANK",      "BATON_WORLD_SIZE", "BATON_LOCAL_RANK", "BATON_LOCAL_WORLD_SIZE",
    "BATON_NODE_RANK", "BATON_MASTER",     "BATON_JOB_TOKEN",  "BATON_REJOIN"};

std::string this_host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

std::string self_path() {
  std::string path(PATH_MAX, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size());
  if (n <= 0)
    throw std::runtime_error(
        fmt::format("cannot find baton-launch's own path: {}", std::strerror(errno)));
  path.resize(static_cast<std::size_t>(n));
  return path;
}

std::string current_dir() {
  std::string dir(PATH_MAX, '\0');
  if (!::getcwd(dir.data(), dir.size())) {
    throw std::runtime_error(
        fmt::format("cannot read the working directory: {}", std::strerror(errno)));
  }
  dir.resize(std::strlen(dir.c_str()));
  return dir;
}

std::vector<std::string> inherited_environment() {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view entry(*e);
    const auto name = entry.substr(0, entry.find('='));
    if (std::find(rank_variables.begin(), rank_variables.end(), name) == rank_variables.end())
      env.emplace_back(entry);
  }
  return env;
}

struct Stream {
  Fd fd;
  LinePrefixer lines;
  OutputSink* sink = nullptr;
};

/// A process this launcher started: one of its ranks, or (--hosts) ssh running another
/// node's launcher.
struct Child {
  enum class Kind { rank, node };
  Kind kind = Kind::rank;
  std::uint32_t id = 0;  // the global rank, or the node index
  std::string host;
  pid_t pid = -1;
  std::optional<int> status;  // waitpid() status, once reaped
  Clock::time_point exited_at;
  Stream out, err;

  bool running() const { return !status; }
  std::string name() const {
    return kind == Kind::rank ? fmt::format("rank {} (host {}, pid {})", id, host, pid)
                              : fmt::format("node {} (host {})", id, host);
  }
};

struct Failure {
  int exit_code = 1;
};

class Job {
 public:
  Job(const Plan& plan, const Supervision& supervision, const DashboardOptions& dashboard)
      : plan_(plan), supervision_(supervision), dashboard_(dashboard), host_(this_host_name()) {}

  int run() {
    // Until children exist a signal simply ends the launcher (set-up may sit in a connect).
    SignalPipe::exit_on_signal(true);
    start_control_plane();
    SignalPipe::exit_on_signal(false);
    // Orphaned grandchildren of the ranks become ours, so they are reaped, not left as zombies.
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);
    start_ranks();
    if (!failure_) start_nodes();
    loop();
    if (!failure_ && client_) client_->finish();
    if (model_) {
      const auto outcome = server_->outcome();
      model_->set_outcome(!failure_, outcome && !outcome->ok ? outcome->reason : failure_ ? "the job failed" : "");
    }
    write_trace();
    const auto flush_deadline = Clock::now() + supervision_.final_flush;
    stderr_.flush(flush_deadline);
    stdout_.flush(flush_deadline);
    linger();
    return failure_ ? failure_->exit_code : 0;
  }

 private:
  // --- set-up -------------------------------------------------------------------------------

  /// Node 0 with --dashboard: the job model, fed by the rendezvous server's telemetry, and the
  /// page. The ranks learn to send telemetry from BATON_DASHBOARD, set here in our own
  /// environment so that ssh'ed launchers forward it to their ranks too (BATON_* travels).
  void start_dashboard() {
    if (dashboard_.listen.empty()) return;
    model_ = std::make_unique<observe::JobModel>(observe::JobModelSettings{
        .world_size = plan_.world_size(), .title = fmt::format("{} ({} ranks)", job_title(), plan_.world_size())});
    // "Record N seconds": the ranks get a server command and stream the window to trace_.
    trace_ = std::make_unique<observe::TraceCollector>();
    on_demand_ = std::make_unique<observe::TraceOnDemand>(
        *trace_,
        [this](std::uint32_t session, double seconds) {
          if (!server_) throw std::runtime_error("the job has not started");
          server_->send_command(observe::trace_kind, fmt::format(R"({{"session": {}, "seconds": {}}})", session, seconds));
        },
        plan_.world_size());
    observe::DashboardSettings ds{.listen = dashboard_.listen};
    ds.trace = [od = on_demand_.get()](double seconds, std::function<void(bool, std::string)> done) {
      od->record(seconds, std::move(done));
    };
    http_ = std::make_unique<observe::DashboardServer>(*model_, std::move(ds));
    ::setenv(observe::dashboard_env, "1", 1);
    stderr_.append(fmt::format("baton-launch: dashboard at {}\n", http_->url()));
  }

  /// The program's name and first arguments, for the page's title.
  std::string job_title() const {
    std::string title;
    for (std::size_t i = 0; i < plan_.program.size() && i < 4; ++i) {
      std::string word = plan_.program[i];
      if (i == 0) word = word.substr(word.rfind('/') + 1);
      title += (i ? " " : "") + word;
    }
    return title;
  }

  /// --dashboard-linger: the page stays up after the job, until the time is up or a signal.
  void linger() {
    if (!http_ || dashboard_.linger.count() <= 0) return;
    fmt::print(stderr, "baton-launch: the dashboard stays up at {} for {} s (Ctrl-C ends it)\n", http_->url(),
               std::chrono::duration_cast<std::chrono::seconds>(dashboard_.linger).count());
    const auto until = Clock::now() + dashboard_.linger;
    for (auto now = Clock::now(); now < until; now = Clock::now()) {
      pollfd fd{signals_.fd(), POLLIN, 0};
      const auto left = std::chrono::ceil<milliseconds>(until - now).count();
      if (::poll(&fd, 1, static_cast<int>(std::min<std::int64_t>(left, 1000))) > 0) {
        for (int sig : signals_.take()) {
          if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) return;
        }
      }
    }
  }

  void start_control_plane() {
    if (plan_.node_rank == 0) {
      token_ = plan_.token.empty() ? transport::random_token() : plan_.token;
      transport::ServerSettings settings;
      settings.bind_host = plan_.bind_host;
      settings.port = plan_.bind_port;
      settings.token = token_;
      settings.world_size = plan_.world_size();
      settings.launchers = plan_.nnodes - 1;
      settings.hand_out_token = plan_.hand_out_token;
      settings.join_timeout = plan_.join_timeout;
      start_dashboard();
      if (!plan_.trace.empty() && !trace_) trace_ = std::make_unique<observe::TraceCollector>();
      // The server's thread hands each rank's telemetry on: traces to the trace collector, the
      // rest (dash.*) to the dashboard's model.
      if (trace_ || model_) {
        settings.on_telemetry = [trace = trace_.get(), model = model_.get()](transport::Telemetry t) {
          if (t.kind == "trace") {
            if (trace) trace->on_telemetry(t);
          } else if (model) {
            model->ingest(t.rank, t.kind, t.body);
          }
        };
      }
      try {
        server_ = std::make_unique<transport::RendezvousServer>(settings);
      } catch (const std::exception& e) {
        // The server's error names the address; say it here if it does not.
        const std::string where = join_endpoint(plan_.bind_host, plan_.bind_port);
        const std::string what = e.what();
        throw transport::TransportError(
            what.find(where) != std::string::npos
                ? what
                : fmt::format("cannot start the rendezvous server on {}: {}", where, what));
      }
      master_ =
          !plan_.master.empty() ? plan_.master : join_endpoint(plan_.master_host, server_->port());
    } else {
      transport::LauncherClientSettings settings;
      settings.master = plan_.master;
      settings.token = plan_.token;
      settings.node_rank = plan_.node_rank;
      settings.join_timeout = plan_.join_timeout;
      client_ = std::make_unique<transport::LauncherClient>(settings);
      // Called on the client's thread: only wake the event loop, which asks aborted().
      client_->on_abort([this](const std::string&) { signals_.wake(); });
      try {
        token_ = client_->join();
      } catch (const std::exception& e) {
        throw transport::TransportError(fmt::format("node {} cannot join the job at {}: {}",
                                                    plan_.node_rank, plan_.master, e.what()));
      }
      master_ = plan_.master;
    }
  }

  /// --trace: the ranks record (and, in a job of many, stream to node 0) into this file.
  std::vector<std::string> with_trace(std::vector<std::string> env) const {
    if (!plan_.trace.empty()) {
      env.push_back(fmt::format("{}={}", observe::trace_env, std::filesystem::absolute(plan_.trace).string()));
    }
    return env;
  }

  /// Node 0, --trace: the ranks' records, merged, once the job has ended (also when it failed:
  /// what led up to a failure is worth seeing). A job of one rank wrote it itself.
  void write_trace() {
    if (!trace_ || plan_.trace.empty() || plan_.world_size() == 1) return;
    if (trace_->ranks() == 0) {
      stderr_.append(fmt::format("baton-launch: no trace written: no rank sent one (does the program record "
                                 "when {} is set? baton-train does)\n",
                                 observe::trace_env));
      return;
    }
    try {
      const observe::TraceRecorder trace = trace_->merge();
      trace.write_file(plan_.trace);
      stderr_.append(fmt::format("baton-launch: trace of {} of {} ranks ({} acts) written to {}\n", trace_->ranks(),
                                 plan_.world_size(), trace.acts(), plan_.trace));
    } catch (const std::exception& e) {
      stderr_.append(fmt::format("baton-launch: {}\n", e.what()));
    }
  }

  void start_ranks() {
    for (std::uint32_t local = 0; local < plan_.nproc_per_node; ++local) {
      if (!start_rank(plan_.first_rank() + local, false)) return;  // failed to exec: the job is over before it began
    }
  }

  /// Starts rank `rank` of this node; `rejoin`: again, to come back to the job (BATON_REJOIN=1).
  bool start_rank(std::uint32_t rank, bool rejoin) {
    SpawnRequest request{plan_.program, with_trace(inherited_environment())};
    const std::pair<const char*, std::string> values[] = {
        {"BATON_RANK", std::to_string(rank)},
        {"BATON_WORLD_SIZE", std::to_string(plan_.world_size())},
        {"BATON_LOCAL_RANK", std::to_string(plan_.local_rank_base + rank - plan_.first_rank())},
        {"BATON_LOCAL_WORLD_SIZE", std::to_string(plan_.local_world_size)},
        {"BATON_NODE_RANK", std::to_string(plan_.node_rank)},
        {"BATON_MASTER", master_},
        {"BATON_JOB_TOKEN", token_},
        {"BATON_REJOIN", rejoin ? "1" : "0"},
    };
    for (const auto& [name, value] : values) request.env.push_back(fmt::format("{}={}", name, value));
    auto child = std::make_unique<Child>();
    child->kind = Child::Kind::rank;
    child->id = rank;
    child->host = host_;
    return start(std::move(child), request, fmt::format("[{}] ", rank));
  }

  /// A rank that left: started again to come back, if --max-restarts allows.
  void restart(const Child& child) {
    std::uint32_t& done = restarts_[child.id];
    if (done >= plan_.max_restarts) {
      if (plan_.max_restarts > 0) {
        stderr_.append(fmt::format("baton-launch: rank {} is not started again: it was, {} time{} (--max-restarts {})\n",
                                   child.id, done, done == 1 ? "" : "s", plan_.max_restarts));
      }
      return;
    }
    ++done;
    stderr_.append(fmt::format("baton-launch: starting rank {} again ({} of --max-restarts {}): it comes back at the "
                               "servers' step\n",
                               child.id, done, plan_.max_restarts));
    start_rank(child.id, true);
  }

  void start_nodes() {
    if (plan_.remote_hosts.empty()) return;
    const auto env = with_trace(inherited_environment());
    const auto ssh = ssh_prefix(process_environment());
    const std::string self = self_path(), cwd = current_dir();
    for (std::size_t i = 0; i < plan_.remote_hosts.size(); ++i) {
      const auto node = static_cast<std::uint32_t>(i + 1);
      SpawnRequest request{ssh, env};
      request.argv.push_back(plan_.remote_hosts[i]);
      request.argv.push_back(remote_command(plan_, node, master_, token_, self, cwd, forwarded_environment(env)));
      auto child = std::make_unique<Child>();
      child->kind = Child::Kind::node;
      child->id = node;
      child->host = plan_.remote_hosts[i];
      // The remote launcher prefixes its ranks' lines itself.
      if (!start(std::move(child), request, "")) return;
    }
  }

  /// Starts one child; false (and the job failed) if it could not be executed.
  bool start(std::unique_ptr<Child> child, const SpawnRequest& request, const std::string& prefix) {
    try {
      Spawned spawned = spawn(request);
      child->pid = spawned.pid;
      child->out = Stream{std::move(spawned.out), LinePrefixer(prefix), &stdout_};
      child->err = Stream{std::move(spawned.err), LinePrefixer(prefix), &stderr_};
      children_.push_back(std::move(child));
      return true;
    } catch (const SpawnError& e) {
      const bool rank = child->kind == Child::Kind::rank;
      fail(fmt::format("{} {} (host {}): {}", rank ? "rank" : "node", child->id, child->host,
                       e.what()),
           127, rank ? std::optional<std::uint32_t>(child->id) : std::nullopt, e.what());
      return false;
    }
  }

  // --- the event loop -----------------------------------------------------------------------

  void loop() {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    while (true) {
      const auto now = Clock::now();
      check_control_plane();
      escalate(now);
      close_drained_streams(now);
      if (finished(now)) return;

      fds.clear();
      streams.clear();
      fds.push_back({signals_.fd(), POLLIN, 0});
      for (auto& child : children_) {
        for (Stream* s : {&child->out, &child->err}) {
          if (!s->fd || s->sink->queued() >= supervision_.output_high_water) continue;
          fds.push_back({s->fd.get(), POLLIN, 0});
          streams.push_back(s);
        }
      }
      const std::size_t sinks_at = fds.size();
      fds.push_back({stdout_.pending() ? stdout_.fd() : -1, POLLOUT, 0});
      fds.push_back({stderr_.pending() ? stderr_.fd() : -1, POLLOUT, 0});

      const int ready = ::poll(fds.data(), fds.size(), poll_timeout(now));
      if (ready < 0) {
        if (errno == EINTR) continue;
        throw std::system_error(errno, std::generic_category(), "poll");
      }
      if (fds[0].revents) handle_signals();
      for (std::size_t i = 0; i < streams.size(); ++i) {
        if (fds[i + 1].revents) read_stream(*streams[i], 4);
      }
      if (fds[sinks_at].revents) stdout_.write_some();
      if (fds[sinks_at + 1].revents) stderr_.write_some();
    }
  }

  int poll_timeout(Clock::time_point now) const {
    auto next = now + supervision_.control_poll;
    const auto consider = [&](std::optional<Clock::time_point> t) {
      if (t) next = std::min(next, std::max(*t, now));
    };
    consider(kill_ranks_at_);
    consider(stop_by_);
    consider(term_nodes_at_);
    consider(kill_nodes_at_);
    consider(give_up_at_);
    consider(finish_deadline_);
    for (const auto& child : children_) {
      if (!child->running() && (child->out.fd || child->err.fd))
        consider(child->exited_at + supervision_.drain_after_exit);
    }
    return static_cast<int>(std::chrono::ceil<milliseconds>(next - now).count());
  }

  void handle_signals() {
    for (int sig : signals_.take()) {
      if (sig == SIGCHLD) {
        reap();
      } else if (sig == SignalPipe::wake_code) {
        check_control_plane();
      } else {
        on_launcher_signal(sig);
      }
    }
  }

  /// Reads what a pipe has (at most `rounds` buffers, so one chatty rank cannot starve the
  /// others); EOF flushes a partial last line and closes the pipe.
  void read_stream(Stream& s, int rounds) {
    char buffer[65536];
    std::string text;
    for (int i = 0; i < rounds && s.fd; ++i) {
      const ssize_t n = ::read(s.fd.get(), buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      if (n <= 0) {
        s.lines.finish(text);
        s.fd.reset();
        break;
      }
      s.lines.feed(std::string_view(buffer, static_cast<std::size_t>(n)), text);
    }
    s.sink->append(text);
  }

  void reap() {
    std::vector<std::pair<Child*, int>> ended;
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid < 0 && errno == EINTR) continue;
      if (pid <= 0) break;
      auto it = std::find_if(children_.begin(), children_.end(),
                             [&](const auto& c) { return c->pid == pid; });
      if (it != children_.end()) ended.emplace_back(it->get(), status);
      // Otherwise an orphaned grandchild (we are a subreaper): reaped, nothing more.
    }
    // Children that ended since the last look come back in the kernel's order, not in the order
    // they died. When a rank is killed from outside, a peer can die of it within a millisecond
    // (UCX aborts a process whose shared-memory copy finds its peer gone): report the one killed
    // from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP) as the cause, and name the others too.
    auto external = [](int status) {
      if (!WIFSIGNALED(status)) return false;
      const int sig = WTERMSIG(status);
      return sig == SIGKILL || sig == SIGTERM || sig == SIGINT || sig == SIGHUP;
    };
    std::stable_partition(ended.begin(), ended.end(), [&](const auto& e) { return external(e.second); });
    const bool failed_before = failure_.has_value();
    for (auto& [child, status] : ended) {
      const bool was_first = !failure_;
      on_exit(*child, status);
      const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!failed_before && !was_first && !clean && child->kind == Child::Kind::rank) {
        stderr_.append(fmt::format("baton-launch: {} also ended at the same time: {}\n", child->name(),
                                   describe_wait_status(status)));
      }
    }
  }

  void on_exit(Child& child, int status) {
    child.status = status;
    child.exited_at = Clock::now();
    // What it wrote before dying comes before our line about it.
    read_stream(child.out, 64);
    read_stream(child.err, 64);
    const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (clean || failure_) return;
    const std::string how = describe_wait_status(status);
    // A rank that may leave (a parameter-server worker under bounded staleness) leaves: the
    // rendezvous server tells the others, and the job goes on without it.
    // On another node than the server's, the launcher reports it (the server counts it as a
    // departure) and keeps its other ranks.
    const bool leaves = child.kind == Child::Kind::rank &&
                        ((server_ && server_->rank_exited(child.id, "it " + how)) ||
                         (client_ && client_->may_leave(child.id) && report_departure(child.id, "it " + how)));
    if (leaves) {
      stderr_.append(fmt::format("baton-launch: {} left the job: it {}; the job goes on without it\n", child.name(),
                                 how));
      if (model_) model_->rank_left(child.id, "it " + how);
      restart(child);
      return;
    }
    if (child.kind == Child::Kind::rank) {
      fail(fmt::format("{} {}", child.name(), how), exit_code_for(status), child.id, how);
    } else {
      const bool ssh_error = WIFEXITED(status) && WEXITSTATUS(status) == 255;
      fail(fmt::format("{}: its launcher (over ssh) {}{}", child.name(), how,
                       ssh_error ? " (ssh's code for a failed connection)" : ""),
           exit_code_for(status), std::nullopt,
           fmt::format("the launcher of node {} {}", child.id, how));
    }
  }

  /// Pipes still open a while after their process exited: a background process holds them.
  void close_drained_streams(Clock::time_point now) {
    for (auto& child : children_) {
      if (child->running() || now < child->exited_at + supervision_.drain_after_exit) continue;
      for (Stream* s : {&child->out, &child->err}) {
        if (!s->fd || s->sink->queued() >= supervision_.output_high_water) continue;
        read_stream(*s, 1);
        if (s->fd) {
          std::string text;
          s->lines.finish(text);
          s->sink->append(text);
          s->fd.reset();
        }
      }
    }
  }

  void check_control_plane() {
    if (failure_) return;
    if (server_ && model_) {  // ranks that came back (--max-restarts): the dashboard shows them running
      const auto back = server_->rejoined();
      for (; rejoins_seen_ < back.size(); ++rejoins_seen_) model_->rank_rejoined(back[rejoins_seen_].first, back[rejoins_seen_].second);
    }
    if (server_) {
      if (auto outcome = server_->outcome(); outcome && !outcome->ok) {
        fail_from_control_plane(outcome->reason);
      }
    } else if (client_) {
      if (auto reason = client_->aborted()) fail_from_control_plane(*reason);
    }
  }

  bool all_reaped() const {
    return std::all_of(children_.begin(), children_.end(),
                       [](const auto& c) { return !c->running(); });
  }
  bool all_drained() const {
    return std::all_of(children_.begin(), children_.end(),
                       [](const auto& c) { return !c->out.fd && !c->err.fd; });
  }

  bool finished(Clock::time_point now) {
    if (failure_) {
      if (give_up_at_ && now >= *give_up_at_) {
        for (const auto& child : children_) {
          if (child->running()) {
            stderr_.append(
                fmt::format("baton-launch: gave up waiting for {} to end\n", child->name()));
          }
        }
        return true;
      }
      return all_reaped() && all_drained();
    }
    if (!all_reaped() || !all_drained()) return false;
    // Every local rank (and every ssh'ed launcher) ended well.
    if (!server_ || plan_.nnodes == 1 || !plan_.remote_hosts.empty()) return true;
    // Node 0 of several, the other launchers reporting only to the server: keep serving the
    // job until it says they are done.
    if (!finish_deadline_) finish_deadline_ = now + plan_.finish_timeout;
    if (auto outcome = server_->outcome(); outcome && outcome->ok) return true;
    if (server_->finished_launchers() >= plan_.nnodes - 1) return true;
    if (now >= *finish_deadline_) {
      fail(fmt::format(
               "this node's ranks are done, but the other nodes did not finish within {} s",
               std::chrono::duration_cast<std::chrono::seconds>(plan_.finish_timeout).count()),
           1, std::nullopt, "node 0 gave up waiting for the other nodes to finish");
      return true;
    }
    return false;
  }

  // --- failure and termination --------------------------------------------------------------

  /// The first failure ends the job: one line on stderr, a report to the control plane, and
  /// SIGTERM to every local rank. Later failures are consequences and stay quiet.
  void fail(const std::string& message, int exit_code, std::optional<std::uint32_t> rank,
            const std::string& reason, int term_signal = SIGTERM) {
    if (failure_) return;
    failure_ = Failure{exit_code};
    stderr_.append(fmt::format("baton-launch: {}\n", message));
    try {
      // With a rank, the server says "rank R (host H): reason"; without one, reason alone.
      if (server_) {
        server_->abort(reason, rank, rank ? host_ : std::string());
      } else if (client_) {
        client_->fail(reason, rank.value_or(plan_.first_rank()));
      }
    } catch (const std::exception& e) {
      stderr_.append(fmt::format(
          "baton-launch: could not report the failure to the rendezvous server: {}\n", e.what()));
    }
    begin_termination(term_signal);
  }

  /// A rank of this node that may leave has left: the server is told (it counts the rank out and
  /// tells the others); false if it could not be told, and the job fails as for any rank.
  bool report_departure(std::uint32_t rank, const std::string& how) {
    try {
      client_->fail(how, rank);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  void fail_from_control_plane(const std::string& reason) {
    if (failure_) return;
    failure_ = Failure{1};
    stderr_.append(fmt::format("baton-launch: job aborted: {}\n", reason));
    begin_termination(SIGTERM);
  }

  void on_launcher_signal(int sig) {
    if (!failure_ && stop_by_) {
      stop_by_.reset();
      fail(fmt::format("{} again while the ranks stop: ending the job", signal_name(sig)), 128 + sig, std::nullopt,
           launcher_signal_reason(sig), sig);
      return;
    }
    if (!failure_ && supervision_.stop_grace.count() > 0) {
      // The ranks stop on their own (a server drains): the job ends as their exits say.
      stop_by_ = Clock::now() + supervision_.stop_grace;
      stop_signal_ = sig;
      stderr_.append(fmt::format("baton-launch: received {}: forwarding it to the ranks, which have {} s to stop on "
                                 "their own (--stop-grace; again to end the job now)\n",
                                 signal_name(sig),
                                 std::chrono::duration_cast<std::chrono::seconds>(supervision_.stop_grace).count()));
      signal_children(Child::Kind::rank, sig);
      return;
    }
    if (failure_) {
      // A second Ctrl-C: no more patience.
      if (sig == SIGINT || sig == SIGTERM) {
        stderr_.append(
            fmt::format("baton-launch: {} again: killing every child now\n", signal_name(sig)));
        signal_children(Child::Kind::rank, SIGKILL);
        signal_children(Child::Kind::node, SIGKILL);
      }
      return;
    }
    // The ranks get the signal the launcher got (SIGINT, SIGTERM, SIGHUP), then SIGKILL after
    // the grace.
    fail(
        fmt::format("received {}: forwarding it to the ranks and ending the job", signal_name(sig)),
        128 + sig, std::nullopt, launcher_signal_reason(sig), sig);
  }

  std::string launcher_signal_reason(int sig) const {
    // Other nodes' launchers can only report a rank: theirs is "rank R (host H): its launcher ...".
    return server_ ? fmt::format("the launcher of node 0 (host {}) received {}", host_, signal_name(sig))
                   : fmt::format("its launcher (node {}) received {}", plan_.node_rank, signal_name(sig));
  }

  void begin_termination(int sig) {
    const auto now = Clock::now();
    signal_children(Child::Kind::rank, sig);
    kill_ranks_at_ = now + supervision_.term_grace;
    term_nodes_at_ = now + supervision_.node_grace;
    kill_nodes_at_ = now + supervision_.node_grace + supervision_.term_grace;
    give_up_at_ = now + supervision_.give_up_after;
  }

  void escalate(Clock::time_point now) {
    const auto due = [&](std::optional<Clock::time_point>& t) {
      if (!t || now < *t) return false;
      t.reset();
      return true;
    };
    if (!failure_ && due(stop_by_)) {
      fail(fmt::format("the ranks did not stop within --stop-grace {} s of {}: ending the job",
                       std::chrono::duration_cast<std::chrono::seconds>(supervision_.stop_grace).count(),
                       signal_name(stop_signal_)),
           128 + stop_signal_, std::nullopt, launcher_signal_reason(stop_signal_), SIGKILL);
    }
    if (due(kill_ranks_at_)) signal_children(Child::Kind::rank, SIGKILL);
    if (due(term_nodes_at_)) signal_children(Child::Kind::node, SIGTERM);
    if (due(kill_nodes_at_)) signal_children(Child::Kind::node, SIGKILL);
  }

  void signal_children(Child::Kind kind, int sig) {
    for (const auto& child : children_) {
      if (child->kind != kind || !child->running()) continue;
      // The child's whole process group (a shell and what it started); the child alone if it
      // has left that group.
      if (::kill(-child->pid, sig) != 0) ::kill(child->pid, sig);
    }
  }

  const Plan& plan_;
  const Supervision supervision_;
  const DashboardOptions dashboard_;
  const std::string host_;
  OutputSink stdout_{STDOUT_FILENO};
  OutputSink stderr_{STDERR_FILENO};
  SignalPipe signals_;
  std::string token_;
  std::string master_;
  // Outlives the server, whose thread feeds it.
  std::unique_ptr<observe::TraceCollector> trace_;
  // The dashboard (node 0): the server's telemetry callback feeds the model, so both outlive it;
  // the page's trace button waits on on_demand_, torn down after the page.
  std::unique_ptr<observe::JobModel> model_;
  std::unique_ptr<observe::TraceOnDemand> on_demand_;
  std::unique_ptr<observe::DashboardServer> http_;
  // Torn down before the signal pipe their callbacks write to.
  std::unique_ptr<transport::RendezvousServer> server_;
  std::unique_ptr<transport::LauncherClient> client_;
  std::vector<std::unique_ptr<Child>> children_;
  std::map<std::uint32_t, std::uint32_t> restarts_;  // by rank: how often it was started again
  std::size_t rejoins_seen_ = 0;  // of the server's rejoined(), handed to the dashboard
  std::optional<Failure> failure_;
  std::optional<Clock::time_point> kill_ranks_at_, term_nodes_at_, kill_nodes_at_, give_up_at_,
      finish_deadline_;
  std::optional<Clock::time_point> stop_by_;  // --stop-grace: the ranks stop on their own by then
  int stop_signal_ = 0;
};

}  // namespace

int run_job(const Plan& plan, const Supervision& supervision, const DashboardOptions& dashboard) {
  Job job(plan, supervision, dashboard);
  return job.run();
}

}  // namespace baton::launch
