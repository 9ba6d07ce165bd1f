#pragma once
/// A worker thread's mailbox for messages from other threads.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "baton/actors/message.h"

namespace baton {

/// A multi-producer queue (Boost.Lockfree) with an explicit state machine for the owner's
/// idle strategy:
///
///   running --park()--> parking --(queue still empty)--> parked --push()/close()--> running
///      |                   '--(a message arrived)----------> running
///      '--close()--> closed (from any state; final)
///
/// Threads: push() and close() from any thread; try_pop() and park() from the owner only.
/// A push() that finds the owner parking or parked moves it back to running and, if it was
/// parked, wakes it (a futex wake: std::atomic::notify_one). The owner re-checks the queue
/// after announcing `parking`, and both sides fence, so a wake-up is never lost.
class Mailbox {
 public:
  enum class State : std::uint8_t { running, parking, parked, closed };

  /// `capacity` nodes are allocated up front; pushes beyond it allocate more.
  explicit Mailbox(std::size_t capacity = 1024);
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  /// Any thread.
  void push(const Message& m);
  /// Owner thread.
  std::optional<Message> try_pop();
  /// Owner thread: nothing is queued that was pushed before what this thread has seen (a
  /// push racing with the call may or may not count).
  bool empty() const;
  /// Owner thread: sleeps until a push() or close(). Returns at once, with the message, if
  /// one was already queued; at once, with nothing, if the mailbox is closed.
  std::optional<Message> park();
  /// Any thread: wakes the owner; state() stays closed from now on.
  void close();
  State state() const { return state_.load(std::memory_order_acquire); }
  bool closed() const { return state() == State::closed; }
  /// How many times the owner actually went to sleep (for the benchmarks and tests).
  std::uint64_t parks() const { return parks_.load(std::memory_order_relaxed); }

 private:
  struct Queue;
  std::unique_ptr<Queue> queue_;
  alignas(64) std::atomic<State> state_{State::running};
  std::atomic<std::uint64_t> parks_{0};
};

std::string_view name(Mailbox::State s);

}  // namespace baton
