#pragma once
// Private to kernels/src/cuda (built only with BATON_HAS_CUDA): scaled-dot-product attention,
// forward and backward, by cuDNN's graph API (cuDNN 9's fused flash attention, as PyTorch's
// sdpa and Transformer Engine call it). cuDNN is loaded at run time (dlopen of libcudnn.so.9:
// the GPU machine's own library, PyTorch's included); nothing is linked, so a build and its GPU
// bundle work where there is none, and `--attention auto` then keeps the fused kernels.
//
// The layouts are baton's attention op's (baton/kernels/ops.h):
//   q, k, v, o, do   [b, h, s, d], contiguous (strides h s d, s d, d, 1); k and v [b, h_kv,
//                    s, d] with grouped-query heads (h_kv dividing h)
//   dq, dk, dv       [b, h, s, d] ([b, h_kv, s, d]) with rows `grad_ld` elements apart
//                    (strides h s ld, s ld, ld, 1): side by side in one [b, h, s, 3 d] tensor
//                    (ld 3 d, the graph's attention_grad; dk starts d elements in, dv 2 d), or
//                    tensors of their own (ld d, the plan's three outputs, and any layout with
//                    grouped-query heads)
//   stats            [b, h, s] float32: each row's log-sum-exp of scale q k^T over its unmasked
//                    keys (natural log), written by the forward and read by the backward, so
//                    the backward recomputes nothing.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace baton::cuda::cudnn {

/// "" when cuDNN can be used here (libcudnn.so.9 loaded, its version 9.0 or later, so that
/// fused attention forward and backward exist), else why not ("libcudnn.so.9 not found: ...",
/// "cuDNN 8.9.7 is older than 9.0"). Asked once per process; thread-safe.
const std::string& unavailable_reason();
/// The loaded library's version, "9.19.0" ("" when unavailable).
std::string version();

enum class Elem : std::uint8_t { bf16, f16 };
struct SdpaShape;

/// Builds the forward and backward graphs of `shape` as far as a machine without a GPU can: every
/// tensor and operation descriptor, and from cuDNN 9.8 the operation graphs (which then need no
/// handle), each finalized by cuDNN; the engines are not asked (they need the device), `sm`
/// stands in for its compute capability (90: Hopper). "" when all finalize, else cuDNN's message.
std::string check_graphs(const SdpaShape& shape, int sm);

/// One attention problem (see the layouts above). `scale` multiplies q k^T before the softmax;
/// `causal` hides key j > query i.
struct SdpaShape {
  std::int64_t b = 0, h = 0, s = 0, d = 0;
  /// Key and value heads: 0 (or h) for as many as q's, fewer (dividing h) for grouped-query
  /// heads: query head i reads kv head i / (h / h_kv).
  std::int64_t h_kv = 0;
  double scale = 1.0;
  bool causal = true;
  Elem elem = Elem::bf16;
  /// The backward's gradients' row stride in elements (0: 3 d, dq, dk and dv side by side).
  std::int64_t grad_ld = 0;
  std::int64_t kv_heads() const { return h_kv > 0 ? h_kv : h; }
  bool operator==(const SdpaShape&) const = default;
};

/// A finalized cuDNN forward graph and its execution plan for one shape, on the device current
/// when it is made (make and run it on the actor's thread, its device bound). Throws
/// std::runtime_error naming `who`, the cuDNN call and cuDNN's own message when cuDNN is
/// unavailable or supports no engine for the shape.
class SdpaForward {
 public:
  SdpaForward(const SdpaShape& shape, std::string who);
  ~SdpaForward();
  SdpaForward(const SdpaForward&) = delete;
  SdpaForward& operator=(const SdpaForward&) = delete;
  const SdpaShape& shape() const;
  /// Device memory run() needs beside its tensors.
  std::size_t workspace_bytes() const;
  /// Enqueues the forward on `stream`: o and stats from q, k, v. `workspace`: at least
  /// workspace_bytes() of device memory (null when that is 0). Throws as the constructor.
  void run(const void* q, const void* k, const void* v, void* o, float* stats, void* workspace,
           cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The backward of the same problem: dq, dk, dv (rows grad_ld apart) from q, k, v, o, do and
/// the forward's stats. cuDNN's deterministic algorithm where it has one (the same bits every
/// run, as baton's other kernels).
class SdpaBackward {
 public:
  SdpaBackward(const SdpaShape& shape, std::string who);
  ~SdpaBackward();
  SdpaBackward(const SdpaBackward&) = delete;
  SdpaBackward& operator=(const SdpaBackward&) = delete;
  const SdpaShape& shape() const;
  std::size_t workspace_bytes() const;
  void run(const void* q, const void* k, const void* v, const void* o, const void* dout, const float* stats,
           void* dq, void* dk, void* dv, void* workspace, cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::cuda::cudnn
