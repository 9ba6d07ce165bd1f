#include "baton/graph/collectives.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <type_traits>

#include <fmt/format.h>

#include "baton/kernels/cuda.h"

#include "runs.h"

namespace baton {

std::pair<std::vector<RegisterIndex>, std::int64_t> window_of_parts(const Plan& plan,
                                                                   const std::vector<RegisterIndex>& parts,
                                                                   std::int64_t offset, std::int64_t count) {
  std::vector<RegisterIndex> held;
  std::int64_t at = 0, from = 0;
  for (RegisterIndex p : parts) {
    const std::int64_t n = numel(plan.registers.at(p).shape);
    if (n > 0 && at < offset + count && at + n > offset) {
      if (held.empty()) from = offset - at;
      held.push_back(p);
    }
    at += n;
  }
  return {held, from};
}

std::vector<std::int64_t> chunk_offsets(std::int64_t n, std::int64_t parts) {
  std::vector<std::int64_t> off{0};
  for (std::int64_t c = 0; c < parts; ++c) off.push_back(off.back() + n / parts + (c < n % parts ? 1 : 0));
  return off;
}

namespace {
/// Readers of one member's input that the segments may use (of the runtime's 255 per register).
constexpr std::int64_t readers_for_segments = 240;
}  // namespace

std::int64_t allreduce_segments(std::int64_t elements, DType dtype, std::int64_t members,
                                const AllReduceSettings& settings) {
  if (members <= 0) throw std::invalid_argument(fmt::format("all-reduce over {} members", members));
  if (settings.segment_bytes <= 0 || settings.max_segments <= 0) {
    throw std::invalid_argument(fmt::format("all-reduce settings: segment_bytes {} and max_segments {} must be > 0",
                                            settings.segment_bytes, settings.max_segments));
  }
  const std::int64_t chunk = (elements + members - 1) / members;  // the largest chunk
  const auto chunk_bytes = chunk * static_cast<std::int64_t>(size_of(dtype));
  const std::int64_t s = (chunk_bytes + settings.segment_bytes - 1) / settings.segment_bytes;
  // Each member's input is read by members x segments actors (its slices and adds), and a
  // register has at most 255 readers: keep a few for whatever else reads the input.
  const std::int64_t reader_bound = std::max<std::int64_t>(1, readers_for_segments / members);
  return std::max<std::int64_t>(1, std::min({s, settings.max_segments, chunk, reader_bound}));
}

namespace {

/// Where a compressed all-reduce keeps its sums in bf16 or f16 (AllReduceSettings::wire), the
/// f32 kernels read and write them through these: widen on load (exact), round once on store.
template <class T>
bool is_wire(const Tensor& t) {
  return std::is_same_v<T, float> && (t.dtype() == DType::bf16 || t.dtype() == DType::f16);
}

/// Elements [from, from + n) of `t` (f32, or a 16-bit wire dtype widened: exact) into out.
void widen(const Tensor& t, std::size_t from, std::size_t n, float* out) {
  switch (t.dtype()) {
    case DType::bf16: return to_float(t.data<bfloat16>().subspan(from, n), std::span<float>(out, n));
    case DType::f16: return to_float(t.data<float16>().subspan(from, n), std::span<float>(out, n));
    default: std::copy_n(t.data<float>().data() + from, n, out);
  }
}

/// out[from, from + n) = in, rounded once to out's wire dtype (bf16 or f16). binary16 ends at
/// 65504: a finite sum that rounds to infinity (65520 and up) fails the act, naming it, rather
/// than sending an infinity on that every replica's update would turn into NaN weights (bf16
/// has f32's range and cannot overflow so). The message names element `from + i` of out.
void narrow(const float* in, std::size_t n, Tensor& out, std::size_t from, std::string_view actor) {
  if (out.dtype() == DType::bf16) return to_bf16(std::span<const float>(in, n), out.data<bfloat16>().subspan(from, n));
  float largest = 0;  // NaNs drop out of the max (and stay NaNs); an infinity is no overflow
  for (std::size_t i = 0; i < n; ++i) largest = std::max(largest, std::abs(in[i]));
  if (!(largest < 65520.0f)) {
    for (std::size_t i = 0; i < n; ++i) {
      if (std::isfinite(in[i]) && std::abs(in[i]) >= 65520.0f) {
        throw std::runtime_error(fmt::format("{}: element {} sums to {}, beyond fp16's range (65504) on the wire; "
                                             "use --grad-compression bf16 (f32's range) or none",
                                             actor, from + i, in[i]));
      }
    }
  }
  to_f16(std::span<const float>(in, n), out.data<float16>().subspan(from, n));
}

/// The compressed kernels add and round a block at a time through a buffer of this many floats
/// on the stack (2 KiB: in L1 beside the block's inputs).
constexpr std::size_t wire_block = 512;

template <class T>
void check_window(const Tensor& t, std::int64_t offset, std::size_t count, std::string_view actor) {
  if (offset < 0 || static_cast<std::size_t>(offset) + count > static_cast<std::size_t>(t.numel())) {
    throw std::runtime_error(fmt::format("{}: elements [{}, {}) lie outside its input of {}", actor, offset,
                                         static_cast<std::size_t>(offset) + count, t.numel()));
  }
}

template <class T>
std::span<const T> window(const Tensor& t, std::int64_t offset, std::size_t count, std::string_view actor) {
  auto all = t.data<T>();
  if (offset < 0 || static_cast<std::size_t>(offset) + count > all.size()) {
    throw std::runtime_error(fmt::format("{}: elements [{}, {}) lie outside its input of {}", actor, offset,
                                         static_cast<std::size_t>(offset) + count, all.size()));
  }
  return all.subspan(static_cast<std::size_t>(offset), count);
}

/// Elements [offset, offset + count) of the concatenation of inputs [first, first + ports), as
/// the runs of each input that hold them, into `runs` (a kernel's own, reused act after act):
/// one run when ports is 1 (a member's input is one register), more where it is in parts
/// (AllReduceMember::parts, the weights' gradients a bucket would concatenate).
template <class T>
void window_runs(const KernelContext& ctx, std::size_t first, std::size_t ports, std::int64_t offset,
                 std::size_t count, std::string_view actor, std::vector<std::span<const T>>& runs) {
  runs.clear();
  const std::size_t held = baton::detail::for_each_run<T>(
      ctx.inputs.subspan(first, ports), offset, count, [&](std::span<const T> run, std::size_t) { runs.push_back(run); },
      [](const Tensor* t) { return std::span<const T>(t->data<T>()); });
  if (offset < 0 || held != count) {
    throw std::runtime_error(fmt::format("{}: elements [{}, {}) lie outside its input ({} part{})", actor, offset,
                                         offset + static_cast<std::int64_t>(count), ports, ports == 1 ? "" : "s"));
  }
}

/// o[i] = a[i] + b[i] over runs of a and b that cover out, each loop over a stretch where both
/// are contiguous (the same additions, element by element, as over whole spans).
template <class T>
void add_runs(std::span<T> out, const std::vector<std::span<const T>>& a, const std::vector<std::span<const T>>& b) {
  std::size_t ia = 0, ib = 0, oa = 0, ob = 0, done = 0;
  while (done < out.size()) {
    const std::size_t len = std::min(a[ia].size() - oa, b[ib].size() - ob);
    T* __restrict o = out.data() + done;
    const T* __restrict x = a[ia].data() + oa;
    const T* __restrict y = b[ib].data() + ob;
    for (std::size_t i = 0; i < len; ++i) o[i] = x[i] + y[i];
    done += len;
    oa += len;
    ob += len;
    if (oa == a[ia].size()) ++ia, oa = 0;
    if (ob == b[ib].size()) ++ib, ob = 0;
  }
}

/// out = input[offset, offset + out.size()): the first partial of a chain, sent to the next rank.
/// The input is the concatenation of all the actor's inputs (one, or a member's parts).
template <class T>
struct Slice final : Kernel {
  std::string actor;
  std::int64_t offset;
  Slice(std::string_view a, std::int64_t off) : actor(a), offset(off) {}
  void compute(KernelContext& ctx) override {
    if constexpr (std::is_same_v<T, float>) {
      if (is_wire<T>(*ctx.outputs[0])) {
        Tensor& out = *ctx.outputs[0];
        const auto count = static_cast<std::size_t>(out.numel());
        narrow(window<T>(*ctx.inputs[0], offset, count, actor).data(), count, out, 0, actor);
        return;
      }
    }
    auto out = ctx.outputs[0]->data<T>();
    window_runs<T>(ctx, 0, ctx.inputs.size(), offset, out.size(), actor, runs);
    std::size_t at = 0;
    for (auto run : runs) {
      std::copy(run.begin(), run.end(), out.begin() + static_cast<std::ptrdiff_t>(at));
      at += run.size();
    }
  }
  std::vector<std::span<const T>> runs;
};

/// out = partial + own[offset, ...): one hop of a reduce-scatter chain. The partial is either
/// the previous hop's register (from = -1) or the previous member's whole input read in place
/// at `from` (same rank: no slice copy). A member's input may be several registers (attr
/// "parts": the inputs after the partial's; the partial read in place has as many).
template <class T>
struct Add final : Kernel {
  std::string actor;
  std::int64_t offset, from, parts;
  Add(std::string_view a, std::int64_t off, std::int64_t f, std::int64_t p) : actor(a), offset(off), from(f), parts(p) {}
  void compute(KernelContext& ctx) override {
    if (is_wire<T>(*ctx.inputs[0]) || is_wire<T>(*ctx.outputs[0])) return compute_wire(ctx);
    auto out = ctx.outputs[0]->data<T>();
    const auto own = static_cast<std::size_t>(parts);
    const std::size_t partial = ctx.inputs.size() - own;
    window_runs<T>(ctx, 0, partial, from < 0 ? 0 : from, out.size(), actor, a_runs);
    window_runs<T>(ctx, partial, own, offset, out.size(), actor, b_runs);
    add_runs<T>(out, a_runs, b_runs);
  }
  std::vector<std::span<const T>> a_runs, b_runs;
  /// A compressed hop: the partial (bf16 / f16, or the first member's f32 input read in place)
  /// plus this member's f32 segment, added in f32 and rounded once to the wire dtype (or, never
  /// in a plan add_allreduce makes, kept in f32).
  void compute_wire(KernelContext& ctx) {
    if constexpr (std::is_same_v<T, float>) {
      if (ctx.inputs.size() != 2) throw std::runtime_error(fmt::format("{}: compressed sums read one register each", actor));
      const Tensor& partial = *ctx.inputs[0];
      Tensor& out_t = *ctx.outputs[0];
      const auto count = static_cast<std::size_t>(out_t.numel());
      const auto at = static_cast<std::size_t>(from < 0 ? 0 : from);
      check_window<T>(partial, static_cast<std::int64_t>(at), count, actor);
      auto own = window<T>(*ctx.inputs[1], offset, count, actor);
      float sum[wire_block];
      for (std::size_t b = 0; b < count; b += wire_block) {
        const std::size_t n = std::min(wire_block, count - b);
        widen(partial, at + b, n, sum);
        for (std::size_t i = 0; i < n; ++i) sum[i] += own[b + i];
        if (is_wire<T>(out_t)) {
          narrow(sum, n, out_t, b, actor);
        } else {
          std::copy_n(sum, n, out_t.data<T>().data() + b);
        }
      }
    }
  }
};

template <class T>
void add_kernels(KernelRegistry& k, DType dt) {
  k.add("allreduce.slice", DeviceType::cpu, dt, [](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    return std::make_unique<Slice<T>>(cfg.actor, cfg.attrs.get_int("offset", 0));
  });
  k.add("allreduce.add", DeviceType::cpu, dt, [](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    return std::make_unique<Add<T>>(cfg.actor, cfg.attrs.get_int("offset", 0), cfg.attrs.get_int("from", -1),
                                    cfg.attrs.get_int("parts", 1));
  });
  // Also what the compiler packs (concat) and unpacks (split) a gradient bucket with.
  k.add_fn("allreduce.split", DeviceType::cpu, dt, [](KernelContext& ctx) {
    auto in = ctx.inputs[0]->data<T>();
    std::size_t at = 0;
    for (Tensor* out : ctx.outputs) {
      auto o = out->data<T>();
      std::copy(in.begin() + static_cast<std::ptrdiff_t>(at), in.begin() + static_cast<std::ptrdiff_t>(at + o.size()),
                o.begin());
      at += o.size();
    }
  });
  // out = in_0 + in_1 + ... left to right over elements [offset, offset + out.size()) of each
  // member's input (the whole input for an all-reduce, one member's chunk for a reduce-scatter);
  // a member's input is "parts" consecutive inputs (1: one register).
  k.add("allreduce.sum", DeviceType::cpu, dt, [](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    struct Sum final : Kernel {
      std::string actor;
      std::int64_t offset, parts;
      Sum(std::string_view a, std::int64_t off, std::int64_t p) : actor(a), offset(off), parts(p) {}
      void compute(KernelContext& ctx) override {
        auto out = ctx.outputs[0]->data<T>();
        const auto k = static_cast<std::size_t>(parts);
        if (k == 0 || ctx.inputs.size() % k != 0) {
          throw std::runtime_error(fmt::format("{}: {} inputs are not members of {} parts", actor, ctx.inputs.size(), k));
        }
        for (std::size_t j = 0; j < ctx.inputs.size(); j += k) {
          window_runs<T>(ctx, j, k, offset, out.size(), actor, runs);
          std::size_t at = 0;
          for (auto run : runs) {
            T* o = out.data() + at;
            if (j == 0) std::copy(run.begin(), run.end(), o);
            else
              for (std::size_t i = 0; i < run.size(); ++i) o[i] += run[i];
            at += run.size();
          }
        }
      }
      std::vector<std::span<const T>> runs;
    };
    return std::make_unique<Sum>(cfg.actor, cfg.attrs.get_int("offset", 0), cfg.attrs.get_int("parts", 1));
  });
  k.add_fn("allreduce.concat", DeviceType::cpu, dt, [](KernelContext& ctx) {
    auto out = ctx.outputs[0]->data<T>();
    std::size_t at = 0;
    for (const Tensor* in : ctx.inputs) {
      if constexpr (std::is_same_v<T, float>) {
        if (is_wire<T>(*in)) {  // a compressed sum, widened (exactly)
          const auto count = static_cast<std::size_t>(in->numel());
          widen(*in, 0, count, out.data() + at);
          at += count;
          continue;
        }
      }
      auto i = in->data<T>();
      std::copy(i.begin(), i.end(), out.begin() + static_cast<std::ptrdiff_t>(at));
      at += i.size();
    }
  });
}

/// AllReduceAlgorithm::two_hop: split, the owner of each chunk sums it, concat; returns the
/// members' sum registers in tensor order (one per chunk) for the gathers.
std::vector<RegisterIndex> add_two_hop_sums(Plan& plan, const std::string& name,
                                            const std::vector<AllReduceMember>& members, DType dtype,
                                            const std::vector<std::int64_t>& off, std::int32_t slots) {
  const auto n = static_cast<std::int64_t>(members.size());
  auto len = [&](std::int64_t c) { return off[static_cast<std::size_t>(c) + 1] - off[static_cast<std::size_t>(c)]; };
  std::vector<std::vector<RegisterIndex>> chunk(static_cast<std::size_t>(n));  // chunk[j][c]: member j's chunk c
  for (std::int64_t j = 0; j < n; ++j) {
    const AllReduceMember& m = members[static_cast<std::size_t>(j)];
    for (std::int64_t c = 0; c < n; ++c) {
      chunk[static_cast<std::size_t>(j)].push_back(plan.add_register(
          {.name = fmt::format("{}.chunk{}{}", name, c, m.suffix), .shape = {len(c)}, .dtype = dtype, .slots = slots}));
    }
    plan.add_actor({.name = name + ".split" + m.suffix, .op = "allreduce.split", .dtype = dtype, .where = m.where,
                    .inputs = {{m.input}}, .outputs = chunk[static_cast<std::size_t>(j)], .attrs = {{"allreduce", name}},
                    .role = ActorRole::collective});
  }
  std::vector<RegisterIndex> sums;
  for (std::int64_t c = 0; c < n; ++c) {
    const AllReduceMember& owner = members[static_cast<std::size_t>(c)];
    std::vector<InputPort> ins;
    for (std::int64_t j = 0; j < n; ++j) ins.push_back({chunk[static_cast<std::size_t>(j)][static_cast<std::size_t>(c)]});
    const std::string sum_name = fmt::format("{}.sum{}{}", name, c, owner.suffix);
    sums.push_back(plan.add_register({.name = sum_name, .shape = {len(c)}, .dtype = dtype, .slots = slots}));
    plan.add_actor({.name = sum_name, .op = "allreduce.sum", .dtype = dtype, .where = owner.where,
                    .inputs = std::move(ins), .outputs = {sums.back()}, .attrs = {{"allreduce", name}},
                    .role = ActorRole::collective});
  }
  return sums;
}

/// Whether member `to` may add its own to a piece that member `from` holds as it receives it (a
/// reducing transfer, "transfer.add"): asked for, across ranks, both on the CPU.
bool adds_as_received(const AllReduceSettings& settings, const AllReduceMember& from, const AllReduceMember& to) {
  return settings.fuse_receive_add && from.where.rank != to.where.rank && from.where.device.type == DeviceType::cpu &&
         to.where.device.type == DeviceType::cpu;
}

/// AllReduceAlgorithm::direct: each member sums every member's input, in member order. Two CPU
/// members on two ranks (settings.fuse_receive_add): each one's sum is a reducing transfer that
/// adds its own input to the other's as it reads it, with no register of its own for the
/// other's input and no actor after it; a + b and b + a are the same float, so both members
/// still hold the same bits.
std::vector<RegisterIndex> add_direct_allreduce(Plan& plan, const std::string& name,
                                                const std::vector<AllReduceMember>& members, const Shape& shape,
                                                DType dtype, std::int32_t result_slots, const AllReduceSettings& settings) {
  std::vector<InputPort> all;
  for (const AllReduceMember& m : members) all.push_back({m.input});
  const bool fused = members.size() == 2 && (dtype == DType::f32 || dtype == DType::f64) &&
                     adds_as_received(settings, members[0], members[1]);
  std::vector<RegisterIndex> results;
  for (const AllReduceMember& m : members) {
    results.push_back(
        plan.add_register({.name = name + ".allreduced" + m.suffix, .shape = shape, .dtype = dtype, .slots = result_slots}));
    if (fused) {
      const AllReduceMember& other = &m == &members[0] ? members[1] : members[0];
      plan.add_actor({.name = name + ".sum" + m.suffix, .kind = ActorKind::transfer, .op = "transfer.add",
                      .dtype = dtype, .where = m.where, .inputs = {{other.input}, {m.input}},
                      .outputs = {results.back()}, .attrs = {{"offset", std::int64_t{0}}, {"allreduce", name}},
                      .role = ActorRole::collective,
                      .adds = true});
      continue;
    }
    plan.add_actor({.name = name + ".sum" + m.suffix, .op = "allreduce.sum", .dtype = dtype, .where = m.where,
                    .inputs = all, .outputs = {results.back()}, .attrs = {{"allreduce", name}},
                    .role = ActorRole::collective});
  }
  return results;
}

}  // namespace

void add_collective_kernels(KernelRegistry& kernels) {
  add_kernels<float>(kernels, DType::f32);
  add_kernels<double>(kernels, DType::f64);
  cuda::add_collective_kernels(kernels);  // nothing in a build without CUDA
}

namespace {

/// Checks the members and the wire dtype; whether `settings` send this tensor by the direct form.
bool direct_for(const std::string& name, const std::vector<AllReduceMember>& members, const Shape& shape, DType dtype,
                const AllReduceSettings& settings) {
  if (members.empty()) throw std::invalid_argument(fmt::format("all-reduce '{}' has no members", name));
  const std::int64_t bytes = numel(shape) * static_cast<std::int64_t>(size_of(dtype));
  const bool compressed = settings.wire && *settings.wire != dtype;
  const bool direct = settings.algorithm == AllReduceAlgorithm::direct ||
                      (settings.algorithm == AllReduceAlgorithm::ring && bytes < settings.direct_below_bytes && !compressed);
  if (direct && compressed) {
    throw std::invalid_argument(fmt::format("all-reduce '{}': sums on the wire in {} for {} members by direct: only "
                                            "bf16 or f16 for f32, by the ring",
                                            name, baton::name(*settings.wire), baton::name(dtype)));
  }
  if (!compressed) return direct;
  const bool ring = settings.algorithm == AllReduceAlgorithm::ring;
  if ((*settings.wire != DType::bf16 && *settings.wire != DType::f16) || dtype != DType::f32 || !ring) {
    throw std::invalid_argument(fmt::format("all-reduce '{}': sums on the wire in {} for {} members{}: only bf16 or f16 for f32, by the ring",
                                            name, baton::name(*settings.wire), baton::name(dtype), ring ? "" : " by two_hop"));
  }
  for (const AllReduceMember& m : members) {
    if (m.where.device.type != DeviceType::cpu) {
      throw std::invalid_argument(fmt::format(
          "all-reduce '{}': member '{}' is on {}; compressed sums ({} on the wire) have CPU kernels only", name,
          m.suffix, m.where.device.str(), baton::name(*settings.wire)));
    }
  }
  return false;
}

/// The inputs that hold elements [offset, offset + count) of member m's input (its register,
/// or the parts of it those elements are in), and where the window starts in their
/// concatenation.
std::pair<std::vector<InputPort>, std::int64_t> input_window(const Plan& plan, const AllReduceMember& m,
                                                             std::int64_t offset, std::int64_t count) {
  if (m.parts.empty()) return {{{m.input}}, offset};
  auto [regs, from] = window_of_parts(plan, m.parts, offset, count);
  if (regs.empty()) return {{{m.parts.front()}}, 0};  // an empty chunk reads nothing
  std::vector<InputPort> ports;
  for (RegisterIndex r : regs) ports.push_back({r});
  return {ports, from};
}

/// The reduce-scatter of a ring or two_hop all-reduce (direct_for() said no).
ReduceScattered ring_or_two_hop_scatter(Plan& plan, const std::string& name, const std::vector<AllReduceMember>& members,
                                        const Shape& shape, DType dtype, const AllReduceSettings& settings) {
  const auto n = static_cast<std::int64_t>(members.size());
  ReduceScattered out{.offsets = chunk_offsets(numel(shape), n), .parts = {}};
  const auto& chunks = out.offsets;
  out.parts.resize(static_cast<std::size_t>(n));
  const bool in_parts = !members.front().parts.empty();
  if (in_parts && (settings.wire || settings.algorithm != AllReduceAlgorithm::ring)) {
    throw std::invalid_argument(fmt::format(
        "reduce-scatter '{}': inputs in parts are read by the ring's own kernels only (no two_hop, no compression)", name));
  }
  if (settings.algorithm != AllReduceAlgorithm::ring) {
    auto sums = add_two_hop_sums(plan, name, members, dtype, chunks, settings.slots);
    for (std::int64_t c = 0; c < n; ++c) out.parts[static_cast<std::size_t>(c)] = {sums[static_cast<std::size_t>(c)]};
    return out;
  }
  const DType wire = settings.wire.value_or(dtype);
  const std::int64_t segments = allreduce_segments(numel(shape), dtype, n, settings);
  auto member = [&](std::int64_t j) -> const AllReduceMember& { return members[static_cast<std::size_t>(j % n)]; };
  for (std::int64_t c = 0; c < n; ++c) {
    const auto c_at = static_cast<std::size_t>(c);
    const auto seg = chunk_offsets(chunks[c_at + 1] - chunks[c_at], segments);
    for (std::int64_t s = 0; s < segments; ++s) {
      const auto s_at = static_cast<std::size_t>(s);
      const std::int64_t offset = chunks[c_at] + seg[s_at];
      const std::int64_t count = seg[s_at + 1] - seg[s_at];
      const std::string piece = segments == 1 ? fmt::format("{}", c) : fmt::format("{}.{}", c, s);
      // The chain runs over members c+1, c+2, ..., c+n (= c, which keeps the sum).
      const AllReduceMember& first = member(c + 1);
      // partial is `first`'s whole input (or the parts of it that hold the segment), read in place
      // (Not a structured binding: the lambdas below read it, which clang 14 refuses.)
      std::pair<std::vector<InputPort>, std::int64_t> first_window = input_window(plan, first, offset, count);
      std::vector<InputPort>& partial = first_window.first;
      std::int64_t& from = first_window.second;
      const AllReduceMember* holder = &first;  // the member whose rank and device hold the partial
      // The partial is now register r, written on member m.
      auto hand_on = [&](RegisterIndex r, const AllReduceMember& m) {
        partial = {{r}};
        from = -1;
        holder = &m;
      };
      const AllReduceMember& next = member(c + 2);
      // A hop from another rank whose member adds its own segment to the partial as it reads it
      // (a reducing transfer, ActorDesc's "transfer.add"): no register of its own for the partial.
      auto fused = [&](const AllReduceMember& m, const std::vector<InputPort>& own) {
        return wire == dtype && partial.size() == 1 && own.size() == 1 && adds_as_received(settings, *holder, m);
      };
      if (n > 1 && fused(next, input_window(plan, next, offset, count).first)) {
        // The next member reads the segment's window of the input where it lies.
      } else if (n > 1 && first.where.rank != next.where.rank && wire == dtype && partial.size() == 1) {
        // Only the segment travels: the next member pulls its window straight from the input's
        // slot (no slice copied out first).
        const std::string segment = fmt::format("{}.segment{}{}", name, piece, next.suffix);
        RegisterIndex r = plan.add_register({.name = segment, .shape = {count}, .dtype = dtype, .slots = settings.slots});
        plan.add_actor({.name = segment, .kind = ActorKind::transfer,
                        .op = "transfer", .dtype = dtype, .where = next.where, .inputs = partial, .outputs = {r},
                        .window = from, .attrs = {{"allreduce", name}}, .role = ActorRole::collective});
        hand_on(r, next);
      } else if (n == 1 || first.where.rank != next.where.rank) {
        // Only the segment should travel: copy it out of the input first (into the wire's dtype
        // where the sums travel compressed).
        RegisterIndex r = plan.add_register({.name = fmt::format("{}.part{}{}", name, piece, first.suffix),
                                             .shape = {count}, .dtype = wire, .slots = settings.slots});
        plan.add_actor({.name = fmt::format("{}.slice{}{}", name, piece, first.suffix), .op = "allreduce.slice",
                        .dtype = dtype, .where = first.where, .inputs = partial, .outputs = {r},
                        .attrs = {{"offset", from}, {"allreduce", name}}, .role = ActorRole::collective});
        hand_on(r, first);
      }
      for (std::int64_t k = 2; k <= n; ++k) {
        const AllReduceMember& m = member(c + k);
        const std::string out_name = k == n ? fmt::format("{}.sum{}{}", name, piece, m.suffix)
                                            : fmt::format("{}.part{}{}", name, piece, m.suffix);
        RegisterIndex r =
            plan.add_register({.name = out_name, .shape = {count}, .dtype = wire, .slots = settings.slots});
        auto [own, own_from] = input_window(plan, m, offset, count);
        if (fused(m, own)) {
          plan.add_actor({.name = fmt::format("{}.add{}{}", name, piece, m.suffix), .kind = ActorKind::transfer,
                          .op = "transfer.add", .dtype = dtype, .where = m.where, .inputs = {partial.front(), own.front()},
                          .outputs = {r}, .window = from, .attrs = {{"offset", own_from}, {"allreduce", name}},
                          .role = ActorRole::collective,
                          .adds = true});
          hand_on(r, m);
          continue;
        }
        std::vector<InputPort> ins = partial;
        ins.insert(ins.end(), own.begin(), own.end());
        Attrs attrs{{"from", from}, {"offset", own_from}, {"allreduce", name}};
        if (own.size() > 1 || partial.size() > 1) attrs.set("parts", static_cast<std::int64_t>(own.size()));
        plan.add_actor({.name = fmt::format("{}.add{}{}", name, piece, m.suffix), .op = "allreduce.add",
                        .dtype = dtype, .where = m.where, .inputs = std::move(ins), .outputs = {r},
                        .attrs = std::move(attrs), .role = ActorRole::collective});
        hand_on(r, m);
      }
      out.parts[c_at].push_back(partial.front().reg);
    }
  }
  return out;
}

}  // namespace

std::vector<std::vector<std::size_t>> hosts_of_members(const std::vector<AllReduceMember>& members, const Shape& shape,
                                                       DType dtype, const AllReduceSettings& settings) {
  if (settings.rank_hosts.empty()) return {};
  std::vector<std::vector<std::size_t>> groups;
  std::vector<std::uint32_t> hosts;  // hosts[g]: the host of groups[g]
  for (std::size_t m = 0; m < members.size(); ++m) {
    const std::uint16_t rank = members[m].where.rank;
    if (rank >= settings.rank_hosts.size()) {
      throw std::invalid_argument(fmt::format("all-reduce: member '{}' is on rank {}, but rank_hosts names the hosts of "
                                              "{} rank{}",
                                              members[m].suffix, rank, settings.rank_hosts.size(),
                                              settings.rank_hosts.size() == 1 ? "" : "s"));
    }
    const auto g = std::find(hosts.begin(), hosts.end(), settings.rank_hosts[rank]);
    if (g == hosts.end()) {
      hosts.push_back(settings.rank_hosts[rank]);
      groups.push_back({m});
    } else {
      groups[static_cast<std::size_t>(g - hosts.begin())].push_back(m);
    }
  }
  const bool even = std::all_of(groups.begin(), groups.end(),
                                [&](const auto& g) { return g.size() == groups.front().size(); });
  if (groups.size() < 2 || groups.front().size() < 2 || !even || settings.algorithm != AllReduceAlgorithm::ring ||
      (settings.wire && *settings.wire != dtype) || direct_for("all-reduce", members, shape, dtype, settings)) {
    return {};
  }
  return groups;
}

std::vector<std::vector<RegisterIndex>> add_host_sums(Plan& plan, const std::string& name,
                                                      const std::vector<AllReduceMember>& members, const Shape& shape,
                                                      DType dtype, const AllReduceSettings& settings) {
  const auto groups = hosts_of_members(members, shape, dtype, settings);
  if (groups.empty()) {
    throw std::invalid_argument(fmt::format("all-reduce '{}': its members are not on two hosts or more with two or "
                                            "more each, evenly (or it is compressed, or small enough for direct)",
                                            name));
  }
  AllReduceSettings flat = settings;
  flat.rank_hosts.clear();
  const std::size_t local = groups.front().size();
  // 1. Within each host: local member j ends with chunk j of the host's sum (in segments).
  std::vector<ReduceScattered> within;
  for (const auto& g : groups) {
    std::vector<AllReduceMember> here;
    for (std::size_t m : g) here.push_back(members[m]);
    within.push_back(ring_or_two_hop_scatter(plan, name, here, shape, dtype, flat));
  }
  // 2. Across hosts, per local index j and segment s: member j of every host all-reduces its
  //    segment (the flat ring, or direct for a small one); every host's member j gets the sum.
  // 3. Each member's sums: its host's results in tensor order (chunk j, then segment s).
  std::vector<std::vector<RegisterIndex>> sums(members.size());
  for (std::size_t j = 0; j < local; ++j) {
    const std::vector<RegisterIndex>& segments = within.front().parts[j];
    for (std::size_t s = 0; s < segments.size(); ++s) {
      std::vector<AllReduceMember> across;
      for (std::size_t h = 0; h < groups.size(); ++h) {
        const AllReduceMember& m = members[groups[h][j]];
        across.push_back({m.where, within[h].parts[j][s], m.suffix});
      }
      const std::int64_t count = numel(plan.registers.at(segments[s]).shape);
      const std::string piece = segments.size() == 1 ? fmt::format("{}", j) : fmt::format("{}.{}", j, s);
      const std::size_t before = plan.actors.size();
      const auto results =
          add_allreduce(plan, fmt::format("{}.x{}", name, piece), across, {count}, dtype, settings.slots, flat);
      // Its actors count with the whole all-reduce's (collective_overlap, the dashboard).
      for (std::size_t a = before; a < plan.actors.size(); ++a) plan.actors[a].attrs.set("allreduce", name);
      for (std::size_t h = 0; h < groups.size(); ++h) {
        for (std::size_t m : groups[h]) sums[m].push_back(results[h]);
      }
    }
  }
  return sums;
}

ReduceScattered add_reduce_scatter(Plan& plan, const std::string& name, const std::vector<AllReduceMember>& members,
                                   const Shape& shape, DType dtype, const AllReduceSettings& settings) {
  if (!direct_for(name, members, shape, dtype, settings)) {
    return ring_or_two_hop_scatter(plan, name, members, shape, dtype, settings);
  }
  // Direct: member c sums chunk c of every member's input, in member order (the same sums, bit
  // for bit, as the direct all-reduce makes of those elements).
  const auto n = static_cast<std::int64_t>(members.size());
  ReduceScattered out{.offsets = chunk_offsets(numel(shape), n), .parts = {}};
  for (std::int64_t c = 0; c < n; ++c) {
    const AllReduceMember& m = members[static_cast<std::size_t>(c)];
    const std::int64_t begin = out.offsets[static_cast<std::size_t>(c)];
    const std::int64_t count = out.offsets[static_cast<std::size_t>(c) + 1] - begin;
    // Every member's input (or the parts of it that hold the chunk), in member order.
    std::vector<InputPort> all;
    std::int64_t from = begin, parts = 1;
    for (const AllReduceMember& each : members) {
      auto [ports, at] = input_window(plan, each, begin, count);
      from = at;
      parts = static_cast<std::int64_t>(ports.size());
      all.insert(all.end(), ports.begin(), ports.end());
    }
    const std::string sum_name = fmt::format("{}.sum{}{}", name, c, m.suffix);
    RegisterIndex r = plan.add_register({.name = sum_name, .shape = {count}, .dtype = dtype, .slots = settings.slots});
    Attrs attrs{{"offset", from}, {"allreduce", name}};
    if (parts > 1) attrs.set("parts", parts);
    plan.add_actor({.name = sum_name, .op = "allreduce.sum", .dtype = dtype, .where = m.where, .inputs = std::move(all),
                    .outputs = {r}, .attrs = std::move(attrs), .role = ActorRole::collective});
    out.parts.push_back({r});
  }
  return out;
}

std::vector<RegisterIndex> add_allreduce(Plan& plan, const std::string& name, const std::vector<AllReduceMember>& members,
                                         const Shape& shape, DType dtype, std::int32_t result_slots,
                                         const AllReduceSettings& settings) {
  for (const AllReduceMember& m : members) {
    if (!m.parts.empty()) {
      throw std::invalid_argument(fmt::format("all-reduce '{}': inputs in parts are for add_reduce_scatter only", name));
    }
  }
  if (direct_for(name, members, shape, dtype, settings)) {
    return add_direct_allreduce(plan, name, members, shape, dtype, result_slots, settings);
  }
  // The reduce-scatter, then every member gathers every member's sums in tensor order
  // (hierarchical: its host's, each the sum over every host).
  std::vector<std::vector<RegisterIndex>> sums;
  if (!hosts_of_members(members, shape, dtype, settings).empty()) {
    sums = add_host_sums(plan, name, members, shape, dtype, settings);
  } else {
    const ReduceScattered scattered = ring_or_two_hop_scatter(plan, name, members, shape, dtype, settings);
    std::vector<RegisterIndex> all;
    for (const auto& parts : scattered.parts) all.insert(all.end(), parts.begin(), parts.end());
    sums.assign(members.size(), all);
  }
  std::vector<RegisterIndex> results;
  for (std::size_t i = 0; i < members.size(); ++i) {
    const AllReduceMember& m = members[i];
    std::vector<InputPort> ins;
    for (RegisterIndex r : sums[i]) ins.push_back({r});
    results.push_back(
        plan.add_register({.name = name + ".allreduced" + m.suffix, .shape = shape, .dtype = dtype, .slots = result_slots}));
    // The sums from other ranks land in their places in the result (a gathering transfer),
    // where they can: in host memory, in the result's dtype.
    const bool remote = std::any_of(sums[i].begin(), sums[i].end(), [&](RegisterIndex r) {
      return plan.actors.at(plan.registers.at(r).producer).where.rank != m.where.rank;
    });
    const bool host = std::all_of(sums[i].begin(), sums[i].end(), [&](RegisterIndex r) {
      return !is_async(plan.actors.at(plan.registers.at(r).producer).where.device.type);
    });
    const bool in_place = remote && host && !is_async(m.where.device.type) && settings.wire.value_or(dtype) == dtype &&
                          ins.size() <= max_transfer_inputs;
    plan.add_actor({.name = name + ".gather" + m.suffix, .kind = in_place ? ActorKind::transfer : ActorKind::compute,
                    .op = in_place ? "transfer" : "allreduce.concat", .dtype = dtype, .where = m.where,
                    .inputs = std::move(ins), .outputs = {results.back()}, .attrs = {{"allreduce", name}},
                    .role = ActorRole::collective});
  }
  return results;
}

std::vector<RegisterIndex> add_nccl_allreduce(Plan& plan, const std::string& name,
                                              const std::vector<AllReduceMember>& members, const Shape& shape,
                                              DType dtype, std::int32_t result_slots, const std::string& group) {
  return add_nccl_collective(plan, NcclCollective::all_reduce, name, members, shape, dtype, result_slots, group);
}

std::vector<RegisterIndex> add_nccl_collective(Plan& plan, NcclCollective collective, const std::string& name,
                                               const std::vector<AllReduceMember>& members, const Shape& shape,
                                               DType dtype, std::int32_t result_slots, const std::string& group) {
  if (members.empty()) throw std::invalid_argument(fmt::format("NCCL collective '{}' has no members", name));
  const auto n = static_cast<std::int64_t>(members.size());
  std::vector<std::int64_t> ranks, devices;
  for (const AllReduceMember& m : members) {
    // A sim device (sim.h) takes the sim's stand-in for NCCL (sim_nccl.cpp), in tests.
    if (m.where.device.type != DeviceType::cuda && m.where.device.type != DeviceType::sim) {
      throw std::invalid_argument(fmt::format("NCCL collective '{}': member '{}' is on rank {} {}, not a CUDA device",
                                              name, m.suffix, m.where.rank, m.where.device.str()));
    }
    for (std::size_t j = 0; j < ranks.size(); ++j) {
      if (ranks[j] == m.where.rank && devices[j] == m.where.device.index) {
        throw std::invalid_argument(fmt::format("NCCL collective '{}': members '{}' and '{}' are both on rank {} {} "
                                                "(NCCL needs one GPU per member)",
                                                name, members[j].suffix, m.suffix, m.where.rank, m.where.device.str()));
      }
    }
    ranks.push_back(m.where.rank);
    devices.push_back(m.where.device.index);
  }
  const std::int64_t elements = numel(shape);
  const char* op = "nccl.allreduce";
  const char* result = ".allreduced";
  Shape out_shape = shape;
  if (collective == NcclCollective::reduce_scatter) {
    if (elements % n != 0) {
      throw std::invalid_argument(fmt::format("NCCL reduce-scatter '{}': {} elements do not split into {} equal parts",
                                              name, elements, n));
    }
    op = "nccl.reduce_scatter";
    result = ".reduce_scattered";
    out_shape = {elements / n};
  } else if (collective == NcclCollective::all_gather) {
    op = "nccl.all_gather";
    result = ".all_gathered";
    out_shape = {elements * n};
  }
  std::vector<RegisterIndex> results;
  for (std::int64_t i = 0; i < n; ++i) {
    const AllReduceMember& m = members[static_cast<std::size_t>(i)];
    results.push_back(
        plan.add_register({.name = name + result + m.suffix, .shape = out_shape, .dtype = dtype, .slots = result_slots}));
    plan.add_actor({.name = name + ".nccl" + m.suffix, .op = op, .dtype = dtype, .where = m.where,
                    .inputs = {{m.input}}, .outputs = {results.back()},
                    .attrs = {{"group", group.empty() ? name : group}, {"ranks", ranks}, {"devices", devices}, {"allreduce", name},
                              {"member", i}},
                    .role = ActorRole::collective});
  }
  return results;
}

}  // namespace baton
