// Megatron-LM's vocabulary-parallel embedding and cross-entropy, built from graph ops.
#include "baton/graph/vocab_parallel.h"

#include <optional>

#include <fmt/format.h>

#include "baton/graph/ops.h"
#include "baton/graph/sharding.h"

namespace baton {

namespace {

[[noreturn]] void fail(const char* op, const std::vector<Value>& inputs, const std::string& why) {
  std::string args;
  for (const auto& v : inputs) args += fmt::format("{}{}", args.empty() ? "" : ", ", v.describe());
  throw GraphError(fmt::format("{}({}): {}", op, args, why));
}

void check_labels(const char* op, const std::vector<Value>& all, const Value& labels,
                  std::int64_t rows) {
  if (labels.dtype() != DType::i32)
    fail(op, all, fmt::format("'{}' must be i32 class indices", labels.name()));
  if (labels.shape() != Shape{rows})
    fail(op, all, fmt::format("'{}' must be [{}], one per row", labels.name(), rows));
}

/// Shard k's part is built on shard k when there are several (Graph::Shard), in the caller's
/// scope when there is one.
std::optional<Graph::Shard> on_shard(Graph& g, std::size_t parts, std::size_t k) {
  if (parts == 1) return std::nullopt;
  return std::optional<Graph::Shard>(std::in_place, g, static_cast<std::int32_t>(k));
}

}  // namespace

Value embedding_shard(Value table, Value ids, std::int64_t start, std::int64_t vocab) {
  const char* op = "embedding_shard";
  // Under autocast an embedding looks up in the low dtype, as embedding() does (graph.h).
  if (auto low = table.graph().autocast_dtype(); low && is_floating(table.dtype())) {
    table = table.graph().cast_once(table, *low);
  }
  if (!is_floating(table.dtype()) || table.rank() != 2)
    fail(op, {table, ids}, "table must be f32 or f64 [V, D]");
  if (ids.dtype() != DType::i32) fail(op, {table, ids}, "ids must be i32");
  if (start < 0 || start + table.dim(0) > vocab) {
    fail(op, {table, ids},
         fmt::format("rows [{}, {}) are not inside a vocabulary of {}", start, start + table.dim(0),
                     vocab));
  }
  Shape out = ids.shape();
  out.push_back(table.dim(1));
  return table.graph().add("embedding", {table, ids},
                           Attrs{{"vocab_start", start}, {"vocab", vocab}}, std::move(out),
                           table.dtype());
}

Value vocab_parallel_embedding(const std::vector<Value>& tables, Value ids) {
  const char* op = "vocab_parallel_embedding";
  if (tables.empty()) throw GraphError("vocab_parallel_embedding() of no tables");
  std::vector<Value> all = tables;
  all.push_back(ids);
  std::int64_t vocab = 0;
  for (const Value& t : tables) {
    if (t.rank() != 2 || t.dtype() != tables[0].dtype() || t.dim(1) != tables[0].dim(1) ||
        &t.graph() != &ids.graph()) {
      fail(op, all, "the tables must be [V_k, D] of one graph, one D and one dtype");
    }
    vocab += t.dim(0);
  }
  Graph& g = ids.graph();
  Value sum;
  std::int64_t start = 0;
  for (std::size_t k = 0; k < tables.size(); ++k) {
    auto scope = on_shard(g, tables.size(), k);
    Value part = embedding_shard(tables[k], ids, start, vocab);
    // A chain of adds over the shards (tp_sum_link: one NCCL all-reduce on GPUs).
    sum = k == 0 ? part : tp_sum_link(sum + part, static_cast<std::int64_t>(k), static_cast<std::int64_t>(tables.size()));
    start += tables[k].dim(0);
  }
  return sum;
}

Value vocab_parallel_ce_stats(Value logits, Value labels, Value row_max, std::int64_t start,
                              std::int64_t vocab) {
  const char* op = "vocab_parallel_ce_stats";
  const std::vector<Value> all{logits, labels, row_max};
  if (!is_floating(logits.dtype()) || logits.rank() != 2)
    fail(op, all, "logits must be f32 or f64 [N, C]");
  check_labels(op, all, labels, logits.dim(0));
  if (row_max.dtype() != logits.dtype() || row_max.shape() != Shape{logits.dim(0)}) {
    fail(op, all, "row_max must be [N], of the logits' dtype");
  }
  if (start < 0 || start + logits.dim(1) > vocab) {
    fail(op, all,
         fmt::format("classes [{}, {}) are not inside a vocabulary of {}", start,
                     start + logits.dim(1), vocab));
  }
  return logits.graph().add(op, {logits, labels, row_max},
                            Attrs{{"vocab_start", start}, {"vocab", vocab}},
                            Shape{logits.dim(0), 2}, logits.dtype());
}

Value vocab_parallel_ce_loss(Value stats, Value row_max) {
  const char* op = "vocab_parallel_ce_loss";
  if (!is_floating(stats.dtype()) || stats.rank() != 2 || stats.dim(1) != 2)
    fail(op, {stats, row_max}, "stats must be [N, 2]");
  if (row_max.dtype() != stats.dtype() || row_max.shape() != Shape{stats.dim(0)}) {
    fail(op, {stats, row_max}, "row_max must be [N], of the stats' dtype");
  }
  return stats.graph().add(op, {stats, row_max}, {}, Shape{}, stats.dtype());
}

Value vocab_parallel_cross_entropy(const std::vector<Value>& shard_logits, Value labels) {
  const char* op = "vocab_parallel_cross_entropy";
  if (shard_logits.empty()) throw GraphError("vocab_parallel_cross_entropy() of no logits");
  // Under autocast a loss computes in f32, as softmax_cross_entropy does (graph.h), each shard's
  // logits cast on their own shard.
  std::vector<Value> logits = shard_logits;
  if (labels.graph().autocast_dtype()) {
    for (std::size_t k = 0; k < logits.size(); ++k) {
      auto scope = on_shard(labels.graph(), logits.size(), k);
      if (is_floating(logits[k].dtype())) logits[k] = labels.graph().cast_once(logits[k], DType::f32);
    }
  }
  std::vector<Value> all = logits;
  all.push_back(labels);
  std::int64_t vocab = 0;
  for (const Value& l : logits) {
    if (!is_floating(l.dtype()) || l.rank() != 2 || l.dtype() != logits[0].dtype() ||
        l.dim(0) != logits[0].dim(0) || &l.graph() != &labels.graph()) {
      fail(op, all, "the logits must be f32 or f64 [N, C_k] of one graph, one N and one dtype");
    }
    vocab += l.dim(1);
  }
  check_labels(op, all, labels, logits[0].dim(0));
  Graph& g = labels.graph();
  const std::size_t n = logits.size();
  // The row maxima over every shard: the shift that keeps exp() finite. The loss does not depend
  // on it (d/dM of log sum exp(l - M) + M is 0), so no gradient flows back through it.
  Value row_max;
  for (std::size_t k = 0; k < n; ++k) {
    auto scope = on_shard(g, n, k);
    Value m = max(logits[k], {1});
    row_max = k == 0 ? m : maximum(row_max, m);
  }
  {
    auto scope = on_shard(g, n, n - 1);
    row_max = stop_gradient(row_max);
  }
  // Sum of exp and the target's logit: one [N, 2] sum over the shards instead of two [N] ones.
  Value stats;
  std::int64_t start = 0;
  for (std::size_t k = 0; k < n; ++k) {
    auto scope = on_shard(g, n, k);
    Value s = vocab_parallel_ce_stats(logits[k], labels, row_max, start, vocab);
    stats = k == 0 ? s : tp_sum_link(stats + s, static_cast<std::int64_t>(k), static_cast<std::int64_t>(n));
    start += logits[k].dim(1);
  }
  return vocab_parallel_ce_loss(stats, row_max);
}

}  // namespace baton
