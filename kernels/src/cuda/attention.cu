// Fused causal attention on the GPU, after FlashAttention-2 (Dao, 2023): a block of threads owns
// a block of query rows (the forward, dq) or of keys (dk, dv) and walks the other side in tiles
// through shared memory; the T x T scores never reach global memory.
//
// Forward: S = Q K^T per tile, an online softmax per row (running maximum m, running sum l, the
// output rescaled by 2^(m_old - m_new)), O += P V; at the end O / l. Backward, atomics-free in
// two kernels: per block of query rows, a first pass over the keys recomputes each row's
// log-sum-exp (graph nodes have one output, so the forward cannot hand it over) and D =
// rowsum(dO * O), writes both for the second kernel, and a second pass accumulates
// dQ = sum_j dS_ij K_j with P = 2^(S scale log2e - lse), dP = dO V^T, dS = P (dP - D) scale;
// per block of keys, the second kernel accumulates dV = P^T dO and dK = dS^T Q over the query
// rows. Grouped-query heads: query head h reads key and value head h / group; the second kernel
// runs per kv head and walks the query rows of each of its group's heads in turn.
//
// Every product is a warp's 16-row tile times a tile in shared memory (warp_gemm), written as
// float32 to the warp's scratch; the softmax and the accumulators then work on that scratch
// through a layout of our own (lane l: row l / 2, every other column from l % 2), so the code is
// the same for both element types. bf16 products run on tensor cores (WMMA m16n16k16, float32
// accumulation; P and dS are rounded to bf16 for them, as FlashAttention does); float32
// products are float32 FMAs on the CUDA cores (correct and simple, not fast). Exponentials are
// exp2f of scores pre-scaled by log2(e).
#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "launch_fused.h"

namespace baton::cuda::launch {
namespace {

constexpr double log2e = 1.44269504088896340736;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

/// The tiling for element type T and head size D (a multiple of 16; smaller heads are padded).
/// Pitches keep WMMA's rules: 16-bit tiles a multiple of 8 elements, float32 ones of 4, every
/// 16-row tile 32-byte aligned.
template <class T, int D>
struct Tile {
  static constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  static constexpr int warps = bf16 ? 4 : 2;
  static constexpr int threads = 32 * warps;
  static constexpr int rows = 16 * warps;      // query rows (dk/dv: keys) a block owns
  static constexpr int cols = bf16 ? 64 : 32;  // keys (dk/dv: query rows) per step
  static constexpr int ld = D + 8;             // pitch of the [.][D] tiles
  static constexpr int pld = cols + 8;         // pitch of the P and dS tiles
  static constexpr int wide = (cols > D ? cols : D) + 4;  // float scratch of rows x max(cols, D)
  static constexpr int narrow = cols + 4;                 // float scratch of rows x cols
  static constexpr int half = D / 2;                      // accumulator columns per lane
  static constexpr int half_cols = cols / 2;              // score columns per lane

  static constexpr size_t forward_bytes() {
    return sizeof(T) * (rows * ld + 2 * cols * ld + rows * pld) + sizeof(float) * rows * wide;
  }
  static constexpr size_t dq_bytes() {
    return sizeof(T) * (2 * rows * ld + 2 * cols * ld + rows * pld) + sizeof(float) * rows * (wide + narrow);
  }
  static constexpr size_t dkdv_bytes() {
    return sizeof(T) * (2 * rows * ld + 2 * cols * ld + rows * pld) + sizeof(float) * (rows * (wide + narrow) + 2 * cols);
  }
  static_assert(D % 16 == 0 && D <= 128, "head sizes 16, 32, 64, 128");
  static_assert((rows * ld * sizeof(T)) % 128 == 0 && (cols * ld * sizeof(T)) % 128 == 0, "aligned tiles");
  static_assert((rows * pld * sizeof(T)) % 128 == 0 && (rows * wide * 4) % 128 == 0 && (rows * narrow * 4) % 128 == 0,
                "aligned tiles");
};

/// Hands out consecutive pieces of the dynamic shared memory.
struct Carve {
  unsigned char* p;
  template <class U>
  __device__ U* take(int count) {
    U* r = reinterpret_cast<U*>(p);
    p += static_cast<size_t>(count) * sizeof(U);
    return r;
  }
};

// ---- one warp's products ----------------------------------------------------------------------

// c[16][N] (float, pitch ldc) = a[16][K] (pitch lda) times B[K][N], where B[k][n] is b[n * ldb + k]
// when BCol (B is the transpose of a row-major tile: K^T, V^T, Q^T, dO^T) and b[k * ldb + n]
// otherwise. All in shared memory; the whole warp calls it. CUDA-core version: lane l computes
// row l % 16, columns 2 j + l / 16.
template <int N, int K, bool BCol, class T>
__device__ __forceinline__ void warp_gemm_fma(const T* a, int lda, const T* b, int ldb, float* c, int ldc) {
  const int lane = threadIdx.x & 31;
  const int r = lane & 15, h = lane >> 4;
  float acc[N / 2];
#pragma unroll
  for (int j = 0; j < N / 2; ++j) acc[j] = 0.f;
  const T* ar = a + r * lda;
#pragma unroll 2
  for (int kk = 0; kk < K; ++kk) {
    const float av = to_f(ar[kk]);
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const int n = 2 * j + h;
      acc[j] = fmaf(av, to_f(BCol ? b[n * ldb + kk] : b[kk * ldb + n]), acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < N / 2; ++j) c[r * ldc + 2 * j + h] = acc[j];
}

template <int N, int K, bool BCol>
__device__ __forceinline__ void warp_gemm(const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  warp_gemm_fma<N, K, BCol>(a, lda, b, ldb, c, ldc);
}

// bf16 operands on tensor cores, float32 accumulation (WMMA needs sm_80 for bf16).
template <int N, int K, bool BCol>
__device__ __forceinline__ void warp_gemm(const __nv_bfloat16* a, int lda, const __nv_bfloat16* b, int ldb, float* c,
                                          int ldc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  using BLayout = typename std::conditional<BCol, wmma::col_major, wmma::row_major>::type;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[N / 16];
#pragma unroll
  for (int n = 0; n < N / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + kk * 16, lda);
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> fb;
      // col_major: B[k][n] at p[n * ldb + k]; row_major: at p[k * ldb + n].
      const __nv_bfloat16* p = BCol ? b + n * 16 * ldb + kk * 16 : b + kk * 16 * ldb + n * 16;
      wmma::load_matrix_sync(fb, p, ldb);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < N / 16; ++n) wmma::store_matrix_sync(c + n * 16, acc[n], ldc, wmma::mem_row_major);
#else
  warp_gemm_fma<N, K, BCol>(a, lda, b, ldb, c, ldc);
#endif
}

// ---- tiles from global memory -----------------------------------------------------------------

// Rows [row0, row0 + NROWS) of a head's [t, d] matrix into dst [NROWS][ld], D columns: zeros
// past row t and past column d. `vec`: d == D and 16-byte aligned rows, read 16 bytes at a time.
template <class T, int D, int NROWS, int NTHREADS>
__device__ __forceinline__ void load_rows(T* dst, int ld, const T* src, int row0, int t, int d, bool vec) {
  if (vec) {
    constexpr int per = 16 / sizeof(T);
    constexpr int chunks = D / per;
    for (int idx = threadIdx.x; idx < NROWS * chunks; idx += NTHREADS) {
      const int r = idx / chunks, c = idx % chunks, row = row0 + r;
      uint4 value = make_uint4(0u, 0u, 0u, 0u);
      if (row < t) value = *reinterpret_cast<const uint4*>(src + static_cast<long long>(row) * D + c * per);
      *reinterpret_cast<uint4*>(dst + r * ld + c * per) = value;
    }
  } else {
    for (int idx = threadIdx.x; idx < NROWS * D; idx += NTHREADS) {
      const int r = idx / D, c = idx % D, row = row0 + r;
      dst[r * ld + c] = row < t && c < d ? src[static_cast<long long>(row) * d + c] : from_f<T>(0.f);
    }
  }
}

// The first query row of this block, the last row blocks first: under the causal mask a block's
// work grows with its rows (it reads every key up to them), and the blocks run roughly in the
// order of blockIdx (x, the head, fastest), so the heaviest start first and the lightest fill
// the tail, as FlashAttention-2 orders them. (The dk/dv kernel's heaviest blocks, the first
// keys, come first already.)
template <int ROWS>
__device__ __forceinline__ int heaviest_first_rows() {
  return static_cast<int>(gridDim.y - 1 - blockIdx.y) * ROWS;
}

// ---- forward ----------------------------------------------------------------------------------

template <class T, int D>
__global__ void __launch_bounds__(Tile<T, D>::threads)
    attention_forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             T* __restrict__ o, float* __restrict__ lse, int group, int t, int d, float scale2,
                             bool causal, bool vec) {
  using C = Tile<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carve carve{smem};
  T* sq = carve.take<T>(C::rows * C::ld);
  T* sk = carve.take<T>(C::cols * C::ld);
  T* sv = carve.take<T>(C::cols * C::ld);
  T* sp = carve.take<T>(C::rows * C::pld);
  float* ss = carve.take<float>(C::rows * C::wide);

  const long long head = blockIdx.x;
  const long long base = head * t * d;
  const long long kv_base = head / group * t * d;  // its key and value head (grouped-query heads)
  const int i0 = heaviest_first_rows<C::rows>();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 1, h = lane & 1;  // this lane's row of its warp's 16, and its column parity
  const int qi = i0 + warp * 16 + r;
  const T* qw = sq + warp * 16 * C::ld;
  T* pw = sp + warp * 16 * C::pld;
  float* sw = ss + warp * 16 * C::wide;

  load_rows<T, D, C::rows, C::threads>(sq, C::ld, q + base, i0, t, d, vec);
  float m = -INFINITY, l = 0.f;
  float acc[C::half];
#pragma unroll
  for (int j = 0; j < C::half; ++j) acc[j] = 0.f;
  const int key_end = causal ? min(t, i0 + C::rows) : t;
  for (int j0 = 0; j0 < key_end; j0 += C::cols) {
    __syncthreads();  // every warp is done with the last tiles
    load_rows<T, D, C::cols, C::threads>(sk, C::ld, k + kv_base, j0, t, d, vec);
    load_rows<T, D, C::cols, C::threads>(sv, C::ld, v + kv_base, j0, t, d, vec);
    __syncthreads();
    warp_gemm<C::cols, D, true>(qw, C::ld, sk, C::ld, sw, C::wide);  // S = Q K^T
    __syncwarp();
    float s[C::half_cols];
    float tile_max = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < C::half_cols; ++jj) {
      const int c = 2 * jj + h, key = j0 + c;
      const bool hidden = key >= t || (causal && key > qi);
      s[jj] = hidden ? -INFINITY : sw[r * C::wide + c] * scale2;
      tile_max = fmaxf(tile_max, s[jj]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float shift = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet: every p is 0
    const float rescale = exp2f(m - shift);
    float row_sum = 0.f;
#pragma unroll
    for (int jj = 0; jj < C::half_cols; ++jj) {
      const float p = exp2f(s[jj] - shift);
      row_sum += p;
      pw[r * C::pld + 2 * jj + h] = from_f<T>(p);
    }
    row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
    l = l * rescale + row_sum;
    m = m_new;
#pragma unroll
    for (int j = 0; j < C::half; ++j) acc[j] *= rescale;
    __syncwarp();
    warp_gemm<D, C::cols, false>(pw, C::pld, sv, C::ld, sw, C::wide);  // P V
    __syncwarp();
#pragma unroll
    for (int j = 0; j < C::half; ++j) acc[j] += sw[r * C::wide + 2 * j + h];
  }
  if (qi < t) {
    const float inv = 1.f / l;
    T* out = o + base + static_cast<long long>(qi) * d;
#pragma unroll
    for (int j = 0; j < C::half; ++j) {
      const int c = 2 * j + h;
      if (c < d) out[c] = from_f<T>(acc[j] * inv);
    }
    if (lse != nullptr && h == 0) lse[head * t + qi] = static_cast<float>((m + log2f(l)) / log2e);
  }
}

// ---- backward: dq (and the rows' log-sum-exp and D) ---------------------------------------------

template <class T, int D>
__global__ void __launch_bounds__(Tile<T, D>::threads)
    attention_dq_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const T* __restrict__ o, const T* __restrict__ dout, T* __restrict__ dq_out, long long ld,
                        const float* __restrict__ lse_in, float* __restrict__ lse2_out, float* __restrict__ delta_out,
                        int group, int t, int d, float scale2, float scale, bool causal, bool vec) {
  using C = Tile<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carve carve{smem};
  T* sq = carve.take<T>(C::rows * C::ld);
  T* sdo = carve.take<T>(C::rows * C::ld);
  T* sk = carve.take<T>(C::cols * C::ld);
  T* sv = carve.take<T>(C::cols * C::ld);
  T* sds = carve.take<T>(C::rows * C::pld);
  float* ss1 = carve.take<float>(C::rows * C::wide);
  float* ss2 = carve.take<float>(C::rows * C::narrow);

  const long long head = blockIdx.x;
  const long long base = head * t * d;
  const long long kv_base = head / group * t * d;
  const int i0 = heaviest_first_rows<C::rows>();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 1, h = lane & 1;
  const int qi = i0 + warp * 16 + r;
  const T* qw = sq + warp * 16 * C::ld;
  const T* dow = sdo + warp * 16 * C::ld;
  T* dsw = sds + warp * 16 * C::pld;
  float* s1w = ss1 + warp * 16 * C::wide;
  float* s2w = ss2 + warp * 16 * C::narrow;

  load_rows<T, D, C::rows, C::threads>(sq, C::ld, q + base, i0, t, d, vec);
  load_rows<T, D, C::rows, C::threads>(sdo, C::ld, dout + base, i0, t, d, vec);
  __syncthreads();
  // D_i = do_i . o_i, the lane pair's halves added.
  float delta = 0.f;
  if (qi < t) {
    const T* orow = o + base + static_cast<long long>(qi) * d;
#pragma unroll
    for (int j = 0; j < C::half; ++j) {
      const int c = 2 * j + h;
      if (c < d) delta += to_f(orow[c]) * to_f(dow[r * C::ld + c]);
    }
  }
  delta += __shfl_xor_sync(0xffffffffu, delta, 1);

  // Pass 1: the rows' log-sum-exp (base 2, of the scores times scale log2e), online; or the
  // forward's (natural log: times log2e), where the plan saved it. lse_in is the same for every
  // thread of the grid, so the block's barriers below are taken by all or none.
  const int key_end = causal ? min(t, i0 + C::rows) : t;
  float m = -INFINITY, l = 0.f;
  for (int j0 = 0; lse_in == nullptr && j0 < key_end; j0 += C::cols) {
    __syncthreads();
    load_rows<T, D, C::cols, C::threads>(sk, C::ld, k + kv_base, j0, t, d, vec);
    __syncthreads();
    warp_gemm<C::cols, D, true>(qw, C::ld, sk, C::ld, s1w, C::wide);
    __syncwarp();
    float s[C::half_cols];
    float tile_max = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < C::half_cols; ++jj) {
      const int c = 2 * jj + h, key = j0 + c;
      const bool hidden = key >= t || (causal && key > qi);
      s[jj] = hidden ? -INFINITY : s1w[r * C::wide + c] * scale2;
      tile_max = fmaxf(tile_max, s[jj]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float shift = m_new == -INFINITY ? 0.f : m_new;
    float row_sum = 0.f;
#pragma unroll
    for (int jj = 0; jj < C::half_cols; ++jj) row_sum += exp2f(s[jj] - shift);
    row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
    l = l * exp2f(m - shift) + row_sum;
    m = m_new;
  }
  const float lse2 = lse_in == nullptr ? m + log2f(l) : (qi < t ? lse_in[head * t + qi] * static_cast<float>(log2e) : 0.f);
  if (qi < t && h == 0) {
    lse2_out[head * t + qi] = lse2;
    delta_out[head * t + qi] = delta;
  }

  // Pass 2: dq = sum over key tiles of dS K.
  float acc[C::half];
#pragma unroll
  for (int j = 0; j < C::half; ++j) acc[j] = 0.f;
  for (int j0 = 0; j0 < key_end; j0 += C::cols) {
    __syncthreads();
    load_rows<T, D, C::cols, C::threads>(sk, C::ld, k + kv_base, j0, t, d, vec);
    load_rows<T, D, C::cols, C::threads>(sv, C::ld, v + kv_base, j0, t, d, vec);
    __syncthreads();
    warp_gemm<C::cols, D, true>(qw, C::ld, sk, C::ld, s1w, C::wide);     // S = Q K^T
    warp_gemm<C::cols, D, true>(dow, C::ld, sv, C::ld, s2w, C::narrow);  // dP = dO V^T
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < C::half_cols; ++jj) {
      const int c = 2 * jj + h, key = j0 + c;
      const bool hidden = key >= t || (causal && key > qi);
      const float p = hidden ? 0.f : exp2f(s1w[r * C::wide + c] * scale2 - lse2);
      dsw[r * C::pld + c] = from_f<T>(p * (s2w[r * C::narrow + c] - delta) * scale);
    }
    __syncwarp();
    warp_gemm<D, C::cols, false>(dsw, C::pld, sk, C::ld, s1w, C::wide);  // dS K
    __syncwarp();
#pragma unroll
    for (int j = 0; j < C::half; ++j) acc[j] += s1w[r * C::wide + 2 * j + h];
  }
  if (qi < t) {
    T* out = dq_out + (head * t + qi) * ld;
#pragma unroll
    for (int j = 0; j < C::half; ++j) {
      const int c = 2 * j + h;
      if (c < d) out[c] = from_f<T>(acc[j]);
    }
  }
}

// ---- backward: dk and dv ------------------------------------------------------------------------

template <class T, int D>
__global__ void __launch_bounds__(Tile<T, D>::threads)
    attention_dkdv_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const T* __restrict__ dout, T* __restrict__ dk_out, T* __restrict__ dv_out, long long ld,
                          const float* __restrict__ lse2_in,
                          const float* __restrict__ delta_in, int group, int t, int d, float scale2, float scale,
                          bool causal, bool vec) {
  using C = Tile<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carve carve{smem};
  T* sk = carve.take<T>(C::rows * C::ld);
  T* sv = carve.take<T>(C::rows * C::ld);
  T* sq = carve.take<T>(C::cols * C::ld);
  T* sdo = carve.take<T>(C::cols * C::ld);
  T* spt = carve.take<T>(C::rows * C::pld);
  float* ss1 = carve.take<float>(C::rows * C::narrow);
  float* ss2 = carve.take<float>(C::rows * C::wide);
  float* s_lse = carve.take<float>(C::cols);
  float* s_delta = carve.take<float>(C::cols);

  const long long kv_head = blockIdx.x;  // a key and value head, read by `group` query heads
  const long long kv_base = kv_head * t * d;
  const int j0 = static_cast<int>(blockIdx.y) * C::rows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 1, h = lane & 1;
  const int kj = j0 + warp * 16 + r;  // this lane's key
  const T* kw = sk + warp * 16 * C::ld;
  const T* vw = sv + warp * 16 * C::ld;
  T* ptw = spt + warp * 16 * C::pld;
  float* s1w = ss1 + warp * 16 * C::narrow;
  float* s2w = ss2 + warp * 16 * C::wide;

  load_rows<T, D, C::rows, C::threads>(sk, C::ld, k + kv_base, j0, t, d, vec);
  load_rows<T, D, C::rows, C::threads>(sv, C::ld, v + kv_base, j0, t, d, vec);
  float dk[C::half], dv[C::half];
#pragma unroll
  for (int j = 0; j < C::half; ++j) dk[j] = dv[j] = 0.f;
  // Causal: query rows before the first tile holding j0 see none of these keys.
  const int q_begin = causal ? j0 / C::cols * C::cols : 0;
  // The query rows of each of the kv head's query heads in turn: dk and dv add up over them.
  for (long long head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    const long long base = head * t * d;
    for (int i0 = q_begin; i0 < t; i0 += C::cols) {
      __syncthreads();
      load_rows<T, D, C::cols, C::threads>(sq, C::ld, q + base, i0, t, d, vec);
      load_rows<T, D, C::cols, C::threads>(sdo, C::ld, dout + base, i0, t, d, vec);
      for (int idx = threadIdx.x; idx < C::cols; idx += C::threads) {
        const int row = i0 + idx;
        s_lse[idx] = row < t ? lse2_in[head * t + row] : 0.f;
        s_delta[idx] = row < t ? delta_in[head * t + row] : 0.f;
      }
      __syncthreads();
      warp_gemm<C::cols, D, true>(kw, C::ld, sq, C::ld, s1w, C::narrow);  // S^T = K Q^T
      __syncwarp();
#pragma unroll
      for (int jj = 0; jj < C::half_cols; ++jj) {
        const int c = 2 * jj + h, query = i0 + c;
        const bool hidden = query >= t || (causal && kj > query);
        const float p = hidden ? 0.f : exp2f(s1w[r * C::narrow + c] * scale2 - s_lse[c]);
        s1w[r * C::narrow + c] = p;
        ptw[r * C::pld + c] = from_f<T>(p);
      }
      __syncwarp();
      warp_gemm<D, C::cols, false>(ptw, C::pld, sdo, C::ld, s2w, C::wide);  // P^T dO
      __syncwarp();
#pragma unroll
      for (int j = 0; j < C::half; ++j) dv[j] += s2w[r * C::wide + 2 * j + h];
      __syncwarp();
      warp_gemm<C::cols, D, true>(vw, C::ld, sdo, C::ld, s2w, C::wide);  // dP^T = V dO^T
      __syncwarp();
#pragma unroll
      for (int jj = 0; jj < C::half_cols; ++jj) {
        const int c = 2 * jj + h;
        ptw[r * C::pld + c] = from_f<T>(s1w[r * C::narrow + c] * (s2w[r * C::wide + c] - s_delta[c]) * scale);
      }
      __syncwarp();
      warp_gemm<D, C::cols, false>(ptw, C::pld, sq, C::ld, s2w, C::wide);  // dS^T Q
      __syncwarp();
#pragma unroll
      for (int j = 0; j < C::half; ++j) dk[j] += s2w[r * C::wide + 2 * j + h];
    }
  }
  if (kj < t) {
    T* dk_row = dk_out + (kv_head * t + kj) * ld;
    T* dv_row = dv_out + (kv_head * t + kj) * ld;
#pragma unroll
    for (int j = 0; j < C::half; ++j) {
      const int c = 2 * j + h;
      if (c < d) {
        dk_row[c] = from_f<T>(dk[j]);
        dv_row[c] = from_f<T>(dv[j]);
      }
    }
  }
}

// ---- launchers ----------------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Calls fn with the compiled head size for d (the smallest of 16, 32, 64, 128 that holds it).
template <class Fn>
cudaError_t by_head_size(long long d, Fn fn) {
  if (d <= 16) return fn(std::integral_constant<int, 16>{});
  if (d <= 32) return fn(std::integral_constant<int, 32>{});
  if (d <= 64) return fn(std::integral_constant<int, 64>{});
  if (d <= 128) return fn(std::integral_constant<int, 128>{});
  return cudaErrorInvalidValue;
}

template <class Kernel>
cudaError_t allow_shared(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <class T>
cudaError_t forward_t(const T* q, const T* k, const T* v, T* o, float* lse, long long heads, long long group,
                      long long t, long long d, double scale, bool causal, cudaStream_t s) {
  if (heads == 0 || t == 0) return cudaSuccess;
  if (d < 1 || t > 0x7fffffffLL || heads > 0x7fffffffLL || group < 1 || heads % group != 0) {
    return cudaErrorInvalidValue;
  }
  const bool vec_ok = aligned16(q) && aligned16(k) && aligned16(v);
  const auto scale2 = static_cast<float>(scale * log2e);
  return by_head_size(d, [&](auto head_size) {
    constexpr int D = decltype(head_size)::value;
    using C = Tile<T, D>;
    const unsigned blocks = static_cast<unsigned>((t + C::rows - 1) / C::rows);
    if (blocks > 65535) return cudaErrorInvalidValue;
    auto kernel = attention_forward_kernel<T, D>;
    if (cudaError_t e = allow_shared(kernel, C::forward_bytes()); e != cudaSuccess) return e;
    kernel<<<dim3(static_cast<unsigned>(heads), blocks), C::threads, C::forward_bytes(), s>>>(
        q, k, v, o, lse, static_cast<int>(group), static_cast<int>(t), static_cast<int>(d), scale2, causal,
        vec_ok && d == D);
    return cudaGetLastError();
  });
}

template <class T>
cudaError_t backward_t(const T* q, const T* k, const T* v, const T* o, const T* dout, T* dq_out, T* dk_out,
                       T* dv_out, long long ld, const float* lse, void* scratch, long long heads, long long group,
                       long long t, long long d, double scale, bool causal, cudaStream_t s) {
  if (heads == 0 || t == 0) return cudaSuccess;
  if (d < 1 || ld < d || t > 0x7fffffffLL || heads > 0x7fffffffLL || group < 1 || heads % group != 0) {
    return cudaErrorInvalidValue;
  }
  const bool vec_ok = aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const auto scale2 = static_cast<float>(scale * log2e);
  float* lse2 = static_cast<float*>(scratch);
  float* delta = lse2 + heads * t;
  return by_head_size(d, [&](auto head_size) {
    constexpr int D = decltype(head_size)::value;
    using C = Tile<T, D>;
    const unsigned blocks = static_cast<unsigned>((t + C::rows - 1) / C::rows);
    if (blocks > 65535) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(heads), blocks);
    const dim3 kv_grid(static_cast<unsigned>(heads / group), blocks);  // dk and dv: per key and value head
    const bool vec = vec_ok && d == D;
    auto dq = attention_dq_kernel<T, D>;
    if (cudaError_t e = allow_shared(dq, C::dq_bytes()); e != cudaSuccess) return e;
    dq<<<grid, C::threads, C::dq_bytes(), s>>>(q, k, v, o, dout, dq_out, ld, lse, lse2, delta, static_cast<int>(group),
                                               static_cast<int>(t), static_cast<int>(d), scale2,
                                               static_cast<float>(scale), causal, vec);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    auto dkdv = attention_dkdv_kernel<T, D>;
    if (cudaError_t e = allow_shared(dkdv, C::dkdv_bytes()); e != cudaSuccess) return e;
    dkdv<<<kv_grid, C::threads, C::dkdv_bytes(), s>>>(q, k, v, dout, dk_out, dv_out, ld, lse2, delta,
                                                      static_cast<int>(group), static_cast<int>(t),
                                                      static_cast<int>(d), scale2, static_cast<float>(scale), causal,
                                                      vec);
    return cudaGetLastError();
  });
}

const __nv_bfloat16* dev(const Bf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
__nv_bfloat16* dev(Bf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

}  // namespace

cudaError_t attention(const float* q, const float* k, const float* v, float* o, float* lse, long long heads,
                      long long group, long long t, long long d, double scale, bool causal, cudaStream_t s) {
  return forward_t(q, k, v, o, lse, heads, group, t, d, scale, causal, s);
}
cudaError_t attention(const Bf16* q, const Bf16* k, const Bf16* v, Bf16* o, float* lse, long long heads,
                      long long group, long long t, long long d, double scale, bool causal, cudaStream_t s) {
  return forward_t(dev(q), dev(k), dev(v), dev(o), lse, heads, group, t, d, scale, causal, s);
}

cudaError_t attention_grad(const float* q, const float* k, const float* v, const float* o, const float* dout,
                           GradRows out, const float* lse, void* scratch, long long heads, long long group,
                           long long t, long long d, double scale, bool causal, cudaStream_t s) {
  return backward_t(q, k, v, o, dout, static_cast<float*>(out.dq), static_cast<float*>(out.dk),
                    static_cast<float*>(out.dv), out.ld, lse, scratch, heads, group, t, d, scale, causal, s);
}
cudaError_t attention_grad(const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* o, const Bf16* dout, GradRows out,
                           const float* lse, void* scratch, long long heads, long long group, long long t,
                           long long d, double scale, bool causal, cudaStream_t s) {
  return backward_t(dev(q), dev(k), dev(v), dev(o), dev(dout), static_cast<__nv_bfloat16*>(out.dq),
                    static_cast<__nv_bfloat16*>(out.dk), static_cast<__nv_bfloat16*>(out.dv), out.ld, lse, scratch,
                    heads, group, t, d, scale, causal, s);
}

}  // namespace baton::cuda::launch
