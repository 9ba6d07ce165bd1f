// The row-wise and positional LLM ops on CUDA devices, f32 (bf16 runs them on f32 copies, as
// KernelRegistry::create falls back): RMSNorm forward and backward, the rotary embedding. As the
// CPU's kernels (ops_llm.cpp): rows reduce in double, elementwise work in double rounded once.
#include <cuda_runtime.h>

#include "block.cuh"
#include "launch.h"

namespace baton::cuda::launch {
namespace {

constexpr int threads = 256;

__device__ double row_sum(double v, double* scratch) { return block::reduce(v, scratch, block::Sum{}); }

/// 1 / sqrt(mean(x^2) + eps) of one row, on every thread of the block.
__device__ double row_rstd(const float* xr, long long cols, double eps, double* scratch) {
  double sq = 0;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) sq += static_cast<double>(xr[j]) * xr[j];
  return 1.0 / sqrt(row_sum(sq, scratch) / static_cast<double>(cols) + eps);
}

// One block per row (grid-stride over rows).
__global__ void rms_norm_kernel(const float* x, const float* w, float* y, long long rows, long long cols, double eps) {
  __shared__ double scratch[threads];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * cols;
    const double rstd = row_rstd(xr, cols, eps, scratch);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
      y[r * cols + j] = static_cast<float>(static_cast<double>(xr[j]) * rstd * w[j]);
    }
  }
}

__global__ void rms_norm_grad_kernel(const float* x, const float* w, const float* dy, float* dx, long long rows,
                                     long long cols, double eps) {
  __shared__ double scratch[threads];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * cols;
    const float* dyr = dy + r * cols;
    const double rstd = row_rstd(xr, cols, eps, scratch);
    double s = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += static_cast<double>(dyr[j]) * w[j] * xr[j] * rstd;
    const double mean = row_sum(s, scratch) / static_cast<double>(cols);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
      const double g = static_cast<double>(dyr[j]) * w[j];
      const double xhat = static_cast<double>(xr[j]) * rstd;
      dx[r * cols + j] = static_cast<float>(rstd * (g - xhat * mean));
    }
  }
}

__global__ void row_rstd_kernel(const float* x, double* rstd, long long rows, long long cols, double eps) {
  __shared__ double scratch[threads];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const double v = row_rstd(x + r * cols, cols, eps, scratch);
    if (threadIdx.x == 0) rstd[r] = v;
  }
}

// One thread per column, the rows in order (as the CPU adds them: the same sum to rounding).
__global__ void rms_norm_grad_weight_kernel(const float* x, const float* dy, const double* rstd, float* dw,
                                            long long rows, long long cols) {
  for (long long j = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; j < cols;
       j += static_cast<long long>(gridDim.x) * blockDim.x) {
    double acc = 0;
    for (long long r = 0; r < rows; ++r) acc += static_cast<double>(dy[r * cols + j]) * x[r * cols + j] * rstd[r];
    dw[j] = static_cast<float>(acc);
  }
}

// x [blocks, T, D]: pair (i, i + D/2) of position t rotated by the table's cos and sin [T, D/2].
__global__ void rope_kernel(const float* x, const float* cos_t, const float* sin_t, float* y, long long blocks,
                            long long t_len, long long half) {
  const long long n = blocks * t_len * half;
  for (long long k = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i = k % half, row = k / half, t = row % t_len;
    const float* xr = x + row * 2 * half;
    float* yr = y + row * 2 * half;
    const float c = cos_t[t * half + i], s = sin_t[t * half + i];
    const float lo = xr[i], hi = xr[i + half];
    yr[i] = lo * c - hi * s;
    yr[i + half] = hi * c + lo * s;
  }
}

unsigned row_blocks(long long rows) { return static_cast<unsigned>(rows < 65535 ? (rows < 1 ? 1 : rows) : 65535); }

}  // namespace

cudaError_t rms_norm(const float* x, const float* w, float* y, long long rows, long long cols, double eps,
                     cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  rms_norm_kernel<<<row_blocks(rows), threads, 0, s>>>(x, w, y, rows, cols, eps);
  return cudaGetLastError();
}

cudaError_t rms_norm_grad(const float* x, const float* w, const float* dy, float* dx, long long rows, long long cols,
                          double eps, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  rms_norm_grad_kernel<<<row_blocks(rows), threads, 0, s>>>(x, w, dy, dx, rows, cols, eps);
  return cudaGetLastError();
}

cudaError_t rms_norm_grad_weight(const float* x, const float* dy, double* rstd, float* dw, long long rows,
                                 long long cols, double eps, cudaStream_t s) {
  if (cols == 0) return cudaSuccess;
  if (rows > 0) {
    row_rstd_kernel<<<row_blocks(rows), threads, 0, s>>>(x, rstd, rows, cols, eps);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  rms_norm_grad_weight_kernel<<<block::blocks_for(cols, threads), threads, 0, s>>>(x, dy, rstd, dw, rows, cols);
  return cudaGetLastError();
}

cudaError_t rope(const float* x, const float* cos_table, const float* sin_table, float* y, long long blocks,
                 long long t_len, long long half, cudaStream_t s) {
  const long long n = blocks * t_len * half;
  if (n == 0) return cudaSuccess;
  rope_kernel<<<block::blocks_for(n, threads), threads, 0, s>>>(x, cos_table, sin_table, y, blocks, t_len, half);
  return cudaGetLastError();
}

}  // namespace baton::cuda::launch
