// actors/: the worker's local queue, its outbox for other ranks, and its cross-thread mailbox
// (queue and park/wake state machine). Every wait in here is bounded: a lost wake-up fails a test instead of hanging it.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "baton/actors/local_queue.h"
#include "baton/actors/mailbox.h"
#include "baton/actors/outbox.h"

namespace {

using baton::ActorId;
using baton::LocalQueue;
using baton::Mailbox;
using baton::Message;
using baton::Outbox;
using namespace std::chrono_literals;

Message make_message(std::uint64_t src, std::int64_t piece) {
  Message m;
  m.src = ActorId{src};
  m.dst = ActorId{0};
  m.piece = piece;
  return m;
}

// Polls `pred` until it holds or `limit` passes; returns whether it held.
template <class Pred>
bool wait_until(Pred pred, std::chrono::steady_clock::duration limit = 5s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// Closes the mailbox if the test has not finished by the deadline, so that an owner stuck in
// park() (a lost wake-up) returns and the test fails on its counts instead of hanging.
class Watchdog {
 public:
  Watchdog(Mailbox& mb, std::chrono::steady_clock::duration limit)
      : thread_([this, &mb, limit] {
          const auto deadline = std::chrono::steady_clock::now() + limit;
          while (!done_.load(std::memory_order_acquire)) {
            if (std::chrono::steady_clock::now() > deadline) {
              fired_.store(true, std::memory_order_release);
              mb.close();
              return;
            }
            std::this_thread::sleep_for(1ms);
          }
        }) {}
  ~Watchdog() { stop(); }
  void stop() {
    done_.store(true, std::memory_order_release);
    if (thread_.joinable()) thread_.join();
  }
  bool fired() const { return fired_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> done_{false};
  std::atomic<bool> fired_{false};
  std::thread thread_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// LocalQueue

TEST_CASE("LocalQueue.IsFifo") {
  LocalQueue q;
  CHECK(q.empty());
  CHECK_FALSE(q.pop().has_value());
  for (std::int64_t i = 0; i < 50; ++i) q.push(make_message(1, i));
  CHECK(q.size() == 50);
  for (std::int64_t i = 0; i < 50; ++i) {
    auto m = q.pop();
    REQUIRE(m.has_value());
    CHECK(m->piece == i);
  }
  CHECK(q.empty());
  CHECK_FALSE(q.pop().has_value());
}

TEST_CASE("LocalQueue.GrowsPastCapacityKeepingOrderAcrossWraparound") {
  // Starts at the smallest ring (8) and, with pops interleaved, grows while its head is in
  // the middle of the ring, nine times or more; a std::deque is the reference.
  LocalQueue q(1);
  std::deque<std::int64_t> ref;
  std::mt19937 rng(5);
  std::int64_t next = 0;
  std::size_t mismatches = 0;
  std::size_t max_size = 0;
  for (int round = 0; round < 4000; ++round) {
    const int pushes = std::uniform_int_distribution<int>(0, 12)(rng);
    const int pops = std::uniform_int_distribution<int>(0, 10)(rng);
    for (int i = 0; i < pushes; ++i) {
      q.push(make_message(2, next));
      ref.push_back(next++);
    }
    for (int i = 0; i < pops; ++i) {
      auto m = q.pop();
      if (ref.empty()) {
        mismatches += m.has_value();
        continue;
      }
      if (!m || m->piece != ref.front()) ++mismatches;
      ref.pop_front();
    }
    if (q.size() != ref.size()) ++mismatches;
    max_size = std::max(max_size, q.size());
  }
  CHECK(mismatches == 0);
  CHECK(max_size > 2048);  // 8 -> 4096: grew at least nine times
  while (auto m = q.pop()) {
    REQUIRE_FALSE(ref.empty());
    CHECK(m->piece == ref.front());
    ref.pop_front();
  }
  CHECK(ref.empty());
}

TEST_CASE("LocalQueue.MessageFieldsSurviveTheRing") {
  LocalQueue q(8);
  for (int i = 0; i < 100; ++i) {
    Message m;
    m.src = ActorId::make(3, baton::Device{baton::DeviceType::cpu, 2}, 1, static_cast<std::uint32_t>(i));
    m.dst = ActorId::make(4, baton::Device{}, 0, 9);
    m.piece = i * 1000;
    m.reg = static_cast<std::uint32_t>(i + 7);
    m.slot = static_cast<std::uint16_t>(i % 3);
    m.kind = baton::MsgKind::ack;
    m.consumer = static_cast<std::uint8_t>(i % 5);
    q.push(m);
  }
  for (int i = 0; i < 100; ++i) {
    auto m = q.pop();
    REQUIRE(m);
    CHECK(m->src.index() == static_cast<std::uint32_t>(i));
    CHECK(m->src.rank() == 3);
    CHECK(m->dst.index() == 9);
    CHECK(m->piece == i * 1000);
    CHECK(m->reg == static_cast<std::uint32_t>(i + 7));
    CHECK(m->slot == i % 3);
    CHECK(m->kind == baton::MsgKind::ack);
    CHECK(m->consumer == i % 5);
  }
}

// ---------------------------------------------------------------------------------------------
// Outbox

namespace {

/// A message for actor `index` on `rank`, told apart by `piece`.
Message to_rank(std::uint16_t rank, std::int64_t piece) {
  Message m;
  m.dst = ActorId::make(rank, baton::Device{}, 0, 3);
  m.piece = piece;
  m.kind = baton::MsgKind::ack;
  return m;
}

/// What an outbox handed on: one entry per link message, its rank and its messages' pieces.
struct Sent {
  std::vector<std::pair<std::uint32_t, std::vector<std::int64_t>>> messages;
  auto sink() {
    return [this](std::uint32_t rank, const Message* m, std::size_t n) {
      std::vector<std::int64_t> pieces;
      for (std::size_t i = 0; i < n; ++i) {
        CHECK(m[i].dst.rank() == rank);
        pieces.push_back(m[i].piece);
      }
      messages.emplace_back(rank, std::move(pieces));
    };
  }
};

using Pieces = std::vector<std::int64_t>;

}  // namespace

TEST_CASE("Outbox.TwoMessagesForOneRankGoAsOneLinkMessageAtOnceInOrder") {
  static_assert(Outbox::per_link_message == 2, "Link::max_message holds two actor messages");
  Outbox box(4);
  Sent sent;
  box.add(to_rank(1, 10), 100, sent.sink());
  box.add(to_rank(2, 20), 200, sent.sink());
  CHECK(sent.messages.empty());
  CHECK_FALSE(box.empty());
  CHECK(box.since() == 100);
  box.add(to_rank(1, 11), 300, sent.sink());  // rank 1's pair is full: it goes now
  REQUIRE(sent.messages.size() == 1);
  CHECK(sent.messages[0].first == 1);
  CHECK(sent.messages[0].second == Pieces{10, 11});
  box.add(to_rank(1, 12), 400, sent.sink());
  box.add(to_rank(2, 21), 500, sent.sink());
  REQUIRE(sent.messages.size() == 2);
  CHECK(sent.messages[1].first == 2);
  CHECK(sent.messages[1].second == Pieces{20, 21});
  // Rank 1's third message still waits; since() is no younger than the oldest held.
  CHECK_FALSE(box.empty());
  CHECK(box.since() <= 400);
}

TEST_CASE("Outbox.FlushHandsOnWhatIsHeldOneLinkMessagePerRankOldestFirst") {
  Outbox box(8);
  Sent sent;
  box.add(to_rank(5, 1), 1, sent.sink());
  box.add(to_rank(0, 2), 2, sent.sink());
  box.add(to_rank(7, 3), 3, sent.sink());
  box.flush(sent.sink());
  CHECK(box.empty());
  REQUIRE(sent.messages.size() == 3);
  CHECK(sent.messages[0] == std::pair<std::uint32_t, Pieces>{5, {1}});
  CHECK(sent.messages[1] == std::pair<std::uint32_t, Pieces>{0, {2}});
  CHECK(sent.messages[2] == std::pair<std::uint32_t, Pieces>{7, {3}});
  box.flush(sent.sink());  // nothing left: nothing sent
  CHECK(sent.messages.size() == 3);
  // Empty again, the next message starts the clock afresh.
  box.add(to_rank(5, 4), 50, sent.sink());
  CHECK(box.since() == 50);
}

TEST_CASE("Outbox.FlushToOneRankLeavesTheOthersWaiting") {
  Outbox box(3);
  Sent sent;
  box.add(to_rank(1, 1), 1, sent.sink());
  box.add(to_rank(2, 2), 2, sent.sink());
  box.flush_to(2, sent.sink());
  REQUIRE(sent.messages.size() == 1);
  CHECK(sent.messages[0] == std::pair<std::uint32_t, Pieces>{2, {2}});
  box.flush_to(2, sent.sink());  // nothing held for 2 now
  box.flush_to(9, sent.sink());  // nor for a rank outside the job
  CHECK(sent.messages.size() == 1);
  CHECK_FALSE(box.empty());
  box.add(to_rank(2, 3), 3, sent.sink());
  box.add(to_rank(1, 4), 4, sent.sink());  // pairs with rank 1's first
  REQUIRE(sent.messages.size() == 2);
  CHECK(sent.messages[1] == std::pair<std::uint32_t, Pieces>{1, {1, 4}});
  box.flush(sent.sink());
  REQUIRE(sent.messages.size() == 3);
  CHECK(sent.messages[2] == std::pair<std::uint32_t, Pieces>{2, {3}});
  CHECK(box.empty());
}

TEST_CASE("Outbox.AMessageForARankOutsideTheJobGoesAloneAtOnce") {
  // The link refuses it with its own error; the outbox neither holds it nor writes past its end.
  Outbox box(2);
  Sent sent;
  box.add(to_rank(2, 7), 1, sent.sink());
  REQUIRE(sent.messages.size() == 1);
  CHECK(sent.messages[0] == std::pair<std::uint32_t, Pieces>{2, {7}});
  CHECK(box.empty());
}

TEST_CASE("Outbox.KeepsEachRanksOrderOverManyMessages") {
  Outbox box(4);
  Sent sent;
  std::mt19937 rng(7);
  std::vector<std::int64_t> next(4, 0);
  for (int i = 0; i < 1000; ++i) {
    const auto r = static_cast<std::uint16_t>(rng() % 4);
    box.add(to_rank(r, next[r]++), static_cast<std::uint64_t>(i), sent.sink());
    if (rng() % 17 == 0) box.flush_to(static_cast<std::uint32_t>(rng() % 4), sent.sink());
    if (rng() % 53 == 0) box.flush(sent.sink());
  }
  box.flush(sent.sink());
  std::vector<std::int64_t> seen(4, 0);
  for (const auto& [rank, pieces] : sent.messages) {
    CHECK(pieces.size() <= Outbox::per_link_message);
    for (std::int64_t p : pieces) CHECK(p == seen[rank]++);
  }
  CHECK(seen == next);
}

// ---------------------------------------------------------------------------------------------
// Mailbox: the queue

namespace {

// `producers` threads push `per_producer` messages each (src = producer, piece = sequence)
// into one mailbox; the calling thread owns it and pops, spinning `spin` polls on an empty
// mailbox before it parks (0: parks at once). Checks every message arrives once and each
// producer's in its order.
void many_producers_one_owner(int producers, std::int64_t per_producer, int spin) {
  Mailbox mb(64);  // small, so the queue has to allocate more nodes under load
  Watchdog watchdog(mb, 25s);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      for (std::int64_t i = 0; i < per_producer; ++i) mb.push(make_message(static_cast<std::uint64_t>(p), i));
    });
  }
  std::vector<std::int64_t> next(static_cast<std::size_t>(producers), 0);
  std::int64_t received = 0;
  std::int64_t out_of_order = 0;
  std::int64_t foreign = 0;
  const std::int64_t total = producers * per_producer;
  auto take = [&](const Message& m) {
    ++received;
    if (m.src.bits >= static_cast<std::uint64_t>(producers)) {
      ++foreign;
      return;
    }
    auto& expected = next[static_cast<std::size_t>(m.src.bits)];
    if (m.piece != expected) ++out_of_order;
    expected = m.piece + 1;
  };
  go.store(true, std::memory_order_release);
  int idle = 0;
  while (received < total && !mb.closed()) {
    if (auto m = mb.try_pop()) {
      take(*m);
      idle = 0;
    } else if (++idle > spin) {
      idle = 0;
      if (auto parked = mb.park()) take(*parked);
    }
  }
  for (auto& t : threads) t.join();
  watchdog.stop();
  CHECK_FALSE(watchdog.fired());
  // Nothing extra is left behind.
  std::int64_t extra = 0;
  while (mb.try_pop()) ++extra;
  CHECK(received == total);
  CHECK(extra == 0);
  CHECK(out_of_order == 0);
  CHECK(foreign == 0);
  for (int p = 0; p < producers; ++p) CHECK(next[static_cast<std::size_t>(p)] == per_producer);
  MESSAGE("owner parked " << mb.parks() << " times");
}

}  // namespace

TEST_CASE("Mailbox.ManyProducersEachArriveOnceInOrderWhileOwnerSpins" * doctest::timeout(30)) {
  many_producers_one_owner(4, 50'000, 1000);
}

TEST_CASE("Mailbox.ManyProducersEachArriveOnceInOrderWhileOwnerParks" * doctest::timeout(30)) {
  many_producers_one_owner(4, 50'000, 0);
}

// ---------------------------------------------------------------------------------------------
// Mailbox: the state machine

TEST_CASE("Mailbox.EmptyOnlyWithNothingQueued") {
  Mailbox mb(4);
  CHECK(mb.empty());
  mb.push(make_message(1, 1));
  CHECK_FALSE(mb.empty());
  REQUIRE(mb.try_pop());
  CHECK(mb.empty());
}

TEST_CASE("Mailbox.FreshMailboxIsRunning") {
  Mailbox mb;
  CHECK(mb.state() == Mailbox::State::running);
  CHECK_FALSE(mb.closed());
  CHECK(mb.parks() == 0);
  CHECK_FALSE(mb.try_pop().has_value());
  CHECK(baton::name(Mailbox::State::running) == "running");
  CHECK(baton::name(Mailbox::State::parking) == "parking");
  CHECK(baton::name(Mailbox::State::parked) == "parked");
  CHECK(baton::name(Mailbox::State::closed) == "closed");
}

TEST_CASE("Mailbox.PushToARunningMailboxKeepsItRunning") {
  Mailbox mb(4);
  for (std::int64_t i = 0; i < 100; ++i) mb.push(make_message(1, i));
  CHECK(mb.state() == Mailbox::State::running);
  for (std::int64_t i = 0; i < 100; ++i) {
    auto m = mb.try_pop();
    REQUIRE(m);
    CHECK(m->piece == i);
  }
  CHECK_FALSE(mb.try_pop());
  CHECK(mb.parks() == 0);
}

TEST_CASE("Mailbox.ParkOnEmptyParksUntilPush" * doctest::timeout(30)) {
  Mailbox mb;
  Watchdog watchdog(mb, 20s);
  std::atomic<bool> returned{false};
  std::optional<Message> got;
  std::thread owner([&] {
    got = mb.park();
    returned.store(true, std::memory_order_release);
  });
  const bool parked = wait_until([&] { return mb.state() == Mailbox::State::parked; });
  CHECK(parked);
  // park() announces `parked`, then counts, then sleeps: the count may trail the state.
  CHECK(wait_until([&] { return mb.parks() == 1; }));
  CHECK_FALSE(returned.load(std::memory_order_acquire));

  mb.push(make_message(7, 42));
  // The push moved it back to running (the owner may already be back from park()).
  CHECK(mb.state() == Mailbox::State::running);
  CHECK(wait_until([&] { return returned.load(std::memory_order_acquire); }));
  owner.join();
  watchdog.stop();
  CHECK_FALSE(watchdog.fired());
  CHECK(mb.state() == Mailbox::State::running);
  CHECK(mb.parks() == 1);

  // The message is either what park() returned or still queued, never both.
  std::optional<Message> queued = mb.try_pop();
  REQUIRE(got.has_value() != queued.has_value());
  const Message& m = got ? *got : *queued;
  CHECK(m.src.bits == 7);
  CHECK(m.piece == 42);
  CHECK_FALSE(mb.try_pop());
}

TEST_CASE("Mailbox.CloseWakesParkedOwner" * doctest::timeout(30)) {
  Mailbox mb;
  std::atomic<bool> returned{false};
  std::optional<Message> got;
  std::thread owner([&] {
    got = mb.park();
    returned.store(true, std::memory_order_release);
  });
  CHECK(wait_until([&] { return mb.state() == Mailbox::State::parked; }));
  mb.close();
  CHECK(mb.state() == Mailbox::State::closed);
  // close() is the wake-up of last resort, so no watchdog here: if it does not wake the owner
  // the join below hangs and the CTest timeout fails the test.
  CHECK(wait_until([&] { return returned.load(std::memory_order_acquire); }));
  owner.join();
  CHECK_FALSE(got.has_value());
  CHECK(mb.parks() == 1);
  // Closed is final: a push does not reopen it.
  mb.push(make_message(1, 1));
  CHECK(mb.state() == Mailbox::State::closed);
  CHECK(mb.closed());
}

TEST_CASE("Mailbox.ParkOnClosedReturnsAtOnce" * doctest::timeout(30)) {
  Mailbox mb;
  mb.close();
  CHECK(mb.state() == Mailbox::State::closed);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(mb.park().has_value());
  // Even with a message queued: closed means stop.
  mb.push(make_message(1, 5));
  CHECK_FALSE(mb.park().has_value());
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(mb.state() == Mailbox::State::closed);
  CHECK(mb.parks() == 0);
  // The message that came in after close() is still there for a final drain.
  auto m = mb.try_pop();
  REQUIRE(m);
  CHECK(m->piece == 5);
}

TEST_CASE("Mailbox.ParkWithQueuedMessageReturnsItWithoutSleeping" * doctest::timeout(30)) {
  Mailbox mb;
  mb.push(make_message(3, 11));
  mb.push(make_message(3, 12));
  auto m = mb.park();
  REQUIRE(m.has_value());
  CHECK(m->src.bits == 3);
  CHECK(m->piece == 11);
  CHECK(mb.parks() == 0);
  CHECK(mb.state() == Mailbox::State::running);
  m = mb.park();
  REQUIRE(m.has_value());
  CHECK(m->piece == 12);
  CHECK(mb.parks() == 0);
  CHECK(mb.state() == Mailbox::State::running);
}

TEST_CASE("Mailbox.ParkAgainAfterWakeParksAgain" * doctest::timeout(30)) {
  // Several park / wake cycles on one mailbox: each one counts, each ends back in running.
  Mailbox mb;
  Watchdog watchdog(mb, 20s);
  constexpr int cycles = 5;
  std::atomic<int> woken{0};
  std::thread owner([&] {
    for (int i = 0; i < cycles && !mb.closed(); ++i) {
      auto m = mb.park();
      if (!m) m = mb.try_pop();
      woken.fetch_add(1, std::memory_order_acq_rel);
    }
  });
  for (int i = 0; i < cycles; ++i) {
    CHECK(wait_until([&] { return mb.state() == Mailbox::State::parked; }));
    CHECK(wait_until([&] { return mb.parks() == static_cast<std::uint64_t>(i + 1); }));
    mb.push(make_message(0, i));
    CHECK(wait_until([&] { return woken.load(std::memory_order_acquire) == i + 1; }));
  }
  owner.join();
  watchdog.stop();
  CHECK_FALSE(watchdog.fired());
  CHECK(mb.parks() == cycles);
  CHECK(mb.state() == Mailbox::State::running);
}

TEST_CASE("Mailbox.WakeUpIsNeverLost" * doctest::timeout(30)) {
  // Ping-pong: the producer pushes one message and waits for the owner to take it; the owner
  // parks whenever its mailbox is empty. Each round races a push against a park; a lost
  // wake-up leaves the owner asleep with a message queued, and that round's deadline fails.
  // A round costs a futex wake and, on a loaded machine, up to a scheduler slice, so the
  // rounds stop at a time budget rather than fail a slow machine: a lost wake-up shows as a
  // stuck round, not as a slow test.
  constexpr std::int64_t max_rounds = 20'000;
  constexpr std::int64_t min_rounds = 200;
  const auto budget_end = std::chrono::steady_clock::now() + 4s;
  Mailbox mb;
  std::atomic<std::int64_t> consumed{0};
  std::atomic<std::int64_t> out_of_order{0};
  std::thread owner([&] {
    std::int64_t expected = 0;
    while (!mb.closed()) {
      std::optional<Message> m = mb.try_pop();
      if (!m) m = mb.park();
      if (!m) continue;
      if (m->piece != expected) out_of_order.fetch_add(1, std::memory_order_relaxed);
      expected = m->piece + 1;
      consumed.store(expected, std::memory_order_release);
    }
  });
  std::int64_t rounds = 0;
  std::int64_t stuck_round = -1;
  for (; rounds < max_rounds && std::chrono::steady_clock::now() < budget_end; ++rounds) {
    mb.push(make_message(1, rounds));
    if (!wait_until([&] { return consumed.load(std::memory_order_acquire) == rounds + 1; }, 2s)) {
      stuck_round = rounds;
      break;
    }
  }
  mb.close();  // ends the owner's loop (and wakes it if a round got stuck)
  owner.join();
  CHECK(stuck_round == -1);
  CHECK(rounds >= min_rounds);
  CHECK(consumed.load() == rounds);
  CHECK(out_of_order.load() == 0);
  MESSAGE("owner parked " << mb.parks() << " times in " << rounds << " rounds");
}

TEST_CASE("Mailbox.CloseRacingWithParkAlwaysWakesTheOwner" * doctest::timeout(30)) {
  // close() at every point of park(): running, parking or parked. The owner must return
  // each time.
  for (int round = 0; round < 500; ++round) {
    // Shared with the owner so that, if the owner never returns, it can be detached safely.
    struct Shared {
      Mailbox mb;
      std::atomic<bool> returned{false};
    };
    auto shared = std::make_shared<Shared>();
    std::thread owner([shared] {
      while (!shared->mb.closed()) (void)shared->mb.park();
      shared->returned.store(true, std::memory_order_release);
    });
    if (round % 2 == 1) std::this_thread::sleep_for(std::chrono::microseconds(round % 50));
    shared->mb.close();
    const bool ok = wait_until([&] { return shared->returned.load(std::memory_order_acquire); }, 5s);
    if (!ok) {
      owner.detach();
      FAIL("round " << round << ": close() did not wake the owner");
    }
    owner.join();
    CHECK(shared->mb.state() == Mailbox::State::closed);
  }
}
