#pragma once
// A skip is a skip: a test that cannot run here calls test::skip() and returns, and CTest
// reports it SKIPPED, never PASSED. Every test program's main is test::run_tests() (define
// DOCTEST_CONFIG_IMPLEMENT before including this header in that one file): it exits 77 when
// every test case that ran skipped and none failed, and tests/CMakeLists.txt gives each test
// SKIP_RETURN_CODE 77. A failed check is never hidden by a skip: the exit status is 77 only
// when nothing failed.
//
// Under CI=true (.ci/run exports it), a skip for something CI is expected to have fails the
// test instead: CI runs as root with what scripts/run.sh installs, so only what no script can
// give a CI machine (a GPU; see allowed_in_ci) may be missing there.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <source_location>
#include <string>

namespace baton::test {

/// What a test lacks when it cannot run.
enum class Missing {
  cuda_device,         // no usable CUDA device, or a build without CUDA or NCCL
  cudnn,               // a GPU machine without cuDNN 9 (libcudnn.so.9, PyTorch's included)
  second_cuda_device,  // a test of two or more GPUs found fewer
  ipv6_loopback,       // no ::1 to bind to
  cpu_feature,         // a CPU (or architecture) without the instructions a test needs (AVX2 with FMA)
  root,                // creating network namespaces, starting sshd
  network_namespaces,  // `ip netns` refused, or iproute2 missing
  sshd,                // openssh-server / openssh-client
  mpirun,              // openmpi-bin
  slurm,               // a one-node Slurm cluster (root, slurm-wlm and munge: tests/slurm/cluster.sh)
  python3,             // a python3 on PATH
  torch,               // python3 without PyTorch (Debian: python3-torch)
  chromium,            // the browser test's headless Chromium
  system_file,         // a file every Debian system has (/usr/share/common-licenses/GPL-3)
  data_file,           // data scripts/run.sh fetches (data/digits.csv.gz)
  sentencepiece,       // a build without libsentencepiece-dev (baton-prepare-data's tokenizer)
  nodejs,              // node and npm (Debian: nodejs, npm), or npm ci cannot fetch the openai package
};

/// Whether a CI run (CI=true) may skip for want of `what`. Only the GPU: CI machines have
/// none, and the CPU build still compiles and checks the CUDA path's host side. IPv6 too: a
/// container runtime may start CI with IPv6 switched off (Docker does without --ipv6), which
/// nothing run inside it can change. Everything else CI has: it runs as root, with network
/// namespaces, and scripts/run.sh installs openssh, openmpi, slurm-wlm and munge, python3-torch and chromium and
/// fetches the data.
constexpr bool allowed_in_ci(Missing what) {
  switch (what) {
    case Missing::cuda_device:
    case Missing::cudnn:
    case Missing::second_cuda_device:
    case Missing::ipv6_loopback:
    case Missing::cpu_feature:
      return true;
    default:
      return false;
  }
}

/// The line a skip prints, for a reader of the test's output (CTest reads the exit status).
inline constexpr const char* skip_marker = "SKIPPED: ";

/// Whether this run is CI's: the CI environment variable is "true".
inline bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

/// What run_tests() counts: test cases started, and of those the ones that skipped.
struct SkipCounts {
  int cases = 0;
  int skipped = 0;
  bool current_skipped = false;
};

inline SkipCounts& skip_counts() {
  static SkipCounts counts;
  return counts;
}

/// Says why the running test cannot run, and marks it skipped; the caller returns right after.
/// Under CI=true, for what CI must have (allowed_in_ci), fails the test instead.
///
///   if (!std::filesystem::exists(path)) return test::skip(test::Missing::system_file, path + " is missing");
inline void skip(Missing what, const std::string& reason,
                 const std::source_location where = std::source_location::current()) {
  if (in_ci() && !allowed_in_ci(what)) {
    ADD_FAIL_CHECK_AT(where.file_name(), static_cast<int>(where.line()),
                      "CI=true, and this test cannot run: "
                          << reason
                          << ". CI must have it (it runs as root, and scripts/run.sh installs what the tests "
                             "need): not a skip but a failure");
    return;
  }
  std::printf("%s%s\n", skip_marker, reason.c_str());
  std::fflush(stdout);
  skip_counts().current_skipped = true;
}

#ifdef DOCTEST_CONFIG_IMPLEMENT
/// Counts the test cases run and those that skipped, for run_tests().
struct SkipListener : doctest::IReporter {
  explicit SkipListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {
    ++skip_counts().cases;
    skip_counts().current_skipped = false;
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {
    if (skip_counts().current_skipped) ++skip_counts().skipped;
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("baton-skips", 1, SkipListener);

/// A test program's main: doctest's, then 77 (CTest's SKIP_RETURN_CODE) when every test case
/// that ran skipped and nothing failed.
inline int run_tests(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int status = context.run();
  if (context.shouldExit()) return status;
  const SkipCounts& counts = skip_counts();
  if (status == 0 && counts.cases > 0 && counts.skipped == counts.cases) {
    std::printf("%s%d of %d test case(s) could not run here\n", skip_marker, counts.skipped, counts.cases);
    return 77;
  }
  return status;
}
#endif

}  // namespace baton::test
