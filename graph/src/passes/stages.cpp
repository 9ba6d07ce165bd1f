// The pipeline staging pass (passes.h): each node's stage and each stage's activation depth.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/graph/passes.h"
#include "baton/graph/profile.h"
#include "baton/graph/schedule.h"

namespace baton::passes {

namespace {

bool is_leaf(const Node& n) {
  return n.op == "input" || n.op == "variable" || (n.op == "fill" && n.inputs.empty());
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

/// A forward op that only reads one weight (its cast under autocast, a view of it): it goes with
/// its first reader, as the weight does, not where the cut happens to fall, so that the weight
/// and its cast stay on the stage that reads them (a cast on the stage before would send the
/// whole weight across every micro-batch).
bool follows_reader(const Graph& g, const Node& n) {
  return n.inputs.size() == 1 && g.node(n.inputs[0]).op == "variable";
}

/// Where a stage may begin: not inside a tensor-parallel region, between one shard's ops and the
/// next's (Node::tp_shard above 0: shard k's ops and the chain that sums the shards' parts),
/// since a stage's tp group is that stage's devices and a sum whose parts were made on two
/// stages would have members in two groups (tp_collectives could not make it one NCCL call).
bool may_begin_stage(const Node& n) { return n.tp_shard <= 0; }

/// The forward ops (in order) cut into `stages` runs of about equal cost (`measured`, each
/// node's profiled cost, or the estimate).
void cut_forward(const Graph& g, const std::vector<bool>& need, int loss_id, int stages,
                 const std::vector<double>* measured, std::vector<int>& stage) {
  auto counted = [&](int id) {
    const Node& n = g.node(id);
    return need[static_cast<std::size_t>(id)] && !is_leaf(n) && !follows_reader(g, n);
  };
  double total = 0;
  int starts = 0;
  for (int id = 0; id <= loss_id; ++id) {
    if (!counted(id)) continue;
    total += measured ? (*measured)[static_cast<std::size_t>(id)] : op_cost(g, g.node(id));
    starts += may_begin_stage(g.node(id)) ? 1 : 0;
  }
  if (starts < stages) {
    throw GraphError(fmt::format(
        "a {}-stage pipeline needs at least {} ops in the forward pass where a stage can begin (outside a "
        "tensor-parallel region); this one has {}",
        stages, stages, starts));
  }
  double done = 0;
  int last = 0, placed = 0;
  for (int id = 0; id <= loss_id; ++id) {
    if (!counted(id)) continue;
    const Node& n = g.node(id);
    const double c = measured ? (*measured)[static_cast<std::size_t>(id)] : op_cost(g, n);
    int s = last;
    if (may_begin_stage(n)) {
      s = static_cast<int>((done + c / 2) / total * stages);
      // Stages in order, none skipped (at most one past the previous op's), and never so early
      // that too few places to begin one are left for the stages after this one.
      const int lo = std::max(last, stages - (starts - placed));
      const int hi = placed == 0 ? 0 : last + 1;
      s = std::clamp(s, lo, std::max(lo, hi));
      ++placed;
    }
    stage[static_cast<std::size_t>(id)] = s;
    last = s;
    done += c;
  }
}

/// Pipeline stages: the forward ops cut by cost; inputs and variables go with their first
/// reader; a backward op goes with the forward op whose backward step made it (Node::grad_of):
/// the gradient of a weight is made where the weight and its accumulation live, and only dx
/// crosses back to the stage before. A backward op without one goes with the latest stage
/// among its forward inputs, or, with none, with the earliest among its inputs (where the
/// summed gradient is needed next).
std::vector<int> assign_stages(const Graph& g, const std::vector<bool>& need, int loss_id,
                               int stages, const std::vector<double>* measured) {
  std::vector<int> stage(static_cast<std::size_t>(g.size()), -1);
  cut_forward(g, need, loss_id, stages, measured, stage);
  // A weight's cast or view: its first forward reader's stage (follows_reader).
  for (int id = 0; id <= loss_id; ++id) {
    if (!need[static_cast<std::size_t>(id)] || is_leaf(g.node(id))) continue;
    for (int in : g.node(id).inputs) {
      if (stage[static_cast<std::size_t>(in)] < 0 && follows_reader(g, g.node(in))) {
        stage[static_cast<std::size_t>(in)] = stage[static_cast<std::size_t>(id)];
      }
    }
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

/// Each node's profiled cost (profile.h), a forward op's including its backward steps.
std::vector<double> measured_costs(const Graph& g, const Differentiated& d,
                                   const ParameterStore& params) {
  // A stage runs its forward ops and their backward steps (Node::grad_of), so a forward op
  // costs both. A kernel too fast to time still counts a little, so that no stage is cut
  // from nothing.
  std::vector<double> measured = profile_op_costs(g, params, {.only = d.need});
  for (int id = g.size() - 1; id > d.loss.id(); --id) {
    const int of = g.node(id).grad_of;
    if (of >= 0) measured[static_cast<std::size_t>(of)] += measured[static_cast<std::size_t>(id)];
  }
  for (double& c : measured) c = std::max(c, 1e-9);
  return measured;
}

}  // namespace

Stages stages(const Graph& g, const Differentiated& d, const TrainConfig& cfg,
              const ParameterStore& params) {
  Stages out{.pp = cfg.pp, .devices = cfg.pp, .backward_slots = cfg.activation_slots};
  const PipelineSchedule sch = parse_schedule(cfg.schedule);
  if (cfg.pp <= 1) {
    out.forward_slots.push_back(cfg.activation_slots);
    return out;
  }
  // The schedule's depths (schedule.h, register_depths): GPipe M, 1F1B pp - s, the others what
  // their sequences hold between a stage's forward and its last backward unit.
  RegisterDepths depth = register_depths(sch, cfg.pp, cfg.microbatches, cfg.virtual_stages, cfg.activation_slots);
  out.pp = static_cast<int>(depth.forward.size());
  out.forward_slots = std::move(depth.forward);
  if (out.pp != cfg.pp || sch == PipelineSchedule::zb_h1 || sch == PipelineSchedule::zb_v) {
    for (int s = 0; s < out.pp; ++s) out.device.push_back(device_of_stage(sch, cfg.pp, s));
    out.backward_slots_of = std::move(depth.backward);
  }
  std::vector<double> measured;
  if (cfg.balance == "profile") measured = measured_costs(g, d, params);
  try {
    out.of = assign_stages(g, d.need, d.loss.id(), out.pp, measured.empty() ? nullptr : &measured);
  } catch (const GraphError& e) {
    if (out.pp == cfg.pp) throw;
    throw GraphError(fmt::format("schedule '{}' cuts the model into pp {} x {} stages per device: {}", cfg.schedule,
                                 cfg.pp, out.pp / cfg.pp, e.what()));
  }
  return out;
}

std::vector<bool> weight_gradient_nodes(const Graph& g, const Differentiated& d) {
  // The gradients of activations: what a forward node's backward step (Node::grad_of) reads
  // that another step made (the dy it was handed; the rules read forward values and dy). B
  // work is every backward node that some such gradient depends on (the input-gradient chain
  // down to the stage before); W work is the rest: what only the weights' gradients read.
  const int loss = d.loss.id();
  const auto n = static_cast<std::size_t>(g.size());
  std::vector<bool> input_work(n, false), w(n, false);
  for (int id = loss + 1; id < g.size(); ++id) {
    const Node& node = g.node(id);
    if (!d.need[static_cast<std::size_t>(id)] || node.grad_of < 0) continue;
    for (int in : node.inputs) {
      if (in > loss && g.node(in).grad_of != node.grad_of) input_work[static_cast<std::size_t>(in)] = true;
    }
  }
  // Backwards over the ids (a topological order): what an input gradient reads is B work too.
  for (int id = g.size() - 1; id > loss; --id) {
    const auto i = static_cast<std::size_t>(id);
    if (!d.need[i]) continue;
    if (input_work[i]) {
      for (int in : g.node(id).inputs) {
        if (in > loss) input_work[static_cast<std::size_t>(in)] = true;
      }
    } else {
      w[i] = true;
    }
  }
  return w;
}

std::string Stages::to_text(const Graph& g, const Differentiated& d) const {
  std::string out = fmt::format("pp {}, activation slots by stage [{}], backward {}\n", pp,
                                fmt::join(forward_slots, ", "),
                                backward_slots_of.empty() ? fmt::format("{}", backward_slots)
                                                          : fmt::format("[{}]", fmt::join(backward_slots_of, ", ")));
  if (!device.empty()) out += fmt::format("{} devices, device by stage [{}]\n", devices, fmt::join(device, ", "));
  for (int id = 0; id < g.size(); ++id) {
    if (d.need[static_cast<std::size_t>(id)])
      out += fmt::format("{} stage={}\n", g.node(id).name, at(id));
  }
  return out;
}

}  // namespace baton::passes
