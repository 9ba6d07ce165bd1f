#pragma once
/// The compiler: a graph becomes a plan of actors for one device. One actor per op; a variable
/// actor per weight that applies its optimizer; repeat actors so the M micro-batches of a step
/// read one weight; accumulate actors so their M gradients sum into one; the register slot
/// counts chosen here. A step of M micro-batches is exactly synchronous SGD over the whole batch.
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "baton/actors/plan.h"
#include "baton/graph/graph.h"
#include "baton/kernels/kernel.h"

namespace baton {

/// How weights are updated; see torch.optim for the meaning of each field.
struct OptimizerConfig {
  enum class Kind : std::uint8_t { sgd, adam, adamw };
  Kind kind = Kind::sgd;
  double lr = 0.01;
  double momentum = 0.0;  // sgd
  bool nesterov = false;  // sgd
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam, adamw
  double weight_decay = 0.0;
  /// Learning-rate schedule: linear warm-up over `warmup_steps`, then (if `cosine`) a cosine
  /// decay to min_lr_ratio * lr at the last step.
  std::int64_t warmup_steps = 0;
  bool cosine = false;
  double min_lr_ratio = 0.0;
  /// Clip gradients by their global norm (over every weight) when > 0.
  double clip_norm = 0.0;
};

namespace optim {
OptimizerConfig sgd(double lr, double momentum = 0.0, double weight_decay = 0.0);
OptimizerConfig adam(double lr, double weight_decay = 0.0);
OptimizerConfig adamw(double lr, double weight_decay = 0.01);
}  // namespace optim

/// The learning rate of optimizer step `step` (1-based) of `total_steps`: the warm-up and the
/// cosine decay applied, as the variable actors apply them (for progress displays).
double learning_rate(const OptimizerConfig& cfg, std::int64_t step, std::int64_t total_steps);

/// Every weight's value, by variable name. The compiled plan's variable actors read their
/// initial values here and write the trained ones back, so after Runtime::run() this holds the
/// result (and evaluate() reads it).
class ParameterStore {
 public:
  /// Initial values from each variable's initializer, seeded by the graph's seed and the name.
  static std::shared_ptr<ParameterStore> initialize(Graph& g);
  Tensor& at(const std::string& name);
  const Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const { return values_.count(name) != 0; }
  void set(const std::string& name, Tensor t) { values_[name] = std::move(t); }
  const std::map<std::string, Tensor>& values() const { return values_; }

 private:
  std::map<std::string, Tensor> values_;
};

/// Losses as the loss actor reports them (any thread may read while the job runs).
class LossLog {
 public:
  explicit LossLog(std::int64_t microbatches) : microbatches_(microbatches) {}
  void record(std::int64_t piece, double value);
  /// Steps whose every micro-batch has reported.
  std::int64_t steps_done() const { return steps_done_.load(std::memory_order_acquire); }
  /// Mean loss of each finished step (the mean over its micro-batches).
  std::vector<double> per_step() const;

 private:
  std::int64_t microbatches_;
  mutable std::mutex mutex_;
  std::vector<double> sums_;
  std::vector<std::int64_t> counts_;
  std::atomic<std::int64_t> steps_done_{0};
};

/// A source of micro-batches for some of the graph's inputs: a kernel (e.g. from
/// baton::data::batch_source) whose outputs feed `inputs`, in order.
struct DataBinding {
  std::string name;
  KernelFactory source;
  std::vector<std::string> inputs;
};

struct TrainConfig {
  std::int64_t steps = 1;
  std::int64_t microbatches = 1;
  OptimizerConfig optimizer{};
  std::vector<DataBinding> data;
  /// Worker threads: 1 puts every actor on one; 2 puts the forward pass (and data) on one and
  /// the backward pass and optimizers on the other, so micro-batches pipeline.
  int threads = 1;
  /// Slots of an activation register (how far forward may run ahead of backward).
  std::int32_t activation_slots = 2;
  /// Data parallelism: `dp` replicas of the whole model. Each step has dp x microbatches
  /// micro-batches; replica r trains on micro-batches r*M .. r*M+M-1 of them (its data source
  /// reads those pieces of the DataBinding), so the graph's input shapes are one micro-batch.
  /// Every replica's summed gradient is all-reduced (actors: split, sum by the owner of each
  /// chunk, concat) before each replica applies the same update to its own copy of the
  /// weights: the result equals one replica training on all dp x M micro-batches. The loss is
  /// all-reduced the same way and reported once. `params` ends up holding replica 0's weights.
  int dp = 1;
  /// dp > 1: gradients are all-reduced in buckets of up to this many bytes, as DDP does (its
  /// default, 25 MB): one all-reduce per bucket instead of one per weight. 0: one per weight,
  /// each as soon as it is summed.
  std::int64_t bucket_bytes = 25 << 20;
  /// Pipeline parallelism: the forward ops cut into `pp` stages of about equal estimated cost
  /// (multiply-adds), each backward op on the stage of the forward op it differentiates (so a
  /// weight's gradient is made where the weight lives), each stage on its own device. The M
  /// micro-batches of a step flow through the stages. The schedule (schedule.h) is each stage's
  /// order of forward and backward passes, which the plan fixes (ActOrder lanes), and the depth
  /// of its activation registers: "gpipe" runs every forward, then every backward, with M slots;
  /// "1f1b" runs min(pp - s - 1, M) warm-up forwards, then one forward and one backward in turn,
  /// with pp - s slots on stage s. One weight version per step, as without stages.
  int pp = 1;
  std::string schedule = "1f1b";
  /// How the forward ops are cut into stages of equal cost: "flops" estimates each op (the
  /// multiply-adds of a matrix product, the output elements of the rest); "profile" times each
  /// op's kernel on its real shapes first, and those of its backward step (profile.h; tens of
  /// milliseconds for a small model), and refuses a job over several ranks, whose plans must
  /// match.
  std::string balance = "flops";
  /// Tensor parallelism: the model itself says which nodes belong to which of `tp` shards
  /// (Graph::shard scopes, written by hand or by shard_graph() from SBP annotations, sharding.h;
  /// models::mlp splits each pair of layers Megatron's way: the first by columns, the second by
  /// rows, their partial products summed once); each shard of each stage gets its own device,
  /// and backward ops go with the shard of what they differentiate.
  int tp = 1;
  /// Where each (replica, stage, shard) runs (rank, device; streams are chosen by `threads`):
  /// replica r's stage s, shard k at (r * pp + s) * tp + k. Empty: the in-process device with
  /// that index on rank 0.
  std::vector<Placement> replica_places;
};

/// What the runtime needs to train: the plan, the kernels it names (the built-in ops plus this
/// job's data, variable and loss kernels) and where results land.
struct TrainingJob {
  Plan plan;
  KernelRegistry kernels;
  std::shared_ptr<ParameterStore> params;
  std::shared_ptr<LossLog> losses;
};

/// Compiles the training of `loss` (a scalar) over every trainable variable it depends on.
/// `params` defaults to a fresh ParameterStore::initialize(g). Throws GraphError for a bad graph
/// (an input no DataBinding feeds, shapes that do not match, ...).
TrainingJob compile_training(Graph& g, Value loss, const TrainConfig& cfg,
                             std::shared_ptr<ParameterStore> params = nullptr);

/// Runs the graph once (no training) on the given inputs with the weights in `params` and
/// returns the fetched values. For evaluation and for tests.
std::vector<Tensor> evaluate(Graph& g, const std::map<std::string, Tensor>& feeds,
                             const std::vector<Value>& fetches, const ParameterStore& params);

}  // namespace baton
