#pragma once
/// Data sets and the source kernels that stream them as micro-batches: the 8x8 digits set
/// (a small real one), a learnable synthetic set for benchmarks, and character-level text.
///
///   auto all = baton::data::load_digits(baton::data::find_digits_file());
///   auto [train, heldout] = baton::data::split(all, 0.2, /*seed=*/1);
///   auto train_ptr = std::make_shared<const baton::data::Dataset>(std::move(train));
///   reg.add("digits", DeviceType::cpu, f32, baton::data::batch_source(train_ptr, 64, 4, 7));
///
/// Everything random here is a pure function of its seed and gives the same result on every
/// machine: the generator is std::mt19937_64 (whose output the standard fixes) and the draws
/// from it are our own (std::shuffle and the std distributions are implementation-defined).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "baton/kernels/kernel.h"
#include "baton/kernels/tensor.h"

namespace baton::data {

/// Labelled rows: features f32 [N, F], labels i32 [N] in [0, num_classes).
struct Dataset {
  std::string name;
  Tensor features;
  Tensor labels;
  std::int64_t num_classes = 0;

  std::int64_t rows() const { return features.defined() ? features.dim(0) : 0; }
  std::int64_t width() const { return features.defined() ? features.dim(1) : 0; }
};

/// The 8x8 digits set: sklearn's digits.csv.gz, 1,797 rows of 64 pixel values 0..16 then the
/// label 0..9, comma-separated, no header. Reads a plain .csv or a gzip-compressed one (told
/// apart by content, not by name). Features are scaled to [0, 1] (divided by 16); blank lines
/// are skipped. Throws std::runtime_error naming the file: missing, unreadable, empty or
/// truncated / corrupt gzip; and the line for malformed content (wrong column count, a value
/// that is not a number, a pixel outside 0..16, a label that is not an integer 0..9).
Dataset load_digits(const std::string& path);

/// Where the digits file is. If $BATON_DATA_DIR is set, $BATON_DATA_DIR/digits.csv.gz and
/// nowhere else; otherwise the first that exists of <directory of the running
/// executable>/../../data/digits.csv.gz (build/bin/x -> <repo>/data) and ./data/digits.csv.gz.
/// Throws std::runtime_error listing the places looked in and how to get the file
/// (scripts/run.sh build fetches it) when there is none.
std::string find_digits_file();

/// 0, 1, ..., n-1 shuffled by a Fisher-Yates driven by std::mt19937_64(seed) with an unbiased
/// bounded draw (rejection sampling): the shuffle split() and batch_source() use, identical on
/// every machine.
std::vector<std::int64_t> shuffled_indices(std::int64_t n, std::uint64_t seed);

/// Shuffles the rows with shuffled_indices(N, seed) and splits off the last
/// round(heldout_fraction * N) of them as the held-out set: returns {training, held-out}, named
/// "<name>/train" and "<name>/heldout". Throws std::invalid_argument unless 0 <= fraction <= 1.
std::pair<Dataset, Dataset> split(const Dataset& all, double heldout_fraction,
                                  std::uint64_t seed);

/// A learnable synthetic set for benchmarks and tests: features ~ N(0, 1) and labels = argmax
/// over classes of features x T, T [width, classes] a fixed random N(0, 1) teacher; both drawn
/// from `seed`, so a linear classifier can reach 100% accuracy. Throws std::invalid_argument
/// unless rows >= 1, width >= 1 and classes >= 2.
Dataset synthetic(std::int64_t rows, std::int64_t width, std::int64_t classes,
                  std::uint64_t seed);

/// A character-level corpus: vocab = the sorted distinct bytes of the file; ids = the file as
/// indices into vocab.
struct TextCorpus {
  std::string path;
  std::vector<unsigned char> vocab;
  std::vector<std::int32_t> ids;

  std::int64_t vocab_size() const { return static_cast<std::int64_t>(vocab.size()); }
  /// Entropy of the characters' frequencies, in nats: the loss a model that ignores context
  /// can reach at best (a character model should go below it).
  double unigram_entropy_nats() const;
};

/// Reads a text file as bytes. Throws std::runtime_error naming the file if it is missing,
/// unreadable, or shorter than 2 bytes (no next character to predict).
TextCorpus load_text(const std::string& path);

/// A source kernel streaming `data` in shuffled epochs.
///
/// The row stream is epoch 0's order, then epoch 1's, ... where epoch e's order is
/// shuffled_indices(N, seed + e). Step s's global batch is stream positions
/// [s * batch, (s + 1) * batch): a step may straddle an epoch boundary (its first rows end one
/// epoch, its last rows start the next), so every row appears exactly once per epoch and
/// nothing is dropped. Piece k = s * M + j is micro-batch j of step s: rows
/// [j * batch / M, (j + 1) * batch / M) of that global batch, so a step's global batch is the
/// same whatever M is. The kernel is a pure function of the piece.
///
/// Outputs: x [batch / M, F] (f32, or f64 for gradient checks) and y i32 [batch / M]. Throws
/// std::invalid_argument at once if data is null or empty, batch < 1, microbatches < 1 or
/// batch % microbatches != 0; the kernel throws if its outputs do not have those shapes or its
/// device is not the CPU.
KernelFactory batch_source(std::shared_ptr<const Dataset> data, std::int64_t batch,
                           std::int64_t microbatches, std::uint64_t seed);

/// The window starts of rows [first_row, first_row + rows) of step `step`'s global batch: each
/// drawn uniformly from [0, starts) by one std::mt19937_64 per step, seeded with (seed, step),
/// row by row from the step's first row, so a step's windows do not depend on how its batch is
/// cut into micro-batches. text_source() and the token shards' source (graph/tokens.h) draw
/// their windows here. Throws std::invalid_argument unless starts >= 1, first_row >= 0 and
/// rows >= 0.
std::vector<std::uint64_t> window_starts(std::uint64_t seed, std::int64_t step, std::int64_t first_row,
                                         std::int64_t rows, std::uint64_t starts);

/// A source kernel of character windows from `corpus`. Row i of step s's global batch is the
/// window starting at offset o(s, i), drawn uniformly from [0, n - seq - 1] by a generator
/// seeded with (seed, s): tokens = ids[o, o + seq) and targets = ids[o + 1, o + seq + 1) (the
/// next character of each token). Piece k = s * M + j takes rows [j * batch / M,
/// (j + 1) * batch / M) of step s, as batch_source() does.
///
/// Outputs: tokens i32 [batch / M, seq] and targets i32 [batch / M * seq]. Throws
/// std::invalid_argument at once if corpus is null, batch, microbatches or seq < 1,
/// batch % microbatches != 0, or the corpus is shorter than seq + 1 characters.
KernelFactory text_source(std::shared_ptr<const TextCorpus> corpus, std::int64_t batch,
                          std::int64_t microbatches, std::int64_t seq, std::uint64_t seed);

}  // namespace baton::data
