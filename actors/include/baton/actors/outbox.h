#pragma once
/// Where a worker's messages for actors on other ranks wait to share a link message.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "baton/actors/message.h"
#include "baton/transport/link.h"

namespace baton {

/// An act usually sends one rank two messages (the request for its output, the ack of its input)
/// and the rank needs both before it can act in turn: sent apart they cost two sends and two
/// receives on the critical path of every hop. The outbox holds a message for a rank until a
/// second one for that rank comes (then both go as one link message, at once) or the owner
/// flushes it. When to flush is the owner's policy (Worker: before an act that may take long,
/// and whenever it runs out of local work); the outbox only keeps each rank's messages in the
/// order they were added.
///
/// Single-threaded: only the owning worker thread calls any method.
class Outbox {
 public:
  /// Actor messages per link message (Link::max_message holds two).
  static constexpr std::size_t per_link_message = transport::Link::max_message / sizeof(Message);
  static_assert(per_link_message >= 2, "a link message must hold two actor messages for the outbox to help");

  /// `world_size`: ranks of the job (messages for ranks beyond it go out alone, at once, for
  /// the link to refuse with its own error).
  explicit Outbox(std::uint32_t world_size)
      : held_(std::size_t{world_size} * per_link_message), count_(world_size, 0) {}

  /// Adds `m`; if that fills a link message for its rank, hands them to `send(rank, messages,
  /// n)` now. `now` (any clock) is kept as the time the oldest held message came (since()).
  template <class Send>
  void add(const Message& m, std::uint64_t now, Send&& send) {
    const std::uint32_t r = m.dst.rank();
    if (r >= count_.size()) {
      send(r, &m, std::size_t{1});
      return;
    }
    if (count_[r] == 0) {
      if (ranks_.empty()) since_ = now;
      ranks_.push_back(r);
    }
    held_[std::size_t{r} * per_link_message + count_[r]] = m;
    if (++count_[r] == per_link_message) {
      ranks_.erase(std::find(ranks_.begin(), ranks_.end(), r));
      take(r, send);
    }
  }

  /// Hands every held message to `send`, a link message per rank.
  template <class Send>
  void flush(Send&& send) {
    for (std::uint32_t r : ranks_) take(r, send);
    ranks_.clear();
  }

  /// Hands the messages held for `rank` to `send` (before something else goes to that rank
  /// outside the outbox, which must not overtake them).
  template <class Send>
  void flush_to(std::uint32_t rank, Send&& send) {
    if (rank >= count_.size() || count_[rank] == 0) return;
    ranks_.erase(std::find(ranks_.begin(), ranks_.end(), rank));
    take(rank, send);
  }

  bool empty() const { return ranks_.empty(); }
  /// The `now` given with the oldest message held (meaningless when empty()).
  std::uint64_t since() const { return since_; }

 private:
  template <class Send>
  void take(std::uint32_t r, Send& send) {
    const std::size_t n = count_[r];
    count_[r] = 0;
    send(r, &held_[std::size_t{r} * per_link_message], n);
  }

  std::vector<Message> held_;        // per rank, per_link_message places
  std::vector<std::uint8_t> count_;  // per rank: how many are held
  std::vector<std::uint32_t> ranks_;  // the ranks with messages held, oldest first
  std::uint64_t since_ = 0;
};

}  // namespace baton
