#pragma once
// Internals of the runtime: the actor state machine, worker threads and the runtime core.
// Not installed; nothing outside actors/src includes this.
#include <array>
#include <chrono>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "baton/actors/activity.h"
#include "baton/actors/clock.h"
#include "baton/actors/local_queue.h"
#include "baton/actors/mailbox.h"
#include "baton/actors/message.h"
#include "baton/actors/metrics.h"
#include "baton/actors/outbox.h"
#include "baton/actors/plan.h"
#include "baton/actors/runtime.h"
#include "baton/actors/settings.h"
#include "baton/actors/simulate.h"
#include "baton/kernels/allocator.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/nccl.h"
#include "baton/kernels/stream.h"
#include "baton/transport/link.h"
#include "baton/transport/shared_memory.h"

namespace baton::detail {

class Actor;
class Worker;
struct Core;

inline constexpr std::int64_t never = std::numeric_limits<std::int64_t>::max();

// The hot path's arithmetic on piece numbers. Pieces and acts count in 64 bits, and a 64-bit
// division costs tens of cycles on x86 (40-90 on Intel cores before Ice Lake): the two dozen an
// act did were most of a same-thread hop's cost after its clock reads (bench actors). The
// divisors are small and mostly 1 (acts per piece) or a power of two (slots), so those take no
// division, and the others a 32-bit one while the piece fits (it does for 2^32 pieces).

/// The slot of piece `piece` (>= 0) in a register of `slots` (>= 1) slots: piece % slots.
inline std::size_t slot_of(std::int64_t piece, std::int32_t slots) {
  const auto p = static_cast<std::uint64_t>(piece);
  const auto n = static_cast<std::uint32_t>(slots);
  if ((n & (n - 1)) == 0) return static_cast<std::size_t>(p & (n - 1));
  if (p <= 0xffffffffu) return static_cast<std::uint32_t>(p) % n;
  return static_cast<std::size_t>(p % n);
}

/// a / d and a % d for a count a >= 0 and the acts per piece d >= 1 (mostly 1).
inline std::int64_t count_div(std::int64_t a, std::int64_t d) { return d == 1 ? a : a / d; }
inline std::int64_t count_mod(std::int64_t a, std::int64_t d) { return d == 1 ? 0 : a % d; }

/// A consumer of one output register, as its producer sees it.
struct Consumer {
  ActorId id;
  Worker* worker = nullptr;            // null: on another rank (through the data plane)
  std::int64_t acked = 0;              // pieces acked so far (acks come in piece order)
  std::int64_t detached_from = never;  // pieces >= this will not be read
  std::int64_t from = 0;               // pieces < this are not its (a rank that came back)
  /// What a consumer on another rank pulls of each slot: bytes [offset, offset + bytes), the
  /// whole slot or a transfer's window (ActorDesc::window).
  std::size_t offset = 0;
  std::size_t bytes = 0;
  std::size_t port = 0;  // the consumer's input port of this register (payload_tag)
  /// How its pieces reach it: offered for its receive to pull, inline with the requests
  /// (RuntimeSettings::inline_payload_bytes), or read where they lie (mapped:
  /// RuntimeSettings::shared_registers). Decided at the first request, once the data plane
  /// knows its transport to the peer, and kept: a pulled piece is acked when it lands and the
  /// others at the act, and a transfer acks its inputs in piece order, so one input never
  /// mixes pulled pieces with the others.
  enum class Way : std::uint8_t { undecided, pulled, inline_payload, mapped } way = Way::undecided;
  std::uint64_t sent = 0;  // pieces requested of it, the way above (RunReport::pieces_*)
};

/// A device's register bytes in use, with the most ever (RuntimeSettings::measure_memory).
struct InUse {
  std::atomic<std::int64_t> now{0};
  std::atomic<std::int64_t> peak{0};
  void add(std::int64_t bytes) {
    const std::int64_t v = now.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::int64_t p = peak.load(std::memory_order_relaxed);
    while (v > p && !peak.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
    }
  }
  void sub(std::int64_t bytes) { now.fetch_sub(bytes, std::memory_order_relaxed); }
};

/// A register this actor produces: its slots and who still reads each.
struct Output {
  RegisterIndex reg = 0;
  std::int32_t slots = 1;
  std::vector<Tensor> buffers;        // one per slot; a repeat re-points them at its input
  std::vector<std::int32_t> pending;  // per slot: consumers yet to ack the piece in it
  std::vector<Consumer> consumers;
  std::int32_t live = 0;              // consumers not detached
  std::int32_t joining = 0;           // of those, how many read from a piece not yet written
  std::int64_t written = 0;           // pieces published; piece p lives in slot p % slots
  std::int64_t freed = 0;             // pieces acked by every live consumer (in order)
  std::int32_t max_outstanding = 0;
  // Stream-ordered handshakes (an actor on a stream, or a repeat aliasing what one wrote):
  // per consumer, whether its requests wait for the stream to reach the write (EdgeSync::to_host).
  std::vector<bool> deferred;
  bool any_deferred = false;
  // Per slot: what a reader on another stream waits for before reading (an event recorded
  // after the write; a repeat forwards its input's). Null: nothing to wait for.
  std::vector<const StreamEvent*> ready;
  std::vector<std::unique_ptr<StreamEvent>> ready_events;  // the writer's own, per slot
  // Per consumer, per slot: events its readers recorded after their reads (left here before
  // their ack); the writer's stream waits for them before it writes the slot again.
  std::vector<std::vector<std::vector<const StreamEvent*>>> done;
  // RuntimeSettings::measure_memory (null in_use: not measured): the device's count, the bytes
  // of a slot, and per slot the readers yet to finish with its piece. Readers on this rank
  // count themselves down when they release a piece (not when the ack reaches the writer, which
  // may be later than the plan's lives assume); the writer counts down readers on other ranks
  // as their acks arrive and readers that detach.
  InUse* in_use = nullptr;
  std::int64_t slot_bytes = 0;
  std::unique_ptr<std::atomic<std::int32_t>[]> unread;
  // A view's output (a repeat of group 1) over a counted input: once its readers are done with
  // a piece, the input's slot is counted down for the view (`counts_slot`: the input slot each
  // of its slots aliases), when the plan's lives end, not when the view's own release gets to
  // run on its worker.
  Output* counts_for = nullptr;
  std::vector<std::size_t> counts_slot;
  bool counted() const { return in_use != nullptr || counts_for != nullptr; }
  void reader_done(std::size_t slot) {
    if (unread[slot].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (in_use != nullptr) {
      in_use->sub(slot_bytes);
    } else {
      counts_for->reader_done(counts_slot[slot]);
    }
  }
  // Mirrors for the metrics reader (relaxed, written by the owner only).
  std::atomic<std::int64_t> written_seen{0};
  std::atomic<std::int64_t> freed_seen{0};
  std::atomic<std::int32_t> max_outstanding_seen{0};
};

/// A register this actor reads (once, however many of its ports bind it).
struct Input {
  RegisterIndex reg = 0;
  std::int32_t delay = 0;
  std::int32_t slots = 1;
  ActorId producer;
  Worker* producer_worker = nullptr;  // null: on another rank (through the data plane)
  std::uint8_t consumer_index = 0;  // our place in the register's consumer list
  Output* source = nullptr;         // the producer's slots, read in place (null if remote)
  std::int64_t received = 0;        // requests seen: pieces [released, received) are readable
  std::int64_t released = 0;        // pieces acked back to the producer
  std::int64_t end = -1;            // total pieces, once end-of-stream arrived
  bool detached = false;
  /// Pieces below this read as zeros and nothing goes back: its producer's rank left the job
  /// (Runtime::rank_left: `never`), or came back from this piece on (Runtime::rank_rejoined).
  std::int64_t zeros_until = 0;
  EdgeSync sync = EdgeSync::host;   // with the data's writer (plan.h)
  // EdgeSync::event: per slot, recorded on this actor's stream after its last read of the slot.
  std::vector<std::unique_ptr<StreamEvent>> done_events;
  // RuntimeSettings::measure_memory: a piece whose read this actor counted down before writing
  // its output into the same bytes (ActorDesc::in_place), so its release does not count again.
  std::int64_t counted_early = -1;
  // A transfer's input from another rank: the bytes it reads of each piece; and per producer
  // slot, where the piece in it may be read already (null: it is pulled). Set on the data
  // plane's thread before the request is posted: into `staging` (a producer's slots' worth,
  // allocated at the first) for a piece that came inline (MsgKind::request_inline), or the
  // producer's slot itself, mapped (MsgKind::request_mapped); cleared by the act that copies it.
  std::size_t piece_bytes = 0;
  std::unique_ptr<std::byte[]> staging;
  std::vector<const std::byte*> arrived;
  std::vector<const std::byte*> prefaulted;  // per slot: the producer's slot last prefaulted
  transport::PeerSegment segment;            // the producer's segment its last piece lay in
};

/// The acts of one lane (ActOrder) in one period, in the order of their keys, and whose turn it
/// is. The keys of every period repeat the first one's (a lane's actors share a period), so
/// the turn walks this list round and round, after walking the lane's prefix (the actors'
/// leads) once. Only the lane's worker thread touches it.
struct Lane {
  struct Act {
    std::int32_t unit = 0;
    std::int32_t rank = 0;
    ActorIndex index = 0;
    Actor* actor = nullptr;
  };
  std::int32_t id = 0;
  std::vector<Act> prefix;  // filled before start(): the leads' acts
  std::vector<Act> period;  // filled before start(): one period's acts
  std::vector<Act> acts;    // start(): the sorted prefix, then the sorted period
  std::size_t loop = 0;     // where the period starts in `acts`
  std::size_t at = 0;       // the act whose turn it is
  Actor* turn = nullptr;    // acts[at]'s actor; null once every actor has finished
  /// Sorts the prefix and the period and gives the turn to the first act.
  void start();
  /// The turn moves on: past the act just done (if `acted`), then past the acts of actors that
  /// have finished.
  void move_on(bool acted);
};

/// Per-actor counters: written by the owning thread with relaxed stores, read by anyone.
struct alignas(64) ActorCounters {
  std::atomic<std::uint64_t> acts{0};
  std::atomic<std::uint64_t> bytes_in{0};
  std::atomic<std::uint64_t> bytes_out{0};
  std::array<std::atomic<std::uint64_t>, 4> ticks{};  // busy, starved, backpressured, transferring
  std::atomic<std::uint64_t> kernel_ticks{0};          // the part of busy spent in kernels
  std::atomic<std::uint64_t> device_ns{0};             // kernels' time on the device (device_time)
  std::atomic<std::uint64_t> since{0};
  std::atomic<ActorActivity> activity{ActorActivity::starved};
  std::atomic<bool> in_kernel{false};  // sampled accounting: inside the act's kernel part
};

/// The actor state machine (DESIGN.md section 3). Acts when every input has a readable
/// piece and every output a free slot; after acting it requests its consumers and acks its
/// producers. Only its worker thread calls its methods.
class Actor {
 public:
  Actor(Core& core, const ActorDesc& desc, ActorIndex index, ActorId id);
  /// Wiring, after every actor exists: first every actor's outputs (slots, buffers,
  /// consumers), then every actor's inputs (which point at their producers' slots) and kernel.
  void wire_outputs();
  void wire_inputs();
  void on_message(const Message& m);
  /// On the data plane's thread, before the request_inline `m` is posted to this (transfer)
  /// actor: copies its payload into the input's staging. Empty, or what is wrong.
  std::string stage(const Message& m, const void* payload, std::size_t size);
  /// The same for a request_mapped: maps where its piece lies in the producer's memory.
  std::string map_piece(const Message& m, const transport::SharedLocation& at);
  /// Before the run starts (before any worker thread): its lifetime begins now.
  void begin(std::uint64_t start_ticks);

  ActorId id() const { return id_; }
  ActorIndex plan_index() const { return index_; }
  const std::string& name() const { return desc_.name; }
  Worker* worker() const { return worker_; }
  void set_worker(Worker* w) { worker_ = w; }
  bool retired() const { return retired_; }
  std::uint64_t acts() const { return acts_; }
  Output* output_for(RegisterIndex reg);
  const Output* output_for(RegisterIndex reg) const { return const_cast<Actor*>(this)->output_for(reg); }
  void set_lane(Lane* l) { lane_ = l; }
  bool finished() const { return finished_; }
  /// Whether this actor exchanges a register with an actor on `rank` (any thread: the wiring
  /// does not change once the run starts).
  bool talks_to(std::uint32_t rank) const;
  /// Could act now (not finished, every input readable, every output slot free, its turn).
  bool ready() const { return !finished_ && next_block() == Block::none; }
  const ActorCounters& counters() const { return counters_; }
  /// The sampler's (sampled time accounting), which books the time buckets the actor's thread
  /// then leaves alone.
  ActorCounters& counters_for_sampler() { return counters_; }
  const ActorDesc& desc() const { return desc_; }
  /// After the run (threads joined): adds how its pieces crossed to other ranks.
  void count_crossings(RunReport& report) const;
  /// After the run (threads joined): what this actor was waiting for, in words.
  std::string describe_wait() const;
  /// The next piece each input needs; -1 if none.
  std::int64_t needed_piece(const Input& in) const;

 private:
  enum class Block : std::uint8_t { none, starved, backpressured, finish, unread, transferring, turn, enough };
  Block next_block() const;
  Block next_block_of_stream() const;
  void act_transfer();
  /// A reducing transfer's addend for `piece`: its window of the own input's slot.
  const void* addend(const Input& own, std::int64_t piece) const;
  void on_pulled(const Message& m);
  void landed(std::uint16_t slot);
  void on_stream_reached(const Message& m);
  /// What act k hands on: `all` for an act that is over (host actors, deterministic mode);
  /// `enqueued` right after an act on a stream was enqueued (what stream order or events
  /// cover); `reached` once the stream has run it (what the host had to wait for).
  enum class Handoff : std::uint8_t { all, enqueued, reached };
  void after_act(std::int64_t k, Handoff h = Handoff::all);
  void count_in_place_reads(std::int64_t k);
  void adopt_kernel_memory();
  void wait_for_readers(Output& out, std::size_t slot);
  void wire_streams();
  void advance();
  void act();
  void run_kernel(std::int64_t k, bool opens_group, bool closes_group);
  // The slot of the piece act k writes: k / out_group_, not out.written, which counts only
  // published pieces and lags behind while acts are in flight on a stream (a second act
  // enqueued before the first was reached would otherwise write the first one's slot).
  std::size_t slot_written(const Output& out, std::int64_t k) const {
    return slot_of(count_div(k, out_group_), out.slots);
  }
  bool wait_for_stream(std::int64_t k, bool closes_group);
  /// Piece `piece` of `out` is written: with Handoff::all or ::enqueued it is the next one
  /// (out.written), booked here; with ::reached only the requests that waited go out.
  void publish(Output& out, std::int64_t piece, Handoff h = Handoff::all);
  void request(Output& out, std::int64_t piece, std::size_t consumer);
  void release(Input& in, std::int64_t piece);
  bool defers_ack(const Input& in) const;
  void advance_freed(Output& out);
  void release_repeat_inputs();
  void finish(bool unread);
  void retire_if_done();
  /// Books the time since the last change to the activity that ends now; returns the tick it
  /// read (0: none, as the activity did not change or time accounting is off).
  std::uint64_t set_activity(ActorActivity a);
  void pass_turn(bool acted);
  /// Inline (below Core): an act sends two or three messages, and a message built at the call
  /// and then copied out of memory into the queue's slot costs a store-forwarding stall (its
  /// fields are stored one by one, then read 16 bytes at a time), about a fifth of a
  /// same-thread hop; inlined, its fields go straight into the slot.
  void send(Worker* to, const Message& m);
  void on_request(const Message& m);
  void on_ack(const Message& m);
  void on_eos(const Message& m);
  void on_detach(const Message& m);
  void on_rank_left(std::uint32_t rank);
  void on_hold_for_rejoin(std::uint32_t rank);
  void on_rank_rejoined(std::uint32_t rank, std::int64_t step);
  Input* input_for(RegisterIndex reg);
  void protocol_error(const Message& m, const char* what);

  Core& core_;
  const ActorDesc& desc_;
  ActorIndex index_;
  ActorId id_;
  Worker* worker_ = nullptr;
  Lane* lane_ = nullptr;
  std::unique_ptr<Kernel> kernel_;
  std::unique_ptr<Kernel> copy_kernel_;  // accumulate: the first piece of a group
  std::vector<Input> inputs_;
  std::vector<std::unique_ptr<Output>> outputs_;
  std::vector<std::uint32_t> port_to_input_;
  std::vector<const Tensor*> in_view_;
  std::vector<Tensor*> out_view_;
  std::int64_t in_ratio_ = 1;   // acts per input piece (repeat: group)
  std::int64_t out_group_ = 1;  // acts per output piece (accumulate: group)
  std::int64_t acts_ = 0;
  std::int32_t outputs_read_ = 0;  // outputs that had consumers at the start
  std::int32_t outputs_dead_ = 0;  // of those, how many lost every consumer to detach
  std::uint64_t bytes_in_per_act_ = 0;
  std::uint64_t bytes_out_per_act_ = 0;
  // Transfer actors: pulls issued but not yet published, and which slots have landed (every
  // input's part of them: pulls_left_ counts down the receives of each slot's act).
  std::int64_t inflight_ = 0;
  std::vector<bool> pulled_;
  std::vector<std::uint16_t> pulls_left_;
  std::vector<std::size_t> port_bytes_;  // per input port: where its piece lands in the slot
  std::vector<std::uint64_t> pull_started_;  // per slot, for the activity log
  // A reducing transfer (reduces()): where its addend starts in its own input's slot, and per
  // slot whether the piece was pulled and still needs the addend when it has landed.
  bool reduces_ = false;
  bool orphaned_ = false;  // an input's rank left (Input::zeros_until)
  std::int32_t held_ = -1;  // a rank coming back (Runtime::hold_for_rejoin): no acts meanwhile
  std::size_t own_offset_ = 0;
  std::vector<bool> add_on_landing_;
  // Actors on a CUDA or sim device: the stream their kernels enqueue on (and the same as a CUDA
  // stream, for CUDA kernels), whether handshakes follow stream order (not in deterministic
  // mode, which waits for the stream after every act), and the acts whose requests or acks
  // wait for the stream to reach them (counted in inflight_ too, so the actor does not finish
  // before they went out).
  AsyncStream* stream_ = nullptr;
  cuda::Stream* cuda_stream_ = nullptr;
  bool stream_ordered_ = false;
  bool wait_every_act_ = false;  // RuntimeSettings::stream_order off
  bool needs_reached_ = false;  // some output defers requests or some input defers acks
  // Acts whose handoff waits for the stream, in act order, each with what its callback posts.
  // The actor owns them: a failed stream never runs its callbacks (AsyncStream::when_reached),
  // and what they would have freed must not leak.
  struct Reached {
    Worker* worker;
    Message m;
  };
  std::deque<std::unique_ptr<Reached>> on_stream_;
  // RuntimeSettings::device_time: timing events around acts the device has not run yet (in act
  // order), and spare pairs.
  struct Timing {
    std::unique_ptr<StreamEvent> start, end;
  };
  std::deque<Timing> timings_;
  std::vector<Timing> spare_timings_;
 public:
  /// Books the device time of the timed acts the device has run; all of them if `all` (after
  /// the streams drained). The actor's thread, or any once the workers have stopped.
  void collect_device_time(bool all);
 private:
  // A repeat: the events its readers left for the pieces of each input piece (group), handed
  // to the input's writer with the ack of that piece.
  std::map<std::int64_t, std::vector<const StreamEvent*>> repeat_done_;
  bool finished_ = false;
  bool retired_ = false;
  /// Its last act took less than RuntimeSettings::hold_messages_ns (timed only where messages
  /// are held): its worker's held messages may wait through the next.
  bool brief_ = false;
  ActorActivity activity_ = ActorActivity::starved;
  std::uint64_t since_ = 0;
  ActorCounters counters_;
};

/// One thread per (device, stream): owns its actors, drains its local queue and mailbox,
/// spins briefly when idle, then parks.
class Worker {
 public:
  Worker(Core& core, Device device, std::uint8_t stream, std::size_t mailbox_capacity, std::uint16_t index);
  ~Worker();

  /// Owner thread (an actor on this worker): to a local actor through the local queue,
  /// to another thread's through its mailbox.
  void send(Worker* to, const Message& m) {
    if (to == nullptr) {
      send_remote(m);
    } else if (to == this) {
      local_.push(m);
    } else {
      to->mailbox_.push(m);
    }
  }
  /// Any thread.
  void post(const Message& m) { mailbox_.push(m); }
  /// The data plane's handlers, on whichever thread progresses the link: a message from another
  /// rank. Straight into the local queue where that thread is this worker's own (it polled the
  /// link while idle) and nothing from before waits in the mailbox, which it would overtake;
  /// else into the mailbox.
  void deliver(const Message& m);
  /// Deterministic mode, before drain(): queue a message behind the ones already queued.
  void enqueue_local(const Message& m) { local_.push(m); }
  void close() { mailbox_.close(); }
  /// Owner thread, before an act: sends what the outbox holds unless the act is expected to be
  /// brief (its actor's last act was) and nothing held has waited long
  /// (RuntimeSettings::hold_messages_ns).
  void before_act(bool brief) {
    if (!outbox_.empty() && (!brief || ticks() - outbox_.since() >= hold_ticks_)) flush_outbox();
  }
  /// Owner thread: whether an act that took `act_ticks` counts as brief.
  bool brief(std::uint64_t act_ticks) const { return act_ticks < hold_ticks_; }
  /// Whether messages to other ranks may wait in the outbox (then acts are timed for brief()).
  bool holds_messages() const { return hold_ticks_ > 0; }
  /// Owner thread: sends everything the outbox holds.
  void flush_outbox();
  /// Owner thread: before a message goes to `rank` another way (with its payload, or saying
  /// where it lies): what the outbox holds for that rank goes first, in order.
  void flush_outbox_to(std::uint32_t rank);
  /// Owner thread: a message to another rank went in a link message of its own, with what it
  /// needs (its payload, where its piece lies).
  void count_link_message() {
    ++messages_to_other_ranks_;
    ++link_messages_;
  }
  std::uint64_t messages_to_other_ranks() const { return messages_to_other_ranks_; }
  std::uint64_t link_messages() const { return link_messages_; }
  /// A simulation (simulate.h): dispatches `m` and moves what the dispatch sent to this
  /// worker's own actors (the whole plan's, one worker) into `sent`, in order.
  void dispatch_simulated(const Message& m, std::vector<Message>& sent) {
    dispatch(m);
    while (auto next = local_.pop()) sent.push_back(*next);
  }
  /// Threaded mode: loops until closed.
  void run();
  /// Deterministic mode: processes messages until none is left (or the run failed).
  void drain();
  void start_thread();
  void join();

  Device device() const { return device_; }
  std::uint8_t stream() const { return stream_; }
  std::uint64_t messages() const { return messages_.load(std::memory_order_relaxed); }
  std::uint64_t parks() const { return mailbox_.parks(); }
  std::uint16_t index() const { return index_; }
  /// Owner thread: appends to this worker's activity ring (drops it if the ring is full).
  void log(const ActRecord& r);
  /// The one draining thread (Core::activity_mutex held).
  std::size_t drain_log(std::vector<ActRecord>& out);
  std::uint64_t log_dropped() const { return log_dropped_.load(std::memory_order_relaxed); }

 private:
  void dispatch(const Message& m);
  void send_remote(const Message& m);
  void send_link_message(const Message* messages, std::size_t n);
  /// What the outbox hands a full or flushed link message to.
  auto sender() {
    return [this](std::uint32_t, const Message* messages, std::size_t n) { send_link_message(messages, n); };
  }
  /// After a dispatch: with no local work left, nothing held waits any longer.
  void after_dispatch() {
    if (local_.empty() && !outbox_.empty()) flush_outbox();
  }

  Core& core_;
  Device device_;
  std::uint8_t stream_;
  Mailbox mailbox_;
  LocalQueue local_;
  Outbox outbox_;
  std::uint64_t hold_ticks_ = 0;  // RuntimeSettings::hold_messages_ns in ticks; 0: hold nothing
  std::uint64_t messages_to_other_ranks_ = 0;  // owner thread; read once the threads are joined
  std::uint64_t link_messages_ = 0;
  std::thread thread_;
  std::atomic<std::uint64_t> messages_{0};
  std::uint16_t index_;
  struct Ring;
  std::unique_ptr<Ring> ring_;  // the activity log (boost::lockfree::spsc_queue)
  std::atomic<std::uint64_t> log_dropped_{0};
};

/// Link tags for payloads: the transfer actor that pulls, the input port it lands through (a
/// transfer with several inputs gathers them, each into its own part of the slot) and the piece
/// (modulo 2^20: at most 65535 pieces of a register are in flight, so a tag is unique while it
/// is in use). The transfer, not the register: several transfers on one rank may pull windows
/// of one register (ActorDesc::window). Fits the data plane's 48 bits.
inline constexpr std::uint32_t max_actors_across_ranks = 1u << 20;
inline std::uint64_t payload_tag(ActorIndex transfer, std::size_t port, std::int64_t piece) {
  return (std::uint64_t{transfer} << 28) | (std::uint64_t{port} << 20) |
         (static_cast<std::uint64_t>(piece) & ((1u << 20) - 1));
}

/// What a request_mapped carries: the request, and where its piece lies in the producer's
/// memory (Link::max_message bytes at most).
struct MappedRequest {
  Message m;
  transport::SharedLocation at;
};
static_assert(std::is_trivially_copyable_v<MappedRequest>);
static_assert(sizeof(MappedRequest) <= transport::Link::max_message);

/// The state one Runtime owns (Runtime::Impl). It is also the data plane's handler: messages
/// from other ranks go to their actor's mailbox, finished pulls to their transfer actor.
struct Core : transport::LinkHandler {
  Core(Plan p, const KernelRegistry* k, RuntimeSettings s, bool dry_run);
  ~Core() override;

  void on_message(std::uint32_t from_rank, const void* data, std::size_t size) override;
  void on_message_with_payload(std::uint32_t from_rank, const void* data, std::size_t size, const void* payload,
                               std::size_t payload_size) override;
  void on_payload(std::uint64_t cookie) override;
  /// Several plain messages in one link message (Worker's outbox).
  void on_messages(std::uint32_t from_rank, const void* data, std::size_t size);
  void on_link_error(const std::string& reason) override;
  bool on_peer_error(std::uint32_t peer, const std::string& reason) override;
  /// Under `mutex`: a peer error whose rank has not left within RuntimeSettings::
  /// departure_grace, as the reason the run fails; empty if none (errors of ranks that left go).
  std::string overdue_peer_error();
  struct PeerError {
    std::uint32_t peer;
    std::chrono::steady_clock::time_point deadline;
    std::string reason;
  };
  std::vector<PeerError> peer_errors;  // under `mutex`
  void send_remote(const Message& m, const void* payload = nullptr, std::size_t payload_size = 0);
  /// `n` messages for actors of one other rank (Outbox::per_link_message at most) in one link
  /// message, in order.
  void send_remote_batch(const Message* m, std::size_t n);
  /// send_remote_batch's send, of messages numbered as the other rank numbers them.
  void send_shifted_batch(const Message* m, std::size_t n);
  /// A request_mapped: `m` and where its piece lies.
  void send_remote_mapped(const Message& m, const transport::SharedLocation& at);
  /// Where [data, data + bytes) lies in this rank's shared memory, if a reader on `rank` can
  /// read it there (RuntimeSettings::shared_registers, the link's word that `rank` shares the
  /// host, and the bytes in a segment).
  std::optional<transport::SharedLocation> locate_shared(std::uint32_t rank, const void* data, std::size_t bytes) const;
  Actor* receiver(std::uint32_t from_rank, const Message& m);

  void instantiate();
  void fail(std::string reason);
  /// Runtime::rank_left.
  void rank_left(std::uint32_t rank, const std::string& reason);
  /// Whether rank `rank` has left (any thread): messages to it are dropped, from it ignored.
  bool departed(std::uint32_t rank) const {
    return rank < departed_ranks && departed_flags[rank].load(std::memory_order_acquire);
  }
  /// Runtime::hold_for_rejoin, rank_rejoined, release_hold.
  std::int64_t hold_for_rejoin(std::uint32_t rank, std::chrono::milliseconds timeout);
  void rank_rejoined(std::uint32_t rank, std::int64_t step, std::chrono::milliseconds timeout);
  /// Posts `m` (its dst set to each) to every local actor that talks to `rank`; returns how many.
  std::int64_t post_to_peers_of(std::uint32_t rank, Message m);
  /// An actor's answer to hold_for_rejoin (its first step) or to rank_rejoined (0).
  void answer_rejoin(std::int64_t step);
  /// Waits for `expected` answers; false if `timeout` passed or the run failed.
  bool wait_for_answers(std::int64_t expected, std::chrono::milliseconds timeout);
  std::int64_t rejoin_answers = 0;  // under `mutex`
  std::int64_t rejoin_step = 0;     // under `mutex`: the largest answer
  /// Pieces of each register a step: the plan's acts per iteration (an iteration is a step: the
  /// variables act once a step) over the producer's acts per piece. Empty if the plan has none.
  std::vector<std::int64_t> pieces_per_step;
  /// RuntimeSettings::rejoin_step: what to add to a piece of each register that crosses to
  /// another rank (empty: nothing).
  std::vector<std::int64_t> piece_shift;
  std::int64_t shift(RegisterIndex reg) const { return piece_shift.empty() ? 0 : piece_shift[reg]; }
  /// `m` as the other rank numbers its piece (RuntimeSettings::rejoin_step).
  Message shifted(Message m) const {
    m.piece += shift(m.reg);
    return m;
  }
  std::size_t departed_ranks = 0;
  std::unique_ptr<std::atomic<bool>[]> departed_flags;
  std::vector<std::string> departures;  // under `mutex`: "rank r: reason", in order
  std::vector<std::string> rejoins;     // under `mutex`: "rank r at step s", in order
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  void on_retired();
  Actor* actor(ActorId id) { return actors[id.index()].get(); }
  MetricsSnapshot snapshot() const;
  std::string describe_stuck() const;
  void record(const Message& m);
  // Dry run (validation): stop once every actor has acted its target number of times (the plan
  // keeps going) or the act budget is spent.
  bool dry_budget_spent() const { return dry_spent; }
  std::int64_t dry_target_of(ActorIndex actor) const {
    if (!dry_after_end.empty() && dry_after_end[actor]) return 0;
    return dry_targets.empty() ? dry_target : dry_targets[actor];
  }
  /// Acts past which a dry run's actor stops (it has proven what it can): none in the long check.
  bool dry_enough(ActorIndex actor, std::int64_t acts) const { return !dry_limits.empty() && acts >= dry_limits[actor]; }
  bool dry_after(ActorIndex actor) const { return !dry_after_end.empty() && dry_after_end[actor]; }
  void count_dry_act(ActorIndex actor, std::int64_t acts_so_far);
  void count_dry_reached();
  /// instantiate()'s last step in a dry run: the targets, limits and act budget that decide
  /// when the check has seen enough.
  void size_dry_run();
  /// A simulation (simulate.h): a dry run on a virtual clock. Sources emit their real piece
  /// counts, each dispatch runs at most one act (dry_spent is set from the start, so an actor
  /// stops after each act and simulate() asks it again when the act has ended), and an act of
  /// actor a moves sim_now on by (*sim_seconds)[a].
  bool simulated = false;
  const std::vector<double>* sim_seconds = nullptr;
  double sim_now = 0;
  /// The actor whose act the last dispatch ran (no_actor: none), and every act, if recorded.
  ActorIndex sim_acted = no_actor;
  std::vector<SimulatedAct>* sim_acts = nullptr;

  Plan plan;
  const KernelRegistry* kernels;  // null in a dry run
  RuntimeSettings settings;
  bool dry_run;
  /// Idle workers keep polling instead of parking (RuntimeSettings::idle_polling), and why.
  bool busy_poll = false;
  std::string idle_polling;
  /// The ranks this one exchanges registers with.
  std::set<std::uint16_t> peers;
  std::map<Device, std::unique_ptr<CpuAllocator>> allocators;
  /// RuntimeSettings::measure_memory: register bytes in use per device of this rank (made while
  /// wiring, before any worker runs; outlives the actors that point here).
  std::map<Device, InUse> in_use;
  /// CUDA devices' memory, and page-locked host memory for registers copied to or from them.
  std::map<Device, std::unique_ptr<Allocator>> device_allocators;
  std::unique_ptr<Allocator> pinned;
  /// RuntimeSettings::shared_registers: the host memory of registers read on other ranks (made
  /// at the first; null if none), and the producers' memory this rank's transfers read.
  std::unique_ptr<transport::SharedSegments> shared_segments;
  std::unique_ptr<Allocator> shared_allocator;
  std::vector<std::int8_t> arena_shared;  // per arena: -1 not known yet, 0 no, 1 yes
  transport::PeerSegments peer_segments;
  /// Whether the slots of host register `reg` go in shared memory.
  bool read_on_other_ranks(RegisterIndex reg);
  CpuAllocator& allocator_for_host(Device d);
  /// Where the slots of `reg`, written by `producer`, live.
  Allocator& allocator_for(const ActorDesc& producer, RegisterIndex reg);
  /// The plan's arenas on this rank (Plan::arenas; allocated on first use, null elsewhere) and
  /// a handle per slot placed in one. After the allocators (freed before them), before the
  /// actors (whose slots point into them).
  struct Arena;
  std::vector<std::unique_ptr<Arena>> arenas;
  std::vector<std::unique_ptr<Allocator>> arena_slots;
  /// Slot `slot` of `reg` (written by `producer`): its place in its arena, or memory of its own.
  Tensor register_slot(const ActorDesc& producer, RegisterIndex r, std::size_t slot);
  /// The stream of a (device, stream) placement on a CUDA or sim device, made on first use.
  AsyncStream& stream_for(const Placement& where);
  /// Waits until every stream has run what was enqueued (or `limit` passed, if > 0); returns
  /// why not ("" when all are idle): a stream's failure or the time-out.
  std::string drain_streams(std::chrono::milliseconds limit);
  /// "<error>; actors on that stream: '<name>' (<acts> acts enqueued), ..."
  std::string describe_stream_failure(const std::pair<Device, std::uint8_t>& where, const std::string& why) const;
  std::vector<std::unique_ptr<Actor>> actors;  // by plan index; null if on another rank
  std::vector<std::unique_ptr<Worker>> workers;
  std::map<std::int32_t, Lane> lanes;  // by ActOrder::lane, for the local actors
  // Written once by run(), read by snapshot() from any thread (a collector may sample while
  // run() is still starting).
  std::atomic<std::uint64_t> start_ticks{0};
  /// Sampled time accounting (RuntimeSettings::time_sample_hz > 0, where the sampler may run at a
  /// real-time priority; exact otherwise): the sampler's thread, and the tick up to which it has
  /// booked every actor's time (snapshot() adds what followed). Set before any actor acts.
  std::atomic<bool> sampled_time{false};
  std::thread sampler;
  std::atomic<std::uint64_t> sampled_until{0};
  std::mutex sampler_mutex;
  std::condition_variable sampler_cv;
  bool sampler_stop = false;
  /// Books the ticks since sampled_until to what each local actor is doing now (sampler thread).
  void sample_activity();
  void start_sampler();
  void stop_sampler();
  std::int64_t local_actors = 0;
  std::vector<HandshakeEvent> log;

  std::atomic<std::int64_t> retired{0};
  std::atomic<bool> failed_{false};
  /// The activity log is on (Runtime::set_activity_log); read by actors before each act.
  std::atomic<bool> activity_log{false};
  std::mutex activity_mutex;  // one drainer at a time
  mutable std::mutex mutex;
  std::condition_variable cv;
  std::string error;
  bool done = false;
  bool ran = false;
  static constexpr std::int64_t max_dry_budget = 20'000'000;
  bool dry_by_tokens = false;             // ProgressCheck::tokens: the long check
  std::vector<std::int64_t> dry_targets;  // by plan index: D + 2 iterations' acts (or empty)
  std::vector<std::int64_t> dry_limits;   // by plan index: 2 D + 3 iterations' acts (or empty)
  /// By plan index: reads what an ActorDesc::at_end accumulate publishes (or empty): acts only
  /// after the run, so the dry run does not wait for it (target 0; counted as reached at the
  /// start). In a short run it may act within the check, and does.
  std::vector<bool> dry_after_end;
  std::int64_t dry_target = 0;            // every actor's, where the rates do not balance
  bool dry_budget_capped = false;
  std::int64_t dry_budget = 0;
  std::int64_t dry_acts = 0;
  std::int64_t dry_reached = 0;
  bool dry_spent = false;
  // Late, so destroyed early (after only the communicators below): each waits for its queued
  // work, which reads and writes register slots and posts to workers, before those go.
  std::map<std::pair<Device, std::uint8_t>, std::unique_ptr<AsyncStream>> streams;
  // After the streams, so destroyed before them: a collective whose peer is gone never ends,
  // and a stream would wait for it forever unless its communicator is aborted first.
  std::unique_ptr<nccl::Communicators> nccl;
  /// What the kernels get beyond their registers (KernelConfig::services).
  KernelServices services;
};

inline void Actor::send(Worker* to, const Message& m) {
  if (core_.settings.record_handshakes) [[unlikely]] core_.record(m);
  worker_->send(to, m);
}

}  // namespace baton::detail
