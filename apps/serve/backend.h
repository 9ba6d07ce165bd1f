#pragma once
// What baton-serve's HTTP front end (http.h) asks of the engine that generates (engine.h): a
// narrow interface, so that the front end's protocol (OpenAI's completions, server-sent events,
// errors, back-pressure, metrics) is written and tested apart from the model.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace baton::serve {

/// How the next token is drawn (OpenAI's fields of the same names).
struct Sampling {
  double temperature = 1.0;  // 0: greedy (the largest logit; ties to the lowest id)
  double top_p = 1.0;        // nucleus: the smallest set of most likely tokens whose mass >= top_p
  std::uint64_t seed = 0;    // the request's own random stream: the same draws whatever else runs
};

/// Why a request ended: OpenAI's "stop" (a stop string, or the model's end-of-text token) and
/// "length" (max_tokens or the context), or the request went away (its client left: cancelled)
/// or the server failed (failed: the error says why; the front end answers 503).
enum class Finish : std::uint8_t { stop, length, cancelled, failed };

struct Usage {
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
};

/// What the engine tells a request as it goes. Called on the engine's thread, in this order:
/// `started` once (the request joined the running batch: its queue time ends), `token` once per
/// generated token, `finish` exactly once (also for a request that never started). None may
/// block; each may be empty.
struct Events {
  std::function<void()> started;
  /// `text`: what this token adds to the decoded completion (empty while a multi-byte character
  /// or a possible stop string is still incomplete; then it comes with a later token).
  std::function<void(std::int32_t token, const std::string& text)> token;
  /// `error`: the reason, for Finish::failed.
  std::function<void(Finish, Usage, const std::string& error)> finish;
};

struct Request {
  std::vector<std::int32_t> prompt;  // token ids, >= 1
  std::int64_t max_tokens = 16;      // >= 1
  Sampling sampling;
  std::vector<std::string> stop;  // stop strings (text models only); the text ends before them
  Events events;
};

/// The engine's state, for /metrics and /healthz.
struct Stats {
  std::int64_t running = 0;  // requests in the running batch
  std::int64_t waiting = 0;  // admitted, queued for the batch
  double kv_cache_usage = 0;  // fraction of the KV-cache blocks in use, [0, 1]
  std::int64_t kv_cache_tokens = 0;  // the cache's capacity in tokens (all layers hold each)
  std::int64_t steps = 0;            // decode steps run
  std::string weights;               // which weights answer now (a checkpoint's step, a file)
  bool swapping = false;             // new weights wait for the running batch to end
  double busy_seconds = 0;           // time spent in decode steps since the start
  std::int64_t generated_tokens = 0;  // tokens generated since the start
  std::int64_t batch_rows = 0;        // token rows of the last step (decode tokens + prompt chunks)
  /// Per pipeline stage (its shard 0 where tensor-parallel): seconds spent running its part of
  /// the steps since the start. One entry for a model on one device.
  std::vector<double> stage_busy_seconds;
};

/// What a model offers (/v1/models, and the front end's checks).
struct ModelInfo {
  std::string id;               // the model's name in the API ("model" field)
  std::int64_t context = 0;     // the longest prompt + completion, in tokens
  std::int64_t vocab = 0;       // ids are [0, vocab)
  bool text = false;            // prompts may be strings (the model has a tokenizer)
  std::int64_t created = 0;     // seconds since the epoch (the weights' time)
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual ModelInfo info() const = 0;

  /// Text to ids; throws std::invalid_argument saying what cannot be encoded (a model without a
  /// tokenizer: every string).
  virtual std::vector<std::int32_t> encode(const std::string& text) const = 0;

  /// Why `r` cannot be served, naming the field ("prompt", "max_tokens", ...), or "" if it can:
  /// an id outside the vocabulary, a prompt plus max_tokens longer than the context.
  virtual std::string check(const Request& r) const = 0;

  enum class Admission : std::uint8_t { accepted, queue_full, draining };
  /// Queues `r` without blocking (it was check()ed). Returns queue_full when --max-queue
  /// requests already wait, draining once drain() began; then no event is ever called.
  /// Accepted: `id` names it for cancel().
  virtual Admission submit(Request r, std::uint64_t& id) = 0;

  /// The request's client left: it ends (Finish::cancelled) and frees its slot and KV-cache
  /// blocks at the next step. A finished or unknown id is ignored.
  virtual void cancel(std::uint64_t id) = 0;

  virtual Stats stats() const = 0;

  /// Stops admitting (submit answers draining), lets what runs and waits finish, and returns
  /// when nothing is left or at `deadline` (then what is left is cancelled). Idempotent.
  virtual void drain(std::chrono::steady_clock::time_point deadline) = 0;

  /// Set once the engine failed for good (a kernel threw, a rank died): the reason. The front end
  /// then answers every request 503 with it and ends the server.
  virtual std::string failure() const = 0;
};

}  // namespace baton::serve
