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

/// The clipping factor of a step (inputs[1]: one scalar, made on the host from every gradient's
/// norm and copied to the device), read back so that a step with nothing to clip skips the
/// scaling, as the CPU does (which also keeps the two bit for bit); 1 without clipping.
float clip_factor(const KernelContext& ctx, std::size_t input, cuda::Stream& s) {
  if (ctx.inputs.size() <= input || ctx.inputs[input] == nullptr) return 1.0f;
  Tensor factor = Tensor::empty({1}, DType::f32);
  cuda::copy(factor, *ctx.inputs[input], s);
  s.synchronize();
  return factor.data<float>()[0];
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
      emit_initial(out, s);
    }
  }

  // What CudaVariableGroup drives: the same steps, the update itself one launch for all.
  void prepare(cuda::Stream& s) {
    if (!ready_) upload(s);
  }
  void emit_initial(Tensor& out, cuda::Stream& s) { cuda::convert(out, master_, s); }
  /// This weight's part of a multi-tensor step that reads gradient `g` and writes `out`.
  cuda::AdamSlice adam_slice(const Tensor& g, Tensor& out) {
    return {master_.data<float>().data(), g.data<float>().data(), m_.data<float>().data(), v_.data<float>().data(),
            master_.numel(), &out};
  }
  cuda::SgdSlice sgd_slice(const Tensor& g, Tensor& out) {
    return {master_.data<float>().data(), g.data<float>().data(), m_.defined() ? m_.data<float>().data() : nullptr,
            master_.numel(), &out};
  }
  /// After step `step`'s update is enqueued: the trained value back to the host after the
  /// last step, the state to the checkpoint writer at checkpoint steps.
  void after_step(std::int64_t step, cuda::Stream& s) {
    if (step == total_steps_) {
      // The trained value goes back to the ParameterStore (the CPU variable trains it in place).
      cuda::copy(host_, master_, s);
      s.synchronize();
    }
    if (snapshots_.hand_over && snapshots_.every > 0 && (step % snapshots_.every == 0 || step == total_steps_)) {
      hand_over(step, s);
    }
  }
  const OptimizerConfig& optimizer() const { return cfg_; }
  std::int64_t total_steps() const { return total_steps_; }

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
    if (const float f = clip_factor(ctx, 1, s); f != 1.0f) {
      if (!scaled_.defined()) scaled_ = Tensor::empty(host_.shape(), host_.dtype(), *alloc_);
      cuda::copy(scaled_, g_in, s);
      cuda::scale(scaled_.data<float>().data(), scaled_.numel(), f, s);
      g = scaled_.data<float>().data();
    }
    const double lr = learning_rate(cfg_, step, total_steps_);
    float* w = master_.data<float>().data();
    const std::int64_t n = master_.numel();
    if (cfg_.kind == OptimizerConfig::Kind::sgd) {
      cuda::sgd_step(w, g, m_.defined() ? m_.data<float>().data() : nullptr, n, sgd_config_of(cfg_), step, lr, s, &out);
    } else {
      cuda::adam_step(w, g, m_.data<float>().data(), v_.data<float>().data(), n, adam_config_of(cfg_), step, lr, s,
                      &out);
    }
    after_step(step, s);
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

/// A CUDA device's trained weights stepped together (the updates pass): each member keeps its
/// weight and slots as a CudaVariable does, and a step is one multi-tensor launch (a few for
/// many weights) instead of one per weight, with the clipping factor read back once instead of
/// once per weight and applied inside the step instead of by a scaled copy of each gradient.
/// Every element's arithmetic is adam_step's (sgd_step's), so the weights are the per-weight
/// actors' bit for bit.
class CudaVariableGroup final : public Kernel {
 public:
  CudaVariableGroup(std::string actor, std::vector<std::unique_ptr<Kernel>> owned, std::vector<CudaVariable*> members,
                    bool clip)
      : actor_(std::move(actor)), owned_(std::move(owned)), members_(std::move(members)), clip_(clip) {}

  void compute(KernelContext& ctx) override {
    cuda::Stream& s = stream_of(ctx, actor_);
    const std::size_t n = members_.size();
    for (CudaVariable* m : members_) m->prepare(s);
    if (ctx.inputs.empty() || ctx.inputs[0] == nullptr) {
      for (std::size_t i = 0; i < n; ++i) members_[i]->emit_initial(*ctx.outputs[i], s);
      return;
    }
    const std::int64_t step = ctx.piece;
    const float f = clip_ ? clip_factor(ctx, n, s) : 1.0f;
    const OptimizerConfig& oc = members_[0]->optimizer();
    const double lr = learning_rate(oc, step, members_[0]->total_steps());
    if (oc.kind == OptimizerConfig::Kind::sgd) {
      sgd_.clear();
      for (std::size_t i = 0; i < n; ++i) sgd_.push_back(members_[i]->sgd_slice(*ctx.inputs[i], *ctx.outputs[i]));
      cuda::sgd_step_multi(sgd_, sgd_config_of(oc), step, lr, s, f);
    } else {
      adam_.clear();
      for (std::size_t i = 0; i < n; ++i) adam_.push_back(members_[i]->adam_slice(*ctx.inputs[i], *ctx.outputs[i]));
      cuda::adam_step_multi(adam_, adam_config_of(oc), step, lr, s, f);
    }
    for (CudaVariable* m : members_) m->after_step(step, s);
  }

 private:
  std::string actor_;
  std::vector<std::unique_ptr<Kernel>> owned_;
  std::vector<CudaVariable*> members_;  // into owned_
  bool clip_;
  std::vector<cuda::AdamSlice> adam_;
  std::vector<cuda::SgdSlice> sgd_;
};

/// The same group anywhere else (a sim device: the CPU's variable kernels on its stream), or a
/// CUDA group whose members are not all CudaVariables: each member's own act in turn, on the
/// member's inputs and output.
class VariableGroup final : public Kernel {
 public:
  VariableGroup(std::vector<std::unique_ptr<Kernel>> members, std::vector<std::size_t> parts, bool clip)
      : members_(std::move(members)), parts_(std::move(parts)), clip_(clip) {}

  void compute(KernelContext& ctx) override {
    const Tensor* clip = clip_ ? ctx.inputs.back() : nullptr;
    std::size_t at = 0;
    for (std::size_t i = 0; i < members_.size(); ++i) {
      ins_.clear();
      for (std::size_t p = 0; p < parts_[i]; ++p) ins_.push_back(ctx.inputs[at++]);
      if (clip_) ins_.push_back(clip);
      Tensor* out = ctx.outputs[i];
      KernelContext sub{.inputs = ins_,
                        .outputs = std::span<Tensor* const>(&out, 1),
                        .piece = ctx.piece,
                        .stream = ctx.stream,
                        .async_stream = ctx.async_stream};
      members_[i]->compute(sub);
    }
  }

 private:
  std::vector<std::unique_ptr<Kernel>> members_;
  std::vector<std::size_t> parts_;
  bool clip_;
  std::vector<const Tensor*> ins_;
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

KernelFactory variable_group(std::shared_ptr<const KernelRegistry> kernels, std::vector<GroupMember> members,
                             bool clip) {
  return [kernels = std::move(kernels), members = std::move(members), clip](const KernelConfig& kc) -> std::unique_ptr<Kernel> {
    std::vector<std::unique_ptr<Kernel>> made;
    std::vector<CudaVariable*> cuda_members;
    std::vector<std::size_t> parts;
    for (const GroupMember& m : members) {
      made.push_back(kernels->create(m.op, KernelConfig{m.actor, kc.device, kc.dtype, kc.attrs, kc.services}));
      if (auto* v = dynamic_cast<CudaVariable*>(made.back().get()); v != nullptr && m.parts == 1) {
        cuda_members.push_back(v);
      }
      parts.push_back(m.parts);
    }
    if (kc.device.type == DeviceType::cuda && cuda_members.size() == made.size()) {
      return std::make_unique<CudaVariableGroup>(std::string(kc.actor), std::move(made), std::move(cuda_members), clip);
    }
    return std::make_unique<VariableGroup>(std::move(made), std::move(parts), clip);
  };
}

KernelFactory cuda_constant(Tensor value) {
  return [value](const KernelConfig& kc) -> std::unique_ptr<Kernel> {
    return std::make_unique<CudaConstant>(kc.device, value);
  };
}

}  // namespace baton::detail
