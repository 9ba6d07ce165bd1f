#include "baton/graph/schedule.h"

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <optional>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/graph/graph.h"

namespace baton {

PipelineSchedule parse_schedule(std::string_view s) {
  if (s == "gpipe") return PipelineSchedule::gpipe;
  if (s == "1f1b") return PipelineSchedule::one_f_one_b;
  if (s == "interleaved") return PipelineSchedule::interleaved;
  if (s == "zb-h1") return PipelineSchedule::zb_h1;
  if (s == "2bw") return PipelineSchedule::two_bw;
  if (s == "zb-v") return PipelineSchedule::zb_v;
  throw GraphError(fmt::format("schedule '{}': {}", s, schedule_names()));
}

std::string_view schedule_names() { return "gpipe, 1f1b, interleaved, zb-h1, zb-v or 2bw"; }

std::string_view name(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::gpipe: return "gpipe";
    case PipelineSchedule::one_f_one_b: return "1f1b";
    case PipelineSchedule::interleaved: return "interleaved";
    case PipelineSchedule::zb_h1: return "zb-h1";
    case PipelineSchedule::two_bw: return "2bw";
    case PipelineSchedule::zb_v: return "zb-v";
  }
  return "?";
}

int chunks_per_device(PipelineSchedule s, int virtual_stages) {
  if (s == PipelineSchedule::zb_v) return 2;
  return s == PipelineSchedule::interleaved ? virtual_stages : 1;
}

bool splits_backward(PipelineSchedule s) { return s == PipelineSchedule::zb_h1 || s == PipelineSchedule::zb_v; }

// ZB-V's V: device d holds stage d (chunk 0) and stage 2 devices - 1 - d (chunk 1).
int stage_of(PipelineSchedule s, int devices, int device, int chunk) {
  if (s == PipelineSchedule::zb_v) return chunk == 0 ? device : 2 * devices - 1 - device;
  return chunk * devices + device;
}
int device_of_stage(PipelineSchedule s, int devices, int stage) {
  if (s == PipelineSchedule::zb_v) return stage < devices ? stage : 2 * devices - 1 - stage;
  return stage % devices;
}
int chunk_of_stage(PipelineSchedule s, int devices, int stage) {
  if (s == PipelineSchedule::zb_v) return stage < devices ? 0 : 1;
  return stage / devices;
}

std::string PipelineUnit::str(bool chunks) const {
  const char p = pass == Pass::forward ? 'F' : pass == Pass::backward ? 'B' : 'W';
  return chunks ? fmt::format("{}{}.{}", p, microbatch, chunk) : fmt::format("{}{}", p, microbatch);
}

std::string schedule_refusal(PipelineSchedule s, int devices, int v, std::int64_t m) {
  if (devices < 1) return fmt::format("a pipeline needs at least one device, not {}", devices);
  if (m < 1) return fmt::format("a step needs at least one micro-batch, not {}", m);
  if (s == PipelineSchedule::interleaved) {
    if (v < 2) {
      return fmt::format("schedule 'interleaved' needs at least 2 virtual stages per device, not {} (1 is 1f1b)", v);
    }
    if (m % devices != 0) {
      return fmt::format(
          "schedule 'interleaved' runs micro-batches in groups of the {} devices: {} micro-batches is not a multiple "
          "of {}",
          devices, m, devices);
    }
  } else if (v != 1 && s == PipelineSchedule::zb_v) {
    return fmt::format("schedule 'zb-v' places two stages per device, in a V; virtual stages {} are for 'interleaved'",
                       v);
  } else if (v != 1) {
    return fmt::format("schedule '{}' has one stage per device; virtual stages {} are for 'interleaved'", name(s), v);
  }
  return "";
}

namespace {

/// 1F1B's shape: `warmup` forwards, then forward and backward in turn, then the backwards left
/// (GPipe: every forward a warm-up one). Megatron's forward_backward_pipelining_without_interleaving.
std::vector<PipelineUnit> one_f_one_b(std::int64_t m, std::int64_t warmup) {
  std::vector<PipelineUnit> seq;
  for (std::int64_t i = 0; i < warmup; ++i) seq.push_back({Pass::forward, i});
  for (std::int64_t j = 0; j + warmup < m; ++j) {
    seq.push_back({Pass::forward, warmup + j});
    seq.push_back({Pass::backward, j});
  }
  for (std::int64_t j = m - warmup; j < m; ++j) seq.push_back({Pass::backward, j});
  return seq;
}

/// Megatron's forward_backward_pipelining_with_interleaving: unit k of the device's v M
/// forwards is micro-batch (k / (p v)) p + k mod p of chunk (k mod p v) / p; backwards walk the
/// chunks the other way. Warm-up (p - d - 1) 2 + (v - 1) p units, then one forward and one
/// backward in turn.
std::vector<PipelineUnit> interleaved(int p, int d, std::int64_t m, int v) {
  const std::int64_t total = m * v, group = static_cast<std::int64_t>(p) * v;
  auto unit = [&](Pass pass, std::int64_t k) {
    const int chunk = static_cast<int>((k % group) / p);
    return PipelineUnit{pass, (k / group) * p + k % p, pass == Pass::forward ? chunk : v - 1 - chunk};
  };
  const std::int64_t warmup = std::min<std::int64_t>(total, (p - d - 1) * 2 + static_cast<std::int64_t>(v - 1) * p);
  std::vector<PipelineUnit> seq;
  for (std::int64_t k = 0; k < warmup; ++k) seq.push_back(unit(Pass::forward, k));
  for (std::int64_t j = 0; j + warmup < total; ++j) {
    seq.push_back(unit(Pass::forward, warmup + j));
    seq.push_back(unit(Pass::backward, j));
  }
  for (std::int64_t j = total - warmup; j < total; ++j) seq.push_back(unit(Pass::backward, j));
  return seq;
}

/// ZB-H1 (Qi et al. 2024; the authors' handcrafted schedule with exact semantics): p - d - 1
/// warm-up forwards, d times F B (W held back), F B W while forwards remain, B W while
/// backwards remain, then the W's held back.
std::vector<PipelineUnit> zb_h1(int p, int d, std::int64_t m) {
  std::vector<PipelineUnit> seq;
  std::int64_t f = 0, b = 0, w = 0;
  for (int i = 0; i < p - d - 1 && f < m; ++i) seq.push_back({Pass::forward, f++});
  for (int i = 0; i < d && f < m; ++i) {
    seq.push_back({Pass::forward, f++});
    seq.push_back({Pass::backward, b++});
  }
  while (f < m) {
    seq.push_back({Pass::forward, f++});
    seq.push_back({Pass::backward, b++});
    seq.push_back({Pass::weight, w++});
  }
  while (b < m) {
    seq.push_back({Pass::backward, b++});
    seq.push_back({Pass::weight, w++});
  }
  while (w < m) seq.push_back({Pass::weight, w++});
  return seq;
}

/// ZB-V's order (Qi et al. 2024, section 5), our own construction, not the authors' (their
/// zbv.py searches further): the step played unit by unit with F = B = W = 1; at each unit every
/// device takes, of the units whose inputs are done, its oldest ready B (chunk 0's B of a
/// micro-batch comes after chunk 1's: the critical path), else, while it holds fewer than
/// 2 devices chunk activations (forward done, W not), a ready F, chunk 1's first (it ends a
/// forward that backwards wait for), chunk 0's in the warm-up; else a W (filling what would be
/// idle, and freeing memory at the cap). Each pass of a stage runs in micro-batch order.
std::vector<std::vector<PipelineUnit>> zb_v(int p, std::int64_t m) {
  const int stages = 2 * p;
  const std::int64_t cap = 2 * static_cast<std::int64_t>(p);
  // When each (stage, pass, micro-batch) ends, in units; -1 before it is placed.
  std::vector<std::array<std::vector<std::int64_t>, 3>> ends(static_cast<std::size_t>(stages));
  for (auto& e : ends) {
    for (auto& pass : e) pass.assign(static_cast<std::size_t>(m), -1);
  }
  auto done = [&](int stage, Pass pass, std::int64_t k, std::int64_t t) {
    const std::int64_t e = ends[static_cast<std::size_t>(stage)][static_cast<std::size_t>(pass)][static_cast<std::size_t>(k)];
    return e >= 0 && e <= t;
  };
  // By device, chunk and pass: the next micro-batch.
  std::vector<std::array<std::array<std::int64_t, 3>, 2>> next(static_cast<std::size_t>(p));
  std::vector<std::vector<PipelineUnit>> seqs(static_cast<std::size_t>(p));
  const std::int64_t units = 6 * m * p;
  for (std::int64_t t = 0, placed = 0; placed < units; ++t) {
    std::vector<PipelineUnit> picks;
    for (int d = 0; d < p; ++d) {
      auto& n = next[static_cast<std::size_t>(d)];
      auto nx = [&](int c, Pass pass) { return n[static_cast<std::size_t>(c)][static_cast<std::size_t>(pass)]; };
      const std::int64_t live = nx(0, Pass::forward) - nx(0, Pass::weight) + nx(1, Pass::forward) - nx(1, Pass::weight);
      std::optional<PipelineUnit> pick;
      for (int c : {0, 1}) {
        const int st = stage_of(PipelineSchedule::zb_v, p, d, c);
        const std::int64_t k = nx(c, Pass::backward);
        if (!pick && k < nx(c, Pass::forward) && (st == stages - 1 || done(st + 1, Pass::backward, k, t))) {
          pick = PipelineUnit{Pass::backward, k, c};
        }
      }
      for (int c : {1, 0}) {
        const int st = stage_of(PipelineSchedule::zb_v, p, d, c);
        const std::int64_t k = nx(c, Pass::forward);
        if (!pick && live < cap && k < m && (st == 0 || done(st - 1, Pass::forward, k, t))) {
          pick = PipelineUnit{Pass::forward, k, c};
        }
      }
      for (int c : {1, 0}) {
        if (!pick && nx(c, Pass::weight) < nx(c, Pass::backward)) pick = PipelineUnit{Pass::weight, nx(c, Pass::weight), c};
      }
      if (!pick) continue;
      picks.push_back(*pick);
      const int st = stage_of(PipelineSchedule::zb_v, p, d, pick->chunk);
      ends[static_cast<std::size_t>(st)][static_cast<std::size_t>(pick->pass)][static_cast<std::size_t>(pick->microbatch)] =
          t + 1;
      ++n[static_cast<std::size_t>(pick->chunk)][static_cast<std::size_t>(pick->pass)];
      seqs[static_cast<std::size_t>(d)].push_back(*pick);
    }
    if (picks.empty()) throw GraphError(fmt::format("schedule 'zb-v': no device can move at unit {}", t));
    placed += static_cast<std::int64_t>(picks.size());
  }
  return seqs;
}

}  // namespace

std::vector<PipelineUnit> device_sequence(PipelineSchedule s, int devices, int device, std::int64_t m, int v) {
  if (device < 0 || device >= devices) {
    throw GraphError(fmt::format("device_sequence: device {} of {}", device, devices));
  }
  if (std::string why = schedule_refusal(s, devices, v, m); !why.empty()) throw GraphError(why);
  switch (s) {
    case PipelineSchedule::gpipe: return one_f_one_b(m, m);
    case PipelineSchedule::one_f_one_b:
    case PipelineSchedule::two_bw: return one_f_one_b(m, std::min<std::int64_t>(devices - device - 1, m));
    case PipelineSchedule::interleaved: return interleaved(devices, device, m, v);
    case PipelineSchedule::zb_h1: return zb_h1(devices, device, m);
    case PipelineSchedule::zb_v: return zb_v(devices, m)[static_cast<std::size_t>(device)];
  }
  return {};
}

std::vector<PipelineUnit> stage_sequence(PipelineSchedule s, int stages, int stage, std::int64_t m) {
  if (stages < 1 || stage < 0 || stage >= stages || m < 1) {
    throw GraphError(fmt::format("stage_sequence: stage {} of {} with {} micro-batches", stage, stages, m));
  }
  return device_sequence(s, stages, stage, m, 1);
}

namespace {

/// The sequences played with unit costs for `steps` steps: each device runs its sequence in
/// order, step after step; a unit starts when its device is free and what it reads is done: F
/// after the stage before's F (and, from the second step on, after the step before's last
/// update of its stage's weights: its last W, or B where unsplit), B after its own F and the
/// next stage's B (the last stage's after its F), W after its B.
struct Timeline {
  struct Ends {
    std::array<double, 3> end{-1, -1, -1};  // F, B, W
  };
  std::int64_t m = 0;
  std::vector<std::vector<Ends>> ends;  // [stage][step * m + micro-batch]
  std::vector<double> free, busy;       // by device
  std::string problem;
  const Ends& at(int stage, std::int64_t k) const {
    return ends[static_cast<std::size_t>(stage)][static_cast<std::size_t>(k)];
  }
};

Timeline timeline(PipelineSchedule s, int p, std::int64_t m, int v, const std::vector<std::vector<PipelineUnit>>& seqs,
                  UnitCosts costs, int steps) {
  const int chunks = chunks_per_device(s, v), stages = p * chunks;
  const bool split = splits_backward(s);
  constexpr double not_yet = -1;
  Timeline out;
  out.m = m;
  out.ends.assign(static_cast<std::size_t>(stages), std::vector<Timeline::Ends>(static_cast<std::size_t>(m * steps)));
  std::vector<std::size_t> at(static_cast<std::size_t>(p), 0);
  out.free.assign(static_cast<std::size_t>(p), 0);
  out.busy.assign(static_cast<std::size_t>(p), 0);
  // What each device's next unit waits for, while it waits: (stage, pass).
  std::vector<std::pair<int, Pass>> waits_for(static_cast<std::size_t>(p), {-1, Pass::forward});
  const double b_cost = split ? costs.backward : costs.backward + costs.weight;
  const Pass last_pass = split ? Pass::weight : Pass::backward;
  for (bool moved = true; moved;) {
    moved = false;
    for (int d = 0; d < p; ++d) {
      const auto& seq = seqs[static_cast<std::size_t>(d)];
      const std::size_t n = seq.size() * static_cast<std::size_t>(steps);
      for (std::size_t& k = at[static_cast<std::size_t>(d)]; k < n; ++k) {
        const PipelineUnit& u = seq[k % seq.size()];
        const std::int64_t step = static_cast<std::int64_t>(k / seq.size());
        const int st = stage_of(s, p, d, u.chunk);
        const std::int64_t i = step * m + u.microbatch;
        double ready = 0;
        auto after = [&](int stage, Pass pass, std::int64_t piece) {
          const double e = out.at(stage, piece).end[static_cast<std::size_t>(pass)];
          if (e == not_yet) {
            waits_for[static_cast<std::size_t>(d)] = {stage, pass};
            return false;
          }
          ready = std::max(ready, e);
          return true;
        };
        bool ok = true;
        double cost = costs.forward;
        if (u.pass == Pass::forward) {
          ok = (st == 0 || after(st - 1, Pass::forward, i)) && (step == 0 || after(st, last_pass, step * m - 1));
        } else if (u.pass == Pass::backward) {
          ok = after(st, Pass::forward, i) && (st == stages - 1 || after(st + 1, Pass::backward, i));
          cost = b_cost;
        } else {
          ok = after(st, Pass::backward, i);
          cost = costs.weight;
        }
        if (!ok) break;
        double& free = out.free[static_cast<std::size_t>(d)];
        const double start = std::max(ready, free);
        free = start + cost;
        out.busy[static_cast<std::size_t>(d)] += cost;
        out.ends[static_cast<std::size_t>(st)][static_cast<std::size_t>(i)].end[static_cast<std::size_t>(u.pass)] =
            start + cost;
        moved = true;
      }
    }
  }
  std::vector<std::string> stuck;
  for (int d = 0; d < p; ++d) {
    const auto& seq = seqs[static_cast<std::size_t>(d)];
    const std::size_t k = at[static_cast<std::size_t>(d)];
    if (k < seq.size() * static_cast<std::size_t>(steps)) {
      const PipelineUnit& u = seq[k % seq.size()];
      const auto [stage, pass] = waits_for[static_cast<std::size_t>(d)];
      const PipelineUnit dep{pass, u.microbatch, chunk_of_stage(s, p, stage)};
      stuck.push_back(fmt::format("device {} waits at {} of stage {} (unit {} of its order) for {} of stage {}, which "
                                  "device {} has not reached",
                                  d, u.str(), stage_of(s, p, d, u.chunk), k % seq.size(), dep.str(), stage,
                                  device_of_stage(s, p, stage)));
    }
  }
  if (!stuck.empty()) out.problem = fmt::format("the order cannot run: {}", fmt::join(stuck, "; "));
  return out;
}

}  // namespace

ScheduleAnalysis analyse_sequences(PipelineSchedule s, int p, std::int64_t m, int v,
                                   const std::vector<std::vector<PipelineUnit>>& seqs, UnitCosts costs) {
  ScheduleAnalysis out;
  const int chunks = chunks_per_device(s, v), stages = p * chunks;
  const bool split = splits_backward(s);
  const auto S = static_cast<std::size_t>(stages);
  out.stage_depth.assign(S, 0);
  out.device_peak.assign(static_cast<std::size_t>(p), 0);
  out.device_idle.assign(static_cast<std::size_t>(p), 0.0);
  if (seqs.size() != static_cast<std::size_t>(p)) {
    out.problem = fmt::format("{} sequences for {} devices", seqs.size(), p);
    return out;
  }
  // Each stage's units in order: every (pass, micro-batch) once, each pass in micro-batch order
  // (registers are FIFO), a W only where the schedule splits the backward.
  const int passes = split ? 3 : 2;
  for (int d = 0; d < p && out.problem.empty(); ++d) {
    std::vector<std::array<std::int64_t, 3>> next(static_cast<std::size_t>(chunks), {0, 0, 0});
    for (const PipelineUnit& u : seqs[static_cast<std::size_t>(d)]) {
      const auto pi = static_cast<std::size_t>(u.pass);
      if (u.chunk < 0 || u.chunk >= chunks || static_cast<int>(pi) >= passes) {
        out.problem = fmt::format("device {} runs {}, which this schedule has no place for", d, u.str(chunks > 1));
        break;
      }
      std::int64_t& want = next[static_cast<std::size_t>(u.chunk)][pi];
      if (u.microbatch != want) {
        out.problem = fmt::format(
            "device {} runs {} where its stage {} needs micro-batch {} of that pass next (registers are FIFO)", d,
            u.str(chunks > 1), stage_of(s, p, d, u.chunk), want);
        break;
      }
      ++want;
    }
    for (int c = 0; c < chunks && out.problem.empty(); ++c) {
      for (int pi = 0; pi < passes; ++pi) {
        if (next[static_cast<std::size_t>(c)][static_cast<std::size_t>(pi)] != m) {
          out.problem = fmt::format("device {} runs {} of the {} {} units of stage {}", d,
                                    next[static_cast<std::size_t>(c)][static_cast<std::size_t>(pi)], m,
                                    "FBW"[pi], stage_of(s, p, d, c));
          break;
        }
      }
    }
  }
  if (!out.problem.empty()) return out;
  // Depths: after each forward, the micro-batches a stage holds (forward done, last unit not).
  for (int d = 0; d < p; ++d) {
    std::vector<std::int32_t> live(static_cast<std::size_t>(chunks), 0);
    std::int32_t total = 0;
    for (const PipelineUnit& u : seqs[static_cast<std::size_t>(d)]) {
      const auto st = static_cast<std::size_t>(stage_of(s, p, d, u.chunk));
      auto& l = live[static_cast<std::size_t>(u.chunk)];
      if (u.pass == Pass::forward) {
        ++l;
        ++total;
        out.stage_depth[st] = std::max(out.stage_depth[st], l);
        out.device_peak[static_cast<std::size_t>(d)] = std::max(out.device_peak[static_cast<std::size_t>(d)], total);
      } else if (u.pass == (split ? Pass::weight : Pass::backward)) {
        --l;
        --total;
      }
    }
  }
  // One step, for the bubble; two, for what the registers hold across a step's end (a step's
  // forwards may begin while the step before's last W's still read its registers).
  const Timeline one = timeline(s, p, m, v, seqs, costs, 1);
  if (!one.problem.empty()) {
    out.problem = one.problem;
    return out;
  }
  const double makespan = *std::max_element(one.free.begin(), one.free.end());
  for (int d = 0; d < p; ++d) {
    out.device_idle[static_cast<std::size_t>(d)] =
        makespan > 0 ? 1.0 - one.busy[static_cast<std::size_t>(d)] / makespan : 0;
    out.idle += out.device_idle[static_cast<std::size_t>(d)] / p;
  }
  const Timeline two = timeline(s, p, m, v, seqs, costs, 2);
  // A register a stage's forward writes is taken when its F starts and given back when the
  // last of its possible readers is done: the stage's own B and W, the next stage's F, B and
  // W. One its backward writes: from its B's start until the stage before's B and W and its own
  // W are done.
  out.forward_held.assign(S, 0);
  out.backward_held.assign(S, 0);
  for (int st = 0; st < stages; ++st) {
    const auto i = static_cast<std::size_t>(st);
    std::vector<std::pair<double, int>> fwd, bwd;  // (time, +1 take / -1 give back)
    for (std::int64_t k = 0; k < 2 * m; ++k) {
      const auto& here = two.at(st, k);
      double last = std::max(here.end[1], split ? here.end[2] : 0.0);
      if (st + 1 < stages) {
        const auto& next = two.at(st + 1, k);
        last = std::max({last, next.end[0], next.end[1], split ? next.end[2] : 0.0});
      }
      fwd.push_back({here.end[0] - costs.forward, 1});
      fwd.push_back({last, -1});
      double last_b = split ? here.end[2] : 0.0;
      if (st > 0) {
        const auto& before = two.at(st - 1, k);
        last_b = std::max({last_b, before.end[1], split ? before.end[2] : 0.0});
      }
      bwd.push_back({here.end[1] - (split ? costs.backward : costs.backward + costs.weight), 1});
      bwd.push_back({std::max(last_b, here.end[1]), -1});
    }
    auto peak = [](std::vector<std::pair<double, int>>& ev) {
      std::sort(ev.begin(), ev.end());  // at equal times, give back (-1) before taking (+1)
      std::int32_t now = 0, most = 0;
      for (const auto& [t, d] : ev) most = std::max(most, now += d);
      return most;
    };
    out.forward_held[i] = peak(fwd);
    out.backward_held[i] = peak(bwd);
  }
  return out;
}

ScheduleAnalysis analyse_schedule(PipelineSchedule s, int p, std::int64_t m, int v, UnitCosts costs) {
  std::vector<std::vector<PipelineUnit>> seqs;
  for (int d = 0; d < p; ++d) seqs.push_back(device_sequence(s, p, d, m, v));
  return analyse_sequences(s, p, m, v, seqs, costs);
}

RegisterDepths register_depths(PipelineSchedule s, int p, std::int64_t m, int v, std::int32_t backward_min) {
  RegisterDepths out;
  if (s == PipelineSchedule::gpipe || s == PipelineSchedule::one_f_one_b || s == PipelineSchedule::two_bw) {
    for (int st = 0; st < p; ++st) {
      out.forward.push_back(s == PipelineSchedule::gpipe ? static_cast<std::int32_t>(m) : p - st);
      out.backward.push_back(backward_min);
    }
    return out;
  }
  const ScheduleAnalysis a = analyse_schedule(s, p, m, v);
  if (!a.problem.empty()) throw GraphError(fmt::format("schedule '{}': {}", name(s), a.problem));
  for (std::size_t i = 0; i < a.stage_depth.size(); ++i) {
    out.forward.push_back(std::max({a.stage_depth[i], a.forward_held[i], std::int32_t{1}}));
    out.backward.push_back(std::max(backward_min, a.backward_held[i]));
  }
  return out;
}

Plan pipeline_skeleton(PipelineSchedule s, int p, std::int64_t m, int v, const SkeletonOptions& o) {
  const RegisterDepths depth = register_depths(s, p, m, v);
  const int stages = p * chunks_per_device(s, v);
  const bool split = splits_backward(s);
  Plan plan;
  auto reg = [&](std::string n, std::int32_t slots) {
    return plan.add_register({.name = std::move(n), .shape = {o.elements}, .dtype = DType::f32, .slots = slots});
  };
  auto at = [&](int stage) {
    return Placement{.device = Device{o.device, static_cast<std::uint8_t>(device_of_stage(s, p, stage))}};
  };
  auto attrs = [](int stage, int pass) { return Attrs{{"stage", std::int64_t{stage}}, {"pass", std::int64_t{pass}}}; };
  const auto S = static_cast<std::size_t>(stages);
  const RegisterIndex data = reg("data", std::max(2, depth.forward[0]));
  plan.add_actor({.name = "data", .kind = ActorKind::source, .op = "noop", .where = at(0), .outputs = {data},
                  .pieces = o.steps * m});
  std::vector<RegisterIndex> act(S), grad(S), grad_sum(S), weight(S);
  for (int st = 0; st < stages; ++st) {
    const auto i = static_cast<std::size_t>(st);
    grad_sum[i] = reg(fmt::format("grad{}.sum", st), 1);
    // 2bw: two weight versions, the one the last backwards of a step read and the one the
    // next step's forwards read, live at once (there is no flush between them).
    const RegisterIndex w = reg(fmt::format("w{}.step", st), s == PipelineSchedule::two_bw ? 2 : 1);
    // The step's weights read the gradient of the step before (2bw: of the one before that,
    // which lets the next step's forwards start before this step's backwards are done).
    const std::int32_t delay = s == PipelineSchedule::two_bw ? 2 : 1;
    plan.add_actor({.name = fmt::format("w{}", st), .op = "noop", .where = at(st), .inputs = {{grad_sum[i], delay}},
                    .outputs = {w}, .stops_when_unread = false});
    // The forward of micro-batch i and the backward of micro-batch i - depth read the same
    // weight: its repeat needs as many slots as the activations, or it caps the schedule.
    weight[i] = reg(fmt::format("w{}", st), std::max(2, depth.forward[i] + 1));
    plan.add_actor({.name = fmt::format("w{}.repeat", st), .kind = ActorKind::repeat, .where = at(st),
                    .inputs = {{w}}, .outputs = {weight[i]}, .group = static_cast<std::int32_t>(m)});
  }
  for (int st = 0; st < stages; ++st) {
    const auto i = static_cast<std::size_t>(st);
    act[i] = reg(fmt::format("act{}", st), depth.forward[i]);
    plan.add_actor({.name = fmt::format("fwd{}", st), .op = o.op, .where = at(st),
                    .inputs = {{st == 0 ? data : act[i - 1]}, {weight[i]}}, .outputs = {act[i]},
                    .attrs = attrs(st, 0), .role = ActorRole::forward, .stage = st});
  }
  for (int st = stages - 1; st >= 0; --st) {
    const auto i = static_cast<std::size_t>(st);
    grad[i] = reg(fmt::format("grad{}", st), depth.backward[i]);
    std::vector<InputPort> ins{{act[i]}, {weight[i]}};
    if (st < stages - 1) ins.push_back({grad[i + 1]});
    plan.add_actor({.name = fmt::format("bwd{}", st), .op = o.op, .where = at(st), .inputs = std::move(ins),
                    .outputs = {grad[i]}, .attrs = attrs(st, 1), .role = ActorRole::backward, .stage = st});
    RegisterIndex wgrad = grad[i];
    if (split) {
      // W: the stage's input and the gradient of its output (dW = x^T dy), and its B's output.
      wgrad = reg(fmt::format("wgrad{}", st), depth.backward[i]);
      plan.add_actor({.name = fmt::format("wgt{}", st), .op = o.op, .where = at(st),
                      .inputs = {{st == 0 ? data : act[i - 1]}, {st < stages - 1 ? grad[i + 1] : act[i]}, {grad[i]}},
                      .outputs = {wgrad}, .attrs = attrs(st, 2), .role = ActorRole::backward, .stage = st,
                      .weight_gradient = true});
    }
    plan.add_actor({.name = fmt::format("grad{}.accumulate", st), .kind = ActorKind::accumulate, .where = at(st),
                    .inputs = {{wgrad}}, .outputs = {grad_sum[i]}, .group = static_cast<std::int32_t>(m)});
  }
  order_pipeline(plan, s, p, m, v);
  return plan;
}

std::string schedule_text(PipelineSchedule s, int p, std::int64_t m, int v) {
  const ScheduleAnalysis a = analyse_schedule(s, p, m, v);
  const int chunks = chunks_per_device(s, v);
  std::string out = fmt::format(
      "schedule {}: {} devices, {} stage{} each, {} micro-batches; F forward, B backward{}{}\n", name(s), p, chunks,
      chunks > 1 ? "s" : "", m, splits_backward(s) ? " (input gradients), W weight gradients" : "",
      chunks > 1 ? ", .c the device's c-th stage" : "");
  if (s == PipelineSchedule::two_bw) {
    out += "2bw runs this order without a flush: each device's warm-up forwards once at the start of the job, then "
           "F B in turn across step boundaries (the next step's forwards go on from this one's), the cool-down once "
           "at the end; the figures below are one step's with a flush, an upper bound\n";
  }
  for (int d = 0; d < p; ++d) {
    std::vector<int> stages;
    for (int c = 0; c < chunks; ++c) stages.push_back(stage_of(s, p, d, c));
    std::vector<std::string> units;
    for (const PipelineUnit& u : device_sequence(s, p, d, m, v)) units.push_back(u.str(chunks > 1));
    out += fmt::format("device {} (stage{} {}): {}\n", d, chunks > 1 ? "s" : "", fmt::join(stages, ", "),
                       fmt::join(units, " "));
  }
  if (!a.problem.empty()) return out + "refused: " + a.problem + "\n";
  for (int d = 0; d < p; ++d) {
    const std::int32_t peak = a.device_peak[static_cast<std::size_t>(d)];
    out += fmt::format("device {}: peak activations {} micro-batch{} of a stage{}, bubble {:.1f}%\n", d, peak,
                       peak == 1 ? "" : "es",
                       chunks > 1 ? fmt::format(" (each 1/{} of a one-stage device's: {:.2f})", chunks,
                                                static_cast<double>(peak) / chunks)
                                  : "",
                       100.0 * a.device_idle[static_cast<std::size_t>(d)]);
  }
  out += fmt::format("bubble {:.1f}% of the step (unit costs F = B = W = 1, an unsplit backward 2)\n", 100.0 * a.idle);
  return out;
}

void order_pipeline(Plan& plan, PipelineSchedule s, int devices, std::int64_t m, int v) {
  const int chunks = chunks_per_device(s, v), stages = devices * chunks;
  const bool split = splits_backward(s);
  // Where each (stage, pass, micro-batch) falls in its device's sequence.
  std::vector<std::array<std::vector<std::int32_t>, 3>> units(static_cast<std::size_t>(stages));
  std::vector<std::int32_t> period(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) {
    const auto seq = device_sequence(s, devices, d, m, v);
    period[static_cast<std::size_t>(d)] = static_cast<std::int32_t>(seq.size());
    for (int c = 0; c < chunks; ++c) {
      for (auto& u : units[static_cast<std::size_t>(stage_of(s, devices, d, c))]) u.resize(static_cast<std::size_t>(m));
    }
    for (std::size_t k = 0; k < seq.size(); ++k) {
      units[static_cast<std::size_t>(stage_of(s, devices, d, seq[k].chunk))][static_cast<std::size_t>(seq[k].pass)]
           [static_cast<std::size_t>(seq[k].microbatch)] = static_cast<std::int32_t>(k);
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
    const int device = device_of_stage(s, devices, a.stage);
    auto [it, fresh] = lanes.emplace(std::tuple{device, a.where.rank, a.where.device, a.where.stream},
                                     static_cast<std::int32_t>(lanes.size()));
    const Pass pass = a.role == ActorRole::forward               ? Pass::forward
                      : split && a.weight_gradient ? Pass::weight
                                                                 : Pass::backward;
    a.order = ActOrder{.lane = it->second,
                       .units = units[static_cast<std::size_t>(a.stage)][static_cast<std::size_t>(pass)],
                       .period = period[static_cast<std::size_t>(device)],
                       .rank = ranks[it->second]++};
    if (s == PipelineSchedule::two_bw) {
      // PipeDream-2BW runs without a flush: the w = min(p - d - 1, m) warm-up forwards once, as
      // the lane's prefix, then the steady state F(w + j) B(j) round and round, its forwards
      // counted across steps (a forward of the next step needs only the weights the gradient
      // of the step before this one made); the cool-down is the backwards left once the
      // forwards have finished.
      const std::int64_t w = std::min<std::int64_t>(devices - device - 1, m);
      a.order.period = static_cast<std::int32_t>(2 * m);
      a.order.units.clear();
      for (std::int64_t j = 0; j < m; ++j) {
        a.order.units.push_back(static_cast<std::int32_t>(2 * j + (pass == Pass::forward ? 0 : 1)));
      }
      if (pass == Pass::forward) {
        for (std::int64_t k = 0; k < w; ++k) a.order.lead.push_back(static_cast<std::int32_t>(k));
      }
    }
  }
}

}  // namespace baton
