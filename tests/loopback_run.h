#pragma once
// Runs every rank of a plan as a Runtime in this process, the ranks joined by a LoopbackHub,
// each on its own thread. A rank that fails aborts the others, as the control plane does
// between processes.
#include <algorithm>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/transport/loopback.h"

namespace baton::test {

struct RankResult {
  std::optional<RunReport> report;
  std::string error;
};

/// `plan` after insert_transfers(); the world is the highest rank in it plus one.
/// shares_memory false: the ranks play ranks on different hosts (LoopbackHub).
inline std::vector<RankResult> run_on_loopback(const Plan& plan, const KernelRegistry& kernels,
                                               RuntimeSettings base = {}, bool shares_memory = true) {
  std::uint16_t world = 1;
  for (const auto& a : plan.actors) world = std::max<std::uint16_t>(world, static_cast<std::uint16_t>(a.where.rank + 1));
  transport::LoopbackHub hub(world, shares_memory);
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (std::uint16_t r = 0; r < world; ++r) {
    RuntimeSettings s = base;
    s.rank = r;
    s.link = &hub.link(r);
    runtimes.push_back(std::make_unique<Runtime>(plan, kernels, s));
  }
  hub.start();
  std::vector<RankResult> results(world);
  std::vector<std::thread> threads;
  for (std::uint16_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        results[r].report = runtimes[r]->run();
      } catch (const std::exception& e) {
        results[r].error = e.what();
        for (std::uint16_t o = 0; o < world; ++o) {
          if (o != r) runtimes[o]->abort(fmt::format("rank {} failed: {}", r, e.what()));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  hub.stop();
  return results;
}

}  // namespace baton::test
