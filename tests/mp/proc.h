#pragma once
// A child process for the multi-process tests: started with extra environment, its stdout and
// stderr collected, every wait with a deadline (a hung child is killed, never waited for).
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace baton::test {

class Proc {
 public:
  using Clock = std::chrono::steady_clock;

  Proc(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {}) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      setpgid(0, 0);  // its own process group: kill_group() reaches whatever it started
      for (const auto& [k, v] : env) {
        if (v.empty()) unsetenv(k.c_str());
        else setenv(k.c_str(), v.c_str(), 1);
      }
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execvp(args[0], args.data());
      dprintf(STDERR_FILENO, "cannot execute '%s': %s\n", argv[0].c_str(), std::strerror(errno));
      _exit(127);
    }
    close(out[1]);
    close(err[1]);
    out_ = out[0];
    err_ = err[0];
  }
  ~Proc() {
    if (!reaped_) {
      kill_group(SIGKILL);
      int st = 0;
      waitpid(pid_, &st, 0);
    }
    if (out_ >= 0) close(out_);
    if (err_ >= 0) close(err_);
  }
  Proc(const Proc&) = delete;
  Proc& operator=(const Proc&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& out() const { return out_text_; }
  const std::string& err() const { return err_text_; }
  std::string all() const { return out_text_ + err_text_; }

  /// Reads output until `done(stdout, stderr)` or the deadline; true if done.
  bool read_until(const std::function<bool(const std::string&, const std::string&)>& done,
                  std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!done(out_text_, err_text_)) {
      if (Clock::now() >= deadline || (out_ < 0 && err_ < 0)) return done(out_text_, err_text_);
      pump(50);
    }
    return true;
  }

  /// Waits for the exit; kills the whole group at the deadline. Returns the exit code, 128+signal
  /// if a signal ended it, or -1 if it had to be killed.
  int wait(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!reaped_) {
      int st = 0;
      pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        break;
      }
      if (Clock::now() >= deadline) {
        kill_group(SIGKILL);
        waitpid(pid_, &st, 0);
        reaped_ = true;
        code_ = -1;
        break;
      }
      pump(20);
    }
    // Whatever is left in the pipes (bounded: the writers are gone or killed).
    for (int i = 0; i < 50 && (out_ >= 0 || err_ >= 0); ++i) pump(20);
    return code_;
  }

  void signal(int sig) const { ::kill(pid_, sig); }
  void kill_group(int sig) const { ::kill(-pid_, sig); }

 private:
  void pump(int timeout_ms) {
    pollfd fds[2] = {{out_, POLLIN, 0}, {err_, POLLIN, 0}};
    if (poll(fds, 2, timeout_ms) <= 0) return;
    char buf[8192];
    for (int i = 0; i < 2; ++i) {
      int& fd = i == 0 ? out_ : err_;
      if (fd < 0 || (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      ssize_t n = read(fd, buf, sizeof buf);
      if (n <= 0) {
        close(fd);
        fd = -1;
      } else {
        (i == 0 ? out_text_ : err_text_).append(buf, static_cast<std::size_t>(n));
      }
    }
  }

  pid_t pid_ = -1;
  int out_ = -1, err_ = -1;
  std::string out_text_, err_text_;
  bool reaped_ = false;
  int code_ = -1;
};

/// Running (a zombie, dead but not yet reaped, counts as gone).
inline bool process_alive(pid_t pid) {
  std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return false;
  char buf[512] = {};
  std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string stat(buf, n);
  auto close_paren = stat.rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < stat.size() && stat[close_paren + 2] != 'Z';
}

/// Process `pid`'s environment, "KEY=value" each; empty if it cannot be read (gone, not ours).
inline std::vector<std::string> environment_of(pid_t pid) {
  std::vector<std::string> vars;
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/environ").c_str(), "r");
  if (f == nullptr) return vars;
  std::string env;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) env.append(buf, n);
  std::fclose(f);
  for (std::size_t at = 0; at < env.size();) {
    const std::size_t end = env.find('\0', at);
    vars.push_back(env.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return vars;
}

/// A TCP port nobody listens to on 127.0.0.1 (the kernel picks it), for BATON_MASTER: the
/// schedulers' default, 29500, may be taken. 0 where no socket could be had.
inline std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof address;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0;
  ::close(fd);
  return ok ? ntohs(address.sin_port) : 0;
}

/// The number after the last `"key": ` in `text` (a JSON line a program printed); NaN if none.
inline double json_number(const std::string& text, const std::string& key) {
  const auto pos = text.rfind("\"" + key + "\": ");
  if (pos == std::string::npos) return std::nan("");
  return std::stod(text.substr(pos + key.size() + 4));
}

}  // namespace baton::test
