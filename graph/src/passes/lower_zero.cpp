// Lowering ZeRO (lowering.h, TrainConfig::zero). Per gradient bucket of each place, over the dp
// replicas:
//
//   grads of the bucket@dp0 ──┐                  ┌─> optim.bucket@dp0 ─> shard@dp0 ──┐ (every shard to
//   grads of the bucket@dp1 ──┼─ reduce-scatter ─┼─> optim.bucket@dp1 ─> shard@dp1 ──┤  every replica)
//        ...                  │                  │         ...                        ├─> gather@dp r
//                                                                                        ─> w.step@dp r
//
// Both stages reduce-scatter the weights' gradients where they lie (as plain dp does on CPU
// devices, lower_allreduce.cpp: no replica ever holds the whole summed bucket), so they differ
// only in clipping: stage 1 reads every chunk's sums (plain dp's norm, bit for bit), stage 2
// sums each replica's squares and shares the scalars. With --grad-compression bf16 (stage 1
// only) the packed bucket is all-reduced and each shard reads its window of it.
//
// Replica c's optimizer actor owns elements [off_c, off_c+1) of the bucket's concatenated
// weights (chunk_offsets, as the all-reduce's chunks): their optimizer slots, so each replica
// keeps 1/dp of them, and its output register, where it updates those elements (read from the
// weights its replica's gather wrote the step before: no master copy beside them). It reads
// the same sums the plain all-reduce would have given it (its chunk, which is all the
// reduce-scatter leaves it) and applies the same elementwise update, so weights and losses
// equal plain data parallelism bit for bit. The gather then writes every weight of the bucket
// into the replica's step register, which the repeat hands to the micro-batches.
//
// Stage 3 (FSDP's full sharding) keeps no step register: replica c's optimizer keeps its window
// as its master (its output register, updated in place, as a plain variable's), and every
// replica reads every shard through a repeat for its micro-batches:
//
//   shard@dp c ─> repeat@dp r ─┬─> w.gather@dp r     (just before w's first forward reader)
//                              └─> w.gather.bwd@dp r (just before its first backward reader)
//
// Each gather acts once per micro-batch in its pass's lane (lanes.cpp), so the memory pass
// (plan_memory.h) sees a whole weight live only from its gather to its last reader in that pass
// and gives those bytes to other registers the rest of the time. The same values reach the same
// readers and the same update is applied to the same elements: bit for bit plain dp again.
#include <algorithm>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "baton/graph/collectives.h"
#include "lowering.h"
#include "variable_kernel.h"

namespace baton::passes::detail {

namespace {

/// Elements [begin, end) of the concatenation of `tensors` (each flattened), as T.
template <class T>
std::vector<T> window_of(const std::vector<const Tensor*>& tensors, std::int64_t begin,
                         std::int64_t end) {
  std::vector<std::span<const T>> parts;
  for (const Tensor* t : tensors) parts.push_back(t->data<T>());
  std::vector<T> out(static_cast<std::size_t>(end - begin));
  copy_window<T>(parts, begin, std::span<T>(out));
  return out;
}

/// "zero.gather": the concatenation of the inputs (every replica's shard, in replica order)
/// into the concatenation of the outputs (the bucket's weights, in bucket order).
template <class T>
void gather_shards(KernelContext& ctx) {
  std::size_t out = 0, at = 0;  // the output being filled, and how far
  auto skip_full = [&] {
    while (out < ctx.outputs.size() &&
           at == static_cast<std::size_t>(ctx.outputs[out]->numel())) {
      ++out;
      at = 0;
    }
  };
  for (const Tensor* in : ctx.inputs) {
    auto src = in->data<T>();
    for (std::size_t taken = 0; taken < src.size();) {
      skip_full();
      if (out == ctx.outputs.size())
        throw std::invalid_argument("zero.gather: the shards hold more elements than the weights");
      auto dst = ctx.outputs[out]->data<T>();
      const std::size_t n = std::min(src.size() - taken, dst.size() - at);
      std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(taken), n,
                  dst.begin() + static_cast<std::ptrdiff_t>(at));
      taken += n;
      at += n;
    }
  }
  skip_full();
  if (out != ctx.outputs.size())
    throw std::invalid_argument("zero.gather: the shards hold fewer elements than the weights");
}

/// "zero3.gather.<weight>": the weight is elements [begin, begin + its size) of the
/// concatenation of the inputs (the shards that hold it).
template <class T>
void gather_window(KernelContext& ctx, std::int64_t begin) {
  std::vector<std::span<const T>> parts;
  for (const Tensor* in : ctx.inputs) parts.push_back(in->data<T>());
  auto out = ctx.outputs[0]->data<T>();
  const std::size_t filled = copy_window<T>(parts, begin, out);
  if (filled != out.size()) {
    throw std::invalid_argument(fmt::format("zero 3: the shards hold {} of the weight's {} elements", filled, out.size()));
  }
}

/// Copies `from`, elements [begin, begin + its size) of the concatenation of `to`, into `to`.
template <class T>
void scatter_window(std::span<const T> from, std::int64_t begin, std::vector<Tensor>& to) {
  std::int64_t at = 0;  // where to[i] starts in the concatenation
  const std::int64_t end = begin + static_cast<std::int64_t>(from.size());
  for (Tensor& t : to) {
    auto dst = t.data<T>();
    const auto n = static_cast<std::int64_t>(dst.size());
    const std::int64_t lo = std::max(begin, at), hi = std::min(end, at + n);
    if (lo < hi) std::copy(from.begin() + (lo - begin), from.begin() + (hi - begin), dst.begin() + (lo - at));
    at += n;
  }
}

/// Refuses a bucket the sharded optimizer cannot train (CPU kernels, f32 and f64 only).
void check_zero_place(const std::vector<PlanBuilder>& replicas, const Replicas::Bucket& bucket, const TrainConfig& cfg) {
  const DType dt = bucket.weights[0].dtype();
  for (const PlanBuilder& b : replicas) {
    const Placement where = b.at(backward_stream(cfg), bucket.place);
    if (where.device.type != DeviceType::cpu || (dt != DType::f32 && dt != DType::f64)) {
      throw GraphError(fmt::format(
          "zero {}: the sharded optimizer has CPU kernels for f32 and f64 only so far; '{}' is "
          "{} on {} (train it without --zero)",
          cfg.zero, bucket.weights[0].name(), baton::name(dt), where.device.str()));
    }
  }
}

/// How many micro-batches of a stage may read a weight at once (add_weight_repeat's depth).
std::int32_t weight_slots(const Stages& st, int stage) {
  return st.pp > 1 ? std::max(2, st.forward_slots[static_cast<std::size_t>(stage)] + 1) : 2;
}

/// Replica 0's gather on the reporting rank: also copies its last act's weights (the trained
/// ones) into the ParameterStore, which without ZeRO is the master copy itself.
template <class T>
class GatherIntoStore final : public Kernel {
 public:
  GatherIntoStore(std::vector<Tensor> store, std::int64_t last_piece)
      : store_(std::move(store)), last_piece_(last_piece) {}
  void compute(KernelContext& ctx) override {
    gather_shards<T>(ctx);
    if (ctx.piece != last_piece_) return;
    for (std::size_t i = 0; i < store_.size(); ++i) {
      auto from = ctx.outputs[i]->data<T>();
      std::copy(from.begin(), from.end(), store_[i].data<T>().begin());
    }
  }

 private:
  std::vector<Tensor> store_;
  std::int64_t last_piece_;
};

/// The weights of `bucket` that elements [begin, end) of its concatenation hold: whole, or the
/// piece of a weight that straddles the window's edge (SnapshotPart, on `rank`).
std::vector<SnapshotPart> parts_in_window(const std::vector<Value>& bucket, std::int64_t begin,
                                          std::int64_t end, std::uint32_t rank) {
  std::vector<SnapshotPart> parts;
  std::int64_t at = 0;  // where the weight starts in the concatenation
  for (const Value& v : bucket) {
    const std::int64_t n = numel(v.shape());
    const std::int64_t lo = std::max(begin, at), hi = std::min(end, at + n);
    if (lo < hi) {
      const bool whole = lo == at && hi == at + n;
      parts.push_back({.name = v.name(),
                       .begin = whole ? 0 : lo - at,
                       .end = whole ? -1 : hi - at,
                       .shape = v.shape(),
                       .dtype = v.dtype(),
                       .rank = rank});
    }
    at += n;
  }
  return parts;
}

/// A shard's checkpoint hook: its snapshot (the window's elements, 1-D) handed on as one
/// snapshot per weight of `parts` (parts_in_window, whose windows start at `begin`).
baton::detail::SnapshotHook shard_snapshots(std::vector<SnapshotPart> parts, std::int64_t begin,
                                            const TrainConfig& cfg) {
  if (cfg.snapshot_every <= 0 || !cfg.on_snapshot) return {};
  // Where each part starts in the shard's window.
  std::vector<std::int64_t> offsets;
  std::int64_t at = begin;  // the concatenation's element the window's first part starts at
  for (const SnapshotPart& p : parts) {
    offsets.push_back(at - begin);
    at += p.whole() ? numel(p.shape) : p.end - p.begin;
  }
  auto split = [parts = std::move(parts), offsets, hand_on = cfg.on_snapshot](VariableSnapshot s) {
    auto piece = [](const Tensor& t, std::int64_t from, std::int64_t n, const Shape& shape) {
      Tensor out = Tensor::empty(shape, t.dtype());
      const std::size_t bytes = size_of(t.dtype());
      std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + static_cast<std::size_t>(from) * bytes,
                  static_cast<std::size_t>(n) * bytes);
      return out;
    };
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const SnapshotPart& p = parts[i];
      const std::int64_t n = p.whole() ? numel(p.shape) : p.end - p.begin;
      const Shape shape = p.whole() ? p.shape : Shape{n};
      VariableSnapshot one{.name = p.name,
                           .step = s.step,
                           .weight = piece(s.weight, offsets[i], n, shape),
                           .begin = p.begin,
                           .end = p.end};
      for (const auto& [slot, t] : s.slots) one.slots[slot] = piece(t, offsets[i], n, shape);
      hand_on(std::move(one));
    }
  };
  return {.name = "", .every = cfg.snapshot_every, .hand_over = std::move(split)};
}

/// Replica c's optimizer kernel for elements [begin, end) of bucket `bucket`'s weights.
template <class T>
KernelFactory shard_kernel(const std::vector<Value>& bucket, std::int64_t begin, std::int64_t end,
                           GradientWindow window, WeightWindow weight_window, const TrainConfig& cfg,
                           const ParameterStore& params, const Graph& g,
                           baton::detail::SnapshotHook snapshots) {
  std::vector<const Tensor*> weights;
  for (const Value& v : bucket) weights.push_back(&params.at(v.name()));
  Tensor master = Tensor::empty({end - begin}, bucket[0].dtype());
  auto values = window_of<T>(weights, begin, end);
  std::copy(values.begin(), values.end(), master.data<T>().begin());
  std::vector<std::vector<T>> slots;
  if (cfg.optimizer_state) {
    // A resumed job: the saved (whole) slots, this shard's window of them.
    std::vector<const std::map<std::string, Tensor>*> saved;
    for (const Value& v : bucket) saved.push_back(optimizer_slots_of(cfg, g.node(v.id())));
    for (const std::string& name : optimizer_slot_names(cfg.optimizer)) {
      std::vector<const Tensor*> of;
      for (const auto* s : saved) of.push_back(&s->at(name));
      slots.push_back(window_of<T>(of, begin, end));
    }
  }
  return [master, slots, window, weight_window, oc = cfg.optimizer, steps = cfg.steps,
          snapshots](const KernelConfig&) -> std::unique_ptr<Kernel> {
    return std::make_unique<VariableKernel<T>>(master, oc, steps, slots, snapshots, window, weight_window);
  };
}

/// Every replica's clipping factor: zero 1 from every bucket's sums, where they lie (as
/// without ZeRO);
/// zero 2, where each replica has only its chunks, from the sum of every replica's sum of
/// squares (a scalar each way instead of the gradients).
void lower_zero_clip(std::vector<PlanBuilder>& replicas, DType dt,
                     const std::vector<std::vector<InputPort>>& reduced,
                     const std::vector<std::optional<RegisterIndex>>& clip,
                     const TrainConfig& cfg) {
  const std::uint8_t stream = backward_stream(cfg);
  add_clip_kernel(replicas[0].kernels, dt, cfg.optimizer.clip_norm);
  auto add_clip = [&](std::size_t r, const std::string& op, const std::vector<InputPort>& inputs) {
    PlanBuilder& b = replicas[r];
    b.plan.add_actor({.name = b.named("optim.clip"),
                      .op = op,
                      .dtype = dt,
                      .where = b.host(stream),
                      .inputs = inputs,
                      .outputs = {*clip[r]},
                      .role = ActorRole::update});
  };
  if (cfg.zero == 1) {
    for (std::size_t r = 0; r < replicas.size(); ++r) add_clip(r, "optim.clip", reduced[r]);
    return;
  }
  std::vector<InputPort> squares;
  for (std::size_t r = 0; r < replicas.size(); ++r) {
    PlanBuilder& b = replicas[r];
    squares.push_back({b.add_register("clip.squares", {1}, DType::f64, 1)});
    b.plan.add_actor({.name = b.named("optim.sum_of_squares"),
                      .op = "optim.sum_of_squares",
                      .dtype = dt,
                      .where = b.host(stream),
                      .inputs = reduced[r],
                      .outputs = {squares.back().reg},
                      .role = ActorRole::update});
  }
  for (std::size_t r = 0; r < replicas.size(); ++r) add_clip(r, "optim.clip_of_squares", squares);
}

}  // namespace

namespace {

/// What each replica's shard of a bucket reads of the summed gradients: its ports (delay 1) and
/// where its elements start in their concatenation.
struct ShardGradients {
  std::vector<std::vector<InputPort>> grads;
  std::vector<GradientWindow> windows;
};

/// Sums bucket `bi` over the replicas for their shards (chunk c for replica c, `offsets`), and
/// adds what each replica's clipping reads to `reduced`.
ShardGradients sum_bucket(std::vector<PlanBuilder>& replicas, const Replicas& reps, std::size_t bi,
                          const GradientInputs& grad_sum, const TrainConfig& cfg,
                          const std::vector<std::int64_t>& offsets, std::vector<std::vector<InputPort>>& reduced) {
  const Replicas::Bucket& bucket = reps.buckets[bi];
  const DType dt = bucket.weights[0].dtype();
  const std::int64_t total = offsets.back();
  Plan& plan = replicas[0].plan;
  // The weights' gradients are reduce-scattered where they lie (no packed copy), as plain dp
  // does (lower_allreduce.cpp); compressed sums go by the packed bucket's all-reduce.
  const std::vector<AllReduceMember> members =
      gradient_members(replicas, reps, bi, grad_sum, cfg, sums_in_place(replicas, reps, bi, cfg));
  const std::string name = bucket.weights.size() == 1 ? "grad." + bucket.weights[0].name()
                                                      : fmt::format("grad.bucket{}", bi);
  // The plain all-reduce's choices (lower_allreduce.cpp), so the sums are the same bits.
  const AllReduceSettings settings = gradient_allreduce_settings(cfg);
  ShardGradients out{.grads = std::vector<std::vector<InputPort>>(replicas.size()),
                     .windows = std::vector<GradientWindow>(replicas.size())};
  try {
    if (settings.wire) {  // stage 1 only (check_config refuses compression with 2)
      auto sums = add_allreduce(plan, name, members, {total}, dt, 1, settings);
      for (std::size_t c = 0; c < sums.size(); ++c) {
        out.grads[c] = {{sums[c], 1}};
        out.windows[c] = {.parts = 1, .offset = offsets[c]};
        reduced[c].push_back({sums[c]});
      }
      return out;
    }
    // Both stages: replica c's shard is chunk c, which the reduce-scatter leaves on c. What
    // clipping reads: stage 2 each replica's own chunk (its sum of squares), stage 1 every
    // chunk, where it lies, as plain dp's clipping does (so the same norm, bit for bit).
    const ReduceScattered rs = add_reduce_scatter(plan, name, members, {total}, dt, settings);
    for (std::size_t c = 0; c < rs.parts.size(); ++c) {
      for (RegisterIndex part : rs.parts[c]) {
        out.grads[c].push_back({part, 1});
        if (cfg.zero >= 2) reduced[c].push_back({part});
        for (std::size_t r = 0; cfg.zero == 1 && r < reduced.size(); ++r) reduced[r].push_back({part});
      }
      out.windows[c] = {.parts = rs.parts[c].size(), .offset = 0};
    }
  } catch (const std::invalid_argument& e) {
    throw GraphError(e.what());
  }
  return out;
}

/// Stage 3: the repeats through which the gathers (add_zero3_gather) read the shards of bucket
/// `bi`, one per micro-batch: on the reader's replica for a shard of its rank, on the shard's
/// for a transfer to pull.
void add_zero3_reads(std::vector<PlanBuilder>& replicas, std::size_t bi, const Zero3Layout& z, const TrainConfig& cfg) {
  const Zero3Layout::Bucket& zb = z.buckets[bi];
  auto repeat = [&](std::size_t at, const std::string& name, std::size_t c, RegisterIndex out) {
    PlanBuilder& b = replicas[at];
    b.plan.add_actor({.name = b.named(name),
                      .kind = ActorKind::repeat,
                      .dtype = b.plan.registers[out].dtype,
                      .where = z.at(bi, at),
                      .inputs = {{zb.shards[c]}},
                      .outputs = {out},
                      .group = static_cast<std::int32_t>(cfg.microbatches)});
  };
  for (std::size_t r = 0; r < replicas.size(); ++r) {
    for (std::size_t c = 0; c < replicas.size(); ++c) {
      const auto& read = zb.reads[r][c];
      const auto& pulled = zb.pulled[r][c];
      if (pulled[0].made || pulled[1].made) {
        for (std::size_t pass = 0; pass < 2; ++pass) {
          if (pulled[pass].made)
            repeat(c, fmt::format("zero.bucket{}.shard{}.repeat{}.for{}", bi, c, pass == 1 ? ".bwd" : "", z.suffixes[r]), c,
                   pulled[pass].reg);
        }
      } else if (read[0].made || read[1].made) {
        repeat(r, fmt::format("zero.bucket{}.shard{}.repeat", bi, c), c, read[read[0].made ? 0 : 1].reg);
      }
    }
  }
}

/// Stage 3: the trained weights into `params` on the reporting rank, shard by shard. A sink there
/// reads a shard of that rank each step and copies its last; replica 0's forward pulls bring the
/// other ranks' shards to a sink in the lane (add_zero3_gather), which copies the pieces of the
/// step after the last. Where replica 0 is not on the reporting rank (a pipeline stage on
/// another rank), each shard is kept to its last step beside it (an accumulate "last", as
/// gather_final_weights does), and one piece crosses, once.
void add_zero3_store(std::vector<PlanBuilder>& replicas, const Replicas::Bucket& bucket, std::size_t bi,
                     const Zero3Layout& z, const TrainConfig& cfg, ParameterStore& params) {
  const DType dt = bucket.weights[0].dtype();
  const std::int64_t acts = cfg.steps - cfg.first_step + 1;  // the first weights, then a step each
  Plan& plan = replicas[0].plan;
  const Zero3Layout::Bucket& zb = z.buckets[bi];
  for (std::size_t c = 0; c < replicas.size(); ++c) {
    const Placement where = z.at(bi, c);
    std::vector<Tensor> store;
    for (const Value& v : bucket.weights) store.push_back(params.at(v.name()));
    const std::int64_t begin = zb.offsets[c];
    auto add_kernel = [&](const std::string& op, std::int64_t copy_at) {
      replicas[0].kernels.add_fn(op, DeviceType::cpu, dt, [store, begin, copy_at, dt](KernelContext& ctx) mutable {
        if (ctx.piece != copy_at) return;
        if (dt == DType::f64) {
          scatter_window<double>(ctx.inputs[0]->data<double>(), begin, store);
        } else {
          scatter_window<float>(ctx.inputs[0]->data<float>(), begin, store);
        }
      });
    };
    if (zb.stored_from_pull[c]) {
      add_kernel(fmt::format("zero3.store.bucket{}.shard{}", bi, c), acts * cfg.microbatches - 1);
      continue;
    }
    if (zb.offsets[c] == zb.offsets[c + 1]) continue;  // an empty shard
    RegisterIndex from = zb.shards[c];
    std::int64_t copy_at = acts - 1;
    const std::string name = fmt::format("zero.bucket{}.shard{}.store", bi, c);
    if (where.rank != z.reporter.rank) {
      const RegisterDesc& shard = plan.registers[from];
      const RegisterIndex last = plan.add_register({.name = name + ".last", .shape = shard.shape, .dtype = dt, .slots = 1});
      plan.add_actor({.name = name + ".last",
                      .kind = ActorKind::accumulate,
                      .op = "last",
                      .dtype = dt,
                      .where = where,
                      .inputs = {{from}},
                      .outputs = {last},
                      .group = static_cast<std::int32_t>(acts),
                      .role = ActorRole::update,
                      .at_end = true});
      from = last;
      copy_at = 0;
    }
    add_kernel(name, copy_at);
    plan.add_actor({.name = name,
                    .op = name,
                    .dtype = dt,
                    .where = where.rank == z.reporter.rank ? where : z.reporter,
                    .inputs = {{from}},
                    .role = ActorRole::update});
  }
}

}  // namespace

Zero3Layout zero3_layout(std::vector<PlanBuilder>& replicas, const Replicas& reps, const TrainConfig& cfg) {
  const std::size_t n_dp = replicas.size();
  KernelRegistry& kernels = replicas[0].kernels;
  Zero3Layout z;
  z.weights.resize(n_dp);
  for (const PlanBuilder& b : replicas) z.suffixes.push_back(b.suffix);
  for (std::size_t bi = 0; bi < reps.buckets.size(); ++bi) {
    const Replicas::Bucket& bucket = reps.buckets[bi];
    check_zero_place(replicas, bucket, cfg);
    const DType dt = bucket.weights[0].dtype();
    std::int64_t total = 0;
    for (const Value& v : bucket.weights) total += numel(v.shape());
    Zero3Layout::Bucket& zb = z.buckets.emplace_back();
    zb.offsets = chunk_offsets(total, static_cast<std::int64_t>(n_dp));
    for (std::size_t c = 0; c < n_dp; ++c) {
      z.places.push_back(replicas[c].at(backward_stream(cfg), bucket.place));
      const RegisterIndex s = replicas[c].add_register(fmt::format("zero.bucket{}.shard", bi),
                                                        {zb.offsets[c + 1] - zb.offsets[c]}, dt, 1);
      // The optimizer's master itself (VariableKernel::owned_output), as a plain variable's.
      replicas[c].plan.registers[s].kernel_memory = true;
      zb.shards.push_back(s);
    }
    zb.reads.assign(n_dp, std::vector<std::array<Zero3Layout::Read, 2>>(n_dp));
    zb.pulled = zb.reads;
    zb.stored_from_pull.assign(n_dp, false);
    std::int64_t at = 0;  // where the weight starts in the bucket's concatenation
    for (const Value& v : bucket.weights) {
      const std::int64_t n = numel(v.shape());
      // The shards holding its first and last elements (an empty chunk is never the one).
      auto holder = [&](std::int64_t e) {
        return static_cast<std::size_t>(std::upper_bound(zb.offsets.begin(), zb.offsets.end(), e) - zb.offsets.begin() - 1);
      };
      Zero3Layout::Weight w{.bucket = bi,
                            .first = holder(at),
                            .last = holder(at + std::max<std::int64_t>(n, 1) - 1),
                            .begin = 0,
                            .op = "zero3.gather." + v.name()};
      w.begin = at - zb.offsets[w.first];
      const std::int64_t begin = w.begin;
      if (dt == DType::f64) {
        kernels.add_fn(w.op, DeviceType::cpu, dt, [begin](KernelContext& ctx) { gather_window<double>(ctx, begin); });
      } else {
        kernels.add_fn(w.op, DeviceType::cpu, dt, [begin](KernelContext& ctx) { gather_window<float>(ctx, begin); });
      }
      for (std::size_t r = 0; r < n_dp; ++r) z.weights[r][v.id()] = w;
      at += n;
    }
  }
  return z;
}

namespace {

/// What replica r (b) reads shard c of bucket `bucket` from in a pass, made at the first need: a
/// repeat of it where it lies (its rank), or the register a transfer pulls it into, the transfer
/// placed in the pass's lane here (its repeat on the shard's rank is lower_zero's).
Zero3Layout::Read& zero3_read(PlanBuilder& b, std::size_t r, Zero3Layout& z, std::size_t bucket, std::size_t c,
                              bool backward, const Placement& where, std::int32_t slots) {
  Zero3Layout::Bucket& zb = z.buckets[bucket];
  const std::size_t pass = backward ? 1 : 0;
  auto& read = zb.reads[r][c][pass];
  if (read.made) return read;
  const RegisterDesc shard = b.plan.registers[zb.shards[c]];
  if (z.at(bucket, c).rank == where.rank) {
    // Read where it lies through a repeat (no bytes of its own), one for both passes.
    auto& other = zb.reads[r][c][1 - pass];
    if (!other.made) other = {b.add_register(fmt::format("zero.bucket{}.shard{}", bucket, c), shard.shape, shard.dtype, slots), true};
    read = other;
    return read;
  }
  const ActorRole role = backward ? ActorRole::backward : ActorRole::forward;
  const std::string to = fmt::format("zero.bucket{}.shard{}{}", bucket, c, backward ? ".bwd" : "");
  auto& pulled = zb.pulled[r][c][pass];
  pulled = {b.plan.add_register({.name = fmt::format("{}.to{}{}", to, b.suffix, z.suffixes[c]),
                                 .shape = shard.shape,
                                 .dtype = shard.dtype,
                                 .slots = slots}),
            true};
  read = {b.add_register(to, shard.shape, shard.dtype, slots), true};
  b.plan.add_actor({.name = b.named(to + ".pull"),
                    .kind = ActorKind::transfer,
                    .op = "transfer",
                    .dtype = shard.dtype,
                    .where = where,
                    .inputs = {{pulled.reg}},
                    .outputs = {read.reg},
                    .role = role});
  if (r == 0 && !backward && where.rank == z.reporter.rank) {
    // The reporting rank's store takes the trained shard from these pulls: one more step's
    // worth after the last forward pass. Right behind the pull in the lane, so the pulled
    // register lives no longer for it (lower_zero gives it its kernel).
    zb.stored_from_pull[c] = true;
    b.plan.add_actor({.name = fmt::format("zero.bucket{}.shard{}.store", bucket, c),
                      .op = fmt::format("zero3.store.bucket{}.shard{}", bucket, c),
                      .dtype = shard.dtype,
                      .where = where,
                      .inputs = {{read.reg}},
                      .role = role});
  }
  return read;
}

/// Where replica b gathers weight `id` in a pass, and with how many slots.
std::pair<Placement, std::int32_t> zero3_place(const PlanBuilder& b, int id, bool backward, const Stages& st,
                                               const TrainConfig& cfg) {
  return {b.at(backward ? backward_stream(cfg) : forward_stream, b.place(id)), weight_slots(st, b.stage(id))};
}

}  // namespace

void zero3_sequence(Zero3Layout& z, const Graph& g, const std::vector<bool>& needed, int loss_id) {
  // As lower_nodes goes: the op nodes in id order, each gathering the weights it reads first.
  std::vector<std::pair<int, bool>> order;
  std::set<std::pair<int, bool>> seen;
  for (int id = 0; id < g.size(); ++id) {
    const Node& n = g.node(id);
    if (!needed[static_cast<std::size_t>(id)] || n.op == "input" || n.op == "variable" ||
        (n.op == "fill" && n.inputs.empty()))
      continue;
    for (int in : n.inputs) {
      const std::pair<int, bool> gather{in, id > loss_id};
      if (z.weights[0].contains(in) && seen.insert(gather).second) order.push_back(gather);
    }
  }
  for (std::size_t i = 0; i + 1 < order.size(); ++i) z.next[order[i]] = order[i + 1];
}

void add_zero3_gather(PlanBuilder& b, std::size_t r, int id, Zero3Layout& z, bool backward, const Stages& st,
                      const TrainConfig& cfg) {
  const Zero3Layout::Weight& w = z.weights[r].at(id);
  const Node& n = b.g.node(id);
  const auto [where, slots] = zero3_place(b, id, backward, st, cfg);
  std::vector<InputPort> ins;
  for (std::size_t c = w.first; c <= w.last; ++c) ins.push_back({zero3_read(b, r, z, w.bucket, c, backward, where, slots).reg});
  const RegisterIndex reg = b.add_register(n.name + (backward ? ".gathered.bwd" : ".gathered"), n.shape, n.dtype, slots);
  (backward ? b.backward_reg_of : b.reg_of)[id] = reg;
  b.plan.add_actor({.name = b.named(n.name + (backward ? ".gather.bwd" : ".gather")),
                    .op = w.op,
                    .dtype = n.dtype,
                    .where = where,
                    .inputs = std::move(ins),
                    .outputs = {reg},
                    .role = backward ? ActorRole::backward : ActorRole::forward,
                    .memory = MemoryCategory::weights});  // gathered in the pass, but weights
  // FSDP's prefetch: the next gather's pulls go into the lane here, behind this gather and
  // ahead of this weight's readers, so that they cross while those compute.
  if (auto next = z.next.find({id, backward}); next != z.next.end()) {
    const auto [next_id, next_backward] = next->second;
    const Zero3Layout::Weight& nw = z.weights[r].at(next_id);
    const auto [next_where, next_slots] = zero3_place(b, next_id, next_backward, st, cfg);
    for (std::size_t c = nw.first; c <= nw.last; ++c) zero3_read(b, r, z, nw.bucket, c, next_backward, next_where, next_slots);
  }
}

std::vector<SnapshotPart> lower_zero(std::vector<PlanBuilder>& replicas, const Replicas& reps, const Differentiated& d,
                const GradientInputs& grad_sum, const GradientInputs& steps,
                const std::vector<std::optional<RegisterIndex>>& clip, const TrainConfig& cfg,
                ParameterStore& params, const Placement& reporter, const Zero3Layout* zero3) {
  const std::uint16_t reporter_rank = reporter.rank;
  const auto n_dp = static_cast<std::int64_t>(replicas.size());
  const std::uint8_t stream = backward_stream(cfg);
  KernelRegistry& kernels = replicas[0].kernels;
  kernels.add_fn("zero.gather", DeviceType::cpu, DType::f32, gather_shards<float>);
  kernels.add_fn("zero.gather", DeviceType::cpu, DType::f64, gather_shards<double>);
  // What each replica's clipping reads: every bucket's sums (1) or its chunks (2).
  std::vector<std::vector<InputPort>> reduced(static_cast<std::size_t>(n_dp));
  std::vector<SnapshotPart> snapshots;
  for (std::size_t bi = 0; bi < reps.buckets.size(); ++bi) {
    const Replicas::Bucket& bucket = reps.buckets[bi];
    const DType dt = bucket.weights[0].dtype();
    std::int64_t total = 0;
    for (const Value& v : bucket.weights) total += numel(v.shape());
    check_zero_place(replicas, bucket, cfg);
    const auto offsets = chunk_offsets(total, n_dp);
    const ShardGradients g = sum_bucket(replicas, reps, bi, grad_sum, cfg, offsets, reduced);
    const auto& grads = g.grads;
    const auto& windows = g.windows;
    // Each replica's optimizer for its shard, then every replica's gather of all the shards.
    std::vector<InputPort> shards;
    for (std::int64_t c = 0; c < n_dp; ++c) {
      const auto ci = static_cast<std::size_t>(c);
      PlanBuilder& b = replicas[ci];
      const std::int64_t begin = offsets[ci], end = offsets[ci + 1];
      shards.push_back({zero3 != nullptr ? zero3->buckets[bi].shards[ci]
                                          : b.add_register(fmt::format("zero.bucket{}.shard", bi), {end - begin}, dt, 1)});
      const std::string op = b.named(fmt::format("optim.bucket{}", bi));
      // Stages 1 and 2: it reads its elements' current values from the weights its replica's
      // gather wrote (the step before's, delay 1), so it keeps no master copy of its own. Stage
      // 3: its output is its master (no weights are gathered between steps).
      std::vector<InputPort> ins = grads[ci];
      if (zero3 == nullptr) {
        for (const Value& v : bucket.weights) ins.push_back({steps[ci].at(v.id()), 1});
      }
      if (clip[ci]) ins.push_back({*clip[ci], 1});
      const WeightWindow weights = zero3 != nullptr ? WeightWindow{} : WeightWindow{.parts = bucket.weights.size(), .offset = begin};
      // Every replica snapshots its shard: the weights (or pieces) its window holds.
      auto parts = parts_in_window(bucket.weights, begin, end, b.at(stream, bucket.place).rank);
      snapshots.insert(snapshots.end(), parts.begin(), parts.end());
      auto hook = shard_snapshots(std::move(parts), begin, cfg);
      kernels.add(op, DeviceType::cpu, dt,
                  dt == DType::f64
                      ? shard_kernel<double>(bucket.weights, begin, end, windows[ci], weights, cfg, params, b.g, hook)
                      : shard_kernel<float>(bucket.weights, begin, end, windows[ci], weights, cfg, params, b.g, hook));
      const std::int64_t bytes = (end - begin) * static_cast<std::int64_t>(size_of(dt));
      const auto slots = static_cast<std::int64_t>(optimizer_slot_names(cfg.optimizer).size());
      std::vector<KeptBytes> kept;
      if (zero3 != nullptr) kept.push_back({MemoryCategory::weights, bytes});  // the master, its output
      if (slots > 0) kept.push_back({MemoryCategory::optimizer_state, slots * bytes});
      // A clipped gradient is scaled into a copy; an unclipped one is read where it lies.
      if (clip[ci]) kept.push_back({MemoryCategory::gradients, bytes});
      b.plan.add_actor({.name = op,
                        .op = op,
                        .dtype = dt,
                        .where = b.at(stream, bucket.place),
                        .inputs = std::move(ins),
                        .outputs = {shards.back().reg},
                        .first_piece = cfg.first_step,
                        .stops_when_unread = false,
                        .role = ActorRole::update,
                        .kept = std::move(kept)});
    }
    if (zero3 != nullptr) {
      add_zero3_reads(replicas, bi, *zero3, cfg);
      add_zero3_store(replicas, bucket, bi, *zero3, cfg, params);
      continue;
    }
    for (std::int64_t r = 0; r < n_dp; ++r) {
      PlanBuilder& b = replicas[static_cast<std::size_t>(r)];
      std::vector<RegisterIndex> outs;
      for (const Value& v : bucket.weights) outs.push_back(steps[static_cast<std::size_t>(r)].at(v.id()));
      std::string op = "zero.gather";
      if (r == 0 && b.at(stream, bucket.place).rank == reporter_rank) {
        op = fmt::format("zero.bucket{}.gather", bi);
        std::vector<Tensor> store;
        for (const Value& v : bucket.weights) store.push_back(params.at(v.name()));
        const std::int64_t last = cfg.steps - cfg.first_step;  // its acts: the first weights, then a step each
        kernels.add(op, DeviceType::cpu, dt, [store, last, dt](const KernelConfig&) -> std::unique_ptr<Kernel> {
          if (dt == DType::f64) return std::make_unique<GatherIntoStore<double>>(store, last);
          return std::make_unique<GatherIntoStore<float>>(store, last);
        });
      }
      b.plan.add_actor({.name = b.named(fmt::format("zero.bucket{}.gather", bi)),
                        .op = op,
                        .dtype = dt,
                        .where = b.at(stream, bucket.place),
                        .inputs = shards,
                        .outputs = std::move(outs),
                        .stops_when_unread = false,  // the last weights are the result
                        .role = ActorRole::update});
    }
  }
  if (clip[0]) lower_zero_clip(replicas, d.trained[0].first.dtype(), reduced, clip, cfg);
  return snapshots;
}

}  // namespace baton::passes::detail
