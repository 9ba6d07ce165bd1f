// run_job: control plane + data plane + runtime for one rank of a job.
#include "baton/actors/job.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <mutex>

#include <fmt/format.h>

#include "baton/kernels/store.h"
#include "baton/transport/control.h"

namespace baton {

namespace {

/// The job's shared values, through the rendezvous server (ControlClient::publish / fetch).
class ControlStore final : public Store {
 public:
  explicit ControlStore(transport::ControlClient& control) : control_(control) {}
  void set(const std::string& key, const std::string& value) override { control_.publish(key, value); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    return control_.fetch(key, timeout);
  }

 private:
  transport::ControlClient& control_;
};

std::uint32_t parse_number(const char* var, const char* text) {
  char* end = nullptr;
  errno = 0;
  unsigned long v = std::strtoul(text, &end, 10);
  if (*text == '\0' || *end != '\0' || errno != 0 || v > 65535 || text[0] == '-') {
    throw std::invalid_argument(fmt::format("{}='{}' is not a number from 0 to 65535", var, text));
  }
  return static_cast<std::uint32_t>(v);
}

}  // namespace

JobEnvironment JobEnvironment::from_env() {
  JobEnvironment env;
  const char* world = std::getenv("BATON_WORLD_SIZE");
  if (world == nullptr) return env;
  env.world_size = parse_number("BATON_WORLD_SIZE", world);
  if (env.world_size < 1) throw std::invalid_argument("BATON_WORLD_SIZE='0': a job has at least one rank");
  auto need = [](const char* var) {
    const char* v = std::getenv(var);
    if (v == nullptr || *v == '\0') {
      throw std::invalid_argument(fmt::format("{} is not set: BATON_WORLD_SIZE is, so this is one rank of a job "
                                              "(start it with baton-launch)",
                                              var));
    }
    return v;
  };
  env.rank = parse_number("BATON_RANK", need("BATON_RANK"));
  if (env.rank >= env.world_size) {
    throw std::invalid_argument(fmt::format("BATON_RANK={} but BATON_WORLD_SIZE={}", env.rank, env.world_size));
  }
  if (const char* local = std::getenv("BATON_LOCAL_RANK")) env.local_rank = parse_number("BATON_LOCAL_RANK", local);
  if (const char* local = std::getenv("BATON_LOCAL_WORLD_SIZE")) {
    env.local_world_size = parse_number("BATON_LOCAL_WORLD_SIZE", local);
    if (env.local_world_size > env.world_size) {
      throw std::invalid_argument(fmt::format("BATON_LOCAL_WORLD_SIZE={} but BATON_WORLD_SIZE={}",
                                              env.local_world_size, env.world_size));
    }
  }
  if (env.world_size > 1) {
    env.master = need("BATON_MASTER");
    env.token = need("BATON_JOB_TOKEN");
  }
  return env;
}

transport::DataPlaneSettings data_plane_for_job(const JobEnvironment& env, transport::DataPlaneSettings base,
                                                std::string* why) {
  if (base.transports.empty() && std::getenv("UCX_TLS") == nullptr && env.world_size > 1 &&
      env.local_world_size == env.world_size) {
    base.transports = "^cma,tcp";
    if (why != nullptr) *why = " (every rank on this host)";
  }
  return base;
}

RunReport run_job(const Plan& logical, const KernelRegistry& kernels, const JobEnvironment& env, JobSettings js) {
  const Plan plan = insert_transfers(logical);
  for (const auto& a : plan.actors) {
    if (a.where.rank >= env.world_size) {
      throw PlanError(fmt::format("invalid plan: actor '{}' is placed on rank {} but the job has {} rank{} "
                                  "(start it with baton-launch --nproc-per-node {} or more)",
                                  a.name, a.where.rank, env.world_size, env.world_size == 1 ? "" : "s",
                                  a.where.rank + 1));
    }
  }
  if (!env.distributed()) {
    Runtime rt(plan, kernels, js.runtime);
    if (js.observer == nullptr) return rt.run();
    js.observer->on_start(rt, nullptr);
    RunReport report;
    try {
      report = rt.run();
    } catch (const std::exception& e) {
      js.observer->on_finish(rt, e.what());
      throw;
    }
    js.observer->on_finish(rt, {});
    return report;
  }

  // Declared in this order so that they go in the reverse one: the data plane stops (no more
  // calls into the runtime) before the control client closes, and both before the runtime.
  std::mutex mutex;
  std::unique_ptr<Runtime> runtime;
  std::string early_abort;
  transport::ControlClient control(transport::ClientSettings{.master = env.master,
                                                             .token = env.token,
                                                             .rank = env.rank,
                                                             .world_size = env.world_size,
                                                             .join_timeout = js.join_timeout});
  control.on_abort([&](const std::string& reason) {
    std::lock_guard lock(mutex);
    if (runtime) {
      runtime->abort("job aborted: " + reason);
    } else {
      early_abort = reason;
    }
  });
  if (js.observer != nullptr) {
    control.on_command([observer = js.observer](const std::string& kind, const std::string& body) {
      observer->on_command(kind, body);
    });
  }
  // Kernels publish while the runtime is built (an NCCL group's unique id), before the start
  // barrier, and fetch once running; the runtime uses it no more once run() returns.
  ControlStore store(control);
  std::string why_transports;
  js.data = data_plane_for_job(env, js.data, &why_transports);
  std::string data_plane_config;
  for (const auto& [name, value] : transport::ucx_configuration(js.data)) {
    data_plane_config += fmt::format("{}{}={}", data_plane_config.empty() ? "" : ", ", name, value);
  }
  if (data_plane_config.empty()) data_plane_config = "as the UCX_ environment variables say";
  transport::DataPlane data(env.rank, env.world_size, js.data);
  // An empty host: join() names this machine.
  const auto table = control.join(transport::RankInfo{env.rank, {}, data.address(), plan.hash()});

  try {
    js.runtime.rank = static_cast<std::uint16_t>(env.rank);
    js.runtime.link = &data;
    js.runtime.store = &store;
    if (js.runtime.ranks_on_host == 0) {
      const std::string& here = table.at(env.rank).host;
      js.runtime.ranks_on_host = static_cast<std::uint32_t>(
          std::count_if(table.begin(), table.end(), [&](const transport::RankInfo& r) { return r.host == here; }));
    }
    auto rt = std::make_unique<Runtime>(plan, kernels, js.runtime);
    std::lock_guard lock(mutex);
    runtime = std::move(rt);
    if (!early_abort.empty()) throw JobError("job aborted: " + early_abort);
  } catch (const std::exception& e) {
    control.fail(e.what());
    throw;
  }
  std::vector<std::string> addresses;
  for (const auto& info : table) addresses.push_back(info.data_address);
  try {
    data.connect(addresses);
    data.start();
  } catch (const std::exception& e) {
    control.fail(fmt::format("data plane: {}", e.what()));
    throw;
  }
  control.barrier("start", js.start_timeout);
  if (js.observer != nullptr) js.observer->on_start(*runtime, &control);
  RunReport report;
  try {
    report = runtime->run();
  } catch (const std::exception& e) {
    if (js.observer != nullptr) js.observer->on_finish(*runtime, e.what());
    control.fail(e.what());
    data.stop();
    throw;
  }
  report.data_plane = data_plane_config + why_transports;
  if (js.observer != nullptr) js.observer->on_finish(*runtime, {});
  // The others may still need our acks: the data plane keeps going until every rank is done.
  control.finish(js.finish_timeout);
  data.stop();
  return report;
}

}  // namespace baton
