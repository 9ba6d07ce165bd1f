#pragma once
// The machine's load, as every baton benchmark states it: the 1-minute load average from
// /proc/loadavg when the benchmark starts and when each JSON line is printed, and the cores this
// process may use. A ratio against a peer measured on a machine busy with other work says more
// about the neighbours than about baton, so JsonLine::print() leaves the comparative keys (those
// given with JsonLine::compare()) out when the load is above the core count, unless the
// benchmark was given --allow-load (then they are printed and the line says "loaded": true).
//
//   int main(int argc, char** argv) {
//     baton::bench::load().start(argc, argv, /*own_threads=*/2);  // takes --allow-load out of argv
//     ...
//
// The load compared with the cores is the other work on the machine: the start reading (taken
// before the benchmark runs anything), and the end reading less the threads the benchmark keeps
// busy itself (`own_threads`: on a quiet 2-core machine a benchmark spinning 2 threads raises the
// 1-minute average towards 2 on its own). Both raw readings are printed.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "provenance.h"

namespace baton::bench {

/// The 1-minute load average (the first field of /proc/loadavg); -1 if it cannot be read.
inline double read_loadavg(const char* path = "/proc/loadavg") {
  std::ifstream in(path);
  double one = -1;
  if (!(in >> one)) return -1;
  return one;
}

/// The cores this process may run on (its affinity mask), in order; empty if it cannot be read.
inline std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

/// How many cores this process may run on (its affinity mask), or hardware_concurrency().
inline int usable_cores() {
  if (const auto n = allowed_cpus().size(); n > 0) return static_cast<int>(n);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

/// Whether a ratio may be printed, given the load readings (pure: the tests of the benchmarks'
/// policy need no loaded machine). `own_threads` is subtracted from the end reading only.
struct LoadVerdict {
  bool loaded = false;  // the other work on the machine exceeds its cores
  double others = 0;    // the load compared with the cores
  std::string reason;   // why it is loaded, or ""
};
inline LoadVerdict judge_load(double start, double end, int cores, int own_threads) {
  LoadVerdict v;
  const double others_end = end - static_cast<double>(std::max(own_threads, 0));
  v.others = std::max(start, others_end);
  if (start > cores) {
    v.loaded = true;
    v.reason = fmt::format("load average {:.2f} at the start is above the {} cores", start, cores);
  } else if (others_end > cores) {
    v.loaded = true;
    v.reason = fmt::format(
        "load average {:.2f} at the end, less this benchmark's {} busy threads, is above the {} "
        "cores",
        end, own_threads, cores);
  }
  return v;
}

/// The process-wide load watch (one per benchmark process).
class LoadWatch {
 public:
  /// Reads the start load, and takes --allow-load out of argv (so that a benchmark's own parser
  /// never sees it). Call first thing in main(). A benchmark's worker processes (started with
  /// --worker, or with BATON_BENCH_CHILD in the environment) print nothing about the load: their
  /// parent does.
  ///
  /// `loadavg` is where the load is read from: /proc/loadavg, or a file of a test's own.
  void start(int& argc, char** argv, int own_threads, std::string loadavg = "/proc/loadavg") {
    provenance().record_command(argc, argv);
    loadavg_ = std::move(loadavg);
    int out = 1;
    bool worker = false;
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      worker = worker || a == "--worker";
      if (a == "--allow-load") {
        allow_ = true;
      } else {
        argv[out++] = argv[i];
      }
    }
    argc = out;
    argv[argc] = nullptr;
    own_threads_ = own_threads;
    cores_ = usable_cores();
    start_ = read_loadavg(loadavg_.c_str());
    started_ = true;
    // A child a benchmark starts for one measurement says so in its environment.
    worker = worker || std::getenv("BATON_BENCH_CHILD") != nullptr;
    if (!worker) {
      // Read now, before anything is measured: the commit runs git, the machine reads cpuinfo.
      (void)provenance().commit();
      (void)provenance().machine();
    }
    if (start_ > cores_ && !worker) {
      fmt::print(stderr, "load average {:.2f} is above the {} cores: {}\n", start_, cores_,
                 allow_
                     ? "ratios will be printed marked \"loaded\": true (--allow-load)"
                     : "no ratio will be printed (give --allow-load to print them, marked loaded)");
    }
  }
  /// The busy threads of the benchmark's current case, when it changes (e.g. 2 then 4 ranks).
  void set_own_threads(int n) { own_threads_ = n; }

  bool started() const { return started_; }
  bool allowed() const { return allow_; }
  int cores() const { return cores_; }
  int own_threads() const { return own_threads_; }
  double start_load() const { return start_; }
  /// The load now (the end reading of a line printed now).
  double load_now() const { return read_loadavg(loadavg_.c_str()); }

  /// Whether a ratio may be shown now (not started, not loaded, or --allow-load).
  bool ratios_shown() const {
    return !started_ || allow_ || !judge_load(start_, load_now(), cores_, own_threads_).loaded;
  }

 private:
  bool started_ = false;
  bool allow_ = false;
  int cores_ = 1;
  int own_threads_ = 1;
  double start_ = -1;
  std::string loadavg_ = "/proc/loadavg";
};

inline LoadWatch& load() {
  static LoadWatch watch;
  return watch;
}

/// A ratio for the human notes on stderr, as the JSON line shows it: withheld on a loaded machine.
inline std::string ratio_note(double ratio) {
  return load().ratios_shown() ? fmt::format("{:.2f}", ratio)
                               : std::string("withheld (machine loaded)");
}

/// The usage line every benchmark prints for the flag LoadWatch::start() handles.
inline constexpr std::string_view allow_load_usage =
    "  --allow-load  print ratios even when the machine's load is above its cores (marked "
    "\"loaded\": true)\n";

}  // namespace baton::bench
