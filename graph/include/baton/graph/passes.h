#pragma once
/// The compiler as a pipeline of named passes, as LLVM's and XLA's are. compile_training runs
/// them in this order, each a function from explicit values to a value that prints itself:
///
///   autodiff -> sbp -> stages -> recompute -> replicas -> [sync] lower -> device_copies
///            -> transfers -> lanes -> memory
///
///   autodiff       the loss's gradients, as new nodes of the graph; which nodes the plan needs
///   sbp            each node's tensor-parallel shard (the SBP split of the model, tp)
///   stages         each node's pipeline stage and each stage's activation depth (pp, schedule)
///   recompute      forward nodes computed again in the backward pass instead of kept
///                  (TrainConfig::recompute: selective, full)
///   replicas       where each (replica, stage, shard) runs and the gradient buckets (dp)
///   sync           (within lower) gradient synchronisation, one strategy chosen once: the
///                  all-reduce, ZeRO 1/2, ZeRO 3 or parameter servers; prints which, and the
///                  actors it added
///   lower          the actors and registers of every replica: the plan, and its kernels
///   device_copies  copy actors between host and CUDA devices (insert_device_copies); what
///                  crosses ranks from or to a CUDA device is staged through host memory
///   transfers      a transfer actor wherever a register crosses ranks (insert_transfers)
///   lanes          each stage's fixed order of acts (schedule.h)
///   memory         register slots placed in one arena per device (plan_memory.h)
///
/// baton-train --print-after PASS (or all) prints a pass's value (TrainConfig::print_after). The
/// runtime's Plan stays the contract: the last four passes are Plan -> Plan, and the plan
/// verifier (validate(), runtime.h) runs after lower and after each of them with what the pass
/// can have broken (the structure; from transfers on, every crossing has its transfer; after
/// lanes, the dry run; after memory, the arenas), so a pass that breaks an invariant is named
/// as the pass, in a PlanError, before anything runs.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "baton/actors/plan.h"
#include "baton/graph/compile.h"
#include "baton/graph/graph.h"
#include "baton/kernels/kernel.h"

namespace baton::passes {

/// The passes' names, in the order compile_training runs them.
const std::vector<std::string_view>& names();

/// Throws GraphError for a TrainConfig that no pass can compile (steps, microbatches, dp, pp,
/// tp, schedule, balance, collectives, places), naming the setting.
void check_config(const TrainConfig& cfg);

/// autodiff: the gradients of the mean loss over the global batch (dp x M micro-batches), so
/// each micro-batch's gradient is scaled by 1 / (dp M) (the accumulate actors sum a replica's M,
/// the all-reduce the replicas').
struct Differentiated {
  Value loss;
  /// (variable, its gradient) for every trainable variable the loss depends on, in graph order.
  std::vector<std::pair<Value, Value>> trained;
  /// The nodes the plan computes: the loss, the gradients and everything they read.
  std::vector<bool> need;
  /// Needed nodes, one line each, then "trained W <- GRAD".
  std::string to_text() const;
};
Differentiated autodiff(Graph& g, Value loss, const TrainConfig& cfg);

/// sbp: the tensor-parallel shard of every node. A forward node keeps the shard the model gave
/// it (Graph::shard scopes, or shard_graph() from SBP signatures; -1, shared, runs on shard 0);
/// a backward node goes with the forward node whose backward step made it (Node::grad_of), so
/// the gradient of shard k's weights and activations is computed where they live, and only dy
/// crosses to them (a backward node without one: the highest shard among its inputs). tp 1:
/// every node on shard 0.
struct Shards {
  int tp = 1;
  std::vector<int> of;  // by node id
  int at(int id) const { return of.empty() ? 0 : of[static_cast<std::size_t>(id)]; }
  std::string to_text(const Graph& g, const Differentiated& d) const;
};
Shards sbp(const Graph& g, const Differentiated& d, int tp);

/// stages: the forward ops cut into pp x chunks stages of about equal cost
/// (TrainConfig::balance; chunks: the schedule's stages per device, schedule.h), each backward
/// op on the stage of the forward op it differentiates; where each stage runs (its pipeline
/// device); and the slots of the activation registers on each stage: the schedule's depth
/// (gpipe M, 1f1b pp - s, the others their analyse_schedule() depth; without stages,
/// TrainConfig::activation_slots).
struct Stages {
  int pp = 1;                               // stages (pipeline devices x chunks)
  int devices = 1;                          // pipeline devices (TrainConfig::pp)
  std::vector<int> of;                      // by node id (empty: all 0)
  std::vector<int> device;                  // by stage (empty: stage s on device s)
  std::vector<std::int32_t> forward_slots;  // by stage
  std::int32_t backward_slots = 2;
  /// By stage, where the schedule needs more than backward_slots for the registers its backward
  /// ops write (empty: backward_slots everywhere).
  std::vector<std::int32_t> backward_slots_of;
  int at(int id) const { return of.empty() ? 0 : of[static_cast<std::size_t>(id)]; }
  int device_of(int stage) const { return device.empty() ? stage : device[static_cast<std::size_t>(stage)]; }
  std::int32_t backward_depth(int stage) const {
    return backward_slots_of.empty() ? backward_slots : backward_slots_of[static_cast<std::size_t>(stage)];
  }
  std::string to_text(const Graph& g, const Differentiated& d) const;
};

/// The backward nodes that are weight-gradient work (zero-bubble's W): those no gradient of an
/// activation depends on (the dy a forward node's backward step reads), so that only the
/// weights' gradients read them. By node id; the B/W split of schedule.h.
std::vector<bool> weight_gradient_nodes(const Graph& g, const Differentiated& d);
Stages stages(const Graph& g, const Differentiated& d, const TrainConfig& cfg,
              const ParameterStore& params);

/// recompute: activation recomputation (TrainConfig::recompute; Chen et al. 2016, Megatron's
/// selective recomputation, Korthikanti et al. 2022). The recomputed forward nodes are those of a
/// segment (a block's attention core for "selective", a whole block for "full") that no forward
/// node outside the segment reads; every backward node that reads one on its own stage reads a
/// clone instead, computed in the backward pass from the segment's kept inputs (its boundary:
/// the block's input, weights, ...) by the same op on the same stage and shard, so the forward
/// node's activation is free once the forward pass has read it. The backward nodes are made
/// again after the loss (the old ones left unneeded) so that node ids stay a topological order
/// and each clone comes just before its first reader. "none" changes nothing.
struct Recomputed {
  Differentiated d;
  Shards shards;  // extended to the new nodes
  Stages stages;
  std::string mode = "none";
  /// clone id -> the forward node it computes again
  std::map<int, int> clones;
  /// The mode and what is recomputed, then Differentiated::to_text().
  std::string to_text() const;
};
Recomputed recompute(Graph& g, const Differentiated& d, const Shards& shards, const Stages& st,
                     const TrainConfig& cfg);

/// replicas: where replica r's stage s, shard k runs (TrainConfig::replica_places at
/// (r * pp + s) * tp + k, or in-process device of that index), and, with dp > 1, the buckets
/// whose gradients are all-reduced together, as DDP makes them: in reverse order of the weights
/// (roughly the order their gradients are ready), a bucket takes weights of one place and dtype
/// until the next would pass TrainConfig::bucket_bytes.
struct Replicas {
  int dp = 1, pp = 1, tp = 1;
  /// TrainConfig::zero where dp > 1 (else 0): how the buckets are reduced and updated.
  int zero = 0;
  /// [replica][stage * tp + shard]
  std::vector<std::vector<Placement>> places;
  struct Bucket {
    std::vector<Value> weights;
    int place = 0;      // their stage * tp + shard
    bool nccl = false;  // all-reduced by NCCL (TrainConfig::collectives), else by actors
  };
  std::vector<Bucket> buckets;
  /// "@dp<r>" with dp > 1, else "".
  std::string suffix(std::int64_t r) const;
  std::string to_text() const;
};
Replicas replicate(const Differentiated& d, const Shards& shards, const Stages& st,
                   const TrainConfig& cfg);

/// lower: the plan of every replica's actors and registers (compile.h draws one), the kernels
/// it names, and where results land. Throws GraphError for an input no data feeds.
TrainingJob lower(Graph& g, const Differentiated& d, const Shards& shards, const Stages& st,
                  const Replicas& reps, const TrainConfig& cfg,
                  std::shared_ptr<ParameterStore> params);

/// updates: with TrainConfig::multi_tensor_updates, the trained variable actors of each CUDA or
/// sim device (two or more, each step's gradient applied at once) as one actor that steps them
/// together: cuda::adam_step_multi / sgd_step_multi on CUDA, the members' kernels in turn on a
/// sim device (passes/updates.cpp says when, and what it costs); else the plan unchanged.
Plan updates(const Plan& plan, KernelRegistry& kernels, const TrainConfig& cfg);

/// segments: with TrainConfig::cuda_graphs, each run of forward (or backward) compute actors of
/// one CUDA or sim device's stream that nothing off the stream waits on in between, as one actor
/// whose act runs theirs in turn, captured into a CUDA graph and launched as one from the second
/// time its slots come round (passes/segments.cpp says which actors and where a run ends);
/// else the plan unchanged. Registers keep their names, slots and outside readers.
Plan segments(const Plan& plan, KernelRegistry& kernels, const TrainConfig& cfg);

/// What the segments' kernels (segments pass) did in this process so far: graphs captured,
/// acts launched as a graph, segments that gave capturing up (and ran eagerly).
struct SegmentGraphs {
  std::int64_t captured = 0, launched = 0, refused = 0;
};
SegmentGraphs segment_graphs();

/// epilogues: with TrainConfig::fuse_bias_gradients, each Linear layer's weight gradient
/// (matmul(x, dy, trans_a)) and bias gradient (sum_to(dy, [n])) as one matmul_bias_grad actor;
/// with TrainConfig::fuse_bias_adds, its forward product and bias add (matmul(x, w) + b) as one
/// matmul_bias actor, and bias_gelu(matmul(x, w), b) in GELU's tanh form as one
/// matmul_bias_gelu actor (writing the pre-activation the backward's gelu_grad reads); each
/// where the device has its kernel (passes/epilogues.cpp says when);
/// else the plan unchanged.
Plan epilogues(const Plan& plan, const KernelRegistry& kernels, const TrainConfig& cfg);

/// tp_collectives: with tp > 1, each tensor-parallel partial sum (shard_graph's chain of adds)
/// as one NCCL all-reduce where every shard is a CUDA device of its own (TrainConfig::collectives;
/// `sim` devices with "nccl"): an nccl.allreduce actor per shard on tp_nccl_stream, each reader
/// of the sum reading the copy on its own device (passes/tp_collectives.cpp says when and in
/// which order); else the plan unchanged.
Plan tp_collectives(const Plan& plan, const KernelRegistry& kernels, const TrainConfig& cfg);

/// device_copies: with any actor on a CUDA device, refuses actors whose op has no CUDA kernel
/// (GraphError naming them) and adds the copy actors (insert_device_copies, plan.h); a plan of
/// host devices comes back unchanged.
Plan device_copies(const Plan& plan, const KernelRegistry& kernels);

/// transfers: insert_transfers (plan.h); a plan within one rank comes back unchanged.
Plan transfers(const Plan& plan);

/// nccl_p2p: each register that crosses ranks from a GPU to a GPU (staged by device_copies and
/// transfers: to_host, transfer, to_device) moved by NCCL instead where TrainConfig::collectives
/// allows (as for dp and tp; `sim` devices with "nccl"): an nccl.send on the producer's GPU,
/// a host token per piece (p2p.token) that a transfer takes to the receiving rank, and an
/// nccl.recv there writing the register the to_device copy wrote (passes/nccl_p2p.cpp says
/// why the token, and which streams); else the plan unchanged.
Plan nccl_p2p(const Plan& plan, const KernelRegistry& kernels, const TrainConfig& cfg);

/// lanes: each pipeline stage's order of forward and backward passes (order_pipeline,
/// schedule.h) with pp > 1. Without stages, with TrainConfig::memory_plan, the one stage runs
/// each micro-batch's forward and then its backward (1F1B on one stage), an order that lets
/// the memory pass share bytes between the registers it orders; else the plan is unchanged.
Plan lanes(const Plan& plan, const TrainConfig& cfg);

/// memory: with TrainConfig::memory_plan, every register slot the runtime allocates (not a
/// repeat's, which aliases its input, nor page-locked ones between host and device) gets an
/// offset in one arena per (rank, device), and slots whose lives never meet share bytes
/// (plan_memory.h says when a life is known: inside a lane); with TrainConfig::in_place, an
/// output an act may compute in place of an input it reads last (ActorDesc::in_place) takes that
/// input slot's bytes where nothing else live is there (without it, the permissions are
/// dropped from the plan). Then, with a memory_budget,
/// refuses (GraphError) a plan that needs more than that on some device, naming its needs by
/// category and the largest consumers.
Plan memory(const Plan& plan, const TrainConfig& cfg);

/// The plan's peak bytes per device by category, and the largest consumers (memory_report).
std::string memory_text(const Plan& plan);

/// Runs the passes in order on `loss` and `cfg` (checked first) and returns the job; after each
/// pass named in cfg.print_after (or "all") hands its text to cfg.print_ir.
TrainingJob run(Graph& g, Value loss, const TrainConfig& cfg,
                std::shared_ptr<ParameterStore> params);

}  // namespace baton::passes
