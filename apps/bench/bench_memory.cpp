// baton-bench-memory: what the memory plan says a training job keeps per rank (step 9, #16).
//
// model_state_zero{Z}_dp{N}: the GPT of `baton-train --model gpt` at d 256, 4 heads, 4 layers,
// T 128 (the characters of Debian's GPL-3 text as vocabulary), Adam, f32, dp N replicas, ZeRO stage Z; the bytes of model state on
// replica 0's device by the plan (plan_memory.h: the same accounting as --print-memory):
//   weights          the step registers the micro-batches read, and, without ZeRO, each
//                    variable actor's master copy (with ZeRO each shard's output register)
//   gradients        the weights' gradient buffers: the accumulated gradient of each weight
//                    ("grad.W"), the bucket it is packed into, and the all-reduce's or
//                    reduce-scatter's registers (every register named "grad.*"), and kernel scratch
//   optimizer_state  Adam's two slots
// against the ZeRO paper's formula for f32 training with Adam (Rajbhandari et al. 2020, section
// 5, with K = 8: exp_avg and exp_avg_sq; the f32 weights are the master): psi x (4 + 4 + 8) for
// plain dp, 4 + 4 + 8/N for stage 1, 4 + (4 + 8)/N for stage 2. "of_formula" is the plan's
// bytes over the formula's: what baton spends beyond what the algorithm needs.
//
// A figure of the plan alone (no timing, so the machine's load does not enter it; it is recorded
// as every benchmark does). The plan's accounting is checked against the running job by
// MemoryPlan.TheMeasuredHighWaterMarkAgreesWithThePlan (an upper bound).
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "baton/actors/plan_memory.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "json_line.h"
#include "models.h"

using namespace baton;

namespace {

struct ModelState {
  std::int64_t params = 0, weights = 0, gradients = 0, optimizer_state = 0;
  std::int64_t total() const { return weights + gradients + optimizer_state; }
};

ModelState model_state(const std::shared_ptr<const data::TextCorpus>& text, int dp, int zero) {
  const models::GptShape shape{.vocab = text->vocab_size(), .seq = 128, .d_model = 256, .heads = 4, .layers = 4};
  const std::int64_t batch = 4;  // per replica; model state does not depend on it
  Graph g(1);
  auto out = models::gpt_with_loss(g, batch, shape);
  TrainConfig cfg;
  cfg.steps = 2;
  cfg.dp = dp;
  cfg.zero = zero;
  cfg.optimizer = optim::adam(1e-3);
  cfg.data = {{"text", data::text_source(text, batch * dp, dp, shape.seq, 1), {"tokens", "targets"}}};
  TrainingJob job = compile_training(g, out.loss, cfg);
  ModelState s;
  for (const auto& [name, t] : job.params->values()) s.params += t.numel();
  const DeviceMemory m = memory_report(job.plan).at(0);  // replica 0's device
  s.weights = m.bytes[static_cast<std::size_t>(MemoryCategory::weights)];
  s.optimizer_state = m.bytes[static_cast<std::size_t>(MemoryCategory::optimizer_state)];
  for (RegisterIndex i = 0; i < job.plan.registers.size(); ++i) {
    const RegisterDesc& r = job.plan.registers[i];
    const RegisterMemory rm = register_memory(job.plan, i);
    if (!rm.allocated || rm.rank != m.rank || rm.device != m.device || !r.name.starts_with("grad.")) continue;
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
  return psi * (4 + (4 + 8) / n);
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 1);
  const char* corpus = "/usr/share/common-licenses/GPL-3";  // Debian's base-files: the vocabulary
  if (!std::filesystem::exists(corpus)) {
    fmt::print(stderr, "baton-bench-memory: {} is missing (Debian's base-files); nothing measured\n", corpus);
    return 77;
  }
  const auto text = std::make_shared<const data::TextCorpus>(data::load_text(corpus));
  for (int dp : {2, 4}) {
    const ModelState plain = model_state(text, dp, 0);
    for (int zero : {0, 1, 2}) {
      const ModelState s = zero == 0 ? plain : model_state(text, dp, zero);
      const double f = formula(s.params, dp, zero);
      bench::JsonLine line("memory", fmt::format("model_state_zero{}_dp{}", zero, dp));
      line.add("value", s.total())
          .add("unit", "bytes per rank (plan)")
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
  return 0;
}
