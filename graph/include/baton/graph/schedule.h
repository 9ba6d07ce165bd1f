#pragma once
/// Pipeline schedules: in which order each device runs the forward and backward passes of a
/// step's M micro-batches over its stages. compile_training applies one to its plan
/// (TrainConfig::schedule); a hand-built pipeline plan (the bubble benchmark) can apply one too.
///
///   baton::order_pipeline(plan, baton::PipelineSchedule::one_f_one_b, /*devices=*/4, /*M=*/8);
///
/// A schedule is data: per device a sequence of units (the forward F, the input-gradient
/// backward B or the weight-gradient backward W of one micro-batch on one of the device's
/// stages) and, per stage, how many micro-batches' activations it holds at once (the depth of
/// its registers). The order is the plan's (ActOrder lanes, one per device and worker): each
/// device's worker runs its acts in the sequence whatever the kernels cost; there is no central
/// scheduler. The register depths bound what is in flight; analyse_schedule() checks a sequence
/// before any plan exists (every unit once, FIFO order per stage, no unit that waits for one
/// its own device runs later), and validate()'s dry run proves the plan with its slots.
///
/// `devices` counts pipeline devices (TrainConfig::pp); the model is cut into
/// devices x chunks_per_device() stages. Where a stage lives (stage_of / device_of_stage):
///   gpipe, 1f1b, 2bw, zb-h1   stage d on device d (one chunk)
///   interleaved (v chunks)    chunk c of device d is stage c * devices + d (Megatron's)
///   zb-v (2 chunks, a V)      device d holds stage d and stage 2 devices - 1 - d: device 0 the
///                             first and the last (the loss and the labels' data on device 0)
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "baton/actors/plan.h"

namespace baton {

enum class PipelineSchedule : std::uint8_t {
  /// GPipe (Huang et al. 2019): every forward of the step, then every backward.
  gpipe,
  /// PipeDream-Flush / Megatron-LM's 1F1B (Narayanan et al. 2021): stage s of N runs
  /// w = min(N - s - 1, M) warm-up forwards, then one forward and one backward in turn while
  /// forwards remain, then the remaining backwards; at most N - s micro-batches in flight.
  one_f_one_b,
  /// Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2): each device holds v
  /// non-adjacent stages; forwards go in groups of `devices` micro-batches chunk after chunk,
  /// backwards the other way; warm-up (devices - d - 1) * 2 + (v - 1) * devices units. M must
  /// be a multiple of the devices. Bubble (p - 1) / (v M + p - 1).
  interleaved,
  /// ZB-H1 (Qi et al., ICLR 2024, section 3.1): 1F1B with each backward split into B (input
  /// gradients) and W (weight gradients); device d runs N - d - 1 warm-up forwards, then d
  /// times F B with W held back, then F B W while forwards remain, then B W, then the held W's.
  /// A third of 1F1B's bubble when F, B and W cost the same; every stage holds up to N
  /// micro-batches (1F1B's peak, stage 0's).
  zb_h1,
  /// PipeDream-2BW (Narayanan et al. 2021): 1F1B's order with each update applied one step
  /// late (two weight versions), so there is no flush between steps.
  two_bw,
  /// ZB-V (Qi et al., ICLR 2024, section 5): two stages per device in a V (stage_of), backward
  /// split into B and W as zb-h1, each device holding at most 2 devices chunk activations
  /// (1F1B's stage-0 peak). The order is our own greedy construction with F = B = W = 1, not the
  /// authors' (zb_v in schedule.cpp). On that timeline it takes at most p - 1 units more than
  /// the lower bound max(6 M + p - 1, 4 p + 1), and the bound itself for p <= 4 and M >= p: a
  /// bubble of (p - 1) / (6 M + p - 1), the pipeline's fill.
  zb_v,
};

/// "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v" or "2bw"; throws GraphError otherwise.
PipelineSchedule parse_schedule(std::string_view name);
std::string_view name(PipelineSchedule s);
/// The names parse_schedule takes, for messages: "gpipe, 1f1b, ...".
std::string_view schedule_names();

/// Stages per device: v for interleaved, 2 for zb-v, else 1.
int chunks_per_device(PipelineSchedule s, int virtual_stages = 1);
/// Whether backward work is split into B and W units (zb-h1, zb-v).
bool splits_backward(PipelineSchedule s);
/// The model stage of chunk `chunk` of device `device`, and the inverse.
int stage_of(PipelineSchedule s, int devices, int device, int chunk);
int device_of_stage(PipelineSchedule s, int devices, int stage);
int chunk_of_stage(PipelineSchedule s, int devices, int stage);

/// Why a schedule cannot be built for this shape ("" if it can): virtual stages where the
/// schedule has none, interleaved M not a multiple of the devices, and the like.
std::string schedule_refusal(PipelineSchedule s, int devices, int virtual_stages, std::int64_t microbatches);

/// One piece of a device's work: a pass of one micro-batch on one of its stages (its chunk).
enum class Pass : std::uint8_t { forward, backward, weight };
struct PipelineUnit {
  Pass pass = Pass::forward;
  std::int64_t microbatch = 0;
  int chunk = 0;
  /// "F3", "B0", "W2"; with several chunks, the chunk too: "F3.1".
  std::string str(bool chunks = false) const;
  friend bool operator==(const PipelineUnit&, const PipelineUnit&) = default;
};

/// The sequence device `device` of `devices` runs in one step of `microbatches`.
/// Backwards run in micro-batch order on each stage, as the loss reports them: registers are
/// FIFO, so a stage reads its activations back in the order it wrote them (GPipe's figure draws
/// them reversed; the bubble is the same). Throws GraphError for a refused shape.
std::vector<PipelineUnit> device_sequence(PipelineSchedule s, int devices, int device, std::int64_t microbatches,
                                          int virtual_stages = 1);
/// device_sequence for the one-chunk schedules (stage == device).
std::vector<PipelineUnit> stage_sequence(PipelineSchedule s, int stages, int stage, std::int64_t microbatches);

/// What a schedule costs, worked out from its sequences alone (no plan, no kernels).
struct ScheduleAnalysis {
  /// By model stage: the most micro-batches whose activations it holds at once (forward done,
  /// its last backward unit, W where split, not yet).
  std::vector<std::int32_t> stage_depth;
  /// By device: the most stage-activations live at once over its chunks (a chunk's are 1 /
  /// chunks of a one-chunk stage's).
  std::vector<std::int32_t> device_peak;
  /// By device: its idle share of the step when every unit costs its unit cost (below) and
  /// nothing else waits: the schedule's own bubble.
  std::vector<double> device_idle;
  double idle = 0;  // mean over devices
  /// By stage, on that timeline over two steps: the most micro-batches a register its forward
  /// writes (`forward_held`) or its backward writes (`backward_held`) holds at once, if every
  /// op that could read it does (the stage's own and the next stage's F, B and W; the stage
  /// before's B and W): what its slots need so that the order never waits for them.
  std::vector<std::int32_t> forward_held, backward_held;
  /// Non-empty: why the sequences cannot run (a unit missing or twice, a stage out of FIFO
  /// order, a unit that waits for work its device only does later), naming device and unit.
  std::string problem;
};
/// Unit costs for the bubble: F = forward, B = backward (input gradients), W = weight
/// gradients; an unsplit backward costs backward + weight.
struct UnitCosts {
  double forward = 1, backward = 1, weight = 1;
};
ScheduleAnalysis analyse_schedule(PipelineSchedule s, int devices, std::int64_t microbatches, int virtual_stages = 1,
                                  UnitCosts costs = {});
/// The same for sequences given by hand (by device; stage_of(s, ...) places their chunks).
ScheduleAnalysis analyse_sequences(PipelineSchedule s, int devices, std::int64_t microbatches, int virtual_stages,
                                   const std::vector<std::vector<PipelineUnit>>& sequences, UnitCosts costs = {});

/// The register depths a schedule needs, by stage. GPipe: M for what a stage's forward
/// writes; 1F1B and 2BW: devices - s; backward registers `backward_min`. The others,
/// analyse_schedule's: what the registers hold on the schedule's own timeline
/// (forward_held, backward_held), at least the stage's depth (and backward_min). The dry run
/// proves a plan with them deadlock-free whatever the kernels cost; where the costs differ from
/// the units', an act may wait for a slot a little. Throws GraphError for a schedule that
/// cannot run.
struct RegisterDepths {
  std::vector<std::int32_t> forward, backward;
};
RegisterDepths register_depths(PipelineSchedule s, int devices, std::int64_t microbatches, int virtual_stages = 1,
                               std::int32_t backward_min = 2);

/// A pipeline of `devices` x chunks stages built as compile_training builds one, without a
/// model: per stage a weight (a variable read by M micro-batches through a repeat, its
/// gradients accumulated and fed back with a delay of one step), a forward actor, a backward
/// (B) actor and, where the schedule splits the backward, a weight-gradient (W) actor reading
/// the stage's input, the gradient from the next stage and its B's output; registers as deep as
/// register_depths() says, ordered by order_pipeline. Every F, B and W actor runs `op` on f32
/// registers of `elements`, with attrs {"stage", s} and {"pass", 0 F, 1 B, 2 W}; the rest are
/// noops. For the bubble benchmark and the schedule property tests.
struct SkeletonOptions {
  std::string op = "noop";
  DeviceType device = DeviceType::cpu;
  std::int64_t steps = 1;
  std::int64_t elements = 4;
};
Plan pipeline_skeleton(PipelineSchedule s, int devices, std::int64_t microbatches, int virtual_stages = 1,
                       const SkeletonOptions& options = {});

/// Each device's order as text, one line each ("device 0 (stages 0, 7): F0 F1 B0 W0 ..."),
/// with its peak activations and bubble (analyse_schedule), for --print-schedule and the
/// lanes pass's --print-after.
std::string schedule_text(PipelineSchedule s, int devices, std::int64_t microbatches, int virtual_stages = 1);

/// Puts the model's ops of each pipeline stage into its device's lane, in device_sequence's
/// order: every compute actor (and transfer given a pass) with a stage >= 0, role forward or
/// backward and at least one output (a sink such as loss.report is left free). A backward actor
/// with ActorDesc::weight_gradient is W work where the schedule splits backward, B work
/// otherwise. One lane per (device, rank, worker place); within a unit the ops keep their plan
/// order (compile_training adds them in topological order). Throws GraphError if a stage is
/// out of range.
void order_pipeline(Plan& plan, PipelineSchedule s, int devices, std::int64_t microbatches, int virtual_stages = 1);

}  // namespace baton
