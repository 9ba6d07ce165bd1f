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

// Four elements a thread, in 16-byte float loads and 8-byte bf16 stores (or the reverse): a
// thread per 2-byte element left the memory system half idle. For 16-byte aligned pointers and
// n a multiple of 4 (the launcher checks); the rounding is the scalar kernels'.
__global__ void f32_to_bf16_x4(const float4* x, uint2* y, long long n4) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float4 v = x[i];
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 out;
    out.x = *reinterpret_cast<unsigned*>(&lo);
    out.y = *reinterpret_cast<unsigned*>(&hi);
    y[i] = out;
  }
}

__global__ void bf16_to_f32_x4(const uint2* x, float4* y, long long n4) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const uint2 v = x[i];
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&v.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&v.y);
    const float2 a = __bfloat1622float2(lo), b = __bfloat1622float2(hi);
    y[i] = make_float4(a.x, a.y, b.x, b.y);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<unsigned long long>(p) % 16 == 0; }

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
  if (n % 4 == 0 && aligned16(x) && aligned16(y)) {
    if (x_kind == 0) {
      f32_to_bf16_x4<<<blocks_for(n / 4), 256, 0, s>>>(static_cast<const float4*>(x), static_cast<uint2*>(y), n / 4);
    } else {
      bf16_to_f32_x4<<<blocks_for(n / 4), 256, 0, s>>>(static_cast<const uint2*>(x), static_cast<float4*>(y), n / 4);
    }
    return cudaGetLastError();
  }
  if (x_kind == 0) {
    f32_to_bf16<<<blocks_for(n), 256, 0, s>>>(static_cast<const float*>(x), static_cast<__nv_bfloat16*>(y), n);
  } else {
    bf16_to_f32<<<blocks_for(n), 256, 0, s>>>(static_cast<const __nv_bfloat16*>(x), static_cast<float*>(y), n);
  }
  return cudaGetLastError();
}

}  // namespace baton::cuda::launch
