#include "baton/transport/loopback.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

namespace baton::transport {

namespace {

struct Offer {
  const void* data = nullptr;
  std::size_t size = 0;
};

struct Receive {
  void* dest = nullptr;
  std::size_t size = 0;
  std::uint64_t cookie = 0;
};

struct Op {
  enum Kind : std::uint8_t { message, offer, receive } kind;
  std::uint32_t from = 0;  // message / offer: the sender; receive: the offering rank
  std::uint32_t to = 0;    // message / offer: the receiver; receive: the receiving rank
  std::uint64_t tag = 0;
  std::vector<std::byte> bytes;
  std::vector<std::byte> payload;  // message: an inline payload (send_inline)
  Offer o;
  Receive r;
};

}  // namespace

struct LoopbackHub::Impl {
  class End final : public Link {
   public:
    End(Impl& hub, std::uint32_t rank) : hub_(hub), rank_(rank) {}
    std::uint32_t rank() const override { return rank_; }
    std::uint32_t world_size() const override { return static_cast<std::uint32_t>(hub_.ends.size()); }
    // A rank that comes back (a new Runtime on the same end) sets it again while the hub runs.
    void set_handler(LinkHandler* h) override { handler.store(h, std::memory_order_release); }
    // The ranks share this process (unless the hub plays ranks on different hosts).
    bool shares_memory_with(std::uint32_t peer) const override {
      return hub_.shares_memory && peer != rank_ && peer < world_size();
    }
    void send(std::uint32_t to, const void* data, std::size_t size) override { send_inline(to, data, size, nullptr, 0); }
    void send_inline(std::uint32_t to, const void* data, std::size_t size, const void* payload,
                     std::size_t payload_size) override {
      if (size > max_message) throw TransportError(fmt::format("message of {} bytes; at most {}", size, max_message));
      if (payload_size > max_inline_payload) {
        throw TransportError(fmt::format("inline payload of {} bytes; at most {}", payload_size, max_inline_payload));
      }
      check(to);
      Op op{Op::message, rank_, to};
      op.bytes.resize(size);
      std::memcpy(op.bytes.data(), data, size);
      // Copied here (the hub delivers later, from its own thread): as the data plane's eager
      // path, which copies it before the sender's slot is free again.
      const auto* p = static_cast<const std::byte*>(payload);
      if (payload_size > 0) op.payload.assign(p, p + payload_size);
      hub_.push(std::move(op));
    }
    void send_payload(std::uint32_t to, std::uint64_t tag, const void* data, std::size_t size) override {
      check(to);
      Op op{Op::offer, rank_, to, tag};
      op.o = Offer{data, size};
      hub_.push(std::move(op));
    }
    void receive_payload(std::uint32_t from, std::uint64_t tag, void* dest, std::size_t size,
                         std::uint64_t cookie) override {
      check(from);
      Op op{Op::receive, from, rank_, tag};
      op.r = Receive{dest, size, cookie};
      hub_.push(std::move(op));
    }
    std::atomic<LinkHandler*> handler{nullptr};

   private:
    void check(std::uint32_t peer) const {
      if (peer >= hub_.ends.size()) {
        throw TransportError(fmt::format("rank {} is outside the job (world size {})", peer, hub_.ends.size()));
      }
    }
    Impl& hub_;
    std::uint32_t rank_;
  };

  Impl(std::uint32_t world, bool shares) : shares_memory(shares) {
    for (std::uint32_t r = 0; r < world; ++r) ends.push_back(std::make_unique<End>(*this, r));
  }

  void push(Op op) {
    {
      std::lock_guard lock(mutex);
      queue.push_back(std::move(op));
    }
    cv.notify_one();
  }

  void run() {
    std::unique_lock lock(mutex);
    while (true) {
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) return;
      Op op = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      deliver(op);
      lock.lock();
    }
  }

  void deliver(Op& op) {
    const auto key = std::tuple{op.from, op.to, op.tag};
    switch (op.kind) {
      case Op::message:
        if (op.payload.empty()) {
          ends[op.to]->handler.load(std::memory_order_acquire)->on_message(op.from, op.bytes.data(), op.bytes.size());
        } else {
          ends[op.to]->handler.load(std::memory_order_acquire)->on_message_with_payload(op.from, op.bytes.data(), op.bytes.size(), op.payload.data(),
                                                        op.payload.size());
        }
        break;
      case Op::offer: {
        auto it = receives.find(key);
        if (it == receives.end()) {
          offers.emplace(key, op.o);
        } else {
          Receive r = it->second;
          receives.erase(it);
          complete(op.to, op.o, r);
        }
        break;
      }
      case Op::receive: {
        auto it = offers.find(key);
        if (it == offers.end()) {
          receives.emplace(key, op.r);
        } else {
          Offer o = it->second;
          offers.erase(it);
          complete(op.to, o, op.r);
        }
        break;
      }
    }
  }

  void complete(std::uint32_t receiver, const Offer& o, const Receive& r) {
    LinkHandler* h = ends[receiver]->handler.load(std::memory_order_acquire);
    if (o.size != r.size) {
      h->on_link_error(fmt::format("payload of {} bytes offered, {} bytes expected", o.size, r.size));
      return;
    }
    std::memcpy(r.dest, o.data, o.size);
    h->on_payload(r.cookie);
  }

  std::vector<std::unique_ptr<End>> ends;
  bool shares_memory = true;
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Op> queue;
  bool stopping = false;
  std::thread thread;
  // Touched by the delivery thread only.
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint64_t>, Offer> offers;
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint64_t>, Receive> receives;
};

LoopbackHub::LoopbackHub(std::uint32_t world_size, bool shares_memory)
    : impl_(std::make_unique<Impl>(world_size, shares_memory)) {}

LoopbackHub::~LoopbackHub() { stop(); }

Link& LoopbackHub::link(std::uint32_t rank) { return *impl_->ends.at(rank); }

void LoopbackHub::start() {
  for (auto& e : impl_->ends) {
    if (e->handler == nullptr) throw TransportError(fmt::format("loopback rank {} has no handler", e->rank()));
  }
  impl_->thread = std::thread([this] { impl_->run(); });
}

void LoopbackHub::stop() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace baton::transport
