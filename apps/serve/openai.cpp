#include "openai.h"

#include <limits>
#include <stdexcept>

#include <fmt/format.h>

// Boost.JSON's implementation is compiled once, in baton::transport (control.cpp), which this
// library links: never include <boost/json/src.hpp> here (the linker would see it twice).
#include <boost/json.hpp>

namespace baton::serve {

namespace json = boost::json;

namespace {

/// The most stop strings OpenAI accepts.
constexpr std::size_t max_stop_strings = 4;

ApiError bad(std::string param, std::string message, std::string code = {}) {
  return ApiError{.status = 400,
                  .message = std::move(message),
                  .param = std::move(param),
                  .code = std::move(code)};
}

ApiError wrong_type(const std::string& field, const char* expected) {
  return bad(field, fmt::format("Invalid type for '{}': expected {}.", field, expected),
             "invalid_type");
}

ApiError unsupported(const std::string& field, const char* neutral) {
  return bad(
      field,
      fmt::format("'{}' is not supported by this server: leave it out or send {}.", field, neutral),
      "unsupported_parameter");
}

/// The field, or nullptr when absent or null (OpenAI's clients send null for "not set").
const json::value* field(const json::object& o, std::string_view name) {
  const json::value* v = o.if_contains(name);
  return v != nullptr && !v->is_null() ? v : nullptr;
}

std::optional<std::int64_t> as_integer(const json::value& v) {
  if (v.is_int64()) return v.get_int64();
  if (v.is_uint64() &&
      v.get_uint64() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
    return static_cast<std::int64_t>(v.get_uint64());
  }
  return std::nullopt;
}

std::optional<double> as_number(const json::value& v) {
  if (v.is_double()) return v.get_double();
  if (v.is_int64()) return static_cast<double>(v.get_int64());
  if (v.is_uint64()) return static_cast<double>(v.get_uint64());
  return std::nullopt;
}

/// Token ids from a JSON array of integers; nullopt if any element is not an int32.
std::optional<std::vector<std::int32_t>> token_ids(const json::array& a) {
  std::vector<std::int32_t> ids;
  ids.reserve(a.size());
  for (const json::value& v : a) {
    const auto id = as_integer(v);
    if (!id || *id > std::numeric_limits<std::int32_t>::max()) return std::nullopt;
    ids.push_back(static_cast<std::int32_t>(*id));
  }
  return ids;
}

std::optional<ApiError> parse_text_prompt(const std::string& text, const Backend& backend,
                                          Request& r) {
  if (!backend.info().text) {
    return bad("prompt", "This model has no tokenizer: send the prompt as an array of token ids.");
  }
  try {
    r.prompt = backend.encode(text);
  } catch (const std::invalid_argument& e) {
    return bad("prompt", e.what());
  }
  return std::nullopt;
}

/// `prompt`: a string, an array of token ids, or an array of one of these (a batch of one).
std::optional<ApiError> parse_prompt(const json::object& o, const Backend& backend, Request& r) {
  const json::value* p = field(o, "prompt");
  if (p == nullptr) return bad("prompt", "'prompt' is required.");
  if (p->is_string()) {
    if (auto e = parse_text_prompt(std::string(p->get_string()), backend, r)) return e;
  } else if (p->is_array()) {
    const json::array& a = p->get_array();
    const bool nested = !a.empty() && (a[0].is_string() || a[0].is_array());
    if (nested && a.size() > 1) {
      return bad("prompt",
                 "Batch prompts (an array of several prompts) are not supported: send one prompt "
                 "per request.");
    }
    if (nested && a[0].is_string()) {
      if (auto e = parse_text_prompt(std::string(a[0].get_string()), backend, r)) return e;
    } else {
      auto ids = token_ids(nested ? a[0].get_array() : a);
      if (!ids) return wrong_type("prompt", "a string, or an array of integer token ids");
      r.prompt = std::move(*ids);
    }
  } else {
    return wrong_type("prompt", "a string, or an array of integer token ids");
  }
  if (r.prompt.empty()) return bad("prompt", "The prompt is empty: it needs at least one token.");
  return std::nullopt;
}

std::optional<ApiError> parse_stop(const json::object& o, Request& r) {
  const json::value* s = field(o, "stop");
  if (s == nullptr) return std::nullopt;
  if (s->is_string()) {
    if (!s->get_string().empty()) r.stop.emplace_back(s->get_string());
    return std::nullopt;
  }
  if (!s->is_array()) return wrong_type("stop", "a string or an array of strings");
  const json::array& a = s->get_array();
  if (a.size() > max_stop_strings)
    return bad("stop", fmt::format("At most {} stop strings.", max_stop_strings));
  for (const json::value& v : a) {
    if (!v.is_string()) return wrong_type("stop", "a string or an array of strings");
    if (!v.get_string().empty()) r.stop.emplace_back(v.get_string());
  }
  return std::nullopt;
}

std::optional<ApiError> parse_sampling(const json::object& o, Request& r) {
  if (const json::value* v = field(o, "max_tokens")) {
    const auto n = as_integer(*v);
    if (!v->is_int64() && !v->is_uint64()) return wrong_type("max_tokens", "an integer");
    if (!n || *n < 1) return bad("max_tokens", "'max_tokens' must be at least 1.", "invalid_value");
    r.max_tokens = *n;
  }
  if (const json::value* v = field(o, "temperature")) {
    const auto t = as_number(*v);
    if (!t) return wrong_type("temperature", "a number");
    if (!(*t >= 0 && *t <= 2))
      return bad("temperature", "'temperature' must be in [0, 2].", "invalid_value");
    r.sampling.temperature = *t;
  }
  if (const json::value* v = field(o, "top_p")) {
    const auto p = as_number(*v);
    if (!p) return wrong_type("top_p", "a number");
    if (!(*p > 0 && *p <= 1)) return bad("top_p", "'top_p' must be in (0, 1].", "invalid_value");
    r.sampling.top_p = *p;
  }
  if (const json::value* v = field(o, "seed")) {
    if (v->is_int64()) {
      r.sampling.seed = static_cast<std::uint64_t>(v->get_int64());
    } else if (v->is_uint64()) {
      r.sampling.seed = v->get_uint64();
    } else {
      return wrong_type("seed", "an integer");
    }
  }
  return std::nullopt;
}

/// The fields baton accepts only at their neutral values (what a client sends by default).
std::optional<ApiError> parse_neutral_fields(const json::object& o) {
  if (const json::value* v = field(o, "n")) {
    if (!as_integer(*v)) return wrong_type("n", "an integer");
    if (*as_integer(*v) != 1) return unsupported("n", "1");
  }
  if (const json::value* v = field(o, "best_of")) {
    if (!as_integer(*v)) return wrong_type("best_of", "an integer");
    if (*as_integer(*v) != 1) return unsupported("best_of", "1");
  }
  if (const json::value* v = field(o, "echo")) {
    if (!v->is_bool()) return wrong_type("echo", "a boolean");
    if (v->get_bool()) return unsupported("echo", "false");
  }
  if (const json::value* v = field(o, "logprobs")) {
    if (!as_integer(*v)) return wrong_type("logprobs", "an integer or null");
    return unsupported("logprobs", "null");
  }
  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    if (const json::value* v = field(o, name)) {
      const auto x = as_number(*v);
      if (!x) return wrong_type(name, "a number");
      if (*x != 0) return unsupported(name, "0");
    }
  }
  if (const json::value* v = field(o, "logit_bias")) {
    if (!v->is_object()) return wrong_type("logit_bias", "an object");
    if (!v->get_object().empty()) return unsupported("logit_bias", "{}");
  }
  if (const json::value* v = field(o, "suffix")) {
    if (!v->is_string()) return wrong_type("suffix", "a string");
    if (!v->get_string().empty()) return unsupported("suffix", "null");
  }
  if (const json::value* v = field(o, "user"); v != nullptr && !v->is_string())
    return wrong_type("user", "a string");
  return std::nullopt;
}

std::optional<ApiError> parse_streaming(const json::object& o, CompletionParams& out) {
  if (const json::value* v = field(o, "stream")) {
    if (!v->is_bool()) return wrong_type("stream", "a boolean");
    out.stream = v->get_bool();
  }
  if (const json::value* v = field(o, "stream_options")) {
    if (!v->is_object()) return wrong_type("stream_options", "an object");
    if (const json::value* u = field(v->get_object(), "include_usage")) {
      if (!u->is_bool()) return wrong_type("stream_options.include_usage", "a boolean");
      out.include_usage = u->get_bool();
    }
  }
  return std::nullopt;
}

std::optional<ApiError> parse_model(const json::object& o, const Backend& backend) {
  const json::value* m = field(o, "model");
  if (m == nullptr) return bad("model", "'model' is required.");
  if (!m->is_string()) return wrong_type("model", "a string");
  const std::string id = backend.info().id;
  if (m->get_string() != id) {
    ApiError e = bad("model",
                     fmt::format("The model '{}' does not exist; this server serves '{}'.",
                                 std::string_view(m->get_string()), id),
                     "model_not_found");
    e.status = 404;
    return e;
  }
  return std::nullopt;
}

json::value nullable(const std::string& s) {
  return s.empty() ? json::value(nullptr) : json::value(s);
}

json::object usage_object(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

json::object base_object(const CompletionMeta& meta) {
  return {{"id", meta.id},
          {"object", "text_completion"},
          {"created", meta.created},
          {"model", meta.model}};
}

json::value reason_value(std::optional<Finish> f) {
  const char* reason = f ? finish_reason(*f) : nullptr;
  return reason != nullptr ? json::value(reason) : json::value(nullptr);
}

}  // namespace

std::string error_json(const ApiError& e) {
  json::object err{{"message", e.message},
                   {"type", e.type},
                   {"param", nullable(e.param)},
                   {"code", nullable(e.code)}};
  return json::serialize(json::object{{"error", std::move(err)}});
}

std::variant<CompletionParams, ApiError> parse_completion(std::string_view body,
                                                          const Backend& backend,
                                                          std::uint64_t default_seed) {
  boost::system::error_code ec;
  const json::value doc = json::parse(body, ec);
  if (ec) return bad("", fmt::format("The body is not valid JSON: {}.", ec.message()));
  if (!doc.is_object()) return bad("", "The body must be a JSON object.");
  const json::object& o = doc.get_object();
  CompletionParams out;
  out.request.sampling.seed = default_seed;
  // The model first, as OpenAI answers an unknown model before anything else.
  if (auto e = parse_model(o, backend)) return *e;
  if (auto e = parse_neutral_fields(o)) return *e;
  if (auto e = parse_sampling(o, out.request)) return *e;
  if (auto e = parse_stop(o, out.request)) return *e;
  if (auto e = parse_streaming(o, out)) return *e;
  if (auto e = parse_prompt(o, backend, out.request)) return *e;
  return out;
}

const char* finish_reason(Finish f) {
  switch (f) {
    case Finish::stop:
      return "stop";
    case Finish::length:
      return "length";
    default:
      return nullptr;
  }
}

std::string completion_json(const CompletionMeta& meta, const std::string& text, Finish finish,
                            const Usage& usage) {
  json::object o = base_object(meta);
  json::object choice{
      {"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", reason_value(finish)}};
  o["choices"] = json::array{std::move(choice)};
  o["usage"] = usage_object(usage);
  return json::serialize(o);
}

std::string chunk_json(const CompletionMeta& meta, const std::string& text,
                       std::optional<Finish> finish, bool include_usage) {
  json::object o = base_object(meta);
  json::object choice{
      {"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", reason_value(finish)}};
  o["choices"] = json::array{std::move(choice)};
  if (include_usage) o["usage"] = nullptr;
  return json::serialize(o);
}

std::string usage_chunk_json(const CompletionMeta& meta, const Usage& usage) {
  json::object o = base_object(meta);
  o["choices"] = json::array{};
  o["usage"] = usage_object(usage);
  return json::serialize(o);
}

std::string models_json(const ModelInfo& info) {
  json::object model{
      {"id", info.id}, {"object", "model"}, {"created", info.created}, {"owned_by", "baton"}};
  return json::serialize(json::object{{"object", "list"}, {"data", json::array{std::move(model)}}});
}

std::string health_json(const std::string& status, const std::string& error) {
  json::object o{{"status", status}};
  if (!error.empty()) o["error"] = error;
  return json::serialize(o);
}

std::string state_json(const ModelInfo& info, const Stats& s, const Metrics::Recent& recent, bool draining,
                       const std::string& failure) {
  json::object o{{"model", info.id},
                 {"context", info.context},
                 {"running", s.running},
                 {"waiting", s.waiting},
                 {"kv_cache_usage", s.kv_cache_usage},
                 {"kv_cache_tokens", s.kv_cache_tokens},
                 {"steps", s.steps},
                 {"batch_rows", s.batch_rows},
                 {"busy_seconds", s.busy_seconds},
                 {"generated_tokens", s.generated_tokens},
                 {"weights", s.weights},
                 {"swapping", s.swapping},
                 {"draining", draining},
                 {"failure", failure},
                 {"ttft_p50_s", recent.ttft_p50},
                 {"ttft_p99_s", recent.ttft_p99},
                 {"tpot_p50_s", recent.tpot_p50},
                 {"tpot_p99_s", recent.tpot_p99},
                 {"requests_recent", recent.tpot_samples}};
  json::array stages;
  for (double b : s.stage_busy_seconds) stages.push_back(b);
  o["stage_busy_seconds"] = std::move(stages);
  return json::serialize(o);
}

}  // namespace baton::serve
