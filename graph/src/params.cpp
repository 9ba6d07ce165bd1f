// Seeded initial values and the loss log.
#include <cmath>
#include <cstring>
#include <numbers>

#include <fmt/format.h>

#include "baton/graph/compile.h"
#include "baton/graph/sharding.h"
#include "baton/kernels/optim.h"

namespace baton {

namespace {

// splitmix64: a tiny generator whose output is the same on every platform and library (unlike
// std::uniform_real_distribution), so the same seed gives the same weights everywhere.
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform01() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double normal() {  // Box-Muller
    double u1 = uniform01(), u2 = uniform01();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }
};

std::uint64_t name_hash(const std::string& s) {
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

template <class T>
void fill_initial(Tensor& t, const Node& n, std::uint64_t seed) {
  auto d = t.data<T>();
  SplitMix64 rng{seed ^ name_hash(n.name)};
  const auto& s = n.shape;
  double fan_in = s.empty() ? 1.0 : static_cast<double>(s.size() >= 2 ? s[s.size() - 2] : s.back());
  double fan_out = s.empty() ? 1.0 : static_cast<double>(s.back());
  switch (n.init.kind) {
    case Init::Kind::zeros:
      for (auto& x : d) x = T(0);
      break;
    case Init::Kind::constant:
      for (auto& x : d) x = static_cast<T>(n.init.a);
      break;
    case Init::Kind::uniform:
      for (auto& x : d) x = static_cast<T>(n.init.a + (n.init.b - n.init.a) * rng.uniform01());
      break;
    case Init::Kind::normal:
      for (auto& x : d) x = static_cast<T>(n.init.a + n.init.b * rng.normal());
      break;
    case Init::Kind::xavier_uniform: {
      double a = std::sqrt(6.0 / (fan_in + fan_out));
      for (auto& x : d) x = static_cast<T>(-a + 2 * a * rng.uniform01());
      break;
    }
    case Init::Kind::kaiming_uniform: {
      double a = 1.0 / std::sqrt(fan_in);
      for (auto& x : d) x = static_cast<T>(-a + 2 * a * rng.uniform01());
      break;
    }
  }
}

}  // namespace

std::shared_ptr<ParameterStore> ParameterStore::initialize(Graph& g) {
  auto store = std::make_shared<ParameterStore>();
  for (Value v : g.variables()) {
    Node n = v.node();
    // A part of a split weight: the whole weight's initial values (its name seeds them, its
    // shape gives the fans), then this part of them, so tp shards start as one device does.
    const std::optional<PartOf> part = n.part_of;
    if (part) {
      n.name = part->name;
      n.shape = part->shape;
    }
    Tensor t = Tensor::empty(n.shape, n.dtype);
    if (n.dtype == DType::f64) {
      fill_initial<double>(t, n, g.seed());
    } else {
      fill_initial<float>(t, n, g.seed());
    }
    if (part) t = part_along(t, part->axis, part->index, part->parts);
    store->set(v.node().name, std::move(t));
  }
  return store;
}

std::shared_ptr<ParameterStore> ParameterStore::shapes(Graph& g) {
  auto store = std::make_shared<ParameterStore>();
  for (Value v : g.variables()) store->set(v.node().name, Tensor::unallocated(v.node().shape, v.node().dtype));
  return store;
}

Tensor& ParameterStore::at(const std::string& name) {
  auto it = values_.find(name);
  if (it == values_.end()) throw std::out_of_range(fmt::format("no parameter '{}'", name));
  return it->second;
}

const Tensor& ParameterStore::at(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) throw std::out_of_range(fmt::format("no parameter '{}'", name));
  return it->second;
}

void LossLog::record(std::int64_t piece, double value) {
  std::lock_guard lock(mutex_);
  auto step = static_cast<std::size_t>(piece / microbatches_);
  if (sums_.size() <= step) {
    sums_.resize(step + 1, 0.0);
    counts_.resize(step + 1, 0);
  }
  sums_[step] += value;
  if (++counts_[step] == microbatches_) {
    // Steps complete in order: one loss actor reports pieces in order.
    done_at_.resize(step + 1, std::chrono::steady_clock::now());
    steps_done_.store(static_cast<std::int64_t>(step) + 1, std::memory_order_release);
  }
}

std::optional<std::chrono::steady_clock::time_point> LossLog::when_done(std::int64_t steps) const {
  std::lock_guard lock(mutex_);
  if (steps <= 0 || static_cast<std::size_t>(steps) > done_at_.size()) return std::nullopt;
  return done_at_[static_cast<std::size_t>(steps) - 1];
}

std::vector<double> LossLog::per_step() const {
  std::lock_guard lock(mutex_);
  std::vector<double> out;
  for (std::size_t s = 0; s < sums_.size() && counts_[s] == microbatches_; ++s) {
    out.push_back(sums_[s] / static_cast<double>(microbatches_));
  }
  return out;
}

namespace optim {
OptimizerConfig sgd(double lr, double momentum, double weight_decay) {
  OptimizerConfig c;
  c.kind = OptimizerConfig::Kind::sgd;
  c.lr = lr;
  c.momentum = momentum;
  c.weight_decay = weight_decay;
  return c;
}
OptimizerConfig adam(double lr, double weight_decay) {
  OptimizerConfig c;
  c.kind = OptimizerConfig::Kind::adam;
  c.lr = lr;
  c.weight_decay = weight_decay;
  return c;
}
OptimizerConfig adamw(double lr, double weight_decay) {
  OptimizerConfig c;
  c.kind = OptimizerConfig::Kind::adamw;
  c.lr = lr;
  c.weight_decay = weight_decay;
  return c;
}
}  // namespace optim

std::string_view name(OptimizerConfig::Kind kind) {
  switch (kind) {
    case OptimizerConfig::Kind::sgd: return "sgd";
    case OptimizerConfig::Kind::adam: return "adam";
    case OptimizerConfig::Kind::adamw: return "adamw";
  }
  return "?";
}

std::vector<std::string> optimizer_slot_names(const OptimizerConfig& cfg) {
  if (cfg.kind != OptimizerConfig::Kind::sgd) return {"exp_avg", "exp_avg_sq"};
  if (cfg.momentum != 0.0) return {"momentum_buffer"};
  return {};
}

double learning_rate(const OptimizerConfig& cfg, std::int64_t step, std::int64_t total_steps) {
  if (cfg.cosine) return lr_schedule(cfg.lr, step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio);
  if (cfg.warmup_steps > 0 && step < cfg.warmup_steps) {
    return cfg.lr * static_cast<double>(step) / static_cast<double>(cfg.warmup_steps);
  }
  return cfg.lr;
}

}  // namespace baton
