// baton-serve's engine (apps/serve): the decode step over a paged KV cache computes what the
// training model computes, continuous batching changes no request's tokens, and the engine's
// promises (a short request is not held up by a long one, a request that cannot fit waits, a
// cancelled one frees its blocks, a full queue refuses, weights swap between batches, memory
// stays flat) hold on real tiny models.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "baton/graph.h"
#include "baton/graph/program.h"
#include "baton/kernels/cuda.h"
#include "baton/transport/loopback.h"
#include "decode_models.h"
#include "engine.h"
#include "pipeline.h"
#include "sample.h"
#include "test_util.h"

using namespace baton;
using namespace baton::serve;
using namespace std::chrono_literals;

namespace {

DecodeModel tiny(DecodeModel::Kind kind, DType dtype, std::int64_t layers = 2) {
  DecodeModel m;
  m.kind = kind;
  m.gpt = models::GptShape{.vocab = 40, .seq = 48, .d_model = 32, .heads = 4, .layers = layers, .dtype = dtype};
  m.gpt2 = models::Gpt2Shape{.vocab = 40, .seq = 48, .positions = 48, .d_model = 32, .heads = 4, .layers = layers,
                             .dtype = dtype};
  // Grouped-query heads (2 kv heads for 4) and a head of its own.
  m.llama = models::LlamaShape{.vocab = 40, .seq = 48, .d_model = 32, .heads = 4, .kv_heads = 2, .ffn_hidden = 48,
                               .layers = layers, .dtype = dtype};
  return m;
}

// The training model's weights, redrawn larger than its initialisation (std 0.02 would leave
// every logit near 0 and greedy choices near ties): matrices N(0, 0.35), vectors 1 + N(0, 0.1)
// for norm gains and N(0, 0.1) for biases. Seeded: the same weights on every machine.
std::shared_ptr<ParameterStore> weights(const DecodeModel& m, std::uint64_t seed) {
  Graph g;
  m.full(g);
  auto params = ParameterStore::initialize(g);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);  // the draws differ by library; only the seed's run matters
  for (const auto& [name, t0] : params->values()) {
    Tensor& t = params->at(name);
    const bool bias = name.ends_with(".b") || name.ends_with(".bias") || name.find("mlp.b") != std::string::npos;
    const bool gain = !bias && (name.find("ln") != std::string::npos || name.find("norm") != std::string::npos);
    const bool matrix = t.shape().size() == 2;
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const double x = matrix ? 0.35 * normal(rng) : (gain ? 1.0 : 0.0) + 0.1 * normal(rng);
      if (t.dtype() == DType::f64) t.data<double>()[static_cast<std::size_t>(i)] = x;
      else t.data<float>()[static_cast<std::size_t>(i)] = static_cast<float>(x);
    }
  }
  return params;
}

double at(const Tensor& t, std::int64_t i) {
  return t.dtype() == DType::f64 ? t.data<double>()[static_cast<std::size_t>(i)]
                                 : static_cast<double>(t.data<float>()[static_cast<std::size_t>(i)]);
}

// The training model's logits at every position of `ids` (batch 1, padded to seq with the last
// id: a causal model's earlier positions never see the padding).
std::vector<std::vector<double>> full_logits(const DecodeModel& m, const ParameterStore& params,
                                             const std::vector<std::int32_t>& ids) {
  Graph g;
  Value logits = m.full(g);
  const std::int64_t seq = g.node(g.find("tokens").id()).shape[1];
  Tensor tokens = Tensor::empty({1, seq}, DType::i32);
  for (std::int64_t i = 0; i < seq; ++i)
    tokens.data<std::int32_t>()[static_cast<std::size_t>(i)] = ids[std::min<std::size_t>(static_cast<std::size_t>(i), ids.size() - 1)];
  Tensor targets = Tensor::zeros({seq}, DType::i32);
  const Tensor out = evaluate(g, {{"tokens", tokens}, {"targets", targets}}, {logits}, params)[0];
  std::vector<std::vector<double>> rows;
  for (std::size_t p = 0; p < ids.size(); ++p) {
    std::vector<double> row;
    for (std::int64_t v = 0; v < m.vocab(); ++v) row.push_back(at(out, static_cast<std::int64_t>(p) * m.vocab() + v));
    rows.push_back(std::move(row));
  }
  return rows;
}

std::int32_t argmax(const std::vector<double>& row) {
  return static_cast<std::int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// Greedy `tokens` after `prompt` against the training model run on the whole context for every
// token (no cache): checks each token while the reference's two best logits differ by more than
// 1e-3 and returns how many it compared. f32 sums in other orders round differently (~1e-6 of
// the logits' scale of a few units, on any OpenBLAS core type), so a nearer tie may flip and
// the runs part there: the comparison stops at the first such step.
int compare_with_full_pass(const DecodeModel& m, const ParameterStore& params, const std::vector<std::int32_t>& prompt,
                           const std::vector<std::int32_t>& tokens) {
  std::vector<std::int32_t> context = prompt;
  int compared = 0;
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    auto row = full_logits(m, params, context).back();
    std::vector<double> sorted = row;
    std::sort(sorted.rbegin(), sorted.rend());
    if (sorted[0] - sorted[1] <= 1e-3) break;
    CHECK_MESSAGE(tokens[k] == argmax(row), fmt::format("token {}", k));
    context.push_back(tokens[k]);
    ++compared;
  }
  return compared;
}

// One request's greedy run on an engine, or its sampled run with `seed`.
struct Run {
  std::vector<std::int32_t> tokens;
  std::string text;
  Finish finish = Finish::failed;
  Usage usage;
  std::string error;
  std::chrono::steady_clock::time_point started, ended;
  std::promise<void> done;
  std::shared_future<void> finished = done.get_future().share();
  std::atomic<int> count{0};  // tokens so far
  std::shared_future<void> gate;  // if valid, the first token's event waits for it (holds the engine)
};

std::shared_ptr<Run> submit(Engine& e, std::vector<std::int32_t> prompt, std::int64_t max_tokens,
                            Sampling sampling = {.temperature = 0}, std::vector<std::string> stop = {},
                            std::uint64_t* id_out = nullptr, std::shared_future<void> gate = {}) {
  auto run = std::make_shared<Run>();
  run->gate = std::move(gate);
  Request r{.prompt = std::move(prompt), .max_tokens = max_tokens, .sampling = sampling, .stop = std::move(stop)};
  r.events.started = [run] { run->started = std::chrono::steady_clock::now(); };
  r.events.token = [run](std::int32_t t, const std::string& text) {
    run->tokens.push_back(t);
    run->text += text;
    if (++run->count == 1 && run->gate.valid()) run->gate.wait();
  };
  r.events.finish = [run](Finish f, Usage u, const std::string& error) {
    run->finish = f;
    run->usage = u;
    run->error = error;
    run->ended = std::chrono::steady_clock::now();
    run->done.set_value();
  };
  REQUIRE(e.check(r).empty());
  std::uint64_t id = 0;
  REQUIRE(e.submit(std::move(r), id) == Backend::Admission::accepted);
  if (id_out != nullptr) *id_out = id;
  return run;
}

void wait(Run& r, std::chrono::seconds limit = 60s) {
  REQUIRE_MESSAGE(r.finished.wait_for(limit) == std::future_status::ready, "a request did not finish in time");
}

// A greedy request whose first token holds the engine until `release` is set: returns once that
// token came (the request runs, and the next ones queue behind the held step).
std::shared_ptr<Run> submit_held(Engine& e, std::vector<std::int32_t> prompt, std::int64_t max_tokens,
                                 std::promise<void>& release, std::uint64_t* id_out = nullptr) {
  auto run = submit(e, std::move(prompt), max_tokens, {.temperature = 0}, {}, id_out, release.get_future().share());
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (run->count == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  REQUIRE_MESSAGE(run->count > 0, "a held request gave no first token in 60 s");
  return run;
}

EngineSettings settings(const DecodeModel& m, std::shared_ptr<const ParameterStore> params) {
  return EngineSettings{.model = m, .model_id = "tiny", .params = std::move(params), .weights = "test",
                        .max_batch = 8, .max_batch_tokens = 32, .block_size = 4, .kv_cache_bytes = 64ll << 20,
                        .max_queue = 64};
}

std::vector<std::int32_t> prompt_of(std::size_t n, std::uint64_t seed, std::int64_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> p;
  for (std::size_t i = 0; i < n; ++i) p.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab)));
  return p;
}

}  // namespace

TEST_CASE("Serve.TheDecodeStepOverThePagedCacheComputesTheTrainingModelsLogits") {
  // f64: the step and the training model sum in other orders (attention over the cache in
  // double, the training model's T x T scores; matrix products of other row counts, which
  // OpenBLAS blocks differently on every core type), so the logits agree to rounding only:
  // f64's 1e-16 relative, grown by the few hundred terms of each sum, stays far below 1e-9 of the
  // logits' scale on Haswell, Zen, Sandybridge and SkylakeX alike.
  std::vector<DecodeModel> models;
  for (auto kind : {DecodeModel::Kind::gpt, DecodeModel::Kind::gpt2, DecodeModel::Kind::llama}) {
    models.push_back(tiny(kind, DType::f64));
  }
  models.push_back(tiny(DecodeModel::Kind::gpt, DType::f64));
  models.back().gpt.gelu = GeluApprox::tanh;  // a checkpoint of baton-train --gelu tanh
  for (const DecodeModel& m : models) {
    CAPTURE(m.name());
    CAPTURE(static_cast<int>(m.gpt.gelu));
    auto params = weights(m, 11);
    // 3 slots, 6 rows a step, blocks of 4: a prompt of 13 goes in three chunks, with another
    // request's rows in the same steps, then decodes one token a step.
    const StepShape shape{.rows = 6, .slots = 3, .blocks_per_slot = 12, .block_size = 4, .cache_blocks = 40};
    Graph g;
    Value logits = decode_step(g, m, shape);
    Program p(g, {logits}, params);
    const Shape cache{shape.cache_blocks, shape.block_size, m.kv_heads(), m.head_dim()};
    for (std::int64_t l = 0; l < m.layers(); ++l) {
      p.input(fmt::format("cache.k.{}", l)) = Tensor::zeros(cache, m.dtype());
      p.input(fmt::format("cache.v.{}", l)) = Tensor::zeros(cache, m.dtype());
    }
    auto* table = p.input("block_table").data<std::int32_t>().data();
    // Slot 2's blocks scattered (37, 3, 20, ...), slot 0's the others: the table, not the order, places them.
    std::vector<std::int32_t> blocks(40);
    for (int i = 0; i < 40; ++i) blocks[static_cast<std::size_t>(i)] = (i * 17 + 3) % 40;
    for (int i = 0; i < 12; ++i) {
      table[2 * 12 + i] = blocks[static_cast<std::size_t>(i)];
      table[0 * 12 + i] = blocks[static_cast<std::size_t>(12 + i)];
      table[1 * 12 + i] = -1;
    }
    std::vector<std::vector<std::int32_t>> seqs{prompt_of(13, 1, m.vocab()), {}, prompt_of(2, 2, m.vocab())};
    std::vector<std::size_t> fed(3, 0);
    double worst = 0, scale = 0;
    for (int step = 0; step < 20; ++step) {
      auto* tokens = p.input("tokens").data<std::int32_t>().data();
      auto* positions = p.input("positions").data<std::int32_t>().data();
      auto* slots = p.input("slots").data<std::int32_t>().data();
      std::vector<std::pair<int, int>> last_row;  // (slot, row)
      int row = 0;
      for (int s : {2, 0}) {  // slot 2 decodes (1 row), slot 0 prefills with what is left
        const std::size_t n = std::min<std::size_t>(seqs[static_cast<std::size_t>(s)].size() - fed[static_cast<std::size_t>(s)], static_cast<std::size_t>(6 - row));
        for (std::size_t i = 0; i < n; ++i, ++row) {
          tokens[row] = seqs[static_cast<std::size_t>(s)][fed[static_cast<std::size_t>(s)] + i];
          positions[row] = static_cast<std::int32_t>(fed[static_cast<std::size_t>(s)] + i);
          slots[row] = s;
        }
        fed[static_cast<std::size_t>(s)] += n;
        if (n > 0 && fed[static_cast<std::size_t>(s)] == seqs[static_cast<std::size_t>(s)].size()) last_row.emplace_back(s, row - 1);
      }
      for (; row < 6; ++row) slots[row] = -1;
      auto* sample = p.input("sample_rows").data<std::int32_t>().data();
      for (std::size_t k = 0; k < 3; ++k) sample[k] = k < last_row.size() ? last_row[k].second : 0;
      const Tensor& out = p.run()[0];
      for (std::size_t k = 0; k < last_row.size(); ++k) {
        const int s = last_row[k].first, r = static_cast<int>(k);  // the logits' row k is sample_rows[k]
        auto& seq = seqs[static_cast<std::size_t>(s)];
        const auto ref = full_logits(m, *params, seq).back();
        std::vector<double> got;
        for (std::int64_t v = 0; v < m.vocab(); ++v) got.push_back(at(out, r * m.vocab() + v));
        for (std::size_t v = 0; v < got.size(); ++v) {
          worst = std::max(worst, std::abs(got[v] - ref[v]));
          scale = std::max(scale, std::abs(ref[v]));
        }
        seq.push_back(argmax(ref));  // greedy, by the reference
      }
    }
    CHECK(seqs[2].size() == 2 + 20);
    CHECK(seqs[0].size() > 13 + 15);
    CHECK(scale > 1.0);  // logits far from 0: the weights make real choices
    CHECK_MESSAGE(worst <= 1e-9 * scale, fmt::format("{}: largest logit difference {:.3g} at scale {:.3g}", m.name(), worst, scale));
  }
}

namespace {

/// The logits of `steps` decode steps of `m` over a paged cache on `device`: two requests, one
/// prefilling its prompt of 13 in chunks while the other decodes, fed fixed tokens (not the
/// program's own choices, so that two devices see the same inputs whatever they compute). The
/// caches are given at construction, in the device's memory, as baton-serve gives them.
/// With `graphs`, the program captures its kernels at the second run and launches the graph from
/// then on; with `swap`, new weights come in before step 8 (set_params), as a --watch swap does.
std::vector<Tensor> decode_on(const DecodeModel& m, std::shared_ptr<const ParameterStore> params, Device device,
                              int steps, bool graphs = false, std::shared_ptr<const ParameterStore> swap = nullptr,
                              std::string* status = nullptr) {
  const StepShape shape{.rows = 6, .slots = 3, .blocks_per_slot = 12, .block_size = 4, .cache_blocks = 40};
  Graph g;
  Value logits = decode_step(g, m, shape);
  const Shape cache{shape.cache_blocks, shape.block_size, m.kv_heads(), m.head_dim()};
  std::unique_ptr<Allocator> memory = Program::device_allocator(device);
  std::map<std::string, Tensor> caches;
  for (std::int64_t l = 0; l < m.layers(); ++l) {
    for (const char* kv : {"k", "v"}) {
      Tensor zeros = Tensor::zeros(cache, m.dtype());
      Tensor c = memory ? Tensor::empty(cache, m.dtype(), *memory) : zeros;
      if (memory) {
        auto up = cuda::Stream::create(device, "test upload");
        cuda::copy(c, zeros, *up);
        up->synchronize();
      }
      caches[fmt::format("cache.{}.{}", kv, l)] = c;
    }
  }
  Program p(g, {logits}, params, caches, KernelRegistry::with_builtin_kernels(), device);
  CHECK(p.device() == device);
  p.use_graphs(graphs);
  auto* table = p.input("block_table").data<std::int32_t>().data();
  for (int i = 0; i < 12; ++i) {
    table[2 * 12 + i] = (i * 17 + 3) % 40;
    table[0 * 12 + i] = ((12 + i) * 17 + 3) % 40;
    table[1 * 12 + i] = -1;
  }
  const std::vector<std::int32_t> feed = prompt_of(13 + steps, 1, m.vocab()), other = prompt_of(2 + steps, 2, m.vocab());
  std::size_t fed0 = 0, fed2 = 0;
  std::vector<Tensor> out;
  for (int step = 0; step < steps; ++step) {
    if (swap && step == 8) p.set_params(swap);
    auto* tokens = p.input("tokens").data<std::int32_t>().data();
    auto* positions = p.input("positions").data<std::int32_t>().data();
    auto* slots = p.input("slots").data<std::int32_t>().data();
    int row = 0;
    auto put = [&](int slot, const std::vector<std::int32_t>& seq, std::size_t& fed, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i, ++row, ++fed) {
        tokens[row] = seq[fed];
        positions[row] = static_cast<std::int32_t>(fed);
        slots[row] = slot;
      }
    };
    put(2, other, fed2, step == 0 ? 2 : 1);                                   // decodes
    put(0, feed, fed0, fed0 < 13 ? std::min<std::size_t>(13 - fed0, 4) : 1);  // prefills in chunks, then decodes
    const int live = row;
    for (; row < 6; ++row) slots[row] = -1;
    auto* sample = p.input("sample_rows").data<std::int32_t>().data();
    sample[0] = 0;
    sample[1] = live - 1;
    sample[2] = 0;
    const Tensor& logits_now = p.run()[0];
    Tensor copy = Tensor::empty(logits_now.shape(), logits_now.dtype());
    std::memcpy(copy.raw(), logits_now.raw(), copy.nbytes());
    out.push_back(copy);
  }
  if (status != nullptr) *status = fmt::format("{} ({} launches)", p.graph_status(), p.graph_launches());
  return out;
}

bool same_bits(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].nbytes() != b[i].nbytes() || std::memcmp(a[i].raw(), b[i].raw(), a[i].nbytes()) != 0) return false;
  }
  return true;
}

}  // namespace

// A Program on an asynchronous device (apps/serve's stages on a GPU): the device's kernels on
// the program's stream, weights uploaded once, inputs written on the host and copied over at
// each run, the KV caches where the caller put them, the logits copied back. On a sim device the
// kernels are the CPU's, run in the same order, so the logits must be the CPU's bit for bit: a
// copy missing, late or from a stale input, or a cache not kept from step to step, shows.
TEST_CASE("Serve.TheDecodeStepOnASimDeviceGivesTheHostsLogitsBitForBit") {
  for (auto kind : {DecodeModel::Kind::gpt, DecodeModel::Kind::gpt2, DecodeModel::Kind::llama}) {
    const DecodeModel m = tiny(kind, DType::f32);
    CAPTURE(m.name());
    auto params = weights(m, 3);
    const std::vector<Tensor> cpu = decode_on(m, params, Device{}, 16);
    const std::vector<Tensor> sim = decode_on(m, params, Device::parse("sim:0"), 16);
    REQUIRE(cpu.size() == sim.size());
    for (std::size_t i = 0; i < cpu.size(); ++i) {
      CAPTURE(i);
      CHECK(std::memcmp(cpu[i].raw(), sim[i].raw(), cpu[i].nbytes()) == 0);
    }
  }
}

// The decode step captured into a graph (Program::use_graphs: a CUDA graph on a GPU; on a sim
// device the recorded closures, replayed with the arguments they were captured with, which is
// what a CUDA graph does): from the second step on one launch runs every kernel, on the same
// buffers, and the logits stay the CPU's bit for bit, also across a weight swap (new weights
// written into the same device memory). A graph replaying stale inputs, or one captured before
// a kernel's lazy set-up, shows here.
TEST_CASE("Serve.TheDecodeStepAsAGraphGivesTheSameLogits") {
  for (auto kind : {DecodeModel::Kind::gpt, DecodeModel::Kind::gpt2, DecodeModel::Kind::llama}) {
    const DecodeModel m = tiny(kind, DType::f32);
    CAPTURE(m.name());
    auto params = weights(m, 3), other = weights(m, 4);
    const std::vector<Tensor> cpu = decode_on(m, params, Device{}, 16, false, other);
    std::string status;
    const std::vector<Tensor> sim = decode_on(m, params, Device::parse("sim:0"), 16, true, other, &status);
    CHECK(status == "captured (15 launches)");
    CHECK(same_bits(cpu, sim));
    CHECK_FALSE(same_bits(cpu, decode_on(m, params, Device{}, 16)));  // the swap changed the logits
  }
}

// What a GPU stage needs before any GPU runs it: every op of the three models' decode steps (one
// stage, and the two stages of a pipeline) has a CUDA kernel of its dtype, so that
// `baton-serve --device cuda:0` does not fail at start naming a node. Needs a CUDA build only.
TEST_CASE("Serve.EveryOpOfTheDecodeStepHasACudaKernel") {
  if (!test::cuda_built()) return;
  const KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  for (auto kind : {DecodeModel::Kind::gpt, DecodeModel::Kind::gpt2, DecodeModel::Kind::llama}) {
    const DecodeModel m = tiny(kind, DType::f32);
    CAPTURE(m.name());
    for (auto [first, end] : std::vector<std::pair<std::int64_t, std::int64_t>>{{0, -1}, {0, 1}, {1, -1}}) {
      Graph g;
      decode_step(g, m, StepShape{.rows = 4, .slots = 2, .blocks_per_slot = 3, .block_size = 4, .cache_blocks = 8,
                                  .first_layer = first, .end_layer = end});
      for (int id = 0; id < g.size(); ++id) {
        const Node& n = g.node(id);
        if (n.op == "input" || n.op == "variable" || n.op == "reshape") continue;
        CAPTURE(n.name);
        // The dtype Program looks the kernel up with (as the plan's): the node's if floating, else
        // its first floating input's, else f32.
        DType dt = n.dtype;
        if (!is_floating(dt)) {
          dt = DType::f32;
          for (int in : n.inputs) {
            if (is_floating(g.node(in).dtype)) {
              dt = g.node(in).dtype;
              break;
            }
          }
        }
        CHECK_MESSAGE(kernels.contains(n.op, DeviceType::cuda, dt), n.op << " has no cuda/" << name(dt));
      }
    }
  }
}

// The same on the GPU (cuda:0; skipped without one), in f32 against the CPU within a tolerance:
// cuBLAS and the decode kernels sum in other orders than OpenBLAS and the CPU's kernels (f32's
// 6e-8 relative over sums of at most a few hundred terms here, a few 1e-6 of the logits' scale
// on any OpenBLAS core type): 1e-4 of the scale bounds it with room.
TEST_CASE("Serve.TheDecodeStepOnTheGpuGivesTheHostsLogits") {
  if (!test::cuda_usable()) return;
  for (auto kind : {DecodeModel::Kind::gpt, DecodeModel::Kind::gpt2, DecodeModel::Kind::llama}) {
    const DecodeModel m = tiny(kind, DType::f32);
    CAPTURE(m.name());
    auto params = weights(m, 3);
    const std::vector<Tensor> cpu = decode_on(m, params, Device{}, 16);
    const std::vector<Tensor> gpu = decode_on(m, params, Device::parse("cuda:0"), 16);
    // As a CUDA graph from the second step on: the same kernels on the same buffers, the same bits.
    std::string status;
    const std::vector<Tensor> graph = decode_on(m, params, Device::parse("cuda:0"), 16, true, nullptr, &status);
    CHECK(status == "captured (15 launches)");
    CHECK(same_bits(gpu, graph));
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < cpu.size(); ++i) {
      for (std::int64_t j = 0; j < cpu[i].numel(); ++j) {
        worst = std::max(worst, std::abs(at(cpu[i], j) - at(gpu[i], j)));
        scale = std::max(scale, std::abs(at(cpu[i], j)));
      }
    }
    CHECK(scale > 1.0);
    CHECK_MESSAGE(worst <= 1e-4 * scale, fmt::format("{}: largest difference {:.3g} at scale {:.3g}", m.name(), worst, scale));
  }
}

// The engine (continuous batching, the cache's blocks, pp 2 in this process) with its stages on
// sim devices (baton-serve --device sim:0): the same tokens as on the CPU, greedy and sampled,
// several requests at once. Two stages: the hidden state crosses from one device's program to
// the next through the host, as it does between GPUs.
TEST_CASE("Serve.AnEngineOnASimDeviceGivesTheCpusTokens") {
  for (auto kind : {DecodeModel::Kind::gpt, DecodeModel::Kind::llama}) {
    const DecodeModel m = tiny(kind, DType::f32);
    CAPTURE(m.name());
    auto params = weights(m, 7);
    auto tokens = [&](Device device) {
      EngineSettings s = settings(m, params);
      s.device = device;
      s.pp = 2;
      Engine e(s);
      std::vector<std::shared_ptr<Run>> runs;
      for (std::uint64_t i = 0; i < 4; ++i) {
        const Sampling sampling = i % 2 == 0 ? Sampling{.temperature = 0}
                                             : Sampling{.temperature = 0.8, .top_p = 0.9, .seed = 40 + i};
        runs.push_back(submit(e, prompt_of(5 + 3 * i, 20 + i, m.vocab()), 12 + 4 * static_cast<std::int64_t>(i), sampling));
      }
      std::vector<std::vector<std::int32_t>> out;
      for (auto& r : runs) {
        wait(*r);
        CHECK(r->error.empty());
        out.push_back(r->tokens);
      }
      return out;
    };
    const auto cpu = tokens(Device{});
    const auto sim = tokens(Device::parse("sim:0"));
    CHECK(cpu == sim);
    CHECK(cpu[3].size() == 24);
  }
}

TEST_CASE("Serve.GreedyGenerationEqualsTheFullForwardPassWithoutACache") {
  // f32, the engine against sample::generate (the training model run on the whole context for
  // every token, no cache): the same tokens while the reference's two best logits differ by more
  // than 1e-3. The two sum in other orders (f32 rounding, ~1e-6 of the logits' scale of a few
  // units, on any OpenBLAS core type), so a nearer tie may flip and the runs part there: the test
  // stops comparing at the first such step, and asserts that most steps were compared.
  for (auto kind : {DecodeModel::Kind::gpt, DecodeModel::Kind::gpt2, DecodeModel::Kind::llama}) {
    const DecodeModel m = tiny(kind, DType::f32);
    CAPTURE(m.name());
    auto params = weights(m, 5);
    Engine e(settings(m, params));
    const auto prompt = prompt_of(7, 9, m.vocab());
    auto run = submit(e, prompt, 30);
    wait(*run);
    CHECK(run->finish == Finish::length);
    CHECK(run->usage.completion_tokens == 30);
    const int compared = compare_with_full_pass(m, *params, prompt, run->tokens);
    CHECK(compared >= 20);
  }
}

TEST_CASE("Serve.ABatchChangesNoRequestsTokensGreedyOrSampled") {
  // f64 (rounding far below any choice): each request alone, then all eight at once with other
  // prompts' chunks in their steps, give the same tokens; sampled ones too, from their seeds.
  const DecodeModel m = tiny(DecodeModel::Kind::llama, DType::f64);
  auto params = weights(m, 3);
  Engine e(settings(m, params));
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<Sampling> sampling;
  for (int i = 0; i < 8; ++i) {
    prompts.push_back(prompt_of(static_cast<std::size_t>(1 + 5 * i), 100 + static_cast<std::uint64_t>(i), m.vocab()));
    sampling.push_back(i % 2 == 0 ? Sampling{.temperature = 0}
                                  : Sampling{.temperature = 1.0, .top_p = 0.9, .seed = 1000 + static_cast<std::uint64_t>(i)});
  }
  std::vector<std::vector<std::int32_t>> alone;
  for (int i = 0; i < 8; ++i) {
    auto r = submit(e, prompts[static_cast<std::size_t>(i)], 8, sampling[static_cast<std::size_t>(i)]);
    wait(*r);
    alone.push_back(r->tokens);
  }
  std::vector<std::shared_ptr<Run>> together;
  for (int i = 0; i < 8; ++i) together.push_back(submit(e, prompts[static_cast<std::size_t>(i)], 8, sampling[static_cast<std::size_t>(i)]));
  for (int i = 0; i < 8; ++i) {
    wait(*together[static_cast<std::size_t>(i)]);
    CHECK_MESSAGE(together[static_cast<std::size_t>(i)]->tokens == alone[static_cast<std::size_t>(i)], fmt::format("request {}", i));
  }
  // Another seed draws other tokens (a check that the seed is used at all).
  auto other = submit(e, prompts[1], 8, Sampling{.temperature = 1.0, .top_p = 0.9, .seed = 77});
  wait(*other);
  CHECK(other->tokens != alone[1]);
}

TEST_CASE("Serve.AShortRequestAdmittedWhileALongOneRunsFinishesFirst") {
  // The long request's first token holds the engine until the short one is queued: it then
  // joins the running batch at the next step and ends 2 steps later, 38 before the long one.
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f32);
  Engine e(settings(m, weights(m, 1)));
  std::promise<void> release;
  auto long_run = submit_held(e, prompt_of(4, 1, m.vocab()), 40, release);
  auto short_run = submit(e, prompt_of(4, 2, m.vocab()), 2);
  release.set_value();
  wait(*short_run);
  wait(*long_run);
  CHECK(short_run->ended < long_run->ended);
  CHECK(long_run->tokens.size() == 40);
}

TEST_CASE("Serve.StaticBatchingHoldsAShortRequestBehindALongOne") {
  // The comparison of the benchmark: continuous batching off, a short request waits for the
  // running batch to end.
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f32);
  auto s = settings(m, weights(m, 1));
  s.continuous = false;
  Engine e(s);
  std::promise<void> release;
  auto long_run = submit_held(e, prompt_of(4, 1, m.vocab()), 40, release);
  auto short_run = submit(e, prompt_of(4, 2, m.vocab()), 2);
  release.set_value();
  wait(*short_run);
  wait(*long_run);
  CHECK(short_run->started >= long_run->ended);
}

TEST_CASE("Serve.ARequestThatCannotFitWaitsAndACancelledOneFreesItsBlocks") {
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f32);
  auto s = settings(m, weights(m, 1));
  // Room for one request of the whole context (48 positions: 12 blocks of 4), no more.
  s.kv_cache_bytes = 12 * (m.layers() * 2 * 4 * m.kv_heads() * m.head_dim() * 4);
  Engine e(s);
  CHECK(e.cache_tokens() == 48);
  std::uint64_t first_id = 0;
  std::promise<void> release;
  auto first = submit_held(e, prompt_of(8, 1, m.vocab()), 40, release, &first_id);
  auto second = submit(e, prompt_of(8, 2, m.vocab()), 20);
  CHECK(e.stats().waiting == 1);  // its 7 blocks are not free: it waits, it does not fail
  CHECK(e.stats().kv_cache_usage == 1.0);
  e.cancel(first_id);
  release.set_value();
  wait(*first);
  CHECK(first->finish == Finish::cancelled);
  wait(*second);
  CHECK(second->finish == Finish::length);
  CHECK(second->started > first->ended - 1ms);
  const Stats st = e.stats();
  CHECK(st.kv_cache_usage == 0.0);
  CHECK(st.running == 0);
}

TEST_CASE("Serve.AFullQueueRefusesAndADrainLetsTheRunningFinish") {
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f32);
  auto s = settings(m, weights(m, 1));
  s.max_batch = 1;
  s.max_queue = 1;
  Engine e(s);
  std::promise<void> release;
  auto running = submit_held(e, prompt_of(4, 1, m.vocab()), 40, release);
  auto queued = submit(e, prompt_of(4, 2, m.vocab()), 4);
  std::uint64_t id = 0;
  CHECK(e.submit(Request{.prompt = {1}, .max_tokens = 1}, id) == Backend::Admission::queue_full);
  release.set_value();
  e.drain(std::chrono::steady_clock::now() + 60s);
  CHECK(e.submit(Request{.prompt = {1}, .max_tokens = 1}, id) == Backend::Admission::draining);
  wait(*running);
  wait(*queued);
  CHECK(running->finish == Finish::length);
  CHECK(queued->finish == Finish::length);
}

TEST_CASE("Serve.WeightsSwapBetweenBatchesAndEachRequestSeesOneSetWhole") {
  // Drain-then-swap: the request that runs when the swap is asked for ends with the old weights
  // (its tokens are the old weights' alone), the one queued meanwhile runs with the new.
  const DecodeModel m = tiny(DecodeModel::Kind::gpt2, DType::f64);
  auto old_w = weights(m, 1), new_w = weights(m, 2);
  const auto p1 = prompt_of(5, 1, m.vocab()), p2 = prompt_of(5, 2, m.vocab());
  std::vector<std::int32_t> old_alone, new_alone;
  {
    Engine e(settings(m, old_w));
    auto r = submit(e, p1, 30);
    wait(*r);
    old_alone = r->tokens;
  }
  {
    Engine e(settings(m, new_w));
    auto r = submit(e, p2, 10);
    wait(*r);
    new_alone = r->tokens;
  }
  Engine e(settings(m, old_w));
  std::promise<void> release;
  auto before = submit_held(e, p1, 30, release);
  std::thread swapper([&] { e.swap_weights(new_w, "step 2", std::chrono::steady_clock::now() + 60s); });
  while (!e.stats().swapping) std::this_thread::sleep_for(1ms);
  auto after = submit(e, p2, 10);
  release.set_value();
  swapper.join();
  wait(*before);
  wait(*after);
  CHECK(after->started >= before->ended);
  CHECK(before->tokens == old_alone);
  CHECK(after->tokens == new_alone);
  CHECK(e.stats().weights == "step 2");
  // Weights of another shape are refused, the old stay.
  auto bad = std::make_shared<ParameterStore>(*new_w);
  bad->set("wte.weight", Tensor::zeros({3, 3}, DType::f64));
  CHECK_THROWS_WITH_AS(e.swap_weights(bad, "bad", std::chrono::steady_clock::now() + 5s), doctest::Contains("wte.weight"),
                       std::invalid_argument);
  CHECK(e.stats().weights == "step 2");
}

TEST_CASE("Serve.BadRequestsAreNamedAndTheEngineRefusesACacheTooSmall") {
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f32);
  Engine e(settings(m, weights(m, 1)));
  CHECK(e.check(Request{.prompt = {}, .max_tokens = 1}).find("prompt") == 0);
  CHECK(e.check(Request{.prompt = {40}, .max_tokens = 1}).find("outside the vocabulary") != std::string::npos);
  CHECK(e.check(Request{.prompt = {1}, .max_tokens = 0}).find("max_tokens") == 0);
  CHECK(e.check(Request{.prompt = {1, 2}, .max_tokens = 47}).find("context is 48 tokens") != std::string::npos);
  CHECK(e.check(Request{.prompt = {1}, .max_tokens = 1, .stop = {"x"}}).find("tokenizer") != std::string::npos);
  CHECK(e.check(Request{.prompt = {1, 2}, .max_tokens = 46}).empty());
  auto s = settings(m, weights(m, 1));
  s.kv_cache_bytes = 1000;
  CHECK_THROWS_WITH_AS(Engine{s}, doctest::Contains("fewer than one request of the whole context"), std::invalid_argument);
}

TEST_CASE("Serve.TextStopsAtAStopStringAndNeverSendsItsBeginning") {
  // A byte model: the completion is text, a stop string ends it before the string, and no piece
  // sent before ever held the beginning of a stop string that then matched.
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f64);
  std::vector<unsigned char> vocab;
  for (int c = 0; c < 40; ++c) vocab.push_back(static_cast<unsigned char>('A' + c));  // 'A' .. 'h'
  auto s = settings(m, weights(m, 4));
  s.codec = byte_codec(vocab);
  Engine e(s);
  const auto prompt = e.encode("ABCD");
  auto free_run = submit(e, prompt, 30);
  wait(*free_run);
  REQUIRE(free_run->text.size() == 30);
  // Stop at the 3 characters found at offset 10 of the free run.
  const std::string stop = free_run->text.substr(10, 3);
  auto stopped = submit(e, prompt, 30, {.temperature = 0}, {stop});
  wait(*stopped);
  CHECK(stopped->finish == Finish::stop);
  CHECK(stopped->text == free_run->text.substr(0, free_run->text.find(stop)));
  CHECK_THROWS_WITH_AS(e.encode("AB~"), doctest::Contains("byte 0x7e"), std::invalid_argument);
}

TEST_CASE("Serve.MemoryStaysFlatOverManyRequests") {
  // The soak: BATON_SERVE_SOAK requests (default 100000; the sanitizer stages run fewer) of a
  // tiny model, 8 at a time; the resident set after the first tenth and at the end differ by
  // less than 4 MiB (the allocator's slack; a leak of even 64 bytes a request would show 6 MiB).
  const char* knob = std::getenv("BATON_SERVE_SOAK");
  const long total = knob != nullptr ? std::atol(knob) : 100000;
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f32);
  Engine e(settings(m, weights(m, 1)));
  auto rss = [] {
    std::ifstream in("/proc/self/statm");
    long pages = 0, resident = 0;
    in >> pages >> resident;
    return resident * 4096L;
  };
  long base = 0;
  std::atomic<long> finished{0};
  std::mutex mu;
  std::condition_variable cv;
  long in_flight = 0;
  for (long i = 0; i < total; ++i) {
    {
      std::unique_lock lock(mu);
      REQUIRE(cv.wait_for(lock, 60s, [&] { return in_flight < 8; }));
      ++in_flight;
    }
    Request r{.prompt = {static_cast<std::int32_t>(i % 40), 3}, .max_tokens = 2, .sampling = {.temperature = 0}};
    r.events.finish = [&](Finish f, Usage, const std::string&) {
      if (f == Finish::length) ++finished;
      std::lock_guard lock(mu);
      --in_flight;
      cv.notify_all();
    };
    std::uint64_t id = 0;
    REQUIRE(e.submit(std::move(r), id) == Backend::Admission::accepted);
    if (i == total / 10) base = rss();
  }
  {
    std::unique_lock lock(mu);
    REQUIRE(cv.wait_for(lock, 60s, [&] { return in_flight == 0; }));
  }
  CHECK(finished == total);
  const long grown = rss() - base;
  MESSAGE(fmt::format("{} requests, resident set grew {} KiB after the first tenth", total, grown / 1024));
#if defined(__SANITIZE_ADDRESS__)
  // Under AddressSanitizer freed memory waits in its quarantine (up to 256 MiB) before it is
  // reused, so the resident set grows with any allocation: there LeakSanitizer, at exit, is the
  // check that nothing is lost.
  MESSAGE("AddressSanitizer: the resident set is not compared (its quarantine holds freed memory)");
#else
  CHECK(grown < 4L << 20);
#endif
}

namespace {

// A model cut across pp x tp ranks inside this process (a LoopbackHub in place of the job's UCX
// data plane): rank 0's RankPipeline for an engine, ranks 1.. (shard r % tp of stage r / tp)
// running serve_stage on threads, as baton-serve's ranks do. `silent`: ranks 1.. never run (a
// rank that hangs).
struct RankedPipeline {
  RankedPipeline(const DecodeModel& m, std::shared_ptr<const ParameterStore> params, std::int64_t pp, std::int64_t tp,
                 const EngineSettings& base, std::chrono::milliseconds step_timeout = 30s, bool silent = false)
      : hub(static_cast<std::uint32_t>(pp * tp)), layers(stage_layers(m.layers(), pp)) {
    const std::int64_t world = pp * tp;
    for (std::uint32_t r = 0; r < world; ++r) links.push_back(std::make_unique<StageLink>(hub.link(r)));
    hub.start();
    std::int64_t cache_layers = 0;
    for (const auto& [b, e] : layers) cache_layers = std::max(cache_layers, e - b);
    const ServeShape shape =
        serve_shape(m, base.max_batch, base.max_batch_tokens, base.block_size, base.kv_cache_bytes, cache_layers, tp);
    for (std::int64_t r = 0; r < world; ++r) {
      groups.push_back(tp > 1 ? TpGroup::of_stage(*links[static_cast<std::size_t>(r)], r / tp, r % tp, tp, step_timeout)
                              : nullptr);
    }
    // Each rank keeps only its shard of its stage's weights, as baton-serve's do. Built here, on
    // one thread: building graphs is not thread-safe (a process builds its own), running them is.
    for (std::int64_t r = 1; r < world && !silent; ++r) {
      const auto part = layers[static_cast<std::size_t>(r / tp)];
      stages.push_back(std::make_unique<Stage>(m, part, shape, stage_weights(m, part, *params, tp, r % tp), tp, r % tp,
                                               groups[static_cast<std::size_t>(r)].get()));
    }
    for (std::int64_t r = 1; r < world && !silent; ++r) {
      workers.emplace_back([this, r, pp, tp] {
        try {
          serve_stage(*stages[static_cast<std::size_t>(r - 1)], *links[static_cast<std::size_t>(r)],
                      static_cast<std::uint32_t>(r), pp, tp);
        } catch (const std::exception& e) {
          {
            std::lock_guard lock(mutex);
            errors += fmt::format("rank {}: {}\n", r, e.what());
          }
          // What the control plane does when a rank fails: every rank hears it.
          for (auto& l : links) l->abort(fmt::format("rank {} failed: {}", r, e.what()));
        }
      });
    }
    settings = base;
    settings.cache_layers = cache_layers;
    settings.runner = [this, m, params, pp, tp, step_timeout](const ServeShape& sh) -> std::unique_ptr<StepRunner> {
      return std::make_unique<RankPipeline>(
          std::make_unique<Stage>(m, layers[0], sh, stage_weights(m, layers[0], *params, tp, 0), tp, 0, groups[0].get()),
          pp, tp, *links[0], m, sh.slots, step_timeout);
    };
  }
  // After the engine: the stages stop as baton-serve's do (rank 0 says so), or the link fails.
  void finish() {
    stop_stages(*links[0], static_cast<std::int64_t>(links.size()));
    for (auto& w : workers) w.join();
    workers.clear();
  }
  ~RankedPipeline() {
    for (auto& l : links) l->abort("the test ended");
    for (auto& w : workers) w.join();
    hub.stop();
  }

  transport::LoopbackHub hub;
  std::vector<std::pair<std::int64_t, std::int64_t>> layers;
  std::vector<std::unique_ptr<StageLink>> links;
  std::vector<std::unique_ptr<TpGroup>> groups;  // by rank
  std::vector<std::unique_ptr<Stage>> stages;    // ranks 1..
  std::vector<std::thread> workers;
  EngineSettings settings;
  std::mutex mutex;
  std::string errors;
};

// Six requests at once (prompts of 1..26 tokens, so chunked prefill shares steps with decoding;
// greedy and seeded sampling in turn): their tokens.
std::vector<std::vector<std::int32_t>> six_requests(Engine& e, std::int64_t vocab) {
  std::vector<std::shared_ptr<Run>> runs;
  for (int i = 0; i < 6; ++i) {
    const Sampling s = i % 2 == 0 ? Sampling{.temperature = 0}
                                  : Sampling{.temperature = 1.0, .top_p = 0.9, .seed = 500 + static_cast<std::uint64_t>(i)};
    runs.push_back(submit(e, prompt_of(static_cast<std::size_t>(1 + 5 * i), 40 + static_cast<std::uint64_t>(i), vocab), 10, s));
  }
  std::vector<std::vector<std::int32_t>> tokens;
  for (auto& r : runs) {
    wait(*r);
    CHECK(r->finish == Finish::length);
    tokens.push_back(r->tokens);
  }
  return tokens;
}

}  // namespace

TEST_CASE("Serve.PipelineAndTensorParallelCutsGiveOneDevicesTokens") {
  // The decode step cut into 2 and 3 stages (layers 2+1, 1+1+1 of 3) in one process, and across
  // ranks as pp x tp = 2 x 1, 3 x 1, 1 x 2 and 2 x 2 (each rank holding its shard of its stage's
  // weights and caches only): the same tokens as one device, greedy and sampled, for six
  // requests at once. f64: a pipeline cut changes no sum's order (each stage runs the same
  // kernels on the same rows; the hidden state is copied whole); a tensor-parallel cut splits
  // each output projection's sum in two halves added after (a change of f64 rounding, ~1e-16 of
  // the logits), far below any greedy choice here and any sampled one but with odds of ~1e-14
  // a draw, so the tokens must agree exactly.
  for (auto kind : {DecodeModel::Kind::gpt, DecodeModel::Kind::gpt2, DecodeModel::Kind::llama}) {
    const DecodeModel m = tiny(kind, DType::f64, 3);
    CAPTURE(m.name());
    auto params = weights(m, 21);
    std::vector<std::vector<std::int32_t>> one;
    {
      Engine e(settings(m, params));
      one = six_requests(e, m.vocab());
    }
    for (std::int64_t pp : {2, 3}) {
      CAPTURE(pp);
      auto s = settings(m, params);
      s.pp = pp;
      Engine e(s);
      CHECK(six_requests(e, m.vocab()) == one);
      // Each stage's time in the steps, for the dashboard.
      const auto busy = e.stats().stage_busy_seconds;
      CHECK(busy.size() == static_cast<std::size_t>(pp));
      for (double b : busy) CHECK(b > 0);
    }
    // pp x tp: 2 x 1, 3 x 1, 1 x 2 (the heads and MLP cut, partial sums added across ranks), 2 x 2.
    for (auto [pp, tp] : {std::pair<std::int64_t, std::int64_t>{2, 1}, {3, 1}, {1, 2}, {2, 2}}) {
      CAPTURE(pp);
      CAPTURE(tp);
      RankedPipeline ranks(m, params, pp, tp, settings(m, params));
      {
        Engine e(ranks.settings);
        CHECK(six_requests(e, m.vocab()) == one);
        CHECK(e.failure().empty());
        // Every stage's time came back with the logits.
        const auto busy = e.stats().stage_busy_seconds;
        CHECK(busy.size() == static_cast<std::size_t>(pp));
        for (double b : busy) CHECK(b > 0);
      }
      ranks.finish();
      CHECK(ranks.errors.empty());
    }
  }
}

TEST_CASE("Serve.GreedyGenerationOnTwoStagesOfTwoShardsEqualsTheFullForwardPass") {
  // f32 on pp 2 x tp 2 (4 ranks) against the training model without a cache
  // (compare_with_full_pass says why a near-tie ends the comparison).
  for (auto kind : {DecodeModel::Kind::gpt2, DecodeModel::Kind::llama}) {
    const DecodeModel m = tiny(kind, DType::f32);
    CAPTURE(m.name());
    auto params = weights(m, 5);
    RankedPipeline ranks(m, params, 2, 2, settings(m, params));
    {
      Engine e(ranks.settings);
      const auto prompt = prompt_of(7, 9, m.vocab());
      auto run = submit(e, prompt, 30);
      wait(*run);
      REQUIRE(run->tokens.size() == 30);
      CHECK(compare_with_full_pass(m, *params, prompt, run->tokens) >= 20);
    }
    ranks.finish();
    CHECK(ranks.errors.empty());
  }
}

TEST_CASE("Serve.APipelineRankThatHangsOrDiesFailsTheEngineWithTheReason") {
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f32);
  auto params = weights(m, 1);
  SUBCASE("a rank that never answers: the step's deadline") {
    RankedPipeline ranks(m, params, 2, 1, settings(m, params), 300ms, /*silent=*/true);
    Engine e(ranks.settings);
    auto run = submit(e, prompt_of(4, 1, m.vocab()), 5);
    wait(*run, 30s);
    CHECK(run->finish == Finish::failed);
    CHECK_MESSAGE(run->error.find("did not come in time") != std::string::npos, run->error);
    CHECK(e.failure().find("rank 1") != std::string::npos);
    std::uint64_t id = 0;
    CHECK(e.submit(Request{.prompt = {1}, .max_tokens = 1}, id) == Backend::Admission::draining);
  }
  SUBCASE("the control plane's abort (a rank that died): running and waiting requests end with its reason") {
    auto base = settings(m, params);
    base.max_batch = 1;  // the second request waits
    RankedPipeline ranks(m, params, 2, 1, base);
    Engine e(ranks.settings);
    std::promise<void> release;
    auto running = submit_held(e, prompt_of(4, 1, m.vocab()), 40, release);
    auto waiting = submit(e, prompt_of(4, 2, m.vocab()), 4);
    const std::string reason = "rank 1 (node7): exited with signal 9 (Killed)";
    ranks.links[0]->abort(reason);  // what baton-serve's on_abort does
    e.fail(reason);
    release.set_value();
    wait(*running);
    wait(*waiting);
    CHECK(running->finish == Finish::failed);
    CHECK(waiting->finish == Finish::failed);
    CHECK_MESSAGE(running->error.find("signal 9") != std::string::npos, running->error);
    CHECK_MESSAGE(waiting->error.find("signal 9") != std::string::npos, waiting->error);
    CHECK(e.failure().find("signal 9") != std::string::npos);
  }
}

TEST_CASE("Serve.ACancelledRequestAcrossRanksFreesItsBlocksOnlyOnceItsStepIsBack") {
  // Two ranks, two groups of requests with steps in flight; the cache holds one request of the
  // whole context. The first request is cancelled while its steps run: its blocks go to the
  // waiting second one only once no step of the first is in flight (the second's tokens are
  // then those it gives alone: its cache was not written under it).
  const DecodeModel m = tiny(DecodeModel::Kind::gpt, DType::f64);
  auto params = weights(m, 1);
  auto base = settings(m, params);
  // 12 blocks of 4 positions for the whole context of 48, over each rank's one layer.
  base.kv_cache_bytes = 12 * (1 * 2 * 4 * m.kv_heads() * m.head_dim() * 8);
  std::vector<std::int32_t> alone;
  {
    Engine e(settings(m, params));
    auto r = submit(e, prompt_of(8, 2, m.vocab()), 20);
    wait(*r);
    alone = r->tokens;
  }
  RankedPipeline ranks(m, params, 2, 1, base);
  {
    Engine e(ranks.settings);
    CHECK(e.cache_tokens() == 48);
    std::uint64_t first_id = 0;
    std::promise<void> release;
    auto first = submit_held(e, prompt_of(8, 1, m.vocab()), 40, release, &first_id);
    auto second = submit(e, prompt_of(8, 2, m.vocab()), 20);
    CHECK(e.stats().waiting == 1);
    e.cancel(first_id);
    release.set_value();
    wait(*first);
    wait(*second);
    CHECK(first->finish == Finish::cancelled);
    CHECK(second->finish == Finish::length);
    CHECK(second->tokens == alone);
    CHECK(e.stats().kv_cache_usage == 0.0);
  }
  ranks.finish();
  CHECK(ranks.errors.empty());
}
