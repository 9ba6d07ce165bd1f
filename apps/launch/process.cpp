#include "process.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <system_error>

#include <fmt/format.h>

namespace baton::launch {

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::pair<Fd, Fd> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    throw std::system_error(errno, std::generic_category(), "pipe2");
  return {Fd(fds[0]), Fd(fds[1])};
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    throw std::system_error(errno, std::generic_category(), "fcntl(O_NONBLOCK)");
  }
}

namespace {

/// The signals the launcher handles; a child puts them back to their defaults before exec.
constexpr int handled_signals[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE};

/// Runs in the forked child: only async-signal-safe calls (the parent has other threads).
[[noreturn]] void exec_child(char* const* argv, char* const* envp, int stdin_fd, int out_fd,
                             int err_fd, int exec_error_fd, pid_t parent, int max_fd) {
  // Our own process group: the launcher signals a rank's whole tree (a shell and what it
  // started), and a terminal's Ctrl-C reaches only the launcher, which forwards it once.
  ::setpgid(0, 0);
  // Die with the launcher. The launcher may already have died before prctl took effect:
  // then our parent is someone else by now.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(128 + SIGKILL);
  // The parent blocked every signal around fork(); handlers go back to their defaults first,
  // so that nothing the launcher installed runs in the child, then the mask is cleared.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigemptyset(&dfl.sa_mask);
  for (int sig : handled_signals) ::sigaction(sig, &dfl, nullptr);
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);

  if (::dup2(stdin_fd, 0) < 0 || ::dup2(out_fd, 1) < 0 || ::dup2(err_fd, 2) < 0) {
    const int e = errno;
    (void)!::write(exec_error_fd, &e, sizeof e);
    ::_exit(127);
  }
  // Nothing else of the launcher's leaks into the rank (sockets of the rendezvous server,
  // other ranks' pipes): everything above 2 closes on exec, the error pipe included.
#ifdef CLOSE_RANGE_CLOEXEC
  if (::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC) != 0)
#endif
  {
    for (int fd = 3; fd < max_fd; ++fd) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  ::execvpe(argv[0], argv, envp);
  const int e = errno;
  (void)!::write(exec_error_fd, &e, sizeof e);
  ::_exit(127);
}

int highest_fd_bound() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
      lim.rlim_cur < 65536) {
    return static_cast<int>(lim.rlim_cur);
  }
  return 65536;
}

}  // namespace

Spawned spawn(const SpawnRequest& request) {
  if (request.argv.empty()) throw SpawnError("nothing to execute", EINVAL);
  // Everything the child needs is built before fork().
  std::vector<char*> argv, envp;
  for (const auto& a : request.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : request.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  auto [out_read, out_write] = make_pipe();
  auto [err_read, err_write] = make_pipe();
  auto [exec_read, exec_write] = make_pipe();
  Fd dev_null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!dev_null)
    throw SpawnError(fmt::format("cannot open /dev/null: {}", std::strerror(errno)), errno);
  const pid_t parent = ::getpid();
  const int max_fd = highest_fd_bound();

  sigset_t all, old;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t pid = ::fork();
  if (pid == 0) {
    exec_child(argv.data(), envp.data(), dev_null.get(), out_write.get(), err_write.get(),
               exec_write.get(), parent, max_fd);
  }
  const int fork_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) {
    throw SpawnError(
        fmt::format("cannot start '{}': fork: {}", request.argv[0], std::strerror(fork_errno)),
        fork_errno);
  }
  // Also here, so the group exists before we signal it, whichever of the two runs first
  // (after the child's exec this fails with EACCES, which is fine).
  ::setpgid(pid, pid);
  out_write.reset();
  err_write.reset();
  exec_write.reset();

  // The error pipe closes on a successful exec; an exec failure writes errno first. The child
  // does nothing that can block before either, so this read ends promptly.
  int child_errno = 0;
  std::size_t got = 0;
  while (got < sizeof child_errno) {
    const ssize_t n = ::read(exec_read.get(), reinterpret_cast<char*>(&child_errno) + got,
                             sizeof child_errno - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got == sizeof child_errno) {
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    throw SpawnError(
        fmt::format("cannot execute '{}': {}", request.argv[0], std::strerror(child_errno)),
        child_errno);
  }
  set_nonblocking(out_read.get());
  set_nonblocking(err_read.get());
  return Spawned{pid, std::move(out_read), std::move(err_read)};
}

std::string signal_name(int sig) {
  if (const char* abbrev = ::sigabbrev_np(sig)) return fmt::format("SIG{}", abbrev);
  return fmt::format("signal {}", sig);
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return fmt::format("was killed by signal {} ({}){}", sig, signal_name(sig),
                       WCOREDUMP(status) ? ", core dumped" : "");
  }
  return fmt::format("ended with wait status {:#x}", status);
}

int exit_code_for(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

namespace {

std::atomic<int> signal_write_fd{-1};
std::atomic<bool> exit_on_signal_flag{false};
struct sigaction previous_actions[std::size(handled_signals)];

void on_signal(int sig) {
  const int saved_errno = errno;
  if (sig != SIGCHLD && sig != SIGPIPE && exit_on_signal_flag.load(std::memory_order_relaxed)) {
    static const char message[] = "baton-launch: interrupted before the ranks started\n";
    (void)!::write(2, message, sizeof message - 1);
    ::_exit(128 + sig);
  }
  const unsigned char byte = static_cast<unsigned char>(sig);
  // Non-blocking: if the pipe is full, the poller has plenty to wake up for already.
  (void)!::write(signal_write_fd.load(std::memory_order_relaxed), &byte, 1);
  errno = saved_errno;
}

}  // namespace

SignalPipe::SignalPipe() {
  auto [r, w] = make_pipe();
  set_nonblocking(r.get());
  set_nonblocking(w.get());
  read_ = std::move(r);
  write_ = std::move(w);
  signal_write_fd.store(write_.get());
  struct sigaction action {};
  action.sa_handler = on_signal;
  ::sigfillset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  ::sigemptyset(&ignore.sa_mask);
  for (std::size_t i = 0; i < std::size(handled_signals); ++i) {
    const int sig = handled_signals[i];
    ::sigaction(sig, sig == SIGPIPE ? &ignore : &action, &previous_actions[i]);
  }
}

SignalPipe::~SignalPipe() {
  for (std::size_t i = 0; i < std::size(handled_signals); ++i) {
    ::sigaction(handled_signals[i], &previous_actions[i], nullptr);
  }
  signal_write_fd.store(-1);
}

std::vector<int> SignalPipe::take() {
  std::vector<int> out;
  unsigned char buf[64];
  for (;;) {
    const ssize_t n = ::read(read_.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; ++i) out.push_back(buf[i]);
  }
  return out;
}

void SignalPipe::wake() const {
  const unsigned char byte = wake_code;
  (void)!::write(write_.get(), &byte, 1);
}

void SignalPipe::exit_on_signal(bool on) {
  exit_on_signal_flag.store(on);
}

}  // namespace baton::launch
