#include "codec.h"

#include <array>
#include <stdexcept>

#include <fmt/format.h>

#ifdef BATON_HAS_SENTENCEPIECE
#include "prepare.h"
#endif

namespace baton::serve {

namespace {

class Bytes final : public Codec {
 public:
  explicit Bytes(std::vector<unsigned char> vocab) : vocab_(std::move(vocab)) {
    id_of_.fill(-1);
    for (std::size_t i = 0; i < vocab_.size(); ++i) id_of_[vocab_[i]] = static_cast<std::int32_t>(i);
  }
  std::vector<std::int32_t> encode(const std::string& text) const override {
    std::vector<std::int32_t> ids;
    ids.reserve(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) {
      const auto byte = static_cast<unsigned char>(text[i]);
      if (id_of_[byte] < 0) {
        throw std::invalid_argument(fmt::format(
            "character {} (byte 0x{:02x}{}) never occurred in the model's training text, so it has no token", i, byte,
            byte >= 0x20 && byte < 0x7f ? fmt::format(", '{}'", static_cast<char>(byte)) : ""));
      }
      ids.push_back(id_of_[byte]);
    }
    return ids;
  }
  std::string decode(const std::vector<std::int32_t>& ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (std::int32_t id : ids) {
      if (id >= 0 && static_cast<std::size_t>(id) < vocab_.size()) out += static_cast<char>(vocab_[static_cast<std::size_t>(id)]);
    }
    return out;
  }
  std::string describe() const override { return fmt::format("bytes ({} symbols)", vocab_.size()); }

 private:
  std::vector<unsigned char> vocab_;
  std::array<std::int32_t, 256> id_of_{};
};

#ifdef BATON_HAS_SENTENCEPIECE
class Pieces final : public Codec {
 public:
  explicit Pieces(const std::string& path) : path_(path), tok_(prepare::Tokenizer::load(path)) {}
  std::vector<std::int32_t> encode(const std::string& text) const override { return tok_.encode(text); }
  std::string decode(const std::vector<std::int32_t>& ids) const override { return tok_.decode(ids); }
  std::int32_t eos() const override { return tok_.eos_id(); }
  std::string describe() const override {
    return fmt::format("SentencePiece {} ({} pieces)", path_, tok_.vocab_size());
  }

 private:
  std::string path_;
  prepare::Tokenizer tok_;
};
#endif

}  // namespace

std::shared_ptr<const Codec> byte_codec(std::vector<unsigned char> vocab) {
  if (vocab.empty()) throw std::invalid_argument("a byte vocabulary needs at least one byte");
  return std::make_shared<Bytes>(std::move(vocab));
}

std::shared_ptr<const Codec> sentencepiece_codec(const std::string& path) {
#ifdef BATON_HAS_SENTENCEPIECE
  return std::make_shared<Pieces>(path);
#else
  throw std::runtime_error(fmt::format("{}: this build has no SentencePiece (Debian's libsentencepiece-dev)", path));
#endif
}

std::size_t stable_prefix(const std::string& text) {
  std::size_t n = text.size();
  // A trailing replacement character (EF BF BD): a byte-fallback decoder's placeholder for a
  // character whose bytes are not all there yet.
  while (n >= 3 && text.compare(n - 3, 3, "\xEF\xBF\xBD") == 0) n -= 3;
  // An incomplete UTF-8 sequence at the end: its lead byte and fewer continuation bytes than it
  // announces.
  std::size_t back = 0;
  while (back < 4 && back < n && (static_cast<unsigned char>(text[n - 1 - back]) & 0xC0) == 0x80) ++back;
  if (back < n) {
    const auto lead = static_cast<unsigned char>(text[n - 1 - back]);
    const std::size_t want = lead >= 0xF0 ? 3 : lead >= 0xE0 ? 2 : lead >= 0xC0 ? 1 : 0;
    if (want > back) n -= back + 1;
  }
  return n;
}

}  // namespace baton::serve
