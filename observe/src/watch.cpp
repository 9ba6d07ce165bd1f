#include "baton/observe/watch.h"

#include <cstdlib>
#include <cstring>
#include <thread>

#include "baton/observe/dashboard.h"
#include "baton/observe/job_model.h"

namespace baton::observe {

bool WatchSettings::launcher_wants_telemetry() {
  const char* v = std::getenv(dashboard_env);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

struct Watch::Impl {
  WatchSettings settings;
  // The server reads the model: declared after it, so that it stops first.
  std::unique_ptr<JobModel> model;
  std::unique_ptr<DashboardServer> server;
  Collector collector;

  explicit Impl(WatchSettings s) : settings(std::move(s)), collector([&] {
    CollectorSettings c = settings.collector;
    c.send_to_control = settings.to_launcher;
    return c;
  }()) {}
};

Watch::Watch(WatchSettings settings) : impl_(std::make_unique<Impl>(std::move(settings))) {
  Impl& s = *impl_;
  if (!s.settings.listen.empty()) {
    s.model = std::make_unique<JobModel>(JobModelSettings{.title = s.settings.title});
    s.server = std::make_unique<DashboardServer>(*s.model, DashboardSettings{.listen = s.settings.listen});
    s.collector.feed(*s.model);
  }
}

Watch::~Watch() = default;

bool Watch::active() const { return impl_->server != nullptr || impl_->settings.to_launcher; }
bool Watch::serving() const { return impl_->server != nullptr; }
std::string Watch::url() const { return impl_->server ? impl_->server->url() : std::string(); }

void Watch::add_activity_sink(ActivitySink sink) { impl_->collector.add_activity_sink(std::move(sink)); }

void Watch::attach(JobSettings& js) {
  if (!active()) return;
  js.observer = &impl_->collector;
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
