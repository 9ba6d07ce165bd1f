// run_job: control plane + data plane + runtime for one rank of a job.
#include "baton/actors/job.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <tuple>

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
  if (const char* bind = std::getenv("BATON_BIND_TO"); bind != nullptr && *bind != '\0') {
    const std::string b = bind;
    if (b != "core" && b != "none") {
      throw std::invalid_argument(fmt::format("BATON_BIND_TO='{}': 'core' or 'none'", b));
    }
    env.bind_to_core = b == "core";
  }
  if (const char* shared = std::getenv("BATON_SHARED_REGISTERS"); shared != nullptr && *shared != '\0') {
    const std::string s = shared;
    if (s != "0" && s != "1") throw std::invalid_argument(fmt::format("BATON_SHARED_REGISTERS='{}': 0 or 1", s));
    env.shared_registers = s == "1";
  }
  if (const char* hold = std::getenv("BATON_HOLD_MESSAGES_NS"); hold != nullptr && *hold != '\0') {
    env.hold_messages_ns = parse_number("BATON_HOLD_MESSAGES_NS", hold);
  }
  if (const char* back = std::getenv("BATON_REJOIN"); back != nullptr && *back != '\0') {
    const std::string b = back;
    if (b != "0" && b != "1") throw std::invalid_argument(fmt::format("BATON_REJOIN='{}': 0 or 1", b));
    env.rejoin = b == "1";
  }
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

namespace {

/// "0-3,6": a sorted list of cpu numbers, in ranges.
std::string cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    out += fmt::format("{}{}", out.empty() ? "" : ",", i == j ? fmt::format("{}", cpus[i])
                                                              : fmt::format("{}-{}", cpus[i], cpus[j]));
    i = j + 1;
  }
  return out;
}

}  // namespace

std::vector<std::uint32_t> JobEnvironment::rank_hosts() const {
  if (local_world_size == 0 || world_size % local_world_size != 0) return {};
  std::vector<std::uint32_t> hosts;
  for (std::uint32_t r = 0; r < world_size; ++r) hosts.push_back(r / local_world_size);
  return hosts;
}

std::string bind_to_cores(const JobEnvironment& env, std::uint32_t* own_cores) {
  if (own_cores != nullptr) *own_cores = 0;
  if (!env.bind_to_core) return {};
  if (env.local_world_size == 0) return "not bound: BATON_LOCAL_WORLD_SIZE is not set";
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
    return fmt::format("not bound: sched_getaffinity: {}", std::strerror(errno));
  }
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  const std::size_t n = env.local_world_size;
  const std::size_t local = env.local_rank % n;
  std::vector<int> mine;
  if (cpus.size() >= n) {  // an even share; the first cpus.size() % n ranks get one more
    const std::size_t share = cpus.size() / n, extra = cpus.size() % n;
    const std::size_t begin = local * share + std::min(local, extra);
    mine.assign(cpus.begin() + static_cast<std::ptrdiff_t>(begin),
                cpus.begin() + static_cast<std::ptrdiff_t>(begin + share + (local < extra ? 1 : 0)));
  } else {  // more ranks than cores: they share, round robin
    mine.push_back(cpus[local % cpus.size()]);
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : mine) CPU_SET(c, &set);
  // Every thread the process has now (a BLAS pool, the control client's), and through the
  // calling thread those it starts later.
  std::size_t threads = 0;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    const pid_t tid = static_cast<pid_t>(std::strtol(task.path().filename().c_str(), nullptr, 10));
    if (tid > 0 && sched_setaffinity(tid, sizeof set, &set) == 0) ++threads;
  }
  if (sched_setaffinity(0, sizeof set, &set) != 0) {
    return fmt::format("not bound: sched_setaffinity: {}", std::strerror(errno));
  }
  if (own_cores != nullptr && cpus.size() >= n) *own_cores = static_cast<std::uint32_t>(mine.size());
  return fmt::format("cores {} of {}, local rank {} of {}{} ({} threads)", cpu_list(mine), cpu_list(cpus),
                     env.local_rank, n, cpus.size() < n ? ", more ranks than cores" : "", std::max<std::size_t>(threads, 1));
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

namespace {

RunReport run_alone(const Plan& plan, const KernelRegistry& kernels, const JobSettings& js) {
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

/// What the control client's thread reaches of a rank's job (under `mutex`): the runtime once
/// built, what came before it (an abort, departures), and the data plane while it lives.
struct Reachable {
  std::mutex mutex;
  std::unique_ptr<Runtime> runtime;
  std::string early_abort;
  std::vector<std::pair<std::uint32_t, std::string>> early_left;
  transport::DataPlane* data = nullptr;

  Runtime& running(std::uint32_t rank) {
    if (!runtime) throw JobError(fmt::format("rank {} is not running yet", rank));
    return *runtime;
  }
};

/// How long this rank's actors may take to hold for a rank coming back, or to take it back: well
/// under the heartbeat timeout, as the control client's thread waits for them.
constexpr std::chrono::milliseconds answer_within{3'000};

/// The control plane's news for this rank: an abort, a rank that left or comes back, commands.
void listen(transport::ControlClient& control, Reachable& at, const JobSettings& js, std::uint32_t me) {
  control.on_abort([&at](const std::string& reason) {
    std::lock_guard lock(at.mutex);
    if (at.runtime) {
      at.runtime->abort("job aborted: " + reason);
    } else {
      at.early_abort = reason;
    }
  });
  control.on_left([&at, on_left = js.on_left](std::uint32_t rank, const std::string& reason) {
    {
      std::lock_guard lock(at.mutex);
      if (at.runtime) {
        at.runtime->rank_left(rank, reason);
      } else {
        at.early_left.emplace_back(rank, reason);
      }
    }
    if (on_left) on_left(rank, reason);
  });
  // Another rank comes back (ControlClient::rejoin): hold, then take it back (bounded by
  // answer_within: these run on the control client's thread).
  control.on_rejoin(transport::RejoinHandlers{
      .hold = [&at, me](std::uint32_t rank) {
        std::lock_guard lock(at.mutex);
        return at.running(me).hold_for_rejoin(rank, answer_within);
      },
      .rejoined = [&at, me, on_rejoined = js.on_rejoined](const transport::RankInfo& info, std::int64_t step) {
        {
          std::lock_guard lock(at.mutex);
          Runtime& rt = at.running(me);
          if (at.data != nullptr) at.data->reconnect(info.rank, info.data_address);
          rt.rank_rejoined(info.rank, step, answer_within);
        }
        if (on_rejoined) on_rejoined(info.rank, step);
      },
      .release = [&at](std::uint32_t rank) {
        std::lock_guard lock(at.mutex);
        if (at.runtime) at.runtime->release_hold(rank);
      },
  });
  if (js.observer != nullptr) {
    control.on_command([observer = js.observer](const std::string& kind, const std::string& body) {
      observer->on_command(kind, body);
    });
  }
}

/// "TLS=^cma, RNDV_THRESH=..." (RunReport::data_plane).
std::string describe_data_plane(const transport::DataPlaneSettings& data) {
  std::string config;
  for (const auto& [name, value] : transport::ucx_configuration(data)) {
    config += fmt::format("{}{}={}", config.empty() ? "" : ", ", name, value);
  }
  return config.empty() ? "as the UCX_ environment variables say" : config;
}

/// What the rank runs: the plan it was given, or (a rank coming back, BATON_REJOIN=1) the plan
/// from the step the others hold at, compiled while they wait. Fills `table` with every rank's
/// RankInfo and js.runtime.rejoin_step.
std::pair<const Plan*, const KernelRegistry*> join(transport::ControlClient& control, const transport::RankInfo& me,
                                                   const JobEnvironment& env, JobSettings& js, const Plan& plan,
                                                   const KernelRegistry& kernels, Plan& rejoined,
                                                   std::vector<transport::RankInfo>& table) {
  if (!env.rejoin) {
    table = control.join(me);
    return {&plan, &kernels};
  }
  if (!js.rejoin_plan) {
    throw JobError(fmt::format("rank {} was started to come back to its job (BATON_REJOIN=1), which this program "
                               "cannot do",
                               env.rank));
  }
  std::int64_t step = 0;
  std::tie(table, step) = control.rejoin(me);
  try {
    auto [logical_back, kernels_back] = js.rejoin_plan(step);
    rejoined = insert_transfers(logical_back);
    js.runtime.rejoin_step = step;
    return {&rejoined, kernels_back};
  } catch (const std::exception& e) {
    control.fail(fmt::format("could not come back at step {}: {}", step, e.what()));
    throw;
  }
}

/// The runtime's settings that the job's table decides.
void settle(RuntimeSettings& rs, const JobEnvironment& env, const std::vector<transport::RankInfo>& table) {
  rs.rank = static_cast<std::uint16_t>(env.rank);
  if (!env.shared_registers) rs.shared_registers = false;
  if (env.hold_messages_ns) rs.hold_messages_ns = *env.hold_messages_ns;
  for (const auto& info : table) {
    if (info.may_leave) rs.may_leave.push_back(info.rank);
  }
  if (rs.ranks_on_host == 0) {
    const std::string& here = table.at(env.rank).host;
    rs.ranks_on_host = static_cast<std::uint32_t>(
        std::count_if(table.begin(), table.end(), [&](const transport::RankInfo& r) { return r.host == here; }));
  }
}

}  // namespace

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
  if (!env.distributed()) return run_alone(plan, kernels, js);

  // Declared in this order so that they go in the reverse one: the data plane stops (no more
  // calls into the runtime) before the control client closes, and both before the runtime.
  Reachable at;
  transport::ControlClient control(transport::ClientSettings{.master = env.master,
                                                             .token = env.token,
                                                             .rank = env.rank,
                                                             .world_size = env.world_size,
                                                             .join_timeout = js.join_timeout});
  listen(control, at, js, env.rank);
  // Kernels publish while the runtime is built (an NCCL group's unique id), before the start
  // barrier, and fetch once running; the runtime uses it no more once run() returns.
  ControlStore store(control);
  std::uint32_t own_cores = 0;
  const std::string binding = bind_to_cores(env, &own_cores);
  if (js.runtime.own_cores == 0) js.runtime.own_cores = own_cores;
  std::string why_transports;
  js.data = data_plane_for_job(env, js.data, &why_transports);
  const std::string data_plane_config = describe_data_plane(js.data) + why_transports;
  transport::DataPlane data_plane(env.rank, env.world_size, js.data);
  // The control client's thread reaches the data plane until it goes.
  struct Forget {
    Reachable& at;
    ~Forget() {
      std::lock_guard lock(at.mutex);
      at.data = nullptr;
    }
  } forget{at};
  {
    std::lock_guard lock(at.mutex);
    at.data = &data_plane;
  }
  // An empty host: join() names this machine.
  const transport::RankInfo me{
      .rank = env.rank, .data_address = data_plane.address(), .plan_hash = plan.hash(), .may_leave = js.may_leave};
  std::vector<transport::RankInfo> table;
  Plan rejoined;
  const auto [to_run, run_kernels] = join(control, me, env, js, plan, kernels, rejoined, table);
  try {
    settle(js.runtime, env, table);
    js.runtime.link = &data_plane;
    js.runtime.store = &store;
    auto rt = std::make_unique<Runtime>(*to_run, *run_kernels, js.runtime);
    std::lock_guard lock(at.mutex);
    at.runtime = std::move(rt);
    if (!at.early_abort.empty()) throw JobError("job aborted: " + at.early_abort);
    for (const auto& [rank, reason] : at.early_left) at.runtime->rank_left(rank, reason);
  } catch (const std::exception& e) {
    control.fail(e.what());
    throw;
  }
  Runtime& runtime = *at.runtime;
  std::vector<std::string> addresses;
  for (const auto& info : table) addresses.push_back(info.data_address);
  try {
    data_plane.connect(addresses);
    data_plane.start();
  } catch (const std::exception& e) {
    control.fail(fmt::format("data plane: {}", e.what()));
    throw;
  }
  if (env.rejoin) {
    control.ready(js.start_timeout);  // every other rank has taken it back
  } else {
    control.barrier("start", js.start_timeout);
  }
  if (js.observer != nullptr) js.observer->on_start(runtime, &control);
  RunReport report;
  try {
    report = runtime.run();
  } catch (const std::exception& e) {
    if (js.observer != nullptr) js.observer->on_finish(runtime, e.what());
    control.fail(e.what());
    data_plane.stop();
    throw;
  }
  report.data_plane = data_plane_config;
  report.binding = binding;
  if (js.observer != nullptr) js.observer->on_finish(runtime, {});
  // The others may still need our acks: the data plane keeps going until every rank is done.
  control.finish(js.finish_timeout);
  data_plane.stop();
  return report;
}

}  // namespace baton
