#pragma once
// The decode step cut into pipeline stages (DESIGN.md 7b, pp): stage s runs layers [begin, end)
// of the model (decode_models.h: stage_layers) with the KV caches of those layers only, so a
// model too big for one device's memory is served by several. The batch of a step is the piece
// that streams through the stages: the first stage embeds the step's tokens, each stage hands
// its rows' hidden state to the next, the last returns the logits of the rows drawn from.
//
//   LocalPipeline: every stage in this process, one after another (the cut without the ranks:
//                  the same arithmetic as one stage, which the tests check).
//   RankPipeline:  rank 0 of a job (baton-launch, Slurm): stage 0 here, the other stages on the
//                  other ranks; the step's rows and hidden state travel over the job's data plane
//                  (UCX), the logits come back from the last stage. Ranks 1.. run serve_stage().
//
// Tensor parallelism (--tp) cuts each stage's heads and MLP width over tp ranks (Megatron's cut:
// decode_models.h, StepShape::tp); a stage's ranks add their row-parallel partial sums with each
// other after each attention and MLP (TpGroup). A job has pp x tp ranks: rank s * tp + t runs
// shard t of stage s; rank 0 (stage 0, shard 0) runs the engine and the HTTP front end.
//
// A step is synchronous: rank 0 sends the next step once the last one's logits are back (each
// step's rows depend on the tokens the step before drew). What a pipeline of ranks buys today is
// memory (each rank holds 1/pp of the weights and of the cache), not speed; overlapping steps
// needs the batch split into pp groups in flight at once (vLLM's "virtual engines"), not built.
//
// Wire (StageLink): a message {kind, seq, bytes} and the packet as a payload the receiver pulls.
// A step's packet carries the seconds each stage before took; the logits come back with every
// stage's (the dashboard's per-stage utilisation).
// A rank that dies or fails ends the job through the control plane (the caller's on_abort calls
// StageLink::abort); a step's answer that does not come within the step timeout fails the engine
// and the job with the reason.
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "baton/graph/program.h"
#include "baton/transport/link.h"
#include "decode_models.h"

namespace baton::serve {

/// What every stage compiles for: the same on every rank (its hash is the job's plan hash).
struct ServeShape {
  std::int64_t slots = 1;            // requests in a batch at most
  std::int64_t blocks_per_slot = 1;  // a request's cache blocks at most (its whole context)
  std::int64_t block_size = 16;
  std::int64_t cache_blocks = 1;      // the cache's blocks (the same block ids on every stage)
  std::vector<std::int64_t> buckets;  // the step programs' rows: 2, 4, ..., max_batch_tokens
  /// Where each stage's step programs and KV caches live (baton-serve --device): a CPU by
  /// default, a CUDA GPU, or a sim device (tests). Not part of hash(): ranks of one job may use
  /// different GPUs of their hosts.
  Device device{};
  /// On a device: each step program captured into a graph at its second run and launched as one
  /// from then on (Program::use_graphs; baton-serve --no-graphs turns it off).
  bool graphs = true;
  std::uint64_t hash(const DecodeModel& m, std::int64_t pp, std::int64_t tp) const;
};

/// The shape for a server of these limits whose devices each hold the caches of `cache_layers`
/// layers (of 1/tp of the kv heads) in `kv_cache_bytes`. Throws std::invalid_argument (naming the
/// flag) for limits that do not go together or a cache too small for one request of the whole
/// context.
ServeShape serve_shape(const DecodeModel& m, std::int64_t max_batch, std::int64_t max_batch_tokens,
                       std::int64_t block_size, std::int64_t kv_cache_bytes, std::int64_t cache_layers,
                       std::int64_t tp = 1);

/// One step's rows, as the engine lays them out for bucket `rows` (padding rows: slot -1).
struct StepRows {
  std::int64_t rows = 0;
  std::vector<std::int32_t> tokens, positions, slots, table, sample_rows;  // table: [slots, blocks_per_slot]
};

/// The weights a stage reads, taken from `all` (one device's whole weights): shared where whole,
/// shard `tp_rank` of `tp` cut out of them where the stage splits them (columns or rows; GPT-2's
/// packed q, k, v by each of the three). A rank keeps no others. Throws std::invalid_argument
/// for a weight missing or of another shape.
std::shared_ptr<ParameterStore> stage_weights(const DecodeModel& m, std::pair<std::int64_t, std::int64_t> layers,
                                              const ParameterStore& all, std::int64_t tp = 1,
                                              std::int64_t tp_rank = 0);

/// Whether `params` hold every weight of the model's decode step in its shape and dtype: "" if
/// they do, else what is wrong ("lack 'h0.attn.wq'", "'wte' is f32[64, 32], the model's ...").
std::string check_weights(const DecodeModel& m, const ParameterStore& params);

class StageLink;

/// The ranks of one stage's tensor-parallel shards: adds their partial sums (the serve.tp_sum
/// op's kernel calls all_reduce on the thread that runs the stage). Every rank sends its part to
/// every other and adds all of them in shard order, so every rank gets the same bits.
class TpGroup {
 public:
  /// `members`: the group's ranks in shard order; `me`: this rank's index among them. A part
  /// that does not come within `timeout` fails the step.
  TpGroup(StageLink& link, std::vector<std::uint32_t> members, std::size_t me, std::chrono::milliseconds timeout);
  /// The group of shard `shard` of stage `stage` in a job of tp shards a stage (ranks stage * tp
  /// .. stage * tp + tp - 1).
  static std::unique_ptr<TpGroup> of_stage(StageLink& link, std::int64_t stage, std::int64_t shard, std::int64_t tp,
                                           std::chrono::milliseconds timeout);
  void all_reduce(Tensor& t);
  std::size_t size() const { return members_.size(); }

 private:
  StageLink& link_;
  std::vector<std::uint32_t> members_;
  std::size_t me_;
  std::chrono::milliseconds timeout_;
  std::uint64_t round_ = 0;
  std::vector<std::byte> sent_[2];  // a part in flight: two rounds' (a peer may not have taken the last yet)
  std::vector<double> sum_;
};

/// One stage's step programs (one per bucket) and the KV caches of its layers.
class Stage {
 public:
  /// Throws std::invalid_argument when the weights do not fit the model. With tp > 1, `group`
  /// is the stage's shards (it must outlive the stage).
  Stage(const DecodeModel& m, std::pair<std::int64_t, std::int64_t> layers, const ServeShape& shape,
        std::shared_ptr<const ParameterStore> params, std::int64_t tp = 1, std::int64_t tp_rank = 0,
        TpGroup* group = nullptr);
  /// Runs the bucket of rows.rows; `hidden` is what the stage before returned ([rows, width] of
  /// the model's dtype; null for the first stage). Returns the stage's output (hidden state, or
  /// the logits [min(rows, slots), vocab] on the last), valid until the next run.
  const Tensor& run(const StepRows& rows, const void* hidden, std::size_t hidden_bytes);
  void set_params(std::shared_ptr<const ParameterStore> params);
  bool first() const { return layers_.first == 0; }
  bool last() const { return layers_.second == model_.layers(); }
  std::size_t buffer_bytes() const { return buffer_bytes_; }
  std::size_t cache_bytes() const { return cache_bytes_; }
  /// How long the last run() took.
  double last_seconds() const { return last_seconds_; }

 private:
  struct Bucket {
    std::int64_t rows = 0;
    std::unique_ptr<Graph> graph;
    std::unique_ptr<Program> program;
  };
  DecodeModel model_;
  std::pair<std::int64_t, std::int64_t> layers_;
  TpGroup* group_ = nullptr;
  std::unique_ptr<Allocator> cache_memory_;  // the caches' device memory (null: host); outlives them
  std::vector<Tensor> caches_;
  std::vector<Bucket> buckets_;
  std::size_t buffer_bytes_ = 0, cache_bytes_ = 0;
  double last_seconds_ = 0;
};

/// Runs steps through every stage: what the engine drives. A step is launched (what runs in this
/// process runs, the rest is sent on) and later collected (its logits [min(rows, slots), vocab]),
/// first launched first collected; up to groups() steps may be in flight at once, so the stages
/// of a pipeline across ranks work on different steps at the same time.
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  virtual void launch(const StepRows& rows) = 0;
  /// The oldest launched step's logits, valid until the next collect() or launch().
  virtual const Tensor& collect() = 0;
  /// Steps in flight at most: the stages that can work at once (1 in one process).
  virtual std::int64_t groups() const { return 1; }
  /// New weights for every stage (throws std::invalid_argument if they do not fit: the old stay).
  virtual void set_params(std::shared_ptr<const ParameterStore> params) = 0;
  /// Why this runner cannot take new weights ("": it can).
  virtual std::string swap_refused() const { return {}; }
  /// The steps' buffers and the KV caches in this process.
  virtual std::size_t buffer_bytes() const = 0;
  virtual std::size_t cache_bytes() const = 0;
  /// "1 stage", "2 stages in this process", "2 stages on 2 ranks".
  virtual std::string describe() const = 0;
  /// Seconds each stage (its shard 0) has spent in its part of the collected steps.
  virtual std::vector<double> stage_busy_seconds() const = 0;
};

class LocalPipeline final : public StepRunner {
 public:
  LocalPipeline(const DecodeModel& m, std::int64_t pp, const ServeShape& shape,
                std::shared_ptr<const ParameterStore> params);
  void launch(const StepRows& rows) override;
  const Tensor& collect() override;
  void set_params(std::shared_ptr<const ParameterStore> params) override;
  std::size_t buffer_bytes() const override;
  std::size_t cache_bytes() const override;
  std::string describe() const override;
  std::vector<double> stage_busy_seconds() const override { return busy_; }

 private:
  std::vector<std::unique_ptr<Stage>> stages_;
  const Tensor* out_ = nullptr;
  std::vector<double> busy_;
};

/// The stages' messages over a transport::Link (the job's data plane, or a LoopbackHub's link in
/// tests). Thread-safe; one StageLink per link (it is the link's handler).
class StageLink final : public transport::LinkHandler {
 public:
  enum Kind : std::uint32_t { step = 1, logits = 2, stop = 3, partial = 4 };
  struct Packet {
    std::uint32_t from = 0;
    Kind kind = step;
    std::uint64_t seq = 0;
    std::vector<std::byte> bytes;
  };
  explicit StageLink(transport::Link& link);
  /// Sends `bytes` to rank `to`; they must stay valid and unchanged until the peer has them (the
  /// pipeline's own order says so: see pipeline.h).
  void send(std::uint32_t to, Kind kind, std::uint64_t seq, const std::vector<std::byte>& bytes);
  /// The next packet, waiting until `deadline`. Throws transport::TransportError once the link
  /// failed or abort() was called (with the reason), or at the deadline (saying what was awaited).
  /// The first packet `wanted` accepts (the others stay, in order, for later receives).
  Packet receive(const std::function<bool(const Packet&)>& wanted, std::chrono::steady_clock::time_point deadline,
                 const std::string& awaiting);
  /// Ends every wait with this reason (the first one wins).
  void abort(const std::string& reason);
  std::string failure() const;

  void on_message(std::uint32_t from_rank, const void* data, std::size_t size) override;
  void on_payload(std::uint64_t cookie) override;
  void on_link_error(const std::string& reason) override;

 private:
  transport::Link& link_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Packet> inbox_;
  std::map<std::uint64_t, Packet> pending_;  // receives in flight, by cookie
  std::uint64_t next_cookie_ = 1;
  std::string failure_;
};

/// Rank 0's runner: shard 0 of stage 0 in this process, shard t of stage s on rank s * tp + t.
/// pp steps in flight at once (the engine's groups of requests): while a later stage works on
/// one group's step, the stages before work on the next group's.
class RankPipeline final : public StepRunner {
 public:
  /// `stage`: this rank's (the first); the logits come from the last stage within
  /// `step_timeout` of a step's start, or the step fails.
  RankPipeline(std::unique_ptr<Stage> stage, std::int64_t pp, std::int64_t tp, StageLink& link, const DecodeModel& m,
               std::int64_t samples, std::chrono::milliseconds step_timeout);
  void launch(const StepRows& rows) override;
  const Tensor& collect() override;
  std::int64_t groups() const override { return pp_; }
  void set_params(std::shared_ptr<const ParameterStore> params) override;
  std::string swap_refused() const override;
  std::size_t buffer_bytes() const override { return stage_->buffer_bytes(); }
  std::size_t cache_bytes() const override { return stage_->cache_bytes(); }
  std::string describe() const override;
  std::vector<double> stage_busy_seconds() const override { return busy_; }
 private:
  std::unique_ptr<Stage> stage_;
  std::int64_t pp_, tp_;
  StageLink& link_;
  DecodeModel model_;
  std::int64_t samples_;
  std::chrono::milliseconds step_timeout_;
  std::uint64_t seq_ = 0;
  struct Flight {
    std::uint64_t seq;
    std::int64_t samples;
    std::chrono::steady_clock::time_point deadline;
    double first_seconds;  // stage 0's time in it (here)
  };
  std::deque<Flight> flights_;
  // A step's packets until the next stage has pulled them: one pair per step in flight (the
  // step launched pp steps later reuses them, after this one's logits came back).
  std::vector<std::vector<std::byte>> step_out_, hidden_out_;
  Tensor logits_;
  const Tensor* local_ = nullptr;  // pp 1: the logits computed here
  std::vector<double> busy_;       // by stage
};

/// Rank 0, after the last step: tells ranks 1..world-1 to stop (their serve_stage returns).
/// Best effort: a link that failed already sends nothing (the control plane ends those ranks).
void stop_stages(StageLink& link, std::int64_t world_size);

/// Ranks 1..pp*tp-1 (shard rank % tp of stage rank / tp): receive each step (up to pp in flight)
/// from the stage before (stage 0's shards: from rank 0), run this rank's stage with its shards, send it on
/// (the last stage's shard 0: the logits to rank 0). Returns when rank 0 says stop; throws
/// transport::TransportError when the link fails or is aborted, and what a stage throws.
void serve_stage(Stage& stage, StageLink& link, std::uint32_t rank, std::int64_t pp, std::int64_t tp);

}  // namespace baton::serve
