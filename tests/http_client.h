#pragma once
// A small blocking HTTP/1.1 client for the dashboard's tests (Boost.Beast), every call with a
// deadline: a server that hangs fails the test instead of hanging it.
#include <chrono>
#include <map>
#include <string>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace baton::test {

struct HttpReply {
  int status = 0;
  std::string body;
  std::map<std::string, std::string> headers;  // lower-case names
};

struct HttpRequest {
  std::string method = "GET";
  std::string target = "/";
  std::string body;
  std::map<std::string, std::string> headers;
};

/// Runs one asynchronous operation of `stream` to its end: `start(handler)` starts it; the
/// stream's expiry (tcp_stream::expires_after) bounds it. Throws beast::system_error.
template <class Start>
void run_one(boost::asio::io_context& io, Start start) {
  boost::beast::error_code result;
  bool done = false;
  start([&](boost::beast::error_code ec, auto&&...) {
    result = ec;
    done = true;
  });
  io.restart();
  io.run();
  if (!done) throw std::runtime_error("an HTTP operation did not complete");
  if (result) throw boost::beast::system_error(result);
}

/// One request on a fresh connection to 127.0.0.1:port. Throws on a connection error or when
/// `timeout` passes.
inline HttpReply http_request(std::uint16_t port, const HttpRequest& r,
                              std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  namespace beast = boost::beast;
  namespace http = beast::http;
  boost::asio::io_context io;
  beast::tcp_stream stream(io);
  stream.expires_after(timeout);
  const boost::asio::ip::tcp::endpoint to(boost::asio::ip::make_address("127.0.0.1"), port);
  run_one(io, [&](auto h) { stream.async_connect(to, h); });
  http::request<http::string_body> req(http::string_to_verb(r.method), r.target, 11);
  req.set(http::field::host, "127.0.0.1:" + std::to_string(port));
  for (const auto& [k, v] : r.headers) req.set(k, v);
  req.body() = r.body;
  if (!r.body.empty()) req.prepare_payload();
  run_one(io, [&](auto h) { http::async_write(stream, req, h); });
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(std::uint64_t{1} << 30);  // traces of busy runs are large
  if (r.method == "HEAD") parser.skip(true);
  run_one(io, [&](auto h) { http::async_read(stream, buffer, parser, h); });
  HttpReply out;
  const auto& res = parser.get();
  out.status = static_cast<int>(res.result_int());
  out.body = res.body();
  for (const auto& f : res) {
    std::string name(f.name_string());
    for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    out.headers[name] = std::string(f.value());
  }
  beast::error_code ec;
  stream.socket().shutdown(boost::asio::ip::tcp::socket::shutdown_both, ec);
  return out;
}

inline HttpReply http_get(std::uint16_t port, const std::string& target,
                          std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return http_request(port, HttpRequest{.target = target}, timeout);
}

}  // namespace baton::test
