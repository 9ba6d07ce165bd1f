// The sim device's stand-in for NCCL (sim.h): "nccl.allreduce", "nccl.reduce_scatter",
// "nccl.all_gather", "nccl.send" and "nccl.recv" on `sim` devices, so that the plans that put
// NCCL between GPUs (data parallelism's buckets, tensor parallelism's sums, pipeline registers
// between ranks) run in CI, under ThreadSanitizer, without a GPU.
//
// It keeps what matters of NCCL to a plan: the calls of a group are paired by their order on
// each member (whichever of the member's actors makes them), not by name, and a call blocks its member's stream until every member has made
// it. So a plan whose members call in different orders fails here as it would hang (or sum the
// wrong tensors) on GPUs: a call whose peers bring another collective or another size fails
// the job naming both, and one whose peers never come gives up when the run fails or after
// `deadline`. Members meet in this process (a job's ranks run in one process in the tests);
// the sum adds the members' parts in member order, rounding to the dtype after each add, as a
// chain of add kernels does, so a sim run has the CPU's bits.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "baton/kernels/kernel.h"
#include "baton/kernels/sim.h"
#include "baton/kernels/tensor.h"

namespace baton::sim {

namespace {

using namespace std::chrono_literals;

/// A member gives up on its peers after this long (or when the run fails, sooner).
constexpr auto deadline = 120s;

enum class Op { all_reduce, reduce_scatter, all_gather };

/// One group's meeting place: the calls in flight, by number.
struct Rendezvous {
  struct Call {
    std::string what;  // the first member's collective, name and size
    std::vector<const Tensor*> parts;
    int arrived = 0, done = 0;
  };
  std::mutex mutex;
  std::condition_variable cv;
  std::map<std::int64_t, Call> calls;
  /// Per member, the number its next call gets: NCCL numbers a communicator's calls on each
  /// rank, whichever actor makes them.
  std::map<std::size_t, std::int64_t> next;
};

std::shared_ptr<Rendezvous> rendezvous_of(const std::string& group) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<Rendezvous>> all;
  std::lock_guard lock(mutex);
  std::erase_if(all, [](const auto& e) { return e.second.expired(); });
  auto& slot = all[group];
  auto r = slot.lock();
  if (!r) slot = r = std::make_shared<Rendezvous>();
  return r;
}

template <class T>
void combine(Op op, const std::vector<const Tensor*>& parts, std::size_t member, Tensor& out) {
  auto o = out.data<T>();
  const std::size_t n = parts.size();
  const std::size_t size = o.size();
  auto add = [](T a, T b) {
    if constexpr (std::is_same_v<T, bfloat16>) {
      return to_bf16(to_float(a) + to_float(b));
    } else {
      return static_cast<T>(a + b);
    }
  };
  if (op == Op::all_gather) {
    for (std::size_t m = 0; m < n; ++m) {
      auto in = parts[m]->data<T>();
      std::copy(in.begin(), in.end(), o.begin() + static_cast<std::ptrdiff_t>(m * in.size()));
    }
    return;
  }
  const std::size_t offset = op == Op::reduce_scatter ? member * size : 0;
  for (std::size_t e = 0; e < size; ++e) {
    T sum = parts[0]->data<T>()[offset + e];
    for (std::size_t m = 1; m < n; ++m) sum = add(sum, parts[m]->data<T>()[offset + e]);
    o[e] = sum;
  }
}

/// What a member of a group keeps: its names for errors, the run's failure flag, and the
/// group's meeting place, where it waits for its peers.
class Member : public Kernel {
 protected:
  Member(std::string actor, std::string group, const std::atomic<bool>* failed)
      : actor_(std::move(actor)), group_(std::move(group)), failed_(failed), meet_(rendezvous_of(group_)) {}

  /// Waits (the meeting's lock held) until `ready`, the run fails, or `deadline` passes.
  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lock, std::int64_t call, Pred ready, const char* for_what) {
    const auto until = std::chrono::steady_clock::now() + deadline;
    while (!ready()) {
      if (failed_ != nullptr && failed_->load(std::memory_order_relaxed)) {
        throw std::runtime_error(fmt::format("{}: call {} on group '{}' gave up waiting for {}: the run failed",
                                             actor_, call, group_, for_what));
      }
      if (std::chrono::steady_clock::now() > until) {
        throw std::runtime_error(fmt::format("{}: call {} on group '{}' waited {} s for {}", actor_, call, group_,
                                             std::chrono::duration_cast<std::chrono::seconds>(deadline).count(),
                                             for_what));
      }
      meet_->cv.wait_for(lock, 10ms);
    }
  }

  std::string actor_, group_;
  const std::atomic<bool>* failed_;
  std::shared_ptr<Rendezvous> meet_;
};

class SimNccl final : public Member {
 public:
  SimNccl(Op op, std::string actor, std::string group, std::size_t member, std::size_t members,
          const std::atomic<bool>* failed)
      : Member(std::move(actor), std::move(group), failed), op_(op), member_(member), members_(members) {}

  void compute(KernelContext& ctx) override {
    if (ctx.inputs.size() != 1 || ctx.outputs.size() != 1 || ctx.inputs[0] == nullptr || ctx.outputs[0] == nullptr) {
      throw std::invalid_argument(fmt::format("{}: a collective reads one input and writes one output", actor_));
    }
    const Tensor& in = *ctx.inputs[0];
    Tensor& out = *ctx.outputs[0];
    const std::string what = fmt::format("{} of {} {} elements", op_name(), in.numel(), name(in.dtype()));
    Rendezvous& r = *meet_;
    std::unique_lock lock(r.mutex);
    const std::int64_t call = r.next[member_]++;
    auto& c = r.calls[call];
    if (c.parts.empty()) {
      c.what = what;
      c.parts.resize(members_, nullptr);
    } else if (c.what != what) {
      throw std::runtime_error(fmt::format(
          "{}: call {} on group '{}' is {}, but another member's call {} is {}: the members call in different "
          "orders (NCCL would hang or sum the wrong tensors)",
          actor_, call, group_, what, call, c.what));
    }
    c.parts[member_] = &in;
    ++c.arrived;
    r.cv.notify_all();
    wait(lock, call, [&] { return c.arrived == static_cast<int>(members_); }, "every member to call");
    switch (in.dtype()) {
      case DType::f32: combine<float>(op_, c.parts, member_, out); break;
      case DType::f64: combine<double>(op_, c.parts, member_, out); break;
      case DType::bf16: combine<bfloat16>(op_, c.parts, member_, out); break;
      default: throw std::invalid_argument(fmt::format("{}: the sim's NCCL has no {} kernel", actor_, name(in.dtype())));
    }
    // The members read each other's inputs: none returns (and lets its input's slot go) until
    // every one has read.
    ++c.done;
    r.cv.notify_all();
    wait(lock, call, [&] { return c.done == static_cast<int>(members_); }, "every member to read");
    if (--c.arrived == 0) r.calls.erase(call);
  }

 private:
  const char* op_name() const {
    return op_ == Op::all_reduce ? "all-reduce" : op_ == Op::reduce_scatter ? "reduce-scatter" : "all-gather";
  }

  Op op_;
  std::size_t member_, members_;
};

/// One half of a point-to-point move ("nccl.send", member 0 of a group of two, or "nccl.recv",
/// member 1): the k-th send of a group pairs with its k-th receive, as NCCL pairs them, and each
/// blocks its stream until the other has come; the receive copies the sender's bytes. The
/// receive's input is its token (the nccl_p2p pass's: the number of the piece that was sent),
/// which must be the number of its call: a token that ran ahead of its data, or a receive of
/// another piece, fails the job.
class SimP2p final : public Member {
 public:
  SimP2p(bool send, std::string actor, std::string group, const std::atomic<bool>* failed)
      : Member(std::move(actor), std::move(group), failed), send_(send) {}

  void compute(KernelContext& ctx) override {
    const std::size_t outputs = send_ ? 0 : 1;
    if (ctx.inputs.size() != 1 || ctx.outputs.size() != outputs || ctx.inputs[0] == nullptr ||
        (!send_ && ctx.outputs[0] == nullptr)) {
      throw std::invalid_argument(fmt::format("{}: {} reads one input and writes {} output{}", actor_,
                                              send_ ? "nccl.send" : "nccl.recv", outputs, outputs == 1 ? "" : "s"));
    }
    const Tensor& mine = send_ ? *ctx.inputs[0] : *ctx.outputs[0];
    const std::string what = fmt::format("{} {} elements", mine.numel(), name(mine.dtype()));
    Rendezvous& r = *meet_;
    std::unique_lock lock(r.mutex);
    const std::size_t member = send_ ? 0 : 1;
    const std::int64_t call = r.next[member]++;
    if (!send_) {
      const Tensor& token = *ctx.inputs[0];
      const std::int64_t sent = token.numel() == 1 && token.dtype() == DType::i64 ? token.data<std::int64_t>()[0] : -1;
      if (sent != call) {
        throw std::runtime_error(fmt::format("{}: receive {} on group '{}' was told piece {} is coming", actor_, call,
                                             group_, sent));
      }
    }
    auto& c = r.calls[call];
    if (c.parts.empty()) {
      c.what = what;
      c.parts.resize(2, nullptr);
    } else if (c.what != what) {
      throw std::runtime_error(fmt::format(
          "{}: {} {} on group '{}' moves {}, but the peer's {} moves {}: the two sides disagree on what crosses",
          actor_, send_ ? "send" : "receive", call, group_, what, send_ ? "receive" : "send", c.what));
    }
    ++c.arrived;
    if (send_) {
      c.parts[0] = &mine;
      r.cv.notify_all();
      wait(lock, call, [&] { return c.done == 1; }, "its receive");
    } else {
      r.cv.notify_all();
      wait(lock, call, [&] { return c.parts[0] != nullptr; }, "its send");
      std::memcpy(ctx.outputs[0]->raw(), c.parts[0]->raw(), mine.nbytes());
      c.done = 1;
      r.cv.notify_all();
    }
    if (--c.arrived == 0 && c.done == 1) r.calls.erase(call);
  }

 private:
  bool send_;
};

}  // namespace

void add_sim_nccl_kernels(KernelRegistry& reg) {
  const std::pair<const char*, Op> ops[] = {
      {"nccl.allreduce", Op::all_reduce}, {"nccl.reduce_scatter", Op::reduce_scatter}, {"nccl.all_gather", Op::all_gather}};
  for (const auto& entry : ops) {
    // Named copies: clang refuses to capture structured bindings.
    const char* op_name = entry.first;
    const Op op = entry.second;
    for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
      reg.add(op_name, DeviceType::sim, dt, [op_name, op](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
        const std::string group = cfg.attrs.get_string("group", "");
        const std::int64_t member = cfg.attrs.get_int("member", -1);
        const auto ranks = cfg.attrs.values().find("ranks");
        const std::size_t members =
            ranks == cfg.attrs.values().end() ? 0 : std::get<std::vector<std::int64_t>>(ranks->second).size();
        if (group.empty() || member < 0 || static_cast<std::size_t>(member) >= members) {
          throw std::invalid_argument(fmt::format("{}: {} needs a group, its members' ranks and its member number "
                                                  "(graph/collectives.h: add_nccl_collective)",
                                                  cfg.actor, op_name));
        }
        const std::atomic<bool>* failed = cfg.services == nullptr ? nullptr : cfg.services->failed;
        return on_stream(std::make_unique<SimNccl>(op, std::string(cfg.actor), group, static_cast<std::size_t>(member),
                                                   members, failed),
                         std::string(cfg.actor));
      });
    }
  }
  for (const bool send : {true, false}) {
    const char* op_name = send ? "nccl.send" : "nccl.recv";
    for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
      reg.add(op_name, DeviceType::sim, dt, [op_name, send](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
        const std::string group = cfg.attrs.get_string("group", "");
        if (group.empty() || cfg.attrs.get_int("member", -1) != (send ? 0 : 1)) {
          throw std::invalid_argument(fmt::format("{}: {} needs a group and is its member {} (the nccl_p2p pass sets "
                                                  "them)",
                                                  cfg.actor, op_name, send ? 0 : 1));
        }
        const std::atomic<bool>* failed = cfg.services == nullptr ? nullptr : cfg.services->failed;
        return on_stream(std::make_unique<SimP2p>(send, std::string(cfg.actor), group, failed), std::string(cfg.actor));
      });
    }
  }
}

}  // namespace baton::sim
