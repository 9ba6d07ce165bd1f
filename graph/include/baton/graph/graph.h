#pragma once
/// The logical graph users write a model in: inputs, variables and ops, with shapes and dtypes
/// inferred as it is built. Handles (Value) are cheap; the Graph owns the nodes.
///
///   baton::Graph g;
///   auto x  = g.input("x", {32, 64});
///   auto y  = g.input("label", {32}, baton::i32);
///   auto w1 = g.variable("w1", {64, 256}, baton::init::xavier());
///   auto b1 = g.variable("b1", {256}, baton::init::zeros());
///   auto h  = relu(matmul(x, w1) + b1);
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "baton/graph/sbp.h"
#include "baton/kernels/attrs.h"
#include "baton/kernels/dtype.h"
#include "baton/kernels/tensor.h"

namespace baton {

class Graph;

/// A graph mistake found while building (mismatched shapes, wrong dtypes, a loss that is not a
/// scalar, an op without a gradient where one is needed): names the op and its inputs.
class GraphError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// How a variable starts. Every initializer draws from a generator seeded by the graph's seed and
/// the variable's name, so the same seed gives the same weights on every run and every rank.
struct Init {
  enum class Kind : std::uint8_t { zeros, constant, uniform, normal, xavier_uniform, kaiming_uniform };
  Kind kind = Kind::zeros;
  double a = 0;  // constant: value; uniform: low; normal: mean
  double b = 0;  // uniform: high; normal: stddev
};

namespace init {
inline Init zeros() { return {Init::Kind::zeros}; }
inline Init ones() { return {Init::Kind::constant, 1.0}; }
inline Init constant(double v) { return {Init::Kind::constant, v}; }
inline Init uniform(double lo, double hi) { return {Init::Kind::uniform, lo, hi}; }
inline Init normal(double mean, double stddev) { return {Init::Kind::normal, mean, stddev}; }
/// Glorot: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) over the last two dimensions.
inline Init xavier() { return {Init::Kind::xavier_uniform}; }
/// He / PyTorch Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
inline Init kaiming() { return {Init::Kind::kaiming_uniform}; }
}  // namespace init

/// A variable that is one part of a bigger, logical one (shard_graph() splits annotated weights
/// this way): it starts as part `index` of `parts` equal pieces along `axis` of the variable
/// `name` of shape `shape` as that one would be initialised, so tensor-parallel training starts
/// where one device does.
struct PartOf {
  std::string name;
  Shape shape;
  std::int32_t axis = 0;
  std::int32_t index = 0;
  std::int32_t parts = 1;
};

/// One node: an op applied to earlier nodes. Inputs and variables are nodes too.
struct Node {
  std::string op;    // "input", "variable", "matmul", ...
  std::string name;  // unique in the graph
  std::vector<int> inputs;
  Attrs attrs;
  Shape shape;
  DType dtype = DType::f32;
  Init init{};             // variables only
  bool trainable = false;  // variables only
  std::optional<PartOf> part_of;  // variables only
  /// The signature the user asked for on the tensor-parallel axis (Graph::set_sbp); unset:
  /// shard_graph() infers it.
  std::optional<Sbp> sbp;
  /// Tensor parallelism: the shard (0 .. tp-1) whose device computes this node, or -1 for a
  /// node every shard shares (it runs on shard 0's device). Set by Graph::Shard scopes.
  std::int32_t tp_shard = -1;
  /// Autodiff: the forward node whose backward step made this node (-1: none). Pipeline stages
  /// put it on that node's stage, next to the activations and weights it reads.
  std::int32_t grad_of = -1;
  /// Activation recomputation (TrainConfig::recompute): the transformer block this node was
  /// made in (Graph::Block scopes; -1: none), and whether it is part of a block's attention
  /// core, softmax(Q K^T) V (Graph::AttentionCore scopes), whose T x T activations selective
  /// recomputation recomputes.
  std::int32_t block = -1;
  bool attention_core = false;
};

/// A handle to a node's output. Cheap to copy; valid while its Graph lives.
class Value {
 public:
  Value() = default;
  Value(Graph* g, int id) : graph_(g), id_(id) {}

  bool valid() const { return graph_ != nullptr; }
  Graph& graph() const;
  int id() const { return id_; }
  const Node& node() const;
  const Shape& shape() const { return node().shape; }
  DType dtype() const { return node().dtype; }
  const std::string& name() const { return node().name; }
  std::int64_t dim(int i) const;
  int rank() const { return static_cast<int>(shape().size()); }
  /// Renames the node (names must stay unique); returns *this for chaining.
  Value named(std::string name) const;
  /// "h1 f32[32, 256]"
  std::string describe() const;

 private:
  Graph* graph_ = nullptr;
  int id_ = -1;
};

class Graph {
 public:
  explicit Graph(std::uint64_t seed = 0) : seed_(seed) {}
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  Graph(Graph&&) = default;

  /// A tensor fed from outside for every micro-batch (data, labels).
  Value input(std::string name, Shape shape, DType dtype = DType::f32);
  /// A weight: trainable by default, initialised from the graph's seed and its name.
  Value variable(std::string name, Shape shape, Init init = init::xavier(), DType dtype = DType::f32);
  /// A weight with its tensor-parallel signature (see set_sbp).
  Value variable(std::string name, Shape shape, Init init, Sbp sbp, DType dtype = DType::f32);
  /// A tensor of one repeated value.
  Value constant(double value, Shape shape, DType dtype = DType::f32);

  /// Adds a node after the caller inferred its shape and dtype (the DSL's ops use this).
  Value add(std::string op, std::vector<Value> inputs, Attrs attrs, Shape shape, DType dtype);

  const Node& node(int id) const { return nodes_.at(static_cast<std::size_t>(id)); }
  Node& node_mut(int id) { return nodes_.at(static_cast<std::size_t>(id)); }
  int size() const { return static_cast<int>(nodes_.size()); }
  std::uint64_t seed() const { return seed_; }
  Value value(int id) { return Value(this, id); }
  /// The node with this name, or an invalid Value.
  Value find(const std::string& name);
  std::vector<Value> variables();
  std::vector<Value> inputs();

  /// Asks shard_graph() (sharding.h) to give v signature s over the tensor-parallel shards: a
  /// weight is created split that way, any other tensor is moved into it after it is computed.
  /// Throws GraphError if v has no such axis. Negative axes count from the end. Returns v.
  Value set_sbp(Value v, Sbp s);

  /// Nodes created while a Shard lives belong to tensor-parallel shard k (see Node::tp_shard):
  ///   { auto on = g.shard(k); h = relu(matmul(x, w_k) + b_k); }
  class Shard {
   public:
    Shard(Graph& g, std::int32_t k) : g_(g), previous_(g.shard_) { g.shard_ = k; }
    ~Shard() { g_.shard_ = previous_; }
    Shard(const Shard&) = delete;
    Shard& operator=(const Shard&) = delete;

   private:
    Graph& g_;
    std::int32_t previous_;
  };
  [[nodiscard]] Shard shard(std::int32_t k) { return Shard(*this, k); }

  /// Nodes created while a Block lives belong to transformer block `index`; while an
  /// AttentionCore lives, to its attention core too (see Node::block). Full recomputation keeps
  /// only what crosses a block's boundary and recomputes the rest in the backward pass:
  ///   for (l ...) { auto in_block = g.block(l); ... { auto core = g.attention_core(); ... } }
  class Block {
   public:
    Block(Graph& g, std::int32_t index, bool core)
        : g_(g), block_(g.block_), core_(g.attention_core_) {
      if (index >= 0) g.block_ = index;
      g.attention_core_ = core || core_;
    }
    ~Block() {
      g_.block_ = block_;
      g_.attention_core_ = core_;
    }
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;

   private:
    Graph& g_;
    std::int32_t block_;
    bool core_;
  };
  [[nodiscard]] Block block(std::int32_t index) { return Block(*this, index, false); }
  /// The attention core of the current block (see Block).
  [[nodiscard]] Block attention_core() { return Block(*this, -1, true); }

  /// Mixed precision, as torch.autocast: while an Autocast lives, the ops made compute
  ///  - matrix products and embeddings in `low` (bf16): their float inputs are cast to it;
  ///  - softmax, log_softmax, the losses, layer_norm, sum and mean in f32, for range and
  ///    precision: their float inputs are cast to f32;
  ///  - elementwise ops whose float inputs differ in dtype in the wider one;
  ///  - everything else in its input's dtype.
  /// Weights stay f32 (the optimizer's master copy) and each is cast once, where first used;
  /// autodiff casts each gradient back to its value's dtype, so a weight's gradient is summed
  /// over micro-batches and replicas and applied in f32.
  ///   { auto bf = g.autocast(); logits = models::mlp(g, ...); loss = softmax_cross_entropy(...); }
  class Autocast {
   public:
    Autocast(Graph& g, std::optional<DType> low) : g_(g), previous_(g.autocast_) { g.autocast_ = low; }
    ~Autocast() { g_.autocast_ = previous_; }
    Autocast(const Autocast&) = delete;
    Autocast& operator=(const Autocast&) = delete;

   private:
    Graph& g_;
    std::optional<DType> previous_;
  };
  /// Throws GraphError unless `low` is bf16 or f32 (f32: autocast off, for a flag's default).
  [[nodiscard]] Autocast autocast(DType low = DType::bf16);
  /// The low dtype while an Autocast lives and is not f32.
  std::optional<DType> autocast_dtype() const { return autocast_; }
  /// cast(v, to), made once per (v, to) and reused (autocast's casts of a weight).
  Value cast_once(Value v, DType to);

  /// One line per node: "h1 = relu(mm1) f32[32, 256]".
  std::string to_text() const;
  /// Graphviz, inputs and variables as ellipses.
  std::string to_dot() const;

 private:
  std::string unique_name(const std::string& base);
  std::vector<Node> nodes_;
  std::uint64_t seed_;
  int counter_ = 0;
  std::int32_t shard_ = -1;
  std::int32_t block_ = -1;
  bool attention_core_ = false;
  std::optional<DType> autocast_;
  std::map<std::pair<int, DType>, int> casts_;
};

}  // namespace baton
