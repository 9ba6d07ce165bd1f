// The NCCL kernels and a run's communicators by group: the part of the NCCL path that does not
// call NCCL itself (that is kernels/src/cuda/nccl.cpp, or nccl_none.cpp), so it builds and its
// id hand-over can be tested everywhere.
#include <algorithm>
#include <set>
#include <stdexcept>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/kernels/kernel.h"
#include "baton/kernels/nccl.h"
#include "baton/kernels/store.h"
#include "baton/kernels/tensor.h"

namespace baton::nccl {

std::uint16_t Group::root() const {
  if (ranks.empty()) throw std::invalid_argument(fmt::format("NCCL group '{}' has no members", name));
  return static_cast<std::uint16_t>(*std::min_element(ranks.begin(), ranks.end()));
}

std::string Group::key() const { return "nccl/" + name; }

void Group::check() const {
  if (name.empty()) throw std::invalid_argument("an NCCL group without a name");
  if (ranks.empty()) throw std::invalid_argument(fmt::format("NCCL group '{}' has no members", name));
  if (ranks.size() != devices.size()) {
    throw std::invalid_argument(fmt::format("NCCL group '{}': {} ranks but {} devices", name, ranks.size(), devices.size()));
  }
  std::set<std::pair<std::int64_t, std::int64_t>> seen;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] > 65535 || devices[i] < 0 || devices[i] > 255) {
      throw std::invalid_argument(
          fmt::format("NCCL group '{}': member {} is on rank {}, cuda:{}", name, i, ranks[i], devices[i]));
    }
    // NCCL refuses two ranks of one communicator on one GPU ("duplicate GPU detected").
    if (!seen.insert({ranks[i], devices[i]}).second) {
      throw std::invalid_argument(fmt::format("NCCL group '{}': two members on rank {} cuda:{} (one member per GPU)",
                                              name, ranks[i], devices[i]));
    }
  }
}

Communicators::Communicators(std::uint16_t rank, Store* store, WaitSettings wait,
                             std::function<void(const std::string&)> on_failure)
    : rank_(rank), store_(store), wait_(wait), on_failure_(std::move(on_failure)) {}

Communicators::~Communicators() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  // All at once: finalising one rank of a communicator may need the others of this process.
  std::vector<Communicator*> all;
  for (auto& [name, entry] : groups_) {
    for (auto& [member, comm] : entry->comms) all.push_back(comm.get());
  }
  Communicator::close(all);
}

void Communicators::prepare(const Group& group) {
  group.check();
  std::lock_guard lock(mutex_);
  if (auto it = groups_.find(group.name); it != groups_.end()) {
    const auto& slot = it->second;
    if (slot->group != group) {
      throw std::invalid_argument(fmt::format("NCCL group '{}' is laid out differently by two of its actors "
                                              "(ranks [{}] devices [{}] and ranks [{}] devices [{}])",
                                              group.name, fmt::join(slot->group.ranks, ", "),
                                              fmt::join(slot->group.devices, ", "), fmt::join(group.ranks, ", "),
                                              fmt::join(group.devices, ", ")));
    }
    return;
  }
  auto entry = std::make_unique<Entry>();
  entry->group = group;
  if (group.root() == rank_) {
    entry->id = make_unique_id();
    const bool spans_ranks =
        std::any_of(group.ranks.begin(), group.ranks.end(), [&](std::int64_t r) { return r != rank_; });
    if (spans_ranks) {
      if (store_ == nullptr) {
        throw std::runtime_error(fmt::format("NCCL group '{}' spans ranks [{}] but this runtime has no store to hand "
                                             "its unique id on (run the plan with run_job)",
                                             group.name, fmt::join(group.ranks, ", ")));
      }
      store_->set(group.key(), entry->id);
    }
  }
  groups_.emplace(group.name, std::move(entry));
}

Communicator& Communicators::communicator(const std::string& name, int member) {
  Entry* e = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = groups_.find(name);
    if (it == groups_.end()) throw std::logic_error(fmt::format("NCCL group '{}' was not prepared", name));
    e = it->second.get();
  }
  // One lock per group: a group waiting for its peers must not hold up another group's set-up
  // on another worker (the other ranks may make them in another order).
  std::lock_guard lock(e->mutex);
  if (auto it = e->comms.find(member); it != e->comms.end()) return *it->second;
  if (!e->error.empty()) throw std::runtime_error(e->error);
  const Group& g = e->group;
  if (member < 0 || static_cast<std::size_t>(member) >= g.ranks.size() || g.ranks[static_cast<std::size_t>(member)] != rank_) {
    throw std::logic_error(fmt::format("NCCL group '{}' has no member {} on rank {}", name, member, rank_));
  }
  try {
    if (e->id.empty()) {
      if (store_ == nullptr) {
        throw std::runtime_error(fmt::format("NCCL group '{}': rank {} has no store to get the unique id from "
                                             "(run the plan with run_job)",
                                             name, rank_));
      }
      e->id = store_->get(g.key(), wait_.timeout);
      if (e->id.size() != unique_id_bytes) {
        throw std::runtime_error(fmt::format("NCCL group '{}': the unique id from rank {} has {} bytes, not {}", name,
                                             g.root(), e->id.size(), unique_id_bytes));
      }
    }
    std::vector<int> local;
    std::vector<Device> devices;
    for (std::size_t i = 0; i < g.ranks.size(); ++i) {
      if (g.ranks[i] != rank_) continue;
      local.push_back(static_cast<int>(i));
      devices.push_back(Device{DeviceType::cuda, static_cast<std::uint8_t>(g.devices[i])});
    }
    auto comms = Communicator::create_local(e->id, static_cast<int>(g.ranks.size()), local, devices, name, wait_);
    for (std::size_t j = 0; j < local.size(); ++j) e->comms[local[j]] = std::move(comms[j]);
    start_watchdog();
  } catch (const std::exception& ex) {
    // Every local member fails the same way; none tries again (its peers have given up too).
    e->error = ex.what();
    throw;
  }
  return *e->comms.at(member);
}

void Communicators::start_watchdog() {
  std::lock_guard lock(mutex_);
  if (!watchdog_.joinable() && !stopping_) watchdog_ = std::thread([this] { watch(); });
}

// A collective whose peer never calls it hangs on the device, where no host call of NCCL sees
// it (ncclCommGetAsyncError stays ncclSuccess); only its age tells. PyTorch's ProcessGroupNCCL
// keeps such a watchdog thread for the same reason.
void Communicators::watch() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, watchdog_period, [&] { return stopping_; });
    if (stopping_) break;
    // Communicators are only added while the run goes (the destructor stops this thread before
    // it closes them), so the pointers stay good once the locks are let go. A group that is
    // being made holds its lock for long: it has nothing to watch yet.
    std::vector<Communicator*> all;
    for (auto& [name, entry] : groups_) {
      std::unique_lock making(entry->mutex, std::try_to_lock);
      if (!making.owns_lock()) continue;
      for (auto& [member, comm] : entry->comms) all.push_back(comm.get());
    }
    lock.unlock();
    for (Communicator* c : all) {
      if (auto why = c->abort_if_overdue(); why && on_failure_) on_failure_(*why);
    }
    lock.lock();
  }
}

namespace {

/// The collectives, and the two halves of a point-to-point move (a pipeline register between
/// GPUs of two ranks: the nccl_p2p pass, graph/passes.h).
enum class Collective { all_reduce, reduce_scatter, all_gather, send, recv };

const char* op_name(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "nccl.allreduce";
    case Collective::reduce_scatter: return "nccl.reduce_scatter";
    case Collective::all_gather: return "nccl.all_gather";
    case Collective::send: return "nccl.send";
    case Collective::recv: return "nccl.recv";
  }
  return "nccl.?";
}

std::vector<std::int64_t> int_list(const KernelConfig& cfg, const char* op, const char* attr) {
  const auto& values = cfg.attrs.values();
  auto it = values.find(attr);
  if (it == values.end()) {
    throw std::invalid_argument(fmt::format("{}: {} needs the attribute '{}' (graph/collectives.h: add_nccl_allreduce "
                                            "sets it)",
                                            cfg.actor, op, attr));
  }
  if (const auto* v = std::get_if<std::vector<std::int64_t>>(&it->second)) return *v;
  throw std::invalid_argument(fmt::format("{}: {}'s attribute '{}' is not a list of integers", cfg.actor, op, attr));
}

/// One member's collective: reads its input register, writes its output register, on the
/// actor's stream, through the group's communicator (made at the first act). A send reads its
/// input and writes nothing; a receive writes its output, and its one input is the token that
/// says a piece is on its way (host memory, not read here).
/// The peer of a send or receive is the group's other member.
class NcclKernel final : public Kernel {
 public:
  NcclKernel(Collective op, std::string actor, std::string group, int member, Communicators& comms)
      : op_(op), actor_(std::move(actor)), group_(std::move(group)), member_(member), comms_(comms) {}

  void compute(KernelContext& ctx) override {
    if (ctx.stream == nullptr) throw std::runtime_error(fmt::format("{} runs on a CUDA stream; this act has none", op_name(op_)));
    const std::size_t outputs = op_ == Collective::send ? 0 : 1;
    if (ctx.inputs.size() != 1 || ctx.outputs.size() != outputs || ctx.inputs[0] == nullptr) {
      throw std::invalid_argument(fmt::format("{} reads one input and writes {} output{}", op_name(op_), outputs,
                                              outputs == 1 ? "" : "s"));
    }
    if (comm_ == nullptr) comm_ = &comms_.communicator(group_, member_);
    switch (op_) {
      case Collective::send: comm_->send(*ctx.inputs[0], 1 - member_, *ctx.stream); break;
      case Collective::recv: comm_->recv(*ctx.outputs[0], 1 - member_, *ctx.stream); break;
      case Collective::all_reduce: comm_->all_reduce(*ctx.inputs[0], *ctx.outputs[0], *ctx.stream); break;
      case Collective::reduce_scatter: comm_->reduce_scatter(*ctx.inputs[0], *ctx.outputs[0], *ctx.stream); break;
      case Collective::all_gather: comm_->all_gather(*ctx.inputs[0], *ctx.outputs[0], *ctx.stream); break;
    }
  }

 private:
  Collective op_;
  std::string actor_;
  std::string group_;
  int member_;
  Communicators& comms_;
  Communicator* comm_ = nullptr;  // owned by comms_
};

std::unique_ptr<Kernel> make_kernel(Collective op, const KernelConfig& cfg) {
  const char* name = op_name(op);
  if (!built_with_nccl()) {
    throw std::runtime_error(fmt::format("{}: {} on {} needs NCCL, but baton was built without NCCL", cfg.actor, name,
                                         cfg.device.str()));
  }
  if (cfg.services == nullptr || cfg.services->nccl == nullptr) {
    throw std::invalid_argument(fmt::format("{}: {} needs a runtime's NCCL communicators (KernelServices)", cfg.actor, name));
  }
  Group g{cfg.attrs.get_string("group", ""), int_list(cfg, name, "ranks"), int_list(cfg, name, "devices")};
  const std::int64_t member = cfg.attrs.get_int("member", -1);
  if (member < 0 || static_cast<std::size_t>(member) >= g.ranks.size()) {
    throw std::invalid_argument(fmt::format("{}: {} is member {} of NCCL group '{}', which has {}", cfg.actor, name,
                                            member, g.name, g.ranks.size()));
  }
  if ((op == Collective::send || op == Collective::recv) && (g.ranks.size() != 2 || member != (op == Collective::recv))) {
    throw std::invalid_argument(fmt::format("{}: {} is member {} of NCCL group '{}' of {}; a send is member 0 of two, "
                                            "a receive member 1",
                                            cfg.actor, name, member, g.name, g.ranks.size()));
  }
  const auto at = static_cast<std::size_t>(member);
  if (g.ranks[at] != cfg.services->rank || g.devices[at] != cfg.device.index || cfg.device.type != DeviceType::cuda) {
    throw std::invalid_argument(fmt::format("{}: member {} of NCCL group '{}' belongs on rank {} cuda:{}, but the actor "
                                            "runs on rank {} {}",
                                            cfg.actor, member, g.name, g.ranks[at], g.devices[at], cfg.services->rank,
                                            cfg.device.str()));
  }
  cfg.services->nccl->prepare(g);
  return std::make_unique<NcclKernel>(op, std::string(cfg.actor), g.name, static_cast<int>(member), *cfg.services->nccl);
}

}  // namespace

void add_nccl_kernels(KernelRegistry& reg) {
  for (Collective op : {Collective::all_reduce, Collective::reduce_scatter, Collective::all_gather, Collective::send,
                        Collective::recv}) {
    for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
      reg.add(op_name(op), DeviceType::cuda, dt, [op](const KernelConfig& cfg) { return make_kernel(op, cfg); });
    }
  }
}

}  // namespace baton::nccl
