// baton-prepare-data: text files to token shards for `baton-train --data tokens:DIR`.
//
//   baton-prepare-data --input /usr/share/common-licenses/GPL-3 --train-tokenizer --vocab-size 512
//       --model-type bpe --output data/gpl --val-fraction 0.1
//   baton-prepare-data --input more.txt --tokenizer data/gpl/tokenizer.model --output data/more
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "prepare.h"

int main(int argc, char** argv) {
  baton::prepare::Options o;
  CLI::App app{
      "Tokenise text files with SentencePiece and write token shards (uint16/uint32, "
      "little-endian) "
      "and index.json for baton-train --data tokens:DIR"};
  app.add_option("--input", o.inputs, "text files, encoded line by line in this order")->required();
  app.add_option("--tokenizer", o.tokenizer,
                 "a SentencePiece .model to load (copied into the output directory)");
  app.add_flag(
      "--train-tokenizer", o.train_tokenizer,
      "train a SentencePiece model on the inputs instead, written to OUTPUT/tokenizer.model");
  app.add_option("--vocab-size", o.vocab_size,
                 "pieces of the trained model (with --train-tokenizer)");
  app.add_option("--model-type", o.model_type, "the trained model's kind: bpe or unigram")
      ->default_str("bpe");
  app.add_option("--output", o.output, "the shard directory to write (created if missing)")
      ->required();
  app.add_option("--val-fraction", o.val_fraction,
                 "the stream's last fraction held out as val_*.bin, in [0, 1)")
      ->default_str("0.1");
  app.add_option("--shard-tokens", o.shard_tokens, "tokens per shard at most")
      ->default_str("100000000");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    const baton::prepare::Summary s = baton::prepare::prepare_data(o);
    fmt::print(
        "{}: {} training tokens in {} shard(s), {} validation tokens in {}; {} ids as {}; "
        "tokenizer {}\n",
        o.output, s.train_tokens, s.index.train.size(), s.val_tokens, s.index.val.size(),
        s.index.vocab_size, s.index.dtype, s.tokenizer_path);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-prepare-data: error: {}\n", e.what());
    return 1;
  }
}
