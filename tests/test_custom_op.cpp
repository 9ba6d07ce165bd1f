// An op defined outside baton (here, in a test) with register_op: its shape rule, CPU kernels
// and gradient rule, used by autodiff, the compiler and the runtime as a built-in op is.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "test_util.h"

using namespace baton;

namespace {

// softplus(x) = log(1 + e^x), computed without overflow; its derivative is sigmoid(x).
template <class T>
void softplus_kernel(KernelContext& ctx) {
  auto x = ctx.inputs[0]->data<T>();
  auto y = ctx.outputs[0]->data<T>();
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = std::max(x[i], T(0)) + std::log1p(std::exp(-std::abs(x[i])));
}

// softplus_grad(x, dy) = dy * sigmoid(x).
template <class T>
void softplus_grad_kernel(KernelContext& ctx) {
  auto x = ctx.inputs[0]->data<T>();
  auto dy = ctx.inputs[1]->data<T>();
  auto dx = ctx.outputs[0]->data<T>();
  for (std::size_t i = 0; i < x.size(); ++i) dx[i] = dy[i] / (T(1) + std::exp(-x[i]));
}

TensorType same_as_first(const OpInputs& in) {
  for (std::size_t i = 1; i < in.size(); ++i) {
    if (in[i].shape() != in[0].shape() || in[i].dtype() != in[0].dtype()) {
      throw GraphError(fmt::format("test.softplus_grad: {} and {} differ", in[0].describe(), in[i].describe()));
    }
  }
  return {in[0].shape(), in[0].dtype()};
}

/// Registers the two ops once per process (a name is registered once).
void register_softplus() {
  static const bool done = [] {
    register_op({.name = "test.softplus_grad",
                 .infer = same_as_first,
                 .kernels = {{DeviceType::cpu, f32, kernel_of(softplus_grad_kernel<float>)},
                             {DeviceType::cpu, f64, kernel_of(softplus_grad_kernel<double>)}},
                 .elementwise = true});
    register_op({.name = "test.softplus",
                 .infer = same_as_first,
                 .gradient = [](const GradientArgs& a) { return apply("test.softplus_grad", {a.x(), a.dy}); },
                 .kernels = {{DeviceType::cpu, f32, kernel_of(softplus_kernel<float>)},
                             {DeviceType::cpu, f64, kernel_of(softplus_kernel<double>)}},
                 .elementwise = true});
    return true;
  }();
  (void)done;
}

Value softplus(Value x) { return apply("test.softplus", {x}); }

// The same function from built-in ops, for comparison.
Value softplus_composite(Value x) { return log(exp(x) + x.graph().constant(1.0, x.shape(), x.dtype())); }

/// A two-layer classifier on 8 features, 4 classes, with `act` between the layers, in f64.
Value classifier(Graph& g, std::int64_t batch, Value (*act)(Value)) {
  Value x = cast(g.input("x", {batch, 8}), f64);
  Value label = g.input("label", {batch}, DType::i32);
  Value h = act(matmul(x, g.variable("w1", {8, 16}, init::xavier(), f64)) +
                g.variable("b1", {16}, init::uniform(-0.5, 0.5), f64));
  Value logits = matmul(h, g.variable("w2", {16, 4}, init::xavier(), f64)) + g.variable("b2", {4}, init::zeros(), f64);
  return softmax_cross_entropy(logits, label);
}

}  // namespace

TEST_CASE("CustomOp.GradientMatchesFiniteDifferences") {
  // d loss / d w1 through the registered op, by autodiff (its gradient rule and its gradient
  // op's kernel), against central differences of the loss (its forward kernel), in f64: the
  // difference's truncation error is O(h^2) ~ 1e-12 and its rounding ~1e-16 / h ~ 1e-11.
  register_softplus();
  Graph g(3);
  Value loss = classifier(g, 6, softplus);
  Value w1 = g.find("w1");
  Value dw1 = gradients(loss, {w1})[0];
  REQUIRE(dw1.valid());
  bool used = false;
  for (int id = 0; id < g.size(); ++id) used = used || g.node(id).op == "test.softplus_grad";
  CHECK(used);  // the backward pass runs the registered gradient op
  const data::Dataset d = data::synthetic(6, 8, 4, 11);
  const std::map<std::string, Tensor> feeds{{"x", d.features}, {"label", d.labels}};
  auto params = ParameterStore::initialize(g);
  const Tensor grad = evaluate(g, feeds, {dw1}, *params)[0];
  const double h = 1e-5;
  Tensor& w = params->at("w1");
  auto loss_at = [&] { return evaluate(g, feeds, {loss}, *params)[0].data<double>()[0]; };
  double worst = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(w.numel()); ++i) {
    const double keep = w.data<double>()[i];
    w.data<double>()[i] = keep + h;
    const double up = loss_at();
    w.data<double>()[i] = keep - h;
    const double down = loss_at();
    w.data<double>()[i] = keep;
    const double fd = (up - down) / (2 * h);
    worst = std::max(worst, std::abs(fd - grad.data<double>()[i]));
  }
  CHECK(worst < 1e-8);
}

TEST_CASE("CustomOp.TrainsAsTheSameFunctionFromBuiltInOps" * doctest::timeout(120)) {
  // 30 steps of SGD, dp 2 with two micro-batches each, through the registered softplus and
  // through log(exp(x) + 1) from built-in ops: the same function and gradient, rounded
  // differently (~1e-16 each), so f64 losses agree to 1e-9 (far above that rounding grown over
  // 30 steps, far below the loss's fall), on every OpenBLAS kernel set (their f64 sums differ
  // in order by ~1e-15 alike on both sides).
  register_softplus();
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(256, 8, 4, 5));
  auto run = [&](Value (*act)(Value)) {
    Graph g(7);
    Value loss = classifier(g, 8, act);
    TrainConfig cfg;
    cfg.steps = 30;
    cfg.dp = 2;
    cfg.microbatches = 2;
    cfg.optimizer = optim::sgd(0.2);
    cfg.data = {{"synthetic", data::batch_source(dataset, 32, 4, 3), {"x", "label"}}};
    TrainingJob job = compile_training(g, loss, cfg);
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(30'000);
    Runtime(job.plan, job.kernels, rs).run();
    return job.losses->per_step();
  };
  const std::vector<double> custom = run(softplus);
  const std::vector<double> builtin = run(softplus_composite);
  REQUIRE(custom.size() == 30);
  REQUIRE(builtin.size() == 30);
  for (std::size_t i = 0; i < custom.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(custom[i] - builtin[i]) < 1e-9 * std::abs(builtin[i]));
  }
  CHECK(custom.back() < 0.8 * custom.front());  // it learns
}

TEST_CASE("CustomOp.TensorParallelismSplitsItOnlyWhereItSaysItIsElementwise") {
  register_softplus();
  static const bool rowwise = [] {
    register_op({.name = "test.row_max",
                 .infer = [](const OpInputs& in) { return TensorType{in[0].shape(), in[0].dtype()}; }});
    return true;
  }();
  (void)rowwise;
  Graph g;
  Value x = g.input("x", {4, 6});
  const Value elementwise = softplus(x);
  const Value other = apply("test.row_max", {x});
  const Sbp s1 = sbp::split(1);
  CHECK(infer_signature(g, elementwise.id(), {s1}, 2).output == s1);
  CHECK(infer_signature(g, other.id(), {s1}, 2) == Signature{{sbp::broadcast()}, sbp::broadcast()});
}

TEST_CASE("CustomOp.MistakesAreRefusedNamingTheOp") {
  register_softplus();
  auto error_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const GraphError& e) {
      return e.what();
    }
    return "(no error)";
  };
  auto refused = [&](const std::function<void()>& fn, const std::string& words) {
    const std::string e = error_of(fn);
    CHECK_MESSAGE(test::contains(e, words), e);
  };
  refused([] { register_op({.name = "matmul"}); }, "register_op 'matmul': a built-in op has that name");
  refused([] { register_op({.name = "relu_grad"}); }, "a built-in op has that name");  // no gradient rule of its own
  refused([] { register_op({.name = "test.softplus"}); }, "registered already");
  refused([] { register_op({}); }, "no name");
  refused([] { register_op({.name = "test.no_factory", .kernels = {{DeviceType::cpu, f32, nullptr}}}); },
          "the cpu/f32 kernel has no factory");
  Graph g;
  Value x = g.input("x", {2, 3});
  Value y = g.input("y", {3, 2});
  refused([&] { apply("test.nothing", {x}); }, "apply 'test.nothing': no op of that name is registered");
  refused([&] { apply("matmul", {x, y}); }, "a built-in op: call its function");
  refused([&] { apply("test.softplus_grad", {x, y}); }, "test.softplus_grad: x f32[2, 3] and y f32[3, 2] differ");
  // An op without a gradient rule on the loss's path: autodiff names it.
  static const bool once = [] {
    register_op({.name = "test.no_gradient",
                 .infer = [](const OpInputs& in) { return TensorType{in[0].shape(), in[0].dtype()}; },
                 .kernels = {{DeviceType::cpu, f32, kernel_of(softplus_kernel<float>)}}});
    return true;
  }();
  (void)once;
  Value w = g.variable("w", {2, 3});
  Value loss = mean(apply("test.no_gradient", {x * w}));
  refused([&] { gradients(loss, {w}); }, "op 'test.no_gradient'");
  // No kernel for the dtype: the error names the op and what exists.
  Graph g64;
  Value x64 = g64.input("x", {2, 3}, f64);
  const std::string e = [&] {
    try {
      evaluate(g64, {{"x", Tensor::zeros({2, 3}, f64)}}, {apply("test.no_gradient", {x64})}, ParameterStore());
    } catch (const std::exception& ex) {
      return std::string(ex.what());
    }
    return std::string("(no error)");
  }();
  CHECK_MESSAGE(test::contains(e, "needs kernel 'test.no_gradient' for cpu/f64, which is not registered"), e);
}
