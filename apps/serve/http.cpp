// baton-serve's HTTP front end: Boost.Beast on one io_context, run by the thread that calls
// HttpServer::run(), so no handler runs concurrently with another and no strand is needed. The
// engine's events arrive on its own thread; they only take the time and post to the io_context.
//
// A connection reads one request at a time (keep-alive). While a completion runs, a read stays
// pending on the socket so that a client who leaves is seen at once (EOF) and its request
// cancelled, streamed or not.
#include "http.h"

#include <array>
#include <cctype>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "dashboard.h"
#include "openai.h"

namespace baton::serve {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

/// Request headers beyond this are refused (431).
constexpr std::size_t max_header_bytes = 16 * 1024;
/// What a client may send ahead (a pipelined request) while its completion runs; past this the
/// server stops reading, and so stops noticing that the client left.
constexpr std::size_t max_read_ahead_bytes = 64 * 1024;
/// How often the server asks the backend whether it failed for good.
constexpr auto failure_poll_every = std::chrono::milliseconds(200);
/// After a last answer, how long the client's remaining bytes are read and dropped.
constexpr auto linger_for = std::chrono::seconds(2);

/// Posts work to the io_context from any thread (the engine's) until the server goes; then drops
/// it.
class Poster {
 public:
  explicit Poster(net::io_context::executor_type executor) : executor_(executor) {}
  template <class F>
  void post(F&& f) {
    std::lock_guard lock(mutex_);
    if (open_) net::post(executor_, std::forward<F>(f));
  }
  void close() {
    std::lock_guard lock(mutex_);
    open_ = false;
  }

 private:
  std::mutex mutex_;
  bool open_ = true;
  net::io_context::executor_type executor_;
};

/// What every connection shares. io thread only, except what says otherwise.
struct State {
  Backend& backend;
  ServerSettings settings;
  ModelInfo info;
  Metrics metrics;                 // thread-safe
  std::shared_ptr<Poster> poster;  // set once the io_context exists
  std::mt19937_64 random;
  std::uint64_t id_nonce = 0;
  std::uint64_t completions = 0;
  bool draining = false;
  std::string failure;  // the backend's, once seen
  /// The drain completed or the backend failed: run() returns once no completion is unanswered.
  bool ending = false;
  std::size_t unanswered = 0;
  std::function<void()> stop_now;

  State(Backend& b, ServerSettings s)
      : backend(b),
        settings(std::move(s)),
        info(b.info()),
        metrics(info.id),
        random(std::random_device{}()) {
    id_nonce = random();
  }

  void log(const std::string& line) const {
    if (settings.log) settings.log(line);
  }
  void maybe_end() {
    if (ending && unanswered == 0 && stop_now) stop_now();
  }
};

/// Counts a completion the server has not answered in full (run() waits for none at the end).
class Unanswered {
 public:
  explicit Unanswered(State& state) : state_(state) { ++state_.unanswered; }
  ~Unanswered() {
    --state_.unanswered;
    state_.maybe_end();
  }
  Unanswered(const Unanswered&) = delete;
  Unanswered& operator=(const Unanswered&) = delete;

 private:
  State& state_;
};

/// One completion: what its answers repeat and when its events came. io thread only.
struct Call {
  CompletionMeta meta;
  bool stream = false;
  bool include_usage = false;
  std::uint64_t id = 0;  // the backend's, once accepted
  RequestTimes times;
  bool finished = false;
};

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

/// Compares in time that depends on the lengths only, not on where they differ.
bool equal_constant_time(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  return diff == 0;
}

bool authorized(const http::request<http::string_body>& req, const std::string& key) {
  const std::string_view header = req[http::field::authorization];
  constexpr std::string_view scheme = "bearer ";
  if (header.size() < scheme.size()) return false;
  for (std::size_t i = 0; i < scheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(header[i])) != scheme[i]) return false;
  }
  return equal_constant_time(header.substr(scheme.size()), key);
}

/// The request field a backend's check() reason names, when it starts with one.
std::string field_named_by(const std::string& reason) {
  for (const char* name : {"prompt", "max_tokens", "stop", "temperature", "top_p", "seed"}) {
    const std::string_view n(name);
    if (reason.compare(0, n.size(), n) == 0 &&
        (reason.size() == n.size() || reason[n.size()] == ':' || reason[n.size()] == ' ')) {
      return std::string(n);
    }
  }
  return {};
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, State& state) : stream_(std::move(socket)), state_(state) {}
  ~Session() {
    // The server went with the request still running (or the client left): nobody reads it now.
    if (call_ && call_->id != 0 && !call_->finished) state_.backend.cancel(call_->id);
  }

  void start() { read_request(); }

  // Engine events, posted to the io thread (make_events).
  void on_text(const std::shared_ptr<Call>& call, const std::string& text) {
    if (call != call_ || closed_) return;
    if (!call->stream) {
      text_ += text;
    } else if (!text.empty()) {
      queue_event(chunk_json(call->meta, text, std::nullopt, call->include_usage));
    }
  }
  void on_finish(const std::shared_ptr<Call>& call, Finish finish, const Usage& usage,
                 const std::string& error);

 private:
  enum class AfterWatch : std::uint8_t { nothing, read_request, linger };

  void read_request();
  void on_request(beast::error_code ec);
  void handle(http::request<http::string_body> req);
  void handle_completion(const std::string& body);
  Events make_events(const std::shared_ptr<Call>& call);
  void start_stream();

  // Answers.
  void send(http::status status, std::string body, const char* content_type = "application/json");
  void send_error(const ApiError& e);
  void send(std::shared_ptr<http::response<http::string_body>> res);
  void after_response(bool keep_alive);

  // The event stream's writes (chunked): queued while one is in flight.
  void queue_event(const std::string& data) { queue_chunk("data: " + data + "\n\n"); }
  void queue_chunk(const std::string& bytes);
  void finish_stream();
  void write_next();

  // Noticing a client who leaves while its completion runs.
  void watch();
  void on_watch(beast::error_code ec, std::size_t bytes);
  void then_after_watch(AfterWatch next);
  void client_left();
  void linger();
  void drop_rest();
  void close();

  beast::tcp_stream stream_;
  State& state_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  unsigned version_ = 11;
  bool keep_alive_ = true;
  // The completion in flight.
  std::shared_ptr<Call> call_;
  std::optional<Unanswered> unanswered_;
  std::string text_;  // a non-streamed completion's text so far
  // The event stream.
  bool chunked_ = true;
  bool writing_ = false;
  bool stream_done_ = false;  // its last bytes are queued
  std::string out_, queued_;
  // The pending read while a completion runs.
  bool watch_pending_ = false;
  AfterWatch after_watch_ = AfterWatch::nothing;
  bool closed_ = false;
  std::array<char, 4096> scratch_{};
};

void Session::read_request() {
  if (closed_) return;
  parser_.emplace();
  parser_->header_limit(max_header_bytes);
  parser_->body_limit(state_.settings.max_body_bytes);
  stream_.expires_after(state_.settings.io_timeout);
  http::async_read(
      stream_, buffer_, *parser_,
      [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_request(ec); });
}

void Session::on_request(beast::error_code ec) {
  if (ec == http::error::body_limit || ec == http::error::header_limit) {
    keep_alive_ = false;
    version_ = parser_->get().version();
    const bool body = ec == http::error::body_limit;
    return send_error({.status = body ? 413 : 431,
                       .message = body ? fmt::format("The body is larger than {} bytes.",
                                                     state_.settings.max_body_bytes)
                                       : std::string("The request's header is too large.")});
  }
  if (ec) return close();  // the client closed, timed out, or sent something that is not HTTP
  handle(parser_->release());
}

void Session::handle(http::request<http::string_body> req) {
  version_ = req.version();
  keep_alive_ = req.keep_alive();
  const std::string_view target = req.target();
  const std::string_view path = target.substr(0, target.find('?'));
  const auto method = req.method();
  auto wrong_method = [&](const char* allowed) {
    auto res = std::make_shared<http::response<http::string_body>>(http::status::method_not_allowed,
                                                                   version_);
    res->set(http::field::allow, allowed);
    res->set(http::field::content_type, "application/json");
    res->body() =
        error_json({.status = 405,
                    .message = fmt::format("Method {} is not allowed on {}: use {}.",
                                           std::string(req.method_string()), path, allowed)});
    send(std::move(res));
  };
  if (path == "/healthz") {
    if (method != http::verb::get) return wrong_method("GET");
    if (!state_.failure.empty())
      return send(http::status::service_unavailable, health_json("failed", state_.failure));
    if (state_.draining)
      return send(http::status::service_unavailable, health_json("draining", ""));
    return send(http::status::ok, health_json("ok", ""));
  }
  if (path == "/" || path == "/dashboard") {
    // The page itself holds nothing secret: it asks for the key and sends it on /api/serve.
    if (method != http::verb::get) return wrong_method("GET");
    return send(http::status::ok, std::string(dashboard_html()), "text/html; charset=utf-8");
  }
  if (!authorized(req, state_.settings.api_key)) {
    return send_error(
        {.status = 401,
         .message = "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
         .code = "invalid_api_key"});
  }
  if (path == "/v1/models") {
    if (method != http::verb::get) return wrong_method("GET");
    return send(http::status::ok, models_json(state_.info));
  }
  if (path == "/v1/completions") {
    if (method != http::verb::post) return wrong_method("POST");
    return handle_completion(req.body());
  }
  if (path == "/api/serve") {
    if (method != http::verb::get) return wrong_method("GET");
    return send(http::status::ok,
                state_json(state_.info, state_.backend.stats(), state_.metrics.recent(), state_.draining,
                           state_.failure));
  }
  if (path == "/metrics") {
    if (method != http::verb::get) return wrong_method("GET");
    return send(http::status::ok, state_.metrics.prometheus(state_.backend.stats()),
                "text/plain; version=0.0.4; charset=utf-8");
  }
  send_error({.status = 404,
              .message = fmt::format("Invalid URL ({} {}).", std::string(req.method_string()),
                                     std::string(path)),
              .code = "unknown_url"});
}

void Session::handle_completion(const std::string& body) {
  if (!state_.failure.empty()) {
    return send_error(
        {.status = 503, .message = "The engine failed: " + state_.failure, .type = "server_error"});
  }
  const ApiError shutting_down{
      .status = 503,
      .message = "The server is shutting down: it takes no new completions.",
      .type = "server_error",
      .code = "server_shutting_down"};
  if (state_.draining) return send_error(shutting_down);
  auto parsed = parse_completion(body, state_.backend, state_.random());
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(*e);
  CompletionParams& params = std::get<CompletionParams>(parsed);
  if (std::string reason = state_.backend.check(params.request); !reason.empty()) {
    return send_error({.status = 400, .message = reason, .param = field_named_by(reason)});
  }
  auto call = std::make_shared<Call>();
  call->meta = {.id = fmt::format("cmpl-{:016x}{:08x}", state_.id_nonce, ++state_.completions),
                .created = std::chrono::duration_cast<std::chrono::seconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count(),
                .model = state_.info.id};
  call->stream = params.stream;
  call->include_usage = params.include_usage;
  params.request.events = make_events(call);
  call->times.submitted = Clock::now();
  std::uint64_t id = 0;
  const auto admission = state_.backend.submit(std::move(params.request), id);
  if (admission == Backend::Admission::queue_full) {
    auto res = std::make_shared<http::response<http::string_body>>(http::status::too_many_requests,
                                                                   version_);
    res->set(http::field::retry_after, std::to_string(state_.settings.retry_after_s));
    res->set(http::field::content_type, "application/json");
    res->body() = error_json({.status = 429,
                              .message = "The server's queue is full: retry later.",
                              .type = "rate_limit_error",
                              .code = "rate_limit_exceeded"});
    return send(std::move(res));
  }
  if (admission == Backend::Admission::draining) return send_error(shutting_down);
  call->id = id;
  call_ = call;
  text_.clear();
  unanswered_.emplace(state_);
  if (call->stream) start_stream();
  watch();
}

Events Session::make_events(const std::shared_ptr<Call>& call) {
  // Called on the engine's thread: take the time, post the rest. The posted work holds the call
  // and a weak session: a client who left makes the events count for the metrics alone.
  std::shared_ptr<Poster> poster = state_.poster;
  State* state = &state_;  // alive while the poster is open
  std::weak_ptr<Session> session = weak_from_this();
  Events events;
  events.started = [poster, call] {
    const auto now = Clock::now();
    poster->post([call, now] {
      call->times.started = now;
      call->times.has_started = true;
    });
  };
  events.token = [poster, call, state, session](std::int32_t, const std::string& text) {
    const auto now = Clock::now();
    poster->post([call, state, session, now, text] {
      RequestTimes& t = call->times;
      if (t.tokens == 0) {
        t.first_token = now;
        state->metrics.observe_first_token(seconds_between(t.submitted, now));
      } else {
        state->metrics.observe_inter_token(seconds_between(t.last_token, now));
      }
      t.last_token = now;
      ++t.tokens;
      if (auto s = session.lock()) s->on_text(call, text);
    });
  };
  events.finish = [poster, call, state, session](Finish finish, Usage usage,
                                                 const std::string& error) {
    const auto now = Clock::now();
    poster->post([call, state, session, now, finish, usage, error] {
      call->finished = true;
      state->metrics.record_finish(call->times, finish, usage, now);
      if (auto s = session.lock()) s->on_finish(call, finish, usage, error);
    });
  };
  return events;
}

void Session::on_finish(const std::shared_ptr<Call>& call, Finish finish, const Usage& usage,
                        const std::string& error) {
  if (call != call_ || closed_) return;
  const bool ok = finish == Finish::stop || finish == Finish::length;
  const ApiError failed{.status = 503,
                        .message = finish == Finish::failed
                                       ? "The engine failed: " + error
                                       : std::string("The request was cancelled."),
                        .type = "server_error"};
  if (!call->stream) {
    if (!ok) return send_error(failed);
    return send(http::status::ok, completion_json(call->meta, text_, finish, usage));
  }
  if (ok) {
    queue_event(chunk_json(call->meta, "", finish, call->include_usage));
    if (call->include_usage) queue_event(usage_chunk_json(call->meta, usage));
    queue_chunk("data: [DONE]\n\n");
  } else {
    // Mid-stream the status is sent: the error goes as an event, and the connection closes.
    queue_event(error_json(failed));
    keep_alive_ = false;
  }
  finish_stream();
}

void Session::start_stream() {
  chunked_ = version_ >= 11;
  if (!chunked_) keep_alive_ = false;  // HTTP/1.0: the body ends when the connection does
  std::string head = fmt::format(
      "HTTP/{}.{} 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
      "X-Accel-Buffering: no\r\nConnection: {}\r\n{}\r\n",
      version_ / 10, version_ % 10, keep_alive_ ? "keep-alive" : "close",
      chunked_ ? "Transfer-Encoding: chunked\r\n" : "");
  stream_done_ = false;
  queued_ = std::move(head);
  write_next();
}

void Session::queue_chunk(const std::string& bytes) {
  if (bytes.empty()) return;
  if (chunked_) {
    fmt::format_to(std::back_inserter(queued_), "{:x}\r\n{}\r\n", bytes.size(), bytes);
  } else {
    queued_ += bytes;
  }
  if (!writing_) write_next();
}

void Session::finish_stream() {
  if (chunked_) queued_ += "0\r\n\r\n";
  stream_done_ = true;
  if (!writing_) write_next();
}

void Session::write_next() {
  if (closed_) return;
  if (queued_.empty()) {
    if (stream_done_) {
      stream_done_ = false;
      after_response(keep_alive_);
    }
    return;
  }
  writing_ = true;
  out_.swap(queued_);
  queued_.clear();
  stream_.expires_after(state_.settings.io_timeout);  // a client that stops reading is dropped
  net::async_write(stream_, net::buffer(out_),
                   [self = shared_from_this()](beast::error_code ec, std::size_t) {
                     self->writing_ = false;
                     if (ec) return self->client_left();
                     self->write_next();
                   });
}

void Session::send(http::status status, std::string body, const char* content_type) {
  auto res = std::make_shared<http::response<http::string_body>>(status, version_);
  res->set(http::field::content_type, content_type);
  res->body() = std::move(body);
  send(std::move(res));
}

void Session::send_error(const ApiError& e) {
  send(static_cast<http::status>(e.status), error_json(e));
}

void Session::send(std::shared_ptr<http::response<http::string_body>> res) {
  if (closed_) return;
  res->set(http::field::server, "baton-serve");
  res->set(http::field::cache_control, "no-store");
  res->keep_alive(keep_alive_);
  res->prepare_payload();
  stream_.expires_after(state_.settings.io_timeout);
  http::async_write(stream_, *res,
                    [self = shared_from_this(), res](beast::error_code ec, std::size_t) {
                      if (ec) return self->client_left();
                      self->after_response(res->keep_alive());
                    });
}

void Session::after_response(bool keep_alive) {
  call_.reset();
  unanswered_.reset();  // may end run(): the last answer of a drain is out
  if (closed_) return;
  then_after_watch(keep_alive ? AfterWatch::read_request : AfterWatch::linger);
}

void Session::watch() {
  if (watch_pending_ || closed_ || buffer_.size() >= max_read_ahead_bytes) return;
  watch_pending_ = true;
  stream_.socket().async_read_some(
      buffer_.prepare(scratch_.size()),
      [self = shared_from_this()](beast::error_code ec, std::size_t bytes) {
        self->on_watch(ec, bytes);
      });
}

void Session::on_watch(beast::error_code ec, std::size_t bytes) {
  watch_pending_ = false;
  if (!ec) buffer_.commit(bytes);  // a request sent ahead: kept for the next read
  if (ec && ec != net::error::operation_aborted) return client_left();
  if (closed_) return;
  switch (std::exchange(after_watch_, AfterWatch::nothing)) {
    case AfterWatch::read_request:
      return read_request();
    case AfterWatch::linger:
      return linger();
    case AfterWatch::nothing:
      if (call_ && !ec) watch();
      return;
  }
}

void Session::then_after_watch(AfterWatch next) {
  if (!watch_pending_) return next == AfterWatch::read_request ? read_request() : linger();
  after_watch_ = next;
  beast::error_code ignored;
  stream_.socket().cancel(ignored);  // no write is pending: this ends the watch alone
}

void Session::client_left() {
  if (closed_) return;
  if (call_ && call_->id != 0 && !call_->finished) state_.backend.cancel(call_->id);
  close();
}

/// Closes after a last answer as HTTP servers do (RFC 9112 section 9.6): stop sending, then read
/// and drop what the client still sends for a moment, so that the answer is not lost to a reset.
void Session::linger() {
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  stream_.expires_after(linger_for);
  drop_rest();
}

void Session::drop_rest() {
  stream_.async_read_some(net::buffer(scratch_),
                          [self = shared_from_this()](beast::error_code ec, std::size_t) {
                            if (ec) return self->close();
                            self->drop_rest();
                          });
}

void Session::close() {
  if (closed_) return;
  closed_ = true;
  call_.reset();
  unanswered_.reset();
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream_.close();
}

// Asio gives SIGTERM and SIGINT their default action back when the last signal_set that holds
// them goes (its signal_set_service counts the registrations). When the server goes, the process
// is still ending (baton-serve tells the other ranks to stop), and a second SIGTERM is often on
// its way: Slurm's scancel signals every process of a task and baton-launch forwards the signal
// too, moments apart. The default action would kill the process there, and the job would fail.
// A set that lives as long as the process and is never waited on keeps them caught: a signal
// that reaches only it does nothing.
void keep_signals_caught() {
  static net::io_context* const io = new net::io_context(1);
  static net::signal_set* const held = new net::signal_set(*io, SIGTERM, SIGINT);
  (void)held;
}

}  // namespace

struct HttpServer::Impl {
  // Member order is teardown order: the io_context (and the sessions its handlers hold) goes
  // before the state they point to.
  State state;
  net::io_context io{1};
  tcp::acceptor acceptor{io};
  net::steady_timer failure_poll{io};
  std::optional<net::signal_set> signals;
  std::thread drain_thread;
  Clock::time_point first_signal;  // the signal that began the drain
  std::uint16_t port = 0;

  Impl(Backend& backend, ServerSettings settings) : state(backend, std::move(settings)) {
    state.poster = std::make_shared<Poster>(io.get_executor());
  }

  void listen();
  void accept();
  void watch_signals();
  void poll_failure();
  void begin_drain();
  void stop_now();
};

void HttpServer::Impl::listen() {
  const ServerSettings& s = state.settings;
  const std::string where = fmt::format("{}:{}", s.host, s.port);
  beast::error_code ec;
  tcp::endpoint endpoint;
  const auto address = net::ip::make_address(s.host, ec);
  if (!ec) {
    endpoint = tcp::endpoint(address, s.port);
  } else {
    tcp::resolver resolver(io);
    auto results = resolver.resolve(s.host, std::to_string(s.port), ec);
    if (ec || results.empty())
      throw std::runtime_error(fmt::format("cannot serve on {}: {}", where, ec.message()));
    endpoint = results.begin()->endpoint();
  }
  auto check = [&](const char* what) {
    if (ec)
      throw std::runtime_error(
          fmt::format("cannot serve on {}: {}: {}", where, what, ec.message()));
  };
  acceptor.open(endpoint.protocol(), ec);
  check("open");
  acceptor.set_option(net::socket_base::reuse_address(true), ec);
  check("SO_REUSEADDR");
  acceptor.bind(endpoint, ec);
  check("bind");
  acceptor.listen(net::socket_base::max_listen_connections, ec);
  check("listen");
  port = acceptor.local_endpoint().port();
}

void HttpServer::Impl::accept() {
  acceptor.async_accept(io, [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted) return;
    if (!ec) std::make_shared<Session>(std::move(socket), state)->start();
    accept();
  });
}

void HttpServer::Impl::watch_signals() {
  signals->async_wait([this](beast::error_code ec, int signal) {
    if (ec) return;
    if (state.draining) {
      // A scheduler that signals every process of a task (Slurm's scancel) and the launcher that
      // forwards the signal to its ranks deliver it twice within moments: that is one request.
      if (Clock::now() - first_signal < std::chrono::seconds(2)) {
        state.log(fmt::format("signal {} again within 2 s of the first: taken as the same request (still draining)",
                              signal));
        return watch_signals();
      }
      state.log(fmt::format("signal {} again: stopping now", signal));
      return stop_now();
    }
    first_signal = Clock::now();
    state.log(fmt::format("signal {}: draining (again, 2 s or more later, to stop now)", signal));
    begin_drain();
    watch_signals();
  });
}

void HttpServer::Impl::poll_failure() {
  failure_poll.expires_after(failure_poll_every);
  failure_poll.async_wait([this](beast::error_code ec) {
    if (ec) return;
    if (state.failure.empty()) {
      state.failure = state.backend.failure();
      if (!state.failure.empty()) {
        state.log("the engine failed: " + state.failure +
                  "; stopping once its requests are answered");
        state.ending = true;
        state.maybe_end();
      }
    }
    poll_failure();
  });
}

void HttpServer::Impl::begin_drain() {
  if (state.draining) return;
  state.draining = true;
  const auto deadline = Clock::now() + state.settings.drain_timeout;
  state.log(fmt::format("draining: no new completions; the running ones have {} s",
                        state.settings.drain_timeout.count()));
  // Backend::drain blocks until the engine is empty: on a thread of its own, never the io thread.
  drain_thread = std::thread([this, deadline, poster = state.poster] {
    state.backend.drain(deadline);
    poster->post([this] {
      state.log("drained: stopping once the last answers are sent");
      state.ending = true;
      state.maybe_end();
    });
  });
}

void HttpServer::Impl::stop_now() {
  beast::error_code ignored;
  acceptor.close(ignored);
  failure_poll.cancel();
  if (signals) signals->cancel(ignored);
  io.stop();
}

HttpServer::HttpServer(Backend& backend, ServerSettings settings) {
  if (settings.api_key.empty()) {
    throw std::invalid_argument(
        "baton-serve needs an API key (ServerSettings::api_key): see random_api_key()");
  }
  impl_ = std::make_unique<Impl>(backend, std::move(settings));
  Impl& s = *impl_;
  s.listen();
  s.state.stop_now = [&s] { s.stop_now(); };
  s.accept();
  s.poll_failure();
  if (s.state.settings.handle_signals) {
    keep_signals_caught();
    s.signals.emplace(s.io, SIGTERM, SIGINT);
    s.watch_signals();
  }
  s.state.log(fmt::format("serving '{}' on http://{}:{}/v1", s.state.info.id, s.state.settings.host, s.port));
}

HttpServer::~HttpServer() {
  impl_->state.poster->close();
  impl_->state.stop_now = nullptr;  // sessions that go with the io_context must not stop it again
  impl_->io.stop();
  if (impl_->drain_thread.joinable()) impl_->drain_thread.join();
}

std::uint16_t HttpServer::port() const {
  return impl_->port;
}

void HttpServer::run() {
  for (;;) {
    try {
      impl_->io.run();
      return;
    } catch (const std::exception& e) {
      // A handler threw (out of memory, a backend's bug): that connection is lost, not the server.
      impl_->state.log(std::string("a request's handler threw: ") + e.what());
    }
  }
}

void HttpServer::stop() {
  impl_->io.stop();
}

void HttpServer::begin_drain() {
  net::post(impl_->io, [impl = impl_.get()] { impl->begin_drain(); });
}

const Metrics& HttpServer::metrics() const {
  return impl_->state.metrics;
}

std::string check_api_key(const std::string& key) {
  constexpr std::size_t min_key_chars = 16;
  if (key.size() < min_key_chars) {
    return fmt::format("the API key has {} characters: use at least {} (random_api_key makes one)",
                       key.size(), min_key_chars);
  }
  // Shorter ids would match most keys by chance (any 32 hex characters contain some 3 digits).
  constexpr std::size_t min_id_chars = 4;
  for (const char* variable :
       {"SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "BATON_JOB_TOKEN"}) {
    const char* value = std::getenv(variable);
    if (value == nullptr || std::string_view(value).size() < min_id_chars) continue;
    if (key.find(value) != std::string::npos) {
      return fmt::format(
          "the API key contains ${} ({}), which others on the cluster can read: use a random key",
          variable, value);
    }
  }
  return "";
}

std::string random_api_key() {
  std::random_device device;  // getrandom(2) on Linux
  for (;;) {
    std::string key;
    for (int i = 0; i < 4; ++i) key += fmt::format("{:08x}", static_cast<std::uint32_t>(device()));
    if (check_api_key(key).empty()) return key;  // a job id among its digits by chance: draw again
  }
}

}  // namespace baton::serve
