// Lowering data parallelism (lowering.h): each bucket of summed gradients all-reduced over the
// replicas, by a ring of actors (collectives.h) or by NCCL.
#include <algorithm>

#include <fmt/format.h>

#include "baton/graph/collectives.h"
#include "lowering.h"

namespace baton::passes::detail {

std::vector<RegisterIndex> add_replica_allreduce(std::vector<PlanBuilder>& replicas,
                                                 const std::string& name,
                                                 const std::vector<RegisterIndex>& inputs,
                                                 const Shape& shape, DType dtype,
                                                 std::uint8_t stream, std::int32_t result_slots,
                                                 int place, const AllReduceSettings& settings) {
  std::vector<AllReduceMember> members;
  for (std::size_t r = 0; r < replicas.size(); ++r) {
    members.push_back({replicas[r].at(stream, place), inputs[r], replicas[r].suffix});
  }
  return add_allreduce(replicas[0].plan, name, members, shape, dtype, result_slots, settings);
}

namespace {

/// The all-reduce of one register per replica (bucket `bi` of `reps`): NCCL's, or the ring of
/// actors.
std::vector<RegisterIndex> allreduce_bucket(std::vector<PlanBuilder>& replicas,
                                            const Replicas& reps, std::size_t bi,
                                            const std::string& name,
                                            const std::vector<RegisterIndex>& inputs,
                                            const Shape& shape, DType dt, const TrainConfig& cfg) {
  const Replicas::Bucket& bucket = reps.buckets[bi];
  const bool compress = gradient_wire(cfg).has_value();
  if (compress && (bucket.nccl || dt != DType::f32)) {
    throw GraphError(fmt::format(
        "grad compression '{}' compresses f32 gradients summed by the ring of actors on the CPU; "
        "'{}' is {}{} (use --collectives actors with replicas on the CPU, or no compression)",
        cfg.grad_compression, name, baton::name(dt), bucket.nccl ? " and all-reduced by NCCL" : ""));
  }
  if (!bucket.nccl) {
    const AllReduceSettings settings = gradient_allreduce_settings(cfg);
    try {
      return add_replica_allreduce(replicas, name, inputs, shape, dt, backward_stream(cfg), 1,
                                   bucket.place, settings);
    } catch (const std::invalid_argument& e) {
      throw GraphError(e.what());
    }
  }
  Plan& plan = replicas[0].plan;
  std::vector<AllReduceMember> members;
  for (std::size_t r = 0; r < replicas.size(); ++r) {
    members.push_back({replicas[r].at(nccl_stream, bucket.place), inputs[r], replicas[r].suffix});
  }
  const std::size_t before = plan.actors.size();
  // One communicator per place (its members are the same every step), and the buckets in
  // one order on every rank: NCCL pairs the ranks' calls by their order on a communicator.
  auto out = add_nccl_allreduce(plan, name, members, shape, dt, 1,
                                fmt::format("grad.place{}", bucket.place));
  for (std::size_t a = before; a < plan.actors.size(); ++a) {
    ActorDesc& d = plan.actors[a];
    d.role = ActorRole::collective;
    // A lane is one worker's: one per (rank, device), so the ranks' lanes are told apart too
    // (the plan verifier after lower found two ranks' NCCL actors in one lane).
    d.order = ActOrder{.lane = nccl_lane_base + d.where.rank * 256 + d.where.device.code(),
                       .units = {0},
                       .period = 1,
                       .rank = static_cast<std::int32_t>(bi)};
  }
  return out;
}

}  // namespace

std::optional<DType> gradient_wire(const TrainConfig& cfg) {
  if (cfg.grad_compression == "bf16") return DType::bf16;
  if (cfg.grad_compression == "fp16") return DType::f16;
  return std::nullopt;  // "none" (check_config refuses anything else)
}

AllReduceSettings gradient_allreduce_settings(const TrainConfig& cfg) {
  AllReduceSettings settings;
  // A small bucket (a bias's gradient, a layer norm's) goes by the direct all-reduce: one hop
  // where the ring takes 2(N-1). Measured with baton-bench-allreduce on the 2-core machines,
  // 2 and 4 ranks, two runs (README, "Numbers"): through the data plane direct was 1.5-9x
  // faster at 1 and 4 KiB and 1.3-4x slower at 16 KiB, where UCX leaves its eager protocol for
  // rendezvous and the ring's chunks still travel eagerly (8 KiB, not measured, the safe side);
  // with the ranks of one host reading pieces in place, direct won to 64 KiB and the ring from
  // 256 KiB (collectives.h). Across hosts the pieces go through the data plane.
  const bool one_host = std::all_of(cfg.rank_hosts.begin(), cfg.rank_hosts.end(),
                                    [&](std::uint32_t h) { return h == cfg.rank_hosts.front(); });
  settings.direct_below_bytes = one_host ? gradient_direct_below_bytes_one_host : gradient_direct_below_bytes;
  settings.wire = gradient_wire(cfg);
  if (cfg.hierarchical_allreduce) settings.rank_hosts = cfg.rank_hosts;
  // A bucket is all-reduced once a step, and its next step's sums need this step's update,
  // which needs these sums read: a second slot on a hop would never be in use.
  settings.slots = 1;
  return settings;
}

namespace {

/// Replica r's gradient bucket `bi` as one register: the weight's summed gradient itself for a
/// bucket of one, else a flat register its pack actor fills.
RegisterIndex pack_bucket(PlanBuilder& b, const Replicas& reps, std::size_t bi,
                          const GradientInputs& grad_sum, std::int64_t r, const TrainConfig& cfg) {
  const std::vector<Value>& bucket = reps.buckets[bi].weights;
  const auto& local = grad_sum[static_cast<std::size_t>(r)];
  if (bucket.size() == 1) return local.at(bucket[0].id());
  const std::string name = fmt::format("grad.bucket{}", bi);
  std::int64_t total = 0;
  for (const Value& v : bucket) total += numel(v.shape());
  const DType dt = bucket[0].dtype();
  RegisterIndex flat = b.add_register(name, {total}, dt, 1);
  std::vector<InputPort> ins;
  for (const Value& v : bucket) ins.push_back({local.at(v.id())});
  b.plan.add_actor({.name = b.named(name + ".pack"),
                    .op = "allreduce.concat",
                    .dtype = dt,
                    .where = b.at(backward_stream(cfg), reps.buckets[bi].place),
                    .inputs = std::move(ins),
                    .outputs = {flat},
                    .role = ActorRole::collective});
  return flat;
}

}  // namespace

bool sums_in_place(const std::vector<PlanBuilder>& replicas, const Replicas& reps, std::size_t bi,
                   const TrainConfig& cfg) {
  const Replicas::Bucket& bucket = reps.buckets[bi];
  return !bucket.nccl && !gradient_wire(cfg) &&
         std::all_of(replicas.begin(), replicas.end(), [&](const PlanBuilder& b) {
           return b.at(backward_stream(cfg), bucket.place).device.type == DeviceType::cpu &&
                  std::all_of(bucket.weights.begin(), bucket.weights.end(),
                              [&](const Value& v) { return b.place(v.id()) == bucket.place; });
         });
}

std::vector<AllReduceMember> gradient_members(std::vector<PlanBuilder>& replicas, const Replicas& reps,
                                              std::size_t bi, const GradientInputs& grad_sum,
                                              const TrainConfig& cfg, bool in_place) {
  const std::vector<Value>& bucket = reps.buckets[bi].weights;
  std::vector<AllReduceMember> members;
  for (std::size_t r = 0; r < replicas.size(); ++r) {
    PlanBuilder& b = replicas[r];
    const Placement where = b.at(backward_stream(cfg), reps.buckets[bi].place);
    if (!in_place || bucket.size() == 1) {
      members.push_back({where, pack_bucket(b, reps, bi, grad_sum, static_cast<std::int64_t>(r), cfg), b.suffix});
      continue;
    }
    std::vector<RegisterIndex> parts;
    for (const Value& v : bucket) parts.push_back(grad_sum[r].at(v.id()));
    members.push_back({where, parts.front(), b.suffix, std::move(parts)});
  }
  return members;
}

namespace {

/// Each replica's variables' windows of a bucket's sums (its weights concatenated): sums[r] are
/// the registers replica r reads, in order (every replica the same ones after a flat
/// reduce-scatter, its host's after a hierarchical one); each weight reads the parts that hold
/// its elements, wherever they lie.
void read_in_place(const Plan& plan, const std::vector<Value>& bucket,
                   const std::vector<std::vector<RegisterIndex>>& sums, GradientInputs& grad_in,
                   GradientWindows& windows) {
  std::int64_t at = 0;
  for (const Value& v : bucket) {
    const std::int64_t n = numel(v.shape());
    for (std::size_t r = 0; r < sums.size(); ++r) {
      auto [parts, offset] = window_of_parts(plan, sums[r], at, n);
      const GradientAt window{std::move(parts), offset};
      grad_in[r][v.id()] = window.parts.front();
      windows[r][v.id()] = window;
    }
    at += n;
  }
}

}  // namespace

GradientInputs lower_gradient_allreduce(std::vector<PlanBuilder>& replicas, const Replicas& reps,
                                        const GradientInputs& grad_sum, const TrainConfig& cfg,
                                        GradientWindows& windows) {
  const auto n_dp = static_cast<std::int64_t>(replicas.size());
  GradientInputs grad_in(grad_sum.size());
  for (std::size_t bi = 0; bi < reps.buckets.size(); ++bi) {
    const std::vector<Value>& bucket = reps.buckets[bi].weights;
    if (n_dp == 1) {
      for (const Value& v : bucket) grad_in[0][v.id()] = grad_sum[0].at(v.id());
      continue;
    }
    const int place = reps.buckets[bi].place;
    // A bucket of one is all-reduced as it is; a bigger one is packed into one flat register.
    const std::string name = bucket.size() == 1 ? "grad." + bucket[0].name() : fmt::format("grad.bucket{}", bi);
    std::int64_t total = 0;
    for (const Value& v : bucket) total += numel(v.shape());
    const DType dt = bucket[0].dtype();
    // On CPU devices, with every weight of the bucket there and the sums in the weights' dtype,
    // the bucket is reduce-scattered from its weights' gradients where they lie (no packed
    // copy: each chain reads the gradients its segment is in) and each variable reads its
    // window of the members' sums where they lie (other devices' directly, other ranks' through
    // one transfer each): the same sums, bit for bit, as the all-reduce's of the packed bucket,
    // without the pack, the gather into a whole copy or the unpack.
    const bool in_place = sums_in_place(replicas, reps, bi, cfg);
    const std::vector<AllReduceMember> members = gradient_members(replicas, reps, bi, grad_sum, cfg, in_place);
    if (in_place) {
      try {
        const AllReduceSettings settings = gradient_allreduce_settings(cfg);
        Plan& plan = replicas[0].plan;
        std::vector<std::vector<RegisterIndex>> sums;
        if (!hosts_of_members(members, {total}, dt, settings).empty()) {
          sums = add_host_sums(plan, name, members, {total}, dt, settings);
        } else {
          std::vector<RegisterIndex> all;
          for (const auto& chunk : add_reduce_scatter(plan, name, members, {total}, dt, settings).parts) {
            all.insert(all.end(), chunk.begin(), chunk.end());
          }
          sums.assign(replicas.size(), all);
        }
        read_in_place(plan, bucket, sums, grad_in, windows);
      } catch (const std::invalid_argument& e) {
        throw GraphError(e.what());
      }
      continue;
    }
    std::vector<RegisterIndex> flat;
    for (const AllReduceMember& m : members) flat.push_back(m.input);
    auto reduced = allreduce_bucket(replicas, reps, bi, name, flat, {total}, dt, cfg);
    if (bucket.size() == 1) {
      for (std::int64_t r = 0; r < n_dp; ++r)
        grad_in[static_cast<std::size_t>(r)][bucket[0].id()] = reduced[static_cast<std::size_t>(r)];
      continue;
    }
    for (std::int64_t r = 0; r < n_dp; ++r) {
      auto& b = replicas[static_cast<std::size_t>(r)];
      std::vector<RegisterIndex> outs;
      for (const Value& v : bucket) {
        outs.push_back(b.add_register("grad." + v.name() + ".allreduced", v.shape(), v.dtype(), 1));
        grad_in[static_cast<std::size_t>(r)][v.id()] = outs.back();
      }
      b.plan.add_actor({.name = b.named(name + ".unpack"),
                        .op = "allreduce.split",
                        .dtype = dt,
                        .where = b.at(backward_stream(cfg), place),
                        .inputs = {{reduced[static_cast<std::size_t>(r)]}},
                        .outputs = std::move(outs),
                        .role = ActorRole::collective});
    }
  }
  return grad_in;
}

}  // namespace baton::passes::detail
