// transport/: the UCX data plane. Two DataPlanes in one process, each with its own ucp context,
// worker and progress thread, exchange addresses directly. Every scenario runs twice: with
// UCX's own choice of transports (shared memory here) and with TCP over loopback only.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "baton/transport/data_plane.h"
#include "baton/transport/shared_memory.h"
#include "test_util.h"

namespace {

using baton::test::contains;
using baton::transport::DataPlane;
using baton::transport::DataPlaneSettings;
using baton::transport::Link;
using baton::transport::LinkHandler;
using baton::transport::TransportError;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

/// Runs the rest of the test case once per transport setting ("" is the data plane's own choice).
std::string transport_variant() {
  std::string transports;
  SUBCASE("default transports") {}
  SUBCASE("tcp") { transports = "tcp"; }
  // What run_job picks when every rank is on one host: no TCP, so that UCX's rendezvous
  // between processes of the host cannot ride TCP loopback.
  SUBCASE("shared memory only") { transports = "^cma,tcp"; }
  CAPTURE(transports);
  return transports;
}

/// Collects what a link delivers. Messages are checked as they arrive: each carries the
/// sending thread and its sequence number, and a byte pattern derived from both.
class Recorder final : public LinkHandler {
 public:
  void on_message(std::uint32_t from, const void* data, std::size_t size) override {
    std::lock_guard lock(mutex_);
    ++messages_;
    std::uint32_t thread = 0;
    std::uint32_t sequence = 0;
    if (size < 8) {
      ++bad_messages_;
    } else {
      std::memcpy(&thread, data, 4);
      std::memcpy(&sequence, static_cast<const char*>(data) + 4, 4);
      auto& expected = next_[{from, thread}];
      if (sequence != expected || size != message_size(sequence)) ++bad_messages_;
      expected = sequence + 1;
      for (std::size_t i = 8; i < size; ++i) {
        if (static_cast<const unsigned char*>(data)[i] != pattern_byte(thread, sequence, i)) {
          ++bad_messages_;
          break;
        }
      }
    }
    changed_.notify_all();
  }
  void on_payload(std::uint64_t cookie) override {
    std::lock_guard lock(mutex_);
    payloads_.push_back(cookie);
    changed_.notify_all();
  }
  void on_link_error(const std::string& reason) override {
    std::lock_guard lock(mutex_);
    errors_.push_back(reason);
    changed_.notify_all();
  }

  /// Waits (at most `limit`) until `pred()` holds, with the lock held; returns whether it did.
  template <class Pred>
  bool wait(Pred pred, Clock::duration limit = 20s) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, limit, [&] { return pred(*this); });
  }
  std::size_t messages() {
    std::lock_guard lock(mutex_);
    return messages_;
  }
  std::size_t bad_messages() {
    std::lock_guard lock(mutex_);
    return bad_messages_;
  }
  std::vector<std::uint64_t> payloads() {
    std::lock_guard lock(mutex_);
    return payloads_;
  }
  std::vector<std::string> errors() {
    std::lock_guard lock(mutex_);
    return errors_;
  }
  /// The link errors, one a line ("" if none): what a failed CHECK shows.
  std::string error_text() {
    std::lock_guard lock(mutex_);
    std::string text;
    for (const auto& e : errors_) text += e + "\n";
    return text;
  }

  static std::size_t message_size(std::uint32_t sequence) { return 8 + sequence % (Link::max_message - 7); }
  static unsigned char pattern_byte(std::uint32_t thread, std::uint32_t sequence, std::size_t i) {
    return static_cast<unsigned char>(thread * 31 + sequence * 7 + i);
  }
  static std::vector<unsigned char> message(std::uint32_t thread, std::uint32_t sequence) {
    std::vector<unsigned char> bytes(message_size(sequence));
    std::memcpy(bytes.data(), &thread, 4);
    std::memcpy(bytes.data() + 4, &sequence, 4);
    for (std::size_t i = 8; i < bytes.size(); ++i) bytes[i] = pattern_byte(thread, sequence, i);
    return bytes;
  }

  // Read under the lock, from wait()'s predicate.
  std::size_t messages_ = 0;
  std::size_t bad_messages_ = 0;
  std::vector<std::uint64_t> payloads_;
  std::vector<std::string> errors_;

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::uint32_t> next_;
};

/// Ranks 0 and 1, connected and started. Handlers outlive the data planes (declared first).
struct Pair {
  explicit Pair(DataPlaneSettings settings) {
    for (std::uint32_t r = 0; r < 2; ++r) planes[r] = std::make_unique<DataPlane>(r, 2, settings);
    std::vector<std::string> addresses{planes[0]->address(), planes[1]->address()};
    for (std::uint32_t r = 0; r < 2; ++r) {
      planes[r]->set_handler(&handlers[r]);
      planes[r]->connect(addresses);
      planes[r]->start();
    }
  }
  explicit Pair(const std::string& transports) : Pair(DataPlaneSettings{.transports = transports}) {}

  Recorder handlers[2];
  std::unique_ptr<DataPlane> planes[2];
};

/// Rank 0 sends to rank 1, whose handler is the test's own.
struct OneWay {
  OneWay(const std::string& transports, LinkHandler& handler)
      : receiver(1, 2, DataPlaneSettings{.transports = transports}),
        sender(0, 2, DataPlaneSettings{.transports = transports}) {
    std::vector<std::string> addresses{sender.address(), receiver.address()};
    receiver.set_handler(&handler);
    sender.set_handler(&unused);
    receiver.connect(addresses);
    sender.connect(addresses);
    receiver.start();
    sender.start();
  }
  Recorder unused;  // the sender's handler: declared first, destroyed after the planes
  DataPlane receiver;
  DataPlane sender;
};

/// Bytes that differ at every position and between payloads.
std::vector<unsigned char> pattern(std::size_t size, unsigned seed) {
  std::vector<unsigned char> bytes(size);
  std::uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (std::size_t i = 0; i < size; ++i) {
    if (i % 8 == 0) x = x * 6364136223846793005ull + 1442695040888963407ull;
    bytes[i] = static_cast<unsigned char>(x >> (8 * (i % 8)));
  }
  return bytes;
}

bool has_cookie(Recorder& r, std::uint64_t cookie) {
  for (auto c : r.payloads_)
    if (c == cookie) return true;
  return false;
}

/// Waits until `plane` has finished sending `count` payloads (UCX no longer reads them).
bool wait_payloads_sent(DataPlane& plane, std::uint64_t count, Clock::duration limit = 20s) {
  const auto deadline = Clock::now() + limit;
  while (plane.stats().payloads_sent < count) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace

TEST_CASE("data plane: connects and names the transports UCX chose" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  Pair pair(transports);
  for (std::uint32_t r = 0; r < 2; ++r) {
    CHECK(pair.planes[r]->rank() == r);
    CHECK(pair.planes[r]->world_size() == 2);
    CHECK_FALSE(pair.planes[r]->address().empty());
    const std::string chosen = pair.planes[r]->transports_to(1 - r);
    MESSAGE("rank ", r, " uses ", chosen);
    CHECK_FALSE(chosen.empty());
    if (transports == "tcp") CHECK(contains(chosen, "tcp/"));
    // Inline payloads: up to 4 KiB over shared memory, up to the most over TCP (measured).
    const bool shared_memory = contains(chosen, "sysv") || contains(chosen, "posix") || contains(chosen, "xpmem");
    CHECK(pair.planes[r]->inline_limit(1 - r) == (shared_memory ? std::size_t{4096} : Link::max_inline_payload));
    if (transports == "tcp") CHECK(pair.planes[r]->inline_limit(1 - r) == Link::max_inline_payload);
    CHECK(pair.planes[r]->inline_limit(7) == 0);
    // Reading a peer's memory in place (shared_memory.h) only where UCX found the host shared.
    CHECK(pair.planes[r]->shares_memory_with(1 - r) == shared_memory);
    CHECK_FALSE(pair.planes[r]->shares_memory_with(r));
    CHECK_FALSE(pair.planes[r]->shares_memory_with(7));
  }
}

TEST_CASE("data plane: 10000 messages each way arrive in order and intact, from two threads per side" *
          doctest::timeout(60)) {
  const std::string transports = transport_variant();
  Pair pair(transports);
  constexpr std::uint32_t threads_per_side = 2;
  constexpr std::uint32_t per_thread = 5000;
  std::vector<std::thread> senders;
  for (std::uint32_t side = 0; side < 2; ++side) {
    for (std::uint32_t t = 0; t < threads_per_side; ++t) {
      senders.emplace_back([&pair, side, t] {
        for (std::uint32_t s = 0; s < per_thread; ++s) {
          auto bytes = Recorder::message(t, s);
          pair.planes[side]->send(1 - side, bytes.data(), bytes.size());
        }
      });
    }
  }
  for (auto& s : senders) s.join();
  for (std::uint32_t r = 0; r < 2; ++r) {
    CHECK(pair.handlers[r].wait([](Recorder& h) { return h.messages_ >= threads_per_side * per_thread; }));
    CHECK(pair.handlers[r].messages() == threads_per_side * per_thread);
    CHECK(pair.handlers[r].bad_messages() == 0);
    CHECK(pair.handlers[r].error_text() == "");
    CHECK(pair.planes[r]->stats().messages_received == threads_per_side * per_thread);
  }
  // The sender counts a message once UCX has it; wait for the last completions.
  for (std::uint32_t r = 0; r < 2; ++r) {
    auto deadline = Clock::now() + 10s;
    while (pair.planes[r]->stats().messages_sent < threads_per_side * per_thread && Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    CHECK(pair.planes[r]->stats().messages_sent == threads_per_side * per_thread);
  }
}

TEST_CASE("data plane: empty and short messages keep their order with the rest" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  struct Check final : LinkHandler {
    void on_message(std::uint32_t, const void* data, std::size_t size) override {
      std::lock_guard lock(mutex);
      sizes.push_back(size);
      if (size > 0) firsts.push_back(*static_cast<const unsigned char*>(data));
    }
    void on_payload(std::uint64_t) override {}
    void on_link_error(const std::string&) override {}
    std::mutex mutex;
    std::vector<std::size_t> sizes;
    std::vector<unsigned char> firsts;
  } check;
  OneWay link(transports, check);
  DataPlane& sender = link.sender;
  std::vector<std::size_t> sent_sizes;
  for (std::size_t i = 0; i < 200; ++i) {
    std::size_t size = i % 3 == 0 ? 0 : (i % 3 == 1 ? 1 : Link::max_message);
    std::vector<unsigned char> bytes(size, static_cast<unsigned char>(i));
    sender.send(1, bytes.data(), size);
    sent_sizes.push_back(size);
  }
  auto deadline = Clock::now() + 20s;
  while (Clock::now() < deadline) {
    {
      std::lock_guard lock(check.mutex);
      if (check.sizes.size() >= sent_sizes.size()) break;
    }
    std::this_thread::sleep_for(1ms);
  }
  std::lock_guard lock(check.mutex);
  CHECK(check.sizes == sent_sizes);
  std::vector<unsigned char> expected_firsts;
  for (std::size_t i = 0; i < 200; ++i)
    if (i % 3 != 0) expected_firsts.push_back(static_cast<unsigned char>(i));
  CHECK(check.firsts == expected_firsts);
}

TEST_CASE("data plane: inline payloads arrive with their messages, in order with plain ones" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  struct Seen {
    std::size_t size;
    unsigned char first;
    std::vector<unsigned char> payload;
  };
  struct Check final : LinkHandler {
    void on_message(std::uint32_t from, const void* data, std::size_t size) override {
      on_message_with_payload(from, data, size, nullptr, 0);
    }
    void on_message_with_payload(std::uint32_t, const void* data, std::size_t size, const void* payload,
                                 std::size_t payload_size) override {
      std::lock_guard lock(mutex);
      const auto* p = static_cast<const unsigned char*>(payload);
      seen.push_back({size, size > 0 ? *static_cast<const unsigned char*>(data) : std::uint8_t{0},
                      std::vector<unsigned char>(p, p + payload_size)});
    }
    void on_payload(std::uint64_t) override {}
    void on_link_error(const std::string& reason) override {
      std::lock_guard lock(mutex);
      errors.push_back(reason);
    }
    std::mutex mutex;
    std::vector<Seen> seen;
    std::vector<std::string> errors;
  } check;
  // The payloads outlive the link. The receiver having them all says nothing to the sender's
  // progress thread, which may still be finishing the sends that read them (a producer frees a
  // slot on the consumer's ack, which that thread delivers); the link's teardown joins it.
  std::vector<std::vector<unsigned char>> payloads;
  OneWay link(transports, check);
  DataPlane& sender = link.sender;
  // Plain messages, and messages of 0, 32 and 64 bytes with payloads of 1 B to the most; the
  // payloads stay where they are until they have arrived (as a producer's slot does).
  const std::vector<std::size_t> payload_sizes{1, 100, 4096, Link::max_inline_payload};
  std::vector<Seen> sent;
  for (std::size_t i = 0; i < 300; ++i) {
    const std::size_t size = i % 3 == 0 ? 0 : (i % 3 == 1 ? 32 : Link::max_message);
    std::vector<unsigned char> bytes(size, static_cast<unsigned char>(i));
    std::vector<unsigned char> payload;
    if (i % 4 != 0) {
      payload.resize(payload_sizes[i % payload_sizes.size()]);
      for (std::size_t b = 0; b < payload.size(); ++b) payload[b] = static_cast<unsigned char>(i * 13 + b);
    }
    payloads.push_back(payload);
    if (payload.empty()) {
      sender.send(1, bytes.data(), size);
    } else {
      sender.send_inline(1, bytes.data(), size, payloads.back().data(), payloads.back().size());
    }
    sent.push_back({size, size > 0 ? static_cast<unsigned char>(i) : std::uint8_t{0}, payload});
  }
  auto deadline = Clock::now() + 20s;
  while (Clock::now() < deadline) {
    {
      std::lock_guard lock(check.mutex);
      if (check.seen.size() >= sent.size() || !check.errors.empty()) break;
    }
    std::this_thread::sleep_for(1ms);
  }
  std::lock_guard lock(check.mutex);
  REQUIRE_MESSAGE(check.errors.empty(), check.errors.front());
  REQUIRE(check.seen.size() == sent.size());
  for (std::size_t i = 0; i < sent.size(); ++i) {
    CAPTURE(i);
    CHECK(check.seen[i].size == sent[i].size);
    CHECK(check.seen[i].first == sent[i].first);
    CHECK(check.seen[i].payload == sent[i].payload);
  }
}

TEST_CASE("data plane: payloads from 0 B to 64 MiB arrive intact, received before or after the offer" *
          doctest::timeout(60)) {
  const std::string transports = transport_variant();
  Pair pair(transports);
  // Eager below DataPlaneSettings::rendezvous_from (1 MiB), by rendezvous from there: both
  // sides of the threshold, each posted before and after the offer.
  const std::size_t sizes[] = {0, 1, 4096, 64 << 10, (1 << 20) - 1, 1 << 20, 16 << 20, 64 << 20};
  std::uint64_t cookie = 100;
  std::uint64_t tag = 1;
  std::uint64_t offers[2] = {0, 0};
  for (std::size_t size : sizes) {
    for (bool receive_first : {true, false}) {
      CAPTURE(size);
      CAPTURE(receive_first);
      const std::uint32_t from = receive_first ? 0 : 1;
      const std::uint32_t to = 1 - from;
      auto source = pattern(size, static_cast<unsigned>(tag));
      std::vector<unsigned char> dest(size, 0xEE);
      ++cookie;
      ++tag;
      if (receive_first) {
        pair.planes[to]->receive_payload(from, tag, dest.data(), size, cookie);
        std::this_thread::sleep_for(5ms);  // let the receive be posted first
        pair.planes[from]->send_payload(to, tag, source.data(), size);
      } else {
        pair.planes[from]->send_payload(to, tag, source.data(), size);
        std::this_thread::sleep_for(5ms);  // let the offer (eager data or rendezvous) arrive first
        pair.planes[to]->receive_payload(from, tag, dest.data(), size, cookie);
      }
      REQUIRE(pair.handlers[to].wait([&](Recorder& h) { return has_cookie(h, cookie) || !h.errors_.empty(); }));
      REQUIRE(pair.handlers[to].error_text() == "");
      CHECK(dest == source);
      ++offers[from];
      CHECK(wait_payloads_sent(*pair.planes[from], offers[from]));  // before `source` goes
    }
  }
  const auto& s = pair.planes[0]->stats();
  CHECK(s.payloads_received + pair.planes[1]->stats().payloads_received == std::size(sizes) * 2);
}

TEST_CASE("data plane: says what it sets in UCX's configuration, and the environment wins" * doctest::timeout(60)) {
  using Config = std::vector<std::pair<std::string, std::string>>;
  struct Saved {
    std::string name;
    std::optional<std::string> value;
    explicit Saved(std::string n) : name(std::move(n)) {
      if (const char* v = std::getenv(name.c_str())) value = v;
      unsetenv(name.c_str());
    }
    ~Saved() {
      if (value) setenv(name.c_str(), value->c_str(), 1);
    }
  };
  Saved tls("UCX_TLS");
  Saved threshold("UCX_RNDV_THRESH");
  CHECK(baton::transport::ucx_configuration({}) == Config{{"TLS", "^cma"}, {"RNDV_THRESH", "1048576"}});
  CHECK(baton::transport::ucx_configuration({.transports = "tcp", .rendezvous_from = 0}) == Config{{"TLS", "tcp"}});
  setenv("UCX_RNDV_THRESH", "64kb", 1);
  setenv("UCX_TLS", "posix,self", 1);
  CHECK(baton::transport::ucx_configuration({}).empty());
  CHECK(baton::transport::ucx_configuration({.transports = "tcp"}) == Config{{"TLS", "tcp"}});
  // A data plane made under them carries a payload on either side of the environment's threshold.
  for (std::size_t size : {std::size_t{60} << 10, std::size_t{200} << 10}) {
    CAPTURE(size);
    Pair pair(std::string{});
    auto source = pattern(size, 7);
    std::vector<unsigned char> dest(size, 0);
    pair.planes[0]->send_payload(1, 3, source.data(), size);
    pair.planes[1]->receive_payload(0, 3, dest.data(), size, 77);
    REQUIRE(pair.handlers[1].wait([](Recorder& h) { return has_cookie(h, 77) || !h.errors_.empty(); }));
    CHECK(pair.handlers[1].error_text() == "");
    CHECK(dest == source);
    CHECK(wait_payloads_sent(*pair.planes[0], 1));
  }
  unsetenv("UCX_TLS");
  unsetenv("UCX_RNDV_THRESH");
}

TEST_CASE("data plane: 64 payloads in flight at once, both ways" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  Pair pair(transports);
  constexpr int count = 64;
  struct Transfer {
    std::uint32_t from;
    std::vector<unsigned char> source, dest;
  };
  std::vector<Transfer> transfers(count);
  for (int i = 0; i < count; ++i) {
    std::size_t size = (i % 4 == 0) ? std::size_t{1} << 20 : 1000 + static_cast<std::size_t>(i) * 4099;
    transfers[i].from = static_cast<std::uint32_t>(i % 2);
    transfers[i].source = pattern(size, 1000 + i);
    transfers[i].dest.assign(size, 0);
  }
  // Half the receives go first, then every offer, then the other half of the receives.
  for (int i = 0; i < count; i += 2) {
    auto& t = transfers[i];
    pair.planes[1 - t.from]->receive_payload(t.from, 5000 + i, t.dest.data(), t.dest.size(), i);
  }
  for (int i = 0; i < count; ++i) {
    auto& t = transfers[i];
    pair.planes[t.from]->send_payload(1 - t.from, 5000 + i, t.source.data(), t.source.size());
  }
  for (int i = 1; i < count; i += 2) {
    auto& t = transfers[i];
    pair.planes[1 - t.from]->receive_payload(t.from, 5000 + i, t.dest.data(), t.dest.size(), i);
  }
  for (std::uint32_t r = 0; r < 2; ++r) {
    CHECK(pair.handlers[r].wait([](Recorder& h) { return h.payloads_.size() >= count / 2 || !h.errors_.empty(); }));
    CHECK(pair.handlers[r].error_text() == "");
    std::set<std::uint64_t> cookies;
    for (auto c : pair.handlers[r].payloads()) cookies.insert(c);
    CHECK(cookies.size() == count / 2);
  }
  for (int i = 0; i < count; ++i) {
    CAPTURE(i);
    CHECK(transfers[i].dest == transfers[i].source);
  }
  for (std::uint32_t r = 0; r < 2; ++r) CHECK(wait_payloads_sent(*pair.planes[r], count / 2));
}

TEST_CASE("data plane: equal tags from different senders do not meet" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  // Three ranks: 0 and 1 both offer tag 7 to rank 2.
  Recorder handlers[3];
  std::unique_ptr<DataPlane> planes[3];
  std::vector<std::string> addresses;
  for (std::uint32_t r = 0; r < 3; ++r) {
    planes[r] = std::make_unique<DataPlane>(r, 3, DataPlaneSettings{.transports = transports});
    addresses.push_back(planes[r]->address());
  }
  for (std::uint32_t r = 0; r < 3; ++r) {
    planes[r]->set_handler(&handlers[r]);
    planes[r]->connect(addresses);
    planes[r]->start();
  }
  auto from0 = pattern(100000, 0);
  auto from1 = pattern(100000, 1);
  std::vector<unsigned char> into0(from0.size()), into1(from1.size());
  planes[0]->send_payload(2, 7, from0.data(), from0.size());
  planes[1]->send_payload(2, 7, from1.data(), from1.size());
  std::this_thread::sleep_for(5ms);
  planes[2]->receive_payload(1, 7, into1.data(), into1.size(), 1);
  planes[2]->receive_payload(0, 7, into0.data(), into0.size(), 0);
  CHECK(handlers[2].wait([](Recorder& h) { return h.payloads_.size() == 2 || !h.errors_.empty(); }));
  CHECK(handlers[2].error_text() == "");
  CHECK(into0 == from0);
  CHECK(into1 == from1);
  CHECK(wait_payloads_sent(*planes[0], 1));
  CHECK(wait_payloads_sent(*planes[1], 1));
  for (auto& p : planes) p->stop();
}

TEST_CASE("data plane: a payload of the wrong size is a link error, not a hang" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  struct Case {
    std::size_t offered, expected;
  };
  // Eager and rendezvous sizes, each both ways round.
  for (Case c : {Case{2000, 1000}, Case{1000, 2000}, Case{1 << 20, 1 << 19}, Case{1 << 19, 1 << 20}}) {
    CAPTURE(c.offered);
    CAPTURE(c.expected);
    DataPlaneSettings settings{.transports = transports};
    settings.close_timeout = 500ms;
    Pair pair(settings);
    auto source = pattern(c.offered, 3);
    std::vector<unsigned char> dest(c.expected);
    pair.planes[1]->receive_payload(0, 42, dest.data(), dest.size(), 9);
    pair.planes[0]->send_payload(1, 42, source.data(), source.size());
    REQUIRE(pair.handlers[1].wait([](Recorder& h) { return !h.errors_.empty() || !h.payloads_.empty(); }));
    auto errors = pair.handlers[1].errors();
    REQUIRE(errors.size() == 1);
    MESSAGE(errors[0]);
    CHECK(contains(errors[0], "rank 1"));
    CHECK(contains(errors[0], "from rank 0"));
    CHECK(contains(errors[0], "tag 42"));
    CHECK(contains(errors[0], std::to_string(c.expected)));
    CHECK(pair.handlers[1].payloads().empty());
    CHECK(pair.planes[1]->stats().errors == 1);
    // Both sides still stop within their close timeout.
    auto begin = Clock::now();
    pair.planes[1]->stop();
    pair.planes[0]->stop();
    CHECK(Clock::now() - begin < 3s);
  }
}

TEST_CASE("data plane: refuses what it cannot carry with a TransportError" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  using baton::test::thrown_message;
  Pair pair(transports);
  DataPlane& dp = *pair.planes[0];
  std::vector<unsigned char> big(Link::max_message + 1);
  CHECK(contains(thrown_message<TransportError>([&] { dp.send(1, big.data(), big.size()); }), "65 bytes"));
  std::vector<unsigned char> too_much(Link::max_inline_payload + 1);
  CHECK(contains(thrown_message<TransportError>([&] { dp.send_inline(1, big.data(), 1, too_much.data(), too_much.size()); }),
                 fmt::format("inline payload of {} bytes to rank 1: at most {}", too_much.size(), Link::max_inline_payload)));
  CHECK(contains(thrown_message<TransportError>([&] { dp.send(2, big.data(), 1); }), "rank 2"));
  CHECK(contains(thrown_message<TransportError>([&] { dp.send(0, big.data(), 1); }), "itself"));
  CHECK(contains(thrown_message<TransportError>([&] { dp.send_payload(5, 1, big.data(), 1); }), "rank 5"));
  CHECK(contains(thrown_message<TransportError>([&] { dp.receive_payload(7, 1, big.data(), 1, 0); }), "rank 7"));
  const std::uint64_t huge_tag = std::uint64_t{1} << 48;
  CHECK(contains(thrown_message<TransportError>([&] { dp.send_payload(1, huge_tag, big.data(), 1); }), "48 bits"));
  CHECK(contains(thrown_message<TransportError>([&] { dp.receive_payload(1, huge_tag, big.data(), 1, 0); }),
                 "48 bits"));
  CHECK_THROWS_AS(dp.transports_to(0), TransportError);
  CHECK_THROWS_AS(dp.transports_to(9), TransportError);
  CHECK_THROWS_AS(dp.start(), TransportError);  // twice
  CHECK_THROWS_AS(dp.connect({dp.address(), pair.planes[1]->address()}), TransportError);  // twice
  dp.stop();
  CHECK(contains(thrown_message<TransportError>([&] { dp.send(1, big.data(), 1); }), "stop"));

  CHECK_THROWS_AS(DataPlane(2, 2), TransportError);
  CHECK_THROWS_AS(DataPlane(0, 0), TransportError);
  DataPlane lonely(0, 3, DataPlaneSettings{.transports = transports});
  CHECK(contains(thrown_message<TransportError>([&] { lonely.connect({lonely.address()}); }), "1 addresses"));
  CHECK(contains(thrown_message<TransportError>([&] { lonely.send(1, big.data(), 1); }), "connect"));
  CHECK(contains(thrown_message<TransportError>([&] { lonely.start(); }), "set_handler"));
  CHECK(contains(thrown_message<TransportError>([&] { lonely.connect({"", "", lonely.address()}); }),
                 "rank 0 to rank 1"));  // an empty address; malformed bytes make UCX abort
}

TEST_CASE("data plane: a never started data plane tears down cleanly" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  // Over TCP an endpoint's flush needs the peer's worker to answer the wire-up, and nobody
  // progresses b's: a's close runs into close_timeout, and no further.
  DataPlaneSettings settings{.transports = transports};
  settings.close_timeout = 200ms;
  DataPlane a(0, 2, settings);
  DataPlane b(1, 2, settings);
  std::vector<std::string> addresses{a.address(), b.address()};
  a.connect(addresses);
  b.connect(addresses);
  CHECK_FALSE(a.transports_to(1).empty());
  auto begin = Clock::now();
  a.stop();
  a.stop();  // idempotent
  b.stop();
  CHECK(Clock::now() - begin < 2 * 200ms + 1s);
}

TEST_CASE("data plane: stop() with a receive that never matches returns within close_timeout" *
          doctest::timeout(60)) {
  const std::string transports = transport_variant();
  DataPlaneSettings settings{.transports = transports};
  settings.close_timeout = 300ms;
  Pair pair(settings);
  std::vector<unsigned char> dest(1 << 20);
  pair.planes[1]->receive_payload(0, 77, dest.data(), dest.size(), 1);
  std::this_thread::sleep_for(10ms);
  auto begin = Clock::now();
  pair.planes[1]->stop();
  auto took = Clock::now() - begin;
  MESSAGE("stop() took ", std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms");
  CHECK(took >= 250ms);
  CHECK(took < 300ms + 1s);
  CHECK(pair.handlers[1].payloads().empty());
  CHECK(pair.handlers[1].errors().empty());  // a stop is not a link failure
  pair.planes[1]->stop();  // idempotent
  begin = Clock::now();
  pair.planes[0]->stop();
  CHECK(Clock::now() - begin < 300ms + 1s);
}

TEST_CASE("data plane: an idle progress thread sleeps, and wakes for work" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  DataPlaneSettings settings{.transports = transports};
  // So long that only the eventfd and the worker's events can explain a prompt delivery.
  settings.max_sleep = 10s;
  Pair pair(settings);
  std::this_thread::sleep_for(50ms);  // settle: wire-up, first sleeps
  const auto sleeps_before = pair.planes[0]->stats().sleeps + pair.planes[1]->stats().sleeps;
  const double cpu_before = process_cpu_seconds();
  const auto wall_before = Clock::now();
  std::this_thread::sleep_for(200ms);
  const double cpu = process_cpu_seconds() - cpu_before;
  const double wall = std::chrono::duration<double>(Clock::now() - wall_before).count();
  MESSAGE("idle: ", cpu * 1e3, " ms of CPU in ", wall * 1e3, " ms");
  CHECK(cpu < 0.5 * wall);
  const auto sleeps_after = pair.planes[0]->stats().sleeps + pair.planes[1]->stats().sleeps;
  CHECK(sleeps_after >= sleeps_before);
  CHECK(sleeps_after >= 2);  // both went to sleep at least once

  // Both sleep: a message, and a rendezvous payload (receive first, then offer), still arrive
  // well before a sleep could time out.
  auto begin = Clock::now();
  auto bytes = Recorder::message(0, 0);
  pair.planes[0]->send(1, bytes.data(), bytes.size());
  CHECK(pair.handlers[1].wait([](Recorder& h) { return h.messages_ == 1; }, 5s));
  std::this_thread::sleep_for(50ms);  // asleep again
  auto source = pattern(4 << 20, 8);
  std::vector<unsigned char> dest(source.size());
  pair.planes[1]->receive_payload(0, 3, dest.data(), dest.size(), 3);
  std::this_thread::sleep_for(50ms);
  pair.planes[0]->send_payload(1, 3, source.data(), source.size());
  CHECK(pair.handlers[1].wait([](Recorder& h) { return !h.payloads_.empty(); }, 5s));
  CHECK(dest == source);
  CHECK(wait_payloads_sent(*pair.planes[0], 1));
  CHECK(Clock::now() - begin < 3s);
  // stop() rings the sleeping thread too.
  begin = Clock::now();
  pair.planes[0]->stop();
  pair.planes[1]->stop();
  CHECK(Clock::now() - begin < 3s);
}

TEST_CASE("data plane: sends to a peer that is gone never hang stop()" * doctest::timeout(60)) {
  const std::string transports = transport_variant();
  DataPlaneSettings settings{.transports = transports};
  settings.close_timeout = 200ms;
  Pair pair(settings);
  auto bytes = Recorder::message(0, 0);
  pair.planes[1]->send(0, bytes.data(), bytes.size());
  REQUIRE(pair.handlers[0].wait([](Recorder& h) { return h.messages_ == 1; }, 5s));
  pair.planes[0]->stop();  // rank 0 is gone; rank 1 has not been told (the control plane's job)
  std::vector<unsigned char> payload(1 << 20);
  for (std::uint32_t s = 1; s <= 300; ++s) {  // more than a shared-memory FIFO holds
    auto m = Recorder::message(0, s);
    pair.planes[1]->send(0, m.data(), m.size());
  }
  pair.planes[1]->send_payload(0, 1, payload.data(), payload.size());
  pair.planes[1]->receive_payload(0, 2, payload.data(), payload.size(), 2);
  std::this_thread::sleep_for(50ms);
  // Over TCP the loss shows as a link error; over shared memory the bytes go nowhere.
  MESSAGE("rank 1 heard: ", pair.handlers[1].error_text());
  CHECK(pair.handlers[1].errors().size() <= 1);
  auto begin = Clock::now();
  pair.planes[1]->stop();
  auto took = Clock::now() - begin;
  MESSAGE("stop() took ", std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms");
  CHECK(took < 200ms * 5 / 4 + 1s);
  CHECK(pair.handlers[1].payloads().empty());
}

namespace {
/// Stops its own data plane from inside the first message's handler, on whichever thread
/// delivers it, and says which thread that was.
class StopOnFirstMessage final : public LinkHandler {
 public:
  DataPlane* plane = nullptr;
  std::atomic<int> handled{0};
  std::atomic<bool> on_poller{false};
  // Set by the test after the polling thread starts; read on whichever thread delivers. The
  // message that triggers the read goes through UCX, which TSan cannot see as ordering.
  std::atomic<std::thread::id> poller{};
  void on_message(std::uint32_t, const void*, std::size_t) override {
    if (handled.fetch_add(1) == 0) {
      on_poller = std::this_thread::get_id() == poller.load();
      plane->stop();  // only asks: must not wait for the thread that waits for this one
    }
  }
  void on_payload(std::uint64_t) override {}
  void on_link_error(const std::string&) override {}
};
}  // namespace

TEST_CASE("data plane: a handler's stop() on a polling thread only asks, and the owner's stop() ends it" *
          doctest::timeout(60)) {
  int on_poller = 0;
  for (int round = 0; round < 10; ++round) {
    Recorder sender_handler;
    StopOnFirstMessage stopper;
    auto sender = std::make_unique<DataPlane>(0, 2, DataPlaneSettings{});
    auto receiver = std::make_unique<DataPlane>(1, 2, DataPlaneSettings{});
    stopper.plane = receiver.get();
    std::vector<std::string> addresses{sender->address(), receiver->address()};
    sender->set_handler(&sender_handler);
    receiver->set_handler(&stopper);
    sender->connect(addresses);
    receiver->connect(addresses);
    sender->start();
    receiver->start();
    std::atomic<bool> polling{true};
    std::thread poller([&] {
      const auto until = Clock::now() + 10s;
      while (polling && Clock::now() < until) receiver->poll();
    });
    stopper.poller = poller.get_id();
    const char hello[8] = "hello";
    sender->send(1, hello, sizeof hello);
    const auto until = Clock::now() + 10s;
    while (stopper.handled == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
    REQUIRE(stopper.handled >= 1);
    polling = false;
    poller.join();
    receiver->stop();
    sender->stop();
    on_poller += stopper.on_poller ? 1 : 0;
  }
  MESSAGE("the polling thread handled the message in " << on_poller << " of 10 rounds");
}

// ---------------------------------------------------------------------------------------------
// Shared register memory (transport/shared_memory.h): what a transfer on another rank of the
// host reads in place.

TEST_CASE("shared memory: a segment's bytes read through a peer's mapping, and what is refused" *
          doctest::timeout(60)) {
  using baton::transport::PeerSegments;
  using baton::transport::SharedLocation;
  using baton::transport::SharedSegments;
  SharedSegments segments("rank 0", 4096);  // small segments: the third allocation needs a second
  auto* a = static_cast<std::uint32_t*>(segments.allocate(2000));
  auto* b = static_cast<std::uint32_t*>(segments.allocate(2000));
  auto* c = static_cast<std::uint32_t*>(segments.allocate(10000));  // larger than a segment
  for (auto* p : {a, b, c}) CHECK(reinterpret_cast<std::uintptr_t>(p) % SharedSegments::alignment == 0);
  CHECK(segments.bytes_allocated() == 2048 + 2048 + 10048);
  CHECK(segments.bytes_reserved() >= 4096 + 10048);
  for (std::uint32_t i = 0; i < 500; ++i) a[i] = i, b[i] = 1000 + i;
  for (std::uint32_t i = 0; i < 2500; ++i) c[i] = 7 * i;
  const auto at_a = segments.locate(a, 2000);
  const auto at_b = segments.locate(b + 10, 400);
  const auto at_c = segments.locate(c, 10000);
  REQUIRE(at_a);
  REQUIRE(at_b);
  REQUIRE(at_c);
  CHECK(at_a->fd == at_b->fd);
  CHECK(at_c->fd != at_a->fd);
  CHECK(at_b->offset == at_a->offset + 2048 + 40);
  CHECK_FALSE(segments.locate(&segments, 4));  // not in a segment
  CHECK_FALSE(segments.locate(a, 1u << 20));   // runs past its segment

  PeerSegments peers;  // this process plays the peer (the mp tests read across processes)
  const auto* pa = reinterpret_cast<const std::uint32_t*>(peers.map(*at_a, 2000));
  const auto* pb = reinterpret_cast<const std::uint32_t*>(peers.map(*at_b, 400));
  const auto* pc = reinterpret_cast<const std::uint32_t*>(peers.map(*at_c, 10000));
  CHECK(static_cast<const void*>(pa) != static_cast<const void*>(a));  // a mapping of its own
  CHECK(std::memcmp(pa, a, 2000) == 0);
  CHECK(pb[0] == 1010);
  CHECK(pc[2499] == 7 * 2499);
  a[3] = 42;  // the same memory, not a copy
  CHECK(pa[3] == 42);

  auto refused = [&](SharedLocation at, std::size_t bytes) -> std::string {
    try {
      peers.map(at, bytes);
    } catch (const TransportError& e) {
      return e.what();
    }
    return "";
  };
  SharedLocation wrong = *at_a;
  wrong.nonce ^= 1;
  wrong.fd = at_c->fd;  // mapped, but under another nonce: looked up again, and the name differs
  CHECK(contains(refused(wrong, 4), "not the register segment it named"));
  SharedLocation past = *at_b;
  past.offset = 4000;
  CHECK(contains(refused(past, 200), "named bytes [4000, 4200) of its register segment"));
  SharedLocation closed = *at_a;
  closed.fd = 100000;
  CHECK(contains(refused(closed, 4), fmt::format("cannot map the register memory of process {} (/proc/{}/fd/100000): "
                                                 "readlink",
                                                 at_a->pid, at_a->pid)));
  CHECK(contains(refused(closed, 4), "RuntimeSettings::shared_registers = false"));
}

TEST_CASE("shared memory: another process's segment stays readable after that process died" *
          doctest::timeout(60)) {
  using baton::transport::PeerSegments;
  using baton::transport::SharedLocation;
  using baton::transport::SharedSegments;
  // The child allocates, fills, says where, and waits to be killed; the parent maps while it
  // lives, kills it, and reads on: a writer that dies leaves its readers' mappings valid (no
  // SIGBUS), which is why a lost rank is reported by deadlines and not by a crash.
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(ready[0]);
    SharedSegments segments("child");
    auto* p = static_cast<std::uint64_t*>(segments.allocate(1 << 20));
    for (std::uint64_t i = 0; i < (1 << 17); ++i) p[i] = i * 3 + 1;
    const auto at = segments.locate(p, 1 << 20);
    const SharedLocation where = at.value_or(SharedLocation{});
    if (::write(ready[1], &where, sizeof where) != sizeof where) ::_exit(1);
    ::pause();  // until killed (the parent's timeout bounds this)
    ::_exit(0);
  }
  ::close(ready[1]);
  SharedLocation at;
  const ssize_t got = ::read(ready[0], &at, sizeof at);
  ::close(ready[0]);
  struct Reap {
    pid_t pid;
    ~Reap() {
      if (pid <= 0) return;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{child};
  REQUIRE(got == static_cast<ssize_t>(sizeof at));
  REQUIRE(at.pid == static_cast<std::uint32_t>(child));
  PeerSegments peers;
  const auto* p = reinterpret_cast<const std::uint64_t*>(peers.map(at, 1 << 20));
  CHECK(p[0] == 1);
  CHECK(p[(1 << 17) - 1] == ((1 << 17) - 1) * 3 + 1);
  ::kill(child, SIGKILL);
  REQUIRE(::waitpid(child, nullptr, 0) == child);
  reap.pid = -1;
  std::uint64_t sum = 0;
  for (std::uint64_t i = 0; i < (1 << 17); ++i) sum += p[i];
  const std::uint64_t n = 1 << 17;
  CHECK(sum == 3 * (n * (n - 1) / 2) + n);
}
