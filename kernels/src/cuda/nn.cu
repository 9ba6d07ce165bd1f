// Row-wise CUDA kernels over the last axis (softmax, cross-entropy, layer norm, the
// vocabulary-parallel cross-entropy's stats: one block per row, reductions in double as the CPU
// kernels do), the scalar losses (mse, the vocabulary-parallel loss) and the embedding gather,
// whole or one vocabulary shard (its gradient: embedding_grad.cu).
#include <cmath>
#include <type_traits>

#include "block.cuh"
#include "elem.cuh"
#include "launch.h"

namespace baton::cuda::launch {
namespace {

using elem::load;

constexpr int threads = 256;

// Block-wide reductions; every thread gets the result. Within each warp by shuffles, then every
// thread combines the warps' partials in warp order (a fixed order: the same bits every run).
// `scratch` holds a double per warp; blockDim.x is a multiple of 32 (every launch here: 256).
// (A shared-memory tree with a __syncthreads per level made a row of 1024 wait on eight barriers
// per sum: layer norm's backward took 5.7 ms of an H200 GPT step.)
__device__ double block_sum(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  double r = 0;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

// The larger of m and v, where a NaN wins, as in the CPU's row maximum.
template <class T>
__device__ __forceinline__ T max_nan(T m, T v) {
  return (v > m || isnan(v)) ? v : m;
}

__device__ double block_max(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  double r = -INFINITY;
  for (unsigned w = 0; w < blockDim.x / 32; ++w) r = max_nan(r, scratch[w]);
  __syncthreads();
  return r;
}

template <class T>
__device__ double row_max(const T* xr, long long cols, double* scratch) {
  double m = -INFINITY;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    const double v = load(xr + j);
    if (v > m || isnan(v)) m = v;
  }
  return block_max(m, scratch);
}

// The float32 kernels and their bfloat16 twins (elem.cuh): each row in double either way.
template <class T>
__global__ void softmax_kernel(const T* x, T* y, long long cols, bool log) {
  __shared__ double scratch[threads];
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  const double mx = row_max(xr, cols, scratch);
  double s = 0;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += exp(load(xr + j) - mx);
  const double sum = block_sum(s, scratch);
  const double lse = mx + ::log(sum);
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    elem::store_d(yr + j, log ? load(xr + j) - lse : exp(load(xr + j) - mx) / sum);
  }
}

// softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy)
template <class T>
__global__ void softmax_grad_kernel(const T* y, const T* dy, T* dx, long long cols, bool log) {
  __shared__ double scratch[threads];
  const long long off = blockIdx.x * cols;
  double s = 0;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    const double g = load(dy + off + j);
    s += log ? g : g * load(y + off + j);
  }
  const double sum = block_sum(s, scratch);
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    const double yj = load(y + off + j), g = load(dy + off + j);
    elem::store_d(dx + off + j, log ? g - exp(yj) * sum : yj * (g - sum));
  }
}

// A row's largest logit (NaN wins, as in the CPU's row maximum) and sum of exp(x - max): exp in
// float, as the CPU's float32 kernel computes it (a double exp per element made the loss's
// backward compute-bound: 9 ms a step of the H200 GPT's 32768 x 32768 logits), summed in
// double. Four floats a load where the row allows (`vec4`: cols a multiple of 4, 16-byte
// aligned rows).
__device__ void row_max_sum(const float* xr, long long cols, bool vec4, double* scratch, float& mx, double& sum) {
  float m = -INFINITY;
  const auto* x4 = reinterpret_cast<const float4*>(xr);
  if (vec4) {
    for (long long j = threadIdx.x; j < cols / 4; j += blockDim.x) {
      const float4 v = x4[j];
      m = max_nan(max_nan(max_nan(max_nan(m, v.x), v.y), v.z), v.w);
    }
  } else {
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) m = max_nan(m, xr[j]);
  }
  mx = static_cast<float>(block_max(m, scratch));
  double s = 0;
  if (vec4) {
    for (long long j = threadIdx.x; j < cols / 4; j += blockDim.x) {
      const float4 v = x4[j];
      s += static_cast<double>(expf(v.x - mx)) + expf(v.y - mx) + expf(v.z - mx) + expf(v.w - mx);
    }
  } else {
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += expf(xr[j] - mx);
  }
  sum = block_sum(s, scratch);
}

__global__ void cross_entropy_rows(const float* logits, const int* labels, double* row_loss, long long cols, bool vec4) {
  __shared__ double scratch[threads];
  const float* xr = logits + blockIdx.x * cols;
  float mx;
  double sum;
  row_max_sum(xr, cols, vec4, scratch, mx, sum);
  if (threadIdx.x == 0) {
    const int label = labels[blockIdx.x];
    row_loss[blockIdx.x] = (label >= 0 && label < cols) ? mx + ::log(sum) - xr[label] : NAN;
  }
}

__global__ void mean_kernel(const double* row_loss, float* loss, long long rows) {
  __shared__ double scratch[threads];
  double s = 0;
  for (long long i = threadIdx.x; i < rows; i += blockDim.x) s += row_loss[i];
  const double total = block_sum(s, scratch);
  if (threadIdx.x == 0) loss[0] = static_cast<float>(total / static_cast<double>(rows));
}

__global__ void cross_entropy_grad_kernel(const float* logits, const int* labels, const float* dloss, float* dlogits,
                                          long long rows, long long cols, bool vec4) {
  __shared__ double scratch[threads];
  const float* xr = logits + blockIdx.x * cols;
  float* dr = dlogits + blockIdx.x * cols;
  float mx;
  double sum;
  row_max_sum(xr, cols, vec4, scratch, mx, sum);
  const double g = static_cast<double>(dloss[0]) / static_cast<double>(rows);
  // As the CPU: exp in float, scaled in float, the label's g taken off after.
  const float scale = static_cast<float>(g / sum), gf = static_cast<float>(g);
  const int label = labels[blockIdx.x];
  const bool valid = label >= 0 && label < cols;
  auto value = [&](float x, long long j) {
    float v = expf(x - mx) * scale;
    if (j == label) v -= gf;
    return valid ? v : NAN;
  };
  if (vec4) {
    const auto* x4 = reinterpret_cast<const float4*>(xr);
    auto* d4 = reinterpret_cast<float4*>(dr);
    for (long long j = threadIdx.x; j < cols / 4; j += blockDim.x) {
      const float4 v = x4[j];
      d4[j] = make_float4(value(v.x, 4 * j), value(v.y, 4 * j + 1), value(v.z, 4 * j + 2), value(v.w, 4 * j + 3));
    }
  } else {
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) dr[j] = value(xr[j], j);
  }
}

template <class T>
__device__ void moments(const T* xr, long long cols, double eps, double* scratch, double& mean, double& rstd) {
  double s = 0;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += load(xr + j);
  mean = block_sum(s, scratch) / static_cast<double>(cols);
  double q = 0;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    const double d = load(xr + j) - mean;
    q += d * d;
  }
  const double var = block_sum(q, scratch) / static_cast<double>(cols);
  rstd = 1.0 / sqrt(var + eps);
}

template <class T>
__global__ void layer_norm_kernel(const T* x, T* y, long long cols, double eps) {
  __shared__ double scratch[threads];
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  double mean, rstd;
  moments(xr, cols, eps, scratch, mean, rstd);
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) elem::store_d(yr + j, (load(xr + j) - mean) * rstd);
}

template <class T>
__global__ void layer_norm_grad_kernel(const T* x, const T* dy, T* dx, long long cols, double eps) {
  __shared__ double scratch[threads];
  const long long off = blockIdx.x * cols;
  double mean, rstd;
  moments(x + off, cols, eps, scratch, mean, rstd);
  double s_dy = 0, s_dy_xhat = 0;
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    const double xhat = (load(x + off + j) - mean) * rstd;
    const double g = load(dy + off + j);
    s_dy += g;
    s_dy_xhat += g * xhat;
  }
  const double mean_dy = block_sum(s_dy, scratch) / static_cast<double>(cols);
  const double mean_dy_xhat = block_sum(s_dy_xhat, scratch) / static_cast<double>(cols);
  for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
    const double xhat = (load(x + off + j) - mean) * rstd;
    elem::store_d(dx + off + j, rstd * (load(dy + off + j) - mean_dy - xhat * mean_dy_xhat));
  }
}

// The same two kernels for rows of at most PER * blockDim.x elements, each thread holding its
// elements (j = thread, thread + blockDim.x, ...) in registers: the row is read from memory once
// instead of three or four times. The partial sums run over the same elements in the same
// order, so these give the kernels above their bits.
// This thread's elements of a row (j = thread, thread + blockDim.x, ...), zeros past its end.
template <class T, int PER>
__device__ void hold_row(const T* xr, long long cols, double (&v)[PER]) {
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const long long j = threadIdx.x + static_cast<long long>(k) * blockDim.x;
    v[k] = j < cols ? static_cast<double>(load(xr + j)) : 0.0;
  }
}

// The mean and 1 / sqrt(var + eps) of a row the block holds (hold_row), summed as moments()
// sums them.
template <int PER>
__device__ void held_moments(const double (&v)[PER], long long cols, double eps, double* scratch, double& mean,
                             double& rstd) {
  double s = 0;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    if (threadIdx.x + static_cast<long long>(k) * blockDim.x < cols) s += v[k];
  }
  mean = block_sum(s, scratch) / static_cast<double>(cols);
  double q = 0;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const double d = v[k] - mean;
    if (threadIdx.x + static_cast<long long>(k) * blockDim.x < cols) q += d * d;
  }
  rstd = 1.0 / sqrt(block_sum(q, scratch) / static_cast<double>(cols) + eps);
}

template <class T, int PER>
__global__ void layer_norm_held_kernel(const T* x, T* y, long long cols, double eps) {
  __shared__ double scratch[threads];
  const long long off = blockIdx.x * cols;
  double v[PER], mean, rstd;
  hold_row(x + off, cols, v);
  held_moments(v, cols, eps, scratch, mean, rstd);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const long long j = threadIdx.x + static_cast<long long>(k) * blockDim.x;
    if (j < cols) elem::store_d(y + off + j, (v[k] - mean) * rstd);
  }
}

template <class T, int PER>
__global__ void layer_norm_grad_held_kernel(const T* x, const T* dy, T* dx, long long cols, double eps) {
  __shared__ double scratch[threads];
  const long long off = blockIdx.x * cols;
  double v[PER], g[PER], mean, rstd;
  hold_row(x + off, cols, v);
  hold_row(dy + off, cols, g);
  held_moments(v, cols, eps, scratch, mean, rstd);
  double s_dy = 0, s_dy_xhat = 0;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    if (threadIdx.x + static_cast<long long>(k) * blockDim.x < cols) {
      s_dy += g[k];
      s_dy_xhat += g[k] * ((v[k] - mean) * rstd);
    }
  }
  const double mean_dy = block_sum(s_dy, scratch) / static_cast<double>(cols);
  const double mean_dy_xhat = block_sum(s_dy_xhat, scratch) / static_cast<double>(cols);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const long long j = threadIdx.x + static_cast<long long>(k) * blockDim.x;
    if (j < cols) elem::store_d(dx + off + j, rstd * (g[k] - mean_dy - (v[k] - mean) * rstd * mean_dy_xhat));
  }
}

// Calls fn with the elements per thread that hold a row of `cols` (1, 2, 4 or 8 of `threads`),
// or returns false for longer rows.
template <class Fn>
bool by_row_length(long long cols, Fn fn) {
  if (cols <= threads) return fn(std::integral_constant<int, 1>{}), true;
  if (cols <= 2 * threads) return fn(std::integral_constant<int, 2>{}), true;
  if (cols <= 4 * threads) return fn(std::integral_constant<int, 4>{}), true;
  if (cols <= 8 * threads) return fn(std::integral_constant<int, 8>{}), true;
  return false;
}

// The row of the shard that `id` names, or -1 for another shard's id (or one outside the
// vocabulary, which the CPU rejects).
__device__ long long shard_row(long long id, long long rows, long long start, long long vocab) {
  if (id < 0 || id >= vocab) return -1;
  const long long row = id - start;
  return row >= 0 && row < rows ? row : -1;
}

template <class T>
__global__ void embedding_kernel(const T* table, const int* ids, T* y, long long n, long long d, long long rows,
                                 long long start, long long vocab) {
  const long long total = n * d;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long pos = i / d, col = i % d;
    const long long row = shard_row(ids[pos], rows, start, vocab);
    y[i] = row >= 0 ? table[row * d + col] : T(0.f);
  }
}

// exp(x - m) as a float, like the CPU's std::exp(float): the float difference, then exp in
// double rounded once (glibc's expf is within an ulp of that; the tests allow 1e-5).
__device__ float exp_diff(float x, float m) { return static_cast<float>(exp(static_cast<double>(x - m))); }

// One block per row (grid-stride over rows): the row's sum of exp(logits - row_max).
__global__ void vocab_ce_stats_kernel(const float* logits, const int* labels, const float* row_max, float* stats,
                                      long long rows, long long cols, long long start, long long vocab) {
  __shared__ double scratch[threads];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = logits + r * cols;
    const float m = row_max[r];
    double s = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += exp_diff(xr[j], m);
    const double sum = block::reduce(s, scratch, block::Sum{});
    if (threadIdx.x == 0) {
      const long long label = labels[r];
      const long long col = label - start;
      const bool valid = label >= 0 && label < vocab;
      stats[2 * r] = valid ? static_cast<float>(sum) : NAN;
      stats[2 * r + 1] = !valid ? NAN : (col >= 0 && col < cols ? xr[col] : 0.f);
    }
  }
}

__global__ void vocab_ce_stats_grad_kernel(const float* logits, const int* labels, const float* row_max,
                                           const float* dstats, float* dlogits, long long rows, long long cols,
                                           long long start, long long vocab) {
  const long long total = rows * cols;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / cols, j = i % cols;
    const long long label = labels[r];
    // As the CPU: the float product, then the label's column gets its float add.
    float v = exp_diff(logits[i], row_max[r]) * dstats[2 * r];
    if (j == label - start) v += dstats[2 * r + 1];
    dlogits[i] = label >= 0 && label < vocab ? v : NAN;
  }
}

// The terms of the scalar means, each in double as the CPU sums them.
struct MseTerm {
  const float* pred;
  const float* target;
  __device__ double operator()(long long i) const {
    const double d = static_cast<double>(pred[i]) - static_cast<double>(target[i]);
    return d * d;
  }
};
struct VocabLossTerm {
  const float* stats;
  const float* row_max;
  __device__ double operator()(long long r) const {
    return ::log(static_cast<double>(stats[2 * r])) + static_cast<double>(row_max[r]) -
           static_cast<double>(stats[2 * r + 1]);
  }
};

// Stage one of a scalar mean: block b sums its grid-stride share into partial[b].
template <class Term>
__global__ void partial_sums(Term term, long long n, double* partial) {
  __shared__ double scratch[threads];
  double s = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    s += term(i);
  }
  const double total = block::reduce(s, scratch, block::Sum{});
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// Stage two, one block: the parts in a fixed order, divided by n (0 / 0 = NaN for n = 0).
__global__ void finish_mean(const double* partial, int parts, float* out, long long n) {
  __shared__ double scratch[threads];
  double s = 0;
  for (int i = static_cast<int>(threadIdx.x); i < parts; i += static_cast<int>(blockDim.x)) s += partial[i];
  const double total = block::reduce(s, scratch, block::Sum{});
  if (threadIdx.x == 0) out[0] = static_cast<float>(total / static_cast<double>(n));
}

__global__ void mse_grad_kernel(const float* pred, const float* target, const float* dloss, float* dpred, long long n) {
  const float scale = static_cast<float>(2.0 * static_cast<double>(dloss[0]) / static_cast<double>(n));
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    dpred[i] = scale * (pred[i] - target[i]);
  }
}

__global__ void vocab_ce_loss_grad_kernel(const float* stats, const float* dloss, float* dstats, long long rows) {
  const double g = static_cast<double>(dloss[0]) / static_cast<double>(rows);
  for (long long r = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<long long>(gridDim.x) * blockDim.x) {
    dstats[2 * r] = static_cast<float>(g / static_cast<double>(stats[2 * r]));
    dstats[2 * r + 1] = static_cast<float>(-g);
  }
}

template <class T>
__global__ void causal_mask_kernel(const T* x, T* y, long long total, long long t, float value) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long j = i % t, r = (i / t) % t;
    if (j > r) {
      elem::store(y + i, value);
    } else {
      y[i] = x[i];
    }
  }
}

unsigned blocks_for(long long n) {
  long long b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b > 262140 ? 262140 : b);
}

}  // namespace

namespace {
template <class T>
cudaError_t softmax_t(const T* x, T* y, long long rows, long long cols, bool log, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  softmax_kernel<<<static_cast<unsigned>(rows), threads, 0, s>>>(elem::dev(x), elem::dev(y), cols, log);
  return cudaGetLastError();
}
template <class T>
cudaError_t softmax_grad_t(const T* y, const T* dy, T* dx, long long rows, long long cols, bool log, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  softmax_grad_kernel<<<static_cast<unsigned>(rows), threads, 0, s>>>(elem::dev(y), elem::dev(dy), elem::dev(dx), cols,
                                                                      log);
  return cudaGetLastError();
}
template <class T>
cudaError_t layer_norm_t(const T* x, T* y, long long rows, long long cols, double eps, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  using D = std::remove_const_t<std::remove_pointer_t<decltype(elem::dev(x))>>;
  const bool held = by_row_length(cols, [&](auto per) {
    layer_norm_held_kernel<D, decltype(per)::value>
        <<<static_cast<unsigned>(rows), threads, 0, s>>>(elem::dev(x), elem::dev(y), cols, eps);
  });
  if (!held) layer_norm_kernel<<<static_cast<unsigned>(rows), threads, 0, s>>>(elem::dev(x), elem::dev(y), cols, eps);
  return cudaGetLastError();
}
template <class T>
cudaError_t layer_norm_grad_t(const T* x, const T* dy, T* dx, long long rows, long long cols, double eps,
                              cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  using D = std::remove_const_t<std::remove_pointer_t<decltype(elem::dev(x))>>;
  const bool held = by_row_length(cols, [&](auto per) {
    layer_norm_grad_held_kernel<D, decltype(per)::value>
        <<<static_cast<unsigned>(rows), threads, 0, s>>>(elem::dev(x), elem::dev(dy), elem::dev(dx), cols, eps);
  });
  if (!held) {
    layer_norm_grad_kernel<<<static_cast<unsigned>(rows), threads, 0, s>>>(elem::dev(x), elem::dev(dy), elem::dev(dx),
                                                                           cols, eps);
  }
  return cudaGetLastError();
}
template <class T>
cudaError_t embedding_t(const T* table, const int* ids, T* y, long long n, long long d, long long rows,
                        long long start, long long vocab, cudaStream_t s) {
  if (n * d == 0) return cudaSuccess;
  embedding_kernel<<<blocks_for(n * d), threads, 0, s>>>(elem::dev(table), ids, elem::dev(y), n, d, rows, start, vocab);
  return cudaGetLastError();
}
template <class T>
cudaError_t causal_mask_t(const T* x, T* y, long long batch, long long t, float value, cudaStream_t s) {
  const long long total = batch * t * t;
  if (total == 0) return cudaSuccess;
  causal_mask_kernel<<<blocks_for(total), threads, 0, s>>>(elem::dev(x), elem::dev(y), total, t, value);
  return cudaGetLastError();
}
}  // namespace

cudaError_t softmax(const float* x, float* y, long long rows, long long cols, bool log, cudaStream_t s) {
  return softmax_t(x, y, rows, cols, log, s);
}
cudaError_t softmax(const Bf16* x, Bf16* y, long long rows, long long cols, bool log, cudaStream_t s) {
  return softmax_t(x, y, rows, cols, log, s);
}

cudaError_t softmax_grad(const float* y, const float* dy, float* dx, long long rows, long long cols, bool log,
                         cudaStream_t s) {
  return softmax_grad_t(y, dy, dx, rows, cols, log, s);
}
cudaError_t softmax_grad(const Bf16* y, const Bf16* dy, Bf16* dx, long long rows, long long cols, bool log,
                         cudaStream_t s) {
  return softmax_grad_t(y, dy, dx, rows, cols, log, s);
}

cudaError_t cross_entropy(const float* logits, const int* labels, float* loss, double* row_loss, long long rows,
                          long long cols, cudaStream_t s) {
  if (rows > 0) {
    const bool vec4 = cols % 4 == 0 && reinterpret_cast<unsigned long long>(logits) % 16 == 0;
    cross_entropy_rows<<<static_cast<unsigned>(rows), threads, 0, s>>>(logits, labels, row_loss, cols, vec4);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  mean_kernel<<<1, threads, 0, s>>>(row_loss, loss, rows);  // rows == 0: NaN, as the CPU
  return cudaGetLastError();
}

cudaError_t cross_entropy_grad(const float* logits, const int* labels, const float* dloss, float* dlogits,
                               long long rows, long long cols, cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const bool vec4 = cols % 4 == 0 && reinterpret_cast<unsigned long long>(logits) % 16 == 0 &&
                    reinterpret_cast<unsigned long long>(dlogits) % 16 == 0;
  cross_entropy_grad_kernel<<<static_cast<unsigned>(rows), threads, 0, s>>>(logits, labels, dloss, dlogits, rows, cols,
                                                                             vec4);
  return cudaGetLastError();
}

cudaError_t layer_norm(const float* x, float* y, long long rows, long long cols, double eps, cudaStream_t s) {
  return layer_norm_t(x, y, rows, cols, eps, s);
}
cudaError_t layer_norm(const Bf16* x, Bf16* y, long long rows, long long cols, double eps, cudaStream_t s) {
  return layer_norm_t(x, y, rows, cols, eps, s);
}

cudaError_t layer_norm_grad(const float* x, const float* dy, float* dx, long long rows, long long cols, double eps,
                            cudaStream_t s) {
  return layer_norm_grad_t(x, dy, dx, rows, cols, eps, s);
}
cudaError_t layer_norm_grad(const Bf16* x, const Bf16* dy, Bf16* dx, long long rows, long long cols, double eps,
                            cudaStream_t s) {
  return layer_norm_grad_t(x, dy, dx, rows, cols, eps, s);
}

cudaError_t embedding(const float* table, const int* ids, float* y, long long n, long long d, long long rows,
                      long long start, long long vocab, cudaStream_t s) {
  return embedding_t(table, ids, y, n, d, rows, start, vocab, s);
}
cudaError_t embedding(const Bf16* table, const int* ids, Bf16* y, long long n, long long d, long long rows,
                      long long start, long long vocab, cudaStream_t s) {
  return embedding_t(table, ids, y, n, d, rows, start, vocab, s);
}

cudaError_t vocab_ce_stats(const float* logits, const int* labels, const float* row_max, float* stats, long long rows,
                           long long cols, long long start, long long vocab, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  vocab_ce_stats_kernel<<<static_cast<unsigned>(rows < 65535 ? rows : 65535), threads, 0, s>>>(
      logits, labels, row_max, stats, rows, cols, start, vocab);
  return cudaGetLastError();
}

cudaError_t vocab_ce_stats_grad(const float* logits, const int* labels, const float* row_max, const float* dstats,
                                float* dlogits, long long rows, long long cols, long long start, long long vocab,
                                cudaStream_t s) {
  if (rows * cols == 0) return cudaSuccess;
  vocab_ce_stats_grad_kernel<<<blocks_for(rows * cols), threads, 0, s>>>(logits, labels, row_max, dstats, dlogits,
                                                                         rows, cols, start, vocab);
  return cudaGetLastError();
}

namespace {
template <class Term>
cudaError_t scalar_mean(Term term, long long n, float* out, double* partial, cudaStream_t s) {
  // The number of parts depends on n alone, so a mean is the same bits every time.
  const long long b = (n + threads - 1) / threads;
  const int parts = static_cast<int>(b < mean_parts ? b : mean_parts);
  if (parts > 0) {
    partial_sums<Term><<<static_cast<unsigned>(parts), threads, 0, s>>>(term, n, partial);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  finish_mean<<<1, threads, 0, s>>>(partial, parts, out, n);
  return cudaGetLastError();
}
}  // namespace

cudaError_t mse(const float* pred, const float* target, float* loss, double* partial, long long n, cudaStream_t s) {
  return scalar_mean(MseTerm{pred, target}, n, loss, partial, s);
}

cudaError_t mse_grad(const float* pred, const float* target, const float* dloss, float* dpred, long long n,
                     cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  mse_grad_kernel<<<blocks_for(n), threads, 0, s>>>(pred, target, dloss, dpred, n);
  return cudaGetLastError();
}

cudaError_t vocab_ce_loss(const float* stats, const float* row_max, float* loss, double* partial, long long rows,
                          cudaStream_t s) {
  return scalar_mean(VocabLossTerm{stats, row_max}, rows, loss, partial, s);
}

cudaError_t vocab_ce_loss_grad(const float* stats, const float* dloss, float* dstats, long long rows, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  vocab_ce_loss_grad_kernel<<<blocks_for(rows), threads, 0, s>>>(stats, dloss, dstats, rows);
  return cudaGetLastError();
}

cudaError_t causal_mask(const float* x, float* y, long long batch, long long t, float value, cudaStream_t s) {
  return causal_mask_t(x, y, batch, t, value, s);
}
cudaError_t causal_mask(const Bf16* x, Bf16* y, long long batch, long long t, float value, cudaStream_t s) {
  return causal_mask_t(x, y, batch, t, value, s);
}

}  // namespace baton::cuda::launch
