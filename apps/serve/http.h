#pragma once
// baton-serve's HTTP front end: OpenAI's completions API (non-streamed and server-sent events),
// /v1/models, /healthz and Prometheus /metrics over Boost.Beast, in front of a Backend
// (backend.h). One io_context on the thread that calls run(); the engine's events are posted to
// it, so the engine's thread never waits on a socket.
//
//   HttpServer server(engine, {.port = 8000, .api_key = key, .handle_signals = true});
//   server.run();  // until stop(), or SIGTERM / SIGINT's drain completes
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "backend.h"
#include "metrics.h"

namespace baton::serve {

struct ServerSettings {
  std::string host = "127.0.0.1";
  std::uint16_t port = 8000;  // 0: any free port (port() says which)
  /// What `Authorization: Bearer ...` must carry on every route but /healthz. Required: the
  /// constructor refuses an empty one (see check_api_key, random_api_key).
  std::string api_key;
  std::size_t max_body_bytes = std::size_t{1} << 20;  // a longer body is answered 413
  /// How long a drain lets running requests finish before the engine cancels them.
  std::chrono::seconds drain_timeout{600};
  int retry_after_s = 1;  // the Retry-After of a 429 (the engine's queue is full)
  /// SIGTERM and SIGINT begin a drain (a second one, 2 s or more later, stops at once). From then
  /// on, for the life of the process, they stay caught: once the server is gone they do nothing,
  /// so a second signal that arrives while the process ends cannot kill it (a scheduler and a
  /// launcher that both deliver one); the caller ends the process in its own time.
  bool handle_signals = false;
  /// A client has this long to send a request's header and body, and to take each write.
  std::chrono::seconds io_timeout{30};
  /// Where the server says what it does (listening, draining, the engine failed); may be empty.
  std::function<void(const std::string&)> log;
};

class HttpServer {
 public:
  /// Binds the port (throws std::runtime_error saying why it cannot), and std::invalid_argument
  /// for an empty api_key. `backend` must outlive the server.
  HttpServer(Backend& backend, ServerSettings settings);
  /// Stops serving and waits for a drain thread that began (Backend::drain returns by its
  /// deadline).
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  std::uint16_t port() const;

  /// Serves on the calling thread until stop(), until a drain completes (every running request
  /// answered), or until the backend fails for good and its requests are answered. Call once.
  void run();
  /// Any thread: run() returns soon, whatever is in flight.
  void stop();
  /// Any thread: new completions get 503, /healthz 503; the running ones finish (Backend::drain on
  /// a thread of its own, up to drain_timeout) and are answered; then run() returns.
  void begin_drain();

  const Metrics& metrics() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Why `key` should not be an API key, or "" if it will do: shorter than 16 characters, or it
/// contains a scheduler's job id (SLURM_JOB_ID, SLURM_JOBID, PBS_JOBID, LSB_JOBID, JOB_ID,
/// BATON_JOB_TOKEN, where set), which whoever shares the cluster can read. Ids shorter than 4
/// characters are not looked for: any key contains one by chance.
std::string check_api_key(const std::string& key);

/// 32 hex characters from the system's random source, which check_api_key accepts.
std::string random_api_key();

}  // namespace baton::serve
