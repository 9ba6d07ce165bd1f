#pragma once
/// Pipeline schedules: in which order a stage runs the forward and backward passes of a step's
/// M micro-batches. compile_training applies one to its plan (TrainConfig::schedule); a
/// hand-built pipeline plan (the bubble benchmark) can apply one too.
///
///   baton::order_pipeline(plan, baton::PipelineSchedule::one_f_one_b, /*stages=*/4, /*M=*/8);
///
/// The order is the plan's (ActOrder lanes, one per stage and worker): each stage's worker runs
/// its forward and backward acts in the canonical sequence whatever the kernels cost; there is
/// no central scheduler. The register depths (M activation slots a stage for GPipe, stages - s
/// for 1F1B) still bound what is in flight, and must be at least what the order needs.
#include <cstdint>
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
};

/// "gpipe" or "1f1b"; throws GraphError for anything else.
PipelineSchedule parse_schedule(std::string_view name);
std::string_view name(PipelineSchedule s);

/// One piece of a stage's work: the forward or the backward pass of one micro-batch.
struct PipelineUnit {
  bool backward = false;
  std::int64_t microbatch = 0;
  friend bool operator==(const PipelineUnit&, const PipelineUnit&) = default;
};

/// The sequence stage `stage` of `stages` runs in one step of `microbatches` (2M units).
/// Backwards run in micro-batch order, as the loss reports them: registers are FIFO, so a stage
/// reads its activations back in the order it wrote them (GPipe's figure draws them reversed;
/// the bubble is the same).
std::vector<PipelineUnit> stage_sequence(PipelineSchedule s, int stages, int stage, std::int64_t microbatches);

/// Puts the model's ops of each pipeline stage into a lane that follows stage_sequence: every
/// compute actor with a stage >= 0, role forward or backward and at least one output (a sink
/// such as loss.report is left free). One lane per (stage, rank, device, stream); within a unit
/// the ops keep their plan order (compile_training adds them in topological order). Throws
/// GraphError if a stage is out of range.
void order_pipeline(Plan& plan, PipelineSchedule s, int stages, std::int64_t microbatches);

}  // namespace baton
