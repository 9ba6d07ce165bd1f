// Slot lives, the arena check and the memory report (plan_memory.h).
#include "baton/actors/plan_memory.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include <fmt/format.h>

namespace baton {

namespace {

/// Past this many lane periods a periodic life is folded into one period (the union of its
/// spans there): still sound, less precise. Registers' slots and micro-batches are small
/// numbers, so real plans stay far below it.
constexpr std::int64_t max_unrolled_periods = 64;

/// Where each act of each lane member falls in its lane's period (ActOrder, as the runtime's
/// Lane::start sorts them): position[actor][u] for its unit u, and the acts of each lane's period.
struct LanePositions {
  std::vector<std::vector<std::int32_t>> position;
  std::map<std::int32_t, std::int32_t> acts;
  /// Lanes with a prefix (ActOrder::lead): their acts' positions are not one period's, so
  /// the lives of their registers are not known (always live: conservative).
  std::set<std::int32_t> led;
  /// Positions in steps: act position k is steps k * scale ... k * scale + scale - 1, one per
  /// kernel of an act that runs several in turn (ActSteps); 1 where no act does.
  std::int64_t scale = 1;
};

/// The step of `a`'s act that last reads its input register `reg` (0: an act of one step).
std::int64_t read_step(const ActorDesc& a, RegisterIndex reg) {
  std::int64_t step = 0;
  for (std::size_t i = 0; i < a.inputs.size() && i < a.steps.input_read.size(); ++i) {
    if (a.inputs[i].reg == reg) step = std::max<std::int64_t>(step, a.steps.input_read[i]);
  }
  return step;
}

/// The steps of `a`'s act that write its output register `reg` and last read it within the act.
std::pair<std::int64_t, std::int64_t> write_steps(const ActorDesc& a, RegisterIndex reg) {
  for (std::size_t o = 0; o < a.outputs.size(); ++o) {
    if (a.outputs[o] != reg || o >= a.steps.output_written.size() || o >= a.steps.output_read.size()) continue;
    return {a.steps.output_written[o], std::max(a.steps.output_written[o], a.steps.output_read[o])};
  }
  return {0, 0};
}

LanePositions lane_positions(const Plan& plan) {
  LanePositions out;
  out.position.resize(plan.actors.size());
  std::map<std::int32_t,
           std::vector<std::tuple<std::int32_t, std::int32_t, ActorIndex, std::size_t>>>
      lanes;
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    const ActOrder& o = plan.actors[i].order;
    if (o.lane < 0) continue;
    if (!o.lead.empty()) out.led.insert(o.lane);
    out.position[i].resize(o.units.size());
    for (std::int32_t step : plan.actors[i].steps.input_read) out.scale = std::max<std::int64_t>(out.scale, step + 1);
    for (std::int32_t step : plan.actors[i].steps.output_read) out.scale = std::max<std::int64_t>(out.scale, step + 1);
    for (std::int32_t step : plan.actors[i].steps.output_written) out.scale = std::max<std::int64_t>(out.scale, step + 1);
    for (std::size_t u = 0; u < o.units.size(); ++u)
      lanes[o.lane].emplace_back(o.units[u], o.rank, i, u);
  }
  for (auto& [lane, entries] : lanes) {
    std::sort(entries.begin(), entries.end());
    for (std::size_t k = 0; k < entries.size(); ++k) {
      const auto& [unit, rank, actor, u] = entries[k];
      out.position[actor][u] = static_cast<std::int32_t>(k);
    }
    out.acts[lane] = static_cast<std::int32_t>(entries.size());
  }
  return out;
}

/// Folds into `last_read` the positions at which the readers of `reg` (a register whose bytes
/// are those of the register written at `write`, itself or a view of it) read each micro-batch
/// m; false if some reader's position is not known (plan_memory.h).
bool reader_positions(const Plan& plan, RegisterIndex reg, const ActOrder& writer,
                      const LanePositions& lanes, const std::vector<std::int64_t>& write,
                      std::vector<std::int64_t>& last_read, std::size_t depth) {
  if (depth > plan.actors.size()) return false;
  const std::size_t units = writer.units.size();
  for (ActorIndex c : plan.registers[reg].consumers) {
    if (c >= plan.actors.size()) return false;
    const ActorDesc& a = plan.actors[c];
    if (is_view(a)) {
      // A view's readers read these bytes (ActorKind::repeat); the view itself reads nothing.
      if (a.outputs.size() != 1 ||
          !reader_positions(plan, a.outputs[0], writer, lanes, write, last_read, depth + 1))
        return false;
      continue;
    }
    if (a.kind != ActorKind::compute || a.order.lane != writer.lane || a.order.units.size() != units)
      return false;
    for (const InputPort& in : a.inputs) {
      if (in.reg == reg && in.delay != 0) return false;
    }
    const std::int64_t step = read_step(a, reg);
    for (std::size_t m = 0; m < units; ++m) {
      const std::int64_t at = lanes.position[c][m] * lanes.scale + step;
      if (at <= write[m])
        return false;  // read before it is written in the period: not a life we know
      last_read[m] = std::max(last_read[m], at);
    }
  }
  return true;
}

/// The write and last-read positions of each micro-batch m of register r within its lane's
/// period, if its life is known (plan_memory.h), else nothing.
bool piece_spans(const Plan& plan, RegisterIndex r, const LanePositions& lanes,
                 std::vector<std::int64_t>& write, std::vector<std::int64_t>& last_read) {
  const RegisterDesc& reg = plan.registers[r];
  if (reg.producer >= plan.actors.size()) return false;
  const ActorDesc& p = plan.actors[reg.producer];
  // A transfer in a lane starts writing its slot (the pull) at its act, as a kernel would.
  if ((p.kind != ActorKind::compute && p.kind != ActorKind::transfer) || p.order.lane < 0 || p.order.units.empty())
    return false;
  if (lanes.led.contains(p.order.lane)) return false;
  const auto& wpos = lanes.position[reg.producer];
  const auto [written, read] = write_steps(p, r);
  write.clear();
  last_read.clear();
  for (std::int32_t at : wpos) {
    write.push_back(at * lanes.scale + written);
    last_read.push_back(at * lanes.scale + read);  // the act's own reads of what it wrote
  }
  return reader_positions(plan, r, p.order, lanes, write, last_read, 0);
}

void sort_spans(std::vector<std::pair<std::int64_t, std::int64_t>>& spans) {
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<std::int64_t, std::int64_t>> merged;
  for (const auto& s : spans) {
    if (!merged.empty() && s.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, s.second);
    } else {
      merged.push_back(s);
    }
  }
  spans = std::move(merged);
}

/// The spans of `life` over `periods` lane periods (a multiple of its own), or folded into one
/// period when periods is 0.
std::vector<std::pair<std::int64_t, std::int64_t>> unrolled(const SlotLife& life,
                                                            std::int64_t periods) {
  const std::int64_t n = life.lane_acts;
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  if (periods == 0) {
    for (const auto& [a, b] : life.spans) out.emplace_back(a % n, a % n + (b - a));
  } else {
    for (std::int64_t k = 0; k < periods / life.period; ++k) {
      for (const auto& [a, b] : life.spans)
        out.emplace_back(a + k * life.period * n, b + k * life.period * n);
    }
  }
  sort_spans(out);
  return out;
}

bool intersect(const std::vector<std::pair<std::int64_t, std::int64_t>>& a,
               const std::vector<std::pair<std::int64_t, std::int64_t>>& b) {
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i].second < b[j].first) {
      ++i;
    } else if (b[j].second < a[i].first) {
      ++j;
    } else {
      return true;
    }
  }
  return false;
}

}  // namespace

std::int64_t slot_bytes(const RegisterDesc& reg) {
  return numel(reg.shape) * static_cast<std::int64_t>(size_of(reg.dtype));
}

std::vector<std::vector<SlotLife>> slot_lives(const Plan& plan) {
  const LanePositions lanes = lane_positions(plan);
  std::vector<std::vector<SlotLife>> out(plan.registers.size());
  std::vector<std::int64_t> write, last_read;
  for (RegisterIndex r = 0; r < plan.registers.size(); ++r) {
    const RegisterDesc& reg = plan.registers[r];
    const std::int64_t slots = std::max<std::int32_t>(reg.slots, 1);
    out[r].resize(static_cast<std::size_t>(slots));
    if (!piece_spans(plan, r, lanes, write, last_read)) continue;
    const ActOrder& o = plan.actors[reg.producer].order;
    const auto units = static_cast<std::int64_t>(o.units.size());
    const std::int64_t n = lanes.acts.at(o.lane) * lanes.scale;
    // Piece p = q * units + m is in slot p % slots; the pattern repeats after lcm(units, slots)
    // pieces. Past the cap, slot j holds micro-batch m in some period iff m = j mod gcd.
    std::int64_t periods = std::lcm(units, slots) / units;
    const bool fold = periods > max_unrolled_periods;
    if (fold) periods = 1;
    for (std::int64_t j = 0; j < slots; ++j) {
      SlotLife& life = out[r][static_cast<std::size_t>(j)];
      life.lane = o.lane;
      life.lane_acts = static_cast<std::int32_t>(n);
      life.period = static_cast<std::int32_t>(periods);
    }
    const std::int64_t g = std::gcd(units, slots);
    for (std::int64_t q = 0; q < periods; ++q) {
      for (std::int64_t m = 0; m < units; ++m) {
        const auto span = std::pair{q * n + write[static_cast<std::size_t>(m)],
                                    q * n + last_read[static_cast<std::size_t>(m)]};
        if (fold) {
          for (std::int64_t j = m % g; j < slots; j += g)
            out[r][static_cast<std::size_t>(j)].spans.push_back(span);
        } else {
          out[r][static_cast<std::size_t>((q * units + m) % slots)].spans.push_back(span);
        }
      }
    }
    for (SlotLife& life : out[r]) sort_spans(life.spans);
  }
  return out;
}

bool may_overlap(const SlotLife& a, const SlotLife& b) {
  if (a.always() || b.always() || a.lane != b.lane || a.lane_acts != b.lane_acts) return true;
  std::int64_t periods = std::lcm<std::int64_t>(a.period, b.period);
  if (periods > max_unrolled_periods) periods = 0;  // fold both into one period
  return intersect(unrolled(a, periods), unrolled(b, periods));
}

LifeTable::LifeTable(const std::vector<std::vector<SlotLife>>& lives) {
  std::map<std::int32_t, std::int64_t> periods;  // lane -> common period (0: folded)
  for (const auto& reg : lives) {
    for (const SlotLife& life : reg) {
      if (life.always()) continue;
      auto [it, fresh] = periods.emplace(life.lane, life.period);
      if (!fresh && it->second != 0) {
        it->second = std::lcm<std::int64_t>(it->second, life.period);
        if (it->second > max_unrolled_periods) it->second = 0;
      }
    }
  }
  entries_.resize(lives.size());
  for (std::size_t r = 0; r < lives.size(); ++r) {
    for (const SlotLife& life : lives[r]) {
      Entry e;
      if (!life.always()) {
        const auto spans = unrolled(life, periods.at(life.lane));
        e = Entry{life.lane, spans_.size(), spans.size()};
        spans_.insert(spans_.end(), spans.begin(), spans.end());
      }
      entries_[r].push_back(e);
    }
  }
}

bool LifeTable::meet(RegisterIndex a, std::size_t slot_a, RegisterIndex b, std::size_t slot_b,
                     bool b_starts_after_a_ends) const {
  const Entry& x = entries_[a][slot_a];
  const Entry& y = entries_[b][slot_b];
  if (x.lane < 0 || y.lane < 0 || x.lane != y.lane) return true;
  std::size_t i = x.first, j = y.first;
  const std::size_t i_end = x.first + x.count, j_end = y.first + y.count;
  while (i < i_end && j < j_end) {
    // In place, b's piece is written by the act that last reads a's: a span of a that ends
    // where one of b begins has ended (the act reads before it writes, element by element).
    if (spans_[i].second < spans_[j].first ||
        (b_starts_after_a_ends && spans_[i].second == spans_[j].first)) {
      ++i;
    } else if (spans_[j].second < spans_[i].first) {
      ++j;
    } else {
      return true;
    }
  }
  return false;
}

bool LifeTable::may_overlap(RegisterIndex a, std::size_t slot_a, RegisterIndex b,
                            std::size_t slot_b) const {
  return meet(a, slot_a, b, slot_b, false);
}

bool LifeTable::may_overlap_in_place(RegisterIndex in, std::size_t slot_in, RegisterIndex out,
                                     std::size_t slot_out) const {
  return meet(in, slot_in, out, slot_out, true);
}

bool in_place_of_each_other(const std::vector<InPlacePair>& pairs, const LifeTable& lives, RegisterIndex a,
                            std::size_t slot_a, RegisterIndex b, std::size_t slot_b) {
  for (const InPlacePair& p : pairs) {
    if (p.input == a && p.output == b && !lives.may_overlap_in_place(a, slot_a, b, slot_b)) return true;
    if (p.input == b && p.output == a && !lives.may_overlap_in_place(b, slot_b, a, slot_a)) return true;
  }
  return false;
}

std::vector<InPlacePair> in_place_pairs(const Plan& plan) {
  std::vector<InPlacePair> out;
  for (const ActorDesc& a : plan.actors) {
    if (a.kind != ActorKind::compute) continue;
    for (const InPlace& p : a.in_place) {
      if (p.output >= a.outputs.size() || p.input >= a.inputs.size() || a.inputs[p.input].delay != 0) continue;
      const RegisterIndex in = a.inputs[p.input].reg, o = a.outputs[p.output];
      if (in >= plan.registers.size() || o >= plan.registers.size() || in == o) continue;
      const RegisterMemory mi = register_memory(plan, in), mo = register_memory(plan, o);
      if (!mi.allocated || !mo.allocated || mi.pinned || mo.pinned || mi.rank != mo.rank ||
          mi.device != mo.device || slot_bytes(plan.registers[in]) != slot_bytes(plan.registers[o]) ||
          slot_bytes(plan.registers[o]) == 0)
        continue;
      const InPlacePair pair{in, o};
      if (std::find(out.begin(), out.end(), pair) == out.end()) out.push_back(pair);
    }
  }
  return out;
}

RegisterMemory register_memory(const Plan& plan, RegisterIndex r) {
  const RegisterDesc& reg = plan.registers[r];
  RegisterMemory out;
  if (reg.producer >= plan.actors.size()) return out;
  const ActorDesc& p = plan.actors[reg.producer];
  if (p.kind == ActorKind::repeat) return out;
  out.allocated = true;
  out.rank = p.where.rank;
  out.device = p.where.device;
  // As the runtime's Core::allocator_for: a CUDA producer's registers are device memory, unless
  // it copies to the host; what crosses between host and device is page-locked host memory.
  // (A sim device's memory is host memory: nothing of it is page-locked.)
  if (p.where.device.type == DeviceType::cuda && p.copy != CopyDirection::to_host) return out;
  if ((p.copy == CopyDirection::to_host && p.where.device.type == DeviceType::cuda) || copied_to_cuda(plan, r)) {
    out.pinned = true;
    out.device = Device{DeviceType::cpu, p.where.device.index};
  } else if (reg.kernel_memory) {
    out.allocated = false;  // the kernel's (page-locked memory above stays the runtime's)
  }
  return out;
}

MemoryCategory register_category(const Plan& plan, RegisterIndex r) {
  for (int hops = 0; hops < 8 && r < plan.registers.size(); ++hops) {
    const ActorIndex producer = plan.registers[r].producer;
    if (producer >= plan.actors.size()) return MemoryCategory::other;
    const ActorDesc& p = plan.actors[producer];
    const bool mover = p.kind == ActorKind::transfer || p.copy != CopyDirection::none;
    if (mover && !p.inputs.empty()) {
      r = p.inputs[0].reg;
      continue;
    }
    // Said by the actor (a ZeRO-3 weight gathered for its pass is a weight, though its gather
    // acts in the pass).
    if (p.memory) return *p.memory;
    switch (p.role) {
      case ActorRole::update:
        return MemoryCategory::weights;
      case ActorRole::data:
      case ActorRole::forward:
        return MemoryCategory::activations;
      case ActorRole::backward:
      case ActorRole::collective:
        return MemoryCategory::gradients;
      default:
        return p.kind == ActorKind::repeat ? MemoryCategory::weights : MemoryCategory::other;
    }
  }
  return MemoryCategory::other;
}

void check_memory(const Plan& plan, std::vector<std::string>& problems) {
  const std::size_t before = problems.size();
  auto problem = [&]<class... A>(fmt::format_string<A...> f, A&&... args) {
    problems.push_back(fmt::format(f, std::forward<A>(args)...));
  };
  for (RegisterIndex r = 0; r < plan.registers.size(); ++r) {
    const RegisterDesc& reg = plan.registers[r];
    if (reg.arena < 0 && reg.offsets.empty()) continue;
    if (reg.arena < 0 || static_cast<std::size_t>(reg.arena) >= plan.arenas.size()) {
      problem("register '{}' is placed in arena {}, which does not exist ({} arenas)", reg.name,
              reg.arena, plan.arenas.size());
      continue;
    }
    const ArenaDesc& arena = plan.arenas[static_cast<std::size_t>(reg.arena)];
    const RegisterMemory mem = register_memory(plan, r);
    if (!mem.allocated) {
      problem(
          "register '{}' is placed in arena {}, but the runtime allocates no slots for it (a "
          "repeat's output aliases its input; a kernel's memory is the kernel's)",
          reg.name, reg.arena);
    } else if (mem.pinned) {
      problem(
          "register '{}' is placed in arena {}, but it is copied between host and device and needs "
          "page-locked "
          "memory of its own",
          reg.name, reg.arena);
    } else if (mem.rank != arena.rank || mem.device != arena.device) {
      problem("register '{}' lives on r{}/{} but is placed in arena {} on r{}/{}", reg.name,
              mem.rank, mem.device.str(), reg.arena, arena.rank, arena.device.str());
    }
    if (reg.offsets.size() != static_cast<std::size_t>(std::max(reg.slots, 0))) {
      problem("register '{}' has {} slots but {} offsets", reg.name, reg.slots, reg.offsets.size());
      continue;
    }
    const std::int64_t bytes = slot_bytes(reg);
    for (std::size_t s = 0; s < reg.offsets.size(); ++s) {
      const std::int64_t at = reg.offsets[s];
      if (at < 0 || at % arena_alignment != 0 || at + bytes > arena.bytes) {
        problem(
            "register '{}' slot {} at offset {} ({} bytes) is not inside arena {} ({} bytes) at a "
            "multiple of {}",
            reg.name, s, at, bytes, reg.arena, arena.bytes, arena_alignment);
      }
    }
  }
  if (problems.size() != before) return;
  // Slots that share bytes must never be live at once: sweep each arena by offset.
  const LifeTable lives(slot_lives(plan));
  struct Block {
    std::int64_t begin, end;
    RegisterIndex reg;
    std::size_t slot;
  };
  std::map<std::int32_t, std::vector<Block>> arenas;
  for (RegisterIndex r = 0; r < plan.registers.size(); ++r) {
    const RegisterDesc& reg = plan.registers[r];
    const std::int64_t bytes = slot_bytes(reg);
    if (reg.arena < 0 || bytes == 0) continue;
    for (std::size_t s = 0; s < reg.offsets.size(); ++s)
      arenas[reg.arena].push_back({reg.offsets[s], reg.offsets[s] + bytes, r, s});
  }
  const auto pairs = in_place_pairs(plan);
  // Two blocks at the same bytes that an act computes in place (one its input, the other its
  // output) may touch at that act.
  auto in_place = [&](const Block& a, const Block& b) {
    return a.begin == b.begin && a.end == b.end && in_place_of_each_other(pairs, lives, a.reg, a.slot, b.reg, b.slot);
  };
  int reported = 0;
  for (auto& [arena, blocks] : arenas) {
    std::sort(blocks.begin(), blocks.end(),
              [](const Block& a, const Block& b) { return a.begin < b.begin; });
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      for (std::size_t k = i + 1; k < blocks.size() && blocks[k].begin < blocks[i].end; ++k) {
        const Block &a = blocks[i], &b = blocks[k];
        if (!lives.may_overlap(a.reg, a.slot, b.reg, b.slot) || in_place(a, b)) continue;
        if (++reported > 8) return;
        problem(
            "registers '{}' (slot {}) and '{}' (slot {}) share bytes [{}, {}) of arena {} but may "
            "be live at once",
            plan.registers[a.reg].name, a.slot, plan.registers[b.reg].name, b.slot,
            std::max(a.begin, b.begin), std::min(a.end, b.end), arena);
      }
    }
  }
}

std::int64_t DeviceMemory::total() const {
  std::int64_t sum = slack;
  for (std::int64_t b : bytes) sum += b;
  return sum;
}

namespace {

/// A planned slot whose life a lane knows; `in_place_of`: the life of the input slot whose very
/// bytes it was given (InPlacePair), if any.
struct LaneSlot {
  RegisterIndex reg;
  const SlotLife* life;
  std::int64_t bytes;
  const SlotLife* in_place_of = nullptr;
};

/// The moment of `slots` (one lane's, on one device) when the most bytes are live: the bytes
/// then, charged to the registers live then (added to `charged`). Moments are half acts: an act
/// at position p reads at 2p; an output it writes in place of an input it read last is live
/// from 2p + 1 (the same bytes: counted once), any other output from 2p.
std::int64_t lane_peak(const std::vector<LaneSlot>& slots, std::vector<std::int64_t>& charged) {
  if (slots.empty()) return 0;
  std::int64_t periods = 1;
  for (const LaneSlot& s : slots) periods = std::lcm<std::int64_t>(periods, s.life->period);
  if (periods > max_unrolled_periods) periods = 0;  // folded: an upper bound of each moment
  const std::int64_t n = slots[0].life->lane_acts;
  std::vector<std::int64_t> delta(
      static_cast<std::size_t>(2 * n * std::max<std::int64_t>(periods, 1) + 2), 0);
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> spans;
  for (const LaneSlot& s : slots) {
    std::vector<std::pair<std::int64_t, std::int64_t>> ends;  // the input's, where in place
    if (s.in_place_of != nullptr) ends = unrolled(*s.in_place_of, periods);
    spans.push_back(unrolled(*s.life, periods));
    for (auto& [a, b] : spans.back()) {
      const bool late = std::any_of(ends.begin(), ends.end(), [a = a](const auto& e) { return e.second == a; });
      a = 2 * a + (late ? 1 : 0);
      b = 2 * b;
      delta[static_cast<std::size_t>(a)] += s.bytes;
      delta[static_cast<std::size_t>(b + 1)] -= s.bytes;
    }
  }
  std::int64_t live = 0, peak = 0, when = 0;
  for (std::size_t t = 0; t + 1 < delta.size(); ++t) {
    live += delta[t];
    if (live > peak) {
      peak = live;
      when = static_cast<std::int64_t>(t);
    }
  }
  for (std::size_t i = 0; i < slots.size(); ++i) {
    for (const auto& [a, b] : spans[i]) {
      if (a <= when && when <= b) charged[slots[i].reg] += slots[i].bytes;
    }
  }
  return peak;
}

}  // namespace

std::vector<DeviceMemory> memory_report(const Plan& plan, std::size_t consumers) {
  using Key = std::pair<std::uint16_t, Device>;
  std::map<Key, DeviceMemory> devices;
  auto at = [&](std::uint16_t rank, Device d) -> DeviceMemory& {
    DeviceMemory& m = devices[{rank, d}];
    m.rank = rank;
    m.device = d;
    return m;
  };
  std::map<Key, std::int64_t> arena_bytes, placed_live;
  for (const ArenaDesc& a : plan.arenas) {
    at(a.rank, a.device).registers += a.bytes;
    arena_bytes[{a.rank, a.device}] += a.bytes;
  }
  const auto lives = slot_lives(plan);
  std::vector<std::int64_t> charged(plan.registers.size(), 0);
  std::map<std::pair<Key, std::int32_t>, std::vector<LaneSlot>> lanes;
  // Output slots given their input slot's very bytes (InPlacePair): [register][slot].
  std::map<std::pair<RegisterIndex, std::size_t>, const SlotLife*> in_place_of;
  for (const InPlacePair& p : in_place_pairs(plan)) {
    const RegisterDesc &in = plan.registers[p.input], &out = plan.registers[p.output];
    if (in.arena < 0 || in.arena != out.arena) continue;
    for (std::size_t so = 0; so < out.offsets.size() && so < lives[p.output].size(); ++so) {
      for (std::size_t si = 0; si < in.offsets.size() && si < lives[p.input].size(); ++si) {
        if (in.offsets[si] == out.offsets[so]) in_place_of[{p.output, so}] = &lives[p.input][si];
      }
    }
  }
  for (RegisterIndex r = 0; r < plan.registers.size(); ++r) {
    const RegisterDesc& reg = plan.registers[r];
    const RegisterMemory mem = register_memory(plan, r);
    const std::int64_t bytes = slot_bytes(reg);
    if (!mem.allocated || bytes == 0) continue;
    DeviceMemory& m = at(mem.rank, mem.device);
    if (reg.arena < 0) {
      m.registers += bytes * reg.slots;
      charged[r] += bytes * reg.slots;
      continue;
    }
    for (std::size_t s = 0; s < lives[r].size(); ++s) {
      if (lives[r][s].always()) {
        charged[r] += bytes;
        placed_live[{mem.rank, mem.device}] += bytes;
      } else {
        auto partner = in_place_of.find({r, s});
        lanes[{{mem.rank, mem.device}, lives[r][s].lane}].push_back(
            {r, &lives[r][s], bytes, partner == in_place_of.end() ? nullptr : partner->second});
      }
    }
  }
  for (const auto& [key, slots] : lanes) placed_live[key.first] += lane_peak(slots, charged);
  std::map<Key, std::vector<DeviceMemory::Consumer>> who;
  for (RegisterIndex r = 0; r < plan.registers.size(); ++r) {
    if (charged[r] == 0) continue;
    const RegisterMemory mem = register_memory(plan, r);
    const MemoryCategory c = register_category(plan, r);
    at(mem.rank, mem.device).bytes[static_cast<std::size_t>(c)] += charged[r];
    who[{mem.rank, mem.device}].push_back({plan.registers[r].name, c, charged[r]});
  }
  for (const ActorDesc& a : plan.actors) {
    for (const KeptBytes& k : a.kept) {
      DeviceMemory& m = at(a.where.rank, a.where.device);
      m.bytes[static_cast<std::size_t>(k.category)] += k.bytes;
      m.kept += k.bytes;
      who[{a.where.rank, a.where.device}].push_back({a.name, k.category, k.bytes});
    }
  }
  std::vector<DeviceMemory> out;
  for (auto& [key, m] : devices) {
    m.slack = arena_bytes[key] - placed_live[key];
    auto& list = who[key];
    std::stable_sort(list.begin(), list.end(),
                     [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
    if (list.size() > consumers) list.resize(consumers);
    m.largest = std::move(list);
    out.push_back(std::move(m));
  }
  return out;
}

std::string format_bytes(std::int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes < 1024) return fmt::format("{} B", bytes);
  if (bytes < (1 << 20)) return fmt::format("{:.1f} KiB", b / 1024);
  if (bytes < (std::int64_t{1} << 30)) return fmt::format("{:.1f} MiB", b / (1 << 20));
  return fmt::format("{:.2f} GiB", b / static_cast<double>(std::int64_t{1} << 30));
}

std::string to_text(const std::vector<DeviceMemory>& report) {
  std::string out;
  for (const DeviceMemory& m : report) {
    out += fmt::format("r{}/{} peak {}:", m.rank, m.device.str(), format_bytes(m.total()));
    for (std::size_t c = 0; c < memory_categories; ++c) {
      out += fmt::format(" {} {},", name(static_cast<MemoryCategory>(c)), format_bytes(m.bytes[c]));
    }
    out += fmt::format(" arena slack {} (registers allocate {})\n", format_bytes(m.slack),
                       format_bytes(m.registers));
    for (const auto& c : m.largest)
      out += fmt::format("  {} {} ({})\n", format_bytes(c.bytes), c.name, name(c.category));
  }
  return out;
}

}  // namespace baton
