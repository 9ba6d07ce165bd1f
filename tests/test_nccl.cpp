// NCCL collectives (baton/kernels/nccl.h) and their actors (graph/collectives.h:
// add_nccl_collective).
//
// Without a GPU: the unique id's trip over the control plane (two ranks on loopback), the
// group layouts and their checks, the plans add_nccl_collective makes, and what a build without
// NCCL says. With a driver and one GPU: one-rank collectives are identities, NCCL actors in a
// runtime, a set-up whose peer never comes times out naming the rank and fails the job. With two
// GPUs: a two-rank all-reduce in one process is the sum. GPU tests print the same "...; CUDA
// tests skipped" as tests/test_cuda.cpp where they cannot run.
#include <doctest/doctest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/graph/collectives.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "baton/transport/control.h"
#include "loopback_run.h"
#include "models.h"
#include "test_util.h"

using namespace baton;
using namespace std::chrono_literals;
using baton::test::contains;

namespace {

/// What `fn` throws (any std::exception); fails the test if it throws nothing.
template <class F>
std::string thrown(F&& fn) {
  return baton::test::thrown_message<std::exception>(std::forward<F>(fn));
}

bool cuda_usable(int devices = 1) {
  const auto& a = cuda::availability();
  if (!a.ok) {
    baton::test::skip(baton::test::Missing::cuda_device, a.reason + "; CUDA tests skipped");
    return false;
  }
  if (!nccl::built_with_nccl()) {
    baton::test::skip(baton::test::Missing::cuda_device, "built without NCCL; CUDA tests skipped");
    return false;
  }
  if (a.devices < devices) {
    baton::test::skip(baton::test::Missing::second_cuda_device,
                      fmt::format("{} CUDA device(s), this test needs {}; CUDA tests skipped", a.devices, devices));
    return false;
  }
  return true;
}

// 128 bytes that look like an id: NCCL's own where the build has it, else every byte value
// that could trip an encoding (NUL, newline, quote, high bytes).
std::string some_id() {
  if (nccl::built_with_nccl()) return nccl::make_unique_id();
  std::string id(nccl::unique_id_bytes, '\0');
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>((i * 37 + 10) & 0xff);
  return id;
}

transport::ServerSettings server_settings(std::uint32_t world_size) {
  transport::ServerSettings s;
  s.bind_host = "127.0.0.1";
  s.token = "0123456789abcdef0123456789abcdef";
  s.world_size = world_size;
  s.join_timeout = 5000ms;
  s.barrier_timeout = 5000ms;
  s.heartbeat_interval = 100ms;
  s.heartbeat_timeout = 3000ms;
  return s;
}

std::unique_ptr<transport::ControlClient> client(const transport::RendezvousServer& server, std::uint32_t rank,
                                                 std::uint32_t world_size) {
  transport::ClientSettings s;
  s.master = "127.0.0.1:" + std::to_string(server.port());
  s.token = "0123456789abcdef0123456789abcdef";
  s.rank = rank;
  s.world_size = world_size;
  s.join_timeout = 5000ms;
  s.heartbeat_interval = 100ms;
  s.heartbeat_timeout = 3000ms;
  return std::make_unique<transport::ControlClient>(s);
}

void join_all(std::vector<std::unique_ptr<transport::ControlClient>>& clients) {
  std::vector<std::future<std::vector<transport::RankInfo>>> joins;
  for (std::uint32_t r = 0; r < clients.size(); ++r) {
    joins.push_back(std::async(std::launch::async, [&clients, r] {
      return clients[r]->join(transport::RankInfo{r, "host" + std::to_string(r), "addr", 42});
    }));
  }
  for (auto& j : joins) j.get();
}

std::vector<float> random_values(std::size_t n, int seed) {
  std::mt19937 g(static_cast<std::uint32_t>(seed));
  std::uniform_real_distribution<float> d(-2.f, 2.f);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

}  // namespace

TEST_CASE("Nccl.IdExchange.TwoRanksShareTheIdOverTheControlPlane" * doctest::timeout(30)) {
  transport::RendezvousServer server(server_settings(2));
  std::vector<std::unique_ptr<transport::ControlClient>> clients;
  clients.push_back(client(server, 0, 2));
  clients.push_back(client(server, 1, 2));
  join_all(clients);
  const std::string id = some_id();
  REQUIRE(id.size() == 128);
  // Rank 1 asks before rank 0 has published: it waits for the value.
  auto fetched = std::async(std::launch::async, [&] { return clients[1]->fetch("nccl/grad", 5000ms); });
  std::this_thread::sleep_for(50ms);
  clients[0]->publish("nccl/grad", id);
  CHECK(fetched.get() == id);
  CHECK(clients[0]->fetch("nccl/grad", 100ms) == id);
  // A value published before a barrier is there on every rank once the barrier completes.
  const std::string second = some_id();
  clients[1]->publish("nccl/other", second);
  auto b0 = std::async(std::launch::async, [&] { clients[0]->barrier("start", 5000ms); });
  clients[1]->barrier("start", 5000ms);
  b0.get();
  CHECK(clients[0]->fetch("nccl/other", 0ms) == second);
  // Publishing the same value again is harmless; a key nobody publishes times out, named.
  clients[0]->publish("nccl/grad", id);
  const std::string missing = thrown([&] { clients[1]->fetch("nccl/nobody", 200ms); });
  CHECK(contains(missing, "nccl/nobody"));
  CHECK(contains(missing, "no rank published it"));
  for (auto& c : clients) CHECK_FALSE(c->aborted().has_value());
}

TEST_CASE("Nccl.IdExchange.AnotherValueUnderTheSameKeyFailsTheJob" * doctest::timeout(30)) {
  transport::RendezvousServer server(server_settings(2));
  std::vector<std::unique_ptr<transport::ControlClient>> clients;
  clients.push_back(client(server, 0, 2));
  clients.push_back(client(server, 1, 2));
  join_all(clients);
  clients[0]->publish("nccl/g", std::string(128, 'a'));
  CHECK(clients[1]->fetch("nccl/g", 5000ms) == std::string(128, 'a'));
  clients[1]->publish("nccl/g", std::string(128, 'b'));
  const auto outcome = server.wait_for(5000ms);
  REQUIRE(outcome.has_value());
  CHECK_FALSE(outcome->ok);
  CHECK(contains(outcome->reason, "'nccl/g'"));
  CHECK(contains(outcome->reason, "rank 1 published"));
}

TEST_CASE("Nccl.Communicators.TheLowestRankMakesAndPublishesTheId" * doctest::timeout(60)) {
  LocalStore store;
  const nccl::Group g{"grad", {1, 0}, {0, 0}};  // member 0 on rank 1, member 1 on rank 0
  CHECK(g.root() == 0);
  CHECK(g.key() == "nccl/grad");
  nccl::Communicators rank0(0, &store, {.timeout = 2000ms});
  nccl::Communicators rank1(1, &store, {.timeout = 2000ms});
  if (!nccl::built_with_nccl()) {
    CHECK(contains(thrown([&] { rank0.prepare(g); }), "built without NCCL"));
    return;
  }
  rank1.prepare(g);  // not the root: publishes nothing
  CHECK(contains(thrown([&] { store.get("nccl/grad", 10ms); }), "nccl/grad"));
  rank0.prepare(g);
  rank0.prepare(g);  // a second member of the same group on this rank: nothing more
  const std::string id = store.get("nccl/grad", 10ms);
  CHECK(id.size() == nccl::unique_id_bytes);
  // The same name with another layout is a plan error, named.
  const std::string clash = thrown([&] { rank0.prepare(nccl::Group{"grad", {0, 1}, {0, 0}}); });
  CHECK(contains(clash, "'grad'"));
  CHECK(contains(clash, "laid out differently"));
  // A group that spans ranks needs a store to hand its id on.
  nccl::Communicators alone(0, nullptr, {.timeout = 2000ms});
  CHECK(contains(thrown([&] { alone.prepare(g); }), "no store"));
  // Without a GPU, making rank 1's communicator says why, naming it; with one, its peer (rank 0)
  // never starts, so the set-up times out, naming the call and the rank, and is aborted.
  const std::string err = thrown([&] { rank1.communicator("grad", 0); });
  CHECK(contains(err, "communicator 'grad' rank 0 of 2 on cuda:0"));
  if (cuda::availability().ok) {
    CHECK(contains(err, "ncclCommInitRankConfig did not finish within 2.0 s"));
  } else {
    CHECK(contains(err, cuda::availability().reason));
  }
  // Every later ask fails the same way at once.
  CHECK(thrown([&] { rank1.communicator("grad", 0); }) == err);
}

TEST_CASE("Nccl.Group.BadLayoutsAreRefused") {
  CHECK(contains(thrown([] { nccl::Group{"g", {0, 0}, {1, 1}}.check(); }), "two members on rank 0 cuda:1"));
  CHECK(contains(thrown([] { nccl::Group{"g", {0, 1}, {0}}.check(); }), "2 ranks but 1 devices"));
  CHECK(contains(thrown([] { nccl::Group{"g", {}, {}}.check(); }), "no members"));
  nccl::Group{"g", {0, 0, 1}, {0, 1, 0}}.check();
}

TEST_CASE("Nccl.Plan.OneActorPerMemberOnItsDevice") {
  Plan plan;
  const Device gpu0 = Device::parse("cuda:0"), gpu1 = Device::parse("cuda:1");
  std::vector<AllReduceMember> members;
  const std::vector<Placement> places{{0, gpu0, 0}, {0, gpu1, 0}, {1, gpu0, 2}};
  for (std::size_t i = 0; i < places.size(); ++i) {
    auto a = plan.add_register({.name = fmt::format("a{}", i), .shape = {6, 4}, .dtype = f32});
    plan.add_actor({.name = fmt::format("src{}", i), .kind = ActorKind::source, .op = "fill_piece",
                    .where = {places[i].rank, Device{}, 0}, .outputs = {a}, .pieces = 3});
    auto r = plan.add_register({.name = fmt::format("g{}", i), .shape = {6, 4}, .dtype = f32});
    plan.add_actor({.name = fmt::format("twice{}", i), .op = "scale", .where = places[i], .inputs = {{a}},
                    .outputs = {r}, .attrs = Attrs{{"value", 2.0}}});
    members.push_back({places[i], r, fmt::format("@dp{}", i)});
  }
  auto sums = add_nccl_allreduce(plan, "grad", members, {6, 4}, f32, 3);
  auto parts = add_nccl_collective(plan, NcclCollective::reduce_scatter, "rs", members, {6, 4}, f32, 2, "shared");
  auto whole = add_nccl_collective(plan, NcclCollective::all_gather, "ag", members, {6, 4}, f32, 2, "shared");
  REQUIRE(sums.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    const RegisterDesc& sum = plan.registers[sums[i]];
    CHECK(sum.name == fmt::format("grad.allreduced@dp{}", i));
    CHECK(sum.shape == Shape{6, 4});
    CHECK(sum.slots == 3);
    const ActorDesc& a = plan.actors[sum.producer];
    CHECK(a.name == fmt::format("grad.nccl@dp{}", i));
    CHECK(a.op == "nccl.allreduce");
    CHECK(a.where == places[i]);
    CHECK(a.inputs == std::vector<InputPort>{{members[i].input}});
    CHECK(a.role == ActorRole::collective);
    CHECK(a.attrs.get_string("group", "") == "grad");
    CHECK(a.attrs.get_int("member", -1) == static_cast<std::int64_t>(i));
    CHECK(std::get<std::vector<std::int64_t>>(a.attrs.values().at("ranks")) == std::vector<std::int64_t>{0, 0, 1});
    CHECK(std::get<std::vector<std::int64_t>>(a.attrs.values().at("devices")) == std::vector<std::int64_t>{0, 1, 0});
    CHECK(plan.registers[parts[i]].shape == Shape{8});
    CHECK(plan.actors[plan.registers[parts[i]].producer].attrs.get_string("group", "") == "shared");
    CHECK(plan.registers[whole[i]].shape == Shape{72});
    CHECK(plan.actors[plan.registers[whole[i]].producer].op == "nccl.all_gather");
  }
  // The NCCL kernels exist in every build (without NCCL they say so when made).
  const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  for (const char* op : {"nccl.allreduce", "nccl.reduce_scatter", "nccl.all_gather"}) {
    CHECK(reg.contains(op, DeviceType::cuda, f32));
    CHECK(reg.contains(op, DeviceType::cuda, i64));
  }
  Plan with_sinks = plan;
  for (auto r : sums) with_sinks.add_actor({.name = plan.registers[r].name + ".sink", .op = "noop", .where = plan.actors[plan.registers[r].producer].where, .inputs = {{r}}});
  for (auto r : parts) with_sinks.add_actor({.name = plan.registers[r].name + ".sink", .op = "noop", .where = plan.actors[plan.registers[r].producer].where, .inputs = {{r}}});
  for (auto r : whole) with_sinks.add_actor({.name = plan.registers[r].name + ".sink", .op = "noop", .where = plan.actors[plan.registers[r].producer].where, .inputs = {{r}}});
  // The other CUDA kernels (scale, noop, the copies) exist only in a build with CUDA.
  if (cuda::built_with_cuda()) validate(insert_device_copies(with_sinks), reg, 0);
}

TEST_CASE("Nccl.Plan.MistakesAreNamed") {
  Plan plan;
  auto r = plan.add_register({.name = "g", .shape = {5}, .dtype = f32});
  plan.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {r}, .pieces = 1});
  const Placement cpu{}, gpu{0, Device::parse("cuda:0"), 0};
  CHECK(contains(thrown([&] { add_nccl_allreduce(plan, "x", {{cpu, r, "@a"}}, {5}, f32); }),
                 "member '@a' is on rank 0 cpu:0, not a CUDA device"));
  CHECK(contains(thrown([&] { add_nccl_allreduce(plan, "x", {{gpu, r, "@a"}, {gpu, r, "@b"}}, {5}, f32); }),
                 "members '@a' and '@b' are both on rank 0 cuda:0"));
  const Placement gpu1{0, Device::parse("cuda:1"), 0};
  CHECK(contains(thrown([&] {
                   add_nccl_collective(plan, NcclCollective::reduce_scatter, "x", {{gpu, r, "@a"}, {gpu1, r, "@b"}},
                                       {5}, f32);
                 }),
                 "5 elements do not split into 2 equal parts"));
  CHECK(contains(thrown([&] { add_nccl_allreduce(plan, "x", {}, {5}, f32); }), "no members"));
}

TEST_CASE("Nccl.Kernels.SayWhatTheyNeed") {
  const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  const Attrs attrs{{"group", std::string("g")}, {"ranks", std::vector<std::int64_t>{0}},
                    {"devices", std::vector<std::int64_t>{0}}, {"member", std::int64_t{0}}};
  const std::string outside =
      thrown([&] { reg.create("nccl.allreduce", KernelConfig{"g.nccl", Device::parse("cuda:0"), f32, attrs}); });
  CHECK(contains(outside, "g.nccl"));
  if (!nccl::built_with_nccl()) {
    CHECK(contains(outside, "built without NCCL"));
    CHECK(nccl::version() == "built without NCCL");
    return;
  }
  CHECK(contains(outside, "KernelServices"));
  std::printf("NCCL %s\n", nccl::version().c_str());
  CHECK(nccl::version().rfind("2.", 0) == 0);
  nccl::Communicators comms(0, nullptr, {});
  KernelServices services{0, nullptr, &comms, nullptr};
  // An actor on another device than its member's.
  const std::string wrong = thrown(
      [&] { reg.create("nccl.allreduce", KernelConfig{"g.nccl", Device::parse("cuda:1"), f32, attrs, &services}); });
  CHECK(contains(wrong, "belongs on rank 0 cuda:0"));
  Attrs no_ranks{{"group", std::string("g")}, {"member", std::int64_t{0}}};
  CHECK(contains(thrown([&] {
                   reg.create("nccl.allreduce", KernelConfig{"g.nccl", Device::parse("cuda:0"), f32, no_ranks, &services});
                 }),
                 "needs the attribute 'ranks'"));
  // Made fine: the id is made now, the communicator at the first act.
  CHECK(reg.create("nccl.allreduce", KernelConfig{"g.nccl", Device::parse("cuda:0"), f32, attrs, &services}) != nullptr);
}

// ---- with a GPU ----------------------------------------------------------------------------

namespace {

struct OnDevice {
  Device device;
  std::unique_ptr<cuda::Stream> stream;
  std::unique_ptr<Allocator> memory;
  explicit OnDevice(int index)
      : device{DeviceType::cuda, static_cast<std::uint8_t>(index)},
        stream(cuda::Stream::create(device, fmt::format("test_nccl cuda:{}", index))),
        memory(cuda::make_device_allocator(device)) {}
  Tensor up(const std::vector<float>& v) {
    Tensor h = Tensor::empty({static_cast<std::int64_t>(v.size())}, f32);
    std::copy(v.begin(), v.end(), h.data<float>().begin());
    Tensor d = Tensor::empty(h.shape(), f32, *memory);
    cuda::copy(d, h, *stream);
    stream->synchronize();  // h goes out of scope
    return d;
  }
  Tensor poisoned(std::int64_t n) {
    Tensor h = Tensor::empty({n}, f32);
    std::memset(h.raw(), 0xff, h.nbytes());
    Tensor d = Tensor::empty({n}, f32, *memory);
    cuda::copy(d, h, *stream);
    stream->synchronize();
    return d;
  }
  std::vector<float> down(const Tensor& d) {
    Tensor h = Tensor::empty(d.shape(), f32);
    cuda::copy(h, d, *stream);
    stream->synchronize();
    auto x = h.data<float>();
    return {x.begin(), x.end()};
  }
};

}  // namespace

TEST_CASE("Nccl.OneRank.CollectivesAreIdentities" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  OnDevice gpu(0);
  auto comm = nccl::Communicator::create(nccl::make_unique_id(), 1, 0, gpu.device, "one", {.timeout = 60'000ms});
  CHECK(comm->size() == 1);
  CHECK(comm->describe() == "communicator 'one' rank 0 of 1 on cuda:0");
  for (int round = 0; round < 3; ++round) {
    const auto x = random_values(1000 + static_cast<std::size_t>(round), round);
    Tensor in = gpu.up(x);
    Tensor out = gpu.poisoned(static_cast<std::int64_t>(x.size()));
    comm->all_reduce(in, out, *gpu.stream);
    CHECK(gpu.down(out) == x);
    out = gpu.poisoned(static_cast<std::int64_t>(x.size()));
    comm->reduce_scatter(in, out, *gpu.stream);
    CHECK(gpu.down(out) == x);
    out = gpu.poisoned(static_cast<std::int64_t>(x.size()));
    comm->all_gather(in, out, *gpu.stream);
    CHECK(gpu.down(out) == x);
  }
  Tensor small = gpu.poisoned(10), big = gpu.poisoned(20);
  CHECK(contains(thrown([&] { comm->all_reduce(small, big, *gpu.stream); }), "ncclAllReduce"));
}

TEST_CASE("Nccl.OneRank.ActorsSumInARuntime" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  // source (cpu) -> to_device -> nccl.allreduce over one member (cuda:0) -> to_host -> collect.
  Plan p;
  const Placement gpu{0, Device::parse("cuda:0"), 0};
  auto a = p.add_register({.name = "a", .shape = {4096}, .dtype = f32, .slots = 2});
  p.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {a}, .pieces = 100,
               .attrs = Attrs{{"offset", std::int64_t{5}}}});
  auto g = p.add_register({.name = "g", .shape = {4096}, .dtype = f32, .slots = 2});
  p.add_actor({.name = "twice", .op = "scale", .where = gpu, .inputs = {{a}}, .outputs = {g}, .attrs = Attrs{{"value", 2.0}}});
  auto sums = add_nccl_allreduce(p, "grad", {{gpu, g, "@0"}}, {4096}, f32);
  p.add_actor({.name = "sink", .op = "collect", .inputs = {{sums[0]}}});
  const Plan plan = insert_device_copies(p);
  for (auto mode : {ExecutionMode::threaded, ExecutionMode::deterministic}) {
    CAPTURE(static_cast<int>(mode));
    KernelRegistry reg = KernelRegistry::with_builtin_kernels();
    std::vector<float> seen;
    reg.add_fn("collect", DeviceType::cpu, f32, [&seen](KernelContext& ctx) {
      auto x = ctx.inputs[0]->data<float>();
      for (float v : x) {
        if (v != x[0]) throw std::runtime_error(fmt::format("piece {}: mixed values {} and {}", ctx.piece, x[0], v));
      }
      seen.push_back(x[0]);
    });
    RuntimeSettings s;
    s.mode = mode;
    s.stall_timeout = 40'000ms;
    Runtime rt(plan, reg, s);
    rt.run();
    REQUIRE(seen.size() == 100);
    for (std::size_t i = 0; i < seen.size(); ++i) CHECK(seen[i] == 2.f * (static_cast<float>(i) + 5));
  }
}

TEST_CASE("Nccl.Failure.APeerThatNeverComesFailsTheJobNamingTheRank" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  // A group of two members, one per rank; this runtime plays rank 0 only, so member 1 never
  // starts: member 0's first act waits for it, gives up, and the job fails with NCCL's reason.
  Plan plan;
  std::vector<AllReduceMember> members;
  for (std::uint16_t rank = 0; rank < 2; ++rank) {
    const Placement at{rank, Device::parse("cuda:0"), 0};
    auto a = plan.add_register({.name = fmt::format("a{}", rank), .shape = {256}, .dtype = f32});
    plan.add_actor({.name = fmt::format("src{}", rank), .kind = ActorKind::source, .op = "fill_piece",
                    .where = {rank, Device{}, 0}, .outputs = {a}, .pieces = 4});
    auto r = plan.add_register({.name = fmt::format("g{}", rank), .shape = {256}, .dtype = f32});
    plan.add_actor({.name = fmt::format("twice{}", rank), .op = "scale", .where = at, .inputs = {{a}}, .outputs = {r},
                    .attrs = Attrs{{"value", 2.0}}});
    members.push_back({at, r, fmt::format("@r{}", rank)});
  }
  auto sums = add_nccl_allreduce(plan, "lonely", members, {256}, f32);
  for (std::uint16_t rank = 0; rank < 2; ++rank) {
    plan.add_actor({.name = fmt::format("sink{}", rank), .op = "noop", .where = members[rank].where,
                    .inputs = {{sums[rank]}}});
  }
  plan = insert_device_copies(plan);
  LocalStore store;
  RuntimeSettings s;
  s.rank = 0;
  s.store = &store;
  s.stall_timeout = 4000ms;  // NCCL gives up after 3 s
  Runtime rt(plan, KernelRegistry::with_builtin_kernels(), s);
  const std::string err = thrown([&] { rt.run(); });
  CHECK(contains(err, "actor 'lonely.nccl@r0'"));
  CHECK(contains(err, "communicator 'lonely' rank 0 of 2 on cuda:0"));
  CHECK(contains(err, "ncclCommInitRankConfig did not finish within 3.0 s"));
}

TEST_CASE("Nccl.TwoDevices.AllReduceIsTheSumOnBoth" * doctest::timeout(180)) {
  if (!cuda_usable(2)) return;
  OnDevice d0(0), d1(1);
  auto comms = nccl::Communicator::create_local(nccl::make_unique_id(), 2, {0, 1}, {d0.device, d1.device}, "pair",
                                                {.timeout = 60'000ms});
  REQUIRE(comms.size() == 2);
  const auto x = random_values(3000, 1), y = random_values(3000, 2);
  Tensor in0 = d0.up(x), in1 = d1.up(y);
  Tensor out0 = d0.poisoned(3000), out1 = d1.poisoned(3000);
  // One thread per device: NCCL's calls for two devices from one thread need a group.
  auto t = std::async(std::launch::async, [&] { comms[1]->all_reduce(in1, out1, *d1.stream); });
  comms[0]->all_reduce(in0, out0, *d0.stream);
  t.get();
  const auto s0 = d0.down(out0), s1 = d1.down(out1);
  CHECK(s0 == s1);  // the same bits on both
  // One f32 addition each: within one rounding (6e-8) of the double sum; 1e-6 leaves room.
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(s0[i] == doctest::Approx(x[i] + y[i]).epsilon(1e-6));
  // And as actors: two members on cuda:0 and cuda:1 of rank 0, 50 pieces.
  Plan p;
  std::vector<AllReduceMember> members;
  for (int d = 0; d < 2; ++d) {
    const Placement at{0, Device{DeviceType::cuda, static_cast<std::uint8_t>(d)}, 0};
    auto a = p.add_register({.name = fmt::format("a{}", d), .shape = {1024}, .dtype = f32});
    p.add_actor({.name = fmt::format("src{}", d), .kind = ActorKind::source, .op = "fill_piece", .outputs = {a},
                 .pieces = 50, .attrs = Attrs{{"offset", std::int64_t{d * 1000}}}});
    auto g = p.add_register({.name = fmt::format("g{}", d), .shape = {1024}, .dtype = f32});
    p.add_actor({.name = fmt::format("copy{}", d), .op = "scale", .where = at, .inputs = {{a}}, .outputs = {g},
                 .attrs = Attrs{{"value", 1.0}}});
    members.push_back({at, g, fmt::format("@{}", d)});
  }
  auto sums = add_nccl_allreduce(p, "grad", members, {1024}, f32);
  for (int d = 0; d < 2; ++d) p.add_actor({.name = fmt::format("sink{}", d), .op = "collect", .inputs = {{sums[static_cast<std::size_t>(d)]}}});
  const Plan plan = insert_device_copies(p);
  KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  std::mutex mutex;
  std::vector<float> seen;
  reg.add_fn("collect", DeviceType::cpu, f32, [&](KernelContext& ctx) {
    auto v = ctx.inputs[0]->data<float>();
    std::lock_guard lock(mutex);
    seen.push_back(v[0]);
    if (v[0] != 2.f * static_cast<float>(ctx.piece) + 1000.f || v[v.size() - 1] != v[0]) {
      throw std::runtime_error(fmt::format("piece {}: {} ... {}", ctx.piece, v[0], v[v.size() - 1]));
    }
  });
  RuntimeSettings s;
  s.stall_timeout = 60'000ms;
  Runtime rt(plan, reg, s);
  rt.run();
  CHECK(seen.size() == 100);
}

TEST_CASE("Nccl.TwoDevices.ACollectiveWithoutItsPeerIsAbortedByTheWatchdog" * doctest::timeout(120)) {
  if (!cuda_usable(2)) return;
  // Both members are made (the set-up needs both), but only member 0 calls the all-reduce: its
  // kernel waits on the device for member 1 forever, where no NCCL host call sees it. The
  // watchdog aborts the communicator after the timeout and says which collective and rank.
  std::mutex mutex;
  std::condition_variable cv;
  std::string reported;
  nccl::Communicators comms(0, nullptr, {.timeout = 2000ms}, [&](const std::string& why) {
    std::lock_guard lock(mutex);
    reported = why;
    cv.notify_all();
  });
  const nccl::Group g{"half", {0, 0}, {0, 1}};
  comms.prepare(g);
  OnDevice d0(0);
  nccl::Communicator& c0 = comms.communicator("half", 0);
  Tensor in = d0.up(random_values(1000, 3));
  Tensor out = d0.poisoned(1000);
  c0.all_reduce(in, out, *d0.stream);
  {
    std::unique_lock lock(mutex);
    REQUIRE(cv.wait_for(lock, 20s, [&] { return !reported.empty(); }));
  }
  CHECK(contains(reported, "communicator 'half' rank 0 of 2 on cuda:0: ncclAllReduce #1"));
  CHECK(contains(reported, "aborted by the NCCL watchdog"));
  // The abort ended the kernel: the stream drains instead of hanging.
  try {
    d0.stream->synchronize();
  } catch (const std::exception& e) {
    MESSAGE("after the abort the stream reports: " << e.what());
  }
  CHECK(contains(thrown([&] { c0.all_reduce(in, out, *d0.stream); }), "after the communicator was aborted"));
}

TEST_CASE("Nccl.IdExchange.RunJobHandsKernelsAStoreFilledBeforeTheStart" * doctest::timeout(120)) {
  // Two ranks of run_job in this process. On rank 0 the kernel factory publishes 128 bytes while
  // the runtime is built (as an NCCL group's root does with its unique id); rank 1's kernel
  // reads them at its first act without waiting (timeout 0): the start barrier comes between.
  const std::string id = some_id();
  std::mutex mutex;
  std::string seen;
  KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  reg.add("share", DeviceType::cpu, f32, [&](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    if (cfg.services == nullptr || cfg.services->store == nullptr) throw std::runtime_error("no store for the kernels");
    if (cfg.services->rank == 0) cfg.services->store->set("test/id", id);
    struct Fetch final : Kernel {
      Store* store;
      std::uint16_t rank;
      std::mutex* mutex;
      std::string* seen;
      Fetch(Store* s, std::uint16_t r, std::mutex* m, std::string* out) : store(s), rank(r), mutex(m), seen(out) {}
      void compute(KernelContext&) override {
        if (rank != 1) return;
        std::string value = store->get("test/id", 0ms);
        std::lock_guard lock(*mutex);
        *seen = std::move(value);
      }
    };
    return std::make_unique<Fetch>(cfg.services->store, cfg.services->rank, &mutex, &seen);
  });
  // Each rank's output is read on the other (run_job's data plane wants ranks that talk).
  Plan plan;
  std::vector<RegisterIndex> outs;
  for (std::uint16_t rank = 0; rank < 2; ++rank) {
    outs.push_back(plan.add_register({.name = fmt::format("out{}", rank), .shape = {1}, .dtype = f32}));
    plan.add_actor({.name = fmt::format("share{}", rank), .kind = ActorKind::source, .op = "share",
                    .where = {rank, Device{}, 0}, .outputs = {outs.back()}, .pieces = 1});
  }
  for (std::uint16_t rank = 0; rank < 2; ++rank) {
    plan.add_actor({.name = fmt::format("sink{}", rank), .op = "noop", .where = {rank, Device{}, 0},
                    .inputs = {{outs[1u - rank]}}});
  }
  transport::RendezvousServer server(server_settings(2));
  std::vector<std::future<RunReport>> ranks;
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    ranks.push_back(std::async(std::launch::async, [&, rank] {
      JobEnvironment env{rank, 2, rank, "127.0.0.1:" + std::to_string(server.port()),
                         "0123456789abcdef0123456789abcdef"};
      JobSettings js;
      js.join_timeout = 20'000ms;
      js.start_timeout = 20'000ms;
      js.finish_timeout = 20'000ms;
      return run_job(plan, reg, env, js);
    }));
  }
  for (auto& r : ranks) r.get();
  std::lock_guard lock(mutex);
  CHECK(seen == id);
}

// Tensor parallelism's sums through NCCL between two GPUs (graph/src/passes/tp_collectives.cpp):
// the GPT at tp 2 on cuda:0 and cuda:1, its forward sums one NCCL all-reduce each ("auto")
// against the chains of adds ("actors"), three Adam steps in f32. NCCL adds two members' parts
// in one f32 addition, as the chain's add does, so the losses should agree to the last bits;
// 1e-6 relative leaves room for a reduction order NCCL may choose otherwise. The logic runs
// in CI on sim devices (tests/test_tp_collectives.cpp); this is its run on GPUs.
namespace {

/// What the two-GPU GPTs (batch 8, sequences of 8) train with: 3 steps of 2 micro-batches of
/// 600 tokens of 16 letters in a fixed pattern, Adam, and `collectives`.
TrainConfig two_gpu_config(const char* collectives) {
  auto corpus = std::make_shared<data::TextCorpus>();
  for (int c = 0; c < 16; ++c) corpus->vocab.push_back(static_cast<unsigned char>('a' + c));
  for (int i = 0; i < 600; ++i) corpus->ids.push_back((i * 5 + i / 11) % 16);
  TrainConfig cfg;
  cfg.steps = 3;
  cfg.microbatches = 2;
  cfg.optimizer = optim::adam(0.01);
  cfg.collectives = collectives;
  cfg.data = {{"text", data::text_source(corpus, 8, 2, 8, 3), {"tokens", "targets"}}};
  return cfg;
}

}  // namespace

TEST_CASE("Nccl.TwoDevices.TensorParallelSumsTrainAsTheChainsOfAdds" * doctest::timeout(300)) {
  if (!cuda_usable(2)) return;
  auto train = [](const char* collectives) {
    Graph g(5);
    Value loss =
        models::gpt_with_loss(g, 4, {.vocab = 16, .seq = 8, .d_model = 16, .heads = 2, .layers = 2, .tp = 2}).loss;
    TrainConfig cfg = two_gpu_config(collectives);
    cfg.tp = 2;
    cfg.replica_places = {{.device = Device::parse("cuda:0")}, {.device = Device::parse("cuda:1")}};
    TrainingJob job = compile_training(g, loss, cfg);
    int nccl = 0;
    for (const ActorDesc& a : job.plan.actors) nccl += a.op == "nccl.allreduce";
    RuntimeSettings rs;
    rs.stall_timeout = 60'000ms;
    Runtime(job.plan, job.kernels, rs).run();
    return std::pair{job.losses->per_step(), nccl};
  };
  const auto [with_nccl, n] = train("auto");
  const auto [with_adds, none] = train("actors");
  CHECK(n == 12);
  CHECK(none == 0);
  REQUIRE(with_nccl.size() == 3);
  REQUIRE(with_adds.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(with_nccl[i] == doctest::Approx(with_adds[i]).epsilon(1e-6));
}

// Two pipeline stages on two ranks of this process (a loopback data plane), rank 0 on cuda:0 and
// rank 1 on cuda:1: the stage boundary by NCCL's send and receive (the nccl_p2p pass) trains as
// the host-staged boundary does, bit for bit (a move copies; it adds nothing).
TEST_CASE("Nccl.TwoDevices.PipelineRegistersBetweenRanksTrainAsStaged" * doctest::timeout(300)) {
  if (!cuda_usable(2)) return;
  auto train = [](const char* collectives) {
    Graph g(5);
    Value loss = models::gpt_with_loss(g, 4, {.vocab = 16, .seq = 8, .d_model = 16, .heads = 2, .layers = 2}).loss;
    TrainConfig cfg = two_gpu_config(collectives);
    cfg.pp = 2;
    cfg.replica_places = {{.rank = 0, .device = Device::parse("cuda:0")}, {.rank = 1, .device = Device::parse("cuda:1")}};
    TrainingJob job = compile_training(g, loss, cfg);
    LocalStore store;  // the ranks' shared control plane: how rank 1 gets the group's unique id
    RuntimeSettings rs;
    rs.stall_timeout = 60'000ms;
    rs.store = &store;
    for (const auto& r : test::run_on_loopback(job.plan, job.kernels, rs)) REQUIRE_MESSAGE(r.error.empty(), r.error);
    return std::pair{job.losses->per_step(), test::count_op(job.plan, "nccl.send")};
  };
  const auto [by_nccl, sends] = train("auto");
  const auto [staged, none] = train("actors");
  CHECK(sends >= 2);
  CHECK(none == 0);
  REQUIRE(by_nccl.size() == 3);
  CHECK(by_nccl == staged);
}
