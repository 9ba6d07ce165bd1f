#pragma once
/// What a run reports: per-actor and per-register counters.
#include <cstdint>
#include <string>
#include <vector>

#include "baton/actors/plan.h"

namespace baton {

/// How an actor's time splits; the buckets sum to its lifetime.
enum class ActorActivity : std::uint8_t {
  /// Running its kernel (and the handshakes around it).
  busy,
  /// Waiting for an input piece.
  starved,
  /// Has its inputs, waiting for a free output slot (or, after end of stream, for its last
  /// slots to be acked).
  backpressured,
  /// Waiting for its data to arrive from another rank (a transfer actor with pulls in flight
  /// and nothing else it could do).
  transferring,
  /// Finished and all its slots acked.
  retired,
};
std::string_view name(ActorActivity a);

struct ActorMetrics {
  std::string name;
  ActorKind kind = ActorKind::compute;
  Placement where{};
  std::uint64_t acts = 0;
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
  double busy_s = 0;
  double starved_s = 0;
  double backpressured_s = 0;
  double transferring_s = 0;
  /// The part of busy_s spent inside the kernel; the rest is the handshakes around it.
  double kernel_s = 0;
  /// On a stream (CUDA, sim) with RuntimeSettings::device_time: the time its kernels ran on the
  /// device, as far as the device has run them (0 otherwise). kernel_s is then the time to
  /// enqueue them.
  double device_s = 0;
  ActorActivity activity = ActorActivity::starved;

  double lifetime_s() const { return busy_s + starved_s + backpressured_s + transferring_s; }
};

struct RegisterMetrics {
  std::string name;
  std::int32_t slots = 0;
  std::int64_t written = 0;
  std::int64_t freed = 0;
  /// The most slots that were ever written and not yet acked by every consumer.
  std::int32_t max_outstanding = 0;
};

struct MetricsSnapshot {
  double elapsed_s = 0;
  std::vector<ActorMetrics> actors;
  std::vector<RegisterMetrics> registers;

  /// A fixed-width table: actor, place, acts, acts/s, MB/s in and out, busy / starved /
  /// back-pressured %, then the registers' occupancy.
  std::string table() const;
  std::uint64_t total_acts() const;
};

/// A device's register memory in use as measured over a run (RuntimeSettings::measure_memory),
/// for comparison with the plan's own account (memory_report).
struct MeasuredMemory {
  Device device{};
  /// The most bytes of register slots in use at once: written and not yet read by every reader.
  std::int64_t peak_bytes = 0;
};

struct RunReport {
  MetricsSnapshot metrics;
  /// By device of this rank, where RuntimeSettings::measure_memory was set.
  std::vector<MeasuredMemory> memory;
  double wall_s = 0;
  /// Messages delivered, and how often a worker went to sleep for want of one.
  std::uint64_t messages = 0;
  std::uint64_t parks = 0;
  /// Messages this rank's actors sent to actors on other ranks (requests, acks, ends of stream),
  /// and the link messages they went in: fewer where two for one rank went as one
  /// (RuntimeSettings::hold_messages_ns).
  std::uint64_t messages_to_other_ranks = 0;
  std::uint64_t link_messages = 0;
  /// What idle workers did (RuntimeSettings::idle_polling) and why: "busy-polling: 2 workers x 2
  /// ranks on this host < 16 cores", "parking: ...".
  std::string idle_polling;
  /// How the actors' times were measured (RuntimeSettings::time_sample_hz): "sampled at N Hz",
  /// "exact" (asked for, or the sampler could not run at a real-time priority: then says so),
  /// or "off".
  std::string time_accounting;
  /// run_job: what the data plane set in UCX's configuration and why ("TLS=^cma,tcp,
  /// RNDV_THRESH=1048576 (every rank on this host)"); empty for a job of one rank.
  std::string data_plane;
  /// Ranks that left the job while this one ran (Runtime::rank_left): "rank 1: <reason>".
  std::vector<std::string> departed;
  /// Ranks that came back while this one ran (Runtime::rank_rejoined): "rank 1 from step 58"
  /// (it trains step 58 on; steps counted from 1).
  std::vector<std::string> rejoined;
  /// run_job under BATON_BIND_TO=core: the cores this rank's threads were put on (bind_to_cores).
  std::string binding;
  /// Pieces of this rank's registers that readers on other ranks took (one per piece and
  /// reader), by how they crossed: read where they lay, in memory the ranks of a host share
  /// (RuntimeSettings::shared_registers); inline with the request (inline_payload_bytes);
  /// offered and pulled through the data plane. And the bytes of the register slots this rank
  /// placed in shared memory for them.
  std::uint64_t pieces_read_in_place = 0;
  std::uint64_t pieces_inline = 0;
  std::uint64_t pieces_pulled = 0;
  std::uint64_t shared_register_bytes = 0;
};

}  // namespace baton
