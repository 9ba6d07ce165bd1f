#pragma once
// Private to kernels/src/cuda (built only with BATON_HAS_CUDA): the handles behind
// baton::cuda::Stream and the error checks every CUDA call goes through.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "baton/kernels/cuda.h"
#include "launch.h"

namespace baton::cuda {

struct Stream::Impl {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  // While the owner captures the stream's work (begin_capture .. end_capture), no other thread
  // may query it: cudaStreamQuery on a capturing stream fails and invalidates the capture. The
  // runtime's watch polls failure() and idle() from its own thread, so both take this lock and
  // answer without a query while `capturing`.
  mutable std::mutex capture_mutex;
  bool capturing = false;
};

/// Throws std::runtime_error "<who>: <call> failed: <name> (<code>): <description>".
inline void check(cudaError_t e, const char* call, std::string_view who) {
  if (e != cudaSuccess) {
    throw std::runtime_error(fmt::format("{}: {} failed: {} ({}): {}", who, call, cudaGetErrorName(e),
                                         static_cast<int>(e), cudaGetErrorString(e)));
  }
}
inline void check(cublasStatus_t s, const char* call, std::string_view who) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(fmt::format("{}: {} failed: {} ({})", who, call, cublasGetStatusName(s),
                                         static_cast<int>(s)));
  }
}

/// Adds `bytes` (negative: gives them back) to what cuda::device_memory reports held and
/// reserved on device `index`, for device memory a kernel obtains from cudaMalloc itself
/// (util::Scratch) rather than through make_device_allocator (device.cpp).
void count_device_bytes(int index, std::int64_t bytes) noexcept;

/// Where an optimizer step also writes the new weights (`copy`, may be null): checked to be f32
/// or bf16 of n elements, else std::invalid_argument naming the stream's owner (ops.cpp).
launch::WeightCopy weight_copy(Tensor* copy, std::int64_t n, const Stream& stream);

}  // namespace baton::cuda

/// Checks a CUDA or cuBLAS call, naming it and `who` (the actor or owner) on failure.
#define BATON_CUDA_CHECK(call, who) ::baton::cuda::check((call), #call, (who))
