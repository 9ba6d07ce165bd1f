// Serving's decode ops on CUDA devices, f32 (bf16 through float32 copies, as
// KernelRegistry::create falls back): rope_at and paged_attention, as the CPU's (ops_decode.cpp)
// compute them. Launchers declared in launch.h, called from decode.cpp.
#include <cuda_runtime.h>

#include "block.cuh"
#include "launch.h"

namespace baton::cuda::launch {
namespace {

constexpr int threads = 128;

// x [R, H, D]: pair (i, i + D/2) of row r rotated by positions[r] (0 for a padding row's
// negative position). The angle as the CPU rounds it (float t times float inv_freq), its cosine
// and sine in double rounded once.
__global__ void rope_at_kernel(const float* x, const int* positions, const float* inv_freq, float* y, long long rows,
                               long long heads, long long half) {
  const long long n = rows * heads * half;
  for (long long k = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i = k % half, rh = k / half, r = rh / heads;
    const int p = positions[r] > 0 ? positions[r] : 0;
    const double angle = static_cast<double>(__fmul_rn(static_cast<float>(p), inv_freq[i]));
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
    const float* xr = x + rh * 2 * half;
    float* yr = y + rh * 2 * half;
    const float lo = xr[i], hi = xr[i + half];
    yr[i] = __fsub_rn(__fmul_rn(lo, c), __fmul_rn(hi, s));
    yr[i + half] = __fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, s));
  }
}

// Where position p of slot s lies in the caches (in rows of kv_heads * d), or -1 outside the
// slot's table or the cache.
__device__ long long cache_row(const int* table, long long n_slots, long long per_slot, long long blocks,
                               long long block_size, long long s, long long p) {
  if (s < 0 || s >= n_slots || p < 0 || p / block_size >= per_slot) return -1;
  const int b = table[s * per_slot + p / block_size];
  if (b < 0 || b >= blocks) return -1;
  return static_cast<long long>(b) * block_size + p % block_size;
}

// Each live row's k and v into the caches at its slot and position: one thread per element.
__global__ void paged_write_kernel(const float* k, const float* v, const int* slots, const int* positions,
                                   const int* table, float* k_cache, float* v_cache, long long rows, long long row_kv,
                                   long long n_slots, long long per_slot, long long blocks, long long block_size) {
  const long long n = rows * row_kv;
  for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = e / row_kv, j = e % row_kv;
    if (slots[r] < 0) continue;
    const long long at = cache_row(table, n_slots, per_slot, blocks, block_size, slots[r], positions[r]);
    if (at < 0) continue;  // the attention kernel writes the row's output as NaN
    k_cache[at * row_kv + j] = k[e];
    v_cache[at * row_kv + j] = v[e];
  }
}

// One block per (row, query head): the scores of the row's positions 0..p (scale q.k in float,
// as BLAS's gemv with alpha = scale), the softmax's exponentials and sum in double (each
// weight rounded to float, as the CPU keeps them), then the output as the weighted sum of the
// values in float times 1 / sum. Scores live in dynamic shared memory (one float per position
// of the slot's table), the query row beside them. A padding row writes zeros; a row whose slot,
// position or block lies outside the table or the cache writes NaN (a device kernel cannot
// throw; the CPU's kernel refuses it).
__global__ void paged_attention_kernel(const float* q, const int* slots, const int* positions, const int* table,
                                       const float* k_cache, const float* v_cache, float* o, long long heads,
                                       long long kv_heads, long long d, long long n_slots, long long per_slot,
                                       long long blocks, long long block_size, float scale) {
  extern __shared__ float smem[];
  __shared__ double reduce_scratch[threads];
  __shared__ int bad;
  const long long r = blockIdx.x / heads, h = blockIdx.x % heads;
  const long long row_kv = kv_heads * d, kvh = (h / (heads / kv_heads)) * d;
  float* out = o + (r * heads + h) * d;
  const int slot = slots[r];
  if (slot < 0) {
    for (long long j = threadIdx.x; j < d; j += blockDim.x) out[j] = 0.f;
    return;
  }
  const long long len = static_cast<long long>(positions[r]) + 1;
  float* qs = smem;          // [d]
  float* score = smem + d;   // [len]
  for (long long j = threadIdx.x; j < d; j += blockDim.x) qs[j] = q[(r * heads + h) * d + j];
  if (threadIdx.x == 0) bad = len < 1 || len > per_slot * block_size;
  __syncthreads();
  if (!bad) {
    for (long long p = threadIdx.x; p < len; p += blockDim.x) {
      const long long at = cache_row(table, n_slots, per_slot, blocks, block_size, slot, p);
      if (at < 0) {
        bad = 1;
        continue;
      }
      const float* kr = k_cache + at * row_kv + kvh;
      float dot = 0.f;
      for (long long j = 0; j < d; ++j) dot = __fadd_rn(dot, __fmul_rn(qs[j], kr[j]));
      score[p] = __fmul_rn(scale, dot);
    }
  }
  __syncthreads();
  if (bad) {
    for (long long j = threadIdx.x; j < d; j += blockDim.x) out[j] = __int_as_float(0x7fc00000);
    return;
  }
  double best = -INFINITY;
  for (long long p = threadIdx.x; p < len; p += blockDim.x) best = block::nan_max(best, static_cast<double>(score[p]));
  best = block::reduce(best, reduce_scratch, block::Max{});
  double total = 0;
  for (long long p = threadIdx.x; p < len; p += blockDim.x) {
    const double w = exp(static_cast<double>(score[p]) - best);
    score[p] = static_cast<float>(w);  // the weight, rounded as the CPU keeps it
    total += w;
  }
  total = block::reduce(total, reduce_scratch, block::Sum{});
  __syncthreads();
  const float inv = static_cast<float>(1.0 / total);
  for (long long j = threadIdx.x; j < d; j += blockDim.x) {
    float acc = 0.f;
    for (long long p = 0; p < len; ++p) {
      const long long at = cache_row(table, n_slots, per_slot, blocks, block_size, slot, p);
      acc = __fadd_rn(acc, __fmul_rn(score[p], v_cache[at * row_kv + kvh + j]));
    }
    out[j] = __fmul_rn(inv, acc);
  }
}

}  // namespace

cudaError_t rope_at(const float* x, const int* positions, const float* inv_freq, float* y, long long rows,
                    long long heads, long long half, cudaStream_t s) {
  const long long n = rows * heads * half;
  if (n == 0) return cudaSuccess;
  rope_at_kernel<<<block::blocks_for(n, threads), threads, 0, s>>>(x, positions, inv_freq, y, rows, heads, half);
  return cudaGetLastError();
}

unsigned long paged_attention_shared_bytes(long long d, long long per_slot, long long block_size) {
  return static_cast<unsigned long>(d + per_slot * block_size) * sizeof(float);
}

cudaError_t paged_attention(const float* q, const float* k, const float* v, const int* slots, const int* positions,
                            const int* table, float* k_cache, float* v_cache, float* o, long long rows, long long heads,
                            long long kv_heads, long long d, long long n_slots, long long per_slot, long long blocks,
                            long long block_size, float scale, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  const long long row_kv = kv_heads * d;
  paged_write_kernel<<<block::blocks_for(rows * row_kv, threads), threads, 0, s>>>(
      k, v, slots, positions, table, k_cache, v_cache, rows, row_kv, n_slots, per_slot, blocks, block_size);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const unsigned long shared = paged_attention_shared_bytes(d, per_slot, block_size);
  if (shared > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(paged_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(shared));
        e != cudaSuccess) {
      return e;
    }
  }
  paged_attention_kernel<<<static_cast<unsigned>(rows * heads), threads, shared, s>>>(
      q, slots, positions, table, k_cache, v_cache, o, heads, kv_heads, d, n_slots, per_slot, blocks, block_size, scale);
  return cudaGetLastError();
}

}  // namespace baton::cuda::launch
