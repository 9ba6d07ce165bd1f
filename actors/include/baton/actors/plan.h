#pragma once
/// The plan: the contract between the compiler and the runtime. A plain value that lists
/// every actor (rank, device, stream, kind, kernel, attributes) and every register (shape,
/// dtype, slots, producer, consumers). Hand-writable, printable, hashable.
///
///   baton::Plan plan;
///   auto r = plan.add_register({.name = "src.out", .shape = {16}, .dtype = baton::f32});
///   plan.add_actor({.name = "src", .kind = baton::ActorKind::source, .op = "fill_piece",
///                   .outputs = {r}, .pieces = 1000});
///   plan.add_actor({.name = "sink", .op = "noop", .inputs = {{r}}});
#include <cstdint>
#include <optional>
#include <limits>
#include <string>
#include <vector>

#include "baton/kernels/attrs.h"
#include "baton/kernels/device.h"
#include "baton/kernels/dtype.h"
#include "baton/kernels/tensor.h"

namespace baton {

using RegisterIndex = std::uint32_t;
using ActorIndex = std::uint32_t;
inline constexpr ActorIndex no_actor = std::numeric_limits<ActorIndex>::max();

enum class ActorKind : std::uint8_t {
  /// No inputs; emits `pieces` pieces, running its kernel for each.
  source,
  /// Runs its kernel once per piece: reads one piece of each input, writes one of each output.
  /// With no outputs it is a sink.
  compute,
  /// One input, one output: each input piece is read by `group` output pieces without a copy
  /// (the output aliases the input slot). Lets the M micro-batches of a step read one weight.
  /// With group 1 it is a *view*: output piece p is input piece p, in the input's slot, and the
  /// output may have another shape of as many elements (a reshape without a copy; see
  /// aliased_register()). Readers of a view read the input's bytes: the memory plan counts their
  /// reads as reads of the input, and the stream handshakes as reads of what its writer wrote.
  repeat,
  /// One input, one output: sums each `group` consecutive input pieces into one output piece
  /// (the gradient accumulation of M micro-batches). With op "last" it keeps the group's last
  /// piece instead of the sum, copying only that one (a weight's final value after its steps).
  accumulate,
  /// One input on another rank, one output here of the same shape and dtype: pulls each piece
  /// from the remote producer's slot into its own (the data plane), then acks the producer and
  /// requests its local consumers. Placed by insert_transfers(), one per (register, rank), or
  /// by a lowering that wants one in a lane (ZeRO 3's pulls), where it starts each pull at its
  /// turn. With several inputs (at most max_transfer_inputs, each register once, no delay, one
  /// dtype, at least one on another rank) it *gathers*: each input's piece lands in its own part
  /// of the output slot, one after another in port order, filling it; those on other ranks are
  /// pulled straight there and those of its own rank (host memory) copied there. An all-reduce's
  /// result is gathered so, with no register and no copy per remote sum.
  /// With op "transfer.add" it *reduces* (reduces()): two inputs, a piece from another rank
  /// (its whole slot, or a window) and one of its own rank's host memory, f32 or f64; each
  /// output piece is the remote piece plus elements [attr "offset", + its size) of the local
  /// one. A piece read where it lies (in the producer's slot between ranks of one host, or
  /// inline) is added as it is read: the ring all-reduce's receive and add in one pass.
  transfer,
};

struct ActorDesc;
/// Whether `a` is a reducing transfer (ActorKind::transfer, op "transfer.add").
bool reduces(const ActorDesc& a);

/// The most inputs one gathering transfer reads (ActorKind::transfer): the data plane's payload
/// tag names the input port in 8 bits.
inline constexpr std::size_t max_transfer_inputs = 256;

std::string_view name(ActorKind k);

/// What an actor does for training, for people reading a plan (the dashboard colours and the
/// pipeline timeline use it); the runtime ignores it.
enum class ActorRole : std::uint8_t {
  other,
  /// Reads the data set.
  data,
  /// An op of the forward pass (up to and including the loss).
  forward,
  /// An op of the backward pass, or the accumulation of its gradients.
  backward,
  /// A variable (which applies the optimizer step) and what hands its weights out.
  update,
  /// Part of an all-reduce or another collective.
  collective,
  /// Moves a register between ranks (insert_transfers).
  transfer,
};
std::string_view name(ActorRole r);

/// What a piece of memory holds, for the plan's memory report (plan_memory.h).
enum class MemoryCategory : std::uint8_t { weights, optimizer_state, activations, gradients, other };
inline constexpr std::size_t memory_categories = 5;
std::string_view name(MemoryCategory c);

/// What a copy actor moves between host and device (insert_device_copies sets it; its op names
/// its kernel, "to_host" or "to_device", which no other layer reads for its meaning).
enum class CopyDirection : std::uint8_t { none, to_host, to_device };

/// Bytes a kernel keeps for the whole job outside any register (a variable's master weight and
/// optimizer state): the memory report counts them on the actor's device; the kernel allocates them.
struct KeptBytes {
  MemoryCategory category = MemoryCategory::other;
  std::int64_t bytes = 0;
  friend bool operator==(const KeptBytes&, const KeptBytes&) = default;
};

/// An output a kernel may write into the bytes of one of its inputs (an elementwise op whose
/// element i of the output depends only on element i of that input, of the same size and dtype):
/// the memory pass may then give the output's slot the input slot's very bytes where this act is
/// the last to read the input's piece (plan_memory.h). A permission for the memory pass, not a
/// request: without the memory plan, or where the input lives on, the output has bytes of its own.
struct InPlace {
  std::uint32_t output = 0;  // index into ActorDesc::outputs
  std::uint32_t input = 0;   // index into ActorDesc::inputs
  friend bool operator==(const InPlace&, const InPlace&) = default;
};

/// Where an actor runs: which rank, which device, which stream (worker thread) on it.
struct Placement {
  std::uint16_t rank = 0;
  Device device{};
  std::uint8_t stream = 0;
  friend bool operator==(const Placement&, const Placement&) = default;
};

/// An actor's input: a register, and how many pieces late the actor reads it. With delay d,
/// act k reads piece k - d and needs nothing for k < d (initial tokens; what lets a cycle
/// such as variable -> ... -> optimizer -> variable make progress).
struct InputPort {
  RegisterIndex reg = 0;
  std::int32_t delay = 0;
  friend bool operator==(const InputPort&, const InputPort&) = default;
};

/// A fixed order among the acts of several actors on one worker: a pipeline stage's schedule
/// (GPipe, 1F1B; baton/graph/schedule.h makes it). The actors of one lane (all on the same rank,
/// device and stream) act strictly in the order of their acts' keys, whatever arrives first: an
/// act whose turn has not come waits, even with its inputs there and its output slots free. Act
/// k of an actor has the key
///
///   (k / units.size() * period + units[k % units.size()], rank, actor index)
///
/// so `units` says where each piece of a period (one training step's M micro-batches) falls in
/// the period's sequence of `period` units, and `rank` orders the actors within a unit (a
/// topological order of the stage's ops); the actors of a lane share one period. The register
/// depths still bound what is in flight; the lane makes the order exact whatever the kernels
/// cost (a priority among ready actors cannot: the act that should come next may still be
/// waiting for its input). The order must be one the handshakes can follow: validate() refuses
/// a plan whose lanes deadlock. With a `lead` of L units, the actor's acts k < L come first
/// with keys (lead[k], rank, actor index) in the lane's one-time prefix, and act k >= L has
/// the key above of k - L.
struct ActOrder {
  /// -1: no lane; the actor acts as soon as it is ready.
  std::int32_t lane = -1;
  /// Per piece of a period: its unit (strictly increasing, each below `period`).
  std::vector<std::int32_t> units;
  std::int32_t period = 0;
  std::int32_t rank = 0;
  /// A one-time prefix (a pipeline's warm-up that is not repeated, PipeDream-2BW): the actor's
  /// first lead.size() acts come before the lane's first period, in (lead unit, rank) order
  /// with the other actors' leads; its later acts walk the period. Units >= 0, strictly
  /// increasing, not bounded by `period`. Empty: the lane is its period alone.
  std::vector<std::int32_t> lead;
  friend bool operator==(const ActOrder&, const ActOrder&) = default;
};

/// The kernels of one act that run one after another on the actor's stream (a segment, the
/// segments pass of graph/passes.h), for the memory plan: it times each register at the step
/// (0-based kernel) that uses it rather than at the act, so that what one kernel of the act
/// leaves behind may share bytes with what a later one writes (plan_memory.h). Empty: the act
/// is one step.
struct ActSteps {
  /// Per input: the last step that reads it.
  std::vector<std::int32_t> input_read;
  /// Per output: the step that writes it, and the last step of the act that reads it (the
  /// same step where no later step does).
  std::vector<std::int32_t> output_written;
  std::vector<std::int32_t> output_read;
  bool empty() const { return input_read.empty() && output_written.empty(); }
  friend bool operator==(const ActSteps&, const ActSteps&) = default;
};

struct ActorDesc {
  std::string name;
  ActorKind kind = ActorKind::compute;
  /// Kernel name in the registry (ignored for repeat; accumulate uses copy and add).
  std::string op;
  /// The dtype the kernel is looked up with.
  DType dtype = DType::f32;
  Placement where{};
  std::vector<InputPort> inputs;
  std::vector<RegisterIndex> outputs;
  /// Sources: pieces to emit (>= 0).
  std::int64_t pieces = 0;
  /// The piece number its kernel sees at its first act (KernelContext::piece = first_piece +
  /// act): a job resumed from a checkpoint numbers its pieces as the uninterrupted run would,
  /// so kernels that are functions of the piece (data sources, dropout, a step counter) go on
  /// where they left off. Register pieces (the handshakes) always count from 0.
  std::int64_t first_piece = 0;
  /// Repeat: output pieces per input piece; accumulate: input pieces per output piece.
  std::int32_t group = 1;
  /// Transfers only: -1 moves the producer's whole slot; w >= 0 moves a window of it, elements
  /// [w, w + numel(output)) of the input register (same dtype), which the producer offers
  /// straight from its slot: a collective's segment crosses without a slice copied out first.
  std::int64_t window = -1;
  Attrs attrs;
  /// Stop (and detach from the inputs) once every consumer of every output has detached. False
  /// for an actor whose acts matter beyond its outputs: a variable must still apply its last
  /// gradients after the forward pass has stopped reading the weights.
  bool stops_when_unread = true;
  /// For people and tools: what it does, and its pipeline stage (-1: none).
  ActorRole role = ActorRole::other;
  std::int32_t stage = -1;
  /// A backward op whose outputs feed only weight gradients (zero-bubble's W work: the weight's
  /// side of a matrix product's backward): a schedule that splits the backward may run it later
  /// than the input gradients (B) the stage before waits for.
  bool weight_gradient = false;
  /// An accumulate whose group is the whole run (it keeps the run's last piece: the trained
  /// weights gathered once at the end). It publishes once, after the run, so the dry run
  /// (validate()'s progress check), which proves the plan's steady state in a few of its
  /// iterations, neither counts its group into an iteration nor waits for what reads it.
  bool at_end = false;
  /// A copy between host and device memory (CopyDirection), or none.
  CopyDirection copy = CopyDirection::none;
  /// Transfers only: adds the piece it moves to the window of its own second input as it reads
  /// it (the fused receive-add of a collective's reduce step) instead of moving it as it is.
  bool adds = false;
  /// What the memory report counts this actor's outputs as, where its role alone would say
  /// otherwise (a ZeRO-3 gather acts in the pass, but what it writes is the weights).
  std::optional<MemoryCategory> memory;
  /// Reports the job's loss (loss.report): the rank it runs on speaks for the job.
  bool reports_loss = false;
  /// Its place in its worker's fixed order of acts, if it has one (pipeline schedules).
  ActOrder order{};
  /// Memory its kernel keeps beyond its registers, by category (KeptBytes).
  std::vector<KeptBytes> kept;
  /// Outputs its kernel may compute in place of an input (InPlace; compute actors only).
  std::vector<InPlace> in_place;
  /// Where its act runs several kernels in turn (ActSteps; compute actors on a stream only).
  ActSteps steps;
  friend bool operator==(const ActorDesc&, const ActorDesc&) = default;
};

struct RegisterDesc {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  /// Physical buffers on this edge: the depth of the pipe, the credit the producer has.
  std::int32_t slots = 2;
  /// Filled in by Plan::add_actor; checked by validate() in a hand-edited plan.
  ActorIndex producer = no_actor;
  std::vector<ActorIndex> consumers;
  /// The memory plan (plan_memory.h): the arena (Plan::arenas) its slots live in and each slot's
  /// byte offset there. -1 (and no offsets): the runtime allocates each slot on its own.
  std::int32_t arena = -1;
  std::vector<std::int64_t> offsets;
  /// Its one slot is memory the producer's kernel keeps (Kernel::owned_output: a weight its
  /// optimizer updates in place), which the kernel's ActorDesc::kept counts; the runtime
  /// allocates nothing for it (unless the kernel offers none). One slot, no arena.
  bool kernel_memory = false;
  friend bool operator==(const RegisterDesc&, const RegisterDesc&) = default;
};

/// One block of memory on one device of one rank that the runtime allocates once; the slots of
/// the registers placed in it (RegisterDesc::arena) point into it, and slots whose lives never
/// overlap share bytes (the memory pass, graph/passes.h; validate() checks them).
struct ArenaDesc {
  std::uint16_t rank = 0;
  Device device{};
  std::int64_t bytes = 0;
  friend bool operator==(const ArenaDesc&, const ArenaDesc&) = default;
};

struct Plan {
  std::vector<ActorDesc> actors;
  std::vector<RegisterDesc> registers;
  std::vector<ArenaDesc> arenas;

  RegisterIndex add_register(RegisterDesc r);
  /// Appends the actor and records it as producer / consumer of its registers.
  /// Throws std::invalid_argument for a register index out of range.
  ActorIndex add_actor(ActorDesc a);

  /// One line per arena, per register and per actor, in order; a register read across a stream
  /// boundary lists each consumer's EdgeSync (`sync=[...]`). The hash is taken over this text.
  std::string to_text() const;
  /// Graphviz: actors as nodes (clustered by rank/device/stream), registers as edges.
  std::string to_dot() const;
  /// FNV-1a 64 of to_text(): equal plans hash equal on every rank and every run.
  std::uint64_t hash() const;

  /// The actors placed on `rank`.
  std::vector<ActorIndex> actors_on(std::uint16_t rank) const;
  friend bool operator==(const Plan&, const Plan&) = default;
};

/// How a consumer of a register learns that a piece is there, and its producer that the slot is
/// free again, where asynchronous devices (CUDA, sim: baton/kernels/stream.h) are involved. The
/// *writer* is the register's producer, or through repeat actors (which only alias) the actor
/// that wrote the data. DESIGN.md section 3: the host waits for a stream only where the host
/// must see the data.
enum class EdgeSync : std::uint8_t {
  /// Writer and reader on the host (or the reader on another rank, from a host writer):
  /// requests and acks go out when the acts end.
  host,
  /// Written on a stream, read on the host or another rank: the request goes out when the
  /// writer's stream has reached the write (a host callback). Also between a collective that
  /// waits on its stream for its peers (NCCL's) and an actor on another stream, either way: a
  /// reader on a stream then acks once its stream has reached the read, and neither stream
  /// waits on the other's events.
  to_host,
  /// Written on the host, read on a stream: the ack goes out when the reader's stream has
  /// reached the read (a host callback).
  from_host,
  /// Both on one stream: stream order alone; requests and acks go out at enqueue time.
  same_stream,
  /// On two streams of the same kind (and rank): requests and acks go out at enqueue time; the
  /// reader's stream waits on an event recorded after the write, the writer's on one recorded
  /// after the read before it writes the slot again.
  event,
  /// A repeat actor reading what a stream wrote for readers that are all on streams: it
  /// forwards the request at once, and the write's event to its readers, their events back.
  alias,
};
std::string_view name(EdgeSync s);

/// The actor that wrote the data in `reg`: its producer, or through repeats the producer of the
/// repeat's input. no_actor if none.
ActorIndex data_writer(const Plan& plan, RegisterIndex reg);
/// Whether `a` is a view: a repeat of group 1 (ActorKind::repeat), reading its input without a delay.
bool is_view(const ActorDesc& a);
/// The register whose slots hold the bytes of `reg`: `reg` itself, or through repeats (views and
/// the weights' repeats, which allocate nothing) the register they alias.
RegisterIndex aliased_register(const Plan& plan, RegisterIndex reg);
/// Whether the bytes of `reg` are copied to a CUDA device (a `to_device` reader of it, or of a
/// view of it): such a register is page-locked host memory, so that the copy runs
/// asynchronously on a copy engine (the runtime's allocator and the memory plan agree by this).
bool copied_to_cuda(const Plan& plan, RegisterIndex reg);
/// Whether `a` enqueues its work on a stream: a compute, source or accumulate actor on a CUDA
/// or sim device (repeats only alias; transfers are the data plane's).
bool on_stream(const ActorDesc& a);
/// How consumer `consumer` of `reg` synchronizes with the register's writer (see EdgeSync).
EdgeSync edge_sync(const Plan& plan, RegisterIndex reg, ActorIndex consumer);

/// The plan with a transfer actor on the consumer's rank for every register read on another
/// rank than its producer's: one transfer per (register, consuming rank), placed on the
/// consumers' device and stream (the first consumer's), named "<register>@r<rank>", writing
/// a local register "<register>@r<rank>" with the same shape, dtype and slots. The consumers
/// on that rank read the local copy instead. A plan without cross-rank edges comes back
/// unchanged; applying it twice changes nothing more.
Plan insert_transfers(const Plan& plan);

/// The stream that insert_device_copies() puts copies between host and device on: a worker
/// (and CUDA stream) of its own, so that copies overlap the device's compute.
inline constexpr std::uint8_t device_copy_stream = 15;

/// The stream of a copy from asynchronous device `from` onto another of the same rank (on the
/// consuming device): one per producing device, so that a copy whose stream waits for one
/// device's kernel holds up no copy from another. A pipeline stage receives activations from
/// the stage before and gradients from the stage after; on one copy stream the gradient's
/// copy queued behind the next activation's wait, and 1F1B on sim devices lost about one
/// forward's time per micro-batch (4 stages, M 16: idle 0.37 against the formula's 0.16).
constexpr std::uint8_t peer_copy_stream(Device from) {
  return static_cast<std::uint8_t>(16 + from.index % 240);
}

/// The plan with a copy actor for every register read on the same rank but on another device,
/// where one of the two is an asynchronous device (CUDA or sim; "CUDA" below stands for
/// both): "to_device" on the consumers' device (host -> device,
/// or device -> device) or "to_host" on the producer's CUDA device (device -> host: its register
/// is page-locked host memory). One copy per (register, consuming device), on stream
/// device_copy_stream (between host and device) or peer_copy_stream(producer's device)
/// (between devices), named "<register>@<device>", writing a register of that name with the
/// same shape, dtype and slots; the consumers on that device read it instead. Registers between
/// two CPU devices stay as they are (host memory is shared); so does a plan without CUDA
/// actors. Registers between ranks go through host memory (this UCX moves host memory only):
/// a CUDA register read on another rank gets a to_host copy on its rank, and one read by a CUDA
/// actor of another rank gets its transfer (insert_transfers) there now, on that rank's CPU
/// device of the same index, with a to_device copy after it. Applying it twice changes nothing
/// more.
Plan insert_device_copies(const Plan& plan);

}  // namespace baton
