#pragma once
/// The queue for messages an actor sends to an actor on the same worker thread.
#include <cstddef>
#include <optional>
#include <vector>

#include "baton/actors/message.h"

namespace baton {

/// A growable FIFO ring. Single-threaded: only the owning worker thread calls any method.
class LocalQueue {
 public:
  explicit LocalQueue(std::size_t capacity = 64) : ring_(round_up(capacity)) {}

  void push(const Message& m) {
    if (size_ == ring_.size()) grow();
    copy_fields(ring_[(head_ + size_) & (ring_.size() - 1)], m);
    ++size_;
  }
  std::optional<Message> pop() {
    if (size_ == 0) return std::nullopt;
    Message m = ring_[head_];
    head_ = (head_ + 1) & (ring_.size() - 1);
    --size_;
    return m;
  }
  bool empty() const { return size_ == 0; }
  std::size_t size() const { return size_; }

 private:
  static std::size_t round_up(std::size_t n) {
    std::size_t c = 8;
    while (c < n) c *= 2;
    return c;
  }
  void grow() {
    std::vector<Message> bigger(ring_.size() * 2);
    for (std::size_t i = 0; i < size_; ++i) bigger[i] = ring_[(head_ + i) & (ring_.size() - 1)];
    ring_ = std::move(bigger);
    head_ = 0;
  }

  std::vector<Message> ring_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

}  // namespace baton
