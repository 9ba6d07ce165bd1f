#pragma once
/// The control plane (DESIGN.md section 4): a rendezvous server (run by the launcher of node 0,
/// or by a test) and a client in every rank, over TCP with Boost.Asio. JSON lines on the wire.
///
///   rank -> server   hello {token, rank, world_size, host, data_address, plan_hash}
///                    (data_address in base64, plan_hash as 16 hex digits)
///   server -> ranks  table {ranks: [RankInfo...]}, once all have joined with the same hash;
///                    refused {reason} for a wrong token, a duplicate or out-of-range rank, a
///                    world-size mismatch, or plans whose hashes differ (naming ranks + hashes)
///   rank <-> server  heartbeat, both ways, every heartbeat_interval
///   rank -> server   barrier {name}; server -> ranks barrier_done {name} once all arrived
///   rank -> server   barrier_status {name} / join_status, after a client-side timeout; the
///                    server answers with {missing: [ranks]} so the error can name them
///   rank -> server   fail {reason}; server -> everyone abort {reason}
///   rank -> server   bye (after the final barrier); a connection that closes without it is a
///                    failed rank ("lost its control connection")
///   launcher -> server  launcher {token?, node_rank, host}: a node's launcher; gets
///                    welcome {token} and the abort broadcasts; its connection closing early
///                    is a failed node; launcher -> server fail {reason, rank} for its ranks
///   server -> launchers done, once every rank said bye (the server closing later is no failure)
///   rank -> server   clock {t0}; server -> rank clock_reply {t0, ts}: the rank estimates the
///                    server's steady clock against its own (NTP's way: the reply with the
///                    shortest round trip wins), a few times right after join
///   rank -> server   telemetry {kind, body}: metrics, plans and activity for the dashboard and
///                    traces (body is JSON text, at most max_telemetry_bytes); the server hands
///                    it to ServerSettings::on_telemetry
///   server -> ranks  command {kind, body}: RendezvousServer::send_command (e.g. "record a trace")
///   rank -> server   publish {key, value} (value in base64): a key is set once; the server sends
///                    value {key, value} to every rank (ControlClient::publish / fetch). A second
///                    publish of a key with another value fails the job.
///   A rank that left comes back (ControlClient::rejoin; one at a time, the others queued):
///   new process -> server  hello {..., rejoin: true}; refused unless the rank left a formed job
///   server -> ranks  hold {rank}; rank -> server held {rank, step} (or {rank, error})
///   server -> new    rejoin {step, ranks}: the largest step, every rank's RankInfo
///   new -> server    ready (its runtime built, its data plane connected)
///   server -> ranks  rejoined {rank, step, host, data_address}; rank -> server taken_back {rank}
///   server -> new    go {step}. Before ready, the new process dying, failing or the others not
///                    answering within the join timeout sends release {rank} to the ranks (it
///                    stays left); after it, it leaves again as any rank that may leave.
///
/// Boost.JSON's implementation is compiled into baton::transport (control.cpp): a program that
/// links it uses <boost/json.hpp> and must not include <boost/json/src.hpp> again.
///
/// Every wait has a deadline, and the error names who is late. Nothing here knows graphs or
/// actors: the plan is only a hash.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "baton/transport/link.h"

namespace baton::transport {

/// What a rank tells the rendezvous server about itself.
struct RankInfo {
  std::uint32_t rank = 0;
  std::string host;          // the rank's host name, for messages
  std::string data_address;  // the data plane's address (opaque bytes; base64 on the wire)
  std::uint64_t plan_hash = 0;
  /// This rank may leave the job once it has formed (every rank passed the first barrier) without ending it (a parameter-server
  /// worker under bounded staleness, docs/parameter-servers.md): when it dies, fails or goes
  /// silent, the server tells the others (ControlClient::on_left) and counts it out of every
  /// barrier and of the final bye, instead of aborting the job. False: its loss ends the job.
  bool may_leave = false;
};

/// "host:port" -> {host, port}; "[::1]:29500" for IPv6. Throws TransportError naming the text.
std::pair<std::string, std::uint16_t> parse_endpoint(const std::string& text);

/// A fresh random job token (hex, 32 characters: 128 bits from std::random_device).
std::string random_token();

/// Whether a peer's token is the job's, in time that does not depend on where they differ
/// (the server checks every hello this way).
bool tokens_equal(std::string_view given, std::string_view expected);

/// The largest telemetry body a rank may send in one message (the server reads lines of at
/// most 1 MiB); a sender splits bigger payloads.
inline constexpr std::size_t max_telemetry_bytes = std::size_t{512} << 10;

/// What a rank does when another one comes back (ControlClient::on_rejoin), on the control
/// client's thread, in order with the other messages. A handler that throws sends its what() to
/// the server instead: before `rejoined` the rank does not come back; at `rejoined` the job
/// fails. Unset: nothing to do (hold answers step 0).
struct RejoinHandlers {
  /// Hold for `rank` and return the first step it may come back at (Runtime::hold_for_rejoin).
  std::function<std::int64_t(std::uint32_t rank)> hold;
  /// It is back from `step`: its new RankInfo (host, data address).
  std::function<void(const RankInfo& info, std::int64_t step)> rejoined;
  /// It does not come back after all (Runtime::release_hold).
  std::function<void(std::uint32_t rank)> release;
};

/// What a rank sent on the telemetry channel, as the server hands it on.
struct Telemetry {
  std::uint32_t rank = 0;
  std::string kind;
  std::string body;  // JSON text, as the rank wrote it
};

struct ServerSettings {
  std::string bind_host = "0.0.0.0";
  std::uint16_t port = 0;  // 0: a free port, see RendezvousServer::port()
  std::string token;       // required of every rank (and of launchers, unless hand_out_token)
  std::uint32_t world_size = 1;
  /// Launchers of other nodes that will connect (0 when there is one node).
  std::uint32_t launchers = 0;
  /// Launchers may join without the token and are given it (torchrun-style --nnodes without
  /// a shared secret). The token then only keeps stray ranks of other jobs out.
  bool hand_out_token = false;
  /// From the first rank's hello until every rank has joined (a job whose programs never use
  /// the control plane, e.g. a shell command under baton-launch, is not failed by it); for
  /// launchers, from the server's start.
  std::chrono::milliseconds join_timeout{120'000};
  /// From the first rank's arrival at a barrier until the last one's.
  std::chrono::milliseconds barrier_timeout{600'000};
  std::chrono::milliseconds heartbeat_interval{1'000};
  /// A rank or launcher that sends nothing for this long has failed.
  std::chrono::milliseconds heartbeat_timeout{10'000};
  /// Telemetry from the ranks, called on the server's thread in arrival order (keep it short:
  /// copy and return). Unset: telemetry is dropped.
  std::function<void(Telemetry)> on_telemetry;
};

/// How the job ended, as the server saw it.
struct JobOutcome {
  bool ok = false;
  std::string reason;                       // empty when ok
  std::optional<std::uint32_t> failed_rank;  // the rank that failed first, if one did
  std::string failed_host;
};

/// Serves one job on its own thread. Binds in the constructor: a port in use is a
/// TransportError naming host and port.
class RendezvousServer {
 public:
  explicit RendezvousServer(ServerSettings settings);
  ~RendezvousServer();  // stops the thread; never throws
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  std::uint16_t port() const;
  /// Blocks until every rank said bye (ok) or the job failed. Returns nullopt if `timeout`
  /// passed first.
  std::optional<JobOutcome> wait_for(std::chrono::milliseconds timeout);
  /// Ends the job on every rank and launcher with this reason (e.g. the launcher saw a rank
  /// die). The first failure wins; later ones are ignored.
  void abort(const std::string& reason, std::optional<std::uint32_t> rank = std::nullopt,
             const std::string& host = {});
  /// The outcome so far, if the job has ended.
  std::optional<JobOutcome> outcome() const;
  /// How many launchers of other nodes have finished (LauncherClient::finish: every rank of
  /// their node exited 0). Node 0's launcher, its own ranks done, waits for all of them: ranks
  /// that never use the control plane say no bye, so the outcome alone cannot tell.
  std::uint32_t finished_launchers() const;
  /// Any thread: sends `command {kind, body}` to every rank that has joined (ControlClient::
  /// on_command). `body` is JSON text.
  void send_command(const std::string& kind, const std::string& body);
  /// Any thread (the launcher, which saw rank `rank` exit): if the rank may leave
  /// (RankInfo::may_leave) and the job has formed and not ended, it leaves with `reason` (the
  /// others are told; a rank that left already keeps its first reason) and this returns true;
  /// else false, and the caller ends the job as for any failure (abort()).
  bool rank_exited(std::uint32_t rank, const std::string& reason);
  /// The ranks that have left so far (and not come back), with their reasons, in order.
  std::vector<std::pair<std::uint32_t, std::string>> departed() const;
  /// The ranks that came back (ControlClient::rejoin), with the step each came back at, in order.
  std::vector<std::pair<std::uint32_t, std::int64_t>> rejoined() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct ClientSettings {
  std::string master;  // "host:port" of the rendezvous server
  std::string token;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 1;
  /// join(): keep retrying the connection (the server may start later) and then wait for the
  /// table, until this passes.
  std::chrono::milliseconds join_timeout{120'000};
  std::chrono::milliseconds heartbeat_interval{1'000};
  /// The server silent for this long: the job is aborted locally ("rendezvous server ... lost").
  std::chrono::milliseconds heartbeat_timeout{10'000};
};

/// A rank's connection to the rendezvous server. After join() a background thread sends
/// heartbeats and listens for abort broadcasts.
class ControlClient {
 public:
  explicit ControlClient(ClientSettings settings);
  /// Without finish(), closing tells the server this rank failed (if it has not said so).
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  /// Connects, says hello, waits for the table (every rank's RankInfo, indexed by rank).
  /// Throws TransportError: refused (with the server's reason), timed out, or aborted.
  /// The rank sent is ClientSettings::rank (me.rank is not used); an empty me.host is replaced
  /// by this machine's host name.
  std::vector<RankInfo> join(const RankInfo& me);
  /// Instead of join(), for a new process of a rank that left the job (it may leave, and the
  /// job has formed): every other rank holds for it. Returns every rank's RankInfo and the step
  /// it comes back at. Then build the runtime (RuntimeSettings::rejoin_step), connect the data
  /// plane and call ready(). Throws TransportError (refused: it has not left, the job has not
  /// formed, it is coming back already; timed out; aborted).
  std::pair<std::vector<RankInfo>, std::int64_t> rejoin(const RankInfo& me);
  /// After rejoin(): says this rank is ready and waits until every other rank has taken it back.
  /// Throws TransportError if it is refused meanwhile, the job is aborted or `timeout` passes.
  void ready(std::chrono::milliseconds timeout);
  /// What this rank does when another comes back. Set before join().
  void on_rejoin(RejoinHandlers handlers);
  /// Called once, on the client's thread, when the job is aborted (broadcast or server lost).
  /// Set before join(). What it uses must outlive the client, and it must not destroy the
  /// client.
  void on_abort(std::function<void(const std::string& reason)> callback);
  /// A rank that may leave (RankInfo::may_leave) left the job: it died, failed or went silent.
  /// Called on the client's thread with the rank and the reason; the job goes on.
  void on_left(std::function<void(std::uint32_t rank, const std::string& reason)> callback);
  /// Waits until every rank has reached the barrier `name`. Throws TransportError if the job
  /// was aborted meanwhile or `timeout` passed (naming the ranks that have not arrived, as far
  /// as the server knows).
  void barrier(const std::string& name, std::chrono::milliseconds timeout);
  /// This rank failed: the server aborts every rank with "rank R (host): reason". Waits (about
  /// a second at most) until the message is written. Never throws; does nothing before join()
  /// or once the job is aborted.
  void fail(const std::string& reason);
  /// The final barrier, then bye. The server counts this rank as done.
  void finish(std::chrono::milliseconds timeout);
  /// The abort reason, once aborted.
  std::optional<std::string> aborted() const;
  /// Any thread, after join(): shares `value` (any bytes) under `key` with every rank of the job
  /// (NCCL's unique ids travel this way). Does not wait; a value published before a barrier
  /// has reached every rank when that barrier completes. Throws TransportError if not joined
  /// or aborted.
  void publish(const std::string& key, const std::string& value);
  /// Any thread, after join(): the value some rank published under `key`, waiting for it up to
  /// `timeout`. Throws TransportError naming the key if it does not come in time, the job is
  /// aborted or the connection closes.
  std::string fetch(const std::string& key, std::chrono::milliseconds timeout);
  /// Any thread, after join(): sends `telemetry {kind, body}` to the server (body: JSON text of
  /// at most max_telemetry_bytes, else std::invalid_argument). Does not wait; does nothing once
  /// the job is aborted or finished.
  void send_telemetry(const std::string& kind, const std::string& body);
  /// Called on the client's thread for each command from the server. Set before join().
  void on_command(std::function<void(const std::string& kind, const std::string& body)> callback);
  /// The server's steady clock minus this process's, in nanoseconds, as measured right after
  /// join() (0 before, or if the server did not answer). Add it to a local steady_clock time to
  /// get the server's. Within one host both are CLOCK_MONOTONIC and this is about 0.
  std::int64_t clock_offset_ns() const;
  /// The round trip of the measurement that clock_offset_ns() comes from: its uncertainty is
  /// half of this.
  std::int64_t clock_rtt_ns() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct LauncherClientSettings {
  std::string master;
  std::string token;  // empty: ask the server for it (ServerSettings::hand_out_token)
  std::uint32_t node_rank = 1;
  std::chrono::milliseconds join_timeout{120'000};
  std::chrono::milliseconds heartbeat_interval{1'000};
  std::chrono::milliseconds heartbeat_timeout{10'000};
};

/// A launcher of node >= 1: learns the token, reports its ranks' failures, hears aborts.
class LauncherClient {
 public:
  explicit LauncherClient(LauncherClientSettings settings);
  ~LauncherClient();
  LauncherClient(const LauncherClient&) = delete;
  LauncherClient& operator=(const LauncherClient&) = delete;

  /// Connects (retrying until join_timeout) and returns the job token. Throws TransportError.
  /// Destroying a joined LauncherClient without finish() fails the job ("exited without
  /// finishing"), unless the job already ended.
  std::string join();
  void on_abort(std::function<void(const std::string& reason)> callback);
  /// A rank of this node failed (exit code, signal): the server aborts the job.
  void fail(const std::string& reason, std::uint32_t rank);
  /// Whether rank `rank` may leave the job (RankInfo::may_leave): the server says which, once
  /// the job has formed. Such a rank's exit is reported with fail(), and the server counts it
  /// as a departure; its launcher does not end the job over it.
  bool may_leave(std::uint32_t rank) const;
  /// Every rank of this node exited 0: close without failing the job.
  void finish();
  std::optional<std::string> aborted() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::transport
