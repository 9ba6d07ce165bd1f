#pragma once
/// The DSL's ops. Each infers its output's shape and dtype when called and throws GraphError
/// naming the op, its inputs and their shapes if they do not fit.
#include <cstdint>
#include <optional>
#include <vector>

#include "baton/graph/graph.h"

namespace baton {

/// a [..., M, K] x b [K, N] (a shared weight) or [..., K, N] (same batch dims) -> [..., M, N];
/// trans_a / trans_b read a or b transposed in their last two dimensions.
Value matmul(Value a, Value b, bool trans_a = false, bool trans_b = false);

/// x converted to another float dtype (f32, f64, bf16; bf16 rounds to nearest even); x itself
/// if it has that dtype. Its gradient is dy cast back.
Value cast(Value x, DType to);

/// Elementwise with numpy broadcasting.
Value operator+(Value a, Value b);
Value operator-(Value a, Value b);
Value operator*(Value a, Value b);
Value operator/(Value a, Value b);
Value operator*(Value a, double s);
Value operator*(double s, Value a);
Value operator/(Value a, double s);
Value operator-(Value a);

Value relu(Value x);
/// GELU's two forms, as torch's `approximate` argument: `none`, the exact erf form (torch's
/// default), and `tanh`, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (GPT-2's gelu_new,
/// Megatron's bias_gelu, and the form cuBLASLt's GELU epilogues compute). The node carries it as
/// the string attribute "approximate" ("tanh"; absent for none); its gradient takes the same.
enum class GeluApprox { none, tanh };
Value gelu(Value x, GeluApprox approximate = GeluApprox::none);
Value tanh(Value x);
Value sigmoid(Value x);
/// gelu(x + b) in one op, b one bias per column of x [..., F] (a Linear layer's bias and its
/// activation): one pass over x instead of two, and no x + b tensor kept for the backward. Under
/// autocast the bias joins x's product dtype, as torch's Linear casts its bias (so a bf16
/// product gives a bf16 activation). Its gradient: bias_gelu_grad for x, summed over the rows
/// for b.
Value bias_gelu(Value x, Value b, GeluApprox approximate = GeluApprox::none);
/// The math of current LLMs, elementwise. log, sqrt and rsqrt of a negative number give NaN (of
/// 0: -inf, 0, +inf), as in torch; nothing checks the domain. Under autocast exp, log, rsqrt
/// and pow compute in f32 (torch's autocast lists them so); sqrt and silu keep x's dtype.
Value exp(Value x);
Value log(Value x);
Value sqrt(Value x);
/// 1 / sqrt(x).
Value rsqrt(Value x);
/// x^exponent for a finite exponent; pow(x, 2.0) is x squared.
Value pow(Value x, double exponent);
/// x sigmoid(x) (SiLU, or Swish with beta 1: Llama's activation).
Value silu(Value x);
/// Over the last axis.
Value softmax(Value x);
Value log_softmax(Value x);

/// Mean cross-entropy of logits [N, C] against integer labels [N] (i32): a scalar.
Value softmax_cross_entropy(Value logits, Value labels);
/// Mean squared error: a scalar.
Value mse(Value prediction, Value target);

/// One extent may be -1 (inferred).
Value reshape(Value x, Shape shape);
/// y.shape[i] = x.shape[perm[i]].
Value transpose(Value x, std::vector<std::int64_t> perm);
/// Over `axes` (all if empty); negative axes count from the end.
Value sum(Value x, std::vector<std::int64_t> axes = {}, bool keepdims = false);
Value mean(Value x, std::vector<std::int64_t> axes = {}, bool keepdims = false);
/// The largest element over `axes`. No gradient, nor has maximum(): they are for shifts that a
/// stop_gradient() cuts off (a softmax's row maximum) and for metrics.
Value max(Value x, std::vector<std::int64_t> axes = {}, bool keepdims = false);
/// The larger of a and b elementwise, with numpy broadcasting; NaN if either is.
Value maximum(Value a, Value b);
/// x's value; autodiff passes no gradient through it (torch's detach()).
Value stop_gradient(Value x);

/// (x - mean) / sqrt(var + eps) over the last axis, times gamma plus beta (both [D]).
Value layer_norm(Value x, Value gamma, Value beta, double eps = 1e-5);
/// Without the affine part.
Value layer_norm(Value x, double eps = 1e-5);
/// Llama's RMSNorm over the last axis: x w / sqrt(mean(x^2) + eps), w [D] the learnt scale
/// (initialise it to ones), eps > 0. Under autocast it computes in f32 (as transformers'
/// LlamaRMSNorm does). One op, whose gradient is rms_norm_grad (dx) and rms_norm_grad_weight (dw).
Value rms_norm(Value x, Value w, double eps = 1e-6);
/// Rotary position embedding (RoFormer) of x [..., T, D], D even: position t is the index on
/// axis -2, so x is laid out as attention() takes it, [batch, heads, T, D]. The layout is Hugging
/// Face Llama's "rotate_half" (not the interleaved one of the original paper and Meta's code):
/// for i < D/2 the pair (x_i, x_{i+D/2}) is rotated by the angle t base^(-2i/D),
///   y_i = x_i cos - x_{i+D/2} sin,   y_{i+D/2} = x_{i+D/2} cos + x_i sin,
/// so weights from transformers' Llama checkpoints load unpermuted. Its gradient is the
/// rotation by the negated angles (op rope_grad).
///   auto q = rope(split_heads(matmul(x, wq)), 10000.0);   // [b, heads, t, head_dim]
Value rope(Value x, double base = 10000.0);
/// Llama's feed-forward block: matmul(silu(matmul(x, w1)) * matmul(x, w3), w2), x [..., D],
/// w1 and w3 [D, F] (gate and up projections), w2 [F, D] (down). Built from the ops above.
Value swiglu(Value x, Value w1, Value w3, Value w2);
/// Rows of table [V, D] picked by integer ids [...] -> [..., D]. (Split by vocabulary over
/// tensor-parallel shards: vocab_parallel.h.)
Value embedding(Value table, Value ids);
/// Scores [..., T, T] with the entries above the diagonal set to -infinity (attention can
/// only look back).
Value causal_mask(Value scores);

struct AttentionOptions {
  /// Query i sees keys j <= i only (torch's is_causal, the mask aligned top left).
  bool causal = true;
  /// The scores' factor; unset: 1 / sqrt(D).
  std::optional<double> scale;
  /// Which kernel a CUDA device runs (the op's attr kernel; ops.h of baton/kernels): "auto"
  /// (cuDNN's fused attention where cuDNN 9 loads and takes the shape, else baton's), "cudnn"
  /// (or fail, naming why) or "fused" (baton's). The CPU has one kernel ("cudnn" is refused there).
  std::string kernel = "auto";
};
/// Fused scaled dot-product attention over q, k, v [..., T, D] (the leading axes: batch and
/// heads): softmax(scale q k^T, masked if causal) v -> [..., T, D], as
/// matmul(softmax(causal_mask(scale * matmul(q, k, false, true))), v) but without the T x T
/// scores (FlashAttention's tiling and online softmax; CPU kernels f32 and f64, CUDA f32 and
/// bf16). Grouped-query heads (Llama's GQA, torch's enable_gqa): k and v [..., Hkv, T, D] with
/// Hkv dividing q's H, query head h reading kv head h / (H / Hkv), so nothing repeats k and v.
/// Under autocast it computes in the low dtype (torch's SDPA does). Its gradient is one op,
/// attention_grad, whose [..., T, 3 D] result is sliced into dq, dk and dv (with grouped-query
/// heads a flat one, dq, dk and dv one after another).
///   auto o = attention(q, k, v);                                   // causal, 1/sqrt(D)
///   auto o2 = attention(q, k, v, {.causal = false, .scale = 0.5});
Value attention(Value q, Value k, Value v, const AttentionOptions& options = {});
/// Decoding (serving's steps; apps/serve). A step's rows are tokens of many requests, each at
/// its own position, flattened: R rows, padded with rows whose slot is < 0.
///
/// RoPE (as rope) of x [R, H, D] with row r at position positions[r] (i32 [R]) instead of its
/// index: rope_at(x, p) of row r equals rope()'s output at index p[r] of a sequence.
Value rope_at(Value x, Value positions, double base = 10000.0);
/// Causal attention of a step's rows over a paged KV cache (vLLM's PagedAttention): q [R, H, D],
/// k and v [R, Hkv, D] (H a multiple of Hkv: grouped-query heads, query head h reading kv head
/// h / (H / Hkv)), slots and positions i32 [R], block_table i32 [S, M] (slot s's positions
/// [i B, (i+1) B) lie in block block_table[s, i]), k_cache and v_cache [blocks, B, Hkv, D]
/// (inputs the caller keeps from step to step: the op writes them in place, the only op that
/// writes an input). Each live row's k and v are first written at its slot and position; then
/// row r attends to positions 0..positions[r] of its slot. Rows of a slot's prompt chunk in one
/// step thus see each other causally, and a request's next step sees all it wrote before. Rows
/// with slot < 0 are padding (output 0). -> [R, H, D]; the softmax in double. Not
/// differentiable (serving only).
Value paged_attention(Value q, Value k, Value v, Value slots, Value positions, Value block_table, Value k_cache,
                      Value v_cache, std::optional<double> scale = std::nullopt);
/// Zeroes each element with probability p (and scales the rest by 1/(1-p)); the mask depends on
/// the graph's seed, this op and the micro-batch, so a run is reproducible.
Value dropout(Value x, double p);
/// x[..., start:end, ...] along `axis`.
Value slice(Value x, std::int64_t axis, std::int64_t start, std::int64_t end);
Value concat(const std::vector<Value>& xs, std::int64_t axis);

/// Lower-level ops that autodiff emits (usable directly too).
Value sum_to(Value x, Shape shape);
Value broadcast_to(Value x, Shape shape);
Value scale(Value x, double s);

/// The numpy broadcast of two shapes; throws GraphError naming `op` if they do not broadcast.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op, const Value& va, const Value& vb);

}  // namespace baton
