#pragma once
/// baton-train --sample: text in, text out around sample::generate(). The prompt is encoded
/// and checked against the training data's vocabulary before training (a character the text
/// never has, a tokenizer that cannot be loaded, are refused at once, not after a minute of
/// training); after training the drawn ids are decoded the same way: bytes for --data text:PATH,
/// the shards' SentencePiece model for --data tokens:DIR.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "baton/graph/tokens.h"
#include "baton/kernels/data.h"
#include "sample.h"

namespace baton::sample {

/// What the flags ask for.
struct Request {
  std::int64_t tokens = 0;   // --sample
  std::string prompt;        // --sample-prompt; "" starts from the data's first token
  double temperature = 0.8;  // --temperature
  std::uint64_t seed = 1;    // --sample-seed (default: --seed)
};

class TextSampler {
 public:
  /// For characters (`text`, the training corpus) or token shards (`shards`, whose index names
  /// the tokenizer); exactly one is non-null. Throws std::invalid_argument naming the flag:
  /// --sample-prompt with a character outside the text's vocabulary or that encodes to nothing,
  /// token shards without a tokenizer or, in a build without SentencePiece, with one.
  TextSampler(const Request& r, std::shared_ptr<const data::TextCorpus> text,
              std::shared_ptr<const data::TokenShards> shards);
  ~TextSampler();
  TextSampler(TextSampler&&) noexcept;

  /// The prompt and the drawn continuation, decoded.
  struct Result {
    std::string prompt, text;
    std::int64_t tokens = 0;
  };
  Result run(const BuildLogits& build, std::int64_t seq, const ParameterStore& params) const;

  /// `s` as a JSON string literal (quotes and escapes included), for --json.
  static std::string json_string(const std::string& s);

 private:
  struct Codec;
  Request request_;
  std::int64_t vocab_ = 0;
  std::vector<std::int32_t> prompt_ids_;
  std::unique_ptr<Codec> codec_;
};

}  // namespace baton::sample
