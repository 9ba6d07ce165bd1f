// The lanes pass (passes.h): each stage's fixed order of acts.
#include "baton/graph/passes.h"
#include "baton/graph/schedule.h"

namespace baton::passes {

Plan lanes(const Plan& plan, const TrainConfig& cfg) {
  Plan out = plan;
  // The order within each stage (schedule.h); the slots of the lowering bound what is in flight.
  if (cfg.pp > 1) {
    order_pipeline(out, parse_schedule(cfg.schedule), cfg.pp, cfg.microbatches, cfg.virtual_stages);
  } else if (cfg.memory_plan) {
    // One stage: F0 B0 F1 B1 ... (1F1B without warm-up), within the activation slots.
    order_pipeline(out, PipelineSchedule::one_f_one_b, 1, cfg.microbatches);
  }
  return out;
}

}  // namespace baton::passes
