// baton-bench-plan: how well baton-plan predicts what a layout does, on this machine.
//
// A held-out set of layouts of the MLP and a small GPT on in-process CPU devices (one or two:
// this machine has two cores): micro-batches, dp with ZeRO 0-3, pp 2 with every schedule, tp 2,
// recomputation, two worker threads. For each, baton-plan's prediction (the layout's real plan
// on the virtual clock, each kernel timed on its shapes: planner.h) against the same plan
// trained for real (seconds per step in the steady state), in the same run. Nothing of the
// real runs feeds the prediction: the kernels are timed alone, the handshakes and the schedule
// are the simulation's.
//
// One line per layout: "value" is the prediction's error in percent of the measured step time
// (better lower), with "predicted_s" and "measured_s". Then per model and overall: the mean and
// worst absolute error, Kendall's tau between predicted and measured step times (1: the
// prediction orders the layouts as the runs do), and the pick: the measured step time of the
// layout predicted fastest over the measured fastest (1: the prediction picked the best).
//
//   baton-bench-plan           every layout (about 40; a few minutes)
//   baton-bench-plan --quick   four layouts (the CTest smoke run)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "json_line.h"
#include "planner.h"

namespace {

using namespace baton;
using planner::Layout;

Layout mlp() {
  Layout l;
  l.model = "mlp";
  l.layers = 4;
  l.hidden = 512;
  l.global_batch = 128;
  return l;
}

Layout gpt() {
  Layout l;
  l.model = "gpt";
  l.layers = 2;
  l.d_model = 64;
  l.heads = 4;
  l.seq = 64;
  l.vocab = 256;
  l.global_batch = 16;
  return l;
}

std::vector<Layout> layouts(const Layout& base, bool quick) {
  std::vector<Layout> out;
  const auto with = [&](auto change) {
    Layout l = base;
    change(l);
    out.push_back(l);
  };
  const std::int64_t B = base.global_batch;
  if (quick) {
    with([](Layout&) {});
    with([&](Layout& l) { l.pp = 2, l.micro_batch = B / 4; });
    return out;
  }
  for (std::int64_t m : {1, 2, 4, 8}) with([&](Layout& l) { l.micro_batch = B / m; });
  for (int zero : {0, 1, 2, 3}) with([&](Layout& l) { l.dp = 2, l.zero = zero; });
  with([&](Layout& l) { l.dp = 2, l.micro_batch = B / 4; });
  for (const char* s : {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "2bw"}) {
    with([&](Layout& l) {
      l.pp = 2, l.schedule = s, l.micro_batch = B / 4;
      if (l.schedule == "interleaved") l.virtual_stages = 2;
    });
  }
  with([&](Layout& l) { l.pp = 2, l.micro_batch = B / 8; });
  with([&](Layout& l) { l.pp = 2, l.schedule = "gpipe", l.micro_batch = B / 8; });
  with([&](Layout& l) { l.tp = 2; });
  with([&](Layout& l) { l.tp = 2, l.micro_batch = B / 2; });
  with([&](Layout& l) { l.threads = 2, l.micro_batch = B / 4; });
  if (base.model != "mlp") {
    with([&](Layout& l) { l.recompute = "selective"; });
    with([&](Layout& l) { l.recompute = "full"; });
    with([&](Layout& l) { l.pp = 2, l.recompute = "full", l.micro_batch = B / 4; });
  }
  return out;
}

double kendall_tau(const std::vector<double>& a, const std::vector<double>& b) {
  double concordant = 0, discordant = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    for (std::size_t j = i + 1; j < a.size(); ++j) {
      const double s = (a[i] - a[j]) * (b[i] - b[j]);
      if (s > 0) concordant += 1;
      if (s < 0) discordant += 1;
    }
  }
  const double n = concordant + discordant;
  return n > 0 ? (concordant - discordant) / n : 1.0;
}

struct Result {
  std::string model;
  double predicted = 0, measured = 0;
};

void summary(const std::string& name, const std::vector<Result>& results) {
  std::vector<double> predicted, measured, errors;
  for (const Result& r : results) {
    predicted.push_back(r.predicted);
    measured.push_back(r.measured);
    errors.push_back(std::abs(r.predicted - r.measured) / r.measured * 100);
  }
  if (errors.empty()) return;
  double mean = 0;
  for (double e : errors) mean += e;
  mean /= static_cast<double>(errors.size());
  const auto pick = std::min_element(predicted.begin(), predicted.end()) - predicted.begin();
  const double best = *std::min_element(measured.begin(), measured.end());
  bench::JsonLine(std::string("plan"), "summary_" + name)
      .add("value", mean)
      .add("unit", "% mean absolute error of the step time")
      .better(bench::Better::lower)
      .add("worst_error_pct", *std::max_element(errors.begin(), errors.end()))
      .add("kendall_tau", kendall_tau(predicted, measured))
      .add("pick_over_best", measured[static_cast<std::size_t>(pick)] / best)
      .add("layouts", static_cast<std::int64_t>(errors.size()))
      .print();
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 2);
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a != "--allow-load") {
      fmt::print(stderr, "usage: baton-bench-plan [--quick] [--allow-load]\n");
      return 2;
    }
  }
  const std::int64_t warm = 2;
  std::vector<Result> all;
  for (const Layout& base : {mlp(), gpt()}) {
    std::vector<Result> mine;
    for (const Layout& l : layouts(base, quick)) {
      const int devices = l.dp * l.tp * l.pp;
      // This machine's timings vary from run to run by a tenth: each side is the median of three
      // (a prediction times the kernels anew each time).
      const int runs = quick ? 1 : 3;
      std::vector<planner::Prediction> predictions;
      std::vector<planner::Measured> runs_measured;
      for (int k = 0; k < runs; ++k) predictions.push_back(planner::predict(l, planner::parse_cluster(fmt::format("cpu:{}", devices))));
      std::sort(predictions.begin(), predictions.end(), [](const auto& a, const auto& b) { return a.step_time_s < b.step_time_s; });
      const planner::Prediction& p = predictions[predictions.size() / 2];
      // About half a second of steady steps (at least ten), as predicted.
      const std::int64_t steps = quick ? 5 : warm + std::max<std::int64_t>(10, static_cast<std::int64_t>(0.5 / p.step_time_s));
      for (int k = 0; k < runs; ++k) runs_measured.push_back(planner::measure(l, steps, warm));
      std::sort(runs_measured.begin(), runs_measured.end(), [](const auto& a, const auto& b) { return a.step_s < b.step_s; });
      const planner::Measured& run = runs_measured[runs_measured.size() / 2];
      const double measured = run.step_s;
      const double error = (p.step_time_s - measured) / measured * 100;
      bench::JsonLine("plan", l.str())
          .add("value", std::abs(error))
          .add("unit", "% error of the predicted step time")
          .better(bench::Better::lower)
          .add("signed_error_pct", error)
          .add("predicted_s", p.step_time_s)
          .add("measured_s", measured)
          .add("predicted_act_s", p.act_s_per_step)
          .add("measured_kernel_s", run.kernel_s_per_step)
          .add("bubble_fraction", p.bubble_fraction)
          .add("peak_memory_bytes", p.peak_memory_bytes)
          .add("simulate_wall_s", p.wall_s)
          .add("actors", p.actors)
          .print();
      mine.push_back({base.model, p.step_time_s, measured});
    }
    summary(base.model, mine);
    all.insert(all.end(), mine.begin(), mine.end());
  }
  summary("all", all);
  return 0;
}
