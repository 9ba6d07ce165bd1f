#pragma once
/// Ops a user adds without editing baton: one registration gives a new op its shape and dtype
/// rule, its kernels (per device type and dtype) and its gradient rule (a function that builds
/// the backward subgraph from ops, built-in or registered). The built-in ops' gradient rules
/// live in the same table (autodiff.cpp registers them), and their kernels in the same
/// KernelRegistry, so autodiff, the compiler and the runtime treat a registered op as they
/// treat matmul.
///
///   baton::register_op({
///       .name = "my.softplus",
///       .infer = [](const baton::OpInputs& in) { return baton::TensorType{in[0].shape(), in[0].dtype()}; },
///       .gradient = [](const baton::GradientArgs& a) { return a.dy * sigmoid(a.inputs[0]); },
///       .kernels = {{baton::DeviceType::cpu, baton::f32, my_softplus_cpu_factory}},
///       .elementwise = true,
///   });
///   baton::Value y = baton::apply("my.softplus", {x});
///
/// Register before building the graphs that use the op (a registry is process-wide, and a
/// name is registered once). What is still the built-ins' own: their shape rules (each DSL
/// function, ops.h, computes its own) and their tensor-parallel signatures (sharding.cpp); a
/// registered op runs whole on every tp shard unless it says it is elementwise.
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "baton/graph/graph.h"
#include "baton/kernels/kernel.h"

namespace baton {

/// A value's shape and dtype.
struct TensorType {
  Shape shape;
  DType dtype = DType::f32;
};

/// What a shape rule sees: the op's inputs and attributes.
struct OpInputs {
  const std::vector<Value>& values;
  const Attrs& attrs;
  const Value& operator[](std::size_t i) const { return values.at(i); }
  std::size_t size() const { return values.size(); }
};

/// What a gradient rule sees: the forward node y = op(inputs; attrs), which input the gradient
/// is wanted for, and dL/dy. It returns dL/d(inputs[input]), with that input's shape, built from
/// ops (it may call apply() with registered ops, its own gradient op included).
struct GradientArgs {
  Value y;
  const std::vector<Value>& inputs;
  const Attrs& attrs;
  std::size_t input = 0;
  Value dy;
  const Value& x() const { return inputs.at(input); }
  /// Throws the GraphError autodiff gives for an input without a gradient (a label, an index).
  [[noreturn]] void none() const;
};

/// A kernel of a registered op: for `device` and `dtype` (the dtype of the node, i.e. of the
/// op's output), made by `factory` once per actor.
struct OpKernel {
  DeviceType device = DeviceType::cpu;
  DType dtype = DType::f32;
  KernelFactory factory;
};

struct OpDef {
  std::string name;
  /// The output's shape and dtype; throws GraphError (naming the op) for inputs it cannot take.
  /// Required for an op apply() builds.
  std::function<TensorType(const OpInputs&)> infer;
  /// Empty: the op has no gradient (autodiff refuses a loss that needs one, naming the op).
  std::function<Value(const GradientArgs&)> gradient;
  std::vector<OpKernel> kernels;
  /// The output's element i depends only on element i of each input, of the same shape as the
  /// output: tensor parallelism may then split it along any axis its input is split on (else
  /// each tp shard computes it whole).
  bool elementwise = false;
};

/// Registers `def` for the whole process. Throws GraphError if the name is empty, already
/// registered or a built-in op's, or if a kernel has no factory.
void register_op(OpDef def);

/// The registered op of that name (built-in gradient rules included), or null.
const OpDef* find_op(std::string_view name);

/// A node of registered op `op` on `inputs` (all of one graph), its shape and dtype from the
/// op's rule. Throws GraphError naming the op if it is not registered or its rule refuses.
Value apply(const std::string& op, const std::vector<Value>& inputs, Attrs attrs = {});

}  // namespace baton
