// Tensor CUDA kernels beyond the elementwise ones: dropout (the CPU's counter-based mask, bit
// for bit), strided run copies (slice, concat), reductions over axes (sum, mean, max) and the
// all-reduce's adds. Grid-stride loops over 64-bit indices, so tensors past 2^31 elements work.
#include <cmath>

#include "block.cuh"
#include "elem.cuh"
#include "launch.h"

namespace baton::cuda::launch {
namespace {

constexpr int threads = 256;

unsigned blocks_for(long long n) { return block::blocks_for(n, threads); }

// ---- dropout -----------------------------------------------------------------------------------

// The splitmix64 finaliser and increment of baton/kernels/ops_nn.cpp: the same bits on host
// and device make the same mask as the CPU kernel.
__host__ __device__ inline unsigned long long mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
constexpr unsigned long long golden_gamma = 0x9e3779b97f4a7c15ULL;

template <class T>
__global__ void dropout_kernel(const T* x, T* y, long long n, unsigned long long key, unsigned long long threshold,
                               T scale) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const unsigned long long bits = mix64(key + (static_cast<unsigned long long>(i) + 1ULL) * golden_gamma);
    y[i] = (bits >> 11) >= threshold ? x[i] * scale : T(0);
  }
}

template <class T>
cudaError_t dropout_t(const T* x, T* y, long long n, long long seed, long long piece, unsigned long long threshold,
                      T scale, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  // As DropoutKernel: the seed's key, then the piece's stream key.
  const unsigned long long seed_key = mix64(static_cast<unsigned long long>(seed) + golden_gamma);
  const unsigned long long key = mix64(seed_key ^ static_cast<unsigned long long>(piece));
  dropout_kernel<T><<<blocks_for(n), threads, 0, s>>>(x, y, n, key, threshold, scale);
  return cudaGetLastError();
}

// ---- run copies --------------------------------------------------------------------------------

template <class E>
__global__ void copy_runs_kernel(const E* src, E* dst, long long rows, long long run, long long src_pitch,
                                 long long dst_pitch) {
  const long long total = rows * run;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / run, j = i - r * run;
    dst[r * dst_pitch + j] = src[r * src_pitch + j];
  }
}

template <class E>
cudaError_t copy_runs_t(const void* src, void* dst, long long rows, long long run, long long src_pitch,
                        long long dst_pitch, cudaStream_t s) {
  copy_runs_kernel<E><<<blocks_for(rows * run), threads, 0, s>>>(static_cast<const E*>(src), static_cast<E*>(dst), rows,
                                                                 run, src_pitch, dst_pitch);
  return cudaGetLastError();
}

// ---- reductions over axes ----------------------------------------------------------------------

// One thread per output: when there are many outputs (every SM busy) or few elements each.
template <class T>
__global__ void reduce_per_thread(int op, const T* x, T* y, Indexing out, long long n_out, Indexing red, long long n_red,
                                  double factor) {
  const bool max = static_cast<Reduce>(op) == Reduce::max;
  for (long long o = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; o < n_out;
       o += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long base = block::offset_a(out, o);
    double acc = max ? -INFINITY : 0.0;
    for (long long r = 0; r < n_red; ++r) {
      const double v = elem::load(x + base + block::offset_a(red, r));
      acc = max ? block::nan_max(acc, v) : acc + v;
    }
    elem::store_d(y + o, max ? acc : acc * factor);
  }
}

// One block per output: few outputs over many elements (a loss's mean, a row's maximum).
template <class T>
__global__ void reduce_per_block(int op, const T* x, T* y, Indexing out, long long n_out, Indexing red, long long n_red,
                                 double factor) {
  __shared__ double scratch[threads];
  const bool max = static_cast<Reduce>(op) == Reduce::max;
  for (long long o = blockIdx.x; o < n_out; o += gridDim.x) {
    const long long base = block::offset_a(out, o);
    double acc = max ? -INFINITY : 0.0;
    for (long long r = threadIdx.x; r < n_red; r += blockDim.x) {
      const double v = elem::load(x + base + block::offset_a(red, r));
      acc = max ? block::nan_max(acc, v) : acc + v;
    }
    const double total = max ? block::reduce(acc, scratch, block::Max{}) : block::reduce(acc, scratch, block::Sum{});
    if (threadIdx.x == 0) elem::store_d(y + o, max ? total : total * factor);
  }
}

// Over leading rows: x is [n_red, n_out] row-major, y [n_out] (a bias's gradient: sum_to over
// the batch and sequence). A block owns 32 columns; its 32 x 32 threads sum rows ty, ty + 32, ...
// of their column, so that each warp reads 32 neighbouring elements of a row (coalesced), then
// the 32 partial sums of a column are combined in a fixed order: the same bits every run.
constexpr int column_rows = 32;
template <class T>
__global__ void reduce_columns(int op, const T* x, T* y, long long n_out, long long n_red, double factor) {
  __shared__ double part[column_rows][33];
  const bool max = static_cast<Reduce>(op) == Reduce::max;
  const long long c = blockIdx.x * 32LL + threadIdx.x;
  double acc = max ? -INFINITY : 0.0;
  if (c < n_out) {
    for (long long r = threadIdx.y; r < n_red; r += column_rows) {
      const double v = elem::load(x + r * n_out + c);
      acc = max ? block::nan_max(acc, v) : acc + v;
    }
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < n_out) {
    double total = part[0][threadIdx.x];
    for (int k = 1; k < column_rows; ++k) {
      total = max ? block::nan_max(total, part[k][threadIdx.x]) : total + part[k][threadIdx.x];
    }
    elem::store_d(y + c, max ? total : total * factor);
  }
}

// Over trailing elements: x is [n_out, n_red] row-major (a mean over the last axis). A warp per
// row, its lanes reading neighbouring elements, combined by shuffles in a fixed order.
template <class T>
__global__ void reduce_rows(int op, const T* x, T* y, long long n_out, long long n_red, double factor) {
  const bool max = static_cast<Reduce>(op) == Reduce::max;
  const long long warps = blockDim.x / 32;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (long long row = blockIdx.x * warps + threadIdx.x / 32; row < n_out; row += gridDim.x * warps) {
    const T* p = x + row * n_red;
    double acc = max ? -INFINITY : 0.0;
    for (long long r = lane; r < n_red; r += 32) {
      const double v = elem::load(p + r);
      acc = max ? block::nan_max(acc, v) : acc + v;
    }
    for (int step = 16; step > 0; step /= 2) {
      const double other = __shfl_down_sync(0xffffffffu, acc, step);
      acc = max ? block::nan_max(acc, other) : acc + other;
    }
    if (lane == 0) elem::store_d(y + row, max ? acc : acc * factor);
  }
}

// Whether ix walks its index space as one row-major run of step `scale`: offset_a(ix, i) ==
// i * scale for every i (dims of extent 1 have any stride).
bool contiguous_run(const Indexing& ix, long long scale) {
  long long expect = scale;
  for (int d = ix.ndim - 1; d >= 0; --d) {
    if (ix.shape[d] != 1 && ix.a[d] != expect) return false;
    expect *= ix.shape[d];
  }
  return true;
}

template <class T>
cudaError_t reduce_t(Reduce op, const T* x, T* y, const Indexing& out, long long n_out, const Indexing& red,
                     long long n_red, double factor, cudaStream_t s) {
  if (n_out == 0) return cudaSuccess;
  // The two layouts training reduces most, read coalesced; any other through the general kernels.
  if (n_red > 1 && contiguous_run(out, 1) && contiguous_run(red, n_out)) {
    const dim3 block(32, column_rows);
    reduce_columns<T><<<static_cast<unsigned>((n_out + 31) / 32), block, 0, s>>>(static_cast<int>(op), x, y, n_out,
                                                                                n_red, factor);
    return cudaGetLastError();
  }
  if (n_out >= 1024 && n_red > 1 && contiguous_run(out, n_red) && contiguous_run(red, 1)) {
    reduce_rows<T><<<blocks_for(n_out * 32), threads, 0, s>>>(static_cast<int>(op), x, y, n_out, n_red, factor);
    return cudaGetLastError();
  }
  // A block per output keeps the threads of a block on one output's elements; worth it while
  // the outputs alone would leave SMs idle and each has a block's worth of elements.
  if (n_out < 4096 && n_red >= threads) {
    reduce_per_block<T><<<static_cast<unsigned>(n_out), threads, 0, s>>>(static_cast<int>(op), x, y, out, n_out, red,
                                                                          n_red, factor);
  } else {
    reduce_per_thread<T><<<blocks_for(n_out), threads, 0, s>>>(static_cast<int>(op), x, y, out, n_out, red, n_red,
                                                               factor);
  }
  return cudaGetLastError();
}

// ---- adds --------------------------------------------------------------------------------------

template <class T>
__global__ void add_kernel(const T* a, const T* b, T* c, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    c[i] = a[i] + b[i];
  }
}

template <class T>
cudaError_t add_t(const T* a, const T* b, T* c, long long n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  add_kernel<T><<<blocks_for(n), threads, 0, s>>>(a, b, c, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t dropout(const float* x, float* y, long long n, long long seed, long long piece,
                    unsigned long long threshold, float scale, cudaStream_t s) {
  return dropout_t<float>(x, y, n, seed, piece, threshold, scale, s);
}
cudaError_t dropout(const double* x, double* y, long long n, long long seed, long long piece,
                    unsigned long long threshold, double scale, cudaStream_t s) {
  return dropout_t<double>(x, y, n, seed, piece, threshold, scale, s);
}

cudaError_t copy_runs(const void* src, void* dst, int elem_bytes, long long rows, long long run, long long src_pitch,
                      long long dst_pitch, cudaStream_t s) {
  if (rows == 0 || run == 0) return cudaSuccess;
  if (rows == 1 || (run == src_pitch && run == dst_pitch)) {
    // Contiguous: one copy, which also works between devices (cudaMemcpyDefault).
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(rows * run * elem_bytes), cudaMemcpyDefault, s);
  }
  switch (elem_bytes) {
    case 1: return copy_runs_t<unsigned char>(src, dst, rows, run, src_pitch, dst_pitch, s);
    case 2: return copy_runs_t<unsigned short>(src, dst, rows, run, src_pitch, dst_pitch, s);
    case 4: return copy_runs_t<unsigned int>(src, dst, rows, run, src_pitch, dst_pitch, s);
    case 8: return copy_runs_t<unsigned long long>(src, dst, rows, run, src_pitch, dst_pitch, s);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t reduce(Reduce op, const float* x, float* y, const Indexing& out, long long n_out, const Indexing& red,
                   long long n_red, double factor, cudaStream_t s) {
  return reduce_t(op, x, y, out, n_out, red, n_red, factor, s);
}
cudaError_t reduce(Reduce op, const double* x, double* y, const Indexing& out, long long n_out, const Indexing& red,
                   long long n_red, double factor, cudaStream_t s) {
  return reduce_t(op, x, y, out, n_out, red, n_red, factor, s);
}
cudaError_t reduce(Reduce op, const Bf16* x, Bf16* y, const Indexing& out, long long n_out, const Indexing& red,
                   long long n_red, double factor, cudaStream_t s) {
  return reduce_t(op, elem::dev(x), elem::dev(y), out, n_out, red, n_red, factor, s);
}

cudaError_t add(const float* a, const float* b, float* c, long long n, cudaStream_t s) { return add_t(a, b, c, n, s); }
cudaError_t add(const double* a, const double* b, double* c, long long n, cudaStream_t s) {
  return add_t(a, b, c, n, s);
}

}  // namespace baton::cuda::launch
