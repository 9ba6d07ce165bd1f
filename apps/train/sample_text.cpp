#include "sample_text.h"

#include <array>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#ifdef BATON_HAS_SENTENCEPIECE
#include "prepare.h"
#endif

namespace baton::sample {

/// Bytes for a text corpus (its sorted distinct bytes are the ids), or a SentencePiece model.
struct TextSampler::Codec {
  std::shared_ptr<const data::TextCorpus> text;
#ifdef BATON_HAS_SENTENCEPIECE
  std::unique_ptr<prepare::Tokenizer> tokenizer;
#endif

  std::string decode(const std::vector<std::int32_t>& ids) const {
    if (text) {
      std::string out;
      for (std::int32_t id : ids)
        out += static_cast<char>(text->vocab[static_cast<std::size_t>(id)]);
      return out;
    }
#ifdef BATON_HAS_SENTENCEPIECE
    return tokenizer->decode(ids);
#else
    return {};
#endif
  }
};

namespace {

std::vector<std::int32_t> encode_bytes(const data::TextCorpus& text, const std::string& prompt) {
  std::array<std::int32_t, 256> id_of;
  id_of.fill(-1);
  for (std::size_t i = 0; i < text.vocab.size(); ++i)
    id_of[text.vocab[i]] = static_cast<std::int32_t>(i);
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i < prompt.size(); ++i) {
    const auto byte = static_cast<unsigned char>(prompt[i]);
    if (id_of[byte] < 0) {
      throw std::invalid_argument(fmt::format(
          "--sample-prompt: character {} ('{}', byte 0x{:02x}) never occurs in {}, "
          "so the model has no id for it",
          i, byte >= 0x20 && byte < 0x7f ? std::string(1, prompt[i]) : "?", byte, text.path));
    }
    ids.push_back(id_of[byte]);
  }
  return ids;
}

}  // namespace

TextSampler::TextSampler(const Request& r, std::shared_ptr<const data::TextCorpus> text,
                         std::shared_ptr<const data::TokenShards> shards)
    : request_(r), codec_(std::make_unique<Codec>()) {
  if ((text == nullptr) == (shards == nullptr)) {
    throw std::invalid_argument("--sample needs --data text:PATH or tokens:DIR");
  }
  if (text) {
    vocab_ = text->vocab_size();
    codec_->text = text;
    prompt_ids_ = r.prompt.empty() ? std::vector<std::int32_t>{text->ids.front()}
                                   : encode_bytes(*text, r.prompt);
  } else {
    vocab_ = shards->vocab_size();
    const std::string dir = std::filesystem::path(shards->name()).parent_path().string();
    if (shards->index().tokenizer.empty()) {
      throw std::invalid_argument(
          fmt::format("--sample: {}/index.json names no tokenizer, so the drawn ids cannot be "
                      "turned into text",
                      dir));
    }
#ifdef BATON_HAS_SENTENCEPIECE
    codec_->tokenizer = std::make_unique<prepare::Tokenizer>(prepare::Tokenizer::load(
        (std::filesystem::path(dir) / shards->index().tokenizer).string()));
    if (codec_->tokenizer->vocab_size() != vocab_) {
      throw std::invalid_argument(
          fmt::format("--sample: the tokenizer of {} has {} pieces, the shards {} ids", dir,
                      codec_->tokenizer->vocab_size(), vocab_));
    }
    if (r.prompt.empty()) {
      prompt_ids_.resize(1);
      shards->copy(0, 1, prompt_ids_.data());
    } else {
      prompt_ids_ = codec_->tokenizer->encode(r.prompt);
      if (prompt_ids_.empty()) {
        throw std::invalid_argument(
            fmt::format("--sample-prompt '{}': the tokenizer makes no tokens of it", r.prompt));
      }
    }
#else
    throw std::invalid_argument(
        "--sample with --data tokens: this baton-train was built without SentencePiece "
        "(Debian's libsentencepiece-dev), so it cannot decode tokens");
#endif
  }
}

TextSampler::~TextSampler() = default;
TextSampler::TextSampler(TextSampler&&) noexcept = default;

TextSampler::Result TextSampler::run(const BuildLogits& build, std::int64_t seq,
                                     const ParameterStore& params) const {
  const Settings s{
      .tokens = request_.tokens, .temperature = request_.temperature, .seed = request_.seed};
  const std::vector<std::int32_t> drawn = generate(build, seq, vocab_, params, prompt_ids_, s);
  // Decoded together, as SentencePiece joins pieces (a word's leading space belongs to its piece).
  std::vector<std::int32_t> all = prompt_ids_;
  all.insert(all.end(), drawn.begin(), drawn.end());
  Result r{.prompt = codec_->decode(prompt_ids_), .text = codec_->decode(all), .tokens = s.tokens};
  return r;
}

std::string TextSampler::json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (byte < 0x20) {
      out += fmt::format("\\u{:04x}", byte);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace baton::sample
