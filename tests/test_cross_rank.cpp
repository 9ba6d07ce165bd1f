// Plans whose edges cross ranks: the transfer pass, its validation, and several Runtimes of
// one job in one process joined by a LoopbackHub (the multi-process runs over UCX are in
// tests/mp/). Step 1's invariants must hold across ranks: every piece once, in order, never
// overwritten while read (the pattern kernel), slots never exceeded.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <optional>
#include <thread>

#include "baton/actors.h"
#include "checking_kernels.h"
#include "loopback_run.h"
#include "test_util.h"
#include "xrank_plans.h"

using namespace baton;
using baton::test::CrossRankShape;

namespace {

using test::RankResult;

std::vector<RankResult> run_loopback(const Plan& logical, std::uint16_t world) {
  RuntimeSettings s;
  s.stall_timeout = std::chrono::milliseconds(20'000);
  auto results = test::run_on_loopback(insert_transfers(logical), test::checking_registry(), s);
  REQUIRE(results.size() == world);
  return results;
}

/// How the pieces cross: read in place from the producer's slot (the loopback ranks share a
/// process, so a host; RuntimeSettings::shared_registers), or, with that off, inline with their
/// requests where they have at most `inline_bytes` and pulled otherwise.
struct Crossing {
  bool in_place = false;
  std::size_t inline_bytes = 0;
  std::string str() const { return in_place ? "read in place" : fmt::format("inline up to {} B, else pulled", inline_bytes); }
};
const std::vector<Crossing>& every_crossing() {
  static const std::vector<Crossing> ways{
      {.in_place = true}, {.inline_bytes = 0}, {.inline_bytes = RuntimeSettings{}.inline_payload_bytes}};
  return ways;
}

/// Runs `plan` on loopback ranks, its pieces crossing as `how` says.
std::vector<RankResult> run_crossing(const Plan& plan, const KernelRegistry& kernels, const Crossing& how) {
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  rs.shared_registers = how.in_place;
  rs.inline_payload_bytes = how.inline_bytes;
  auto results = test::run_on_loopback(plan, kernels, rs);
  for (const auto& r : results) REQUIRE_MESSAGE(r.error.empty(), r.error);
  return results;
}

const ActorMetrics* find_actor(const RunReport& rep, const std::string& name) {
  for (const auto& a : rep.metrics.actors) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("cross rank: insert_transfers puts one transfer per (register, rank) on the consumers' side") {
  CrossRankShape s{.topology = "fanout", .world = 4};
  const Plan logical = test::cross_rank_plan(s);
  const Plan plan = insert_transfers(logical);
  int transfers = 0;
  for (const auto& a : plan.actors) {
    if (a.kind != ActorKind::transfer) continue;
    ++transfers;
    REQUIRE(a.inputs.size() == 1);
    REQUIRE(a.outputs.size() == 1);
    const auto& src = plan.registers[a.inputs[0].reg];
    const auto& copy = plan.registers[a.outputs[0]];
    CHECK(src.name == "src.out");
    CHECK(copy.name == fmt::format("src.out@r{}", a.where.rank));
    CHECK(copy.shape == src.shape);
    CHECK(copy.slots == src.slots);
    CHECK(a.name == copy.name);
    // Both sinks of that rank read the local copy; the source's register now feeds the transfer.
    REQUIRE(copy.consumers.size() == 2);
    for (auto c : copy.consumers) CHECK(plan.actors[c].where.rank == a.where.rank);
  }
  CHECK(transfers == 3);
  const auto& out = plan.registers[0];
  CHECK(out.consumers.size() == 4);  // sink0 on rank 0 and the three transfers
  CHECK(insert_transfers(plan) == plan);
  // A plan on one rank comes back as it was.
  CrossRankShape one{.topology = "chain", .world = 2};
  Plan local = test::cross_rank_plan(one);
  for (auto& a : local.actors) a.where.rank = 0;
  CHECK(insert_transfers(local) == local);
  CHECK(plan.hash() != logical.hash());
}

TEST_CASE("cross rank: an edge between ranks without a transfer is refused, naming the fix") {
  const Plan logical = test::cross_rank_plan(CrossRankShape{.topology = "chain", .world = 2});
  auto kernels = test::checking_registry();
  try {
    validate(logical, kernels, 0);
    FAIL("validate accepted a cross-rank edge without a transfer");
  } catch (const PlanError& e) {
    CHECK(test::contains(e.what(), "'src.out' crosses from rank 0 ('src') to rank 1 ('sink')"));
    CHECK(test::contains(e.what(), "insert_transfers"));
  }
  // With transfers but without a data plane, the runtime says what is missing.
  try {
    Runtime rt(insert_transfers(logical), kernels, RuntimeSettings{});
    FAIL("a runtime without a data plane accepted a cross-rank plan");
  } catch (const PlanError& e) {
    CHECK(test::contains(e.what(), "no data plane"));
  }
}

TEST_CASE("cross rank: a cycle across ranks without a delay is found before anything runs") {
  Plan p;
  auto a_out = p.add_register({.name = "a.out", .shape = {4}, .dtype = DType::i64});
  auto b_out = p.add_register({.name = "b.out", .shape = {4}, .dtype = DType::i64});
  p.add_actor({.name = "a", .op = "noop", .dtype = DType::i64, .where = {.rank = 0}, .inputs = {{b_out}}, .outputs = {a_out}});
  p.add_actor({.name = "b", .op = "noop", .dtype = DType::i64, .where = {.rank = 1}, .inputs = {{a_out}}, .outputs = {b_out}});
  auto kernels = test::checking_registry();
  const Plan plan = insert_transfers(p);
  CHECK_THROWS_WITH_AS(validate(plan, kernels, 0), doctest::Contains("cannot make progress"), PlanError);
  CHECK_THROWS_WITH_AS(validate(plan, kernels, 1), doctest::Contains("cannot make progress"), PlanError);
  // With one piece of delay on the way back it turns (and the dry run spans both ranks).
  p.actors[0].inputs[0].delay = 1;
  CHECK_NOTHROW(validate(insert_transfers(p), kernels, 0));
}

TEST_CASE("cross rank: chains, fan-out, fan-in and a ring over 2 and 4 ranks keep every invariant" *
          doctest::timeout(120)) {
  for (const char* topology : {"chain", "fanout", "fanin", "ring"}) {
    for (std::uint16_t world : {2, 4}) {
      for (std::int32_t slots : {1, 2, 4}) {
        CAPTURE(topology);
        CAPTURE(world);
        CAPTURE(slots);
        CrossRankShape s{.topology = topology, .world = world, .pieces = 300, .elements = 32, .slots = slots};
        auto results = run_loopback(test::cross_rank_plan(s), world);
        for (std::uint16_t r = 0; r < world; ++r) {
          CAPTURE(r);
          REQUIRE_MESSAGE(results[r].error.empty(), results[r].error);
          const RunReport& rep = *results[r].report;
          for (const auto& a : rep.metrics.actors) {
            CHECK(a.activity == ActorActivity::retired);
            CHECK(a.acts == static_cast<std::uint64_t>(s.pieces));
          }
          for (const auto& reg : rep.metrics.registers) {
            CHECK(reg.written == s.pieces);
            CHECK(reg.max_outstanding <= reg.slots);
          }
        }
      }
    }
  }
}

TEST_CASE("cross rank: transfer actors move the bytes and account their time" * doctest::timeout(60)) {
  CrossRankShape s{.topology = "chain", .world = 2, .pieces = 100, .elements = 1 << 14, .slots = 2};
  auto results = run_loopback(test::cross_rank_plan(s), 2);
  REQUIRE(results[1].error.empty());
  const auto* t = find_actor(*results[1].report, "src.out@r1");
  REQUIRE(t != nullptr);
  CHECK(t->kind == ActorKind::transfer);
  CHECK(t->acts == 100);
  CHECK(t->bytes_out == 100u * (1u << 14) * 8u);
  CHECK(t->lifetime_s() > 0);
  // A rank only reports its own actors.
  CHECK(find_actor(*results[1].report, "src") == nullptr);
  CHECK(find_actor(*results[0].report, "src") != nullptr);
}

namespace {

/// A checker of what landed: it checks before reading and, every `linger_every`-th act, sleeps
/// 200 us and checks again, so that a slot overwritten while still read fails the run.
class LingeringCheck : public Kernel {
 public:
  explicit LingeringCheck(const KernelConfig& cfg) : linger_every_(cfg.attrs.get_int("linger_every", 0)) {}
  void compute(KernelContext& ctx) final {
    check(ctx, "before reading");
    if (linger_every_ > 0 && ctx.piece % linger_every_ == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      check(ctx, "after lingering");
    }
  }

 protected:
  virtual void check(const KernelContext& ctx, const char* when) const = 0;

 private:
  std::int64_t linger_every_;
};

/// "window_check": input i must hold elements [offsets[i], offsets[i] + its size) of register
/// `reg`'s pattern at this piece (a window pulled from the wrong place fails the run).
class WindowCheck final : public LingeringCheck {
 public:
  explicit WindowCheck(const KernelConfig& cfg)
      : LingeringCheck(cfg),
        reg_(cfg.attrs.get_int("reg", 0)),
        offsets_(std::get<std::vector<std::int64_t>>(cfg.attrs.values().at("offsets"))) {}

 private:
  void check(const KernelContext& ctx, const char* when) const override {
    for (std::size_t i = 0; i < ctx.inputs.size(); ++i) {
      auto d = ctx.inputs[i]->data<std::int64_t>();
      for (std::size_t j = 0; j < d.size(); ++j) {
        const std::int64_t want = test::pattern_value(reg_, ctx.piece, offsets_.at(i) + static_cast<std::int64_t>(j));
        if (d[j] != want) {
          throw std::runtime_error(fmt::format("{}: input {} element {} holds {}, not {} (piece {})", when, i, j, d[j],
                                               want, ctx.piece));
        }
      }
    }
  }
  std::int64_t reg_;
  std::vector<std::int64_t> offsets_;
};

/// "gather_check": reads a gathering transfer's register; part i (counts[i] elements, one after
/// another) must hold register regs[i]'s pattern of the piece (a part landed in the wrong place
/// fails the run).
class GatherCheck final : public LingeringCheck {
 public:
  explicit GatherCheck(const KernelConfig& cfg)
      : LingeringCheck(cfg),
        regs_(std::get<std::vector<std::int64_t>>(cfg.attrs.values().at("regs"))),
        counts_(std::get<std::vector<std::int64_t>>(cfg.attrs.values().at("counts"))) {}

 private:
  void check(const KernelContext& ctx, const char* when) const override {
    auto d = ctx.inputs[0]->data<std::int64_t>();
    std::size_t at = 0;
    for (std::size_t i = 0; i < regs_.size(); ++i) {
      for (std::int64_t j = 0; j < counts_[i]; ++j, ++at) {
        const std::int64_t want = test::pattern_value(regs_[i], ctx.piece, j);
        if (at >= d.size() || d[at] != want) {
          throw std::runtime_error(fmt::format("{}: part {} element {} holds {}, not {} (piece {})", when, i, j,
                                               at < d.size() ? d[at] : -1, want, ctx.piece));
        }
      }
    }
    if (at != d.size()) throw std::runtime_error(fmt::format("{}: {} elements, the parts fill {}", when, d.size(), at));
  }
  std::vector<std::int64_t> regs_, counts_;
};

}  // namespace

TEST_CASE("cross rank: transfers of windows pull sub-ranges of one slot, beside a whole pull, under back-pressure" *
          doctest::timeout(120)) {
  // One source on rank 0 (16 elements a piece, 2 slots); on rank 1 four transfers pull windows
  // of its slots (overlapping, one at the very end, one empty) into registers of one slot, and a
  // pattern sink reads the whole register through the transfer insert_transfers adds. The
  // checker lingers every 3rd act, so the windows' slots and the source's stay full
  // (back-pressure) while their bytes must stay what was pulled.
  Plan p;
  CrossRankShape s{.pieces = 300, .linger_every = 5};
  auto src = p.add_register({.name = "src.out", .shape = {test::pattern_elements}, .dtype = DType::i64, .slots = 2});
  p.add_actor(test::detail_xrank::pattern_actor("src", 0, {}, {src}, s));
  const std::vector<std::pair<std::int64_t, std::int64_t>> windows{{0, 4}, {2, 10}, {12, 4}, {16, 0}};
  std::vector<InputPort> pulled;
  std::vector<std::int64_t> offsets;
  for (const auto& [offset, count] : windows) {
    auto r = p.add_register({.name = fmt::format("window{}", offset), .shape = {count}, .dtype = DType::i64, .slots = 1});
    p.add_actor({.name = fmt::format("pull{}", offset), .kind = ActorKind::transfer, .op = "transfer",
                 .dtype = DType::i64, .where = {.rank = 1}, .inputs = {{src}}, .outputs = {r}, .window = offset});
    pulled.push_back({r});
    offsets.push_back(offset);
  }
  p.add_actor({.name = "check", .op = "window_check", .dtype = DType::i64, .where = {.rank = 1}, .inputs = pulled,
               .attrs = Attrs{}.set("reg", static_cast<std::int64_t>(src)).set("offsets", offsets).set("linger_every", 3)});
  p.add_actor(test::detail_xrank::pattern_actor("whole", 1, {src}, {}, s));
  auto kernels = test::checking_registry();
  kernels.add("window_check", DeviceType::cpu, DType::i64,
              [](const KernelConfig& cfg) { return std::make_unique<WindowCheck>(cfg); });
  const Plan plan = insert_transfers(p);
  CHECK(plan.to_text().find("window=12") != std::string::npos);
  // Read in place, pulled, and inline with the requests (the windows are 0-80 bytes).
  for (const Crossing& how : every_crossing()) {
    CAPTURE(how.str());
    const auto results = run_crossing(plan, kernels, how);
    // Each non-empty window, and the whole register for `whole`, 300 pieces each, all one way.
    const RunReport& r0 = *results[0].report;
    const std::uint64_t crossed = 300 * (1 + std::count_if(windows.begin(), windows.end(), [](const auto& w) {
                                           return w.second > 0;
                                         }));
    CHECK(r0.pieces_read_in_place + r0.pieces_inline + r0.pieces_pulled == crossed);
    CHECK((how.in_place ? r0.pieces_read_in_place : how.inline_bytes > 0 ? r0.pieces_inline : r0.pieces_pulled) ==
          crossed);
    CHECK((r0.shared_register_bytes > 0) == how.in_place);
    for (const auto& [offset, count] : windows) {
      const auto* t = find_actor(*results[1].report, fmt::format("pull{}", offset));
      REQUIRE(t != nullptr);
      CHECK(t->acts == 300);
      CHECK(t->bytes_in == static_cast<std::uint64_t>(300 * count * 8));  // the window, not the slot
      CHECK(t->bytes_out == t->bytes_in);
    }
    CHECK(find_actor(*results[1].report, "check")->acts == 300);
    CHECK(find_actor(*results[1].report, "whole")->acts == 300);
  }
}

TEST_CASE("cross rank: a window that leaves its register, changes the dtype or is not a transfer's is refused") {
  Plan p;
  auto src = p.add_register({.name = "src.out", .shape = {4, 4}, .dtype = DType::i64});
  auto ok = p.add_register({.name = "ok", .shape = {8}, .dtype = DType::i64});
  auto past = p.add_register({.name = "past", .shape = {6}, .dtype = DType::i64});
  auto other = p.add_register({.name = "other", .shape = {2}, .dtype = DType::f32});
  auto copied = p.add_register({.name = "copied", .shape = {4, 4}, .dtype = DType::i64});
  CrossRankShape s;
  p.add_actor(test::detail_xrank::pattern_actor("src", 0, {}, {src}, s));
  auto pull = [&](std::string name, RegisterIndex out, std::int64_t window) {
    p.add_actor({.name = std::move(name), .kind = ActorKind::transfer, .op = "transfer", .dtype = DType::i64,
                 .where = {.rank = 1}, .inputs = {{src}}, .outputs = {out}, .window = window});
  };
  pull("ok", ok, 8);
  pull("past", past, 12);
  pull("other", other, 0);
  p.add_actor({.name = "copy", .op = "copy", .dtype = DType::i64, .inputs = {{src}}, .outputs = {copied}, .window = 2});
  auto kernels = test::checking_registry();
  try {
    validate(p, kernels, 0);
    FAIL("validate accepted bad windows");
  } catch (const PlanError& e) {
    const std::string what = e.what();
    CHECK(what.find("'ok'") == std::string::npos);
    CHECK(test::contains(what, "transfer actor 'past' moves elements [12, 18) of 'src.out' (i64[4, 4]) into 'past'"));
    CHECK(test::contains(what, "transfer actor 'other' moves elements [0, 2) of 'src.out' (i64[4, 4]) into 'other' (f32"));
    CHECK(test::contains(what, "compute actor 'copy' has window 2; only a transfer moves a window"));
  }
}

TEST_CASE("cross rank: a gathering transfer lands each input in its part of one slot, under back-pressure" *
          doctest::timeout(120)) {
  // On rank 1 one transfer gathers, in this order: a register of rank 0, one of its own rank
  // (copied), an empty one of rank 0, one of rank 2, and a second of rank 0 (two pulls from one
  // rank for one piece: the tags must tell them apart). A whole pull of the first register by
  // another reader on rank 1 runs beside it. The checker lingers, so the gather's two slots and
  // its sources' stay full while the parts must stay what landed.
  Plan p;
  CrossRankShape s{.pieces = 300, .linger_every = 5};
  auto reg = [&](std::string name, std::int64_t elements) {
    return p.add_register({.name = std::move(name), .shape = {elements}, .dtype = DType::i64, .slots = 2});
  };
  const RegisterIndex a = reg("a.out", 16), local = reg("local.out", 16), empty = reg("empty.out", 0),
                      b = reg("b.out", 16), a2 = reg("a2.out", 8);
  p.add_actor(test::detail_xrank::pattern_actor("a", 0, {}, {a, empty}, s));
  p.add_actor(test::detail_xrank::pattern_actor("local", 1, {}, {local}, s));
  p.add_actor(test::detail_xrank::pattern_actor("b", 2, {}, {b}, s));
  p.add_actor(test::detail_xrank::pattern_actor("a2", 0, {}, {a2}, s));
  const std::vector<RegisterIndex> parts{a, local, empty, b, a2};
  const std::vector<std::int64_t> counts{16, 16, 0, 16, 8};
  const RegisterIndex gathered = reg("gathered", 56);
  std::vector<InputPort> ins;
  for (RegisterIndex r : parts) ins.push_back({r});
  p.add_actor({.name = "gather", .kind = ActorKind::transfer, .op = "transfer", .dtype = DType::i64,
               .where = {.rank = 1}, .inputs = ins, .outputs = {gathered}});
  p.add_actor({.name = "check", .op = "gather_check", .dtype = DType::i64, .where = {.rank = 1}, .inputs = {{gathered}},
               .attrs = Attrs{}
                            .set("regs", std::vector<std::int64_t>(parts.begin(), parts.end()))
                            .set("counts", counts)
                            .set("linger_every", 3)});
  p.add_actor(test::detail_xrank::pattern_actor("whole", 1, {a}, {}, s));
  auto kernels = test::checking_registry();
  kernels.add("gather_check", DeviceType::cpu, DType::i64,
              [](const KernelConfig& cfg) { return std::make_unique<GatherCheck>(cfg); });
  const Plan plan = insert_transfers(p);
  // The gather is a transfer already: insert_transfers adds one for `whole` only.
  CHECK(std::count_if(plan.actors.begin(), plan.actors.end(),
                      [](const ActorDesc& d) { return d.kind == ActorKind::transfer; }) == 2);
  // Read in place; pulled; inline with the requests; a.out (128 bytes) pulled while a2.out (64)
  // comes inline.
  std::vector<Crossing> ways = every_crossing();
  ways.push_back({.inline_bytes = 64});
  for (const Crossing& how : ways) {
    CAPTURE(how.str());
    const auto results = run_crossing(plan, kernels, how);
    // Rank 0 hands a.out to the gather and to whole's transfer, a2.out to the gather.
    const RunReport& r0 = *results[0].report;
    if (how.in_place) {
      CHECK(r0.pieces_read_in_place == 900);
      CHECK(results[2].report->pieces_read_in_place == 300);
      // a.out, a2.out and their pattern actor's other register, 2 slots each, 64-byte aligned.
      CHECK(r0.shared_register_bytes >= 2 * (128 + 64));
    } else {
      CHECK(r0.pieces_inline == (how.inline_bytes >= 128 ? 900 : how.inline_bytes >= 64 ? 300 : 0));
      CHECK(r0.pieces_pulled == 900 - r0.pieces_inline);
      CHECK(r0.shared_register_bytes == 0);
    }
    const auto* g = find_actor(*results[1].report, "gather");
    REQUIRE(g != nullptr);
    CHECK(g->acts == 300);
    CHECK(g->bytes_in == static_cast<std::uint64_t>(300 * 56 * 8));
    CHECK(g->bytes_out == g->bytes_in);
    CHECK(find_actor(*results[1].report, "check")->acts == 300);
    CHECK(find_actor(*results[1].report, "whole")->acts == 300);
    for (const char* source : {"a", "a2"}) CHECK(find_actor(*results[0].report, source)->acts == 300);
    CHECK(find_actor(*results[2].report, "b")->acts == 300);
  }
}

TEST_CASE("cross rank: a gather that does not fill its register, mixes dtypes or crosses no rank is refused") {
  Plan p;
  CrossRankShape s;
  auto reg = [&](std::string name, std::int64_t elements, DType dt = DType::i64) {
    return p.add_register({.name = std::move(name), .shape = {elements}, .dtype = dt});
  };
  const RegisterIndex a = reg("a.out", 16), mine = reg("mine.out", 16), mine2 = reg("mine2.out", 4),
                      real = reg("real.out", 16, DType::f32), dev = reg("dev.out", 16);
  p.add_actor(test::detail_xrank::pattern_actor("a", 0, {}, {a, real}, s));
  p.add_actor(test::detail_xrank::pattern_actor("mine", 1, {}, {mine, mine2}, s));
  auto on_sim = test::detail_xrank::pattern_actor("dev", 1, {}, {dev}, s);
  on_sim.where.device = Device{DeviceType::sim, 0};
  p.add_actor(on_sim);
  auto gather = [&](std::string name, std::vector<RegisterIndex> from, std::int64_t elements, std::int64_t window = -1) {
    std::vector<InputPort> ins;
    for (RegisterIndex r : from) ins.push_back({r});
    const RegisterIndex out = reg(name, elements);
    p.add_actor({.name = std::move(name), .kind = ActorKind::transfer, .op = "transfer", .dtype = DType::i64,
                 .where = {.rank = 1}, .inputs = std::move(ins), .outputs = {out}, .window = window});
  };
  gather("ok", {a, mine, mine2}, 36);
  gather("short", {a, mine}, 40);
  gather("twice", {a, a}, 32);
  gather("mixed", {a, real}, 32);
  gather("at_home", {mine, mine2}, 20);
  gather("windowed", {a, mine}, 32, 0);
  gather("from_device", {a, dev}, 32);
  try {
    validate(p, test::checking_registry(), 0);
    FAIL("validate accepted bad gathers");
  } catch (const PlanError& e) {
    const std::string what = e.what();
    CHECK(what.find("'ok'") == std::string::npos);
    CHECK(test::contains(what, "transfer actor 'short' gathers 32 elements from 2 inputs into 'short' (i64[40], 40 "
                               "elements); they must fill it"));
    CHECK(test::contains(what, "transfer actor 'twice' gathers 'a.out' twice"));
    CHECK(test::contains(what, "transfer actor 'mixed' gathers 'real.out' (f32) into 'mixed' (i64); a transfer keeps "
                               "the dtype"));
    CHECK(test::contains(what, "transfer actor 'at_home' gathers 2 inputs, all from its own rank 1; a transfer crosses "
                               "ranks"));
    CHECK(test::contains(what, "transfer actor 'windowed' gathers 2 inputs and has window 0; a window is of one input"));
    CHECK(test::contains(what, "transfer actor 'from_device' gathers 'dev.out' from sim:0 of its own rank 1 onto cpu:0; "
                               "it copies host memory only"));
  }
}

TEST_CASE("cross rank: a reducing transfer must add a float piece from another rank to one of its own, inside both") {
  Plan p;
  CrossRankShape s;
  auto reg = [&](std::string name, std::int64_t elements, DType dt = DType::f32) {
    return p.add_register({.name = std::move(name), .shape = {elements}, .dtype = dt});
  };
  const RegisterIndex a = reg("a.out", 16), mine = reg("mine.out", 16), ints = reg("ints.out", 16, DType::i64),
                      my_ints = reg("my_ints.out", 16, DType::i64);
  p.add_actor(test::detail_xrank::pattern_actor("a", 0, {}, {a, ints}, s));
  p.add_actor(test::detail_xrank::pattern_actor("mine", 1, {}, {mine, my_ints}, s));
  auto add = [&](std::string name, std::vector<RegisterIndex> from, std::int64_t elements, std::int64_t offset = 0,
                 std::int64_t window = -1, DType dt = DType::f32, Device on = {}) {
    std::vector<InputPort> ins;
    for (RegisterIndex r : from) ins.push_back({r});
    const RegisterIndex out = reg(name, elements, dt);
    p.add_actor({.name = std::move(name), .kind = ActorKind::transfer, .op = "transfer.add", .dtype = dt,
                 .where = {.rank = 1, .device = on}, .inputs = std::move(ins), .outputs = {out}, .window = window,
                 .attrs = {{"offset", offset}}, .adds = true});
  };
  add("ok", {a, mine}, 16);
  add("ok_window", {a, mine}, 4, 12, 12);
  add("past_own", {a, mine}, 16, 4);
  add("past_window", {a, mine}, 16, 0, 8);
  add("sizes", {a, mine}, 8);
  add("ints", {ints, my_ints}, 16, 0, -1, DType::i64);
  add("backwards", {mine, a}, 16);
  add("three", {a, mine, ints}, 16);
  add("on_device", {a, mine}, 16, 0, -1, DType::f32, Device{DeviceType::sim, 0});
  try {
    validate(p, test::checking_registry(), 0);
    FAIL("validate accepted bad reducing transfers");
  } catch (const PlanError& e) {
    const std::string what = e.what();
    CHECK(what.find("'ok'") == std::string::npos);
    CHECK(what.find("'ok_window'") == std::string::npos);
    CHECK(test::contains(what, "transfer actor 'past_own' adds elements [4, 20) of 'mine.out', which has 16"));
    CHECK(test::contains(what, "transfer actor 'past_window' adds elements [8, 24) of 'a.out', which has 16"));
    CHECK(test::contains(what, "transfer actor 'sizes' adds 'a.out' (16 elements) into 'sizes' (8 elements); without a "
                               "window they are the same size"));
    CHECK(test::contains(what, "transfer actor 'ints' adds 'ints.out' (i64) and 'my_ints.out' (i64) into 'ints' (i64); "
                               "a reducing transfer adds f32 or f64, one dtype"));
    CHECK(test::contains(what, "transfer actor 'backwards' adds 'mine.out' (rank 1) to 'a.out' (rank 0) on rank 1; the "
                               "first comes from another rank, the second from its own"));
    CHECK(test::contains(what, "transfer actor 'three' adds 3 inputs into 1 outputs; a reducing transfer (transfer.add) "
                               "adds a piece from another rank to one of its own: two inputs, one output"));
    CHECK(test::contains(what, "transfer actor 'on_device' adds on sim:0; a reducing transfer adds on the CPU"));
  }
}

TEST_CASE("cross rank: a kernel failing on one rank fails that rank with the actor and piece" *
          doctest::timeout(60)) {
  CrossRankShape s{.topology = "chain", .world = 3, .pieces = 500, .fail_rank = 1, .fail_at = 42};
  auto results = run_loopback(test::cross_rank_plan(s), 3);
  CHECK(test::contains(results[1].error, "actor 's1'"));
  CHECK(test::contains(results[1].error, "injected failure at piece 42"));
  for (std::uint16_t r : {0, 2}) CHECK(test::contains(results[r].error, "rank 1 failed"));
}

TEST_CASE("cross rank: a sink that stops early detaches across ranks and the source still ends" *
          doctest::timeout(60)) {
  // The source on rank 0 could make 10000 pieces; the reader on rank 1 is fed by a 50-piece
  // source too and ends after 50: its detach must reach rank 0 through the transfer actor.
  Plan p;
  auto big = p.add_register({.name = "big.out", .shape = {8}, .dtype = DType::i64});
  auto small = p.add_register({.name = "small.out", .shape = {8}, .dtype = DType::i64});
  CrossRankShape s;
  auto src_big = test::detail_xrank::pattern_actor("big", 0, {}, {big}, s);
  src_big.pieces = 10'000;
  auto src_small = test::detail_xrank::pattern_actor("small", 1, {}, {small}, s);
  src_small.pieces = 50;
  p.add_actor(src_big);
  p.add_actor(src_small);
  p.add_actor(test::detail_xrank::pattern_actor("sink", 1, {big, small}, {}, s));
  auto results = run_loopback(p, 2);
  REQUIRE(results[0].error.empty());
  REQUIRE(results[1].error.empty());
  const auto* b = find_actor(*results[0].report, "big");
  REQUIRE(b != nullptr);
  CHECK(b->acts < 10'000);
  CHECK(find_actor(*results[1].report, "sink")->acts == 50);
}

TEST_CASE("cross rank: empty registers cross ranks as bare requests" * doctest::timeout(60)) {
  CrossRankShape s{.topology = "ring", .world = 3, .pieces = 500, .elements = 0, .slots = 1};
  auto results = run_loopback(test::cross_rank_plan(s), 3);
  for (std::uint16_t r = 0; r < 3; ++r) {
    REQUIRE_MESSAGE(results[r].error.empty(), results[r].error);
    for (const auto& a : results[r].report->metrics.actors) CHECK(a.acts == 500);
  }
}

TEST_CASE("cross rank: the request and ack an act sends one rank share a link message where held, in order" *
          doctest::timeout(120)) {
  struct Way {
    std::string name;
    std::int64_t elements;
    bool shared;
  };
  const Way ways[] = {{"bare requests", 0, true}, {"offered and pulled", 64, false}};
  const std::uint32_t holds[] = {0, 1'000'000'000};  // none; 1 s: every act after the first is brief
  auto settings = [](const Way& way, std::uint32_t hold_ns) {
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(20'000);
    rs.shared_registers = way.shared;
    rs.inline_payload_bytes = 0;  // what does not lie in shared memory is offered and pulled
    rs.hold_messages_ns = hold_ns;
    return rs;
  };
  SUBCASE("ping and pong in lockstep: each hop's ack and request go as one") {
    // ping(r0) and pong(r1) each wait for the other's last piece (one slot everywhere): the
    // request from the other rank starts a transfer's act (which acks the other rank) and then
    // its reader's act (which requests from it), so the two go together once held.
    for (const Way& way : ways) {
      for (const std::uint32_t hold_ns : holds) {
        CAPTURE(way.name);
        CAPTURE(hold_ns);
        constexpr std::int64_t pieces = 300;
        Plan p;
        auto reg = [&](std::string name) {
          return p.add_register({.name = std::move(name), .shape = {way.elements}, .dtype = DType::f32, .slots = 1});
        };
        auto tick = reg("tick");
        auto ping = reg("ping.out");
        auto pong = reg("pong.out");
        p.add_actor({.name = "ticks", .kind = ActorKind::source, .op = "noop", .outputs = {tick}, .pieces = pieces});
        p.add_actor({.name = "ping", .op = "noop", .inputs = {{tick}, {pong, 1}}, .outputs = {ping}});
        p.add_actor({.name = "pong", .op = "noop", .where = {.rank = 1}, .inputs = {{ping}}, .outputs = {pong}});
        auto results = test::run_on_loopback(insert_transfers(p), KernelRegistry::with_builtin_kernels(),
                                             settings(way, hold_ns));
        for (std::uint16_t r = 0; r < 2; ++r) {
          CAPTURE(r);
          REQUIRE_MESSAGE(results[r].error.empty(), results[r].error);
          const RunReport& rep = *results[r].report;
          // Ping reads all of pong's pieces but the last, so pong may stop before its last act
          // (the detach that says so can come first).
          const auto* mine = find_actor(rep, r == 0 ? "ping" : "pong");
          REQUIRE(mine != nullptr);
          CHECK(mine->acts >= static_cast<std::uint64_t>(r == 0 ? pieces : pieces - 1));
          // Each piece costs each rank an ack and a request to the other.
          CHECK(rep.messages_to_other_ranks >= 2u * (pieces - 1));
          if (hold_ns == 0) {
            CHECK(rep.link_messages == rep.messages_to_other_ranks);
          } else {
            CHECK(rep.link_messages <= rep.messages_to_other_ranks * 2 / 3);  // most went in pairs
          }
        }
      }
    }
  }
  SUBCASE("a ring that checks every piece: held or not, nothing is lost or reordered") {
    // src(r0) -> mid(r1) -> sink(r0), two slots: a transfer's ack and mid's request go
    // together only where both come of one message (not in the steady state of a stream).
    for (const Way& way : ways) {
      for (const std::uint32_t hold_ns : holds) {
        CAPTURE(way.name);
        CAPTURE(hold_ns);
        const CrossRankShape s{.topology = "ring", .world = 2, .pieces = 300, .elements = way.elements, .slots = 2};
        auto results =
            test::run_on_loopback(insert_transfers(test::cross_rank_plan(s)), test::checking_registry(), settings(way, hold_ns));
        for (std::uint16_t r = 0; r < 2; ++r) {
          CAPTURE(r);
          REQUIRE_MESSAGE(results[r].error.empty(), results[r].error);
          const RunReport& rep = *results[r].report;
          for (const auto& a : rep.metrics.actors) CHECK(a.acts == 300u);
          CHECK(rep.link_messages <= rep.messages_to_other_ranks);
          if (hold_ns == 0) CHECK(rep.link_messages == rep.messages_to_other_ranks);
        }
      }
    }
  }
}

namespace {

/// When each act of "stamp" (a source) began and each act of "slow" (which sleeps 30 ms) ended,
/// by piece.
struct Stamps {
  static constexpr int pieces = 4;
  std::array<std::atomic<std::int64_t>, pieces> src_began{};
  std::array<std::atomic<std::int64_t>, pieces> slow_ended{};
  static std::int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

}  // namespace

TEST_CASE("cross rank: a held message goes before an act that takes long, not after it" * doctest::timeout(60)) {
  // src(r0, one slot) -> slow(r1). The transfer on rank 1 acks src's piece k as slow starts
  // act k: held through that act, the ack would reach src only when it ended, and src's act
  // k + 1 (which needs the slot back) would begin after slow's act k ended. A slow act is
  // never brief, so what is held goes before it.
  Stamps stamps;
  KernelRegistry kernels;
  kernels.add_fn("stamp", DeviceType::cpu, DType::f32, [&](KernelContext& ctx) {
    stamps.src_began.at(static_cast<std::size_t>(ctx.piece)).store(Stamps::now_us());
  });
  kernels.add_fn("slow", DeviceType::cpu, DType::f32, [&](KernelContext& ctx) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    stamps.slow_ended.at(static_cast<std::size_t>(ctx.piece)).store(Stamps::now_us());
  });
  Plan p;
  auto r = p.add_register({.name = "src.out", .shape = {16}, .dtype = DType::f32, .slots = 1});
  p.add_actor({.name = "src", .kind = ActorKind::source, .op = "stamp", .outputs = {r}, .pieces = Stamps::pieces});
  p.add_actor({.name = "slow", .op = "slow", .where = {.rank = 1}, .inputs = {{r}}});
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  rs.inline_payload_bytes = 0;
  rs.shared_registers = false;  // offered and pulled: the request is a plain message too
  auto results = test::run_on_loopback(insert_transfers(p), kernels, rs);
  for (const auto& res : results) REQUIRE_MESSAGE(res.error.empty(), res.error);
  for (std::size_t k = 1; k + 1 < Stamps::pieces; ++k) {
    CAPTURE(k);
    CHECK(stamps.src_began[k + 1].load() < stamps.slow_ended[k].load());
  }
}

TEST_CASE("cross rank: idle workers busy-poll only where the busy threads leave a core or the rank has cores of its "
          "own, and say which" *
          doctest::timeout(60)) {
  const CrossRankShape s{.topology = "chain", .world = 2, .pieces = 300, .elements = 64, .slots = 2};
  const Plan plan = insert_transfers(test::cross_rank_plan(s));
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  struct Case {
    IdlePolling policy;
    std::uint32_t ranks_on_host, own_cores;
    std::string says;
    bool shares_memory = true;
  };
  for (const Case& c :
       {Case{IdlePolling::automatic, 0, 0, "parking: 1 worker, ranks on this host not known"},
        Case{IdlePolling::automatic, 10'000, 0,
             fmt::format("parking: 1 worker x 10000 ranks on this host >= {} cores", cores)},
        Case{IdlePolling::automatic, 1, 0,
             cores > 1 ? fmt::format("busy-polling: 1 worker x 1 rank on this host < {} cores", cores)
                       : "parking: 1 worker x 1 rank on this host >= 1 cores"},
        // Bound to a core of its own, a rank polls however many ranks share the host.
        Case{IdlePolling::automatic, 10'000, 1,
             fmt::format("busy-polling: 1 worker x 10000 ranks on this host >= {} cores, 1 <= 1 core of its own (bound)",
                         cores)},
        Case{IdlePolling::automatic, 0, 2, "busy-polling: 1 worker, ranks on this host not known, 1 <= 2 cores of its own"},
        // Not where a peer is beyond shared memory (TCP: the kernel's network stack needs the core).
        Case{IdlePolling::automatic, 10'000, 1,
             fmt::format("parking: 1 worker x 10000 ranks on this host >= {} cores, 1 <= 1 core of its own (bound), a "
                         "peer beyond shared memory",
                         cores),
             false},
        Case{IdlePolling::busy_poll, 0, 0, "busy-polling (asked for): 1 worker, ranks on this host not known"},
        Case{IdlePolling::park, 1, 1, "parking (asked for)"}}) {
    CAPTURE(c.says);
    RuntimeSettings settings;
    settings.stall_timeout = std::chrono::milliseconds(20'000);
    settings.idle_polling = c.policy;
    settings.ranks_on_host = c.ranks_on_host;
    settings.own_cores = c.own_cores;
    auto results = test::run_on_loopback(plan, test::checking_registry(), settings, c.shares_memory);
    for (std::uint16_t r = 0; r < 2; ++r) {
      CAPTURE(r);
      REQUIRE_MESSAGE(results[r].error.empty(), results[r].error);
      const RunReport& rep = *results[r].report;
      CHECK(test::contains(rep.idle_polling, c.says));
      for (const auto& a : rep.metrics.actors) CHECK(a.acts == static_cast<std::uint64_t>(s.pieces));
      // A busy-polling worker never sleeps on its mailbox.
      if (test::contains(c.says, "busy-polling")) CHECK(rep.parks == 0);
    }
  }
  // A rank that talks to nobody has nothing to poll for.
  Plan alone = test::cross_rank_plan(CrossRankShape{.topology = "chain", .world = 2, .pieces = 10});
  for (auto& a : alone.actors) a.where.rank = 0;
  RuntimeSettings settings;
  settings.ranks_on_host = 1;
  const KernelRegistry kernels = test::checking_registry();
  Runtime rt(alone, kernels, settings);
  CHECK(test::contains(rt.run().idle_polling, "parking: no other rank to poll for"));
}

// baton-launch numbers ranks node by node (BATON_RANK = node_rank x nproc_per_node + local
// rank), so the host of rank r is r / local_world_size; unknown without the local world size or
// where it does not divide the world (TrainConfig::rank_hosts then stays empty: the flat ring).
TEST_CASE("cross rank: the job environment says which host each rank is on") {
  CHECK(JobEnvironment{.world_size = 4, .local_world_size = 2}.rank_hosts() == std::vector<std::uint32_t>{0, 0, 1, 1});
  CHECK(JobEnvironment{.world_size = 6, .local_world_size = 3}.rank_hosts() ==
        std::vector<std::uint32_t>{0, 0, 0, 1, 1, 1});
  CHECK(JobEnvironment{.world_size = 2, .local_world_size = 2}.rank_hosts() == std::vector<std::uint32_t>{0, 0});
  CHECK(JobEnvironment{.world_size = 4}.rank_hosts().empty());
  CHECK(JobEnvironment{.world_size = 5, .local_world_size = 2}.rank_hosts().empty());
}

namespace {

/// Rank 0's end of a loopback hub that garbles where its request_mapped messages say a piece
/// lies (the nonce of the segment, the last 8 bytes of the 56: baton's MappedRequest).
class GarblingLink final : public transport::Link {
 public:
  explicit GarblingLink(transport::Link& inner) : inner_(inner) {}
  std::uint32_t rank() const override { return inner_.rank(); }
  std::uint32_t world_size() const override { return inner_.world_size(); }
  void set_handler(transport::LinkHandler* h) override { inner_.set_handler(h); }
  void send(std::uint32_t to, const void* data, std::size_t size) override {
    std::array<unsigned char, max_message> bytes{};
    std::memcpy(bytes.data(), data, size);
    if (size == 56) bytes[48] ^= 0x5a;
    garbled_ += size == 56;
    inner_.send(to, bytes.data(), size);
  }
  void send_inline(std::uint32_t to, const void* data, std::size_t size, const void* payload,
                   std::size_t payload_size) override {
    inner_.send_inline(to, data, size, payload, payload_size);
  }
  void send_payload(std::uint32_t to, std::uint64_t tag, const void* data, std::size_t size) override {
    inner_.send_payload(to, tag, data, size);
  }
  void receive_payload(std::uint32_t from, std::uint64_t tag, void* dest, std::size_t size,
                       std::uint64_t cookie) override {
    inner_.receive_payload(from, tag, dest, size, cookie);
  }
  bool shares_memory_with(std::uint32_t peer) const override { return inner_.shares_memory_with(peer); }
  int garbled() const { return garbled_.load(); }

 private:
  transport::Link& inner_;
  std::atomic<int> garbled_{0};
};

}  // namespace

TEST_CASE("cross rank: a piece said to lie where it does not fails the reader, naming the piece and why" *
          doctest::timeout(60)) {
  CrossRankShape s{.topology = "chain", .world = 2, .pieces = 50};
  const Plan plan = insert_transfers(test::cross_rank_plan(s));
  const auto kernels = test::checking_registry();
  transport::LoopbackHub hub(2);
  GarblingLink garbling(hub.link(0));
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (std::uint16_t r = 0; r < 2; ++r) {
    RuntimeSettings rs;
    rs.rank = r;
    rs.link = r == 0 ? static_cast<transport::Link*>(&garbling) : &hub.link(r);
    rs.stall_timeout = std::chrono::milliseconds(20'000);
    runtimes.push_back(std::make_unique<Runtime>(plan, kernels, rs));
  }
  hub.start();
  std::array<std::string, 2> errors;
  std::vector<std::thread> threads;
  for (std::uint16_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        runtimes[r]->run();
      } catch (const std::exception& e) {
        errors[r] = e.what();
        runtimes[1 - r]->abort(fmt::format("rank {} failed: {}", r, e.what()));
      }
    });
  }
  for (auto& t : threads) t.join();
  hub.stop();
  CHECK(garbling.garbled() > 0);
  INFO(errors[1]);
  CHECK(test::contains(errors[1], "rank 0 told "));
  CHECK(test::contains(errors[1], "where piece 0 of 'src.out' lies: cannot map the register memory of process"));
  CHECK(test::contains(errors[1], "not the register segment it named"));
  CHECK_FALSE(errors[0].empty());  // ended by rank 1's failure, not left waiting
}
