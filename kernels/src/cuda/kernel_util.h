#pragma once
// Private to the host files of kernels/src/cuda (ops.cpp, collectives.cpp): what the CUDA
// kernels share around their launches: the actor's stream, launch checks naming the actor,
// byte offsets into tensors, and device scratch memory kept between acts.
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "baton/kernels/kernel.h"
#include "baton/kernels/tensor.h"
#include "common.h"

namespace baton::cuda::util {

/// The actor's CUDA stream, its device made current; throws naming `op` when there is none.
inline cudaStream_t stream_of(const KernelContext& ctx, const char* op) {
  if (ctx.stream == nullptr) {
    throw std::invalid_argument(fmt::format("{}: a CUDA kernel ran without a CUDA stream (is its actor on a cuda device?)", op));
  }
  ctx.stream->bind();
  return ctx.stream->impl().stream;
}

/// The cuBLAS data type of an f32 or bf16 tensor's elements (the products' two dtypes).
inline cudaDataType_t blas_type(DType t) { return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

/// Checks a launcher's result, naming `op` and the actor.
inline void launched(cudaError_t e, const char* op, const KernelContext& ctx) {
  check(e, op, ctx.stream->owner());
}

/// Throws naming `op` and both tensors when their dtypes differ.
inline void check_same_dtype(const Tensor& a, const Tensor& b, const char* op) {
  if (a.dtype() != b.dtype()) throw std::invalid_argument(fmt::format("{}: {} and {} differ in dtype", op, a.describe(), b.describe()));
}

/// The address of element `elems` of `t` (any dtype), for launchers that take bytes.
inline const char* at_elem(const Tensor& t, std::int64_t elems) {
  return static_cast<const char*>(t.raw()) + elems * static_cast<std::int64_t>(size_of(t.dtype()));
}
inline char* at_elem(Tensor& t, std::int64_t elems) {
  return static_cast<char*>(t.raw()) + elems * static_cast<std::int64_t>(size_of(t.dtype()));
}

/// Device memory a kernel keeps between acts (a reduction's parts, a sort's buffers, a staged
/// input), on its actor's device: get() grows it on demand (call it after stream_of, which
/// makes the device current), the destructor frees it. Work on the actor's one stream is
/// ordered, so the next act cannot overwrite it while the last one still reads it.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { release(); }
  void* get(std::size_t bytes, const KernelContext& ctx) {
    if (bytes > capacity_) {
      if (p_ != nullptr) check(cudaFree(p_), "cudaFree", ctx.stream->owner());
      count_device_bytes(device_, -static_cast<std::int64_t>(capacity_));
      p_ = nullptr;
      capacity_ = 0;
      check(cudaGetDevice(&device_), "cudaGetDevice", ctx.stream->owner());
      check(cudaMalloc(&p_, bytes), "cudaMalloc", ctx.stream->owner());
      capacity_ = bytes;
      count_device_bytes(device_, static_cast<std::int64_t>(capacity_));  // cuda::device_memory
    }
    return p_;
  }
  /// Gives the memory back now (the destructor does too).
  void release() noexcept {
    if (p_ != nullptr) cudaFree(p_);
    count_device_bytes(device_, -static_cast<std::int64_t>(capacity_));
    p_ = nullptr;
    capacity_ = 0;
  }

 private:
  void* p_ = nullptr;
  std::size_t capacity_ = 0;
  int device_ = 0;
};

}  // namespace baton::cuda::util
