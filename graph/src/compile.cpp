// Graph -> plan for one device. See compile.h for the shape of a training plan:
//
//   data ──> forward ops ──> loss ──> loss.report
//                 ^    \──> backward ops ──> accumulate(M) ──┐
//   variable ──> repeat(M)                                   │ (delay 1: step s's weights come
//      ^──────────────────────────────────────────────────────┘  from step s-1's gradients)
#include "baton/graph/compile.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/actors/runtime.h"
#include "baton/graph/autodiff.h"
#include "baton/graph/collectives.h"
#include "baton/graph/profile.h"
#include "baton/graph/schedule.h"
#include "baton/kernels/nccl.h"
#include "baton/kernels/optim.h"
#include "device_variables.h"

namespace baton {

namespace {

DType kernel_dtype(const Graph& g, const Node& n) {
  if (is_floating(n.dtype)) return n.dtype;
  for (int in : n.inputs) {
    if (is_floating(g.node(in).dtype)) return g.node(in).dtype;
  }
  return DType::f32;
}

void copy_tensor(const Tensor& from, Tensor& to) {
  if (from.nbytes() != to.nbytes()) {
    throw std::invalid_argument(fmt::format("copy of {} into {}", from.describe(), to.describe()));
  }
  std::memcpy(to.raw(), from.raw(), from.nbytes());
}

/// A source that writes a fixed tensor (a weight that is not trained, a feed).
class ConstantSource final : public Kernel {
 public:
  explicit ConstantSource(Tensor value) : value_(std::move(value)) {}
  void compute(KernelContext& ctx) override { copy_tensor(value_, *ctx.outputs[0]); }

 private:
  Tensor value_;
};

using detail::SnapshotHook;

/// A weight with its optimizer. Act 0 emits the initial value; act k >= 1 applies step k-1's
/// summed gradient (input 0, read with delay 1), scaled by the clipping factor (input 1, if
/// any), then emits the new value. The master copy is the ParameterStore's tensor itself. A
/// resumed job's actor starts at piece first_step (its acts count steps), from saved slots.
template <class T>
class VariableKernel final : public Kernel {
 public:
  VariableKernel(Tensor master, OptimizerConfig cfg, std::int64_t total_steps, const std::map<std::string, Tensor>* slots,
                 SnapshotHook snapshots)
      : master_(std::move(master)), cfg_(cfg), total_steps_(total_steps), snapshots_(std::move(snapshots)) {
    auto n = static_cast<std::size_t>(master_.numel());
    if (cfg_.kind == OptimizerConfig::Kind::sgd) {
      if (cfg_.momentum != 0.0) m_.assign(n, T(0));
    } else {
      m_.assign(n, T(0));
      v_.assign(n, T(0));
    }
    if (slots != nullptr) {  // compile_training checked their names, shapes and dtypes
      const auto names = optimizer_slot_names(cfg_);
      for (std::size_t i = 0; i < names.size(); ++i) {
        auto from = slots->at(names[i]).template data<T>();
        std::copy(from.begin(), from.end(), (i == 0 ? m_ : v_).begin());
      }
    }
  }
  void compute(KernelContext& ctx) override {
    if (!ctx.inputs.empty() && ctx.inputs[0] != nullptr) update(ctx);
    copy_tensor(master_, *ctx.outputs[0]);
  }

 private:
  void update(KernelContext& ctx) {
    const std::int64_t step = ctx.piece;  // 1-based: act k applies the k-th update
    auto g = ctx.inputs[0]->data<T>();
    std::span<const T> grad = g;
    if (ctx.inputs.size() > 1 && ctx.inputs[1] != nullptr) {
      double factor = static_cast<double>(ctx.inputs[1]->data<T>()[0]);
      if (factor != 1.0) {
        scaled_.resize(g.size());
        for (std::size_t i = 0; i < g.size(); ++i) scaled_[i] = static_cast<T>(g[i] * factor);
        grad = scaled_;
      }
    }
    const double lr = learning_rate(cfg_, step, total_steps_);
    auto w = master_.data<T>();
    if (cfg_.kind == OptimizerConfig::Kind::sgd) {
      SgdConfig c{cfg_.lr, cfg_.momentum, cfg_.weight_decay, cfg_.nesterov};
      sgd_step(w, grad, std::span<T>(m_), c, step, lr);
    } else {
      AdamConfig c{cfg_.lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay,
                   cfg_.kind == OptimizerConfig::Kind::adamw};
      adam_step(w, grad, std::span<T>(m_), std::span<T>(v_), c, step, lr);
    }
    if (snapshots_.hand_over && snapshots_.every > 0 && (step % snapshots_.every == 0 || step == total_steps_)) {
      hand_over(step);
    }
  }

  void hand_over(std::int64_t step) {
    auto copy_of = [&](std::span<const T> from) {
      Tensor t = Tensor::empty(master_.shape(), master_.dtype());
      std::copy(from.begin(), from.end(), t.data<T>().begin());
      return t;
    };
    VariableSnapshot s{.name = snapshots_.name, .step = step, .weight = copy_of(master_.data<T>())};
    const auto names = optimizer_slot_names(cfg_);
    for (std::size_t i = 0; i < names.size(); ++i) s.slots[names[i]] = copy_of(i == 0 ? m_ : v_);
    snapshots_.hand_over(std::move(s));
  }

  Tensor master_;
  OptimizerConfig cfg_;
  std::int64_t total_steps_;
  SnapshotHook snapshots_;
  std::vector<T> m_, v_, scaled_;
};

/// Global-norm clipping: reads every summed gradient of a step, writes the factor.
template <class T>
class ClipKernel final : public Kernel {
 public:
  explicit ClipKernel(double max_norm) : max_norm_(max_norm) {}
  void compute(KernelContext& ctx) override {
    double sq = 0;
    for (const Tensor* g : ctx.inputs) {
      for (T x : g->data<T>()) sq += static_cast<double>(x) * static_cast<double>(x);
    }
    ctx.outputs[0]->data<T>()[0] = static_cast<T>(clip_factor(std::sqrt(sq), max_norm_));
  }

 private:
  double max_norm_;
};

template <class T>
double scalar_of(const Tensor& t) {
  return static_cast<double>(t.data<T>()[0]);
}

/// Builds the actors and registers for the nodes a plan needs: one model replica's worth, with
/// names suffixed and actors placed for that replica.
struct PlanBuilder {
  Graph& g;
  Plan& plan;
  KernelRegistry& kernels;
  /// Rank and device of each (pipeline stage, tensor shard) of this replica, at stage * tp + shard.
  std::vector<Placement> places{Placement{}};
  int tp = 1;
  const std::vector<int>* stage_of = nullptr;  // node -> pipeline stage (null: all 0)
  const std::vector<int>* shard_of = nullptr;  // node -> tensor-parallel shard (null: all 0)
  std::string suffix;      // "" for one replica, "@dp<r>" otherwise
  std::map<int, RegisterIndex> reg_of;  // node -> the register its per-micro-batch value is in
  int loss_id = std::numeric_limits<int>::max();  // nodes up to it are the forward pass
  std::int64_t first_piece = 0;  // a resumed job's first micro-batch (ActorDesc::first_piece)

  std::string named(const std::string& n) const { return n + suffix; }
  int stage(int id) const { return stage_of == nullptr ? 0 : (*stage_of)[static_cast<std::size_t>(id)]; }
  int shard(int id) const { return shard_of == nullptr ? 0 : (*shard_of)[static_cast<std::size_t>(id)]; }
  /// The node's index into `places`.
  int place(int id) const { return stage(id) * tp + shard(id); }
  Placement at(std::uint8_t stream, int place = 0) const {
    Placement p = places[static_cast<std::size_t>(place)];
    p.stream = stream;
    return p;
  }
  /// Where the host side of a place runs (data sources, loss reports, clipping: CPU closures):
  /// the place itself on a CPU device; beside a CUDA device, the CPU device of the same rank and
  /// index, whose registers the device copy actors read and write (insert_device_copies).
  Placement host(std::uint8_t stream, int place = 0) const {
    Placement p = at(stream, place);
    if (p.device.type == DeviceType::cuda) p.device = Device{DeviceType::cpu, p.device.index};
    return p;
  }

  RegisterIndex add_register(const std::string& name, const Shape& shape, DType dtype, std::int32_t slots) {
    return plan.add_register({.name = named(name), .shape = shape, .dtype = dtype, .slots = slots});
  }

  RegisterIndex node_register(int id, std::int32_t slots) {
    const Node& n = g.node(id);
    RegisterIndex r = add_register(n.name, n.shape, n.dtype, slots);
    reg_of[id] = r;
    return r;
  }

  void op_actor(int id, std::uint8_t stream, std::int32_t slots) {
    const Node& n = g.node(id);
    std::vector<InputPort> inputs;
    for (int in : n.inputs) inputs.push_back({reg_of.at(in)});
    RegisterIndex out = node_register(id, slots);
    plan.add_actor({.name = named(n.name), .kind = ActorKind::compute, .op = n.op, .dtype = kernel_dtype(g, n),
                    .where = at(stream, place(id)), .inputs = std::move(inputs), .outputs = {out},
                    .first_piece = first_piece, .attrs = n.attrs,
                    .role = id <= loss_id ? ActorRole::forward : ActorRole::backward});
  }

  void source_actor(const std::string& name, const std::string& op, DType dtype, std::vector<RegisterIndex> outputs,
                    std::int64_t pieces, const Placement& where, Attrs attrs = {}) {
    plan.add_actor({.name = named(name), .kind = ActorKind::source, .op = op, .dtype = dtype, .where = where,
                    .outputs = std::move(outputs), .pieces = pieces, .first_piece = first_piece,
                    .attrs = std::move(attrs)});
  }
};

/// A trained weight of replica 0: the register its variable actor writes once per step (and
/// once more with the last step's update applied), and where that actor runs.
struct FinalWeight {
  std::string name;
  RegisterIndex reg;
  Placement where;
  DType dtype;
  Shape shape;
};

/// The process that reports (loss.report's rank) evaluates the trained weights, but a weight
/// placed on another rank is trained there: its final value comes over as part of the plan. An
/// accumulate "last" beside the variable keeps the last of its steps + 1 pieces, so one piece
/// crosses, once, at the end; a sink on the reporting rank copies it into the ParameterStore.
void gather_final_weights(Plan& plan, KernelRegistry& kernels, ParameterStore& params,
                          const std::vector<FinalWeight>& finals, const Placement& reporter, std::int64_t steps) {
  for (const FinalWeight& f : finals) {
    if (f.where.rank == reporter.rank) continue;
    const std::string name = "final." + f.name;
    RegisterIndex last = plan.add_register({.name = name, .shape = f.shape, .dtype = f.dtype, .slots = 1});
    plan.add_actor({.name = name + ".last", .kind = ActorKind::accumulate, .op = "last", .dtype = f.dtype,
                    .where = f.where, .inputs = {{f.reg}}, .outputs = {last},
                    .group = static_cast<std::int32_t>(steps + 1), .role = ActorRole::update});
    Tensor dest = params.at(f.name);
    kernels.add_fn(name, DeviceType::cpu, f.dtype, [dest](KernelContext& ctx) mutable {
      copy_tensor(*ctx.inputs[0], dest);
    });
    plan.add_actor({.name = name, .op = name, .dtype = f.dtype, .where = reporter, .inputs = {{last}},
                    .role = ActorRole::update});
  }
}

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
    if (auto it = stage_of_device.find({a.where.rank, a.where.device}); it != stage_of_device.end()) {
      a.stage = it->second;
    }
    if (a.role != ActorRole::other) continue;
    if (a.op.starts_with("allreduce.")) {
      a.role = ActorRole::collective;
    } else if (a.kind == ActorKind::accumulate) {
      a.role = ActorRole::backward;
    } else if (a.kind == ActorKind::repeat || a.op.starts_with("variable.") || a.op == "optim.clip") {
      a.role = ActorRole::update;
    } else if (a.kind == ActorKind::source && a.op.starts_with("data.")) {
      a.role = ActorRole::data;
    } else if (a.op == "loss.report") {
      a.role = ActorRole::forward;
    }
  }
}

/// Runs another kernel with its piece numbers mapped: replica r of dp, M micro-batches a step,
/// reads micro-batch s*dp*M + r*M + k of the whole job where it is at its own piece s*M + k.
class ReplicaPieces final : public Kernel {
 public:
  ReplicaPieces(std::unique_ptr<Kernel> inner, std::int64_t replica, std::int64_t replicas, std::int64_t m)
      : inner_(std::move(inner)), replica_(replica), replicas_(replicas), m_(m) {}
  void compute(KernelContext& ctx) override {
    KernelContext mapped{ctx.inputs, ctx.outputs, (ctx.piece / m_) * replicas_ * m_ + replica_ * m_ + ctx.piece % m_};
    inner_->compute(mapped);
  }

 private:
  std::unique_ptr<Kernel> inner_;
  std::int64_t replica_, replicas_, m_;
};

/// The all-reduce of `inputs[r]` (replica r's register) over the replicas (collectives.h),
/// each member placed at its replica's `place` and `stream`; returns the N result registers.
std::vector<RegisterIndex> add_allreduce(std::vector<PlanBuilder>& replicas, const std::string& name,
                                         const std::vector<RegisterIndex>& inputs, const Shape& shape, DType dtype,
                                         std::uint8_t stream, std::int32_t result_slots, int place) {
  std::vector<AllReduceMember> members;
  for (std::size_t r = 0; r < replicas.size(); ++r) {
    members.push_back({replicas[r].at(stream, place), inputs[r], replicas[r].suffix});
  }
  return add_allreduce(replicas[0].plan, name, members, shape, dtype, result_slots);
}

/// Every actor placed on a CUDA device has a CUDA kernel for its op and dtype, or the job is
/// refused here, naming them, rather than when the runtime makes the kernels.
void check_cuda_kernels(const Plan& plan, const KernelRegistry& kernels) {
  std::vector<std::string> missing;
  for (const ActorDesc& a : plan.actors) {
    if (a.where.device.type != DeviceType::cuda) continue;
    std::vector<std::string> ops;
    if (a.kind == ActorKind::accumulate) {
      ops = a.op == "last" ? std::vector<std::string>{"copy"} : std::vector<std::string>{"copy", "add"};
    } else if (a.kind == ActorKind::compute || a.kind == ActorKind::source) {
      ops = {a.op};
    }
    for (const std::string& op : ops) {
      if (!kernels.contains(op, DeviceType::cuda, a.dtype)) {
        missing.push_back(fmt::format("'{}' ({} {})", a.name, op, name(a.dtype)));
      }
    }
  }
  if (missing.empty()) return;
  const std::size_t shown = std::min<std::size_t>(missing.size(), 8);
  throw GraphError(fmt::format("{} actor{} on a CUDA device ha{} no CUDA kernel: {}{}; place {} on the CPU",
                               missing.size(), missing.size() == 1 ? "" : "s", missing.size() == 1 ? "s" : "ve",
                               fmt::join(missing.begin(), missing.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
                               missing.size() > shown ? ", ..." : "", missing.size() == 1 ? "it" : "them"));
}

/// The stream NCCL all-reduce actors run on: a worker and CUDA stream of their own, so that a
/// collective waiting for its peers holds up neither compute nor copies.
constexpr std::uint8_t nccl_stream = 14;
/// Their lanes (ActOrder): one per (rank, device), above any pipeline stage's.
constexpr std::int32_t nccl_lane_base = 1 << 20;

/// Whether a bucket's all-reduce over these members goes through NCCL (TrainConfig::collectives).
bool use_nccl(const TrainConfig& cfg, const std::vector<PlanBuilder>& replicas, int place) {
  const bool all_cuda = std::all_of(replicas.begin(), replicas.end(), [&](const PlanBuilder& b) {
    return b.at(0, place).device.type == DeviceType::cuda;
  });
  if (cfg.collectives == "actors") return false;
  if (cfg.collectives == "auto") return all_cuda && nccl::built_with_nccl();
  if (!all_cuda) {
    throw GraphError("collectives 'nccl' needs every replica on a CUDA device; use 'actors' (or 'auto')");
  }
  if (!nccl::built_with_nccl()) throw GraphError("collectives 'nccl': baton was built without NCCL");
  return true;
}

/// Nodes that the targets depend on (ids are topological, so one backward sweep finds them).
std::vector<bool> needed_nodes(const Graph& g, const std::vector<Value>& targets) {
  std::vector<bool> need(static_cast<std::size_t>(g.size()), false);
  for (const Value& t : targets) need[static_cast<std::size_t>(t.id())] = true;
  for (int id = g.size() - 1; id >= 0; --id) {
    if (!need[static_cast<std::size_t>(id)]) continue;
    for (int in : g.node(id).inputs) need[static_cast<std::size_t>(in)] = true;
  }
  return need;
}

/// An op's estimated cost, for balancing pipeline stages: multiply-adds for a matrix product,
/// output elements for the rest.
double op_cost(const Graph& g, const Node& n) {
  const double out = static_cast<double>(numel(n.shape));
  if ((n.op == "matmul" || n.op == "batch_matmul") && !n.inputs.empty()) {
    const Shape& a = g.node(n.inputs[0]).shape;
    return out * static_cast<double>(a.empty() ? 1 : a.back());
  }
  return std::max(1.0, out);
}

/// Pipeline stages: the forward ops (in order) cut into `stages` runs of about equal estimated
/// cost; inputs and variables go with their first reader; a backward op goes with the forward op
/// whose backward step made it (Node::grad_of): the gradient of a weight is made where the
/// weight and its accumulation live, and only dx crosses back to the stage before. A backward op
/// without one goes with the latest stage among its forward inputs, or, with none, with the
/// earliest among its inputs (where the summed gradient is needed next). `measured`: each node's
/// profiled cost (profile.h) to cut by instead of the estimate.
std::vector<int> assign_stages(const Graph& g, const std::vector<bool>& need, int loss_id, int stages,
                               const std::vector<double>* measured = nullptr) {
  std::vector<int> stage(static_cast<std::size_t>(g.size()), -1);
  auto is_leaf = [&](const Node& n) { return n.op == "input" || n.op == "variable" || (n.op == "fill" && n.inputs.empty()); };
  double total = 0;
  int ops = 0;
  for (int id = 0; id <= loss_id; ++id) {
    const Node& n = g.node(id);
    if (!need[static_cast<std::size_t>(id)] || is_leaf(n)) continue;
    total += measured ? (*measured)[static_cast<std::size_t>(id)] : op_cost(g, n);
    ++ops;
  }
  if (ops < stages) {
    throw GraphError(fmt::format("a {}-stage pipeline needs at least {} ops in the forward pass; this one has {}", stages,
                                 stages, ops));
  }
  double done = 0;
  int last = 0, placed = 0;
  for (int id = 0; id <= loss_id; ++id) {
    const Node& n = g.node(id);
    if (!need[static_cast<std::size_t>(id)] || is_leaf(n)) continue;
    const double c = measured ? (*measured)[static_cast<std::size_t>(id)] : op_cost(g, n);
    int s = static_cast<int>((done + c / 2) / total * stages);
    // Stages in order, none skipped (at most one past the previous op's), and never so early
    // that too few ops are left for the stages after this one.
    const int lo = std::max(last, stages - (ops - placed));
    const int hi = placed == 0 ? 0 : last + 1;
    s = std::clamp(s, lo, std::max(lo, hi));
    stage[static_cast<std::size_t>(id)] = s;
    last = s;
    done += c;
    ++placed;
  }
  for (int id = 0; id < g.size(); ++id) {
    if (!need[static_cast<std::size_t>(id)]) continue;
    const Node& n = g.node(id);
    if (id > loss_id && n.grad_of >= 0 && stage[static_cast<std::size_t>(n.grad_of)] >= 0) {
      stage[static_cast<std::size_t>(id)] = stage[static_cast<std::size_t>(n.grad_of)];
    } else if (id > loss_id) {
      int fwd = -1, any = stages;
      for (int in : n.inputs) {
        const int s = stage[static_cast<std::size_t>(in)];
        if (in <= loss_id && !is_leaf(g.node(in))) fwd = std::max(fwd, s);
        if (s >= 0) any = std::min(any, s);
      }
      stage[static_cast<std::size_t>(id)] = fwd >= 0 ? fwd : (any < stages ? any : stages - 1);
    }
    // Leaves and forward ops give their stage to the leaves they read, if those have none yet.
    for (int in : n.inputs) {
      if (is_leaf(g.node(in)) && stage[static_cast<std::size_t>(in)] < 0) {
        stage[static_cast<std::size_t>(in)] = stage[static_cast<std::size_t>(id)];
      }
    }
  }
  for (auto& s : stage) s = std::max(s, 0);
  return stage;
}

/// Tensor-parallel shards: a forward node keeps the shard the model gave it (Graph::Shard; -1,
/// shared, runs on shard 0); a backward node goes with the highest shard among its inputs, so
/// the gradient of shard k's weights and activations is computed where they live.
std::vector<int> assign_shards(const Graph& g, const std::vector<bool>& need, int loss_id, int tp) {
  std::vector<int> shard(static_cast<std::size_t>(g.size()), 0);
  bool any = false;
  for (int id = 0; id < g.size(); ++id) {
    if (!need[static_cast<std::size_t>(id)]) continue;
    const Node& n = g.node(id);
    if (n.tp_shard >= tp) {
      throw GraphError(fmt::format("'{}' is on tensor-parallel shard {} but tp is {}", n.name, n.tp_shard, tp));
    }
    if (id <= loss_id || n.tp_shard >= 0) {
      shard[static_cast<std::size_t>(id)] = std::max(0, n.tp_shard);
      any = any || n.tp_shard > 0;
    } else {
      int s = 0;
      for (int in : n.inputs) s = std::max(s, shard[static_cast<std::size_t>(in)]);
      shard[static_cast<std::size_t>(id)] = s;
    }
  }
  if (!any) {
    throw GraphError(fmt::format("tp is {} but no node of the model is on a shard above 0 (annotate its weights with "
                                 "sbp::split and shard it with shard_graph, as models::mlp does, or build it with "
                                 "Graph::shard scopes, as models::gpt does)",
                                 tp));
  }
  return shard;
}

/// The saved optimizer slots of trained variable `n` in a resumed job (null: start at zero),
/// checked against the variable and the optimizer.
const std::map<std::string, Tensor>* optimizer_slots_of(const TrainConfig& cfg, const Node& n) {
  if (!cfg.optimizer_state) return nullptr;
  auto it = cfg.optimizer_state->find(n.name);
  const auto names = optimizer_slot_names(cfg.optimizer);
  if (it == cfg.optimizer_state->end()) {
    if (names.empty()) return nullptr;
    throw GraphError(fmt::format("the optimizer state has no slots for trained variable '{}'", n.name));
  }
  for (const std::string& slot : names) {
    auto s = it->second.find(slot);
    if (s == it->second.end()) {
      throw GraphError(fmt::format("the optimizer state of '{}' has no '{}' ({} keeps {})", n.name, slot,
                                   name(cfg.optimizer.kind), fmt::join(names, " and ")));
    }
    if (s->second.shape() != n.shape || s->second.dtype() != n.dtype) {
      throw GraphError(fmt::format("the optimizer state '{}' of '{}' is {} but the variable is {}{}", slot, n.name,
                                   s->second.describe(), baton::name(n.dtype), to_string(n.shape)));
    }
  }
  return &it->second;
}

}  // namespace

TrainingJob compile_training(Graph& g, Value loss, const TrainConfig& cfg, std::shared_ptr<ParameterStore> params) {
  if (!loss.valid() || &loss.graph() != &g) throw GraphError("compile_training: the loss is not a value of this graph");
  if (!loss.shape().empty()) throw GraphError(fmt::format("the loss must be a scalar; {} is not", loss.describe()));
  if (cfg.steps < 1) throw GraphError(fmt::format("steps must be >= 1, not {}", cfg.steps));
  if (cfg.first_step < 0 || cfg.first_step >= cfg.steps) {
    throw GraphError(fmt::format("a job of {} steps cannot start after step {}", cfg.steps, cfg.first_step));
  }
  if (cfg.microbatches < 1) throw GraphError(fmt::format("microbatches must be >= 1, not {}", cfg.microbatches));
  if (cfg.dp < 1) throw GraphError(fmt::format("dp must be >= 1, not {}", cfg.dp));
  if (cfg.pp < 1) throw GraphError(fmt::format("pp must be >= 1, not {}", cfg.pp));
  if (cfg.schedule != "gpipe" && cfg.schedule != "1f1b") {
    throw GraphError(fmt::format("schedule '{}': gpipe or 1f1b", cfg.schedule));
  }
  if (cfg.tp < 1) throw GraphError(fmt::format("tp must be >= 1, not {}", cfg.tp));
  if (cfg.collectives != "auto" && cfg.collectives != "actors" && cfg.collectives != "nccl") {
    throw GraphError(fmt::format("collectives '{}': auto, actors or nccl", cfg.collectives));
  }
  if (cfg.balance != "flops" && cfg.balance != "profile") {
    throw GraphError(fmt::format("balance '{}': flops or profile", cfg.balance));
  }
  if (cfg.pp > 1 && cfg.balance == "profile" &&
      std::any_of(cfg.replica_places.begin(), cfg.replica_places.end(), [](const Placement& p) { return p.rank != 0; })) {
    // Timings differ from rank to rank, and so would the plans (whose hashes must match).
    throw GraphError("balance 'profile' times the kernels on this process, so ranks would cut the stages differently; "
                     "use 'flops' for a job over several ranks");
  }
  const int n_places = cfg.dp * cfg.pp * cfg.tp;
  if (!cfg.replica_places.empty() && cfg.replica_places.size() != static_cast<std::size_t>(n_places)) {
    throw GraphError(fmt::format("dp {} x pp {} x tp {} is {} but {} replica places are given", cfg.dp, cfg.pp, cfg.tp,
                                 n_places, cfg.replica_places.size()));
  }
  if (n_places > Device::max_index + 1 && cfg.replica_places.empty()) {
    throw GraphError(fmt::format("dp {} x pp {} x tp {} needs {} in-process devices; at most {}", cfg.dp, cfg.pp,
                                 cfg.tp, n_places, Device::max_index + 1));
  }
  const bool any_cuda = std::any_of(cfg.replica_places.begin(), cfg.replica_places.end(),
                                    [](const Placement& p) { return p.device.type == DeviceType::cuda; });
  if (!params) params = ParameterStore::initialize(g);
  const std::int64_t m = cfg.microbatches;
  const std::int64_t n_dp = cfg.dp;
  const std::int64_t run_steps = cfg.steps - cfg.first_step;  // this job's steps (a resumed one's rest)
  const std::int64_t pieces = run_steps * m;
  const int loss_id = loss.id();

  // Gradients of the mean loss over the global batch (dp x M micro-batches): each micro-batch's
  // gradient is scaled by 1/(dp M); the accumulate actors sum a replica's M, the all-reduce the
  // replicas'.
  std::vector<Value> vars;
  for (Value v : g.variables()) {
    if (v.node().trainable && v.id() < loss_id) vars.push_back(v);
  }
  std::vector<Value> grads = gradients(loss, vars, 1.0 / static_cast<double>(m * n_dp));
  std::vector<Value> targets{loss};
  std::vector<std::pair<Value, Value>> trained;  // (variable, gradient)
  for (std::size_t i = 0; i < vars.size(); ++i) {
    if (grads[i].valid()) {
      targets.push_back(grads[i]);
      trained.emplace_back(vars[i], grads[i]);
    }
  }
  std::vector<bool> need = needed_nodes(g, targets);
  const int n_pp = cfg.pp;
  std::vector<double> measured;
  if (n_pp > 1 && cfg.balance == "profile") {
    // A stage runs its forward ops and their backward steps (Node::grad_of), so a forward op
    // costs both. A kernel too fast to time still counts a little, so that no stage is cut
    // from nothing.
    measured = profile_op_costs(g, *params, {.only = need});
    for (int id = g.size() - 1; id > loss_id; --id) {
      const int of = g.node(id).grad_of;
      if (of >= 0) measured[static_cast<std::size_t>(of)] += measured[static_cast<std::size_t>(id)];
    }
    for (double& c : measured) c = std::max(c, 1e-9);
  }
  const std::vector<int> stages =
      n_pp > 1 ? assign_stages(g, need, loss_id, n_pp, measured.empty() ? nullptr : &measured) : std::vector<int>{};
  const std::vector<int> shards = cfg.tp > 1 ? assign_shards(g, need, loss_id, cfg.tp) : std::vector<int>{};
  // Activation slots of stage s: the schedule.
  auto forward_slots = [&](int s) -> std::int32_t {
    if (n_pp == 1) return cfg.activation_slots;
    return cfg.schedule == "gpipe" ? static_cast<std::int32_t>(std::max<std::int64_t>(m, 1)) : n_pp - s;
  };

  Plan plan;
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  if (n_dp > 1) {
    add_collective_kernels(kernels);
  }
  std::vector<PlanBuilder> replicas;
  for (std::int64_t r = 0; r < n_dp; ++r) {
    PlanBuilder b{g, plan, kernels};
    b.places.clear();
    b.tp = cfg.tp;
    for (int s = 0; s < n_pp * cfg.tp; ++s) {
      const auto i = static_cast<std::size_t>(r * n_pp * cfg.tp + s);
      b.places.push_back(cfg.replica_places.empty()
                             ? Placement{.device = Device{DeviceType::cpu, static_cast<std::uint8_t>(i)}}
                             : cfg.replica_places[i]);
    }
    if (n_pp > 1) b.stage_of = &stages;
    if (cfg.tp > 1) b.shard_of = &shards;
    b.loss_id = loss_id;
    b.first_piece = cfg.first_step * m;
    if (n_dp > 1) b.suffix = fmt::format("@dp{}", r);
    replicas.push_back(std::move(b));
  }
  const auto forward_stream = std::uint8_t{0};
  const auto backward_stream = static_cast<std::uint8_t>(cfg.threads >= 2 ? 1 : 0);
  auto stream_of = [&](int id) { return id <= loss_id ? forward_stream : backward_stream; };

  // Every replica's summed gradient, and what its variable actors read: the same register with
  // one replica, the all-reduced one with several (made first: variables read them, with a
  // delay, before the actors that write them are added).
  std::vector<std::map<int, RegisterIndex>> grad_sum(static_cast<std::size_t>(n_dp)), grad_in(grad_sum);
  for (auto& [v, grad] : trained) {
    for (std::int64_t r = 0; r < n_dp; ++r) {
      auto& b = replicas[static_cast<std::size_t>(r)];
      grad_sum[static_cast<std::size_t>(r)][v.id()] = b.add_register("grad." + v.name(), v.shape(), v.dtype(), 1);
    }
  }
  // Buckets, as DDP makes them: in reverse order of the weights (roughly the order their
  // gradients are ready), a bucket takes weights of one place and dtype until the next would
  // pass bucket_bytes. A bucket of one is all-reduced as it is; a bigger one is packed into one
  // flat register, all-reduced once, and unpacked.
  std::vector<std::vector<Value>> buckets;
  std::int64_t bucket_size = 0;
  for (auto it = trained.rbegin(); it != trained.rend(); ++it) {
    const Value v = it->first;
    const std::int64_t bytes = numel(v.shape()) * static_cast<std::int64_t>(size_of(v.dtype()));
    const bool fits = !buckets.empty() && bucket_size + bytes <= cfg.bucket_bytes &&
                      buckets.back()[0].dtype() == v.dtype() &&
                      replicas[0].place(buckets.back()[0].id()) == replicas[0].place(v.id());
    if (!fits) {
      buckets.emplace_back();
      bucket_size = 0;
    }
    buckets.back().push_back(v);
    bucket_size += bytes;
  }
  for (std::size_t bi = 0; bi < buckets.size(); ++bi) {
    const std::vector<Value>& bucket = buckets[bi];
    auto local = [&](std::int64_t r, const Value& v) { return grad_sum[static_cast<std::size_t>(r)].at(v.id()); };
    if (n_dp == 1) {
      for (const Value& v : bucket) grad_in[0][v.id()] = local(0, v);
      continue;
    }
    const int place = replicas[0].place(bucket[0].id());
    const bool nccl = use_nccl(cfg, replicas, place);
    // The all-reduce of one register per replica: NCCL's, or the ring of actors.
    auto allreduce = [&](const std::string& name, const std::vector<RegisterIndex>& inputs, const Shape& shape,
                         DType dt) {
      if (!nccl) return add_allreduce(replicas, name, inputs, shape, dt, backward_stream, 1, place);
      std::vector<AllReduceMember> members;
      for (std::size_t r = 0; r < replicas.size(); ++r) {
        members.push_back({replicas[r].at(nccl_stream, place), inputs[r], replicas[r].suffix});
      }
      const std::size_t before = plan.actors.size();
      // One communicator per place (its members are the same every step), and the buckets in
      // one order on every rank: NCCL pairs the ranks' calls by their order on a communicator.
      auto out = add_nccl_allreduce(plan, name, members, shape, dt, 1, fmt::format("grad.place{}", place));
      for (std::size_t a = before; a < plan.actors.size(); ++a) {
        ActorDesc& d = plan.actors[a];
        d.role = ActorRole::collective;
        d.order = ActOrder{.lane = nccl_lane_base + d.where.device.code(), .units = {0}, .period = 1,
                           .rank = static_cast<std::int32_t>(bi)};
      }
      return out;
    };
    if (bucket.size() == 1) {
      const Value& v = bucket[0];
      std::vector<RegisterIndex> inputs;
      for (std::int64_t r = 0; r < n_dp; ++r) inputs.push_back(local(r, v));
      auto reduced = allreduce("grad." + v.name(), inputs, v.shape(), v.dtype());
      for (std::int64_t r = 0; r < n_dp; ++r) grad_in[static_cast<std::size_t>(r)][v.id()] = reduced[static_cast<std::size_t>(r)];
      continue;
    }
    const std::string name = fmt::format("grad.bucket{}", bi);
    std::int64_t total = 0;
    for (const Value& v : bucket) total += numel(v.shape());
    const DType dt = bucket[0].dtype();
    std::vector<RegisterIndex> flat;
    for (std::int64_t r = 0; r < n_dp; ++r) {
      auto& b = replicas[static_cast<std::size_t>(r)];
      flat.push_back(b.add_register(name, {total}, dt, 1));
      std::vector<InputPort> ins;
      for (const Value& v : bucket) ins.push_back({local(r, v)});
      plan.add_actor({.name = b.named(name + ".pack"), .op = "allreduce.concat", .dtype = dt,
                      .where = b.at(backward_stream, place), .inputs = std::move(ins), .outputs = {flat.back()}});
    }
    auto reduced = allreduce(name, flat, {total}, dt);
    for (std::int64_t r = 0; r < n_dp; ++r) {
      auto& b = replicas[static_cast<std::size_t>(r)];
      std::vector<RegisterIndex> outs;
      for (const Value& v : bucket) {
        outs.push_back(b.add_register("grad." + v.name() + ".allreduced", v.shape(), v.dtype(), 1));
        grad_in[static_cast<std::size_t>(r)][v.id()] = outs.back();
      }
      plan.add_actor({.name = b.named(name + ".unpack"), .op = "allreduce.split", .dtype = dt,
                      .where = b.at(backward_stream, place), .inputs = {{reduced[static_cast<std::size_t>(r)]}},
                      .outputs = std::move(outs)});
    }
  }
  std::vector<std::optional<RegisterIndex>> clip_reg(static_cast<std::size_t>(n_dp));
  if (cfg.optimizer.clip_norm > 0 && !trained.empty()) {
    for (std::int64_t r = 0; r < n_dp; ++r) {
      clip_reg[static_cast<std::size_t>(r)] =
          replicas[static_cast<std::size_t>(r)].add_register("clip.factor", {1}, trained[0].first.dtype(), 1);
    }
  }

  // Replica 0's trained weights: where each one's steps come out (see gather_final_weights).
  std::vector<FinalWeight> finals;
  std::vector<RegisterIndex> loss_regs;
  for (std::int64_t r = 0; r < n_dp; ++r) {
    PlanBuilder& b = replicas[static_cast<std::size_t>(r)];
    // Data: each binding is one source actor whose outputs are the inputs it feeds.
    std::set<int> fed;
    for (const DataBinding& d : cfg.data) {
      std::vector<RegisterIndex> outs;
      int data_stage = n_pp - 1;
      for (const std::string& in : d.inputs) {
        Value v = g.find(in);
        if (!v.valid() || v.node().op != "input") {
          throw GraphError(fmt::format("data '{}' feeds '{}', which is not an input of the graph", d.name, in));
        }
        fed.insert(v.id());
        // Deep enough that a later stage's reader (the labels, read by the loss) does not hold
        // the first stage's back.
        outs.push_back(b.node_register(v.id(), std::max<std::int32_t>(2, forward_slots(0))));
        data_stage = std::min(data_stage, b.stage(v.id()));
      }
      std::string op = b.named("data." + d.name);
      if (n_dp == 1) {
        kernels.add(op, DeviceType::cpu, DType::f32, d.source);
      } else {
        KernelFactory inner = d.source;
        kernels.add(op, DeviceType::cpu, DType::f32, [inner, r, n_dp, m](const KernelConfig& kc) -> std::unique_ptr<Kernel> {
          return std::make_unique<ReplicaPieces>(inner(kc), r, n_dp, m);
        });
      }
      b.source_actor("data." + d.name, op, DType::f32, std::move(outs), pieces,
                     b.host(forward_stream, data_stage * b.tp));
    }

    for (int id = 0; id < g.size(); ++id) {
      if (!need[static_cast<std::size_t>(id)]) continue;
      const Node& n = g.node(id);
      if (n.op == "input") {
        if (!fed.count(id)) {
          throw GraphError(fmt::format("input '{}' ({}{}) is fed by no data source", n.name, name(n.dtype),
                                       to_string(n.shape)));
        }
      } else if (n.op == "variable") {
        // The weight, once per step, then read by the step's M micro-batches through a repeat.
        RegisterIndex w = b.add_register(n.name + ".step", n.shape, n.dtype, 1);
        std::string op = b.named("variable." + n.name);
        auto it = grad_in[static_cast<std::size_t>(r)].find(id);
        const DType dt = n.dtype;
        const bool on_cuda = b.at(backward_stream, b.place(id)).device.type == DeviceType::cuda;
        // Replica 0 trains the store's tensor itself; the others their own copies.
        Tensor master = params->at(n.name);
        if (r > 0) {
          Tensor copy = Tensor::empty(master.shape(), master.dtype());
          copy_tensor(master, copy);
          master = copy;
        }
        if (it != grad_in[static_cast<std::size_t>(r)].end()) {
          OptimizerConfig oc = cfg.optimizer;
          const std::int64_t steps = cfg.steps;
          const std::map<std::string, Tensor>* slots = optimizer_slots_of(cfg, n);
          SnapshotHook snap{n.name, r == 0 ? cfg.snapshot_every : 0, r == 0 ? cfg.on_snapshot : nullptr};
          if (on_cuda) {
            // The slots point into cfg.optimizer_state, which the factory keeps alive.
            KernelFactory make = detail::cuda_variable(master, oc, steps, slots, snap);
            kernels.add(op, DeviceType::cuda, dt, [make, state = cfg.optimizer_state](const KernelConfig& kc) {
              return make(kc);
            });
          }
          // The factory keeps the state alive (`state`) for the slots it points into.
          if (!on_cuda) kernels.add(op, DeviceType::cpu, dt, [master, oc, steps, dt, slots, snap, state = cfg.optimizer_state](
                                                   const KernelConfig&) -> std::unique_ptr<Kernel> {
            if (dt == DType::f64) {
              return std::make_unique<VariableKernel<double>>(master, oc, steps, slots, snap);
            }
            return std::make_unique<VariableKernel<float>>(master, oc, steps, slots, snap);
          });
          std::vector<InputPort> ins{{it->second, 1}};
          if (clip_reg[static_cast<std::size_t>(r)]) ins.push_back({*clip_reg[static_cast<std::size_t>(r)], 1});
          plan.add_actor({.name = op, .op = op, .dtype = dt, .where = b.at(backward_stream, b.place(id)),
                          .inputs = std::move(ins), .outputs = {w}, .first_piece = cfg.first_step,
                          .stops_when_unread = false});
        } else {
          if (on_cuda) {
            kernels.add(op, DeviceType::cuda, dt, detail::cuda_constant(master));
          } else {
            kernels.add(op, DeviceType::cpu, dt, [master](const KernelConfig&) {
              return std::make_unique<ConstantSource>(master);
            });
          }
          b.source_actor("variable." + n.name, op, dt, {w}, run_steps, b.at(backward_stream, b.place(id)));
        }
        if (r == 0 && it != grad_in[0].end()) finals.push_back({n.name, w, b.at(backward_stream, b.place(id)), dt, n.shape});
        // A stage's forward of micro-batch i and its backward of micro-batch i - depth read this
        // weight at once: the repeat needs the activations' depth, or it caps the schedule.
        RegisterIndex rep = b.node_register(id, n_pp > 1 ? std::max(2, forward_slots(b.stage(id)) + 1) : 2);
        plan.add_actor({.name = b.named(n.name + ".repeat"), .kind = ActorKind::repeat, .dtype = dt,
                        .where = b.at(backward_stream, b.place(id)), .inputs = {{w}}, .outputs = {rep},
                        .group = static_cast<std::int32_t>(m)});
      } else if (n.op == "fill" && n.inputs.empty()) {
        RegisterIndex reg = b.node_register(id, 2);
        b.source_actor(n.name, "fill", n.dtype, {reg}, pieces, b.at(stream_of(id), b.place(id)), n.attrs);
      } else {
        b.op_actor(id, stream_of(id), id <= loss_id ? forward_slots(b.stage(id)) : cfg.activation_slots);
      }
    }

    // Gradient accumulation and clipping.
    std::vector<InputPort> clip_inputs;
    for (auto& [v, grad] : trained) {
      plan.add_actor({.name = b.named("grad." + v.name() + ".accumulate"), .kind = ActorKind::accumulate,
                      .dtype = v.dtype(), .where = b.at(backward_stream, b.place(v.id())),
                      .inputs = {{b.reg_of.at(grad.id())}},
                      .outputs = {grad_sum[static_cast<std::size_t>(r)].at(v.id())},
                      .group = static_cast<std::int32_t>(m)});
      clip_inputs.push_back({grad_in[static_cast<std::size_t>(r)].at(v.id())});
    }
    if (clip_reg[static_cast<std::size_t>(r)]) {
      const DType dt = trained[0].first.dtype();
      const double max_norm = cfg.optimizer.clip_norm;
      if (r == 0) {
        kernels.add("optim.clip", DeviceType::cpu, dt, [max_norm, dt](const KernelConfig&) -> std::unique_ptr<Kernel> {
          if (dt == DType::f64) return std::make_unique<ClipKernel<double>>(max_norm);
          return std::make_unique<ClipKernel<float>>(max_norm);
        });
      }
      plan.add_actor({.name = b.named("optim.clip"), .op = "optim.clip", .dtype = dt, .where = b.host(backward_stream),
                      .inputs = clip_inputs, .outputs = {*clip_reg[static_cast<std::size_t>(r)]}});
    }
    loss_regs.push_back(b.reg_of.at(loss_id));
  }

  // The loss of each micro-batch, summed over the replicas (each replica's micro-batch k of a
  // step) and reported once, on replica 0, as their mean.
  auto losses = std::make_shared<LossLog>(m);
  const DType loss_dt = loss.dtype();
  RegisterIndex loss_in = loss_regs[0];
  const int loss_place = replicas[0].place(loss_id);
  if (n_dp > 1) loss_in = add_allreduce(replicas, "loss", loss_regs, {}, loss_dt, forward_stream, 2, loss_place)[0];
  const double loss_scale = 1.0 / static_cast<double>(n_dp);
  kernels.add_fn("loss.report", DeviceType::cpu, loss_dt, [losses, loss_dt, loss_scale](KernelContext& ctx) {
    const Tensor& t = *ctx.inputs[0];
    const double value = loss_dt == DType::f64    ? scalar_of<double>(t)
                         : loss_dt == DType::bf16 ? static_cast<double>(to_float(t.data<bfloat16>()[0]))
                                                  : scalar_of<float>(t);
    losses->record(ctx.piece, loss_scale * value);
  });
  plan.add_actor({.name = "loss.report", .op = "loss.report", .dtype = loss_dt,
                  .where = replicas[0].host(forward_stream, loss_place), .inputs = {{loss_in}}});
  gather_final_weights(plan, kernels, *params, finals, replicas[0].host(forward_stream, loss_place), run_steps);

  label_roles_and_stages(plan, replicas);
  // The order within each stage (schedule.h); the slots above bound what is in flight.
  if (n_pp > 1) order_pipeline(plan, parse_schedule(cfg.schedule), n_pp, m);
  if (any_cuda) {
    check_cuda_kernels(plan, kernels);
    // Data and losses are made and read on the host; copy actors move them (on their own
    // stream, so the copies overlap compute), and what crosses ranks goes through host memory.
    plan = insert_device_copies(plan);
  }
  std::map<std::string, Placement> trained_at;
  for (const FinalWeight& f : finals) trained_at[f.name] = f.where;
  return TrainingJob{std::move(plan), std::move(kernels), std::move(params), std::move(losses), std::move(trained_at)};
}

std::vector<Tensor> evaluate(Graph& g, const std::map<std::string, Tensor>& feeds, const std::vector<Value>& fetches,
                             const ParameterStore& params) {
  std::vector<bool> need = needed_nodes(g, fetches);
  Plan plan;
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  PlanBuilder b{g, plan, kernels};
  for (int id = 0; id < g.size(); ++id) {
    if (!need[static_cast<std::size_t>(id)]) continue;
    const Node& n = g.node(id);
    if (n.op == "input" || n.op == "variable") {
      Tensor value;
      if (n.op == "input") {
        auto it = feeds.find(n.name);
        if (it == feeds.end()) throw GraphError(fmt::format("evaluate: input '{}' is not fed", n.name));
        value = it->second;
      } else {
        value = params.at(n.name);
      }
      if (value.shape() != n.shape || value.dtype() != n.dtype) {
        throw GraphError(fmt::format("evaluate: '{}' is {}{} but was given {}", n.name, name(n.dtype),
                                     to_string(n.shape), value.describe()));
      }
      std::string op = "const." + n.name;
      b.kernels.add(op, DeviceType::cpu, n.dtype, [value](const KernelConfig&) {
        return std::make_unique<ConstantSource>(value);
      });
      b.source_actor(op, op, n.dtype, {b.node_register(id, 1)}, 1, b.at(0));
    } else if (n.op == "fill" && n.inputs.empty()) {
      b.source_actor(n.name, "fill", n.dtype, {b.node_register(id, 1)}, 1, b.at(0), n.attrs);
    } else {
      b.op_actor(id, 0, 1);
    }
  }
  auto results = std::make_shared<std::vector<Tensor>>(fetches.size());
  for (std::size_t i = 0; i < fetches.size(); ++i) {
    const Node& n = fetches[i].node();
    std::string op = fmt::format("fetch.{}", i);
    b.kernels.add_fn(op, DeviceType::cpu, n.dtype, [results, i](KernelContext& ctx) {
      const Tensor& t = *ctx.inputs[0];
      Tensor copy = Tensor::empty(t.shape(), t.dtype());
      copy_tensor(t, copy);
      (*results)[i] = std::move(copy);
    });
    b.plan.add_actor({.name = op, .op = op, .dtype = n.dtype, .inputs = {{b.reg_of.at(fetches[i].id())}}});
  }
  RuntimeSettings s;
  s.mode = ExecutionMode::deterministic;
  Runtime rt(std::move(plan), kernels, s);
  rt.run();
  return std::move(*results);
}

}  // namespace baton
