// baton-plan's engine (apps/plan/planner.h): a layout compiled into its real plan, costed and
// run on the virtual clock. What can be checked exactly is: the memory it predicts is the
// memory plan's, which a real run's measured high-water mark reaches; the GPU profiles compile
// onto sim devices; bad layouts are refused naming the flag.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <map>

#include "baton/actors/runtime.h"
#include "planner.h"

using namespace baton;
using namespace baton::planner;

namespace {

Layout small_gpt() {
  Layout l;
  l.model = "gpt";
  l.layers = 2;
  l.d_model = 32;
  l.heads = 2;
  l.seq = 16;
  l.vocab = 64;
  l.global_batch = 8;
  l.micro_batch = 2;
  return l;
}

}  // namespace

TEST_CASE("Planner.ThePredictedMemoryIsThePlansAndBoundsARealRun" * doctest::timeout(280)) {
  // The prediction's bytes are the memory plan's (plan_memory.h) for the plan the layout
  // compiles to; a real run of that plan with measure_memory counts the register bytes in use
  // (written, not yet read by every reader), which the plan's registers at its peak bound on
  // every device. Not equal: a slot's bytes are the plan's from its write to its last reader's
  // ack, and the run counts them only while unread (docs/planning.md).
  for (const auto& [pp, schedule] : {std::pair{1, "1f1b"}, std::pair{2, "1f1b"}, std::pair{2, "gpipe"}}) {
    Layout l = small_gpt();
    l.pp = pp;
    l.schedule = schedule;
    CAPTURE(l.str());
    const Prediction p = predict(l, parse_cluster(fmt::format("cpu:{}", pp)), {.repeats = 1, .keep_acts = true});
    REQUIRE(p.memory.size() >= static_cast<std::size_t>(pp));
    std::int64_t largest = 0;
    for (const DeviceMemory& m : p.memory) largest = std::max(largest, m.total());
    CHECK(p.peak_memory_bytes == largest);
    CHECK(p.fits);
    CHECK(p.step_time_s > 0);
    CHECK(p.tokens_per_s == doctest::Approx(8.0 * 16 / p.step_time_s));

    // The same plan, run: its measured registers against the plan's.
    TrainingJob job = compile(l, DeviceType::cpu, 3);
    const std::vector<DeviceMemory> planned = memory_report(job.plan);
    REQUIRE(planned.size() == p.memory.size());
    for (std::size_t i = 0; i < planned.size(); ++i) CHECK(planned[i].total() == p.memory[i].total());
    RuntimeSettings rs;
    rs.measure_memory = true;
    Runtime rt(job.plan, job.kernels, rs);
    const RunReport report = rt.run();
    std::map<Device, std::int64_t> at_peak;
    for (const DeviceMemory& m : planned) at_peak[m.device] = m.registers_at_peak();
    REQUIRE(report.memory.size() == static_cast<std::size_t>(pp));
    for (const MeasuredMemory& m : report.memory) {
      CAPTURE(m.device.str());
      CHECK(m.peak_bytes > 0);
      CHECK(m.peak_bytes <= at_peak[m.device]);
    }
  }
}

TEST_CASE("Planner.AGpuLayoutCompilesOntoSimDevicesAndPredicts" * doctest::timeout(280)) {
  Layout l = small_gpt();
  l.dtype = "bf16";
  l.pp = 2;
  l.dp = 2;
  const Prediction p = predict(l, parse_cluster("h100-sxm:4"));
  CHECK(p.cluster == "h100-sxm:4");
  CHECK(p.step_time_s > 0);
  CHECK(p.mfu > 0);
  CHECK(p.mfu < 1);
  CHECK(p.fits);
  CHECK(p.bubble_fraction >= 0);
  CHECK(p.bubble_fraction < 1);
  const std::string json = to_json(p);
  for (const char* key : {"\"step_time_s\":", "\"tokens_per_s\":", "\"mfu\":", "\"bubble_fraction\":",
                          "\"peak_memory_bytes\":", "\"fits\":true", "\"dp\":2", "\"pp\":2"}) {
    CHECK_MESSAGE(json.find(key) != std::string::npos, key, " in ", json);
  }
}

TEST_CASE("Planner.ALayoutTheClusterCannotHoldIsRefusedNamingWhy") {
  Layout l = small_gpt();
  l.pp = 2;
  CHECK_THROWS_WITH_AS(predict(l, parse_cluster("cpu:3")), "--dp 1 x --tp 1 x --pp 2 is 2 devices; the cluster has 3",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_cluster("v100:8"), doctest::Contains("no device profile 'v100'; the built-in ones are a100-40gb"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_cluster("h100-sxm"), doctest::Contains("NAME:N"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_cluster("h100-sxm:0"), doctest::Contains("at least one device"), std::invalid_argument);
  l.global_batch = 7;
  CHECK_THROWS_WITH_AS(l.check(), "--global-batch 7 is not a multiple of --dp 1 x --micro-batch 2", std::invalid_argument);
  l = small_gpt();
  l.heads = 3;
  CHECK_THROWS_WITH_AS(l.check(), "--d-model 32 is not a multiple of --heads 3", std::invalid_argument);
  l = small_gpt();
  l.dp = 128;
  l.global_batch = 256;
  CHECK_THROWS_WITH_AS(predict(l, parse_cluster("h100-sxm:128")), doctest::Contains("at most 64 devices for now"),
                       std::invalid_argument);
}

TEST_CASE("Planner.SearchRanksTheLayoutsThatFitAndHoldsWhatIsGiven" * doctest::timeout(280)) {
  Layout base = small_gpt();
  base.dtype = "bf16";
  Cluster c = parse_cluster("h100-sxm:2");
  SearchResult r = search(base, c, {}, {.top = 50});
  REQUIRE(!r.ranked.empty());
  CHECK(r.candidates > 5);
  bool saw_pp = false, saw_dp = false;
  for (std::size_t i = 0; i < r.ranked.size(); ++i) {
    const Prediction& p = r.ranked[i];
    CAPTURE(p.layout.str());
    CHECK(p.fits);
    CHECK(p.layout.dp * p.layout.tp * p.layout.pp == 2);
    CHECK(p.layout.schedule != "2bw");  // another model (one step stale): never chosen for the user
    CHECK(p.layout.zero == 0);          // everything fits without ZeRO or recomputation
    CHECK(p.layout.recompute == "none");
    if (i > 0) CHECK(p.step_time_s >= r.ranked[i - 1].step_time_s);
    saw_pp = saw_pp || p.layout.pp == 2;
    saw_dp = saw_dp || p.layout.dp == 2;
  }
  CHECK(saw_pp);
  CHECK(saw_dp);
  // What the user gives is held fixed.
  SearchFixed f;
  f.pp = 2;
  f.schedule = "gpipe";
  r = search(base, c, f);
  REQUIRE(!r.ranked.empty());
  for (const Prediction& p : r.ranked) {
    CHECK(p.layout.pp == 2);
    CHECK(p.layout.schedule == "gpipe");
  }
  // Under a memory limit that dp 2 without ZeRO misses, the search climbs ZeRO's stages (then
  // recomputation) until it fits, and says the layout with them.
  f = {};
  f.dp = 2;
  f.micro_batch = 2;
  const SearchResult plain = search(base, c, f);
  REQUIRE(plain.ranked.size() == 1);
  c.device.memory_bytes = plain.ranked[0].peak_memory_bytes - 1;
  const SearchResult tight = search(base, c, f);
  REQUIRE(tight.ranked.size() == 1);
  CHECK(tight.ranked[0].fits);
  CHECK(tight.ranked[0].peak_memory_bytes < plain.ranked[0].peak_memory_bytes);
  CHECK((tight.ranked[0].layout.zero > 0 || tight.ranked[0].layout.recompute != "none"));
  c.device.memory_bytes = 1024;
  CHECK(search(base, c, f).ranked.empty());
}
