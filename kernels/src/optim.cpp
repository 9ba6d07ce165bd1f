// The update rules follow torch.optim's single-tensor implementations (PyTorch 1.13,
// torch/optim/sgd.py and adam.py / adamw.py), element by element.
#include "baton/kernels/optim.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

#include <fmt/format.h>

namespace baton {

namespace {

void check_step(const char* fn, std::int64_t step) {
  if (step < 1) {
    throw std::invalid_argument(fmt::format("{}: step counts from 1, got {}", fn, step));
  }
}

void check_size(const char* fn, const char* what, std::size_t got, std::size_t want) {
  if (got != want) {
    throw std::invalid_argument(
        fmt::format("{}: {} has {} elements, the parameter {}", fn, what, got, want));
  }
}

template <class T>
void sgd_impl(std::span<T> w, std::span<const T> g, std::span<T> buf, const SgdConfig& cfg,
              std::int64_t step, double lr) {
  const char* fn = "sgd_step";
  check_step(fn, step);
  check_size(fn, "the gradient", g.size(), w.size());
  const bool momentum = cfg.momentum != 0.0;
  if (momentum) check_size(fn, "the momentum buffer", buf.size(), w.size());
  if (cfg.nesterov && !(cfg.momentum > 0.0)) {
    throw std::invalid_argument(
        fmt::format("{}: nesterov needs a positive momentum, got {}", fn, cfg.momentum));
  }
  const double wd = cfg.weight_decay;
  const double mu = cfg.momentum;
  const bool first = step == 1;
  for (std::size_t i = 0; i < w.size(); ++i) {
    const double wi = w[i];
    double d = static_cast<double>(g[i]) + wd * wi;
    if (momentum) {
      const double b = first ? d : mu * static_cast<double>(buf[i]) + d;
      buf[i] = static_cast<T>(b);
      d = cfg.nesterov ? d + mu * b : b;
    }
    w[i] = static_cast<T>(wi - lr * d);
  }
}

template <class T>
void adam_impl(std::span<T> w, std::span<const T> g, std::span<T> m, std::span<T> v,
               const AdamConfig& cfg, std::int64_t step, double lr) {
  const char* fn = "adam_step";
  check_step(fn, step);
  check_size(fn, "the gradient", g.size(), w.size());
  check_size(fn, "m", m.size(), w.size());
  check_size(fn, "v", v.size(), w.size());
  // The per-step constants in double; the per-element work in the parameter's own type, as
  // torch does, so that the loop vectorises (double sqrt and division per element made this the
  // slowest kernel of an MLP step).
  const double t = static_cast<double>(step);
  const T b1 = static_cast<T>(cfg.beta1);
  const T b2 = static_cast<T>(cfg.beta2);
  const T one_minus_b1 = static_cast<T>(1.0 - cfg.beta1);
  const T one_minus_b2 = static_cast<T>(1.0 - cfg.beta2);
  const T step_size = static_cast<T>(lr / (1.0 - std::pow(cfg.beta1, t)));
  const T inv_bc2_sqrt = static_cast<T>(1.0 / std::sqrt(1.0 - std::pow(cfg.beta2, t)));
  const T eps = static_cast<T>(cfg.eps);
  // AdamW decays the weight itself; Adam adds the L2 term to the gradient.
  const T decay = static_cast<T>(cfg.decoupled ? 1.0 - lr * cfg.weight_decay : 1.0);
  const T l2 = static_cast<T>(cfg.decoupled ? 0.0 : cfg.weight_decay);
  T* wp = w.data();
  const T* gp = g.data();
  T* mp = m.data();
  T* vp = v.data();
  for (std::size_t i = 0; i < w.size(); ++i) {
    const T gi = gp[i] + l2 * wp[i];
    const T mi = b1 * mp[i] + one_minus_b1 * gi;
    const T vi = b2 * vp[i] + one_minus_b2 * gi * gi;
    mp[i] = mi;
    vp[i] = vi;
    wp[i] = wp[i] * decay - step_size * mi / (std::sqrt(vi) * inv_bc2_sqrt + eps);
  }
}

}  // namespace

void sgd_step(std::span<float> w, std::span<const float> g, std::span<float> momentum_buf,
              const SgdConfig& cfg, std::int64_t step, double lr) {
  sgd_impl<float>(w, g, momentum_buf, cfg, step, lr);
}

void sgd_step(std::span<double> w, std::span<const double> g, std::span<double> momentum_buf,
              const SgdConfig& cfg, std::int64_t step, double lr) {
  sgd_impl<double>(w, g, momentum_buf, cfg, step, lr);
}

void adam_step(std::span<float> w, std::span<const float> g, std::span<float> m, std::span<float> v,
               const AdamConfig& cfg, std::int64_t step, double lr) {
  adam_impl<float>(w, g, m, v, cfg, step, lr);
}

void adam_step(std::span<double> w, std::span<const double> g, std::span<double> m,
               std::span<double> v, const AdamConfig& cfg, std::int64_t step, double lr) {
  adam_impl<double>(w, g, m, v, cfg, step, lr);
}

double lr_schedule(double base_lr, std::int64_t step, std::int64_t warmup_steps,
                   std::int64_t total_steps, double min_ratio) {
  if (step < 0 || warmup_steps < 0 || total_steps < 0) {
    throw std::invalid_argument(
        fmt::format("lr_schedule: step {}, warmup_steps {} and total_steps {} must not be negative",
                    step, warmup_steps, total_steps));
  }
  if (step < warmup_steps) {
    return base_lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
  }
  double progress = 1.0;
  if (total_steps > warmup_steps) {
    progress =
        static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    progress = std::min(progress, 1.0);  // step >= warmup_steps, so never below 0
  }
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return base_lr * (min_ratio + (1.0 - min_ratio) * cosine);
}

double clip_factor(double global_norm, double max_norm) {
  const double factor = max_norm / (global_norm + 1e-6);
  return std::isnan(factor) ? factor : std::min(factor, 1.0);
}

}  // namespace baton
