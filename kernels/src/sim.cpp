// The sim device's stream: a thread that runs closures in order, with events, waits between
// streams and host callbacks, failing stickily as a CUDA stream does (see sim.h).
#include "baton/kernels/sim.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels/dtype.h"
#include "baton/kernels/tensor.h"

namespace baton::sim {

struct Stream::State {
  struct Item {
    std::function<void()> work;
    bool callback = false;  // skipped after a failure, as CUDA skips host functions
  };
  std::string owner;
  mutable std::mutex mutex;
  std::condition_variable work_cv;      // the stream's thread waits here for work
  std::condition_variable progress_cv;  // synchronize() and other streams' waits wait here
  std::deque<Item> queue;
  std::atomic<std::uint64_t> enqueued{0};  // written under mutex
  std::atomic<std::uint64_t> executed{0};  // written under mutex
  std::atomic<bool> failed{false};
  std::string error;  // under mutex, set once with failed
  int waiters = 0;    // threads blocked on progress_cv; under mutex
  bool parked = false;
  std::atomic<bool> stop{false};

  void fail(const std::string& what) {
    std::lock_guard lock(mutex);
    if (failed.load(std::memory_order_relaxed)) return;
    error = fmt::format("{}: its work failed: {}", owner, what);
    failed.store(true, std::memory_order_release);
  }

  /// Blocks (another stream's thread, or a host thread in synchronize) until `position` items
  /// have run here, this stream failed or stops, or `give_up` says so. Returns this stream's
  /// error, if any.
  std::string wait_until(std::uint64_t position, const std::atomic<bool>* give_up) {
    std::unique_lock lock(mutex);
    ++waiters;
    while (executed.load(std::memory_order_relaxed) < position &&
           !failed.load(std::memory_order_relaxed) && !stop.load(std::memory_order_relaxed) &&
           !(give_up != nullptr && give_up->load(std::memory_order_relaxed))) {
      // Bounded, so that a waiter whose own stream stops (give_up) notices without a notify.
      progress_cv.wait_for(lock, std::chrono::milliseconds(10));
    }
    --waiters;
    if (failed.load(std::memory_order_relaxed)) return error;
    if (executed.load(std::memory_order_relaxed) < position)
      return owner + ": stopped before the work waited for ran";
    return {};
  }
};

namespace {

struct Event final : StreamEvent {
  std::shared_ptr<Stream::State> state;  // null: never recorded
  std::uint64_t position = 0;
  // Timing events: the steady clock when the stream reached the last record (0: not yet),
  // written by the stream's thread.
  bool timing = false;
  std::shared_ptr<std::atomic<std::int64_t>> reached_ns =
      std::make_shared<std::atomic<std::int64_t>>(0);
};

template <class E, class Sim = std::conditional_t<std::is_const_v<E>, const Event, Event>>
Sim& sim_event(E& e, const std::string& who) {
  auto* ev = dynamic_cast<Sim*>(&e);
  if (ev == nullptr)
    throw std::invalid_argument(
        fmt::format("{}: an event of another kind of stream (not sim)", who));
  return *ev;
}

}  // namespace

Stream::Stream(Device device, std::string owner, StreamSettings settings)
    : device_(device),
      owner_(std::move(owner)),
      settings_(settings),
      state_(std::make_shared<State>()) {
  state_->owner = owner_;
}

std::unique_ptr<Stream> Stream::create(Device device, std::string_view owner,
                                       StreamSettings settings) {
  if (device.type != DeviceType::sim) {
    throw std::invalid_argument(
        fmt::format("{}: a sim stream on {}, which is not a sim device", owner, device.str()));
  }
  std::unique_ptr<Stream> s(new Stream(device, std::string(owner), settings));
  s->thread_ = std::thread([p = s.get()] { p->loop(); });
  return s;
}

Stream::~Stream() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stop.store(true, std::memory_order_relaxed);
  }
  state_->work_cv.notify_all();
  state_->progress_cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Stream::loop() {
  State& st = *state_;
  int idle = 0;
  for (;;) {
    State::Item item;
    if (st.enqueued.load(std::memory_order_acquire) ==
            st.executed.load(std::memory_order_relaxed) &&
        !st.stop.load(std::memory_order_relaxed) && idle < settings_.spin_polls) {
      ++idle;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    {
      std::unique_lock lock(st.mutex);
      if (st.queue.empty() && !st.stop.load(std::memory_order_relaxed)) {
        st.parked = true;
        st.work_cv.wait(
            lock, [&] { return st.stop.load(std::memory_order_relaxed) || !st.queue.empty(); });
        st.parked = false;
      }
      if (st.stop.load(std::memory_order_relaxed)) return;  // what is left is dropped
      item = std::move(st.queue.front());
      st.queue.pop_front();
    }
    idle = 0;
    if (!st.failed.load(std::memory_order_acquire)) {
      try {
        item.work();
      } catch (const std::exception& e) {
        st.fail(e.what());
      } catch (...) {
        st.fail("an exception that is not a std::exception");
      }
    }
    {
      std::lock_guard lock(st.mutex);
      st.executed.store(st.executed.load(std::memory_order_relaxed) + 1, std::memory_order_release);
      if (st.waiters == 0) continue;
    }
    st.progress_cv.notify_all();
  }
}

void Stream::enqueue(std::function<void()> work) {
  if (capturing_) {
    recorded_.push_back(std::move(work));
    return;
  }
  State& st = *state_;
  bool wake = false;
  {
    std::lock_guard lock(st.mutex);
    st.queue.push_back(State::Item{std::move(work), false});
    st.enqueued.store(st.enqueued.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    wake = st.parked;
  }
  if (wake) st.work_cv.notify_one();
}

std::uint64_t Stream::executed() const {
  return state_->executed.load(std::memory_order_acquire);
}

std::unique_ptr<StreamEvent> Stream::make_event() {
  return std::make_unique<Event>();
}

std::unique_ptr<StreamEvent> Stream::make_timing_event() {
  auto e = std::make_unique<Event>();
  e->timing = true;
  return e;
}

std::optional<double> Stream::elapsed_ms(const StreamEvent& start, const StreamEvent& end) const {
  const Event& a = sim_event(start, owner_);
  const Event& b = sim_event(end, owner_);
  const std::int64_t t0 = a.reached_ns->load(std::memory_order_acquire);
  const std::int64_t t1 = b.reached_ns->load(std::memory_order_acquire);
  if (t0 == 0 || t1 == 0) return std::nullopt;
  return static_cast<double>(t1 - t0) * 1e-6;
}

void Stream::refuse_in_capture(const char* what) {
  if (!capturing_) return;
  if (capture_broken_.empty()) capture_broken_ = fmt::format("{} during a capture", what);
  throw std::runtime_error(fmt::format("{}: {} during a capture of its work (it cannot be captured)", owner_, what));
}

namespace {

struct SimGraph final : StreamGraph {
  std::shared_ptr<const std::vector<std::function<void()>>> work;
};

}  // namespace

void Stream::begin_capture() {
  if (capturing_) throw std::logic_error(owner_ + ": begin_capture during a capture");
  capturing_ = true;
  recorded_.clear();
  capture_broken_.clear();
}

std::unique_ptr<StreamGraph> Stream::end_capture() {
  if (!capturing_) throw std::logic_error(owner_ + ": end_capture without begin_capture");
  capturing_ = false;
  auto work = std::make_shared<const std::vector<std::function<void()>>>(std::move(recorded_));
  recorded_.clear();
  if (!capture_broken_.empty()) {
    throw std::runtime_error(fmt::format("{}: the capture is invalid: {}", owner_, capture_broken_));
  }
  auto g = std::make_unique<SimGraph>();
  g->work = std::move(work);
  return g;
}

void Stream::launch(StreamGraph& g) {
  auto* sim = dynamic_cast<SimGraph*>(&g);
  if (sim == nullptr) throw std::invalid_argument(owner_ + ": launch of a graph that is not a sim stream's");
  refuse_in_capture("a graph's launch");
  enqueue([work = sim->work] {
    for (const auto& f : *work) f();
  });
}

void Stream::record(StreamEvent& e) {
  refuse_in_capture("an event's record");
  Event& ev = sim_event(e, owner_);
  if (ev.timing) {
    // A fresh cell per record: a reader of the last one's time never sees this one's.
    ev.reached_ns = std::make_shared<std::atomic<std::int64_t>>(0);
    enqueue([cell = ev.reached_ns] {
      cell->store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count(),
                  std::memory_order_release);
    });
  }
  ev.state = state_;
  ev.position = state_->enqueued.load(std::memory_order_acquire);
}

void Stream::wait(const StreamEvent& e) {
  refuse_in_capture("a wait for an event");
  const Event& ev = sim_event(e, owner_);
  if (ev.state == nullptr || ev.state == state_) return;  // never recorded, or our own order
  // As cudaStreamWaitEvent: the event as recorded now, whatever is recorded into it later.
  enqueue([other = ev.state, position = ev.position, mine = state_] {
    std::string why = other->wait_until(position, &mine->stop);
    if (!why.empty()) throw std::runtime_error(fmt::format("waited for another stream: {}", why));
  });
}

void Stream::when_reached(void (*fn)(void*), void* arg) {
  refuse_in_capture("a host callback");
  State& st = *state_;
  bool wake = false;
  {
    std::lock_guard lock(st.mutex);
    st.queue.push_back(State::Item{[fn, arg] { fn(arg); }, true});
    st.enqueued.store(st.enqueued.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    wake = st.parked;
  }
  if (wake) st.work_cv.notify_one();
}

void Stream::synchronize() {
  refuse_in_capture("synchronize");
  const std::uint64_t target = state_->enqueued.load(std::memory_order_acquire);
  std::string why = state_->wait_until(target, nullptr);
  if (!why.empty()) throw std::runtime_error(why);
}

std::string Stream::failure() const {
  if (!state_->failed.load(std::memory_order_acquire)) return {};
  std::lock_guard lock(state_->mutex);
  return state_->error;
}

bool Stream::idle() const {
  return state_->failed.load(std::memory_order_acquire) ||
         state_->executed.load(std::memory_order_acquire) ==
             state_->enqueued.load(std::memory_order_acquire);
}

namespace {

/// A CPU kernel run on the actor's sim stream. Its arguments are taken when it is enqueued, as a
/// CUDA launch takes its pointers and sizes: the tensors (handles to the same memory) and the
/// piece go with it, since the actor reuses its views for the next act before this one runs,
/// and a repeat (a weight's, a view) points its output handle at the next piece's slot while
/// readers of the last piece are still queued.
class OnStream final : public Kernel {
 public:
  OnStream(std::unique_ptr<Kernel> cpu, std::string actor)
      : cpu_(std::move(cpu)), actor_(std::move(actor)) {}
  void compute(KernelContext& ctx) override {
    auto* s = dynamic_cast<Stream*>(ctx.async_stream);
    if (s == nullptr) {
      throw std::invalid_argument(
          fmt::format("actor '{}': a sim kernel ran without a sim stream (is its actor on a "
                      "sim device?)",
                      actor_));
    }
    struct Args {
      std::vector<Tensor> in, out;  // shallow copies (the same storage)
      std::vector<const Tensor*> in_ptrs;
      std::vector<Tensor*> out_ptrs;
    };
    auto args = std::make_shared<Args>();
    for (const Tensor* t : ctx.inputs) args->in.push_back(t == nullptr ? Tensor{} : *t);
    for (const Tensor* t : ctx.outputs) args->out.push_back(t == nullptr ? Tensor{} : *t);
    for (std::size_t i = 0; i < ctx.inputs.size(); ++i)
      args->in_ptrs.push_back(ctx.inputs[i] == nullptr ? nullptr : &args->in[i]);
    for (std::size_t i = 0; i < ctx.outputs.size(); ++i)
      args->out_ptrs.push_back(ctx.outputs[i] == nullptr ? nullptr : &args->out[i]);
    s->enqueue([k = cpu_.get(), args = std::move(args), piece = ctx.piece] {
      KernelContext c{args->in_ptrs, args->out_ptrs, piece, nullptr, nullptr};
      k->compute(c);
    });
  }

 private:
  std::unique_ptr<Kernel> cpu_;
  std::string actor_;
};

void copy_bytes(KernelContext& ctx, const char* op) {
  if (ctx.inputs.size() != 1 || ctx.outputs.size() != 1 || ctx.inputs[0] == nullptr ||
      ctx.outputs[0] == nullptr) {
    throw std::invalid_argument(fmt::format("{}: needs one input and one output", op));
  }
  const Tensor& from = *ctx.inputs[0];
  Tensor& to = *ctx.outputs[0];
  if (from.nbytes() != to.nbytes()) {
    throw std::invalid_argument(
        fmt::format("{}: {} into {}: sizes differ", op, from.describe(), to.describe()));
  }
  if (from.nbytes() > 0) std::memcpy(to.raw(), from.raw(), from.nbytes());
}

class CopyKernel final : public Kernel {
 public:
  explicit CopyKernel(const char* op) : op_(op) {}
  void compute(KernelContext& ctx) override { copy_bytes(ctx, op_); }

 private:
  const char* op_;
};

}  // namespace

std::unique_ptr<Kernel> on_stream(std::unique_ptr<Kernel> cpu_kernel, std::string actor) {
  return std::make_unique<OnStream>(std::move(cpu_kernel), std::move(actor));
}

void add_sim_kernels(KernelRegistry& reg) {
  add_sim_nccl_kernels(reg);
  for (DType t : {DType::f32, DType::f64, DType::i32, DType::i64, DType::u8, DType::bf16}) {
    for (const char* op : {"copy", "to_device", "to_host"}) {
      reg.add(op, DeviceType::sim, t, [op](const KernelConfig& cfg) {
        return on_stream(std::make_unique<CopyKernel>(op), std::string(cfg.actor));
      });
    }
  }
}

}  // namespace baton::sim
