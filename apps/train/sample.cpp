#include "sample.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

#include <fmt/format.h>

namespace baton::sample {

std::int32_t draw(const float* logits, std::int64_t vocab, double temperature, double u) {
  const float* best = std::max_element(logits, logits + vocab);
  if (temperature == 0) return static_cast<std::int32_t>(best - logits);
  // Softmax in double, shifted by the largest logit so that no exp overflows.
  std::vector<double> weight(static_cast<std::size_t>(vocab));
  double total = 0;
  for (std::int64_t i = 0; i < vocab; ++i) {
    weight[static_cast<std::size_t>(i)] =
        std::exp((static_cast<double>(logits[i]) - *best) / temperature);
    total += weight[static_cast<std::size_t>(i)];
  }
  double target = u * total, seen = 0;
  for (std::int64_t i = 0; i < vocab; ++i) {
    seen += weight[static_cast<std::size_t>(i)];
    if (target < seen) return static_cast<std::int32_t>(i);
  }
  // u * total rounded up to total: the last token with any weight.
  for (std::int64_t i = vocab - 1; i > 0; --i) {
    if (weight[static_cast<std::size_t>(i)] > 0) return static_cast<std::int32_t>(i);
  }
  return 0;
}

std::int32_t draw(const float* logits, std::int64_t vocab, double temperature, double top_p, double u) {
  if (temperature == 0 || top_p >= 1) return draw(logits, vocab, temperature, u);
  const float best = *std::max_element(logits, logits + vocab);
  std::vector<std::pair<double, std::int32_t>> weight(static_cast<std::size_t>(vocab));
  double total = 0;
  for (std::int64_t i = 0; i < vocab; ++i) {
    const double w = std::exp((static_cast<double>(logits[i]) - best) / temperature);
    weight[static_cast<std::size_t>(i)] = {w, static_cast<std::int32_t>(i)};
    total += w;
  }
  // Most likely first, ties to the lower id (a stable order on every machine).
  std::sort(weight.begin(), weight.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  double kept = 0;
  std::size_t n = 0;
  while (n < weight.size() && (n == 0 || kept < top_p * total)) kept += weight[n++].first;
  const double target = u * kept;
  double seen = 0;
  for (std::size_t i = 0; i < n; ++i) {
    seen += weight[i].first;
    if (target < seen) return weight[i].second;
  }
  return weight[n - 1].second;
}

double uniform(std::uint64_t draw_bits) { return static_cast<double>(draw_bits >> 11) * 0x1.0p-53; }

namespace {

void check(std::int64_t seq, std::int64_t vocab, const std::vector<std::int32_t>& prompt,
           const Settings& s) {
  if (s.tokens < 1)
    throw std::invalid_argument(fmt::format("sample: tokens must be >= 1, not {}", s.tokens));
  if (!(s.temperature >= 0) || !std::isfinite(s.temperature)) {
    throw std::invalid_argument(fmt::format(
        "sample: temperature must be a finite number >= 0 (0: greedy), not {}", s.temperature));
  }
  if (seq < 1 || vocab < 1)
    throw std::invalid_argument(
        fmt::format("sample: seq {} and vocab {} must be >= 1", seq, vocab));
  if (prompt.empty())
    throw std::invalid_argument("sample: the prompt is empty (it needs at least one token)");
  for (std::size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= vocab) {
      throw std::invalid_argument(fmt::format(
          "sample: prompt token {} is id {}, outside the vocabulary [0, {})", i, prompt[i], vocab));
    }
  }
}

}  // namespace

std::vector<std::int32_t> generate(const BuildLogits& build, std::int64_t seq, std::int64_t vocab,
                                   const ParameterStore& params,
                                   const std::vector<std::int32_t>& prompt, const Settings& s) {
  check(seq, vocab, prompt, s);
  Graph g;
  const Value logits = build(g);
  if (logits.shape() != Shape{seq, vocab}) {
    throw std::invalid_argument(
        fmt::format("sample: the model's logits at batch 1 are {}, expected [{}, {}]",
                    to_string(logits.shape()), seq, vocab));
  }
  // mt19937_64's output is fixed by the standard (unlike the distributions'), and the top 53
  // bits make a double in [0, 1): the same draws on every machine and library.
  std::mt19937_64 rng(s.seed);
  std::vector<std::int32_t> context = prompt, out;
  Tensor window = Tensor::empty({1, seq}, DType::i32);
  for (std::int64_t k = 0; k < s.tokens; ++k) {
    // The last seq tokens; a shorter context is padded after its end with its last token,
    // which a causal model's earlier positions do not see.
    const auto n = static_cast<std::int64_t>(
        std::min<std::size_t>(context.size(), static_cast<std::size_t>(seq)));
    auto ids = window.data<std::int32_t>();
    for (std::int64_t i = 0; i < seq; ++i) {
      ids[static_cast<std::size_t>(i)] = context[context.size() - static_cast<std::size_t>(n) +
                                                 static_cast<std::size_t>(std::min(i, n - 1))];
    }
    const Tensor out_logits = evaluate(g, {{"tokens", window}}, {logits}, params)[0];
    const float* row = out_logits.data<float>().data() + (n - 1) * vocab;
    const double u = uniform(rng());
    const std::int32_t next = draw(row, vocab, s.temperature, u);
    context.push_back(next);
    out.push_back(next);
  }
  return out;
}

}  // namespace baton::sample
