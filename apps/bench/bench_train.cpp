// baton-bench-train: training throughput of baton against PyTorch on the same models.
//
// Each case compiles a model written with the DSL (apps/train/models.h) into a training plan,
// exactly as baton-train does (compile_training + Runtime::run, Adam lr 1e-3, one micro-batch
// per step), trains it on synthetic data and prints one JSON line to stdout. The same model,
// batch, optimizer and thread count trained in PyTorch (apps/bench/torch_reference.py, run as a
// subprocess with /usr/bin/python3 and Debian's python3-torch) is the reference, measured in
// the same run; "ratio" = baton samples/s / PyTorch samples/s (above 1: baton is faster).
// Human-readable notes go to stderr.
//
//   baton-bench-train                       every case, best of 3 runs of ~1.5 s per side
//   baton-bench-train --quick               ~10x fewer steps
//   baton-bench-train --quick --no-reference  (the CTest smoke run: needs no PyTorch)
//   baton-bench-train --case gpt_small
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
#include "baton/actors.h"
#include "baton/graph.h"
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
  int threads = 1;
};

std::vector<Case> all_cases() {
  std::vector<Case> base{{"mlp_b64", "mlp", 64, 1}, {"mlp_b256", "mlp", 256, 1}, {"gpt_small", "gpt", 16, 1}};
  std::vector<Case> out = base;
  for (Case c : base) {
    c.name += "_2threads";
    c.threads = 2;
    out.push_back(c);
  }
  return out;
}

const models::GptShape gpt_shape{.vocab = 64, .seq = 32, .d_model = 64, .heads = 4, .layers = 2};
constexpr std::uint64_t seed = 1;
constexpr double lr = 1e-3;

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
  bool quick = false;
  bool reference = true;
  std::string only;  // run cases whose name starts with this
};

[[noreturn]] void usage(int code) {
  std::FILE* f = code == 0 ? stdout : stderr;
  std::vector<std::string> names;
  for (const auto& c : all_cases()) names.push_back(c.name);
  fmt::print(f,
             "usage: {} [--quick] [--no-reference] [--case NAME] [--help]\n"
             "  Trains each model with baton and with PyTorch (the reference) and prints one JSON\n"
             "  line per case to stdout.\n"
             "  --quick         ~10x fewer steps\n"
             "  --no-reference  skip PyTorch (no reference/ratio keys)\n"
             "  --case NAME     run only the cases whose name starts with NAME\n"
             "  cases: {}\n"
             "  environment: BATON_PYTHON (default /usr/bin/python3), BATON_TORCH_REFERENCE (the script)\n",
             prog, fmt::join(names, ", "));
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
      o.reference = false;
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
  bool any = false;
  for (const auto& c : all_cases()) any = any || c.name.starts_with(o.only);
  if (!any) {
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
// The PyTorch reference: a subprocess that prints one JSON line.

using bench::executable_dir;
using bench::json_number;
using bench::json_string;
using bench::run_capture;
using bench::shell_quote;
using bench::trim;

class Reference {
 public:
  /// Finds the interpreter and the script and checks that `import torch` works; if not,
  /// missing() says why (and the benchmark prints no reference keys).
  Reference() {
    if (const char* env = std::getenv("BATON_PYTHON"); env != nullptr && *env != '\0') {
      python_ = env;
    } else if (::access("/usr/bin/python3", X_OK) == 0) {
      python_ = "/usr/bin/python3";  // Debian's, where python3-torch lives (not a pyenv one)
    } else {
      python_ = "python3";
    }
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("BATON_TORCH_REFERENCE"); env != nullptr && *env != '\0') {
      candidates.emplace_back(env);
    }
#ifdef BATON_SOURCE_DIR
    candidates.emplace_back(std::string(BATON_SOURCE_DIR) + "/apps/bench/torch_reference.py");
#endif
    candidates.push_back(executable_dir() + "/../../apps/bench/torch_reference.py");
    candidates.emplace_back("apps/bench/torch_reference.py");
    for (const auto& c : candidates) {
      if (std::filesystem::exists(c)) {
        script_ = c;
        break;
      }
    }
    if (script_.empty()) {
      missing_ = fmt::format("torch_reference.py not found (looked in: {})", fmt::join(candidates, ", "));
      return;
    }
    auto [status, out] =
        run_capture(fmt::format("{} -c 'import torch; print(torch.__version__)' 2>&1", shell_quote(python_)));
    out = trim(out);
    if (status != 0) {
      auto nl = out.rfind('\n');
      std::string last = nl == std::string::npos ? out : out.substr(nl + 1);
      missing_ = fmt::format("{} cannot import torch: {}", python_, last.empty() ? "exit status " + std::to_string(status) : last);
      return;
    }
    version_ = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
  }

  const std::string& missing() const { return missing_; }
  const std::string& version() const { return version_; }

  struct Result {
    double samples_per_s = 0;
    double step_ms = 0;
    double loss = 0;
    std::string omp_wait_policy;
  };

  /// Trains the case in PyTorch for `steps` steps (after `warmup` untimed ones), the best of
  /// `repeats` timed runs.
  Result run(const Case& c, std::int64_t steps, std::int64_t warmup, int repeats) const {
    const std::string cmd = fmt::format(
        "{} {} --case {} --steps {} --threads {} --batch {} --warmup {} --lr {} --seed {} --repeats {}",
        shell_quote(python_), shell_quote(script_), c.name, steps, c.threads, c.batch, warmup, lr, seed, repeats);
    auto [status, out] = run_capture(cmd);
    if (status != 0) throw std::runtime_error(fmt::format("'{}' failed (status {})", cmd, status));
    const std::string line = bench::last_json_line(out);
    auto rate = json_number(line, "samples_per_s");
    auto step_ms = json_number(line, "step_ms");
    auto loss = json_number(line, "loss");
    if (!rate || !step_ms || !loss) {
      throw std::runtime_error(fmt::format("'{}' printed no result line: {}", cmd, trim(out)));
    }
    return {*rate, *step_ms, *loss, json_string(line, "omp_wait_policy").value_or("")};
  }

 private:
  std::string python_, script_, version_, missing_;
};

// ---------------------------------------------------------------------------------------------
// baton

struct Data {
  std::shared_ptr<const data::Dataset> synthetic;  // the MLP's labelled rows
  std::shared_ptr<const data::TextCorpus> text;    // uniformly random tokens for the GPT
};

Data make_data() {
  Data d;
  // As baton-train --data synthetic: 4096 rows, 64 features, 10 classes, 80% for training.
  auto [train, heldout] = data::split(data::synthetic(4096, 64, 10, seed), 0.2, seed);
  d.synthetic = std::make_shared<const data::Dataset>(std::move(train));
  // A corpus of 64 Ki characters drawn uniformly from 64 symbols, built in memory.
  data::TextCorpus text;
  text.path = "<synthetic>";
  for (int i = 0; i < gpt_shape.vocab; ++i) text.vocab.push_back(static_cast<unsigned char>('0' + i));
  std::mt19937_64 gen(seed);
  text.ids.resize(std::size_t{1} << 16);
  for (auto& id : text.ids) id = static_cast<std::int32_t>(gen() % static_cast<std::uint64_t>(gpt_shape.vocab));
  d.text = std::make_shared<const data::TextCorpus>(std::move(text));
  return d;
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
  Value logits = gpt ? models::gpt(g, c.batch, gpt_shape) : models::mlp(g, c.batch, models::MlpShape{});
  Value loss = softmax_cross_entropy(logits, g.find(gpt ? "targets" : "label")).named("loss");
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = 1;
  cfg.optimizer = optim::adam(lr);
  cfg.threads = c.threads;
  if (gpt) {
    cfg.data = {{"text", data::text_source(d.text, c.batch, 1, gpt_shape.seq, seed), {"tokens", "targets"}}};
  } else {
    cfg.data = {{"synthetic", data::batch_source(d.synthetic, c.batch, 1, seed), {"x", "label"}}};
  }
  TrainingJob job = compile_training(g, loss, cfg);
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
constexpr std::int64_t calibration_steps = 20;
constexpr std::int64_t min_steps = 20;
constexpr std::int64_t max_steps = 1'000'000;
/// Measured runs per side (each from fresh weights); the fastest counts. The machine is shared,
/// so a single run can be slowed by a neighbour.
constexpr int repeats = 3;

void bench_case(const Case& c, const Options& o, const Data& d, const Reference* ref) {
  // Calibrate (also warms caches and the allocator), then the measured run from fresh weights.
  const double target_s = o.quick ? target_run_s * quick_factor : target_run_s;
  const BatonResult calib = run_baton(c, calibration_steps, d);
  const double per_step = calib.wall_s / static_cast<double>(calibration_steps);
  const auto steps = std::clamp<std::int64_t>(static_cast<std::int64_t>(std::ceil(target_s / per_step)),
                                              o.quick ? std::int64_t{5} : min_steps, max_steps);
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

  std::optional<Reference::Result> t;
  if (ref != nullptr && ref->missing().empty()) t = ref->run(c, steps, o.quick ? 2 : 5, runs);
  JsonLine line(c.name);
  line.add("value", rate).add("unit", "samples/s");
  if (t) line.add("reference", t->samples_per_s).add("ratio", rate / t->samples_per_s);
  line.add("batch", c.batch).add("steps", steps).add("threads", c.threads).add("repeats", runs);
  line.add("step_ms", step_ms);
  if (t) line.add("reference_step_ms", t->step_ms);
  line.add("kernel_ms_per_step", kernel_ms);
  if (c.threads == 1) line.add("overhead_ms_per_step", step_ms - kernel_ms);
  line.add("handshake_ms_per_step", handshake_ms);
  line.add("loss", r.loss);
  if (t) line.add("reference_loss", t->loss);
  line.add("actors", r.actors);
  if (t) line.add("torch_version", ref->version()).add("reference_omp_wait_policy", t->omp_wait_policy);
  if (ref != nullptr && !ref->missing().empty()) line.add("reference_missing", ref->missing());
  std::string ref_note;
  if (t) {
    ref_note = fmt::format(" | torch {:.0f} samples/s ({:.3f} ms/step, loss {:.4f}), ratio {:.2f}", t->samples_per_s,
                           t->step_ms, t->loss, rate / t->samples_per_s);
  }
  line.print();
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
  const Options opt = parse(argc, argv);
  const auto t0 = Clock::now();
  (void)baton::ns_per_tick();  // its one-off calibration, outside every measurement
  const Data d = make_data();
  std::optional<Reference> ref;
  if (opt.reference) {
    ref.emplace();
    if (!ref->missing().empty()) {
      fmt::print(stderr,
                 "{}: the PyTorch reference is missing: {}\n"
                 "  install it with: apt-get install -y python3 python3-torch (Debian 12; scripts/run.sh bench train "
                 "does this)\n"
                 "  or point BATON_PYTHON at a python3 that has torch; running without reference keys\n",
                 prog, ref->missing());
    }
  }
  fmt::print(stderr, "{}: {} mode, {} hardware threads, best of {} runs of ~{:.2f} s per side per case{}\n", prog,
             opt.quick ? "quick" : "full", std::thread::hardware_concurrency(), opt.quick ? 1 : repeats,
             opt.quick ? target_run_s * quick_factor : target_run_s,
             ref && ref->missing().empty() ? fmt::format(", reference: PyTorch {}", ref->version()) : std::string());
  int failed = 0;
  for (const auto& c : all_cases()) {
    if (!c.name.starts_with(opt.only)) continue;
    try {
      bench_case(c, opt, d, ref ? &*ref : nullptr);
    } catch (const std::exception& e) {
      fmt::print(stderr, "{}: case {} failed: {}\n", prog, c.name, e.what());
      ++failed;
    }
  }
  fmt::print(stderr, "{}: done in {:.1f} s{}\n", prog, seconds_since(t0),
             failed ? fmt::format(", {} case(s) failed", failed) : std::string());
  return failed ? 1 : 0;
}
