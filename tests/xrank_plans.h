#pragma once
// Hand-written plans whose edges cross ranks, for the loopback tests (test_cross_rank.cpp)
// and the multi-process ones (baton-xrank-check under baton-launch). Every actor runs the
// "pattern" kernel, so a piece that arrives twice, out of order, skipped or overwritten while
// read fails the run with the actor's name (checking_kernels.h).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/actors/plan.h"
#include "checking_kernels.h"

namespace baton::test {

struct CrossRankShape {
  std::string topology = "chain";  // chain | fanout | fanin | ring
  std::uint16_t world = 2;
  std::int64_t pieces = 200;
  std::int64_t elements = 64;  // i64 per register: 8 bytes each
  std::int32_t slots = 2;
  std::int64_t linger_every = 7;
  std::int64_t sleep_us = 0;   // per act of every actor
  int fail_rank = -1;          // the first actor on this rank throws at piece fail_at
  std::int64_t fail_at = -1;
};

namespace detail_xrank {
inline ActorDesc pattern_actor(std::string name, std::uint16_t rank, std::vector<RegisterIndex> in,
                               std::vector<RegisterIndex> out, const CrossRankShape& s) {
  ActorDesc a;
  a.name = std::move(name);
  a.kind = in.empty() ? ActorKind::source : ActorKind::compute;
  a.op = "pattern";
  a.dtype = DType::i64;
  a.where.rank = rank;
  std::vector<std::int64_t> in_ids(in.begin(), in.end()), out_ids(out.begin(), out.end());
  for (auto r : in) a.inputs.push_back(InputPort{r, 0});
  a.outputs = std::move(out);
  a.pieces = s.pieces;
  a.attrs.set("in_regs", in_ids).set("out_regs", out_ids).set("linger_every", s.linger_every);
  if (s.sleep_us > 0) a.attrs.set("sleep_us", s.sleep_us);
  if (rank == s.fail_rank && s.fail_at >= 0) a.attrs.set("fail_at", s.fail_at);
  return a;
}
}  // namespace detail_xrank

/// Before insert_transfers(): the logical plan, its edges crossing ranks.
///   chain:  src(r0) -> s1(r1) -> ... -> sink(r(W-1))
///   fanout: src(r0) read by a sink on every rank, two on each rank > 0 (they share a transfer)
///   fanin:  a source on every rank, one sink on rank 0 reading them all
///   ring:   src(r0) -> r1 -> ... -> r(W-1) -> sink(r0): back to where it started
///   soak:   a chain of 16 actors in blocks of 4 that alternate ranks (the soak test's graph)
inline Plan cross_rank_plan(const CrossRankShape& s) {
  using detail_xrank::pattern_actor;
  if (s.world < 2) throw std::invalid_argument("cross-rank plans need 2 ranks or more");
  Plan p;
  auto reg = [&](std::string name) {
    return p.add_register(RegisterDesc{.name = std::move(name), .shape = {s.elements}, .dtype = DType::i64,
                                       .slots = s.slots});
  };
  auto add = [&](ActorDesc a) {
    a.pieces = a.kind == ActorKind::source ? s.pieces : 0;
    p.add_actor(std::move(a));
  };
  if (s.topology == "chain" || s.topology == "ring") {
    const int hops = s.topology == "ring" ? s.world : s.world - 1;
    RegisterIndex prev = reg("src.out");
    add(pattern_actor("src", 0, {}, {prev}, s));
    for (int i = 1; i < hops; ++i) {
      RegisterIndex next = reg(fmt::format("s{}.out", i));
      add(pattern_actor(fmt::format("s{}", i), static_cast<std::uint16_t>(i % s.world), {prev}, {next}, s));
      prev = next;
    }
    add(pattern_actor("sink", static_cast<std::uint16_t>(hops % s.world), {prev}, {}, s));
  } else if (s.topology == "fanout") {
    RegisterIndex r = reg("src.out");
    add(pattern_actor("src", 0, {}, {r}, s));
    add(pattern_actor("sink0", 0, {r}, {}, s));
    for (std::uint16_t k = 1; k < s.world; ++k) {
      add(pattern_actor(fmt::format("sink{}a", k), k, {r}, {}, s));
      add(pattern_actor(fmt::format("sink{}b", k), k, {r}, {}, s));
    }
  } else if (s.topology == "fanin") {
    std::vector<RegisterIndex> all;
    for (std::uint16_t k = 0; k < s.world; ++k) {
      all.push_back(reg(fmt::format("src{}.out", k)));
      add(pattern_actor(fmt::format("src{}", k), k, {}, {all.back()}, s));
    }
    add(pattern_actor("sink", 0, all, {}, s));
  } else if (s.topology == "soak") {
    // 16 actors in blocks of 4 that alternate ranks (r0, r1, r0, r1 with two ranks): every piece
    // crosses ranks three times, and each rank holds sources of work, transfers and sinks.
    RegisterIndex prev = reg("a0.out");
    add(pattern_actor("a0", 0, {}, {prev}, s));
    for (int i = 1; i < 15; ++i) {
      RegisterIndex next = reg(fmt::format("a{}.out", i));
      add(pattern_actor(fmt::format("a{}", i), static_cast<std::uint16_t>((i / 4) % s.world), {prev}, {next}, s));
      prev = next;
    }
    add(pattern_actor("a15", static_cast<std::uint16_t>((15 / 4) % s.world), {prev}, {}, s));
  } else {
    throw std::invalid_argument("unknown topology '" + s.topology + "' (chain, fanout, fanin, ring, soak)");
  }
  return p;
}

}  // namespace baton::test
