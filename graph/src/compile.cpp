// Graph -> plan for one device. See compile.h for the shape of a training plan:
//
//   data ──> forward ops ──> loss ──> loss.report
//                 ^    \──> backward ops ──> accumulate(M) ──┐
//   variable ──> repeat(M)                                   │ (delay 1: step s's weights come
//      ^──────────────────────────────────────────────────────┘  from step s-1's gradients)
#include "baton/graph/compile.h"

#include <cmath>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "baton/actors/runtime.h"
#include "baton/graph/autodiff.h"
#include "baton/kernels/optim.h"

namespace baton {

namespace {

bool is_float(DType t) { return t == DType::f32 || t == DType::f64; }

DType kernel_dtype(const Graph& g, const Node& n) {
  if (is_float(n.dtype)) return n.dtype;
  for (int in : n.inputs) {
    if (is_float(g.node(in).dtype)) return g.node(in).dtype;
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

/// A weight with its optimizer. Act 0 emits the initial value; act k >= 1 applies step k-1's
/// summed gradient (input 0, read with delay 1), scaled by the clipping factor (input 1, if
/// any), then emits the new value. The master copy is the ParameterStore's tensor itself.
template <class T>
class VariableKernel final : public Kernel {
 public:
  VariableKernel(Tensor master, OptimizerConfig cfg, std::int64_t total_steps)
      : master_(std::move(master)), cfg_(cfg), total_steps_(total_steps) {
    auto n = static_cast<std::size_t>(master_.numel());
    if (cfg_.kind == OptimizerConfig::Kind::sgd) {
      if (cfg_.momentum != 0.0) m_.assign(n, T(0));
    } else {
      m_.assign(n, T(0));
      v_.assign(n, T(0));
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
    double lr = cfg_.lr;
    if (cfg_.cosine) {
      lr = lr_schedule(cfg_.lr, step, cfg_.warmup_steps, total_steps_, cfg_.min_lr_ratio);
    } else if (cfg_.warmup_steps > 0 && step < cfg_.warmup_steps) {
      lr = cfg_.lr * static_cast<double>(step) / static_cast<double>(cfg_.warmup_steps);
    }
    auto w = master_.data<T>();
    if (cfg_.kind == OptimizerConfig::Kind::sgd) {
      SgdConfig c{cfg_.lr, cfg_.momentum, cfg_.weight_decay, cfg_.nesterov};
      sgd_step(w, grad, std::span<T>(m_), c, step, lr);
    } else {
      AdamConfig c{cfg_.lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay,
                   cfg_.kind == OptimizerConfig::Kind::adamw};
      adam_step(w, grad, std::span<T>(m_), std::span<T>(v_), c, step, lr);
    }
  }

  Tensor master_;
  OptimizerConfig cfg_;
  std::int64_t total_steps_;
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

/// Builds the actors and registers for the nodes a plan needs.
struct PlanBuilder {
  Graph& g;
  Plan plan;
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  std::map<int, RegisterIndex> reg_of;  // node -> the register its per-micro-batch value is in

  RegisterIndex add_register(std::string name, const Shape& shape, DType dtype, std::int32_t slots) {
    return plan.add_register({.name = std::move(name), .shape = shape, .dtype = dtype, .slots = slots});
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
    plan.add_actor({.name = n.name, .kind = ActorKind::compute, .op = n.op, .dtype = kernel_dtype(g, n),
                    .where = {.stream = stream}, .inputs = std::move(inputs), .outputs = {out}, .attrs = n.attrs});
  }

  void source_actor(const std::string& name, const std::string& op, DType dtype, std::vector<RegisterIndex> outputs,
                    std::int64_t pieces, std::uint8_t stream, Attrs attrs = {}) {
    plan.add_actor({.name = name, .kind = ActorKind::source, .op = op, .dtype = dtype, .where = {.stream = stream},
                    .outputs = std::move(outputs), .pieces = pieces, .attrs = std::move(attrs)});
  }
};

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

}  // namespace

TrainingJob compile_training(Graph& g, Value loss, const TrainConfig& cfg, std::shared_ptr<ParameterStore> params) {
  if (!loss.valid() || &loss.graph() != &g) throw GraphError("compile_training: the loss is not a value of this graph");
  if (!loss.shape().empty()) throw GraphError(fmt::format("the loss must be a scalar; {} is not", loss.describe()));
  if (cfg.steps < 1) throw GraphError(fmt::format("steps must be >= 1, not {}", cfg.steps));
  if (cfg.microbatches < 1) throw GraphError(fmt::format("microbatches must be >= 1, not {}", cfg.microbatches));
  if (!params) params = ParameterStore::initialize(g);
  const std::int64_t m = cfg.microbatches;
  const std::int64_t pieces = cfg.steps * m;
  const int loss_id = loss.id();

  // Gradients of the mean loss over the global batch: each micro-batch's gradient is scaled by
  // 1/M, and the accumulate actor sums the M of them.
  std::vector<Value> vars;
  for (Value v : g.variables()) {
    if (v.node().trainable && v.id() < loss_id) vars.push_back(v);
  }
  std::vector<Value> grads = gradients(loss, vars, 1.0 / static_cast<double>(m));
  std::vector<Value> targets{loss};
  std::vector<std::pair<Value, Value>> trained;  // (variable, gradient)
  for (std::size_t i = 0; i < vars.size(); ++i) {
    if (grads[i].valid()) {
      targets.push_back(grads[i]);
      trained.emplace_back(vars[i], grads[i]);
    }
  }
  std::vector<bool> need = needed_nodes(g, targets);

  PlanBuilder b{g};
  const auto forward_stream = std::uint8_t{0};
  const auto backward_stream = static_cast<std::uint8_t>(cfg.threads >= 2 ? 1 : 0);
  auto stream_of = [&](int id) { return id <= loss_id ? forward_stream : backward_stream; };

  // Data: each binding is one source actor whose outputs are the inputs it feeds.
  std::set<int> fed;
  for (const DataBinding& d : cfg.data) {
    std::vector<RegisterIndex> outs;
    for (const std::string& in : d.inputs) {
      Value v = g.find(in);
      if (!v.valid() || v.node().op != "input") {
        throw GraphError(fmt::format("data '{}' feeds '{}', which is not an input of the graph", d.name, in));
      }
      fed.insert(v.id());
      outs.push_back(b.node_register(v.id(), 2));
    }
    std::string op = "data." + d.name;
    b.kernels.add(op, DeviceType::cpu, DType::f32, d.source);
    b.source_actor(op, op, DType::f32, std::move(outs), pieces, forward_stream);
  }

  // Registers for the summed gradients exist first: variables read them (with a delay) before
  // the accumulate actors that write them are added.
  std::map<int, RegisterIndex> grad_sum;
  for (auto& [v, grad] : trained) {
    grad_sum[v.id()] = b.add_register("grad." + v.name(), v.shape(), v.dtype(), 1);
  }
  std::optional<RegisterIndex> clip_reg;
  if (cfg.optimizer.clip_norm > 0 && !trained.empty()) {
    clip_reg = b.add_register("clip.factor", {1}, trained[0].first.dtype(), 1);
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
      std::string op = "variable." + n.name;
      auto it = grad_sum.find(id);
      const DType dt = n.dtype;
      const Tensor master = params->at(n.name);
      if (it != grad_sum.end()) {
        OptimizerConfig oc = cfg.optimizer;
        const std::int64_t steps = cfg.steps;
        b.kernels.add(op, DeviceType::cpu, dt, [master, oc, steps, dt](const KernelConfig&) -> std::unique_ptr<Kernel> {
          if (dt == DType::f64) return std::make_unique<VariableKernel<double>>(master, oc, steps);
          return std::make_unique<VariableKernel<float>>(master, oc, steps);
        });
        std::vector<InputPort> ins{{it->second, 1}};
        if (clip_reg) ins.push_back({*clip_reg, 1});
        b.plan.add_actor({.name = op, .op = op, .dtype = dt, .where = {.stream = backward_stream},
                          .inputs = std::move(ins), .outputs = {w}, .stops_when_unread = false});
      } else {
        b.kernels.add(op, DeviceType::cpu, dt, [master](const KernelConfig&) {
          return std::make_unique<ConstantSource>(master);
        });
        b.source_actor(op, op, dt, {w}, cfg.steps, backward_stream);
      }
      RegisterIndex rep = b.node_register(id, 2);
      b.plan.add_actor({.name = n.name + ".repeat", .kind = ActorKind::repeat, .dtype = dt,
                        .where = {.stream = backward_stream}, .inputs = {{w}}, .outputs = {rep},
                        .group = static_cast<std::int32_t>(m)});
    } else if (n.op == "fill" && n.inputs.empty()) {
      RegisterIndex r = b.node_register(id, 2);
      b.source_actor(n.name, "fill", n.dtype, {r}, pieces, stream_of(id), n.attrs);
    } else {
      b.op_actor(id, stream_of(id), cfg.activation_slots);
    }
  }

  // Gradient accumulation, clipping, and the loss report.
  std::vector<InputPort> clip_inputs;
  for (auto& [v, grad] : trained) {
    b.plan.add_actor({.name = "grad." + v.name() + ".accumulate", .kind = ActorKind::accumulate, .dtype = v.dtype(),
                      .where = {.stream = backward_stream}, .inputs = {{b.reg_of.at(grad.id())}},
                      .outputs = {grad_sum.at(v.id())}, .group = static_cast<std::int32_t>(m)});
    clip_inputs.push_back({grad_sum.at(v.id())});
  }
  if (clip_reg) {
    const DType dt = trained[0].first.dtype();
    const double max_norm = cfg.optimizer.clip_norm;
    b.kernels.add("optim.clip", DeviceType::cpu, dt, [max_norm, dt](const KernelConfig&) -> std::unique_ptr<Kernel> {
      if (dt == DType::f64) return std::make_unique<ClipKernel<double>>(max_norm);
      return std::make_unique<ClipKernel<float>>(max_norm);
    });
    b.plan.add_actor({.name = "optim.clip", .op = "optim.clip", .dtype = dt, .where = {.stream = backward_stream},
                      .inputs = clip_inputs, .outputs = {*clip_reg}});
  }
  auto losses = std::make_shared<LossLog>(m);
  const DType loss_dt = loss.dtype();
  b.kernels.add_fn("loss.report", DeviceType::cpu, loss_dt, [losses, loss_dt](KernelContext& ctx) {
    const Tensor& t = *ctx.inputs[0];
    losses->record(ctx.piece, loss_dt == DType::f64 ? scalar_of<double>(t) : scalar_of<float>(t));
  });
  b.plan.add_actor({.name = "loss.report", .op = "loss.report", .dtype = loss_dt, .where = {.stream = forward_stream},
                    .inputs = {{b.reg_of.at(loss_id)}}});

  return TrainingJob{std::move(b.plan), std::move(b.kernels), std::move(params), std::move(losses)};
}

std::vector<Tensor> evaluate(Graph& g, const std::map<std::string, Tensor>& feeds, const std::vector<Value>& fetches,
                             const ParameterStore& params) {
  std::vector<bool> need = needed_nodes(g, fetches);
  PlanBuilder b{g};
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
      b.source_actor(op, op, n.dtype, {b.node_register(id, 1)}, 1, 0);
    } else if (n.op == "fill" && n.inputs.empty()) {
      b.source_actor(n.name, "fill", n.dtype, {b.node_register(id, 1)}, 1, 0, n.attrs);
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
  Runtime rt(std::move(b.plan), b.kernels, s);
  rt.run();
  return std::move(*results);
}

}  // namespace baton
