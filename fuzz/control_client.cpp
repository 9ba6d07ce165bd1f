// Fuzzes a rank's control client with whatever a (broken or hostile) server may answer: a
// loopback listener plays the server, reads the client's hello, sends the input and closes.
// join() must return a table or throw TransportError naming what was wrong -- never crash,
// hang past its deadline or accept a malformed table.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "baton/transport/control.h"
#include "fuzz_util.h"

using namespace std::chrono_literals;

namespace {

struct Listener {
  int fd = -1;
  std::uint16_t port = 0;
  Listener() {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::listen(fd, 16);
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static Listener listener;
  std::thread server([&] {
    pollfd p{listener.fd, POLLIN, 0};
    if (::poll(&p, 1, 2000) <= 0) return;
    const int fd = ::accept(listener.fd, nullptr, nullptr);
    if (fd < 0) return;
    // The hello first (one line), as a server would read it, then the answer.
    char c = 0;
    for (int i = 0; i < 65536 && ::recv(fd, &c, 1, 0) == 1 && c != '\n'; ++i) {
    }
    baton::fuzz::send_all(fd, data, size);
    ::shutdown(fd, SHUT_WR);
    baton::fuzz::drain_until_closed(fd, 300ms);
    ::close(fd);
  });
  {
    baton::transport::ClientSettings s;
    s.master = fmt::format("127.0.0.1:{}", listener.port);
    s.token = "fuzz-token";
    s.rank = 0;
    s.world_size = 2;
    s.join_timeout = 1s;
    baton::transport::ControlClient client(s);
    baton::transport::RankInfo me;
    me.host = "fuzz";
    me.data_address = "addr";
    try {
      const auto table = client.join(me);
      // A table the client accepted is whole: one entry per rank.
      if (table.size() != s.world_size) __builtin_trap();
    } catch (const baton::transport::TransportError&) {
    }
  }
  server.join();
  return 0;
}
