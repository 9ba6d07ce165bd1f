#pragma once
// Private to kernels/src/cuda: the CUDA kernels' launchers, compiled by nvcc (C++17) from the
// .cu files and called from ops.cpp (C++20). Plain pointers, sizes and a stream only; each
// returns the launch's cudaError_t, which the caller checks and reports with its actor's name.
// All tensors are dense and row-major in device memory, float32 unless a launcher says
// otherwise; labels and ids are int32.
#include <cuda_runtime.h>

namespace baton::cuda::launch {

constexpr int max_dims = 8;

/// bfloat16 in device memory, as the launchers' interface names it (raw 16-bit storage: the
/// .cu files read it as __nv_bfloat16, the host files have baton::bfloat16). A bf16 launcher
/// loads each element exactly into float32, computes as its float32 twin does and rounds the
/// result to nearest even once when it stores it: the bits that the float32 kernel run on
/// converted copies would give (KernelRegistry's fallback), without the copies.
struct Bf16 {
  unsigned short bits;
};

/// An output of `ndim` dims and, per input, the element stride along each output dim (0 where
/// the input is broadcast along it): numpy broadcasting, transposes and broadcast_to.
struct Indexing {
  int ndim = 0;
  long long shape[max_dims] = {};
  long long a[max_dims] = {};
  long long b[max_dims] = {};
};

enum class Binary : int { add, sub, mul, div, maximum };
/// pow raises to `param`; scale multiplies by it.
/// gelu_tanh is GELU's tanh form (gelu.cuh).
enum class Unary : int { relu, gelu, tanh, sigmoid, scale, exp, log, sqrt, rsqrt, silu, pow, gelu_tanh };
/// relu, gelu, silu and pow (exponent `param`) take the forward input x; tanh, sigmoid, sqrt and
/// rsqrt the forward output y.
enum class UnaryGrad : int { relu, gelu, tanh, sigmoid, sqrt, rsqrt, silu, pow, gelu_tanh };

cudaError_t binary(Binary op, const float* a, const float* b, float* c, const Indexing& ix, long long n,
                   cudaStream_t s);
cudaError_t binary(Binary op, const Bf16* a, const Bf16* b, Bf16* c, const Indexing& ix, long long n, cudaStream_t s);
cudaError_t unary(Unary op, const float* x, float* y, long long n, float param, cudaStream_t s);
cudaError_t unary(Unary op, const Bf16* x, Bf16* y, long long n, float param, cudaStream_t s);
cudaError_t unary_grad(UnaryGrad op, const float* x, const float* dy, float* dx, long long n, cudaStream_t s,
                       float param = 0);
cudaError_t unary_grad(UnaryGrad op, const Bf16* x, const Bf16* dy, Bf16* dx, long long n, cudaStream_t s,
                       float param = 0);
cudaError_t fill(float* y, long long n, float value, cudaStream_t s);
cudaError_t fill(Bf16* y, long long n, float value, cudaStream_t s);
/// y[i] = x[sum_d idx_d(i) * ix.a[d]]: transpose and broadcast_to.
cudaError_t gather(const float* x, float* y, const Indexing& ix, long long n, cudaStream_t s);
/// The same for elements of `elem_bytes` bytes (2, 4 or 8): it moves bytes, so any dtype.
cudaError_t gather_bytes(const void* x, void* y, int elem_bytes, const Indexing& ix, long long n, cudaStream_t s);

// Row-wise ops over the last axis: `rows` rows of `cols`.
cudaError_t softmax(const float* x, float* y, long long rows, long long cols, bool log, cudaStream_t s);
cudaError_t softmax(const Bf16* x, Bf16* y, long long rows, long long cols, bool log, cudaStream_t s);
cudaError_t softmax_grad(const float* y, const float* dy, float* dx, long long rows, long long cols, bool log,
                         cudaStream_t s);
cudaError_t softmax_grad(const Bf16* y, const Bf16* dy, Bf16* dx, long long rows, long long cols, bool log,
                         cudaStream_t s);
/// loss[0] = mean over rows of the cross-entropy; row_loss is scratch of `rows` doubles.
cudaError_t cross_entropy(const float* logits, const int* labels, float* loss, double* row_loss, long long rows,
                          long long cols, cudaStream_t s);
cudaError_t cross_entropy_grad(const float* logits, const int* labels, const float* dloss, float* dlogits,
                               long long rows, long long cols, cudaStream_t s);
cudaError_t layer_norm(const float* x, float* y, long long rows, long long cols, double eps, cudaStream_t s);
cudaError_t layer_norm(const Bf16* x, Bf16* y, long long rows, long long cols, double eps, cudaStream_t s);
cudaError_t layer_norm_grad(const float* x, const float* dy, float* dx, long long rows, long long cols, double eps,
                            cudaStream_t s);
cudaError_t layer_norm_grad(const Bf16* x, const Bf16* dy, Bf16* dx, long long rows, long long cols, double eps,
                            cudaStream_t s);
// The LLM ops (llm.cu), f32: RMSNorm over the last axis (`rows` rows of `cols`) and its
// gradients (rstd: scratch of `rows` doubles); the rotary embedding of x [blocks, t_len, 2 half]
// by tables [t_len, half] of cos and sin (negated sin: its gradient).
cudaError_t rms_norm(const float* x, const float* w, float* y, long long rows, long long cols, double eps,
                     cudaStream_t s);
cudaError_t rms_norm_grad(const float* x, const float* w, const float* dy, float* dx, long long rows, long long cols,
                          double eps, cudaStream_t s);
cudaError_t rms_norm_grad_weight(const float* x, const float* dy, double* rstd, float* dw, long long rows,
                                 long long cols, double eps, cudaStream_t s);
cudaError_t rope(const float* x, const float* cos_table, const float* sin_table, float* y, long long blocks,
                 long long t_len, long long half, cudaStream_t s);
/// Serving's decode ops (decode.cu). rope_at: x [rows, heads, 2 half] rotated row by row by
/// positions[row] (int32; a negative one by 0), inv_freq [half] the table made on the host.
cudaError_t rope_at(const float* x, const int* positions, const float* inv_freq, float* y, long long rows,
                    long long heads, long long half, cudaStream_t s);
/// paged_attention (ops_decode.cpp's semantics): writes each live row's k and v [rows, kv_heads,
/// d] into k_cache / v_cache [blocks, block_size, kv_heads, d] at its slot and position (int32
/// slots, positions [rows], table [n_slots, per_slot]), then o [rows, heads, d] = each row's
/// causal attention over its slot's positions 0..position; padding rows (slot < 0) zero, rows
/// whose slot, position or block lies outside the table or the cache NaN.
/// paged_attention_shared_bytes: the dynamic shared memory one block needs (the query row and
/// a score per position of a slot).
unsigned long paged_attention_shared_bytes(long long d, long long per_slot, long long block_size);
cudaError_t paged_attention(const float* q, const float* k, const float* v, const int* slots, const int* positions,
                            const int* table, float* k_cache, float* v_cache, float* o, long long rows, long long heads,
                            long long kv_heads, long long d, long long n_slots, long long per_slot, long long blocks,
                            long long block_size, float scale, cudaStream_t s);
/// y[i, :] = table[ids[i] - start, :] for a table of `rows` rows holding entries
/// [start, start + rows) of a vocabulary [0, vocab); an id of another shard, or outside the
/// vocabulary (the CPU throws there), gives a zero row. Unsharded: start 0, vocab = rows.
cudaError_t embedding(const float* table, const int* ids, float* y, long long n, long long d, long long rows,
                      long long start, long long vocab, cudaStream_t s);
cudaError_t embedding(const Bf16* table, const int* ids, Bf16* y, long long n, long long d, long long rows,
                      long long start, long long vocab, cudaStream_t s);
/// dtable = 0, then dtable[ids[i] - start, :] += dy[i, :] for the ids the shard holds, each row's
/// positions added in increasing order as on the CPU (no atomics: the same bits every run).
/// `scratch` is device memory of embedding_grad_scratch(n, rows) bytes; n and rows below 2^31.
cudaError_t embedding_grad(const int* ids, const float* dy, float* dtable, long long n, long long d, long long rows,
                           long long start, long long vocab, void* scratch, size_t scratch_bytes, cudaStream_t s);
size_t embedding_grad_scratch(long long n, long long rows);
/// y = x with y[..., i, j] = value where j > i, over `batch` matrices of t x t.
cudaError_t causal_mask(const float* x, float* y, long long batch, long long t, float value, cudaStream_t s);
cudaError_t causal_mask(const Bf16* x, Bf16* y, long long batch, long long t, float value, cudaStream_t s);

// Vocabulary-parallel cross-entropy (baton/kernels/ops_nn.cpp): logits [rows, cols] hold
// classes [start, start + cols) of [0, vocab); a label outside [0, vocab) (the CPU throws)
// makes its row's stats and gradient NaN.
/// stats[r] = (sum_j exp(logits[r, j] - row_max[r]), logits[r, label - start] or 0).
cudaError_t vocab_ce_stats(const float* logits, const int* labels, const float* row_max, float* stats, long long rows,
                           long long cols, long long start, long long vocab, cudaStream_t s);
/// dlogits = exp(logits - row_max) * dstats[:, 0] + onehot(label - start) * dstats[:, 1].
cudaError_t vocab_ce_stats_grad(const float* logits, const int* labels, const float* row_max, const float* dstats,
                                float* dlogits, long long rows, long long cols, long long start, long long vocab,
                                cudaStream_t s);

/// The scalar means (mse, vocab_ce_loss) sum in `mean_parts` blocks, then one block adds the
/// parts in a fixed order: `partial` is device scratch of mean_parts doubles.
constexpr int mean_parts = 256;
/// loss[0] = mean of (pred - target)^2 (NaN for n = 0, as the CPU).
cudaError_t mse(const float* pred, const float* target, float* loss, double* partial, long long n, cudaStream_t s);
/// dpred = (2 dloss / n) (pred - target), the factor rounded to float once as on the CPU.
cudaError_t mse_grad(const float* pred, const float* target, const float* dloss, float* dpred, long long n,
                     cudaStream_t s);
/// loss[0] = mean over rows of log(stats[r, 0]) + row_max[r] - stats[r, 1].
cudaError_t vocab_ce_loss(const float* stats, const float* row_max, float* loss, double* partial, long long rows,
                          cudaStream_t s);
/// dstats[r] = (dloss / (rows stats[r, 0]), -dloss / rows).
cudaError_t vocab_ce_loss_grad(const float* stats, const float* dloss, float* dstats, long long rows, cudaStream_t s);

/// Dropout as the CPU draws it (baton/kernels/ops_nn.cpp), bit for bit: element i of piece
/// `piece` is kept, as x[i] * scale, when the top 53 bits of splitmix64's output i of the stream
/// keyed by (seed, piece) reach `threshold` (ceil(p 2^53)); otherwise it is 0.
cudaError_t dropout(const float* x, float* y, long long n, long long seed, long long piece,
                    unsigned long long threshold, float scale, cudaStream_t s);
cudaError_t dropout(const double* x, double* y, long long n, long long seed, long long piece,
                    unsigned long long threshold, double scale, cudaStream_t s);

/// Copies `rows` runs of `run` elements of `elem_bytes` (1, 2, 4 or 8) bytes:
/// dst[r * dst_pitch + j] = src[r * src_pitch + j], pitches in elements. The pointers may be
/// on different devices only when the runs are contiguous (one cudaMemcpyAsync).
cudaError_t copy_runs(const void* src, void* dst, int elem_bytes, long long rows, long long run, long long src_pitch,
                      long long dst_pitch, cudaStream_t s);

enum class Reduce : int { sum, max };
/// y[o] = the sum times `factor` (a mean: 1 / count), or the maximum, of x over the reduced
/// index space: sum_to, sum, mean and max. `out` indexes x by the output's elements (x's dims,
/// extent 1 and stride 0 along a reduced dim), `red` walks the reduced dims (their extents, and
/// x's strides in red.a). In double; the maximum of nothing is -infinity and a NaN wins, as on
/// the CPU.
cudaError_t reduce(Reduce op, const float* x, float* y, const Indexing& out, long long n_out, const Indexing& red,
                   long long n_red, double factor, cudaStream_t s);
cudaError_t reduce(Reduce op, const double* x, double* y, const Indexing& out, long long n_out, const Indexing& red,
                   long long n_red, double factor, cudaStream_t s);
cudaError_t reduce(Reduce op, const Bf16* x, Bf16* y, const Indexing& out, long long n_out, const Indexing& red,
                   long long n_red, double factor, cudaStream_t s);

/// c[i] = a[i] + b[i] over n elements (c may be a): the all-reduce's adds, in the element type.
cudaError_t add(const float* a, const float* b, float* c, long long n, cudaStream_t s);
cudaError_t add(const double* a, const double* b, double* c, long long n, cudaStream_t s);

/// One Adam/AdamW step with the per-step constants of baton/kernels/optim.cpp, computed there
/// in double and rounded once, so that each element follows the CPU's float arithmetic:
///   g' = g + l2 w;  m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2;
///   w = w decay - step_size m / (sqrt(v) inv_bc2_sqrt + eps)
struct AdamConstants {
  float b1, b2, one_minus_b1, one_minus_b2, step_size, inv_bc2_sqrt, eps, decay, l2;
};
/// Where an optimizer step also writes the new weights (n elements): float32, or bfloat16 rounded
/// to nearest even (convert()'s rounding); data null: nowhere.
struct WeightCopy {
  void* data = nullptr;
  bool bf16 = false;
};
cudaError_t adam(float* w, const float* g, float* m, float* v, long long n, const AdamConstants& k, WeightCopy copy,
                 cudaStream_t s);
/// One SGD step; `first` is step 1 (the momentum buffer starts as the gradient).
cudaError_t sgd(float* w, const float* g, float* buf, long long n, double lr, double momentum, double weight_decay,
                bool nesterov, bool first, WeightCopy copy, cudaStream_t s);

}  // namespace baton::cuda::launch
