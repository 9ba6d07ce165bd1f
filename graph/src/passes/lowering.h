#pragma once
// Private to graph/src/passes: what the lowering pass (lower*.cpp) and evaluate() share: the
// builder of one replica's actors and registers, and the kernels the compiler makes itself.
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "baton/actors/plan.h"
#include "baton/graph/collectives.h"
#include "baton/graph/compile.h"
#include "baton/graph/graph.h"
#include "baton/graph/passes.h"
#include "baton/kernels/kernel.h"

namespace baton::passes::detail {

/// The dtype an op's kernel is looked up with: its own if floating, else its first floating
/// input's, else f32.
DType kernel_dtype(const Graph& g, const Node& n);

/// Copies `from` into `to` (same byte size, else std::invalid_argument).
void copy_tensor(const Tensor& from, Tensor& to);

/// Throws GraphError unless `loss` is a scalar value of `g`.
void check_loss(const Graph& g, const Value& loss);

/// Nodes that the targets depend on (ids are topological, so one backward sweep finds them).
std::vector<bool> needed_nodes(const Graph& g, const std::vector<Value>& targets);

/// The inputs whose bytes node `n`'s actor at `where` may compute its output in (ActorDesc::
/// in_place): built-in elementwise ops on the CPU, inputs of the output's shape and dtype.
std::vector<InPlace> in_place_inputs(const Graph& g, const Node& n, const Placement& where);

/// A source that writes a fixed tensor (a weight that is not trained, a feed).
class ConstantSource final : public Kernel {
 public:
  explicit ConstantSource(Tensor value) : value_(std::move(value)) {}
  void compute(KernelContext& ctx) override { copy_tensor(value_, *ctx.outputs[0]); }

 private:
  Tensor value_;
};

/// The streams of a training plan's workers (TrainConfig::threads): the forward pass and data
/// on one, the backward pass and optimizers on the other when there are two.
constexpr std::uint8_t forward_stream = 0;
inline std::uint8_t backward_stream(const TrainConfig& cfg) {
  return static_cast<std::uint8_t>(cfg.threads >= 2 ? 1 : 0);
}

/// The stream NCCL all-reduce actors run on: a worker and CUDA stream of their own, so that a
/// collective waiting for its peers holds up neither compute nor copies.
constexpr std::uint8_t nccl_stream = 14;
/// Their lanes (ActOrder): one per (rank, device) (base + rank * 256 + device code), above any
/// pipeline stage's.
constexpr std::int32_t nccl_lane_base = 1 << 20;

/// The stream of tensor parallelism's NCCL all-reduces (the tp_collectives pass): not dp's
/// (nccl_stream), whose buckets wait for the whole backward while these sit between a stage's
/// ops, and not a compute stream, whose lane would order them after the ops that read them.
constexpr std::uint8_t tp_nccl_stream = 13;

/// The streams of pipeline registers' NCCL moves between ranks (the nccl_p2p pass): each send
/// on a stream of its own, p2p_send_streams of them per device from p2p_first_send_stream (a
/// send waits on its stream for its receive, which its rank cannot order with another
/// register's), and a device's receives on one, p2p_recv_stream (a receive is posted only once
/// its token says the send is there or coming, so it holds its stream for no other).
constexpr std::uint8_t p2p_first_send_stream = 2;
constexpr int p2p_send_streams = 10;
constexpr std::uint8_t p2p_recv_stream = 12;

/// `base`, or "<base>.<k>" for the first k >= 2 not in `taken`; added to `taken`.
std::string unique_name(std::set<std::string>& taken, const std::string& base);

/// A plan pass's rewrite: the plan without the actors in `drop` and with each entry of
/// `replace` in place of the actor at its index (several actors in a row where it has
/// several), less the registers that only the dropped and replaced actors wrote; add_actor
/// links producers and consumers anew. Registers the replacements write are kept whoever wrote
/// them before.
Plan rebuilt(const Plan& plan, const std::map<ActorIndex, std::vector<ActorDesc>>& replace,
             const std::set<ActorIndex>& drop);

/// Builds the actors and registers for the nodes a plan needs: one model replica's worth, with
/// names suffixed and actors placed for that replica.
struct PlanBuilder {
  Graph& g;
  Plan& plan;
  KernelRegistry& kernels;
  /// Rank and device of each (pipeline device, tensor shard) of this replica, at device * tp + shard.
  std::vector<Placement> places{Placement{}};
  int tp = 1;
  const Stages* stages = nullptr;       // null: all on stage 0
  /// By node id, the backward nodes that are W work (weight_gradient_nodes; null: no split).
  const std::vector<bool>* weight_work = nullptr;
  const Shards* shards = nullptr;       // null: all on shard 0
  std::string suffix;                   // "" for one replica, "@dp<r>" otherwise
  std::map<int, RegisterIndex> reg_of;  // node -> the register its per-micro-batch value is in
  /// node -> the register the backward pass reads it from, where that is not reg_of's: a ZeRO-3
  /// weight, gathered once for the forward pass and again for the backward (lower_zero.cpp).
  std::map<int, RegisterIndex> backward_reg_of;
  int loss_id = std::numeric_limits<int>::max();  // nodes up to it are the forward pass
  std::int64_t first_piece = 0;  // a resumed job's first micro-batch (ActorDesc::first_piece)

  std::string named(const std::string& n) const { return n + suffix; }
  /// The register node `id`'s actor reads its input node `in` from.
  RegisterIndex input_reg(int id, int in) const;
  int stage(int id) const { return stages == nullptr ? 0 : stages->at(id); }
  int shard(int id) const { return shards == nullptr ? 0 : shards->at(id); }
  /// The node's index into `places`.
  int place(int id) const { return (stages == nullptr ? 0 : stages->device_of(stage(id))) * tp + shard(id); }
  Placement at(std::uint8_t stream, int place = 0) const;
  /// Where the host side of a place runs (data sources, loss reports, clipping: CPU closures):
  /// the place itself on a CPU device; beside a CUDA device, the CPU device of the same rank and
  /// index, whose registers the device copy actors read and write (insert_device_copies).
  Placement host(std::uint8_t stream, int place = 0) const;

  RegisterIndex add_register(const std::string& name, const Shape& shape, DType dtype,
                             std::int32_t slots);
  RegisterIndex node_register(int id, std::int32_t slots);
  /// forward node -> the register of the tensor its actor saves for its gradient op (see
  /// saved_for in plan_builder.cpp).
  std::map<int, RegisterIndex> saved_reg_of;
  /// For gradient node `id`: the register its forward's saved tensor is in, which this adds to
  /// the forward's actor on first use; nullopt where the op saves nothing.
  std::optional<RegisterIndex> saved_for(int id);
  /// The nodes the lowering needs (null: every node); what split_outputs looks at.
  const std::vector<bool>* need = nullptr;
  /// Slices whose register the node they slice writes directly (split_outputs): lowered with it.
  std::set<int> written_by_input;
  /// For a node whose only needed readers are slices that take its output apart along the last
  /// axis into pieces (attention_grad's dq, dk and dv): those slices, in order, so that
  /// its actor writes each piece into a register of its own (its kernel takes the outputs); else
  /// empty. Only ops whose kernels take both forms are split.
  std::vector<int> split_outputs(int id) const;
  void op_actor(int id, std::uint8_t stream, std::int32_t slots);
  void source_actor(const std::string& name, const std::string& op, DType dtype,
                    std::vector<RegisterIndex> outputs, std::int64_t pieces, const Placement& where,
                    Attrs attrs = {}, ActorRole role = ActorRole::other);
};

/// A trained weight of replica 0: the register its variable actor writes once per step (and
/// once more with the last step's update applied), and where that actor runs.
struct FinalWeight {
  std::string name;
  RegisterIndex reg;
  Placement where;
  DType dtype;
  Shape shape;
  /// The ParameterStore's tensor is the master copy (replica 0's whole weight on the reporting
  /// rank): nothing to copy back. False under ZeRO, whose masters are shards.
  bool in_store = true;
};

/// The registers each replica's variable actors read their summed gradients from, by variable
/// node id: the accumulated gradient with one replica, the all-reduced one with several.
using GradientInputs = std::vector<std::map<int, RegisterIndex>>;
/// Where a variable reads its summed gradient: elements [offset, offset + its size) of the
/// concatenation of `parts` (a whole register: {{reg}, 0}).
struct GradientAt {
  std::vector<RegisterIndex> parts;
  std::int64_t offset = 0;
};
/// Per replica, by variable node id: where a gradient is not one whole GradientInputs register.
using GradientWindows = std::vector<std::map<int, GradientAt>>;

/// Adds the all-reduce of every bucket of `reps` (lower_allreduce.cpp): from each replica's
/// summed gradients `grad_sum` to the registers the variables read, which it returns (for a
/// window, its first part). On CPU devices a bucket is reduce-scattered and every replica's
/// variables read their windows of the members' sums where they lie (`windows`): no gather into
/// a whole copy. Elsewhere (NCCL, CUDA, compressed sums) it is all-reduced and unpacked into a
/// register per weight.
GradientInputs lower_gradient_allreduce(std::vector<PlanBuilder>& replicas, const Replicas& reps,
                                        const GradientInputs& grad_sum, const TrainConfig& cfg,
                                        GradientWindows& windows);

/// Whether bucket `bi` is reduce-scattered from its weights' gradients where they lie and its
/// sums read where they lie (lower_allreduce.cpp): every replica's place is a CPU device holding
/// every weight of the bucket, the ring of actors sums it (not NCCL), in the weights' dtype (no
/// compression).
bool sums_in_place(const std::vector<PlanBuilder>& replicas, const Replicas& reps, std::size_t bi,
                   const TrainConfig& cfg);

/// Each replica's member of bucket `bi`'s reduction, at the bucket's place on the backward
/// stream: with `in_place`, the weights' gradients as its parts; else the bucket packed into one
/// register (pack_bucket; a bucket of one: its gradient as it is).
std::vector<AllReduceMember> gradient_members(std::vector<PlanBuilder>& replicas, const Replicas& reps,
                                              std::size_t bi, const GradientInputs& grad_sum,
                                              const TrainConfig& cfg, bool in_place);

/// The dtype gradient sums travel in under cfg.grad_compression: bf16 for "bf16", f16 for
/// "fp16", none (the gradients' own) for "none".
std::optional<DType> gradient_wire(const TrainConfig& cfg);

/// How the ring of actors sums a gradient bucket (lower_allreduce.cpp): the direct form below
/// gradient_direct_below_bytes (gradient_direct_below_bytes_one_host for a job on one host), bf16 or f16 on the wire with --grad-compression, one slot a hop.
/// ZeRO's reduce-scatter takes the same, so its sums are the same bits.
AllReduceSettings gradient_allreduce_settings(const TrainConfig& cfg);

/// The all-reduce of `inputs[r]` (replica r's register) over the replicas, made of actors
/// (collectives.h), each member at its replica's `place` and `stream`; the N result registers.
std::vector<RegisterIndex> add_replica_allreduce(std::vector<PlanBuilder>& replicas,
                                                 const std::string& name,
                                                 const std::vector<RegisterIndex>& inputs,
                                                 const Shape& shape, DType dtype,
                                                 std::uint8_t stream, std::int32_t result_slots,
                                                 int place, const AllReduceSettings& settings = {});

/// How many steps after its own a step's summed gradient is applied: 1 (synchronous: step s's
/// weights have step s-1's gradient applied), or 2 under PipeDream-2BW (`schedule` "2bw": step
/// s's weights are step s-1's with step s-2's gradient applied, so a stage holds two versions of
/// a weight and never waits for the step before's last backward). The variable actor reads its
/// gradient with this delay and writes steps + weight_delay pieces, the last with every step's
/// gradient applied. Parameter servers with staleness S (`sync` "ps"): S + 1.
std::int32_t weight_delay(const TrainConfig& cfg);

/// Throws GraphError, naming both settings, for what PipeDream-2BW's delayed updates do not work
/// with (lower_variables.cpp): ZeRO, a resumed job, CUDA variables.
void check_weight_delay(const TrainConfig& cfg);

/// Parameter servers (TrainConfig::sync "ps", lower_ps.cpp): each trained weight's variable
/// actor on its server (the weights sharded over the servers by bytes, largest first, each to
/// the server with the fewest bytes so far), reading the sum of every replica's `grad_sum` of it
/// (added on the server in replica order), its step register returned by weight id for every
/// replica to repeat (as ZeRO's gathered weights are).
std::map<int, RegisterIndex> lower_parameter_servers(std::vector<PlanBuilder>& replicas, const Differentiated& d,
                                                     const GradientInputs& grad_sum, const Stages& st,
                                                     const TrainConfig& cfg, ParameterStore& params);

/// Where server `k` of TrainConfig::sync "ps" runs: its server place, else in-process device
/// cpu:(replicas + k).
Placement server_place(const TrainConfig& cfg, int k);

/// Parameter servers' loss (lower_ps.cpp): each replica's loss of each micro-batch as a pair
/// (loss, 1), added on server 0 in replica order; the register of the sums, and where it is.
/// A replica whose rank left the job (Runtime::rank_left) adds (0, 0) from then on, so the
/// reported mean, sum / count, is over the replicas still there.
std::pair<RegisterIndex, Placement> lower_ps_loss(std::vector<PlanBuilder>& replicas,
                                                  const std::vector<RegisterIndex>& loss_regs, DType loss_dt,
                                                  int loss_place, const TrainConfig& cfg);

/// Throws GraphError, naming both settings, for a `sync` / `servers` / `staleness` that cannot
/// be built (lower_ps.cpp; check_config calls it).
void check_sync(const TrainConfig& cfg);

/// Adds replica `r`'s variable actor for variable node `id` (lower_variables.cpp): its optimizer
/// (reading `grad`, with `clip` if given) or, for a weight that is not trained (no `grad`), a
/// constant source; then (`with_repeat`) the repeat that lets the step's M micro-batches read
/// it. Returns the register it writes once per step. A parameter server's variable (lower_ps.cpp)
/// has no repeat of its own: each replica repeats the weights it pulls.
/// `emit`: the dtype its register holds when not the weight's own (bf16 for an f32 weight whose
/// readers all cast it: TrainConfig::fuse_weight_casts); the master stays the weight's dtype.
RegisterIndex lower_variable(PlanBuilder& b, std::int64_t r, int id, const GradientAt* grad,
                             const RegisterIndex* clip, const Stages& st, const TrainConfig& cfg,
                             ParameterStore& params, bool with_repeat = true,
                             std::optional<DType> emit = std::nullopt);

/// The saved optimizer slots of trained variable `n` in a resumed job (null: start at zero),
/// checked against the variable and the optimizer (GraphError naming what does not fit).
const std::map<std::string, Tensor>* optimizer_slots_of(const TrainConfig& cfg, const Node& n);

/// Adds the repeat that lets the step's M micro-batches read weight `id` from `w`, the register
/// written once per step (by its variable actor, or by the ZeRO gather).
void add_weight_repeat(PlanBuilder& b, int id, RegisterIndex w, const Stages& st,
                       const TrainConfig& cfg);

/// ZeRO 3 (lower_zero.cpp): each bucket's weights live only as shards, replica c's optimizer
/// keeping elements [offsets[c], offsets[c+1]) of the bucket's concatenation as its master (its
/// output register, updated in place). Each replica gathers each weight from the shards just
/// before its first reader of the forward pass and again before its first reader of the
/// backward pass (add_zero3_gather), so a whole weight is held only between its gather and its
/// last reader of that pass. A shard on the replica's own rank is read where it lies, through a
/// repeat for the micro-batches; one on another rank is pulled, per micro-batch and pass, by a
/// transfer in the pass's lane just before the bucket's first gather that needs it, or behind the
/// gather before that (the prefetch of FSDP).
struct Zero3Layout {
  struct Weight {
    std::size_t bucket = 0;
    std::size_t first = 0, last = 0;  // the shards holding its first and last elements
    std::int64_t begin = 0;           // where it starts in the concatenation of those shards
    std::string op;                   // its gather kernel
  };
  /// What replica r reads shard c of a bucket from in a pass: the shard's repeat on r (same
  /// rank), or a transfer's register, made at the first gather that needs it.
  struct Read {
    RegisterIndex reg = 0;
    bool made = false;
  };
  struct Bucket {
    std::vector<std::int64_t> offsets;  // chunk_offsets
    std::vector<RegisterIndex> shards;  // [c]: on replica c
    /// [r][c][pass]: the register replica r reads shard c from (pass 0 forward, 1 backward);
    /// for a remote shard, `pulled` is the repeat on c that r's transfer pulls from.
    std::vector<std::vector<std::array<Read, 2>>> reads, pulled;
    /// [c]: replica 0's sink of shard c's forward pulls, which copies the last step's shard into
    /// the store (add_zero3_gather adds it beside the pull; lower_zero gives it its kernel).
    std::vector<bool> stored_from_pull;
  };
  std::vector<Bucket> buckets;
  std::vector<std::map<int, Weight>> weights;  // [r], by variable node id
  /// (weight, backward) -> the gather after it in lane order (every replica's), whose pulls it
  /// starts (prefetch): zero3_sequence.
  std::map<std::pair<int, bool>, std::pair<int, bool>> next;
  std::vector<Placement> places;              // [bucket * dp + c]: where replica c holds it
  std::vector<std::string> suffixes;          // [r]: PlanBuilder::suffix
  Placement reporter;                         // where the trained weights are wanted (loss.report)
  Placement at(std::size_t bucket, std::size_t r) const { return places[bucket * suffixes.size() + r]; }
};

/// The order in which lower_nodes reaches the gathers (a weight's first reader in each pass, by
/// node id) into z.next: `needed` and the loss's id as lower_nodes has them.
void zero3_sequence(Zero3Layout& z, const Graph& g, const std::vector<bool>& needed, int loss_id);

/// The registers of zero3 that exist before the actors (lower_nodes and lower_zero add them),
/// and the gather kernels.
Zero3Layout zero3_layout(std::vector<PlanBuilder>& replicas, const Replicas& reps, const TrainConfig& cfg);

/// Replica r's (b's) gather of ZeRO-3 weight `id` for the forward pass (into reg_of) or the
/// backward pass (into backward_reg_of), acting once per micro-batch in that pass's lane, with
/// the transfers of remote shards it is the first to need.
void add_zero3_gather(PlanBuilder& b, std::size_t r, int id, Zero3Layout& z, bool backward, const Stages& st,
                      const TrainConfig& cfg);

/// ZeRO (TrainConfig::zero, lower_zero.cpp): for each bucket, the gradients reduce-scattered
/// (all-reduced, for stage 1 with compression), each replica's optimizer actor updating its 1/dp shard of the
/// bucket's weights and optimizer state, and each replica's gather writing every weight of the
/// bucket into its `.step` register (`steps[r]`, by variable node id) from all the shards.
/// With clipping, also the actors that write each replica's factor into `clip[r]`. Replica 0's
/// gathers on the reporter's rank copy the trained weights into `params` after the last step.
/// Returns what the shards' checkpoint snapshots are (TrainingJob::snapshots).
/// With stage 3 (`zero3`), the optimizers write the shards of `zero3` (no `.step` registers:
/// `steps` is empty) and replica 0's reporting-rank sinks copy the last step's shards into `params`.
std::vector<SnapshotPart> lower_zero(std::vector<PlanBuilder>& replicas, const Replicas& reps, const Differentiated& d,
                const GradientInputs& grad_sum, const GradientInputs& steps,
                const std::vector<std::optional<RegisterIndex>>& clip, const TrainConfig& cfg,
                ParameterStore& params, const Placement& reporter, const Zero3Layout* zero3 = nullptr);

/// Registers the global-norm clipping kernels for `dt` (TrainConfig's clip_norm): "optim.clip"
/// (gradients -> factor), "optim.sum_of_squares" (gradients -> f64 scalar) and
/// "optim.clip_of_squares" (every replica's scalar -> factor).
void add_clip_kernel(KernelRegistry& kernels, DType dt, double max_norm);

/// The process that reports (loss.report's rank) evaluates the trained weights, but a weight
/// placed on another rank is trained there: its final value comes over as part of the plan.
/// `pieces`: how many each variable writes (steps + weight_delay), the last being the final one.
void gather_final_weights(Plan& plan, KernelRegistry& kernels, ParameterStore& params,
                          const std::vector<FinalWeight>& finals, const Placement& reporter,
                          std::int64_t pieces);

/// Hands `text()` to cfg.print_ir (or stdout) if cfg.print_after names `pass` or all
/// (pipeline.cpp).
void print_after(const TrainConfig& cfg, std::string_view pass, const std::function<std::string()>& text);

/// The first element of `t` (a loss: f64, bf16 or f32) as a double (sync.cpp).
double scalar_value(const Tensor& t, DType dt);

/// What a gradient-synchronisation strategy leaves for the model's nodes (lower_nodes) to read.
struct SyncRegisters {
  GradientInputs grad_in;        // what each replica's variables read (the all-reduce's sums)
  GradientWindows grad_windows;  // ... or windows of the members' sums, read where they lie
  GradientInputs steps;          // weights' step registers written by the strategy (ZeRO 1/2, servers)
  std::optional<Zero3Layout> zero3;
};

/// Gradient synchronisation as a strategy (DESIGN.md), chosen once per job (choose_sync): how the
/// replicas' summed gradients become the weights every replica reads the next step. One
/// implementation each (sync.cpp): the all-reduce, ZeRO 1/2, ZeRO 3, parameter servers. lower()
/// calls it before the model's nodes, after them, and for the loss; `--print-after sync` shows
/// which it is and the actors it added.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  /// "all-reduce", "ZeRO stage 2", "parameter servers: 2, staleness 1".
  virtual std::string describe() const = 0;
  /// Before the model's nodes: what the variables read, or who writes their step registers.
  virtual SyncRegisters before_nodes(std::vector<PlanBuilder>& replicas, const Replicas& reps, const Differentiated& d,
                                     const GradientInputs& grad_sum, const Stages& st, ParameterStore& params) = 0;
  /// Where the loss is reported and the trained weights are wanted: by default replica 0's host
  /// side of the loss's place.
  virtual Placement reporter(std::vector<PlanBuilder>& replicas, const Differentiated& d) const;
  /// After the model's nodes: the rest of it (ZeRO's sharded optimizers and gathers). Returns
  /// the checkpoint's parts if it names them itself (ZeRO's shards); nullopt: one per final
  /// weight, where it is trained.
  virtual std::optional<std::vector<SnapshotPart>> after_nodes(std::vector<PlanBuilder>& replicas, const Replicas& reps,
                                                               const Differentiated& d, const GradientInputs& grad_sum,
                                                               SyncRegisters& regs,
                                                               const std::vector<std::optional<RegisterIndex>>& clip,
                                                               ParameterStore& params, const Placement& reporter,
                                                               std::vector<FinalWeight>& finals);
  /// The loss of each micro-batch reported once: by default summed over the replicas by an
  /// all-reduce and reported on replica 0 as their mean.
  virtual std::shared_ptr<LossLog> report_loss(std::vector<PlanBuilder>& replicas, const Differentiated& d,
                                               const std::vector<RegisterIndex>& loss_regs);

 protected:
  explicit GradientSync(const TrainConfig& cfg) : cfg_(cfg) {}
  const TrainConfig& cfg_;
};

/// The strategy cfg asks for: parameter servers (sync "ps"), ZeRO (zero > 0 with dp > 1), else
/// the all-reduce (one replica: its own sums).
std::unique_ptr<GradientSync> choose_sync(const TrainConfig& cfg);

}  // namespace baton::passes::detail
