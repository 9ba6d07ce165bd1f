// The UCX data plane: one progress thread owns the ucp worker; other threads hand it commands
// through a lock-free queue and ring an eventfd only when the thread has said it is asleep.
#include "baton/transport/data_plane.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>

#include <boost/lockfree/queue.hpp>
#include <fmt/format.h>
#include <ucp/api/ucp.h>

#include "ucx_handles.h"

namespace baton::transport {

namespace {

using Clock = std::chrono::steady_clock;

/// The active-message id of the runtime's messages.
constexpr unsigned message_am_id = 0;
/// Payload tags on the wire are (link tag << rank_bits) | sender rank: UCX matches tags per
/// worker, not per endpoint, so the sender must be part of the tag for two senders' equal link
/// tags not to meet.
constexpr int rank_bits = 16;
constexpr std::uint64_t max_world_size = std::uint64_t{1} << rank_bits;
constexpr std::uint64_t max_link_tag = (std::uint64_t{1} << (64 - rank_bits)) - 1;
constexpr ucp_tag_t full_tag_mask = ~ucp_tag_t{0};
/// Commands one round of the progress loop takes before it progresses the worker again.
constexpr int commands_per_round = 64;
/// How recently another thread must have polled for the progress thread to stand by (and how
/// long it stands by before it looks again).
constexpr auto stand_by_window = std::chrono::milliseconds(1);
/// Queue nodes allocated up front; a burst beyond them allocates more.
constexpr std::size_t command_queue_capacity = 1024;
/// stop(): at most how long cancelled receives get to report back (they do so at the next
/// progress call) before what is left is abandoned.
constexpr auto cancel_grace = std::chrono::milliseconds(100);

ucp_tag_t wire_tag(std::uint64_t link_tag, std::uint32_t sender) { return (link_tag << rank_bits) | sender; }

/// The data plane whose worker this thread is progressing now (holds its ucx_mutex), if any:
/// a handler that sends from inside a callback must not try to take the lock again.
thread_local const void* progressing = nullptr;

/// In front of every message: who sent it (so no reply endpoint is needed) and its place in
/// the (sender, receiver) sequence. UCX does not promise that active messages keep their order.
struct MessageHeader {
  std::uint64_t sequence;
  std::uint32_t from;
  std::uint32_t size;     // the message's bytes
  std::uint32_t payload;  // an inline payload's bytes (send_inline), after the message
  std::uint32_t unused;
};

/// What a calling thread asks of the progress thread. Trivially copyable: it lives in the
/// lock-free queue.
struct Command {
  enum class Kind : std::uint8_t { send, offer, receive };
  Kind kind;
  std::uint32_t peer;     // send / offer: the receiver; receive: the offering rank
  std::uint64_t tag;      // offer / receive
  std::uint64_t size;     // bytes of the message or payload
  std::uint64_t cookie;   // receive
  const void* source;     // offer; send: the inline payload (send_inline)
  std::uint64_t payload;  // send: the inline payload's bytes
  void* dest;             // receive
  std::array<std::byte, Link::max_message> message;  // send
};
static_assert(std::is_trivially_copyable_v<Command> && std::is_trivially_destructible_v<Command>);

template <class Rep, class Period>
int milliseconds_at_least_one(std::chrono::duration<Rep, Period> d) {
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(d).count();
  return static_cast<int>(std::clamp<decltype(ms)>(ms, 1, 60'000));
}

}  // namespace

struct DataPlane::Impl {
  enum class ThreadState : std::uint8_t { running, sleeping, standing_by };

  /// One operation UCX holds, from its posting until its completion callback. Owned by the
  /// progress thread (a freelist), linked into `outstanding` while UCX has it.
  struct Op {
    Impl* owner = nullptr;
    Command::Kind kind = Command::Kind::send;
    std::uint32_t peer = 0;
    std::uint64_t tag = 0;
    std::uint64_t size = 0;
    std::uint64_t cookie = 0;
    std::uint32_t generation = 0;  // of its peer's endpoint (reconnect)
    void* request = nullptr;
    bool posting = false;                  // inside the ucp_*_nbx call that posts it
    bool completed_while_posting = false;  // its callback ran before that call returned
    bool abandoned = false;                // stop() gave it up: the callback must not free it
    bool linked = false;
    Op* prev = nullptr;
    Op* next = nullptr;
    /// A message's header and bytes: UCX reads them until the send completes.
    alignas(8) std::array<std::byte, sizeof(MessageHeader) + Link::max_message> wire{};
    /// An inline payload sent apart from the header: the message's bytes, then the payload.
    std::array<ucp_dt_iov_t, 2> iov{};
  };

  struct HeldMessage {
    std::uint32_t size = 0;
    std::array<std::byte, Link::max_message> bytes{};
    std::vector<std::byte> payload;
  };

  Impl(std::uint32_t my_rank, std::uint32_t ranks, DataPlaneSettings options);

  // Any thread.
  void check_peer(std::uint32_t peer, std::string_view what) const;
  /// check_peer, and the tag fits beside the sender's rank; `dir` is "to" or "from".
  void check_payload(std::uint32_t peer, std::uint64_t tag, std::string_view dir) const;
  void push(const Command& command);
  void ring() noexcept;
  void stop() noexcept;
  /// Any thread: progress the worker here if no other thread is (try-lock). -1: another thread
  /// holds it; 0: nothing happened; 1: something did.
  int try_progress();

  // The progress thread (or, before start() / for a data plane never started, the owner).
  void run() noexcept;
  bool poll_once();
  void sleep(std::chrono::milliseconds limit, bool watch_commands);
  void stand_by();
  /// Any thread: a thread that polled is going to sleep; the progress thread takes the watch.
  void went_idle() noexcept;
  template <class Done>
  void progress_until(Done done, Clock::time_point deadline);
  void shut_down() noexcept;
  void execute(const Command& command);
  void post_message(const Command& command);
  void post_offer(const Command& command);
  void post_receive(const Command& command);
  Op* acquire(const Command& command);
  void release(Op* op);
  void link(Op* op);
  void unlink(Op* op);
  void finish_post(Op* op, ucs_status_ptr_t posted);
  void complete(Op* op, ucs_status_t status, std::size_t length);
  void on_completion(Op* op, void* request, ucs_status_t status, std::size_t length);
  void on_message(const void* header, std::size_t header_length, const void* data, std::size_t length,
                  const ucp_am_recv_param_t* param);
  void deliver(std::uint32_t from, const void* data, std::size_t size, const void* payload, std::size_t payload_size);
  void report(std::string reason);
  /// A failed operation to or from `peer` (its process may be gone): the handler decides.
  void report_peer(std::uint32_t peer, std::string reason);

  static void sent(void* request, ucs_status_t status, void* user_data);
  static void received(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data);
  static ucs_status_t message_arrived(void* arg, const void* header, std::size_t header_length, void* data,
                                      std::size_t length, const ucp_am_recv_param_t* param);

  const std::uint32_t rank;
  const std::uint32_t world_size;
  const DataPlaneSettings settings;
  const std::string who;  // "rank 3", for errors

  // Declared first, destroyed last: an abandoned request's callback may still name its Op
  // while the worker is torn down.
  std::vector<std::unique_ptr<Op>> op_storage;
  std::vector<Op*> free_ops;

  // Teardown order is the reverse: endpoints, epoll, worker, context (stop() resets them in
  // that order explicitly; these declarations keep the same order for the destructor).
  ucx::Context context;
  ucx::Worker worker;
  ucx::FileDescriptor wake_fd;  // rung by push() when the progress thread sleeps
  ucx::FileDescriptor epoll_fd;  // the worker's event fd and wake_fd
  std::vector<ucx::Endpoint> endpoints;  // by rank; our own stays empty
  // Endpoints to processes that were replaced (reconnect): what is stuck on them stays there
  // until stop(), which closes them with the others.
  std::vector<ucx::Endpoint> retired_endpoints;

  std::string address;
  std::size_t max_am_header = 0;
  std::vector<std::string> transports;  // by rank, taken at connect()
  LinkHandler* handler = nullptr;

  boost::lockfree::queue<Command> commands{command_queue_capacity};
  /// Held by whichever thread progresses the worker: the progress thread, or an actor thread
  /// that sends (its command goes out at once, with no hand-off) or polls while it is idle
  /// (a message is handled by the thread that will act on it, with no wake-up). Everything
  /// below marked "the progress thread's own" is touched only under it.
  std::mutex ucx_mutex;
  std::atomic<bool> inline_progress{false};  // after start(), until stop()
  /// When a thread other than the progress thread last polled (steady clock, ns; 0: it went
  /// idle). While other threads poll, the progress thread stands by without arming the worker's
  /// event fd: every arrival would wake it only to find the message taken, and on a machine
  /// with few cores that wake-up takes the core a poller needs.
  std::atomic<std::int64_t> last_outside_poll{0};
  alignas(64) std::atomic<ThreadState> thread_state{ThreadState::running};
  std::atomic<bool> accepting{true};
  std::atomic<bool> stop_requested{false};
  std::atomic<bool> connected{false};

  // Counters: written by the progress thread only, read by anyone.
  alignas(64) std::atomic<std::uint64_t> messages_sent{0};
  std::atomic<std::uint64_t> messages_received{0};
  std::atomic<std::uint64_t> payloads_sent{0};
  std::atomic<std::uint64_t> payloads_received{0};
  std::atomic<std::uint64_t> payload_bytes_received{0};
  std::atomic<std::uint64_t> sleeps{0};
  std::atomic<std::uint64_t> errors{0};

  // The progress thread's own.
  alignas(64) Op* outstanding = nullptr;  // head of the list of ops UCX holds
  std::size_t outstanding_count = 0;
  std::vector<std::uint32_t> peer_generation;        // by rank: its reconnects so far
  std::vector<std::uint64_t> next_send_sequence;     // by receiver
  std::vector<std::uint64_t> next_receive_sequence;  // by sender
  std::vector<std::map<std::uint64_t, HeldMessage>> early;  // by sender: arrived ahead of turn
  bool link_failed = false;
  bool quiet = false;  // stopping: no more calls into the handler

  std::mutex life_cycle_mutex;  // start() / stop() / connect(); never on the hot path
  bool started = false;
  bool stopped = false;
  std::thread thread;
};

std::vector<std::pair<std::string, std::string>> ucx_configuration(const DataPlaneSettings& settings) {
  std::vector<std::pair<std::string, std::string>> config;
  // Unless told otherwise, every transport but CMA (process_vm_readv between processes of one
  // host). With CMA, a rank whose peer dies mid-copy is aborted by UCX (SIGABRT and a backtrace:
  // ERR_HANDLING_MODE_NONE makes a failed endpoint fatal), so the job ended blaming the survivor
  // (found by tests/mp/test_faults.cpp). Without it a lost peer is an error baton reports.
  // UCP_ERR_HANDLING_MODE_PEER, the other way out, cost 4-20x. The price: UCX's rendezvous
  // between processes of one host then runs over TCP loopback (the shared-memory transports
  // have no zero-copy get), which is why payloads below `rendezvous_from` go eagerly through
  // the shared-memory FIFO instead. UCX_TLS=all (or `transports`) brings CMA back.
  if (!settings.transports.empty()) {
    config.emplace_back("TLS", settings.transports);
  } else if (std::getenv("UCX_TLS") == nullptr) {
    config.emplace_back("TLS", "^cma");
  }
  if (settings.rendezvous_from > 0 && std::getenv("UCX_RNDV_THRESH") == nullptr) {
    config.emplace_back("RNDV_THRESH", std::to_string(settings.rendezvous_from));
  }
  return config;
}

DataPlane::Impl::Impl(std::uint32_t my_rank, std::uint32_t ranks, DataPlaneSettings options)
    : rank(my_rank), world_size(ranks), settings(std::move(options)), who(fmt::format("rank {}", my_rank)) {
  if (world_size == 0 || world_size > max_world_size || rank >= world_size) {
    throw TransportError(fmt::format("data plane: rank {} in a world of {} (at most {} ranks)", rank, world_size,
                                     max_world_size));
  }
  context = ucx::Context(UCP_FEATURE_AM | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP, ucx_configuration(settings), who);
  worker = ucx::Worker(context, who);
  address = worker.address(who);
  max_am_header = worker.max_am_header(who);

  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                  UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  am.id = message_am_id;
  am.cb = &Impl::message_arrived;
  am.arg = this;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker.get(), &am); s != UCS_OK) {
    ucx::fail("ucp_worker_set_am_recv_handler", s, who);
  }

  wake_fd = ucx::FileDescriptor(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  epoll_fd = ucx::FileDescriptor(::epoll_create1(EPOLL_CLOEXEC));
  if (wake_fd.get() < 0 || epoll_fd.get() < 0) {
    throw TransportError(fmt::format("data plane ({}): eventfd / epoll_create1: {}", who, std::strerror(errno)));
  }
  for (int fd : {worker.event_fd(who), wake_fd.get()}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &event) != 0) {
      throw TransportError(fmt::format("data plane ({}): epoll_ctl: {}", who, std::strerror(errno)));
    }
  }

  transports.resize(world_size);
  peer_generation.assign(world_size, 0);
  next_send_sequence.assign(world_size, 0);
  next_receive_sequence.assign(world_size, 0);
  early.resize(world_size);
}

// --- any thread ------------------------------------------------------------------------------

void DataPlane::Impl::check_peer(std::uint32_t peer, std::string_view what) const {
  if (!accepting.load(std::memory_order_acquire)) {
    throw TransportError(fmt::format("{}: {} to / from rank {} after stop()", who, what, peer));
  }
  if (peer >= world_size) {
    throw TransportError(fmt::format("{}: {} to / from rank {}: outside the job (world size {})", who, what, peer,
                                     world_size));
  }
  if (peer == rank) {
    throw TransportError(fmt::format("{}: {} to / from itself: the data plane only joins different ranks", who, what));
  }
  if (!connected.load(std::memory_order_acquire)) {
    throw TransportError(fmt::format("{}: {} to / from rank {} before connect()", who, what, peer));
  }
}

void DataPlane::Impl::check_payload(std::uint32_t peer, std::uint64_t tag, std::string_view dir) const {
  check_peer(peer, "payload");
  if (tag > max_link_tag) {
    throw TransportError(fmt::format("{}: payload {} rank {}: tag {} does not fit in {} bits", who, dir, peer, tag,
                                     64 - rank_bits));
  }
}

int DataPlane::Impl::try_progress() {
  if (progressing == this || !inline_progress.load(std::memory_order_acquire)) return -1;
  last_outside_poll.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  std::unique_lock lock(ucx_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return -1;
  if (stop_requested.load(std::memory_order_acquire)) return -1;
  progressing = this;
  const bool did = poll_once();
  progressing = nullptr;
  return did ? 1 : 0;
}

void DataPlane::Impl::push(const Command& command) {
  // push() fails only if no node can be allocated: out of memory.
  if (!commands.push(command)) throw std::bad_alloc();
  // Post it from this thread if nobody is progressing the worker: no hand-off, no wake-up.
  for (int round = 0; round < 4; ++round) {
    if (try_progress() < 0) break;
    if (commands.empty()) return;
  }
  // Pairs with the fence in sleep(): either the progress thread sees this command when it
  // re-checks the queue, or this thread sees `sleeping` and rings (Dekker; mailbox.cpp).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const ThreadState state = thread_state.load(std::memory_order_relaxed);
  if (state != ThreadState::running && thread_state.exchange(ThreadState::running, std::memory_order_acq_rel) != ThreadState::running) {
    ring();
  }
}

void DataPlane::Impl::ring() noexcept {
  std::uint64_t one = 1;
  // A full counter (2^64 - 2 rings unread) is the only failure, and leaves the fd readable.
  if (::write(wake_fd.get(), &one, sizeof one) < 0) return;
}

void DataPlane::Impl::stop() noexcept {
  if (progressing == this) {
    // From a handler (on whichever thread is progressing the worker, holding ucx_mutex): ask;
    // the owner's stop() or the destructor joins. Joining here would wait for a progress
    // thread that waits for this thread's lock.
    accepting.store(false, std::memory_order_release);
    stop_requested.store(true, std::memory_order_release);
    ring();
    return;
  }
  std::lock_guard lock(life_cycle_mutex);
  if (stopped) return;
  stopped = true;
  accepting.store(false, std::memory_order_seq_cst);
  if (thread.joinable()) {
    stop_requested.store(true, std::memory_order_seq_cst);
    ring();
    try {
      thread.join();
    } catch (...) {
      // join() throws only for a thread that cannot be joined; nothing is left to do then.
    }
  } else {
    progressing = this;  // never started: the worker is this thread's
    shut_down();
    progressing = nullptr;
  }
  endpoints.clear();
  retired_endpoints.clear();
  epoll_fd.reset();
  worker.reset();
  context.reset();
}

// --- the progress thread ---------------------------------------------------------------------

void DataPlane::Impl::run() noexcept {
  int idle_polls = 0;
  while (!stop_requested.load(std::memory_order_acquire)) {
    bool did;
    {
      std::lock_guard lock(ucx_mutex);
      progressing = this;
      did = poll_once();
      progressing = nullptr;
    }
    if (did) {
      idle_polls = 0;
    } else if (++idle_polls >= settings.spin_polls) {
      idle_polls = 0;
      const auto since = Clock::now().time_since_epoch().count() - last_outside_poll.load(std::memory_order_relaxed);
      if (since < std::chrono::nanoseconds(stand_by_window).count()) {
        stand_by();
      } else {
        sleep(settings.max_sleep, true);
      }
    }
  }
  inline_progress.store(false, std::memory_order_release);
  std::lock_guard lock(ucx_mutex);
  progressing = this;
  shut_down();
  progressing = nullptr;
}

bool DataPlane::Impl::poll_once() {
  int taken = 0;
  Command command;
  while (taken < commands_per_round && commands.pop(command)) {
    execute(command);
    ++taken;
  }
  return ucp_worker_progress(worker.get()) > 0 || taken > 0;
}

// Others are polling: wait for a ring (a poller going idle, a command nobody could post) or a
// short timeout, without arming the worker's event fd.
void DataPlane::Impl::stand_by() {
  thread_state.store(ThreadState::standing_by, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!commands.empty() || last_outside_poll.load(std::memory_order_relaxed) == 0) {
    thread_state.store(ThreadState::running, std::memory_order_seq_cst);
    return;
  }
  pollfd p{wake_fd.get(), POLLIN, 0};
  ::poll(&p, 1, static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(stand_by_window).count()));
  thread_state.store(ThreadState::running, std::memory_order_seq_cst);
  std::uint64_t rings = 0;
  if (::read(wake_fd.get(), &rings, sizeof rings) < 0) return;  // EAGAIN: nobody rang
}

void DataPlane::Impl::went_idle() noexcept {
  last_outside_poll.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (thread_state.load(std::memory_order_relaxed) == ThreadState::standing_by) ring();
}

void DataPlane::Impl::sleep(std::chrono::milliseconds limit, bool watch_commands) {
  // The check and the arm under the lock (unless the caller holds it: shut_down); the wait
  // without it, so that actor threads may progress meanwhile.
  std::unique_lock lock(ucx_mutex, std::defer_lock);
  if (progressing != this) lock.lock();
  if (watch_commands) {
    thread_state.store(ThreadState::sleeping, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    Command command;
    if (commands.pop(command)) {  // pushed before the producer could see `sleeping`
      thread_state.store(ThreadState::running, std::memory_order_seq_cst);
      progressing = this;
      execute(command);
      if (lock.owns_lock()) progressing = nullptr;
      return;
    }
  }
  // UCS_ERR_BUSY: events arrived since the last progress; anything else: keep polling.
  const bool armed = ucp_worker_arm(worker.get()) == UCS_OK;
  if (lock.owns_lock()) lock.unlock();
  if (armed) {
    sleeps.fetch_add(1, std::memory_order_relaxed);
    std::array<epoll_event, 2> events{};
    ::epoll_wait(epoll_fd.get(), events.data(), static_cast<int>(events.size()), milliseconds_at_least_one(limit));
  }
  thread_state.store(ThreadState::running, std::memory_order_seq_cst);
  std::uint64_t rings = 0;
  if (::read(wake_fd.get(), &rings, sizeof rings) < 0) return;  // EAGAIN: nobody rang
}

template <class Done>
void DataPlane::Impl::progress_until(Done done, Clock::time_point deadline) {
  int idle_polls = 0;
  while (!done()) {
    auto now = Clock::now();
    if (now >= deadline) return;
    if (ucp_worker_progress(worker.get()) > 0) {
      idle_polls = 0;
    } else if (++idle_polls >= settings.spin_polls) {
      idle_polls = 0;
      sleep(std::min(settings.max_sleep, std::chrono::ceil<std::chrono::milliseconds>(deadline - now)), false);
    }
  }
}

void DataPlane::Impl::shut_down() noexcept {
  try {
    auto deadline = Clock::now() + settings.close_timeout;
    // What was accepted before stop() still goes out (a racing send may be left in the queue).
    Command command;
    while (commands.pop(command)) execute(command);
    progress_until([&] { return outstanding_count == 0; }, deadline);

    quiet = true;
    if (outstanding_count > 0) {
      for (Op* op = outstanding; op != nullptr;) {
        Op* next = op->next;  // a cancelled receive may complete (and unlink) right here
        ucp_request_cancel(worker.get(), op->request);
        op = next;
      }
      // Receives complete (cancelled) at the next progress; sends cannot be cancelled.
      auto receives_left = [&] {
        for (Op* op = outstanding; op != nullptr; op = op->next) {
          if (op->kind == Command::Kind::receive) return true;
        }
        return false;
      };
      progress_until([&] { return !receives_left(); },
                     Clock::now() + std::min<Clock::duration>(cancel_grace, settings.close_timeout));
      // What is left (a send to a peer that is gone) is abandoned; destroying the worker
      // reclaims it.
      for (Op* op = outstanding; op != nullptr; op = op->next) {
        op->abandoned = true;
        ucp_request_free(op->request);
      }
    }

    // Flush-mode close; UCP_EP_CLOSE_FLAG_FORCE is undefined behaviour without
    // UCP_ERR_HANDLING_MODE_PEER, so past the deadline an unfinished close is abandoned to
    // ucp_worker_destroy instead.
    std::vector<void*> closing;
    for (auto* group : {&endpoints, &retired_endpoints}) {
      for (auto& endpoint : *group) {
        if (!endpoint) continue;
        ucs_status_ptr_t request = endpoint.close();
        if (UCS_PTR_IS_PTR(request)) closing.push_back(request);
      }
    }
    auto close_deadline = std::max(deadline, Clock::now() + settings.close_timeout / 4);
    progress_until(
        [&] {
          return std::all_of(closing.begin(), closing.end(),
                             [](void* r) { return ucp_request_check_status(r) != UCS_INPROGRESS; });
        },
        close_deadline);
    for (void* request : closing) ucp_request_free(request);
  } catch (...) {
    // Only allocation can throw here; the rest of stop() still tears down.
  }
}

void DataPlane::Impl::execute(const Command& command) {
  switch (command.kind) {
    case Command::Kind::send: post_message(command); break;
    case Command::Kind::offer: post_offer(command); break;
    case Command::Kind::receive: post_receive(command); break;
  }
}

void DataPlane::Impl::post_message(const Command& command) {
  Op* op = acquire(command);
  MessageHeader header{next_send_sequence[command.peer]++, rank, static_cast<std::uint32_t>(command.size),
                       static_cast<std::uint32_t>(command.payload), 0};
  std::memcpy(op->wire.data(), &header, sizeof header);
  std::memcpy(op->wire.data() + sizeof header, command.message.data(), command.size);

  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &Impl::sent;
  param.user_data = op;
  // Eager whatever the size: an inline payload is small (Link::max_inline_payload), and the
  // receiver takes it inside the handler (UCP_AM_FLAG_WHOLE_MSG), never by a rendezvous.
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  op->posting = true;
  ucs_status_ptr_t posted;
  const bool in_header = sizeof header + command.size <= max_am_header;
  if (in_header) {
    // The message in the header (UCX's advice for small latency-bound messages); the inline
    // payload, if any, is the data, read where it lies.
    posted = ucp_am_send_nbx(endpoints[command.peer].get(), message_am_id, op->wire.data(),
                             sizeof header + command.size, command.source, command.payload, &param);
  } else if (command.payload == 0) {
    posted = ucp_am_send_nbx(endpoints[command.peer].get(), message_am_id, op->wire.data(), sizeof header,
                             op->wire.data() + sizeof header, command.size, &param);
  } else {  // the message, then the payload
    op->iov[0] = {op->wire.data() + sizeof header, command.size};
    op->iov[1] = {const_cast<void*>(command.source), command.payload};
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_iov();
    posted = ucp_am_send_nbx(endpoints[command.peer].get(), message_am_id, op->wire.data(), sizeof header,
                             op->iov.data(), op->iov.size(), &param);
  }
  op->posting = false;
  finish_post(op, posted);
}

void DataPlane::Impl::post_offer(const Command& command) {
  Op* op = acquire(command);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &Impl::sent;
  param.user_data = op;
  op->posting = true;
  ucs_status_ptr_t posted = ucp_tag_send_nbx(endpoints[command.peer].get(), command.source, command.size,
                                             wire_tag(command.tag, rank), &param);
  op->posting = false;
  finish_post(op, posted);
}

void DataPlane::Impl::post_receive(const Command& command) {
  Op* op = acquire(command);
  ucp_request_param_t param{};
  // UCX 1.13 does not fill param.recv_info on an immediate completion, so a short offer would
  // pass unnoticed: ask for the callback always (it may run inside ucp_tag_recv_nbx; `posting`).
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &Impl::received;
  param.user_data = op;
  op->posting = true;
  ucs_status_ptr_t posted = ucp_tag_recv_nbx(worker.get(), command.dest, command.size,
                                             wire_tag(command.tag, command.peer), full_tag_mask, &param);
  op->posting = false;
  finish_post(op, posted);
}

DataPlane::Impl::Op* DataPlane::Impl::acquire(const Command& command) {
  Op* op;
  if (free_ops.empty()) {
    op_storage.push_back(std::make_unique<Op>());
    op = op_storage.back().get();
  } else {
    op = free_ops.back();
    free_ops.pop_back();
  }
  *op = Op{};
  op->owner = this;
  op->kind = command.kind;
  op->peer = command.peer;
  op->tag = command.tag;
  op->size = command.size;
  op->cookie = command.cookie;
  op->generation = peer_generation[command.peer];
  return op;
}

void DataPlane::Impl::release(Op* op) {
  if (op->linked) unlink(op);
  free_ops.push_back(op);
}

void DataPlane::Impl::link(Op* op) {
  op->prev = nullptr;
  op->next = outstanding;
  if (outstanding != nullptr) outstanding->prev = op;
  outstanding = op;
  op->linked = true;
  ++outstanding_count;
}

void DataPlane::Impl::unlink(Op* op) {
  if (op->prev != nullptr) {
    op->prev->next = op->next;
  } else {
    outstanding = op->next;
  }
  if (op->next != nullptr) op->next->prev = op->prev;
  op->linked = false;
  --outstanding_count;
}

void DataPlane::Impl::finish_post(Op* op, ucs_status_ptr_t posted) {
  if (posted == nullptr) {  // done at once: no callback will come
    complete(op, UCS_OK, op->size);  // (receives always call back: post_receive)
    release(op);
  } else if (UCS_PTR_IS_ERR(posted)) {
    complete(op, UCS_PTR_STATUS(posted), 0);
    release(op);
  } else if (op->completed_while_posting) {  // the callback ran already and freed the request
    release(op);
  } else {
    op->request = posted;
    link(op);
  }
}

void DataPlane::Impl::complete(Op* op, ucs_status_t status, std::size_t length) {
  if (op->generation != peer_generation[op->peer]) {  // to or from a process that was replaced
    if (status != UCS_OK) errors.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  switch (op->kind) {
    case Command::Kind::send:
      if (status == UCS_OK) {
        messages_sent.fetch_add(1, std::memory_order_relaxed);
      } else {
        report_peer(op->peer,
                    fmt::format("{}: message to rank {}: ucp_am_send_nbx: {}", who, op->peer, ucs_status_string(status)));
      }
      return;
    case Command::Kind::offer:
      if (status == UCS_OK) {
        // Release: a stats() that counts this offer also sees UCX done reading its memory.
        payloads_sent.fetch_add(1, std::memory_order_release);
      } else {
        report_peer(op->peer, fmt::format("{}: payload of {} bytes to rank {} under tag {}: ucp_tag_send_nbx: {}", who, op->size,
                           op->peer, op->tag, ucs_status_string(status)));
      }
      return;
    case Command::Kind::receive:
      if (status == UCS_OK && length == op->size) {
        payloads_received.fetch_add(1, std::memory_order_relaxed);
        payload_bytes_received.fetch_add(op->size, std::memory_order_relaxed);
        if (handler == nullptr || quiet) return;
        try {
          handler->on_payload(op->cookie);
        } catch (const std::exception& e) {
          report(fmt::format("{}: on_payload threw: {}", who, e.what()));
        } catch (...) {
          report(fmt::format("{}: on_payload threw", who));
        }
      } else if (status == UCS_OK) {
        report(fmt::format("{}: payload from rank {} under tag {}: expected {} bytes, rank {} offered {}", who,
                           op->peer, op->tag, op->size, op->peer, length));
      } else if (status == UCS_ERR_MESSAGE_TRUNCATED) {
        report(fmt::format("{}: payload from rank {} under tag {}: expected {} bytes, rank {} offered more: "
                           "ucp_tag_recv_nbx: {}",
                           who, op->peer, op->tag, op->size, op->peer, ucs_status_string(status)));
      } else {
        report_peer(op->peer, fmt::format("{}: payload of {} bytes from rank {} under tag {}: ucp_tag_recv_nbx: {}", who, op->size,
                           op->peer, op->tag, ucs_status_string(status)));
      }
      return;
  }
}

void DataPlane::Impl::on_completion(Op* op, void* request, ucs_status_t status, std::size_t length) {
  if (op->abandoned) {  // stop() freed the request already; only the Op is left to recycle
    release(op);
    return;
  }
  complete(op, status, length);
  ucp_request_free(request);
  if (op->posting) {
    op->completed_while_posting = true;  // finish_post() recycles it
    return;
  }
  release(op);
}

void DataPlane::Impl::sent(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->owner->on_completion(op, request, status, op->size);
}

void DataPlane::Impl::received(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->owner->on_completion(op, request, status, info != nullptr ? info->length : 0);
}

ucs_status_t DataPlane::Impl::message_arrived(void* arg, const void* header, std::size_t header_length, void* data,
                                              std::size_t length, const ucp_am_recv_param_t* param) {
  static_cast<Impl*>(arg)->on_message(header, header_length, data, length, param);
  return UCS_OK;  // the bytes were consumed (copied out if held back)
}

void DataPlane::Impl::on_message(const void* header, std::size_t header_length, const void* data,
                                 std::size_t length, const ucp_am_recv_param_t* param) {
  if (header_length < sizeof(MessageHeader) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    report(fmt::format("{}: malformed message ({} header bytes, {} data bytes)", who, header_length, length));
    return;
  }
  MessageHeader h;
  std::memcpy(&h, header, sizeof h);
  // The message rides in the header (and the data is the inline payload, if any), or the data
  // is the message followed by the payload.
  const bool in_header = header_length > sizeof h;
  const auto* bytes = in_header ? static_cast<const std::byte*>(header) + sizeof h : static_cast<const std::byte*>(data);
  const std::size_t size = in_header ? header_length - sizeof h : std::min<std::size_t>(length, h.size);
  const std::byte* payload = in_header ? static_cast<const std::byte*>(data) : bytes + size;
  const std::size_t payload_length = in_header ? length : length - size;
  if (h.from >= world_size || size != h.size || size > Link::max_message || payload_length != h.payload ||
      h.payload > Link::max_inline_payload) {
    report(fmt::format("{}: malformed message (from rank {}, {} + {} bytes, {} + {} announced)", who, h.from,
                       header_length, length, h.size, h.payload));
    return;
  }
  std::uint64_t& expected = next_receive_sequence[h.from];
  if (h.sequence != expected) {
    if (h.sequence > expected) {  // early: hold it until its turn
      HeldMessage& held = early[h.from][h.sequence];
      held.size = h.size;
      std::memcpy(held.bytes.data(), bytes, size);
      held.payload.assign(payload, payload + h.payload);
    }
    return;
  }
  deliver(h.from, bytes, size, payload, h.payload);
  ++expected;
  auto& held = early[h.from];
  for (auto it = held.begin(); it != held.end() && it->first == expected; it = held.erase(it)) {
    deliver(h.from, it->second.bytes.data(), it->second.size, it->second.payload.data(), it->second.payload.size());
    ++expected;
  }
}

void DataPlane::Impl::deliver(std::uint32_t from, const void* data, std::size_t size, const void* payload,
                              std::size_t payload_size) {
  messages_received.fetch_add(1, std::memory_order_relaxed);
  if (handler == nullptr || quiet) return;
  static constexpr std::byte nothing{};
  try {
    if (payload_size > 0) {
      handler->on_message_with_payload(from, size == 0 ? &nothing : data, size, payload, payload_size);
    } else {
      handler->on_message(from, size == 0 ? &nothing : data, size);
    }
  } catch (const std::exception& e) {
    report(fmt::format("{}: on_message threw: {}", who, e.what()));
  } catch (...) {
    report(fmt::format("{}: on_message threw", who));
  }
}

void DataPlane::Impl::report_peer(std::uint32_t peer, std::string reason) {
  errors.fetch_add(1, std::memory_order_relaxed);
  if (link_failed || quiet || handler == nullptr) return;
  try {
    if (handler->on_peer_error(peer, reason)) link_failed = true;
  } catch (...) {
    // As report().
  }
}

void DataPlane::Impl::report(std::string reason) {
  errors.fetch_add(1, std::memory_order_relaxed);
  if (link_failed || quiet || handler == nullptr) return;
  link_failed = true;
  try {
    handler->on_link_error(reason);
  } catch (...) {
    // The handler's own failure has nowhere further to go.
  }
}

// --- DataPlane -------------------------------------------------------------------------------

DataPlane::DataPlane(std::uint32_t rank, std::uint32_t world_size, DataPlaneSettings settings)
    : impl_(std::make_unique<Impl>(rank, world_size, std::move(settings))) {}

DataPlane::~DataPlane() { stop(); }

const std::string& DataPlane::address() const { return impl_->address; }

void DataPlane::connect(const std::vector<std::string>& addresses) {
  Impl& d = *impl_;
  std::lock_guard lock(d.life_cycle_mutex);
  if (d.started || d.stopped || d.connected.load()) {
    throw TransportError(fmt::format("{}: connect() once, before start()", d.who));
  }
  if (addresses.size() != d.world_size) {
    throw TransportError(
        fmt::format("{}: connect() with {} addresses for a world of {}", d.who, addresses.size(), d.world_size));
  }
  std::vector<ucx::Endpoint> endpoints(d.world_size);
  std::vector<std::string> transports(d.world_size);
  for (std::uint32_t peer = 0; peer < d.world_size; ++peer) {
    if (peer == d.rank) continue;
    endpoints[peer] = ucx::Endpoint(d.worker, addresses[peer], fmt::format("{} to rank {}", d.who, peer));
    transports[peer] = endpoints[peer].transports();
  }
  d.endpoints = std::move(endpoints);
  d.transports = std::move(transports);
  d.connected.store(true, std::memory_order_release);
}

void DataPlane::reconnect(std::uint32_t peer, const std::string& address) {
  Impl& d = *impl_;
  std::lock_guard lock(d.life_cycle_mutex);
  if (peer >= d.world_size || peer == d.rank) {
    throw TransportError(fmt::format("{}: reconnect() to rank {} (world size {})", d.who, peer, d.world_size));
  }
  if (!d.connected.load() || d.stopped) throw TransportError(fmt::format("{}: reconnect() after connect(), before stop()", d.who));
  std::lock_guard progress(d.ucx_mutex);
  ucx::Endpoint fresh(d.worker, address, fmt::format("{} to rank {}", d.who, peer));
  d.retired_endpoints.push_back(std::move(d.endpoints[peer]));
  d.endpoints[peer] = std::move(fresh);
  d.transports[peer] = d.endpoints[peer].transports();
  ++d.peer_generation[peer];
  // The new process numbers its messages from 0, and nothing of the old one's is still due.
  d.next_send_sequence[peer] = 0;
  d.next_receive_sequence[peer] = 0;
  d.early[peer].clear();
}

void DataPlane::start() {
  Impl& d = *impl_;
  std::lock_guard lock(d.life_cycle_mutex);
  if (d.started || d.stopped) throw TransportError(fmt::format("{}: start() once, before stop()", d.who));
  if (d.handler == nullptr) throw TransportError(fmt::format("{}: start() before set_handler()", d.who));
  d.thread = std::thread([&d] { d.run(); });
  d.started = true;
  d.inline_progress.store(true, std::memory_order_release);
}

void DataPlane::stop() noexcept { impl_->stop(); }

bool DataPlane::poll() { return impl_->try_progress() > 0; }

void DataPlane::idle() { impl_->went_idle(); }

namespace {

// UCX reaches a peer through one of its shared-memory transports only on the same host.
bool over_shared_memory(const std::string& transports) {
  return transports.find("sysv") != std::string::npos || transports.find("posix") != std::string::npos ||
         transports.find("xpmem") != std::string::npos;
}

}  // namespace

std::size_t DataPlane::inline_limit(std::uint32_t peer) const {
  const Impl& d = *impl_;
  if (peer >= d.world_size || !d.connected.load(std::memory_order_acquire)) return 0;
  return over_shared_memory(d.transports[peer]) ? std::size_t{4} << 10 : max_inline_payload;
}

bool DataPlane::shares_memory_with(std::uint32_t peer) const {
  const Impl& d = *impl_;
  if (peer >= d.world_size || peer == d.rank || !d.connected.load(std::memory_order_acquire)) return false;
  return over_shared_memory(d.transports[peer]);
}

std::string DataPlane::transports_to(std::uint32_t peer) const {
  const Impl& d = *impl_;
  if (peer >= d.world_size || peer == d.rank || !d.connected.load(std::memory_order_acquire)) {
    throw TransportError(fmt::format("{}: transports_to({}): no endpoint (world size {}{})", d.who, peer,
                                     d.world_size, d.connected.load() ? "" : ", not connected"));
  }
  return d.transports[peer];
}

DataPlaneStats DataPlane::stats() const {
  const Impl& d = *impl_;
  DataPlaneStats s;
  s.messages_sent = d.messages_sent.load(std::memory_order_relaxed);
  s.messages_received = d.messages_received.load(std::memory_order_relaxed);
  s.payloads_sent = d.payloads_sent.load(std::memory_order_acquire);
  s.payloads_received = d.payloads_received.load(std::memory_order_relaxed);
  s.payload_bytes_received = d.payload_bytes_received.load(std::memory_order_relaxed);
  s.sleeps = d.sleeps.load(std::memory_order_relaxed);
  s.errors = d.errors.load(std::memory_order_relaxed);
  return s;
}

std::uint32_t DataPlane::rank() const { return impl_->rank; }
std::uint32_t DataPlane::world_size() const { return impl_->world_size; }

void DataPlane::set_handler(LinkHandler* handler) { impl_->handler = handler; }

void DataPlane::send(std::uint32_t to, const void* data, std::size_t size) { send_inline(to, data, size, nullptr, 0); }

void DataPlane::send_inline(std::uint32_t to, const void* data, std::size_t size, const void* payload,
                            std::size_t payload_size) {
  Impl& d = *impl_;
  if (size > max_message) {
    throw TransportError(fmt::format("{}: message of {} bytes to rank {}: at most {}", d.who, size, to, max_message));
  }
  if (payload_size > max_inline_payload) {
    throw TransportError(fmt::format("{}: inline payload of {} bytes to rank {}: at most {}", d.who, payload_size, to,
                                     max_inline_payload));
  }
  d.check_peer(to, "message");
  Command command{};
  command.kind = Command::Kind::send;
  command.peer = to;
  command.size = size;
  command.source = payload;
  command.payload = payload_size;
  if (size > 0) std::memcpy(command.message.data(), data, size);
  d.push(command);
}

void DataPlane::send_payload(std::uint32_t to, std::uint64_t tag, const void* data, std::size_t size) {
  Impl& d = *impl_;
  d.check_payload(to, tag, "to");
  Command command{};
  command.kind = Command::Kind::offer;
  command.peer = to;
  command.tag = tag;
  command.size = size;
  command.source = data;
  d.push(command);
}

void DataPlane::receive_payload(std::uint32_t from, std::uint64_t tag, void* dest, std::size_t size,
                                std::uint64_t cookie) {
  Impl& d = *impl_;
  d.check_payload(from, tag, "from");
  Command command{};
  command.kind = Command::Kind::receive;
  command.peer = from;
  command.tag = tag;
  command.size = size;
  command.cookie = cookie;
  command.dest = dest;
  d.push(command);
}

}  // namespace baton::transport
