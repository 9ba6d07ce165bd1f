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

#include "../kernel_args.h"
#include "baton/kernels/kernel.h"
#include "common.h"
#include "fused.h"
#include "kernel_util.h"
#include "launch.h"

namespace baton::cuda {

namespace {

using detail::check_dtype;
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
    check_dtype(pos, DType::i32, op, "positions");
    const Shape& s = x.shape();
    if (s.size() != 3 || s[2] % 2 != 0 || pos.shape() != Shape{s[0]} || y.shape() != s) {
      throw std::invalid_argument(fmt::format("{}: x {} must be [R, H, D] with D even, positions [R] ({})", op,
                                              x.describe(), pos.describe()));
    }
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
  const Tensor& q = need_input(ctx, 0, op, "q");
  const Tensor& k = need_input(ctx, 1, op, "k");
  const Tensor& v = need_input(ctx, 2, op, "v");
  const Tensor& slots = need_input(ctx, 3, op, "slots");
  const Tensor& positions = need_input(ctx, 4, op, "positions");
  const Tensor& table = need_input(ctx, 5, op, "block_table");
  // The caches are written in place: the op's state, passed as inputs (ops_decode.cpp says why).
  auto& k_cache = const_cast<Tensor&>(need_input(ctx, 6, op, "k_cache"));
  auto& v_cache = const_cast<Tensor&>(need_input(ctx, 7, op, "v_cache"));
  Tensor& o = need_output(ctx, 0, op, "o");
  for (const auto* t : {&slots, &positions, &table}) check_dtype(*t, DType::i32, op, "an index input");
  const Shape& qs = q.shape();
  const Shape& cs = k_cache.shape();
  const std::int64_t rows = qs.size() == 3 ? qs[0] : -1;
  if (qs.size() != 3 || cs.size() != 4 || v_cache.shape() != cs || k.shape() != Shape{rows, cs[2], cs[3]} ||
      v.shape() != k.shape() || qs[2] != cs[3] || cs[2] == 0 || qs[1] % cs[2] != 0 || slots.shape() != Shape{rows} ||
      positions.shape() != Shape{rows} || table.shape().size() != 2 || o.shape() != qs) {
    throw std::invalid_argument(fmt::format(
        "{}: q {} must be [R, H, D], k {} and v {} [R, Hkv, D] with H a multiple of Hkv, slots {} and positions {} "
        "[R], block_table {} [S, M], k_cache {} and v_cache {} [blocks, block_size, Hkv, D]",
        op, q.describe(), k.describe(), v.describe(), slots.describe(), positions.describe(), table.describe(),
        k_cache.describe(), v_cache.describe()));
  }
  const long long d = cs[3], per_slot = table.shape()[1], block_size = cs[1];
  const unsigned long shared = launch::paged_attention_shared_bytes(d, per_slot, block_size);
  // 227 KB is the most a block may opt into on Hopper (and Ampere's A100: 163 KB).
  if (shared > 160 * 1024) {
    throw std::invalid_argument(fmt::format("{}: a slot of {} positions of head size {} needs {} KB of shared memory "
                                            "per block; the CUDA kernel takes at most 160 KB (about 40,000 positions)",
                                            op, per_slot * block_size, d, shared / 1024));
  }
  const double scale = scale_attr > 0 ? scale_attr : 1.0 / std::sqrt(static_cast<double>(d));
  launched(launch::paged_attention(in_data<float>(q, op, "q"), in_data<float>(k, op, "k"), in_data<float>(v, op, "v"),
                                   static_cast<const int*>(slots.raw()), static_cast<const int*>(positions.raw()),
                                   static_cast<const int*>(table.raw()), out_data<float>(k_cache, op, "k_cache"),
                                   out_data<float>(v_cache, op, "v_cache"), out_data<float>(o, op, "o"), rows, qs[1],
                                   cs[2], d, table.shape()[0], per_slot, cs[0], block_size, static_cast<float>(scale),
                                   stream_of(ctx, op)),
           op, ctx);
}

}  // namespace

void add_decode_kernels(KernelRegistry& reg) {
  constexpr auto cuda = DeviceType::cuda;
  reg.add("rope_at", cuda, DType::f32, [](const KernelConfig& cfg) {
    const double base = cfg.attrs.get_double("base", 10000.0);
    if (!(base > 0.0 && std::isfinite(base))) {
      throw std::invalid_argument(fmt::format("rope_at (actor '{}'): base must be finite and > 0, got {}", cfg.actor, base));
    }
    return std::make_unique<RopeAtKernel>(base);
  });
  reg.add("paged_attention", cuda, DType::f32, [](const KernelConfig& cfg) {
    const double scale = cfg.attrs.get_double("scale", 0.0);
    return kernel_of([scale](KernelContext& c) { paged_attention(c, scale); })(cfg);
  });
}

}  // namespace baton::cuda
