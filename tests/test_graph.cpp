// The DSL, autodiff and the compiler: build-time errors name the op; every op's gradient
// matches float64 finite differences through the whole compile-and-run path; M micro-batches
// give the weights of one big batch; the same seed gives the same loss curve bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>

#include "equivalence.h"
#include "test_util.h"
#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"

#include <fmt/format.h>

using namespace baton;

namespace {

using baton::test::contains;

template <class F>
std::string graph_error(F&& f) {
  try {
    f();
  } catch (const GraphError& e) {
    return e.what();
  }
  return {};
}

Tensor random_f64(const Shape& s, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  Tensor t = Tensor::empty(s, f64);
  for (auto& x : t.data<double>()) x = u(rng);
  return t;
}

double scalar(const Tensor& t) { return t.dtype() == f64 ? t.data<double>()[0] : t.data<float>()[0]; }

// Checks d(loss)/d(w) for every variable against central differences in float64. `build`
// makes the loss from the graph's variables; `feeds` feeds its inputs.
void check_gradients(const std::string& what, Graph& g, Value loss, const std::map<std::string, Tensor>& feeds = {}) {
  INFO(what);
  auto params = ParameterStore::initialize(g);
  for (auto& [name, t] : params->values()) {
    Tensor r = random_f64(t.shape(), static_cast<std::uint32_t>(std::hash<std::string>{}(name)), -0.9, 0.9);
    params->set(name, r);
  }
  std::vector<Value> vars = g.variables();
  std::vector<Value> grads = gradients(loss, vars);
  std::vector<Tensor> analytic = evaluate(g, feeds, grads, *params);
  const double h = 1e-6;
  for (std::size_t v = 0; v < vars.size(); ++v) {
    Tensor& w = params->at(vars[v].name());
    auto wd = w.data<double>();
    auto ad = analytic[v].data<double>();
    REQUIRE(ad.size() == wd.size());
    for (std::size_t i = 0; i < wd.size(); ++i) {
      const double keep = wd[i];
      wd[i] = keep + h;
      double up = scalar(evaluate(g, feeds, {loss}, *params)[0]);
      wd[i] = keep - h;
      double down = scalar(evaluate(g, feeds, {loss}, *params)[0]);
      wd[i] = keep;
      double numeric = (up - down) / (2 * h);
      INFO(vars[v].name() << "[" << i << "]: analytic " << ad[i] << ", numeric " << numeric);
      // Central differences with h = 1e-6 in f64 err by h^2 |L'3| / 6 ~ 1e-12 and by the loss's
      // rounding over 2h, ~1e-16 x 10 / 1e-6 = 1e-9 (a loss of tens of ops rounds each once):
      // 1e-6 absolute plus 1e-5 relative is far above that, and far below a wrong term.
      CHECK(std::abs(ad[i] - numeric) <= 1e-6 + 1e-5 * std::abs(numeric));
    }
  }
}

// loss = sum(y * r) with a fixed random r: every element of y gets its own upstream gradient.
Value weighted_sum(Graph& g, Value y, std::map<std::string, Tensor>& feeds) {
  std::string name = "r" + std::to_string(feeds.size());
  feeds[name] = random_f64(y.shape(), static_cast<std::uint32_t>(feeds.size() + 7));
  return sum(y * g.input(name, y.shape(), f64));
}

}  // namespace

TEST_CASE("Graph.ShapeMistakesNameTheOpAndShapes") {
  Graph g;
  auto x = g.input("x", {32, 64});
  auto w = g.variable("w", {32, 256});
  std::string msg = graph_error([&] { matmul(x, w); });
  CHECK(contains(msg, "matmul(x f32[32, 64], w f32[32, 256])"));
  CHECK(contains(msg, "inner dimensions 64 and 32 differ"));

  auto b = g.variable("b", {3});
  msg = graph_error([&] { (void)(x + b); });
  CHECK(contains(msg, "add("));
  CHECK(contains(msg, "do not broadcast"));

  auto logits = g.input("logits", {32, 10});
  auto float_labels = g.input("labels_f", {32});
  msg = graph_error([&] { softmax_cross_entropy(logits, float_labels); });
  CHECK(contains(msg, "labels must be i32"));

  auto labels = g.input("labels", {31}, i32);
  msg = graph_error([&] { softmax_cross_entropy(logits, labels); });
  CHECK(contains(msg, "one per row"));

  msg = graph_error([&] { reshape(x, {5, -1}); });
  CHECK(contains(msg, "reshape"));
  msg = graph_error([&] { g.input("x", {1}); });
  CHECK(contains(msg, "name is taken"));
}

TEST_CASE("Graph.LossMustBeAScalar") {
  Graph g;
  auto x = g.input("x", {4, 3});
  auto w = g.variable("w", {3, 2});
  auto y = matmul(x, w);
  CHECK(contains(graph_error([&] { gradients(y, {w}); }), "must be a scalar"));
  TrainConfig cfg;
  CHECK(contains(graph_error([&] { compile_training(g, y, cfg); }), "must be a scalar"));
}

TEST_CASE("Graph.AnOpWithoutAGradientIsNamed") {
  Graph g;
  auto x = g.input("x", {4});
  auto w = g.variable("w", {4});
  // relu_grad is a backward op: it has no gradient of its own.
  auto y = g.add("relu_grad", {x, w}, {}, {4}, f32);
  std::string msg = graph_error([&] { gradients(sum(y), {w}); });
  CHECK(contains(msg, "op 'relu_grad'"));
  CHECK(contains(msg, "has no gradient"));
}

TEST_CASE("Graph.PrintsAsTextAndDot") {
  Graph g;
  auto x = g.input("x", {2, 3});
  auto w = g.variable("w", {3, 4});
  auto h = relu(matmul(x, w)).named("h");
  (void)h;
  std::string text = g.to_text();
  CHECK(contains(text, "x = input() f32[2, 3]"));
  CHECK(contains(text, "h = relu("));
  CHECK(contains(text, "f32[2, 4]"));
  std::string dot = g.to_dot();
  CHECK(contains(dot, "digraph"));
  CHECK(contains(dot, "n0 -> n2"));
}

TEST_CASE("Graph.InitializersAreSeededByGraphSeedAndName") {
  auto weights = [](std::uint64_t seed) {
    Graph g(seed);
    g.variable("w", {8, 8}, init::xavier());
    g.variable("v", {8}, init::normal(0.0, 1.0));
    auto p = ParameterStore::initialize(g);
    std::vector<float> out;
    for (const char* name : {"w", "v"}) {
      for (float x : p->at(name).data<float>()) out.push_back(x);
    }
    return out;
  };
  CHECK(weights(1) == weights(1));
  CHECK(weights(1) != weights(2));
  auto w = weights(3);
  double limit = std::sqrt(6.0 / 16.0);
  for (std::size_t i = 0; i < 64; ++i) CHECK(std::abs(w[i]) <= limit);
}

TEST_CASE("Autodiff.MatmulAndElementwiseMatchFiniteDifferences") {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      Graph g;
      std::map<std::string, Tensor> feeds;
      auto a = g.variable("a", ta ? Shape{3, 2} : Shape{2, 3}, init::zeros(), f64);
      auto b = g.variable("b", tb ? Shape{4, 3} : Shape{3, 4}, init::zeros(), f64);
      check_gradients(fmt::format("matmul ta={} tb={}", ta, tb), g, weighted_sum(g, matmul(a, b, ta, tb), feeds), feeds);
    }
  }
  {
    Graph g;
    std::map<std::string, Tensor> feeds;
    auto a = g.variable("a", {2, 3, 4}, init::zeros(), f64);
    auto w = g.variable("w", {4, 2}, init::zeros(), f64);
    check_gradients("batched matmul, shared weight", g, weighted_sum(g, matmul(a, w), feeds), feeds);
  }
  {
    Graph g;
    std::map<std::string, Tensor> feeds;
    auto a = g.variable("a", {2, 3, 4}, init::zeros(), f64);
    auto b = g.variable("b", {2, 5, 4}, init::zeros(), f64);
    check_gradients("batched matmul, trans_b", g, weighted_sum(g, matmul(a, b, false, true), feeds), feeds);
  }
  {
    Graph g;
    std::map<std::string, Tensor> feeds;
    auto a = g.variable("a", {3, 4}, init::zeros(), f64);
    auto bias = g.variable("bias", {4}, init::zeros(), f64);
    auto col = g.variable("col", {3, 1}, init::zeros(), f64);
    auto y = (a + bias) * col - a / (bias * bias + 2.0 * g.constant(1.0, {4}, f64)) + a * 0.5;
    check_gradients("add sub mul div scale with broadcasting", g, weighted_sum(g, y, feeds), feeds);
  }
}

TEST_CASE("Autodiff.ActivationsAndNormalisationMatchFiniteDifferences") {
  using Fn = std::function<Value(Value)>;
  std::vector<std::pair<std::string, Fn>> unary = {
      {"relu", [](Value x) { return relu(x); }},       {"gelu", [](Value x) { return gelu(x); }},
      {"tanh", [](Value x) { return tanh(x); }},       {"sigmoid", [](Value x) { return sigmoid(x); }},
      {"softmax", [](Value x) { return softmax(x); }}, {"log_softmax", [](Value x) { return log_softmax(x); }},
      {"layer_norm", [](Value x) { return layer_norm(x); }},
      {"transpose", [](Value x) { return transpose(x, {2, 0, 1}); }},
      {"reshape", [](Value x) { return reshape(x, {8, -1}); }},
      {"sum axes", [](Value x) { return sum(x, {1}); }},
      {"mean keepdims", [](Value x) { return mean(x, {0, 2}, true); }},
      {"slice", [](Value x) { return slice(x, 2, 1, 3); }},
      {"concat", [](Value x) { return concat({x, slice(x, 1, 0, 1) * 3.0}, 1); }},
      {"causal_mask + softmax", [](Value x) { return softmax(causal_mask(reshape(x, {2, 4, 4}) * 1.0)); }},
      {"dropout", [](Value x) { return dropout(x, 0.3); }},
  };
  for (auto& [name, fn] : unary) {
    Graph g(11);
    std::map<std::string, Tensor> feeds;
    auto x = g.variable("x", {2, 4, 4}, init::zeros(), f64);
    Value y = fn(x);
    check_gradients(name, g, weighted_sum(g, y, feeds), feeds);
  }
  {
    Graph g;
    std::map<std::string, Tensor> feeds;
    auto x = g.variable("x", {3, 5}, init::zeros(), f64);
    auto gamma = g.variable("gamma", {5}, init::zeros(), f64);
    auto beta = g.variable("beta", {5}, init::zeros(), f64);
    check_gradients("layer_norm with affine", g, weighted_sum(g, layer_norm(x, gamma, beta), feeds), feeds);
  }
}

TEST_CASE("Autodiff.LossesAndEmbeddingMatchFiniteDifferences") {
  {
    Graph g;
    auto logits = g.variable("logits", {4, 5}, init::zeros(), f64);
    auto labels = g.input("labels", {4}, i32);
    Tensor l = Tensor::empty({4}, i32);
    auto ld = l.data<std::int32_t>();
    ld[0] = 1, ld[1] = 4, ld[2] = 0, ld[3] = 1;
    check_gradients("softmax_cross_entropy", g, softmax_cross_entropy(logits, labels), {{"labels", l}});
  }
  {
    Graph g;
    auto pred = g.variable("pred", {3, 2}, init::zeros(), f64);
    auto target = g.variable("target", {3, 2}, init::zeros(), f64);
    check_gradients("mse (both sides)", g, mse(pred, target));
  }
  {
    Graph g;
    std::map<std::string, Tensor> feeds;
    auto table = g.variable("table", {5, 3}, init::zeros(), f64);
    auto ids = g.input("ids", {2, 3}, i32);
    Tensor t = Tensor::empty({2, 3}, i32);
    auto td = t.data<std::int32_t>();
    td[0] = 4, td[1] = 0, td[2] = 4, td[3] = 2, td[4] = 2, td[5] = 1;  // repeats: the grad must add
    feeds["ids"] = t;
    check_gradients("embedding", g, weighted_sum(g, embedding(table, ids), feeds), feeds);
  }
}

namespace {

using MlpRun = test::TrainedRun;
constexpr std::int64_t mlp_batch = 32;

MlpRun train_mlp(std::int64_t microbatches, int threads, OptimizerConfig opt, std::int64_t steps = 10,
                 std::uint64_t seed = 5, DType dtype = DType::f32, std::int64_t batch = mlp_batch) {
  constexpr std::int64_t width = 12, classes = 4;
  auto data = std::make_shared<const data::Dataset>(data::synthetic(256, width, classes, 99));
  Graph g(seed);
  const std::int64_t mb = batch / microbatches;
  auto x = g.input("x", {mb, width}, dtype);
  auto y = g.input("label", {mb}, i32);
  auto w1 = g.variable("w1", {width, 16}, init::kaiming(), dtype);
  auto b1 = g.variable("b1", {16}, init::zeros(), dtype);
  auto w2 = g.variable("w2", {16, classes}, init::kaiming(), dtype);
  auto b2 = g.variable("b2", {classes}, init::zeros(), dtype);
  auto loss = softmax_cross_entropy(matmul(relu(matmul(x, w1) + b1), w2) + b2, y);
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = microbatches;
  cfg.optimizer = opt;
  cfg.threads = threads;
  cfg.data = {{"synthetic", data::batch_source(data, batch, microbatches, 7), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  Runtime rt(job.plan, job.kernels, rs);
  rt.run();
  return test::trained(job);
}

}  // namespace

TEST_CASE("Training.MicrobatchesGiveTheSameWeights" * doctest::timeout(60)) {
  // The M partial gradients are summed in another order than the one big batch's:
  // test::Reordering's tolerance (10 steps, sums over the batch of 32), in f64 and in f32.
  for (DType dtype : {DType::f64, DType::f32}) {
    for (auto opt : {optim::sgd(0.1, 0.9), optim::adam(0.01)}) {
      CAPTURE(dtype);
      MlpRun one = train_mlp(1, 1, opt, 10, 5, dtype);
      REQUIRE(one.losses.size() == 10);
      CHECK(one.losses.back() < one.losses.front());
      const double tol = test::tolerance({.dtype = dtype, .steps = 10, .longest_sum = mlp_batch, .lr = opt.lr});
      for (std::int64_t m : {2, 4}) {
        CAPTURE(m);
        test::check_same_training(one, train_mlp(m, 1, opt, 10, 5, dtype), tol);
      }
    }
  }
}

TEST_CASE("Training.ReorderingToleranceIsFarBelowALostMicrobatch" * doctest::timeout(60)) {
  // The tolerance above must still see a wrong sum: training on 3 of the 4 micro-batches of
  // each step (batch 24 instead of 32, as if one micro-batch's gradient were lost) moves the
  // weights by far more than it, in both dtypes and with both optimizers.
  for (DType dtype : {DType::f64, DType::f32}) {
    for (auto opt : {optim::sgd(0.1, 0.9), optim::adam(0.01)}) {
      CAPTURE(dtype);
      const MlpRun one = train_mlp(4, 1, opt, 10, 5, dtype);
      const MlpRun lost = train_mlp(3, 1, opt, 10, 5, dtype, /*batch=*/24);
      const double tol = test::tolerance({.dtype = dtype, .steps = 10, .longest_sum = mlp_batch, .lr = opt.lr});
      CHECK(test::largest_difference(one, lost) > 10 * tol);
    }
  }
}

TEST_CASE("Training.SameSeedSameLossCurveBitForBit" * doctest::timeout(60)) {
  MlpRun a = train_mlp(2, 1, optim::adamw(0.01), 15);
  MlpRun b = train_mlp(2, 1, optim::adamw(0.01), 15);
  MlpRun threaded = train_mlp(2, 2, optim::adamw(0.01), 15);
  CHECK(a.losses == b.losses);
  CHECK(a.losses == threaded.losses);  // two worker threads: same order of every sum
  CHECK(a.weights == threaded.weights);
  MlpRun other = train_mlp(2, 1, optim::adamw(0.01), 15, /*seed=*/6);
  CHECK(a.losses != other.losses);
}

TEST_CASE("Training.PlanHasTheMicrobatchingActors") {
  auto data = std::make_shared<const data::Dataset>(data::synthetic(64, 4, 2, 1));
  Graph g;
  auto x = g.input("x", {8, 4});
  auto y = g.input("label", {8}, i32);
  auto w = g.variable("w", {4, 2});
  auto loss = softmax_cross_entropy(matmul(x, w), y);
  TrainConfig cfg;
  cfg.steps = 3;
  cfg.microbatches = 2;
  cfg.data = {{"d", data::batch_source(data, 16, 2, 1), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  std::string text = job.plan.to_text();
  CHECK(contains(text, "variable.w compute"));
  CHECK(contains(text, "w.repeat repeat"));
  CHECK(contains(text, "repeat op= f32 at r0/cpu:0/s0 in=[") );
  CHECK(contains(text, "accumulate"));
  CHECK(contains(text, "@-1"));  // the variable reads its summed gradient one step late
  CHECK(contains(job.plan.to_dot(), "digraph"));
  CHECK_NOTHROW(validate(job.plan, job.kernels));
}

TEST_CASE("Training.GlobalNormClippingBoundsTheUpdate" * doctest::timeout(60)) {
  // One SGD step with lr 1: the weights move by exactly the (clipped) gradient, so the global
  // norm of the change is the clip norm when clipping applies, and the gradient's own norm
  // when the clip norm is large.
  auto data = std::make_shared<const data::Dataset>(data::synthetic(64, 6, 3, 4));
  auto step_norm = [&](double clip) {
    Graph g(9);
    auto x = g.input("x", {16, 6});
    auto y = g.input("label", {16}, i32);
    auto w = g.variable("w", {6, 3}, init::normal(0.0, 3.0));
    auto b = g.variable("b", {3}, init::zeros());
    auto loss = softmax_cross_entropy(matmul(x, w) + b, y);
    TrainConfig cfg;
    cfg.steps = 1;
    cfg.optimizer = optim::sgd(1.0);
    cfg.optimizer.clip_norm = clip;
    cfg.data = {{"d", data::batch_source(data, 16, 1, 2), {"x", "label"}}};
    auto before = ParameterStore::initialize(g);
    std::map<std::string, std::vector<float>> start;
    for (auto& [n, t] : before->values()) start[n] = std::vector<float>(t.data<float>().begin(), t.data<float>().end());
    TrainingJob job = compile_training(g, loss, cfg);
    Runtime(job.plan, job.kernels).run();
    double sq = 0;
    for (auto& [n, t] : job.params->values()) {
      auto d = t.data<float>();
      for (std::size_t i = 0; i < d.size(); ++i) sq += std::pow(static_cast<double>(d[i]) - start[n][i], 2);
    }
    return std::sqrt(sq);
  };
  const double unclipped = step_norm(0.0);
  REQUIRE(unclipped > 0.05);
  // A clip far above the norm scales by 1: the same step, up to the f32 rounding of w - step
  // read back as a difference, u |w| / |step| ~ 6e-8 / 1e-2 = 6e-6 of the norm (1e-5). A clip to
  // a quarter: the step is max / (norm + 1e-6) times the gradient, off by 1e-6 / norm = 2e-5
  // (norm > 0.05) plus the same 6e-6 (1e-4).
  CHECK(step_norm(1e6) == doctest::Approx(unclipped).epsilon(1e-5));
  CHECK(step_norm(unclipped / 4) == doctest::Approx(unclipped / 4).epsilon(1e-4));
}
