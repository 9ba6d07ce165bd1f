#pragma once
/// The `sim` device: an asynchronous device in all but name, so that the runtime's stream logic
/// (stream order, events, host callbacks, failures) runs in CI, under ThreadSanitizer, without a
/// GPU. Its memory is host memory; its stream is a thread that runs enqueued work in order,
/// as a CUDA stream does, with events, waits between streams and host callbacks.
///
///   auto s = baton::sim::Stream::create(baton::Device::parse("sim:0"), "worker sim:0/s0");
///   s->enqueue([&] { /* runs on the stream's thread, after what was enqueued before */ });
///   auto e = s->make_event();  s->record(*e);  other->wait(*e);
///
/// Every op that has a CPU kernel has a sim kernel: KernelRegistry::create wraps the CPU kernel
/// so that compute() enqueues it on the actor's sim stream (KernelContext::async_stream) and
/// returns at once. The test kernels `spin_ns` and `sleep_ns` so become kernels of a set length
/// on an asynchronous device. add_sim_kernels adds the copies (to_device, to_host).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "baton/kernels/kernel.h"
#include "baton/kernels/stream.h"

namespace baton::sim {

/// How a sim stream's thread waits for work: it polls `spin_polls` times (a pause each), then
/// sleeps on a condition variable until work comes. Spinning shortens the gap between short
/// kernels; on machines with few cores it steals time from the threads that enqueue.
struct StreamSettings {
  int spin_polls = 2000;
};

/// One stream of a sim device: a thread running closures in the order they were enqueued.
/// An exception from a closure fails the stream (sticky, as a CUDA fault is): failure() says
/// what(), and nothing enqueued after it runs (no callback either). Thread-safe.
class Stream final : public AsyncStream {
 public:
  static std::unique_ptr<Stream> create(Device device, std::string_view owner,
                                        StreamSettings settings = {});
  /// Stops the thread; work not yet started is dropped (the runtime waits for idle() first).
  ~Stream() override;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  /// Runs `work` on the stream's thread after everything enqueued before it.
  void enqueue(std::function<void()> work);

  Device device() const override { return device_; }
  const std::string& owner() const override { return owner_; }
  std::unique_ptr<StreamEvent> make_event() override;
  /// A timing event's time is taken by the stream's thread when it reaches the record.
  std::unique_ptr<StreamEvent> make_timing_event() override;
  std::optional<double> elapsed_ms(const StreamEvent& start, const StreamEvent& end) const override;
  void record(StreamEvent& e) override;
  /// Enqueues a wait: the stream's thread blocks there until the other stream has run
  /// everything `e` marks (or failed, which fails this stream too: CUDA would never get past).
  void wait(const StreamEvent& e) override;
  void when_reached(void (*fn)(void*), void* arg) override;
  void synchronize() override;
  std::string failure() const override;
  bool idle() const override;
  /// Capture as CUDA's: the closures enqueued from begin_capture() on are recorded, not run;
  /// launch() enqueues them again as one item, with the arguments they were given. A
  /// synchronize(), an event or a callback during the capture throws and invalidates it (CUDA
  /// refuses the first outright), so that end_capture() throws. From the owning thread only.
  void begin_capture() override;
  std::unique_ptr<StreamGraph> end_capture() override;
  void launch(StreamGraph& g) override;

  /// Work items run (or skipped after a failure) so far. Any thread.
  std::uint64_t executed() const;

  /// The queue, counters and failure (sim.cpp), shared with the events recorded on this stream,
  /// so that another stream waiting on one never outlives what it reads.
  struct State;

 private:
  Stream(Device device, std::string owner, StreamSettings settings);
  void loop();

  Device device_;
  std::string owner_;
  StreamSettings settings_;
  std::shared_ptr<State> state_;
  std::thread thread_;
  // The capture in progress (begin_capture): what was recorded, and why it is invalid ("": it is not).
  bool capturing_ = false;
  std::vector<std::function<void()>> recorded_;
  std::string capture_broken_;
  /// Throws (and invalidates the capture) if one is in progress: `what` cannot be captured.
  void refuse_in_capture(const char* what);
};

/// Registers the sim device's own kernels: copy, to_device and to_host for every dtype (a
/// memcpy on the stream). Every other op runs its CPU kernel on the stream (on_stream).
void add_sim_kernels(KernelRegistry& reg);

/// Registers the sim's stand-in for NCCL (kernels/src/sim_nccl.cpp): "nccl.allreduce",
/// "nccl.reduce_scatter" and "nccl.all_gather" on sim devices (f32, f64, bf16), with NCCL's
/// pairing of calls by their order and a call that waits on its stream for every member (in
/// this process), so that plans with NCCL actors run in CI. Called by add_sim_kernels.
void add_sim_nccl_kernels(KernelRegistry& reg);

/// A kernel whose compute() enqueues `cpu_kernel`'s on the actor's sim stream
/// (KernelContext::async_stream) with the act's tensors and piece, and returns.
std::unique_ptr<Kernel> on_stream(std::unique_ptr<Kernel> cpu_kernel, std::string actor);

}  // namespace baton::sim
