// The epilogues pass (passes.h): work that a matrix product can do as it writes its result,
// fused into the product's actor. Today one pattern, the one every Linear layer with a bias has
// in its backward pass: the weight gradient dw = matmul(x, dy, trans_a) and the bias gradient
// db = sum_to(dy, [n]) read the same dy; one `matmul_bias_grad` actor computes both (on CUDA
// cuBLASLt's bias-gradient epilogue, kernels/src/cuda/linear_grad.cpp; on the CPU the same gemm
// and the same reduction as the two ops, so the same bits). One read of dy instead of two and
// one actor instead of two (and of the views between them).
//
// When. The sum and the product are on the same place and stream, in the same role, stage and
// kind of backward work (a zero-bubble schedule's W work stays W work); nothing is delayed; the
// product reads dy and x whole or through same-place views (2-D reshapes of [..., k] and
// [..., n]), which the fused actor reads past. The fused actor takes the sum's place in the plan,
// so every reader of either result still comes after it in its lane (lanes keep plan order), and
// it runs only there where x is written earlier in the plan than the sum (a recomputed x made
// later, just before the product, leaves the pair alone). The device must have the kernel.
#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "baton/graph/passes.h"
#include "lowering.h"

namespace baton::passes {

namespace {

struct Fusion {
  ActorIndex sum = 0, product = 0;
  RegisterIndex x = 0, dy = 0;
};

/// The register `reg` reads: itself, or what the same-place view that writes it views.
RegisterIndex past_view(const Plan& plan, RegisterIndex reg, const Placement& where) {
  const ActorIndex p = plan.registers[reg].producer;
  if (p >= plan.actors.size()) return reg;
  const ActorDesc& v = plan.actors[p];
  if (!is_view(v) || v.inputs.size() != 1 || v.inputs[0].delay != 0 || v.where != where) return reg;
  return v.inputs[0].reg;
}

bool is_plain(const InputPort& in) { return in.delay == 0; }

std::optional<Fusion> fusion_for(const Plan& plan, const KernelRegistry& kernels, ActorIndex si,
                                 const std::set<ActorIndex>& taken) {
  const ActorDesc& s = plan.actors[si];
  if (s.kind != ActorKind::compute || s.op != "sum_to" || s.inputs.size() != 1 || s.outputs.size() != 1 ||
      !is_plain(s.inputs[0]))
    return std::nullopt;
  const RegisterIndex dy = s.inputs[0].reg;
  const RegisterDesc& dyr = plan.registers[dy];
  const RegisterDesc& dbr = plan.registers[s.outputs[0]];
  if (dyr.shape.size() < 2 || dbr.shape != Shape{dyr.shape.back()} || dbr.dtype != dyr.dtype) return std::nullopt;
  // The products that read dy, directly or through a view of it.
  std::vector<ActorIndex> readers(dyr.consumers.begin(), dyr.consumers.end());
  for (ActorIndex c : dyr.consumers) {
    if (is_view(plan.actors[c])) {
      for (RegisterIndex out : plan.actors[c].outputs) {
        readers.insert(readers.end(), plan.registers[out].consumers.begin(), plan.registers[out].consumers.end());
      }
    }
  }
  for (ActorIndex mi : readers) {
    const ActorDesc& m = plan.actors[mi];
    if (taken.contains(mi) || m.kind != ActorKind::compute || m.op != "matmul" || m.inputs.size() != 2 ||
        m.outputs.size() != 1 || !is_plain(m.inputs[0]) || !is_plain(m.inputs[1]) ||
        m.attrs.get_int("trans_a", 0) != 1 || m.attrs.get_int("trans_b", 0) != 0)
      continue;
    if (m.where != s.where || m.role != s.role || m.stage != s.stage || m.weight_gradient != s.weight_gradient ||
        m.first_piece != s.first_piece || m.pieces != s.pieces || m.dtype != s.dtype)
      continue;
    if (past_view(plan, m.inputs[1].reg, m.where) != dy) continue;
    const RegisterIndex x = past_view(plan, m.inputs[0].reg, m.where);
    const RegisterDesc& xr = plan.registers[x];
    const RegisterDesc& dwr = plan.registers[m.outputs[0]];
    if (xr.shape.empty() || xr.dtype != dyr.dtype || dwr.dtype != dyr.dtype) continue;
    const std::int64_t k = xr.shape.back(), n = dyr.shape.back();
    if (k <= 0 || n <= 0 || numel(xr.shape) / k != numel(dyr.shape) / n || dwr.shape != Shape{k, n}) continue;
    // x written before the sum's place in the plan (where the fused actor goes).
    if (xr.producer >= si) continue;
    if (!kernels.contains("matmul_bias_grad", m.where.device.type, m.dtype)) continue;
    return Fusion{si, mi, x, dy};
  }
  return std::nullopt;
}

}  // namespace

Plan epilogues(const Plan& plan, const KernelRegistry& kernels, const TrainConfig& cfg) {
  if (!cfg.fuse_bias_gradients) return plan;
  std::vector<Fusion> found;
  std::set<ActorIndex> taken;
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    if (auto f = fusion_for(plan, kernels, i, taken)) {
      taken.insert(f->product);
      found.push_back(*f);
    }
  }
  if (found.empty()) return plan;
  // The fused actors, at their sums' places; the products go, and so do the views only they read.
  std::map<ActorIndex, ActorDesc> replace;
  std::set<ActorIndex> drop;
  for (const Fusion& f : found) {
    const ActorDesc& m = plan.actors[f.product];
    const ActorDesc& s = plan.actors[f.sum];
    ActorDesc fused = m;
    fused.op = "matmul_bias_grad";
    fused.attrs = Attrs{};
    fused.inputs = {{f.x}, {f.dy}};
    fused.outputs = {m.outputs[0], s.outputs[0]};
    fused.in_place.clear();
    replace[f.sum] = std::move(fused);
    drop.insert(f.product);
    for (const InputPort& in : m.inputs) {
      const ActorIndex p = plan.registers[in.reg].producer;
      if (p < plan.actors.size() && is_view(plan.actors[p]) && plan.registers[in.reg].consumers.size() == 1)
        drop.insert(p);
    }
  }
  // Rebuilt without the dropped actors and the registers only they wrote; add_actor links anew.
  Plan out;
  constexpr RegisterIndex none = std::numeric_limits<RegisterIndex>::max();
  std::vector<RegisterIndex> reg_at(plan.registers.size(), none);
  std::set<RegisterIndex> gone;
  for (ActorIndex a : drop) {
    if (is_view(plan.actors[a])) gone.insert(plan.actors[a].outputs.begin(), plan.actors[a].outputs.end());
  }
  for (RegisterIndex r = 0; r < plan.registers.size(); ++r) {
    if (gone.contains(r)) continue;
    RegisterDesc d = plan.registers[r];
    d.producer = no_actor;
    d.consumers.clear();
    reg_at[r] = out.add_register(std::move(d));
  }
  for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
    if (drop.contains(i)) continue;
    ActorDesc a = replace.contains(i) ? replace.at(i) : plan.actors[i];
    for (InputPort& in : a.inputs) in.reg = reg_at.at(in.reg);
    for (RegisterIndex& o : a.outputs) o = reg_at.at(o);
    out.add_actor(std::move(a));
  }
  out.arenas = plan.arenas;
  return out;
}

}  // namespace baton::passes
