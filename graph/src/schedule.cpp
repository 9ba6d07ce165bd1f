#include "baton/graph/schedule.h"

#include <map>
#include <tuple>

#include <fmt/format.h>

#include "baton/graph/graph.h"

namespace baton {

PipelineSchedule parse_schedule(std::string_view s) {
  if (s == "gpipe") return PipelineSchedule::gpipe;
  if (s == "1f1b") return PipelineSchedule::one_f_one_b;
  throw GraphError(fmt::format("schedule '{}': gpipe or 1f1b", s));
}

std::string_view name(PipelineSchedule s) { return s == PipelineSchedule::gpipe ? "gpipe" : "1f1b"; }

std::vector<PipelineUnit> stage_sequence(PipelineSchedule s, int stages, int stage, std::int64_t m) {
  if (stages < 1 || stage < 0 || stage >= stages || m < 1) {
    throw GraphError(fmt::format("stage_sequence: stage {} of {} with {} micro-batches", stage, stages, m));
  }
  std::vector<PipelineUnit> seq;
  // GPipe is 1F1B with every forward a warm-up one.
  const std::int64_t warmup =
      s == PipelineSchedule::gpipe ? m : std::min<std::int64_t>(stages - stage - 1, m);
  for (std::int64_t i = 0; i < warmup; ++i) seq.push_back({false, i});
  // Steady state (Megatron's): the forward of micro-batch w + j, then the backward of j, which
  // frees the activation slot the next forward needs.
  for (std::int64_t j = 0; j + warmup < m; ++j) {
    seq.push_back({false, warmup + j});
    seq.push_back({true, j});
  }
  for (std::int64_t j = m - warmup; j < m; ++j) seq.push_back({true, j});
  return seq;
}

void order_pipeline(Plan& plan, PipelineSchedule s, int stages, std::int64_t m) {
  // Where each micro-batch's forward and backward fall in each stage's sequence.
  std::vector<std::vector<std::int32_t>> forward_units(static_cast<std::size_t>(stages)), backward_units(forward_units);
  for (int st = 0; st < stages; ++st) {
    forward_units[static_cast<std::size_t>(st)].resize(static_cast<std::size_t>(m));
    backward_units[static_cast<std::size_t>(st)].resize(static_cast<std::size_t>(m));
    const auto seq = stage_sequence(s, stages, st, m);
    for (std::size_t u = 0; u < seq.size(); ++u) {
      auto& units = seq[u].backward ? backward_units : forward_units;
      units[static_cast<std::size_t>(st)][static_cast<std::size_t>(seq[u].microbatch)] = static_cast<std::int32_t>(u);
    }
  }
  std::map<std::tuple<int, std::uint16_t, Device, std::uint8_t>, std::int32_t> lanes;
  std::map<std::int32_t, std::int32_t> ranks;  // lane -> actors in it so far
  for (ActorDesc& a : plan.actors) {
    // Transfers too where the lowering gave them a pass (ZeRO 3's pulls of remote shards), and
    // of the sinks, ZeRO 3's store of those pulls (lower_zero.cpp), whose place is beside them.
    if (a.kind != ActorKind::compute && a.kind != ActorKind::transfer) continue;
    if ((a.outputs.empty() && !a.op.starts_with("zero3.store.")) || a.stage < 0) continue;
    if (a.role != ActorRole::forward && a.role != ActorRole::backward) continue;
    if (a.stage >= stages) {
      throw GraphError(fmt::format("order_pipeline: actor '{}' is on stage {} of a {}-stage pipeline", a.name,
                                   a.stage, stages));
    }
    auto [it, fresh] = lanes.emplace(std::tuple{a.stage, a.where.rank, a.where.device, a.where.stream},
                                     static_cast<std::int32_t>(lanes.size()));
    const auto st = static_cast<std::size_t>(a.stage);
    a.order = ActOrder{.lane = it->second,
                       .units = a.role == ActorRole::forward ? forward_units[st] : backward_units[st],
                       .period = static_cast<std::int32_t>(2 * m),
                       .rank = ranks[it->second]++};
  }
}

}  // namespace baton
