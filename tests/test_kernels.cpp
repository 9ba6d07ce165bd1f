// kernels/: dtypes, devices, tensors, the CPU allocator, attributes, the kernel registry and
// the built-in CPU kernels, each checked against a straightforward reference.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "test_util.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels.h"

namespace {

using baton::test::contains;
using baton::test::thrown_message;

using baton::Attrs;
using baton::CpuAllocator;
using baton::Device;
using baton::DeviceType;
using baton::DType;
using baton::KernelConfig;
using baton::KernelContext;
using baton::KernelRegistry;
using baton::Shape;
using baton::Tensor;

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::i32, DType::i64, DType::u8};

// Fills a tensor with random values from `rng`; integers stay small enough that a sum of two
// cannot overflow.
template <class T>
void fill_random(Tensor& t, std::mt19937& rng) {
  for (auto& x : t.data<T>()) {
    if constexpr (std::is_floating_point_v<T>) {
      x = std::uniform_real_distribution<T>(T(-100), T(100))(rng);
    } else {
      x = static_cast<T>(std::uniform_int_distribution<std::int64_t>(-1'000'000, 1'000'000)(rng));
    }
  }
}

template <class T>
Tensor random_tensor(const Shape& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, baton::dtype_of<T>());
  fill_random<T>(t, rng);
  return t;
}

// Makes the kernel `op` for a cpu actor named "k" with the given attributes.
std::unique_ptr<baton::Kernel> make_kernel(const KernelRegistry& reg, std::string_view op, DType dtype,
                                           const Attrs& attrs = {}) {
  KernelConfig cfg{"k", Device{}, dtype, attrs};
  return reg.create(op, cfg);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// DType

TEST_CASE("DType.SizeOfIsBytesPerElement") {
  CHECK(baton::size_of(DType::f32) == sizeof(float));
  CHECK(baton::size_of(DType::f64) == sizeof(double));
  CHECK(baton::size_of(DType::i32) == sizeof(std::int32_t));
  CHECK(baton::size_of(DType::i64) == sizeof(std::int64_t));
  CHECK(baton::size_of(DType::u8) == sizeof(std::uint8_t));
  static_assert(baton::dtype_of<float>() == DType::f32);
  static_assert(baton::dtype_of<std::uint8_t>() == DType::u8);
}

TEST_CASE("DType.NameAndParseRoundTrip") {
  for (DType t : all_dtypes) {
    CAPTURE(baton::name(t));
    auto parsed = baton::parse_dtype(baton::name(t));
    REQUIRE(parsed.has_value());
    CHECK(*parsed == t);
  }
  CHECK(baton::name(DType::f32) == "f32");
  CHECK(baton::name(DType::i64) == "i64");
}

TEST_CASE("DType.UnknownNameParsesToNullopt") {
  CHECK_FALSE(baton::parse_dtype("fp16").has_value());
  CHECK_FALSE(baton::parse_dtype("").has_value());
  CHECK_FALSE(baton::parse_dtype("F32").has_value());
  CHECK_FALSE(baton::parse_dtype("f32 ").has_value());
}

// ---------------------------------------------------------------------------------------------
// Device

TEST_CASE("Device.ParseAcceptsTypeAndOptionalIndex") {
  Device cpu = Device::parse("cpu");
  CHECK(cpu.type == DeviceType::cpu);
  CHECK(cpu.index == 0);

  Device cpu3 = Device::parse("cpu:3");
  CHECK(cpu3.type == DeviceType::cpu);
  CHECK(cpu3.index == 3);

  Device cuda1 = Device::parse("cuda:1");
  CHECK(cuda1.type == DeviceType::cuda);
  CHECK(cuda1.index == 1);

  Device top = Device::parse("cpu:63");
  CHECK(top.index == Device::max_index);
}

TEST_CASE("Device.ParseRejectsBadTextNamingIt") {
  for (const char* bad : {"gpu:0", "cpu:x", "cpu:-1", "cpu:64", "cpu:", "cpu:1:2", "", "CPU"}) {
    CAPTURE(bad);
    std::string msg = thrown_message<std::invalid_argument>([&] { (void)Device::parse(bad); });
    CHECK(contains(msg, "'" + std::string(bad) + "'"));
  }
}

TEST_CASE("Device.StrRoundTrips") {
  for (DeviceType type : {DeviceType::cpu, DeviceType::cuda}) {
    for (int i = 0; i <= Device::max_index; ++i) {
      Device d{type, static_cast<std::uint8_t>(i)};
      CAPTURE(d.str());
      CHECK(Device::parse(d.str()) == d);
    }
  }
  CHECK(Device{}.str() == "cpu:0");
  CHECK(Device{DeviceType::cuda, 7}.str() == "cuda:7");
}

TEST_CASE("Device.CodeRoundTrips") {
  std::vector<std::uint8_t> seen;
  for (DeviceType type : {DeviceType::cpu, DeviceType::cuda}) {
    for (int i = 0; i <= Device::max_index; ++i) {
      Device d{type, static_cast<std::uint8_t>(i)};
      CAPTURE(d.str());
      CHECK(Device::from_code(d.code()) == d);
      seen.push_back(d.code());
    }
  }
  // Distinct devices get distinct codes.
  std::sort(seen.begin(), seen.end());
  CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
  static_assert(Device::from_code(Device{DeviceType::cuda, 5}.code()) == Device{DeviceType::cuda, 5});
}

// ---------------------------------------------------------------------------------------------
// Tensor

TEST_CASE("Tensor.DefaultIsUndefined") {
  Tensor t;
  CHECK_FALSE(t.defined());
  CHECK(t.raw() == nullptr);
  CHECK(t.numel() == 0);
  CHECK(t.describe() == "undefined tensor");
}

TEST_CASE("Tensor.EmptyAndZerosHaveShapeAndSize") {
  Tensor e = Tensor::empty({2, 3}, DType::f64);
  CHECK(e.defined());
  CHECK(e.shape() == Shape{2, 3});
  CHECK(e.dtype() == DType::f64);
  CHECK(e.numel() == 6);
  CHECK(e.nbytes() == 48);
  CHECK(e.dim(0) == 2);
  CHECK(e.dim(1) == 3);
  CHECK_THROWS_AS((void)e.dim(2), std::out_of_range);
  CHECK(e.device() == Device{});

  Tensor z = Tensor::zeros({4, 5, 6}, DType::i32);
  CHECK(z.numel() == 120);
  CHECK(z.nbytes() == 480);
  for (auto x : z.data<std::int32_t>()) CHECK(x == 0);
}

TEST_CASE("Tensor.EmptyShapeIsAScalar") {
  CHECK(baton::numel(Shape{}) == 1);
  Tensor s = Tensor::zeros({}, DType::f32);
  CHECK(s.numel() == 1);
  CHECK(s.nbytes() == 4);
  REQUIRE(s.data<float>().size() == 1);
  CHECK(s.data<float>()[0] == 0.0f);
}

TEST_CASE("Tensor.ZeroExtentHasNoElements") {
  CHECK(baton::numel(Shape{0}) == 0);
  CHECK(baton::numel(Shape{3, 0, 5}) == 0);
  Tensor t = Tensor::zeros({0}, DType::i64);
  CHECK(t.defined());
  CHECK(t.numel() == 0);
  CHECK(t.nbytes() == 0);
  CHECK(t.data<std::int64_t>().empty());
}

TEST_CASE("Tensor.NegativeExtentThrows") {
  CHECK_THROWS_AS((void)baton::numel(Shape{2, -1}), std::invalid_argument);
  CHECK_THROWS_AS((void)Tensor::empty({-3}, DType::f32), std::invalid_argument);
  CHECK_THROWS_AS((void)Tensor::zeros({4, -2}, DType::u8), std::invalid_argument);
  std::string msg = thrown_message<std::invalid_argument>([] { (void)baton::numel(Shape{2, -1}); });
  CHECK(contains(msg, "[2, -1]"));
}

// Regression: numel({2^40, 2^40}) once overflowed (undefined behaviour, 0 on x86-64), so such a
// shape passed for an empty tensor instead of failing early.
TEST_CASE("Tensor.NumelOverflowThrows") {
  const std::int64_t big = std::int64_t{1} << 40;
  CHECK_THROWS_AS((void)baton::numel(Shape{big, big}), std::exception);
  CHECK_THROWS_AS((void)Tensor::empty({big, big}, DType::f32), std::exception);
}

TEST_CASE("Tensor.DataWithTheWrongTypeThrows") {
  Tensor t = Tensor::zeros({3}, DType::f32);
  CHECK_NOTHROW((void)t.data<float>());
  CHECK_THROWS_AS((void)t.data<double>(), std::logic_error);
  CHECK_THROWS_AS((void)t.data<std::int32_t>(), std::logic_error);
  const Tensor& ct = t;
  CHECK_THROWS_AS((void)ct.data<std::uint8_t>(), std::logic_error);
  std::string msg = thrown_message<std::logic_error>([&] { (void)t.data<std::int64_t>(); });
  CHECK(contains(msg, "f32[3]"));
  CHECK(contains(msg, "i64"));
}

TEST_CASE("Tensor.DescribeNamesDtypeShapeAndDevice") {
  CHECK(Tensor::empty({2, 3}, DType::f32).describe() == "f32[2, 3] on cpu:0");
  CHECK(Tensor::empty({}, DType::u8).describe() == "u8[] on cpu:0");
  CpuAllocator alloc(Device{DeviceType::cpu, 2});
  CHECK(Tensor::empty({7}, DType::i64, alloc).describe() == "i64[7] on cpu:2");
}

TEST_CASE("Tensor.CopiesShareStorage") {
  Tensor a = Tensor::zeros({8}, DType::i32);
  Tensor b = a;  // NOLINT(performance-unnecessary-copy-initialization): the copy is the test
  CHECK(b.shares_storage_with(a));
  CHECK(b.raw() == a.raw());
  b.data<std::int32_t>()[5] = 42;
  CHECK(a.data<std::int32_t>()[5] == 42);

  Tensor c = Tensor::zeros({8}, DType::i32);
  CHECK_FALSE(c.shares_storage_with(a));
  CHECK(c.raw() != a.raw());
}

TEST_CASE("CpuAllocator.CountsBytesInUseAndPeak") {
  CpuAllocator alloc;
  CHECK(alloc.bytes_in_use() == 0);
  CHECK(alloc.peak_bytes() == 0);
  {
    Tensor a = Tensor::empty({10}, DType::f32, alloc);  // 40 bytes
    CHECK(alloc.bytes_in_use() == 40);
    {
      Tensor b = Tensor::empty({3, 4}, DType::f64, alloc);  // 96 bytes
      CHECK(alloc.bytes_in_use() == 136);
      CHECK(alloc.peak_bytes() == 136);
    }
    CHECK(alloc.bytes_in_use() == 40);
    CHECK(alloc.peak_bytes() == 136);
    Tensor c = Tensor::empty({16}, DType::u8, alloc);
    CHECK(alloc.bytes_in_use() == 56);
    CHECK(alloc.peak_bytes() == 136);
  }
  CHECK(alloc.bytes_in_use() == 0);
  CHECK(alloc.peak_bytes() == 136);
}

TEST_CASE("CpuAllocator.MemoryIs64ByteAligned") {
  CpuAllocator alloc;
  std::vector<Tensor> keep;
  for (std::int64_t n : {1, 3, 7, 13, 64, 65, 1000, 0}) {
    keep.push_back(Tensor::empty({n}, DType::u8, alloc));
    keep.push_back(Tensor::empty({n}, DType::u8));  // plain host memory, no allocator
  }
  for (const Tensor& t : keep) {
    CAPTURE(t.describe());
    REQUIRE(t.raw() != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(t.raw()) % CpuAllocator::alignment == 0);
  }
  void* p = alloc.allocate(5);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
  CHECK(alloc.bytes_in_use() == 5 + 1 + 3 + 7 + 13 + 64 + 65 + 1000);
  alloc.deallocate(p, 5);
}

TEST_CASE("CpuAllocator.FreedWhenTheLastTensorGoesAway") {
  CpuAllocator alloc;
  Tensor survivor;
  {
    Tensor a = Tensor::empty({256}, DType::f32, alloc);
    Tensor b = a;
    survivor = b;
    CHECK(alloc.bytes_in_use() == 1024);
  }
  // Two of three handles are gone; the storage lives on.
  CHECK(alloc.bytes_in_use() == 1024);
  CHECK(survivor.defined());
  survivor = Tensor{};
  CHECK(alloc.bytes_in_use() == 0);
  CHECK(alloc.peak_bytes() == 1024);
}

// ---------------------------------------------------------------------------------------------
// Attrs

TEST_CASE("Attrs.TypedGettersWithFallbacks") {
  Attrs a{{"ns", std::int64_t{1000}}, {"rate", 0.25}, {"mode", std::string("fast")}};
  CHECK(a.has("ns"));
  CHECK_FALSE(a.has("missing"));
  CHECK(a.get_int("ns", -1) == 1000);
  CHECK(a.get_int("missing", -1) == -1);
  CHECK(a.get_double("rate", 9.0) == 0.25);
  CHECK(a.get_double("missing", 9.0) == 9.0);
  // An integer is a number too.
  CHECK(a.get_double("ns", 9.0) == 1000.0);
  CHECK(a.get_string("mode", "slow") == "fast");
  CHECK(a.get_string("missing", "slow") == "slow");

  a.set("ns", std::int64_t{5});
  CHECK(a.get_int("ns", -1) == 5);
}

TEST_CASE("Attrs.WrongTypeThrowsNamingTheAttribute") {
  Attrs a{{"ns", std::int64_t{1000}}, {"rate", 0.25}, {"mode", std::string("fast")},
          {"dims", std::vector<std::int64_t>{1, 2}}};
  auto check_throws = [](auto fn, const char* attr) {
    std::string msg = thrown_message<std::invalid_argument>(fn);
    CHECK(contains(msg, std::string("'") + attr + "'"));
  };
  check_throws([&] { (void)a.get_int("rate", 0); }, "rate");
  check_throws([&] { (void)a.get_int("mode", 0); }, "mode");
  check_throws([&] { (void)a.get_int("dims", 0); }, "dims");
  check_throws([&] { (void)a.get_double("mode", 0); }, "mode");
  check_throws([&] { (void)a.get_string("ns", ""); }, "ns");
  check_throws([&] { (void)a.get_string("rate", ""); }, "rate");
}

TEST_CASE("Attrs.StrIsSortedAndDeterministic") {
  CHECK(Attrs{}.str().empty());
  Attrs a;
  a.set("zeta", std::int64_t{7}).set("alpha", std::string("x")).set("mid", 0.5);
  a.set("dims", std::vector<std::int64_t>{2, 3});
  Attrs b;  // same values, other insertion order
  b.set("dims", std::vector<std::int64_t>{2, 3}).set("mid", 0.5).set("alpha", std::string("x"));
  b.set("zeta", std::int64_t{7});
  CHECK(a.str() == R"({alpha="x", dims=[2,3], mid=0.5, zeta=7})");
  CHECK(a.str() == b.str());
  CHECK(a == b);
  CHECK(a.str() == a.str());
}

// ---------------------------------------------------------------------------------------------
// KernelRegistry

TEST_CASE("KernelRegistry.BuiltinKernelsAreRegisteredForCpu") {
  const auto reg = KernelRegistry::with_builtin_kernels();
  for (DType t : all_dtypes) {
    CAPTURE(baton::name(t));
    CHECK(reg.contains("noop", DeviceType::cpu, t));
    CHECK(reg.contains("copy", DeviceType::cpu, t));
    CHECK(reg.contains("spin_ns", DeviceType::cpu, t));
    CHECK(reg.contains("sleep_ns", DeviceType::cpu, t));
  }
  // The arithmetic kernels exist for the four arithmetic dtypes.
  for (DType t : {DType::f32, DType::f64, DType::i32, DType::i64}) {
    CAPTURE(baton::name(t));
    CHECK(reg.contains("add", DeviceType::cpu, t));
    CHECK(reg.contains("fill_piece", DeviceType::cpu, t));
  }
  // A host-only source: no CUDA variant, with or without the CUDA path in the build.
  CHECK_FALSE(reg.contains("fill_piece", DeviceType::cuda, DType::f32));
  CHECK(reg.contains("add", DeviceType::cuda, DType::f32) == baton::cuda::built_with_cuda());
  CHECK_FALSE(reg.contains("no_such_op", DeviceType::cpu, DType::f32));

  std::string d = reg.describe();
  CHECK(contains(d, "add: cpu/f32 cpu/f64 cpu/i32 cpu/i64"));
  for (const char* op : {"noop:", "copy:", "fill_piece:", "spin_ns:", "sleep_ns:"}) CHECK(contains(d, op));
}

TEST_CASE("KernelRegistry.CreateUnknownThrowsNamingOpDeviceDtypeAndActor") {
  const auto reg = KernelRegistry::with_builtin_kernels();
  Attrs none;

  SUBCASE("unknown op") {
    KernelConfig cfg{"my_actor", Device{}, DType::f32, none};
    std::string msg = thrown_message<std::invalid_argument>([&] { (void)reg.create("no_such_op", cfg); });
    CHECK(contains(msg, "'no_such_op'"));
    CHECK(contains(msg, "cpu/f32"));
    CHECK(contains(msg, "'my_actor'"));
  }
  SUBCASE("unknown dtype lists the variants that exist") {
    KernelConfig cfg{"adder", Device{}, DType::u8, none};
    std::string msg = thrown_message<std::invalid_argument>([&] { (void)reg.create("add", cfg); });
    CHECK(contains(msg, "'add'"));
    CHECK(contains(msg, "cpu/u8"));
    CHECK(contains(msg, "'adder'"));
    CHECK(contains(msg, "cpu/f32 cpu/f64 cpu/i32 cpu/i64"));
  }
  SUBCASE("unknown device lists the variants that exist") {
    KernelConfig cfg{"gpu_adder", Device{DeviceType::cuda, 0}, DType::f32, none};
    std::string msg = thrown_message<std::invalid_argument>([&] { (void)reg.create("fill_piece", cfg); });
    CHECK(contains(msg, "'fill_piece'"));
    CHECK(contains(msg, "cuda/f32"));
    CHECK(contains(msg, "'gpu_adder'"));
    CHECK(contains(msg, "cpu/f32"));
  }
}

TEST_CASE("KernelRegistry.AddFnRegistersACustomKernel") {
  auto reg = KernelRegistry::with_builtin_kernels();
  int calls = 0;
  std::int64_t seen_piece = -1;
  reg.add_fn("double_it", DeviceType::cpu, DType::f32, [&](KernelContext& ctx) {
    ++calls;
    seen_piece = ctx.piece;
    auto in = ctx.inputs[0]->data<float>();
    auto out = ctx.outputs[0]->data<float>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = 2 * in[i];
  });
  CHECK(reg.contains("double_it", DeviceType::cpu, DType::f32));
  CHECK_FALSE(reg.contains("double_it", DeviceType::cpu, DType::f64));

  auto k = make_kernel(reg, "double_it", DType::f32);
  REQUIRE(k);
  Tensor in = Tensor::empty({4}, DType::f32);
  Tensor out = Tensor::zeros({4}, DType::f32);
  for (int i = 0; i < 4; ++i) in.data<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i) + 0.5f;
  const Tensor* ins[] = {&in};
  Tensor* outs[] = {&out};
  KernelContext ctx{ins, outs, 17};
  k->compute(ctx);
  CHECK(calls == 1);
  CHECK(seen_piece == 17);
  for (int i = 0; i < 4; ++i) CHECK(out.data<float>()[static_cast<std::size_t>(i)] == 2.0f * (static_cast<float>(i) + 0.5f));
}

TEST_CASE("KernelRegistry.FactoryReadsAttrs") {
  const auto reg = KernelRegistry::with_builtin_kernels();
  SUBCASE("spin_ns without ns throws naming the actor") {
    Attrs none;
    KernelConfig cfg{"slow_actor", Device{}, DType::f32, none};
    std::string msg = thrown_message<std::invalid_argument>([&] { (void)reg.create("spin_ns", cfg); });
    CHECK(contains(msg, "'slow_actor'"));
    CHECK(contains(msg, "'ns'"));
  }
  SUBCASE("sleep_ns with a negative ns throws naming the actor") {
    Attrs neg{{"ns", std::int64_t{-5}}};
    KernelConfig cfg{"sleepy", Device{}, DType::i32, neg};
    std::string msg = thrown_message<std::invalid_argument>([&] { (void)reg.create("sleep_ns", cfg); });
    CHECK(contains(msg, "'sleepy'"));
  }
  SUBCASE("a custom factory sees the actor, device, dtype and attributes") {
    auto mine = KernelRegistry::with_builtin_kernels();
    std::string seen_actor;
    Device seen_device;
    DType seen_dtype = DType::u8;
    std::int64_t seen_seed = 0;
    mine.add("seeded", DeviceType::cpu, DType::i64, [&](const KernelConfig& cfg) {
      seen_actor = std::string(cfg.actor);
      seen_device = cfg.device;
      seen_dtype = cfg.dtype;
      seen_seed = cfg.attrs.get_int("seed", -1);
      return KernelRegistry::with_builtin_kernels().create("noop", cfg);
    });
    Attrs attrs{{"seed", std::int64_t{7}}};
    KernelConfig cfg{"rng", Device{DeviceType::cpu, 3}, DType::i64, attrs};
    auto k = mine.create("seeded", cfg);
    CHECK(k != nullptr);
    CHECK(seen_actor == "rng");
    CHECK(seen_device == Device{DeviceType::cpu, 3});
    CHECK(seen_dtype == DType::i64);
    CHECK(seen_seed == 7);
  }
}

TEST_CASE("KernelRegistry.FactoryThatReturnsNothingThrows") {
  KernelRegistry reg;
  reg.add("broken", DeviceType::cpu, DType::f32,
          [](const KernelConfig&) -> std::unique_ptr<baton::Kernel> { return nullptr; });
  Attrs none;
  KernelConfig cfg{"who", Device{}, DType::f32, none};
  std::string msg = thrown_message<std::invalid_argument>([&] { (void)reg.create("broken", cfg); });
  CHECK(contains(msg, "'broken'"));
  CHECK(contains(msg, "'who'"));
}

// ---------------------------------------------------------------------------------------------
// The built-in CPU kernels against references

namespace {

template <class T>
void check_add_against_reference(std::mt19937& rng) {
  const auto reg = KernelRegistry::with_builtin_kernels();
  auto add = make_kernel(reg, "add", baton::dtype_of<T>());
  for (const Shape& shape : {Shape{}, Shape{1}, Shape{17}, Shape{3, 5, 7}, Shape{0}}) {
    CAPTURE(baton::to_string(shape));
    Tensor a = random_tensor<T>(shape, rng);
    Tensor b = random_tensor<T>(shape, rng);
    Tensor out = Tensor::empty(shape, baton::dtype_of<T>());
    const Tensor* ins[] = {&a, &b};
    Tensor* outs[] = {&out};
    KernelContext ctx{ins, outs, 0};
    add->compute(ctx);
    auto av = a.data<T>();
    auto bv = b.data<T>();
    auto ov = out.data<T>();
    REQUIRE(ov.size() == av.size());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < ov.size(); ++i) {
      // One addition, rounded once: the reference is exact for floats as well.
      const T want = static_cast<T>(av[i] + bv[i]);
      if (ov[i] != want) ++wrong;
    }
    CHECK(wrong == 0);
  }
}

}  // namespace

TEST_CASE("Kernels.AddMatchesTheReference") {
  std::mt19937 rng(20240601);
  SUBCASE("f32") { check_add_against_reference<float>(rng); }
  SUBCASE("f64") { check_add_against_reference<double>(rng); }
  SUBCASE("i32") { check_add_against_reference<std::int32_t>(rng); }
  SUBCASE("i64") { check_add_against_reference<std::int64_t>(rng); }
}

TEST_CASE("Kernels.AddWritesInPlaceWhenOutputAliasesAnInput") {
  // The accumulate actor sums into its own output slot: out = out + in.
  std::mt19937 rng(7);
  const auto reg = KernelRegistry::with_builtin_kernels();
  auto add = make_kernel(reg, "add", DType::f64);
  Tensor acc = random_tensor<double>({33}, rng);
  Tensor in = random_tensor<double>({33}, rng);
  std::vector<double> want(33);
  for (std::size_t i = 0; i < 33; ++i) want[i] = acc.data<double>()[i] + in.data<double>()[i];
  const Tensor* ins[] = {&acc, &in};
  Tensor* outs[] = {&acc};
  KernelContext ctx{ins, outs, 0};
  add->compute(ctx);
  for (std::size_t i = 0; i < 33; ++i) CHECK(acc.data<double>()[i] == want[i]);
}

TEST_CASE("Kernels.AddWithMismatchedSizesThrows") {
  const auto reg = KernelRegistry::with_builtin_kernels();
  auto add = make_kernel(reg, "add", DType::f32);
  Tensor a = Tensor::zeros({4}, DType::f32);
  Tensor b = Tensor::zeros({5}, DType::f32);
  Tensor out = Tensor::zeros({4}, DType::f32);
  SUBCASE("inputs differ") {
    const Tensor* ins[] = {&a, &b};
    Tensor* outs[] = {&out};
    KernelContext ctx{ins, outs, 0};
    CHECK_THROWS_AS(add->compute(ctx), std::invalid_argument);
  }
  SUBCASE("output differs") {
    Tensor big = Tensor::zeros({8}, DType::f32);
    const Tensor* ins[] = {&a, &a};
    Tensor* outs[] = {&big};
    KernelContext ctx{ins, outs, 0};
    CHECK_THROWS_AS(add->compute(ctx), std::invalid_argument);
  }
  SUBCASE("an input is missing") {
    const Tensor* ins[] = {&a, nullptr};
    Tensor* outs[] = {&out};
    KernelContext ctx{ins, outs, 0};
    CHECK_THROWS_AS(add->compute(ctx), std::invalid_argument);
  }
  SUBCASE("a dtype differs") {
    Tensor d = Tensor::zeros({4}, DType::f64);
    const Tensor* ins[] = {&a, &d};
    Tensor* outs[] = {&out};
    KernelContext ctx{ins, outs, 0};
    CHECK_THROWS_AS(add->compute(ctx), std::logic_error);
  }
}

TEST_CASE("Kernels.CopyMatchesTheReference") {
  std::mt19937 rng(11);
  const auto reg = KernelRegistry::with_builtin_kernels();
  for (DType t : all_dtypes) {
    CAPTURE(baton::name(t));
    auto copy = make_kernel(reg, "copy", t);
    Tensor in = Tensor::empty({5, 13}, t);
    auto* bytes = static_cast<unsigned char*>(in.raw());
    for (std::size_t i = 0; i < in.nbytes(); ++i) bytes[i] = static_cast<unsigned char>(rng());
    Tensor out = Tensor::zeros({5, 13}, t);
    const Tensor* ins[] = {&in};
    Tensor* outs[] = {&out};
    KernelContext ctx{ins, outs, 3};
    copy->compute(ctx);
    CHECK(std::memcmp(in.raw(), out.raw(), in.nbytes()) == 0);
    CHECK_FALSE(out.shares_storage_with(in));
  }
  // Sizes must agree.
  auto copy = make_kernel(reg, "copy", DType::f32);
  Tensor in = Tensor::zeros({4}, DType::f32);
  Tensor out = Tensor::zeros({3}, DType::f32);
  const Tensor* ins[] = {&in};
  Tensor* outs[] = {&out};
  KernelContext ctx{ins, outs, 0};
  CHECK_THROWS_AS(copy->compute(ctx), std::invalid_argument);
}

TEST_CASE("Kernels.FillPieceWritesPiecePlusOffset") {
  const auto reg = KernelRegistry::with_builtin_kernels();
  std::mt19937 rng(99);
  auto check = [&]<class T>(T /*tag*/, std::int64_t offset, std::int64_t piece) {
    Attrs attrs{{"offset", offset}};
    auto fill = make_kernel(reg, "fill_piece", baton::dtype_of<T>(), attrs);
    Tensor a = random_tensor<T>({3, 4}, rng);
    Tensor b = random_tensor<T>({9}, rng);
    Tensor* outs[] = {&a, &b};
    KernelContext ctx{{}, outs, piece};
    fill->compute(ctx);
    const T want = static_cast<T>(piece + offset);
    std::size_t wrong = 0;
    for (const Tensor* t : {&a, &b}) {
      for (T x : t->data<T>()) wrong += x != want;
    }
    CHECK(wrong == 0);
  };
  for (int round = 0; round < 20; ++round) {
    const std::int64_t piece = std::uniform_int_distribution<std::int64_t>(0, 100'000)(rng);
    const std::int64_t offset = std::uniform_int_distribution<std::int64_t>(-1000, 1000)(rng);
    CAPTURE(piece);
    CAPTURE(offset);
    check(float{}, offset, piece);
    check(double{}, offset, piece);
    check(std::int32_t{}, offset, piece);
    check(std::int64_t{}, offset, piece);
  }
  // Without the attribute the offset is 0.
  auto fill = make_kernel(reg, "fill_piece", DType::i64);
  Tensor t = Tensor::zeros({4}, DType::i64);
  Tensor* outs[] = {&t};
  KernelContext ctx{{}, outs, 41};
  fill->compute(ctx);
  for (auto x : t.data<std::int64_t>()) CHECK(x == 41);
}

namespace {

// Runs a fixed-cost kernel (spin_ns / sleep_ns) over random input and checks that it copies
// its input and does not return before `ns` have passed. Only the lower bound is asserted:
// a loaded machine may take longer.
void check_fixed_cost_kernel(const char* op, std::int64_t ns) {
  CAPTURE(op);
  CAPTURE(ns);
  const auto reg = KernelRegistry::with_builtin_kernels();
  std::mt19937 rng(static_cast<std::mt19937::result_type>(ns));
  Attrs attrs{{"ns", ns}};
  auto k = make_kernel(reg, op, DType::f32, attrs);
  Tensor in = random_tensor<float>({64}, rng);
  Tensor out = Tensor::zeros({64}, DType::f32);
  const Tensor* ins[] = {&in};
  Tensor* outs[] = {&out};
  KernelContext ctx{ins, outs, 0};
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    k->compute(ctx);
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count() >= ns);
  }
  CHECK(std::memcmp(in.raw(), out.raw(), in.nbytes()) == 0);

  // With no input (a source) it writes nothing and still takes its time.
  Tensor untouched = Tensor::zeros({4}, DType::f32);
  Tensor* only_out[] = {&untouched};
  KernelContext src_ctx{{}, only_out, 0};
  const auto t0 = std::chrono::steady_clock::now();
  k->compute(src_ctx);
  CHECK(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() >= ns);
  for (float x : untouched.data<float>()) CHECK(x == 0.0f);
}

}  // namespace

TEST_CASE("Kernels.SpinNsCopiesAndTakesAtLeastNs") {
  check_fixed_cost_kernel("spin_ns", 0);
  check_fixed_cost_kernel("spin_ns", 50'000);
  check_fixed_cost_kernel("spin_ns", 3'000'000);
}

TEST_CASE("Kernels.SleepNsCopiesAndTakesAtLeastNs") {
  check_fixed_cost_kernel("sleep_ns", 0);
  check_fixed_cost_kernel("sleep_ns", 50'000);
  check_fixed_cost_kernel("sleep_ns", 3'000'000);
}

TEST_CASE("Kernels.NoopTouchesNothing") {
  const auto reg = KernelRegistry::with_builtin_kernels();
  auto noop = make_kernel(reg, "noop", DType::u8);
  Tensor in = Tensor::empty({8}, DType::u8);
  for (auto& x : in.data<std::uint8_t>()) x = 0xAB;
  Tensor out = Tensor::zeros({8}, DType::u8);
  const Tensor* ins[] = {&in};
  Tensor* outs[] = {&out};
  KernelContext ctx{ins, outs, 0};
  noop->compute(ctx);
  for (auto x : out.data<std::uint8_t>()) CHECK(x == 0);
}
