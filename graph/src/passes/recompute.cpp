// The recompute pass (passes.h): activation recomputation. A forward node that the backward
// pass reads keeps its activation from its forward act to that backward act, for every block
// at once; a recomputed one is read back through a clone made in the backward pass, so it
// lives only as long as the forward pass reads it, and its clone only as long as the backward
// pass does (Chen et al. 2016, "Training deep nets with sublinear memory cost"; Megatron's
// selective recomputation, Korthikanti et al. 2022).
//
// When the clones act. They must not act early (in the forward pass, or at the start of the
// backward pass), or their activations would be live just as long as the originals' and
// nothing would be saved. No control edge is added: the clones are backward nodes (ids after
// the loss), so the lowering gives them the backward role, stream and slots, and the lanes
// pass (schedule.h) puts them in their stage's backward unit of each micro-batch, where the
// acts keep node-id order. The pass makes each clone just before the first backward node that
// reads it, so in the lane it acts right before it is needed. This is also what lets the
// memory plan see the savings: a slot's life is known only inside a lane (plan_memory.h).
// Without a lane (one stage and no memory plan) clones may act whenever their inputs are
// ready, but then every slot has memory of its own for the whole job and there was nothing to
// save. The results are the same either way: the same kernels on the same inputs.
//
// Stages. A clone goes on its original's stage and shard, and is read only by nodes of that
// stage: a backward node of another stage reads the kept original. The backward pass runs
// stages in reverse, so a clone read across stages would make the later stage wait for the
// earlier one's backward, which waits for the later one's: a deadlock. A segment cut by a
// stage boundary is therefore recomputed in pieces, each from what its stage keeps.
#include <fmt/format.h>

#include "baton/graph/passes.h"
#include "lowering.h"

namespace baton::passes {

namespace {

bool is_leaf(const Node& n) {
  return n.inputs.empty();
}

/// The forward nodes recomputed: those of a segment (a block with `full`, else a block's
/// attention core) that no needed forward node of another segment reads (what leaves a segment is
/// kept: the next block reads it). Leaves are never recomputed, nor the loss.
std::vector<bool> recomputed_nodes(const Graph& g, const Differentiated& d, bool full) {
  const int loss_id = d.loss.id();
  auto segment = [&](int id) {
    const Node& n = g.node(id);
    if (full) return n.block;
    return n.attention_core && n.block >= 0 ? n.block : (n.attention_core ? -2 : -1);
  };
  std::vector<bool> exits(static_cast<std::size_t>(loss_id) + 1, false);
  for (int id = 0; id <= loss_id; ++id) {
    if (!d.need[static_cast<std::size_t>(id)]) continue;
    for (int in : g.node(id).inputs) {
      if (segment(in) != segment(id)) exits[static_cast<std::size_t>(in)] = true;
    }
  }
  std::vector<bool> out(static_cast<std::size_t>(loss_id) + 1, false);
  for (int id = 0; id < loss_id; ++id) {
    const Node& n = g.node(id);
    out[static_cast<std::size_t>(id)] = d.need[static_cast<std::size_t>(id)] && !is_leaf(n) &&
                                        segment(id) >= 0 && !exits[static_cast<std::size_t>(id)];
  }
  return out;
}

/// Makes the clones and the new backward nodes, remembering where each new node came from.
struct Rewriter {
  Graph& g;
  const Stages& st;
  std::vector<bool> recomputed;  // by forward node id
  std::map<int, int> clone_of;   // forward node -> its clone
  std::map<int, int> from;       // new node -> the node whose placement it takes

  /// What a node on `stage` reads for forward node `in`: its clone if `in` is recomputed on
  /// that stage, else `in` itself.
  int reads(int in, int stage) {
    const bool again = static_cast<std::size_t>(in) < recomputed.size() &&
                       recomputed[static_cast<std::size_t>(in)] && st.at(in) == stage;
    return again ? clone(in) : in;
  }

  /// Node `like` made again from `inputs`, with its placement and marks; its name is `name`.
  int remake(int like, const std::vector<int>& inputs, std::string name) {
    const Node n = g.node(like);  // a copy: adding nodes may move the vector
    std::vector<Value> ins;
    for (int in : inputs) ins.push_back(g.value(in));
    const int id = g.add(n.op, std::move(ins), n.attrs, n.shape, n.dtype).id();
    Node& made = g.node_mut(id);
    made.tp_shard = n.tp_shard;
    made.block = n.block;
    made.attention_core = n.attention_core;
    made.name = std::move(name);
    from[id] = like;
    return id;
  }

  /// The clone of recomputed forward node `id`, made (with those of the recomputed nodes it
  /// reads on its stage) on first use. A constant it reads (a fill) is made again too, beside
  /// it: the original's two slots are freed by the forward pass, and a backward reader would
  /// hold them for as long as the schedule keeps micro-batches in flight.
  int clone(int id) {
    if (auto it = clone_of.find(id); it != clone_of.end()) return it->second;
    const std::vector<int> inputs = g.node(id).inputs;
    std::vector<int> ins;
    for (int in : inputs) {
      const Node& x = g.node(in);
      if (x.op == "fill" && is_leaf(x)) {
        const int fill = remake(in, {}, fresh_name(x.name + ".recompute"));
        from[fill] = id;  // on its reader's stage and shard
        ins.push_back(fill);
      } else {
        ins.push_back(reads(in, st.at(id)));
      }
    }
    const int c = remake(id, ins, fresh_name(g.node(id).name + ".recompute"));
    g.node_mut(c).grad_of = id;
    clone_of[id] = c;
    return c;
  }

  std::string fresh_name(const std::string& base) {
    std::string name = base;
    for (int k = 1; g.find(name).valid(); ++k) name = fmt::format("{}.{}", base, k);
    return name;
  }
};

/// `of` (by node id; empty: all 0) extended to every node of `g`, a new node taking the entry
/// of the node it came from.
std::vector<int> extended(std::vector<int> of, const Graph& g, const std::map<int, int>& from) {
  if (of.empty()) return of;
  of.resize(static_cast<std::size_t>(g.size()), 0);
  for (const auto& [made, like] : from)
    of[static_cast<std::size_t>(made)] = of[static_cast<std::size_t>(like)];
  return of;
}

}  // namespace

Recomputed recompute(Graph& g, const Differentiated& d, const Shards& shards, const Stages& st,
                     const TrainConfig& cfg) {
  Recomputed out{.d = d, .shards = shards, .stages = st, .mode = cfg.recompute};
  if (cfg.recompute == "none") return out;
  const bool full = cfg.recompute == "full";
  Rewriter rw{g, st, recomputed_nodes(g, d, full)};
  bool any = false;
  for (bool r : rw.recomputed) any = any || r;
  if (!any) {
    throw GraphError(
        full ? "recompute 'full': the model marks no transformer block (Graph::block scopes, as "
               "models::gpt and models::llama make)"
             : "recompute 'selective': the model marks no attention core whose scores it keeps "
               "(Graph::attention_core scopes, as models::gpt makes around naive attention; "
               "fused attention keeps no T x T scores, so there is nothing to recompute)");
  }
  // Every needed backward node made again, in order, reading clones where it read recomputed
  // nodes on its stage; the old ones are left unneeded, renamed.
  const int loss_id = d.loss.id(), old_size = g.size();
  std::map<int, int> copy_of;
  for (int id = loss_id + 1; id < old_size; ++id) {
    if (!d.need[static_cast<std::size_t>(id)] || is_leaf(g.node(id))) continue;
    const std::vector<int> inputs = g.node(id).inputs;
    std::vector<int> ins;
    for (int in : inputs) {
      if (in > loss_id) {
        auto it = copy_of.find(in);
        ins.push_back(it == copy_of.end() ? in : it->second);
      } else {
        ins.push_back(rw.reads(in, st.at(id)));
      }
    }
    const std::string name = g.node(id).name;
    g.node_mut(id).name = rw.fresh_name(name + ".before_recompute");
    const int made = rw.remake(id, ins, name);
    g.node_mut(made).grad_of = g.node(id).grad_of;
    copy_of[id] = made;
  }
  std::vector<Value> targets{d.loss};
  for (auto& [v, grad] : out.d.trained) {
    if (auto it = copy_of.find(grad.id()); it != copy_of.end()) grad = g.value(it->second);
    targets.push_back(grad);
  }
  out.d.need = detail::needed_nodes(g, targets);
  out.shards.of = extended(shards.of, g, rw.from);
  out.stages.of = extended(st.of, g, rw.from);
  for (const auto& [forward, c] : rw.clone_of) out.clones[c] = forward;
  return out;
}

std::string Recomputed::to_text() const {
  const Graph& g = d.loss.graph();
  std::string out = fmt::format(
      "recompute {}: {} forward nodes computed again in the backward pass\n", mode, clones.size());
  for (const auto& [c, forward] : clones) {
    out += fmt::format("{} recomputes {} (stage {}, shard {})\n", g.node(c).name,
                       g.node(forward).name, stages.at(c), shards.at(c));
  }
  return out + d.to_text();
}

}  // namespace baton::passes
