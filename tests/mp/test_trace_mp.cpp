// Traces of real processes: baton-launch --trace merges what its ranks stream into one Chrome
// trace, a process per rank on one clock; baton-train --trace writes a job of one rank's itself,
// and one file per rank when the launcher does not merge.
#include <doctest/doctest.h>
#include <unistd.h>

#include <boost/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "proc.h"

using namespace std::chrono_literals;
using baton::test::Proc;
namespace json = boost::json;

namespace {

const std::string bin = BATON_BIN_DIR;

const std::vector<std::string> train_args{"--model", "mlp", "--data", "synthetic", "--steps", "20", "--batch", "32",
                                          "--dp", "2", "--pp", "2", "--microbatches", "2", "--json"};

std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

json::object load(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str()).as_object();  // throws if it is not JSON
}

std::int64_t ns_of(const json::value& v) { return std::llround(v.to_number<double>() * 1000.0); }

/// Process names by pid, thread names by (pid, tid) (workers; their pulls apart), slices per
/// pid and category.
struct Summary {
  std::map<int, std::string> processes;
  std::map<std::pair<int, int>, std::string> threads;
  std::map<std::pair<int, int>, std::string> pull_lanes;
  std::map<std::pair<int, std::string>, int> slices;
  std::set<std::pair<int, int>> tracks_with_slices;
  std::map<std::uint64_t, json::object> starts, ends;
};

Summary summarize(const json::object& trace) {
  Summary s;
  for (const auto& e : trace.at("traceEvents").as_array()) {
    const auto& o = e.as_object();
    const std::string ph = json::value_to<std::string>(o.at("ph"));
    const int pid = o.at("pid").to_number<int>();
    if (ph == "M" && o.at("name") == "process_name") s.processes[pid] = json::value_to<std::string>(o.at("args").at("name"));
    if (ph == "M" && o.at("name") == "thread_name") {
      const std::string name = json::value_to<std::string>(o.at("args").at("name"));
      auto& names = name.find(" pulls") == std::string::npos ? s.threads : s.pull_lanes;
      names[{pid, o.at("tid").to_number<int>()}] = name;
    }
    if (ph == "X") {
      ++s.slices[{pid, json::value_to<std::string>(o.at("cat"))}];
      s.tracks_with_slices.insert({pid, o.at("tid").to_number<int>()});
      CHECK(ns_of(o.at("dur")) >= 0);
    }
    if (ph == "s") s.starts[o.at("id").to_number<std::uint64_t>()] = o;
    if (ph == "f") s.ends[o.at("id").to_number<std::uint64_t>()] = o;
  }
  return s;
}

std::filesystem::path temp(const std::string& name) {
  return std::filesystem::temp_directory_path() / fmt::format("baton-mp-{}-{}", ::getpid(), name);
}

}  // namespace

TEST_CASE("multi-process: baton-launch --trace merges the ranks' traces into one file on one clock" *
          doctest::timeout(180)) {
  const auto path = temp("merged.trace.json");
  Proc p(concat({bin + "/baton-launch", "--nproc-per-node", "2", "--trace", path.string(), "--", bin + "/baton-train"},
                train_args));
  const int code = p.wait(120s);
  INFO(p.all());
  REQUIRE(code == 0);
  CHECK(p.err().find("trace of 2 of 2 ranks") != std::string::npos);
  const json::object trace = load(path);
  std::filesystem::remove(path);
  const Summary s = summarize(trace);

  // A process per rank, a named track per worker (two stages: two devices each).
  REQUIRE(s.processes.size() == 2);
  CHECK(s.processes.at(1).starts_with("rank 0 ("));
  CHECK(s.processes.at(2).starts_with("rank 1 ("));
  CHECK(s.threads.size() == 4);
  CHECK(!s.pull_lanes.empty());
  for (const auto& track : s.tracks_with_slices) CHECK(s.threads.count(track) + s.pull_lanes.count(track) == 1);
  for (int pid : {1, 2}) {
    CAPTURE(pid);
    CHECK(s.slices.count({pid, "forward"}) == 1);
    CHECK(s.slices.count({pid, "backward"}) == 1);
    CHECK(s.slices.count({pid, "transfer"}) == 1);  // the all-reduce's chunks cross ranks
  }
  // Both ranks ended their traces; on one host they share the server's clock exactly.
  const auto& other = trace.at("otherData").as_object();
  CHECK(other.at("truncated") == false);
  std::map<int, std::int64_t> uncertainty;
  for (const auto& r : other.at("ranks").as_array()) {
    CHECK(r.at("finished") == true);
    CHECK(r.at("error") == "");
    uncertainty[r.at("rank").to_number<int>() + 1] = r.at("clock_uncertainty_ns").to_number<std::int64_t>();
  }
  REQUIRE(uncertainty.size() == 2);
  // Every request's arrow ends where it starts or later, across ranks too.
  CHECK(s.starts.size() == s.ends.size());
  int across = 0;
  for (const auto& [id, start] : s.starts) {
    CAPTURE(id);
    REQUIRE(s.ends.count(id) == 1);
    const auto& end = s.ends.at(id);
    const int from = start.at("pid").to_number<int>(), to = end.at("pid").to_number<int>();
    across += from != to;
    CHECK(ns_of(end.at("ts")) + uncertainty[from] + uncertainty[to] >= ns_of(start.at("ts")));
  }
  CHECK(across > 0);
}

TEST_CASE("multi-process: baton-train --trace writes its own file, and one per rank without the launcher's" *
          doctest::timeout(180)) {
  const auto one = temp("one.trace.json");
  Proc single(concat({bin + "/baton-train", "--trace", one.string()}, train_args));
  const auto per_rank = temp("ranks.trace.json");
  Proc ranks(concat({bin + "/baton-launch", "--nproc-per-node", "2", "--", bin + "/baton-train", "--trace",
                     per_rank.string()},
                    train_args));
  const int single_code = single.wait(120s);
  const int ranks_code = ranks.wait(120s);
  INFO(single.all());
  INFO(ranks.all());
  REQUIRE(single_code == 0);
  REQUIRE(ranks_code == 0);
  const Summary s = summarize(load(one));
  std::filesystem::remove(one);
  CHECK(s.processes.size() == 1);
  CHECK(s.threads.size() == 4);  // dp 2 x pp 2 in-process devices
  CHECK(s.pull_lanes.empty());
  CHECK(s.slices.count({1, "transfer"}) == 0);
  for (int r = 0; r < 2; ++r) {
    const std::filesystem::path file = per_rank.string() + fmt::format(".rank{}.json", r);
    CAPTURE(file);
    REQUIRE(std::filesystem::exists(file));
    const Summary rs = summarize(load(file));
    std::filesystem::remove(file);
    CHECK(rs.processes.size() == 1);
    CHECK(rs.processes.begin()->second.starts_with(fmt::format("rank {} (", r)));
    CHECK(rs.slices.count({r + 1, "transfer"}) == 1);
  }
}
