#pragma once
/// The data plane as the runtime sees it: small ordered messages between ranks, and payloads
/// that the receiving side pulls into memory it chose. Two implementations: DataPlane (UCX,
/// between processes and hosts) and LoopbackHub (ranks inside one process, for tests).
/// Knows nothing of actors or graphs: messages are opaque bytes.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace baton::transport {

/// Anything the transport refuses or loses: a bad address, a port in use, a refused join, a
/// deadline passed, a peer gone. what() says which rank / host / address.
class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What a Link delivers to its owner. Called on whichever thread is progressing the link (its
/// progress thread, or a thread inside send() / poll()): must not block (post to a queue and
/// return).
class LinkHandler {
 public:
  virtual ~LinkHandler() = default;
  /// A message from `from_rank`. Messages from one rank arrive in the order they were sent
  /// (by one sending thread).
  virtual void on_message(std::uint32_t from_rank, const void* data, std::size_t size) = 0;
  /// A message sent with send_inline(): its payload (`payload_size` bytes at `payload`, valid
  /// only during the call: copy what is needed) came with it. In order with on_message's.
  virtual void on_message_with_payload(std::uint32_t from_rank, const void* data, std::size_t size,
                                       const void* payload, std::size_t payload_size) {
    (void)data, (void)size, (void)payload;
    on_link_error("rank " + std::to_string(from_rank) + " sent a message with a payload of " +
                  std::to_string(payload_size) + " bytes, which this receiver does not take");
  }
  /// The receive_payload() with this cookie has finished: the bytes are in its memory.
  virtual void on_payload(std::uint64_t cookie) = 0;
  /// The link cannot go on (a peer vanished, a transfer failed). Called at most once.
  virtual void on_link_error(const std::string& reason) = 0;
  /// An operation to or from `peer` failed (a message, an offer or a receive: its process may
  /// have died). A handler that knows `peer` may leave the job can wait for the control plane's
  /// word before it calls this a failure (returns false: more may come). By default a link
  /// error (returns true: on_link_error was called, and nothing more comes).
  virtual bool on_peer_error(std::uint32_t peer, const std::string& reason) {
    (void)peer;
    on_link_error(reason);
    return true;
  }
};

/// Thread-safe: any thread may call send / send_payload / receive_payload.
class Link {
 public:
  /// The most bytes one message may carry.
  static constexpr std::size_t max_message = 64;
  /// The most payload bytes send_inline() carries with a message.
  static constexpr std::size_t max_inline_payload = std::size_t{16} << 10;

  virtual ~Link() = default;
  virtual std::uint32_t rank() const = 0;
  virtual std::uint32_t world_size() const = 0;
  /// Who gets what arrives. Set once, before the first message can arrive (before start()).
  virtual void set_handler(LinkHandler* handler) = 0;
  /// Copies `size` (<= max_message) bytes and delivers them to rank `to` (in order, see above).
  virtual void send(std::uint32_t to, const void* data, std::size_t size) = 0;
  /// As send(), with `payload_size` (<= max_inline_payload) bytes at `payload` in the same
  /// message (one active message, eager: no offer, no receive to post, no rendezvous); the
  /// receiver gets them in on_message_with_payload. The payload is not copied on this side: its
  /// memory must stay valid and unchanged until the receiver has it (as send_payload's).
  virtual void send_inline(std::uint32_t to, const void* data, std::size_t size, const void* payload,
                           std::size_t payload_size) = 0;
  /// Offers `size` bytes at `data` to rank `to` under `tag`. The memory must stay valid and
  /// unchanged until the receiver has it; the caller learns that from its own protocol (the
  /// receiver's ack). Large payloads are not copied on the sender's side.
  virtual void send_payload(std::uint32_t to, std::uint64_t tag, const void* data, std::size_t size) = 0;
  /// Receives the payload that rank `from` offers under `tag` straight into `dest` (`size`
  /// bytes, which must equal the offered size); then calls on_payload(cookie). The receive
  /// may be posted before or after the offer. (from, tag) must be unique while in flight.
  virtual void receive_payload(std::uint32_t from, std::uint64_t tag, void* dest, std::size_t size,
                               std::uint64_t cookie) = 0;
  /// Payloads of at most this many bytes to `peer` are worth sending inline (send_inline): the
  /// link's measured advice for the transport it uses to that peer (<= max_inline_payload).
  virtual std::size_t inline_limit(std::uint32_t peer) const {
    (void)peer;
    return max_inline_payload;
  }
  /// Whether `peer` runs on this host and can read this process's shared memory
  /// (shared_memory.h): then a payload may be read straight from where it lies instead of
  /// travelling through the link.
  virtual bool shares_memory_with(std::uint32_t peer) const {
    (void)peer;
    return false;
  }
  /// An idle thread may lend itself: progress the link here if no other thread is doing so
  /// (handlers then run on this thread). True if anything happened. Never blocks.
  virtual bool poll() { return false; }
  /// A thread that has been calling poll() is about to sleep: the link must not count on it.
  virtual void idle() {}
};

}  // namespace baton::transport
