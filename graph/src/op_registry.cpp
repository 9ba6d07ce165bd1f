// The op table (op_registry.h): the built-in ops' gradient rules and the ops users register.
#include "baton/graph/op_registry.h"

#include <map>
#include <memory>
#include <set>
#include <mutex>
#include <shared_mutex>

#include <fmt/format.h>

#include "builtin_gradients.h"

namespace baton {

namespace {

struct Table {
  std::shared_mutex mutex;
  std::map<std::string, std::unique_ptr<const OpDef>, std::less<>> ops;  // nodes: pointers stay valid
  std::set<std::string, std::less<>> builtin;                           // of ops, baton's own
};

Table& table() {
  static Table* t = [] {
    auto* made = new Table;  // never destroyed: ops may be looked up during static destruction
    for (auto& [op, rule] : detail::builtin_gradient_rules()) {
      made->builtin.insert(op);
      made->ops.emplace(op, std::make_unique<const OpDef>(OpDef{.name = op, .gradient = std::move(rule)}));
    }
    return made;
  }();
  return *t;
}

}  // namespace

void GradientArgs::none() const {
  const Node& n = y.node();
  throw GraphError(fmt::format("op '{}' ('{}') has no gradient with respect to its input {} ('{}'), which the loss "
                               "needs to differentiate",
                               n.op, n.name, input, inputs.at(input).name()));
}

void register_op(OpDef def) {
  if (def.name.empty()) throw GraphError("register_op: the op has no name");
  for (const OpKernel& k : def.kernels) {
    if (!k.factory) {
      throw GraphError(fmt::format("register_op '{}': the {}/{} kernel has no factory", def.name, name(k.device),
                                   name(k.dtype)));
    }
  }
  Table& t = table();
  std::unique_lock lock(t.mutex);
  if (t.ops.count(def.name) && !t.builtin.count(def.name)) {
    throw GraphError(fmt::format("register_op '{}': an op of that name is registered already", def.name));
  }
  // The built-in kernels name every built-in op, those without a gradient rule too.
  if (t.builtin.count(def.name) || KernelRegistry::with_builtin_kernels().contains_op(def.name)) {
    throw GraphError(fmt::format("register_op '{}': a built-in op has that name", def.name));
  }
  for (const OpKernel& k : def.kernels) KernelRegistry::add_process_wide(def.name, k.device, k.dtype, k.factory);
  const std::string op = def.name;
  t.ops.emplace(op, std::make_unique<const OpDef>(std::move(def)));
}

const OpDef* find_op(std::string_view name) {
  Table& t = table();
  std::shared_lock lock(t.mutex);
  auto it = t.ops.find(name);
  return it == t.ops.end() ? nullptr : it->second.get();
}

Value apply(const std::string& op, const std::vector<Value>& inputs, Attrs attrs) {
  const OpDef* def = find_op(op);
  if (def == nullptr || !def->infer) {
    throw GraphError(fmt::format("apply '{}': {}", op,
                                 def == nullptr ? "no op of that name is registered (register_op)"
                                                : "a built-in op: call its function (ops.h)"));
  }
  if (inputs.empty() || !inputs[0].valid()) throw GraphError(fmt::format("apply '{}': needs an input", op));
  TensorType out;
  try {
    out = def->infer(OpInputs{inputs, attrs});
  } catch (const GraphError&) {
    throw;
  } catch (const std::exception& e) {
    throw GraphError(fmt::format("{}: {}", op, e.what()));
  }
  return inputs[0].graph().add(op, inputs, std::move(attrs), std::move(out.shape), out.dtype);
}

}  // namespace baton
