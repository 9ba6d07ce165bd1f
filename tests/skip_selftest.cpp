// The skip mechanism itself (tests/skip.h), run case by case by tests/check_skip.cmake, which
// checks the exit status of each: 77 for a skip, 1 for a skip that hides a failed check or
// that CI=true forbids, 0 when something ran. Not discovered as CTest tests of their own.
#define DOCTEST_CONFIG_IMPLEMENT
#include "skip.h"

using baton::test::Missing;
using baton::test::skip;

TEST_CASE("Skip.ForWantOfAGpu") { return skip(Missing::cuda_device, "no GPU (a test of test::skip)"); }

TEST_CASE("Skip.ForWantOfMpirun") { return skip(Missing::mpirun, "no mpirun (a test of test::skip)"); }

TEST_CASE("Skip.AfterAFailedCheck") {
  CHECK(1 + 1 == 3);  // fails on purpose: the skip below must not hide it
  return skip(Missing::cuda_device, "no GPU (a test of test::skip)");
}

TEST_CASE("Skip.Runs") { CHECK(1 + 1 == 2); }

int main(int argc, char** argv) { return baton::test::run_tests(argc, argv); }
