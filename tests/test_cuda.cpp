// The CUDA path against the CPU: every CUDA kernel on fresh random inputs, its outputs poisoned
// (NaN) before each run, against the CPU kernel of the same op (float32 relative error <= 1e-5,
// measured against the largest CPU value); the optimizer steps; and plans that cross between
// host and device through the copy actors, in threaded and deterministic mode.
//
// Where there is no GPU (or no CUDA in the build) each test prints "<reason>; CUDA tests
// skipped" and returns; CTest reports such a run as skipped (tests/CMakeLists.txt).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/kernels.h"
#include "baton/kernels/optim.h"

using namespace baton;

namespace {

bool cuda_usable() {
  const auto& a = cuda::availability();
  if (!a.ok) {
    std::printf("%s; CUDA tests skipped\n", a.reason.c_str());
    std::fflush(stdout);
  }
  return a.ok;
}

std::mt19937& rng() {
  static std::mt19937 g(std::random_device{}());
  return g;
}

Tensor random_f32(const Shape& s, float lo = -2.f, float hi = 2.f) {
  Tensor t = Tensor::empty(s, f32);
  std::uniform_real_distribution<float> d(lo, hi);
  for (float& x : t.data<float>()) x = d(rng());
  return t;
}

Tensor random_ids(const Shape& s, int n) {
  Tensor t = Tensor::empty(s, i32);
  std::uniform_int_distribution<int> d(0, n - 1);
  for (auto& x : t.data<std::int32_t>()) x = d(rng());
  return t;
}

// One device, its stream and memory, for running single kernels outside a runtime.
struct Gpu {
  std::unique_ptr<cuda::Stream> stream = cuda::Stream::create(Device::parse("cuda:0"), "test_cuda");
  std::unique_ptr<Allocator> memory = cuda::make_device_allocator(Device::parse("cuda:0"));

  Tensor to_device(const Tensor& host) {
    Tensor d = Tensor::empty(host.shape(), host.dtype(), *memory);
    cuda::copy(d, host, *stream);
    return d;
  }
  Tensor to_host(const Tensor& dev) {
    Tensor h = Tensor::empty(dev.shape(), dev.dtype());
    cuda::copy(h, dev, *stream);
    stream->synchronize();
    return h;
  }
  // Every byte 0xff: NaN in float32, -1 in int32, so an element a kernel forgot shows.
  Tensor poisoned(const Shape& s, DType t) {
    Tensor h = Tensor::empty(s, t);
    std::memset(h.raw(), 0xff, h.nbytes());
    return to_device(h);
  }
};

double rel_error(const Tensor& got, const Tensor& want) {
  auto g = got.data<float>();
  auto w = want.data<float>();
  REQUIRE(g.size() == w.size());
  double scale = 0, err = 0;
  for (std::size_t i = 0; i < w.size(); ++i) scale = std::max(scale, std::abs(static_cast<double>(w[i])));
  for (std::size_t i = 0; i < w.size(); ++i) {
    const double d = std::abs(static_cast<double>(g[i]) - w[i]);
    if (std::isnan(g[i]) != std::isnan(w[i])) return INFINITY;
    if (!std::isnan(d)) err = std::max(err, d);
  }
  return scale == 0 ? err : err / scale;
}

// Runs `op` with `attrs` on the CPU and on cuda:0 and compares every output.
void check_op(Gpu& gpu, const KernelRegistry& reg, const std::string& op, const Attrs& attrs,
              const std::vector<Tensor>& inputs, const std::vector<std::pair<Shape, DType>>& outputs,
              double tolerance = 1e-5) {
  CAPTURE(op);
  CAPTURE(attrs.str());
  const Device cpu{}, dev = Device::parse("cuda:0");
  auto cpu_kernel = reg.create(op, KernelConfig{"cpu." + op, cpu, f32, attrs});
  auto gpu_kernel = reg.create(op, KernelConfig{"cuda." + op, dev, f32, attrs});
  std::vector<const Tensor*> in_cpu, in_gpu;
  std::vector<Tensor> dev_inputs;
  for (const Tensor& t : inputs) dev_inputs.push_back(gpu.to_device(t));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    in_cpu.push_back(&inputs[i]);
    in_gpu.push_back(&dev_inputs[i]);
  }
  std::vector<Tensor> out_cpu, out_gpu;
  for (const auto& [shape, dtype] : outputs) {
    out_cpu.push_back(Tensor::zeros(shape, dtype));
    out_gpu.push_back(gpu.poisoned(shape, dtype));
  }
  std::vector<Tensor*> out_cpu_p, out_gpu_p;
  for (auto& t : out_cpu) out_cpu_p.push_back(&t);
  for (auto& t : out_gpu) out_gpu_p.push_back(&t);
  KernelContext c_cpu{in_cpu, out_cpu_p, 0};
  KernelContext c_gpu{in_gpu, out_gpu_p, 0, gpu.stream.get()};
  cpu_kernel->compute(c_cpu);
  gpu_kernel->compute(c_gpu);
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    Tensor back = gpu.to_host(out_gpu[o]);
    const double e = rel_error(back, out_cpu[o]);
    CAPTURE(o);
    CHECK(e <= tolerance);
  }
}

}  // namespace

TEST_CASE("Cuda.Availability.SaysWhy") {
  const auto& a = cuda::availability();
  if (!cuda_usable()) {
    CHECK(!a.reason.empty());
    if (!cuda::built_with_cuda()) CHECK(a.reason == "built without CUDA");
    return;
  }
  CHECK(a.devices > 0);
  CHECK_THROWS_WITH_AS(cuda::Stream::create(Device{DeviceType::cuda, 63}, "probe"), doctest::Contains("probe"),
                       std::runtime_error);
}

TEST_CASE("Cuda.Kernels.MatchCpu" * doctest::timeout(120)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  const KernelRegistry reg = KernelRegistry::with_builtin_kernels();

  SUBCASE("matmul, every transpose, batched and shared b") {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        const Attrs at{{"trans_a", std::int64_t{ta}}, {"trans_b", std::int64_t{tb}}};
        const std::int64_t m = 33, k = 47, n = 29;
        Shape a2 = ta ? Shape{k, m} : Shape{m, k}, b2 = tb ? Shape{n, k} : Shape{k, n};
        check_op(gpu, reg, "matmul", at, {random_f32(a2), random_f32(b2)}, {{{m, n}, f32}});
        Shape a3 = ta ? Shape{3, k, m} : Shape{3, m, k}, b3 = tb ? Shape{3, n, k} : Shape{3, k, n};
        check_op(gpu, reg, "matmul", at, {random_f32(a3), random_f32(b3)}, {{{3, m, n}, f32}});
        check_op(gpu, reg, "matmul", at, {random_f32(a3), random_f32(b2)}, {{{3, m, n}, f32}});
      }
    }
  }
  SUBCASE("elementwise with broadcasting") {
    for (const char* op : {"add", "sub", "mul", "maximum"}) {
      check_op(gpu, reg, op, {}, {random_f32({5, 7}), random_f32({5, 7})}, {{{5, 7}, f32}});
      check_op(gpu, reg, op, {}, {random_f32({4, 5, 7}), random_f32({7})}, {{{4, 5, 7}, f32}});
      check_op(gpu, reg, op, {}, {random_f32({4, 1, 7}), random_f32({5, 1})}, {{{4, 5, 7}, f32}});
    }
    check_op(gpu, reg, "div", {}, {random_f32({6, 9}), random_f32({9}, 0.5f, 2.f)}, {{{6, 9}, f32}});
  }
  SUBCASE("activations and their gradients") {
    const Shape s{13, 37};
    for (const char* op : {"relu", "gelu", "tanh", "sigmoid"}) check_op(gpu, reg, op, {}, {random_f32(s)}, {{s, f32}});
    for (const char* op : {"relu_grad", "gelu_grad"}) {
      check_op(gpu, reg, op, {}, {random_f32(s), random_f32(s)}, {{s, f32}});
    }
    for (const char* op : {"tanh_grad", "sigmoid_grad"}) {
      check_op(gpu, reg, op, {}, {random_f32(s, 0.f, 1.f), random_f32(s)}, {{s, f32}});
    }
  }
  SUBCASE("shape ops") {
    check_op(gpu, reg, "sum_to", {}, {random_f32({64, 10})}, {{{10}, f32}});
    check_op(gpu, reg, "sum_to", {}, {random_f32({3, 4, 5})}, {{{3, 1, 5}, f32}});
    check_op(gpu, reg, "sum_to", {}, {random_f32({3, 4, 5})}, {{{}, f32}});
    check_op(gpu, reg, "broadcast_to", {}, {random_f32({4, 1})}, {{{2, 4, 3}, f32}});
    check_op(gpu, reg, "transpose", Attrs{{"perm", std::vector<std::int64_t>{0, 2, 1, 3}}}, {random_f32({2, 3, 4, 5})},
             {{{2, 4, 3, 5}, f32}});
    check_op(gpu, reg, "reshape", {}, {random_f32({6, 4})}, {{{4, 6}, f32}});
    check_op(gpu, reg, "scale", Attrs{{"value", 0.37}}, {random_f32({100})}, {{{100}, f32}});
    check_op(gpu, reg, "fill", Attrs{{"value", -1.5}}, {}, {{{3, 3}, f32}});
    check_op(gpu, reg, "causal_mask", Attrs{{"value", -1e9}}, {random_f32({2, 6, 6})}, {{{2, 6, 6}, f32}});
  }
  SUBCASE("softmax, cross-entropy and layer norm, forward and backward") {
    for (std::int64_t cols : {7, 300, 1000}) {
      const Shape s{17, cols};
      check_op(gpu, reg, "softmax", {}, {random_f32(s, -5, 5)}, {{s, f32}});
      check_op(gpu, reg, "log_softmax", {}, {random_f32(s, -5, 5)}, {{s, f32}});
      check_op(gpu, reg, "softmax_grad", {}, {random_f32(s, 0, 1), random_f32(s)}, {{s, f32}});
      check_op(gpu, reg, "log_softmax_grad", {}, {random_f32(s, -3, 0), random_f32(s)}, {{s, f32}});
      const Tensor labels = random_ids({17}, static_cast<int>(cols));
      check_op(gpu, reg, "softmax_cross_entropy", {}, {random_f32(s, -5, 5), labels}, {{{}, f32}});
      check_op(gpu, reg, "softmax_cross_entropy_grad", {}, {random_f32(s, -5, 5), labels, random_f32({}, 0.5, 2)},
               {{s, f32}});
      check_op(gpu, reg, "layer_norm", Attrs{{"eps", 1e-5}}, {random_f32(s, -3, 5)}, {{s, f32}});
      check_op(gpu, reg, "layer_norm_grad", Attrs{{"eps", 1e-5}}, {random_f32(s, -3, 5), random_f32(s)}, {{s, f32}});
    }
  }
  SUBCASE("embedding and its gradient") {
    const Tensor ids = random_ids({4, 9}, 50);
    check_op(gpu, reg, "embedding", {}, {random_f32({50, 16}), ids}, {{{4, 9, 16}, f32}});
    check_op(gpu, reg, "embedding_grad", {}, {ids, random_f32({4, 9, 16})}, {{{50, 16}, f32}});
  }
}

TEST_CASE("Cuda.Optim.MatchCpu" * doctest::timeout(60)) {
  if (!cuda_usable()) return;
  Gpu gpu;
  const std::int64_t n = 10'000;
  for (bool decoupled : {false, true}) {
    AdamConfig cfg{.lr = 1e-2, .weight_decay = 0.1, .decoupled = decoupled};
    Tensor w = random_f32({n}), m = Tensor::zeros({n}, f32), v = Tensor::zeros({n}, f32);
    Tensor dw = gpu.to_device(w), dm = gpu.to_device(m), dv = gpu.to_device(v);
    for (std::int64_t step = 1; step <= 3; ++step) {
      Tensor g = random_f32({n});
      Tensor dg = gpu.to_device(g);
      adam_step(w.data<float>(), g.data<float>(), m.data<float>(), v.data<float>(), cfg, step, cfg.lr);
      cuda::adam_step(dw.data<float>().data(), dg.data<float>().data(), dm.data<float>().data(),
                      dv.data<float>().data(), n, cfg, step, cfg.lr, *gpu.stream);
    }
    CHECK(rel_error(gpu.to_host(dw), w) <= 1e-5);
    CHECK(rel_error(gpu.to_host(dv), v) <= 1e-5);
  }
  for (bool nesterov : {false, true}) {
    SgdConfig cfg{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = nesterov};
    Tensor w = random_f32({n}), buf = Tensor::zeros({n}, f32);
    Tensor dw = gpu.to_device(w), dbuf = gpu.to_device(buf);
    for (std::int64_t step = 1; step <= 3; ++step) {
      Tensor g = random_f32({n});
      Tensor dg = gpu.to_device(g);
      sgd_step(w.data<float>(), g.data<float>(), buf.data<float>(), cfg, step, cfg.lr);
      cuda::sgd_step(dw.data<float>().data(), dg.data<float>().data(), dbuf.data<float>().data(), n, cfg, step, cfg.lr,
                     *gpu.stream);
    }
    CHECK(rel_error(gpu.to_host(dw), w) <= 1e-5);
  }
}

namespace {

// source (cpu) -> scale x2 (cuda) -> relu (cuda) -> collect (cpu): two copy actors in between.
Plan host_device_host(std::int64_t pieces, std::int32_t slots) {
  Plan p;
  const Device gpu = Device::parse("cuda:0");
  auto a = p.add_register({.name = "a", .shape = {1000}, .dtype = f32, .slots = slots});
  auto b = p.add_register({.name = "b", .shape = {1000}, .dtype = f32, .slots = slots});
  auto c = p.add_register({.name = "c", .shape = {1000}, .dtype = f32, .slots = slots});
  p.add_actor({.name = "src", .kind = ActorKind::source, .op = "fill_piece", .outputs = {a}, .pieces = pieces,
               .attrs = Attrs{{"offset", std::int64_t{-3}}}});
  p.add_actor({.name = "twice", .op = "scale", .where = {.device = gpu}, .inputs = {{a}}, .outputs = {b},
               .attrs = Attrs{{"value", 2.0}}});
  p.add_actor({.name = "relu", .op = "relu", .where = {.device = gpu}, .inputs = {{b}}, .outputs = {c}});
  p.add_actor({.name = "sink", .op = "collect", .inputs = {{c}}});
  return insert_device_copies(p);
}

}  // namespace

TEST_CASE("Cuda.Runtime.CopyActorsMoveEveryPieceInOrder" * doctest::timeout(60)) {
  const Plan plan = host_device_host(200, 2);
  // The plan part holds without a GPU: one copy each way, on the copy stream.
  int to_device = 0, to_host = 0;
  for (const auto& a : plan.actors) {
    if (a.op != "to_device" && a.op != "to_host") continue;
    (a.op == "to_device" ? to_device : to_host) += 1;
    CHECK(a.where.device == Device::parse("cuda:0"));
    CHECK(a.where.stream == device_copy_stream);
  }
  CHECK(to_device == 1);
  CHECK(to_host == 1);
  CHECK(insert_device_copies(plan) == plan);
  if (!cuda_usable()) return;
  for (auto mode : {ExecutionMode::threaded, ExecutionMode::deterministic}) {
    CAPTURE(static_cast<int>(mode));
    KernelRegistry reg = KernelRegistry::with_builtin_kernels();
    std::vector<float> seen;
    reg.add_fn("collect", DeviceType::cpu, f32, [&seen](KernelContext& ctx) {
      auto x = ctx.inputs[0]->data<float>();
      // Every element of the piece: a request that came before the copy landed shows here.
      for (float v : x) {
        if (v != x[0]) throw std::runtime_error(fmt::format("piece {}: mixed values {} and {}", ctx.piece, x[0], v));
      }
      seen.push_back(x[0]);
    });
    RuntimeSettings s;
    s.mode = mode;
    s.stall_timeout = std::chrono::milliseconds(20'000);
    Runtime rt(plan, reg, s);
    rt.run();
    REQUIRE(seen.size() == 200);
    for (std::size_t i = 0; i < seen.size(); ++i) CHECK(seen[i] == std::max(0.f, 2.f * (static_cast<float>(i) - 3)));
  }
}
