// End to end: the models baton-train ships learn real data.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "models.h"
#include "skip.h"

using namespace baton;

namespace {

std::pair<TrainingJob, RunReport> train(Graph& g, Value loss, TrainConfig cfg) {
  TrainingJob job = compile_training(g, loss, cfg);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(30'000);
  Runtime rt(job.plan, job.kernels, rs);
  RunReport report = rt.run();
  return {std::move(job), report};
}

/// The share of `heldout`'s rows the MLP of `shape` with `params` classifies right.
double heldout_accuracy(const data::Dataset& heldout, const models::MlpShape& shape, const ParameterStore& params) {
  Graph eval(1);
  Value logits = models::mlp(eval, heldout.rows(), shape);
  Tensor out = evaluate(eval, {{"x", heldout.features}, {"label", heldout.labels}}, {logits}, params)[0];
  auto l = out.data<float>();
  auto y = heldout.labels.data<std::int32_t>();
  std::int64_t right = 0;
  for (std::int64_t i = 0; i < heldout.rows(); ++i) {
    auto row = l.subspan(static_cast<std::size_t>(i * 10), 10);
    if (std::max_element(row.begin(), row.end()) - row.begin() == y[static_cast<std::size_t>(i)]) ++right;
  }
  return static_cast<double>(right) / static_cast<double>(heldout.rows());
}

}  // namespace

TEST_CASE("Training.MlpOnDigitsReaches97PercentHeldOut" * doctest::timeout(120)) {
  // scripts/run.sh fetches the data set before the tests; without it this fails and says how.
  std::string path = data::find_digits_file();
  auto [train_set, heldout] = data::split(data::load_digits(path), 0.2, 1);
  auto train_ptr = std::make_shared<const data::Dataset>(std::move(train_set));
  models::MlpShape shape;  // 64-256-256-10
  Graph g(1);
  Value logits = models::mlp(g, 32, shape);
  Value loss = softmax_cross_entropy(logits, g.find("label"));
  TrainConfig cfg;
  cfg.steps = 1000;
  cfg.microbatches = 2;
  cfg.optimizer = optim::adam(1e-3);
  cfg.data = {{"digits", data::batch_source(train_ptr, 64, 2, 1), {"x", "label"}}};
  auto [job, report] = train(g, loss, cfg);
  auto losses = job.losses->per_step();
  REQUIRE(losses.size() == 1000);
  CHECK(losses.back() < 0.1 * losses.front());

  const double accuracy = heldout_accuracy(heldout, shape, *job.params);
  MESSAGE("held-out accuracy " << accuracy << " over " << heldout.rows() << " rows");
  // A learning claim, not a rounding bound: 98.05% is what this seed reaches, the same under
  // OPENBLAS_CORETYPE Cooperlake, Haswell and Sandybridge; 97% is 4 of the 359 held-out rows
  // below it, and a model that did not learn sits near 10%.
  CHECK(accuracy >= 0.97);
}

TEST_CASE("Training.SmallGptLearnsTextBelowTheUnigramEntropy" * doctest::timeout(120)) {
  // Any text file will do; Debian's base-files ships the GPL, which is English prose.
  const std::string path = "/usr/share/common-licenses/GPL-3";
  if (!std::filesystem::exists(path)) return test::skip(test::Missing::system_file, path + " is missing (Debian: base-files)");
  auto corpus = std::make_shared<const data::TextCorpus>(data::load_text(path));
  models::GptShape shape{.vocab = corpus->vocab_size(), .seq = 32, .d_model = 64, .heads = 4, .layers = 2};
  Graph g(3);
  Value logits = models::gpt(g, 16, shape);
  Value loss = softmax_cross_entropy(logits, g.find("targets"));
  TrainConfig cfg;
  cfg.steps = 300;
  cfg.optimizer = optim::adam(3e-3);
  cfg.data = {{"text", data::text_source(corpus, 16, 1, 32, 3), {"tokens", "targets"}}};
  auto [job, report] = train(g, loss, cfg);
  auto losses = job.losses->per_step();
  REQUIRE(losses.size() == 300);
  double last = 0;
  for (std::size_t i = losses.size() - 20; i < losses.size(); ++i) last += losses[i] / 20;
  const double unigram = corpus->unigram_entropy_nats();
  MESSAGE("mean loss of the last 20 steps " << last << " nats; unigram entropy " << unigram);
  CHECK(losses.front() > unigram);  // it starts knowing nothing
  // A learning claim: 2.21 against 3.17 nats here (the same to 1e-4 under Cooperlake, Haswell
  // and Sandybridge kernels); half a nat below the unigram entropy is what only context can
  // give, and leaves 0.46 nats of margin.
  CHECK(last < unigram - 0.5);      // and learns context: well below what letter counts give
}

// Gradient compression (TrainConfig::grad_compression, collectives.h): dp 2 whose gradient sums
// travel in bf16 or fp16 learns as dp 2 in f32. Learning claims, compared within one test: the
// relative rounding (bf16 2^-9 a hop, fp16 2^-12; fp16's subnormals, below 6.1e-5, keep fewer
// bits and below 3e-8 nothing) changes each step's gradient by up to about 0.2%, which Adam's
// steps carry on; over hundreds of steps the runs part ways, so they are compared by what they
// learned, not step by step.
TEST_CASE("Training.CompressedGradientsLearnAsF32Ones" * doctest::timeout(300)) {
  auto mean_last = [](const std::vector<double>& losses, std::size_t n) {
    double sum = 0;
    for (std::size_t i = losses.size() - n; i < losses.size(); ++i) sum += losses[i];
    return sum / static_cast<double>(n);
  };
  SUBCASE("mlp on digits") {
    auto [train_set, heldout] = data::split(data::load_digits(data::find_digits_file()), 0.2, 1);
    auto train_ptr = std::make_shared<const data::Dataset>(std::move(train_set));
    models::MlpShape shape;
    std::map<std::string, double> accuracy;
    for (const std::string compression : {"none", "bf16", "fp16"}) {
      Graph g(1);
      Value logits = models::mlp(g, 32, shape);  // before find("label"): it makes the input
      Value loss = softmax_cross_entropy(logits, g.find("label"));
      TrainConfig cfg;
      cfg.steps = 1000;
      cfg.dp = 2;
      cfg.grad_compression = compression;
      cfg.optimizer = optim::adam(1e-3);
      cfg.data = {{"digits", data::batch_source(train_ptr, 64, 2, 1), {"x", "label"}}};
      auto [job, report] = train(g, loss, cfg);
      accuracy[compression] = heldout_accuracy(heldout, shape, *job.params);
      MESSAGE(compression << ": held-out accuracy " << accuracy[compression]);
    }
    // All learn (97%: see Training.MlpOnDigitsReaches97PercentHeldOut), and compression costs at
    // most 4 of the 359 held-out rows (measured: 98.05% for each of the three).
    for (const char* c : {"none", "bf16", "fp16"}) CHECK(accuracy[c] >= 0.97);
    CHECK(std::abs(accuracy["bf16"] - accuracy["none"]) <= 4.0 / 359 + 1e-12);
    CHECK(std::abs(accuracy["fp16"] - accuracy["none"]) <= 4.0 / 359 + 1e-12);
  }
  SUBCASE("gpt on text") {
    const std::string path = "/usr/share/common-licenses/GPL-3";
    if (!std::filesystem::exists(path)) return test::skip(test::Missing::system_file, path + " is missing (Debian: base-files)");
    auto corpus = std::make_shared<const data::TextCorpus>(data::load_text(path));
    models::GptShape shape{.vocab = corpus->vocab_size(), .seq = 32, .d_model = 64, .heads = 4, .layers = 2};
    std::map<std::string, double> last;
    for (const std::string compression : {"none", "bf16", "fp16"}) {
      Graph g(3);
      Value logits = models::gpt(g, 8, shape);
      Value loss = softmax_cross_entropy(logits, g.find("targets"));
      TrainConfig cfg;
      cfg.steps = 300;
      cfg.dp = 2;
      cfg.grad_compression = compression;
      cfg.optimizer = optim::adam(3e-3);
      cfg.data = {{"text", data::text_source(corpus, 16, 2, 32, 3), {"tokens", "targets"}}};
      auto [job, report] = train(g, loss, cfg);
      last[compression] = mean_last(job.losses->per_step(), 20);
      MESSAGE(compression << ": mean loss of the last 20 steps " << last[compression] << " nats");
    }
    // Both learn context (Training.SmallGptLearnsTextBelowTheUnigramEntropy), and within 3% of
    // each other (measured: 2.2077 and 2.2072 nats, 0.02% apart; the margin is for other CPUs'
    // BLAS kernels, whose sums move both runs).
    CHECK(last["none"] < corpus->unigram_entropy_nats() - 0.5);
    CHECK(std::abs(last["bf16"] - last["none"]) <= 0.03 * last["none"]);
    CHECK(std::abs(last["fp16"] - last["none"]) <= 0.03 * last["none"]);
  }
}
