// Fuzzes the rendezvous server with whatever a stranger may send to its port: each input is
// written on a fresh loopback connection, which is then half-closed. The server must refuse or
// drop bad input without crashing, leaking or hanging (sanitizers watch its thread); a job that
// the input managed to join (the seeds know the token) and then abandon ends, and a fresh server
// takes its place.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>

#include "baton/transport/control.h"
#include "fuzz_util.h"

using namespace std::chrono_literals;
using baton::transport::RendezvousServer;

namespace {

std::unique_ptr<RendezvousServer> fresh_server() {
  baton::transport::ServerSettings s;
  s.bind_host = "127.0.0.1";
  s.token = "fuzz-token";
  s.world_size = 2;
  s.launchers = 1;
  s.join_timeout = 60s;
  s.heartbeat_timeout = 60s;
  s.on_telemetry = [](baton::transport::Telemetry) {};
  return std::make_unique<RendezvousServer>(s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static std::unique_ptr<RendezvousServer> server = fresh_server();
  if (server->outcome()) server = fresh_server();

  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(server->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    baton::fuzz::send_all(fd, data, size);
    ::shutdown(fd, SHUT_WR);
    baton::fuzz::drain_until_closed(fd, 200ms);
  }
  ::close(fd);
  return 0;
}
