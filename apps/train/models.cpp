#include "models.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace baton::models {

Value mlp(Graph& g, std::int64_t batch, const MlpShape& s, std::string* sbp_text) {
  if (s.tp < 1) throw GraphError(fmt::format("mlp: tp must be >= 1, not {}", s.tp));
  // The logical model, written once. Each pair of hidden layers carries Megatron's signatures:
  // the first by columns (w S(1), b S(0)), the second by rows (w S(0)); shard_graph infers the
  // rest (the first product S(1), the second P, one all-reduce before the second bias).
  auto build = [&](Graph& m) {
    Value h = m.input("x", {batch, s.inputs}, s.dtype);
    m.input("label", {batch}, i32);
    std::int64_t width = s.inputs;
    for (std::int64_t l = 0; l < s.layers; ++l) {
      const bool columns = l % 2 == 0 && l + 1 < s.layers, rows = l % 2 == 1;
      auto w = m.variable(fmt::format("fc{}.w", l), {width, s.hidden}, init::kaiming(), s.dtype);
      auto b = m.variable(fmt::format("fc{}.b", l), {s.hidden}, init::zeros(), s.dtype);
      if (columns) {
        m.set_sbp(w, sbp::split(1));
        m.set_sbp(b, sbp::split(0));
      }
      if (rows) m.set_sbp(w, sbp::split(0));
      h = relu(matmul(h, w) + b);
      width = s.hidden;
    }
    auto w = m.variable("out.w", {width, s.classes}, init::kaiming(), s.dtype);
    auto b = m.variable("out.b", {s.classes}, init::zeros(), s.dtype);
    return (matmul(h, w) + b).named("logits");
  };
  if (s.tp == 1 && sbp_text == nullptr) return build(g);  // the graph is its own physical graph
  Graph logical(g.seed());
  Value logits = build(logical);
  ShardedGraph sharded = shard_graph(logical, g, static_cast<int>(s.tp));
  if (sbp_text != nullptr) *sbp_text = sharded.to_text();
  return sharded.whole(logits);  // B: the node named "logits" itself
}

namespace {

Outputs build_gpt(Graph& g, std::int64_t batch, const GptShape& s, bool with_loss) {
  const std::int64_t b = batch, t = s.seq, d = s.d_model, nh = s.heads, dh = s.d_model / s.heads;
  if (d % nh != 0) throw GraphError(fmt::format("d_model {} is not a multiple of heads {}", d, nh));
  const std::int64_t tp = s.tp;
  if (tp < 1 || nh % tp != 0) throw GraphError(fmt::format("gpt: heads {} is not divisible by tp {}", nh, tp));
  if (s.vocab % tp != 0) {
    throw GraphError(fmt::format("gpt: vocab {} is not divisible by tp {} (the token table and the head are split by "
                                 "vocabulary over the tp shards)",
                                 s.vocab, tp));
  }
  auto shard_name = [&](const std::string& name, std::int64_t k) {
    return tp == 1 ? name : fmt::format("{}.tp{}", name, k);
  };
  auto tokens = g.input("tokens", {b, t}, i32);
  auto targets = g.input("targets", {b * t}, i32);
  // Megatron's vocabulary-parallel embedding: shard k looks up ids [k V/tp, (k+1) V/tp).
  const std::int64_t v_k = s.vocab / tp;
  std::vector<Value> tables;
  for (std::int64_t k = 0; k < tp; ++k) {
    auto on = g.shard(tp == 1 ? -1 : static_cast<std::int32_t>(k));
    tables.push_back(g.variable(shard_name("wte", k), {v_k, d}, init::normal(0.0, 0.02), s.dtype));
  }
  auto wpe = g.variable("wpe", {t, d}, init::normal(0.0, 0.02), s.dtype);
  Value x = (tp == 1 ? embedding(tables[0], tokens) : vocab_parallel_embedding(tables, tokens)) + wpe;  // [b, t, d]
  const std::int64_t nh_k = nh / tp, d_k = d / tp, f_k = 4 * d / tp;  // per shard
  for (std::int64_t l = 0; l < s.layers; ++l) {
    auto in_block = g.block(static_cast<std::int32_t>(l));  // what --recompute full recomputes
    auto p = [&](const char* what) { return fmt::format("h{}.{}", l, what); };
    auto ln1 = layer_norm(x, g.variable(p("ln1.g"), {d}, init::ones(), s.dtype), g.variable(p("ln1.b"), {d}, init::zeros(), s.dtype));
    // Attention: shard k computes heads [k nh/tp, (k+1) nh/tp) and its part of the output
    // projection; the parts are summed once.
    Value attn;
    for (std::int64_t sk = 0; sk < tp; ++sk) {
      auto on = g.shard(tp == 1 ? -1 : static_cast<std::int32_t>(sk));
      auto w = [&](const char* what, Shape shape) {
        return g.variable(shard_name(p(what), sk), std::move(shape), init::normal(0.0, 0.02), s.dtype);
      };
      auto split_heads = [&](Value v) {  // [b, t, d/tp] -> [b, nh_k, t, dh]
        return transpose(reshape(v, {b, t, nh_k, dh}), {0, 2, 1, 3});
      };
      auto q = split_heads(matmul(ln1, w("attn.wq", {d, d_k})));
      auto k = split_heads(matmul(ln1, w("attn.wk", {d, d_k})));
      auto v = split_heads(matmul(ln1, w("attn.wv", {d, d_k})));
      Value heads;  // [b, nh_k, t, dh]
      if (s.attention != GptShape::Attention::naive) {
        heads = attention(q, k, v, attention_options(s.attention));  // causal, scaled by 1/sqrt(dh)
      } else {
        auto q3 = reshape(q, {b * nh_k, t, dh}), k3 = reshape(k, {b * nh_k, t, dh}), v3 = reshape(v, {b * nh_k, t, dh});
        auto core = g.attention_core();  // the T x T scores: what --recompute selective recomputes
        auto att = softmax(causal_mask(matmul(q3, k3, false, true) * (1.0 / std::sqrt(static_cast<double>(dh)))));
        heads = reshape(matmul(att, v3), {b, nh_k, t, dh});
      }
      auto o = reshape(transpose(heads, {0, 2, 1, 3}), {b, t, d_k});
      Value part = matmul(o, w("attn.wo", {d_k, d}));
      attn = sk == 0 ? part : tp_sum_link(attn + part, sk, tp);  // one NCCL all-reduce on GPUs
    }
    x = x + attn;
    auto ln2 = layer_norm(x, g.variable(p("ln2.g"), {d}, init::ones(), s.dtype), g.variable(p("ln2.b"), {d}, init::zeros(), s.dtype));
    // MLP: w1 (and b1) by columns, w2 by rows.
    Value mlp;
    for (std::int64_t sk = 0; sk < tp; ++sk) {
      auto on = g.shard(tp == 1 ? -1 : static_cast<std::int32_t>(sk));
      auto h1 = matmul(ln2, g.variable(shard_name(p("mlp.w1"), sk), {d, f_k}, init::normal(0.0, 0.02), s.dtype));
      auto b1 = g.variable(shard_name(p("mlp.b1"), sk), {f_k}, init::zeros(), s.dtype);
      auto fc = s.fused_bias_gelu ? bias_gelu(h1, b1, s.gelu) : gelu(h1 + b1, s.gelu);
      Value part = matmul(fc, g.variable(shard_name(p("mlp.w2"), sk), {f_k, d}, init::normal(0.0, 0.02), s.dtype));
      mlp = sk == 0 ? part : tp_sum_link(mlp + part, sk, tp);
    }
    // The second product's bias on the product, then the residual (as nn.Linear and Megatron's
    // row-parallel Linear add it): x w2 + b2 is one cuBLASLt product with its bias epilogue.
    x = x + (mlp + g.variable(p("mlp.b2"), {d}, init::zeros(), s.dtype));
  }
  auto lnf = layer_norm(x, g.variable("lnf.g", {d}, init::ones(), s.dtype), g.variable("lnf.b", {d}, init::zeros(), s.dtype));
  // The head by columns: shard k's logits are classes [k V/tp, (k+1) V/tp).
  std::vector<Value> logits;
  for (std::int64_t k = 0; k < tp; ++k) {
    auto on = g.shard(tp == 1 ? -1 : static_cast<std::int32_t>(k));
    logits.push_back(reshape(matmul(lnf, g.variable(shard_name("head.w", k), {d, v_k}, init::normal(0.0, 0.02), s.dtype)),
                             {b * t, v_k}));
  }
  Outputs out;
  out.logits = (tp == 1 ? logits[0] : concat(logits, 1)).named("logits");
  if (with_loss) {
    out.loss = tp == 1 ? softmax_cross_entropy(out.logits, targets) : vocab_parallel_cross_entropy(logits, targets);
  }
  return out;
}

}  // namespace

GptShape::Attention parse_attention(std::string_view s, bool on_cuda) {
  if (s == "naive") return GptShape::Attention::naive;
  if (s == "fused") return GptShape::Attention::fused;
  if (s == "cudnn") {
    if (!on_cuda) throw std::invalid_argument("--attention cudnn runs on CUDA devices (--devices cuda:K); the CPU has naive and fused");
    return GptShape::Attention::cudnn;
  }
  if (s == "auto") return on_cuda ? GptShape::Attention::automatic : GptShape::Attention::naive;
  throw std::invalid_argument(fmt::format("--attention must be auto, naive, fused or cudnn, not '{}'", s));
}

GeluApprox parse_gelu(std::string_view s) {
  if (s == "erf") return GeluApprox::none;
  if (s == "tanh") return GeluApprox::tanh;
  throw std::invalid_argument(fmt::format("--gelu must be erf or tanh, not '{}'", s));
}

AttentionOptions attention_options(GptShape::Attention a) {
  switch (a) {
    case GptShape::Attention::cudnn: return {.kernel = "cudnn"};
    case GptShape::Attention::fused: return {.kernel = "fused"};
    default: return {};  // causal, 1/sqrt(D), kernel auto
  }
}

Value gpt(Graph& g, std::int64_t batch, const GptShape& s) { return build_gpt(g, batch, s, false).logits; }

Outputs gpt_with_loss(Graph& g, std::int64_t batch, const GptShape& s) { return build_gpt(g, batch, s, true); }

namespace {

void check_llama(const LlamaShape& s) {
  auto bad = [](const std::string& what) { throw GraphError("llama: " + what); };
  if (s.heads < 1 || s.d_model % s.heads != 0) bad(fmt::format("d_model {} is not a multiple of heads {}", s.d_model, s.heads));
  if ((s.d_model / s.heads) % 2 != 0) {
    bad(fmt::format("the head size d_model / heads = {} must be even (RoPE rotates pairs)", s.d_model / s.heads));
  }
  if (s.kv_heads < 1 || s.kv_heads > s.heads || s.heads % s.kv_heads != 0) {
    bad(fmt::format("kv_heads {} must divide heads {} (each kv head serves heads / kv_heads query heads)", s.kv_heads,
                    s.heads));
  }
  if (s.ffn_hidden < 1) bad(fmt::format("ffn_hidden {} must be >= 1", s.ffn_hidden));
  const std::int64_t tp = s.tp;
  if (tp < 1 || s.heads % tp != 0) bad(fmt::format("heads {} is not divisible by tp {}", s.heads, tp));
  if (s.ffn_hidden % tp != 0) bad(fmt::format("ffn_hidden {} is not divisible by tp {}", s.ffn_hidden, tp));
  if (s.vocab % tp != 0) {
    bad(fmt::format("vocab {} is not divisible by tp {} (the token table and the head are split by vocabulary over "
                    "the tp shards)",
                    s.vocab, tp));
  }
}

/// [b, kv, t, dh] -> [b, kv * rep, t, dh], kv head j read by query heads [j rep, (j+1) rep)
/// (transformers' repeat_kv: expand, then reshape).
Value repeat_kv(Value x, std::int64_t rep) {
  if (rep == 1) return x;
  const Shape s = x.shape();  // a copy: adding nodes may move the graph's
  auto five = reshape(x, {s[0], s[1], 1, s[2], s[3]});
  return reshape(broadcast_to(five, {s[0], s[1], rep, s[2], s[3]}), {s[0], s[1] * rep, s[2], s[3]});
}

Outputs build_llama(Graph& g, std::int64_t batch, const LlamaShape& s, bool with_loss) {
  check_llama(s);
  const std::int64_t b = batch, t = s.seq, d = s.d_model, nh = s.heads, nkv = s.kv_heads, dh = d / nh;
  const std::int64_t tp = s.tp, rep = nh / nkv;
  const bool kv_split = nkv % tp == 0;
  const std::int64_t nh_k = nh / tp, f_k = s.ffn_hidden / tp, v_k = s.vocab / tp;
  auto shard_name = [&](const std::string& name, std::int64_t k) {
    return tp == 1 ? name : fmt::format("{}.tp{}", name, k);
  };
  auto on_shard = [&](std::int64_t k) { return g.shard(tp == 1 ? -1 : static_cast<std::int32_t>(k)); };
  auto weight = [&](const std::string& name, Shape shape) {
    return g.variable(name, std::move(shape), init::normal(0.0, 0.02), s.dtype);
  };
  auto norm = [&](Value x, const std::string& name) {
    return rms_norm(x, g.variable(name, {d}, init::ones(), s.dtype), s.norm_eps);
  };
  auto tokens = g.input("tokens", {b, t}, i32);
  auto targets = g.input("targets", {b * t}, i32);
  std::vector<Value> tables;
  for (std::int64_t k = 0; k < tp; ++k) {
    auto on = on_shard(k);
    tables.push_back(weight(shard_name("model.embed_tokens.weight", k), {v_k, d}));
  }
  Value x = tp == 1 ? embedding(tables[0], tokens) : vocab_parallel_embedding(tables, tokens);  // [b, t, d]
  auto split_heads = [&](Value v, std::int64_t n) {  // [b, t, n dh] -> [b, n, t, dh]
    return transpose(reshape(v, {b, t, n, dh}), {0, 2, 1, 3});
  };
  // attention() takes grouped-query heads as they are (nothing repeated, no sums of the repeats'
  // gradients); the naive composition, and shards that cut a kv head's group apart, need them
  // repeated to one per query head.
  const bool grouped = s.attention != GptShape::Attention::naive;
  auto kv_for_attention = [&](Value kv, bool whole_groups) {
    return grouped && whole_groups ? kv : repeat_kv(kv, rep);
  };
  for (std::int64_t l = 0; l < s.layers; ++l) {
    auto in_block = g.block(static_cast<std::int32_t>(l));  // what --recompute full recomputes
    auto p = [&](const char* what) { return fmt::format("model.layers.{}.{}", l, what); };
    Value h = norm(x, p("input_layernorm.weight"));
    // Keys and values kept whole when their heads do not split over the shards: computed once,
    // and each shard takes what its query heads read. Where a shard's query heads all read one
    // kv head (rep a multiple of nh_k: multi-query heads, or 8 kv heads over tp 16) that head
    // alone; else (the shards cut a kv head's group apart) they are repeated to one per query
    // head and each shard takes its heads' share.
    Value k_all, v_all;
    const bool one_kv_head_a_shard = rep % nh_k == 0;
    if (!kv_split) {
      k_all = kv_for_attention(
          rope(split_heads(matmul(h, weight(p("self_attn.k_proj.weight"), {d, nkv * dh})), nkv), s.rope_base),
          one_kv_head_a_shard);
      v_all = kv_for_attention(split_heads(matmul(h, weight(p("self_attn.v_proj.weight"), {d, nkv * dh})), nkv),
                               one_kv_head_a_shard);
    }
    Value attn;
    for (std::int64_t sk = 0; sk < tp; ++sk) {
      auto on = on_shard(sk);
      auto w = [&](const char* what, Shape shape) { return weight(shard_name(p(what), sk), std::move(shape)); };
      Value q = rope(split_heads(matmul(h, w("self_attn.q_proj.weight", {d, nh_k * dh})), nh_k), s.rope_base);
      Value k, v;
      if (kv_split) {
        const std::int64_t nkv_k = nkv / tp;
        k = kv_for_attention(
            rope(split_heads(matmul(h, w("self_attn.k_proj.weight", {d, nkv_k * dh})), nkv_k), s.rope_base), true);
        v = kv_for_attention(split_heads(matmul(h, w("self_attn.v_proj.weight", {d, nkv_k * dh})), nkv_k), true);
      } else if (grouped && one_kv_head_a_shard) {
        const std::int64_t j = sk * nh_k / rep;  // the kv head of this shard's query heads
        k = slice(k_all, 1, j, j + 1);
        v = slice(v_all, 1, j, j + 1);
      } else {
        k = slice(k_all, 1, sk * nh_k, (sk + 1) * nh_k);
        v = slice(v_all, 1, sk * nh_k, (sk + 1) * nh_k);
      }
      Value heads;  // [b, nh_k, t, dh]
      if (s.attention != GptShape::Attention::naive) {
        heads = attention(q, k, v, attention_options(s.attention));  // causal, scaled by 1/sqrt(dh)
      } else {
        auto q3 = reshape(q, {b * nh_k, t, dh}), k3 = reshape(k, {b * nh_k, t, dh}), v3 = reshape(v, {b * nh_k, t, dh});
        auto core = g.attention_core();  // the T x T scores: what --recompute selective recomputes
        auto att = softmax(causal_mask(matmul(q3, k3, false, true) * (1.0 / std::sqrt(static_cast<double>(dh)))));
        heads = reshape(matmul(att, v3), {b, nh_k, t, dh});
      }
      auto o = reshape(transpose(heads, {0, 2, 1, 3}), {b, t, nh_k * dh});
      Value part = matmul(o, w("self_attn.o_proj.weight", {nh_k * dh, d}));
      attn = sk == 0 ? part : tp_sum_link(attn + part, sk, tp);  // one NCCL all-reduce on GPUs
    }
    x = x + attn;
    Value h2 = norm(x, p("post_attention_layernorm.weight"));
    Value mlp;
    for (std::int64_t sk = 0; sk < tp; ++sk) {
      auto on = on_shard(sk);
      auto w = [&](const char* what, Shape shape) { return weight(shard_name(p(what), sk), std::move(shape)); };
      // gate (w1) and up (w3) by columns, down (w2) by rows: SwiGLU is elementwise in between.
      Value part = swiglu(h2, w("mlp.gate_proj.weight", {d, f_k}), w("mlp.up_proj.weight", {d, f_k}),
                          w("mlp.down_proj.weight", {f_k, d}));
      mlp = sk == 0 ? part : tp_sum_link(mlp + part, sk, tp);
    }
    x = x + mlp;
  }
  Value xf = norm(x, "model.norm.weight");
  std::vector<Value> logits;
  for (std::int64_t k = 0; k < tp; ++k) {
    auto on = on_shard(k);
    // Tied: the head is the token table transposed, and shard k's table rows are its classes.
    Value y = s.tie_embeddings ? matmul(xf, tables[static_cast<std::size_t>(k)], false, true)
                               : matmul(xf, weight(shard_name("lm_head.weight", k), {d, v_k}));
    logits.push_back(reshape(y, {b * t, v_k}));
  }
  Outputs out;
  out.logits = (tp == 1 ? logits[0] : concat(logits, 1)).named("logits");
  if (with_loss) {
    out.loss = tp == 1 ? softmax_cross_entropy(out.logits, targets) : vocab_parallel_cross_entropy(logits, targets);
  }
  return out;
}

}  // namespace

Value llama(Graph& g, std::int64_t batch, const LlamaShape& s) { return build_llama(g, batch, s, false).logits; }

Outputs llama_with_loss(Graph& g, std::int64_t batch, const LlamaShape& s) { return build_llama(g, batch, s, true); }

namespace {

Outputs build_gpt2(Graph& g, std::int64_t batch, const Gpt2Shape& s, bool with_loss) {
  const std::int64_t b = batch, t = s.seq, d = s.d_model, nh = s.heads;
  const std::int64_t positions = s.positions == 0 ? s.seq : s.positions;
  if (nh < 1 || d % nh != 0) throw GraphError(fmt::format("gpt2: d_model {} is not a multiple of heads {}", d, nh));
  if (positions < t) throw GraphError(fmt::format("gpt2: {} positions cannot hold seq {}", positions, t));
  const std::int64_t dh = d / nh;
  auto weight = [&](const std::string& name, Shape shape) {
    return g.variable(name, std::move(shape), init::normal(0.0, 0.02), s.dtype);
  };
  auto zeros = [&](const std::string& name, std::int64_t n) { return g.variable(name, {n}, init::zeros(), s.dtype); };
  auto norm = [&](Value x, const std::string& name) {
    return layer_norm(x, g.variable(name + ".weight", {d}, init::ones(), s.dtype), zeros(name + ".bias", d), s.norm_eps);
  };
  auto linear = [&](Value x, const std::string& name, std::int64_t in, std::int64_t out) {  // Conv1D: x w + b
    return matmul(x, weight(name + ".weight", {in, out})) + zeros(name + ".bias", out);
  };
  auto tokens = g.input("tokens", {b, t}, i32);
  auto targets = g.input("targets", {b * t}, i32);
  Value wte = weight("wte.weight", {s.vocab, d});
  Value wpe = weight("wpe.weight", {positions, d});
  Value x = embedding(wte, tokens) + (positions == t ? wpe : slice(wpe, 0, 0, t));  // [b, t, d]
  auto split_heads = [&](Value v) { return transpose(reshape(v, {b, t, nh, dh}), {0, 2, 1, 3}); };
  for (std::int64_t l = 0; l < s.layers; ++l) {
    const std::string p = fmt::format("h.{}.", l);
    Value qkv = linear(norm(x, p + "ln_1"), p + "attn.c_attn", d, 3 * d);  // [b, t, 3 d]: q | k | v
    Value q = split_heads(slice(qkv, 2, 0, d)), k = split_heads(slice(qkv, 2, d, 2 * d)),
          v = split_heads(slice(qkv, 2, 2 * d, 3 * d));
    Value heads;  // [b, nh, t, dh]
    if (s.attention != GptShape::Attention::naive) {
      heads = attention(q, k, v, attention_options(s.attention));
    } else {
      auto q3 = reshape(q, {b * nh, t, dh}), k3 = reshape(k, {b * nh, t, dh}), v3 = reshape(v, {b * nh, t, dh});
      auto att = softmax(causal_mask(matmul(q3, k3, false, true) * (1.0 / std::sqrt(static_cast<double>(dh)))));
      heads = reshape(matmul(att, v3), {b, nh, t, dh});
    }
    x = x + linear(reshape(transpose(heads, {0, 2, 1, 3}), {b, t, d}), p + "attn.c_proj", d, d);
    // gelu_new(x w + b) as one op, bias_gelu: under autocast the bias joins the bf16 product as
    // torch's Linear adds it, and the plan's epilogues make the product, the bias and the GELU
    // one cuBLASLt product (forward and backward).
    Value h = bias_gelu(matmul(norm(x, p + "ln_2"), weight(p + "mlp.c_fc.weight", {d, 4 * d})),
                        zeros(p + "mlp.c_fc.bias", 4 * d), GeluApprox::tanh);
    x = x + linear(h, p + "mlp.c_proj", 4 * d, d);
  }
  Outputs out;
  out.logits = reshape(matmul(norm(x, "ln_f"), wte, false, true), {b * t, s.vocab}).named("logits");
  if (with_loss) out.loss = softmax_cross_entropy(out.logits, targets);
  return out;
}

}  // namespace

Value gpt2(Graph& g, std::int64_t batch, const Gpt2Shape& s) { return build_gpt2(g, batch, s, false).logits; }

Outputs gpt2_with_loss(Graph& g, std::int64_t batch, const Gpt2Shape& s) { return build_gpt2(g, batch, s, true); }

}  // namespace baton::models
