#include "baton/observe/watch.h"

#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "baton/observe/dashboard.h"
#include "baton/observe/job_model.h"
#include "baton/observe/trace.h"
#include "baton/transport/control.h"

namespace baton::observe {

bool WatchSettings::launcher_wants_telemetry() {
  const char* v = std::getenv(dashboard_env);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

struct Watch::Impl {
  WatchSettings settings;
  // The page's "record N seconds": a tracer that records only when asked, fed by the
  // collector's drain. Here its parts go to a collector in this process; for a launcher's page,
  // over the control plane (the launcher asks with a server command).
  TraceCollector traces;
  std::unique_ptr<TraceObserver> tracer;
  std::unique_ptr<TraceOnDemand> on_demand;
  // The server reads the model and records traces: declared after them, so that it stops first.
  std::unique_ptr<JobModel> model;
  std::unique_ptr<DashboardServer> server;
  Collector collector;
  std::unique_ptr<JobObservers> observers;

  explicit Impl(WatchSettings s) : settings(std::move(s)), collector([&] {
    CollectorSettings c = settings.collector;
    c.send_to_control = settings.to_launcher;
    return c;
  }()) {}
};

Watch::Watch(WatchSettings settings) : impl_(std::make_unique<Impl>(std::move(settings))) {
  Impl& s = *impl_;
  if (!s.settings.listen.empty()) {
    TraceOptions topt;
    topt.whole_run = false;
    topt.drain = false;
    topt.send = [&traces = s.traces](const std::string& body) {
      traces.on_telemetry(transport::Telemetry{0, std::string(trace_kind), body});
    };
    s.tracer = std::make_unique<TraceObserver>(topt);
    s.on_demand = std::make_unique<TraceOnDemand>(
        s.traces,
        [tracer = s.tracer.get()](std::uint32_t session, double seconds) {
          tracer->on_command(trace_kind, fmt::format(R"({{"session": {}, "seconds": {}}})", session, seconds));
        },
        1);
    s.model = std::make_unique<JobModel>(JobModelSettings{.title = s.settings.title});
    DashboardSettings ds{.listen = s.settings.listen};
    ds.trace = [od = s.on_demand.get()](double seconds, std::function<void(bool, std::string)> done) {
      od->record(seconds, std::move(done));
    };
    s.server = std::make_unique<DashboardServer>(*s.model, std::move(ds));
    s.collector.feed(*s.model);
  } else if (s.settings.to_launcher) {
    TraceOptions topt;
    topt.whole_run = false;
    topt.drain = false;
    s.tracer = std::make_unique<TraceObserver>(topt);
  }
  if (s.tracer) {
    s.collector.add_activity_sink([tracer = s.tracer.get()](const std::vector<ActRecord>& records, const Runtime& rt) {
      tracer->consume(records, rt);
    });
    s.observers = std::make_unique<JobObservers>(std::vector<JobObserver*>{&s.collector, s.tracer.get()});
  }
}

Watch::~Watch() = default;

bool Watch::active() const { return impl_->server != nullptr || impl_->settings.to_launcher; }
bool Watch::serving() const { return impl_->server != nullptr; }
std::string Watch::url() const { return impl_->server ? impl_->server->url() : std::string(); }

void Watch::add_activity_sink(ActivitySink sink) { impl_->collector.add_activity_sink(std::move(sink)); }

void Watch::attach(JobSettings& js) {
  if (!active()) return;
  js.observer = impl_->observers ? static_cast<JobObserver*>(impl_->observers.get()) : &impl_->collector;
  js.runtime.activity_log = true;
}

void Watch::record_step(const StepScalars& step) {
  if (active()) impl_->collector.record_step(step);
}

void Watch::before_sample(std::function<void()> poll) {
  if (active()) impl_->collector.before_sample(std::move(poll));
}

void Watch::finish() { impl_->collector.flush(); }

void Watch::linger(std::chrono::milliseconds how_long) {
  if (serving()) std::this_thread::sleep_for(how_long);
}

}  // namespace baton::observe
