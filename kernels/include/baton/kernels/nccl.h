#pragma once
/// NCCL collectives between CUDA devices: communicators, the collectives on a baton CUDA stream,
/// and the kernels that let an actor run them ("nccl.allreduce", "nccl.reduce_scatter",
/// "nccl.all_gather", and "nccl.send" / "nccl.recv" for point-to-point moves). This header needs no NCCL (or CUDA) headers and exists in every build;
/// without NCCL (BATON_HAS_NCCL undefined) everything that would call NCCL throws
/// std::runtime_error "... baton was built without NCCL".
///
/// Nothing here may hang: communicators are non-blocking (ncclConfig_t::blocking = 0), and every
/// wait for NCCL (initialisation, the enqueueing of a collective, finalisation) polls
/// ncclCommGetAsyncError until a deadline, then aborts the communicator (ncclCommAbort) and
/// throws an error that names the communicator, the call and the rank. A collective that was
/// enqueued but never finishes on the device (its peer never called it) is caught by
/// Communicators' watchdog thread, which aborts the communicator and reports it.
///
///   std::string id = baton::nccl::make_unique_id();        // one rank makes it, all use it
///   auto comm = baton::nccl::Communicator::create(id, 1, 0, Device::parse("cuda:0"), "grad");
///   comm->all_reduce(in, out, stream);                       // enqueued on `stream`
///
/// In a plan, a group of NCCL actors (graph/collectives.h: add_nccl_allreduce) names its
/// communicator in the attributes below; the runtime's Communicators make it the first time one
/// of its kernels acts, from a unique id that the group's lowest rank made while the runtime was
/// built and published through KernelServices::store (the control plane) before the start
/// barrier.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "baton/kernels/device.h"

namespace baton {
class KernelRegistry;
class Store;
class Tensor;
namespace cuda {
class Stream;
}
}  // namespace baton

namespace baton::nccl {

/// True if this build has NCCL (BATON_HAS_NCCL).
bool built_with_nccl();
/// "2.28.9" (the library loaded at run time), or "built without NCCL".
std::string version();
/// Bytes in a unique id (NCCL_UNIQUE_ID_BYTES).
inline constexpr std::size_t unique_id_bytes = 128;
/// A fresh ncclUniqueId (ncclGetUniqueId: it opens the bootstrap root's socket on this host and
/// needs no GPU), as unique_id_bytes bytes. Throws naming the call and NCCL's error.
std::string make_unique_id();

/// How long a communicator waits for NCCL, and what may stop the wait early.
struct WaitSettings {
  /// Initialisation, each collective's enqueueing, finalisation: past this the communicator is
  /// aborted and the call throws.
  std::chrono::milliseconds timeout{60'000};
  /// If set (the run has failed meanwhile), a wait gives up at once: the communicator is
  /// aborted and the call throws.
  const std::atomic<bool>* cancel = nullptr;
};

/// One rank of an NCCL communicator on one CUDA device. Move-only owner of its ncclComm_t: the
/// destructor aborts it (ncclCommAbort) if it failed, timed out, or still has work that has not
/// finished on the device (a peer that died would leave that work waiting forever), and
/// otherwise finalises (bounded by the timeout) and destroys it. Never throws from the
/// destructor. The collectives may be called from one thread at a time.
class Communicator {
 public:
  /// Rank `rank` of `nranks` on `device` (ncclCommInitRankConfig, non-blocking). Blocks until
  /// the communicator is ready: every other rank must create its own with the same id
  /// meanwhile. `name` (the group) goes into every error message. Throws std::runtime_error:
  /// built without NCCL, no CUDA driver, NCCL's error, or the timeout (naming the rank).
  static std::unique_ptr<Communicator> create(const std::string& unique_id, int nranks, int rank, Device device,
                                              const std::string& name, WaitSettings wait = {});
  /// Several ranks of one communicator in this process, one per device (ncclCommInitRankConfig
  /// calls inside ncclGroupStart / ncclGroupEnd, as ncclCommInitAll does): `ranks[i]` on
  /// `devices[i]`. Returns them in that order. Throws as create() does.
  static std::vector<std::unique_ptr<Communicator>> create_local(const std::string& unique_id, int nranks,
                                                                 const std::vector<int>& ranks,
                                                                 const std::vector<Device>& devices,
                                                                 const std::string& name, WaitSettings wait = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return nranks_; }
  Device device() const { return device_; }
  /// "communicator 'grad' rank 1 of 2 on cuda:1": how errors name it.
  std::string describe() const;

  /// out = the sum over the ranks of `in` (same element count; in and out may be the same
  /// tensor). Enqueued on `stream`, which must be on this communicator's device. The dtypes NCCL
  /// sums: f32, f64, i32, i64, u8. Throws std::invalid_argument for a shape, dtype or device that
  /// does not fit, std::runtime_error for NCCL's errors and timeouts (the communicator is
  /// aborted then and every later call throws).
  void all_reduce(const Tensor& in, Tensor& out, cuda::Stream& stream);
  /// out = part `rank()` of the sum over the ranks of `in` (in has size() x out's elements).
  void reduce_scatter(const Tensor& in, Tensor& out, cuda::Stream& stream);
  /// out = every rank's `in`, in rank order (out has size() x in's elements).
  void all_gather(const Tensor& in, Tensor& out, cuda::Stream& stream);
  /// Sends `in` to rank `peer` of this communicator (ncclSend), which receives it with recv():
  /// a communicator's sends and receives between two ranks pair by their order. Every dtype
  /// (the bytes move as they are). The call on the device waits for the peer's receive.
  void send(const Tensor& in, int peer, cuda::Stream& stream);
  /// Receives into `out` what rank `peer` sends (ncclRecv): the same element count and dtype.
  void recv(Tensor& out, int peer, cuda::Stream& stream);

  /// Aborts the communicator now (its device work ends, its later calls throw). Never throws.
  /// Any thread.
  void abort() noexcept;
  /// For a watchdog thread: if the latest collective was enqueued longer than the timeout ago
  /// and has not finished on the device, aborts the communicator (which ends that work) and
  /// returns why ("... ncclAllReduce #7 enqueued 45.0 s ago has not finished ..."); else
  /// nothing. Does not wait: skips a communicator another thread is using.
  std::optional<std::string> abort_if_overdue() noexcept;
  /// Ends several communicators of this process together, as the destructor ends one: those
  /// that are healthy and idle are finalised all at once (finalising one rank may wait for the
  /// others) and destroyed; the rest, and any whose finalisation fails or times out, aborted.
  /// Their destructors then have nothing left to do. Never throws.
  static void close(const std::vector<Communicator*>& comms) noexcept;

  struct Impl;  // the NCCL handle (kernels/src/cuda/nccl.cpp)

 private:
  Communicator(std::string name, int nranks, int rank, Device device, WaitSettings wait);
  std::string name_;
  int nranks_;
  int rank_;
  Device device_;
  WaitSettings wait_;
  std::unique_ptr<Impl> impl_;
};

/// Where a communicator group's members are, as a plan lays them out: member i (its rank in
/// the communicator) runs on job rank `ranks[i]` and CUDA device `devices[i]`. The group's
/// actors carry it as attributes: "group" (the name), "ranks", "devices" (int lists) and
/// "member" (the actor's own member index).
struct Group {
  std::string name;
  std::vector<std::int64_t> ranks;
  std::vector<std::int64_t> devices;
  /// The job rank that makes the unique id: the lowest in `ranks`.
  std::uint16_t root() const;
  /// The store key its unique id travels under: "nccl/<name>".
  std::string key() const;
  /// Checks that it is well formed (members, devices, no device twice on one rank); throws
  /// std::invalid_argument naming the group.
  void check() const;
  friend bool operator==(const Group&, const Group&) = default;
};

/// A run's communicators, by group: what the runtime gives its NCCL kernels
/// (KernelServices::nccl). prepare() runs while the runtime is built (on the thread building
/// it): on the group's root it makes the unique id and, if the group spans ranks, publishes it
/// in the store. communicator() runs when a kernel first acts: the first local member of a group
/// to ask makes the communicators of every member on this rank at once (create_local), from the
/// id (fetched from the store on the other ranks). Thread-safe. The destructor finalises or
/// aborts them all; the runtime destroys it before its CUDA streams, so that no stream waits on
/// a collective whose peer is gone.
///
/// Once it has a communicator it runs a watchdog thread (waking every watchdog_period) that
/// aborts a communicator whose latest collective has been enqueued for longer than the timeout
/// without finishing on the device, and passes the reason to `on_failure` (the runtime fails the
/// run with it): a peer that stopped calling would otherwise leave the device, and anything that
/// waits for its stream, waiting forever.
class Communicators {
 public:
  /// How often the watchdog looks at the communicators' latest collectives.
  static constexpr std::chrono::milliseconds watchdog_period{200};
  /// `rank`: the job rank of this runtime; `store`: null in a job of one rank; `on_failure`:
  /// called on the watchdog thread with the reason when it aborts a communicator.
  Communicators(std::uint16_t rank, Store* store, WaitSettings wait,
                std::function<void(const std::string&)> on_failure = {});
  ~Communicators();
  Communicators(const Communicators&) = delete;
  Communicators& operator=(const Communicators&) = delete;

  /// Registers `group` (the same layout for every member; a different one under the same name
  /// throws) and, on its root, makes its unique id. Throws.
  void prepare(const Group& group);
  /// The communicator of member `member` of a prepared group on this rank. Throws as
  /// Communicator::create does, or if the id does not arrive in time.
  Communicator& communicator(const std::string& group, int member);

 private:
  struct Entry {
    Group group;
    std::mutex mutex;  // held while the group's communicators are made
    std::string id;    // empty until made (root) or fetched
    std::map<int, std::unique_ptr<Communicator>> comms;  // by member, once made
    std::string error;  // why making them failed: every later ask fails the same way
  };
  void start_watchdog();
  void watch();
  std::uint16_t rank_;
  Store* store_;
  WaitSettings wait_;
  std::function<void(const std::string&)> on_failure_;
  std::mutex mutex_;  // guards groups_ (not the entries) and the watchdog's state
  std::map<std::string, std::unique_ptr<Entry>> groups_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread watchdog_;  // started with the first communicator; joined first in the destructor
};

/// Registers "nccl.allreduce", "nccl.reduce_scatter" and "nccl.all_gather" for cuda and every
/// dtype NCCL sums. Their actor has one input and one output register on its member's device;
/// "nccl.send" (member 0 of a group of two) reads one input and writes nothing, "nccl.recv"
/// (member 1) writes one output and reads one input it ignores (the token that tells it a piece
/// is coming: graph/passes.h, nccl_p2p);
/// the kernel needs the runtime's KernelServices. In a build without NCCL they are registered all
/// the same, and making one throws "built without NCCL". KernelRegistry::with_builtin_kernels()
/// calls it.
void add_nccl_kernels(KernelRegistry& reg);

}  // namespace baton::nccl
