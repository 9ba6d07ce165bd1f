// The replication pass (passes.h): where each replica's stages and shards run, and which
// gradients are all-reduced together.
#include <algorithm>

#include <fmt/format.h>

#include "baton/graph/passes.h"
#include "baton/kernels/nccl.h"

namespace baton::passes {

namespace {

/// Whether a bucket's all-reduce over these places goes through NCCL (TrainConfig::collectives).
bool use_nccl(const TrainConfig& cfg, const std::vector<std::vector<Placement>>& places,
              int place) {
  const bool all_cuda =
      std::all_of(places.begin(), places.end(), [&](const std::vector<Placement>& p) {
        return p[static_cast<std::size_t>(place)].device.type == DeviceType::cuda;
      });
  if (cfg.collectives == "actors") return false;
  if (cfg.collectives == "auto") return all_cuda && nccl::built_with_nccl();
  // "nccl" on sim devices: the sim's stand-in for NCCL (kernels/src/sim_nccl.cpp), for tests.
  const bool all_sim =
      std::all_of(places.begin(), places.end(), [&](const std::vector<Placement>& p) {
        return p[static_cast<std::size_t>(place)].device.type == DeviceType::sim;
      });
  if (all_sim) return true;
  if (!all_cuda) {
    throw GraphError(
        "collectives 'nccl' needs every replica on a CUDA device; use 'actors' (or 'auto')");
  }
  if (!nccl::built_with_nccl())
    throw GraphError("collectives 'nccl': baton was built without NCCL");
  return true;
}

}  // namespace

std::string Replicas::suffix(std::int64_t r) const {
  return dp > 1 ? fmt::format("@dp{}", r) : std::string();
}

Replicas replicate(const Differentiated& d, const Shards& shards, const Stages& st,
                   const TrainConfig& cfg) {
  Replicas out{.dp = cfg.dp, .pp = cfg.pp, .tp = cfg.tp, .zero = cfg.dp > 1 ? cfg.zero : 0};
  for (int r = 0; r < cfg.dp; ++r) {
    std::vector<Placement> places;
    for (int s = 0; s < cfg.pp * cfg.tp; ++s) {
      const auto i = static_cast<std::size_t>(r * cfg.pp * cfg.tp + s);
      places.push_back(
          cfg.replica_places.empty()
              ? Placement{.device = Device{DeviceType::cpu, static_cast<std::uint8_t>(i)}}
              : cfg.replica_places[i]);
    }
    out.places.push_back(std::move(places));
  }
  auto place = [&](const Value& v) { return st.device_of(st.at(v.id())) * cfg.tp + shards.at(v.id()); };
  std::int64_t bucket_size = 0;
  for (auto it = d.trained.rbegin(); it != d.trained.rend(); ++it) {
    const Value v = it->first;
    const std::int64_t bytes = numel(v.shape()) * static_cast<std::int64_t>(size_of(v.dtype()));
    const bool fits = !out.buckets.empty() && bucket_size + bytes <= cfg.bucket_bytes &&
                      out.buckets.back().weights[0].dtype() == v.dtype() &&
                      out.buckets.back().place == place(v);
    if (!fits) {
      out.buckets.push_back({.place = place(v)});
      bucket_size = 0;
    }
    out.buckets.back().weights.push_back(v);
    bucket_size += bytes;
  }
  if (cfg.dp > 1) {
    for (Replicas::Bucket& b : out.buckets) b.nccl = use_nccl(cfg, out.places, b.place);
  }
  return out;
}

std::string Replicas::to_text() const {
  std::string out = fmt::format("dp {} x pp {} x tp {}{}\n", dp, pp, tp,
                                zero == 1   ? ", zero 1: optimizer state split over dp"
                                : zero == 2 ? ", zero 2: optimizer state and gradients split over dp"
                                : zero == 3 ? ", zero 3: optimizer state, gradients and weights split over dp"
                                            : "");
  for (std::size_t r = 0; r < places.size(); ++r) {
    out += fmt::format("replica {}:", r);
    for (const Placement& p : places[r]) out += fmt::format(" r{}/{}", p.rank, p.device.str());
    out += '\n';
  }
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    std::string names;
    for (const Value& v : buckets[b].weights)
      names += fmt::format("{}{}", names.empty() ? "" : ", ", v.name());
    out += fmt::format("bucket {} at place {}{}: {}\n", b, buckets[b].place,
                       buckets[b].nccl ? " (nccl)" : "", names);
  }
  return out;
}

}  // namespace baton::passes
