// baton-serve as a user runs it: the binary on imported tiny GPT-2 and Llama weights answers with
// PyTorch's greedy tokens; on a baton-train checkpoint it answers text, and follows the training
// job's new checkpoints (--watch) under load without failing a request; SIGTERM lets a running
// stream finish, then exits 0.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mp/proc.h"
#include "serve/raw_http.h"
#include "serve/node_client.h"
#include "skip.h"

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using baton::test::Proc;

namespace {

const std::string key = "test-key-0123456789abcdef";

fs::path scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / fmt::format("baton-serve-tests-{}", ::getpid());
    fs::create_directories(d);
    return d;
  }();
  static const struct Cleanup {
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup;
  return dir;
}

std::string http(std::uint16_t port, const std::string& method, const std::string& target, const std::string& body,
                 std::chrono::milliseconds timeout = 30s, const std::string& until = {},
                 const std::function<void(const std::string&)>& on_data = {}) {
  return baton::test::raw_http_request(port, key, method, target, body, timeout, until, on_data);
}

std::vector<int> ints_after(const std::string& text, const std::string& key_text) {
  std::vector<int> out;
  const auto at = text.find(key_text);
  if (at == std::string::npos) return out;
  const auto end = text.find(']', at);
  std::stringstream list(text.substr(at + key_text.size(), end - at - key_text.size()));
  for (std::string item; std::getline(list, item, ',');) out.push_back(std::stoi(item));
  return out;
}

std::vector<double> doubles_after(const std::string& text, const std::string& key_text) {
  std::vector<double> out;
  const auto at = text.find(key_text);
  if (at == std::string::npos) return out;
  const auto end = text.find(']', at);
  std::stringstream list(text.substr(at + key_text.size(), end - at - key_text.size()));
  for (std::string item; std::getline(list, item, ',');) out.push_back(std::stod(item));
  return out;
}

std::string text_of(const std::string& reply) { return baton::test::completion_text(reply); }

/// Starts baton-serve with `args` on a free port (under baton-launch with `launch` before it, if
/// given); returns once it says it serves.
std::unique_ptr<Proc> start_server(std::vector<std::string> args, std::uint16_t& port,
                                   std::vector<std::string> launch = {}) {
  port = baton::test::free_port();
  args.insert(args.begin(), std::string(BATON_BIN_DIR) + "/baton-serve");
  args.insert(args.begin(), launch.begin(), launch.end());
  args.insert(args.end(), {"--listen", fmt::format("127.0.0.1:{}", port), "--api-key", key});
  auto p = std::make_unique<Proc>(args);
  const bool up = p->read_until([](const std::string&, const std::string& err) {
    return err.find("serving '") != std::string::npos || err.find("error:") != std::string::npos;
  }, 60s);
  INFO(p->err());
  REQUIRE(up);
  REQUIRE(p->err().find("serving '") != std::string::npos);
  return p;
}

/// baton-train's GPT on a repeating line of text, checkpoints in `dir`/ckpt (resumed from there).
void train_fox(const fs::path& dir, int steps, bool resume, int layers = 1) {
  fs::create_directories(dir);
  const fs::path text = dir / "fox.txt", ckpt = dir / "ckpt";
  if (!fs::exists(text) && !fs::exists(dir / "moved.txt")) {
    std::ofstream out(text);
    for (int i = 0; i < 100; ++i) out << "the quick brown fox jumps over the lazy dog. ";
  }
  std::vector<std::string> args{std::string(BATON_BIN_DIR) + "/baton-train", "--model", "gpt", "--data",
                                "text:" + text.string(), "--steps", std::to_string(steps), "--batch", "16", "--seq",
                                "32", "--d-model", "32", "--heads", "4", "--layers", std::to_string(layers), "--checkpoint-dir",
                                ckpt.string()};
  if (resume) args.insert(args.end(), {"--resume", ckpt.string()});
  Proc p(args);
  const int rc = p.wait(240s);
  INFO(p.all());
  REQUIRE(rc == 0);
}

bool torch_available() {
  Proc p({"/usr/bin/python3", "-c", "import torch"});
  return p.wait(60s) == 0;
}

}  // namespace

TEST_CASE("Serve.BinaryOnImportedGpt2AndLlamaGivesPyTorchsGreedyTokens") {
  if (!torch_available()) return baton::test::skip(baton::test::Missing::torch, "python3 cannot import torch");
  const std::string script = std::string(BATON_SOURCE_DIR) + "/tests/serve/decode_reference.py";
  for (const std::string model : {"gpt2", "llama"}) {
    CAPTURE(model);
    const fs::path weights = scratch() / (model + ".safetensors");
    Proc ref({"/usr/bin/python3", script, model, weights.string(), "--prompt", "3,1,4,1,5", "--tokens", "24",
              "--vocab", "48", "--d-model", "32", "--heads", "4", "--layers", "2", "--kv-heads", "2", "--ffn-hidden",
              "48", "--positions", "64"});
    REQUIRE(ref.wait(120s) == 0);
    const std::vector<int> want = ints_after(ref.out(), "\"tokens\": [");
    const std::vector<double> margins = doubles_after(ref.out(), "\"margins\": [");
    REQUIRE(want.size() == 24);
    std::uint16_t port = 0;
    auto server = start_server({"--model", model, "--init-from", weights.string(), "--heads", "4", "--seq", "64"}, port);
    const std::string reply = http(port, "POST", "/v1/completions",
                                   fmt::format(R"({{"model":"{}","prompt":[3,1,4,1,5],"max_tokens":24,"temperature":0}})", model));
    INFO(reply);
    REQUIRE(reply.find("200 OK") != std::string::npos);
    std::vector<int> got;
    std::stringstream ids(text_of(reply));
    for (int id; ids >> id;) got.push_back(id);
    REQUIRE(got.size() == 24);
    // baton serves float32, the reference runs float64 on the file's float32 values: they part
    // at most where the reference's two best logits are within float32's rounding of a few
    // units' sums (1e-3 is a hundred times that); compared up to the first such near-tie.
    std::size_t compared = 0;
    for (; compared < want.size() && margins[compared] > 1e-3; ++compared) {
      CHECK_MESSAGE(got[compared] == want[compared], fmt::format("token {}", compared));
    }
    CHECK(compared >= 12);
    server->signal(SIGTERM);
    CHECK(server->wait(30s) == 0);
  }
}

TEST_CASE("Serve.BinaryServesACheckpointAsTextAndSwapsInTheNextOneUnderLoad") {
  // baton-train on a repeating line writes a checkpoint; baton-serve --watch serves it as text
  // (the checkpoint carries the bytes of its vocabulary); a second training run (--resume) writes
  // a newer one while requests keep coming: every request is answered 200 with a finish reason,
  // and the server says it swapped.
  const fs::path dir = scratch() / "watch";
  const fs::path text = dir / "fox.txt", ckpt = dir / "ckpt";
  auto train = [&](int steps, bool resume) { train_fox(dir, steps, resume); };
  train(120, false);
  fs::rename(text, dir / "moved.txt");  // the server must not need the training text
  std::uint16_t port = 0;
  auto server = start_server({"--watch", ckpt.string(), "--watch-every", "0.2", "--served-model-name", "fox"}, port);
  const std::string first = http(port, "POST", "/v1/completions",
                                 R"({"model":"fox","prompt":"the quick","max_tokens":12,"temperature":0})");
  INFO(first);
  REQUIRE(first.find("200 OK") != std::string::npos);
  CHECK(text_of(first).size() == 12);
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, bad{0};
  std::thread load([&] {
    while (!stop) {
      const std::string r = http(port, "POST", "/v1/completions",
                                 R"({"model":"fox","prompt":"the lazy","max_tokens":8,"temperature":0.5,"seed":3})");
      (r.find("200 OK") != std::string::npos && r.find("\"finish_reason\":\"length\"") != std::string::npos ? ok : bad)++;
    }
  });
  fs::rename(dir / "moved.txt", text);
  train(240, true);
  const bool swapped = server->read_until([](const std::string&, const std::string& err) {
    return err.find("weights swapped in: checkpoint step 240") != std::string::npos;
  }, 60s);
  stop = true;
  load.join();
  INFO(server->err());
  CHECK(swapped);
  CHECK(ok > 0);
  CHECK(bad == 0);
  server->signal(SIGTERM);
  CHECK(server->wait(30s) == 0);
}

TEST_CASE("Serve.SigtermLetsARunningStreamFinishThenExits") {
  if (!torch_available()) return baton::test::skip(baton::test::Missing::torch, "python3 cannot import torch");
  // A GPT-2 of 512 positions: a stream of 400 tokens runs long enough to be caught mid-way.
  const fs::path weights = scratch() / "long.safetensors";
  Proc ref({"/usr/bin/python3", std::string(BATON_SOURCE_DIR) + "/tests/serve/decode_reference.py", "gpt2",
            weights.string(), "--prompt", "1", "--tokens", "1", "--vocab", "64", "--d-model", "64", "--heads", "4",
            "--layers", "2", "--positions", "512"});
  REQUIRE(ref.wait(120s) == 0);
  std::uint16_t port = 0;
  auto server = start_server({"--model", "gpt2", "--init-from", weights.string(), "--heads", "4"}, port);
  std::atomic<bool> signalled{false};
  const std::string stream = http(
      port, "POST", "/v1/completions", R"({"model":"gpt2","prompt":[1,2,3],"max_tokens":400,"stream":true})", 120s,
      "data: [DONE]", [&](const std::string& got) {
        if (!signalled && got.find("data: {") != std::string::npos) {
          server->signal(SIGTERM);
          signalled = true;
        }
      });
  CHECK(signalled);
  CHECK(stream.find("\"finish_reason\":\"length\"") != std::string::npos);
  CHECK(stream.find("data: [DONE]") != std::string::npos);
  // Draining: a new request is refused (503) or finds the port closed, never served.
  const std::string late = http(port, "POST", "/v1/completions", R"({"model":"gpt2","prompt":[1],"max_tokens":2})", 5s);
  CHECK(late.find("200 OK") == std::string::npos);
  CHECK(server->wait(60s) == 0);
  INFO(server->err());
  CHECK(server->err().find("draining") != std::string::npos);
}

TEST_CASE("Serve.TheOfficialOpenAIClientAgainstBatonServeOnATrainedModel") {
  // What a user's code sees: openai's npm package, unchanged, against baton-serve serving a
  // baton-train checkpoint (tests/serve/openai_client/real_server_test.mjs: greedy text, the same
  // text streamed, seeds that repeat, a stop string, an error naming its field).
  const baton::test::NodeClient client = baton::test::openai_client(BATON_OPENAI_CLIENT_DIR, BATON_OPENAI_CLIENT_WORK_DIR);
  if (!client.why_not.empty()) return baton::test::skip(baton::test::Missing::nodejs, client.why_not);
  const fs::path dir = scratch() / "client";
  train_fox(dir, 120, false);
  std::uint16_t port = 0;
  auto server = start_server({"--checkpoint", (dir / "ckpt").string(), "--served-model-name", "fox"}, port);
  const auto [rc, out] = baton::test::shell(fmt::format(
      "cd '{}' && BASE_URL=http://127.0.0.1:{}/v1 API_KEY={} MODEL=fox PROMPT='the quick' timeout 60 '{}' "
      "real_server_test.mjs",
      client.dir.string(), port, key, client.node));
  MESSAGE(out);
  CHECK_MESSAGE(rc == 0, "real_server_test.mjs failed (exit " << rc << ")");
  CHECK(out.find("all checks passed") != std::string::npos);
  server->signal(SIGTERM);
  CHECK(server->wait(30s) == 0);
}

TEST_CASE("Serve.TwoRanksUnderBatonLaunchAnswerAsOneAndDrainOnSigterm") {
  // pp 2 as a user runs it: baton-launch starts two baton-serve processes, rank 0 serves HTTP and
  // the first layer, rank 1 the second layer and the head; the step's rows travel between them
  // over the job's UCX data plane. They answer what one process answers: the same kernels on the
  // same rows in the same order (the cut copies the hidden state whole), so the same bits. Then
  // tp 2 on two ranks.
  const fs::path dir = scratch() / "pp";
  train_fox(dir, 120, false, 2);
  const std::string ckpt = (dir / "ckpt").string();
  // --stop-grace: SIGTERM to the launcher lets rank 0 drain instead of ending the job at once.
  const std::vector<std::string> launch{std::string(BATON_BIN_DIR) + "/baton-launch", "--nproc-per-node", "2",
                                        "--stop-grace", "60", "--"};
  const std::vector<std::string> bodies{
      R"({"model":"gpt","prompt":"the quick","max_tokens":20,"temperature":0})",
      R"({"model":"gpt","prompt":"over the","max_tokens":20,"temperature":0.8,"seed":42})"};
  std::vector<std::string> alone;
  {
    std::uint16_t port = 0;
    auto server = start_server({"--checkpoint", ckpt}, port);
    for (const auto& b : bodies) alone.push_back(text_of(http(port, "POST", "/v1/completions", b)));
    server->signal(SIGTERM);
    CHECK(server->wait(30s) == 0);
  }
  REQUIRE(alone[0].size() == 20);
  {
    std::uint16_t port = 0;
    auto job = start_server({"--checkpoint", ckpt}, port, launch);
    INFO(job->err());
    CHECK(job->err().find("2 stages on 2 ranks") != std::string::npos);
    for (std::size_t i = 0; i < bodies.size(); ++i) {
      CHECK_MESSAGE(text_of(http(port, "POST", "/v1/completions", bodies[i])) == alone[i], bodies[i]);
    }
    // SIGTERM to the launcher: every rank hears it, rank 0 drains and tells rank 1 to stop; the
    // job ends 0.
    job->signal(SIGTERM);
    CHECK(job->wait(60s) == 0);
    CHECK(job->err().find("drained") != std::string::npos);
    CHECK(job->err().find("stopped (rank 0 said so)") != std::string::npos);
  }
  {
    // tp 2: each rank holds half the heads and half the MLP; the output projections' partial
    // sums are added across the ranks, a change of f32 rounding (~1e-6 of logits some units
    // apart on this trained model), so the greedy text is the same.
    std::uint16_t port = 0;
    auto job = start_server({"--checkpoint", ckpt, "--tp", "2"}, port, launch);
    INFO(job->err());
    CHECK(job->err().find("1 stage of 2 tensor-parallel shards on 2 ranks") != std::string::npos);
    CHECK(text_of(http(port, "POST", "/v1/completions", bodies[0])) == alone[0]);
    job->signal(SIGTERM);
    CHECK(job->wait(60s) == 0);
  }
}

TEST_CASE("Serve.ARankKilledMidStreamEndsTheStreamAndTheJobWithTheReason") {
  // A model of 512 positions whose 400-token stream lasts long enough to kill rank 1 (SIGKILL)
  // after its first tokens: the stream ends with OpenAI's server_error naming the rank, and the
  // job (rank 0, the launcher) ends with that reason instead of hanging.
  const fs::path dir = scratch() / "pp-kill";
  fs::create_directories(dir);
  {
    std::ofstream out(dir / "text.txt");
    for (int i = 0; i < 200; ++i) out << "pack my box with five dozen liquor jugs. ";
  }
  Proc train({std::string(BATON_BIN_DIR) + "/baton-train", "--model", "gpt", "--data", "text:" + (dir / "text.txt").string(),
              "--steps", "2", "--batch", "2", "--seq", "512", "--d-model", "128", "--heads", "4", "--layers", "2",
              "--checkpoint-dir", (dir / "ckpt").string()});
  {
    const int rc = train.wait(240s);
    INFO(train.all());
    REQUIRE(rc == 0);
  }
  std::uint16_t port = 0;
  auto job = start_server({"--checkpoint", (dir / "ckpt").string()}, port,
                          {std::string(BATON_BIN_DIR) + "/baton-launch", "--nproc-per-node", "2", "--"});
  REQUIRE(job->read_until([](const std::string&, const std::string& err) { return err.find("(pid ") != std::string::npos; }, 30s));
  const std::string err = job->err();
  const auto at = err.find("(pid ");
  const int rank1 = std::stoi(err.substr(at + 5));
  REQUIRE(rank1 > 0);
  bool killed = false;
  const std::string stream = http(
      port, "POST", "/v1/completions", R"({"model":"gpt","prompt":"pack my","max_tokens":400,"stream":true})", 60s,
      "data: [DONE]", [&](const std::string& got) {
        if (!killed && got.find("data: {") != std::string::npos) {
          ::kill(rank1, SIGKILL);
          killed = true;
        }
      });
  INFO(stream);
  REQUIRE(killed);
  CHECK(stream.find("\"finish_reason\":\"length\"") == std::string::npos);  // it did not run to its end
  CHECK(stream.find("server_error") != std::string::npos);
  CHECK(stream.find("rank 1") != std::string::npos);
  const int rc = job->wait(60s);
  INFO(job->err());
  CHECK(rc != 0);
  CHECK(rc != -1);  // it ended (wait's timeout is -1)
  // Rank 0 ends with the reason: the launcher saw rank 1 killed and aborted the job.
  // (Between steps the abort itself ends the engine; mid-step the step fails with it.)
  const std::string log = job->err();
  const auto stopped = log.find("baton-serve[rank 0/2]: stopped: ");
  REQUIRE(stopped != std::string::npos);
  const std::string line = log.substr(stopped, log.find('\n', stopped) - stopped);
  CHECK_MESSAGE(line.find("rank 1 (host") != std::string::npos, line);
  CHECK_MESSAGE(line.find("killed by signal 9") != std::string::npos, line);
}

TEST_CASE("Serve.RanksStartedWithOtherFlagsAreRefusedAtTheRendezvous") {
  // The serving shape (model, pp, tp, batch limits, cache blocks) is the job's plan hash: rank 1
  // started with another --max-batch is refused, the job ends non-zero naming both plans.
  const fs::path dir = scratch() / "mismatch";
  train_fox(dir, 10, false, 2);
  const std::string serve = std::string(BATON_BIN_DIR) + "/baton-serve";
  const std::string common = fmt::format("--checkpoint '{}' --listen 127.0.0.1:{} --api-key {}",
                                         (dir / "ckpt").string(), baton::test::free_port(), key);
  Proc job({std::string(BATON_BIN_DIR) + "/baton-launch", "--nproc-per-node", "2", "--", "sh", "-c",
            fmt::format("if [ \"$BATON_RANK\" = 1 ]; then exec '{0}' {1} --max-batch 8; else exec '{0}' {1}; fi", serve,
                        common)});
  const int rc = job.wait(60s);
  INFO(job.all());
  CHECK(rc != 0);
  CHECK(rc != -1);
  CHECK(job.err().find("ranks compiled different plans: rank 0: plan") != std::string::npos);
}
