// Lowering a variable (lowering.h): the actor that owns a weight and applies its optimizer, or
// a constant source for a weight that is not trained, and the repeat its micro-batches read.
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "../device_variables.h"
#include "baton/kernels/optim.h"
#include "lowering.h"
#include "variable_kernel.h"

namespace baton::passes::detail {

namespace {

using baton::detail::SnapshotHook;


/// The saved slots (optimizer_slots_of) as VariableKernel takes them; none: empty.
template <class T>
std::vector<std::vector<T>> saved_slots(const OptimizerConfig& oc,
                                        const std::map<std::string, Tensor>* slots) {
  std::vector<std::vector<T>> out;
  if (slots == nullptr) return out;
  for (const std::string& name : optimizer_slot_names(oc)) out.push_back(elements_of<T>(slots->at(name)));
  return out;
}

/// The kernel of a trained variable's actor: on its device, with the optimizer's state.
void add_variable_kernel(KernelRegistry& kernels, const std::string& op, bool on_cuda,
                         Tensor master, DType dt, const TrainConfig& cfg,
                         const std::map<std::string, Tensor>* slots, SnapshotHook snap,
                         GradientWindow window) {
  OptimizerConfig oc = cfg.optimizer;
  const std::int64_t steps = cfg.steps;
  const std::int64_t late = weight_delay(cfg) - 1;
  if (on_cuda) {
    if (late != 0) {
      throw GraphError(fmt::format("'{}': --schedule {} with a weight on a CUDA device: the CUDA variable "
                                   "applies each step's gradient at once (no delayed update); use --schedule "
                                   "1f1b, or keep the weights on the CPU",
                                   op, cfg.schedule));
    }
    if (window.parts != 1 || window.offset != 0) {
      throw GraphError(fmt::format("'{}': a CUDA variable reads one whole gradient register (no window)", op));
    }
    // The slots point into cfg.optimizer_state, which the factory keeps alive.
    KernelFactory make = baton::detail::cuda_variable(master, oc, steps, slots, snap);
    kernels.add(op, DeviceType::cuda, dt,
                [make, state = cfg.optimizer_state](const KernelConfig& kc) { return make(kc); });
    return;
  }
  // The factory keeps the state alive (`state`) for the slots it points into.
  kernels.add(op, DeviceType::cpu, dt,
              [master, oc, steps, dt, slots, snap, window, late,
               state = cfg.optimizer_state](const KernelConfig&) -> std::unique_ptr<Kernel> {
                if (dt == DType::f64) {
                  return std::make_unique<VariableKernel<double>>(
                      master, oc, steps, saved_slots<double>(oc, slots), snap, window, WeightWindow{}, late);
                }
                return std::make_unique<VariableKernel<float>>(
                    master, oc, steps, saved_slots<float>(oc, slots), snap, window, WeightWindow{}, late);
              });
}

}  // namespace

std::int32_t weight_delay(const TrainConfig& cfg) {
  if (cfg.sync == "ps") return 1 + cfg.staleness;
  return cfg.schedule == "2bw" ? 2 : 1;
}

void check_weight_delay(const TrainConfig& cfg) {
  if (weight_delay(cfg) == 1) return;
  const std::string what = cfg.sync == "ps" ? fmt::format("--staleness {}", cfg.staleness)
                                            : fmt::format("--schedule {}", cfg.schedule);
  if (cfg.zero > 0 && cfg.dp > 1) {
    throw GraphError(fmt::format("{} with --zero {}: ZeRO's sharded optimizers apply each step's "
                                 "gradient at once, not a step late; use one or the other",
                                 what, cfg.zero));
  }
  if ((cfg.first_step > 0 && !cfg.rejoin) || cfg.optimizer_state) {
    throw GraphError(fmt::format("{} with a resumed job (first step {}): a checkpoint holds the "
                                 "weights but not the gradients still to be applied late, so training "
                                 "cannot go on from it as the uninterrupted run would",
                                 what, cfg.first_step));
  }
}

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

RegisterIndex lower_variable(PlanBuilder& b, std::int64_t r, int id, const GradientAt* grad,
                             const RegisterIndex* clip, const Stages& st, const TrainConfig& cfg,
                             ParameterStore& params, bool with_repeat, std::optional<DType> emit) {
  const Node& n = b.g.node(id);
  const DType out_dt = emit.value_or(n.dtype);
  if (out_dt != n.dtype && (n.dtype != DType::f32 || out_dt != DType::bf16)) {
    throw std::logic_error(fmt::format("variable '{}': a {} weight emitted as {}", n.name, name(n.dtype), name(out_dt)));
  }
  const std::uint8_t stream = backward_stream(cfg);
  // The weight, once per step, then read by the step's M micro-batches through a repeat. A
  // trained weight on a CPU device is its optimizer's master itself (kernel_memory: the
  // optimizer updates it in place once every reader of the last step has acked it), so it is
  // held once, not once more for its readers; CUDA variables still copy theirs out.
  // Under 2BW (weight_delay 2) a trained weight's register holds two versions: the next step's
  // weights are written while the step before's backward passes still read theirs.
  const std::int32_t delay = weight_delay(cfg);
  RegisterIndex w = b.add_register(n.name + ".step", n.shape, out_dt, grad != nullptr ? delay : 1);
  std::string op = b.named("variable." + n.name);
  const DType dt = n.dtype;
  const bool on_cuda = b.at(stream, b.place(id)).device.type == DeviceType::cuda;
  // Replica 0 trains the store's tensor itself; the others their own copies.
  Tensor master = params.at(n.name);
  if (r > 0 && !cfg.plan_only) {
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
    // Two versions are two slots, so not the master's one (the kernel copies each version out).
    b.plan.registers[w].kernel_memory =
        delay == 1 && !on_cuda && out_dt == dt && b.at(stream, b.place(id)).device.type == DeviceType::cpu;
    SnapshotHook snap{n.name, r == 0 ? cfg.snapshot_every : 0, r == 0 ? cfg.on_snapshot : nullptr};
    add_variable_kernel(b.kernels, op, on_cuda, master, dt, cfg, optimizer_slots_of(cfg, n),
                        std::move(snap), GradientWindow{grad->parts.size(), grad->offset});
    std::vector<InputPort> ins;
    for (RegisterIndex part : grad->parts) ins.push_back({part, delay});
    if (clip != nullptr) ins.push_back({*clip, delay});
    b.plan.add_actor({.name = op,
                      .op = op,
                      .dtype = dt,
                      .where = b.at(stream, b.place(id)),
                      .inputs = std::move(ins),
                      .outputs = {w},
                      .first_piece = cfg.first_step,
                      .stops_when_unread = false,
                      .role = ActorRole::update});
  } else {
    if (out_dt != dt && cfg.plan_only) {
      master = Tensor::unallocated(master.shape(), out_dt);
    } else if (out_dt != dt) {  // a constant's low-precision copy is made once, here
      Tensor low = Tensor::empty(master.shape(), out_dt);
      auto from = master.data<float>();
      auto to = low.data<bfloat16>();
      for (std::size_t i = 0; i < from.size(); ++i) to[i] = to_bf16(from[i]);
      master = low;
    }
    if (on_cuda) {
      b.kernels.add(op, DeviceType::cuda, dt, baton::detail::cuda_constant(master));
    } else {
      b.kernels.add(op, DeviceType::cpu, dt, [master](const KernelConfig&) {
        return std::make_unique<ConstantSource>(master);
      });
    }
    b.source_actor("variable." + n.name, op, dt, {w}, cfg.steps - cfg.first_step,
                   b.at(stream, b.place(id)), {}, ActorRole::update);
  }
  b.plan.actors.back().kept = std::move(kept);
  if (with_repeat) add_weight_repeat(b, id, w, st, cfg);
  return w;
}

void add_weight_repeat(PlanBuilder& b, int id, RegisterIndex w, const Stages& st,
                       const TrainConfig& cfg) {
  const Node& n = b.g.node(id);
  const std::uint8_t stream = backward_stream(cfg);
  const DType dt = b.plan.registers[w].dtype;  // the weight's, or the low precision its variable emits
  // A stage's forward of micro-batch i and its backward of micro-batch i - depth read this
  // weight at once: the repeat needs the activations' depth, or it caps the schedule.
  RegisterIndex rep = b.add_register(
      n.name, n.shape, dt, st.pp > 1 ? std::max(2, st.forward_slots[static_cast<std::size_t>(b.stage(id))] + 1) : 2);
  b.reg_of[id] = rep;
  b.plan.add_actor({.name = b.named(n.name + ".repeat"),
                    .kind = ActorKind::repeat,
                    .dtype = dt,
                    .where = b.at(stream, b.place(id)),
                    .inputs = {{w}},
                    .outputs = {rep},
                    .group = static_cast<std::int32_t>(cfg.microbatches)});
}

void add_clip_kernel(KernelRegistry& kernels, DType dt, double max_norm) {
  for (bool of_squares : {false, true}) {
    kernels.add(of_squares ? "optim.clip_of_squares" : "optim.clip", DeviceType::cpu, dt,
                [max_norm, dt, of_squares](const KernelConfig&) -> std::unique_ptr<Kernel> {
                  if (dt == DType::f64) return std::make_unique<ClipKernel<double>>(max_norm, of_squares);
                  return std::make_unique<ClipKernel<float>>(max_norm, of_squares);
                });
  }
  kernels.add("optim.sum_of_squares", DeviceType::cpu, dt,
              [dt](const KernelConfig&) -> std::unique_ptr<Kernel> {
                if (dt == DType::f64) return std::make_unique<SumOfSquaresKernel<double>>();
                return std::make_unique<SumOfSquaresKernel<float>>();
              });
}

}  // namespace baton::passes::detail
