// SBP signatures (sbp.h) and shard_graph() (sharding.h): the inference rules op by op, the
// movement between every pair of signatures (values and gradients against the logical graph),
// and models::mlp written once with annotations: it must train exactly as one device does and
// compile to the plan of the MLP that was sharded by hand before.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "equivalence.h"
#include "models.h"
#include "test_util.h"

using namespace baton;
using baton::test::contains;
using baton::test::count;

namespace {

const Sbp B = sbp::broadcast();
const Sbp P = sbp::partial_sum();
Sbp S(std::int32_t a) {
  return sbp::split(a);
}

Signature sig(Value v, std::vector<Sbp> given, int tp = 2) {
  return infer_signature(v.graph(), v.id(), given, tp);
}

std::string str(const Signature& s) {
  std::string out;
  for (const Sbp& i : s.inputs) out += (out.empty() ? "" : ", ") + to_string(i);
  return out + " -> " + to_string(s.output);
}

// Checks a signature and prints both on failure.
#define CHECK_SIG(actual, expected) \
  CHECK_MESSAGE((actual) == (expected), str(actual) << " vs expected " << str(expected))

// Values in [-1, 1) from a fixed sequence, in `dtype` (f32 or f64: the same numbers, all
// exact in f32).
Tensor filled(Shape shape, std::uint64_t seed, DType dtype = f32) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  std::uint64_t s = seed;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const double x = static_cast<double>(s >> 40) / static_cast<double>(1ull << 24) * 2.0 - 1.0;
    if (dtype == f64) {
      t.data<double>()[static_cast<std::size_t>(i)] = x;
    } else {
      t.data<float>()[static_cast<std::size_t>(i)] = static_cast<float>(x);
    }
  }
  return t;
}

// One evaluation of a logical graph against its sharded form (values and gradients): they
// differ only in the order of their sums (a P's partial sums added by the all-reduce; BLAS
// kernels picked for the shards' narrower shapes). Every sum in these graphs has n = 8 terms;
// two orders of a sum differ by at most 2 n u sum|terms| (Higham, Accuracy and Stability of
// Numerical Algorithms, 4.2). For the movements below (|x| < 1, |w| <= 1.5), t = x w has
// sum|terms| <= 8 x 1.5 = 12, and the gradient 2 x^T t of sum(t * t) sum|terms| <= 8 x 2 x 12
// = 192: its own reordering 2 x 8 x 192 u, plus t's error carried through 2 x^T, 8 x 2 x
// (2 x 8 x 12) u, about 6100 u in all, relative to max(1, |value|). The attention block's
// chain (layer norm, three products, the softmax of the scores, two more products) has sums
// of 8 terms of the same size, and stays within the same bound (BATON_TEST_MARGINS=1: the
// largest used was 0.41% of it, in f32 and f64, under every OpenBLAS kernel family).
double one_pass_tolerance(DType dtype) {
  return 6144 * test::unit_roundoff(dtype);
}

double value(const Tensor& t, std::size_t i) {
  return t.dtype() == f64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}

void check_close(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  REQUIRE(a.dtype() == b.dtype());
  double worst = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(a.numel()); ++i) {
    worst = std::max(worst, test::relative_difference(value(a, i), value(b, i)));
  }
  const double tol = one_pass_tolerance(a.dtype());
  INFO("largest relative difference " << worst << " (" << name(a.dtype()) << ")");
  CHECK(worst <= tol);
  if (const char* m = std::getenv("BATON_TEST_MARGINS"); m != nullptr && std::string(m) == "1") {
    std::printf("margin: %.3g, tolerance %.3g: %.2g%% of it used\n", worst, tol, 100 * worst / tol);
  }
}

// Piece k of tp along `axis` of a 2-D tensor.
Tensor piece_of(const Tensor& t, int axis, int k, int tp) {
  const auto rows = t.dim(0), cols = t.dim(1);
  Shape s = t.shape();
  s[static_cast<std::size_t>(axis)] /= tp;
  Tensor out = Tensor::empty(s, t.dtype());
  const std::size_t es = size_of(t.dtype());
  const auto* src = static_cast<const std::byte*>(t.raw());
  auto* dst = static_cast<std::byte*>(out.raw());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const bool in = axis == 0 ? r / s[0] == k : c / s[1] == k;
      if (in) dst = std::copy_n(src + static_cast<std::size_t>(r * cols + c) * es, es, dst);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("Sbp.PrintsAndAnnotates") {
  CHECK(to_string(S(1)) == "S(1)");
  CHECK(to_string(B) == "B");
  CHECK(to_string(P) == "P");
  Graph g;
  auto w = g.variable("w", {4, 6}, init::zeros(), sbp::split(-1));
  CHECK(w.node().sbp == S(1));  // negative axes count from the end
  auto b = g.variable("b", {6});
  g.set_sbp(b, S(0));
  CHECK(b.node().sbp == S(0));
  CHECK(contains(g.to_text(), "w = variable() f32[4, 6] sbp=S(1)"));
  std::string msg = test::thrown_message<GraphError>([&] { g.set_sbp(b, S(1)); });
  CHECK(contains(msg, "b f32[6]"));
  CHECK(contains(msg, "no axis 1"));
  msg = test::thrown_message<GraphError>([&] {
    g.variable("v", {3, 4}, init::zeros(), sbp::split(-3));
  });
  CHECK(contains(msg, "no axis -3"));
}

TEST_CASE("Sbp.InferenceRulesPerOp") {
  Graph g;
  auto x = g.input("x", {8, 12});
  auto w = g.variable("w", {12, 16});
  auto h = g.input("h", {8, 16});
  auto bias = g.variable("bias", {16});
  auto row = g.input("row", {1, 16});

  SUBCASE("matmul: Megatron's column and row splits, data split, partial sums") {
    auto y = matmul(x, w);
    CHECK_SIG(sig(y, {B, S(1)}), (Signature{{B, S(1)}, S(1)}));     // column parallel
    CHECK_SIG(sig(y, {S(1), S(0)}), (Signature{{S(1), S(0)}, P}));  // row parallel
    CHECK_SIG(sig(y, {S(0), B}), (Signature{{S(0), B}, S(0)}));     // data parallel
    CHECK_SIG(sig(y, {B, B}), (Signature{{B, B}, B}));              // nothing split: nothing moves
    CHECK_SIG(sig(y, {S(1), B}), (Signature{{S(1), S(0)}, P}));     // slicing the weight is free
    CHECK_SIG(sig(y, {P, B}), (Signature{{P, B}, P}));              // linear in each input
    CHECK_SIG(sig(y, {B, P}), (Signature{{B, P}, P}));
    CHECK_SIG(sig(y, {P, S(1)}), (Signature{{B, S(1)}, S(1)}));    // all-reduce the P first
    auto yt = matmul(x, g.variable("wt", {16, 12}), false, true);  // b read transposed: n is axis 0
    CHECK_SIG(sig(yt, {B, S(0)}), (Signature{{B, S(0)}, S(1)}));
    CHECK_SIG(sig(yt, {S(1), S(1)}), (Signature{{S(1), S(1)}, P}));
    auto a3 = g.input("a3", {4, 8, 12});
    auto b3 = g.input("b3", {4, 12, 6});
    CHECK_SIG(sig(matmul(a3, b3), {S(0), S(0)}), (Signature{{S(0), S(0)}, S(0)}));  // batch split
    CHECK_SIG(sig(matmul(a3, w), {S(0), B}), (Signature{{S(0), B}, S(0)}));         // shared weight
    CHECK_SIG(sig(matmul(a3, w), {S(1), B}), (Signature{{S(1), B}, S(1)}));  // rows of each batch
    // Not divisible by 3: the weight cannot be sliced for the row rule, so the split is gathered.
    auto x3 = g.input("x3", {9, 9});
    auto w3 = g.variable("w3", {9, 10});
    CHECK_SIG(sig(matmul(x3, w3), {S(1), B}, 3), (Signature{{S(1), S(0)}, P}));
    CHECK_SIG(sig(matmul(x3, w3), {S(1), B}, 4), (Signature{{B, B}, B}));
  }
  SUBCASE("elementwise: splits stay, broadcast inputs follow, P only where linear") {
    CHECK_SIG(sig(h + bias, {S(1), S(0)}),
              (Signature{{S(1), S(0)}, S(1)}));  // the column-parallel bias
    CHECK_SIG(sig(h + bias, {S(1), B}), (Signature{{S(1), S(0)}, S(1)}));  // sliced to match
    CHECK_SIG(sig(h + bias, {S(0), B}), (Signature{{S(0), B}, S(0)}));     // bias has no axis 0
    CHECK_SIG(sig(h + row, {S(1), B}), (Signature{{S(1), S(1)}, S(1)}));
    CHECK_SIG(sig(h + row, {S(0), B}), (Signature{{S(0), B}, S(0)}));  // row broadcasts over axis 0
    CHECK_SIG(sig(h + h, {P, P}), (Signature{{P, P}, P}));
    CHECK_SIG(sig(h - h, {P, P}), (Signature{{P, P}, P}));
    CHECK_SIG(sig(h + bias, {P, B}), (Signature{{B, B}, B}));           // P + B: all-reduce the P
    CHECK_SIG(sig(h + h, {P, S(1)}), (Signature{{S(1), S(1)}, S(1)}));  // reduce-scatter is cheaper
    CHECK_SIG(sig(h * h, {P, B}), (Signature{{P, B}, P}));
    CHECK_SIG(sig(h * h, {B, P}), (Signature{{B, P}, P}));
    CHECK_SIG(sig(h * h, {P, P}), (Signature{{P, B}, P}));  // all-reduce one of them
    CHECK_SIG(sig(h / h, {P, B}), (Signature{{P, B}, P}));
    CHECK_SIG(sig(h / h, {B, P}), (Signature{{B, B}, B}));
    CHECK_SIG(sig(maximum(h, h), {P, B}), (Signature{{B, B}, B}));
    CHECK_SIG(sig(relu(h), {S(1)}), (Signature{{S(1)}, S(1)}));
    CHECK_SIG(sig(relu(h), {P}), (Signature{{B}, B}));
    CHECK_SIG(sig(gelu(h), {S(0)}), (Signature{{S(0)}, S(0)}));
    CHECK_SIG(sig(h * 2.0, {P}), (Signature{{P}, P}));
    CHECK_SIG(sig(stop_gradient(h), {P}), (Signature{{P}, P}));
    CHECK_SIG(sig(dropout(h, 0.1), {S(0)}),
              (Signature{{B}, B}));  // the mask spans the whole tensor
  }
  SUBCASE("normalisations need the whole last axis") {
    CHECK_SIG(sig(softmax(h), {S(0)}), (Signature{{S(0)}, S(0)}));
    CHECK_SIG(sig(softmax(h), {S(1)}), (Signature{{B}, B}));
    CHECK_SIG(sig(log_softmax(h), {S(1)}), (Signature{{B}, B}));
    CHECK_SIG(sig(layer_norm(h), {S(0)}), (Signature{{S(0)}, S(0)}));
    CHECK_SIG(sig(layer_norm(h), {S(1)}), (Signature{{B}, B}));
    CHECK_SIG(sig(layer_norm(h), {P}), (Signature{{B}, B}));
    auto scores = g.input("scores", {4, 8, 8});
    CHECK_SIG(sig(causal_mask(scores), {S(0)}), (Signature{{S(0)}, S(0)}));
    CHECK_SIG(sig(causal_mask(scores), {S(1)}), (Signature{{B}, B}));
  }
  SUBCASE("the LLM ops: elementwise ones keep a split, rms_norm needs its last axis, rope its last two") {
    for (Value y : {exp(h), log(h), sqrt(h), rsqrt(h), pow(h, 2.0), silu(h)}) {
      CHECK_SIG(sig(y, {S(0)}), (Signature{{S(0)}, S(0)}));
      CHECK_SIG(sig(y, {S(1)}), (Signature{{S(1)}, S(1)}));
      CHECK_SIG(sig(y, {P}), (Signature{{B}, B}));  // not linear: the partial sums added first
    }
    auto scale_w = g.variable("scale_w", {16});
    CHECK_SIG(sig(rms_norm(h, scale_w), {S(0), B}), (Signature{{S(0), B}, S(0)}));
    CHECK_SIG(sig(rms_norm(h, scale_w), {S(0), S(0)}), (Signature{{S(0), B}, S(0)}));  // w gathered
    CHECK_SIG(sig(rms_norm(h, scale_w), {S(1), B}), (Signature{{B, B}, B}));
    CHECK_SIG(sig(rms_norm(h, scale_w), {P, B}), (Signature{{B, B}, B}));
    auto heads = g.input("heads", {2, 4, 8, 6});  // [batch, heads, T, D]
    CHECK_SIG(sig(rope(heads), {S(0)}), (Signature{{S(0)}, S(0)}));
    CHECK_SIG(sig(rope(heads), {S(1)}), (Signature{{S(1)}, S(1)}));  // heads split (tensor parallel)
    CHECK_SIG(sig(rope(heads), {S(2)}), (Signature{{B}, B}));        // positions: t is the index
    CHECK_SIG(sig(rope(heads), {S(3)}), (Signature{{B}, B}));        // the rotated pairs span D
    CHECK_SIG(sig(rope(heads), {P}), (Signature{{P}, P}));  // a rotation is linear
  }
  SUBCASE("reductions: a split axis summed away is a partial sum") {
    CHECK_SIG(sig(sum(h, {1}), {S(1)}), (Signature{{S(1)}, P}));
    CHECK_SIG(sig(sum(h, {1}), {S(0)}), (Signature{{S(0)}, S(0)}));
    CHECK_SIG(sig(sum(h, {0}), {S(1)}), (Signature{{S(1)}, S(0)}));        // the axis moves down
    CHECK_SIG(sig(sum(h, {0}, true), {S(1)}), (Signature{{S(1)}, S(1)}));  // unless kept
    CHECK_SIG(sig(mean(h, {1}), {S(1)}), (Signature{{B}, B}));
    CHECK_SIG(sig(mean(h, {1}), {P}), (Signature{{P}, P}));
    CHECK_SIG(sig(max(h, {1}), {S(1)}), (Signature{{B}, B}));
    CHECK_SIG(sig(max(h, {0}), {S(1)}), (Signature{{S(1)}, S(0)}));
    CHECK_SIG(sig(max(h, {0}), {P}), (Signature{{B}, B}));
    CHECK_SIG(sig(sum(h), {P}), (Signature{{P}, P}));
  }
  SUBCASE("reshape, transpose, slice, concat, embedding") {
    auto t = g.input("t", {8, 4, 6});
    CHECK_SIG(sig(reshape(t, {32, 6}), {S(0)}), (Signature{{S(0)}, S(0)}));
    CHECK_SIG(sig(reshape(t, {32, 6}), {S(2)}), (Signature{{S(2)}, S(1)}));
    CHECK_SIG(sig(reshape(t, {8, 24}), {S(1)}),
              (Signature{{S(1)}, S(1)}));                              // [4, 6] -> [24]: 4 outer
    CHECK_SIG(sig(reshape(t, {8, 24}), {S(2)}), (Signature{{B}, B}));  // 6 is not outermost
    CHECK_SIG(sig(reshape(h, {8, 2, 8}), {S(1)}), (Signature{{S(1)}, S(1)}));
    CHECK_SIG(sig(reshape(h, {8, 2, 8}), {S(1)}, 4),
              (Signature{{B}, B}));  // 2 does not divide by 4
    CHECK_SIG(sig(reshape(h, {8, 2, 8}), {P}), (Signature{{P}, P}));
    CHECK_SIG(sig(transpose(t, {2, 0, 1}), {S(0)}), (Signature{{S(0)}, S(1)}));
    CHECK_SIG(sig(transpose(t, {2, 0, 1}), {S(2)}), (Signature{{S(2)}, S(0)}));
    CHECK_SIG(sig(slice(h, 0, 2, 6), {S(1)}), (Signature{{S(1)}, S(1)}));
    CHECK_SIG(sig(slice(h, 1, 2, 6), {S(1)}), (Signature{{B}, B}));
    CHECK_SIG(sig(concat({h, h}, 0), {S(1), S(1)}), (Signature{{S(1), S(1)}, S(1)}));
    CHECK_SIG(sig(concat({h, h}, 0), {S(0), S(0)}), (Signature{{B, B}, B}));
    CHECK_SIG(sig(concat({h, h}, 0), {P, P}), (Signature{{P, P}, P}));
    auto table = g.variable("table", {10, 16});
    auto ids = g.input("ids", {8, 4}, i32);
    CHECK_SIG(sig(embedding(table, ids), {B, S(0)}), (Signature{{B, S(0)}, S(0)}));
    CHECK_SIG(sig(embedding(table, ids), {S(1), B}), (Signature{{S(1), B}, S(2)}));
    CHECK_SIG(sig(embedding(table, ids), {S(0), B}),
              (Signature{{B, B}, B}));  // vocab-parallel: not a rule
  }
  SUBCASE("ops without a rule get every input whole") {
    auto labels = g.input("labels", {8}, i32);
    CHECK_SIG(sig(softmax_cross_entropy(h, labels), {S(0), S(0)}), (Signature{{B, B}, B}));
    CHECK_SIG(sig(mse(h, h), {P, S(1)}), (Signature{{B, B}, B}));
  }
  SUBCASE("leaves: a variable's annotation (over more than one shard), otherwise B") {
    auto v = g.variable("v", {4, 6}, init::zeros(), S(1));
    CHECK_SIG(sig(v, {}), (Signature{{}, S(1)}));
    CHECK_SIG(sig(v, {}, 1), (Signature{{}, B}));
    CHECK_SIG(sig(x, {}), (Signature{{}, B}));
  }
}

TEST_CASE("Sbp.MovementBetweenEverySignaturePairKeepsValuesAndGradients") {
  CHECK(movement(P, B) == Movement::all_reduce);
  CHECK(movement(P, S(0)) == Movement::reduce_scatter);
  CHECK(movement(S(1), B) == Movement::all_gather);
  CHECK(movement(B, S(1)) == Movement::slice);
  CHECK(movement(S(0), S(1)) == Movement::all_to_all);
  CHECK(movement(S(0), S(0)) == Movement::none);
  CHECK_THROWS_AS(movement(B, P), GraphError);
  CHECK_THROWS_AS(movement(S(0), P), GraphError);

  struct Case {
    Sbp from, to;
    Movement kind;
    const char* made;  // a physical node the movement makes
  };
  const std::vector<Case> cases{
      {P, B, Movement::all_reduce, "t.allreduce"},
      {P, S(0), Movement::reduce_scatter, "t.reduce_scatter0.tp1"},
      {P, S(1), Movement::reduce_scatter, "t.cut1.tp1.for0"},
      {S(0), B, Movement::all_gather, "t.allgather"},
      {S(1), B, Movement::all_gather, "t.allgather"},
      {B, S(0), Movement::slice, "t.slice0.tp1"},
      {B, S(1), Movement::slice, "t.slice1.tp0"},
      {S(0), S(1), Movement::all_to_all, "t.slice1.tp1"},
      {S(1), S(0), Movement::all_to_all, "t.slice0.tp0"},
  };
  for (DType dtype : {f64, f32}) {
  const Tensor feed = filled({8, 8}, 11, dtype);
  for (int tp : {2, 4}) {
    for (const Case& c : cases) {
      CAPTURE(dtype);
      CAPTURE(tp);
      INFO(to_string(c.from) << " -> " << to_string(c.to));
      // t is made with signature `from` (a product of S(1) x S(0) for P; otherwise a scaled
      // weight split that way), then annotated `to`.
      Graph logical(3);
      auto x = logical.input("x", {8, 8}, dtype);
      auto w = logical.variable("w", {8, 8}, init::uniform(-1, 1), c.from.is_partial() ? S(0) : c.from,
                                dtype);
      Value t = (c.from.is_partial() ? matmul(x, w) : w * 1.5).named("t");
      logical.set_sbp(t, c.to);
      Graph physical(3);
      ShardedGraph sharded = shard_graph(logical, physical, tp);
      CHECK(sharded.signature(t.id()).output == c.from);
      CHECK(sharded.sbp(t) == c.to);
      const auto& moves = sharded.movements();
      auto it = std::find_if(moves.begin(), moves.end(),
                             [&](const Boxing& b) { return b.tensor == "t" && b.to == c.to; });
      REQUIRE(it != moves.end());
      CHECK(it->kind == c.kind);
      CHECK(it->from == c.from);
      CHECK(it->to == c.to);
      CHECK(physical.find(c.made).valid());
      const auto& parts = sharded.parts(t);
      CHECK(parts.size() == (c.to.is_broadcast() ? 1u : static_cast<std::size_t>(tp)));

      // Values: each part is its piece of the logical tensor.
      auto logical_params = ParameterStore::initialize(logical);
      auto physical_params = ParameterStore::initialize(physical);
      const Tensor want = evaluate(logical, {{"x", feed}}, {t}, *logical_params)[0];
      const std::vector<Tensor> got = evaluate(physical, {{"x", feed}}, parts, *physical_params);
      for (int k = 0; k < static_cast<int>(got.size()); ++k) {
        CAPTURE(k);
        check_close(c.to.is_split() ? piece_of(want, c.to.axis, k, tp) : want,
                    got[static_cast<std::size_t>(k)]);
      }
      // Gradients through the movement: d sum(t * t) / dw on the physical graph, joined, equals
      // the logical one.
      Value whole = sharded.whole(t);
      std::vector<Value> vars = physical.variables();
      std::vector<Value> grads = gradients(sum(whole * whole), vars);
      std::vector<Value> fetch;
      for (const Value& gv : grads) fetch.push_back(gv);
      auto grad_values = evaluate(physical, {{"x", feed}}, fetch, *physical_params);
      std::map<std::string, Tensor> by_name;
      for (std::size_t i = 0; i < vars.size(); ++i) by_name[vars[i].name()] = grad_values[i];
      auto joined = join_parts(physical, by_name);
      const Tensor want_grad =
          evaluate(logical, {{"x", feed}}, {gradients(sum(t * t), {w})[0]}, *logical_params)[0];
      REQUIRE(joined.count("w"));
      check_close(want_grad, joined.at("w"));
    }
  }
  }
}

TEST_CASE("Sbp.ReduceScatterAndAllReduceMakeTheirOps") {
  // tp 3: the all-reduce is 2 adds (shard 1, shard 2); the reduce-scatter 9 slices (each made on
  // the shard that holds the part) and 6 adds (on the shard whose piece it sums).
  Graph logical(1);
  auto x = logical.input("x", {6, 6});
  auto w = logical.variable("w", {6, 6}, init::uniform(-1, 1), S(0));
  Value t = matmul(x, w).named("t");
  Value sum_b = relu(t).named("r");  // relu needs B: all-reduce
  Value rs = (t + logical.variable("v", {6, 6}, init::uniform(-1, 1), S(1)))
                 .named("u");  // P + S(1): reduce-scatter
  Graph physical(1);
  ShardedGraph sharded = shard_graph(logical, physical, 3);
  CHECK(sharded.sbp(sum_b) == B);
  CHECK(sharded.sbp(rs) == S(1));
  int allreduce_adds = 0, cuts = 0, scatter_adds = 0;
  for (int id = 0; id < physical.size(); ++id) {
    const Node& n = physical.node(id);
    if (n.name.starts_with("t.allreduce")) {
      CHECK(n.op == "add");
      CHECK(n.tp_shard == (n.name == "t.allreduce" ? 2 : 1));
      ++allreduce_adds;
    }
    if (n.name.starts_with("t.cut1.")) {
      CHECK(n.op == "slice");
      CHECK(n.tp_shard == n.name[std::string("t.cut1.tp").size()] - '0');
      ++cuts;
    }
    if (n.op == "add" && n.inputs.size() == 2 &&
        physical.node(n.inputs[1]).name.starts_with("t.cut1.")) {
      CHECK(contains(physical.node(n.inputs[1]).name, fmt::format(".for{}", n.tp_shard)));
      ++scatter_adds;
    }
  }
  CHECK(allreduce_adds == 2);
  CHECK(cuts == 9);
  CHECK(scatter_adds == 6);
  std::string text = sharded.to_text();
  CHECK(contains(text, "all-reduce t: P -> B, for r"));
  CHECK(contains(text, "reduce-scatter t: P -> S(1), for u"));
  CHECK(contains(text, "u = add(t, v) f32[6, 6] : S(1), S(1) -> S(1)"));
}

TEST_CASE("Sbp.MistakesNameTheTensorAxisSizeAndTp") {
  Graph g;
  std::string msg =
      test::thrown_message<GraphError>([&] { models::mlp(g, 4, {.hidden = 10, .tp = 4}); });
  CHECK(contains(msg, "fc0.w"));
  CHECK(contains(msg, "S(1)"));
  CHECK(contains(msg, "axis 1 has size 10"));
  CHECK(contains(msg, "not divisible by tp 4"));

  Graph logical;
  auto x = logical.input("x", {6, 4});
  logical.set_sbp(relu(x).named("r"), S(0));  // an intermediate annotation: 6 rows over 4 shards
  Graph physical;
  msg = test::thrown_message<GraphError>([&] { shard_graph(logical, physical, 4); });
  CHECK(contains(msg, "'r' f32[6, 4] as S(0): axis 0 has size 6, which is not divisible by tp 4"));

  Graph l2;
  l2.variable("p", {4}, init::zeros(), P);
  Graph p2;
  msg = test::thrown_message<GraphError>([&] { shard_graph(l2, p2, 2); });
  CHECK(contains(msg, "variable 'p' is annotated P"));

  Graph l3;
  l3.set_sbp(relu(l3.input("x", {4, 4})).named("r"), P);
  Graph p3;
  msg = test::thrown_message<GraphError>([&] { shard_graph(l3, p3, 2); });
  CHECK(contains(msg, "'r' f32[4, 4] as P"));
  CHECK(contains(msg, "only ops make partial sums"));
  CHECK_THROWS_AS(shard_graph(l3, l3, 2), GraphError);
  CHECK_THROWS_AS(shard_graph(l3, p3, 0), GraphError);
}

namespace {

/// models::mlp as it was sharded by hand before the annotations (Graph::shard scopes, one
/// variable per shard, the partial products summed with +): the reference plan structure.
Value hand_sharded_mlp(Graph& g, std::int64_t batch, const models::MlpShape& s) {
  Value h = g.input("x", {batch, s.inputs});
  g.input("label", {batch}, i32);
  std::int64_t width = s.inputs;
  for (std::int64_t l = 0; l < s.layers; ++l) {
    if (l + 1 < s.layers) {
      const std::int64_t part = s.hidden / s.tp;
      Value total;
      for (std::int64_t k = 0; k < s.tp; ++k) {
        auto on = g.shard(static_cast<std::int32_t>(k));
        auto w1 = g.variable(fmt::format("fc{}.w.tp{}", l, k), {width, part}, init::kaiming());
        auto b1 = g.variable(fmt::format("fc{}.b.tp{}", l, k), {part}, init::zeros());
        auto w2 =
            g.variable(fmt::format("fc{}.w.tp{}", l + 1, k), {part, s.hidden}, init::kaiming());
        Value partial = matmul(relu(matmul(h, w1) + b1), w2);
        total = k == 0 ? partial : total + partial;
      }
      auto b2 = g.variable(fmt::format("fc{}.b", l + 1), {s.hidden}, init::zeros());
      h = relu(total + b2);
      width = s.hidden;
      ++l;
      continue;
    }
    auto w = g.variable(fmt::format("fc{}.w", l), {width, s.hidden}, init::kaiming());
    auto b = g.variable(fmt::format("fc{}.b", l), {s.hidden}, init::zeros());
    h = relu(matmul(h, w) + b);
    width = s.hidden;
  }
  auto w = g.variable("out.w", {width, s.classes}, init::kaiming());
  auto b = g.variable("out.b", {s.classes}, init::zeros());
  return (matmul(h, w) + b).named("logits");
}

/// A plan's shape without names: every actor as (kind, kernel or role, device, output shapes),
/// and how many edges cross devices.
std::multiset<std::string> structure(const Plan& p, int* crossing) {
  std::multiset<std::string> out;
  *crossing = 0;
  for (const ActorDesc& a : p.actors) {
    std::string shapes;
    for (RegisterIndex r : a.outputs) shapes += to_string(p.registers[r].shape);
    // Variable and data actors carry the weight's name in their kernel's: use the role.
    const bool named = a.op.find('.') != std::string::npos;
    out.insert(fmt::format("{} {} cpu:{} {}", static_cast<int>(a.kind),
                           named ? fmt::format("role{}", static_cast<int>(a.role)) : a.op,
                           a.where.device.index, shapes));
    for (const InputPort& in : a.inputs) {
      if (!(p.actors[p.registers[in.reg].producer].where == a.where)) ++*crossing;
    }
  }
  return out;
}

TrainingJob compile_mlp(Graph& g, Value logits, int tp, std::int64_t batch) {
  auto data = std::make_shared<const baton::data::Dataset>(baton::data::synthetic(64, 12, 4, 1));
  TrainConfig cfg;
  cfg.tp = tp;
  cfg.data = {{"synthetic", baton::data::batch_source(data, batch, 1, 7), {"x", "label"}}};
  return compile_training(g, softmax_cross_entropy(logits, g.find("label")), cfg);
}

}  // namespace

TEST_CASE("Sbp.AnnotatedMlpInfersMegatronAndCompilesToTheHandShardedPlan") {
  for (std::int64_t tp : {2, 4}) {
    for (std::int64_t layers : {2, 4}) {
      CAPTURE(tp);
      CAPTURE(layers);
      const models::MlpShape shape{
          .inputs = 12, .hidden = 16, .layers = layers, .classes = 4, .tp = tp};
      Graph g(5);
      std::string text;
      Value logits = models::mlp(g, 8, shape, &text);
      // The inferred signatures: column-parallel, then row-parallel, then one all-reduce.
      CHECK(contains(text, "fc0.w = variable() f32[12, 16] : S(1) (annotated)"));
      CHECK(contains(text, "fc1.w = variable() f32[16, 16] : S(0) (annotated)"));
      CHECK(contains(text, "(x, fc0.w) {trans_a=0, trans_b=0} f32[8, 16] : B, S(1) -> S(1)"));
      CHECK(contains(text, ", fc0.b) f32[8, 16] : S(1), S(0) -> S(1)"));
      CHECK(contains(text, ", fc1.w) {trans_a=0, trans_b=0} f32[8, 16] : S(1), S(0) -> P"));
      CHECK(contains(text, ", fc1.b) f32[8, 16] : B, B -> B"));
      CHECK(contains(text, "logits = add("));
      CHECK(count(text, "all-reduce ") == static_cast<std::size_t>(layers / 2));
      Graph hand(5);
      Value hand_logits = hand_sharded_mlp(hand, 8, shape);
      // The same physical graph: the same nodes (op, shard, shape), the same variable names.
      std::multiset<std::string> ours, theirs;
      for (int id = 0; id < g.size(); ++id) {
        const Node& n = g.node(id);
        ours.insert(fmt::format("{} {} {}{}", n.op, n.tp_shard, to_string(n.shape),
                                n.op == "variable" ? " " + n.name : ""));
      }
      for (int id = 0; id < hand.size(); ++id) {
        const Node& n = hand.node(id);
        theirs.insert(fmt::format("{} {} {}{}", n.op, n.tp_shard, to_string(n.shape),
                                  n.op == "variable" ? " " + n.name : ""));
      }
      CHECK(ours == theirs);
      // And the same plan once compiled, with its backward pass: the same actors on the same
      // devices, and as many edges between devices.
      int crossing = 0, hand_crossing = 0;
      auto a = structure(compile_mlp(g, logits, static_cast<int>(tp), 8).plan, &crossing);
      auto b =
          structure(compile_mlp(hand, hand_logits, static_cast<int>(tp), 8).plan, &hand_crossing);
      CHECK(a == b);
      CHECK(crossing == hand_crossing);
      CHECK(crossing > 0);
    }
  }
}

TEST_CASE("Sbp.AnnotatedMlpStartsFromThePiecesOfTheOneDeviceWeights") {
  Graph one(5), split(5);
  models::mlp(one, 8, {.inputs = 12, .hidden = 16, .layers = 3, .classes = 4});
  models::mlp(split, 8, {.inputs = 12, .hidden = 16, .layers = 3, .classes = 4, .tp = 4});
  auto whole = ParameterStore::initialize(one);
  auto parts = ParameterStore::initialize(split);
  CHECK(parts->contains("fc0.w.tp3"));
  CHECK(parts->at("fc0.w.tp3").shape() == Shape{12, 4});
  CHECK(parts->at("fc1.w.tp2").shape() == Shape{4, 16});
  CHECK(parts->contains("fc2.w"));  // the last, odd layer is shared
  CHECK(split.find("fc0.w.tp1").node().part_of->name == "fc0.w");
  CHECK(contains(split.to_text(),
                 "fc1.w.tp2 = variable() f32[4, 16] (part 2/4 of fc1.w[16, 16] on axis 0)"));
  auto joined = join_parts(split, parts->values());
  REQUIRE(joined.size() == whole->values().size());
  for (const auto& [name, t] : whole->values()) {
    CAPTURE(name);
    REQUIRE(joined.count(name));
    const Tensor& j = joined.at(name);
    REQUIRE(j.shape() == t.shape());
    auto x = t.data<float>();
    auto y = j.data<float>();
    CHECK(std::equal(x.begin(), x.end(), y.begin()));  // bit for bit: the same draws
  }
}

namespace {

constexpr std::int64_t mlp_batch = 32, mlp_steps = 20;
const OptimizerConfig mlp_adam = optim::adam(0.01);

/// models::mlp trained 20 steps from ParameterStore::initialize of its own graph (tp > 1: the
/// pieces of the one-device weights), its weights joined back.
test::TrainedRun train_mlp(std::int64_t tp, int dp, int pp, std::int64_t layers, DType dtype) {
  constexpr std::int64_t batch = mlp_batch;
  auto dataset =
      std::make_shared<const baton::data::Dataset>(baton::data::synthetic(256, 12, 4, 99));
  const std::int64_t m = 2, pieces = dp * m;
  Graph g(5);
  Value logits = models::mlp(
      g, batch / pieces,
      {.inputs = 12, .hidden = 16, .layers = layers, .classes = 4, .tp = tp, .dtype = dtype});
  TrainConfig cfg;
  cfg.steps = mlp_steps;
  cfg.microbatches = m;
  cfg.dp = dp;
  cfg.pp = pp;
  cfg.tp = static_cast<int>(tp);
  cfg.optimizer = mlp_adam;
  cfg.data = {{"synthetic", baton::data::batch_source(dataset, batch, pieces, 7), {"x", "label"}}};
  TrainingJob job = compile_training(g, softmax_cross_entropy(logits, g.find("label")), cfg);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  Runtime rt(job.plan, job.kernels, rs);
  rt.run();
  test::TrainedRun out;
  out.losses = job.losses->per_step();
  for (const auto& [name, t] : join_parts(g, job.params->values())) out.weights[name] = test::widened(t);
  return out;
}

}  // namespace

TEST_CASE("Sbp.AnnotatedMlpTrainsAsOneDevice" * doctest::timeout(180)) {
  // The shards' partial products are summed in another order than one device's matrix
  // product: test::Reordering's tolerance (20 steps of Adam, sums over the batch of 32).
  // In f64, and in f32, the dtype training uses.
  struct Mix {
    std::int64_t tp;
    int dp, pp;
  };
  const Mix mixes[] = {{2, 1, 1}, {4, 1, 1}, {2, 2, 1}, {2, 1, 2}};
  for (auto [layers, dtype] : {std::pair{2, DType::f64}, {3, DType::f64}, {4, DType::f64}, {2, DType::f32},
                               {3, DType::f32}, {4, DType::f32}}) {
    const double tolerance =
        test::tolerance({.dtype = dtype, .steps = mlp_steps, .longest_sum = mlp_batch, .lr = mlp_adam.lr});
    const test::TrainedRun one = train_mlp(1, 1, 1, layers, dtype);
    REQUIRE(one.losses.size() == 20);
    CHECK(one.losses.back() < one.losses.front());
    for (Mix mix : mixes) {
      CAPTURE(layers);
      CAPTURE(dtype);
      CAPTURE(mix.tp);
      CAPTURE(mix.dp);
      CAPTURE(mix.pp);
      test::check_same_training(one, train_mlp(mix.tp, mix.dp, mix.pp, layers, dtype), tolerance);
    }
  }
}

TEST_CASE("Sbp.AttentionBlockSplitByHeadsNeedsOneAllReduce") {
  // Megatron's attention from three annotations: wq, wk, wv by columns, wo by rows. The heads
  // axis carries the split through reshape, transpose, the batched products, the mask and the
  // softmax; the output projection is P, all-reduced once before the residual add. Values and
  // gradients must equal the logical graph's.
  const std::int64_t b = 2, t = 4, d = 8, nh = 4, dh = d / nh;
  for (auto [tp, dtype] : {std::pair{2, f64}, {4, f64}, {2, f32}, {4, f32}}) {
    CAPTURE(tp);
    CAPTURE(dtype);
    Graph logical(9);
    auto x = logical.input("x", {b, t, d}, dtype);
    auto ln = layer_norm(x);
    auto w = [&](const char* name, Sbp s) {
      return logical.variable(name, {d, d}, init::normal(0.0, 0.3), s, dtype);
    };
    auto wq = w("wq", S(1)), wk = w("wk", S(1)), wv = w("wv", S(1)), wo = w("wo", S(0));
    auto heads = [&](Value v) {
      return transpose(reshape(matmul(ln, v), {b, t, nh, dh}), {0, 2, 1, 3});
    };
    auto q = heads(wq), k = heads(wk), v = heads(wv);
    auto att = softmax(
        causal_mask(matmul(q, k, false, true) * (1.0 / std::sqrt(static_cast<double>(dh)))));
    auto o = reshape(transpose(matmul(att, v), {0, 2, 1, 3}), {b, t, d});
    Value y = (x + matmul(o, wo)).named("y");
    Graph physical(9);
    ShardedGraph sharded = shard_graph(logical, physical, tp);
    CHECK(sharded.sbp(q) == S(1));
    CHECK(sharded.sbp(att) == S(1));
    CHECK(sharded.sbp(o) == S(2));
    REQUIRE(sharded.movements().size() == 1);
    CHECK(sharded.movements()[0].kind == Movement::all_reduce);
    CHECK(sharded.movements()[0].consumers == std::vector<std::string>{"y"});

    const Tensor feed = filled({b, t, d}, 5, dtype);
    auto lp = ParameterStore::initialize(logical);
    auto pp = ParameterStore::initialize(physical);
    Value whole = sharded.whole(y);
    std::vector<Value> vars = physical.variables();
    std::vector<Value> fetch = gradients(sum(whole * whole), vars);
    fetch.push_back(whole);
    auto got = evaluate(physical, {{"x", feed}}, fetch, *pp);
    std::vector<Value> want_fetch = gradients(sum(y * y), {wq, wk, wv, wo});
    want_fetch.push_back(y);
    auto want = evaluate(logical, {{"x", feed}}, want_fetch, *lp);
    check_close(want.back(), got.back());
    std::map<std::string, Tensor> grads;
    for (std::size_t i = 0; i < vars.size(); ++i) grads[vars[i].name()] = got[i];
    auto joined = join_parts(physical, grads);
    const char* names[] = {"wq", "wk", "wv", "wo"};
    for (std::size_t i = 0; i < 4; ++i) {
      CAPTURE(names[i]);
      REQUIRE(joined.count(names[i]));
      check_close(want[i], joined.at(names[i]));
    }
  }
}
