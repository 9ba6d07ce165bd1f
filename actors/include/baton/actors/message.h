#pragma once
/// The one message type actors exchange: small, trivially copyable, fixed size.
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "baton/actors/ids.h"

namespace baton {

enum class MsgKind : std::uint8_t {
  /// producer -> consumer: piece `piece` of register `reg` is readable in slot `slot`.
  request,
  /// consumer -> producer: done reading piece `piece` in slot `slot`; it may be rewritten.
  ack,
  /// producer -> consumer: register `reg` has ended after `piece` pieces in all.
  end_of_stream,
  /// consumer -> producer: will read no piece >= `piece` of `reg`; count them as acked.
  detach,
  /// runtime -> actor: start acting (sources begin producing).
  start,
  /// data plane -> transfer actor: the pull into slot `slot` has landed.
  pulled,
  /// producer -> transfer actor on another rank: as `request`, and the piece's bytes came with
  /// it (Link::send_inline: RuntimeSettings::inline_payload_bytes); the runtime staged them.
  request_inline,
  /// producer -> transfer actor on another rank of the same host: as `request`, and the piece
  /// may be read where it lies, in the producer's slot in memory the ranks of a host share
  /// (RuntimeSettings::shared_registers); the message carries where (MappedRequest).
  request_mapped,
  /// runtime -> actor: rank `piece` left the job (Runtime::rank_left): its consumers of this
  /// actor's outputs detach at what they acked, and this actor's inputs from it read zeros.
  rank_left,
  /// runtime -> actor: rank `piece`, which left, is coming back (Runtime::hold_for_rejoin):
  /// an actor that exchanged a register with it stops acting and tells the runtime the first
  /// step it may come back at.
  hold_for_rejoin,
  /// runtime -> actor: rank `reg` comes back at step `piece` (Runtime::rank_rejoined): the
  /// actor's readers on it are attached again from that step's first piece, its inputs from it
  /// read zeros up to there and then its pieces; a held actor goes on. Step -1: it does not
  /// come back after all (Runtime::release_hold); a held actor goes on without it.
  rank_rejoined,
};

std::string_view name(MsgKind k);

/// 32 bytes. `consumer` is the consumer's position in the register's consumer list, so the
/// producer finds the acking consumer without a search.
struct Message {
  ActorId src;
  ActorId dst;
  std::int64_t piece = 0;
  std::uint32_t reg = 0;
  std::uint16_t slot = 0;
  MsgKind kind = MsgKind::request;
  std::uint8_t consumer = 0;
};
static_assert(std::is_trivially_copyable_v<Message>);
static_assert(sizeof(Message) == 32);

/// `to = from`, a field at a time. A message is usually built just before it is queued, its
/// fields stored one by one; the compiler copies a whole Message 16 bytes at a time, and a
/// 16-byte load of bytes that two or more stores still in flight wrote cannot be forwarded from
/// them: the load waits for the stores to retire (a store-forwarding stall, about 12 cycles on
/// Zen and Skylake alike), which was a fifth of a same-thread hop (docs/runtime.md). Loads of
/// each field at its own width are forwarded. GCC would merge the two one-byte loads into one
/// of two bytes (the same stall): the second is read through a pointer it cannot see through.
inline void copy_fields(Message& to, const Message& from) {
  to.src = from.src;
  to.dst = from.dst;
  to.piece = from.piece;
  to.reg = from.reg;
  to.slot = from.slot;
  to.kind = from.kind;
  const std::uint8_t* consumer = &from.consumer;
#if defined(__GNUC__)
  asm("" : "+r"(consumer));
#endif
  to.consumer = *consumer;
}

}  // namespace baton
