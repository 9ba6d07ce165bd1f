#include "metrics.h"

#include <algorithm>

#include <fmt/format.h>

namespace baton::serve {

namespace {

// vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles read
// the same here.
const std::vector<double> ttft_buckets = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                          0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                          20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const std::vector<double> per_token_buckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                               0.3,  0.4,   0.5,  0.75,  1.0, 2.5,  5.0,
                                               7.5,  10.0,  20.0, 40.0,  80.0};
const std::vector<double> request_latency_buckets = {
    0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

double seconds_between(RequestTimes::Clock::time_point from, RequestTimes::Clock::time_point to) {
  return std::max(0.0, std::chrono::duration<double>(to - from).count());
}

/// The `q` quantile (0..1) of `values` by the nearest-rank method.
double quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  const auto rank = static_cast<std::size_t>(q * static_cast<double>(values.size() - 1) + 0.5);
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(rank),
                   values.end());
  return values[rank];
}

/// A label value escaped as the text format asks (backslash, quote, line feed).
std::string escape_label(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void family(std::string& out, const char* name, const char* type, const char* help) {
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void write_histogram(std::string& out, const char* name, const char* help, const Histogram& h,
                     const std::string& labels) {
  family(out, name, "histogram", help);
  std::uint64_t cumulative = 0;
  for (std::size_t i = 0; i < h.bounds.size(); ++i) {
    cumulative += h.counts[i];
    fmt::format_to(std::back_inserter(out), "{}_bucket{{{},le=\"{}\"}} {}\n", name, labels,
                   h.bounds[i], cumulative);
  }
  cumulative += h.counts.back();
  fmt::format_to(std::back_inserter(out), "{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels,
                 cumulative);
  fmt::format_to(std::back_inserter(out), "{}_sum{{{}}} {}\n{}_count{{{}}} {}\n", name, labels,
                 h.sum, name, labels, h.count);
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds(std::move(upper_bounds)), counts(bounds.size() + 1, 0) {}

void Histogram::observe(double value) {
  const auto at =
      std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin();  // le: value <= bound
  ++counts[static_cast<std::size_t>(at)];
  sum += value;
  ++count;
}

Metrics::Metrics(std::string model_name, std::size_t window)
    : model_name_(std::move(model_name)),
      window_(std::max<std::size_t>(window, 1)),
      ttft_(ttft_buckets),
      itl_(per_token_buckets),
      tpot_(per_token_buckets),
      e2e_(request_latency_buckets),
      queue_(request_latency_buckets) {}

void Metrics::observe_first_token(double seconds) {
  std::lock_guard lock(mutex_);
  ttft_.observe(seconds);
}

void Metrics::observe_inter_token(double seconds) {
  std::lock_guard lock(mutex_);
  itl_.observe(seconds);
}

void Metrics::remember(std::deque<double>& window, double value) {
  window.push_back(value);
  while (window.size() > window_) window.pop_front();
}

void Metrics::record_finish(const RequestTimes& times, Finish finish, const Usage& usage,
                            RequestTimes::Clock::time_point finished) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += static_cast<std::uint64_t>(std::max<std::int64_t>(usage.prompt_tokens, 0));
  generation_tokens_ +=
      static_cast<std::uint64_t>(std::max<std::int64_t>(usage.completion_tokens, 0));
  if (finish != Finish::stop && finish != Finish::length) return;
  ++(finish == Finish::stop ? success_stop_ : success_length_);
  const double e2e = seconds_between(times.submitted, finished);
  e2e_.observe(e2e);
  if (times.has_started) queue_.observe(seconds_between(times.submitted, times.started));
  if (times.tokens > 0) {
    const double ttft = seconds_between(times.submitted, times.first_token);
    remember(recent_ttft_, ttft);
    if (times.tokens > 1) {
      // vLLM's request_time_per_output_token: the decode time spread over the tokens after the
      // first.
      const double tpot = std::max(0.0, e2e - ttft) / static_cast<double>(times.tokens - 1);
      tpot_.observe(tpot);
      remember(recent_tpot_, tpot);
    }
  }
}

std::string Metrics::prometheus(const Stats& engine) const {
  const std::string labels = fmt::format("model_name=\"{}\"", escape_label(model_name_));
  std::string out;
  std::lock_guard lock(mutex_);
  family(out, "baton:num_requests_running", "gauge", "Number of requests in the running batch.");
  fmt::format_to(std::back_inserter(out), "baton:num_requests_running{{{}}} {}\n", labels,
                 engine.running);
  family(out, "baton:num_requests_waiting", "gauge", "Number of requests waiting to be processed.");
  fmt::format_to(std::back_inserter(out), "baton:num_requests_waiting{{{}}} {}\n", labels,
                 engine.waiting);
  family(out, "baton:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.");
  fmt::format_to(std::back_inserter(out), "baton:kv_cache_usage_perc{{{}}} {}\n", labels,
                 engine.kv_cache_usage);
  family(out, "baton:prompt_tokens_total", "counter", "Number of prefill tokens processed.");
  fmt::format_to(std::back_inserter(out), "baton:prompt_tokens_total{{{}}} {}\n", labels,
                 prompt_tokens_);
  family(out, "baton:generation_tokens_total", "counter", "Number of generation tokens processed.");
  fmt::format_to(std::back_inserter(out), "baton:generation_tokens_total{{{}}} {}\n", labels,
                 generation_tokens_);
  family(out, "baton:request_success_total", "counter",
         "Count of successfully processed requests.");
  fmt::format_to(std::back_inserter(out),
                 "baton:request_success_total{{{},finished_reason=\"stop\"}} {}\n", labels,
                 success_stop_);
  fmt::format_to(std::back_inserter(out),
                 "baton:request_success_total{{{},finished_reason=\"length\"}} {}\n", labels,
                 success_length_);
  write_histogram(out, "baton:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", ttft_, labels);
  write_histogram(out, "baton:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds.", itl_, labels);
  write_histogram(out, "baton:request_time_per_output_token_seconds",
                  "Histogram of time_per_output_token_seconds per request.", tpot_, labels);
  write_histogram(out, "baton:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", e2e_, labels);
  write_histogram(out, "baton:request_queue_time_seconds",
                  "Histogram of time spent in WAITING phase for request.", queue_, labels);
  return out;
}

Metrics::Recent Metrics::recent() const {
  std::vector<double> ttft, tpot;
  {
    std::lock_guard lock(mutex_);
    ttft.assign(recent_ttft_.begin(), recent_ttft_.end());
    tpot.assign(recent_tpot_.begin(), recent_tpot_.end());
  }
  Recent r;
  r.ttft_samples = ttft.size();
  r.tpot_samples = tpot.size();
  r.ttft_p50 = quantile(ttft, 0.5);
  r.ttft_p99 = quantile(ttft, 0.99);
  r.tpot_p50 = quantile(tpot, 0.5);
  r.tpot_p99 = quantile(tpot, 0.99);
  return r;
}

}  // namespace baton::serve
