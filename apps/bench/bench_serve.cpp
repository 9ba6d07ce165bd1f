// baton-bench-serve: baton-serve (apps/serve/) under load, against a PyTorch decode loop on the
// same weights, measured in the same run (scripts/run.sh bench serve; docs/serving.md).
//
// The model: a GPT-2 (vocabulary 2048, d_model 256, 4 heads, 4 layers, 512 positions, f32) with
// random weights that apps/bench/serve_torch.py writes to a safetensors file in transformers'
// names. The workload: a list of requests drawn from a seeded generator (the same list for every
// system): token-id prompts (no tokenizer) of uniform 16..128 tokens, and mixed output lengths,
// 70% short (uniform 16..64 tokens) and 30% long (uniform 128..256), greedy (temperature 0), no
// stop strings (with no tokenizer there is no end-of-text token: every request runs to its
// max_tokens). A load point takes the first N requests of the list:
//   closed_c{C}     closed loop, C clients (1, 4, 16, 64), each sending its next request when its
//                   last one ends;
//   poisson_{F}x    open loop, Poisson arrivals (as vLLM's `bench serve --request-rate`) at F
//                   times the capacity (the requests/s of the first system measured, at its best
//                   closed-loop point), F = 0.25, 0.5, 0.75; the same arrival times for every
//                   system.
// The systems, on the same weights and the same BLAS / torch threads (--threads, default 1):
//   continuous  baton-serve --batching continuous (the default), streamed over HTTP;
//   static      baton-serve --batching static (a batch runs until its longest request ends);
//   pytorch     the peer (serve_torch.py under /usr/bin/python3, Debian's python3-torch): a
//               PyTorch eager decode loop with a KV cache and static batches of up to --max-batch
//               waiting requests, left-padded, as a user without a serving engine writes it. It is
//               driven in its own process, without HTTP (which favours it): it simulates the same
//               arrival process and times each request with perf_counter the same way.
// Both baton systems run at --max-batch requests at most (default 32), as the peer's batches.
//
// Per request: TTFT (sent -> first token event; for Poisson points from the arrival time),
// TPOT ((e2e - TTFT) / (tokens - 1)), e2e (sent -> last token event). Per point and system one
// JSON line: "value" the output tokens/s (all the point's tokens over its wall time, from its
// start to its last token), requests/s, TTFT, TPOT and e2e p50 and p99, and the peak resident
// memory of the system's process over its whole run (baton-serve's VmHWM, the peer's ru_maxrss).
// baton's lines compare (above 1: baton better): "ratio" and "vs_torch_tokens_per_s" (its
// output tokens/s over PyTorch's at the same point: the same figure, under json_line.h's shared
// name and docs/serving.md's), "tpot_p99_vs_torch" (PyTorch's p99 TPOT over baton's) and, on the
// continuous lines, "vs_static_tokens_per_s" (continuous over static). One "peak_rss_{system}"
// line per system holds its memory figure alone.
//
//   baton-bench-serve                   every point, all three systems (3 to 4 minutes on 2 cores)
//   baton-bench-serve --quick           a few requests at 3 points (a smoke run, ~20 s)
//   baton-bench-serve --only baton|torch --threads N --allow-load
//
// Without a python3 that imports torch baton's lines are printed without the comparison, then
// it exits 77 (a skip; under CI=true a failure, skip.h).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "capture.h"
#include "json_line.h"
#include "skip.h"
#include "spawn.h"

using namespace baton;

namespace {

namespace fs = std::filesystem;
using bench::Clock;

/// The served GPT-2: big enough that a decode step is real work on a CPU core, small enough that
/// the whole benchmark runs in a few minutes on two.
struct ModelShape {
  std::int64_t vocab = 2048, d_model = 256, heads = 4, layers = 4, positions = 512;
};

/// The workload's draws (docs/serving.md quotes them).
struct WorkloadSettings {
  std::uint64_t seed = 20261128;
  std::int64_t prompt_min = 16, prompt_max = 128;
  double short_share = 0.7;
  std::int64_t short_min = 16, short_max = 64, long_min = 128, long_max = 256;
};

struct Request {
  std::vector<std::int64_t> prompt;
  std::int64_t max_tokens = 0;
};

/// `n` requests from `w`'s seeded generator: the same list on every machine (mt19937_64 is fixed by
/// the standard; the draws below use its raw output, not the library's distributions).
std::vector<Request> make_requests(std::size_t n, const WorkloadSettings& w, std::int64_t vocab) {
  std::mt19937_64 rng(w.seed);
  auto uniform = [&](std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(hi - lo + 1));
  };
  std::vector<Request> out(n);
  for (Request& r : out) {
    r.prompt.resize(static_cast<std::size_t>(uniform(w.prompt_min, w.prompt_max)));
    for (auto& id : r.prompt) id = uniform(0, vocab - 1);
    const bool is_short = static_cast<double>(rng() >> 11) * 0x1.0p-53 < w.short_share;
    r.max_tokens = is_short ? uniform(w.short_min, w.short_max) : uniform(w.long_min, w.long_max);
  }
  return out;
}

/// A load point: closed loop (`clients` > 0) or Poisson arrivals (`arrivals`, seconds from the
/// point's start), over the first `requests` requests of the list.
struct Point {
  std::string name;
  std::size_t requests = 0;
  std::int64_t clients = 0;
  double rate = 0, of_capacity = 0;  // Poisson: requests/s, and as a fraction of the capacity
  std::vector<double> arrivals;
};

/// Poisson arrival times at `rate` requests/s for `n` requests (exponential gaps, seeded).
std::vector<double> poisson_arrivals(std::size_t n, double rate, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> out;
  double t = 0;
  for (std::size_t i = 0; i < n; ++i) {
    out.push_back(t);
    const double u = (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
    t += -std::log(u) / rate;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Figures

struct Timing {
  double ttft_s = 0, e2e_s = 0;
  std::int64_t tokens = 0;
  double tpot_s() const {
    return tokens > 1 ? (e2e_s - ttft_s) / static_cast<double>(tokens - 1) : 0;
  }
};

struct PointResult {
  std::vector<Timing> requests;
  double wall_s = 0;
};

/// The p-th percentile (0..100) with linear interpolation between order statistics (numpy's).
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double at = p / 100.0 * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(at));
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
}

struct Summary {
  std::int64_t tokens = 0;
  double tokens_per_s = 0, requests_per_s = 0;
  double ttft_p50 = 0, ttft_p99 = 0, tpot_p50 = 0, tpot_p99 = 0, e2e_p50 = 0, e2e_p99 = 0;
};

Summary summarize(const PointResult& r) {
  Summary s;
  std::vector<double> ttft, tpot, e2e;
  for (const Timing& t : r.requests) {
    s.tokens += t.tokens;
    ttft.push_back(t.ttft_s);
    tpot.push_back(t.tpot_s());
    e2e.push_back(t.e2e_s);
  }
  s.tokens_per_s = static_cast<double>(s.tokens) / r.wall_s;
  s.requests_per_s = static_cast<double>(r.requests.size()) / r.wall_s;
  s.ttft_p50 = percentile(ttft, 50);
  s.ttft_p99 = percentile(ttft, 99);
  s.tpot_p50 = percentile(tpot, 50);
  s.tpot_p99 = percentile(tpot, 99);
  s.e2e_p50 = percentile(e2e, 50);
  s.e2e_p99 = percentile(e2e, 99);
  return s;
}

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// ---------------------------------------------------------------------------------------------
// The load generator: streamed completions over plain sockets, one poll loop

/// One streamed completion on its own HTTP/1.0 connection (the server ends the body by closing
/// it): the request written, the event stream read, the token events timed.
struct Stream {
  int fd = -1;
  std::size_t index = 0;
  Clock::time_point start;
  std::string out;
  std::size_t written = 0;
  std::string in;
  std::size_t scanned = std::string::npos;  // where the next event starts, once the headers are in
  std::optional<Clock::time_point> first, last;
  std::int64_t tokens = 0;
  bool done = false;  // "data: [DONE]" seen
};

std::string completion_body(const Request& r) {
  return fmt::format(
      R"({{"model": "gpt2", "prompt": [{}], "max_tokens": {}, "temperature": 0, "stream": true}})",
      fmt::join(r.prompt, ","), r.max_tokens);
}

int connect_to(std::uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(fmt::format("socket: {}", std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno != EINPROGRESS) {
    const int e = errno;
    close(fd);
    throw std::runtime_error(fmt::format("connect to 127.0.0.1:{}: {}", port, std::strerror(e)));
  }
  return fd;
}

/// The events of `s` read so far: counts the token events (a chunk with text; the last chunk,
/// with the finish reason, has none) and notes [DONE].
void scan_events(Stream& s, Clock::time_point now) {
  if (s.scanned == std::string::npos) {
    const auto end = s.in.find("\r\n\r\n");
    if (end == std::string::npos) return;
    if (s.in.compare(0, 12, "HTTP/1.0 200") != 0 && s.in.compare(0, 12, "HTTP/1.1 200") != 0) {
      throw std::runtime_error(
          fmt::format("request {}: the server answered: {}", s.index, s.in.substr(0, 400)));
    }
    s.scanned = end + 4;
  }
  for (auto end = s.in.find("\n\n", s.scanned); end != std::string::npos;
       end = s.in.find("\n\n", s.scanned)) {
    const std::string_view event(s.in.data() + s.scanned, end - s.scanned);
    s.scanned = end + 2;
    if (event == "data: [DONE]") {
      s.done = true;
      continue;
    }
    constexpr std::string_view text_key = "\"text\":\"";
    const auto at = event.find(text_key);
    if (at == std::string_view::npos || at + text_key.size() >= event.size()) continue;
    if (event[at + text_key.size()] == '"') continue;  // the closing chunk: no text
    ++s.tokens;
    if (!s.first) s.first = now;
    s.last = now;
  }
}

/// Runs one load point against baton-serve on `port`: every request of `p` streamed, timed.
class LoadGenerator {
 public:
  LoadGenerator(std::uint16_t port, std::string api_key, const std::vector<Request>& requests)
      : port_(port), api_key_(std::move(api_key)), requests_(requests) {}

  PointResult run(const Point& p, Clock::duration limit) {
    const std::size_t n = std::min(p.requests, requests_.size());
    results_.assign(n, Timing{});
    streams_.clear();
    finished_ = 0;
    const Clock::time_point t0 = Clock::now(), deadline = t0 + limit;
    std::size_t next = 0;
    if (p.clients > 0) {
      for (; next < std::min<std::size_t>(static_cast<std::size_t>(p.clients), n); ++next)
        launch(next, t0);
    }
    Clock::time_point last_token = t0;
    while (finished_ < n) {
      const Clock::time_point now = Clock::now();
      if (now > deadline) {
        close_all();
        throw std::runtime_error(fmt::format("{}: {} of {} requests finished within {:.0f} s",
                                             p.name, finished_, n, seconds(limit)));
      }
      // Open loop: every request whose time has come is sent.
      while (p.clients == 0 && next < n &&
             t0 + std::chrono::duration_cast<Clock::duration>(
                      std::chrono::duration<double>(p.arrivals[next])) <=
                 now) {
        launch(next, t0 + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(p.arrivals[next])));
        ++next;
      }
      Clock::time_point wake = deadline;
      if (p.clients == 0 && next < n) {
        wake = std::min(wake, t0 + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(p.arrivals[next])));
      }
      for (const Clock::time_point end : poll_once(wake)) {
        last_token = std::max(last_token, end);
        // Closed loop: the client whose request ended sends its next one.
        if (p.clients > 0 && next < n) launch(next++, Clock::now());
      }
    }
    return {results_, seconds(last_token - t0)};
  }

 private:
  void launch(std::size_t index, Clock::time_point start) {
    Stream s;
    s.index = index;
    s.start = start;
    const std::string body = completion_body(requests_[index]);
    s.out = fmt::format(
        "POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {}\r\n"
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
        port_, api_key_, body.size(), body);
    s.fd = connect_to(port_);
    streams_.push_back(std::move(s));
  }

  /// One poll over the open streams, until `wake` at most; returns the end times (the last token
  /// event) of the requests that completed.
  std::vector<Clock::time_point> poll_once(Clock::time_point wake) {
    std::vector<pollfd> fds;
    for (const Stream& s : streams_) {
      fds.push_back({s.fd, static_cast<short>(s.written < s.out.size() ? POLLOUT : POLLIN), 0});
    }
    const auto wait_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now()).count();
    const int timeout = static_cast<int>(std::clamp<std::int64_t>(wait_ms + 1, 0, 1000));
    if (poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) {
      throw std::runtime_error(fmt::format("poll: {}", std::strerror(errno)));
    }
    const Clock::time_point now = Clock::now();
    std::vector<Clock::time_point> ended;
    std::vector<Stream> open;
    for (std::size_t i = 0; i < streams_.size(); ++i) {
      Stream& s = streams_[i];
      if (fds[i].revents != 0 && !step(s, now)) {
        ended.push_back(complete(s));
        continue;
      }
      open.push_back(std::move(s));
    }
    streams_ = std::move(open);
    return ended;
  }

  /// Writes or reads what the socket allows; false once the server has closed the stream.
  bool step(Stream& s, Clock::time_point now) {
    if (s.written < s.out.size()) {
      const ssize_t n =
          send(s.fd, s.out.data() + s.written, s.out.size() - s.written, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN && errno != EINTR) {
        throw std::runtime_error(
            fmt::format("request {}: sending: {}", s.index, std::strerror(errno)));
      }
      if (n > 0) s.written += static_cast<std::size_t>(n);
      return true;
    }
    char buf[16384];
    const ssize_t n = read(s.fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return true;
      throw std::runtime_error(
          fmt::format("request {}: reading: {}", s.index, std::strerror(errno)));
    }
    if (n == 0) return false;
    s.in.append(buf, static_cast<std::size_t>(n));
    scan_events(s, now);
    return true;
  }

  Clock::time_point complete(Stream& s) {
    close(s.fd);
    const Request& r = requests_[s.index];
    if (!s.done || s.tokens != r.max_tokens || !s.first) {
      throw std::runtime_error(
          fmt::format("request {}: the stream ended after {} of {} tokens{}: {}", s.index, s.tokens,
                      r.max_tokens, s.done ? "" : " without [DONE]",
                      s.in.substr(0, std::min<std::size_t>(s.in.size(), 400))));
    }
    results_[s.index] = {seconds(*s.first - s.start), seconds(*s.last - s.start), s.tokens};
    ++finished_;
    return *s.last;
  }

  void close_all() {
    for (const Stream& s : streams_) close(s.fd);
    streams_.clear();
  }

  std::uint16_t port_;
  std::string api_key_;
  const std::vector<Request>& requests_;
  std::vector<Stream> streams_;
  std::vector<Timing> results_;
  std::size_t finished_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The systems

struct SystemRun {
  std::map<std::string, PointResult> points;  // by point name
  std::int64_t peak_rss_bytes = 0;
};

/// A process's peak resident memory so far (VmHWM in /proc/PID/status), in bytes; 0 if unread.
std::int64_t vm_hwm_bytes(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(in, line)) {
    if (line.starts_with("VmHWM:")) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

std::string random_key() {
  std::random_device rd;
  std::string key;
  for (int i = 0; i < 32; ++i) key += "0123456789abcdef"[rd() % 16];
  return key;
}

/// baton-serve on `weights`, one process for all of a system's points.
class ServeProcess {
 public:
  /// ranks > 1: baton-launch starts that many, one pipeline stage each (--pp).
  ServeProcess(const std::string& weights, const ModelShape& m, const std::string& batching,
               int threads, std::int64_t max_batch, int ranks = 1, const std::string& device = "cpu")
      : port_(bench::free_port()), key_(random_key()) {
    std::vector<std::string> argv{bench::executable_dir() + "/baton-serve",
                                        "--model",
                                        "gpt2",
                                        "--init-from",
                                        weights,
                                        "--heads",
                                        std::to_string(m.heads),
                                        "--batching",
                                        batching,
                                        "--listen",
                                        fmt::format("127.0.0.1:{}", port_),
                                        "--api-key",
                                        key_,
                                        "--max-batch",
                                        std::to_string(max_batch),
                                        "--threads",
                                        std::to_string(threads),
                                        "--device",
                                        device};
    if (ranks > 1) {
      argv.insert(argv.begin(), {bench::executable_dir() + "/baton-launch", "--nproc-per-node",
                                 std::to_string(ranks), "--stop-grace", "60", "--"});
    }
    child_ = bench::spawn(argv, {}, false);
    wait_listening(Clock::now() + std::chrono::seconds(60));
  }
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;
  ~ServeProcess() {
    if (child_.pid > 0) stop();
  }

  std::uint16_t port() const { return port_; }
  const std::string& key() const { return key_; }

  /// SIGTERM (it drains: nothing is running by now) and the wait; returns its peak memory.
  std::int64_t stop() {
    const std::int64_t peak = vm_hwm_bytes(child_.pid);
    kill(child_.pid, SIGTERM);
    const auto [code, out] = bench::finish(child_, Clock::now() + std::chrono::seconds(30));
    child_.pid = -1;
    if (code != 0) fmt::print(stderr, "baton-bench-serve: baton-serve exited {}\n", code);
    return peak;
  }

 private:
  void wait_listening(Clock::time_point deadline) {
    while (Clock::now() < deadline) {
      int status = 0;
      if (waitpid(child_.pid, &status, WNOHANG) == child_.pid) {
        child_.pid = -1;
        throw std::runtime_error(
            "baton-serve exited before it listened (its stderr above says why)");
      }
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(port_);
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      const bool up = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
      close(fd);
      if (up) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    throw std::runtime_error(
        fmt::format("baton-serve did not listen on port {} within 60 s", port_));
  }

  std::uint16_t port_;
  std::string key_;
  bench::Child child_;
};

struct RunSettings {
  ModelShape model;
  std::string weights;
  std::string device = "cpu";
  int threads = 1;
  std::int64_t max_batch = 32;
  std::vector<Request> warmup;
};

/// Each point a limit: ample for the slowest system at these sizes, and a bound on a hang.
constexpr auto point_limit = std::chrono::minutes(10);

/// The Poisson points, given the run of the closed-loop points so far (the first system measured
/// sets them from its capacity; the others get the same).
using PoissonPoints = std::function<std::vector<Point>(const SystemRun&)>;

/// One baton-serve process for all of a system's points: the closed-loop ones, then the Poisson.
SystemRun run_baton(const RunSettings& rs, const std::string& batching,
                    const std::vector<Request>& requests, const std::vector<Point>& closed,
                    const PoissonPoints& poisson,
                    const std::function<void(const Point&, const PointResult&)>& seen) {
  // "pp2": two ranks of one stage each, one thread each; "threads2": one process, two threads
  // (the same two cores, the fair comparison).
  const bool pp2 = batching == "pp2";
  const int threads = batching == "threads2" ? 2 : rs.threads;
  ServeProcess server(rs.weights, rs.model, pp2 || batching == "threads2" ? "continuous" : batching, threads,
                      rs.max_batch, pp2 ? 2 : 1, rs.device);
  LoadGenerator warm(server.port(), server.key(), rs.warmup);
  warm.run({.name = "warmup", .requests = rs.warmup.size(), .clients = 1}, point_limit);
  LoadGenerator load(server.port(), server.key(), requests);
  SystemRun out;
  auto measure = [&](const Point& p) {
    out.points[p.name] = load.run(p, point_limit);
    seen(p, out.points[p.name]);
  };
  for (const Point& p : closed) measure(p);
  for (const Point& p : poisson(out)) measure(p);
  out.peak_rss_bytes = server.stop();
  return out;
}

std::string request_json(const Request& r) {
  return fmt::format(R"({{"prompt": [{}], "max_tokens": {}}})", fmt::join(r.prompt, ","),
                     r.max_tokens);
}

/// The points as serve_torch.py reads them.
std::string points_json(const RunSettings& rs, const std::vector<Request>& requests,
                        const std::vector<Point>& points) {
  std::vector<std::string> warm, ps;
  for (const Request& r : rs.warmup) warm.push_back(request_json(r));
  for (const Point& p : points) {
    std::vector<std::string> reqs;
    for (std::size_t i = 0; i < std::min(p.requests, requests.size()); ++i)
      reqs.push_back(request_json(requests[i]));
    const std::string load =
        p.clients > 0 ? fmt::format(R"("clients": {})", p.clients)
                      : fmt::format(R"("arrivals": [{:.6f}])", fmt::join(p.arrivals, ", "));
    ps.push_back(fmt::format(R"({{"case": "{}", "requests": [{}], {}}})", p.name,
                             fmt::join(reqs, ", "), load));
  }
  return fmt::format(R"({{"warmup": [{}], "points": [{}]}})", fmt::join(warm, ", "),
                     fmt::join(ps, ",\n"));
}

/// The numbers of the array after "key": in a JSON line (Python's json.dumps).
std::vector<double> json_numbers(const std::string& line, std::string_view key) {
  const std::string needle = fmt::format("\"{}\": [", key);
  auto at = line.find(needle);
  if (at == std::string::npos)
    throw std::runtime_error(fmt::format("no \"{}\" in: {}", key, line.substr(0, 200)));
  std::vector<double> out;
  const char* p = line.c_str() + at + needle.size();
  while (*p != ']' && *p != '\0') {
    char* end = nullptr;
    out.push_back(std::strtod(p, &end));
    if (end == p)
      throw std::runtime_error(
          fmt::format("\"{}\": not a list of numbers: {}", key, line.substr(0, 200)));
    p = end;
    while (*p == ',' || *p == ' ') ++p;
  }
  return out;
}

struct Peer {
  std::string python, script, missing, version;
};

Peer find_peer() {
  Peer p;
  p.python = bench::reference_python();
  auto [status, out] = bench::run_capture(
      fmt::format("timeout 120 {} -c 'import torch; print(torch.__version__)' 2>&1",
                  bench::shell_quote(p.python)));
  if (status != 0) {
    p.missing = fmt::format(
        "{} cannot import torch: {} (apt-get install python3-torch, or set BATON_PYTHON)", p.python,
        bench::trim(out));
    return p;
  }
  p.version = bench::trim(out);
  p.script = bench::find_reference_script("BATON_SERVE_TORCH", "serve_torch.py", p.missing);
  return p;
}

/// One serve_torch.py process for `points`.
SystemRun run_torch_points(const Peer& peer, const RunSettings& rs,
                           const std::vector<Request>& requests, const std::vector<Point>& points,
                           const fs::path& dir) {
  const fs::path spec = dir / "points.json";
  std::ofstream(spec) << points_json(rs, requests, points);
  const std::vector<std::string> argv{peer.python,   peer.script,
                                      "run",         rs.weights,
                                      "--points",    spec.string(),
                                      "--heads",     std::to_string(rs.model.heads),
                                      "--threads",   std::to_string(rs.threads),
                                      "--max-batch", std::to_string(rs.max_batch),
                                      "--device",    rs.device};
  const auto [code, out] =
      bench::finish(bench::spawn(argv, {{"BATON_BENCH_CHILD", "1"}}, true),
                    Clock::now() + point_limit * static_cast<int>(points.size() + 1));
  if (code != 0)
    throw std::runtime_error(fmt::format("serve_torch.py run exited {}: {}", code, out));
  SystemRun run;
  std::size_t pos = 0;
  while (pos < out.size()) {
    const auto nl = std::min(out.find('\n', pos), out.size());
    const std::string line = out.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.empty() || line.front() != '{') continue;
    if (auto rss = bench::json_number(line, "maxrss_kib")) {
      run.peak_rss_bytes = static_cast<std::int64_t>(*rss) * 1024;
      continue;
    }
    const auto name = bench::json_string(line, "case");
    const auto wall = bench::json_number(line, "wall_s");
    if (!name || !wall)
      throw std::runtime_error("serve_torch.py printed an unreadable line: " + line.substr(0, 200));
    const auto ttft = json_numbers(line, "ttft"), e2e = json_numbers(line, "e2e"),
               tokens = json_numbers(line, "tokens");
    PointResult r{.wall_s = *wall};
    for (std::size_t i = 0; i < ttft.size() && i < e2e.size() && i < tokens.size(); ++i)
      r.requests.push_back({ttft[i], e2e[i], static_cast<std::int64_t>(tokens[i])});
    run.points[*name] = std::move(r);
  }
  for (const Point& p : points) {
    if (!run.points.count(p.name))
      throw std::runtime_error("serve_torch.py printed no line for " + p.name);
  }
  return run;
}

/// The peer on the closed-loop points, then the Poisson: one process where the Poisson points are
/// known already, else two (the peer measured first sets them).
SystemRun run_torch(const Peer& peer, const RunSettings& rs, const std::vector<Request>& requests,
                    const std::vector<Point>& closed, const PoissonPoints& poisson,
                    const fs::path& dir) {
  SystemRun none;
  std::vector<Point> known = poisson(none);
  if (!known.empty()) {
    known.insert(known.begin(), closed.begin(), closed.end());
    return run_torch_points(peer, rs, requests, known, dir);
  }
  SystemRun run = run_torch_points(peer, rs, requests, closed, dir);
  const SystemRun more = run_torch_points(peer, rs, requests, poisson(run), dir);
  for (const auto& [name, r] : more.points) run.points[name] = r;
  run.peak_rss_bytes = std::max(run.peak_rss_bytes, more.peak_rss_bytes);
  return run;
}

// ---------------------------------------------------------------------------------------------
// The lines

struct Options {
  bool quick = false;
  std::string only;  // "", "baton" or "torch"
  int threads = 1;
  std::int64_t max_batch = 32;
  bool pipeline = false;  // also pp 2 across 2 ranks, and one process of 2 threads
  std::string device = "cpu";  // baton-serve --device; the peer on the same device (cuda:N -> cuda:N)
};

/// The closed-loop points, then the Poisson rates as fractions of the capacity.
struct Plan {
  std::vector<std::pair<std::int64_t, std::size_t>> closed;  // {clients, requests}
  std::vector<double> rate_fractions;
  std::size_t poisson_requests = 0;
};

Plan plan_of(const Options& o) {
  if (o.quick) return {.closed = {{1, 2}, {4, 8}}, .rate_fractions = {0.5}, .poisson_requests = 8};
  return {.closed = {{1, 6}, {4, 12}, {16, 32}, {64, 64}},
          .rate_fractions = {0.25, 0.5, 0.75},
          .poisson_requests = 32};
}

std::vector<Point> closed_points(const Plan& plan) {
  std::vector<Point> out;
  for (const auto& [clients, n] : plan.closed) {
    out.push_back({.name = fmt::format("closed_c{}", clients), .requests = n, .clients = clients});
  }
  return out;
}

std::vector<Point> poisson_points(const Plan& plan, double capacity, std::uint64_t seed) {
  std::vector<Point> out;
  for (const double f : plan.rate_fractions) {
    const double rate = f * capacity;
    out.push_back({.name = fmt::format("poisson_{:.2f}x", f),
                   .requests = plan.poisson_requests,
                   .rate = rate,
                   .of_capacity = f,
                   .arrivals = poisson_arrivals(plan.poisson_requests, rate, seed + 1)});
  }
  return out;
}

/// The best requests/s of a system's closed-loop points.
double capacity_of(const SystemRun& run, const std::vector<Point>& closed) {
  double best = 0;
  for (const Point& p : closed)
    best = std::max(best, summarize(run.points.at(p.name)).requests_per_s);
  return best;
}

void add_workload(bench::JsonLine& line, const RunSettings& rs, const WorkloadSettings& w) {
  line.add("model",
           fmt::format(
               "gpt2 vocab {} d_model {} heads {} layers {} positions {} (random weights, f32)",
               rs.model.vocab, rs.model.d_model, rs.model.heads, rs.model.layers,
               rs.model.positions))
      .add("workload",
           fmt::format("seed {}: prompts uniform {}..{} token ids; outputs {:.0f}% uniform {}..{}, "
                       "{:.0f}% uniform {}..{} tokens; greedy, no stop strings",
                       w.seed, w.prompt_min, w.prompt_max, 100 * w.short_share, w.short_min,
                       w.short_max, 100 * (1 - w.short_share), w.long_min, w.long_max))
      .add("threads", rs.threads)
      .add("max_batch", rs.max_batch)
      .add("device", rs.device);
}

std::string system_note(const std::string& system) {
  if (system == "continuous")
    return "baton-serve --batching continuous, streamed over HTTP on loopback";
  if (system == "static") return "baton-serve --batching static, streamed over HTTP on loopback";
  if (system == "pp2")
    return "baton-launch --nproc-per-node 2 baton-serve: 2 pipeline stages on 2 ranks, 1 thread each, 2 steps in flight";
  if (system == "threads2") return "baton-serve --threads 2: one process, the same 2 cores as pp2";
  return "PyTorch eager decode loop, KV cache, static batches (serve_torch.py), in-process: no "
         "HTTP overhead (favours "
         "it)";
}

void print_point(const std::string& system, const Point& p,
                 const std::map<std::string, SystemRun>& runs, const RunSettings& rs,
                 const WorkloadSettings& w, const Peer& peer) {
  const SystemRun& run = runs.at(system);
  const Summary s = summarize(run.points.at(p.name));
  bench::JsonLine line("serve", fmt::format("{}_{}", p.name, system));
  line.add("value", s.tokens_per_s).add("unit", "output tokens/s").better(bench::Better::higher);
  line.add("system", system).add("system_is", system_note(system));
  if (p.clients > 0) {
    line.add("load", "closed loop").add("clients", p.clients);
  } else {
    line.add("load", "poisson").add("request_rate", p.rate).add("rate_of_capacity", p.of_capacity);
  }
  line.add("requests", static_cast<std::int64_t>(p.requests))
      .add("output_tokens", s.tokens)
      .add("wall_s", run.points.at(p.name).wall_s)
      .add("output_tokens_per_s", s.tokens_per_s)
      .add("requests_per_s", s.requests_per_s)
      .add("ttft_p50_s", s.ttft_p50)
      .add("ttft_p99_s", s.ttft_p99)
      .add("tpot_p50_s", s.tpot_p50)
      .add("tpot_p99_s", s.tpot_p99)
      .add("e2e_p50_s", s.e2e_p50)
      .add("e2e_p99_s", s.e2e_p99)
      .add("peak_rss_bytes", run.peak_rss_bytes);
  if (system != "pytorch") {
    if (auto t = runs.find("pytorch"); t != runs.end()) {
      const Summary ts = summarize(t->second.points.at(p.name));
      line.add("reference", ts.tokens_per_s)
          .add("reference_name", "PyTorch eager, static batches, no HTTP")
          .compare("ratio", s.tokens_per_s, ts.tokens_per_s)
          .compare("vs_torch_tokens_per_s", s.tokens_per_s, ts.tokens_per_s)
          .compare("tpot_p99_vs_torch", s.tpot_p99, ts.tpot_p99, bench::Better::lower);
    } else {
      line.add("reference_missing", peer.missing.empty() ? "--only baton" : peer.missing);
    }
    if (auto st = runs.find("static"); system == "continuous" && st != runs.end()) {
      line.compare("vs_static_tokens_per_s", s.tokens_per_s,
                   summarize(st->second.points.at(p.name)).tokens_per_s);
    }
  } else {
    line.add("torch", peer.version);
  }
  add_workload(line, rs, w);
  line.print();
}

void print_memory(const std::string& system, const std::map<std::string, SystemRun>& runs,
                  const RunSettings& rs, const WorkloadSettings& w) {
  bench::JsonLine line("serve", "peak_rss_" + system);
  const auto peak = static_cast<double>(runs.at(system).peak_rss_bytes);
  line.add("value", peak / (1024.0 * 1024.0))
      .add("unit", "MiB peak resident memory of the process over the whole run")
      .better(bench::Better::lower)
      .add("system", system)
      .add("system_is", system_note(system));
  if (auto t = runs.find("pytorch"); system != "pytorch" && t != runs.end()) {
    const auto theirs = static_cast<double>(t->second.peak_rss_bytes);
    line.add("reference", theirs / (1024.0 * 1024.0))
        .add("reference_name", "PyTorch eager (ru_maxrss)")
        .compare("ratio", peak, theirs);
  }
  add_workload(line, rs, w);
  line.print();
}

void note_point(const std::string& system, const Point& p, const PointResult& r) {
  const Summary s = summarize(r);
  fmt::print(stderr,
             "baton-bench-serve: {} {}: {:.0f} tokens/s, {:.2f} requests/s, TTFT p99 {:.3f} s, "
             "TPOT p99 {:.4f} s\n",
             system, p.name, s.tokens_per_s, s.requests_per_s, s.ttft_p99, s.tpot_p99);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--quick")
      o.quick = true;
    else if (a == "--only")
      o.only = value();
    else if (a == "--threads")
      o.threads = std::max(1, std::stoi(value()));
    else if (a == "--max-batch")
      o.max_batch = std::max<std::int64_t>(1, std::stoll(value()));
    else if (a == "--pipeline")
      o.pipeline = true;
    else if (a == "--device")
      o.device = value();
    else if (a == "-h" || a == "--help") {
      fmt::print(
          "usage: baton-bench-serve [--quick] [--only baton|torch] [--threads 1] [--max-batch 32] [--pipeline]\n"
          "                         [--device cpu|cuda:N]\n"
          "  --quick      a few requests at 3 points (a smoke run)\n"
          "  --only       baton-serve (continuous and static) or the PyTorch peer alone\n"
          "  --threads    BLAS threads of baton-serve and torch.set_num_threads of the peer\n"
          "  --max-batch  requests in a batch at most, every system\n"
          "  --pipeline   also baton-serve as 2 pipeline stages on 2 ranks (pp2) and one process of 2\n"
          "               threads (threads2), the same 2 cores\n"
          "  --device     where baton-serve and the PyTorch peer run (both on the same GPU with cuda:N)\n{}",
          bench::allow_load_usage);
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown argument '" + a + "' (--help lists them)");
    }
  }
  if (!o.only.empty() && o.only != "baton" && o.only != "torch")
    throw std::invalid_argument("--only: baton or torch, not '" + o.only + "'");
  if (o.device != "cpu" && !o.device.starts_with("cuda:"))
    throw std::invalid_argument("--device: cpu or cuda:N, not '" + o.device + "'");
  if (o.device != "cpu" && o.pipeline)
    throw std::invalid_argument("--pipeline measures ranks sharing the CPU's cores: not with --device " + o.device);
  return o;
}

/// A temporary folder, removed with its contents at the end.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "baton-bench-serve-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// The weights file, written by serve_torch.py (torch is needed for it, even with --only baton).
void write_weights(const Peer& peer, const ModelShape& m, const std::string& file) {
  const std::vector<std::string> argv{peer.python,   peer.script,
                                      "weights",     file,
                                      "--vocab",     std::to_string(m.vocab),
                                      "--d-model",   std::to_string(m.d_model),
                                      "--heads",     std::to_string(m.heads),
                                      "--layers",    std::to_string(m.layers),
                                      "--positions", std::to_string(m.positions)};
  const auto [code, out] =
      bench::finish(bench::spawn(argv, {}, true), Clock::now() + std::chrono::minutes(2));
  if (code != 0)
    throw std::runtime_error(fmt::format("serve_torch.py weights exited {}: {}", code, out));
}

int run(const Options& o) {
  const Peer peer = find_peer();
  if (!peer.missing.empty()) {
    // The random weights come from the same script: nothing can run without it.
    return bench::skip("baton-bench-serve", peer.missing);
  }
  const TempDir dir;
  RunSettings rs{.weights = (dir.path / "gpt2.safetensors").string(),
                 .device = o.device,
                 .threads = o.threads,
                 .max_batch = o.max_batch};
  write_weights(peer, rs.model, rs.weights);
  const WorkloadSettings w;
  const Plan plan = plan_of(o);
  std::size_t most = plan.poisson_requests;
  for (const auto& [c, n] : plan.closed) most = std::max(most, n);
  const std::vector<Request> requests = make_requests(most, w, rs.model.vocab);
  rs.warmup =
      make_requests(2, {.seed = w.seed + 7, .long_min = 16, .long_max = 16}, rs.model.vocab);
  for (Request& r : rs.warmup) r.max_tokens = 16;

  const std::vector<Point> closed = closed_points(plan);
  std::vector<Point> poisson;
  // The first system's capacity sets the rates; an empty run (the peer asking ahead) gets the
  // points if they are known, else none.
  const PoissonPoints poisson_of = [&](const SystemRun& run) {
    if (poisson.empty() && !run.points.empty()) {
      const double capacity = capacity_of(run, closed);
      fmt::print(
          stderr,
          "baton-bench-serve: capacity {:.2f} requests/s: the Poisson rates are {} times it\n",
          capacity, fmt::join(plan.rate_fractions, ", "));
      poisson = poisson_points(plan, capacity, w.seed);
    }
    return poisson;
  };
  std::vector<std::string> systems;
  if (o.only != "torch") systems = {"continuous", "static"};
  if (o.only != "torch" && o.pipeline) systems.insert(systems.end(), {"pp2", "threads2"});
  if (o.only != "baton") systems.push_back("pytorch");
  std::map<std::string, SystemRun> runs;
  for (const std::string& system : systems) {
    auto seen = [&](const Point& p, const PointResult& r) { note_point(system, p, r); };
    if (system == "pytorch") {
      runs[system] = run_torch(peer, rs, requests, closed, poisson_of, dir.path);
      for (const auto& [name, r] : runs[system].points) seen(Point{.name = name}, r);
    } else {
      runs[system] = run_baton(rs, system, requests, closed, poisson_of, seen);
    }
  }
  std::vector<Point> all = closed;
  all.insert(all.end(), poisson.begin(), poisson.end());
  for (const Point& p : all) {
    for (const std::string& system : systems) print_point(system, p, runs, rs, w, peer);
  }
  for (const std::string& system : systems) {
    if (system != "pp2") print_memory(system, runs, rs, w);  // pp2's ranks are not the launcher measured
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 1);  // takes --allow-load out of argv
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-bench-serve: {}\n", e.what());
    return 2;
  }
  // The decode step's threads: the load generator sleeps in poll, the HTTP threads mostly wait.
  bench::load().set_own_threads(o.pipeline ? std::max(o.threads, 2) : o.threads);
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-bench-serve: {}\n", e.what());
    return 1;
  }
}
