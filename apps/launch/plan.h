#pragma once
/// baton-launch's inputs resolved into one plain value before anything starts: how many nodes
/// and ranks, which node this launcher is, where the rendezvous server is, how the token is
/// found, and which hosts get a launcher over ssh. Everything here is pure (no processes, no
/// sockets) so that it can be tested on its own.
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace baton::launch {

/// A mistake in what the user asked for. what() names the option and the value.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// What the command line said, before defaults.
struct CommandLine {
  std::optional<std::int64_t> nproc_per_node;
  std::optional<std::int64_t> nnodes;
  std::optional<std::int64_t> node_rank;
  std::string master;    // --master HOST:PORT
  std::string hosts;     // --hosts h1,h2 (h:N gives N slots)
  std::string hostfile;  // --hostfile F
  std::string token;     // --token T
  std::string bind;      // --bind ADDR: the interface node 0's server listens on
  std::chrono::milliseconds finish_timeout{300'000};
  std::chrono::milliseconds join_timeout{120'000};  // --join-timeout S
  std::string trace;                 // --trace FILE
  std::vector<std::string> program;  // PROGRAM ARGS...
};

/// Looks an environment variable up; tests pass their own.
using Environment = std::function<std::optional<std::string>(const std::string& name)>;
/// The process's own environment.
Environment process_environment();

/// One line of a host file, or one entry of --hosts.
struct HostEntry {
  std::string host;
  std::optional<std::uint32_t> slots;
};

/// A host file in OpenMPI's format: one host per line, optionally "slots=N" (max_slots=N is
/// accepted and ignored), '#' starts a comment, blank lines are skipped. `origin` names the
/// file in errors ("hosts.txt:3: ...").
std::vector<HostEntry> parse_hostfile(std::string_view text, const std::string& origin);
/// "h1,h2" or "h1:2,h2:2" (":N" gives N slots, as mpirun's --host does).
std::vector<HostEntry> parse_host_list(std::string_view text);

/// The layout of a scheduler that started one launcher per task (srun, mpirun).
struct SchedulerLayout {
  std::string name;  // "OpenMPI" or "Slurm", for messages
  std::uint32_t rank = 0;
  std::uint32_t size = 1;
  std::uint32_t local_rank = 0;
  std::optional<std::uint32_t> local_size;
  std::string job_id;      // empty if the scheduler gave none
  std::string first_host;  // Slurm: the step's first node; empty otherwise
};

/// OpenMPI (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK) or Slurm (SLURM_PROCID / SLURM_NTASKS /
/// SLURM_LOCALID, inside a step: SLURM_STEP_ID set, so a batch script itself is not taken for
/// one task of many). Throws UsageError if the variables are there but malformed.
std::optional<SchedulerLayout> detect_scheduler(const Environment& env);

/// "n[01-04,07],m" -> "n01": the first host of a Slurm host list.
std::string first_slurm_host(std::string_view nodelist);

/// Where the rendezvous server of the job is and who runs it.
struct Plan {
  std::vector<std::string> program;
  std::uint32_t nproc_per_node = 1;
  std::uint32_t nnodes = 1;
  std::uint32_t node_rank = 0;
  /// BATON_LOCAL_RANK of this launcher's first rank and BATON_LOCAL_WORLD_SIZE: 0 and
  /// nproc_per_node, unless a scheduler runs several launchers on one host.
  std::uint32_t local_rank_base = 0;
  std::uint32_t local_world_size = 1;

  /// Node 0 runs the server, bound to bind_host:bind_port (port 0: any free port); ranks and
  /// other launchers reach it at master_host:port.
  std::string bind_host = "127.0.0.1";
  std::uint16_t bind_port = 0;
  std::string master_host = "127.0.0.1";
  /// Nodes >= 1: "host:port" of the server.
  std::string master;

  /// Empty: node 0 makes a fresh one, other nodes ask node 0's server for it.
  std::string token;
  /// Node 0's server gives the token to launchers that come without one.
  bool hand_out_token = false;

  /// --hosts / --hostfile: the hosts of nodes 1..K-1, where this launcher starts one over ssh.
  std::vector<std::string> remote_hosts;
  /// "OpenMPI" / "Slurm" when the layout was adopted from one, for messages.
  std::string scheduler;
  /// Node 0 of several: how long to wait for the other nodes once its own ranks are done.
  std::chrono::milliseconds finish_timeout{300'000};
  /// How long every node (and node 0's server, for the ranks and the other launchers) waits
  /// for the job to form: an unreachable master or a node that never comes is an error then.
  std::chrono::milliseconds join_timeout{120'000};
  /// --trace FILE: the ranks get BATON_TRACE=FILE (absolute) and stream their act records;
  /// node 0 merges them into FILE when the job ends. Empty: no trace.
  std::string trace;
  /// --max-restarts K: a rank of this node that may leave (a parameter-server worker under
  /// bounded staleness) and leaves is started again, at most K times each, with BATON_REJOIN=1:
  /// it comes back at the servers' step (run_job). 0: it stays gone.
  std::uint32_t max_restarts = 0;

  std::uint32_t world_size() const { return nnodes * nproc_per_node; }
  std::uint32_t first_rank() const { return node_rank * nproc_per_node; }
};

/// What resolve_plan needs to know about the machine it runs on (tests pass their own).
struct ThisMachine {
  std::function<bool(const std::string&)> is_local_host;  // see is_this_host()
  std::string host_name;                                  // gethostname()
};
ThisMachine this_machine();

/// Checks the command line against itself and the environment and fills in the defaults.
/// Throws UsageError naming what is wrong.
Plan resolve_plan(const CommandLine& cli, const Environment& env, const ThisMachine& machine);

/// "host:port", with IPv6 addresses in brackets.
std::string join_endpoint(const std::string& host, std::uint16_t port);

/// Whether `host` names this machine: localhost, 127.x.y.z, ::1, our host name (short or
/// long), or a name that resolves to an address of one of our interfaces.
bool is_this_host(const std::string& host);

/// A word for a POSIX shell: 'single quoted', with ' written as '\''. Plain words
/// (letters, digits, -_./=:,@%+) stay as they are.
std::string shell_quote(std::string_view word);

/// The shell command that starts node `node`'s launcher on its host:
///   cd 'CWD' && exec 'SELF' --nnodes K --node-rank I --master H:P --token T --nproc-per-node N --
///   'PROGRAM' 'ARGS'...
/// `forward` ("NAME=value" words) goes in front as `env NAME=value ...`: ssh does not carry
/// the environment, and the remote ranks need the same UCX_* and BATON_* settings (as
/// mpirun's -x).
std::string remote_command(const Plan& plan, std::uint32_t node, const std::string& master,
                           const std::string& token, const std::string& self_path,
                           const std::string& cwd, const std::vector<std::string>& forward = {});

/// The variables of `environ` that a remote launcher should see too: UCX_* and BATON_*,
/// except those baton-launch sets per rank (BATON_RANK, BATON_MASTER, ...) and BATON_SSH.
std::vector<std::string> forwarded_environment(const std::vector<std::string>& environ_words);

/// The ssh command line in front of the host: $BATON_SSH split at spaces (default "ssh"),
/// then -o BatchMode=yes -o StrictHostKeyChecking=accept-new.
std::vector<std::string> ssh_prefix(const Environment& env);

}  // namespace baton::launch
