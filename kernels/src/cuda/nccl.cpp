// NCCL communicators and their collectives on baton's CUDA streams (built with BATON_HAS_NCCL).
//
// Every communicator is non-blocking (ncclConfig_t::blocking = 0): NCCL calls then return
// ncclInProgress instead of blocking inside, and ncclCommGetAsyncError says when the call has
// finished (ncclSuccess), failed, or is still going. Polling it against a deadline is what lets
// a missing peer turn into an error instead of a hang; the communicator is then aborted, which
// also ends any of its kernels that wait on the device for that peer.
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "baton/kernels/nccl.h"
#include "baton/kernels/tensor.h"
#include "common.h"

namespace baton::nccl {

struct Communicator::Impl {
  /// Held while the communicator is used or aborted: NCCL's calls on one communicator must not
  /// overlap, and the watchdog thread may abort it while a worker enqueues.
  std::mutex mutex;
  ncclComm_t comm = nullptr;
  /// Recorded on the stream after each collective: not reached yet at the end means some work
  /// never finished (a peer that stopped), so the communicator must be aborted, not finalised.
  cudaEvent_t last = nullptr;
  /// An error or a timeout: the communicator was aborted (comm is null then) or must be.
  bool failed = false;
  std::string failure;
  /// The latest collective: which call, how many so far, when it was enqueued (the watchdog).
  const char* last_call = "";
  std::int64_t calls = 0;
  std::chrono::steady_clock::time_point enqueued_at{};
};

namespace {

using Clock = std::chrono::steady_clock;

/// Finalising a healthy communicator at the end of a run takes milliseconds; past this it is
/// aborted instead (the run is over either way).
constexpr std::chrono::milliseconds close_timeout{10'000};

std::string describe_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = fmt::format("{} ({})", ncclGetErrorString(r), static_cast<int>(r));
  // The last error is per communicator (or per thread, for null); it says what failed inside.
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += fmt::format(": {}", last);
  return s;
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
  }
  throw std::invalid_argument(fmt::format("NCCL has no type for {}", name(t)));
}

enum class Outcome { ready, failed, timed_out, cancelled };

struct Waited {
  Outcome outcome = Outcome::ready;
  ncclResult_t error = ncclSuccess;
};

/// Polls until `comm` leaves ncclInProgress, the deadline passes or `cancel` is set. Yields
/// between the first polls (a collective's enqueueing usually finishes within microseconds),
/// then sleeps a little (an initialisation takes a second or more; these machines have few
/// cores to spin on).
Waited wait_ready(ncclComm_t comm, Clock::time_point deadline, const std::atomic<bool>* cancel) {
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return {Outcome::failed, r};
    if (state == ncclSuccess) return {};
    if (state != ncclInProgress) return {Outcome::failed, state};
    if (cancel != nullptr && cancel->load(std::memory_order_acquire)) return {Outcome::cancelled, ncclSuccess};
    if (Clock::now() >= deadline) return {Outcome::timed_out, ncclSuccess};
    if (polls < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

/// Restores the calling thread's current device when it goes: Stream::bind() caches which device
/// is current per thread, so code that switches devices for NCCL's sake must switch back.
class DeviceGuard {
 public:
  DeviceGuard() {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
  }
  ~DeviceGuard() {
    if (saved_ >= 0) cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = -1;
};

std::string seconds(std::chrono::milliseconds d) { return fmt::format("{:.1f} s", static_cast<double>(d.count()) / 1e3); }

/// Aborts with impl.mutex held (or with no other user left). Never throws.
void abort_comm(Communicator::Impl& impl, Device device) noexcept {
  if (impl.comm == nullptr) return;
  const DeviceGuard restore;
  cudaSetDevice(device.index);
  ncclCommAbort(impl.comm);
  impl.comm = nullptr;
  impl.failed = true;
  if (impl.failure.empty()) impl.failure = "aborted";
}

}  // namespace

bool built_with_nccl() { return true; }

std::string version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z) is X * 10000 + Y * 100 + Z since 2.9.
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

std::string make_unique_id() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    throw std::runtime_error(fmt::format("ncclGetUniqueId failed: {}", describe_error(r, nullptr)));
  }
  static_assert(sizeof id == unique_id_bytes);
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

Communicator::Communicator(std::string name, int nranks, int rank, Device device, WaitSettings wait)
    : name_(std::move(name)), nranks_(nranks), rank_(rank), device_(device), wait_(wait),
      impl_(std::make_unique<Impl>()) {}

std::string Communicator::describe() const {
  return fmt::format("communicator '{}' rank {} of {} on {}", name_, rank_, nranks_, device_.str());
}

std::unique_ptr<Communicator> Communicator::create(const std::string& unique_id, int nranks, int rank, Device device,
                                                   const std::string& name, WaitSettings wait) {
  auto comms = create_local(unique_id, nranks, {rank}, {device}, name, wait);
  return std::move(comms.front());
}

std::vector<std::unique_ptr<Communicator>> Communicator::create_local(const std::string& unique_id, int nranks,
                                                                      const std::vector<int>& ranks,
                                                                      const std::vector<Device>& devices,
                                                                      const std::string& name, WaitSettings wait) {
  if (ranks.empty() || ranks.size() != devices.size()) {
    throw std::invalid_argument(fmt::format("communicator '{}': {} ranks but {} devices", name, ranks.size(), devices.size()));
  }
  if (unique_id.size() != unique_id_bytes) {
    throw std::invalid_argument(fmt::format("communicator '{}': the unique id has {} bytes, not {}", name,
                                            unique_id.size(), unique_id_bytes));
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= nranks) {
      throw std::invalid_argument(fmt::format("communicator '{}': rank {} of {}", name, ranks[i], nranks));
    }
    if (devices[i].type != DeviceType::cuda) {
      throw std::invalid_argument(fmt::format("communicator '{}' rank {}: {} is not a CUDA device", name, ranks[i],
                                              devices[i].str()));
    }
    out.push_back(std::unique_ptr<Communicator>(new Communicator(name, nranks, ranks[i], devices[i], wait)));
  }
  const auto& a = cuda::availability();
  if (!a.ok) throw std::runtime_error(fmt::format("{}: cannot use {}: {}", out[0]->describe(), devices[0].str(), a.reason));
  for (const auto& c : out) {
    if (c->device_.index >= a.devices) {
      throw std::runtime_error(fmt::format("{}: {} does not exist ({} CUDA devices)", c->describe(), c->device_.str(), a.devices));
    }
  }

  const DeviceGuard restore;
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof id);
  // On any failure below, the communicators made so far are marked failed: their destructors
  // (when `out` goes) abort them.
  auto fail_all = [&](const std::string& why) {
    for (auto& c : out) c->impl_->failed = true;
    return std::runtime_error(why);
  };
  const auto deadline = Clock::now() + wait.timeout;
  // Ranks of one communicator in one thread must be made inside a group (what ncclCommInitAll
  // does): each initialisation waits for the others.
  if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess) {
    throw fail_all(fmt::format("{}: ncclGroupStart failed: {}", out[0]->describe(), describe_error(r, nullptr)));
  }
  std::string init_error;
  for (auto& c : out) {
    if (cudaError_t e = cudaSetDevice(c->device_.index); e != cudaSuccess) {
      init_error = fmt::format("{}: cudaSetDevice failed: {}", c->describe(), cudaGetErrorString(e));
      break;
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.commName = c->name_.c_str();
    const ncclResult_t r = ncclCommInitRankConfig(&c->impl_->comm, nranks, id, c->rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      init_error = fmt::format("{}: ncclCommInitRankConfig failed: {}", c->describe(), describe_error(r, c->impl_->comm));
      break;
    }
  }
  // The group is closed whatever happened in it.
  const ncclResult_t ended = ncclGroupEnd();
  if (!init_error.empty()) throw fail_all(init_error);
  if (ended != ncclSuccess && ended != ncclInProgress) {
    throw fail_all(fmt::format("{}: ncclGroupEnd (initialising) failed: {}", out[0]->describe(),
                               describe_error(ended, out[0]->impl_->comm)));
  }
  for (auto& c : out) {
    if (c->impl_->comm == nullptr) {
      throw fail_all(fmt::format("{}: ncclCommInitRankConfig made no communicator", c->describe()));
    }
    const Waited w = wait_ready(c->impl_->comm, deadline, wait.cancel);
    switch (w.outcome) {
      case Outcome::ready: break;
      case Outcome::failed:
        throw fail_all(fmt::format("{}: ncclCommInitRankConfig failed: {}", c->describe(),
                                   describe_error(w.error, c->impl_->comm)));
      case Outcome::timed_out:
        throw fail_all(fmt::format("{}: ncclCommInitRankConfig did not finish within {} (did every rank of the group "
                                   "start?); aborted",
                                   c->describe(), seconds(wait.timeout)));
      case Outcome::cancelled:
        throw fail_all(fmt::format("{}: initialisation given up: the run failed meanwhile", c->describe()));
    }
  }
  for (auto& c : out) {
    BATON_CUDA_CHECK(cudaSetDevice(c->device_.index), c->describe());
    BATON_CUDA_CHECK(cudaEventCreateWithFlags(&c->impl_->last, cudaEventDisableTiming), c->describe());
  }
  return out;
}

Communicator::~Communicator() {
  if (!impl_) return;
  if (impl_->comm != nullptr) close({this});
  if (impl_->last != nullptr) {
    const DeviceGuard restore;
    cudaSetDevice(device_.index);
    cudaEventDestroy(impl_->last);
  }
}

void Communicator::abort() noexcept {
  std::lock_guard lock(impl_->mutex);
  abort_comm(*impl_, device_);
}

std::optional<std::string> Communicator::abort_if_overdue() noexcept {
  try {
    std::unique_lock lock(impl_->mutex, std::try_to_lock);
    if (!lock.owns_lock() || impl_->comm == nullptr || impl_->calls == 0) return std::nullopt;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - impl_->enqueued_at);
    if (waited < wait_.timeout) return std::nullopt;
    const cudaError_t q = cudaEventQuery(impl_->last);
    if (q == cudaSuccess) return std::nullopt;
    cudaGetLastError();  // not ready is no error to keep
    std::string why = fmt::format("{}: {} #{} was enqueued {} ago and has not finished on the device (does every rank "
                                  "of the group call it?); aborted by the NCCL watchdog",
                                  describe(), impl_->last_call, impl_->calls, seconds(waited));
    impl_->failure = why;
    abort_comm(*impl_, device_);
    return why;
  } catch (...) {  // formatting ran out of memory: try again next time
    return std::nullopt;
  }
}

void Communicator::close(const std::vector<Communicator*>& comms) noexcept {
  const DeviceGuard restore;
  std::vector<Communicator*> finalising;
  for (Communicator* c : comms) {
    if (c == nullptr || c->impl_->comm == nullptr) continue;
    cudaSetDevice(c->device_.index);
    const bool cancelled = c->wait_.cancel != nullptr && c->wait_.cancel->load(std::memory_order_acquire);
    const bool idle = c->impl_->last == nullptr || cudaEventQuery(c->impl_->last) == cudaSuccess;
    cudaGetLastError();  // a not-ready query is no error to keep
    if (c->impl_->failed || cancelled || !idle) {
      c->abort();
      continue;
    }
    const ncclResult_t r = ncclCommFinalize(c->impl_->comm);
    if (r == ncclSuccess || r == ncclInProgress) {
      finalising.push_back(c);
    } else {
      c->abort();
    }
  }
  const auto deadline = Clock::now() + close_timeout;
  for (Communicator* c : finalising) {
    const Waited w = wait_ready(c->impl_->comm, deadline, nullptr);
    cudaSetDevice(c->device_.index);
    if (w.outcome == Outcome::ready) {
      ncclCommDestroy(c->impl_->comm);
      c->impl_->comm = nullptr;
    } else {
      c->abort();
    }
  }
}

namespace {

/// Checks what every collective needs; throws std::invalid_argument naming the communicator.
void check_operands(const Communicator& c, const char* call, const Tensor& in, const Tensor& out,
                    const cuda::Stream& stream, std::int64_t in_per_out_num, std::int64_t in_per_out_den) {
  if (in.dtype() != out.dtype()) {
    throw std::invalid_argument(fmt::format("{}: {} from {} into {}: dtypes differ", c.describe(), call, in.describe(),
                                            out.describe()));
  }
  if (in.numel() * in_per_out_den != out.numel() * in_per_out_num) {
    throw std::invalid_argument(fmt::format("{}: {} from {} into {}: {} wants {} input elements per {} output elements",
                                            c.describe(), call, in.describe(), out.describe(), call, in_per_out_num,
                                            in_per_out_den));
  }
  for (const Tensor* t : {&in, &out}) {
    if (t->numel() > 0 && t->device() != c.device()) {
      throw std::invalid_argument(fmt::format("{}: {} on {}, which lives on {}", c.describe(), call, t->describe(),
                                              t->device().str()));
    }
  }
  if (stream.device() != c.device()) {
    throw std::invalid_argument(fmt::format("{}: {} on a stream of {} ({})", c.describe(), call, stream.device().str(),
                                            stream.owner()));
  }
}

}  // namespace

// Enqueues one collective on `stream` and returns once NCCL has put it there (its kernel runs
// later, on the device): what follows on the stream (the actor's host callback) comes after it.
template <class Call>
static void enqueue(Communicator& c, Communicator::Impl& impl, const WaitSettings& wait, const char* call,
                    cuda::Stream& stream, Call&& launch) {
  std::lock_guard lock(impl.mutex);
  if (impl.comm == nullptr || impl.failed) {
    throw std::runtime_error(fmt::format("{}: {} after the communicator was aborted ({})", c.describe(), call,
                                         impl.failure.empty() ? "an earlier error" : impl.failure));
  }
  stream.bind();
  const auto deadline = Clock::now() + wait.timeout;
  auto settle = [&](const char* what) {
    const Waited w = wait_ready(impl.comm, deadline, wait.cancel);
    std::string why;
    switch (w.outcome) {
      case Outcome::ready: return;
      case Outcome::failed: why = fmt::format("{} failed: {}", what, describe_error(w.error, impl.comm)); break;
      case Outcome::timed_out:
        why = fmt::format("{} did not finish within {} (is every rank of the group running it?); aborted", what,
                          seconds(wait.timeout));
        break;
      case Outcome::cancelled: why = fmt::format("{} given up: the run failed meanwhile", what); break;
    }
    impl.failure = why;
    abort_comm(impl, c.device());
    throw std::runtime_error(fmt::format("{}: {}", c.describe(), why));
  };
  // An asynchronous error of an earlier collective (a peer's network failure) shows here first.
  settle("an earlier operation");
  const ncclResult_t r = launch(stream.impl().stream);
  if (r == ncclInProgress) {
    settle(call);
  } else if (r != ncclSuccess) {
    impl.failure = fmt::format("{} failed: {}", call, describe_error(r, impl.comm));
    const std::string message = fmt::format("{}: {}", c.describe(), impl.failure);
    abort_comm(impl, c.device());
    throw std::runtime_error(message);
  }
  BATON_CUDA_CHECK(cudaEventRecord(impl.last, stream.impl().stream), c.describe());
  impl.last_call = call;
  ++impl.calls;
  impl.enqueued_at = Clock::now();
}

void Communicator::all_reduce(const Tensor& in, Tensor& out, cuda::Stream& stream) {
  check_operands(*this, "ncclAllReduce", in, out, stream, 1, 1);
  if (in.numel() == 0) return;
  const auto count = static_cast<std::size_t>(in.numel());
  const ncclDataType_t type = nccl_type(in.dtype());
  enqueue(*this, *impl_, wait_, "ncclAllReduce", stream, [&](cudaStream_t s) {
    return ncclAllReduce(in.raw(), out.raw(), count, type, ncclSum, impl_->comm, s);
  });
}

void Communicator::reduce_scatter(const Tensor& in, Tensor& out, cuda::Stream& stream) {
  check_operands(*this, "ncclReduceScatter", in, out, stream, nranks_, 1);
  if (out.numel() == 0) return;
  const auto count = static_cast<std::size_t>(out.numel());
  const ncclDataType_t type = nccl_type(in.dtype());
  enqueue(*this, *impl_, wait_, "ncclReduceScatter", stream, [&](cudaStream_t s) {
    return ncclReduceScatter(in.raw(), out.raw(), count, type, ncclSum, impl_->comm, s);
  });
}

void Communicator::all_gather(const Tensor& in, Tensor& out, cuda::Stream& stream) {
  check_operands(*this, "ncclAllGather", in, out, stream, 1, nranks_);
  if (in.numel() == 0) return;
  const auto count = static_cast<std::size_t>(in.numel());
  const ncclDataType_t type = nccl_type(in.dtype());
  enqueue(*this, *impl_, wait_, "ncclAllGather", stream, [&](cudaStream_t s) {
    return ncclAllGather(in.raw(), out.raw(), count, type, impl_->comm, s);
  });
}

void Communicator::send(const Tensor& in, int peer, cuda::Stream& stream) {
  check_operands(*this, "ncclSend", in, in, stream, 1, 1);
  if (peer < 0 || peer >= nranks_ || peer == rank_) {
    throw std::invalid_argument(fmt::format("{}: ncclSend to rank {}", describe(), peer));
  }
  if (in.numel() == 0) return;
  const auto count = static_cast<std::size_t>(in.numel());
  const ncclDataType_t type = nccl_type(in.dtype());
  enqueue(*this, *impl_, wait_, "ncclSend", stream,
          [&](cudaStream_t s) { return ncclSend(in.raw(), count, type, peer, impl_->comm, s); });
}

void Communicator::recv(Tensor& out, int peer, cuda::Stream& stream) {
  check_operands(*this, "ncclRecv", out, out, stream, 1, 1);
  if (peer < 0 || peer >= nranks_ || peer == rank_) {
    throw std::invalid_argument(fmt::format("{}: ncclRecv from rank {}", describe(), peer));
  }
  if (out.numel() == 0) return;
  const auto count = static_cast<std::size_t>(out.numel());
  const ncclDataType_t type = nccl_type(out.dtype());
  enqueue(*this, *impl_, wait_, "ncclRecv", stream,
          [&](cudaStream_t s) { return ncclRecv(out.raw(), count, type, peer, impl_->comm, s); });
}

}  // namespace baton::nccl
