// baton-launch --dashboard: two real baton-train ranks (a 2-stage pipeline, one stage each)
// send telemetry over the control plane; the launcher's page shows both, live and at the end.
#include <doctest/doctest.h>

#include <regex>
#include <set>
#include <thread>

#include <boost/json.hpp>

#include "http_client.h"
#include "prometheus_text.h"
#include "proc.h"

using namespace std::chrono_literals;
namespace json = boost::json;
using baton::test::Proc;

namespace {

json::object get_json(std::uint16_t port, const std::string& target) {
  return json::parse(baton::test::http_get(port, target).body).as_object();
}

}  // namespace

TEST_CASE("multi-process: baton-launch --dashboard serves every rank of the job" * doctest::timeout(240)) {
  const std::string bin = BATON_BIN_DIR;
  Proc p({bin + "/baton-launch", "--nproc-per-node", "2", "--dashboard", "127.0.0.1:0", "--dashboard-linger", "20", "--",
          bin + "/baton-train", "--model", "mlp", "--data", "synthetic", "--steps", "6000", "--batch", "64", "--pp", "2",
          "--microbatches", "4"});
  std::smatch m;
  const std::regex url_re(R"(dashboard at http://127\.0\.0\.1:(\d+)/)");
  REQUIRE_MESSAGE(p.read_until([&](const std::string&, const std::string& err) { return std::regex_search(err, m, url_re); },
                               30s),
                  p.all());
  const auto port = static_cast<std::uint16_t>(std::stoi(m[1]));

  // Live: both ranks report, and every actor of the plan (rank 0 sends it) has acted.
  json::object state, plan;
  std::set<std::string> names;
  bool live = false;
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (!live && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(200ms);
    plan = get_json(port, "/api/plan");
    state = get_json(port, "/api/state");
    if (!plan.at("complete").as_bool() || state.at("ranks").as_array().size() < 2) continue;
    names.clear();
    for (const auto& a : plan.at("actors").as_array()) {
      // The trained weights brought to the reporting rank ("final.*") move once, at the end.
      std::string name(a.at("name").as_string());
      if (!name.starts_with("final.") || name.ends_with(".last")) names.insert(std::move(name));
    }
    std::size_t acted = 0;
    for (const auto& a : state.at("actors").as_array()) {
      if (names.count(std::string(a.at("name").as_string())) && a.at("acts").to_number<double>() > 0) ++acted;
    }
    live = acted == names.size();
  }
  INFO(json::serialize(state));
  REQUIRE(live);
  CHECK(state.at("status").as_string() == "running");
  CHECK(state.at("world_size").to_number<int>() == 2);
  std::set<std::int64_t> ranks;
  for (const auto& r : state.at("ranks").as_array()) {
    ranks.insert(r.at("rank").to_number<std::int64_t>());
    CHECK(r.at("actors").to_number<int>() > 0);
    CHECK(r.at("acts_per_s").to_number<double>() > 0);
  }
  CHECK(ranks == std::set<std::int64_t>{0, 1});
  // Each actor is reported by the rank the plan puts it on.
  std::map<std::string, std::int64_t> planned;
  for (const auto& a : plan.at("actors").as_array()) {
    planned[std::string(a.at("name").as_string())] = a.at("rank").to_number<std::int64_t>();
  }
  for (const auto& a : state.at("actors").as_array()) {
    CHECK(a.at("rank").to_number<std::int64_t>() == planned.at(std::string(a.at("name").as_string())));
  }
  // /metrics carries both ranks.
  auto prom = baton::test::parse_prometheus(baton::test::http_get(port, "/metrics").body);
  CHECK(prom.find("baton_rank_acts_per_second").size() == 2);
  CHECK(prom.find("baton_actor_acts_total", {{"rank", "0"}}).size() > 0);
  CHECK(prom.find("baton_actor_acts_total", {{"rank", "1"}}).size() > 0);

  // "Record trace": the launcher asks both ranks for a second of activity and merges it.
  const auto traced = baton::test::http_get(port, "/api/trace?seconds=1", 60s);
  REQUIRE_MESSAGE(traced.status == 200, traced.body);
  std::set<std::string> processes;
  std::size_t slices = 0;
  const json::value trace = json::parse(traced.body);  // kept: the loop walks into it
  for (const auto& e : trace.as_object().at("traceEvents").as_array()) {
    const auto& o = e.as_object();
    if (o.at("ph").as_string() == "X") ++slices;
    if (o.at("ph").as_string() == "M" && o.at("name").as_string() == "process_name") {
      processes.insert(std::string(o.at("args").as_object().at("name").as_string()));
    }
  }
  CHECK(processes.size() == 2);
  CHECK(slices > 0);

  // The job ends well; the page, still up, says so and has the last step.
  REQUIRE(p.read_until([](const std::string&, const std::string& err) { return err.find("stays up") != std::string::npos; },
                       120s));
  auto last = get_json(port, "/api/state");
  CHECK(last.at("status").as_string() == "finished");
  CHECK(last.at("training").at("step").to_number<int>() == 6000);
  CHECK(last.at("bad_messages").to_number<int>() == 0);
  p.signal(SIGINT);  // ends the linger
  CHECK(p.wait(30s) == 0);
}
