#pragma once
// Private to the .cu files of kernels/src/cuda: loads and stores of the element types one kernel
// template serves (float32, float64, and bfloat16 computed in float32), so that a bf16 kernel is
// its float32 twin with a different load and store: loaded exactly, stored rounded to nearest
// even once (a double result goes through float first, as the float32 kernel's output would on
// its way to bf16 in KernelRegistry's fallback: the same bits).
#include <cuda_bf16.h>

#include "launch.h"

namespace baton::cuda::launch::elem {

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ double load(const double* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

/// A double result into the element type: rounded to float first (bf16 too, see above).
__device__ __forceinline__ void store_d(float* p, double v) { *p = static_cast<float>(v); }
__device__ __forceinline__ void store_d(double* p, double v) { *p = v; }
__device__ __forceinline__ void store_d(__nv_bfloat16* p, double v) { *p = __float2bfloat16_rn(static_cast<float>(v)); }

/// The device type behind launch.h's Bf16; float and double pass through.
inline const __nv_bfloat16* dev(const Bf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
inline __nv_bfloat16* dev(Bf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
inline const float* dev(const float* p) { return p; }
inline float* dev(float* p) { return p; }
inline const double* dev(const double* p) { return p; }
inline double* dev(double* p) { return p; }

static_assert(sizeof(Bf16) == sizeof(__nv_bfloat16), "Bf16 is bfloat16's 16-bit storage");

}  // namespace baton::cuda::launch::elem
