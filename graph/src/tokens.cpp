// Token shards on disk and the source kernel that serves their windows; see tokens.h.
#include "baton/graph/tokens.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <boost/json.hpp>

#include "baton/kernels/data.h"

namespace baton::data {

namespace {

namespace fs = std::filesystem;
namespace json = boost::json;

// The shards are little-endian, as every loader of this format expects; reading them with
// memcpy is right only on a little-endian host (x86-64, aarch64 as Linux runs it).
static_assert(std::endian::native == std::endian::little, "token shards are read as little-endian");

constexpr const char* format_name = "baton-token-shards";

std::string shard_name(const char* split, std::size_t i) {
  return fmt::format("{}_{:03}.bin", split, i);
}

// Writes one split's shards, little-endian, and returns their index entries.
std::vector<TokenShardIndex::Shard> write_split(const fs::path& dir, const char* split,
                                                std::span<const std::int32_t> ids,
                                                std::int64_t vocab, std::int64_t width,
                                                std::int64_t shard_tokens) {
  std::vector<TokenShardIndex::Shard> shards;
  std::vector<unsigned char> bytes;
  for (std::size_t first = 0; first < ids.size(); first += static_cast<std::size_t>(shard_tokens)) {
    const std::size_t n = std::min(ids.size() - first, static_cast<std::size_t>(shard_tokens));
    bytes.resize(n * static_cast<std::size_t>(width));
    for (std::size_t i = 0; i < n; ++i) {
      const std::int32_t id = ids[first + i];
      if (id < 0 || id >= vocab) {
        throw std::invalid_argument(
            fmt::format("write_token_shards: {} token {} is {}, outside the vocabulary [0, {})",
                        split, first + i, id, vocab));
      }
      const auto v = static_cast<std::uint32_t>(id);
      for (std::int64_t b = 0; b < width; ++b)
        bytes[i * static_cast<std::size_t>(width) + static_cast<std::size_t>(b)] =
            static_cast<unsigned char>(v >> (8 * b));
    }
    const std::string name = shard_name(split, shards.size());
    const fs::path path = dir / name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out)
      throw std::runtime_error(
          fmt::format("{}: cannot write: {}", path.string(), std::strerror(errno)));
    shards.push_back({name, static_cast<std::int64_t>(n)});
  }
  return shards;
}

json::array shard_list(const std::vector<TokenShardIndex::Shard>& shards) {
  json::array a;
  for (const auto& s : shards) a.push_back(json::object{{"file", s.file}, {"tokens", s.tokens}});
  return a;
}

// index.json's key `key` of `o`, which must hold a value of the kind `is` checks.
template <typename Check>
const json::value& field(const json::object& o, const char* key, Check is, const char* kind,
                         const std::string& file) {
  const json::value* v = o.if_contains(key);
  if (v == nullptr || !is(*v))
    throw std::runtime_error(fmt::format("{}: \"{}\" must be {}", file, key, kind));
  return *v;
}

std::int64_t count_of(const json::value& v, const char* what, const std::string& file) {
  if (v.is_int64() && v.as_int64() >= 0) return v.as_int64();
  if (v.is_uint64() && v.as_uint64() <= static_cast<std::uint64_t>(INT64_MAX))
    return static_cast<std::int64_t>(v.as_uint64());
  throw std::runtime_error(fmt::format("{}: {} must be a whole number >= 0", file, what));
}

std::vector<TokenShardIndex::Shard> read_shard_list(const json::object& o, const char* split,
                                                    const std::string& file) {
  const json::array& a =
      field(
          o, split, [](const json::value& v) { return v.is_array(); }, "an array of shards", file)
          .as_array();
  std::vector<TokenShardIndex::Shard> shards;
  for (const json::value& v : a) {
    const json::object* s = v.if_object();
    const json::value* name = s != nullptr ? s->if_contains("file") : nullptr;
    const json::value* tokens = s != nullptr ? s->if_contains("tokens") : nullptr;
    if (name == nullptr || !name->is_string() || tokens == nullptr) {
      throw std::runtime_error(fmt::format(
          "{}: each \"{}\" shard must be {{\"file\": NAME, \"tokens\": N}}", file, split));
    }
    const std::string n(name->as_string());
    if (n.empty() || n.find('/') != std::string::npos) {
      throw std::runtime_error(
          fmt::format("{}: shard file '{}' must be a plain name in the directory", file, n));
    }
    shards.push_back(
        {n, count_of(*tokens, fmt::format("\"{}\" shard {}'s tokens", split, n).c_str(), file)});
  }
  return shards;
}

// Reads the ids of a little-endian shard into int32, checking them against the vocabulary.
void decode(const unsigned char* src, std::int64_t n, std::int64_t width, std::int64_t vocab,
            std::int32_t* out, const std::string& path, std::int64_t first) {
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t v = 0;
    if (width == 2) {
      std::uint16_t h;
      std::memcpy(&h, src + i * 2, 2);
      v = h;
    } else {
      std::memcpy(&v, src + i * 4, 4);
    }
    if (v >= static_cast<std::uint64_t>(vocab)) {
      throw std::runtime_error(
          fmt::format("{}: token {} is {}, outside the vocabulary [0, {}) of index.json", path,
                      first + i, v, vocab));
    }
    out[i] = static_cast<std::int32_t>(v);
  }
}

class TokenSourceKernel final : public Kernel {
 public:
  TokenSourceKernel(std::shared_ptr<const TokenShards> shards, std::int64_t batch,
                    std::int64_t microbatches, std::int64_t seq, std::uint64_t seed,
                    std::string actor)
      : shards_(std::move(shards)),
        microbatches_(microbatches),
        per_piece_(batch / microbatches),
        seq_(seq),
        seed_(seed),
        actor_(std::move(actor)),
        window_(static_cast<std::size_t>(seq + 1)) {}

  void compute(KernelContext& ctx) override {
    constexpr const char* what = "token_source";
    if (ctx.piece < 0)
      throw std::invalid_argument(
          fmt::format("{} (actor '{}'): negative piece {}", what, actor_, ctx.piece));
    if (ctx.outputs.size() < 2 || ctx.outputs[0] == nullptr || ctx.outputs[1] == nullptr) {
      throw std::invalid_argument(
          fmt::format("{} (actor '{}'): needs outputs tokens and targets", what, actor_));
    }
    Tensor& tokens = *ctx.outputs[0];
    Tensor& targets = *ctx.outputs[1];
    if (tokens.dtype() != DType::i32 || tokens.shape() != Shape{per_piece_, seq_} ||
        targets.dtype() != DType::i32 || targets.shape() != Shape{per_piece_ * seq_}) {
      throw std::invalid_argument(
          fmt::format("{} (actor '{}'): outputs are {} and {}, expected i32{} and i32{}", what,
                      actor_, tokens.describe(), targets.describe(),
                      to_string(Shape{per_piece_, seq_}), to_string(Shape{per_piece_ * seq_})));
    }
    const std::int64_t step = ctx.piece / microbatches_;
    const std::int64_t first_row = (ctx.piece % microbatches_) * per_piece_;
    const auto starts = static_cast<std::uint64_t>(shards_->size() - seq_);
    auto tok = tokens.data<std::int32_t>();
    auto tgt = targets.data<std::int32_t>();
    const auto s = static_cast<std::size_t>(seq_);
    const auto offsets = window_starts(seed_, step, first_row, per_piece_, starts);
    for (std::size_t r = 0; r < offsets.size(); ++r) {
      shards_->copy(static_cast<std::int64_t>(offsets[r]), seq_ + 1, window_.data());
      std::copy_n(window_.begin(), s, tok.begin() + static_cast<std::ptrdiff_t>(r * s));
      std::copy_n(window_.begin() + 1, s, tgt.begin() + static_cast<std::ptrdiff_t>(r * s));
    }
    // Read-ahead: the pages this actor's next piece will read, requested now so that the kernel
    // reads them in while the step runs (a no-op for pages already in memory).
    for (std::uint64_t o : window_starts(seed_, step + 1, first_row, per_piece_, starts)) {
      shards_->prefetch(static_cast<std::int64_t>(o), seq_ + 1);
    }
  }

 private:
  std::shared_ptr<const TokenShards> shards_;
  std::int64_t microbatches_;
  std::int64_t per_piece_;
  std::int64_t seq_;
  std::uint64_t seed_;
  std::string actor_;
  std::vector<std::int32_t> window_;
};

}  // namespace

TokenShardIndex write_token_shards(const std::string& dir, std::span<const std::int32_t> train,
                                   std::span<const std::int32_t> val, std::int64_t vocab_size,
                                   const std::string& tokenizer, std::int64_t shard_tokens) {
  if (vocab_size < 1 || vocab_size > (std::int64_t{1} << 32)) {
    throw std::invalid_argument(
        fmt::format("write_token_shards: vocab_size {} must be in [1, 2^32]", vocab_size));
  }
  if (shard_tokens < 1)
    throw std::invalid_argument(
        fmt::format("write_token_shards: shard_tokens {} must be >= 1", shard_tokens));
  if (train.empty()) throw std::invalid_argument("write_token_shards: no training tokens");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error(fmt::format("{}: cannot create the directory: {}", dir, ec.message()));

  TokenShardIndex index;
  index.dtype = vocab_size <= 65536 ? "uint16" : "uint32";
  index.vocab_size = vocab_size;
  index.tokenizer = tokenizer;
  index.train = write_split(dir, "train", train, vocab_size, index.token_bytes(), shard_tokens);
  index.val = write_split(dir, "val", val, vocab_size, index.token_bytes(), shard_tokens);

  const json::object o{{"format", format_name},       {"version", TokenShardIndex::format_version},
                       {"dtype", index.dtype},        {"vocab_size", vocab_size},
                       {"tokenizer", tokenizer},      {"train", shard_list(index.train)},
                       {"val", shard_list(index.val)}};
  const fs::path path = fs::path(dir) / "index.json";
  std::ofstream out(path, std::ios::trunc);
  out << json::serialize(o) << "\n";
  out.close();
  if (!out)
    throw std::runtime_error(
        fmt::format("{}: cannot write: {}", path.string(), std::strerror(errno)));
  return index;
}

TokenShardIndex read_token_index(const std::string& dir) {
  const std::string file = (fs::path(dir) / "index.json").string();
  std::ifstream in(file);
  if (!in) {
    throw std::runtime_error(
        fmt::format("{}: cannot open ({}); a token shard directory is what baton-prepare-data "
                    "--output writes",
                    file, std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  json::error_code ec;
  const json::value v = json::parse(text.str(), ec);
  if (ec) throw std::runtime_error(fmt::format("{}: not JSON: {}", file, ec.message()));
  const json::object* o = v.if_object();
  if (o == nullptr) throw std::runtime_error(fmt::format("{}: must be a JSON object", file));
  const json::value* format = o->if_contains("format");
  if (format == nullptr || !format->is_string() || format->as_string() != format_name) {
    throw std::runtime_error(fmt::format("{}: \"format\" must be \"{}\"", file, format_name));
  }
  const std::int64_t version = count_of(
      field(
          *o, "version", [](const json::value& x) { return x.is_number(); }, "a number", file),
      "\"version\"", file);
  if (version != TokenShardIndex::format_version) {
    throw std::runtime_error(fmt::format("{}: format version {}; this baton reads version {}", file,
                                         version, TokenShardIndex::format_version));
  }
  TokenShardIndex index;
  auto is_string = [](const json::value& x) { return x.is_string(); };
  index.dtype = std::string(field(*o, "dtype", is_string, "a string", file).as_string());
  index.vocab_size = count_of(
      field(
          *o, "vocab_size", [](const json::value& x) { return x.is_number(); }, "a number", file),
      "\"vocab_size\"", file);
  index.tokenizer = std::string(field(*o, "tokenizer", is_string, "a string", file).as_string());
  if (index.dtype != "uint16" && index.dtype != "uint32") {
    throw std::runtime_error(
        fmt::format("{}: dtype '{}' must be uint16 or uint32", file, index.dtype));
  }
  if (index.vocab_size < 1 || (index.dtype == "uint16" && index.vocab_size > 65536) ||
      index.vocab_size > (std::int64_t{1} << 32)) {
    throw std::runtime_error(fmt::format("{}: vocab_size {} does not fit dtype {}", file,
                                         index.vocab_size, index.dtype));
  }
  index.train = read_shard_list(*o, "train", file);
  index.val = read_shard_list(*o, "val", file);
  return index;
}

std::shared_ptr<const TokenShards> TokenShards::open(const std::string& dir,
                                                     const std::string& split) {
  if (split != "train" && split != "val") {
    throw std::invalid_argument(fmt::format("TokenShards: split '{}' must be train or val", split));
  }
  std::shared_ptr<TokenShards> t(new TokenShards());
  t->index_ = read_token_index(dir);
  t->name_ = (fs::path(dir) / split).string();
  const auto width = static_cast<std::size_t>(t->index_.token_bytes());
  for (const TokenShardIndex::Shard& s : split == "train" ? t->index_.train : t->index_.val) {
    Mapped m;
    m.path = (fs::path(dir) / s.file).string();
    m.first = t->total_;
    m.tokens = s.tokens;
    const int fd = ::open(m.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      throw std::runtime_error(fmt::format("{}: cannot open: {}", m.path, std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 ||
        static_cast<std::uint64_t>(st.st_size) != static_cast<std::uint64_t>(s.tokens) * width) {
      ::close(fd);
      throw std::runtime_error(
          fmt::format("{}: {} bytes, but index.json says {} tokens of {} bytes", m.path,
                      static_cast<long long>(st.st_size), s.tokens, width));
    }
    m.bytes = static_cast<std::size_t>(st.st_size);
    if (m.bytes > 0) {
      void* p = ::mmap(nullptr, m.bytes, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw std::runtime_error(
            fmt::format("{}: cannot memory-map: {}", m.path, std::strerror(err)));
      }
      // Windows are drawn at random: the kernel's sequential read-ahead would read pages no
      // window asks for; the source prefetches what it will read itself.
      ::madvise(p, m.bytes, MADV_RANDOM);
      m.data = static_cast<const unsigned char*>(p);
    }
    ::close(fd);  // the mapping keeps the file
    t->total_ += s.tokens;
    t->shards_.push_back(std::move(m));
  }
  if (t->total_ == 0)
    throw std::invalid_argument(fmt::format("{}: the {} split has no tokens", dir, split));
  return t;
}

TokenShards::~TokenShards() {
  for (const Mapped& m : shards_) {
    if (m.data != nullptr) ::munmap(const_cast<unsigned char*>(m.data), m.bytes);
  }
}

void TokenShards::copy(std::int64_t offset, std::int64_t n, std::int32_t* out) const {
  if (offset < 0 || n < 0 || offset + n > total_) {
    throw std::out_of_range(
        fmt::format("{}: tokens [{}, {}) are outside its {}", name_, offset, offset + n, total_));
  }
  // The first shard holding `offset`, then on across shard boundaries.
  auto it =
      std::upper_bound(shards_.begin(), shards_.end(), offset,
                       [](std::int64_t o, const Mapped& m) { return o < m.first + m.tokens; });
  const std::int64_t width = index_.token_bytes();
  while (n > 0) {
    const std::int64_t at = offset - it->first;
    const std::int64_t take = std::min(n, it->tokens - at);
    decode(it->data + at * width, take, width, index_.vocab_size, out, it->path, at);
    out += take;
    offset += take;
    n -= take;
    ++it;
  }
}

void TokenShards::prefetch(std::int64_t offset, std::int64_t n) const {
  const std::int64_t width = index_.token_bytes();
  const auto page = static_cast<std::int64_t>(::sysconf(_SC_PAGESIZE));
  for (const Mapped& m : shards_) {
    const std::int64_t lo = std::max(offset, m.first),
                       hi = std::min(offset + n, m.first + m.tokens);
    if (lo >= hi || m.data == nullptr) continue;
    const std::int64_t begin =
        (lo - m.first) * width / page * page;  // madvise wants page-aligned starts
    const std::int64_t end = (hi - m.first) * width;
    ::madvise(const_cast<unsigned char*>(m.data) + begin, static_cast<std::size_t>(end - begin),
              MADV_WILLNEED);
  }
}

KernelFactory token_source(std::shared_ptr<const TokenShards> shards, std::int64_t batch,
                           std::int64_t microbatches, std::int64_t seq, std::uint64_t seed) {
  if (shards == nullptr) throw std::invalid_argument("token_source: needs token shards");
  if (batch < 1 || microbatches < 1 || batch % microbatches != 0) {
    throw std::invalid_argument(
        fmt::format("token_source: batch {} must be positive and divisible by the {} micro-batches",
                    batch, microbatches));
  }
  if (seq < 1 || shards->size() < seq + 1) {
    throw std::invalid_argument(
        fmt::format("token_source: {} has {} tokens; windows of seq {} need at least seq + 1",
                    shards->name(), shards->size(), seq));
  }
  return [shards = std::move(shards), batch, microbatches, seq,
          seed](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    if (cfg.device.type != DeviceType::cpu) {
      throw std::invalid_argument(fmt::format(
          "token_source (actor '{}') writes host memory and runs on the CPU only, not {}",
          cfg.actor, cfg.device.str()));
    }
    return std::make_unique<TokenSourceKernel>(shards, batch, microbatches, seq, seed,
                                               std::string(cfg.actor));
  };
}

}  // namespace baton::data
