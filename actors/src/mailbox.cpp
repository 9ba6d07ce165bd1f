#include "baton/actors/mailbox.h"

#include <boost/lockfree/queue.hpp>

namespace baton {

struct Mailbox::Queue {
  explicit Queue(std::size_t capacity) : q(capacity) {}
  boost::lockfree::queue<Message> q;
};

Mailbox::Mailbox(std::size_t capacity) : queue_(std::make_unique<Queue>(capacity)) {}
Mailbox::~Mailbox() = default;

void Mailbox::push(const Message& m) {
  // push() only fails if a node cannot be allocated; that is out of memory.
  if (!queue_->q.push(m)) throw std::bad_alloc();
  // Pairs with the fence in park(): either the owner sees this message when it re-checks,
  // or this thread sees `parking` / `parked` below and wakes it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  State s = state_.load(std::memory_order_relaxed);
  while (s == State::parking || s == State::parked) {
    if (state_.compare_exchange_weak(s, State::running, std::memory_order_acq_rel)) {
      if (s == State::parked) state_.notify_one();
      return;
    }
  }
}

std::optional<Message> Mailbox::try_pop() {
  Message m;
  if (queue_->q.pop(m)) return m;
  return std::nullopt;
}

bool Mailbox::empty() const { return queue_->q.empty(); }

std::optional<Message> Mailbox::park() {
  State expected = State::running;
  if (!state_.compare_exchange_strong(expected, State::parking, std::memory_order_acq_rel)) {
    return std::nullopt;  // closed
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  Message m;
  if (queue_->q.pop(m)) {
    expected = State::parking;
    state_.compare_exchange_strong(expected, State::running, std::memory_order_acq_rel);
    return m;
  }
  expected = State::parking;
  if (!state_.compare_exchange_strong(expected, State::parked, std::memory_order_acq_rel)) {
    return std::nullopt;  // a push() or close() came in between: state is running or closed
  }
  parks_.fetch_add(1, std::memory_order_relaxed);
  state_.wait(State::parked, std::memory_order_acquire);
  return std::nullopt;
}

void Mailbox::close() {
  state_.store(State::closed, std::memory_order_release);
  state_.notify_all();
}

std::string_view name(Mailbox::State s) {
  switch (s) {
    case Mailbox::State::running: return "running";
    case Mailbox::State::parking: return "parking";
    case Mailbox::State::parked: return "parked";
    case Mailbox::State::closed: return "closed";
  }
  return "?";
}

}  // namespace baton
