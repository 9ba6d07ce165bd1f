// baton-bench-validate: what checking a plan before it runs costs a job at its start.
//
// Every Runtime validates its plan first (validate(), baton/actors/runtime.h): a dry run of the
// handshakes of every rank proves that the plan cannot deadlock. Each case compiles a GPT training
// plan as baton-train does and times validate() with the short progress check (the default: each
// actor's acts of D + 2 iterations of the plan) against the long one it replaced, measured in the
// same run on the same plan (ProgressCheck::tokens: every actor past the plan's slots and delays,
// capped at 20 million acts). "value" is the short check's milliseconds (best of 5), "reference"
// the long one's (one run; it takes seconds), "ratio" reference / value (above 1: the short check
// is faster). Both must give the same verdict; the benchmark fails if they do not.
//
//   baton-bench-validate           GPT d 256, 4 heads, T 128: 4 and 12 layers; pp 2 and 4 in 1F1B
//                                  with 8 micro-batches; tp 2 x dp 2
//   baton-bench-validate --quick   one small case (the CTest smoke run)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "json_line.h"
#include "models.h"

namespace {

using namespace baton;

struct Case {
  std::string name;
  std::int64_t d_model = 256, layers = 4, seq = 128;
  int dp = 1, pp = 1, tp = 1;
  std::int64_t microbatches = 1;
};

TrainingJob compile(const Case& c) {
  auto corpus = std::make_shared<data::TextCorpus>();
  for (int v = 0; v < 64; ++v) corpus->vocab.push_back(static_cast<unsigned char>(' ' + v));
  for (int i = 0; i < 4096; ++i) corpus->ids.push_back((i * 7 + i / 13) % 64);
  const std::int64_t pieces = c.dp * c.microbatches, batch = 2 * pieces;
  Graph g(1);
  Value loss = models::gpt_with_loss(g, batch / pieces,
                                     {.vocab = 64, .seq = c.seq, .d_model = c.d_model, .heads = 4, .layers = c.layers,
                                      .tp = c.tp})
                   .loss;
  TrainConfig cfg;
  cfg.steps = 2;
  cfg.dp = c.dp;
  cfg.pp = c.pp;
  cfg.tp = c.tp;
  cfg.microbatches = c.microbatches;
  cfg.schedule = "1f1b";
  cfg.optimizer = optim::adam(1e-3);
  cfg.data = {{"text", data::text_source(corpus, batch, pieces, c.seq, 1), {"tokens", "targets"}}};
  return compile_training(g, loss, cfg);
}

/// validate()'s refusal, or "" where it accepts; and how long it took, in seconds.
std::pair<std::string, double> timed_validate(const TrainingJob& job, ProgressCheck how) {
  const auto start = std::chrono::steady_clock::now();
  std::string refusal;
  try {
    validate(job.plan, job.kernels, 0, how);
  } catch (const PlanError& e) {
    refusal = e.what();
  }
  return {refusal, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 1);
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else {
      fmt::print(stderr, "usage: baton-bench-validate [--quick] [--allow-load]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  std::vector<Case> cases;
  if (quick) {
    cases = {{.name = "gpt_d64_l2_pp2_1f1b_m4", .d_model = 64, .layers = 2, .seq = 16, .pp = 2, .microbatches = 4}};
  } else {
    cases = {{.name = "gpt_l4"},
             {.name = "gpt_l12", .layers = 12},
             {.name = "gpt_l4_pp2_1f1b_m8", .pp = 2, .microbatches = 8},
             {.name = "gpt_l12_pp4_1f1b_m8", .layers = 12, .pp = 4, .microbatches = 8},
             {.name = "gpt_l4_tp2_dp2", .dp = 2, .tp = 2}};
  }
  int status = 0;
  for (const Case& c : cases) {
    const TrainingJob job = compile(c);
    double best = 1e300;
    std::string verdict;
    for (int r = 0; r < 5; ++r) {
      auto [refusal, s] = timed_validate(job, ProgressCheck::iterations);
      best = std::min(best, s);
      verdict = refusal;
    }
    const auto [long_verdict, long_s] = timed_validate(job, ProgressCheck::tokens);
    if (verdict != long_verdict) {
      fmt::print(stderr, "{}: the two checks disagree:\n  short: '{}'\n  long: '{}'\n", c.name, verdict, long_verdict);
      status = 1;
    }
    bench::JsonLine("validate", c.name)
        .add("value", best * 1e3)
        .add("unit", "ms")
        .better(bench::Better::lower)
        .add("reference", long_s * 1e3)
        .add("reference_name", "ProgressCheck::tokens (the check before 2026-11-26)")
        .compare("ratio", best, long_s)
        .add("actors", static_cast<std::int64_t>(job.plan.actors.size()))
        .add("registers", static_cast<std::int64_t>(job.plan.registers.size()))
        .add("accepted", verdict.empty())
        .print();
  }
  return status;
}
