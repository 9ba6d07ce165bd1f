// The memory pass (passes.h): every register slot the runtime allocates gets an offset in one
// arena per (rank, device), and slots whose lives never meet share bytes. The lives come from
// the plan (plan_memory.h: known inside a lane, the whole job elsewhere); the placement is
// greedy by decreasing size, first fit (XLA's GlobalDecreasingSizeBestFitHeap, TVM's storage
// rewrite and OneFlow's mem_block offsets do the same kind of packing). An output that its act
// may compute in place of an input (ActorDesc::in_place) is put on that input slot's bytes first,
// where their lives only touch at the act (TVM's inplace storage rewrite, PyTorch's in-place
// elementwise ops where autograd allows them).
#include <algorithm>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "baton/actors/plan_memory.h"
#include "baton/graph/passes.h"

namespace baton::passes {

namespace {

std::int64_t aligned(std::int64_t bytes) {
  return (bytes + arena_alignment - 1) / arena_alignment * arena_alignment;
}

struct Slot {
  RegisterIndex reg;
  std::size_t slot;
  std::int64_t bytes;  // aligned
  bool always;
  std::int64_t offset = -1;
};

/// The lowest offset from `base` where [offset, offset + bytes) misses every block in `taken`.
std::int64_t first_fit(std::vector<std::pair<std::int64_t, std::int64_t>>& taken, std::int64_t base,
                       std::int64_t bytes) {
  std::sort(taken.begin(), taken.end());
  std::int64_t at = base;
  for (const auto& [begin, end] : taken) {
    if (begin >= at + bytes) break;
    at = std::max(at, end);
  }
  return at;
}

/// Whether slot `s` may take the bytes of the placed slot `t` in place (an InPlacePair of theirs,
/// either way round, whose lives only touch at the act that computes one from the other).
bool in_place_over(const Slot& s, const Slot& t, const std::vector<InPlacePair>& pairs, const LifeTable& lives) {
  return s.bytes == t.bytes && !t.always && !s.always && in_place_of_each_other(pairs, lives, s.reg, s.slot, t.reg, t.slot);
}

/// The offset of a placed slot among `candidates` (indices below i) whose bytes slots[i] may
/// take in place, where no other slot live with it is; -1: none.
std::int64_t in_place_offset(const std::vector<Slot>& slots, std::size_t i, const std::vector<std::size_t>& candidates,
                             const std::vector<InPlacePair>& pairs, const LifeTable& lives) {
  const Slot& s = slots[i];
  for (std::size_t k : candidates) {
    const Slot& t = slots[k];
    if (!in_place_over(s, t, pairs, lives)) continue;
    bool clear = true;  // t itself passes: the same bytes, in place
    for (std::size_t j = 0; j < i && clear; ++j) {
      const Slot& o = slots[j];
      if (o.always || o.offset + o.bytes <= t.offset || t.offset + t.bytes <= o.offset) continue;
      const bool same_bytes = o.offset == t.offset && o.bytes == t.bytes;
      clear = !lives.may_overlap(s.reg, s.slot, o.reg, o.slot) || (same_bytes && in_place_over(s, o, pairs, lives));
    }
    if (clear) return t.offset;
  }
  return -1;
}

/// Places one arena's slots; returns its size. Slots live the whole job go first, one after
/// the other; the rest, largest first: on the bytes of a placed slot they may be computed in
/// place of (or that may be computed in place of them), where nothing else live with them is
/// there, else at the lowest offset clear of every placed slot that may be live with them.
std::int64_t place(std::vector<Slot>& slots, const LifeTable& lives, const std::vector<InPlacePair>& pairs) {
  std::stable_sort(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) {
    return std::tuple(!a.always, -a.bytes) < std::tuple(!b.always, -b.bytes);
  });
  std::int64_t base = 0;
  for (Slot& s : slots) {
    if (!s.always) break;
    s.offset = base;
    base += s.bytes;
  }
  std::int64_t end = base;
  std::vector<std::pair<std::int64_t, std::int64_t>> taken;
  std::map<RegisterIndex, std::vector<RegisterIndex>> partners;  // both ways round
  for (const InPlacePair& p : pairs) {
    partners[p.input].push_back(p.output);
    partners[p.output].push_back(p.input);
  }
  std::map<RegisterIndex, std::vector<std::size_t>> positions;  // of each register's slots
  for (std::size_t i = 0; i < slots.size() && !partners.empty(); ++i) positions[slots[i].reg].push_back(i);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    Slot& s = slots[i];
    if (s.always) continue;
    taken.clear();
    for (std::size_t k = 0; k < i; ++k) {
      const Slot& o = slots[k];
      if (!o.always && lives.may_overlap(s.reg, s.slot, o.reg, o.slot))
        taken.emplace_back(o.offset, o.offset + o.bytes);
    }
    std::vector<std::size_t> candidates;  // placed slots of registers paired with s's
    if (auto p = partners.find(s.reg); p != partners.end()) {
      for (RegisterIndex r : p->second) {
        for (std::size_t k : positions[r]) {
          if (k < i) candidates.push_back(k);
        }
      }
      std::sort(candidates.begin(), candidates.end());
    }
    s.offset = in_place_offset(slots, i, candidates, pairs, lives);
    if (s.offset < 0) s.offset = first_fit(taken, base, s.bytes);
    end = std::max(end, s.offset + s.bytes);
  }
  return end;
}

/// Refuses a plan that needs more than the budget on some device, naming what it needs most.
void check_budget(const Plan& plan, std::int64_t budget) {
  if (budget <= 0) return;
  for (const DeviceMemory& m : memory_report(plan, 5)) {
    if (m.total() <= budget) continue;
    std::string parts, largest;
    for (std::size_t c = 0; c < memory_categories; ++c) {
      parts += fmt::format("{}{} {}", c == 0 ? "" : ", ", name(static_cast<MemoryCategory>(c)),
                           format_bytes(m.bytes[c]));
    }
    for (const auto& c : m.largest)
      largest +=
          fmt::format("{}{} ({})", largest.empty() ? "" : ", ", c.name, format_bytes(c.bytes));
    throw GraphError(
        fmt::format("the plan needs {} on r{}/{} but the memory budget is {}: {}, arena slack {}; "
                    "the largest: {}",
                    format_bytes(m.total()), m.rank, m.device.str(), format_bytes(budget), parts,
                    format_bytes(m.slack), largest));
  }
}

}  // namespace

Plan memory(const Plan& plan, const TrainConfig& cfg) {
  Plan out = plan;
  if (!cfg.memory_plan || !cfg.in_place) {
    for (ActorDesc& a : out.actors) a.in_place.clear();
  }
  if (cfg.memory_plan) {
    const auto lives = slot_lives(out);
    const LifeTable table(lives);
    const auto pairs = in_place_pairs(out);
    std::map<std::pair<std::uint16_t, Device>, std::vector<Slot>> arenas;
    for (RegisterIndex r = 0; r < out.registers.size(); ++r) {
      RegisterDesc& reg = out.registers[r];
      reg.arena = -1;
      reg.offsets.clear();
      const RegisterMemory mem = register_memory(out, r);
      const std::int64_t bytes = slot_bytes(reg);
      if (!mem.allocated || mem.pinned || bytes == 0) continue;
      for (std::size_t s = 0; s < static_cast<std::size_t>(reg.slots); ++s) {
        arenas[{mem.rank, mem.device}].push_back({r, s, aligned(bytes), lives[r][s].always()});
      }
    }
    out.arenas.clear();
    for (auto& [where, slots] : arenas) {
      const std::int64_t bytes = place(slots, table, pairs);
      const auto index = static_cast<std::int32_t>(out.arenas.size());
      out.arenas.push_back({.rank = where.first, .device = where.second, .bytes = bytes});
      for (const Slot& s : slots) {
        RegisterDesc& reg = out.registers[s.reg];
        reg.arena = index;
        reg.offsets.resize(static_cast<std::size_t>(reg.slots), 0);
        reg.offsets[s.slot] = s.offset;
      }
    }
  }
  check_budget(out, cfg.memory_budget);
  return out;
}

std::string memory_text(const Plan& plan) {
  return to_text(memory_report(plan));
}

}  // namespace baton::passes
