#pragma once
/// The runtime: instantiates a plan's actors on worker threads and runs them to the end.
#include <cstdint>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "baton/actors/activity.h"
#include "baton/actors/message.h"
#include "baton/actors/metrics.h"
#include "baton/actors/plan.h"
#include "baton/actors/settings.h"
#include "baton/kernels/kernel.h"

namespace baton {

/// A plan the runtime refuses before anything runs. what() lists every problem, one a line.
class PlanError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A run that failed: an actor's kernel threw, the protocol was broken, or nothing moved for
/// the stall timeout. what() names the actor and piece (or what each actor waited for).
class JobError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Checks a plan against the registry: every register has one producer and consistent
/// consumers, slots >= 1, kinds have the ports they need, every kernel exists, and a dry run
/// of the handshakes makes progress (a cycle needs delays and slots enough to turn), and no two
/// register slots that may be live at once share bytes of an arena (plan_memory.h). Throws
/// PlanError.
///
/// How the dry run decides that the plan keeps going (DESIGN.md section 3): `iterations` plays
/// each actor's acts of a few iterations of the plan (its rates' repetition vector, times the
/// delays plus two), milliseconds for a training plan; `tokens` plays until each actor has
/// acted more often than the plan has slots and delays, quadratic in the plan's size (seconds
/// for a small GPT): the fallback where the rates do not balance, and the reference the tests
/// hold the short check to.
enum class ProgressCheck : std::uint8_t { iterations, tokens };
/// How far validate() goes: the plan's structure alone, before_transfers allowing registers
/// that cross ranks without a transfer actor yet (what the compiler's plan is until its
/// transfers pass), also the dry run (once its lanes are fixed), or also its memory (once slots
/// are placed in arenas: all). The compiler verifies its plan after every plan pass with what
/// that pass can have broken (passes.h), as XLA's verifier runs between HLO passes.
enum class PlanChecks : std::uint8_t { before_transfers, structure, progress, all };
void validate(const Plan& plan, const KernelRegistry& kernels, std::uint16_t rank = 0,
              ProgressCheck progress = ProgressCheck::iterations, PlanChecks checks = PlanChecks::all);

/// One message as sent, in deterministic mode (RuntimeSettings::record_handshakes).
struct HandshakeEvent {
  MsgKind kind;
  std::string from;
  std::string to;
  std::string reg;
  std::uint16_t slot;
  std::int64_t piece;
  /// "request a->b a.out[0]#3"
  std::string str() const;
};

/// Owns the worker threads, the actors and their registers for one run of one plan. Two
/// runtimes may live in one process.
///
///   baton::Runtime rt(plan, baton::KernelRegistry::with_builtin_kernels());
///   baton::RunReport report = rt.run();
///   fmt::print("{}", report.metrics.table());
class Runtime {
 public:
  /// Validates the plan (throws PlanError) and allocates every register.
  Runtime(Plan plan, const KernelRegistry& kernels, RuntimeSettings settings = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// Runs until every actor has retired; throws JobError if the run fails. Once per Runtime.
  RunReport run();
  /// Any thread: ends the run (run() throws JobError with this reason). For the job layer: the
  /// control plane reported that another rank failed.
  void abort(const std::string& reason);
  /// Any thread: rank `rank` left the job and the run goes on without it (a parameter-server
  /// worker under bounded staleness; the control plane decides who may leave). Messages to it
  /// are dropped from now on; its consumers of this rank's registers detach at the pieces they
  /// acked; this rank's transfers from it read zeros from their next piece on (a pull from it
  /// still in flight lands as zeros), so a sum over replicas goes on with the others'. A
  /// transfer that gathers from it and another rank cannot, and the run fails saying so.
  void rank_left(std::uint32_t rank, const std::string& reason);
  /// Any thread, while run() goes: rank `rank`, which left (rank_left), is coming back as a new
  /// process (baton-launch --max-restarts). Every actor of this rank that exchanged a register
  /// with it stops acting until rank_rejoined or release_hold; returns the first step it may
  /// come back at here (each such actor's next piece, and its producer's credit beyond it for
  /// an input: a piece the departed process may still have offered is never asked of the new
  /// one), 0 if no actor of this rank talks to it. Every rank is asked and the largest answer
  /// is the step: the held actors cannot move past it meanwhile. Throws JobError if the actors
  /// did not answer within `timeout` (or the run failed).
  std::int64_t hold_for_rejoin(std::uint32_t rank, std::chrono::milliseconds timeout);
  /// Any thread, after hold_for_rejoin, once the data plane reaches the new process: rank
  /// `rank` is back from step `step` (its RuntimeSettings::rejoin_step). Its readers of this
  /// rank's registers are attached again from that step's first piece; this rank's transfers
  /// from it read zeros up to there, then its pieces; the held actors go on. Returns once every
  /// actor has done so (messages from it are taken from then on); throws JobError as above.
  void rank_rejoined(std::uint32_t rank, std::int64_t step, std::chrono::milliseconds timeout);
  /// Any thread, after hold_for_rejoin: the rank does not come back after all (it died again
  /// before it was ready); the held actors go on without it.
  void release_hold(std::uint32_t rank);
  /// Counters as of now; safe from any thread while run() is going.
  MetricsSnapshot snapshot() const;
  /// Starts or stops the activity log (needs RuntimeSettings::activity_log, which sets its
  /// initial state and makes the rings). Any thread, any time.
  void set_activity_log(bool on);
  /// Moves every record logged so far into `out` (appended, per worker in order); returns how
  /// many. Any thread; concurrent callers take turns. Safe while run() is going and after.
  std::size_t drain_activity(std::vector<ActRecord>& out);
  /// Records lost because a worker's ring was full (nobody drained for a few seconds).
  std::uint64_t activity_dropped() const;
  /// One name per worker thread, "cpu:0/s0": ActRecord::worker indexes this.
  std::vector<std::string> worker_names() const;
  /// Deterministic mode with record_handshakes: every message in the order it was sent.
  const std::vector<HandshakeEvent>& handshakes() const;
  const Plan& plan() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton
