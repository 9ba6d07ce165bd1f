// Many processes: baton-launch starts real ranks (baton-xrank-check) that run cross-rank plans
// over the UCX data plane and meet at the rendezvous server; faults end the whole job.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "baton/transport/control.h"
#include "proc.h"

using namespace std::chrono_literals;
using baton::test::Proc;
using baton::test::json_number;

namespace {

const std::string bin = BATON_BIN_DIR;
const std::string launch = bin + "/baton-launch";
const std::string xrank = bin + "/baton-xrank-check";

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

std::vector<std::string> launch_args(int nproc, std::vector<std::string> program_args) {
  std::vector<std::string> a{launch, "--nproc-per-node", std::to_string(nproc), "--", xrank};
  a.insert(a.end(), program_args.begin(), program_args.end());
  return a;
}

/// The pids the ranks printed ("rank R pid P"), by rank.
std::map<int, pid_t> rank_pids(const std::string& out) {
  std::map<int, pid_t> pids;
  static const std::regex re(R"(rank (\d+) pid (\d+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
    pids[std::stoi((*it)[1])] = static_cast<pid_t>(std::stol((*it)[2]));
  }
  return pids;
}

}  // namespace

TEST_CASE("multi-process: chains, fan-out, fan-in and rings on 2 and 4 local ranks" * doctest::timeout(240)) {
  for (const char* topology : {"chain", "fanout", "fanin", "ring"}) {
    for (int world : {2, 4}) {
      CAPTURE(topology);
      CAPTURE(world);
      Proc p(launch_args(world, {"--topology", topology, "--pieces", "400", "--elements", "4096", "--slots", "2"}));
      int code = p.wait(60s);
      INFO(p.all());
      REQUIRE(code == 0);
      for (int r = 0; r < world; ++r) CHECK(contains(p.out(), fmt::format("[{}] rank {} ok:", r, r)));
    }
  }
}

// Registers on either side of the data plane's rendezvous threshold (1 MiB: 131072 int64s),
// with one slot each so that producers wait for every ack: eager payloads arrive before the
// consumer's receive is posted and must be matched to the right piece; each piece is checked
// by the pattern kernels. Over the data plane's choice for one host (shared memory only) and
// over TCP.
TEST_CASE("multi-process: registers just below and at the rendezvous threshold cross intact under back-pressure" *
          doctest::timeout(240)) {
  for (const char* tls : {"", "tcp"}) {
    for (const char* elements : {"131071", "131072"}) {
      for (const char* topology : {"fanout", "ring"}) {
        CAPTURE(tls);
        CAPTURE(elements);
        CAPTURE(topology);
        Proc p(launch_args(3, {"--topology", topology, "--pieces", "40", "--elements", elements, "--slots", "1"}),
               {{"UCX_TLS", tls}});
        const int code = p.wait(60s);
        INFO(p.all());
        REQUIRE(code == 0);
        for (int r = 0; r < 3; ++r) CHECK(contains(p.out(), fmt::format("[{}] rank {} ok:", r, r)));
      }
    }
  }
}

// The soak: 10^6 pieces (BATON_SOAK_PIECES overrides; the sanitizer stage uses fewer) through a
// 16-actor chain that crosses between 2 ranks three times. Every piece is checked by the pattern
// kernels; each rank samples its resident memory every 100 ms and fails if, after the first
// fifth of the run, it ever rises more than 5% above that level. Under AddressSanitizer a leak
// at exit fails the rank too.
TEST_CASE("multi-process: soak, 10^6 pieces through 16 actors on 2 ranks with flat memory" * doctest::timeout(290)) {
  const char* env_pieces = std::getenv("BATON_SOAK_PIECES");
  const std::string pieces = env_pieces != nullptr ? env_pieces : "1000000";
  Proc p(launch_args(2, {"--topology", "soak", "--pieces", pieces, "--rss-growth", "0.05"}));
  const int code = p.wait(280s);
  INFO(p.all());
  REQUIRE(code == 0);
  for (int r = 0; r < 2; ++r) CHECK(contains(p.out(), fmt::format("[{}] rank {} ok:", r, r)));
  // Each rank's summary line, for the log (ctest --output-on-failure, or -V).
  MESSAGE(p.out());
}

TEST_CASE("multi-process: the same plan over TCP (UCX_TLS=tcp) with large registers" * doctest::timeout(120)) {
  Proc p(launch_args(3, {"--topology", "fanout", "--pieces", "64", "--elements", std::to_string(1 << 18)}),
         {{"UCX_TLS", "tcp"}});
  int code = p.wait(90s);
  INFO(p.all());
  REQUIRE(code == 0);
  for (int r = 0; r < 3; ++r) CHECK(contains(p.out(), fmt::format("rank {} ok:", r)));
}

TEST_CASE("multi-process: kill -9 of one rank ends every rank within 10 s, naming it" * doctest::timeout(90)) {
  Proc p(launch_args(3, {"--topology", "chain", "--pieces", "1000000", "--sleep-us", "200"}));
  REQUIRE_MESSAGE(p.read_until([](const std::string& out, const std::string&) { return rank_pids(out).size() == 3; },
                               30s),
                  p.all());
  auto pids = rank_pids(p.out());
  std::this_thread::sleep_for(1s);  // mid-run: past the rendezvous, pieces flowing
  REQUIRE(::kill(pids[1], SIGKILL) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  int code = p.wait(30s);
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(p.all());
  CHECK(code != 0);
  CHECK(code != -1);  // it exited by itself
  CHECK(took < 10s);
  CHECK(contains(p.err(), "rank 1"));
  for (auto [r, pid] : pids) {
    CAPTURE(r);
    CHECK_FALSE(baton::test::process_alive(pid));
  }
}

TEST_CASE("multi-process: a kernel that throws on one rank fails the job on every rank with its reason" *
          doctest::timeout(90)) {
  Proc p(launch_args(3, {"--topology", "chain", "--pieces", "5000", "--fail-rank", "1", "--fail-at", "100"}));
  int code = p.wait(60s);
  INFO(p.all());
  CHECK(code != 0);
  // The launcher says which rank failed and why (the others hear it from the control plane's
  // abort, and are ended).
  CHECK(contains(p.err(), "injected failure at piece 100"));
  CHECK(contains(p.err(), "rank 1"));
  CHECK(contains(p.err(), "baton-launch: "));
}

TEST_CASE("multi-process: ranks that compiled different plans are refused with both hashes" * doctest::timeout(90)) {
  Proc p(launch_args(2, {"--topology", "chain", "--salt", "different", "--salt-rank", "1"}));
  int code = p.wait(60s);
  INFO(p.all());
  CHECK(code != 0);
  CHECK(contains(p.err(), "different plans"));
  static const std::regex hashes(R"([0-9a-f]{16})");
  std::set<std::string> seen;
  const std::string err = p.err();
  for (std::sregex_iterator it(err.begin(), err.end(), hashes), end; it != end; ++it) seen.insert(it->str());
  CHECK(seen.size() >= 2);
}

namespace {
std::map<std::string, std::string> rank_env(int rank, int world, std::uint16_t port, const std::string& token) {
  return {{"BATON_RANK", std::to_string(rank)},
          {"BATON_WORLD_SIZE", std::to_string(world)},
          {"BATON_LOCAL_RANK", std::to_string(rank)},
          {"BATON_MASTER", fmt::format("127.0.0.1:{}", port)},
          {"BATON_JOB_TOKEN", token}};
}
}  // namespace

TEST_CASE("multi-process: a rank with the wrong job token is refused" * doctest::timeout(60)) {
  baton::transport::ServerSettings ss;
  ss.bind_host = "127.0.0.1";
  ss.token = "the-right-token";
  ss.world_size = 2;
  ss.join_timeout = 3s;
  baton::transport::RendezvousServer server(ss);
  Proc p({xrank, "--topology", "chain"}, rank_env(0, 2, server.port(), "a-wrong-token"));
  int code = p.wait(30s);
  INFO(p.all());
  CHECK(code == 1);
  CHECK(contains(p.err(), "wrong job token"));
}

TEST_CASE("multi-process: --bind-to core gives each rank cores of its own, and each says which" *
          doctest::timeout(120)) {
  Proc p({launch, "--nproc-per-node", "2", "--bind-to", "core", "--", bin + "/baton-train", "--model", "mlp",
          "--data", "synthetic", "--dp", "2", "--steps", "5", "--json"});
  const int code = p.wait(60s);
  INFO(p.all());
  REQUIRE(code == 0);
  static const std::regex bound(R"(\[(\d)\] baton-train: r\d: .*; bound to cores ([0-9,-]+) of ([0-9,-]+), local rank (\d) of 2)");
  std::map<int, std::string> cores;
  const std::string err = p.err();
  for (std::sregex_iterator it(err.begin(), err.end(), bound), end; it != end; ++it) {
    CHECK((*it)[1].str() == (*it)[4].str());  // rank r is local rank r here
    cores[std::stoi((*it)[1])] = (*it)[2];
  }
  REQUIRE(cores.size() == 2);
  // Two ranks on one core only where the process may use a single core.
  if (std::thread::hardware_concurrency() > 1) CHECK(cores[0] != cores[1]);
  // Each rank's idle workers count the cores it has to itself (RuntimeSettings::own_cores) and,
  // its one worker having a core and its peer sharing the host, busy-poll (asked when the run
  // starts, once the data plane knows its transports).
  static const std::regex own(R"(idle workers: busy-polling: [^;]*, 1 <= \d+ cores? of its own \(bound\);)");
  if (std::thread::hardware_concurrency() > 1) {
    CHECK(std::distance(std::sregex_iterator(err.begin(), err.end(), own), std::sregex_iterator()) == 2);
  }
  // A value the ranks do not know is refused before anything runs.
  auto env = rank_env(0, 2, 1, "0123456789abcdef0123456789abcdef");
  env["BATON_BIND_TO"] = "socket";
  Proc bad({xrank, "--topology", "chain"}, env);
  CHECK(bad.wait(30s) != 0);
  CHECK(contains(bad.err(), "BATON_BIND_TO='socket': 'core' or 'none'"));
}

TEST_CASE("multi-process: more local ranks than ranks is refused, naming both" * doctest::timeout(60)) {
  auto env = rank_env(0, 2, 1, "0123456789abcdef0123456789abcdef");
  env["BATON_LOCAL_WORLD_SIZE"] = "3";
  Proc p({xrank, "--topology", "chain"}, env);
  CHECK(p.wait(30s) != 0);
  INFO(p.all());
  CHECK(contains(p.err(), "BATON_LOCAL_WORLD_SIZE=3 but BATON_WORLD_SIZE=2"));
}

TEST_CASE("multi-process: a rank that never arrives times out with its number in the message" * doctest::timeout(60)) {
  baton::transport::ServerSettings ss;
  ss.bind_host = "127.0.0.1";
  ss.token = baton::transport::random_token();
  ss.world_size = 3;
  ss.join_timeout = 2s;
  baton::transport::RendezvousServer server(ss);
  Proc r0({xrank, "--topology", "chain"}, rank_env(0, 3, server.port(), ss.token));
  Proc r2({xrank, "--topology", "chain"}, rank_env(2, 3, server.port(), ss.token));
  CHECK(r0.wait(30s) == 1);
  CHECK(r2.wait(30s) == 1);
  INFO(r0.all());
  CHECK(contains(r0.err(), "1 did not join"));
  auto outcome = server.wait_for(5s);
  REQUIRE(outcome.has_value());
  CHECK_FALSE(outcome->ok);
}

TEST_CASE("multi-process: baton-train --dp 2 over 2 ranks equals 2 in-process replicas and one device" *
          doctest::timeout(120)) {
  const std::vector<std::string> args{"--model", "mlp", "--data", "synthetic", "--steps", "30", "--batch", "64",
                                      "--optimizer", "sgd", "--lr", "0.05", "--json"};
  auto with = [&](std::vector<std::string> head, std::vector<std::string> extra) {
    head.insert(head.end(), args.begin(), args.end());
    head.insert(head.end(), extra.begin(), extra.end());
    return head;
  };
  Proc one(with({bin + "/baton-train"}, {"--microbatches", "2"}));
  Proc local(with({bin + "/baton-train"}, {"--dp", "2"}));
  Proc ranks(with({launch, "--nproc-per-node", "2", "--", bin + "/baton-train"}, {"--dp", "2"}));
  REQUIRE(one.wait(60s) == 0);
  REQUIRE(local.wait(60s) == 0);
  int code = ranks.wait(60s);
  INFO(ranks.all());
  REQUIRE(code == 0);
  const double a = json_number(one.out(), "final_loss");
  const double b = json_number(local.out(), "final_loss");
  const double c = json_number(ranks.out(), "final_loss");
  INFO(a << " " << b << " " << c);
  CHECK(std::abs(a - b) <= 1e-5 * std::max(1.0, std::abs(a)));
  CHECK(std::abs(a - c) <= 1e-5 * std::max(1.0, std::abs(a)));
  CHECK(json_number(ranks.out(), "ranks") == 2);
  // Both ranks on this host: the data plane leaves TCP out, and says so.
  CHECK(contains(ranks.err(), "data plane: TLS=^cma,tcp, RNDV_THRESH=1048576 (every rank on this host)"));
  // The gradients' pieces were read in place in the other rank's shared register memory; with
  // BATON_SHARED_REGISTERS=0 they go through the data plane, and the sums are the same adds.
  static const std::regex crossed(R"(r(\d): .*pieces to other ranks: (\d+) read in place \(([0-9.]+) MiB of registers in shared memory\), (\d+) inline, (\d+) pulled)");
  auto crossings = [](const std::string& err) {
    std::map<int, std::array<double, 4>> by_rank;
    for (std::sregex_iterator it(err.begin(), err.end(), crossed), end; it != end; ++it) {
      by_rank[std::stoi((*it)[1])] = {std::stod((*it)[2]), std::stod((*it)[3]), std::stod((*it)[4]), std::stod((*it)[5])};
    }
    return by_rank;
  };
  const auto shared = crossings(ranks.err());
  REQUIRE(shared.size() == 2);
  for (const auto& [rank, n] : shared) {
    CAPTURE(rank);
    CHECK(n[0] > 0);   // read in place
    CHECK(n[1] > 0);   // MiB shared
    CHECK(n[3] == 0);  // nothing pulled
  }
  Proc apart(with({launch, "--nproc-per-node", "2", "--", bin + "/baton-train"}, {"--dp", "2"}),
             {{"BATON_SHARED_REGISTERS", "0"}});
  code = apart.wait(60s);
  INFO(apart.all());
  REQUIRE(code == 0);
  CHECK(json_number(apart.out(), "final_loss") == c);
  const auto through = crossings(apart.err());
  REQUIRE(through.size() == 2);
  for (const auto& [rank, n] : through) {
    CAPTURE(rank);
    CHECK(n[0] == 0);
    CHECK(n[1] == 0);
    CHECK(n[2] + n[3] == shared.at(rank)[0]);  // the same pieces, inline or pulled
  }
  Proc bad({xrank, "--topology", "chain"}, {{"BATON_WORLD_SIZE", "2"}, {"BATON_RANK", "0"}, {"BATON_SHARED_REGISTERS", "yes"}});
  CHECK(bad.wait(30s) != 0);
  CHECK(contains(bad.err(), "BATON_SHARED_REGISTERS='yes': 0 or 1"));
  // Each rank says how many link messages its handshakes took: with BATON_HOLD_MESSAGES_NS=0
  // one each, and the same training.
  static const std::regex messages(R"(r(\d): .*messages to other ranks: (\d+) in (\d+) link messages)");
  auto counts = [](const std::string& err) {
    std::map<int, std::pair<long, long>> by_rank;
    for (std::sregex_iterator it(err.begin(), err.end(), messages), end; it != end; ++it) {
      by_rank[std::stoi((*it)[1])] = {std::stol((*it)[2]), std::stol((*it)[3])};
    }
    return by_rank;
  };
  for (const auto& [rank, n] : counts(ranks.err())) {
    CAPTURE(rank);
    CHECK(n.first > 0);
    CHECK(n.second <= n.first);
  }
  Proc alone(with({launch, "--nproc-per-node", "2", "--", bin + "/baton-train"}, {"--dp", "2"}),
             {{"BATON_HOLD_MESSAGES_NS", "0"}});
  code = alone.wait(60s);
  INFO(alone.all());
  REQUIRE(code == 0);
  CHECK(json_number(alone.out(), "final_loss") == c);
  const auto one_each = counts(alone.err());
  REQUIRE(one_each.size() == 2);
  for (const auto& [rank, n] : one_each) {
    CAPTURE(rank);
    CHECK(n.first > 0);
    CHECK(n.second == n.first);
  }
  Proc nonsense({xrank, "--topology", "chain"},
                {{"BATON_WORLD_SIZE", "2"}, {"BATON_RANK", "0"}, {"BATON_HOLD_MESSAGES_NS", "1us"}});
  CHECK(nonsense.wait(30s) != 0);
  CHECK(contains(nonsense.err(), "BATON_HOLD_MESSAGES_NS='1us' is not a number from 0 to 65535"));
}

// ZeRO 3 over ranks pulls another rank's shard in the pass's lane just before its gather, over
// the real data plane here; its sums and updates are plain dp's, so the figures are the same.
TEST_CASE("multi-process: baton-train --dp 2 --zero 3 over 2 ranks reports what plain dp does" * doctest::timeout(180)) {
  const std::vector<std::string> args{"--model", "mlp", "--data", "digits", "--steps", "40", "--dp", "2",
                                      "--microbatches", "2", "--optimizer", "adam", "--lr", "0.01", "--json"};
  std::vector<std::string> plain{launch, "--nproc-per-node", "2", "--", bin + "/baton-train"};
  plain.insert(plain.end(), args.begin(), args.end());
  std::vector<std::string> zero = plain;
  zero.insert(zero.end(), {"--zero", "3"});
  Proc a(plain);
  REQUIRE(a.wait(90s) == 0);
  Proc b(zero);
  const int code = b.wait(90s);
  INFO(b.all());
  REQUIRE(code == 0);
  for (const char* key : {"final_loss", "eval_loss", "eval_accuracy"}) {
    CAPTURE(key);
    CHECK(json_number(a.out(), key) == json_number(b.out(), key));
  }
}

// Parameter servers over ranks: the 2 workers are ranks 0 and 1, the server rank 2 (the last
// --servers ranks); the weights travel to and from it as registers. Synchronous (staleness 0)
// with two replicas, the server's sum is the ring's (a + b = b + a): the same figures as plain
// dp over 2 ranks, and as the same servers in one process.
TEST_CASE("multi-process: baton-train --dp 2 --sync ps over 2 workers and 1 server rank reports what dp does" *
          doctest::timeout(180)) {
  const std::vector<std::string> args{"--model", "mlp", "--data", "digits", "--steps", "40", "--dp", "2",
                                      "--microbatches", "2", "--optimizer", "adam", "--lr", "0.01", "--json"};
  auto launched = [&](int nproc, std::vector<std::string> extra) {
    std::vector<std::string> a{launch, "--nproc-per-node", std::to_string(nproc), "--", bin + "/baton-train"};
    a.insert(a.end(), args.begin(), args.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  Proc ring(launched(2, {}));
  REQUIRE(ring.wait(90s) == 0);
  Proc ps(launched(3, {"--sync", "ps", "--servers", "1"}));
  const int code = ps.wait(90s);
  INFO(ps.all());
  REQUIRE(code == 0);
  CHECK(json_number(ps.out(), "ranks") == 3);
  std::vector<std::string> one{bin + "/baton-train"};
  one.insert(one.end(), args.begin(), args.end());
  one.insert(one.end(), {"--sync", "ps", "--servers", "1"});
  Proc local(one);
  REQUIRE(local.wait(90s) == 0);
  for (const char* key : {"final_loss", "eval_loss", "eval_accuracy"}) {
    CAPTURE(key);
    CHECK(json_number(ring.out(), key) == json_number(ps.out(), key));
    CHECK(json_number(local.out(), key) == json_number(ps.out(), key));
  }
}

// Under pp and tp a rank holds only some of the weights, and under pp the losses arrive on the
// last stage's rank: the compiled plan brings the trained weights to the reporting rank, so the
// held-out figures over ranks are those of one process.
TEST_CASE("multi-process: baton-train --pp 2 and --tp 2 over 2 ranks report what one process does" *
          doctest::timeout(180)) {
  const std::vector<std::string> args{"--model", "mlp", "--data", "digits", "--steps", "40", "--json"};
  for (const std::string flag : {"--pp", "--tp"}) {
    CAPTURE(flag);
    std::vector<std::string> local{bin + "/baton-train", flag, "2", "--devices", "cpu:2"};
    std::vector<std::string> ranks{launch, "--nproc-per-node", "2", "--", bin + "/baton-train", flag, "2"};
    local.insert(local.end(), args.begin(), args.end());
    ranks.insert(ranks.end(), args.begin(), args.end());
    Proc one(local);
    Proc many(ranks);
    REQUIRE(one.wait(90s) == 0);
    const int code = many.wait(90s);
    INFO(many.all());
    REQUIRE(code == 0);
    for (const char* key : {"final_loss", "eval_loss", "eval_accuracy"}) {
      CAPTURE(key);
      CHECK(json_number(one.out(), key) == json_number(many.out(), key));  // the same sums in the same order
    }
  }
}

// Checkpoints over ranks (checkpoint.h): each rank writes the weights of its pipeline stage into
// its own file of one step directory; a job resumed on 2 ranks, or in one process with the same
// stages, ends where the uninterrupted job ends, to the last printed digit.
TEST_CASE("multi-process: baton-train --pp 2 over 2 ranks writes a file per rank and resumes bit for bit" *
          doctest::timeout(240)) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / fmt::format("baton-mp-ckpt-{}", ::getpid());
  fs::remove_all(dir);
  const std::vector<std::string> args{"--model", "mlp", "--data", "synthetic", "--pp", "2", "--microbatches", "2", "--json"};
  auto train = [&](bool ranks, std::vector<std::string> extra) {
    std::vector<std::string> a = ranks ? std::vector<std::string>{launch, "--nproc-per-node", "2", "--", bin + "/baton-train"}
                                       : std::vector<std::string>{bin + "/baton-train", "--devices", "cpu:2"};
    a.insert(a.end(), args.begin(), args.end());
    a.insert(a.end(), extra.begin(), extra.end());
    Proc p(a);
    const int code = p.wait(90s);
    INFO(p.all());
    REQUIRE(code == 0);
    return p.out();
  };
  const std::string straight = train(true, {"--steps", "40"});
  train(true, {"--steps", "20", "--checkpoint-dir", (dir / "a").string()});
  const fs::path step20 = dir / "a" / "step-00000020";
  CHECK(fs::exists(step20 / "rank0.safetensors"));
  CHECK(fs::exists(step20 / "rank1.safetensors"));
  CHECK(fs::exists(step20 / "index.json"));
  const std::string resumed = train(true, {"--steps", "40", "--resume", (dir / "a").string()});
  const std::string one_process = train(false, {"--steps", "40", "--resume", step20.string()});
  for (const char* key : {"final_loss", "eval_loss", "eval_accuracy"}) {
    CAPTURE(key);
    CHECK(json_number(straight, key) == json_number(resumed, key));
    CHECK(json_number(straight, key) == json_number(one_process, key));
  }
  CHECK(json_number(resumed, "first_step") == 20);
  // A rank's file missing: one line that names it, on the rank that reads it.
  fs::remove(step20 / "rank1.safetensors");
  Proc broken({bin + "/baton-train", "--devices", "cpu:2", "--pp", "2", "--steps", "40", "--resume", step20.string()});
  CHECK(broken.wait(60s) == 1);
  CHECK(contains(broken.err(), (step20 / "rank1.safetensors").string() + ": missing"));
  fs::remove_all(dir);
}
