#pragma once
// baton-plan's engine: a training layout compiled by the real compiler into its real plan, each
// actor given what its act costs on the devices of a cluster, and the plan run on the virtual
// clock (baton/actors/simulate.h). docs/planning.md says what is exact and what is assumed.
//
//   baton::planner::Layout l{.model = "gpt", .layers = 4, .d_model = 256, ...};
//   baton::planner::Prediction p = baton::planner::predict(l, baton::planner::parse_cluster("cpu:2"));
//   // p.step_time_s, p.tokens_per_s, p.peak_memory_bytes, p.fits ...
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "baton/actors/plan_memory.h"
#include "baton/actors/simulate.h"
#include "baton/graph/compile.h"

namespace baton::planner {

/// The model and its layout, in baton-train's terms (the flags share their names).
struct Layout {
  std::string model = "gpt";  // mlp, gpt or llama
  std::int64_t layers = 2;
  std::int64_t d_model = 64;
  std::int64_t heads = 4;
  std::int64_t kv_heads = 0;    // llama: 0 is heads
  std::int64_t ffn_hidden = 0;  // llama: 0 is 8 d / 3 rounded up to 32
  std::int64_t seq = 32;
  std::int64_t vocab = 256;
  std::int64_t hidden = 256;  // mlp: hidden width; its inputs are 64 wide, 10 classes
  std::int64_t global_batch = 16;
  std::int64_t micro_batch = 0;  // 0: global_batch / dp (one micro-batch a step)
  int dp = 1, tp = 1, pp = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  int zero = 0;
  std::string recompute = "none";
  std::string dtype = "f32";  // f32, or bf16 (autocast's mixed precision)
  int threads = 1;            // worker threads per device (baton-train --threads)

  /// Micro-batches of a step per replica: global_batch / (dp x micro_batch).
  std::int64_t microbatches() const;
  /// "gpt L4 d256 h4 s64 v256 | B16 b4 dp2 tp1 pp1 1f1b zero0 recompute none f32"
  std::string str() const;
  /// Throws std::invalid_argument naming the flag whose value cannot be.
  void check() const;
};

/// A class of link and what one transfer over it costs: latency + bytes / bandwidth.
struct Link {
  std::string name;
  double latency_s = 0;
  double bytes_per_s = 0;
  double seconds(double bytes) const { return latency_s + bytes / bytes_per_s; }
};

/// A device kind: its peaks (from its specification), the share of them its kernels reach
/// (measured where it could be), its memory, and its links.
struct DeviceProfile {
  std::string name;
  /// Dense peak FLOP/s by dtype (bf16: tensor cores; f32: without TF32).
  double flops_f32 = 0, flops_bf16 = 0;
  double memory_bytes_per_s = 0;
  std::int64_t memory_bytes = 0;
  /// The share of the peaks a large matrix product and a streaming kernel reach.
  double matmul_efficiency = 1, memory_efficiency = 1;
  /// What each kernel launch (or act's handshake) costs on top.
  double act_overhead_s = 0;
  int per_node = 8;
  Link intra_node, inter_node;
  /// The CPU of this machine: act costs are each kernel timed on its real shapes, not peaks.
  bool measured = false;
  /// Where its figures come from, for people.
  std::string source;
};

/// The built-in profiles: a100-40gb, a100-80gb, h100-sxm, h200 and cpu (this machine,
/// measured). Throws std::invalid_argument listing them for another name.
DeviceProfile device_profile(std::string_view name);
std::vector<std::string> device_profile_names();

struct Cluster {
  DeviceProfile device;
  int devices = 1;
};
/// "NAME:N" (h100-sxm:1024, cpu:2); gpus_per_node > 0 overrides the profile's per_node.
Cluster parse_cluster(std::string_view spec, int gpus_per_node = 0);

/// What the simulation predicts for one training step in its steady state.
struct Prediction {
  Layout layout;
  std::string cluster;
  double step_time_s = 0;
  double samples_per_s = 0;
  double tokens_per_s = 0;  // samples x seq (0 for the mlp)
  /// The model's FLOPs per step (6 N T plus attention's 12 L d S T, PaLM's count; recomputation
  /// not counted), per device per second, and over the devices' peak for the dtype.
  double model_flops_per_step = 0;
  double model_flops_per_device_s = 0;
  double mfu = 0;
  /// Each device's idle share of the step (its stream or worker that computes), averaged.
  double bubble_fraction = 0;
  /// The memory plan's exact bytes (plan_memory.h): the largest device's, and each device's.
  std::int64_t peak_memory_bytes = 0;
  std::vector<DeviceMemory> memory;
  bool fits = true;
  /// Bytes moved per step by link class ("nvlink", "pcie", ...).
  std::map<std::string, double> link_bytes_per_step;
  /// Where the step's time went on its critical path: seconds by resource, largest first.
  std::vector<std::pair<std::string, double>> critical_path;
  std::int64_t actors = 0;
  /// The acts' simulated seconds per step, over every resource but links: what the kernels cost.
  double act_s_per_step = 0;
  /// By op: the seconds the cost model gives one act.
  std::map<std::string, double> act_s_by_op;
  /// How long the prediction took (compiling, costing, simulating).
  double wall_s = 0;
  /// The simulated run (three steps), for --trace.
  Simulation simulation;
  Plan plan;
};

struct PredictOptions {
  /// Timed runs of each distinct kernel on a measured (CPU) device; the median counts.
  int repeats = 3;
  /// Keep the simulation's acts and the plan (Prediction::simulation, ::plan) for a trace.
  bool keep_acts = false;
  /// Stop once the plan's memory is known not to fit (Prediction::fits false, nothing timed).
  bool skip_if_unfit = false;
};

/// Compiles the layout's training plan for the cluster's devices (CPU devices for `cpu`, sim
/// devices, the GPU's execution model, for the others), costs each actor and simulates three
/// steps. Throws std::invalid_argument for a layout the cluster cannot hold (dp x tp x pp !=
/// devices) or the compiler refuses, naming why.
Prediction predict(const Layout& layout, const Cluster& cluster, const PredictOptions& options = {});

/// What a search holds fixed (the flags the user gave); the rest it chooses.
struct SearchFixed {
  std::optional<int> dp, tp, pp, zero;
  std::optional<std::int64_t> micro_batch;
  std::optional<std::string> schedule, recompute;
};
struct SearchOptions {
  int top = 10;
  /// Stop trying layouts after this long (the best so far are returned, and a note says so).
  double time_limit_s = 600;
};
struct SearchResult {
  /// The fastest layouts that fit, fastest first (at most SearchOptions::top).
  std::vector<Prediction> ranked;
  std::int64_t candidates = 0;  // shapes (dp, tp, pp, micro-batch, schedule) enumerated
  std::int64_t evaluated = 0;   // predictions made (each rung of the memory ladder counts)
  std::int64_t refused = 0;     // shapes the model or the compiler refused
  std::vector<std::string> notes;
  double wall_s = 0;
};
/// Every layout of `base`'s model and global batch on the cluster's devices: dp x tp x pp equal
/// to the devices, micro-batches that split the batch into 1-32 per replica, every schedule but
/// 2BW (it trains another model, one step stale) where pp > 1; for each, the first rung of
/// ZeRO stages then recomputation (neither makes a step faster) at which it fits. The fastest
/// predicted first.
SearchResult search(const Layout& base, const Cluster& c, const SearchFixed& fixed, const SearchOptions& options = {});

/// baton-train --layout auto: the fastest layout that fits on 1 to `devices` devices of the
/// profile (fewer devices may win: a small model on two devices can be slower than on one), and
/// why, in a line for people. Throws std::invalid_argument when no layout fits.
struct Choice {
  Prediction best;
  std::string why;
};
Choice choose(const Layout& base, std::string_view profile, int devices, const SearchFixed& fixed);

/// The layout's training job for `steps` steps, compiled as predict() compiles it (on in-process
/// devices of `device`'s type, synthetic micro-batches).
TrainingJob compile(const Layout& layout, DeviceType device, std::int64_t steps);

/// Trains the layout for real here (in-process CPU devices, as baton-train --devices cpu:N, on
/// the same synthetic micro-batches) and returns its seconds per step in the steady state: from
/// the moment step `warm`'s losses were all in to the moment the last step's were, over the
/// steps between. What `bench plan` holds the prediction to.
struct Measured {
  double step_s = 0;
  /// Every actor's kernel seconds in the run (exact accounting), per step.
  double kernel_s_per_step = 0;
  /// By op: kernel seconds per act in the run.
  std::map<std::string, double> kernel_s_per_act;
};
Measured measure(const Layout& layout, std::int64_t steps = 8, std::int64_t warm = 2);

/// One JSON object: step_time_s, tokens_per_s, samples_per_s, mfu, bubble_fraction,
/// peak_memory_bytes, fits, model_flops_per_device_s, link_bytes_per_step, critical_path and the
/// layout's flags.
std::string to_json(const Prediction& p);
/// What `baton-plan simulate` prints: a few lines for people.
std::string to_text(const Prediction& p);
/// The simulated steps as a Chrome/Perfetto trace (the JSON array form a real run's --trace
/// writes: one track per resource, one slice per act).
std::string to_trace(const Prediction& p);

}  // namespace baton::planner
