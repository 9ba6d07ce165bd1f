// baton-xrank-check: one rank of a job that runs a hand-written cross-rank plan
// (tests/xrank_plans.h) with the checking kernels. Started by baton-launch in the
// multi-process and multi-host tests:
//   baton-launch --nproc-per-node 4 -- baton-xrank-check --topology fanout --pieces 2000
// Prints "rank R ok: ..." on success; on failure the reason on stderr and exit code 1.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
#include <optional>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "baton/actors.h"
#include "checking_kernels.h"
#include "xrank_plans.h"

namespace {

/// Resident set size in KiB (/proc/self/statm's second field, in pages).
long rss_kib() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  long size = 0, resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * (sysconf(_SC_PAGESIZE) / 1024) : -1;
}

/// Samples the RSS every `period` on its own thread while a run lasts (the soak test).
class RssSampler {
 public:
  explicit RssSampler(std::chrono::milliseconds period) : thread_([this, period] {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      samples_.push_back(rss_kib());
      cv_.wait_for(lock, period, [&] { return stop_; });
    }
  }) {}
  /// Stops and returns the samples, in time order.
  std::vector<long> finish() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    samples_.push_back(rss_kib());
    return samples_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<long> samples_;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Runs one rank of a cross-rank test plan"};
  baton::test::CrossRankShape shape;
  std::string salt;
  int salt_rank = -1;
  bool print_plan = false;
  app.add_option("--topology", shape.topology, "chain | fanout | fanin | ring")->capture_default_str();
  app.add_option("--pieces", shape.pieces, "pieces every source emits")->capture_default_str();
  app.add_option("--elements", shape.elements, "int64 elements per register")->capture_default_str();
  app.add_option("--slots", shape.slots, "slots per register")->capture_default_str();
  app.add_option("--sleep-us", shape.sleep_us, "sleep in every act (a run that lasts)")->capture_default_str();
  app.add_option("--fail-rank", shape.fail_rank, "the actors on this rank throw at --fail-at");
  app.add_option("--fail-at", shape.fail_at, "the piece at which they throw");
  app.add_option("--salt", salt, "an attribute that makes --salt-rank's plan differ (plan-hash test)");
  app.add_option("--salt-rank", salt_rank, "the rank whose plan gets --salt");
  app.add_flag("--print-plan", print_plan, "print the plan (after insert_transfers) on rank 0");
  double rss_growth = 0;
  app.add_option("--rss-growth", rss_growth,
                 "soak: fail if the resident memory grows by more than this fraction after the first "
                 "fifth of the run (sampled every 100 ms); prints a JSON line of the samples' summary");
  CLI11_PARSE(app, argc, argv);

  std::uint32_t rank = 0;
  try {
    auto env = baton::JobEnvironment::from_env();
    rank = env.rank;
    fmt::print("rank {} pid {}\n", rank, getpid());
    std::fflush(stdout);
    shape.world = static_cast<std::uint16_t>(env.world_size);
    baton::Plan plan = baton::test::cross_rank_plan(shape);
    if (!salt.empty() && static_cast<int>(env.rank) == salt_rank) plan.actors[0].attrs.set("salt", salt);
    if (print_plan && env.rank == 0) fmt::print("{}", baton::insert_transfers(plan).to_text());
    auto kernels = baton::test::checking_registry();
    std::optional<RssSampler> sampler;
    if (rss_growth > 0) sampler.emplace(std::chrono::milliseconds(100));
    baton::RunReport report = baton::run_job(plan, kernels, env);
    if (sampler) {
      // Warm-up: the first fifth of the samples (pools, UCX's buffers and the registers fill).
      // After it, memory must stay flat: no sample above the warm level by more than the bound.
      const std::vector<long> rss = sampler->finish();
      const std::size_t warm_at = rss.size() / 5;
      const long warm = rss[warm_at];
      long peak = warm;
      for (std::size_t i = warm_at; i < rss.size(); ++i) peak = std::max(peak, rss[i]);
      const double growth = warm > 0 ? static_cast<double>(peak - warm) / static_cast<double>(warm) : 0.0;
      fmt::print("{{\"rank\": {}, \"pieces\": {}, \"wall_s\": {:.2f}, \"samples\": {}, \"rss_start_kib\": {}, "
                 "\"rss_warm_kib\": {}, \"rss_peak_after_warm_kib\": {}, \"rss_end_kib\": {}, \"growth\": {:.4f}}}\n",
                 rank, shape.pieces, report.wall_s, rss.size(), rss.front(), warm, peak, rss.back(), growth);
      if (growth > rss_growth) {
        fmt::print(stderr, "rank {}: resident memory grew {:.1f}% after warm-up ({} KiB -> {} KiB), over the {:.1f}% bound\n",
                   rank, 100 * growth, warm, peak, 100 * rss_growth);
        return 1;
      }
    }
    std::uint64_t acts = 0;
    bool all_retired = true;
    for (const auto& a : report.metrics.actors) {
      acts += a.acts;
      all_retired = all_retired && a.activity == baton::ActorActivity::retired;
    }
    for (const auto& r : report.metrics.registers) {
      if (r.max_outstanding > r.slots) {
        fmt::print(stderr, "rank {}: register '{}' had {} slots in use of {}\n", rank, r.name, r.max_outstanding,
                   r.slots);
        return 1;
      }
    }
    if (!all_retired) {
      fmt::print(stderr, "rank {}: the run returned with actors not retired\n", rank);
      return 1;
    }
    fmt::print("rank {} ok: {} actors, {} acts in {:.3f} s\n", rank, report.metrics.actors.size(), acts,
               report.wall_s);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "rank {}: {}\n", rank, e.what());
    return 1;
  }
}
