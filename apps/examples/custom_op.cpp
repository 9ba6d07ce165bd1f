//  custom_op: an op of your own, without editing baton. One register_op call gives it a shape
//  rule, CPU kernels and a gradient rule; autodiff, the compiler and the runtime then treat it
//  as a built-in op. Here a leaky ReLU (slope 0.1 below zero) between two layers.
#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"

using namespace baton;

// out = x > 0 ? x : 0.1 x (the forward), and out = x > 0 ? dy : 0.1 dy (its gradient, of (x, dy)).
void leaky(KernelContext& c) {
  auto x = c.inputs[0]->data<float>();
  auto out = c.outputs[0]->data<float>();
  auto dy = c.inputs.size() > 1 ? c.inputs[1]->data<float>() : x;
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = x[i] > 0 ? dy[i] : 0.1f * dy[i];
}

int main() {
  auto like_input = [](const OpInputs& in) { return TensorType{in[0].shape(), in[0].dtype()}; };
  register_op({.name = "my.leaky_relu_grad", .infer = like_input,
               .kernels = {{DeviceType::cpu, f32, kernel_of(leaky)}}, .elementwise = true});
  register_op({.name = "my.leaky_relu", .infer = like_input,
               .gradient = [](const GradientArgs& a) { return apply("my.leaky_relu_grad", {a.x(), a.dy}); },
               .kernels = {{DeviceType::cpu, f32, kernel_of(leaky)}}, .elementwise = true});

  auto data = std::make_shared<const data::Dataset>(data::synthetic(1024, 8, 3, /*seed=*/1));
  Graph g(/*seed=*/42);
  auto h = apply("my.leaky_relu", {matmul(g.input("x", {16, 8}), g.variable("w1", {8, 32}, init::kaiming())) +
                                   g.variable("b1", {32}, init::zeros())});
  auto logits = matmul(h, g.variable("w2", {32, 3}, init::kaiming())) + g.variable("b2", {3}, init::zeros());
  auto loss = softmax_cross_entropy(logits, g.input("label", {16}, i32));

  TrainConfig cfg;
  cfg.steps = 300;
  cfg.microbatches = 2;
  cfg.optimizer = optim::adam(1e-2);
  cfg.data = {{"synthetic", data::batch_source(data, 32, 2, /*seed=*/7), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  Runtime(job.plan, job.kernels).run();
  auto losses = job.losses->per_step();
  fmt::print("my.leaky_relu: loss {:.4f} -> {:.4f} in {} steps\n", losses.front(), losses.back(), losses.size());
  return losses.back() < 0.5 * losses.front() ? 0 : 1;
}
