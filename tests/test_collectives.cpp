// The ring all-reduce made of actors (graph/collectives.h) sums exactly, on every member, for
// sizes from one element to 64 MiB, odd sizes, 2-4 members on ranks or in-process devices,
// with one or many segments per chunk, and with fewer slots than segments in flight.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph/collectives.h"
#include "loopback_run.h"

using namespace baton;

namespace {

// Small integers: every sum is exact in float32, so the check is equality.
float value(std::int64_t member, std::int64_t piece, std::int64_t i) {
  return static_cast<float>((member + 1) * 1000 + i % 977 + piece * 7);
}

KernelRegistry registry(std::int64_t members) {
  KernelRegistry k = KernelRegistry::with_builtin_kernels();
  add_collective_kernels(k);
  k.add("test.fill", DeviceType::cpu, DType::f32, [](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    // Elements from "at" on of the member's tensor (a part of it starts there).
    struct Fill final : Kernel {
      std::int64_t member, at;
      Fill(std::int64_t m, std::int64_t a) : member(m), at(a) {}
      void compute(KernelContext& ctx) override {
        auto out = ctx.outputs[0]->data<float>();
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = value(member, ctx.piece, at + static_cast<std::int64_t>(i));
      }
    };
    return std::make_unique<Fill>(cfg.attrs.get_int("member", -1), cfg.attrs.get_int("at", 0));
  });
  k.add("test.check", DeviceType::cpu, DType::f32, [members](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    // The sums of elements from "at" on (a reduce-scatter's part starts there).
    struct Check final : Kernel {
      std::int64_t members, at;
      std::string who;
      Check(std::int64_t n, std::int64_t a, std::string w) : members(n), at(a), who(std::move(w)) {}
      void compute(KernelContext& ctx) override {
        auto in = ctx.inputs[0]->data<float>();
        for (std::size_t i = 0; i < in.size(); ++i) {
          float want = 0;
          for (std::int64_t j = 0; j < members; ++j) want += value(j, ctx.piece, at + static_cast<std::int64_t>(i));
          if (in[i] != want) {
            throw std::runtime_error(
                fmt::format("{}: piece {} element {} is {}, the sum is {}", who, ctx.piece, i, in[i], want));
          }
        }
      }
    };
    return std::make_unique<Check>(members, cfg.attrs.get_int("at", 0), std::string(cfg.actor));
  });
  return k;
}

/// N members, each a source, the all-reduce and a checking sink; member j at places[j].
Plan allreduce_plan(const std::vector<Placement>& places, std::int64_t elements, std::int64_t pieces,
                    const AllReduceSettings& settings = {}) {
  Plan p;
  std::vector<AllReduceMember> members;
  for (std::size_t j = 0; j < places.size(); ++j) {
    const std::string suffix = fmt::format("@m{}", j);
    auto r = p.add_register({.name = "grad" + suffix, .shape = {elements}, .dtype = DType::f32});
    p.add_actor({.name = "fill" + suffix, .kind = ActorKind::source, .op = "test.fill", .where = places[j],
                 .outputs = {r}, .pieces = pieces, .attrs = {{"member", static_cast<std::int64_t>(j)}}});
    members.push_back({places[j], r, suffix});
  }
  auto results = add_allreduce(p, "ar", members, {elements}, DType::f32, 2, settings);
  for (std::size_t j = 0; j < places.size(); ++j) {
    p.add_actor({.name = fmt::format("check@m{}", j), .op = "test.check", .where = places[j], .inputs = {{results[j]}}});
  }
  return p;
}

}  // namespace

TEST_CASE("Collectives.AllReduceSumsOnEveryRank" * doctest::timeout(240)) {
  for (std::int64_t n : {2, 3, 4}) {
    for (std::int64_t elements : {std::int64_t{1}, std::int64_t{2}, std::int64_t{7}, std::int64_t{1000},
                                  std::int64_t{65537}, std::int64_t{1} << 20, std::int64_t{16} << 20}) {
      if (elements == (std::int64_t{16} << 20) && n > 2) continue;  // 64 MiB: two ranks are enough here
      CAPTURE(n);
      CAPTURE(elements);
      std::vector<Placement> places;
      for (std::int64_t j = 0; j < n; ++j) places.push_back({.rank = static_cast<std::uint16_t>(j)});
      const std::int64_t pieces = elements > 100'000 ? 2 : 5;
      auto results = test::run_on_loopback(insert_transfers(allreduce_plan(places, elements, pieces)), registry(n));
      for (const auto& r : results) {
        REQUIRE_MESSAGE(r.error.empty(), r.error);
        for (const auto& a : r.report->metrics.actors) CHECK(a.acts == static_cast<std::uint64_t>(pieces));
      }
    }
  }
}

TEST_CASE("Collectives.AllReduceOverInProcessDevices" * doctest::timeout(60)) {
  for (std::int64_t n : {2, 4}) {
    for (std::int64_t elements : {3, 4099}) {
      std::vector<Placement> places;
      for (std::int64_t j = 0; j < n; ++j) places.push_back({.device = Device{DeviceType::cpu, static_cast<std::uint8_t>(j)}});
      Runtime rt(allreduce_plan(places, elements, 20), registry(n));
      // fill, gather, check per member; one segment per chunk, n-1 adds per chunk and no slice
      // (the first add reads its neighbour's input in place on the same rank).
      CHECK(rt.run().metrics.actors.size() == static_cast<std::size_t>(3 * n + n * (n - 1)));
    }
  }
}

// Many segments per chunk, one slot per hop: 7 all-reduces of 12 segments each stream through
// the chains, every hop waiting for its consumer's ack before the next segment.
TEST_CASE("Collectives.AllReducePipelinesSegmentsUnderBackPressure" * doctest::timeout(120)) {
  const AllReduceSettings fine{.segment_bytes = 4096, .max_segments = 12, .slots = 1};
  const std::int64_t elements = 100'003;  // chunks of 33335 / 33334 elements: segments of unequal size
  CHECK(allreduce_segments(elements, DType::f32, 3, fine) == 12);
  SUBCASE("ranks") {
    // Each hop from another rank adds as it receives (a reducing transfer) or receives and then
    // adds (unfused); its partial read in the previous member's slot, inline with the request,
    // or pulled into the slot (the reducing transfer then adds its segment once it has landed,
    // holding the segment's piece till then).
    struct Way {
      bool fused, in_place;
      std::size_t inline_bytes;
    };
    for (const Way way : {Way{true, true, 0}, Way{true, false, 0}, Way{true, false, 16 << 10}, Way{false, true, 0},
                          Way{false, false, 0}}) {
      for (std::int64_t n : {2, 3}) {
        CAPTURE(n);
        CAPTURE(way.fused);
        CAPTURE(way.in_place);
        CAPTURE(way.inline_bytes);
        std::vector<Placement> places;
        for (std::int64_t j = 0; j < n; ++j) places.push_back({.rank = static_cast<std::uint16_t>(j)});
        AllReduceSettings settings = fine;
        settings.fuse_receive_add = way.fused;
        RuntimeSettings rs;
        rs.shared_registers = way.in_place;
        rs.inline_payload_bytes = way.inline_bytes;
        auto results =
            test::run_on_loopback(insert_transfers(allreduce_plan(places, elements, 7, settings)), registry(n), rs);
        std::uint64_t in_place = 0, inline_payload = 0, pulled = 0;
        for (const auto& r : results) {
          REQUIRE_MESSAGE(r.error.empty(), r.error);
          for (const auto& a : r.report->metrics.actors) CHECK(a.acts == 7u);
          in_place += r.report->pieces_read_in_place;
          inline_payload += r.report->pieces_inline;
          pulled += r.report->pieces_pulled;
        }
        // Every piece that crossed went the way asked for; inline only up to 16 KiB: with 3
        // members the segments have 11 KiB, with 2 they have 16.7 KiB and are pulled.
        const std::uint64_t crossed = in_place + inline_payload + pulled;
        const bool inline_fits = way.inline_bytes > 0 && n == 3;
        CHECK(crossed > 0);
        CHECK(in_place == (way.in_place ? crossed : 0));
        CHECK(inline_payload == (inline_fits ? crossed : 0));
        CHECK(pulled == (!way.in_place && !inline_fits ? crossed : 0));
      }
    }
  }
  SUBCASE("devices") {
    std::vector<Placement> places;
    for (std::uint8_t j = 0; j < 3; ++j) places.push_back({.device = Device{DeviceType::cpu, j}});
    Runtime rt(allreduce_plan(places, elements, 7, fine), registry(3));
    CHECK(rt.run().metrics.actors.size() == static_cast<std::size_t>(3 * 3 + 3 * 2 * 12));
  }
}

namespace {

/// N members whose input is in parts of the sizes given (a gradient bucket's weights' gradients,
/// never packed), each part a source filling its elements.
std::vector<AllReduceMember> members_in_parts(Plan& p, const std::vector<Placement>& places,
                                              const std::vector<std::int64_t>& sizes, std::int64_t pieces) {
  std::vector<AllReduceMember> members;
  for (std::size_t j = 0; j < places.size(); ++j) {
    const std::string suffix = fmt::format("@m{}", j);
    std::vector<RegisterIndex> parts;
    std::int64_t at = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      parts.push_back(p.add_register({.name = fmt::format("grad{}{}", k, suffix), .shape = {sizes[k]}, .dtype = DType::f32}));
      p.add_actor({.name = fmt::format("fill{}{}", k, suffix), .kind = ActorKind::source, .op = "test.fill",
                   .where = places[j], .outputs = {parts.back()}, .pieces = pieces,
                   .attrs = {{"member", static_cast<std::int64_t>(j)}, {"at", at}}});
      at += sizes[k];
    }
    members.push_back({places[j], parts.front(), suffix, parts});
  }
  return members;
}

/// members_in_parts(); the reduce-scatter, and a check of every part of every member's chunk of
/// the sum.
Plan reduce_scatter_in_parts(const std::vector<Placement>& places, const std::vector<std::int64_t>& sizes,
                             std::int64_t pieces, const AllReduceSettings& settings) {
  Plan p;
  std::int64_t total = 0;
  for (std::int64_t s : sizes) total += s;
  const std::vector<AllReduceMember> members = members_in_parts(p, places, sizes, pieces);
  const ReduceScattered rs = add_reduce_scatter(p, "rs", members, {total}, DType::f32, settings);
  for (std::size_t c = 0; c < places.size(); ++c) {
    std::int64_t at = rs.offsets[c];
    for (RegisterIndex part : rs.parts[c]) {
      p.add_actor({.name = fmt::format("check{}.{}", c, part), .op = "test.check", .where = places[c],
                   .inputs = {{part}}, .attrs = {{"at", at}}});
      at += numel(p.registers[part].shape);
    }
    CHECK(at == rs.offsets[c + 1]);
  }
  return p;
}

}  // namespace

// A member's input may be several registers (AllReduceMember::parts): each actor of the chains
// reads the parts its segment is in, wherever they lie, and the sums are exact. Parts of uneven
// sizes, so segments start and end inside parts and span several; the ring with many segments
// (one slot a hop) and the direct form; on ranks and on in-process devices.
TEST_CASE("Collectives.ReduceScatterReadsAnInputInPartsWhereTheyLie" * doctest::timeout(120)) {
  const std::vector<std::int64_t> sizes{5, 3000, 1, 17, 4099, 700};  // 7822 elements
  const AllReduceSettings ring{.segment_bytes = 1024, .max_segments = 12, .slots = 1};
  const AllReduceSettings direct{.algorithm = AllReduceAlgorithm::direct};
  for (const auto* settings : {&ring, &direct}) {
    CAPTURE(settings == &ring);
    for (std::int64_t n : {2, 3}) {
      CAPTURE(n);
      std::vector<Placement> ranks, devices;
      for (std::int64_t j = 0; j < n; ++j) {
        ranks.push_back({.rank = static_cast<std::uint16_t>(j)});
        devices.push_back({.device = Device{DeviceType::cpu, static_cast<std::uint8_t>(j)}});
      }
      for (const auto& r :
           test::run_on_loopback(insert_transfers(reduce_scatter_in_parts(ranks, sizes, 3, *settings)), registry(n))) {
        REQUIRE_MESSAGE(r.error.empty(), r.error);
      }
      const Plan plan = reduce_scatter_in_parts(devices, sizes, 3, *settings);
      // No chain reads a part that holds none of its segment's elements (so a chain starts as
      // its weights' gradients are done, not when the whole bucket is): a ring segment (at most
      // 326 elements here) spans at most 4 of the parts, twice when a hop reads the previous
      // member's parts in place beside its own.
      for (const ActorDesc& a : plan.actors) {
        if (settings == &ring && (a.op == "allreduce.add" || a.op == "allreduce.slice")) CHECK(a.inputs.size() <= 8u);
      }
      Runtime rt(plan, registry(n));
      for (const auto& a : rt.run().metrics.actors) CHECK(a.acts == 3u);
    }
  }
  // Only the ring's own kernels read parts: two_hop and an all-reduce are refused.
  Plan p;
  const RegisterIndex a = p.add_register({.name = "a", .shape = {4}}), b = p.add_register({.name = "b", .shape = {4}});
  const std::vector<AllReduceMember> members{{Placement{}, a, "@0", {a, b}}, {Placement{.rank = 1}, a, "@1", {a, b}}};
  CHECK_THROWS_AS(add_reduce_scatter(p, "x", members, {8}, DType::f32, {.algorithm = AllReduceAlgorithm::two_hop}),
                  std::invalid_argument);
  CHECK_THROWS_AS(add_allreduce(p, "y", members, {8}, DType::f32), std::invalid_argument);
}

TEST_CASE("Collectives.TwoHopAllReduceSumsToo" * doctest::timeout(60)) {
  const AllReduceSettings two_hop{.algorithm = AllReduceAlgorithm::two_hop};
  std::vector<Placement> ranks, devices;
  for (std::uint8_t j = 0; j < 3; ++j) {
    ranks.push_back({.rank = j});
    devices.push_back({.device = Device{DeviceType::cpu, j}});
  }
  for (const auto& r : test::run_on_loopback(insert_transfers(allreduce_plan(ranks, 65537, 3, two_hop)), registry(3))) {
    REQUIRE_MESSAGE(r.error.empty(), r.error);
  }
  Runtime rt(allreduce_plan(devices, 4099, 5, two_hop), registry(3));
  CHECK(rt.run().metrics.actors.size() == 5u * 3u);  // fill, split, sum, gather, check per member
}

TEST_CASE("Collectives.SegmentsAndActorsForASize") {
  // Default: 1 MiB segments, at most 16 per chunk; one segment below 1 MiB per chunk.
  CHECK(allreduce_segments(1, DType::f32, 4) == 1);
  CHECK(allreduce_segments(256 << 10, DType::f32, 2) == 1);      // 1 MiB: chunks of 512 KiB
  CHECK(allreduce_segments(1 << 20, DType::f32, 2) == 2);        // 4 MiB: chunks of 2 MiB
  CHECK(allreduce_segments(1 << 20, DType::f64, 2) == 4);        // 8 MiB
  CHECK(allreduce_segments(std::int64_t{16} << 20, DType::f32, 2) == 16);  // 64 MiB: capped
  CHECK(allreduce_segments(5, DType::f32, 2, {.segment_bytes = 4}) == 3);  // never more than elements
  CHECK_THROWS_AS(allreduce_segments(5, DType::f32, 2, {.segment_bytes = 0}), std::invalid_argument);
  // A member's input has members x segments readers, of the 255 a register may have.
  CHECK(allreduce_segments(std::int64_t{1} << 30, DType::f32, 4, {.max_segments = 1000}) == 60);
  CHECK(allreduce_segments(std::int64_t{1} << 30, DType::f32, 300, {.max_segments = 1000}) == 1);
  // Across ranks, per (chunk, segment): member c+2 reads the segment's window of member c+1's
  // input (no slice copied out of it) and n-1 hops follow, each one reducing transfer that
  // adds its member's segment as it reads the partial (fused); unfused, the window is pulled
  // into a register and each hop is an add (its partial's transfer comes with insert_transfers).
  // Per member a gather. Compressed, member c+1 slices the segment into the wire's dtype first,
  // and the hops are adds.
  for (std::int64_t n : {2, 4}) {
    CAPTURE(n);
    std::vector<Placement> places;
    for (std::int64_t j = 0; j < n; ++j) places.push_back({.rank = static_cast<std::uint16_t>(j)});
    const std::int64_t s = allreduce_segments(std::int64_t{1} << 20, DType::f32, n);
    for (const auto& [compressed, fused] : {std::pair{false, true}, {false, false}, {true, true}}) {
      CAPTURE(compressed);
      CAPTURE(fused);
      AllReduceSettings settings{.fuse_receive_add = fused};
      if (compressed) settings.wire = DType::bf16;
      const Plan p = allreduce_plan(places, std::int64_t{1} << 20, 1, settings);
      std::map<std::string, std::int64_t> ops;
      std::int64_t windows = 0;
      for (const auto& a : p.actors) {
        ++ops[a.op];
        if (a.window < 0) continue;
        ++windows;
        CHECK(reduces(a) == fused);
        const RegisterDesc& from = p.registers[a.inputs.at(0).reg];
        CHECK(from.consumers.size() == static_cast<std::size_t>(n * s));  // the member's input
        CHECK(a.where.rank != p.actors[from.producer].where.rank);
      }
      CHECK(ops["allreduce.slice"] == (compressed ? n * s : 0));
      CHECK(windows == (compressed ? 0 : n * s));
      CHECK(ops["allreduce.add"] == (fused && !compressed ? 0 : n * (n - 1) * s));
      CHECK(ops["transfer.add"] == (fused && !compressed ? n * (n - 1) * s : 0));
      // Each member's result gathers the sums where they land (a gathering transfer), unless
      // they travel compressed (the concat widens them).
      CHECK(ops["allreduce.concat"] == (compressed ? n : 0));
      std::int64_t gathers = 0;
      for (const auto& a : p.actors) {
        if (a.kind != ActorKind::transfer || a.inputs.size() < 2 || reduces(a)) continue;
        ++gathers;
        CHECK(a.inputs.size() == static_cast<std::size_t>(n * s));
        CHECK(p.registers[a.outputs.at(0)].name.find(".allreduced") != std::string::npos);
      }
      CHECK(gathers == (compressed ? 0 : n));
    }
  }
}

TEST_CASE("Collectives.ChunksCoverTheTensor") {
  CHECK(chunk_offsets(10, 3) == std::vector<std::int64_t>{0, 4, 7, 10});
  CHECK(chunk_offsets(1, 4) == std::vector<std::int64_t>{0, 1, 1, 1, 1});
  CHECK(chunk_offsets(0, 2) == std::vector<std::int64_t>{0, 0, 0});
}

namespace {

// Compressed all-reduce (AllReduceSettings::wire = bf16 or f16): member j's element i of piece p.
// `exact`: small integers (each below 16, so sums of 4 stay below 256: exact in bf16's 8 bits and
// f16's 11); else fractions with 24 significant bits, which bf16 and f16 must round.
float wire_value(bool exact, std::int64_t member, std::int64_t piece, std::int64_t i) {
  if (exact) return static_cast<float>((i * 7 + member * 3 + piece) % 16);
  return static_cast<float>(1.0 + 0.37 * static_cast<double>(member) + 1e-3 * static_cast<double>(i % 1013) +
                            1e-5 * static_cast<double>(piece));
}

/// Members' sources and checks for a compressed all-reduce: the check of member j keeps what it
/// got (`seen[j]`), and fails the job where a sum is off by more than the wire dtype allows.
struct WirePlan {
  Plan plan;
  KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
  std::shared_ptr<std::vector<std::vector<float>>> seen;
  WirePlan(const std::vector<Placement>& places, std::int64_t elements, std::int64_t pieces, bool exact, DType wire) {
    // Bits of significand each wire dtype keeps (the implicit one included): bf16 8, f16 11.
    const int precision = wire == DType::bf16 ? 8 : 11;
    const auto n = static_cast<std::int64_t>(places.size());
    seen = std::make_shared<std::vector<std::vector<float>>>(places.size());
    add_collective_kernels(kernels);
    kernels.add("test.wire_fill", DeviceType::cpu, DType::f32, [exact](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
      struct Fill final : Kernel {
        bool exact;
        std::int64_t member;
        Fill(bool e, std::int64_t m) : exact(e), member(m) {}
        void compute(KernelContext& ctx) override {
          auto out = ctx.outputs[0]->data<float>();
          for (std::size_t i = 0; i < out.size(); ++i)
            out[i] = wire_value(exact, member, ctx.piece, static_cast<std::int64_t>(i));
        }
      };
      return std::make_unique<Fill>(exact, cfg.attrs.get_int("member", -1));
    });
    kernels.add("test.wire_check", DeviceType::cpu, DType::f32,
                [exact, n, precision, seen = seen](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
                  struct Check final : Kernel {
                    bool exact;
                    int precision;
                    std::int64_t n, member;
                    std::shared_ptr<std::vector<std::vector<float>>> seen;
                    void compute(KernelContext& ctx) override {
                      auto in = ctx.inputs[0]->data<float>();
                      for (std::size_t i = 0; i < in.size(); ++i) {
                        double want = 0, magnitude = 0;
                        for (std::int64_t j = 0; j < n; ++j) {
                          const double v = wire_value(exact, j, ctx.piece, static_cast<std::int64_t>(i));
                          want += v;
                          magnitude += std::abs(v);
                        }
                        // Exact sums must come back exactly. Else each of the chain's n roundings
                        // to p bits (to nearest: relative error <= 2^-p; bf16 p = 8, f16 11) errs
                        // by at most 2^-p of a partial, and no partial exceeds the sum of
                        // magnitudes (f16's subnormals are far below these values): n x 2^-p x
                        // that, doubled for margin.
                        const double bound =
                            exact ? 0.0 : static_cast<double>(n) * std::ldexp(magnitude, 1 - precision);
                        if (std::abs(static_cast<double>(in[i]) - want) > bound) {
                          throw std::runtime_error(fmt::format("member {}: piece {} element {} is {}, the sum is {}",
                                                               member, ctx.piece, i, in[i], want));
                        }
                      }
                      auto& keep = (*seen)[static_cast<std::size_t>(member)];
                      keep.insert(keep.end(), in.begin(), in.end());
                    }
                  };
                  auto k = std::make_unique<Check>();
                  k->exact = exact;
                  k->precision = precision;
                  k->n = n;
                  k->member = cfg.attrs.get_int("member", -1);
                  k->seen = seen;
                  return k;
                });
    std::vector<AllReduceMember> members;
    for (std::size_t j = 0; j < places.size(); ++j) {
      const std::string suffix = fmt::format("@m{}", j);
      auto r = plan.add_register({.name = "grad" + suffix, .shape = {elements}, .dtype = DType::f32});
      plan.add_actor({.name = "fill" + suffix, .kind = ActorKind::source, .op = "test.wire_fill", .where = places[j],
                      .outputs = {r}, .pieces = pieces, .attrs = {{"member", static_cast<std::int64_t>(j)}}});
      members.push_back({places[j], r, suffix});
    }
    AllReduceSettings settings{.segment_bytes = 4096};
    settings.wire = wire;
    auto results = add_allreduce(plan, "ar", members, {elements}, DType::f32, 2, settings);
    for (std::size_t j = 0; j < places.size(); ++j) {
      plan.add_actor({.name = fmt::format("check@m{}", j), .op = "test.wire_check", .where = places[j],
                      .inputs = {{results[j]}}, .attrs = {{"member", static_cast<std::int64_t>(j)}}});
    }
  }
};

}  // namespace

TEST_CASE("Collectives.CompressedAllReduceSends16BitsAndEveryMemberGetsTheSameBits" * doctest::timeout(120)) {
  const std::int64_t elements = 10'007, pieces = 3;
  for (auto [exact, wire] : {std::pair{true, DType::bf16}, std::pair{false, DType::bf16}, std::pair{true, DType::f16},
                             std::pair{false, DType::f16}}) {
    CAPTURE(exact);
    CAPTURE(name(wire));
    SUBCASE("ranks") {
      for (std::int64_t n : {2, 3}) {
        CAPTURE(n);
        std::vector<Placement> places;
        for (std::int64_t j = 0; j < n; ++j) places.push_back({.rank = static_cast<std::uint16_t>(j)});
        WirePlan w(places, elements, pieces, exact, wire);
        const Plan plan = insert_transfers(w.plan);
        // What crosses ranks is the 16-bit partials and sums: half the bytes of the f32 gradient.
        std::size_t transfers = 0;
        for (const ActorDesc& a : plan.actors) {
          if (a.kind != ActorKind::transfer) continue;
          ++transfers;
          CHECK(plan.registers[a.outputs[0]].dtype == wire);
        }
        CHECK(transfers > 0);
        for (const auto& r : test::run_on_loopback(plan, w.kernels)) REQUIRE_MESSAGE(r.error.empty(), r.error);
        for (std::int64_t j = 0; j < n; ++j) {
          REQUIRE((*w.seen)[static_cast<std::size_t>(j)].size() == static_cast<std::size_t>(elements * pieces));
          CHECK((*w.seen)[static_cast<std::size_t>(j)] == (*w.seen)[0]);  // the same bits everywhere
        }
      }
    }
    SUBCASE("devices") {
      std::vector<Placement> places;
      for (std::uint8_t j = 0; j < 4; ++j) places.push_back({.device = Device{DeviceType::cpu, j}});
      WirePlan w(places, elements, pieces, exact, wire);
      Runtime(w.plan, w.kernels).run();
      for (std::size_t j = 0; j < 4; ++j) CHECK((*w.seen)[j] == (*w.seen)[0]);
    }
  }
}

TEST_CASE("Collectives.CompressionIsRefusedWhereItHasNoKernels") {
  Plan p;
  std::vector<AllReduceMember> members;
  for (std::uint8_t j = 0; j < 2; ++j) {
    auto r = p.add_register({.name = fmt::format("g{}", j), .shape = {8}, .dtype = DType::f64});
    members.push_back({Placement{.device = Device{DeviceType::cpu, j}}, r, fmt::format("@m{}", j)});
  }
  AllReduceSettings s;
  s.wire = DType::bf16;
  CHECK_THROWS_WITH_AS(add_allreduce(p, "ar", members, {8}, DType::f64, 2, s),
                       doctest::Contains("only bf16 or f16 for f32, by the ring"), std::invalid_argument);
  s.algorithm = AllReduceAlgorithm::two_hop;
  CHECK_THROWS_WITH_AS(add_allreduce(p, "ar", members, {8}, DType::f32, 2, s), doctest::Contains("by two_hop"),
                       std::invalid_argument);
}

// f16 ends at 65504. A chain's partial that rounds beyond it (two members' 40000s: on devices of
// one rank, where the chain's first partial is read in place in f32) or a member's own value
// beyond it (70000 across ranks: the first partial, rounded as it is sliced out to be sent)
// fails the act that rounds it, naming the actor and the sum, instead of sending infinities on
// to every replica.
TEST_CASE("Collectives.Fp16OnTheWireFailsNamingTheActorWhoseSumLeavesItsRange" * doctest::timeout(60)) {
  for (bool ranks : {false, true}) {
    CAPTURE(ranks);
    const float value = ranks ? 70000.0f : 40000.0f;
    KernelRegistry kernels = KernelRegistry::with_builtin_kernels();
    add_collective_kernels(kernels);
    kernels.add_fn("test.const_fill", DeviceType::cpu, DType::f32, [value](KernelContext& ctx) {
      auto out = ctx.outputs[0]->data<float>();
      std::fill(out.begin(), out.end(), 0.5f);
      out[3] = value;
    });
    Plan plan;
    std::vector<AllReduceMember> members;
    for (std::uint8_t j = 0; j < 2; ++j) {
      const std::string suffix = fmt::format("@m{}", j);
      auto r = plan.add_register({.name = "grad" + suffix, .shape = {64}, .dtype = DType::f32});
      const Placement at = ranks ? Placement{.rank = j} : Placement{.device = Device{DeviceType::cpu, j}};
      plan.add_actor({.name = "fill" + suffix, .kind = ActorKind::source, .op = "test.const_fill", .where = at,
                      .outputs = {r}, .pieces = 2});
      members.push_back({at, r, suffix});
    }
    AllReduceSettings settings;
    settings.wire = DType::f16;
    settings.direct_below_bytes = 0;
    for (RegisterIndex r : add_allreduce(plan, "ar", members, {64}, DType::f32, 1, settings)) {
      plan.add_actor({.name = fmt::format("sink{}", r), .op = "noop", .dtype = DType::f32,
                      .where = plan.actors[plan.registers[r].producer].where, .inputs = {{r}}});
    }
    std::string error;
    if (ranks) {
      for (const auto& r : test::run_on_loopback(insert_transfers(plan), kernels)) {
        if (r.error.find("beyond fp16") != std::string::npos) error = r.error;
      }
    } else {
      try {
        Runtime(plan, kernels).run();
      } catch (const JobError& e) {
        error = e.what();
      }
    }
    MESSAGE(error);
    CHECK(error.find("beyond fp16's range (65504)") != std::string::npos);
    CHECK(error.find("element 3") != std::string::npos);
    CHECK(error.find(ranks ? "sums to 70000" : "sums to 80000") != std::string::npos);
    CHECK(error.find(ranks ? "actor 'ar.slice" : "actor 'ar.add") != std::string::npos);
  }
}

// The overlap of gradient all-reduces with the backward pass (activity.h), on hand-made
// records: spans per (all-reduce, piece), their union, and what of it backward acts cover.
TEST_CASE("Collectives.OverlapWithTheBackwardPassIsMeasuredFromTheActivityLog") {
  Plan p;
  auto g = p.add_register({.name = "g", .shape = {4}});
  auto s = p.add_register({.name = "s", .shape = {4}});
  auto l = p.add_register({.name = "l", .shape = {}});
  const ActorIndex bwd = p.add_actor({.name = "bwd", .kind = ActorKind::source, .op = "fill_piece", .outputs = {g},
                                      .pieces = 2, .role = ActorRole::backward});
  const ActorIndex add = p.add_actor({.name = "grad.add", .op = "copy", .inputs = {{g}}, .outputs = {s},
                                      .attrs = {{"allreduce", std::string("grad")}}, .role = ActorRole::collective});
  auto s2 = p.add_register({.name = "s2", .shape = {4}});
  const ActorIndex add2 = p.add_actor({.name = "grad2.add", .op = "copy", .inputs = {{g}}, .outputs = {s2},
                                       .attrs = {{"allreduce", std::string("grad2")}}, .role = ActorRole::collective});
  const ActorIndex loss = p.add_actor({.name = "loss.add", .kind = ActorKind::source, .op = "fill_piece",
                                       .outputs = {l}, .pieces = 2, .attrs = {{"allreduce", std::string("loss")}},
                                       .role = ActorRole::collective});
  // Piece 0: the all-reduce runs over [100, 300) (two acts), backward over [0, 200): 100 of 200
  // overlap. Piece 1: [400, 500), backward [450, 460): 10 of 100. The loss's all-reduce counts not.
  // A second bucket, grad2, piece 0 over [150, 250): inside grad's span (the union is the same),
  // 50 of its 100 beside the backward pass.
  const std::vector<ActRecord> acts{
      {bwd, 0, 0, 200, 0},  {add, 0, 100, 150, 1}, {add, 0, 250, 300, 1}, {bwd, 1, 450, 460, 0},
      {add, 1, 400, 500, 1}, {loss, 0, 0, 1000, 1}, {add2, 0, 150, 250, 1},
  };
  const CollectiveOverlap o = collective_overlap(p, acts);
  CHECK(o.spans == 3);
  CHECK(o.collective_s == doctest::Approx(300e-9));
  CHECK(o.overlapped_s == doctest::Approx(110e-9));
  CHECK(o.fraction() == doctest::Approx(110.0 / 300.0));
  REQUIRE(o.by_allreduce.size() == 2);
  CHECK(o.by_allreduce[0].name == "grad");
  CHECK(o.by_allreduce[0].collective_s == doctest::Approx(300e-9));
  CHECK(o.by_allreduce[0].fraction() == doctest::Approx(110.0 / 300.0));
  CHECK(o.by_allreduce[1].name == "grad2");
  CHECK(o.by_allreduce[1].collective_s == doctest::Approx(100e-9));
  CHECK(o.by_allreduce[1].fraction() == doctest::Approx(0.5));
  CHECK(collective_overlap(p, {}).fraction() == 0.0);
}

// The direct all-reduce (every member sums every input, in member order): exact sums, the same
// bits on every member, over ranks and in-process devices; and the ring hands small tensors to
// it below AllReduceSettings::direct_below_bytes.
TEST_CASE("Collectives.DirectAllReduceSumsOnEveryMember" * doctest::timeout(120)) {
  const AllReduceSettings direct{.algorithm = AllReduceAlgorithm::direct};
  auto count = [](const Plan& p, std::string_view op) {
    return std::count_if(p.actors.begin(), p.actors.end(), [&](const ActorDesc& a) { return a.op == op; });
  };
  for (std::int64_t n : {2, 3, 4}) {
    for (std::int64_t elements : {std::int64_t{1}, std::int64_t{1000}, std::int64_t{65537}}) {
      CAPTURE(n);
      CAPTURE(elements);
      std::vector<Placement> places;
      for (std::int64_t j = 0; j < n; ++j) places.push_back({.rank = static_cast<std::uint16_t>(j)});
      const Plan plan = insert_transfers(allreduce_plan(places, elements, 4, direct));
      // Two members: each sum is a reducing transfer reading the other's input; more: a sum
      // actor per member reading transfers' copies.
      CHECK(count(plan, "transfer.add") == (n == 2 ? 2 : 0));
      CHECK(count(plan, "allreduce.sum") == (n == 2 ? 0 : n));
      for (const auto& r : test::run_on_loopback(plan, registry(n))) REQUIRE_MESSAGE(r.error.empty(), r.error);
    }
  }
  // Two members, fused and not, the other's input read in its slot, inline, or pulled (the
  // reducing transfer then adds once it has landed): every piece crosses the way asked for and
  // every sum is exact.
  for (const bool fused : {true, false}) {
    for (const bool in_place : {true, false}) {
      for (const std::size_t inline_bytes : {std::size_t{0}, std::size_t{16} << 10}) {
        if (in_place && inline_bytes > 0) continue;
        CAPTURE(fused);
        CAPTURE(in_place);
        CAPTURE(inline_bytes);
        AllReduceSettings settings = direct;
        settings.fuse_receive_add = fused;
        RuntimeSettings rs;
        rs.shared_registers = in_place;
        rs.inline_payload_bytes = inline_bytes;
        const Plan plan = insert_transfers(allreduce_plan({{.rank = 0}, {.rank = 1}}, 1000, 9, settings));
        CHECK(count(plan, "transfer.add") == (fused ? 2 : 0));
        std::uint64_t read_in_place = 0, inline_payload = 0, pulled = 0;
        for (const auto& r : test::run_on_loopback(plan, registry(2), rs)) {
          REQUIRE_MESSAGE(r.error.empty(), r.error);
          for (const auto& a : r.report->metrics.actors) CHECK(a.acts == 9u);
          read_in_place += r.report->pieces_read_in_place;
          inline_payload += r.report->pieces_inline;
          pulled += r.report->pieces_pulled;
        }
        CHECK(read_in_place == (in_place ? 18u : 0u));  // each member's 9 inputs, read by the other
        CHECK(inline_payload == (inline_bytes > 0 ? 18u : 0u));
        CHECK(pulled == (!in_place && inline_bytes == 0 ? 18u : 0u));
      }
    }
  }
  std::vector<Placement> devices;
  for (std::uint8_t j = 0; j < 3; ++j) devices.push_back({.device = Device{DeviceType::cpu, j}});
  Runtime rt(allreduce_plan(devices, 4099, 10, direct), registry(3));
  CHECK(rt.run().metrics.actors.size() == 9u);  // fill, sum and check per member
  // The ring's choice by size: 4 KiB below 8 KiB goes direct (one sum per member), above it not.
  const AllReduceSettings by_size{.direct_below_bytes = 8 << 10};
  const Plan small = allreduce_plan(devices, 1024, 1, by_size), large = allreduce_plan(devices, 4096, 1, by_size);
  CHECK(count(small, "allreduce.sum") == 3);
  CHECK(count(large, "allreduce.sum") == 0);
}

// Hierarchical all-reduce (AllReduceSettings::rank_hosts): within each host, across hosts per
// local index, within again. Exact sums on every member, the layouts a job takes (two or three
// hosts of two or three ranks; in-process devices on two hosts' ranks), sizes on both sides of
// the direct form's threshold, odd sizes, many segments with one slot a hop; and fewer elements
// cross hosts than by the flat ring, exactly the 2(H-1)/H of n/L per member it is built for.
namespace {

/// The elements that cross hosts in `plan` (before insert_transfers): each register once for
/// every rank on another host that reads it (insert_transfers moves it there once).
std::int64_t elements_across_hosts(const Plan& plan, const std::vector<std::uint32_t>& hosts) {
  std::map<RegisterIndex, std::uint16_t> producer;
  for (const ActorDesc& a : plan.actors) {
    for (RegisterIndex r : a.outputs) producer[r] = a.where.rank;
  }
  std::set<std::pair<RegisterIndex, std::uint16_t>> moved;
  std::int64_t n = 0;
  for (const ActorDesc& a : plan.actors) {
    for (const InputPort& in : a.inputs) {
      if (hosts.at(producer.at(in.reg)) == hosts.at(a.where.rank)) continue;
      if (a.window >= 0) {
        n += numel(plan.registers.at(a.outputs.at(0)).shape);  // a window of the register crosses
      } else {
        moved.insert({in.reg, a.where.rank});  // the whole register, once per rank
      }
    }
  }
  for (const auto& [r, rank] : moved) n += numel(plan.registers.at(r).shape);
  return n;
}

struct HostLayout {
  std::vector<Placement> places;
  std::vector<std::uint32_t> rank_hosts;
  std::int64_t hosts, per_host;
};

/// `hosts` hosts of `per_host` ranks (rank r on host r / per_host), one member on each rank.
HostLayout ranks_on_hosts(std::int64_t hosts, std::int64_t per_host) {
  HostLayout l{.places = {}, .rank_hosts = {}, .hosts = hosts, .per_host = per_host};
  for (std::int64_t r = 0; r < hosts * per_host; ++r) {
    l.places.push_back({.rank = static_cast<std::uint16_t>(r)});
    l.rank_hosts.push_back(static_cast<std::uint32_t>(r / per_host));
  }
  return l;
}

}  // namespace

TEST_CASE("Collectives.HierarchicalAllReduceSumsOnEveryMemberAndCrossesHostsLess" * doctest::timeout(240)) {
  HostLayout devices{.places = {}, .rank_hosts = {0, 1}, .hosts = 2, .per_host = 2};  // 2 ranks x 2 devices
  for (std::uint16_t r = 0; r < 2; ++r) {
    for (std::uint8_t d = 0; d < 2; ++d) devices.places.push_back({.rank = r, .device = Device{DeviceType::cpu, d}});
  }
  for (const HostLayout& l : {ranks_on_hosts(2, 2), ranks_on_hosts(3, 2), ranks_on_hosts(2, 3), devices}) {
    const auto n = static_cast<std::int64_t>(l.places.size());
    CAPTURE(l.hosts);
    CAPTURE(l.per_host);
    for (std::int64_t elements : {std::int64_t{7}, std::int64_t{2048}, std::int64_t{2049}, std::int64_t{65537},
                                  std::int64_t{3} << 18}) {
      CAPTURE(elements);
      const AllReduceSettings hier{.direct_below_bytes = gradient_direct_below_bytes, .rank_hosts = l.rank_hosts};
      std::vector<AllReduceMember> members;
      for (const Placement& p : l.places) members.push_back({p, 0, "@m"});
      // From 8 KiB (2048 f32) the ring, so the hierarchy; below, one direct hop.
      CHECK(hosts_of_members(members, {elements}, DType::f32, hier).size() ==
            (elements >= 2048 ? static_cast<std::size_t>(l.hosts) : 0u));
      const std::int64_t pieces = elements > 100'000 ? 2 : 4;
      const Plan plan = allreduce_plan(l.places, elements, pieces, hier);
      for (const auto& r : test::run_on_loopback(insert_transfers(plan), registry(n))) {
        REQUIRE_MESSAGE(r.error.empty(), r.error);
        for (const auto& a : r.report->metrics.actors) CHECK(a.acts == static_cast<std::uint64_t>(pieces));
      }
      if (elements == (std::int64_t{3} << 18)) {  // divides evenly by every layout's hosts x ranks
        const std::int64_t across = elements_across_hosts(plan, l.rank_hosts);
        CHECK(across == n * 2 * (l.hosts - 1) * elements / (l.hosts * l.per_host));
        const Plan flat = allreduce_plan(l.places, elements, pieces, {.direct_below_bytes = gradient_direct_below_bytes});
        CHECK(across < elements_across_hosts(flat, l.rank_hosts));
      }
    }
  }
  SUBCASE("many segments, one slot a hop") {
    const HostLayout l = ranks_on_hosts(2, 2);
    const AllReduceSettings fine{.segment_bytes = 4096, .max_segments = 12, .slots = 1, .rank_hosts = l.rank_hosts};
    for (const auto& r : test::run_on_loopback(insert_transfers(allreduce_plan(l.places, 65537, 7, fine)), registry(4))) {
      REQUIRE_MESSAGE(r.error.empty(), r.error);
    }
  }
}

// A bucket's gradients in parts (AllReduceMember::parts) go through the hierarchy too: each
// member's host sums, checked part by part at their offsets in the tensor.
TEST_CASE("Collectives.HostSumsReadInputsInPartsAndCoverTheTensor" * doctest::timeout(120)) {
  const std::vector<std::int64_t> sizes{5, 3000, 1, 17, 4099, 700};  // 7822 elements
  const HostLayout l = ranks_on_hosts(2, 2);
  const AllReduceSettings settings{.segment_bytes = 2048, .max_segments = 6, .slots = 1, .rank_hosts = l.rank_hosts};
  Plan p;
  const std::vector<AllReduceMember> members = members_in_parts(p, l.places, sizes, 3);
  const auto sums = add_host_sums(p, "hs", members, {7822}, DType::f32, settings);
  REQUIRE(sums.size() == members.size());
  std::map<RegisterIndex, std::uint16_t> producer;
  for (const ActorDesc& a : p.actors) {
    for (RegisterIndex r : a.outputs) producer[r] = a.where.rank;
  }
  for (std::size_t m = 0; m < sums.size(); ++m) {
    std::int64_t at = 0;
    for (RegisterIndex part : sums[m]) {
      CHECK(l.rank_hosts.at(producer.at(part)) == l.rank_hosts[l.places[m].rank]);  // made on the member's host
      p.add_actor({.name = fmt::format("check{}.{}", m, part), .op = "test.check", .where = l.places[m],
                   .inputs = {{part}}, .attrs = {{"at", at}}});
      at += numel(p.registers[part].shape);
    }
    CHECK(at == 7822);
    CHECK(sums[m] == sums[m ^ 1]);  // the two members of a host read the same registers
    CHECK(sums[m] != sums[m ^ 2]);  // each host its own
  }
  for (const auto& r : test::run_on_loopback(insert_transfers(p), registry(4))) REQUIRE_MESSAGE(r.error.empty(), r.error);
}

TEST_CASE("Collectives.HierarchyOnlyWhereEveryHostHasTheSameMembers") {
  auto members_on = [](std::vector<std::uint16_t> ranks) {
    std::vector<AllReduceMember> m;
    for (std::uint16_t r : ranks) m.push_back({Placement{.rank = r}, 0, fmt::format("@r{}", r)});
    return m;
  };
  const Shape big{1 << 20};
  const AllReduceSettings two_by_two{.rank_hosts = {0, 0, 1, 1}};
  CHECK(hosts_of_members(members_on({0, 1, 2, 3}), big, DType::f32, two_by_two) ==
        std::vector<std::vector<std::size_t>>{{0, 1}, {2, 3}});
  // Members in any order: grouped by host in the order their hosts first appear.
  CHECK(hosts_of_members(members_on({2, 0, 3, 1}), big, DType::f32, two_by_two) ==
        std::vector<std::vector<std::size_t>>{{0, 2}, {1, 3}});
  CHECK(hosts_of_members(members_on({0, 1, 2, 3}), big, DType::f32, {}).empty());  // hosts not known
  CHECK(hosts_of_members(members_on({0, 1, 2, 3}), big, DType::f32, {.rank_hosts = {0, 0, 0, 0}}).empty());
  CHECK(hosts_of_members(members_on({0, 1, 2, 3}), big, DType::f32, {.rank_hosts = {0, 0, 0, 1}}).empty());  // uneven
  CHECK(hosts_of_members(members_on({0, 2}), big, DType::f32, two_by_two).empty());  // one member a host: the ring is it
  CHECK(hosts_of_members(members_on({0, 1, 2, 3}), big, DType::f32,
                         {.algorithm = AllReduceAlgorithm::two_hop, .rank_hosts = {0, 0, 1, 1}})
            .empty());
  CHECK(hosts_of_members(members_on({0, 1, 2, 3}), big, DType::f32, {.wire = DType::bf16, .rank_hosts = {0, 0, 1, 1}})
            .empty());  // compressed: the flat ring
  CHECK(hosts_of_members(members_on({0, 1, 2, 3}), {100}, DType::f32,
                         {.direct_below_bytes = gradient_direct_below_bytes, .rank_hosts = {0, 0, 1, 1}})
            .empty());  // direct: one hop
  CHECK_THROWS_WITH_AS(hosts_of_members(members_on({0, 1, 2, 4}), big, DType::f32, two_by_two),
                       doctest::Contains("rank 4, but rank_hosts names the hosts of 4 ranks"), std::invalid_argument);
  Plan p;
  CHECK_THROWS_AS(add_host_sums(p, "x", members_on({0, 1, 2, 3}), big, DType::f32, {}), std::invalid_argument);
}
