#include <thread>

#include <fmt/format.h>

#include "baton/actors/clock.h"
#include "baton/actors/ids.h"
#include "baton/actors/message.h"

namespace baton {

double ns_per_tick() {
  static const double rate = [] {
    using clock = std::chrono::steady_clock;
    auto t0 = clock::now();
    auto k0 = ticks();
    while (clock::now() - t0 < std::chrono::milliseconds(2)) {
    }
    auto k1 = ticks();
    auto t1 = clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
    return k1 > k0 ? ns / static_cast<double>(k1 - k0) : 1.0;
  }();
  return rate;
}

std::string ActorId::str() const {
  return fmt::format("r{}/{}/s{}/#{}", rank(), device().str(), stream(), index());
}

std::string_view name(MsgKind k) {
  switch (k) {
    case MsgKind::request: return "request";
    case MsgKind::ack: return "ack";
    case MsgKind::end_of_stream: return "end_of_stream";
    case MsgKind::detach: return "detach";
    case MsgKind::rank_left: return "rank_left";
    case MsgKind::hold_for_rejoin: return "hold_for_rejoin";
    case MsgKind::rank_rejoined: return "rank_rejoined";
    case MsgKind::start: return "start";
    case MsgKind::pulled: return "pulled";
    case MsgKind::request_inline: return "request_inline";
    case MsgKind::request_mapped: return "request_mapped";
  }
  return "?";
}

}  // namespace baton
