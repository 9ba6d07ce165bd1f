#pragma once
/// Tensor parallelism from signatures, as OneFlow's SBP inference does it (Yuan et al., arXiv
/// 2110.15032, section 3): the user writes the logical model once and annotates a few tensors
/// (sbp.h); shard_graph() infers every other tensor's signature op by op, inserts the data
/// movement where a producer's signature differs from what its consumer needs, and writes the
/// physical graph the compiler places: a node per shard (Graph::shard scopes) where a tensor is
/// split or partial, one shared node where it is broadcast. Autodiff then runs on the physical
/// graph, as for a model sharded by hand.
///
///   Graph logical(seed);
///   auto x  = logical.input("x", {32, 64});
///   auto w1 = logical.variable("fc0.w", {64, 256}, init::kaiming(), sbp::split(1));
///   auto b1 = logical.variable("fc0.b", {256}, init::zeros(), sbp::split(0));
///   auto w2 = logical.variable("fc1.w", {256, 64}, init::kaiming(), sbp::split(0));
///   auto y  = matmul(relu(matmul(x, w1) + b1), w2);   // S(1), S(1), then P
///   Graph g(seed);                                     // same seed: same initial weights
///   ShardedGraph sharded = shard_graph(logical, g, 2);
///   Value out = sharded.whole(y);                      // all-reduce: P -> B
///   std::cout << sharded.to_text();                    // every signature and movement
///
/// Split weights become one variable per shard, "<name>.tp<k>" (Node::part_of), whose initial
/// values are the k-th piece of the whole weight's, so tp training starts where one device does;
/// join_parts() puts trained parts back together.
///
/// Movement, and how the physical graph does it (sums in shard order, so every path sums the
/// same numbers in the same order):
///   P -> B     all-reduce: shard k adds its part to the sum so far; the sum is one tensor
///   S(a) -> B  all-gather: concat of the parts along a
///   B -> S(a)  slice: shard k takes its piece (no communication)
///   P -> S(a)  reduce-scatter: shard j slices its part, shard k sums the k-th slices
///   S(a) -> S(b)  all-to-all: an all-gather, then a slice
/// Nothing becomes P by movement: only ops make partial sums.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "baton/graph/graph.h"
#include "baton/graph/sbp.h"

namespace baton {

/// An op's signature: the signatures it needs its inputs in, and its output's.
struct Signature {
  std::vector<Sbp> inputs;
  Sbp output;
  friend bool operator==(const Signature&, const Signature&) = default;
};

/// The signature shard_graph() gives node `id` of `g` over `tp` shards when its inputs come as
/// `given` (one per input). Each op has a table of signatures (OneFlow's per-op SBP signature
/// lists); the one whose movement of the inputs costs least is taken, the first on a tie. Splits
/// propagate from the inputs; an op splits a broadcast input only where that is free (a matmul
/// slicing a weight to meet a split activation). The rules:
///   matmul       B x B -> B; S(m) x B -> S; B x S(n) -> S(last); S(k) x S(k) -> P;
///                S(batch) x B (or x S(batch)) -> S(batch); P x B -> P; B x P -> P
///   elementwise  (add, sub, mul, div, maximum; unary relu, gelu, tanh, sigmoid, scale,
///                stop_gradient; registered ops that say so, op_registry.h) S(a) stays S(a);
///                an input that broadcasts over a is B;
///                P + P -> P, P - P -> P, P * B, B * P, P / B, scale(P) -> P; P + B boxes P to B
///   softmax, log_softmax, layer_norm   S on any axis but the last
///   causal_mask  S on any axis but the last two
///   sum, mean, max   S on a kept axis stays S; sum over the split axis -> P; sum or mean of P -> P
///   reshape      S(a) -> S(a') where the elements before both axes are as many and both
///                extents divide by tp; P -> P
///   transpose    S follows the axis; P -> P
///   slice, concat    S on another axis than theirs; P -> P
///   embedding    ids S(a) -> S(a); table S(1) -> S(last)
///   anything else (and dropout, whose mask spans the whole tensor; the losses)   all B -> B
/// Leaves: a variable's annotation or B; an input's or constant's B.
Signature infer_signature(const Graph& g, int id, const std::vector<Sbp>& given, int tp);

/// What moving a tensor from one signature to another takes.
enum class Movement : std::uint8_t {
  none,
  all_reduce,
  all_gather,
  slice,
  reduce_scatter,
  all_to_all
};
/// The movement from `from` to `to`; throws GraphError for a move to P (only ops make partial
/// sums).
Movement movement(Sbp from, Sbp to);
/// "all-reduce", "all-gather", ...
const char* to_string(Movement m);

/// One movement shard_graph() inserted.
struct Boxing {
  Movement kind = Movement::none;
  std::string tensor;  // the logical tensor moved
  Sbp from, to;
  /// The logical nodes that read the moved tensor; "(output)" for ShardedGraph::whole(),
  /// "(annotation)" where set_sbp asked for it.
  std::vector<std::string> consumers;
};

/// The result of shard_graph(): the physical parts of every logical tensor, their signatures
/// and the movement made. Refers to both graphs, which must outlive it.
class ShardedGraph {
 public:
  ShardedGraph(const Graph& logical, Graph& physical, int tp);

  int tp() const { return tp_; }
  Graph& physical() const { return *physical_; }
  /// The signature logical node `id`'s tensor ended up with (after its annotation, if any).
  Sbp sbp(int id) const { return home_.at(static_cast<std::size_t>(id)); }
  Sbp sbp(const Value& logical) const { return sbp(logical.id()); }
  /// The signature inferred for logical node `id` (inputs empty for leaves).
  const Signature& signature(int id) const { return signatures_.at(static_cast<std::size_t>(id)); }
  /// The physical values of logical node `id` in its signature: one for B, tp for S and P.
  const std::vector<Value>& parts(int id) const;
  const std::vector<Value>& parts(const Value& logical) const { return parts(logical.id()); }
  /// The logical tensor as one physical value (its own if B; else gathered or all-reduced, once).
  Value whole(const Value& logical);
  /// The logical tensor's physical values in signature `to`, moving it there if needed (once).
  const std::vector<Value>& in(int id, Sbp to, const std::string& consumer);
  const std::vector<Boxing>& movements() const { return movements_; }
  /// The logical graph, one line per node with its signature ("matmul_3 = matmul(x, fc0.w)
  /// f32[8, 16] : B, S(1) -> S(1)"), then the movement inserted.
  std::string to_text() const;

 private:
  friend ShardedGraph shard_graph(const Graph& logical, Graph& physical, int tp);
  void shard_node(int id);
  void leaf(int id);
  std::vector<Value> move(int id, Sbp from, Sbp to);
  std::string part_name(int id, const std::string& what, int k) const;

  const Graph* logical_;
  Graph* physical_;
  int tp_;
  std::vector<Sbp> home_;
  std::vector<Signature> signatures_;
  /// (node, signature) -> physical parts; the node's home signature is always there.
  std::map<std::pair<int, std::pair<int, int>>, std::vector<Value>> available_;
  std::vector<Boxing> movements_;
  std::map<std::pair<int, std::pair<int, int>>, std::size_t> boxing_of_;
};

/// Writes the physical graph of `logical` over `tp` shards into `physical` (whose seed should be
/// the logical graph's, so that initial weights match). With tp 1 it copies the graph (names and
/// all) and ignores annotations. Throws GraphError where an annotated split does not divide (naming
/// the tensor, the axis, its size and tp), for a partial-sum annotation on a leaf or a move to P.
ShardedGraph shard_graph(const Graph& logical, Graph& physical, int tp);

/// Marks `sum`, an add on shard k of `tp` that adds shard k's part to the sum of shards
/// 0 .. k-1 (the sum on shard k-1), as link k of a tensor-parallel sum (attrs "tp_sum" and
/// "tp"): the tp_collectives pass makes such a chain one NCCL all-reduce where the shards are
/// GPUs (graph/src/passes/tp_collectives.cpp). Returns sum.
Value tp_sum_link(Value sum, std::int64_t k, std::int64_t tp);

/// Part `index` of `parts` equal pieces of `whole` along `axis`.
Tensor part_along(const Tensor& whole, std::int32_t axis, std::int32_t index, std::int32_t parts);

/// The parts (equal shapes and dtypes, else std::invalid_argument) one after another along `axis`.
Tensor concat_along(const std::vector<const Tensor*>& parts, std::int32_t axis);

/// "NAME.tp<k>" (a split weight's part k, as shard_graph and the models name them) -> {NAME, k};
/// any other name -> {name, -1}.
std::pair<std::string, std::int64_t> tp_part_name(const std::string& name);

/// Whole weights from parts: each variable of `physical` that is part of a split weight
/// (Node::part_of) joined with its sibling parts from `values` under the whole weight's name; every
/// other entry of `values` as it is (shared storage). For checkpoints and comparisons with one
/// device.
std::map<std::string, Tensor> join_parts(const Graph& physical,
                                         const std::map<std::string, Tensor>& values);

}  // namespace baton
