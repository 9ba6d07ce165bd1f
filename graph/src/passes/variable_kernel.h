#pragma once
// Private to graph/src/passes: the CPU kernels that apply an optimizer (lower_variables.cpp for a
// whole weight, lower_zero.cpp for a ZeRO shard of a bucket of weights) and compute the
// global-norm clipping factor.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "../device_variables.h"
#include "../runs.h"
#include "baton/graph/compile.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/optim.h"

namespace baton::passes::detail {

/// Copies elements [offset, offset + to.size()) of the concatenation of `parts` into `to`;
/// returns how many of them the parts hold.
template <class T>
std::size_t copy_window(const std::vector<std::span<const T>>& parts, std::int64_t offset, std::span<T> to) {
  return baton::detail::for_each_run<T>(parts, offset, to.size(), [&](std::span<const T> run, std::size_t at) {
    std::copy(run.begin(), run.end(), to.begin() + static_cast<std::ptrdiff_t>(at));
  });
}

/// Where an optimizer actor finds its gradient: the concatenation of its first `parts` inputs,
/// from element `offset` on (as many elements as the master has). A whole weight reads its
/// summed gradient (one part, offset 0); a ZeRO-1 shard reads its window of the all-reduced
/// bucket; a ZeRO-2 shard the reduce-scattered segments of its chunk.
struct GradientWindow {
  std::size_t parts = 1;
  std::int64_t offset = 0;
};

/// Where a ZeRO shard's optimizer finds the current values of its elements after act 0: the
/// concatenation of the `parts` inputs after the gradient's (the bucket's weights as its
/// replica's gather wrote them, read with delay 1), from element `offset` on. It then keeps no
/// master copy: it copies its window of them into its output and updates that in place.
/// parts 0: the kernel keeps the master (a whole weight).
struct WeightWindow {
  std::size_t parts = 0;
  std::int64_t offset = 0;
};

/// A weight (or a ZeRO shard of a bucket of weights) with its optimizer. Act 0 emits the initial
/// value; act k >= 1 applies step k-1's summed gradient (GradientWindow, read with delay 1),
/// scaled by the clipping factor (the input after the gradient's, if any), then emits the new
/// value. The master copy is `master` itself (for replica 0 of a whole weight, the
/// ParameterStore's tensor). A resumed job's actor starts at piece first_step (its acts count
/// steps), from the saved `slots` (optimizer_slot_names order; empty: zeros).
///
/// `late` steps more (PipeDream-2BW: 1, the gradient read with delay 2): acts 0 .. late emit the
/// initial value, and act k > late applies step k-1-late's gradient as update number k - late,
/// which is the step the learning-rate schedule, Adam's bias correction and the snapshots see.
template <class T>
class VariableKernel final : public Kernel {
 public:
  VariableKernel(Tensor master, OptimizerConfig cfg, std::int64_t total_steps,
                 std::vector<std::vector<T>> slots, baton::detail::SnapshotHook snapshots,
                 GradientWindow window = {}, WeightWindow weights = {}, std::int64_t late = 0)
      : master_(std::move(master)),
        cfg_(cfg),
        total_steps_(total_steps),
        snapshots_(std::move(snapshots)),
        window_(window),
        weights_(weights),
        late_(late),
        n_(static_cast<std::size_t>(master_.numel())),
        shape_(master_.shape()),
        dtype_(master_.dtype()) {
    const std::size_t n = n_;
    if (cfg_.kind == OptimizerConfig::Kind::sgd) {
      if (cfg_.momentum != 0.0) m_.assign(n, T(0));
    } else {
      m_.assign(n, T(0));
      v_.assign(n, T(0));
    }
    for (std::size_t i = 0; i < slots.size() && i < 2; ++i) {
      std::vector<T>& to = i == 0 ? m_ : v_;
      if (slots[i].size() != to.size()) {
        throw std::invalid_argument(fmt::format("optimizer slot {} holds {} elements, the weight {}", i,
                                                slots[i].size(), to.size()));
      }
      to = std::move(slots[i]);
    }
  }
  /// A whole weight's master is its output register's slot (RegisterDesc::kernel_memory): the
  /// readers read it where the optimizer updates it, with no copy.
  Tensor owned_output(std::size_t output) override {
    return output == 0 && weights_.parts == 0 ? master_ : Tensor();
  }
  void compute(KernelContext& ctx) override {
    const bool first = ctx.inputs.empty() || ctx.inputs[0] == nullptr;
    if (weights_.parts == 0) {
      if (!first) update(ctx, master_.data<T>());
      copy_out(master_.data<T>(), *ctx.outputs[0]);
      return;
    }
    if (first) {  // the initial values, needed once
      copy_out(master_.data<T>(), *ctx.outputs[0]);
      master_ = Tensor();
      return;
    }
    auto out = ctx.outputs[0]->data<T>();
    gather(ctx, window_.parts, weights_.parts, weights_.offset, out, "weights");
    update(ctx, out);
  }

 private:
  void copy_out(std::span<const T> from, Tensor& out) const {
    if (out.dtype() != dtype_) {
      // A low-precision copy for readers that would cast it (TrainConfig::fuse_weight_casts):
      // rounded as the cast kernel rounds.
      if (out.dtype() != DType::bf16 || !std::is_same_v<T, float> || out.numel() != static_cast<std::int64_t>(from.size())) {
        throw std::invalid_argument(fmt::format("a {} weight of {} elements into a register {}", name(dtype_),
                                                from.size(), out.describe()));
      }
      auto to = out.data<bfloat16>();
      for (std::size_t i = 0; i < from.size(); ++i) to[i] = to_bf16(static_cast<float>(from[i]));
      return;
    }
    auto to = out.data<T>();
    if (to.data() == from.data() && to.size() == from.size()) return;  // the master is the slot
    if (from.size() != to.size()) {
      throw std::invalid_argument(
          fmt::format("a weight of {} elements into a register of {}", from.size(), to.size()));
    }
    std::copy(from.begin(), from.end(), to.begin());
  }

  /// Inputs [first, first + parts) as spans.
  static std::vector<std::span<const T>> parts_of(const KernelContext& ctx, std::size_t first, std::size_t parts) {
    std::vector<std::span<const T>> in;
    for (std::size_t p = first; p < first + parts; ++p) in.push_back(ctx.inputs[p]->data<T>());
    return in;
  }

  /// Elements [offset, offset + to.size()) of the concatenation of inputs [first, first + parts).
  static void gather(KernelContext& ctx, std::size_t first, std::size_t parts, std::int64_t offset,
                     std::span<T> to, const char* what) {
    const std::size_t filled = copy_window<T>(parts_of(ctx, first, parts), offset, to);
    if (filled != to.size()) {
      throw std::invalid_argument(fmt::format("the {} hold {} of the shard's {} elements [{}, {})", what,
                                              filled, to.size(), offset,
                                              offset + static_cast<std::int64_t>(to.size())));
    }
  }

  /// The step's gradient for the master's elements (in scaled_ when it had to be gathered).
  std::span<const T> gradient(KernelContext& ctx) {
    const std::size_t n = n_;
    if (window_.parts == 1) {
      auto all = ctx.inputs[0]->data<T>();
      if (window_.offset < 0 || static_cast<std::size_t>(window_.offset) + n > all.size()) {
        throw std::invalid_argument(fmt::format("elements [{}, {}) of a gradient of {}", window_.offset,
                                                static_cast<std::size_t>(window_.offset) + n, all.size()));
      }
      return all.subspan(static_cast<std::size_t>(window_.offset), n);
    }
    scaled_.resize(n);
    gather(ctx, 0, window_.parts, window_.offset, std::span<T>(scaled_), "gradient's parts");
    return scaled_;
  }

  void update(KernelContext& ctx, std::span<T> w) {
    const std::int64_t step = ctx.piece - late_;  // 1-based: act k applies update k - late
    const std::size_t clip_at = window_.parts + weights_.parts;
    double factor = 1.0;
    if (ctx.inputs.size() > clip_at && ctx.inputs[clip_at] != nullptr) {
      factor = static_cast<double>(ctx.inputs[clip_at]->data<T>()[0]);
    }
    if (window_.parts > 1 && factor == 1.0) {
      // A gradient in several parts (a weight's window of its bucket's reduce-scattered sums, a
      // ZeRO-2 shard's segments): each part's share is updated where it lies, with no copy of
      // the gradient. The optimizers are elementwise, so this is the one update, bit for bit.
      baton::detail::for_each_run<T>(parts_of(ctx, 0, window_.parts), window_.offset, n_,
                                     [&](std::span<const T> run, std::size_t at) {
                                       step_on(w.subspan(at, run.size()), run, at, step);
                                     });
    } else {
      std::span<const T> grad = gradient(ctx);
      if (factor != 1.0) {
        scaled_.resize(grad.size());  // in place when grad is scaled_ already
        for (std::size_t i = 0; i < grad.size(); ++i) scaled_[i] = static_cast<T>(grad[i] * factor);
        grad = scaled_;
      }
      step_on(w, grad, 0, step);
    }
    if (snapshots_.hand_over && snapshots_.every > 0 &&
        (step % snapshots_.every == 0 || step == total_steps_)) {
      hand_over(step, w);
    }
  }

  /// The optimizer's step on elements [at, at + w.size()) of the master and of its slots.
  void step_on(std::span<T> w, std::span<const T> grad, std::size_t at, std::int64_t step) {
    const double lr = learning_rate(cfg_, step, total_steps_);
    auto slot = [&](std::vector<T>& s) { return s.empty() ? std::span<T>() : std::span<T>(s).subspan(at, w.size()); };
    if (cfg_.kind == OptimizerConfig::Kind::sgd) {
      sgd_step(w, grad, slot(m_), baton::detail::sgd_config_of(cfg_), step, lr);
    } else {
      adam_step(w, grad, slot(m_), slot(v_), baton::detail::adam_config_of(cfg_), step, lr);
    }
  }

  void hand_over(std::int64_t step, std::span<const T> w) {
    auto copy_of = [&](std::span<const T> from) {
      Tensor t = Tensor::empty(shape_, dtype_);  // master_ is gone when the weights are read
      std::copy(from.begin(), from.end(), t.data<T>().begin());
      return t;
    };
    VariableSnapshot s{.name = snapshots_.name, .step = step, .weight = copy_of(w)};
    const auto names = optimizer_slot_names(cfg_);
    for (std::size_t i = 0; i < names.size(); ++i) s.slots[names[i]] = copy_of(i == 0 ? m_ : v_);
    snapshots_.hand_over(std::move(s));
  }

  Tensor master_;
  OptimizerConfig cfg_;
  std::int64_t total_steps_;
  baton::detail::SnapshotHook snapshots_;
  GradientWindow window_;
  WeightWindow weights_;
  std::int64_t late_;  // steps between a gradient's step and its update, less one
  std::size_t n_;  // the elements it updates
  Shape shape_;    // the master's
  DType dtype_;
  std::vector<T> m_, v_, scaled_;
};

/// The squares of every input's elements, summed in double (one scalar f64 output): each
/// ZeRO-2 replica's share of the global gradient norm.
template <class T>
class SumOfSquaresKernel final : public Kernel {
 public:
  void compute(KernelContext& ctx) override {
    double sq = 0;
    for (const Tensor* g : ctx.inputs) {
      for (T x : g->data<T>()) sq += static_cast<double>(x) * static_cast<double>(x);
    }
    ctx.outputs[0]->data<double>()[0] = sq;
  }
};

/// Global-norm clipping: reads every summed gradient of a step (or, `of_squares`, every
/// replica's SumOfSquaresKernel scalar), writes the factor.
template <class T>
class ClipKernel final : public Kernel {
 public:
  ClipKernel(double max_norm, bool of_squares) : max_norm_(max_norm), of_squares_(of_squares) {}
  void compute(KernelContext& ctx) override {
    double sq = 0;
    for (const Tensor* g : ctx.inputs) {
      if (of_squares_) {
        sq += g->data<double>()[0];
        continue;
      }
      for (T x : g->data<T>()) sq += static_cast<double>(x) * static_cast<double>(x);
    }
    ctx.outputs[0]->data<T>()[0] = static_cast<T>(clip_factor(std::sqrt(sq), max_norm_));
  }

 private:
  double max_norm_;
  bool of_squares_;
};

/// A tensor's elements as a vector of T.
template <class T>
std::vector<T> elements_of(const Tensor& t) {
  auto d = t.data<T>();
  return {d.begin(), d.end()};
}

}  // namespace baton::passes::detail
