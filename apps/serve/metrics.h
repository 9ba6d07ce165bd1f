#pragma once
// baton-serve's Prometheus metrics: vLLM's request metrics under a `baton:` prefix, measured by the
// HTTP front end from the engine's events (backend.h), so that a dashboard or an alert written
// for vLLM reads baton-serve with the prefix changed.
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"

namespace baton::serve {

/// When one request's events came (steady clock), for the latency histograms.
struct RequestTimes {
  using Clock = std::chrono::steady_clock;
  Clock::time_point submitted;
  Clock::time_point started;      // joined the running batch (set when `has_started`)
  Clock::time_point first_token;  // set when `tokens` > 0
  Clock::time_point last_token;
  bool has_started = false;
  std::int64_t tokens = 0;
};

/// A Prometheus histogram with fixed upper bounds (`le`), plus +Inf.
struct Histogram {
  std::vector<double> bounds;         // ascending
  std::vector<std::uint64_t> counts;  // per bucket, not cumulative; the last is +Inf's
  double sum = 0;
  std::uint64_t count = 0;

  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
};

/// The request metrics of one served model. Thread-safe: the front end records from its io thread,
/// /metrics and a dashboard read from any thread.
///
///   Metrics m("tiny");
///   m.observe_first_token(0.02);
///   m.record_finish(times, Finish::length, usage, now);
///   std::string text = m.prometheus(backend.stats());
class Metrics {
 public:
  /// `window`: how many recent requests recent() summarises.
  explicit Metrics(std::string model_name, std::size_t window = 1024);

  /// A request's first token came `seconds` after it was submitted (TTFT).
  void observe_first_token(double seconds);
  /// A token came `seconds` after the request's previous one (ITL).
  void observe_inter_token(double seconds);
  /// A request ended at `finished`. Every finish adds its tokens to the token counters; stop and
  /// length (the successes) also add to request_success_total and the latency histograms
  /// (e2e, queue time, time per output token), and to recent()'s window.
  void record_finish(const RequestTimes& times, Finish finish, const Usage& usage,
                     RequestTimes::Clock::time_point finished);

  /// The text exposition format 0.0.4, with the engine's gauges from `engine`.
  std::string prometheus(const Stats& engine) const;

  /// Percentiles of the recent successful requests, in seconds (0 where there are no samples).
  struct Recent {
    double ttft_p50 = 0, ttft_p99 = 0;
    double tpot_p50 = 0, tpot_p99 = 0;
    std::size_t ttft_samples = 0, tpot_samples = 0;
  };
  Recent recent() const;

 private:
  void remember(std::deque<double>& window, double value);

  std::string model_name_;
  std::size_t window_;
  mutable std::mutex mutex_;
  Histogram ttft_, itl_, tpot_, e2e_, queue_;
  std::uint64_t success_stop_ = 0, success_length_ = 0;
  std::uint64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  std::deque<double> recent_ttft_, recent_tpot_;
};

}  // namespace baton::serve
