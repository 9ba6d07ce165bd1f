#pragma once
/// Text from a trained language model: the GPT or Llama of models.h run forward on the CPU one
/// token at a time (autoregressive sampling), as baton-train --sample does after training.
///
///   baton::sample::Settings s{.tokens = 200, .temperature = 0.8, .seed = 1};
///   auto ids = baton::sample::generate(
///       [&](baton::Graph& g) { return baton::models::gpt(g, 1, shape); }, shape.seq, shape.vocab,
///       *job.params, prompt_ids, s);
///
/// Each step evaluates the model at batch 1 on the last `seq` tokens of the context (the prompt
/// and what was drawn so far; shorter contexts are padded at the end, which a causal model's
/// earlier positions never see) and draws the next token from the logits at the context's last
/// position. There is no KV cache: at a demo's size the full forward pass per token is cheap,
/// and the result is the same.
#include <cstdint>
#include <functional>
#include <vector>

#include "baton/graph.h"

namespace baton::sample {

struct Settings {
  /// Tokens to generate (>= 1).
  std::int64_t tokens = 100;
  /// Softmax temperature (>= 0): logits / temperature. 0 is greedy (the most likely token,
  /// the lowest id on a tie).
  double temperature = 1.0;
  /// The draws' seed: the same seed, weights and prompt give the same tokens.
  std::uint64_t seed = 1;
};

/// Builds the model's logits at batch 1 into `g`: input "tokens" i32 [1, seq], logits
/// [seq, vocab] (the model's weights named as in training).
using BuildLogits = std::function<Value(Graph& g)>;

/// Generates `s.tokens` ids after `prompt` with the weights in `params` and returns them (the
/// prompt not included). Throws std::invalid_argument naming what is wrong: an empty prompt, an
/// id outside [0, vocab), tokens < 1, a negative or non-finite temperature, logits of another
/// shape than [seq, vocab].
std::vector<std::int32_t> generate(const BuildLogits& build, std::int64_t seq, std::int64_t vocab,
                                   const ParameterStore& params,
                                   const std::vector<std::int32_t>& prompt, const Settings& s);

/// The index drawn from softmax(logits / temperature) by the uniform number u in [0, 1) (the
/// inverse of the distribution function), or the first largest logit when temperature is 0.
std::int32_t draw(const float* logits, std::int64_t vocab, double temperature, double u);

/// The same with nucleus sampling (Holtzman et al. 2019; OpenAI's top_p): only the most likely
/// tokens whose probabilities first add up to >= top_p (in (0, 1]) may be drawn, renormalised;
/// u picks among them from the most likely down (ties: the lower id first). top_p = 1 is draw()
/// above, token for token.
std::int32_t draw(const float* logits, std::int64_t vocab, double temperature, double top_p, double u);

/// The next uniform number in [0, 1) of a request's stream: mt19937_64's output is fixed by the
/// standard (unlike the distributions'), and its top 53 bits make a double, so the same seed
/// draws the same numbers on every machine and library.
double uniform(std::uint64_t draw_bits);

}  // namespace baton::sample
