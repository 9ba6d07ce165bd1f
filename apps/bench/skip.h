#pragma once
// A benchmark that cannot run here, or whose peer cannot, says why and exits 77 (CTest's
// SKIP_RETURN_CODE: the smoke test is SKIPPED, not PASSED), the policy of tests/skip.h for the
// doctest suites: under CI=true a skip for want of what CI has (it runs as root, with network
// namespaces, and scripts/run.sh installs the peers: python3-torch, libtorch-dev, OpenMPI, TBB,
// CAF, ucx-utils) is a failure instead, exit 1. Only a GPU may be missing there.
//
//   if (!hosts.ok()) return bench::skip("baton-bench-parallel --only hosts", hosts.why_not());
//
// A peer that was there and failed is no skip: the benchmark fails (exit 1), naming the case.
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace baton::bench {

/// CTest's SKIP_RETURN_CODE for the benchmarks' smoke tests (apps/CMakeLists.txt).
inline constexpr int skip_exit_code = 77;

/// What a CI run (CI=true) may lack: only the GPU.
enum class MayLackInCi { no, gpu };

/// Whether this run is CI's: the CI environment variable is "true".
inline bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string_view(ci) == "true";
}

/// Says on stderr why `what` cannot run here and returns the exit status: 77 (a skip), or 1
/// under CI=true unless `may_lack` says CI may lack it.
inline int skip(std::string_view what, std::string_view reason, MayLackInCi may_lack = MayLackInCi::no) {
  if (in_ci() && may_lack == MayLackInCi::no) {
    fmt::print(stderr,
               "{}: CI=true, and this cannot run: {}. CI must have it (it runs as root, and scripts/run.sh "
               "installs what the benchmarks' smoke tests need): not a skip but a failure\n",
               what, reason);
    return 1;
  }
  fmt::print(stderr, "SKIPPED: {}: {}\n", what, reason);
  return skip_exit_code;
}

}  // namespace baton::bench
