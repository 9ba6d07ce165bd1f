#pragma once
// Poisoned outputs, for the tests of the memory plan and of recomputation: every compute and
// source actor of a job fills its outputs with garbage (NaN for floats) before its kernel writes
// them, so a slot that shared bytes with one still live, or a kernel that read its output
// before writing it, hands its readers NaN.
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "baton/graph.h"
#include "baton/kernels.h"

namespace baton::test {

/// Fills a float tensor with NaN and any other with 0xA5 bytes.
inline void poison(Tensor& t) {
  if (t.dtype() == DType::f32) {
    for (float& v : t.data<float>()) v = std::numeric_limits<float>::quiet_NaN();
  } else if (t.dtype() == DType::f64) {
    for (double& v : t.data<double>()) v = std::numeric_limits<double>::quiet_NaN();
  } else {
    std::memset(t.raw(), 0xA5, t.nbytes());
  }
}

/// Runs another kernel after poisoning its outputs (those that are not also its inputs, nor the
/// kernel's own memory).
class Poisoning final : public Kernel {
 public:
  explicit Poisoning(std::unique_ptr<Kernel> inner) : inner_(std::move(inner)) {}
  void compute(KernelContext& ctx) override {
    for (std::size_t o = 0; o < ctx.outputs.size(); ++o) {
      Tensor* out = ctx.outputs[o];
      bool is_input = false;
      for (const Tensor* in : ctx.inputs) is_input = is_input || (in != nullptr && in->raw() == out->raw());
      // A kernel's own memory (a weight its optimizer updates in place) is its state, not a
      // fresh output.
      const bool owned = inner_->owned_output(o).raw() == out->raw();
      if (!is_input && !owned) poison(*out);
    }
    inner_->compute(ctx);
  }
  Tensor owned_output(std::size_t output) override { return inner_->owned_output(output); }

 private:
  std::unique_ptr<Kernel> inner_;
};

/// Every compute and source actor of the job poisons its outputs before it writes them.
inline void poison_outputs(TrainingJob& job) {
  auto base = std::make_shared<const KernelRegistry>(job.kernels);
  for (ActorDesc& a : job.plan.actors) {
    if ((a.kind != ActorKind::compute && a.kind != ActorKind::source) || a.outputs.empty()) continue;
    const std::string op = "poisoning." + a.op;
    if (!job.kernels.contains(op, a.where.device.type, a.dtype)) {
      job.kernels.add(op, a.where.device.type, a.dtype, [base, inner = a.op](const KernelConfig& cfg) {
        return std::make_unique<Poisoning>(base->create(inner, cfg));
      });
    }
    a.op = op;
  }
}

}  // namespace baton::test
