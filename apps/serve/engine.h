#pragma once
// baton-serve's engine: requests in, tokens out. Continuous batching (Yu et al., "Orca", 2022)
// over a decode step (decode_models.h) whose rows are tokens of many requests: between steps,
// requests join and leave the running batch; a step's rows are first every running request's
// next token, then prompt chunks with the rows left (chunked prefill), so a long prompt shares
// the step with the others' decoding instead of stalling it. The KV cache is paged (blocks of
// block_size positions), its size fixed at start-up; a request reserves the blocks its prompt
// plus max_tokens need when it joins the batch and waits until they are free (it never fails for
// want of memory later). The step runs through a StepRunner (pipeline.h): one stage or several
// (pp) in this process, or stages on the ranks of a job; each stage a Program (program.h) per
// row bucket (2, 4, 8, ... up to max_batch_tokens: a step of two rows does not pay for 256)
// sharing the stage's caches.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "baton/graph/program.h"
#include "codec.h"
#include "decode_models.h"
#include "pipeline.h"

namespace baton::serve {

struct EngineSettings {
  DecodeModel model;
  std::string model_id;                          // the API's model name
  std::shared_ptr<const ParameterStore> params;  // the weights (decode_step's names)
  std::string weights;                           // which they are, for the log and /healthz
  std::int64_t created = 0;                      // their time, seconds since the epoch
  std::shared_ptr<const Codec> codec;            // null: prompts are ids, text is " <id>" per token
  std::int64_t max_batch = 16;          // requests in the running batch at most
  std::int64_t max_batch_tokens = 256;  // rows of a step at most (decode tokens + prompt chunks)
  std::int64_t block_size = 16;         // positions per KV-cache block
  std::int64_t kv_cache_bytes = 256ll << 20;  // the caches of all layers, keys and values
  std::int64_t max_queue = 256;  // requests waiting at most; more: submit() answers queue_full
  /// False: static batching (a batch of requests is admitted only when the running batch is
  /// empty, and runs until its longest request ends): the benchmark's comparison.
  bool continuous = true;
  /// Pipeline stages in this process (LocalPipeline), when `runner` is unset.
  std::int64_t pp = 1;
  /// Where the step programs and the KV caches live (ServeShape::device), and whether they run as
  /// graphs there (ServeShape::graphs).
  Device device{};
  bool graphs = true;
  /// Layers whose caches one device holds within kv_cache_bytes (0: all of the model's; a stage
  /// of a pipeline across ranks holds its own).
  std::int64_t cache_layers = 0;
  /// Makes the step's runner for the shape the engine chose (a pipeline across ranks: rank 0's
  /// RankPipeline). Unset: LocalPipeline of `pp` stages.
  std::function<std::unique_ptr<StepRunner>(const ServeShape&)> runner;
  std::function<void(const std::string&)> log;
};

class Engine final : public Backend {
 public:
  /// Compiles the step programs and allocates the KV cache; throws std::invalid_argument when
  /// the cache cannot hold one request of the whole context, or the weights do not fit the
  /// model. Starts the engine's thread.
  explicit Engine(EngineSettings settings);
  ~Engine() override;

  ModelInfo info() const override;
  std::vector<std::int32_t> encode(const std::string& text) const override;
  std::string check(const Request& r) const override;
  Admission submit(Request r, std::uint64_t& id) override;
  void cancel(std::uint64_t id) override;
  Stats stats() const override;
  void drain(std::chrono::steady_clock::time_point deadline) override;
  std::string failure() const override;

  /// Drain-then-swap: admission pauses, the running requests finish with the old weights, the
  /// weights change, admission resumes (requests that arrived meanwhile wait in the queue and
  /// see the new ones). Returns once swapped, or throws std::invalid_argument (the weights do
  /// not fit the model; the old stay) or std::runtime_error at `deadline`.
  void swap_weights(std::shared_ptr<const ParameterStore> params, const std::string& label,
                    std::chrono::steady_clock::time_point deadline);

  /// The KV cache's capacity: blocks and tokens.
  std::int64_t cache_blocks() const { return shape_.cache_blocks; }
  std::int64_t cache_tokens() const { return shape_.cache_blocks * settings_.block_size; }
  const ServeShape& shape() const { return shape_; }

  /// Any thread: the engine fails for good with this reason (another rank of its pipeline
  /// failed): the waiting and running requests end with it (503), as does what comes later.
  void fail(const std::string& reason);

 private:
  struct Live;      // a request and its progress
  struct Launched;  // a step in flight

  void loop();
  bool admit_locked();
  void launch_step(std::vector<std::shared_ptr<Live>>& batch);
  void collect_step();
  void emit(Live& r, std::int32_t token);
  void finish(Live& r, Finish why, const std::string& error = {});
  void fail_all(const std::string& reason);
  std::int64_t blocks_for(const Live& r) const;

  EngineSettings settings_;
  ServeShape shape_;
  std::unique_ptr<StepRunner> runner_;
  StepRows rows_;  // the step's inputs, reused
  std::int64_t groups_ = 1;  // steps in flight at most (the runner's groups): the requests' groups
  std::int64_t next_group_ = 0;
  std::vector<Launched> in_flight_;  // oldest first; the engine thread's

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<Live>> waiting_;
  std::vector<std::shared_ptr<Live>> running_;
  std::map<std::uint64_t, std::shared_ptr<Live>> by_id_;
  std::vector<std::int32_t> free_blocks_;
  std::vector<std::int64_t> free_slots_;
  std::uint64_t next_id_ = 1;
  bool draining_ = false;
  bool stopping_ = false;
  std::shared_ptr<const ParameterStore> pending_params_;  // a swap waiting for the batch to empty
  std::string pending_label_;
  std::uint64_t swaps_ = 0;
  std::string weights_;
  std::string failure_;
  std::string failed_from_outside_;  // fail()'s reason, for the engine's thread
  std::int64_t steps_ = 0;
  double busy_seconds_ = 0;
  std::vector<double> stage_busy_;  // the runner's, copied under mutex_ after each step
  std::int64_t generated_ = 0, last_rows_ = 0;
  std::thread thread_;  // last
};

}  // namespace baton::serve
