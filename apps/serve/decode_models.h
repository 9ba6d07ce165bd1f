#pragma once
// The models of baton-train (apps/train/models.h) as serving's decode step: the same weights by
// the same names, but the rows of a step are tokens of many requests at their own positions, and
// attention reads and writes a paged KV cache (ops.h: paged_attention) instead of seeing a whole
// sequence. One device's model (tp 1), whole or one pipeline stage's layers of it (pp).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "baton/graph.h"
#include "models.h"

namespace baton::serve {

struct DecodeModel {
  enum class Kind : std::uint8_t { gpt, gpt2, llama };
  Kind kind = Kind::gpt;
  models::GptShape gpt;
  models::Gpt2Shape gpt2;
  models::LlamaShape llama;

  std::string name() const;  // "gpt", "gpt2", "llama"
  /// The longest prompt plus completion: the position table's rows (gpt, gpt2), the trained
  /// sequence length (llama, whose RoPE has no table).
  std::int64_t context() const;
  std::int64_t vocab() const;
  std::int64_t layers() const;
  std::int64_t kv_heads() const;
  std::int64_t head_dim() const;
  DType dtype() const;
  std::int64_t width() const;  // d_model: the rows' width between stages
  /// The training model at batch 1 (its logits [seq, vocab]), for checking a decode against it.
  Value full(Graph& g) const;
};

/// A step's extents: `rows` token rows; `slots` requests at most; each request's positions in
/// at most `blocks_per_slot` blocks of `block_size`; the caches hold `cache_blocks` blocks.
struct StepShape {
  std::int64_t rows = 1;
  std::int64_t slots = 1;
  std::int64_t blocks_per_slot = 1;
  std::int64_t block_size = 16;
  std::int64_t cache_blocks = 1;
  /// The pipeline stage's layers, [first_layer, end_layer) (end_layer -1: to the last). The first
  /// stage (first_layer 0) embeds the tokens; the last (to the last layer) ends in the head.
  std::int64_t first_layer = 0;
  std::int64_t end_layer = -1;
  /// Tensor parallelism (Megatron's cut): the stage's heads and MLP width split over `tp` ranks,
  /// this one `tp_rank`; q, k, v (by heads) and the MLP's first product by columns, the output
  /// projections by rows, their partial sums added across the ranks by "serve.tp_sum"
  /// (pipeline.h: TpGroup), the biases after. The KV cache holds this rank's kv heads only.
  /// Norms, embeddings and the head are whole on every rank.
  std::int64_t tp = 1;
  std::int64_t tp_rank = 0;
};

/// The op that adds a row-parallel product's partial sums across the tensor-parallel ranks
/// (registered once by decode_step; its kernel is pipeline.cpp's).
inline constexpr const char* tp_sum_op = "serve.tp_sum";
/// Registers tp_sum_op (once per process; decode_step calls it for a step with tp > 1).
void register_tp_sum();

/// The layers of each of `pp` pipeline stages, [begin, end): as even as they go, the earlier
/// stages taking one more where they do not divide (the last also runs the head, the largest
/// product). Throws std::invalid_argument when pp is < 1 or more than the layers.
std::vector<std::pair<std::int64_t, std::int64_t>> stage_layers(std::int64_t layers, std::int64_t pp);

/// The decode step's graph. Inputs "tokens", "positions", "slots" (i32 [rows]; a row of slot < 0
/// is padding), "block_table" (i32 [slots, blocks_per_slot]), "sample_rows" (i32 [min(rows,
/// slots)]: the rows whose next token is drawn, a request's last row in the step; the rest of a
/// prompt's rows need no logits, so the head, the largest product, runs on these alone) and, per
/// layer l, "cache.k.<l>" and "cache.v.<l>" ([cache_blocks, block_size, kv_heads, head_dim], the
/// model's dtype: the caller keeps them from step to step). Returns the logits [min(rows, slots),
/// vocab], row k for sample_rows[k].
///
/// A stage of a pipeline (StepShape::first_layer, end_layer) has the caches of its layers only;
/// a stage after the first reads "hidden" ([rows, width], the model's dtype: what the stage
/// before returned) instead of "tokens"; a stage before the last returns "hidden" instead of
/// the logits and has no "sample_rows".
Value decode_step(Graph& g, const DecodeModel& m, const StepShape& s);

}  // namespace baton::serve
