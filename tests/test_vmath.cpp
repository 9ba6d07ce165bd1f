// The vectorised float32 GELU of the CPU kernels (baton/kernels/vmath.h).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "baton/kernels/vmath.h"

namespace {

using baton::vmath::gelu_grad_on;
using baton::vmath::gelu_on;

/// Uniform in [-14, 14] (past -14 GELU is below float's smallest normal), and the edges.
std::vector<float> inputs(std::size_t n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-14.f, 14.f);
  std::vector<float> x(n);
  for (float& v : x) v = u(g);
  const float edges[] = {0.f, -0.f, 1e-30f, -1e-30f, 1e-3f, -1e-3f, -0.7517915f, 30.f, -30.f, 3e38f, -3e38f};
  for (std::size_t i = 0; i < std::size(edges) && i < n; ++i) x[i * 7 % n] = edges[i];
  return x;
}

/// The paths this machine and build have; the first is what the kernels use.
std::vector<std::string> paths() {
  std::vector<std::string> p{baton::vmath::path()};
  for (const char* other : {"avx", "sse2", "scalar"}) {
    float x = 1, y;
    if (p[0] != other && gelu_on(other, &x, nullptr, 1, &y, 1)) p.push_back(other);
  }
  return p;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

// Against the formula in double: 0.5 x erfc(-x / sqrt 2) and its derivative. The float formula
// itself is off by up to 2 z^2 times float's rounding of z = -x / sqrt 2 (erfc's relative
// sensitivity to its argument), about 1.6e-6 where |gelu| reaches 1e-6 (x near -5.2); below
// that the error is absolute and tiny. Measured over 4 million inputs: relative 2.4e-6 (the
// vector paths; 1.5e-6 with the C library's erfc) and absolute 2e-12; the gradient 65 float
// ulps of its scale |dy| (Phi(x) + |x| phi(x)), 3.9e-6 (it crosses zero near x = -0.75, so it
// is measured against that scale, not its own value). Bounds: 8e-6 relative plus 1e-11. No
// BLAS and nothing machine-dependent is involved (see the next test), so they hold everywhere.
TEST_CASE("Vmath.Gelu.IsCloseToTheFormulaInDouble") {
  const std::vector<float> x = inputs(200000, 7), dy = inputs(200000, 8);
  for (const std::string& path : paths()) {
    CAPTURE(path);
    std::vector<float> y(x.size()), dx(x.size());
    REQUIRE(gelu_on(path.c_str(), x.data(), nullptr, 1, y.data(), x.size()));
    REQUIRE(gelu_grad_on(path.c_str(), x.data(), nullptr, 1, dy.data(), dx.data(), x.size()));
    std::size_t bad = 0, bad_grad = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double v = x[i], c = 0.5 * std::erfc(-v / std::sqrt(2.0));
      const double pdf = std::exp(-0.5 * v * v) / std::sqrt(2 * M_PI);
      const double want = v * c, want_grad = dy[i] * (c + v * pdf);
      const double scale = std::fabs(dy[i]) * (c + std::fabs(v) * pdf);
      if (std::isinf(want) || std::isinf(x[i])) {
        bad += y[i] != static_cast<float>(want);
        continue;
      }
      bad += !(std::fabs(y[i] - want) <= 8e-6 * std::fabs(want) + 1e-11);
      bad_grad += !(std::fabs(dx[i] - want_grad) <= 8e-6 * scale + 1e-11);
    }
    CHECK(bad == 0);
    CHECK(bad_grad == 0);
  }
  // Infinities and NaN as the formula gives them: gelu(inf) = inf, gelu(-inf) = -inf * 0 = NaN.
  const float special[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN()};
  for (const std::string& path : paths()) {
    float y[3];
    REQUIRE(gelu_on(path.c_str(), special, nullptr, 1, y, 3));
    CHECK(y[0] == std::numeric_limits<float>::infinity());
    CHECK(std::isnan(y[1]));
    CHECK(std::isnan(y[2]));
  }
}

// The vector paths give the same bits: AVX's 8 lanes and SSE2's 4 (SLEEF's "cinz" exp, without
// FMA, is the same function in every width, and the rest is IEEE arithmetic), so the results do
// not depend on the machine. Nor on an element's place: a tensor cut at any offset (as a
// tensor-parallel shard or the last partial vector cuts it), in place, or with the bias added
// inside (bias_gelu) instead of by an add first, the elements keep their bits.
TEST_CASE("Vmath.Gelu.EveryPathAndPlaceGivesTheSameBits") {
  const std::size_t n = 1003;
  const std::vector<float> x = inputs(n, 3), dy = inputs(n, 4);
  auto run = [&](const std::string& path, const float* in, const float* b, std::size_t cols, const float* g,
                 std::size_t count) {
    std::vector<float> out(count);
    const bool ok = g == nullptr ? gelu_on(path.c_str(), in, b, cols, out.data(), count)
                                 : gelu_grad_on(path.c_str(), in, b, cols, g, out.data(), count);
    REQUIRE(ok);
    return out;
  };
  const std::string best = baton::vmath::path();
  for (const float* g : {static_cast<const float*>(nullptr), dy.data()}) {
    CAPTURE(g == nullptr ? "gelu" : "gelu_grad");
    const std::vector<float> whole = run(best, x.data(), nullptr, 1, g, n);
    if (best == "avx") CHECK(same_bits(whole, run("sse2", x.data(), nullptr, 1, g, n)));
    if (best != "avx") MESSAGE("no AVX here: the AVX path is not compared with SSE2's");
    for (std::size_t offset = 1; offset <= 9; ++offset) {
      CAPTURE(offset);
      const auto part = run(best, x.data() + offset, nullptr, 1, g == nullptr ? nullptr : g + offset, n - offset);
      CHECK(same_bits(part, std::vector<float>(whole.begin() + static_cast<std::ptrdiff_t>(offset), whole.end())));
    }
    std::vector<float> in_place = x;
    if (g == nullptr) {
      REQUIRE(gelu_on(best.c_str(), in_place.data(), nullptr, 1, in_place.data(), n));
    } else {
      REQUIRE(gelu_grad_on(best.c_str(), in_place.data(), nullptr, 1, g, in_place.data(), n));
    }
    CHECK(same_bits(in_place, whole));
    for (std::size_t cols : {1, 3, 8, 13, 64}) {
      CAPTURE(cols);
      const std::size_t rows = 1 + 500 / cols, m = rows * cols;
      const std::vector<float> bias = inputs(cols, 5);
      std::vector<float> sum(m);
      for (std::size_t i = 0; i < m; ++i) sum[i] = x[i % n] + bias[i % cols];
      std::vector<float> xs(m), gs(m);
      for (std::size_t i = 0; i < m; ++i) xs[i] = x[i % n], gs[i] = dy[i % n];
      const float* gp = g == nullptr ? nullptr : gs.data();
      CHECK(same_bits(run(best, xs.data(), bias.data(), cols, gp, m), run(best, sum.data(), nullptr, 1, gp, m)));
    }
  }
}

// exp for the softmax and cross-entropy rows: SLEEF's (its bound: 1 ulp) against exp in double of
// the same float difference, within 2 float ulps of the exact value over [-80, 80) (past about
// -87 the results are subnormal; past 88.7 they overflow); -inf gives 0 (a masked score), NaN
// NaN, overflow inf. The same bits on every vector path and at every offset.
TEST_CASE("Vmath.Exp.IsWithinTwoUlpsAndTheSameOnEveryPath") {
  std::mt19937 g(11);
  std::uniform_real_distribution<float> u(-80.f, 80.f);
  const std::size_t n = 100003;
  std::vector<float> x(n);
  for (float& v : x) v = u(g);
  const float shift = 1.25f;
  for (const std::string& path : paths()) {
    CAPTURE(path);
    std::vector<float> y(n);
    REQUIRE(baton::vmath::exp_shifted_on(path.c_str(), x.data(), shift, y.data(), n));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double want = std::exp(static_cast<double>(x[i] - shift));
      const auto w = static_cast<float>(want);
      const double ulp = std::nextafter(w, std::numeric_limits<float>::infinity()) - w;
      bad += !(std::fabs(y[i] - want) <= 2 * ulp);
    }
    CHECK(bad == 0);
    const float special[] = {-std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 200.f};
    float out[3];
    REQUIRE(baton::vmath::exp_shifted_on(path.c_str(), special, 0.f, out, 3));
    CHECK(out[0] == 0.f);
    CHECK(std::isnan(out[1]));
    CHECK(out[2] == std::numeric_limits<float>::infinity());
  }
  const std::string best = baton::vmath::path();
  std::vector<float> whole(n), other(n);
  baton::vmath::exp_shifted(x.data(), shift, whole.data(), n);
  if (best == "avx") {
    REQUIRE(baton::vmath::exp_shifted_on("sse2", x.data(), shift, other.data(), n));
    CHECK(same_bits(whole, other));
  }
  for (std::size_t offset = 1; offset <= 9; ++offset) {
    std::vector<float> part(n - offset);
    baton::vmath::exp_shifted(x.data() + offset, shift, part.data(), part.size());
    CHECK(same_bits(part, std::vector<float>(whole.begin() + static_cast<std::ptrdiff_t>(offset), whole.end())));
  }
}
