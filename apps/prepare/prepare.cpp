// baton-prepare-data's work: SentencePiece in, token shards out; see prepare.h.
#include "prepare.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include <fmt/format.h>

namespace baton::prepare {

namespace {

namespace fs = std::filesystem;

std::string read_input(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw std::invalid_argument(fmt::format("--input {}: no such file", path));
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in && !in.eof())
    throw std::invalid_argument(
        fmt::format("--input {}: cannot read: {}", path, std::strerror(errno)));
  return text.str();
}

// The non-blank lines of a text, as SentencePiece reads sentences.
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) lines.push_back(std::move(line));
    pos = end + 1;
  }
  return lines;
}

// Hands the trainer the lines of the inputs (no file names in its flag syntax, so any path
// works, commas and spaces included).
class Lines final : public sentencepiece::SentenceIterator {
 public:
  explicit Lines(std::vector<std::string> lines) : lines_(std::move(lines)) {}
  bool done() const override { return at_ >= lines_.size(); }
  void Next() override { ++at_; }
  const std::string& value() const override { return lines_[at_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  std::vector<std::string> lines_;
  std::size_t at_ = 0;
};

}  // namespace

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw std::runtime_error(fmt::format("--tokenizer {}: no such file", path));
  const auto status = impl->sp.Load(path);
  if (!status.ok()) {
    throw std::runtime_error(
        fmt::format("--tokenizer {}: not a SentencePiece model: {}", path, status.ToString()));
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::train(const std::vector<std::string>& inputs, std::int64_t vocab_size,
                           const std::string& model_type, const std::string& model_path) {
  if (model_type != "bpe" && model_type != "unigram") {
    throw std::invalid_argument(fmt::format("--model-type {}: must be bpe or unigram", model_type));
  }
  // SentencePiece reserves ids 0-2 (unknown, begin and end of sentence) and needs pieces
  // beyond them; ids are written as uint32 at most.
  if (vocab_size < 8 || vocab_size > (std::int64_t{1} << 31) - 1) {
    throw std::invalid_argument(fmt::format("--vocab-size {}: must be in [8, 2^31)", vocab_size));
  }
  std::vector<std::string> lines;
  for (const std::string& path : inputs) {
    for (std::string& line : lines_of(read_input(path))) lines.push_back(std::move(line));
  }
  Lines iterator(std::move(lines));
  // One thread and a fixed seed: the same text gives the same model on every run.
  sentencepiece::SetRandomGeneratorSeed(1);
  const std::unordered_map<std::string, std::string> args{
      {"model_type", model_type},
      {"vocab_size", std::to_string(vocab_size)},
      {"num_threads", "1"},
      {"minloglevel", "2"}};
  std::string proto;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &iterator, &proto);
  if (!status.ok()) {
    throw std::runtime_error(
        fmt::format("--train-tokenizer (--vocab-size {}, --model-type {}): SentencePiece cannot "
                    "train: {}",
                    vocab_size, model_type, status.ToString()));
  }
  std::ofstream out(model_path, std::ios::binary | std::ios::trunc);
  out.write(proto.data(), static_cast<std::streamsize>(proto.size()));
  out.close();
  if (!out)
    throw std::runtime_error(
        fmt::format("{}: cannot write the tokenizer: {}", model_path, std::strerror(errno)));
  auto impl = std::make_unique<Impl>();
  const auto loaded = impl->sp.LoadFromSerializedProto(proto);
  if (!loaded.ok())
    throw std::runtime_error(
        fmt::format("{}: cannot load what was trained: {}", model_path, loaded.ToString()));
  return Tokenizer(std::move(impl));
}

std::int64_t Tokenizer::vocab_size() const {
  return impl_->sp.GetPieceSize();
}
std::int32_t Tokenizer::eos_id() const {
  return impl_->sp.eos_id();
}

std::vector<std::int32_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  const auto status = impl_->sp.Encode(text, &ids);
  if (!status.ok())
    throw std::runtime_error(fmt::format("SentencePiece cannot encode: {}", status.ToString()));
  return {ids.begin(), ids.end()};
}

std::string Tokenizer::decode(const std::vector<std::int32_t>& ids) const {
  std::string text;
  const auto status = impl_->sp.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  if (!status.ok())
    throw std::runtime_error(fmt::format("SentencePiece cannot decode: {}", status.ToString()));
  return text;
}

std::vector<std::int32_t> Tokenizer::encode_file(const std::string& path) const {
  const std::vector<std::string> lines = lines_of(read_input(path));
  if (lines.empty()) throw std::invalid_argument(fmt::format("--input {}: has no text", path));
  std::vector<std::int32_t> ids;
  for (const std::string& line : lines) {
    const std::vector<std::int32_t> more = encode(line);
    ids.insert(ids.end(), more.begin(), more.end());
  }
  if (eos_id() >= 0) ids.push_back(eos_id());
  return ids;
}

Summary prepare_data(const Options& o) {
  if (o.inputs.empty()) throw std::invalid_argument("--input: needs at least one text file");
  if (o.output.empty()) throw std::invalid_argument("--output: needs a directory");
  if (o.train_tokenizer == !o.tokenizer.empty()) {
    throw std::invalid_argument("--tokenizer MODEL or --train-tokenizer: give exactly one");
  }
  if (!o.train_tokenizer && o.vocab_size != 0) {
    throw std::invalid_argument(
        "--vocab-size: only with --train-tokenizer (a loaded model has its own)");
  }
  if (!(o.val_fraction >= 0 && o.val_fraction < 1)) {
    throw std::invalid_argument(
        fmt::format("--val-fraction {}: must be in [0, 1)", o.val_fraction));
  }
  if (o.shard_tokens < 1)
    throw std::invalid_argument(fmt::format("--shard-tokens {}: must be >= 1", o.shard_tokens));
  for (const std::string& path : o.inputs) read_input(path);  // every input named before any work

  std::error_code ec;
  fs::create_directories(o.output, ec);
  if (ec)
    throw std::runtime_error(
        fmt::format("--output {}: cannot create the directory: {}", o.output, ec.message()));
  Summary s;
  Tokenizer tok = [&] {
    if (!o.train_tokenizer) return Tokenizer::load(o.tokenizer);
    s.tokenizer_path = (fs::path(o.output) / "tokenizer.model").string();
    return Tokenizer::train(o.inputs, o.vocab_size, o.model_type, s.tokenizer_path);
  }();
  std::string tokenizer_name = "tokenizer.model";
  if (!o.train_tokenizer) {
    // The index names the tokenizer inside the directory: a copy travels with the shards.
    s.tokenizer_path = (fs::path(o.output) / tokenizer_name).string();
    if (!fs::equivalent(o.tokenizer, s.tokenizer_path, ec)) {
      fs::copy_file(o.tokenizer, s.tokenizer_path, fs::copy_options::overwrite_existing, ec);
      if (ec)
        throw std::runtime_error(
            fmt::format("{}: cannot copy the tokenizer there: {}", s.tokenizer_path, ec.message()));
    }
  }

  std::vector<std::int32_t> ids;
  for (const std::string& path : o.inputs) {
    const std::vector<std::int32_t> more = tok.encode_file(path);
    ids.insert(ids.end(), more.begin(), more.end());
  }
  const auto val =
      static_cast<std::size_t>(std::llround(o.val_fraction * static_cast<double>(ids.size())));
  const std::size_t train = ids.size() - val;
  if (train < 2) {
    throw std::invalid_argument(fmt::format(
        "--input: {} tokens leave {} for training; a model needs at least 2", ids.size(), train));
  }
  const std::span<const std::int32_t> all(ids);
  s.index = data::write_token_shards(o.output, all.first(train), all.subspan(train),
                                     tok.vocab_size(), tokenizer_name, o.shard_tokens);
  s.train_tokens = static_cast<std::int64_t>(train);
  s.val_tokens = static_cast<std::int64_t>(val);
  return s;
}

}  // namespace baton::prepare
