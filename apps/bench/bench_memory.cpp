// baton-bench-memory: what a training job keeps in memory (step 9, #16), from the plan and as
// measured, against the ZeRO paper's formula and against PyTorch.
//
// The model throughout is the GPT of `baton-train --model gpt` (4 heads, 4 layers, T 128, the
// characters of Debian's GPL-3 text as vocabulary, Adam, f32), at d_model D.
//
// model_state_zero{Z}_dp{N} (the plan alone): at D 256 with dp N replicas and ZeRO stage Z, the
// bytes of model state on replica 0's device by the plan (plan_memory.h: the accounting of
// --print-memory):
//   weights          the step registers the micro-batches read, and, without ZeRO, each
//                    variable actor's master copy (with ZeRO each shard's output register)
//   gradients        the weights' gradient buffers: each weight's gradient as the backward
//                    pass writes it (dW) and, with several micro-batches, their sum ("grad.W";
//                    with one, a view of dW), the bucket it is packed into, and the all-reduce's
//                    or reduce-scatter's registers (every register named "grad.*"), and kernel
//                    scratch
//   optimizer_state  Adam's two slots
// against the ZeRO paper's formula for f32 training with Adam (Rajbhandari et al. 2020, section
// 5, with K = 8: exp_avg and exp_avg_sq; the f32 weights are the master): psi x (4 + 4 + 8) for
// plain dp, 4 + 4 + 8/N for stage 1, 4 + (4 + 8)/N for stage 2. "of_formula" is the plan's
// bytes over the formula's: what baton spends beyond what the algorithm needs.
//
// act_mem_per_sample_gpt_d{D} (measured): the activation memory per sample as step 9 defines it,
// the slope of the peak resident memory of a whole training process between batch 4 and batch 16
// (ru_maxrss of the child, from wait4; what does not grow with the batch, the program, the
// weights, Adam's state, cancels). Each side runs 2 training steps in a process of its own, one
// thread: `baton-train --threads 1 --no-eval` (no held-out evaluation after training, so the
// peak is training's) and PyTorch 1.13 eager on the same model (apps/bench/gpt_torch.py --device
// cpu --threads 1: the same layers, the same parameter count, checked). "value" is baton's MiB
// per sample, "reference" PyTorch's, "ratio" PyTorch's over baton's: how many times less baton
// keeps (above 1: baton keeps less; step 9's goal: >= 1.0); "full_recompute" baton's with
// --recompute full ("ratio_full_recompute", likewise: goal >= 1 / 0.35, about 2.9), from
// batch 16 to 64, one run each: with full recomputation the training needs so little that at
// batch 4 and 16 the process's peak is set before training starts (the heap the set-up used,
// freed and reused by the arena), and the slope from 4 to 16 would be about 0, flattering it.
// "plan" is the slope of the plan's peak for the same device (the register bytes --print-memory
// adds up). Each other peak is the median of --repeats runs (baton's vary by under 0.1 MB from
// run to run, PyTorch's by up to 20 MB: its allocator's caching).
//
// max_batch_gpt_d256_{M}MiB (measured by trying): the largest batch whose training process
// stays within M MiB of peak resident memory, for baton, baton with full recomputation, and
// PyTorch; a first guess from the slopes above, then runs bracket and bisect it. The whole
// process counts on both sides (a CPU "device" is the process's memory), so the fixed part
// (PyTorch's library is larger than baton's) enters this figure, unlike the slope.
//
// recompute_throughput_gpt_d256: samples/s of baton at batch 16 without recomputation,
// selective and full (steps 2 to 6 of a 6-step run: the 6-step run's training time less the
// 2-step run's), and the ratios: the throughput recomputation keeps (below 1: what it costs).
//
// Without a python3 that imports torch the smoke run (--quick) prints baton's figures, then
// exits 77 (a skip; under CI=true a failure, skip.h).
//
// Flags: --plan-only (the model-state lines only), --quick (D 128 only, one run each, no
// max-batch or throughput lines: the ctest smoke), --sizes 128,256,384, --repeats N,
// --budget-mib M (0: no max-batch lines), --allow-load. Environment: BATON_PYTHON (default
// /usr/bin/python3, Debian's, with python3-torch), BATON_GPT_TORCH (the reference script).
// Without a python3 that imports torch the PyTorch figures are left out, and the lines say why.
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/actors/plan_memory.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "capture.h"
#include "json_line.h"
#include "models.h"
#include "skip.h"
#include "spawn.h"

using namespace baton;

namespace {

constexpr const char* corpus = "/usr/share/common-licenses/GPL-3";  // Debian's base-files
constexpr std::int64_t seq = 128, heads = 4, layers = 4;
constexpr double mib = 1024.0 * 1024.0;

models::GptShape gpt_shape(const data::TextCorpus& text, std::int64_t d) {
  return {.vocab = text.vocab_size(), .seq = seq, .d_model = d, .heads = heads, .layers = layers};
}

TrainConfig text_config(const std::shared_ptr<const data::TextCorpus>& text, std::int64_t batch, int dp) {
  TrainConfig cfg;
  cfg.steps = 2;
  cfg.dp = dp;
  cfg.optimizer = optim::adam(1e-3);
  cfg.data = {{"text", data::text_source(text, batch * dp, dp, seq, 1), {"tokens", "targets"}}};
  return cfg;
}

// ---------------------------------------------------------------------------------------------
// Model state by the plan

struct ModelState {
  std::int64_t params = 0, weights = 0, gradients = 0, optimizer_state = 0;
  std::int64_t total() const { return weights + gradients + optimizer_state; }
};

/// Replica 0's device: the replicas are devices of one process, or with `ranks` each on a rank of
/// its own (the plan as rank 0 runs it, its transfers in).
ModelState model_state(const std::shared_ptr<const data::TextCorpus>& text, int dp, int zero, bool ranks) {
  const std::int64_t batch = 4;  // per replica; model state does not depend on it
  Graph g(1);
  auto out = models::gpt_with_loss(g, batch, gpt_shape(*text, 256));
  TrainConfig cfg = text_config(text, batch, dp);
  cfg.zero = zero;
  for (int r = 0; ranks && r < dp; ++r) cfg.replica_places.push_back({.rank = static_cast<std::uint16_t>(r)});
  TrainingJob job = compile_training(g, out.loss, cfg);
  if (ranks) job.plan = insert_transfers(job.plan);
  ModelState s;
  for (const auto& [name, t] : job.params->values()) s.params += t.numel();
  const DeviceMemory m = memory_report(job.plan).at(0);  // replica 0's device
  s.weights = m.bytes[static_cast<std::size_t>(MemoryCategory::weights)];
  s.optimizer_state = m.bytes[static_cast<std::size_t>(MemoryCategory::optimizer_state)];
  // The registers of the weights' gradients: every "grad.*" one, and what each weight's
  // accumulation (or, with one micro-batch, its view) reads: the backward op's output, dW itself.
  std::set<RegisterIndex> grads;
  for (RegisterIndex i = 0; i < job.plan.registers.size(); ++i) {
    if (job.plan.registers[i].name.starts_with("grad.")) grads.insert(i);
  }
  for (const ActorDesc& a : job.plan.actors) {
    if (a.name.starts_with("grad.") && (a.kind == ActorKind::accumulate || a.kind == ActorKind::repeat))
      grads.insert(a.inputs.at(0).reg);
  }
  for (RegisterIndex i : grads) {
    const RegisterDesc& r = job.plan.registers[i];
    const RegisterMemory rm = register_memory(job.plan, i);
    if (!rm.allocated || rm.rank != m.rank || rm.device != m.device) continue;
    s.gradients += slot_bytes(r) * r.slots;
  }
  for (const ActorDesc& a : job.plan.actors) {
    if (a.where.rank != m.rank || a.where.device != m.device) continue;
    for (const KeptBytes& k : a.kept) s.gradients += k.category == MemoryCategory::gradients ? k.bytes : 0;
  }
  return s;
}

double formula(std::int64_t params, int dp, int zero) {
  const double psi = static_cast<double>(params);
  const double n = dp;
  if (zero == 0) return psi * (4 + 4 + 8);
  if (zero == 1) return psi * (4 + 4 + 8 / n);
  if (zero == 2) return psi * (4 + (4 + 8) / n);
  return psi * (4 + 4 + 8) / n;
}

void print_model_state(const std::shared_ptr<const data::TextCorpus>& text) {
  for (bool ranks : {false, true}) {
  for (int dp : {2, 4}) {
    const ModelState plain = model_state(text, dp, 0, ranks);
    for (int zero : {0, 1, 2, 3}) {
      const ModelState s = zero == 0 ? plain : model_state(text, dp, zero, ranks);
      const double f = formula(s.params, dp, zero);
      bench::JsonLine line("memory", fmt::format("model_state_zero{}_dp{}{}", zero, dp, ranks ? "_ranks" : ""));
      // The plan's bytes, not a measurement: "of_formula" and "of_plain_dp" are fractions of
      // those figures (lower is better, as for "value"), which no load changes.
      line.add("value", s.total())
          .add("unit", "bytes per rank (plan)")
          .better(bench::Better::lower)
          .add("params", s.params)
          .add("weights", s.weights)
          .add("gradients", s.gradients)
          .add("optimizer_state", s.optimizer_state)
          .add("formula", f)
          .add("of_formula", static_cast<double>(s.total()) / f)
          .add("of_plain_dp", static_cast<double>(s.total()) / static_cast<double>(plain.total()))
          .print();
    }
  }
  }
}

/// The plan's peak on the one device of a single-device job at this batch, and its parameters.
std::pair<std::int64_t, std::int64_t> plan_peak(const std::shared_ptr<const data::TextCorpus>& text, std::int64_t d,
                                                std::int64_t batch) {
  Graph g(1);
  auto out = models::gpt_with_loss(g, batch, gpt_shape(*text, d));
  TrainingJob job = compile_training(g, out.loss, text_config(text, batch, 1));
  std::int64_t params = 0;
  for (const auto& [name, t] : job.params->values()) params += t.numel();
  return {memory_report(job.plan).at(0).total(), params};
}

// ---------------------------------------------------------------------------------------------
// Measured: training processes and their peak resident memory

struct Run {
  std::int64_t peak_bytes = 0;  // ru_maxrss
  double wall_s = 0;            // baton: the runtime's training time (its JSON line's wall_s)
};

class Processes {
 public:
  Processes(std::string baton_train, int repeats) : baton_train_(std::move(baton_train)), repeats_(repeats) {
    const std::string python = bench::reference_python();
    auto [status, out] = bench::run_capture(
        fmt::format("timeout 120 {} -c 'import torch; print(torch.__version__)' 2>&1", bench::shell_quote(python)));
    if (status != 0) {
      torch_missing_ = fmt::format("{} cannot import torch: {} (apt-get install python3-torch, or set BATON_PYTHON)",
                                   python, bench::trim(out));
      return;
    }
    torch_version_ = bench::trim(out);
    const std::string script = bench::find_reference_script("BATON_GPT_TORCH", "gpt_torch.py", torch_missing_);
    if (!script.empty()) torch_ = {python, script};
  }

  bool has_torch() const { return !torch_.empty(); }
  const std::string& torch_missing() const { return torch_missing_; }
  const std::string& torch_version() const { return torch_version_; }

  /// baton-train on the GPT at d_model `d`, one thread, `steps` steps; the median of `repeats`.
  Run baton(std::int64_t d, std::int64_t batch, const std::string& recompute, int steps = 2, int repeats = 0) const {
    std::vector<std::string> argv{baton_train_, "--model", "gpt", "--data", fmt::format("text:{}", corpus),
                                  "--d-model", std::to_string(d), "--heads", std::to_string(heads), "--layers",
                                  std::to_string(layers), "--seq", std::to_string(seq), "--batch",
                                  std::to_string(batch), "--steps", std::to_string(steps), "--optimizer", "adam",
                                  "--lr", "1e-3", "--threads", "1", "--recompute", recompute, "--no-eval", "--json"};
    return median(argv, repeats, [](const std::string& out) {
      const auto wall = bench::json_number(bench::last_json_line(out), "wall_s");
      if (!wall) throw std::runtime_error("baton-train printed no result line: " + bench::trim(out));
      return *wall;
    });
  }

  /// gpt_torch.py on the same model: 1 warm-up step and 1 timed, as baton's 2 steps.
  Run torch(std::int64_t d, std::int64_t vocab, std::int64_t batch, int repeats = 0) const {
    std::vector<std::string> argv{torch_[0], torch_[1], "--device", "cpu", "--threads", "1", "--d-model",
                                  std::to_string(d), "--heads", std::to_string(heads), "--layers",
                                  std::to_string(layers), "--seq", std::to_string(seq), "--vocab",
                                  std::to_string(vocab), "--batch", std::to_string(batch), "--warmup", "1",
                                  "--steps", "1"};
    return median(argv, repeats, [](const std::string& out) {
      if (bench::last_json_line(out).empty()) throw std::runtime_error("gpt_torch.py printed no result line: " + out);
      return 0.0;
    });
  }

  /// gpt_torch.py's parameter count for the model at d_model `d`.
  std::int64_t torch_params(std::int64_t d, std::int64_t vocab) const {
    std::vector<std::string> argv{torch_[0], torch_[1], "--count-only", "--d-model", std::to_string(d), "--heads",
                                  std::to_string(heads), "--layers", std::to_string(layers), "--seq",
                                  std::to_string(seq), "--vocab", std::to_string(vocab)};
    const auto [code, out] = bench::finish(bench::spawn(argv, {}, true), bench::Clock::now() + std::chrono::minutes(2));
    const auto n = bench::json_number(bench::last_json_line(out), "params");
    if (code != 0 || !n) throw std::runtime_error(fmt::format("gpt_torch.py --count-only failed ({}): {}", code, out));
    return static_cast<std::int64_t>(*n);
  }

 private:
  Run once(const std::vector<std::string>& argv, const std::function<double(const std::string&)>& wall) const {
    rusage ru{};
    const auto [code, out] = bench::finish(bench::spawn(argv, {{"BATON_BENCH_CHILD", "1"}}, true),
                                           bench::Clock::now() + std::chrono::minutes(5), &ru);
    if (code != 0) throw std::runtime_error(fmt::format("'{}' exited {}: {}", fmt::join(argv, " "), code, out));
    return {static_cast<std::int64_t>(ru.ru_maxrss) * 1024, wall(out)};
  }
  Run median(const std::vector<std::string>& argv, int repeats,
             const std::function<double(const std::string&)>& wall) const {
    std::vector<Run> runs;
    for (int i = 0; i < (repeats > 0 ? repeats : repeats_); ++i) runs.push_back(once(argv, wall));
    auto mid = [&](auto key) {
      std::vector<double> v;
      for (const Run& r : runs) v.push_back(static_cast<double>(key(r)));
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    return {static_cast<std::int64_t>(mid([](const Run& r) { return r.peak_bytes; })),
            mid([](const Run& r) { return r.wall_s; })};
  }

  std::string baton_train_;
  int repeats_ = 3;
  std::vector<std::string> torch_;  // {python, script}, or empty
  std::string torch_missing_, torch_version_;
};

constexpr std::int64_t small_batch = 4, large_batch = 16;
constexpr std::int64_t full_small_batch = 16, full_large_batch = 64;  // full recomputation's

/// MiB per sample between the two batches.
double slope(std::int64_t small, std::int64_t large) {
  return static_cast<double>(large - small) / static_cast<double>(large_batch - small_batch) / mib;
}

struct Slopes {
  double baton = 0, full = 0, torch = 0;
  std::int64_t baton_fixed = 0, full_fixed = 0, torch_fixed = 0;  // the fit's bytes at batch 0
};

Slopes act_mem_per_sample(const Processes& p, const std::shared_ptr<const data::TextCorpus>& text, std::int64_t d) {
  const std::int64_t vocab = text->vocab_size();
  const auto [plan_small, params] = plan_peak(text, d, small_batch);
  const std::int64_t plan_large = plan_peak(text, d, large_batch).first;
  const Run b4 = p.baton(d, small_batch, "none"), b16 = p.baton(d, large_batch, "none");
  const Run f16 = p.baton(d, full_small_batch, "full", 2, 1), f64 = p.baton(d, full_large_batch, "full", 2, 1);
  auto fixed = [](const Run& s, std::int64_t batch, double per_sample) {
    return s.peak_bytes - static_cast<std::int64_t>(per_sample * mib * static_cast<double>(batch));
  };
  Slopes s;
  s.baton = slope(b4.peak_bytes, b16.peak_bytes);
  s.full = static_cast<double>(f64.peak_bytes - f16.peak_bytes) /
           static_cast<double>(full_large_batch - full_small_batch) / mib;
  s.baton_fixed = fixed(b4, small_batch, s.baton);
  s.full_fixed = fixed(f16, full_small_batch, s.full);
  bench::JsonLine line("memory", fmt::format("act_mem_per_sample_gpt_d{}", d));
  line.add("value", s.baton)
      .add("unit", "MiB per sample (peak resident memory, slope from batch 4 to 16)")
      .better(bench::Better::lower)
      .add("params", params)
      .add("plan", slope(plan_small, plan_large))
      .add("full_recompute", s.full)
      .add("full_recompute_batches", fmt::format("{} to {}", full_small_batch, full_large_batch))
      .add("baton_peak_b4", b4.peak_bytes)
      .add("baton_peak_b16", b16.peak_bytes);
  if (p.has_torch()) {
    const std::int64_t torch_params = p.torch_params(d, vocab);
    if (torch_params != params) {
      throw std::runtime_error(fmt::format(
          "gpt_torch.py's model has {} parameters against baton's {} at d_model {}: it is not the same model", torch_params,
          params, d));
    }
    const Run t4 = p.torch(d, vocab, small_batch), t16 = p.torch(d, vocab, large_batch);
    s.torch = slope(t4.peak_bytes, t16.peak_bytes);
    s.torch_fixed = fixed(t4, small_batch, s.torch);
    line.add("reference", s.torch)
        .compare("ratio", s.baton, s.torch)
        .compare("ratio_full_recompute", s.full, s.torch)
        .add("pytorch_peak_b4", t4.peak_bytes)
        .add("pytorch_peak_b16", t16.peak_bytes)
        .add("torch", p.torch_version());
  } else {
    line.add("reference_missing", p.torch_missing());
  }
  line.print();
  return s;
}

/// The largest batch for which `peak(batch)` is at most `budget`, starting from `guess`: doubling
/// steps bracket it, then bisection (at most `tries` runs). 0 if batch 1 does not fit.
std::int64_t largest_fitting(std::int64_t budget, std::int64_t guess, const std::function<std::int64_t(std::int64_t)>& peak,
                             int& tries) {
  std::int64_t lo = 0, hi = -1;  // lo fits (0: none known), hi does not (-1: none known)
  const int limit = 12;
  auto fits = [&](std::int64_t b) {
    ++tries;
    return peak(b) <= budget;
  };
  std::int64_t b = std::max<std::int64_t>(1, guess);
  for (std::int64_t step = 1; tries < limit; step *= 2) {  // bracket
    if (fits(b)) {
      lo = b;
      if (hi >= 0) break;
      b = lo + step;
    } else {
      hi = b;
      if (b == 1 || lo > 0) break;
      b = std::max<std::int64_t>(1, hi - step);
    }
  }
  while (hi > lo + 1 && tries < limit) {  // bisect
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) lo = mid;
    else hi = mid;
  }
  return lo;
}

void max_batch(const Processes& p, const std::shared_ptr<const data::TextCorpus>& text, const Slopes& s,
               std::int64_t budget_mib) {
  const std::int64_t d = 256, budget = budget_mib * 1024 * 1024;
  auto guess = [&](double per_sample, std::int64_t fixed) {
    return per_sample > 0 ? static_cast<std::int64_t>(static_cast<double>(budget - fixed) / (per_sample * mib)) : 1;
  };
  int tries_baton = 0, tries_full = 0, tries_torch = 0;
  const std::int64_t baton = largest_fitting(
      budget, guess(s.baton, s.baton_fixed), [&](std::int64_t b) { return p.baton(d, b, "none", 2, 1).peak_bytes; },
      tries_baton);
  const std::int64_t full = largest_fitting(
      budget, guess(s.full, s.full_fixed), [&](std::int64_t b) { return p.baton(d, b, "full", 2, 1).peak_bytes; },
      tries_full);
  bench::JsonLine line("memory", fmt::format("max_batch_gpt_d{}_{}MiB", d, budget_mib));
  line.add("value", baton)
      .add("unit", fmt::format("samples (largest batch with peak resident memory <= {} MiB)", budget_mib))
      .better(bench::Better::higher)
      .add("full_recompute", full)
      .add("baton_runs", tries_baton + tries_full);
  if (p.has_torch()) {
    const std::int64_t vocab = text->vocab_size();
    const std::int64_t torch = largest_fitting(
        budget, guess(s.torch, s.torch_fixed), [&](std::int64_t b) { return p.torch(d, vocab, b, 1).peak_bytes; },
        tries_torch);
    line.add("reference", torch).add("pytorch_runs", tries_torch);
    if (torch > 0) {
      line.compare("ratio", static_cast<double>(baton), static_cast<double>(torch))
          .compare("ratio_full_recompute", static_cast<double>(full), static_cast<double>(torch));
    }
  } else {
    line.add("reference_missing", p.torch_missing());
  }
  line.print();
}

void recompute_throughput(const Processes& p) {
  const std::int64_t d = 256, batch = large_batch;
  const int short_steps = 2, long_steps = 6;
  auto rate = [&](const std::string& recompute) {
    const double t = p.baton(d, batch, recompute, long_steps).wall_s - p.baton(d, batch, recompute, short_steps).wall_s;
    return static_cast<double>((long_steps - short_steps) * batch) / t;
  };
  const double none = rate("none"), selective = rate("selective"), full = rate("full");
  bench::JsonLine("memory", fmt::format("recompute_throughput_gpt_d{}", d))
      .add("value", none)
      .add("unit", fmt::format("samples/s (batch {}, steps {} to {}, one thread)", batch, short_steps, long_steps))
      .better(bench::Better::higher)
      .add("selective", selective)
      .add("full", full)
      .compare("ratio_selective", selective, none)
      .compare("ratio_full", full, none)
      .print();
}

std::vector<std::int64_t> parse_sizes(const std::string& s) {
  std::vector<std::int64_t> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    const auto comma = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, comma - pos);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v <= 0 || v % heads != 0) {
      throw std::invalid_argument(
          fmt::format("--sizes: '{}' is not a positive d_model divisible by the {} heads", item, heads));
    }
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 1);
  bool plan_only = false, quick = false;
  std::vector<std::int64_t> sizes{128, 256, 384};
  int repeats = 3;
  std::int64_t budget_mib = 512;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
        return argv[++i];
      };
      if (a == "--plan-only") plan_only = true;
      else if (a == "--quick") quick = true;
      else if (a == "--sizes") sizes = parse_sizes(value());
      else if (a == "--repeats") repeats = std::max(1, std::stoi(value()));
      else if (a == "--budget-mib") budget_mib = std::stoll(value());
      else if (a == "-h" || a == "--help") {
        fmt::print(
            "usage: baton-bench-memory [--plan-only] [--quick] [--sizes 128,256,384] [--repeats 3] [--budget-mib 512]\n"
            "  --plan-only   the model-state lines only (the plan; no training process runs)\n"
            "  --quick       d_model 128 only, one run of each, no max-batch or throughput lines\n"
            "  --budget-mib  the peak resident memory of max_batch_gpt_d256 (0: no such line)\n{}",
            bench::allow_load_usage);
        return 0;
      } else {
        throw std::invalid_argument("unknown argument '" + a + "' (--help lists them)");
      }
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-bench-memory: {}\n", e.what());
    return 2;
  }
  if (!std::filesystem::exists(corpus)) {
    return bench::skip("baton-bench-memory", fmt::format("{} is missing (Debian's base-files); nothing measured", corpus));
  }
  const auto text = std::make_shared<const data::TextCorpus>(data::load_text(corpus));
  try {
    print_model_state(text);
    if (plan_only) return 0;
    if (quick) {
      sizes = {128};
      repeats = 1;
      budget_mib = 0;
    }
    const std::string baton_train = bench::executable_dir() + "/baton-train";
    if (!std::filesystem::exists(baton_train)) throw std::runtime_error(baton_train + " not found (build it first)");
    Processes p(baton_train, repeats);
    if (!p.has_torch()) fmt::print(stderr, "baton-bench-memory: no PyTorch figures: {}\n", p.torch_missing());
    std::optional<Slopes> at256;
    for (std::int64_t d : sizes) {
      const Slopes s = act_mem_per_sample(p, text, d);
      if (d == 256) at256 = s;
    }
    if (!quick) {
      if (budget_mib > 0) {
        if (!at256) at256 = act_mem_per_sample(p, text, 256);
        max_batch(p, text, *at256, budget_mib);
      }
      recompute_throughput(p);
    }
    // baton's figures are printed; the reference's absence is no pass.
    return p.has_torch() ? 0 : bench::skip("baton-bench-memory's PyTorch reference", p.torch_missing());
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-bench-memory: {}\n", e.what());
    return 1;
  }
}
