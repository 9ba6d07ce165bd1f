#pragma once
/// The training ops' CPU kernels: the contract between the graph compiler (which emits one actor
/// per op with these names, inputs, outputs and attributes) and the kernels. Every op here is
/// registered for cpu/f32 and cpu/f64 (f64 for gradient checks against finite differences).
/// Inputs and outputs are by position; an output's shape is fixed by the plan (the compiler's
/// shape inference) and a kernel checks what it relies on, throwing std::invalid_argument that
/// names the op and the shapes. Labels and ids are i32 tensors, read as such by f32/f64 kernels.
///
/// Tensor ops (ops_tensor.cpp)
///   matmul(a, b) -> c          attrs trans_a, trans_b (0/1). a [..., M, K] ([..., K, M] if
///                              trans_a), b [K, N] or [..., K, N] with the same batch dims
///                              ([N, K] / [..., N, K] if trans_b); c [..., M, N]. OpenBLAS sgemm/dgemm.
///   add | sub | mul | div | maximum(a, b) -> c    numpy broadcasting; c has the broadcast shape
///                              (maximum: NaN if either is, as torch.maximum).
///   sum_to(x) -> y             sums x over the axes where y (broadcast-compatible) is 1 or absent:
///                              the gradient of broadcasting.
///   broadcast_to(x) -> y       repeats x to y's shape (numpy rules).
///   scale(x) -> y              y = x * attr value (double).
///   fill() -> y                every element = attr value (double); a constant source.
///   reshape(x) -> y            same elements, y's shape (copy).
///   transpose(x) -> y          attr perm (int list): y.shape[i] = x.shape[perm[i]].
///   sum | mean | max(x) -> y  attrs axes (int list; empty = all), keepdims (0/1). max of
///                              nothing is -infinity; of a NaN, NaN.
///   stop_gradient(x) -> y      a copy (autodiff passes no gradient through it).
///   slice(x) -> y              attrs axis, start: y = x[..., start : start + y.shape[axis], ...].
///   slice_grad(dy) -> dx       attrs axis, start: zeros of dx's shape with dy written at start.
///   concat(x0, x1, ...) -> y   attr axis.
///
/// Neural-network ops (ops_nn.cpp)
///   relu | gelu | tanh | sigmoid(x) -> y          gelu is the exact erf form (PyTorch's default).
///   relu_grad(x, dy) -> dx | gelu_grad(x, dy) -> dx
///   tanh_grad(y, dy) -> dx | sigmoid_grad(y, dy) -> dx      (from the forward output y)
///   softmax(x) -> y | log_softmax(x) -> y                    over the last axis
///   softmax_grad(y, dy) -> dx | log_softmax_grad(y, dy) -> dx
///   softmax_cross_entropy(logits [N, C], labels i32 [N]) -> loss []   mean over N
///   softmax_cross_entropy_grad(logits, labels, dloss []) -> dlogits [N, C]
///   mse(pred, target) -> loss []                              mean of squared differences
///   mse_grad(pred, target, dloss []) -> dpred
///   layer_norm(x) -> y                 attr eps (double, default 1e-5): (x - mean) / sqrt(var + eps)
///                                      over the last axis, no affine part (the graph adds gamma, beta)
///   layer_norm_grad(x, dy) -> dx       attr eps
///   embedding(table [V, D], ids i32 [...]) -> y [..., D]
///   embedding_grad(ids i32 [...], dy [..., D]) -> dtable [V, D]    (scatter-add; V from dtable)
///                                      Both take optional attrs vocab and vocab_start (ints, both
///                                      or neither): the table is then rows [vocab_start,
///                                      vocab_start + V) of a vocabulary of `vocab` (a tensor-
///                                      parallel shard); ids in [0, vocab) outside those rows give
///                                      zero rows and no gradient.
///
/// Vocabulary-parallel cross-entropy (Megatron-LM), logits [N, C] being classes [vocab_start,
/// vocab_start + C) of `vocab` (attrs as for embedding; without them, all C classes), row_max [N]
/// the maxima of every shard's logits:
///   vocab_parallel_ce_stats(logits, labels i32 [N], row_max) -> stats [N, 2]
///                                      stats[i] = (sum_j exp(logits[i, j] - row_max[i]),
///                                      logits[i, labels[i] - vocab_start] or 0 off this shard)
///   vocab_parallel_ce_stats_grad(logits, labels, row_max, dstats [N, 2]) -> dlogits [N, C]
///                                      exp(logits - row_max) * dstats[:, 0]
///                                      + onehot(labels - vocab_start) * dstats[:, 1]
///   vocab_parallel_ce_loss(stats [N, 2], row_max [N]) -> loss []
///                                      mean over N of log(stats[:, 0]) + row_max - stats[:, 1];
///                                      with the shards' stats summed, the cross-entropy
///   vocab_parallel_ce_loss_grad(stats, dloss []) -> dstats [N, 2]    (dloss / (N S), -dloss / N)
///   causal_mask(x [..., T, T]) -> y    attr value (double): y[..., i, j] = value where j > i
///   dropout(x) -> y                    attrs p (double), seed (int): keeps each element with
///                                      probability 1-p and scales it by 1/(1-p); the mask is a pure
///                                      function of (seed, KernelContext::piece, element index), so
///                                      dropout(dy) with the same attrs and piece is its gradient.
///
/// Fused ops (ops_nn.cpp, ops_attention.cpp; CUDA kernels for f32 and bf16 too)
///   bias_gelu(x [..., F], b [F]) -> y          gelu(x + b), the sum rounded as the add's
///   bias_gelu_grad(x, b, dy) -> dx             gelu_grad(x + b, dy) (db: sum_to of dx)
///   attention(q, k, v) -> o            q, k, v, o [..., T, D] (the leading axes: batch x heads):
///                                      o = softmax(scale q k^T, keys j > i hidden if causal) v,
///                                      without the T x T scores (online softmax, per block).
///                                      Grouped-query heads: k, v [..., Hkv, T, D] with Hkv
///                                      dividing q's H; query head h reads kv head h / (H / Hkv).
///                                      attrs causal (0/1, default 1), scale (double, default
///                                      1/sqrt(D)).
///                                      attr kernel (CUDA devices): auto (default: cuDNN's
///                                      fused attention where it loads, else baton's), cudnn,
///                                      fused (baton's).
///                                      Where the actor has a second output (a training plan
///                                      gives one), the rows' log-sum-exp of the scaled scores
///                                      stats [..., T] (f32; f64 for f64) goes there.
///   attention_grad(q, k, v, o, do[, stats]) -> dqkv [..., T, 3 D]   dq, dk, dv side by side
///                                      along the last axis; the same attrs. With the forward's
///                                      stats the softmax is not recomputed. Grouped-query
///                                      heads: dqkv [numel(q) + 2 numel(k)], dq, dk, dv one
///                                      after another (attention_grad_shape); dk and dv sum
///                                      over each kv head's query heads. Or three outputs, dq,
///                                      dk and dv of q's, k's and v's sizes.
///
/// The math of current LLMs (ops_llm.cpp; no CUDA kernels yet)
///   exp | log | sqrt | rsqrt | silu(x) -> y     silu(x) = x sigmoid(x); log, sqrt, rsqrt of a
///                                      negative are NaN (as torch), not an error
///   pow(x) -> y                        attr exponent (double, finite): x^exponent
///   sqrt_grad(y, dy) -> dx | rsqrt_grad(y, dy) -> dx          (from the forward output y)
///   silu_grad(x, dy) -> dx | pow_grad(x, dy) -> dx            (pow_grad: attr exponent)
///   rms_norm(x [..., D], w [D]) -> y   attr eps (double > 0, default 1e-6): y = x w / sqrt(mean(x^2)
///                                      + eps) over the last axis (Llama's RMSNorm)
///   rms_norm_grad(x, w, dy) -> dx | rms_norm_grad_weight(x, dy) -> dw [D]      attr eps
///   rope(x [..., T, D]) -> y           attr base (double > 0, default 10000): rotary position
///                                      embedding, position t = index on axis -2, D even, pairs
///                                      (i, i + D/2) rotated by t base^(-2i/D) (Hugging Face's
///                                      rotate_half layout)
///   rope_grad(dy) -> dx                attr base: the rotation by the negated angles
#include "baton/kernels/kernel.h"

namespace baton {

/// The shape of attention's stats for q [..., T, D]: [..., T].
inline Shape attention_stats_shape(const Shape& q) { return q.empty() ? q : Shape(q.begin(), q.end() - 1); }
/// "" when attention's k (and v) shape goes with q's: the same, or for grouped-query heads the
/// same but on axis -3, whose Hkv heads divide q's H; else what is wrong (the graph's op and
/// every kernel refuse with these words).
std::string attention_kv_mismatch(const Shape& q, const Shape& k);
/// attention_grad's output as the graph makes it: dq, dk and dv side by side along the last
/// axis, [..., T, 3 D]; with grouped-query heads (k's shape not q's) one after another, flat,
/// [numel(q) + 2 numel(k)].
Shape attention_grad_shape(const Shape& q, const Shape& k);

/// Registers the tensor ops above for cpu/f32 and cpu/f64.
void add_cpu_tensor_ops(KernelRegistry& reg);
/// Threads of every CPU matrix product (OpenBLAS's, process-wide). Default 1, or
/// BATON_BLAS_THREADS: kernels run one per actor thread, so BLAS's own threads contend with the
/// other actors; more pays where the plan leaves cores idle (one device, one micro-batch).
void set_blas_threads(int threads);
int blas_threads();
// Which OpenBLAS kernels run, and why: baton/kernels/blas_choice.h.

/// Registers the neural-network ops above (the fused ones included) for cpu/f32 and cpu/f64.
void add_cpu_nn_ops(KernelRegistry& reg);
/// Registers attention and attention_grad for cpu/f32 and cpu/f64 (add_cpu_nn_ops calls it).
void add_cpu_attention_ops(KernelRegistry& reg);
/// Registers the LLM ops above (exp ... rope_grad) for cpu/f32 and cpu/f64 (add_cpu_nn_ops
/// calls it).
void add_cpu_llm_ops(KernelRegistry& reg);
/// Registers the decoding ops (rope_at, paged_attention; graph ops.h) for cpu/f32 and cpu/f64
/// (add_cpu_nn_ops calls it).
void add_cpu_decode_ops(KernelRegistry& reg);

}  // namespace baton
