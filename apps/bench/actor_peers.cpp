// The TBB flow graph and CAF chains of baton-bench-actors (see actor_peers.h).
#include "actor_peers.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#ifdef BATON_BENCH_HAS_TBB
#include <oneapi/tbb/flow_graph.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/version.h>
#endif

#ifdef BATON_BENCH_HAS_CAF
#include <caf/all.hpp>
#endif

namespace baton::bench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void check_delivered(const std::string& peer, std::int64_t delivered, std::int64_t pieces) {
  if (delivered != pieces) {
    throw std::runtime_error(
        fmt::format("{}: the last stage saw {} of {} pieces", peer, delivered, pieces));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// TBB flow graph

#ifdef BATON_BENCH_HAS_TBB

std::string tbb_missing() {
  return {};
}

namespace {

class TbbChain final : public PeerChain {
 public:
  TbbChain(int threads, int window) : arena_(threads), window_(window) {}

  PeerSample run(const std::vector<StageWork>& stages, std::int64_t pieces,
                 double timeout_s) override {
    namespace flow = oneapi::tbb::flow;
    if (stages.size() < 2)
      throw std::invalid_argument("tbb_flow_graph: a chain needs a source and a sink");
    PeerSample out;
    const auto t0 = Clock::now();
    arena_.execute([&] {
      flow::graph g;
      std::int64_t next = 0;
      std::atomic<std::int64_t> delivered{0};
      flow::input_node<std::int64_t> source(g, [&](oneapi::tbb::flow_control& fc) -> std::int64_t {
        if (next >= pieces) {
          fc.stop();
          return 0;
        }
        stages.front()();
        return next++;
      });
      flow::limiter_node<std::int64_t> limiter(g, static_cast<std::size_t>(window_));
      // The middle stages, then the sink, whose continue_msg gives the limiter its token back.
      std::vector<std::unique_ptr<flow::function_node<std::int64_t, std::int64_t>>> middle;
      for (std::size_t i = 1; i + 1 < stages.size(); ++i) {
        const StageWork* work = &stages[i];
        middle.push_back(std::make_unique<flow::function_node<std::int64_t, std::int64_t>>(
            g, flow::serial, [work](std::int64_t p) {
              (*work)();
              return p;
            }));
      }
      const StageWork* last = &stages.back();
      flow::function_node<std::int64_t, flow::continue_msg> sink(
          g, flow::serial, [&, last](std::int64_t) {
            (*last)();
            delivered.fetch_add(1, std::memory_order_relaxed);
            return flow::continue_msg();
          });
      flow::make_edge(source, limiter);
      if (middle.empty()) {
        flow::make_edge(limiter, sink);
      } else {
        flow::make_edge(limiter, *middle.front());
        for (std::size_t i = 0; i + 1 < middle.size(); ++i)
          flow::make_edge(*middle[i], *middle[i + 1]);
        flow::make_edge(*middle.back(), sink);
      }
      flow::make_edge(sink, limiter.decrementer());
      source.activate();
      // A lost piece cannot hang the wait (the graph is done when no task is left); it shows as
      // a short count below.
      g.wait_for_all();
      out.delivered = delivered.load();
    });
    out.wall_s = seconds_since(t0);
    if (out.wall_s > timeout_s) {
      throw std::runtime_error(fmt::format("tbb_flow_graph: the run took {:.1f} s, past {:.0f} s",
                                           out.wall_s, timeout_s));
    }
    check_delivered(name(), out.delivered, pieces);
    return out;
  }

  std::string name() const override { return "tbb_flow_graph"; }
  std::string describe() const override {
    return fmt::format(
        "oneTBB {} flow graph: input_node source, serial function_nodes, at most {} pieces in "
        "flight "
        "(limiter_node), task_arena of {} threads",
        TBB_VERSION_STRING, window_, arena_.max_concurrency());
  }

 private:
  oneapi::tbb::task_arena arena_;
  int window_;
};

}  // namespace

std::unique_ptr<PeerChain> make_tbb_chain(int threads, int window) {
  return std::make_unique<TbbChain>(threads, window);
}

#else

std::string tbb_missing() {
  return "built without oneTBB (apt-get install libtbb-dev, then reconfigure)";
}
std::unique_ptr<PeerChain> make_tbb_chain(int, int) {
  throw std::runtime_error(tbb_missing());
}

#endif

// ---------------------------------------------------------------------------------------------
// CAF

#ifdef BATON_BENCH_HAS_CAF

std::string caf_missing() {
  return {};
}

namespace {

using request_atom = caf::atom_constant<caf::atom("request")>;
using ack_atom = caf::atom_constant<caf::atom("ack")>;
using start_atom = caf::atom_constant<caf::atom("start")>;
using done_atom = caf::atom_constant<caf::atom("done")>;

struct StageState {
  std::int64_t received = 0;  // requests seen from upstream
  std::int64_t acts = 0;      // pieces processed (and sent downstream)
  std::int64_t freed = 0;     // pieces acked by downstream
  caf::actor prev;            // the upstream stage, learnt from its first request
};

/// One stage: acts while it has input and a free slot downstream, as baton's actors do.
caf::behavior stage_actor(caf::stateful_actor<StageState>* self, const StageWork* work,
                          caf::actor next, caf::actor done_to, std::int64_t pieces, int slots,
                          bool source) {
  auto advance = [=] {
    StageState& s = self->state;
    while (true) {
      const bool has_input = source ? s.acts < pieces : s.received > s.acts;
      const bool has_slot = !next || s.acts - s.freed < slots;
      if (!has_input || !has_slot) break;
      (*work)();
      const std::int64_t p = s.acts++;
      if (next) self->send(next, request_atom::value, p);
      if (s.prev) self->send(s.prev, ack_atom::value, p);
      if (!next && s.acts == pieces) self->send(done_to, done_atom::value, s.acts);
    }
  };
  return {
      [=](start_atom) { advance(); },
      [=](request_atom, std::int64_t p) {
        if (!self->state.prev)
          self->state.prev = caf::actor_cast<caf::actor>(self->current_sender());
        self->state.received = p + 1;
        advance();
      },
      [=](ack_atom, std::int64_t p) {
        self->state.freed = p + 1;
        advance();
      },
  };
}

caf::actor_system_config& with_threads(caf::actor_system_config& cfg, int threads) {
  cfg.set("scheduler.max-threads", static_cast<std::size_t>(threads));
  return cfg;
}

class CafChain final : public PeerChain {
 public:
  CafChain(int threads, int slots)
      : system_(with_threads(cfg_, threads)), threads_(threads), slots_(slots) {
    // The setting is a string key: check that the scheduler took it.
    const auto workers = system_.scheduler().num_workers();
    if (workers != static_cast<std::size_t>(threads)) {
      throw std::runtime_error(fmt::format(
          "caf: asked for {} scheduler threads, the actor system has {}", threads, workers));
    }
  }

  PeerSample run(const std::vector<StageWork>& stages, std::int64_t pieces,
                 double timeout_s) override {
    if (stages.size() < 2) throw std::invalid_argument("caf: a chain needs a source and a sink");
    PeerSample out;
    caf::scoped_actor self{system_};
    const auto t0 = Clock::now();
    // From the sink up, so that each stage is spawned knowing the next.
    std::vector<caf::actor> actors(stages.size());
    caf::actor next;
    for (std::size_t i = stages.size(); i-- > 0;) {
      actors[i] = system_.spawn(stage_actor, &stages[i], next, caf::actor_cast<caf::actor>(self),
                                pieces, slots_, i == 0);
      next = actors[i];
    }
    self->send(actors.front(), start_atom::value);
    bool timed_out = false;
    self->receive(
        [&](done_atom, std::int64_t n) { out.delivered = n; },
        caf::after(std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1e3))) >>
            [&] { timed_out = true; });
    out.wall_s = seconds_since(t0);
    // The stages hold each other (next, prev): end them, or the system waits for them forever.
    for (const auto& a : actors) self->send_exit(a, caf::exit_reason::user_shutdown);
    if (timed_out)
      throw std::runtime_error(
          fmt::format("caf: no 'done' from the sink within {:.0f} s", timeout_s));
    check_delivered(name(), out.delivered, pieces);
    return out;
  }

  std::string name() const override { return "caf"; }
  std::string describe() const override {
    return fmt::format(
        "CAF {}.{}.{} event-based actors, one per stage, request + ack per hop with at most {} "
        "un-acked per edge, "
        "{} scheduler threads (work stealing)",
        CAF_MAJOR_VERSION, CAF_MINOR_VERSION, CAF_PATCH_VERSION, slots_, threads_);
  }

 private:
  caf::actor_system_config cfg_;
  caf::actor_system system_;
  int threads_;
  int slots_;
};

}  // namespace

std::unique_ptr<PeerChain> make_caf_chain(int threads, int slots) {
  return std::make_unique<CafChain>(threads, slots);
}

#else

std::string caf_missing() {
  return "built without CAF (apt-get install libcaf-dev, then reconfigure)";
}
std::unique_ptr<PeerChain> make_caf_chain(int, int) {
  throw std::runtime_error(caf_missing());
}

#endif

}  // namespace baton::bench
