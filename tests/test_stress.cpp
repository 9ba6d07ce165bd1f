// Invariants under stress: random DAGs (fan-out, fan-in, diamonds), random slot counts 1..4,
// random mappings onto 1..4 worker threads, 10^5 pieces. Every reader checks that each input
// holds the piece it expects before and after lingering over it (so every piece is seen once,
// in order, and no slot is rewritten while it is read); the registers report that no more than
// `slots` pieces were ever outstanding.
#include <doctest/doctest.h>

#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "checking_kernels.h"

using namespace baton;

namespace {

struct RandomDag {
  Plan plan;
  int threads = 0;
};

RandomDag random_dag(std::uint32_t seed, std::int64_t pieces) {
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  RandomDag dag;
  Plan& p = dag.plan;
  const int n_actors = pick(4, 10);
  const int n_sources = pick(1, 2);
  const int n_threads = pick(1, 4);
  dag.threads = n_threads;
  std::vector<RegisterIndex> produced;  // every register so far, in creation order
  for (int i = 0; i < n_actors; ++i) {
    ActorDesc a;
    a.name = fmt::format("a{}", i);
    a.op = "pattern";
    a.dtype = i64;
    a.where.stream = static_cast<std::uint8_t>(pick(0, n_threads - 1));
    std::vector<std::int64_t> in_regs, out_regs;
    if (i < n_sources) {
      a.kind = ActorKind::source;
      a.pieces = pieces;
    } else {
      // 1..3 distinct inputs among everything produced so far: fan-in, and with shared
      // producers, diamonds; one register read by several actors is fan-out.
      int n_in = std::min<int>(pick(1, 3), static_cast<int>(produced.size()));
      std::vector<RegisterIndex> pool = produced;
      std::shuffle(pool.begin(), pool.end(), rng);
      for (int k = 0; k < n_in; ++k) {
        a.inputs.push_back({pool[static_cast<std::size_t>(k)]});
        in_regs.push_back(pool[static_cast<std::size_t>(k)]);
      }
    }
    int n_out = (i == n_actors - 1) ? 0 : pick(1, 2);
    if (a.kind == ActorKind::source) n_out = std::max(n_out, 1);
    for (int k = 0; k < n_out; ++k) {
      auto r = p.add_register({.name = fmt::format("a{}.out{}", i, k), .shape = {test::pattern_elements},
                               .dtype = i64, .slots = pick(1, 4)});
      a.outputs.push_back(r);
      out_regs.push_back(r);
      produced.push_back(r);
    }
    a.attrs.set("in_regs", in_regs).set("out_regs", out_regs).set("linger_every", std::int64_t{pick(5, 50)});
    p.add_actor(std::move(a));
  }
  return dag;
}

void run_and_check(std::uint32_t seed, std::int64_t pieces, ExecutionMode mode) {
  auto dag = random_dag(seed, pieces);
  auto kernels = test::checking_registry();
  RuntimeSettings s;
  s.mode = mode;
  s.stall_timeout = std::chrono::milliseconds(20'000);
  INFO("seed " << seed << ", " << dag.threads << " threads, plan:\n" << dag.plan.to_text());
  Runtime rt(dag.plan, kernels, s);
  RunReport report;
  try {
    report = rt.run();
  } catch (const JobError& e) {
    FAIL(e.what());
  }
  for (const auto& a : report.metrics.actors) {
    CHECK_MESSAGE(a.acts == static_cast<std::uint64_t>(pieces), a.name);
    CHECK(a.activity == ActorActivity::retired);
  }
  for (const auto& r : report.metrics.registers) {
    CHECK_MESSAGE(r.written == pieces, r.name);
    CHECK_MESSAGE(r.freed == pieces, r.name);
    CHECK_MESSAGE(r.max_outstanding <= r.slots, r.name);
    CHECK_MESSAGE(r.max_outstanding >= 1, r.name);
  }
}

}  // namespace

TEST_CASE("Stress.RandomDags.Threaded.HundredThousandPieces" * doctest::timeout(240)) {
  for (std::uint32_t seed = 1; seed <= 6; ++seed) run_and_check(seed, 100'000, ExecutionMode::threaded);
}

TEST_CASE("Stress.RandomDags.Threaded.ManyShapes" * doctest::timeout(240)) {
  for (std::uint32_t seed = 100; seed < 160; ++seed) run_and_check(seed, 2'000, ExecutionMode::threaded);
}

TEST_CASE("Stress.RandomDags.Deterministic" * doctest::timeout(240)) {
  for (std::uint32_t seed = 1000; seed < 1100; ++seed) run_and_check(seed, 1'000, ExecutionMode::deterministic);
}
