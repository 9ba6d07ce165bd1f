#pragma once
/// Child processes for baton-launch: a file-descriptor owner, fork/exec with the child's
/// output on pipes, and the self-pipe that turns signals into poll() events.
#include <sys/types.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace baton::launch {

/// Owns one file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset();

 private:
  int fd_ = -1;
};

/// A pipe whose ends close on exec. Throws std::system_error.
std::pair<Fd, Fd> make_pipe();

void set_nonblocking(int fd);

/// What to start and how.
struct SpawnRequest {
  std::vector<std::string> argv;  // argv[0] is looked up in PATH (execvp)
  std::vector<std::string> env;   // the whole environment, "NAME=value"
};

/// A started child: its pid (also its process group: signals go to the whole group) and the
/// read ends of its stdout and stderr pipes (non-blocking).
struct Spawned {
  pid_t pid = -1;
  Fd out;
  Fd err;
};

/// Starts `request` in its own process group with stdin from /dev/null, stdout and stderr on
/// pipes, every other descriptor closed, and PR_SET_PDEATHSIG(SIGKILL) so that it dies with
/// the launcher. Waits until the child has exec'ed: if exec failed, throws SpawnError with
/// the child's errno ("cannot execute 'foo': No such file or directory"); the child is reaped.
Spawned spawn(const SpawnRequest& request);

/// exec failed in the child (errno() says why), or fork / pipe failed in the parent.
class SpawnError : public std::runtime_error {
 public:
  SpawnError(const std::string& what, int error) : std::runtime_error(what), errno_(error) {}
  int error() const { return errno_; }

 private:
  int errno_;
};

/// "SIGKILL" for 9; "signal 64" for a number without a name.
std::string signal_name(int sig);

/// "exited with code 3", "was killed by signal 9 (SIGKILL)" for a waitpid() status.
std::string describe_wait_status(int status);

/// The launcher's exit code for a child's waitpid() status: its exit code, or 128 + signal.
int exit_code_for(int status);

/// Turns signals into bytes on a pipe that poll() can wait on (the self-pipe trick). One per
/// process: the handlers are process-wide. Installed for SIGCHLD, SIGINT, SIGTERM, SIGHUP;
/// SIGPIPE is ignored (a closed stdout becomes EPIPE, not death). The destructor puts the
/// previous handlers back.
class SignalPipe {
 public:
  SignalPipe();
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  /// The descriptor to poll for POLLIN.
  int fd() const { return read_.get(); }
  /// The signals that arrived since the last call, in order (drains the pipe).
  std::vector<int> take();
  /// Wakes the poller from another thread (e.g. an abort callback): take() returns `code`.
  /// `code` must not be a signal number in use (see wake_code).
  void wake() const;
  static constexpr int wake_code = 0;
  /// Until the job's children exist, SIGINT / SIGTERM / SIGHUP end the launcher at once
  /// (exit 128 + signal): there is nothing to forward them to, and set-up may be blocked in
  /// a connect. Call with false once children have started.
  static void exit_on_signal(bool on);

 private:
  Fd read_;
  Fd write_;
};

}  // namespace baton::launch
