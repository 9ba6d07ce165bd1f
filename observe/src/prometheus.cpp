// /metrics: the job model in the Prometheus text exposition format, version 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/). Labels stay bounded: rank,
// host, actor, op, role, state, register: all fixed by the plan; never a piece number.
#include <cmath>

#include <fmt/format.h>

#include "job_model_impl.h"

namespace baton::observe::detail {

namespace {

/// Label values escape backslash, double quote and line feed.
std::string escape(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

/// Sample values: Go's float formatting accepts NaN and +Inf / -Inf spelled this way.
std::string value(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", x);
}

class Writer {
 public:
  /// Starts a metric family: its HELP and TYPE lines.
  void family(std::string_view name, std::string_view type, std::string_view help) {
    out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    name_ = name;
  }
  /// One sample of the current family; labels as (name, value) pairs.
  void sample(std::initializer_list<std::pair<std::string_view, std::string_view>> labels, double v) {
    out_ += name_;
    if (labels.size() != 0) {
      out_ += '{';
      bool first = true;
      for (const auto& [k, val] : labels) {
        if (!first) out_ += ',';
        first = false;
        out_ += fmt::format("{}=\"{}\"", k, escape(val));
      }
      out_ += '}';
    }
    out_ += ' ';
    out_ += value(v);
    out_ += '\n';
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
  std::string name_;
};

constexpr std::array<const char*, 4> states = {"busy", "starved", "backpressured", "transferring"};

}  // namespace

std::string Model::prometheus() const {
  Writer w;
  const double now = now_s();
  w.family("baton_job_world_size", "gauge", "Ranks in the job.");
  w.sample({}, world_size());
  w.family("baton_job_ranks_reporting", "gauge", "Ranks that have sent telemetry.");
  w.sample({}, static_cast<double>(std::count_if(ranks.begin(), ranks.end(), [](const auto& r) { return r.hello; })));
  w.family("baton_job_running", "gauge", "1 while the job runs, else 0.");
  w.sample({}, status() == JobStatus::running ? 1 : 0);
  w.family("baton_job_failed", "gauge", "1 once the job has failed, else 0.");
  w.sample({}, status() == JobStatus::failed ? 1 : 0);
  w.family("baton_telemetry_bad_messages_total", "counter", "Telemetry messages the dashboard could not read.");
  w.sample({}, static_cast<double>(bad_messages));

  // Per rank.
  struct RankLabels {
    std::string rank, host;
  };
  std::vector<RankLabels> rl(ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i) rl[i] = {std::to_string(i), host_of(static_cast<std::uint32_t>(i))};
  auto each_rank = [&](auto&& fn) {
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].samples_complete > 0) fn(ranks[i], rl[i]);
    }
  };
  w.family("baton_rank_last_seen_seconds", "gauge", "Seconds since the rank's last telemetry.");
  each_rank([&](const RankState& r, const RankLabels& l) { w.sample({{"rank", l.rank}, {"host", l.host}}, now - r.last_seen_s); });
  w.family("baton_rank_elapsed_seconds", "gauge", "Seconds the rank's runtime has been running.");
  each_rank([&](const RankState& r, const RankLabels& l) { w.sample({{"rank", l.rank}, {"host", l.host}}, r.elapsed_s); });
  w.family("baton_rank_acts_per_second", "gauge", "Acts per second of all the rank's actors, over the last interval.");
  each_rank([&](const RankState& r, const RankLabels& l) { w.sample({{"rank", l.rank}, {"host", l.host}}, r.acts_per_s); });
  w.family("baton_rank_time_share", "gauge",
           "Share of the rank's actors' time over the last interval, by state (sums to 1).");
  each_rank([&](const RankState& r, const RankLabels& l) {
    for (std::size_t b = 0; b < 4; ++b) w.sample({{"rank", l.rank}, {"host", l.host}, {"state", states[b]}}, r.shares[b]);
  });
  w.family("baton_rank_samples_per_second", "gauge", "Training samples per second (the job's), over the last seconds.");
  each_rank([&](const RankState& r, const RankLabels& l) { w.sample({{"rank", l.rank}, {"host", l.host}}, r.samples_per_s); });
  w.family("baton_rank_step_seconds", "gauge", "Seconds per optimizer step, over the last seconds.");
  each_rank([&](const RankState& r, const RankLabels& l) { w.sample({{"rank", l.rank}, {"host", l.host}}, r.step_time_s); });
  w.family("baton_train_step", "gauge", "The last finished optimizer step.");
  each_rank([&](const RankState& r, const RankLabels& l) { w.sample({{"rank", l.rank}, {"host", l.host}}, static_cast<double>(r.step)); });
  w.family("baton_train_samples_total", "counter", "Training samples consumed by the job.");
  each_rank([&](const RankState& r, const RankLabels& l) { w.sample({{"rank", l.rank}, {"host", l.host}}, static_cast<double>(r.samples)); });
  w.family("baton_train_loss", "gauge", "The loss of the last finished step.");
  each_rank([&](const RankState& r, const RankLabels& l) {
    if (r.step > 0) w.sample({{"rank", l.rank}, {"host", l.host}}, r.loss);
  });
  w.family("baton_train_learning_rate", "gauge", "The learning rate of the last finished step.");
  each_rank([&](const RankState& r, const RankLabels& l) {
    if (r.step > 0) w.sample({{"rank", l.rank}, {"host", l.host}}, r.lr);
  });
  w.family("baton_activity_dropped_total", "counter", "Act records lost because an activity ring was full.");
  each_rank([&](const RankState& r, const RankLabels& l) { w.sample({{"rank", l.rank}, {"host", l.host}}, static_cast<double>(r.dropped)); });

  // Per actor.
  struct ActorLabels {
    std::string name, op, role;
  };
  std::vector<ActorLabels> al(actors.size());
  for (std::size_t i = 0; i < actors.size(); ++i) {
    al[i].name = actor_name(i);
    if (i < plan.actors.size()) {
      al[i].op = plan.actors[i].op;
      al[i].role = plan.actors[i].role;
    }
  }
  auto each_actor = [&](auto&& fn) {
    for (std::size_t i = 0; i < actors.size(); ++i) {
      if (!actors[i].seen) continue;
      const auto r = actors[i].rank;
      fn(actors[i], al[i], rl[r]);
    }
  };
#define BATON_ACTOR_LABELS {"rank", r.rank}, {"host", r.host}, {"actor", l.name}, {"op", l.op}, {"role", l.role}
  w.family("baton_actor_acts_total", "counter", "Acts of the actor (kernel runs, transfers).");
  each_actor([&](const ActorState& a, const ActorLabels& l, const RankLabels& r) {
    w.sample({BATON_ACTOR_LABELS}, static_cast<double>(a.now.acts));
  });
  w.family("baton_actor_bytes_in_total", "counter", "Bytes the actor read.");
  each_actor([&](const ActorState& a, const ActorLabels& l, const RankLabels& r) {
    w.sample({BATON_ACTOR_LABELS}, static_cast<double>(a.now.bytes_in));
  });
  w.family("baton_actor_bytes_out_total", "counter", "Bytes the actor wrote.");
  each_actor([&](const ActorState& a, const ActorLabels& l, const RankLabels& r) {
    w.sample({BATON_ACTOR_LABELS}, static_cast<double>(a.now.bytes_out));
  });
  w.family("baton_actor_seconds_total", "counter",
           "The actor's time by state: busy, starved (waiting for input), backpressured (waiting for a free "
           "output slot), transferring (waiting for data from another rank).");
  each_actor([&](const ActorState& a, const ActorLabels& l, const RankLabels& r) {
    for (std::size_t b = 0; b < 4; ++b) w.sample({BATON_ACTOR_LABELS, {"state", states[b]}}, a.now.time[b]);
  });
  w.family("baton_actor_kernel_seconds_total", "counter", "The part of busy time spent inside the kernel.");
  each_actor([&](const ActorState& a, const ActorLabels& l, const RankLabels& r) {
    w.sample({BATON_ACTOR_LABELS}, a.now.kernel);
  });
  w.family("baton_actor_time_share", "gauge",
           "Share of the last interval's wall time by state; retired: the part after the actor finished.");
  each_actor([&](const ActorState& a, const ActorLabels& l, const RankLabels& r) {
    for (std::size_t b = 0; b < 4; ++b) w.sample({BATON_ACTOR_LABELS, {"state", states[b]}}, a.share(b));
    w.sample({BATON_ACTOR_LABELS, {"state", "retired"}}, a.retired_share());
  });
  w.family("baton_actor_acts_per_second", "gauge", "Acts per second over the last interval.");
  each_actor([&](const ActorState& a, const ActorLabels& l, const RankLabels& r) {
    w.sample({BATON_ACTOR_LABELS}, a.acts_per_s);
  });
#undef BATON_ACTOR_LABELS

  // Per register (an output of an actor).
  auto each_register = [&](auto&& fn) {
    for (std::size_t i = 0; i < registers.size(); ++i) {
      if (!registers[i].seen) continue;
      const PlanRegister* p = i < plan.registers.size() ? &plan.registers[i] : nullptr;
      const std::string producer =
          p != nullptr && p->producer >= 0 ? actor_name(static_cast<std::size_t>(p->producer)) : std::string();
      fn(registers[i], register_name(i), producer, rl[registers[i].rank]);
    }
  };
#define BATON_REGISTER_LABELS {"rank", r.rank}, {"host", r.host}, {"actor", producer}, {"register", reg}
  w.family("baton_register_slots", "gauge", "Slots (buffers) of the register: the depth of its pipe.");
  each_register([&](const RegisterState& g, const std::string& reg, const std::string& producer, const RankLabels& r) {
    w.sample({BATON_REGISTER_LABELS}, g.slots);
  });
  w.family("baton_register_slots_in_use", "gauge", "Slots written and not yet freed by every consumer.");
  each_register([&](const RegisterState& g, const std::string& reg, const std::string& producer, const RankLabels& r) {
    w.sample({BATON_REGISTER_LABELS}, static_cast<double>(g.written - g.freed));
  });
  w.family("baton_register_slots_in_use_max", "gauge", "The most slots ever in use at once.");
  each_register([&](const RegisterState& g, const std::string& reg, const std::string& producer, const RankLabels& r) {
    w.sample({BATON_REGISTER_LABELS}, g.max_outstanding);
  });
  w.family("baton_register_pieces_written_total", "counter", "Pieces written into the register.");
  each_register([&](const RegisterState& g, const std::string& reg, const std::string& producer, const RankLabels& r) {
    w.sample({BATON_REGISTER_LABELS}, static_cast<double>(g.written));
  });
#undef BATON_REGISTER_LABELS
  return w.take();
}

}  // namespace baton::observe::detail
