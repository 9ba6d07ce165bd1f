// baton-bench-allreduce: the all-reduce made of actors (graph/collectives.h) between ranks on
// this host, against OpenMPI's MPI_Allreduce measured in the same run (baton-mpi-allreduce-ref
// under mpirun, shared memory). Each rank's producer waits for its own previous result before
// it emits the next tensor (delay 1), so the all-reduces run back to back as MPI's do, not
// pipelined. Both sides report the same statistic, as OSU and nccl-tests do: each rank's time
// per all-reduce averaged over the timed iterations (after a warm-up), the slowest rank's
// (baton: between its producer's acts; MPI: MPI_Wtime around the loop after a barrier, the
// maximum over ranks by MPI_Reduce). Bus bandwidth as nccl-tests defines it:
// busbw = 2(n-1)/n x bytes / time. mpirun gets --oversubscribe only where the ranks outnumber
// the cores this process may use. Both sides choose their algorithm by size (MPI's tuned module;
// baton as training does: direct below gradient_direct_below_bytes_one_host, else the ring),
// and both sides' ranks are bound alike: a core each where they fit the cores (mpirun's own
// default for two ranks), else not bound.
//
//   baton-bench-allreduce            2 and 4 ranks, 1 KiB .. 256 MiB
//   baton-bench-allreduce --quick    2 ranks, three sizes, few iterations (the CTest smoke run)
//   baton-bench-allreduce --no-reference
//   baton-bench-allreduce --segment-kib K --max-segments S --ranks N --min-kib A --max-mib B
//                                    other AllReduceSettings, rank counts and sizes (sweeps)
//   baton-bench-allreduce --algorithm ring       the ring at every size (auto: by size, the default)
//   baton-bench-allreduce --direct-below-kib K   auto's crossover: direct below K KiB
//   baton-bench-allreduce --bind core|none       both sides' ranks on a core each, or not bound
//   baton-bench-allreduce --algorithm two_hop    the earlier split / owner-sums / concat form
//   baton-bench-allreduce --unfused  each hop from another rank: a transfer copies the partial
//                                    into a register, then an add reads it (before late 2026-11-27),
//                                    against one reducing transfer that adds as it reads
//   baton-bench-allreduce --algorithm direct     every member sums every input (one hop; small tensors)
//   baton-bench-allreduce --hosts 2  two network namespaces of two ranks, over TCP (root): the
//                                    hierarchical all-reduce against the flat ring and MPI there;
//                                    --link-gbit G limits the link between them (tc tbf)
// BATON_BENCH_TABLE=1 in the environment: every rank prints its actors' table to stderr;
// BATON_BENCH_INLINE=B: RuntimeSettings::inline_payload_bytes (0: no piece goes inline);
// BATON_BENCH_SHARED=0: RuntimeSettings::shared_registers off (no piece read in place);
// BATON_BENCH_IDLE=park|busy_poll: RuntimeSettings::idle_polling (automatic by default).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "json_line.h"
#include "knobs.h"
#include "netns.h"
#include "skip.h"
#include "spawn.h"
#include "baton/actors.h"
#include "baton/graph/collectives.h"
#include "baton/kernels.h"

namespace {

using namespace baton;

std::int64_t iterations_for(std::int64_t bytes, bool quick) {
  // Bytes moved per size; from 64 MiB up 5-8 all-reduces suffice (each takes tens of ms) and
  // keep the whole bench to a few minutes.
  const std::int64_t target = quick ? (std::int64_t{16} << 20) : (std::int64_t{1} << 30);
  return std::clamp<std::int64_t>(target / bytes, quick ? 3 : (bytes >= (std::int64_t{64} << 20) ? 5 : 10),
                                  quick ? 50 : 2000);
}

Plan allreduce_plan(std::uint16_t n, std::int64_t elements, std::int64_t iters, const AllReduceSettings& settings) {
  Plan p;
  std::vector<AllReduceMember> members;
  std::vector<RegisterIndex> ticks, inputs;
  for (std::uint16_t r = 0; r < n; ++r) {
    const std::string sfx = fmt::format("@r{}", r);
    ticks.push_back(p.add_register({.name = "tick" + sfx, .shape = {0}, .dtype = DType::f32, .slots = 1}));
    p.add_actor({.name = "ticks" + sfx, .kind = ActorKind::source, .op = "noop", .where = {.rank = r},
                 .outputs = {ticks.back()}, .pieces = iters});
    inputs.push_back(p.add_register({.name = "grad" + sfx, .shape = {elements}, .dtype = DType::f32, .slots = 1}));
    members.push_back({Placement{.rank = r}, inputs.back(), sfx});
  }
  const auto results = add_allreduce(p, "ar", members, {elements}, DType::f32, 1, settings);
  for (std::uint16_t r = 0; r < n; ++r) {
    // The next tensor only once this rank holds the previous result: back to back.
    p.add_actor({.name = fmt::format("produce@r{}", r), .op = "bench.produce", .where = {.rank = r},
                 .inputs = {{ticks[r]}, {results[r], 1}}, .outputs = {inputs[r]}});
  }
  return p;
}

int worker(std::int64_t bytes, std::int64_t iters, AllReduceSettings settings, bool hierarchical) {
  try {
    auto env = JobEnvironment::from_env();
    if (hierarchical) settings.rank_hosts = env.rank_hosts();
    auto kernels = KernelRegistry::with_builtin_kernels();
    add_collective_kernels(kernels);
    // When each act of this rank's producer began: act k starts once all-reduce k-1 is back,
    // so the time between acts is one all-reduce. The first `warm` are not timed (start-up).
    const std::int64_t warm = std::max<std::int64_t>(3, iters / 5);
    auto starts = std::make_shared<std::vector<bench::Clock::time_point>>();
    starts->reserve(static_cast<std::size_t>(warm + iters));
    kernels.add_fn("bench.produce", DeviceType::cpu, DType::f32,
                   [starts](KernelContext&) { starts->push_back(bench::Clock::now()); });
    JobSettings js;
    bench::apply_knobs(js.runtime);
    auto rep = run_job(allreduce_plan(static_cast<std::uint16_t>(env.world_size), bytes / 4, warm + iters + 1, settings), kernels, env, js);
    const auto timed = std::chrono::duration<double>(starts->at(static_cast<std::size_t>(warm + iters)) -
                                                     starts->at(static_cast<std::size_t>(warm)));
    fmt::print("IDLE {}\nRESULT {:.9f}\n", rep.idle_polling, timed.count() / static_cast<double>(iters));
    if (std::getenv("BATON_BENCH_TABLE")) fmt::print(stderr, "rank {}:\n{}", env.rank, rep.metrics.table());
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-bench-allreduce worker: {}\n", e.what());
    return 1;
  }
}

/// mpirun's options for n ranks on this machine: --oversubscribe only where n is above the cores;
/// each rank on a core of its own or not bound (mpirun's own default binds two ranks to cores).
std::vector<std::string> mpirun_options(int n, bool bind) {
  std::vector<std::string> out{"--allow-run-as-root"};
  if (n > bench::usable_cores()) out.emplace_back("--oversubscribe");
  out.insert(out.end(), {"--bind-to", bind ? "core" : "none"});
  for (const char* o : {"--mca", "btl", "self,vader"}) out.emplace_back(o);
  return out;
}

/// Runs one mpirun of baton-mpi-allreduce-ref (`argv`) and puts its seconds per op in out[bytes].
void run_reference(const std::vector<std::string>& argv, std::int64_t bytes, std::map<std::int64_t, double>& out) {
  auto [code, text] = bench::finish(bench::spawn(argv, {}, true), bench::Clock::now() + std::chrono::seconds(300));
  std::istringstream lines(text);
  std::int64_t b = 0;
  double secs = 0;
  if (code == 0 && (lines >> b >> secs)) {
    out[b] = secs;
  } else {
    fmt::print(stderr, "baton-bench-allreduce: {} exited {} for {} bytes:\n{}\n", fmt::join(argv, " "), code, bytes, text);
  }
}

/// Why the MPI reference cannot run here ("": it can).
std::string mpi_missing(const std::string& ref) {
  if (access(ref.c_str(), X_OK) != 0) return fmt::format("no {} (built when OpenMPI's libopenmpi-dev is installed)", ref);
  return {};
}

/// MPI_Allreduce seconds per op by size (the slowest rank's average), from one mpirun per size;
/// empty if MPI is not there. A size missing from a non-empty result is an mpirun that failed.
std::map<std::int64_t, double> mpi_reference(const std::string& ref, int n, const std::vector<std::int64_t>& sizes,
                                             bool quick, bool bind) {
  std::map<std::int64_t, double> out;
  if (const std::string why = mpi_missing(ref); !why.empty()) {
    fmt::print(stderr, "baton-bench-allreduce: {}\n", why);
    return out;
  }
  for (std::int64_t bytes : sizes) {
    std::vector<std::string> argv{"mpirun"};
    for (auto& o : mpirun_options(n, bind)) argv.push_back(std::move(o));
    for (auto a : {std::string("-np"), std::to_string(n), ref, std::to_string(iterations_for(bytes, quick)),
                   std::to_string(bytes)}) {
      argv.push_back(std::move(a));
    }
    run_reference(argv, bytes, out);
  }
  return out;
}

/// MPI_Allreduce over two hosts (network namespaces) of `per_host` ranks each, over TCP as
/// baton's side is: mpirun in the first namespace, its daemon on the second started through
/// `ip netns exec` (OpenMPI's plm_rsh_agent), btl self,tcp on the veth subnet. Seconds per op by
/// size; empty where mpirun fails.
std::map<std::int64_t, double> mpi_across_hosts(const std::string& ref, const bench::NamespacePair& hosts, int per_host,
                                                const std::vector<std::int64_t>& sizes, bool quick) {
  std::map<std::int64_t, double> out;
  if (!mpi_missing(ref).empty()) return out;
  char dir_template[] = "/tmp/baton-bench-mpi-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) {
    fmt::print(stderr, "baton-bench-allreduce: mkdtemp {} failed: no MPI reference across the hosts\n", dir_template);
    return out;
  }
  const std::string agent = std::string(dir) + "/agent.sh", hostfile = std::string(dir) + "/hosts";
  {
    std::ofstream a(agent);
    a << "#!/bin/sh\nhost=$1; shift\ncase $host in " << hosts.address(1) << ") ns=" << hosts.names()[1]
      << ";; *) ns=" << hosts.names()[0] << ";; esac\nexec ip netns exec $ns sh -c \"$*\"\n";
    std::ofstream h(hostfile);
    h << hosts.address(0) << " slots=" << per_host << "\n" << hosts.address(1) << " slots=" << per_host << "\n";
  }
  chmod(agent.c_str(), 0755);
  const int n = 2 * per_host;
  for (std::int64_t bytes : sizes) {
    std::vector<std::string> argv{"ip", "netns", "exec", hosts.names()[0], "mpirun", "--allow-run-as-root",
                                  "--hostfile", hostfile, "-np", std::to_string(n), "--mca", "plm_rsh_agent", agent,
                                  "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", hosts.subnet(),
                                  "--mca", "oob_tcp_if_include", hosts.subnet()};
    // As --oversubscribe does on one host: ranks that outnumber the cores yield when idle.
    if (n > bench::usable_cores()) argv.insert(argv.end(), {"--mca", "mpi_yield_when_idle", "1"});
    argv.insert(argv.end(), {ref, std::to_string(iterations_for(bytes, quick)), std::to_string(bytes)});
    run_reference(argv, bytes, out);
  }
  std::filesystem::remove_all(dir);
  return out;
}

/// What rank 0's idle workers did in the last baton_seconds() (RunReport::idle_polling).
std::string last_idle_polling;

/// One baton all-reduce job of `n` ranks: the slowest rank's seconds per all-reduce, or nullopt.
std::optional<double> baton_seconds(const std::string& self, const std::vector<std::string>& args, int n,
                                    const bench::JobLayout& layout, const bench::Env& env, double* fastest) {
  std::vector<int> every_rank(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) every_rank[static_cast<std::size_t>(r)] = r;
  const auto outs = bench::run_job_outputs(self, args, n, every_rank, env, std::chrono::seconds(300), layout);
  std::vector<double> per_rank;
  for (const auto& [r, out] : outs ? *outs : std::map<int, std::string>{}) {
    if (auto pos = out.find("RESULT "); pos != std::string::npos) per_rank.push_back(std::stod(out.substr(pos + 7)));
    if (auto idle = out.find("IDLE "); r == 0 && idle != std::string::npos) {
      last_idle_polling = out.substr(idle + 5, out.find('\n', idle) - idle - 5);
    }
  }
  if (static_cast<int>(per_rank.size()) != n) {
    fmt::print(stderr, "baton-bench-allreduce: {} of {} ranks reported a time\n", per_rank.size(), n);
    return std::nullopt;
  }
  if (fastest != nullptr) *fastest = *std::min_element(per_rank.begin(), per_rank.end());
  return *std::max_element(per_rank.begin(), per_rank.end());
}

std::string size_name(std::int64_t b) {
  if (b >= (std::int64_t{1} << 20)) return fmt::format("{}MiB", b >> 20);
  return fmt::format("{}KiB", b >> 10);
}

/// --hosts 2: two hosts (network namespaces joined by a veth pair) of two ranks each, everything
/// over TCP (UCX_TLS=tcp: UCX would otherwise pick shared memory between namespaces of one
/// machine), baton's hierarchical all-reduce against its flat ring and against MPI_Allreduce
/// across the same namespaces. One line per size: allreduce_hier_{size}_2x2.
int across_two_hosts(const std::string& self, const std::string& ref, const std::vector<std::string>& knobs, bool quick,
                     bool reference, std::int64_t min_bytes, std::int64_t max_bytes, double link_gbit) {
  bench::NamespacePair hosts;
  if (!hosts.ok()) return bench::skip("baton-bench-allreduce --hosts 2", hosts.why_not());
  if (link_gbit > 0) {
    if (const std::string why = hosts.limit_link(link_gbit); !why.empty()) {
      fmt::print(stderr, "baton-bench-allreduce --link-gbit: {}\n", why);
      return 1;
    }
  }
  constexpr int per_host = 2, n = 2 * per_host;
  std::vector<std::int64_t> sizes;
  for (std::int64_t b = std::max<std::int64_t>(min_bytes, 64 << 10); b <= std::min<std::int64_t>(max_bytes, std::int64_t{64} << 20);
       b *= 4) {
    sizes.push_back(b);
  }
  if (quick) sizes = {std::int64_t{1} << 20};
  bench::load().set_own_threads(n);
  const auto mpi = reference ? mpi_across_hosts(ref, hosts, per_host, sizes, quick) : std::map<std::int64_t, double>{};
  const std::string missing = reference ? mpi_missing(ref) : std::string();
  const bench::JobLayout layout{.hosts = hosts.names(), .ranks_per_host = per_host, .server_address = hosts.address(0)};
  const bench::Env tcp{{"UCX_TLS", "tcp"}};
  const double factor = 2.0 * (n - 1) / n;
  int failures = 0;
  for (std::int64_t bytes : sizes) {
    const std::int64_t iters = iterations_for(bytes, quick);
    std::vector<std::string> args = knobs;
    args.insert(args.end(), {"--worker", std::to_string(bytes), std::to_string(iters)});
    const std::string case_name = fmt::format("allreduce_hier_{}_2x2{}", size_name(bytes),
                                              link_gbit > 0 ? fmt::format("_{}gbit", link_gbit) : "");
    const auto flat = baton_seconds(self, args, n, layout, tcp, nullptr);
    args.push_back("--hierarchical");
    const auto hier = baton_seconds(self, args, n, layout, tcp, nullptr);
    if (!flat || !hier) {
      fmt::print(stderr, "baton-bench-allreduce: case {} failed: no time from the {} all-reduce\n", case_name,
                 !flat ? "flat" : "hierarchical");
      ++failures;
      continue;
    }
    auto busbw = [&](double secs) { return static_cast<double>(bytes) / secs * factor / 1e9; };
    bench::JsonLine line("allreduce", case_name);
    line.add("value", busbw(*hier)).add("unit", "GB/s busbw").better(bench::Better::higher).add("bytes", bytes)
        .add("ranks", n).add("hosts", 2)
        .add("iterations", iters).add("transport", "tcp (UCX_TLS=tcp; MPI btl self,tcp)")
        .add("stat", "the slowest rank's time per all-reduce, averaged over the iterations (every side)")
        .add("us_per_op", *hier * 1e6).add("flat_ring", busbw(*flat)).add("flat_ring_us_per_op", *flat * 1e6)
        .compare("hierarchical_over_flat", busbw(*hier), busbw(*flat)).add("oversubscribed", n > bench::usable_cores())
        .add("link", link_gbit > 0 ? fmt::format("veth limited to {} Gbit/s each way (tc tbf)", link_gbit)
                                   : std::string("veth, not limited"));
    if (auto it = mpi.find(bytes); it != mpi.end()) {
      line.add("reference", busbw(it->second)).add("reference_name", "OpenMPI MPI_Allreduce across the namespaces (tcp)")
          .compare("ratio", busbw(*hier), busbw(it->second)).compare("flat_ratio", busbw(*flat), busbw(it->second))
          .add("reference_us_per_op", it->second * 1e6);
    } else if (reference && missing.empty()) {
      fmt::print(stderr, "baton-bench-allreduce: case {}: the MPI reference failed\n", case_name);
      line.add("reference_failed", "mpirun of baton-mpi-allreduce-ref across the namespaces failed (stderr)");
      ++failures;
    } else if (reference) {
      line.add("reference_missing", missing);
    }
    line.print();
  }
  if (failures > 0) return 1;
  return missing.empty() ? 0 : bench::skip("baton-bench-allreduce --hosts 2's MPI reference", missing);
}

/// What the command line asked for.
struct Options {
  bool quick = false, reference = true, hierarchical = false, across_hosts = false;
  double link_gbit = 0;
  std::int64_t worker_bytes = -1, worker_iters = 0;
  AllReduceSettings settings;
  /// --algorithm auto (the default): the ring, and direct below the size training would use.
  bool by_size = true;
  std::optional<std::int64_t> direct_below;  // --direct-below-kib
  std::optional<bool> bind;                  // --bind core|none; unset: core where the ranks fit the cores
  std::vector<int> ranks;
  std::int64_t min_bytes = std::int64_t{1} << 10, max_bytes = std::int64_t{256} << 20;
};

/// Parses argv into `o`; -1 to go on, else the exit code (usage printed).
int parse(int argc, char** argv, Options& o) {
  auto usage = [](int code) {
    fmt::print(stderr,
               "usage: baton-bench-allreduce [--quick] [--no-reference] [--algorithm auto|ring|two_hop|direct]\n"
               "                             [--direct-below-kib K] [--bind core|none] [--unfused]\n"
               "                             [--segment-kib K] [--max-segments S] [--ranks N]... [--min-kib A]\n"
               "                             [--max-mib B] [--hosts 2 [--link-gbit G]] [--allow-load]\n{}",
               bench::allow_load_usage);
    return code;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--quick") {
      o.quick = true;
    } else if (a == "--no-reference") {
      o.reference = false;
    } else if (a == "--algorithm" && has_value) {
      const std::string alg = argv[++i];
      if (alg != "auto" && alg != "ring" && alg != "two_hop" && alg != "direct") {
        fmt::print(stderr, "baton-bench-allreduce: --algorithm {}: auto, ring, two_hop or direct\n", alg);
        return 2;
      }
      o.by_size = alg == "auto";
      o.settings.algorithm = alg == "direct" ? AllReduceAlgorithm::direct
                             : alg == "two_hop" ? AllReduceAlgorithm::two_hop
                                                : AllReduceAlgorithm::ring;
    } else if (a == "--direct-below-kib" && has_value) {
      o.direct_below = std::stoll(argv[++i]) << 10;
    } else if (a == "--direct-below-bytes" && has_value) {  // how the driver tells its ranks
      o.direct_below = std::stoll(argv[++i]);
    } else if (a == "--bind" && has_value) {
      const std::string b = argv[++i];
      if (b != "core" && b != "none") {
        fmt::print(stderr, "baton-bench-allreduce: --bind {}: core or none\n", b);
        return 2;
      }
      o.bind = b == "core";
    } else if (a == "--unfused") {
      o.settings.fuse_receive_add = false;
    } else if (a == "--segment-kib" && has_value) {
      o.settings.segment_bytes = std::stoll(argv[++i]) << 10;
    } else if (a == "--max-segments" && has_value) {
      o.settings.max_segments = std::stoll(argv[++i]);
    } else if (a == "--ranks" && has_value) {
      o.ranks.push_back(std::stoi(argv[++i]));
    } else if (a == "--min-kib" && has_value) {
      o.min_bytes = std::stoll(argv[++i]) << 10;
    } else if (a == "--max-mib" && has_value) {
      o.max_bytes = std::stoll(argv[++i]) << 20;
    } else if (a == "--link-gbit" && has_value) {
      o.link_gbit = std::stod(argv[++i]);
    } else if (a == "--hierarchical") {
      o.hierarchical = true;
    } else if (a == "--hosts" && has_value) {
      o.across_hosts = std::stoi(argv[++i]) == 2;
      if (!o.across_hosts) {
        fmt::print(stderr, "baton-bench-allreduce: --hosts {}: 2 (two network namespaces) is what it makes\n", argv[i]);
        return 2;
      }
    } else if (a == "--worker" && i + 2 < argc) {
      o.worker_bytes = std::stoll(argv[++i]);
      o.worker_iters = std::stoll(argv[++i]);
    } else {
      return usage(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  // auto: as compile_training chooses for gradient buckets (the crossovers measured, collectives.h).
  o.settings.direct_below_bytes = o.direct_below.value_or(
      o.by_size ? (o.across_hosts ? gradient_direct_below_bytes : gradient_direct_below_bytes_one_host) : 0);
  return -1;
}

/// --algorithm's name for `a`.
const char* algorithm_name(AllReduceAlgorithm a) {
  switch (a) {
    case AllReduceAlgorithm::ring: return "ring";
    case AllReduceAlgorithm::direct: return "direct";
    case AllReduceAlgorithm::two_hop: return "two_hop";
  }
  return "?";
}

/// The algorithm `settings` use for a tensor of `bytes`.
const char* algorithm_for(std::int64_t bytes, const AllReduceSettings& settings) {
  const bool by_size = settings.algorithm == AllReduceAlgorithm::ring && bytes < settings.direct_below_bytes;
  return algorithm_name(by_size ? AllReduceAlgorithm::direct : settings.algorithm);
}

/// Every rank on this host, `o.ranks` ranks at a time: one line per size and rank count.
int on_one_host(const std::string& self, const std::string& ref, const std::vector<std::string>& knobs,
                const Options& o) {
  std::vector<std::int64_t> sizes;
  if (o.quick) {
    sizes = {std::int64_t{1} << 10, std::int64_t{1} << 20, std::int64_t{4} << 20};
  } else {
    for (std::int64_t b = o.min_bytes; b <= o.max_bytes; b *= 4) sizes.push_back(b);
  }
  const std::vector<int> ranks = !o.ranks.empty() ? o.ranks : o.quick ? std::vector<int>{2} : std::vector<int>{2, 4};
  const AllReduceSettings& settings = o.settings;
  const std::string missing = o.reference ? mpi_missing(ref) : std::string();
  int failures = 0;
  for (int n : ranks) {
    bench::load().set_own_threads(n);  // every rank keeps a worker busy
    // As mpirun binds MPI's ranks (to a core each where they fit), so both sides alike.
    const bool bind = o.bind.value_or(n <= bench::usable_cores());
    const auto mpi = o.reference ? mpi_reference(ref, n, sizes, o.quick, bind) : std::map<std::int64_t, double>{};
    const bench::Env env{{"BATON_BIND_TO", bind ? "core" : "none"}};
    for (std::int64_t bytes : sizes) {
      const std::int64_t iters = iterations_for(bytes, o.quick);
      std::vector<std::string> args = knobs;
      args.insert(args.end(), {"--worker", std::to_string(bytes), std::to_string(iters)});
      // Each rank's time per all-reduce; the slowest rank's is the figure.
      double fastest = 0;
      const std::string case_name = fmt::format("allreduce_busbw_{}_{}ranks", size_name(bytes), n);
      const auto timed = baton_seconds(self, args, n, {}, env, &fastest);
      if (!timed) {
        fmt::print(stderr, "baton-bench-allreduce: case {} failed: no time for {} bytes over {} ranks\n", case_name,
                   bytes, n);
        ++failures;
        continue;
      }
      const double secs = *timed;
      const double factor = 2.0 * (n - 1) / n;
      const double busbw = static_cast<double>(bytes) / secs * factor / 1e9;
      const std::string algorithm = algorithm_for(bytes, settings);
      bench::JsonLine line("allreduce", case_name);
      line.add("value", busbw).add("unit", "GB/s busbw").better(bench::Better::higher).add("bytes", bytes).add("ranks", n)
          .add("iterations", iters)
          .add("stat", "the slowest rank's time per all-reduce, averaged over the iterations (both sides)")
          .add("us_per_op", secs * 1e6).add("fastest_rank_us_per_op", fastest * 1e6)
          .add("oversubscribed", n > bench::usable_cores()).add("algorithm", algorithm)
          .add("chosen_by", o.by_size ? fmt::format("size (direct below {} bytes)", settings.direct_below_bytes)
                                      : std::string("--algorithm"))
          .add("bound", bind ? "a core per rank, both sides" : "not bound, both sides")
          .add("idle_polling", last_idle_polling)
          .add("hop", settings.fuse_receive_add && (algorithm == "ring" || n == 2) ? "added as received (transfer.add)"
                                                                                    : "received, then added");
      if (algorithm == "ring") {
        line.add("segments", allreduce_segments(bytes / 4, DType::f32, n, settings))
            .add("segment_kib", settings.segment_bytes >> 10);
      }
      line.add("inline_payload_bytes", static_cast<std::int64_t>(bench::inline_payload_bytes()))
          .add("shared_registers", bench::shared_registers());
      if (auto it = mpi.find(bytes); it != mpi.end()) {
        const double ref_busbw = static_cast<double>(bytes) / it->second * factor / 1e9;
        line.add("reference", ref_busbw).add("reference_name", "OpenMPI MPI_Allreduce (vader shm)")
            .compare("ratio", busbw, ref_busbw).add("reference_us_per_op", it->second * 1e6)
            .add("reference_mpirun", fmt::format("{}", fmt::join(mpirun_options(n, bind), " ")));
      } else if (o.reference && missing.empty()) {
        fmt::print(stderr, "baton-bench-allreduce: case {}: the MPI reference failed\n", case_name);
        line.add("reference_failed", "mpirun of baton-mpi-allreduce-ref failed (stderr)");
        ++failures;
      } else if (o.reference) {
        line.add("reference_missing", missing);
      }
      line.print();
    }
  }
  if (failures > 0) return 1;
  return missing.empty() ? 0 : bench::skip("baton-bench-allreduce's MPI reference", missing);
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 2);
  Options o;
  if (const int code = parse(argc, argv, o); code >= 0) return code;
  if (o.worker_bytes >= 0) return worker(o.worker_bytes, o.worker_iters, o.settings, o.hierarchical);

  char self_buf[4096] = {};
  ssize_t len = readlink("/proc/self/exe", self_buf, sizeof self_buf - 1);
  const std::string self = len > 0 ? std::string(self_buf, static_cast<std::size_t>(len)) : argv[0];
  const std::string ref = self.substr(0, self.rfind('/') + 1) + "baton-mpi-allreduce-ref";
  const AllReduceSettings& settings = o.settings;
  std::vector<std::string> knobs{"--algorithm", algorithm_name(settings.algorithm), "--direct-below-bytes",
                                 std::to_string(settings.direct_below_bytes), "--segment-kib",
                                 std::to_string(settings.segment_bytes >> 10), "--max-segments",
                                 std::to_string(settings.max_segments)};
  if (!settings.fuse_receive_add) knobs.push_back("--unfused");
  if (o.across_hosts) return across_two_hosts(self, ref, knobs, o.quick, o.reference, o.min_bytes, o.max_bytes, o.link_gbit);
  return on_one_host(self, ref, knobs, o);
}
