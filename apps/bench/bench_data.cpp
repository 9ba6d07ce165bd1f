// bench data: the token loader (data::token_source, the kernel the data-source actor runs each
// act: random windows of memory-mapped shards into a micro-batch's tokens and targets) against
// its peer measured in the same run, nanoGPT's get_batch in Python (token_loader_torch.py: the
// same shards, np.memmap, random windows, int64 rows stacked by torch), and against what training
// consumes: the tokens/s of baton-train's GPT on the same shards (its step's need).
//
// The shards are written by the benchmark (random ids, uint16) and read from the page cache
// (warm: just written); a cold read is disk speed, which neither loader changes. One thread each.
//
//   {"bench":"data","case":"tokens_b16_t128","value":...,"unit":"tokens/s","better":"higher",
//    "reference":...,"reference_name":"...","ratio":...,"train_tokens_per_s":...,"headroom_ratio":...}
//
// "ratio" is baton's tokens/s over the peer's, "headroom_ratio" baton's over what training
// consumes (above 1: the loader keeps up). A peer that fails, or a baton-train that fails, fails
// the benchmark; a peer that cannot run here (no python3 with numpy, no script) is a skip
// (exit 77; under CI=true a failure: skip.h) after baton's figures are printed.
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "baton/graph/tokens.h"
#include "capture.h"
#include "json_line.h"
#include "load.h"
#include "skip.h"

namespace {

using namespace baton;
using Clock = std::chrono::steady_clock;

/// Tokens/s of the loader kernel serving micro-batches of `batch` x `seq` for about `seconds`;
/// the median of `repeats` runs.
double loader_tokens_per_s(const std::shared_ptr<const data::TokenShards>& shards, std::int64_t batch,
                           std::int64_t seq, double seconds, int repeats) {
  std::vector<double> rates;
  for (int r = 0; r < repeats; ++r) {
    const Attrs attrs;
    const KernelConfig kc{.actor = "tokens", .device = Device{}, .dtype = DType::i32, .attrs = attrs};
    auto kernel = data::token_source(shards, batch, 1, seq, static_cast<std::uint64_t>(r + 1))(kc);
    Tensor tokens = Tensor::empty({batch, seq}, DType::i32), targets = Tensor::empty({batch * seq}, DType::i32);
    std::vector<Tensor*> outs{&tokens, &targets};
    std::int64_t piece = 0;
    const auto began = Clock::now();
    double elapsed = 0;
    while (elapsed < seconds) {
      KernelContext ctx{.inputs = {}, .outputs = outs, .piece = piece++};
      kernel->compute(ctx);
      elapsed = std::chrono::duration<double>(Clock::now() - began).count();
    }
    rates.push_back(static_cast<double>(piece * batch * seq) / elapsed);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

/// baton-train's GPT on the shards: the tokens/s of its steady steps, from two runs of `steps`
/// and 3 * `steps` steps ("done: N steps in T s"): the difference leaves out start-up and the
/// first steps. Throws where it cannot run or fails.
double train_tokens_per_s(const std::string& dir, std::int64_t batch, std::int64_t seq, int steps) {
  const std::string exe = bench::executable_dir() + "/baton-train";
  if (!std::filesystem::exists(exe)) throw std::runtime_error(exe + " not found (build it: no training figure)");
  auto seconds_of = [&](int n) -> double {
    const std::string cmd =
        fmt::format("{} --model gpt --data tokens:{} --batch {} --seq {} --steps {} --threads 1 --no-eval 2>&1",
                    bench::shell_quote(exe), bench::shell_quote(dir), batch, seq, n);
    auto [rc, out] = bench::run_capture(cmd);
    const auto done = out.rfind("done: ");
    const auto in = out.find(" steps in ", done);
    if (rc != 0 || done == std::string::npos || in == std::string::npos) {
      throw std::runtime_error(fmt::format("baton-train failed ({}): {}", rc, out.substr(0, 400)));
    }
    return std::stod(out.substr(in + 10));
  };
  const double short_run = seconds_of(steps), long_run = seconds_of(3 * steps);
  if (long_run <= short_run) {
    throw std::runtime_error(fmt::format("baton-train's {} steps took {} s, no longer than its {} steps' {} s: no "
                                         "steady rate",
                                         3 * steps, long_run, steps, short_run));
  }
  return static_cast<double>(2 * steps * batch * seq) / (long_run - short_run);
}

}  // namespace

int main(int argc, char** argv) {
  bench::load().start(argc, argv, 1);
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "-h" || a == "--help") {
      fmt::print("usage: baton-bench-data [--quick]\n  --quick  a small corpus, short runs (ctest's smoke)\n{}",
                 bench::allow_load_usage);
      return 0;
    } else {
      fmt::print(stderr, "baton-bench-data: unknown argument '{}' (--help lists them)\n", a);
      return 2;
    }
  }
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("baton-bench-data-{}", ::getpid());
  try {
    // 16M tokens (32 MB of uint16) in 4 shards, so windows cross shard boundaries too.
    const std::int64_t n = quick ? (1 << 20) : (1 << 24), vocab = 4096;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
    std::mt19937 rng(1);
    for (auto& t : ids) t = static_cast<std::int32_t>(rng() % vocab);
    std::vector<std::int32_t> val(ids.begin(), ids.begin() + 4096);
    data::write_token_shards(dir.string(), ids, val, vocab, "", n / 4);
    const auto shards = data::TokenShards::open(dir.string(), "train");
    std::string missing;
    std::string peer = bench::find_reference_script("BATON_TOKEN_LOADER_PEER", "token_loader_torch.py", missing);
    if (!peer.empty()) {
      // The peer needs numpy (torch where there is one: the script says which loader ran).
      const std::string python = bench::reference_python();
      auto [rc, out] = bench::run_capture(
          fmt::format("{} -c 'import numpy' 2>&1", bench::shell_quote(python)));
      if (rc != 0) {
        missing = fmt::format("{} cannot import numpy: {} (apt-get install python3-numpy python3-torch, or set "
                              "BATON_PYTHON)",
                              python, bench::trim(out));
        peer.clear();
      }
    }
    if (peer.empty()) fmt::print(stderr, "bench data: no peer: {}\n", missing);
    int failures = 0;
    const double seconds = quick ? 0.2 : 2.0;
    struct Case {
      std::int64_t batch, seq;
    };
    for (const Case c : {Case{16, 128}, Case{64, 1024}}) {
      const double mine = loader_tokens_per_s(shards, c.batch, c.seq, seconds, quick ? 1 : 3);
      const std::string case_name = fmt::format("tokens_b{}_t{}", c.batch, c.seq);
      bench::JsonLine line("data", case_name);
      line.add("value", mine).add("unit", "tokens/s").better(bench::Better::higher);
      line.add("corpus_tokens", static_cast<double>(n)).add("threads", 1.0);
      if (!peer.empty()) {
        auto [rc, out] = bench::run_capture(fmt::format("{} {} --dir {} --batch {} --seq {} --seconds {} 2>&1",
                                                        bench::shell_quote(bench::reference_python()),
                                                        bench::shell_quote(peer), bench::shell_quote(dir.string()),
                                                        c.batch, c.seq, seconds * (quick ? 1 : 3)));
        const std::string json = bench::last_json_line(out);
        if (auto rate = bench::json_number(json, "tokens_per_s"); rc == 0 && rate) {
          line.add("reference", *rate).add("reference_name", bench::json_string(json, "loader").value_or("?"));
          line.compare("ratio", mine, *rate);
        } else {
          const int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
          fmt::print(stderr, "bench data: case {}: the peer failed (exit {}): {}\n", case_name, code, out.substr(0, 400));
          line.add("reference_failed", fmt::format("token_loader_torch.py exited {} (stderr)", code));
          ++failures;
        }
      } else {
        line.add("reference_missing", missing);
      }
      // What training consumes: baton-train's GPT (d 256, 4 layers) at this batch and context,
      // one thread; at T 1024 a CPU step takes seconds, so that case has no training figure.
      if (c.seq <= 256) {
        const double need = train_tokens_per_s(dir.string(), c.batch, c.seq, quick ? 2 : 10);
        line.add("train_tokens_per_s", need).compare("headroom_ratio", mine, need);
      }
      line.print();
    }
    std::filesystem::remove_all(dir);
    if (failures > 0) return 1;
    return peer.empty() ? bench::skip("baton-bench-data's peer (nanoGPT's get_batch)", missing) : 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "baton-bench-data: {}\n", e.what());
    std::filesystem::remove_all(dir);
    return 1;
  }
}
