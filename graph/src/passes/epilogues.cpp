// The epilogues pass (passes.h): work that a matrix product can do as it writes its result,
// fused into the product's actor. Two patterns, the ones every Linear layer with a bias has:
//
// - Backward: the weight gradient dw = matmul(x, dy, trans_a) and the bias gradient
//   db = sum_to(dy, [n]) read the same dy; one `matmul_bias_grad` actor computes both (on CUDA
//   cuBLASLt's bias-gradient epilogue, kernels/src/cuda/linear.cpp; on the CPU the same gemm and
//   the same reduction as the two ops, so the same bits). One read of dy instead of two and one
//   actor instead of two (and of the views between them).
// - Forward: y = matmul(x, w) + b with b [n], the product read by nothing but the add (directly,
//   or through autocast's cast of a bf16 product to f32 when b is f32); one `matmul_bias` actor
//   (on CUDA cuBLASLt's bias epilogue, writing y in the add's dtype; on the CPU the product, its
//   rounding and the add as the ops did them, so the same bits). One pass over y instead of two
//   (three with the cast), and the product's register is gone.
// - Forward with GELU: fc = bias_gelu(matmul(x, w), b) in GELU's tanh form (the only form
//   cuBLASLt's GELU epilogue computes), where the product h is read by nothing but that op and
//   the backward's bias_gelu_grad(h, b, dy) (the same b and form): one
//   `matmul_bias_gelu` actor writing fc and, into h's register, the pre-activation h + b
//   (cuBLASLt's GELU_AUX_BIAS on CUDA, its aux output); each bias_gelu_grad becomes
//   gelu_grad(h + b, dy), which computes what it computed (the sum rounded as bias_gelu_grad
//   rounds it: the same bits in f32; in bf16 the stored pre-activation is rounded to bf16 once
//   more). One pass over h instead of two and no separate bias_gelu kernel; the memory is the
//   same (h's register holds h + b).
// - Backward with GELU: that bias_gelu_grad's dy the data gradient of the next product,
//   dfc = matmul(dy2, w2) read by it alone, and its result's bias gradient sum_to(dh, [n]) (both
//   alike): one `matmul_dgelu_bgrad` actor computing dh = gelu'(h + b) dfc and db as it writes
//   the product (cuBLASLt's DGELU_BGRAD on CUDA; on the CPU the three ops' arithmetic, the same
//   bits). This takes b's gradient before the bias-gradient pattern can pair it with the first
//   product's weight gradient, and the gelu' pass goes too. With fuse_bias_gradients.
//
// When. The ops are on the same place and stream, in the same role, stage and kind of backward
// work (a zero-bubble schedule's W work stays W work); nothing is delayed. Backward: the product
// reads dy and x whole or through same-place views (2-D reshapes of [..., k] and [..., n]), which
// the fused actor reads past; the fused actor takes the sum's place in the plan, so every reader
// of either result still comes after it in its lane (lanes keep plan order), where x is written
// earlier in the plan than the sum; else the product's place, where every reader of the bias
// gradient comes after the product (a tensor-parallel shard's copy of x, made just before its
// product); else the pair stays apart. Forward: the product is matmul(x, w) with x
// [..., k] untransposed and w 2-D (transposed or not); the fused actor takes the add's place,
// after the product's inputs. The device must have the kernel.
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
  ActorIndex at = 0;  // the place the fused actor takes: the sum's, or the product's
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
    if (!kernels.contains("matmul_bias_grad", m.where.device.type, m.dtype)) continue;
    // The fused actor takes the sum's place where x is written before it; else the product's,
    // where that comes after the sum and every reader of the bias gradient after it (x a copy
    // made for the product, after the sum: a tensor-parallel shard's input from shard 0).
    if (xr.producer < si) return Fusion{si, mi, x, dy, si};
    const auto& db_readers = plan.registers[s.outputs[0]].consumers;
    if (mi > si && std::all_of(db_readers.begin(), db_readers.end(), [&](ActorIndex c) { return c > mi; }))
      return Fusion{si, mi, x, dy, mi};
  }
  return std::nullopt;
}

struct BiasAdd {
  ActorIndex add = 0, product = 0;
  std::optional<ActorIndex> cast;  // autocast's widening of a bf16 product, between the two
  RegisterIndex x = 0, w = 0, b = 0;
  bool trans_b = false;
};

/// Whether `a` and `b` run alike: place, stream, role, stage, pieces and kind of backward work.
bool alike(const ActorDesc& a, const ActorDesc& b) {
  return a.where == b.where && a.role == b.role && a.stage == b.stage && a.weight_gradient == b.weight_gradient &&
         a.first_piece == b.first_piece && a.pieces == b.pieces;
}

/// Whether `m` is a plain product matmul(x, w) that may fuse with `with`: x [..., k] read
/// untransposed, w 2-D, both read as they are, and `m` alike `with`.
bool plain_product(const Plan& plan, const ActorDesc& m, const ActorDesc& with) {
  if (m.kind != ActorKind::compute || m.op != "matmul" || m.inputs.size() != 2 || m.outputs.size() != 1 ||
      !is_plain(m.inputs[0]) || !is_plain(m.inputs[1]) || m.attrs.get_int("trans_a", 0) != 0 || !alike(m, with))
    return false;
  return plan.registers[m.inputs[0].reg].shape.size() >= 2 && plan.registers[m.inputs[1].reg].shape.size() == 2;
}

/// The one actor that reads `reg`, if it has exactly one reader.
std::optional<ActorIndex> only_reader(const Plan& plan, RegisterIndex reg) {
  const auto& c = plan.registers[reg].consumers;
  if (c.size() != 1) return std::nullopt;
  return c[0];
}

std::optional<BiasAdd> bias_add_for(const Plan& plan, const KernelRegistry& kernels, ActorIndex ai,
                                    const std::set<ActorIndex>& taken) {
  const ActorDesc& a = plan.actors[ai];
  if (a.kind != ActorKind::compute || a.op != "add" || a.inputs.size() != 2 || a.outputs.size() != 1 ||
      !is_plain(a.inputs[0]) || !is_plain(a.inputs[1]))
    return std::nullopt;
  const RegisterDesc& yr = plan.registers[a.outputs[0]];
  if (yr.shape.size() < 2) return std::nullopt;
  for (int side : {1, 0}) {  // the bias is add's second operand in every model here (x w + b)
    const RegisterIndex b = a.inputs[static_cast<std::size_t>(side)].reg;
    RegisterIndex y = a.inputs[static_cast<std::size_t>(1 - side)].reg;
    const RegisterDesc& br = plan.registers[b];
    if (br.shape != Shape{yr.shape.back()} || br.dtype != yr.dtype) continue;
    if (plan.registers[y].shape != yr.shape || plan.registers[y].dtype != yr.dtype) continue;
    if (only_reader(plan, y) != ai) continue;
    BiasAdd f{.add = ai};
    ActorIndex p = plan.registers[y].producer;
    if (p >= plan.actors.size()) continue;
    if (const ActorDesc& c = plan.actors[p]; c.kind == ActorKind::compute && c.op == "cast") {
      // autocast's f32 copy of a bf16 product, read by the add alone
      if (c.inputs.size() != 1 || c.outputs.size() != 1 || !is_plain(c.inputs[0]) || !alike(c, a) ||
          yr.dtype != DType::f32 || plan.registers[c.inputs[0].reg].dtype != DType::bf16 || taken.contains(p))
        continue;
      f.cast = p;
      y = c.inputs[0].reg;
      if (only_reader(plan, y) != p) continue;
      p = plan.registers[y].producer;
      if (p >= plan.actors.size()) continue;
    }
    const ActorDesc& m = plan.actors[p];
    if (taken.contains(p) || !plain_product(plan, m, a)) continue;
    const RegisterDesc& xr = plan.registers[m.inputs[0].reg];
    const RegisterDesc& wr = plan.registers[m.inputs[1].reg];
    if (xr.dtype != wr.dtype || xr.dtype != m.dtype) continue;
    if (xr.dtype != (f.cast ? DType::bf16 : yr.dtype)) continue;
    if (!kernels.contains("matmul_bias", m.where.device.type, m.dtype)) continue;
    f.product = p;
    f.x = m.inputs[0].reg;
    f.w = m.inputs[1].reg;
    f.b = b;
    f.trans_b = m.attrs.get_int("trans_b", 0) != 0;
    return f;
  }
  return std::nullopt;
}

struct GeluProduct {
  ActorIndex gelu = 0, product = 0;
  RegisterIndex x = 0, w = 0, b = 0;
  bool trans_b = false;
  std::vector<ActorIndex> grads;  // the backward's bias_gelu_grad(h, b, dy) actors
};

bool tanh_form(const ActorDesc& a) { return a.attrs.get_string("approximate", "none") == "tanh"; }

std::optional<GeluProduct> gelu_product_for(const Plan& plan, const KernelRegistry& kernels, ActorIndex gi,
                                            const std::set<ActorIndex>& taken) {
  const ActorDesc& g = plan.actors[gi];
  if (g.kind != ActorKind::compute || g.op != "bias_gelu" || g.inputs.size() != 2 || g.outputs.size() != 1 ||
      !is_plain(g.inputs[0]) || !is_plain(g.inputs[1]) || !tanh_form(g))
    return std::nullopt;
  const RegisterIndex h = g.inputs[0].reg, b = g.inputs[1].reg;
  const ActorIndex p = plan.registers[h].producer;
  if (p >= plan.actors.size() || taken.contains(p)) return std::nullopt;
  const ActorDesc& m = plan.actors[p];
  if (!plain_product(plan, m, g)) return std::nullopt;
  const RegisterDesc& xr = plan.registers[m.inputs[0].reg];
  const RegisterDesc& wr = plan.registers[m.inputs[1].reg];
  const RegisterDesc& hr = plan.registers[h];
  if (hr.shape.size() < 2) return std::nullopt;
  const DType t = m.dtype;
  if (xr.dtype != t || wr.dtype != t || hr.dtype != t || plan.registers[b].dtype != t ||
      plan.registers[g.outputs[0]].dtype != t || plan.registers[b].shape != Shape{hr.shape.back()})
    return std::nullopt;
  GeluProduct f{.gelu = gi, .product = p, .x = m.inputs[0].reg, .w = m.inputs[1].reg, .b = b,
                .trans_b = m.attrs.get_int("trans_b", 0) != 0};
  for (ActorIndex c : hr.consumers) {
    if (c == gi) continue;
    const ActorDesc& r = plan.actors[c];
    if (r.kind != ActorKind::compute || r.op != "bias_gelu_grad" || r.inputs.size() != 3 || r.outputs.size() != 1 ||
        r.inputs[0].reg != h || r.inputs[1].reg != b || !is_plain(r.inputs[0]) || !is_plain(r.inputs[1]) ||
        !tanh_form(r) || r.dtype != t || !kernels.contains("gelu_grad", r.where.device.type, t))
      return std::nullopt;
    if (std::find(f.grads.begin(), f.grads.end(), c) == f.grads.end()) f.grads.push_back(c);
  }
  if (!kernels.contains("matmul_bias_gelu", m.where.device.type, t)) return std::nullopt;
  return f;
}

struct DgeluFusion {
  ActorIndex product = 0, sum = 0;
  RegisterIndex dy = 0, w = 0;
  bool trans_b = false;
};

/// For the backward's bias_gelu_grad(h, b, dfc) at `ri`: dfc = matmul(dy, w), read by it alone,
/// and its result's one sum_to to [n] (b's gradient), alike; the data gradient of the product that
/// read the GELU, its gelu' and the bias gradient then are one matmul_dgelu_bgrad.
std::optional<DgeluFusion> dgelu_for(const Plan& plan, const KernelRegistry& kernels, ActorIndex ri,
                                     const std::set<ActorIndex>& taken) {
  const ActorDesc& r = plan.actors[ri];
  if (!is_plain(r.inputs[2])) return std::nullopt;
  const RegisterIndex dfc = r.inputs[2].reg;
  const ActorIndex p = plan.registers[dfc].producer;
  if (p >= plan.actors.size() || taken.contains(p) || only_reader(plan, dfc) != ri) return std::nullopt;
  const ActorDesc& m = plan.actors[p];
  if (!plain_product(plan, m, r) || m.dtype != r.dtype) return std::nullopt;
  const RegisterDesc& dyr = plan.registers[m.inputs[0].reg];
  const RegisterDesc& wr = plan.registers[m.inputs[1].reg];
  if (dyr.dtype != r.dtype || wr.dtype != r.dtype) return std::nullopt;
  const RegisterDesc& dh = plan.registers[r.outputs[0]];
  std::optional<ActorIndex> sum;
  for (ActorIndex c : dh.consumers) {
    const ActorDesc& a = plan.actors[c];
    if (a.kind != ActorKind::compute || a.op != "sum_to" || a.inputs.size() != 1 || a.outputs.size() != 1 ||
        !is_plain(a.inputs[0]) || !alike(a, r))
      continue;
    const RegisterDesc& db = plan.registers[a.outputs[0]];
    if (db.shape != Shape{dh.shape.back()} || db.dtype != r.dtype) continue;
    if (sum && *sum != c) return std::nullopt;
    sum = c;
  }
  if (!sum || !kernels.contains("matmul_dgelu_bgrad", r.where.device.type, r.dtype)) return std::nullopt;
  return DgeluFusion{p, *sum, m.inputs[0].reg, m.inputs[1].reg, m.attrs.get_int("trans_b", 0) != 0};
}

/// A fused forward actor: the product's placement and kind of work, with the name and memory
/// category of the op whose place it takes.
ActorDesc fused_forward(const ActorDesc& product, const ActorDesc& at, const char* op, bool trans_b,
                        std::vector<InputPort> inputs, std::vector<RegisterIndex> outputs) {
  ActorDesc fused = product;
  fused.name = at.name;
  fused.op = op;
  fused.attrs = Attrs{};
  fused.attrs.set("trans_b", std::int64_t{trans_b ? 1 : 0});
  fused.inputs = std::move(inputs);
  fused.outputs = std::move(outputs);
  fused.memory = at.memory;
  fused.in_place.clear();
  return fused;
}

/// bias_gelu_grad(h, b, dy) as gelu_grad(h + b, dy): its inputs without b, what it computed in
/// place of h or dy still in place of them.
ActorDesc as_gelu_grad(const ActorDesc& r) {
  ActorDesc a = r;
  a.op = "gelu_grad";
  a.attrs = Attrs{};
  a.attrs.set("approximate", std::string("tanh"));
  a.inputs = {r.inputs[0], r.inputs[2]};
  a.in_place.clear();
  for (InPlace ip : r.in_place) {
    if (ip.input == 1) continue;
    if (ip.input == 2) ip.input = 1;
    a.in_place.push_back(ip);
  }
  return a;
}

}  // namespace

Plan epilogues(const Plan& plan, const KernelRegistry& kernels, const TrainConfig& cfg) {
  std::map<ActorIndex, ActorDesc> replace;  // the fused actors, at the places of the ops they replace
  std::set<ActorIndex> drop;                // the ops they absorb
  std::set<ActorIndex> taken;               // products (and casts) already fused
  if (cfg.fuse_bias_adds) {
    // GELU products first, their backward's bias gradient with them (DGELU_BGRAD) rather than
    // with the first product's weight gradient (BGRADA, below): that takes the gelu' pass too.
    for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
      if (replace.contains(i) || drop.contains(i)) continue;
      const auto f = gelu_product_for(plan, kernels, i, taken);
      if (!f || drop.contains(f->product) || replace.contains(f->product)) continue;
      if (std::any_of(f->grads.begin(), f->grads.end(), [&](ActorIndex g) { return replace.contains(g) || drop.contains(g); }))
        continue;
      taken.insert(f->product);
      const ActorDesc& m = plan.actors[f->product];
      const ActorDesc& g = plan.actors[f->gelu];
      // fc, and h + b in h's register
      ActorDesc fused = fused_forward(m, g, "matmul_bias_gelu", f->trans_b, {{f->x}, {f->w}, {f->b}},
                                      {g.outputs[0], m.outputs[0]});
      fused.attrs.set("approximate", std::string("tanh"));
      replace[f->gelu] = std::move(fused);
      drop.insert(f->product);
      for (ActorIndex r : f->grads) {
        const auto d = cfg.fuse_bias_gradients ? dgelu_for(plan, kernels, r, taken) : std::nullopt;
        if (!d || drop.contains(d->product) || replace.contains(d->product) || drop.contains(d->sum) ||
            replace.contains(d->sum)) {
          replace[r] = as_gelu_grad(plan.actors[r]);
          continue;
        }
        taken.insert(d->product);
        const ActorDesc& a = plan.actors[r];
        ActorDesc back = a;
        back.op = "matmul_dgelu_bgrad";
        back.attrs = Attrs{};
        back.attrs.set("trans_b", std::int64_t{d->trans_b ? 1 : 0});
        back.attrs.set("approximate", std::string("tanh"));
        back.inputs = {{d->dy}, {d->w}, a.inputs[0]};  // the product's operands, and h + b
        back.outputs = {a.outputs[0], plan.actors[d->sum].outputs[0]};
        back.in_place.clear();
        replace[r] = std::move(back);
        drop.insert(d->product);
        drop.insert(d->sum);
      }
    }
  }
  if (cfg.fuse_bias_gradients) {
    for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
      if (replace.contains(i) || drop.contains(i)) continue;
      const auto f = fusion_for(plan, kernels, i, taken);
      if (!f || drop.contains(f->product) || replace.contains(f->product)) continue;
      taken.insert(f->product);
      const ActorDesc& m = plan.actors[f->product];
      const ActorDesc& s = plan.actors[f->sum];
      ActorDesc fused = m;
      fused.op = "matmul_bias_grad";
      fused.attrs = Attrs{};
      fused.inputs = {{f->x}, {f->dy}};
      fused.outputs = {m.outputs[0], s.outputs[0]};
      fused.in_place.clear();
      replace[f->at] = std::move(fused);
      drop.insert(f->at == f->sum ? f->product : f->sum);
      // and the views only the product read
      for (const InputPort& in : m.inputs) {
        const ActorIndex p = plan.registers[in.reg].producer;
        if (p < plan.actors.size() && is_view(plan.actors[p]) && plan.registers[in.reg].consumers.size() == 1)
          drop.insert(p);
      }
    }
  }
  if (cfg.fuse_bias_adds) {
    for (ActorIndex i = 0; i < plan.actors.size(); ++i) {
      if (replace.contains(i) || drop.contains(i)) continue;
      const auto f = bias_add_for(plan, kernels, i, taken);
      if (!f || drop.contains(f->product) || replace.contains(f->product)) continue;
      taken.insert(f->product);
      const ActorDesc& a = plan.actors[f->add];
      replace[f->add] =
          fused_forward(plan.actors[f->product], a, "matmul_bias", f->trans_b, {{f->x}, {f->w}, {f->b}}, {a.outputs[0]});
      drop.insert(f->product);
      if (f->cast) {
        taken.insert(*f->cast);
        drop.insert(*f->cast);
      }
    }
  }
  if (replace.empty()) return plan;
  std::map<ActorIndex, std::vector<ActorDesc>> in_place;
  for (auto& [i, a] : replace) in_place[i].push_back(std::move(a));
  return detail::rebuilt(plan, in_place, drop);
}

}  // namespace baton::passes
