#pragma once
/// Checkpoints of a training job and resuming from them: every trained weight and its optimizer
/// state (safetensors.h, so PyTorch and others read them), the step, the job's layout and
/// settings, in a directory of one subdirectory per step.
///
///   D/step-00000010/index.json            step, layout (dp, pp, tp, ranks), optimizer, the
///                                         job's settings, data position, RNG, the files
///   D/step-00000010/rank0.safetensors     the weights rank 0 trains ("fc0.w") and their
///                                         optimizer slots ("fc0.w#exp_avg", torch.optim's names)
///   D/step-00000010/rank1.safetensors     ... one file per rank that trains weights
///
/// Under ZeRO each replica's optimizer holds a window of its bucket's weights and their slots,
/// so each rank saves its windows: the weights they hold whole, and the weights that straddle
/// a window's edge as pieces ("fc0.w@0:96", elements [0, 96) of the flattened weight, 1-D, and
/// "fc0.w@0:96#exp_avg"), listed under "pieces" in the index. load() puts the pieces back
/// together, so a checkpoint resumes under any dp, pp, number of ranks or ZeRO stage.
///
/// How a consistent snapshot is taken without stopping the stream: each of replica 0's variable
/// actors copies its weight and slots right after it applies a checkpoint step's update
/// (TrainConfig::on_snapshot). That state is exactly what the next step starts from, whatever
/// the other actors are busy with, so the copies form one consistent state although they are
/// taken at different moments. A Writer gathers a rank's copies of a step and hands them to its
/// own thread, which writes the file while training goes on (disk I/O overlaps compute, as the
/// design asks of data movement); at most `max_queued` steps wait, then the actors wait for the
/// disk. Data order, text windows and dropout are functions of
/// (seed, step, piece), so the step number is the data position and the RNG state: a resumed
/// job numbers its pieces from there (TrainConfig::first_step) and draws what the
/// uninterrupted run would have. On the CPU a resumed run repeats that run's losses and weights
/// bit for bit.
///
/// Crash safety: a one-rank job writes D/step-N.tmp-<pid>/ and renames it to D/step-N when every
/// file is written and fsynced; in a job of several ranks each rank renames its file into
/// D/step-N/ and the index lists the files a complete checkpoint has. find() takes only complete
/// checkpoints (and ignores *.tmp-* leftovers), load() checks every byte (a CRC-32 per file).
///
///   auto writer = std::make_shared<checkpoint::Writer>(settings);
///   cfg.snapshot_every = 100;
///   cfg.on_snapshot = writer->hook();
///   TrainingJob job = compile_training(g, loss, cfg);
///   writer->expect(job.snapshots);
///   ... run the job ...
///   writer->finish();   // the last checkpoint is on disk (or its error thrown)
///
///   checkpoint::Checkpoint c = checkpoint::load(checkpoint::find(dir).dir);
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "baton/graph/compile.h"

namespace baton::checkpoint {

/// How the job's places are laid out. Weights are saved and found by name, so a job may resume
/// with another dp, pp or number of ranks; tp names the shards' weights differently
/// ("fc0.w.tp1"), so it must match (a model mismatch otherwise).
struct Layout {
  int dp = 1, pp = 1, tp = 1, ranks = 1;
  friend bool operator==(const Layout&, const Layout&) = default;
};

struct Settings {
  std::filesystem::path dir;
  /// Checkpoints kept: the newest `keep` complete ones (>= 1); older ones are removed.
  int keep = 2;
  std::uint32_t rank = 0;
  Layout layout;
  OptimizerConfig optimizer;
  /// What the job is (model, data, seed, batch, ...), as strings: recorded in the index, and
  /// compared on resume by the caller (mismatches()).
  std::map<std::string, std::string> config;
  /// Global batch per step and the seed, for the index's data position and RNG record.
  std::int64_t batch = 0;
  std::uint64_t seed = 0;
  /// Steps that may wait for the writing thread before take() blocks (each holds a copy of
  /// the rank's weights and optimizer state), and how long it blocks before failing the job.
  int max_queued = 2;
  std::chrono::seconds disk_timeout{600};
  /// Files every step directory carries beside the weights (format version 2), by plain name:
  /// what turns the model's ids into text, so that the checkpoint is served on its own
  /// (baton-serve): a tokenizer's .model file. Written by the rank that writes the index, listed
  /// in it with their sizes and CRC-32s, and checked by load().
  std::map<std::string, std::string> assets;
};

/// Gathers the snapshots of the variables this rank trains and writes a checkpoint of each
/// step once all of them are in, on a thread of its own. Thread-safe: variable actors on any
/// worker call take().
class Writer : public std::enable_shared_from_this<Writer> {
 public:
  explicit Writer(Settings settings);
  /// Finishes what is queued (errors are dropped here: call finish() to see them).
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  /// After compile_training: what each checkpoint step's snapshots are and where each is taken
  /// (TrainingJob::snapshots). This rank writes those taken on it; the index lists them all.
  void expect(const std::vector<SnapshotPart>& parts);
  /// For TrainConfig::on_snapshot (holds this writer alive).
  std::function<void(VariableSnapshot)> hook();
  /// One variable's state after a step. Throws (failing the job, on that actor) if an earlier
  /// checkpoint could not be written, if the disk keeps the queue full past disk_timeout, or
  /// for a variable expect() did not name.
  void take(VariableSnapshot snapshot);
  /// Waits until every complete step handed over is on disk; throws the first writing error
  /// ("<file>: <what>"). Call it after the job has run.
  void finish();
  /// The step directories this rank has finished, oldest first.
  std::vector<std::filesystem::path> written() const;

 private:
  void write_step(std::int64_t step, std::vector<VariableSnapshot> snapshots);
  void writer_loop();

  Settings settings_;
  std::vector<SnapshotPart> parts_;
  std::map<std::string, std::uint32_t> rank_of_;  // a part's tensor name -> its rank
  std::size_t mine_ = 0;                          // parts this rank snapshots
  bool index_writer_ = false;
  mutable std::mutex mutex_;
  std::map<std::int64_t, std::vector<VariableSnapshot>> pending_;
  std::vector<std::filesystem::path> written_;
  std::deque<std::pair<std::int64_t, std::vector<VariableSnapshot>>> queue_;
  bool writing_ = false;  // the thread is writing a step it took from the queue
  bool stopping_ = false;
  std::exception_ptr error_;
  std::condition_variable changed_;
  std::thread thread_;  // last: started once the rest is built, joined first
};

/// The directory of step `step` under `dir`: dir/step-00000010.
std::filesystem::path step_dir(const std::filesystem::path& dir, std::int64_t step);

struct Found {
  std::filesystem::path dir;
  /// Newer step directories passed over, each with why (incomplete: a crash while writing).
  std::vector<std::string> skipped;
};

/// The newest complete checkpoint under `dir`, or `dir` itself if it is a step directory (has
/// an index.json). Throws std::runtime_error naming `dir` if there is none.
Found find(const std::filesystem::path& dir);

/// A loaded checkpoint.
struct Checkpoint {
  std::filesystem::path dir;
  std::int64_t step = 0;
  Layout layout;
  std::string optimizer;  // name(OptimizerConfig::Kind)
  std::map<std::string, std::string> config;
  std::map<std::string, Tensor> weights;
  OptimizerState slots;
  /// Settings::assets of the writer, by name: their paths in `dir` (none in a version 1
  /// checkpoint).
  std::map<std::string, std::filesystem::path> assets;
};

/// Reads a step directory and checks it whole: the index, every file it lists (safetensors.h
/// checks, the CRC-32, the step and rank in each file's metadata), every variable's weight and
/// optimizer slots present. Throws std::runtime_error "<file>: <what is wrong>".
Checkpoint load(const std::filesystem::path& step_dir);

/// Before restore(), where the checkpoint was written under another tensor-parallel layout: each
/// split weight saved as parts "NAME.tp<k>" (or whole as "NAME") is joined along the axis its
/// parts were cut on and cut again as `params` holds it, and so are its optimizer slots; weights
/// whose names `params` has as they are stay as they are. The values are only moved, never
/// computed. Returns one line per weight so resharded ("h0.attn.q: 2 parts -> 4"). Throws
/// std::runtime_error naming the index and the weight where the parts do not make one tensor
/// that the model's parts divide.
std::vector<std::string> reshard(Checkpoint& c, const ParameterStore& params);

/// Before compile_training: puts a checkpoint's weights into `params` (the model's store),
/// checking that the model has each of them with the same shape and dtype and that it was
/// written with the same optimizer. Throws std::runtime_error naming the checkpoint's index.
void restore(const Checkpoint& c, ParameterStore& params, const OptimizerConfig& optimizer);

/// After compile_training: checks that every variable the job trains (TrainingJob::trained)
/// is in the checkpoint. Throws std::runtime_error naming the index and the variable.
void check_covers(const Checkpoint& c, const std::map<std::string, Placement>& trained);

/// The settings of `c.config` that differ from `config` ("seed: checkpoint 1, this run 2"),
/// over the keys of `keys`.
std::vector<std::string> mismatches(const Checkpoint& c, const std::map<std::string, std::string>& config,
                                    const std::vector<std::string>& keys);

}  // namespace baton::checkpoint
