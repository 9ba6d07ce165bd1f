#pragma once
// OpenAI's completions protocol as values
// (https://platform.openai.com/docs/api-reference/completions): a request body parsed into a
// backend Request, and the JSON of the answers, chunks and errors. No sockets here: http.h carries
// these over HTTP.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "backend.h"
#include "metrics.h"

namespace baton::serve {

/// An error in OpenAI's shape, `{"error":{"message","type","param","code"}}`, with its HTTP status.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the request field at fault; "" writes null
  std::string code;   // "" writes null
};

std::string error_json(const ApiError& e);

/// A /v1/completions body, parsed and checked against the model (not yet Backend::check()ed).
struct CompletionParams {
  Request request;  // prompt, max_tokens, sampling, stop; no events
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

/// Parses a /v1/completions body. `default_seed` is the request's seed when it names none.
/// Unknown fields are ignored (OpenAI's clients send extras); a known field of the wrong type, out
/// of range, or not at its neutral value where baton does not support it, is an ApiError naming it.
std::variant<CompletionParams, ApiError> parse_completion(std::string_view body,
                                                          const Backend& backend,
                                                          std::uint64_t default_seed);

/// What every answer to one completion repeats.
struct CompletionMeta {
  std::string id;  // "cmpl-..."
  std::int64_t created = 0;
  std::string model;
};

/// OpenAI's name of a finish: "stop", "length"; null for the others.
const char* finish_reason(Finish f);

/// The non-streamed answer, `object: "text_completion"`.
std::string completion_json(const CompletionMeta& meta, const std::string& text, Finish finish,
                            const Usage& usage);

/// One streamed chunk: `text` with finish_reason `finish` (nullopt: null). With include_usage every
/// chunk carries `"usage": null`, as OpenAI's do.
std::string chunk_json(const CompletionMeta& meta, const std::string& text,
                       std::optional<Finish> finish, bool include_usage);

/// The last chunk under include_usage: no choices, the usage.
std::string usage_chunk_json(const CompletionMeta& meta, const Usage& usage);

/// /v1/models: OpenAI's list with the one model.
std::string models_json(const ModelInfo& info);

/// /healthz: `{"status": status}`, with `"error"` when `error` is not empty.
std::string health_json(const std::string& status, const std::string& error);

/// /api/serve, what the dashboard page (dashboard.h) polls: the engine's state, the recent
/// requests' TTFT and TPOT percentiles, and whether the server drains or failed.
std::string state_json(const ModelInfo& info, const Stats& stats, const Metrics::Recent& recent, bool draining,
                       const std::string& failure);

}  // namespace baton::serve
