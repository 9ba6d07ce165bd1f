// The nccl_p2p pass (passes.h): a register that crosses ranks from one GPU to another (a
// pipeline stage's activations forward, their gradients back) moves by NCCL's send and
// receive, GPU to GPU, instead of through host memory on both sides.
//
// device_copies and transfers stage such a register R through the hosts: a to_host copy on the
// producer's rank, a UCX transfer of the host copy to the consumer's rank, a to_device copy
// there. (Sim devices' memory is host memory, and device_copies adds no copies for them: the
// transfer pulls R itself.) This pass replaces them, where both ends are GPUs, with
//
//   rank A:  R --> nccl.send            (on the producer's GPU, a stream of its own)
//            R --> p2p.token --> token  (on the host: the piece's number, one i64)
//   rank B:  token@rB (a UCX transfer of the token) --> nccl.recv --> R@cuda:e (R's copy there)
//
// Why a token. NCCL pairs a communicator's sends and receives by their order, and a receive
// posted for a piece that never comes holds its stream for ever; the receiving rank must know
// how many pieces come and when. The token is R's piece count and pacing in eight bytes: the
// token actor acts once the producer's stream has written the piece (the host sees it, as any
// host reader of a GPU register does), without waiting for the send, which itself waits on its
// stream for the receive. So a receive is posted only for a piece whose send is enqueued or
// about to be, and the end of R's stream ends the token's, which ends the receive's: the
// handshakes over UCX still say what moves when; only the bytes go GPU to GPU.
//
// Order. Each (R, receiving device) gets a communicator of its own (group "p2p.<R>.r<A><d>.r<B><e>")
// and its send a stream of its own: a send waits for its receive, and two registers' sends on
// one stream would have to come in the order the other rank posts the receives, which that
// rank's schedule decides. The receives of a device share one stream: each is posted only once
// its send is, so none waits on another register's. The edges between these actors and the
// compute streams are host-side (EdgeSync::to_host, actors/plan.h), as for every NCCL actor.
//
// Which registers: a pipeline's (made by a forward or backward op), moved whole by a plain
// transfer. The loss's ring, ZeRO 3's pulls (in lanes) and a parameter server's traffic keep
// theirs.
//
// TrainConfig::collectives decides, as for dp and tp: "actors" keeps the staging, "auto" moves
// by NCCL where both ends are CUDA devices and baton has NCCL, "nccl" also on `sim` devices
// (the sim's stand-in, kernels/src/sim_nccl.cpp, which pairs sends and receives by order and
// checks each token) and fails naming what it cannot move.
#include <algorithm>
#include <map>
#include <set>
#include <string>

#include <fmt/format.h>

#include "baton/graph/passes.h"
#include "baton/kernels/nccl.h"
#include "lowering.h"

namespace baton::passes {

namespace {

/// One move of a GPU register R from rank A to a GPU of rank B. On CUDA devices device_copies
/// staged it: R's copy `to_host` on rank A, the `transfer` of that copy to rank B, the copy `up`
/// (to_device) onto the GPU there. Sim devices' memory is host memory, so their plans have no
/// copies (device_copies adds them for CUDA only): the `transfer` (`up` too) pulls R itself.
/// The receive replaces `up`, writing its register.
struct Move {
  RegisterIndex r = 0;
  Placement from, to;
  ActorIndex to_host = no_actor, transfer = no_actor, up = no_actor;
  std::uint8_t send_stream = 0;  // set once chosen (chosen_moves)
};

/// Why R cannot move from `from` to `to` by NCCL (empty: it can).
std::string refusal(const KernelRegistry& kernels, const TrainConfig& cfg, const Placement& from, const Placement& to,
                    DType dtype) {
  const DeviceType type = from.device.type;
  if (to.device.type != type) return fmt::format("it goes from {} to {}", from.device.str(), to.device.str());
  if (type == DeviceType::sim && cfg.collectives != "nccl") return "sim devices take NCCL's stand-in only when asked";
  if (type == DeviceType::cuda && !nccl::built_with_nccl()) return "baton was built without NCCL";
  if (type != DeviceType::cuda && type != DeviceType::sim) return "its ends are not GPUs";
  if (!kernels.contains("nccl.send", type, dtype) || !kernels.contains("nccl.recv", type, dtype)) {
    return fmt::format("NCCL has no {} send and receive here", name(dtype));
  }
  return "";
}

std::string where_str(const Placement& p) { return fmt::format("r{}{}", p.rank, p.device.str()); }

/// A transfer that moves a whole register as it comes: not a window, gather or sum of a
/// collective, and not one a lowering put in a lane to start at its turn (ZeRO 3's pulls).
bool plain_transfer(const ActorDesc& a) {
  return a.kind == ActorKind::transfer && a.op == "transfer" && a.inputs.size() == 1 && a.outputs.size() == 1 &&
         a.window < 0 && a.inputs[0].delay == 0 && a.order.lane < 0;
}

/// Whether register r is a pipeline's: made by an op of the forward or backward pass (an
/// activation, a gradient), not by a collective, an optimizer or a parameter server, whose
/// traffic between ranks keeps its own mechanisms (a parameter server's worker may leave and
/// come back, which a communicator cannot follow).
bool pipeline_register(const Plan& plan, RegisterIndex r) {
  const ActorIndex p = plan.registers[r].producer;
  if (p >= plan.actors.size()) return false;
  const ActorRole role = plan.actors[p].role;
  return role == ActorRole::forward || role == ActorRole::backward;
}

/// The moves the plan's transfers make between GPUs of two ranks.
std::vector<Move> moves_of(const Plan& plan) {
  std::vector<Move> out;
  for (ActorIndex t = 0; t < plan.actors.size(); ++t) {
    const ActorDesc& across = plan.actors[t];
    if (!plain_transfer(across)) continue;
    const RegisterDesc& in = plan.registers[across.inputs[0].reg];
    if (in.producer >= plan.actors.size()) continue;
    const ActorDesc& made = plan.actors[in.producer];
    const RegisterIndex r = made.copy == CopyDirection::to_host ? made.inputs[0].reg : across.inputs[0].reg;
    if (!pipeline_register(plan, r)) continue;
    if (made.copy == CopyDirection::to_host) {
      for (ActorIndex c2 : plan.registers[across.outputs[0]].consumers) {
        const ActorDesc& up = plan.actors[c2];
        if (up.copy != CopyDirection::to_device) continue;
        out.push_back({.r = r, .from = made.where, .to = up.where, .to_host = in.producer,
                       .transfer = t, .up = c2});
      }
    } else if (made.where.device.type == DeviceType::sim && across.where.device.type == DeviceType::sim) {
      out.push_back({.r = r, .from = made.where, .to = across.where, .transfer = t, .up = t});
    }
  }
  return out;
}

/// The moves NCCL can make, by the register they move, each with its send's stream: as many as
/// a device has streams for (the rest stay staged, or "nccl" fails naming the register).
std::map<RegisterIndex, std::vector<Move>> chosen_moves(const Plan& plan, const KernelRegistry& kernels,
                                                        const TrainConfig& cfg) {
  std::map<RegisterIndex, std::vector<Move>> moves;
  std::map<std::pair<std::uint16_t, Device>, int> sends_at;
  for (Move m : moves_of(plan)) {
    std::string why = refusal(kernels, cfg, m.from, m.to, plan.registers[m.r].dtype);
    int& taken = sends_at[{m.from.rank, m.from.device}];
    if (why.empty() && taken == detail::p2p_send_streams) {
      why = fmt::format("more than {} registers leave rank {} {} for other ranks' GPUs (a stream each)",
                        detail::p2p_send_streams, m.from.rank, m.from.device.str());
    }
    if (!why.empty()) {
      if (cfg.collectives == "nccl") {
        throw GraphError(fmt::format("collectives 'nccl': '{}' cannot cross from rank {} to rank {} by NCCL: {} (use "
                                     "--collectives auto or actors)",
                                     plan.registers[m.r].name, m.from.rank, m.to.rank, why));
      }
      continue;
    }
    m.send_stream = static_cast<std::uint8_t>(detail::p2p_first_send_stream + taken++);
    moves[m.r].push_back(m);
  }
  return moves;
}

}  // namespace

Plan nccl_p2p(const Plan& plan, const KernelRegistry& kernels, const TrainConfig& cfg) {
  if (cfg.collectives == "actors") return plan;
  const std::map<RegisterIndex, std::vector<Move>> moves = chosen_moves(plan, kernels, cfg);
  if (moves.empty()) return plan;

  Plan work = plan;
  std::map<ActorIndex, std::vector<ActorDesc>> replace;
  // A staged move's copy and transfer stay for the readers they have beyond the moves (a host
  // reader of R on either rank); one with none left goes.
  std::map<ActorIndex, std::size_t> readers_left;
  auto keep = [&](ActorIndex a) {
    if (replace.contains(a)) return;
    replace[a] = {plan.actors[a]};
    readers_left[a] = plan.registers[plan.actors[a].outputs[0]].consumers.size();
  };
  for (const auto& [r, ms] : moves) {
    const RegisterDesc& reg = plan.registers[r];
    const Placement from = ms.front().from;
    const std::int32_t stage = plan.actors[reg.producer].stage;
    // Where the token and the sends join the plan: beside the to_host copy, or R's producer.
    const ActorIndex anchor = ms.front().to_host != no_actor ? ms.front().to_host : reg.producer;
    keep(anchor);
    // The token: one per R, on the producing rank's host, taken to each receiving rank.
    const RegisterIndex token =
        work.add_register({.name = reg.name + ".p2p", .shape = {1}, .dtype = DType::i64, .slots = reg.slots});
    replace[anchor].push_back({.name = reg.name + ".p2p",
                               .op = "p2p.token",
                               .dtype = DType::i64,
                               .where = {from.rank, Device{DeviceType::cpu, from.device.index}, 0},
                               .inputs = {{r}},
                               .outputs = {token},
                               .role = ActorRole::transfer,
                               .stage = stage});
    std::map<std::uint16_t, RegisterIndex> token_at;  // by receiving rank
    for (const Move& m : ms) {
      const ActorDesc& up = plan.actors[m.up];
      const bool staged = m.to_host != no_actor;
      if (staged) {
        keep(m.to_host);
        keep(m.transfer);
      }
      if (!token_at.contains(m.to.rank)) {
        const std::string name = fmt::format("{}.p2p@r{}", reg.name, m.to.rank);
        token_at[m.to.rank] = work.add_register({.name = name, .shape = {1}, .dtype = DType::i64, .slots = reg.slots});
        replace[m.transfer].push_back({.name = name,
                                       .kind = ActorKind::transfer,
                                       .op = "transfer",
                                       .dtype = DType::i64,
                                       .where = {m.to.rank, Device{DeviceType::cpu, m.to.device.index}, 0},
                                       .inputs = {{token}},
                                       .outputs = {token_at[m.to.rank]},
                                       .role = ActorRole::transfer,
                                       .stage = up.stage});
      }
      const std::string group = fmt::format("p2p.{}.{}.{}", reg.name, where_str(from), where_str(m.to));
      const Attrs attrs{{"group", group},
                        {"ranks", std::vector<std::int64_t>{from.rank, m.to.rank}},
                        {"devices", std::vector<std::int64_t>{from.device.index, m.to.device.index}}};
      ActorDesc send{.name = fmt::format("{}.send@{}", reg.name, where_str(m.to)),
                     .op = "nccl.send",
                     .dtype = reg.dtype,
                     .where = {from.rank, from.device, m.send_stream},
                     .inputs = {{r}},
                     .attrs = attrs,
                     .role = ActorRole::transfer,
                     .stage = stage};
      send.attrs.set("member", std::int64_t{0});
      replace[anchor].push_back(std::move(send));
      ActorDesc recv{.name = up.name,
                     .op = "nccl.recv",
                     .dtype = reg.dtype,
                     .where = {m.to.rank, m.to.device, detail::p2p_recv_stream},
                     .inputs = {{token_at[m.to.rank]}},
                     .outputs = up.outputs,
                     .attrs = attrs,
                     // A send cannot be taken back: the receive takes every piece the producer
                     // makes, also once its readers have stopped (a weight's cast made for a step
                     // that never runs), or the send would wait on its stream for ever.
                     .stops_when_unread = false,
                     .role = ActorRole::transfer,
                     .stage = up.stage};
      recv.attrs.set("member", std::int64_t{1});
      if (!staged) {
        replace[m.transfer].push_back(std::move(recv));  // after the token's transfer
        continue;
      }
      replace[m.up] = {std::move(recv)};
      if (--readers_left[m.transfer] == 0) {
        // The transfer has no reader left: it goes, and its host copy loses one.
        auto& at = replace[m.transfer];
        at.erase(at.begin());
        --readers_left[m.to_host];
      }
    }
  }
  for (auto& [a, actors] : replace) {
    if (plan.actors[a].copy == CopyDirection::to_host && readers_left.at(a) == 0) actors.erase(actors.begin());
  }
  return detail::rebuilt(work, replace, {});
}

}  // namespace baton::passes
