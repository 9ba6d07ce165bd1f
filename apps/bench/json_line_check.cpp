// baton-json-line-check: the benchmarks' JSON line (json_line.h) checks its own rules, without a
// benchmark or a loaded machine (CTest: bench.json_line). The load is read from files this
// program writes, so that one LoadWatch sees a quiet machine, one a loaded one and one a loaded
// one with --allow-load.
//   - compare() follows one rule: above 1, the measured figure is better ("lower": theirs / mine);
//   - a loaded verdict withholds every compare()d key ("ratio", "efficiency", "x_over_y") and
//     keeps the plain ones; --allow-load prints them, marked "loaded": true;
//   - a line with a "value" and no "better" is refused, naming the bench and the case;
//   - a ratio given with add() is refused;
//   - every line says its machine, date, commit and command.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "json_line.h"
#include "load.h"

namespace {

using baton::bench::Better;
using baton::bench::JsonLine;
using baton::bench::LoadWatch;

int failures = 0;

void check(bool ok, const std::string& what, const std::string& line = {}) {
  if (ok) return;
  ++failures;
  fmt::print(stderr, "FAILED: {}{}\n", what, line.empty() ? "" : "\n  line: " + line);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// The message of the std::logic_error `f` throws, or "" if it throws none.
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return {};
}

/// A LoadWatch that reads `load` as the 1-minute load average (from a file in `dir`).
LoadWatch watch_at(const std::filesystem::path& dir, const std::string& name, double load, bool allow) {
  const std::filesystem::path file = dir / name;
  std::ofstream(file) << fmt::format("{:.2f} 0.00 0.00 1/100 1\n", load);
  std::vector<std::string> args{"baton-bench-check", "--quick"};
  if (allow) args.emplace_back("--allow-load");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int argc = static_cast<int>(args.size());
  LoadWatch w;
  w.start(argc, argv.data(), 1, file.string());
  return w;
}

JsonLine sample_line() {
  JsonLine line("check", "hop");
  line.add("value", 40.0).add("unit", "ns").better(Better::lower).add("reference", 50.0);
  line.compare("ratio", 40.0, 50.0).compare("efficiency", 3.0, 4.0, Better::higher);
  line.compare("hierarchical_over_flat", 2.0, 1.0, Better::higher).add("pieces", 100);
  return line;
}

}  // namespace

int main() {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("baton-json-line-check-{}", ::getpid());
  std::filesystem::create_directories(dir);
  // Far above any machine's cores: loaded wherever this runs.
  const double heavy = 100000;

  // One rule for compare(): above 1, the measured figure is better, whatever the unit.
  check(baton::bench::times_better(40, 50, Better::lower) == 1.25, "lower: theirs / mine");
  check(baton::bench::times_better(60, 50, Better::higher) == 1.2, "higher: mine / theirs");

  const LoadWatch quiet = watch_at(dir, "quiet", 0, false);
  const std::string calm = sample_line().text(quiet);
  check(contains(calm, "\"better\": \"lower\""), "the line says which way is better", calm);
  check(contains(calm, "\"ratio\": 1.25"), "ratio of a lower-is-better figure = reference / value", calm);
  check(contains(calm, "\"efficiency\": 0.75") && contains(calm, "\"hierarchical_over_flat\": 2"),
        "a quiet machine prints every compared key", calm);
  check(contains(calm, "\"loaded\": false") && !contains(calm, "withheld"), "a quiet machine withholds nothing", calm);
  for (const char* key : {"\"machine\": \"", "\"date\": \"", "\"commit\": \"", "\"command\": \"scripts/run.sh bench check --quick\""}) {
    check(contains(calm, key), fmt::format("the line carries {}", key), calm);
  }

  const LoadWatch loaded = watch_at(dir, "loaded", heavy, false);
  const std::string busy = sample_line().text(loaded);
  for (const char* key : {"\"ratio\":", "\"efficiency\":", "\"hierarchical_over_flat\":"}) {
    check(!contains(busy, key), fmt::format("a loaded machine withholds {}", key), busy);
  }
  check(contains(busy, "\"withheld\": [\"ratio\", \"efficiency\", \"hierarchical_over_flat\"]"),
        "the line names what it withheld", busy);
  check(contains(busy, "\"ratio_refused\": \"load average"), "the line says why", busy);
  check(contains(busy, "\"value\": 40") && contains(busy, "\"reference\": 50") && contains(busy, "\"pieces\": 100"),
        "a loaded machine keeps the plain keys", busy);
  check(contains(busy, "\"loaded\": true"), "the line says it is loaded", busy);

  const LoadWatch allowed = watch_at(dir, "allowed", heavy, true);
  const std::string shown = sample_line().text(allowed);
  check(contains(shown, "\"ratio\": 1.25") && contains(shown, "\"loaded\": true") && !contains(shown, "withheld"),
        "--allow-load prints the compared keys, marked loaded", shown);

  // A "value" without "better" is refused, naming the bench and the case.
  const std::string no_better = refusal([&] {
    JsonLine line("check", "forgotten");
    line.add("value", 1.0).add("unit", "s");
    (void)line.text(quiet);
  });
  check(contains(no_better, "check") && contains(no_better, "forgotten") && contains(no_better, "better"),
        "a value without better is refused, naming bench and case: '" + no_better + "'");
  // A line without a value (a skipped case, an error) needs none.
  check(refusal([&] { (void)JsonLine("check", "skipped").add("skipped", "no GPU").text(quiet); }).empty(),
        "a line without a value needs no better");
  // A ratio must come from compare(); so must a comparison before better() say its direction.
  check(contains(refusal([] { JsonLine("check", "plain").add("median_ratio", 2.0); }), "compare()"),
        "add() refuses a ratio");
  check(!refusal([] { JsonLine("check", "early").compare("ratio", 1.0, 2.0); }).empty(),
        "compare() before better() is refused");

  std::filesystem::remove_all(dir);
  if (failures > 0) {
    fmt::print(stderr, "baton-json-line-check: {} check(s) failed\n", failures);
    return 1;
  }
  fmt::print("baton-json-line-check: every check passed\n{}\n{}\n", calm, busy);
  return 0;
}
