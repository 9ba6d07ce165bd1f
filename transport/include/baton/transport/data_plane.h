#pragma once
/// The UCX data plane (DESIGN.md section 4): one ucp worker per process, progressed by whichever
/// thread gets to it first: the caller of send() / send_payload() / receive_payload() posts its
/// own operation at once, an idle actor thread polls (poll()), and a progress thread of its own
/// keeps watch and sleeps on the worker's event fd when nobody else is busy; messages as active messages; payloads as tagged rendezvous sends that the receiver
/// pulls into the memory it posted (so a large payload is never copied through a bounce buffer).
/// Shared memory, TCP and the rest come from UCX itself (UCX_TLS).
///
/// Limits of this implementation of Link: at most 65536 ranks, and payload tags below 2^48 (the
/// sender's rank rides in the low 16 bits of the UCX tag); a rank does not send to itself.
/// Endpoints use UCP_ERR_HANDLING_MODE_NONE (the peer mode would rule out shared memory): a
/// peer that dies is the control plane's to notice; sends to it may fail (on_link_error) or
/// simply never complete.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "baton/transport/link.h"

namespace baton::transport {

struct DataPlaneSettings {
  /// UCX_TLS for this data plane ("tcp", "posix,cma,tcp", ...); empty: the UCX_TLS environment
  /// variable, or else every transport but CMA (a peer that dies mid-copy makes UCX abort the
  /// survivor under CMA; see ucx_handles.cpp).
  std::string transports;
  /// Payloads of at least this many bytes go by UCX's rendezvous; smaller ones eagerly (UCX's
  /// RNDV_THRESH; 0: UCX's own choice, "auto"). The UCX_RNDV_THRESH environment variable wins.
  /// Measured (baton-bench-transport --sizes 4K,...,16M under thresholds from auto to inf, shared
  /// memory and TCP, 2026-11-25): UCX's own choice sends from about 8 KiB by rendezvous, which
  /// without CMA runs over TCP loopback even between processes of one host (0.5 GB/s at 16 KiB,
  /// 2 GB/s at 64 KiB); eager copies through the shared-memory FIFO moved 4-8 GB/s from 16 KiB
  /// to 256 KiB. Over TCP eager also won up to 256 KiB (1.6-2x); from 1 MiB the rendezvous won
  /// over TCP and drew level over shared memory, and eager at 16 MiB lost on both.
  std::size_t rendezvous_from = std::size_t{1} << 20;
  /// Polls of an idle worker before the progress thread sleeps on the worker's event fd (and
  /// an eventfd that a caller rings when it could not post its operation itself). Short: the
  /// actor threads poll while they have nothing to do, and on a 2-core machine a spinning
  /// progress thread takes the core the others need (measured: 1000 polls halved 64 KiB
  /// bandwidth over TCP against 100).
  int spin_polls = 100;
  /// stop(): how long to wait for outstanding operations (then receives are cancelled and
  /// sends abandoned); the endpoints' flushes get until then too, and at least a quarter of
  /// it more. stop() returns within about 1.25 x close_timeout.
  std::chrono::milliseconds close_timeout{5'000};
  /// Longest one sleep of the progress thread lasts before it polls again. Every wake-up it
  /// needs comes as an event; this bound is a safety net (and how soon stop() is seen at worst).
  std::chrono::milliseconds max_sleep{100};
};

/// What the data plane sets in UCX's configuration (name without the UCX_ prefix, value), in
/// order: the transports (unless UCX_TLS is set) and the rendezvous threshold (unless
/// UCX_RNDV_THRESH is). A peer measured beside baton (ucx_perftest) runs under the same.
std::vector<std::pair<std::string, std::string>> ucx_configuration(const DataPlaneSettings& settings);

/// Counters, read from any thread.
struct DataPlaneStats {
  std::uint64_t messages_sent = 0;
  std::uint64_t messages_received = 0;
  std::uint64_t payloads_sent = 0;  // offers UCX is done with (their memory is free again)
  std::uint64_t payloads_received = 0;
  std::uint64_t payload_bytes_received = 0;
  std::uint64_t sleeps = 0;  // times the progress thread went to sleep
  std::uint64_t errors = 0;  // failed operations (the first also went to on_link_error)
};

/// Life cycle:
///   DataPlane dp(rank, world);            // ucp context + worker; address() is ready
///   ... exchange addresses (control plane) ...
///   dp.set_handler(&h); dp.connect(addresses); dp.start();
///   ... send / send_payload / receive_payload from any thread ...
///   dp.stop();                            // or the destructor
/// Errors: TransportError naming the UCX call, the status string and the peer rank.
class DataPlane final : public Link {
 public:
  DataPlane(std::uint32_t rank, std::uint32_t world_size, DataPlaneSettings settings = {});
  ~DataPlane() override;  // stop(); never throws
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  /// This process's ucp worker address (opaque bytes) for the address table.
  const std::string& address() const;
  /// One endpoint to every other rank, from the table (indexed by rank; our own entry is
  /// ignored). Once, before start(). The addresses must come from address(): UCX aborts the
  /// process on malformed bytes (it checks only for an empty one).
  void connect(const std::vector<std::string>& addresses);
  /// After connect(), before stop(), any thread: rank `peer` is a new process at `address` (a
  /// rank that left the job came back: ControlClient::rejoin). A new endpoint replaces the old
  /// one, messages are numbered from 0 again both ways, and what is still stuck on the old one
  /// is left there (a failure of it is no link error) until stop() closes both.
  void reconnect(std::uint32_t peer, const std::string& address);
  /// Starts the progress thread. Once; set_handler() first.
  void start();
  /// Finishes what is in flight (up to close_timeout), closes the endpoints, joins the thread,
  /// destroys the worker and the context. Idempotent; the handler hears nothing more once the
  /// operations still in flight at the deadline are cancelled (a stop is not a link error).
  /// Called from a handler (on whichever thread progresses the worker) it only asks: the owner's stop() or the
  /// destructor finishes the job. Sends racing with stop() may be dropped; sends after it throw.
  void stop() noexcept;
  /// Which transports UCX chose for the endpoint to `peer` ("sysv/memory, cma/memory",
  /// "tcp/lo, tcp/eth0"), for logs and benchmarks. After connect(); best effort.
  std::string transports_to(std::uint32_t peer) const;
  DataPlaneStats stats() const;

  std::uint32_t rank() const override;
  std::uint32_t world_size() const override;
  void set_handler(LinkHandler* handler) override;
  void send(std::uint32_t to, const void* data, std::size_t size) override;
  /// Measured (baton-bench-transport, BATON_BENCH_INLINE, README): over shared memory an inline
  /// payload gains below 4 KiB and loses from 8 KiB (UCX cuts it into FIFO fragments and
  /// assembles them, one copy more than a tagged receive); over TCP it gains up to the most.
  std::size_t inline_limit(std::uint32_t peer) const override;
  /// True where UCX reaches `peer` over shared memory (sysv, posix, xpmem: the same host).
  bool shares_memory_with(std::uint32_t peer) const override;
  void send_inline(std::uint32_t to, const void* data, std::size_t size, const void* payload,
                   std::size_t payload_size) override;
  void send_payload(std::uint32_t to, std::uint64_t tag, const void* data, std::size_t size) override;
  void receive_payload(std::uint32_t from, std::uint64_t tag, void* dest, std::size_t size,
                       std::uint64_t cookie) override;
  /// After start(): progress the worker on the calling thread unless another thread is.
  bool poll() override;
  void idle() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::transport
