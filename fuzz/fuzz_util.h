#pragma once
// What the fuzz targets share: a loopback TCP connection with a deadline on every step.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace baton::fuzz {

/// Sends all of `data` on `fd` (stopping early if the peer goes away).
inline void send_all(int fd, const std::uint8_t* data, std::size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n <= 0) return;
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

/// Reads and drops what the peer sends until it closes, or `budget` passes.
inline void drain_until_closed(int fd, std::chrono::milliseconds budget) {
  const auto until = std::chrono::steady_clock::now() + budget;
  char buffer[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return;
    if (::recv(fd, buffer, sizeof buffer, 0) <= 0) return;
  }
}

}  // namespace baton::fuzz
