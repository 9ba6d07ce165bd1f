// The embedding's gradient without atomics: the positions are sorted by the table row they name
// (a stable radix sort, so each row's positions stay in increasing order), then one thread per
// (row, column) adds that row's dy rows in that order. The sum is the CPU's, float add for
// float add: the same bits on every run and on both devices, where atomicAdd's order (and so
// its rounding) would change from run to run.
#include <cub/device/device_radix_sort.cuh>

#include "block.cuh"
#include "launch.h"

namespace baton::cuda::launch {
namespace {

constexpr int threads = 256;

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Keys wide enough for [0, rows]: `rows` itself marks an id the shard does not hold.
int key_bits(long long rows) {
  int bits = 1;
  while (bits < 32 && (1LL << bits) <= rows) ++bits;
  return bits;
}

size_t sort_bytes(long long n, long long rows) {
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, temp, static_cast<const unsigned*>(nullptr), static_cast<unsigned*>(nullptr),
                                  static_cast<const int*>(nullptr), static_cast<int*>(nullptr), static_cast<int>(n), 0,
                                  key_bits(rows));
  return temp;
}

__global__ void keys_kernel(const int* ids, unsigned* keys, int* pos, long long n, long long rows, long long start,
                            long long vocab) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long id = ids[i];
    const long long row = id >= 0 && id < vocab ? id - start : -1;
    keys[i] = static_cast<unsigned>(row >= 0 && row < rows ? row : rows);
    pos[i] = static_cast<int>(i);
  }
}

// Thread (k, c) sums column c of the run of equal keys that starts at sorted position k.
__global__ void sum_runs_kernel(const unsigned* keys, const int* pos, const float* dy, float* dtable, long long n,
                                long long d, long long rows) {
  const long long total = n * d;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long k = i / d, c = i % d;
    const unsigned key = keys[k];
    if (key >= rows || (k > 0 && keys[k - 1] == key)) continue;  // another shard's id, or not a run's start
    float acc = 0.f;
    for (long long j = k; j < n && keys[j] == key; ++j) acc += dy[static_cast<long long>(pos[j]) * d + c];
    dtable[static_cast<long long>(key) * d + c] = acc;
  }
}

}  // namespace

size_t embedding_grad_scratch(long long n, long long rows) {
  return 4 * aligned(static_cast<size_t>(n) * 4) + aligned(sort_bytes(n, rows));
}

cudaError_t embedding_grad(const int* ids, const float* dy, float* dtable, long long n, long long d, long long rows,
                           long long start, long long vocab, void* scratch, size_t scratch_bytes, cudaStream_t s) {
  if (n > 0x7fffffffLL || rows >= 0x7fffffffLL) return cudaErrorInvalidValue;  // the sort's 32-bit counts and keys
  if (rows * d > 0) {
    if (cudaError_t e = cudaMemsetAsync(dtable, 0, static_cast<size_t>(rows * d) * sizeof(float), s); e != cudaSuccess) {
      return e;
    }
  }
  if (n * d == 0) return cudaSuccess;
  const size_t slot = aligned(static_cast<size_t>(n) * 4);
  size_t temp_bytes = sort_bytes(n, rows);
  if (scratch_bytes < 4 * slot + temp_bytes) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(scratch);
  auto* keys_in = reinterpret_cast<unsigned*>(base);
  auto* keys_out = reinterpret_cast<unsigned*>(base + slot);
  auto* pos_in = reinterpret_cast<int*>(base + 2 * slot);
  auto* pos_out = reinterpret_cast<int*>(base + 3 * slot);
  void* temp = base + 4 * slot;
  keys_kernel<<<block::blocks_for(n, threads), threads, 0, s>>>(ids, keys_in, pos_in, n, rows, start, vocab);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, pos_in, pos_out,
                                                      static_cast<int>(n), 0, key_bits(rows), s);
      e != cudaSuccess) {
    return e;
  }
  sum_runs_kernel<<<block::blocks_for(n * d, threads), threads, 0, s>>>(keys_out, pos_out, dy, dtable, n, d, rows);
  return cudaGetLastError();
}

}  // namespace baton::cuda::launch
