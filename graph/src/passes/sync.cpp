// Gradient synchronisation as a strategy (lowering.h: GradientSync): the all-reduce, ZeRO 1/2,
// ZeRO 3 and parameter servers, each one implementation of the same three calls lower() makes:
//
//   before_nodes   what each replica's variables read (sums, windows of sums), or who writes
//                  their step registers (ZeRO 1/2's gathers, the servers); ZeRO 3's layout
//   after_nodes    the rest (ZeRO's sharded optimizers and gathers) and the checkpoint's parts
//   report_loss    where the job's loss is summed and reported
//
// `--print-after sync` names the strategy and lists the actors it added.
#include <fmt/format.h>

#include "baton/graph/collectives.h"
#include "lowering.h"

namespace baton::passes::detail {

double scalar_value(const Tensor& t, DType dt) {
  if (dt == DType::f64) return t.data<double>()[0];
  if (dt == DType::bf16) return static_cast<double>(to_float(t.data<bfloat16>()[0]));
  return static_cast<double>(t.data<float>()[0]);
}

Placement GradientSync::reporter(std::vector<PlanBuilder>& replicas, const Differentiated& d) const {
  return replicas[0].host(forward_stream, replicas[0].place(d.loss.id()));
}

std::optional<std::vector<SnapshotPart>> GradientSync::after_nodes(
    std::vector<PlanBuilder>&, const Replicas&, const Differentiated&, const GradientInputs&, SyncRegisters&,
    const std::vector<std::optional<RegisterIndex>>&, ParameterStore&, const Placement&, std::vector<FinalWeight>&) {
  return std::nullopt;
}

// The replicas' losses of each micro-batch summed by an all-reduce (one replica: its own) and
// reported once, on replica 0, as their mean.
std::shared_ptr<LossLog> GradientSync::report_loss(std::vector<PlanBuilder>& replicas, const Differentiated& d,
                                                   const std::vector<RegisterIndex>& loss_regs) {
  auto losses = std::make_shared<LossLog>(cfg_.microbatches);
  const DType loss_dt = d.loss.dtype();
  RegisterIndex loss_in = loss_regs[0];
  const int loss_place = replicas[0].place(d.loss.id());
  if (cfg_.dp > 1) {
    loss_in = add_replica_allreduce(replicas, "loss", loss_regs, {}, loss_dt, forward_stream, 2, loss_place)[0];
  }
  const double loss_scale = 1.0 / static_cast<double>(cfg_.dp);
  replicas[0].kernels.add_fn(
      "loss.report", DeviceType::cpu, loss_dt, [losses, loss_dt, loss_scale](KernelContext& ctx) {
        losses->record(ctx.piece, loss_scale * scalar_value(*ctx.inputs[0], loss_dt));
      });
  replicas[0].plan.add_actor({.name = "loss.report",
                              .op = "loss.report",
                              .dtype = loss_dt,
                              .where = replicas[0].host(forward_stream, loss_place),
                              .inputs = {{loss_in}},
                              .role = ActorRole::forward,
                              .reports_loss = true});
  return losses;
}

namespace {

/// Every replica's variables read the all-reduced sums of its gradients (lower_allreduce.cpp):
/// windows of the members' sums where they lie on CPU devices, a register per weight elsewhere.
/// With one replica, its own sums.
class AllReduceSync final : public GradientSync {
 public:
  explicit AllReduceSync(const TrainConfig& cfg) : GradientSync(cfg) {}
  std::string describe() const override {
    return cfg_.dp > 1 ? fmt::format("all-reduce over {} replicas", cfg_.dp) : std::string("one replica: its own sums");
  }
  SyncRegisters before_nodes(std::vector<PlanBuilder>& replicas, const Replicas& reps, const Differentiated&,
                             const GradientInputs& grad_sum, const Stages&, ParameterStore&) override {
    SyncRegisters s;
    s.grad_windows.resize(grad_sum.size());
    s.steps.resize(grad_sum.size());
    s.grad_in = lower_gradient_allreduce(replicas, reps, grad_sum, cfg_, s.grad_windows);
    return s;
  }
};

/// ZeRO (lower_zero.cpp): the optimizer state (stage 1), the gradients (2) and the weights (3)
/// sharded over the replicas; the buckets' optimizers and gathers come after the nodes.
class ZeroSync final : public GradientSync {
 public:
  explicit ZeroSync(const TrainConfig& cfg) : GradientSync(cfg) {}
  std::string describe() const override { return fmt::format("ZeRO stage {} over {} replicas", cfg_.zero, cfg_.dp); }
  SyncRegisters before_nodes(std::vector<PlanBuilder>& replicas, const Replicas& reps, const Differentiated& d,
                             const GradientInputs& grad_sum, const Stages&, ParameterStore&) override {
    SyncRegisters s;
    s.grad_in.resize(grad_sum.size());
    s.grad_windows.resize(grad_sum.size());
    s.steps.resize(grad_sum.size());
    if (cfg_.zero == 3) {
      // Stage 3 keeps no step register: the weights are gathered from the shards where read.
      s.zero3 = zero3_layout(replicas, reps, cfg_);
      s.zero3->reporter = reporter(replicas, d);
      zero3_sequence(*s.zero3, replicas[0].g, d.need, d.loss.id());
      return s;
    }
    // Each trained weight's step register is written by its bucket's gather.
    for (const auto& [v, grad] : d.trained) {
      for (std::size_t r = 0; r < replicas.size(); ++r) {
        s.steps[r][v.id()] = replicas[r].add_register(v.name() + ".step", v.shape(), v.dtype(), 1);
      }
    }
    return s;
  }
  std::optional<std::vector<SnapshotPart>> after_nodes(std::vector<PlanBuilder>& replicas, const Replicas& reps,
                                                       const Differentiated& d, const GradientInputs& grad_sum,
                                                       SyncRegisters& regs,
                                                       const std::vector<std::optional<RegisterIndex>>& clip,
                                                       ParameterStore& params, const Placement& reporter_place,
                                                       std::vector<FinalWeight>& finals) override {
    auto parts = lower_zero(replicas, reps, d, grad_sum, regs.steps, clip, cfg_, params, reporter_place,
                            regs.zero3 ? &*regs.zero3 : nullptr);
    // Replica 0's gathers on the reporting rank write the store themselves (lower_zero).
    for (FinalWeight& f : finals) f.in_store = f.in_store || f.where.rank == reporter_place.rank;
    return parts;
  }
};

/// Parameter servers (lower_ps.cpp): the weights and their optimizer state on server actors,
/// each replica pushing its summed gradients and repeating the weights it pulls; server 0
/// reports the loss and gets the trained weights, so neither depends on a worker.
class ParameterServerSync final : public GradientSync {
 public:
  explicit ParameterServerSync(const TrainConfig& cfg) : GradientSync(cfg) {}
  std::string describe() const override {
    return fmt::format("parameter servers: {} server{}, staleness {}", cfg_.servers, cfg_.servers == 1 ? "" : "s",
                       cfg_.staleness);
  }
  SyncRegisters before_nodes(std::vector<PlanBuilder>& replicas, const Replicas&, const Differentiated& d,
                             const GradientInputs& grad_sum, const Stages& st, ParameterStore& params) override {
    SyncRegisters s;
    s.grad_in.resize(grad_sum.size());
    s.grad_windows.resize(grad_sum.size());
    s.steps.resize(grad_sum.size());
    // Each replica repeats the weights its server writes, as ZeRO's gathers.
    for (const auto& [id, w] : lower_parameter_servers(replicas, d, grad_sum, st, cfg_, params)) {
      for (auto& steps : s.steps) steps[id] = w;
    }
    return s;
  }
  Placement reporter(std::vector<PlanBuilder>& replicas, const Differentiated&) const override {
    PlanBuilder s0{replicas[0].g, replicas[0].plan, replicas[0].kernels};
    s0.places = {server_place(cfg_, 0)};
    return s0.host(forward_stream, 0);
  }
  // The pairs (loss, 1) summed on server 0, reported as sum / count: the mean over the workers
  // still there when one has left (docs/parameter-servers.md).
  std::shared_ptr<LossLog> report_loss(std::vector<PlanBuilder>& replicas, const Differentiated& d,
                                       const std::vector<RegisterIndex>& loss_regs) override {
    auto losses = std::make_shared<LossLog>(cfg_.microbatches);
    const DType loss_dt = d.loss.dtype();
    const auto [summed, where] = lower_ps_loss(replicas, loss_regs, loss_dt, replicas[0].place(d.loss.id()), cfg_);
    const DType pair_dt = loss_dt == DType::f64 ? DType::f64 : DType::f32;
    replicas[0].kernels.add_fn("loss.report", DeviceType::cpu, pair_dt, [losses, pair_dt](KernelContext& ctx) {
      const Tensor& t = *ctx.inputs[0];
      const double sum = pair_dt == DType::f64 ? t.data<double>()[0] : static_cast<double>(t.data<float>()[0]);
      const double count = pair_dt == DType::f64 ? t.data<double>()[1] : static_cast<double>(t.data<float>()[1]);
      losses->record(ctx.piece, sum / count);
    });
    replicas[0].plan.add_actor({.name = "loss.report",
                                .op = "loss.report",
                                .dtype = pair_dt,
                                .where = where,
                                .inputs = {{summed}},
                                .role = ActorRole::forward,
                                .reports_loss = true});
    return losses;
  }
};

}  // namespace

std::unique_ptr<GradientSync> choose_sync(const TrainConfig& cfg) {
  if (cfg.sync == "ps") return std::make_unique<ParameterServerSync>(cfg);
  if (cfg.zero > 0 && cfg.dp > 1) return std::make_unique<ZeroSync>(cfg);
  return std::make_unique<AllReduceSync>(cfg);
}

}  // namespace baton::passes::detail
