#pragma once
/// The compiler: a graph becomes a plan of actors, through a pipeline of passes (passes.h). One
/// actor per op; a variable actor per weight that applies its optimizer; repeat actors so the M
/// micro-batches of a step read one weight; accumulate actors so their M gradients sum into one; the register slot
/// counts chosen here. A step of M micro-batches is exactly synchronous SGD over the whole batch.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
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

/// "sgd", "adam" or "adamw".
std::string_view name(OptimizerConfig::Kind kind);

/// The state the optimizer keeps per weight, by torch.optim's names: SGD with momentum keeps
/// "momentum_buffer"; Adam and AdamW keep "exp_avg" and "exp_avg_sq" (plain SGD: none). Their
/// step count, for Adam's bias correction and the learning-rate schedule, is the job's step.
std::vector<std::string> optimizer_slot_names(const OptimizerConfig& cfg);

/// Each trained weight's optimizer slots: variable name -> slot name -> tensor (the weight's
/// shape and dtype).
using OptimizerState = std::map<std::string, std::map<std::string, Tensor>>;

/// A trained weight as its variable actor hands it over after a checkpoint step's update
/// (TrainConfig::on_snapshot): copies of the weight and its optimizer slots, so the job runs on
/// while they are written. Under ZeRO an optimizer holds a window of its bucket's weights, so
/// a weight that straddles two replicas' windows comes as two pieces: elements [begin, end) of
/// the flattened weight, as 1-D tensors (end -1: the whole weight, in its own shape).
struct VariableSnapshot {
  std::string name;
  std::int64_t step = 0;
  Tensor weight;
  std::map<std::string, Tensor> slots;
  std::int64_t begin = 0, end = -1;
};

/// What one snapshot holds (TrainingJob::snapshots): a whole weight (end -1) or elements
/// [begin, end) of it, and the rank whose actor takes it (and whose checkpoint file holds it).
struct SnapshotPart {
  std::string name;
  std::int64_t begin = 0, end = -1;
  Shape shape;  // the whole weight's
  DType dtype = DType::f32;
  std::uint32_t rank = 0;
  bool whole() const { return end < 0; }
};

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
  /// Each variable's shape and dtype without memory or values (Tensor::unallocated): for a plan
  /// compiled only to be simulated (TrainConfig::plan_only).
  static std::shared_ptr<ParameterStore> shapes(Graph& g);
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
  /// When the first `steps` steps had all reported (steady clock, taken as the last loss of
  /// step `steps` - 1 was recorded), if they have; steps <= 0: nothing. A benchmark times steps
  /// by these, not by polling steps_done().
  std::optional<std::chrono::steady_clock::time_point> when_done(std::int64_t steps) const;

 private:
  std::int64_t microbatches_;
  mutable std::mutex mutex_;
  std::vector<double> sums_;
  std::vector<std::int64_t> counts_;
  std::vector<std::chrono::steady_clock::time_point> done_at_;  // by step
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
  /// How dp > 1 all-reduces the gradient buckets: "actors" (the ring of add actors,
  /// collectives.h; any devices, through host memory between ranks), "nccl" (one NCCL
  /// all-reduce actor per replica, on a stream of its own, the buckets in one fixed order on
  /// every rank; every replica's place must be a CUDA device, each on its own GPU) or "auto":
  /// NCCL where every member is on a CUDA device and baton has NCCL, else actors. The loss's
  /// all-reduce (a scalar per micro-batch) is always made of actors. Also how tp > 1 sums its
  /// shards' partial products (passes.h: tp_collectives): "actors" a chain of adds, "auto" NCCL
  /// where every shard is a CUDA device of its own, "nccl" NCCL or an error. On `sim` devices
  /// "nccl" takes the sim's stand-in for NCCL (tests). And how registers cross ranks between
  /// GPUs (pipeline stages; passes.h: nccl_p2p): "actors" through both hosts, "auto" NCCL's
  /// send and receive where both ends are CUDA devices and baton has NCCL, "nccl" also on sim.
  std::string collectives = "auto";
  /// dp > 1: "none", "bf16" or "fp16": the gradient sums travel (and are kept between hops) in
  /// bf16 or IEEE half (DType::f16) and are added in f32 (AllReduceSettings::wire; Horovod's
  /// compression), half the bytes on the wire. f32 gradients, the ring of actors on the CPU only
  /// (a NCCL bucket or a CUDA replica is refused). bf16 keeps f32's range; fp16 keeps 3 more
  /// mantissa bits but ends at 65504: a partial sum beyond it fails the job naming the actor
  /// (no loss scaling: Horovod's fp16 compression has none either).
  std::string grad_compression = "none";
  /// Where the job's ranks are: rank_hosts[r] is the host of rank r (baton-train takes it from
  /// baton-launch's environment: JobEnvironment::rank_hosts); empty: not known, as if on one
  /// host. With dp > 1 and the ring of actors, where the replicas span two hosts or more with
  /// the same number (two or more) on each, each gradient bucket is all-reduced hierarchically
  /// (AllReduceSettings::rank_hosts: within each host, then across hosts, then within) unless
  /// `hierarchical_allreduce` is false. The sums then come in another order than the flat
  /// ring's (each host's first), the same bits on every replica.
  std::vector<std::uint32_t> rank_hosts;
  bool hierarchical_allreduce = true;
  /// ZeRO (Rajbhandari et al. 2020) for dp > 1, in SBP's terms: 0, every replica holds every
  /// weight, its optimizer state and the all-reduced (broadcast) gradient; 1, each gradient
  /// bucket's optimizer state and master weights are split S(0) over the replicas (replica r
  /// updates elements [r n/dp, (r+1) n/dp) of the bucket: chunk_offsets), the gradients still
  /// all-reduced; 2, the gradients too: reduce-scattered (partial-sum -> S(0)) instead of
  /// all-reduced, so each replica receives only its chunk. After each update every replica
  /// gathers the shards (S(0) -> broadcast) into its weights' step registers. The same sums and
  /// the same elementwise updates as 0, so the same bits. CPU replicas, the ring of actors;
  /// checkpoints are not written under ZeRO yet (resuming from a checkpoint is). 3 (weights
  /// split too, gathered just before use) is not built yet.
  int zero = 0;
  /// How the dp replicas' gradients meet: "allreduce" (each replica updates its own copy of
  /// the weights from the all-reduced sum) or "ps" (parameter servers, as ps-lite and BytePS:
  /// the trained weights and their optimizer state sharded by bytes over `servers` server
  /// actors; each replica pushes its summed gradient of each weight to the weight's server, which
  /// adds the replicas' gradients in replica order, applies the optimizer and hands the new
  /// weights back: each worker sends and receives a weight's bytes once a step). `staleness`
  /// S > 0 (ps only): the gradient of step s is applied S steps late, W(s) = W(s-1) - lr
  /// grad f(W(s-1-S)), so a replica runs up to S steps ahead of the slowest one's gradients;
  /// deterministic (exactly S), so the same every run. Not combined (yet) with zero, pp, tp,
  /// compressed gradients, clipping or a resumed job.
  std::string sync = "allreduce";
  int servers = 1;
  int staleness = 0;
  /// Where the servers run (rank, device), one each; empty: in-process devices after the
  /// replicas' (cpu:dp, cpu:dp+1, ...).
  std::vector<Placement> server_places;
  /// Pipeline parallelism: the forward ops cut into `pp` stages of about equal estimated cost
  /// (multiply-adds), each backward op on the stage of the forward op it differentiates (so a
  /// weight's gradient is made where the weight lives), each stage on its own device. The M
  /// micro-batches of a step flow through the stages. The schedule (schedule.h) is each stage's
  /// order of forward and backward passes, which the plan fixes (ActOrder lanes), and the depth
  /// of its activation registers: "gpipe" runs every forward, then every backward, with M slots;
  /// "1f1b" runs min(pp - s - 1, M) warm-up forwards, then one forward and one backward in turn,
  /// with pp - s slots on stage s. One weight version per step, as without stages.
  /// "interleaved" (Megatron's interleaved 1F1B) gives each device `virtual_stages` non-adjacent
  /// stages (the model cut into pp x virtual_stages, stage s on device s mod pp; M a multiple of
  /// pp); "zb-h1" (Qi et al. 2024) splits each backward op into input-gradient (B) and
  /// weight-gradient (W) work and fills 1F1B's bubble with the deferred W's; "2bw"
  /// (PipeDream-2BW) runs 1F1B's order with each update applied one step late. The exact
  /// sequences and each stage's depth: schedule.h. `pp` always counts devices.
  int pp = 1;
  std::string schedule = "1f1b";
  /// Stages per device for "interleaved" (>= 2); 1 for the others.
  int virtual_stages = 1;
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
  /// Resuming (checkpoint.h): the steps already done, 0 for a fresh start. The job runs steps
  /// first_step + 1 .. steps: the variable actors count their steps from it (the learning-rate
  /// schedule, Adam's bias correction) and every other actor numbers its pieces as the
  /// uninterrupted run would (ActorDesc::first_piece), so data sources and dropout draw what
  /// that run would have drawn and the loss curve goes on bit for bit. `params` must then hold
  /// the weights after step first_step, and `optimizer_state` every trained weight's slots
  /// (optimizer_slot_names); without it they start at zero. The LossLog counts this job's steps.
  std::int64_t first_step = 0;
  /// The plan of a parameter-server worker that comes back to a running job at first_step
  /// (baton-launch --max-restarts; RuntimeSettings::rejoin_step): only its own actors run, and
  /// the servers keep the weights, their optimizer state and the gradients still to be
  /// applied, so a staleness that a resumed job refuses is fine here.
  bool rejoin = false;
  std::shared_ptr<const OptimizerState> optimizer_state;
  /// Checkpoints: after the update of each step s with s % snapshot_every == 0, and of the last
  /// step, each of replica 0's trained variable actors (under ZeRO: every replica's sharded
  /// optimizer, a snapshot per weight its window holds, TrainingJob::snapshots) hands
  /// `on_snapshot` a copy of its weight and slots, on its own worker thread. The snapshot is taken in the stream, without a pause
  /// or a barrier: a variable actor's state after step s's update is exactly what step s + 1
  /// starts from, whatever the other actors are doing, so the copies of one step form a
  /// consistent state even though they are taken at different moments. 0: no snapshots.
  std::int64_t snapshot_every = 0;
  std::function<void(VariableSnapshot)> on_snapshot;
  /// The compiler's passes (passes.h) whose result to print, by name, or "all" (as LLVM's
  /// -print-after): each is handed to `print_ir` (default: printed on stdout under a header)
  /// as text once the pass has run. Unknown names are refused.
  std::vector<std::string> print_after;
  /// The memory pass (passes.h): register slots in one arena per device, slots whose lives
  /// never meet sharing bytes (plan_memory.h). False: every slot has memory of its own.
  bool memory_plan = true;
  /// With the memory plan: an elementwise op may write its output into the bytes of an input it
  /// reads last (ActorDesc::in_place; the built-in elementwise ops' CPU kernels). False: every
  /// output has bytes of its own (to rule out a kernel that mishandles aliasing, or to compare).
  bool in_place = true;
  /// A float32 weight that every reader casts to bf16 (autocast's weights, read by matrix
  /// products) is emitted in bf16 by its own variable actor: the optimizer's kernel writes the
  /// rounded copy as it updates the master (on CUDA in the same pass), and no cast actor runs,
  /// once a step instead of once a micro-batch; its step register holds 2 bytes an element, not 4.
  /// The master, the optimizer and the checkpoints stay f32; the readers see the same bits.
  /// Not for the one piece that must cross to the reporting rank as the final f32 weight (a
  /// pipeline stage's weights on another rank keep their casts). False: the casts stay (to
  /// compare).
  bool fuse_weight_casts = true;
  /// A Linear layer's weight gradient and bias gradient, matmul(x, dy, trans_a) and
  /// sum_to(dy, [n]), as one actor (the epilogues pass, passes.h): on CUDA one cuBLASLt product
  /// whose epilogue sums dy's rows as it reads them; on the CPU the same two computations, bit
  /// for bit. False: two actors (to compare).
  bool fuse_bias_gradients = true;
  /// A Linear layer's forward, matmul(x, w) and the add of its bias b [n] (through autocast's
  /// cast of a bf16 product to f32 when the bias is f32), as one matmul_bias actor (the
  /// epilogues pass): on CUDA one cuBLASLt product whose epilogue adds b as it writes the
  /// result (the product is then not rounded to bf16 before the bias is added); on the CPU the
  /// same two computations, bit for bit. False: two actors (three with the cast). With it too,
  /// bias_gelu(matmul(x, w), b) in GELU's tanh form as one matmul_bias_gelu actor (cuBLASLt's
  /// GELU_AUX_BIAS epilogue; its pre-activation output replaces the product for the backward).
  bool fuse_bias_adds = true;
  /// Each CUDA (or sim) device's trained weights stepped by one actor (the updates pass,
  /// passes.h): on CUDA a multi-tensor Adam or SGD step, a few launches for all of them and one
  /// read-back of the clipping factor, instead of a launch and a read-back per weight; the same
  /// arithmetic, so the same bits. The weights then step once all of the device's gradients of
  /// the step are in. False: one variable actor per weight (to compare).
  bool multi_tensor_updates = true;
  /// A device's runs of forward or backward ops as CUDA graphs (the segments pass, passes.h):
  /// each run one actor, whose act is captured once per pattern of register slots and then
  /// launched as one graph, instead of an actor and a launch per op. On CUDA and sim devices;
  /// the same kernels on the same memory, so the same bits. False: one actor per op (to compare).
  bool cuda_graphs = true;
  /// The plan is compiled to be simulated or printed, never run (baton-plan): the weights are
  /// shapes without memory (ParameterStore::shapes) and replicas share them, so that a model
  /// larger than this machine compiles. Running such a plan fails at its first weight.
  bool plan_only = false;
  /// Activation recomputation (the recompute pass, passes.h): "none"; "selective" (Megatron's):
  /// the attention cores' T x T scores (Graph::attention_core) are computed again in the
  /// backward pass instead of kept; "full": only what crosses each transformer block's boundary
  /// (Graph::block) is kept and the rest of the block is computed again in its backward pass.
  /// The same kernels on the same inputs: losses and weights equal "none" bit for bit.
  std::string recompute = "none";
  /// Refuse, at compile time, a plan that needs more than this many bytes on some device
  /// (registers, weights and optimizer state, by the plan: plan_memory.h). 0: no limit.
  std::int64_t memory_budget = 0;
  std::function<void(std::string_view pass, const std::string& ir)> print_ir;
};

/// What the runtime needs to train: the plan, the kernels it names (the built-in ops plus this
/// job's data, variable and loss kernels) and where results land.
struct TrainingJob {
  Plan plan;
  KernelRegistry kernels;
  std::shared_ptr<ParameterStore> params;
  std::shared_ptr<LossLog> losses;
  /// Replica 0's trained variables and where each is trained.
  std::map<std::string, Placement> trained;
  /// What the snapshots of a checkpoint step are, and on which rank each is taken: each trained
  /// weight whole, or under ZeRO the pieces the replicas' windows cut it into.
  std::vector<SnapshotPart> snapshots;
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
