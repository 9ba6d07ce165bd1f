// Serving's decode ops on CUDA devices (launchers in decode.cu): rope_at and paged_attention,
// f32 (bf16 through float32 copies, as KernelRegistry::create falls back). Shapes and dtypes are
// checked on the host, in the CPU kernels' words (ops_decode.cpp), before anything is enqueued;
// what only the device sees (a slot, position or block outside the table or the cache) makes
// that row's output NaN instead of the CPU's exception.
#include <cmath>
#include <memory>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "../decode_args.h"
#include "../kernel_args.h"
#include "baton/kernels/kernel.h"
#include "common.h"
#include "fused.h"
#include "kernel_util.h"
#include "launch.h"

namespace baton::cuda {

namespace {

using detail::in_data;
using detail::need_input;
using detail::need_output;
using detail::out_data;
using util::launched;
using util::Scratch;
using util::stream_of;

/// The inverse frequencies as the CPU's RopeAtKernel makes them (in float), copied to the
/// device once per head size.
class RopeAtKernel final : public Kernel {
 public:
  explicit RopeAtKernel(double base) : base_(static_cast<float>(base)) {}
  void compute(KernelContext& ctx) override {
    const char* op = "rope_at";
    const Tensor& x = need_input(ctx, 0, op, "x");
    const Tensor& pos = need_input(ctx, 1, op, "positions");
    Tensor& y = need_output(ctx, 0, op, "y");
    baton::detail::check_rope_at(x, pos, y);
    const Shape& s = x.shape();
    const long long half = s[2] / 2;
    cudaStream_t stream = stream_of(ctx, op);
    auto* inv = static_cast<float*>(scratch_.get(static_cast<std::size_t>(std::max(half, 1LL)) * sizeof(float), ctx));
    if (half != table_half_) {
      host_.resize(static_cast<std::size_t>(half));
      const auto d = static_cast<float>(s[2]);
      for (long long i = 0; i < half; ++i) host_[static_cast<std::size_t>(i)] = 1.f / std::pow(base_, static_cast<float>(2 * i) / d);
      check(cudaMemcpyAsync(inv, host_.data(), host_.size() * sizeof(float), cudaMemcpyHostToDevice, stream), op,
            ctx.stream->owner());
      table_half_ = half;
    }
    launched(launch::rope_at(in_data<float>(x, op, "x"), static_cast<const int*>(pos.raw()), inv,
                             out_data<float>(y, op, "y"), s[0], s[1], half, stream),
             op, ctx);
  }

 private:
  float base_;
  std::vector<float> host_;  // kept while the copy may read it
  long long table_half_ = -1;
  Scratch scratch_;
};

void paged_attention(KernelContext& ctx, double scale_attr) {
  const char* op = "paged_attention";
  const baton::detail::PagedAttentionArgs a = baton::detail::paged_attention_args(ctx, scale_attr);
  const unsigned long shared = launch::paged_attention_shared_bytes(a.d, a.per_slot, a.block_size);
  // 227 KB is the most a block may opt into on Hopper (and Ampere's A100: 163 KB).
  if (shared > 160 * 1024) {
    throw std::invalid_argument(fmt::format("{}: a slot of {} positions of head size {} needs {} KB of shared memory "
                                            "per block; the CUDA kernel takes at most 160 KB (about 40,000 positions)",
                                            op, a.per_slot * a.block_size, a.d, shared / 1024));
  }
  launched(launch::paged_attention(in_data<float>(*a.q, op, "q"), in_data<float>(*a.k, op, "k"),
                                   in_data<float>(*a.v, op, "v"), static_cast<const int*>(a.slots->raw()),
                                   static_cast<const int*>(a.positions->raw()), static_cast<const int*>(a.table->raw()),
                                   out_data<float>(*a.k_cache, op, "k_cache"), out_data<float>(*a.v_cache, op, "v_cache"),
                                   out_data<float>(*a.o, op, "o"), a.rows, a.heads, a.kv_heads, a.d, a.n_slots,
                                   a.per_slot, a.blocks, a.block_size, static_cast<float>(a.scale), stream_of(ctx, op)),
           op, ctx);
}

}  // namespace

void add_decode_kernels(KernelRegistry& reg) {
  constexpr auto cuda = DeviceType::cuda;
  reg.add("rope_at", cuda, DType::f32,
          [](const KernelConfig& cfg) { return std::make_unique<RopeAtKernel>(baton::detail::rope_at_base(cfg)); });
  reg.add("paged_attention", cuda, DType::f32, [](const KernelConfig& cfg) {
    const double scale = cfg.attrs.get_double("scale", 0.0);
    return kernel_of([scale](KernelContext& c) { paged_attention(c, scale); })(cfg);
  });
}

}  // namespace baton::cuda
