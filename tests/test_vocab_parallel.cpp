// Megatron's vocabulary-parallel embedding and cross-entropy (graph/vocab_parallel.h) and the
// kernels under them. The kernels against float64 loops written here and their gradients against
// central differences in f64; the graph functions against the unsplit ops they replace
// (embedding, softmax_cross_entropy): same values, same gradients, for shards of equal and of
// unequal sizes. Training with them (the GPT's --tp) is in test_parallel.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "baton/graph.h"
#include "baton/kernels.h"
#include "test_util.h"

using namespace baton;
using baton::test::contains;
using baton::test::thrown_message;

namespace {

const KernelRegistry& registry() {
  static const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  return reg;
}

// Runs `op` on `inputs` into a fresh NaN-poisoned output of `out_shape`.
template <class T>
Tensor apply(const std::string& op, const std::vector<Tensor>& inputs, const Shape& out_shape,
             const Attrs& attrs = {}) {
  Tensor out = Tensor::empty(out_shape, dtype_of<T>());
  for (auto& x : out.data<T>()) x = std::numeric_limits<T>::quiet_NaN();
  std::vector<const Tensor*> in;
  for (const Tensor& t : inputs) in.push_back(&t);
  auto kernel = registry().create(op, KernelConfig{"k", Device{}, dtype_of<T>(), attrs});
  std::vector<Tensor*> outs{&out};
  KernelContext ctx{in, outs, 0};
  kernel->compute(ctx);
  return out;
}

template <class T>
Tensor random_tensor(const Shape& shape, std::mt19937& rng, double stddev = 1.0) {
  Tensor t = Tensor::empty(shape, dtype_of<T>());
  std::normal_distribution<double> dist(0.0, stddev);
  for (auto& x : t.data<T>()) x = static_cast<T>(dist(rng));
  return t;
}

Tensor ids_of(const Shape& shape, const std::vector<std::int32_t>& values) {
  Tensor t = Tensor::empty(shape, DType::i32);
  REQUIRE(values.size() == t.data<std::int32_t>().size());
  std::copy(values.begin(), values.end(), t.data<std::int32_t>().begin());
  return t;
}

Tensor random_ids(const Shape& shape, std::int32_t upper, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, DType::i32);
  std::uniform_int_distribution<std::int32_t> dist(0, upper - 1);
  for (auto& x : t.data<std::int32_t>()) x = dist(rng);
  return t;
}

std::vector<double> values(const Tensor& t) {
  if (t.dtype() == DType::f32) return {t.data<float>().begin(), t.data<float>().end()};
  return {t.data<double>().begin(), t.data<double>().end()};
}

// Columns [from, to) of a [rows, cols] tensor.
template <class T>
Tensor columns(const Tensor& x, std::int64_t from, std::int64_t to) {
  const std::int64_t rows = x.dim(0), cols = x.dim(1);
  Tensor out = Tensor::empty({rows, to - from}, x.dtype());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = from; c < to; ++c) {
      out.data<T>()[static_cast<std::size_t>(r * (to - from) + c - from)] =
          x.data<T>()[static_cast<std::size_t>(r * cols + c)];
    }
  }
  return out;
}

// Rows [from, to) of a [rows, cols] tensor.
template <class T>
Tensor rows_of(const Tensor& x, std::int64_t from, std::int64_t to) {
  const std::int64_t cols = x.dim(1);
  Tensor out = Tensor::empty({to - from, cols}, x.dtype());
  std::copy(x.data<T>().begin() + from * cols, x.data<T>().begin() + to * cols,
            out.data<T>().begin());
  return out;
}

// |got - want| <= rel * |want| + abs everywhere; names the first element that is not.
void check_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                 double abs) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= rel * std::abs(want[i]) + abs)) {
      CAPTURE(i);
      CAPTURE(got[i]);
      CAPTURE(want[i]);
      FAIL_CHECK("element differs from the reference");
      return;
    }
  }
}

// The kernels against float64 loops: each value is a max, a copy, or a sum of at most 10
// exp() terms, all positive (condition 1): f32 carries n u = 10 x 6e-8 = 6e-7 relative from
// the sum plus a few ulp from exp and log, so 1e-5 relative; the loss, a log-sum-exp minus a
// logit of magnitude <= ~10, cancels to an absolute error of about 10 u, hence the 1e-6 floor.
// f64: the same with u = 1.1e-16, 1e-12.
template <class T>
void check_forward(const Tensor& got, const std::vector<double>& want) {
  if constexpr (std::is_same_v<T, float>) {
    check_close(values(got), want, 1e-5, 1e-6);
  } else {
    check_close(values(got), want, 1e-12, 1e-12);
  }
}

// d/dx of sum(dy * f()) by central differences (h = 1e-6), x perturbed in place and restored.
// Compared at 1e-6 relative and 1e-8 absolute: the quotient errs by its truncation, h^2 |f'3|
// / 6 ~ 1e-12, and by rounding, u |f| / h ~ 1e-16 x 10 / 1e-6 = 1e-9.
std::vector<double> vjp_by_differences(Tensor& x, const Tensor& dy,
                                       const std::function<Tensor()>& f) {
  constexpr double h = 1e-6;
  auto dot = [&](const Tensor& y) {
    auto a = values(y), b = values(dy);
    double s = 0;
    for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  auto d = x.data<double>();
  std::vector<double> grad(d.size());
  for (std::size_t i = 0; i < d.size(); ++i) {
    const double keep = d[i];
    d[i] = keep + h;
    const double up = dot(f());
    d[i] = keep - h;
    const double down = dot(f());
    d[i] = keep;
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}

Attrs shard_attrs(std::int64_t start, std::int64_t vocab) {
  return Attrs{{"vocab_start", start}, {"vocab", vocab}};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Kernels

TEST_CASE("Ops.VocabParallel.EveryOpIsRegisteredForCpuF32AndF64") {
  for (const char* op :
       {"max", "maximum", "stop_gradient", "vocab_parallel_ce_stats",
        "vocab_parallel_ce_stats_grad", "vocab_parallel_ce_loss", "vocab_parallel_ce_loss_grad"}) {
    CAPTURE(op);
    CHECK(registry().contains(op, DeviceType::cpu, DType::f32));
    CHECK(registry().contains(op, DeviceType::cpu, DType::f64));
  }
}

TEST_CASE_TEMPLATE("Ops.Max.MatchesReference", T, float, double) {
  std::mt19937 rng(71);
  Tensor x = random_tensor<T>({3, 4, 5}, rng, 3.0);
  auto v = values(x);
  auto at = [&](std::size_t i, std::size_t j, std::size_t k) { return v[(i * 4 + j) * 5 + k]; };
  const double lowest = -std::numeric_limits<double>::infinity();
  {  // last axis
    std::vector<double> want;
    for (std::size_t i = 0; i < 3; ++i) {
      for (std::size_t j = 0; j < 4; ++j) {
        double m = lowest;
        for (std::size_t k = 0; k < 5; ++k) m = std::max(m, at(i, j, k));
        want.push_back(m);
      }
    }
    check_forward<T>(apply<T>("max", {x}, {3, 4}, Attrs{{"axes", std::vector<std::int64_t>{2}}}),
                     want);
    check_forward<T>(
        apply<T>("max", {x}, {3, 4, 1},
                 Attrs{{"axes", std::vector<std::int64_t>{-1}}, {"keepdims", std::int64_t{1}}}),
        want);
  }
  {  // a middle axis and the first
    std::vector<double> want;
    for (std::size_t j = 0; j < 4; ++j) {
      double m = lowest;
      for (std::size_t i = 0; i < 3; ++i) {
        for (std::size_t k = 0; k < 5; ++k) m = std::max(m, at(i, j, k));
      }
      want.push_back(m);
    }
    check_forward<T>(apply<T>("max", {x}, {4}, Attrs{{"axes", std::vector<std::int64_t>{0, 2}}}),
                     want);
  }
  double all = lowest;
  for (double e : v) all = std::max(all, e);
  check_forward<T>(apply<T>("max", {x}, {}), {all});
  // A NaN wins wherever it is; the maximum of nothing is -infinity.
  x.data<T>()[7] = std::numeric_limits<T>::quiet_NaN();
  auto rows = values(apply<T>("max", {x}, {3, 4}, Attrs{{"axes", std::vector<std::int64_t>{2}}}));
  CHECK(std::isnan(rows[1]));
  CHECK(std::count_if(rows.begin(), rows.end(), [](double r) { return std::isnan(r); }) == 1);
  Tensor empty = Tensor::empty({2, 0}, dtype_of<T>());
  CHECK(values(apply<T>("max", {empty}, {2}, Attrs{{"axes", std::vector<std::int64_t>{1}}})) ==
        std::vector<double>{lowest, lowest});
}

TEST_CASE_TEMPLATE("Ops.Maximum.BroadcastsAndKeepsNaN", T, float, double) {
  Tensor a = Tensor::empty({2, 3}, dtype_of<T>());
  Tensor b = Tensor::empty({3}, dtype_of<T>());
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::vector<T> av{1, -2, 3, nan, 5, -6}, bv{0, 0, nan};
  std::copy(av.begin(), av.end(), a.data<T>().begin());
  std::copy(bv.begin(), bv.end(), b.data<T>().begin());
  auto c = values(apply<T>("maximum", {a, b}, {2, 3}));
  CHECK(c[0] == 1);
  CHECK(c[1] == 0);
  CHECK(std::isnan(c[2]));
  CHECK(std::isnan(c[3]));
  CHECK(c[4] == 5);
  CHECK(std::isnan(c[5]));
  auto c2 = values(apply<T>("maximum", {b, a}, {2, 3}));
  CHECK(std::isnan(c2[3]));
  CHECK(c2[1] == 0);
  CHECK(values(apply<T>("stop_gradient", {a}, {2, 3}))[4] == 5);
}

TEST_CASE_TEMPLATE("Ops.EmbeddingShard.LooksUpItsRowsAndZeroesTheRest", T, float, double) {
  std::mt19937 rng(72);
  const std::int64_t vocab = 11, d = 4;
  Tensor whole = random_tensor<T>({vocab, d}, rng);
  Tensor ids = random_ids({3, 5}, static_cast<std::int32_t>(vocab), rng);
  auto w = values(whole);
  std::vector<double> sum(static_cast<std::size_t>(15 * d), 0.0);
  for (auto [start, end] : {std::pair<std::int64_t, std::int64_t>{0, 4}, {4, 8}, {8, 11}}) {
    CAPTURE(start);
    Tensor table = rows_of<T>(whole, start, end);
    auto got = values(apply<T>("embedding", {table, ids}, {3, 5, d}, shard_attrs(start, vocab)));
    std::vector<double> want;
    for (std::int32_t id : ids.data<std::int32_t>()) {
      for (std::int64_t j = 0; j < d; ++j)
        want.push_back(id >= start && id < end ? w[static_cast<std::size_t>(id * d + j)] : 0.0);
    }
    check_close(got, want, 0, 0);  // a copy, bit for bit
    for (std::size_t i = 0; i < got.size(); ++i) sum[i] += got[i];
  }
  // The shards' outputs add up to the lookup in the whole table.
  check_close(sum, values(apply<T>("embedding", {whole, ids}, {3, 5, d})), 0, 0);
}

TEST_CASE("Ops.EmbeddingShard.GradientTouchesOnlyItsRows") {
  std::mt19937 rng(73);
  const std::int64_t vocab = 9;
  Tensor ids = ids_of({2, 4}, {0, 5, 3, 5, 8, 4, 1, 6});  // 5 twice: the gradient adds
  Tensor dy = random_tensor<double>({2, 4, 3}, rng);
  for (auto [start, rows] : {std::pair<std::int64_t, std::int64_t>{3, 3}, {0, 3}, {6, 3}, {0, 9}}) {
    CAPTURE(start);
    Tensor table = random_tensor<double>({rows, 3}, rng);
    Tensor dtable =
        apply<double>("embedding_grad", {ids, dy}, {rows, 3}, shard_attrs(start, vocab));
    auto fd = vjp_by_differences(table, dy, [&] {
      return apply<double>("embedding", {table, ids}, {2, 4, 3}, shard_attrs(start, vocab));
    });
    check_close(values(dtable), fd, 1e-6, 1e-8);
  }
  // Shard [3, 6): row 2 (id 5) gets dy of positions 1 and 3; no other shard's id leaks in.
  // The kernel adds the same two doubles (to a zero row): Approx's default, 1.2e-5 relative,
  // only allows for the order, and is far below a leaked or missing dy (O(1)).
  Tensor dtable = apply<double>("embedding_grad", {ids, dy}, {3, 3}, shard_attrs(3, vocab));
  for (std::size_t j = 0; j < 3; ++j) {
    CHECK(dtable.data<double>()[6 + j] ==
          doctest::Approx(dy.data<double>()[3 + j] + dy.data<double>()[9 + j]));
  }
}

TEST_CASE("Ops.EmbeddingShard.BadIdsAndAttributesThrowNamingThem") {
  Tensor table = Tensor::empty({4, 2}, DType::f32);
  std::string msg = thrown_message<std::invalid_argument>([&] {
    (void)apply<float>("embedding", {table, ids_of({2}, {1, 12})}, {2, 2}, shard_attrs(4, 12));
  });
  CHECK(contains(msg, "embedding"));
  CHECK(contains(msg, "id 12"));
  CHECK(contains(msg, "[0, 12)"));
  msg = thrown_message<std::invalid_argument>([&] {
    (void)apply<float>("embedding", {table, ids_of({1}, {1})}, {1, 2}, shard_attrs(10, 12));
  });
  CHECK(contains(msg, "[10, 14)"));
  CHECK(contains(msg, "vocabulary of only 12"));
  msg = thrown_message<std::invalid_argument>([&] {
    (void)apply<float>("embedding_grad", {ids_of({1}, {1}), table}, {4, 2},
                       Attrs{{"vocab_start", std::int64_t{4}}});
  });
  CHECK(contains(msg, "embedding_grad (actor 'k')"));
  CHECK(contains(msg, "both attributes vocab"));
}

TEST_CASE_TEMPLATE("Ops.VocabParallelCe.ShardStatsSumToTheCrossEntropy", T, float, double) {
  std::mt19937 rng(74);
  const std::int64_t n = 6, vocab = 10;
  Tensor logits = random_tensor<T>({n, vocab}, rng, 3.0);
  Tensor labels = random_ids({n}, static_cast<std::int32_t>(vocab), rng);
  const std::vector<std::pair<std::int64_t, std::int64_t>> shards{{0, 3}, {3, 8}, {8, 10}};
  // Row maxima: each shard's, then the larger of them.
  Tensor row_max;
  for (auto [from, to] : shards) {
    Tensor m = apply<T>("max", {columns<T>(logits, from, to)}, {n},
                        Attrs{{"axes", std::vector<std::int64_t>{1}}});
    row_max = row_max.defined() ? apply<T>("maximum", {row_max, m}, {n}) : m;
  }
  auto x = values(logits);
  auto m = values(row_max);
  std::vector<double> total(static_cast<std::size_t>(2 * n), 0.0);
  for (auto [from, to] : shards) {
    CAPTURE(from);
    auto got =
        values(apply<T>("vocab_parallel_ce_stats", {columns<T>(logits, from, to), labels, row_max},
                        {n, 2}, shard_attrs(from, vocab)));
    std::vector<double> want;
    for (std::int64_t r = 0; r < n; ++r) {
      double s = 0;
      for (std::int64_t c = from; c < to; ++c)
        s += std::exp(x[static_cast<std::size_t>(r * vocab + c)] - m[static_cast<std::size_t>(r)]);
      const std::int32_t label = labels.data<std::int32_t>()[static_cast<std::size_t>(r)];
      want.push_back(s);
      want.push_back(label >= from && label < to ? x[static_cast<std::size_t>(r * vocab + label)]
                                                 : 0.0);
    }
    check_forward<T>(
        apply<T>("vocab_parallel_ce_stats", {columns<T>(logits, from, to), labels, row_max}, {n, 2},
                 shard_attrs(from, vocab)),
        want);
    for (std::size_t i = 0; i < got.size(); ++i) total[i] += got[i];
  }
  Tensor stats = Tensor::empty({n, 2}, dtype_of<T>());
  for (std::size_t i = 0; i < total.size(); ++i) stats.data<T>()[i] = static_cast<T>(total[i]);
  const double want = values(apply<T>("softmax_cross_entropy", {logits, labels}, {}))[0];
  check_forward<T>(apply<T>("vocab_parallel_ce_loss", {stats, row_max}, {}), {want});
}

TEST_CASE("Ops.VocabParallelCe.GradientsMatchFiniteDifferences") {
  std::mt19937 rng(75);
  const std::int64_t n = 5, vocab = 9;
  Tensor labels = ids_of({n}, {0, 4, 8, 5, 4});
  for (auto [from, to] : {std::pair<std::int64_t, std::int64_t>{3, 6}, {0, 9}, {6, 9}}) {
    CAPTURE(from);
    Tensor logits = random_tensor<double>({n, to - from}, rng, 2.0);
    // The rows' maxima, as the loss gives it (any shift would do: the gradient holds it fixed).
    Tensor row_max =
        apply<double>("max", {logits}, {n}, Attrs{{"axes", std::vector<std::int64_t>{1}}});
    Tensor dstats = random_tensor<double>({n, 2}, rng);
    const Attrs attrs = shard_attrs(from, vocab);
    Tensor dlogits = apply<double>("vocab_parallel_ce_stats_grad",
                                   {logits, labels, row_max, dstats}, {n, to - from}, attrs);
    auto fd = vjp_by_differences(logits, dstats, [&] {
      return apply<double>("vocab_parallel_ce_stats", {logits, labels, row_max}, {n, 2}, attrs);
    });
    check_close(values(dlogits), fd, 1e-6, 1e-8);
  }
  Tensor stats = random_tensor<double>({n, 2}, rng);
  for (std::int64_t r = 0; r < n; ++r)
    stats.data<double>()[static_cast<std::size_t>(2 * r)] = 0.5 + r;  // sums of exp: > 0
  Tensor row_max = random_tensor<double>({n}, rng);
  Tensor dloss = Tensor::empty({}, DType::f64);
  dloss.data<double>()[0] = -0.8;
  Tensor dstats = apply<double>("vocab_parallel_ce_loss_grad", {stats, dloss}, {n, 2});
  auto fd = vjp_by_differences(stats, dloss, [&] {
    return apply<double>("vocab_parallel_ce_loss", {stats, row_max}, {});
  });
  check_close(values(dstats), fd, 1e-6, 1e-8);
}

TEST_CASE("Ops.VocabParallelCe.LabelOutsideVocabularyThrowsNamingRowAndLabel") {
  Tensor logits = Tensor::empty({3, 4}, DType::f32);
  std::fill(logits.data<float>().begin(), logits.data<float>().end(), 0.0f);
  Tensor row_max = Tensor::empty({3}, DType::f32);
  std::fill(row_max.data<float>().begin(), row_max.data<float>().end(), 0.0f);
  Tensor labels = ids_of({3}, {0, 11, 2});
  std::string msg = thrown_message<std::invalid_argument>([&] {
    (void)apply<float>("vocab_parallel_ce_stats", {logits, labels, row_max}, {3, 2},
                       shard_attrs(4, 8));
  });
  CHECK(contains(msg, "vocab_parallel_ce_stats"));
  CHECK(contains(msg, "label 11 at row 1"));
  CHECK(contains(msg, "[0, 8)"));
  msg = thrown_message<std::invalid_argument>([&] {
    (void)apply<float>("vocab_parallel_ce_stats", {logits, ids_of({3}, {0, 1, 2}), row_max}, {3, 2},
                       shard_attrs(6, 8));
  });
  CHECK(contains(msg, "[6, 10) of a vocabulary of only 8"));
}

// ---------------------------------------------------------------------------------------------
// The graph functions against the unsplit ops

namespace {

Tensor random_f64(const Shape& s, std::uint32_t seed) {
  std::mt19937 rng(seed);
  return random_tensor<double>(s, rng, 1.5);
}

}  // namespace

TEST_CASE("VocabParallel.CrossEntropyEqualsSoftmaxCrossEntropyWithItsGradient") {
  const std::int64_t n = 7, vocab = 12;
  Tensor whole = random_f64({n, vocab}, 1);
  Tensor labels = ids_of({n}, {0, 11, 3, 4, 7, 8, 3});
  // One device: softmax_cross_entropy and its gradient.
  Graph one;
  auto lw = one.variable("logits", {n, vocab}, init::zeros(), f64);
  auto loss_one = softmax_cross_entropy(lw, one.input("labels", {n}, i32));
  ParameterStore p_one;
  p_one.set("logits", whole);
  auto ref = evaluate(one, {{"labels", labels}}, {loss_one, gradients(loss_one, {lw})[0]}, p_one);
  const double ref_loss = ref[0].data<double>()[0];
  for (const std::vector<std::int64_t>& widths :
       {std::vector<std::int64_t>{12}, {6, 6}, {3, 3, 3, 3}, {5, 1, 6}}) {
    CAPTURE(widths.size());
    Graph g;
    std::vector<Value> parts;
    ParameterStore params;
    std::int64_t from = 0;
    for (std::size_t k = 0; k < widths.size(); ++k) {
      auto on = g.shard(static_cast<std::int32_t>(k));
      parts.push_back(g.variable("logits" + std::to_string(k), {n, widths[k]}, init::zeros(), f64));
      params.set(parts.back().name(), columns<double>(whole, from, from + widths[k]));
      from += widths[k];
    }
    Value loss = vocab_parallel_cross_entropy(parts, g.input("labels", {n}, i32));
    std::vector<Value> fetch{loss};
    for (const Value& d : gradients(loss, parts)) fetch.push_back(d);
    auto got = evaluate(g, {{"labels", labels}}, fetch, params);
    // f64 throughout: the shards' sums of exp() (12 positive terms) and the loss's log, in
    // another order than one softmax_cross_entropy: a few roundings of values below 10, 1e-13;
    // the gradients (softmax - onehot) / N are below 1, so 1e-12 relative, 1e-15 absolute.
    CHECK(got[0].data<double>()[0] == doctest::Approx(ref_loss).epsilon(1e-13));
    // Each shard's gradient is its columns of the whole one: softmax - onehot, over N.
    from = 0;
    for (std::size_t k = 0; k < widths.size(); ++k) {
      check_close(values(got[k + 1]), values(columns<double>(ref[1], from, from + widths[k])),
                  1e-12, 1e-15);
      from += widths[k];
    }
    // Each shard's part of the loss ran on that shard; the row maximum carries no gradient.
    if (widths.size() > 1) {
      for (int id = 0; id < g.size(); ++id) {
        const Node& node = g.node(id);
        if (node.op == "vocab_parallel_ce_stats")
          CHECK(node.tp_shard == g.node(node.inputs[0]).tp_shard);
      }
    }
  }
}

TEST_CASE("VocabParallel.EmbeddingEqualsEmbeddingWithItsGradient") {
  const std::int64_t vocab = 10, d = 3;
  Tensor whole = random_f64({vocab, d}, 2);
  Tensor ids = ids_of({2, 5}, {9, 0, 4, 4, 5, 1, 7, 2, 9, 3});
  Tensor r = random_f64({2, 5, d}, 3);  // loss = sum(embedding * r)
  Graph one;
  auto tw = one.variable("table", {vocab, d}, init::zeros(), f64);
  auto loss_one =
      sum(embedding(tw, one.input("ids", {2, 5}, i32)) * one.input("r", {2, 5, d}, f64));
  ParameterStore p_one;
  p_one.set("table", whole);
  auto ref =
      evaluate(one, {{"ids", ids}, {"r", r}}, {loss_one, gradients(loss_one, {tw})[0]}, p_one);
  for (const std::vector<std::int64_t>& heights : {std::vector<std::int64_t>{5, 5}, {2, 3, 4, 1}}) {
    CAPTURE(heights.size());
    Graph g;
    std::vector<Value> tables;
    ParameterStore params;
    std::int64_t from = 0;
    for (std::size_t k = 0; k < heights.size(); ++k) {
      auto on = g.shard(static_cast<std::int32_t>(k));
      tables.push_back(
          g.variable("table" + std::to_string(k), {heights[k], d}, init::zeros(), f64));
      params.set(tables.back().name(), rows_of<double>(whole, from, from + heights[k]));
      from += heights[k];
    }
    Value x = vocab_parallel_embedding(tables, g.input("ids", {2, 5}, i32));
    Value loss = sum(x * g.input("r", {2, 5, d}, f64));
    std::vector<Value> fetch{loss};
    for (const Value& dt : gradients(loss, tables)) fetch.push_back(dt);
    auto got = evaluate(g, {{"ids", ids}, {"r", r}}, fetch, params);
    // f64: the lookups are copies and their gradients sums of at most 2 dy; only the loss, a
    // sum of 30 products, is reordered: 30 u sum|terms| ~ 1e-14 relative, hence 1e-13 (and
    // 1e-13 relative, 1e-15 absolute for the gradients).
    CHECK(got[0].data<double>()[0] == doctest::Approx(ref[0].data<double>()[0]).epsilon(1e-13));
    from = 0;
    for (std::size_t k = 0; k < heights.size(); ++k) {
      check_close(values(got[k + 1]), values(rows_of<double>(ref[1], from, from + heights[k])),
                  1e-13, 1e-15);
      from += heights[k];
    }
  }
}

TEST_CASE("VocabParallel.StopGradientCutsTheGradient") {
  Graph g;
  auto x = g.variable("x", {3}, init::zeros(), f64);
  auto loss = sum(x * stop_gradient(x));  // d/dx = x (one factor held fixed), not 2x
  ParameterStore p;
  Tensor v = random_f64({3}, 4);
  p.set("x", v);
  auto got = evaluate(g, {}, {gradients(loss, {x})[0]}, p);
  // d/dx sum(x * stop_gradient(x)) is x times 1: exact up to one rounding (1e-15 relative).
  check_close(values(got[0]), values(v), 1e-15, 0);
  // A max with no stop_gradient after it is named when autodiff needs its gradient.
  Graph h;
  auto y = h.variable("y", {2, 3}, init::zeros(), f64);
  auto msg = thrown_message<GraphError>([&] { gradients(sum(max(y, {1})), {y}); });
  CHECK(contains(msg, "op 'max'"));
}

TEST_CASE("VocabParallel.MistakesNameTheOpAndShapes") {
  Graph g;
  auto a = g.variable("a", {4, 3});
  auto b = g.variable("b", {4, 5});
  auto ids = g.input("ids", {6}, i32);
  auto msg = thrown_message<GraphError>([&] { vocab_parallel_embedding({a, b}, ids); });
  CHECK(contains(msg, "vocab_parallel_embedding(a f32[4, 3], b f32[4, 5], ids i32[6])"));
  CHECK(contains(msg, "one D"));
  msg = thrown_message<GraphError>([&] { embedding_shard(a, ids, 8, 10); });
  CHECK(contains(msg, "rows [8, 12) are not inside a vocabulary of 10"));
  auto logits = g.variable("logits", {6, 5});
  msg = thrown_message<GraphError>([&] {
    vocab_parallel_cross_entropy({logits, b}, g.input("labels", {6}, i32));
  });
  CHECK(contains(msg, "one N"));
  msg = thrown_message<GraphError>(
      [&] { vocab_parallel_cross_entropy({logits}, g.input("fl", {6})); });
  CHECK(contains(msg, "'fl' must be i32"));
}
