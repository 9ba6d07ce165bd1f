// Other people's weights: the safetensors reader's F16 and BF16 tensors, the importer that maps
// transformers' Llama names and layout onto models::llama (import.h), and the same Llama trained
// in baton and in PyTorch from the same file on the same batches (tests/llama_reference.py).
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <fmt/format.h>
#include <boost/json.hpp>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/graph/safetensors.h"
#include "baton/kernels/data.h"
#include "import.h"
#include "models.h"
#include "skip.h"
#include "test_util.h"

using namespace baton;
namespace fs = std::filesystem;

namespace {

/// A fresh directory under /tmp, removed at the end of the test.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    static int counter = 0;
    path = fs::temp_directory_path() /
           fmt::format("baton-import-{}-{}-{}", ::getpid(), name, counter++);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// A safetensors file written byte by byte: `header` (JSON) and `data`.
void write_raw(const fs::path& p, const std::string& header, const std::string& data) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  const std::uint64_t n = header.size();
  char length[8];
  std::memcpy(length, &n, 8);
  out.write(length, 8);
  out << header << data;
}

/// binary16's value by its definition (IEEE 754-2008, 3.4), in double: a second derivation, by
/// arithmetic, of what half_to_float does with bits.
double half_value(std::uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const double magnitude = exponent == 0    ? std::ldexp(mantissa, -24)
                           : exponent == 31 ? (mantissa == 0 ? INFINITY : NAN)
                                            : std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  return sign != 0 ? -magnitude : magnitude;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

/// A tiny Llama's graph and its weights (seeded by `seed`).
struct TinyLlama {
  models::LlamaShape shape{.vocab = 24,
                           .seq = 6,
                           .d_model = 16,
                           .heads = 4,
                           .kv_heads = 2,
                           .ffn_hidden = 24,
                           .layers = 2};
  Graph g;
  Value logits;
  std::shared_ptr<ParameterStore> params;
  TinyLlama(std::uint64_t seed, std::int64_t tp, bool tied, DType dtype = DType::f32) : g(seed) {
    shape.tp = tp;
    shape.tie_embeddings = tied;
    shape.dtype = dtype;
    logits = models::llama(g, 2, shape);
    params = ParameterStore::initialize(g);
  }
};

bool torch_linear(const std::string& name) {
  return name.ends_with("_proj.weight") || name == "lm_head.weight";
}

/// A one-device Llama's weights in transformers' layout: Linear weights transposed to [out, in].
std::vector<std::pair<std::string, Tensor>> hf_tensors(const ParameterStore& params) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, t] : params.values()) {
    if (!torch_linear(name)) {
      out.emplace_back(name, t);
      continue;
    }
    const std::int64_t rows = t.dim(0), cols = t.dim(1);
    Tensor tt = Tensor::empty({cols, rows}, t.dtype());
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        tt.data<float>()[static_cast<std::size_t>(c * rows + r)] =
            t.data<float>()[static_cast<std::size_t>(r * cols + c)];
      }
    }
    out.emplace_back(name, tt);
  }
  return out;
}

std::vector<float> floats(const Tensor& t) {
  return {t.data<float>().begin(), t.data<float>().end()};
}

}  // namespace

TEST_CASE("Safetensors.F16ReadsAsTheExactFloatForEveryBitPattern") {
  TempDir tmp("f16");
  std::string data(2 * 65536, '\0');
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    std::memcpy(data.data() + 2 * i, &h, 2);
  }
  const fs::path p = tmp.path / "half.safetensors";
  write_raw(p, R"({"h":{"dtype":"F16","shape":[256,256],"data_offsets":[0,131072]}})", data);
  const safetensors::Contents c = safetensors::read(p);
  REQUIRE(c.tensors.size() == 1);
  const Tensor& t = c.tensors[0].second;
  CHECK(t.dtype() == DType::f32);
  CHECK(t.shape() == Shape{256, 256});
  std::int64_t wrong = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const double want = half_value(static_cast<std::uint16_t>(i));
    const float got = t.data<float>()[i];
    const bool same = std::isnan(want) ? std::isnan(got)
                                       : static_cast<double>(got) == want &&
                                             std::signbit(got) == std::signbit(want);
    if (!same && ++wrong <= 5)
      FAIL_CHECK(fmt::format("F16 0x{:04x}: read {} but it is {}", i, got, want));
  }
  CHECK(wrong == 0);
  // A few by name: one, the largest half, the smallest subnormal, minus zero.
  CHECK(safetensors::half_to_float(0x3c00) == 1.0f);
  CHECK(safetensors::half_to_float(0x7bff) == 65504.0f);
  CHECK(safetensors::half_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(std::signbit(safetensors::half_to_float(0x8000)));
}

TEST_CASE("Safetensors.Bf16IsKeptAndOtherDtypesAreRefusedNamingTheTensor") {
  TempDir tmp("dtypes");
  // BF16 and F16 beside F32, as a mixed checkpoint has them.
  const std::array<std::uint16_t, 3> bf{0x3f80, 0xc040, 0x0001};  // 1, -3, the smallest subnormal
  const std::array<std::uint16_t, 2> half{0x4200, 0xbc00};        // 3, -1
  const float f = 0.25f;
  std::string data(reinterpret_cast<const char*>(bf.data()), 6);
  data.append(reinterpret_cast<const char*>(half.data()), 4);
  data.append(reinterpret_cast<const char*>(&f), 4);
  const fs::path p = tmp.path / "mixed.safetensors";
  write_raw(
      p,
      R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},"h":{"dtype":"F16","shape":[2],"data_offsets":[6,10]},)"
      R"("f":{"dtype":"F32","shape":[],"data_offsets":[10,14]}})",
      data);
  const safetensors::Contents c = safetensors::read(p);
  REQUIRE(c.find("b") != nullptr);
  CHECK(c.find("b")->dtype() == DType::bf16);
  CHECK(c.find("b")->data<bfloat16>()[1].bits == 0xc040);
  CHECK(to_float(c.find("b")->data<bfloat16>()[2]) == std::ldexp(1.0f, -133));
  CHECK(floats(*c.find("h")) == std::vector<float>{3.0f, -1.0f});
  CHECK(floats(*c.find("f")) == std::vector<float>{0.25f});

  // Dtypes baton has no tensors for, and an F16 tensor whose bytes do not match its shape.
  for (const char* dtype : {"F8_E4M3", "I8", "U16", "BOOL", "f16"}) {
    write_raw(p, fmt::format(R"({{"w":{{"dtype":"{}","shape":[2],"data_offsets":[0,2]}}}})", dtype),
              std::string(2, '\0'));
    const std::string e = error_of([&] { safetensors::read(p); });
    CHECK_MESSAGE(
        test::contains(
            e, fmt::format("{}: tensor 'w': dtype '{}' is not one baton reads (F32, F64, F16, BF16",
                           p.string(), dtype)),
        e);
  }
  write_raw(p, R"({"w":{"dtype":"F16","shape":[3],"data_offsets":[0,4]}})", std::string(4, '\0'));
  CHECK(test::contains(error_of([&] { safetensors::read(p); }),
                       "tensor 'w': F16 [3] needs 6 bytes but data_offsets [0, 4] hold 4"));
  write_raw(p, R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,6]}})", std::string(4, '\0'));
  CHECK(test::contains(error_of([&] { safetensors::read(p); }),
                       "tensor 'w': data_offsets [0, 6] are outside the 4 bytes of data"));
  // baton writes BF16 and reads it back as it was.
  Tensor t = Tensor::empty({2}, DType::bf16);
  t.data<bfloat16>()[0] = to_bf16(1.5f);
  t.data<bfloat16>()[1] = to_bf16(-2.0f);
  safetensors::write(p, {{"t", t}});
  CHECK(safetensors::read(p).find("t")->data<bfloat16>()[0].bits == t.data<bfloat16>()[0].bits);
}

TEST_CASE("Import.LlamaFromTransformersLayoutGivesTheSameWeightsAndLogits") {
  TempDir tmp("llama");
  TinyLlama source(1, 1, false);
  const fs::path file = tmp.path / "hf.safetensors";
  safetensors::write(file, hf_tensors(*source.params));
  // Another seed's weights, replaced by the file's: equal to the source's, bit for bit.
  TinyLlama target(2, 1, false);
  CHECK(floats(target.params->at("model.layers.0.self_attn.q_proj.weight")) !=
        floats(source.params->at("model.layers.0.self_attn.q_proj.weight")));
  models::init_from(file, "llama", *target.params);
  for (const auto& [name, t] : source.params->values()) {
    INFO(name);
    CHECK(floats(target.params->at(name)) == floats(t));
  }
  // The same logits: the model reads the file's layout as transformers does (x W^T).
  Tensor tokens = Tensor::empty({2, 6}, i32);
  for (std::int32_t i = 0; i < 12; ++i)
    tokens.data<std::int32_t>()[static_cast<std::size_t>(i)] = (7 * i + 3) % 24;
  const std::map<std::string, Tensor> feeds{{"tokens", tokens},
                                            {"targets", Tensor::zeros({12}, i32)}};
  CHECK(floats(evaluate(source.g, feeds, {source.logits}, *source.params)[0]) ==
        floats(evaluate(target.g, feeds, {target.logits}, *target.params)[0]));

  // Into f64 weights: every F32 value exactly.
  TinyLlama wide(3, 1, false, DType::f64);
  models::init_from(file, "llama", *wide.params);
  const Tensor& down = wide.params->at("model.layers.1.mlp.down_proj.weight");
  CHECK(down.dtype() == DType::f64);
  CHECK(down.data<double>()[5] ==
        static_cast<double>(
            source.params->at("model.layers.1.mlp.down_proj.weight").data<float>()[5]));

  // Tensor parallelism: each shard is its piece of the file's tensor (q by columns, o by rows,
  // the token table by rows), and the logits are the one-device model's up to the order of the
  // shards' partial sums (f32 rounding of a few terms: 1e-5 of logits of size ~1).
  TinyLlama split(4, 2, false);
  models::init_from(file, "llama", *split.params);
  const Tensor& q = source.params->at("model.layers.0.self_attn.q_proj.weight");      // [16, 16]
  const Tensor& q1 = split.params->at("model.layers.0.self_attn.q_proj.weight.tp1");  // [16, 8]
  REQUIRE(q1.shape() == Shape{16, 8});
  CHECK(q1.data<float>()[3 * 8 + 2] == q.data<float>()[3 * 16 + 8 + 2]);
  const Tensor& o = source.params->at("model.layers.0.self_attn.o_proj.weight");
  CHECK(split.params->at("model.layers.0.self_attn.o_proj.weight.tp1").data<float>()[0] ==
        o.data<float>()[8 * 16]);
  CHECK(split.params->at("model.embed_tokens.weight.tp1").data<float>()[0] ==
        source.params->at("model.embed_tokens.weight").data<float>()[12 * 16]);
  const std::vector<float> one =
      floats(evaluate(source.g, feeds, {source.logits}, *source.params)[0]);
  const std::vector<float> two = floats(evaluate(split.g, feeds, {split.logits}, *split.params)[0]);
  REQUIRE(one.size() == two.size());
  for (std::size_t i = 0; i < one.size(); ++i)
    CHECK(two[i] == doctest::Approx(one[i]).epsilon(1e-5).scale(1.0));
}

TEST_CASE("Import.MissingExtraOrMisshapenTensorsAreErrorsNamingThem") {
  TempDir tmp("errors");
  TinyLlama source(1, 1, false);
  const fs::path file = tmp.path / "w.safetensors";
  auto error_with = [&](std::vector<std::pair<std::string, Tensor>> tensors, bool tied = false) {
    safetensors::write(file, tensors);
    TinyLlama target(2, 1, tied);
    return error_of([&] { models::init_from(file, "llama", *target.params); });
  };
  auto all = hf_tensors(*source.params);
  auto without = [&](const std::string& name) {
    auto v = all;
    std::erase_if(v, [&](const auto& p) { return p.first == name; });
    return v;
  };
  std::string e = error_with(without("model.layers.1.mlp.up_proj.weight"));
  CHECK_MESSAGE(
      test::contains(e, file.string() +
                            ": the model's weight 'model.layers.1.mlp.up_proj.weight' [24, 16] is "
                            "not in the file (--model llama)"),
      e);
  auto extra = all;
  extra.emplace_back("model.layers.2.input_layernorm.weight", Tensor::zeros({16}, f32));
  e = error_with(extra);
  CHECK_MESSAGE(
      test::contains(
          e, "tensor 'model.layers.2.input_layernorm.weight' [16] is no weight of the model"),
      e);
  // A Linear weight in baton's layout, [in, out], instead of torch's [out, in].
  auto wrong = without("model.layers.0.mlp.gate_proj.weight");
  wrong.emplace_back("model.layers.0.mlp.gate_proj.weight",
                     source.params->at("model.layers.0.mlp.gate_proj.weight"));
  e = error_with(wrong);
  CHECK_MESSAGE(
      test::contains(
          e,
          "tensor 'model.layers.0.mlp.gate_proj.weight' is [16, 24] in the file but [24, 16] in "
          "the model (a torch Linear weight, [out, in])"),
      e);
  auto ints = without("model.norm.weight");
  ints.emplace_back("model.norm.weight", Tensor::zeros({16}, i32));
  CHECK(test::contains(error_with(ints),
                       "tensor 'model.norm.weight' is i32 [16], not a floating dtype"));
  // Tied: lm_head.weight is dropped, or the token table itself; another head is an error.
  CHECK(error_with(without("lm_head.weight"), true) == "(no error)");
  auto tied_copy = without("lm_head.weight");
  tied_copy.emplace_back("lm_head.weight", source.params->at("model.embed_tokens.weight"));
  CHECK(error_with(tied_copy, true) == "(no error)");
  e = error_with(all, true);
  CHECK_MESSAGE(
      test::contains(
          e,
          "tensor 'lm_head.weight' [24, 16] is no weight of the model (--model llama with "
          "--tie-embeddings, whose head is the token table)"),
      e);
  // Shards that do not tile the file's tensor: heads 4 over tp 2 need q_proj rows 16, not 12.
  auto narrow = without("model.layers.0.self_attn.q_proj.weight");
  narrow.emplace_back("model.layers.0.self_attn.q_proj.weight", Tensor::zeros({12, 16}, f32));
  safetensors::write(file, narrow);
  TinyLlama split(2, 2, false);
  e = error_of([&] { models::init_from(file, "llama", *split.params); });
  CHECK_MESSAGE(
      test::contains(
          e,
          "tensor 'model.layers.0.self_attn.q_proj.weight' is [12, 16] in the file, which 2 "
          "shards of [8, 16] do not make"),
      e);
  // A file that is not safetensors at all: the reader's error, naming it.
  write_raw(file, "{\"w\"", "");
  TinyLlama target(2, 1, false);
  e = error_of([&] { models::init_from(file, "llama", *target.params); });
  CHECK_MESSAGE(test::contains(e, file.string() + ": the header is not valid JSON"), e);
}

// ---- The same Llama in baton and in PyTorch ------------------------------------------------

namespace {

const std::string reference_text = "/usr/share/common-licenses/GPL-3";
constexpr std::int64_t ref_batch = 8, ref_steps = 20;
constexpr double ref_lr = 3e-3;
constexpr std::uint64_t ref_data_seed = 11;

models::LlamaShape reference_shape(std::int64_t vocab, DType dtype) {
  return {.vocab = vocab,
          .seq = 16,
          .d_model = 32,
          .heads = 4,
          .kv_heads = 2,
          .ffn_hidden = 64,
          .layers = 2,
          .rope_base = 10000.0,
          .norm_eps = 1e-5,
          .dtype = dtype};
}

std::string reference_flags(const models::LlamaShape& s) {
  return fmt::format(
      "--vocab {} --d-model {} --heads {} --kv-heads {} --ffn-hidden {} --layers {} --rope-base {} "
      "--eps {} "
      "--lr {} --seed 5",
      s.vocab, s.d_model, s.heads, s.kv_heads, s.ffn_hidden, s.layers, s.rope_base, s.norm_eps,
      ref_lr);
}

/// The batches baton's text_source gives steps 0 .. ref_steps - 1 (kernels/data.h: row i of
/// step s is the window at window_starts(seed, s, 0, batch, n - seq)[i]), for the reference.
void write_batches(const fs::path& file, const data::TextCorpus& corpus, std::int64_t seq) {
  Tensor tokens = Tensor::empty({ref_steps, ref_batch, seq}, i32),
         targets = Tensor::empty({ref_steps, ref_batch * seq}, i32);
  const auto starts =
      static_cast<std::uint64_t>(corpus.ids.size()) - static_cast<std::uint64_t>(seq);
  std::size_t at = 0;
  for (std::int64_t step = 0; step < ref_steps; ++step) {
    for (std::uint64_t o : data::window_starts(ref_data_seed, step, 0, ref_batch, starts)) {
      for (std::int64_t j = 0; j < seq; ++j, ++at) {
        tokens.data<std::int32_t>()[at] = corpus.ids[o + static_cast<std::size_t>(j)];
        targets.data<std::int32_t>()[at] = corpus.ids[o + static_cast<std::size_t>(j) + 1];
      }
    }
  }
  safetensors::write(file, {{"tokens", tokens}, {"targets", targets}});
}

/// baton's losses: the model of `loss` started from `weights` (in `layout`), trained on
/// text_source's batches.
std::vector<double> train_from(Graph& g, Value loss, const fs::path& weights,
                               std::string_view layout,
                               std::shared_ptr<const data::TextCorpus> corpus, std::int64_t seq) {
  auto params = ParameterStore::initialize(g);
  models::init_from(weights, layout, *params);
  TrainConfig cfg;
  cfg.steps = ref_steps;
  cfg.optimizer = optim::adam(ref_lr);
  cfg.data = {{"text",
               data::text_source(std::move(corpus), ref_batch, 1, seq, ref_data_seed),
               {"tokens", "targets"}}};
  TrainingJob job = compile_training(g, loss, cfg, params);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(60'000);
  Runtime rt(job.plan, job.kernels, rs);
  rt.run();
  return job.losses->per_step();
}

/// baton's losses: models::llama started from `weights`, trained on text_source's batches.
std::vector<double> baton_losses(const fs::path& weights,
                                 std::shared_ptr<const data::TextCorpus> corpus, DType dtype) {
  Graph g(5);
  const models::LlamaShape s = reference_shape(corpus->vocab_size(), dtype);
  Value loss = models::llama_with_loss(g, ref_batch, s).loss;
  return train_from(g, loss, weights, "llama", std::move(corpus), s.seq);
}

/// The losses a reference script prints as {"losses": [...]}.
std::vector<double> torch_losses(const std::string& command) {
  std::FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  const int status = ::pclose(pipe);
  REQUIRE_MESSAGE(status == 0, command << " failed: " << out);
  std::vector<double> losses;
  boost::system::error_code ec;
  const boost::json::value parsed = boost::json::parse(out, ec);
  const boost::json::array* values =
      ec || !parsed.is_object() || !parsed.as_object().contains("losses")
          ? nullptr
          : parsed.as_object().at("losses").if_array();
  REQUIRE_MESSAGE(values != nullptr, command << " printed no {\"losses\": [...]}: " << out);
  for (const auto& v : *values) {
    REQUIRE_MESSAGE(v.is_number(), command << " printed a loss that is not a number: " << out);
    losses.push_back(v.to_number<double>());
  }
  return losses;
}

}  // namespace

TEST_CASE("Import.LlamaTrainsAsPyTorchFromTheSameSafetensorsFile" * doctest::timeout(280)) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    return test::skip(test::Missing::torch,
                      "/usr/bin/python3 cannot import torch (Debian: python3-torch)");
  }
  if (!fs::exists(reference_text)) {
    return test::skip(test::Missing::system_file,
                      reference_text + " is missing (Debian: base-files)");
  }
  TempDir tmp("torch");
  auto corpus = std::make_shared<const data::TextCorpus>(data::load_text(reference_text));
  const std::string script = std::string(BATON_SOURCE_DIR) + "/tests/llama_reference.py";
  const fs::path batches = tmp.path / "batches.safetensors";
  write_batches(batches, *corpus, 16);
  struct Case {
    const char* file_dtype;  // how the reference writes its initial weights
    DType dtype;             // what both sides train in
    double tolerance;
  };
  // f64: the two sides differ by the order of their sums and by libm (exp, sin, cos), each near
  // 1e-16 relative; 20 Adam steps carry a gradient's rounding into the weights (the update is
  // g / (sqrt(v) + eps): relative errors pass through, not shrunk), so the losses, about 4,
  // differ by a few 1e-15 (measured: at most 3.6e-15 under every OpenBLAS core type): 1e-10.
  // f32: the same differences at 6e-8 relative per operation (measured: at most 4.8e-7 over the
  // 20 steps); 2e-5 leaves room for other CPUs' BLAS kernels summing in other orders.
  const std::vector<Case> cases{{"F32", DType::f64, 1e-10},
                                {"BF16", DType::f64, 1e-10},
                                {"F16", DType::f64, 1e-10},
                                {"F32", DType::f32, 2e-5}};
  for (const Case& c : cases) {
    CAPTURE(c.file_dtype);
    CAPTURE(name(c.dtype));
    const fs::path weights = tmp.path / fmt::format("llama-{}.safetensors", c.file_dtype);
    const models::LlamaShape s = reference_shape(corpus->vocab_size(), c.dtype);
    const std::string flags = reference_flags(s);
    if (!fs::exists(weights)) {
      const std::string init = fmt::format("/usr/bin/python3 {} init {} {} --file-dtype {}", script,
                                           weights.string(), flags, c.file_dtype);
      REQUIRE_MESSAGE(std::system(init.c_str()) == 0, init);
    }
    const std::vector<double> theirs = torch_losses(
        fmt::format("/usr/bin/python3 {} train {} {} {} --dtype {}", script, weights.string(),
                    batches.string(), flags, c.dtype == DType::f64 ? "float64" : "float32"));
    const std::vector<double> ours = baton_losses(weights, corpus, c.dtype);
    REQUIRE(theirs.size() == static_cast<std::size_t>(ref_steps));
    REQUIRE(ours.size() == static_cast<std::size_t>(ref_steps));
    double worst = 0;
    for (std::int64_t i = 0; i < ref_steps; ++i) {
      const auto k = static_cast<std::size_t>(i);
      worst = std::max(worst, std::abs(ours[k] - theirs[k]));
      CHECK_MESSAGE(std::abs(ours[k] - theirs[k]) <= c.tolerance,
                    "step " << i + 1 << ": baton " << ours[k] << ", torch " << theirs[k]);
    }
    // The model learns: the file's weights are a start, not the end.
    CHECK(ours.back() < ours.front() - 0.3);
    fmt::print(
        "llama vs torch ({} file, {}): step 1 {:.10f} / {:.10f}, step 10 {:.10f} / {:.10f}, step "
        "20 {:.10f} / "
        "{:.10f} (baton / torch), max |difference| {:.3g}\n",
        c.file_dtype, name(c.dtype), ours[0], theirs[0], ours[9], theirs[9], ours[19], theirs[19],
        worst);
  }
}

TEST_CASE("Import.Gpt2FromItsPublishedLayoutGivesPyTorchsLogits" * doctest::timeout(120)) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    return test::skip(test::Missing::torch,
                      "/usr/bin/python3 cannot import torch (Debian: python3-torch)");
  }
  TempDir tmp("gpt2");
  const std::string script = std::string(BATON_SOURCE_DIR) + "/tests/gpt2_reference.py";
  // 12 positions for a context of 8: the model reads the first rows of the table.
  const models::Gpt2Shape shape{
      .vocab = 40, .seq = 8, .positions = 12, .d_model = 16, .heads = 4, .layers = 2};
  const std::int64_t batch = 2;
  for (const char* prefix : {"", "transformer."}) {  // GPT2Model's names, and GPT2LMHeadModel's
    CAPTURE(prefix);
    const fs::path file = tmp.path / "gpt2.safetensors";
    const std::string command = fmt::format(
        "/usr/bin/python3 {} {} --vocab {} --d-model {} --heads {} --layers {} "
        "--positions {} --seq {} --batch {}{}",
        script, file.string(), shape.vocab, shape.d_model, shape.heads, shape.layers,
        shape.positions, shape.seq, batch,
        *prefix != '\0' ? fmt::format(" --prefix {}", prefix) : std::string());
    std::FILE* pipe = ::popen(command.c_str(), "r");
    REQUIRE(pipe != nullptr);
    std::string out;
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
    REQUIRE_MESSAGE(::pclose(pipe) == 0, command);
    const boost::json::object reference = boost::json::parse(out).as_object();
    Tensor tokens = Tensor::empty({batch, shape.seq}, i32);
    const auto& ids = reference.at("tokens").as_array();
    REQUIRE(static_cast<std::int64_t>(ids.size()) == tokens.numel());
    for (std::size_t i = 0; i < ids.size(); ++i)
      tokens.data<std::int32_t>()[i] = static_cast<std::int32_t>(ids[i].to_number<std::int64_t>());
    // f64: the two differ only by the order of sums and libm's tanh, exp (1e-16 relative) through
    // two blocks: 1e-12 on logits of size ~1 (measured: 7.8e-16). f32: the same at 6e-8 relative
    // per operation through the 16-wide products and norms of two blocks (measured: 3.6e-7 under
    // every OpenBLAS core type): 5e-6.
    struct Precision {
      DType dtype;
      const char* key;
      double tolerance;
    };
    for (const Precision& precision :
         {Precision{DType::f64, "float64", 1e-12}, Precision{DType::f32, "float32", 5e-6}}) {
      const auto [dtype, key, tolerance] = precision;
      CAPTURE(precision.key);
      models::Gpt2Shape s = shape;
      s.dtype = dtype;
      Graph g(9);
      Value logits = models::gpt2(g, batch, s);
      auto params = ParameterStore::initialize(g);
      models::init_from(file, "gpt2", *params);
      const Tensor got =
          evaluate(g, {{"tokens", tokens}, {"targets", Tensor::zeros({batch * shape.seq}, i32)}},
                   {logits}, *params)[0];
      const auto& want = reference.at(key).as_array();
      REQUIRE(static_cast<std::int64_t>(want.size()) == got.numel());
      double worst = 0;
      for (std::size_t i = 0; i < want.size(); ++i) {
        const double ours =
            dtype == DType::f64 ? got.data<double>()[i] : static_cast<double>(got.data<float>()[i]);
        worst = std::max(worst, std::abs(ours - want[i].to_number<double>()));
      }
      CHECK_MESSAGE(worst <= tolerance, "the largest difference from torch's logits is " << worst);
      fmt::print("gpt2 vs torch ({}{}): max |logit difference| {:.3g}\n", prefix, key, worst);
    }
  }
  // The importer refuses an untied head and a file without the model's position rows.
  TempDir bad("gpt2-bad");
  Graph g(9);
  models::gpt2(g, batch, shape);
  auto params = ParameterStore::initialize(g);
  std::vector<std::pair<std::string, Tensor>> tensors(params->values().begin(),
                                                      params->values().end());
  tensors.emplace_back("lm_head.weight", Tensor::zeros({shape.vocab, shape.d_model}, f32));
  safetensors::write(bad.path / "w.safetensors", tensors);
  std::string e = error_of([&] { models::init_from(bad.path / "w.safetensors", "gpt2", *params); });
  CHECK_MESSAGE(
      test::contains(
          e,
          "tensor 'lm_head.weight' [40, 16] is no weight of the model (--model gpt2, whose head is "
          "the token table)"),
      e);
  tensors.pop_back();
  std::erase_if(tensors, [](const auto& p) { return p.first == "wpe.weight"; });
  tensors.emplace_back("wpe.weight", Tensor::zeros({8, shape.d_model}, f32));
  safetensors::write(bad.path / "w.safetensors", tensors);
  e = error_of([&] { models::init_from(bad.path / "w.safetensors", "gpt2", *params); });
  CHECK_MESSAGE(
      test::contains(e, "tensor 'wpe.weight' is [8, 16] in the file but [12, 16] in the model"), e);
}

TEST_CASE("Import.Gpt2TrainsAsPyTorchFromTheSameSafetensorsFile" * doctest::timeout(200)) {
  // The backward too: tanh GELU from tanh and pow, the sliced c_attn, the tied head's two
  // gradients summed, learned positions with rows the context never reads.
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    return test::skip(test::Missing::torch,
                      "/usr/bin/python3 cannot import torch (Debian: python3-torch)");
  }
  if (!fs::exists(reference_text)) {
    return test::skip(test::Missing::system_file,
                      reference_text + " is missing (Debian: base-files)");
  }
  TempDir tmp("gpt2-train");
  auto corpus = std::make_shared<const data::TextCorpus>(data::load_text(reference_text));
  const models::Gpt2Shape s{.vocab = corpus->vocab_size(),
                            .seq = 16,
                            .positions = 24,
                            .d_model = 32,
                            .heads = 4,
                            .layers = 2,
                            .dtype = DType::f64};
  const fs::path weights = tmp.path / "gpt2.safetensors",
                 batches = tmp.path / "batches.safetensors";
  write_batches(batches, *corpus, s.seq);
  const std::vector<double> theirs =
      torch_losses(fmt::format("/usr/bin/python3 {}/tests/gpt2_reference.py {} --vocab {} "
                               "--d-model {} --heads {} --layers {} --positions {} "
                               "--seq {} --batch {} --train {} --lr {}",
                               BATON_SOURCE_DIR, weights.string(), s.vocab, s.d_model, s.heads,
                               s.layers, s.positions, s.seq, ref_batch, batches.string(), ref_lr));
  Graph g(5);
  Value loss = models::gpt2_with_loss(g, ref_batch, s).loss;
  const std::vector<double> ours = train_from(g, loss, weights, "gpt2", corpus, s.seq);
  REQUIRE(theirs.size() == static_cast<std::size_t>(ref_steps));
  REQUIRE(ours.size() == static_cast<std::size_t>(ref_steps));
  // f64, as the Llama's: sums in other orders and libm, 1e-16 relative, carried through 20 Adam
  // steps; the losses, about 4, differ by a few 1e-15 at most: 1e-10.
  double worst = 0;
  for (std::size_t k = 0; k < ours.size(); ++k) {
    worst = std::max(worst, std::abs(ours[k] - theirs[k]));
    CHECK_MESSAGE(std::abs(ours[k] - theirs[k]) <= 1e-10,
                  "step " << k + 1 << ": baton " << ours[k] << ", torch " << theirs[k]);
  }
  CHECK(ours.back() < ours.front() - 0.3);
  fmt::print(
      "gpt2 vs torch (training, f64): step 1 {:.10f} / {:.10f}, step 20 {:.10f} / {:.10f}, max "
      "|difference| "
      "{:.3g}\n",
      ours[0], theirs[0], ours[19], theirs[19], worst);
}
