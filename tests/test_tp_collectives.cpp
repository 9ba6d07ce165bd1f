// Tensor parallelism's sums through NCCL (graph/src/passes/tp_collectives.cpp), run for real on
// `sim` devices, whose stand-in for NCCL (kernels/src/sim_nccl.cpp) pairs the calls of a group
// by their order and blocks a member's stream until every member has called, as NCCL does on
// GPUs. Its sum adds in member order, the order of the chain of adds it replaces, so a sim run
// must train as the CPU with the chains does, bit for bit: a member that read a part before it
// was written, or a reader given another shard's copy at the wrong piece, shows as a
// difference; a lane that ordered the calls differently on two members fails the job.
#include <doctest/doctest.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/graph/collectives.h"
#include "baton/kernels.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/data.h"
#include "baton/kernels/nccl.h"
#include "loopback_run.h"
#include "models.h"
#include "test_util.h"

using namespace baton;
using namespace std::chrono_literals;

namespace {

struct Setup {
  int dp = 1, pp = 1, tp = 2;
  std::string schedule = "1f1b";
  std::int64_t microbatches = 2;  // per replica
  int threads = 1;
  bool memory_plan = true;
  bool ranks = false;  // each place a rank of its own (sim:0 of each), joined by a loopback data plane
  int virtual_stages = 1;
};

using test::count_op;

struct Trained {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
  int nccl = 0;  // nccl.allreduce actors in the plan
  int sends = 0, receives = 0;  // nccl.send and nccl.recv actors
  int staged = 0;  // registers still staged through the hosts from a GPU to another rank's GPU
};

/// The pipeline's registers (made by a forward or backward op) that cross ranks from a GPU to
/// another through host memory: a to_host copy read by a transfer whose copy a to_device copy
/// reads (CUDA devices), or a transfer between sim devices (whose memory is host memory: no
/// copies). (The loss's all-reduce keeps its ring of actors.)
int staged_crossings(const Plan& plan) {
  auto pipeline = [&](RegisterIndex r) {
    const ActorRole role = plan.actors[plan.registers[r].producer].role;
    return role == ActorRole::forward || role == ActorRole::backward;
  };
  int n = 0;
  for (const ActorDesc& down : plan.actors) {
    const bool whole = down.op == "transfer" && down.inputs.size() == 1 && down.window < 0;  // no ring's window
    if (down.kind == ActorKind::transfer && whole && down.where.device.type == DeviceType::sim &&
        pipeline(down.inputs[0].reg)) {
      const ActorIndex p = plan.registers[down.inputs[0].reg].producer;
      n += plan.actors[p].where.device.type == DeviceType::sim;
    }
    if (down.copy != CopyDirection::to_host || !pipeline(down.inputs[0].reg)) continue;
    for (ActorIndex t : plan.registers[down.outputs[0]].consumers) {
      if (plan.actors[t].kind != ActorKind::transfer) continue;
      for (ActorIndex up : plan.registers[plan.actors[t].outputs[0]].consumers) {
        n += plan.actors[up].copy == CopyDirection::to_device;
      }
    }
  }
  return n;
}

void run_job(const TrainingJob& job, bool ranks) {
  RuntimeSettings rs;
  rs.stall_timeout = 30'000ms;
  if (ranks) {
    for (const auto& r : test::run_on_loopback(job.plan, job.kernels, rs)) REQUIRE_MESSAGE(r.error.empty(), r.error);
  } else {
    Runtime(job.plan, job.kernels, rs).run();
  }
}

Trained result(const TrainingJob& job) {
  Trained out{job.losses->per_step(),
              {},
              count_op(job.plan, "nccl.allreduce"),
              count_op(job.plan, "nccl.send"),
              count_op(job.plan, "nccl.recv"),
              staged_crossings(job.plan)};
  for (auto& [name, t] : job.params->values()) {
    auto d = t.data<float>();
    out.weights[name] = std::vector<float>(d.begin(), d.end());
  }
  return out;
}

std::vector<Placement> places(const Setup& s, DeviceType type) {
  std::vector<Placement> out;
  for (int i = 0; i < s.dp * s.pp * s.tp; ++i) {
    if (s.ranks) {
      out.push_back({.rank = static_cast<std::uint16_t>(i), .device = Device{type, 0}});
    } else {
      out.push_back({.device = Device{type, static_cast<std::uint8_t>(i)}});
    }
  }
  return out;
}

TrainConfig config(const Setup& s, DeviceType type) {
  TrainConfig cfg;
  cfg.steps = 4;
  cfg.microbatches = s.microbatches;
  cfg.dp = s.dp;
  cfg.pp = s.pp;
  cfg.tp = s.tp;
  cfg.schedule = s.schedule;
  cfg.virtual_stages = s.virtual_stages;
  cfg.threads = s.threads;
  cfg.memory_plan = s.memory_plan;
  cfg.optimizer = optim::adam(0.01);
  // The CPU keeps the chains of adds; the sim devices take NCCL's stand-in.
  cfg.collectives = type == DeviceType::sim ? "nccl" : "actors";
  cfg.replica_places = places(s, type);
  return cfg;
}

/// The MLP 12-16-16-4, its hidden pair split Megatron's way (one sum forward, one backward).
Trained train_mlp(const Setup& s, DeviceType type) {
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(256, 12, 4, 99));
  const std::int64_t pieces = s.dp * s.microbatches;
  Graph g(5);
  Value logits =
      models::mlp(g, 32 / pieces, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = s.tp});
  Value loss = softmax_cross_entropy(logits, g.find("label")).named("loss");
  TrainConfig cfg = config(s, type);
  cfg.data = {{"synthetic", data::batch_source(dataset, 32, pieces, 7), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  run_job(job, s.ranks);
  return result(job);
}

struct Gpt {
  Graph g{5};
  Value loss;
  TrainConfig cfg;
  Gpt(const Setup& s, DeviceType type, bool bf16, models::GptShape shape = {.vocab = 16, .seq = 8, .d_model = 16, .heads = 2, .layers = 2}) {
    const std::int64_t batch = 8, pieces = s.dp * s.microbatches;
    shape.tp = s.tp;
    auto corpus = std::make_shared<data::TextCorpus>();
    for (int c = 0; c < 16; ++c) corpus->vocab.push_back(static_cast<unsigned char>('a' + c));
    for (int i = 0; i < 600; ++i) corpus->ids.push_back((i * 5 + i / 11) % 16);
    {
      auto mixed = g.autocast(bf16 ? DType::bf16 : DType::f32);
      loss = models::gpt_with_loss(g, batch / pieces, shape).loss;
    }
    cfg = config(s, type);
    cfg.steps = 3;
    cfg.data = {{"text", data::text_source(corpus, batch, pieces, 8, 3), {"tokens", "targets"}}};
  }
};

/// The same losses and weights, bit for bit.
void check_bits(const Trained& cpu, const Trained& sim) {
  REQUIRE(!cpu.losses.empty());
  CHECK(cpu.losses == sim.losses);
  for (const auto& [name, w] : cpu.weights) {
    CAPTURE(name);
    CHECK(w == sim.weights.at(name));
  }
}

void check_same(const Trained& cpu, const Trained& sim) {
  CHECK(cpu.nccl == 0);
  CHECK(sim.nccl > 0);
  check_bits(cpu, sim);
}

}  // namespace

TEST_CASE("TpCollectives.SimNcclTrainsTheMlpAsTheChainsOfAddsDo" * doctest::timeout(300)) {
  const std::vector<Setup> setups = {
      {},
      {.tp = 4},                                     // three adds in the chain, four members
      {.memory_plan = false},                        // no lanes pass: the pass's own lane
      {.dp = 2, .tp = 1},                            // dp's buckets alone through NCCL
      {.dp = 2},                                     // dp's buckets through NCCL too
      {.pp = 2, .microbatches = 4},                  // 1F1B: the sums in the stages' schedule
      {.pp = 2, .schedule = "gpipe", .microbatches = 4, .threads = 2},
      {.dp = 2, .pp = 2, .tp = 2, .microbatches = 2},  // eight members in four groups
      {.ranks = true},                               // shards on two ranks: no staging through the host
  };
  for (const Setup& s : setups) {
    CAPTURE(s.dp);
    CAPTURE(s.pp);
    CAPTURE(s.tp);
    CAPTURE(s.schedule);
    CAPTURE(s.memory_plan);
    CAPTURE(s.ranks);
    check_same(train_mlp(s, DeviceType::cpu), train_mlp(s, DeviceType::sim));
  }
}

// Every forward sum of the GPT over its shards (attention's and the MLP's, the vocabulary-parallel
// embedding's and loss's) becomes one all-reduce under "nccl" (which refuses to compile
// otherwise), each shard's readers read their own shard's copy, and every member's lane walks
// the calls in one order; trained, the GPT's losses and weights are the CPU's, bit for bit.
TEST_CASE("TpCollectives.EveryGptSumIsOneAllReduceWhoseReadersReadTheirOwnCopy" * doctest::timeout(300)) {
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    Gpt sim({}, DeviceType::sim, bf16);
    TrainingJob job = compile_training(sim.g, sim.loss, sim.cfg);
    const Plan& plan = job.plan;
    for (const ActorDesc& a : plan.actors) {
      CHECK_MESSAGE(!a.attrs.has("tp_sum"), a.name);
    }
    std::map<std::string, std::map<std::int64_t, std::vector<std::pair<std::vector<std::int32_t>, std::int32_t>>>>
        sequence;  // group -> member -> (units, rank) of its calls in plan order
    int members = 0;
    for (const ActorDesc& a : plan.actors) {
      if (a.op != "nccl.allreduce") continue;
      ++members;
      CHECK(a.where.stream == 13);
      CHECK(a.order.lane >= 0);
      sequence[a.attrs.get_string("group", "")][a.attrs.get_int("member", -1)].push_back({a.order.units, a.order.rank});
      for (ActorIndex c : plan.registers[a.outputs[0]].consumers) {
        const ActorDesc& reader = plan.actors[c];
        if (reader.where.device.type == DeviceType::sim) {
          CHECK_MESSAGE(reader.where.device == a.where.device, reader.name, " reads ", a.name);
        }
      }
    }
    // Two members for each of the forward's sums: attention's and the MLP's in each of the two
    // blocks, the vocabulary-parallel embedding's and the loss's statistics. (The backward's
    // sums of the shards' input gradients are autodiff's accumulations onto the shard that
    // reads them, a reduce already: they stay adds.)
    CHECK(members == 2 * (2 * 2 + 2));
    REQUIRE(sequence.size() == 1);
    const auto& [group, by_member] = *sequence.begin();
    CHECK(group == "tp.r0sim:0.r0sim:1");
    REQUIRE(by_member.size() == 2);
    CHECK(by_member.at(0) == by_member.at(1));
    run_job(job, false);
    Gpt cpu({}, DeviceType::cpu, bf16);
    TrainingJob cpu_job = compile_training(cpu.g, cpu.loss, cpu.cfg);
    run_job(cpu_job, false);
    check_same(result(cpu_job), result(job));
  }
}

namespace {

/// Every tensor-parallel sum of the plan is an NCCL all-reduce of one (replica, stage) group: tp
/// consecutive devices from a multiple of tp; and a weight's bf16 cast is made on its readers'
/// device (the stage that reads the weight), not on the stage before, which would send the whole
/// weight across every micro-batch.
void check_groups_within_stages(const Plan& plan, const Setup& s) {
  std::map<std::string, std::set<int>> devices_of_group;
  for (const ActorDesc& a : plan.actors) {
    CHECK_MESSAGE(!a.attrs.has("tp_sum"), a.name);
    if (a.op == "nccl.allreduce" && a.attrs.get_string("group", "").starts_with("tp.")) {
      devices_of_group[a.attrs.get_string("group", "")].insert(a.where.device.index);
    }
    if (a.op != "cast" || a.inputs.size() != 1) continue;
    const ActorIndex w = plan.registers[a.inputs[0].reg].producer;
    if (w >= plan.actors.size() || plan.actors[w].kind != ActorKind::repeat) continue;
    for (ActorIndex c : plan.registers[a.outputs[0]].consumers) {
      CHECK_MESSAGE(plan.actors[c].where.device == a.where.device, a.name, " is read on another device by ",
                    plan.actors[c].name);
    }
  }
  CHECK(devices_of_group.size() == static_cast<std::size_t>(s.dp * s.pp));
  for (const auto& [group, devices] : devices_of_group) {
    CAPTURE(group);
    REQUIRE(devices.size() == static_cast<std::size_t>(s.tp));
    CHECK(*devices.begin() % s.tp == 0);
    CHECK(*devices.rbegin() == *devices.begin() + s.tp - 1);
  }
}

}  // namespace

// Tensor and pipeline parallelism together, the layout of a large job: the stage cut never
// falls inside a tensor-parallel region (between one shard's ops and the next's), so every sum's
// members are one stage's devices. (A cut there made a sum with members on two stages, which
// the pass refused: this GPT at tp 4 x pp 2, tp 2 x pp 4 or tp 2 x pp 2 x dp 2 did not compile
// for GPUs.) Compiled only: the small GPT below trains.
TEST_CASE("TpCollectives.WithPipelineStagesEverySumStaysInItsStagesGroup" * doctest::timeout(300)) {
  const models::GptShape shape{.vocab = 1024, .seq = 64, .d_model = 256, .heads = 8, .layers = 4};
  for (const Setup& s : {Setup{.pp = 2, .tp = 4, .microbatches = 8}, Setup{.pp = 4, .tp = 2, .microbatches = 8},
                         Setup{.dp = 2, .pp = 2, .tp = 2, .microbatches = 4}}) {
    CAPTURE(s.dp);
    CAPTURE(s.pp);
    CAPTURE(s.tp);
    Gpt sim(s, DeviceType::sim, true, shape);
    check_groups_within_stages(compile_training(sim.g, sim.loss, sim.cfg).plan, s);
  }
}

// ... and trained, bit for bit as the CPU does.
TEST_CASE("TpCollectives.WithPipelineStagesTheSumsTrainAsTheChainsDo" * doctest::timeout(300)) {
  for (const Setup& s : {Setup{.pp = 2, .tp = 2, .microbatches = 2}, Setup{.dp = 2, .pp = 2, .tp = 2, .microbatches = 2}}) {
    CAPTURE(s.dp);
    Gpt sim(s, DeviceType::sim, true);
    TrainingJob job = compile_training(sim.g, sim.loss, sim.cfg);
    check_groups_within_stages(job.plan, s);
    run_job(job, false);
    Gpt cpu(s, DeviceType::cpu, true);
    TrainingJob cpu_job = compile_training(cpu.g, cpu.loss, cpu.cfg);
    run_job(cpu_job, false);
    check_bits(result(cpu_job), result(job));
  }
}

// The same plans for GPUs: compiled (nothing runs), the GPT's sums on cuda:0 and cuda:1 become
// NCCL all-reduces under "auto" where baton has NCCL, and stay chains under "actors".
TEST_CASE("TpCollectives.OnCudaDevicesAutoTakesNccl") {
  if (!cuda::built_with_cuda() || !nccl::built_with_nccl()) {
    test::skip(test::Missing::cuda_device, "built without CUDA or NCCL; the CUDA plan is not compiled");
    return;
  }
  for (const char* collectives : {"auto", "actors"}) {
    CAPTURE(collectives);
    Gpt gpt({}, DeviceType::cuda, true);
    gpt.cfg.collectives = collectives;
    TrainingJob job = compile_training(gpt.g, gpt.loss, gpt.cfg);
    const int n = count_op(job.plan, "nccl.allreduce");
    if (std::string(collectives) == "auto") {
      CHECK(n == 2 * (2 * 2 + 2));
    } else {
      CHECK(n == 0);
    }
  }
}

TEST_CASE("TpCollectives.WhatCannotGoThroughNcclIsNamed") {
  Setup s;
  {
    Gpt gpt(s, DeviceType::cpu, false);
    gpt.cfg.collectives = "nccl";
    CHECK(test::contains(test::thrown_message<GraphError>([&] { compile_training(gpt.g, gpt.loss, gpt.cfg); }),
                         "cannot be an NCCL all-reduce: its shards are not all on CUDA devices"));
  }
  {
    Gpt gpt(s, DeviceType::sim, false);
    gpt.cfg.replica_places = {{.device = Device::parse("sim:0")}, {.device = Device::parse("sim:0")}};
    CHECK(test::contains(test::thrown_message<GraphError>([&] { compile_training(gpt.g, gpt.loss, gpt.cfg); }),
                         "shards 0 and 1 are both on rank 0 sim:0 (NCCL needs one GPU per member)"));
  }
  {
    Gpt gpt(s, DeviceType::sim, false);
    gpt.cfg.collectives = "auto";  // sim devices take the stand-in only when asked: chains
    CHECK(count_op(compile_training(gpt.g, gpt.loss, gpt.cfg).plan, "nccl.allreduce") == 0);
  }
}

// What the order is for: two members whose calls come in different orders (member 0 sums a
// then b, member 1 b then a). NCCL would hang, or sum a with b where the sizes matched; the
// sim's stand-in fails the job naming both calls.
TEST_CASE("SimNccl.CallsInDifferentOrdersFailTheJobNamingBoth" * doctest::timeout(120)) {
  Plan plan;
  const std::vector<Placement> at{{.device = Device::parse("sim:0"), .stream = 13},
                                  {.device = Device::parse("sim:1"), .stream = 13}};
  std::map<std::string, std::vector<RegisterIndex>> sums;
  for (const auto& [name, size] : std::vector<std::pair<std::string, std::int64_t>>{{"a", 4}, {"b", 6}}) {
    std::vector<AllReduceMember> members;
    for (std::size_t i = 0; i < at.size(); ++i) {
      auto r = plan.add_register({.name = fmt::format("{}{}", name, i), .shape = {size}, .dtype = DType::f32});
      plan.add_actor({.name = fmt::format("src.{}{}", name, i), .kind = ActorKind::source, .op = "fill_piece",
                      .outputs = {r}, .pieces = 2});
      members.push_back({at[i], r, fmt::format("@{}", i)});
    }
    sums[name] = add_nccl_allreduce(plan, name, members, {size}, DType::f32, 1, "g");
  }
  for (ActorDesc& a : plan.actors) {
    if (a.op != "nccl.allreduce") continue;
    const std::int64_t member = a.attrs.get_int("member", -1);
    const bool first = (a.name.starts_with("a.") == (member == 0));
    a.order = ActOrder{.lane = 100 + static_cast<std::int32_t>(member), .units = {0}, .period = 1, .rank = first ? 0 : 1};
  }
  for (const auto& [name, regs] : sums) {
    for (RegisterIndex r : regs) {
      plan.add_actor({.name = plan.registers[r].name + ".sink", .op = "noop",
                      .where = plan.actors[plan.registers[r].producer].where, .inputs = {{r}}});
    }
  }
  RuntimeSettings s;
  s.stall_timeout = 20'000ms;
  Runtime rt(insert_device_copies(plan), KernelRegistry::with_builtin_kernels(), s);
  const std::string why = test::thrown_message<JobError>([&] { rt.run(); });
  CHECK(test::contains(why, "the members call in different orders"));
  CHECK((test::contains(why, "all-reduce of 4 f32 elements") && test::contains(why, "all-reduce of 6 f32 elements")));
}

// Pipeline registers between GPUs of two ranks (the nccl_p2p pass): on `sim` devices with
// "nccl" every stage boundary moves by the stand-in's send and receive, paced by the host
// tokens, and the job trains as the CPU does over UCX, bit for bit. A receive posted for a
// piece that is not coming, a token of another piece or a send of another size fails the job
// (the stand-in checks each); a send and a receive that never meet stall it.
TEST_CASE("NcclP2p.PipelineRegistersBetweenRanksTrainAsOverUcx" * doctest::timeout(300)) {
  const std::vector<Setup> setups = {
      {.pp = 2, .tp = 1, .microbatches = 4, .ranks = true},
      {.pp = 2, .tp = 1, .schedule = "gpipe", .microbatches = 4, .threads = 2, .ranks = true},
      {.pp = 2, .tp = 1, .microbatches = 4, .memory_plan = false, .ranks = true},
      {.pp = 2, .tp = 1, .schedule = "zb-h1", .microbatches = 4, .ranks = true},
      {.pp = 2, .tp = 1, .schedule = "2bw", .microbatches = 4, .ranks = true},
      {.pp = 2, .tp = 1, .schedule = "interleaved", .microbatches = 4, .ranks = true, .virtual_stages = 2},
      {.dp = 2, .pp = 2, .tp = 1, .microbatches = 2, .ranks = true},  // dp's buckets through NCCL too
      {.pp = 2, .tp = 2, .microbatches = 2, .ranks = true},           // tp's sums too: four ranks
  };
  for (const Setup& s : setups) {
    CAPTURE(s.dp);
    CAPTURE(s.pp);
    CAPTURE(s.tp);
    CAPTURE(s.schedule);
    CAPTURE(s.virtual_stages);
    CAPTURE(s.memory_plan);
    const Trained cpu = train_mlp(s, DeviceType::cpu);
    const Trained sim = train_mlp(s, DeviceType::sim);
    check_bits(cpu, sim);
    // Each boundary carries the activation one way and its gradient the other, each by NCCL:
    // a send and a receive each, nothing staged. (Shards add their own crossings: the unsharded
    // ops' inputs between shards' ranks. The cut falls outside a tensor-parallel region, so a
    // boundary's activation is the shards' sum, sent to each shard of the next stage that reads it.)
    if (s.tp == 1) CHECK(sim.sends == 2 * s.dp * (s.pp * s.virtual_stages - 1));
    CHECK(sim.sends >= 2 * s.dp);
    CHECK(sim.receives == sim.sends);
    CHECK(sim.staged == 0);
    CHECK(cpu.sends == 0);
  }
}

// The GPT in bf16 over two stages on two ranks: its boundary registers by NCCL, the same
// losses and weights as the CPU's.
TEST_CASE("NcclP2p.TheGptsStagesOnTwoRanksTrainAsOverUcx" * doctest::timeout(300)) {
  const Setup s{.pp = 2, .tp = 1, .microbatches = 2, .ranks = true};
  Gpt sim(s, DeviceType::sim, true);
  TrainingJob job = compile_training(sim.g, sim.loss, sim.cfg);
  CHECK(staged_crossings(job.plan) == 0);
  CHECK(count_op(job.plan, "nccl.send") > 0);
  CHECK(count_op(job.plan, "nccl.send") == count_op(job.plan, "nccl.recv"));
  for (const ActorDesc& a : job.plan.actors) {
    if (a.op == "nccl.send") {
      CAPTURE(a.name);
      CHECK(a.where.device.type == DeviceType::sim);
      CHECK((a.where.stream >= 2 && a.where.stream < 12));
      CHECK(a.outputs.empty());
    } else if (a.op == "nccl.recv") {
      CAPTURE(a.name);
      CHECK(a.where.stream == 12);
      CHECK(job.plan.registers[a.inputs[0].reg].dtype == DType::i64);  // the token
    }
  }
  run_job(job, true);
  Gpt cpu(s, DeviceType::cpu, true);
  TrainingJob cpu_job = compile_training(cpu.g, cpu.loss, cpu.cfg);
  run_job(cpu_job, true);
  check_bits(result(cpu_job), result(job));
}

// A rank that fails while its peer's send waits for a receive that will never come: the job
// ends on both ranks with the reason, none hangs. Rank 1's receive of the activation throws at
// its 30th piece (standing in for a rank that dies); rank 0 is aborted with rank 1's reason, as
// the control plane aborts every rank, and its send, blocked on its stream for that receive,
// gives up when the run fails (on GPUs, NCCL's abort and the watchdog do it).
TEST_CASE("NcclP2p.ARankThatFailsEndsTheJobOnBothRanksWithoutAHang" * doctest::timeout(120)) {
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(256, 12, 4, 99));
  const Setup s{.pp = 2, .tp = 1, .microbatches = 4, .ranks = true};
  Graph g(5);
  Value logits = models::mlp(g, 8, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4});
  Value loss = softmax_cross_entropy(logits, g.find("label")).named("loss");
  TrainConfig cfg = config(s, DeviceType::sim);
  cfg.steps = 50;  // 200 pieces: far more than the failure lets through
  cfg.data = {{"synthetic", data::batch_source(dataset, 32, 4, 7), {"x", "label"}}};
  TrainingJob job = compile_training(g, loss, cfg);
  // The receive on rank 1 (the activation's, from rank 0) fails at piece 30.
  class FailAt final : public Kernel {
   public:
    explicit FailAt(std::unique_ptr<Kernel> inner) : inner_(std::move(inner)) {}
    void compute(KernelContext& ctx) override {
      if (ctx.piece == 30) throw std::runtime_error("injected failure at piece 30");
      inner_->compute(ctx);
    }

   private:
    std::unique_ptr<Kernel> inner_;
  };
  const KernelRegistry builtin = job.kernels;
  job.kernels.add("nccl.recv.failing", DeviceType::sim, DType::f32, [builtin](const KernelConfig& kc) {
    return std::unique_ptr<Kernel>(std::make_unique<FailAt>(builtin.create("nccl.recv", kc)));
  });
  int changed = 0;
  for (ActorDesc& a : job.plan.actors) {
    if (a.op == "nccl.recv" && a.where.rank == 1 && changed++ == 0) a.op = "nccl.recv.failing";
  }
  REQUIRE(changed >= 1);
  RuntimeSettings rs;
  rs.stall_timeout = 60'000ms;
  const auto started = std::chrono::steady_clock::now();
  const auto results = test::run_on_loopback(job.plan, job.kernels, rs);
  CHECK(std::chrono::steady_clock::now() - started < 60s);
  REQUIRE(results.size() == 2);
  CHECK(test::contains(results[1].error, "injected failure at piece 30"));
  CHECK(test::contains(results[0].error, "injected failure at piece 30"));  // the reason, on rank 0 too
}

// "auto" leaves sim devices staged (the stand-in only when asked); on CUDA devices of two ranks
// it takes NCCL where baton has it (compiled only: nothing runs), and "actors" never does.
TEST_CASE("NcclP2p.AutoTakesNcclBetweenCudaDevicesOnly") {
  const Setup s{.pp = 2, .tp = 1, .microbatches = 2, .ranks = true};
  {
    Gpt sim(s, DeviceType::sim, true);
    sim.cfg.collectives = "auto";
    const TrainingJob job = compile_training(sim.g, sim.loss, sim.cfg);
    CHECK(count_op(job.plan, "nccl.send") == 0);
    CHECK(staged_crossings(job.plan) > 0);
  }
  if (!cuda::built_with_cuda() || !nccl::built_with_nccl()) {
    test::skip(test::Missing::cuda_device, "built without CUDA or NCCL; the CUDA plan is not compiled");
    return;
  }
  for (const char* collectives : {"auto", "actors"}) {
    CAPTURE(collectives);
    Gpt gpu(s, DeviceType::cuda, true);
    gpu.cfg.collectives = collectives;
    const TrainingJob job = compile_training(gpu.g, gpu.loss, gpu.cfg);
    const bool nccl = std::string(collectives) == "auto";
    CHECK((count_op(job.plan, "nccl.send") > 0) == nccl);
    CHECK((staged_crossings(job.plan) == 0) == nccl);
  }
}

// The stand-in's checks: a receive of another size than its send fails the job naming both
// sides (NCCL would truncate, or hang).
TEST_CASE("SimNccl.ASendAndAReceiveOfOtherSizesFailTheJob" * doctest::timeout(120)) {
  Plan plan;
  const auto r = plan.add_register({.name = "r", .shape = {4}, .dtype = DType::f32});
  plan.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece",
                  .where = {.device = Device::parse("sim:0")}, .outputs = {r}, .pieces = 2});
  const Attrs attrs{{"group", "p"}, {"ranks", std::vector<std::int64_t>{0, 0}}, {"devices", std::vector<std::int64_t>{0, 1}}};
  ActorDesc send{.name = "send", .op = "nccl.send", .where = {.device = Device::parse("sim:0"), .stream = 2},
                 .inputs = {{r}}, .attrs = attrs};
  send.attrs.set("member", std::int64_t{0});
  plan.add_actor(send);
  const auto token = plan.add_register({.name = "token", .shape = {1}, .dtype = DType::i64});
  plan.add_actor({.name = "token", .op = "p2p.token", .dtype = DType::i64, .inputs = {{r}}, .outputs = {token}});
  const auto got = plan.add_register({.name = "got", .shape = {6}, .dtype = DType::f32});
  ActorDesc recv{.name = "recv", .op = "nccl.recv", .where = {.device = Device::parse("sim:1"), .stream = 12},
                 .inputs = {{token}}, .outputs = {got}, .attrs = attrs};
  recv.attrs.set("member", std::int64_t{1});
  plan.add_actor(recv);
  plan.add_actor({.name = "sink", .op = "noop", .where = {.device = Device::parse("sim:1")}, .inputs = {{got}}});
  RuntimeSettings rs;
  rs.stall_timeout = 20'000ms;
  Runtime rt(plan, KernelRegistry::with_builtin_kernels(), rs);
  const std::string why = test::thrown_message<JobError>([&] { rt.run(); });
  CHECK(test::contains(why, "the two sides disagree on what crosses"));
  CHECK((test::contains(why, "4 f32 elements") && test::contains(why, "6 f32 elements")));
}
