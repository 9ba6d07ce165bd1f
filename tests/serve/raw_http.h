#pragma once
// A plain-socket HTTP/1.1 client for the serving tests of baton-serve as a process: one request
// with a bearer key, read as it comes (a stream watched token by token: on_data) until the
// server closes (Connection: close) or `until` appears. tests/http_client.h (Boost.Beast) is
// the one for whole replies.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace baton::test {

/// What came back (headers and body, chunked as sent) within `timeout`; empty if the port
/// refused the connection.
inline std::string raw_http_request(std::uint16_t port, const std::string& key, const std::string& method,
                                const std::string& target, const std::string& body,
                                std::chrono::milliseconds timeout = std::chrono::seconds(30), const std::string& until = {},
                                const std::function<void(const std::string&)>& on_data = {}) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    ::close(fd);
    return {};
  }
  const std::string req = fmt::format(
      "{} {} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\nConnection: close\r\n\r\n{}",
      method, target, key, body.size(), body);
  REQUIRE(::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
  std::string got;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<std::size_t>(n));
    if (on_data) on_data(got);
    if (!until.empty() && got.find(until) != std::string::npos) break;
  }
  ::close(fd);
  return got;
}

/// The "text" of a non-streamed completion (JSON escapes undone as far as the tests need).
inline std::string completion_text(const std::string& reply) {
  const auto at = reply.find("\"text\":\"");
  if (at == std::string::npos) return {};
  std::string out;
  for (std::size_t i = at + 8; i < reply.size() && reply[i] != '"'; ++i) {
    if (reply[i] == '\\' && i + 1 < reply.size()) ++i;
    out += reply[i];
  }
  return out;
}

}  // namespace baton::test
