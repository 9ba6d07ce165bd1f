// Training with compute on a CUDA device (TrainConfig::replica_places on cuda:N, baton-train
// --devices cuda:K): the compiled plan's shape, checked everywhere (compiling needs no GPU),
// and the training itself against the CPU, where there is a GPU.
//
// Without a GPU the training tests print "<reason>; CUDA tests skipped" and return; CTest
// reports them as skipped (tests/CMakeLists.txt).
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels.h"
#include "baton/kernels/data.h"
#include "baton/kernels/nccl.h"
#include "models.h"

#include "test_util.h"

using namespace baton;
using test::cuda_usable;
using test::count_op;

namespace {

const Device cuda0 = Device::parse("cuda:0");
const Device cpu0 = Device::parse("cpu:0");

struct Digits {
  std::shared_ptr<const data::Dataset> train;
  Digits() {
    auto [t, held] = data::split(data::load_digits(data::find_digits_file()), 0.2, 1);
    train = std::make_shared<const data::Dataset>(std::move(t));
  }
};

/// The digits MLP (64-32-32-10) with its loss, and a config training it for `steps` steps of
/// two micro-batches of 32 on `where` (empty: the CPU).
struct MlpJob {
  Graph g{7};
  Value loss;
  TrainConfig cfg;
  /// `bf16`: the model under autocast (bf16 products, f32 weights).
  MlpJob(const Digits& d, std::vector<Placement> where, OptimizerConfig opt, std::int64_t steps = 3,
         bool bf16 = false) {
    auto build = [&] {
      models::MlpShape shape{.inputs = 64, .hidden = 32, .layers = 2, .classes = 10};
      Value logits = models::mlp(g, 32, shape);
      loss = softmax_cross_entropy(logits, g.find("label")).named("loss");
    };
    if (bf16) {
      auto bf = g.autocast();
      build();
    } else {
      build();
    }
    cfg.steps = steps;
    cfg.microbatches = 2;
    cfg.optimizer = opt;
    cfg.threads = 2;
    cfg.replica_places = std::move(where);
    cfg.data = {{"digits", data::batch_source(d.train, 64, 2, 3), {"x", "label"}}};
  }
};

const ActorDesc& actor_named(const Plan& p, const std::string& name) {
  for (const ActorDesc& a : p.actors) {
    if (a.name == name) return a;
  }
  FAIL("no actor named " << name);
  return p.actors.front();
}

}  // namespace

TEST_CASE("CudaTraining.PlanComputesOnTheDeviceAndFeedsItFromTheHost") {
  if (!test::cuda_built()) return;  // compiling refuses CUDA actors without CUDA kernels
  Digits d;
  OptimizerConfig opt = optim::adam(1e-3);
  opt.clip_norm = 1.0;
  MlpJob job(d, {Placement{.device = cuda0}}, opt);
  TrainingJob t = compile_training(job.g, job.loss, job.cfg);
  std::set<std::string> copies;
  for (const ActorDesc& a : t.plan.actors) {
    CAPTURE(a.name);
    if (a.op == "to_device" || a.op == "to_host") {
      copies.insert(a.name);
      CHECK(a.where.stream == device_copy_stream);
      // A copy runs on the CUDA side: to_device on the consumer's device, to_host on the producer's.
      CHECK(a.where.device == cuda0);
    } else if (a.role == ActorRole::forward || a.role == ActorRole::backward || a.op.starts_with("variable.") ||
               a.kind == ActorKind::repeat) {
      if (a.op != "loss.report") CHECK(a.where.device == cuda0);
    }
  }
  // The host side: data, the loss report, the clipping factor.
  CHECK(actor_named(t.plan, "data.digits").where.device == cpu0);
  CHECK(actor_named(t.plan, "loss.report").where.device == cpu0);
  CHECK(actor_named(t.plan, "optim.clip").where.device == cpu0);
  // Data goes down (features, labels), the loss comes up; every summed gradient comes up for the
  // global norm, and the factor goes down to each variable.
  CHECK(copies.count("x@cuda:0") == 1);
  CHECK(copies.count("label@cuda:0") == 1);
  CHECK(copies.count("loss@cpu:0") == 1);
  CHECK(copies.count("grad.fc0.w@cpu:0") == 1);
  CHECK(copies.count("clip.factor@cuda:0") == 1);
  // Weights never leave the device during the job: no copy of a weight or its step value.
  for (const std::string& c : copies) {
    CAPTURE(c);
    CHECK(c.find(".step") == std::string::npos);
  }
  // The same plan whatever the machine: validation passes, and compiling twice gives the same.
  CHECK_NOTHROW(validate(t.plan, t.kernels));
  MlpJob again(d, {Placement{.device = cuda0}}, opt);
  CHECK(compile_training(again.g, again.loss, again.cfg).plan.hash() == t.plan.hash());
}

TEST_CASE("CudaTraining.MixedPlacementsCopyOnlyAtTheBoundary") {
  if (!test::cuda_built()) return;  // compiling refuses CUDA actors without CUDA kernels
  // A CPU first stage and a CUDA second one: one copy per register crossing between them.
  Digits d;
  MlpJob job(d, {Placement{.device = cpu0}, Placement{.device = cuda0}}, optim::sgd(0.1));
  job.cfg.pp = 2;
  TrainingJob t = compile_training(job.g, job.loss, job.cfg);
  int down = 0, up = 0;
  for (const ActorDesc& a : t.plan.actors) {
    down += a.op == "to_device";
    up += a.op == "to_host";
  }
  // Down: the activation into stage 1 and the labels; up: the gradient back into stage 0 and
  // the loss (reported on the host).
  CHECK(down >= 2);
  CHECK(up >= 2);
  CHECK(actor_named(t.plan, "data.digits").where.device == cpu0);
  CHECK(actor_named(t.plan, "variable.fc0.w").where.device == cpu0);
  // The CUDA stage's weights are stepped together (the updates pass), the CPU's each by its own.
  const ActorDesc& cuda_weights = actor_named(t.plan, "variables.r0.cuda:0");
  CHECK(cuda_weights.where.device == cuda0);
  std::vector<std::string> stepped;
  for (RegisterIndex r : cuda_weights.outputs) stepped.push_back(t.plan.registers[r].name);
  CHECK(stepped.size() >= 2);  // the second stage's weights and biases
  CHECK(std::find(stepped.begin(), stepped.end(), "out.w.step") != stepped.end());
}

TEST_CASE("CudaTraining.WhatCrossesRanksGoesThroughHostMemory") {
  if (!test::cuda_built()) return;  // compiling refuses CUDA actors without CUDA kernels
  // Two pipeline stages on two ranks, each on its rank's cuda:0 (one GPU can hold both, host-
  // staged; NCCL refuses two ranks on one GPU, so "actors").
  Digits d;
  MlpJob job(d, {Placement{.rank = 0, .device = cuda0}, Placement{.rank = 1, .device = cuda0}}, optim::sgd(0.1));
  job.cfg.pp = 2;
  job.cfg.collectives = "actors";
  const Plan plan = insert_transfers(compile_training(job.g, job.loss, job.cfg).plan);
  int transfers = 0;
  for (const RegisterDesc& reg : plan.registers) {
    const ActorDesc& p = plan.actors[reg.producer];
    for (ActorIndex c : reg.consumers) {
      const ActorDesc& a = plan.actors[c];
      CAPTURE(reg.name);
      CAPTURE(a.name);
      if (a.where.rank != p.where.rank) {
        // UCX moves host memory: a transfer on the consumer's host reads a host register.
        ++transfers;
        CHECK(a.kind == ActorKind::transfer);
        CHECK(a.where.device.type == DeviceType::cpu);
        CHECK((p.where.device.type == DeviceType::cpu || p.op == "to_host"));
      } else if ((a.where.device.type == DeviceType::cuda) != (p.where.device.type == DeviceType::cuda)) {
        // Host and device meet only through a copy actor.
        CHECK((a.op == "to_device" || p.op == "to_host"));
      }
    }
  }
  CHECK(transfers >= 3);  // the activation, its gradient, the labels to the last stage and the loss back
  CHECK(insert_device_copies(plan) == plan);  // nothing more to do
}

TEST_CASE("CudaTraining.PipelineRegistersBetweenRanksGoByNccl") {
  if (!test::cuda_built() || !nccl::built_with_nccl()) {
    test::skip(test::Missing::cuda_device, "built without CUDA or NCCL; the CUDA plan is not compiled");
    return;
  }
  // The same two stages under "auto": the activation and its gradient go GPU to GPU by NCCL
  // (the nccl_p2p pass), each paced by a host token; the labels and the loss, which are host
  // registers, still go by UCX.
  Digits d;
  MlpJob job(d, {Placement{.rank = 0, .device = cuda0}, Placement{.rank = 1, .device = cuda0}}, optim::sgd(0.1));
  job.cfg.pp = 2;
  const Plan plan = compile_training(job.g, job.loss, job.cfg).plan;
  std::set<std::string> sent;
  int receives = 0;
  for (const ActorDesc& a : plan.actors) {
    if (a.op == "nccl.send") {
      sent.insert(a.name.substr(0, a.name.find(".send@")));
      CHECK(a.where.device == cuda0);
    }
    receives += a.op == "nccl.recv";
    CAPTURE(a.name);
    if (a.kind == ActorKind::transfer) CHECK(a.where.device.type == DeviceType::cpu);  // tokens and host data only
  }
  CHECK(sent.size() == 2);
  CHECK(receives == 2);
  // Host copies are left for host readers only (the loss report, the final weights), none on
  // its way to another rank's GPU.
  for (const ActorDesc& a : plan.actors) {
    if (a.op != "to_host") continue;
    for (ActorIndex t : plan.registers[a.outputs[0]].consumers) {
      if (plan.actors[t].kind != ActorKind::transfer) continue;
      for (ActorIndex up : plan.registers[plan.actors[t].outputs[0]].consumers) {
        CAPTURE(plan.actors[up].name);
        CHECK(plan.actors[up].op != "to_device");
      }
    }
  }
}

TEST_CASE("CudaTraining.DataParallelGradientsGoThroughNcclInOneOrder") {
  Digits d;
  auto compiled = [&](const std::string& collectives, Device device) {
    MlpJob job(d, {Placement{.rank = 0, .device = device}, Placement{.rank = 1, .device = device}}, optim::sgd(0.1));
    job.cfg.dp = 2;
    job.cfg.bucket_bytes = 0;  // a bucket per weight: several NCCL calls a step
    job.cfg.collectives = collectives;
    return compile_training(job.g, job.loss, job.cfg).plan;
  };
  if (!nccl::built_with_nccl()) {
    CHECK_THROWS_WITH_AS(compiled("nccl", cuda0), doctest::Contains("built without NCCL"), GraphError);
    return;
  }
  const Plan plan = compiled("auto", cuda0);
  std::map<std::uint16_t, std::vector<std::pair<std::int32_t, std::string>>> order;  // rank -> (key, weight)
  for (const ActorDesc& a : plan.actors) {
    if (a.name.starts_with("grad.")) CHECK_FALSE(a.op.starts_with("allreduce."));  // no ring (the loss keeps one)
    if (a.op != "nccl.allreduce") continue;
    CHECK(a.where.device == cuda0);
    CHECK(a.where.stream == 14);
    CHECK(a.role == ActorRole::collective);
    CHECK(a.order.lane >= 0);
    order[a.where.rank].push_back({a.order.rank, a.name.substr(0, a.name.find('@'))});
  }
  REQUIRE(order.size() == 2);
  // Six weights, six buckets, called in the same order on both ranks.
  for (auto& [rank, calls] : order) std::sort(calls.begin(), calls.end());
  CHECK(order[0].size() == 6);
  CHECK(order[0] == order[1]);
  // Actors on request; NCCL refused where a replica is not on a CUDA device.
  for (const ActorDesc& a : compiled("actors", cuda0).actors) CHECK(a.op != "nccl.allreduce");
  for (const ActorDesc& a : compiled("auto", cpu0).actors) CHECK(a.op != "nccl.allreduce");
  CHECK_THROWS_WITH_AS(compiled("nccl", cpu0), doctest::Contains("needs every replica on a CUDA device"), GraphError);
  CHECK_THROWS_WITH_AS(compiled("gloo", cuda0), doctest::Contains("collectives 'gloo': auto, actors or nccl"),
                       GraphError);
}

TEST_CASE("CudaTraining.RefusesWhatItCannotRunWithAReason") {
  Digits d;
  SUBCASE("a float64 weight") {
    Graph g(1);
    Value x = g.input("x", {4, 3}, f64);
    Value w = g.variable("w", {3, 2}, init::normal(0, 0.1), f64);
    Value loss = mean(matmul(x, w) * matmul(x, w));
    TrainConfig cfg;
    cfg.replica_places = {Placement{.device = cuda0}};
    cfg.data = {{"x", [](const KernelConfig&) -> std::unique_ptr<Kernel> { return nullptr; }, {"x"}}};
    CHECK_THROWS_WITH_AS(compile_training(g, loss, cfg), doctest::Contains("must be f32"), GraphError);
  }
}

TEST_CASE("CudaTraining.MlpTrainsAsOnTheCpu" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  Digits d;
  for (OptimizerConfig opt : {optim::sgd(0.05, 0.9), optim::adamw(1e-3)}) {
    opt.clip_norm = 0.5;  // clipped on some steps
    CAPTURE(name(opt.kind));
    MlpJob cpu(d, {}, opt, 30), gpu(d, {Placement{.device = cuda0}}, opt, 30);
    TrainingJob a = compile_training(cpu.g, cpu.loss, cpu.cfg);
    TrainingJob b = compile_training(gpu.g, gpu.loss, gpu.cfg);
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(30'000);
    Runtime(a.plan, a.kernels, rs).run();
    Runtime(b.plan, b.kernels, rs).run();
    auto la = a.losses->per_step(), lb = b.losses->per_step();
    REQUIRE(la.size() == 30);
    REQUIRE(lb.size() == 30);
    // cuBLAS sums a matrix product in another order than OpenBLAS: close, not equal, and the
    // difference may grow a little over the steps. 1e-4 is test::Reordering's bound for the
    // AdamW run (tests/equivalence.h: 30 steps x lr 1e-3 x n 64 x C 1000 x u 6e-8 = 1.2e-4);
    // for SGD(0.05, 0.9) that bound is 50 times larger, and 1e-4 is what the H100 runs met: a
    // claim only a GPU run can check (docs/gpu.md).
    for (std::size_t i = 0; i < la.size(); ++i) {
      CAPTURE(i);
      CHECK(std::abs(la[i] - lb[i]) <= 1e-4 * std::max(1.0, std::abs(la[i])));
    }
    CHECK(lb.back() < lb.front());
    // The trained weights came back into the ParameterStore.
    for (const auto& [w, value] : a.params->values()) {
      CAPTURE(w);
      std::span<const float> x = value.data<float>(), y = b.params->at(w).data<float>();
      double worst = 0, scale = 1e-3;
      for (std::size_t i = 0; i < x.size(); ++i) {
        worst = std::max(worst, static_cast<double>(std::abs(x[i] - y[i])));
        scale = std::max(scale, static_cast<double>(std::abs(x[i])));
      }
      CHECK(worst <= 1e-4 * scale);
    }
  }
}

// The updates pass on a GPU: a device's weights stepped by one multi-tensor launch
// (CudaVariableGroup) against one actor and launch per weight, the same kernels elsewhere.
// cuBLAS gives the same bits for the same products on the same GPU in one process, and the
// multi-tensor step each element's arithmetic of the one-tensor step (with the clipping factor
// applied as cuda::scale applies it): losses and weights equal, bit for bit. SGD with momentum
// and AdamW, clipped on some steps, in f32 and with bf16 autocast (the group then writes each
// weight's bf16 copy for its products).
TEST_CASE("CudaTraining.ADevicesWeightsStepTogetherAsEachOnItsOwn" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  Digits d;
  for (OptimizerConfig opt : {optim::sgd(0.05, 0.9), optim::adamw(1e-3)}) {
    for (const char* precision : {"f32", "bf16"}) {
      opt.clip_norm = 0.5;
      CAPTURE(name(opt.kind));
      CAPTURE(precision);
      const bool bf16 = std::string(precision) == "bf16";
      MlpJob grouped(d, {Placement{.device = cuda0}}, opt, 12, bf16), apart(d, {Placement{.device = cuda0}}, opt, 12, bf16);
      apart.cfg.multi_tensor_updates = false;
      TrainingJob a = compile_training(grouped.g, grouped.loss, grouped.cfg);
      TrainingJob b = compile_training(apart.g, apart.loss, apart.cfg);
      CHECK(count_op(a.plan, "variables.r0.cuda:0") == 1);
      CHECK(count_op(b.plan, "variables.r0.cuda:0") == 0);
      RuntimeSettings rs;
      rs.stall_timeout = std::chrono::milliseconds(30'000);
      Runtime(a.plan, a.kernels, rs).run();
      Runtime(b.plan, b.kernels, rs).run();
      CHECK(a.losses->per_step() == b.losses->per_step());
      for (const auto& [w, value] : a.params->values()) {
        CAPTURE(w);
        std::span<const float> x = value.data<float>(), y = b.params->at(w).data<float>();
        CHECK(std::equal(x.begin(), x.end(), y.begin(), y.end()));
      }
    }
  }
}

// The segments pass on the GPU: each run of forward and backward ops one actor, its act captured
// into a CUDA graph at the second sight of its slots and launched as one from then on. The same
// kernels on the same memory: losses and weights equal one actor per op's, bit for bit, in f32
// and with bf16 autocast (cuBLASLt's epilogues, the casts, cross-entropy's scratch); and every
// segment captured (none refused: a kernel that synchronised or allocated during the capture
// would show here, with its reason on stderr).
TEST_CASE("CudaTraining.SegmentsAsCudaGraphsTrainAsOneActorPerOp" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  Digits d;
  for (const char* precision : {"f32", "bf16"}) {
    CAPTURE(precision);
    const bool bf16 = std::string(precision) == "bf16";
    OptimizerConfig opt = optim::adamw(1e-3);
    opt.clip_norm = 0.5;
    MlpJob graphs(d, {Placement{.device = cuda0}}, opt, 12, bf16), apart(d, {Placement{.device = cuda0}}, opt, 12, bf16);
    apart.cfg.cuda_graphs = false;
    TrainingJob a = compile_training(graphs.g, graphs.loss, graphs.cfg);
    TrainingJob b = compile_training(apart.g, apart.loss, apart.cfg);
    int segments = 0;
    for (const ActorDesc& x : a.plan.actors) segments += x.name.starts_with("segment.");
    CHECK(segments >= 2);  // the forward pass and the backward pass at least
    CHECK(a.plan.actors.size() < b.plan.actors.size());
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(30'000);
    const passes::SegmentGraphs before = passes::segment_graphs();
    Runtime(a.plan, a.kernels, rs).run();
    const passes::SegmentGraphs after = passes::segment_graphs();
    Runtime(b.plan, b.kernels, rs).run();
    CHECK(after.captured - before.captured >= segments);
    CHECK(after.launched - before.launched > after.captured - before.captured);
    CHECK(after.refused == before.refused);
    CHECK(a.losses->per_step() == b.losses->per_step());
    for (const auto& [w, value] : a.params->values()) {
      CAPTURE(w);
      std::span<const float> x = value.data<float>(), y = b.params->at(w).data<float>();
      CHECK(std::equal(x.begin(), x.end(), y.begin(), y.end()));
    }
  }
}

namespace {

Tensor random_bf16(const Shape& s, std::mt19937& rng) {
  Tensor t = Tensor::empty(s, DType::bf16);
  std::uniform_real_distribution<float> d(-2.f, 2.f);
  for (bfloat16& x : t.data<bfloat16>()) x = to_bf16(d(rng));
  return t;
}

/// An f32 copy of a bf16 tensor (exact).
Tensor widened(const Tensor& t) {
  Tensor f = Tensor::empty(t.shape(), DType::f32);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    f.data<float>()[static_cast<std::size_t>(i)] = to_float(t.data<bfloat16>()[static_cast<std::size_t>(i)]);
  return f;
}

/// Runs `op` in bf16 on the CPU and on cuda:0 on the same inputs (the device's outputs poisoned
/// first) and returns the largest difference over the largest CPU magnitude, per output.
std::vector<double> bf16_difference(const std::string& op, const Attrs& attrs, const std::vector<Tensor>& inputs,
                                    const std::vector<std::pair<Shape, DType>>& outputs) {
  auto reg = KernelRegistry::with_builtin_kernels();
  auto stream = cuda::Stream::create(cuda0, "bf16-test");
  auto memory = cuda::make_device_allocator(cuda0);
  std::vector<Tensor> host_out, dev_in, dev_out, back;
  for (const auto& [shape, dt] : outputs) host_out.push_back(Tensor::empty(shape, dt));
  for (const Tensor& t : inputs) {
    dev_in.push_back(Tensor::empty(t.shape(), t.dtype(), *memory));
    cuda::copy(dev_in.back(), t, *stream);
  }
  for (const auto& [shape, dt] : outputs) {
    Tensor poison = Tensor::empty(shape, dt);
    std::memset(poison.raw(), 0xff, poison.nbytes());
    dev_out.push_back(Tensor::empty(shape, dt, *memory));
    cuda::copy(dev_out.back(), poison, *stream);
  }
  auto pointers = [](std::vector<Tensor>& v) {
    std::vector<Tensor*> p;
    for (Tensor& t : v) p.push_back(&t);
    return p;
  };
  auto const_pointers = [](const std::vector<Tensor>& v) {
    std::vector<const Tensor*> p;
    for (const Tensor& t : v) p.push_back(&t);
    return p;
  };
  auto cpu = reg.create(op, KernelConfig{op, Device{}, DType::bf16, attrs});
  auto gpu = reg.create(op, KernelConfig{op, cuda0, DType::bf16, attrs});
  auto ci = const_pointers(inputs);
  auto co = pointers(host_out);
  KernelContext cc{ci, co, 0};
  cpu->compute(cc);
  auto gi = const_pointers(dev_in);
  auto go = pointers(dev_out);
  KernelContext gc{gi, go, 0, stream.get()};
  gpu->compute(gc);
  std::vector<double> worst;
  for (std::size_t k = 0; k < outputs.size(); ++k) {
    Tensor h = Tensor::empty(dev_out[k].shape(), dev_out[k].dtype());
    cuda::copy(h, dev_out[k], *stream);
    stream->synchronize();
    double diff = 0, scale = 1e-6;
    for (std::int64_t i = 0; i < h.numel(); ++i) {
      auto value = [&](const Tensor& t) {
        return t.dtype() == DType::bf16 ? static_cast<double>(to_float(t.data<bfloat16>()[static_cast<std::size_t>(i)]))
                                        : static_cast<double>(t.data<float>()[static_cast<std::size_t>(i)]);
      };
      const double want = value(host_out[k]), got = value(h);
      diff = std::isnan(got) ? INFINITY : std::max(diff, std::abs(want - got));
      scale = std::max(scale, std::abs(want));
    }
    worst.push_back(diff / scale);
  }
  return worst;
}

}  // namespace

TEST_CASE("CudaTraining.Bf16KernelsMatchTheCpu" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  std::mt19937 rng(std::random_device{}());
  struct Case {
    std::string op;
    Attrs attrs;
    std::vector<Tensor> inputs;
    std::vector<std::pair<Shape, DType>> outputs;
  };
  Tensor labels = Tensor::empty({33}, DType::i32);
  for (int i = 0; i < 33; ++i) labels.data<std::int32_t>()[static_cast<std::size_t>(i)] = (i * 7) % 50;
  std::vector<Case> cases{
      // The tensor-core product (cublasGemmEx), every transpose, batched and shared b.
      {"matmul", Attrs{{"trans_a", std::int64_t{0}}, {"trans_b", std::int64_t{0}}},
       {random_bf16({37, 64}, rng), random_bf16({64, 29}, rng)}, {{{37, 29}, DType::bf16}}},
      {"matmul", Attrs{{"trans_a", std::int64_t{1}}, {"trans_b", std::int64_t{1}}},
       {random_bf16({64, 37}, rng), random_bf16({29, 64}, rng)}, {{{37, 29}, DType::bf16}}},
      {"matmul", Attrs{{"trans_a", std::int64_t{0}}, {"trans_b", std::int64_t{1}}},
       {random_bf16({3, 17, 40}, rng), random_bf16({3, 23, 40}, rng)}, {{{3, 17, 23}, DType::bf16}}},
      {"matmul", Attrs{{"trans_a", std::int64_t{0}}, {"trans_b", std::int64_t{0}}},
       {random_bf16({4, 9, 40}, rng), random_bf16({40, 11}, rng)}, {{{4, 9, 11}, DType::bf16}}},
      // A Linear layer's weight and bias gradients in one cuBLASLt product (or apart where it
      // refuses the shape).
      {"matmul_bias_grad", {}, {random_bf16({4, 32, 64}, rng), random_bf16({4, 32, 96}, rng)},
       {{{64, 96}, DType::bf16}, {{96}, DType::bf16}}},
      {"matmul_bias_grad", {}, {random_bf16({37, 24}, rng), random_bf16({37, 40}, rng)},
       {{{24, 40}, DType::bf16}, {{40}, DType::bf16}}},
      // A Linear layer's forward in one cuBLASLt product with the bias epilogue (or apart): bf16
      // throughout, and bf16 operands with an f32 bias and result (autocast's widened product).
      // The GPU adds the bias before rounding the product, the CPU after (the unfused ops'
      // arithmetic): one bf16 rounding apart at most, well inside the bound below.
      {"matmul_bias", Attrs{{"trans_b", std::int64_t{0}}},
       {random_bf16({4, 32, 64}, rng), random_bf16({64, 96}, rng), random_bf16({96}, rng)},
       {{{4, 32, 96}, DType::bf16}}},
      {"matmul_bias", Attrs{{"trans_b", std::int64_t{1}}},
       {random_bf16({37, 24}, rng), random_bf16({40, 24}, rng), widened(random_bf16({40}, rng))},
       {{{37, 40}, DType::f32}}},
      {"matmul_bias", Attrs{{"trans_b", std::int64_t{0}}},
       {random_bf16({2, 16, 64}, rng), random_bf16({64, 48}, rng), widened(random_bf16({48}, rng))},
       {{{2, 16, 48}, DType::f32}}},
      // The MLP's first product with its bias and GELU's tanh form (GELU_AUX_BIAS), and its
      // pre-activation; n = 29 is not a multiple of 8, so that one runs apart.
      {"matmul_bias_gelu", Attrs{{"trans_b", std::int64_t{0}}, {"approximate", std::string("tanh")}},
       {random_bf16({4, 32, 64}, rng), random_bf16({64, 96}, rng), random_bf16({96}, rng)},
       {{{4, 32, 96}, DType::bf16}, {{4, 32, 96}, DType::bf16}}},
      {"matmul_bias_gelu", Attrs{{"trans_b", std::int64_t{0}}, {"approximate", std::string("tanh")}},
       {random_bf16({37, 24}, rng), random_bf16({24, 29}, rng), random_bf16({29}, rng)},
       {{{37, 29}, DType::bf16}, {{37, 29}, DType::bf16}}},
      // Its backward: the next product's data gradient times gelu'(pre), and b's gradient.
      {"matmul_dgelu_bgrad", Attrs{{"trans_b", std::int64_t{1}}, {"approximate", std::string("tanh")}},
       {random_bf16({4, 32, 64}, rng), random_bf16({96, 64}, rng), random_bf16({4, 32, 96}, rng)},
       {{{4, 32, 96}, DType::bf16}, {{96}, DType::bf16}}},
      // Ops without a bf16 kernel of their own: the float32 one on device copies.
      {"gelu", {}, {random_bf16({1000, 3}, rng)}, {{{1000, 3}, DType::bf16}}},
      {"add", {}, {random_bf16({31, 8}, rng), random_bf16({8}, rng)}, {{{31, 8}, DType::bf16}}},
      {"layer_norm", Attrs{{"eps", 1e-5}}, {random_bf16({33, 50}, rng)}, {{{33, 50}, DType::bf16}}},
      {"softmax_cross_entropy", {}, {random_bf16({33, 50}, rng), labels}, {{{}, DType::bf16}}},
      {"cast", {}, {random_bf16({513}, rng)}, {{{513}, DType::f32}}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.op);
    CAPTURE(c.inputs[0].describe());
    // bf16 keeps 8 bits: one rounding is 2^-9 = 2e-3 relative, and the CPU and GPU kernels may
    // round an intermediate (a product's sum in float32, then to bf16) once each in another
    // place: 1e-2, a few bf16 roundings.
    for (double e : bf16_difference(c.op, c.attrs, c.inputs, c.outputs)) CHECK(e <= 1e-2);
  }
}

TEST_CASE("CudaTraining.MlpTrainsInBf16AsOnTheCpu" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  Digits d;
  auto run = [&](std::vector<Placement> where) {
    MlpJob job(d, {}, optim::adam(1e-3), 1);
    Graph g(7);
    {
      auto bf = g.autocast();
      Value logits = models::mlp(g, 32, {.inputs = 64, .hidden = 32, .layers = 2, .classes = 10});
      job.loss = softmax_cross_entropy(logits, g.find("label")).named("loss");
    }
    job.cfg.steps = 40;
    job.cfg.replica_places = std::move(where);
    TrainingJob t = compile_training(g, job.loss, job.cfg);
    RuntimeSettings rs;
    rs.stall_timeout = std::chrono::milliseconds(30'000);
    Runtime(t.plan, t.kernels, rs).run();
    return t.losses->per_step();
  };
  const auto cpu = run({}), gpu = run({Placement{.device = cuda0}});
  REQUIRE(cpu.size() == 40);
  REQUIRE(gpu.size() == 40);
  // bf16 rounds differently where cuBLAS sums in another order: close, not equal. 2e-2: a few
  // bf16 roundings (2^-9 = 2e-3 each) of the loss, a mean over the batch.
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(cpu[i] - gpu[i]) <= 2e-2 * std::max(1.0, cpu[i]));
  }
  // It learns: 40 Adam steps at lr 1e-3 take the loss from 2.29 to 2.12 on both devices (the
  // CPU's figure, measured; the first run on an H100 gave the same). The claim that matters is
  // the per-step agreement above; this one only says the steps were not all zero.
  CHECK(gpu.back() < 0.95 * gpu.front());
}
