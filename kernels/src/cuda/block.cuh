#pragma once
// Private to the .cu files of kernels/src/cuda: what several of them need on the device (a
// block-wide reduction in double, NaN-propagating maximum, strided index offsets) and the
// grid size of a grid-stride loop.
#include <cuda_runtime.h>

#include "launch.h"

namespace baton::cuda::launch::block {

/// The larger of two values, or NaN if either is: the CPU's nan_max (torch.maximum, torch.amax).
__device__ inline double nan_max(double a, double b) { return !isnan(a) && (b > a || isnan(b)) ? b : a; }

struct Sum {
  __device__ double operator()(double a, double b) const { return a + b; }
};
struct Max {
  __device__ double operator()(double a, double b) const { return nan_max(a, b); }
};

/// Combines every thread's `v` with `op` (a tree, so the order is fixed for a block size) and
/// gives every thread the result. Every thread of the block must call it (it synchronises);
/// blockDim.x a power of two; `scratch` holds blockDim.x doubles in shared memory.
template <class Op>
__device__ double reduce(double v, double* scratch, Op op) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int step = static_cast<int>(blockDim.x) / 2; step > 0; step /= 2) {
    if (static_cast<int>(threadIdx.x) < step) scratch[threadIdx.x] = op(scratch[threadIdx.x], scratch[threadIdx.x + step]);
    __syncthreads();
  }
  const double r = scratch[0];
  __syncthreads();  // scratch may be reused straight away
  return r;
}

/// Element i of ix's index space (row-major over ix.shape) as an offset through the strides ix.a.
__device__ inline long long offset_a(const Indexing& ix, long long i) {
  long long o = 0;
  for (int d = ix.ndim - 1; d >= 0; --d) {
    const long long k = i % ix.shape[d];
    i /= ix.shape[d];
    o += k * ix.a[d];
  }
  return o;
}

/// Blocks for a grid-stride loop over n elements with `threads` per block: enough to fill every
/// SM, capped so that the grid stays well inside gridDim.x's limit.
inline unsigned blocks_for(long long n, int threads) {
  long long b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b > 262140 ? 262140 : b);
}

}  // namespace baton::cuda::launch::block
