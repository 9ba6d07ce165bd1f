//  hello_mlp: the smallest useful baton program. Copy it to start your own model.
//
//    x [16, 8] ──matmul── w1 [8, 32] ──+ b1 ──relu──matmul── w2 [32, 3] ──+ b2 ── logits
//                                                                                  │
//    label [16] (i32) ─────────────────────────────── softmax_cross_entropy ─── loss
//
//  compile_training() turns it into actors: a data source, one actor per op and per backward
//  op, and a variable actor per weight that runs Adam on its summed gradient.
#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"

int main() {
  using namespace baton;
  auto data = std::make_shared<const data::Dataset>(data::synthetic(1024, 8, 3, /*seed=*/1));

  Graph g(/*seed=*/42);
  auto x = g.input("x", {16, 8});
  auto label = g.input("label", {16}, i32);
  auto w1 = g.variable("w1", {8, 32}, init::kaiming());
  auto b1 = g.variable("b1", {32}, init::zeros());
  auto w2 = g.variable("w2", {32, 3}, init::kaiming());
  auto b2 = g.variable("b2", {3}, init::zeros());
  auto logits = matmul(relu(matmul(x, w1) + b1), w2) + b2;
  auto loss = softmax_cross_entropy(logits, label);

  TrainConfig cfg;
  cfg.steps = 300;
  cfg.microbatches = 2;  // two micro-batches of 16: a global batch of 32 per step
  cfg.optimizer = optim::adam(1e-2);
  cfg.data = {{"synthetic", data::batch_source(data, 32, 2, /*seed=*/7), {"x", "label"}}};

  TrainingJob job = compile_training(g, loss, cfg);
  Runtime runtime(job.plan, job.kernels);
  RunReport report = runtime.run();

  auto losses = job.losses->per_step();
  for (std::size_t s = 0; s < losses.size(); s += 50) fmt::print("step {:>3}  loss {:.4f}\n", s, losses[s]);
  fmt::print("step {:>3}  loss {:.4f}   ({} actors, {:.2f} s)\n", losses.size() - 1, losses.back(),
             job.plan.actors.size(), report.wall_s);
  return losses.back() < losses.front() ? 0 : 1;
}
