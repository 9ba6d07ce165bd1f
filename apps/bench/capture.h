#pragma once
// What the benchmarks with a Python reference share: running a shell command and reading its
// stdout, quoting for the shell, finding files beside the program, and reading numbers and
// strings out of the flat JSON line a reference prints.
//
//   auto [status, out] = baton::bench::run_capture("python3 ref.py --steps 10");
//   auto line = baton::bench::last_json_line(out);
//   double rate = baton::bench::json_number(line, "samples_per_s").value_or(NAN);
#include <stdio.h>

#include <array>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace baton::bench {

/// 'text' for /bin/sh, whatever it holds.
inline std::string shell_quote(std::string_view s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

/// Runs a shell command; returns its exit status (as pclose gives it) and stdout (stderr is
/// left alone). The command bounds its own time (wrap it in `timeout` where it could hang).
inline std::pair<int, std::string> run_capture(const std::string& cmd) {
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, {}};
  std::string out;
  std::array<char, 4096> buf{};
  std::size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int status = ::pclose(p);
  return {status, out};
}

inline std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

/// The folder of the running program (/proc/self/exe), or "." if it cannot be read.
inline std::string executable_dir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
}

/// The Python that runs the benchmarks' PyTorch and numpy peers: $BATON_PYTHON if set, else
/// Debian's /usr/bin/python3 (where python3-torch and python3-numpy live, not a pyenv one on
/// PATH), else python3.
inline std::string reference_python() {
  if (const char* env = std::getenv("BATON_PYTHON"); env != nullptr && *env != '\0') return env;
  if (std::filesystem::exists("/usr/bin/python3")) return "/usr/bin/python3";
  return "python3";
}

/// A benchmark's reference script `name` (e.g. "gpt_torch.py"): the path in $`env_var` if set,
/// else the first that exists of the program's own folder (a GPU bundle ships the scripts beside
/// the binaries), the source tree (BATON_SOURCE_DIR, where the target defines it) and the tree
/// two folders above the program (build/bin). "" if none exists, and `missing` says where it looked.
inline std::string find_reference_script(const char* env_var, std::string_view name, std::string& missing) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_var); env != nullptr && *env != '\0') candidates.emplace_back(env);
  candidates.push_back(fmt::format("{}/{}", executable_dir(), name));
#ifdef BATON_SOURCE_DIR
  candidates.push_back(fmt::format("{}/apps/bench/{}", BATON_SOURCE_DIR, name));
#endif
  candidates.push_back(fmt::format("{}/../../apps/bench/{}", executable_dir(), name));
  for (const auto& c : candidates) {
    if (std::filesystem::exists(c)) return c;
  }
  missing = fmt::format("{} not found (looked in: {})", name, fmt::join(candidates, ", "));
  return {};
}

/// The last line of `out` that starts with '{' (a reference's result line), or "".
inline std::string last_json_line(const std::string& out) {
  std::string line;
  std::size_t pos = 0;
  while (pos < out.size()) {
    auto nl = out.find('\n', pos);
    std::string l = out.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    if (!l.empty() && l.front() == '{') line = l;
    if (nl == std::string::npos) break;
    pos = nl + 1;
  }
  return line;
}

/// The string after "key": in a flat JSON object (no escapes), if there is one.
inline std::optional<std::string> json_string(const std::string& line, std::string_view key) {
  const std::string needle = fmt::format("\"{}\": \"", key);
  auto at = line.find(needle);
  if (at == std::string::npos) return std::nullopt;
  auto begin = at + needle.size();
  auto end = line.find('"', begin);
  if (end == std::string::npos) return std::nullopt;
  return line.substr(begin, end - begin);
}

/// The number after "key": in a flat JSON object, if there is one.
inline std::optional<double> json_number(const std::string& line, std::string_view key) {
  const std::string needle = fmt::format("\"{}\":", key);
  auto at = line.find(needle);
  if (at == std::string::npos) return std::nullopt;
  const char* begin = line.c_str() + at + needle.size();
  char* end = nullptr;
  double v = std::strtod(begin, &end);
  if (end == begin) return std::nullopt;
  return v;
}

}  // namespace baton::bench
