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
  /// `fused` runs baton's kernels everywhere; `cudnn` runs cuDNN's fused attention (CUDA
  /// devices, bf16); `automatic` is attention() with kernel auto: cuDNN where it loads, else
  /// baton's (parse_attention makes it naive on the CPU).
  enum class Attention : std::uint8_t { naive, fused, cudnn, automatic };
  Attention attention = Attention::naive;
  /// The MLP's first layer as bias_gelu(x w1, b1), one op, instead of gelu(x w1 + b1): the same
  /// bits in f32; under bf16 autocast the activation stays bf16, as torch's Linear + GELU.
  bool fused_bias_gelu = true;
  /// The MLP's GELU: the exact erf form (torch's default, nn.GELU()), or the tanh form (GPT-2's
  /// gelu_new, Megatron's bias_gelu: nn.GELU(approximate="tanh")); --gelu erf|tanh.
  GeluApprox gelu = GeluApprox::none;
  /// The dtype of the weights and of everything computed from them: f32, or f64 (as MlpShape).
  DType dtype = DType::f32;
};

/// baton-train's and baton-bench-gpu's --gelu: "erf" or "tanh"; throws std::invalid_argument
/// naming the flag's value otherwise.
GeluApprox parse_gelu(std::string_view s);

/// baton-train's and baton-bench-gpu's --attention: "naive", "fused", "cudnn" or "auto" (the
/// default: automatic where the model runs on CUDA devices, naive on the CPU, which keeps its
/// own); throws std::invalid_argument naming the flag's value otherwise.
GptShape::Attention parse_attention(std::string_view s, bool on_cuda);
/// The attention() call of a block for `a` (not naive): its options' kernel.
AttentionOptions attention_options(GptShape::Attention a);

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

struct LlamaShape {
  std::int64_t vocab = 64;
  std::int64_t seq = 32;
  std::int64_t d_model = 64;
  std::int64_t heads = 4;
  /// Grouped-query attention: the keys and values have kv_heads heads, each shared by
  /// heads / kv_heads query heads (query head h reads kv head h / (heads / kv_heads), as
  /// transformers' repeat_kv). kv_heads == heads is multi-head attention, 1 multi-query.
  /// Fused attention (not naive) reads the kv heads in place, also under tp where each shard's
  /// query heads read whole kv heads or all one kv head; naive attention, and tp shards that cut
  /// a kv head's group apart (12 query heads on 3 kv heads over tp 4), repeat them.
  std::int64_t kv_heads = 4;
  /// The SwiGLU MLP's hidden width (Llama's intermediate_size): gate and up [d, ffn], down
  /// [ffn, d].
  std::int64_t ffn_hidden = 192;
  std::int64_t layers = 2;
  double rope_base = 10000.0;  // transformers' rope_theta
  double norm_eps = 1e-5;      // RMSNorm's eps (Llama 2's rms_norm_eps)
  /// The head reuses the token table (logits = x embed_tokens^T) instead of a weight of its own.
  bool tie_embeddings = false;
  /// Tensor-parallel shards (Megatron, as GptShape::tp): per block q, k, v and gate, up by
  /// columns, o and down by rows, each half's partial products summed once; the token table by
  /// rows and the head by columns (vocab_parallel.h). heads, ffn_hidden and vocab must be
  /// multiples of tp. The kv heads are split too when kv_heads % tp == 0; otherwise k_proj and
  /// v_proj stay whole (replicated) and each shard takes the kv heads its query heads read.
  std::int64_t tp = 1;
  GptShape::Attention attention = GptShape::Attention::naive;  // as GptShape::attention
  DType dtype = DType::f32;
};

/// Llama's decoder (Touvron et al. 2023; transformers' LlamaForCausalLM): a token embedding (no
/// position table), `layers` blocks of
///   x += o_proj(attention(rope(q_proj(rms_norm(x))), rope(k_proj(..)), v_proj(..)))  (causal, GQA)
///   x += down_proj(silu(gate_proj(rms_norm(x))) * up_proj(rms_norm(x)))               (SwiGLU)
/// then a final RMSNorm and the LM head; no biases. Inputs "tokens" (i32 [batch, seq]) and
/// "targets" (i32 [batch * seq]); returns the logits [batch * seq, vocab].
///
/// The weights are named as transformers names LlamaForCausalLM's, so that its checkpoints
/// map name for name: "model.embed_tokens.weight", "model.layers.N.input_layernorm.weight",
/// "model.layers.N.self_attn.{q,k,v,o}_proj.weight", "model.layers.N.post_attention_layernorm.weight",
/// "model.layers.N.mlp.{gate,up,down}_proj.weight", "model.norm.weight", "lm_head.weight"
/// (absent when tied); with tp > 1 a split weight's shards add ".tp<k>". The projections are
/// stored [in, out] (x w), the transpose of torch's Linear.weight [out, in]; the token table is
/// [vocab, d] in both. RoPE is the rotate_half layout transformers uses (ops.h: rope), so q_proj
/// and k_proj need no permutation.
Value llama(Graph& g, std::int64_t batch, const LlamaShape& s);

/// llama() and its mean cross-entropy against "targets" (vocabulary-parallel with tp > 1, as
/// gpt_with_loss).
Outputs llama_with_loss(Graph& g, std::int64_t batch, const LlamaShape& s);

struct Gpt2Shape {
  std::int64_t vocab = 64;
  std::int64_t seq = 32;
  /// Rows of the learned position table (GPT-2's n_positions, 1024 in the published models):
  /// positions [0, seq) are used. 0 means seq.
  std::int64_t positions = 0;
  std::int64_t d_model = 64;
  std::int64_t heads = 4;
  std::int64_t layers = 2;
  double norm_eps = 1e-5;  // GPT-2's layer_norm_epsilon
  GptShape::Attention attention = GptShape::Attention::naive;
  DType dtype = DType::f32;
};

/// GPT-2 (Radford et al. 2019; transformers' GPT2LMHeadModel) in its published names and layout,
/// so that its safetensors files load name for name (import.h): token and learned position
/// embeddings "wte.weight" [vocab, d] and "wpe.weight" [positions, d]; `layers` pre-norm blocks
/// "h.N." of ln_1, attn.c_attn (q, k and v fused: weight [d, 3 d], bias [3 d], split in the
/// graph), attn.c_proj, ln_2, mlp.c_fc [d, 4 d], mlp.c_proj [4 d, d], every projection with a
/// bias and stored [in, out] as GPT-2's Conv1D stores it (x w + b, baton's own layout); the
/// MLP's activation the tanh form of GELU (GPT-2's gelu_new); "ln_f"; and the head tied to
/// the token table (logits = x wte^T). Inputs "tokens" (i32 [batch, seq]) and "targets" (i32
/// [batch * seq]); returns the logits [batch * seq, vocab]. One device's model (no tp).
Value gpt2(Graph& g, std::int64_t batch, const Gpt2Shape& s);

/// gpt2() and its mean cross-entropy against "targets".
Outputs gpt2_with_loss(Graph& g, std::int64_t batch, const Gpt2Shape& s);

}  // namespace baton::models
