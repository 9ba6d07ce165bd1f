// baton-bench-gpu: a GPT training step on one device, baton against PyTorch eager in the same run.
//
// The model is baton-train's GPT (apps/train/models.h, models::gpt_with_loss), compiled for
// training with Adam (lr 1e-3) on one device (TrainConfig::replica_places), fed uniformly random
// tokens. baton runs `warmup` + `steps` steps as one job; the timed window is from the loss
// report of step `warmup` to that of step `warmup + steps`, so it is steady-state throughput
// (set-up, allocation and the first steps excluded). The reference is the same model and
// optimizer in PyTorch eager mode (apps/bench/gpt_torch.py, a subprocess), timed the same way
// with torch.cuda.synchronize; both parameter counts are compared first and a mismatch fails the
// benchmark. One JSON line per case on stdout; notes on stderr.
//
// By default (--batch-mode best) each side runs at its own best batch, as its user would run
// it: PyTorch with scaled_dot_product_attention (where it has it) and, on CUDA, bf16 autocast,
// at the fastest of the powers of two up to --max-batch, tried until one runs out of memory;
// baton, also bf16 on CUDA, at the fastest of the powers of two up to the largest batch its plan
// fits, and that largest one (each batch in a child process: baton pools device memory for the
// life of a process). The fastest batch of each side is measured again; both batches, both
// searches and both tokens/s are reported, and the ratio is of tokens/s. --batch N (or
// --batch-mode same) runs both sides at one batch with the same ops (naive attention) instead.
//
//   baton-bench-gpu                         cuda:0 if there is one (an H100-sized GPT); else a
//                                           "skipped" line for it and the CPU variant
//   baton-bench-gpu --device cpu --quick    the harness on the CPU, PyTorch (CPU) as reference
//   baton-bench-gpu --batch-mode same --precision bf16   one batch (the largest baton's plan
//                                           fits), mixed precision on both sides
//
// Model FLOPs per token (PaLM, appendix B; Megatron-LM's count): 6 N + 12 L d T, where N counts
// the parameters that multiply (every one but the token and position tables, which are looked
// up) and 12 L d T the attention's scores and their product with the values, forward and
// backward, without discounting the causal mask. MFU = tokens/s x that / the device's peak for
// the precision (a table of NVIDIA's dense figures, or --peak-tflops).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#ifdef BATON_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/data.h"
#include "capture.h"
#include "json_line.h"
#include "models.h"
#include "skip.h"

namespace {

using namespace baton;
using Clock = std::chrono::steady_clock;

constexpr std::string_view prog = "baton-bench-gpu";
constexpr std::uint64_t seed = 1;
constexpr double lr = 1e-3;

// ---------------------------------------------------------------------------------------------
// Options

/// Model sizes; 0 means "the device's default".
struct Sizes {
  std::int64_t d_model = 0, heads = 0, layers = 0, seq = 0, vocab = 0, batch = 0;
};

/// Suited to an 80 GB H100 with float32 activations (batch 0: as many as the plan fits).
constexpr Sizes cuda_defaults{
    .d_model = 1024, .heads = 16, .layers = 8, .seq = 1024, .vocab = 32768, .batch = 0};
/// A few tens of milliseconds per step on one core of the build machine.
constexpr Sizes cpu_defaults{
    .d_model = 128, .heads = 4, .layers = 2, .seq = 64, .vocab = 512, .batch = 8};

struct Options {
  std::string device = "auto";  // auto, cpu, cuda:N
  Sizes sizes;
  std::int64_t warmup = -1, steps = -1;  // -1: the device's default
  int threads = 1;
  /// Slots of each activation register. One device runs one act at a time, so a second slot
  /// (forward running a micro-batch ahead of backward) buys nothing there and doubles the
  /// activations' memory; the attention scores dominate it.
  std::int32_t activation_slots = 1;
  /// "" until resolved for the device and mode (resolve()).
  std::string precision;
  double peak_tflops = 0;  // 0: from the table
  std::string torch_attention;  // naive, sdpa, auto; "" until resolved
  /// The higher anchor: PyTorch's reference again under torch.compile, at its batch (auto: on
  /// CUDA where this PyTorch has torch.compile; on; off).
  std::string torch_compile = "auto";
  /// best: each side at its own best batch (a search); same: both at one batch (--batch, or
  /// the largest baton's plan fits). "" until resolved: same where --batch is given, else best.
  std::string batch_mode;
  /// baton's attention: auto (cuDNN's fused attention where it loads, else baton's fused kernels,
  /// on CUDA; naive on the CPU), naive (matmul, mask, softmax, matmul), fused (attention() with
  /// baton's kernels) or cudnn (attention() with cuDNN's).
  std::string attention = "auto";
  /// The MLP's GELU on both sides: erf (exact, nn.GELU()) or tanh (GPT-2's and Megatron's form).
  std::string gelu = "erf";
  bool reference = true;
  bool require_reference = false;
  bool quick = false;
  /// Compile and size the plan, print it, train nothing.
  bool plan_only = false;
  /// Auto batch: the fraction of the device's free memory the plan may take.
  double mem_fraction = 0.85;
  std::int64_t max_batch = 0;  // 0: 64 on CUDA, 8 on the CPU
  double timeout_s = 600;
};

[[noreturn]] void usage(int code) {
  std::FILE* f = code == 0 ? stdout : stderr;
  fmt::print(
      f,
      "usage: {} [--device auto|cpu|cuda:N] [sizes] [--warmup W] [--steps S] [--precision "
      "f32|tf32|bf16]\n"
      "       [--peak-tflops X] [--attention naive|fused] [--torch-attention naive|sdpa]\n"
      "       [--no-reference] [--quick] [--help]\n"
      "  A GPT training step with baton and with PyTorch eager (the reference, same run); one JSON "
      "line.\n"
      "  --device D          auto (default): cuda:0 if CUDA works, else a 'skipped' line and the "
      "CPU variant\n"
      "  --d-model N --heads N --layers N --seq N --vocab N --batch N\n"
      "                      defaults on CUDA: 1024, 16, 8, 1024, 32768; on the CPU: 128, 4, 2, "
      "64, 512.\n"
      "                      No --batch: --batch-mode best. baton's plan may take --mem-fraction "
      "(default\n"
      "                      0.85) of the free memory; --max-batch bounds every batch (default 64 "
      "on CUDA,\n"
      "                      8 on the CPU)\n"
      "  --warmup W --steps S  untimed then timed steps (CUDA 3 and 30, CPU 3 and 20; --quick: 1 "
      "and 3)\n"
      "  --threads N         baton worker threads (and PyTorch CPU threads), default 1\n"
      "  --activation-slots K  slots per activation register (default 1: one device)\n"
      "  --batch-mode M      best (default without --batch): each side at its own best batch, the "
      "fastest\n"
      "                      of the powers of two up to --max-batch that fit (baton: and the largest "
      "its\n"
      "                      plan fits; PyTorch: until it runs out of memory), both batches reported, "
      "the\n"
      "                      ratio of tokens/s; same (default with --batch): both sides at one batch\n"
      "  --precision P       f32 (full float32 products on both sides), bf16 (autocast on both sides; "
      "f32\n"
      "                      weights and Adam) or tf32 (PyTorch alone). Default: bf16 on CUDA with "
      "--batch-mode\n"
      "                      best (as a user runs PyTorch), f32 otherwise\n"
      "  --peak-tflops X     the device's peak for the precision, for MFU (default: from a table "
      "of\n"
      "                      NVIDIA's dense figures by device name; none for the CPU)\n"
      "  --attention A       baton's attention: auto (default: cudnn where cuDNN 9 loads, else "
      "fused, on\n"
      "                      CUDA; naive on the CPU), naive (matmul, mask, softmax, matmul), "
      "fused (one op\n"
      "                      per block, baton's FlashAttention-style kernels) or cudnn (cuDNN's "
      "fused attention)\n"
      "  --gelu G            the MLP's GELU on both sides: erf (default, exact) or tanh (GPT-2's "
      "and Megatron's form)\n"
      "  --torch-attention A naive (baton's ops), sdpa (PyTorch's fused causal attention) or auto "
      "(sdpa where\n"
      "                      this PyTorch has it, else naive). Default: auto with --batch-mode best, "
      "naive\n"
      "                      with same\n"
      "  --torch-compile M   auto (default: on CUDA where PyTorch has torch.compile), on or off: "
      "PyTorch's\n"
      "                      reference again under torch.compile at its batch (the higher anchor; "
      "compile_* fields)\n"
      "  --no-reference      skip PyTorch;  --require-reference  exit 77 if PyTorch is missing\n"
      "  --timeout S         give up on a side after S seconds (default 600)\n"
      "  --allow-load        print the ratio even on a machine loaded above its cores (marked "
      "\"loaded\")\n"
      "  --plan-only         compile, print the plan's size (register_bytes, estimated_bytes), "
      "train nothing\n"
      "  environment: BATON_STREAM_ORDER=0 (every act waits for its stream: the host round trip "
      "that\n"
      "  stream-ordered handshakes remove), BATON_PYTHON (default: the first of python3 on PATH, /usr/bin/python3 that "
      "imports\n"
      "  torch), BATON_GPT_TORCH (the reference script; default gpt_torch.py beside the program or "
      "in\n"
      "  the source tree)\n",
      prog);
  std::exit(code);
}

/// Refuses (usage, status 2) a value of `flag` that is not one of `allowed`, naming them.
void require_one_of(std::string_view flag, const std::string& v, std::initializer_list<std::string_view> allowed) {
  if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return;
  std::string names;
  std::size_t k = 0;
  for (std::string_view a : allowed) {
    names += fmt::format("{}{}", k == 0 ? "" : k + 1 == allowed.size() ? " or " : ", ", a);
    ++k;
  }
  fmt::print(stderr, "{}: {} must be {}, not '{}'\n", prog, flag, names, v);
  usage(2);
}

/// The second half of parse(): the values that only make sense together, and the choices.
void check_choices(Options& o) {
  if (!o.precision.empty()) require_one_of("--precision", o.precision, {"f32", "tf32", "bf16"});
  if (!o.torch_attention.empty()) require_one_of("--torch-attention", o.torch_attention, {"naive", "sdpa", "auto"});
  if (o.batch_mode.empty()) o.batch_mode = o.sizes.batch > 0 ? "same" : "best";
  require_one_of("--batch-mode", o.batch_mode, {"best", "same"});
  if (o.batch_mode == "best" && o.sizes.batch > 0) {
    fmt::print(stderr,
               "{}: --batch {} fixes the batch, --batch-mode best searches for it: give one of them "
               "(--batch-mode same --batch N compares both sides at N)\n",
               prog, o.sizes.batch);
    usage(2);
  }
  require_one_of("--torch-compile", o.torch_compile, {"auto", "on", "off"});
  require_one_of("--gelu", o.gelu, {"erf", "tanh"});
  require_one_of("--attention", o.attention, {"auto", "naive", "fused", "cudnn"});
  if (o.device != "auto") {
    try {
      (void)Device::parse(o.device);
    } catch (const std::exception& e) {
      fmt::print(stderr, "{}: --device: {}\n", prog, e.what());
      usage(2);
    }
  }
}

Options parse(int argc, char** argv) {
  Options o;
  auto value = [&](int& i, std::string_view flag) -> std::string {
    if (i + 1 >= argc) {
      fmt::print(stderr, "{}: {} needs a value\n", prog, flag);
      usage(2);
    }
    return argv[++i];
  };
  auto integer = [&](int& i, std::string_view flag, std::int64_t min) {
    std::string v = value(i, flag);
    char* end = nullptr;
    long long n = std::strtoll(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0' || n < min) {
      fmt::print(stderr, "{}: {} wants an integer >= {}, not '{}'\n", prog, flag, min, v);
      usage(2);
    }
    return static_cast<std::int64_t>(n);
  };
  auto real = [&](int& i, std::string_view flag) {
    std::string v = value(i, flag);
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0' || !(x > 0)) {
      fmt::print(stderr, "{}: {} wants a positive number, not '{}'\n", prog, flag, v);
      usage(2);
    }
    return x;
  };
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "-h" || a == "--help")
      usage(0);
    else if (a == "--device")
      o.device = value(i, a);
    else if (a == "--d-model")
      o.sizes.d_model = integer(i, a, 1);
    else if (a == "--heads")
      o.sizes.heads = integer(i, a, 1);
    else if (a == "--layers")
      o.sizes.layers = integer(i, a, 1);
    else if (a == "--seq")
      o.sizes.seq = integer(i, a, 1);
    else if (a == "--vocab")
      o.sizes.vocab = integer(i, a, 2);
    else if (a == "--batch")
      o.sizes.batch = integer(i, a, 0);
    else if (a == "--warmup")
      o.warmup = integer(i, a, 1);
    else if (a == "--steps")
      o.steps = integer(i, a, 1);
    else if (a == "--threads")
      o.threads = static_cast<int>(integer(i, a, 1));
    else if (a == "--precision")
      o.precision = value(i, a);
    else if (a == "--activation-slots")
      o.activation_slots = static_cast<std::int32_t>(integer(i, a, 1));
    else if (a == "--peak-tflops")
      o.peak_tflops = real(i, a);
    else if (a == "--torch-attention")
      o.torch_attention = value(i, a);
    else if (a == "--torch-compile")
      o.torch_compile = value(i, a);
    else if (a == "--batch-mode")
      o.batch_mode = value(i, a);
    else if (a == "--attention")
      o.attention = value(i, a);
    else if (a == "--gelu")
      o.gelu = value(i, a);
    else if (a == "--mem-fraction")
      o.mem_fraction = real(i, a);
    else if (a == "--max-batch")
      o.max_batch = integer(i, a, 1);
    else if (a == "--timeout")
      o.timeout_s = real(i, a);
    else if (a == "--no-reference")
      o.reference = false;
    else if (a == "--require-reference")
      o.require_reference = true;
    else if (a == "--quick")
      o.quick = true;
    else if (a == "--plan-only")
      o.plan_only = true;
    else {
      fmt::print(stderr, "{}: unknown argument '{}'\n", prog, a);
      usage(2);
    }
  }
  check_choices(o);
  return o;
}

// ---------------------------------------------------------------------------------------------
// The device: its name, memory and peak

struct DeviceInfo {
  Device device;
  std::string name;                               // "NVIDIA H100 80GB HBM3", or "cpu"
  std::uint64_t free_bytes = 0, total_bytes = 0;  // 0 for the CPU
};

DeviceInfo describe(Device d) {
  DeviceInfo info{d, "cpu", 0, 0};
  if (d.type != DeviceType::cuda) return info;
#ifdef BATON_HAS_CUDA
  // The CUDA runtime directly (this program links it): the kernels library names no device.
  auto check = [&](cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
      throw std::runtime_error(fmt::format("{} on {}: {} ({})", what, d.str(), cudaGetErrorName(e),
                                           static_cast<int>(e)));
    }
  };
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, d.index), "cudaGetDeviceProperties");
  check(cudaSetDevice(d.index), "cudaSetDevice");
  std::size_t free_b = 0, total_b = 0;
  check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  info.name = prop.name;
  info.free_bytes = free_b;
  info.total_bytes = total_b;
#endif
  return info;
}

/// NVIDIA's dense peak in TFLOP/s for a device name and precision ("f32", "tf32", "bf16"), from
/// the H100 and A100 data sheets; the H200 has the H100 SXM's tensor cores. nullopt: unknown.
std::optional<double> table_peak_tflops(const std::string& name, const std::string& precision) {
  struct Row {
    std::string_view match;
    double f32, tf32, bf16;
  };
  // Most specific first: "H100 PCIe" before "H100".
  static constexpr Row rows[] = {
      {"H100 PCIe", 51, 378, 756}, {"H100 NVL", 60, 418, 835},
      {"H100", 67, 495, 989},  // SXM5 (HBM3)
      {"H200", 67, 495, 989},      {"A100", 19.5, 156, 312},
  };
  for (const auto& r : rows) {
    if (name.find(r.match) == std::string::npos) continue;
    if (precision == "f32") return r.f32;
    if (precision == "tf32") return r.tf32;
    if (precision == "bf16") return r.bf16;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// The PyTorch reference

class Reference {
 public:
  /// Finds a python3 that imports torch and the script; if either is missing, missing() says why.
  Reference() {
    std::vector<std::string> pythons;
    if (const char* env = std::getenv("BATON_PYTHON"); env != nullptr && *env != '\0') {
      pythons.emplace_back(env);
    } else {
      pythons = {"python3",
                 "/usr/bin/python3"};  // a GPU machine's torch is usually a pip one on PATH
    }
    std::vector<std::string> tried;
    for (const auto& py : pythons) {
      auto [status, out] = bench::run_capture(
          fmt::format("timeout 60 {} -c 'import torch, torch.nn.functional as F; "
                      "print(torch.__version__, hasattr(F, \"scaled_dot_product_attention\"), "
                      "hasattr(torch, \"compile\"))' 2>&1",
                      bench::shell_quote(py)));
      out = bench::trim(out);
      const auto nl = out.rfind('\n');
      std::string last = nl == std::string::npos ? out : out.substr(nl + 1);
      if (status == 0) {
        python_ = py;
        // "2.11.0+cu130 True True": the version, then whether sdpa and torch.compile exist.
        std::vector<std::string> words;
        for (std::size_t at = 0; at <= last.size();) {
          const std::size_t sp = std::min(last.find(' ', at), last.size());
          words.push_back(last.substr(at, sp - at));
          at = sp + 1;
        }
        version_ = words[0];
        has_sdpa_ = words.size() > 1 && words[1] == "True";
        has_compile_ = words.size() > 2 && words[2] == "True";
        break;
      }
      tried.push_back(
          fmt::format("{}: {}", py, last.empty() ? fmt::format("exit status {}", status) : last));
    }
    if (python_.empty()) {
      missing_ = fmt::format("no python3 that imports torch ({})", fmt::join(tried, "; "));
      return;
    }
    script_ = bench::find_reference_script("BATON_GPT_TORCH", "gpt_torch.py", missing_);
  }

  const std::string& missing() const {
    return missing_;
  }
  const std::string& version() const {
    return version_;
  }
  const std::string& python() const {
    return python_;
  }
  /// Whether this PyTorch has F.scaled_dot_product_attention (2.0 and later).
  bool has_sdpa() const {
    return has_sdpa_;
  }
  /// Whether this PyTorch has torch.compile (2.0 and later).
  bool has_compile() const {
    return has_compile_;
  }

  /// One run of the script: its exit status, its result line ("" if none) and its output.
  struct Outcome {
    int exit_code = -1;
    std::string line, out;
    /// The script ran out of device memory (it exits 3 and says "oom": true).
    bool oom() const {
      return exit_code == 3 && line.find("\"oom\": true") != std::string::npos;
    }
  };
  Outcome try_run(const std::string& args, double timeout_s) const {
    const std::string cmd =
        fmt::format("timeout --kill-after=10 {:.0f} {} {} {}", timeout_s,
                    bench::shell_quote(python_), bench::shell_quote(script_), args);
    auto [status, out] = bench::run_capture(cmd);
    Outcome r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.line = bench::last_json_line(out);
    r.out = std::move(out);
    return r;
  }

  /// The script's result line for these arguments; throws with its output if it has none.
  std::string run(const std::string& args, double timeout_s) const {
    const std::string cmd =
        fmt::format("timeout --kill-after=10 {:.0f} {} {} {}", timeout_s,
                    bench::shell_quote(python_), bench::shell_quote(script_), args);
    auto [status, out] = bench::run_capture(cmd);
    std::string line = bench::last_json_line(out);
    if (status != 0 || line.empty()) {
      throw std::runtime_error(fmt::format(
          "the PyTorch reference '{}' failed (status {}{}): {}", cmd, status,
          WIFEXITED(status) && WEXITSTATUS(status) == 124 ? ", timed out" : "", bench::trim(out)));
    }
    return line;
  }

 private:
  std::string python_, script_, version_, missing_;
  bool has_sdpa_ = false;
  bool has_compile_ = false;
};

// ---------------------------------------------------------------------------------------------
// baton

/// A corpus of uniformly random token ids: the reference draws its tokens the same way.
std::shared_ptr<const data::TextCorpus> random_corpus(std::int64_t vocab, std::int64_t seq,
                                                      std::int64_t batch) {
  data::TextCorpus text;
  text.path = "<uniform random tokens>";
  // Only the size of the vocabulary matters here: ids are not decoded.
  text.vocab.assign(static_cast<std::size_t>(vocab), static_cast<unsigned char>('x'));
  std::mt19937_64 gen(seed);
  const auto n = static_cast<std::size_t>(
      std::max<std::int64_t>(std::int64_t{1} << 20, 4 * (seq + 1) * batch));
  text.ids.resize(n);
  for (auto& id : text.ids)
    id = static_cast<std::int32_t>(gen() % static_cast<std::uint64_t>(vocab));
  return std::make_shared<const data::TextCorpus>(std::move(text));
}

struct Compiled {
  std::unique_ptr<Graph> graph;
  TrainingJob job;
  std::int64_t params = 0;            // every trained parameter
  std::int64_t params_multiply = 0;   // without the token and position tables
  std::uint64_t register_bytes = 0;   // what the runtime allocates for registers on the device (its arenas)
  std::uint64_t estimated_bytes = 0;  // the plan's peak there: registers + what kernels keep
};

Compiled compile_gpt(const models::GptShape& shape, std::int64_t batch, Device device,
                     std::int64_t total_steps, int threads,
                     const std::shared_ptr<const data::TextCorpus>& corpus,
                     std::shared_ptr<ParameterStore> params, DType precision, std::int32_t activation_slots) {
  Compiled c;
  c.graph = std::make_unique<Graph>(seed);
  models::Outputs out;
  {
    // bf16: torch.autocast's policy (graph.h), as the PyTorch side runs it.
    auto mixed = c.graph->autocast(precision);
    out = models::gpt_with_loss(*c.graph, batch, shape);
  }
  TrainConfig cfg;
  cfg.steps = total_steps;
  cfg.microbatches = 1;
  cfg.optimizer = optim::adam(lr);
  cfg.threads = threads;
  cfg.activation_slots = activation_slots;
  cfg.data = {
      {"text", data::text_source(corpus, batch, 1, shape.seq, seed), {"tokens", "targets"}}};
  cfg.replica_places = {Placement{.device = device}};
  // BATON_MULTI_TENSOR=0: one optimizer actor and launch per weight (the updates pass off), to
  // compare with the device's weights stepped together.
  if (const char* e = std::getenv("BATON_MULTI_TENSOR"); e != nullptr && std::string_view(e) == "0") {
    cfg.multi_tensor_updates = false;
  }
  // BATON_CUDA_GRAPHS=0: an actor and a launch per op (the segments pass off), to measure what
  // the runs of ops as CUDA graphs buy.
  if (const char* e = std::getenv("BATON_CUDA_GRAPHS"); e != nullptr && std::string_view(e) == "0") {
    cfg.cuda_graphs = false;
  }
  if (!params) params = ParameterStore::initialize(*c.graph);
  c.job = compile_training(*c.graph, out.loss, cfg, std::move(params));
  for (const auto& [name, t] : c.job.params->values()) {
    c.params += t.numel();
    if (name != "wte" && name != "wpe") c.params_multiply += t.numel();
  }
  // The plan's own account (plan_memory.h): its arenas (slots whose lives never meet share
  // bytes; views and repeats have none) and what the kernels keep (master weights, Adam's
  // moments), on the benchmark's device.
  for (const DeviceMemory& m : memory_report(c.job.plan)) {
    if (m.device != device) continue;
    c.register_bytes += static_cast<std::uint64_t>(m.registers);
    c.estimated_bytes += static_cast<std::uint64_t>(m.total());
  }
  return c;
}

struct BatonResult {
  double timed_s = 0;  // loss of step warmup -> loss of step warmup + steps
  double job_s = 0;    // the whole run, set-up of the workers included
  double loss = NAN;
  std::int64_t actors = 0;
  /// The segments' graphs (passes::segment_graphs()) during the run: captured, acts launched
  /// as one, segments that gave capturing up.
  std::int64_t graphs_captured = 0, graph_launches = 0, graph_refusals = 0;
  std::map<std::string, double> kernel_s_by_op;
  std::map<std::string, double> device_s_by_op;  // BATON_DEVICE_TIME=1
  /// On a CUDA device, what baton's allocators held at most during the run, and had reserved
  /// from cudaMalloc at its end (cuda::device_memory: the measured side of the plan's estimate).
  std::int64_t device_peak_bytes = 0, device_reserved_bytes = 0;
};

/// The shortest timed window worth a figure (the clock reads and a thread wake-up are a few
/// microseconds of it).
constexpr double min_timed_s = 0.01;

/// The timed steps passed too quickly to be timed (a search grows the steps and tries again).
struct TooShort : std::runtime_error {
  using std::runtime_error::runtime_error;
};

BatonResult run_baton(Compiled& c, Device device, std::int64_t warmup, std::int64_t steps, double timeout_s) {
  RuntimeSettings settings;
  // BATON_STREAM_ORDER=0: every act waits for its stream (RuntimeSettings::stream_order), to
  // measure what stream-ordered handshakes buy.
  if (const char* e = std::getenv("BATON_STREAM_ORDER"); e != nullptr && std::string_view(e) == "0") {
    settings.stream_order = false;
  }
  // BATON_DEVICE_TIME=1: each op's time on the device too (RuntimeSettings::device_time).
  if (const char* e = std::getenv("BATON_DEVICE_TIME"); e != nullptr && std::string_view(e) == "1") {
    settings.device_time = true;
  }
  const bool cuda_device = device.type == DeviceType::cuda;
  if (cuda_device) cuda::reset_peak_device_memory(device);
  Runtime rt(c.job.plan, c.job.kernels, settings);
  const passes::SegmentGraphs graphs_before = passes::segment_graphs();
  std::exception_ptr failure;
  RunReport report;
  std::atomic<bool> finished{false};
  const auto started = Clock::now();
  std::thread runner([&] {
    try {
      report = rt.run();
    } catch (...) {
      failure = std::current_exception();
    }
    finished.store(true, std::memory_order_release);
  });
  // The steps are timed by when the loss log recorded them (LossLog::when_done, on the loss
  // actor's thread); this loop only watches the deadline, sleeping between looks.
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  bool timed_out = false;
  while (!finished.load(std::memory_order_acquire)) {
    const auto now = Clock::now();
    const std::int64_t done = c.job.losses->steps_done();
    if (now > deadline && !timed_out) {
      timed_out = true;
      rt.abort(fmt::format("{}: past the --timeout of {:.0f} s at step {} of {}", prog, timeout_s,
                           done, warmup + steps));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  runner.join();
  if (failure) std::rethrow_exception(failure);
  const cuda::DeviceMemoryStats memory = cuda_device ? cuda::device_memory(device) : cuda::DeviceMemoryStats{};
  // Step `warmup` done (at once when there is no warm-up: the job's start), then the rest.
  const std::optional<Clock::time_point> t_warm = warmup > 0 ? c.job.losses->when_done(warmup) : started;
  const std::optional<Clock::time_point> t_end = c.job.losses->when_done(warmup + steps);
  if (!t_warm || !t_end) {
    throw std::runtime_error(fmt::format("the job ended with {} of {} steps reported",
                                         c.job.losses->steps_done(), warmup + steps));
  }
  BatonResult r;
  r.timed_s = std::chrono::duration<double>(*t_end - *t_warm).count();
  if (r.timed_s < min_timed_s) {
    throw TooShort(
        fmt::format("the {} timed steps took {:.2f} ms, too short to time reliably: raise --steps",
                    steps, r.timed_s * 1e3));
  }
  r.job_s = report.wall_s;
  r.device_peak_bytes = memory.peak;
  r.device_reserved_bytes = memory.reserved;
  auto losses = c.job.losses->per_step();
  if (!losses.empty()) r.loss = losses.back();
  r.actors = static_cast<std::int64_t>(c.job.plan.actors.size());
  const passes::SegmentGraphs graphs = passes::segment_graphs();
  r.graphs_captured = graphs.captured - graphs_before.captured;
  r.graph_launches = graphs.launched - graphs_before.launched;
  r.graph_refusals = graphs.refused - graphs_before.refused;
  std::map<std::string, std::string> op_of;
  for (const auto& a : c.job.plan.actors) {
    // The optimizer's actors under one name each way: a weight's own ("variable.<weight>") or a
    // device's group (the updates pass, "variables.r<rank>.<device>").
    std::string op = a.op.empty() ? "(" + a.name + ")" : a.op;
    if (op.starts_with("variables.")) op = "variables (multi-tensor)";
    else if (op.starts_with("variable.")) op = "variable (each weight)";
    else if (op.starts_with("segment.")) op = "segments (CUDA graphs; BATON_CUDA_GRAPHS=0 for each op)";
    op_of[a.name] = std::move(op);
  }
  for (const auto& a : report.metrics.actors) {
    r.kernel_s_by_op[op_of[a.name]] += a.kernel_s;
    if (a.device_s > 0) r.device_s_by_op[op_of[a.name]] += a.device_s;
  }
  return r;
}

/// baton's compute dtype for --precision (tf32 is PyTorch's alone).
DType precision_of(const Options& o) { return o.precision == "bf16" ? DType::bf16 : DType::f32; }

/// The largest batch whose plan fits `fraction` of the device's free memory: the estimate is
/// linear in the batch (the weights and their Adam moments, plus registers whose size is a
/// multiple of it), so two small compilations give it.
std::int64_t auto_batch(const models::GptShape& shape, const DeviceInfo& dev, const Options& o,
                        const std::shared_ptr<const data::TextCorpus>& corpus,
                        const std::shared_ptr<ParameterStore>& params) {
  const auto e1 = static_cast<double>(
      compile_gpt(shape, 1, dev.device, 2, o.threads, corpus, params, precision_of(o), o.activation_slots).estimated_bytes);
  const auto e2 = static_cast<double>(
      compile_gpt(shape, 2, dev.device, 2, o.threads, corpus, params, precision_of(o), o.activation_slots).estimated_bytes);
  const double per_sample = e2 - e1, fixed = e1 - per_sample;
  const double budget = o.mem_fraction * static_cast<double>(dev.free_bytes);
  const auto fit = static_cast<std::int64_t>(std::floor((budget - fixed) / per_sample));
  fmt::print(
      stderr,
      "{}: plan memory ~ {:.2f} GB + {:.2f} GB per sample; {:.1f} of {:.1f} GB free -> batch {}\n",
      prog, fixed / 1e9, per_sample / 1e9, static_cast<double>(dev.free_bytes) / 1e9,
      static_cast<double>(dev.total_bytes) / 1e9, std::clamp<std::int64_t>(fit, 1, o.max_batch));
  if (fit < 1) {
    throw std::runtime_error(
        fmt::format("even batch 1 needs ~{:.1f} GB on {} ({}), {:.1f} GB free: choose smaller "
                    "sizes (--seq, --layers, --d-model)",
                    (fixed + per_sample) / 1e9, dev.device.str(), dev.name,
                    static_cast<double>(dev.free_bytes) / 1e9));
  }
  return std::min(fit, o.max_batch);
}

// ---------------------------------------------------------------------------------------------

std::int64_t pick(std::int64_t given, std::int64_t fallback) {
  return given > 0 ? given : fallback;
}

/// The options with every default that depends on the device settled: the precision (bf16 on
/// CUDA when each side runs at its best batch, as a PyTorch user would; f32 otherwise), the
/// attention of the reference (auto: sdpa where PyTorch has it, when at its best; naive, baton's
/// own ops, when both run at one batch) and the largest batch.
Options resolve(Options o, bool cuda, const Reference* ref) {
  const bool best = o.batch_mode == "best";
  if (o.precision.empty()) o.precision = cuda && best ? "bf16" : "f32";
  if (o.torch_attention.empty()) o.torch_attention = best ? "auto" : "naive";
  if (o.torch_attention == "auto") {
    o.torch_attention = ref != nullptr && ref->missing().empty() && ref->has_sdpa() ? "sdpa" : "naive";
  }
  if (o.max_batch <= 0) o.max_batch = cuda ? 64 : 8;
  return o;
}

/// The batches a search tries, smallest first: the powers of two up to `limit`, and `limit`
/// itself where it is not one (the largest batch that fits, e.g. 5).
std::vector<std::int64_t> search_batches(std::int64_t limit) {
  std::vector<std::int64_t> out;
  for (std::int64_t b = 1; b <= limit; b *= 2) out.push_back(b);
  if (limit >= 1 && out.back() != limit) out.push_back(limit);
  return out;
}

/// One batch a search tried: its tokens/s, or why it gave none ("out of memory").
struct Tried {
  std::int64_t batch = 0;
  std::optional<double> tokens_per_s;
  std::string failed;
};

/// The batch with the most tokens/s; 0 if none ran.
std::int64_t fastest(const std::vector<Tried>& tried) {
  std::int64_t best = 0;
  double rate = -1;
  for (const Tried& t : tried) {
    if (t.tokens_per_s && *t.tokens_per_s > rate) {
      rate = *t.tokens_per_s;
      best = t.batch;
    }
  }
  return best;
}

/// "1:1.2e+04 2:2.3e+04 4:out of memory": a search, as the JSON line reports it.
std::string describe_search(const std::vector<Tried>& tried) {
  std::vector<std::string> parts;
  for (const Tried& t : tried) {
    parts.push_back(t.tokens_per_s ? fmt::format("{}:{:.4g}", t.batch, *t.tokens_per_s)
                                   : fmt::format("{}:{}", t.batch, t.failed));
  }
  return fmt::format("{}", fmt::join(parts, " "));
}

/// What every run on one device shares.
struct Setup {
  Device device;
  bool cuda = false;
  Options o;  // resolved
  models::GptShape shape;
  DeviceInfo dev;
  std::int64_t warmup = 0, steps = 0;
  std::shared_ptr<const data::TextCorpus> corpus;
  std::shared_ptr<ParameterStore> params;
  std::int64_t n_params = 0, n_multiply = 0;
  double flops_per_token = 0;
  std::string sizes_args;
};

/// A measured run of baton at one batch.
struct BatonAt {
  std::int64_t batch = 0, steps = 0;
  BatonResult r;
  std::uint64_t register_bytes = 0, estimated_bytes = 0;
  double tokens_per_s = 0;
};

/// Whether an exception from a baton run says the device ran out of memory.
bool out_of_memory(const std::exception& e) {
  const std::string what = e.what();
  return what.find("out of memory") != std::string::npos || what.find("cudaErrorMemoryAllocation") != std::string::npos;
}

/// baton at `batch` for `steps` timed steps; a timed window too short to time doubles the steps
/// and runs again (a search's small batches, a fast machine).
BatonAt baton_at(const Setup& s, std::int64_t batch, std::int64_t steps) {
  for (int attempt = 0;; ++attempt) {
    Compiled compiled = compile_gpt(s.shape, batch, s.device, s.warmup + steps, s.o.threads, s.corpus, s.params,
                                    precision_of(s.o), s.o.activation_slots);
    if (s.cuda && compiled.estimated_bytes > s.dev.free_bytes) {
      throw std::runtime_error(fmt::format("the plan needs ~{:.1f} GB on {} ({}), {:.1f} GB free: out of memory",
                                           static_cast<double>(compiled.estimated_bytes) / 1e9, s.device.str(),
                                           s.dev.name, static_cast<double>(s.dev.free_bytes) / 1e9));
    }
    try {
      BatonAt b;
      b.batch = batch;
      b.steps = steps;
      b.r = run_baton(compiled, s.device, s.warmup, steps, s.o.timeout_s);
      b.register_bytes = compiled.register_bytes;
      b.estimated_bytes = compiled.estimated_bytes;
      b.tokens_per_s = static_cast<double>(batch * s.shape.seq * steps) / b.r.timed_s;
      return b;
    } catch (const TooShort&) {
      if (attempt >= 10) throw;
      steps *= 2;
    }
  }
}

/// A run of the PyTorch reference at one batch: its result line, or that it ran out of memory.
struct TorchAt {
  std::int64_t batch = 0;
  bool oom = false;
  std::string line;
  double tokens_per_s = 0;
};

TorchAt torch_at(const Setup& s, const Reference& ref, std::int64_t batch, bool oom_is_an_answer,
                 bool compiled = false) {
  const auto outcome = ref.try_run(
      fmt::format("--device {} {} --batch {} --warmup {} --steps {} --threads {} --precision {} --attention {} "
                  "--gelu {} --lr {} --seed {}{}",
                  s.cuda ? fmt::format("cuda:{}", s.device.index) : std::string("cpu"), s.sizes_args, batch,
                  s.warmup, s.steps, s.o.threads, s.o.precision, s.o.torch_attention, s.o.gelu, lr, seed,
                  compiled ? " --compile" : ""),
      s.o.timeout_s);
  TorchAt t;
  t.batch = batch;
  if (outcome.oom() && oom_is_an_answer) {
    t.oom = true;
    return t;
  }
  const auto rate = bench::json_number(outcome.line, "tokens_per_s");
  if (outcome.exit_code != 0 || !rate) {
    throw std::runtime_error(fmt::format("the PyTorch reference failed at batch {} (exit {}{}): {}", batch,
                                         outcome.exit_code, outcome.exit_code == 124 ? ", timed out" : "",
                                         bench::trim(outcome.out)));
  }
  t.line = outcome.line;
  t.tokens_per_s = *rate;
  return t;
}

/// baton at `batch` in a child process of this program (--batch-mode same --no-reference):
/// baton's device memory is pooled by size for the life of the process (kernels/src/cuda), so
/// a search run in this process would keep every batch's blocks and starve the next batch and
/// the PyTorch reference. Throws with the child's error (which names "out of memory" where the
/// device ran out).
BatonAt baton_in_child(const Setup& s, std::int64_t batch, std::int64_t steps) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("cannot read /proc/self/exe to run a batch in a child: " + ec.message());
  const std::string cmd = fmt::format(
      "BATON_BENCH_CHILD=1 timeout --kill-after=10 {:.0f} {} --device {} --batch-mode same --batch {} --no-reference {} --warmup {} "
      "--steps {} --threads {} --precision {} --attention {} --gelu {} --activation-slots {} --timeout {:.0f} --allow-load 2>&1",
      s.o.timeout_s + 60, bench::shell_quote(self.string()), s.device.str(), batch, s.sizes_args, s.warmup, steps,
      s.o.threads, s.o.precision, s.o.attention, s.o.gelu, s.o.activation_slots, s.o.timeout_s);
  // Its notes on stderr come back with its line: shown only where it fails.
  auto [status, out] = bench::run_capture(cmd);
  const std::string line = bench::last_json_line(out);
  const auto rate = bench::json_number(line, "value");
  if (!rate) {
    throw std::runtime_error(fmt::format("baton at batch {} (a child, status {}): {}", batch, status,
                                         bench::json_string(line, "error").value_or(bench::trim(out))));
  }
  BatonAt b;
  b.batch = batch;
  b.steps = static_cast<std::int64_t>(bench::json_number(line, "steps").value_or(static_cast<double>(steps)));
  b.tokens_per_s = *rate;
  b.r.timed_s = bench::json_number(line, "step_ms").value_or(NAN) * static_cast<double>(b.steps) / 1e3;
  b.r.loss = bench::json_number(line, "loss").value_or(NAN);
  b.r.job_s = bench::json_number(line, "job_s").value_or(NAN);
  b.r.actors = static_cast<std::int64_t>(bench::json_number(line, "actors").value_or(0));
  b.r.graphs_captured = static_cast<std::int64_t>(bench::json_number(line, "graphs_captured").value_or(0));
  b.r.graph_launches = static_cast<std::int64_t>(bench::json_number(line, "graph_launches").value_or(0));
  b.r.graph_refusals = static_cast<std::int64_t>(bench::json_number(line, "graph_refusals").value_or(0));
  b.register_bytes = static_cast<std::uint64_t>(bench::json_number(line, "register_bytes").value_or(0));
  b.estimated_bytes = static_cast<std::uint64_t>(bench::json_number(line, "estimated_bytes").value_or(0));
  b.r.device_peak_bytes = static_cast<std::int64_t>(bench::json_number(line, "device_peak_bytes").value_or(0));
  b.r.device_reserved_bytes = static_cast<std::int64_t>(bench::json_number(line, "device_reserved_bytes").value_or(0));
  return b;
}

/// baton at its best batch: every batch of search_batches(the largest its plan fits, at most
/// --max-batch), each in a child process, the fastest measured again.
std::pair<BatonAt, std::vector<Tried>> baton_best(const Setup& s) {
  const std::int64_t limit = s.cuda ? auto_batch(s.shape, s.dev, s.o, s.corpus, s.params) : s.o.max_batch;
  std::vector<Tried> tried;
  std::map<std::int64_t, std::int64_t> steps_of;  // the steps each batch needed
  for (std::int64_t b : search_batches(limit)) {
    try {
      const BatonAt at = baton_in_child(s, b, s.steps);
      tried.push_back({b, at.tokens_per_s, {}});
      steps_of[b] = at.steps;
      fmt::print(stderr, "{}: baton at batch {}: {:.0f} tokens/s\n", prog, b, at.tokens_per_s);
    } catch (const std::exception& e) {
      if (!out_of_memory(e)) throw;
      tried.push_back({b, std::nullopt, "out of memory"});
      fmt::print(stderr, "{}: baton at batch {}: out of memory ({})\n", prog, b, e.what());
      break;  // a larger batch needs more
    }
  }
  const std::int64_t best = fastest(tried);
  if (best == 0) throw std::runtime_error("baton ran at no batch: " + describe_search(tried));
  return {baton_in_child(s, best, steps_of.at(best)), tried};
}

/// PyTorch at its best batch: the powers of two up to --max-batch until one runs out of memory,
/// the fastest measured again.
std::pair<TorchAt, std::vector<Tried>> torch_best(const Setup& s, const Reference& ref) {
  std::vector<Tried> tried;
  for (std::int64_t b : search_batches(s.o.max_batch)) {
    const TorchAt at = torch_at(s, ref, b, true);
    if (at.oom) {
      tried.push_back({b, std::nullopt, "out of memory"});
      fmt::print(stderr, "{}: PyTorch at batch {}: out of memory\n", prog, b);
      break;
    }
    tried.push_back({b, at.tokens_per_s, {}});
    fmt::print(stderr, "{}: PyTorch at batch {}: {:.0f} tokens/s\n", prog, b, at.tokens_per_s);
  }
  const std::int64_t best = fastest(tried);
  if (best == 0) throw std::runtime_error("PyTorch ran at no batch: " + describe_search(tried));
  return {torch_at(s, ref, best, false), tried};
}

/// The settings every run on `device` shares; checks the reference's parameter count against
/// baton's before spending minutes on either side.
Setup make_setup(Device device, const Options& given, const Reference* ref, bool with_ref) {
  Setup s;
  s.device = device;
  s.cuda = device.type == DeviceType::cuda;
  s.o = resolve(given, s.cuda, ref);
  const Sizes& def = s.cuda ? cuda_defaults : cpu_defaults;
  s.shape = models::GptShape{.vocab = pick(s.o.sizes.vocab, def.vocab),
                             .seq = pick(s.o.sizes.seq, def.seq),
                             .d_model = pick(s.o.sizes.d_model, def.d_model),
                             .heads = pick(s.o.sizes.heads, def.heads),
                             .layers = pick(s.o.sizes.layers, def.layers),
                             .attention = models::parse_attention(s.o.attention, s.cuda),
                             .gelu = models::parse_gelu(s.o.gelu)};
  s.warmup = s.o.warmup > 0 ? s.o.warmup : (s.o.quick ? 1 : 3);
  s.steps = s.o.steps > 0 ? s.o.steps : (s.o.quick ? 3 : (s.cuda ? 30 : 20));
  s.dev = describe(device);
  s.corpus = random_corpus(s.shape.vocab, s.shape.seq, std::max<std::int64_t>(s.o.sizes.batch, s.o.max_batch));
  {
    Graph g(seed);
    (void)models::gpt_with_loss(g, 1, s.shape);
    s.params = ParameterStore::initialize(g);
  }
  for (const auto& [name, t] : s.params->values()) {
    s.n_params += t.numel();
    if (name != "wte" && name != "wpe") s.n_multiply += t.numel();
  }
  s.sizes_args = fmt::format("--d-model {} --heads {} --layers {} --seq {} --vocab {}", s.shape.d_model,
                             s.shape.heads, s.shape.layers, s.shape.seq, s.shape.vocab);
  if (with_ref) {
    const std::string counted = ref->run("--count-only " + s.sizes_args, 120);
    const auto ref_params = bench::json_number(counted, "params");
    if (!ref_params || static_cast<std::int64_t>(*ref_params) != s.n_params) {
      throw std::runtime_error(fmt::format(
          "the PyTorch model is not baton's: {} parameters against baton's {} ({}); fix apps/bench/gpt_torch.py",
          ref_params ? fmt::format("{}", static_cast<std::int64_t>(*ref_params)) : "no count", s.n_params,
          s.sizes_args));
    }
  }
  // Model FLOPs per token: 6 N + 12 L d T (the file's header).
  s.flops_per_token = 6.0 * static_cast<double>(s.n_multiply) +
                      static_cast<double>(12 * s.shape.layers * s.shape.d_model * s.shape.seq);
  return s;
}

/// --plan-only: the plan's size at the batch asked for (or the largest that fits).
void print_plan(const Setup& s) {
  const std::int64_t batch =
      s.o.sizes.batch > 0 ? s.o.sizes.batch : (s.cuda ? auto_batch(s.shape, s.dev, s.o, s.corpus, s.params)
                                                      : cpu_defaults.batch);
  const Compiled c = compile_gpt(s.shape, batch, s.device, s.warmup + s.steps, s.o.threads, s.corpus, s.params,
                                 precision_of(s.o), s.o.activation_slots);
  bench::JsonLine line("gpu", s.cuda ? "gpt_cuda" : "gpt_cpu");
  line.add("device", s.device.str()).add("device_name", s.dev.name).add("batch", batch).add("seq", s.shape.seq);
  line.add("d_model", s.shape.d_model).add("heads", s.shape.heads).add("layers", s.shape.layers);
  line.add("vocab", s.shape.vocab).add("params", s.n_params).add("params_multiply", s.n_multiply);
  line.add("flops_per_token", s.flops_per_token).add("actors", static_cast<std::int64_t>(c.job.plan.actors.size()));
  line.add("register_bytes", c.register_bytes).add("estimated_bytes", c.estimated_bytes);
  line.print();
}

/// PyTorch's reference again under torch.compile at the eager run's batch: the higher anchor
/// (--torch-compile; auto: on CUDA), or why there is none.
struct CompileAnchor {
  std::optional<TorchAt> at;
  std::string missing;

  /// Its compile_* fields (baton's tokens/s for the ratio; `mfu_per_token_s`: MFU of one token/s, 0
  /// without a peak).
  void add_to(bench::JsonLine& line, std::optional<double> baton, double mfu_per_token_s) const {
    if (!at) {
      if (!missing.empty()) line.add("compile_missing", missing);
      return;
    }
    line.add("compile_reference", at->tokens_per_s).add("compile_batch", at->batch);
    if (baton) line.add("compile_ratio", *baton / at->tokens_per_s);
    if (mfu_per_token_s > 0) line.add("compile_mfu", at->tokens_per_s * mfu_per_token_s);
    line.add("compile_step_ms", bench::json_number(at->line, "step_ms").value_or(NAN));
    if (const auto m = bench::json_number(at->line, "max_memory_bytes"); m && *m > 0) {
      line.add("compile_max_memory_bytes", *m);
    }
  }
  void report(std::string_view program, const std::string& case_name, std::optional<double> baton) const {
    if (at) {
      fmt::print(stderr, "{}: {}: PyTorch under torch.compile {:.0f} tokens/s at batch {}{}\n", program, case_name,
                 at->tokens_per_s, at->batch,
                 baton ? fmt::format(" | baton / compiled {}", bench::ratio_note(*baton / at->tokens_per_s)) : std::string());
    } else if (!missing.empty()) {
      fmt::print(stderr, "{}: {}: no torch.compile figure: {}\n", program, case_name, missing);
    }
  }
};

CompileAnchor compile_anchor(const Setup& s, const Reference& ref, std::int64_t batch) {
  CompileAnchor c;
  if (s.o.torch_compile == "off" || (s.o.torch_compile == "auto" && !s.cuda)) return c;
  if (!ref.has_compile()) {
    c.missing = fmt::format("PyTorch {} has no torch.compile (2.0 and later)", ref.version());
    return c;
  }
  try {
    c.at = torch_at(s, ref, batch, true, true);
  } catch (const std::exception& e) {
    c.missing = bench::trim(e.what()).substr(0, 600);
  }
  return c;
}

/// Runs the benchmark on `device`; returns false if it failed (a line with "error" was printed).
/// baton's run in a result line: its loss and size, and its memory, planned and measured.
void add_run_fields(bench::JsonLine& line, const BatonAt& b) {
  line.add("loss", b.r.loss).add("job_s", b.r.job_s).add("actors", b.r.actors);
  line.add("graphs_captured", b.r.graphs_captured).add("graph_launches", b.r.graph_launches);
  line.add("graph_refusals", b.r.graph_refusals);
  line.add("register_bytes", b.register_bytes).add("estimated_bytes", b.estimated_bytes);
  if (b.r.device_peak_bytes > 0) {
    // The plan's estimate against what the device's allocators held (the goal: within 10%).
    line.add("device_peak_bytes", b.r.device_peak_bytes).add("device_reserved_bytes", b.r.device_reserved_bytes);
    line.add("plan_vs_device", static_cast<double>(b.estimated_bytes) / static_cast<double>(b.r.device_peak_bytes));
  }
}

/// PyTorch's run in a result line: its loss, memory and settings.
void add_reference_fields(bench::JsonLine& line, const TorchAt& t, const Setup& s, const Reference& ref,
                          bool best_mode) {
  const Options& o = s.o;
  line.add("reference_steps", s.steps);
  line.add("reference_loss", bench::json_number(t.line, "loss").value_or(NAN));
  if (const auto m = bench::json_number(t.line, "max_memory_bytes"); m && *m > 0) {
    line.add("reference_max_memory_bytes", *m);  // torch.cuda.max_memory_allocated
  }
  line.add("reference_attention", o.torch_attention).add("reference_precision", o.precision);
  line.add("torch_version", ref.version());
  if (best_mode && o.torch_attention != "sdpa") {
    line.add("reference_attention_note",
             fmt::format("PyTorch {} has no scaled_dot_product_attention (2.0 and later)", ref.version()));
  }
}

/// Both sides' runs of one device's case: at each side's best batch (--batch-mode best) or at
/// one batch.
struct Measured {
  std::optional<BatonAt> baton;
  std::optional<TorchAt> torch;
  std::vector<Tried> baton_search, torch_search;
  std::int64_t batch = 0, torch_batch = 0;
};

/// Runs baton (unless the precision is TF32, which it does not use) and, with `with_ref`, the
/// PyTorch reference; `batch` 0 picks one (--batch-mode same).
Measured measure(const Setup& s, const Reference* ref, bool with_ref, std::int64_t batch) {
  const Options& o = s.o;
  const bool baton_runs = o.precision != "tf32";
  Measured m;
  m.batch = batch;
  if (o.batch_mode == "best") {
    if (baton_runs) {
      auto [at, tried] = baton_best(s);
      m.baton = std::move(at);
      m.baton_search = std::move(tried);
      m.batch = m.baton->batch;
    }
    if (with_ref) {
      auto [at, tried] = torch_best(s, *ref);
      m.torch = std::move(at);
      m.torch_search = std::move(tried);
      m.torch_batch = m.torch->batch;
    }
    return m;
  }
  if (m.batch == 0) m.batch = s.cuda ? auto_batch(s.shape, s.dev, o, s.corpus, s.params) : cpu_defaults.batch;
  // PyTorch first: baton keeps its device memory pooled until this process ends.
  if (with_ref) {
    m.torch = torch_at(s, *ref, m.batch, false);
    m.torch_batch = m.batch;
  }
  if (baton_runs) {
    fmt::print(stderr, "{}: {} on {} ({}): batch {} x seq {}, {:.1f} M parameters; {} + {} steps\n", prog,
               s.cuda ? "gpt_cuda" : "gpt_cpu", s.device.str(), s.dev.name, m.batch, s.shape.seq,
               static_cast<double>(s.n_params) / 1e6, s.warmup, s.steps);
    m.baton = baton_at(s, m.batch, s.steps);
  }
  return m;
}

/// The case's lines for people (stderr): both sides' throughput and MFU, torch.compile's, and
/// baton's kernel (and device) time per step by op.
void print_summary(const Setup& s, const std::string& case_name, const Measured& m, std::optional<double> peak,
                   const CompileAnchor& tc) {
  const std::optional<BatonAt>& b = m.baton;
  const std::optional<TorchAt>& t = m.torch;
  const std::int64_t torch_batch = m.torch_batch;
  auto mfu = [&](double r) { return r * s.flops_per_token / (*peak * 1e12); };
  fmt::print(
      stderr, "{}: {}: baton {} | PyTorch {}{}\n", prog, case_name,
      b ? fmt::format("{:.0f} tokens/s at batch {} ({:.2f} ms/step, loss {:.4f}){}", b->tokens_per_s, b->batch,
                      b->r.timed_s * 1e3 / static_cast<double>(b->steps), b->r.loss,
                      peak ? fmt::format(", MFU {:.1f}%", 100 * mfu(b->tokens_per_s)) : std::string())
        : std::string("skipped"),
      t ? fmt::format("{:.0f} tokens/s at batch {}{}", t->tokens_per_s, torch_batch,
                      peak ? fmt::format(", MFU {:.1f}%", 100 * mfu(t->tokens_per_s)) : std::string())
        : std::string("not run"),
      b && t ? fmt::format(" | ratio {}", bench::ratio_note(b->tokens_per_s / t->tokens_per_s)) : std::string());
  tc.report(prog, case_name, b ? std::optional<double>(b->tokens_per_s) : std::nullopt);
  if (b && !b->r.kernel_s_by_op.empty()) {  // a child's run printed its own
    const double all_steps = static_cast<double>(s.warmup + b->steps);
    auto top = [&](const std::map<std::string, double>& by_op, std::size_t n) {
      std::vector<std::pair<double, std::string>> ops;
      double total = 0;
      for (const auto& [op, sec] : by_op) {
        ops.emplace_back(sec, op);
        total += sec;
      }
      std::sort(ops.rbegin(), ops.rend());
      std::string out = fmt::format("total {:.2f}", total * 1e3 / all_steps);
      for (std::size_t i = 0; i < std::min(ops.size(), n); ++i) {
        out += fmt::format(", {} {:.2f}", ops[i].second, ops[i].first * 1e3 / all_steps);
      }
      return out;
    };
    fmt::print(stderr, "{}: {}: kernel ms/step by op (whole job; on CUDA the time to enqueue): {}\n", prog,
               case_name, top(b->r.kernel_s_by_op, 6));
    if (!b->r.device_s_by_op.empty()) {
      fmt::print(stderr, "{}: {}: device ms/step by op (BATON_DEVICE_TIME=1): {}\n", prog, case_name,
                 top(b->r.device_s_by_op, 14));
    }
  }
}

bool bench_device(Device device, const Options& given, const Reference* ref) {
  const bool cuda = device.type == DeviceType::cuda;
  const std::string case_name = cuda ? "gpt_cuda" : "gpt_cpu";
  bench::JsonLine line("gpu", case_name);
  std::int64_t batch = given.sizes.batch;
  try {
    const bool with_ref = ref != nullptr && ref->missing().empty() && !given.plan_only;
    const Setup s = make_setup(device, given, ref, with_ref);
    if (cuda) bench::provenance().set_gpu(s.dev.name);  // every line from here on names it
    const Options& o = s.o;
    if (o.plan_only) {
      print_plan(s);
      return true;
    }
    const bool best_mode = o.batch_mode == "best";
    std::optional<double> peak =
        o.peak_tflops > 0 ? std::optional<double>(o.peak_tflops) : table_peak_tflops(s.dev.name, o.precision);
    const std::string peak_source = o.peak_tflops > 0 ? "--peak-tflops" : (peak ? "table" : "");
    const bool baton_runs = o.precision != "tf32";
    const std::string baton_refused =
        baton_runs ? ""
                   : "baton does not use TF32 (its float32 products are full float32): only the PyTorch reference ran";

    Measured m = measure(s, ref, with_ref, batch);
    batch = m.batch;
    const std::optional<BatonAt>& b = m.baton;
    const std::optional<TorchAt>& t = m.torch;
    const std::int64_t torch_batch = m.torch_batch;
    const std::vector<Tried>& baton_search = m.baton_search;
    const std::vector<Tried>& torch_search = m.torch_search;

    const CompileAnchor tc = t ? compile_anchor(s, *ref, torch_batch) : CompileAnchor{};

    auto mfu = [&](double r) { return r * s.flops_per_token / (*peak * 1e12); };
    if (b) line.add("value", b->tokens_per_s);
    line.add("unit", "tokens/s").better(bench::Better::higher);
    if (t) line.add("reference", t->tokens_per_s);
    if (b && t) line.compare("ratio", b->tokens_per_s, t->tokens_per_s);
    line.add("batch_mode", o.batch_mode);
    if (b) line.add("batch", b->batch);
    if (t) line.add("reference_batch", torch_batch);
    if (!baton_search.empty()) line.add("batch_search", describe_search(baton_search));
    if (!torch_search.empty()) line.add("reference_batch_search", describe_search(torch_search));
    if (best_mode) {
      line.add("batch_rule", fmt::format("the fastest of the powers of two up to {} that fit (baton: and the largest "
                                         "its plan fits), measured again",
                                         o.max_batch));
    }
    if (!baton_refused.empty()) line.add("skipped", baton_refused);
    if (b && peak) line.add("mfu", mfu(b->tokens_per_s));
    if (t && peak) line.add("reference_mfu", mfu(t->tokens_per_s));
    if (b) line.add("step_ms", b->r.timed_s * 1e3 / static_cast<double>(b->steps));
    if (t) line.add("reference_step_ms", bench::json_number(t->line, "step_ms").value_or(NAN));
    if (b) line.add("model_tflops", b->tokens_per_s * s.flops_per_token / 1e12);
    if (peak) {
      line.add("peak_tflops", *peak).add("peak_source", peak_source);
    } else {
      line.add("peak_missing", fmt::format("no peak for '{}' at {}: give --peak-tflops", s.dev.name, o.precision));
    }
    line.add("flops_per_token", s.flops_per_token);
    line.add("flops_formula", "6*N + 12*layers*d_model*seq (PaLM/Megatron; N = parameters without wte, wpe)");
    line.add("params", s.n_params).add("params_multiply", s.n_multiply);
    line.add("device", device.str()).add("device_name", s.dev.name).add("precision", o.precision);
    line.add("seq", s.shape.seq).add("d_model", s.shape.d_model).add("heads", s.shape.heads);
    line.add("layers", s.shape.layers).add("vocab", s.shape.vocab);
    line.add("warmup", s.warmup).add("steps", b ? b->steps : s.steps).add("threads", o.threads);
    if (b) add_run_fields(line, *b);
    if (t) add_reference_fields(line, *t, s, *ref, best_mode);
    tc.add_to(line, b ? std::optional<double>(b->tokens_per_s) : std::nullopt, peak ? s.flops_per_token / (*peak * 1e12) : 0);
    line.add("attention", o.attention).add("gelu", o.gelu);
    if (s.cuda && o.attention != "naive" && o.attention != "fused") {
      const cuda::CudnnAttention& c = cuda::cudnn_attention();
      line.add("cudnn", c.ok ? c.version : "unavailable: " + c.reason);
    }
    if (ref != nullptr && !ref->missing().empty()) line.add("reference_missing", ref->missing());
    line.print();

    print_summary(s, case_name, m, peak, tc);
    return true;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: {} failed: {}\n", prog, case_name, e.what());
    line.add("error", e.what()).add("device", device.str());
    if (batch > 0) line.add("batch", batch);
    line.print();
    return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 1);
  const Options opt = parse(argc, argv);
  (void)baton::ns_per_tick();  // its one-off calibration, outside every measurement
  std::optional<Reference> ref;
  if (opt.reference || opt.require_reference) {
    ref.emplace();
    if (!ref->missing().empty()) {
      fmt::print(
          stderr,
          "{}: the PyTorch reference is missing: {}\n  (BATON_PYTHON names a python3 with torch; "
          "scripts/run.sh bench gpu installs Debian's python3-torch); no reference keys\n",
          prog, ref->missing());
      if (opt.require_reference) return bench::skip(fmt::format("{} --require-reference", prog), ref->missing());
    }
  }
  std::vector<Device> devices;
  bool failed = false;
  if (opt.device == "auto") {
    if (const auto& a = cuda::availability(); a.ok) {
      devices.push_back(Device::parse("cuda:0"));
    } else {
      // The GPU part is skipped, said so in the JSON, and the same benchmark runs on the CPU, so
      // that the command always measures something real.
      bench::JsonLine("gpu", "gpt_cuda")
          .add("skipped", fmt::format("no CUDA device: {}; use --device cpu", a.reason))
          .print();
      fmt::print(stderr, "{}: no CUDA device ({}); running the CPU variant\n", prog, a.reason);
      devices.push_back(Device::parse("cpu"));
    }
  } else {
    const Device d = Device::parse(opt.device);
    if (const auto& a = cuda::availability(); d.type == DeviceType::cuda && !a.ok) {
      bench::JsonLine("gpu", "gpt_cuda")
          .add("error", fmt::format("no CUDA device: {}; use --device cpu", a.reason))
          .print();
      fmt::print(stderr, "{}: --device {} asked for, but there is no CUDA device: {}\n", prog,
                 opt.device, a.reason);
      return 1;
    }
    devices.push_back(d);
  }
  for (Device d : devices) failed = !bench_device(d, opt, ref ? &*ref : nullptr) || failed;
  return failed ? 1 : 0;
}
