// SBP signature inference and the movement between signatures (sharding.h). The inference is
// greedy, op by op in the graph's order, as OneFlow's per-op signature selection is: each op
// takes the signature from its table whose input movement costs least, given what its inputs
// already are. It does not look ahead (an op whose P output a later op must all-reduce is not
// charged for that).
#include "baton/graph/sharding.h"
#include "baton/graph/op_registry.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "baton/graph/ops.h"

namespace baton {

namespace {

using SbpKey = std::pair<int, int>;
SbpKey key(Sbp s) {
  return {static_cast<int>(s.kind), s.axis};
}

constexpr double infinite = std::numeric_limits<double>::infinity();
// A slice moves no data but is an op: a small cost, so that no op splits a tensor for nothing.
constexpr double slice_cost = 1e-3;

bool divides(const Shape& s, std::int64_t axis, int tp) {
  if (axis < 0 || axis >= static_cast<std::int64_t>(s.size())) return false;
  const std::int64_t e = s[static_cast<std::size_t>(axis)];
  return e >= tp && e % tp == 0;
}

// Elements a move of an n-element tensor receives over all shards, as ring collectives do it:
// all-reduce 2 (tp-1)/tp n, all-gather and reduce-scatter (tp-1)/tp n.
double move_cost(Sbp from, Sbp to, double n, int tp) {
  if (from == to) return 0;
  if (to.is_partial()) return infinite;
  const double ring = static_cast<double>(tp - 1) / tp * n;
  if (from.is_partial()) return to.is_broadcast() ? 2 * ring : ring;
  if (from.is_broadcast()) return slice_cost * n;
  return to.is_broadcast() ? ring : ring + slice_cost * n;  // all-gather; all-to-all
}

std::vector<std::int64_t> int_list(const Attrs& attrs, const char* name) {
  auto it = attrs.values().find(name);
  if (it == attrs.values().end()) return {};
  return std::get<std::vector<std::int64_t>>(it->second);
}

// The input axis that lines up with output axis o under numpy broadcasting, or -1 where the
// input has none or broadcasts over it (extent 1): such an input must be whole on that axis.
std::int64_t aligned_axis(const Shape& x, const Shape& out, std::int64_t o) {
  const auto a = o - static_cast<std::int64_t>(out.size() - x.size());
  if (a < 0 || x[static_cast<std::size_t>(a)] != out[static_cast<std::size_t>(o)]) return -1;
  return a;
}

// S(a) of a reshape's input is S(a') of its output when as many elements come before axis a as
// before a', and both extents divide by tp: shard k then holds the same contiguous run of every
// outer row either way.
std::int64_t reshaped_axis(const Shape& in, const Shape& out, std::int64_t a, int tp) {
  std::int64_t before = 1;
  for (std::int64_t i = 0; i < a; ++i) before *= in[static_cast<std::size_t>(i)];
  std::int64_t p = 1;
  for (std::size_t o = 0; o < out.size(); ++o) {
    if (p == before && divides(out, static_cast<std::int64_t>(o), tp))
      return static_cast<std::int64_t>(o);
    p *= out[o];
    if (p > before) break;
  }
  return -1;
}

bool one_of(const std::string& op, std::initializer_list<const char*> ops) {
  return std::any_of(ops.begin(), ops.end(), [&](const char* o) { return op == o; });
}

// The signature table of one op, given its inputs' signatures.
class Candidates {
 public:
  Candidates(const Graph& g, const Node& n, int tp) : g_(g), n_(n), tp_(tp) {
    add(std::vector<Sbp>(n.inputs.size(), sbp::broadcast()), sbp::broadcast());
  }
  const Shape& shape(std::size_t i) const { return g_.node(n_.inputs[i]).shape; }
  /// Adds a signature if every split in it divides by tp.
  void add(std::vector<Sbp> in, Sbp out) {
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (in[i].is_split() && !divides(shape(i), in[i].axis, tp_)) return;
    }
    if (out.is_split() && !divides(n_.shape, out.axis, tp_)) return;
    Signature s{std::move(in), out};
    if (std::find(list_.begin(), list_.end(), s) == list_.end()) list_.push_back(std::move(s));
  }
  void add1(Sbp in, Sbp out) { add({in}, out); }
  const std::vector<Signature>& list() const { return list_; }

 private:
  const Graph& g_;
  const Node& n_;
  int tp_;
  std::vector<Signature> list_;
};

void matmul_rules(Candidates& c, const Node& n) {
  const auto ra = static_cast<std::int32_t>(c.shape(0).size()),
             rb = static_cast<std::int32_t>(c.shape(1).size());
  const auto ro = static_cast<std::int32_t>(n.shape.size());
  const bool ta = n.attrs.get_int("trans_a", 0) != 0, tb = n.attrs.get_int("trans_b", 0) != 0;
  const std::int32_t am = ta ? ra - 1 : ra - 2, ak = ta ? ra - 2 : ra - 1;
  const std::int32_t bk = tb ? rb - 1 : rb - 2, bn = tb ? rb - 2 : rb - 1;
  const Sbp b = sbp::broadcast(), p = sbp::partial_sum();
  c.add({sbp::split(am), b}, sbp::split(ro - 2));
  c.add({b, sbp::split(bn)}, sbp::split(ro - 1));
  c.add({sbp::split(ak), sbp::split(bk)}, p);
  for (std::int32_t i = 0; i < ra - 2; ++i) {
    c.add({sbp::split(i), rb == 2 ? b : sbp::split(i)}, sbp::split(i));
  }
  c.add({p, b}, p);
  c.add({b, p}, p);
}

void elementwise_rules(Candidates& c, const Node& n, const std::vector<Sbp>& given) {
  // A split of any input, carried to the output's axis; the others sliced to match or whole.
  for (std::size_t i = 0; i < given.size(); ++i) {
    if (!given[i].is_split()) continue;
    const Shape& x = c.shape(i);
    const auto o = given[i].axis + static_cast<std::int64_t>(n.shape.size() - x.size());
    if (aligned_axis(x, n.shape, o) != given[i].axis) continue;
    std::vector<Sbp> in;
    for (std::size_t j = 0; j < given.size(); ++j) {
      const auto a = aligned_axis(c.shape(j), n.shape, o);
      in.push_back(a < 0 ? sbp::broadcast() : sbp::split(static_cast<std::int32_t>(a)));
    }
    c.add(std::move(in), sbp::split(static_cast<std::int32_t>(o)));
  }
  const Sbp b = sbp::broadcast(), p = sbp::partial_sum();
  if (n.op == "add" || n.op == "sub") c.add({p, p}, p);  // sum_k (a_k + b_k) = a + b
  if (n.op == "mul") {
    c.add({p, b}, p);
    c.add({b, p}, p);
  }
  if (n.op == "div") c.add({p, b}, p);
}

void reduce_rules(Candidates& c, const Node& n, const Sbp& given) {
  const auto axes = int_list(n.attrs, "axes");
  const bool keepdims = n.attrs.get_int("keepdims", 0) != 0;
  if (given.is_split()) {
    const bool reduced = std::find(axes.begin(), axes.end(), given.axis) != axes.end();
    if (reduced) {
      if (n.op == "sum") c.add1(given, sbp::partial_sum());  // each shard sums its piece
    } else {
      const auto before =
          std::count_if(axes.begin(), axes.end(), [&](std::int64_t a) { return a < given.axis; });
      c.add1(given,
             sbp::split(static_cast<std::int32_t>(keepdims ? given.axis : given.axis - before)));
    }
  }
  if (given.is_partial() && n.op != "max") c.add1(given, given);
}

}  // namespace

Signature infer_signature(const Graph& g, int id, const std::vector<Sbp>& given, int tp) {
  const Node& n = g.node(id);
  if (given.size() != n.inputs.size()) {
    throw GraphError(fmt::format("infer_signature('{}'): {} signatures for {} inputs", n.name,
                                 given.size(), n.inputs.size()));
  }
  if (n.inputs.empty()) {
    const bool annotated = tp > 1 && n.op == "variable" && n.sbp.has_value();
    return {{}, annotated ? *n.sbp : sbp::broadcast()};
  }
  Candidates c(g, n, tp);
  const std::string& op = n.op;
  const Sbp x = given[0];
  if (op == "matmul") {
    matmul_rules(c, n);
  } else if (one_of(op, {"add", "sub", "mul", "div", "maximum"})) {
    elementwise_rules(c, n, given);
  } else if (const OpDef* def = find_op(op); def != nullptr && def->elementwise) {
    elementwise_rules(c, n, given);  // a registered op that says it is elementwise (op_registry.h)
  } else if (one_of(op, {"relu", "gelu", "tanh", "sigmoid", "scale", "stop_gradient", "cast", "exp", "log", "sqrt",
                         "rsqrt", "pow", "silu"})) {
    if (x.is_split()) c.add1(x, x);
    if (x.is_partial() && (op == "scale" || op == "stop_gradient")) c.add1(x, x);
  } else if (op == "bias_gelu") {
    // Rows split: each shard its rows, the whole bias; columns split: the bias split with them.
    const auto last = static_cast<std::int32_t>(n.shape.size()) - 1;
    if (x.is_split() && x.axis < last) c.add({x, sbp::broadcast()}, x);
    if (x.is_split() && x.axis == last) c.add({x, sbp::split(0)}, x);
  } else if (op == "rms_norm") {
    // Normalised over the last axis: rows split, each shard its rows and the whole scale.
    const auto last = static_cast<std::int32_t>(n.shape.size()) - 1;
    if (x.is_split() && x.axis < last) c.add({x, sbp::broadcast()}, x);
  } else if (op == "rope") {
    // Rotates each position's features by its index on axis -2: any axis before those two.
    if (x.is_split() && x.axis + 2 < static_cast<std::int32_t>(n.shape.size())) c.add1(x, x);
    if (x.is_partial()) c.add1(x, x);  // a rotation is linear
  } else if (op == "attention") {
    // Heads (and batches) are independent: q, k and v split alike on a leading axis (with
    // grouped-query heads too: shard s of q's heads reads shard s of k's and v's).
    const auto rank = static_cast<std::int32_t>(n.shape.size());
    if (x.is_split() && x.axis + 2 < rank) c.add({x, x, x}, x);
  } else if (one_of(op, {"softmax", "log_softmax", "layer_norm"})) {
    if (x.is_split() && x.axis + 1 < static_cast<std::int32_t>(n.shape.size())) c.add1(x, x);
  } else if (op == "causal_mask") {
    if (x.is_split() && x.axis + 2 < static_cast<std::int32_t>(n.shape.size())) c.add1(x, x);
  } else if (one_of(op, {"sum", "mean", "max"})) {
    reduce_rules(c, n, x);
  } else if (op == "reshape") {
    if (x.is_split()) {
      const auto a = reshaped_axis(c.shape(0), n.shape, x.axis, tp);
      if (a >= 0) c.add1(x, sbp::split(static_cast<std::int32_t>(a)));
    }
    if (x.is_partial()) c.add1(x, x);
  } else if (op == "transpose") {
    const auto perm = int_list(n.attrs, "perm");
    if (x.is_split()) {
      const auto to = std::find(perm.begin(), perm.end(), x.axis) - perm.begin();
      c.add1(x, sbp::split(static_cast<std::int32_t>(to)));
    }
    if (x.is_partial()) c.add1(x, x);
  } else if (op == "slice") {
    if (x.is_split() && x.axis != n.attrs.get_int("axis", 0)) c.add1(x, x);
    if (x.is_partial()) c.add1(x, x);
  } else if (op == "concat") {
    const auto axis = n.attrs.get_int("axis", 0);
    for (const Sbp& s : given) {
      if (s.is_split() && s.axis != axis) c.add(std::vector<Sbp>(given.size(), s), s);
    }
    c.add(std::vector<Sbp>(given.size(), sbp::partial_sum()), sbp::partial_sum());
  } else if (op == "embedding") {
    if (given[1].is_split()) c.add({sbp::broadcast(), given[1]}, given[1]);
    if (x.is_split() && x.axis == 1) {
      c.add({x, sbp::broadcast()}, sbp::split(static_cast<std::int32_t>(n.shape.size()) - 1));
    }
  } else if (one_of(op, {"sum_to", "broadcast_to"})) {
    if (x.is_partial()) c.add1(x, x);  // linear
  }
  // Everything else: only the all-B signature Candidates starts with.
  const Signature* best = nullptr;
  double best_cost = infinite;
  for (const Signature& s : c.list()) {
    double cost = 0;
    for (std::size_t i = 0; i < given.size(); ++i) {
      cost += move_cost(given[i], s.inputs[i], static_cast<double>(numel(c.shape(i))), tp);
    }
    if (cost < best_cost) {
      best = &s;
      best_cost = cost;
    }
  }
  return *best;  // the all-B signature always costs less than infinity
}

Movement movement(Sbp from, Sbp to) {
  if (from == to) return Movement::none;
  if (to.is_partial()) {
    throw GraphError(fmt::format("no movement makes {} from {}: only ops make partial sums",
                                 to_string(to), to_string(from)));
  }
  if (from.is_partial()) return to.is_broadcast() ? Movement::all_reduce : Movement::reduce_scatter;
  if (from.is_broadcast()) return Movement::slice;
  return to.is_broadcast() ? Movement::all_gather : Movement::all_to_all;
}

const char* to_string(Movement m) {
  switch (m) {
    case Movement::none:
      return "none";
    case Movement::all_reduce:
      return "all-reduce";
    case Movement::all_gather:
      return "all-gather";
    case Movement::slice:
      return "slice";
    case Movement::reduce_scatter:
      return "reduce-scatter";
    case Movement::all_to_all:
      return "all-to-all";
  }
  return "?";
}

ShardedGraph::ShardedGraph(const Graph& logical, Graph& physical, int tp)
    : logical_(&logical),
      physical_(&physical),
      tp_(tp),
      home_(static_cast<std::size_t>(logical.size())),
      signatures_(static_cast<std::size_t>(logical.size())) {}

const std::vector<Value>& ShardedGraph::parts(int id) const {
  auto it = available_.find({id, key(sbp(id))});
  if (it == available_.end())
    throw GraphError(fmt::format("shard_graph: node {} has not been sharded", id));
  return it->second;
}

Value ShardedGraph::whole(const Value& logical) {
  if (!logical.valid() || &logical.graph() != logical_) {
    throw GraphError("ShardedGraph::whole: the value is not one of the logical graph's");
  }
  return in(logical.id(), sbp::broadcast(), "(output)")[0];
}

std::string ShardedGraph::part_name(int id, const std::string& what, int k) const {
  return fmt::format("{}{}.tp{}", logical_->node(id).name, what, k);
}

const std::vector<Value>& ShardedGraph::in(int id, Sbp to, const std::string& consumer) {
  const auto k = std::pair{id, key(to)};
  if (auto it = available_.find(k); it != available_.end()) {
    if (auto b = boxing_of_.find(k); b != boxing_of_.end()) {
      auto& readers = movements_[b->second].consumers;
      if (std::find(readers.begin(), readers.end(), consumer) == readers.end())
        readers.push_back(consumer);
    }
    return it->second;
  }
  const Node& n = logical_->node(id);
  const Sbp from = sbp(id);
  if (to.is_partial()) {
    throw GraphError(fmt::format(
        "shard_graph: {} needs '{}' {}{} as P, but it is {}; only ops make partial sums", consumer,
        n.name, name(n.dtype), baton::to_string(n.shape), to_string(from)));
  }
  if (to.is_split() && !divides(n.shape, to.axis, tp_)) {
    const bool has = to.axis >= 0 && to.axis < static_cast<std::int32_t>(n.shape.size());
    throw GraphError(
        fmt::format("shard_graph: '{}' {}{} as {}: {}, which is not divisible by tp {}", n.name,
                    name(n.dtype), baton::to_string(n.shape), to_string(to),
                    has ? fmt::format("axis {} has size {}", to.axis,
                                      n.shape[static_cast<std::size_t>(to.axis)])
                        : fmt::format("it has no axis {}", to.axis),
                    tp_));
  }
  const Movement m = movement(from, to);
  std::vector<Value> made = move(id, from, to);
  movements_.push_back({m, n.name, from, to, {consumer}});
  boxing_of_[k] = movements_.size() - 1;
  return available_.emplace(k, std::move(made)).first->second;
}

std::vector<Value> ShardedGraph::move(int id, Sbp from, Sbp to) {
  Graph& g = *physical_;
  const std::string& name = logical_->node(id).name;
  const std::vector<Value> src = available_.at({id, key(from)});  // a copy: emplace may come first
  const Shape& shape = logical_->node(id).shape;
  const std::int64_t piece = to.is_split() ? shape[static_cast<std::size_t>(to.axis)] / tp_ : 0;
  std::vector<Value> out;
  auto slices_of = [&](const Value& whole) {
    for (int k = 0; k < tp_; ++k) {
      auto on = g.shard(k);
      out.push_back(slice(whole, to.axis, k * piece, (k + 1) * piece)
                        .named(part_name(id, fmt::format(".slice{}", to.axis), k)));
    }
  };
  switch (movement(from, to)) {
    case Movement::none:
      return src;
    case Movement::all_reduce: {
      // Shard k adds its part to the sum so far, as a model sharded by hand sums its shards'
      // partial products; the sum is one tensor (on the last shard) that every consumer reads.
      // Each add says which link of the chain it is (attrs "tp_sum" k of "tp"): the
      // tp_collectives pass makes the chain one NCCL all-reduce where the shards are GPUs.
      Value sum = src[0];
      for (int k = 1; k < tp_; ++k) {
        auto on = g.shard(k);
        sum = (sum + src[static_cast<std::size_t>(k)])
                  .named(k + 1 == tp_ ? name + ".allreduce" : part_name(id, ".allreduce", k));
        tp_sum_link(sum, k, tp_);
      }
      return {sum};
    }
    case Movement::all_gather: {
      auto on = g.shard(-1);
      return {concat(src, from.axis).named(name + ".allgather")};
    }
    case Movement::slice:
      slices_of(src[0]);
      return out;
    case Movement::reduce_scatter:
      // Shard j cuts its part into tp pieces and sends piece k to shard k, which sums them in
      // shard order (the all-reduce's order: the same sums, only a piece of them on each shard).
      for (int k = 0; k < tp_; ++k) {
        Value sum;
        for (int j = 0; j < tp_; ++j) {
          Value cut;
          {
            auto on = g.shard(j);
            cut = slice(src[static_cast<std::size_t>(j)], to.axis, k * piece, (k + 1) * piece)
                      .named(fmt::format("{}.cut{}.tp{}.for{}", name, to.axis, j, k));
          }
          auto on = g.shard(k);
          sum = j == 0 ? cut : sum + cut;
        }
        out.push_back(sum.named(part_name(id, fmt::format(".reduce_scatter{}", to.axis), k)));
      }
      return out;
    case Movement::all_to_all:
      // An all-gather, then each shard's slice: simple, not the (tp-1)/tp^2 exchange of a real
      // all-to-all.
      slices_of(in(id, sbp::broadcast(), fmt::format("(all-to-all to {})", to_string(to)))[0]);
      return out;
  }
  return out;
}

void ShardedGraph::leaf(int id) {
  Graph& g = *physical_;
  const Node& n = logical_->node(id);
  const Signature sig = infer_signature(*logical_, id, {}, tp_);
  signatures_[static_cast<std::size_t>(id)] = sig;
  std::vector<Value> made;
  if (n.op == "variable" && sig.output.is_partial()) {
    throw GraphError(fmt::format(
        "shard_graph: variable '{}' is annotated P; a weight is split (S) or whole (B)", n.name));
  }
  if (n.op == "variable" && sig.output.is_split()) {
    const auto a = sig.output.axis;
    if (!divides(n.shape, a, tp_)) {
      throw GraphError(fmt::format(
          "shard_graph: '{}' {}{} as {}: axis {} has size {}, which is not divisible by tp {}",
          n.name, name(n.dtype), to_string(n.shape), to_string(sig.output), a,
          n.shape[static_cast<std::size_t>(a)], tp_));
    }
    if (n.part_of)
      throw GraphError(
          fmt::format("shard_graph: '{}' is already a part of '{}'", n.name, n.part_of->name));
    Shape part = n.shape;
    part[static_cast<std::size_t>(a)] /= tp_;
    for (int k = 0; k < tp_; ++k) {
      auto on = g.shard(k);
      Value v = g.variable(part_name(id, "", k), part, n.init, n.dtype);
      Node& p = g.node_mut(v.id());
      p.trainable = n.trainable;
      p.part_of = PartOf{n.name, n.shape, a, k, tp_};
      made.push_back(v);
    }
  } else {
    auto on = g.shard(-1);
    Value v;
    if (n.op == "variable") {
      v = g.variable(n.name, n.shape, n.init, n.dtype);
      g.node_mut(v.id()).trainable = n.trainable;
      g.node_mut(v.id()).part_of = n.part_of;
    } else if (n.op == "input") {
      v = g.input(n.name, n.shape, n.dtype);
    } else {
      v = g.add(n.op, {}, n.attrs, n.shape, n.dtype).named(n.name);
    }
    made.push_back(v);
  }
  home_[static_cast<std::size_t>(id)] = sig.output;
  available_.emplace(std::pair{id, key(sig.output)}, std::move(made));
}

void ShardedGraph::shard_node(int id) {
  const Node& n = logical_->node(id);
  if (n.inputs.empty()) {
    leaf(id);
  } else {
    std::vector<Sbp> given;
    for (int in : n.inputs) given.push_back(sbp(in));
    const Signature sig = infer_signature(*logical_, id, given, tp_);
    signatures_[static_cast<std::size_t>(id)] = sig;
    std::vector<std::vector<Value>> ins;
    for (std::size_t i = 0; i < n.inputs.size(); ++i)
      ins.push_back(in(n.inputs[i], sig.inputs[i], n.name));
    Graph& g = *physical_;
    std::vector<Value> made;
    if (sig.output.is_broadcast()) {
      auto on = g.shard(-1);
      std::vector<Value> args;
      for (const auto& parts : ins) args.push_back(parts[0]);
      made.push_back(g.add(n.op, std::move(args), n.attrs, n.shape, n.dtype).named(n.name));
    } else {
      Shape part = n.shape;
      if (sig.output.is_split()) part[static_cast<std::size_t>(sig.output.axis)] /= tp_;
      for (int k = 0; k < tp_; ++k) {
        auto on = g.shard(k);
        std::vector<Value> args;
        for (const auto& parts : ins)
          args.push_back(parts.size() == 1 ? parts[0] : parts[static_cast<std::size_t>(k)]);
        made.push_back(
            g.add(n.op, std::move(args), n.attrs, part, n.dtype).named(part_name(id, "", k)));
      }
    }
    home_[static_cast<std::size_t>(id)] = sig.output;
    available_.emplace(std::pair{id, key(sig.output)}, std::move(made));
  }
  // An annotation on a computed tensor (or an input) moves it there; consumers see that.
  if (tp_ > 1 && n.sbp && n.op != "variable" && *n.sbp != sbp(id)) {
    in(id, *n.sbp, "(annotation)");
    home_[static_cast<std::size_t>(id)] = *n.sbp;
  }
}

ShardedGraph shard_graph(const Graph& logical, Graph& physical, int tp) {
  if (tp < 1) throw GraphError(fmt::format("shard_graph: tp must be >= 1, not {}", tp));
  if (&logical == &physical)
    throw GraphError("shard_graph: the physical graph must be another graph than the logical one");
  ShardedGraph s(logical, physical, tp);
  for (int id = 0; id < logical.size(); ++id) s.shard_node(id);
  return s;
}

std::string ShardedGraph::to_text() const {
  std::string out = fmt::format(
      "# signatures over tp {} (S(a): split on axis a, B: broadcast, P: partial sum)\n", tp_);
  for (int id = 0; id < logical_->size(); ++id) {
    const Node& n = logical_->node(id);
    const Signature& sig = signature(id);
    std::string args, ins;
    for (int i : n.inputs)
      args += fmt::format("{}{}", args.empty() ? "" : ", ", logical_->node(i).name);
    for (const Sbp& s : sig.inputs)
      ins += fmt::format("{}{}", ins.empty() ? "" : ", ", to_string(s));
    std::string attrs = n.attrs.str();
    out += fmt::format("{} = {}({}){} {}{} : {}{}", n.name, n.op, args,
                       attrs.empty() ? "" : " " + attrs, name(n.dtype), baton::to_string(n.shape),
                       ins.empty() ? "" : ins + " -> ", to_string(sig.output));
    if (tp_ > 1 && n.sbp) {
      out += sbp(id) == sig.output && n.inputs.empty()
                 ? " (annotated)"
                 : fmt::format(" (annotated {})", to_string(sbp(id)));
    }
    out += "\n";
  }
  out += movements_.empty() ? "# no movement\n" : "# movement\n";
  for (const Boxing& b : movements_) {
    std::string readers;
    for (const auto& c : b.consumers)
      readers += fmt::format("{}{}", readers.empty() ? "" : ", ", c);
    out += fmt::format("{} {}: {} -> {}, for {}\n", to_string(b.kind), b.tensor, to_string(b.from),
                       to_string(b.to), readers);
  }
  return out;
}

Value tp_sum_link(Value sum, std::int64_t k, std::int64_t tp) {
  sum.graph().node_mut(sum.id()).attrs.set("tp_sum", k).set("tp", tp);
  return sum;
}

Tensor part_along(const Tensor& whole, std::int32_t axis, std::int32_t index, std::int32_t parts) {
  const Shape& s = whole.shape();
  const auto a = static_cast<std::size_t>(axis);
  std::int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < a; ++i) outer *= s[i];
  for (std::size_t i = a + 1; i < s.size(); ++i) inner *= s[i];
  const std::int64_t piece = s[a] / parts;
  Shape ps = s;
  ps[a] = piece;
  Tensor out = Tensor::empty(ps, whole.dtype());
  const std::size_t es = size_of(whole.dtype());
  const auto* src = static_cast<const std::byte*>(whole.raw());
  auto* dst = static_cast<std::byte*>(out.raw());
  const auto run = static_cast<std::size_t>(piece * inner) * es;
  if (run == 0) return out;
  for (std::int64_t o = 0; o < outer; ++o) {
    std::memcpy(dst + static_cast<std::size_t>(o) * run,
                src + (static_cast<std::size_t>(o * s[a] + index * piece) * static_cast<std::size_t>(inner)) * es, run);
  }
  return out;
}

Tensor concat_along(const std::vector<const Tensor*>& parts, std::int32_t axis) {
  if (parts.empty()) throw std::invalid_argument("concat_along: no parts");
  const Shape& piece_shape = parts[0]->shape();
  const auto a = static_cast<std::size_t>(axis);
  if (a >= piece_shape.size()) {
    throw std::invalid_argument(fmt::format("concat_along: axis {} of {}", axis, to_string(piece_shape)));
  }
  for (const Tensor* p : parts) {
    if (p->shape() != piece_shape || p->dtype() != parts[0]->dtype()) {
      throw std::invalid_argument(
          fmt::format("concat_along: part {} beside part {}", p->describe(), parts[0]->describe()));
    }
  }
  Shape s = piece_shape;
  s[a] *= static_cast<std::int64_t>(parts.size());
  std::int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < a; ++i) outer *= s[i];
  for (std::size_t i = a + 1; i < s.size(); ++i) inner *= s[i];
  const std::int64_t piece = piece_shape[a];
  Tensor t = Tensor::empty(s, parts[0]->dtype());
  const std::size_t es = size_of(t.dtype());
  const auto run = static_cast<std::size_t>(piece * inner) * es;
  auto* dst = static_cast<std::byte*>(t.raw());
  for (std::int64_t o = 0; o < outer && run > 0; ++o) {
    for (std::size_t k = 0; k < parts.size(); ++k) {
      std::memcpy(dst + (static_cast<std::size_t>(o * s[a]) + k * static_cast<std::size_t>(piece)) *
                            static_cast<std::size_t>(inner) * es,
                  static_cast<const std::byte*>(parts[k]->raw()) + static_cast<std::size_t>(o) * run, run);
    }
  }
  return t;
}

std::pair<std::string, std::int64_t> tp_part_name(const std::string& name) {
  const auto at = name.rfind(".tp");
  if (at == std::string::npos || at + 3 == name.size()) return {name, -1};
  std::int64_t k = 0;
  for (std::size_t i = at + 3; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return {name, -1};
    k = 10 * k + (name[i] - '0');
  }
  return {name.substr(0, at), k};
}

std::map<std::string, Tensor> join_parts(const Graph& physical,
                                         const std::map<std::string, Tensor>& values) {
  std::map<std::string, std::vector<const Node*>> families;
  for (int id = 0; id < physical.size(); ++id) {
    const Node& n = physical.node(id);
    if (n.op == "variable" && n.part_of) families[n.part_of->name].push_back(&n);
  }
  std::map<std::string, Tensor> out;
  std::vector<std::string> joined;
  for (const auto& [whole, members] : families) {
    const PartOf& first = *members[0]->part_of;
    std::vector<const Tensor*> parts(static_cast<std::size_t>(first.parts), nullptr);
    for (const Node* m : members) {
      auto it = values.find(m->name);
      if (it == values.end()) continue;
      parts.at(static_cast<std::size_t>(m->part_of->index)) = &it->second;
    }
    if (std::any_of(parts.begin(), parts.end(), [](const Tensor* t) { return t == nullptr; }))
      continue;  // not all here
    const Shape& s = first.shape;
    const auto a = static_cast<std::size_t>(first.axis);
    for (std::size_t k = 0; k < parts.size(); ++k) {
      const Tensor& p = *parts[k];
      if (p.shape().size() != s.size() || p.shape()[a] * first.parts != s[a] || p.dtype() != parts[0]->dtype()) {
        throw GraphError(fmt::format("join_parts: '{}' part {} is {}, not a piece of {}{}", whole, k, p.describe(),
                                     name(parts[0]->dtype()), to_string(s)));
      }
    }
    Tensor t = concat_along(parts, first.axis);
    out[whole] = std::move(t);
    for (const Node* m : members) joined.push_back(m->name);
  }
  for (const auto& [n, t] : values) {
    if (std::find(joined.begin(), joined.end(), n) == joined.end()) out.emplace(n, t);
  }
  return out;
}

}  // namespace baton
