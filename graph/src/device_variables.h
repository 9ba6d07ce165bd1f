#pragma once
// Private to graph/src: the variable actors' kernels for a weight on a CUDA device, which the
// compiler registers for DeviceType::cuda beside the CPU ones in
// passes/lower_variables.cpp.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "baton/graph/compile.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/optim.h"

namespace baton::detail {

/// How a variable actor hands its state over at checkpoint steps (replica 0's only).
struct SnapshotHook {
  std::string name;
  std::int64_t every = 0;  // 0: never (replicas other than 0)
  std::function<void(VariableSnapshot)> hand_over;
};

/// The optimizer's settings as the step functions take them (baton/kernels/optim.h).
inline SgdConfig sgd_config_of(const OptimizerConfig& o) { return {o.lr, o.momentum, o.weight_decay, o.nesterov}; }
inline AdamConfig adam_config_of(const OptimizerConfig& o) {
  return {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.kind == OptimizerConfig::Kind::adamw};
}

/// A trained float32 weight on a CUDA device: as lower_variables.cpp's VariableKernel (act 0 emits the
/// initial value, act k applies step k's summed gradient, scaled by the clipping factor if
/// there is one, and emits the new value: f32, or bf16 where its output register is bf16, written
/// by the optimizer's kernel in the same pass), with the master copy and the optimizer slots in
/// device memory and the step on the actor's stream (baton::cuda::sgd_step / adam_step, the
/// CPU's arithmetic element for element). `host` is the ParameterStore's tensor: read once at
/// the first act, written back after the job's last step, so evaluate() and checkpoints on the
/// host see the trained value. Throws GraphError for a dtype other than f32.
KernelFactory cuda_variable(Tensor host, const OptimizerConfig& cfg, std::int64_t total_steps,
                            const std::map<std::string, Tensor>* slots, SnapshotHook snapshots);

/// A trained variable actor that the updates pass folded into a group: its name, its op (its
/// kernel in the registry) and how many gradient registers it read (its parts).
struct GroupMember {
  std::string actor;
  std::string op;
  std::size_t parts = 1;
};

/// The kernel of a device's trained weights stepped by one actor (passes/updates.cpp), whose
/// inputs are each member's gradient parts in member order, then the clipping factor if `clip`,
/// and whose outputs are the members' weight registers in order. Each member's kernel is made
/// from `kernels` as its own actor's was. On a CUDA device whose members are all cuda_variable's
/// with one part each, a step is cuda::adam_step_multi / sgd_step_multi over all of them (the
/// same bits); elsewhere (a sim device, which runs the CPU kernels) the members act in turn.
KernelFactory variable_group(std::shared_ptr<const KernelRegistry> kernels, std::vector<GroupMember> members,
                             bool clip);

/// A weight that is not trained, on a CUDA device: uploads `value` once and copies it into each
/// act's output on the stream.
KernelFactory cuda_constant(Tensor value);

}  // namespace baton::detail
