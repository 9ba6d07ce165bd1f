// baton-serve's HTTP front end (apps/serve/http.h) against a scripted backend: OpenAI's request
// checks and error shapes, the event stream's exact format, back-pressure, clients that leave,
// the drain, /metrics; and the official openai npm package against it (tests/serve/openai_client).
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <boost/json.hpp>

#include "http.h"
#include "http_client.h"
#include "prometheus_text.h"
#include "serve/node_client.h"
#include "skip.h"

namespace {

namespace fs = std::filesystem;
namespace json = boost::json;
using namespace std::chrono_literals;
using baton::serve::Backend;
using baton::serve::Finish;
using baton::serve::HttpServer;
using baton::serve::ServerSettings;
using baton::test::HttpReply;
using Clock = std::chrono::steady_clock;

const std::string api_key = "test-key-0123456789abcdef";

/// A deterministic engine: token i of a request is the prompt's last id + 1 + i, decoded " w<id>";
/// it honours max_tokens and stop strings, and can be told to refuse (queue_full), to hold requests
/// until released, to be slow, and to fail. Each request runs on a thread of its own (the
/// engine's).
class FakeBackend : public Backend {
 public:
  bool text = true;  // set before the server is made (it reads info() once)
  std::atomic<bool> queue_full{false};
  std::atomic<bool> fail_after_first{false};
  std::atomic<int> token_delay_ms{0};

  ~FakeBackend() override {
    {
      std::lock_guard lock(mutex_);
      hold_ = false;
      tokens_paused_ = false;
      for (auto& [id, job] : jobs_) job->cancelled = true;
      changed_.notify_all();
    }
    for (auto& t : threads_) t.join();
  }

  static std::string piece(std::int32_t token) { return " w" + std::to_string(token); }

  baton::serve::ModelInfo info() const override {
    return {.id = "tiny", .context = 256, .vocab = 1000, .text = text, .created = 1700000000};
  }

  std::vector<std::int32_t> encode(const std::string& s) const override {
    if (!text) throw std::invalid_argument("this model has no tokenizer");
    return std::vector<std::int32_t>(s.begin(), s.end());
  }

  std::string check(const baton::serve::Request& r) const override {
    for (auto id : r.prompt) {
      if (id < 0 || id >= 1000)
        return "prompt: token id " + std::to_string(id) + " is outside the vocabulary [0, 1000)";
    }
    if (static_cast<std::int64_t>(r.prompt.size()) + r.max_tokens > 256) {
      return "max_tokens: the prompt plus max_tokens exceed the context (256 tokens)";
    }
    return "";
  }

  Admission submit(baton::serve::Request r, std::uint64_t& id) override {
    std::lock_guard lock(mutex_);
    if (draining_) return Admission::draining;
    if (queue_full) return Admission::queue_full;
    id = ++next_id_;
    auto job = std::make_shared<Job>();
    job->id = id;
    job->request = std::move(r);
    jobs_[id] = job;
    ++submitted_;
    threads_.emplace_back([this, job] { run(*job); });
    changed_.notify_all();
    return Admission::accepted;
  }

  void cancel(std::uint64_t id) override {
    std::lock_guard lock(mutex_);
    cancelled_.push_back(id);
    if (auto it = jobs_.find(id); it != jobs_.end()) it->second->cancelled = true;
    changed_.notify_all();
  }

  baton::serve::Stats stats() const override {
    std::lock_guard lock(mutex_);
    baton::serve::Stats s;
    for (const auto& [id, job] : jobs_) ++(job->running ? s.running : s.waiting);
    s.kv_cache_usage = 0.25;
    return s;
  }

  void drain(Clock::time_point deadline) override {
    std::unique_lock lock(mutex_);
    draining_ = true;
    if (!changed_.wait_until(lock, deadline, [&] { return jobs_.empty(); })) {
      for (auto& [id, job] : jobs_) job->cancelled = true;
      changed_.notify_all();
      changed_.wait(lock, [&] { return jobs_.empty(); });
    }
  }

  std::string failure() const override {
    std::lock_guard lock(mutex_);
    return failure_;
  }

  // --- the test's controls ------------------------------------------------------------------

  void hold() {
    std::lock_guard lock(mutex_);
    hold_ = true;
  }
  void release() {
    std::lock_guard lock(mutex_);
    hold_ = false;
    changed_.notify_all();
  }
  /// Running requests make no token until resume_tokens().
  void pause_tokens() {
    std::lock_guard lock(mutex_);
    tokens_paused_ = true;
  }
  void resume_tokens() {
    std::lock_guard lock(mutex_);
    tokens_paused_ = false;
    changed_.notify_all();
  }
  void fail_for_good(const std::string& why) {
    std::lock_guard lock(mutex_);
    failure_ = why;
  }
  /// Waits until `n` requests were submitted, or `timeout`.
  bool wait_submitted(std::size_t n, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return submitted_ >= n; });
  }
  /// Waits until some request was cancelled, or `timeout`.
  bool wait_cancelled(std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return !cancelled_.empty(); });
  }
  bool wait_running(std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] {
      for (const auto& [id, job] : jobs_) {
        if (job->running) return true;
      }
      return false;
    });
  }
  std::size_t cancelled_count() const {
    std::lock_guard lock(mutex_);
    return cancelled_.size();
  }

 private:
  struct Job {
    std::uint64_t id = 0;
    baton::serve::Request request;
    bool running = false;
    bool cancelled = false;
  };

  /// Sleeps `ms` and while tokens are paused, waking early when the job is cancelled; false if it
  /// was.
  bool pause(Job& job, int ms) {
    std::unique_lock lock(mutex_);
    changed_.wait_for(lock, std::chrono::milliseconds(ms), [&] { return job.cancelled; });
    changed_.wait(lock, [&] { return !tokens_paused_ || job.cancelled; });
    return !job.cancelled;
  }

  void run(Job& job) {
    const baton::serve::Events& events = job.request.events;
    baton::serve::Usage usage{.prompt_tokens =
                                  static_cast<std::int64_t>(job.request.prompt.size())};
    auto end = [&](Finish f, const std::string& error = "") {
      {
        std::lock_guard lock(mutex_);
        jobs_.erase(job.id);
        changed_.notify_all();
      }
      events.finish(f, usage, error);
    };
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return !hold_ || job.cancelled; });
      if (job.cancelled) {
        lock.unlock();
        return end(Finish::cancelled);
      }
      job.running = true;
      changed_.notify_all();
    }
    events.started();
    std::string so_far;
    for (std::int64_t i = 0; i < job.request.max_tokens; ++i) {
      if (!pause(job, token_delay_ms.load())) return end(Finish::cancelled);
      if (fail_after_first && i == 1) return end(Finish::failed, "the fake engine failed");
      const std::int32_t token = job.request.prompt.back() + 1 + static_cast<std::int32_t>(i);
      const std::string next = so_far + piece(token);
      ++usage.completion_tokens;
      for (const std::string& stop : job.request.stop) {
        if (const auto at = next.find(stop); at != std::string::npos) {
          events.token(token,
                       at > so_far.size() ? next.substr(so_far.size(), at - so_far.size()) : "");
          return end(Finish::stop);
        }
      }
      so_far = next;
      events.token(token, piece(token));
    }
    end(Finish::length);
  }

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::uint64_t, std::shared_ptr<Job>> jobs_;
  std::vector<std::thread> threads_;
  std::vector<std::uint64_t> cancelled_;
  std::uint64_t next_id_ = 0;
  std::size_t submitted_ = 0;
  bool hold_ = false;
  bool tokens_paused_ = false;
  bool draining_ = false;
  std::string failure_;
};

/// A server on a free port, serving on a thread of its own, over a FakeBackend.
struct Served {
  FakeBackend backend;
  HttpServer server;
  std::atomic<bool> returned{false};
  std::thread thread;

  explicit Served(const std::function<void(FakeBackend&)>& setup = {}, ServerSettings settings = {})
      : server(configured(backend, setup), with_test_defaults(std::move(settings))) {
    thread = std::thread([this] {
      server.run();
      returned = true;
    });
  }
  ~Served() {
    server.stop();
    thread.join();
  }
  std::uint16_t port() const { return server.port(); }

  bool wait_returned(std::chrono::milliseconds timeout) const {
    const auto until = Clock::now() + timeout;
    while (!returned && Clock::now() < until) std::this_thread::sleep_for(10ms);
    return returned;
  }

  static Backend& configured(FakeBackend& b, const std::function<void(FakeBackend&)>& setup) {
    if (setup) setup(b);
    return b;
  }
  static ServerSettings with_test_defaults(ServerSettings s) {
    s.port = 0;
    if (s.api_key.empty()) s.api_key = api_key;
    return s;
  }
};

HttpReply call(std::uint16_t port, const std::string& method, const std::string& target,
               const std::string& body = "", const std::string& key = api_key) {
  baton::test::HttpRequest r{.method = method, .target = target, .body = body};
  if (!key.empty()) r.headers["Authorization"] = "Bearer " + key;
  if (!body.empty()) r.headers["Content-Type"] = "application/json";
  return baton::test::http_request(port, r, 20s);
}

HttpReply complete(std::uint16_t port, const std::string& body) {
  return call(port, "POST", "/v1/completions", body);
}

/// The error of an OpenAI-shaped error body; fails the test if the shape is not OpenAI's.
json::object error_of(const HttpReply& reply) {
  json::value doc = json::parse(reply.body);
  REQUIRE_MESSAGE(doc.is_object(), reply.body);
  REQUIRE_MESSAGE(doc.as_object().contains("error"), reply.body);
  json::object e = doc.as_object()["error"].as_object();
  CHECK_MESSAGE(e["message"].is_string(), reply.body);
  CHECK_MESSAGE(!e["message"].as_string().empty(), reply.body);
  CHECK_MESSAGE(e["type"].is_string(), reply.body);
  CHECK_MESSAGE((e.contains("param") && (e["param"].is_null() || e["param"].is_string())),
                reply.body);
  CHECK_MESSAGE(e.contains("code"), reply.body);
  return e;
}

std::string param_of(json::object& e) {
  return e["param"].is_null() ? "" : std::string(e["param"].as_string());
}

/// The data lines of an event stream, checking that it is made of `data: ...\n\n` events alone.
std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < body.size()) {
    REQUIRE_MESSAGE(body.compare(pos, 6, "data: ") == 0,
                    "not an event at byte " << pos << ": " << body);
    const auto end = body.find("\n\n", pos);
    REQUIRE_MESSAGE(end != std::string::npos,
                    "an event without its blank line: " << body.substr(pos));
    out.push_back(body.substr(pos + 6, end - pos - 6));
    pos = end + 2;
  }
  return out;
}

/// A raw connection for the tests of clients that leave: send a request, read until some text
/// comes, then close.
struct RawClient {
  boost::asio::io_context io;
  boost::beast::tcp_stream stream{io};
  std::string received;

  explicit RawClient(std::uint16_t port) {
    stream.expires_after(10s);
    const boost::asio::ip::tcp::endpoint to(boost::asio::ip::make_address("127.0.0.1"), port);
    baton::test::run_one(io, [&](auto h) { stream.async_connect(to, h); });
  }
  void send_completion(const std::string& body) {
    const std::string request =
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + api_key +
        "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
        "\r\n\r\n" + body;
    stream.expires_after(10s);
    baton::test::run_one(
        io, [&](auto h) { boost::asio::async_write(stream, boost::asio::buffer(request), h); });
  }
  void read_until(const std::string& needle) {
    std::array<char, 4096> chunk{};
    stream.expires_after(10s);
    while (received.find(needle) == std::string::npos) {
      std::size_t n = 0;
      baton::test::run_one(io, [&](auto h) {
        stream.async_read_some(boost::asio::buffer(chunk),
                               [&n, h](boost::beast::error_code ec, std::size_t got) mutable {
                                 n = got;
                                 h(ec);
                               });
      });
      received.append(chunk.data(), n);
    }
  }
  void close() {
    boost::beast::error_code ec;
    stream.socket().shutdown(boost::asio::ip::tcp::socket::shutdown_both, ec);
    stream.socket().close(ec);
  }
};

/// Two requests on one connection (keep-alive), each answer read in full.
std::vector<HttpReply> on_one_connection(std::uint16_t port,
                                         const std::vector<baton::test::HttpRequest>& requests) {
  namespace http = boost::beast::http;
  boost::asio::io_context io;
  boost::beast::tcp_stream stream(io);
  stream.expires_after(20s);
  const boost::asio::ip::tcp::endpoint to(boost::asio::ip::make_address("127.0.0.1"), port);
  baton::test::run_one(io, [&](auto h) { stream.async_connect(to, h); });
  boost::beast::flat_buffer buffer;
  std::vector<HttpReply> out;
  for (const auto& r : requests) {
    http::request<http::string_body> req(http::string_to_verb(r.method), r.target, 11);
    req.set(http::field::host, "127.0.0.1");
    for (const auto& [k, v] : r.headers) req.set(k, v);
    req.body() = r.body;
    req.prepare_payload();
    baton::test::run_one(io, [&](auto h) { http::async_write(stream, req, h); });
    http::response<http::string_body> res;
    baton::test::run_one(io, [&](auto h) { http::async_read(stream, buffer, res, h); });
    out.push_back({.status = static_cast<int>(res.result_int()), .body = res.body()});
  }
  return out;
}

}  // namespace

TEST_CASE("ServeHttp.Completion.AnswersInOpenAIShape" * doctest::timeout(60)) {
  Served s;
  SUBCASE("a text prompt, to max_tokens") {
    HttpReply r = complete(
        s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":3,"user":"u1","extra":1})");
    REQUIRE_MESSAGE(r.status == 200, r.body);
    CHECK(r.headers.at("content-type") == "application/json");
    json::object o = json::parse(r.body).as_object();
    CHECK(std::string(o["id"].as_string()).starts_with("cmpl-"));
    CHECK(o["object"] == "text_completion");
    CHECK(o["model"] == "tiny");
    CHECK(o["created"].as_int64() > 1600000000);
    json::object choice = o["choices"].as_array().at(0).as_object();
    CHECK(choice["index"] == 0);
    CHECK(choice["text"] == " w112 w113 w114");  // 'o' is 111
    CHECK(choice["logprobs"].is_null());
    CHECK(choice["finish_reason"] == "length");
    json::object usage = o["usage"].as_object();
    CHECK(usage["prompt_tokens"] == 5);
    CHECK(usage["completion_tokens"] == 3);
    CHECK(usage["total_tokens"] == 8);
  }
  SUBCASE("a stop string ends it with finish_reason stop") {
    HttpReply r =
        complete(s.port(), R"({"model":"tiny","prompt":[7],"max_tokens":10,"stop":["w10"]})");
    REQUIRE_MESSAGE(r.status == 200, r.body);
    json::object choice = json::parse(r.body).at("choices").as_array().at(0).as_object();
    CHECK(choice["text"] == " w8 w9 ");
    CHECK(choice["finish_reason"] == "stop");
  }
  SUBCASE("token ids, an array of one string, and nulls for the defaults") {
    CHECK(
        json::parse(complete(s.port(), R"({"model":"tiny","prompt":[1,2,3],"max_tokens":2})").body)
            .at("choices")
            .at(0)
            .at("text") == " w4 w5");
    CHECK(json::parse(
              complete(s.port(), R"({"model":"tiny","prompt":["hello"],"max_tokens":1})").body)
              .at("choices")
              .at(0)
              .at("text") == " w112");
    HttpReply r =
        complete(s.port(), R"({"model":"tiny","prompt":[[4,5]],"max_tokens":null,"temperature":null,
      "top_p":null,"seed":null,"stop":null,"stream":null,"n":1,"echo":false,"logprobs":null,"best_of":1,
      "presence_penalty":0,"frequency_penalty":0.0,"logit_bias":{},"suffix":null,"temperature":0})");
    REQUIRE_MESSAGE(r.status == 200, r.body);
    CHECK(json::parse(r.body).at("usage").at("completion_tokens") ==
          16);  // OpenAI's default max_tokens
  }
  SUBCASE("/v1/models lists the model") {
    HttpReply r = call(s.port(), "GET", "/v1/models");
    REQUIRE(r.status == 200);
    CHECK(json::parse(r.body) ==
          json::parse(R"({"object":"list","data":[{"id":"tiny","object":"model",
      "created":1700000000,"owned_by":"baton"}]})"));
  }
  SUBCASE("keep-alive: two requests on one connection") {
    const baton::test::HttpRequest models{.target = "/v1/models",
                                          .headers = {{"Authorization", "Bearer " + api_key}}};
    baton::test::HttpRequest completion{.method = "POST",
                                        .target = "/v1/completions",
                                        .body = R"({"model":"tiny","prompt":[1],"max_tokens":2})",
                                        .headers = {{"Authorization", "Bearer " + api_key}}};
    const auto replies = on_one_connection(s.port(), {completion, models, completion});
    REQUIRE(replies.size() == 3);
    CHECK(replies[0].status == 200);
    CHECK(replies[1].status == 200);
    CHECK(json::parse(replies[2].body).at("choices").at(0).at("text") == " w2 w3");
  }
}

TEST_CASE("ServeHttp.Completion.ModelWithoutTokenizer" * doctest::timeout(60)) {
  Served s([](FakeBackend& b) { b.text = false; });
  HttpReply r = complete(s.port(), R"({"model":"tiny","prompt":"hello"})");
  CHECK(r.status == 400);
  json::object e = error_of(r);
  CHECK(param_of(e) == "prompt");
  r = complete(s.port(), R"({"model":"tiny","prompt":[20,21],"max_tokens":2})");
  REQUIRE_MESSAGE(r.status == 200, r.body);
  CHECK(json::parse(r.body).at("choices").at(0).at("text") == " w22 w23");
}

TEST_CASE("ServeHttp.BadRequests.EachNamesTheField" * doctest::timeout(120)) {
  Served s([](FakeBackend& b) { b.token_delay_ms = 20; });
  // A good request streams meanwhile, and must come out whole.
  HttpReply good;
  std::thread good_client([&] {
    good = complete(s.port(), R"({"model":"tiny","prompt":[100],"max_tokens":20,"stream":true})");
  });
  struct Case {
    std::string body;
    int status;
    std::string param;  // "" for null
  };
  const std::vector<Case> cases = {
      {R"({"model":"tiny","prompt":"hi",)", 400, ""},
      {R"([1,2,3])", 400, ""},
      {R"("a string")", 400, ""},
      {R"({"prompt":"hi"})", 400, "model"},
      {R"({"model":5,"prompt":"hi"})", 400, "model"},
      {R"({"model":"gpt-4","prompt":"hi"})", 404, "model"},
      {R"({"model":"tiny"})", 400, "prompt"},
      {R"({"model":"tiny","prompt":{}})", 400, "prompt"},
      {R"({"model":"tiny","prompt":[1,"a"]})", 400, "prompt"},
      {R"({"model":"tiny","prompt":["a","b"]})", 400, "prompt"},
      {R"({"model":"tiny","prompt":[[1],[2]]})", 400, "prompt"},
      {R"({"model":"tiny","prompt":""})", 400, "prompt"},
      {R"({"model":"tiny","prompt":[1,5000]})", 400, "prompt"},
      {R"({"model":"tiny","prompt":"hi","max_tokens":"5"})", 400, "max_tokens"},
      {R"({"model":"tiny","prompt":"hi","max_tokens":2.5})", 400, "max_tokens"},
      {R"({"model":"tiny","prompt":"hi","max_tokens":0})", 400, "max_tokens"},
      {R"({"model":"tiny","prompt":"hi","max_tokens":-3})", 400, "max_tokens"},
      {R"({"model":"tiny","prompt":"hi","max_tokens":1000})", 400, "max_tokens"},
      {R"({"model":"tiny","prompt":"hi","temperature":2.5})", 400, "temperature"},
      {R"({"model":"tiny","prompt":"hi","temperature":-0.1})", 400, "temperature"},
      {R"({"model":"tiny","prompt":"hi","temperature":"hot"})", 400, "temperature"},
      {R"({"model":"tiny","prompt":"hi","top_p":0})", 400, "top_p"},
      {R"({"model":"tiny","prompt":"hi","top_p":1.5})", 400, "top_p"},
      {R"({"model":"tiny","prompt":"hi","seed":"x"})", 400, "seed"},
      {R"({"model":"tiny","prompt":"hi","stop":5})", 400, "stop"},
      {R"({"model":"tiny","prompt":"hi","stop":["a","b","c","d","e"]})", 400, "stop"},
      {R"({"model":"tiny","prompt":"hi","stream":"yes"})", 400, "stream"},
      {R"({"model":"tiny","prompt":"hi","stream":true,"stream_options":{"include_usage":1}})", 400,
       "stream_options.include_usage"},
      {R"({"model":"tiny","prompt":"hi","n":2})", 400, "n"},
      {R"({"model":"tiny","prompt":"hi","n":"1"})", 400, "n"},
      {R"({"model":"tiny","prompt":"hi","best_of":3})", 400, "best_of"},
      {R"({"model":"tiny","prompt":"hi","echo":true})", 400, "echo"},
      {R"({"model":"tiny","prompt":"hi","logprobs":2})", 400, "logprobs"},
      {R"({"model":"tiny","prompt":"hi","presence_penalty":0.5})", 400, "presence_penalty"},
      {R"({"model":"tiny","prompt":"hi","frequency_penalty":-1})", 400, "frequency_penalty"},
      {R"({"model":"tiny","prompt":"hi","logit_bias":{"5":10}})", 400, "logit_bias"},
      {R"({"model":"tiny","prompt":"hi","suffix":"end"})", 400, "suffix"},
      {R"({"model":"tiny","prompt":"hi","user":7})", 400, "user"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.body);
    HttpReply r = complete(s.port(), c.body);
    CHECK_MESSAGE(r.status == c.status, r.body);
    json::object e = error_of(r);
    CHECK(param_of(e) == c.param);
    CHECK(e["type"] == "invalid_request_error");
    if (c.status == 404) CHECK(e["code"] == "model_not_found");
  }
  good_client.join();
  REQUIRE_MESSAGE(good.status == 200, good.body);
  const auto events = sse_events(good.body);
  REQUIRE(events.size() == 22);  // 20 tokens, the finish, [DONE]
  std::string text;
  for (std::size_t i = 0; i + 1 < events.size(); ++i) {
    text += json::parse(events[i]).at("choices").at(0).at("text").as_string();
  }
  CHECK(text.starts_with(" w101 w102"));
  CHECK(text.ends_with(" w120"));
  CHECK(events.back() == "[DONE]");
}

TEST_CASE("ServeHttp.Auth.KeyOnEverythingButHealthz" * doctest::timeout(60)) {
  Served s;
  CHECK_THROWS_AS(HttpServer(s.backend, ServerSettings{.port = 0}), std::invalid_argument);
  for (const std::string& key :
       {std::string(), std::string("wrong-key-0123456789"), api_key + "x", api_key.substr(1)}) {
    CAPTURE(key);
    for (const auto& [method, target] :
         std::vector<std::pair<std::string, std::string>>{{"GET", "/v1/models"},
                                                          {"POST", "/v1/completions"},
                                                          {"GET", "/metrics"},
                                                          {"GET", "/api/serve"},
                                                          {"GET", "/nowhere"}}) {
      CAPTURE(target);
      HttpReply r = call(s.port(), method, target,
                         method == "POST" ? R"({"model":"tiny","prompt":"hi"})" : "", key);
      CHECK(r.status == 401);
      json::object e = error_of(r);
      CHECK(e["code"] == "invalid_api_key");
      CHECK(e["type"] == "invalid_request_error");
      CHECK(e["param"].is_null());
    }
  }
  const HttpReply health = call(s.port(), "GET", "/healthz", "", "");
  CHECK(health.status == 200);
  CHECK(json::parse(health.body) == json::parse(R"({"status":"ok"})"));
  baton::test::HttpRequest lower{.target = "/v1/models",
                                 .headers = {{"Authorization", "bearer " + api_key}}};
  CHECK(baton::test::http_request(s.port(), lower).status == 200);
}

TEST_CASE("ServeHttp.Dashboard.ThePageNeedsNoKeyItsStateDoes" * doctest::timeout(60)) {
  // The page holds nothing secret (it asks for the key); /api/serve, which it polls, is the
  // engine's state and the recent requests' percentiles, behind the key.
  Served s;
  const HttpReply page = call(s.port(), "GET", "/", "", "");
  CHECK(page.status == 200);
  CHECK(page.headers.at("content-type").starts_with("text/html"));
  CHECK(page.body.find("/api/serve") != std::string::npos);
  CHECK(call(s.port(), "GET", "/dashboard", "", "").status == 200);
  const HttpReply done = call(s.port(), "POST", "/v1/completions", R"({"model":"tiny","prompt":"hi","max_tokens":3})");
  REQUIRE(done.status == 200);
  const HttpReply state = call(s.port(), "GET", "/api/serve", "");
  REQUIRE(state.status == 200);
  json::object o = json::parse(state.body).as_object();
  CHECK(o["model"] == "tiny");
  for (const char* field : {"running", "waiting", "kv_cache_usage", "steps", "busy_seconds", "generated_tokens",
                            "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "weights", "draining",
                            "stage_busy_seconds"}) {
    CHECK_MESSAGE(o.contains(field), field);
  }
  CHECK(o["requests_recent"].to_number<double>() == 1);
  CHECK(o["ttft_p50_s"].to_number<double>() > 0);
  CHECK(o["stage_busy_seconds"].is_array());
  CHECK(page.body.find("stage_busy_seconds") != std::string::npos);  // the page draws each stage
}

TEST_CASE("ServeHttp.Routes.NotFoundWrongMethodTooLarge" * doctest::timeout(60)) {
  Served s({}, ServerSettings{.max_body_bytes = 1024});
  HttpReply r = call(s.port(), "GET", "/v1/chat/nothing");
  CHECK(r.status == 404);
  error_of(r);
  r = call(s.port(), "GET", "/v1/completions");
  CHECK(r.status == 405);
  CHECK(r.headers["allow"] == "POST");
  error_of(r);
  r = call(s.port(), "POST", "/v1/models", "{}");
  CHECK(r.status == 405);
  r = complete(s.port(), R"({"model":"tiny","prompt":")" + std::string(2000, 'a') + R"("})");
  CHECK(r.status == 413);
  error_of(r);
}

TEST_CASE("ServeHttp.QueueFull.Answers429WithRetryAfter" * doctest::timeout(60)) {
  Served s([](FakeBackend& b) { b.queue_full = true; }, ServerSettings{.retry_after_s = 7});
  HttpReply r = complete(s.port(), R"({"model":"tiny","prompt":"hello","stream":true})");
  CHECK(r.status == 429);
  CHECK(r.headers["retry-after"] == "7");
  json::object e = error_of(r);
  CHECK(e["code"] == "rate_limit_exceeded");
  s.backend.queue_full = false;
  CHECK(complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":1})").status == 200);
}

TEST_CASE("ServeHttp.Stream.FormatAsOpenAIs" * doctest::timeout(60)) {
  Served s;
  for (const bool include_usage : {false, true}) {
    CAPTURE(include_usage);
    const std::string options = include_usage ? R"(,"stream_options":{"include_usage":true})" : "";
    HttpReply r =
        complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":3,"stream":true)" +
                               options + "}");
    REQUIRE_MESSAGE(r.status == 200, r.body);
    CHECK(r.headers["content-type"] == "text/event-stream");
    CHECK(r.headers["transfer-encoding"] == "chunked");
    const auto events = sse_events(r.body);
    REQUIRE(events.size() == (include_usage ? 6u : 5u));
    CHECK(events.back() == "[DONE]");
    std::string id;
    const char* texts[] = {" w112", " w113", " w114", ""};
    for (std::size_t i = 0; i < 4; ++i) {
      CAPTURE(events[i]);
      json::object chunk = json::parse(events[i]).as_object();
      if (i == 0) id = std::string(chunk["id"].as_string());
      CHECK(chunk["id"].as_string() == id);
      CHECK(chunk["object"] == "text_completion");
      CHECK(chunk["model"] == "tiny");
      CHECK(chunk["created"].is_int64());
      CHECK(chunk.contains("usage") == include_usage);
      if (include_usage) CHECK(chunk["usage"].is_null());
      json::array choices = chunk["choices"].as_array();
      REQUIRE(choices.size() == 1);
      CHECK(choices[0].at("index") == 0);
      CHECK(choices[0].at("text") == texts[i]);
      CHECK(choices[0].at("logprobs").is_null());
      if (i < 3)
        CHECK(choices[0].at("finish_reason").is_null());
      else
        CHECK(choices[0].at("finish_reason") == "length");
    }
    if (include_usage) {
      json::object last = json::parse(events[4]).as_object();
      CHECK(last["id"].as_string() == id);
      CHECK(last["choices"].as_array().empty());
      CHECK(last["usage"] ==
            json::parse(R"({"prompt_tokens":5,"completion_tokens":3,"total_tokens":8})"));
    }
  }
}

TEST_CASE("ServeHttp.Stream.EngineFailureMidStream" * doctest::timeout(60)) {
  Served s([](FakeBackend& b) { b.fail_after_first = true; });
  HttpReply r =
      complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":5,"stream":true})");
  REQUIRE(r.status == 200);
  const auto events = sse_events(r.body);
  REQUIRE(events.size() == 2);
  CHECK(json::parse(events[0]).at("choices").at(0).at("text") == " w112");
  json::object e = json::parse(events[1]).at("error").as_object();
  CHECK(e["type"] == "server_error");
  CHECK(std::string(e["message"].as_string()).find("the fake engine failed") != std::string::npos);
  r = complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":5})");
  CHECK(r.status == 503);
  CHECK(error_of(r)["type"] == "server_error");
}

TEST_CASE("ServeHttp.Disconnect.StreamingClientLeavingCancels" * doctest::timeout(60)) {
  Served s([](FakeBackend& b) { b.token_delay_ms = 50; });
  RawClient client(s.port());
  client.send_completion(R"({"model":"tiny","prompt":"hello","max_tokens":200,"stream":true})");
  client.read_until("w113");
  CHECK(s.backend.cancelled_count() == 0);
  client.close();
  CHECK_MESSAGE(s.backend.wait_cancelled(5s),
                "the server did not cancel the request of a client that left");
  // The server goes on serving.
  CHECK(complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":1})").status == 200);
}

TEST_CASE("ServeHttp.Disconnect.WaitingClientLeavingCancels" * doctest::timeout(60)) {
  Served s([](FakeBackend& b) { b.hold(); });
  RawClient client(s.port());
  client.send_completion(R"({"model":"tiny","prompt":"hello","max_tokens":5})");
  REQUIRE(s.backend.wait_submitted(1));
  std::this_thread::sleep_for(100ms);
  CHECK(s.backend.cancelled_count() == 0);
  client.close();
  CHECK_MESSAGE(s.backend.wait_cancelled(5s),
                "the server did not cancel the request of a client that left");
  s.backend.release();
  CHECK(complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":1})").status == 200);
}

TEST_CASE("ServeHttp.Drain.RefusesNewFinishesRunningThenReturns" * doctest::timeout(60)) {
  // The running stream makes no token until the checks of the drain are done.
  Served s([](FakeBackend& b) { b.pause_tokens(); });
  HttpReply running;
  std::thread client([&] {
    running =
        complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":10,"stream":true})");
  });
  REQUIRE(s.backend.wait_running());
  s.server.begin_drain();
  const auto until = Clock::now() + 5s;
  while (call(s.port(), "GET", "/healthz", "", "").status != 503 && Clock::now() < until)
    std::this_thread::sleep_for(10ms);
  CHECK(call(s.port(), "GET", "/healthz", "", "").status == 503);
  const HttpReply refused =
      complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":1})");
  CHECK(refused.status == 503);
  json::object e = error_of(refused);
  CHECK(std::string(e["message"].as_string()).find("shutting down") != std::string::npos);
  CHECK_FALSE(s.returned);
  s.backend.resume_tokens();
  client.join();
  REQUIRE_MESSAGE(running.status == 200, running.body);
  const auto events = sse_events(running.body);
  REQUIRE(events.size() == 12);
  CHECK(events.back() == "[DONE]");
  CHECK(json::parse(events[10]).at("choices").at(0).at("finish_reason") == "length");
  CHECK_MESSAGE(s.wait_returned(10s), "run() did not return after the drain");
}

TEST_CASE("ServeHttp.Failure.EngineFailedForGoodEndsTheServer" * doctest::timeout(60)) {
  Served s;
  CHECK(complete(s.port(), R"({"model":"tiny","prompt":"hello","max_tokens":1})").status == 200);
  s.backend.fail_for_good("a kernel threw");
  CHECK_MESSAGE(s.wait_returned(10s), "run() did not return after the backend failed");
}

TEST_CASE("ServeHttp.Metrics.CountsMatchTheRequests" * doctest::timeout(60)) {
  Served s([](FakeBackend& b) { b.token_delay_ms = 2; });
  struct Made {
    std::string body;
    std::int64_t prompt_tokens, completion_tokens;
  };
  const std::vector<Made> made = {
      {R"({"model":"tiny","prompt":"hello","max_tokens":4})", 5, 4},
      {R"({"model":"tiny","prompt":[1,2],"max_tokens":1})", 2, 1},
      {R"({"model":"tiny","prompt":[7],"max_tokens":10,"stop":"w10"})", 1, 3},
      {R"({"model":"tiny","prompt":"abc","max_tokens":6,"stream":true})", 3, 6},
  };
  std::int64_t prompt = 0, generated = 0, gaps = 0, multi = 0;
  for (const Made& m : made) {
    REQUIRE(complete(s.port(), m.body).status == 200);
    prompt += m.prompt_tokens;
    generated += m.completion_tokens;
    gaps += m.completion_tokens - 1;
    multi += m.completion_tokens > 1 ? 1 : 0;
  }
  complete(s.port(),
           R"({"model":"tiny","prompt":"hello","max_tokens":0})");  // refused: counts nowhere
  HttpReply r = call(s.port(), "GET", "/metrics");
  REQUIRE(r.status == 200);
  CHECK(r.headers["content-type"].starts_with("text/plain; version=0.0.4"));
  const baton::test::PromText prom = baton::test::parse_prometheus(r.body);
  const std::map<std::string, std::string> model{{"model_name", "tiny"}};
  auto value = [&](const std::string& name, std::map<std::string, std::string> labels = {}) {
    labels.insert(model.begin(), model.end());
    const auto found = prom.find(name, labels);
    REQUIRE_MESSAGE(found.size() == 1, name);
    return found[0].value;
  };
  CHECK(value("baton:request_success_total", {{"finished_reason", "length"}}) == 3);
  CHECK(value("baton:request_success_total", {{"finished_reason", "stop"}}) == 1);
  CHECK(value("baton:prompt_tokens_total") == static_cast<double>(prompt));
  CHECK(value("baton:generation_tokens_total") == static_cast<double>(generated));
  CHECK(value("baton:num_requests_running") == 0);
  CHECK(value("baton:num_requests_waiting") == 0);
  CHECK(value("baton:kv_cache_usage_perc") == 0.25);
  const std::map<std::string, double> counts = {
      {"baton:time_to_first_token_seconds", 4},
      {"baton:inter_token_latency_seconds", static_cast<double>(gaps)},
      {"baton:request_time_per_output_token_seconds", static_cast<double>(multi)},
      {"baton:e2e_request_latency_seconds", 4},
      {"baton:request_queue_time_seconds", 4}};
  for (const auto& [name, count] : counts) {
    CAPTURE(name);
    CHECK(prom.types.at(name) == "histogram");
    CHECK(value(name + "_count") == count);
    CHECK(value(name + "_sum") >= 0);
    const auto buckets = prom.find(name + "_bucket", model);
    REQUIRE(buckets.size() > 2);
    double previous = 0;
    for (const auto& b : buckets) {
      CHECK(b.value >= previous);  // cumulative
      previous = b.value;
    }
    CHECK(buckets.back().labels.at("le") == "+Inf");
    CHECK(buckets.back().value == count);
  }
  const auto recent = s.server.metrics().recent();
  CHECK(recent.ttft_samples == 4);
  CHECK(recent.tpot_samples == static_cast<std::size_t>(multi));
  CHECK(recent.ttft_p50 > 0);
  CHECK(recent.ttft_p99 >= recent.ttft_p50);
  CHECK(recent.tpot_p99 >= recent.tpot_p50);
}

TEST_CASE("ServeHttp.ApiKey.RefusesWeakOrGuessableKeys") {
  using baton::serve::check_api_key;
  for (const char* v :
       {"SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "BATON_JOB_TOKEN"})
    ::unsetenv(v);
  CHECK_FALSE(check_api_key("short").empty());
  CHECK_FALSE(check_api_key("fifteen-chars!!").empty());
  CHECK(check_api_key("sixteen-chars!!!").empty());
  ::setenv("SLURM_JOB_ID", "4242424", 1);
  const std::string why = check_api_key("key-4242424-abcdefgh");
  CHECK(why.find("SLURM_JOB_ID") != std::string::npos);
  CHECK(check_api_key("key-1111111-abcdefgh").empty());
  ::setenv("BATON_JOB_TOKEN", "tok-98765", 1);
  CHECK_FALSE(check_api_key("prefix-tok-98765-suffix").empty());
  ::unsetenv("SLURM_JOB_ID");
  ::unsetenv("BATON_JOB_TOKEN");
  const std::string key = baton::serve::random_api_key();
  CHECK(key.size() == 32);
  CHECK(key.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(check_api_key(key).empty());
  CHECK(baton::serve::random_api_key() != key);
}

TEST_CASE("ServeHttp.OpenAIClient.OfficialPackageAgainstTheServer" * doctest::timeout(280)) {
  const baton::test::NodeClient client =
      baton::test::openai_client(BATON_OPENAI_CLIENT_DIR, BATON_OPENAI_CLIENT_WORK_DIR);
  if (!client.why_not.empty()) return baton::test::skip(baton::test::Missing::nodejs, client.why_not);
  Served s;
  const auto [rc, out] =
      baton::test::shell("cd '" + client.dir.string() + "' && BASE_URL=http://127.0.0.1:" + std::to_string(s.port()) +
                         "/v1 API_KEY=" + api_key + " timeout 60 '" + client.node + "' client_test.mjs");
  MESSAGE(out);
  CHECK_MESSAGE(rc == 0, "client_test.mjs failed (exit " << rc << ")");
  CHECK(out.find("FAIL") == std::string::npos);
}
