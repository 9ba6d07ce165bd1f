// baton-plan's engine (planner.h): compile, cost, simulate.
#include "planner.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <thread>
#include <variant>

#include "baton/actors/runtime.h"
#include "baton/graph.h"
#include "baton/graph/schedule.h"
#include "models.h"

namespace baton::planner {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ----------------------------------------------------------------------------------------------
// The layout's model and training plan, as baton-train builds them.

bool is_lm(const Layout& l) { return l.model != "mlp"; }

std::int64_t micro_batch_of(const Layout& l) { return l.micro_batch > 0 ? l.micro_batch : l.global_batch / l.dp; }

models::LlamaShape llama_shape(const Layout& l, models::GptShape::Attention attention) {
  models::LlamaShape s{.vocab = l.vocab, .seq = l.seq, .d_model = l.d_model, .heads = l.heads,
                       .kv_heads = l.kv_heads == 0 ? l.heads : l.kv_heads, .layers = l.layers, .tp = l.tp,
                       .attention = attention};
  s.ffn_hidden = l.ffn_hidden != 0 ? l.ffn_hidden : (8 * l.d_model / 3 + 31) / 32 * 32;
  return s;
}

// Synthetic micro-batches of the model's inputs: what they hold costs nothing to the plan.
KernelFactory synthetic_source(std::int64_t modulus) {
  return kernel_of([modulus](KernelContext& c) {
    for (Tensor* out : c.outputs) {
      if (out->dtype() == DType::i32) {
        auto d = out->data<std::int32_t>();
        for (std::size_t i = 0; i < d.size(); ++i) d[i] = static_cast<std::int32_t>((i * 7919 + static_cast<std::size_t>(c.piece)) % static_cast<std::size_t>(modulus));
      } else if (out->dtype() == DType::f32) {
        auto d = out->data<float>();
        for (std::size_t i = 0; i < d.size(); ++i) d[i] = 0.01f * static_cast<float>((i * 31 + static_cast<std::size_t>(c.piece)) % 97);
      }
    }
  });
}

}  // namespace

TrainingJob compile(const Layout& l, DeviceType device, std::int64_t steps) {
  const std::int64_t mb = micro_batch_of(l);
  Graph g(1);
  Value loss;
  {
    auto mixed = g.autocast(l.dtype == "bf16" ? DType::bf16 : DType::f32);
    // GPUs run fused attention (FlashAttention's tiling); the CPU baton-train's default, naive.
    const auto attention = device == DeviceType::cpu ? models::GptShape::Attention::naive : models::GptShape::Attention::fused;
    if (l.model == "mlp") {
      Value logits = models::mlp(g, mb, {.inputs = 64, .hidden = l.hidden, .layers = l.layers, .classes = 10, .tp = l.tp});
      loss = softmax_cross_entropy(logits, g.find("label"));
    } else if (l.model == "llama") {
      loss = models::llama_with_loss(g, mb, llama_shape(l, attention)).loss;
    } else {
      loss = models::gpt_with_loss(g, mb, {.vocab = l.vocab, .seq = l.seq, .d_model = l.d_model, .heads = l.heads,
                                           .layers = l.layers, .tp = l.tp, .attention = attention})
                 .loss;
    }
    loss = loss.named("loss");
  }
  TrainConfig cfg;
  cfg.steps = steps;
  cfg.microbatches = l.microbatches();
  cfg.optimizer = optim::adam(1e-3);
  cfg.threads = l.threads;
  cfg.dp = l.dp;
  cfg.tp = l.tp;
  cfg.pp = l.pp;
  cfg.schedule = l.schedule;
  cfg.virtual_stages = l.virtual_stages;
  cfg.zero = l.zero;
  cfg.recompute = l.recompute;
  // Accelerators sum through NCCL's collectives, as baton-train's "auto" does on GPUs (on sim
  // devices, the sim's stand-in for NCCL), costed by NCCL's ring model (nccl_seconds).
  if (device != DeviceType::cpu) cfg.collectives = "nccl";
  // One actor per kernel: a CUDA graph's segment is costed as its kernels would be.
  cfg.cuda_graphs = false;
  const int places = l.dp * l.tp * l.pp;
  if (places > 1) {
    for (int i = 0; i < places; ++i) cfg.replica_places.push_back(Placement{.device = Device{device, static_cast<std::uint8_t>(i)}});
  }
  const std::vector<std::string> inputs = is_lm(l) ? std::vector<std::string>{"tokens", "targets"}
                                                   : std::vector<std::string>{"x", "label"};
  cfg.data = {{"synthetic", synthetic_source(is_lm(l) ? l.vocab : 10), inputs}};
  return compile_training(g, loss, cfg);
}

namespace {

// ----------------------------------------------------------------------------------------------
// What each act costs.

std::int64_t input_bytes(const Plan& plan, const ActorDesc& a) {
  std::int64_t b = 0;
  for (const InputPort& in : a.inputs) b += slot_bytes(plan.registers[in.reg]);
  return b;
}
std::int64_t output_bytes(const Plan& plan, const ActorDesc& a) {
  std::int64_t b = 0;
  for (RegisterIndex r : a.outputs) b += slot_bytes(plan.registers[r]);
  return b;
}

// Multiply-adds x 2 of an act: matrix products from their shapes (the inner dimension is the
// first input's last, or its second-to-last where it is read transposed), attention from its
// query's (scores and their product with the values: 4 T^2 d per head, half of it causal;
// the backward 2.5 times the forward, FlashAttention's count). Everything else counts as
// memory traffic only.
double act_flops(const Plan& plan, const ActorDesc& a) {
  if (a.inputs.empty() || a.outputs.empty()) return 0;
  const Shape& x = plan.registers[a.inputs[0].reg].shape;
  const Shape& out = plan.registers[a.outputs[0]].shape;
  if (a.op.find("matmul") != std::string::npos && !x.empty()) {
    const bool trans_a = a.attrs.get_int("trans_a", 0) != 0;
    const std::int64_t k = trans_a && x.size() >= 2 ? x[x.size() - 2] : x.back();
    return 2.0 * static_cast<double>(numel(out)) * static_cast<double>(k);
  }
  if (a.op.find("attention") != std::string::npos && x.size() == 4) {
    // q [batch, heads, T, head_dim]
    const double fwd = 4.0 * static_cast<double>(x[0] * x[1]) * static_cast<double>(x[2] * x[2]) *
                       static_cast<double>(x[3]) * (a.attrs.get_int("causal", 1) != 0 ? 0.5 : 1.0);
    return a.op.find("backward") != std::string::npos || a.op.find("grad") != std::string::npos ? 2.5 * fwd : fwd;
  }
  return 0;
}

double roofline_seconds(const Plan& plan, const ActorDesc& a, const DeviceProfile& d) {
  const double flops = act_flops(plan, a);
  std::int64_t kept = 0;
  for (const KeptBytes& k : a.kept) kept += k.bytes;
  // An optimizer reads and writes what it keeps (master weights, moments).
  const double bytes = static_cast<double>(input_bytes(plan, a) + output_bytes(plan, a) + 2 * kept);
  const double peak = a.dtype == DType::bf16 || a.dtype == DType::f16 ? d.flops_bf16 : d.flops_f32;
  return std::max(flops / (peak * d.matmul_efficiency), bytes / (d.memory_bytes_per_s * d.memory_efficiency)) +
         d.act_overhead_s;
}

// The link a copy or transfer crosses: between two devices of one node, between nodes, or
// between host and device (PCIe).
const Link& link_of(const Plan& plan, const ActorDesc& a, const Cluster& c, const Link& pcie) {
  if (a.copy == CopyDirection::to_host) return pcie;
  const ActorIndex p = a.inputs.empty() ? no_actor : data_writer(plan, a.inputs[0].reg);
  if (p == no_actor) return pcie;
  const Device from = plan.actors[p].where.device, to = a.where.device;
  if (from.type == DeviceType::cpu || to.type == DeviceType::cpu) return pcie;
  const int per_node = std::max(1, c.device.per_node);
  return from.index / per_node == to.index / per_node ? c.device.intra_node : c.device.inter_node;
}

// An NCCL collective among the devices its attribute "devices" lists, by NCCL's ring model
// (its documentation's bus bandwidth): an all-reduce moves 2 (n-1)/n of the bytes over each
// member's link in 2 (n-1) steps, an all-gather or reduce-scatter (n-1)/n in n-1; the link is the
// slowest the ring crosses (InfiniBand where it spans nodes). Returns the seconds and sets the
// link and the bytes it moves.
double nccl_seconds(const Plan& plan, const ActorDesc& a, const Cluster& c, const Link*& link, double& moved) {
  std::vector<std::int64_t> devices;
  if (const auto it = a.attrs.values().find("devices"); it != a.attrs.values().end()) {
    if (const auto* v = std::get_if<std::vector<std::int64_t>>(&it->second)) devices = *v;
  }
  const auto n = static_cast<double>(std::max<std::size_t>(devices.size(), 1));
  const int per_node = std::max(1, c.device.per_node);
  bool spans = false;
  for (std::int64_t d : devices) spans = spans || d / per_node != devices.front() / per_node;
  link = spans ? &c.device.inter_node : &c.device.intra_node;
  const double bytes = static_cast<double>(output_bytes(plan, a));
  const bool all_reduce = a.op.find("allreduce") != std::string::npos;
  const double share = (all_reduce ? 2.0 : 1.0) * (n - 1) / n;
  moved = share * bytes;
  return (all_reduce ? 2.0 : 1.0) * (n - 1) * link->latency_s + moved / link->bytes_per_s + c.device.act_overhead_s;
}

// The kernel an actor's act runs, made outside a runtime: its own, or for an accumulation the
// add that sums each piece into its sum.
std::unique_ptr<Kernel> kernel_of_act(const TrainingJob& job, const ActorDesc& a) {
  return job.kernels.create(a.kind == ActorKind::accumulate ? std::string_view("add") : std::string_view(a.op),
                            KernelConfig{a.name, a.where.device, a.dtype, a.attrs, nullptr});
}

// Each distinct kernel of the plan timed on its real shapes (zeros as inputs: a matrix
// product or a softmax costs the same on any values; an index of 0 is valid everywhere).
class KernelTimer {
 public:
  KernelTimer(const TrainingJob& job, int repeats) : job_(job), repeats_(std::max(1, repeats)) {}

  double seconds(const ActorDesc& a) {
    const Plan& plan = job_.plan;
    std::string key = fmt::format("{}|{}|{}|{}", a.op, name(a.dtype), static_cast<int>(a.kind), a.attrs.str());
    for (const InputPort& in : a.inputs) key += fmt::format("|i{}{}", name(plan.registers[in.reg].dtype), plan.registers[in.reg].shape);
    for (RegisterIndex r : a.outputs) key += fmt::format("|o{}{}", name(plan.registers[r].dtype), plan.registers[r].shape);
    const auto [it, added] = cache_.try_emplace(key, 0.0);
    if (added) it->second = time(a);
    return it->second;
  }

 private:
  double time(const ActorDesc& a) {
    const Plan& plan = job_.plan;
    std::unique_ptr<Kernel> k = kernel_of_act(job_, a);
    std::vector<Tensor> ins, outs;
    if (a.kind == ActorKind::accumulate) {
      const RegisterDesc& r = plan.registers[a.outputs[0]];
      ins = {Tensor::zeros(r.shape, r.dtype), Tensor::zeros(r.shape, r.dtype)};
    } else {
      for (const InputPort& in : a.inputs) ins.push_back(Tensor::zeros(plan.registers[in.reg].shape, plan.registers[in.reg].dtype));
    }
    for (std::size_t o = 0; o < a.outputs.size(); ++o) {
      Tensor own = k->owned_output(o);
      const RegisterDesc& r = plan.registers[a.outputs[o]];
      outs.push_back(own.defined() ? own : Tensor::zeros(r.shape, r.dtype));
    }
    std::vector<const Tensor*> in_ptrs;
    std::vector<Tensor*> out_ptrs;
    for (auto& t : ins) in_ptrs.push_back(&t);
    for (auto& t : outs) out_ptrs.push_back(&t);
    std::vector<double> runs;
    for (int i = 0; i <= repeats_; ++i) {
      // Piece 2 on: a variable's act 0 only hands out its initial value, and under
      // PipeDream-2BW (its update one step late) its act 1 too.
      KernelContext ctx{in_ptrs, out_ptrs, i + 2, nullptr, nullptr};
      const auto t0 = Clock::now();
      k->compute(ctx);
      if (i > 0) runs.push_back(seconds_since(t0));  // the first fills the caches
    }
    std::nth_element(runs.begin(), runs.begin() + static_cast<std::ptrdiff_t>(runs.size() / 2), runs.end());
    return runs[runs.size() / 2];
  }

  const TrainingJob& job_;
  int repeats_;
  std::map<std::string, double> cache_;
};

// The kernels timed where they run: the acts of a simulated run replayed on one thread in the
// order they started, each actor with its own kernel and each register with its slots, which its
// producer writes in turn and its readers read (a repeat's output is its input's), so that an act
// finds in the caches what the acts before it left there, as in a real run. Timed alone, a kernel
// runs on hot inputs again and again; in a step it reads what others wrote, into slots that
// rotate, and the weights the last update left (bench plan: isolated timings came out 20-35%
// under a run's kernel times). Each actor's cost is the median of its acts after its first. An
// actor whose kernel throws on these inputs keeps its isolated timing.
class Replay {
 public:
  explicit Replay(const TrainingJob& job) : plan_(job.plan), kernels_(plan_.actors.size()), slots_(plan_.registers.size()) {
    for (ActorIndex i = 0; i < plan_.actors.size(); ++i) {
      const ActorDesc& a = plan_.actors[i];
      if (a.kind == ActorKind::repeat || a.kind == ActorKind::transfer || a.copy != CopyDirection::none) continue;
      if (a.kind == ActorKind::accumulate && a.op == "last") continue;
      try {
        kernels_[i] = kernel_of_act(job, a);
        for (std::size_t o = 0; o < a.outputs.size(); ++o) {
          const RegisterDesc& r = plan_.registers[a.outputs[o]];
          Tensor own = kernels_[i]->owned_output(o);
          if (own.defined()) {
            slots_[a.outputs[o]] = {own};
          } else {
            for (std::int32_t k = 0; k < r.slots; ++k) slots_[a.outputs[o]].push_back(Tensor::zeros(r.shape, r.dtype));
          }
        }
      } catch (const std::exception&) {
        kernels_[i].reset();
      }
    }
    // A register whose producer is not replayed (a transfer, a copy) still has a slot to read.
    for (RegisterIndex r = 0; r < plan_.registers.size(); ++r) {
      if (slots_[r].empty()) slots_[r].push_back(Tensor::zeros(plan_.registers[r].shape, plan_.registers[r].dtype));
    }
  }

  /// Each actor's median act in the replay of `sim`'s acts. The acts of each resource (a device's
  /// worker) replay in their order on a thread of their own, all at once where the machine has
  /// a core for each, so that kernels that run side by side in the run share the caches and the
  /// memory bandwidth here too; one after another otherwise. What one thread writes another may
  /// read meanwhile: the values are the run's to within a race, the times what they cost.
  std::vector<double> seconds(const Simulation& sim, std::vector<double> seconds) {
    std::map<std::int32_t, std::vector<SimulatedAct>> by_resource;
    for (const SimulatedAct& a : sim.acts) by_resource[sim.resource_of[a.actor]].push_back(a);
    std::vector<std::vector<double>> timed(plan_.actors.size());
    std::vector<char> broken(plan_.actors.size(), 0);
    const auto replay = [&](std::vector<SimulatedAct>& acts) {
      std::stable_sort(acts.begin(), acts.end(), [](const SimulatedAct& x, const SimulatedAct& y) { return x.start < y.start; });
      for (const SimulatedAct& act : acts) run(act, timed[act.actor], broken[act.actor]);
    };
    const auto cores = static_cast<std::size_t>(std::max(1u, std::thread::hardware_concurrency()));
    if (by_resource.size() > 1 && by_resource.size() <= cores) {
      std::vector<std::thread> threads;
      for (auto& [r, acts] : by_resource) threads.emplace_back([&replay, &acts = acts] { replay(acts); });
      for (auto& t : threads) t.join();
    } else {
      for (auto& [r, acts] : by_resource) replay(acts);
    }
    for (ActorIndex i = 0; i < plan_.actors.size(); ++i) {
      auto& t = timed[i];
      if (broken[i] != 0 || t.size() < 2) continue;
      t.erase(t.begin());  // its first act: caches and pages still cold
      std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
      seconds[i] = t[t.size() / 2];
    }
    return seconds;
  }

 private:
  // One act of actor act.actor (on the calling thread, which owns the actor's acts).
  void run(const SimulatedAct& act, std::vector<double>& timed, char& broken) {
    const ActorIndex i = act.actor;
    const ActorDesc& a = plan_.actors[i];
    if (!kernels_[i] || broken != 0) return;
    std::vector<const Tensor*> ins;
    std::vector<Tensor*> outs;
    std::vector<Tensor> views;
    views.reserve(a.inputs.size() + 1);
    const std::int64_t written = a.kind == ActorKind::accumulate ? act.act / std::max(1, a.group) : act.act;
    for (RegisterIndex r : a.outputs) outs.push_back(&slot(r, written));
    if (a.kind == ActorKind::accumulate) {
      ins = {outs[0], read(a.inputs[0].reg, act.act, views)};
    } else {
      // Act k reads piece k - delay: nothing before its delay (a variable's first act).
      for (const InputPort& in : a.inputs) ins.push_back(act.act < in.delay ? nullptr : read(in.reg, act.act - in.delay, views));
    }
    KernelContext ctx{ins, outs, a.first_piece + act.act, nullptr, nullptr};
    const auto t0 = Clock::now();
    try {
      kernels_[i]->compute(ctx);
    } catch (const std::exception&) {
      broken = 1;
      return;
    }
    timed.push_back(seconds_since(t0));
  }

  Tensor& slot(RegisterIndex r, std::int64_t piece) {
    auto& s = slots_[r];
    return s[static_cast<std::size_t>(piece) % s.size()];
  }
  // Piece `piece` of `r`: through repeats (output piece j is input piece j / group) to the
  // slot that holds it, seen in r's shape.
  const Tensor* read(RegisterIndex r, std::int64_t piece, std::vector<Tensor>& views) {
    RegisterIndex at = r;
    for (ActorIndex p = plan_.registers[at].producer; p != no_actor && plan_.actors[p].kind == ActorKind::repeat;
         p = plan_.registers[at].producer) {
      piece /= std::max(1, plan_.actors[p].group);
      at = plan_.actors[p].inputs[0].reg;
    }
    Tensor& t = slot(at, piece);
    if (at == r) return &t;
    views.push_back(t.view(plan_.registers[r].shape));
    return &views.back();
  }

  const Plan& plan_;
  std::vector<std::unique_ptr<Kernel>> kernels_;
  std::vector<std::vector<Tensor>> slots_;
};

struct Costs {
  std::vector<double> seconds;            // by actor
  std::vector<std::string> link_of_actor;  // a copy's or transfer's link; "" for compute
  /// By actor: bytes an act reads from another accelerator's memory, and over which link.
  std::vector<double> remote_bytes;
  std::vector<std::string> remote_link;
};

Costs act_costs(const TrainingJob& job, const Cluster& c, int repeats) {
  const Plan& plan = job.plan;
  const Link pcie{"pcie", 5e-6, 25e9};
  Costs costs;
  costs.seconds.assign(plan.actors.size(), 0.0);
  costs.link_of_actor.assign(plan.actors.size(), "");
  costs.remote_bytes.assign(plan.actors.size(), 0.0);
  costs.remote_link.assign(plan.actors.size(), "");
  std::set<std::pair<RegisterIndex, Device>> copied;  // registers already brought to a device
  KernelTimer timer(job, repeats);
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    const ActorDesc& a = plan.actors[i];
    if (a.kind == ActorKind::repeat) continue;  // an alias
    if (a.kind == ActorKind::transfer || a.copy != CopyDirection::none) {
      const Link& link = link_of(plan, a, c, pcie);
      costs.seconds[i] = link.seconds(static_cast<double>(output_bytes(plan, a)));
      costs.link_of_actor[i] = link.name;
      continue;
    }
    if (a.kind == ActorKind::accumulate && a.op == "last") continue;  // keeps a pointer's worth
    if (c.device.measured) {
      costs.seconds[i] = timer.seconds(a) + c.device.act_overhead_s;
      continue;
    }
    if (a.op.starts_with("nccl.")) {
      const Link* link = nullptr;
      costs.seconds[i] = nccl_seconds(plan, a, c, link, costs.remote_bytes[i]);
      costs.remote_link[i] = link->name;
      continue;
    }
    costs.seconds[i] = roofline_seconds(plan, a, c.device);
    // Accelerators in one plan read each other's registers where the plan says so (a stage
    // reading its predecessor's activations): those bytes cross the link between the two
    // devices, before the act can compute on them, once per register and reading device (the
    // first reader in plan order pays), as the CUDA plan copies each such register once per
    // device (insert_device_copies).
    for (const InputPort& in : a.inputs) {
      const ActorIndex w = data_writer(plan, in.reg);
      if (w == no_actor || plan.actors[w].where.device == a.where.device || !is_async(plan.actors[w].where.device.type) ||
          !is_async(a.where.device.type) || !copied.emplace(aliased_register(plan, in.reg), a.where.device).second) {
        continue;
      }
      const Link& link = link_of(plan, ActorDesc{.where = a.where, .inputs = {in}}, c, pcie);
      // Through repeats (a weight handed to the step's M micro-batches) a piece crosses once for
      // the group of acts that read it: each act pays its share.
      double group = 1;
      for (RegisterIndex r = in.reg; plan.registers[r].producer != no_actor &&
                                     plan.actors[plan.registers[r].producer].kind == ActorKind::repeat;) {
        const ActorDesc& rep = plan.actors[plan.registers[r].producer];
        group *= std::max(1, rep.group);
        r = rep.inputs[0].reg;
      }
      const auto bytes = static_cast<double>(slot_bytes(plan.registers[in.reg])) / group;
      costs.seconds[i] += link.seconds(bytes);
      costs.remote_bytes[i] += bytes;
      costs.remote_link[i] = link.name;
    }
  }
  return costs;
}

// ----------------------------------------------------------------------------------------------
// The CPU's profile: its peaks measured here.

double measure_matmul_flops() {
  const std::int64_t n = 384;
  KernelRegistry reg = KernelRegistry::with_builtin_kernels();
  Attrs none;
  auto k = reg.create("matmul", KernelConfig{"calibrate", Device{}, DType::f32, none, nullptr});
  Tensor a = Tensor::zeros({n, n}, DType::f32), b = Tensor::zeros({n, n}, DType::f32), out = Tensor::zeros({n, n}, DType::f32);
  const Tensor* ins[] = {&a, &b};
  Tensor* outs[] = {&out};
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    KernelContext ctx{ins, outs, 0, nullptr, nullptr};
    const auto t0 = Clock::now();
    k->compute(ctx);
    best = std::min(best, seconds_since(t0));
  }
  return 2.0 * static_cast<double>(n * n * n) / best;
}

double measure_memory_bandwidth() {
  const std::size_t n = std::size_t{64} << 20;  // bytes: past any cache
  std::vector<char> from(n, 1), to(n, 0);
  double best = 1e30;
  for (int i = 0; i < 4; ++i) {
    const auto t0 = Clock::now();
    std::copy(from.begin(), from.end(), to.begin());
    best = std::min(best, seconds_since(t0));
  }
  return 2.0 * static_cast<double>(n) / best;  // read and written
}

DeviceProfile cpu_profile() {
  DeviceProfile d;
  d.name = "cpu";
  d.measured = true;
  d.flops_f32 = measure_matmul_flops();
  d.flops_bf16 = d.flops_f32;
  d.memory_bytes_per_s = measure_memory_bandwidth();
  d.memory_bytes = std::int64_t{1} << 40;
  // An act's handshakes on one worker (bench actors: same-thread hop about 0.06 us; a request
  // and an ack each).
  d.act_overhead_s = 0.2e-6;
  d.per_node = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  d.intra_node = {"shm", 1e-6, d.memory_bytes_per_s / 2};
  d.inter_node = {"tcp", 10e-6, 1.25e9};
  d.source = fmt::format("measured here: f32 matrix product {:.1f} GFLOP/s on one core, copy {:.1f} GB/s; each kernel "
                         "timed on its shapes",
                         d.flops_f32 / 1e9, d.memory_bytes_per_s / 1e9);
  return d;
}

// GPUs: peaks and links from NVIDIA's data sheets (dense, without sparsity); the efficiencies
// are assumptions until `baton-plan calibrate` has run on the device (docs/planning.md).
DeviceProfile gpu_profile(std::string name, double bf16, double f32, double bw, double gib, double nvlink) {
  DeviceProfile d;
  d.name = std::move(name);
  d.flops_bf16 = bf16;
  d.flops_f32 = f32;
  d.memory_bytes_per_s = bw;
  d.memory_bytes = static_cast<std::int64_t>(gib * static_cast<double>(std::int64_t{1} << 30));
  d.matmul_efficiency = 0.7;
  d.memory_efficiency = 0.8;
  d.act_overhead_s = 4e-6;
  d.per_node = 8;
  d.intra_node = {"nvlink", 3e-6, nvlink};
  d.inter_node = {"infiniband", 6e-6, 25e9};
  d.source = "data sheet peaks; efficiencies 0.7 (matrix products) and 0.8 (memory) assumed, not calibrated on this device";
  return d;
}

}  // namespace

template <class... A>
[[noreturn]] void refuse(fmt::format_string<A...> f, A&&... a) {
  throw std::invalid_argument(fmt::format(f, std::forward<A>(a)...));
}

std::int64_t Layout::microbatches() const { return global_batch / (dp * micro_batch_of(*this)); }

std::string Layout::str() const {
  const std::string m = model == "mlp" ? fmt::format("mlp L{} hidden {}", layers, hidden)
                                       : fmt::format("{} L{} d{} h{} s{} v{}", model, layers, d_model, heads, seq, vocab);
  return fmt::format("{} | B{} b{} dp{} tp{} pp{} {}{} zero{} recompute {} {}", m, global_batch, micro_batch_of(*this), dp, tp, pp,
                     schedule, virtual_stages > 1 ? fmt::format(" v{}", virtual_stages) : "", zero, recompute, dtype);
}

void Layout::check() const {
  if (model != "mlp" && model != "gpt" && model != "llama") refuse("--model {}: mlp, gpt or llama", model);
  if (dp < 1 || tp < 1 || pp < 1) refuse("--dp {} --tp {} --pp {}: each at least 1", dp, tp, pp);
  if (global_batch < 1) refuse("--global-batch {}: at least 1", global_batch);
  const std::int64_t mb = micro_batch_of(*this);
  if (mb < 1 || global_batch % (dp * mb) != 0) {
    refuse("--global-batch {} is not a multiple of --dp {} x --micro-batch {}", global_batch, dp, mb);
  }
  if (dtype != "f32" && dtype != "bf16") refuse("--dtype {}: f32 or bf16", dtype);
  if (recompute != "none" && recompute != "selective" && recompute != "full") {
    refuse("--recompute {}: none, selective or full", recompute);
  }
  if (zero < 0 || zero > 3) refuse("--zero {}: 0, 1, 2 or 3", zero);
  const PipelineSchedule s = parse_schedule(schedule);
  if (pp > 1) {
    const std::string why = schedule_refusal(s, pp, virtual_stages, microbatches());
    if (!why.empty()) refuse("--schedule {} with --pp {} and {} micro-batches: {}", schedule, pp, microbatches(), why);
  }
  if (model != "mlp") {
    if (d_model % heads != 0) refuse("--d-model {} is not a multiple of --heads {}", d_model, heads);
    if (heads % tp != 0) refuse("--heads {} is not a multiple of --tp {}", heads, tp);
    if (vocab % tp != 0) refuse("--vocab {} is not a multiple of --tp {}", vocab, tp);
  } else if (hidden % tp != 0) {
    refuse("--hidden {} is not a multiple of --tp {}", hidden, tp);
  }
}

std::vector<std::string> device_profile_names() { return {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "cpu"}; }

DeviceProfile device_profile(std::string_view name) {
  // A100: 312 TFLOP/s bf16, 19.5 f32; 1,555 GB/s (40 GB) and 2,039 GB/s (80 GB); NVLink 3
  // 600 GB/s both ways. H100 SXM: 989 bf16, 67 f32; 3.35 TB/s; NVLink 4 900 GB/s. H200: H100's
  // compute, 4.8 TB/s, 141 GB. Per direction: half the NVLink figure.
  if (name == "a100-40gb") return gpu_profile("a100-40gb", 312e12, 19.5e12, 1555e9, 40, 300e9);
  if (name == "a100-80gb") return gpu_profile("a100-80gb", 312e12, 19.5e12, 2039e9, 80, 300e9);
  if (name == "h100-sxm") return gpu_profile("h100-sxm", 989e12, 67e12, 3350e9, 80, 450e9);
  if (name == "h200") return gpu_profile("h200", 989e12, 67e12, 4800e9, 141, 450e9);
  if (name == "cpu") return cpu_profile();
  throw std::invalid_argument(fmt::format("no device profile '{}'; the built-in ones are {}", name,
                                          fmt::join(device_profile_names(), ", ")));
}

Cluster parse_cluster(std::string_view spec, int gpus_per_node) {
  const auto colon = spec.rfind(':');
  int n = 0;
  if (colon == std::string_view::npos || colon + 1 == spec.size()) {
    throw std::invalid_argument(fmt::format("--cluster {}: NAME:N (h100-sxm:1024, cpu:2)", spec));
  }
  for (char ch : spec.substr(colon + 1)) {
    if (ch < '0' || ch > '9' || n > 1'000'000) throw std::invalid_argument(fmt::format("--cluster {}: N must be a count of devices", spec));
    n = n * 10 + (ch - '0');
  }
  if (n < 1) throw std::invalid_argument(fmt::format("--cluster {}: at least one device", spec));
  Cluster c{device_profile(spec.substr(0, colon)), n};
  if (gpus_per_node > 0) c.device.per_node = gpus_per_node;
  return c;
}

Prediction predict(const Layout& l, const Cluster& c, const PredictOptions& options) {
  const auto t0 = Clock::now();
  l.check();
  const int places = l.dp * l.tp * l.pp;
  if (places != c.devices) {
    throw std::invalid_argument(fmt::format("--dp {} x --tp {} x --pp {} is {} devices; the cluster has {}", l.dp, l.tp,
                                            l.pp, places, c.devices));
  }
  if (places > Device::max_index + 1) {
    throw std::invalid_argument(fmt::format(
        "{} devices: baton-plan compiles the whole plan in this process, at most {} devices for now (the plan's "
        "symmetry, which a larger job needs, is not built yet)",
        places, Device::max_index + 1));
  }
  const DeviceType type = c.device.measured ? DeviceType::cpu : DeviceType::sim;
  Prediction p;
  p.layout = l;
  p.cluster = fmt::format("{}:{}", c.device.name, c.devices);
  // The steady state: three steps against one (the first also fills the pipeline and the
  // variables' first hand-out).
  const std::int64_t steps = 3;
  TrainingJob job = compile(l, type, steps);
  p.memory = memory_report(job.plan);
  for (const DeviceMemory& m : p.memory) p.peak_memory_bytes = std::max(p.peak_memory_bytes, m.total());
  p.fits = p.peak_memory_bytes <= c.device.memory_bytes;
  p.actors = static_cast<std::int64_t>(job.plan.actors.size());
  if (!p.fits && options.skip_if_unfit) {
    p.wall_s = seconds_since(t0);
    return p;
  }
  TrainingJob one = compile(l, type, 1);
  Costs costs = act_costs(job, c, options.repeats);
  SimulationOptions so;
  so.act_seconds = costs.seconds;
  Simulation sim = simulate(job.plan, so);
  if (sim.stalled) throw std::runtime_error("the simulated plan stalls:" + sim.stall);
  if (c.device.measured) {
    // Timed again where they run, in the order the simulation ran them, and run again.
    std::vector<double> replayed = Replay(job).seconds(sim, costs.seconds);
    for (ActorIndex i = 0; i < replayed.size(); ++i) {
      if (costs.link_of_actor[i].empty() && replayed[i] != costs.seconds[i]) costs.seconds[i] = replayed[i] + c.device.act_overhead_s;
    }
    so.act_seconds = costs.seconds;
    sim = simulate(job.plan, so);
    if (sim.stalled) throw std::runtime_error("the simulated plan stalls:" + sim.stall);
  }
  // The one-step plan has the same actors (only the sources' pieces differ): the same costs.
  if (one.plan.actors.size() != job.plan.actors.size()) throw std::logic_error("the one-step plan has other actors");
  so.record_acts = false;
  const Simulation first = simulate(one.plan, so);
  p.step_time_s = (sim.makespan - first.makespan) / static_cast<double>(steps - 1);
  if (!(p.step_time_s > 0)) p.step_time_s = sim.makespan / static_cast<double>(steps);
  p.samples_per_s = static_cast<double>(l.global_batch) / p.step_time_s;
  p.tokens_per_s = is_lm(l) ? p.samples_per_s * static_cast<double>(l.seq) : 0;

  // The model's FLOPs: 6 per weight per token (sample), and attention's scores.
  std::int64_t weights = 0;
  for (const auto& [name, t] : job.params->values()) weights += t.numel();
  const double tokens = static_cast<double>(l.global_batch) * (is_lm(l) ? static_cast<double>(l.seq) : 1.0);
  p.model_flops_per_step = 6.0 * static_cast<double>(weights) * tokens;
  if (is_lm(l)) p.model_flops_per_step += 12.0 * static_cast<double>(l.layers * l.d_model * l.seq) * tokens;
  p.model_flops_per_device_s = p.model_flops_per_step / p.step_time_s / places;
  const double peak = l.dtype == "bf16" ? c.device.flops_bf16 : c.device.flops_f32;
  p.mfu = p.model_flops_per_device_s / peak;

  // Each device's compute resource: the one its forward ops run on.
  std::map<std::int32_t, bool> compute;
  for (ActorIndex i = 0; i < job.plan.actors.size(); ++i) {
    const ActorRole r = job.plan.actors[i].role;
    if (r == ActorRole::forward || r == ActorRole::backward) compute[sim.resource_of[i]] = true;
  }
  double idle = 0;
  for (const auto& [r, yes] : compute) {
    const double busy = sim.busy[static_cast<std::size_t>(r)] - first.busy[static_cast<std::size_t>(r)];
    idle += 1.0 - busy / (p.step_time_s * static_cast<double>(steps - 1));
  }
  p.bubble_fraction = compute.empty() ? 0 : std::max(0.0, idle / static_cast<double>(compute.size()));

  for (ActorIndex i = 0; i < job.plan.actors.size(); ++i) {
    const double per_step = static_cast<double>(sim.act_count[i]) / static_cast<double>(steps);
    if (!costs.link_of_actor[i].empty()) {
      p.link_bytes_per_step[costs.link_of_actor[i]] += per_step * static_cast<double>(output_bytes(job.plan, job.plan.actors[i]));
    }
    if (costs.remote_bytes[i] > 0) p.link_bytes_per_step[costs.remote_link[i]] += per_step * costs.remote_bytes[i];
  }
  std::map<std::string, double> on_path;
  for (std::int64_t a : sim.critical_path()) {
    const SimulatedAct& act = sim.acts[static_cast<std::size_t>(a)];
    on_path[sim.resource_names[static_cast<std::size_t>(sim.resource_of[act.actor])]] += act.end - act.start;
  }
  p.critical_path.assign(on_path.begin(), on_path.end());
  std::sort(p.critical_path.begin(), p.critical_path.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  for (ActorIndex i = 0; i < job.plan.actors.size(); ++i) {
    if (costs.link_of_actor[i].empty()) p.act_s_per_step += costs.seconds[i] * static_cast<double>(sim.act_count[i]);
  }
  p.act_s_per_step /= static_cast<double>(steps);
  std::map<std::string, double> acts_of_op;
  for (ActorIndex i = 0; i < job.plan.actors.size(); ++i) {
    const ActorDesc& d = job.plan.actors[i];
    if (d.kind == ActorKind::repeat || !costs.link_of_actor[i].empty() || sim.act_count[i] == 0) continue;
    const std::string op = d.kind == ActorKind::accumulate ? "(accumulate)" : d.op;
    p.act_s_by_op[op] += costs.seconds[i] * static_cast<double>(sim.act_count[i]);
    acts_of_op[op] += static_cast<double>(sim.act_count[i]);
  }
  for (auto& [op, s] : p.act_s_by_op) s /= acts_of_op[op];
  if (options.keep_acts) {
    p.simulation = std::move(sim);
    p.plan = std::move(job.plan);
  }
  p.wall_s = seconds_since(t0);
  return p;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

// What a layout may still turn on to fit, cheapest first: ZeRO's stages (memory for a little
// communication), then recomputation (memory for compute). Neither makes a step faster, so the
// search takes the first rung that fits.
std::vector<std::pair<int, std::string>> memory_ladder(const Layout& l, const SearchFixed& f) {
  std::vector<std::pair<int, std::string>> rungs;
  const std::vector<int> zeros = f.zero ? std::vector<int>{*f.zero} : l.dp > 1 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0};
  const std::vector<std::string> recomputes =
      f.recompute ? std::vector<std::string>{*f.recompute}
      : l.model == "mlp" ? std::vector<std::string>{"none"}
                         : std::vector<std::string>{"none", "selective", "full"};
  for (const std::string& r : recomputes) {
    for (int z : zeros) rungs.emplace_back(z, r);
  }
  return rungs;
}

}  // namespace

SearchResult search(const Layout& base, const Cluster& c, const SearchFixed& f, const SearchOptions& options) {
  const auto t0 = Clock::now();
  SearchResult result;
  std::vector<Layout> shapes;
  for (int dp : f.dp ? std::vector<int>{*f.dp} : divisors(c.devices)) {
    for (int tp : f.tp ? std::vector<int>{*f.tp} : divisors(c.devices / dp)) {
      const int pp = c.devices / (dp * tp);
      if (dp * tp * pp != c.devices || (f.pp && *f.pp != pp)) continue;
      if (pp > base.layers) continue;  // a stage needs a layer
      // Micro-batches: every micro-batch size that splits the global batch into 1, 2, 4, ... 32
      // micro-batches per replica.
      std::vector<std::int64_t> micro;
      if (f.micro_batch) {
        micro = {*f.micro_batch};
      } else {
        for (std::int64_t m = 1; m <= 32; m *= 2) {
          if (base.global_batch % (dp * m) == 0) micro.push_back(base.global_batch / (dp * m));
        }
      }
      // PipeDream-2BW trains with weights one step stale: another model, never chosen for the user.
      std::vector<std::string> schedules = f.schedule ? std::vector<std::string>{*f.schedule}
                                           : pp == 1 ? std::vector<std::string>{"1f1b"}
                                                     : std::vector<std::string>{"1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"};
      for (std::int64_t b : micro) {
        for (const std::string& s : schedules) {
          Layout l = base;
          l.dp = dp, l.tp = tp, l.pp = pp, l.micro_batch = b, l.schedule = s;
          l.virtual_stages = s == "interleaved" ? 2 : 1;
          if (s == "interleaved" && pp * l.virtual_stages > base.layers) continue;
          try {
            l.check();
          } catch (const std::invalid_argument&) {
            ++result.refused;
            continue;
          }
          shapes.push_back(l);
        }
      }
    }
  }
  result.candidates = static_cast<std::int64_t>(shapes.size());
  for (const Layout& shape : shapes) {
    if (seconds_since(t0) > options.time_limit_s) {
      result.notes.push_back(fmt::format("stopped after {:.0f} s (--time-limit): {} of {} layouts not tried",
                                         options.time_limit_s, result.candidates - result.evaluated - result.refused,
                                         result.candidates));
      break;
    }
    for (const auto& [zero, recompute] : memory_ladder(shape, f)) {
      Layout l = shape;
      l.zero = zero;
      l.recompute = recompute;
      Prediction p;
      try {
        p = predict(l, c, {.repeats = 1, .skip_if_unfit = true});
      } catch (const std::exception&) {
        // A rung the compiler refuses (ZeRO's sharded optimizer on accelerators, selective
        // recomputation of a fused attention that keeps no scores): the next one may do.
        ++result.refused;
        continue;
      }
      ++result.evaluated;
      if (!p.fits) continue;
      result.ranked.push_back(std::move(p));
      break;
    }
  }
  std::stable_sort(result.ranked.begin(), result.ranked.end(), [](const Prediction& a, const Prediction& b) {
    return a.step_time_s != b.step_time_s ? a.step_time_s < b.step_time_s : a.peak_memory_bytes < b.peak_memory_bytes;
  });
  if (result.ranked.size() > static_cast<std::size_t>(options.top)) result.ranked.resize(static_cast<std::size_t>(options.top));
  result.wall_s = seconds_since(t0);
  return result;
}

Choice choose(const Layout& base, std::string_view profile, int devices, const SearchFixed& fixed) {
  const auto t0 = Clock::now();
  std::vector<Prediction> all;
  std::int64_t tried = 0;
  for (int n = 1; n <= devices; ++n) {
    if (fixed.dp.value_or(1) * fixed.tp.value_or(1) * fixed.pp.value_or(1) > n) continue;
    SearchResult r = search(base, parse_cluster(fmt::format("{}:{}", profile, n)), fixed, {.top = 2});
    tried += r.candidates;
    for (Prediction& p : r.ranked) all.push_back(std::move(p));
  }
  std::stable_sort(all.begin(), all.end(), [](const Prediction& a, const Prediction& b) { return a.step_time_s < b.step_time_s; });
  if (all.empty()) {
    throw std::invalid_argument(fmt::format("--layout auto: no layout of {} on 1-{} {} devices fits", base.str(), devices, profile));
  }
  Choice c{all.front(), ""};
  const Prediction& b = c.best;
  c.why = fmt::format("{}: predicted {:.4g} samples/s ({:.4g} s a step, bubble {:.0f}%, {} on the largest device)", b.layout.str(),
                      b.samples_per_s, b.step_time_s, 100 * b.bubble_fraction, format_bytes(b.peak_memory_bytes));
  if (all.size() > 1) {
    c.why += fmt::format("; the next best, {}, {:.1f}% slower", all[1].layout.str(),
                         100 * (all[1].step_time_s / b.step_time_s - 1));
  }
  c.why += fmt::format("; {} layouts on 1-{} devices searched in {:.1f} s (baton-plan search, docs/planning.md)", tried, devices,
                       seconds_since(t0));
  return c;
}

Measured measure(const Layout& l, std::int64_t steps, std::int64_t warm) {
  l.check();
  if (steps <= warm || warm < 1) throw std::invalid_argument(fmt::format("measure: {} steps after {} warm-up steps", steps, warm));
  TrainingJob job = compile(l, DeviceType::cpu, steps);
  RuntimeSettings rs;
  rs.time_sample_hz = 0;  // exact: each kernel's time
  Runtime rt(job.plan, job.kernels, rs);
  const RunReport report = rt.run();
  const auto from = job.losses->when_done(warm), to = job.losses->when_done(steps);
  if (!from || !to) throw std::runtime_error("measure: the run ended before its last step reported");
  Measured m;
  m.step_s = std::chrono::duration<double>(*to - *from).count() / static_cast<double>(steps - warm);
  std::map<std::string, ActorIndex> index;
  for (ActorIndex i = 0; i < job.plan.actors.size(); ++i) index[job.plan.actors[i].name] = i;
  std::map<std::string, double> acts;
  for (const auto& a : report.metrics.actors) {
    m.kernel_s_per_step += a.kernel_s;
    const ActorDesc& d = job.plan.actors[index.at(a.name)];
    const std::string op = d.kind == ActorKind::accumulate ? "(accumulate)" : d.op;
    m.kernel_s_per_act[op] += a.kernel_s;
    acts[op] += static_cast<double>(a.acts);
  }
  for (auto& [op, s] : m.kernel_s_per_act) s /= std::max(1.0, acts[op]);
  m.kernel_s_per_step /= static_cast<double>(steps);
  return m;
}

std::string to_json(const Prediction& p) {
  const Layout& l = p.layout;
  std::string links, path;
  for (const auto& [k, v] : p.link_bytes_per_step) links += fmt::format("{}\"{}\":{:.0f}", links.empty() ? "" : ",", k, v);
  for (const auto& [k, v] : p.critical_path) path += fmt::format("{}{{\"resource\":\"{}\",\"seconds\":{:.6g}}}", path.empty() ? "" : ",", k, v);
  return fmt::format(
      "{{\"cluster\":\"{}\",\"model\":\"{}\",\"layers\":{},\"d_model\":{},\"heads\":{},\"seq\":{},\"vocab\":{},"
      "\"global_batch\":{},\"micro_batch\":{},\"microbatches\":{},\"dp\":{},\"tp\":{},\"pp\":{},\"schedule\":\"{}\","
      "\"virtual_stages\":{},\"zero\":{},\"recompute\":\"{}\",\"dtype\":\"{}\","
      "\"step_time_s\":{:.6g},\"samples_per_s\":{:.6g},\"tokens_per_s\":{:.6g},\"model_flops_per_device_s\":{:.6g},"
      "\"mfu\":{:.4f},\"bubble_fraction\":{:.4f},\"peak_memory_bytes\":{},\"fits\":{},\"link_bytes_per_step\":{{{}}},"
      "\"critical_path\":[{}],\"actors\":{},\"wall_s\":{:.3f}}}",
      p.cluster, l.model, l.layers, l.d_model, l.heads, l.seq, l.vocab, l.global_batch, micro_batch_of(l), l.microbatches(),
      l.dp, l.tp, l.pp, l.schedule, l.virtual_stages, l.zero, l.recompute, l.dtype, p.step_time_s, p.samples_per_s,
      p.tokens_per_s, p.model_flops_per_device_s, p.mfu, p.bubble_fraction, p.peak_memory_bytes, p.fits ? "true" : "false",
      links, path, p.actors, p.wall_s);
}

std::string to_text(const Prediction& p) {
  std::string out = fmt::format("baton-plan: {} on {} ({} actors, simulated in {:.2f} s)\n", p.layout.str(), p.cluster,
                                p.actors, p.wall_s);
  out += fmt::format("  step time    {:.4g} s   ({:.4g} samples/s{})\n", p.step_time_s, p.samples_per_s,
                     p.tokens_per_s > 0 ? fmt::format(", {:.4g} tokens/s", p.tokens_per_s) : "");
  out += fmt::format("  model FLOPs  {:.4g} TFLOP/s per device, MFU {:.1f}%\n", p.model_flops_per_device_s / 1e12, 100 * p.mfu);
  out += fmt::format("  bubble       {:.1f}% of each device's step idle (mean)\n", 100 * p.bubble_fraction);
  out += fmt::format("  memory       {} peak on the largest device: {}\n", format_bytes(p.peak_memory_bytes),
                     p.fits ? "fits" : "DOES NOT FIT");
  for (const auto& [k, v] : p.link_bytes_per_step) out += fmt::format("  link {:<8} {} a step\n", k, format_bytes(static_cast<std::int64_t>(v)));
  out += "  critical path (the chain of acts the last one waited for), by resource:\n";
  for (std::size_t i = 0; i < p.critical_path.size() && i < 6; ++i) {
    out += fmt::format("    {:<20} {:.4g} s\n", p.critical_path[i].first, p.critical_path[i].second);
  }
  return out;
}

std::string to_trace(const Prediction& p) {
  const Simulation& s = p.simulation;
  std::string out = "[";
  for (std::size_t r = 0; r < s.resource_names.size(); ++r) {
    out += fmt::format("{}{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":0,\"tid\":{},\"args\":{{\"name\":\"{}\"}}}}",
                       r == 0 ? "" : ",", r, s.resource_names[r]);
  }
  for (const SimulatedAct& a : s.acts) {
    if (a.end <= a.start) continue;
    out += fmt::format(",{{\"ph\":\"X\",\"name\":\"{}\",\"pid\":0,\"tid\":{},\"ts\":{:.3f},\"dur\":{:.3f},\"args\":{{\"act\":{}}}}}",
                       p.plan.actors[a.actor].name, s.resource_of[a.actor], a.start * 1e6, (a.end - a.start) * 1e6, a.act);
  }
  return out + "]\n";
}

}  // namespace baton::planner
