// Checkpoints (checkpoint.h, safetensors.h): the file format, resuming bit for bit, and every
// kind of bad checkpoint failing with one line that names the file.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <boost/json.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/actors.h"
#include "baton/graph.h"
#include "baton/kernels/data.h"
#include "equivalence.h"
#include "loopback_run.h"
#include "models.h"
#include "test_util.h"

using namespace baton;
namespace fs = std::filesystem;

namespace {

/// A fresh directory under /tmp, removed at the end of the test.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    static int counter = 0;
    path = fs::temp_directory_path() / fmt::format("baton-ckpt-{}-{}-{}", ::getpid(), name, counter++);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << bytes;
}

struct Setup {
  int dp = 1;
  int pp = 1;
  int tp = 1;
  std::int64_t microbatches = 2;  // per replica
  std::int64_t steps = 20;
  OptimizerConfig opt = optim::adam(0.01);
  std::vector<Placement> places;  // on ranks (run on a loopback hub); empty: in-process devices
  fs::path dir;                   // checkpoints go here (empty: none)
  std::int64_t every = 10;
  int keep = 2;
  fs::path resume;  // a checkpoint directory to resume from
  double dropout = 0.2;
  DType dtype = DType::f32;  // of the input and the weights
  int zero = 0;              // ZeRO stage (with dp > 1)
  std::map<std::string, std::string> assets;  // checkpoint::Settings::assets
};

struct Run {
  std::vector<double> losses;  // this job's steps
  std::map<std::string, std::string> weights;  // the bytes of each trained weight
  std::int64_t first_step = 0;
};

/// The MLP of models.h (with dropout after the first layer, so that the random draws must go
/// on too) on synthetic data, global batch 32.
Run train(const Setup& s) {
  constexpr std::int64_t batch = 32;
  auto dataset = std::make_shared<const data::Dataset>(data::synthetic(256, 12, 4, 99));
  Graph g(5);
  const std::int64_t pieces = s.dp * s.microbatches;
  const std::int64_t mb = batch / pieces;
  Value logits =
      models::mlp(g, mb, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = s.tp, .dtype = s.dtype});
  Value loss = softmax_cross_entropy(s.dropout > 0 ? dropout(logits, s.dropout) : logits, g.find("label"));
  TrainConfig cfg;
  cfg.steps = s.steps;
  cfg.microbatches = s.microbatches;
  cfg.dp = s.dp;
  cfg.zero = s.zero;
  cfg.pp = s.pp;
  cfg.tp = s.tp;
  cfg.optimizer = s.opt;
  cfg.replica_places = s.places;
  cfg.data = {{"synthetic", data::batch_source(dataset, batch, pieces, 7), {"x", "label"}}};
  auto params = ParameterStore::initialize(g);
  std::optional<checkpoint::Checkpoint> resumed;
  if (!s.resume.empty()) {
    resumed = checkpoint::load(checkpoint::find(s.resume).dir);
    checkpoint::reshard(*resumed, *params);  // as baton-train does: a checkpoint of another tp
    checkpoint::restore(*resumed, *params, s.opt);
    cfg.first_step = resumed->step;
    cfg.optimizer_state = std::make_shared<OptimizerState>(resumed->slots);
  }
  // One writer per rank, as each process of a job has its own; snapshots go to the writer of
  // the rank that trains the variable.
  int ranks = 1;
  for (const Placement& p : s.places) ranks = std::max(ranks, p.rank + 1);
  std::vector<std::shared_ptr<checkpoint::Writer>> writers;
  // Each snapshot's rank, by its weight and where its piece begins (ZeRO's shards: pieces).
  auto rank_of = std::make_shared<std::map<std::pair<std::string, std::int64_t>, std::uint32_t>>();
  if (!s.dir.empty()) {
    for (int r = 0; r < ranks; ++r) {
      checkpoint::Settings cs{.dir = s.dir, .keep = s.keep, .rank = static_cast<std::uint32_t>(r),
                              .layout = {s.dp, s.pp, s.tp, ranks}, .optimizer = s.opt,
                              .config = {{"model", "mlp"}, {"run", "test"}}, .batch = batch, .seed = 5,
                              .assets = s.assets};
      writers.push_back(std::make_shared<checkpoint::Writer>(cs));
    }
    cfg.snapshot_every = s.every;
    cfg.on_snapshot = [writers, rank_of](VariableSnapshot snap) {
      writers[rank_of->at({snap.name, snap.begin})]->take(std::move(snap));
    };
  }
  TrainingJob job = compile_training(g, loss, cfg, params);
  if (resumed) checkpoint::check_covers(*resumed, job.trained);
  for (const SnapshotPart& p : job.snapshots) (*rank_of)[{p.name, p.begin}] = p.rank;
  for (auto& w : writers) w->expect(job.snapshots);
  RuntimeSettings rs;
  rs.stall_timeout = std::chrono::milliseconds(20'000);
  if (ranks == 1) {
    Runtime rt(job.plan, job.kernels, rs);
    rt.run();
  } else {
    for (const auto& r : test::run_on_loopback(insert_transfers(job.plan), job.kernels, rs)) {
      REQUIRE_MESSAGE(r.error.empty(), r.error);
    }
  }
  for (auto& w : writers) w->finish();
  Run out;
  out.losses = job.losses->per_step();
  out.first_step = cfg.first_step;
  // Replica 0's weights (every rank's, as all run in this process).
  for (const auto& [name, where] : job.trained) {
    const Tensor& t = job.params->at(name);
    out.weights[name] = std::string(static_cast<const char*>(t.raw()), t.nbytes());
  }
  return out;
}

/// Exactly equal: the same doubles and the same bytes.
void check_continues(const Run& straight, const Run& resumed) {
  REQUIRE(resumed.first_step > 0);
  REQUIRE(straight.losses.size() == resumed.losses.size() + static_cast<std::size_t>(resumed.first_step));
  for (std::size_t i = 0; i < resumed.losses.size(); ++i) {
    const std::size_t step = i + static_cast<std::size_t>(resumed.first_step);
    INFO("step " << step + 1 << ": " << straight.losses[step] << " vs " << resumed.losses[i]);
    CHECK(std::memcmp(&straight.losses[step], &resumed.losses[i], sizeof(double)) == 0);
  }
  REQUIRE(straight.weights.size() == resumed.weights.size());
  for (const auto& [name, bytes] : straight.weights) {
    INFO(name);
    const bool same_bytes = bytes == resumed.weights.at(name);
    CHECK(same_bytes);
  }
}

/// `r`'s weights, as doubles, and `losses`: for test::check_same_training.
test::TrainedRun as_trained(const Run& r, std::vector<double> losses, DType dtype) {
  test::TrainedRun out;
  out.losses = std::move(losses);
  for (const auto& [name, bytes] : r.weights) {
    std::vector<double>& w = out.weights[name];
    for (std::size_t at = 0; at < bytes.size(); at += size_of(dtype)) {
      double v;
      if (dtype == DType::f64) {
        std::memcpy(&v, bytes.data() + at, sizeof v);
      } else {
        float f;
        std::memcpy(&f, bytes.data() + at, sizeof f);
        v = f;
      }
      w.push_back(v);
    }
  }
  return out;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

/// A one-rank checkpoint of 10 steps of the MLP with Adam, in `dir`/step-00000010.
fs::path make_checkpoint(const fs::path& dir, OptimizerConfig opt = optim::adam(0.01)) {
  train({.steps = 10, .opt = opt, .dir = dir, .every = 10});
  return checkpoint::step_dir(dir, 10);
}

}  // namespace

TEST_CASE("Safetensors.RoundTripKeepsNamesShapesDtypesBytesAndMetadata") {
  TempDir tmp("roundtrip");
  Tensor a = Tensor::empty({2, 3}, f32), b = Tensor::empty({}, f64), c = Tensor::empty({4}, i32),
         d = Tensor::empty({0, 5}, f32), e = Tensor::empty({3}, i64), f = Tensor::empty({5}, u8);
  for (int i = 0; i < 6; ++i) a.data<float>()[static_cast<std::size_t>(i)] = 0.5f * static_cast<float>(i) - 1.0f;
  b.data<double>()[0] = 3.141592653589793;
  for (int i = 0; i < 4; ++i) c.data<std::int32_t>()[static_cast<std::size_t>(i)] = -7 * i;
  for (int i = 0; i < 3; ++i) e.data<std::int64_t>()[static_cast<std::size_t>(i)] = std::int64_t{1} << (40 + i);
  for (int i = 0; i < 5; ++i) f.data<std::uint8_t>()[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(250 + i);
  const fs::path p = tmp.path / "t.safetensors";
  safetensors::write(p, {{"a", a}, {"b", b}, {"c", c}, {"d", d}, {"e", e}, {"f", f}}, {{"step", "7"}});
  // The data starts 8-byte aligned, as the reference writer pads it.
  const std::string bytes = read_bytes(p);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
  safetensors::Contents got = safetensors::read(p);
  CHECK(got.metadata == std::map<std::string, std::string>{{"step", "7"}});
  REQUIRE(got.tensors.size() == 6);
  const std::vector<std::pair<std::string, Tensor>> want{{"a", a}, {"b", b}, {"c", c}, {"d", d}, {"e", e}, {"f", f}};
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO(want[i].first);
    CHECK(got.tensors[i].first == want[i].first);
    CHECK(got.tensors[i].second.shape() == want[i].second.shape());
    CHECK(got.tensors[i].second.dtype() == want[i].second.dtype());
    CHECK(std::memcmp(got.tensors[i].second.raw(), want[i].second.raw(), want[i].second.nbytes()) == 0);
  }
  CHECK(got.find("c") != nullptr);
  CHECK(got.find("zz") == nullptr);
}

TEST_CASE("Safetensors.BadFilesFailWithTheFileAndTheTensorNamed") {
  TempDir tmp("bad");
  Tensor w = Tensor::zeros({2, 2}, f32);
  const fs::path good = tmp.path / "good.safetensors";
  safetensors::write(good, {{"w", w}, {"v", Tensor::zeros({3}, f32)}}, {{"k", "v"}});
  const std::string bytes = read_bytes(good);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  std::string header = bytes.substr(8, n);
  const std::string data = bytes.substr(8 + n);
  // A file with this header (padded to its old length where it is shorter) and data.
  auto with_header = [&](std::string h, const std::string& d) {
    std::string out(8, '\0');
    const std::uint64_t len = h.size();
    std::memcpy(out.data(), &len, 8);
    return out + h + d;
  };
  auto read_error = [&](const std::string& file_bytes) {
    const fs::path p = tmp.path / "bad.safetensors";
    write_bytes(p, file_bytes);
    std::string e = error_of([&] { safetensors::read(p); });
    CHECK_MESSAGE(test::contains(e, p.string() + ": "), e);
    return e;
  };
  auto expect_read_error = [&](const std::string& file_bytes, const std::string& needle) {
    const std::string e = read_error(file_bytes);
    CHECK_MESSAGE(test::contains(e, needle), e);
  };
  auto replaced = [&](std::string from, std::string to) {
    std::string h = header;
    const auto at = h.find(from);
    REQUIRE_MESSAGE(at != std::string::npos, from);
    h.replace(at, from.size(), to);
    return h;
  };
  expect_read_error(bytes.substr(0, 5), "too short");
  expect_read_error(bytes.substr(0, bytes.size() - 4), "tensor 'v': data_offsets [16, 28] are outside the 24 bytes");
  expect_read_error(bytes.substr(0, 8 + n / 2), "runs past the end of the file");
  std::string huge = bytes;
  const std::uint64_t big = std::uint64_t{1} << 62;
  std::memcpy(huge.data(), &big, 8);
  expect_read_error(huge, "runs past the end");
  expect_read_error(with_header("{\"w\": [1, 2", data), "not valid JSON");
  expect_read_error(with_header("[1, 2, 3]", data), "not a JSON object");
  expect_read_error(with_header(replaced("\"F32\"", "\"F8_E4M3\""), data), "tensor 'w': dtype 'F8_E4M3'");
  expect_read_error(with_header(replaced("[2,2]", "[2,3]"), data), "tensor 'w': F32 [2, 3] needs 24 bytes");
  expect_read_error(with_header(replaced("[2,2]", "[2,-2]"), data), "tensor 'w': shape");
  expect_read_error(with_header(replaced("[16,28]", "[16,2800]"), data), "outside the 28 bytes");
  expect_read_error(with_header(replaced("[16,28]", "[12,24]"), data), "overlap");
  expect_read_error(with_header(replaced("[0,16]", "[\"a\",16]"), data), "tensor 'w': data_offsets");
  expect_read_error(with_header(replaced("\"k\":\"v\"", "\"k\":7"), data), "__metadata__ 'k'");
  CHECK(test::contains(read_error(with_header(replaced("{\"dtype\":\"F32\",\"shape\":[3]", "{\"shape\":[3]"), data)),
                       "tensor 'v': no dtype"));
  expect_read_error(std::string(8, '\0') + data, "the header length 0 cannot hold a JSON object");
  CHECK(test::contains(error_of([&] { safetensors::read(tmp.path / "none.safetensors"); }), "none.safetensors: cannot read"));
}

TEST_CASE("Checkpoint.ResumeContinuesTheLossCurveBitForBit" * doctest::timeout(240)) {
  // 20 steps straight vs 10, then a new job resumed from the checkpoint of step 10: the same
  // losses and weights to the last bit, with dropout drawing, for both optimizers' state.
  struct Case {
    const char* name;
    Setup setup;
  };
  const std::vector<Case> cases{
      {"adam", {.opt = optim::adam(0.01)}},
      {"sgd momentum", {.opt = optim::sgd(0.1, 0.9)}},
      {"adamw warm-up cosine clip", {.opt = [] {
         OptimizerConfig o = optim::adamw(0.01, 0.01);
         o.warmup_steps = 4;
         o.cosine = true;
         o.clip_norm = 0.5;
         return o;
       }()}},
      {"dp2", {.dp = 2, .opt = optim::adam(0.01)}},
      {"pp2 1f1b", {.pp = 2, .microbatches = 4, .opt = optim::sgd(0.1, 0.9)}},
      {"tp2", {.tp = 2, .opt = optim::adam(0.01)}},
      // On sim devices a device's weights are stepped by one actor (the updates pass): its
      // members hand their state over at checkpoint steps, and a resumed group starts from the
      // saved slots at the resumed step.
      {"sim clip", {.opt = [] {
         OptimizerConfig o = optim::adam(0.01);
         o.clip_norm = 0.5;
         return o;
       }(),
                    .places = {{.device = Device::parse("sim:0")}}}},
      {"sim dp2", {.dp = 2, .opt = optim::sgd(0.1, 0.9),
                   .places = {{.device = Device::parse("sim:0")}, {.device = Device::parse("sim:1")}}}},
  };
  for (const Case& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    TempDir a("straight"), b("resumed"), d("snapshot");
    Setup straight = c.setup;
    straight.dir = a.path;
    const Run all = train(straight);
    REQUIRE(all.losses.size() == 20);
    CHECK(fs::is_directory(checkpoint::step_dir(a.path, 10)));
    CHECK(fs::is_directory(checkpoint::step_dir(a.path, 20)));
    // The snapshot taken in the stream at step 10 of the running job, resumed.
    fs::copy(checkpoint::step_dir(a.path, 10), checkpoint::step_dir(d.path, 10));
    Setup from_snapshot = c.setup;
    from_snapshot.resume = d.path;
    check_continues(all, train(from_snapshot));
    if (c.setup.opt.cosine) continue;  // a job of 10 steps decays its rate over 10, not 20
    // A job of 10 steps, then a new job of 20 resumed from its last checkpoint.
    Setup first = c.setup;
    first.steps = 10;
    first.dir = b.path;
    train(first);
    Setup rest = c.setup;
    rest.resume = b.path;
    rest.dir = b.path;
    const Run resumed = train(rest);
    check_continues(all, resumed);
    // The checkpoints of step 20 agree byte for byte (weights and optimizer state).
    const bool same_files = read_bytes(checkpoint::step_dir(a.path, 20) / "rank0.safetensors") ==
                            read_bytes(checkpoint::step_dir(b.path, 20) / "rank0.safetensors");
    CHECK(same_files);
  }
}

TEST_CASE("Checkpoint.EachRankWritesItsShardsAndResumeReadsThem" * doctest::timeout(240)) {
  // Two pipeline stages on two ranks (runtimes joined by a loopback hub): each rank writes the
  // weights it trains into its own file; a resumed job on the same layout continues bit for bit.
  TempDir a("ranks-straight"), b("ranks-resumed");
  const std::vector<Placement> places{{.rank = 0}, {.rank = 1}};
  const Setup base{.pp = 2, .microbatches = 4, .opt = optim::adam(0.01), .places = places};
  Setup straight = base;
  straight.dir = a.path;
  const Run all = train(straight);
  const fs::path step10 = checkpoint::step_dir(a.path, 10);
  CHECK(fs::exists(step10 / "rank0.safetensors"));
  CHECK(fs::exists(step10 / "rank1.safetensors"));
  const checkpoint::Checkpoint c = checkpoint::load(step10);
  CHECK(c.layout == checkpoint::Layout{1, 2, 1, 2});
  Setup first = base;
  first.steps = 10;
  first.dir = b.path;
  train(first);
  Setup rest = base;
  rest.resume = b.path;
  const Run resumed = train(rest);
  REQUIRE(resumed.first_step == 10);
  REQUIRE(all.losses.size() == 20);
  REQUIRE(resumed.losses.size() == 10);
  for (std::size_t i = 0; i < 10; ++i) CHECK(all.losses[10 + i] == resumed.losses[i]);
  // A file missing (a rank that died while writing): that checkpoint is incomplete.
  fs::remove(checkpoint::step_dir(b.path, 10) / "rank1.safetensors");
  const std::string e = error_of([&] { checkpoint::load(checkpoint::step_dir(b.path, 10)); });
  CHECK_MESSAGE(test::contains(e, "rank1.safetensors: missing: the checkpoint is incomplete"), e);
}

TEST_CASE("Checkpoint.ResumeWithAnotherLayoutContinuesTheCurve" * doctest::timeout(240)) {
  // Weights are found by name, so a checkpoint of one device resumes as dp2 x pp2: the same
  // curve within float tolerance: the gradients of its last 10 steps are summed in another
  // order, test::Reordering's tolerance (10 steps, sums over the batch of 32), in f64 and f32.
  // Without dropout: its draws are keyed by each replica's own piece numbers, which dp changes.
  for (DType dtype : {DType::f64, DType::f32}) {
    CAPTURE(dtype);
    TempDir a("layout");
    const Run all = train({.microbatches = 4, .opt = optim::adam(0.01), .dropout = 0, .dtype = dtype});
    train({.microbatches = 4, .steps = 10, .opt = optim::adam(0.01), .dir = a.path, .dropout = 0, .dtype = dtype});
    const Run resumed = train({.dp = 2, .pp = 2, .microbatches = 2, .opt = optim::adam(0.01), .resume = a.path,
                               .dropout = 0, .dtype = dtype});
    REQUIRE(resumed.losses.size() == 10);
    const test::TrainedRun straight_end = as_trained(all, {all.losses.begin() + 10, all.losses.end()}, dtype);
    const test::TrainedRun resumed_end = as_trained(resumed, resumed.losses, dtype);
    test::check_same_training(straight_end, resumed_end,
                              test::tolerance({.dtype = dtype, .steps = 10, .longest_sum = 32, .lr = 0.01}));
  }
}

TEST_CASE("Checkpoint.ATensorParallelCheckpointResumesUnderAnotherTp" * doctest::timeout(240)) {
  // Written under tp 2 (the MLP's fc0 split by columns, fc1 by rows: "fc0.w.tp0", ...) and resumed
  // under tp 1, tp 4 and tp 2 x dp 2: each split weight and its Adam moments are joined along
  // their axis and cut again (checkpoint::reshard), so the curve goes on, within the tolerance
  // of sums in another order (10 steps, sums over the batch of 32); under tp 2 itself, bit for bit.
  TempDir a("tp");
  const Setup tp2{.tp = 2, .opt = optim::adam(0.01), .dropout = 0};
  const Run all = train(tp2);
  Setup first = tp2;
  first.steps = 10;
  first.dir = a.path;
  train(first);
  const auto tolerance = test::tolerance({.dtype = DType::f32, .steps = 10, .longest_sum = 32, .lr = 0.01});
  for (const Setup& other : {Setup{.tp = 1}, Setup{.tp = 4}, Setup{.dp = 2, .tp = 2}}) {
    CAPTURE(other.tp);
    CAPTURE(other.dp);
    Setup s = other;
    s.opt = optim::adam(0.01);
    s.dropout = 0;
    s.resume = a.path;
    const Run resumed = train(s);
    REQUIRE(resumed.losses.size() == 10);
    if (other.tp == 2 && other.dp == 1) check_continues(all, resumed);
    test::TrainedRun want, got;
    want.losses.assign(all.losses.begin() + 10, all.losses.end());
    got.losses = resumed.losses;
    test::check_same_training(want, got, tolerance);
  }
}

TEST_CASE("Checkpoint.ReshardingMovesEveryValueExactly" * doctest::timeout(120)) {
  // tp 2 -> tp 4 -> tp 1 gives the bytes tp 2 -> tp 1 gives, which are the tp 2 parts joined
  // (join_parts, the sharding's own inverse), weights and Adam moments alike.
  TempDir a("reshard");
  train({.tp = 2, .steps = 10, .opt = optim::adam(0.01), .dir = a.path, .dropout = 0});
  const fs::path step10 = checkpoint::step_dir(a.path, 10);
  auto store_of = [](std::int64_t tp, Graph& g) {
    models::mlp(g, 8, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = tp});
    return ParameterStore::initialize(g);
  };
  Graph g1(5), g2(5), g4(5);
  const auto one = store_of(1, g1), two = store_of(2, g2), four = store_of(4, g4);
  const checkpoint::Checkpoint saved = checkpoint::load(step10);
  checkpoint::Checkpoint direct = checkpoint::load(step10), twice = checkpoint::load(step10), same = checkpoint::load(step10);
  CHECK(checkpoint::reshard(same, *two).empty());  // its own layout: nothing to do
  const auto moved = checkpoint::reshard(direct, *one);
  CHECK(moved.size() == 3);  // fc0.w, fc0.b by columns, fc1.w by rows
  CHECK_FALSE(checkpoint::reshard(twice, *four).empty());
  CHECK(twice.weights.at("fc0.w.tp3").shape() == Shape{12, 4});
  checkpoint::reshard(twice, *one);
  auto bytes = [](const Tensor& t) { return std::string(static_cast<const char*>(t.raw()), t.nbytes()); };
  const auto joined = join_parts(g2, saved.weights);
  REQUIRE(direct.weights.size() == joined.size());
  for (const auto& [name, t] : joined) {
    CAPTURE(name);
    CHECK(bytes(direct.weights.at(name)) == bytes(t));
    CHECK(bytes(twice.weights.at(name)) == bytes(t));
    for (const char* slot : {"exp_avg", "exp_avg_sq"}) {
      CAPTURE(slot);
      CHECK(bytes(twice.slots.at(name).at(slot)) == bytes(direct.slots.at(name).at(slot)));
    }
  }
  std::map<std::string, Tensor> moments;
  for (const auto& [name, s] : saved.slots) moments[name] = s.at("exp_avg");
  for (const auto& [name, t] : join_parts(g2, moments)) CHECK(bytes(direct.slots.at(name).at("exp_avg")) == bytes(t));
}

TEST_CASE("Checkpoint.ZeroSavesEachReplicasWindowAndResumesUnderAnyLayout" * doctest::timeout(240)) {
  // ZeRO dp 2 on two ranks: each replica's optimizer holds a window of the bucket, so each rank
  // writes its window, and the weight that straddles the windows' edge is saved in two pieces,
  // one in each rank's file. load() puts them together: the same job resumed, and plain dp on
  // one rank, continue the curve bit for bit (ZeRO's sums and updates are plain dp's); one device
  // (one micro-batch sum of 4 instead of dp's 2 x 2) within float tolerance.
  const std::vector<Placement> places{{.rank = 0}, {.rank = 1}};
  for (int zero : {1, 2, 3}) {
    CAPTURE(zero);
    TempDir a("zero-straight"), b("zero-resumed");
    const Setup base{.dp = 2, .opt = optim::adam(0.01), .places = places, .dropout = 0, .zero = zero};
    Setup straight = base;
    straight.dir = a.path;
    const Run all = train(straight);
    REQUIRE(all.losses.size() == 20);
    const fs::path step10 = checkpoint::step_dir(a.path, 10);
    // The index lists a weight in pieces in both ranks' files.
    const boost::json::object files = boost::json::parse(read_bytes(step10 / "index.json")).at("files").as_object();
    std::map<std::string, std::set<std::string>> files_of_piece;
    for (const auto& [file, entry] : files) {
      if (const auto* pieces = entry.as_object().if_contains("pieces")) {
        for (const auto& p : pieces->as_array()) {
          files_of_piece[std::string(p.at("variable").as_string())].insert(std::string(file));
        }
      }
    }
    REQUIRE(files_of_piece.size() == 1);
    CHECK(files_of_piece.begin()->second == std::set<std::string>{"rank0.safetensors", "rank1.safetensors"});
    // Assembled, each weight has its shape, and the optimizer state of every weight is there.
    const checkpoint::Checkpoint c = checkpoint::load(step10);
    CHECK(c.weights.size() == all.weights.size());
    for (const auto& [name, w] : c.weights) {
      CAPTURE(name);
      CHECK(c.slots.at(name).size() == 2);
      CHECK(c.slots.at(name).at("exp_avg").shape() == w.shape());
    }
    // The first 10 steps in a job of their own, then the rest resumed as the same job.
    Setup first = base;
    first.steps = 10;
    first.dir = b.path;
    train(first);
    Setup same = base;
    same.resume = b.path;
    check_continues(all, train(same));
    // Plain data parallelism, in one process.
    check_continues(all, train({.dp = 2, .opt = optim::adam(0.01), .resume = b.path, .dropout = 0}));
    // One device.
    const Run one = train({.microbatches = 4, .opt = optim::adam(0.01), .resume = b.path, .dropout = 0});
    REQUIRE(one.losses.size() == 10);
    // As Checkpoint.ResumeWithAnotherLayoutContinuesTheCurve: the gradients of 10 steps summed in
    // another order, sums over the batch of 32 (test::Reordering's tolerance).
    test::check_same_training(as_trained(all, {all.losses.begin() + 10, all.losses.end()}, DType::f32),
                              as_trained(one, one.losses, DType::f32),
                              test::tolerance({.dtype = DType::f32, .steps = 10, .longest_sum = 32, .lr = 0.01}));
  }
}

TEST_CASE("Checkpoint.PiecesThatDoNotCoverTheirWeightAreRefused" * doctest::timeout(120)) {
  // A ZeRO checkpoint whose index loses a piece, or lists one twice: load() names the weight.
  TempDir a("zero-pieces");
  train({.dp = 2, .steps = 10, .opt = optim::adam(0.01), .dir = a.path, .every = 10, .dropout = 0, .zero = 2});
  const fs::path step10 = checkpoint::step_dir(a.path, 10);
  const std::string index = read_bytes(step10 / "index.json");
  boost::json::value v = boost::json::parse(index);
  boost::json::object* with_pieces = nullptr;
  for (auto& [file, entry] : v.at("files").as_object()) {
    if (entry.as_object().contains("pieces")) with_pieces = &entry.as_object();
  }
  REQUIRE(with_pieces != nullptr);
  boost::json::array& pieces = with_pieces->at("pieces").as_array();
  REQUIRE(pieces.size() >= 2);
  const std::string name(pieces[0].at("variable").as_string());
  const boost::json::value first = pieces[0];
  // Dropped: its elements are left out (and its tensors are not listed any more).
  pieces.erase(pieces.begin());
  write_bytes(step10 / "index.json", boost::json::serialize(v));
  std::string e = error_of([&] { checkpoint::load(step10); });
  CHECK_MESSAGE(test::contains(e, "is not listed in the index"), e);
  // Listed twice: the same piece is read into place twice, so its elements overlap.
  pieces.insert(pieces.begin(), first);
  pieces.insert(pieces.begin(), first);
  write_bytes(step10 / "index.json", boost::json::serialize(v));
  e = error_of([&] { checkpoint::load(step10); });
  CHECK_MESSAGE(test::contains(e, "tensor '" + name), e);
  // A piece outside its weight.
  pieces.erase(pieces.begin());
  pieces[0].as_object()["end"] = 1'000'000;
  write_bytes(step10 / "index.json", boost::json::serialize(v));
  e = error_of([&] { checkpoint::load(step10); });
  CHECK_MESSAGE(test::contains(e, "lies outside its"), e);
  // As written, it loads.
  write_bytes(step10 / "index.json", index);
  CHECK_NOTHROW(checkpoint::load(step10));
}

TEST_CASE("Checkpoint.KeepsTheNewestAndIgnoresWhatACrashLeft" * doctest::timeout(120)) {
  TempDir a("keep");
  train({.steps = 20, .opt = optim::sgd(0.1, 0.9), .dir = a.path, .every = 4, .keep = 2});
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(a.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step-00000016", "step-00000020"});
  // A crash while writing step 24 left its temporary directory, and one of several ranks
  // left step 28 without all its files: both are passed over.
  fs::create_directories(a.path / "step-00000024.tmp-99999");
  write_bytes(a.path / "step-00000024.tmp-99999" / "rank0.safetensors", "torn");
  fs::create_directories(a.path / "step-00000028");
  fs::copy_file(checkpoint::step_dir(a.path, 20) / "index.json", a.path / "step-00000028" / "index.json");
  const checkpoint::Found found = checkpoint::find(a.path);
  CHECK(found.dir == checkpoint::step_dir(a.path, 20));
  REQUIRE(found.skipped.size() == 1);
  CHECK(test::contains(found.skipped[0], "step-00000028"));
  CHECK(checkpoint::load(found.dir).step == 20);
  // A file where the directory should be: refused before training, naming it.
  write_bytes(a.path / "file", "x");
  const std::string e = error_of([&] { train({.steps = 2, .dir = a.path / "file"}); });
  CHECK_MESSAGE(test::contains(e, (a.path / "file").string() + ": cannot make the checkpoint directory"), e);
  // Nothing complete at all: one line naming the directory.
  TempDir empty("empty");
  CHECK(test::contains(error_of([&] { checkpoint::find(empty.path); }), empty.path.string() + ": holds no checkpoint"));
}

TEST_CASE("Checkpoint.AssetsTravelWithEachStepAndVersion1StillLoads" * doctest::timeout(120)) {
  // Format 2: a step directory carries files beside the weights (a tokenizer, for baton-serve),
  // listed in the index with their size and CRC-32; a damaged one is refused naming it. An index
  // of version 1 (no assets) still loads; a version this baton does not know is refused.
  TempDir a("assets");
  const std::string model(3000, 'x');
  train({.steps = 8, .dir = a.path, .every = 4, .assets = {{"tokenizer.model", model + "end"}}});
  const fs::path dir = checkpoint::step_dir(a.path, 8);
  const checkpoint::Checkpoint c = checkpoint::load(dir);
  REQUIRE(c.assets.count("tokenizer.model") == 1);
  CHECK(read_bytes(c.assets.at("tokenizer.model")) == model + "end");
  CHECK(checkpoint::load(checkpoint::step_dir(a.path, 4)).assets.size() == 1);  // every step has them
  const std::string good = read_bytes(dir / "tokenizer.model");
  write_bytes(dir / "tokenizer.model", model + "END");
  const std::string e = error_of([&] { checkpoint::load(dir); });
  CHECK_MESSAGE((test::contains(e, (dir / "tokenizer.model").string()) && test::contains(e, "damaged")), e);
  write_bytes(dir / "tokenizer.model", good);
  std::string index = read_bytes(dir / "index.json");
  const auto at = index.find("\"version\":2");
  REQUIRE(at != std::string::npos);
  write_bytes(dir / "index.json", index.replace(at, 11, "\"version\":1"));
  CHECK_NOTHROW(checkpoint::load(dir));
  write_bytes(dir / "index.json", index.replace(at, 11, "\"version\":3"));
  CHECK(test::contains(error_of([&] { checkpoint::load(dir); }), "version 3 (this baton reads versions 1 to 2)"));
}

TEST_CASE("Checkpoint.CorruptOrMismatchedCheckpointsFailNamingTheFile" * doctest::timeout(180)) {
  TempDir a("corrupt");
  const fs::path dir = make_checkpoint(a.path);
  const fs::path file = dir / "rank0.safetensors", index = dir / "index.json";
  const std::string good = read_bytes(file), good_index = read_bytes(index);
  auto load_error = [&] { return error_of([&] { checkpoint::load(dir); }); };
  SUBCASE("a flipped byte in the data fails the CRC") {
    std::string bad = good;
    bad[bad.size() - 3] ^= 0x10;
    write_bytes(file, bad);
    const std::string e = load_error();
    CHECK_MESSAGE(test::contains(e, file.string() + ": CRC-32 of the data is"), e);
  }
  SUBCASE("a truncated file") {
    write_bytes(file, good.substr(0, good.size() / 2));
    const std::string e = load_error();
    CHECK_MESSAGE((test::contains(e, file.string() + ": tensor ") && test::contains(e, "are outside the")), e);
  }
  SUBCASE("a header length past the end") {
    std::string bad = good;
    bad[5] = 0x7f;
    CHECK(test::contains((write_bytes(file, bad), load_error()), file.string() + ": the header length"));
  }
  SUBCASE("a missing tensor") {
    std::string ix = good_index;
    const auto at = ix.find("\"fc0.w\"");
    REQUIRE(at != std::string::npos);
    ix.replace(at, 7, "\"fc9.w\"");
    write_bytes(index, ix);
    const std::string e = load_error();
    CHECK_MESSAGE(test::contains(e, file.string() + ": tensor 'fc9.w' is missing"), e);
  }
  SUBCASE("a torn index") {
    write_bytes(index, good_index.substr(0, good_index.size() / 2));
    CHECK(test::contains(load_error(), index.string() + ": not valid JSON"));
  }
  SUBCASE("an index of another step") {
    std::string ix = good_index;
    const auto at = ix.find("\"step\":10");
    REQUIRE(at != std::string::npos);
    ix.replace(at, 9, "\"step\":12");
    write_bytes(index, ix);
    CHECK(test::contains(load_error(), index.string() + ": says step 12 but lies in step-00000010"));
  }
  SUBCASE("a file of another checkpoint") {
    TempDir b("other");
    train({.steps = 5, .opt = optim::adam(0.01), .dir = b.path, .every = 5});
    fs::copy_file(checkpoint::step_dir(b.path, 5) / "rank0.safetensors", file, fs::copy_options::overwrite_existing);
    CHECK(test::contains(load_error(), file.string() + ": holds step 5 but the index says step 10"));
  }
  SUBCASE("another model: a shape that does not match") {
    const checkpoint::Checkpoint c = checkpoint::load(dir);
    Graph g(5);
    models::mlp(g, 8, {.inputs = 12, .hidden = 32, .layers = 2, .classes = 4});
    auto params = ParameterStore::initialize(g);
    const std::string e = error_of([&] { checkpoint::restore(c, *params, optim::adam(0.01)); });
    CHECK_MESSAGE(test::contains(e, index.string() + ": weight 'fc0.b' is f32[16] in the checkpoint but f32[32]"), e);
  }
  SUBCASE("another optimizer") {
    const checkpoint::Checkpoint c = checkpoint::load(dir);
    Graph g(5);
    models::mlp(g, 8, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4});
    auto params = ParameterStore::initialize(g);
    const std::string e = error_of([&] { checkpoint::restore(c, *params, optim::sgd(0.1, 0.9)); });
    CHECK_MESSAGE(test::contains(e, index.string() + ": written with optimizer adam, but this run uses sgd"), e);
  }
  SUBCASE("a weight of the model that the checkpoint's parts cannot make") {
    checkpoint::Checkpoint c = checkpoint::load(dir);
    Graph g(5);
    models::mlp(g, 8, {.inputs = 12, .hidden = 16, .layers = 2, .classes = 4, .tp = 2});
    auto params = ParameterStore::initialize(g);
    // fc0.w is f32[12, 16] whole; as if it had been saved as f32[12, 6]: no cut of 2 parts.
    c.weights["fc0.w"] = Tensor::empty({12, 6}, DType::f32);
    const std::string e = error_of([&] { checkpoint::reshard(c, *params); });
    CHECK_MESSAGE(test::contains(e, index.string() + ": weight 'fc0.w' is 1 part of f32[12, 6] in the checkpoint, "
                                                     "which 2 parts of f32[12, 8] cannot make"),
                  e);
  }
  SUBCASE("a model with a weight the checkpoint lacks") {
    checkpoint::Checkpoint c = checkpoint::load(dir);
    c.weights.erase("fc1.w");
    std::map<std::string, Placement> trained{{"fc1.w", {}}};
    CHECK(test::contains(error_of([&] { checkpoint::check_covers(c, trained); }), "has no weight 'fc1.w'"));
  }
}

TEST_CASE("Checkpoint.PythonReadsTheFileWithoutBaton" * doctest::timeout(60)) {
  // An independent reader (json + struct, and torch.frombuffer where PyTorch is installed)
  // sums each tensor of a checkpoint file; the sums must be ours.
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) {
    return test::skip(test::Missing::python3, "python3 not found: the independent reader cannot run");
  }
  TempDir a("python");
  const fs::path file = make_checkpoint(a.path) / "rank0.safetensors";
  const fs::path out = a.path / "sums.txt";
  const std::string cmd = fmt::format("python3 {}/tests/read_safetensors.py {} > {}", BATON_SOURCE_DIR, file.string(), out.string());
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::map<std::string, std::string> theirs;
  std::ifstream in(out);
  for (std::string name, dtype, shape, sum; in >> name >> dtype >> shape >> sum;) theirs[name] = dtype + " " + shape + " " + sum;
  const safetensors::Contents ours = safetensors::read(file);
  REQUIRE(theirs.size() == ours.tensors.size());
  for (const auto& [name, t] : ours.tensors) {
    double sum = 0;
    for (float x : t.data<float>()) sum += static_cast<double>(x);
    std::vector<std::string> dims;
    for (auto d : t.shape()) dims.push_back(std::to_string(d));
    CHECK(theirs[name] == fmt::format("F32 [{}] {:.9g}", fmt::join(dims, ","), sum));
  }
  CHECK(theirs.count("fc0.w#exp_avg_sq") == 1);
}

TEST_CASE("Checkpoint.AWriteThatFailsFailsTheJobNamingThePath" * doctest::timeout(60)) {
  // The writing thread's error comes back from finish(), and from the next snapshot a variable
  // actor hands over (which fails the job on that actor).
  TempDir a("unwritable");
  const fs::path dir = a.path / "ckpt";
  auto writer = std::make_shared<checkpoint::Writer>(
      checkpoint::Settings{.dir = dir, .optimizer = optim::sgd(0.1), .config = {{"run", "t"}}});
  writer->expect({SnapshotPart{.name = "w", .shape = {3}}});
  // A variable this rank does not train is a bug in the caller: refused by name.
  CHECK(test::contains(error_of([&] { writer->take(VariableSnapshot{.name = "v", .step = 1}); }), "variable 'v'"));
  fs::remove_all(dir);
  write_bytes(dir, "a file now");
  auto snapshot = [](std::int64_t step) {
    return VariableSnapshot{.name = "w", .step = step, .weight = Tensor::zeros({3}, f32)};
  };
  writer->take(snapshot(1));
  const std::string e = error_of([&] { writer->finish(); });
  CHECK_MESSAGE(test::contains(e, dir.string() + "/step-00000001.tmp-"), e);
  CHECK(test::contains(error_of([&] { writer->take(snapshot(2)); }), dir.string()));
  CHECK(writer->written().empty());
}
