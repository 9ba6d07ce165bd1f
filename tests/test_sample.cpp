// Text from a trained model (apps/train/sample.h, baton-train --sample): the draws follow the
// softmax, the same seed gives the same text, greedy sampling from a model that memorised a
// repeating text reproduces it (in-process and through baton-train), and bad settings and
// flags are refused with a clear error.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "models.h"
#include "mp/proc.h"
#include "sample.h"
#include "skip.h"

using namespace baton;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// One line that repeats: every 16-character window of it occurs once per period, so a model
// with a context of 16 can know the next character from any window that has passed the
// ambiguous "the " (which starts both "the quick" and "the lazy").
const std::string line = "the quick brown fox jumps over the lazy dog. ";

/// A scratch directory for this test binary, removed at exit.
const fs::path& scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / fmt::format("baton-sample-tests-{}", ::getpid());
    fs::create_directories(d);
    return d;
  }();
  static const struct Cleanup {
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup;
  return dir;
}

/// The repeating text, 60 periods, as a file.
std::string repeating_text_file() {
  const fs::path p = scratch() / "fox.txt";
  std::ofstream out(p, std::ios::binary);
  for (int i = 0; i < 60; ++i) out << line;
  return p.string();
}

std::vector<std::int32_t> encode(const data::TextCorpus& text, const std::string& s) {
  std::vector<std::int32_t> ids;
  for (char c : s) {
    auto it = std::find(text.vocab.begin(), text.vocab.end(), static_cast<unsigned char>(c));
    REQUIRE(it != text.vocab.end());
    ids.push_back(static_cast<std::int32_t>(it - text.vocab.begin()));
  }
  return ids;
}

std::string decode(const data::TextCorpus& text, const std::vector<std::int32_t>& ids) {
  std::string s;
  for (std::int32_t id : ids) s += static_cast<char>(text.vocab.at(static_cast<std::size_t>(id)));
  return s;
}

models::GptShape shape_for(std::int64_t vocab) {
  return {.vocab = vocab, .seq = 16, .d_model = 32, .heads = 2, .layers = 1};
}

/// Runs baton-train with `args`; returns {exit code, stdout, stderr}.
struct Outcome {
  int code;
  std::string out, err;
};
Outcome train_cli(const std::vector<std::string>& args, std::chrono::seconds deadline = 120s) {
  std::vector<std::string> argv{std::string(BATON_BIN_DIR) + "/baton-train"};
  argv.insert(argv.end(), args.begin(), args.end());
  test::Proc p(argv);
  const int code = p.wait(deadline);
  return {code, p.out(), p.err()};
}

}  // namespace

TEST_CASE("Sample.DrawFollowsTheSoftmax") {
  // logits ln(1), ln(2), ln(1): probabilities 1/4, 1/2, 1/4, so the distribution function steps
  // at 0.25 and 0.75.
  const float logits[3] = {0.0f, std::log(2.0f), 0.0f};
  CHECK(sample::draw(logits, 3, 1.0, 0.0) == 0);
  CHECK(sample::draw(logits, 3, 1.0, 0.24) == 0);
  CHECK(sample::draw(logits, 3, 1.0, 0.26) == 1);
  CHECK(sample::draw(logits, 3, 1.0, 0.74) == 1);
  CHECK(sample::draw(logits, 3, 1.0, 0.76) == 2);
  CHECK(sample::draw(logits, 3, 1.0, 0.999999) == 2);
  // Temperature 0.5 squares the odds: 1/6, 4/6, 1/6.
  CHECK(sample::draw(logits, 3, 0.5, 0.16) == 0);
  CHECK(sample::draw(logits, 3, 0.5, 0.18) == 1);
  CHECK(sample::draw(logits, 3, 0.5, 0.84) == 2);
  // Greedy: the largest, the first of equals, whatever u is.
  CHECK(sample::draw(logits, 3, 0.0, 0.99) == 1);
  const float tie[3] = {1.0f, 5.0f, 5.0f};
  CHECK(sample::draw(tie, 3, 0.0, 0.5) == 1);
}

TEST_CASE("Sample.TheSameSeedGivesTheSameText" * doctest::timeout(120)) {
  // Untrained weights: the draws are near uniform over the 28 characters, so two seeds agree on
  // all 40 tokens with a chance of about 28^-40.
  const std::int64_t vocab = 28;
  const models::GptShape shape = shape_for(vocab);
  Graph init(7);
  models::gpt(init, 1, shape);
  auto params = ParameterStore::initialize(init);
  auto build = [&](Graph& g) { return models::gpt(g, 1, shape); };
  const std::vector<std::int32_t> prompt{3, 1, 4};
  auto draw = [&](std::uint64_t seed) {
    return sample::generate(build, shape.seq, vocab, *params, prompt,
                            {.tokens = 40, .temperature = 1.0, .seed = seed});
  };
  const auto a = draw(5), b = draw(5), c = draw(6);
  REQUIRE(a.size() == 40);
  for (std::int32_t id : a) CHECK((id >= 0 && id < vocab));
  CHECK(a == b);
  CHECK(a != c);
}

TEST_CASE("Sample.GreedyReproducesAMemorisedText" * doctest::timeout(240)) {
  auto corpus = std::make_shared<const data::TextCorpus>(data::load_text(repeating_text_file()));
  const models::GptShape shape = shape_for(corpus->vocab_size());
  Graph g(3);
  Value loss = models::gpt_with_loss(g, 16, shape).loss;
  TrainConfig cfg;
  cfg.steps = 300;
  cfg.optimizer = optim::adam(1e-2);
  cfg.data = {{"text", data::text_source(corpus, 16, 1, shape.seq, 3), {"tokens", "targets"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(30'000);
  Runtime rt(job.plan, job.kernels, rs);
  rt.run();
  const auto losses = job.losses->per_step();
  REQUIRE(losses.size() == 300);
  MESSAGE("loss " << losses.front() << " -> " << losses.back() << " nats");

  // The prompt is past the ambiguous "the "; 100 greedy tokens run more than twice round the
  // period, through contexts longer than the model's 16 (the window slides).
  const std::string prompt = "the quick";
  const auto ids = sample::generate(
      [&](Graph& eval) { return models::gpt(eval, 1, shape); }, shape.seq, corpus->vocab_size(),
      *job.params, encode(*corpus, prompt), {.tokens = 100, .temperature = 0.0, .seed = 1});
  const std::string text = decode(*corpus, ids);
  std::string expected;
  while (expected.size() < prompt.size() + 100) expected += line;
  expected = expected.substr(prompt.size(), 100);
  CHECK(text == expected);
}

TEST_CASE("Sample.BadSettingsAreRefused") {
  const models::GptShape shape = shape_for(8);
  Graph init(1);
  models::gpt(init, 1, shape);
  auto params = ParameterStore::initialize(init);
  auto build = [&](Graph& g) { return models::gpt(g, 1, shape); };
  auto refused = [&](std::vector<std::int32_t> prompt, sample::Settings s, std::int64_t vocab,
                     const std::string& says) {
    CAPTURE(says);
    try {
      sample::generate(build, shape.seq, vocab, *params, prompt, s);
      FAIL("not refused");
    } catch (const std::invalid_argument& e) {
      CHECK_MESSAGE(std::string(e.what()).find(says) != std::string::npos, e.what());
    }
  };
  refused({1}, {.tokens = 0}, 8, "tokens must be >= 1, not 0");
  refused({1}, {.tokens = 5, .temperature = -0.5}, 8, "temperature must be a finite number >= 0");
  refused({1}, {.tokens = 5, .temperature = std::numeric_limits<double>::quiet_NaN()}, 8,
          "temperature");
  refused({1}, {.tokens = 5, .temperature = std::numeric_limits<double>::infinity()}, 8,
          "temperature");
  refused({}, {.tokens = 5}, 8, "the prompt is empty");
  refused({1, 8}, {.tokens = 5}, 8, "prompt token 1 is id 8, outside the vocabulary [0, 8)");
  refused({1, -1}, {.tokens = 5}, 8, "prompt token 1 is id -1");
  refused({1}, {.tokens = 5}, 9, "the model's logits at batch 1 are [16, 8], expected [16, 9]");
}

TEST_CASE("Sample.BatonTrainSamplesAMemorisedText" * doctest::timeout(240)) {
  const std::string file = repeating_text_file();
  const Outcome r = train_cli({"--model",       "gpt",  "--data",          "text:" + file,
                               "--steps",       "300",  "--batch",         "16",
                               "--seq",         "16",   "--d-model",       "32",
                               "--heads",       "2",    "--layers",        "1",
                               "--lr",          "1e-2", "--seed",          "3",
                               "--sample",      "60",   "--sample-prompt", "the quick",
                               "--temperature", "0"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  std::string expected;
  while (expected.size() < 80) expected += line;
  // The prompt and its 60 greedy characters, decoded from the text's bytes.
  CHECK(r.out.find("sample (60 tokens after the prompt, temperature 0):\n" +
                   expected.substr(0, 69) + "\n") != std::string::npos);
}

TEST_CASE("Sample.BatonTrainDecodesTokensThroughTheShardsTokenizer" * doctest::timeout(240)) {
  const std::string prepare = std::string(BATON_BIN_DIR) + "/baton-prepare-data";
  if (!fs::exists(prepare)) {
    return test::skip(test::Missing::sentencepiece,
                      "no baton-prepare-data (a build without libsentencepiece-dev)");
  }
  // The line once per text line, as baton-prepare-data encodes files line by line.
  const fs::path dir = scratch() / "fox-tokens";
  fs::create_directories(dir);
  {
    std::ofstream out(dir / "fox.txt");
    for (int i = 0; i < 60; ++i) out << "the quick brown fox jumps over the lazy dog.\n";
  }
  test::Proc p({prepare, "--input", (dir / "fox.txt").string(), "--train-tokenizer", "--vocab-size",
                "40", "--output", (dir / "shards").string()});
  const int code = p.wait(60s);
  CAPTURE(p.err());
  REQUIRE(code == 0);
  const Outcome r =
      train_cli({"--model",       "gpt",  "--data",          "tokens:" + (dir / "shards").string(),
                 "--steps",       "300",  "--batch",         "16",
                 "--seq",         "16",   "--d-model",       "32",
                 "--heads",       "2",    "--layers",        "1",
                 "--lr",          "1e-2", "--seed",          "3",
                 "--sample",      "60",   "--sample-prompt", "the quick",
                 "--temperature", "0"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  // SentencePiece's pieces carry their leading space, so the lines join with one.
  CHECK(r.out.find(
            "temperature 0):\nthe quick brown fox jumps over the lazy dog. the quick brown fox") !=
        std::string::npos);
  CHECK(train_cli({"--model", "gpt", "--data", "tokens:" + (dir / "shards").string(), "--steps",
                   "1", "--batch", "2", "--seq", "8", "--sample", "3", "--sample-prompt", "!!!"},
                  60s)
            .code == 0);  // a piece it does not know is SentencePiece's unknown id, not an error
}

TEST_CASE("Sample.BatonTrainRefusesBadSampleFlags" * doctest::timeout(240)) {
  const std::string file = repeating_text_file();
  const std::vector<std::string> gpt{
      "--model", "gpt", "--data",    "text:" + file, "--steps", "1", "--batch",  "2",
      "--seq",   "8",   "--d-model", "16",           "--heads", "2", "--layers", "1"};
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases{
      {{"--sample", "0"}, "--sample: must be > 0, not 0"},
      {{"--sample", "-4"}, "--sample: must be > 0, not -4"},
      {{"--sample", "ten"}, "--sample: must be a number, not 'ten'"},
      {{"--sample", "5", "--temperature", "-1"}, "--temperature: must be >= 0, not -1"},
      {{"--sample-prompt", "the"}, "--sample-prompt needs --sample N"},
      {{"--temperature", "0.5"}, "--temperature needs --sample N"},
      {{"--sample", "5", "--sample-prompt", "the QUICK"},
       "--sample-prompt: character 4 ('Q', byte 0x51) never occurs in " + file},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = gpt;
    args.insert(args.end(), c.args.begin(), c.args.end());
    const Outcome r = train_cli(args, 60s);
    CAPTURE(c.says);
    CAPTURE(r.err);
    CHECK(r.code > 0);    // 1 from baton-train, CLI11's own code (105) for a value it refuses
    CHECK(r.code < 128);  // an error exit, not a signal
    CHECK(r.err.substr(0, r.err.find('\n')).find(c.says) != std::string::npos);
    CHECK(r.out.find("step") == std::string::npos);  // refused before training
  }
  const Outcome mlp =
      train_cli({"--model", "mlp", "--data", "synthetic", "--steps", "1", "--sample", "5"}, 60s);
  CAPTURE(mlp.err);
  CHECK(mlp.code == 1);
  CHECK(mlp.err.find("--sample needs a language model: --model gpt or llama") != std::string::npos);
}

// baton-train --no-epilogues keeps each Linear layer's product and bias add (and its weight and
// bias gradients) as actors of their own: the plan says so, and on the CPU the run is the same
// bits as the fused one (the fused kernels keep the ops' arithmetic there).
TEST_CASE("TrainCli.NoEpiloguesKeepsTheOpsApartWithTheSameLosses" * doctest::timeout(240)) {
  const std::vector<std::string> base{"--model", "mlp", "--data", "digits", "--steps", "40", "--batch", "32"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    const Outcome r = train_cli(args);
    CAPTURE(r.err);
    REQUIRE(r.code == 0);
    return r.out;
  };
  const std::string fused_plan = with({"--print-plan"}), apart_plan = with({"--print-plan", "--no-epilogues"});
  CHECK(fused_plan.find("matmul_bias ") != std::string::npos);
  CHECK(fused_plan.find("matmul_bias_grad") != std::string::npos);
  CHECK(apart_plan.find("matmul_bias") == std::string::npos);
  // The JSON line's losses as printed (six digits; BiasAdds.* and BiasGradients.* compare every bit
  // in-process).
  auto field = [](const std::string& out, const std::string& key) {
    std::smatch m;
    REQUIRE(std::regex_search(out, m, std::regex("\"" + key + "\": ?([-0-9.eE+]+)")));
    return m[1].str();
  };
  const std::string fused = with({"--json"}), apart = with({"--json", "--no-epilogues"});
  CHECK(field(fused, "final_loss") == field(apart, "final_loss"));
  CHECK(field(fused, "eval_loss") == field(apart, "eval_loss"));
}

TEST_CASE("TrainCli.GeluTanhIsTheGptsMlpActivationAndItsCheckpointSaysSo" * doctest::timeout(240)) {
  // --gelu tanh trains the GPT with GELU's tanh form, the checkpoint's config records it (a
  // server of the checkpoint builds the same MLP), a resume must agree on it, and the models
  // without that choice refuse the flag by name.
  const std::string file = repeating_text_file();
  const fs::path ckpt = scratch() / "gelu-tanh-ckpt";
  fs::remove_all(ckpt);
  const std::vector<std::string> base{"--model", "gpt", "--data", "text:" + file, "--batch", "4", "--seq", "16",
                                      "--d-model", "16", "--heads", "2", "--layers", "1", "--checkpoint-dir", ckpt.string()};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    return train_cli(args);
  };
  const Outcome trained = with({"--steps", "4", "--gelu", "tanh"});
  CAPTURE(trained.err);
  REQUIRE(trained.code == 0);
  std::string index;
  for (const auto& entry : fs::recursive_directory_iterator(ckpt)) {
    if (entry.path().filename() == "index.json") {
      std::ifstream in(entry.path());
      index.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  }
  CHECK(std::regex_search(index, std::regex("\"gelu\": ?\"tanh\"")));
  const Outcome erf = with({"--steps", "8", "--resume", ckpt.string()});
  CHECK(erf.code != 0);
  CHECK(erf.err.find("gelu: checkpoint tanh, this run (none)") != std::string::npos);
  CHECK(with({"--steps", "8", "--resume", ckpt.string(), "--gelu", "tanh"}).code == 0);
  const Outcome llama = train_cli({"--model", "llama", "--data", "text:" + file, "--steps", "1", "--gelu", "tanh"});
  CHECK(llama.code != 0);
  CHECK(llama.err.find("--gelu tanh is an option of --model gpt") != std::string::npos);
}
