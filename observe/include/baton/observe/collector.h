#pragma once
/// The rank-side collector: a JobObserver with a thread that, every `interval` (2 Hz by
/// default), takes the runtime's counters (Runtime::snapshot), drains its activity log
/// (Runtime::drain_activity) and hands both on: to a JobModel in this process (a job of one
/// rank: baton-train --dashboard) or over the control plane to the launcher's model (a job of
/// many ranks: baton-launch --dashboard). The actors count from their own threads with
/// relaxed atomics; the collector only reads.
///
///   baton::observe::JobModel model;
///   baton::observe::Collector collector;
///   collector.feed(model);                               // one rank: straight into the model
///   baton::JobSettings js;
///   js.observer = &collector;
///   js.runtime.activity_log = true;                      // for the pipeline timeline
///   baton::run_job(plan, kernels, env, js);              // the training loop calls
///                                                        // collector.record_step(...) per step
///
/// The activity log has one reader: while a collector runs, nothing else may call
/// drain_activity. Another consumer of the act records (the trace recorder) registers an
/// activity sink instead and gets every drained batch, on the collector's thread.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "baton/actors/activity.h"
#include "baton/actors/job.h"
#include "baton/observe/telemetry.h"

namespace baton::observe {

class JobModel;

struct CollectorSettings {
  /// Between two samples of the counters: 2 Hz, as the dashboard updates.
  std::chrono::milliseconds interval{500};
  /// Between two drains of the activity log: more often than samples, so that a busy worker's
  /// ring (64 Ki records) does not overflow between two (a full ring drops the newest acts).
  std::chrono::milliseconds drain_interval{100};
  /// Aggregate the activity log into the pipeline timeline's boxes and send them (needs
  /// RuntimeSettings::activity_log on; without it there is simply nothing to drain).
  bool timeline = true;
  /// Timeline boxes sent per sample at most (the newest are kept): bounds the message size
  /// when micro-batches are tiny.
  std::size_t max_boxes_per_sample = 2048;
  /// Steps' scalars sent per sample at most (the newest are kept).
  std::size_t max_steps_per_sample = 4096;
  /// In a job of many ranks, send the telemetry to the rendezvous server (the launcher's
  /// dashboard), as well as to what feed() named.
  bool send_to_control = true;
};

/// Gets every batch of act records the collector drains, on the collector's thread, with the
/// runtime they came from (its plan and worker_names). Keep it short.
using ActivitySink = std::function<void(const std::vector<ActRecord>& records, const Runtime& runtime)>;
/// Where the telemetry goes: (kind, JSON body), as transport::ControlClient::send_telemetry.
using TelemetrySink = std::function<void(const std::string& kind, const std::string& body)>;

class Collector : public JobObserver {
 public:
  explicit Collector(CollectorSettings settings = {});
  ~Collector() override;
  Collector(const Collector&) = delete;
  Collector& operator=(const Collector&) = delete;

  /// Also sends to this model (not owned; must outlive the run): a dashboard in this process.
  /// Call before the run.
  void feed(JobModel& model);
  /// Also sends to this function (tests). Call before the run.
  void feed(TelemetrySink sink);
  /// Another consumer of the act records (see the file comment). Call before the run.
  void add_activity_sink(ActivitySink sink);
  /// Any thread, any time: the training program reports a finished step. Cheap (a lock and a
  /// push); the scalars go out with the next sample.
  void record_step(const StepScalars& step);
  /// Runs `hook` on the collector's thread before each sample, the last one (in on_finish,
  /// while the control plane is still up) included: where a training program that polls its
  /// loss log calls record_step, so that the last steps go out too. Call before the run.
  void before_sample(std::function<void()> hook);

  /// After the run: sends the steps recorded since its end to what feed() named (the control
  /// plane is gone by then).
  void flush();

  void on_start(Runtime& runtime, transport::ControlClient* control) override;
  void on_finish(Runtime& runtime, const std::string& error) override;

  /// Samples taken so far (for tests and the benchmark).
  std::uint64_t samples() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::observe
