// collective_overlap (activity.h): interval arithmetic over the activity log.
#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "baton/actors/activity.h"

namespace baton {

namespace {

using Span = std::pair<std::uint64_t, std::uint64_t>;

/// Sorted, disjoint intervals covering the same points as `spans`.
std::vector<Span> merged(std::vector<Span> spans) {
  std::sort(spans.begin(), spans.end());
  std::vector<Span> out;
  for (const Span& s : spans) {
    if (s.second <= s.first) continue;
    if (!out.empty() && s.first <= out.back().second) {
      out.back().second = std::max(out.back().second, s.second);
    } else {
      out.push_back(s);
    }
  }
  return out;
}

std::uint64_t measure(const std::vector<Span>& disjoint) {
  std::uint64_t total = 0;
  for (const Span& s : disjoint) total += s.second - s.first;
  return total;
}

/// The measure of the intersection of two sorted, disjoint interval lists.
std::uint64_t intersection(const std::vector<Span>& a, const std::vector<Span>& b) {
  std::uint64_t total = 0;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const std::uint64_t lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (hi > lo) total += hi - lo;
    if (a[i].second < b[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return total;
}

/// The all-reduce an actor belongs to: its "allreduce" attribute, or for a transfer, that of
/// the actor whose register it moves. Empty if none (or the loss's).
std::string allreduce_of(const Plan& plan, ActorIndex a) {
  const ActorDesc* d = &plan.actors[a];
  if (d->kind == ActorKind::transfer && !d->attrs.has("allreduce") && !d->inputs.empty() && d->inputs[0].reg < plan.registers.size()) {
    const ActorIndex w = data_writer(plan, d->inputs[0].reg);
    if (w >= plan.actors.size()) return {};
    d = &plan.actors[w];
  }
  std::string name = d->attrs.get_string("allreduce", "");
  return name == "loss" ? std::string() : name;
}

}  // namespace

CollectiveOverlap collective_overlap(const Plan& plan, const std::vector<ActRecord>& acts) {
  std::vector<std::string> group(plan.actors.size());
  for (ActorIndex a = 0; a < plan.actors.size(); ++a) group[a] = allreduce_of(plan, a);
  std::map<std::pair<std::string, std::int64_t>, Span> spans;
  std::vector<Span> backward;
  for (const ActRecord& r : acts) {
    if (r.actor >= plan.actors.size() || r.end_ns < r.start_ns) continue;
    if (!group[r.actor].empty()) {
      auto [it, fresh] = spans.try_emplace({group[r.actor], r.piece}, Span{r.start_ns, r.end_ns});
      if (!fresh) {
        it->second.first = std::min(it->second.first, r.start_ns);
        it->second.second = std::max(it->second.second, r.end_ns);
      }
    } else if (plan.actors[r.actor].role == ActorRole::backward) {
      backward.emplace_back(r.start_ns, r.end_ns);
    }
  }
  std::vector<Span> collective;
  std::map<std::string, std::vector<Span>> each;
  for (const auto& [key, span] : spans) {
    collective.push_back(span);
    each[key.first].push_back(span);
  }
  const std::vector<Span> c = merged(std::move(collective)), b = merged(std::move(backward));
  CollectiveOverlap out;
  out.spans = spans.size();
  out.collective_s = static_cast<double>(measure(c)) * 1e-9;
  out.overlapped_s = static_cast<double>(intersection(c, b)) * 1e-9;
  for (auto& [name, list] : each) {
    const std::vector<Span> g = merged(std::move(list));
    out.by_allreduce.push_back({name, static_cast<double>(measure(g)) * 1e-9,
                                static_cast<double>(intersection(g, b)) * 1e-9});
  }
  return out;
}

}  // namespace baton
