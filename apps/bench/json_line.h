#pragma once
// The benchmarks' output: one flat JSON object per line on stdout, with the keys every baton
// benchmark shares: "bench", "case", "value", "unit", "better" (which way "value" is better:
// "higher" or "lower"), "reference" and "ratio" where a peer was measured in the same run; the
// machine's load (load.h: "load_start", "load_end", "cores", "own_threads", "loaded"); and where
// the figure comes from (provenance.h: "machine", "gpu", "date", "commit", "command").
//
// One rule for every comparative key (JsonLine::compare()): it says how many times better
// baton's figure is than what it is compared with, whatever the unit: above 1, baton is better.
// For a "higher" figure that is baton / reference, for a "lower" one reference / baton. On a
// loaded machine print() withholds every comparative key (load.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "load.h"
#include "provenance.h"

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

/// Which way a figure is better: throughput is better higher; latency, memory, an idle fraction
/// or a time lower.
enum class Better { higher, lower };

inline std::string_view better_name(Better b) { return b == Better::higher ? "higher" : "lower"; }

/// How many times better `mine` is than `theirs` for a figure that is better `way`: mine / theirs
/// for higher, theirs / mine for lower. Above 1: `mine` is better.
inline double times_better(double mine, double theirs, Better way) {
  return way == Better::higher ? mine / theirs : theirs / mine;
}

/// Whether `key` reads as a ratio: "ratio", or a key with "ratio" as one of its '_'-separated
/// words ("median_ratio", "ratio_tbb"). Such a key must come from compare(): add() refuses a
/// number under that name, so that no ratio escapes the rule above or the load's verdict.
inline bool is_ratio_key(std::string_view key) {
  std::size_t pos = 0;
  while (pos <= key.size()) {
    const auto end = std::min(key.find('_', pos), key.size());
    if (key.substr(pos, end - pos) == "ratio") return true;
    pos = end + 1;
  }
  return false;
}

/// JsonLine("actors", "same_thread_hop").add("value", 54.7).add("unit", "ns/hop").better(Better::lower)
///     .add("reference", 50.1).compare("ratio", 54.7, 50.1).print();
/// A line with a "value" must say which way it is better (print() throws otherwise, naming the
/// bench and the case). print() adds the load and the provenance, and withholds the comparative
/// keys on a loaded machine.
class JsonLine {
 public:
  JsonLine(std::string_view bench, std::string_view case_name) : bench_(bench), case_(case_name) {
    add("bench", bench);
    add("case", case_name);
  }
  JsonLine& add(std::string_view key, std::string_view v) { return raw(key, fmt::format("\"{}\"", json_escape(v))); }
  JsonLine& add(std::string_view key, const char* v) { return add(key, std::string_view(v)); }
  JsonLine& add(std::string_view key, const std::string& v) { return add(key, std::string_view(v)); }
  JsonLine& add(std::string_view key, bool v) { return raw(key, v ? "true" : "false"); }
  JsonLine& add(std::string_view key, double v) { return raw(key, number(not_a_ratio(key), v)); }
  JsonLine& add(std::string_view key, std::int64_t v) { return raw(not_a_ratio(key), fmt::format("{}", v)); }
  JsonLine& add(std::string_view key, int v) { return add(key, std::int64_t{v}); }
  JsonLine& add(std::string_view key, std::uint64_t v) { return raw(not_a_ratio(key), fmt::format("{}", v)); }
  /// An object of numbers: {"name": value, ...}.
  JsonLine& add(std::string_view key, const std::vector<std::pair<std::string, double>>& numbers) {
    std::string body;
    for (const auto& [name, v] : numbers) {
      body += fmt::format("{}\"{}\": {}", body.empty() ? "" : ", ", json_escape(name),
                          std::isfinite(v) ? fmt::format("{:.6g}", v) : std::string("null"));
    }
    return raw(key, "{" + body + "}");
  }

  /// Which way "value" is better ("better": "higher" or "lower"); also the direction of
  /// compare() without one of its own.
  JsonLine& better(Better way) {
    better_ = way;
    return raw("better", fmt::format("\"{}\"", better_name(way)));
  }

  /// A comparative key: how many times better `mine` is than `theirs` (times_better(): above 1,
  /// `mine` is better), for figures that are better the way "value" is (better(), given before)
  /// or `way`. Withheld on a loaded machine.
  ///   line.add("value", ns).better(Better::lower).add("reference", ref_ns).compare("ratio", ns, ref_ns);
  JsonLine& compare(std::string_view key, double mine, double theirs, Better way) {
    compared_.emplace(key);
    return raw(key, number(key, times_better(mine, theirs, way)));
  }
  JsonLine& compare(std::string_view key, double mine, double theirs) {
    if (!better_) {
      throw std::logic_error(fmt::format("baton-bench-{}: case '{}': compare(\"{}\") before better(): which way is "
                                         "better?",
                                         bench_, case_, key));
    }
    return compare(key, mine, theirs, *better_);
  }

  /// The line as print() writes it, the load and the provenance included (and the comparative
  /// keys left out where the load forbids them). Throws std::logic_error for a line with a
  /// "value" and no "better".
  std::string text(const LoadWatch& w = load()) const {
    const auto has = [&](std::string_view k) {
      return std::any_of(entries_.begin(), entries_.end(), [&](const auto& e) { return e.first == k; });
    };
    if (has("value") && !better_) {
      throw std::logic_error(fmt::format(
          "baton-bench-{}: case '{}' has a \"value\" but no \"better\": say which way it is better "
          "(JsonLine::better(Better::higher or Better::lower))",
          bench_, case_));
    }
    std::vector<std::pair<std::string, std::string>> entries = entries_;
    if (w.started()) {
      const double end = w.load_now();
      const LoadVerdict v = judge_load(w.start_load(), end, w.cores(), w.own_threads());
      if (v.loaded && !w.allowed() && !compared_.empty()) {
        std::string withheld;
        for (const auto& [k, val] : entries_) {
          if (compared_.count(k) != 0) withheld += fmt::format("{}\"{}\"", withheld.empty() ? "" : ", ", json_escape(k));
        }
        std::erase_if(entries, [&](const auto& e) { return compared_.count(e.first) != 0; });
        entries.emplace_back("withheld", "[" + withheld + "]");
        entries.emplace_back("ratio_refused", fmt::format("\"{} (give --allow-load to print it)\"", json_escape(v.reason)));
      }
      entries.emplace_back("load_start", fmt::format("{:.2f}", w.start_load()));
      entries.emplace_back("load_end", fmt::format("{:.2f}", end));
      entries.emplace_back("cores", fmt::format("{}", w.cores()));
      entries.emplace_back("own_threads", fmt::format("{}", w.own_threads()));
      entries.emplace_back("loaded", v.loaded ? "true" : "false");
    }
    const Provenance& p = provenance();
    auto quoted = [](std::string_view s) { return fmt::format("\"{}\"", json_escape(s)); };
    entries.emplace_back("machine", quoted(p.machine()));
    if (!p.gpu().empty()) entries.emplace_back("gpu", quoted(p.gpu()));
    entries.emplace_back("date", quoted(utc_now()));
    entries.emplace_back("commit", quoted(p.commit()));
    if (!p.command().empty()) entries.emplace_back("command", quoted(p.command()));
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
  /// `key`, if it does not read as a ratio (is_ratio_key); else throws: use compare().
  std::string_view not_a_ratio(std::string_view key) const {
    if (is_ratio_key(key)) {
      throw std::logic_error(fmt::format("baton-bench-{}: case '{}': \"{}\" is a ratio: give it with compare(), so "
                                         "that it follows the one rule (above 1: baton better) and the load's verdict",
                                         bench_, case_, key));
    }
    return key;
  }
  /// `v` as JSON: JSON has no inf or nan; a non-finite figure is a bug in the benchmark, so say so.
  std::string number(std::string_view key, double v) const {
    if (!std::isfinite(v)) {
      fmt::print(stderr, "baton-bench-{}: case '{}': key '{}' is not finite ({}); printed as null\n", bench_, case_, key,
                 v);
      return "null";
    }
    return fmt::format("{:.6g}", v);
  }

  std::string bench_, case_;
  std::optional<Better> better_;
  std::set<std::string, std::less<>> compared_;
  std::vector<std::pair<std::string, std::string>> entries_;
};

}  // namespace baton::bench
