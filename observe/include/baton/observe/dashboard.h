#pragma once
/// The dashboard's HTTP server (Boost.Beast, its own thread, read-only): the page and its
/// assets (embedded in the binary: clusters are often offline), the JSON API and /metrics,
/// all read from one JobModel.
///
///   GET /                 the page (observe/ui/index.html), /app.js, /style.css
///   GET /api/plan         JobModel::plan_json
///   GET /api/state        JobModel::state_json
///   GET /api/history      JobModel::history_json (?points=N)
///   GET /api/timeline     JobModel::timeline_json
///   GET /api/events       server-sent events: "state" with the state JSON whenever it changes
///   GET /metrics          JobModel::prometheus (text/plain; version=0.0.4)
///   anything else         404; a method other than GET (or HEAD) 405; a request with a body
///                         or headers over 8 KiB 413 / 431
///
///   baton::observe::DashboardServer http(model, {.listen = "127.0.0.1:8080"});
///   fmt::print("dashboard: {}\n", http.url());
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <functional>
#include <string>
#include <utility>

namespace baton::observe {

class JobModel;

/// The dashboard cannot serve: a malformed HOST:PORT, a port in use, an address not here.
class DashboardError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// "HOST:PORT", ":PORT" or "PORT" -> {host, port}; the host defaults to 127.0.0.1 (the page is
/// for this machine unless the user names another interface). "[::1]:8080" for IPv6. Throws
/// DashboardError naming the text.
std::pair<std::string, std::uint16_t> parse_listen(const std::string& text);

/// Records `seconds` of the job's activity and then calls `done` exactly once, from any thread:
/// ok and the Chrome trace JSON, or not ok and why (one recording at a time, nobody answered).
using TraceProvider =
    std::function<void(double seconds, std::function<void(bool ok, std::string body)> done)>;

struct DashboardSettings {
  /// Where to listen, as parse_listen reads it. Port 0: a free one (see port()).
  std::string listen = "127.0.0.1:0";
  /// How often an open event stream looks for a new state to push.
  std::chrono::milliseconds push_interval{250};
  /// Event streams open at once; more get 503.
  std::size_t max_event_streams = 64;
  /// Connections open at once (a browser opens a few); more are closed at once.
  std::size_t max_connections = 256;
  /// GET /api/trace?seconds=N (the page's "record" button): a Chrome trace of the next N
  /// seconds (1 to 60), as a download. Unset: 404.
  TraceProvider trace;
};

class DashboardServer {
 public:
  /// Binds and starts serving on its own thread. Throws DashboardError naming the address.
  DashboardServer(JobModel& model, DashboardSettings settings = {});
  /// Stops the thread and closes every connection; never throws.
  ~DashboardServer();
  DashboardServer(const DashboardServer&) = delete;
  DashboardServer& operator=(const DashboardServer&) = delete;

  std::uint16_t port() const;
  /// http://HOST:PORT/ (this machine's name when bound to every interface).
  std::string url() const;
  /// Requests answered so far.
  std::uint64_t requests() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::observe
