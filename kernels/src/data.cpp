// Data sets (digits, synthetic, text) and the source kernels that stream them.
#include "baton/kernels/data.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

namespace baton::data {

namespace {

namespace fs = std::filesystem;

constexpr std::int64_t digits_pixels = 64;
constexpr double digits_max_pixel = 16.0;
constexpr std::int64_t digits_classes = 10;
constexpr const char* digits_file_name = "digits.csv.gz";

// ---------------------------------------------------------------------------------------------
// Deterministic randomness. std::mt19937_64's output sequence is fixed by the standard; the
// std distributions and std::shuffle are not, so the draws below are our own.

// Uniform in [0, n), n >= 1, without modulo bias: reject the lowest 2^64 mod n values so that
// what remains is a whole number of copies of [0, n).
std::uint64_t bounded(std::mt19937_64& rng, std::uint64_t n) {
  const std::uint64_t threshold = (std::uint64_t{0} - n) % n;
  for (;;) {
    const std::uint64_t x = rng();
    if (x >= threshold) return x % n;
  }
}

// Uniform in (0, 1): 53 random bits, centred in their cell so 0 never comes out (log(0)).
double open_unit(std::mt19937_64& rng) {
  return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53;
}

// Standard normals by the Box-Muller transform, two per pair of uniforms.
class Normal {
 public:
  double operator()(std::mt19937_64& rng) {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    constexpr double two_pi = 6.283185307179586476925286766559;
    const double r = std::sqrt(-2.0 * std::log(open_unit(rng)));
    const double theta = two_pi * open_unit(rng);
    spare_ = r * std::sin(theta);
    have_spare_ = true;
    return r * std::cos(theta);
  }

 private:
  double spare_ = 0.0;
  bool have_spare_ = false;
};

// SplitMix64's finaliser (Steele, Lea, Flood 2014): turns (seed, step) into a well-mixed seed.
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// ---------------------------------------------------------------------------------------------
// Files.

void require_regular_file(const std::string& path) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (ec || !fs::exists(status)) throw std::runtime_error(fmt::format("{}: no such file", path));
  if (!fs::is_regular_file(status)) {
    throw std::runtime_error(fmt::format("{}: not a regular file", path));
  }
}

// The whole file, gunzipped if it is gzip (zlib reads a plain file through unchanged).
std::string read_maybe_gzip(const std::string& path) {
  require_regular_file(path);
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw std::runtime_error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  }
  struct Closer {
    gzFile f;
    ~Closer() { gzclose(f); }
  } closer{file};

  std::string text;
  std::array<char, 1 << 16> chunk{};
  for (;;) {
    const int got = gzread(file, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (got > 0) {
      text.append(chunk.data(), static_cast<std::size_t>(got));
      continue;
    }
    // A stream cut short reads as a clean end with Z_BUF_ERROR left behind, so look at the
    // error state on every exit, not only when gzread returns -1.
    int err = Z_OK;
    const char* msg = gzerror(file, &err);
    if (got < 0 || err != Z_OK) {
      std::string why = err == Z_ERRNO ? std::strerror(errno) : msg;
      if (why.starts_with(path + ": ")) why.erase(0, path.size() + 2);  // zlib names the file too
      throw std::runtime_error(
          fmt::format("{}: truncated or corrupt gzip data ({}) after {} bytes", path, why,
                      text.size()));
    }
    break;
  }
  return text;
}

std::string_view trim(std::string_view s) {
  constexpr std::string_view blanks = " \t\r";
  const auto first = s.find_first_not_of(blanks);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(blanks) - first + 1);
}

// A finite number filling the whole field, or nullopt.
std::optional<double> parse_number(std::string_view field) {
  double value = 0.0;
  const char* end = field.data() + field.size();
  auto [ptr, ec] = std::from_chars(field.data(), end, value);
  if (field.empty() || ec != std::errc{} || ptr != end || !std::isfinite(value)) return {};
  return value;
}

// ---------------------------------------------------------------------------------------------
// Data sets.

Dataset gather(const Dataset& all, const std::int64_t* rows, std::int64_t count,
               std::string name) {
  const std::int64_t width = all.width();
  Dataset out;
  out.name = std::move(name);
  out.num_classes = all.num_classes;
  out.features = Tensor::empty({count, width}, DType::f32);
  out.labels = Tensor::empty({count}, DType::i32);
  auto src_x = all.features.data<float>();
  auto src_y = all.labels.data<std::int32_t>();
  auto dst_x = out.features.data<float>();
  auto dst_y = out.labels.data<std::int32_t>();
  for (std::int64_t i = 0; i < count; ++i) {
    const auto r = static_cast<std::size_t>(rows[i]);
    const auto w = static_cast<std::size_t>(width);
    std::copy_n(src_x.begin() + static_cast<std::ptrdiff_t>(r * w), w,
                dst_x.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i) * w));
    dst_y[static_cast<std::size_t>(i)] = src_y[r];
  }
  return out;
}

void check_micro_batching(const char* what, std::int64_t batch, std::int64_t microbatches) {
  if (batch < 1 || microbatches < 1 || batch % microbatches != 0) {
    throw std::invalid_argument(fmt::format(
        "{}: batch {} must be positive and divisible by the {} micro-batches", what, batch,
        microbatches));
  }
}

void check_cpu(const KernelConfig& cfg, const char* what) {
  if (cfg.device.type != DeviceType::cpu) {
    throw std::invalid_argument(
        fmt::format("{} (actor '{}') writes host memory and runs on the CPU only, not {}", what,
                    cfg.actor, cfg.device.str()));
  }
}

Tensor& output(KernelContext& ctx, std::size_t i, const std::string& actor, const char* what) {
  if (ctx.outputs.size() <= i || ctx.outputs[i] == nullptr) {
    throw std::invalid_argument(
        fmt::format("{} (actor '{}'): output {} is missing", what, actor, i));
  }
  return *ctx.outputs[i];
}

void expect(const Tensor& t, const Shape& shape, bool dtype_ok, const std::string& actor,
            const char* what, const char* output_name, const char* dtypes) {
  if (!dtype_ok || t.shape() != shape) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): output {} is {}, expected {}{}",
                                            what, actor, output_name, t.describe(), dtypes,
                                            to_string(shape)));
  }
}

// Streams a data set in shuffled epochs; see batch_source() in data.h for the order.
class BatchSourceKernel final : public Kernel {
 public:
  BatchSourceKernel(std::shared_ptr<const Dataset> data, std::int64_t batch,
                    std::int64_t microbatches, std::uint64_t seed, std::string actor)
      : data_(std::move(data)),
        batch_(batch),
        microbatches_(microbatches),
        per_piece_(batch / microbatches),
        seed_(seed),
        actor_(std::move(actor)) {}

  void compute(KernelContext& ctx) override {
    constexpr const char* what = "batch_source";
    if (ctx.piece < 0) {
      throw std::invalid_argument(fmt::format("{} (actor '{}'): negative piece {}", what,
                                              actor_, ctx.piece));
    }
    Tensor& x = output(ctx, 0, actor_, what);
    Tensor& y = output(ctx, 1, actor_, what);
    const std::int64_t width = data_->width();
    expect(x, {per_piece_, width}, x.dtype() == DType::f32 || x.dtype() == DType::f64, actor_,
           what, "x", "f32 or f64");
    expect(y, {per_piece_}, y.dtype() == DType::i32, actor_, what, "y", "i32");

    const std::int64_t rows = data_->rows();
    const std::int64_t step = ctx.piece / microbatches_;
    const std::int64_t first = step * batch_ + (ctx.piece % microbatches_) * per_piece_;
    auto src_x = data_->features.data<float>();
    auto src_y = data_->labels.data<std::int32_t>();
    auto dst_y = y.data<std::int32_t>();
    const auto w = static_cast<std::size_t>(width);
    for (std::int64_t r = 0; r < per_piece_; ++r) {
      const std::int64_t position = first + r;
      const auto row = static_cast<std::size_t>(order(position / rows)[position % rows]);
      const auto out = static_cast<std::size_t>(r);
      const float* from = src_x.data() + row * w;
      if (x.dtype() == DType::f32) {
        std::copy_n(from, w, x.data<float>().data() + out * w);
      } else {
        std::copy_n(from, w, x.data<double>().data() + out * w);
      }
      dst_y[out] = src_y[row];
    }
  }

 private:
  // Epoch e's row order. Two epochs are cached: a step straddling a boundary needs both.
  const std::vector<std::int64_t>& order(std::int64_t epoch) {
    for (auto& cached : cache_) {
      if (cached.epoch == epoch) return cached.order;
    }
    Cached& slot = cache_[0].epoch < cache_[1].epoch ? cache_[0] : cache_[1];
    slot.epoch = epoch;
    slot.order = shuffled_indices(data_->rows(), seed_ + static_cast<std::uint64_t>(epoch));
    return slot.order;
  }

  struct Cached {
    std::int64_t epoch = -1;
    std::vector<std::int64_t> order;
  };

  std::shared_ptr<const Dataset> data_;
  std::int64_t batch_;
  std::int64_t microbatches_;
  std::int64_t per_piece_;
  std::uint64_t seed_;
  std::string actor_;
  std::array<Cached, 2> cache_;
};

// Character windows at seeded offsets; see text_source() in data.h.
class TextSourceKernel final : public Kernel {
 public:
  TextSourceKernel(std::shared_ptr<const TextCorpus> corpus, std::int64_t batch,
                   std::int64_t microbatches, std::int64_t seq, std::uint64_t seed,
                   std::string actor)
      : corpus_(std::move(corpus)),
        microbatches_(microbatches),
        per_piece_(batch / microbatches),
        seq_(seq),
        seed_(seed),
        actor_(std::move(actor)) {}

  void compute(KernelContext& ctx) override {
    constexpr const char* what = "text_source";
    if (ctx.piece < 0) {
      throw std::invalid_argument(fmt::format("{} (actor '{}'): negative piece {}", what,
                                              actor_, ctx.piece));
    }
    Tensor& tokens = output(ctx, 0, actor_, what);
    Tensor& targets = output(ctx, 1, actor_, what);
    expect(tokens, {per_piece_, seq_}, tokens.dtype() == DType::i32, actor_, what, "tokens",
           "i32");
    expect(targets, {per_piece_ * seq_}, targets.dtype() == DType::i32, actor_, what, "targets",
           "i32");

    const std::int64_t step = ctx.piece / microbatches_;
    const std::int64_t micro = ctx.piece % microbatches_;
    const auto starts = static_cast<std::uint64_t>(corpus_->ids.size()) -
                        static_cast<std::uint64_t>(seq_);
    const std::vector<std::uint64_t> offsets =
        window_starts(seed_, step, micro * per_piece_, per_piece_, starts);

    const std::int32_t* ids = corpus_->ids.data();
    auto tok = tokens.data<std::int32_t>();
    auto tgt = targets.data<std::int32_t>();
    const auto s = static_cast<std::size_t>(seq_);
    for (std::int64_t r = 0; r < per_piece_; ++r) {
      const auto offset = static_cast<std::size_t>(offsets[static_cast<std::size_t>(r)]);
      const auto out = static_cast<std::size_t>(r) * s;
      std::copy_n(ids + offset, s, tok.data() + out);
      std::copy_n(ids + offset + 1, s, tgt.data() + out);
    }
  }

 private:
  std::shared_ptr<const TextCorpus> corpus_;
  std::int64_t microbatches_;
  std::int64_t per_piece_;
  std::int64_t seq_;
  std::uint64_t seed_;
  std::string actor_;
};

}  // namespace

Dataset load_digits(const std::string& path) {
  const std::string text = read_maybe_gzip(path);
  constexpr std::int64_t columns = digits_pixels + 1;

  std::vector<float> features;
  std::vector<std::int32_t> labels;
  std::vector<std::string_view> fields;
  std::int64_t line_no = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    auto end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (trim(line).empty()) continue;

    fields.clear();
    for (std::size_t from = 0;;) {
      const auto comma = line.find(',', from);
      fields.push_back(trim(line.substr(from, comma == std::string_view::npos
                                                  ? std::string_view::npos
                                                  : comma - from)));
      if (comma == std::string_view::npos) break;
      from = comma + 1;
    }
    if (static_cast<std::int64_t>(fields.size()) != columns) {
      throw std::runtime_error(fmt::format(
          "{}:{}: {} comma-separated values, expected {} (64 pixels, then the label)", path,
          line_no, fields.size(), columns));
    }
    for (std::size_t column = 0; column < fields.size(); ++column) {
      const auto field = fields[column];
      const auto value = parse_number(field);
      if (!value) {
        throw std::runtime_error(fmt::format("{}:{}: column {} is '{}', not a number", path,
                                             line_no, column + 1, field));
      }
      if (static_cast<std::int64_t>(column) < digits_pixels) {
        if (*value < 0.0 || *value > digits_max_pixel) {
          throw std::runtime_error(fmt::format("{}:{}: pixel {} is {}, outside 0..16", path,
                                               line_no, column + 1, field));
        }
        features.push_back(static_cast<float>(*value / digits_max_pixel));
      } else if (*value != std::floor(*value) || *value < 0.0 ||
                 *value > static_cast<double>(digits_classes - 1)) {
        throw std::runtime_error(
            fmt::format("{}:{}: label is {}, not an integer in 0..9", path, line_no, field));
      } else {
        labels.push_back(static_cast<std::int32_t>(*value));
      }
    }
  }
  if (labels.empty()) throw std::runtime_error(fmt::format("{}: empty file (no rows)", path));

  Dataset out;
  out.name = "digits";
  out.num_classes = digits_classes;
  const auto rows = static_cast<std::int64_t>(labels.size());
  out.features = Tensor::empty({rows, digits_pixels}, DType::f32);
  out.labels = Tensor::empty({rows}, DType::i32);
  std::copy(features.begin(), features.end(), out.features.data<float>().begin());
  std::copy(labels.begin(), labels.end(), out.labels.data<std::int32_t>().begin());
  return out;
}

std::string find_digits_file() {
  if (const char* dir = std::getenv("BATON_DATA_DIR"); dir != nullptr && *dir != '\0') {
    const auto path = (fs::path(dir) / digits_file_name).string();
    if (fs::exists(path)) return path;
    throw std::runtime_error(fmt::format(
        "{} not found: BATON_DATA_DIR is set to '{}', which holds no {}; unset it to use the "
        "repository's data/ (scripts/run.sh build fetches the file there from Debian's "
        "python3-sklearn package)",
        path, dir, digits_file_name));
  }
  std::vector<fs::path> candidates;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(
        (exe.parent_path() / ".." / ".." / "data" / digits_file_name).lexically_normal());
  }
  candidates.push_back(fs::path("data") / digits_file_name);
  std::string looked;
  for (const auto& candidate : candidates) {
    if (fs::exists(candidate, ec)) return candidate.string();
    looked += looked.empty() ? candidate.string() : ", " + candidate.string();
  }
  throw std::runtime_error(fmt::format(
      "{} not found (looked in: {}); `scripts/run.sh build` fetches it into <repository>/data/ "
      "from Debian's python3-sklearn package, or set BATON_DATA_DIR to a folder holding it",
      digits_file_name, looked));
}

std::vector<std::int64_t> shuffled_indices(std::int64_t n, std::uint64_t seed) {
  if (n < 0) throw std::invalid_argument(fmt::format("shuffled_indices: negative count {}", n));
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  std::mt19937_64 rng(seed);
  // Fisher-Yates (Durstenfeld's in-place form): position i takes a uniform pick of 0..i.
  for (std::size_t i = order.size(); i > 1; --i) {
    const auto j = static_cast<std::size_t>(bounded(rng, i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

std::pair<Dataset, Dataset> split(const Dataset& all, double heldout_fraction,
                                  std::uint64_t seed) {
  if (!(heldout_fraction >= 0.0 && heldout_fraction <= 1.0)) {
    throw std::invalid_argument(fmt::format(
        "split of '{}': held-out fraction {} is not in [0, 1]", all.name, heldout_fraction));
  }
  const std::int64_t rows = all.rows();
  const auto heldout =
      static_cast<std::int64_t>(std::llround(heldout_fraction * static_cast<double>(rows)));
  const auto order = shuffled_indices(rows, seed);
  return {gather(all, order.data(), rows - heldout, all.name + "/train"),
          gather(all, order.data() + (rows - heldout), heldout, all.name + "/heldout")};
}

Dataset synthetic(std::int64_t rows, std::int64_t width, std::int64_t classes,
                  std::uint64_t seed) {
  if (rows < 1 || width < 1 || classes < 2 ||
      classes > std::numeric_limits<std::int32_t>::max()) {
    throw std::invalid_argument(fmt::format(
        "synthetic: needs rows >= 1, width >= 1 and classes >= 2, got {} x {}, {} classes", rows,
        width, classes));
  }
  std::mt19937_64 rng(seed);
  Normal normal;
  const auto w = static_cast<std::size_t>(width);
  const auto c = static_cast<std::size_t>(classes);
  std::vector<double> teacher(w * c);  // [width, classes]
  for (auto& t : teacher) t = normal(rng);

  Dataset out;
  out.name = fmt::format("synthetic-{}x{}-{}", rows, width, classes);
  out.num_classes = classes;
  out.features = Tensor::empty({rows, width}, DType::f32);
  out.labels = Tensor::empty({rows}, DType::i32);
  auto x = out.features.data<float>();
  auto y = out.labels.data<std::int32_t>();
  std::vector<double> logits(c);
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    float* row = x.data() + r * w;
    for (std::size_t f = 0; f < w; ++f) row[f] = static_cast<float>(normal(rng));
    // The label comes from the stored (float) features, so the teacher is exact on them.
    std::fill(logits.begin(), logits.end(), 0.0);
    for (std::size_t f = 0; f < w; ++f) {
      for (std::size_t k = 0; k < c; ++k) logits[k] += static_cast<double>(row[f]) * teacher[f * c + k];
    }
    y[r] = static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                     logits.begin());
  }
  return out;
}

double TextCorpus::unigram_entropy_nats() const {
  if (ids.empty()) return 0.0;
  std::vector<std::int64_t> counts(vocab.size(), 0);
  for (auto id : ids) ++counts[static_cast<std::size_t>(id)];
  const double n = static_cast<double>(ids.size());
  double entropy = 0.0;
  for (auto count : counts) {
    if (count == 0) continue;
    const double p = static_cast<double>(count) / n;
    entropy -= p * std::log(p);
  }
  return entropy;
}

TextCorpus load_text(const std::string& path) {
  require_regular_file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::runtime_error(fmt::format("{}: read error", path));
  if (bytes.size() < 2) {
    throw std::runtime_error(fmt::format(
        "{}: {} bytes; a text corpus needs at least 2 (a character and the next one)", path,
        bytes.size()));
  }
  TextCorpus out;
  out.path = path;
  std::array<std::int32_t, 256> index{};
  std::array<bool, 256> seen{};
  for (char ch : bytes) seen[static_cast<unsigned char>(ch)] = true;
  for (std::size_t b = 0; b < seen.size(); ++b) {
    if (!seen[b]) continue;
    index[b] = static_cast<std::int32_t>(out.vocab.size());
    out.vocab.push_back(static_cast<unsigned char>(b));
  }
  out.ids.reserve(bytes.size());
  for (char ch : bytes) out.ids.push_back(index[static_cast<unsigned char>(ch)]);
  return out;
}

KernelFactory batch_source(std::shared_ptr<const Dataset> data, std::int64_t batch,
                           std::int64_t microbatches, std::uint64_t seed) {
  if (data == nullptr || data->rows() < 1) {
    throw std::invalid_argument("batch_source: needs a data set with at least one row");
  }
  if (!data->labels.defined() || data->labels.numel() != data->rows() ||
      data->features.dtype() != DType::f32 || data->labels.dtype() != DType::i32) {
    throw std::invalid_argument(fmt::format(
        "batch_source: data set '{}' must hold f32 features [N, F] and i32 labels [N]",
        data->name));
  }
  check_micro_batching("batch_source", batch, microbatches);
  return [data = std::move(data), batch, microbatches, seed](const KernelConfig& cfg) {
    check_cpu(cfg, "batch_source");
    return std::make_unique<BatchSourceKernel>(data, batch, microbatches, seed,
                                               std::string(cfg.actor));
  };
}

std::vector<std::uint64_t> window_starts(std::uint64_t seed, std::int64_t step, std::int64_t first_row,
                                         std::int64_t rows, std::uint64_t starts) {
  if (starts < 1 || first_row < 0 || rows < 0) {
    throw std::invalid_argument(fmt::format("window_starts: needs starts >= 1, first_row >= 0 and rows >= 0, "
                                            "not {}, {} and {}", starts, first_row, rows));
  }
  // One generator per step, drawn row by row from the step's first row: the offsets of a
  // step's global batch do not depend on how it is cut into micro-batches.
  std::mt19937_64 rng(splitmix64(splitmix64(seed) ^ static_cast<std::uint64_t>(step)));
  for (std::int64_t skip = 0; skip < first_row; ++skip) bounded(rng, starts);
  std::vector<std::uint64_t> out(static_cast<std::size_t>(rows));
  for (auto& o : out) o = bounded(rng, starts);
  return out;
}

KernelFactory text_source(std::shared_ptr<const TextCorpus> corpus, std::int64_t batch,
                          std::int64_t microbatches, std::int64_t seq, std::uint64_t seed) {
  if (corpus == nullptr) throw std::invalid_argument("text_source: needs a corpus");
  check_micro_batching("text_source", batch, microbatches);
  if (seq < 1 || static_cast<std::int64_t>(corpus->ids.size()) < seq + 1) {
    throw std::invalid_argument(fmt::format(
        "text_source: {} has {} characters; windows of seq {} need at least seq + 1",
        corpus->path, corpus->ids.size(), seq));
  }
  return [corpus = std::move(corpus), batch, microbatches, seq, seed](const KernelConfig& cfg) {
    check_cpu(cfg, "text_source");
    return std::make_unique<TextSourceKernel>(corpus, batch, microbatches, seq, seed,
                                              std::string(cfg.actor));
  };
}

}  // namespace baton::data
