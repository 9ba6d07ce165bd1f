#pragma once
// Drives headless Chromium through the DevTools protocol (https://chromedevtools.github.io/
// devtools-protocol/): a WebSocket to one page target, commands by id, events collected on
// the side. For the dashboard's browser test; every call has a deadline.
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/websocket.hpp>
#include <boost/json.hpp>

namespace baton::test {

class DevTools {
 public:
  /// Connects to `ws_url` ("ws://127.0.0.1:PORT/devtools/page/ID").
  DevTools(const std::string& ws_url, std::chrono::milliseconds timeout) : ws_(io_), timeout_(timeout) {
    const std::string prefix = "ws://";
    if (ws_url.rfind(prefix, 0) != 0) throw std::runtime_error("not a ws:// URL: " + ws_url);
    const auto slash = ws_url.find('/', prefix.size());
    const std::string host_port = ws_url.substr(prefix.size(), slash - prefix.size());
    const std::string path = ws_url.substr(slash);
    const auto colon = host_port.rfind(':');
    const boost::asio::ip::tcp::endpoint to(boost::asio::ip::make_address(host_port.substr(0, colon)),
                                            static_cast<unsigned short>(std::stoi(host_port.substr(colon + 1))));
    auto& tcp = boost::beast::get_lowest_layer(ws_);
    tcp.expires_after(timeout_);
    run([&](auto h) { tcp.async_connect(to, h); });
    tcp.expires_never();
    ws_.set_option(boost::beast::websocket::stream_base::timeout{timeout_, boost::beast::websocket::stream_base::none(), false});
    ws_.read_message_max(256 << 20);  // screenshots are big
    run([&](auto h) { ws_.async_handshake(host_port, path, h); });
  }

  /// Sends a command and waits for its answer's "result"; throws with the protocol's error.
  boost::json::object call(const std::string& method, boost::json::object params = {}) {
    const std::int64_t id = ++next_id_;
    boost::json::object msg{{"id", id}, {"method", method}, {"params", std::move(params)}};
    const std::string text = boost::json::serialize(msg);
    boost::beast::get_lowest_layer(ws_).expires_after(timeout_);
    run([&](auto h) { ws_.async_write(boost::asio::buffer(text), h); });
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (std::chrono::steady_clock::now() < deadline) {
      boost::json::object m = read();
      if (auto* got = m.if_contains("id"); got != nullptr && got->to_number<std::int64_t>() == id) {
        if (auto* err = m.if_contains("error")) throw std::runtime_error(method + ": " + boost::json::serialize(*err));
        return m["result"].as_object();
      }
      events_.push_back(std::move(m));
    }
    throw std::runtime_error(method + ": no answer in time");
  }

  /// Evaluates a JavaScript expression in the page; its value (returnByValue).
  boost::json::value evaluate(const std::string& expression) {
    auto r = call("Runtime.evaluate", {{"expression", expression}, {"returnByValue", true}, {"awaitPromise", true}});
    if (auto* ex = r.if_contains("exceptionDetails")) {
      throw std::runtime_error("the page threw: " + boost::json::serialize(*ex));
    }
    return r["result"].as_object()["value"];
  }

  /// Events received so far (Runtime.exceptionThrown, Runtime.consoleAPICalled, ...).
  const std::vector<boost::json::object>& events() const { return events_; }

 private:
  boost::json::object read() {
    buffer_.clear();
    boost::beast::get_lowest_layer(ws_).expires_after(timeout_);
    run([&](auto h) { ws_.async_read(buffer_, h); });
    return boost::json::parse(boost::beast::buffers_to_string(buffer_.data())).as_object();
  }

  template <class Start>
  void run(Start start) {
    boost::beast::error_code result;
    bool done = false;
    start([&](boost::beast::error_code ec, auto&&...) {
      result = ec;
      done = true;
    });
    io_.restart();
    io_.run();
    if (!done) throw std::runtime_error("a DevTools operation did not complete");
    if (result) throw boost::beast::system_error(result);
  }

  boost::asio::io_context io_;
  boost::beast::websocket::stream<boost::beast::tcp_stream> ws_;
  std::chrono::milliseconds timeout_;
  boost::beast::flat_buffer buffer_;
  std::int64_t next_id_ = 0;
  std::vector<boost::json::object> events_;
};

/// Standard base64 (RFC 4648) to bytes: Page.captureScreenshot's data.
inline std::string base64_decode(std::string_view in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  out.reserve(in.size() * 3 / 4);
  unsigned buffer = 0;
  int bits = 0;
  for (char c : in) {
    const int v = value(c);
    if (v < 0) continue;  // '=' padding, line breaks
    buffer = (buffer << 6) | static_cast<unsigned>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((buffer >> bits) & 0xff);
    }
  }
  return out;
}

}  // namespace baton::test
