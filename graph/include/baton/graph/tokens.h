#pragma once
/// Token shards: a tokenised corpus on disk, as baton-prepare-data writes it and nanoGPT's and
/// Megatron's loaders read such files, and the source kernel that streams windows of it.
///
/// A shard directory holds raw little-endian token ids, uint16 when the vocabulary fits
/// (vocab_size <= 65536) and uint32 otherwise, in train_000.bin, train_001.bin, ... and
/// val_000.bin, ..., and an index.json that names them:
///
///   {"format": "baton-token-shards", "version": 1, "dtype": "uint16", "vocab_size": 512,
///    "tokenizer": "tokenizer.model",
///    "train": [{"file": "train_000.bin", "tokens": 91234}], "val": [{"file": "val_000.bin",
///    "tokens": 4801}]}
///
/// A split is its shards' tokens one after another (shard order): a window may run across a
/// shard boundary. The shards are memory-mapped, not read: a corpus larger than memory costs
/// only the pages the windows touch.
///
///   auto shards = baton::data::TokenShards::open("data/gpl", "train");
///   cfg.data = {{"tokens", baton::data::token_source(shards, 16, 2, 64, 1), {"tokens",
///   "targets"}}};
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "baton/kernels/kernel.h"

namespace baton::data {

/// What index.json says.
struct TokenShardIndex {
  /// The format version this code writes and reads; another is refused by name.
  static constexpr int format_version = 1;
  struct Shard {
    std::string file;  // relative to the directory
    std::int64_t tokens = 0;
  };
  std::string dtype;  // "uint16" or "uint32"
  std::int64_t vocab_size = 0;
  std::string tokenizer;  // the tokenizer model's file in the directory; "" for none
  std::vector<Shard> train, val;

  std::int64_t token_bytes() const { return dtype == "uint16" ? 2 : 4; }
};

/// Writes `train` and `val` as shards of at most `shard_tokens` tokens each and index.json into
/// `dir` (created if missing), and returns the index written. The dtype is uint16 when
/// vocab_size <= 65536, else uint32. Throws std::invalid_argument if vocab_size < 1,
/// shard_tokens < 1, train is empty or an id is outside [0, vocab_size) (naming the split and
/// position); std::runtime_error naming the file when one cannot be written.
TokenShardIndex write_token_shards(const std::string& dir, std::span<const std::int32_t> train,
                                   std::span<const std::int32_t> val, std::int64_t vocab_size,
                                   const std::string& tokenizer, std::int64_t shard_tokens);

/// Reads `dir`/index.json. Throws std::runtime_error naming the file and what is wrong: missing,
/// not JSON, another format or version, a missing or mistyped key, a dtype other than uint16 /
/// uint32 or one too narrow for vocab_size.
TokenShardIndex read_token_index(const std::string& dir);

/// One split of a shard directory, memory-mapped (read-only, shared).
class TokenShards {
 public:
  /// Maps the shards of `split` ("train" or "val"). Throws std::runtime_error naming the file:
  /// what read_token_index() refuses, a shard missing or whose size is not its token count times
  /// the dtype's width; std::invalid_argument for another split or one with no tokens.
  static std::shared_ptr<const TokenShards> open(const std::string& dir, const std::string& split);

  ~TokenShards();
  TokenShards(const TokenShards&) = delete;
  TokenShards& operator=(const TokenShards&) = delete;

  const TokenShardIndex& index() const { return index_; }
  std::int64_t vocab_size() const { return index_.vocab_size; }
  /// Tokens in the split.
  std::int64_t size() const { return total_; }
  /// "<dir>/<split>" for messages.
  const std::string& name() const { return name_; }

  /// Tokens [offset, offset + n) of the split as int32 into out[0, n), across shard boundaries.
  /// Throws std::out_of_range if the range leaves the split, std::runtime_error naming the
  /// shard and position of an id >= vocab_size (a corrupt or mismatched shard).
  void copy(std::int64_t offset, std::int64_t n, std::int32_t* out) const;
  /// Asks the kernel to start reading tokens [offset, offset + n) in (madvise MADV_WILLNEED):
  /// read-ahead for windows about to be served. Out-of-range parts are ignored.
  void prefetch(std::int64_t offset, std::int64_t n) const;

 private:
  struct Mapped {
    std::string path;
    const unsigned char* data = nullptr;
    std::size_t bytes = 0;
    std::int64_t first = 0;  // the split's position of its first token
    std::int64_t tokens = 0;
  };
  TokenShards() = default;

  TokenShardIndex index_;
  std::string name_;
  std::vector<Mapped> shards_;
  std::int64_t total_ = 0;
};

/// A source kernel of token windows, as text_source() serves characters: row i of step s's
/// global batch is the window starting at window_starts(seed, s, ...)[i], uniform in
/// [0, size - seq - 1]: tokens = ids[o, o + seq), targets = ids[o + 1, o + seq + 1). Piece
/// k = s * M + j takes rows [j * batch / M, (j + 1) * batch / M) of step s. The kernel is a pure
/// function of its piece, so a job resumed at step k (TrainConfig::first_step numbers the pieces
/// as the uninterrupted run did) serves exactly the batches that run would have. After serving a
/// piece it prefetches the windows of the same piece of the next step (read-ahead).
///
/// Outputs: tokens i32 [batch / M, seq] and targets i32 [batch / M * seq]. Throws
/// std::invalid_argument at once if shards is null, batch, microbatches or seq < 1,
/// batch % microbatches != 0, or the split is shorter than seq + 1 tokens.
KernelFactory token_source(std::shared_ptr<const TokenShards> shards, std::int64_t batch,
                           std::int64_t microbatches, std::int64_t seq, std::uint64_t seed);

}  // namespace baton::data
