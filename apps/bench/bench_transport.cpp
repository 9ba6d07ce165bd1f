// baton-bench-transport: what crossing ranks costs. Two ranks (processes on this host) run
// small cross-rank plans over the UCX data plane, once with UCX's own choice of transports
// (shared memory between processes of one host) and once with UCX_TLS=tcp (loopback); each
// case is compared with ucx_perftest measured in the same run under the UCX configuration the
// data plane gives itself (transports and rendezvous threshold: ucx_configuration), and the
// bandwidth cases also with ucx_perftest under UCX's defaults (`ceiling`: CMA between processes).
//
//   baton-bench-transport                  every case
//   baton-bench-transport --quick          ~10x less data (the CTest smoke run)
//   baton-bench-transport --no-reference   skip ucx_perftest
//   baton-bench-transport --case transfer_bw_1MiB
//
// Cases (one JSON line each, keys as in every baton benchmark):
//   transfer_bw_{64KiB,1MiB,16MiB}_{shm,tcp}  a source on rank 0 streams registers to a sink on
//       rank 1 (8 slots): GB/s moved into rank 1's registers; reference ucx_perftest tag_bw
//       (--sizes 4K,16K,... for other sizes)
//   msg_latency_{shm,tcp}  an actor on each rank in a cycle of empty registers (each waits for
//       the other): one-way latency of one hop; reference ucx_perftest tag_lat (32 bytes)
//   cross_rank_stream_{shm,tcp}  empty source on rank 0 -> empty sink on rank 1: pieces/s;
//       reference ucx_perftest ucp_am_bw message rate (32 bytes)
// Knobs for experiments (environment): BATON_BENCH_RT_SPIN / _RT_YIELD (the workers'
// spin_polls / spin_yield_every), BATON_BENCH_DP_SPIN (the data plane's spin_polls),
// BATON_BENCH_IDLE=park|busy_poll|automatic (RuntimeSettings::idle_polling),
// BATON_BENCH_SHM_TLS (UCX_TLS of the _shm cases, for baton and the reference alike),
// BATON_BENCH_INLINE=B (RuntimeSettings::inline_payload_bytes: pieces up to B bytes go with
// their requests; 0: every piece is offered and pulled), BATON_BENCH_SHARED=0
// (RuntimeSettings::shared_registers off: no piece is read in place in the producer's slot).
// Binding (--bind core|none): by default, where this process may use two cores or more, each
// rank on a core of its own (BATON_BIND_TO=core, as baton-launch --bind-to core) and each
// ucx_perftest process likewise (its -c), as mpirun binds two ranks; unbound, one hop over shared
// memory was bimodal (0.6-0.8 or 2.4-2.9 us), as the scheduler put the two ranks on two cores
// or on one.
// The driver hosts the rendezvous server and starts the two ranks as child processes of
// itself (--worker); rank 1 reports its run time on stdout.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "json_line.h"
#include "knobs.h"
#include "spawn.h"
#include "baton/actors.h"
#include "baton/kernels.h"
#include "baton/transport/data_plane.h"

namespace {

using Clock = std::chrono::steady_clock;
using baton::bench::Env;
using baton::bench::Child;
using baton::bench::spawn;
using baton::bench::finish;
using baton::bench::free_port;

struct Options {
  bool quick = false;
  bool reference = true;
  std::string only;
  std::vector<std::int64_t> sizes{std::int64_t{64} << 10, std::int64_t{1} << 20, std::int64_t{16} << 20};
  // --worker mode
  bool worker = false;
  std::string mode;  // bw | lat | stream
  std::int64_t bytes = 0;
  std::int64_t pieces = 0;
  std::int32_t slots = 8;
  std::optional<bool> bind;  // --bind core|none; unset: core where two cores may be used
};

[[noreturn]] void usage(int code) {
  fmt::print(code == 0 ? stdout : stderr,
             "usage: baton-bench-transport [--quick] [--no-reference] [--case NAME] [--sizes 64K,1M,16M]\n"
             "       [--bind core|none] [--allow-load] [--help]\n"
             "  Two ranks on this host, shared memory and TCP; one JSON line per case on stdout.\n"
             "{}",
             baton::bench::allow_load_usage);
  std::exit(code);
}

/// "64K,1M,16M" (K and M are 2^10 and 2^20).
std::vector<std::int64_t> parse_sizes(const std::string& list) {
  std::vector<std::int64_t> sizes;
  std::istringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    std::int64_t n = 0;
    try {
      n = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    const std::string unit = item.substr(used);
    const int shift = unit == "K" ? 10 : unit == "M" ? 20 : unit.empty() ? 0 : -1;
    if (used == 0 || shift < 0 || n <= 0) {
      fmt::print(stderr, "baton-bench-transport: --sizes: '{}' is not a size (like 64K or 1M)\n", item);
      usage(2);
    }
    sizes.push_back(n << shift);
  }
  return sizes;
}

Options parse(int argc, char** argv) {
  Options o;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) {
      fmt::print(stderr, "baton-bench-transport: {} needs a value\n", argv[i]);
      usage(2);
    }
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") usage(0);
    else if (a == "--quick") o.quick = true;
    else if (a == "--no-reference") o.reference = false;
    else if (a == "--case") o.only = value(i);
    else if (a == "--sizes") o.sizes = parse_sizes(value(i));
    else if (a == "--worker") o.worker = true;
    else if (a == "--mode") o.mode = value(i);
    else if (a == "--bytes") o.bytes = std::stoll(value(i));
    else if (a == "--pieces") o.pieces = std::stoll(value(i));
    else if (a == "--slots") o.slots = std::stoi(value(i));
    else if (a == "--bind") {
      const std::string b = value(i);
      if (b != "core" && b != "none") {
        fmt::print(stderr, "baton-bench-transport: --bind {}: core or none\n", b);
        usage(2);
      }
      o.bind = b == "core";
    }
    else {
      fmt::print(stderr, "baton-bench-transport: unknown argument '{}'\n", a);
      usage(2);
    }
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// ucx_perftest, the reference

struct PerfResult {
  double latency_us = 0;   // overall, one-way for latency tests
  double bandwidth_MBps = 0;  // MB = 2^20 bytes, as ucx_perftest prints
  double msg_rate = 0;     // messages/s
};

/// The first two cores this process may use, for the two sides of a bound run (empty: fewer).
std::vector<int> two_cores() {
  std::vector<int> cores = baton::bench::allowed_cpus();
  cores.resize(cores.size() < 2 ? 0 : 2);
  return cores;
}

/// `cores`: empty, or the server's and the client's core (ucx_perftest -c).
std::optional<PerfResult> ucx_perftest(const std::string& test, std::int64_t size, std::int64_t iters,
                                       const Env& env, const std::vector<int>& cores) {
  const auto port = std::to_string(free_port());
  std::vector<std::string> server_argv{"ucx_perftest", "-p", port};
  std::vector<std::string> client_argv{"ucx_perftest", "127.0.0.1", "-p", port, "-t", test, "-s", std::to_string(size),
                                       "-n", std::to_string(iters)};
  if (cores.size() == 2) {
    server_argv.insert(server_argv.end(), {"-c", std::to_string(cores[0])});
    client_argv.insert(client_argv.end(), {"-c", std::to_string(cores[1])});
  }
  Child server = spawn(server_argv, env, false);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  Child client = spawn(client_argv, env, true);
  auto deadline = Clock::now() + std::chrono::seconds(120);
  auto [code, text] = finish(client, deadline);
  finish(server, Clock::now() + std::chrono::seconds(5));
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("Final:", 0) != 0) continue;
    std::istringstream f(line.substr(6));
    double iters_done = 0, p50 = 0, lat_avg = 0, lat_all = 0, bw_avg = 0, bw_all = 0, mr_avg = 0, mr_all = 0;
    f >> iters_done >> p50 >> lat_avg >> lat_all >> bw_avg >> bw_all >> mr_avg >> mr_all;
    if (!f) break;
    return PerfResult{lat_all, bw_all, mr_all};
  }
  fmt::print(stderr, "baton-bench-transport: ucx_perftest -t {} -s {} gave no result (exit {}):\n{}\n", test, size,
             code, text);
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// The plans (every rank builds the same one)

baton::Plan bench_plan(const Options& o) {
  baton::Plan p;
  const std::int64_t elements = o.bytes / 4;
  auto reg = [&](std::string name, std::int32_t slots) {
    return p.add_register({.name = std::move(name), .shape = {elements}, .dtype = baton::DType::f32, .slots = slots});
  };
  if (o.mode == "bw" || o.mode == "stream") {
    auto r = reg("src.out", o.slots);
    p.add_actor({.name = "src", .kind = baton::ActorKind::source, .op = "noop", .outputs = {r}, .pieces = o.pieces});
    p.add_actor({.name = "sink", .op = "noop", .where = {.rank = 1}, .inputs = {{r}}});
  } else {  // lat: ping (rank 0) and pong (rank 1) wait for each other
    auto tick = reg("tick", 1);
    auto ping = reg("ping.out", 1);
    auto pong = reg("pong.out", 1);
    p.add_actor({.name = "ticks", .kind = baton::ActorKind::source, .op = "noop", .outputs = {tick}, .pieces = o.pieces});
    p.add_actor({.name = "ping", .op = "noop", .inputs = {{tick}, {pong, 1}}, .outputs = {ping}});
    p.add_actor({.name = "pong", .op = "noop", .where = {.rank = 1}, .inputs = {{ping}}, .outputs = {pong}});
  }
  return p;
}

int worker_main(const Options& o) {
  try {
    auto env = baton::JobEnvironment::from_env();
    auto kernels = baton::KernelRegistry::with_builtin_kernels();
    baton::JobSettings js;
    js.runtime.time_accounting = false;
    if (const char* s = std::getenv("BATON_BENCH_RT_SPIN")) js.runtime.spin_polls = std::atoi(s);
    if (const char* s = std::getenv("BATON_BENCH_DP_SPIN")) js.data.spin_polls = std::atoi(s);
    if (const char* s = std::getenv("BATON_BENCH_RT_YIELD")) js.runtime.spin_yield_every = std::atoi(s);
    baton::bench::apply_knobs(js.runtime);  // BATON_BENCH_INLINE, _SHARED, _IDLE
    auto report = baton::run_job(bench_plan(o), kernels, env, js);
    if (env.rank == 1) fmt::print("IDLE {}\nRESULT {:.9f}\n", report.idle_polling, report.wall_s);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-bench-transport worker: {}\n", e.what());
    return 1;
  }
}

/// What rank 1's idle workers did (RunReport::idle_polling), from the last run_ranks.
std::string last_idle_polling;

/// Runs the two ranks; returns rank 1's run time in seconds.
std::optional<double> run_ranks(const std::string& self, const Options& o, const Env& tls_env) {
  auto out = baton::bench::run_job_of(self,
                               {"--worker", "--mode", o.mode, "--bytes", std::to_string(o.bytes), "--pieces",
                                std::to_string(o.pieces), "--slots", std::to_string(o.slots)},
                               2, 1, tls_env);
  if (!out) return std::nullopt;
  if (auto idle = out->find("IDLE "); idle != std::string::npos) {
    last_idle_polling = out->substr(idle + 5, out->find('\n', idle) - idle - 5);
  }
  auto pos = out->find("RESULT ");
  if (pos == std::string::npos) return std::nullopt;
  return std::stod(out->substr(pos + 7));
}

std::string size_name(std::int64_t b) {
  if (b >= (1 << 20) && b % (1 << 20) == 0) return fmt::format("{}MiB", b >> 20);
  if (b >= (1 << 10) && b % (1 << 10) == 0) return fmt::format("{}KiB", b >> 10);
  return fmt::format("{}B", b);
}

/// The environments one transport's cases run under.
struct Transport {
  std::string tls;    // "shm" or "tcp"
  Env env;            // the ranks'
  Env reference_env;  // ucx_perftest's, under the UCX configuration the data plane gives itself
  Env ceiling_env;    // ucx_perftest's, under UCX's own defaults
};

/// "shm": the data plane's own choice of transports for a job on one host (shared memory);
/// "tcp": TCP over loopback only. `bound`: the ranks on a core each (BATON_BIND_TO).
Transport transport_for(const std::string& tls, bool bound) {
  Transport t{.tls = tls, .env = {{"UCX_TLS", tls == "tcp" ? "tcp" : ""}, {"BATON_BIND_TO", bound ? "core" : "none"}},
              .reference_env = {}, .ceiling_env = {{"UCX_TLS", tls == "tcp" ? "tcp" : ""}, {"UCX_RNDV_THRESH", ""}}};
  if (const char* shm_tls = std::getenv("BATON_BENCH_SHM_TLS"); shm_tls != nullptr && tls == "shm") {
    t.env["UCX_TLS"] = shm_tls;
  }
  // The reference runs under the UCX configuration the data plane gives itself (the same
  // transports and rendezvous threshold), so the ratio is what baton's runtime costs over
  // its transport; the ceiling is ucx_perftest under UCX's own defaults (with CMA between
  // processes of one host), which baton does not use by default (data_plane.cpp says why).
  if (tls == "shm") unsetenv("UCX_TLS");
  t.reference_env = t.env;
  // The ranks run as run_job runs a job whose ranks share a host (data_plane_for_job).
  baton::transport::DataPlaneSettings as_baton;
  if (tls == "tcp") as_baton.transports = "tcp";
  if (t.env["UCX_TLS"] != "") as_baton.transports = t.env["UCX_TLS"];
  baton::JobEnvironment one_host{.world_size = 2, .local_world_size = 2};
  as_baton = baton::data_plane_for_job(one_host, as_baton);
  for (const auto& [name, value] : baton::transport::ucx_configuration(as_baton)) t.reference_env["UCX_" + name] = value;
  return t;
}

using baton::bench::Better;

/// A reference asked for that gave no result (ucx_perftest said why on stderr) fails the case:
/// says so in its line and on stderr; returns 1, a failure to count.
int reference_failed(baton::bench::JsonLine& line, const std::string& case_name) {
  fmt::print(stderr, "baton-bench-transport: case {}: ucx_perftest gave no result (--no-reference measures baton "
                     "alone)\n", case_name);
  line.add("reference_failed", "ucx_perftest gave no result (stderr)");
  return 1;
}

/// What every case's line says beside its value: how rank 1's idle workers waited, how both
/// sides were bound, and the knobs the ranks ran under.
void add_conditions(baton::bench::JsonLine& line, const std::string& bound) {
  line.add("idle_polling", last_idle_polling).add("bound", bound)
      .add("inline_payload_bytes", static_cast<std::int64_t>(baton::bench::inline_payload_bytes()))
      .add("shared_registers", baton::bench::shared_registers());
}

}  // namespace

int main(int argc, char** argv) {
  baton::bench::load().start(argc, argv, 2);  // two ranks, each with a busy worker
  Options o = parse(argc, argv);
  if (o.worker) return worker_main(o);
  signal(SIGPIPE, SIG_IGN);
  char self_buf[4096] = {};
  ssize_t n = readlink("/proc/self/exe", self_buf, sizeof self_buf - 1);
  const std::string self = n > 0 ? std::string(self_buf, static_cast<std::size_t>(n)) : argv[0];
  const double scale = o.quick ? 0.1 : 1.0;
  int failures = 0;
  // Both sides bound alike: the ranks' threads a core per rank, each perftest process a core.
  const std::vector<int> cores = o.bind.value_or(true) ? two_cores() : std::vector<int>{};
  const std::string bound = cores.empty() ? "not bound, both sides"
                                          : fmt::format("a core per rank (cores {} and {}), both sides", cores[0], cores[1]);

  for (const std::string tls : {"shm", "tcp"}) {
    const Transport t = transport_for(tls, !cores.empty());
    const Env& env = t.env;
    auto wanted = [&](const std::string& c) { return o.only.empty() || c.rfind(o.only, 0) == 0; };

    for (std::int64_t bytes : o.sizes) {
      const std::string name = fmt::format("transfer_bw_{}_{}", size_name(bytes), tls);
      if (!wanted(name)) continue;
      const double total = (tls == "tcp" ? 2e9 : 4e9) * scale;
      Options w = o;
      w.mode = "bw";
      w.bytes = bytes;
      w.pieces = std::max<std::int64_t>(16, static_cast<std::int64_t>(total / static_cast<double>(bytes)));
      w.slots = 8;
      auto secs = run_ranks(self, w, env);
      if (!secs) {
        fmt::print(stderr, "baton-bench-transport: case {} failed: the ranks gave no time\n", name);
        ++failures;
        continue;
      }
      const double gbps = static_cast<double>(bytes) * static_cast<double>(w.pieces) / *secs / 1e9;
      baton::bench::JsonLine line("transport", name);
      line.add("value", gbps).add("unit", "GB/s").better(Better::higher).add("bytes", bytes).add("pieces", w.pieces)
          .add("slots", 8);
      add_conditions(line, bound);
      if (o.reference) {
        if (auto ref = ucx_perftest("tag_bw", bytes, w.pieces, t.reference_env, cores)) {
          const double ref_gbps = ref->bandwidth_MBps * 1048576.0 / 1e9;
          line.add("reference", ref_gbps).add("reference_name", "ucx_perftest tag_bw").compare("ratio", gbps, ref_gbps);
        } else {
          failures += reference_failed(line, name);
        }
        if (auto top = ucx_perftest("tag_bw", bytes, w.pieces, t.ceiling_env, cores)) {
          const double top_gbps = top->bandwidth_MBps * 1048576.0 / 1e9;
          line.add("ceiling", top_gbps).add("ceiling_name", "ucx_perftest tag_bw, UCX defaults")
              .compare("ratio_to_ceiling", gbps, top_gbps);
        } else {
          failures += reference_failed(line, name + " (ceiling)");
        }
      }
      line.print();
    }

    const std::string lat_name = "msg_latency_" + tls;
    if (wanted(lat_name)) {
      Options w = o;
      w.mode = "lat";
      w.bytes = 0;
      w.pieces = static_cast<std::int64_t>(20000 * scale);
      if (auto secs = run_ranks(self, w, env)) {
        const double us = *secs / static_cast<double>(2 * w.pieces) * 1e6;
        baton::bench::JsonLine line("transport", lat_name);
        line.add("value", us).add("unit", "us one-way").better(Better::lower).add("pieces", w.pieces);
        add_conditions(line, bound);
        if (o.reference) {
          if (auto ref = ucx_perftest("tag_lat", 32, w.pieces, t.reference_env, cores)) {
            line.add("reference", ref->latency_us).add("reference_name", "ucx_perftest tag_lat 32 B")
                .compare("ratio", us, ref->latency_us);
          } else {
            failures += reference_failed(line, lat_name);
          }
        }
        line.print();
      } else {
        fmt::print(stderr, "baton-bench-transport: case {} failed: the ranks gave no time\n", lat_name);
        ++failures;
      }
    }

    const std::string stream_name = "cross_rank_stream_" + tls;
    if (wanted(stream_name)) {
      Options w = o;
      w.mode = "stream";
      w.bytes = 0;
      w.slots = 8;
      w.pieces = static_cast<std::int64_t>(200000 * scale);
      if (auto secs = run_ranks(self, w, env)) {
        const double rate = static_cast<double>(w.pieces) / *secs;
        baton::bench::JsonLine line("transport", stream_name);
        line.add("value", rate).add("unit", "pieces/s").better(Better::higher).add("pieces", w.pieces).add("slots", 8);
        add_conditions(line, bound);
        if (o.reference) {
          if (auto ref = ucx_perftest("ucp_am_bw", 32, w.pieces, t.reference_env, cores)) {
            line.add("reference", ref->msg_rate).add("reference_name", "ucx_perftest ucp_am_bw 32 B msg/s")
                .compare("ratio", rate, ref->msg_rate);
          } else {
            failures += reference_failed(line, stream_name);
          }
        }
        line.print();
      } else {
        fmt::print(stderr, "baton-bench-transport: case {} failed: the ranks gave no time\n", stream_name);
        ++failures;
      }
    }
  }
  return failures == 0 ? 0 : 1;
}
