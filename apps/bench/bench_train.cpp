// baton-bench-train: training throughput of baton against PyTorch on the same models.
//
// Each case compiles a model written with the DSL (apps/train/models.h) into a training plan,
// exactly as baton-train does (compile_training + Runtime::run, Adam lr 1e-3, one micro-batch
// per step), trains it on synthetic data and prints one JSON line to stdout. Two references
// train the same model, batch, optimizer and thread count from baton's initial weights (handed
// over in a file, weights_file.h), measured in the same run:
//   - LibTorch's C++ API (baton-bench-train-libtorch, apps/bench/libtorch_reference.cpp, built
//     where Debian's libtorch-dev is installed): PyTorch's kernels without Python's dispatch;
//   - PyTorch (apps/bench/torch_reference.py under /usr/bin/python3 and Debian's python3-torch),
//     as most users run it.
// "libtorch" / "pytorch" are their samples/s and "ratio_libtorch" / "ratio_pytorch" baton's
// samples/s over theirs (above 1: baton is faster); "reference" / "ratio" are against the faster
// of the two. A reference that cannot run is named in "reference_missing" with the reason.
// Human-readable notes go to stderr.
//
//   baton-bench-train                       every case, best of 3 runs of ~1.5 s per side
//   baton-bench-train --quick               ~10x fewer steps
//   baton-bench-train --quick --no-reference  (the CTest smoke run: needs no PyTorch)
//   baton-bench-train --case gpt_small
//   baton-bench-train --reference libtorch --require-reference   exit 77 if LibTorch is missing
//
// Per-step overhead from the run's metrics: kernel_ms_per_step is the time inside kernels
// (every actor's ActorMetrics::kernel_s summed, per step); with 1 thread
// overhead_ms_per_step = step_ms - kernel_ms_per_step is everything else the runtime spent
// (handshakes, mailbox polling, actor bookkeeping); handshake_ms_per_step is busy - kernel
// summed over actors, per step (the handshakes around the kernels, on whichever thread).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
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

#include "capture.h"
#include "json_line.h"
#include "skip.h"
#include "weights_file.h"
#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/blas_choice.h"
#include "baton/kernels/ops.h"
#include "baton/kernels/data.h"
#include "models.h"

namespace {

using namespace baton;
using Clock = std::chrono::steady_clock;

constexpr std::string_view prog = "baton-bench-train";

// ---------------------------------------------------------------------------------------------
// Cases

struct Case {
  std::string name;
  std::string model;  // "mlp" or "gpt"
  std::int64_t batch = 0;
  int threads = 1;  // baton's worker threads (TrainConfig::threads)
  models::MlpShape mlp{};
  models::GptShape gpt{};
  int blas_threads = 1;  // baton's threads per matrix product (set_blas_threads)
  /// The cores the case may use: the references get as many threads.
  int cores() const { return threads * blas_threads; }
};

/// The small GPT of baton-train's defaults, and one where the matrix products dominate a step.
constexpr models::GptShape gpt_small{.vocab = 64, .seq = 32, .d_model = 64, .heads = 4, .layers = 2};
constexpr models::GptShape gpt_d256{.vocab = 64, .seq = 128, .d_model = 256, .heads = 4, .layers = 4};
/// The MLP of baton-train's defaults (64-256-256-10), and MNIST's 784-1024-1024-10.
constexpr models::MlpShape mlp_small{};
constexpr models::MlpShape mlp_784{.inputs = 784, .hidden = 1024, .layers = 2, .classes = 10};

std::vector<Case> all_cases() {
  std::vector<Case> base{{"mlp_b64", "mlp", 64, 1, mlp_small, {}},
                         {"mlp_b256", "mlp", 256, 1, mlp_small, {}},
                         {"mlp784_b256", "mlp", 256, 1, mlp_784, {}},
                         {"gpt_small", "gpt", 16, 1, {}, gpt_small},
                         {"gpt_d256", "gpt", 8, 1, {}, gpt_d256}};
  std::vector<Case> out = base;
  for (Case c : base) {
    c.name += "_2threads";
    c.threads = 2;
    out.push_back(c);
  }
  // The other way to give baton 2 cores: one worker whose matrix products run on both (what
  // the references do with their 2 intra-op threads).
  for (Case c : base) {
    c.name += "_blas2";
    c.blas_threads = 2;
    out.push_back(c);
  }
  return out;
}

/// The cases `only` selects: the one of that name if there is one, else those it begins.
std::vector<Case> selected_cases(const std::string& only) {
  std::vector<Case> out;
  for (const auto& c : all_cases()) {
    if (c.name == only) return {c};
    if (c.name.starts_with(only)) out.push_back(c);
  }
  return out;
}

constexpr std::uint64_t seed = 1;
constexpr double lr = 1e-3;

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
  bool quick = false;
  bool pytorch = true;   // run torch_reference.py
  bool libtorch = true;  // run baton-bench-train-libtorch
  bool require_reference = false;  // exit 77 if a reference asked for cannot run
  std::string only;  // run the case of that name, or those whose name starts with this
};

[[noreturn]] void usage(int code) {
  std::FILE* f = code == 0 ? stdout : stderr;
  std::vector<std::string> names;
  for (const auto& c : all_cases()) names.push_back(c.name);
  fmt::print(f,
             "usage: {} [--quick] [--reference all|libtorch|pytorch|none] [--no-reference] [--require-reference]\n"
             "       [--case NAME] [--allow-load] [--help]\n"
             "  Trains each model with baton and with LibTorch and PyTorch (the references) and prints one\n"
             "  JSON line per case to stdout.\n"
             "  --quick              ~10x fewer steps\n"
             "  --reference R        which references to run (default all); --no-reference = none\n"
             "  --require-reference  exit 77 (a skip for CTest) if a reference asked for cannot run\n"
             "  --case NAME          run only that case, or the cases whose name starts with NAME\n"
             "{}"
             "  cases: {}\n"
             "  environment: BATON_PYTHON (default /usr/bin/python3), BATON_TORCH_REFERENCE (the script),\n"
             "  BATON_LIBTORCH_REFERENCE (the LibTorch program; default beside this one), OMP_WAIT_POLICY\n"
             "  (the references' OpenMP waiting; default PASSIVE)\n",
             prog, bench::allow_load_usage, fmt::join(names, ", "));
  std::exit(code);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "-h" || a == "--help") {
      usage(0);
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--no-reference") {
      o.pytorch = o.libtorch = false;
    } else if (a == "--require-reference") {
      o.require_reference = true;
    } else if (a == "--reference" || a.starts_with("--reference=")) {
      std::string v;
      if (a == "--reference") {
        if (i + 1 >= argc) {
          fmt::print(stderr, "{}: --reference needs all, libtorch, pytorch or none\n", prog);
          usage(2);
        }
        v = argv[++i];
      } else {
        v = std::string(a.substr(12));
      }
      if (v != "all" && v != "libtorch" && v != "pytorch" && v != "none") {
        fmt::print(stderr, "{}: --reference must be all, libtorch, pytorch or none, not '{}'\n", prog, v);
        usage(2);
      }
      o.pytorch = v == "all" || v == "pytorch";
      o.libtorch = v == "all" || v == "libtorch";
    } else if (a == "--case") {
      if (i + 1 >= argc) {
        fmt::print(stderr, "{}: --case needs a NAME\n", prog);
        usage(2);
      }
      o.only = argv[++i];
    } else if (a.starts_with("--case=")) {
      o.only = std::string(a.substr(7));
    } else {
      fmt::print(stderr, "{}: unknown argument '{}'\n", prog, a);
      usage(2);
    }
  }
  if (selected_cases(o.only).empty()) {
    fmt::print(stderr, "{}: no case starts with '{}'\n", prog, o.only);
    usage(2);
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// JSON lines: flat objects of strings and finite numbers, one per line on stdout.

/// This benchmark's lines (see json_line.h).
struct JsonLine : baton::bench::JsonLine {
  explicit JsonLine(std::string_view case_name) : baton::bench::JsonLine("train", case_name) {}
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ---------------------------------------------------------------------------------------------
// The references: subprocesses that print one JSON line.

using bench::executable_dir;
using bench::json_number;
using bench::json_string;
using bench::run_capture;
using bench::shell_quote;
using bench::trim;

/// The OpenMP waiting the references run with: the caller's, or PASSIVE (libgomp's default
/// spinning makes 2 intra-op threads 20-50x slower when the 2 cores are shared with anything;
/// torch_reference.py says more).
std::string omp_wait_policy() {
  const char* env = std::getenv("OMP_WAIT_POLICY");
  return env != nullptr && *env != '\0' ? env : "PASSIVE";
}

/// A limit on a reference's run, far above any case's: a hung reference fails its case.
constexpr int reference_timeout_s = 1800;

class Reference {
 public:
  struct Result {
    double samples_per_s = 0;
    double step_ms = 0;
    double loss = 0;
    std::string omp_wait_policy;
    std::string weights;  // "baton" if it started from baton's weights
  };

  /// "libtorch" or "pytorch": the JSON keys' prefix.
  const std::string& name() const { return name_; }
  const std::string& missing() const { return missing_; }
  const std::string& version() const { return version_; }
  bool runs() const { return missing_.empty(); }

  /// Trains the case for `steps` steps (after `warmup` untimed ones) from the weights in
  /// `weights_file`, the best of `repeats` timed runs. OpenBLAS runs on the case's threads:
  /// Debian's torch 1.13 does not hand torch.set_num_threads on to its OpenBLAS, whose pthread
  /// build would otherwise add a thread per core to every matrix product (baton's side calls
  /// openblas_set_num_threads).
  Result run(const Case& c, std::int64_t steps, std::int64_t warmup, int repeats, const std::string& weights_file) const {
    std::string shape;
    if (c.model == "mlp") {
      shape = fmt::format("--model mlp --inputs {} --hidden {} --layers {} --classes {}", c.mlp.inputs, c.mlp.hidden,
                          c.mlp.layers, c.mlp.classes);
    } else {
      shape = fmt::format("--model gpt --vocab {} --seq {} --d-model {} --heads {} --layers {}", c.gpt.vocab, c.gpt.seq,
                          c.gpt.d_model, c.gpt.heads, c.gpt.layers);
    }
    const std::string cmd = fmt::format(
        "timeout --kill-after=10 {} env OMP_WAIT_POLICY={} OPENBLAS_NUM_THREADS={} {} --case {} {} --steps {} --threads {} "
        "--batch {} --warmup {} --lr {} --seed {} --repeats {} --weights {}",
        reference_timeout_s, shell_quote(omp_wait_policy()), c.cores(), command_, c.name, shape, steps, c.cores(), c.batch, warmup,
        lr, seed, repeats, shell_quote(weights_file));
    auto [status, out] = run_capture(cmd);
    if (status != 0) throw std::runtime_error(fmt::format("'{}' failed (status {})", cmd, status));
    const std::string line = bench::last_json_line(out);
    auto rate = json_number(line, "samples_per_s");
    auto step_ms = json_number(line, "step_ms");
    auto loss = json_number(line, "loss");
    if (!rate || !step_ms || !loss) {
      throw std::runtime_error(fmt::format("'{}' printed no result line: {}", cmd, trim(out)));
    }
    return {*rate, *step_ms, *loss, json_string(line, "omp_wait_policy").value_or(""),
            json_string(line, "weights").value_or("")};
  }

  /// PyTorch from Python: finds the interpreter and the script and checks that `import torch`
  /// works; if not, missing() says why.
  static Reference pytorch() {
    Reference r;
    r.name_ = "pytorch";
    const std::string python = bench::reference_python();
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("BATON_TORCH_REFERENCE"); env != nullptr && *env != '\0') {
      candidates.emplace_back(env);
    }
#ifdef BATON_SOURCE_DIR
    candidates.emplace_back(std::string(BATON_SOURCE_DIR) + "/apps/bench/torch_reference.py");
#endif
    candidates.push_back(executable_dir() + "/../../apps/bench/torch_reference.py");
    candidates.emplace_back("apps/bench/torch_reference.py");
    std::string script;
    for (const auto& c : candidates) {
      if (std::filesystem::exists(c)) {
        script = c;
        break;
      }
    }
    if (script.empty()) {
      r.missing_ = fmt::format("torch_reference.py not found (looked in: {})", fmt::join(candidates, ", "));
      return r;
    }
    auto [status, out] =
        run_capture(fmt::format("timeout 120 {} -c 'import torch; print(torch.__version__)' 2>&1", shell_quote(python)));
    out = trim(out);
    if (status != 0) {
      auto nl = out.rfind('\n');
      std::string last = nl == std::string::npos ? out : out.substr(nl + 1);
      r.missing_ = fmt::format("{} cannot import torch: {} (apt-get install python3-torch, or set BATON_PYTHON)",
                               python, last.empty() ? "exit status " + std::to_string(status) : last);
      return r;
    }
    r.version_ = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
    r.command_ = shell_quote(python) + " " + shell_quote(script);
    return r;
  }

  /// LibTorch: baton-bench-train-libtorch beside this program, where CMake found LibTorch.
  static Reference libtorch() {
    Reference r;
    r.name_ = "libtorch";
    std::string program;
    if (const char* env = std::getenv("BATON_LIBTORCH_REFERENCE"); env != nullptr && *env != '\0') {
      program = env;
    } else {
#ifndef BATON_HAS_LIBTORCH_REFERENCE
      r.missing_ =
          "baton-bench-train-libtorch was not built: CMake found no LibTorch (apt-get install libtorch-dev, then "
          "reconfigure the build)";
      return r;
#endif
      program = executable_dir() + "/baton-bench-train-libtorch";
    }
    if (::access(program.c_str(), X_OK) != 0) {
      r.missing_ = fmt::format("{} is not there or not executable", program);
      return r;
    }
    r.command_ = shell_quote(program);
    r.version_ = "LibTorch (the C++ API of the same build)";
    return r;
  }

 private:
  std::string name_, command_, version_, missing_;
};

// ---------------------------------------------------------------------------------------------
// baton

struct Data {
  std::map<std::int64_t, std::shared_ptr<const data::Dataset>> synthetic;  // the MLP's rows, by width
  std::shared_ptr<const data::TextCorpus> text;  // uniformly random tokens for the GPTs
};

Data make_data(const std::vector<Case>& cases) {
  Data d;
  for (const Case& c : cases) {
    if (c.model != "mlp" || d.synthetic.count(c.mlp.inputs) != 0) continue;
    // As baton-train --data synthetic: 4096 rows, 10 classes, 80% for training.
    auto [train, heldout] = data::split(data::synthetic(4096, c.mlp.inputs, c.mlp.classes, seed), 0.2, seed);
    d.synthetic[c.mlp.inputs] = std::make_shared<const data::Dataset>(std::move(train));
  }
  // A corpus of 64 Ki characters drawn uniformly from 64 symbols, built in memory (both GPTs
  // have a vocabulary of 64).
  data::TextCorpus text;
  text.path = "<synthetic>";
  for (int i = 0; i < 64; ++i) text.vocab.push_back(static_cast<unsigned char>('0' + i));
  std::mt19937_64 gen(seed);
  text.ids.resize(std::size_t{1} << 16);
  for (auto& id : text.ids) id = static_cast<std::int32_t>(gen() % 64);
  d.text = std::make_shared<const data::TextCorpus>(std::move(text));
  return d;
}

/// The case's model and loss in a fresh graph (seeded: the same initial weights every time).
Value build_model(Graph& g, const Case& c) {
  const bool gpt = c.model == "gpt";
  if (gpt && c.gpt.vocab != 64) throw std::logic_error("the benchmark's corpus has 64 symbols");
  Value logits = gpt ? models::gpt(g, c.batch, c.gpt) : models::mlp(g, c.batch, c.mlp);
  return softmax_cross_entropy(logits, g.find(gpt ? "targets" : "label")).named("loss");
}

/// Writes the case's initial weights (ParameterStore::initialize, as compile_training makes
/// them) for the references, and returns the file's path.
std::string write_initial_weights(const Case& c) {
  Graph g(seed);
  (void)build_model(g, c);
  const auto store = ParameterStore::initialize(g);
  std::map<std::string, bench::NamedArray> arrays;
  for (const auto& [name, t] : store->values()) {
    auto v = t.data<float>();
    arrays[name] = bench::NamedArray{t.shape(), std::vector<float>(v.begin(), v.end())};
  }
  const auto path = std::filesystem::temp_directory_path() / fmt::format("baton-bench-train-{}-{}.weights", ::getpid(), c.name);
  bench::write_weights(path.string(), arrays);
  return path.string();
}

struct BatonResult {
  double wall_s = 0;
  double kernel_s = 0;     // summed over actors
  double handshake_s = 0;  // busy - kernel, summed over actors
  double loss = 0;
  std::int64_t actors = 0;
  std::map<std::string, double> kernel_s_by_op;  // where the kernel time goes
};

BatonResult run_baton(const Case& c, std::int64_t steps, const Data& d) {
  Graph g(seed);
  const bool gpt = c.model == "gpt";
  Value loss = build_model(g, c);
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = 1;
  cfg.optimizer = optim::adam(lr);
  cfg.threads = c.threads;
  if (gpt) {
    cfg.data = {{"text", data::text_source(d.text, c.batch, 1, c.gpt.seq, seed), {"tokens", "targets"}}};
  } else {
    cfg.data = {{"synthetic", data::batch_source(d.synthetic.at(c.mlp.inputs), c.batch, 1, seed), {"x", "label"}}};
  }
  TrainingJob job = compile_training(g, loss, cfg);
  set_blas_threads(c.blas_threads);
  struct Reset {
    ~Reset() { set_blas_threads(1); }
  } reset_blas;  // the next case starts from one, whatever happens to this one
  Runtime rt(job.plan, job.kernels);
  RunReport report = rt.run();
  BatonResult r;
  r.wall_s = report.wall_s;
  std::map<std::string, std::string> op_of;
  for (const auto& a : job.plan.actors) op_of[a.name] = a.op.empty() ? "(" + a.name + ")" : a.op;
  for (const auto& a : report.metrics.actors) {
    r.kernel_s += a.kernel_s;
    r.kernel_s_by_op[op_of[a.name]] += a.kernel_s;
    r.handshake_s += a.busy_s - a.kernel_s;
  }
  auto losses = job.losses->per_step();
  r.loss = losses.empty() ? NAN : losses.back();
  r.actors = static_cast<std::int64_t>(job.plan.actors.size());
  return r;
}

// ---------------------------------------------------------------------------------------------

/// Seconds of training per measured run (each side).
constexpr double target_run_s = 1.5;
constexpr double quick_factor = 0.1;
/// A first calibration run of a few steps sizes a heavy case (the 256-wide GPT takes a good part
/// of a second per step on one core); a light one is calibrated again on more steps.
constexpr std::int64_t first_calibration_steps = 3;
constexpr std::int64_t calibration_steps = 20;
constexpr std::int64_t min_steps = 5;
constexpr std::int64_t max_steps = 1'000'000;
/// Measured runs per side (each from fresh weights); the fastest counts. The machine is shared,
/// so a single run can be slowed by a neighbour.
constexpr int repeats = 3;

/// The number of steps that makes a run last about `target_s`; the calibration runs warm the
/// caches and the allocator.
std::int64_t calibrate(const Case& c, const Data& d, double target_s, bool quick) {
  double per_step = run_baton(c, first_calibration_steps, d).wall_s / static_cast<double>(first_calibration_steps);
  if (per_step * calibration_steps < target_s) {
    per_step = run_baton(c, calibration_steps, d).wall_s / static_cast<double>(calibration_steps);
  }
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(std::ceil(target_s / per_step)),
                                  quick ? std::int64_t{2} : min_steps, max_steps);
}

void bench_case(const Case& c, const Options& o, const Data& d, const std::vector<Reference>& refs) {
  const double target_s = o.quick ? target_run_s * quick_factor : target_run_s;
  const std::int64_t steps = calibrate(c, d, target_s, o.quick);
  const int runs = o.quick ? 1 : repeats;
  BatonResult r = run_baton(c, steps, d);
  for (int i = 1; i < runs; ++i) {
    BatonResult again = run_baton(c, steps, d);
    if (again.wall_s < r.wall_s) r = again;
  }
  const double rate = static_cast<double>(steps * c.batch) / r.wall_s;
  const double step_ms = r.wall_s * 1e3 / static_cast<double>(steps);
  const double kernel_ms = r.kernel_s * 1e3 / static_cast<double>(steps);
  const double handshake_ms = r.handshake_s * 1e3 / static_cast<double>(steps);

  // The references, each from baton's initial weights.
  std::vector<std::pair<const Reference*, Reference::Result>> results;
  std::vector<std::string> missing;
  std::string weights;
  for (const Reference& ref : refs) {
    if (!ref.runs()) {
      missing.push_back(fmt::format("{}: {}", ref.name(), ref.missing()));
      continue;
    }
    if (weights.empty()) weights = write_initial_weights(c);
    try {
      results.emplace_back(&ref, ref.run(c, steps, o.quick ? 2 : 5, runs, weights));
    } catch (...) {
      std::filesystem::remove(weights);
      throw;
    }
  }
  if (!weights.empty()) std::filesystem::remove(weights);

  JsonLine line(c.name);
  line.add("value", rate).add("unit", "samples/s").better(bench::Better::higher);
  const std::pair<const Reference*, Reference::Result>* best = nullptr;
  for (const auto& res : results) {
    if (best == nullptr || res.second.samples_per_s > best->second.samples_per_s) best = &res;
  }
  if (best != nullptr) {
    line.add("reference", best->second.samples_per_s).compare("ratio", rate, best->second.samples_per_s);
    line.add("reference_is", fmt::format("the faster of the references: {}", best->first->name()));
  }
  for (const auto& [ref, t] : results) {
    const std::string& n = ref->name();
    line.add(n, t.samples_per_s).compare("ratio_" + n, rate, t.samples_per_s).add(n + "_step_ms", t.step_ms);
    line.add(n + "_loss", t.loss).add(n + "_weights", t.weights);
  }
  if (!missing.empty()) line.add("reference_missing", fmt::format("{}", fmt::join(missing, "; ")));
  line.add("model", c.model);
  if (c.model == "mlp") {
    line.add("shape", fmt::format("{}-{}x{}-{}", c.mlp.inputs, c.mlp.hidden, c.mlp.layers, c.mlp.classes));
  } else {
    line.add("shape", fmt::format("d{} L{} T{} heads {} vocab {}", c.gpt.d_model, c.gpt.layers, c.gpt.seq, c.gpt.heads,
                                  c.gpt.vocab));
  }
  line.add("batch", c.batch).add("steps", steps).add("threads", c.threads).add("blas_threads", c.blas_threads);
  line.add("blas_kernels", blas::decision().core).add("blas_choice", blas::summary());
  line.add("repeats", runs);
  line.add("step_ms", step_ms);
  line.add("kernel_ms_per_step", kernel_ms);
  if (c.cores() == 1) line.add("overhead_ms_per_step", step_ms - kernel_ms);
  line.add("handshake_ms_per_step", handshake_ms);
  line.add("loss", r.loss);
  line.add("actors", r.actors);
  if (!results.empty()) {
    for (const auto& [ref, t] : results) {
      if (ref->name() == "pytorch") line.add("torch_version", ref->version());
    }
    line.add("reference_omp_wait_policy", results.front().second.omp_wait_policy);
    line.add("reference_openblas_threads", c.cores());
  }
  line.print();
  std::string ref_note;
  for (const auto& [ref, t] : results) {
    ref_note += fmt::format(" | {} {:.0f} samples/s ({:.3f} ms/step, loss {:.4f}), ratio {}", ref->name(),
                            t.samples_per_s, t.step_ms, t.loss, bench::ratio_note(rate / t.samples_per_s));
  }
  fmt::print(stderr, "{}: baton {:.0f} samples/s ({} steps of {}, {:.3f} ms/step, kernels {:.3f} ms, handshakes {:.3f} ms, "
             "loss {:.4f}){}\n",
             c.name, rate, steps, c.batch, step_ms, kernel_ms, handshake_ms, r.loss, ref_note);
  std::vector<std::pair<double, std::string>> ops;
  for (const auto& [op, s] : r.kernel_s_by_op) ops.emplace_back(s, op);
  std::sort(ops.rbegin(), ops.rend());
  std::string top;
  for (std::size_t i = 0; i < std::min<std::size_t>(ops.size(), 6); ++i) {
    top += fmt::format("{}{} {:.3f}", i ? ", " : "", ops[i].second, ops[i].first * 1e3 / static_cast<double>(steps));
  }
  fmt::print(stderr, "{}: kernel ms/step by op: {}\n", c.name, top);
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 1);
  const Options opt = parse(argc, argv);
  const auto t0 = Clock::now();
  (void)baton::ns_per_tick();  // its one-off calibration, outside every measurement
  std::vector<Reference> refs;
  if (opt.libtorch) refs.push_back(Reference::libtorch());
  if (opt.pytorch) refs.push_back(Reference::pytorch());
  for (const Reference& r : refs) {
    if (r.runs()) continue;
    fmt::print(stderr, "{}: the {} reference is missing: {}\n", prog, r.name(), r.missing());
    if (opt.require_reference) {
      return bench::skip(fmt::format("{} --reference {} --require-reference", prog, r.name()), r.missing());
    }
  }
  const std::vector<Case> cases = selected_cases(opt.only);
  const Data d = make_data(cases);
  std::vector<std::string> ref_names;
  for (const Reference& r : refs) {
    if (r.runs()) ref_names.push_back(r.name() == "pytorch" ? "PyTorch " + r.version() : std::string("LibTorch"));
  }
  fmt::print(stderr, "{}: {} mode, {} hardware threads, best of {} runs of ~{:.2f} s per side per case{}\n", prog,
             opt.quick ? "quick" : "full", std::thread::hardware_concurrency(), opt.quick ? 1 : repeats,
             opt.quick ? target_run_s * quick_factor : target_run_s,
             ref_names.empty() ? std::string() : fmt::format(", references: {}", fmt::join(ref_names, ", ")));
  int failed = 0;
  for (const auto& c : cases) {
    bench::load().set_own_threads(c.cores());
    try {
      bench_case(c, opt, d, refs);
    } catch (const std::exception& e) {
      fmt::print(stderr, "{}: case {} failed: {}\n", prog, c.name, e.what());
      ++failed;
    }
  }
  fmt::print(stderr, "{}: done in {:.1f} s{}\n", prog, seconds_since(t0),
             failed ? fmt::format(", {} case(s) failed", failed) : std::string());
  return failed ? 1 : 0;
}
