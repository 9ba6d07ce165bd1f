#pragma once
// Parallel training equals sequential training (DESIGN.md section 8): the claim, its tolerance
// and the comparison, in one place for every test that makes it (test_parallel.cpp,
// test_sbp.cpp, test_graph.cpp, test_schedule.cpp, test_checkpoint.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "baton/graph.h"

namespace baton {

/// For doctest's CAPTURE and INFO: a dtype by its name ("f32").
inline std::ostream& operator<<(std::ostream& out, DType dtype) { return out << name(dtype); }

}  // namespace baton

namespace baton::test {

/// What a training run produced: the loss of each step and every weight, widened to double
/// whatever the model's dtype (f32 or f64).
struct TrainedRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<double>> weights;
};

/// An f32 or f64 tensor's elements as doubles.
inline std::vector<double> widened(const Tensor& t) {
  if (t.dtype() == DType::f64) return {t.data<double>().begin(), t.data<double>().end()};
  REQUIRE_MESSAGE(t.dtype() == DType::f32, "a weight of dtype " << name(t.dtype()));
  return {t.data<float>().begin(), t.data<float>().end()};
}

/// The losses and the weights of a finished job (replica 0's weights; tp shards as they are).
inline TrainedRun trained(const TrainingJob& job) {
  TrainedRun out;
  out.losses = job.losses->per_step();
  for (const auto& [name, t] : job.params->values()) out.weights[name] = widened(t);
  return out;
}

/// The unit roundoff of a float dtype: half the distance from 1 to the next number.
inline double unit_roundoff(DType dtype) {
  return dtype == DType::f64 ? 0x1p-53 : 0x1p-24;
}

/// How far two runs of one training job may drift apart when they differ only in the order of
/// their sums (micro-batches, replicas, pipeline stages, tensor-parallel shards): the largest
/// difference of a loss or a weight, relative to max(1, |value|).
///
/// The derivation. A gradient element is a sum of n terms; summed in another order it changes
/// by at most about n u sum|terms| (u: the dtype's unit roundoff; Higham, Accuracy and
/// Stability of Numerical Algorithms, 2nd ed., 4.2). A step moves a weight by lr d, and that
/// error moves the direction d by at most n u C, where C is the conditioning of the step:
///  - Adam and AdamW divide the gradient by its own running scale, so d's error is the
///    gradient's relative error, n u kappa, with kappa = sum|terms| / |sum| the condition
///    number of the sum: C = kappa.
///  - SGD's d is the gradient itself plus momentum, so d's error is the absolute one,
///    n u sum|terms| / (1 - momentum): C = sum|terms| / (1 - momentum), about 10 sum|terms| at
///    momentum 0.9, with sum|terms| a few units for these models (inputs and activations of
///    order 1, softmax errors below 1).
/// Over `steps` steps the errors add (10 to 20 steps at these learning rates stay linear: a
/// step's Jacobian is I - lr H, near I), so
///     difference <= steps * lr * n * C * u.
/// C is the one number not read off the job: kappa is unbounded for a gradient element that
/// cancels to near 0, and how near 0 they come depends on the data, not on baton. `kappa_limit`
/// bounds it; see there for what the tests use of it under each kernel family Debian's OpenBLAS
/// picks. BATON_TEST_MARGINS=1 prints each comparison's difference and its share of the
/// tolerance (as `scripts/run.sh test` runs them: one CPU kernel family per run).
///
/// The same derivation holds for f32 and f64 with their own u: the f64 runs, 2^29 times
/// tighter, are where a wrong sum (a micro-batch counted twice, a shard's gradient missing)
/// cannot hide; the f32 runs check the dtype training uses.
struct Reordering {
  DType dtype = DType::f32;
  std::int64_t steps = 10;
  std::int64_t longest_sum = 32;  // n: the global batch, or a wider layer's width
  double lr = 0.01;               // the optimizer's learning rate
};

/// The conditioning budget C of Reordering's derivation. What the tests need of it, over every
/// comparison of test_parallel, test_sbp, test_graph and test_checkpoint under
/// OPENBLAS_CORETYPE Haswell, Zen, SkylakeX, Sandybridge and Cooperlake (this AMD EPYC's own):
/// C = 44 at most (4.4% of the tolerance: Sbp.AnnotatedMlpTrainsAsOneDevice, fc2.w of the
/// 4-layer MLP, f64, Sandybridge; in f32 2.9%, the same weight under Haswell and Zen, 1.12e-5
/// against 3.8e-4). The same weight needs C of about 40 in both dtypes: the difference scales
/// with u, as the derivation says. 1000 leaves a factor above 20 for other CPUs and BLAS
/// builds, and still fails a run whose sums are wrong rather than reordered: a lost micro-batch
/// (of 4) moves the MLP's weights by 0.09 (Adam) to 0.13 (SGD) in 10 steps, 67 times the
/// loosest f32 tolerance (Training.ReorderingToleranceIsFarBelowALostMicrobatch).
inline constexpr double kappa_limit = 1000.0;

inline double tolerance(const Reordering& r) {
  return static_cast<double>(r.steps) * r.lr * static_cast<double>(r.longest_sum) * kappa_limit *
         unit_roundoff(r.dtype);
}

/// The difference the tolerance bounds: |a - b| / max(1, |a|).
inline double relative_difference(double a, double b) { return std::abs(a - b) / std::max(1.0, std::abs(a)); }

/// The largest relative difference of two runs' losses and weights (the runs must have the same
/// steps and weights).
inline double largest_difference(const TrainedRun& a, const TrainedRun& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  double worst = 0;
  for (std::size_t s = 0; s < a.losses.size(); ++s) worst = std::max(worst, relative_difference(a.losses[s], b.losses[s]));
  for (const auto& [name, w] : a.weights) {
    REQUIRE_MESSAGE(b.weights.count(name), "no weight " << name << " in the second run");
    const auto& v = b.weights.at(name);
    REQUIRE(w.size() == v.size());
    for (std::size_t i = 0; i < w.size(); ++i) worst = std::max(worst, relative_difference(w[i], v[i]));
  }
  return worst;
}

/// Checks that two runs' losses and weights agree within `tol` (relative to max(1, |a|)); on
/// failure names the step or the weight and the largest difference. With BATON_TEST_MARGINS=1
/// in the environment, prints each comparison's largest difference against the tolerance.
inline void check_same_training(const TrainedRun& a, const TrainedRun& b, double tol) {
  REQUIRE(a.losses.size() == b.losses.size());
  double worst_loss = 0;
  for (std::size_t s = 0; s < a.losses.size(); ++s) {
    INFO("step " << s << ": loss " << a.losses[s] << " vs " << b.losses[s]);
    CHECK(relative_difference(a.losses[s], b.losses[s]) <= tol);
    worst_loss = std::max(worst_loss, relative_difference(a.losses[s], b.losses[s]));
  }
  REQUIRE(a.weights.size() == b.weights.size());
  double worst_weight = 0;
  std::string worst_name;
  for (const auto& [name, w] : a.weights) {
    REQUIRE_MESSAGE(b.weights.count(name), "no weight " << name << " in the second run");
    const auto& v = b.weights.at(name);
    REQUIRE(w.size() == v.size());
    double worst = 0;
    for (std::size_t i = 0; i < w.size(); ++i) worst = std::max(worst, relative_difference(w[i], v[i]));
    INFO(name << ": largest relative difference " << worst);
    CHECK(worst <= tol);
    if (worst >= worst_weight) worst_weight = worst, worst_name = name;
  }
  if (const char* m = std::getenv("BATON_TEST_MARGINS"); m != nullptr && std::string(m) == "1") {
    std::printf("margin: loss %.3g, weight %.3g (%s), tolerance %.3g: %.2g%% of it used\n", worst_loss,
                worst_weight, worst_name.c_str(), tol, 100 * std::max(worst_loss, worst_weight) / tol);
  }
}

}  // namespace baton::test
