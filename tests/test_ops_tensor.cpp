// The tensor ops of kernels/ops.h: every op against a straightforward float64 reference loop,
// in f32 and f64, on outputs poisoned with NaN; the gradient relationships autodiff relies on,
// checked in f64 against central finite differences; and shape errors that name the op.
#include <doctest/doctest.h>

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "test_util.h"
#include "baton/kernels.h"

namespace {

using baton::test::contains;

using baton::Attrs;
using baton::Device;
using baton::DType;
using baton::Kernel;
using baton::KernelConfig;
using baton::KernelContext;
using baton::KernelRegistry;
using baton::Shape;
using baton::Tensor;
using Ints = std::vector<std::int64_t>;
using Values = std::vector<double>;

const KernelRegistry& registry() {
  static const KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  return reg;
}

std::unique_ptr<Kernel> make(const char* op, DType dtype, const Attrs& attrs = {}) {
  return registry().create(op, KernelConfig{"k", Device{}, dtype, attrs});
}

void run(Kernel& k, std::vector<const Tensor*> ins, std::vector<Tensor*> outs) {
  KernelContext ctx{ins, outs, 0};
  k.compute(ctx);
}

template <class T>
Tensor random_tensor(const Shape& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, baton::dtype_of<T>());
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  for (auto& x : t.data<T>()) x = static_cast<T>(dist(rng));
  return t;
}

// An output the kernel must overwrite entirely: any element it skips stays NaN and fails.
template <class T>
Tensor poisoned(const Shape& shape) {
  Tensor t = Tensor::empty(shape, baton::dtype_of<T>());
  for (auto& x : t.data<T>()) x = std::numeric_limits<T>::quiet_NaN();
  return t;
}

template <class T>
Values values(const Tensor& t) {
  auto d = t.data<T>();
  return Values(d.begin(), d.end());
}

// ---- reference index arithmetic ----

Ints unravel(std::int64_t flat, const Shape& s) {
  Ints idx(s.size());
  for (std::size_t i = s.size(); i-- > 0;) {
    idx[i] = flat % s[i];
    flat /= s[i];
  }
  return idx;
}

std::int64_t ravel(const Ints& idx, const Shape& s) {
  std::int64_t flat = 0;
  for (std::size_t i = 0; i < s.size(); ++i) flat = flat * s[i] + idx[i];
  return flat;
}

// The element of `from` that numpy broadcasting reads for element `flat` of `to`.
std::int64_t broadcast_source(const Shape& from, const Shape& to, std::int64_t flat) {
  Ints to_idx = unravel(flat, to);
  Ints idx(from.size());
  const std::size_t lead = to.size() - from.size();
  for (std::size_t i = 0; i < from.size(); ++i) idx[i] = from[i] == 1 ? 0 : to_idx[lead + i];
  return ravel(idx, from);
}

Shape broadcast(const Shape& a, const Shape& b) {
  const std::size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (std::size_t i = 0; i < rank; ++i) {
    const std::int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    const std::int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// Checks got against want: f32 within 1e-5 of the magnitude (|want|, or the sum of |terms| for
// sums and products) or 1e-6 absolute near 0; f64 within 1e-12 of the magnitude. Why: a sum of
// n terms in any order is within n u sum|terms| of the exact one (Higham, Accuracy and
// Stability of Numerical Algorithms, 4.2; whatever order a BLAS kernel family picks); the
// longest here is matmul's k = 65, 65 x 6e-8 = 3.9e-6 < 1e-5 in f32, 65 x 1.1e-16 = 7e-15 <
// 1e-12 in f64. Element-wise ops are one rounding (plus a few ulp for exp and friends).
template <class T>
void expect_close(const Tensor& got, const Values& want, const Values* magnitude = nullptr) {
  REQUIRE(got.numel() == static_cast<std::int64_t>(want.size()));
  constexpr bool f32 = std::is_same_v<T, float>;
  const double rel = f32 ? 1e-5 : 1e-12;
  const double floor = f32 ? 1e-6 : 1e-14;
  auto g = got.data<T>();
  std::size_t bad = 0;
  std::string first;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double m = magnitude ? (*magnitude)[i] : std::abs(want[i]);
    const double err = std::abs(static_cast<double>(g[i]) - want[i]);
    if (!(err <= rel * m || err <= floor)) {
      if (bad++ == 0)
        first = "element " + std::to_string(i) + ": got " + std::to_string(g[i]) + ", want " +
                std::to_string(want[i]);
    }
  }
  CHECK_MESSAGE(bad == 0, bad, " of ", want.size(), " elements wrong; first ", first);
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  FAIL("expected std::invalid_argument");
  return {};
}

#define FOR_BOTH_DTYPES(fn) \
  SUBCASE("f32") {          \
    fn<float>(rng);         \
  }                         \
  SUBCASE("f64") {          \
    fn<double>(rng);        \
  }

// ---- references ----

struct MatmulCase {
  Shape a, b;
  bool trans_a = false, trans_b = false;
};

// c = op(a) op(b) per batch entry, with sum |a||b| as each element's magnitude.
Shape matmul_ref(const MatmulCase& mc, const Values& a, const Values& b, Values& c, Values& mag) {
  const std::size_t ra = mc.a.size(), rb = mc.b.size();
  const std::int64_t m = mc.trans_a ? mc.a[ra - 1] : mc.a[ra - 2];
  const std::int64_t k = mc.trans_a ? mc.a[ra - 2] : mc.a[ra - 1];
  const std::int64_t n = mc.trans_b ? mc.b[rb - 2] : mc.b[rb - 1];
  Shape out(mc.a.begin(), mc.a.end() - 2);
  std::int64_t batches = baton::numel(out);
  out.push_back(m);
  out.push_back(n);
  c.assign(static_cast<std::size_t>(batches * m * n), 0.0);
  mag = c;
  for (std::int64_t bi = 0; bi < batches; ++bi) {
    const std::int64_t bj = rb == 2 ? 0 : bi;
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double s = 0, sm = 0;
        for (std::int64_t p = 0; p < k; ++p) {
          double x = a[bi * m * k + (mc.trans_a ? p * m + i : i * k + p)];
          double y = b[bj * k * n + (mc.trans_b ? j * k + p : p * n + j)];
          s += x * y;
          sm += std::abs(x * y);
        }
        c[(bi * m + i) * n + j] = s;
        mag[(bi * m + i) * n + j] = sm;
      }
    }
  }
  return out;
}

// x summed onto `kept` (same rank as x, reduced axes 1); also each output's sum of |terms|.
void sum_ref(const Shape& xs, const Values& x, const Shape& kept, Values& y, Values& mag) {
  y.assign(static_cast<std::size_t>(baton::numel(kept)), 0.0);
  mag = y;
  for (std::int64_t i = 0; i < baton::numel(xs); ++i) {
    auto j = broadcast_source(kept, xs, i);
    y[j] += x[i];
    mag[j] += std::abs(x[i]);
  }
}

Attrs int_attrs(std::initializer_list<std::pair<const char*, std::int64_t>> kv) {
  Attrs a;
  for (auto& [k, v] : kv) a.set(k, v);
  return a;
}

// ---- checks against the references, per dtype ----

template <class T>
void check_matmul(std::mt19937& rng) {
  const std::vector<MatmulCase> cases = {
      {{3, 4}, {4, 5}},
      {{4, 3}, {4, 5}, true},
      {{3, 4}, {5, 4}, false, true},
      {{4, 3}, {5, 4}, true, true},
      {{2, 3, 4}, {4, 5}},
      {{2, 3, 3, 4}, {6, 4}, false, true},
      {{2, 4, 3}, {4, 5}, true},
      {{2, 3, 4}, {2, 4, 5}},
      {{2, 3, 4}, {2, 5, 4}, false, true},
      {{2, 2, 4, 3}, {2, 2, 5, 4}, true, true},
      {{1, 1}, {1, 1}},
      {{33, 65}, {65, 17}},
      {{3, 0}, {0, 5}},
      {{0, 4}, {4, 5}},
  };
  for (const auto& mc : cases) {
    CAPTURE(baton::to_string(mc.a));
    CAPTURE(baton::to_string(mc.b));
    CAPTURE(mc.trans_a);
    CAPTURE(mc.trans_b);
    auto k = make("matmul", baton::dtype_of<T>(),
                  int_attrs({{"trans_a", mc.trans_a}, {"trans_b", mc.trans_b}}));
    Tensor a = random_tensor<T>(mc.a, rng), b = random_tensor<T>(mc.b, rng);
    Values want, mag;
    Shape cs = matmul_ref(mc, values<T>(a), values<T>(b), want, mag);
    Tensor c = poisoned<T>(cs);
    run(*k, {&a, &b}, {&c});
    expect_close<T>(c, want, &mag);
  }
}

template <class T>
void check_binary(std::mt19937& rng) {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{3, 4}, {3, 4}},
      {{5, 7}, {7}},
      {{5, 1}, {1, 7}},
      {{4, 3}, {}},
      {{}, {4, 3}},
      {{2, 3, 4}, {3, 1}},
      {{2, 1, 4}, {3, 1}},
      {{7}, {5, 1}},
      {{1}, {1}},
      {{}, {}},
      {{0, 3}, {3}},
      {{64, 129}, {129}},
      {{2, 3, 4, 5}, {2, 1, 4, 1}},
      {{3, 1, 5}, {1, 4, 5}},
  };
  struct Op {
    const char* name;
    double (*fn)(double, double);
  };
  const Op ops[] = {{"add", [](double x, double y) { return x + y; }},
                    {"sub", [](double x, double y) { return x - y; }},
                    {"mul", [](double x, double y) { return x * y; }},
                    {"div", [](double x, double y) { return x / y; }}};
  for (const Op& op : ops) {
    auto k = make(op.name, baton::dtype_of<T>());
    for (const auto& [as, bs] : cases) {
      CAPTURE(op.name);
      CAPTURE(baton::to_string(as));
      CAPTURE(baton::to_string(bs));
      Tensor a = random_tensor<T>(as, rng), b = random_tensor<T>(bs, rng);
      const Shape cs = broadcast(as, bs);
      Tensor c = poisoned<T>(cs);
      run(*k, {&a, &b}, {&c});
      Values av = values<T>(a), bv = values<T>(b), want(static_cast<std::size_t>(c.numel()));
      for (std::int64_t i = 0; i < c.numel(); ++i) {
        // Rounded to T as the kernel rounds each operation: then f64 compares exactly.
        want[i] =
            static_cast<T>(op.fn(av[broadcast_source(as, cs, i)], bv[broadcast_source(bs, cs, i)]));
      }
      expect_close<T>(c, want);
    }
  }
}

template <class T>
void check_sum_to_and_broadcast_to(std::mt19937& rng) {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{5, 7}, {7}}, {{5, 7}, {5, 1}},    {{5, 7}, {1, 7}},       {{5, 7}, {}},
      {{5, 7}, {1}}, {{2, 3, 4}, {3, 1}}, {{2, 3, 4}, {2, 1, 4}}, {{2, 3, 4}, {2, 3, 4}},
      {{0, 3}, {3}}, {{64, 129}, {129}},  {{3, 100}, {3, 1}},     {{}, {}},
  };
  auto sum_to = make("sum_to", baton::dtype_of<T>());
  auto broadcast_to = make("broadcast_to", baton::dtype_of<T>());
  for (const auto& [big, small] : cases) {
    CAPTURE(baton::to_string(big));
    CAPTURE(baton::to_string(small));
    Tensor x = random_tensor<T>(big, rng);
    Tensor y = poisoned<T>(small);
    run(*sum_to, {&x}, {&y});
    Values want, mag;
    Shape kept(big.size() - small.size(), 1);
    kept.insert(kept.end(), small.begin(), small.end());
    sum_ref(big, values<T>(x), kept, want, mag);
    expect_close<T>(y, want, &mag);

    Tensor s = random_tensor<T>(small, rng);
    Tensor b = poisoned<T>(big);
    run(*broadcast_to, {&s}, {&b});
    Values sv = values<T>(s), bwant(static_cast<std::size_t>(b.numel()));
    for (std::int64_t i = 0; i < b.numel(); ++i) bwant[i] = sv[broadcast_source(small, big, i)];
    expect_close<T>(b, bwant);
  }
}

template <class T>
void check_sum_and_mean(std::mt19937& rng) {
  struct Case {
    Shape x;
    Ints axes;
    bool keepdims;
  };
  const std::vector<Case> cases = {
      {{2, 3, 4}, {}, false},    {{2, 3, 4}, {}, true},    {{2, 3, 4}, {0}, false},
      {{2, 3, 4}, {1}, true},    {{2, 3, 4}, {-1}, false}, {{2, 3, 4}, {0, 2}, false},
      {{2, 3, 4}, {2, 0}, true}, {{5}, {0}, false},        {{37, 53}, {1}, false},
      {{37, 53}, {0}, true},     {{4, 0}, {1}, false},
  };
  for (const char* op : {"sum", "mean"}) {
    for (const auto& c : cases) {
      CAPTURE(op);
      CAPTURE(baton::to_string(c.x));
      CAPTURE(baton::to_string(c.axes));
      CAPTURE(c.keepdims);
      Attrs attrs;
      attrs.set("axes", c.axes).set("keepdims", std::int64_t{c.keepdims});
      auto k = make(op, baton::dtype_of<T>(), attrs);
      std::vector<bool> reduced(c.x.size(), c.axes.empty());
      for (auto a : c.axes)
        reduced[static_cast<std::size_t>(a < 0 ? a + std::ssize(c.x) : a)] = true;
      Shape kept = c.x, dropped;
      for (std::size_t i = 0; i < c.x.size(); ++i) {
        if (reduced[i]) {
          kept[i] = 1;
        } else {
          dropped.push_back(c.x[i]);
        }
      }
      if (std::string(op) == "mean" && baton::numel(c.x) == 0) continue;  // 0 / 0
      Tensor x = random_tensor<T>(c.x, rng);
      Tensor y = poisoned<T>(c.keepdims ? kept : dropped);
      run(*k, {&x}, {&y});
      Values want, mag;
      sum_ref(c.x, values<T>(x), kept, want, mag);
      if (std::string(op) == "mean") {
        const double count =
            static_cast<double>(x.numel()) / static_cast<double>(baton::numel(kept));
        for (auto& w : want) w /= count;
        for (auto& m : mag) m /= count;
      }
      expect_close<T>(y, want, &mag);
    }
  }
}

template <class T>
void check_scale_fill_reshape(std::mt19937& rng) {
  for (double v : {2.5, -0.5, 0.0}) {
    CAPTURE(v);
    auto scale = make("scale", baton::dtype_of<T>(), Attrs{{"value", v}});
    Tensor x = random_tensor<T>({3, 4}, rng);
    Tensor y = poisoned<T>({3, 4});
    run(*scale, {&x}, {&y});
    Values want = values<T>(x);
    for (auto& w : want) w = static_cast<T>(w * static_cast<T>(v));
    expect_close<T>(y, want);

    auto fill = make("fill", baton::dtype_of<T>(), Attrs{{"value", v}});
    for (const Shape& s : {Shape{2, 3}, Shape{}, Shape{0}}) {
      Tensor f = poisoned<T>(s);
      run(*fill, {}, {&f});
      expect_close<T>(f, Values(static_cast<std::size_t>(f.numel()), v));
    }
  }
  auto reshape = make("reshape", baton::dtype_of<T>());
  for (const auto& [from, to] : std::vector<std::pair<Shape, Shape>>{
           {{2, 3, 4}, {6, 4}}, {{2, 3, 4}, {24}}, {{1}, {}}, {{0, 3}, {3, 0}}}) {
    Tensor x = random_tensor<T>(from, rng);
    Tensor y = poisoned<T>(to);
    run(*reshape, {&x}, {&y});
    expect_close<T>(y, values<T>(x));
  }
}

template <class T>
void check_transpose(std::mt19937& rng) {
  const std::vector<std::pair<Shape, Ints>> cases = {
      {{3, 4}, {1, 0}},
      {{2, 3, 4}, {0, 2, 1}},
      {{2, 3, 4}, {2, 0, 1}},
      {{2, 3, 4}, {1, 0, 2}},
      {{2, 3, 4, 5}, {0, 2, 1, 3}},
      {{5}, {0}},
      {{}, {}},
      {{33, 65}, {1, 0}},
      {{2, 1, 3}, {2, 1, 0}},
      {{2, 3, 4, 5}, {1, 0, 3, 2}},
      {{3, 17, 19}, {0, 2, 1}},
      {{64, 32}, {1, 0}},
  };
  for (const auto& [xs, perm] : cases) {
    CAPTURE(baton::to_string(xs));
    CAPTURE(baton::to_string(perm));
    auto k = make("transpose", baton::dtype_of<T>(), Attrs{{"perm", perm}});
    Shape ys(xs.size());
    for (std::size_t i = 0; i < xs.size(); ++i) ys[i] = xs[static_cast<std::size_t>(perm[i])];
    Tensor x = random_tensor<T>(xs, rng);
    Tensor y = poisoned<T>(ys);
    run(*k, {&x}, {&y});
    Values xv = values<T>(x), want(static_cast<std::size_t>(y.numel()));
    for (std::int64_t i = 0; i < y.numel(); ++i) {
      Ints yi = unravel(i, ys), xi(xs.size());
      for (std::size_t d = 0; d < xs.size(); ++d) xi[static_cast<std::size_t>(perm[d])] = yi[d];
      want[i] = xv[ravel(xi, xs)];
    }
    expect_close<T>(y, want);
  }
}

struct SliceCase {
  Shape x;
  std::int64_t axis, start, len;
};
const std::vector<SliceCase> slice_cases = {
    {{4, 5, 6}, 0, 1, 2},  {{4, 5, 6}, 1, 2, 3}, {{4, 5, 6}, 2, 0, 6},
    {{4, 5, 6}, -1, 5, 1}, {{4, 5, 6}, 1, 5, 0}, {{7}, 0, 3, 4},
};

Shape sliced(const SliceCase& c) {
  Shape s = c.x;
  s[static_cast<std::size_t>(c.axis < 0 ? c.axis + std::ssize(s) : c.axis)] = c.len;
  return s;
}

// Element `i` of the slice is element window_source(...) of the whole.
std::int64_t window_source(const SliceCase& c, std::int64_t i) {
  Ints idx = unravel(i, sliced(c));
  idx[static_cast<std::size_t>(c.axis < 0 ? c.axis + std::ssize(c.x) : c.axis)] += c.start;
  return ravel(idx, c.x);
}

template <class T>
void check_slice(std::mt19937& rng) {
  for (const auto& c : slice_cases) {
    CAPTURE(baton::to_string(c.x));
    CAPTURE(c.axis);
    CAPTURE(c.start);
    CAPTURE(c.len);
    Attrs attrs = int_attrs({{"axis", c.axis}, {"start", c.start}});
    auto slice = make("slice", baton::dtype_of<T>(), attrs);
    auto slice_grad = make("slice_grad", baton::dtype_of<T>(), attrs);
    Tensor x = random_tensor<T>(c.x, rng);
    Tensor y = poisoned<T>(sliced(c));
    run(*slice, {&x}, {&y});
    Values xv = values<T>(x), want(static_cast<std::size_t>(y.numel()));
    for (std::int64_t i = 0; i < y.numel(); ++i) want[i] = xv[window_source(c, i)];
    expect_close<T>(y, want);

    Tensor dy = random_tensor<T>(sliced(c), rng);
    Tensor dx = poisoned<T>(c.x);
    run(*slice_grad, {&dy}, {&dx});
    Values dyv = values<T>(dy), dwant(static_cast<std::size_t>(dx.numel()), 0.0);
    for (std::int64_t i = 0; i < dy.numel(); ++i) dwant[window_source(c, i)] = dyv[i];
    expect_close<T>(dx, dwant);
  }
}

template <class T>
void check_concat(std::mt19937& rng) {
  const std::vector<std::pair<std::vector<Shape>, std::int64_t>> cases = {
      {{{2, 3}, {4, 3}}, 0}, {{{2, 3, 4}, {2, 1, 4}, {2, 2, 4}}, 1}, {{{2, 3}, {2, 5}}, -1},
      {{{3, 2}}, 0},         {{{2, 0}, {2, 3}, {2, 1}}, 1},
  };
  for (const auto& [shapes, axis] : cases) {
    CAPTURE(axis);
    auto k = make("concat", baton::dtype_of<T>(), int_attrs({{"axis", axis}}));
    const std::size_t ax = static_cast<std::size_t>(axis < 0 ? axis + std::ssize(shapes[0]) : axis);
    Shape ys = shapes[0];
    ys[ax] = 0;
    std::vector<Tensor> xs;
    std::vector<const Tensor*> ins;
    for (const auto& s : shapes) {
      xs.push_back(random_tensor<T>(s, rng));
      ys[ax] += s[ax];
    }
    std::vector<Values> xvs;
    for (const auto& x : xs) {
      ins.push_back(&x);
      xvs.push_back(values<T>(x));
    }
    Tensor y = poisoned<T>(ys);
    run(*k, ins, {&y});
    Values want(static_cast<std::size_t>(y.numel()));
    for (std::int64_t i = 0; i < y.numel(); ++i) {
      Ints idx = unravel(i, ys);
      std::size_t which = 0;
      while (idx[ax] >= shapes[which][ax]) idx[ax] -= shapes[which++][ax];
      want[i] = xvs[which][ravel(idx, shapes[which])];
    }
    expect_close<T>(y, want);
  }
}

// ---- finite differences (f64) ----

Tensor random64(const Shape& s, std::mt19937& rng) {
  return random_tensor<double>(s, rng);
}

// The gradient of L(x) = sum(w * forward()) with respect to x by central differences; forward
// writes the output `out` from the current contents of x.
Values numeric_grad(Tensor& x, const Tensor& w, Tensor& out, const std::function<void()>& forward) {
  constexpr double h = 1e-6;
  auto loss = [&] {
    forward();
    double l = 0;
    for (std::int64_t i = 0; i < out.numel(); ++i) l += w.data<double>()[i] * out.data<double>()[i];
    return l;
  };
  Values g(static_cast<std::size_t>(x.numel()));
  auto xv = x.data<double>();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const double keep = xv[i];
    xv[i] = keep + h;
    const double plus = loss();
    xv[i] = keep - h;
    const double minus = loss();
    xv[i] = keep;
    g[i] = (plus - minus) / (2 * h);
  }
  return g;
}

// Central differences with h = 1e-6 in f64 err by about h^2 |f'3| / 6 ~ 1e-12 (truncation) plus
// u |f| / h ~ 1e-9 (rounding): 1e-6 relative to max(1, |g|) is far above both and far below a
// wrong gradient.
void expect_grad(const Tensor& analytic, const Values& numeric) {
  REQUIRE(analytic.numel() == static_cast<std::int64_t>(numeric.size()));
  auto g = analytic.data<double>();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < numeric.size(); ++i) {
    if (!(std::abs(g[i] - numeric[i]) <= 1e-6 * std::max(1.0, std::abs(numeric[i])))) ++bad;
  }
  CHECK_MESSAGE(bad == 0, bad, " of ", numeric.size(), " gradient elements disagree");
}

Tensor with_shape(const Tensor& t, const Shape& s) {
  Tensor r = Tensor::empty(s, t.dtype());
  auto k = make("reshape", DType::f64);
  run(*k, {&t}, {&r});
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Against the float64 references

TEST_CASE("Ops.Matmul.MatchesFloat64Reference") {
  std::mt19937 rng(11);
  FOR_BOTH_DTYPES(check_matmul)
}

TEST_CASE("Ops.Elementwise.BroadcastingMatchesFloat64Reference") {
  std::mt19937 rng(12);
  FOR_BOTH_DTYPES(check_binary)
}

TEST_CASE("Ops.Elementwise.AddInPlaceIntoFirstInput") {
  std::mt19937 rng(13);
  Tensor a = random64({5, 7}, rng), b = random64({7}, rng);
  Values want = values<double>(a);
  for (std::size_t i = 0; i < want.size(); ++i) want[i] += b.data<double>()[i % 7];
  run(*make("add", DType::f64), {&a, &b}, {&a});
  expect_close<double>(a, want);
}

TEST_CASE("Ops.SumToAndBroadcastTo.MatchFloat64Reference") {
  std::mt19937 rng(14);
  FOR_BOTH_DTYPES(check_sum_to_and_broadcast_to)
}

TEST_CASE("Ops.SumAndMean.MatchFloat64ReferenceOverAxes") {
  std::mt19937 rng(15);
  FOR_BOTH_DTYPES(check_sum_and_mean)
}

TEST_CASE("Ops.Sum.F32AccumulatesWithoutLosingDigits") {
  // 1e8 + 1 == 1e8 in float: a float accumulator would drop the ones between 1e8 and -1e8.
  Tensor x = Tensor::empty({1002}, DType::f32);
  for (auto& v : x.data<float>()) v = 1.0f;
  x.data<float>()[0] = 1e8f;
  x.data<float>()[1001] = -1e8f;
  Tensor y = poisoned<float>({});
  run(*make("sum", DType::f32), {&x}, {&y});
  CHECK(y.data<float>()[0] == 1000.0f);
  Tensor to = poisoned<float>({1});
  run(*make("sum_to", DType::f32), {&x}, {&to});
  CHECK(to.data<float>()[0] == 1000.0f);
}

TEST_CASE("Ops.ScaleFillReshape.MatchFloat64Reference") {
  std::mt19937 rng(16);
  FOR_BOTH_DTYPES(check_scale_fill_reshape)
}

TEST_CASE("Ops.Transpose.MatchesFloat64Reference") {
  std::mt19937 rng(17);
  FOR_BOTH_DTYPES(check_transpose)
}

TEST_CASE("Ops.SliceAndSliceGrad.MatchFloat64Reference") {
  std::mt19937 rng(18);
  FOR_BOTH_DTYPES(check_slice)
}

TEST_CASE("Ops.Concat.MatchesFloat64Reference") {
  std::mt19937 rng(19);
  FOR_BOTH_DTYPES(check_concat)
}

TEST_CASE("Ops.Matmul.BlasRunsOneThreadPerActor") {
  (void)registry();
  if (std::getenv("BATON_BLAS_THREADS") == nullptr) CHECK(openblas_get_num_threads() == 1);
}

// ---------------------------------------------------------------------------------------------
// Gradients by central finite differences (f64)

TEST_CASE("Ops.Matmul.GradientsAreMatmulsWithTransFlags") {
  std::mt19937 rng(21);
  auto matmul = make("matmul", DType::f64);
  auto dc_bt = make("matmul", DType::f64, int_attrs({{"trans_b", 1}}));
  auto at_dc = make("matmul", DType::f64, int_attrs({{"trans_a", 1}}));
  for (const auto& [as, bs] : std::vector<std::pair<Shape, Shape>>{
           {{3, 4}, {4, 5}}, {{2, 3, 4}, {2, 4, 5}}, {{2, 3, 4}, {4, 5}}}) {
    CAPTURE(baton::to_string(as));
    CAPTURE(baton::to_string(bs));
    Tensor a = random64(as, rng), b = random64(bs, rng);
    Shape cs = as;
    cs.back() = bs.back();
    Tensor c = Tensor::empty(cs, DType::f64), dc = random64(cs, rng);
    auto forward = [&] { run(*matmul, {&a, &b}, {&c}); };

    Tensor da = poisoned<double>(as);  // dA = dC Bᵀ
    run(*dc_bt, {&dc, &b}, {&da});
    expect_grad(da, numeric_grad(a, dc, c, forward));

    Tensor db = poisoned<double>(bs);  // dB = Aᵀ dC; a shared B sums over the batch, folded into M
    if (bs.size() == as.size()) {
      run(*at_dc, {&a, &dc}, {&db});
    } else {
      const std::int64_t rows = a.numel() / as.back();
      Tensor a2 = with_shape(a, {rows, as.back()}), dc2 = with_shape(dc, {rows, cs.back()});
      run(*at_dc, {&a2, &dc2}, {&db});
    }
    expect_grad(db, numeric_grad(b, dc, c, forward));
  }
}

TEST_CASE("Ops.SumTo.IsTheGradientOfBroadcasting") {
  std::mt19937 rng(22);
  auto sum_to = make("sum_to", DType::f64);
  auto mul = make("mul", DType::f64);
  for (const char* op : {"add", "mul"}) {
    for (const auto& [as, bs] : std::vector<std::pair<Shape, Shape>>{
             {{4, 5}, {5}}, {{4, 1}, {1, 5}}, {{4, 5}, {}}, {{2, 3, 4}, {3, 1}}}) {
      CAPTURE(op);
      CAPTURE(baton::to_string(as));
      CAPTURE(baton::to_string(bs));
      auto k = make(op, DType::f64);
      Tensor a = random64(as, rng), b = random64(bs, rng);
      const Shape cs = broadcast(as, bs);
      Tensor c = Tensor::empty(cs, DType::f64), dc = random64(cs, rng);
      auto forward = [&] { run(*k, {&a, &b}, {&c}); };
      // add: dA = sum_to(dC); mul: dA = sum_to(dC * B), and the same for b.
      for (auto [x, other] : {std::pair{&a, &b}, std::pair{&b, &a}}) {
        Tensor upstream = dc;
        if (std::string(op) == "mul") {
          upstream = Tensor::empty(cs, DType::f64);
          run(*mul, {&dc, other}, {&upstream});
        }
        Tensor dx = poisoned<double>(x->shape());
        run(*sum_to, {&upstream}, {&dx});
        expect_grad(dx, numeric_grad(*x, dc, c, forward));
      }
    }
  }
}

TEST_CASE("Ops.SliceGrad.IsTheGradientOfSlice") {
  std::mt19937 rng(23);
  for (const auto& c : slice_cases) {
    CAPTURE(baton::to_string(c.x));
    CAPTURE(c.axis);
    Attrs attrs = int_attrs({{"axis", c.axis}, {"start", c.start}});
    auto slice = make("slice", DType::f64, attrs);
    Tensor x = random64(c.x, rng), y = Tensor::empty(sliced(c), DType::f64);
    Tensor dy = random64(sliced(c), rng), dx = poisoned<double>(c.x);
    run(*make("slice_grad", DType::f64, attrs), {&dy}, {&dx});
    expect_grad(dx, numeric_grad(x, dy, y, [&] { run(*slice, {&x}, {&y}); }));
  }
}

TEST_CASE("Ops.Transpose.GradientIsTheInversePermutation") {
  std::mt19937 rng(24);
  for (const auto& [xs, perm] : std::vector<std::pair<Shape, Ints>>{
           {{3, 4}, {1, 0}}, {{2, 3, 4}, {2, 0, 1}}, {{2, 3, 4, 5}, {0, 2, 1, 3}}}) {
    CAPTURE(baton::to_string(perm));
    Ints inverse(perm.size());
    Shape ys(xs.size());
    for (std::size_t i = 0; i < perm.size(); ++i) {
      inverse[static_cast<std::size_t>(perm[i])] = static_cast<std::int64_t>(i);
      ys[i] = xs[static_cast<std::size_t>(perm[i])];
    }
    auto forward_k = make("transpose", DType::f64, Attrs{{"perm", perm}});
    Tensor x = random64(xs, rng), y = Tensor::empty(ys, DType::f64);
    Tensor dy = random64(ys, rng), dx = poisoned<double>(xs);
    run(*make("transpose", DType::f64, Attrs{{"perm", inverse}}), {&dy}, {&dx});
    expect_grad(dx, numeric_grad(x, dy, y, [&] { run(*forward_k, {&x}, {&y}); }));
  }
}

TEST_CASE("Ops.Mean.GradientIsBroadcastThenScale") {
  std::mt19937 rng(25);
  struct Case {
    Shape x;
    Ints axes;
    bool keepdims;
    Shape kept;
  };
  for (const auto& c : std::vector<Case>{{{3, 4, 5}, {1}, false, {3, 1, 5}},
                                         {{3, 4, 5}, {0, 2}, true, {1, 4, 1}},
                                         {{3, 4}, {}, false, {1, 1}}}) {
    CAPTURE(baton::to_string(c.x));
    CAPTURE(baton::to_string(c.axes));
    Attrs attrs;
    attrs.set("axes", c.axes).set("keepdims", std::int64_t{c.keepdims});
    auto mean = make("mean", DType::f64, attrs);
    Shape ys;
    for (std::size_t i = 0; i < c.x.size(); ++i) {
      if (c.keepdims || c.kept[i] != 1) ys.push_back(c.kept[i]);
    }
    Tensor x = random64(c.x, rng), y = Tensor::empty(ys, DType::f64), dy = random64(ys, rng);
    // dx = scale(broadcast_to(reshape(dy, kept)), 1 / count)
    Tensor wide = Tensor::empty(c.x, DType::f64), dx = poisoned<double>(c.x);
    Tensor dy_kept = with_shape(dy, c.kept);
    run(*make("broadcast_to", DType::f64), {&dy_kept}, {&wide});
    const double count = static_cast<double>(x.numel() / baton::numel(c.kept));
    run(*make("scale", DType::f64, Attrs{{"value", 1.0 / count}}), {&wide}, {&dx});
    expect_grad(dx, numeric_grad(x, dy, y, [&] { run(*mean, {&x}, {&y}); }));
  }
}

// ---------------------------------------------------------------------------------------------
// Errors

TEST_CASE("Ops.BadShapesThrowNamingTheOpAndShapes") {
  struct Bad {
    const char* op;
    Attrs attrs;
    std::vector<Shape> ins;
    Shape out;
  };
  const std::vector<Bad> cases = {
      {"matmul", {}, {{2, 3}, {4, 5}}, {2, 5}},
      {"matmul", {}, {{2, 3, 4}, {3, 4, 5}}, {2, 3, 5}},
      {"matmul", {}, {{2, 3}, {3, 5}}, {2, 6}},
      {"matmul", Attrs{{"trans_a", std::int64_t{1}}}, {{2, 3}, {3, 5}}, {3, 5}},
      {"matmul", {}, {{3}, {3, 5}}, {5}},
      {"add", {}, {{2, 3}, {4}}, {2, 3}},
      {"sub", {}, {{2, 3}, {3}}, {3, 3}},
      {"mul", {}, {{2, 1}, {1, 3}}, {2, 1}},
      {"div", {}, {{2, 3}, {2, 3}}, {6}},
      {"sum_to", {}, {{2, 3}}, {4}},
      {"sum_to", {}, {{2, 3}}, {2, 3, 1}},
      {"broadcast_to", {}, {{3}}, {2, 4}},
      {"scale", Attrs{{"value", 2.0}}, {{2, 3}}, {3, 2}},
      {"reshape", {}, {{2, 3}}, {7}},
      {"transpose", Attrs{{"perm", Ints{0, 0}}}, {{2, 3}}, {2, 3}},
      {"transpose", Attrs{{"perm", Ints{1, 0}}}, {{2, 3}}, {2, 3}},
      {"transpose", Attrs{{"perm", Ints{1, 0}}}, {{2, 3, 4}}, {3, 2, 4}},
      {"sum", Attrs{{"axes", Ints{0}}}, {{2, 3}}, {2}},
      {"sum", Attrs{{"axes", Ints{2}}}, {{2, 3}}, {2}},
      {"mean", Attrs{{"axes", Ints{1, -1}}}, {{2, 3}}, {2}},
      {"mean", Attrs{{"axes", Ints{1}}, {"keepdims", std::int64_t{1}}}, {{2, 3}}, {2}},
      {"slice", int_attrs({{"axis", 1}, {"start", 3}}), {{4, 5}}, {4, 3}},
      {"slice", int_attrs({{"axis", 1}, {"start", 0}}), {{4, 5}}, {3, 3}},
      {"slice", int_attrs({{"axis", 2}, {"start", 0}}), {{4, 5}}, {4, 5}},
      {"slice_grad", int_attrs({{"axis", 1}, {"start", 3}}), {{4, 3}}, {4, 5}},
      {"concat", int_attrs({{"axis", 1}}), {{2, 3}, {3, 3}}, {2, 6}},
      {"concat", int_attrs({{"axis", 0}}), {{2, 3}, {3, 3}}, {6, 3}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.op);
    CAPTURE(baton::to_string(c.ins[0]));
    auto k = make(c.op, DType::f32, c.attrs);
    std::vector<Tensor> ins;
    std::vector<const Tensor*> ptrs;
    for (const auto& s : c.ins) ins.push_back(Tensor::zeros(s, DType::f32));
    for (const auto& t : ins) ptrs.push_back(&t);
    Tensor out = Tensor::zeros(c.out, DType::f32);
    std::string msg = message_of([&] { run(*k, ptrs, {&out}); });
    CHECK(contains(msg, c.op));
    CHECK(contains(msg, baton::to_string(c.ins[0])));
  }
}

TEST_CASE("Ops.MissingOrMistypedAttributesThrowAtCreation") {
  for (const char* op : {"scale", "fill", "transpose", "slice", "slice_grad", "concat"}) {
    CAPTURE(op);
    std::string msg = message_of([&] { (void)make(op, DType::f64); });
    CHECK(contains(msg, op));
  }
  CHECK(contains(message_of([] { (void)make("sum", DType::f32, Attrs{{"axes", 1.5}}); }), "axes"));
  CHECK(contains(message_of([] {
                   (void)make("matmul", DType::f32, Attrs{{"trans_a", std::int64_t{2}}});
                 }),
                 "trans_a"));
}

// matmul_bias (the epilogues pass's fused Linear forward, y = x w + b) on the CPU is the product
// and then the add as the two ops' own kernels compute them, so a plan with the fusion trains bit
// for bit as one without: for each dtype it takes (f32, f64; bf16 operands with a bf16 result, and
// with an f32 one, autocast's product widened before an f32 bias), w as stored and transposed, and
// a 3-D x whose rows fold into one product.
TEST_CASE("Ops.MatmulBiasIsTheProductThenTheAddBitForBit") {
  std::mt19937 rng(11);
  auto random = [&](const Shape& s, DType dt) {
    Tensor f = Tensor::empty(s, DType::f32);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    for (float& x : f.data<float>()) x = dist(rng);
    if (dt == DType::f32) return f;
    Tensor t = Tensor::empty(s, dt);
    for (std::size_t i = 0; i < static_cast<std::size_t>(f.numel()); ++i) {
      if (dt == DType::f64) t.data<double>()[i] = f.data<float>()[i];
      if (dt == DType::bf16) t.data<baton::bfloat16>()[i] = baton::to_bf16(f.data<float>()[i]);
    }
    return t;
  };
  struct Dtypes {
    DType in, out;
  };
  const std::int64_t k = 7, n = 6;
  for (const Dtypes dt : {Dtypes{DType::f32, DType::f32}, Dtypes{DType::f64, DType::f64},
                          Dtypes{DType::bf16, DType::bf16}, Dtypes{DType::bf16, DType::f32}}) {
    for (const std::int64_t tb : {0, 1}) {
      for (const Shape& xs : {Shape{5, k}, Shape{2, 3, k}}) {
        CAPTURE(baton::name(dt.in));
        CAPTURE(baton::name(dt.out));
        CAPTURE(tb);
        CAPTURE(xs.size());
        Shape ys = xs;
        ys.back() = n;
        const Tensor x = random(xs, dt.in), w = random(tb ? Shape{n, k} : Shape{k, n}, dt.in), b = random({n}, dt.out);
        Tensor y = Tensor::empty(ys, dt.out);
        run(*make("matmul_bias", dt.in, Attrs{{"trans_b", tb}}), {&x, &w, &b}, {&y});
        // The ops: the product in its dtype, widened (exactly) where the result is f32, the add.
        Tensor product = Tensor::empty(ys, dt.in);
        run(*make("matmul", dt.in, Attrs{{"trans_a", std::int64_t{0}}, {"trans_b", tb}}), {&x, &w}, {&product});
        Tensor widened = product;
        if (dt.out != dt.in) {
          widened = Tensor::empty(ys, DType::f32);
          for (std::size_t i = 0; i < static_cast<std::size_t>(product.numel()); ++i)
            widened.data<float>()[i] = baton::to_float(product.data<baton::bfloat16>()[i]);
        }
        Tensor want = Tensor::empty(ys, dt.out);
        run(*make("add", dt.out), {&widened, &b}, {&want});
        REQUIRE(y.nbytes() == want.nbytes());
        CHECK(std::memcmp(y.raw(), want.raw(), y.nbytes()) == 0);
      }
    }
  }
  // What it refuses, by name.
  const Tensor x = random({4, k}, DType::f32), w = random({k, n}, DType::f32), b = random({n + 1}, DType::f32);
  Tensor y = Tensor::empty({4, n}, DType::f32);
  CHECK(contains(message_of([&] { run(*make("matmul_bias", DType::f32), {&x, &w, &b}, {&y}); }), "b should be [6]"));
}

// matmul_bias_gelu (the epilogues pass's fusion of bias_gelu(matmul(x, w), b)): y is bias_gelu of
// the product and pre is add(product, b), bit for bit, in both GELU forms, f32 and f64; in bf16 y
// is bias_gelu's result bit for bit and pre the float32 sum rounded to bf16 once.
TEST_CASE("Ops.MatmulBiasGeluAndItsGradientAreTheOpsBitForBit") {
  std::mt19937 rng(12);
  auto random = [&](const Shape& s, DType dt) {
    Tensor t = Tensor::empty(s, dt);
    std::uniform_real_distribution<float> dist(-1.5f, 1.5f);
    for (std::size_t i = 0; i < static_cast<std::size_t>(t.numel()); ++i) {
      const float v = dist(rng);
      if (dt == DType::f32) t.data<float>()[i] = v;
      if (dt == DType::f64) t.data<double>()[i] = v;
      if (dt == DType::bf16) t.data<baton::bfloat16>()[i] = baton::to_bf16(v);
    }
    return t;
  };
  auto same = [](const Tensor& a, const Tensor& b) {
    REQUIRE(a.nbytes() == b.nbytes());
    return std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
  };
  const std::int64_t k = 9, n = 8;
  for (const char* form : {"none", "tanh"}) {
    for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
      for (const std::int64_t tb : {0, 1}) {
        CAPTURE(form);
        CAPTURE(baton::name(dt));
        CAPTURE(tb);
        const Shape xs{2, 5, k}, ys{2, 5, n};
        const Tensor x = random(xs, dt), w = random(tb ? Shape{n, k} : Shape{k, n}, dt), b = random({n}, dt);
        Tensor y = Tensor::empty(ys, dt), pre = Tensor::empty(ys, dt);
        const Attrs gelu{{"approximate", std::string(form)}};
        Attrs fused = gelu;
        fused.set("trans_b", tb);
        run(*make("matmul_bias_gelu", dt, fused), {&x, &w, &b}, {&y, &pre});
        Tensor product = Tensor::empty(ys, dt), want_y = Tensor::empty(ys, dt), want_pre = Tensor::empty(ys, dt);
        run(*make("matmul", dt, Attrs{{"trans_a", std::int64_t{0}}, {"trans_b", tb}}), {&x, &w}, {&product});
        run(*make("bias_gelu", dt, gelu), {&product, &b}, {&want_y});
        run(*make("add", dt), {&product, &b}, {&want_pre});
        CHECK(same(y, want_y));
        CHECK(same(pre, want_pre));
      }
    }
  }
  // Its backward twin, matmul_dgelu_bgrad: dh = gelu'(pre) (dy w^T) and db = dh summed over the
  // rows, bit for bit the product, gelu_grad and sum_to in f32 and f64.
  for (const char* form : {"none", "tanh"}) {
    for (DType dt : {DType::f32, DType::f64}) {
      for (const std::int64_t tb : {0, 1}) {
        CAPTURE(form);
        CAPTURE(baton::name(dt));
        CAPTURE(tb);
        const Shape ys{2, 5, k}, hs{2, 5, n};
        const Tensor dy = random(ys, dt), w = random(tb ? Shape{n, k} : Shape{k, n}, dt), pre = random(hs, dt);
        Tensor dh = Tensor::empty(hs, dt), db = Tensor::empty({n}, dt);
        const Attrs gelu{{"approximate", std::string(form)}};
        Attrs fused = gelu;
        fused.set("trans_b", tb);
        run(*make("matmul_dgelu_bgrad", dt, fused), {&dy, &w, &pre}, {&dh, &db});
        Tensor dfc = Tensor::empty(hs, dt), want_dh = Tensor::empty(hs, dt), want_db = Tensor::empty({n}, dt);
        run(*make("matmul", dt, Attrs{{"trans_a", std::int64_t{0}}, {"trans_b", tb}}), {&dy, &w}, {&dfc});
        run(*make("gelu_grad", dt, gelu), {&pre, &dfc}, {&want_dh});
        run(*make("sum_to", dt), {&want_dh}, {&want_db});
        CHECK(same(dh, want_dh));
        CHECK(same(db, want_db));
      }
    }
  }
  // What it refuses, by name: a second output of another shape, a form it does not know.
  const Tensor x = random({4, k}, DType::f32), w = random({k, n}, DType::f32), b = random({n}, DType::f32);
  Tensor y = Tensor::empty({4, n}, DType::f32), pre = Tensor::empty({4, n + 1}, DType::f32);
  CHECK(contains(message_of([&] { run(*make("matmul_bias_gelu", DType::f32), {&x, &w, &b}, {&y, &pre}); }),
                 "pre f32[4, 9] on cpu:0 must have y's shape and dtype"));
  CHECK(contains(message_of([&] { (void)make("matmul_bias_gelu", DType::f32, Attrs{{"approximate", std::string("erf")}}); }),
                 "attribute approximate must be \"none\" or \"tanh\", not \"erf\""));
}
