#pragma once
// Private to kernels/src/cuda: element-wise conversion between float32 and bfloat16 in device
// memory (convert.cu), for baton::cuda::convert.
#include <cuda_runtime.h>

namespace baton::cuda::launch {

/// 0: float32, 1: bfloat16 (raw 16-bit storage). y[i] = x[i] converted, rounding to nearest
/// even into bfloat16; n elements.
cudaError_t convert(const void* x, int x_kind, void* y, int y_kind, long long n, cudaStream_t s);

}  // namespace baton::cuda::launch
