// A rank for baton-launch's tests: joins the job's control plane with the variables the
// launcher set (BATON_MASTER, BATON_JOB_TOKEN, BATON_RANK, BATON_WORLD_SIZE).
//
//   baton-launch-rank ok              join, a barrier, finish; prints what it saw
//   baton-launch-rank fail R TEXT     rank R reports TEXT as its failure; every rank then
//                                     waits (for the launcher to end it)
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "baton/transport/control.h"

namespace {

std::string need(const char* name) {
  const char* value = std::getenv(name);
  if (!value) {
    fmt::print(stderr, "{} is not set\n", name);
    std::exit(2);
  }
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  const std::string mode = argc > 1 ? argv[1] : "ok";
  baton::transport::ClientSettings settings;
  settings.master = need("BATON_MASTER");
  settings.token = need("BATON_JOB_TOKEN");
  settings.rank = static_cast<std::uint32_t>(std::stoul(need("BATON_RANK")));
  settings.world_size = static_cast<std::uint32_t>(std::stoul(need("BATON_WORLD_SIZE")));
  settings.join_timeout = 30s;
  try {
    baton::transport::ControlClient client(settings);
    client.on_abort([](const std::string&) {});
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const auto table = client.join({settings.rank, host, "", 42});
    fmt::print("joined rank={} table={}\n", settings.rank, table.size());
    std::fflush(stdout);
    if (mode == "fail") {
      if (argc > 3 && settings.rank == std::stoul(argv[2])) client.fail(argv[3]);
      std::this_thread::sleep_for(100s);
      return 0;
    }
    client.barrier("work", 30s);
    client.finish(30s);
    fmt::print("finished\n");
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "rank {}: {}\n", settings.rank, e.what());
    return 1;
  }
}
