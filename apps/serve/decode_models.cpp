#include "decode_models.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

namespace baton::serve {

namespace {

using Kind = DecodeModel::Kind;

// What every step graph starts with: its inputs. `hidden` for a stage after the first, `tokens`
// for the first; `sample_rows` for the last.
struct StepInputs {
  Value tokens, hidden, positions, slots, table, sample_rows;
  std::int64_t begin = 0, end = 0;  // the stage's layers
  bool first = true, last = true;
  std::int64_t tp = 1;
  std::vector<Value> k_cache, v_cache;  // by layer - begin
};

StepInputs step_inputs(Graph& g, const DecodeModel& m, const StepShape& s) {
  StepInputs in;
  in.begin = s.first_layer;
  in.end = s.end_layer < 0 ? m.layers() : s.end_layer;
  in.first = in.begin == 0;
  in.last = in.end == m.layers();
  in.tp = s.tp;
  if (in.first) {
    in.tokens = g.input("tokens", {s.rows}, DType::i32);
  } else {
    in.hidden = g.input("hidden", {s.rows, m.width()}, m.dtype());
  }
  in.positions = g.input("positions", {s.rows}, DType::i32);
  in.slots = g.input("slots", {s.rows}, DType::i32);
  in.table = g.input("block_table", {s.slots, s.blocks_per_slot}, DType::i32);
  if (in.last) in.sample_rows = g.input("sample_rows", {std::min(s.rows, s.slots)}, DType::i32);
  const Shape cache{s.cache_blocks, s.block_size, m.kv_heads() / s.tp, m.head_dim()};
  for (std::int64_t l = in.begin; l < in.end; ++l) {
    in.k_cache.push_back(g.input(fmt::format("cache.k.{}", l), cache, m.dtype()));
    in.v_cache.push_back(g.input(fmt::format("cache.v.{}", l), cache, m.dtype()));
  }
  return in;
}

// A weight of the step (the same one again where a tied table is read twice).
Value weight(Graph& g, const std::string& name, Shape shape, DType dtype) {
  if (Value v = g.find(name); v.valid()) return v;
  return g.variable(name, std::move(shape), init::zeros(), dtype);
}

// A row-parallel product's partial sum, added across the tensor-parallel ranks.
Value reduce(const StepInputs& in, Value partial) { return in.tp == 1 ? partial : apply(tp_sum_op, {partial}); }

// [R, n dh] -> attention over the cache -> [R, heads dh].
Value attend(const StepInputs& in, std::int64_t layer, Value q, Value k, Value v, std::int64_t heads,
             std::int64_t kv_heads, std::int64_t dh) {
  const std::int64_t r = q.dim(0);
  Value o = paged_attention(reshape(q, {r, heads, dh}), reshape(k, {r, kv_heads, dh}), reshape(v, {r, kv_heads, dh}),
                            in.slots, in.positions, in.table, in.k_cache[static_cast<std::size_t>(layer - in.begin)],
                            in.v_cache[static_cast<std::size_t>(layer - in.begin)]);
  return reshape(o, {r, heads * dh});
}

Value gpt_step(Graph& g, const models::GptShape& m, const StepInputs& in) {
  const std::int64_t d = m.d_model, nh = m.heads / in.tp, dh = d / m.heads, dt = d / in.tp, ff = 4 * d / in.tp;
  auto w = [&](const std::string& name, Shape shape) { return weight(g, name, std::move(shape), m.dtype); };
  Value x = in.first ? embedding(w("wte", {m.vocab, d}), in.tokens) + embedding(w("wpe", {m.seq, d}), in.positions)
                     : in.hidden;  // [R, d]
  for (std::int64_t l = in.begin; l < in.end; ++l) {
    auto p = [&](const char* what) { return fmt::format("h{}.{}", l, what); };
    Value h = layer_norm(x, w(p("ln1.g"), {d}), w(p("ln1.b"), {d}));
    Value q = matmul(h, w(p("attn.wq"), {d, dt})), k = matmul(h, w(p("attn.wk"), {d, dt})),
          v = matmul(h, w(p("attn.wv"), {d, dt}));
    x = x + reduce(in, matmul(attend(in, l, q, k, v, nh, nh, dh), w(p("attn.wo"), {dt, d})));
    Value h2 = layer_norm(x, w(p("ln2.g"), {d}), w(p("ln2.b"), {d}));
    Value h1 = matmul(h2, w(p("mlp.w1"), {d, ff}));
    Value b1 = w(p("mlp.b1"), {ff});
    Value fc = m.fused_bias_gelu ? bias_gelu(h1, b1, m.gelu) : gelu(h1 + b1, m.gelu);
    x = x + (reduce(in, matmul(fc, w(p("mlp.w2"), {ff, d}))) + w(p("mlp.b2"), {d}));  // as models::gpt adds b2
  }
  if (!in.last) return x;
  Value xf = layer_norm(embedding(x, in.sample_rows), w("lnf.g", {d}), w("lnf.b", {d}));
  return matmul(xf, w("head.w", {d, m.vocab}));
}

Value gpt2_step(Graph& g, const models::Gpt2Shape& m, std::int64_t positions, const StepInputs& in) {
  const std::int64_t d = m.d_model, nh = m.heads / in.tp, dh = d / m.heads, dt = d / in.tp, ff = 4 * d / in.tp;
  auto w = [&](const std::string& name, Shape shape) { return weight(g, name, std::move(shape), m.dtype); };
  auto norm = [&](Value x, const std::string& name) {
    return layer_norm(x, w(name + ".weight", {d}), w(name + ".bias", {d}), m.norm_eps);
  };
  auto linear = [&](Value x, const std::string& name, std::int64_t n_in, std::int64_t n_out) {
    return matmul(x, w(name + ".weight", {n_in, n_out})) + w(name + ".bias", {n_out});
  };
  Value x = in.first ? embedding(w("wte.weight", {m.vocab, d}), in.tokens) +
                         embedding(w("wpe.weight", {positions, d}), in.positions)
                     : in.hidden;
  for (std::int64_t l = in.begin; l < in.end; ++l) {
    const std::string p = fmt::format("h.{}.", l);
    Value qkv = linear(norm(x, p + "ln_1"), p + "attn.c_attn", d, 3 * dt);  // [R, 3 d / tp]: this rank's q, k, v
    Value o = attend(in, l, slice(qkv, 1, 0, dt), slice(qkv, 1, dt, 2 * dt), slice(qkv, 1, 2 * dt, 3 * dt), nh, nh, dh);
    // Row-parallel: the partial products added across the ranks, then the bias once.
    auto row_linear = [&](Value v, const std::string& name, std::int64_t n_in) {
      return reduce(in, matmul(v, w(name + ".weight", {n_in, d}))) + w(name + ".bias", {d});
    };
    x = x + row_linear(o, p + "attn.c_proj", dt);
    // gelu_new(x w + b) as models::gpt2 computes it (bias_gelu).
    Value fc = bias_gelu(matmul(norm(x, p + "ln_2"), w(p + "mlp.c_fc.weight", {d, ff})), w(p + "mlp.c_fc.bias", {ff}),
                         GeluApprox::tanh);
    x = x + row_linear(fc, p + "mlp.c_proj", ff);
  }
  if (!in.last) return x;
  return matmul(norm(embedding(x, in.sample_rows), "ln_f"), w("wte.weight", {m.vocab, d}), false, true);
}

Value llama_step(Graph& g, const models::LlamaShape& m, const StepInputs& in) {
  const std::int64_t d = m.d_model, nh = m.heads / in.tp, nkv = m.kv_heads / in.tp, dh = d / m.heads,
                     ff = m.ffn_hidden / in.tp, r = in.positions.dim(0);
  auto w = [&](const std::string& name, Shape shape) { return weight(g, name, std::move(shape), m.dtype); };
  auto norm = [&](Value x, const std::string& name) { return rms_norm(x, w(name, {d}), m.norm_eps); };
  auto rotate = [&](Value x, std::int64_t heads) {
    return reshape(rope_at(reshape(x, {r, heads, dh}), in.positions, m.rope_base), {r, heads * dh});
  };
  Value x = in.first ? embedding(w("model.embed_tokens.weight", {m.vocab, d}), in.tokens) : in.hidden;
  for (std::int64_t l = in.begin; l < in.end; ++l) {
    auto p = [&](const char* what) { return fmt::format("model.layers.{}.{}", l, what); };
    Value h = norm(x, p("input_layernorm.weight"));
    Value q = rotate(matmul(h, w(p("self_attn.q_proj.weight"), {d, nh * dh})), nh);
    Value k = rotate(matmul(h, w(p("self_attn.k_proj.weight"), {d, nkv * dh})), nkv);
    Value v = matmul(h, w(p("self_attn.v_proj.weight"), {d, nkv * dh}));
    x = x + reduce(in, matmul(attend(in, l, q, k, v, nh, nkv, dh), w(p("self_attn.o_proj.weight"), {nh * dh, d})));
    Value h2 = norm(x, p("post_attention_layernorm.weight"));
    x = x + reduce(in, swiglu(h2, w(p("mlp.gate_proj.weight"), {d, ff}), w(p("mlp.up_proj.weight"), {d, ff}),
                              w(p("mlp.down_proj.weight"), {ff, d})));
  }
  if (!in.last) return x;
  Value xf = norm(embedding(x, in.sample_rows), "model.norm.weight");
  return m.tie_embeddings ? matmul(xf, w("model.embed_tokens.weight", {m.vocab, d}), false, true) : matmul(xf, w("lm_head.weight", {d, m.vocab}));
}

}  // namespace

std::string DecodeModel::name() const {
  switch (kind) {
    case Kind::gpt: return "gpt";
    case Kind::gpt2: return "gpt2";
    case Kind::llama: return "llama";
  }
  return "?";
}

std::int64_t DecodeModel::context() const {
  switch (kind) {
    case Kind::gpt: return gpt.seq;
    case Kind::gpt2: return gpt2.positions == 0 ? gpt2.seq : gpt2.positions;
    case Kind::llama: return llama.seq;
  }
  return 0;
}

std::int64_t DecodeModel::vocab() const {
  return kind == Kind::gpt ? gpt.vocab : kind == Kind::gpt2 ? gpt2.vocab : llama.vocab;
}
std::int64_t DecodeModel::layers() const {
  return kind == Kind::gpt ? gpt.layers : kind == Kind::gpt2 ? gpt2.layers : llama.layers;
}
std::int64_t DecodeModel::kv_heads() const {
  return kind == Kind::gpt ? gpt.heads : kind == Kind::gpt2 ? gpt2.heads : llama.kv_heads;
}
std::int64_t DecodeModel::head_dim() const {
  return kind == Kind::gpt ? gpt.d_model / gpt.heads
                           : kind == Kind::gpt2 ? gpt2.d_model / gpt2.heads : llama.d_model / llama.heads;
}
std::int64_t DecodeModel::width() const {
  return kind == Kind::gpt ? gpt.d_model : kind == Kind::gpt2 ? gpt2.d_model : llama.d_model;
}
DType DecodeModel::dtype() const {
  return kind == Kind::gpt ? gpt.dtype : kind == Kind::gpt2 ? gpt2.dtype : llama.dtype;
}

Value DecodeModel::full(Graph& g) const {
  switch (kind) {
    case Kind::gpt: return models::gpt(g, 1, gpt);
    case Kind::gpt2: return models::gpt2(g, 1, gpt2);
    case Kind::llama: return models::llama(g, 1, llama);
  }
  return {};
}

Value decode_step(Graph& g, const DecodeModel& m, const StepShape& s) {
  if (m.kind == Kind::gpt && m.gpt.tp != 1) throw GraphError("decode_step: a tp 1 model only (serving is one device)");
  if (m.kind == Kind::llama && m.llama.tp != 1) throw GraphError("decode_step: a tp 1 model only (serving is one device)");
  if (s.rows < 1 || s.slots < 1 || s.blocks_per_slot < 1 || s.block_size < 1 || s.cache_blocks < 1) {
    throw GraphError(fmt::format("decode_step: rows {}, slots {}, blocks_per_slot {}, block_size {} and cache_blocks {} "
                                 "must all be >= 1",
                                 s.rows, s.slots, s.blocks_per_slot, s.block_size, s.cache_blocks));
  }
  const std::int64_t end = s.end_layer < 0 ? m.layers() : s.end_layer;
  if (s.first_layer < 0 || end <= s.first_layer || end > m.layers()) {
    throw GraphError(fmt::format("decode_step: the stage's layers [{}, {}) are not a non-empty range of the model's {}",
                                 s.first_layer, end, m.layers()));
  }
  if (s.tp < 1 || s.tp_rank < 0 || s.tp_rank >= s.tp) {
    throw GraphError(fmt::format("decode_step: tp rank {} of {}", s.tp_rank, s.tp));
  }
  if (s.tp > 1) {
    const std::int64_t heads = m.kind == Kind::gpt ? m.gpt.heads : m.kind == Kind::gpt2 ? m.gpt2.heads : m.llama.heads;
    const std::int64_t width = m.kind == Kind::llama ? m.llama.ffn_hidden : 4 * m.width();
    if (heads % s.tp != 0 || m.kv_heads() % s.tp != 0 || width % s.tp != 0) {
      throw GraphError(fmt::format("--tp {}: the {} model's {} heads, {} kv heads and MLP width {} must all be multiples "
                                   "of it",
                                   s.tp, m.name(), heads, m.kv_heads(), width));
    }
    if (find_op(tp_sum_op) == nullptr) register_tp_sum();
  }
  const StepInputs in = step_inputs(g, m, s);
  Value logits;
  switch (m.kind) {
    case Kind::gpt: logits = gpt_step(g, m.gpt, in); break;
    case Kind::gpt2: logits = gpt2_step(g, m.gpt2, m.context(), in); break;
    case Kind::llama: logits = llama_step(g, m.llama, in); break;
  }
  return logits.named(in.last ? "logits" : "hidden_out");
}

std::vector<std::pair<std::int64_t, std::int64_t>> stage_layers(std::int64_t layers, std::int64_t pp) {
  if (pp < 1 || pp > layers) {
    throw std::invalid_argument(
        fmt::format("--pp {}: a pipeline needs between 1 and the model's {} layers stages (one layer at least each)",
                    pp, layers));
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> stages;
  std::int64_t begin = 0;
  for (std::int64_t s = 0; s < pp; ++s) {
    const std::int64_t n = layers / pp + (s < layers % pp ? 1 : 0);
    stages.emplace_back(begin, begin + n);
    begin += n;
  }
  return stages;
}

}  // namespace baton::serve
