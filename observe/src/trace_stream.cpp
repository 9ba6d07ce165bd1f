// The wire format of streamed traces: telemetry of kind "trace", each body one JSON object
// that starts {"part":P,"session":S, ... (the collector files the text by that prefix without
// parsing it; it parses when the trace is merged). Both ends are the same build (SPMD), so
// kinds and roles travel as their enum values.
//
//   meta       {rank, host, boot_id, clock_offset_ns, clock_rtt_ns, workers: [names]}
//   actors     {actors: [[index, name, op, kind, role, stage, group, rank, [[reg, delay]...]]...]}
//   registers  {registers: [[index, name, slots, producer]...]}
//   acts       {acts: [[actor, piece, start_ns, end_ns, worker]...]}     (the rank's clock)
//   occupancy  {samples: [[t_ns, reg, in_use]...]}
//   end        {dropped, error}
#include <unistd.h>

#include <charconv>
#include <fstream>
#include <map>
#include <mutex>
#include <set>

#include <boost/json.hpp>
#include <fmt/format.h>

#include "baton/observe/trace.h"
#include "baton/transport/control.h"

namespace baton::observe {

namespace json = boost::json;

namespace {

/// This boot of this machine's kernel: processes that share it share CLOCK_MONOTONIC (barring
/// time namespaces, which the offset check below catches). Empty where Linux does not say.
std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return {};
  return name;
}

std::string quoted(std::string_view s) { return json::serialize(json::string_view(s.data(), s.size())); }

/// Items of one array, cut into bodies of at most `max` bytes: {"part":P,"session":S,"KEY":[...]}.
class Parts {
 public:
  Parts(const TraceStream::Send& send, std::size_t max, std::string head) : send_(send), max_(max), head_(std::move(head)) {}
  ~Parts() = default;
  void item(const std::string& text) {
    if (count_ > 0 && head_.size() + body_.size() + text.size() + 3 > max_) flush();
    if (count_ > 0) body_ += ',';
    body_ += text;
    ++count_;
  }
  void flush() {
    if (count_ == 0) return;
    send_(head_ + body_ + "]}");
    body_.clear();
    count_ = 0;
  }

 private:
  const TraceStream::Send& send_;
  std::size_t max_;
  std::string head_;
  std::string body_;
  std::size_t count_ = 0;
};

std::int64_t as_int(const json::value& v) { return v.to_number<std::int64_t>(); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// TraceStream: the rank's side

struct TraceStream::Impl {
  Send send;
  std::uint32_t session = 0;
  std::size_t max_body = 0;
  std::string head(std::string_view part, std::string_view key) const {
    return fmt::format(R"({{"part":"{}","session":{},"{}":[)", part, session, key);
  }
};

TraceStream::TraceStream(Send send, std::uint32_t session, std::size_t max_body) : impl_(std::make_unique<Impl>()) {
  impl_->send = std::move(send);
  impl_->session = session;
  impl_->max_body = max_body;
}
TraceStream::~TraceStream() = default;
TraceStream::TraceStream(TraceStream&&) noexcept = default;
TraceStream& TraceStream::operator=(TraceStream&&) noexcept = default;

void TraceStream::begin(const TraceRank& rank, const Plan& plan, std::int64_t clock_rtt_ns) {
  std::string workers;
  for (const auto& w : rank.workers) workers += (workers.empty() ? "" : ",") + quoted(w);
  impl_->send(fmt::format(
      R"({{"part":"meta","session":{},"rank":{},"host":{},"boot_id":{},"clock_offset_ns":{},"clock_rtt_ns":{},"workers":[{}]}})",
      impl_->session, rank.rank, quoted(rank.host.empty() ? host_name() : rank.host), quoted(boot_id()),
      rank.clock_offset_ns, clock_rtt_ns, workers));
  // This rank's actors, and the registers they write: the ranks together describe the plan.
  Parts actors(impl_->send, impl_->max_body, impl_->head("actors", "actors"));
  Parts registers(impl_->send, impl_->max_body, impl_->head("registers", "registers"));
  for (std::size_t i = 0; i < plan.actors.size(); ++i) {
    const ActorDesc& a = plan.actors[i];
    if (a.where.rank != rank.rank) continue;
    std::string inputs;
    for (const auto& in : a.inputs) inputs += fmt::format("{}[{},{}]", inputs.empty() ? "" : ",", in.reg, in.delay);
    actors.item(fmt::format("[{},{},{},{},{},{},{},{},[{}]]", i, quoted(a.name), quoted(a.op), static_cast<int>(a.kind),
                            static_cast<int>(a.role), a.stage, a.group, a.where.rank, inputs));
    for (RegisterIndex r : a.outputs) {
      const RegisterDesc& reg = plan.registers[r];
      registers.item(fmt::format("[{},{},{},{}]", r, quoted(reg.name), reg.slots, i));
    }
  }
  actors.flush();
  registers.flush();
}

void TraceStream::acts(std::span<const ActRecord> records) {
  Parts parts(impl_->send, impl_->max_body, impl_->head("acts", "acts"));
  for (const ActRecord& r : records) {
    parts.item(fmt::format("[{},{},{},{},{}]", r.actor, r.piece, r.start_ns, r.end_ns, r.worker));
  }
  parts.flush();
}

void TraceStream::occupancy(std::span<const OccupancySample> samples) {
  Parts parts(impl_->send, impl_->max_body, impl_->head("occupancy", "samples"));
  for (const OccupancySample& s : samples) parts.item(fmt::format("[{},{},{}]", s.t_ns, s.reg, s.in_use));
  parts.flush();
}

void TraceStream::end(std::uint64_t dropped, const std::string& error) {
  impl_->send(fmt::format(R"({{"part":"end","session":{},"dropped":{},"error":{}}})", impl_->session, dropped,
                          quoted(error)));
}

// ---------------------------------------------------------------------------------------------
// TraceCollector: the launcher's side

namespace {

/// {"part":"P","session":S,... -> (P, S), without parsing the rest.
std::optional<std::pair<std::string, std::uint32_t>> header(std::string_view body) {
  constexpr std::string_view open = R"({"part":")";
  if (!body.starts_with(open)) return std::nullopt;
  body.remove_prefix(open.size());
  const auto quote = body.find('"');
  if (quote == std::string_view::npos) return std::nullopt;
  std::string part(body.substr(0, quote));
  body.remove_prefix(quote);
  constexpr std::string_view session_key = R"(","session":)";
  if (!body.starts_with(session_key)) return std::nullopt;
  body.remove_prefix(session_key.size());
  std::uint32_t session = 0;
  auto [end, ec] = std::from_chars(body.data(), body.data() + body.size(), session);
  if (ec != std::errc()) return std::nullopt;
  return std::pair{std::move(part), session};
}

}  // namespace

struct TraceCollector::Impl {
  TraceLimits limits;
  struct Body {
    std::uint32_t rank;
    std::string part;
    std::string text;
  };
  struct Session {
    std::vector<Body> bodies;
    std::set<std::uint32_t> heard;
    std::set<std::uint32_t> ended;
    std::size_t act_bytes = 0;
    std::map<std::uint32_t, std::uint64_t> parts_dropped;  // act parts past the cap, by rank
    std::uint64_t malformed = 0;
  };
  mutable std::mutex mutex;
  std::map<std::uint32_t, Session> sessions;
};

TraceCollector::TraceCollector(TraceLimits limits) : impl_(std::make_unique<Impl>()) { impl_->limits = limits; }
TraceCollector::~TraceCollector() = default;

void TraceCollector::on_telemetry(const transport::Telemetry& t) {
  if (t.kind != trace_kind) return;
  auto h = header(t.body);
  std::lock_guard lock(impl_->mutex);
  if (!h) {
    ++impl_->sessions[0].malformed;
    return;
  }
  auto& [part, session_id] = *h;
  Impl::Session& s = impl_->sessions[session_id];
  s.heard.insert(t.rank);
  if (part == "end") s.ended.insert(t.rank);
  if (part == "acts" || part == "occupancy") {
    // The raw text is ~25-60 bytes a record: stop keeping it well past what the file may hold.
    if (s.act_bytes + t.body.size() > impl_->limits.max_events * 64) {
      ++s.parts_dropped[t.rank];
      return;
    }
    s.act_bytes += t.body.size();
  }
  s.bodies.push_back({t.rank, std::move(part), t.body});
}

std::size_t TraceCollector::finished(std::uint32_t session) const {
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->sessions.find(session);
  return it == impl_->sessions.end() ? 0 : it->second.ended.size();
}

std::size_t TraceCollector::ranks(std::uint32_t session) const {
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->sessions.find(session);
  return it == impl_->sessions.end() ? 0 : it->second.heard.size();
}

void TraceCollector::forget(std::uint32_t session) {
  std::lock_guard lock(impl_->mutex);
  impl_->sessions.erase(session);
}

TraceRecorder TraceCollector::merge(std::uint32_t session) const {
  TraceRecorder recorder(impl_->limits);
  std::vector<Impl::Body> bodies;
  std::set<std::uint32_t> heard;
  std::map<std::uint32_t, std::uint64_t> parts_dropped;
  std::uint64_t malformed = 0;
  {
    std::lock_guard lock(impl_->mutex);
    auto it = impl_->sessions.find(session);
    if (it != impl_->sessions.end()) {
      bodies = it->second.bodies;
      heard = it->second.heard;
      parts_dropped = it->second.parts_dropped;
      malformed = it->second.malformed;
    }
  }
  const std::string my_boot = boot_id();
  std::map<std::uint32_t, TraceRank> ranks;
  std::vector<std::string> bad;
  std::vector<ActRecord> records;
  std::vector<OccupancySample> samples;
  for (const auto& b : bodies) {
    TraceRank& rank = ranks[b.rank];
    rank.rank = b.rank;
    try {
      const json::object o = json::parse(b.text).as_object();
      if (b.part == "meta") {
        rank.host = json::value_to<std::string>(o.at("host"));
        for (const auto& w : o.at("workers").as_array()) rank.workers.push_back(json::value_to<std::string>(w));
        const std::int64_t offset = as_int(o.at("clock_offset_ns"));
        const std::int64_t rtt = as_int(o.at("clock_rtt_ns"));
        // On this host the clocks are one: the measured offset is only its error. Elsewhere
        // the offset is the best estimate there is, good to half the round trip.
        const bool same_clock = !my_boot.empty() && json::value_to<std::string>(o.at("boot_id")) == my_boot &&
                                std::abs(offset) <= rtt / 2 + 1000;
        rank.clock_offset_ns = same_clock ? 0 : offset;
        rank.clock_uncertainty_ns = same_clock ? 0 : rtt / 2;
      } else if (b.part == "actors") {
        Plan partial;
        for (const auto& item : o.at("actors").as_array()) {
          const auto& a = item.as_array();
          const auto index = static_cast<std::size_t>(as_int(a.at(0)));
          if (index >= (1u << 24)) throw std::out_of_range("actor index out of range");
          if (partial.actors.size() <= index) partial.actors.resize(index + 1);
          ActorDesc& d = partial.actors[index];
          d.name = json::value_to<std::string>(a.at(1));
          d.op = json::value_to<std::string>(a.at(2));
          d.kind = static_cast<ActorKind>(as_int(a.at(3)));
          d.role = static_cast<ActorRole>(as_int(a.at(4)));
          d.stage = static_cast<std::int32_t>(as_int(a.at(5)));
          d.group = static_cast<std::int32_t>(as_int(a.at(6)));
          d.where.rank = static_cast<std::uint16_t>(as_int(a.at(7)));
          for (const auto& in : a.at(8).as_array()) {
            d.inputs.push_back(InputPort{static_cast<RegisterIndex>(as_int(in.as_array().at(0))),
                                         static_cast<std::int32_t>(as_int(in.as_array().at(1)))});
          }
        }
        recorder.add_plan(partial);
      } else if (b.part == "registers") {
        Plan partial;
        for (const auto& item : o.at("registers").as_array()) {
          const auto& r = item.as_array();
          const auto index = static_cast<std::size_t>(as_int(r.at(0)));
          if (index >= (1u << 24)) throw std::out_of_range("register index out of range");
          if (partial.registers.size() <= index) partial.registers.resize(index + 1);
          RegisterDesc& d = partial.registers[index];
          d.name = json::value_to<std::string>(r.at(1));
          d.slots = static_cast<std::int32_t>(as_int(r.at(2)));
          d.producer = static_cast<ActorIndex>(as_int(r.at(3)));
        }
        recorder.add_plan(partial);
      } else if (b.part == "acts") {
        records.clear();
        for (const auto& item : o.at("acts").as_array()) {
          const auto& r = item.as_array();
          records.push_back(ActRecord{static_cast<ActorIndex>(as_int(r.at(0))), as_int(r.at(1)),
                                      r.at(2).to_number<std::uint64_t>(), r.at(3).to_number<std::uint64_t>(),
                                      static_cast<std::uint16_t>(as_int(r.at(4)))});
        }
        recorder.add_acts(b.rank, records);
      } else if (b.part == "occupancy") {
        samples.clear();
        for (const auto& item : o.at("samples").as_array()) {
          const auto& s = item.as_array();
          samples.push_back(OccupancySample{s.at(0).to_number<std::uint64_t>(), static_cast<RegisterIndex>(as_int(s.at(1))),
                                            static_cast<std::int32_t>(as_int(s.at(2)))});
        }
        recorder.add_occupancy(b.rank, samples);
      } else if (b.part == "end") {
        rank.finished = true;
        rank.dropped += o.at("dropped").to_number<std::uint64_t>();
        rank.error = json::value_to<std::string>(o.at("error"));
      }
    } catch (const std::exception& e) {
      bad.push_back(fmt::format("rank {}'s '{}' part: {}", b.rank, b.part, e.what()));
    }
  }
  for (auto& [r, rank] : ranks) {
    if (!rank.finished) {
      recorder.add_note(fmt::format("rank {} did not end its trace (its run failed or was cut short): what it sent "
                                    "until then is here",
                                    r));
    }
    if (auto d = parts_dropped.find(r); d != parts_dropped.end()) {
      recorder.add_note(fmt::format("{} parts of rank {}'s records arrived past the cap and were dropped", d->second, r));
    }
    recorder.add_rank(std::move(rank));
  }
  if (!bad.empty()) {
    recorder.add_note(fmt::format("{} parts did not parse and were skipped, the first: {}", bad.size(), bad.front()));
  }
  if (malformed > 0) recorder.add_note(fmt::format("{} telemetry bodies of kind 'trace' were not trace parts", malformed));
  return recorder;
}

}  // namespace baton::observe
