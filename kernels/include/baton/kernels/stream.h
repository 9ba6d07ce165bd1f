#pragma once
/// Asynchronous devices: a stream runs the work enqueued on it in order, after the act that
/// enqueued it has returned. A CUDA stream (baton/kernels/cuda.h) is one; a `sim` stream
/// (baton/kernels/sim.h, a thread that runs closures in order) is another, so that the runtime's
/// stream logic runs in CI without a GPU.
///
/// The runtime orders work across streams with events, as CUDA does:
///
///   auto ready = producer_stream.make_event();
///   producer_stream.record(*ready);   // after the producer's kernel was enqueued
///   consumer_stream.wait(*ready);     // the consumer's work enqueued from now on runs after it
///
/// `wait` takes the event as it was last recorded when wait is called; a later record does
/// not change what an earlier wait waits for. Waiting for an event that was never recorded
/// waits for nothing.
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "baton/kernels/device.h"

namespace baton {

/// A point in one stream's work (cudaEvent_t; a position in a sim stream). Made by its
/// stream's make_event(); recorded and waited on from one thread at a time.
class StreamEvent {
 public:
  virtual ~StreamEvent() = default;
};

/// A stream's work captured once (AsyncStream::begin_capture / end_capture) and launched again
/// as a whole: a CUDA graph; on a sim stream, the recorded closures. What it replays is what was
/// enqueued, with the same arguments and addresses.
class StreamGraph {
 public:
  virtual ~StreamGraph() = default;
};

/// The in-order work queue of an asynchronous device, as one worker thread of the runtime
/// sees it. Methods are called from one thread at a time (the worker that owns the stream),
/// except failure() and idle(), which any thread may call.
class AsyncStream {
 public:
  virtual ~AsyncStream() = default;
  virtual Device device() const = 0;
  /// Who uses the stream (a worker or an actor), for error messages.
  virtual const std::string& owner() const = 0;
  /// An event for record() / wait() on streams of this kind. Throws on failure.
  virtual std::unique_ptr<StreamEvent> make_event() = 0;
  /// `e` now marks the work enqueued on this stream so far. Throws on failure.
  virtual void record(StreamEvent& e) = 0;
  /// Work enqueued on this stream from now on starts only after the work `e` marks (on this
  /// or another stream of the same kind). Throws on failure, or for an event of another kind.
  virtual void wait(const StreamEvent& e) = 0;
  /// An event that also keeps the time the stream reached it (costlier than make_event()).
  virtual std::unique_ptr<StreamEvent> make_timing_event() = 0;
  /// Milliseconds between two timing events recorded on this stream, once the stream has
  /// reached both; nullopt while either is pending (or was never recorded). Any thread.
  virtual std::optional<double> elapsed_ms(const StreamEvent& start, const StreamEvent& end) const = 0;
  /// Calls fn(arg) once all the work enqueued so far has finished, on a thread of the stream's
  /// (a CUDA driver thread; the sim stream's own). fn must not use the stream; it should only
  /// hand a message on. After a failure of the stream it is never called. Throws.
  virtual void when_reached(void (*fn)(void*), void* arg) = 0;
  /// Blocks until the work enqueued so far has finished; throws naming the owner if it failed.
  virtual void synchronize() = 0;
  /// Without waiting: "" while the work runs or is done, else "<owner>: <what failed>" once it
  /// failed (sticky). Any thread.
  virtual std::string failure() const = 0;
  /// Without waiting: true once every piece of work enqueued so far has finished (or the
  /// stream failed). Any thread.
  virtual bool idle() const = 0;
  /// Makes the stream's device current on the calling thread where that means something.
  virtual void bind() const {}

  /// Capture (CUDA's stream capture, cudaGraph_t): from begin_capture() until end_capture(), the
  /// work enqueued on this stream is recorded, not run. end_capture() returns it as a graph, or
  /// throws std::runtime_error (the capture ended, nothing recorded kept) where something in it
  /// cannot be captured: a synchronize(), an event, an allocation of device memory. A kernel
  /// that throws during a capture must still be followed by end_capture(). launch(g) enqueues
  /// the graph's work as one item, in the order it was recorded. Streams that cannot capture
  /// throw from begin_capture().
  virtual void begin_capture();
  virtual std::unique_ptr<StreamGraph> end_capture();
  virtual void launch(StreamGraph& g);
};

}  // namespace baton
