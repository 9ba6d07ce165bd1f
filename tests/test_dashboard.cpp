// The dashboard: the collector, the job model and the HTTP server during real training runs
// (one rank; two ranks through the control plane), read by an HTTP client as a browser or
// Prometheus would.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <sstream>
#include <future>
#include <mutex>
#include <regex>
#include <set>
#include <thread>

#include <boost/json.hpp>
#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "baton/observe.h"
#include "baton/transport/control.h"
#include "baton/transport/loopback.h"
#include "http_client.h"
#include "models.h"
#include "prometheus_text.h"

using namespace baton;
using namespace std::chrono_literals;
namespace json = boost::json;
using observe::Collector;
using observe::DashboardServer;
using observe::JobModel;
using test::http_get;
using test::http_request;

namespace {

/// A 2-stage pipeline (1F1B) of a small MLP on synthetic data: several workers, forward and
/// backward on each stage. `places` empty: two in-process devices; else (rank, device) per stage.
TrainingJob pipeline_job(std::int64_t steps, std::vector<Placement> places = {}) {
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(2048, 32, 10, 3));
  Graph g(11);
  constexpr std::int64_t batch = 64, microbatches = 4;
  Value logits = models::mlp(g, batch / microbatches, {.inputs = 32, .hidden = 96, .layers = 2, .classes = 10});
  Value loss = softmax_cross_entropy(logits, g.find("label"));
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = microbatches;
  cfg.pp = 2;
  cfg.optimizer = optim::adam(1e-3);
  cfg.replica_places = std::move(places);
  cfg.data = {{"synthetic", data::batch_source(dataset, batch, microbatches, 5), {"x", "label"}}};
  return compile_training(g, loss, cfg);
}

/// Hands the run to a collector and keeps the runtime, so that the test can end an endless run
/// once it has seen what it came for.
class Tee : public JobObserver {
 public:
  explicit Tee(Collector& c) : collector_(c) {}
  void on_start(Runtime& rt, transport::ControlClient* control) override {
    collector_.on_start(rt, control);
    std::lock_guard lock(mutex_);
    runtime_ = &rt;
  }
  void on_finish(Runtime& rt, const std::string& error) override {
    {
      // The runtime goes once this returns: no abort() may still be inside it then.
      std::lock_guard lock(mutex_);
      runtime_ = nullptr;
    }
    collector_.on_finish(rt, error);
  }
  /// Ends the run (run_job throws JobError); false if it is not running.
  bool stop() {
    std::lock_guard lock(mutex_);
    if (runtime_ == nullptr) return false;
    runtime_->abort("the test has seen enough");
    return true;
  }

 private:
  Collector& collector_;
  std::mutex mutex_;
  Runtime* runtime_ = nullptr;
};

json::object parse_object(const std::string& text) {
  json::value v = json::parse(text);
  REQUIRE(v.is_object());
  return v.as_object();
}

double num(const json::value& v) { return v.is_null() ? NAN : v.to_number<double>(); }

/// Polls `target` until `ready(json)` or the deadline; returns the last answer.
json::object poll_until(std::uint16_t port, const std::string& target,
                        const std::function<bool(const json::object&)>& ready, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  json::object last;
  while (std::chrono::steady_clock::now() < deadline) {
    auto reply = http_get(port, target);
    REQUIRE(reply.status == 200);
    last = parse_object(reply.body);
    if (ready(last)) return last;
    std::this_thread::sleep_for(100ms);
  }
  return last;
}

/// Every actor of `plan` in the state, with acts > 0.
/// An actor that acts only once the run ends: it reads only what an accumulate "last" writes
/// (the trained weights brought to the reporting rank).
bool acts_at_the_end(const Plan& plan, const ActorDesc& a) {
  if (a.inputs.empty()) return false;
  for (const auto& in : a.inputs) {
    const ActorDesc& producer = plan.actors[plan.registers[in.reg].producer];
    const bool last = producer.kind == ActorKind::accumulate && producer.op == "last";
    const bool bridged = producer.kind == ActorKind::transfer && acts_at_the_end(plan, producer);
    if (!last && !bridged) return false;
  }
  return true;
}

/// Every actor of the plan has acted (those that can only act at the end aside, while it runs).
bool every_actor_acted(const json::object& state, const Plan& plan) {
  std::map<std::string, double> acts;
  for (const auto& a : state.at("actors").as_array()) {
    acts[std::string(a.at("name").as_string())] = num(a.at("acts"));
  }
  const bool running = state.at("status").as_string() == "running";
  for (const auto& a : plan.actors) {
    if (running && acts_at_the_end(plan, a)) continue;
    if (!(acts[a.name] > 0)) return false;
  }
  return true;
}

/// The labels /metrics may use: bounded by the plan and the job, never by the run's length.
const std::set<std::string> bounded_labels = {"rank", "host", "actor", "op", "role", "state", "register"};

void check_prometheus(const std::string& text, const Plan& plan, std::uint32_t ranks) {
  test::PromText prom;
  try {
    prom = test::parse_prometheus(text);
  } catch (const std::exception& e) {
    FAIL("malformed /metrics: " << e.what());
  }
  const std::regex piece_like(R"(.*[#@]\d+$|^\d+$)");
  for (const auto& s : prom.samples) {
    for (const auto& [k, v] : s.labels) {
      INFO("sample " << s.name << " label " << k << "=" << v);
      CHECK(bounded_labels.count(k) == 1);
      // Only the rank is a number; an actor, register or op name that ends in a number is the
      // plan's (matmul_4), never a piece ("#17").
      if (k != "rank") CHECK_FALSE(v.find('#') != std::string::npos);
    }
    if (prom.types.at(s.name) == "counter") CHECK(s.value >= 0);
  }
  for (const auto& a : plan.actors) {
    INFO("actor " << a.name);
    auto acts = prom.find("baton_actor_acts_total", {{"actor", a.name}, {"rank", std::to_string(a.where.rank)}});
    REQUIRE(acts.size() == 1);
    CHECK(acts[0].value > 0);
    CHECK(acts[0].labels.at("op") == a.op);
    CHECK(acts[0].labels.at("role") == std::string(name(a.role)));
    double total = 0;
    for (const char* state : {"busy", "starved", "backpressured", "transferring", "retired"}) {
      auto share = prom.find("baton_actor_time_share", {{"actor", a.name}, {"state", state}});
      REQUIRE(share.size() == 1);
      total += share[0].value;
    }
    // Time, not arithmetic: the shares are read from counters that each actor updates on its
    // own thread while the collector samples them, so an act in flight at the sample lands in
    // one interval or the next: 2% of an interval.
    CHECK(total == doctest::Approx(1.0).epsilon(0.02));
  }
  CHECK(prom.types.at("baton_actor_acts_total") == "counter");
  CHECK(prom.types.at("baton_rank_samples_per_second") == "gauge");
  CHECK(prom.find("baton_rank_acts_per_second").size() == ranks);
  CHECK(prom.find("baton_job_world_size").at(0).value == ranks);
}

/// The four time shares of every actor sum to 100% of the interval's wall time (+- 2%).
void check_time_shares(const json::object& state) {
  for (const auto& a : state.at("actors").as_array()) {
    INFO("actor " << a.at("name").as_string());
    // Live: nobody has retired, and the four states cover the wall time.
    CHECK(num(a.at("retired")) == 0);
    const double sum =
        num(a.at("busy")) + num(a.at("starved")) + num(a.at("backpressured")) + num(a.at("transferring"));
    CHECK(sum == doctest::Approx(1.0).epsilon(0.02));
    CHECK(num(a.at("acts")) > 0);
  }
}

}  // namespace

TEST_CASE("Dashboard.ServesALiveTrainingRun" * doctest::timeout(180)) {
  // Steps enough to run for minutes: the test stops it once it has checked everything.
  TrainingJob job = pipeline_job(1'000'000);
  const Plan plan = insert_transfers(job.plan);
  JobModel model({.title = "test"});
  DashboardServer http(model, {.listen = "127.0.0.1:0"});
  REQUIRE(http.port() != 0);
  CHECK(http.url() == fmt::format("http://127.0.0.1:{}/", http.port()));
  Collector collector({.interval = 200ms});
  collector.feed(model);
  Tee tee(collector);
  JobSettings js;
  js.observer = &tee;
  js.runtime.activity_log = true;
  js.runtime.stall_timeout = 60s;

  std::atomic<std::int64_t> steps_reported{0};
  std::atomic<bool> done{false};
  std::string failure;
  std::thread runner, reporter;
  // A failed REQUIRE ends the test early: the run still stops and the threads are joined.
  struct Cleanup {
    std::function<void()> fn;
    ~Cleanup() { fn(); }
  } cleanup{[&] {
    while (runner.joinable() && !done) {
      tee.stop();
      std::this_thread::sleep_for(10ms);
    }
    done = true;
    if (runner.joinable()) runner.join();
    if (reporter.joinable()) reporter.join();
  }};
  runner = std::thread([&] {
    try {
      run_job(job.plan, job.kernels, JobEnvironment{}, js);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    done = true;
  });
  // What baton-train does: report each finished step.
  reporter = std::thread([&] {
    while (!done) {
      auto losses = job.losses->per_step();
      for (auto s = steps_reported.load(); s < static_cast<std::int64_t>(losses.size()); ++s) {
        collector.record_step({.step = s + 1, .loss = losses[static_cast<std::size_t>(s)], .lr = 1e-3,
                               .samples = (s + 1) * 64});
        steps_reported = s + 1;
      }
      std::this_thread::sleep_for(50ms);
    }
  });

  // Live: every actor has acted and a few samples have come in.
  const json::object state = poll_until(
      http.port(), "/api/state",
      [&](const json::object& s) {
        return s.at("version").to_number<double>() >= 4 && every_actor_acted(s, plan) && !s.at("training").is_null();
      },
      120s);
  CHECK(state.at("status").as_string() == "running");
  REQUIRE(every_actor_acted(state, plan));
  CHECK(state.at("actors").as_array().size() == plan.actors.size());
  check_time_shares(state);
  const auto& training = state.at("training").as_object();
  CHECK(training.at("step").to_number<double>() > 0);
  CHECK(std::isfinite(num(training.at("loss"))));
  CHECK(num(training.at("samples_per_s")) > 0);
  REQUIRE(state.at("ranks").as_array().size() == 1);
  const auto& rank = state.at("ranks").as_array()[0].as_object();
  CHECK(num(rank.at("acts_per_s")) > 0);
  CHECK(num(rank.at("busy")) + num(rank.at("starved")) + num(rank.at("backpressured")) +
            num(rank.at("transferring")) ==
        doctest::Approx(1.0).epsilon(0.02));
  CHECK(rank.at("workers").to_number<int>() >= 2);
  // Edges carry bytes: each register read by a consumer is an edge.
  std::size_t edges = 0;
  for (const auto& r : plan.registers) edges += r.consumers.size();
  CHECK(state.at("edges").as_array().size() == edges);

  // /metrics
  auto metrics = http_get(http.port(), "/metrics");
  CHECK(metrics.status == 200);
  CHECK(metrics.headers["content-type"].starts_with("text/plain; version=0.0.4"));
  check_prometheus(metrics.body, plan, 1);

  // The plan, the history, the timeline.
  auto plan_json = parse_object(http_get(http.port(), "/api/plan").body);
  CHECK(plan_json.at("complete").as_bool());
  CHECK(plan_json.at("actors").as_array().size() == plan.actors.size());
  CHECK(plan_json.at("registers").as_array().size() == plan.registers.size());
  auto history = parse_object(http_get(http.port(), "/api/history?points=50").body);
  CHECK(history.at("t").as_array().size() >= 2);
  CHECK(history.at("t").as_array().size() <= 50);
  CHECK_FALSE(history.at("actors").as_array().empty());
  CHECK_FALSE(history.at("loss").at("step").as_array().empty());
  const auto timeline = poll_until(
      http.port(), "/api/timeline",
      [](const json::object& t) {
        std::set<std::pair<std::int64_t, std::int64_t>> stage_phase;
        for (const auto& lane : t.at("lanes").as_array()) {
          for (const auto& b : lane.at("boxes").as_array()) {
            stage_phase.insert({lane.at("stage").to_number<std::int64_t>(), b.at(0).to_number<std::int64_t>()});
          }
        }
        return stage_phase.size() == 4;  // forward and backward boxes on both stages
      },
      30s);
  CHECK(timeline.at("lanes").as_array().size() == 2);
  for (const auto& lane : timeline.at("lanes").as_array()) {
    for (const auto& b : lane.at("boxes").as_array()) CHECK(num(b.at(3)) >= num(b.at(2)));
  }

  // The page and its assets are in the binary.
  auto page = http_get(http.port(), "/");
  CHECK(page.status == 200);
  CHECK(page.headers["content-type"].starts_with("text/html"));
  CHECK(page.body.find("app.js") != std::string::npos);
  CHECK(http_get(http.port(), "/app.js").status == 200);
  CHECK(http_get(http.port(), "/style.css").status == 200);

  // Read-only, bounded.
  auto missing = http_get(http.port(), "/api/nothing");
  CHECK(missing.status == 404);
  CHECK(http_get(http.port(), "/../etc/passwd").status == 404);
  auto post = http_request(http.port(), {.method = "POST", .target = "/api/state", .body = "{}"});
  CHECK(post.status == 405);
  CHECK(post.headers["allow"] == "GET, HEAD");
  CHECK(http_request(http.port(), {.method = "DELETE", .target = "/metrics"}).status == 405);
  CHECK(http_request(http.port(), {.method = "PUT", .target = "/", .body = "x"}).status == 405);
  auto head = http_request(http.port(), {.method = "HEAD", .target = "/api/state"});
  CHECK(head.status == 200);
  CHECK(head.body.empty());
  auto huge_header = http_request(http.port(), {.target = "/", .headers = {{"X-Junk", std::string(20'000, 'j')}}});
  CHECK(huge_header.status == 431);
  auto with_body = http_request(http.port(), {.method = "GET", .target = "/api/state", .body = "a body"});
  CHECK(with_body.status == 413);

  // Live updates: the event stream pushes the state as it changes.
  {
    namespace beast = boost::beast;
    boost::asio::io_context io;
    beast::tcp_stream stream(io);
    stream.expires_after(20s);
    const boost::asio::ip::tcp::endpoint to(boost::asio::ip::make_address("127.0.0.1"), http.port());
    test::run_one(io, [&](auto h) { stream.async_connect(to, h); });
    const std::string request = "GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n";
    test::run_one(io, [&](auto h) { boost::asio::async_write(stream, boost::asio::buffer(request), h); });
    std::string got;
    std::vector<std::uint64_t> versions;
    char buf[65536];
    while (versions.size() < 2) {
      std::size_t n = 0;
      test::run_one(io, [&](auto h) {
        stream.async_read_some(boost::asio::buffer(buf), [&n, h](beast::error_code ec, std::size_t got_n) mutable {
          n = got_n;
          h(ec);
        });
      });
      got.append(buf, n);
      // Complete events end with a blank line.
      std::size_t end;
      while ((end = got.find("\n\n")) != std::string::npos) {
        const std::string event = got.substr(0, end);
        got.erase(0, end + 2);
        if (event.starts_with("HTTP/1.1")) {
          CHECK(event.find("text/event-stream") != std::string::npos);
          continue;
        }
        const auto data = event.find("data: ");
        if (event.find("event: state") == std::string::npos || data == std::string::npos) continue;
        auto s = parse_object(event.substr(data + 6));
        versions.push_back(s.at("version").to_number<std::uint64_t>());
      }
    }
    CHECK(versions[1] > versions[0]);
  }
  CHECK(http.requests() > 10);

  REQUIRE(tee.stop());
  runner.join();
  reporter.join();
  CHECK(failure.find("the test has seen enough") != std::string::npos);
  // The collector's last word reached the model: the job failed (it was stopped).
  auto last = parse_object(http_get(http.port(), "/api/state").body);
  CHECK(last.at("status").as_string() == "failed");
  CHECK(std::string(last.at("error").as_string()).find("seen enough") != std::string::npos);
  CHECK(model.bad_messages() == 0);
}

TEST_CASE("Dashboard.AFinishedRunEndsRetiredWithItsLastStep" * doctest::timeout(120)) {
  TrainingJob job = pipeline_job(40);
  JobModel model;
  Collector collector({.interval = 100ms});
  collector.feed(model);
  JobSettings js;
  js.observer = &collector;
  js.runtime.activity_log = true;
  run_job(job.plan, job.kernels, JobEnvironment{}, js);
  // After the run, as baton-train does: the last steps, then flush.
  auto losses = job.losses->per_step();
  REQUIRE(losses.size() == 40);
  for (std::size_t s = 0; s < losses.size(); ++s) {
    collector.record_step({.step = static_cast<std::int64_t>(s + 1), .loss = losses[s], .lr = 1e-3,
                           .samples = static_cast<std::int64_t>(s + 1) * 64});
  }
  collector.flush();
  CHECK(model.status() == observe::JobStatus::finished);
  auto state = parse_object(model.state_json());
  CHECK(state.at("status").as_string() == "finished");
  CHECK(state.at("training").at("step").to_number<int>() == 40);
  CHECK(num(state.at("training").at("loss")) == doctest::Approx(losses.back()));
  for (const auto& a : state.at("actors").as_array()) {
    INFO(a.at("name").as_string());
    CHECK(a.at("activity").as_string() == "retired");
  }
  auto history = parse_object(model.history_json());
  CHECK(history.at("loss").at("step").as_array().size() == 40);
  CHECK(collector.samples() >= 1);
  CHECK(model.bad_messages() == 0);
}

TEST_CASE("Dashboard.TwoRanksReachOneModelThroughTheControlPlane" * doctest::timeout(180)) {
  // Stage 0 on rank 0, stage 1 on rank 1, joined by a loopback data plane; the telemetry goes
  // through a real rendezvous server, as baton-launch --dashboard runs it.
  // Steps enough (seconds) that the dashboard sees it running.
  TrainingJob job = pipeline_job(4000, {Placement{.rank = 0}, Placement{.rank = 1}});
  const Plan plan = insert_transfers(job.plan);
  JobModel model({.world_size = 2});
  transport::ServerSettings ss;
  ss.bind_host = "127.0.0.1";
  ss.token = "dash-test";
  ss.world_size = 2;
  ss.join_timeout = 20s;
  ss.on_telemetry = [&](transport::Telemetry t) { model.ingest(t.rank, t.kind, t.body); };
  transport::RendezvousServer server(ss);
  DashboardServer http(model, {.listen = "127.0.0.1:0"});

  std::vector<std::unique_ptr<transport::ControlClient>> clients;
  for (std::uint32_t r = 0; r < 2; ++r) {
    clients.push_back(std::make_unique<transport::ControlClient>(transport::ClientSettings{
        .master = fmt::format("127.0.0.1:{}", server.port()), .token = "dash-test", .rank = r, .world_size = 2,
        .join_timeout = 20s}));
  }
  {
    std::vector<std::future<std::vector<transport::RankInfo>>> joins;
    for (std::uint32_t r = 0; r < 2; ++r) {
      joins.push_back(std::async(std::launch::async, [&, r] {
        return clients[r]->join(transport::RankInfo{.rank = r, .host = fmt::format("host{}", r), .plan_hash = plan.hash()});
      }));
    }
    for (auto& j : joins) j.get();
  }

  transport::LoopbackHub hub(2);
  std::vector<std::unique_ptr<Runtime>> runtimes;
  std::vector<std::unique_ptr<Collector>> collectors;
  for (std::uint16_t r = 0; r < 2; ++r) {
    RuntimeSettings rs;
    rs.rank = r;
    rs.link = &hub.link(r);
    rs.activity_log = true;
    rs.stall_timeout = 60s;
    runtimes.push_back(std::make_unique<Runtime>(plan, job.kernels, rs));
    collectors.push_back(std::make_unique<Collector>(observe::CollectorSettings{.interval = 100ms}));
  }
  hub.start();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (std::uint16_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      collectors[r]->on_start(*runtimes[r], clients[r].get());
      try {
        runtimes[r]->run();
      } catch (const std::exception& e) {
        errors[r] = e.what();
        runtimes[1 - r]->abort(e.what());
      }
      collectors[r]->on_finish(*runtimes[r], errors[r]);
    });
  }
  // While it runs, both ranks show up live.
  const json::object live = poll_until(
      http.port(), "/api/state",
      [&](const json::object& s) { return s.at("ranks").as_array().size() == 2 && every_actor_acted(s, plan); }, 120s);
  for (auto& t : threads) t.join();
  hub.stop();
  REQUIRE(errors[0].empty());
  REQUIRE(errors[1].empty());
  {
    std::vector<std::future<void>> finishes;
    for (auto& c : clients) finishes.push_back(std::async(std::launch::async, [&c] { c->finish(20s); }));
    for (auto& f : finishes) f.get();
  }
  CHECK(live.at("status").as_string() == "running");
  CHECK(live.at("ranks").as_array().size() == 2);
  CHECK(every_actor_acted(live, plan));

  // After the run: every actor of each rank is there, with its rank; the job finished.
  auto state = parse_object(model.state_json());
  CHECK(state.at("status").as_string() == "finished");
  CHECK(model.ranks_seen() == 2);
  std::map<std::string, int> rank_of;
  for (const auto& a : state.at("actors").as_array()) rank_of[std::string(a.at("name").as_string())] = a.at("rank").to_number<int>();
  for (const auto& a : plan.actors) {
    INFO(a.name);
    REQUIRE(rank_of.count(a.name) == 1);
    CHECK(rank_of[a.name] == a.where.rank);
  }
  std::set<std::int64_t> ranks_with_transfers;
  for (const auto& a : state.at("actors").as_array()) {
    if (a.at("role").as_string() == "transfer") ranks_with_transfers.insert(a.at("rank").to_number<std::int64_t>());
  }
  CHECK(ranks_with_transfers == std::set<std::int64_t>{0, 1});  // activations one way, gradients back
  auto timeline = parse_object(model.timeline_json());
  std::set<std::int64_t> lane_ranks;
  for (const auto& lane : timeline.at("lanes").as_array()) lane_ranks.insert(lane.at("rank").to_number<std::int64_t>());
  CHECK(lane_ranks == std::set<std::int64_t>{0, 1});
  check_prometheus(model.prometheus(), plan, 2);
  CHECK(model.bad_messages() == 0);
}

TEST_CASE("Dashboard.ModelAssemblesPartsAndSurvivesBadMessages") {
  JobModel model({.loss_points = 64});
  // A malformed message is counted, not thrown.
  CHECK_FALSE(model.ingest(0, "dash.metrics", "{not json"));
  CHECK_FALSE(model.ingest(0, "dash.metrics", "[1,2]"));
  CHECK_FALSE(model.ingest(0, "dash.metrics", R"({"seq":0})"));
  CHECK_FALSE(model.ingest(0, "dash.hello", R"({"host":3})"));
  CHECK_FALSE(model.ingest(0, "dash.metrics",
                           R"({"seq":0,"elapsed_s":1,"dropped":0,"step":0,"samples":0,"loss":0,"lr":0,"part":0,"parts":1,)"
                           R"("entries":[["a",99999999,1,1,1,1,1,1,1,1,1]]})"));
  CHECK(model.bad_messages() == 5);
  CHECK(model.last_error().find("out of range") != std::string::npos);
  CHECK_FALSE(model.ingest(0, "trace.chunk", "{}"));  // another consumer's kind: ignored, not bad
  CHECK(model.bad_messages() == 5);

  // A chain a -> b -> c: a back-pressured, b busy, c starved: b is the bottleneck. A sample in
  // two parts counts once, when its last part is in.
  auto plan_part = [](int part, const std::string& entries) {
    return fmt::format(R"({{"hash":"00ff","actors":3,"registers":2,"part":{},"parts":2,"entries":[{}]}})", part, entries);
  };
  CHECK(model.ingest(0, "dash.plan", plan_part(0, R"({"t":"a","i":0,"name":"a","kind":"source","op":"src","role":"data","stage":0,"rank":0,"device":"cpu:0","stream":0,"inputs":[],"outputs":[0]},
    {"t":"a","i":1,"name":"b","kind":"compute","op":"slow","role":"forward","stage":0,"rank":0,"device":"cpu:0","stream":0,"inputs":[[0,0]],"outputs":[1]})")));
  CHECK(model.ingest(0, "dash.plan", plan_part(1, R"({"t":"a","i":2,"name":"c","kind":"compute","op":"sink","role":"forward","stage":0,"rank":0,"device":"cpu:0","stream":0,"inputs":[[1,0]],"outputs":[]},
    {"t":"r","i":0,"name":"a.out","slots":2,"bytes":1000,"shape":"[250]","dtype":"f32","producer":0,"consumers":[1]},
    {"t":"r","i":1,"name":"b.out","slots":2,"bytes":4,"shape":"[1]","dtype":"f32","producer":1,"consumers":[2]})")));
  CHECK(model.ingest(0, "dash.hello", R"({"rank":0,"host":"h","world_size":1,"plan_hash":"00ff","workers":["cpu:0/s0"],"actors":3})"));
  auto sample = [&](int seq, double t, std::uint64_t acts) {
    // busy, starved, back-pressured, transferring: a mostly back-pressured, b mostly busy, c starved.
    const std::string head = fmt::format(R"("seq":{},"elapsed_s":{},"dropped":0,"step":{},"samples":{},"loss":0.5,"lr":0.1,"parts":2)",
                                         seq, t, acts, acts * 8);
    CHECK(model.ingest(0, "dash.metrics", fmt::format(R"({{{},"part":0,"entries":[["a",0,{},0,{},{},0,{},0,0,2],["r",0,{},{},2,2]]}})",
                                                      head, acts, acts * 1000, 0.1 * t, 0.9 * t, acts, acts - 1)));
    const std::uint64_t v = model.version();
    CHECK(model.ingest(0, "dash.metrics", fmt::format(R"({{{},"part":1,"entries":[["a",1,{},0,0,{},{},{},0,{},0],["a",2,{},0,0,{},{},0,0,0,1]]}})",
                                                      head, acts, 0.9 * t, 0.05 * t, 0.05 * t, 0.8 * t, acts, 0.02 * t, 0.98 * t)));
    CHECK(model.version() == v + 1);
  };
  sample(0, 1.0, 100);
  sample(1, 2.0, 200);
  auto state = parse_object(model.state_json());
  REQUIRE(state.at("bottleneck").is_object());
  CHECK(state.at("bottleneck").at("name").as_string() == "b");
  CHECK(state.at("bottleneck").at("confident").as_bool());
  for (const auto& a : state.at("actors").as_array()) {
    CHECK(num(a.at("acts_per_s")) == doctest::Approx(100));
  }
  // a.out carries 1000 bytes a piece at 100 pieces/s.
  bool found = false;
  for (const auto& e : state.at("edges").as_array()) {
    if (e.at("reg").to_number<int>() == 0) {
      CHECK(num(e.at("bytes_per_s")) == doctest::Approx(100'000));
      found = true;
    }
  }
  CHECK(found);
  CHECK(state.at("training").at("samples_per_s").to_number<double>() == doctest::Approx(800));

  // The loss curve stays bounded however long the run: every other point goes, the span stays.
  std::string steps = R"({"steps":[)";
  for (int s = 1; s <= 1000; ++s) steps += fmt::format("{}[{},{},0.1,{}]", s > 1 ? "," : "", s, 1.0 / s, s * 8);
  steps += "]}";
  CHECK(model.ingest(0, "dash.steps", steps));
  auto history = parse_object(model.history_json());
  const auto& curve = history.at("loss").at("step").as_array();
  CHECK(curve.size() <= 64);
  CHECK(curve.size() >= 32);
  CHECK(curve.back().to_number<int>() >= 1000 - 32);
  CHECK(model.bad_messages() == 5);
}

TEST_CASE("Dashboard.ListenAddressesAndPortsInUse") {
  using observe::parse_listen;
  CHECK(parse_listen("8080") == std::pair<std::string, std::uint16_t>{"127.0.0.1", 8080});
  CHECK(parse_listen(":0") == std::pair<std::string, std::uint16_t>{"127.0.0.1", 0});
  CHECK(parse_listen("0.0.0.0:9000") == std::pair<std::string, std::uint16_t>{"0.0.0.0", 9000});
  CHECK(parse_listen("[::1]:81") == std::pair<std::string, std::uint16_t>{"::1", 81});
  CHECK_THROWS_WITH_AS(parse_listen("host:"), doctest::Contains("'host:'"), observe::DashboardError);
  CHECK_THROWS_WITH_AS(parse_listen("host:70000"), doctest::Contains("0 to 65535"), observe::DashboardError);
  CHECK_THROWS_WITH_AS(parse_listen("::1:80"), doctest::Contains("brackets"), observe::DashboardError);
  CHECK_THROWS_AS(parse_listen("localhost:http"), observe::DashboardError);

  JobModel model;
  DashboardServer first(model, {.listen = "127.0.0.1:0"});
  const std::string taken = fmt::format("127.0.0.1:{}", first.port());
  CHECK_THROWS_WITH_AS(DashboardServer(model, {.listen = taken}), doctest::Contains(taken.c_str()), observe::DashboardError);
  CHECK_THROWS_WITH_AS(DashboardServer(model, {.listen = taken}), doctest::Contains("in use"), observe::DashboardError);
  CHECK_THROWS_WITH_AS(DashboardServer(model, {.listen = "192.0.2.1:0"}), doctest::Contains("192.0.2.1:0"),
                       observe::DashboardError);
  // An empty model serves an empty but well-formed state.
  auto state = parse_object(http_get(first.port(), "/api/state").body);
  CHECK(state.at("status").as_string() == "waiting");
  CHECK(state.at("actors").as_array().empty());
  CHECK_NOTHROW(test::parse_prometheus(http_get(first.port(), "/metrics").body));
}

TEST_CASE("Dashboard.GrafanaPanelsQueryWhatMetricsExports" * doctest::timeout(60)) {
  // docs/grafana/baton.json must only ask for metric families and labels that /metrics has.
  std::ifstream in(std::string(BATON_SOURCE_DIR) + "/docs/grafana/baton.json");
  REQUIRE(in.good());
  const json::value dash = json::parse(std::string(std::istreambuf_iterator<char>(in), {}));
  std::vector<std::string> exprs;
  for (const auto& p : dash.at("panels").as_array()) {
    for (const auto& t : p.at("targets").as_array()) exprs.emplace_back(t.at("expr").as_string());
  }
  REQUIRE(exprs.size() >= 15);

  TrainingJob job = pipeline_job(30);
  JobModel model;
  Collector collector({.interval = 50ms});
  collector.feed(model);
  JobSettings js;
  js.observer = &collector;
  collector.before_sample([&, reported = std::size_t{0}]() mutable {
    for (auto losses = job.losses->per_step(); reported < losses.size(); ++reported) {
      collector.record_step({.step = static_cast<std::int64_t>(reported + 1), .loss = losses[reported], .lr = 1e-3,
                             .samples = static_cast<std::int64_t>(reported + 1) * 64});
    }
  });
  run_job(job.plan, job.kernels, JobEnvironment{}, js);
  const auto prom = test::parse_prometheus(model.prometheus());

  const std::regex metric(R"(\bbaton_[a-z_]+)"), by(R"(by \(([a-z_, ]+)\))");
  std::set<std::string> used;
  for (const auto& e : exprs) {
    INFO(e);
    for (std::sregex_iterator it(e.begin(), e.end(), metric), end; it != end; ++it) {
      used.insert(it->str());
      CHECK_MESSAGE(prom.types.count(it->str()) == 1, it->str() << " is not in /metrics");
      CHECK_FALSE(prom.find(it->str()).empty());
    }
    for (std::sregex_iterator it(e.begin(), e.end(), by), end; it != end; ++it) {
      std::stringstream labels((*it)[1].str());
      for (std::string l; std::getline(labels, l, ',');) {
        l.erase(0, l.find_first_not_of(' '));
        CHECK_MESSAGE(bounded_labels.count(l) == 1, l);
      }
    }
  }
  CHECK(used.size() >= 12);
}

TEST_CASE("Dashboard.ABigPlanTravelsInPartsUnderTheTelemetryLimit" * doctest::timeout(120)) {
  // 6000 actors: the plan and each sample of counters are bigger than one telemetry message.
  constexpr int n = 6000;
  Plan plan;
  RegisterIndex prev = 0;
  for (int i = 0; i < n; ++i) {
    ActorDesc a{.name = fmt::format("actor_with_a_long_name_{:05}", i), .op = "noop"};
    if (i == 0) {
      a.kind = ActorKind::source;
      a.pieces = 3;
    } else {
      a.inputs = {{prev}};
    }
    if (i + 1 < n) {
      prev = plan.add_register({.name = fmt::format("register_{:05}", i), .shape = {0}, .dtype = f32, .slots = 2});
      a.outputs = {prev};
    }
    plan.add_actor(std::move(a));
  }
  JobModel model;
  std::map<std::string, int> messages;
  std::size_t largest = 0;
  Collector collector({.interval = 50ms});
  collector.feed([&](const std::string& kind, const std::string& body) {
    largest = std::max(largest, body.size());
    ++messages[kind];
    CHECK(model.ingest(0, kind, body));
  });
  // Exact time accounting: a run of 3 pieces is over before a sampler's first look, and the
  // samples' zeros would make the counters' message small enough for one.
  RuntimeSettings exact;
  exact.time_sample_hz = 0;
  Runtime rt(plan, KernelRegistry::with_builtin_kernels(), exact);
  collector.on_start(rt, nullptr);
  rt.run();
  collector.on_finish(rt, {});
  CHECK(largest <= transport::max_telemetry_bytes);
  CHECK(messages["dash.plan"] >= 2);
  CHECK(messages["dash.metrics"] >= 2);
  auto plan_json = parse_object(model.plan_json());
  CHECK(plan_json.at("complete").as_bool());
  CHECK(plan_json.at("actors").as_array().size() == n);
  auto state = parse_object(model.state_json());
  REQUIRE(state.at("actors").as_array().size() == n);
  for (const auto& a : state.at("actors").as_array()) CHECK(a.at("acts").to_number<int>() == 3);
  CHECK(state.at("status").as_string() == "finished");
  CHECK(model.bad_messages() == 0);
}

TEST_CASE("Dashboard.ABusyWorkerOfSmallActorsIsTheBottleneck") {
  // Three actors share one worker thread, busy 20%, 30% and 40% of the time: no actor is
  // saturated, but the thread is (90%), so the hint names the worker and its busiest actor.
  JobModel model;
  std::string entries;
  for (int i = 0; i < 3; ++i) {
    entries += fmt::format(R"({}{{"t":"a","i":{},"name":"op{}","kind":"compute","op":"matmul","role":"forward","stage":1,"rank":0,"device":"cpu:1","stream":0,"inputs":[],"outputs":[]}})",
                           i ? "," : "", i, i);
  }
  CHECK(model.ingest(0, "dash.plan", fmt::format(R"({{"hash":"01","actors":3,"registers":0,"part":0,"parts":1,"entries":[{}]}})", entries)));
  for (int seq = 0; seq < 2; ++seq) {
    const double t = 1.0 + seq;
    std::string e;
    for (int i = 0; i < 3; ++i) {
      const double busy = 0.2 + 0.1 * i;
      e += fmt::format(R"({}["a",{},{},0,0,{},{},0,0,{},1])", i ? "," : "", i, 100 * (seq + 1), busy * t, (1 - busy) * t, busy * t);
    }
    CHECK(model.ingest(0, "dash.metrics", fmt::format(R"({{"seq":{},"elapsed_s":{},"dropped":0,"step":0,"samples":0,"loss":0,"lr":0,"part":0,"parts":1,"entries":[{}]}})", seq, t, e)));
  }
  auto state = parse_object(model.state_json());
  REQUIRE(state.at("bottleneck").is_object());
  const auto& b = state.at("bottleneck").as_object();
  CHECK(b.at("worker").as_string() == "cpu:1/s0");
  CHECK(num(b.at("worker_busy")) == doctest::Approx(0.9));
  CHECK(b.at("name").as_string() == "op2");
  CHECK(std::string(b.at("text").as_string()).find("stage 1") != std::string::npos);
  CHECK(model.bad_messages() == 0);
}

namespace {
/// Keeps the runtime of a run, so that the test can end it once it has what it came for.
class Grab final : public JobObserver {
 public:
  void on_start(Runtime& rt, transport::ControlClient*) override {
    std::lock_guard lock(mutex_);
    runtime_ = &rt;
  }
  void on_finish(Runtime&, const std::string&) override {
    std::lock_guard lock(mutex_);
    runtime_ = nullptr;
  }
  bool stop() {
    std::lock_guard lock(mutex_);
    if (runtime_ == nullptr) return false;
    runtime_->abort("the test has seen enough");
    return true;
  }

 private:
  std::mutex mutex_;
  Runtime* runtime_ = nullptr;
};
}  // namespace

TEST_CASE("Dashboard.RecordTraceGivesAChromeTraceOfTheNextSeconds" * doctest::timeout(120)) {
  TrainingJob job = pipeline_job(1'000'000);  // endless for this test: it ends the run itself
  observe::Watch watch({.listen = "127.0.0.1:0", .title = "trace button"});
  REQUIRE(watch.serving());
  std::smatch m;
  const std::string url = watch.url();
  REQUIRE(std::regex_search(url, m, std::regex(R"(:(\d+)/$)")));
  const auto port = static_cast<std::uint16_t>(std::stoi(m[1]));
  JobSettings js;
  watch.attach(js);
  Grab grab;
  JobObservers both({js.observer, &grab});
  js.observer = &both;
  std::atomic<bool> done{false};
  std::thread runner([&] {
    try {
      run_job(job.plan, job.kernels, JobEnvironment{}, js);
    } catch (const JobError&) {  // the test ends it
    }
    done = true;
  });
  struct Cleanup {
    std::function<void()> fn;
    ~Cleanup() { fn(); }
  } cleanup{[&] {
    while (!done) {
      grab.stop();
      std::this_thread::sleep_for(10ms);
    }
    runner.join();
  }};

  CHECK(http_get(port, "/api/trace?seconds=0").status == 400);
  CHECK(http_get(port, "/api/trace?seconds=abc").status == 400);
  const auto t0 = std::chrono::steady_clock::now();
  const auto reply = http_get(port, "/api/trace?seconds=1", 30s);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE_MESSAGE(reply.status == 200, reply.body);
  CHECK(took >= 1.0);  // it recorded the next second, not what was there
  CHECK(reply.headers.at("content-disposition").find("baton-trace.json") != std::string::npos);
  const json::object trace = json::parse(reply.body).as_object();
  std::set<std::string> acted, threads;
  for (const auto& e : trace.at("traceEvents").as_array()) {
    const auto& o = e.as_object();
    const std::string ph(o.at("ph").as_string());
    if (ph == "X") acted.insert(std::string(o.at("name").as_string()));
    if (ph == "M" && o.at("name").as_string() == "thread_name") {
      threads.insert(std::string(o.at("args").as_object().at("name").as_string()));
    }
  }
  // The pipeline's ops of both stages ran in the window, each worker has its track.
  for (const auto& a : job.plan.actors) {
    if (a.role == ActorRole::forward || a.role == ActorRole::backward) CHECK_MESSAGE(acted.count(a.name), a.name);
  }
  CHECK(threads.count("cpu:0/s0"));
  CHECK(threads.count("cpu:1/s0"));
  // The page's timeline still fills after the recording switched itself off.
  const auto before = json::parse(http_get(port, "/api/timeline").body).as_object();
  std::this_thread::sleep_for(1500ms);
  const auto after = json::parse(http_get(port, "/api/timeline").body).as_object();
  CHECK(json::serialize(before) != json::serialize(after));

  // A page without a trace recorder says so.
  JobModel model;
  DashboardServer plain(model, {.listen = "127.0.0.1:0"});
  CHECK(http_get(plain.port(), "/api/trace?seconds=1").status == 404);
}

// With data parallelism the timeline has a third row: each step's gradient all-reduce on each
// replica's device (phase 2, "AR"), from its first act to its last, so that how much of it sits
// under the backward pass is visible; the loss's all-reduce is not drawn.
TEST_CASE("Dashboard.TimelineShowsTheGradientAllReduceOfEachStep" * doctest::timeout(60)) {
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(2048, 32, 10, 3));
  Graph g(11);
  constexpr std::int64_t batch = 64, steps = 6;
  Value logits = models::mlp(g, batch / 4, {.inputs = 32, .hidden = 96, .layers = 2, .classes = 10});
  Value loss = softmax_cross_entropy(logits, g.find("label"));
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = 2;
  cfg.dp = 2;
  cfg.optimizer = optim::adam(1e-3);
  cfg.data = {{"synthetic", data::batch_source(dataset, batch, 4, 5), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  JobModel model;
  Collector collector({.interval = 50ms});
  collector.feed([&](const std::string& kind, const std::string& body) { CHECK(model.ingest(0, kind, body)); });
  RuntimeSettings rs;
  rs.activity_log = true;
  Runtime rt(job.plan, job.kernels, rs);
  collector.on_start(rt, nullptr);
  rt.run();
  collector.on_finish(rt, {});
  const auto timeline = parse_object(model.timeline_json());
  std::map<std::string, std::set<std::int64_t>> steps_by_device;  // phase-2 pieces per lane
  for (const auto& lane : timeline.at("lanes").as_array()) {
    for (const auto& b : lane.at("boxes").as_array()) {
      if (b.at(0).to_number<std::int64_t>() != 2) continue;
      CHECK(num(b.at(3)) >= num(b.at(2)));
      steps_by_device[std::string(lane.at("device").as_string())].insert(b.at(1).to_number<std::int64_t>());
    }
  }
  // Each replica's device, every step (the all-reduce acts once a step: its pieces are steps).
  REQUIRE(steps_by_device.size() == 2);
  for (const auto& [device, pieces] : steps_by_device) {
    INFO(device);
    CHECK(pieces == std::set<std::int64_t>{0, 1, 2, 3, 4, 5});
  }
}

// A rank that left the job (a parameter-server worker under staleness, JobModel::rank_left):
// its row says "left", the page's "left" line says who, at which step (the job's, as the model
// knows it) and why; the job itself is not failed by it.
TEST_CASE("Dashboard.ARankThatLeftIsShownAsLeftWithItsStepAndReason") {
  JobModel model({.world_size = 3});
  for (std::uint32_t r = 0; r < 3; ++r) {
    CHECK(model.ingest(r, "dash.hello", fmt::format(R"({{"rank":{},"host":"h","world_size":3,"plan_hash":"00ff","workers":["cpu:0/s0"],"actors":0}})", r)));
  }
  CHECK(model.ingest(2, "dash.metrics",
                     R"({"seq":0,"elapsed_s":1,"dropped":0,"step":37,"samples":370,"loss":0.5,"lr":0.1,"part":0,"parts":1,"entries":[]})"));
  const std::uint64_t before = model.version();
  model.rank_left(1, "it was killed by signal 9 (SIGKILL)");
  CHECK(model.version() > before);
  model.rank_left(1, "a second word is not kept");
  const auto state = boost::json::parse(model.state_json()).as_object();
  CHECK(state.at("status").as_string() != "failed");
  CHECK(state.at("error").as_string().empty());
  const auto& left = state.at("left").as_array();
  REQUIRE(left.size() == 1);
  CHECK(std::string(left[0].as_string()) ==
        "rank 1 left at step 37: it was killed by signal 9 (SIGKILL); the job goes on without it");
  int rows_left = 0;
  for (const auto& r : state.at("ranks").as_array()) {
    if (r.as_object().at("status").as_string() == "left") {
      ++rows_left;
      CHECK(r.as_object().at("rank").as_int64() == 1);
    }
  }
  CHECK(rows_left == 1);
  // It comes back (baton-launch --max-restarts): running again, and the page says so.
  model.rank_rejoined(1, 51);
  const auto back = boost::json::parse(model.state_json()).as_object();
  const auto& said = back.at("left").as_array();
  REQUIRE(said.size() == 1);
  CHECK(std::string(said[0].as_string()) ==
        "rank 1 left at step 37 (it was killed by signal 9 (SIGKILL)) and came back: it trains from step 52 on");
  for (const auto& r : back.at("ranks").as_array()) CHECK(r.as_object().at("status").as_string() != "left");
}
