#include "baton/graph/program.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "baton/kernels/allocator.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/sim.h"
#include "passes/lowering.h"

namespace baton {

struct Program::Step {
  std::string name;
  std::unique_ptr<Kernel> kernel;
  std::vector<int> inputs;  // node ids
  int output = -1;
  std::vector<const Tensor*> in_ptrs;
  std::vector<Tensor*> out_ptrs;
};

std::unique_ptr<Allocator> Program::device_allocator(Device device) {
  if (device.type == DeviceType::cuda) return cuda::make_device_allocator(device);
  return nullptr;
}

namespace {

/// A tensor of `shape` and `dtype` from `alloc` (host memory when null).
Tensor empty_on(Allocator* alloc, const Shape& shape, DType dtype) {
  return alloc != nullptr ? Tensor::empty(shape, dtype, *alloc) : Tensor::empty(shape, dtype);
}

}  // namespace

Program::Program(Graph& g, const std::vector<Value>& fetches, std::shared_ptr<const ParameterStore> params,
                 const std::map<std::string, Tensor>& inputs, const KernelRegistry& kernels, Device device)
    : g_(g), params_(std::move(params)), device_(device) {
  if (!params_) throw GraphError("Program: no ParameterStore");
  if (is_async(device.type)) {
    const std::string owner = fmt::format("program {}", device.str());
    if (device.type == DeviceType::sim) {
      stream_ = sim::Stream::create(device, owner);
    } else {
      stream_ = cuda::Stream::create(device, owner);
    }
    alloc_ = device_allocator(device);
  }
  needed_ = passes::detail::needed_nodes(g, fetches);
  for (const Value& f : fetches) fetch_ids_.push_back(f.id());
  // Views (reshape) share their input's bytes: a buffer lives until the last reader of any view
  // of it. root[id]: the node whose buffer id's tensor is.
  std::vector<int> root(static_cast<std::size_t>(g.size()), -1);
  const std::vector<int> computed = place_nodes(inputs, kernels, root);
  bind(*params_);
  make_steps(computed, root, kernels);
  // Views last: their roots' tensors exist now.
  for (int id = 0; id < g.size(); ++id) {
    if (needed_[static_cast<std::size_t>(id)] && g.node(id).op == "reshape")
      values_[id] = values_.at(g.node(id).inputs[0]).view(g.node(id).shape);
  }
  for (Step& step : steps_) {
    for (int in : step.inputs) step.in_ptrs.push_back(&values_.at(in));
    step.out_ptrs.push_back(&values_.at(step.output));
  }
  fetched_.resize(fetch_ids_.size());
  if (on_stream()) {
    for (std::size_t i = 0; i < fetch_ids_.size(); ++i) {
      const Node& n = g.node(fetch_ids_[i]);
      fetched_[i] = Tensor::empty(n.shape, n.dtype);  // host copies, filled by run()
      add_copy_kernel(kernels, "to_host", n.dtype);
    }
  }
}

void Program::add_copy_kernel(const KernelRegistry& kernels, const char* op, DType dt) {
  if (!on_stream() || copy_kernels_.contains({op, dt})) return;
  copy_kernels_[{op, dt}] = kernels.create(
      op, KernelConfig{.actor = fmt::format("program.{}", op), .device = device_, .dtype = dt, .attrs = {}});
}

std::vector<int> Program::place_nodes(const std::map<std::string, Tensor>& inputs, const KernelRegistry& kernels,
                                      std::vector<int>& root) {
  std::vector<int> computed;
  for (int id = 0; id < g_.size(); ++id) {
    if (!needed_[static_cast<std::size_t>(id)]) continue;
    const Node& n = g_.node(id);
    root[static_cast<std::size_t>(id)] = id;
    if (n.op == "input") {
      if (auto given = inputs.find(n.name); given != inputs.end()) {
        if (given->second.shape() != n.shape || given->second.dtype() != n.dtype) {
          throw GraphError(fmt::format("Program: input '{}' is {}{} but was given {}", n.name, name(n.dtype),
                                       to_string(n.shape), given->second.describe()));
        }
        values_[id] = given->second;
      } else if (on_stream()) {
        // Written on the host, copied to the device at each run.
        host_inputs_[id] = Tensor::zeros(n.shape, n.dtype);
        values_[id] = empty_on(alloc_.get(), n.shape, n.dtype);
        add_copy_kernel(kernels, "to_device", n.dtype);
      } else {
        values_[id] = Tensor::zeros(n.shape, n.dtype);
      }
      inputs_[n.name] = id;
    } else if (n.op == "variable") {
      add_copy_kernel(kernels, "to_device", n.dtype);  // bound by bind()
    } else if (n.op == "reshape") {
      root[static_cast<std::size_t>(id)] = root[static_cast<std::size_t>(n.inputs[0])];
    } else {
      computed.push_back(id);
    }
  }
  return computed;
}

void Program::make_steps(const std::vector<int>& computed, const std::vector<int>& root,
                         const KernelRegistry& kernels) {
  std::vector<std::size_t> last_use(static_cast<std::size_t>(g_.size()), 0);
  constexpr std::size_t forever = std::numeric_limits<std::size_t>::max();
  for (std::size_t s = 0; s < computed.size(); ++s) {
    for (int in : g_.node(computed[s]).inputs) {
      auto& use = last_use[static_cast<std::size_t>(root[static_cast<std::size_t>(in)])];
      use = std::max(use, s + 1);  // step s reads it (1-based, so that 0 is "never read")
    }
  }
  // A view's readers are its root's: a reshape after the last reader of its input extends it.
  for (int id = 0; id < g_.size(); ++id) {
    if (!needed_[static_cast<std::size_t>(id)] || g_.node(id).op != "reshape") continue;
    auto& r = last_use[static_cast<std::size_t>(root[static_cast<std::size_t>(id)])];
    r = std::max(r, last_use[static_cast<std::size_t>(id)]);
  }
  for (int f : fetch_ids_) last_use[static_cast<std::size_t>(root[static_cast<std::size_t>(f)])] = forever;
  // Buffers by (dtype, elements): a step's output takes a free one of its size or a new one.
  std::map<std::pair<DType, std::int64_t>, std::vector<Tensor>> free;
  std::map<int, Tensor> buffer_of;  // root id -> its buffer
  auto release_after = [&](std::size_t s) {
    for (auto it = buffer_of.begin(); it != buffer_of.end();) {
      if (last_use[static_cast<std::size_t>(it->first)] == s + 1) {
        free[{it->second.dtype(), it->second.numel()}].push_back(it->second);
        it = buffer_of.erase(it);
      } else {
        ++it;
      }
    }
  };
  for (std::size_t s = 0; s < computed.size(); ++s) {
    const int id = computed[s];
    const Node& n = g_.node(id);
    Step step;
    step.name = n.name;
    step.inputs = n.inputs;
    step.output = id;
    const DType dt = passes::detail::kernel_dtype(g_, n);
    try {
      step.kernel = kernels.create(n.op, KernelConfig{.actor = n.name, .device = device_, .dtype = dt, .attrs = n.attrs});
    } catch (const std::exception& e) {
      throw GraphError(fmt::format("Program: node '{}' ({}): {}", n.name, n.op, e.what()));
    }
    auto& pool = free[{n.dtype, numel(n.shape)}];
    Tensor buf;
    if (!pool.empty()) {
      buf = std::move(pool.back());
      pool.pop_back();
    } else {
      buf = empty_on(alloc_.get(), n.shape, n.dtype);
      buffer_bytes_ += buf.nbytes();
    }
    values_[id] = buf.view(n.shape);
    buffer_of[id] = buf;
    if (last_use[static_cast<std::size_t>(id)] == 0) last_use[static_cast<std::size_t>(id)] = s + 1;  // unread
    steps_.push_back(std::move(step));
    release_after(s);
  }
}

Program::~Program() = default;

void Program::bind(const ParameterStore& params) {
  // Every weight checked before any is bound: refused weights leave the old ones in place.
  std::vector<std::pair<int, const Tensor*>> bound;
  for (int id = 0; id < g_.size(); ++id) {
    const Node& n = g_.node(id);
    if (n.op != "variable" || !needed_[static_cast<std::size_t>(id)]) continue;
    if (!params.contains(n.name)) throw GraphError(fmt::format("Program: no weight '{}' in the parameters", n.name));
    const Tensor& t = params.at(n.name);
    if (t.shape() != n.shape || t.dtype() != n.dtype) {
      throw GraphError(fmt::format("Program: weight '{}' is {}{} but was given {}", n.name, name(n.dtype),
                                   to_string(n.shape), t.describe()));
    }
    bound.emplace_back(id, &t);
  }
  if (!on_stream()) {
    for (auto [id, t] : bound) values_[id] = *t;  // shares the store's bytes (params_ keeps the store)
    return;
  }
  // On a device: uploaded into the program's own copies (made once; a swap writes them again),
  // waited for, so that the store's tensors may change as soon as this returns.
  for (auto [id, t] : bound) {
    auto [it, fresh] = device_weights_.try_emplace(id);
    if (fresh) it->second = empty_on(alloc_.get(), t->shape(), t->dtype());
    copy("to_device", *t, it->second);
    values_[id] = it->second;
  }
  stream_->synchronize();
}

void Program::copy(const char* op, const Tensor& src, Tensor& dst) {
  const Tensor* in = &src;
  Tensor* out = &dst;
  KernelContext ctx{.inputs = std::span<const Tensor* const>(&in, 1),
                    .outputs = std::span<Tensor* const>(&out, 1),
                    .stream = device_.type == DeviceType::cuda ? static_cast<cuda::Stream*>(stream_.get()) : nullptr,
                    .async_stream = stream_.get()};
  copy_kernels_.at({op, src.dtype()})->compute(ctx);
}

void Program::set_params(std::shared_ptr<const ParameterStore> params) {
  if (!params) throw GraphError("Program::set_params: no ParameterStore");
  // Variables must be bound before the steps' pointers are read again: values_ keeps its nodes
  // (std::map), so the pointers stay valid while the tensors change.
  bind(*params);
  params_ = std::move(params);
}

Tensor& Program::input(const std::string& name) {
  auto it = inputs_.find(name);
  if (it == inputs_.end()) throw GraphError(fmt::format("Program: '{}' is not an input it reads", name));
  if (auto host = host_inputs_.find(it->second); host != host_inputs_.end()) return host->second;
  return values_.at(it->second);
}

void Program::run_steps() {
  cuda::Stream* cuda_stream = device_.type == DeviceType::cuda ? static_cast<cuda::Stream*>(stream_.get()) : nullptr;
  for (Step& step : steps_) {
    KernelContext ctx{.inputs = step.in_ptrs, .outputs = step.out_ptrs, .stream = cuda_stream, .async_stream = stream_.get()};
    try {
      step.kernel->compute(ctx);
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format("{}: {}", step.name, e.what()));
    }
  }
}

void Program::capture() {
  std::string why;
  try {
    stream_->begin_capture();
    try {
      run_steps();
    } catch (const std::exception& e) {
      why = e.what();  // what cannot be captured, or a real error the eager run will meet again
    }
    try {
      graph_ = stream_->end_capture();
    } catch (const std::exception& e) {
      if (why.empty()) why = e.what();
    }
  } catch (const std::exception& e) {
    why = e.what();  // the stream cannot capture at all
  }
  if (!why.empty()) {
    graph_.reset();
    graph_refused_ = why;
    fmt::print(stderr, "baton: a program on {} runs its kernels ({}) one by one: its capture into a graph failed: {}\n",
               device_.str(), steps_.size(), why);
  }
}

std::string Program::graph_status() const {
  if (!on_stream()) return "eager";
  if (!graphs_) return "off";
  if (graph_) return "captured";
  if (!graph_refused_.empty()) return "refused: " + graph_refused_;
  return "waiting";
}

const std::vector<Tensor>& Program::run() {
  if (on_stream()) {
    // The stream is idle here (the last run waited for it), so the host inputs are not read by
    // a copy still in flight when the caller writes them.
    for (auto& [id, host] : host_inputs_) copy("to_device", host, values_.at(id));
  }
  if (on_stream() && graphs_ && runs_ > 0 && !graph_ && graph_refused_.empty()) capture();
  ++runs_;
  if (graph_) {
    stream_->launch(*graph_);
    ++graph_launches_;
  } else {
    run_steps();
  }
  if (!on_stream()) {
    for (std::size_t i = 0; i < fetch_ids_.size(); ++i) fetched_[i] = values_.at(fetch_ids_[i]);
    return fetched_;
  }
  for (std::size_t i = 0; i < fetch_ids_.size(); ++i) copy("to_host", values_.at(fetch_ids_[i]), fetched_[i]);
  stream_->synchronize();  // throws naming the stream if a kernel failed on the device
  return fetched_;
}

}  // namespace baton
