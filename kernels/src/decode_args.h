#pragma once
// Private to kernels/src: what the decode ops' CPU kernels (ops_decode.cpp) and CUDA kernels
// (cuda/decode.cpp) check alike before they compute, in the same words (defined in
// ops_decode.cpp).
#include <cstdint>

#include "baton/kernels/kernel.h"

namespace baton::detail {

/// rope_at's attribute `base` (10000 by default); throws naming the actor unless finite and > 0.
double rope_at_base(const KernelConfig& cfg);
/// x [R, H, D] with D even, positions i32 [R], y as x; throws naming them otherwise.
void check_rope_at(const Tensor& x, const Tensor& positions, const Tensor& y);

/// paged_attention's inputs and output (ops.h says what each is), checked: shapes, i32 index
/// inputs, H a multiple of Hkv. The caches are written in place (the op's state).
struct PagedAttentionArgs {
  const Tensor* q = nullptr;
  const Tensor* k = nullptr;
  const Tensor* v = nullptr;
  const Tensor* slots = nullptr;
  const Tensor* positions = nullptr;
  const Tensor* table = nullptr;
  Tensor* k_cache = nullptr;
  Tensor* v_cache = nullptr;
  Tensor* o = nullptr;
  std::int64_t rows = 0, heads = 0, kv_heads = 0, d = 0;
  std::int64_t blocks = 0, block_size = 0, n_slots = 0, per_slot = 0;
  /// The scores' scale: the attribute where > 0, else 1 / sqrt(d).
  double scale = 0;
};
PagedAttentionArgs paged_attention_args(KernelContext& ctx, double scale_attr);

}  // namespace baton::detail
