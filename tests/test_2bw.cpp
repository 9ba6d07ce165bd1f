// PipeDream-2BW (`schedule` "2bw"; Narayanan et al., ICML 2021): each stage keeps two versions
// of its weights and applies each step's gradient one step late, so that no stage's next step
// need wait for the step before's last backward (baton's lanes still run 1F1B's order step by
// step: the flush goes once a lane can go on across steps; docs/schedules.md):
//     W(s) = W(s-1) - lr(u) d(grad f(W(s-2))),   W(0) = W(1) = the initial weights,
// where d is the optimizer's direction and u = s - 1 the number of updates applied so far, the
// count the learning-rate schedule and Adam's bias correction see. The job ends with every
// step's gradient applied: the final weights are W(steps + 1).
//
// The claim is checked against a reference written out here in plain loops (a 3-layer tanh MLP
// with a mean-squared-error loss, f64, forward and backward by hand), which applies the same
// delay step by step; the same reference with delay 1 must equal 1F1B, so it is not fitted to
// what baton does.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "equivalence.h"
#include "loopback_run.h"

using namespace baton;

namespace {

constexpr std::int64_t in_width = 4, hidden = 8, out_width = 2;
constexpr std::int64_t global_batch = 8;  // rows a step, split over the micro-batches
constexpr std::int64_t steps = 6;

// Row `row` of the job's data (rows s * global_batch .. of step s): smooth, deterministic, and
// the same double in the reference as in the source kernel.
double feature(std::int64_t row, std::int64_t j) {
  return std::sin(0.37 * static_cast<double>(row) + 1.3 * static_cast<double>(j) + 0.1);
}
double target(std::int64_t row, std::int64_t k) {
  return std::cos(0.21 * static_cast<double>(row) * static_cast<double>(k + 1));
}

/// Micro-batch `piece` of the job: rows piece * rows .. + rows.
class RowsSource final : public Kernel {
 public:
  explicit RowsSource(std::int64_t rows) : rows_(rows) {}
  void compute(KernelContext& ctx) override {
    auto x = ctx.outputs[0]->data<double>();
    auto t = ctx.outputs[1]->data<double>();
    for (std::int64_t r = 0; r < rows_; ++r) {
      const std::int64_t row = ctx.piece * rows_ + r;
      for (std::int64_t j = 0; j < in_width; ++j) x[static_cast<std::size_t>(r * in_width + j)] = feature(row, j);
      for (std::int64_t k = 0; k < out_width; ++k) t[static_cast<std::size_t>(r * out_width + k)] = target(row, k);
    }
  }

 private:
  std::int64_t rows_;
};

struct Setup {
  std::string schedule = "2bw";
  int pp = 1;
  int m = 2;
  OptimizerConfig optimizer = optim::sgd(0.2);
  int dp = 1;
  std::string sync = "allreduce";
  int servers = 1;
  int staleness = 0;
};

/// The MLP: y = tanh(tanh(x w0 + b0) w1 + b1) w2 + b2, loss mse(y, t).
TrainConfig config_of(const Setup& s) {
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = s.m;
  cfg.pp = s.pp;
  cfg.dp = s.dp;
  cfg.schedule = s.schedule;
  cfg.optimizer = s.optimizer;
  cfg.sync = s.sync;
  cfg.servers = s.servers;
  cfg.staleness = s.staleness;
  const std::int64_t rows = global_batch / (s.m * s.dp);
  cfg.data = {{"rows", [rows](const KernelConfig&) { return std::make_unique<RowsSource>(rows); }, {"x", "t"}}};
  return cfg;
}

Value build(Graph& g, std::int64_t rows) {
  Value h = g.input("x", {rows, in_width}, f64);
  Value t = g.input("t", {rows, out_width}, f64);
  std::int64_t width = in_width;
  for (int l = 0; l < 2; ++l) {
    auto w = g.variable("w" + std::to_string(l), {width, hidden}, init::xavier(), f64);
    auto b = g.variable("b" + std::to_string(l), {hidden}, init::uniform(-0.1, 0.1), f64);
    h = tanh(matmul(h, w) + b);
    width = hidden;
  }
  auto w = g.variable("w2", {hidden, out_width}, init::xavier(), f64);
  auto b = g.variable("b2", {out_width}, init::uniform(-0.1, 0.1), f64);
  return mse(matmul(h, w) + b, t);
}

TrainingJob compile(const Setup& s) {
  Graph g(11);
  Value loss = build(g, global_batch / (s.m * s.dp));
  return compile_training(g, loss, config_of(s));
}

test::TrainedRun run(const Setup& s) {
  TrainingJob job = compile(s);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(30'000);
  Runtime rt(job.plan, job.kernels, rs);
  rt.run();
  return test::trained(job);
}

// ---- The reference: plain loops, one step at a time, no baton ----

using Weights = std::map<std::string, std::vector<double>>;

/// y = a[r x n] * b[n x c]
std::vector<double> matmul_of(const std::vector<double>& a, const std::vector<double>& b, std::int64_t r,
                              std::int64_t n, std::int64_t c) {
  std::vector<double> y(static_cast<std::size_t>(r * c), 0.0);
  for (std::int64_t i = 0; i < r; ++i)
    for (std::int64_t k = 0; k < n; ++k)
      for (std::int64_t j = 0; j < c; ++j)
        y[static_cast<std::size_t>(i * c + j)] += a[static_cast<std::size_t>(i * n + k)] * b[static_cast<std::size_t>(k * c + j)];
  return y;
}

/// Step `step`'s loss (over its global batch) and gradient at `w`.
std::pair<double, Weights> loss_and_gradient(const Weights& w, std::int64_t step) {
  const std::int64_t n = global_batch;
  std::vector<double> x(static_cast<std::size_t>(n * in_width)), t(static_cast<std::size_t>(n * out_width));
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t row = step * n + r;
    for (std::int64_t j = 0; j < in_width; ++j) x[static_cast<std::size_t>(r * in_width + j)] = feature(row, j);
    for (std::int64_t k = 0; k < out_width; ++k) t[static_cast<std::size_t>(r * out_width + k)] = target(row, k);
  }
  const std::int64_t widths[] = {in_width, hidden, hidden, out_width};
  std::vector<std::vector<double>> acts{x};  // the input of each layer, then the output
  for (int l = 0; l < 3; ++l) {
    const std::string i = std::to_string(l);
    std::vector<double> z = matmul_of(acts.back(), w.at("w" + i), n, widths[l], widths[l + 1]);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t j = 0; j < widths[l + 1]; ++j) {
        double& v = z[static_cast<std::size_t>(r * widths[l + 1] + j)];
        v += w.at("b" + i)[static_cast<std::size_t>(j)];
        if (l < 2) v = std::tanh(v);
      }
    acts.push_back(std::move(z));
  }
  const std::vector<double>& y = acts.back();
  double loss = 0;
  const double elements = static_cast<double>(n * out_width);
  std::vector<double> dz(y.size());
  for (std::size_t e = 0; e < y.size(); ++e) {
    loss += (y[e] - t[e]) * (y[e] - t[e]) / elements;
    dz[e] = 2.0 * (y[e] - t[e]) / elements;
  }
  Weights grad;
  for (int l = 2; l >= 0; --l) {
    const std::string i = std::to_string(l);
    const std::int64_t a = widths[l], c = widths[l + 1];
    const std::vector<double>& in = acts[static_cast<std::size_t>(l)];
    std::vector<double> gw(static_cast<std::size_t>(a * c), 0.0), gb(static_cast<std::size_t>(c), 0.0);
    std::vector<double> din(static_cast<std::size_t>(n * a), 0.0);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t j = 0; j < c; ++j) {
        const double d = dz[static_cast<std::size_t>(r * c + j)];
        gb[static_cast<std::size_t>(j)] += d;
        for (std::int64_t k = 0; k < a; ++k) {
          gw[static_cast<std::size_t>(k * c + j)] += in[static_cast<std::size_t>(r * a + k)] * d;
          din[static_cast<std::size_t>(r * a + k)] += w.at("w" + i)[static_cast<std::size_t>(k * c + j)] * d;
        }
      }
    grad["w" + i] = std::move(gw);
    grad["b" + i] = std::move(gb);
    if (l > 0) {  // through the tanh that made `in`
      for (std::size_t e = 0; e < din.size(); ++e) din[e] *= 1.0 - in[e] * in[e];
    }
    dz = std::move(din);
  }
  return {loss, grad};
}

/// Training by the rule W(s) = W(s-1) - lr(u) d(gradient of step s - delay), as the file's header
/// says: delay 1 is synchronous training (1F1B, GPipe), delay 2 PipeDream-2BW.
test::TrainedRun reference(const Weights& initial, const OptimizerConfig& oc, int delay) {
  Weights w = initial;
  Weights m, v;  // Adam's moments, or SGD's momentum in m
  for (const auto& [name, x] : w) m[name] = v[name] = std::vector<double>(x.size(), 0.0);
  std::vector<Weights> pending;  // gradients not yet applied, oldest first
  std::int64_t updates = 0;
  test::TrainedRun out;
  auto apply = [&](const Weights& g_in) {
    const std::int64_t u = ++updates;  // 1-based: the optimizer's step
    Weights g = g_in;
    if (oc.clip_norm > 0) {  // by the global norm of the gradient applied now
      double sq = 0;
      for (const auto& [name, x] : g) for (double e : x) sq += e * e;
      const double factor = std::min(1.0, oc.clip_norm / (std::sqrt(sq) + 1e-6));
      if (factor != 1.0) for (auto& [name, x] : g) for (double& e : x) e *= factor;
    }
    const double lr = oc.warmup_steps > 0 && u < oc.warmup_steps
                          ? oc.lr * static_cast<double>(u) / static_cast<double>(oc.warmup_steps)
                          : oc.lr;
    for (auto& [name, x] : w) {
      const std::vector<double>& gi = g.at(name);
      for (std::size_t e = 0; e < x.size(); ++e) {
        if (oc.kind == OptimizerConfig::Kind::sgd) {
          double d = gi[e];
          if (oc.momentum != 0.0) d = m[name][e] = u == 1 ? d : oc.momentum * m[name][e] + d;
          x[e] -= lr * d;
        } else {  // Adam, no weight decay
          double& me = m[name][e];
          double& ve = v[name][e];
          me = oc.beta1 * me + (1 - oc.beta1) * gi[e];
          ve = oc.beta2 * ve + (1 - oc.beta2) * gi[e] * gi[e];
          const double mhat = me / (1 - std::pow(oc.beta1, static_cast<double>(u)));
          const double vhat = ve / (1 - std::pow(oc.beta2, static_cast<double>(u)));
          x[e] -= lr * mhat / (std::sqrt(vhat) + oc.eps);
        }
      }
    }
  };
  for (std::int64_t s = 0; s < steps; ++s) {
    // W(s): the gradient of step s - delay applied to W(s-1).
    if (static_cast<int>(pending.size()) == delay) {
      apply(pending.front());
      pending.erase(pending.begin());
    }
    auto [loss, grad] = loss_and_gradient(w, s);
    out.losses.push_back(loss);
    pending.push_back(std::move(grad));
  }
  for (const Weights& g : pending) apply(g);  // the job ends with every step's gradient applied
  out.weights = w;
  return out;
}

Weights initial_weights(const Setup& s) {
  TrainingJob job = compile(s);  // compiling initialises the weights from the graph's seed
  return test::trained(job).weights;
}

// Both are f64 with the same sums in another order (baton's matmul is BLAS, whose kernels sum
// in an order of their own, per CPU: OPENBLAS_CORETYPE), so Reordering's derivation bounds them:
// steps * lr * n * kappa_limit * u with n = 8 rows (the longest sum) and, for Adam, whose
// direction is the gradient's sign-like ratio, its lr. 6 * 0.2 * 8 * 1000 * 2^-53 = 1.1e-12.
double tolerance_of(const OptimizerConfig& oc) {
  return test::tolerance({.dtype = DType::f64, .steps = steps, .longest_sum = global_batch, .lr = oc.lr});
}

}  // namespace

TEST_CASE("Schedule2bw.MatchesAReferenceThatAppliesEachGradientAStepLate" * doctest::timeout(120)) {
  OptimizerConfig adam = optim::adam(0.05);
  adam.warmup_steps = 3;  // the schedule sees the number of updates applied, as Adam does
  const std::map<std::string, OptimizerConfig> optimizers{
      {"sgd", optim::sgd(0.2)}, {"sgd momentum", optim::sgd(0.2, 0.9)}, {"adam warm-up", adam}};
  for (const auto& [what, oc] : optimizers) {
    for (int pp : {1, 2}) {
      for (int m : {2, 4}) {
        CAPTURE(what);
        CAPTURE(pp);
        CAPTURE(m);
        Setup s{.schedule = "2bw", .pp = pp, .m = m, .optimizer = oc};
        const test::TrainedRun expected = reference(initial_weights(s), oc, 2);
        const test::TrainedRun got = run(s);
        REQUIRE(got.losses.size() == static_cast<std::size_t>(steps));
        test::check_same_training(expected, got, tolerance_of(oc));
      }
    }
  }
}

TEST_CASE("Schedule2bw.TheReferenceWithoutTheDelayIsOneFOneB" * doctest::timeout(60)) {
  // The reference is baton's own synchronous training with delay 1: the loops above are the
  // model baton trains, and only the delay tells 2BW apart.
  for (int pp : {1, 2}) {
    CAPTURE(pp);
    Setup s{.schedule = "1f1b", .pp = pp, .m = 2, .optimizer = optim::sgd(0.2, 0.9)};
    test::check_same_training(reference(initial_weights(s), s.optimizer, 1), run(s), tolerance_of(s.optimizer));
  }
}

TEST_CASE("Schedule2bw.DiffersFromOneFOneBFromTheSecondStepOn" * doctest::timeout(60)) {
  Setup s{.pp = 2, .m = 4, .optimizer = optim::sgd(0.2)};
  const test::TrainedRun two_bw = run(s);
  s.schedule = "1f1b";
  const test::TrainedRun one_f_one_b = run(s);
  REQUIRE(two_bw.losses.size() == one_f_one_b.losses.size());
  // Step 0 runs on the initial weights in both; from step 1 on 1F1B has applied step 0's
  // gradient and 2BW has not (step 1 still runs on the initial weights), and the runs part ways
  // by far more than any reordering of sums (tolerance_of: about 1e-12).
  CHECK(test::relative_difference(two_bw.losses[0], one_f_one_b.losses[0]) <= tolerance_of(s.optimizer));
  for (std::size_t step = 1; step < two_bw.losses.size(); ++step) {
    CAPTURE(step);
    CHECK(test::relative_difference(two_bw.losses[step], one_f_one_b.losses[step]) > 1e-6);
  }
  CHECK(test::largest_difference(two_bw, one_f_one_b) > 1e-3);
}

TEST_CASE("Schedule2bw.RefusesWhatItDoesNotDelay" * doctest::timeout(30)) {
  SUBCASE("ZeRO") {
    Graph g(11);
    Value loss = build(g, global_batch / 4);
    TrainConfig cfg = config_of({.m = 2});
    cfg.dp = 2;
    cfg.zero = 1;
    CHECK_THROWS_WITH_AS(compile_training(g, loss, cfg),
                         doctest::Contains("--schedule 2bw with --zero 1"), GraphError);
  }
  SUBCASE("a resumed job") {
    Graph g(11);
    Value loss = build(g, global_batch / 2);
    TrainConfig cfg = config_of({.m = 2});
    cfg.first_step = 2;
    CHECK_THROWS_WITH_AS(compile_training(g, loss, cfg),
                         doctest::Contains("--schedule 2bw with a resumed job"), GraphError);
  }
}

TEST_CASE("Schedule2bw.WithDataParallelismAndClipping" * doctest::timeout(60)) {
  // The all-reduced gradient and the clipping factor of step s are both read two steps late,
  // together: the factor is the one of the gradient it scales.
  OptimizerConfig clipped = optim::sgd(0.2, 0.9);
  clipped.clip_norm = 0.05;  // below this model's gradient norms, so it clips
  for (int pp : {1, 2}) {
    std::vector<test::TrainedRun> runs;
    for (const OptimizerConfig& oc : {optim::sgd(0.2, 0.9), clipped}) {
      CAPTURE(pp);
      CAPTURE(oc.clip_norm);
      Setup s{.schedule = "2bw", .pp = pp, .m = 2, .optimizer = oc, .dp = 2};
      runs.push_back(run(s));
      test::check_same_training(reference(initial_weights(s), oc, 2), runs.back(), tolerance_of(oc));
    }
    CHECK(test::largest_difference(runs[0], runs[1]) > 1e-3);  // the clipping did clip
  }
}

// ---- Parameter servers (TrainConfig::sync "ps"): the same rule with delay 1 + staleness ----

TEST_CASE("ParameterServer.SynchronousTrainsAsAllReduce" * doctest::timeout(120)) {
  // Staleness 0: every step's summed gradient applied at once, as the all-reduce does. The
  // servers add the replicas' gradients in replica order, the ring in its own: the same sums in
  // another order (tolerance_of's derivation; two replicas give the same bits, a + b = b + a).
  for (int dp : {1, 2, 4}) {
    for (int servers : {1, 2, 3}) {
      CAPTURE(dp);
      CAPTURE(servers);
      const OptimizerConfig oc = optim::adam(0.05);
      Setup ps{.schedule = "1f1b", .m = 2, .optimizer = oc, .dp = dp, .sync = "ps", .servers = servers};
      Setup ring = ps;
      ring.sync = "allreduce";
      ring.servers = 1;
      const test::TrainedRun got = run(ps);
      test::check_same_training(run(ring), got, tolerance_of(oc));
      test::check_same_training(reference(initial_weights(ps), oc, 1), got, tolerance_of(oc));
    }
  }
}

TEST_CASE("ParameterServer.StaleTrainsAsItsReferenceStepByStep" * doctest::timeout(180)) {
  // Staleness S: W(s) = W(s-1) - lr d(gradient of step s - 1 - S), the first S + 1 steps on the
  // initial weights, every gradient applied by the end; the optimizer counts updates applied.
  OptimizerConfig adam = optim::adam(0.05);
  adam.warmup_steps = 3;
  const std::map<std::string, OptimizerConfig> optimizers{{"sgd momentum", optim::sgd(0.2, 0.9)}, {"adam warm-up", adam}};
  for (const auto& [what, oc] : optimizers) {
    for (int staleness : {1, 2, 4}) {
      for (int dp : {1, 2}) {
        CAPTURE(what);
        CAPTURE(staleness);
        CAPTURE(dp);
        Setup s{.schedule = "1f1b", .m = 2, .optimizer = oc, .dp = dp, .sync = "ps", .servers = 2,
                .staleness = staleness};
        const test::TrainedRun got = run(s);
        test::check_same_training(reference(initial_weights(s), oc, 1 + staleness), got, tolerance_of(oc));
      }
    }
  }
  // The staleness is real: S 1 differs from S 0 from the second step on.
  Setup s0{.schedule = "1f1b", .m = 2, .dp = 2, .sync = "ps"};
  Setup s1 = s0;
  s1.staleness = 1;
  const test::TrainedRun a = run(s0), b = run(s1);
  CHECK(a.losses[0] == b.losses[0]);
  CHECK(std::abs(a.losses[2] - b.losses[2]) > 1e-6);
}

TEST_CASE("ParameterServer.WeightsAreShardedOverTheServersByBytes") {
  Setup s{.schedule = "1f1b", .m = 2, .dp = 2, .sync = "ps", .servers = 2};
  const TrainingJob job = compile(s);
  std::map<std::string, std::int64_t> bytes_on;  // server suffix -> weight bytes
  int variables = 0;
  for (const ActorDesc& a : job.plan.actors) {
    if (!a.op.starts_with("variable.")) continue;
    ++variables;
    CAPTURE(a.name);
    // On a server's own device (cpu:2, cpu:3 after the replicas' cpu:0, cpu:1), not a replica's.
    REQUIRE(a.name.find("@ps") != std::string::npos);
    CHECK(a.where.device.index >= 2);
    const RegisterDesc& w = job.plan.registers[a.outputs[0]];
    bytes_on[a.name.substr(a.name.find("@ps"))] += numel(w.shape) * static_cast<std::int64_t>(size_of(w.dtype));
    // Read by both replicas' repeats: each pulls the weights once a step.
    int repeats = 0;
    for (ActorIndex c : w.consumers) repeats += job.plan.actors[c].kind == ActorKind::repeat;
    CHECK(repeats == 2);
  }
  CHECK(variables == 6);  // one optimizer a weight, on the servers alone
  REQUIRE(bytes_on.size() == 2);
  // Largest first to the emptier server: w0 (4x8) and w1 (8x8) and w2 (8x2) and the biases.
  const auto [lo, hi] = std::minmax(bytes_on.begin()->second, bytes_on.rbegin()->second);
  CHECK(hi - lo <= 8 * 8 * 8);
}

// The trained weights are gathered once, at the end, by an accumulate whose group is the whole
// run (ActorDesc::at_end). The compiler's dry run proves a plan in a few of its iterations; it
// once counted that group into the iteration, so a run of 60,000 steps was refused as a
// deadlock (its act budget ran out). Found under parameter servers, where the weights live on
// the servers; pipeline stages over ranks had it too.
TEST_CASE("ParameterServer.ALongRunIsProvenAsQuicklyAsAShortOne" * doctest::timeout(60)) {
  Setup s{.schedule = "1f1b", .m = 2, .dp = 2, .sync = "ps", .servers = 2, .staleness = 2};
  Graph g(11);
  Value loss = build(g, global_batch / (s.m * s.dp));
  TrainConfig cfg = config_of(s);
  cfg.steps = 1'000'000;
  const TrainingJob job = compile_training(g, loss, cfg);  // verified after every pass
  int at_end = 0;
  for (const ActorDesc& a : job.plan.actors) {
    if (!a.at_end) continue;
    ++at_end;
    CAPTURE(a.name);
    CHECK(a.kind == ActorKind::accumulate);
    CHECK(a.group == 1'000'000 + 1 + s.staleness);  // every step's weights, then the delayed ones
    // Kept where its server writes it: the job's result does not pass through a worker.
    CHECK(a.where.device.index >= 2);
  }
  CHECK(at_end == 6);
  // The loss is reported by server 0, as the mean of (loss, 1) pairs.
  const auto report = std::find_if(job.plan.actors.begin(), job.plan.actors.end(),
                                   [](const ActorDesc& a) { return a.name == "loss.report"; });
  REQUIRE(report != job.plan.actors.end());
  CHECK(report->where.device.index == 2);
}

// A parameter-server job of 2 workers (ranks 0, 1) and 1 server (rank 2), staleness 2, on ranks
// of one process. `first_step` > 0: the plan of worker rank 1 coming back there (rejoin).
static TrainingJob ps_job_on_ranks(std::int64_t steps, std::int64_t first_step = 0) {
  Setup s{.schedule = "1f1b", .m = 2, .dp = 2, .sync = "ps", .servers = 1, .staleness = 2};
  Graph g(11);
  Value loss = build(g, global_batch / (s.m * s.dp));
  TrainConfig cfg = config_of(s);
  cfg.steps = steps;
  cfg.first_step = first_step;
  cfg.rejoin = first_step > 0;
  cfg.replica_places = {Placement{.rank = 0}, Placement{.rank = 1}};
  cfg.server_places = {Placement{.rank = 2}};
  return compile_training(g, loss, cfg);
}

// Each rank of `job` a Runtime on `hub`.
static std::vector<std::unique_ptr<Runtime>> runtimes_on(const TrainingJob& job, transport::LoopbackHub& hub) {
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (std::uint16_t r = 0; r < 3; ++r) {
    RuntimeSettings rs;
    rs.rank = r;
    rs.link = &hub.link(r);
    runtimes.push_back(std::make_unique<Runtime>(job.plan, job.kernels, rs));
  }
  return runtimes;
}

// Runs `rt` on a thread of its own; its report or error lands in `result`.
static std::thread run_in_thread(Runtime& rt, test::RankResult& result) {
  return std::thread([&rt, &result] {
    try {
      result.report = rt.run();
    } catch (const std::exception& e) {
      result.error = e.what();
    }
  });
}

// A worker rank that leaves (Runtime::rank_left: what run_job does when the control plane says
// a rank that may leave has left) leaves the servers going: every rank a Runtime in this process
// over a loopback hub (2 workers, 1 server rank, staleness 2), worker rank 1 stopped once the
// server has reported some steps. The run ends on the others; every step's loss is reported
// (from then on the mean over worker 0 alone, as (loss, 1) pairs summed on the server); the
// steps reported before it left are those of a run nobody left, bit for bit.
TEST_CASE("ParameterServer.AWorkerRankThatLeavesLeavesTheServersGoing" * doctest::timeout(120)) {
  constexpr std::int64_t long_steps = 120, leave_after = 30;
  const TrainingJob whole = ps_job_on_ranks(long_steps);
  for (const auto& r : test::run_on_loopback(whole.plan, whole.kernels)) REQUIRE_MESSAGE(r.report, r.error);
  const std::vector<double> undisturbed = whole.losses->per_step();
  REQUIRE(undisturbed.size() == static_cast<std::size_t>(long_steps));

  // Ranks of one host (pieces read where they lie) and of different hosts (pieces pulled: a
  // pull from the rank that left may be in flight, and lands as zeros).
  for (const bool shares_memory : {true, false}) {
    CAPTURE(shares_memory);
    const TrainingJob job = ps_job_on_ranks(long_steps);
    transport::LoopbackHub hub(3, shares_memory);
    const auto runtimes = runtimes_on(job, hub);
    hub.start();
    std::vector<test::RankResult> results(3);
    std::vector<std::thread> threads;
    for (std::uint16_t r = 0; r < 3; ++r) threads.push_back(run_in_thread(*runtimes[r], results[r]));
    // Worker 1 goes once the server has reported some steps; the others are told it left.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (job.losses->steps_done() < leave_after && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    const std::int64_t reported_before = job.losses->steps_done();
    runtimes[1]->abort("stopped by the test");
    for (std::uint16_t r : {0, 2}) runtimes[r]->rank_left(1, "stopped by the test");
    for (auto& t : threads) t.join();
    hub.stop();
    INFO("rank 0: " << results[0].error << "; rank 2: " << results[2].error);
    REQUIRE(results[0].report);
    REQUIRE(results[2].report);
    CHECK_FALSE(results[1].report);
    REQUIRE(results[2].report->departed.size() == 1);
    CHECK(results[2].report->departed[0] == "rank 1: stopped by the test");
    const std::vector<double> losses = job.losses->per_step();
    REQUIRE(losses.size() == static_cast<std::size_t>(long_steps));
    MESSAGE("worker 1 left after the server had reported " << reported_before << " of " << long_steps << " steps");
    REQUIRE(reported_before >= leave_after);
    REQUIRE(reported_before < long_steps);  // it left mid-run
    for (std::size_t i = 0; i < losses.size(); ++i) {
      CAPTURE(i);
      CHECK(std::isfinite(losses[i]));
      // Reported before it left: computed before it left, the same as when nobody leaves.
      if (static_cast<std::int64_t>(i) < leave_after) CHECK(losses[i] == undisturbed[i]);
    }
    // From then on worker 0 trains alone: the run is not the undisturbed one.
    CHECK(losses.back() != undisturbed.back());
  }
}

// A worker rank that left comes back (what run_job does for a process that baton-launch
// --max-restarts started again): the server and the other worker hold the actors that talk to
// rank 1 and answer the first step it may come back at (Runtime::hold_for_rejoin); rank 1 is a
// new Runtime on the same hub whose plan starts at the largest answer (TrainConfig::first_step,
// rejoin; RuntimeSettings::rejoin_step numbers its pieces as the others'); then they take it
// back (rank_rejoined). The new rank must train every step from there to the end: it finishes
// only once the server has read every gradient and loss it wrote (its registers' slots come
// back), and the server only once it has a gradient from it for every step from there (its
// transfers wait for them: no zeros any more).
TEST_CASE("ParameterServer.AWorkerRankThatLeftComesBackAtTheServersStep" * doctest::timeout(120)) {
  constexpr std::int64_t long_steps = 120, leave_after = 20;
  const TrainingJob whole = ps_job_on_ranks(long_steps);
  for (const auto& r : test::run_on_loopback(whole.plan, whole.kernels)) REQUIRE_MESSAGE(r.report, r.error);
  const std::vector<double> undisturbed = whole.losses->per_step();

  for (const bool shares_memory : {true, false}) {
    CAPTURE(shares_memory);
    const TrainingJob job = ps_job_on_ranks(long_steps);
    transport::LoopbackHub hub(3, shares_memory);
    const auto runtimes = runtimes_on(job, hub);
    hub.start();
    std::vector<test::RankResult> results(4);  // [3]: rank 1 come back
    std::vector<std::thread> threads;
    for (std::uint16_t r = 0; r < 3; ++r) threads.push_back(run_in_thread(*runtimes[r], results[r]));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (job.losses->steps_done() < leave_after && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    runtimes[1]->abort("stopped by the test");
    threads[1].join();
    for (std::uint16_t r : {0, 2}) runtimes[r]->rank_left(1, "stopped by the test");

    // It comes back: every other rank holds and answers; the largest answer is the step.
    const std::chrono::milliseconds patience{10'000};
    std::int64_t step = 0;
    for (std::uint16_t r : {0, 2}) step = std::max(step, runtimes[r]->hold_for_rejoin(1, patience));
    MESSAGE("worker 1 comes back at step " << step << " of " << long_steps);
    REQUIRE(step >= leave_after);
    REQUIRE(step < long_steps);
    const TrainingJob back_job = ps_job_on_ranks(long_steps, step);
    RuntimeSettings rs;
    rs.rank = 1;
    rs.link = &hub.link(1);
    rs.rejoin_step = step;
    Runtime back(back_job.plan, back_job.kernels, rs);
    for (std::uint16_t r : {0, 2}) runtimes[r]->rank_rejoined(1, step, patience);
    std::thread back_thread = run_in_thread(back, results[3]);
    for (std::uint16_t r : {0, 2}) threads[r].join();
    back_thread.join();
    hub.stop();
    INFO("rank 0: " << results[0].error << "; rank 2: " << results[2].error << "; rank 1 come back: " << results[3].error);
    REQUIRE(results[0].report);
    REQUIRE(results[2].report);
    REQUIRE(results[3].report);
    CHECK(results[2].report->rejoined == std::vector<std::string>{fmt::format("rank 1 from step {}", step + 1)});
    // The new rank 1 trained every step from `step` on: its data source drew m pieces a step.
    std::uint64_t drawn = 0;
    for (const auto& a : results[3].report->metrics.actors) {
      if (a.kind == ActorKind::source && a.where.rank == 1 && a.name.starts_with("data.")) drawn = std::max(drawn, a.acts);
    }
    CHECK(drawn == static_cast<std::uint64_t>((long_steps - step) * 2));
    const std::vector<double> losses = job.losses->per_step();
    REQUIRE(losses.size() == static_cast<std::size_t>(long_steps));
    for (std::size_t i = 0; i < losses.size(); ++i) {
      CAPTURE(i);
      CHECK(std::isfinite(losses[i]));
      if (static_cast<std::int64_t>(i) < leave_after) CHECK(losses[i] == undisturbed[i]);
    }
  }
}

TEST_CASE("ParameterServer.RefusesWhatItDoesNotServe") {
  auto refused = [](Setup s, const std::string& why) {
    CAPTURE(why);
    CHECK_THROWS_WITH_AS(compile(s), doctest::Contains(why.c_str()), GraphError);
  };
  Setup ps{.schedule = "1f1b", .m = 2, .dp = 2, .sync = "ps"};
  Setup s = ps;
  s.sync = "gossip";
  refused(s, "sync 'gossip': allreduce or ps");
  s = ps;
  s.pp = 2;
  refused(s, "sync ps with pp 2: servers for pipeline stages are not built yet");
  s = ps;
  s.servers = 0;
  refused(s, "sync ps needs at least 1 server, not 0");
  s = ps;
  s.sync = "allreduce";
  s.staleness = 2;
  refused(s, "staleness 2 is for parameter servers");
  s = ps;
  s.optimizer.clip_norm = 1.0;
  refused(s, "sync ps with clip norm 1");
  s = ps;
  s.schedule = "2bw";
  refused(s, "sync ps with schedule 2bw");
}
