// The CUDA path against the CPU: every CUDA kernel on fresh random inputs, its outputs poisoned
// (NaN) before each run, against the CPU kernel of the same op (float32 relative error <= 1e-5,
// measured against the largest CPU value); the optimizer steps; and plans that cross between
// host and device through the copy actors, in threaded and deterministic mode.
//
// Where there is no GPU (or no CUDA in the build) each test prints "<reason>; CUDA tests
// skipped" and returns; CTest reports such a run as skipped (tests/CMakeLists.txt).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/actors.h"
#include "baton/graph/collectives.h"
#include "baton/kernels.h"
#include "baton/kernels/optim.h"

#include "test_util.h"

using namespace baton;
using test::cuda_usable;

namespace {

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

Tensor random_f64(const Shape& s, double lo = -2, double hi = 2) {
  Tensor t = Tensor::empty(s, f64);
  std::uniform_real_distribution<double> d(lo, hi);
  for (double& x : t.data<double>()) x = d(rng());
  return t;
}

Tensor random_of(DType dt, const Shape& s) { return dt == f64 ? random_f64(s) : random_f32(s); }

Attrs ints(std::initializer_list<std::pair<const char*, std::int64_t>> kv) {
  Attrs a;
  for (const auto& [k, v] : kv) a.set(k, v);
  return a;
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

std::vector<double> values(const Tensor& t) {
  std::vector<double> v;
  if (t.dtype() == f64) {
    for (double x : t.data<double>()) v.push_back(x);
  } else {
    for (float x : t.data<float>()) v.push_back(x);
  }
  return v;
}

// max |got - want| / max |want| over the finite values; a NaN where the other has none, or an
// infinity that the other does not have, is an infinite error.
double rel_error(const Tensor& got, const Tensor& want) {
  REQUIRE(got.dtype() == want.dtype());
  const auto g = values(got);
  const auto w = values(want);
  REQUIRE(g.size() == w.size());
  double scale = 0, err = 0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (std::isfinite(w[i])) scale = std::max(scale, std::abs(w[i]));
  }
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (std::isnan(g[i]) != std::isnan(w[i])) return INFINITY;
    if (std::isinf(g[i]) || std::isinf(w[i])) {
      if (g[i] != w[i]) return INFINITY;
      continue;
    }
    if (!std::isnan(w[i])) err = std::max(err, std::abs(g[i] - w[i]));
  }
  return scale == 0 ? err : err / scale;
}

// Runs `op` with `attrs` on the CPU and on cuda:0 as act `piece` and compares every output
// (tolerance 0: the same bits). The default 1e-5, relative to the largest CPU value: the CUDA
// kernels are built with -fmad=false, so every element-wise operation rounds as on the CPU, and
// what differs is the order of the sums (a tree of partial sums on the GPU, a loop on the CPU).
// Rounding errors of random inputs add as a random walk, about sqrt(n) u of sum|terms|: for the
// longest sums here (n = 3000 rows of a bias gradient, 5000 of a reduction) sqrt(3000) x 6e-8
// = 3.3e-6, within 1e-5 (the worst-case n u would not be; the runs on an H100 passed). f64:
// 1e-12, the same with u = 1.1e-16. The kernels' dtype is the first output's. Without a GPU
// (gpu null) only the CPU kernel runs, and the CUDA kernel is made: the inputs fit the op and
// the CUDA kernel exists and takes the attributes.
void check_op(Gpu* gpu_or_null, const KernelRegistry& reg, const std::string& op, const Attrs& attrs,
              const std::vector<Tensor>& inputs, const std::vector<std::pair<Shape, DType>>& outputs,
              double tolerance = 1e-5, std::int64_t piece = 0) {
  CAPTURE(op);
  CAPTURE(attrs.str());
  CAPTURE(piece);
  const Device cpu{}, dev = Device::parse("cuda:0");
  const DType dt = outputs.empty() ? f32 : outputs[0].second;
  auto cpu_kernel = reg.create(op, KernelConfig{"cpu." + op, cpu, dt, attrs});
  auto gpu_kernel = reg.create(op, KernelConfig{"cuda." + op, dev, dt, attrs});
  if (gpu_or_null == nullptr) {
    std::vector<const Tensor*> in;
    for (const Tensor& t : inputs) in.push_back(&t);
    std::vector<Tensor> out;
    for (const auto& [shape, dtype] : outputs) out.push_back(Tensor::zeros(shape, dtype));
    std::vector<Tensor*> out_p;
    for (auto& t : out) out_p.push_back(&t);
    KernelContext c{in, out_p, piece};
    CHECK_NOTHROW(cpu_kernel->compute(c));
    return;
  }
  Gpu& gpu = *gpu_or_null;
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
  KernelContext c_cpu{in_cpu, out_cpu_p, piece};
  KernelContext c_gpu{in_gpu, out_gpu_p, piece, gpu.stream.get()};
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

// A stream made, and a kernel launched, on cuda:0 right after an allocation on cuda:1 made
// that device current on this thread: the stream must still live on cuda:0 and its kernel run
// there (Stream::bind once trusted a remembered device and skipped the switch). Needs two GPUs.
TEST_CASE("Cuda.Stream.BindsItsDeviceWhateverWasCurrent" * doctest::timeout(60)) {
  if (!cuda_usable()) return;
  if (cuda::availability().devices < 2) {
    return test::skip(test::Missing::second_cuda_device, "one CUDA device: nothing to switch between");
  }
  const Device d0 = Device::parse("cuda:0"), d1 = Device::parse("cuda:1");
  auto first = cuda::Stream::create(d0, "first");
  auto memory0 = cuda::make_device_allocator(d0);
  auto memory1 = cuda::make_device_allocator(d1);
  const Tensor x = random_f32({1000});
  Tensor dx = Tensor::empty(x.shape(), f32, *memory0), dy = Tensor::empty(x.shape(), f32, *memory0);
  Tensor elsewhere = Tensor::empty({16}, f32, *memory1);  // makes cuda:1 current here
  auto second = cuda::Stream::create(d0, "second");
  cuda::copy(dx, x, *second);
  const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  auto scale = reg.create("scale", KernelConfig{"twice", d0, f32, Attrs{{"value", 2.0}}});
  const Tensor* in[] = {&dx};
  Tensor* out[] = {&dy};
  KernelContext ctx{in, out, 0, second.get()};
  scale->compute(ctx);
  Tensor back = Tensor::empty(x.shape(), f32);
  cuda::copy(back, dy, *second);
  second->synchronize();
  for (std::size_t i = 0; i < 1000; ++i) CHECK(back.data<float>()[i] == 2.f * x.data<float>()[i]);
}

// Stream capture on a GPU (what Program::use_graphs does with a decode step): a scale kernel
// captured once and launched three times triples its doubling (y = 2x in place: x 8x); nothing
// runs while capturing; a synchronize during a capture fails, end_capture then throws, and the
// stream works as before.
TEST_CASE("Cuda.Stream.ACaptureReplaysItsKernels" * doctest::timeout(60)) {
  if (!cuda_usable()) return;
  const Device d0 = Device::parse("cuda:0");
  auto s = cuda::Stream::create(d0, "capture");
  auto memory = cuda::make_device_allocator(d0);
  const Tensor x = random_f32({1000});
  Tensor dx = Tensor::empty(x.shape(), f32, *memory);
  cuda::copy(dx, x, *s);
  s->synchronize();
  const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  auto scale = reg.create("scale", KernelConfig{"twice", d0, f32, Attrs{{"value", 2.0}}});
  const Tensor* in[] = {&dx};
  Tensor* out[] = {&dx};
  KernelContext ctx{in, out, 0, s.get(), s.get()};
  s->begin_capture();
  scale->compute(ctx);
  std::unique_ptr<StreamGraph> g = s->end_capture();
  Tensor back = Tensor::empty(x.shape(), f32);
  cuda::copy(back, dx, *s);
  s->synchronize();
  for (std::size_t i = 0; i < 1000; ++i) CHECK(back.data<float>()[i] == x.data<float>()[i]);  // not run
  for (int k = 0; k < 3; ++k) s->launch(*g);
  cuda::copy(back, dx, *s);
  s->synchronize();
  for (std::size_t i = 0; i < 1000; ++i) CHECK(back.data<float>()[i] == 8.f * x.data<float>()[i]);
  s->begin_capture();
  CHECK_THROWS(s->synchronize());
  CHECK_THROWS_AS(s->end_capture(), std::runtime_error);
  scale->compute(ctx);
  cuda::copy(back, dx, *s);
  s->synchronize();
  for (std::size_t i = 0; i < 1000; ++i) CHECK(back.data<float>()[i] == 16.f * x.data<float>()[i]);
  CHECK(s->failure().empty());
}

// The CUDA binary ops check their shapes on the host, before anything reaches a device, so
// this runs without a GPU: an input with more axes than the output is refused (it once wrapped
// an unsigned count and read as broadcast along every axis).
TEST_CASE("Cuda.Kernels.BinaryRefusesAnInputWithMoreAxesThanTheOutput") {
  if (!cuda::built_with_cuda()) {
    cuda_usable();  // says why, and CTest reports a skip
    return;
  }
  const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  const Tensor a = random_f32({2, 3}), b = random_f32({3});
  Tensor c = Tensor::zeros({3}, f32);
  for (const char* op : {"add", "mul", "maximum"}) {
    CAPTURE(op);
    auto k = reg.create(op, KernelConfig{"wide", Device::parse("cuda:0"), f32, {}});
    const Tensor* in[] = {&a, &b};
    Tensor* out[] = {&c};
    KernelContext ctx{in, out, 0};
    CHECK_THROWS_WITH_AS(k->compute(ctx), doctest::Contains("a of shape [2, 3] does not broadcast to [3]"),
                         std::invalid_argument);
  }
}

TEST_CASE("Cuda.Kernels.MatchCpu" * doctest::timeout(120)) {
  // Without a GPU the CUDA kernels are still made (check_op), which needs a CUDA build: a build
  // without CUDA skips (it failed there, hidden by the old skip pattern).
  if (!test::cuda_built()) return;
  std::optional<Gpu> device;
  if (cuda_usable()) device.emplace();
  Gpu* gpu = device ? &*device : nullptr;
  const KernelRegistry reg = [] {
    KernelRegistry r = KernelRegistry::with_builtin_kernels();
    add_collective_kernels(r);
    return r;
  }();

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
  SUBCASE("matmul_bias_grad: cuBLASLt's bias-gradient epilogue, or the two ops apart") {
    // dw = x^T dy over every row and db = dy's rows summed (the epilogues pass's fused Linear
    // gradient): 3-D operands whose rows fold, and odd extents that cuBLASLt may refuse (then
    // the kernel runs cuBLAS and sum_to: the same values either way).
    check_op(gpu, reg, "matmul_bias_grad", {}, {random_f32({3, 40, 48}), random_f32({3, 40, 64})},
             {{{48, 64}, f32}, {{64}, f32}});
    check_op(gpu, reg, "matmul_bias_grad", {}, {random_f32({33, 47}), random_f32({33, 29})},
             {{{47, 29}, f32}, {{29}, f32}});
  }
  SUBCASE("matmul_bias: cuBLASLt's bias epilogue, or the two ops apart") {
    // y = x w + b (the epilogues pass's fused Linear forward), w as stored and transposed, 3-D x
    // whose rows fold, and odd extents that cuBLASLt may refuse (then cuBLAS and add's kernel).
    for (std::int64_t tb : {0, 1}) {
      const Attrs at{{"trans_b", tb}};
      check_op(gpu, reg, "matmul_bias", at,
               {random_f32({3, 40, 48}), random_f32(tb ? Shape{64, 48} : Shape{48, 64}), random_f32({64})},
               {{{3, 40, 64}, f32}});
      check_op(gpu, reg, "matmul_bias", at,
               {random_f32({33, 47}), random_f32(tb ? Shape{29, 47} : Shape{47, 29}), random_f32({29})},
               {{{33, 29}, f32}});
    }
  }
  SUBCASE("matmul_bias_gelu: cuBLASLt's GELU epilogue (GELU_AUX_BIAS), or the ops apart") {
    // y = gelu(x w + b) and pre = x w + b: the tanh form through the epilogue where n is a
    // multiple of 8 (its aux's leading dimension), apart where not; the erf form always apart.
    for (const char* form : {"tanh", "none"}) {
      for (std::int64_t tb : {0, 1}) {
        const Attrs at{{"trans_b", tb}, {"approximate", std::string(form)}};
        check_op(gpu, reg, "matmul_bias_gelu", at,
                 {random_f32({3, 40, 48}), random_f32(tb ? Shape{64, 48} : Shape{48, 64}), random_f32({64})},
                 {{{3, 40, 64}, f32}, {{3, 40, 64}, f32}});
        check_op(gpu, reg, "matmul_bias_gelu", at,
                 {random_f32({33, 47}), random_f32(tb ? Shape{29, 47} : Shape{47, 29}), random_f32({29})},
                 {{{33, 29}, f32}, {{33, 29}, f32}});
      }
    }
  }
  SUBCASE("matmul_dgelu_bgrad: cuBLASLt's GELU-gradient epilogue (DGELU_BGRAD), or the ops apart") {
    // dh = gelu'(pre) (dy w^T) and db, dh's rows summed: the tanh form through the epilogue where
    // n is a multiple of 8, apart where not; the erf form apart.
    for (const char* form : {"tanh", "none"}) {
      for (std::int64_t tb : {0, 1}) {
        const Attrs at{{"trans_b", tb}, {"approximate", std::string(form)}};
        check_op(gpu, reg, "matmul_dgelu_bgrad", at,
                 {random_f32({3, 40, 48}), random_f32(tb ? Shape{64, 48} : Shape{48, 64}), random_f32({3, 40, 64})},
                 {{{3, 40, 64}, f32}, {{64}, f32}});
        check_op(gpu, reg, "matmul_dgelu_bgrad", at,
                 {random_f32({33, 47}), random_f32(tb ? Shape{29, 47} : Shape{47, 29}), random_f32({33, 29})},
                 {{{33, 29}, f32}, {{29}, f32}});
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
    // A NaN stays NaN through each activation (relu too, as torch.relu and the CPU's std::max),
    // and through the gradients where the CPU's does.
    Tensor with_nan = random_f32(s);
    with_nan.data<float>()[40] = NAN;
    for (const char* op : {"relu", "gelu", "tanh", "sigmoid"}) check_op(gpu, reg, op, {}, {with_nan}, {{s, f32}});
    for (const char* op : {"relu_grad", "gelu_grad"}) check_op(gpu, reg, op, {}, {with_nan, random_f32(s)}, {{s, f32}});
    for (const char* op : {"relu_grad", "gelu_grad"}) {
      check_op(gpu, reg, op, {}, {random_f32(s), random_f32(s)}, {{s, f32}});
    }
    for (const char* op : {"tanh_grad", "sigmoid_grad"}) {
      check_op(gpu, reg, op, {}, {random_f32(s, 0.f, 1.f), random_f32(s)}, {{s, f32}});
    }
  }
  SUBCASE("the LLM ops' elementwise part and their gradients") {
    const Shape s{13, 37};
    const Tensor positive = random_f32(s, 0.1f, 4.f);
    for (const char* op : {"exp", "silu"}) check_op(gpu, reg, op, {}, {random_f32(s)}, {{s, f32}});
    for (const char* op : {"log", "sqrt", "rsqrt"}) check_op(gpu, reg, op, {}, {positive}, {{s, f32}});
    for (double e : {2.0, 0.5, -1.5}) {
      check_op(gpu, reg, "pow", Attrs{{"exponent", e}}, {positive}, {{s, f32}});
      check_op(gpu, reg, "pow_grad", Attrs{{"exponent", e}}, {positive, random_f32(s)}, {{s, f32}});
    }
    for (const char* op : {"sqrt_grad", "rsqrt_grad"}) check_op(gpu, reg, op, {}, {positive, random_f32(s)}, {{s, f32}});
    check_op(gpu, reg, "silu_grad", {}, {random_f32(s), random_f32(s)}, {{s, f32}});
  }
  SUBCASE("RMSNorm and the rotary embedding") {
    const Shape x{3, 7, 64};
    const Attrs eps{{"eps", 1e-5}};
    const Tensor w = random_f32({64}, 0.5f, 1.5f);
    check_op(gpu, reg, "rms_norm", eps, {random_f32(x), w}, {{x, f32}});
    check_op(gpu, reg, "rms_norm_grad", eps, {random_f32(x), w, random_f32(x)}, {{x, f32}});
    check_op(gpu, reg, "rms_norm_grad_weight", eps, {random_f32(x), random_f32(x)}, {{{64}, f32}});
    // Positions up to 300 (angles up to 300 radians): the tables are the CPU's, made on the host.
    for (const Shape& r : {Shape{2, 5, 16}, Shape{2, 4, 300, 32}}) {
      check_op(gpu, reg, "rope", Attrs{{"base", 10000.0}}, {random_f32(r)}, {{r, f32}});
      check_op(gpu, reg, "rope_grad", Attrs{{"base", 500000.0}}, {random_f32(r)}, {{r, f32}});
    }
  }
  SUBCASE("shape ops") {
    check_op(gpu, reg, "sum_to", {}, {random_f32({64, 10})}, {{{10}, f32}});
    check_op(gpu, reg, "sum_to", {}, {random_f32({3, 4, 5})}, {{{3, 1, 5}, f32}});
    check_op(gpu, reg, "sum_to", {}, {random_f32({3, 4, 5})}, {{{}, f32}});
    check_op(gpu, reg, "sum_to", {}, {random_f32({3000, 40})}, {{{40}, f32}});  // a bias gradient
    check_op(gpu, reg, "sum_to", {}, {random_f32({4, 1000, 130})}, {{{130}, f32}});
    check_op(gpu, reg, "sum_to", {}, {random_f32({2, 3, 4100})}, {{{1, 1, 4100}, f32}});
    check_op(gpu, reg, "sum_to", {}, {random_f64({30, 7})}, {{{1, 7}, f64}}, 1e-12);
    check_op(gpu, reg, "broadcast_to", {}, {random_f32({4, 1})}, {{{2, 4, 3}, f32}});
    check_op(gpu, reg, "transpose", Attrs{{"perm", std::vector<std::int64_t>{0, 2, 1, 3}}}, {random_f32({2, 3, 4, 5})},
             {{{2, 4, 3, 5}, f32}});
    check_op(gpu, reg, "reshape", {}, {random_f32({6, 4})}, {{{4, 6}, f32}});
    check_op(gpu, reg, "scale", Attrs{{"value", 0.37}}, {random_f32({100})}, {{{100}, f32}});
    check_op(gpu, reg, "fill", Attrs{{"value", -1.5}}, {}, {{{3, 3}, f32}});
    check_op(gpu, reg, "causal_mask", Attrs{{"value", -1e9}}, {random_f32({2, 6, 6})}, {{{2, 6, 6}, f32}});
  }
  SUBCASE("softmax, cross-entropy and layer norm, forward and backward") {
    for (std::int64_t cols : {7, 300, 1000, 2048, 4096}) {  // 300 on: four floats a load in the loss; to 2048 layer norm holds its row in registers
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
    // The gradient adds each row's positions in the CPU's order: the same bits. Few rows for
    // many positions (long runs), and no positions at all.
    check_op(gpu, reg, "embedding_grad", {}, {ids, random_f32({4, 9, 16})}, {{{50, 16}, f32}}, 0.0);
    check_op(gpu, reg, "embedding_grad", {}, {random_ids({64, 33}, 5), random_f32({64, 33, 3})}, {{{5, 3}, f32}}, 0.0);
    check_op(gpu, reg, "embedding_grad", {}, {random_ids({0}, 5), random_f32({0, 8})}, {{{5, 8}, f32}}, 0.0);
  }
  SUBCASE("embedding over a shard of the vocabulary") {
    // Rows [30, 50) and the last rows [44, 64) of 64, an odd width: ids of other shards give
    // zero rows and no gradient.
    for (auto [start, d] : {std::pair<std::int64_t, std::int64_t>{30, 16}, {44, 7}}) {
      const Attrs shard = ints({{"vocab_start", start}, {"vocab", 64}});
      const Tensor ids = random_ids({5, 11}, 64);
      check_op(gpu, reg, "embedding", shard, {random_f32({20, d}), ids}, {{{5, 11, d}, f32}});
      check_op(gpu, reg, "embedding_grad", shard, {ids, random_f32({5, 11, d})}, {{{20, d}, f32}}, 0.0);
    }
  }
  SUBCASE("vocabulary-parallel cross-entropy, forward and backward") {
    // The first and the last shard of 1000 classes, and one shard holding them all.
    for (auto [start, cols, vocab] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 300, 1000},
                                      {700, 300, 1000}, {0, 7, 7}}) {
      CAPTURE(start);
      const Attrs shard = ints({{"vocab_start", start}, {"vocab", vocab}});
      const Shape s{17, cols};
      const Tensor logits = random_f32(s, -5, 5), labels = random_ids({17}, static_cast<int>(vocab));
      const Tensor row_max = random_f32({17}, 4, 6);
      check_op(gpu, reg, "vocab_parallel_ce_stats", shard, {logits, labels, row_max}, {{{17, 2}, f32}});
      check_op(gpu, reg, "vocab_parallel_ce_stats_grad", shard, {logits, labels, row_max, random_f32({17, 2})},
               {{s, f32}});
    }
    for (std::int64_t rows : {33, 5000}) {
      const Tensor stats = random_f32({rows, 2}, 0.5, 3);
      check_op(gpu, reg, "vocab_parallel_ce_loss", {}, {stats, random_f32({rows})}, {{{}, f32}});
      check_op(gpu, reg, "vocab_parallel_ce_loss_grad", {}, {stats, random_f32({}, 0.5, 2)}, {{{rows, 2}, f32}});
    }
  }
  SUBCASE("mse and its gradient") {
    // 100003 elements: every one of the mean's parts; none: NaN, as the CPU.
    for (const Shape& s : {Shape{17, 33}, Shape{100003}, Shape{0}}) {
      check_op(gpu, reg, "mse", {}, {random_f32(s), random_f32(s)}, {{{}, f32}});
      check_op(gpu, reg, "mse_grad", {}, {random_f32(s), random_f32(s), random_f32({}, 0.5, 2)}, {{s, f32}});
    }
  }
  SUBCASE("sum, mean and max over axes, f32 and f64") {
    auto axes = [](std::vector<std::int64_t> a, bool keep) {
      return Attrs{{"axes", std::move(a)}, {"keepdims", std::int64_t{keep ? 1 : 0}}};
    };
    Tensor with_nan = random_f32({6, 300});
    with_nan.data<float>()[2 * 300 + 17] = NAN;  // row 2's sum, mean and max are NaN
    Tensor many_rows_with_nan = random_f32({1500, 100});
    many_rows_with_nan.data<float>()[1200 * 100 + 99] = NAN;
    for (const char* op : {"sum", "mean", "max"}) {
      check_op(gpu, reg, op, {}, {random_f32({37, 300})}, {{{}, f32}});                 // all: a block per output
      check_op(gpu, reg, op, axes({1}, false), {random_f32({17, 300})}, {{{17}, f32}});
      check_op(gpu, reg, op, axes({-1}, true), {random_f32({17, 5})}, {{{17, 1}, f32}});  // a thread per output
      check_op(gpu, reg, op, axes({0}, true), {random_f32({5, 7, 9})}, {{{1, 7, 9}, f32}});
      check_op(gpu, reg, op, axes({0, 2}, false), {random_f32({4, 5, 6})}, {{{5}, f32}});
      check_op(gpu, reg, op, axes({1}, false), {random_f32({5000, 3})}, {{{5000}, f32}});
      check_op(gpu, reg, op, axes({1}, false), {with_nan}, {{{6}, f32}});
      // The coalesced layouts (reduce_columns, reduce_rows in tensor.cu): over leading rows with
      // a column count that is no multiple of 32, and over the last axis of many rows, a NaN in one.
      check_op(gpu, reg, op, axes({0}, false), {random_f32({3000, 70})}, {{{70}, f32}});
      check_op(gpu, reg, op, axes({0, 1}, false), {random_f32({9, 500, 33})}, {{{33}, f32}});
      check_op(gpu, reg, op, axes({1}, false), {random_f32({2048, 300})}, {{{2048}, f32}});
      check_op(gpu, reg, op, axes({1}, true), {many_rows_with_nan}, {{{1500, 1}, f32}});
      check_op(gpu, reg, op, axes({1}, false), {random_f32({3, 0})}, {{{3}, f32}});  // of nothing: 0, NaN, -inf
      check_op(gpu, reg, op, axes({0, 2}, true), {random_f64({33, 4, 20})}, {{{1, 4, 1}, f64}}, 1e-12);
      check_op(gpu, reg, op, {}, {random_f64({1000})}, {{{}, f64}}, 1e-12);
    }
  }
  SUBCASE("dropout: the CPU's mask, bit for bit") {
    for (std::int64_t piece : {std::int64_t{0}, std::int64_t{7}, std::int64_t{123456789}}) {
      for (double p : {0.0, 0.1, 0.5, 1.0}) {
        check_op(gpu, reg, "dropout", Attrs{{"p", p}, {"seed", std::int64_t{42}}}, {random_f32({1001})},
                 {{{1001}, f32}}, 0.0, piece);
      }
      check_op(gpu, reg, "dropout", Attrs{{"p", 0.3}, {"seed", std::int64_t{-5}}}, {random_f32({3, 37, 5})},
               {{{3, 37, 5}, f32}}, 0.0, piece);
      check_op(gpu, reg, "dropout", Attrs{{"p", 0.3}, {"seed", std::int64_t{9}}}, {random_f64({257})}, {{{257}, f64}}, 0.0,
               piece);
    }
    check_op(gpu, reg, "dropout", Attrs{{"p", 0.5}}, {random_f32({0})}, {{{0}, f32}}, 0.0);
  }
  SUBCASE("slice, its gradient, concat and reshape, f32 and f64") {
    for (DType dt : {f32, f64}) {
      CAPTURE(name(dt));
      auto r = [dt](const Shape& s) { return random_of(dt, s); };
      const double exact = 0.0;
      // A middle axis, the first (one contiguous run) and the last (runs of a few elements).
      check_op(gpu, reg, "slice", ints({{"axis", 1}, {"start", 2}}), {r({5, 7, 3})}, {{{5, 3, 3}, dt}}, exact);
      check_op(gpu, reg, "slice", ints({{"axis", 0}, {"start", 4}}), {r({9, 13})}, {{{5, 13}, dt}}, exact);
      check_op(gpu, reg, "slice", ints({{"axis", -1}, {"start", 1}}), {r({6, 11})}, {{{6, 9}, dt}}, exact);
      check_op(gpu, reg, "slice_grad", ints({{"axis", 1}, {"start", 2}}), {r({5, 3, 3})}, {{{5, 7, 3}, dt}}, exact);
      check_op(gpu, reg, "slice_grad", ints({{"axis", -1}, {"start", 10}}), {r({6, 1})}, {{{6, 11}, dt}}, exact);
      check_op(gpu, reg, "concat", ints({{"axis", 1}}), {r({4, 2, 3}), r({4, 5, 3}), r({4, 1, 3})}, {{{4, 8, 3}, dt}},
               exact);
      check_op(gpu, reg, "concat", ints({{"axis", 0}}), {r({3, 7}), r({1, 7})}, {{{4, 7}, dt}}, exact);
      check_op(gpu, reg, "concat", ints({{"axis", -1}}), {r({5, 1}), r({5, 6})}, {{{5, 7}, dt}}, exact);
      check_op(gpu, reg, "reshape", {}, {r({6, 5})}, {{{3, 10}, dt}}, exact);
    }
  }
  SUBCASE("the all-reduce's kernels, f32 and f64") {
    for (DType dt : {f32, f64}) {
      CAPTURE(name(dt));
      auto r = [dt](const Shape& s) { return random_of(dt, s); };
      const double exact = 0.0;
      check_op(gpu, reg, "allreduce.slice", ints({{"offset", 5}}), {r({100})}, {{{37}, dt}}, exact);
      check_op(gpu, reg, "allreduce.add", ints({{"offset", 11}, {"from", -1}}), {r({37}), r({100})}, {{{37}, dt}}, exact);
      check_op(gpu, reg, "allreduce.add", ints({{"offset", 11}, {"from", 3}}), {r({100}), r({100})}, {{{37}, dt}}, exact);
      check_op(gpu, reg, "allreduce.sum", {}, {r({41}), r({41}), r({41})}, {{{41}, dt}}, exact);
      check_op(gpu, reg, "allreduce.split", {}, {r({100})}, {{{30}, dt}, {{45}, dt}, {{25}, dt}}, exact);
      check_op(gpu, reg, "allreduce.concat", {}, {r({30}), r({1}), r({69})}, {{{100}, dt}}, exact);
    }
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
    // Element-wise, 3 steps: a few roundings each, and the GPU's sqrt and division are correctly
    // rounded as the CPU's (no fast-math): a few u = 6e-8, well within 1e-5.
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

TEST_CASE("Cuda.Memory.TheAllocatorsCountWhatTheyHoldAndTheirPeak") {
  // The measured side of the plan's memory estimate (bench gpu's device_peak_bytes): bytes handed
  // out now, the most at once since the last reset, and what cudaMalloc gave (pools included).
  const Device dev = Device::parse("cuda:0");
  if (!cuda_usable()) return;
  auto alloc = cuda::make_device_allocator(dev);
  const cuda::DeviceMemoryStats before = cuda::device_memory(dev);
  cuda::reset_peak_device_memory(dev);
  {
    Tensor a = Tensor::empty({1 << 20}, f32, *alloc);  // 4 MiB
    Tensor b = Tensor::empty({1 << 18}, f32, *alloc);  // 1 MiB
    const cuda::DeviceMemoryStats held = cuda::device_memory(dev);
    CHECK(held.in_use - before.in_use == 5 << 20);
    CHECK(held.peak == held.in_use);
    CHECK(held.reserved - before.reserved >= 0);
  }
  const cuda::DeviceMemoryStats after = cuda::device_memory(dev);
  CHECK(after.in_use == before.in_use);           // given back to the pool
  CHECK(after.peak - before.in_use == 5 << 20);    // the peak stays until the next reset
  CHECK(after.reserved - before.reserved >= 0);  // the pool keeps its blocks
  cuda::reset_peak_device_memory(dev);
  CHECK(cuda::device_memory(dev).peak == after.in_use);
  alloc.reset();  // the pool's blocks go back to CUDA
  CHECK(cuda::device_memory(dev).reserved <= after.reserved);
}

TEST_CASE("Cuda.Optim.TheStepWritesItsCopyOfTheWeights" * doctest::timeout(60)) {
  // The variable actor's output in the optimizer's own pass (TrainConfig::fuse_weight_casts):
  // the f32 copy is the master bit for bit, the bf16 one the cast kernel's rounding of it.
  if (!cuda_usable()) return;
  Gpu gpu;
  const std::int64_t n = 10'001;  // odd: no pack of the copy is whole
  AdamConfig adam{.lr = 1e-2, .weight_decay = 0.1, .decoupled = true};
  SgdConfig sgd{.lr = 0.1, .momentum = 0.9};
  for (DType copy_dt : {f32, DType::bf16}) {
    CAPTURE(name(copy_dt));
    for (bool with_adam : {true, false}) {
      Tensor dw = gpu.to_device(random_f32({n})), dm = gpu.to_device(Tensor::zeros({n}, f32));
      Tensor dv = gpu.to_device(Tensor::zeros({n}, f32)), dg = gpu.to_device(random_f32({n}));
      Tensor copy = gpu.to_device(Tensor::zeros({n}, copy_dt));
      for (std::int64_t step = 1; step <= 2; ++step) {
        if (with_adam) {
          cuda::adam_step(dw.data<float>().data(), dg.data<float>().data(), dm.data<float>().data(),
                          dv.data<float>().data(), n, adam, step, adam.lr, *gpu.stream, &copy);
        } else {
          cuda::sgd_step(dw.data<float>().data(), dg.data<float>().data(), dm.data<float>().data(), n, sgd, step, sgd.lr,
                         *gpu.stream, &copy);
        }
      }
      const Tensor w = gpu.to_host(dw), c = gpu.to_host(copy);
      for (std::int64_t i = 0; i < n; ++i) {
        const float wi = w.data<float>()[static_cast<std::size_t>(i)];
        if (copy_dt == f32) {
          REQUIRE(c.data<float>()[static_cast<std::size_t>(i)] == wi);
        } else {
          REQUIRE(c.data<bfloat16>()[static_cast<std::size_t>(i)].bits == to_bf16(wi).bits);
        }
      }
    }
  }
  Tensor dw = gpu.to_device(random_f32({n})), dg = gpu.to_device(random_f32({n}));
  Tensor short_copy = gpu.to_device(Tensor::zeros({n - 1}, DType::bf16));
  CHECK_THROWS_WITH_AS(cuda::sgd_step(dw.data<float>().data(), dg.data<float>().data(), nullptr, n, SgdConfig{.lr = 0.1},
                                      1, 0.1, *gpu.stream, &short_copy),
                       doctest::Contains("f32 or bf16 of the same size"), std::invalid_argument);
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

namespace {

// Small integers: every sum of a few is exact in float32.
float value(std::int64_t member, std::int64_t piece, std::int64_t i) {
  return static_cast<float>((member + 1) * 1000 + i % 977 + piece * 7);
}

class FunctionKernelOf final : public Kernel {
 public:
  explicit FunctionKernelOf(std::function<void(KernelContext&)> fn) : fn_(std::move(fn)) {}
  void compute(KernelContext& ctx) override { fn_(ctx); }

 private:
  std::function<void(KernelContext&)> fn_;
};

}  // namespace

// An all-reduce among members on three streams (workers) of cuda:0, fed from and checked on the
// host: the CUDA all-reduce kernels in a running plan, every piece's sum exact on every member
// (small integers, so float sums are exact and the check is equality). Without a GPU, the plan
// is still checked: every actor on cuda:0 finds a kernel, and the host crossings are copies.
TEST_CASE("Cuda.Collectives.AllReduceAmongStreamsOfOneDevice" * doctest::timeout(120)) {
  // Without a GPU the plan is still checked, but only against the CUDA kernels a CUDA build
  // registers: a build without CUDA skips (it failed there, hidden by the old skip pattern).
  if (!test::cuda_built()) return;
  const bool gpu = cuda_usable();
  const std::int64_t elements = 4099, pieces = 6, n = 3;
  for (auto algorithm : {AllReduceAlgorithm::ring, AllReduceAlgorithm::two_hop}) {
    CAPTURE(static_cast<int>(algorithm));
    Plan plan;
    {
      std::vector<AllReduceMember> members;
      for (std::int64_t j = 0; j < n; ++j) {
        const std::string suffix = fmt::format("@m{}", j);
        auto r = plan.add_register({.name = "grad" + suffix, .shape = {elements}, .dtype = f32});
        plan.add_actor({.name = "fill" + suffix, .kind = ActorKind::source, .op = "test.fill", .outputs = {r},
                        .pieces = pieces, .attrs = {{"member", j}}});
        members.push_back(
            {Placement{.device = Device::parse("cuda:0"), .stream = static_cast<std::uint8_t>(j)}, r, suffix});
      }
      const auto results = add_allreduce(plan, "ar", members, {elements}, f32, 2, {.algorithm = algorithm});
      for (std::int64_t j = 0; j < n; ++j) {
        plan.add_actor({.name = fmt::format("check@m{}", j), .op = "test.check",
                        .inputs = {{results[static_cast<std::size_t>(j)]}}, .attrs = {{"member", j}}});
      }
      plan = insert_device_copies(plan);
    }
    int to_device = 0, to_host = 0;
    for (const auto& a : plan.actors) {
      to_device += a.op == "to_device";
      to_host += a.op == "to_host";
    }
    CHECK(to_device == n);
    CHECK(to_host == n);
    for (auto mode : {ExecutionMode::threaded, ExecutionMode::deterministic}) {
      CAPTURE(static_cast<int>(mode));
      KernelRegistry reg = KernelRegistry::with_builtin_kernels();
      add_collective_kernels(reg);
      reg.add("test.fill", DeviceType::cpu, f32, [](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
        const std::int64_t member = cfg.attrs.get_int("member", -1);
        return std::make_unique<FunctionKernelOf>([member](KernelContext& ctx) {
          auto out = ctx.outputs[0]->data<float>();
          for (std::size_t i = 0; i < out.size(); ++i) out[i] = value(member, ctx.piece, static_cast<std::int64_t>(i));
        });
      });
      std::mutex m;
      std::vector<std::string> wrong;
      std::vector<std::int64_t> checked(static_cast<std::size_t>(n), 0);
      reg.add("test.check", DeviceType::cpu, f32, [&](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
        const std::int64_t member = cfg.attrs.get_int("member", -1);
        return std::make_unique<FunctionKernelOf>([&, member](KernelContext& ctx) {
          auto in = ctx.inputs[0]->data<float>();
          std::lock_guard lock(m);
          ++checked[static_cast<std::size_t>(member)];
          for (std::size_t i = 0; i < in.size(); ++i) {
            float want = 0;
            for (std::int64_t j = 0; j < n; ++j) want += value(j, ctx.piece, static_cast<std::int64_t>(i));
            if (in[i] != want && wrong.size() < 5) {
              wrong.push_back(
                  fmt::format("member {} piece {} element {}: {}, the sum is {}", member, ctx.piece, i, in[i], want));
            }
          }
        });
      });
      REQUIRE_NOTHROW(validate(plan, reg));
      if (!gpu) continue;
      RuntimeSettings s;
      s.mode = mode;
      s.stall_timeout = std::chrono::milliseconds(20'000);
      Runtime rt(plan, reg, s);
      rt.run();
      CHECK_MESSAGE(wrong.empty(), fmt::format("{}", fmt::join(wrong, "; ")));
      for (std::int64_t c : checked) CHECK(c == pieces);
    }
  }
}

// A kernel that faults on the device at its last act: the fault is sticky, so the stream's
// when_reached callbacks never run and the consumer never hears of that piece. The run must
// fail naming the CUDA error and the actors, not wait (the stall watchdog is off here). The
// fault ruins the process's CUDA context, so the run happens in a child process: this same
// test program, with BATON_TEST_CUDA_FAULT_CHILD set, under a 90 s deadline.
TEST_CASE("Cuda.Runtime.DeviceFaultFailsTheJob" * doctest::timeout(150)) {
  if (!cuda_usable()) return;
  const char* test_name = "Cuda.Runtime.DeviceFaultFailsTheJob";
  if (std::getenv("BATON_TEST_CUDA_FAULT_CHILD") == nullptr) {
    const auto log = std::filesystem::temp_directory_path() / fmt::format("baton-cuda-fault-{}.log", ::getpid());
    const auto exe = std::filesystem::read_symlink("/proc/self/exe");
    const int status = std::system(fmt::format("BATON_TEST_CUDA_FAULT_CHILD=1 timeout 90 '{}' -tc='{}' > '{}' 2>&1",
                                               exe.string(), test_name, log.string())
                                       .c_str());
    std::stringstream out;
    out << std::ifstream(log).rdbuf();
    std::filesystem::remove(log);
    CHECK_MESSAGE(status == 0, fmt::format("the child run (exit status {}) said:\n{}", status, out.str()));
    return;
  }
  const Device gpu = Device::parse("cuda:0");
  Plan p;
  auto r = p.add_register({.name = "r", .shape = {1024}, .dtype = f32, .slots = 2});
  p.add_actor({.name = "faulty", .kind = ActorKind::source, .op = "test.fault", .where = {.device = gpu}, .outputs = {r},
               .pieces = 3});
  p.add_actor({.name = "sink", .op = "noop", .where = {.device = gpu}, .inputs = {{r}}});
  KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  reg.add_fn("test.fault", DeviceType::cuda, f32, [](KernelContext& ctx) {
    Tensor& y = *ctx.outputs[0];
    // Piece 2 writes through an address no allocation has: an illegal access on the device.
    float* to = ctx.piece == 2 ? reinterpret_cast<float*>(std::uintptr_t{256}) : y.data<float>().data();
    cuda::scale(to, y.numel(), 2.f, *ctx.stream);
  });
  RuntimeSettings s;
  s.mode = ExecutionMode::threaded;
  s.stall_timeout = std::chrono::milliseconds(0);
  Runtime rt(p, reg, s);
  const std::string why = test::thrown_message<JobError>([&] { rt.run(); });
  CHECK(test::contains(why, "cudaError"));
  CHECK((test::contains(why, "'faulty'") || test::contains(why, "'sink'")));
}
