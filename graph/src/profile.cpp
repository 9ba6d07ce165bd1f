#include "baton/graph/profile.h"

#include <algorithm>
#include <chrono>
#include <cstdint>

#include <fmt/format.h>

#include "baton/kernels/kernel.h"

namespace baton {

namespace {

// The dtype a node's kernel is looked up with, as the compiler chooses it (passes/plan_builder.cpp).
DType kernel_dtype_of(const Graph& g, const Node& n) {
  if (is_floating(n.dtype)) return n.dtype;
  for (int in : n.inputs) {
    if (is_floating(g.node(in).dtype)) return g.node(in).dtype;
  }
  return DType::f32;
}

// Deterministic filler: a float tensor in [-1, 1], an integer one all 0.
Tensor made_up(const Node& n) {
  Tensor t = Tensor::empty(n.shape, n.dtype);
  std::uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(state >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;
  };
  switch (n.dtype) {
    case DType::f32:
      for (float& x : t.data<float>()) x = static_cast<float>(next());
      break;
    case DType::f64:
      for (double& x : t.data<double>()) x = next();
      break;
    default: std::fill_n(static_cast<std::byte*>(t.raw()), t.nbytes(), std::byte{0});
  }
  return t;
}

}  // namespace

std::vector<double> profile_op_costs(const Graph& g, const ParameterStore& params, const ProfileOptions& options) {
  const KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  const int end = g.size();
  std::vector<double> seconds(static_cast<std::size_t>(g.size()), 0.0);
  std::vector<Tensor> value(static_cast<std::size_t>(end));
  auto wanted = [&](int id) {
    return options.only.empty() || (static_cast<std::size_t>(id) < options.only.size() && options.only[static_cast<std::size_t>(id)]);
  };
  // Every node that a profiled one reads needs a value, profiled or not.
  std::vector<bool> compute(static_cast<std::size_t>(end), false);
  for (int id = end - 1; id >= 0; --id) {
    if (wanted(id)) compute[static_cast<std::size_t>(id)] = true;
    if (!compute[static_cast<std::size_t>(id)]) continue;
    for (int in : g.node(id).inputs) compute[static_cast<std::size_t>(in)] = true;
  }
  for (int id = 0; id < end; ++id) {
    if (!compute[static_cast<std::size_t>(id)]) continue;
    const Node& n = g.node(id);
    if (n.op == "input") {
      value[static_cast<std::size_t>(id)] = made_up(n);
      continue;
    }
    if (n.op == "variable") {
      value[static_cast<std::size_t>(id)] = params.contains(n.name) ? params.at(n.name) : made_up(n);
      continue;
    }
    const DType dtype = kernel_dtype_of(g, n);
    std::vector<const Tensor*> ins;
    for (int in : n.inputs) ins.push_back(&value[static_cast<std::size_t>(in)]);
    Tensor out = Tensor::empty(n.shape, n.dtype);
    Tensor* outs[1] = {&out};
    try {
      auto kernel = kernels.create(n.op, KernelConfig{n.name, Device{}, dtype, n.attrs});
      KernelContext ctx{ins, outs, 0};
      kernel->compute(ctx);  // the value the next ops read; also warms the caches
      const bool timed = wanted(id) && !n.inputs.empty();
      std::vector<double> runs;
      for (int r = 0; timed && r < std::max(1, options.repeats); ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        kernel->compute(ctx);
        runs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      if (!runs.empty()) {
        std::nth_element(runs.begin(), runs.begin() + static_cast<std::ptrdiff_t>(runs.size() / 2), runs.end());
        seconds[static_cast<std::size_t>(id)] = runs[runs.size() / 2];
      }
    } catch (const std::exception& e) {
      throw GraphError(fmt::format("profiling op '{}' ({} of {}{}): {}", n.name, n.op, name(n.dtype), to_string(n.shape),
                                   e.what()));
    }
    value[static_cast<std::size_t>(id)] = std::move(out);
  }
  return seconds;
}

}  // namespace baton
