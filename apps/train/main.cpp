// baton-train: trains a model written with the DSL on real data, as a stream of actors.
//
//   baton-train --model mlp --data digits --steps 2000 --batch 64 --microbatches 2 --json
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <filesystem>
#include <map>
#include <memory>
#include <thread>

#include <CLI/CLI.hpp>
#include <boost/algorithm/string/classification.hpp>
#include <boost/algorithm/string/replace.hpp>
#include <boost/algorithm/string/split.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/kernels/ops.h"
#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/blas_choice.h"
#include "baton/kernels/cuda.h"
#include "baton/graph/tokens.h"
#include "baton/kernels/data.h"
#include "baton/observe/trace.h"
#include "baton/observe/watch.h"
#include "bytes.h"
#include "import.h"
#include "models.h"
#include "planner.h"
#include "sample_text.h"

namespace {

using namespace baton;

struct Options {
  std::string model = "mlp";
  std::string data = "digits";
  std::int64_t steps = 1000;
  std::int64_t batch = 64;
  std::int64_t microbatches = 1;
  std::string optimizer = "adam";
  double lr = 1e-3;
  double momentum = 0.9;
  double weight_decay = 0.0;
  std::int64_t warmup = 0;
  bool cosine = false;
  double clip = 0.0;
  std::uint64_t seed = 1;
  std::int64_t layers = 2;
  std::int64_t d_model = 64;
  std::int64_t heads = 4;
  std::int64_t seq = 32;
  std::string attention = "auto";
  std::string gelu = "erf";  // gpt's MLP activation: erf or tanh
  std::int64_t hidden = 256;
  std::int64_t kv_heads = 0;    // llama: 0 is --heads (multi-head attention)
  std::int64_t ffn_hidden = 0;  // llama: 0 is 8 d_model / 3 rounded up to a multiple of 32
  double rope_base = 10000.0;
  bool tie_embeddings = false;
  int threads = 1;
  int dp = 1;
  double bucket_mb = 25;
  int pp = 1;
  std::int64_t tp = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  bool print_schedule = false;
  std::string balance = "flops";
  std::string devices;  // "cpu:K", "cuda:K" or RANK:TYPE:INDEX per place
  std::string precision = "f32";
  std::string collectives = "auto";
  std::string grad_compression = "none";
  std::string allreduce = "auto";
  int zero = 0;
  std::string sync = "allreduce";
  int servers = 1;
  int staleness = 0;
  bool json = false;
  std::string print_plan;
  std::vector<std::string> print_after;
  bool print_sbp = false;
  bool print_memory = false;
  bool measure_memory = false;
  bool eval = true;  // the held-out loss after training
  int blas_threads = 0;  // 0: baton's default (1, or BATON_BLAS_THREADS)
  bool memory_plan = true;
  bool in_place = true;
  bool epilogues = true;
  bool multi_tensor = true;
  bool cuda_graphs = true;
  std::string recompute = "none";
  std::string memory_budget;  // bytes, or with a unit: 512MiB, 2GiB, 1.5GB
  std::string trace;
  std::string dashboard;  // HOST:PORT to serve the dashboard on
  double dashboard_linger = 0;
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;  // 0: at the last step only
  int checkpoint_keep = 2;
  std::string resume;
  std::string init_from;  // a safetensors file of the model's weights (import.h)
  std::int64_t positions = 0;  // gpt2: rows of the position table (0: --seq, or the --init-from file's)
  std::int64_t sample = 0;  // --sample: tokens of text drawn from the trained model (0: none)
  std::string sample_prompt;
  double temperature = 0.8;
  std::optional<std::uint64_t> sample_seed;  // default: --seed
  std::string layout = "given";  // or auto: baton-plan's search chooses (apply_auto_layout)
  std::vector<std::string> layout_given;  // --layout auto: the layout flags given, held fixed
};

struct Data {
  std::shared_ptr<const data::Dataset> train, heldout;        // labelled sets
  std::shared_ptr<const data::TextCorpus> text, text_heldout;  // text
  std::shared_ptr<const data::TokenShards> tokens, tokens_val;  // token shards (tokens_val: null without val_*.bin)

  /// The GPT's vocabulary: the text's distinct bytes, or the shards' tokenizer's.
  std::int64_t vocab_size() const { return tokens ? tokens->vocab_size() : text->vocab_size(); }
};


Data load(const Options& o) {
  Data d;
  if (o.data == "digits" || o.data == "synthetic") {
    data::Dataset all = o.data == "digits" ? data::load_digits(data::find_digits_file())
                                           : data::synthetic(4096, 64, 10, o.seed);
    auto [train, heldout] = data::split(all, 0.2, o.seed);
    d.train = std::make_shared<const data::Dataset>(std::move(train));
    d.heldout = std::make_shared<const data::Dataset>(std::move(heldout));
  } else if (o.data.rfind("text:", 0) == 0) {
    data::TextCorpus all = data::load_text(o.data.substr(5));
    // The last tenth is held out (a contiguous stretch, so no window straddles both).
    auto cut = static_cast<std::ptrdiff_t>(all.ids.size() * 9 / 10);
    data::TextCorpus train = all, heldout = all;
    train.ids.assign(all.ids.begin(), all.ids.begin() + cut);
    heldout.ids.assign(all.ids.begin() + cut, all.ids.end());
    d.text = std::make_shared<const data::TextCorpus>(std::move(train));
    d.text_heldout = std::make_shared<const data::TextCorpus>(std::move(heldout));
  } else if (o.data.rfind("tokens:", 0) == 0) {
    // baton-prepare-data's shards: val_*.bin is the held-out stretch.
    const std::string dir = o.data.substr(7);
    d.tokens = data::TokenShards::open(dir, "train");
    if (!d.tokens->index().val.empty()) d.tokens_val = data::TokenShards::open(dir, "val");
  } else {
    throw std::invalid_argument(fmt::format("--data {}: expected digits, synthetic, text:PATH or tokens:DIR", o.data));
  }
  return d;
}

OptimizerConfig optimizer(const Options& o) {
  OptimizerConfig c = o.optimizer == "sgd"    ? optim::sgd(o.lr, o.momentum, o.weight_decay)
                      : o.optimizer == "adam" ? optim::adam(o.lr, o.weight_decay)
                                              : optim::adamw(o.lr, o.weight_decay);
  c.warmup_steps = o.warmup;
  c.cosine = o.cosine;
  c.clip_norm = o.clip;
  return c;
}

/// Whether the model runs on CUDA devices (--devices cuda:...), where --attention auto means
/// cuDNN's fused attention (or baton's kernels), not the CPU's naive ops.
bool on_cuda(const Options& o) { return o.devices.find("cuda") != std::string::npos; }

/// --model llama's shape from the flags; a value the model cannot take is refused naming its
/// flag (the model's own checks, in models.cpp, speak of its fields).
models::LlamaShape llama_shape(const Options& o, std::int64_t vocab) {
  models::LlamaShape s{.vocab = vocab, .seq = o.seq, .d_model = o.d_model, .heads = o.heads,
                       .kv_heads = o.kv_heads == 0 ? o.heads : o.kv_heads, .layers = o.layers,
                       .rope_base = o.rope_base, .tie_embeddings = o.tie_embeddings, .tp = o.tp,
                       .attention = models::parse_attention(o.attention, on_cuda(o))};
  // Llama's intermediate size is about 8/3 d (SwiGLU's three matrices cost as GELU's two of 4 d),
  // rounded up as Meta's multiple_of does, here to 32.
  s.ffn_hidden = o.ffn_hidden != 0 ? o.ffn_hidden : (8 * o.d_model / 3 + 31) / 32 * 32;
  if (o.d_model % o.heads != 0) {
    throw std::invalid_argument(fmt::format("--d-model {} is not a multiple of --heads {}", o.d_model, o.heads));
  }
  if ((o.d_model / o.heads) % 2 != 0) {
    throw std::invalid_argument(fmt::format("--d-model {} / --heads {} = {}: a llama head's size must be even (RoPE "
                                            "rotates pairs of features)",
                                            o.d_model, o.heads, o.d_model / o.heads));
  }
  if (s.kv_heads > o.heads || o.heads % s.kv_heads != 0) {
    throw std::invalid_argument(fmt::format("--kv-heads {} must divide --heads {} (each kv head serves --heads / "
                                            "--kv-heads query heads)",
                                            s.kv_heads, o.heads));
  }
  if (o.heads % o.tp != 0) {
    throw std::invalid_argument(fmt::format("--heads {} is not a multiple of --tp {}", o.heads, o.tp));
  }
  if (s.ffn_hidden % o.tp != 0) {
    throw std::invalid_argument(fmt::format("--ffn-hidden {} is not a multiple of --tp {}{}", s.ffn_hidden, o.tp,
                                            o.ffn_hidden == 0 ? " (the default, 8 d_model / 3 rounded up to 32)" : ""));
  }
  return s;
}

/// Logits and loss of a model for `batch` rows (builds the model into g).
models::Outputs build(Graph& g, const Options& o, const Data& d, std::int64_t batch) {
  if (o.gelu != "erf" && o.model != "gpt") {
    throw std::invalid_argument(fmt::format("--gelu {} is an option of --model gpt (gpt2's GELU is always the tanh form, "
                                            "llama's MLP is SwiGLU)", o.gelu));
  }
  if (o.model == "mlp") {
    if (!d.train) throw std::invalid_argument("--model mlp needs labelled data: --data digits or synthetic");
    Value logits = models::mlp(g, batch, {d.train->width(), o.hidden, o.layers, d.train->num_classes, o.tp});
    return {logits, softmax_cross_entropy(logits, g.find("label"))};
  }
  if (!d.text && !d.tokens) {
    throw std::invalid_argument(fmt::format("--model {} needs --data text:PATH or tokens:DIR", o.model));
  }
  if (o.model == "llama") return models::llama_with_loss(g, batch, llama_shape(o, d.vocab_size()));
  if (o.model == "gpt2") {
    if (o.tp != 1) throw std::invalid_argument("--model gpt2 runs with --tp 1 (its fused c_attn is not split)");
    return models::gpt2_with_loss(g, batch,
                                  {.vocab = d.vocab_size(), .seq = o.seq, .positions = o.positions, .d_model = o.d_model,
                                   .heads = o.heads, .layers = o.layers, .attention = models::parse_attention(o.attention, on_cuda(o))});
  }
  return models::gpt_with_loss(g, batch,
                               {.vocab = d.vocab_size(), .seq = o.seq, .d_model = o.d_model, .heads = o.heads,
                                .layers = o.layers, .tp = o.tp, .attention = models::parse_attention(o.attention, on_cuda(o)),
                                .gelu = models::parse_gelu(o.gelu)});
}

/// Held-out accuracy (labelled data) or loss (text), with the trained weights.
std::pair<double, double> evaluate_heldout(const Options& o, const Data& d, const ParameterStore& params) {
  if (d.heldout) {
    const std::int64_t n = d.heldout->rows();
    Graph g(o.seed);
    auto [logits, loss] = build(g, o, d, n);
    auto out = evaluate(g, {{"x", d.heldout->features}, {"label", d.heldout->labels}}, {logits, loss}, params);
    auto l = out[0].data<float>();
    auto y = d.heldout->labels.data<std::int32_t>();
    const std::int64_t c = out[0].dim(1);
    std::int64_t right = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      auto row = l.subspan(static_cast<std::size_t>(i * c), static_cast<std::size_t>(c));
      if (std::max_element(row.begin(), row.end()) - row.begin() == y[static_cast<std::size_t>(i)]) ++right;
    }
    return {static_cast<double>(right) / static_cast<double>(n), out[1].data<float>()[0]};
  }
  // Text: the mean loss over consecutive held-out windows.
  const std::int64_t rows = 16, t = o.seq;
  std::vector<std::int32_t> ids;
  if (d.text_heldout) {
    ids = d.text_heldout->ids;
  } else if (d.tokens_val) {
    ids.resize(static_cast<std::size_t>(std::min(d.tokens_val->size(), rows * t + 1)));
    d.tokens_val->copy(0, static_cast<std::int64_t>(ids.size()), ids.data());
  }
  const std::int64_t windows = std::min<std::int64_t>(rows, (static_cast<std::int64_t>(ids.size()) - 1) / t);
  if (windows < 1) return {NAN, NAN};
  Graph g(o.seed);
  Value loss = build(g, o, d, windows).loss;
  Tensor tokens = Tensor::empty({windows, t}, i32), targets = Tensor::empty({windows * t}, i32);
  for (std::int64_t i = 0; i < windows * t; ++i) {
    tokens.data<std::int32_t>()[static_cast<std::size_t>(i)] = ids[static_cast<std::size_t>(i)];
    targets.data<std::int32_t>()[static_cast<std::size_t>(i)] = ids[static_cast<std::size_t>(i + 1)];
  }
  auto out = evaluate(g, {{"tokens", tokens}, {"targets", targets}}, {loss}, params);
  return {NAN, out[0].data<float>()[0]};
}

/// What makes a run the run it is, as a checkpoint records it; a resumed run must agree on the
/// keys of must_match() (the rest, dp, pp, tp, micro-batches, threads, may change: a checkpoint
/// of another tp is resharded, checkpoint::reshard).
std::map<std::string, std::string> run_config(const Options& o) {
  std::map<std::string, std::string> config{{"model", o.model},          {"data", o.data},
          {"steps", std::to_string(o.steps)}, {"batch", std::to_string(o.batch)},
          {"optimizer", o.optimizer}, {"lr", fmt::format("{}", o.lr)},
          {"momentum", fmt::format("{}", o.momentum)}, {"weight_decay", fmt::format("{}", o.weight_decay)},
          {"warmup", std::to_string(o.warmup)}, {"cosine", o.cosine ? "true" : "false"},
          {"clip", fmt::format("{}", o.clip)}, {"seed", std::to_string(o.seed)},
          {"layers", std::to_string(o.layers)}, {"hidden", std::to_string(o.hidden)},
          {"d_model", std::to_string(o.d_model)}, {"heads", std::to_string(o.heads)},
          {"seq", std::to_string(o.seq)}, {"tp", std::to_string(o.tp)},
          {"microbatches", std::to_string(o.microbatches)}, {"dp", std::to_string(o.dp)},
          {"pp", std::to_string(o.pp)}};
  if (o.model == "llama") {  // only then, so that the other models' checkpoints read as before
    config["kv_heads"] = std::to_string(o.kv_heads);
    config["ffn_hidden"] = std::to_string(o.ffn_hidden);
    config["rope_base"] = fmt::format("{}", o.rope_base);
    config["tie_embeddings"] = o.tie_embeddings ? "true" : "false";
  }
  if (o.model == "gpt2") config["positions"] = std::to_string(o.positions);
  if (o.model == "gpt" && o.gelu != "erf") config["gelu"] = o.gelu;  // absent: erf, as before the flag
  return config;
}

std::vector<std::string> must_match(const Options& o) {
  std::vector<std::string> keys{"model", "data", "batch", "optimizer", "lr", "momentum", "weight_decay", "warmup",
                                "cosine", "clip", "seed", "layers", "hidden", "d_model", "heads", "seq"};
  if (o.cosine) keys.push_back("steps");  // the decay spans the whole run
  if (o.model == "llama") keys.insert(keys.end(), {"kv_heads", "ffn_hidden", "rope_base", "tie_embeddings"});
  if (o.model == "gpt2") keys.push_back("positions");
  if (o.model == "gpt") keys.push_back("gelu");
  return keys;
}

/// Where replica r's stage s runs: the dp x pp x tp places spread over the job's ranks, and over
/// in-process devices within a rank. `--devices` is either TYPE:K, K devices of that type per
/// rank (cpu:0 .. cpu:K-1, or the first K GPUs), or one explicit RANK:TYPE:INDEX per place,
/// comma-separated ("0:cuda:0,0:cuda:1" or, mixed, "0:cpu:0,0:cuda:0" for a CPU first stage).
/// Ranks that run only parameter servers (--sync ps over several ranks): the last --servers.
int server_ranks(const Options& o, const JobEnvironment& env) {
  return o.sync == "ps" && env.distributed() ? o.servers : 0;
}

std::vector<Placement> replica_places(const Options& o, const JobEnvironment& env) {
  const auto world = static_cast<int>(env.world_size) - server_ranks(o, env);
  if (world < 1) {
    throw std::invalid_argument(fmt::format("--sync ps with --servers {} over ranks runs the servers on the last {} "
                                            "ranks and the replicas on the others; the job has {} rank{}",
                                            o.servers, o.servers, env.world_size, env.world_size == 1 ? "" : "s"));
  }
  const int places = o.dp * o.pp * o.tp;
  const std::string shape = fmt::format("--dp {} x --pp {} x --tp {} = {}", o.dp, o.pp, o.tp, places);
  std::vector<Placement> where;
  if (o.devices.find(',') != std::string::npos || std::count(o.devices.begin(), o.devices.end(), ':') == 2) {
    // Explicit places, one per (replica, stage, shard).
    std::vector<std::string> items;
    boost::split(items, o.devices, boost::is_any_of(","));
    for (const std::string& item : items) {
      const auto colon = item.find(':');
      int rank = -1;
      if (colon == std::string::npos || std::sscanf(item.substr(0, colon).c_str(), "%d", &rank) != 1 ||
          item.substr(0, colon) != std::to_string(rank)) {
        throw std::invalid_argument(fmt::format("--devices: '{}' is not RANK:TYPE:INDEX (e.g. 0:cuda:0)", item));
      }
      if (rank < 0 || rank >= world) {
        throw std::invalid_argument(fmt::format("--devices: '{}' names rank {}, but the job has {} rank{}", item, rank,
                                                world, world == 1 ? "" : "s"));
      }
      Device d;
      try {
        d = Device::parse(item.substr(colon + 1));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(fmt::format("--devices: '{}': {}", item, e.what()));
      }
      where.push_back(Placement{.rank = static_cast<std::uint16_t>(rank), .device = d});
    }
    if (static_cast<int>(where.size()) != places) {
      throw std::invalid_argument(fmt::format("--devices lists {} place{}, but {} (one RANK:TYPE:INDEX per replica, "
                                              "stage and shard)",
                                              where.size(), where.size() == 1 ? "" : "s", shape));
    }
    return where;
  }
  if (places % world != 0) {
    throw std::invalid_argument(fmt::format("{} cannot be spread evenly over the job's {} ranks", shape, world));
  }
  int per_rank = places / world;
  DeviceType type = DeviceType::cpu;
  if (!o.devices.empty()) {
    int k = 0;
    char kind[8] = {};
    if (std::sscanf(o.devices.c_str(), "%4[a-z]:%d", kind, &k) != 2 || k < 1 ||
        o.devices != fmt::format("{}:{}", kind, k) ||
        (std::string_view(kind) != "cpu" && std::string_view(kind) != "cuda" && std::string_view(kind) != "sim")) {
      throw std::invalid_argument(fmt::format(
          "--devices '{}': expected cpu:K, cuda:K or sim:K (K in-process devices per rank), or RANK:TYPE:INDEX per "
          "place",
          o.devices));
    }
    if (k * world != places) {
      throw std::invalid_argument(fmt::format("--devices {} on {} rank{} gives {} devices, but {} (dp x pp x tp must "
                                              "equal the devices)",
                                              o.devices, world, world == 1 ? "" : "s", k * world, shape));
    }
    per_rank = k;
    type = Device::parse(kind).type;
  }
  for (int i = 0; i < places; ++i) {
    where.push_back(Placement{.rank = static_cast<std::uint16_t>(i / per_rank),
                              .device = Device{type, static_cast<std::uint8_t>(i % per_rank)}});
  }
  return where;
}

/// --print-memory: what the plan needs on each device, from the plan alone (plan_memory.h).
/// --measure-memory: each device's register high-water mark over the run against the plan's
/// account of the same bytes (its peak without what kernels keep), on stderr.
void print_measured_memory(const Plan& plan, const RunReport& report, std::uint16_t rank) {
  std::map<Device, std::int64_t> planned;
  for (const DeviceMemory& m : memory_report(plan)) {
    if (m.rank == rank) planned[m.device] = m.registers_at_peak();
  }
  for (const MeasuredMemory& m : report.memory) {
    const std::int64_t plan_bytes = planned[m.device];
    fmt::print(stderr, "baton-train: r{}/{} registers in use at most {} during the run; the plan allows for {} ({:.1f}%)\n",
               rank, m.device.str(), format_bytes(m.peak_bytes), format_bytes(plan_bytes),
               plan_bytes > 0 ? 100.0 * static_cast<double>(m.peak_bytes) / static_cast<double>(plan_bytes) : 0.0);
  }
}

void print_memory(const Plan& plan, bool json) {
  const std::vector<DeviceMemory> report = memory_report(plan);
  if (!json) {
    fmt::print("memory by device (peak from the plan):\n{}", to_text(report));
    return;
  }
  std::vector<std::string> devices;
  for (const DeviceMemory& m : report) {
    std::string fields = fmt::format("\"rank\": {}, \"device\": \"{}\", \"peak_bytes\": {}", m.rank, m.device.str(), m.total());
    for (std::size_t c = 0; c < memory_categories; ++c) {
      fields += fmt::format(", \"{}_bytes\": {}", name(static_cast<MemoryCategory>(c)), m.bytes[c]);
    }
    fields += fmt::format(", \"arena_slack_bytes\": {}, \"register_bytes\": {}", m.slack, m.registers);
    devices.push_back("{" + fields + "}");
  }
  fmt::print("{{\"memory\": [{}]}}\n", fmt::join(devices, ", "));
}

/// --init-from's file, read once into `init`: the options with --positions taken from it where a
/// GPT-2's position table says how many it has.
Options read_init_from(const Options& given, std::optional<safetensors::Contents>& init) {
  Options o = given;
  if (o.init_from.empty()) return o;
  if (!o.resume.empty()) {
    throw std::invalid_argument("--init-from and --resume: a resumed run has its checkpoint's weights; give one");
  }
  init = safetensors::read(o.init_from);
  const Tensor* wpe = init->find("wpe.weight") != nullptr ? init->find("wpe.weight") : init->find("transformer.wpe.weight");
  if (o.model == "gpt2" && o.positions == 0 && wpe != nullptr && wpe->shape().size() == 2) o.positions = wpe->dim(0);
  return o;
}

/// A stage is at least one layer: a finer cut would split a layer's ops over devices, which
/// only adds transfers. Refused here, where the model's layers are known.
void check_stages(const Options& o) {
  const std::int64_t model_layers = o.model == "mlp" ? o.layers + 1 : o.layers + 2;
  if (o.schedule == "interleaved" && o.pp * o.virtual_stages > model_layers) {
    throw std::invalid_argument(fmt::format(
        "--pp {} x --virtual-stages {} is {} stages, more than the {} has layers: {}; use fewer, or more --layers",
        o.pp, o.virtual_stages, o.pp * o.virtual_stages, o.model, model_layers));
  }
  if (o.schedule == "zb-v" && o.pp * 2 > model_layers) {
    throw std::invalid_argument(fmt::format(
        "--schedule zb-v cuts the model into --pp {} x 2 stages, more than the {} has layers: {}; use fewer, or more "
        "--layers",
        o.pp, o.model, model_layers));
  }
  if (o.pp > model_layers) {
    throw std::invalid_argument(fmt::format(
        "--pp {} is more stages than the {} has layers: {} ({}); use --pp {} or fewer, or more --layers", o.pp, o.model,
        model_layers,
        o.model == "mlp" ? fmt::format("{} hidden and the output layer", o.layers)
                         : fmt::format("the embedding, {} blocks and the head", o.layers),
        model_layers));
  }
}

/// Where the replicas run (replica_places), with the CUDA devices this rank uses checked before
/// anything is built.
std::vector<Placement> checked_places(const Options& o, const JobEnvironment& env) {
  std::vector<Placement> places = replica_places(o, env);  // also checks --devices
  if (env.distributed() && o.devices.starts_with("cuda:") && o.devices.find(',') == std::string::npos &&
      std::getenv("CUDA_VISIBLE_DEVICES") == nullptr) {
    // cuda:K on each of several ranks: every rank's plan says cuda:0 .. cuda:K-1 (the plan is
    // the same on every rank), and each process on a host sees its own K GPUs as those, as
    // torchrun users pin cuda:LOCAL_RANK. Set before the first CUDA call reads it.
    const int k = std::stoi(o.devices.substr(5));
    std::string visible;
    for (int i = 0; i < k; ++i) visible += fmt::format("{}{}", i == 0 ? "" : ",", static_cast<int>(env.local_rank) * k + i);
    ::setenv("CUDA_VISIBLE_DEVICES", visible.c_str(), 1);
  }
  for (const Placement& p : places) {
    if (p.device.type != DeviceType::cuda || p.rank != env.rank || !o.print_plan.empty() || o.print_memory) continue;
    // Said before anything is built, rather than by the first allocation on the device (a
    // plan can be printed anywhere).
    const cuda::Availability& a = cuda::availability();
    if (!a.ok) throw std::invalid_argument(fmt::format("--devices {}: {} cannot be used here: {}", o.devices, p.device.str(), a.reason));
    if (p.device.index >= a.devices) {
      throw std::invalid_argument(fmt::format("--devices {}: {} does not exist; this machine has {} CUDA device{}",
                                              o.devices, p.device.str(), a.devices, a.devices == 1 ? "" : "s"));
    }
  }
  return places;
}

/// The training settings the options give (checkpoints and resuming apart).
TrainConfig train_config(const Options& o, const JobEnvironment& env, const Data& d) {
  const std::int64_t pieces = o.dp * o.microbatches;  // micro-batches of a step, over all replicas
  TrainConfig cfg;
  cfg.steps = o.steps;
  cfg.microbatches = o.microbatches;
  cfg.optimizer = optimizer(o);
  cfg.threads = o.threads;
  if (o.blas_threads > 0) set_blas_threads(o.blas_threads);
  cfg.recompute = o.recompute;
  cfg.dp = o.dp;
  cfg.bucket_bytes = static_cast<std::int64_t>(o.bucket_mb * 1024 * 1024);
  cfg.collectives = o.collectives;
  cfg.grad_compression = o.grad_compression;
  cfg.rank_hosts = env.rank_hosts();
  cfg.hierarchical_allreduce = o.allreduce == "auto";
  cfg.zero = o.zero;
  cfg.sync = o.sync;
  cfg.servers = o.servers;
  cfg.staleness = o.staleness;
  for (int k = 0; k < server_ranks(o, env); ++k) {
    cfg.server_places.push_back(Placement{.rank = static_cast<std::uint16_t>(env.world_size - o.servers + k)});
  }
  check_stages(o);
  cfg.pp = o.pp;
  cfg.tp = static_cast<int>(o.tp);
  cfg.schedule = o.schedule;
  cfg.virtual_stages = o.virtual_stages;
  cfg.balance = o.balance;
  if (o.dp > 1 || o.pp > 1 || o.tp > 1 || env.distributed() || !o.devices.empty()) cfg.replica_places = checked_places(o, env);
  if (o.model != "mlp" && d.tokens) {
    cfg.data = {{"tokens", data::token_source(d.tokens, o.batch, pieces, o.seq, o.seed), {"tokens", "targets"}}};
  } else if (o.model != "mlp") {
    cfg.data = {{"text", data::text_source(d.text, o.batch, pieces, o.seq, o.seed), {"tokens", "targets"}}};
  } else {
    cfg.data = {{o.data, data::batch_source(d.train, o.batch, pieces, o.seed), {"x", "label"}}};
  }
  cfg.memory_plan = o.memory_plan;
  cfg.in_place = o.in_place;
  cfg.fuse_bias_adds = cfg.fuse_bias_gradients = o.epilogues;
  cfg.multi_tensor_updates = o.multi_tensor;
  cfg.cuda_graphs = o.cuda_graphs;
  cfg.memory_budget = parse_bytes("--memory-budget", o.memory_budget);
  // Every rank compiles the same plan (and refuses a pass it does not know): one prints the IR.
  cfg.print_after = o.print_after;
  if (env.rank != 0) cfg.print_ir = [](std::string_view, const std::string&) {};
  return cfg;
}

/// --resume: the weights and optimizer state after the checkpoint's step, which this job
/// continues from (checkpoint.h), into `params` and `cfg`. None without --resume.
std::optional<checkpoint::Checkpoint> resume(const Options& o, const JobEnvironment& env, ParameterStore& params,
                                             TrainConfig& cfg) {
  if (o.resume.empty()) return std::nullopt;
  const checkpoint::Found found = checkpoint::find(o.resume);
  for (const std::string& why : found.skipped) {
    if (env.rank == 0) fmt::print(stderr, "baton-train: passed over {}\n", why);
  }
  checkpoint::Checkpoint resumed = checkpoint::load(found.dir);
  if (auto diffs = checkpoint::mismatches(resumed, run_config(o), must_match(o)); !diffs.empty()) {
    throw std::invalid_argument(fmt::format("{}: written by another job ({}); resume with its settings",
                                            (found.dir / "index.json").string(), fmt::join(diffs, "; ")));
  }
  if (resumed.step >= o.steps) {
    throw std::invalid_argument(fmt::format("--resume {}: the checkpoint is at step {} and --steps is {}: nothing "
                                            "left to train (raise --steps)",
                                            found.dir.string(), resumed.step, o.steps));
  }
  // Written under another tensor-parallel layout: its split weights cut again as this one splits them.
  if (const auto moved = checkpoint::reshard(resumed, params); !moved.empty() && env.rank == 0) {
    fmt::print(stderr, "baton-train: resharded {} weights of the tp {} checkpoint for tp {} ({}{})\n", moved.size(),
               resumed.layout.tp, o.tp, moved.front(), moved.size() > 1 ? ", ..." : "");
  }
  checkpoint::restore(resumed, params, cfg.optimizer);
  cfg.first_step = resumed.step;
  cfg.optimizer_state = std::make_shared<OptimizerState>(resumed.slots);
  return resumed;
}

/// --checkpoint-dir: the writer this rank's snapshots go to, hooked into `cfg`; null without it.
std::shared_ptr<checkpoint::Writer> checkpoint_writer(const Options& o, const JobEnvironment& env, TrainConfig& cfg,
                                                     const Data& d) {
  if (o.checkpoint_dir.empty()) return nullptr;
  auto config = run_config(o);
  // What turns the model's ids into text, so that baton-serve needs nothing but the checkpoint:
  // a byte model's vocabulary (its sorted bytes, in hex), a token model's SentencePiece file.
  std::map<std::string, std::string> assets;
  if (d.text) {
    std::string hex;
    for (unsigned char b : d.text->vocab) hex += fmt::format("{:02x}", b);
    config["vocab_bytes"] = hex;
  } else if (d.tokens && !d.tokens->index().tokenizer.empty()) {
    const std::string path = o.data.substr(std::string("tokens:").size()) + "/" + d.tokens->index().tokenizer;
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("{}: cannot read the shards' tokenizer for the checkpoints", path));
    assets["tokenizer.model"] = std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  // Files of one job carry its id, so that a file left by an earlier job is not mixed in.
  config["run"] = fmt::format("{:016x}", std::hash<std::string>{}(env.distributed() ? env.token + env.master
                                                                                     : fmt::format("{}.{}", ::getpid(), std::chrono::system_clock::now().time_since_epoch().count())));
  auto writer = std::make_shared<checkpoint::Writer>(checkpoint::Settings{
      .dir = o.checkpoint_dir, .keep = o.checkpoint_keep, .rank = env.rank,
      .layout = {o.dp, o.pp, static_cast<int>(o.tp), static_cast<int>(env.world_size)}, .optimizer = cfg.optimizer,
      .config = std::move(config), .batch = o.batch, .seed = o.seed, .assets = std::move(assets)});
  cfg.snapshot_every = o.checkpoint_every > 0 ? o.checkpoint_every : o.steps;
  cfg.on_snapshot = writer->hook();
  return writer;
}

/// --print-memory and --print-plan: what the reporting rank prints instead of training; true
/// when the job ends there.
bool printed_instead(const Options& o, const TrainingJob& job, bool leader) {
  if (o.print_schedule) {
    if (!leader) return true;
    // The schedule as data, then the proof: the plan's dry run with its real slots (validate),
    // and what it needs on each device.
    if (o.pp > 1) {
      fmt::print("{}", schedule_text(parse_schedule(o.schedule), o.pp, o.microbatches, o.virtual_stages));
    } else {
      fmt::print("one stage (--pp 1): no pipeline schedule\n");
    }
    validate(job.plan, job.kernels, job.plan.actors.empty() ? 0 : job.plan.actors.front().where.rank);
    fmt::print("the plan's dry run keeps going with its registers' slots: no act waits forever\n");
    fmt::print("memory by device (peak from the plan):\n{}", to_text(memory_report(job.plan)));
    return true;
  }
  if (o.print_memory) {
    if (leader) print_memory(job.plan, o.json);
    return true;
  }
  if (o.print_plan.empty()) return false;
  if (!leader) return true;
  if (o.print_plan == "dot") {
    fmt::print("{}", job.plan.to_dot());
  } else {
    // The plan, then what it needs on each device (comments, so the text is still the plan).
    std::string memory = "memory by device (peak from the plan):\n" + to_text(memory_report(job.plan));
    boost::replace_all(memory, "\n", "\n# ");
    fmt::print("{}# {}\n", job.plan.to_text(), memory.substr(0, memory.size() - 3));
  }
  return true;
}

/// How --dp's gradient buckets cross hosts, for the header and the ranks' log lines:
/// "hierarchical, H hosts x L replicas" where the replicas' first stages span hosts evenly
/// (TrainConfig::rank_hosts; each stage's buckets are grouped the same way), else "".
std::string hierarchy_note(const TrainConfig& cfg) {
  if (cfg.dp < 2 || cfg.collectives == "nccl" || cfg.grad_compression != "none" || !cfg.hierarchical_allreduce) return "";
  std::vector<AllReduceMember> members;
  const auto per_replica = static_cast<std::size_t>(cfg.pp) * static_cast<std::size_t>(cfg.tp);
  for (std::size_t r = 0; r < static_cast<std::size_t>(cfg.dp) && r * per_replica < cfg.replica_places.size(); ++r) {
    members.push_back({cfg.replica_places[r * per_replica], 0, fmt::format("@dp{}", r)});
  }
  // A bucket big enough for the ring (smaller ones go direct, one hop, flat).
  const auto hosts = hosts_of_members(members, {std::int64_t{1} << 20}, DType::f32, {.rank_hosts = cfg.rank_hosts});
  if (hosts.empty()) return "";
  return fmt::format("hierarchical, {} hosts x {} replicas", hosts.size(), hosts.front().size());
}

/// Which attention kernels a model on CUDA devices runs, and why (--attention auto's choice).
std::string attention_note(const Options& o) {
  const cuda::CudnnAttention& c = cuda::cudnn_attention();
  if (o.attention == "naive") return "attention: naive (matmul, mask, softmax, matmul)";
  if (o.attention == "fused") return "attention: baton's fused kernels";
  if (o.attention == "cudnn") return c.ok ? fmt::format("attention: cuDNN {} fused attention", c.version)
                                          : fmt::format("attention: cuDNN asked for, but it cannot be used: {}", c.reason);
  return c.ok ? fmt::format("attention: cuDNN {} fused attention for bf16 heads of a multiple of 8 up to 128, baton's "
                            "fused kernels otherwise (--attention auto)", c.version)
              : fmt::format("attention: baton's fused kernels (--attention auto; cuDNN: {})", c.reason);
}

/// The line that says what is about to train.
void print_header(const Options& o, const TrainingJob& job, const JobEnvironment& env, const TrainConfig& cfg,
                  const std::optional<checkpoint::Checkpoint>& resumed, std::int64_t first) {
  std::size_t weights = 0;
  for (auto& [n, t] : job.params->values()) weights += static_cast<std::size_t>(t.numel());
  fmt::print("baton-train: {} on {} | {} weights | {} actors, {} registers | {} steps of {} ({}{} x {}) | {} lr {}{}{}{}\n",
             o.model, o.data, weights, job.plan.actors.size(), job.plan.registers.size(), o.steps, o.batch,
             o.dp > 1 || o.pp > 1 || o.tp > 1 ? fmt::format("dp {}{} x pp {} ({}) x tp {} x ", o.dp,
                                         o.sync == "ps" ? fmt::format(" (ps: {} server{}, staleness {})", o.servers,
                                                                      o.servers == 1 ? "" : "s", o.staleness)
                                                        : "",
                                         o.pp, o.schedule, o.tp) : "",
             o.microbatches, o.batch / (o.dp * o.microbatches), o.optimizer, o.lr,
             env.distributed() ? fmt::format(" | {} ranks", env.world_size) : "",
             hierarchy_note(cfg).empty() ? "" : " | all-reduce: " + hierarchy_note(cfg),
             on_cuda(o) ? "" : " | " + blas::summary());
  if (resumed) fmt::print("baton-train: resuming from {} at step {} of {}\n", resumed->dir.string(), first + 1, o.steps);
  if ((o.model == "gpt" || o.model == "llama" || o.model == "gpt2") && on_cuda(o)) fmt::print("baton-train: {}\n", attention_note(o));
}

/// Traces: under baton-launch --trace (BATON_TRACE=FILE) the ranks of a job stream their records
/// to the launcher, which writes FILE; a job of one rank writes it itself; --trace FILE without
/// the launcher's writes one file per rank (FILE.rank<R>.json).
struct Tracing {
  std::string file;  // where this process writes the trace ("" when it streams it, or none)
  std::unique_ptr<observe::TraceObserver> tracer;
  std::unique_ptr<JobObservers> observers;
};

/// Wires the trace's observer into `js`, beside the dashboard's where there is one.
Tracing start_tracing(const Options& o, const JobEnvironment& env, JobSettings& js, observe::Watch& watch) {
  const char* launch_trace = std::getenv(observe::trace_env);
  const bool stream_trace = launch_trace != nullptr && *launch_trace != '\0' && env.distributed();
  Tracing t;
  t.file = stream_trace                              ? std::string()
           : launch_trace != nullptr && *launch_trace ? std::string(launch_trace)
           : env.distributed() && !o.trace.empty()    ? fmt::format("{}.rank{}.json", o.trace, env.rank)
                                                      : o.trace;
  if (const auto dir = std::filesystem::path(t.file).parent_path(); !dir.empty() && !std::filesystem::is_directory(dir)) {
    throw std::invalid_argument(fmt::format("--trace {}: there is no directory '{}'", t.file, dir.string()));
  }
  if (!stream_trace && t.file.empty()) return t;
  // With a dashboard too, its collector drains the activity rings (a ring has one reader) and
  // hands each batch to the trace.
  observe::TraceOptions topt;
  topt.drain = js.observer == nullptr;
  t.tracer = std::make_unique<observe::TraceObserver>(topt, /*keep=*/!stream_trace);
  js.runtime.activity_log = true;
  if (js.observer != nullptr) {
    watch.add_activity_sink([tracer = t.tracer.get()](const std::vector<ActRecord>& records, const Runtime& rt) {
      tracer->consume(records, rt);
    });
    t.observers = std::make_unique<JobObservers>(std::vector<JobObserver*>{js.observer, t.tracer.get()});
    js.observer = t.observers.get();
  } else {
    js.observer = t.tracer.get();
  }
  return t;
}

/// The model's loss in `g`. Mixed precision (graph.h): the forward ops made here compute in bf16
/// or f32 by autocast's policy; weights, gradients and the optimizer stay f32.
Value build_loss(Graph& g, const Options& o, const Data& d, std::int64_t mb) {
  auto mixed = g.autocast(o.precision == "bf16" ? DType::bf16 : DType::f32);
  return build(g, o, d, mb).loss.named("loss");
}

/// The reporting rank says when a worker leaves the job or comes back (parameter servers).
void announce_departures(JobSettings& js, const Options& o, const TrainingJob& job, std::int64_t first) {
  js.on_left = [&o, &job, first](std::uint32_t rank, const std::string& reason) {
    fmt::print(stderr, "baton-train: rank {} (a worker) left the job at step {}: {}; the servers go on with the "
                       "other workers (staleness {})\n",
               rank, first + job.losses->steps_done(), reason, o.staleness);
  };
  js.on_rejoined = [](std::uint32_t rank, std::int64_t step) {
    fmt::print(stderr, "baton-train: rank {} (a worker) came back: it trains from step {} on, with the weights it "
                       "pulled from the servers\n",
               rank, step + 1);
  };
}

/// A worker started again by baton-launch --max-restarts (BATON_REJOIN=1) comes back at the
/// servers' step: run_job calls compiler()'s function once they hold, and the plan from that step
/// on is compiled while they wait (its data sources draw that step's samples; no checkpoint is
/// read: the servers have the weights). The graph and the job live here, beyond run_job.
struct Comeback {
  Graph graph;
  std::optional<TrainingJob> job;
  explicit Comeback(std::uint64_t seed) : graph(seed) {}
  std::function<std::pair<Plan, const KernelRegistry*>(std::int64_t)> compiler(const Options& o, const Data& d,
                                                                               std::int64_t mb, const TrainConfig& cfg,
                                                                               std::uint32_t rank) {
    return [this, &o, &d, mb, &cfg, rank](std::int64_t step) {
      const Value loss = build_loss(graph, o, d, mb);
      TrainConfig from_there = cfg;
      from_there.first_step = step;
      from_there.rejoin = true;
      job.emplace(compile_training(graph, loss, from_there, ParameterStore::initialize(graph)));
      fmt::print(stderr, "baton-train: rank {} comes back to the job at step {} of {}\n", rank, step + 1, o.steps);
      return std::pair<Plan, const KernelRegistry*>{job->plan, &job->kernels};
    };
  }
};

/// Runs the job on a thread of its own while this one prints its progress (the reporting rank,
/// without --json). The run's failure, if any, is left in `failure`.
RunReport run_with_progress(const Options& o, const TrainingJob& job, const JobEnvironment& env, const JobSettings& js,
                            bool leader, std::int64_t first, bool tty, std::exception_ptr& failure) {
  RunReport report;
  std::atomic<bool> finished{false};
  std::thread runner([&] {
    try {
      report = run_job(job.plan, job.kernels, env, js);
    } catch (...) {
      failure = std::current_exception();
    }
    finished.store(true);
  });
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t printed = 0;
  while (!finished.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (o.json || !leader) continue;
    std::int64_t done = job.losses->steps_done();
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    bool line_due = tty || done >= printed + std::max<std::int64_t>(1, (o.steps - first) / 10);
    if (done == 0 || !line_due) continue;
    printed = done;
    auto losses = job.losses->per_step();
    double rate = static_cast<double>(done * o.batch) / secs;
    double eta = static_cast<double>(o.steps - first - done) * secs / static_cast<double>(done);
    fmt::print("{}step {:>6}/{}  loss {:.4f}  {:>9.0f} samples/s  ETA {:.1f} s{}", tty ? "\r" : "", first + done, o.steps,
               losses.empty() ? NAN : losses.back(), rate, eta, tty ? "   " : "\n");
    std::fflush(stdout);
  }
  runner.join();
  return report;
}

/// After the run: the last checkpoint on disk and the trace written (a failed run's too: it
/// shows what led up to it), then the run's failure, if any, rethrown.
void finish_run(checkpoint::Writer* writer, observe::Watch& watch, const Tracing& tracing, std::exception_ptr failure) {
  if (writer != nullptr) {  // the last checkpoint is written while the job ends: wait for it
    try {
      writer->finish();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  watch.finish();
  if (tracing.tracer && !tracing.file.empty()) {
    try {
      tracing.tracer->recorder().write_file(tracing.file);
      fmt::print(stderr, "baton-train: trace of {} acts written to {} (open it in ui.perfetto.dev or chrome://tracing)\n",
                 tracing.tracer->recorder().acts(), tracing.file);
    } catch (const std::exception& e) {
      if (!failure) throw;
      fmt::print(stderr, "baton-train: {}\n", e.what());  // the run's own failure comes next
    }
  }
  if (failure) std::rethrow_exception(failure);
}

/// Where the time went: the busiest actors (kernel share in busy%; the rest is handshakes).
void print_busiest(const RunReport& report) {
  MetricsSnapshot top = report.metrics;
  top.registers.clear();
  std::sort(top.actors.begin(), top.actors.end(), [](const auto& a, const auto& b) { return a.busy_s > b.busy_s; });
  const std::size_t all = top.actors.size();
  if (all > 10) top.actors.resize(10);
  double kernel = 0, busy = 0;
  for (const auto& a : report.metrics.actors) {
    kernel += a.kernel_s;
    busy += a.busy_s;
  }
  fmt::print("busiest actors ({} of {}); all actors: {:.3f} s in kernels, {:.3f} s in handshakes\n{}", top.actors.size(),
             all, kernel, busy - kernel, top.table());
}

/// ', "departed": ["rank 1: <reason>", ...]' for the workers that left the job (a parameter-server
/// job under staleness), or nothing.
/// `"departed": [...]` and `"rejoined": [...]` (each only if not empty), each after a comma.
std::string departed_json(const RunReport& report) {
  std::string out;
  for (const auto& [key, list] : {std::pair{"departed", &report.departed}, std::pair{"rejoined", &report.rejoined}}) {
    if (list->empty()) continue;
    out += fmt::format(", \"{}\": [", key);
    for (std::size_t i = 0; i < list->size(); ++i) {
      out += (i == 0 ? "" : ", ") + sample::TextSampler::json_string((*list)[i]);
    }
    out += "]";
  }
  return out;
}

/// The reporting rank's result: the final loss, the held-out evaluation, a sample, the busiest
/// actors (or, with --json, one JSON line).
void print_result(const Options& o, const Data& d, const TrainingJob& job, const RunReport& report,
                  const JobEnvironment& env, const std::optional<sample::TextSampler>& sampler, std::int64_t first,
                  bool tty) {
  auto losses = job.losses->per_step();
  const double samples_per_s = static_cast<double>((o.steps - first) * o.batch) / report.wall_s;
  if (losses.empty()) {
    // Pipeline stages on several ranks: the loss, and the last stages' weights, live on another
    // rank, so this one can neither report the loss nor evaluate.
    if (o.json) {
      fmt::print("{{\"model\": \"{}\", \"steps\": {}, \"final_loss\": null, \"samples_per_s\": {:.6g}, \"wall_s\": {:.6g}, "
                 "\"note\": \"the loss is computed on another rank\"}}\n",
                 o.model, o.steps, samples_per_s, report.wall_s);
    } else {
      fmt::print("{}done: {} steps in {:.2f} s, {:.0f} samples/s | the loss is computed on another rank\n", tty ? "\n" : "",
                 o.steps - first, report.wall_s, samples_per_s);
    }
    return;
  }
  auto [accuracy, eval_loss] = o.eval ? evaluate_heldout(o, d, *job.params) : std::pair<double, double>{NAN, NAN};
  std::optional<sample::TextSampler::Result> drawn;
  if (sampler) drawn = sampler->run([&](Graph& eval) { return build(eval, o, d, 1).logits; }, o.seq, *job.params);
  if (o.json) {
    fmt::print("{{\"model\": \"{}\", \"data\": \"{}\", \"steps\": {}, \"batch\": {}, \"dp\": {}, \"pp\": {}, \"tp\": {}, \"ranks\": {}, \"microbatches\": {}, "
               "\"final_loss\": {:.6g}, \"eval_loss\": {}, \"eval_accuracy\": {}, \"samples_per_s\": {:.6g}, "
               "\"wall_s\": {:.6g}, \"first_step\": {}{}{}{}}}\n",
               o.model, o.data, o.steps, o.batch, o.dp, o.pp, o.tp, env.world_size, o.microbatches, losses.back(),
               std::isnan(eval_loss) ? "null" : fmt::format("{:.6g}", eval_loss),
               std::isnan(accuracy) ? "null" : fmt::format("{:.6g}", accuracy), samples_per_s, report.wall_s, first,
               d.text ? fmt::format(", \"unigram_entropy\": {:.6g}", d.text->unigram_entropy_nats()) : "",
               drawn ? fmt::format(", \"sample\": {}", sample::TextSampler::json_string(drawn->text)) : "",
               departed_json(report));
    return;
  }
  fmt::print("{}done: {} steps in {:.2f} s, {:.0f} samples/s | final loss {:.4f} | held-out loss {}", tty ? "\n" : "",
             o.steps - first, report.wall_s, samples_per_s, losses.back(),
             o.eval ? fmt::format("{:.4f}", eval_loss) : std::string("not evaluated (--no-eval)"));
  if (!std::isnan(accuracy)) fmt::print(", accuracy {:.2f}%", 100 * accuracy);
  if (d.text) fmt::print(" (unigram entropy {:.4f})", d.text->unigram_entropy_nats());
  fmt::print("\n\n");
  print_busiest(report);
  if (drawn) {
    fmt::print("\nsample ({} tokens after the prompt, temperature {}):\n{}\n", drawn->tokens, o.temperature, drawn->text);
  }
}

/// --layout auto: baton-plan's search (planner.h) over this machine's in-process CPU devices,
/// 1 to K of them (--devices cpu:K, or K the cores this process may use), holds the layout
/// flags given and chooses the rest: dp, tp, pp, micro-batches, schedule, ZeRO, recomputation.
void apply_auto_layout(Options& o, const Data& d, const JobEnvironment& env) {
  if (env.distributed()) {
    throw std::invalid_argument("--layout auto chooses among one process's in-process devices for now; under baton-launch "
                                "give the layout (baton-plan search says which)");
  }
  if (!o.devices.empty() && !o.devices.starts_with("cpu:")) {
    throw std::invalid_argument(fmt::format("--layout auto with --devices {}: in-process CPU devices (cpu:K) only for now", o.devices));
  }
  const int devices = !o.devices.empty() ? std::stoi(o.devices.substr(4))
                                         : static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  planner::Layout base{.model = o.model, .layers = o.layers, .d_model = o.d_model, .heads = o.heads, .kv_heads = o.kv_heads,
                       .ffn_hidden = o.ffn_hidden, .seq = o.seq, .vocab = o.model == "mlp" ? 256 : d.vocab_size(),
                       .hidden = o.hidden, .global_batch = o.batch, .dtype = o.precision, .threads = o.threads};
  if (o.model == "gpt2" || (o.model == "mlp" && (d.train->width() != 64 || d.train->num_classes != 10))) {
    throw std::invalid_argument(fmt::format("--layout auto: baton-plan models the mlp of 64 inputs and 10 classes, gpt and "
                                            "llama; not this --model {} on --data {}", o.model, o.data));
  }
  planner::SearchFixed f;
  const auto given = [&](const char* flag) { return std::find(o.layout_given.begin(), o.layout_given.end(), flag) != o.layout_given.end(); };
  if (given("--dp")) f.dp = o.dp;
  if (given("--tp")) f.tp = static_cast<int>(o.tp);
  if (given("--pp")) f.pp = o.pp;
  if (given("--zero")) f.zero = o.zero;
  if (given("--microbatches")) f.micro_batch = o.batch / (o.dp * o.microbatches);
  if (given("--schedule")) f.schedule = o.schedule;
  if (given("--recompute")) f.recompute = o.recompute;
  const planner::Choice c = planner::choose(base, "cpu", devices, f);
  const planner::Layout& l = c.best.layout;
  o.dp = l.dp;
  o.tp = l.tp;
  o.pp = l.pp;
  o.microbatches = l.microbatches();
  o.schedule = l.schedule;
  o.virtual_stages = l.virtual_stages;
  o.zero = l.zero;
  o.recompute = l.recompute;
  if (!o.devices.empty()) o.devices = fmt::format("cpu:{}", l.dp * l.tp * l.pp);
  fmt::print(stderr, "baton-train: --layout auto chose {}\n", c.why);
}

int run(const Options& given) {
  const JobEnvironment env = JobEnvironment::from_env();
  std::optional<safetensors::Contents> init;
  Options o = read_init_from(given, init);
  const Data d = load(o);
  if (o.layout == "auto") apply_auto_layout(o, d, env);
  // Checked before training: a prompt the data cannot encode is refused now, not after it.
  std::optional<sample::TextSampler> sampler;
  if (o.sample > 0) {
    if (o.model == "mlp") throw std::invalid_argument("--sample needs a language model: --model gpt or llama");
    sampler.emplace(sample::Request{.tokens = o.sample, .prompt = o.sample_prompt, .temperature = o.temperature,
                                    .seed = o.sample_seed.value_or(o.seed)},
                    d.text, d.tokens);
  }
  const std::int64_t pieces = o.dp * o.microbatches;  // micro-batches of a step, over all replicas
  if (o.batch % pieces != 0) {
    throw std::invalid_argument(fmt::format("--batch {} is not a multiple of --dp {} x --microbatches {} = {}", o.batch,
                                            o.dp, o.microbatches, pieces));
  }
  const std::int64_t mb = o.batch / pieces;
  if (o.print_sbp) {
    if (o.model != "mlp" || !d.train) {
      throw std::invalid_argument("--print-sbp: only --model mlp is sharded from signatures (the gpt is sharded by hand)");
    }
    Graph scratch(o.seed);
    std::string sbp_text;
    models::mlp(scratch, mb, {d.train->width(), o.hidden, o.layers, d.train->num_classes, o.tp}, &sbp_text);
    fmt::print("{}", sbp_text);
    return 0;
  }
  Graph g(o.seed);
  const Value loss = build_loss(g, o, d, mb);
  TrainConfig cfg = train_config(o, env, d);
  auto params = ParameterStore::initialize(g);
  if (init) models::init_from(*init, o.init_from, o.model, *params);
  const std::optional<checkpoint::Checkpoint> resumed = resume(o, env, *params, cfg);
  const std::shared_ptr<checkpoint::Writer> writer = checkpoint_writer(o, env, cfg, d);
  TrainingJob job = compile_training(g, loss, cfg, params);
  if (resumed) checkpoint::check_covers(*resumed, job.trained);
  if (writer) writer->expect(job.snapshots);
  const std::int64_t first = cfg.first_step;  // steps done before this job
  // The rank that reports for the job: where the losses arrive (loss.report) and where the
  // compiled plan brings the trained weights for the held-out evaluation.
  const auto reporter = std::find_if(job.plan.actors.begin(), job.plan.actors.end(),
                                     [](const ActorDesc& a) { return a.reports_loss; });
  const bool leader = env.rank == (reporter == job.plan.actors.end() ? 0u : reporter->where.rank);
  if (printed_instead(o, job, leader)) return 0;
  if (!o.json && leader) print_header(o, job, env, cfg, resumed, first);
  // The dashboard: served here (--dashboard) and/or by the launcher (baton-launch --dashboard).
  observe::Watch watch({.listen = o.dashboard, .title = fmt::format("{} on {}", o.model, o.data)});
  if (watch.serving()) fmt::print(stderr, "baton-train: dashboard at {}\n", watch.url());
  JobSettings js;
  watch.attach(js);
  std::int64_t reported = 0;  // steps handed to the dashboard (by the collector's thread)
  watch.before_sample([&] {
    if (job.losses->steps_done() <= reported) return;
    auto losses = job.losses->per_step();
    for (; reported < static_cast<std::int64_t>(losses.size()); ++reported) {
      const std::int64_t step = first + reported + 1;
      watch.record_step({.step = step, .loss = losses[static_cast<std::size_t>(reported)],
                         .lr = learning_rate(cfg.optimizer, step, o.steps), .samples = step * o.batch});
    }
  });
  const Tracing tracing = start_tracing(o, env, js, watch);
  js.runtime.measure_memory = o.measure_memory;
  // A parameter-server worker under bounded staleness may leave without ending the job
  // (docs/parameter-servers.md): the servers go on with the others and say who left.
  js.may_leave = o.sync == "ps" && o.staleness > 0 && env.distributed() &&
                 static_cast<int>(env.rank) < static_cast<int>(env.world_size) - server_ranks(o, env);
  if (leader) announce_departures(js, o, job, first);
  Comeback back(o.seed);
  if (env.rejoin) js.rejoin_plan = back.compiler(o, d, mb, cfg, env.rank);
  const bool tty = isatty(fileno(stdout)) != 0;
  std::exception_ptr failure;
  const RunReport report = run_with_progress(o, job, env, js, leader, first, tty, failure);
  finish_run(writer.get(), watch, tracing, failure);
  if (o.measure_memory) print_measured_memory(job.plan, report, env.rank);
  if (writer && !o.json && !writer->written().empty()) {
    fmt::print(stderr, "baton-train: rank {} wrote {} checkpoint{}, the last {}\n", env.rank, writer->written().size(),
               writer->written().size() == 1 ? "" : "s", writer->written().back().string());
  }
  // Each rank's own choices: UCX's configuration, whether idle workers polled the data plane
  // or slept (RuntimeSettings::idle_polling), the cores it was bound to, the all-reduce's form,
  // how its pieces crossed to other ranks, and how many link messages its handshakes took
  // (RuntimeSettings::hold_messages_ns).
  if (env.world_size > 1) {
    const std::string hierarchy = hierarchy_note(cfg);
    fmt::print(stderr, "baton-train: r{}: data plane: {}; idle workers: {}{}{}; pieces to other ranks: {} read in "
                       "place ({:.1f} MiB of registers in shared memory), {} inline, {} pulled; messages to other "
                       "ranks: {} in {} link messages\n",
               env.rank, report.data_plane, report.idle_polling,
               report.binding.empty() ? "" : "; bound to " + report.binding,
               hierarchy.empty() ? "" : "; all-reduce: " + hierarchy, report.pieces_read_in_place,
               static_cast<double>(report.shared_register_bytes) / (1 << 20), report.pieces_inline,
               report.pieces_pulled, report.messages_to_other_ranks, report.link_messages);
  }
  if (!leader) return 0;  // the reporting rank speaks for the job
  if (report.departed.size() == 1 && report.rejoined.empty()) {
    fmt::print(stderr, "baton-train: 1 worker left during the run and the job went on without it: {}\n",
               report.departed.front());
  } else if (!report.departed.empty()) {  // several, or one that came back (and may have left again)
    fmt::print(stderr, "baton-train: {} time{} a worker left during the run and the job went on: {}\n",
               report.departed.size(), report.departed.size() == 1 ? "" : "s", fmt::join(report.departed, "; "));
  }
  if (!report.rejoined.empty()) {
    fmt::print(stderr, "baton-train: {} came back during the run: {}\n",
               report.rejoined.size() == 1 ? "a worker" : "workers", fmt::join(report.rejoined, "; "));
  }
  print_result(o, d, job, report, env, sampler, first, tty);
  if (watch.serving() && o.dashboard_linger > 0) {
    std::fflush(stdout);
    fmt::print(stderr, "baton-train: the dashboard stays up at {} for {:.0f} s (Ctrl-C ends it)\n", watch.url(),
               o.dashboard_linger);
    watch.linger(std::chrono::milliseconds(static_cast<std::int64_t>(o.dashboard_linger * 1000)));
  }
  return 0;
}

}  // namespace

// CLI11's own PositiveNumber prints the whole double range on a bad value; say it plainly.
const CLI::Validator positive(
    [](std::string& text) {
      char* end = nullptr;
      double v = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0') return std::string("must be a number, not '" + text + "'");
      return v > 0 ? std::string() : std::string("must be > 0, not " + text);
    },
    "> 0");
const CLI::Validator non_negative(
    [](std::string& text) {
      char* end = nullptr;
      double v = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0') return std::string("must be a number, not '" + text + "'");
      return v >= 0 ? std::string() : std::string("must be >= 0, not " + text);
    },
    ">= 0");

/// The flags of what trains: the model, its data and the optimizer.
void add_model_options(CLI::App& app, Options& o) {
  app.add_option("--model", o.model, "mlp, gpt, llama or gpt2 (GPT-2's layout: tied head, learned positions, tanh GELU)")
      ->check(CLI::IsMember({"mlp", "gpt", "llama", "gpt2"}));
  app.add_option("--data", o.data, "digits, synthetic, text:PATH (characters) or tokens:DIR (baton-prepare-data's shards)");
  app.add_option("--steps", o.steps, "optimizer steps in all (a resumed run goes on to this one)")->check(positive);
  app.add_option("--batch", o.batch, "global batch per step")->check(positive);
  app.add_option("--microbatches", o.microbatches, "micro-batches per step (gradient accumulation)")
      ->check(positive);
  app.add_option("--optimizer", o.optimizer, "sgd, adam or adamw")->check(CLI::IsMember({"sgd", "adam", "adamw"}));
  app.add_option("--lr", o.lr, "learning rate")->check(positive);
  app.add_option("--momentum", o.momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0));
  app.add_option("--weight-decay", o.weight_decay, "weight decay")->check(non_negative);
  app.add_option("--warmup", o.warmup, "linear warm-up steps")->check(non_negative);
  app.add_flag("--cosine", o.cosine, "cosine decay after the warm-up");
  app.add_option("--clip", o.clip, "clip gradients to this global norm (0: off)")->check(non_negative);
  app.add_option("--seed", o.seed, "seed for weights, shuffling and dropout");
  app.add_option("--layers", o.layers, "hidden layers (mlp) or blocks (gpt, llama)")->check(positive);
  app.add_option("--hidden", o.hidden, "mlp hidden width")->check(positive);
  app.add_option("--d-model", o.d_model, "gpt and llama width")->check(positive);
  app.add_option("--heads", o.heads, "gpt and llama attention (query) heads")->check(positive);
  app.add_option("--seq", o.seq, "gpt and llama context length")->check(positive);
  app.add_option("--kv-heads", o.kv_heads, "llama key/value heads (grouped-query attention; must divide --heads; "
                 "default: --heads)")
      ->check(positive);
  app.add_option("--ffn-hidden", o.ffn_hidden, "llama SwiGLU hidden width (default: 8 d_model / 3 rounded up to a "
                 "multiple of 32)")
      ->check(positive);
  app.add_option("--positions", o.positions, "gpt2: rows of the learned position table (default: the --init-from "
                 "file's, else --seq)")
      ->check(positive);
  app.add_option("--rope-base", o.rope_base, "llama RoPE base (rope_theta)")->check(positive);
  app.add_flag("--tie-embeddings", o.tie_embeddings, "llama: the LM head is the token table transposed");
  app.add_option("--attention", o.attention, "gpt and llama attention: naive (matmul, mask, softmax, matmul: the T x T scores in "
                 "memory), fused (one op, baton's FlashAttention-style kernels; no scores in memory), cudnn (one "
                 "op, cuDNN 9's fused attention: CUDA devices, bf16) or auto (cudnn where cuDNN loads, else fused, "
                 "on CUDA devices; naive on the CPU)")
      ->check(CLI::IsMember({"auto", "naive", "fused", "cudnn"}));
  app.add_option("--gelu", o.gelu, "gpt's MLP activation: erf (exact, torch's nn.GELU()) or tanh (the tanh approximation: "
                 "GPT-2's gelu_new, Megatron's bias_gelu). gpt2 always has tanh, llama SwiGLU")
      ->check(CLI::IsMember({"erf", "tanh"}));
  app.add_option("--threads", o.threads, "worker threads: 1, or 2 (forward | backward)")->check(CLI::Range(1, 2));
  app.add_option("--blas-threads", o.blas_threads,
                 "threads of every CPU matrix product (default 1, one per actor; more pays where the plan leaves cores "
                 "idle: one device, one micro-batch)")
      ->check(CLI::Range(1, 256));
}

/// The flags of how the job is cut over devices: data, pipeline and tensor parallelism, their
/// synchronisation and collectives, precision and the pipeline's schedule.
void add_parallel_options(CLI::App& app, Options& o) {
  app.add_option("--dp", o.dp, "data-parallel replicas (in-process devices, and the ranks under baton-launch)")
      ->check(CLI::Range(1, 64));
  app.add_option("--bucket-mb", o.bucket_mb, "data parallelism: gradients all-reduced in buckets of this many MiB "
                 "(DDP's 25; 0: one all-reduce per weight)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--pp", o.pp, "pipeline stages, each on its own device")->check(CLI::Range(1, 64));
  app.add_option("--tp", o.tp, "tensor-parallel shards (Megatron: MLP layer pairs; GPT and Llama attention heads, MLP and vocabulary)")
      ->check(CLI::Range(1, 64));
  app.add_option("--grad-compression", o.grad_compression,
                 "with --dp: gradients travel between replicas in bf16 or fp16 (IEEE half: 3 more mantissa bits, "
                 "range ends at 65504) and are summed in f32 (half the bytes; CPU, the actors' ring), or none")
      ->check(CLI::IsMember({"none", "bf16", "fp16"}));
  app.add_option("--sync", o.sync,
                 "how --dp replicas' gradients meet: allreduce (each replica updates its own weights from the "
                 "all-reduced sum) or ps (parameter servers: weights and optimizer state sharded over --servers, "
                 "which add the replicas' gradients and hand the weights back; over ranks the servers are the last "
                 "--servers ranks)")
      ->check(CLI::IsMember({"allreduce", "ps"}));
  app.add_option("--servers", o.servers, "with --sync ps: how many parameter servers")->check(CLI::Range(1, 32));
  app.add_option("--staleness", o.staleness,
                 "with --sync ps: apply each step's gradient this many steps late (bounded staleness, exactly S; "
                 "0: synchronous)")
      ->check(CLI::Range(0, 1000));
  app.add_option("--zero", o.zero, "with --dp: ZeRO stage: 1 splits the optimizer state (and master weights) over the "
                 "replicas, 2 the gradients too (reduce-scatter instead of all-reduce), 3 the weights too (each gathered "
                 "just before its readers in each pass, FSDP); 0 none. Same results as plain dp")
      ->check(CLI::Range(0, 3));
  app.add_option("--allreduce", o.allreduce, "with --dp over ranks on several hosts (baton-launch --nnodes): auto "
                 "(hierarchical where the replicas span hosts evenly: within each host, across hosts, within) or flat "
                 "(one ring over every replica)")
      ->check(CLI::IsMember({"auto", "flat"}));
  app.add_option("--collectives", o.collectives, "how --dp all-reduces gradients, --tp sums its shards and --pp moves "
                 "registers between GPUs of two ranks: auto (NCCL where every member is on a CUDA device of its own, "
                 "else actors), nccl, or actors (a ring of add actors, a chain of adds, host-staged transfers; any "
                 "devices)")
      ->check(CLI::IsMember({"auto", "nccl", "actors"}));
  app.add_option("--precision", o.precision, "f32, or bf16: mixed precision as torch.autocast (matrix products in bf16, "
                 "softmax, losses and norms in f32; f32 master weights and optimizer)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--schedule", o.schedule,
                 "pipeline schedule (each device's order of passes and depth of activations): gpipe, 1f1b, interleaved "
                 "(--virtual-stages stages a device), zb-h1 (backward split into input and weight gradients, a third "
                 "of 1f1b's bubble), zb-v (two stages a device in a V, backward split; our greedy order, near no "
                 "bubble) or 2bw (PipeDream-2BW: 1f1b with each update applied one step late)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "2bw"}));
  app.add_option("--virtual-stages", o.virtual_stages,
                 "with --schedule interleaved: stages per device (the model cut into --pp x this; --microbatches a "
                 "multiple of --pp)")
      ->check(CLI::Range(1, 16));
  app.add_flag("--print-schedule", o.print_schedule,
               "print each device's order of passes (F0 F1 B0 W0 ...) with its peak activations and bubble, prove the "
               "plan deadlock-free by its dry run, print its memory per device, and exit");
  app.add_option("--balance", o.balance, "pipeline stages of equal cost by: flops (estimated) or profile (each "
                 "op's kernel timed on its shapes; one rank only)")
      ->check(CLI::IsMember({"flops", "profile"}));
}

/// The flags of where and how it runs: devices, output, memory, checkpoints, sampling.
void add_run_options(CLI::App& app, Options& o) {
  add_parallel_options(app, o);
  app.add_option("--layout", o.layout,
                 "given (the flags say it), or auto: baton-plan's search chooses dp, tp, pp, micro-batches, schedule, ZeRO "
                 "and recomputation for this machine's in-process CPU devices, holding those flags given (docs/planning.md)")
      ->check(CLI::IsMember({"given", "auto"}))
      ->capture_default_str();
  app.add_option("--devices", o.devices,
                 "where the dp x pp x tp places run: cpu:K, cuda:K or sim:K (K in-process devices per rank; default cpu, dp x "
                 "pp x tp / ranks), or RANK:TYPE:INDEX per place, comma-separated (0:cuda:0,0:cuda:1)");
  app.add_flag("--json", o.json, "print one JSON object as the last line");
  app.add_option("--dashboard", o.dashboard,
                 "serve a live dashboard of this job at HOST:PORT (:PORT or PORT: on 127.0.0.1; port 0: any free one)");
  app.add_option("--dashboard-linger", o.dashboard_linger, "keep the dashboard up this many seconds after training")
      ->check(non_negative);
  app.add_option("--print-plan", o.print_plan, "print the compiled plan (text or dot) and exit")
      ->expected(0, 1)
      ->default_str("text")
      ->check(CLI::IsMember({"text", "dot"}));
  app.add_option("--print-after", o.print_after,
                 "print the compiler's IR after these passes (comma-separated, or all), as LLVM's -print-after: "
                 "autodiff, sbp, stages, recompute, replicas, sync, lower, updates, epilogues, tp_collectives, device_copies, "
                 "transfers, nccl_p2p, lanes, memory")
      ->delimiter(',');
  app.add_flag("!--no-memory-plan", o.memory_plan,
               "give every register slot memory of its own instead of packing slots whose lives never meet into "
               "one arena per device");
  app.add_flag("!--no-in-place", o.in_place,
               "give every elementwise op's output bytes of its own, instead of letting the memory plan put it in "
               "the bytes of an input it reads last");
  app.add_flag("!--no-epilogues", o.epilogues,
               "keep each Linear layer's product and its bias's add (and GELU, with --gelu tanh), and its weight "
               "gradient and its bias's sum, as actors of their own instead of one fused actor each (cuBLASLt's "
               "epilogues on CUDA, where the fused forward adds the bias before rounding a bf16 product): to compare "
               "numbers or speed");
  app.add_flag("!--no-multi-tensor", o.multi_tensor,
               "step each weight on a GPU with its own optimizer launch, instead of all of a device's weights in a "
               "few multi-tensor launches once the device's gradients of the step are in (the same numbers): to "
               "compare speed");
  app.add_flag("--cuda-graphs,!--no-cuda-graphs", o.cuda_graphs,
               "run each GPU's runs of forward and backward ops as one actor each, captured into a CUDA graph and "
               "launched as one (on by default; the same numbers): --no-cuda-graphs keeps an actor and a launch per op, "
               "to compare speed or to see each op's time");
  app.add_option("--recompute", o.recompute,
                 "activation recomputation: none, selective (the attention scores computed again in the backward pass "
                 "instead of kept) or full (only each block's input kept, the block computed again in its backward)")
      ->check(CLI::IsMember({"none", "selective", "full"}));
  app.add_option("--memory-budget,--device-memory", o.memory_budget,
                 "refuse, before running, a plan that needs more than this on some device (bytes, or 512MiB, 2GiB, "
                 "1.5GB; CPU devices too), naming the largest consumers");
  app.add_flag("--measure-memory", o.measure_memory,
               "measure each device's register memory in use over the run and print its high-water mark beside "
               "the plan's account of the same bytes (stderr)");
  app.add_flag("--no-eval{false}", o.eval,
               "skip the held-out evaluation after training (its memory then does not enter the process's peak: "
               "baton-bench-memory measures training alone)");
  app.add_flag("--print-memory", o.print_memory,
               "print what the plan needs on each device (peak bytes of weights, optimizer state, activations, "
               "gradients, arena slack, the largest consumers), from the plan alone, and exit (--json: one object)");
  app.add_flag("--print-sbp", o.print_sbp,
               "print each tensor's inferred parallel signature (S(axis), B, P) over --tp shards and the movement "
               "inserted, and exit (--model mlp)");
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "write checkpoints here (DIR/step-N/: safetensors weights and optimizer state, index.json)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "a checkpoint every N steps, and at the last (default: the last only)")
      ->check(non_negative);
  app.add_option("--checkpoint-keep", o.checkpoint_keep, "checkpoints kept: the newest K complete ones")->check(CLI::Range(1, 1 << 20));
  app.add_option("--resume", o.resume, "continue from the newest complete checkpoint in DIR (or from DIR/step-N itself), "
                 "with the same settings; with --checkpoint-dir it goes on writing");
  app.add_option("--init-from", o.init_from,
                 "start from the weights in this safetensors file (F32, F16 or BF16): --model llama and gpt2 in "
                 "transformers' names and layout (LlamaForCausalLM, GPT-2), gpt and mlp in baton's own")
      ->check(CLI::ExistingFile);
  app.add_option("--trace", o.trace, "write a Chrome trace of the run (acts, slot occupancy, requests) to FILE");
  app.add_option("--sample", o.sample, "after training, draw this many tokens of text from the model (gpt, llama) "
                 "and print them")
      ->check(positive);
  app.add_option("--sample-prompt", o.sample_prompt, "--sample: the text to continue (default: the data's first token)");
  app.add_option("--temperature", o.temperature, "--sample: softmax temperature (0: greedy)")->check(non_negative);
  app.add_option("--sample-seed", o.sample_seed, "--sample: the draws' seed (default: --seed)");
}

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"baton-train: train a model on real data as a stream of actors"};
  // A flag given twice takes its last value, so that scripts/run.sh demo ARGS can override the demo's own.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add_model_options(app, o);
  add_run_options(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (app.count("--print-plan") && o.print_plan.empty()) o.print_plan = "text";
  for (const char* flag : {"--dp", "--tp", "--pp", "--zero", "--microbatches", "--schedule", "--recompute"}) {
    if (app.count(flag) > 0) o.layout_given.emplace_back(flag);
  }
  for (const char* flag : {"--sample-prompt", "--temperature", "--sample-seed"}) {
    if (app.count(flag) && o.sample == 0) {
      fmt::print(stderr, "baton-train: error: {} needs --sample N\n", flag);
      return 1;
    }
  }
  if (app.count("--checkpoint-every") && o.checkpoint_dir.empty()) {
    fmt::print(stderr, "baton-train: error: --checkpoint-every needs --checkpoint-dir\n");
    return 1;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-train: error: {}\n", e.what());
    return 1;
  }
}
