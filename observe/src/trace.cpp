// TraceRecorder: act records and occupancy samples of one or many ranks, written as Chrome
// trace-event JSON. The file is streamed out with fmt (a DOM of millions of events would cost
// gigabytes); only the tests parse it back.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>

#include "baton/observe/trace.h"
#include "baton/actors/activity.h"

namespace baton::observe {

namespace {

constexpr std::uint32_t missing = std::numeric_limits<std::uint32_t>::max();

/// The act of `producer` that published piece q of its output: an accumulate publishes once
/// per group, at the group's last act; everything else once per act.
std::int64_t writer_act(const ActorDesc& producer, std::int64_t q) {
  const std::int64_t group = std::max<std::int64_t>(1, producer.group);  // a plan from the wire may say 0
  return producer.kind == ActorKind::accumulate ? q * group + group - 1 : q;
}

/// The piece of `port` that act k of `consumer` reads (negative: none, an initial token).
std::int64_t read_piece(const ActorDesc& consumer, const InputPort& port, std::int64_t k) {
  const std::int64_t ratio = consumer.kind == ActorKind::repeat ? std::max<std::int64_t>(1, consumer.group) : 1;
  return k / ratio - port.delay;
}

void append_escaped(fmt::memory_buffer& out, std::string_view s) {
  out.push_back('"');
  for (char c : s) {
    switch (c) {
      case '"': out.append(std::string_view("\\\"")); break;
      case '\\': out.append(std::string_view("\\\\")); break;
      case '\n': out.append(std::string_view("\\n")); break;
      case '\t': out.append(std::string_view("\\t")); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

/// The track of a worker's pulls, lane `lane` (the worker's own track is tid worker + 1).
std::uint32_t pull_lane_tid(std::uint16_t worker, std::size_t lane) {
  return static_cast<std::uint32_t>(1000 * (lane + 1)) + worker + 1u;
}

/// Nanoseconds as the format's microseconds, exactly (no float rounding): 1234567 -> 1234.567.
void append_us(fmt::memory_buffer& out, std::int64_t ns) {
  if (ns < 0) {
    out.push_back('-');
    ns = -ns;
  }
  fmt::format_to(std::back_inserter(out), "{}.{:03}", ns / 1000, ns % 1000);
}

}  // namespace

struct TraceRecorder::Impl {
  TraceLimits limits;
  std::vector<ActorDesc> actors;  // by plan index; an empty name: not described
  std::vector<RegisterDesc> registers;
  std::map<std::uint32_t, TraceRank> ranks;
  struct Act {
    ActRecord r;
    std::uint32_t rank;
  };
  std::vector<Act> acts;
  struct Sample {
    OccupancySample s;
    std::uint32_t rank;
  };
  std::vector<Sample> samples;
  std::uint64_t acts_left_out = 0;
  std::uint64_t samples_left_out = 0;
  std::vector<std::string> notes;

  std::size_t room() const {
    const std::size_t used = acts.size() + samples.size();
    return used >= limits.max_events ? 0 : limits.max_events - used;
  }
  std::int64_t offset(std::uint32_t rank) const {
    auto it = ranks.find(rank);
    return it == ranks.end() ? 0 : it->second.clock_offset_ns;
  }
  const ActorDesc* actor(std::uint32_t index) const {
    return index < actors.size() && !actors[index].name.empty() ? &actors[index] : nullptr;
  }
  void write(const std::function<void(std::string_view)>& sink) const;
  void append_act_args(fmt::memory_buffer& out, const ActorDesc& d, std::int64_t piece,
                       std::int64_t microbatches) const;
};

TraceRecorder::TraceRecorder(TraceLimits limits) : impl_(std::make_unique<Impl>()) { impl_->limits = limits; }
TraceRecorder::~TraceRecorder() = default;
TraceRecorder::TraceRecorder(TraceRecorder&&) noexcept = default;
TraceRecorder& TraceRecorder::operator=(TraceRecorder&&) noexcept = default;

void TraceRecorder::add_plan(const Plan& plan) {
  auto& actors = impl_->actors;
  auto& registers = impl_->registers;
  if (actors.size() < plan.actors.size()) actors.resize(plan.actors.size());
  if (registers.size() < plan.registers.size()) registers.resize(plan.registers.size());
  for (std::size_t i = 0; i < plan.actors.size(); ++i) {
    if (actors[i].name.empty() && !plan.actors[i].name.empty()) actors[i] = plan.actors[i];
  }
  for (std::size_t i = 0; i < plan.registers.size(); ++i) {
    if (registers[i].name.empty() && !plan.registers[i].name.empty()) registers[i] = plan.registers[i];
  }
}

void TraceRecorder::add_rank(TraceRank rank) {
  const std::uint32_t r = rank.rank;
  impl_->ranks[r] = std::move(rank);
}

void TraceRecorder::add_acts(std::uint32_t rank, std::span<const ActRecord> acts) {
  const std::size_t keep = std::min(acts.size(), impl_->room());
  for (std::size_t i = 0; i < keep; ++i) impl_->acts.push_back({acts[i], rank});
  impl_->acts_left_out += acts.size() - keep;
}

void TraceRecorder::add_occupancy(std::uint32_t rank, std::span<const OccupancySample> samples) {
  const std::size_t keep = std::min(samples.size(), impl_->room());
  for (std::size_t i = 0; i < keep; ++i) impl_->samples.push_back({samples[i], rank});
  impl_->samples_left_out += samples.size() - keep;
}

std::size_t TraceRecorder::acts() const { return impl_->acts.size(); }

void TraceRecorder::add_note(std::string note) { impl_->notes.push_back(std::move(note)); }

/// What an act of `d` says about itself beyond its piece: its step and micro-batch (for the
/// passes and the data), stage, op, and for a transfer the rank it pulls from (a gathering
/// transfer: the first of its inputs' other ranks).
void TraceRecorder::Impl::append_act_args(fmt::memory_buffer& out, const ActorDesc& d, std::int64_t piece,
                                          std::int64_t microbatches) const {
  const bool per_microbatch = d.role == ActorRole::forward || d.role == ActorRole::backward || d.role == ActorRole::data;
  if (microbatches > 0 && per_microbatch) {
    fmt::format_to(std::back_inserter(out), R"(, "step": {}, "micro-batch": {})", piece / microbatches,
                   piece % microbatches);
  }
  if (d.stage >= 0) fmt::format_to(std::back_inserter(out), R"(, "stage": {})", d.stage);
  if (!d.op.empty()) {
    out.append(std::string_view(", \"op\": "));
    append_escaped(out, d.op);
  }
  if (d.kind != ActorKind::transfer) return;
  for (const InputPort& in : d.inputs) {
    const ActorDesc* from = in.reg < registers.size() ? actor(registers[in.reg].producer) : nullptr;
    if (from == nullptr || from->where.rank == d.where.rank) continue;
    fmt::format_to(std::back_inserter(out), R"(, "from rank": {})", from->where.rank);
    return;
  }
}

void TraceRecorder::Impl::write(const std::function<void(std::string_view)>& sink) const {
  fmt::memory_buffer out;
  auto flush_if_big = [&] {
    if (out.size() >= (std::size_t{1} << 20)) {
      sink(std::string_view(out.data(), out.size()));
      out.clear();
    }
  };
  auto put = [&](std::string_view s) { out.append(s); };

  // The common clock: each rank's times plus its offset; the file counts from the earliest.
  std::int64_t origin = std::numeric_limits<std::int64_t>::max();
  for (const Act& a : acts) origin = std::min(origin, static_cast<std::int64_t>(a.r.start_ns) + offset(a.rank));
  for (const Sample& s : samples) origin = std::min(origin, static_cast<std::int64_t>(s.s.t_ns) + offset(s.rank));
  if (origin == std::numeric_limits<std::int64_t>::max()) origin = 0;
  auto at = [&](std::uint64_t t, std::uint32_t rank) { return static_cast<std::int64_t>(t) + offset(rank) - origin; };

  // Micro-batches per step: what a repeat hands one weight to (every repeat of a training plan
  // has that group). Zero: the plan has no steps.
  std::int64_t microbatches = 0;
  for (const auto& a : actors) {
    if (a.kind == ActorKind::repeat) microbatches = std::max<std::int64_t>(microbatches, a.group);
  }

  // Every rank and worker that appears, named even if it never acted.
  std::map<std::uint32_t, std::set<std::uint16_t>> threads;
  for (const auto& [r, info] : ranks) {
    for (std::size_t w = 0; w < info.workers.size(); ++w) threads[r].insert(static_cast<std::uint16_t>(w));
  }
  for (const Act& a : acts) threads[a.rank].insert(a.r.worker);

  // A track per act. A transfer's pulls overlap the worker's other acts and one another (one
  // in flight per free slot), and the viewers draw a track's slices only when they nest: pulls
  // go on lanes of their own beside their worker, each pull on the first lane free by its start.
  std::vector<std::uint32_t> tid(acts.size());
  std::map<std::pair<std::uint32_t, std::uint16_t>, std::vector<std::int64_t>> lane_ends;  // (rank, worker)
  {
    std::vector<std::uint32_t> pulls;
    for (std::size_t i = 0; i < acts.size(); ++i) {
      const ActorDesc* d = actor(acts[i].r.actor);
      tid[i] = acts[i].r.worker + 1u;
      if (d != nullptr && d->kind == ActorKind::transfer) pulls.push_back(static_cast<std::uint32_t>(i));
    }
    std::sort(pulls.begin(), pulls.end(), [&](std::uint32_t x, std::uint32_t y) {
      return std::tie(acts[x].rank, acts[x].r.worker, acts[x].r.start_ns) <
             std::tie(acts[y].rank, acts[y].r.worker, acts[y].r.start_ns);
    });
    for (std::uint32_t i : pulls) {
      const Act& a = acts[i];
      auto& ends = lane_ends[{a.rank, a.r.worker}];
      const std::int64_t start = at(a.r.start_ns, a.rank), end = std::max(start, at(a.r.end_ns, a.rank));
      std::size_t lane = 0;
      while (lane < ends.size() && ends[lane] > start) ++lane;
      if (lane == ends.size()) ends.push_back(end);
      ends[lane] = end;
      tid[i] = pull_lane_tid(a.r.worker, lane);
    }
  }

  put("{\"traceEvents\": [\n");
  bool first = true;
  auto begin_event = [&] {
    if (!first) put(",\n");
    first = false;
  };
  for (const auto& [rank, workers] : threads) {
    const auto r = rank;  // the lambdas below capture it (clang < 16 cannot capture a binding)
    auto info = ranks.find(r);
    const std::string host = info == ranks.end() ? std::string() : info->second.host;
    begin_event();
    fmt::format_to(std::back_inserter(out), R"({{"ph": "M", "pid": {}, "tid": 0, "name": "process_name", "args": {{"name": )",
                   r + 1);
    append_escaped(out, host.empty() ? fmt::format("rank {}", r) : fmt::format("rank {} ({})", r, host));
    put("}}");
    begin_event();
    fmt::format_to(std::back_inserter(out),
                   R"({{"ph": "M", "pid": {}, "tid": 0, "name": "process_sort_index", "args": {{"sort_index": {}}}}})", r + 1,
                   r);
    auto name_thread = [&](std::uint32_t t, const std::string& name, std::uint32_t sort_index) {
      begin_event();
      fmt::format_to(std::back_inserter(out),
                     R"({{"ph": "M", "pid": {}, "tid": {}, "name": "thread_name", "args": {{"name": )", r + 1, t);
      append_escaped(out, name);
      put("}}");
      begin_event();
      fmt::format_to(std::back_inserter(out),
                     R"({{"ph": "M", "pid": {}, "tid": {}, "name": "thread_sort_index", "args": {{"sort_index": {}}}}})",
                     r + 1, t, sort_index);
    };
    auto worker_name = [&](std::uint16_t w) {
      return info != ranks.end() && w < info->second.workers.size() ? info->second.workers[w]
                                                                    : fmt::format("worker {}", w);
    };
    // Tracks in the order of their names (cpu:0 before cpu:1), whatever order the runtime made
    // its workers in.
    std::vector<std::uint16_t> by_name(workers.begin(), workers.end());
    std::stable_sort(by_name.begin(), by_name.end(),
                     [&](std::uint16_t x, std::uint16_t y) { return worker_name(x) < worker_name(y); });
    for (std::uint16_t w : workers) {
      const std::string name = worker_name(w);
      const auto position = static_cast<std::uint32_t>(std::find(by_name.begin(), by_name.end(), w) - by_name.begin());
      name_thread(w + 1u, name, position * 1000u);
      auto lanes = lane_ends.find({r, w});
      const std::size_t n = lanes == lane_ends.end() ? 0 : lanes->second.size();
      for (std::size_t lane = 0; lane < n; ++lane) {
        name_thread(pull_lane_tid(w, lane), lane == 0 ? name + " pulls" : fmt::format("{} pulls {}", name, lane + 1),
                    position * 1000u + 1u + static_cast<std::uint32_t>(lane));
      }
    }
  }

  // Slices, in each thread's order.
  std::vector<std::uint32_t> order(acts.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::uint32_t>(i);
  std::sort(order.begin(), order.end(), [&](std::uint32_t x, std::uint32_t y) {
    const Act& a = acts[x];
    const Act& b = acts[y];
    return std::tie(a.rank, tid[x], a.r.start_ns, a.r.actor) < std::tie(b.rank, tid[y], b.r.start_ns, b.r.actor);
  });
  std::uint64_t negative = 0;
  for (std::uint32_t i : order) {
    const Act& a = acts[i];
    const ActorDesc* d = actor(a.r.actor);
    begin_event();
    fmt::format_to(std::back_inserter(out), R"({{"ph": "X", "pid": {}, "tid": {}, "ts": )", a.rank + 1, tid[i]);
    append_us(out, at(a.r.start_ns, a.rank));
    put(", \"dur\": ");
    std::int64_t dur = static_cast<std::int64_t>(a.r.end_ns) - static_cast<std::int64_t>(a.r.start_ns);
    if (dur < 0) {
      ++negative;
      dur = 0;
    }
    append_us(out, dur);
    put(", \"name\": ");
    append_escaped(out, d != nullptr ? d->name : fmt::format("actor {}", a.r.actor));
    put(", \"cat\": ");
    append_escaped(out, d == nullptr ? "unknown" : d->role != ActorRole::other ? name(d->role) : name(d->kind));
    fmt::format_to(std::back_inserter(out), R"(, "args": {{"piece": {})", a.r.piece);
    if (d != nullptr) append_act_args(out, *d, a.r.piece, microbatches);
    put("}}");
    flush_if_big();
  }

  // Occupancy counters.
  for (const Sample& s : samples) {
    begin_event();
    fmt::format_to(std::back_inserter(out), R"({{"ph": "C", "pid": {}, "tid": 0, "ts": )", s.rank + 1);
    append_us(out, at(s.s.t_ns, s.rank));
    put(", \"name\": ");
    append_escaped(out, s.s.reg < registers.size() && !registers[s.s.reg].name.empty()
                            ? registers[s.s.reg].name
                            : fmt::format("register {}", s.s.reg));
    fmt::format_to(std::back_inserter(out), R"(, "cat": "occupancy", "args": {{"slots in use": {}}}}})", s.s.in_use);
    flush_if_big();
  }

  // Arrows for the requests that cross workers or ranks. Act (actor, piece) -> record, per
  // actor from its lowest piece (a window recorded mid-run starts late).
  struct Pieces {
    std::int64_t base = std::numeric_limits<std::int64_t>::max();
    std::vector<std::uint32_t> index;
  };
  std::vector<Pieces> by_actor(actors.size());
  for (const Act& a : acts) {
    if (a.r.actor < by_actor.size()) by_actor[a.r.actor].base = std::min(by_actor[a.r.actor].base, a.r.piece);
  }
  for (std::size_t i = 0; i < acts.size(); ++i) {
    const Act& a = acts[i];
    if (a.r.actor >= by_actor.size()) continue;
    Pieces& p = by_actor[a.r.actor];
    const auto slot = static_cast<std::size_t>(a.r.piece - p.base);
    if (slot >= (std::size_t{1} << 28)) continue;  // not a window of one run: draw no arrows to it
    if (slot >= p.index.size()) p.index.resize(slot + 1, missing);
    p.index[slot] = static_cast<std::uint32_t>(i);
  }
  auto find_act = [&](ActorIndex actor_index, std::int64_t piece) -> std::uint32_t {
    if (actor_index >= by_actor.size()) return missing;
    const Pieces& p = by_actor[actor_index];
    if (piece < p.base || static_cast<std::size_t>(piece - p.base) >= p.index.size()) return missing;
    return p.index[static_cast<std::size_t>(piece - p.base)];
  };
  const std::size_t used = acts.size() + samples.size();
  std::size_t flow_budget = used >= limits.max_events ? 0 : (limits.max_events - used) / 2;
  std::uint64_t flows = 0, flows_left_out = 0;
  std::vector<RegisterIndex> seen;
  for (std::uint32_t i : order) {
    const Act& c = acts[i];
    const ActorDesc* consumer = actor(c.r.actor);
    if (consumer == nullptr) continue;
    seen.clear();
    for (const InputPort& port : consumer->inputs) {
      if (std::find(seen.begin(), seen.end(), port.reg) != seen.end()) continue;  // one register, two ports
      seen.push_back(port.reg);
      if (port.reg >= registers.size()) continue;
      const ActorIndex producer_index = registers[port.reg].producer;
      const ActorDesc* producer = actor(producer_index);
      if (producer == nullptr) continue;
      const std::int64_t q = read_piece(*consumer, port, c.r.piece);
      if (q < 0) continue;
      const std::uint32_t pi = find_act(producer_index, writer_act(*producer, q));
      if (pi == missing) continue;
      const Act* p = &acts[pi];
      if (p->rank == c.rank && p->r.worker == c.r.worker) continue;
      if (flows == flow_budget) {
        ++flows_left_out;
        continue;
      }
      // Each end inside its slice (Perfetto binds a flow to the slice enclosing it): the start
      // 1 ns before the producer's act ends, the end 1 ns after the consumer's begins.
      const std::int64_t s_ts = std::max(at(p->r.start_ns, p->rank), at(p->r.end_ns, p->rank) - 1);
      const std::int64_t f_ts = std::min(at(c.r.start_ns, c.rank) + 1, std::max(at(c.r.end_ns, c.rank), at(c.r.start_ns, c.rank)));
      const std::string_view reg_name = registers[port.reg].name;
      begin_event();
      fmt::format_to(std::back_inserter(out), R"({{"ph": "s", "id": {}, "pid": {}, "tid": {}, "ts": )", flows, p->rank + 1,
                     tid[pi]);
      append_us(out, s_ts);
      put(", \"cat\": \"request\", \"name\": ");
      append_escaped(out, reg_name);
      put("}");
      begin_event();
      fmt::format_to(std::back_inserter(out), R"({{"ph": "f", "bp": "e", "id": {}, "pid": {}, "tid": {}, "ts": )", flows,
                     c.rank + 1, tid[i]);
      append_us(out, f_ts);
      put(", \"cat\": \"request\", \"name\": ");
      append_escaped(out, reg_name);
      put("}");
      ++flows;
      flush_if_big();
    }
  }

  // What a reader should know about this file.
  put("\n],\n\"displayTimeUnit\": \"ns\",\n\"otherData\": {\"generator\": \"baton\", \"clock\": ");
  append_escaped(out,
                 "steady clock (CLOCK_MONOTONIC) of the rendezvous server's host, or of the only rank; "
                 "ts = (t - origin_ns) / 1000; each rank's times moved by its clock_offset_ns");
  fmt::format_to(std::back_inserter(out), ", \"origin_ns\": {}, \"microbatches\": {}, \"ranks\": [", origin, microbatches);
  bool first_rank = true;
  for (const auto& [r, info] : ranks) {
    if (!first_rank) put(", ");
    first_rank = false;
    fmt::format_to(std::back_inserter(out), R"({{"rank": {}, "host": )", r);
    append_escaped(out, info.host);
    fmt::format_to(std::back_inserter(out),
                   R"(, "clock_offset_ns": {}, "clock_uncertainty_ns": {}, "dropped": {}, "finished": {}, "error": )",
                   info.clock_offset_ns, info.clock_uncertainty_ns, info.dropped, info.finished);
    append_escaped(out, info.error);
    put("}");
  }
  put("]");
  // With data parallelism: how much of the gradients' all-reduces ran beside the backward pass,
  // over every rank's acts on the common clock, and for each all-reduce (bucket) alone.
  {
    Plan described;
    described.actors = actors;
    described.registers = registers;
    std::vector<ActRecord> common;
    common.reserve(acts.size());
    for (const Act& a : acts) {
      ActRecord r = a.r;
      r.start_ns = static_cast<std::uint64_t>(static_cast<std::int64_t>(r.start_ns) + offset(a.rank));
      r.end_ns = static_cast<std::uint64_t>(static_cast<std::int64_t>(r.end_ns) + offset(a.rank));
      common.push_back(r);
    }
    const CollectiveOverlap o = collective_overlap(described, common);
    if (o.spans > 0) {
      fmt::format_to(std::back_inserter(out), R"(, "allreduce_overlap": {{"fraction": {:.4f}, "allreduce_s": {:.6g}, )"
                                              R"("by_allreduce": {{)",
                     o.fraction(), o.collective_s);
      for (std::size_t i = 0; i < o.by_allreduce.size(); ++i) {
        if (i > 0) put(", ");
        append_escaped(out, o.by_allreduce[i].name);
        fmt::format_to(std::back_inserter(out), ": {:.4f}", o.by_allreduce[i].fraction());
      }
      put("}}");
    }
  }
  const bool truncated = acts_left_out + samples_left_out + flows_left_out > 0;
  fmt::format_to(std::back_inserter(out),
                 R"(, "events": {{"acts": {}, "counters": {}, "flows": {}}}, "max_events": {}, "truncated": {}, )"
                 R"("left_out": {{"acts": {}, "counters": {}, "flows": {}}}, "notes": [)",
                 acts.size(), samples.size(), flows, limits.max_events, truncated, acts_left_out, samples_left_out,
                 flows_left_out);
  std::vector<std::string> all_notes = notes;
  if (truncated) {
    all_notes.push_back(fmt::format("cut at {} events: {} acts, {} counter samples and {} arrows left out (the first "
                                    "events are kept)",
                                    limits.max_events, acts_left_out, samples_left_out, flows_left_out));
  }
  if (negative > 0) all_notes.push_back(fmt::format("{} acts ended before they began; written with duration 0", negative));
  for (std::size_t i = 0; i < all_notes.size(); ++i) {
    if (i > 0) put(", ");
    append_escaped(out, all_notes[i]);
  }
  put("]}\n}\n");
  sink(std::string_view(out.data(), out.size()));
}

void TraceRecorder::write(std::FILE* file) const {
  impl_->write([file](std::string_view s) {
    if (std::fwrite(s.data(), 1, s.size(), file) != s.size()) {
      throw std::runtime_error(fmt::format("cannot write the trace: {}", std::strerror(errno)));
    }
  });
}

std::string TraceRecorder::json() const {
  std::string text;
  impl_->write([&text](std::string_view s) { text.append(s); });
  return text;
}

void TraceRecorder::write_file(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) throw std::runtime_error(fmt::format("cannot write the trace '{}': {}", path, std::strerror(errno)));
  try {
    write(f);
  } catch (const std::exception& e) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw std::runtime_error(fmt::format("cannot write the trace '{}': {}", path, e.what()));
  }
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error(fmt::format("cannot write the trace '{}': {}", path, reason));
  }
}

}  // namespace baton::observe
