// kernels/data.h: the digits loader (good and malformed files, plain and gzip), the real digits
// file when it is there, split(), synthetic(), text corpora, and the two source kernels' order.
#include "test_util.h"
#include "baton/kernels/data.h"

#include <doctest/doctest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace {

using baton::test::contains;

namespace fs = std::filesystem;
namespace data = baton::data;
using baton::Attrs;
using baton::Device;
using baton::DeviceType;
using baton::DType;
using baton::KernelConfig;
using baton::KernelContext;
using baton::Tensor;

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            fmt::format("baton-test-data-{}-{}", ::getpid(), counter.fetch_add(1));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::string write_file(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
  REQUIRE(out.good());
  return path;
}

std::string write_gzip(const std::string& path, const std::string& contents) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, contents.data(), static_cast<unsigned>(contents.size())) ==
          static_cast<int>(contents.size()));
  REQUIRE(gzclose(f) == Z_OK);
  return path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// One digits row: pixel i = (i * step + shift) % 17, then the label.
std::string digits_row(int shift, int label, int step = 1) {
  std::string line;
  for (int i = 0; i < 64; ++i) line += fmt::format("{},", (i * step + shift) % 17);
  return line + fmt::format("{}\n", label);
}

std::string good_digits(int rows) {
  std::string text;
  for (int r = 0; r < rows; ++r) text += digits_row(r, r % 10, 1 + r % 5);
  return text;
}

template <class F>
std::string runtime_error_of(F&& fn) {
  try {
    fn();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  FAIL("expected a std::runtime_error");
  return {};
}

// Loading `contents` (plain) throws naming the file and, when line > 0, "file:line".
void expect_malformed(const std::string& contents, int line, const std::string& also) {
  TempDir dir;
  const auto path = write_file(dir.file("bad.csv"), contents);
  const auto msg = runtime_error_of([&] { data::load_digits(path); });
  INFO(msg);
  CHECK(contains(msg, path));
  if (line > 0) CHECK(contains(msg, fmt::format("{}:{}:", path, line)));
  CHECK(contains(msg, also));
}

// A data set whose row i has every feature = i and label i % classes: rows name themselves.
std::shared_ptr<const data::Dataset> numbered(std::int64_t rows, std::int64_t width,
                                              std::int64_t classes) {
  auto d = std::make_shared<data::Dataset>();
  d->name = "numbered";
  d->num_classes = classes;
  d->features = Tensor::empty({rows, width}, DType::f32);
  d->labels = Tensor::empty({rows}, DType::i32);
  auto x = d->features.data<float>();
  auto y = d->labels.data<std::int32_t>();
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t f = 0; f < width; ++f) x[static_cast<std::size_t>(r * width + f)] = float(r);
    y[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(r % classes);
  }
  return d;
}

// Runs a two-output source kernel for pieces [0, pieces) and returns the outputs, piece after
// piece, concatenated.
struct Stream {
  std::vector<float> first_f32;
  std::vector<std::int32_t> first_i32;
  std::vector<std::int32_t> second;
};

Stream run_source(const baton::KernelFactory& factory, std::int64_t pieces, baton::Shape first,
                  DType first_dtype, baton::Shape second) {
  Attrs none;
  KernelConfig cfg{"src", Device{}, first_dtype, none};
  auto kernel = factory(cfg);
  Tensor a = Tensor::empty(first, first_dtype);
  Tensor b = Tensor::empty(second, DType::i32);
  Tensor* outs[] = {&a, &b};
  Stream s;
  for (std::int64_t p = 0; p < pieces; ++p) {
    KernelContext ctx{{}, outs, p};
    kernel->compute(ctx);
    if (first_dtype == DType::f32) {
      auto v = a.data<float>();
      s.first_f32.insert(s.first_f32.end(), v.begin(), v.end());
    } else {
      auto v = a.data<std::int32_t>();
      s.first_i32.insert(s.first_i32.end(), v.begin(), v.end());
    }
    auto w = b.data<std::int32_t>();
    s.second.insert(s.second.end(), w.begin(), w.end());
  }
  return s;
}

Stream run_batches(std::shared_ptr<const data::Dataset> d, std::int64_t batch, std::int64_t m,
                   std::uint64_t seed, std::int64_t steps) {
  const std::int64_t per = batch / m;
  const std::int64_t width = d->width();
  return run_source(data::batch_source(std::move(d), batch, m, seed), steps * m, {per, width},
                    DType::f32, {per});
}

}  // namespace

TEST_CASE("Data.Digits.LoadsPlainAndGzipWithRightShapesAndValues") {
  TempDir dir;
  // CRLF line ends, spaces around values, decimals and a trailing blank line are all fine.
  std::string text = good_digits(3);
  text.insert(text.find('\n'), "\r");
  text += "\n  \n";
  text.replace(0, 2, " 0.0 ,");
  const auto plain = write_file(dir.file("d.csv"), text);
  const auto gz = write_gzip(dir.file("d.csv.gz"), text);
  for (const auto& path : {plain, gz}) {
    CAPTURE(path);
    const auto d = data::load_digits(path);
    CHECK(d.name == "digits");
    CHECK(d.rows() == 3);
    CHECK(d.width() == 64);
    CHECK(d.num_classes == 10);
    CHECK(d.features.shape() == baton::Shape{3, 64});
    CHECK(d.features.dtype() == DType::f32);
    CHECK(d.labels.shape() == baton::Shape{3});
    CHECK(d.labels.dtype() == DType::i32);
    auto x = d.features.data<float>();
    auto y = d.labels.data<std::int32_t>();
    CHECK(y[0] == 0);
    CHECK(y[1] == 1);
    CHECK(y[2] == 2);
    for (int r = 0; r < 3; ++r) {
      for (int i = 0; i < 64; ++i) {
        const int pixel = (i * (1 + r % 5) + r) % 17;
        CHECK(x[static_cast<std::size_t>(r * 64 + i)] == float(pixel) / 16.0f);
      }
    }
    CHECK(*std::max_element(x.begin(), x.end()) == 1.0f);
  }
}

TEST_CASE("Data.Digits.MissingFileNamesIt") {
  TempDir dir;
  const auto path = dir.file("nope.csv.gz");
  const auto msg = runtime_error_of([&] { data::load_digits(path); });
  CHECK(contains(msg, path));
  CHECK(contains(msg, "no such file"));
}

TEST_CASE("Data.Digits.EmptyFileNamesIt") {
  TempDir dir;
  for (const auto& path : {write_file(dir.file("empty.csv"), ""),
                           write_file(dir.file("blank.csv"), "\n \n"),
                           write_gzip(dir.file("empty.csv.gz"), "")}) {
    const auto msg = runtime_error_of([&] { data::load_digits(path); });
    CHECK(contains(msg, path));
    CHECK(contains(msg, "empty"));
  }
}

TEST_CASE("Data.Digits.WrongColumnCountNamesFileAndLine") {
  std::string short_row = digits_row(0, 1);
  short_row.erase(0, short_row.find(',') + 1);  // 63 pixels + label
  expect_malformed(good_digits(2) + short_row, 3, "64 comma-separated values, expected 65");
  std::string long_row = "5," + digits_row(0, 1);
  expect_malformed(good_digits(4) + long_row + good_digits(1), 5, "66 comma-separated values");
  expect_malformed(digits_row(0, 1) + "1,2,3\n", 2, "3 comma-separated values");
}

TEST_CASE("Data.Digits.NonNumberNamesFileAndLine") {
  std::string row = digits_row(0, 1);
  row.replace(0, 1, "x");
  expect_malformed(good_digits(1) + row, 2, "column 1 is 'x', not a number");
  std::string empty_field = digits_row(0, 1);
  empty_field.replace(0, 1, "");
  expect_malformed(empty_field, 1, "not a number");
  expect_malformed(good_digits(6) + digits_row(0, 1).replace(2, 1, "1e"), 7, "not a number");
}

TEST_CASE("Data.Digits.PixelOutOfRangeNamesFileAndLine") {
  expect_malformed(good_digits(2) + "17," + digits_row(0, 1).substr(2), 3, "outside 0..16");
  expect_malformed("-1," + digits_row(0, 1).substr(2), 1, "pixel 1 is -1");
}

TEST_CASE("Data.Digits.LabelOutOfRangeNamesFileAndLine") {
  auto row = [](const std::string& label) {
    std::string r = digits_row(0, 0);
    return r.substr(0, r.rfind(',') + 1) + label + "\n";
  };
  expect_malformed(good_digits(3) + row("10"), 4, "label is 10");
  expect_malformed(row("-1"), 1, "label is -1");
  expect_malformed(good_digits(1) + row("2.5"), 2, "label is 2.5");
}

TEST_CASE("Data.Digits.TruncatedGzipNamesFile") {
  TempDir dir;
  const auto whole = write_gzip(dir.file("whole.csv.gz"), good_digits(300));
  CHECK(data::load_digits(whole).rows() == 300);
  const std::string bytes = read_bytes(whole);
  // Cut in the middle of the compressed data, and in the trailer (the CRC and length).
  for (std::size_t keep : {bytes.size() / 2, bytes.size() - 4}) {
    CAPTURE(keep);
    const auto cut = write_file(dir.file(fmt::format("cut{}.csv.gz", keep)), bytes.substr(0, keep));
    const auto msg = runtime_error_of([&] { data::load_digits(cut); });
    INFO(msg);
    CHECK(contains(msg, cut));
    CHECK(contains(msg, "truncated or corrupt gzip"));
  }
}

TEST_CASE("Data.Digits.RealFileHas1797RowsOf64PixelsAndEveryClass") {
  std::string path;
  try {
    path = data::find_digits_file();
  } catch (const std::runtime_error& e) {
    return baton::test::skip(baton::test::Missing::data_file,
                             std::string("the real digits file is not here (scripts/run.sh fetches it): ") + e.what());
  }
  const auto d = data::load_digits(path);
  CHECK(d.rows() == 1797);
  CHECK(d.width() == 64);
  CHECK(d.num_classes == 10);
  std::vector<int> per_class(10, 0);
  for (auto y : d.labels.data<std::int32_t>()) {
    REQUIRE(y >= 0);
    REQUIRE(y < 10);
    ++per_class[static_cast<std::size_t>(y)];
  }
  for (int c = 0; c < 10; ++c) {
    CAPTURE(c);
    CHECK(per_class[static_cast<std::size_t>(c)] > 150);  // 174..183 each
  }
  auto x = d.features.data<float>();
  CHECK(*std::min_element(x.begin(), x.end()) == 0.0f);
  CHECK(*std::max_element(x.begin(), x.end()) == 1.0f);
}

TEST_CASE("Data.Digits.FindHonoursDataDirAndSaysHowToGetTheFile") {
  TempDir dir;
  const char* old = std::getenv("BATON_DATA_DIR");
  const std::string saved = old ? old : "";
  const std::string folder = fs::path(dir.file("x")).parent_path().string();
  ::setenv("BATON_DATA_DIR", folder.c_str(), 1);
  const auto msg = runtime_error_of([] { data::find_digits_file(); });
  CHECK(contains(msg, "scripts/run.sh"));
  write_gzip(dir.file("digits.csv.gz"), good_digits(2));
  CHECK(data::find_digits_file() == dir.file("digits.csv.gz"));
  if (old) {
    ::setenv("BATON_DATA_DIR", saved.c_str(), 1);
  } else {
    ::unsetenv("BATON_DATA_DIR");
  }
}

TEST_CASE("Data.Shuffle.IsAPermutationFixedBySeed") {
  const auto a = data::shuffled_indices(1000, 42);
  CHECK(a == data::shuffled_indices(1000, 42));
  CHECK(a != data::shuffled_indices(1000, 43));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (std::int64_t i = 0; i < 1000; ++i) CHECK(sorted[static_cast<std::size_t>(i)] == i);
  // Pinned: the same on every machine (mt19937_64 and our own draws; no std distributions).
  // Cross-checked against an independent Python mt19937_64 with the same Fisher-Yates.
  CHECK(data::shuffled_indices(8, 1) == std::vector<std::int64_t>{4, 6, 3, 5, 1, 7, 2, 0});
  CHECK(data::shuffled_indices(0, 1).empty());
  CHECK(data::shuffled_indices(1, 1) == std::vector<std::int64_t>{0});
}

TEST_CASE("Data.Split.DisjointDeterministicAndSized") {
  const auto all = numbered(101, 3, 7);
  const auto [train, heldout] = data::split(*all, 0.2, 5);
  CHECK(train.rows() == 81);
  CHECK(heldout.rows() == 20);
  CHECK(train.width() == 3);
  CHECK(heldout.num_classes == 7);
  CHECK(train.name == "numbered/train");
  CHECK(heldout.name == "numbered/heldout");
  std::set<int> seen;
  for (const auto* part : {&train, &heldout}) {
    auto x = part->features.data<float>();
    auto y = part->labels.data<std::int32_t>();
    for (std::int64_t r = 0; r < part->rows(); ++r) {
      const int id = static_cast<int>(x[static_cast<std::size_t>(r * 3)]);
      CHECK(seen.insert(id).second);
      CHECK(x[static_cast<std::size_t>(r * 3 + 2)] == float(id));
      CHECK(y[static_cast<std::size_t>(r)] == id % 7);
    }
  }
  CHECK(seen.size() == 101);

  const auto [train2, heldout2] = data::split(*all, 0.2, 5);
  auto same = [](const data::Dataset& a, const data::Dataset& b) {
    return std::ranges::equal(a.features.data<float>(), b.features.data<float>()) &&
           std::ranges::equal(a.labels.data<std::int32_t>(), b.labels.data<std::int32_t>());
  };
  CHECK(same(train, train2));
  CHECK(same(heldout, heldout2));
  CHECK_FALSE(same(heldout, data::split(*all, 0.2, 6).second));

  CHECK(data::split(*all, 0.0, 1).second.rows() == 0);
  CHECK(data::split(*all, 1.0, 1).first.rows() == 0);
  CHECK(data::split(*all, 0.5, 1).second.rows() == 51);  // round(50.5) = 51
  CHECK_THROWS_AS(data::split(*all, 1.5, 1), std::invalid_argument);
  CHECK_THROWS_AS(data::split(*all, -0.1, 1), std::invalid_argument);
}

TEST_CASE("Data.Synthetic.ShapesDeterminismAndEveryClass") {
  const auto a = data::synthetic(500, 12, 4, 9);
  CHECK(a.features.shape() == baton::Shape{500, 12});
  CHECK(a.labels.shape() == baton::Shape{500});
  CHECK(a.num_classes == 4);
  const auto b = data::synthetic(500, 12, 4, 9);
  CHECK(std::ranges::equal(a.features.data<float>(), b.features.data<float>()));
  CHECK(std::ranges::equal(a.labels.data<std::int32_t>(), b.labels.data<std::int32_t>()));
  const auto c = data::synthetic(500, 12, 4, 10);
  CHECK_FALSE(std::ranges::equal(a.features.data<float>(), c.features.data<float>()));
  std::vector<int> per_class(4, 0);
  for (auto y : a.labels.data<std::int32_t>()) {
    REQUIRE(y >= 0);
    REQUIRE(y < 4);
    ++per_class[static_cast<std::size_t>(y)];
  }
  for (int n : per_class) CHECK(n > 0);
  // Roughly standard normal features.
  double sum = 0, sum_sq = 0;
  for (float v : a.features.data<float>()) {
    sum += v;
    sum_sq += double(v) * v;
  }
  const double n = 500.0 * 12.0;
  CHECK(std::abs(sum / n) < 0.1);
  CHECK(std::abs(sum_sq / n - 1.0) < 0.1);
  CHECK_THROWS_AS(data::synthetic(10, 3, 1, 1), std::invalid_argument);
  CHECK_THROWS_AS(data::synthetic(0, 3, 2, 1), std::invalid_argument);
}

TEST_CASE("Data.BatchSource.GlobalBatchIsTheSameWhateverTheMicroBatches") {
  const auto d = numbered(37, 3, 5);  // 37 rows, batch 12: steps straddle epochs
  const auto one = run_batches(d, 12, 1, 3, 10);
  for (std::int64_t m : {2, 4}) {
    CAPTURE(m);
    const auto many = run_batches(d, 12, m, 3, 10);
    CHECK(many.first_f32.size() == one.first_f32.size());
    CHECK(std::memcmp(many.first_f32.data(), one.first_f32.data(),
                      one.first_f32.size() * sizeof(float)) == 0);
    CHECK(many.second == one.second);
  }
}

TEST_CASE("Data.BatchSource.EveryRowOncePerEpoch") {
  const std::int64_t rows = 37;
  const auto d = numbered(rows, 3, 5);
  const auto s = run_batches(d, 12, 4, 3, 10);  // 120 positions: 3 whole epochs and a bit
  for (std::int64_t e = 0; e < 3; ++e) {
    CAPTURE(e);
    std::vector<std::int64_t> epoch;
    for (std::int64_t p = e * rows; p < (e + 1) * rows; ++p) {
      const auto id = static_cast<std::int64_t>(s.first_f32[static_cast<std::size_t>(p * 3)]);
      CHECK(s.second[static_cast<std::size_t>(p)] == id % 5);  // the label travels with its row
      epoch.push_back(id);
    }
    // The documented order: epoch e is shuffled_indices(N, seed + e).
    CHECK(epoch == data::shuffled_indices(rows, 3 + static_cast<std::uint64_t>(e)));
  }
}

TEST_CASE("Data.BatchSource.DifferentSeedsDiffer") {
  const auto d = numbered(50, 3, 5);
  const auto a = run_batches(d, 10, 2, 1, 5);
  CHECK(a.first_f32 == run_batches(d, 10, 2, 1, 5).first_f32);
  CHECK(a.first_f32 != run_batches(d, 10, 2, 2, 5).first_f32);
}

TEST_CASE("Data.BatchSource.RejectsBadBatchingAndBadOutputs") {
  const auto d = numbered(20, 3, 5);
  CHECK_THROWS_AS(data::batch_source(d, 10, 3, 1), std::invalid_argument);
  CHECK_THROWS_AS(data::batch_source(d, 0, 1, 1), std::invalid_argument);
  CHECK_THROWS_AS(data::batch_source(nullptr, 4, 1, 1), std::invalid_argument);

  Attrs none;
  auto factory = data::batch_source(d, 8, 2, 1);
  KernelConfig gpu{"src", Device{DeviceType::cuda, 0}, DType::f32, none};
  CHECK_THROWS_AS(factory(gpu), std::invalid_argument);
  KernelConfig cpu{"src", Device{}, DType::f32, none};
  auto kernel = factory(cpu);
  Tensor x = Tensor::empty({8, 3}, DType::f32);  // the global batch, not the micro-batch
  Tensor y = Tensor::empty({4}, DType::i32);
  Tensor* outs[] = {&x, &y};
  KernelContext ctx{{}, outs, 0};
  try {
    kernel->compute(ctx);
    FAIL("expected a shape error");
  } catch (const std::invalid_argument& e) {
    CHECK(contains(e.what(), "actor 'src'"));
    CHECK(contains(e.what(), "[4, 3]"));
  }
}

TEST_CASE("Data.BatchSource.WritesF64Features") {
  const auto d = numbered(10, 3, 5);
  Attrs none;
  auto kernel = data::batch_source(d, 4, 1, 1)(KernelConfig{"src", Device{}, DType::f64, none});
  Tensor x = Tensor::empty({4, 3}, DType::f64);
  Tensor y = Tensor::empty({4}, DType::i32);
  Tensor* outs[] = {&x, &y};
  KernelContext ctx{{}, outs, 1};
  kernel->compute(ctx);
  const auto order = data::shuffled_indices(10, 1);
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(x.data<double>()[r * 3 + 1] == double(order[4 + r]));
  }
}

TEST_CASE("Data.Text.VocabIdsAndEntropy") {
  TempDir dir;
  const auto path = write_file(dir.file("t.txt"), "abca\nb");
  const auto c = data::load_text(path);
  CHECK(c.path == path);
  CHECK(c.vocab == std::vector<unsigned char>{'\n', 'a', 'b', 'c'});
  CHECK(c.vocab_size() == 4);
  CHECK(c.ids == std::vector<std::int32_t>{1, 2, 3, 1, 0, 2});
  // p = {1/6, 2/6, 2/6, 1/6}
  const double expected = -(2 * (1.0 / 6) * std::log(1.0 / 6) + 2 * (2.0 / 6) * std::log(2.0 / 6));
  // Four terms in double, another order: a few roundings; Approx's default (1.2e-5) is far
  // above them and far below a wrong count (a probability off by 1/6).
  CHECK(c.unigram_entropy_nats() == doctest::Approx(expected));
}

TEST_CASE("Data.Text.MissingEmptyOrOneByteFileNamesIt") {
  TempDir dir;
  for (const auto& path : {dir.file("missing.txt"), write_file(dir.file("empty.txt"), ""),
                           write_file(dir.file("one.txt"), "a")}) {
    const auto msg = runtime_error_of([&] { data::load_text(path); });
    CHECK(contains(msg, path));
  }
}

TEST_CASE("Data.TextSource.TargetsAreNextCharactersInRangeAndDeterministic") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 300; ++i) text += static_cast<char>('a' + (i * 7) % 26);
  const auto corpus = std::make_shared<const data::TextCorpus>(
      data::load_text(write_file(dir.file("c.txt"), text)));
  const std::int64_t batch = 8, seq = 16, steps = 6;
  auto run = [&](std::int64_t m, std::uint64_t seed) {
    return run_source(data::text_source(corpus, batch, m, seq, seed), steps * m,
                      {batch / m, seq}, DType::i32, {batch / m * seq});
  };
  const auto one = run(1, 11);
  const auto& ids = corpus->ids;
  for (std::int64_t w = 0; w < steps * batch; ++w) {
    const auto* tok = one.first_i32.data() + w * seq;
    const auto* tgt = one.second.data() + w * seq;
    // Find the window in the corpus: the text's period is 26, so match the whole window.
    std::int64_t found = -1;
    for (std::int64_t o = 0; o + seq < static_cast<std::int64_t>(ids.size()); ++o) {
      if (std::equal(tok, tok + seq, ids.begin() + o)) {
        found = o;
        break;
      }
    }
    REQUIRE(found >= 0);
    for (std::int64_t t = 0; t < seq; ++t) {
      CHECK(tgt[t] == ids[static_cast<std::size_t>(found + t + 1)]);
      if (t + 1 < seq) CHECK(tgt[t] == tok[t + 1]);
    }
  }
  CHECK(one.first_i32 == run(1, 11).first_i32);
  CHECK(one.first_i32 == run(2, 11).first_i32);
  CHECK(one.second == run(4, 11).second);
  CHECK(one.first_i32 != run(1, 12).first_i32);

  CHECK_THROWS_AS(data::text_source(corpus, 8, 3, seq, 1), std::invalid_argument);
  CHECK_THROWS_AS(data::text_source(corpus, 8, 1, 300, 1), std::invalid_argument);
  CHECK_NOTHROW(data::text_source(corpus, 8, 1, 299, 1));
}

TEST_CASE("Data.TextSource.WindowsCoverTheWholeCorpusEdgeToEdge") {
  TempDir dir;
  // Distinct bytes, so a window's first token gives its offset exactly.
  std::string text;
  for (int i = 0; i < 40; ++i) text += static_cast<char>(i + 32);
  const auto corpus = std::make_shared<const data::TextCorpus>(
      data::load_text(write_file(dir.file("c.txt"), text)));
  const std::int64_t seq = 10;  // offsets 0..29
  const auto s = run_source(data::text_source(corpus, 16, 2, seq, 3), 100, {8, seq}, DType::i32,
                            {8 * seq});
  std::set<std::int32_t> starts;
  for (std::size_t w = 0; w * seq < s.first_i32.size(); ++w) {
    const std::int32_t o = s.first_i32[w * seq];
    REQUIRE(o >= 0);
    REQUIRE(o <= 29);
    starts.insert(o);
    CHECK(s.second[w * seq + seq - 1] == o + seq);  // the last target is the corpus' o + seq
  }
  CHECK(starts.size() == 30);  // 800 draws reach every offset, both ends included
}
