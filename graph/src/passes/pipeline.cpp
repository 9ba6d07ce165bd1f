// The pipeline of passes (passes.h) and compile_training, which runs it.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/actors/runtime.h"
#include "baton/graph/passes.h"
#include "baton/graph/schedule.h"
#include "lowering.h"

namespace baton {

namespace passes {

const std::vector<std::string_view>& names() {
  // Device copies before transfers: what crosses ranks from or to a CUDA device is staged
  // through host memory, and the copies say which host register the transfer then reads.
  static const std::vector<std::string_view> all{
      "autodiff",  "sbp",     "stages",         "recompute",     "replicas",  "sync",     "lower", "updates",
      "epilogues", "tp_collectives", "device_copies", "transfers", "nccl_p2p", "segments", "lanes", "memory"};
  return all;
}

void check_config(const TrainConfig& cfg) {
  if (cfg.steps < 1) throw GraphError(fmt::format("steps must be >= 1, not {}", cfg.steps));
  if (cfg.first_step < 0 || cfg.first_step >= cfg.steps) {
    throw GraphError(
        fmt::format("a job of {} steps cannot start after step {}", cfg.steps, cfg.first_step));
  }
  if (cfg.microbatches < 1)
    throw GraphError(fmt::format("microbatches must be >= 1, not {}", cfg.microbatches));
  if (cfg.dp < 1) throw GraphError(fmt::format("dp must be >= 1, not {}", cfg.dp));
  if (cfg.pp < 1) throw GraphError(fmt::format("pp must be >= 1, not {}", cfg.pp));
  const PipelineSchedule schedule = parse_schedule(cfg.schedule);  // throws naming the choices
  if (cfg.virtual_stages < 1) {
    throw GraphError(fmt::format("virtual stages must be >= 1, not {}", cfg.virtual_stages));
  }
  if (cfg.pp > 1) {
    if (std::string why = schedule_refusal(schedule, cfg.pp, cfg.virtual_stages, cfg.microbatches); !why.empty()) {
      throw GraphError(fmt::format("pp {}: {}", cfg.pp, why));
    }
  } else if (cfg.virtual_stages != 1) {
    throw GraphError(fmt::format("virtual stages {} need a pipeline (pp > 1)", cfg.virtual_stages));
  }
  const bool new_schedule = schedule == PipelineSchedule::interleaved || schedule == PipelineSchedule::zb_h1 ||
                            schedule == PipelineSchedule::zb_v;
  if (cfg.pp > 1 && new_schedule && cfg.zero == 3) {
    throw GraphError(fmt::format(
        "schedule '{}' with zero 3: ZeRO 3's gathers are placed for one stage per device; use 1f1b or gpipe with "
        "zero 3, or zero 0-2",
        cfg.schedule));
  }
  if (cfg.recompute != "none" && cfg.recompute != "selective" && cfg.recompute != "full") {
    throw GraphError(fmt::format("recompute '{}': none, selective or full", cfg.recompute));
  }
  if (cfg.memory_budget < 0) throw GraphError(fmt::format("memory budget must be >= 0, not {}", cfg.memory_budget));
  if (cfg.tp < 1) throw GraphError(fmt::format("tp must be >= 1, not {}", cfg.tp));
  if (cfg.collectives != "auto" && cfg.collectives != "actors" && cfg.collectives != "nccl") {
    throw GraphError(fmt::format("collectives '{}': auto, actors or nccl", cfg.collectives));
  }
  if (cfg.grad_compression != "none" && cfg.grad_compression != "bf16" && cfg.grad_compression != "fp16") {
    throw GraphError(fmt::format("grad compression '{}': none, bf16 or fp16", cfg.grad_compression));
  }
  if (cfg.zero < 0 || cfg.zero > 3) throw GraphError(fmt::format("zero {}: 0, 1, 2 or 3", cfg.zero));
  detail::check_sync(cfg);
  if (cfg.zero >= 2 && cfg.grad_compression != "none") {
    throw GraphError(fmt::format(
        "grad compression '{0}' with zero {1}: the reduce-scattered shards would be in {0}; use "
        "zero 1 (which all-reduces in {0}) or no compression",
        cfg.grad_compression, cfg.zero));
  }
  if (cfg.balance != "flops" && cfg.balance != "profile") {
    throw GraphError(fmt::format("balance '{}': flops or profile", cfg.balance));
  }
  if (cfg.pp > 1 && cfg.balance == "profile" &&
      std::any_of(cfg.replica_places.begin(), cfg.replica_places.end(),
                  [](const Placement& p) { return p.rank != 0; })) {
    // Timings differ from rank to rank, and so would the plans (whose hashes must match).
    throw GraphError(
        "balance 'profile' times the kernels on this process, so ranks would cut the stages "
        "differently; "
        "use 'flops' for a job over several ranks");
  }
  const int n_places = cfg.dp * cfg.pp * cfg.tp;
  if (!cfg.replica_places.empty() &&
      cfg.replica_places.size() != static_cast<std::size_t>(n_places)) {
    throw GraphError(fmt::format("dp {} x pp {} x tp {} is {} but {} replica places are given",
                                 cfg.dp, cfg.pp, cfg.tp, n_places, cfg.replica_places.size()));
  }
  if (n_places > Device::max_index + 1 && cfg.replica_places.empty()) {
    throw GraphError(fmt::format("dp {} x pp {} x tp {} needs {} in-process devices; at most {}",
                                 cfg.dp, cfg.pp, cfg.tp, n_places, Device::max_index + 1));
  }
  for (const std::string& pass : cfg.print_after) {
    const auto& all = names();
    if (pass != "all" && std::find(all.begin(), all.end(), pass) == all.end()) {
      throw GraphError(fmt::format("print after '{}': no such pass; the passes are {} (or all)",
                                   pass, fmt::join(all, ", ")));
    }
  }
}

namespace detail {

void print_after(const TrainConfig& cfg, std::string_view pass, const std::function<std::string()>& text) {
  const bool wanted = std::any_of(cfg.print_after.begin(), cfg.print_after.end(),
                                  [&](const std::string& p) { return p == "all" || p == pass; });
  if (!wanted) return;
  const std::string ir = text();
  if (cfg.print_ir) {
    cfg.print_ir(pass, ir);
  } else {
    fmt::print("*** IR after {} ***\n{}", pass, ir);
  }
}

}  // namespace detail

namespace {

using detail::print_after;

/// The plan verifier after plan pass `pass`: what that pass can have broken (PlanChecks), so a
/// pass that breaks an invariant is named, not the runtime that trips on it later.
/// A plan compiled only to be simulated (TrainConfig::plan_only) skips the dry run and the
/// arenas' check: the simulation plays the same protocol to the end and stops where the dry run
/// would, in its words (simulate.h), and for a large plan the dry run is most of the compile.
void verify(const TrainingJob& job, std::string_view pass, PlanChecks checks, const TrainConfig& cfg) {
  if (cfg.plan_only && (checks == PlanChecks::progress || checks == PlanChecks::all)) checks = PlanChecks::structure;
  try {
    validate(job.plan, job.kernels, /*rank=*/0, ProgressCheck::iterations, checks);
  } catch (const PlanError& e) {
    throw PlanError(fmt::format("the compiler's plan after the {} pass: {}", pass, e.what()));
  }
}

}  // namespace

TrainingJob run(Graph& g, Value loss, const TrainConfig& cfg,
                std::shared_ptr<ParameterStore> params) {
  detail::check_loss(g, loss);
  check_config(cfg);
  if (!params) params = cfg.plan_only ? ParameterStore::shapes(g) : ParameterStore::initialize(g);
  const Differentiated d = autodiff(g, loss, cfg);
  print_after(cfg, "autodiff", [&] { return d.to_text(); });
  const Shards shards = sbp(g, d, cfg.tp);
  print_after(cfg, "sbp", [&] { return shards.to_text(g, d); });
  const Stages st = stages(g, d, cfg, *params);
  print_after(cfg, "stages", [&] { return st.to_text(g, d); });
  const Recomputed rc = recompute(g, d, shards, st, cfg);
  print_after(cfg, "recompute", [&] { return rc.to_text(); });
  const Replicas reps = replicate(rc.d, rc.shards, rc.stages, cfg);
  print_after(cfg, "replicas", [&] { return reps.to_text(); });
  TrainingJob job = lower(g, rc.d, rc.shards, rc.stages, reps, cfg, std::move(params));
  print_after(cfg, "lower", [&] { return job.plan.to_text(); });
  verify(job, "lower", PlanChecks::before_transfers, cfg);
  job.plan = updates(job.plan, job.kernels, cfg);
  print_after(cfg, "updates", [&] { return job.plan.to_text(); });
  verify(job, "updates", PlanChecks::before_transfers, cfg);
  job.plan = epilogues(job.plan, job.kernels, cfg);
  print_after(cfg, "epilogues", [&] { return job.plan.to_text(); });
  verify(job, "epilogues", PlanChecks::before_transfers, cfg);
  job.plan = tp_collectives(job.plan, job.kernels, cfg);
  print_after(cfg, "tp_collectives", [&] { return job.plan.to_text(); });
  verify(job, "tp_collectives", PlanChecks::before_transfers, cfg);
  job.plan = device_copies(job.plan, job.kernels);
  print_after(cfg, "device_copies", [&] { return job.plan.to_text(); });
  verify(job, "device_copies", PlanChecks::before_transfers, cfg);
  job.plan = transfers(job.plan);
  print_after(cfg, "transfers", [&] { return job.plan.to_text(); });
  verify(job, "transfers", PlanChecks::structure, cfg);
  job.plan = nccl_p2p(job.plan, job.kernels, cfg);
  print_after(cfg, "nccl_p2p", [&] { return job.plan.to_text(); });
  verify(job, "nccl_p2p", PlanChecks::structure, cfg);
  job.plan = segments(job.plan, job.kernels, cfg);
  print_after(cfg, "segments", [&] { return job.plan.to_text(); });
  verify(job, "segments", PlanChecks::structure, cfg);
  job.plan = lanes(job.plan, cfg);
  print_after(cfg, "lanes", [&] {
    return job.plan.to_text() +
           (cfg.pp > 1 ? schedule_text(parse_schedule(cfg.schedule), cfg.pp, cfg.microbatches, cfg.virtual_stages)
                       : std::string());
  });
  verify(job, "lanes", PlanChecks::progress, cfg);
  job.plan = memory(job.plan, cfg);
  print_after(cfg, "memory", [&] { return job.plan.to_text() + memory_text(job.plan); });
  verify(job, "memory", PlanChecks::all, cfg);
  return job;
}

}  // namespace passes

TrainingJob compile_training(Graph& g, Value loss, const TrainConfig& cfg,
                             std::shared_ptr<ParameterStore> params) {
  return passes::run(g, loss, cfg, std::move(params));
}

}  // namespace baton
