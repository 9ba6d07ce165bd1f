// The lowering pass (passes.h): graph -> actors and registers for every replica. A training
// plan's shape (compile.h):
//
//   data ──> forward ops ──> loss ──> loss.report
//                 ^    \──> backward ops ──> accumulate(M) ──┐
//   variable ──> repeat(M)                                   │ (delay 1: step s's weights come
//      ^──────────────────────────────────────────────────────┘  from step s-1's gradients)
//
// Under PipeDream-2BW (schedule "2bw", weight_delay) the gradient's delay is 2: step s's weights
// are step s-1's with step s-2's gradient applied, and the weight's register holds two versions.
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "baton/graph/collectives.h"
#include "baton/graph/schedule.h"
#include "lowering.h"

namespace baton::passes {

namespace detail {

namespace {

/// Runs another kernel with its piece numbers mapped: replica r of dp, M micro-batches a step,
/// reads micro-batch s*dp*M + r*M + k of the whole job where it is at its own piece s*M + k.
class ReplicaPieces final : public Kernel {
 public:
  ReplicaPieces(std::unique_ptr<Kernel> inner, std::int64_t replica, std::int64_t replicas,
                std::int64_t m)
      : inner_(std::move(inner)), replica_(replica), replicas_(replicas), m_(m) {}
  void compute(KernelContext& ctx) override {
    KernelContext mapped{ctx.inputs, ctx.outputs,
                         (ctx.piece / m_) * replicas_ * m_ + replica_ * m_ + ctx.piece % m_};
    inner_->compute(mapped);
  }

 private:
  std::unique_ptr<Kernel> inner_;
  std::int64_t replica_, replicas_, m_;
};

/// Fills ActorDesc::role and ::stage for people and tools (the dashboard's timeline): forward
/// and backward ops were labelled as they were made; the rest is told by kind and op. Each
/// (stage, shard) of each replica has its own device, which gives the stage.
void label_roles_and_stages(Plan& plan, const std::vector<PlanBuilder>& replicas) {
  std::map<std::pair<std::uint16_t, Device>, int> stage_of_device;
  for (const auto& b : replicas) {
    for (std::size_t i = 0; i < b.places.size(); ++i) {
      stage_of_device[{b.places[i].rank, b.places[i].device}] = static_cast<int>(i) / b.tp;
    }
  }
  for (ActorDesc& a : plan.actors) {
    // Model ops carry their own stage (a device may hold several: interleaved schedules).
    if (auto it = stage_of_device.find({a.where.rank, a.where.device});
        a.stage < 0 && it != stage_of_device.end()) {
      a.stage = it->second;
    }
    // Roles are given where actors are made (the variables, the data, the collectives); what
    // is left is told by its kind, never by its op's name.
    if (a.role != ActorRole::other) continue;
    if (a.kind == ActorKind::accumulate) {
      a.role = ActorRole::backward;
    } else if (a.kind == ActorKind::repeat) {
      a.role = ActorRole::update;
    }
  }
}

/// Replica `r`'s data: each binding is one source actor whose outputs are the inputs it feeds.
/// Returns the input nodes fed.
std::set<int> lower_data(PlanBuilder& b, std::int64_t r, const Stages& st, const TrainConfig& cfg) {
  std::set<int> fed;
  const std::int64_t n_dp = cfg.dp, m = cfg.microbatches;
  for (const DataBinding& d : cfg.data) {
    std::vector<RegisterIndex> outs;
    int data_stage = st.pp - 1;
    for (const std::string& in : d.inputs) {
      Value v = b.g.find(in);
      if (!v.valid() || v.node().op != "input") {
        throw GraphError(
            fmt::format("data '{}' feeds '{}', which is not an input of the graph", d.name, in));
      }
      fed.insert(v.id());
      // Deep enough that a later stage's reader (the labels, read by the loss) does not hold
      // the first stage's back.
      outs.push_back(b.node_register(v.id(), std::max<std::int32_t>(2, st.forward_slots[0])));
      data_stage = std::min(data_stage, b.stage(v.id()));
    }
    std::string op = b.named("data." + d.name);
    if (n_dp == 1) {
      b.kernels.add(op, DeviceType::cpu, DType::f32, d.source);
    } else {
      KernelFactory inner = d.source;
      b.kernels.add(op, DeviceType::cpu, DType::f32,
                    [inner, r, n_dp, m](const KernelConfig& kc) -> std::unique_ptr<Kernel> {
                      return std::make_unique<ReplicaPieces>(inner(kc), r, n_dp, m);
                    });
    }
    b.source_actor("data." + d.name, op, DType::f32, std::move(outs), (cfg.steps - cfg.first_step) * m,
                   b.host(forward_stream, st.device_of(data_stage) * b.tp), {}, ActorRole::data);
  }
  return fed;
}

/// The f32 variables that every needed reader casts to bf16 on the variable's own place
/// (autocast's weights), by id: candidates for TrainConfig::fuse_weight_casts.
std::set<int> cast_only_weights(const PlanBuilder& b, const Differentiated& d) {
  std::map<int, bool> only_casts;  // variable id -> every reader so far is such a cast
  for (int id = 0; id < b.g.size(); ++id) {
    if (!d.need[static_cast<std::size_t>(id)]) continue;
    const Node& n = b.g.node(id);
    for (int in : n.inputs) {
      const Node& v = b.g.node(in);
      if (v.op != "variable" || v.dtype != DType::f32) continue;
      const bool cast = n.op == "cast" && n.dtype == DType::bf16 && b.place(id) == b.place(in);
      auto [it, fresh] = only_casts.try_emplace(in, cast);
      it->second = it->second && cast;
    }
  }
  std::set<int> out;
  for (const auto& [id, ok] : only_casts) {
    if (ok) out.insert(id);
  }
  return out;
}

/// Replica `r`'s actors for the needed nodes, in topological order: variables, fills and ops.
void lower_nodes(PlanBuilder& b, std::int64_t r, const Differentiated& d, const Stages& st,
                 const TrainConfig& cfg, const std::set<int>& fed, const GradientInputs& grad_in,
                 const GradientWindows& grad_windows, const GradientInputs& zero_steps,
                 Zero3Layout* zero3, const std::optional<RegisterIndex>& clip,
                 ParameterStore& params, const Placement& reporter, std::vector<FinalWeight>& finals) {
  const int loss_id = d.loss.id();
  // Weights whose variable actors emit bf16 (TrainConfig::fuse_weight_casts): their readers'
  // casts are the variable's register itself (they are lowered after it: ids are topological).
  const std::set<int> cast_only = cfg.fuse_weight_casts ? cast_only_weights(b, d) : std::set<int>{};
  b.need = &d.need;
  std::set<int> emit_low;
  const auto stream_of = [&](int id) {
    return id <= loss_id ? forward_stream : backward_stream(cfg);
  };
  // A trained weight's gradient, with one micro-batch a step, needs one slot: its next write is
  // in the next step's backward pass, which needs this step's update, which needs this gradient
  // read (summed, all-reduced) first; a second slot would never be in use.
  std::set<int> one_slot;
  if (cfg.microbatches == 1) {
    for (const auto& [v, grad] : d.trained) one_slot.insert(grad.id());
  }
  for (int id = 0; id < b.g.size(); ++id) {
    if (!d.need[static_cast<std::size_t>(id)]) continue;
    const Node& n = b.g.node(id);
    if (n.op == "input") {
      if (!fed.count(id)) {
        throw GraphError(fmt::format("input '{}' ({}{}) is fed by no data source", n.name,
                                     name(n.dtype), to_string(n.shape)));
      }
    } else if (n.op == "variable") {
      // Under ZeRO 3 its shards are its bucket's optimizers' (lower_zero); its readers gather it.
      if (zero3 != nullptr && zero3->weights[static_cast<std::size_t>(r)].contains(id)) continue;
      const Placement where = b.at(backward_stream(cfg), b.place(id));
      if (auto z = zero_steps[static_cast<std::size_t>(r)].find(id);
          z != zero_steps[static_cast<std::size_t>(r)].end()) {
        // Under ZeRO the bucket's gather writes the weight (lower_zero); the store is no master.
        add_weight_repeat(b, id, z->second, st, cfg);
        // Kept where that register is written: a parameter server's own rank, so the final
        // weights reach the reporting server without a worker (who may leave) in between.
        // (ZeRO's gather is added later, by lower_zero: replica 0's place then.)
        const ActorIndex producer = b.plan.registers[z->second].producer;
        const Placement written = producer < b.plan.actors.size() ? b.plan.actors[producer].where : where;
        if (r == 0) finals.push_back({n.name, z->second, written, n.dtype, n.shape, false});
        continue;
      }
      auto it = grad_in[static_cast<std::size_t>(r)].find(id);
      const bool trained = it != grad_in[static_cast<std::size_t>(r)].end();
      const auto& windows = grad_windows[static_cast<std::size_t>(r)];
      const auto window = windows.find(id);
      const GradientAt grad = window != windows.end() ? window->second
                              : trained              ? GradientAt{{it->second}, 0}
                                                     : GradientAt{};
      // Replica 0's trained weight off the reporting rank sends its last piece there as the
      // final f32 weight (gather_final_weights): that register stays f32.
      const bool low = cast_only.contains(id) && !(r == 0 && trained && where.rank != reporter.rank);
      if (low) emit_low.insert(id);
      const RegisterIndex w = lower_variable(b, r, id, trained ? &grad : nullptr, clip ? &*clip : nullptr, st,
                                             cfg, params, true, low ? std::optional(DType::bf16) : std::nullopt);
      if (r == 0 && trained) finals.push_back({n.name, w, where, n.dtype, n.shape});
    } else if (n.op == "cast" && emit_low.contains(n.inputs[0])) {
      b.reg_of[id] = b.reg_of.at(n.inputs[0]);  // the variable's repeat is already bf16
    } else if (n.op == "fill" && n.inputs.empty()) {
      RegisterIndex reg = b.node_register(id, 2);
      b.source_actor(n.name, "fill", n.dtype, {reg},
                     (cfg.steps - cfg.first_step) * cfg.microbatches,
                     b.at(stream_of(id), b.place(id)), n.attrs);
    } else {
      // A ZeRO-3 weight is gathered just before its first reader in each pass.
      const bool backward = id > loss_id;
      for (int in : n.inputs) {
        if (zero3 != nullptr && zero3->weights[static_cast<std::size_t>(r)].contains(in) &&
            !(backward ? b.backward_reg_of : b.reg_of).contains(in))
          add_zero3_gather(b, static_cast<std::size_t>(r), in, *zero3, backward, st, cfg);
      }
      b.op_actor(id, stream_of(id),
                 id <= loss_id       ? st.forward_slots[static_cast<std::size_t>(b.stage(id))]
                 : one_slot.count(id) ? 1
                                     : st.backward_depth(b.stage(id)));
    }
  }
}

/// Replica `r`'s gradient accumulation (each trained weight's M micro-batch gradients summed
/// into `grad_sum`) and, with clipping, the actor that computes the step's clipping factor.
/// With one micro-batch a step there is nothing to sum: where the gradient is made on the
/// weight's own device, `grad_sum` is a view of it (a repeat of group 1, no bytes of its own)
/// instead of a copy, so each weight's gradient exists once less.
void lower_accumulation(PlanBuilder& b, std::int64_t r, const Differentiated& d,
                        const TrainConfig& cfg, const GradientInputs& grad_sum,
                        const GradientInputs& grad_in, const GradientWindows& grad_windows,
                        const std::optional<RegisterIndex>& clip) {
  std::vector<InputPort> clip_inputs;
  for (const auto& [v, grad] : d.trained) {
    const RegisterIndex gi = b.reg_of.at(grad.id());
    const Placement where = b.at(backward_stream(cfg), b.place(v.id()));
    const RegisterDesc& g = b.plan.registers[gi];
    const bool view = cfg.microbatches == 1 && g.producer < b.plan.actors.size() &&
                      b.plan.actors[g.producer].where.rank == where.rank &&
                      b.plan.actors[g.producer].where.device == where.device && g.dtype == v.dtype() &&
                      numel(g.shape) == numel(v.shape());
    b.plan.add_actor({.name = b.named("grad." + v.name() + (view ? ".view" : ".accumulate")),
                      .kind = view ? ActorKind::repeat : ActorKind::accumulate,
                      .op = view ? "view" : "",
                      .dtype = v.dtype(),
                      .where = where,
                      .inputs = {{gi}},
                      .outputs = {grad_sum[static_cast<std::size_t>(r)].at(v.id())},
                      .group = view ? 1 : static_cast<std::int32_t>(cfg.microbatches),
                      .role = ActorRole::backward});
    // Under ZeRO no variable reads a whole summed gradient (grad_in is empty): lower_zero clips.
    // Each register once: a weight's window may share its parts with its bucket's other weights.
    const auto& in = grad_in[static_cast<std::size_t>(r)];
    const auto& windows = grad_windows[static_cast<std::size_t>(r)];
    std::vector<RegisterIndex> parts;
    if (auto w = windows.find(v.id()); w != windows.end()) {
      parts = w->second.parts;
    } else if (auto it = in.find(v.id()); it != in.end()) {
      parts = {it->second};
    }
    for (RegisterIndex p : parts) {
      if (std::none_of(clip_inputs.begin(), clip_inputs.end(), [&](const InputPort& q) { return q.reg == p; }))
        clip_inputs.push_back({p});
    }
  }
  if (!clip || clip_inputs.empty()) return;
  const DType dt = d.trained[0].first.dtype();
  if (r == 0) add_clip_kernel(b.kernels, dt, cfg.optimizer.clip_norm);
  b.plan.add_actor({.name = b.named("optim.clip"),
                    .op = "optim.clip",
                    .dtype = dt,
                    .where = b.host(backward_stream(cfg)),
                    .inputs = clip_inputs,
                    .outputs = {*clip},
                    .role = ActorRole::update});
}


}  // namespace

/// An accumulate "last" beside the variable keeps the last of its `pieces` (steps + its weight
/// delay), so one piece crosses, once, at the end; a sink on the reporting rank copies it into
/// the ParameterStore.
void gather_final_weights(Plan& plan, KernelRegistry& kernels, ParameterStore& params,
                          const std::vector<FinalWeight>& finals, const Placement& reporter,
                          std::int64_t pieces) {
  for (const FinalWeight& f : finals) {
    if (f.in_store && f.where.rank == reporter.rank) continue;
    const std::string name = "final." + f.name;
    RegisterIndex last =
        plan.add_register({.name = name, .shape = f.shape, .dtype = f.dtype, .slots = 1});
    plan.add_actor({.name = name + ".last",
                    .kind = ActorKind::accumulate,
                    .op = "last",
                    .dtype = f.dtype,
                    .where = f.where,
                    .inputs = {{f.reg}},
                    .outputs = {last},
                    .group = static_cast<std::int32_t>(pieces),
                    .role = ActorRole::update,
                    .at_end = true});
    Tensor dest = params.at(f.name);
    kernels.add_fn(name, DeviceType::cpu, f.dtype,
                   [dest](KernelContext& ctx) mutable { copy_tensor(*ctx.inputs[0], dest); });
    plan.add_actor({.name = name,
                    .op = name,
                    .dtype = f.dtype,
                    .where = reporter,
                    .inputs = {{last}},
                    .role = ActorRole::update});
  }
}

}  // namespace detail

TrainingJob lower(Graph& g, const Differentiated& d, const Shards& shards, const Stages& st,
                  const Replicas& reps, const TrainConfig& cfg,
                  std::shared_ptr<ParameterStore> params) {
  using namespace detail;
  check_weight_delay(cfg);
  Plan plan;
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  if (cfg.dp > 1) add_collective_kernels(kernels);
  std::vector<PlanBuilder> replicas;
  // The B/W split, only where the schedule runs W work on its own.
  const bool split = cfg.pp > 1 && splits_backward(parse_schedule(cfg.schedule));
  const std::vector<bool> weight_work = split ? weight_gradient_nodes(g, d) : std::vector<bool>{};
  for (std::int64_t r = 0; r < cfg.dp; ++r) {
    PlanBuilder b{g, plan, kernels};
    b.places = reps.places[static_cast<std::size_t>(r)];
    b.tp = cfg.tp;
    if (cfg.pp > 1) b.stages = &st;
    if (split) b.weight_work = &weight_work;
    if (cfg.tp > 1) b.shards = &shards;
    b.loss_id = d.loss.id();
    b.first_piece = cfg.first_step * cfg.microbatches;
    b.suffix = reps.suffix(r);
    replicas.push_back(std::move(b));
  }
  // Every replica's summed gradient, and what its variable actors read: the same register with
  // one replica, the all-reduced one with several (made first: variables read them, with a
  // delay, before the actors that write them are added).
  GradientInputs grad_sum(static_cast<std::size_t>(cfg.dp));
  for (const auto& [v, grad] : d.trained) {
    for (std::int64_t r = 0; r < cfg.dp; ++r) {
      grad_sum[static_cast<std::size_t>(r)][v.id()] =
          replicas[static_cast<std::size_t>(r)].add_register("grad." + v.name(), v.shape(),
                                                             v.dtype(), 1);
    }
  }
  // How the replicas' gradients become the weights they read next (sync.cpp): the actors it
  // adds are listed by --print-after sync.
  const std::unique_ptr<GradientSync> sync = choose_sync(cfg);
  std::vector<std::pair<std::size_t, std::size_t>> sync_actors;  // [from, to) plan indices
  const auto by_sync = [&](auto&& add) {
    const std::size_t from = plan.actors.size();
    add();
    sync_actors.emplace_back(from, plan.actors.size());
  };
  SyncRegisters regs;
  by_sync([&] { regs = sync->before_nodes(replicas, reps, d, grad_sum, st, *params); });
  std::vector<std::optional<RegisterIndex>> clip(static_cast<std::size_t>(cfg.dp));
  if (cfg.optimizer.clip_norm > 0 && !d.trained.empty()) {
    for (std::int64_t r = 0; r < cfg.dp; ++r) {
      clip[static_cast<std::size_t>(r)] = replicas[static_cast<std::size_t>(r)].add_register(
          "clip.factor", {1}, d.trained[0].first.dtype(), 1);
    }
  }
  // Replica 0's trained weights: where each one's steps come out (see gather_final_weights).
  std::vector<FinalWeight> finals;
  std::vector<RegisterIndex> loss_regs;
  const Placement reporter = sync->reporter(replicas, d);
  for (std::int64_t r = 0; r < cfg.dp; ++r) {
    PlanBuilder& b = replicas[static_cast<std::size_t>(r)];
    const std::set<int> fed = lower_data(b, r, st, cfg);
    lower_nodes(b, r, d, st, cfg, fed, regs.grad_in, regs.grad_windows, regs.steps,
                regs.zero3 ? &*regs.zero3 : nullptr, clip[static_cast<std::size_t>(r)], *params, reporter, finals);
    lower_accumulation(b, r, d, cfg, grad_sum, regs.grad_in, regs.grad_windows, clip[static_cast<std::size_t>(r)]);
    loss_regs.push_back(b.reg_of.at(d.loss.id()));
  }
  std::optional<std::vector<SnapshotPart>> sync_snapshots;
  by_sync([&] {
    sync_snapshots = sync->after_nodes(replicas, reps, d, grad_sum, regs, clip, *params, reporter, finals);
  });
  std::shared_ptr<LossLog> losses;
  by_sync([&] { losses = sync->report_loss(replicas, d, loss_regs); });
  print_after(cfg, "sync", [&] {
    std::string text = "gradient sync: " + sync->describe() + "\n";
    for (const auto& [from, to] : sync_actors) {
      for (std::size_t i = from; i < to; ++i) {
        const ActorDesc& a = plan.actors[i];
        text += fmt::format("  {} ({} {}) at rank {} {}\n", a.name, name(a.kind), a.op, a.where.rank, a.where.device.str());
      }
    }
    return text;
  });
  gather_final_weights(plan, kernels, *params, finals, reporter,
                       cfg.steps - cfg.first_step + weight_delay(cfg));
  label_roles_and_stages(plan, replicas);
  std::map<std::string, Placement> trained_at;
  for (const auto& [v, grad] : d.trained) {  // ZeRO 3's weights: no FinalWeight (lower_zero stores them)
    if (regs.zero3 && regs.zero3->weights[0].contains(v.id()))
      trained_at[v.name()] = replicas[0].at(backward_stream(cfg), replicas[0].place(v.id()));
  }
  std::vector<SnapshotPart> snapshots = sync_snapshots.value_or(std::vector<SnapshotPart>{});
  for (const FinalWeight& f : finals) {
    // Trained (and snapshotted) where the register of its steps is written: a parameter
    // server's weight where its variable runs.
    trained_at[f.name] = f.where;
    if (!sync_snapshots) snapshots.push_back({.name = f.name, .shape = f.shape, .dtype = f.dtype, .rank = f.where.rank});
  }
  return TrainingJob{std::move(plan), std::move(kernels), std::move(params), std::move(losses),
                     std::move(trained_at), std::move(snapshots)};
}

}  // namespace baton::passes
