#pragma once
// The benchmarks' output: one flat JSON object per line on stdout, with the keys every baton
// benchmark shares ("bench", "case", "value", "unit", and "reference" / "ratio" where measured),
// and the machine's load (load.h: "load_start", "load_end", "cores", "own_threads", "loaded").
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "load.h"

namespace baton::bench {

inline std::string json_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
    } else {
      out += c;
    }
  }
  return out;
}

/// Whether `key` holds a ratio against a peer or a formula: "ratio", or a key with "ratio" as one
/// of its '_'-separated words ("median_ratio", "ratio_tbb"). These are what a loaded machine
/// withholds (load.h).
inline bool is_ratio_key(std::string_view key) {
  std::size_t pos = 0;
  while (pos <= key.size()) {
    const auto end = std::min(key.find('_', pos), key.size());
    if (key.substr(pos, end - pos) == "ratio") return true;
    pos = end + 1;
  }
  return false;
}

/// JsonLine("actors", "same_thread_hop").add("value", 54.7).add("unit", "ns/hop").print();
/// print() adds the machine's load (load.h) and withholds the ratio keys on a loaded machine.
class JsonLine {
 public:
  JsonLine(std::string_view bench, std::string_view case_name) : bench_(bench) {
    add("bench", bench);
    add("case", case_name);
  }
  JsonLine& add(std::string_view key, std::string_view v) { return raw(key, fmt::format("\"{}\"", json_escape(v))); }
  JsonLine& add(std::string_view key, const char* v) { return add(key, std::string_view(v)); }
  JsonLine& add(std::string_view key, const std::string& v) { return add(key, std::string_view(v)); }
  JsonLine& add(std::string_view key, bool v) { return raw(key, v ? "true" : "false"); }
  JsonLine& add(std::string_view key, double v) {
    // JSON has no inf or nan; a non-finite measurement is a bug in the benchmark, so say so.
    if (!std::isfinite(v)) {
      fmt::print(stderr, "baton-bench-{}: key '{}' is not finite ({}); printed as null\n", bench_, key, v);
      return raw(key, "null");
    }
    return raw(key, fmt::format("{:.6g}", v));
  }
  JsonLine& add(std::string_view key, std::int64_t v) { return raw(key, fmt::format("{}", v)); }
  JsonLine& add(std::string_view key, int v) { return add(key, std::int64_t{v}); }
  JsonLine& add(std::string_view key, std::uint64_t v) { return raw(key, fmt::format("{}", v)); }
  /// An object of numbers: {"name": value, ...}.
  JsonLine& add(std::string_view key, const std::vector<std::pair<std::string, double>>& numbers) {
    std::string body;
    for (const auto& [name, v] : numbers) {
      body += fmt::format("{}\"{}\": {}", body.empty() ? "" : ", ", json_escape(name),
                          std::isfinite(v) ? fmt::format("{:.6g}", v) : std::string("null"));
    }
    return raw(key, "{" + body + "}");
  }

  /// The line as print() writes it, the load keys included (and the ratios left out where the
  /// load forbids them).
  std::string text() const {
    std::vector<std::pair<std::string, std::string>> entries = entries_;
    const LoadWatch& w = load();
    if (w.started()) {
      const double end = read_loadavg();
      const LoadVerdict v = judge_load(w.start_load(), end, w.cores(), w.own_threads());
      const bool has_ratio =
          std::any_of(entries.begin(), entries.end(), [](const auto& e) { return is_ratio_key(e.first); });
      if (v.loaded && !w.allowed() && has_ratio) {
        std::erase_if(entries, [](const auto& e) { return is_ratio_key(e.first); });
        entries.emplace_back("ratio_refused", fmt::format("\"{} (give --allow-load to print it)\"", json_escape(v.reason)));
      }
      entries.emplace_back("load_start", fmt::format("{:.2f}", w.start_load()));
      entries.emplace_back("load_end", fmt::format("{:.2f}", end));
      entries.emplace_back("cores", fmt::format("{}", w.cores()));
      entries.emplace_back("own_threads", fmt::format("{}", w.own_threads()));
      entries.emplace_back("loaded", v.loaded ? "true" : "false");
    }
    std::string body;
    for (const auto& [k, val] : entries) {
      if (!body.empty()) body += ", ";
      body += fmt::format("\"{}\": {}", json_escape(k), val);
    }
    return "{" + body + "}";
  }
  void print() const {
    fmt::print(stdout, "{}\n", text());
    std::fflush(stdout);
  }

 private:
  JsonLine& raw(std::string_view key, std::string_view value) {
    entries_.emplace_back(std::string(key), std::string(value));
    return *this;
  }
  std::string bench_;
  std::vector<std::pair<std::string, std::string>> entries_;
};

}  // namespace baton::bench
