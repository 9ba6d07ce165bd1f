// The catalogue of bad input (issue #8): every way a user, a file or a peer can hand baton
// something wrong, each answered by a clear error that names the culprit, a non-zero exit and
// nothing else -- no crash (the sanitizer stage runs this file under ASan + UBSan), no hang
// (every case has a deadline), no traceback or abort. One table per entry point; a new kind of
// bad input gets its line here.
//
// Entries that live elsewhere because they need a fixture of their own are listed at the end of
// this comment (they run in the same suite):
//   - graph errors at build time (shapes, dtypes, a loss that is not a scalar): Graph.*
//   - every kind of corrupt or mismatched checkpoint file, byte by byte: Checkpoint.*,
//     Safetensors.* (here: what baton-train says about a few of them)
//   - malformed, oversized and out-of-protocol control-plane messages, refused joins (duplicate
//     rank, world-size mismatch): control: *; and the fuzz targets in fuzz/
//   - plans that differ between ranks: "control: different plans are refused naming the ranks"
//   - bad plans (zero slots, no producer, deadlocking cycles): Validate.*
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "mp/proc.h"

using namespace std::chrono_literals;
using baton::test::Proc;
namespace fs = std::filesystem;

namespace {

const std::string bin = BATON_BIN_DIR;

struct Case {
  std::vector<std::string> argv;  // after the program's name
  std::string says;               // the error must contain this (it names the culprit)
  std::map<std::string, std::string> env{};
};

/// A scratch directory for this test binary, removed at exit.
const fs::path& scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / fmt::format("baton-bad-input-{}", ::getpid());
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

std::string write_file(const std::string& name, const std::string& content) {
  const fs::path p = scratch() / name;
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << content;
  return p.string();
}

/// The first `bytes` bytes of the repository's digits file (a truncated gzip stream).
std::string truncated_digits(std::size_t bytes) {
  std::ifstream in(std::string(BATON_SOURCE_DIR) + "/data/digits.csv.gz", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return all.substr(0, std::min(bytes, all.size()));
}

/// Runs `program argv`, then checks the outcome every bad input must have.
void expect_refused(const std::string& program, const Case& c, std::chrono::seconds deadline = 60s) {
  std::vector<std::string> argv{bin + "/" + program};
  argv.insert(argv.end(), c.argv.begin(), c.argv.end());
  std::string line = program;
  for (const auto& a : c.argv) line += " " + a;
  CAPTURE(line);
  Proc p(argv, c.env);
  const int code = p.wait(deadline);
  const std::string err = p.err();
  CAPTURE(err);
  CHECK_MESSAGE(code != -1, "it did not end within the deadline");
  CHECK_MESSAGE(code != 0, "a bad input must give a non-zero exit");
  CHECK_MESSAGE(code < 128, "it died of a signal (a crash or an abort), not an error exit");
  CHECK_MESSAGE(err.find(c.says) != std::string::npos, "the error does not name the culprit");
  // One clear line: the first line says it all (CLI11 adds a "Run with --help" hint).
  const std::string first = err.substr(0, err.find('\n'));
  CHECK_MESSAGE(first.find(c.says) != std::string::npos, "the culprit is not in the first line");
  for (const char* noise : {"terminate called", "Aborted", "Segmentation", "AddressSanitizer", "runtime error:",
                            "std::exception", "what():"}) {
    CHECK_MESSAGE(err.find(noise) == std::string::npos, "the error output has '", noise, "'");
  }
}

}  // namespace

TEST_CASE("BadInput.TrainFlagsAndValues" * doctest::timeout(300)) {
  const std::vector<Case> cases{
      {{"--steps", "0"}, "--steps: must be > 0, not 0"},
      {{"--steps", "-3"}, "--steps"},
      {{"--lr", "abc"}, "--lr: must be a number, not 'abc'"},
      {{"--model", "resnet"}, "--model: resnet not in {mlp,gpt,llama,gpt2}"},
      {{"--grad-compression", "gzip"}, "--grad-compression: gzip not in"},
      {{"--dp", "2", "--zero", "2", "--grad-compression", "fp16"}, "grad compression 'fp16' with zero 2"},
      {{"--optimizer", "lbfgs"}, "--optimizer: lbfgs not in"},
      {{"--schedule", "zigzag"}, "--schedule: zigzag not in"},
      {{"--balance", "random"}, "--balance: random not in"},
      {{"--threads", "3"}, "--threads"},
      {{"--print-plan=xml"}, "--print-plan: xml not in"},
      {{"--no-such-flag"}, "--no-such-flag"},
      {{"--batch", "10", "--microbatches", "3"}, "--batch 10 is not a multiple of --dp 1 x --microbatches 3"},
      {{"--dashboard", "nohost"}, "--dashboard 'nohost'"},
      {{"--trace", "/nonexistent-dir/t.json"}, "there is no directory '/nonexistent-dir'"},
  };
  for (const auto& c : cases) expect_refused("baton-train", c);
}

TEST_CASE("BadInput.TrainParallelConfigsAndDevices" * doctest::timeout(300)) {
  const std::vector<Case> cases{
      // Unknown devices and placements.
      {{"--devices", "gpu:2"}, "--devices 'gpu:2': expected cpu:K"},
      {{"--devices", "cpu:0"}, "--devices 'cpu:0'"},
      {{"--devices", "cpu:two"}, "--devices 'cpu:two'"},
      {{"--devices", "0:gpu:0"}, "--devices: '0:gpu:0'"},
      {{"--devices", "1:cuda:0"}, "names rank 1, but the job has 1 rank"},
      {{"--devices", "0:cuda:0,0:cuda:1"}, "--devices lists 2 places, but --dp 1 x --pp 1 x --tp 1 = 1"},
      // Without a driver: "cannot be used here: no CUDA driver ..."; with one: "does not exist".
      {{"--devices", "0:cuda:9"}, "--devices 0:cuda:9: cuda:9 "},
      // dp x pp x tp must equal the devices given.
      {{"--dp", "2", "--devices", "cpu:3"}, "dp x pp x tp must equal the devices"},
      // More stages than layers.
      {{"--pp", "9", "--layers", "2"}, "--pp 9 is more stages than the mlp has layers: 3"},
      // A split that does not divide.
      {{"--tp", "3"}, "axis 1 has size 256, which is not divisible by tp 3"},
      {{"--dp", "3", "--batch", "64"}, "--batch 64 is not a multiple of --dp 3"},
      // A micro-batch count that does not divide the batch.
      {{"--microbatches", "5", "--batch", "64"}, "--batch 64 is not a multiple of --dp 1 x --microbatches 5"},
      // Schedules: a shape the schedule cannot take, and too few layers for pp x virtual stages.
      {{"--pp", "4", "--layers", "8", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2"},
       "schedule 'interleaved' runs micro-batches in groups of the 4 devices: 2 micro-batches is not a multiple of 4"},
      {{"--pp", "2", "--schedule", "interleaved", "--virtual-stages", "1", "--microbatches", "4"},
       "needs at least 2 virtual stages per device"},
      {{"--pp", "2", "--schedule", "zb-h1", "--virtual-stages", "2", "--microbatches", "4"},
       "virtual stages 2 are for 'interleaved'"},
      {{"--pp", "2", "--layers", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4"},
       "--pp 2 x --virtual-stages 2 is 4 stages, more than the mlp has layers: 3"},
      {{"--pp", "2", "--schedule", "zb-h1", "--zero", "3", "--dp", "2", "--microbatches", "2"}, "with zero 3"},
      // Parameter servers: what they do not serve yet, and staleness without them.
      {{"--dp", "2", "--sync", "ps", "--pp", "2"}, "sync ps with pp 2: servers for pipeline stages are not built yet"},
      {{"--dp", "2", "--sync", "ps", "--zero", "1"}, "sync ps with zero 1"},
      {{"--dp", "2", "--staleness", "2"}, "staleness 2 is for parameter servers (sync ps)"},
      {{"--dp", "2", "--sync", "gossip"}, "--sync: gossip not in"},
      {{"--pp", "2", "--layers", "2", "--schedule", "zb-v", "--microbatches", "4"},
       "--schedule zb-v cuts the model into --pp 2 x 2 stages, more than the mlp has layers: 3"},
      {{"--pp", "2", "--layers", "8", "--schedule", "zb-v", "--virtual-stages", "2", "--microbatches", "4"},
       "schedule 'zb-v' places two stages per device, in a V"},
      {{"--pp", "2", "--layers", "8", "--schedule", "zb-v", "--zero", "3", "--dp", "2", "--microbatches", "2"},
       "with zero 3"},
  };
  for (const auto& c : cases) expect_refused("baton-train", c);
}

TEST_CASE("BadInput.DataFiles" * doctest::timeout(300)) {
  const std::string empty = write_file("empty.txt", "");
  const std::string one = write_file("one.txt", "x");
  const std::string two = write_file("two.txt", "xy");
  const std::string truncated_dir = (scratch() / "truncated").string();
  write_file("truncated/digits.csv.gz", truncated_digits(3000));
  const std::string malformed_dir = (scratch() / "malformed").string();
  write_file("malformed/digits.csv.gz", "0,1,2\n");
  const std::string bad_pixel_dir = (scratch() / "badpixel").string();
  std::string row;
  for (int i = 0; i < 64; ++i) row += i == 5 ? "17," : "0,";
  write_file("badpixel/digits.csv.gz", row + "3\n");
  const std::string bad_label_dir = (scratch() / "badlabel").string();
  std::string row2;
  for (int i = 0; i < 64; ++i) row2 += "0,";
  write_file("badlabel/digits.csv.gz", row2 + "12\n");
  const std::string empty_dir = (scratch() / "emptydigits").string();
  write_file("emptydigits/digits.csv.gz", "");

  const std::vector<Case> cases{
      {{"--data", "nosuch"}, "--data nosuch: expected digits, synthetic, text:PATH or tokens:DIR"},
      {{"--model", "gpt", "--data", "text:/nonexistent/corpus.txt"}, "/nonexistent/corpus.txt"},
      {{"--model", "gpt", "--data", "text:" + empty}, empty + ": 0 bytes"},
      {{"--model", "gpt", "--data", "text:" + one}, one},
      {{"--model", "mlp", "--data", "text:" + two}, "--model mlp needs labelled data"},
      {{"--model", "gpt", "--data", "digits"}, "--model gpt needs --data text:PATH or tokens:DIR"},
      {{"--model", "llama", "--data", "digits"}, "--model llama needs --data text:PATH or tokens:DIR"},
      {{"--steps", "2"}, "/nonexistent-data/digits.csv.gz not found", {{"BATON_DATA_DIR", "/nonexistent-data"}}},
      {{"--steps", "2"}, "truncated or corrupt gzip", {{"BATON_DATA_DIR", truncated_dir}}},
      {{"--steps", "2"}, malformed_dir + "/digits.csv.gz:1: 3 comma-separated values, expected 65",
       {{"BATON_DATA_DIR", malformed_dir}}},
      {{"--steps", "2"}, bad_pixel_dir + "/digits.csv.gz:1:", {{"BATON_DATA_DIR", bad_pixel_dir}}},
      {{"--steps", "2"}, bad_label_dir + "/digits.csv.gz:1:", {{"BATON_DATA_DIR", bad_label_dir}}},
      {{"--steps", "2"}, empty_dir + "/digits.csv.gz", {{"BATON_DATA_DIR", empty_dir}}},
      {{"--init-from", "/nonexistent/w.safetensors"}, "/nonexistent/w.safetensors"},
      {{"--init-from", two}, two + ": 2 bytes is too short for a safetensors file"},
      {{"--init-from", two, "--resume", empty_dir}, "--init-from and --resume"},
      {{"--model", "gpt2", "--tp", "2", "--data", "text:" + two}, "--model gpt2 runs with --tp 1"},
  };
  for (const auto& c : cases) expect_refused("baton-train", c);
}

TEST_CASE("BadInput.Checkpoints" * doctest::timeout(300)) {
  // A real checkpoint of a 2-step run, then a copy with a torn header.
  const fs::path good = scratch() / "ckpt-good";
  {
    Proc p({bin + "/baton-train", "--steps", "2", "--hidden", "8", "--checkpoint-dir", good.string()});
    REQUIRE_MESSAGE(p.wait(120s) == 0, p.all());
  }
  const fs::path torn = scratch() / "ckpt-torn";
  fs::copy(good, torn, fs::copy_options::recursive);
  fs::path rank_file;
  for (const auto& e : fs::recursive_directory_iterator(torn)) {
    if (e.path().filename() == "rank0.safetensors") rank_file = e.path();
  }
  REQUIRE_FALSE(rank_file.empty());
  {
    std::fstream f(rank_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.write("garbage", 7);
  }
  const std::string step = "step-00000002";
  const std::vector<Case> cases{
      {{"--resume", "/nonexistent-ckpt", "--steps", "4"}, "/nonexistent-ckpt: no such checkpoint directory"},
      {{"--checkpoint-every", "5"}, "--checkpoint-every needs --checkpoint-dir"},
      {{"--resume", good.string(), "--steps", "4", "--hidden", "16"},
       (good / step / "index.json").string() + ": written by another job (hidden: checkpoint 8, this run 16)"},
      {{"--resume", torn.string(), "--steps", "4", "--hidden", "8"}, rank_file.string() + ": "},
      {{"--resume", good.string(), "--steps", "2", "--hidden", "8"}, "nothing left to train"},
  };
  for (const auto& c : cases) expect_refused("baton-train", c);
}

TEST_CASE("BadInput.LaunchFlagsHostFilesAndHosts" * doctest::timeout(300)) {
  const std::string bad_slots = write_file("hosts-bad-slots", "node0 slots=x\n");
  const std::string empty_hosts = write_file("hosts-empty", "# nobody\n\n");
  const std::string junk_hosts = write_file("hosts-junk", "node0 slots=2 color=blue\n");
  const std::vector<Case> cases{
      {{"--nproc-per-node", "0", "--", "true"}, "--nproc-per-node must be between 1 and 65535, not 0"},
      {{"--", "/nonexistent/prog"}, "cannot execute '/nonexistent/prog'"},
      {{"--nnodes", "2", "--", "true"}, "--nnodes 2 needs --master HOST:PORT"},
      {{"--nnodes", "2", "--node-rank", "5", "--master", "h:1", "--", "true"}, "--node-rank 5 is out of range"},
      {{"--nnodes", "2", "--node-rank", "1", "--master", "nocolon", "--", "true"}, "--master 'nocolon' is not HOST:PORT"},
      {{"--nnodes", "2", "--node-rank", "1", "--master", "h:99999", "--", "true"}, "h:99999"},
      {{"--bind", "a b", "--", "true"}, "--bind 'a b'"},
      {{"--hostfile", "/nonexistent/hosts", "--", "true"}, "--hostfile: cannot read '/nonexistent/hosts'"},
      {{"--hostfile", bad_slots, "--", "true"}, bad_slots + ":1: 'slots=x' must be a positive number"},
      {{"--hostfile", empty_hosts, "--", "true"}, empty_hosts},
      {{"--hostfile", junk_hosts, "--", "true"}, junk_hosts + ":1"},
      {{"--hosts", "nothere,other", "--", "true"}, "'nothere', is not this machine"},
      {{"--trace", "/nonexistent-dir/t.json", "--", "true"}, "there is no directory '/nonexistent-dir'"},
      // An unreachable master: a clear error once the join deadline has passed.
      {{"--join-timeout", "2", "--nnodes", "2", "--node-rank", "1", "--master", "127.0.0.1:1", "--", "true"},
       "node 1 cannot join the job at 127.0.0.1:1"},
  };
  for (const auto& c : cases) expect_refused("baton-launch", c);
}

TEST_CASE("BadInput.WrongTokenAndMissingNode" * doctest::timeout(120)) {
  // Node 0 waits for node 1, which comes with another job's token: node 1 is refused with the
  // reason, node 0 gives up at its join deadline naming who never came.
  const std::string port = std::to_string(29000 + ::getpid() % 2000);
  const std::string master = "127.0.0.1:" + port;
  Proc node0({bin + "/baton-launch", "--join-timeout", "4", "--nnodes", "2", "--node-rank", "0", "--master", master,
              "--token", "right-token", "--", "true"});
  // Node 1 retries until node 0's server listens.
  Proc node1({bin + "/baton-launch", "--join-timeout", "4", "--nnodes", "2", "--node-rank", "1", "--master", master,
              "--token", "wrong-token", "--", "true"});
  const int code1 = node1.wait(30s);
  const int code0 = node0.wait(30s);
  CAPTURE(node0.err());
  CAPTURE(node1.err());
  CHECK(code1 > 0);
  CHECK(code1 < 128);
  CHECK(node1.err().find("wrong job token") != std::string::npos);
  CHECK(code0 > 0);
  CHECK(code0 < 128);
  CHECK(node0.err().find("node 1") != std::string::npos);
}

// Not bad input, but the same harness: --print-memory answers from the plan alone (nothing
// trains), and a budget below what it prints is refused before anything runs.
TEST_CASE("Train.PrintMemoryAnswersFromThePlanAndABudgetBelowItIsRefused" * doctest::timeout(120)) {
  const std::vector<std::string> args{bin + "/baton-train", "--model", "mlp", "--data", "digits", "--dp", "2",
                                      "--pp", "2", "--microbatches", "2", "--steps", "100000", "--print-memory"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> argv = args;
    argv.insert(argv.end(), more.begin(), more.end());
    return argv;
  };
  Proc text(with({}), {});
  REQUIRE(text.wait(60s) == 0);
  CAPTURE(text.out());
  CHECK(text.out().find("memory by device (peak from the plan):") == 0);
  for (const char* device : {"r0/cpu:0 peak", "r0/cpu:3 peak"}) CHECK(text.out().find(device) != std::string::npos);
  Proc json(with({"--json"}), {});
  REQUIRE(json.wait(60s) == 0);
  const std::string out = json.out();
  CAPTURE(out);
  const std::size_t at = out.find("\"peak_bytes\": ");
  REQUIRE(at != std::string::npos);
  const long long peak = std::stoll(out.substr(at + 14));
  CHECK(peak > 0);
  // The largest device's peak is at least this one's; a budget one byte below it is refused.
  long long largest = 0;
  for (std::size_t p = out.find("\"peak_bytes\": "); p != std::string::npos; p = out.find("\"peak_bytes\": ", p + 1))
    largest = std::max(largest, std::stoll(out.substr(p + 14)));
  expect_refused("baton-train", {{"--model", "mlp", "--data", "digits", "--dp", "2", "--pp", "2", "--microbatches", "2",
                                  "--memory-budget", std::to_string(largest - 1)},
                                 "but the memory budget is"});
  Proc fits(with({"--memory-budget", std::to_string(largest)}), {});
  CHECK(fits.wait(60s) == 0);
  // --device-memory is the same limit under the name the step-9 issue gives it.
  expect_refused("baton-train", {{"--model", "mlp", "--data", "digits", "--dp", "2", "--pp", "2", "--microbatches", "2",
                                  "--device-memory", std::to_string(largest - 1)},
                                 "but the memory budget is"});
}

TEST_CASE("BadInput.TrainLayoutAuto" * doctest::timeout(300)) {
  const std::vector<Case> cases{
      {{"--layout", "best"}, "--layout: best not in {given,auto}"},
      {{"--layout", "auto", "--devices", "sim:2"}, "--layout auto with --devices sim:2: in-process CPU devices"},
      {{"--layout", "auto", "--model", "mlp", "--data", "synthetic", "--dp", "3", "--devices", "cpu:2"},
       "--layout auto: no layout of mlp"},
  };
  for (const Case& c : cases) expect_refused("baton-train", c);
  // And where it can: it says what it chose and why, and trains with it.
  Proc p({bin + "/baton-train", "--model", "mlp", "--data", "synthetic", "--hidden", "64", "--batch", "32", "--steps", "5",
          "--layout", "auto", "--devices", "cpu:2", "--pp", "1"},
         {});
  REQUIRE(p.wait(120s) == 0);
  const std::string err = p.err();
  CAPTURE(err);
  CHECK(err.find("baton-train: --layout auto chose mlp L2 hidden 64 | B32 ") != std::string::npos);
  CHECK(err.find(" pp1 ") != std::string::npos);  // --pp 1 given: held
  CHECK(err.find("layouts on 1-2 devices searched") != std::string::npos);
}
