// baton under OpenMPI's mpirun: one baton-launch per MPI process adopts mpirun's layout
// (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK and the job id) and starts its rank; the ranks
// train together over UCX as under baton-launch alone. mpirun starts the processes and nothing
// else: no MPI library is loaded by baton.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "proc.h"
#include "skip.h"

using namespace std::chrono_literals;
using baton::test::json_number;
using baton::test::Proc;

namespace {

const std::string bin = BATON_BIN_DIR;

std::string find_mpirun() {
  for (const char* candidate : {"/usr/bin/mpirun", "/usr/local/bin/mpirun"}) {
    if (::access(candidate, X_OK) == 0) return candidate;
  }
  return "";
}

}  // namespace

TEST_CASE("multi-process: mpirun -np 2 baton-launch -- baton-train --dp 2 equals in-process dp 2" *
          doctest::timeout(180)) {
  const std::string mpirun = find_mpirun();
  if (mpirun.empty()) return baton::test::skip(baton::test::Missing::mpirun, "mpirun is not installed (Debian: openmpi-bin)");
  const std::vector<std::string> args{"--model", "mlp", "--data", "synthetic", "--steps", "30", "--batch", "64",
                                      "--optimizer", "sgd", "--lr", "0.05", "--json", "--dp", "2"};
  std::vector<std::string> local{bin + "/baton-train"};
  local.insert(local.end(), args.begin(), args.end());
  // As root (CI) mpirun needs --allow-run-as-root; --oversubscribe lets 2 processes share fewer
  // cores; -x hands our master (a free port: the default 29500 may be taken) to every process.
  std::vector<std::string> under_mpirun{mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                                        "-x", "BATON_MASTER", bin + "/baton-launch", "--", bin + "/baton-train"};
  under_mpirun.insert(under_mpirun.end(), args.begin(), args.end());
  Proc one(local);
  REQUIRE(one.wait(60s) == 0);
  const auto port = baton::test::free_port();
  REQUIRE(port != 0);
  Proc job(under_mpirun, {{"BATON_MASTER", fmt::format("127.0.0.1:{}", port)}});
  const int code = job.wait(120s);
  INFO(job.all());
  REQUIRE(code == 0);
  const double reference = json_number(one.out(), "final_loss");
  const double loss = json_number(job.out(), "final_loss");
  INFO("mpirun: ", loss, ", in-process: ", reference);
  // dp over ranks adds the same gradients in the same order as in one process (tests/mp's
  // baton-launch test uses the same bound).
  CHECK(std::abs(loss - reference) <= 1e-5 * std::max(1.0, std::abs(reference)));
  CHECK(json_number(job.out(), "ranks") == 2);
  CHECK(job.all().find("baton-launch: OpenMPI's layout: 2 tasks of 1 rank each, 2 ranks in all") != std::string::npos);
}
