// baton-bench-parallel: what a pipeline's schedule costs. A balanced K-stage synthetic
// pipeline, built the way compile_training builds one (per stage a weight read by M
// micro-batches through a repeat, forward and backward actors, the M gradients accumulated and
// fed back to the weight with a delay of one step: synchronous training), with fixed-cost
// kernels that sleep (an accelerator's stream: they hold no core). Each stage is one device,
// one worker thread; its idle fraction is 1 - (time in its kernels) / (wall time), averaged
// over the stages. The reference is the bubble formula (K-1)/(M+K-1) (GPipe; 1F1B has the same
// bubble and fewer live activations). Also printed: the most activation slots ever in use, per
// schedule (gpipe gives stage s M slots, 1f1b K - s). Each case runs twice: on CPU devices (a
// worker per stage sleeps in its kernels) and on sim devices (`_sim`: the workers only enqueue,
// each stage's stream sleeps, copies move the registers between devices; what a GPU pipeline
// does). Then training throughput: the MLP and the
// small GPT on dp / pp / tp / hybrid against one device with the same micro-batching; the
// efficiency divides the speed-up by min(devices, cores); with dp, allreduce_overlap is the
// share of the time the gradients' all-reduces were under way that the backward pass ran
// beside them (from the activity log of a separate run). The `_bf16` and `_fp16` cases send the gradient
// sums in 16 bits (--grad-compression bf16 or fp16).
//
//   baton-bench-parallel            K in {2, 4}, M in {1, 4, 8, 16}, both schedules
//   baton-bench-parallel --quick    fewer steps (the CTest smoke run)
//   baton-bench-parallel --only bubble|train|balance|ddp
//   baton-bench-parallel --only hosts   baton-train --dp 2 and 4 over two network namespaces
//                                       (root), hierarchical and flat, against one process
//   baton-bench-parallel --no-reference leaves out the PyTorch DDP peer (the ddp case's)
// Then stage balancing: the GPT's stages cut by estimated multiply-adds against profiled
// kernel times (TrainConfig::balance). Last, data parallelism against the peer a user would
// pick for it: baton-train --dp 2 over two ranks on this host (baton-launch) against PyTorch
// DistributedDataParallel (gloo, two processes on 127.0.0.1; gpt_ddp_torch.py), on the same GPT
// (d 256, 4 layers, T 128), global batch 16, one thread a rank and OPENBLAS_NUM_THREADS=1 on both.
// BATON_BENCH_STAGES=1 in the environment: each run's per-stage idle fraction and actor table
// on stderr.
//
// Every ratio says how many times better the measured figure is than its reference (above 1:
// better; json_line.h): for the bubble the formula's idle fraction over the measured one. A case
// that cannot run (a job that fails, the GPT's text missing) fails the benchmark, naming it.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <vector>
#include <numeric>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <filesystem>
#include <thread>

#include "capture.h"
#include "json_line.h"
#include "netns.h"
#include "skip.h"
#include "spawn.h"
#include "models.h"
#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "../../tests/loopback_run.h"

namespace {

using namespace baton;
using bench::Better;

/// The text the GPT cases train on (Debian's base-files ships it).
constexpr const char* gpt_text = "/usr/share/common-licenses/GPL-3";

/// Whether the GPT's text is there; if not, says which cases cannot run (the caller fails them).
bool have_gpt_text(std::string_view cases) {
  if (std::filesystem::exists(gpt_text)) return true;
  fmt::print(stderr, "baton-bench-parallel: {} is missing (Debian's base-files): the {} cases cannot run\n", gpt_text,
             cases);
  return false;
}

struct Result {
  double idle = 0;
  std::int64_t peak_activations = 0;  // sum over stages of the most activation slots in use
  double wall_s = 0;
};

/// Per device, the nanoseconds its kernels spent sleeping (on the worker for a CPU device, on
/// the stream's thread for a sim device): what "busy" means for a device of sleeping kernels.
struct StageClock {
  std::vector<std::atomic<std::int64_t>> busy_ns;
  explicit StageClock(int k) : busy_ns(static_cast<std::size_t>(k)) {}
};

/// A pipeline's costs: each stage's forward, and its backward, split into B and W halves where
/// the schedule splits it (zb-h1, zb-v), divided over a device's stages (interleaved: each of v
/// chunks costs 1/v of a one-stage device's; zb-v: each of 2 half).
struct PassCosts {
  std::int64_t forward_ns = 0, backward_ns = 0;
  int chunks = 1;
  bool split = false;
  std::int64_t ns(std::int64_t pass) const {
    const std::int64_t total = pass == 0 ? forward_ns : split ? backward_ns / 2 : backward_ns;
    return total / chunks;
  }
};

/// "bench.sleep": sleeps its pass's cost (attributes "stage", "pass": 0 F, 1 B, 2 W) and books
/// the time it really slept to its stage's device; copies its first input to its output.
void add_timed_sleep(KernelRegistry& reg, StageClock& clock, PassCosts costs, PipelineSchedule sch, int k) {
  reg.add("bench.sleep", DeviceType::cpu, DType::f32,
          [&clock, costs, sch, k](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
            struct Sleep final : Kernel {
              std::int64_t ns;
              std::atomic<std::int64_t>* busy;
              void compute(KernelContext& ctx) override {
                const auto t0 = std::chrono::steady_clock::now();
                std::this_thread::sleep_for(std::chrono::nanoseconds(ns));
                busy->fetch_add(
                    std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                    std::memory_order_relaxed);
                if (!ctx.outputs.empty() && !ctx.inputs.empty() && ctx.inputs[0] != nullptr) {
                  std::memcpy(ctx.outputs[0]->raw(), ctx.inputs[0]->raw(), ctx.outputs[0]->nbytes());
                }
              }
            };
            auto s = std::make_unique<Sleep>();
            s->ns = costs.ns(cfg.attrs.get_int("pass", 0));
            const int stage = static_cast<int>(cfg.attrs.get_int("stage", 0));
            s->busy = &clock.busy_ns.at(static_cast<std::size_t>(device_of_stage(sch, k, stage)));
            return s;
          });
}

/// The pipeline on `type` devices: cpu (a worker per device runs its kernels) or sim (each
/// device's kernels run on its stream, the worker only enqueues: an accelerator). The plan is
/// pipeline_skeleton's (schedule.h): built the way compile_training builds one, ordered by the
/// schedule, its registers as deep as the schedule says.
Result run(int k, int m, const std::string& schedule, int v, int steps, std::int64_t fwd_ns, std::int64_t bwd_ns,
           DeviceType type = DeviceType::cpu) {
  const PipelineSchedule sch = parse_schedule(schedule);
  Plan p = pipeline_skeleton(sch, k, m, v, {.op = "bench.sleep", .device = type, .steps = steps});
  StageClock clock(k);
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  add_timed_sleep(kernels, clock,
                  {.forward_ns = fwd_ns, .backward_ns = bwd_ns, .chunks = chunks_per_device(sch, v),
                   .split = splits_backward(sch)},
                  sch, k);
  Runtime rt(insert_device_copies(p), kernels);
  RunReport report = rt.run();
  Result r;
  r.wall_s = report.wall_s;
  double idle = 0;
  for (int s = 0; s < k; ++s) {
    const double kernel = static_cast<double>(clock.busy_ns[static_cast<std::size_t>(s)].load()) * 1e-9;
    idle += 1.0 - kernel / report.wall_s;
    if (std::getenv("BATON_BENCH_STAGES")) fmt::print(stderr, "  device {} idle {:.3f}\n", s, 1.0 - kernel / report.wall_s);
  }
  if (std::getenv("BATON_BENCH_STAGES")) fmt::print(stderr, "{}", report.metrics.table());
  r.idle = idle / k;
  for (const auto& reg_metrics : report.metrics.registers) {
    // The stages' own activation registers (not the device copies of them, "act<s>@sim:<t>").
    if (reg_metrics.name.rfind("act", 0) == 0 && reg_metrics.name.find('@') == std::string::npos) {
      r.peak_activations += reg_metrics.max_outstanding;
    }
  }
  return r;
}

// What the schedule keeps live at its peak, summed over the stages' activation registers, on
// its own timeline (analyse_schedule's forward_held: until the last of its readers, the next
// stage's W among them): M a stage for GPipe, min(K - s, M) on stage s for 1F1B. Interleaved's
// chunks each hold 1/v of a stage's activations; its figure counts chunk activations, and the
// _1f1b figure beside it stage activations.
std::int64_t expected_peak(int k, int m, const std::string& schedule, int v) {
  // 2bw without a flush: stage s holds its w + 1 = min(K - s, M + 1) across step boundaries.
  if (schedule == "2bw") {
    std::int64_t sum = 0;
    for (int s = 0; s < k; ++s) sum += std::min(k - s, m + 1);
    return sum;
  }
  const ScheduleAnalysis a = analyse_schedule(parse_schedule(schedule), k, m, v);
  std::int64_t sum = 0;
  for (std::int32_t d : a.forward_held) sum += d;
  return sum;
}

// --- training throughput: the same model and global batch on 1 device and on dp x pp x tp ---

struct Training {
  std::string model;
  int dp = 1, pp = 1, tp = 1;
  std::int64_t microbatches = 1;  // per replica
  std::string balance = "flops";
  std::string grad_compression = "none";
  std::string sync = "allreduce";  // or "ps": parameter servers
  int servers = 1, staleness = 0;
  std::string schedule = "1f1b";
};

/// Kernel seconds of each device (a pipeline stage, without dp or tp) in the last run.
std::vector<double> g_device_kernel_s;

/// `one_thread`: every actor on the calling thread (ExecutionMode::deterministic), so that
/// kernel times are free of other threads' competition for the cores.
/// `overlap`: with the activity log on, what share of the time the gradients' all-reduces were
/// under way the backward pass ran beside them (collective_overlap, activity.h).
/// The training case compiled: the MLP (or the GPT) of `batch` samples a step over its layout;
/// `replica_places` / `server_places` put it on ranks (empty: in-process devices).
TrainingJob compile_case(const Training& t, std::int64_t steps, std::int64_t batch,
                         std::vector<Placement> replica_places = {}, std::vector<Placement> server_places = {}) {
  static const auto synthetic = std::make_shared<const data::Dataset>(data::synthetic(4096, 64, 10, 1));
  static const auto text = std::filesystem::exists(gpt_text)
                               ? std::make_shared<const data::TextCorpus>(data::load_text(gpt_text))
                               : nullptr;
  const bool gpt = t.model == "gpt";
  const std::int64_t pieces = t.dp * t.microbatches;
  Graph g(1);
  Value logits = gpt ? models::gpt(g, batch / pieces,
                                   {.vocab = text->vocab_size(), .seq = 32, .d_model = 64, .heads = 4, .layers = 2, .tp = t.tp})
                     : models::mlp(g, batch / pieces, {.inputs = 64, .hidden = 256, .layers = 2, .classes = 10, .tp = t.tp});
  Value loss = softmax_cross_entropy(logits, g.find(gpt ? "targets" : "label"));
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = t.microbatches;
  cfg.dp = t.dp;
  cfg.pp = t.pp;
  cfg.tp = t.tp;
  cfg.balance = t.balance;
  cfg.schedule = t.schedule;
  cfg.grad_compression = t.grad_compression;
  cfg.sync = t.sync;
  cfg.servers = t.servers;
  cfg.staleness = t.staleness;
  cfg.replica_places = std::move(replica_places);
  cfg.server_places = std::move(server_places);
  cfg.optimizer = optim::adam(1e-3);
  if (gpt) {
    cfg.data = {{"text", data::text_source(text, batch, pieces, 32, 1), {"tokens", "targets"}}};
  } else {
    cfg.data = {{"synthetic", data::batch_source(synthetic, batch, pieces, 1), {"x", "label"}}};
  }
  return compile_training(g, loss, cfg);
}

double samples_per_s(const Training& t, std::int64_t steps, std::int64_t batch, bool one_thread = false,
                     CollectiveOverlap* overlap = nullptr) {
  TrainingJob job = compile_case(t, steps, batch);
  RuntimeSettings rs;
  if (one_thread) rs.mode = ExecutionMode::deterministic;
  rs.activity_log = overlap != nullptr;
  Runtime rt(job.plan, job.kernels, rs);
  RunReport report = rt.run();
  if (overlap != nullptr) {
    std::vector<ActRecord> acts;
    rt.drain_activity(acts);
    if (rt.activity_dropped() > 0) {
      throw std::runtime_error(fmt::format("the activity log dropped {} records: fewer steps", rt.activity_dropped()));
    }
    *overlap = collective_overlap(job.plan, acts);
  }
  g_device_kernel_s.assign(static_cast<std::size_t>(t.dp * t.pp * t.tp + (t.sync == "ps" ? t.servers : 0)), 0.0);
  for (const auto& a : report.metrics.actors) g_device_kernel_s.at(a.where.device.index) += a.kernel_s;
  return static_cast<double>(steps * batch) / report.wall_s;
}

// Stage balancing: the GPT cut by estimated multiply-adds and by profiled kernel times, on 2
// and 4 stages (1F1B, 8 micro-batches). The figure that survives a noisy machine is the
// imbalance: the busiest stage's kernel time over the mean stage's, forward and backward, from
// a run on one thread (1: perfect; a pipeline runs at the pace of its busiest stage), against
// the flops cut's; then samples/s, threaded, against the flops cut's measured in the same run.
/// Returns the cases that failed.
int stage_balance(bool quick) {
  if (!have_gpt_text("balance_gpt_*")) return 1;
  const std::int64_t batch = 32, steps = quick ? 4 : 20;
  for (int pp : {2, 4}) {
    double flops_rate = 0, flops_imbalance = 0;
    for (const std::string balance : {"flops", "profile"}) {
      const Training t{"gpt", 1, pp, 1, 8, balance};
      samples_per_s(t, steps, batch, /*one_thread=*/true);
      const auto& k = g_device_kernel_s;
      const double imbalance =
          *std::max_element(k.begin(), k.end()) / (std::accumulate(k.begin(), k.end(), 0.0) / static_cast<double>(k.size()));
      double rate = 0;
      for (int i = 0; i < (quick ? 1 : 3); ++i) rate = std::max(rate, samples_per_s(t, steps, batch));
      if (balance == "flops") {
        flops_rate = rate;
        flops_imbalance = imbalance;
      }
      bench::JsonLine line("parallel", fmt::format("balance_gpt_pp{}_{}", pp, balance));
      line.add("value", imbalance).add("unit", "busiest stage / mean stage kernel time").better(Better::lower)
          .add("reference", flops_imbalance).add("reference_name", "the same with the flops cut")
          .compare("ratio", imbalance, flops_imbalance).add("samples_per_s", rate)
          .add("reference_samples_per_s", flops_rate).compare("samples_per_s_ratio", rate, flops_rate, Better::higher)
          .add("microbatches", std::int64_t{8}).add("batch", batch);
      line.print();
    }
  }
  return 0;
}

/// Returns the cases that failed.
int training_scaling(bool quick) {
  int failed = 0;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  for (const std::string model : {"mlp", "gpt"}) {
    if (model == "gpt" && !have_gpt_text("train_gpt_*")) {
      ++failed;
      continue;
    }
    const std::int64_t batch = model == "mlp" ? 256 : 16;
    const std::int64_t steps = (model == "mlp" ? 300 : 40) / (quick ? 10 : 1);
    auto best = [&](const Training& t) {
      double r = 0;
      for (int i = 0; i < (quick ? 1 : 3); ++i) r = std::max(r, samples_per_s(t, steps, batch));
      return r;
    };
    const std::vector<Training> configs = {
        {model, 2, 1, 1, 1},          {model, 2, 1, 1, 1, "flops", "bf16"}, {model, 2, 1, 1, 1, "flops", "fp16"},
        {model, 4, 1, 1, 1},          {model, 4, 1, 1, 1, "flops", "bf16"}, {model, 4, 1, 1, 1, "flops", "fp16"},
        {model, 1, 2, 1, 4},          {model, 1, 1, 2, 1},                  {model, 2, 2, 1, 2},
        {model, 2, 1, 2, 1}};
    for (const Training& t : configs) {
      // The one-device run with the same micro-batching (the same split of the global batch).
      const double one = best({model, 1, 1, 1, t.dp * t.microbatches});
      const double many = best(t);
      const int devices = t.dp * t.pp * t.tp;
      bench::JsonLine line("parallel", fmt::format("train_{}_dp{}_pp{}_tp{}{}", model, t.dp, t.pp, t.tp,
                                                   t.grad_compression == "none" ? "" : "_" + t.grad_compression));
      // efficiency: the speed-up over what min(devices, cores) devices could give at best.
      line.add("value", many).add("unit", "samples/s").better(Better::higher).add("reference", one)
          .add("reference_name", "one device").compare("ratio", many, one).add("devices", devices)
          .add("cores", static_cast<std::int64_t>(cores))
          .compare("efficiency", many, one * std::min<double>(devices, cores)).add("batch", batch)
          .add("microbatches", t.microbatches);
      if (t.dp > 1) {
        // A run of its own with the activity log on (the log costs a little time per act).
        CollectiveOverlap o;
        samples_per_s(t, std::min<std::int64_t>(steps, 20), batch, false, &o);
        std::vector<std::pair<std::string, double>> buckets;
        for (const auto& b : o.by_allreduce) buckets.emplace_back(b.name, b.fraction());
        line.add("allreduce_overlap", o.fraction()).add("allreduce_s", o.collective_s)
            .add("allreduce_overlapped_s", o.overlapped_s).add("allreduce_overlap_by_bucket", buckets);
      }
      line.print();
    }
  }
  return failed;
}

/// The samples/s in baton-train's --json line of `out`; 0 if none.
double train_rate(const std::string& out) {
  const auto at = out.rfind("\"samples_per_s\": ");
  return at == std::string::npos ? 0.0 : std::strtod(out.c_str() + at + 17, nullptr);
}

/// --only hosts: baton-train --dp N over two hosts (network namespaces joined by a veth pair, one
/// baton-launch in each, N/2 ranks a host, everything over TCP: UCX_TLS=tcp), against the same
/// job in one process on one device with the same micro-batching. dp 4 runs with the
/// hierarchical all-reduce (the default) and with --allreduce flat; dp 2 (a rank a host) is
/// flat either way; `_bf16` and `_fp16` compress (flat). samples/s is baton-train's (the runtime's wall
/// time, compile and start-up excluded); the best of three runs each. A run that fails fails its
/// case. Returns the exit status: 0, 1 where a case failed, or a skip where it could not make
/// the namespaces (no root; skip.h).
int across_hosts(const std::string& bin, bool quick) {
  bench::NamespacePair hosts;
  if (!hosts.ok()) return bench::skip("baton-bench-parallel --only hosts", hosts.why_not());
  int job = 0, failed = 0;
  for (const std::string model : {"mlp", "gpt"}) {
    if (model == "gpt" && !have_gpt_text("train_gpt_dp*_2hosts*")) {
      ++failed;
      continue;
    }
    const std::vector<std::string> base =
        model == "mlp"
            ? std::vector<std::string>{"--model", "mlp", "--data", "synthetic", "--hidden", "256", "--layers", "2",
                                       "--batch", "256", "--steps", quick ? "20" : "200"}
            : std::vector<std::string>{"--model", "gpt", "--data", fmt::format("text:{}", gpt_text),
                                       "--d-model", "64", "--heads", "4", "--layers", "2", "--seq", "32", "--batch",
                                       "16", "--steps", quick ? "4" : "40"};
    auto args = [&](std::vector<std::string> extra) {
      std::vector<std::string> a{bin + "/baton-train"};
      a.insert(a.end(), base.begin(), base.end());
      a.insert(a.end(), {"--optimizer", "adam", "--lr", "0.001", "--json", "--no-eval"});
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    // The best of the runs; 0 if any run failed (it said why on stderr).
    auto best = [&](auto&& once) {
      double r = 0;
      for (int i = 0; i < (quick ? 1 : 3); ++i) {
        const double once_r = once();
        if (once_r <= 0) return 0.0;
        r = std::max(r, once_r);
      }
      return r;
    };
    struct Case {
      int dp;
      std::string allreduce, compression;
    };
    for (const Case& c : {Case{2, "auto", "none"}, Case{4, "auto", "none"}, Case{4, "flat", "none"},
                          Case{4, "auto", "bf16"}, Case{4, "auto", "fp16"}}) {
      const int per_host = c.dp / 2;
      const std::string case_name = fmt::format("train_{}_dp{}_2hosts{}{}", model, c.dp,
                                                c.allreduce == "flat" ? "_flat" : "",
                                                c.compression == "none" ? "" : "_" + c.compression);
      const double one = best([&] {
        auto [code, out] = bench::finish(
            bench::spawn(args({"--microbatches", std::to_string(c.dp)}), {}, true),
            bench::Clock::now() + std::chrono::seconds(300));
        const double rate = code == 0 ? train_rate(out) : 0.0;
        if (rate <= 0) {
          fmt::print(stderr, "baton-bench-parallel: case {}: the one-process reference exited {}{}\n", case_name, code,
                     code == 0 ? " without a samples_per_s" : "");
        }
        return rate;
      });
      bench::load().set_own_threads(c.dp);
      const double many = best([&] {
        const std::string master = fmt::format("{}:{}", hosts.address(0), 21000 + getpid() % 20000 + job++);
        std::vector<bench::Child> nodes;
        for (int node = 0; node < 2; ++node) {
          std::vector<std::string> argv{"ip", "netns", "exec", hosts.names()[static_cast<std::size_t>(node)],
                                        bin + "/baton-launch", "--nnodes", "2", "--node-rank", std::to_string(node),
                                        "--master", master, "--nproc-per-node", std::to_string(per_host), "--token",
                                        "bench-parallel-hosts", "--"};
          for (auto& a : args({"--dp", std::to_string(c.dp), "--allreduce", c.allreduce, "--grad-compression",
                               c.compression})) {
            argv.push_back(std::move(a));
          }
          nodes.push_back(bench::spawn(argv, {{"UCX_TLS", "tcp"}}, node == 0));
        }
        const auto deadline = bench::Clock::now() + std::chrono::seconds(300);
        auto [code0, out0] = bench::finish(nodes[0], deadline);
        auto [code1, out1] = bench::finish(nodes[1], deadline);
        if (code0 != 0 || code1 != 0) {
          fmt::print(stderr, "baton-bench-parallel: case {}: the launchers exited {} and {}\n", case_name, code0, code1);
          return 0.0;
        }
        const double rate = train_rate(out0);
        if (rate <= 0) fmt::print(stderr, "baton-bench-parallel: case {}: rank 0 printed no samples_per_s\n", case_name);
        return rate;
      });
      if (one <= 0 || many <= 0) {
        fmt::print(stderr, "baton-bench-parallel: case {} failed\n", case_name);
        ++failed;
        bench::load().set_own_threads(1);
        continue;
      }
      const int cores = bench::usable_cores();
      bench::JsonLine line("parallel", case_name);
      line.add("value", many).add("unit", "samples/s").better(Better::higher).add("reference", one)
          .add("reference_name", "one process, one device, the same micro-batching").compare("ratio", many, one)
          .compare("efficiency", many, one * std::min(c.dp, cores)).add("ranks", c.dp).add("hosts", 2)
          .add("allreduce", c.dp == 2 || c.compression != "none" ? "flat (one rank a host, or compressed)"
                            : c.allreduce == "auto"             ? "hierarchical, 2 hosts x 2"
                                                                : "flat ring")
          .add("transport", "tcp (UCX_TLS=tcp) over a veth pair").add("cores", static_cast<std::int64_t>(cores));
      line.print();  // judged with the job's ranks as the benchmark's own busy threads
      bench::load().set_own_threads(1);
    }
  }
  if (failed > 0) fmt::print(stderr, "baton-bench-parallel --only hosts: {} case(s) failed\n", failed);
  return failed > 0 ? 1 : 0;
}

}  // namespace

// --- data parallelism against PyTorch DDP ---

/// The GPT of the ddp case, as baton-train --model gpt builds it on GPL-3's characters.
struct DdpShape {
  std::int64_t d_model = 256, heads = 4, layers = 4, seq = 128, batch = 16;
  int ranks = 2;
};

/// A number after "key": in the last line of `out` that has it ([0] prefixes and all); nullopt if none.
std::optional<double> last_number(const std::string& out, std::string_view key) {
  const std::string needle = fmt::format("\"{}\": ", key);
  const auto at = out.rfind(needle);
  if (at == std::string::npos) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(out.c_str() + at + needle.size(), &end);
  if (end == out.c_str() + at + needle.size()) return std::nullopt;
  return v;
}

/// One baton-train --dp 2 job of `steps` steps over two ranks (baton-launch): the runtime's wall
/// seconds on rank 0, or nullopt (why on stderr).
std::optional<double> baton_ddp_wall(const std::string& bin, const DdpShape& g, int steps, const std::string& case_name) {
  const std::vector<std::string> argv{
      bin + "/baton-launch", "--nproc-per-node", std::to_string(g.ranks), "--", bin + "/baton-train", "--model", "gpt",
      "--data", fmt::format("text:{}", gpt_text), "--d-model", std::to_string(g.d_model), "--heads",
      std::to_string(g.heads), "--layers", std::to_string(g.layers), "--seq", std::to_string(g.seq), "--batch",
      std::to_string(g.batch), "--dp", std::to_string(g.ranks), "--threads", "1", "--steps", std::to_string(steps),
      "--optimizer", "adam", "--lr", "0.001", "--json", "--no-eval"};
  auto [code, out] = bench::finish(bench::spawn(argv, {{"OPENBLAS_NUM_THREADS", "1"}}, true),
                                   bench::Clock::now() + std::chrono::seconds(600));
  const auto wall = code == 0 ? last_number(out, "wall_s") : std::nullopt;
  if (!wall) fmt::print(stderr, "baton-bench-parallel: case {}: baton-launch exited {}: {}\n", case_name, code, out);
  return wall;
}

/// --only ddp (and in the default run): baton's dp 2 over two ranks against PyTorch DDP, each
/// side's steady samples/s (baton: the difference of a warm-up run and a longer one, which
/// leaves out start-up and the first steps; DDP: timed between barriers after its warm-up), the
/// best of 3 (--quick: 1). Returns the exit status: 0, 1 where a side failed or the models
/// differ, a skip where the peer cannot run here (no python3 with torch; skip.h).
int against_ddp(const std::string& bin, bool quick, bool reference) {
  const std::string case_name = "train_gpt_d256_dp2_2ranks";
  if (!have_gpt_text(case_name)) return 1;
  const DdpShape g;
  const auto text = std::make_shared<const data::TextCorpus>(data::load_text(gpt_text));
  const std::int64_t vocab = text->vocab_size();
  const int warmup = quick ? 1 : 5, steps = quick ? 2 : 20, repeats = quick ? 1 : 3;
  // The peer: gpt_ddp_torch.py under a python3 with torch.distributed.
  std::string missing;
  std::vector<std::string> peer;
  if (reference) {
    const std::string python = bench::reference_python();
    const std::string script = bench::find_reference_script("BATON_GPT_DDP_TORCH", "gpt_ddp_torch.py", missing);
    auto [rc, out] = bench::run_capture(fmt::format(
        "timeout 120 {} -c 'import torch.distributed as d; assert d.is_available() and d.is_gloo_available()' 2>&1",
        bench::shell_quote(python)));
    if (script.empty()) {
      // `missing` says where it looked
    } else if (rc != 0) {
      missing = fmt::format("{} has no torch.distributed with gloo: {} (apt-get install python3-torch, or set "
                            "BATON_PYTHON)",
                            python, bench::trim(out));
    } else {
      peer = {python, script};
    }
  }
  auto peer_argv = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = peer;
    for (auto x : {"--ranks", "2", "--threads", "1"}) a.emplace_back(x);
    a.insert(a.end(), {"--d-model", std::to_string(g.d_model), "--heads", std::to_string(g.heads), "--layers",
                       std::to_string(g.layers), "--seq", std::to_string(g.seq), "--vocab", std::to_string(vocab),
                       "--batch", std::to_string(g.batch)});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  if (!peer.empty()) {
    // The same model: gpt_ddp_torch.py's parameter count against baton's.
    Graph graph(1);
    (void)models::gpt(graph, g.batch / g.ranks,
                      {.vocab = vocab, .seq = g.seq, .d_model = g.d_model, .heads = g.heads, .layers = g.layers});
    std::int64_t params = 0;
    const auto store = ParameterStore::initialize(graph);
    for (const auto& [name, t] : store->values()) params += t.numel();
    auto [code, out] = bench::finish(bench::spawn(peer_argv({"--count-only"}), {}, true),
                                     bench::Clock::now() + std::chrono::minutes(2));
    const auto theirs = bench::json_number(bench::last_json_line(out), "params");
    if (code != 0 || !theirs || static_cast<std::int64_t>(*theirs) != params) {
      fmt::print(stderr, "baton-bench-parallel: case {}: gpt_ddp_torch.py's model is not baton's: {} parameters against "
                         "baton's {} (exit {}: {})\n",
                 case_name, theirs ? fmt::format("{}", *theirs) : std::string("no count"), params, code, out);
      return 1;
    }
  }
  bench::load().set_own_threads(g.ranks);  // a busy thread a rank, either side
  double baton = 0, torch = 0;
  std::string torch_version;
  for (int r = 0; r < repeats; ++r) {  // interleaved, so that a slow moment hurts both sides alike
    const auto short_run = baton_ddp_wall(bin, g, warmup, case_name);
    const auto long_run = baton_ddp_wall(bin, g, warmup + steps, case_name);
    if (!short_run || !long_run || *long_run <= *short_run) {
      if (short_run && long_run) {
        fmt::print(stderr, "baton-bench-parallel: case {}: {} steps took {} s, no longer than {} steps' {} s\n",
                   case_name, warmup + steps, *long_run, warmup, *short_run);
      }
      return 1;
    }
    baton = std::max(baton, static_cast<double>(steps * g.batch) / (*long_run - *short_run));
    if (peer.empty()) continue;
    auto [code, out] = bench::finish(
        bench::spawn(peer_argv({"--warmup", std::to_string(warmup), "--steps", std::to_string(steps)}),
                     {{"OPENBLAS_NUM_THREADS", "1"}}, true),
        bench::Clock::now() + std::chrono::seconds(600));
    const std::string json = bench::last_json_line(out);
    const auto rate = bench::json_number(json, "samples_per_s");
    if (code != 0 || !rate) {
      fmt::print(stderr, "baton-bench-parallel: case {}: the PyTorch DDP peer failed (exit {}): {}\n", case_name, code,
                 out);
      return 1;
    }
    torch = std::max(torch, *rate);
    torch_version = bench::json_string(json, "torch").value_or("?");
  }
  bench::JsonLine line("parallel", case_name);
  line.add("value", baton).add("unit", "samples/s").better(Better::higher);
  if (!peer.empty()) {
    line.add("reference", torch)
        .add("reference_name", fmt::format("PyTorch {} DistributedDataParallel (gloo), 2 processes on 127.0.0.1",
                                           torch_version))
        .compare("ratio", baton, torch);
  } else if (reference) {
    line.add("reference_missing", missing);
  }
  line.add("ranks", g.ranks).add("d_model", g.d_model).add("heads", g.heads).add("layers", g.layers).add("seq", g.seq)
      .add("vocab", vocab).add("batch", g.batch).add("threads_per_rank", 1).add("openblas_threads", 1)
      .add("steps", steps).add("warmup", warmup).add("repeats", repeats)
      .add("stat", "steady samples/s, best of the repeats (baton: steps warmup+1 to warmup+steps; DDP: the same, "
                   "between barriers)")
      .add("baton_launch", "baton-launch --nproc-per-node 2 -- baton-train --dp 2 --threads 1");
  line.print();
  bench::load().set_own_threads(1);
  if (reference && peer.empty()) return bench::skip("baton-bench-parallel's PyTorch DDP peer", missing);
  return 0;
}

// --- parameter servers: the bytes a worker moves a step, and what staleness buys ---

/// Bytes worker rank 0 sends and receives a step, measured: every rank of the job run as a
/// Runtime in this process over a LoopbackHub that does not share memory (so every piece that
/// crosses ranks is copied, as between hosts), the transfer actors' bytes summed by direction.
std::pair<double, double> worker_bytes_per_step(const Training& t, std::int64_t steps, std::int64_t batch) {
  std::vector<Placement> replicas, servers;
  for (int r = 0; r < t.dp; ++r) replicas.push_back(Placement{.rank = static_cast<std::uint16_t>(r)});
  if (t.sync == "ps") {
    for (int k = 0; k < t.servers; ++k) servers.push_back(Placement{.rank = static_cast<std::uint16_t>(t.dp + k)});
  }
  TrainingJob job = compile_case(t, steps, batch, replicas, servers);
  const auto results = test::run_on_loopback(job.plan, job.kernels, {}, /*shares_memory=*/false);
  std::map<std::string, ActorIndex> index;
  for (ActorIndex i = 0; i < job.plan.actors.size(); ++i) index[job.plan.actors[i].name] = i;
  double sent = 0, received = 0;
  for (const auto& r : results) {
    if (!r.report) throw std::runtime_error("a rank failed: " + r.error);
    for (const ActorMetrics& a : r.report->metrics.actors) {
      if (a.kind != ActorKind::transfer) continue;
      const ActorDesc& d = job.plan.actors[index.at(a.name)];
      const std::uint16_t from = job.plan.actors[job.plan.registers[d.inputs[0].reg].producer].where.rank;
      if (d.where.rank == 0) received += static_cast<double>(a.bytes_in);
      if (from == 0) sent += static_cast<double>(a.bytes_in);
    }
  }
  return {sent / static_cast<double>(steps), received / static_cast<double>(steps)};
}

/// Returns the cases that failed.
int parameter_servers(bool quick) {
  int failed = 0;
  const std::int64_t batch = 256, steps = quick ? 3 : 20;
  // The main figure: bytes per worker per step, PS against the ring (BytePS's argument: a worker
  // moves each gradient byte once each way to the servers, 2 (n - 1) / n in a ring).
  for (int dp : {2, 4}) {
    try {
      const Training ring{.model = "mlp", .dp = dp};
      Training ps = ring;
      ps.sync = "ps";
      ps.servers = dp / 2;
      const auto [ring_sent, ring_received] = worker_bytes_per_step(ring, steps, batch);
      const auto [ps_sent, ps_received] = worker_bytes_per_step(ps, steps, batch);
      bench::JsonLine line("parallel", fmt::format("ps_bytes_per_worker_dp{}", dp));
      line.add("value", ps_sent + ps_received).add("unit", "bytes/step").better(Better::lower)
          .add("reference", ring_sent + ring_received).add("reference_name", "ring all-reduce, same model and dp")
          .compare("ratio", ps_sent + ps_received, ring_sent + ring_received)
          .add("ps_sent", ps_sent).add("ps_received", ps_received).add("ring_sent", ring_sent)
          .add("ring_received", ring_received).add("servers", ps.servers).add("steps", steps)
          .add("how", "every rank a Runtime in one process over a LoopbackHub without shared memory; the transfer "
                      "actors' bytes of worker rank 0, sent and received");
      line.print();
    } catch (const std::exception& e) {
      fmt::print(stderr, "baton-bench-parallel: ps_bytes_per_worker_dp{}: {}\n", dp, e.what());
      ++failed;
    }
  }
  // Throughput in one process, dp 2: servers against the all-reduce, and staleness against
  // synchronous servers.
  auto best = [&](const Training& t) {
    double r = 0;
    for (int i = 0; i < (quick ? 1 : 3); ++i) r = std::max(r, samples_per_s(t, quick ? 20 : 200, batch));
    return r;
  };
  const Training ring{.model = "mlp", .dp = 2};
  Training sync = ring;
  sync.sync = "ps";
  const double ring_rate = best(ring), sync_rate = best(sync);
  bench::JsonLine line("parallel", "ps_sync_vs_allreduce_dp2");
  line.add("value", sync_rate).add("unit", "samples/s").better(Better::higher).add("reference", ring_rate)
      .add("reference_name", "ring all-reduce, dp 2, one process").compare("ratio", sync_rate, ring_rate)
      .add("servers", 1);
  line.print();
  for (int s : {1, 4}) {
    Training stale = sync;
    stale.staleness = s;
    const double rate = best(stale);
    bench::JsonLine l("parallel", fmt::format("ps_staleness_{}_dp2", s));
    l.add("value", rate).add("unit", "samples/s").better(Better::higher).add("reference", sync_rate)
        .add("reference_name", "synchronous servers (staleness 0), dp 2, one process").compare("ratio", rate, sync_rate)
        .add("servers", 1).add("staleness", s);
    l.print();
  }
  return failed;
}

// --- PipeDream-2BW against 1F1B: throughput and the loss after the same steps ---

/// Returns the cases that failed.
int two_bw_vs_1f1b(bool quick) {
  int failed = 0;
  for (const std::string model : {"mlp", "gpt"}) {
    if (model == "gpt" && !have_gpt_text("2bw_vs_1f1b_gpt_*")) {
      ++failed;
      continue;
    }
    const std::int64_t batch = model == "mlp" ? 256 : 16;
    const std::int64_t steps = (model == "mlp" ? 200 : 40) / (quick ? 10 : 1);
    struct Run {
      double rate = 0, loss = 0;
    };
    auto train = [&](const std::string& schedule) {
      Run best;
      for (int i = 0; i < (quick ? 1 : 3); ++i) {
        Training t{.model = model, .pp = 2, .microbatches = 4};
        t.schedule = schedule;
        TrainingJob job = compile_case(t, steps, batch);
        RunReport report = Runtime(job.plan, job.kernels).run();
        best.rate = std::max(best.rate, static_cast<double>(steps * batch) / report.wall_s);
        best.loss = job.losses->per_step().back();  // the same every repeat: the runs are deterministic in value
      }
      return best;
    };
    const Run one = train("1f1b"), two = train("2bw");
    bench::JsonLine line("parallel", fmt::format("2bw_vs_1f1b_{}_pp2_m4", model));
    line.add("value", two.rate).add("unit", "samples/s").better(Better::higher).add("reference", one.rate)
        .add("reference_name", "1f1b, same model, pp 2, 4 micro-batches").compare("ratio", two.rate, one.rate)
        .add("final_loss_2bw", two.loss).add("final_loss_1f1b", one.loss).add("steps", steps).add("batch", batch);
    line.print();
  }
  return failed;
}

int main(int argc, char** argv) {
  // The training cases keep min(devices, cores) threads busy; the bubble's kernels sleep.
  bench::load().start(argc, argv, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  bool quick = false, reference = true;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--only" && i + 1 < argc &&
               (std::string_view(argv[i + 1]) == "bubble" || std::string_view(argv[i + 1]) == "train" ||
                std::string_view(argv[i + 1]) == "balance" || std::string_view(argv[i + 1]) == "ddp" ||
                std::string_view(argv[i + 1]) == "ps" || std::string_view(argv[i + 1]) == "2bw" ||
                std::string_view(argv[i + 1]) == "hosts")) {
      only = argv[++i];
    } else if (a == "--no-reference") {
      reference = false;  // the ddp case without its PyTorch peer (the others' references are baton's own)
    } else {
      fmt::print(stderr,
                 "usage: baton-bench-parallel [--quick] [--only bubble|train|balance|ps|2bw|ddp|hosts] [--no-reference] "
                 "[--allow-load]\n{}",
                 bench::allow_load_usage);
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  const int steps = quick ? 2 : 6;
  const std::int64_t fwd_ns = 1'000'000, bwd_ns = 2'000'000;  // 1 ms forward, 2 ms backward per stage
  // The schedules' bubbles against their formulas, with the backward (2 ms) split into B and W
  // halves of 1 ms for zb-h1 (so F = B = W) and each of interleaved's v = 2 chunks costing half
  // a one-stage device's F and B. 2bw runs 1f1b's order without a flush (its lanes go on
  // across steps; the skeleton's weights read the gradient two steps late): its bubble is 0 in
  // steady state, so over the whole run it is 1f1b's formula with the run's S M micro-batches
  // for M: (K-1)/(SM+K-1), where M >= K-1 (below, the weight delay caps the warm-up at M).
  struct Case {
    const char* schedule;
    int v;
    const char* label;
  };
  const Case schedules[] = {
      {"gpipe", 1, "gpipe"}, {"1f1b", 1, "1f1b"}, {"zb-h1", 1, "zb-h1"}, {"interleaved", 2, "interleaved-v2"},
      {"2bw", 1, "2bw"}, {"zb-v", 1, "zb-v"}};
  for (int k : {2, 4}) {
    for (int m : {1, 4, 8, 16}) {
      if (!only.empty() && only != "bubble") break;
      if (quick && m > 4) continue;
      for (const Case& c : schedules) {
        const std::string_view sc = c.schedule;
        if (!schedule_refusal(parse_schedule(sc), k, c.v, m).empty()) continue;  // interleaved: M a multiple of K
        if (sc == "2bw" && m < k - 1) continue;  // no formula: the weight delay caps the warm-up
        for (DeviceType type : {DeviceType::cpu, DeviceType::sim}) {
          if ((sc == "zb-h1" || sc == "interleaved" || sc == "zb-v") && type == DeviceType::sim) continue;  // CPU only
          Result r = run(k, m, c.schedule, c.v, steps, fwd_ns, bwd_ns, type);
          // ZB-H1's formula holds for M >= K; below, its order's own timeline is the reference.
          const double km1 = k - 1;
          // ZB-V's order is our greedy one (schedule.h): its own timeline is the reference (the
          // paper's ZB-V has a bubble of about 0 with F = B = W; ours, the pipeline's fill).
          const bool zb_short = (sc == "zb-h1" && m < k) || sc == "zb-v";
          const double formula = zb_short ? analyse_schedule(parse_schedule(sc), k, m).idle
                                 : sc == "zb-h1"       ? km1 / (3.0 * m + km1)
                                 : sc == "interleaved" ? km1 / (static_cast<double>(c.v) * m + km1)
                                 : sc == "2bw"         ? km1 / (static_cast<double>(steps) * m + km1)
                                                       : km1 / (m + km1);
          const char* formula_name = sc == "zb-v" ? "the order's timeline (F = B = W = 1 ms)"
                                     : zb_short ? "the order's timeline with F = B = W = 1 ms (M < K)"
                                     : sc == "zb-h1"       ? "(K-1)/(3M+K-1) (F = B = W = 1 ms)"
                                     : sc == "interleaved" ? "(K-1)/(vM+K-1)"
                                     : sc == "2bw" ? "(K-1)/(SM+K-1) over the run's S steps (0 in steady state, no flush)"
                                                           : "(K-1)/(M+K-1)";
          bench::JsonLine line("parallel", fmt::format("bubble_K{}_M{}_{}{}", k, m, c.label,
                                                       type == DeviceType::sim ? "_sim" : ""));
          line.add("value", r.idle).add("unit", "idle fraction").better(Better::lower).add("reference", formula)
              .add("reference_name", formula_name).compare("ratio", r.idle, formula)
              .add("peak_activation_slots", r.peak_activations)
              .add("peak_activation_schedule", expected_peak(k, m, c.schedule, c.v))
              .add("peak_activation_1f1b", expected_peak(k, m, "1f1b", 1)).add("steps", steps)
              .add("wall_s", r.wall_s).add("device", std::string(name(type)));
          line.print();
        }
      }
    }
  }
  int failed = 0;
  if (only.empty() || only == "train") failed += training_scaling(quick);
  if (only.empty() || only == "balance") failed += stage_balance(quick);
  if (only.empty() || only == "ps") failed += parameter_servers(quick);
  if (only.empty() || only == "2bw") failed += two_bw_vs_1f1b(quick);
  const std::string bin = std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
  if (only == "hosts") return across_hosts(bin, quick);  // root only (network namespaces); not in the default run
  if (only.empty() || only == "ddp") {
    const int status = against_ddp(bin, quick, reference);
    if (status != 0 && status != bench::skip_exit_code) ++failed;
    if (failed == 0) return status;  // 0, or the peer's skip
  }
  return failed > 0 ? 1 : 0;
}
