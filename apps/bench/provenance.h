#pragma once
// Where a benchmark's figure comes from, as every JSON line states it (json_line.h): the machine
// ("machine": the CPU's model name from /proc/cpuinfo; "gpu": the GPU's name where a benchmark
// ran on one and said so with set_gpu()), the date ("date": UTC, ISO 8601, when the line was
// printed), the commit ("commit": the source tree's short hash, "-dirty" when it has changes) and
// the command that reproduces it ("command": scripts/run.sh bench NAME ARGS..., from argv).
//
// The commit: `git -C BATON_SOURCE_DIR rev-parse --short HEAD` when the program runs (the tree
// the binary was built from may have moved on since CMake configured it), else BATON_COMMIT, the
// hash CMake read when it configured (apps/CMakeLists.txt), for a binary run away from its
// source tree (a GPU bundle). Computed once per process, on the first line printed.
#include <sys/utsname.h>

#include <array>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <mutex>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace baton::bench {

/// The CPU's model ("Intel(R) Xeon(R) Processor"): /proc/cpuinfo's first "model name", else
/// the machine's architecture (uname -m; ARM kernels print no model name).
inline std::string cpu_model(const char* path = "/proc/cpuinfo") {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("model name")) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const auto begin = line.find_first_not_of(" \t", colon + 1);
    return begin == std::string::npos ? std::string() : line.substr(begin);
  }
  utsname u{};
  if (uname(&u) == 0) return fmt::format("{} (no model name in {})", u.machine, path);
  return "unknown";
}

/// Now, UTC, ISO 8601 to the second: "2026-11-28T09:41:07Z".
inline std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::array<char, 32> buf{};
  std::strftime(buf.data(), buf.size(), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf.data();
}

/// The first line a shell command prints (stderr discarded), or "" if it fails.
inline std::string first_line_of(const std::string& cmd, int* status = nullptr) {
  std::FILE* p = ::popen((cmd + " 2>/dev/null").c_str(), "r");
  if (p == nullptr) return {};
  std::string out;
  std::array<char, 256> buf{};
  while (std::fgets(buf.data(), static_cast<int>(buf.size()), p) != nullptr) out += buf.data();
  const int rc = ::pclose(p);
  if (status != nullptr) *status = rc;
  if (rc != 0) return {};
  return out.substr(0, out.find('\n'));
}

/// The commit of the source tree at `source_dir` ("3f2a9c1", "3f2a9c1-dirty" where tracked files
/// differ from it), or `fallback` where git or the tree is not there.
inline std::string source_commit(std::string_view source_dir, std::string_view fallback) {
  if (source_dir.empty()) return std::string(fallback);
  const std::string git = fmt::format("git -C '{}'", source_dir);
  const std::string hash = first_line_of(git + " rev-parse --short HEAD");
  if (hash.empty()) return std::string(fallback);
  int status = -1;
  // Untracked files (a build folder, a new test nobody added) do not change what was built.
  const std::string changes = first_line_of(git + " status --porcelain --untracked-files=no", &status);
  if (status != 0) return hash + "-unknown";
  return changes.empty() ? hash : hash + "-dirty";
}

/// The process-wide provenance of the benchmark's lines.
class Provenance {
 public:
  /// The command that reproduces this run, from the benchmark's argv (before any flag is taken
  /// out of it): baton-bench-NAME ARGS... -> "scripts/run.sh bench NAME ARGS...".
  void record_command(int argc, char** argv) {
    std::string prog = argc > 0 ? argv[0] : "";
    prog = prog.substr(prog.rfind('/') + 1);
    constexpr std::string_view prefix = "baton-bench-";
    std::string cmd =
        prog.starts_with(prefix) ? fmt::format("scripts/run.sh bench {}", prog.substr(prefix.size())) : prog;
    for (int i = 1; i < argc; ++i) cmd += " " + shell_word(argv[i]);
    command_ = cmd;
  }
  /// The GPU the lines' figures come from (bench gpu on CUDA), by its name.
  void set_gpu(std::string name) { gpu_ = std::move(name); }

  const std::string& command() const { return command_; }
  const std::string& gpu() const { return gpu_; }
  const std::string& machine() const {
    std::call_once(machine_once_, [this] { machine_ = cpu_model(); });
    return machine_;
  }
  const std::string& commit() const {
    std::call_once(commit_once_, [this] { commit_ = source_commit(source_dir(), compiled_commit()); });
    return commit_;
  }

  /// The source tree this program was built from (BATON_SOURCE_DIR), or "".
  static constexpr std::string_view source_dir() {
#ifdef BATON_SOURCE_DIR
    return BATON_SOURCE_DIR;
#else
    return "";
#endif
  }
  /// The commit CMake read when it configured (BATON_COMMIT), or "unknown".
  static constexpr std::string_view compiled_commit() {
#ifdef BATON_COMMIT
    return BATON_COMMIT;
#else
    return "unknown";
#endif
  }

 private:
  /// `s` as one shell word: as it is where it needs no quotes, else in single quotes.
  static std::string shell_word(std::string_view s) {
    const bool plain = !s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                         "0123456789-_.,/:=+@%") == std::string_view::npos;
    if (plain) return std::string(s);
    std::string out = "'";
    for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return out + "'";
  }

  std::string command_, gpu_;
  mutable std::once_flag machine_once_, commit_once_;
  mutable std::string machine_, commit_;
};

inline Provenance& provenance() {
  static Provenance p;
  return p;
}

}  // namespace baton::bench
