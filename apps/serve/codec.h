#pragma once
// Text to token ids and back for baton-serve: the sorted bytes of a `text:` corpus (what
// baton-train's byte models read), a SentencePiece model (`tokens:` shards, Llama's and
// GPT-2-style published models where a .model file exists), or none (prompts are token ids).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace baton::serve {

class Codec {
 public:
  virtual ~Codec() = default;
  /// Throws std::invalid_argument naming what cannot be encoded.
  virtual std::vector<std::int32_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<std::int32_t>& ids) const = 0;
  /// The end-of-text id that ends a completion ("stop"), or -1.
  virtual std::int32_t eos() const { return -1; }
  /// What it is, for the log ("bytes: 65 symbols", "sentencepiece: FILE").
  virtual std::string describe() const = 0;
};

/// Id i is the byte vocab[i]; a prompt byte outside the vocabulary is refused by name.
std::shared_ptr<const Codec> byte_codec(std::vector<unsigned char> vocab);
/// A SentencePiece .model file. Throws std::runtime_error where it cannot be loaded, or in a
/// build without SentencePiece.
std::shared_ptr<const Codec> sentencepiece_codec(const std::string& path);

/// `text` with the longest tail removed that may still change: an incomplete UTF-8 sequence, a
/// U+FFFD a byte-fallback decoder writes for one. What is left is safe to send.
std::size_t stable_prefix(const std::string& text);

}  // namespace baton::serve
