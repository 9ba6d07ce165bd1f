// actors/: the plan as a value (building, printing, hashing) and validate(), which refuses a
// broken plan before anything runs, naming what is wrong.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "test_util.h"
#include "baton/actors.h"
#include "baton/kernels.h"

namespace {

using baton::test::contains;
using baton::test::count;

using baton::ActorDesc;
using baton::ActorKind;
using baton::InputPort;
using baton::KernelRegistry;
using baton::Plan;
using baton::PlanError;
using baton::RegisterDesc;
using baton::RegisterIndex;

const KernelRegistry& builtin() {
  static const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  return reg;
}

// What validate() says about `plan`: the PlanError's message, or "" if it accepts the plan.
std::string refusal(const Plan& plan, std::uint16_t rank = 0) {
  try {
    baton::validate(plan, builtin(), rank);
  } catch (const PlanError& e) {
    return e.what();
  }
  return {};
}

// src (fill_piece) -> "src.out" -> mid (copy) -> "mid.out" -> sink (noop).
Plan chain(std::int64_t pieces = 100, std::int32_t slots = 2) {
  Plan plan;
  auto a = plan.add_register({.name = "src.out", .shape = {16}, .dtype = baton::f32, .slots = slots});
  auto b = plan.add_register({.name = "mid.out", .shape = {16}, .dtype = baton::f32, .slots = slots});
  plan.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {a}, .pieces = pieces});
  plan.add_actor({.name = "mid", .op = "copy", .inputs = {{a}}, .outputs = {b}});
  plan.add_actor({.name = "sink", .op = "noop", .inputs = {{b}}});
  return plan;
}

// The two-actor cycle A -> "a.out" -> B -> "b.out" -> A, A reading "b.out" with `delay`.
Plan two_actor_cycle(std::int32_t delay, std::int32_t slots = 1) {
  Plan plan;
  auto ra = plan.add_register({.name = "a.out", .shape = {4}, .slots = slots});
  auto rb = plan.add_register({.name = "b.out", .shape = {4}, .slots = slots});
  plan.add_actor({.name = "A", .op = "noop", .inputs = {{rb, delay}}, .outputs = {ra}});
  plan.add_actor({.name = "B", .op = "noop", .inputs = {{ra}}, .outputs = {rb}});
  return plan;
}

// S -> "s.out" -> C -> "c.out"; A reads "s.out" and "c.out" (the latter `delay` pieces late).
Plan fork_join(std::int32_t delay, std::int32_t s_slots, std::int32_t c_slots) {
  Plan plan;
  auto rs = plan.add_register({.name = "s.out", .shape = {4}, .slots = s_slots});
  auto rc = plan.add_register({.name = "c.out", .shape = {4}, .slots = c_slots});
  plan.add_actor({.name = "S", .kind = ActorKind::source, .op = "fill_piece", .outputs = {rs}, .pieces = 10});
  plan.add_actor({.name = "C", .op = "copy", .inputs = {{rs}}, .outputs = {rc}});
  plan.add_actor({.name = "A", .op = "noop", .inputs = {{rs}, {rc, delay}}});
  return plan;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Plan: building

TEST_CASE("Plan.AddActorFillsProducerAndConsumers") {
  Plan plan;
  auto r0 = plan.add_register({.name = "r0", .shape = {2}});
  auto r1 = plan.add_register({.name = "r1", .shape = {2}});
  CHECK(r0 == 0);
  CHECK(r1 == 1);
  CHECK(plan.registers[r0].producer == baton::no_actor);
  CHECK(plan.registers[r0].consumers.empty());

  auto s = plan.add_actor({.name = "s", .kind = ActorKind::source, .op = "fill_piece", .outputs = {r0}});
  auto x = plan.add_actor({.name = "x", .op = "copy", .inputs = {{r0}}, .outputs = {r1}});
  // Reads r0 twice (same delay) and r1 once: listed once per register.
  auto y = plan.add_actor({.name = "y", .op = "add", .inputs = {{r0}, {r0}, {r1}}});
  CHECK(s == 0);
  CHECK(x == 1);
  CHECK(y == 2);
  CHECK(plan.registers[r0].producer == s);
  CHECK(plan.registers[r0].consumers == std::vector<baton::ActorIndex>{x, y});
  CHECK(plan.registers[r1].producer == x);
  CHECK(plan.registers[r1].consumers == std::vector<baton::ActorIndex>{y});
  CHECK(plan.actors.size() == 3);
  CHECK(plan.actors_on(0) == std::vector<baton::ActorIndex>{0, 1, 2});
  CHECK(plan.actors_on(1).empty());
  CHECK(refusal(plan).empty());
}

TEST_CASE("Plan.AddActorWithRegisterOutOfRangeThrows") {
  Plan plan;
  auto r0 = plan.add_register({.name = "r0", .shape = {2}});
  plan.add_actor({.name = "s", .kind = ActorKind::source, .op = "fill_piece", .outputs = {r0}});
  const Plan before = plan;

  CHECK_THROWS_AS(plan.add_actor({.name = "bad_in", .op = "noop", .inputs = {{r0}, {5}}}), std::invalid_argument);
  CHECK_THROWS_AS(plan.add_actor({.name = "bad_out", .op = "copy", .inputs = {{r0}}, .outputs = {1}}),
                  std::invalid_argument);
  try {
    plan.add_actor({.name = "bad_in", .op = "noop", .inputs = {{7}}});
    FAIL("expected std::invalid_argument");
  } catch (const std::invalid_argument& e) {
    CHECK(contains(e.what(), "'bad_in'"));
    CHECK(contains(e.what(), "#7"));
  }
  // A refused actor leaves no trace in the plan.
  CHECK(plan == before);
}

// ---------------------------------------------------------------------------------------------
// Plan: printing and hashing

TEST_CASE("Plan.ToTextIsDeterministic") {
  Plan a = chain();
  Plan b = chain();
  CHECK(a.to_text() == b.to_text());
  CHECK(a.to_text() == a.to_text());
  const std::string text = a.to_text();
  // One line per register and per actor.
  CHECK(count(text, "\n") == 5);
  CHECK(contains(text, "register 0 src.out f32[16] slots=2 producer=0 consumers=[1]"));
  CHECK(contains(text, "actor 0 src source op=fill_piece f32 at r0/cpu:0/s0 in=[] out=[0] pieces=100"));
  CHECK(contains(text, "actor 2 sink compute op=noop"));

  // Attributes print sorted, whatever order they were set in.
  a.actors[1].attrs.set("zeta", std::int64_t{1}).set("alpha", std::int64_t{2});
  b.actors[1].attrs.set("alpha", std::int64_t{2}).set("zeta", std::int64_t{1});
  CHECK(a.to_text() == b.to_text());
  CHECK(contains(a.to_text(), "{alpha=2, zeta=1}"));
}

TEST_CASE("Plan.HashIsEqualForEqualPlansAndChangesWithSlots") {
  Plan a = chain();
  Plan b = chain();
  CHECK(a == b);
  CHECK(a.hash() == b.hash());

  Plan more_slots = chain();
  more_slots.registers[1].slots = 3;
  CHECK_FALSE(more_slots == a);
  CHECK(more_slots.hash() != a.hash());

  Plan more_pieces = chain(101);
  CHECK(more_pieces.hash() != a.hash());

  Plan delayed = chain();
  delayed.actors[2].inputs[0].delay = 1;
  CHECK(delayed.hash() != a.hash());

  Plan moved = chain();
  moved.actors[1].where.device = baton::Device{baton::DeviceType::cpu, 1};
  CHECK(moved.hash() != a.hash());

  Plan attrs = chain();
  attrs.actors[0].attrs.set("offset", std::int64_t{3});
  CHECK(attrs.hash() != a.hash());
}

// Regression: an integer 1 and a double 1.0 once printed alike, so plans that differ only in an
// attribute's type had one text and one hash, and a rank whose plan said {ns=1.0} would pass a
// hash comparison against one that said {ns=1}.
TEST_CASE("Plan.HashDiffersWhenAnAttributeChangesType") {
  Plan as_int = chain();
  Plan as_double = chain();
  as_int.actors[1].attrs.set("scale", std::int64_t{1});
  as_double.actors[1].attrs.set("scale", 1.0);
  REQUIRE_FALSE(as_int == as_double);
  CHECK(as_int.to_text() != as_double.to_text());
  CHECK(as_int.hash() != as_double.hash());
}

TEST_CASE("Plan.ToDotHasANodePerActorAndAnEdgePerReader") {
  Plan plan;
  auto r0 = plan.add_register({.name = "r0", .shape = {2}});
  auto r1 = plan.add_register({.name = "r1", .shape = {2}, .slots = 3});
  plan.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {r0}});
  plan.add_actor({.name = "left", .op = "copy", .inputs = {{r0}}, .outputs = {r1}});
  plan.add_actor({.name = "right", .op = "noop", .inputs = {{r0}, {r1, 2}}});
  plan.actors[2].where.device = baton::Device{baton::DeviceType::cpu, 1};

  const std::string dot = plan.to_dot();
  CHECK(dot.rfind("digraph", 0) == 0);
  CHECK(dot.back() == '\n');
  // Nodes: a0, a1, a2, each once, labelled with its name.
  for (const char* node : {"a0 [label=\"src", "a1 [label=\"left", "a2 [label=\"right"}) {
    CAPTURE(node);
    CHECK(count(dot, node) == 1);
  }
  CHECK(count(dot, "[label=\"") == 3 + 3);  // three nodes, three edges
  // Edges: r0 to left and to right, r1 to right.
  CHECK(count(dot, " -> ") == 3);
  CHECK(count(dot, "a0 -> a1") == 1);
  CHECK(count(dot, "a0 -> a2") == 1);
  CHECK(count(dot, "a1 -> a2") == 1);
  // The delayed edge shows its delay; the slot count shows too.
  CHECK(contains(dot, "r1 f32[2] x3 @-2"));
  CHECK(count(dot, "@-") == 1);
  // Two placements, two clusters.
  CHECK(count(dot, "subgraph cluster_") == 2);
  CHECK(dot == plan.to_dot());
}

// ---------------------------------------------------------------------------------------------
// validate(): static checks

TEST_CASE("Validate.AcceptsAGoodChain") {
  CHECK(refusal(chain()).empty());
  CHECK(refusal(chain(0, 1)).empty());
  CHECK_NOTHROW(baton::validate(chain(5, 1), builtin()));
}

TEST_CASE("Validate.RefusesARegisterWithZeroSlots") {
  Plan plan = chain();
  plan.registers[1].slots = 0;
  CHECK_THROWS_AS(baton::validate(plan, builtin()), PlanError);
  // A PlanError is a std::invalid_argument.
  CHECK_THROWS_AS(baton::validate(plan, builtin()), std::invalid_argument);
  CHECK(contains(refusal(plan), "register 'mid.out' has 0 slots"));
}

TEST_CASE("Validate.RefusesReadingARegisterNoActorProduces") {
  Plan plan = chain();
  auto orphan = plan.add_register({.name = "orphan", .shape = {16}});
  plan.add_actor({.name = "reader", .op = "noop", .inputs = {{orphan}}});
  const std::string msg = refusal(plan);
  CHECK(contains(msg, "'reader'"));
  CHECK(contains(msg, "'orphan'"));
  CHECK(contains(msg, "no actor produces"));
}

TEST_CASE("Validate.RefusesAnUnknownKernel") {
  SUBCASE("unknown op") {
    Plan plan = chain();
    plan.actors[1].op = "no_such_op";
    const std::string msg = refusal(plan);
    CHECK(contains(msg, "'mid'"));
    CHECK(contains(msg, "'no_such_op'"));
    CHECK(contains(msg, "cpu/f32"));
  }
  SUBCASE("op without that dtype") {
    Plan plan = chain();
    plan.actors[1].op = "add";
    plan.actors[1].dtype = baton::u8;
    const std::string msg = refusal(plan);
    CHECK(contains(msg, "'add'"));
    CHECK(contains(msg, "cpu/u8"));
  }
  SUBCASE("op on a device it has no kernel for") {
    Plan plan = chain();
    plan.actors[2].where.device = baton::Device{baton::DeviceType::cuda, 0};
    plan.actors[2].op = "sleep_ns";  // host-only, with or without the CUDA path
    const std::string msg = refusal(plan);
    CHECK(contains(msg, "'sink'"));
    CHECK(contains(msg, "'sleep_ns'"));
    CHECK(contains(msg, "cuda/f32"));
  }
}

TEST_CASE("Validate.RefusesASourceWithInputs") {
  Plan plan = chain();
  plan.actors[0].inputs.push_back({1});
  plan.registers[1].consumers.push_back(0);
  const std::string msg = refusal(plan);
  CHECK(contains(msg, "source 'src' has inputs"));
}

TEST_CASE("Validate.RefusesAComputeActorWithNoInputs") {
  Plan plan = chain();
  auto r = plan.add_register({.name = "lonely.out", .shape = {1}});
  plan.add_actor({.name = "lonely", .op = "fill_piece", .outputs = {r}});
  plan.add_actor({.name = "lonely_sink", .op = "noop", .inputs = {{r}}});
  const std::string msg = refusal(plan);
  CHECK(contains(msg, "compute actor 'lonely' has no inputs"));
}

namespace {

// Adds "g" of `kind` (reading `inputs`, writing a new register "g.out" of `out_shape` /
// `out_dtype`) and a sink for it to the chain; returns what validate() says.
std::string refusal_with_group_actor(ActorKind kind, std::vector<InputPort> inputs, baton::Shape out_shape,
                                     baton::DType out_dtype, std::int32_t group) {
  Plan plan = chain();
  auto out = plan.add_register({.name = "g.out", .shape = std::move(out_shape), .dtype = out_dtype});
  plan.add_actor({.name = "g", .kind = kind, .inputs = std::move(inputs), .outputs = {out}, .group = group});
  plan.add_actor({.name = "g_sink", .op = "noop", .dtype = out_dtype, .inputs = {{out}}});
  return refusal(plan);
}

void check_group_actor_ports(ActorKind kind) {
  const std::string kind_name(baton::name(kind));
  CAPTURE(kind_name);
  const std::string actor = kind_name + " actor 'g' ";
  // Two inputs.
  CHECK(contains(refusal_with_group_actor(kind, {{0}, {1}}, {16}, baton::f32, 2),
                 actor + "needs exactly one input and one output, has 2 and 1"));
  // A group of 0, and a negative one.
  CHECK(contains(refusal_with_group_actor(kind, {{1}}, {16}, baton::f32, 0), actor + "has group 0"));
  CHECK(contains(refusal_with_group_actor(kind, {{1}}, {16}, baton::f32, -3), actor + "has group -3"));
  // Input and output of different shapes, or dtypes.
  CHECK(contains(refusal_with_group_actor(kind, {{1}}, {8}, baton::f32, 2),
                 actor + "reads f32[16] but writes f32[8]"));
  CHECK(contains(refusal_with_group_actor(kind, {{1}}, {16}, baton::f64, 2),
                 actor + "reads f32[16] but writes f64[16]"));
  // Reading with a delay.
  CHECK(contains(refusal_with_group_actor(kind, {{1, 1}}, {16}, baton::f32, 2), actor + "cannot read with a delay"));
  // Well formed: accepted.
  CHECK(refusal_with_group_actor(kind, {{1}}, {16}, baton::f32, 4).empty());
}

}  // namespace

TEST_CASE("Validate.RefusesRepeatWithTheWrongPortsOrGroup") { check_group_actor_ports(ActorKind::repeat); }

TEST_CASE("Validate.RefusesAccumulateWithTheWrongPortsOrGroup") {
  check_group_actor_ports(ActorKind::accumulate);
}

TEST_CASE("Validate.RefusesDuplicateActorNames") {
  Plan plan = chain();
  plan.actors[2].name = "mid";
  const std::string msg = refusal(plan);
  CHECK(contains(msg, "two actors are named 'mid'"));
}

TEST_CASE("Validate.RefusesANegativeDelay") {
  Plan plan = chain();
  plan.actors[2].inputs[0].delay = -1;
  const std::string msg = refusal(plan);
  CHECK(contains(msg, "'sink'"));
  CHECK(contains(msg, "'mid.out'"));
  CHECK(contains(msg, "negative delay -1"));
}

TEST_CASE("Validate.RefusesTheSameRegisterReadWithDifferentDelays") {
  Plan plan = chain();
  plan.actors[2].inputs.push_back({1, 2});
  const std::string msg = refusal(plan);
  CHECK(contains(msg, "actor 'sink' reads 'mid.out' twice with different delays (0 and 2)"));

  // The same delay twice is fine (add reads one register as both operands).
  Plan same = chain();
  same.actors[2].inputs.push_back({1, 0});
  CHECK(refusal(same).empty());
}

TEST_CASE("Validate.RefusesACrossRankEdge") {
  Plan plan = chain();
  plan.actors[2].where.rank = 1;
  for (std::uint16_t rank : {0, 1}) {
    CAPTURE(rank);
    const std::string msg = refusal(plan, rank);
    CHECK(contains(msg, "register 'mid.out' crosses from rank 0 ('mid') to rank 1 ('sink')"));
  }
}

TEST_CASE("Validate.ListsEveryProblemInOneError") {
  Plan plan = chain();
  plan.registers[0].slots = 0;        // 1
  plan.actors[1].op = "no_such_op";       // 2
  plan.actors[2].name = "src";        // 3
  plan.actors[2].inputs[0].delay = -2;  // 4
  const std::string msg = refusal(plan);
  CHECK(contains(msg, "invalid plan (4 problems):"));
  CHECK(contains(msg, "register 'src.out' has 0 slots"));
  CHECK(contains(msg, "'no_such_op'"));
  CHECK(contains(msg, "two actors are named 'src'"));
  CHECK(contains(msg, "negative delay -2"));
  // One a line.
  CHECK(count(msg, "\n  - ") == 4);
}

// ---------------------------------------------------------------------------------------------
// validate(): the dry run (does the plan make progress?)

TEST_CASE("Validate.RefusesACycleWithoutDelay") {
  // A's act 0 needs B's piece 0, which needs A's piece 0: neither can ever act.
  const std::string msg = refusal(two_actor_cycle(0));
  CHECK(contains(msg, "cannot make progress"));
  CHECK(contains(msg, "deadlock"));
  CHECK(contains(msg, "'A'"));
  CHECK(contains(msg, "'B'"));
  // More slots do not help: nothing is ever written.
  CHECK(contains(refusal(two_actor_cycle(0, 8)), "cannot make progress"));
}

TEST_CASE("Validate.AcceptsACycleWithADelay") {
  // With delay 1 A's act 0 needs nothing; it writes a.out piece 0, B turns it into b.out
  // piece 0, which A reads at act 1: the cycle turns with one slot per register.
  const Plan plan = two_actor_cycle(1);
  REQUIRE(plan.registers[0].slots == 1);
  REQUIRE(plan.registers[1].slots == 1);
  CHECK(refusal(plan).empty());
  CHECK(refusal(two_actor_cycle(3, 3)).empty());
}

TEST_CASE("Validate.RefusesAForkJoinWithTooFewSlotsForItsDelay") {
  // S -> s.out -> {A, C}, C -> c.out -> A read 3 pieces late, every register one slot.
  //   S piece 0; A act 0 (reads s 0, no c yet); C act 0 writes c 0. s 0 freed, S piece 1.
  //   A act 1 reads s 1. C act 1 needs a free c.out slot, but c 0 is acked only by A's act 3.
  //   A act 2 needs s 2, which S writes only when s 1 is freed, which needs C's act 1.
  // A waits on S, S on C (back-pressure on s.out), C on A (back-pressure on c.out).
  const std::string msg = refusal(fork_join(3, 1, 1));
  CHECK(contains(msg, "cannot make progress"));
  CHECK(contains(msg, "'A'"));
  CHECK(contains(msg, "'C'"));
  CHECK(contains(msg, "'S'"));
}

TEST_CASE("Validate.ForkJoinNeedsSlotsEnoughForItsDelay") {
  // In general C's act k needs c.out piece k - c_slots acked, i.e. A's act k - c_slots + 3;
  // that needs s.out piece k - c_slots + 3, which needs s.out piece k - c_slots - s_slots + 3
  // freed, i.e. C's act k - c_slots - s_slots + 3. No circular wait iff
  // s_slots + c_slots > 3 (= delay).
  for (std::int32_t s_slots = 1; s_slots <= 4; ++s_slots) {
    for (std::int32_t c_slots = 1; c_slots <= 4; ++c_slots) {
      CAPTURE(s_slots);
      CAPTURE(c_slots);
      const std::string msg = refusal(fork_join(3, s_slots, c_slots));
      if (s_slots + c_slots > 3) {
        CHECK(msg.empty());
      } else {
        CHECK(contains(msg, "cannot make progress"));
      }
    }
  }
}

TEST_CASE("Validate.SelfLoopNeedsTwoSlots") {
  // A reads its own output one piece late: act k reads piece k-1 while writing piece k, so
  // both must be held at once; piece k-1 is acked only after act k. One slot deadlocks.
  auto self_loop = [](std::int32_t slots) {
    Plan plan;
    auto r = plan.add_register({.name = "a.out", .shape = {4}, .slots = slots});
    plan.add_actor({.name = "A", .op = "noop", .inputs = {{r, 1}}, .outputs = {r}});
    return plan;
  };
  const std::string msg = refusal(self_loop(1));
  CHECK(contains(msg, "cannot make progress"));
  CHECK(contains(msg, "'A' after 1 acts: back-pressured"));
  CHECK(refusal(self_loop(2)).empty());
}

namespace {

// A random plan for the progress check: a source and up to eight actors at rate 1 or 2 (a
// repeat of group 2 doubles a stream's rate, an accumulate of group 2 halves it), each compute
// actor reading one or two earlier actors of its rate and perhaps a later one, or itself, with a
// delay of 0 to 3; 1 to 3 slots per register; and perhaps a lane over two or three actors.
Plan random_progress_plan(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  struct Spec {
    ActorKind kind;
    int rate;
    std::vector<InputPort> inputs;
  };
  std::vector<Spec> specs{{ActorKind::source, 1, {}}};
  const int n = pick(3, 14);
  while (static_cast<int>(specs.size()) < n) {
    const int i = pick(0, static_cast<int>(specs.size()) - 1);  // the actor it reads first
    const int roll = pick(0, 99);
    if (roll < 12 && specs[i].rate == 1) {
      specs.push_back({ActorKind::repeat, 2, {{static_cast<RegisterIndex>(i)}}});
    } else if (roll < 24 && specs[i].rate == 2) {
      specs.push_back({ActorKind::accumulate, 1, {{static_cast<RegisterIndex>(i)}}});
    } else {
      Spec c{ActorKind::compute, specs[i].rate, {{static_cast<RegisterIndex>(i)}}};
      const int j = pick(0, static_cast<int>(specs.size()) - 1);
      if (j != i && specs[j].rate == c.rate && pick(0, 1) == 0) c.inputs.push_back({static_cast<RegisterIndex>(j)});
      specs.push_back(std::move(c));
    }
  }
  // Back edges: a compute actor reads one of its rate at or after itself, with a delay.
  for (std::size_t a = 1; a < specs.size(); ++a) {
    if (specs[a].kind != ActorKind::compute || pick(0, 99) >= 45) continue;
    const int b = pick(static_cast<int>(a), n - 1);
    if (specs[static_cast<std::size_t>(b)].rate != specs[a].rate) continue;
    specs[a].inputs.push_back({static_cast<RegisterIndex>(b), pick(0, 3)});
  }
  Plan plan;
  for (int a = 0; a < n; ++a) {
    plan.add_register({.name = fmt::format("r{}", a), .shape = {4}, .slots = pick(1, 3)});
  }
  // A lane: two or three compute actors of one rate in a fixed order of their acts.
  std::vector<int> lane;
  if (pick(0, 99) < 35) {
    const int rate = pick(1, 2);
    for (int a = 0; a < n; ++a) {
      if (specs[static_cast<std::size_t>(a)].kind == ActorKind::compute && specs[static_cast<std::size_t>(a)].rate == rate) {
        lane.push_back(a);
      }
    }
    std::shuffle(lane.begin(), lane.end(), rng);
    lane.resize(std::min<std::size_t>(lane.size(), static_cast<std::size_t>(pick(2, 3))));
    if (lane.size() < 2) lane.clear();
  }
  for (int a = 0; a < n; ++a) {
    const Spec& sp = specs[static_cast<std::size_t>(a)];
    baton::ActorDesc d{.name = fmt::format("a{}", a), .kind = sp.kind, .inputs = sp.inputs,
                       .outputs = {static_cast<RegisterIndex>(a)}};
    if (sp.kind == ActorKind::source) {
      d.op = "fill_piece";
      d.pieces = 10;
    } else if (sp.kind == ActorKind::compute) {
      d.op = "noop";
    } else {
      d.group = 2;
    }
    auto at = std::find(lane.begin(), lane.end(), a);
    if (at != lane.end()) {
      d.order = {.lane = 0, .units = {static_cast<std::int32_t>(at - lane.begin())},
                 .period = static_cast<std::int32_t>(lane.size())};
    }
    plan.add_actor(std::move(d));
  }
  return plan;
}

}  // namespace

TEST_CASE("Validate.TheShortProgressCheckAgreesWithTheLongOneOnRandomPlans" * doctest::timeout(120)) {
  // validate() plays a few iterations of the plan (ProgressCheck::iterations); the long check
  // plays until every actor has acted more often than the plan has slots and delays, which no
  // deadlocking part of a plan can do. Both must accept and refuse the same plans: cycles with
  // and without delays, delays longer than the slots, rates changed by repeat and accumulate,
  // and lanes that force an order.
  std::mt19937 rng(20261126);
  int live = 0, deadlocked = 0;
  for (int t = 0; t < 3000; ++t) {
    const Plan plan = random_progress_plan(rng);
    CAPTURE(t);
    auto verdict = [&](baton::ProgressCheck how) {
      try {
        baton::validate(plan, builtin(), 0, how);
      } catch (const PlanError& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    const std::string short_check = verdict(baton::ProgressCheck::iterations);
    const std::string long_check = verdict(baton::ProgressCheck::tokens);
    INFO(plan.to_text());
    CHECK(short_check.empty() == long_check.empty());
    if (!long_check.empty()) REQUIRE(contains(long_check, "cannot make progress"));
    (long_check.empty() ? live : deadlocked) += 1;
  }
  MESSAGE(live << " live plans, " << deadlocked << " that deadlock");
  // Both kinds, in numbers.
  CHECK(live > 500);
  CHECK(deadlocked > 500);
}

// Regression: the dry run once stopped as soon as its act budget was spent, which a healthy,
// independent chain spends on its own, and then accepted a deadlocking fork-join beside it
// (whose actors act a few times before they stick). Now every actor must reach its target.
TEST_CASE("Validate.RefusesADeadlockNextToAHealthyComponent") {
  Plan plan = fork_join(3, 1, 1);
  auto r = plan.add_register({.name = "ok.out", .shape = {4}});
  plan.add_actor({.name = "ok_src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {r}, .pieces = 10});
  plan.add_actor({.name = "ok_sink", .op = "noop", .inputs = {{r}}});
  REQUIRE(contains(refusal(fork_join(3, 1, 1)), "cannot make progress"));  // alone: refused
  const std::string msg = refusal(plan);
  CHECK(contains(msg, "cannot make progress"));
  CHECK(contains(msg, "'A'"));
}

// ---------------------------------------------------------------------------------------------
// A plan that validates runs

TEST_CASE("Runtime.RunsAValidatedChain" * doctest::timeout(30)) {
  const Plan plan = chain(100, 2);
  REQUIRE(refusal(plan).empty());
  baton::RuntimeSettings settings;
  settings.stall_timeout = std::chrono::milliseconds(10'000);
  baton::Runtime rt(plan, builtin(), settings);
  const baton::RunReport report = rt.run();
  auto acts_of = [&](const std::string& name) -> std::int64_t {
    for (const auto& a : report.metrics.actors) {
      if (a.name == name) return static_cast<std::int64_t>(a.acts);
    }
    return -1;
  };
  CHECK(acts_of("src") == 100);
  CHECK(acts_of("mid") == 100);
  CHECK(acts_of("sink") == 100);
  CHECK(report.metrics.total_acts() == 300);
  for (const auto& a : report.metrics.actors) {
    CAPTURE(a.name);
    CHECK(a.activity == baton::ActorActivity::retired);
  }
  for (const auto& r : report.metrics.registers) {
    CAPTURE(r.name);
    CHECK(r.written == 100);
    CHECK(r.freed == 100);
    CHECK(r.max_outstanding <= r.slots);
  }
}
