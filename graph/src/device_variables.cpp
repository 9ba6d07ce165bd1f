// Variable actors on a CUDA device. The optimizer's state never leaves the device during the
// job: a step reads the summed gradient where the accumulate actor left it (device memory) and
// updates the master copy in place, so a step costs no host round trip. Only the clipping factor
// (one scalar, made on the host) and the checkpoint and final copies cross.
#include "device_variables.h"

#include <memory>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "baton/graph/graph.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/optim.h"

namespace baton::detail {

namespace {

cuda::Stream& stream_of(const KernelContext& ctx, const std::string& who) {
  if (ctx.stream == nullptr) {
    throw std::logic_error(fmt::format("{}: a CUDA variable kernel ran without a CUDA stream", who));
  }
  return *ctx.stream;
}

class CudaVariable final : public Kernel {
 public:
  CudaVariable(std::string actor, Device device, Tensor host, OptimizerConfig cfg, std::int64_t total_steps,
               const std::map<std::string, Tensor>* slots, SnapshotHook snapshots)
      : actor_(std::move(actor)), device_(device), host_(std::move(host)), cfg_(cfg), total_steps_(total_steps),
        slots_(slots), snapshots_(std::move(snapshots)) {}

  void compute(KernelContext& ctx) override {
    cuda::Stream& s = stream_of(ctx, actor_);
    if (!ready_) upload(s);
    // The output is the master's copy its readers take: f32, or bf16 when the plan fused the
    // readers' casts into this actor (TrainConfig::fuse_weight_casts). A step writes it in its
    // own pass; the initial value is converted.
    Tensor& out = *ctx.outputs[0];
    if (!ctx.inputs.empty() && ctx.inputs[0] != nullptr) {
      update(ctx, s, out);
    } else {
      cuda::convert(out, master_, s);
    }
  }

 private:
  void upload(cuda::Stream& s) {
    alloc_ = cuda::make_device_allocator(device_);
    names_ = optimizer_slot_names(cfg_);
    master_ = Tensor::empty(host_.shape(), host_.dtype(), *alloc_);
    cuda::copy(master_, host_, s);
    const bool momentum = cfg_.kind != OptimizerConfig::Kind::sgd || cfg_.momentum != 0.0;
    if (momentum) {
      m_ = Tensor::empty(host_.shape(), host_.dtype(), *alloc_);
      if (cfg_.kind != OptimizerConfig::Kind::sgd) v_ = Tensor::empty(host_.shape(), host_.dtype(), *alloc_);
      // Zeros (a fresh start) or the saved slots (a resumed job; compile_training checked them).
      Tensor zeros = Tensor::zeros(host_.shape(), host_.dtype());
      for (std::size_t i = 0; i < names_.size(); ++i) {
        cuda::copy(i == 0 ? m_ : v_, slots_ != nullptr ? slots_->at(names_[i]) : zeros, s);
      }
      // The copies read host memory that this act may free (zeros): wait for them once.
      s.synchronize();
    }
    ready_ = true;
  }

  void update(KernelContext& ctx, cuda::Stream& s, Tensor& out) {
    const std::int64_t step = ctx.piece;  // 1-based: act k applies the k-th update
    const Tensor& g_in = *ctx.inputs[0];
    const float* g = g_in.data<float>().data();
    if (ctx.inputs.size() > 1 && ctx.inputs[1] != nullptr) {
      // The clipping factor: one scalar, made on the host from every gradient's norm and
      // copied here; read back to skip the scaling when there is nothing to clip, as the CPU
      // does (which also keeps the two bit for bit).
      Tensor factor = Tensor::empty({1}, DType::f32);
      cuda::copy(factor, *ctx.inputs[1], s);
      s.synchronize();
      const float f = factor.data<float>()[0];
      if (f != 1.0f) {
        if (!scaled_.defined()) scaled_ = Tensor::empty(host_.shape(), host_.dtype(), *alloc_);
        cuda::copy(scaled_, g_in, s);
        cuda::scale(scaled_.data<float>().data(), scaled_.numel(), f, s);
        g = scaled_.data<float>().data();
      }
    }
    const double lr = learning_rate(cfg_, step, total_steps_);
    float* w = master_.data<float>().data();
    const std::int64_t n = master_.numel();
    if (cfg_.kind == OptimizerConfig::Kind::sgd) {
      SgdConfig c{cfg_.lr, cfg_.momentum, cfg_.weight_decay, cfg_.nesterov};
      cuda::sgd_step(w, g, m_.defined() ? m_.data<float>().data() : nullptr, n, c, step, lr, s, &out);
    } else {
      AdamConfig c{cfg_.lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, cfg_.kind == OptimizerConfig::Kind::adamw};
      cuda::adam_step(w, g, m_.data<float>().data(), v_.data<float>().data(), n, c, step, lr, s, &out);
    }
    if (step == total_steps_) {
      // The trained value goes back to the ParameterStore (the CPU variable trains it in place).
      cuda::copy(host_, master_, s);
      s.synchronize();
    }
    if (snapshots_.hand_over && snapshots_.every > 0 && (step % snapshots_.every == 0 || step == total_steps_)) {
      hand_over(step, s);
    }
  }

  void hand_over(std::int64_t step, cuda::Stream& s) {
    auto to_host = [&](const Tensor& from) {
      Tensor t = Tensor::empty(from.shape(), from.dtype());
      cuda::copy(t, from, s);
      return t;
    };
    VariableSnapshot snap{.name = snapshots_.name, .step = step, .weight = to_host(master_)};
    for (std::size_t i = 0; i < names_.size(); ++i) snap.slots[names_[i]] = to_host(i == 0 ? m_ : v_);
    s.synchronize();  // the copies are in host memory before the writer sees them
    snapshots_.hand_over(std::move(snap));
  }

  std::string actor_;
  Device device_;
  Tensor host_;
  OptimizerConfig cfg_;
  std::int64_t total_steps_;
  const std::map<std::string, Tensor>* slots_;
  SnapshotHook snapshots_;
  std::vector<std::string> names_;
  bool ready_ = false;
  // The allocator outlives the tensors it made (members are destroyed in reverse order).
  std::unique_ptr<Allocator> alloc_;
  Tensor master_, m_, v_, scaled_;
};

class CudaConstant final : public Kernel {
 public:
  CudaConstant(Device device, Tensor value) : device_(device), host_(std::move(value)) {}
  void compute(KernelContext& ctx) override {
    cuda::Stream& s = stream_of(ctx, "constant");
    if (!value_.defined()) {
      alloc_ = cuda::make_device_allocator(device_);
      value_ = Tensor::empty(host_.shape(), host_.dtype(), *alloc_);
      cuda::copy(value_, host_, s);
    }
    cuda::copy(*ctx.outputs[0], value_, s);
  }

 private:
  Device device_;
  Tensor host_;
  std::unique_ptr<Allocator> alloc_;
  Tensor value_;
};

}  // namespace

KernelFactory cuda_variable(Tensor host, const OptimizerConfig& cfg, std::int64_t total_steps,
                            const std::map<std::string, Tensor>* slots, SnapshotHook snapshots) {
  if (host.dtype() != DType::f32) {
    throw GraphError(fmt::format("variable '{}' is {}: a weight trained on a CUDA device must be f32 (the CUDA "
                                 "optimizer steps are float32)",
                                 snapshots.name, name(host.dtype())));
  }
  return [host, cfg, total_steps, slots, snapshots](const KernelConfig& kc) -> std::unique_ptr<Kernel> {
    return std::make_unique<CudaVariable>(std::string(kc.actor), kc.device, host, cfg, total_steps, slots, snapshots);
  };
}

KernelFactory cuda_constant(Tensor value) {
  return [value](const KernelConfig& kc) -> std::unique_ptr<Kernel> {
    return std::make_unique<CudaConstant>(kc.device, value);
  };
}

}  // namespace baton::detail
