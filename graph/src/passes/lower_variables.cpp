// Lowering a variable (lowering.h): the actor that owns a weight and applies its optimizer, or
// a constant source for a weight that is not trained, and the repeat its micro-batches read.
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "../device_variables.h"
#include "baton/kernels/optim.h"
#include "lowering.h"

namespace baton::passes::detail {

namespace {

using baton::detail::SnapshotHook;

/// A weight with its optimizer. Act 0 emits the initial value; act k >= 1 applies step k-1's
/// summed gradient (input 0, read with delay 1), scaled by the clipping factor (input 1, if
/// any), then emits the new value. The master copy is the ParameterStore's tensor itself. A
/// resumed job's actor starts at piece first_step (its acts count steps), from saved slots.
template <class T>
class VariableKernel final : public Kernel {
 public:
  VariableKernel(Tensor master, OptimizerConfig cfg, std::int64_t total_steps,
                 const std::map<std::string, Tensor>* slots, SnapshotHook snapshots)
      : master_(std::move(master)),
        cfg_(cfg),
        total_steps_(total_steps),
        snapshots_(std::move(snapshots)) {
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
      AdamConfig c{cfg_.lr,  cfg_.beta1,        cfg_.beta2,
                   cfg_.eps, cfg_.weight_decay, cfg_.kind == OptimizerConfig::Kind::adamw};
      adam_step(w, grad, std::span<T>(m_), std::span<T>(v_), c, step, lr);
    }
    if (snapshots_.hand_over && snapshots_.every > 0 &&
        (step % snapshots_.every == 0 || step == total_steps_)) {
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

/// The saved optimizer slots of trained variable `n` in a resumed job (null: start at zero),
/// checked against the variable and the optimizer.
const std::map<std::string, Tensor>* optimizer_slots_of(const TrainConfig& cfg, const Node& n) {
  if (!cfg.optimizer_state) return nullptr;
  auto it = cfg.optimizer_state->find(n.name);
  const auto names = optimizer_slot_names(cfg.optimizer);
  if (it == cfg.optimizer_state->end()) {
    if (names.empty()) return nullptr;
    throw GraphError(
        fmt::format("the optimizer state has no slots for trained variable '{}'", n.name));
  }
  for (const std::string& slot : names) {
    auto s = it->second.find(slot);
    if (s == it->second.end()) {
      throw GraphError(fmt::format("the optimizer state of '{}' has no '{}' ({} keeps {})", n.name,
                                   slot, name(cfg.optimizer.kind), fmt::join(names, " and ")));
    }
    if (s->second.shape() != n.shape || s->second.dtype() != n.dtype) {
      throw GraphError(
          fmt::format("the optimizer state '{}' of '{}' is {} but the variable is {}{}", slot,
                      n.name, s->second.describe(), baton::name(n.dtype), to_string(n.shape)));
    }
  }
  return &it->second;
}

/// The kernel of a trained variable's actor: on its device, with the optimizer's state.
void add_variable_kernel(KernelRegistry& kernels, const std::string& op, bool on_cuda,
                         Tensor master, DType dt, const TrainConfig& cfg,
                         const std::map<std::string, Tensor>* slots, SnapshotHook snap) {
  OptimizerConfig oc = cfg.optimizer;
  const std::int64_t steps = cfg.steps;
  if (on_cuda) {
    // The slots point into cfg.optimizer_state, which the factory keeps alive.
    KernelFactory make = baton::detail::cuda_variable(master, oc, steps, slots, snap);
    kernels.add(op, DeviceType::cuda, dt,
                [make, state = cfg.optimizer_state](const KernelConfig& kc) { return make(kc); });
    return;
  }
  // The factory keeps the state alive (`state`) for the slots it points into.
  kernels.add(op, DeviceType::cpu, dt,
              [master, oc, steps, dt, slots, snap,
               state = cfg.optimizer_state](const KernelConfig&) -> std::unique_ptr<Kernel> {
                if (dt == DType::f64) {
                  return std::make_unique<VariableKernel<double>>(master, oc, steps, slots, snap);
                }
                return std::make_unique<VariableKernel<float>>(master, oc, steps, slots, snap);
              });
}

}  // namespace

RegisterIndex lower_variable(PlanBuilder& b, std::int64_t r, int id, const RegisterIndex* grad,
                             const RegisterIndex* clip, const Stages& st, const TrainConfig& cfg,
                             ParameterStore& params) {
  const Node& n = b.g.node(id);
  const std::uint8_t stream = backward_stream(cfg);
  // The weight, once per step, then read by the step's M micro-batches through a repeat.
  RegisterIndex w = b.add_register(n.name + ".step", n.shape, n.dtype, 1);
  std::string op = b.named("variable." + n.name);
  const DType dt = n.dtype;
  const bool on_cuda = b.at(stream, b.place(id)).device.type == DeviceType::cuda;
  // Replica 0 trains the store's tensor itself; the others their own copies.
  Tensor master = params.at(n.name);
  if (r > 0) {
    Tensor copy = Tensor::empty(master.shape(), master.dtype());
    copy_tensor(master, copy);
    master = copy;
  }
  // What its kernel keeps (the memory report): the master weight, the optimizer's slots, and
  // the scaled gradient when clipping.
  const std::int64_t weight_bytes = numel(n.shape) * static_cast<std::int64_t>(size_of(dt));
  std::vector<KeptBytes> kept{{MemoryCategory::weights, weight_bytes}};
  if (grad != nullptr) {
    const auto slots = static_cast<std::int64_t>(optimizer_slot_names(cfg.optimizer).size());
    if (slots > 0) kept.push_back({MemoryCategory::optimizer_state, slots * weight_bytes});
    if (clip != nullptr) kept.push_back({MemoryCategory::gradients, weight_bytes});
  }
  if (grad != nullptr) {
    SnapshotHook snap{n.name, r == 0 ? cfg.snapshot_every : 0, r == 0 ? cfg.on_snapshot : nullptr};
    add_variable_kernel(b.kernels, op, on_cuda, master, dt, cfg, optimizer_slots_of(cfg, n),
                        std::move(snap));
    std::vector<InputPort> ins{{*grad, 1}};
    if (clip != nullptr) ins.push_back({*clip, 1});
    b.plan.add_actor({.name = op,
                      .op = op,
                      .dtype = dt,
                      .where = b.at(stream, b.place(id)),
                      .inputs = std::move(ins),
                      .outputs = {w},
                      .first_piece = cfg.first_step,
                      .stops_when_unread = false});
  } else {
    if (on_cuda) {
      b.kernels.add(op, DeviceType::cuda, dt, baton::detail::cuda_constant(master));
    } else {
      b.kernels.add(op, DeviceType::cpu, dt, [master](const KernelConfig&) {
        return std::make_unique<ConstantSource>(master);
      });
    }
    b.source_actor("variable." + n.name, op, dt, {w}, cfg.steps - cfg.first_step,
                   b.at(stream, b.place(id)));
  }
  b.plan.actors.back().kept = std::move(kept);
  // A stage's forward of micro-batch i and its backward of micro-batch i - depth read this
  // weight at once: the repeat needs the activations' depth, or it caps the schedule.
  RegisterIndex rep = b.node_register(
      id, st.pp > 1 ? std::max(2, st.forward_slots[static_cast<std::size_t>(b.stage(id))] + 1) : 2);
  b.plan.add_actor({.name = b.named(n.name + ".repeat"),
                    .kind = ActorKind::repeat,
                    .dtype = dt,
                    .where = b.at(stream, b.place(id)),
                    .inputs = {{w}},
                    .outputs = {rep},
                    .group = static_cast<std::int32_t>(cfg.microbatches)});
  return w;
}

void add_clip_kernel(KernelRegistry& kernels, DType dt, double max_norm) {
  kernels.add("optim.clip", DeviceType::cpu, dt,
              [max_norm, dt](const KernelConfig&) -> std::unique_ptr<Kernel> {
                if (dt == DType::f64) return std::make_unique<ClipKernel<double>>(max_norm);
                return std::make_unique<ClipKernel<float>>(max_norm);
              });
}

}  // namespace baton::passes::detail
