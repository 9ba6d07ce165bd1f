#pragma once
// The peers of baton-bench-actors: the same chain of stages built with what a C++ user would
// pick instead of baton, measured in the same run.
//   - TBB's flow graph (oneTBB, Debian's libtbb-dev): an input_node (the source stage) and one
//     serial function_node per further stage, the pieces in flight bounded by a limiter_node
//     (the window) that the last stage decrements; a task_arena of `threads` slots (the caller
//     takes one, as it waits for the graph).
//   - CAF actors (the C++ Actor Framework 0.17, Debian's libcaf-dev): one event-based actor per
//     stage on an actor system of `threads` scheduler threads, talking baton's protocol (a
//     request downstream per piece, an ack upstream per piece, at most `slots` un-acked per
//     edge); the caller waits on a scoped actor for the sink's "done".
// Each stage runs a StageWork per piece: the benchmark hands them the same baton kernels its own
// actors run, so that every system does the same work per task.
//
// This header includes neither library: actor_peers.cpp is compiled with
// BATON_BENCH_HAS_TBB / BATON_BENCH_HAS_CAF where CMake found them, and a peer that was not
// built says so through missing().
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace baton::bench {

/// One stage's work on one piece.
using StageWork = std::function<void()>;

/// One run of a peer: its wall time (spawning the graph or actors included, the thread pool
/// not) and the pieces its last stage saw.
struct PeerSample {
  double wall_s = 0;
  std::int64_t delivered = 0;
};

/// A chain of stages on one peer system; stages[0] is the source, the last one the sink.
class PeerChain {
 public:
  virtual ~PeerChain() = default;
  /// Runs `pieces` pieces through the chain once. Throws if the sink did not see every piece
  /// or the run passed `timeout_s`.
  virtual PeerSample run(const std::vector<StageWork>& stages, std::int64_t pieces,
                         double timeout_s) = 0;
  /// "tbb_flow_graph" or "caf".
  virtual std::string name() const = 0;
  /// What the peer is, for the JSON line's description.
  virtual std::string describe() const = 0;
};

/// Why the TBB flow graph peer cannot run ("" if it can: built with oneTBB).
std::string tbb_missing();
/// Why the CAF peer cannot run ("" if it can: built with CAF).
std::string caf_missing();

/// The TBB flow graph chain: at most `window` pieces in flight, on `threads` threads.
/// Throws std::runtime_error naming tbb_missing() where TBB was not built in.
std::unique_ptr<PeerChain> make_tbb_chain(int threads, int window);
/// The CAF chain: `slots` un-acked pieces per edge, on `threads` scheduler threads.
/// Throws std::runtime_error naming caf_missing() where CAF was not built in.
std::unique_ptr<PeerChain> make_caf_chain(int threads, int slots);

}  // namespace baton::bench
