#pragma once
// The official openai npm package for the serving tests: tests/serve/openai_client copied under
// the build directory and `npm ci`-ed there once per lock file (under a file lock: two tests
// may ask at once), and a runner for its scripts with a deadline.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

namespace baton::test {

inline std::optional<std::string> on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::filesystem::path p = std::filesystem::path(dir.empty() ? "." : dir) / name;
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return std::nullopt;
}

inline std::string file_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Runs a shell command; its exit status and its output (stdout and stderr).
inline std::pair<int, std::string> shell(const std::string& command) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buf{};
  while (std::size_t n = std::fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

struct NodeClient {
  std::string node;             // the node binary
  std::filesystem::path dir;    // the package, installed
  std::string why_not;          // set when it cannot run (then the test skips saying so)
};

/// The package installed in `work` from `source`, or why not (no node or npm; npm ci failed).
inline NodeClient openai_client(const std::filesystem::path& source, const std::filesystem::path& work) {
  namespace fs = std::filesystem;
  NodeClient c;
  const auto node = on_path("node"), npm = on_path("npm");
  if (!node || !npm) {
    c.why_not = "no node or npm on PATH (Debian: apt-get install nodejs npm)";
    return c;
  }
  c.node = *node;
  c.dir = work;
  fs::create_directories(work);
  const int lock = ::open((work / ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  if (lock >= 0) ::flock(lock, LOCK_EX);
  for (const auto& e : fs::directory_iterator(source)) {
    if (e.is_regular_file()) fs::copy_file(e.path(), work / e.path().filename(), fs::copy_options::overwrite_existing);
  }
  const fs::path installed = work / "node_modules" / ".baton-installed-lock.json";
  if (!fs::exists(installed) || file_text(installed) != file_text(source / "package-lock.json")) {
    const auto [rc, out] = shell("cd '" + work.string() + "' && timeout 180 '" + *npm + "' ci --no-audit --no-fund");
    if (rc != 0) {
      c.why_not = "npm ci could not install the openai package (exit " + std::to_string(rc) + "): " + out;
    } else {
      fs::copy_file(source / "package-lock.json", installed, fs::copy_options::overwrite_existing);
    }
  }
  if (lock >= 0) ::close(lock);
  return c;
}

}  // namespace baton::test
