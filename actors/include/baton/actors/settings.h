#pragma once
/// The runtime's knobs: named, with documented defaults.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace baton::transport {
class Link;
}

namespace baton {
class Store;

enum class ExecutionMode : std::uint8_t {
  /// One worker thread per (device, stream) used by the plan.
  threaded,
  /// Every actor on the calling thread, messages in one FIFO, actors started in plan order:
  /// the same plan, a defined order of requests and acks (for tests).
  deterministic,
};

/// What an idle worker does once its spin_polls are spent.
enum class IdlePolling : std::uint8_t {
  /// busy_poll in a job of several ranks with fewer busy threads on this host than cores
  /// (workers of this rank x ranks_on_host < hardware threads), or where this rank is bound to
  /// cores of its own, at least one per worker (own_cores), and reaches every rank it talks to
  /// over shared memory (Link::shares_memory_with), otherwise park: as MPI and
  /// ucx_perftest poll when each process has a core of its own, and must not when the cores
  /// are shared with compute. Unbound, fewer, not as many: the data plane's and control plane's
  /// threads need a core now and then, and a poller that holds one another rank's thread wants
  /// costs more than a wake-up (measured unbound, 2 ranks x 1 worker on 2 cores,
  /// baton-bench-transport with BATON_BENCH_IDLE: one hop over shared memory 1.8-5.1 us
  /// busy-polling, 1.83-1.93 parking). Bound, a poller holds only its own rank's cores, whose
  /// other threads it stands in for (it progresses the data plane itself): one hop 1.40-1.41 us
  /// busy-polling against 2.89-3.35 parking (2026-11-27, both sides bound, 2-vCPU AMD EPYC VM).
  /// Over TCP it lost (one hop 35 against 25 us, 16 MiB 1.1 against 1.9 GB/s): the kernel's
  /// network stack needs the cores it holds.
  automatic,
  /// Keep polling the mailbox and the data plane (a CPU pause between polls, no yield).
  busy_poll,
  /// Sleep on the mailbox; the data plane's progress thread takes the watch.
  park,
};

struct RuntimeSettings {
  ExecutionMode mode = ExecutionMode::threaded;
  /// The rank this runtime plays; it instantiates the plan's actors on that rank.
  std::uint16_t rank = 0;
  /// Polls of an empty mailbox (with a CPU pause between polls, about 30-40 ns each) before a
  /// worker parks. Long enough to ride out the gap between pieces of a busy stream, short
  /// enough that an idle worker gives its core back within tens of microseconds (these
  /// machines have 2 cores).
  int spin_polls = 1000;
  /// While spinning, give the core away (sched_yield) every this many polls, so that a spinning
  /// worker does not hold a core that a woken thread (another worker, the data plane's progress
  /// thread, another rank) needs: with more threads than cores this halved cross-rank latency.
  /// Zero: never yield.
  int spin_yield_every = 10;
  /// A piece that crosses ranks travels with its request, in one active message
  /// (Link::send_inline), instead of an offer that the transfer actor's receive pulls, where it
  /// has at most this many bytes and at most what the link advises for the peer
  /// (Link::inline_limit, measured: 4 KiB over shared memory, 16 KiB over TCP): no tag
  /// matching, no receive to post, no wake-up of the transfer when it lands; the receiving
  /// runtime stages it until the transfer acts and copies it in. 0: never. Each rank decides
  /// for what it sends; a receiver takes either.
  std::size_t inline_payload_bytes = std::size_t{16} << 10;  // Link::max_inline_payload: the link decides
  /// A transfer whose producer is on another rank of this host reads each piece straight out of
  /// the producer's slot (one copy), instead of receiving it through the data plane (without
  /// CMA, UCX's shared-memory transports copy a payload twice: into their FIFO and out). The
  /// slots of host registers that a rank other than their producer's reads live in memory the
  /// ranks of a host can map (transport/shared_memory.h); the link says which peers share the
  /// host (Link::shares_memory_with). Each rank decides for what it sends; a receiver takes
  /// either. Before inline payloads: a piece that can be read in place is not sent at all.
  bool shared_registers = true;
  /// A message for an actor on another rank may wait this long for a second one to the same
  /// rank, so that both go as one link message (baton/actors/outbox.h): an act usually sends a
  /// rank both the request for its output and the ack of its input, and sent apart they cost
  /// the hop two sends and two receives. A held message goes before any act of its worker
  /// whose actor's last act took longer than this (so it never waits behind a kernel that
  /// takes long), once one held message has waited this long, and whenever the worker has no
  /// local work left. 0: every message goes at once, alone. 1 µs: about twice what one send
  /// over shared memory costs here (measured, 2026-11-27), so a message is at most a few
  /// microseconds late where it would have been sent alone.
  std::uint32_t hold_messages_ns = 1000;
  /// After spin_polls: busy-poll or park (see IdlePolling). RunReport::idle_polling says which
  /// was chosen and why.
  IdlePolling idle_polling = IdlePolling::automatic;
  /// Ranks of the job on this host, this one included (run_job counts them from the control
  /// plane's table); 0: not known, and `automatic` parks.
  std::uint32_t ranks_on_host = 0;
  /// Cores this rank's threads have to themselves (run_job under BATON_BIND_TO=core: its share
  /// of the host's cores, bind_to_cores); 0: not bound, or sharing its core with other ranks.
  /// `automatic` busy-polls where they are at least its workers.
  std::uint32_t own_cores = 0;
  /// Actors on streams (CUDA, sim) hand their registers on in stream order (EdgeSync, plan.h):
  /// the host waits for a stream only where it must see the data. False: every act on a
  /// stream waits for its stream to run it before its requests and acks go out (a host round
  /// trip per act, as before step 11; for comparison and for telling a stream-order problem
  /// from another).
  bool stream_order = true;
  /// Actors on streams also measure how long their kernels ran on the device (two timing events
  /// around each act; ActorMetrics::device_s): on an asynchronous device the host's time in a
  /// kernel is only the time to enqueue it. A few microseconds per act.
  bool device_time = false;
  /// A sim device's stream thread polls this many times (a CPU pause each) for new work before
  /// it sleeps (baton/kernels/sim.h): long enough to ride out the host's gap between enqueues
  /// of short kernels, short enough to give the core back on a 2-core machine.
  int sim_spin_polls = 2000;
  /// If no actor acts or retires for this long, the run fails and names what each unfinished
  /// actor waits for. Zero turns the watchdog off.
  std::chrono::milliseconds stall_timeout{60'000};
  /// Deterministic mode only: log every message sent (see Runtime::handshakes()).
  bool record_handshakes = false;
  /// Per-actor busy / starved / back-pressured / transferring time and the part of busy in the
  /// kernel (ActorMetrics). Sampled by default, as a sampling profiler does: each actor only
  /// publishes what it is doing (a relaxed store it makes anyway, and a flag around its kernel),
  /// and a sampler thread books the time since its last look to what each actor was doing then,
  /// time_sample_hz times a second (docs/observing.md says how accurate that is).
  bool time_accounting = true;
  /// Samples a second (at most: the sampler waits at least 50 times as long as a look at every
  /// actor took, so that it never takes more than 2% of a core). 0: exact accounting instead,
  /// which reads the clock at every change of activity and around every kernel (two to four
  /// TSC reads per act, 10-25 ns each, more in a virtual machine).
  int time_sample_hz = 1000;
  /// Measure each device's register memory in use over the run (RunReport::memory): a slot is
  /// in use from the act that writes it until the last of its readers has finished reading it
  /// (a view's or a weight repeat's readers count as the input's). Two atomic adds per piece and
  /// reader; for checking the memory plan's peak (plan_memory.h) against a run.
  bool measure_memory = false;
  /// Makes each worker an activity ring (64 Ki records, 2 MiB) and starts logging every act
  /// (see activity.h; Runtime::set_activity_log turns it off and on again). For traces and the
  /// dashboard's pipeline timeline.
  bool activity_log = false;
  /// Initial capacity of each worker's mailbox in messages (grows on demand).
  std::size_t mailbox_capacity = 1024;
  /// The data plane to the other ranks of the job (transport::DataPlane, or a LoopbackHub's
  /// link in tests). Needed when the plan has actors on other ranks; the runtime becomes its
  /// handler. Not owned; must outlive the Runtime.
  transport::Link* link = nullptr;
  /// Values shared with the other ranks of the job (run_job sets it to the control plane): how
  /// an NCCL group's unique id reaches its members. Its kernels see it in KernelServices. Not
  /// owned; must outlive the run. NCCL's waits (a communicator's set-up, a collective's
  /// enqueueing) are bounded by 3/4 of stall_timeout (120 s when the watchdog is off).
  Store* store = nullptr;
  /// This runtime plays a rank that left a running job and comes back at step `rejoin_step`
  /// (> 0; the others' Runtime::rank_rejoined): its plan was compiled to start there
  /// (TrainConfig::first_step) and numbers its pieces from 0, and what crosses to other ranks
  /// is numbered as theirs: piece p of a register there is p + rejoin_step x the register's
  /// pieces a step (a request, an ack, the end of a stream, a payload's tag). 0: it does not.
  std::int64_t rejoin_step = 0;
  /// The ranks that may leave the job (transport::RankInfo::may_leave; run_job fills it in).
  /// A failed transfer to or from one of them is not a failure of the run at once: its process
  /// may have died, and the control plane says so (Runtime::rank_left) within
  /// `departure_grace`; only if it does not is the run failed.
  std::vector<std::uint32_t> may_leave;
  std::chrono::milliseconds departure_grace{15'000};
};

}  // namespace baton
