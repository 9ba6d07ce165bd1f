// Fuzzes what baton-serve reads from its clients: a /v1/completions body (apps/serve/openai.h).
// Each either parses into a request within OpenAI's ranges or is an error in OpenAI's shape,
// 400 or 404, naming what was wrong; the answers' JSON is written from whatever parsed.
#include <stdexcept>
#include <string>
#include <vector>
#include <string_view>
#include <variant>

#include "openai.h"

namespace {

using namespace baton::serve;

// A model of 50 ids and a 64-token context whose text is bytes ('a' + id); '~' has no id.
class Model final : public Backend {
 public:
  ModelInfo info() const override { return {.id = "m", .context = 64, .vocab = 50, .text = true}; }
  std::vector<std::int32_t> encode(const std::string& text) const override {
    std::vector<std::int32_t> ids;
    for (char c : text) {
      if (c == '~') throw std::invalid_argument("no id for '~'");
      ids.push_back(static_cast<std::int32_t>(static_cast<unsigned char>(c) % 50));
    }
    return ids;
  }
  std::string check(const Request& r) const override {
    return r.prompt.empty() || static_cast<std::int64_t>(r.prompt.size()) + r.max_tokens > 64 ? "prompt: too long" : "";
  }
  Admission submit(Request, std::uint64_t&) override { return Admission::draining; }
  void cancel(std::uint64_t) override {}
  Stats stats() const override { return {}; }
  void drain(std::chrono::steady_clock::time_point) override {}
  std::string failure() const override { return {}; }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const Model model;
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  auto parsed = parse_completion(body, model, 7);
  if (auto* p = std::get_if<CompletionParams>(&parsed)) {
    const Request& r = p->request;
    if (r.max_tokens < 1 || !(r.sampling.temperature >= 0 && r.sampling.temperature <= 2) ||
        !(r.sampling.top_p > 0 && r.sampling.top_p <= 1)) {
      __builtin_trap();  // a request outside OpenAI's ranges got through
    }
    const CompletionMeta meta{.id = "cmpl-x", .created = 1, .model = "m"};
    (void)completion_json(meta, std::string(body.substr(0, 16)), Finish::length, {});
    (void)chunk_json(meta, std::string(body.substr(0, 16)), std::nullopt, p->include_usage);
  } else {
    const ApiError& e = std::get<ApiError>(parsed);
    if ((e.status != 400 && e.status != 404) || e.message.empty()) __builtin_trap();
    (void)error_json(e);
  }
  return 0;
}
