#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include <boost/lockfree/spsc_queue.hpp>
#include <fmt/format.h>

#include "baton/actors/plan_memory.h"
#include "baton/kernels/sim.h"
#include "internal.h"

namespace baton {

std::uint64_t steady_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

namespace detail {

// ---------------------------------------------------------------------------------------------
// Worker

/// About 3 s of a busy worker at 20k acts/s; the dashboard drains twice a second.
constexpr std::size_t activity_ring_capacity = 1 << 16;

struct Worker::Ring {
  boost::lockfree::spsc_queue<ActRecord> q{activity_ring_capacity};
};

namespace {

std::uint32_t world_of(const Core& core) {
  return core.settings.link != nullptr && !core.dry_run ? core.settings.link->world_size() : 0;
}

}  // namespace

Worker::Worker(Core& core, Device device, std::uint8_t stream, std::size_t mailbox_capacity, std::uint16_t index)
    : core_(core), device_(device), stream_(stream), mailbox_(mailbox_capacity), outbox_(world_of(core)), index_(index) {
  if (core.settings.activity_log) ring_ = std::make_unique<Ring>();
  if (world_of(core) > 1 && core.settings.hold_messages_ns > 0) {
    hold_ticks_ = std::max<std::uint64_t>(1, static_cast<std::uint64_t>(core.settings.hold_messages_ns / ns_per_tick()));
  }
}

Worker::~Worker() = default;

void Worker::log(const ActRecord& r) {
  if (!ring_->q.push(r)) log_dropped_.store(log_dropped_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

std::size_t Worker::drain_log(std::vector<ActRecord>& out) {
  if (!ring_) return 0;
  // All that is there in one pop: the ring's indices move once, not once a record, so the
  // worker pushing meanwhile does not lose their cache line to every record drained.
  const std::size_t before = out.size();
  out.resize(before + ring_->q.read_available());
  const std::size_t n = ring_->q.pop(out.data() + before, out.size() - before);
  out.resize(before + n);
  return n;
}

void Worker::dispatch(const Message& m) {
  messages_.store(messages_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  core_.actor(m.dst)->on_message(m);
}

void Worker::send_link_message(const Message* messages, std::size_t n) {
  messages_to_other_ranks_ += n;
  ++link_messages_;
  core_.send_remote_batch(messages, n);
}

void Worker::send_remote(const Message& m) {
  if (hold_ticks_ == 0) return send_link_message(&m, 1);
  outbox_.add(m, ticks(), sender());
}

void Worker::flush_outbox() { outbox_.flush(sender()); }

void Worker::flush_outbox_to(std::uint32_t rank) { outbox_.flush_to(rank, sender()); }

namespace {

/// The worker whose run() this thread is in, if any.
thread_local Worker* this_thread_worker = nullptr;

}  // namespace

void Worker::deliver(const Message& m) {
  if (this_thread_worker == this && mailbox_.empty()) {
    local_.push(m);
  } else {
    mailbox_.push(m);
  }
}

void Worker::run() {
  this_thread_worker = this;
  const int spin_polls = core_.settings.spin_polls;
  const int yield_every = core_.settings.spin_yield_every;
  const bool busy_poll = core_.busy_poll;
  transport::Link* link = core_.settings.link;
  int idle = 0;
  while (!mailbox_.closed()) {
    if (auto m = local_.pop()) {
      dispatch(*m);
      after_dispatch();
      idle = 0;
    } else if (auto mm = mailbox_.try_pop()) {
      dispatch(*mm);
      after_dispatch();
      idle = 0;
    } else if (link != nullptr && link->poll()) {
      // An idle worker progresses the data plane itself: what arrives for its actors lands in
      // its own local queue (deliver) with no hand-off.
      idle = 0;
    } else if (++idle < spin_polls || busy_poll) {
      if (idle >= spin_polls) idle = 0;
      if (!busy_poll && yield_every > 0 && idle % yield_every == 0) {
        sched_yield();
      } else {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
    } else {
      idle = 0;
      if (link != nullptr) link->idle();  // the data plane's own thread takes the watch
      if (auto parked = mailbox_.park()) {
        dispatch(*parked);
        after_dispatch();
      }
    }
  }
  // Closed (the rank's last actor retired, or the run failed) with work left in the local ring:
  // what its last acts sent other ranks (an end of stream, a last ack) still goes, as it did
  // when nothing was held; the runtime joins this thread before the data plane stops.
  flush_outbox();
  this_thread_worker = nullptr;
}

void Worker::drain() {
  while (!core_.failed() && !core_.dry_budget_spent()) {
    if (auto m = local_.pop()) {
      dispatch(*m);
      after_dispatch();
    } else if (auto mm = mailbox_.try_pop()) {
      dispatch(*mm);
      after_dispatch();
    } else {
      return;
    }
  }
}

void Worker::start_thread() {
  thread_ = std::thread([this] {
    try {
      run();
    } catch (const std::exception& e) {
      core_.fail(fmt::format("worker {}/s{} failed: {}", device_.str(), stream_, e.what()));
    }
  });
}

void Worker::join() {
  if (thread_.joinable()) thread_.join();
}

// ---------------------------------------------------------------------------------------------
// Core

namespace {

/// By plan index: whether an actor reads, directly or further down, what an ActorDesc::at_end
/// accumulate publishes (once, after the run).
std::vector<bool> after_end(const Plan& plan) {
  std::vector<bool> after(plan.actors.size(), false);
  std::vector<ActorIndex> todo;
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    if (plan.actors[i].at_end) todo.push_back(i);
  }
  while (!todo.empty()) {
    const ActorIndex i = todo.back();
    todo.pop_back();
    for (RegisterIndex r : plan.actors[i].outputs) {
      if (r >= plan.registers.size()) continue;
      for (ActorIndex c : plan.registers[r].consumers) {
        if (c < after.size() && !after[c]) {
          after[c] = true;
          todo.push_back(c);
        }
      }
    }
  }
  return after;
}

/// Acts of each actor in one iteration of the plan read as synchronous dataflow (Lee and
/// Messerschmitt's repetition vector): along each register, the producer's acts divided by its
/// acts per output piece (accumulate: its group) equal each consumer's acts divided by its acts
/// per input piece (repeat: its group); within a lane, each actor's acts divided by its units
/// per period are equal. The smallest positive integer solution per connected part of the plan.
/// Empty where the equations have none (a plan whose rates disagree; the long check decides)
/// or its numbers pass 10^9.
std::vector<std::int64_t> acts_per_iteration(const Plan& plan) {
  const std::size_t n = plan.actors.size();
  struct Edge {
    std::size_t to;
    std::int64_t num, den;  // acts[to] = acts[from] * num / den
  };
  std::vector<std::vector<Edge>> edges(n);
  auto link = [&](std::size_t from, std::size_t to, std::int64_t num, std::int64_t den) {
    edges[from].push_back({to, num, den});
    edges[to].push_back({from, den, num});
  };
  for (std::size_t c = 0; c < n; ++c) {
    const ActorDesc& a = plan.actors[c];
    if (a.group < 1) return {};
    const std::int64_t in_ratio = a.kind == ActorKind::repeat ? a.group : 1;
    for (const InputPort& in : a.inputs) {
      if (in.reg >= plan.registers.size()) return {};
      const ActorIndex p = plan.registers[in.reg].producer;
      if (p >= n) return {};
      // What an at_end accumulate publishes comes once, after the run: outside the iteration.
      if (plan.actors[p].at_end) continue;
      const std::int64_t out_group = plan.actors[p].kind == ActorKind::accumulate ? plan.actors[p].group : 1;
      link(p, c, in_ratio, out_group);
    }
  }
  std::map<std::int32_t, std::size_t> lane_first;
  for (std::size_t i = 0; i < n; ++i) {
    const ActOrder& o = plan.actors[i].order;
    if (o.lane < 0) continue;
    if (o.units.empty()) return {};
    auto [it, first] = lane_first.emplace(o.lane, i);
    if (!first) {
      link(it->second, i, static_cast<std::int64_t>(o.units.size()),
           static_cast<std::int64_t>(plan.actors[it->second].order.units.size()));
    }
  }
  constexpr std::int64_t limit = 1'000'000'000;
  std::vector<std::int64_t> num(n, 0), den(n, 1), out(n, 0);
  std::vector<std::size_t> part;
  for (std::size_t root = 0; root < n; ++root) {
    if (num[root] != 0) continue;
    num[root] = 1;
    part.assign(1, root);
    for (std::size_t k = 0; k < part.size(); ++k) {
      const std::size_t i = part[k];
      for (const Edge& e : edges[i]) {
        // acts[to] = num[i] * e.num / (den[i] * e.den), reduced
        std::int64_t a = num[i] * e.num, b = den[i] * e.den;
        const std::int64_t g = std::gcd(a, b);
        a /= g;
        b /= g;
        if (a > limit || b > limit) return {};
        if (num[e.to] == 0) {
          num[e.to] = a;
          den[e.to] = b;
          part.push_back(e.to);
        } else if (num[e.to] != a || den[e.to] != b) {
          return {};
        }
      }
    }
    std::int64_t lcm = 1;
    for (std::size_t i : part) {
      lcm = std::lcm(lcm, den[i]);
      if (lcm > limit) return {};
    }
    std::int64_t g = 0;
    for (std::size_t i : part) {
      out[i] = num[i] * (lcm / den[i]);
      if (out[i] > limit) return {};
      g = std::gcd(g, out[i]);
    }
    for (std::size_t i : part) out[i] /= g;
  }
  return out;
}

/// Pieces of each register a step (Core::pieces_per_step); empty where the plan's rates disagree.
std::vector<std::int64_t> pieces_per_step(const Plan& plan) {
  const std::vector<std::int64_t> acts = acts_per_iteration(plan);
  if (acts.empty()) return {};
  std::vector<std::int64_t> per(plan.registers.size(), 0);
  for (RegisterIndex r = 0; r < plan.registers.size(); ++r) {
    const ActorIndex p = plan.registers[r].producer;
    if (p >= plan.actors.size()) continue;
    const ActorDesc& a = plan.actors[p];
    if (a.at_end) continue;  // once a run
    per[r] = acts[p] / (a.kind == ActorKind::accumulate ? a.group : 1);
  }
  return per;
}

}  // namespace

Core::Core(Plan p, const KernelRegistry* k, RuntimeSettings s, bool dry)
    : plan(std::move(p)), kernels(k), settings(s), dry_run(dry) {
  if (dry_run) settings.activity_log = false;
  activity_log.store(settings.activity_log, std::memory_order_relaxed);
  sampled_time.store(settings.time_accounting && settings.time_sample_hz > 0 && !dry_run, std::memory_order_relaxed);
  for (const ActorDesc& a : plan.actors) departed_ranks = std::max<std::size_t>(departed_ranks, a.where.rank + 1u);
  departed_flags = std::make_unique<std::atomic<bool>[]>(departed_ranks);
  if (!dry_run) {
    // NCCL gives up a little before the watchdog would, so that the error reported is its own
    // (which names the call and the rank), and at once when the run fails.
    const auto wait = settings.stall_timeout.count() > 0 ? settings.stall_timeout * 3 / 4 : std::chrono::milliseconds{120'000};
    nccl = std::make_unique<nccl::Communicators>(settings.rank, settings.store, nccl::WaitSettings{wait, &failed_},
                                                 [this](const std::string& why) { fail(why); });
    services = KernelServices{settings.rank, settings.store, nccl.get(), &failed_};
  }
}

Core::~Core() {
  stop_sampler();
  for (auto& w : workers) w->close();
  for (auto& w : workers) w->join();
}

// ---------------------------------------------------------------------------------------------
// Sampled time accounting (RuntimeSettings::time_sample_hz)

void Core::sample_activity() {
  const std::uint64_t now = ticks();
  const std::uint64_t last = sampled_until.load(std::memory_order_relaxed);
  if (now <= last) return;
  const std::uint64_t dt = now - last;
  for (auto& a : actors) {
    if (!a) continue;
    ActorCounters& c = a->counters_for_sampler();
    const ActorActivity what = c.activity.load(std::memory_order_relaxed);
    if (what == ActorActivity::retired) continue;
    // Only this thread writes these in sampled mode: a load and a store, no read-modify-write.
    auto& bucket = c.ticks[static_cast<std::size_t>(what)];
    bucket.store(bucket.load(std::memory_order_relaxed) + dt, std::memory_order_relaxed);
    if (what == ActorActivity::busy && c.in_kernel.load(std::memory_order_relaxed)) {
      c.kernel_ticks.store(c.kernel_ticks.load(std::memory_order_relaxed) + dt, std::memory_order_relaxed);
    }
  }
  sampled_until.store(now, std::memory_order_relaxed);
}

void Core::start_sampler() {
  if (!sampled_time.load(std::memory_order_relaxed) || sampler.joinable()) return;
  sampled_until.store(start_ticks.load(std::memory_order_relaxed), std::memory_order_relaxed);
  sampler_stop = false;
  // Sampling needs a real-time priority (root, CAP_SYS_NICE, RLIMIT_RTPRIO): a sampler at the
  // normal priority gets a core on a busy machine mostly when an actor's thread waits, and then
  // sees starved actors too often (a stage that spun 0.3 s was booked 0.04 s under a parallel
  // build on 2 cores; docs/observing.md). Where the system refuses it, the run accounts exactly
  // instead: decided here, before any actor acts.
  std::promise<bool> realtime;
  std::future<bool> got = realtime.get_future();
  sampler = std::thread([this, &realtime] {
    sched_param rt{};
    rt.sched_priority = 1;
    const bool ok = pthread_setschedparam(pthread_self(), SCHED_FIFO, &rt) == 0;
    realtime.set_value(ok);
    if (!ok) return;
    const auto period = std::chrono::nanoseconds(1'000'000'000 / std::max(1, settings.time_sample_hz));
    std::unique_lock lock(sampler_mutex);
    while (!sampler_stop) {
      lock.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      sample_activity();
      // A look at every actor touches each one's counters, cache lines its worker writes: with
      // many actors that costs, so the sampler waits at least 50 times as long as it looked.
      const auto looked = std::chrono::steady_clock::now() - t0;
      lock.lock();
      sampler_cv.wait_for(lock, std::max<std::chrono::nanoseconds>(period, looked * 50), [&] { return sampler_stop; });
    }
  });
  if (!got.get()) {
    sampler.join();
    sampled_time.store(false, std::memory_order_relaxed);  // exact: every actor's clock starts at begin(), as sampling's would
  }
}

void Core::stop_sampler() {
  if (!sampler.joinable()) return;
  {
    std::lock_guard lock(sampler_mutex);
    sampler_stop = true;
  }
  sampler_cv.notify_all();
  sampler.join();
  sample_activity();  // up to now: the run's last stretch
}

// ---------------------------------------------------------------------------------------------
// The data plane's side (called on its progress thread)

void Core::send_remote(const Message& msg, const void* payload, std::size_t payload_size) {
  if (departed(msg.dst.rank())) return;  // it left the job: nobody reads it any more
  const Message m = shifted(msg);
  if (settings.link == nullptr) {
    fail(fmt::format("a message for {} on rank {} but this runtime has no data plane", m.dst.str(), m.dst.rank()));
    return;
  }
  try {
    if (payload_size > 0) {
      settings.link->send_inline(m.dst.rank(), &m, sizeof m, payload, payload_size);
    } else {
      settings.link->send(m.dst.rank(), &m, sizeof m);
    }
  } catch (const std::exception& e) {
    fail(fmt::format("could not send a {} to {} on rank {}: {}", name(m.kind), m.dst.str(), m.dst.rank(), e.what()));
  }
}

void Core::send_remote_batch(const Message* m, std::size_t n) {
  if (n == 1 || settings.link == nullptr) return send_remote(*m);  // without a link: fails, saying why
  if (departed(m->dst.rank())) return;
  if (!piece_shift.empty()) {  // a rank that came back: pieces as the others number them
    std::array<Message, Outbox::per_link_message> moved;
    for (std::size_t i = 0; i < n; ++i) moved[i] = shifted(m[i]);
    return send_shifted_batch(moved.data(), n);
  }
  send_shifted_batch(m, n);
}

void Core::send_shifted_batch(const Message* m, std::size_t n) {
  try {
    settings.link->send(m->dst.rank(), m, n * sizeof *m);
  } catch (const std::exception& e) {
    fail(fmt::format("could not send {} messages ({}, ...) to rank {}: {}", n, name(m->kind), m->dst.rank(), e.what()));
  }
}

void Core::send_remote_mapped(const Message& m, const transport::SharedLocation& at) {
  if (departed(m.dst.rank())) return;
  const MappedRequest r{shifted(m), at};
  try {
    settings.link->send(m.dst.rank(), &r, sizeof r);
  } catch (const std::exception& e) {
    fail(fmt::format("could not send a {} to {} on rank {}: {}", name(m.kind), m.dst.str(), m.dst.rank(), e.what()));
  }
}

std::optional<transport::SharedLocation> Core::locate_shared(std::uint32_t rank, const void* data,
                                                             std::size_t bytes) const {
  if (!settings.shared_registers || shared_segments == nullptr || !settings.link->shares_memory_with(rank)) {
    return std::nullopt;
  }
  return shared_segments->locate(data, bytes);
}

Actor* Core::receiver(std::uint32_t from_rank, const Message& m) {
  if (departed(from_rank)) return nullptr;  // sent before it left: the actors have let it go
  Actor* a = m.dst.index() < actors.size() ? actors[m.dst.index()].get() : nullptr;
  if (m.dst.rank() != settings.rank || a == nullptr || m.src.rank() != from_rank) {
    fail(fmt::format("rank {} sent a {} for {}, which is not an actor of rank {} (do both ranks run the same plan?)",
                     from_rank, name(m.kind), m.dst.str(), settings.rank));
    return nullptr;
  }
  return a;
}

void Core::on_message(std::uint32_t from_rank, const void* data, std::size_t size) {
  on_message_with_payload(from_rank, data, size, nullptr, 0);
}

void Core::on_message_with_payload(std::uint32_t from_rank, const void* data, std::size_t size, const void* payload,
                                   std::size_t payload_size) {
  Message m;
  if (size < sizeof m) {
    fail(fmt::format("rank {} sent a message of {} bytes; actor messages have {}", from_rank, size, sizeof m));
    return;
  }
  std::memcpy(&m, data, sizeof m);
  if (size > sizeof m && m.kind != MsgKind::request_mapped && payload_size == 0) {
    return on_messages(from_rank, data, size);
  }
  if (m.reg < plan.registers.size()) m.piece -= shift(m.reg);  // RuntimeSettings::rejoin_step
  const std::size_t expected = m.kind == MsgKind::request_mapped ? sizeof(MappedRequest) : sizeof m;
  if (size != expected) {
    fail(fmt::format("rank {} sent a {} of {} bytes; it has {}", from_rank, name(m.kind), size, expected));
    return;
  }
  Actor* a = receiver(from_rank, m);
  if (a == nullptr) return;
  if (m.kind == MsgKind::request_mapped) {
    // Mapped before the request is posted, as a staged piece: the transfer reads it when it acts.
    MappedRequest r;
    std::memcpy(&r, data, sizeof r);
    if (std::string wrong = a->map_piece(m, r.at); !wrong.empty()) {
      fail(fmt::format("rank {} told {} where piece {} of '{}' lies: {}", from_rank, m.dst.str(), m.piece,
                       m.reg < plan.registers.size() ? plan.registers[m.reg].name : "?", wrong));
      return;
    }
  }
  if ((payload_size > 0) != (m.kind == MsgKind::request_inline)) {
    fail(fmt::format("rank {} sent a {} for {} with {} bytes inline", from_rank, name(m.kind), m.dst.str(),
                     payload_size));
    return;
  }
  if (payload_size > 0) {
    // Staged before the request is posted: the transfer finds the bytes when it acts.
    if (std::string wrong = a->stage(m, payload, payload_size); !wrong.empty()) {
      fail(fmt::format("rank {} sent piece {} of '{}' inline to {}: {}", from_rank, m.piece,
                       m.reg < plan.registers.size() ? plan.registers[m.reg].name : "?", m.dst.str(), wrong));
      return;
    }
  }
  a->worker()->deliver(m);
}

// Several messages in one (Worker's outbox): none of them with a payload or a location.
void Core::on_messages(std::uint32_t from_rank, const void* data, std::size_t size) {
  if (size % sizeof(Message) != 0 || size / sizeof(Message) > Outbox::per_link_message) {
    fail(fmt::format("rank {} sent {} bytes: neither one actor message nor up to {} of {} bytes each", from_rank, size,
                     Outbox::per_link_message, sizeof(Message)));
    return;
  }
  for (std::size_t at = 0; at < size; at += sizeof(Message)) {
    Message m;
    std::memcpy(&m, static_cast<const std::byte*>(data) + at, sizeof m);
    if (m.reg < plan.registers.size()) m.piece -= shift(m.reg);
    if (m.kind == MsgKind::request_inline || m.kind == MsgKind::request_mapped) {
      fail(fmt::format("rank {} sent a {} for {} among other messages, without what it needs", from_rank, name(m.kind),
                       m.dst.str()));
      return;
    }
    Actor* a = receiver(from_rank, m);
    if (a == nullptr) return;
    a->worker()->deliver(m);
  }
}

void Core::on_payload(std::uint64_t cookie) {
  const auto index = static_cast<ActorIndex>(cookie >> 16);
  Actor* a = index < actors.size() ? actors[index].get() : nullptr;
  if (a == nullptr) {
    fail(fmt::format("the data plane finished a pull for actor #{}, which is not on this rank", index));
    return;
  }
  a->worker()->post(Message{a->id(), a->id(), 0, 0, static_cast<std::uint16_t>(cookie & 0xffff), MsgKind::pulled, 0});
}

void Core::on_link_error(const std::string& reason) { fail("data plane: " + reason); }

// A transfer to or from `peer` failed. A rank that may leave (a parameter-server worker) may
// have died: the control plane's word (rank_left) is waited for, a while, before this is a
// failure; meanwhile nothing more goes to it than already did.
bool Core::on_peer_error(std::uint32_t peer, const std::string& reason) {
  const auto& may = settings.may_leave;
  if (std::find(may.begin(), may.end(), peer) == may.end()) {
    fail("data plane: " + reason);
    return true;
  }
  if (departed(peer)) return false;
  std::lock_guard lock(mutex);
  for (const PeerError& e : peer_errors) {
    if (e.peer == peer) return false;
  }
  peer_errors.push_back({peer, std::chrono::steady_clock::now() + settings.departure_grace, reason});
  return false;
}

std::string Core::overdue_peer_error() {
  std::erase_if(peer_errors, [&](const PeerError& e) { return departed(e.peer); });
  const auto now = std::chrono::steady_clock::now();
  for (const PeerError& e : peer_errors) {
    if (now >= e.deadline) {
      return fmt::format("data plane: {} (and rank {}, which may leave the job, did not leave it within {} ms)",
                         e.reason, e.peer, settings.departure_grace.count());
    }
  }
  return {};
}

void Core::instantiate() {
  const auto rank = settings.rank;
  const bool one_thread = settings.mode == ExecutionMode::deterministic;
  std::map<std::pair<Device, std::uint8_t>, Worker*> by_place;
  actors.resize(plan.actors.size());
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    const ActorDesc& desc = plan.actors[i];
    // A dry run (validation) plays every rank at once: a deadlock may span ranks.
    if (!dry_run && desc.where.rank != rank) continue;
    auto key = one_thread ? std::pair<Device, std::uint8_t>{} : std::pair{desc.where.device, desc.where.stream};
    Worker*& w = by_place[key];
    if (w == nullptr) {
      workers.push_back(std::make_unique<Worker>(*this, key.first, key.second, settings.mailbox_capacity,
                                                 static_cast<std::uint16_t>(workers.size())));
      w = workers.back().get();
    }
    actors[i] = std::make_unique<Actor>(*this, desc, i,
                                        ActorId::make(desc.where.rank, desc.where.device, desc.where.stream, i));
    actors[i]->set_worker(w);
    ++local_actors;
  }
  for (auto& a : actors) {
    if (a) a->wire_outputs();
  }
  for (auto& a : actors) {
    if (!a) continue;
    try {
      a->wire_inputs();
    } catch (const std::exception& e) {
      throw PlanError(fmt::format("actor '{}': {}", a->name(), e.what()));
    }
  }
  for (ActorIndex i = 0; i < actors.size(); ++i) {
    if (!actors[i] || plan.actors[i].order.lane < 0) continue;
    const ActOrder& o = plan.actors[i].order;
    Lane& lane = lanes[o.lane];
    lane.id = o.lane;
    for (std::int32_t unit : o.lead) lane.prefix.push_back({unit, o.rank, i, actors[i].get()});
    for (std::int32_t unit : o.units) lane.period.push_back({unit, o.rank, i, actors[i].get()});
    actors[i]->set_lane(&lane);
  }
  for (auto& [id, lane] : lanes) lane.start();
  if (simulated) {
    dry_spent = true;  // one act per dispatch (see simulated)
  } else if (dry_run) {
    size_dry_run();
  }
}

void Core::size_dry_run() {
  // Every act that a deadlocking part of a plan can make before it stops is paid for by a
  // token: a free slot or a delayed (initial) piece.
  std::int64_t tokens = 0;
  std::int64_t max_group = 1;
  for (const auto& r : plan.registers) tokens += std::int64_t{r.slots} * static_cast<std::int64_t>(r.consumers.size());
  for (const auto& a : plan.actors) {
    for (const auto& in : a.inputs) tokens += in.delay;
    tokens += static_cast<std::int64_t>(a.order.lead.size());  // a lane's prefix: acts paid for once
    if (!a.at_end) max_group = std::max<std::int64_t>(max_group, a.group);
  }
  // Everything downstream of an at_end accumulate acts only after the run: not waited for
  // (its group, the whole run, would make the check as long as the run).
  std::vector<bool> after = after_end(plan);
  if (std::find(after.begin(), after.end(), true) != after.end()) {
    dry_after_end = std::move(after);
    for (ActorIndex i = 0; i < dry_after_end.size(); ++i) {
      if (dry_after_end[i] && i < actors.size() && actors[i]) ++dry_reached;  // nothing to prove
    }
  }
  // The handshakes make the plan a marked graph once each actor is unrolled into its acts of
  // one iteration (acts_per_iteration): act k of a consumer reading with delay d needs act
  // k - d of the producer (d tokens on that edge), act k of a producer needs the slot of
  // piece k - slots freed by each consumer's act k - slots + d (slots - d tokens on the edge
  // back, fewer than none where a delay outgrows the slots), a lane is a circuit through its
  // acts with one token, and no act, once ready, is made unready by another's (a persistent
  // system). The tokens on a circuit never change, and a plan whose every circuit has one
  // keeps going (Commoner et al., 1971). Where no edge is below zero, an act on a circuit
  // without tokens never happens: once every actor has made its acts of one iteration, the
  // plan keeps going. Edges below zero let an actor on such a circuit act a few times first,
  // at most the sum D of the delays' iterations (renumber each actor's acts by its shortest
  // distance from the edges below zero and the edges are all at least zero): so the target is
  // D + 2 iterations, one for margin. An actor that reached it stops at 2 D + 3 (reaching its
  // target may take its neighbours' acts up to D iterations past theirs), so that the acts of
  // the whole check are linear in the plan's size: early actors cannot run on while a piece
  // travels down a long chain.
  if (!dry_by_tokens) dry_targets = acts_per_iteration(plan);
  double want = 0;
  if (!dry_targets.empty()) {
    std::int64_t delays = 0;
    for (const auto& a : plan.actors) {
      for (const auto& in : a.inputs) delays += in.delay;
    }
    // A lane's prefix shifts its actors' acts against each other as a delay would: by the
    // longest lead of the lane, in its periods (rounded up), counted like the delays.
    std::map<std::int32_t, std::int64_t> lead_periods;
    for (const auto& a : plan.actors) {
      const ActOrder& o = a.order;
      if (o.lane < 0 || o.lead.empty() || o.units.empty()) continue;
      const auto u = static_cast<std::int64_t>(o.units.size());
      auto& most = lead_periods[o.lane];
      most = std::max(most, (static_cast<std::int64_t>(o.lead.size()) + u - 1) / u);
    }
    for (const auto& [lane, n] : lead_periods) delays += n;
    dry_limits.resize(dry_targets.size());
    for (std::size_t i = 0; i < dry_targets.size(); ++i) {
      dry_limits[i] = dry_targets[i] * (2 * delays + 3);
      dry_targets[i] *= delays + 2;
      want += static_cast<double>(dry_limits[i]);
    }
    want += 1;
  } else {
    // Rates that do not balance (or asked for): the long check. An actor that acts more often than there
    // are tokens is not stuck; micro-batch groups scale the count, and actors behind repeat /
    // accumulate act at other rates: the slowest gets room to reach the target too. Past the
    // cap the check turns lenient (see progress_check).
    dry_target = (tokens + 2) * max_group;
    double spread = 1;
    for (const auto& a : plan.actors) {
      if ((a.kind == ActorKind::repeat || a.kind == ActorKind::accumulate) && !a.at_end) {
        spread = std::min(spread * a.group, 1e9);
      }
    }
    want = static_cast<double>(dry_target) * static_cast<double>(local_actors) * 4 * spread;
  }
  dry_budget_capped = want > static_cast<double>(max_dry_budget);
  dry_budget = dry_budget_capped ? max_dry_budget : static_cast<std::int64_t>(want);
}

namespace {

/// Host memory that the ranks of this host may read (RuntimeSettings::shared_registers): from
/// shared segments, or, where the system gives none (no memfd), from the plain allocator, whose
/// slots then go through the data plane as before.
class SharedAllocator final : public Allocator {
 public:
  SharedAllocator(transport::SharedSegments& segments, CpuAllocator& fallback, Device d)
      : segments_(segments), fallback_(fallback), device_(d) {}
  void* allocate(std::size_t bytes) override {
    if (!failed_) {
      try {
        return segments_.allocate(bytes);
      } catch (const transport::TransportError&) {
        failed_ = true;  // the slots stay readable through the data plane
      }
    }
    return fallback_.allocate(bytes);
  }
  // Segments are freed with the runtime; only what came from the fallback goes back now.
  void deallocate(void* p, std::size_t bytes) noexcept override {
    if (!segments_.locate(p, 0)) fallback_.deallocate(p, bytes);
  }
  Device device() const override { return device_; }

 private:
  transport::SharedSegments& segments_;
  CpuAllocator& fallback_;
  Device device_;
  std::atomic<bool> failed_{false};
};

bool has_reader_on_other_rank(const Plan& plan, const RegisterDesc& reg) {
  if (reg.producer == no_actor) return false;
  const auto rank = plan.actors[reg.producer].where.rank;
  return std::any_of(reg.consumers.begin(), reg.consumers.end(),
                     [&](ActorIndex c) { return plan.actors[c].where.rank != rank; });
}

}  // namespace

// A register's slots, or its arena if it has one (any register placed there read on another
// rank puts the whole arena in shared memory).
bool Core::read_on_other_ranks(RegisterIndex reg) {
  if (!settings.shared_registers || settings.link == nullptr || settings.link->world_size() < 2) return false;
  const RegisterDesc& r = plan.registers[reg];
  if (r.arena < 0) return has_reader_on_other_rank(plan, r);
  if (arena_shared.size() < plan.arenas.size()) arena_shared.assign(plan.arenas.size(), -1);
  std::int8_t& known = arena_shared[static_cast<std::size_t>(r.arena)];
  if (known < 0) {
    known = std::any_of(plan.registers.begin(), plan.registers.end(), [&](const RegisterDesc& other) {
      return other.arena == r.arena && has_reader_on_other_rank(plan, other);
    });
  }
  return known == 1;
}

Allocator& Core::allocator_for(const ActorDesc& producer, RegisterIndex reg) {
  const Device d = producer.where.device;
  if (d.type == DeviceType::cuda && producer.copy != CopyDirection::to_host) {
    auto& alloc = device_allocators[d];
    if (!alloc) alloc = cuda::make_device_allocator(d);
    return *alloc;
  }
  // Registers that cross between host and a CUDA device are page-locked, so that their copies
  // run on the copy engines, asynchronously. (A sim device's memory is host memory.)
  const bool crosses = (producer.copy == CopyDirection::to_host && d.type == DeviceType::cuda) ||
                       copied_to_cuda(plan, reg);
  if (crosses) {
    if (!pinned) pinned = cuda::make_pinned_allocator(Device{});
    return *pinned;
  }
  if (d.type == DeviceType::cpu && read_on_other_ranks(reg)) {
    if (!shared_allocator) {
      shared_segments = std::make_unique<transport::SharedSegments>(fmt::format("rank {}", settings.rank));
      shared_allocator = std::make_unique<SharedAllocator>(*shared_segments, allocator_for_host(d), d);
    }
    return *shared_allocator;
  }
  return allocator_for_host(d);
}

CpuAllocator& Core::allocator_for_host(Device d) {
  auto& alloc = allocators[d];
  if (!alloc) alloc = std::make_unique<CpuAllocator>(d);
  return *alloc;
}

namespace {

/// A slot placed in an arena: hands out its block; the arena frees it.
class ArenaBlock final : public Allocator {
 public:
  ArenaBlock(void* data, std::size_t bytes, Device device) : data_(data), bytes_(bytes), device_(device) {}
  void* allocate(std::size_t bytes) override {
    if (bytes > bytes_) throw std::bad_alloc();
    return data_;
  }
  void deallocate(void*, std::size_t) noexcept override {}
  Device device() const override { return device_; }

 private:
  void* data_;
  std::size_t bytes_;
  Device device_;
};

}  // namespace

/// One arena's memory, from its device's allocator.
struct Core::Arena {
  Allocator* from = nullptr;
  void* data = nullptr;
  std::size_t bytes = 0;
  Arena(Allocator& a, std::size_t n) : from(&a), data(a.allocate(n)), bytes(n) {}
  ~Arena() { from->deallocate(data, bytes); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
};

Tensor Core::register_slot(const ActorDesc& producer, RegisterIndex r, std::size_t slot) {
  const RegisterDesc& reg = plan.registers[r];
  if (reg.arena < 0) return Tensor::empty(reg.shape, reg.dtype, allocator_for(producer, r));
  // validate() checked the arena, its device and the offsets.
  const auto a = static_cast<std::size_t>(reg.arena);
  if (arenas.size() < plan.arenas.size()) arenas.resize(plan.arenas.size());
  if (!arenas[a]) {
    const ArenaDesc& desc = plan.arenas[a];
    arenas[a] = std::make_unique<Arena>(allocator_for(producer, r), static_cast<std::size_t>(std::max<std::int64_t>(desc.bytes, 1)));
  }
  auto* at = static_cast<std::byte*>(arenas[a]->data) + reg.offsets[slot];
  arena_slots.push_back(std::make_unique<ArenaBlock>(at, static_cast<std::size_t>(slot_bytes(reg)), producer.where.device));
  return Tensor::empty(reg.shape, reg.dtype, *arena_slots.back());
}

AsyncStream& Core::stream_for(const Placement& where) {
  auto& s = streams[{where.device, where.stream}];
  if (!s) {
    const std::string owner = fmt::format("worker {}/s{}", where.device.str(), where.stream);
    if (where.device.type == DeviceType::sim) {
      s = sim::Stream::create(where.device, owner, sim::StreamSettings{settings.sim_spin_polls});
    } else {
      s = cuda::Stream::create(where.device, owner);
    }
  }
  return *s;
}

std::string Core::describe_stream_failure(const std::pair<Device, std::uint8_t>& where, const std::string& why) const {
  // Which of the stream's kernels failed is not known (the work was asynchronous, and an actor
  // whose handshakes follow stream order may have retired with its work still queued): name
  // every actor that had work on it.
  std::string on_it;
  for (std::size_t i = 0; i < actors.size(); ++i) {
    const auto& a = actors[i];
    const Placement& at = plan.actors[i].where;
    if (a && at.device == where.first && at.stream == where.second) {
      on_it += fmt::format(" '{}' ({} acts enqueued{})", a->name(), a->acts(), a->retired() ? ", retired" : "");
    }
  }
  return fmt::format("{}; actors on that stream:{}", why, on_it.empty() ? " none" : on_it);
}

std::string Core::drain_streams(std::chrono::milliseconds limit) {
  // Actors on streams retire once their last act is enqueued: the job is over when the streams
  // have run it all. Polled, with the stall timeout as the deadline, so that a device that
  // never finishes fails the job instead of hanging it.
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    bool all_idle = true;
    for (const auto& [where, stream] : streams) {
      if (std::string why = stream->failure(); !why.empty()) return describe_stream_failure(where, why);
      all_idle = all_idle && stream->idle();
    }
    if (all_idle) return {};
    if (limit.count() > 0 && std::chrono::steady_clock::now() > deadline) {
      std::string busy;
      for (const auto& [where, stream] : streams) {
        if (!stream->idle()) busy += " " + stream->owner();
      }
      return fmt::format("the job's last acts were enqueued but their streams did not finish within {} ms:{}",
                         limit.count(), busy);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void Core::fail(std::string reason) {
  {
    std::lock_guard lock(mutex);
    if (failed_.load(std::memory_order_relaxed)) return;
    error = std::move(reason);
    failed_.store(true, std::memory_order_release);
  }
  for (auto& w : workers) w->close();
  cv.notify_all();
}

void Core::rank_left(std::uint32_t rank, const std::string& reason) {
  if (rank >= departed_ranks || rank == settings.rank) return;  // no actor of ours talks to it
  if (departed_flags[rank].exchange(true, std::memory_order_acq_rel)) return;
  {
    std::lock_guard lock(mutex);
    departures.push_back(fmt::format("rank {}: {}", rank, reason));
  }
  // Each actor lets go of it on its own thread, in order with its other messages.
  for (auto& a : actors) {
    if (a && a->worker() != nullptr) {
      a->worker()->post(Message{a->id(), a->id(), static_cast<std::int64_t>(rank), 0, 0, MsgKind::rank_left, 0});
    }
  }
}

std::int64_t Core::post_to_peers_of(std::uint32_t rank, Message m) {
  std::int64_t n = 0;
  for (auto& a : actors) {
    if (!a || a->worker() == nullptr || !a->talks_to(rank)) continue;
    m.src = m.dst = a->id();
    a->worker()->post(m);
    ++n;
  }
  return n;
}

void Core::answer_rejoin(std::int64_t step) {
  {
    std::lock_guard lock(mutex);
    ++rejoin_answers;
    rejoin_step = std::max(rejoin_step, step);
  }
  cv.notify_all();
}

bool Core::wait_for_answers(std::int64_t expected, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex);
  return cv.wait_for(lock, timeout, [&] { return rejoin_answers >= expected || failed() || done; }) &&
         rejoin_answers >= expected;
}

std::int64_t Core::hold_for_rejoin(std::uint32_t rank, std::chrono::milliseconds timeout) {
  if (rank >= departed_ranks || !departed(rank)) {
    throw JobError(fmt::format("rank {} cannot come back to rank {}: it has not left", rank, settings.rank));
  }
  const bool talks = std::any_of(actors.begin(), actors.end(), [&](const auto& a) { return a && a->talks_to(rank); });
  if (!talks) return 0;
  {
    std::lock_guard lock(mutex);
    if (done || failed()) throw JobError(fmt::format("rank {} cannot come back: rank {}'s run has ended", rank, settings.rank));
    rejoin_answers = 0;
    rejoin_step = 0;
  }
  const std::int64_t asked = post_to_peers_of(rank, Message{{}, {}, static_cast<std::int64_t>(rank), 0, 0,
                                                            MsgKind::hold_for_rejoin, 0});
  if (!wait_for_answers(asked, timeout)) {
    throw JobError(fmt::format("rank {}'s actors did not stop for rank {} to come back within {} ms{}", settings.rank,
                               rank, timeout.count(), failed() ? " (the run failed)" : ""));
  }
  std::lock_guard lock(mutex);
  return rejoin_step;
}

void Core::rank_rejoined(std::uint32_t rank, std::int64_t step, std::chrono::milliseconds timeout) {
  if (rank >= departed_ranks) return;  // no actor of ours talks to it
  {
    std::lock_guard lock(mutex);
    if (failed()) throw JobError(fmt::format("rank {} cannot come back: rank {}'s run failed", rank, settings.rank));
    rejoin_answers = 0;
    rejoins.push_back(fmt::format("rank {} from step {}", rank, step + 1));  // steps counted from 1
  }
  // Before the actors take it back: what they send it goes out from then on.
  departed_flags[rank].store(false, std::memory_order_release);
  const std::int64_t asked = post_to_peers_of(rank, Message{{}, {}, step, rank, 0, MsgKind::rank_rejoined, 0});
  if (!wait_for_answers(asked, timeout)) {
    throw JobError(fmt::format("rank {}'s actors did not take rank {} back within {} ms{}", settings.rank, rank,
                               timeout.count(), failed() ? " (the run failed)" : ""));
  }
}

void Core::on_retired() {
  if (retired.fetch_add(1, std::memory_order_acq_rel) + 1 == local_actors) {
    {
      std::lock_guard lock(mutex);
      done = true;
    }
    if (settings.mode == ExecutionMode::threaded) {
      for (auto& w : workers) w->close();
    }
    cv.notify_all();
  }
}

void Core::count_dry_act(ActorIndex actor, std::int64_t acts_so_far) {
  if (simulated) {
    const double start = sim_now;
    sim_now += (*sim_seconds)[actor];
    sim_acted = actor;
    if (sim_acts != nullptr) sim_acts->push_back(SimulatedAct{actor, acts_so_far - 1, start, sim_now});
    return;
  }
  if (acts_so_far == dry_target_of(actor)) count_dry_reached();
  if (++dry_acts >= dry_budget) dry_spent = true;
}

void Core::count_dry_reached() {
  if (++dry_reached == local_actors) dry_spent = true;
}

std::string Core::describe_stuck() const {
  std::string out;
  int listed = 0;
  for (const auto& a : actors) {
    if (!a || a->retired()) continue;
    if (listed++ == 12) {
      out += "\n  ...";
      break;
    }
    out += fmt::format("\n  '{}' after {} acts: {}", a->name(), a->acts(), a->describe_wait());
  }
  return out;
}

void Core::record(const Message& m) {
  auto actor_name = [&](ActorId id) {
    return id.index() < plan.actors.size() ? plan.actors[id.index()].name : id.str();
  };
  log.push_back(HandshakeEvent{m.kind, actor_name(m.src), actor_name(m.dst),
                               m.reg < plan.registers.size() ? plan.registers[m.reg].name : "?",
                               m.slot, m.piece});
}

MetricsSnapshot Core::snapshot() const {
  MetricsSnapshot s;
  const double tick_ns = ns_per_tick();
  const std::uint64_t now = ticks();
  const std::uint64_t started = start_ticks.load(std::memory_order_relaxed);
  s.elapsed_s = started == 0 ? 0.0 : static_cast<double>(now - started) * tick_ns * 1e-9;
  for (const auto& a : actors) {
    if (!a) continue;
    const ActorCounters& c = a->counters();
    ActorMetrics m;
    m.name = a->name();
    m.kind = a->desc().kind;
    m.where = a->desc().where;
    m.acts = c.acts.load(std::memory_order_relaxed);
    m.bytes_in = c.bytes_in.load(std::memory_order_relaxed);
    m.bytes_out = c.bytes_out.load(std::memory_order_relaxed);
    m.activity = c.activity.load(std::memory_order_relaxed);
    std::array<double, 4> secs{};
    for (std::size_t b = 0; b < secs.size(); ++b) {
      secs[b] = static_cast<double>(c.ticks[b].load(std::memory_order_relaxed));
    }
    // The interval the actor is in now has not been booked yet (sampled: since the last look).
    auto since = sampled_time.load(std::memory_order_relaxed) ? sampled_until.load(std::memory_order_relaxed) : c.since.load(std::memory_order_relaxed);
    if (settings.time_accounting && started != 0 && m.activity != ActorActivity::retired &&
        since != 0 && now > since) {
      secs[static_cast<std::size_t>(m.activity)] += static_cast<double>(now - since);
    }
    m.busy_s = secs[0] * tick_ns * 1e-9;
    m.starved_s = secs[1] * tick_ns * 1e-9;
    m.backpressured_s = secs[2] * tick_ns * 1e-9;
    m.transferring_s = secs[3] * tick_ns * 1e-9;
    m.kernel_s = static_cast<double>(c.kernel_ticks.load(std::memory_order_relaxed)) * tick_ns * 1e-9;
    m.device_s = static_cast<double>(c.device_ns.load(std::memory_order_relaxed)) * 1e-9;
    s.actors.push_back(std::move(m));
  }
  for (const auto& a : actors) {
    if (!a) continue;
    for (RegisterIndex r : a->desc().outputs) {
      const Output* out = a->output_for(r);
      RegisterMetrics rm;
      rm.name = plan.registers[r].name;
      rm.slots = out->slots;
      rm.written = out->written_seen.load(std::memory_order_relaxed);
      rm.freed = out->freed_seen.load(std::memory_order_relaxed);
      rm.max_outstanding = out->max_outstanding_seen.load(std::memory_order_relaxed);
      s.registers.push_back(std::move(rm));
    }
  }
  return s;
}

}  // namespace detail

// -----------------------------------------------------------------------------------------------
// Validation

namespace {

/// What the checks below found wrong, one line each.
struct Problems {
  std::vector<std::string>& lines;
  template <class... A>
  void operator()(fmt::format_string<A...> f, A&&... args) {
    lines.push_back(fmt::format(f, std::forward<A>(args)...));
  }
};

/// Actor i's inputs: registers that exist, delays, a producer on its rank (or a transfer
/// across), and i among each register's consumers.
void check_inputs(const Plan& plan, ActorIndex i, Problems& problem, bool transferred) {
  const ActorDesc& a = plan.actors[i];
  const auto n_actors = plan.actors.size();
  std::map<RegisterIndex, std::int32_t> delays;
  for (const InputPort& in : a.inputs) {
    if (in.reg >= plan.registers.size()) {
      problem("actor '{}' reads register #{}, which does not exist", a.name, in.reg);
      continue;
    }
    const RegisterDesc& reg = plan.registers[in.reg];
    if (in.delay < 0) problem("actor '{}' reads '{}' with a negative delay {}", a.name, reg.name, in.delay);
    auto [it, fresh] = delays.emplace(in.reg, in.delay);
    if (!fresh && it->second != in.delay) {
      problem("actor '{}' reads '{}' twice with different delays ({} and {})", a.name, reg.name, it->second, in.delay);
    }
    if (reg.producer == no_actor || reg.producer >= n_actors) {
      problem("actor '{}' reads register '{}', which no actor produces", a.name, reg.name);
    } else if (transferred && plan.actors[reg.producer].where.rank != a.where.rank && a.kind != ActorKind::transfer) {
      problem("register '{}' crosses from rank {} ('{}') to rank {} ('{}') without a transfer actor "
              "(run the plan through insert_transfers())",
              reg.name, plan.actors[reg.producer].where.rank, plan.actors[reg.producer].name, a.where.rank, a.name);
    } else if (plan.actors[reg.producer].where.rank == a.where.rank && a.kind == ActorKind::transfer) {
      // A transfer that gathers several inputs copies those of its own rank (host memory only);
      // one input must come from another rank.
      const Device on = plan.actors[reg.producer].where.device;
      if (a.inputs.size() == 1) {
        problem("transfer actor '{}' reads '{}' from its own rank {}; a transfer crosses ranks", a.name, reg.name,
                a.where.rank);
      } else if (is_async(on.type) || is_async(a.where.device.type)) {
        problem("transfer actor '{}' gathers '{}' from {} of its own rank {} onto {}; it copies host memory only",
                a.name, reg.name, on.str(), a.where.rank, a.where.device.str());
      }
    }
    if (std::find(reg.consumers.begin(), reg.consumers.end(), i) == reg.consumers.end()) {
      problem("actor '{}' reads register '{}' but is not among its consumers", a.name, reg.name);
    }
  }
}

/// A shape's elements, or -1 where it has none that count (reported with the register,
/// check_registers).
std::int64_t elements_of(const Shape& shape) {
  try {
    return numel(shape);
  } catch (const std::exception&) {
    return -1;
  }
}

/// A transfer with several inputs gathers them into its one output, in port order: each read
/// once, without delay, in the output's dtype, their elements adding up to the output's; at
/// least one from another rank (check_inputs: the rest in host memory of its own), no window.
/// A reducing transfer (reduces()): a remote piece (or its window) plus a window of a local one.
void check_reducing_transfer(const Plan& plan, const ActorDesc& a, Problems& problem) {
  if (a.inputs.size() != 2 || a.outputs.size() != 1) {
    problem("transfer actor '{}' adds {} inputs into {} outputs; a reducing transfer (transfer.add) adds a piece "
            "from another rank to one of its own: two inputs, one output",
            a.name, a.inputs.size(), a.outputs.size());
    return;
  }
  if (a.group != 1) problem("transfer actor '{}' has group {}; a transfer moves one piece per piece", a.name, a.group);
  if (a.where.device.type != DeviceType::cpu) {
    problem("transfer actor '{}' adds on {}; a reducing transfer adds on the CPU", a.name, a.where.device.str());
  }
  const auto bad = [&](RegisterIndex r) { return r >= plan.registers.size() || plan.registers[r].producer >= plan.actors.size(); };
  if (bad(a.inputs[0].reg) || bad(a.inputs[1].reg) || a.outputs[0] >= plan.registers.size()) return;  // reported
  const RegisterDesc& piece = plan.registers[a.inputs[0].reg];
  const RegisterDesc& own = plan.registers[a.inputs[1].reg];
  const RegisterDesc& out = plan.registers[a.outputs[0]];
  if (plan.actors[piece.producer].where.rank == a.where.rank || plan.actors[own.producer].where.rank != a.where.rank) {
    problem("transfer actor '{}' adds '{}' (rank {}) to '{}' (rank {}) on rank {}; the first comes from another rank, "
            "the second from its own",
            a.name, piece.name, plan.actors[piece.producer].where.rank, own.name,
            plan.actors[own.producer].where.rank, a.where.rank);
  }
  for (const InputPort& port : a.inputs) {
    if (port.delay != 0) problem("transfer actor '{}' cannot read '{}' with a delay", a.name, plan.registers[port.reg].name);
  }
  if (piece.dtype != out.dtype || own.dtype != out.dtype || (out.dtype != DType::f32 && out.dtype != DType::f64)) {
    problem("transfer actor '{}' adds '{}' ({}) and '{}' ({}) into '{}' ({}); a reducing transfer adds f32 or f64, "
            "one dtype",
            a.name, piece.name, name(piece.dtype), own.name, name(own.dtype), out.name, name(out.dtype));
  }
  const std::int64_t n = elements_of(out.shape);
  const std::int64_t offset = a.attrs.get_int("offset", 0);
  if (n < 0) return;
  if (a.window < 0 && elements_of(piece.shape) != n) {
    problem("transfer actor '{}' adds '{}' ({} elements) into '{}' ({} elements); without a window they are the same "
            "size",
            a.name, piece.name, elements_of(piece.shape), out.name, n);
  }
  if (a.window >= 0 && a.window + n > elements_of(piece.shape)) {
    problem("transfer actor '{}' adds elements [{}, {}) of '{}', which has {}", a.name, a.window, a.window + n,
            piece.name, elements_of(piece.shape));
  }
  if (offset < 0 || offset + n > elements_of(own.shape)) {
    problem("transfer actor '{}' adds elements [{}, {}) of '{}', which has {}", a.name, offset, offset + n, own.name,
            elements_of(own.shape));
  }
}

void check_gather(const Plan& plan, const ActorDesc& a, Problems& problem) {
  if (a.outputs.size() != 1) {
    problem("transfer actor '{}' gathers {} inputs into {} outputs; it needs exactly one", a.name, a.inputs.size(),
            a.outputs.size());
    return;
  }
  if (a.inputs.size() > max_transfer_inputs) {
    problem("transfer actor '{}' gathers {} inputs; at most {}", a.name, a.inputs.size(), max_transfer_inputs);
  }
  if (a.window >= 0) problem("transfer actor '{}' gathers {} inputs and has window {}; a window is of one input",
                             a.name, a.inputs.size(), a.window);
  if (a.group != 1) problem("transfer actor '{}' has group {}; a transfer moves one piece per piece", a.name, a.group);
  if (a.outputs[0] >= plan.registers.size()) return;  // reported with the outputs
  const RegisterDesc& out = plan.registers[a.outputs[0]];
  std::int64_t elements = 0;
  bool remote = false;
  std::set<RegisterIndex> seen;
  for (const InputPort& port : a.inputs) {
    if (port.reg >= plan.registers.size()) return;  // check_inputs reported it
    const RegisterDesc& in = plan.registers[port.reg];
    if (!seen.insert(port.reg).second) problem("transfer actor '{}' gathers '{}' twice", a.name, in.name);
    if (port.delay != 0) problem("transfer actor '{}' cannot read '{}' with a delay", a.name, in.name);
    if (in.dtype != out.dtype) {
      problem("transfer actor '{}' gathers '{}' ({}) into '{}' ({}); a transfer keeps the dtype", a.name, in.name,
              name(in.dtype), out.name, name(out.dtype));
    }
    const std::int64_t n = elements_of(in.shape);
    elements = n < 0 || elements < 0 ? -1 : elements + n;
    if (in.producer < plan.actors.size() && plan.actors[in.producer].where.rank != a.where.rank) remote = true;
  }
  const std::int64_t filled = elements_of(out.shape);
  if (elements >= 0 && filled >= 0 && elements != filled) {
    problem("transfer actor '{}' gathers {} elements from {} inputs into '{}' ({}{}, {} elements); they must fill it",
            a.name, elements, a.inputs.size(), out.name, name(out.dtype), to_string(out.shape), filled);
  }
  if (!remote) {
    problem("transfer actor '{}' gathers {} inputs, all from its own rank {}; a transfer crosses ranks", a.name,
            a.inputs.size(), a.where.rank);
  }
}

/// What an actor of its kind must have: a source no inputs, a repeat, accumulate or transfer
/// one input and one output of the same shape and dtype (a view the same bytes), no delay.
void check_kind(const Plan& plan, const ActorDesc& a, Problems& problem) {
  if (!a.in_place.empty() && a.kind != ActorKind::compute) {
    problem("{} actor '{}' lists outputs in place of inputs; only a compute actor's kernel may", name(a.kind), a.name);
  }
  for (const InPlace& p : a.in_place) {
    if (p.output >= a.outputs.size() || p.input >= a.inputs.size()) {
      problem("actor '{}' computes output {} in place of input {}, but has {} outputs and {} inputs", a.name, p.output,
              p.input, a.outputs.size(), a.inputs.size());
    } else if (a.outputs[p.output] < plan.registers.size() && a.inputs[p.input].reg < plan.registers.size()) {
      const RegisterDesc& out = plan.registers[a.outputs[p.output]];
      const RegisterDesc& in = plan.registers[a.inputs[p.input].reg];
      if (out.dtype != in.dtype || out.shape != in.shape || a.inputs[p.input].delay != 0) {
        problem("actor '{}' computes '{}' ({}{}) in place of '{}' ({}{}{}); in place needs the same shape and dtype, "
                "read without delay",
                a.name, out.name, name(out.dtype), to_string(out.shape), in.name, name(in.dtype), to_string(in.shape),
                a.inputs[p.input].delay != 0 ? fmt::format(", delay {}", a.inputs[p.input].delay) : "");
      }
    }
  }
  if (!a.steps.empty()) {
    const ActSteps& st = a.steps;
    const auto bad = [](const std::vector<std::int32_t>& v) {
      return std::any_of(v.begin(), v.end(), [](std::int32_t s) { return s < 0 || s > 65535; });
    };
    if (a.kind != ActorKind::compute) {
      problem("{} actor '{}' lists steps of its act; only a compute actor's kernel runs several", name(a.kind), a.name);
    } else if (st.input_read.size() != a.inputs.size() || st.output_written.size() != a.outputs.size() ||
               st.output_read.size() != a.outputs.size()) {
      problem("actor '{}' lists steps for {} inputs and {}/{} outputs, but has {} inputs and {} outputs", a.name,
              st.input_read.size(), st.output_written.size(), st.output_read.size(), a.inputs.size(), a.outputs.size());
    } else if (bad(st.input_read) || bad(st.output_written) || bad(st.output_read)) {
      problem("actor '{}' lists a step outside 0..65535", a.name);
    } else {
      for (std::size_t o = 0; o < a.outputs.size(); ++o) {
        if (st.output_read[o] < st.output_written[o]) {
          problem("actor '{}' reads output {} at step {} of its act, before step {} writes it", a.name, o,
                  st.output_read[o], st.output_written[o]);
        }
      }
    }
  }
  if (a.window < -1 || (a.window >= 0 && a.kind != ActorKind::transfer)) {
    problem("{} actor '{}' has window {}; only a transfer moves a window (>= 0), -1 is the whole slot", name(a.kind),
            a.name, a.window);
  }
  switch (a.kind) {
    case ActorKind::source:
      if (!a.inputs.empty()) problem("source '{}' has inputs; a source has none", a.name);
      if (a.outputs.empty()) problem("source '{}' has no outputs", a.name);
      if (a.pieces < 0) problem("source '{}' has a negative piece count {}", a.name, a.pieces);
      break;
    case ActorKind::compute:
      if (a.inputs.empty()) problem("compute actor '{}' has no inputs (make it a source)", a.name);
      break;
    case ActorKind::transfer:
      if (reduces(a)) {
        check_reducing_transfer(plan, a, problem);
        break;
      }
      if (a.inputs.size() > 1) {
        check_gather(plan, a, problem);
        break;
      }
      [[fallthrough]];
    case ActorKind::repeat:
    case ActorKind::accumulate:
      if (a.inputs.size() != 1 || a.outputs.size() != 1) {
        problem("{} actor '{}' needs exactly one input and one output, has {} and {}", name(a.kind), a.name,
                a.inputs.size(), a.outputs.size());
      } else if (a.inputs[0].reg < plan.registers.size() && a.outputs[0] < plan.registers.size()) {
        const auto& in = plan.registers[a.inputs[0].reg];
        const auto& out = plan.registers[a.outputs[0]];
        // A view (a repeat of group 1) may see the input's elements as another shape.
        const bool view = a.kind == ActorKind::repeat && a.group == 1;
        const bool same_bytes = in.dtype == out.dtype && elements_of(in.shape) == elements_of(out.shape);
        if (a.window >= 0) {
          // A window of the input: the same dtype, inside its elements (a transfer only, below).
          if (in.dtype != out.dtype || a.window + elements_of(out.shape) > elements_of(in.shape) ||
              elements_of(out.shape) < 0) {
            problem("{} actor '{}' moves elements [{}, {}) of '{}' ({}{}) into '{}' ({}{}); a window keeps the dtype "
                    "and lies inside the register",
                    name(a.kind), a.name, a.window, a.window + std::max<std::int64_t>(elements_of(out.shape), 0), in.name,
                    name(in.dtype), to_string(in.shape), out.name, name(out.dtype), to_string(out.shape));
          }
        } else if (view ? !same_bytes : (in.shape != out.shape || in.dtype != out.dtype)) {
          problem("{} actor '{}' reads {}{} but writes {}{}", name(a.kind), a.name, name(in.dtype), to_string(in.shape),
                  name(out.dtype), to_string(out.shape));
        }
        if (a.inputs[0].delay != 0) problem("{} actor '{}' cannot read with a delay", name(a.kind), a.name);
      }
      if (a.group < 1) problem("{} actor '{}' has group {}; it must be >= 1", name(a.kind), a.name, a.group);
      if (a.kind == ActorKind::transfer && a.group != 1) {
        problem("transfer actor '{}' has group {}; a transfer moves one piece per piece", a.name, a.group);
      }
      break;
  }
}

/// Actor i's lane (ActOrder), if it has one: units in [0, period), strictly increasing, its
/// lead's units >= 0 and strictly increasing, and one worker and one period per lane
/// (lane_place: each lane's first actor).
void check_lane(const Plan& plan, ActorIndex i, std::map<std::int32_t, ActorIndex>& lane_place, Problems& problem) {
  const ActorDesc& a = plan.actors[i];
  if (a.order.lane < 0) {
    if (!a.order.lead.empty()) problem("actor '{}' has a lead of {} acts but no lane", a.name, a.order.lead.size());
    return;
  }
  const ActOrder& o = a.order;
  // (A transfer in a lane starts its pull at its turn and passes the turn on; the pull lands
  // later, and its readers wait for it as for any input.)
  if (o.units.empty() || o.period < 1) {
    problem("actor '{}' is in lane {} with {} units and period {}; it needs at least one unit and a period >= 1", a.name,
            o.lane, o.units.size(), o.period);
  }
  for (std::size_t u = 0; u < o.units.size(); ++u) {
    if (o.units[u] < 0 || o.units[u] >= o.period || (u > 0 && o.units[u] <= o.units[u - 1])) {
      problem("actor '{}' in lane {}: units must increase strictly and stay in [0, {}); unit {} is {}", a.name, o.lane,
              o.period, u, o.units[u]);
      break;
    }
  }
  for (std::size_t u = 0; u < o.lead.size(); ++u) {
    if (o.lead[u] < 0 || (u > 0 && o.lead[u] <= o.lead[u - 1])) {
      problem("actor '{}' in lane {}: lead units must increase strictly from 0 up; lead unit {} is {}", a.name,
              o.lane, u, o.lead[u]);
      break;
    }
  }
  auto [it, fresh] = lane_place.emplace(o.lane, i);
  const ActorDesc& first = plan.actors[it->second];
  if (!fresh && !(first.where == a.where)) {
    problem("lane {} has actors on two workers: '{}' at r{}/{}/s{} and '{}' at r{}/{}/s{}", o.lane, first.name,
            first.where.rank, first.where.device.str(), first.where.stream, a.name, a.where.rank, a.where.device.str(),
            a.where.stream);
  }
  if (!fresh && first.order.period != o.period) {
    problem("lane {} has actors with different periods: '{}' {} and '{}' {}", o.lane, first.name, first.order.period,
            a.name, o.period);
  }
}

/// The kernels an actor of this rank will make.
void check_kernels(const KernelRegistry& kernels, const ActorDesc& a, Problems& problem) {
  auto need = [&](std::string_view op) {
    if (!kernels.contains(op, a.where.device.type, a.dtype)) {
      problem("actor '{}' needs kernel '{}' for {}/{}, which is not registered", a.name, op, name(a.where.device.type),
              name(a.dtype));
    }
  };
  if (a.kind == ActorKind::source || a.kind == ActorKind::compute) need(a.op);
  if (a.kind == ActorKind::accumulate) {
    need("copy");
    need("add");
  }
}

/// Each register: slots and consumers within the runtime's bounds, its producer the actor that
/// writes it (producer_seen), its consumers the actors that read it, a valid shape.
void check_registers(const Plan& plan, const std::vector<ActorIndex>& producer_seen, Problems& problem) {
  for (std::size_t r = 0; r < plan.registers.size(); ++r) {
    const RegisterDesc& reg = plan.registers[r];
    if (reg.slots < 1) {
      problem("register '{}' has {} slots; a register needs at least 1", reg.name, reg.slots);
    } else if (reg.slots > 65535) {
      problem("register '{}' has {} slots; at most 65535", reg.name, reg.slots);
    }
    if (reg.consumers.size() > 255) problem("register '{}' has {} consumers; at most 255", reg.name, reg.consumers.size());
    if (reg.kernel_memory) {
      const bool computed = producer_seen[r] != no_actor && plan.actors[producer_seen[r]].kind == ActorKind::compute;
      if (reg.slots != 1 || reg.arena >= 0 || !computed) {
        problem("register '{}' is its producer's kernel's memory, which needs one slot ({}), no arena{} and a compute "
                "actor writing it",
                reg.name, reg.slots, reg.arena >= 0 ? fmt::format(" (it is in arena {})", reg.arena) : "");
      }
    }
    if (reg.producer != producer_seen[r]) {
      if (producer_seen[r] == no_actor) {
        if (!reg.consumers.empty() && reg.producer != no_actor) {
          problem("register '{}' names producer #{}, which does not write it", reg.name, reg.producer);
        }
      } else {
        problem("register '{}' names producer #{} but is written by '{}'", reg.name, reg.producer,
                plan.actors[producer_seen[r]].name);
      }
    }
    for (ActorIndex c : reg.consumers) {
      const bool reads = c < plan.actors.size() &&
                         std::any_of(plan.actors[c].inputs.begin(), plan.actors[c].inputs.end(),
                                     [&](const InputPort& in) { return in.reg == r; });
      if (!reads) problem("register '{}' lists consumer #{}, which does not read it", reg.name, c);
    }
    try {
      (void)numel(reg.shape);
    } catch (const std::exception& e) {
      problem("register '{}': {}", reg.name, e.what());
    }
  }
}

/// The plan's structure, as this rank will run it: every problem found, one line each.
void static_checks(const Plan& plan, const KernelRegistry& kernels, std::uint16_t rank,
                   std::vector<std::string>& problems, bool transferred = true) {
  Problems problem{problems};
  std::set<std::string> names;
  for (std::size_t i = 0; i < plan.actors.size(); ++i) {
    const ActorDesc& a = plan.actors[i];
    if (a.name.empty()) problem("actor #{} has no name", i);
    if (!names.insert(a.name).second) problem("two actors are named '{}'", a.name);
  }
  std::vector<ActorIndex> producer_seen(plan.registers.size(), no_actor);
  std::map<std::int32_t, ActorIndex> lane_place;  // lane -> its first actor
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    const ActorDesc& a = plan.actors[i];
    for (RegisterIndex r : a.outputs) {
      if (r >= plan.registers.size()) {
        problem("actor '{}' writes register #{}, which does not exist", a.name, r);
        continue;
      }
      if (producer_seen[r] != no_actor) {
        problem("register '{}' is written by both '{}' and '{}'", plan.registers[r].name,
                plan.actors[producer_seen[r]].name, a.name);
      }
      producer_seen[r] = i;
    }
    check_inputs(plan, i, problem, transferred);
    check_kind(plan, a, problem);
    check_lane(plan, i, lane_place, problem);
    if (a.where.device.index > Device::max_index) {
      problem("actor '{}' is placed on {} (device index above {})", a.name, a.where.device.str(), Device::max_index);
    }
    if (a.where.rank == rank) check_kernels(kernels, a, problem);
  }
  // Payload tags carry a transfer's index in 20 bits (payload_tag).
  const bool crosses_ranks = std::any_of(plan.actors.begin(), plan.actors.end(),
                                         [](const ActorDesc& a) { return a.kind == ActorKind::transfer; });
  if (crosses_ranks && plan.actors.size() >= detail::max_actors_across_ranks) {
    problem("the plan has {} actors; a plan that spans ranks may have at most {}", plan.actors.size(),
            detail::max_actors_across_ranks - 1);
  }
  check_registers(plan, producer_seen, problem);
}

// The handshakes of the whole plan, run without kernels or memory on one thread with
// unbounded sources. A plan whose every cycle has enough delay and slots keeps going until
// the budget is spent; one that deadlocks stops early with the actors named.
void progress_check(const Plan& plan, std::uint16_t rank, ProgressCheck how, std::vector<std::string>& problems) {
  RuntimeSettings s;
  s.mode = ExecutionMode::deterministic;
  s.rank = rank;
  s.time_accounting = false;
  detail::Core core(plan, nullptr, s, /*dry_run=*/true);
  core.dry_by_tokens = how == ProgressCheck::tokens;
  core.instantiate();
  if (core.workers.empty()) return;
  for (auto& a : core.actors) {
    if (a) core.workers[0]->enqueue_local(Message{a->id(), a->id(), 0, 0, 0, MsgKind::start, 0});
  }
  core.workers[0]->drain();
  // Every actor reached the target: the plan keeps going. The queue ran dry first: nothing
  // can ever move again: in the short check those short of their target are stuck (the others
  // stopped at their limits), in the long one whoever is blocked; each says on what. The budget
  // ran out first: those short of the target are stuck (while a healthy part of the plan went
  // on), unless the budget was capped, when only an actor that never acted is surely stuck: the
  // short check of a large plan (its actors times D + 2 iterations over the cap: a Llama of 8
  // layers at tp 8 with 16 micro-batches) stops in the middle of a healthy run, and calling that
  // a deadlock refused plans that train.
  const bool all_reached = core.dry_reached == core.local_actors;
  const bool quiesced = !core.dry_spent;
  const bool short_check = !core.dry_targets.empty();
  std::string stuck;
  for (auto& a : core.actors) {
    if (!a || a->retired() || all_reached) continue;
    if (!core.dry_after_end.empty() && core.dry_after_end[a->plan_index()]) continue;  // acts after the run
    const bool short_of_target = static_cast<std::int64_t>(a->acts()) < core.dry_target_of(a->plan_index());
    const bool blocked = quiesced                 ? (short_check ? short_of_target : !a->ready())
                         : core.dry_budget_capped ? a->acts() == 0
                                                  : short_of_target;
    if (blocked) stuck += fmt::format("\n  '{}' after {} acts: {}", a->name(), a->acts(), a->describe_wait());
  }
  if (!stuck.empty()) {
    problems.push_back(fmt::format(
        "the plan cannot make progress: its handshakes deadlock (a cycle needs a delay on one of its "
        "inputs, and enough slots to turn):{}",
        stuck));
  }
}

}  // namespace

void validate(const Plan& plan, const KernelRegistry& kernels, std::uint16_t rank, ProgressCheck progress,
              PlanChecks checks) {
  std::vector<std::string> problems;
  static_checks(plan, kernels, rank, problems, checks != PlanChecks::before_transfers);
  if (problems.empty() && checks != PlanChecks::structure && checks != PlanChecks::before_transfers) {
    progress_check(plan, rank, progress, problems);
  }
  // Arenas: no two slots that may be live at once share bytes (lives follow the lanes, so an
  // order that deadlocks is reported as that first).
  if (problems.empty() && checks == PlanChecks::all) check_memory(plan, problems);
  if (problems.empty()) return;
  std::string msg = problems.size() == 1 ? "invalid plan: " : fmt::format("invalid plan ({} problems):", problems.size());
  for (std::size_t i = 0; i < problems.size(); ++i) msg += (problems.size() == 1 ? "" : "\n  - ") + problems[i];
  throw PlanError(msg);
}

std::string HandshakeEvent::str() const {
  return fmt::format("{} {}->{} {}[{}]#{}", name(kind), from, to, reg, slot, piece);
}

// -----------------------------------------------------------------------------------------------
// Runtime

struct Runtime::Impl : detail::Core {
  using detail::Core::Core;
};

namespace {

/// RuntimeSettings::idle_polling: busy-poll only where the busy threads of this host leave a
/// core, or where this rank's own cores are enough for its workers and it talks to its peers
/// over shared memory only. When the run starts: the link knows its transports once connected.
void choose_idle_polling(detail::Core& core) {
  const RuntimeSettings& s = core.settings;
  const std::set<std::uint16_t>& peers = core.peers;
  const bool talks_to_other_ranks = !peers.empty();
  const auto workers = core.workers.size();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool shared_memory_only =
      talks_to_other_ranks && std::all_of(peers.begin(), peers.end(), [&](std::uint16_t p) {
        return s.link->shares_memory_with(p);
      });
  const bool own_enough = s.own_cores > 0 && workers <= s.own_cores && shared_memory_only;
  std::string count =
      s.ranks_on_host == 0
          ? fmt::format("{} worker{}, ranks on this host not known", workers, workers == 1 ? "" : "s")
          : fmt::format("{} worker{} x {} rank{} on this host {} {} cores", workers, workers == 1 ? "" : "s",
                        s.ranks_on_host, s.ranks_on_host == 1 ? "" : "s",
                        workers * s.ranks_on_host < cores ? "<" : ">=", cores);
  if (s.own_cores > 0) {
    count += fmt::format(", {} {} {} core{} of its own (bound){}", workers, workers <= s.own_cores ? "<=" : ">",
                         s.own_cores, s.own_cores == 1 ? "" : "s",
                         !talks_to_other_ranks || shared_memory_only ? "" : ", a peer beyond shared memory");
  }
  if (s.mode == ExecutionMode::deterministic) {
    core.idle_polling = "one thread (deterministic mode)";
  } else if (s.idle_polling == IdlePolling::busy_poll) {
    core.busy_poll = true;
    core.idle_polling = fmt::format("busy-polling (asked for): {}", count);
  } else if (s.idle_polling == IdlePolling::park) {
    core.idle_polling = fmt::format("parking (asked for): {}", count);
  } else if (!talks_to_other_ranks) {
    core.idle_polling = fmt::format("parking: no other rank to poll for ({})", count);
  } else if (!own_enough && (s.ranks_on_host == 0 || workers * s.ranks_on_host >= cores)) {
    core.idle_polling = fmt::format("parking: {}", count);
  } else {
    core.busy_poll = true;
    core.idle_polling = fmt::format("busy-polling: {}", count);
  }
}

}  // namespace

Runtime::Runtime(Plan plan, const KernelRegistry& kernels, RuntimeSettings settings) {
  if (settings.record_handshakes && settings.mode != ExecutionMode::deterministic) {
    throw std::invalid_argument("record_handshakes needs ExecutionMode::deterministic");
  }
  validate(plan, kernels, settings.rank);
  // Does this rank talk to another one?
  std::set<std::uint16_t> peers;
  for (const auto& a : plan.actors) {
    if (a.where.rank != settings.rank) continue;
    for (const auto& in : a.inputs) peers.insert(plan.actors[plan.registers[in.reg].producer].where.rank);
    for (auto r : a.outputs) {
      for (auto c : plan.registers[r].consumers) peers.insert(plan.actors[c].where.rank);
    }
  }
  peers.erase(settings.rank);
  if (!peers.empty()) {
    if (settings.link == nullptr) {
      throw PlanError(fmt::format("invalid plan: rank {} exchanges registers with rank {} but the runtime has no data "
                                  "plane (RuntimeSettings::link; baton::run_job sets it up)",
                                  settings.rank, *peers.begin()));
    }
    if (*peers.rbegin() >= settings.link->world_size() || settings.link->rank() != settings.rank) {
      throw PlanError(fmt::format("invalid plan: rank {} exchanges registers with rank {}, but the data plane is rank "
                                  "{} of {}",
                                  settings.rank, *peers.rbegin(), settings.link->rank(),
                                  settings.link->world_size()));
    }
  }
  if (settings.mode == ExecutionMode::deterministic && !peers.empty()) {
    throw std::invalid_argument("deterministic mode runs one rank alone; this plan's rank " +
                                std::to_string(settings.rank) + " talks to other ranks");
  }
  impl_ = std::make_unique<Impl>(std::move(plan), &kernels, settings, /*dry_run=*/false);
  if (!peers.empty()) impl_->pieces_per_step = detail::pieces_per_step(impl_->plan);
  if (settings.rejoin_step < 0) throw std::invalid_argument("rejoin_step must be >= 0");
  if (settings.rejoin_step > 0) {
    if (impl_->pieces_per_step.empty()) {
      throw PlanError(fmt::format("rank {} cannot come back at step {}: its plan has no fixed number of pieces a step",
                                  settings.rank, settings.rejoin_step));
    }
    for (std::int64_t per : impl_->pieces_per_step) impl_->piece_shift.push_back(settings.rejoin_step * per);
  }
  impl_->instantiate();
  impl_->peers = peers;
  if (!peers.empty()) settings.link->set_handler(impl_.get());
}

void Runtime::abort(const std::string& reason) { impl_->fail(reason); }

void Runtime::rank_left(std::uint32_t rank, const std::string& reason) { impl_->rank_left(rank, reason); }

std::int64_t Runtime::hold_for_rejoin(std::uint32_t rank, std::chrono::milliseconds timeout) {
  return impl_->hold_for_rejoin(rank, timeout);
}

void Runtime::rank_rejoined(std::uint32_t rank, std::int64_t step, std::chrono::milliseconds timeout) {
  impl_->rank_rejoined(rank, step, timeout);
}

void Runtime::release_hold(std::uint32_t rank) {
  impl_->post_to_peers_of(rank, Message{{}, {}, -1, rank, 0, MsgKind::rank_rejoined, 0});
}

Runtime::~Runtime() = default;

namespace {

/// Threaded mode: starts the workers and watches the run until every actor has retired, the run
/// failed, or it stalled (no act within stall_timeout), a stream failed or a peer's error went
/// unexplained for too long; then stops the workers and fails the run with the reason.
void run_threaded(detail::Core& core) {
  for (auto& w : core.workers) w->start_thread();
  for (auto& a : core.actors) {
    if (a) a->worker()->post(Message{a->id(), a->id(), 0, 0, 0, MsgKind::start, 0});
  }
  std::uint64_t last_progress = ~std::uint64_t{0};
  auto last_change = std::chrono::steady_clock::now();
  bool stalled = false;
  // A stream whose work failed (a CUDA device fault) never runs its when_reached callbacks,
  // so its actors' requests and acks never come: without this check the job would wait for
  // the stall timeout (or, with none, forever) and then not say why.
  std::string device_error;
  std::pair<Device, std::uint8_t> failed_stream;
  std::string peer_failure;
  std::unique_lock lock(core.mutex);
  while (!core.done && !core.failed()) {
    core.cv.wait_for(lock, std::chrono::milliseconds(50));
    if (core.done || core.failed()) continue;
    if (!core.peer_errors.empty()) {
      peer_failure = core.overdue_peer_error();
      if (!peer_failure.empty()) break;
    }
    for (const auto& [where, stream] : core.streams) {
      device_error = stream->failure();
      if (!device_error.empty()) {
        failed_stream = where;
        break;
      }
    }
    if (!device_error.empty()) break;
    if (core.settings.stall_timeout.count() <= 0) continue;
    std::uint64_t progress = static_cast<std::uint64_t>(core.retired.load());
    for (const auto& a : core.actors) {
      if (a) progress += a->counters().acts.load(std::memory_order_relaxed);
    }
    auto now = std::chrono::steady_clock::now();
    if (progress != last_progress) {
      last_progress = progress;
      last_change = now;
    } else if (now - last_change > core.settings.stall_timeout) {
      stalled = true;
      break;
    }
  }
  lock.unlock();
  for (auto& w : core.workers) w->close();
  for (auto& w : core.workers) w->join();
  if (!peer_failure.empty()) core.fail(peer_failure);
  if (stalled) {
    core.fail(fmt::format("no actor acted for {} ms (stall timeout); unfinished actors:{}",
                          core.settings.stall_timeout.count(), core.describe_stuck()));
  }
  if (!device_error.empty()) {
    core.fail(core.describe_stream_failure(failed_stream, device_error));
  }
}

}  // namespace

RunReport Runtime::run() {
  auto& core = *impl_;
  if (core.ran) throw std::logic_error("Runtime::run() called twice; make a new Runtime");
  core.ran = true;
  choose_idle_polling(core);
  const auto t0 = std::chrono::steady_clock::now();
  const std::uint64_t start = ticks();
  for (auto& a : core.actors) {
    if (a) a->begin(start);
  }
  // Published after every actor's lifetime has begun: snapshot() reads it from any thread.
  core.start_ticks.store(start, std::memory_order_relaxed);
  if (core.local_actors == 0) core.done = true;
  core.start_sampler();

  if (core.settings.mode == ExecutionMode::deterministic) {
    if (!core.workers.empty()) {
      for (auto& a : core.actors) {
        if (a) core.workers[0]->enqueue_local(Message{a->id(), a->id(), 0, 0, 0, MsgKind::start, 0});
      }
      core.workers[0]->drain();
    }
    if (!core.failed() && core.retired.load() != core.local_actors) {
      core.fail("the run stopped with actors unfinished (deadlock):" + core.describe_stuck());
    }
  } else {
    run_threaded(core);
  }
  core.stop_sampler();  // every worker has stopped: the actors' last activities are final
  if (!core.failed() && !core.streams.empty()) {
    if (std::string why = core.drain_streams(core.settings.stall_timeout); !why.empty()) core.fail(why);
    if (core.settings.device_time) {
      for (auto& a : core.actors) {
        if (a) a->collect_device_time(true);
      }
    }
  }
  if (core.failed()) throw JobError(core.error);
  RunReport report;
  report.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.idle_polling = core.idle_polling;
  report.time_accounting =
      !core.settings.time_accounting ? "off"
      : core.sampled_time.load(std::memory_order_relaxed)
          ? fmt::format("sampled at {} Hz", core.settings.time_sample_hz)
      : core.settings.time_sample_hz > 0 ? "exact (the sampler could not run at a real-time priority)"
                                         : "exact";
  report.metrics = core.snapshot();
  report.metrics.elapsed_s = report.wall_s;
  for (const auto& [device, use] : core.in_use) {
    report.memory.push_back({device, use.peak.load(std::memory_order_relaxed)});
  }
  for (auto& w : core.workers) {
    report.messages += w->messages();
    report.parks += w->parks();
    report.messages_to_other_ranks += w->messages_to_other_ranks();
    report.link_messages += w->link_messages();
  }
  for (const auto& a : core.actors) {
    if (a) a->count_crossings(report);
  }
  if (core.shared_segments) report.shared_register_bytes = core.shared_segments->bytes_allocated();
  {
    std::lock_guard lock(core.mutex);
    report.departed = core.departures;
    report.rejoined = core.rejoins;
  }
  return report;
}

MetricsSnapshot Runtime::snapshot() const { return impl_->snapshot(); }

void Runtime::set_activity_log(bool on) {
  if (on && !impl_->settings.activity_log) {
    throw std::logic_error("Runtime::set_activity_log(true) needs RuntimeSettings::activity_log");
  }
  impl_->activity_log.store(on, std::memory_order_relaxed);
}

std::size_t Runtime::drain_activity(std::vector<ActRecord>& out) {
  std::lock_guard lock(impl_->activity_mutex);
  std::size_t n = 0;
  for (auto& w : impl_->workers) n += w->drain_log(out);
  return n;
}

std::uint64_t Runtime::activity_dropped() const {
  std::uint64_t n = 0;
  for (const auto& w : impl_->workers) n += w->log_dropped();
  return n;
}

std::vector<std::string> Runtime::worker_names() const {
  std::vector<std::string> names;
  for (const auto& w : impl_->workers) names.push_back(fmt::format("{}/s{}", w->device().str(), w->stream()));
  return names;
}
const std::vector<HandshakeEvent>& Runtime::handshakes() const { return impl_->log; }
const Plan& Runtime::plan() const { return impl_->plan; }

}  // namespace baton
