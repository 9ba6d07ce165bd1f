#pragma once
// The models baton-train knows, written with the DSL.
#include <cstdint>
#include <string>
#include <string_view>

#include "baton/graph.h"

namespace baton::models {

struct MlpShape {
  std::int64_t inputs = 64;
  std::int64_t hidden = 256;
  std::int64_t layers = 2;  // hidden layers
  std::int64_t classes = 10;
  /// Tensor-parallel shards: each pair of hidden layers is split Megatron's way over `tp`
  /// shards (the first layer by columns, "fc<l>.w.tp<k>" [in, hidden/tp] and "fc<l>.b.tp<k>";
  /// the second by rows, "fc<l+1>.w.tp<k>" [hidden/tp, hidden]; their partial products summed
  /// once). A last odd layer and the output layer are shared. hidden must be a multiple of tp.
  /// The model is written once, with these signatures as annotations (sbp.h), and sharded by
  /// shard_graph() (sharding.h); the parts start as pieces of the one-device weights.
  std::int64_t tp = 1;
  /// The dtype of the input x, the weights and everything computed from them: f32, or f64
  /// (the tests' parallel-equals-sequential runs, where rounding is too small to hide a bug).
  DType dtype = DType::f32;
};

/// x [batch, inputs] -> `layers` x (Linear + ReLU) -> Linear -> logits [batch, classes].
/// Returns the logits; the graph gets inputs "x" and "label" (i32 [batch]). `sbp_text`, if
/// given, receives the inferred signatures and the movement (ShardedGraph::to_text()).
Value mlp(Graph& g, std::int64_t batch, const MlpShape& s, std::string* sbp_text = nullptr);

struct GptShape {
  std::int64_t vocab = 64;
  std::int64_t seq = 32;
  std::int64_t d_model = 64;
  std::int64_t heads = 4;
  std::int64_t layers = 2;
  /// Tensor-parallel shards (Megatron): in every block the attention heads are split over `tp`
  /// shards (wq, wk, wv by columns, "h<l>.attn.wq.tp<k>" [d, d/tp]; wo by rows) and so is the
  /// MLP (w1, b1 by columns, w2 by rows); each half sums its shards' partial products once. The
  /// vocabulary is split too (vocab_parallel.h): the token table by rows ("wte.tp<k>"
  /// [vocab/tp, d]) and the head by columns ("head.w.tp<k>" [d, vocab/tp]). heads and vocab must
  /// be multiples of tp.
  std::int64_t tp = 1;
  /// How a block attends: `naive` spells it out (matmul, scale, causal_mask, softmax, matmul:
  /// every head's T x T scores are tensors, in memory for the backward), `fused` calls
  /// attention() (ops.h: FlashAttention's tiling and online softmax, no scores in memory). The
  /// same function, so the same weights give the same loss up to rounding.
  enum class Attention : std::uint8_t { naive, fused };
  Attention attention = Attention::naive;
  /// The MLP's first layer as bias_gelu(x w1, b1), one op, instead of gelu(x w1 + b1): the same
  /// bits in f32; under bf16 autocast the activation stays bf16, as torch's Linear + GELU.
  bool fused_bias_gelu = true;
  /// The dtype of the weights and of everything computed from them: f32, or f64 (as MlpShape).
  DType dtype = DType::f32;
};

/// "naive" or "fused" (baton-train's and baton-bench-gpu's --attention); throws
/// std::invalid_argument naming the flag's value otherwise.
GptShape::Attention parse_attention(std::string_view s);

/// A GPT-style decoder: token + position embeddings, `layers` pre-norm blocks of causal
/// multi-head attention and a GELU MLP (4 x d_model), a final layer norm and a linear head.
/// Inputs "tokens" (i32 [batch, seq]) and "targets" (i32 [batch * seq]); returns the logits
/// [batch * seq, vocab] (with tp > 1, the shards' logits side by side).
Value gpt(Graph& g, std::int64_t batch, const GptShape& s);

/// A model's logits and its training loss.
struct Outputs {
  Value logits;
  Value loss;
};

/// gpt() and its loss, the mean cross-entropy of the logits against "targets". Train on this:
/// with tp > 1 the loss is the vocabulary-parallel cross-entropy of the shards' logits, which
/// never gathers them (the logits are then only computed where they are fetched).
Outputs gpt_with_loss(Graph& g, std::int64_t batch, const GptShape& s);

}  // namespace baton::models
