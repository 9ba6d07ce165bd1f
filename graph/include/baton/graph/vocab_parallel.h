#pragma once
/// Megatron-LM's vocabulary-parallel embedding and cross-entropy (Shoeybi et al., arXiv
/// 1909.08053, section 3; VocabParallelEmbedding and vocab_parallel_cross_entropy in its code): a
/// large vocabulary's embedding table split by rows and its output layer by columns over
/// tensor-parallel shards, so that no shard holds the whole [V, D] table nor gathers the [N, V]
/// logits.
///
///   std::vector<Value> tables, heads;  // shard k: vocabulary entries [k V/tp, (k+1) V/tp)
///   for (int k = 0; k < tp; ++k) {
///     auto on = g.shard(k);
///     tables.push_back(g.variable(fmt::format("wte.tp{}", k), {V / tp, D}));
///     heads.push_back(g.variable(fmt::format("head.tp{}", k), {D, V / tp}));
///   }
///   Value x = vocab_parallel_embedding(tables, tokens);   // embedding(whole table, tokens)
///   ...                                                   // h [N, D]
///   std::vector<Value> logits;
///   for (int k = 0; k < tp; ++k) {
///     auto on = g.shard(k);
///     logits.push_back(matmul(h, heads[k]));             // [N, V/tp]
///   }
///   Value loss = vocab_parallel_cross_entropy(logits, labels);
///   // = softmax_cross_entropy(concat(logits, 1), labels)
///
/// With several shards, each function builds shard k's part inside g.shard(k) and combines the
/// parts as the model's other tensor-parallel sums are combined (shard k adds its part to the sum
/// so far). What crosses shards, as in Megatron: forward, the embedding's [..., D] partial sums;
/// for the loss one maximum of [N] row maxima and one sum of [N, 2] statistics; backward nothing,
/// since each shard's gradient touches only its own rows and columns. The shards may differ in
/// size; a model that wants equal ones checks that V divides (models::gpt does).
#include <cstdint>
#include <vector>

#include "baton/graph/graph.h"

namespace baton {

/// Rows [start, start + table.dim(0)) of a vocabulary of `vocab` ids, looked up: ids [...] in
/// that range pick their row, the others (in [0, vocab)) give zero rows -> [..., D]. Its
/// gradient touches this table's rows only.
Value embedding_shard(Value table, Value ids, std::int64_t start, std::int64_t vocab);

/// embedding() of the tables stacked by rows (shard k holds the next tables[k].dim(0) ids), as
/// the sum over the shards of embedding_shard().
Value vocab_parallel_embedding(const std::vector<Value>& tables, Value ids);

/// One shard's statistics for the cross-entropy of logits [N, C], classes [start, start + C) of
/// `vocab`, given every shard's row maxima row_max [N] (cut off from autodiff: stop_gradient):
/// [N, 2], each row (sum_j exp(logits[i, j] - row_max[i]), logits[i, labels[i] - start] or 0).
Value vocab_parallel_ce_stats(Value logits, Value labels, Value row_max, std::int64_t start,
                              std::int64_t vocab);

/// The mean cross-entropy from the shards' statistics summed: mean(log S + row_max - T).
Value vocab_parallel_ce_loss(Value stats, Value row_max);

/// The mean cross-entropy of logits split by columns, logits[k] [N, C_k] holding the next C_k
/// classes, against labels i32 [N] in [0, sum C_k): softmax_cross_entropy of the logits side by
/// side, without putting them side by side. Its gradient on each shard is softmax - onehot of
/// that shard's columns, over N.
Value vocab_parallel_cross_entropy(const std::vector<Value>& logits, Value labels);

}  // namespace baton
