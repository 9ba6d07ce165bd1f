#pragma once
/// The activity log: what each actor did and when, for traces and the dashboard's pipeline
/// timeline. Off by default; when on, each worker thread appends a record per act to its own
/// lock-free single-producer ring, and one reader drains all rings (Runtime::drain_activity).
/// A full ring drops records (counted) rather than slowing the actors down.
#include <cstdint>
#include <string>
#include <vector>

#include "baton/actors/plan.h"

namespace baton {

/// One act of one actor. Times are steady_clock nanoseconds (CLOCK_MONOTONIC on Linux: the
/// same clock in every process of one host). An act ends when its results are handed on: the
/// end is taken before the requests to its consumers go out, so a consumer's act never starts
/// before the act it reads from ended. A transfer actor's record spans one piece's pull, from
/// asking the data plane for it to its landing.
struct ActRecord {
  /// The actor's index in the plan.
  ActorIndex actor = 0;
  /// Which act of this actor (0, 1, ...): for a compute actor in a training plan, the
  /// micro-batch number counted over the whole run.
  std::int64_t piece = 0;
  std::uint64_t start_ns = 0;
  std::uint64_t end_ns = 0;
  /// The worker thread that ran it: an index into Runtime::worker_names().
  std::uint16_t worker = 0;
};

/// steady_clock now, in nanoseconds, as ActRecord uses it.
std::uint64_t steady_ns();

/// How much of the time the gradients' all-reduces were under way the backward pass ran
/// beside them (what data parallelism hides behind compute, as DDP's bucketing intends).
/// An all-reduce's actors carry the attribute "allreduce" (its name; collectives.h), and the
/// transfers that move their registers count with them. For each (all-reduce, piece) its span
/// runs from the start of its first act to the end of its last; `collective_s` is the measure
/// of the union of those spans, `overlapped_s` the part of it during which some backward act
/// (ActorRole::backward) ran. The loss's all-reduce ("loss") is not a gradient's and is left out.
/// Records of one process (one clock); those of actors the plan does not have are ignored.
/// `by_allreduce`: the same for each all-reduce (a gradient bucket) on its own, by name.
struct CollectiveOverlap {
  struct Group {
    std::string name;
    double collective_s = 0;
    double overlapped_s = 0;
    double fraction() const { return collective_s > 0 ? overlapped_s / collective_s : 0.0; }
  };
  double collective_s = 0;
  double overlapped_s = 0;
  std::size_t spans = 0;  // (all-reduce, piece) pairs seen
  std::vector<Group> by_allreduce;  // in name order
  double fraction() const { return collective_s > 0 ? overlapped_s / collective_s : 0.0; }
};
CollectiveOverlap collective_overlap(const Plan& plan, const std::vector<ActRecord>& acts);

}  // namespace baton
