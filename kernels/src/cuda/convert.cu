// float32 <-> bfloat16 in device memory.
#include <cuda_bf16.h>

#include "convert.h"

namespace baton::cuda::launch {

namespace {

__global__ void f32_to_bf16(const float* x, __nv_bfloat16* y, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    y[i] = __float2bfloat16_rn(x[i]);
  }
}

__global__ void bf16_to_f32(const __nv_bfloat16* x, float* y, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    y[i] = __bfloat162float(x[i]);
  }
}

unsigned blocks_for(long long n) {
  const long long b = (n + 255) / 256;
  return static_cast<unsigned>(b < 65535 * 16 ? b : 65535 * 16);
}

}  // namespace

cudaError_t convert(const void* x, int x_kind, void* y, int y_kind, long long n, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  if (x_kind == y_kind) {
    return cudaMemcpyAsync(y, x, static_cast<size_t>(n) * (x_kind == 0 ? 4 : 2), cudaMemcpyDeviceToDevice, s);
  }
  if (x_kind == 0) {
    f32_to_bf16<<<blocks_for(n), 256, 0, s>>>(static_cast<const float*>(x), static_cast<__nv_bfloat16*>(y), n);
  } else {
    bf16_to_f32<<<blocks_for(n), 256, 0, s>>>(static_cast<const __nv_bfloat16*>(x), static_cast<float*>(y), n);
  }
  return cudaGetLastError();
}

}  // namespace baton::cuda::launch
