#include "baton/actors/metrics.h"

#include <fmt/format.h>

namespace baton {

std::string_view name(ActorActivity a) {
  switch (a) {
    case ActorActivity::busy: return "busy";
    case ActorActivity::starved: return "starved";
    case ActorActivity::backpressured: return "back-pressured";
    case ActorActivity::transferring: return "transferring";
    case ActorActivity::retired: return "retired";
  }
  return "?";
}

std::uint64_t MetricsSnapshot::total_acts() const {
  std::uint64_t n = 0;
  for (const auto& a : actors) n += a.acts;
  return n;
}

std::string MetricsSnapshot::table() const {
  std::size_t width = 5;
  for (const auto& a : actors) width = std::max(width, a.name.size());
  std::string out = fmt::format("{:<{}}  {:<14} {:>10} {:>12} {:>9} {:>9} {:>6} {:>8} {:>7} {:>6}\n", "actor", width,
                                "place", "acts", "acts/s", "MB/s in", "MB/s out", "busy%", "starved%",
                                "bp%", "xfer%");
  const double secs = elapsed_s > 0 ? elapsed_s : 1.0;
  for (const auto& a : actors) {
    double life = a.lifetime_s() > 0 ? a.lifetime_s() : 1.0;
    out += fmt::format("{:<{}}  {:<14} {:>10} {:>12.0f} {:>9.1f} {:>9.1f} {:>6.1f} {:>8.1f} {:>7.1f} {:>6.1f}\n", a.name,
                       width, fmt::format("r{}/{}/s{}", a.where.rank, a.where.device.str(), a.where.stream),
                       a.acts, static_cast<double>(a.acts) / secs,
                       static_cast<double>(a.bytes_in) / secs / 1e6,
                       static_cast<double>(a.bytes_out) / secs / 1e6, 100 * a.busy_s / life,
                       100 * a.starved_s / life, 100 * a.backpressured_s / life, 100 * a.transferring_s / life);
  }
  if (!registers.empty()) {
    std::size_t rwidth = 8;
    for (const auto& r : registers) rwidth = std::max(rwidth, r.name.size());
    out += fmt::format("{:<{}}  {:>5} {:>10} {:>11} {:>15}\n", "register", rwidth, "slots", "written",
                       "in use now", "max in use");
    for (const auto& r : registers) {
      out += fmt::format("{:<{}}  {:>5} {:>10} {:>11} {:>15}\n", r.name, rwidth, r.slots, r.written,
                         r.written - r.freed, r.max_outstanding);
    }
  }
  return out;
}

}  // namespace baton
