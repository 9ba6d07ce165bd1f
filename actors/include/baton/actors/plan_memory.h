#pragma once
/// Register memory in a plan: when each slot of each register holds a piece that someone will
/// still read (its life), which slots may therefore share bytes, and what a plan needs on each
/// device. The memory pass (graph/passes.h) places slots in arenas by these lives; validate()
/// refuses a plan whose arenas give two slots that may be live at once the same bytes.
///
/// A life is known only where the plan's order proves it. The actors of one lane act one at a
/// time in a fixed cyclic order (ActOrder), so within a lane an act has a position: act k of an
/// actor with U units falls in period k / U, at the place of its unit k % U in the period's
/// sorted sequence of N acts. A slot of register R holds piece p from the act that writes it to
/// the last act that reads it; when R's producer and every reader are compute actors of one
/// lane with the same U, reading without delay, that is an interval of positions inside one
/// period, and the slot (piece p is in slot p % slots) is live only during a periodic set of
/// such intervals. Two slots of one lane whose sets never meet are never live at once: the
/// later act starts after the earlier one ended (on one worker; on one CUDA stream in stream
/// order). The readers of a view of R (plan.h: a repeat of group 1, which copies nothing) read
/// R's bytes and count as R's readers. A transfer in a lane writes its slot from its act (the
/// pull it starts there), as a compute actor does. Anything else (a reader on another worker,
/// rank or stream, a repeat of a weight, an accumulate, a transfer outside a lane, a delay) is
/// live for the whole job: conservative, never wrong.
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "baton/actors/plan.h"

namespace baton {

/// When one slot holds a piece. lane < 0: always (the whole job). Else, with N acts in a period
/// of the lane, during `spans` (inclusive positions in [0, period * N)) of every run of
/// `period` consecutive lane periods.
struct SlotLife {
  std::int32_t lane = -1;
  std::int32_t lane_acts = 0;  // N
  std::int32_t period = 1;     // lane periods after which the pattern repeats
  std::vector<std::pair<std::int64_t, std::int64_t>> spans;
  bool always() const { return lane < 0; }
};

/// The lives of every slot of every register: [register][slot].
std::vector<std::vector<SlotLife>> slot_lives(const Plan& plan);

/// False only where the two lives are provably never at once.
bool may_overlap(const SlotLife& a, const SlotLife& b);

/// An in-place permission (ActorDesc::in_place) the memory pass may use: the register the
/// actor reads and the one it writes, both allocated by the runtime in the same memory (no view,
/// nothing page-locked), with slots of equal bytes, read without delay. Where a slot of `output`
/// has the very bytes of a slot of `input`, the two may touch: the act that last reads the
/// input's piece writes the output's there (LifeTable::may_overlap_in_place).
struct InPlacePair {
  RegisterIndex input = 0;
  RegisterIndex output = 0;
  friend bool operator==(const InPlacePair&, const InPlacePair&) = default;
};
std::vector<InPlacePair> in_place_pairs(const Plan& plan);

/// Slot lives prepared for many comparisons (placing slots, checking an arena): each unrolled
/// once over a period common to its lane (folded into one period where that would be long,
/// which is coarser, never wrong). Agrees with may_overlap() wherever that says false.
class LifeTable {
 public:
  explicit LifeTable(const std::vector<std::vector<SlotLife>>& lives);
  bool may_overlap(RegisterIndex a, std::size_t slot_a, RegisterIndex b, std::size_t slot_b) const;
  /// As may_overlap(), for slot `slot_out` of register `out` given the very bytes of slot
  /// `slot_in` of `in` (an InPlacePair): false also where the output's lives begin exactly when
  /// the input's end, at the act that reads one and writes the other, and never meet otherwise.
  bool may_overlap_in_place(RegisterIndex in, std::size_t slot_in, RegisterIndex out, std::size_t slot_out) const;

 private:
  struct Entry {
    std::int32_t lane = -1;
    std::size_t first = 0, count = 0;  // into spans_
  };
  bool meet(RegisterIndex a, std::size_t slot_a, RegisterIndex b, std::size_t slot_b, bool b_starts_after_a_ends) const;
  std::vector<std::vector<Entry>> entries_;
  std::vector<std::pair<std::int64_t, std::int64_t>> spans_;
};

/// Whether slot `slot_a` of `a` and slot `slot_b` of `b` may have the very same bytes because an
/// act computes one in place of the other (an InPlacePair of `pairs`, either way round, whose
/// lives only touch at that act).
bool in_place_of_each_other(const std::vector<InPlacePair>& pairs, const LifeTable& lives, RegisterIndex a,
                            std::size_t slot_a, RegisterIndex b, std::size_t slot_b);

/// Bytes of one slot of `reg`.
std::int64_t slot_bytes(const RegisterDesc& reg);

/// Whether the runtime allocates this register's slots, and where (the rank and device whose
/// memory holds them). False for a repeat's output (it aliases its input's slot) and for a
/// register with no producer, and for a kernel's own memory (RegisterDesc::kernel_memory). `pinned`: page-locked host memory (a register copied between host
/// and a CUDA device), which the runtime allocates apart from any arena.
struct RegisterMemory {
  bool allocated = false;
  bool pinned = false;
  std::uint16_t rank = 0;
  Device device{};
};
RegisterMemory register_memory(const Plan& plan, RegisterIndex r);

/// What a register holds, told by its producer: weights (variables and their repeats),
/// activations (data and the forward pass), gradients (the backward pass, accumulation,
/// collectives), other; a transfer's or copy's register is what it moves.
MemoryCategory register_category(const Plan& plan, RegisterIndex r);

/// Appends the plan's memory problems, one string each: an arena index or offset out of range,
/// a slot outside its arena or misaligned, a placed register the runtime may not place (a
/// repeat's, a page-locked one) or placed on another device than its producer's, and two slots
/// that share bytes but may be live at once (in-place slots, InPlacePair, only at the very same
/// offset and size). Assumes the plan's registers and producers are
/// consistent (validate() checks that first).
void check_memory(const Plan& plan, std::vector<std::string>& problems);

/// Alignment of a slot in an arena: enough for any vector load on the CPU and for CUDA.
inline constexpr std::int64_t arena_alignment = 256;

/// What a plan needs on one device of one rank, from the plan alone.
struct DeviceMemory {
  std::uint16_t rank = 0;
  Device device{};
  /// The peak, by category: registers of their own and always live in full, the lane-planned
  /// ones as live at their lane's busiest moment, and what kernels keep (ActorDesc::kept).
  std::array<std::int64_t, memory_categories> bytes{};
  /// Of `bytes`, what kernels keep (ActorDesc::kept): the rest is register slots live at the peak,
  /// what RunReport::memory measures.
  std::int64_t kept = 0;
  /// Arena bytes beyond what is live at the peak (the cost of packing slots at offsets).
  std::int64_t slack = 0;
  /// What the runtime allocates for registers: arenas and registers of their own.
  std::int64_t registers = 0;
  /// The largest consumers at the peak, largest first: a register (its slots live then) or a
  /// kernel's kept state.
  struct Consumer {
    std::string name;
    MemoryCategory category;
    std::int64_t bytes;
  };
  std::vector<Consumer> largest;
  std::int64_t total() const;
  /// Register bytes live at the peak: total() without the slack and what kernels keep.
  std::int64_t registers_at_peak() const { return total() - slack - kept; }
};

/// Every device's needs, ordered by (rank, device); `largest` keeps the top `consumers`.
std::vector<DeviceMemory> memory_report(const Plan& plan, std::size_t consumers = 8);

/// One line per device: "r0/cpu:0 total 12.3 MiB: weights 1.0 MiB, ..., slack 0.1 MiB", and
/// the largest consumers below it.
std::string to_text(const std::vector<DeviceMemory>& report);

/// "1.5 MiB"
std::string format_bytes(std::int64_t bytes);

}  // namespace baton
