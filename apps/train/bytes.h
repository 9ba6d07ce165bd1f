#pragma once
// Byte counts on command lines (baton-train's --memory-budget, baton-serve's --kv-cache-memory).
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace baton {

/// "1048576", "512MiB", "2GiB", "1.5GB", "64KB" -> bytes; "" -> 0 (no budget). Throws
/// std::invalid_argument naming `flag` for anything else.
inline std::int64_t parse_bytes(const char* flag, const std::string& text) {
  if (text.empty()) return 0;
  std::size_t used = 0;
  double value = -1;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  const std::map<std::string, double> units{{"", 1},          {"B", 1},         {"KB", 1e3}, {"MB", 1e6},
                                            {"GB", 1e9},       {"KiB", 1024.0},  {"MiB", 1048576.0},
                                            {"GiB", 1073741824.0}};
  auto it = units.find(unit);
  if (used == 0 || it == units.end() || !(value > 0) || !std::isfinite(value)) {
    throw std::invalid_argument(fmt::format("{} '{}': expected a positive number of bytes, optionally with a unit "
                                            "(B, KB, MB, GB, KiB, MiB, GiB)", flag, text));
  }
  return static_cast<std::int64_t>(std::llround(value * it->second));
}

}  // namespace baton
