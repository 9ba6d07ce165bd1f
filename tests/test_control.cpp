// The control plane over loopback TCP: rendezvous, barriers, aborts, heartbeats, finish.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include "baton/transport/control.h"
#include "test_util.h"

namespace {

using namespace std::chrono_literals;
using baton::test::contains;
using baton::test::thrown_message;
using baton::transport::ClientSettings;
using baton::transport::ControlClient;
using baton::transport::JobOutcome;
using baton::transport::LauncherClient;
using baton::transport::LauncherClientSettings;
using baton::transport::RankInfo;
using baton::transport::RejoinHandlers;
using baton::transport::TransportError;
using baton::transport::RendezvousServer;
using baton::transport::ServerSettings;
using std::chrono::milliseconds;

const std::string token = "0123456789abcdef0123456789abcdef";

ServerSettings server_settings(std::uint32_t world_size) {
  ServerSettings s;
  s.bind_host = "127.0.0.1";
  s.port = 0;
  s.token = token;
  s.world_size = world_size;
  s.join_timeout = 5000ms;
  s.barrier_timeout = 5000ms;
  s.heartbeat_interval = 100ms;
  s.heartbeat_timeout = 3000ms;
  return s;
}

ClientSettings client_settings(const RendezvousServer& server, std::uint32_t rank, std::uint32_t world_size) {
  ClientSettings s;
  s.master = "127.0.0.1:" + std::to_string(server.port());
  s.token = token;
  s.rank = rank;
  s.world_size = world_size;
  s.join_timeout = 5000ms;
  s.heartbeat_interval = 100ms;
  s.heartbeat_timeout = 3000ms;
  return s;
}

RankInfo info_of(std::uint32_t rank, std::uint64_t plan_hash = 0x1234abcd5678ef00ULL) {
  RankInfo info;
  info.rank = rank;
  info.host = "host" + std::to_string(rank);
  // Binary on purpose: NUL, newline, quote, backslash, high bytes.
  info.data_address = std::string("\0\n\"\\\xff\xfe", 6) + std::string(rank + 1, static_cast<char>(0x80 + rank));
  info.plan_hash = plan_hash;
  return info;
}

/// Remembers the first abort reason a client reports, for the test thread to wait on.
struct AbortWatch {
  std::mutex mutex;
  std::condition_variable cv;
  std::optional<std::string> reason;
  int calls = 0;

  std::function<void(const std::string&)> callback() {
    return [this](const std::string& r) {
      std::lock_guard lock(mutex);
      ++calls;
      if (!reason) reason = r;
      cv.notify_all();
    };
  }
  std::optional<std::string> wait(milliseconds timeout) {
    std::unique_lock lock(mutex);
    cv.wait_for(lock, timeout, [&] { return reason.has_value(); });
    return reason;
  }
};

/// Joins `clients` concurrently, one thread each; returns the tables (or rethrows).
std::vector<std::vector<RankInfo>> join_all(std::vector<std::unique_ptr<ControlClient>>& clients,
                                            const std::vector<RankInfo>& infos) {
  std::vector<std::future<std::vector<RankInfo>>> futures;
  for (std::size_t i = 0; i < clients.size(); ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] { return clients[i]->join(infos[i]); }));
  }
  std::vector<std::vector<RankInfo>> tables;
  for (auto& f : futures) tables.push_back(f.get());
  return tables;
}

/// A world of `n` joined clients on `server`, each with an AbortWatch.
struct World {
  std::vector<std::unique_ptr<AbortWatch>> watches;  // outlive the clients that call them
  std::vector<std::unique_ptr<ControlClient>> clients;

  World(const RendezvousServer& server, std::uint32_t n) {
    for (std::uint32_t r = 0; r < n; ++r) {
      clients.push_back(std::make_unique<ControlClient>(client_settings(server, r, n)));
      watches.push_back(std::make_unique<AbortWatch>());
      clients.back()->on_abort(watches.back()->callback());
    }
  }
  void join() {
    std::vector<RankInfo> infos;
    for (std::uint32_t r = 0; r < clients.size(); ++r) infos.push_back(info_of(r));
    join_all(clients, infos);
  }
};

/// A port nothing listens on (bound, read, closed).
std::uint16_t free_port() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return acceptor.local_endpoint().port();
}

}  // namespace

TEST_CASE("control: parse_endpoint and random_token" * doctest::timeout(30)) {
  using baton::transport::parse_endpoint;
  CHECK(parse_endpoint("node0:29500") == std::pair<std::string, std::uint16_t>{"node0", 29500});
  CHECK(parse_endpoint("127.0.0.1:1") == std::pair<std::string, std::uint16_t>{"127.0.0.1", 1});
  CHECK(parse_endpoint("[::1]:29500") == std::pair<std::string, std::uint16_t>{"::1", 29500});
  for (const std::string bad : {"node0", "node0:", ":29500", "node0:99999", "node0:29x", "::1:29500", "[::1]29500", "[::1"}) {
    CAPTURE(bad);
    const auto message = thrown_message<TransportError>([&] { parse_endpoint(bad); });
    CHECK(contains(message, "'" + bad + "'"));
  }
  const auto a = baton::transport::random_token();
  const auto b = baton::transport::random_token();
  CHECK(a.size() == 32);
  CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(a != b);

  using baton::transport::tokens_equal;
  CHECK(tokens_equal(a, a));
  CHECK(tokens_equal("", ""));
  CHECK_FALSE(tokens_equal(a, b));
  CHECK_FALSE(tokens_equal(a.substr(0, 31), a));           // a prefix is not the token
  CHECK_FALSE(tokens_equal(a + "0", a));                   // nor is a longer string
  CHECK_FALSE(tokens_equal("", a));
  std::string last = a;
  last.back() = last.back() == '0' ? '1' : '0';
  CHECK_FALSE(tokens_equal(last, a));  // a difference in the last byte counts as much as in the first
}

TEST_CASE("control: four ranks join and get the same table with binary addresses intact" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(4));
  World world(server, 4);
  std::vector<RankInfo> infos;
  for (std::uint32_t r = 0; r < 4; ++r) infos.push_back(info_of(r));
  const auto tables = join_all(world.clients, infos);
  for (const auto& table : tables) {
    REQUIRE(table.size() == 4);
    for (std::uint32_t r = 0; r < 4; ++r) {
      CHECK(table[r].rank == r);
      CHECK(table[r].host == infos[r].host);
      CHECK(table[r].data_address == infos[r].data_address);
      CHECK(table[r].plan_hash == infos[r].plan_hash);
    }
  }
  CHECK(tables[0][2].data_address.size() == 9);
  CHECK_FALSE(server.outcome().has_value());
  for (auto& w : world.watches) CHECK_FALSE(w->reason.has_value());
}

TEST_CASE("control: a barrier across three ranks lets nobody through early, and names can repeat" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(3));
  World world(server, 3);
  world.join();
  std::atomic<int> arrived{0};
  std::atomic<int> early{0};
  std::vector<std::future<void>> ranks;
  for (std::uint32_t r = 0; r < 3; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      for (int round = 1; round <= 3; ++round) {
        std::this_thread::sleep_for(milliseconds(10 * r));  // arrive at different times
        arrived.fetch_add(1);
        world.clients[r]->barrier("step", 5000ms);
        if (arrived.load() < 3 * round) early.fetch_add(1);
        world.clients[r]->barrier("after step", 5000ms);
      }
    }));
  }
  for (auto& f : ranks) f.get();
  CHECK(early.load() == 0);
  CHECK(arrived.load() == 9);
}

TEST_CASE("control: finish on every rank ends the job ok" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(2));
  World world(server, 2);
  world.join();
  std::vector<std::future<void>> ranks;
  for (auto& c : world.clients) ranks.push_back(std::async(std::launch::async, [&] { c->finish(5000ms); }));
  for (auto& f : ranks) f.get();
  const auto outcome = server.wait_for(5000ms);
  REQUIRE(outcome.has_value());
  CHECK(outcome->ok);
  CHECK(outcome->reason.empty());
  CHECK_FALSE(outcome->failed_rank.has_value());
  world.clients.clear();  // destroying finished clients reports nothing
  CHECK(server.outcome()->ok);
  for (auto& w : world.watches) CHECK_FALSE(w->reason.has_value());
}

TEST_CASE("control: a wrong token is refused and the real rank still joins" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(1));
  auto stray_settings = client_settings(server, 0, 1);
  stray_settings.token = "not-the-token";
  ControlClient stray(stray_settings);
  const auto message = thrown_message<TransportError>([&] { stray.join(info_of(0)); });
  CHECK(contains(message, "wrong job token"));
  CHECK_FALSE(server.outcome().has_value());

  ControlClient real(client_settings(server, 0, 1));
  const auto table = real.join(info_of(0));
  CHECK(table.size() == 1);
  real.finish(5000ms);
  REQUIRE(server.wait_for(5000ms).has_value());
  CHECK(server.outcome()->ok);
}

TEST_CASE("control: a duplicate rank is refused and the job goes on" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(2));
  // Two rank 0s race; whichever says hello second is refused, and the job completes with the other.
  ControlClient first(client_settings(server, 0, 2));
  ControlClient duplicate(client_settings(server, 0, 2));
  ControlClient rank1(client_settings(server, 1, 2));
  auto try_join = [](ControlClient& client, std::uint32_t rank) -> std::string {
    try {
      return client.join(info_of(rank)).size() == 2 ? "table" : "bad table";
    } catch (const TransportError& e) {
      return e.what();
    }
  };
  auto a = std::async(std::launch::async, [&] { return try_join(first, 0); });
  auto b = std::async(std::launch::async, [&] { return try_join(duplicate, 0); });
  CHECK(try_join(rank1, 1) == "table");
  const std::vector<std::string> results{a.get(), b.get()};
  CAPTURE(results[0]);
  CAPTURE(results[1]);
  CHECK(std::count(results.begin(), results.end(), "table") == 1);
  const auto& refused = results[0] == "table" ? results[1] : results[0];
  CHECK(contains(refused, "refused rank 0: rank 0 already joined"));
  CHECK_FALSE(server.outcome().has_value());
}

TEST_CASE("control: ranks that compiled different plans are all refused, naming ranks and hashes" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(3));
  std::vector<std::unique_ptr<ControlClient>> clients;
  for (std::uint32_t r = 0; r < 3; ++r) clients.push_back(std::make_unique<ControlClient>(client_settings(server, r, 3)));
  std::vector<std::future<std::string>> joins;
  for (std::uint32_t r = 0; r < 3; ++r) {
    const std::uint64_t hash = r < 2 ? 0x3f2aULL : 0x9c1bULL;
    joins.push_back(std::async(std::launch::async, [&, r, hash] {
      return thrown_message<TransportError>([&] { clients[r]->join(info_of(r, hash)); });
    }));
  }
  for (auto& j : joins) {
    const auto message = j.get();
    CHECK(contains(message, "different plans"));
    CHECK(contains(message, "ranks 0, 1: plan 0000000000003f2a"));
    CHECK(contains(message, "rank 2: plan 0000000000009c1b"));
  }
  const auto outcome = server.wait_for(1000ms);
  REQUIRE(outcome.has_value());
  CHECK_FALSE(outcome->ok);
  CHECK(contains(outcome->reason, "different plans"));
}

TEST_CASE("control: a rank that never arrives fails the others' join, naming it" * doctest::timeout(30)) {
  SUBCASE("the server's join timeout") {
    auto settings = server_settings(3);
    settings.join_timeout = 500ms;
    RendezvousServer server(settings);
    std::vector<std::future<std::string>> joins;
    for (std::uint32_t r = 0; r < 2; ++r) {  // ranks 0 and 1 of 3
      joins.push_back(std::async(std::launch::async, [&, r] {
        ControlClient client(client_settings(server, r, 3));
        return thrown_message<TransportError>([&] { client.join(info_of(r)); });
      }));
    }
    for (auto& j : joins) CHECK(contains(j.get(), "rank 2 did not join within 500 ms (joined: 0, 1)"));
    const auto outcome = server.wait_for(1000ms);
    REQUIRE(outcome.has_value());
    CHECK_FALSE(outcome->ok);
    CHECK(outcome->failed_rank == 2u);
  }
  SUBCASE("the client's own join timeout") {
    RendezvousServer server(server_settings(4));
    auto s = client_settings(server, 0, 4);
    s.join_timeout = 400ms;
    ControlClient client(s);
    const auto message = thrown_message<TransportError>([&] { client.join(info_of(0)); });
    CHECK(contains(message, "rank 0 timed out after 400 ms waiting for the table"));
    CHECK(contains(message, "(not joined yet: ranks 1-3)"));
  }
}

TEST_CASE("control: clients reach the server by host name" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(1));
  auto s = client_settings(server, 0, 1);
  s.master = "localhost:" + std::to_string(server.port());  // may resolve to ::1 first: it falls back
  ControlClient client(s);
  CHECK(client.join(info_of(0)).size() == 1);
  client.finish(5000ms);
  CHECK(server.wait_for(5000ms)->ok);
}

TEST_CASE("control: clients reach the server over IPv6" * doctest::timeout(30)) {
  auto settings = server_settings(1);
  settings.bind_host = "::1";
  std::optional<RendezvousServer> server;
  try {
    server.emplace(settings);
  } catch (const TransportError& e) {
    return baton::test::skip(baton::test::Missing::ipv6_loopback, std::string("no IPv6 loopback here: ") + e.what());
  }
  auto s = client_settings(*server, 0, 1);
  s.master = "[::1]:" + std::to_string(server->port());
  ControlClient client(s);
  CHECK(client.join(info_of(0)).size() == 1);
  client.finish(5000ms);
  CHECK(server->wait_for(5000ms)->ok);
}

TEST_CASE("control: a port in use is a clear error naming it" * doctest::timeout(30)) {
  RendezvousServer first(server_settings(1));
  auto settings = server_settings(1);
  settings.port = first.port();
  const auto message = thrown_message<TransportError>([&] { RendezvousServer second(settings); });
  CHECK(contains(message, "127.0.0.1:" + std::to_string(first.port())));
  CHECK(contains(message, "in use"));
}

TEST_CASE("control: fail() on one rank aborts the others with its rank and reason" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(3));
  World world(server, 3);
  world.join();
  world.clients[1]->fail("loss is NaN at step 7");
  for (std::uint32_t r : {0u, 2u}) {
    const auto reason = world.watches[r]->wait(5000ms);
    REQUIRE(reason.has_value());
    CHECK(contains(*reason, "rank 1 (host host1)"));
    CHECK(contains(*reason, "loss is NaN at step 7"));
    CHECK(world.clients[r]->aborted() == reason);
    const auto message = thrown_message<TransportError>([&] { world.clients[r]->barrier("next", 5000ms); });
    CHECK(contains(message, "loss is NaN"));
  }
  const auto outcome = server.wait_for(1000ms);
  REQUIRE(outcome.has_value());
  CHECK_FALSE(outcome->ok);
  CHECK(outcome->failed_rank == 1u);
  CHECK(outcome->failed_host == "host1");
  // A second failure does not replace the first.
  world.clients[2]->fail("too late");
  server.abort("also too late");
  CHECK(contains(server.outcome()->reason, "loss is NaN"));
  for (auto& w : world.watches) {
    w->wait(2000ms);
    std::lock_guard lock(w->mutex);
    CHECK(w->calls <= 1);
  }
}

TEST_CASE("control: a rank that goes away without finishing aborts the others" * doctest::timeout(30)) {
  SUBCASE("its ControlClient is destroyed") {
    RendezvousServer server(server_settings(3));
    World world(server, 3);
    world.join();
    world.clients[2].reset();
    for (std::uint32_t r : {0u, 1u}) {
      const auto reason = world.watches[r]->wait(5000ms);
      REQUIRE(reason.has_value());
      CHECK(contains(*reason, "rank 2 (host host2)"));
      CHECK(contains(*reason, "exited without finishing"));
    }
    CHECK(server.wait_for(1000ms)->failed_rank == 2u);
  }
  SUBCASE("its socket closes") {
    RendezvousServer server(server_settings(2));
    AbortWatch watch;
    ControlClient rank0(client_settings(server, 0, 2));
    rank0.on_abort(watch.callback());
    auto join0 = std::async(std::launch::async, [&] { return rank0.join(info_of(0)); });
    {
      boost::asio::io_context io;
      boost::asio::ip::tcp::socket socket(io);
      socket.connect({boost::asio::ip::make_address("127.0.0.1"), server.port()});
      const std::string hello =
          R"({"type":"hello","token":")" + token +
          R"(","rank":1,"world_size":2,"host":"rawhost","data_address":"AAE=","plan_hash":"1234abcd5678ef00"})"
          "\n";
      boost::asio::write(socket, boost::asio::buffer(hello));
      CHECK(join0.get().size() == 2);
    }  // the raw rank 1 closes without bye
    const auto reason = watch.wait(5000ms);
    REQUIRE(reason.has_value());
    CHECK(contains(*reason, "rank 1 (host rawhost) lost its control connection"));
  }
}

TEST_CASE("control: a rank that goes silent is named after the heartbeat timeout" * doctest::timeout(30)) {
  auto settings = server_settings(1);
  settings.heartbeat_timeout = 500ms;
  RendezvousServer server(settings);
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket socket(io);
  socket.connect({boost::asio::ip::make_address("127.0.0.1"), server.port()});
  const auto start = std::chrono::steady_clock::now();
  const std::string hello =
      R"({"type":"hello","token":")" + token +
      R"(","rank":0,"world_size":1,"host":"quiet","data_address":"","plan_hash":"0"})"
      "\n";
  boost::asio::write(socket, boost::asio::buffer(hello));
  const auto outcome = server.wait_for(5000ms);
  REQUIRE(outcome.has_value());
  CHECK_FALSE(outcome->ok);
  CHECK(contains(outcome->reason, "rank 0 (host quiet) sent nothing for 500 ms"));
  CHECK(outcome->failed_rank == 0u);
  CHECK(outcome->failed_host == "quiet");
  CHECK(std::chrono::steady_clock::now() - start < 3s);
}

TEST_CASE("control: a client sees a silent server and aborts locally" * doctest::timeout(30)) {
  // A listener that accepts and never says anything.
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  auto settings = ClientSettings{};
  settings.master = "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port());
  settings.token = token;
  settings.join_timeout = 5000ms;
  settings.heartbeat_interval = 100ms;
  settings.heartbeat_timeout = 400ms;
  AbortWatch watch;
  ControlClient client(settings);
  client.on_abort(watch.callback());
  const auto message = thrown_message<TransportError>([&] { client.join(info_of(0)); });
  CHECK(contains(message, "sent nothing for 400 ms"));
  const auto reason = watch.wait(1000ms);
  REQUIRE(reason.has_value());
  CHECK(contains(*reason, "sent nothing"));
  CHECK(client.aborted() == reason);
}

TEST_CASE("control: join to a port with no server times out with a clear message" * doctest::timeout(30)) {
  const auto port = free_port();
  ClientSettings settings;
  settings.master = "127.0.0.1:" + std::to_string(port);
  settings.token = token;
  settings.join_timeout = 500ms;
  ControlClient client(settings);
  const auto start = std::chrono::steady_clock::now();
  const auto message = thrown_message<TransportError>([&] { client.join(info_of(0)); });
  CHECK(contains(message, "could not reach rendezvous server at 127.0.0.1:" + std::to_string(port) + " within 500 ms"));
  CHECK(contains(message, "refused"));  // the connect error itself
  CHECK(std::chrono::steady_clock::now() - start < 3s);
}

TEST_CASE("control: a client started before the server keeps trying and joins" * doctest::timeout(30)) {
  const auto port = free_port();
  ClientSettings settings;
  settings.master = "127.0.0.1:" + std::to_string(port);
  settings.token = token;
  settings.join_timeout = 5000ms;
  ControlClient client(settings);
  auto join = std::async(std::launch::async, [&] { return client.join(info_of(0)); });
  std::this_thread::sleep_for(400ms);
  auto server_config = server_settings(1);
  server_config.port = port;
  RendezvousServer server(server_config);
  CHECK(join.get().size() == 1);
  client.finish(5000ms);
  REQUIRE(server.wait_for(5000ms).has_value());
  CHECK(server.outcome()->ok);
}

TEST_CASE("control: barrier timeouts, on the client and on the server" * doctest::timeout(30)) {
  SUBCASE("client deadline") {
    RendezvousServer server(server_settings(2));
    World world(server, 2);
    world.join();
    const auto message = thrown_message<TransportError>([&] { world.clients[0]->barrier("lonely", 300ms); });
    CHECK(contains(message, "barrier 'lonely' timed out after 300 ms"));
    CHECK(contains(message, "not arrived: rank 1"));
    // The barrier is still open: when rank 1 comes, rank 0 can wait for it again.
    auto late = std::async(std::launch::async, [&] { world.clients[1]->barrier("lonely", 5000ms); });
    world.clients[0]->barrier("lonely", 5000ms);
    late.get();
    CHECK_FALSE(server.outcome().has_value());
  }
  SUBCASE("server deadline") {
    auto settings = server_settings(3);
    settings.barrier_timeout = 300ms;
    RendezvousServer server(settings);
    World world(server, 3);
    world.join();
    auto rank1 = std::async(std::launch::async, [&] {
      return thrown_message<TransportError>([&] { world.clients[1]->barrier("sync", 5000ms); });
    });
    const auto message = thrown_message<TransportError>([&] { world.clients[0]->barrier("sync", 5000ms); });
    CHECK(contains(message, "barrier 'sync': rank 2 did not arrive within 300 ms (arrived: 0, 1)"));
    CHECK(contains(rank1.get(), "rank 2 did not arrive"));
    CHECK(server.wait_for(1000ms)->failed_rank == 2u);
  }
}

TEST_CASE("control: a launcher gets the handed-out token and hears the server's abort, as do the ranks" * doctest::timeout(30)) {
  auto settings = server_settings(2);
  settings.launchers = 1;
  settings.hand_out_token = true;
  RendezvousServer server(settings);
  LauncherClientSettings launcher_settings;
  launcher_settings.master = "127.0.0.1:" + std::to_string(server.port());
  launcher_settings.node_rank = 1;
  launcher_settings.join_timeout = 5000ms;
  launcher_settings.heartbeat_interval = 100ms;
  launcher_settings.heartbeat_timeout = 3000ms;
  AbortWatch launcher_watch;
  LauncherClient launcher(launcher_settings);
  launcher.on_abort(launcher_watch.callback());
  CHECK(launcher.join() == token);

  World world(server, 2);
  world.join();
  server.abort("exited with signal 9", 1u);
  const auto expected = "rank 1 (host host1): exited with signal 9";
  CHECK(server.outcome()->reason == expected);
  CHECK(server.outcome()->failed_host == "host1");
  const auto heard = launcher_watch.wait(5000ms);
  REQUIRE(heard.has_value());
  CHECK(*heard == expected);
  for (auto& w : world.watches) {
    const auto reason = w->wait(5000ms);
    REQUIRE(reason.has_value());
    CHECK(*reason == expected);
  }
}

TEST_CASE("control: launchers are checked and report their ranks' failures" * doctest::timeout(30)) {
  auto settings = server_settings(1);
  settings.launchers = 1;
  RendezvousServer server(settings);
  LauncherClientSettings s;
  s.master = "127.0.0.1:" + std::to_string(server.port());
  s.node_rank = 1;
  s.join_timeout = 5000ms;
  s.heartbeat_interval = 100ms;
  {
    LauncherClient no_token(s);  // the server does not hand out the token here
    CHECK(contains(thrown_message<TransportError>([&] { no_token.join(); }), "needs a token"));
  }
  s.token = token;
  s.node_rank = 2;
  {
    LauncherClient out_of_range(s);
    CHECK(contains(thrown_message<TransportError>([&] { out_of_range.join(); }), "node 2 is out of range"));
  }
  s.node_rank = 1;
  LauncherClient launcher(s);
  CHECK(launcher.join() == token);
  World world(server, 1);
  world.join();
  launcher.fail("exited with code 3", 0);
  const auto reason = world.watches[0]->wait(5000ms);
  REQUIRE(reason.has_value());
  CHECK(*reason == "rank 0 (host host0): exited with code 3");
  CHECK(server.wait_for(1000ms)->failed_rank == 0u);
}

TEST_CASE("control: a launcher that does not come fails the job after the join timeout" * doctest::timeout(30)) {
  auto settings = server_settings(1);
  settings.launchers = 2;
  settings.join_timeout = 300ms;
  RendezvousServer server(settings);
  const auto outcome = server.wait_for(5000ms);
  REQUIRE(outcome.has_value());
  CHECK(contains(outcome->reason, "launchers of nodes 1, 2 did not join within 300 ms"));
}

TEST_CASE("control: a finished job's launcher closes quietly, and a destroyed server aborts its ranks" * doctest::timeout(30)) {
  auto settings = server_settings(1);
  settings.launchers = 1;
  std::optional<RendezvousServer> server(std::in_place, settings);
  LauncherClientSettings s;
  s.master = "127.0.0.1:" + std::to_string(server->port());
  s.token = token;
  s.join_timeout = 5000ms;
  s.heartbeat_interval = 100ms;
  AbortWatch launcher_watch;
  LauncherClient launcher(s);
  launcher.on_abort(launcher_watch.callback());
  launcher.join();
  {
    ControlClient rank0(client_settings(*server, 0, 1));
    rank0.join(info_of(0));
    rank0.finish(5000ms);
  }
  REQUIRE(server->wait_for(5000ms)->ok);
  server.reset();  // the launcher was told the job is done: the server going away is no failure
  std::this_thread::sleep_for(300ms);
  CHECK_FALSE(launcher.aborted().has_value());
  launcher.finish();

  std::optional<RendezvousServer> second(std::in_place, server_settings(1));
  AbortWatch watch;
  ControlClient rank(client_settings(*second, 0, 1));
  rank.on_abort(watch.callback());
  rank.join(info_of(0));
  second.reset();
  const auto reason = watch.wait(5000ms);
  REQUIRE(reason.has_value());
  CHECK(contains(*reason, "shut down before the job ended"));
}

TEST_CASE("control: telemetry reaches the server in order, commands reach every rank, clocks agree" * doctest::timeout(30)) {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<baton::transport::Telemetry> got;
  ServerSettings ss = server_settings(2);
  ss.on_telemetry = [&](baton::transport::Telemetry t) {
    std::lock_guard lock(mutex);
    got.push_back(std::move(t));
    cv.notify_all();
  };
  RendezvousServer server(ss);
  World world(server, 2);
  std::vector<std::vector<std::string>> commands(2);
  for (std::uint32_t r = 0; r < 2; ++r) {
    world.clients[r]->on_command([&, r](const std::string& kind, const std::string& body) {
      std::lock_guard lock(mutex);
      commands[r].push_back(kind + " " + body);
      cv.notify_all();
    });
  }
  CHECK(world.clients[0]->clock_offset_ns() == 0);  // not measured before join
  world.join();
  for (auto& c : world.clients) {
    // One host, one CLOCK_MONOTONIC: the estimate is within half its round trip of zero.
    CHECK(c->clock_rtt_ns() > 0);
    CHECK(std::abs(c->clock_offset_ns()) <= c->clock_rtt_ns() / 2 + 1);
  }
  // JSON text with quotes, escapes, newlines and non-ASCII goes through unchanged.
  const std::string tricky = "{\"a\": \"x\\\"y\\nz\", \"b\": [1, 2.5, \"\xc3\xa9\"]}";
  for (int i = 0; i < 50; ++i) world.clients[1]->send_telemetry("metrics", "{\"i\": " + std::to_string(i) + "}");
  world.clients[0]->send_telemetry("plan", tricky);
  const std::string big(baton::transport::max_telemetry_bytes, 'x');
  world.clients[0]->send_telemetry("big", "\"" + big.substr(2) + "\"");
  CHECK_THROWS_AS(world.clients[0]->send_telemetry("too big", big + "x"), std::invalid_argument);
  server.send_command("trace", "{\"seconds\": 2}");
  {
    std::unique_lock lock(mutex);
    REQUIRE(cv.wait_for(lock, 10s, [&] {
      return got.size() == 52 && commands[0].size() == 1 && commands[1].size() == 1;
    }));
  }
  int next = 0;
  for (const auto& t : got) {
    if (t.rank == 1) {
      CHECK(t.kind == "metrics");
      CHECK(t.body == "{\"i\": " + std::to_string(next++) + "}");
    }
  }
  CHECK(next == 50);
  auto plan = std::find_if(got.begin(), got.end(), [](const auto& t) { return t.kind == "plan"; });
  REQUIRE(plan != got.end());
  CHECK(plan->rank == 0);
  CHECK(plan->body == tricky);
  auto bigone = std::find_if(got.begin(), got.end(), [](const auto& t) { return t.kind == "big"; });
  REQUIRE(bigone != got.end());
  CHECK(bigone->body.size() == baton::transport::max_telemetry_bytes);
  for (const auto& c : commands) CHECK(c[0] == "trace {\"seconds\": 2}");
  CHECK_FALSE(server.outcome().has_value());
}

// A rank that may leave (RankInfo::may_leave: a parameter-server worker under bounded
// staleness) and leaves once the job has formed is an event, not a failure: the others are
// told who and why, every barrier and the final bye count it out, and the job ends ok. The
// last such rank leaving ends the job, as does a rank that may not leave, or one lost before
// the job formed (its first barrier).
TEST_CASE("control: a rank that may leave leaves and the others finish ok, told who and why" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(3));
  World world(server, 3);
  std::mutex mutex;
  std::vector<std::pair<std::uint32_t, std::string>> told;  // (receiver, "rank: reason")
  for (std::uint32_t r = 0; r < 3; ++r) {
    world.clients[r]->on_left([&, r](std::uint32_t rank, const std::string& reason) {
      std::lock_guard lock(mutex);
      told.emplace_back(r, std::to_string(rank) + ": " + reason);
    });
  }
  std::vector<RankInfo> infos;
  for (std::uint32_t r = 0; r < 3; ++r) {
    infos.push_back(info_of(r));
    infos.back().may_leave = r < 2;  // ranks 0 and 1 work, rank 2 serves
  }
  const auto tables = join_all(world.clients, infos);
  CHECK(tables[2][0].may_leave);
  CHECK_FALSE(tables[2][2].may_leave);
  SUBCASE("a rank gone without finishing, no launcher's word needed") {
    std::vector<std::future<void>> start;
    for (auto& c : world.clients) start.push_back(std::async(std::launch::async, [&] { c->barrier("start", 5000ms); }));
    for (auto& f : start) f.get();
    // Rank 1 is gone without finishing (its process ended): the server tells ranks 0 and 2.
    world.clients[1].reset();
    std::vector<std::future<void>> finish;
    for (std::uint32_t r : {0u, 2u}) {
      finish.push_back(std::async(std::launch::async, [&, r] { world.clients[r]->finish(5000ms); }));
    }
    for (auto& f : finish) f.get();
    const auto outcome = server.wait_for(5000ms);
    REQUIRE(outcome.has_value());
    CHECK(outcome->ok);
    const auto left = server.departed();
    REQUIRE(left.size() == 1);
    CHECK(left[0].first == 1);
    // What the closing client said (ControlClient's destructor reports a rank ending without
    // finish()), or the server's own word for a connection lost without one.
    MESSAGE("rank 1 left: " << left[0].second);
    CHECK_FALSE(left[0].second.empty());
    std::lock_guard lock(mutex);
    CHECK(told.size() == 2);
    for (const auto& [who, what] : told) {
      CHECK(who != 1);
      CHECK(contains(what, "1: "));
    }
    for (std::uint32_t r : {0u, 2u}) CHECK_FALSE(world.watches[r]->reason.has_value());
  }
  SUBCASE("the launcher's word, a barrier waiting on it, then the last worker ends the job") {
    std::vector<std::future<void>> start;
    for (auto& c : world.clients) start.push_back(std::async(std::launch::async, [&] { c->barrier("start", 5000ms); }));
    for (auto& f : start) f.get();
    // Ranks 0 and 2 wait at a barrier; rank 1 never comes: it left, so the barrier opens.
    std::vector<std::future<void>> step;
    for (std::uint32_t r : {0u, 2u}) {
      step.push_back(std::async(std::launch::async, [&, r] { world.clients[r]->barrier("step", 5000ms); }));
    }
    std::this_thread::sleep_for(50ms);
    CHECK(server.rank_exited(1, "it was killed by signal 9 (SIGKILL)"));
    for (auto& f : step) f.get();
    CHECK_FALSE(server.rank_exited(2, "it was killed by signal 9 (SIGKILL)"));  // a server: not a departure
    CHECK(server.rank_exited(0, "it exited with code 1"));  // the last worker: the job ends
    const auto outcome = server.wait_for(5000ms);
    REQUIRE(outcome.has_value());
    CHECK_FALSE(outcome->ok);
    CHECK(contains(outcome->reason, "rank 0"));
    CHECK(contains(outcome->reason, "the last of the ranks that may leave"));
    const auto reason = world.watches[2]->wait(5000ms);
    REQUIRE(reason.has_value());
    CHECK(contains(*reason, "the last of the ranks that may leave"));
    std::lock_guard lock(mutex);
    REQUIRE_FALSE(told.empty());
    CHECK(contains(told.front().second, "1: it was killed by signal 9"));
  }
}

// A rank that left comes back as a new process (ControlClient::rejoin, baton-launch
// --max-restarts): every other rank holds and answers a step, the new one gets the largest and
// every rank's table, says ready, the others take it back with its new address, and it goes; it
// is then in the job again: counted in the final bye, and a second loss is a departure again.
TEST_CASE("control: a rank that left comes back at the step the others hold at" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(3));
  World world(server, 3);
  std::mutex mutex;
  std::vector<std::string> heard;  // "r: what"
  auto note = [&](std::uint32_t r, const std::string& what) {
    std::lock_guard lock(mutex);
    heard.push_back(std::to_string(r) + ": " + what);
  };
  for (std::uint32_t r = 0; r < 3; ++r) {
    world.clients[r]->on_rejoin(RejoinHandlers{
        .hold = [&, r](std::uint32_t rank) {
          note(r, "hold " + std::to_string(rank));
          return std::int64_t{40} + r;  // rank 2 (a server) answers the largest
        },
        .rejoined = [&, r](const RankInfo& info, std::int64_t step) {
          note(r, fmt::format("rejoined {} at {} from {}", info.rank, step, info.host));
          CHECK(info.data_address == "new address");
        },
        .release = [&, r](std::uint32_t rank) { note(r, "release " + std::to_string(rank)); },
    });
  }
  std::vector<RankInfo> infos;
  for (std::uint32_t r = 0; r < 3; ++r) {
    infos.push_back(info_of(r));
    infos.back().may_leave = r < 2;
  }
  join_all(world.clients, infos);

  // Not before it left: refused, and nothing is held.
  {
    ControlClient early(client_settings(server, 1, 3));
    RankInfo me = info_of(1);
    CHECK_THROWS_WITH_AS(early.rejoin(me), doctest::Contains("rank 1 cannot come back: the job has not started yet"),
                         TransportError);
  }
  std::vector<std::future<void>> start;
  for (auto& c : world.clients) start.push_back(std::async(std::launch::async, [&] { c->barrier("start", 5000ms); }));
  for (auto& f : start) f.get();
  {
    ControlClient twin(client_settings(server, 1, 3));
    CHECK_THROWS_WITH_AS(twin.rejoin(info_of(1)), doctest::Contains("rank 1 cannot come back: it has not left the job"),
                         TransportError);
  }
  CHECK(server.rank_exited(1, "it was killed by signal 9 (SIGKILL)"));
  world.clients[1].reset();

  SUBCASE("it comes back, and finishes with the others") {
    ControlClient back(client_settings(server, 1, 3));
    RankInfo me = info_of(1);
    me.host = "host1b";
    me.data_address = "new address";
    const auto [table, step] = back.rejoin(me);
    CHECK(step == 42);
    REQUIRE(table.size() == 3);
    CHECK(table[1].data_address == "new address");
    CHECK(table[2].data_address == infos[2].data_address);
    back.ready(5000ms);
    {
      std::lock_guard lock(mutex);
      // Ranks 0 and 2 held, then took it back, each in that order; rank 1's old self heard nothing.
      for (std::uint32_t r : {0u, 2u}) {
        const auto hold = std::find(heard.begin(), heard.end(), std::to_string(r) + ": hold 1");
        const auto taken =
            std::find(heard.begin(), heard.end(), fmt::format("{}: rejoined 1 at 42 from host1b", r));
        CHECK(hold != heard.end());
        CHECK(taken != heard.end());
        CHECK(hold < taken);
      }
      CHECK(heard.size() == 4);
    }
    CHECK(server.rejoined() == std::vector<std::pair<std::uint32_t, std::int64_t>>{{1, 42}});
    CHECK(server.departed().empty());
    // In the job again: the final bye waits for it.
    std::vector<std::future<void>> finish;
    for (std::uint32_t r : {0u, 2u}) {
      finish.push_back(std::async(std::launch::async, [&, r] { world.clients[r]->finish(5000ms); }));
    }
    std::this_thread::sleep_for(100ms);
    CHECK_FALSE(server.outcome().has_value());
    back.finish(5000ms);
    for (auto& f : finish) f.get();
    const auto outcome = server.wait_for(5000ms);
    REQUIRE(outcome.has_value());
    CHECK(outcome->ok);
  }
  SUBCASE("it dies before it is ready: the others let go of the hold, and it stays left") {
    {
      ControlClient back(client_settings(server, 1, 3));
      RankInfo me = info_of(1);
      me.data_address = "new address";
      const auto [table, step] = back.rejoin(me);
      CHECK(step == 42);
    }  // gone without ready
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    auto released = [&] {
      std::lock_guard lock(mutex);
      return std::count_if(heard.begin(), heard.end(), [](const std::string& h) { return contains(h, "release 1"); });
    };
    while (released() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
    CHECK(released() == 2);
    CHECK(server.rejoined().empty());
    REQUIRE(server.departed().size() == 1);
    // The others finish without it.
    std::vector<std::future<void>> finish;
    for (std::uint32_t r : {0u, 2u}) {
      finish.push_back(std::async(std::launch::async, [&, r] { world.clients[r]->finish(5000ms); }));
    }
    for (auto& f : finish) f.get();
    const auto outcome = server.wait_for(5000ms);
    REQUIRE(outcome.has_value());
    CHECK(outcome->ok);
  }
}

TEST_CASE("control: a rank that may leave, lost before the job formed, ends the job" * doctest::timeout(30)) {
  RendezvousServer server(server_settings(2));
  World world(server, 2);
  std::vector<RankInfo> infos{info_of(0), info_of(1)};
  infos[0].may_leave = true;
  join_all(world.clients, infos);
  CHECK_FALSE(server.rank_exited(0, "it was killed by signal 9 (SIGKILL)"));  // no barrier passed yet
}
