#pragma once
/// A training program's dashboard in one object: what baton-train needs from observe/. It
/// serves this process's job (--dashboard HOST:PORT) and/or, when started by
/// `baton-launch --dashboard` (BATON_DASHBOARD in the environment), sends this rank's telemetry
/// to the launcher, which serves the whole job.
///
///   baton::observe::Watch watch({.listen = "127.0.0.1:8080", .title = "mlp on digits"});
///   if (watch.serving()) fmt::print(stderr, "dashboard: {}\n", watch.url());
///   baton::JobSettings js;
///   watch.attach(js);                          // the collector, and the activity log it reads
///   watch.before_sample([&] {                  // on the collector's thread, at 2 Hz
///     for (each step finished since the last call)
///       watch.record_step({.step = s, .loss = l, .lr = lr, .samples = s * batch});
///   });
///   ... run_job(plan, kernels, env, js);
///   watch.finish();                            // after the run
///   watch.linger(std::chrono::seconds(30));    // keep the page up a while
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "baton/actors/job.h"
#include "baton/observe/collector.h"
#include "baton/observe/telemetry.h"

namespace baton::observe {

struct WatchSettings {
  /// Where to serve the page (parse_listen): empty serves nothing.
  std::string listen;
  /// The page's title.
  std::string title = "baton job";
  /// Send telemetry to the launcher; by default, when BATON_DASHBOARD is set to anything but 0.
  bool to_launcher = launcher_wants_telemetry();
  CollectorSettings collector{};

  /// BATON_DASHBOARD is set (and not "0"): baton-launch --dashboard serves this job.
  static bool launcher_wants_telemetry();
};

class Watch {
 public:
  /// Starts the HTTP server if settings.listen is set: throws DashboardError (a bad address, a
  /// port in use) before anything runs.
  explicit Watch(WatchSettings settings);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  /// Something to collect for: a page here or a launcher's.
  bool active() const;
  bool serving() const;
  /// The page's address (empty when not serving).
  std::string url() const;
  /// Makes `js` collect (its observer, and the activity log for the pipeline timeline) when
  /// active(); leaves it alone otherwise.
  void attach(JobSettings& js);
  /// Another reader of the act records the collector drains (a trace recorder: a ring has one
  /// reader). Call before the run.
  void add_activity_sink(ActivitySink sink);
  /// Any thread: a step finished.
  void record_step(const StepScalars& step);
  /// Collector::before_sample: `poll` reports the steps finished so far (with record_step).
  void before_sample(std::function<void()> poll);
  /// After the run: the last steps reach the page.
  void finish();
  /// Keeps serving for `how_long` (returns at once when not serving).
  void linger(std::chrono::milliseconds how_long);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::observe
