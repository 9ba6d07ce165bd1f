// The control plane (DESIGN.md section 4): a rendezvous server and its clients, JSON lines over
// TCP with Boost.Asio. Every socket lives on one io_context thread; the public methods post into
// it and wait on a condition variable with a deadline, so no call blocks without a bound.
#include "baton/transport/control.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/host_name.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <boost/json.hpp>
// Boost.JSON's implementation, compiled here once for the whole program: no other .cpp that
// links baton::transport may include it again.
#include <boost/json/src.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

namespace baton::transport {
namespace {

namespace asio = boost::asio;
namespace json = boost::json;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using error_code = boost::system::error_code;

/// The longest line a server reads: a hello carries one data address, a telemetry message at
/// most max_telemetry_bytes of JSON text (escaped: at most twice as long).
constexpr std::size_t max_server_line = std::size_t{1} << 20;
/// The longest line a client reads: the table carries every rank's data address.
constexpr std::size_t max_client_line = std::size_t{64} << 20;
static_assert(baton::transport::max_telemetry_bytes * 2 <= max_server_line,
              "a telemetry body, JSON-escaped, must fit a server line");
/// Clock exchanges right after join, and how long they may take together (a loaded machine
/// makes some round trips long; the shortest one counts).
constexpr int clock_rounds = 5;
constexpr std::chrono::milliseconds clock_bound{2'000};
/// A client retries connecting this often while the server is not up yet.
constexpr milliseconds connect_retry_interval{150};
/// How long closing waits for the last messages to go out and the peer to close its side.
constexpr milliseconds close_grace{1000};
/// How long a timed-out join or barrier waits for the server to say who is missing.
constexpr milliseconds status_grace{500};
/// The server tries accepting again this long after accept() failed (out of descriptors).
constexpr milliseconds accept_retry_interval{100};
/// A lost connection fails the job after this long, so that a launcher's report of how the
/// process ended (exit code, signal), which says more, can come first.
constexpr milliseconds lost_connection_grace{250};
/// How long fail() waits for its message to be written.
constexpr milliseconds fail_flush_grace{1000};
/// The final barrier of ControlClient::finish().
constexpr const char* finish_barrier = "__finish__";

// ---- small text helpers ------------------------------------------------------------------

/// "10 s", "1.5 s", "300 ms": durations the way a person reads them in an error.
std::string format_duration(milliseconds d) {
  const auto ms = d.count();
  if (ms >= 1000 && ms % 1000 == 0) return fmt::format("{} s", ms / 1000);
  if (ms >= 1000) return fmt::format("{:.1f} s", static_cast<double>(ms) / 1000.0);
  return fmt::format("{} ms", ms);
}

/// "0, 1, 4-9": sorted numbers, runs of three or more as ranges so a large job's list stays short.
std::string number_list(std::vector<std::uint32_t> numbers) {
  std::sort(numbers.begin(), numbers.end());
  std::string out;
  for (std::size_t i = 0; i < numbers.size();) {
    std::size_t j = i;
    while (j + 1 < numbers.size() && numbers[j + 1] == numbers[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    if (j - i >= 2) {
      out += fmt::format("{}-{}", numbers[i], numbers[j]);
    } else {
      for (std::size_t k = i; k <= j; ++k) out += fmt::format("{}{}", k == i ? "" : ", ", numbers[k]);
    }
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

/// "rank 2" or "ranks 2, 3" (or "launcher of node 2" / "launchers of nodes 2, 3").
std::string phrase(std::string_view one, std::string_view many, const std::vector<std::uint32_t>& numbers) {
  return fmt::format("{} {}", numbers.size() == 1 ? one : many, number_list(numbers));
}

std::string endpoint_text(const std::string& host, std::uint16_t port) {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

std::string hash_hex(std::uint64_t hash) { return fmt::format("{:016x}", hash); }

std::optional<std::uint64_t> parse_hash_hex(std::string_view text) {
  std::uint64_t value = 0;
  if (text.empty() || text.size() > 16) return std::nullopt;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// ---- base64 (RFC 4648, with padding): data addresses are binary --------------------------

constexpr char base64_alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  auto byte = [&](std::size_t i) { return static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[i])); };
  std::size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const std::uint32_t v = byte(i) << 16 | byte(i + 1) << 8 | byte(i + 2);
    for (int shift = 18; shift >= 0; shift -= 6) out += base64_alphabet[(v >> shift) & 63];
  }
  const std::size_t rest = bytes.size() - i;
  if (rest == 1) {
    const std::uint32_t v = byte(i) << 16;
    out += base64_alphabet[(v >> 18) & 63];
    out += base64_alphabet[(v >> 12) & 63];
    out += "==";
  } else if (rest == 2) {
    const std::uint32_t v = byte(i) << 16 | byte(i + 1) << 8;
    out += base64_alphabet[(v >> 18) & 63];
    out += base64_alphabet[(v >> 12) & 63];
    out += base64_alphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view text) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    const int pad = last ? (text[i + 3] == '=') + (text[i + 2] == '=' && text[i + 3] == '=') : 0;
    std::uint32_t v = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const int d = k >= 4 - static_cast<std::size_t>(pad) ? 0 : value(text[i + k]);
      if (d < 0) return std::nullopt;
      v = v << 6 | static_cast<std::uint32_t>(d);
    }
    out += static_cast<char>((v >> 16) & 0xff);
    if (pad < 2) out += static_cast<char>((v >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(v & 0xff);
  }
  return out;
}

// ---- JSON messages -------------------------------------------------------------------------

/// A message that does not follow the protocol (missing field, wrong type).
class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

json::object message(std::string_view type) {
  json::object m;
  m["type"] = json::string_view(type.data(), type.size());
  return m;
}

json::string_view js(const std::string& s) { return json::string_view(s.data(), s.size()); }

const json::value& field(const json::object& m, std::string_view key) {
  const json::value* v = m.if_contains(json::string_view(key.data(), key.size()));
  if (v == nullptr) throw ProtocolError(fmt::format("missing field '{}'", key));
  return *v;
}

std::string get_string(const json::object& m, std::string_view key) {
  const json::value& v = field(m, key);
  if (!v.is_string()) throw ProtocolError(fmt::format("field '{}' is not a string", key));
  const json::string_view s = v.get_string();
  return std::string(s.data(), s.size());
}

std::uint32_t get_u32(const json::object& m, std::string_view key) {
  error_code ec;
  const auto n = field(m, key).to_number<std::uint64_t>(ec);
  if (ec || n > 0xffffffffu) throw ProtocolError(fmt::format("field '{}' is not a 32-bit unsigned number", key));
  return static_cast<std::uint32_t>(n);
}

std::int64_t get_i64(const json::object& m, std::string_view key) {
  error_code ec;
  const auto n = field(m, key).to_number<std::int64_t>(ec);
  if (ec) throw ProtocolError(fmt::format("field '{}' is not a 64-bit integer", key));
  return n;
}

std::uint64_t get_hash(const json::object& m, std::string_view key) {
  const auto h = parse_hash_hex(get_string(m, key));
  if (!h) throw ProtocolError(fmt::format("field '{}' is not a 64-bit hex number", key));
  return *h;
}

std::string get_bytes(const json::object& m, std::string_view key) {
  auto bytes = base64_decode(get_string(m, key));
  if (!bytes) throw ProtocolError(fmt::format("field '{}' is not base64", key));
  return std::move(*bytes);
}

std::vector<std::uint32_t> get_u32_list(const json::object& m, std::string_view key) {
  const json::value& v = field(m, key);
  if (!v.is_array()) throw ProtocolError(fmt::format("field '{}' is not an array", key));
  std::vector<std::uint32_t> out;
  for (const auto& item : v.get_array()) {
    error_code ec;
    const auto n = item.to_number<std::uint64_t>(ec);
    if (ec || n > 0xffffffffu) throw ProtocolError(fmt::format("field '{}' holds a non-number", key));
    out.push_back(static_cast<std::uint32_t>(n));
  }
  return out;
}

json::object rank_info_json(const RankInfo& info) {
  json::object r;
  r["rank"] = info.rank;
  r["host"] = js(info.host);
  r["data_address"] = json::string(base64_encode(info.data_address));
  r["plan_hash"] = json::string(hash_hex(info.plan_hash));
  if (info.may_leave) r["may_leave"] = true;
  return r;
}

std::string local_host_name() {
  error_code ec;
  auto name = asio::ip::host_name(ec);
  return ec || name.empty() ? std::string("unknown") : name;
}

// ---- Channel: one TCP connection carrying JSON lines ------------------------------------

/// Why a channel ended before its owner closed it.
enum class Loss { closed, protocol };

/// A TCP connection that sends and receives JSON objects, one per line. Used only on its
/// io_context's thread. Writes are queued and go out in order; close_gracefully() lets the
/// queue drain, half-closes, and waits (bounded) for the peer's end of file, so that a last
/// message ("refused", "bye") is read by the peer rather than lost to a reset.
class Channel : public std::enable_shared_from_this<Channel> {
 public:
  struct Handlers {
    std::function<void(const json::object&)> on_message;
    /// The peer closed or reset the connection, or broke the protocol, while the channel was
    /// open (not after close_gracefully() / close_now()).
    std::function<void(Loss, const std::string&)> on_lost;
    /// The socket is closed, for whatever reason. Called once.
    std::function<void()> on_closed;
  };

  Channel(tcp::socket socket, std::size_t max_line)
      : socket_(std::move(socket)), buffer_(max_line), linger_(socket_.get_executor()) {
    error_code ec;
    socket_.set_option(tcp::no_delay(true), ec);
    last_heard_ = last_sent_ = Clock::now();
  }

  void start(Handlers handlers) {
    handlers_ = std::move(handlers);
    read();
  }

  void send(const json::object& m) {
    if (state_ != State::open) return;
    queue_.push_back(json::serialize(m) + '\n');
    ++queued_;
    last_sent_ = Clock::now();
    if (!writing_) write();
  }

  /// Calls `fn(true)` once everything sent so far is written, `fn(false)` if the channel
  /// closes first.
  void when_flushed(std::function<void(bool)> fn) {
    if (state_ == State::closed) return fn(false);
    if (written_ == queued_) return fn(true);
    flush_waiters_.emplace_back(queued_, std::move(fn));
  }

  void close_gracefully() {
    if (state_ != State::open) return;
    state_ = State::closing;
    linger_.expires_after(close_grace);
    linger_.async_wait([self = shared_from_this()](error_code ec) {
      if (!ec) self->close_now();
    });
    if (!writing_) half_close();
  }

  void close_now() {
    if (state_ == State::closed) return;
    state_ = State::closed;
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    linger_.cancel();
    queue_.clear();
    auto waiters = std::move(flush_waiters_);
    flush_waiters_.clear();
    for (auto& w : waiters) w.second(false);
    // on_message / on_lost stay: one of them may be running now (it closed the channel).
    if (auto on_closed = std::move(handlers_.on_closed)) on_closed();
  }

  bool open() const { return state_ == State::open; }
  Clock::time_point last_heard() const { return last_heard_; }
  Clock::time_point last_sent() const { return last_sent_; }

 private:
  enum class State { open, closing, closed };

  void read() {
    asio::async_read_until(socket_, buffer_, '\n', [self = shared_from_this()](error_code ec, std::size_t n) {
      self->on_read(ec, n);
    });
  }

  void on_read(error_code ec, std::size_t n) {
    if (state_ == State::closed) return;
    if (ec) {
      if (ec == asio::error::not_found) return lose(Loss::protocol, "a line longer than the limit");
      return lose(Loss::closed, ec == asio::error::eof ? std::string("end of file") : ec.message());
    }
    last_heard_ = Clock::now();
    // A basic_streambuf's input is one contiguous buffer. (An iterator from buffers_begin()
    // would point into the temporary buffer sequence data() returns: found by the fuzzer.)
    const asio::const_buffer input = buffer_.data();
    std::string line(static_cast<const char*>(input.data()), n - 1);
    buffer_.consume(n);
    if (state_ == State::open) {
      error_code parse_ec;
      json::value v = json::parse(line, parse_ec);
      if (parse_ec) return lose(Loss::protocol, fmt::format("a line that is not JSON ({})", parse_ec.message()));
      if (!v.is_object()) return lose(Loss::protocol, "a line that is not a JSON object");
      if (handlers_.on_message) handlers_.on_message(v.get_object());
    }
    // While closing, what the peer still sends is read and dropped until its end of file.
    if (state_ != State::closed) read();
  }

  void lose(Loss loss, const std::string& why) {
    if (state_ != State::open) return close_now();
    auto on_lost = handlers_.on_lost;
    close_now();
    if (on_lost) on_lost(loss, why);
  }

  void write() {
    writing_ = true;
    asio::async_write(socket_, asio::buffer(queue_.front()), [self = shared_from_this()](error_code ec, std::size_t) {
      self->on_written(ec);
    });
  }

  void on_written(error_code ec) {
    writing_ = false;
    if (state_ == State::closed) return;
    if (ec) return lose(Loss::closed, ec.message());
    queue_.pop_front();
    ++written_;
    while (!flush_waiters_.empty() && flush_waiters_.front().first <= written_) {
      auto fn = std::move(flush_waiters_.front().second);
      flush_waiters_.pop_front();
      fn(true);
      if (state_ == State::closed) return;
    }
    if (!queue_.empty()) {
      write();
    } else if (state_ == State::closing) {
      half_close();
    }
  }

  void half_close() {
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    if (ec) close_now();
  }

  tcp::socket socket_;
  asio::streambuf buffer_;
  asio::steady_timer linger_;
  Handlers handlers_;
  State state_ = State::open;
  std::deque<std::string> queue_;  // front() is being written while writing_
  bool writing_ = false;
  std::uint64_t queued_ = 0;
  std::uint64_t written_ = 0;
  std::deque<std::pair<std::uint64_t, std::function<void(bool)>>> flush_waiters_;
  Clock::time_point last_heard_;
  Clock::time_point last_sent_;
};

/// How often heartbeats are sent and silence is checked: often enough to notice silence
/// within a quarter of the timeout.
milliseconds tick_period(milliseconds interval, milliseconds timeout) {
  return std::clamp(std::min(interval, timeout / 4), milliseconds{5}, milliseconds{1000});
}

/// Runs an io_context until stopped; a handler that throws (none should) does not end the thread.
void run_io(asio::io_context& io) {
  for (;;) {
    try {
      io.run();
      return;
    } catch (const std::exception&) {
      // A bug in a handler; keep serving the other connections rather than std::terminate.
    }
  }
}

}  // namespace

// ---- free functions ------------------------------------------------------------------------

std::pair<std::string, std::uint16_t> parse_endpoint(const std::string& text) {
  auto bad = [&](std::string_view why) {
    return TransportError(fmt::format("bad endpoint '{}': {} (expected host:port or [ipv6]:port)", text, why));
  };
  std::string host;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos) throw bad("no closing ']'");
    host = text.substr(1, close - 1);
    if (close + 1 >= text.size() || text[close + 1] != ':') throw bad("no ':port' after ']'");
    port_text = std::string_view(text).substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) throw bad("no port");
    host = text.substr(0, colon);
    if (host.find(':') != std::string::npos) throw bad("an IPv6 address needs brackets, as in [::1]:29500");
    port_text = std::string_view(text).substr(colon + 1);
  }
  if (host.empty()) throw bad("no host");
  unsigned port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (port_text.empty() || ec != std::errc{} || end != port_text.data() + port_text.size() || port > 65535) {
    throw bad(fmt::format("port '{}' is not a number from 0 to 65535", port_text));
  }
  return {host, static_cast<std::uint16_t>(port)};
}

bool tokens_equal(std::string_view given, std::string_view expected) {
  // Time depends on the lengths only, never on where the first difference is, so a peer cannot
  // find the token a byte at a time by timing refusals. The lengths are not secret (a token's
  // length is fixed by how it is made).
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  const std::size_t n = std::min(given.size(), expected.size());
  volatile const unsigned char* a = reinterpret_cast<const unsigned char*>(given.data());
  volatile const unsigned char* b = reinterpret_cast<const unsigned char*>(expected.data());
  for (std::size_t i = 0; i < n; ++i) diff = static_cast<unsigned char>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

std::string random_token() {
  std::random_device device;
  std::string token;
  for (int i = 0; i < 4; ++i) token += fmt::format("{:08x}", static_cast<std::uint32_t>(device()));
  return token;
}

// ---- the server ----------------------------------------------------------------------------

struct RendezvousServer::Impl {
  enum class Role { unknown, rank, launcher };

  /// One connection and what the server knows of it. Touched only on the io thread.
  struct Peer {
    std::shared_ptr<Channel> channel;
    Role role = Role::unknown;
    std::uint32_t number = 0;  // the rank, or the launcher's node rank
    std::string host;
    bool said_bye = false;
    bool rejoining = false;  // a rank that left, coming back (until the others took it back)
    std::uint64_t id = 0;    // which connection (a rank that came back has a new one)
  };

  /// A rank that left coming back as a new process (ControlClient::rejoin), one at a time:
  /// every other rank holds for it and answers a step (hold / held), the new process gets the
  /// largest (rejoin), builds its runtime and says ready, every other rank takes it back
  /// (rejoined / taken_back) and the new process goes (go).
  struct Rejoin {
    std::shared_ptr<Peer> peer;
    RankInfo info;
    enum class Phase { queued, holding, starting, taking_back } phase = Phase::queued;
    std::set<std::uint32_t> waiting;  // the ranks yet to answer
    std::int64_t step = 0;
    std::shared_ptr<asio::steady_timer> timer;
  };

  struct Barrier {
    std::set<std::uint32_t> arrived;
    std::uint64_t generation = 0;
    std::shared_ptr<asio::steady_timer> timer;
  };

  explicit Impl(ServerSettings s) : settings(std::move(s)) {
    if (settings.world_size == 0) throw TransportError("rendezvous server: world_size must be at least 1");
    const std::string where = endpoint_text(settings.bind_host, settings.port);
    error_code ec;
    tcp::endpoint endpoint;
    const auto address = asio::ip::make_address(settings.bind_host, ec);
    if (!ec) {
      endpoint = tcp::endpoint(address, settings.port);
    } else {
      tcp::resolver resolver(io);
      auto results = resolver.resolve(settings.bind_host, std::to_string(settings.port), tcp::resolver::passive, ec);
      if (ec || results.empty()) {
        throw TransportError(fmt::format("rendezvous server cannot listen on {}: cannot resolve '{}': {}", where,
                                         settings.bind_host, ec ? ec.message() : "no address"));
      }
      endpoint = results.begin()->endpoint();
    }
    auto check = [&](const char* what) {
      if (ec) throw TransportError(fmt::format("rendezvous server cannot listen on {}: {} failed: {}", where, what, ec.message()));
    };
    acceptor.open(endpoint.protocol(), ec);
    check("open");
    // reuse_address lets a restarted job bind over connections in TIME_WAIT; on Linux it does
    // not let two live listeners share the port, so a port in use is still an error.
    acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    check("setsockopt(SO_REUSEADDR)");
    acceptor.bind(endpoint, ec);
    check("bind");
    acceptor.listen(asio::socket_base::max_listen_connections, ec);
    check("listen");
    bound_port = acceptor.local_endpoint(ec).port();

    rank_peers.resize(settings.world_size);
    infos.resize(settings.world_size);
    work.emplace(io.get_executor());
    accept();
    arm_tick();
    if (settings.launchers > 0) {
      launcher_timer.expires_after(settings.join_timeout);
      launcher_timer.async_wait([this](error_code timer_ec) {
        if (!timer_ec) on_launcher_join_timeout();
      });
    }
    thread = std::thread([this] { run_io(io); });
  }

  ~Impl() {
    asio::post(io, [this] { begin_shutdown(); });
    {
      std::unique_lock lock(mutex);
      cv.wait_for(lock, close_grace + milliseconds{200}, [&] { return shutdown_started && open_channels == 0; });
    }
    io.stop();
    thread.join();
  }

  // ---- io thread ----

  void accept() {
    acceptor.async_accept([this](error_code ec, tcp::socket socket) {
      if (stopping) return;
      if (ec) {
        if (ec == asio::error::operation_aborted) return;
        // Out of file descriptors or similar: try again shortly rather than spin.
        accept_retry.expires_after(accept_retry_interval);
        accept_retry.async_wait([this](error_code timer_ec) {
          if (!timer_ec && !stopping) accept();
        });
        return;
      }
      add_peer(std::move(socket));
      accept();
    });
  }

  void add_peer(tcp::socket socket) {
    auto peer = std::make_shared<Peer>();
    peer->id = ++peer_count;
    peer->channel = std::make_shared<Channel>(std::move(socket), max_server_line);
    peers.push_back(peer);
    {
      std::lock_guard lock(mutex);
      ++open_channels;
    }
    std::weak_ptr<Peer> weak = peer;
    peer->channel->start({
        [this, weak](const json::object& m) {
          if (auto p = weak.lock()) on_message(p, m);
        },
        [this, weak](Loss loss, const std::string& why) {
          if (auto p = weak.lock()) on_lost(*p, loss, why);
        },
        [this, weak] {
          // Deferred: the channel may close inside a loop over `peers`.
          asio::post(io, [this, weak] {
            if (auto p = weak.lock()) peers.remove(p);
            std::lock_guard lock(mutex);
            --open_channels;
            cv.notify_all();
          });
        },
    });
  }

  std::string describe(const Peer& p) const {
    if (p.role == Role::rank) return fmt::format("rank {} (host {})", p.number, p.host);
    if (p.role == Role::launcher) return fmt::format("launcher of node {} (host {})", p.number, p.host);
    return "an unidentified connection";
  }

  std::optional<std::uint32_t> rank_of(const Peer& p) const {
    return p.role == Role::rank ? std::optional<std::uint32_t>(p.number) : std::nullopt;
  }

  void on_message(const std::shared_ptr<Peer>& p, const json::object& m) {
    try {
      const std::string type = get_string(m, "type");
      if (p->role == Role::unknown) {
        if (type == "hello") return on_hello(p, m);
        if (type == "launcher") return on_launcher(p, m);
        if (type == "heartbeat") return;
        // Not one of ours (a port scanner, another protocol): drop it, the job goes on.
        return p->channel->close_now();
      }
      if (type == "heartbeat") return;
      if (type == "barrier") return on_barrier(*p, get_string(m, "name"));
      if (type == "barrier_status") return on_barrier_status(*p, get_string(m, "name"));
      if (type == "join_status") return on_join_status(*p);
      if (type == "fail") return on_fail(*p, m);
      if (type == "bye") return on_bye(*p);
      if (type == "clock") return on_clock(*p, m);
      if (type == "telemetry") return on_telemetry(*p, m);
      if (type == "publish") return on_publish(*p, m);
      if (type == "held") return on_held(*p, m);
      if (type == "ready") return on_ready(*p);
      if (type == "taken_back") return on_taken_back(*p, m);
      // Unknown types are ignored, so that a newer client can talk to an older server.
    } catch (const ProtocolError& e) {
      on_lost(*p, Loss::protocol, fmt::format("a message with {}", e.what()));
    }
  }

  void on_clock(const Peer& p, const json::object& m) {
    auto reply = message("clock_reply");
    reply["t0"] = field(m, "t0");
    reply["ts"] = static_cast<std::int64_t>(Clock::now().time_since_epoch().count());
    p.channel->send(reply);
  }

  void on_telemetry(const Peer& p, const json::object& m) {
    if (p.role != Role::rank || !settings.on_telemetry) return;
    settings.on_telemetry(Telemetry{p.number, get_string(m, "kind"), get_string(m, "body")});
  }

  // A key is set once, by one rank; every rank (the publisher too) gets `value` in the order
  // the server saw the publish, so a value published before a barrier arrives before that
  // barrier's barrier_done.
  void on_publish(const Peer& p, const json::object& m) {
    if (p.role != Role::rank) return;
    const std::string key = get_string(m, "key");
    const std::string value = get_bytes(m, "value");
    if (auto it = published.find(key); it != published.end()) {
      if (it->second.second != value) {
        fail_job(fmt::format("rank {} published '{}' with another value than rank {} did", p.number, key,
                             it->second.first),
                 p.number, p.host);
      }
      return;
    }
    published.emplace(key, std::pair{p.number, value});
    auto v = message("value");
    v["key"] = js(key);
    v["value"] = json::string(base64_encode(value));
    for (const auto& peer : rank_peers) {
      if (peer) peer->channel->send(v);
    }
  }

  void send_command(const std::string& kind, const std::string& body) {
    auto m = message("command");
    m["kind"] = js(kind);
    m["body"] = js(body);
    for (const auto& peer : rank_peers) {
      if (peer) peer->channel->send(m);
    }
  }

  void refuse(Peer& p, const std::string& reason) {
    auto m = message("refused");
    m["reason"] = js(reason);
    p.channel->send(m);
    p.channel->close_gracefully();
  }

  void on_hello(const std::shared_ptr<Peer>& p, const json::object& m) {
    const std::string token = get_string(m, "token");
    const std::uint32_t rank = get_u32(m, "rank");
    const std::uint32_t world_size = get_u32(m, "world_size");
    RankInfo info;
    info.rank = rank;
    info.host = get_string(m, "host");
    info.data_address = get_bytes(m, "data_address");
    info.plan_hash = get_hash(m, "plan_hash");
    if (const auto* v = m.if_contains("may_leave"); v != nullptr && v->is_bool()) info.may_leave = v->get_bool();
    const auto* back = m.if_contains("rejoin");

    if (ended) return refuse(*p, fmt::format("the job has already ended: {}", ended_reason));
    if (!tokens_equal(token, settings.token)) return refuse(*p, "wrong job token");
    if (world_size != settings.world_size) {
      return refuse(*p, fmt::format("rank {} says the world size is {}, the server's is {}", rank, world_size,
                                    settings.world_size));
    }
    if (rank >= settings.world_size) {
      return refuse(*p, fmt::format("rank {} is out of range for world size {}", rank, settings.world_size));
    }
    if (back != nullptr && back->is_bool() && back->get_bool()) return on_rejoin_hello(p, std::move(info));
    if (rank_peers[rank]) {
      return refuse(*p, fmt::format("rank {} already joined (from host {})", rank, rank_peers[rank]->host));
    }
    p->role = Role::rank;
    p->number = rank;
    p->host = info.host;
    infos[rank] = std::move(info);
    rank_peers[rank] = p;
    if (!join_timer_started) {
      join_timer_started = true;
      join_timer.expires_after(settings.join_timeout);
      join_timer.async_wait([this](error_code ec) {
        if (!ec) on_join_timeout();
      });
    }
    if (++joined_ranks == settings.world_size) complete_join();
  }

  void complete_join() {
    join_timer.cancel();
    // Group the ranks by plan hash, in order of each group's lowest rank.
    std::vector<std::pair<std::uint64_t, std::vector<std::uint32_t>>> groups;
    for (std::uint32_t r = 0; r < settings.world_size; ++r) {
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == infos[r]->plan_hash; });
      if (it == groups.end()) {
        groups.push_back({infos[r]->plan_hash, {r}});
      } else {
        it->second.push_back(r);
      }
    }
    if (groups.size() > 1) {
      std::string reason = "ranks compiled different plans: ";
      for (std::size_t g = 0; g < groups.size(); ++g) {
        reason += fmt::format("{}{}: plan {}", g == 0 ? "" : "; ", phrase("rank", "ranks", groups[g].second),
                              hash_hex(groups[g].first));
      }
      return fail_job(reason, std::nullopt, {}, /*refuse_ranks=*/true);
    }
    table_sent = true;
    json::array ranks;
    for (const auto& info : infos) ranks.push_back(rank_info_json(*info));
    auto table = message("table");
    table["ranks"] = std::move(ranks);
    for (const auto& peer : rank_peers) peer->channel->send(table);
  }

  // ---- a rank that left comes back (Rejoin) ----

  void on_rejoin_hello(const std::shared_ptr<Peer>& p, RankInfo info) {
    const std::uint32_t rank = info.rank;
    if (!formed) return refuse(*p, fmt::format("rank {} cannot come back: the job has not started yet", rank));
    if (!has_left(rank)) return refuse(*p, fmt::format("rank {} cannot come back: it has not left the job", rank));
    const bool coming = (rejoin && rejoin->info.rank == rank) ||
                        std::any_of(rejoin_queue.begin(), rejoin_queue.end(), [&](const Rejoin& r) { return r.info.rank == rank; });
    if (coming) return refuse(*p, fmt::format("rank {} is already coming back", rank));
    p->role = Role::rank;
    p->number = rank;
    p->host = info.host;
    p->rejoining = true;
    info.may_leave = true;
    rejoin_queue.push_back(Rejoin{p, std::move(info)});
    start_next_rejoin();
  }

  /// The ranks that take part in a rejoin: connected, not left, not done.
  std::set<std::uint32_t> ranks_in_job(std::uint32_t except) const {
    std::set<std::uint32_t> in;
    for (std::uint32_t r = 0; r < settings.world_size; ++r) {
      if (r != except && rank_peers[r] && !rank_peers[r]->said_bye && !has_left(r)) in.insert(r);
    }
    return in;
  }

  void start_next_rejoin() {
    while (!rejoin && !rejoin_queue.empty() && !ended) {
      rejoin = std::move(rejoin_queue.front());
      rejoin_queue.pop_front();
      if (!rejoin->peer->channel->open()) {
        rejoin.reset();
        continue;
      }
      const std::uint32_t rank = rejoin->info.rank;
      rejoin->phase = Rejoin::Phase::holding;
      rejoin->waiting = ranks_in_job(rank);
      rejoin->timer = std::make_shared<asio::steady_timer>(io, settings.join_timeout);
      rejoin->timer->async_wait([this, peer = rejoin->peer](error_code ec) {
        if (!ec) {
          abandon_rejoin(*peer, fmt::format("the others did not take it back within {}",
                                            format_duration(settings.join_timeout)));
        }
      });
      auto m = message("hold");
      m["rank"] = rank;
      for (std::uint32_t r : rejoin->waiting) rank_peers[r]->channel->send(m);
      if (rejoin->waiting.empty()) finish_hold();
    }
  }

  void on_held(const Peer& p, const json::object& m) {
    if (!rejoin || rejoin->phase != Rejoin::Phase::holding || get_u32(m, "rank") != rejoin->info.rank) return;
    if (m.if_contains("error")) {
      return abandon_rejoin(*rejoin->peer,
                            fmt::format("rank {} could not hold for it: {}", p.number, get_string(m, "error")));
    }
    rejoin->step = std::max(rejoin->step, get_i64(m, "step"));
    rejoin->waiting.erase(p.number);
    if (rejoin->waiting.empty()) finish_hold();
  }

  // Every rank holds: the new process learns the step and the others' addresses.
  void finish_hold() {
    rejoin->phase = Rejoin::Phase::starting;
    json::array ranks;
    for (std::uint32_t r = 0; r < settings.world_size; ++r) {
      ranks.push_back(rank_info_json(r == rejoin->info.rank ? rejoin->info : *infos[r]));
    }
    auto m = message("rejoin");
    m["step"] = rejoin->step;
    m["ranks"] = std::move(ranks);
    rejoin->peer->channel->send(m);
  }

  // The new process has its runtime and data plane: it is in the job again, and every other
  // rank takes it back.
  void on_ready(Peer& p) {
    if (!rejoin || rejoin->peer.get() != &p || rejoin->phase != Rejoin::Phase::starting) return;
    const std::uint32_t rank = rejoin->info.rank;
    {
      std::lock_guard lock(mutex);  // departed() reads it from other threads
      std::erase_if(left, [&](const auto& l) { return l.first == rank; });
    }
    infos[rank] = rejoin->info;
    rank_peers[rank] = rejoin->peer;
    p.rejoining = false;
    rejoin->phase = Rejoin::Phase::taking_back;
    rejoin->waiting = ranks_in_job(rank);
    auto m = message("rejoined");
    m["rank"] = rank;
    m["step"] = rejoin->step;
    m["host"] = js(rejoin->info.host);
    m["data_address"] = json::string(base64_encode(rejoin->info.data_address));
    for (std::uint32_t r : rejoin->waiting) rank_peers[r]->channel->send(m);
    if (rejoin->waiting.empty()) complete_rejoin();
  }

  void on_taken_back(const Peer& p, const json::object& m) {
    if (!rejoin || rejoin->phase != Rejoin::Phase::taking_back || get_u32(m, "rank") != rejoin->info.rank) return;
    if (m.if_contains("error")) {
      return fail_job(fmt::format("rank {} (host {}) could not take rank {} back: {}", p.number, p.host,
                                  rejoin->info.rank, get_string(m, "error")),
                      p.number, p.host);
    }
    rejoin->waiting.erase(p.number);
    if (rejoin->waiting.empty()) complete_rejoin();
  }

  void complete_rejoin() {
    rejoin->timer->cancel();
    {
      // Recorded before "go": whoever learns from the rank that it is back finds it here.
      std::lock_guard lock(mutex);  // RendezvousServer::rejoined() reads it from other threads
      rejoined.emplace_back(rejoin->info.rank, rejoin->step);
    }
    auto go = message("go");
    go["step"] = rejoin->step;
    rejoin->peer->channel->send(go);
    rejoin.reset();
    start_next_rejoin();
  }

  /// The rank coming back (`p`) will not: it died, failed or the others did not take it back in
  /// time. Before the others took it back, they let go of the hold and it stays left; after,
  /// it leaves again as any rank that may leave.
  void abandon_rejoin(Peer& p, const std::string& reason) {
    if (auto it = std::find_if(rejoin_queue.begin(), rejoin_queue.end(), [&](const Rejoin& r) { return r.peer.get() == &p; });
        it != rejoin_queue.end()) {
      rejoin_queue.erase(it);
      if (p.channel->open()) refuse(p, fmt::format("rank {} cannot come back: {}", p.number, reason));
      return;
    }
    if (!rejoin || rejoin->peer.get() != &p) return;
    const std::uint32_t rank = rejoin->info.rank;
    rejoin->timer->cancel();
    const bool taken = rejoin->phase == Rejoin::Phase::taking_back;
    rejoin.reset();
    p.rejoining = false;
    if (taken) {
      rank_left(rank, reason);
    } else {
      auto m = message("release");
      m["rank"] = rank;
      for (std::uint32_t r : ranks_in_job(rank)) rank_peers[r]->channel->send(m);
      if (p.channel->open()) refuse(p, fmt::format("rank {} cannot come back: {}", rank, reason));
    }
    start_next_rejoin();
  }

  void on_launcher(const std::shared_ptr<Peer>& p, const json::object& m) {
    const std::uint32_t node = get_u32(m, "node_rank");
    const std::string host = m.if_contains("host") ? get_string(m, "host") : std::string("unknown");
    const std::optional<std::string> token = m.if_contains("token") ? std::optional(get_string(m, "token")) : std::nullopt;
    if (ended) return refuse(*p, fmt::format("the job has already ended: {}", ended_reason));
    if (token ? !tokens_equal(*token, settings.token) : !settings.hand_out_token) {
      return refuse(*p, token ? "wrong job token" : "this job needs a token (the server does not hand it out)");
    }
    if (node == 0 || node > settings.launchers) {
      return refuse(*p, settings.launchers == 0
                            ? fmt::format("node {}: this job expects no launchers of other nodes", node)
                            : fmt::format("node {} is out of range: this job expects launchers of nodes 1 to {}", node,
                                          settings.launchers));
    }
    if (launcher_peers.count(node) != 0) {
      return refuse(*p, fmt::format("a launcher of node {} already joined (from host {})", node, launcher_peers[node]->host));
    }
    p->role = Role::launcher;
    p->number = node;
    p->host = host;
    launcher_peers[node] = p;
    auto welcome = message("welcome");
    welcome["token"] = js(settings.token);
    p->channel->send(welcome);
    if (launcher_peers.size() == settings.launchers) launcher_timer.cancel();
  }

  void on_join_timeout() {
    if (ended || table_sent) return;
    std::vector<std::uint32_t> missing;
    std::vector<std::uint32_t> joined;
    for (std::uint32_t r = 0; r < settings.world_size; ++r) (infos[r] ? joined : missing).push_back(r);
    fail_job(fmt::format("{} did not join within {} (joined: {})", phrase("rank", "ranks", missing),
                         format_duration(settings.join_timeout), number_list(joined)),
             missing.front(), {});
  }

  void on_launcher_join_timeout() {
    if (ended || launcher_peers.size() == settings.launchers) return;
    std::vector<std::uint32_t> missing;
    std::vector<std::uint32_t> joined;
    for (std::uint32_t n = 1; n <= settings.launchers; ++n) (launcher_peers.count(n) ? joined : missing).push_back(n);
    fail_job(fmt::format("{} did not join within {} of the server's start (joined: {})",
                         phrase("launcher of node", "launchers of nodes", missing),
                         format_duration(settings.join_timeout), number_list(joined)),
             std::nullopt, {});
  }

  void on_barrier(const Peer& p, const std::string& name) {
    if (p.role != Role::rank || ended || has_left(p.number)) return;
    auto [it, is_new] = barriers.try_emplace(name);
    Barrier& b = it->second;
    if (is_new) {
      b.generation = ++barrier_generation;
      b.timer = std::make_shared<asio::steady_timer>(io, settings.barrier_timeout);
      b.timer->async_wait([this, name, generation = b.generation](error_code ec) {
        if (!ec) on_barrier_timeout(name, generation);
      });
    }
    b.arrived.insert(p.number);
    complete_barrier(it);
  }

  /// Completes barrier `it` if every rank has arrived or left.
  void complete_barrier(std::map<std::string, Barrier>::iterator it) {
    Barrier& b = it->second;
    for (std::uint32_t r = 0; r < settings.world_size; ++r) {
      if (b.arrived.count(r) == 0 && !has_left(r)) return;
    }
    b.timer->cancel();
    if (!formed) {
      formed = true;
      // The launchers of other nodes learn which ranks may leave: such a rank's death is then
      // reported, not acted on (LauncherClient::may_leave).
      json::array leavers;
      for (std::uint32_t r = 0; r < settings.world_size; ++r) {
        if (infos[r] && infos[r]->may_leave) leavers.push_back(r);
      }
      if (!leavers.empty()) {
        auto m = message("may_leave");
        m["ranks"] = std::move(leavers);
        for (const auto& [node, launcher] : launcher_peers) launcher->channel->send(m);
      }
    }
    auto done = message("barrier_done");
    done["name"] = js(it->first);
    barriers.erase(it);
    for (const auto& peer : rank_peers) {
      if (peer && !has_left(peer->number)) peer->channel->send(done);
    }
  }

  bool has_left(std::uint32_t rank) const {
    return std::any_of(left.begin(), left.end(), [&](const auto& l) { return l.first == rank; });
  }

  /// Only once the job has formed (every rank passed its first barrier: run_job's "start",
  /// after the data plane connected): a rank lost before then ends the job, as any other.
  bool may_leave(std::uint32_t rank) const {
    return formed && !ended && rank < settings.world_size && infos[rank] && infos[rank]->may_leave;
  }

  /// A rank that may leave has left (died, failed, went silent): the others are told and it is
  /// counted out of every barrier and of the final bye. The first reason stays. If no rank that
  /// may leave is left, the job fails: the others (the servers) cannot go on alone.
  void rank_left(std::uint32_t rank, const std::string& reason) {
    if (!may_leave(rank) || has_left(rank)) return;
    if (rank_peers[rank] && rank_peers[rank]->said_bye) return;
    const std::string host = infos[rank]->host;
    {
      std::lock_guard lock(mutex);  // departed() reads it from other threads
      left.emplace_back(rank, reason);
    }
    bool any_stays = false;
    for (std::uint32_t r = 0; r < settings.world_size; ++r) {
      if (infos[r] && infos[r]->may_leave && !has_left(r)) any_stays = true;
    }
    if (!any_stays) {
      return fail_job(fmt::format("rank {} (host {}) left ({}), the last of the ranks that may leave: the others "
                                  "cannot go on without them",
                                  rank, host, reason),
                      rank, host);
    }
    auto m = message("left");
    m["rank"] = rank;
    m["host"] = js(host);
    m["reason"] = js(reason);
    for (const auto& peer : rank_peers) {
      if (peer && peer->number != rank && !peer->said_bye && !has_left(peer->number)) peer->channel->send(m);
    }
    for (auto it = barriers.begin(); it != barriers.end();) {
      auto next = std::next(it);
      complete_barrier(it);
      it = next;
    }
    if (rejoin && rejoin->waiting.erase(rank) != 0 && rejoin->waiting.empty()) {
      if (rejoin->phase == Rejoin::Phase::holding) finish_hold();
      else if (rejoin->phase == Rejoin::Phase::taking_back) complete_rejoin();
    }
    check_all_done();
  }

  void check_all_done() {
    if (ended || byes + left.size() < settings.world_size) return;
    JobOutcome ok;
    ok.ok = true;
    set_outcome(ok);
    for (const auto& [node, launcher] : launcher_peers) launcher->channel->send(message("done"));
  }

  std::vector<std::uint32_t> missing_at(const Barrier& b) const {
    std::vector<std::uint32_t> missing;
    for (std::uint32_t r = 0; r < settings.world_size; ++r) {
      if (b.arrived.count(r) == 0 && !has_left(r)) missing.push_back(r);
    }
    return missing;
  }

  void on_barrier_timeout(const std::string& name, std::uint64_t generation) {
    auto it = barriers.find(name);
    if (ended || it == barriers.end() || it->second.generation != generation) return;
    const auto missing = missing_at(it->second);
    const std::vector<std::uint32_t> arrived(it->second.arrived.begin(), it->second.arrived.end());
    const std::uint32_t first = missing.front();
    fail_job(fmt::format("barrier '{}': {} did not arrive within {} (arrived: {})", name, phrase("rank", "ranks", missing),
                         format_duration(settings.barrier_timeout), number_list(arrived)),
             first, infos[first] ? infos[first]->host : std::string());
  }

  void on_barrier_status(const Peer& p, const std::string& name) {
    json::array missing;
    if (auto it = barriers.find(name); it != barriers.end()) {
      for (auto r : missing_at(it->second)) missing.push_back(r);
    }
    auto reply = message("barrier_status");
    reply["name"] = js(name);
    reply["missing"] = std::move(missing);
    p.channel->send(reply);
  }

  void on_join_status(const Peer& p) {
    json::array missing;
    for (std::uint32_t r = 0; r < settings.world_size; ++r) {
      if (!infos[r]) missing.push_back(r);
    }
    auto reply = message("join_status");
    reply["missing"] = std::move(missing);
    p.channel->send(reply);
  }

  void on_fail(const Peer& p, const json::object& m) {
    const std::string reason = get_string(m, "reason");
    if (p.rejoining) return abandon_rejoin(const_cast<Peer&>(p), reason);
    if (p.role == Role::rank) {
      if (may_leave(p.number)) return rank_left(p.number, reason);
      return fail_job(fmt::format("rank {} (host {}): {}", p.number, p.host, reason), p.number, p.host);
    }
    // A launcher reports one of its ranks, or (without "rank") itself.
    if (!m.if_contains("rank")) return fail_job(fmt::format("{}: {}", describe(p), reason), std::nullopt, p.host);
    const std::uint32_t rank = get_u32(m, "rank");
    const std::string host = rank < settings.world_size && infos[rank] ? infos[rank]->host : p.host;
    if (may_leave(rank)) return rank_left(rank, reason);
    fail_job(fmt::format("rank {} (host {}): {}", rank, host, reason), rank, host);
  }

  void on_bye(Peer& p) {
    if (p.said_bye) return;
    p.said_bye = true;
    if (p.role == Role::launcher) {
      std::lock_guard lock(mutex);
      ++launchers_finished;
      cv.notify_all();
    }
    if (p.role != Role::rank || has_left(p.number)) return;
    ++byes;
    // Launchers of other nodes learn that the job is over (check_all_done), so the server
    // closing later is not a failure to them.
    check_all_done();
  }

  void on_lost(const Peer& p, Loss loss, const std::string& why) {
    if (p.rejoining) return abandon_rejoin(const_cast<Peer&>(p), "it lost its control connection (did the process die?)");
    if (p.role == Role::unknown || p.said_bye || ended) return;
    if (p.role == Role::rank && has_left(p.number)) return;
    if (loss == Loss::protocol) {
      return fail_job(fmt::format("{} broke the control protocol: it sent {}", describe(p), why), rank_of(p), p.host);
    }
    auto timer = std::make_shared<asio::steady_timer>(io, lost_connection_grace);
    timer->async_wait([this, timer, reason = fmt::format("{} lost its control connection (did the process die?)", describe(p)),
                       rank = rank_of(p), host = p.host, id = p.id](error_code ec) {
      if (ec) return;
      // Meanwhile the rank left and came back on a new connection: this one's loss is old news.
      if (rank && (!rank_peers[*rank] || rank_peers[*rank]->id != id)) return;
      // The launcher's word on why (rank_exited) may have come within the grace.
      if (rank && may_leave(*rank)) return rank_left(*rank, "it lost its control connection (did the process die?)");
      fail_job(reason, rank, host);
    });
  }

  void arm_tick() {
    tick_timer.expires_after(tick_period(settings.heartbeat_interval, settings.heartbeat_timeout));
    tick_timer.async_wait([this](error_code ec) {
      if (!ec && !stopping) tick();
    });
  }

  void tick() {
    const auto now = Clock::now();
    const std::vector<std::shared_ptr<Peer>> snapshot(peers.begin(), peers.end());
    for (const auto& p : snapshot) {
      if (!p->channel->open()) continue;
      const bool silent = now - p->channel->last_heard() > settings.heartbeat_timeout;
      if (p->role == Role::unknown) {
        if (silent) p->channel->close_now();  // connected but never said who it is
        continue;
      }
      if (ended || p->said_bye) continue;
      if (p->role == Role::rank && has_left(p->number) && !p->rejoining) continue;
      if (silent && p->role == Role::rank && may_leave(p->number)) {
        rank_left(p->number, fmt::format("it sent nothing for {}", format_duration(settings.heartbeat_timeout)));
        continue;
      }
      if (silent) {
        fail_job(fmt::format("{} sent nothing for {}", describe(*p), format_duration(settings.heartbeat_timeout)),
                 rank_of(*p), p->host);
        break;
      }
      if (now - p->channel->last_sent() >= settings.heartbeat_interval) p->channel->send(message("heartbeat"));
    }
    arm_tick();
  }

  /// Records the outcome; the first one wins. Returns whether this call set it.
  bool set_outcome(const JobOutcome& o) {
    if (ended) return false;
    ended = true;
    ended_reason = o.ok ? "it finished" : o.reason;
    std::lock_guard lock(mutex);
    outcome = o;
    cv.notify_all();
    return true;
  }

  /// Ends the job: abort to every rank and launcher (or, when the plans differ, refused to the
  /// ranks, who are still joining).
  void fail_job(const std::string& reason, std::optional<std::uint32_t> rank, const std::string& host,
                bool refuse_ranks = false) {
    JobOutcome failed;
    failed.reason = reason;
    failed.failed_rank = rank;
    failed.failed_host = host;
    if (!set_outcome(failed)) return;
    join_timer.cancel();
    launcher_timer.cancel();
    for (auto& [name, b] : barriers) b.timer->cancel();
    barriers.clear();
    auto abort = message("abort");
    abort["reason"] = js(reason);
    const std::vector<std::shared_ptr<Peer>> snapshot(peers.begin(), peers.end());
    for (const auto& p : snapshot) {
      if (p->role == Role::unknown) {
        p->channel->close_gracefully();
      } else if (p->role == Role::rank && refuse_ranks) {
        refuse(*p, reason);
      } else if (!p->said_bye) {
        p->channel->send(abort);
      }
    }
  }

  void begin_shutdown() {
    if (!ended) fail_job("the rendezvous server shut down before the job ended", std::nullopt, {});
    stopping = true;
    error_code ec;
    acceptor.close(ec);
    tick_timer.cancel();
    accept_retry.cancel();
    const std::vector<std::shared_ptr<Peer>> snapshot(peers.begin(), peers.end());
    for (const auto& p : snapshot) p->channel->close_gracefully();
    work.reset();
    std::lock_guard lock(mutex);
    shutdown_started = true;
    cv.notify_all();
  }

  ServerSettings settings;
  // Declared first, destroyed last: the sockets and timers below belong to it.
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_retry{io};
  asio::steady_timer tick_timer{io};
  asio::steady_timer join_timer{io};
  asio::steady_timer launcher_timer{io};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::uint16_t bound_port = 0;

  // io thread only
  std::list<std::shared_ptr<Peer>> peers;
  std::vector<std::shared_ptr<Peer>> rank_peers;  // by rank, once its hello was accepted
  std::vector<std::optional<RankInfo>> infos;
  std::map<std::uint32_t, std::shared_ptr<Peer>> launcher_peers;
  std::map<std::string, Barrier> barriers;
  std::map<std::string, std::pair<std::uint32_t, std::string>> published;  // key -> (rank, value)
  std::uint64_t barrier_generation = 0;
  std::uint32_t joined_ranks = 0;
  std::uint64_t peer_count = 0;  // connections so far (Peer::id)
  std::uint32_t byes = 0;
  // Ranks that left (rank_left), in order: written on the io thread under `mutex`, which
  // departed() takes to read it from others.
  std::vector<std::pair<std::uint32_t, std::string>> left;
  std::optional<Rejoin> rejoin;     // the rank coming back now
  std::deque<Rejoin> rejoin_queue;  // the ones after it
  std::vector<std::pair<std::uint32_t, std::int64_t>> rejoined;  // (rank, step), in order; under mutex
  bool join_timer_started = false;
  bool table_sent = false;
  bool formed = false;  // a barrier completed (may_leave)
  bool ended = false;
  std::string ended_reason;
  bool stopping = false;

  // shared with the caller's threads
  mutable std::mutex mutex;
  std::condition_variable cv;
  std::optional<JobOutcome> outcome;
  std::uint32_t launchers_finished = 0;  // under mutex
  std::size_t open_channels = 0;
  bool shutdown_started = false;
  std::uint64_t posted_aborts_done = 0;

  std::thread thread;  // last: started when everything above exists, joined in ~Impl
};

RendezvousServer::RendezvousServer(ServerSettings settings) : impl_(std::make_unique<Impl>(std::move(settings))) {}

RendezvousServer::~RendezvousServer() = default;

std::uint16_t RendezvousServer::port() const { return impl_->bound_port; }

std::optional<JobOutcome> RendezvousServer::wait_for(std::chrono::milliseconds timeout) {
  std::unique_lock lock(impl_->mutex);
  impl_->cv.wait_for(lock, timeout, [&] { return impl_->outcome.has_value(); });
  return impl_->outcome;
}

void RendezvousServer::abort(const std::string& reason, std::optional<std::uint32_t> rank, const std::string& host) {
  Impl* impl = impl_.get();
  std::uint64_t ticket = 0;
  {
    std::lock_guard lock(impl->mutex);
    if (impl->outcome) return;  // the first failure wins
    ticket = impl->posted_aborts_done + 1;
  }
  asio::post(impl->io, [impl, reason, rank, host] {
    std::string text = reason;
    std::string where = host;
    if (rank) {
      if (where.empty() && *rank < impl->settings.world_size && impl->infos[*rank]) where = impl->infos[*rank]->host;
      text = where.empty() ? fmt::format("rank {}: {}", *rank, reason) : fmt::format("rank {} (host {}): {}", *rank, where, reason);
    }
    impl->fail_job(text, rank, where);
    std::lock_guard lock(impl->mutex);
    ++impl->posted_aborts_done;
    impl->cv.notify_all();
  });
  // Wait (bounded) until the io thread has recorded it, so outcome() reflects this abort.
  std::unique_lock lock(impl->mutex);
  impl->cv.wait_for(lock, close_grace, [&] { return impl->posted_aborts_done >= ticket; });
}

void RendezvousServer::send_command(const std::string& kind, const std::string& body) {
  Impl* impl = impl_.get();
  asio::post(impl->io, [impl, kind, body] { impl->send_command(kind, body); });
}

bool RendezvousServer::rank_exited(std::uint32_t rank, const std::string& reason) {
  Impl* impl = impl_.get();
  auto answer = std::make_shared<std::promise<bool>>();
  auto result = answer->get_future();
  asio::post(impl->io, [impl, rank, reason, answer] {
    const bool leaves = impl->may_leave(rank) || impl->has_left(rank);
    if (leaves) impl->rank_left(rank, reason);
    answer->set_value(leaves);
  });
  // The io thread answers at once; a server shutting down may never run it.
  if (result.wait_for(close_grace) != std::future_status::ready) return false;
  return result.get();
}

std::vector<std::pair<std::uint32_t, std::int64_t>> RendezvousServer::rejoined() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->rejoined;
}

std::vector<std::pair<std::uint32_t, std::string>> RendezvousServer::departed() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->left;
}

std::uint32_t RendezvousServer::finished_launchers() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->launchers_finished;
}

std::optional<JobOutcome> RendezvousServer::outcome() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->outcome;
}

// ---- the clients -------------------------------------------------------------------------

namespace {

/// What ControlClient and LauncherClient share: connecting with retries, the hello and its
/// reply, heartbeats, abort handling, barriers, and a bounded close. The socket lives on the
/// client's own io thread (started by join()); the caller's thread posts into it and waits on
/// `cv_` with a deadline.
class ClientCore {
 public:
  struct Config {
    std::string master;
    std::string who;  // "rank 2", "launcher of node 1": for messages
    milliseconds join_timeout;
    milliseconds heartbeat_interval;
    milliseconds heartbeat_timeout;
  };

  explicit ClientCore(Config config) : config_(std::move(config)) {}
  ~ClientCore() { close(std::nullopt); }
  ClientCore(const ClientCore&) = delete;
  ClientCore& operator=(const ClientCore&) = delete;

  const Config& config() const { return config_; }

  void set_on_abort(std::function<void(const std::string&)> callback) {
    std::lock_guard lock(mutex_);
    on_abort_ = std::move(callback);
  }

  /// Connects (retrying), sends `hello`, waits for the message of type `reply_type`. Throws.
  json::object join(json::object hello, std::string reply_type) {
    const auto deadline = Clock::now() + config_.join_timeout;
    auto [host, port] = parse_endpoint(config_.master);
    {
      std::lock_guard lock(mutex_);
      if (started_) throw TransportError(fmt::format("{}: join() was already called", config_.who));
      started_ = true;
      reply_type_ = std::move(reply_type);
    }
    host_ = std::move(host);
    port_text_ = std::to_string(port);
    hello_ = std::move(hello);
    work_.emplace(io_.get_executor());
    thread_ = std::thread([this] { run_io(io_); });
    asio::post(io_, [this] { attempt(); });

    std::unique_lock lock(mutex_);
    auto answered = [&] { return reply_ || refused_ || aborted_; };
    cv_.wait_until(lock, deadline, answered);
    if (!answered() && channel_open_) {
      // Connected, but the table has not come: ask the server who it still waits for.
      post_send(message("join_status"));
      cv_.wait_for(lock, status_grace, [&] { return answered() || join_missing_.has_value(); });
    }
    if (reply_) {
      joined_ = true;
      return *reply_;
    }
    std::string error;
    if (refused_) {
      error = fmt::format("rendezvous server at {} refused {}: {}", config_.master, config_.who, *refused_);
    } else if (aborted_) {
      error = fmt::format("{} could not join: the job was aborted: {}", config_.who, *aborted_);
    } else if (!connected_) {
      error = fmt::format("{} could not reach rendezvous server at {} within {}: {}", config_.who, config_.master,
                          format_duration(config_.join_timeout), last_error_.empty() ? "no answer" : last_error_);
    } else {
      std::string missing;
      if (join_missing_ && !join_missing_->empty()) {
        missing = fmt::format(" (not joined yet: {})", phrase("rank", "ranks", *join_missing_));
      }
      error = fmt::format("{} timed out after {} waiting for the table from the rendezvous server at {}{}", config_.who,
                          format_duration(config_.join_timeout), config_.master, missing);
    }
    lock.unlock();
    close(std::nullopt);
    throw TransportError(error);
  }

  /// Waits for the barrier `name`; see ControlClient::barrier.
  void barrier(const std::string& name, milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    std::unique_lock lock(mutex_);
    if (aborted_) throw TransportError(fmt::format("barrier '{}': the job was aborted: {}", name, *aborted_));
    if (!joined_ || closed_) throw TransportError(fmt::format("barrier '{}': {} is not joined", name, config_.who));
    // The n-th barrier of a name completes with the n-th barrier_done of that name, so a name can
    // be reused; after a timeout the same barrier can be waited for again without re-entering it.
    const std::uint64_t target = barriers_passed_[name] + 1;
    if (barriers_done_[name] < target && barriers_entered_[name] < target) {
      barriers_entered_[name] = target;
      auto m = message("barrier");
      m["name"] = js(name);
      post_send(std::move(m));
    }
    cv_.wait_until(lock, deadline, [&] { return barriers_done_[name] >= target || aborted_ || !channel_open_; });
    if (barriers_done_[name] >= target) {
      barriers_passed_[name] = target;
      return;
    }
    if (aborted_) throw TransportError(fmt::format("barrier '{}': the job was aborted: {}", name, *aborted_));
    if (!channel_open_) throw TransportError(fmt::format("barrier '{}': the control connection is closed", name));
    // Timed out: ask the server who has not arrived, briefly.
    barrier_missing_.erase(name);
    auto query = message("barrier_status");
    query["name"] = js(name);
    post_send(std::move(query));
    cv_.wait_for(lock, status_grace, [&] { return barrier_missing_.count(name) != 0 || aborted_ || !channel_open_; });
    std::string missing;
    if (auto it = barrier_missing_.find(name); it != barrier_missing_.end() && !it->second.empty()) {
      missing = fmt::format(" (not arrived: {})", phrase("rank", "ranks", it->second));
    }
    throw TransportError(fmt::format("barrier '{}' timed out after {} ms{}", name, timeout.count(), missing));
  }

  /// See ControlClient::publish.
  void publish(const std::string& key, const std::string& value) {
    {
      std::lock_guard lock(mutex_);
      if (aborted_) throw TransportError(fmt::format("publish '{}': the job was aborted: {}", key, *aborted_));
      if (!joined_ || closed_) throw TransportError(fmt::format("publish '{}': {} is not joined", key, config_.who));
      values_.emplace(key, value);
    }
    auto m = message("publish");
    m["key"] = js(key);
    m["value"] = json::string(base64_encode(value));
    post_send(std::move(m));
  }

  /// See ControlClient::fetch.
  std::string fetch(const std::string& key, milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    std::unique_lock lock(mutex_);
    if (!joined_ || closed_) throw TransportError(fmt::format("fetch '{}': {} is not joined", key, config_.who));
    cv_.wait_until(lock, deadline, [&] { return values_.count(key) != 0 || aborted_ || !channel_open_; });
    if (auto it = values_.find(key); it != values_.end()) return it->second;
    if (aborted_) throw TransportError(fmt::format("fetch '{}': the job was aborted: {}", key, *aborted_));
    if (!channel_open_) throw TransportError(fmt::format("fetch '{}': the control connection is closed", key));
    throw TransportError(fmt::format("fetch '{}': no rank published it within {}", key, format_duration(timeout)));
  }

  /// Sends `m` and waits (up to `bound`) until it is written. Best effort; never throws.
  void send_flushed(json::object m, milliseconds bound) {
    auto written = std::make_shared<bool>(false);
    asio::post(io_, [this, m = std::move(m), written] {
      auto mark = [this, written](bool) {
        std::lock_guard lock(mutex_);
        *written = true;
        cv_.notify_all();
      };
      if (!channel_ || closing_) return mark(false);
      channel_->send(m);
      channel_->when_flushed(mark);
    });
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, bound, [&] { return *written; });
  }

  /// Sends `last` (if any and still connected), closes gracefully and stops the thread. Bounded;
  /// idempotent; never throws.
  void close(std::optional<json::object> last) {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      closed_ = true;
    }
    asio::post(io_, [this, last = std::move(last)] { begin_close(last); });
    {
      std::unique_lock lock(mutex_);
      cv_.wait_for(lock, close_grace + milliseconds{200}, [&] { return close_started_ && !channel_open_; });
    }
    io_.stop();
    thread_.join();
  }

  bool joined() const {
    std::lock_guard lock(mutex_);
    return joined_ && !closed_;
  }
  bool job_done() const {
    std::lock_guard lock(mutex_);
    return job_done_;
  }
  std::optional<std::string> aborted() const {
    std::lock_guard lock(mutex_);
    return aborted_;
  }

  bool may_leave(std::uint32_t rank) const {
    std::lock_guard lock(mutex_);
    return may_leave_.contains(rank);
  }
  void set_on_left(std::function<void(std::uint32_t, const std::string&)> callback) {
    std::lock_guard lock(mutex_);
    on_left_ = std::move(callback);
  }
  void set_on_command(std::function<void(const std::string&, const std::string&)> callback) {
    std::lock_guard lock(mutex_);
    on_command_ = std::move(callback);
  }
  void set_on_rejoin(RejoinHandlers handlers) {
    std::lock_guard lock(mutex_);
    rejoin_handlers_ = std::move(handlers);
  }

  /// A rank coming back: says it is ready and waits for the others to take it back (go).
  void ready(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    if (!send_async(message("ready"))) throw TransportError(fmt::format("{} is not joined", config_.who));
    std::unique_lock lock(mutex_);
    cv_.wait_until(lock, deadline, [&] { return go_ || aborted_ || refused_ || !channel_open_; });
    if (go_) return;
    if (aborted_) throw TransportError(fmt::format("{} could not come back: the job was aborted: {}", config_.who, *aborted_));
    if (refused_) throw TransportError(fmt::format("{} could not come back: {}", config_.who, *refused_));
    if (!channel_open_) throw TransportError(fmt::format("{} could not come back: the control connection closed", config_.who));
    throw TransportError(fmt::format("{} could not come back: the others did not take it back within {}", config_.who,
                                     format_duration(timeout)));
  }

  /// Any thread, after join: queues `m` for the io thread. False if the connection is not usable.
  bool send_async(json::object m) {
    {
      std::lock_guard lock(mutex_);
      if (!joined_ || closed_ || aborted_ || !channel_open_) return false;
    }
    post_send(std::move(m));
    return true;
  }

  /// After join: `rounds` clock exchanges, one at a time; keeps the one with the shortest round
  /// trip (its error is at most half of it). Gives up quietly after `bound` (an older server).
  void measure_clock(int rounds, milliseconds bound) {
    const auto deadline = Clock::now() + bound;
    for (int i = 0; i < rounds; ++i) {
      const std::int64_t t0 = Clock::now().time_since_epoch().count();
      auto m = message("clock");
      m["t0"] = t0;
      if (!send_async(std::move(m))) return;
      std::unique_lock lock(mutex_);
      if (!cv_.wait_until(lock, deadline, [&] { return clock_reply_t0_ == t0 || aborted_ || !channel_open_; })) return;
      if (clock_reply_t0_ != t0) return;
      const std::int64_t t1 = Clock::now().time_since_epoch().count();
      const std::int64_t rtt = t1 - t0;
      if (clock_rtt_ < 0 || rtt < clock_rtt_) {
        clock_rtt_ = rtt;
        clock_offset_ = clock_reply_ts_ - (t0 + rtt / 2);
      }
    }
  }
  std::int64_t clock_offset() const {
    std::lock_guard lock(mutex_);
    return clock_offset_;
  }
  std::int64_t clock_rtt() const {
    std::lock_guard lock(mutex_);
    return clock_rtt_ < 0 ? 0 : clock_rtt_;
  }

 private:
  // ---- io thread ----

  void attempt() {
    if (closing_) return;
    resolver_.async_resolve(host_, port_text_, [this](error_code ec, const tcp::resolver::results_type& results) {
      if (closing_) return;
      if (ec) return retry(fmt::format("cannot resolve '{}': {}", host_, ec.message()));
      connecting_ = std::make_shared<tcp::socket>(io_);
      asio::async_connect(*connecting_, results, [this](error_code connect_ec, const tcp::endpoint&) {
        if (closing_) return;
        if (connect_ec) {
          connecting_.reset();
          return retry(connect_ec.message());
        }
        auto socket = std::move(*connecting_);
        connecting_.reset();
        on_connected(std::move(socket));
      });
    });
  }

  void retry(const std::string& error) {
    {
      std::lock_guard lock(mutex_);
      last_error_ = error;
    }
    retry_timer_.expires_after(connect_retry_interval);
    retry_timer_.async_wait([this](error_code ec) {
      if (!ec) attempt();
    });
  }

  void on_connected(tcp::socket socket) {
    channel_ = std::make_shared<Channel>(std::move(socket), max_client_line);
    {
      std::lock_guard lock(mutex_);
      connected_ = true;
      channel_open_ = true;
    }
    channel_->start({
        [this](const json::object& m) { on_message(m); },
        [this](Loss loss, const std::string& why) { on_lost(loss, why); },
        [this] {
          std::lock_guard lock(mutex_);
          channel_open_ = false;
          cv_.notify_all();
        },
    });
    channel_->send(hello_);
    arm_tick();
  }

  void on_message(const json::object& m) {
    try {
      const std::string type = get_string(m, "type");
      if (type == "heartbeat") return;
      if (type == "abort") return abort_locally(get_string(m, "reason"));
      if (type == "left") {
        std::function<void(std::uint32_t, const std::string&)> callback;
        {
          std::lock_guard lock(mutex_);
          callback = on_left_;
        }
        if (callback) callback(get_u32(m, "rank"), get_string(m, "reason"));
        return;
      }
      if (type == "hold" || type == "rejoined" || type == "release") return on_rejoin_message(type, m);
      if (type == "command") {
        std::function<void(const std::string&, const std::string&)> callback;
        {
          std::lock_guard lock(mutex_);
          callback = on_command_;
        }
        if (callback) callback(get_string(m, "kind"), get_string(m, "body"));
        return;
      }
      std::unique_lock lock(mutex_);
      if (type == reply_type_) {
        reply_ = m;
      } else if (type == "barrier_done") {
        ++barriers_done_[get_string(m, "name")];
      } else if (type == "barrier_status") {
        barrier_missing_[get_string(m, "name")] = get_u32_list(m, "missing");
      } else if (type == "join_status") {
        join_missing_ = get_u32_list(m, "missing");
      } else if (type == "value") {
        values_[get_string(m, "key")] = get_bytes(m, "value");
      } else if (type == "done") {
        job_done_ = true;
      } else if (type == "go") {
        go_ = true;
      } else if (type == "may_leave") {
        const auto ranks = get_u32_list(m, "ranks");
        may_leave_.insert(ranks.begin(), ranks.end());
      } else if (type == "clock_reply") {
        clock_reply_ts_ = get_i64(m, "ts");
        clock_reply_t0_ = get_i64(m, "t0");
      } else if (type == "refused") {
        refused_ = get_string(m, "reason");
        lock.unlock();
        tick_timer_.cancel();
        channel_->close_gracefully();
        lock.lock();
      }
      cv_.notify_all();
    } catch (const ProtocolError& e) {
      abort_locally(fmt::format("the rendezvous server at {} sent a malformed message: {}", config_.master, e.what()));
    }
  }

  void on_lost(Loss loss, const std::string& why) {
    {
      std::lock_guard lock(mutex_);
      if (closed_ || refused_ || job_done_) return;
    }
    abort_locally(loss == Loss::closed
                      ? fmt::format("the rendezvous server at {} closed the control connection ({}); did it die?",
                                    config_.master, why)
                      : fmt::format("the rendezvous server at {} broke the control protocol: it sent {}",
                                    config_.master, why));
  }

  // Another rank comes back (ControlClient::on_rejoin): the handlers run here, on the io thread,
  // in order with the other messages (a rank that leaves again is told after it came back).
  void on_rejoin_message(const std::string& type, const json::object& m) {
    RejoinHandlers handlers;
    {
      std::lock_guard lock(mutex_);
      handlers = rejoin_handlers_;
    }
    const std::uint32_t rank = get_u32(m, "rank");
    auto reply = message(type == "hold" ? "held" : "taken_back");
    reply["rank"] = rank;
    try {
      if (type == "release") {
        if (handlers.release) handlers.release(rank);
        return;
      }
      if (type == "hold") {
        reply["step"] = handlers.hold ? handlers.hold(rank) : std::int64_t{0};
      } else {
        RankInfo info;
        info.rank = rank;
        info.host = get_string(m, "host");
        info.data_address = get_bytes(m, "data_address");
        info.may_leave = true;
        if (handlers.rejoined) handlers.rejoined(info, get_i64(m, "step"));
      }
    } catch (const ProtocolError&) {
      throw;
    } catch (const std::exception& e) {
      reply["error"] = js(std::string(e.what()));
    }
    if (channel_ && !closing_) channel_->send(reply);
  }

  /// Records the abort, closes the connection and calls on_abort, once.
  void abort_locally(const std::string& reason) {
    std::function<void(const std::string&)> callback;
    {
      std::lock_guard lock(mutex_);
      if (aborted_ || closed_) return;
      aborted_ = reason;
      callback = on_abort_;
      cv_.notify_all();
    }
    tick_timer_.cancel();
    if (channel_) channel_->close_gracefully();
    if (callback) {
      try {
        callback(reason);
      } catch (...) {
        // The callback is the user's; its exception must not end the io thread.
      }
    }
  }

  void arm_tick() {
    tick_timer_.expires_after(tick_period(config_.heartbeat_interval, config_.heartbeat_timeout));
    tick_timer_.async_wait([this](error_code ec) {
      if (!ec) tick();
    });
  }

  void tick() {
    if (closing_ || !channel_ || !channel_->open()) return;
    {
      std::lock_guard lock(mutex_);
      // Once the job is over the server stops its heartbeats; its silence means nothing.
      if (job_done_ || aborted_ || refused_) return;
    }
    const auto now = Clock::now();
    if (now - channel_->last_heard() > config_.heartbeat_timeout) {
      return abort_locally(fmt::format("the rendezvous server at {} sent nothing for {}", config_.master,
                                       format_duration(config_.heartbeat_timeout)));
    }
    if (now - channel_->last_sent() >= config_.heartbeat_interval) channel_->send(message("heartbeat"));
    arm_tick();
  }

  /// Called on the caller's thread: the io thread sends it.
  void post_send(json::object m) {
    asio::post(io_, [this, m = std::move(m)] {
      if (channel_ && !closing_) channel_->send(m);
    });
  }

  void begin_close(const std::optional<json::object>& last) {
    closing_ = true;
    retry_timer_.cancel();
    tick_timer_.cancel();
    resolver_.cancel();
    if (connecting_) {
      error_code ec;
      connecting_->close(ec);
    }
    if (channel_) {
      if (last) channel_->send(*last);
      channel_->close_gracefully();
    }
    work_.reset();
    std::lock_guard lock(mutex_);
    close_started_ = true;
    cv_.notify_all();
  }

  Config config_;
  std::string host_;
  std::string port_text_;
  json::object hello_;

  // Declared before everything that uses it, so it is destroyed after them.
  asio::io_context io_;
  tcp::resolver resolver_{io_};
  asio::steady_timer retry_timer_{io_};
  asio::steady_timer tick_timer_{io_};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  // io thread only
  std::shared_ptr<tcp::socket> connecting_;
  std::shared_ptr<Channel> channel_;
  bool closing_ = false;

  // shared, under mutex_
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool started_ = false;
  bool connected_ = false;
  bool joined_ = false;
  bool channel_open_ = false;
  bool closed_ = false;
  bool close_started_ = false;
  bool job_done_ = false;
  std::string reply_type_;
  std::optional<json::object> reply_;
  std::optional<std::string> refused_;
  std::optional<std::string> aborted_;
  std::string last_error_;
  std::map<std::string, std::uint64_t> barriers_done_;
  std::map<std::string, std::uint64_t> barriers_passed_;
  std::map<std::string, std::uint64_t> barriers_entered_;
  std::map<std::string, std::vector<std::uint32_t>> barrier_missing_;
  std::optional<std::vector<std::uint32_t>> join_missing_;
  std::map<std::string, std::string> values_;  // published keys (ControlClient::publish / fetch)
  std::function<void(const std::string&)> on_abort_;
  std::function<void(const std::string&, const std::string&)> on_command_;
  std::function<void(std::uint32_t, const std::string&)> on_left_;
  RejoinHandlers rejoin_handlers_;
  bool go_ = false;  // a rank coming back: the others took it back
  std::set<std::uint32_t> may_leave_;  // under mutex_: the ranks the server said may leave
  std::int64_t clock_reply_t0_ = -1;
  std::int64_t clock_reply_ts_ = 0;
  std::int64_t clock_offset_ = 0;
  std::int64_t clock_rtt_ = -1;

  std::thread thread_;  // joined by close()
};

RankInfo parse_rank_info(const json::value& v) {
  if (!v.is_object()) throw ProtocolError("a table entry is not an object");
  const auto& o = v.get_object();
  RankInfo info;
  info.rank = get_u32(o, "rank");
  info.host = get_string(o, "host");
  info.data_address = get_bytes(o, "data_address");
  info.plan_hash = get_hash(o, "plan_hash");
  if (const auto* ml = o.if_contains("may_leave"); ml != nullptr && ml->is_bool()) info.may_leave = ml->get_bool();
  return info;
}

}  // namespace

struct ControlClient::Impl {
  explicit Impl(ClientSettings s)
      : settings(std::move(s)),
        core({settings.master, fmt::format("rank {}", settings.rank), settings.join_timeout, settings.heartbeat_interval,
              settings.heartbeat_timeout}) {}

  ~Impl() {
    // Without finish(), tell the server this rank failed, unless it already knows.
    std::optional<json::object> last;
    if (!finished && !fail_sent && core.joined() && !core.aborted()) {
      last = message("fail");
      (*last)["reason"] = "exited without finishing";
    }
    core.close(std::move(last));
  }

  ClientSettings settings;
  ClientCore core;
  bool finished = false;
  bool fail_sent = false;
};

ControlClient::ControlClient(ClientSettings settings) : impl_(std::make_unique<Impl>(std::move(settings))) {}

ControlClient::~ControlClient() = default;

namespace {

/// A rank's hello: who it is, where its data plane listens, its plan.
json::object hello_of(const ClientSettings& s, const RankInfo& me) {
  auto hello = message("hello");
  hello["token"] = js(s.token);
  hello["rank"] = s.rank;
  hello["world_size"] = s.world_size;
  hello["host"] = json::string(me.host.empty() ? local_host_name() : me.host);
  hello["data_address"] = json::string(base64_encode(me.data_address));
  hello["plan_hash"] = json::string(hash_hex(me.plan_hash));
  if (me.may_leave) hello["may_leave"] = true;
  return hello;
}

/// Every rank's RankInfo from a table or rejoin message, checked. Throws ProtocolError.
std::vector<RankInfo> ranks_of(const json::object& m, std::uint32_t world_size) {
  const json::value& ranks = field(m, "ranks");
  if (!ranks.is_array()) throw ProtocolError("field 'ranks' is not an array");
  std::vector<RankInfo> infos;
  for (const auto& entry : ranks.get_array()) infos.push_back(parse_rank_info(entry));
  if (infos.size() != world_size) {
    throw ProtocolError(fmt::format("{} entries for world size {}", infos.size(), world_size));
  }
  for (std::uint32_t r = 0; r < infos.size(); ++r) {
    if (infos[r].rank != r) throw ProtocolError(fmt::format("entry {} is rank {}", r, infos[r].rank));
  }
  return infos;
}

}  // namespace

std::vector<RankInfo> ControlClient::join(const RankInfo& me) {
  const auto& s = impl_->settings;
  const json::object table = impl_->core.join(hello_of(s, me), "table");
  try {
    std::vector<RankInfo> infos = ranks_of(table, s.world_size);
    impl_->core.measure_clock(clock_rounds, clock_bound);
    return infos;
  } catch (const ProtocolError& e) {
    throw TransportError(fmt::format("rank {}: malformed table from the rendezvous server at {}: {}", s.rank, s.master, e.what()));
  }
}

std::pair<std::vector<RankInfo>, std::int64_t> ControlClient::rejoin(const RankInfo& me) {
  const auto& s = impl_->settings;
  RankInfo back = me;
  back.may_leave = true;
  json::object hello = hello_of(s, back);
  hello["rejoin"] = true;
  const json::object reply = impl_->core.join(std::move(hello), "rejoin");
  try {
    std::vector<RankInfo> infos = ranks_of(reply, s.world_size);
    const std::int64_t step = get_i64(reply, "step");
    impl_->core.measure_clock(clock_rounds, clock_bound);
    return {std::move(infos), step};
  } catch (const ProtocolError& e) {
    throw TransportError(fmt::format("rank {}: malformed answer from the rendezvous server at {}: {}", s.rank, s.master, e.what()));
  }
}

void ControlClient::ready(std::chrono::milliseconds timeout) { impl_->core.ready(timeout); }

void ControlClient::on_rejoin(RejoinHandlers handlers) { impl_->core.set_on_rejoin(std::move(handlers)); }

void ControlClient::on_abort(std::function<void(const std::string& reason)> callback) {
  impl_->core.set_on_abort(std::move(callback));
}

void ControlClient::on_left(std::function<void(std::uint32_t rank, const std::string& reason)> callback) {
  impl_->core.set_on_left(std::move(callback));
}

void ControlClient::barrier(const std::string& name, std::chrono::milliseconds timeout) {
  impl_->core.barrier(name, timeout);
}

void ControlClient::publish(const std::string& key, const std::string& value) { impl_->core.publish(key, value); }

std::string ControlClient::fetch(const std::string& key, std::chrono::milliseconds timeout) {
  return impl_->core.fetch(key, timeout);
}

void ControlClient::fail(const std::string& reason) {
  if (!impl_->core.joined() || impl_->core.aborted() || impl_->fail_sent) return;
  auto m = message("fail");
  m["reason"] = js(reason);
  impl_->fail_sent = true;
  impl_->core.send_flushed(std::move(m), fail_flush_grace);
}

void ControlClient::finish(std::chrono::milliseconds timeout) {
  impl_->core.barrier(finish_barrier, timeout);
  impl_->finished = true;
  impl_->core.close(message("bye"));
}

std::optional<std::string> ControlClient::aborted() const { return impl_->core.aborted(); }

void ControlClient::send_telemetry(const std::string& kind, const std::string& body) {
  if (body.size() > max_telemetry_bytes) {
    throw std::invalid_argument(fmt::format("telemetry '{}' of {} bytes is over the limit of {} bytes; split it", kind,
                                            body.size(), max_telemetry_bytes));
  }
  auto m = message("telemetry");
  m["kind"] = js(kind);
  m["body"] = js(body);
  if (json::serialize(m).size() >= max_server_line) {  // only text full of escapes gets here
    throw std::invalid_argument(fmt::format("telemetry '{}' is over {} bytes once escaped; split it", kind,
                                            max_server_line));
  }
  impl_->core.send_async(std::move(m));
}

void ControlClient::on_command(std::function<void(const std::string& kind, const std::string& body)> callback) {
  impl_->core.set_on_command(std::move(callback));
}

std::int64_t ControlClient::clock_offset_ns() const { return impl_->core.clock_offset(); }
std::int64_t ControlClient::clock_rtt_ns() const { return impl_->core.clock_rtt(); }

struct LauncherClient::Impl {
  explicit Impl(LauncherClientSettings s)
      : settings(std::move(s)),
        core({settings.master, fmt::format("launcher of node {}", settings.node_rank), settings.join_timeout,
              settings.heartbeat_interval, settings.heartbeat_timeout}) {}

  ~Impl() {
    std::optional<json::object> last;
    if (!finished && core.joined() && !core.aborted() && !core.job_done()) {
      last = message("fail");
      (*last)["reason"] = "exited without finishing";
    }
    core.close(std::move(last));
  }

  LauncherClientSettings settings;
  ClientCore core;
  bool finished = false;
};

LauncherClient::LauncherClient(LauncherClientSettings settings) : impl_(std::make_unique<Impl>(std::move(settings))) {}

LauncherClient::~LauncherClient() = default;

std::string LauncherClient::join() {
  const auto& s = impl_->settings;
  auto hello = message("launcher");
  if (!s.token.empty()) hello["token"] = js(s.token);
  hello["node_rank"] = s.node_rank;
  hello["host"] = json::string(local_host_name());
  const json::object welcome = impl_->core.join(std::move(hello), "welcome");
  try {
    return get_string(welcome, "token");
  } catch (const ProtocolError& e) {
    throw TransportError(fmt::format("launcher of node {}: malformed welcome from the rendezvous server at {}: {}",
                                     s.node_rank, s.master, e.what()));
  }
}

void LauncherClient::on_abort(std::function<void(const std::string& reason)> callback) {
  impl_->core.set_on_abort(std::move(callback));
}

void LauncherClient::fail(const std::string& reason, std::uint32_t rank) {
  if (!impl_->core.joined() || impl_->core.aborted()) return;
  auto m = message("fail");
  m["reason"] = js(reason);
  m["rank"] = rank;
  impl_->core.send_flushed(std::move(m), fail_flush_grace);
}

bool LauncherClient::may_leave(std::uint32_t rank) const { return impl_->core.may_leave(rank); }

void LauncherClient::finish() {
  impl_->finished = true;
  impl_->core.close(message("bye"));
}

std::optional<std::string> LauncherClient::aborted() const { return impl_->core.aborted(); }

}  // namespace baton::transport
