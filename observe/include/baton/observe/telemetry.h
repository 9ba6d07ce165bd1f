#pragma once
/// What a rank's collector tells the job model: the messages on the telemetry channel
/// (transport::ControlClient::send_telemetry) whose kinds start with "dash.", and the types they
/// carry. The collector writes them, the job model reads them; in a job of one rank the
/// collector hands them to the model directly, so both paths share one format.
///
///   dash.hello     {rank, host, world_size, plan_hash, workers: [names]}
///   dash.plan      {part, parts, hash, actors: [...], registers: [...]}   (rank 0 only)
///   dash.metrics   {seq, part, parts, elapsed_s, interval_s, rank totals, actors: [[...]...],
///                   registers: [[...]...]}  (cumulative counters; split into parts)
///   dash.steps     {steps: [[step, loss, lr, samples], ...]}
///   dash.timeline  {boxes: [[stage, device_code, phase, piece, start_ns, end_ns], ...]}
///   dash.finish    {error}
///
/// Times in dash.timeline are on the steady clock of the process that runs the rendezvous
/// server (the rank's own clock plus ControlClient::clock_offset_ns), so that the boxes of all
/// ranks line up.
#include <cstdint>
#include <string>
#include <string_view>

namespace baton::observe {

/// One optimizer step as the training program reports it (Collector::record_step).
struct StepScalars {
  /// 1-based: the step that has just finished.
  std::int64_t step = 0;
  double loss = 0;
  double lr = 0;
  /// Samples trained on so far, this step included (over the whole job, not only this rank).
  std::int64_t samples = 0;
};

/// The kinds above.
namespace kind {
inline constexpr std::string_view hello = "dash.hello";
inline constexpr std::string_view plan = "dash.plan";
inline constexpr std::string_view metrics = "dash.metrics";
inline constexpr std::string_view steps = "dash.steps";
inline constexpr std::string_view timeline = "dash.timeline";
inline constexpr std::string_view finish = "dash.finish";
}  // namespace kind

/// True for the kinds the job model reads (the telemetry channel may carry others: traces).
inline bool is_dashboard_kind(std::string_view k) { return k.starts_with("dash."); }

/// The environment variable baton-launch --dashboard sets for its ranks: they collect and
/// send telemetry ("1"); a program with a JobObserver of its own may read it.
inline constexpr const char* dashboard_env = "BATON_DASHBOARD";

}  // namespace baton::observe
