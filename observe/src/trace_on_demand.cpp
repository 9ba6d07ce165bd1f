// The dashboard's "record N seconds": one session at a time, waited for on a thread of its own
// so that neither the HTTP server nor the telemetry thread ever blocks on it.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "baton/observe/trace.h"

namespace baton::observe {

namespace {
/// After the window: how long the ranks have to send their last parts and say they ended.
constexpr std::chrono::seconds end_grace{10};
/// How often the waiting thread looks at the collector.
constexpr std::chrono::milliseconds poll_period{50};
}  // namespace

struct TraceOnDemand::Impl {
  TraceCollector& collector;
  Start start;
  std::size_t ranks;
  std::mutex mutex;
  std::condition_variable cv;
  bool busy = false;
  bool stopping = false;
  std::uint32_t next_session = 1;  // 0 is the whole run's
  std::thread thread;

  Impl(TraceCollector& c, Start s, std::size_t n) : collector(c), start(std::move(s)), ranks(n) {}

  void wait_and_answer(std::uint32_t session, double seconds, std::function<void(bool, std::string)> done) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000)) + end_grace;
    bool stopped = false;
    {
      std::unique_lock lock(mutex);
      while (collector.finished(session) < ranks && std::chrono::steady_clock::now() < deadline && !stopping) {
        cv.wait_for(lock, poll_period);
      }
      stopped = stopping;
    }
    if (stopped) {
      // Shutting down: whoever asked (the HTTP server, stopped before us) is gone.
      collector.forget(session);
      return;
    }
    bool ok = false;
    std::string body;
    try {
      if (collector.ranks(session) == 0) {
        body = fmt::format("no rank recorded a trace within {:.0f} s (has the run ended?)",
                           seconds + static_cast<double>(end_grace.count()));
      } else {
        TraceRecorder trace = collector.merge(session);
        if (collector.finished(session) < ranks) {
          trace.add_note(fmt::format("{} of {} ranks ended the recording in time", collector.finished(session), ranks));
        }
        body = trace.json();
        ok = true;
      }
    } catch (const std::exception& e) {
      body = fmt::format("the trace could not be put together: {}", e.what());
    }
    collector.forget(session);
    {
      std::lock_guard lock(mutex);
      busy = false;
    }
    done(ok, std::move(body));
  }
};

TraceOnDemand::TraceOnDemand(TraceCollector& collector, Start start, std::size_t ranks)
    : impl_(std::make_unique<Impl>(collector, std::move(start), ranks)) {}

TraceOnDemand::~TraceOnDemand() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void TraceOnDemand::record(double seconds, std::function<void(bool ok, std::string body)> done) {
  std::uint32_t session = 0;
  std::unique_lock lock(impl_->mutex);
  if (impl_->busy) {
    lock.unlock();
    return done(false, "a recording is already running; try again when it has ended");
  }
  if (impl_->stopping) {
    lock.unlock();
    return done(false, "the dashboard is shutting down");
  }
  impl_->busy = true;
  session = impl_->next_session++;
  if (impl_->thread.joinable()) impl_->thread.join();  // the last one has answered (busy was false)
  lock.unlock();
  try {
    impl_->start(session, seconds);
  } catch (const std::exception& e) {
    std::lock_guard relock(impl_->mutex);
    impl_->busy = false;
    return done(false, fmt::format("could not start recording: {}", e.what()));
  }
  impl_->thread = std::thread([this, session, seconds, done = std::move(done)]() mutable {
    impl_->wait_and_answer(session, seconds, std::move(done));
  });
}

}  // namespace baton::observe
