#pragma once
/// A tensor's parallel signature over the tensor-parallel device axis (OneFlow's SBP: Split,
/// Broadcast, Partial-sum; Yuan et al., arXiv 2110.15032, section 3.1). Over tp shards:
///
///   split(a)       shard k holds the k-th of tp equal pieces along axis a   "S(a)"
///   broadcast      every shard sees the whole tensor                        "B"
///   partial_sum    shard k holds a tensor of the whole shape; the logical   "P"
///                  value is the sum of the shards' tensors
///
/// Users annotate weights (or any tensor) of a logical model; shard_graph() (sharding.h) infers
/// the rest and inserts the data movement:
///
///   auto w1 = g.variable("w1", {64, 256}, init::kaiming(), sbp::split(1));  // by columns
///   auto w2 = g.variable("w2", {256, 64}, init::kaiming(), sbp::split(0));  // by rows
#include <cstdint>
#include <string>

namespace baton {

struct Sbp {
  enum class Kind : std::uint8_t { split, broadcast, partial_sum };
  Kind kind = Kind::broadcast;
  /// split: the axis (0 .. rank-1 once attached to a tensor); otherwise -1.
  std::int32_t axis = -1;

  bool is_split() const { return kind == Kind::split; }
  bool is_broadcast() const { return kind == Kind::broadcast; }
  bool is_partial() const { return kind == Kind::partial_sum; }
  friend bool operator==(const Sbp&, const Sbp&) = default;
};

namespace sbp {
/// Negative axes count from the end; Graph::set_sbp makes them positive.
inline Sbp split(std::int32_t axis) {
  return {Sbp::Kind::split, axis};
}
inline Sbp broadcast() {
  return {Sbp::Kind::broadcast, -1};
}
inline Sbp partial_sum() {
  return {Sbp::Kind::partial_sum, -1};
}
}  // namespace sbp

/// "S(1)", "B", "P".
std::string to_string(const Sbp& s);

}  // namespace baton
