// baton-bench-gpu: a GPT training step on one device, baton against PyTorch eager in the same run.
//
// The model is baton-train's GPT (apps/train/models.h, models::gpt_with_loss), compiled for
// training with Adam (lr 1e-3) on one device (TrainConfig::replica_places), fed uniformly random
// tokens. baton runs `warmup` + `steps` steps as one job; the timed window is from the loss
// report of step `warmup` to that of step `warmup + steps`, so it is steady-state throughput
// (set-up, allocation and the first steps excluded). The reference is the same model, batch,
// optimizer and precision in PyTorch eager mode (apps/bench/gpt_torch.py, a subprocess), timed
// the same way with torch.cuda.synchronize; both parameter counts are compared first and a
// mismatch fails the benchmark. One JSON line per case on stdout; notes on stderr.
//
//   baton-bench-gpu                         cuda:0 if there is one (an H100-sized GPT, batch
//                                           chosen to fill the memory); else a "skipped" line
//                                           for it and the CPU variant (small sizes)
//   baton-bench-gpu --device cpu --quick    the harness on the CPU, PyTorch (CPU) as reference
//   baton-bench-gpu --precision bf16        mixed precision on both sides (autocast's policy)
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
  std::string precision = "f32";
  double peak_tflops = 0;  // 0: from the table
  std::string torch_attention = "naive";
  /// baton's attention: naive (matmul, mask, softmax, matmul) or fused (attention(), ops.h).
  std::string attention = "naive";
  bool reference = true;
  bool require_reference = false;
  bool quick = false;
  /// Compile and size the plan, print it, train nothing.
  bool plan_only = false;
  /// Auto batch: the fraction of the device's free memory the plan may take.
  double mem_fraction = 0.85;
  std::int64_t max_batch = 64;
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
      "                      defaults on CUDA: 1024, 16, 8, 1024, 32768, batch 0 = the largest "
      "that fits\n"
      "                      --mem-fraction (default 0.85) of free memory, at most --max-batch "
      "(64);\n"
      "                      on the CPU: 128, 4, 2, 64, 512, batch 8\n"
      "  --warmup W --steps S  untimed then timed steps (CUDA 3 and 10, CPU 3 and 20; --quick: 1 "
      "and 3)\n"
      "  --threads N         baton worker threads (and PyTorch CPU threads), default 1\n"
      "  --activation-slots K  slots per activation register (default 1: one device)\n"
      "  --precision P       f32 (default; full float32 products on both sides), bf16 (autocast on "
      "both\n"
      "                      sides; f32 weights and Adam) or tf32 (PyTorch alone)\n"
      "  --peak-tflops X     the device's peak for the precision, for MFU (default: from a table "
      "of\n"
      "                      NVIDIA's dense figures by device name; none for the CPU)\n"
      "  --attention A       baton's attention: naive (default: matmul, mask, softmax, matmul) "
      "or fused\n"
      "                      (one op per block, FlashAttention's tiling: no T x T scores in "
      "memory)\n"
      "  --torch-attention A naive (default: baton's ops) or sdpa (PyTorch's fused causal "
      "attention)\n"
      "  --no-reference      skip PyTorch;  --require-reference  exit 77 if PyTorch is missing\n"
      "  --timeout S         give up on a side after S seconds (default 600)\n"
      "  --plan-only         compile, print the plan's size (register_bytes, estimated_bytes), "
      "train nothing\n"
      "  environment: BATON_PYTHON (default: the first of python3 on PATH, /usr/bin/python3 that "
      "imports\n"
      "  torch), BATON_GPT_TORCH (the reference script; default gpt_torch.py beside the program or "
      "in\n"
      "  the source tree)\n",
      prog);
  std::exit(code);
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
    else if (a == "--attention")
      o.attention = value(i, a);
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
  if (o.precision != "f32" && o.precision != "tf32" && o.precision != "bf16") {
    fmt::print(stderr, "{}: --precision must be f32, tf32 or bf16, not '{}'\n", prog, o.precision);
    usage(2);
  }
  if (o.torch_attention != "naive" && o.torch_attention != "sdpa") {
    fmt::print(stderr, "{}: --torch-attention must be naive or sdpa, not '{}'\n", prog,
               o.torch_attention);
    usage(2);
  }
  if (o.attention != "naive" && o.attention != "fused") {
    fmt::print(stderr, "{}: --attention must be naive or fused, not '{}'\n", prog, o.attention);
    usage(2);
  }
  if (o.device != "auto") {
    try {
      (void)Device::parse(o.device);
    } catch (const std::exception& e) {
      fmt::print(stderr, "{}: --device: {}\n", prog, e.what());
      usage(2);
    }
  }
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
          fmt::format("timeout 60 {} -c 'import torch; print(torch.__version__)' 2>&1",
                      bench::shell_quote(py)));
      out = bench::trim(out);
      const auto nl = out.rfind('\n');
      std::string last = nl == std::string::npos ? out : out.substr(nl + 1);
      if (status == 0) {
        python_ = py;
        version_ = last;
        break;
      }
      tried.push_back(
          fmt::format("{}: {}", py, last.empty() ? fmt::format("exit status {}", status) : last));
    }
    if (python_.empty()) {
      missing_ = fmt::format("no python3 that imports torch ({})", fmt::join(tried, "; "));
      return;
    }
    std::vector<std::string> scripts;
    if (const char* env = std::getenv("BATON_GPT_TORCH"); env != nullptr && *env != '\0')
      scripts.emplace_back(env);
    scripts.push_back(bench::executable_dir() + "/gpt_torch.py");  // the GPU bundle
#ifdef BATON_SOURCE_DIR
    scripts.emplace_back(std::string(BATON_SOURCE_DIR) + "/apps/bench/gpt_torch.py");
#endif
    scripts.push_back(bench::executable_dir() + "/../../apps/bench/gpt_torch.py");
    for (const auto& s : scripts) {
      if (std::filesystem::exists(s)) {
        script_ = s;
        return;
      }
    }
    missing_ = fmt::format("gpt_torch.py not found (looked in: {})", fmt::join(scripts, ", "));
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
  std::uint64_t register_bytes = 0;   // every register slot on the benchmark's device
  std::uint64_t estimated_bytes = 0;  // registers + weight and Adam's two moments
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
  if (!params) params = ParameterStore::initialize(*c.graph);
  c.job = compile_training(*c.graph, out.loss, cfg, std::move(params));
  for (const auto& [name, t] : c.job.params->values()) {
    c.params += t.numel();
    if (name != "wte" && name != "wpe") c.params_multiply += t.numel();
  }
  for (const auto& r : c.job.plan.registers) {
    const auto& producer = c.job.plan.actors.at(r.producer);
    if (producer.where.device != device) continue;
    c.register_bytes += static_cast<std::uint64_t>(r.slots) *
                        static_cast<std::uint64_t>(numel(r.shape)) * size_of(r.dtype);
  }
  c.estimated_bytes = c.register_bytes + 3 * static_cast<std::uint64_t>(c.params) * sizeof(float);
  return c;
}

struct BatonResult {
  double timed_s = 0;  // loss of step warmup -> loss of step warmup + steps
  double job_s = 0;    // the whole run, set-up of the workers included
  double loss = NAN;
  std::int64_t actors = 0;
  std::map<std::string, double> kernel_s_by_op;
};

/// The shortest timed window that polling the loss log measures to within a few percent.
constexpr double min_timed_s = 0.01;

BatonResult run_baton(Compiled& c, std::int64_t warmup, std::int64_t steps, double timeout_s) {
  Runtime rt(c.job.plan, c.job.kernels);
  std::exception_ptr failure;
  RunReport report;
  std::atomic<bool> finished{false};
  std::thread runner([&] {
    try {
      report = rt.run();
    } catch (...) {
      failure = std::current_exception();
    }
    finished.store(true, std::memory_order_release);
  });
  // Poll the loss log: a step's loss arrives once per step, so 100 us of polling granularity is
  // far below a step, and sleeping between polls leaves the cores to the job.
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  std::optional<Clock::time_point> t_warm, t_end;
  bool timed_out = false;
  while (!finished.load(std::memory_order_acquire)) {
    const auto now = Clock::now();
    const std::int64_t done = c.job.losses->steps_done();
    if (!t_warm && done >= warmup) t_warm = now;
    if (!t_end && done >= warmup + steps) t_end = now;
    if (now > deadline && !timed_out) {
      timed_out = true;
      rt.abort(fmt::format("{}: past the --timeout of {:.0f} s at step {} of {}", prog, timeout_s,
                           done, warmup + steps));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  runner.join();
  if (failure) std::rethrow_exception(failure);
  if (!t_warm || !t_end) {
    // The job ended between two polls: the last steps' reports are not told apart.
    throw std::runtime_error(
        fmt::format("the job ended before its step times were seen ({} of {} steps reported)",
                    c.job.losses->steps_done(), warmup + steps));
  }
  BatonResult r;
  r.timed_s = std::chrono::duration<double>(*t_end - *t_warm).count();
  if (r.timed_s < min_timed_s) {
    throw std::runtime_error(
        fmt::format("the {} timed steps took {:.2f} ms, too short to time by polling the loss "
                    "log (every ~0.1 ms): raise --steps",
                    steps, r.timed_s * 1e3));
  }
  r.job_s = report.wall_s;
  auto losses = c.job.losses->per_step();
  if (!losses.empty()) r.loss = losses.back();
  r.actors = static_cast<std::int64_t>(c.job.plan.actors.size());
  std::map<std::string, std::string> op_of;
  for (const auto& a : c.job.plan.actors) op_of[a.name] = a.op.empty() ? "(" + a.name + ")" : a.op;
  for (const auto& a : report.metrics.actors) r.kernel_s_by_op[op_of[a.name]] += a.kernel_s;
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

/// Runs the benchmark on `device`; returns false if it failed (a line with "error" was printed).
bool bench_device(Device device, const Options& o, const Reference* ref) {
  const bool cuda = device.type == DeviceType::cuda;
  const Sizes& def = cuda ? cuda_defaults : cpu_defaults;
  const models::GptShape shape{.vocab = pick(o.sizes.vocab, def.vocab),
                               .seq = pick(o.sizes.seq, def.seq),
                               .d_model = pick(o.sizes.d_model, def.d_model),
                               .heads = pick(o.sizes.heads, def.heads),
                               .layers = pick(o.sizes.layers, def.layers),
                               .attention = models::parse_attention(o.attention)};
  const std::int64_t warmup = o.warmup > 0 ? o.warmup : (o.quick ? 1 : 3);
  const std::int64_t steps = o.steps > 0 ? o.steps : (o.quick ? 3 : (cuda ? 10 : 20));
  const std::string case_name = cuda ? "gpt_cuda" : "gpt_cpu";
  bench::JsonLine line("gpu", case_name);
  std::int64_t batch = o.sizes.batch;
  try {
    const DeviceInfo dev = describe(device);
    const std::int64_t flops_attention = 12 * shape.layers * shape.d_model * shape.seq;
    std::optional<double> peak = o.peak_tflops > 0 ? std::optional<double>(o.peak_tflops)
                                                   : table_peak_tflops(dev.name, o.precision);
    const std::string peak_source = o.peak_tflops > 0 ? "--peak-tflops" : (peak ? "table" : "");
    const bool baton_runs = o.precision != "tf32";
    const DType precision = precision_of(o);
    const std::string baton_refused =
        baton_runs ? ""
                   : "baton does not use TF32 (its float32 products are full float32): only the PyTorch "
                     "reference ran";

    // The parameter count is the model's, whatever the batch: check it against the reference's
    // before spending minutes on either side.
    const auto corpus =
        random_corpus(shape.vocab, shape.seq, std::max<std::int64_t>(batch, o.max_batch));
    std::shared_ptr<ParameterStore> params;
    {
      Graph g(seed);
      (void)models::gpt_with_loss(g, 1, shape);
      params = ParameterStore::initialize(g);
    }
    std::int64_t n_params = 0, n_multiply = 0;
    for (const auto& [name, t] : params->values()) {
      n_params += t.numel();
      if (name != "wte" && name != "wpe") n_multiply += t.numel();
    }
    const std::string sizes_args =
        fmt::format("--d-model {} --heads {} --layers {} --seq {} --vocab {}", shape.d_model,
                    shape.heads, shape.layers, shape.seq, shape.vocab);
    const bool with_ref = ref != nullptr && ref->missing().empty() && !o.plan_only;
    if (with_ref) {
      const std::string counted = ref->run("--count-only " + sizes_args, 120);
      const auto ref_params = bench::json_number(counted, "params");
      if (!ref_params || static_cast<std::int64_t>(*ref_params) != n_params) {
        throw std::runtime_error(fmt::format(
            "the PyTorch model is not baton's: {} parameters against baton's {} ({}); fix "
            "apps/bench/gpt_torch.py",
            ref_params ? fmt::format("{}", static_cast<std::int64_t>(*ref_params)) : "no count",
            n_params, sizes_args));
      }
    }
    const double flops_per_token =
        6.0 * static_cast<double>(n_multiply) + static_cast<double>(flops_attention);

    std::optional<BatonResult> b;
    std::optional<Compiled> compiled;
    if (baton_runs) {
      if (batch == 0) {
        batch = cuda ? auto_batch(shape, dev, o, corpus, params) : def.batch;
      }
      compiled.emplace(
          compile_gpt(shape, batch, device, warmup + steps, o.threads, corpus, params, precision, o.activation_slots));
      if (cuda && compiled->estimated_bytes > dev.free_bytes) {
        throw std::runtime_error(
            fmt::format("the plan needs ~{:.1f} GB on {} ({}), {:.1f} GB free: lower --batch",
                        static_cast<double>(compiled->estimated_bytes) / 1e9, device.str(),
                        dev.name, static_cast<double>(dev.free_bytes) / 1e9));
      }
      if (o.plan_only) {
        line.add("device", device.str())
            .add("device_name", dev.name)
            .add("batch", batch)
            .add("seq", shape.seq);
        line.add("d_model", shape.d_model).add("heads", shape.heads).add("layers", shape.layers);
        line.add("vocab", shape.vocab).add("params", n_params).add("params_multiply", n_multiply);
        line.add("flops_per_token", flops_per_token)
            .add("actors", static_cast<std::int64_t>(compiled->job.plan.actors.size()));
        line.add("register_bytes", compiled->register_bytes)
            .add("estimated_bytes", compiled->estimated_bytes);
        line.print();
        return true;
      }
      fmt::print(
          stderr,
          "{}: {} on {} ({}): batch {} x seq {}, {:.1f} M parameters, {} actors, {:.2f} GB of "
          "registers; {} + {} steps\n",
          prog, case_name, device.str(), dev.name, batch, shape.seq,
          static_cast<double>(n_params) / 1e6, compiled->job.plan.actors.size(),
          static_cast<double>(compiled->register_bytes) / 1e9, warmup, steps);
      b = run_baton(*compiled, warmup, steps, o.timeout_s);
    } else if (batch == 0) {
      batch = cuda ? 8 : def.batch;  // no plan to size it by
    }

    std::optional<std::string> t;
    if (with_ref) {
      t = ref->run(
          fmt::format(
              "--device {} {} --batch {} --warmup {} --steps {} --threads {} --precision {} "
              "--attention {} --lr {} --seed {}",
              cuda ? fmt::format("cuda:{}", device.index) : std::string("cpu"), sizes_args, batch,
              warmup, steps, o.threads, o.precision, o.torch_attention, lr, seed),
          o.timeout_s);
    }

    const double tokens_per_step = static_cast<double>(batch * shape.seq);
    std::optional<double> rate, ref_rate;
    if (b) rate = tokens_per_step * static_cast<double>(steps) / b->timed_s;
    if (t) {
      ref_rate = bench::json_number(*t, "tokens_per_s");
      if (!ref_rate)
        throw std::runtime_error("the PyTorch reference printed no tokens_per_s: " + *t);
    }
    auto mfu = [&](double r) { return r * flops_per_token / (*peak * 1e12); };

    if (rate) line.add("value", *rate);
    line.add("unit", "tokens/s");
    if (ref_rate) line.add("reference", *ref_rate);
    if (rate && ref_rate) line.add("ratio", *rate / *ref_rate);
    if (!baton_refused.empty()) line.add("skipped", baton_refused);
    if (rate && peak) line.add("mfu", mfu(*rate));
    if (ref_rate && peak) line.add("reference_mfu", mfu(*ref_rate));
    if (b) line.add("step_ms", b->timed_s * 1e3 / static_cast<double>(steps));
    if (t) line.add("reference_step_ms", bench::json_number(*t, "step_ms").value_or(NAN));
    if (rate) line.add("model_tflops", *rate * flops_per_token / 1e12);
    if (peak) {
      line.add("peak_tflops", *peak).add("peak_source", peak_source);
    } else {
      line.add("peak_missing",
               fmt::format("no peak for '{}' at {}: give --peak-tflops", dev.name, o.precision));
    }
    line.add("flops_per_token", flops_per_token);
    line.add("flops_formula",
             "6*N + 12*layers*d_model*seq (PaLM/Megatron; N = parameters without wte, wpe)");
    line.add("params", n_params).add("params_multiply", n_multiply);
    line.add("device", device.str()).add("device_name", dev.name).add("precision", o.precision);
    line.add("batch", batch)
        .add("seq", shape.seq)
        .add("d_model", shape.d_model)
        .add("heads", shape.heads);
    line.add("layers", shape.layers).add("vocab", shape.vocab);
    line.add("warmup", warmup).add("steps", steps).add("threads", o.threads);
    if (b) {
      line.add("loss", b->loss).add("job_s", b->job_s).add("actors", b->actors);
      line.add("register_bytes", compiled->register_bytes)
          .add("estimated_bytes", compiled->estimated_bytes);
    }
    if (t) {
      line.add("reference_loss", bench::json_number(*t, "loss").value_or(NAN));
      if (const auto m = bench::json_number(*t, "max_memory_bytes"); m && *m > 0) {
        line.add("reference_max_memory_bytes", *m);  // torch.cuda.max_memory_allocated
      }
      line.add("reference_attention", o.torch_attention).add("torch_version", ref->version());
    }
    line.add("attention", o.attention);
    if (ref != nullptr && !ref->missing().empty()) line.add("reference_missing", ref->missing());
    line.print();

    fmt::print(
        stderr, "{}: {}: baton {} | PyTorch {}{}\n", prog, case_name,
        rate ? fmt::format("{:.0f} tokens/s ({:.2f} ms/step, loss {:.4f}){}", *rate,
                           b->timed_s * 1e3 / static_cast<double>(steps), b->loss,
                           peak ? fmt::format(", MFU {:.1f}%", 100 * mfu(*rate)) : std::string())
             : std::string("skipped"),
        ref_rate
            ? fmt::format("{:.0f} tokens/s{}", *ref_rate,
                          peak ? fmt::format(", MFU {:.1f}%", 100 * mfu(*ref_rate)) : std::string())
            : std::string("not run"),
        rate && ref_rate ? fmt::format(" | ratio {:.2f}", *rate / *ref_rate) : std::string());
    if (b) {
      std::vector<std::pair<double, std::string>> ops;
      for (const auto& [op, s] : b->kernel_s_by_op) ops.emplace_back(s, op);
      std::sort(ops.rbegin(), ops.rend());
      std::string top;
      const double all_steps = static_cast<double>(warmup + steps);
      for (std::size_t i = 0; i < std::min<std::size_t>(ops.size(), 6); ++i) {
        top += fmt::format("{}{} {:.2f}", i ? ", " : "", ops[i].second,
                           ops[i].first * 1e3 / all_steps);
      }
      fmt::print(stderr,
                 "{}: {}: kernel ms/step by op (whole job; on CUDA the time to enqueue): {}\n",
                 prog, case_name, top);
    }
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
      if (opt.require_reference) return 77;  // CTest's SKIP_RETURN_CODE
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
