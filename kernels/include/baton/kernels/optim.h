#pragma once
/// Optimizer math: the update rules of SGD, Adam and AdamW on one parameter's elements, the
/// learning-rate schedule and the global-norm clipping factor. Plain functions on spans, so an
/// optimizer actor (or a test) owns its buffers and calls these once per parameter per step.
///
///   baton::AdamConfig cfg{.lr = 3e-4, .weight_decay = 0.1, .decoupled = true};  // AdamW
///   double lr = baton::lr_schedule(cfg.lr, step, 100, 10'000, 0.1);
///   baton::adam_step(w, g, m, v, cfg, step, lr);  // step counts from 1
///
/// The semantics are those of torch.optim.SGD, Adam and AdamW (PyTorch 1.13; dampening 0, no
/// amsgrad, no maximize). Adam works per element in the parameter's own type, as torch does;
/// SGD in double, rounding once.
#include <cstdint>
#include <span>

namespace baton {

struct SgdConfig {
  double lr = 0.01;  ///< base learning rate (the step functions take the scheduled one)
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;  ///< needs momentum > 0, as in torch
};

struct AdamConfig {
  double lr = 1e-3;  ///< base learning rate (the step functions take the scheduled one)
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = false;  ///< true: AdamW's decoupled decay; false: Adam's L2 term
};

/// One SGD step in place, with `lr` the learning rate for this step (cfg.lr is not read):
///   g' = g + weight_decay * w
///   b  = g' on the first step (step == 1), else momentum * b + g'
///   w -= lr * (nesterov ? g' + momentum * b : b)
/// and w -= lr * g' when momentum == 0 (no buffer).
/// `momentum_buf` has w's size, or may be empty when momentum == 0. `step` counts from 1. Throws
/// std::invalid_argument on mismatched sizes, step < 1, or nesterov without momentum.
void sgd_step(std::span<float> w, std::span<const float> g, std::span<float> momentum_buf,
              const SgdConfig& cfg, std::int64_t step, double lr);
void sgd_step(std::span<double> w, std::span<const double> g, std::span<double> momentum_buf,
              const SgdConfig& cfg, std::int64_t step, double lr);

/// One Adam or AdamW step in place, with `lr` the learning rate for this step (cfg.lr is not
/// read) and `step` = t counting from 1:
///   Adam:  g' = g + weight_decay * w         AdamW: w *= 1 - lr * weight_decay, g' = g
///   m = beta1 * m + (1 - beta1) * g'         v = beta2 * v + (1 - beta2) * g'^2
///   w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// m and v start at zero and have w's size. Throws std::invalid_argument on mismatched sizes or
/// step < 1.
void adam_step(std::span<float> w, std::span<const float> g, std::span<float> m, std::span<float> v,
               const AdamConfig& cfg, std::int64_t step, double lr);
void adam_step(std::span<double> w, std::span<const double> g, std::span<double> m,
               std::span<double> v, const AdamConfig& cfg, std::int64_t step, double lr);

/// Linear warm-up then cosine decay:
///   base_lr * step / warmup_steps                                       for step < warmup_steps
///   base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * progress)))   otherwise,
/// progress = (step - warmup_steps) / (total_steps - warmup_steps) clamped to [0, 1] (1 when
/// total_steps <= warmup_steps: no cosine phase, straight to base_lr * min_ratio). Step 0 gives
/// 0 when there is a warm-up. Throws std::invalid_argument on a negative step or step count.
double lr_schedule(double base_lr, std::int64_t step, std::int64_t warmup_steps,
                   std::int64_t total_steps, double min_ratio = 0.0);

/// The factor to multiply every gradient by for global-norm clipping, as
/// torch.nn.utils.clip_grad_norm_: min(1, max_norm / (global_norm + 1e-6)). A NaN norm gives
/// NaN (torch's clamp keeps it), so a broken step shows instead of passing unclipped.
double clip_factor(double global_norm, double max_norm);

}  // namespace baton
