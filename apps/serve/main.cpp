// baton-serve: a language model trained by baton-train (its checkpoint) or published weights
// (a safetensors file) answering OpenAI's completions API, with continuous batching over a paged
// KV cache (engine.h) behind the HTTP front end (http.h). docs/serving.md is the guide.
//
//   baton-serve --checkpoint ckpt/ --api-key "$KEY"                     # what baton-train wrote
//   baton-serve --model llama --init-from model.safetensors --tokenizer tokenizer.model --heads 32
//   baton-serve --watch ckpt/ ...     # follows a training job: each new checkpoint swapped in
//   baton-launch --nproc-per-node 2 -- baton-serve --checkpoint ckpt/   # pp 2: a stage per rank
//   baton-launch --nproc-per-node 4 -- baton-serve --checkpoint ckpt/ --tp 2   # pp 2 x tp 2
#include <unistd.h>

#include <csignal>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "baton/actors/job.h"
#include "baton/graph.h"
#include "baton/graph/checkpoint.h"
#include "baton/graph/safetensors.h"
#include "baton/graph/tokens.h"
#include "baton/kernels/blas_choice.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/data.h"
#include "baton/kernels/ops.h"
#include "baton/transport/control.h"
#include "baton/transport/data_plane.h"
#include "bytes.h"
#include "engine.h"
#include "http.h"
#include "import.h"

namespace {

using namespace baton;
using namespace baton::serve;
namespace fs = std::filesystem;

struct Options {
  std::string checkpoint, watch;
  std::string model, init_from, tokenizer, vocab_text;
  std::int64_t heads = 0, kv_heads = 0, seq = 0;
  double rope_base = 10000.0, norm_eps = 0;
  std::string served_name;
  std::string listen = "127.0.0.1:8000";
  std::string api_key;
  std::int64_t max_batch = 32, max_batch_tokens = 256, block_size = 16, max_queue = 256;
  std::string kv_cache_memory, device_memory;
  std::string batching = "continuous";
  int threads = 1;
  int drain_timeout = 600;
  double watch_every = 2.0;
  std::int64_t pp = 0;  // 0: the job's ranks / tp (1 without baton-launch)
  std::int64_t tp = 1;
  double step_timeout = 120;
  std::string device = "cpu";  // cpu, cuda (this rank's local GPU), cuda:N, sim:N (tests)
  bool graphs = true;          // on a device: the steps as graphs (--no-graphs)
};

std::string rank_tag;  // "[rank 1/2]" in a job of several ranks

void log(const std::string& line) { fmt::print(stderr, "baton-serve{}: {}\n", rank_tag, line); }

std::int64_t config_int(const checkpoint::Checkpoint& c, const std::string& key) {
  auto it = c.config.find(key);
  if (it == c.config.end()) {
    throw std::runtime_error(fmt::format("{}: the checkpoint's config has no '{}'", c.dir.string(), key));
  }
  return std::stoll(it->second);
}

/// Rows of a weight saved whole ("NAME") or in tensor-parallel parts ("NAME.tp<k>", cut by rows).
std::int64_t rows_of(const std::map<std::string, Tensor>& weights, const std::string& name) {
  if (auto it = weights.find(name); it != weights.end()) return it->second.dim(0);
  std::int64_t rows = 0;
  for (int k = 0;; ++k) {
    auto it = weights.find(fmt::format("{}.tp{}", name, k));
    if (it == weights.end()) break;
    rows += it->second.dim(0);
  }
  if (rows == 0) throw std::runtime_error(fmt::format("the weights have no '{}'", name));
  return rows;
}

/// The model a checkpoint of baton-train holds: its config's shape, the vocabulary its token
/// table has.
DecodeModel model_of(const checkpoint::Checkpoint& c) {
  DecodeModel m;
  const std::string kind = c.config.count("model") ? c.config.at("model") : "";
  const std::int64_t d = config_int(c, "d_model"), heads = config_int(c, "heads"), layers = config_int(c, "layers"),
                     seq = config_int(c, "seq");
  if (kind == "gpt") {
    m.kind = DecodeModel::Kind::gpt;
    m.gpt = {.vocab = rows_of(c.weights, "wte"), .seq = seq, .d_model = d, .heads = heads, .layers = layers,
             .gelu = c.config.count("gelu") ? models::parse_gelu(c.config.at("gelu")) : GeluApprox::none};
  } else if (kind == "gpt2") {
    m.kind = DecodeModel::Kind::gpt2;
    m.gpt2 = {.vocab = rows_of(c.weights, "wte.weight"), .seq = seq, .positions = config_int(c, "positions"),
              .d_model = d, .heads = heads, .layers = layers};
  } else if (kind == "llama") {
    m.kind = DecodeModel::Kind::llama;
    m.llama = {.vocab = rows_of(c.weights, "model.embed_tokens.weight"), .seq = seq, .d_model = d, .heads = heads,
               .kv_heads = config_int(c, "kv_heads"), .ffn_hidden = config_int(c, "ffn_hidden"), .layers = layers,
               .rope_base = std::stod(c.config.at("rope_base")), .tie_embeddings = c.config.at("tie_embeddings") == "true"};
  } else {
    throw std::runtime_error(fmt::format("{}: a checkpoint of --model '{}', which is no language model baton-serve "
                                         "serves (gpt, gpt2, llama)",
                                         c.dir.string(), kind));
  }
  return m;
}

/// The weights of `m` (one device's names) from a checkpoint of any tp.
std::shared_ptr<ParameterStore> weights_of(const DecodeModel& m, checkpoint::Checkpoint& c) {
  Graph g;
  m.full(g);
  auto params = ParameterStore::initialize(g);
  checkpoint::reshard(c, *params);
  for (const auto& [name, t] : params->values()) {
    auto it = c.weights.find(name);
    if (it == c.weights.end()) throw std::runtime_error(fmt::format("{}: no weight '{}'", c.dir.string(), name));
    if (it->second.shape() != t.shape() || it->second.dtype() != t.dtype()) {
      throw std::runtime_error(
          fmt::format("{}: '{}' is {}, the model's {}", c.dir.string(), name, it->second.describe(), t.describe()));
    }
    params->set(name, it->second);
  }
  return params;
}

/// Text <-> ids for a checkpoint: what it carries (format 2: "vocab_bytes" in its config, or
/// its tokenizer's file beside its index), else what its data path still holds.
std::shared_ptr<const Codec> codec_of(const checkpoint::Checkpoint& c, const Options& o) {
  if (!o.tokenizer.empty()) return sentencepiece_codec(o.tokenizer);
  if (!o.vocab_text.empty()) return byte_codec(data::load_text(o.vocab_text).vocab);
  if (auto it = c.config.find("vocab_bytes"); it != c.config.end()) {
    std::vector<unsigned char> vocab;
    for (std::size_t i = 0; i + 1 < it->second.size(); i += 2)
      vocab.push_back(static_cast<unsigned char>(std::stoi(it->second.substr(i, 2), nullptr, 16)));
    return byte_codec(std::move(vocab));
  }
  if (auto it = c.assets.find("tokenizer.model"); it != c.assets.end()) return sentencepiece_codec(it->second.string());
  const std::string data = c.config.count("data") ? c.config.at("data") : "";
  if (data.starts_with("text:") && fs::exists(data.substr(5))) {
    log(fmt::format("the checkpoint carries no vocabulary: the bytes of {} (its training text) are taken", data.substr(5)));
    return byte_codec(data::load_text(data.substr(5)).vocab);
  }
  if (data.starts_with("tokens:")) {
    const std::string dir = data.substr(7);
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.path().extension() == ".model") return sentencepiece_codec(e.path().string());
    }
  }
  log("no tokenizer: prompts must be token ids, and completions are ids (give --tokenizer or --vocab-text)");
  return nullptr;
}

/// --model with --init-from: the shape the file's tensors give, the flags the rest.
DecodeModel model_from_file(const Options& o, const safetensors::Contents& file) {
  auto find = [&](const std::string& name) -> const Tensor* {
    if (const Tensor* t = file.find(name)) return t;
    return file.find("transformer." + name);
  };
  auto need = [&](const std::string& name) -> const Tensor& {
    const Tensor* t = find(name);
    if (t == nullptr) throw std::invalid_argument(fmt::format("{}: no tensor '{}'", o.init_from, name));
    return *t;
  };
  auto count_layers = [&](const std::string& fmt_prefix) {
    std::int64_t n = 0;
    while (find(fmt::format(fmt::runtime(fmt_prefix), n)) != nullptr) ++n;
    return n;
  };
  if (o.heads < 1) throw std::invalid_argument("--heads: give the model's attention heads (the file does not say)");
  DecodeModel m;
  if (o.model == "gpt2") {
    const Tensor& wte = need("wte.weight");
    const Tensor& wpe = need("wpe.weight");
    m.kind = DecodeModel::Kind::gpt2;
    m.gpt2 = {.vocab = wte.dim(0), .seq = wpe.dim(0), .positions = wpe.dim(0), .d_model = wte.dim(1), .heads = o.heads,
              .layers = count_layers("h.{}.ln_1.weight"), .norm_eps = o.norm_eps > 0 ? o.norm_eps : 1e-5};
  } else if (o.model == "llama") {
    const Tensor& table = need("model.embed_tokens.weight");
    const std::int64_t d = table.dim(1), dh = d / o.heads;
    m.kind = DecodeModel::Kind::llama;
    m.llama = {.vocab = table.dim(0), .seq = o.seq > 0 ? o.seq : 2048, .d_model = d, .heads = o.heads,
               .kv_heads = need("model.layers.0.self_attn.k_proj.weight").dim(0) / dh,
               .ffn_hidden = need("model.layers.0.mlp.gate_proj.weight").dim(0),
               .layers = count_layers("model.layers.{}.input_layernorm.weight"), .rope_base = o.rope_base,
               .norm_eps = o.norm_eps > 0 ? o.norm_eps : 1e-5, .tie_embeddings = find("lm_head.weight") == nullptr};
  } else {
    throw std::invalid_argument(fmt::format("--model '{}': baton-serve reads gpt2 and llama files (baton's own gpt: "
                                            "serve its --checkpoint)",
                                            o.model));
  }
  return m;
}

struct Loaded {
  DecodeModel model;
  std::shared_ptr<ParameterStore> params;
  std::shared_ptr<const Codec> codec;
  std::string label, name;
  std::int64_t step = -1;
  std::int64_t created = 0;
};

Loaded load_checkpoint(const fs::path& dir, const Options& o) {
  const checkpoint::Found found = checkpoint::find(dir);
  for (const std::string& s : found.skipped) log("passed over " + s);
  checkpoint::Checkpoint c = checkpoint::load(found.dir);
  Loaded l;
  l.model = model_of(c);
  l.params = weights_of(l.model, c);
  l.codec = codec_of(c, o);
  l.step = c.step;
  l.label = fmt::format("checkpoint step {} ({})", c.step, found.dir.string());
  l.name = l.model.name();
  l.created = std::chrono::duration_cast<std::chrono::seconds>(
                  std::chrono::file_clock::to_sys(fs::last_write_time(found.dir)).time_since_epoch())
                  .count();
  return l;
}

Loaded load(const Options& o) {
  if (!o.checkpoint.empty() || !o.watch.empty()) return load_checkpoint(o.checkpoint.empty() ? o.watch : o.checkpoint, o);
  if (o.model.empty() || o.init_from.empty()) {
    throw std::invalid_argument("give --checkpoint DIR (baton-train's), or --model gpt2|llama with --init-from FILE");
  }
  const safetensors::Contents file = safetensors::read(o.init_from);
  Loaded l;
  l.model = model_from_file(o, file);
  Graph g;
  l.model.full(g);
  l.params = ParameterStore::initialize(g);
  models::init_from(file, o.init_from, o.model, *l.params);
  if (!o.tokenizer.empty()) l.codec = sentencepiece_codec(o.tokenizer);
  else if (!o.vocab_text.empty()) l.codec = byte_codec(data::load_text(o.vocab_text).vocab);
  l.label = o.init_from;
  l.name = o.model;
  l.created = std::chrono::duration_cast<std::chrono::seconds>(
                  std::chrono::file_clock::to_sys(fs::last_write_time(o.init_from)).time_since_epoch())
                  .count();
  return l;
}

/// --watch: a thread that swaps in each newer complete checkpoint (checkpoint::find passes over
/// one being written; one pruned while read fails to load and is passed over).
class Watcher {
 public:
  Watcher(Engine& engine, const Options& o, std::int64_t step) : engine_(engine), o_(o), step_(step) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Watcher() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    while (!cv_.wait_for(lock, std::chrono::duration<double>(o_.watch_every), [&] { return stop_; })) {
      lock.unlock();
      try {
        const checkpoint::Found found = checkpoint::find(o_.watch);
        if (found.dir != last_dir_) {
          Loaded l = load_checkpoint(found.dir, o_);
          last_dir_ = found.dir;
          if (l.step > step_) {
            log(fmt::format("a new checkpoint, step {}: admission pauses while the running requests finish", l.step));
            engine_.swap_weights(l.params, l.label,
                                 std::chrono::steady_clock::now() + std::chrono::seconds(o_.drain_timeout));
            step_ = l.step;
          }
        }
      } catch (const std::exception& e) {
        if (last_error_ != e.what()) log(fmt::format("--watch {}: {} (the weights stay)", o_.watch, e.what()));
        last_error_ = e.what();
      }
      lock.lock();
    }
  }

  Engine& engine_;
  const Options& o_;
  std::int64_t step_;
  std::string last_error_;
  fs::path last_dir_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

/// A pipeline across the ranks of a job (baton-launch, Slurm): the control plane (rendezvous,
/// aborts) and the data plane the stages' packets travel on.
struct RankJob {
  RankJob(const JobEnvironment& e, const ServeShape& shape, const DecodeModel& m, std::int64_t pp, std::int64_t tp)
      : env(e),
        data(e.rank, e.world_size, data_plane_for_job(e, {})),
        link(data),
        control(transport::ClientSettings{.master = e.master, .token = e.token, .rank = e.rank,
                                          .world_size = e.world_size}) {
    control.on_abort([this](const std::string& reason) {
      link.abort(reason);
      std::lock_guard lock(mutex);
      if (engine != nullptr) engine->fail(reason);
    });
    // Every rank compiles the same stages: a rank started with other flags or another checkpoint
    // is refused at the rendezvous, naming the ranks whose hashes differ.
    const auto table =
        control.join(transport::RankInfo{.rank = env.rank, .data_address = data.address(), .plan_hash = shape.hash(m, pp, tp)});
    std::vector<std::string> addresses;
    for (const auto& r : table) addresses.push_back(r.data_address);
    data.connect(addresses);
    data.start();
    control.barrier("serve-start", std::chrono::minutes(2));
  }
  ~RankJob() { data.stop(); }
  void watch(Engine* e) {
    std::lock_guard lock(mutex);
    engine = e;
  }

  JobEnvironment env;
  transport::DataPlane data;
  StageLink link;
  transport::ControlClient control;
  std::mutex mutex;
  Engine* engine = nullptr;
};

/// This rank's part: shard t of stage s (rank s * tp + t), its weights cut out of the whole.
struct Part {
  std::int64_t stage = 0, shard = 0;
  std::pair<std::int64_t, std::int64_t> layers;
};

/// Ranks 1..pp*tp-1: a stage's shard, no HTTP; until rank 0 says stop (0) or the job fails (1).
int run_stage(const Loaded& l, const ServeShape& shape, std::int64_t pp, std::int64_t tp, RankJob& job, const Part& part,
              std::chrono::milliseconds step_timeout) {
  // SIGTERM and SIGINT reach every rank from the launcher: rank 0 drains, then says stop.
  std::signal(SIGTERM, SIG_IGN);
  std::signal(SIGINT, SIG_IGN);
  try {
    const auto group = tp > 1 ? TpGroup::of_stage(job.link, part.stage, part.shard, tp, step_timeout) : nullptr;
    Stage stage(l.model, part.layers, shape, l.params, tp, part.shard, group.get());
    log(fmt::format("stage {} of {}{}: layers [{}, {}){}, KV cache {:.1f} MiB, buffers {:.1f} MiB; serving (pid {})",
                    part.stage, pp, tp > 1 ? fmt::format(", shard {} of {}", part.shard, tp) : "", part.layers.first,
                    part.layers.second, stage.last() ? " and the head" : "",
                    static_cast<double>(stage.cache_bytes()) / (1 << 20),
                    static_cast<double>(stage.buffer_bytes()) / (1 << 20), ::getpid()));
    serve_stage(stage, job.link, job.env.rank, pp, tp);
  } catch (const std::exception& e) {
    const std::string why = job.control.aborted().value_or(e.what());
    job.control.fail(e.what());
    log("stopped: " + why);
    return 1;
  }
  job.control.finish(std::chrono::minutes(1));
  log("stopped (rank 0 said so)");
  return 0;
}

/// The KV cache's bytes on this rank: --kv-cache-memory, or what --device-memory leaves after
/// this rank's weights and the steps' buffers (a step of max_batch_tokens rows holds at most a
/// few of the model's widths per row and its logits), or --kv-cache-memory within that.
std::int64_t kv_cache_budget(const Options& o, const Loaded& l) {
  std::int64_t kv_cache_bytes = EngineSettings{}.kv_cache_bytes;
  if (!o.kv_cache_memory.empty()) kv_cache_bytes = parse_bytes("--kv-cache-memory", o.kv_cache_memory);
  if (o.device_memory.empty()) return kv_cache_bytes;
  std::int64_t weight_bytes = 0;
  for (const auto& [name, t] : l.params->values()) weight_bytes += static_cast<std::int64_t>(t.nbytes());
  const std::int64_t budget = parse_bytes("--device-memory", o.device_memory);
  const std::int64_t width = std::max<std::int64_t>(l.model.vocab(), 8 * l.model.kv_heads() * l.model.head_dim());
  const std::int64_t buffers = 4 * o.max_batch_tokens * width * static_cast<std::int64_t>(size_of(l.model.dtype()));
  const std::int64_t left = budget - weight_bytes - buffers;
  if (left <= 0) {
    throw std::invalid_argument(fmt::format("--device-memory {}: the weights ({} bytes) and the steps' buffers (about "
                                            "{}) leave nothing for the KV cache",
                                            o.device_memory, weight_bytes, buffers));
  }
  return o.kv_cache_memory.empty() ? left : std::min(left, kv_cache_bytes);
}

/// --api-key, else BATON_API_KEY, else a random one (logged); a weak or guessable key is refused.
std::string api_key_of(const Options& o) {
  std::string key = o.api_key;
  if (key.empty() && std::getenv("BATON_API_KEY") != nullptr) key = std::getenv("BATON_API_KEY");
  if (key.empty()) {
    key = random_api_key();
    log(fmt::format("no --api-key or BATON_API_KEY: requests must carry this one: Authorization: Bearer {}", key));
  } else if (const std::string why = check_api_key(key); !why.empty()) {
    throw std::invalid_argument(fmt::format("--api-key: {}", why));
  }
  return key;
}

/// --device: "cpu", "cuda" (GPU `local_rank` of this host: one rank per GPU under baton-launch),
/// "cuda:N", or "sim:N" (a simulated device: the CPU's kernels on a stream, for tests). A GPU
/// that cannot be used, and tensor parallelism on a device (its shards' partial sums are added
/// on the host by serve.tp_sum, in the step's thread), are refused naming the flag.
Device device_of(const Options& o, const JobEnvironment& env, std::int64_t tp) {
  Device d;
  try {
    d = o.device == "cuda" ? Device{DeviceType::cuda, static_cast<std::uint8_t>(env.local_rank)} : Device::parse(o.device);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("--device {}: {}", o.device, e.what()));
  }
  if (d.type == DeviceType::cuda) {
    if (const auto& a = cuda::availability(); !a.ok) {
      throw std::invalid_argument(fmt::format("--device {}: {}", o.device, a.reason));
    }
  }
  if (d.type != DeviceType::cpu && tp > 1) {
    throw std::invalid_argument(fmt::format("--device {} with --tp {}: the shards' partial sums are added on the host "
                                            "between the ranks, which a device's stage cannot do yet; use --pp across "
                                            "GPUs, or --tp on CPUs",
                                            o.device, tp));
  }
  return d;
}

/// The ranks of a job are pp x tp, one shard of one stage each; tp needs a job; --watch one rank.
void check_layout(const Options& o, const JobEnvironment& env, std::int64_t pp, std::int64_t tp) {
  const auto world = static_cast<std::int64_t>(env.world_size);
  if (env.distributed()) {
    rank_tag = fmt::format("[rank {}/{}]", env.rank, env.world_size);
    if (pp * tp != world) {
      throw std::invalid_argument(fmt::format("--pp {} --tp {} in a job of {} ranks: across ranks each rank runs one "
                                              "shard of one stage, so pp x tp must be the job's size (leave --pp out)",
                                              pp, tp, world));
    }
    if (!o.watch.empty()) {
      throw std::invalid_argument("--watch with a model cut across ranks is not supported yet: serve from one rank "
                                  "(--pp stages in one process) to follow a training job");
    }
  } else if (tp > 1) {
    throw std::invalid_argument(fmt::format("--tp {}: tensor parallelism runs across the ranks of a job: start "
                                            "pp x tp ranks with baton-launch --nproc-per-node {}",
                                            tp, pp * tp));
  }
}

int run(const Options& o) {
  set_blas_threads(o.threads);
  const JobEnvironment env = JobEnvironment::from_env();
  const auto world = static_cast<std::int64_t>(env.world_size);
  const std::int64_t tp = o.tp;
  if (world % tp != 0) {
    throw std::invalid_argument(fmt::format("--tp {} in a job of {} ranks: the ranks are pp x tp, so tp must divide them",
                                            tp, world));
  }
  const std::int64_t pp = o.pp > 0 ? o.pp : (env.distributed() ? world / tp : 1);
  check_layout(o, env, pp, tp);
  Loaded l = load(o);
  const auto stages = stage_layers(l.model.layers(), pp);
  std::int64_t cache_layers = l.model.layers();
  Part part;
  if (env.distributed()) {
    part.stage = env.rank / tp;
    part.shard = env.rank % tp;
    part.layers = stages[static_cast<std::size_t>(part.stage)];
    // Each rank keeps its stage's weights only (its shard of them), and holds the caches of its
    // layers (its kv heads) in its budget (the largest stage's decides the blocks, the same on
    // every rank).
    l.params = stage_weights(l.model, part.layers, *l.params, tp, part.shard);
    cache_layers = 0;
    for (const auto& [b, e] : stages) cache_layers = std::max(cache_layers, e - b);
  }
  const auto step_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(o.step_timeout * 1000));

  const Device device = device_of(o, env, tp);
  const std::int64_t kv_cache_bytes = kv_cache_budget(o, l);
  ServeShape shape =
      serve_shape(l.model, o.max_batch, o.max_batch_tokens, o.block_size, kv_cache_bytes, cache_layers, tp);
  shape.device = device;
  shape.graphs = o.graphs;

  std::optional<RankJob> job;
  if (env.distributed()) {
    log(fmt::format("joining the job at {} ({} ranks, pp {} x tp {}: stage {}{} holds layers [{}, {}))", env.master,
                    env.world_size, pp, tp, part.stage, tp > 1 ? fmt::format(" shard {}", part.shard) : "",
                    part.layers.first, part.layers.second));
    job.emplace(env, shape, l.model, pp, tp);
    if (env.rank > 0) return run_stage(l, shape, pp, tp, *job, part, step_timeout);
  }

  const std::size_t colon = o.listen.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument(fmt::format("--listen '{}': expected HOST:PORT", o.listen));
  const std::string host = o.listen.substr(0, colon);
  const int port = std::stoi(o.listen.substr(colon + 1));
  if (port < 0 || port > 65535) throw std::invalid_argument(fmt::format("--listen '{}': no such port", o.listen));

  const std::string key = api_key_of(o);

  EngineSettings s{.model = l.model,
                   .model_id = o.served_name.empty() ? l.name : o.served_name,
                   .params = l.params,
                   .weights = l.label,
                   .created = l.created,
                   .codec = l.codec,
                   .max_batch = o.max_batch,
                   .max_batch_tokens = o.max_batch_tokens,
                   .block_size = o.block_size,
                   .kv_cache_bytes = kv_cache_bytes,
                   .max_queue = o.max_queue,
                   .continuous = o.batching == "continuous",
                   .pp = pp,
                   .device = device,
                   .graphs = o.graphs,
                   .cache_layers = cache_layers,
                   .runner = {},
                   .log = log};
  std::unique_ptr<TpGroup> group;  // rank 0's shards of stage 0 (tp > 1)
  if (job) {
    if (tp > 1) group = TpGroup::of_stage(job->link, 0, 0, tp, step_timeout);
    s.runner = [&l, &stages, &job, &group, pp, tp, step_timeout](const ServeShape& sh) -> std::unique_ptr<StepRunner> {
      return std::make_unique<RankPipeline>(std::make_unique<Stage>(l.model, stages[0], sh, l.params, tp, 0, group.get()),
                                            pp, tp, job->link, l.model, sh.slots, step_timeout);
    };
  }
  log(fmt::format("{} ({} layers, vocabulary {}, context {}) from {}; text: {}; {} batching; on {}{}", l.model.name(),
                  l.model.layers(), l.model.vocab(), l.model.context(), l.label,
                  l.codec ? l.codec->describe() : "none (token ids)", o.batching, device.str(),
                  device.type == DeviceType::cpu ? "; " + blas::summary() : ""));
  Engine engine(s);
  if (job) job->watch(&engine);
  std::string why;
  {
    HttpServer server(engine, ServerSettings{.host = host,
                                             .port = static_cast<std::uint16_t>(port),
                                             .api_key = key,
                                             .drain_timeout = std::chrono::seconds(o.drain_timeout),
                                             .handle_signals = true,
                                             .log = log});
    std::optional<Watcher> watcher;
    if (!o.watch.empty()) watcher.emplace(engine, o, l.step);
    // Drained (or stopped): a SIGTERM still on its way (Slurm's scancel signals every process of
    // the task and baton-launch forwards it too, moments apart) does nothing from here on, while
    // the process tells the other ranks to stop (ServerSettings::handle_signals).
    server.run();
    watcher.reset();
    why = engine.failure();
  }
  if (job) {
    job->watch(nullptr);
    if (why.empty()) {
      stop_stages(job->link, world);
      job->control.finish(std::chrono::minutes(1));
    } else {
      job->control.fail(why);  // nothing if another rank's failure ended the job
    }
  }
  if (!why.empty()) {
    log("stopped: " + why);
    return 1;
  }
  log("stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"baton-serve: a language model behind OpenAI's completions API, with continuous batching"};
  app.add_option("--checkpoint", o.checkpoint, "a baton-train checkpoint directory (its newest complete step)");
  app.add_option("--watch", o.watch, "follow this checkpoint directory: swap in each new complete checkpoint");
  app.add_option("--model", o.model, "with --init-from: gpt2 or llama")->check(CLI::IsMember({"gpt2", "llama"}));
  app.add_option("--init-from", o.init_from, "a safetensors file of published weights (transformers' names)");
  app.add_option("--tokenizer", o.tokenizer, "a SentencePiece .model: prompts and completions as text");
  app.add_option("--vocab-text", o.vocab_text, "a text file whose sorted bytes are the vocabulary (a byte model)");
  app.add_option("--heads", o.heads, "with --init-from: attention (query) heads");
  app.add_option("--seq", o.seq, "with --init-from llama: the context (default 2048)");
  app.add_option("--rope-base", o.rope_base, "with --init-from llama: RoPE's base (rope_theta)");
  app.add_option("--norm-eps", o.norm_eps, "with --init-from: the norms' epsilon (default 1e-5)");
  app.add_option("--served-model-name", o.served_name, "the API's model name (default: gpt, gpt2 or llama)");
  app.add_option("--listen", o.listen, "HOST:PORT (default 127.0.0.1:8000; port 0: any free one)");
  app.add_option("--api-key", o.api_key, "the bearer key every request but /healthz needs (or BATON_API_KEY)");
  app.add_option("--max-batch", o.max_batch, "requests in the running batch at most")->check(CLI::PositiveNumber);
  app.add_option("--max-batch-tokens", o.max_batch_tokens, "token rows of a decode step at most")
      ->check(CLI::PositiveNumber);
  app.add_option("--block-size", o.block_size, "positions per KV-cache block")->check(CLI::PositiveNumber);
  app.add_option("--kv-cache-memory", o.kv_cache_memory, "bytes of the KV cache (default 256MiB)");
  app.add_option("--device-memory", o.device_memory, "the device's budget: the cache gets what the weights leave");
  app.add_option("--max-queue", o.max_queue, "requests waiting at most; more are answered 429")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batching", o.batching, "continuous (default) or static (a batch runs to its end)")
      ->check(CLI::IsMember({"continuous", "static"}));
  app.add_option("--threads", o.threads, "BLAS threads of the decode step")->check(CLI::PositiveNumber);
  app.add_option("--drain-timeout", o.drain_timeout, "seconds SIGTERM (or a weight swap) lets requests finish")
      ->check(CLI::PositiveNumber);
  app.add_option("--watch-every", o.watch_every, "seconds between --watch's looks")->check(CLI::PositiveNumber);
  app.add_option("--pp", o.pp,
                 "pipeline stages (layers cut evenly); under baton-launch one per rank (the default), else in this "
                 "process")
      ->check(CLI::PositiveNumber);
  app.add_option("--tp", o.tp,
                 "tensor-parallel shards of each stage (heads and MLP width cut over tp ranks; under baton-launch "
                 "of pp x tp ranks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--device", o.device,
                 "where the model runs: cpu (default), cuda (this rank's GPU: local rank L takes GPU L), cuda:N, or "
                 "sim:N (a simulated device, for tests); the KV cache lives there too");
  app.add_flag("!--no-graphs", o.graphs,
               "on a --device: run each step's kernels one by one instead of as one captured graph (a CUDA "
               "graph) from the second step on");
  app.add_option("--step-timeout", o.step_timeout, "seconds a step may take across the ranks before the job fails")
      ->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    log(fmt::format("error: {}", e.what()));
    return 2;
  }
}
