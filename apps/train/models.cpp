#include "models.h"

#include <cmath>
#include <string>

#include <fmt/format.h>

namespace baton::models {

Value mlp(Graph& g, std::int64_t batch, const MlpShape& s) {
  Value h = g.input("x", {batch, s.inputs});
  g.input("label", {batch}, i32);
  std::int64_t width = s.inputs;
  if (s.tp < 1 || (s.tp > 1 && s.hidden % s.tp != 0)) {
    throw GraphError(fmt::format("mlp: hidden {} is not divisible by tp {}", s.hidden, s.tp));
  }
  for (std::int64_t l = 0; l < s.layers; ++l) {
    if (s.tp > 1 && l + 1 < s.layers) {
      // A pair: column-parallel, then row-parallel; one sum of the partial products.
      const std::int64_t part = s.hidden / s.tp;
      Value sum;
      for (std::int64_t k = 0; k < s.tp; ++k) {
        auto on = g.shard(static_cast<std::int32_t>(k));
        auto w1 = g.variable(fmt::format("fc{}.w.tp{}", l, k), {width, part}, init::kaiming());
        auto b1 = g.variable(fmt::format("fc{}.b.tp{}", l, k), {part}, init::zeros());
        auto w2 = g.variable(fmt::format("fc{}.w.tp{}", l + 1, k), {part, s.hidden}, init::kaiming());
        Value partial = matmul(relu(matmul(h, w1) + b1), w2);
        sum = k == 0 ? partial : sum + partial;
      }
      auto b2 = g.variable(fmt::format("fc{}.b", l + 1), {s.hidden}, init::zeros());
      h = relu(sum + b2);
      width = s.hidden;
      ++l;
      continue;
    }
    auto w = g.variable(fmt::format("fc{}.w", l), {width, s.hidden}, init::kaiming());
    auto b = g.variable(fmt::format("fc{}.b", l), {s.hidden}, init::zeros());
    h = relu(matmul(h, w) + b);
    width = s.hidden;
  }
  auto w = g.variable("out.w", {width, s.classes}, init::kaiming());
  auto b = g.variable("out.b", {s.classes}, init::zeros());
  return (matmul(h, w) + b).named("logits");
}

Value gpt(Graph& g, std::int64_t batch, const GptShape& s) {
  const std::int64_t b = batch, t = s.seq, d = s.d_model, nh = s.heads, dh = s.d_model / s.heads;
  if (d % nh != 0) throw GraphError(fmt::format("d_model {} is not a multiple of heads {}", d, nh));
  auto tokens = g.input("tokens", {b, t}, i32);
  g.input("targets", {b * t}, i32);
  auto wte = g.variable("wte", {s.vocab, d}, init::normal(0.0, 0.02));
  auto wpe = g.variable("wpe", {t, d}, init::normal(0.0, 0.02));
  Value x = embedding(wte, tokens) + wpe;  // [b, t, d]
  auto heads = [&](Value v) {              // [b, t, d] -> [b * nh, t, dh]
    return reshape(transpose(reshape(v, {b, t, nh, dh}), {0, 2, 1, 3}), {b * nh, t, dh});
  };
  for (std::int64_t l = 0; l < s.layers; ++l) {
    auto p = [&](const char* what) { return fmt::format("h{}.{}", l, what); };
    auto ln1 = layer_norm(x, g.variable(p("ln1.g"), {d}, init::ones()), g.variable(p("ln1.b"), {d}, init::zeros()));
    auto q = heads(matmul(ln1, g.variable(p("attn.wq"), {d, d}, init::normal(0.0, 0.02))));
    auto k = heads(matmul(ln1, g.variable(p("attn.wk"), {d, d}, init::normal(0.0, 0.02))));
    auto v = heads(matmul(ln1, g.variable(p("attn.wv"), {d, d}, init::normal(0.0, 0.02))));
    auto att = softmax(causal_mask(matmul(q, k, false, true) * (1.0 / std::sqrt(static_cast<double>(dh)))));
    auto o = reshape(transpose(reshape(matmul(att, v), {b, nh, t, dh}), {0, 2, 1, 3}), {b, t, d});
    x = x + matmul(o, g.variable(p("attn.wo"), {d, d}, init::normal(0.0, 0.02)));
    auto ln2 = layer_norm(x, g.variable(p("ln2.g"), {d}, init::ones()), g.variable(p("ln2.b"), {d}, init::zeros()));
    auto fc = gelu(matmul(ln2, g.variable(p("mlp.w1"), {d, 4 * d}, init::normal(0.0, 0.02))) +
                   g.variable(p("mlp.b1"), {4 * d}, init::zeros()));
    x = x + matmul(fc, g.variable(p("mlp.w2"), {4 * d, d}, init::normal(0.0, 0.02))) +
        g.variable(p("mlp.b2"), {d}, init::zeros());
  }
  auto lnf = layer_norm(x, g.variable("lnf.g", {d}, init::ones()), g.variable("lnf.b", {d}, init::zeros()));
  auto logits = matmul(lnf, g.variable("head.w", {d, s.vocab}, init::normal(0.0, 0.02)));
  return reshape(logits, {b * t, s.vocab}).named("logits");
}

}  // namespace baton::models
