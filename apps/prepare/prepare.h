#pragma once
/// Text files to token shards (graph/tokens.h) through a SentencePiece tokenizer (Debian's
/// libsentencepiece): what baton-prepare-data does, as a library the tests call.
///
///   baton::prepare::Options o{.inputs = {"/usr/share/common-licenses/GPL-3"}, .train_tokenizer =
///   true,
///                             .vocab_size = 512, .output = "data/gpl"};
///   baton::prepare::Summary s = baton::prepare::prepare_data(o);
///
/// A file is encoded line by line (SentencePiece's sentences, which its trainer also reads),
/// each line's ids one after another; after each file comes the tokenizer's end-of-sentence id
/// where it has one, so that no window runs from one document into the next unannounced. The
/// training and validation splits are the stream of all files in order, cut at its last
/// round(val_fraction * tokens) tokens (a contiguous stretch: no window straddles both).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "baton/graph/tokens.h"

namespace baton::prepare {

/// A SentencePiece model, loaded.
class Tokenizer {
 public:
  /// Loads a .model file. Throws std::runtime_error naming the file and SentencePiece's reason.
  static Tokenizer load(const std::string& path);
  /// Trains a `model_type` ("bpe" or "unigram") model of `vocab_size` pieces on the lines of
  /// `inputs` and writes it to `model_path`. Throws std::invalid_argument naming the flag for a
  /// bad model type or size, std::runtime_error with SentencePiece's reason when training fails
  /// (a vocabulary larger than the text allows, say) or the file cannot be written.
  static Tokenizer train(const std::vector<std::string>& inputs, std::int64_t vocab_size,
                         const std::string& model_type, const std::string& model_path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::int64_t vocab_size() const;
  /// The end-of-sentence id, or -1 where the model has none.
  std::int32_t eos_id() const;
  std::vector<std::int32_t> encode(const std::string& text) const;
  std::string decode(const std::vector<std::int32_t>& ids) const;
  /// A file as prepare_data() encodes it (see above), end-of-sentence id included.
  std::vector<std::int32_t> encode_file(const std::string& path) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct Options {
  std::vector<std::string> inputs;  // --input: text files
  std::string tokenizer;            // --tokenizer: a .model to load
  bool train_tokenizer = false;  // --train-tokenizer: train one, written to output/tokenizer.model
  std::int64_t vocab_size = 0;   // --vocab-size (with --train-tokenizer)
  std::string model_type = "bpe";           // --model-type: bpe or unigram
  std::string output;                       // --output: the shard directory
  double val_fraction = 0.1;                // --val-fraction, in [0, 1)
  std::int64_t shard_tokens = 100'000'000;  // --shard-tokens: tokens per shard at most
};

struct Summary {
  data::TokenShardIndex index;
  std::int64_t train_tokens = 0, val_tokens = 0;
  std::string tokenizer_path;
};

/// Tokenises `o.inputs` and writes the shards and index.json into `o.output`. Throws
/// std::invalid_argument with one line naming the flag or file that is wrong (an input missing,
/// unreadable or with no text, no or two tokenizer choices, a bad vocabulary size, model type or
/// fraction, too little text for a training split), std::runtime_error from the tokenizer and
/// the shard writer.
Summary prepare_data(const Options& o);

}  // namespace baton::prepare
