// The dashboard's HTTP server: Boost.Beast on one thread of its own, GET only, read-only.
// Each connection reads one request at a time (keep-alive); /api/events turns its connection
// into a server-sent event stream that a timer feeds.
#include "baton/observe/dashboard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <charconv>
#include <memory>
#include <optional>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "assets.h"
#include "baton/observe/job_model.h"

namespace baton::observe {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

/// Request headers beyond this are refused (431); the dashboard's requests are tiny.
constexpr std::size_t max_header_bytes = 8 * 1024;
/// The body of a refused request (POST, PUT, ...) read before the 405; a longer one gets 413.
constexpr std::uint64_t max_refused_body_bytes = 64 * 1024;
/// A connection that sends nothing for this long is closed (event streams excepted).
constexpr auto idle_timeout = std::chrono::seconds(60);
/// An event stream with nothing new still sends a comment this often, so that proxies and
/// the browser know it is alive.
constexpr auto keepalive_every = std::chrono::seconds(10);

std::string_view path_of(std::string_view target) { return target.substr(0, target.find('?')); }

/// The value of `key` in the target's query string, if there.
std::optional<std::string_view> query_value(std::string_view target, std::string_view key) {
  const auto q = target.find('?');
  if (q == std::string_view::npos) return std::nullopt;
  std::string_view rest = target.substr(q + 1);
  while (!rest.empty()) {
    const auto amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    const auto eq = pair.find('=');
    if (pair.substr(0, eq) == key) return eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
    if (amp == std::string_view::npos) break;
    rest = rest.substr(amp + 1);
  }
  return std::nullopt;
}

std::string this_host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

struct Shared {
  JobModel& model;
  DashboardSettings settings;
  std::atomic<std::uint64_t> requests{0};
  std::atomic<std::size_t> connections{0};
  std::atomic<std::size_t> streams{0};
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Shared& shared) : stream_(std::move(socket)), timer_(stream_.get_executor()), shared_(shared) {
    shared_.connections.fetch_add(1);
  }
  ~Session() {
    shared_.connections.fetch_sub(1);
    if (streaming_) shared_.streams.fetch_sub(1);
  }

  void start() { read(); }

 private:
  void read() {
    parser_.emplace();
    parser_->header_limit(max_header_bytes);
    // Read-only: a request has no body. A small one is read and refused; a big one refused at once.
    parser_->body_limit(max_refused_body_bytes);
    stream_.expires_after(idle_timeout);
    // The header first: a request with a body is answered without reading the body.
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec == http::error::header_limit) return fail_and_close(http::status::request_header_fields_too_large);
    if (ec == http::error::body_limit) return fail_and_close(http::status::payload_too_large);
    if (ec) return close();
    shared_.requests.fetch_add(1);
    const auto method = parser_->get().method();
    if (method != http::verb::get && method != http::verb::head) {
      // Read a small body before saying no: closing with unread data would reset the
      // connection, and the client might never see the answer.
      if (parser_->is_done()) return refuse_method();
      return http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code body_ec, std::size_t) {
        if (body_ec == http::error::body_limit) return self->fail_and_close(http::status::payload_too_large);
        if (body_ec) return self->close();
        self->refuse_method();
      });
    }
    if (!parser_->is_done()) {
      return http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code body_ec, std::size_t) {
        if (body_ec && body_ec != http::error::body_limit) return self->close();
        self->fail_and_close(http::status::payload_too_large);
      });
    }
    handle(parser_->get());
  }

  void refuse_method() {
    auto res = text(http::status::method_not_allowed, "the dashboard is read-only: GET only\n", parser_->get());
    res->set(http::field::allow, "GET, HEAD");
    res->keep_alive(false);
    res->prepare_payload();
    send(std::move(res));
  }

  void fail_and_close(http::status status) {
    auto res = std::make_shared<http::response<http::string_body>>(status, 11);
    res->set(http::field::content_type, "text/plain; charset=utf-8");
    res->body() = fmt::format("{}\n", http::obsolete_reason(status));
    res->keep_alive(false);
    res->prepare_payload();
    send(std::move(res));
  }

  void handle(const http::request<http::string_body>& req) {
    const bool head = req.method() == http::verb::head;
    const std::string_view target = req.target();
    const std::string_view path = path_of(target);
    JobModel& model = shared_.model;
    if (path == "/api/events") return start_events(req);
    std::shared_ptr<http::response<http::string_body>> res;
    if (path == "/api/state") {
      res = json(model.state_json(), req);
    } else if (path == "/api/plan") {
      res = json(model.plan_json(), req);
    } else if (path == "/api/history") {
      std::size_t points = 600;
      if (auto v = query_value(target, "points")) {
        std::size_t n = 0;
        auto [p, e] = std::from_chars(v->data(), v->data() + v->size(), n);
        if (e == std::errc() && p == v->data() + v->size() && n > 0) points = std::min<std::size_t>(n, 100'000);
      }
      res = json(model.history_json(points), req);
    } else if (path == "/api/timeline") {
      res = json(model.timeline_json(), req);
    } else if (path == "/api/trace") {
      return record_trace(req);
    } else if (path == "/metrics") {
      res = text(http::status::ok, model.prometheus(), req);
      res->set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
    } else if (const detail::Asset* asset = detail::find_asset(path == "/" ? "/index.html" : path)) {
      res = std::make_shared<http::response<http::string_body>>(http::status::ok, req.version());
      res->set(http::field::content_type, asset->type);
      res->body().assign(asset->body);
    } else {
      res = text(http::status::not_found, fmt::format("no such page: {}\n", path), req);
    }
    res->keep_alive(req.keep_alive());
    res->prepare_payload();
    if (head) res->body().clear();  // HEAD: the headers (Content-Length included), no body
    send(std::move(res));
  }

  /// /api/trace?seconds=N: the provider records for N seconds on its own threads; the answer
  /// goes out on this connection's executor when it calls back (the server thread never waits).
  void record_trace(const http::request<http::string_body>& req) {
    const bool keep = req.keep_alive();
    const unsigned version = req.version();
    auto answer = [self = shared_from_this(), keep, version](http::status status, std::string body, bool download) {
      auto res = std::make_shared<http::response<http::string_body>>(status, version);
      res->set(http::field::content_type, download ? "application/json" : "text/plain; charset=utf-8");
      res->set(http::field::cache_control, "no-store");
      if (download) res->set(http::field::content_disposition, "attachment; filename=\"baton-trace.json\"");
      res->body() = std::move(body);
      res->keep_alive(keep);
      res->prepare_payload();
      self->send(std::move(res));
    };
    if (!shared_.settings.trace) {
      return answer(http::status::not_found, "this dashboard cannot record traces\n", false);
    }
    double seconds = 5;
    if (auto v = query_value(req.target(), "seconds")) {
      auto [p, e] = std::from_chars(v->data(), v->data() + v->size(), seconds);
      if (e != std::errc() || p != v->data() + v->size() || !(seconds >= 1 && seconds <= 60)) {
        return answer(http::status::bad_request,
                      fmt::format("seconds='{}': a number of seconds from 1 to 60\n", std::string(*v)), false);
      }
    }
    // Recording takes seconds: no idle timeout meanwhile.
    stream_.expires_never();
    auto executor = stream_.get_executor();
    shared_.settings.trace(seconds, [executor, answer](bool ok, std::string body) {
      net::post(executor, [answer, ok, body = std::move(body)]() mutable {
        answer(ok ? http::status::ok : http::status::service_unavailable, ok ? std::move(body) : body + "\n", ok);
      });
    });
  }

  static std::shared_ptr<http::response<http::string_body>> json(std::string body,
                                                                 const http::request<http::string_body>& req) {
    auto res = std::make_shared<http::response<http::string_body>>(http::status::ok, req.version());
    res->set(http::field::content_type, "application/json");
    res->set(http::field::cache_control, "no-store");
    res->body() = std::move(body);
    return res;
  }

  static std::shared_ptr<http::response<http::string_body>> text(http::status status, std::string body,
                                                                 const http::request<http::string_body>& req) {
    auto res = std::make_shared<http::response<http::string_body>>(status, req.version());
    res->set(http::field::content_type, "text/plain; charset=utf-8");
    res->set(http::field::cache_control, "no-store");
    res->body() = std::move(body);
    res->keep_alive(req.keep_alive());
    res->prepare_payload();
    return res;
  }

  void send(std::shared_ptr<http::response<http::string_body>> res) {
    const bool keep = res->keep_alive();
    http::async_write(stream_, *res, [self = shared_from_this(), res, keep](beast::error_code ec, std::size_t) {
      if (ec) return self->close();
      if (!keep) return self->linger();
      self->read();
    });
  }

  /// Closes after a last answer the way HTTP servers do (RFC 9112 section 9.6): stop sending,
  /// then read and drop what the client still sends for a moment. Closing with unread data
  /// would reset the connection, and the client might lose the answer it has not read yet.
  void linger() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.expires_after(std::chrono::seconds(2));
    drain();
  }

  void drain() {
    stream_.async_read_some(net::buffer(scratch_), [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec) return self->close();
      self->drain();
    });
  }

  // --- server-sent events -------------------------------------------------------------------

  void start_events(const http::request<http::string_body>& req) {
    if (shared_.streams.load() >= shared_.settings.max_event_streams) {
      return send(text(http::status::service_unavailable, "too many event streams\n", req));
    }
    shared_.streams.fetch_add(1);
    streaming_ = true;
    stream_.expires_never();
    out_ = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
           "Connection: keep-alive\r\nX-Accel-Buffering: no\r\n\r\n";
    out_ += "retry: 2000\n\n";
    write_out();
  }

  void write_out() {
    net::async_write(stream_.socket(), net::buffer(out_), [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec) return self->close();
      self->wait_for_news();
    });
    // While an event is written, the client may close: the read below notices.
    if (!reading_eof_) {
      reading_eof_ = true;
      stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this()](beast::error_code ec) {
        // Clients send nothing on an event stream: readable means closed (or garbage): end it.
        if (!ec) self->close();
      });
    }
  }

  void wait_for_news() {
    timer_.expires_after(shared_.settings.push_interval);
    timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (ec || self->closed_) return;
      self->push();
    });
  }

  void push() {
    const std::uint64_t v = shared_.model.version();
    const auto now = std::chrono::steady_clock::now();
    if (v != sent_version_) {
      sent_version_ = v;
      last_write_ = now;
      out_ = fmt::format("event: state\nid: {}\ndata: {}\n\n", v, shared_.model.state_json());
      return write_out();
    }
    if (now - last_write_ >= keepalive_every) {
      last_write_ = now;
      out_ = ": keep-alive\n\n";
      return write_out();
    }
    wait_for_news();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ec;
    timer_.cancel();
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
  }

  beast::tcp_stream stream_;
  net::steady_timer timer_;
  Shared& shared_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool streaming_ = false;
  bool reading_eof_ = false;
  bool closed_ = false;
  std::string out_;
  std::array<char, 4096> scratch_{};
  std::uint64_t sent_version_ = ~std::uint64_t{0};
  std::chrono::steady_clock::time_point last_write_{};
};

}  // namespace

std::pair<std::string, std::uint16_t> parse_listen(const std::string& text) {
  std::string host = "127.0.0.1";
  std::string port_text = text;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      throw DashboardError(fmt::format("--dashboard '{}': expected [IPv6]:PORT", text));
    }
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else if (const auto colon = text.rfind(':'); colon != std::string::npos) {
    if (text.find(':') != colon) {
      throw DashboardError(fmt::format("--dashboard '{}': write an IPv6 address in brackets, [::1]:PORT", text));
    }
    if (colon > 0) host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  unsigned port = 0;
  auto [p, e] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (port_text.empty() || e != std::errc() || p != port_text.data() + port_text.size() || port > 65535) {
    throw DashboardError(fmt::format("--dashboard '{}': expected HOST:PORT, :PORT or PORT with a port from 0 to "
                                     "65535 (0: any free port)",
                                     text));
  }
  return {host, static_cast<std::uint16_t>(port)};
}

struct DashboardServer::Impl {
  Shared shared;
  std::string host;
  std::uint16_t port = 0;
  net::io_context io{1};
  tcp::acceptor acceptor{io};
  std::thread thread;

  Impl(JobModel& model, DashboardSettings settings) : shared{model, std::move(settings)} {}

  void accept() {
    acceptor.async_accept(net::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted) return;
      if (!ec) {
        if (shared.connections.load() >= shared.settings.max_connections) {
          beast::error_code ignored;
          socket.close(ignored);
        } else {
          std::make_shared<Session>(std::move(socket), shared)->start();
        }
      }
      accept();
    });
  }
};

DashboardServer::DashboardServer(JobModel& model, DashboardSettings settings)
    : impl_(std::make_unique<Impl>(model, std::move(settings))) {
  Impl& s = *impl_;
  auto [host, port] = parse_listen(s.shared.settings.listen);
  s.host = host;
  const std::string where = host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port)
                                                                 : fmt::format("{}:{}", host, port);
  beast::error_code ec;
  tcp::endpoint endpoint;
  const auto address = net::ip::make_address(host, ec);
  if (!ec) {
    endpoint = tcp::endpoint(address, port);
  } else {
    tcp::resolver resolver(s.io);
    auto results = resolver.resolve(host, std::to_string(port), ec);
    if (ec || results.empty()) {
      throw DashboardError(fmt::format("cannot serve the dashboard on {}: no such host: {}", where, ec.message()));
    }
    endpoint = results.begin()->endpoint();
  }
  auto check = [&](const char* what) {
    if (ec) throw DashboardError(fmt::format("cannot serve the dashboard on {}: {}: {}", where, what, ec.message()));
  };
  s.acceptor.open(endpoint.protocol(), ec);
  check("open");
  s.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  check("SO_REUSEADDR");
  s.acceptor.bind(endpoint, ec);
  check("bind");
  s.acceptor.listen(net::socket_base::max_listen_connections, ec);
  check("listen");
  s.port = s.acceptor.local_endpoint().port();
  s.accept();
  s.thread = std::thread([&s] {
    // A handler that throws (out of memory) must not end the process: log nothing, go on.
    for (;;) {
      try {
        s.io.run();
        return;
      } catch (const std::exception&) {
      }
    }
  });
}

DashboardServer::~DashboardServer() {
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::uint16_t DashboardServer::port() const { return impl_->port; }

std::string DashboardServer::url() const {
  std::string host = impl_->host;
  if (host == "0.0.0.0" || host == "::") host = this_host_name();
  if (host.find(':') != std::string::npos) host = "[" + host + "]";
  return fmt::format("http://{}:{}/", host, impl_->port);
}

std::uint64_t DashboardServer::requests() const { return impl_->shared.requests.load(); }

}  // namespace baton::observe
