// bfloat16 on every device without a bf16 kernel per op: an op asked for in bf16 runs its
// float32 kernel on float32 copies of its bf16 inputs and rounds its outputs once, as
// torch's bf16 CPU ops and autocast do in effect (compute in float32, store in bf16). A device
// may still register a real bf16 kernel for an op (a tensor-core matrix product), which then
// wins. Also the "cast" kernels between the float dtypes, which autocast (graph.h) inserts.
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels/cuda.h"
#include "baton/kernels/kernel.h"
#include "kernel_args.h"

namespace baton::detail {

namespace {

template <class From, class To>
To convert_one(From x) {
  if constexpr (std::is_same_v<From, To>) {
    return x;
  } else if constexpr (std::is_same_v<From, bfloat16>) {
    return static_cast<To>(to_float(x));
  } else if constexpr (std::is_same_v<To, bfloat16>) {
    return to_bf16(static_cast<float>(x));
  } else {
    return static_cast<To>(x);
  }
}

template <class From, class To>
void convert_span(const Tensor& src, Tensor& dst) {
  auto in = src.data<From>();
  auto out = dst.data<To>();
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = convert_one<From, To>(in[i]);
}

template <class From>
void convert_from(const Tensor& src, Tensor& dst) {
  switch (dst.dtype()) {
    case DType::f32: return convert_span<From, float>(src, dst);
    case DType::f64: return convert_span<From, double>(src, dst);
    case DType::bf16: return convert_span<From, bfloat16>(src, dst);
    default: break;
  }
  throw std::invalid_argument(fmt::format("cast from {} into {}: only between f32, f64 and bf16", src.describe(),
                                          dst.describe()));
}

}  // namespace

void convert_on_host(const Tensor& src, Tensor& dst) {
  if (src.numel() != dst.numel()) {
    throw std::invalid_argument(fmt::format("cast of {} into {}: sizes differ", src.describe(), dst.describe()));
  }
  switch (src.dtype()) {
    case DType::f32: return convert_from<float>(src, dst);
    case DType::f64: return convert_from<double>(src, dst);
    case DType::bf16: return convert_from<bfloat16>(src, dst);
    default: break;
  }
  throw std::invalid_argument(fmt::format("cast from {} into {}: only between f32, f64 and bf16", src.describe(),
                                          dst.describe()));
}

namespace {

void convert(const Tensor& src, Tensor& dst, const KernelContext& ctx) {
  if (ctx.stream != nullptr) {
    cuda::convert(dst, src, *ctx.stream);
  } else {
    convert_on_host(src, dst);
  }
}

/// The float32 kernel of an op, on float32 copies of the bf16 tensors. The copies are made once
/// per actor (its shapes do not change) on its device.
class ViaFloat32 final : public Kernel {
 public:
  ViaFloat32(std::unique_ptr<Kernel> inner, Device device) : inner_(std::move(inner)), device_(device) {}

  void compute(KernelContext& ctx) override {
    ins_.assign(ctx.inputs.begin(), ctx.inputs.end());
    outs_.assign(ctx.outputs.begin(), ctx.outputs.end());
    // Sized first: ins_ and outs_ point into them.
    in_scratch_.resize(std::max(in_scratch_.size(), ins_.size()));
    out_scratch_.resize(std::max(out_scratch_.size(), outs_.size()));
    for (std::size_t i = 0; i < ins_.size(); ++i) {
      if (ins_[i] == nullptr || ins_[i]->dtype() != DType::bf16) continue;
      Tensor& wide = scratch(in_scratch_, i, *ins_[i]);
      convert(*ins_[i], wide, ctx);
      ins_[i] = &wide;
    }
    for (std::size_t i = 0; i < outs_.size(); ++i) {
      if (outs_[i] == nullptr || outs_[i]->dtype() != DType::bf16) continue;
      outs_[i] = &scratch(out_scratch_, i, *outs_[i]);
    }
    KernelContext wide{ins_, outs_, ctx.piece, ctx.stream};
    inner_->compute(wide);
    for (std::size_t i = 0; i < outs_.size(); ++i) {
      if (outs_[i] != ctx.outputs[i]) convert(*outs_[i], *ctx.outputs[i], ctx);
    }
  }

 private:
  Tensor& scratch(std::vector<Tensor>& pool, std::size_t i, const Tensor& like) {
    Tensor& t = pool.at(i);
    if (!t.defined() || t.shape() != like.shape()) {
      if (device_.type == DeviceType::cuda) {
        if (!memory_) memory_ = cuda::make_device_allocator(device_);
        t = Tensor::empty(like.shape(), DType::f32, *memory_);
      } else {
        t = Tensor::empty(like.shape(), DType::f32);
      }
    }
    return t;
  }

  std::unique_ptr<Kernel> inner_;
  Device device_;
  std::unique_ptr<Allocator> memory_;  // declared before the tensors it backs
  std::vector<Tensor> in_scratch_, out_scratch_;
  std::vector<const Tensor*> ins_;
  std::vector<Tensor*> outs_;
};

}  // namespace

std::unique_ptr<Kernel> via_float32(std::unique_ptr<Kernel> inner, Device device) {
  return std::make_unique<ViaFloat32>(std::move(inner), device);
}

void add_cast_kernels(KernelRegistry& reg) {
  for (DType to : {DType::f32, DType::f64, DType::bf16}) {
    reg.add_fn("cast", DeviceType::cpu, to, [](KernelContext& ctx) {
      convert_on_host(need_input(ctx, 0, "cast"), need_output(ctx, 0, "cast"));
    });
    if (cuda::built_with_cuda() && to != DType::f64) {
      reg.add_fn("cast", DeviceType::cuda, to, [](KernelContext& ctx) {
        if (ctx.stream == nullptr) throw std::logic_error("cast on a CUDA device without its stream");
        cuda::convert(need_output(ctx, 0, "cast"), need_input(ctx, 0, "cast"), *ctx.stream);
      });
    }
  }
}

}  // namespace baton::detail
