// Other people's weights: the safetensors reader's F16 and BF16 tensors.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <boost/json.hpp>
#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/graph/safetensors.h"
#include "baton/kernels/data.h"
#include "skip.h"
#include "test_util.h"

using namespace baton;
namespace fs = std::filesystem;

namespace {

/// A fresh directory under /tmp, removed at the end of the test.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    static int counter = 0;
    path = fs::temp_directory_path() / fmt::format("baton-import-{}-{}-{}", ::getpid(), name, counter++);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// A safetensors file written byte by byte: `header` (JSON) and `data`.
void write_raw(const fs::path& p, const std::string& header, const std::string& data) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  const std::uint64_t n = header.size();
  char length[8];
  std::memcpy(length, &n, 8);
  out.write(length, 8);
  out << header << data;
}

/// binary16's value by its definition (IEEE 754-2008, 3.4), in double: a second derivation, by
/// arithmetic, of what half_to_float does with bits.
double half_value(std::uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const double magnitude = exponent == 0    ? std::ldexp(mantissa, -24)
                           : exponent == 31 ? (mantissa == 0 ? INFINITY : NAN)
                                            : std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  return sign != 0 ? -magnitude : magnitude;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<float> floats(const Tensor& t) { return {t.data<float>().begin(), t.data<float>().end()}; }

}  // namespace

TEST_CASE("Safetensors.F16ReadsAsTheExactFloatForEveryBitPattern") {
  TempDir tmp("f16");
  std::string data(2 * 65536, '\0');
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    std::memcpy(data.data() + 2 * i, &h, 2);
  }
  const fs::path p = tmp.path / "half.safetensors";
  write_raw(p, R"({"h":{"dtype":"F16","shape":[256,256],"data_offsets":[0,131072]}})", data);
  const safetensors::Contents c = safetensors::read(p);
  REQUIRE(c.tensors.size() == 1);
  const Tensor& t = c.tensors[0].second;
  CHECK(t.dtype() == DType::f32);
  CHECK(t.shape() == Shape{256, 256});
  std::int64_t wrong = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const double want = half_value(static_cast<std::uint16_t>(i));
    const float got = t.data<float>()[i];
    const bool same = std::isnan(want) ? std::isnan(got)
                                       : static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
    if (!same && ++wrong <= 5) FAIL_CHECK(fmt::format("F16 0x{:04x}: read {} but it is {}", i, got, want));
  }
  CHECK(wrong == 0);
  // A few by name: one, the largest half, the smallest subnormal, minus zero.
  CHECK(safetensors::half_to_float(0x3c00) == 1.0f);
  CHECK(safetensors::half_to_float(0x7bff) == 65504.0f);
  CHECK(safetensors::half_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(std::signbit(safetensors::half_to_float(0x8000)));
}

TEST_CASE("Safetensors.Bf16IsKeptAndOtherDtypesAreRefusedNamingTheTensor") {
  TempDir tmp("dtypes");
  // BF16 and F16 beside F32, as a mixed checkpoint has them.
  const std::array<std::uint16_t, 3> bf{0x3f80, 0xc040, 0x0001};  // 1, -3, the smallest subnormal
  const std::array<std::uint16_t, 2> half{0x4200, 0xbc00};         // 3, -1
  const float f = 0.25f;
  std::string data(reinterpret_cast<const char*>(bf.data()), 6);
  data.append(reinterpret_cast<const char*>(half.data()), 4);
  data.append(reinterpret_cast<const char*>(&f), 4);
  const fs::path p = tmp.path / "mixed.safetensors";
  write_raw(p,
            R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},"h":{"dtype":"F16","shape":[2],"data_offsets":[6,10]},)"
            R"("f":{"dtype":"F32","shape":[],"data_offsets":[10,14]}})",
            data);
  const safetensors::Contents c = safetensors::read(p);
  REQUIRE(c.find("b") != nullptr);
  CHECK(c.find("b")->dtype() == DType::bf16);
  CHECK(c.find("b")->data<bfloat16>()[1].bits == 0xc040);
  CHECK(to_float(c.find("b")->data<bfloat16>()[2]) == std::ldexp(1.0f, -133));
  CHECK(floats(*c.find("h")) == std::vector<float>{3.0f, -1.0f});
  CHECK(floats(*c.find("f")) == std::vector<float>{0.25f});

  // Dtypes baton has no tensors for, and an F16 tensor whose bytes do not match its shape.
  for (const char* dtype : {"F8_E4M3", "I8", "U16", "BOOL", "f16"}) {
    write_raw(p, fmt::format(R"({{"w":{{"dtype":"{}","shape":[2],"data_offsets":[0,2]}}}})", dtype), std::string(2, '\0'));
    const std::string e = error_of([&] { safetensors::read(p); });
    CHECK_MESSAGE(test::contains(e, fmt::format("{}: tensor 'w': dtype '{}' is not one baton reads (F32, F64, F16, BF16", p.string(), dtype)), e);
  }
  write_raw(p, R"({"w":{"dtype":"F16","shape":[3],"data_offsets":[0,4]}})", std::string(4, '\0'));
  CHECK(test::contains(error_of([&] { safetensors::read(p); }), "tensor 'w': F16 [3] needs 6 bytes but data_offsets [0, 4] hold 4"));
  write_raw(p, R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,6]}})", std::string(4, '\0'));
  CHECK(test::contains(error_of([&] { safetensors::read(p); }), "tensor 'w': data_offsets [0, 6] are outside the 4 bytes of data"));
  // baton writes BF16 and reads it back as it was.
  Tensor t = Tensor::empty({2}, DType::bf16);
  t.data<bfloat16>()[0] = to_bf16(1.5f);
  t.data<bfloat16>()[1] = to_bf16(-2.0f);
  safetensors::write(p, {{"t", t}});
  CHECK(safetensors::read(p).find("t")->data<bfloat16>()[0].bits == t.data<bfloat16>()[0].bits);
}
