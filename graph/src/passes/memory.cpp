// The memory pass (passes.h): every register slot the runtime allocates gets an offset in one
// arena per (rank, device), and slots whose lives never meet share bytes. The lives come from
// the plan (plan_memory.h: known inside a lane, the whole job elsewhere); the placement is
// greedy by decreasing size, first fit (XLA's GlobalDecreasingSizeBestFitHeap, TVM's storage
// rewrite and OneFlow's mem_block offsets do the same kind of packing).
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

/// Places one arena's slots; returns its size. Slots live the whole job go first, one after
/// the other; the rest, largest first, at the lowest offset clear of every placed slot that
/// may be live with them.
std::int64_t place(std::vector<Slot>& slots, const LifeTable& lives) {
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
  for (std::size_t i = 0; i < slots.size(); ++i) {
    Slot& s = slots[i];
    if (s.always) continue;
    taken.clear();
    for (std::size_t k = 0; k < i; ++k) {
      const Slot& o = slots[k];
      if (!o.always && lives.may_overlap(s.reg, s.slot, o.reg, o.slot))
        taken.emplace_back(o.offset, o.offset + o.bytes);
    }
    s.offset = first_fit(taken, base, s.bytes);
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
  if (cfg.memory_plan) {
    const auto lives = slot_lives(out);
    const LifeTable table(lives);
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
      const std::int64_t bytes = place(slots, table);
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
