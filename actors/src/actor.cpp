// The actor state machine. See DESIGN.md section 3: credit-based back-pressure with the
// credit (slots per register) fixed by the plan, end-of-stream downstream and detach
// upstream so that every actor retires, and failure turned into a job abort.
#include <algorithm>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "baton/actors/plan_memory.h"
#include "internal.h"

namespace baton::detail {

namespace {
constexpr std::size_t bucket(ActorActivity a) { return static_cast<std::size_t>(a); }

template <class T>
void bump(std::atomic<T>& a, T by) {
  a.store(a.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
}

template <class T>
void add_elements(void* out, const void* a, const void* b, std::size_t n) {
  T* o = static_cast<T*>(out);  // may be `a` (a pulled piece gets its addend in place)
  const T* x = static_cast<const T*>(a);
  const T* __restrict y = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

/// out = a + b, element by element, over `bytes` of f32 or f64 (validate(): a reducing
/// transfer's dtype): the partial sum first, as the ring's add kernel (allreduce.add) adds, so
/// either makes the same bits.
void add_elements(DType dtype, void* out, const void* a, const void* b, std::size_t bytes) {
  if (dtype == DType::f64) return add_elements<double>(out, a, b, bytes / sizeof(double));
  add_elements<float>(out, a, b, bytes / sizeof(float));
}
}  // namespace

const void* Actor::addend(const Input& own, std::int64_t piece) const {
  const Tensor& slot = own.source->buffers[slot_of(piece, own.slots)];
  return static_cast<const std::byte*>(slot.raw()) + own_offset_;
}

Actor::Actor(Core& core, const ActorDesc& desc, ActorIndex index, ActorId id)
    : core_(core), desc_(desc), index_(index), id_(id) {
  if (desc.kind == ActorKind::repeat) in_ratio_ = desc.group;
  if (desc.kind == ActorKind::accumulate) out_group_ = desc.group;
}

void Actor::wire_outputs() {
  const Plan& plan = core_.plan;
  // Outputs: slots, buffers and the consumers we will request.
  for (RegisterIndex r : desc_.outputs) {
    const RegisterDesc& reg = plan.registers[r];
    auto out = std::make_unique<Output>();
    out->reg = r;
    out->slots = reg.slots;
    out->pending.assign(static_cast<std::size_t>(reg.slots), 0);
    out->buffers.resize(static_cast<std::size_t>(reg.slots));
    if (!core_.dry_run && desc_.kind != ActorKind::repeat) {
      const RegisterMemory mem = register_memory(plan, r);
      // A kernel's own memory comes with its kernel (adopt_kernel_memory).
      for (std::size_t s = 0; s < out->buffers.size() && !(reg.kernel_memory && !mem.allocated); ++s)
        out->buffers[s] = core_.register_slot(desc_, r, s);
      if (core_.settings.measure_memory && mem.allocated) {
        out->in_use = &core_.in_use[mem.device];
        out->slot_bytes = slot_bytes(reg);
        out->unread = std::make_unique<std::atomic<std::int32_t>[]>(static_cast<std::size_t>(reg.slots));
      }
    }
    for (ActorIndex c : reg.consumers) {
      Actor* consumer = core_.actors[c].get();
      if (consumer != nullptr) {
        out->consumers.push_back(Consumer{consumer->id(), consumer->worker()});
      } else {  // on another rank: its transfer actor, reached through the data plane
        const ActorDesc& t = plan.actors[c];
        Consumer remote{ActorId::make(t.where.rank, t.where.device, t.where.stream, c), nullptr};
        // The whole slot, or the window (validate() checked that it lies inside the slot).
        remote.bytes = static_cast<std::size_t>(slot_bytes(t.window >= 0 ? plan.registers[t.outputs[0]] : reg));
        if (t.window >= 0) remote.offset = static_cast<std::size_t>(t.window) * size_of(reg.dtype);
        // The transfer's port of this register (validate(): a transfer reads each register once).
        for (std::size_t p = 0; p < t.inputs.size(); ++p) {
          if (t.inputs[p].reg == r) remote.port = p;
        }
        out->consumers.push_back(remote);
      }
    }
    out->live = static_cast<std::int32_t>(out->consumers.size());
    if (out->live > 0) ++outputs_read_;
    bytes_out_per_act_ += static_cast<std::uint64_t>(numel(reg.shape)) * size_of(reg.dtype);
    outputs_.push_back(std::move(out));
  }
  out_view_.assign(outputs_.size(), nullptr);
}

Output* Actor::output_for(RegisterIndex reg) {
  for (auto& o : outputs_) {
    if (o->reg == reg) return o.get();
  }
  return nullptr;
}

Input* Actor::input_for(RegisterIndex reg) {
  for (auto& in : inputs_) {
    if (in.reg == reg) return &in;
  }
  return nullptr;
}

void Actor::wire_inputs() {
  const Plan& plan = core_.plan;
  for (const InputPort& port : desc_.inputs) {
    const RegisterDesc& reg = plan.registers[port.reg];
    bytes_in_per_act_ += static_cast<std::uint64_t>(numel(reg.shape)) * size_of(reg.dtype);
    if (input_for(port.reg) != nullptr) {
      port_to_input_.push_back(static_cast<std::uint32_t>(input_for(port.reg) - inputs_.data()));
      continue;
    }
    Actor* producer = core_.actors[reg.producer].get();
    Input in;
    in.reg = port.reg;
    in.delay = port.delay;
    in.slots = reg.slots;
    auto pos = std::find(reg.consumers.begin(), reg.consumers.end(), index_);
    in.consumer_index = static_cast<std::uint8_t>(pos - reg.consumers.begin());
    if (producer != nullptr) {
      in.producer = producer->id();
      in.producer_worker = producer->worker();
      in.source = producer->output_for(port.reg);
    } else {  // a transfer actor's remote producer
      const Placement& at = plan.actors[reg.producer].where;
      in.producer = ActorId::make(at.rank, at.device, at.stream, reg.producer);
    }
    port_to_input_.push_back(static_cast<std::uint32_t>(inputs_.size()));
    inputs_.push_back(std::move(in));
  }
  in_view_.assign(desc_.inputs.size(), nullptr);
  if (desc_.kind == ActorKind::repeat) bytes_in_per_act_ = 0;  // it reads nothing: an alias
  if (desc_.window >= 0) bytes_in_per_act_ = bytes_out_per_act_;  // a window moves what it writes
  if (reduces(desc_)) bytes_in_per_act_ = 2 * bytes_out_per_act_;  // the piece and its addend
  if (desc_.kind == ActorKind::repeat && desc_.group == 1 && inputs_.size() == 1 && outputs_.size() == 1 &&
      inputs_[0].source != nullptr && inputs_[0].source->counted()) {
    Output& out = *outputs_[0];
    out.counts_for = inputs_[0].source;
    out.counts_slot.assign(static_cast<std::size_t>(out.slots), 0);
    out.unread = std::make_unique<std::atomic<std::int32_t>[]>(static_cast<std::size_t>(out.slots));
  }
  wire_streams();
  if (core_.dry_run) return;
  const DType dtype = desc_.dtype;
  KernelConfig cfg{desc_.name, desc_.where.device, dtype, desc_.attrs, &core_.services};
  switch (desc_.kind) {
    case ActorKind::repeat: break;
    case ActorKind::transfer:
      pulled_.assign(static_cast<std::size_t>(outputs_[0]->slots), false);
      pulls_left_.assign(pulled_.size(), 0);
      pull_started_.assign(pulled_.size(), 0);
      // Several inputs land one after another in the slot, in port order (validate() checked
      // that they fill it); one input fills it whole, and so does each of a reducing transfer's
      // two (the remote piece, and the window of its own input it adds to it).
      reduces_ = reduces(desc_);
      if (reduces_) {
        own_offset_ = static_cast<std::size_t>(desc_.attrs.get_int("offset", 0)) * size_of(dtype);
        add_on_landing_.assign(pulled_.size(), false);
      }
      for (std::size_t p = 0; p < desc_.inputs.size(); ++p) {
        const RegisterDesc& reg = plan.registers[desc_.inputs[p].reg];
        port_bytes_.push_back(desc_.inputs.size() == 1 || reduces_ ? outputs_[0]->buffers.front().nbytes()
                                                                   : static_cast<std::size_t>(slot_bytes(reg)));
        // A remote producer may send its pieces inline (stage()) or tell where they lie
        // (map_piece()) instead of offering them to be pulled.
        Input& in = inputs_[port_to_input_[p]];
        if (in.source == nullptr && port_bytes_[p] > 0) {
          in.piece_bytes = port_bytes_[p];
          in.arrived.assign(static_cast<std::size_t>(in.slots), nullptr);
        }
      }
      break;
    case ActorKind::accumulate:
      copy_kernel_ = core_.kernels->create("copy", cfg);
      if (desc_.op != "last") kernel_ = core_.kernels->create("add", cfg);
      break;
    default: kernel_ = core_.kernels->create(desc_.op, cfg);
  }
  adopt_kernel_memory();
}

// An output that is its kernel's own memory (RegisterDesc::kernel_memory) gets that memory as its
// one slot; one the kernel offers none for gets a slot of its own, as any other.
void Actor::adopt_kernel_memory() {
  const Plan& plan = core_.plan;
  for (std::size_t o = 0; o < outputs_.size(); ++o) {
    Output& out = *outputs_[o];
    const RegisterDesc& reg = plan.registers[out.reg];
    if (!reg.kernel_memory || desc_.kind == ActorKind::repeat || register_memory(plan, out.reg).allocated) continue;
    Tensor own = kernel_ ? kernel_->owned_output(o) : Tensor();
    if (own.nbytes() == 0) {
      for (std::size_t s = 0; s < out.buffers.size(); ++s) out.buffers[s] = core_.register_slot(desc_, out.reg, s);
      continue;
    }
    if (own.shape() != reg.shape || own.dtype() != reg.dtype || out.buffers.size() != 1) {
      throw PlanError(fmt::format("actor '{}' offers a {} as register '{}' ({}{}, {} slots)", desc_.name, own.describe(),
                                  reg.name, baton::name(reg.dtype), to_string(reg.shape), out.buffers.size()));
    }
    out.buffers[0] = own;
  }
}

// Which handshakes follow stream order, which wait for the stream (EdgeSync, plan.h), and the
// events that order streams among themselves.
void Actor::wire_streams() {
  if (!core_.dry_run && on_stream(desc_)) {
    stream_ = &core_.stream_for(desc_.where);
    cuda_stream_ = dynamic_cast<cuda::Stream*>(stream_);
    stream_ordered_ = core_.settings.mode != ExecutionMode::deterministic;
    wait_every_act_ = !core_.settings.stream_order;
  }
  const Plan& plan = core_.plan;
  for (auto& out : outputs_) {
    const RegisterDesc& reg = plan.registers[out->reg];
    const auto slots = static_cast<std::size_t>(out->slots);
    out->deferred.assign(out->consumers.size(), false);
    out->ready.assign(slots, nullptr);
    out->done.assign(out->consumers.size(), std::vector<std::vector<const StreamEvent*>>(slots));
    bool readers_on_streams = false;
    for (std::size_t c = 0; c < out->consumers.size(); ++c) {
      const EdgeSync e = edge_sync(plan, out->reg, reg.consumers[c]);
      out->deferred[c] = stream_ordered_ && (wait_every_act_ || e == EdgeSync::to_host);
      out->any_deferred = out->any_deferred || out->deferred[c];
      readers_on_streams = readers_on_streams || e == EdgeSync::event || e == EdgeSync::alias;
    }
    if (stream_ordered_ && !wait_every_act_ && readers_on_streams) {
      out->ready_events.resize(slots);
      for (auto& e : out->ready_events) e = stream_->make_event();
    }
    needs_reached_ = needs_reached_ || out->any_deferred;
  }
  for (Input& in : inputs_) {
    in.sync = edge_sync(plan, in.reg, index_);
    // Every act waits for its stream anyway: the host sees every edge as host memory does.
    if (wait_every_act_ && in.sync != EdgeSync::host) in.sync = EdgeSync::from_host;
    if (stream_ordered_ && in.sync == EdgeSync::event) {
      in.done_events.resize(static_cast<std::size_t>(in.slots));
      for (auto& e : in.done_events) e = stream_->make_event();
    }
    needs_reached_ = needs_reached_ || defers_ack(in);
  }
}

// A reader on a stream whose data a host (or a stream of another kind) wrote acks only once its
// stream has run the read: the writer would otherwise overwrite the slot under it.
bool Actor::defers_ack(const Input& in) const {
  return stream_ordered_ && (in.sync == EdgeSync::from_host || in.sync == EdgeSync::to_host);
}

std::int64_t Actor::needed_piece(const Input& in) const {
  return count_div(acts_, in_ratio_) - in.delay;
}

Actor::Block Actor::next_block() const {
  Block b = next_block_of_stream();
  // A transfer actor with pulls in flight cannot end yet: their data still lands in its slots.
  if (inflight_ > 0 && (b == Block::finish || b == Block::unread)) return Block::transferring;
  return b;
}

Actor::Block Actor::next_block_of_stream() const {
  if (held_ >= 0) return Block::turn;  // a rank coming back (on_hold_for_rejoin)
  // A dry run (validation) treats sources as endless: it asks whether the plan keeps going.
  // A source nobody reads cannot hold anything up, so it sits the dry run out. A simulation
  // (simulate.h) emits the real pieces.
  if (desc_.kind == ActorKind::source) {
    if (core_.dry_run && !core_.simulated ? outputs_read_ == 0 : acts_ >= desc_.pieces) return Block::finish;
  }
  if (core_.dry_run && core_.dry_enough(index_, acts_)) return Block::enough;
  bool starved = false;
  for (const Input& in : inputs_) {
    std::int64_t q = needed_piece(in);
    if (q < 0 || q < in.received) continue;
    if (in.end >= 0 && q >= in.end) return Block::finish;
    starved = true;
  }
  // Nobody reads what it writes any more: stop, unless the actor has work of its own to finish
  // (a variable still applies its last gradients to the weights it owns).
  if (outputs_read_ > 0 && outputs_dead_ == outputs_read_ && desc_.stops_when_unread) return Block::unread;
  if (starved) return Block::starved;
  if (count_mod(acts_, out_group_) == 0) {
    // The piece the next act opens, counting acts still in flight on a stream or the wire (they
    // hold slots that they have not published yet).
    const std::int64_t piece = count_div(acts_, out_group_);
    for (const auto& out : outputs_) {
      if (piece - out->freed >= out->slots) return Block::backpressured;
    }
  }
  if (lane_ != nullptr && lane_->turn != this) return Block::turn;
  return Block::none;
}

void Actor::on_message(const Message& m) {
  if (retired_) {
    // The runtime waits for every actor it asked, finished or not.
    if (m.kind == MsgKind::hold_for_rejoin) on_hold_for_rejoin(static_cast<std::uint32_t>(m.piece));
    if (m.kind == MsgKind::rank_rejoined) on_rank_rejoined(m.reg, m.piece);
    return;
  }
  switch (m.kind) {
    case MsgKind::request:
    case MsgKind::request_inline:
    case MsgKind::request_mapped: on_request(m); break;
    case MsgKind::ack: on_ack(m); break;
    case MsgKind::end_of_stream: on_eos(m); break;
    case MsgKind::detach: on_detach(m); break;
    case MsgKind::start: break;
    case MsgKind::pulled: on_pulled(m); break;
    case MsgKind::rank_left: on_rank_left(static_cast<std::uint32_t>(m.piece)); break;
    case MsgKind::hold_for_rejoin: on_hold_for_rejoin(static_cast<std::uint32_t>(m.piece)); break;
    case MsgKind::rank_rejoined: on_rank_rejoined(m.reg, m.piece); break;
  }
  if (!core_.failed()) advance();
}

void Actor::advance() {
  while (!finished_) {
    Block b = next_block();
    if (b == Block::finish || b == Block::unread) {
      finish(b == Block::unread);
      break;
    }
    if (b != Block::none) {
      // Waiting with pulls in flight is waiting on the data plane; waiting for its turn in a
      // lane is waiting for the acts before it, as good as starved.
      set_activity(inflight_ > 0                                ? ActorActivity::transferring
                   : b == Block::starved || b == Block::turn ? ActorActivity::starved
                                                             : ActorActivity::backpressured);
      return;
    }
    // Messages held for other ranks wait through this act only if it is expected to be brief
    // (RuntimeSettings::hold_messages_ns); its work is timed to tell for the next one.
    worker_->before_act(brief_);
    act();
    if (lane_ != nullptr) pass_turn(true);
    // A dry run stops here once its budget is spent: a source whose registers nobody reads
    // would otherwise act forever inside this loop.
    if (core_.failed() || core_.dry_budget_spent()) return;
  }
  retire_if_done();
}

void Actor::act() {
  // The clock read that starts the busy time also starts the kernel's (a few loads apart): a
  // read of the TSC costs 10-25 ns, in a virtual machine more, and an act of a noop kernel
  // read it four times (bench actors, same_thread_hop).
  const std::uint64_t busy_from = set_activity(ActorActivity::busy);
  if (desc_.kind == ActorKind::transfer && !core_.dry_run) return act_transfer();
  const std::int64_t k = acts_;
  const bool logging = core_.activity_log.load(std::memory_order_relaxed);
  const std::uint64_t log_start = logging ? steady_ns() : 0;
  for (std::size_t p = 0; p < port_to_input_.size(); ++p) {
    Input& in = inputs_[port_to_input_[p]];
    std::int64_t q = needed_piece(in);
    in_view_[p] = q < 0 ? nullptr : &in.source->buffers[slot_of(q, in.slots)];
  }
  const bool opens_group = count_mod(k, out_group_) == 0;
  const bool closes_group = count_mod(k, out_group_) == out_group_ - 1;
  const auto out_slot = [&](const Output& out) { return slot_written(out, k); };
  for (std::size_t o = 0; o < outputs_.size(); ++o) {
    Output& out = *outputs_[o];
    out_view_[o] = &out.buffers[out_slot(out)];
  }
  if (!core_.dry_run) {
    const bool sampled = core_.sampled_time.load(std::memory_order_relaxed);
    const bool clocked = (core_.settings.time_accounting && !sampled) || worker_->holds_messages();
    const std::uint64_t kernel_start = !clocked ? 0 : busy_from != 0 ? busy_from : ticks();
    if (sampled) counters_.in_kernel.store(true, std::memory_order_relaxed);
    try {
      if (stream_ordered_) {
        // Stream order covers what this stream wrote and read; what other streams did, events.
        for (Input& in : inputs_) {
          const std::int64_t q = needed_piece(in);
          if (in.sync != EdgeSync::event || q < 0 || in.source == nullptr) continue;
          if (const StreamEvent* written = in.source->ready[slot_of(q, in.slots)]) {
            stream_->wait(*written);
          }
        }
        if (opens_group) {
          for (auto& out : outputs_) wait_for_readers(*out, out_slot(*out));
        }
      }
      Timing timed;
      if (stream_ordered_ && core_.settings.device_time) {
        if (!spare_timings_.empty()) {
          timed = std::move(spare_timings_.back());
          spare_timings_.pop_back();
        } else {
          timed = Timing{stream_->make_timing_event(), stream_->make_timing_event()};
        }
        stream_->record(*timed.start);
      }
      run_kernel(k, opens_group, closes_group);
      if (timed.start) {
        stream_->record(*timed.end);
        timings_.push_back(std::move(timed));
        collect_device_time(false);
      }
      if (stream_ordered_ && closes_group) {
        for (auto& out : outputs_) {
          if (out->ready_events.empty()) continue;
          StreamEvent& e = *out->ready_events[out_slot(*out)];
          stream_->record(e);
          out->ready[out_slot(*out)] = &e;
        }
      }
      // One worker for every device (deterministic mode) cannot wait for a callback: the act
      // ends when its stream does.
      if (stream_ != nullptr && !stream_ordered_) stream_->synchronize();
    } catch (const std::exception& e) {
      if (sampled) counters_.in_kernel.store(false, std::memory_order_relaxed);
      core_.fail(fmt::format("actor '{}' ({} {} on {}) failed at piece {}: {}", desc_.name,
                             baton::name(desc_.kind), desc_.op, id_.str(), k, e.what()));
      return;
    }
    if (sampled) counters_.in_kernel.store(false, std::memory_order_relaxed);
    if (clocked) {
      const std::uint64_t took = ticks() - kernel_start;
      if (core_.settings.time_accounting && !sampled) bump(counters_.kernel_ticks, took);
      brief_ = worker_->brief(took);
    }
  }
  acts_ = k + 1;
  if (core_.dry_run) core_.count_dry_act(index_, acts_);
  bump(counters_.acts, std::uint64_t{1});
  bump(counters_.bytes_in, bytes_in_per_act_);
  if (stream_ordered_) {
    // The kernel only enqueued its work. What stream order or events cover goes out now; what
    // the host must not see before the stream ran it (a host reader's request, the ack to a
    // host writer) waits for a callback from the stream, which posts to this worker (waking
    // it if parked: polling an event would keep the worker spinning).
    after_act(k, Handoff::enqueued);
    if (core_.failed() || !wait_for_stream(k, closes_group)) return;
    if (logging) worker_->log(ActRecord{index_, k, log_start, steady_ns(), worker_->index()});
    return;
  }
  const std::uint64_t log_end = logging ? steady_ns() : 0;
  after_act(k);
  if (logging) worker_->log(ActRecord{index_, k, log_start, log_end, worker_->index()});
}

// The act's work by the actor's kind: a repeat's alias, an accumulate's copy or add, a kernel.
void Actor::run_kernel(std::int64_t k, bool opens_group, bool closes_group) {
  const auto out_slot = [&](const Output& out) { return slot_written(out, k); };
  KernelContext ctx{in_view_, out_view_, desc_.first_piece + k, cuda_stream_, stream_};
  switch (desc_.kind) {
    case ActorKind::repeat: {
      // An alias: the consumers read the input slot itself (a view sees it in its own shape).
      const Shape& shape = core_.plan.registers[outputs_[0]->reg].shape;
      *out_view_[0] = in_view_[0]->shape() == shape ? *in_view_[0] : in_view_[0]->view(shape);
      // ... and wait for what the input's writer's stream waits for (EdgeSync::alias).
      const Input& in = inputs_[0];
      Output& out = *outputs_[0];
      out.ready[out_slot(out)] =
          in.source == nullptr ? nullptr : in.source->ready[slot_of(needed_piece(in), in.slots)];
      if (out.counts_for != nullptr) out.counts_slot[out_slot(out)] = slot_of(needed_piece(in), in.slots);
      break;
    }
    case ActorKind::accumulate:
      if (!kernel_) {  // op "last": only the group's last piece counts
        if (closes_group) copy_kernel_->compute(ctx);
      } else if (opens_group) {
        copy_kernel_->compute(ctx);
      } else {
        const Tensor* sum_in[2] = {out_view_[0], in_view_[0]};
        KernelContext add{sum_in, out_view_, k, cuda_stream_, stream_};
        kernel_->compute(add);
      }
      break;
    default:
      kernel_->compute(ctx);
  }
}

// After a stream-ordered act has handed on what stream order covers: what the host must not see
// before the stream ran act k waits for a callback from the stream. False if the job failed.
bool Actor::wait_for_stream(std::int64_t k, bool closes_group) {
  bool waits = false;
  if (closes_group) {
    for (const auto& out : outputs_) waits = waits || out->any_deferred;
  }
  for (const Input& in : inputs_) waits = waits || (defers_ack(in) && count_div(k, in_ratio_) - in.delay >= 0);
  if (waits) {
    on_stream_.push_back(
        std::make_unique<Reached>(Reached{worker_, Message{id_, id_, k, 0, 0, MsgKind::pulled, 0}}));
    try {
      stream_->when_reached([](void* p) {
        // A copy first: once posted, the actor may free what p points to.
        const auto& r = *static_cast<const Reached*>(p);
        Worker* w = r.worker;
        const Message m = r.m;
        w->post(m);
      }, on_stream_.back().get());
    } catch (const std::exception& e) {
      on_stream_.pop_back();
      core_.fail(fmt::format("actor '{}' ({} on {}) failed at piece {}: {}", desc_.name, desc_.op, id_.str(), k, e.what()));
      return false;
    }
    ++inflight_;
  }
  return true;
}

void Actor::collect_device_time(bool all) {
  while (!timings_.empty()) {
    Timing& t = timings_.front();
    const std::optional<double> ms = stream_->elapsed_ms(*t.start, *t.end);
    if (!ms) {
      if (!all) return;
    } else {
      bump(counters_.device_ns, static_cast<std::uint64_t>(std::max(0.0, *ms) * 1e6));
    }
    spare_timings_.push_back(std::move(t));
    timings_.pop_front();
  }
}

// The slot is about to be written again on this stream: first the reads of its last piece on
// other streams must be done (the events their readers left with their acks).
void Actor::wait_for_readers(Output& out, std::size_t slot) {
  for (auto& per_consumer : out.done) {
    for (const StreamEvent* e : per_consumer[slot]) stream_->wait(*e);
    per_consumer[slot].clear();
  }
}

// Act k's work is done (or, on a stream, enqueued / reached: Handoff): its outputs are
// published (at the end of a group) and its inputs acked.
void Actor::after_act(std::int64_t k, Handoff h) {
  // The act ends before its requests and acks go out, so no consumer's act (nor this act's
  // next, once its slot comes back) can appear to start before it ended: a trace's arrows
  // point forward in time.
  const bool closes_group = count_mod(k, out_group_) == out_group_ - 1;
  if (closes_group) {
    if (h != Handoff::reached) bump(counters_.bytes_out, bytes_out_per_act_);
    if (h != Handoff::reached && core_.settings.measure_memory && !desc_.in_place.empty()) count_in_place_reads(k);
    for (auto& out : outputs_) publish(*out, count_div(k, out_group_), h);
  }
  // Acks after requests: a consumer hears of new data before the producer hears of space.
  if (desc_.kind != ActorKind::repeat) {
    for (Input& in : inputs_) {
      std::int64_t q = count_div(k, in_ratio_) - in.delay;
      if (q < 0) continue;
      const bool waited = h != Handoff::all && defers_ack(in);
      if (h == Handoff::all || (h == Handoff::reached) == waited) release(in, q);
    }
  }
}

// RuntimeSettings::measure_memory: an output written in the very bytes of an input (the memory
// plan's in-place slots) takes them over; the input's read is counted down before the output is
// counted, so the bytes are in use once, as the plan counts them.
void Actor::count_in_place_reads(std::int64_t k) {
  for (const InPlace& p : desc_.in_place) {  // validate() checked the ports
    Input& in = inputs_[port_to_input_[p.input]];  // a register read on two ports is one input
    const Output& out = *outputs_[p.output];
    const std::int64_t q = count_div(k, in_ratio_) - in.delay;
    if (q < 0 || in.source == nullptr || !in.source->counted() || out.in_use == nullptr) continue;
    const auto in_slot = slot_of(q, in.slots);
    if (in.counted_early == q || in.source->buffers[in_slot].raw() != out.buffers[slot_written(out, k)].raw())
      continue;
    in.source->reader_done(in_slot);
    in.counted_early = q;
  }
}

void Actor::on_stream_reached(const Message& m) {
  if (on_stream_.empty() || on_stream_.front()->m.piece != m.piece) {
    return protocol_error(m, "its stream reached an act that was not the next one waited for");
  }
  on_stream_.pop_front();
  --inflight_;
  after_act(m.piece, Handoff::reached);
}

// Pull piece k of each remote input into its part of our next slot (one input: the whole
// slot), and copy there the part of each input on this rank (a transfer with several inputs
// gathers them; validate() keeps those in host memory), of each whose piece came inline with
// its request (staged) and of each whose piece can be read in its producer's slot (mapped:
// the one copy between ranks of a host). The piece is published (and the pulled inputs acked) when the
// data plane says every pull has landed (on_pulled); at once if nothing was pulled. Several
// pieces may be in flight, one per free slot.
//
// A reducing transfer (reduces()) writes the remote piece plus its addend (the window of its
// own input) instead: read where the piece lies (mapped, staged) it adds as it reads, the
// fused receive-add; a pulled piece lands in the slot and gets its addend added in place when
// it has landed, the addend's piece held until then.
void Actor::act_transfer() {
  Output& out = *outputs_[0];
  const std::int64_t k = acts_;
  const auto slot = static_cast<std::uint16_t>(slot_of(k, out.slots));
  Tensor& dest = out.buffers[slot];
  const std::uint64_t copy_start = worker_->holds_messages() ? ticks() : 0;  // brief_, below
  // The activity log records a pull from here to its landing (on_pulled); 0: not logged.
  pull_started_[slot] = core_.activity_log.load(std::memory_order_relaxed) ? steady_ns() : 0;
  std::uint16_t pulls = 0;
  auto* at = static_cast<std::byte*>(dest.raw());
  acts_ = k + 1;
  ++inflight_;
  bump(counters_.acts, std::uint64_t{1});
  // A reducing transfer's own input: it goes with the piece of port 0 (the loop stops there).
  Input* own = reduces_ ? &inputs_[port_to_input_[1]] : nullptr;
  const std::size_t ports = reduces_ ? 1 : port_to_input_.size();
  for (std::size_t p = 0; p < ports; ++p) {
    Input& in = inputs_[port_to_input_[p]];
    const std::size_t bytes = port_bytes_[p];
    const auto from = slot_of(k, in.slots);
    if (bytes == 0) {
      if (in.source != nullptr) release(in, k);  // a remote one acks when the piece is published
      if (own != nullptr) release(*own, k);
    } else if (k < in.zeros_until) {
      // Its rank left the job: zeros (plus the addend, for a reducing transfer).
      if (own != nullptr) {
        std::memcpy(at, addend(*own, k), bytes);
      } else {
        std::memset(at, 0, bytes);
      }
      // What the departed process staged there goes; once a new one is back (zeros up to its
      // first piece), the slot may already hold its piece.
      if (!in.arrived.empty() && in.zeros_until == never) in.arrived[from] = nullptr;
      release(in, k);
      if (own != nullptr) release(*own, k);
    } else if (in.source != nullptr || (!in.arrived.empty() && in.arrived[from] != nullptr)) {
      // Here already: copied (or summed with the addend), and handed back at once.
      const void* src = in.source != nullptr ? in.source->buffers[from].raw() : in.arrived[from];
      if (own != nullptr) {
        add_elements(desc_.dtype, at, src, addend(*own, k), bytes);
      } else {
        std::memcpy(at, src, bytes);
      }
      if (in.source == nullptr) in.arrived[from] = nullptr;
      release(in, k);
      if (own != nullptr) release(*own, k);
    } else {
      try {
        core_.settings.link->receive_payload(in.producer.rank(), payload_tag(index_, p, k + core_.shift(in.reg)), at, bytes,
                                             (std::uint64_t{index_} << 16) | slot);
      } catch (const std::exception& e) {
        core_.fail(fmt::format("transfer actor '{}' could not pull piece {} of '{}' from rank {}: {}", desc_.name, k,
                               core_.plan.registers[in.reg].name, in.producer.rank(), e.what()));
        return;
      }
      ++pulls;
      if (own != nullptr) add_on_landing_[slot] = true;
    }
    at += bytes;
  }
  pulls_left_[slot] = pulls;
  if (worker_->holds_messages()) brief_ = worker_->brief(ticks() - copy_start);
  if (pulls == 0) landed(slot);  // nothing to wait for
}

void Actor::on_pulled(const Message& m) {
  if (stream_ != nullptr) return on_stream_reached(m);
  // A pull from a rank that left, landed after it was counted as zeros (on_rank_left).
  if (orphaned_ && m.slot < pulls_left_.size() && pulls_left_[m.slot] == 0) return;
  if (desc_.kind != ActorKind::transfer || m.slot >= pulled_.size() || inflight_ == 0 || pulls_left_[m.slot] == 0) {
    return protocol_error(m, "a pull landed that this actor did not start");
  }
  if (--pulls_left_[m.slot] == 0) landed(m.slot);
}

// Every part of the piece in `slot` is there. Pulls may land out of order; pieces are published
// in order, and the inputs not handed back at the act are acked then.
void Actor::landed(std::uint16_t slot) {
  Output& out = *outputs_[0];
  pulled_[slot] = true;
  while (inflight_ > 0 && pulled_[slot_of(out.written, out.slots)]) {
    pulled_[slot_of(out.written, out.slots)] = false;
    --inflight_;
    const std::int64_t piece = out.written;
    const auto at = slot_of(piece, out.slots);
    if (reduces_ && add_on_landing_[at]) {  // a pulled piece: its addend (held since the act) now
      add_on_landing_[at] = false;
      Tensor& sum = out.buffers[at];
      add_elements(desc_.dtype, sum.raw(), sum.raw(), addend(inputs_[port_to_input_[1]], piece), sum.nbytes());
    }
    const std::uint64_t started = pull_started_[at];
    if (started != 0) worker_->log(ActRecord{index_, piece, started, steady_ns(), worker_->index()});
    bump(counters_.bytes_in, bytes_in_per_act_);
    bump(counters_.bytes_out, bytes_out_per_act_);
    publish(out, piece);
    for (Input& in : inputs_) {
      if (in.released == piece) release(in, piece);
    }
    if (core_.failed()) return;
  }
}

// On the data plane's thread (Core::on_message_with_payload), before the request is posted:
// the worker reads the staged bytes only after it has the request, and the producer sends the
// piece for a staging slot only after this actor acked the one before in it (at its act).
std::string Actor::stage(const Message& m, const void* payload, std::size_t size) {
  Input* in = desc_.kind == ActorKind::transfer ? input_for(m.reg) : nullptr;
  if (in == nullptr || in->source != nullptr) return "it is not a transfer that pulls it from there";
  if (in->piece_bytes != size || size > transport::Link::max_inline_payload) {
    return fmt::format("{} bytes, where it takes {} (at most {} inline)", size, in->piece_bytes,
                       transport::Link::max_inline_payload);
  }
  if (in->staging == nullptr) in->staging = std::make_unique<std::byte[]>(static_cast<std::size_t>(in->slots) * size);
  const auto slot = slot_of(m.piece, in->slots);
  std::memcpy(in->staging.get() + slot * size, payload, size);
  in->arrived[slot] = in->staging.get() + slot * size;
  return {};
}

// As stage(): the producer keeps the slot until this actor acks the piece (at its act), so the
// bytes stay as they are while the act copies them.
std::string Actor::map_piece(const Message& m, const transport::SharedLocation& at) {
  Input* in = desc_.kind == ActorKind::transfer ? input_for(m.reg) : nullptr;
  if (in == nullptr || in->source != nullptr) return "it is not a transfer that pulls it from there";
  if (in->piece_bytes == 0) return "its input is empty";
  const auto slot = slot_of(m.piece, in->slots);
  try {
    // The producer's segment, mapped once: its pieces are found without a lock.
    if (!in->segment.is(at)) in->segment = core_.peer_segments.segment(at);
    in->arrived[slot] = in->segment.at(at, in->piece_bytes);
  } catch (const std::exception& e) {
    return e.what();
  }
  // A producer's slot is the same bytes piece after piece: its page tables are made once, in
  // one call, not by a fault per page in the first copies (costly in a virtual machine).
  if (in->prefaulted.empty()) in->prefaulted.assign(static_cast<std::size_t>(in->slots), nullptr);
  if (in->prefaulted[slot] != in->arrived[slot]) {
    transport::PeerSegments::prefault(in->arrived[slot], in->piece_bytes);
    in->prefaulted[slot] = in->arrived[slot];
  }
  return {};
}

// The piece in the next slot is written (Handoff::all, ::enqueued: the bookkeeping happens
// here) and its consumers hear of it: all of them, or (on a stream) those that need not wait
// for the stream now and the others once it has run the write (::reached).
void Actor::publish(Output& out, std::int64_t piece, Handoff h) {
  if (h != Handoff::reached) {
    if (piece != out.written) {
      core_.fail(fmt::format("actor '{}' published piece {} of '{}' out of turn (piece {} was next)", desc_.name, piece,
                             core_.plan.registers[out.reg].name, out.written));
      return;
    }
    const auto slot = slot_of(piece, out.slots);
    std::int32_t readers = out.live;
    if (out.joining > 0) {  // a reader that came back reads from a later piece (on_rank_rejoined)
      out.joining = 0;
      for (const Consumer& c : out.consumers) {
        if (c.detached_from != never || c.from <= piece) continue;
        --readers;
        if (c.from > piece + 1) ++out.joining;
      }
    }
    out.pending[slot] = readers;
    if (out.in_use != nullptr) {
      // Before the requests go out: a reader counts itself down only after it has one.
      out.unread[slot].store(readers, std::memory_order_relaxed);
      out.in_use->add(out.slot_bytes);
      if (readers == 0) out.in_use->sub(out.slot_bytes);
    } else if (out.counts_for != nullptr) {  // a view: its readers count its input down
      out.unread[slot].store(readers, std::memory_order_relaxed);
      if (readers == 0) out.counts_for->reader_done(out.counts_slot[slot]);
    }
    out.written = piece + 1;
    auto outstanding = static_cast<std::int32_t>(out.written - out.freed);
    if (outstanding > out.max_outstanding) {
      out.max_outstanding = outstanding;
      out.max_outstanding_seen.store(outstanding, std::memory_order_relaxed);
    }
    out.written_seen.store(out.written, std::memory_order_relaxed);
  }
  for (std::size_t c = 0; c < out.consumers.size(); ++c) {
    if (piece >= out.consumers[c].detached_from || piece < out.consumers[c].from) continue;
    const bool waits = h != Handoff::all && out.deferred[c];
    if (h == Handoff::all || (h == Handoff::reached) == waits) request(out, piece, c);
    if (core_.failed()) return;
  }
  if (h != Handoff::reached && out.pending[slot_of(piece, out.slots)] == 0) advance_freed(out);
}

void Actor::request(Output& out, std::int64_t piece, std::size_t c) {
  Consumer& consumer = out.consumers[c];
  const auto slot = static_cast<std::uint16_t>(slot_of(piece, out.slots));
  Message m{id_, consumer.id, piece, out.reg, slot, MsgKind::request, static_cast<std::uint8_t>(c)};
  if (consumer.worker == nullptr && !core_.dry_run && consumer.bytes > 0) {
    // A consumer on another rank takes the payload (or its window of it) from this slot, which
    // stays ours until it acks (the slot's credit keeps it unchanged meanwhile): read in place
    // where the slot is in memory its host shares with us, else a small one goes with the
    // request (read from the slot as it is sent), else it is offered for its receive to pull.
    auto* data = static_cast<std::byte*>(out.buffers[slot].raw()) + consumer.offset;
    std::optional<transport::SharedLocation> in_shared;
    if (consumer.way == Consumer::Way::mapped) {
      in_shared = core_.shared_segments->locate(data, consumer.bytes);  // the link was asked at the first
    } else if (consumer.way == Consumer::Way::undecided) {
      in_shared = core_.locate_shared(consumer.id.rank(), data, consumer.bytes);
      const std::size_t most = std::min({core_.settings.inline_payload_bytes, transport::Link::max_inline_payload,
                                         core_.settings.link->inline_limit(consumer.id.rank())});
      consumer.way = in_shared     ? Consumer::Way::mapped
                     : consumer.bytes <= most ? Consumer::Way::inline_payload
                                              : Consumer::Way::pulled;
    }
    ++consumer.sent;
    if (consumer.way == Consumer::Way::mapped) {
      if (!in_shared) {
        core_.fail(fmt::format("actor '{}': piece {} of '{}' is not in shared memory, where the ones before were read "
                               "from by {} on rank {}",
                               desc_.name, piece, core_.plan.registers[out.reg].name, consumer.id.str(),
                               consumer.id.rank()));
        return;
      }
      m.kind = MsgKind::request_mapped;
      if (core_.settings.record_handshakes) core_.record(m);
      worker_->flush_outbox_to(consumer.id.rank());
      worker_->count_link_message();
      core_.send_remote_mapped(m, *in_shared);
      return;
    }
    if (consumer.way == Consumer::Way::inline_payload) {
      m.kind = MsgKind::request_inline;
      if (core_.settings.record_handshakes) core_.record(m);
      worker_->flush_outbox_to(consumer.id.rank());
      worker_->count_link_message();
      core_.send_remote(m, data, consumer.bytes);
      return;
    }
    try {
      if (core_.departed(consumer.id.rank())) return;  // it left the job
      core_.settings.link->send_payload(consumer.id.rank(),
                                        payload_tag(consumer.id.index(), consumer.port, piece + core_.shift(out.reg)),
                                        data, consumer.bytes);
    } catch (const std::exception& e) {
      core_.fail(fmt::format("actor '{}' could not offer piece {} of '{}' to rank {}: {}", desc_.name, piece,
                             core_.plan.registers[out.reg].name, consumer.id.rank(), e.what()));
      return;
    }
  }
  send(consumer.worker, m);
}

void Actor::count_crossings(RunReport& report) const {
  for (const auto& out : outputs_) {
    for (const Consumer& c : out->consumers) {
      switch (c.way) {
        case Consumer::Way::mapped: report.pieces_read_in_place += c.sent; break;
        case Consumer::Way::inline_payload: report.pieces_inline += c.sent; break;
        case Consumer::Way::pulled: report.pieces_pulled += c.sent; break;
        case Consumer::Way::undecided: break;
      }
    }
  }
}

void Actor::release(Input& in, std::int64_t piece) {
  if (piece < in.zeros_until) {  // read as zeros: nobody to hand it back to
    in.released = piece + 1;
    return;
  }
  const auto slot = slot_of(piece, in.slots);
  // Not again where this act counted it already (in place), nor for a view whose readers
  // counted its input down (Output::counts_for).
  if (in.source != nullptr && in.source->counted() && in.counted_early != piece &&
      !(outputs_.size() == 1 && outputs_[0]->counts_for != nullptr && piece < outputs_[0]->written))
    in.source->reader_done(slot);
  if (in.source != nullptr) {
    std::vector<const StreamEvent*>& left = in.source->done[in.consumer_index][slot];
    if (stream_ordered_ && in.sync == EdgeSync::event) {
      // Our reads of the slot are enqueued: the writer's stream waits for them, not the host.
      StreamEvent& e = *in.done_events[slot];
      try {
        stream_->record(e);
      } catch (const std::exception& ex) {
        core_.fail(fmt::format("actor '{}' ({} on {}) failed at piece {}: {}", desc_.name, desc_.op, id_.str(), piece,
                               ex.what()));
        return;
      }
      left.push_back(&e);
    } else if (desc_.kind == ActorKind::repeat) {
      // What the repeat's readers left for this piece's group goes on to the writer.
      auto it = repeat_done_.find(piece);
      if (it != repeat_done_.end()) {
        left.insert(left.end(), it->second.begin(), it->second.end());
        repeat_done_.erase(it);
      }
    }
  }
  in.released = piece + 1;
  send(in.producer_worker, Message{id_, in.producer, piece, in.reg,
                                   static_cast<std::uint16_t>(slot_of(piece, in.slots)), MsgKind::ack,
                                   in.consumer_index});
}

void Actor::advance_freed(Output& out) {
  while (out.freed < out.written && out.pending[slot_of(out.freed, out.slots)] == 0) {
    ++out.freed;
  }
  out.freed_seen.store(out.freed, std::memory_order_relaxed);
  if (desc_.kind == ActorKind::repeat) release_repeat_inputs();
}

// A repeat's input piece g is aliased by its output pieces [g*M, g*M + M); it goes back to
// its producer only when all of those are freed (or, once the repeat has finished, when the
// last one it did write is).
void Actor::release_repeat_inputs() {
  Input& in = inputs_[0];
  const Output& out = *outputs_[0];
  const std::int64_t m = desc_.group;
  std::int64_t releasable = out.freed / m;
  if (finished_ && out.freed == out.written) releasable = (out.written + m - 1) / m;
  while (in.released < releasable) release(in, in.released);
}

void Actor::on_request(const Message& m) {
  Input* in = input_for(m.reg);
  if (in == nullptr) return protocol_error(m, "request for a register this actor does not read");
  if (in->detached) return;
  if (m.piece != in->received) return protocol_error(m, "request out of order");
  if ((m.kind == MsgKind::request_inline || m.kind == MsgKind::request_mapped) &&
      (in->arrived.empty() || in->arrived[slot_of(m.piece, in->slots)] == nullptr)) {
    return protocol_error(m, "a request whose piece came with it, but nothing arrived");
  }
  in->received = m.piece + 1;
}

void Actor::on_ack(const Message& m) {
  Output* out = output_for(m.reg);
  if (out == nullptr || m.consumer >= out->consumers.size()) {
    return protocol_error(m, "ack for a register this actor does not write");
  }
  Consumer& c = out->consumers[m.consumer];
  if (m.piece != c.acked || m.piece >= out->written) return protocol_error(m, "ack out of order");
  c.acked = m.piece + 1;
  if (desc_.kind == ActorKind::repeat && !out->done.empty()) {
    // The events this reader left go to the input piece its output piece aliases.
    auto& left = out->done[m.consumer][slot_of(m.piece, out->slots)];
    if (!left.empty()) {
      auto& to = repeat_done_[m.piece / desc_.group];
      to.insert(to.end(), left.begin(), left.end());
      left.clear();
    }
  }
  if (m.piece < c.detached_from) {
    --out->pending[slot_of(m.piece, out->slots)];
    // A reader on another rank: its release happened there.
    if (out->counted() && c.worker == nullptr) out->reader_done(slot_of(m.piece, out->slots));
    advance_freed(*out);
  }
}

void Actor::on_eos(const Message& m) {
  Input* in = input_for(m.reg);
  if (in == nullptr) return protocol_error(m, "end of stream for a register this actor does not read");
  if (in->detached) return;
  if (m.piece != in->received) return protocol_error(m, "end of stream before the last request");
  in->end = m.piece;
}

void Actor::on_detach(const Message& m) {
  Output* out = output_for(m.reg);
  if (out == nullptr || m.consumer >= out->consumers.size()) {
    return protocol_error(m, "detach from a register this actor does not write");
  }
  Consumer& c = out->consumers[m.consumer];
  if (c.detached_from != never) return;
  c.detached_from = m.piece;
  for (std::int64_t p = std::max(c.acked, m.piece); p < out->written; ++p) {
    --out->pending[slot_of(p, out->slots)];
    if (out->counted()) out->reader_done(slot_of(p, out->slots));
  }
  if (--out->live == 0) ++outputs_dead_;
  advance_freed(*out);
}

// Rank `rank` left the job (Core::rank_left). Its readers of our outputs are detached at what
// they acked (their slots free again); our inputs from it (a transfer's: only transfers read
// another rank) read zeros from the next act on, and a pull from it still in flight lands as
// zeros now: a sum over replicas goes on with the others'.
void Actor::on_rank_left(std::uint32_t rank) {
  for (auto& out : outputs_) {
    for (std::size_t c = 0; c < out->consumers.size(); ++c) {
      const Consumer& consumer = out->consumers[c];
      if (consumer.worker != nullptr || consumer.id.rank() != rank || consumer.detached_from != never) continue;
      on_detach(Message{consumer.id, id_, consumer.acked, out->reg, 0, MsgKind::detach, static_cast<std::uint8_t>(c)});
    }
  }
  bool lost = false;
  for (Input& in : inputs_) {
    if (in.producer_worker != nullptr || in.source != nullptr || in.producer.rank() != rank || in.zeros_until == never) {
      continue;
    }
    in.zeros_until = never;
    in.received = never;  // every piece readable from now on, as zeros
    lost = true;
  }
  if (!lost) return;
  for (const Input& in : inputs_) {
    if (in.producer_worker == nullptr && in.source == nullptr && in.zeros_until != never && in.producer.rank() != rank) {
      core_.fail(fmt::format("transfer actor '{}' gathers from rank {} and rank {}: it cannot go on without rank {}",
                             desc_.name, rank, in.producer.rank(), rank));
      return;
    }
  }
  orphaned_ = true;
  if (desc_.kind != ActorKind::transfer || inflight_ == 0) return;
  // The pulls in flight were all from `rank` (every remote input is): their parts read zeros.
  Output& out = *outputs_[0];
  std::vector<std::uint16_t> zeroed;
  for (std::size_t slot = 0; slot < pulls_left_.size(); ++slot) {
    if (pulls_left_[slot] == 0) continue;
    auto* at = static_cast<std::byte*>(out.buffers[slot].raw());
    for (std::size_t p = 0; p < (reduces_ ? 1 : port_to_input_.size()); ++p) {
      if (inputs_[port_to_input_[p]].zeros_until == never) std::memset(at, 0, port_bytes_[p]);
      at += port_bytes_[p];
    }
    pulls_left_[slot] = 0;
    zeroed.push_back(static_cast<std::uint16_t>(slot));
  }
  // Published in piece order however they are marked (landed()).
  for (std::uint16_t slot : zeroed) {
    landed(slot);
    if (core_.failed()) return;
  }
}

bool Actor::talks_to(std::uint32_t rank) const {
  for (const auto& out : outputs_) {
    for (const Consumer& c : out->consumers) {
      if (c.worker == nullptr && c.id.rank() == rank) return true;
    }
  }
  for (const Input& in : inputs_) {
    if (in.producer_worker == nullptr && in.source == nullptr && in.producer.rank() == rank) return true;
  }
  return false;
}

// Rank `rank`, which left, is coming back (Core::hold_for_rejoin): no more acts until it has (or
// until it will not), and the first step it may come back at as far as this actor goes: past
// every piece this actor has begun, and for an input past its producer's credit too (what the
// departed process may have offered before it died must never be taken for the new one's).
void Actor::on_hold_for_rejoin(std::uint32_t rank) {
  std::int64_t first = 0;
  auto step_of = [&](RegisterIndex reg, std::int64_t piece) {
    const std::int64_t per = core_.pieces_per_step.empty() ? 0 : core_.pieces_per_step[reg];
    if (per <= 0) {
      core_.fail(fmt::format("actor '{}' cannot take rank {} back: register '{}' has no whole number of pieces a step",
                             desc_.name, rank, core_.plan.registers[reg].name));
      return std::int64_t{0};
    }
    return (std::max<std::int64_t>(piece, 0) + per - 1) / per;
  };
  for (const auto& out : outputs_) {
    for (const Consumer& c : out->consumers) {
      if (c.worker != nullptr || c.id.rank() != rank) continue;
      first = std::max(first, step_of(out->reg, count_div(acts_ + out_group_ - 1, out_group_)));
    }
  }
  for (const Input& in : inputs_) {
    if (in.producer_worker != nullptr || in.source != nullptr || in.producer.rank() != rank) continue;
    first = std::max(first, step_of(in.reg, count_div(acts_ + in_ratio_ - 1, in_ratio_) - in.delay + in.slots));
  }
  if (!finished_) {
    held_ = static_cast<std::int32_t>(rank);
    set_activity(ActorActivity::starved);
  }
  core_.answer_rejoin(first);
}

// Rank `rank` is back from step `step` (Core::rank_rejoined; -1: it is not after all). Its readers
// of our outputs read again from that step's first piece, our inputs from it read zeros up to
// there and then its pieces (numbered as ours: RuntimeSettings::rejoin_step on its side).
void Actor::on_rank_rejoined(std::uint32_t rank, std::int64_t step) {
  if (held_ != static_cast<std::int32_t>(rank)) {
    if (step >= 0) core_.answer_rejoin(0);
    return;
  }
  held_ = -1;
  if (step < 0) return;  // release_hold: on without it
  auto first_piece = [&](RegisterIndex reg) { return step * core_.pieces_per_step[reg]; };
  for (auto& out : outputs_) {
    for (Consumer& c : out->consumers) {
      if (c.worker != nullptr || c.id.rank() != rank || c.detached_from == never) continue;
      const std::int64_t p = first_piece(out->reg);
      if (p < count_div(acts_ + out_group_ - 1, out_group_)) {
        core_.fail(fmt::format("actor '{}' cannot take rank {} back at step {}: it has begun piece {} of '{}'",
                               desc_.name, rank, step, count_div(acts_ + out_group_ - 1, out_group_) - 1,
                               core_.plan.registers[out->reg].name));
        return;
      }
      c.detached_from = never;
      c.acked = p;
      c.from = p;
      c.way = Consumer::Way::undecided;  // a new process: the link tells again how to reach it
      if (out->live++ == 0) --outputs_dead_;
      if (p > out->written) ++out->joining;
    }
  }
  for (Input& in : inputs_) {
    if (in.producer_worker != nullptr || in.source != nullptr || in.producer.rank() != rank) continue;
    const std::int64_t z = first_piece(in.reg);
    if (z < count_div(acts_ + in_ratio_ - 1, in_ratio_) - in.delay) {
      core_.fail(fmt::format("actor '{}' cannot take rank {} back at step {}: it has read piece {} of '{}'", desc_.name,
                             rank, step, needed_piece(in) - 1, core_.plan.registers[in.reg].name));
      return;
    }
    in.zeros_until = z;
    in.received = z;
    // What the departed process staged or mapped is not the new one's (it sends nothing before
    // every rank has taken it back).
    std::fill(in.arrived.begin(), in.arrived.end(), nullptr);
    in.segment = {};
    in.prefaulted.clear();
  }
  core_.answer_rejoin(0);
}

void Actor::finish(bool unread) {
  finished_ = true;
  if (core_.dry_run && !core_.dry_after(index_)) core_.count_dry_reached();  // a source nobody reads: nothing to prove
  // A group cut short by its input's end is a plan error; one cut short because nobody reads
  // the sum any more is not.
  if (desc_.kind == ActorKind::accumulate && count_mod(acts_, out_group_) != 0 && !unread) {
    core_.fail(fmt::format(
        "accumulate actor '{}' ended inside a group: {} of {} pieces summed (its input ended "
        "after {} pieces, not a multiple of {})",
        desc_.name, count_mod(acts_, out_group_), out_group_, acts_, out_group_));
    return;
  }
  for (auto& out : outputs_) {
    for (std::size_t c = 0; c < out->consumers.size(); ++c) {
      const Consumer& consumer = out->consumers[c];
      if (consumer.detached_from != never) continue;
      send(consumer.worker, Message{id_, consumer.id, out->written, out->reg, 0,
                                    MsgKind::end_of_stream, static_cast<std::uint8_t>(c)});
    }
  }
  for (Input& in : inputs_) {
    // Pieces from `from` on will not be read; anything before it is acked in the normal way.
    std::int64_t from = desc_.kind == ActorKind::repeat ? (acts_ + in_ratio_ - 1) / in_ratio_
                                                        : in.released;
    if (in.end >= 0 && from >= in.end) continue;
    in.detached = true;
    send(in.producer_worker,
         Message{id_, in.producer, from, in.reg, 0, MsgKind::detach, in.consumer_index});
  }
  if (desc_.kind == ActorKind::repeat) release_repeat_inputs();
  if (lane_ != nullptr) pass_turn(false);
}

void Lane::start() {
  const auto by_key = [](const Act& a, const Act& b) {
    return std::tie(a.unit, a.rank, a.index) < std::tie(b.unit, b.rank, b.index);
  };
  std::sort(prefix.begin(), prefix.end(), by_key);
  std::sort(period.begin(), period.end(), by_key);
  acts = prefix;
  acts.insert(acts.end(), period.begin(), period.end());
  loop = prefix.size();
  at = 0;
  turn = period.empty() ? nullptr : acts[0].actor;
  move_on(false);
}

// Every actor of a lane acts in key order and only at its turn, so the acts not yet done are
// exactly those from `at` on, through the rest of the prefix and then round the period:
// skipping a finished actor's acts keeps the others' order. (A pipeline's cool-down is this:
// once its forwards have finished, the backwards' turns follow one another.) Past the whole
// list of skips, every act of the period was seen finished.
void Lane::move_on(bool acted) {
  if (turn == nullptr) return;
  const auto next = [&] { at = at + 1 == acts.size() ? loop : at + 1; };  // no division per act
  if (acted) next();
  for (std::size_t skipped = 0; acts[at].actor->finished(); next()) {
    if (++skipped == acts.size()) {
      turn = nullptr;
      return;
    }
  }
  turn = acts[at].actor;
}

// A lane's order is the schedule itself (ActOrder): whoever is next may be waiting for nothing
// but its turn, and hears no message that would wake it, so it is told.
void Actor::pass_turn(bool acted) {
  Actor* before = lane_->turn;
  lane_->move_on(acted);
  Actor* next = lane_->turn;
  if (next != before && next != nullptr && next != this) {
    worker_->send(worker_, Message{id_, next->id(), 0, 0, 0, MsgKind::start, 0});
  }
}

void Actor::retire_if_done() {
  if (!finished_ || retired_) return;
  for (const auto& out : outputs_) {
    if (out->freed < out->written) {
      set_activity(ActorActivity::backpressured);
      return;
    }
  }
  set_activity(ActorActivity::retired);
  retired_ = true;
  core_.on_retired();
}

void Actor::begin(std::uint64_t start_ticks) {
  since_ = start_ticks;
  counters_.since.store(start_ticks, std::memory_order_relaxed);
}

std::uint64_t Actor::set_activity(ActorActivity a) {
  if (a == activity_) return 0;
  std::uint64_t now = 0;
  if (core_.settings.time_accounting && !core_.sampled_time.load(std::memory_order_relaxed)) {  // exact: the sampler books it otherwise
    now = ticks();
    if (activity_ != ActorActivity::retired) bump(counters_.ticks[bucket(activity_)], now - since_);
    since_ = now;
    counters_.since.store(now, std::memory_order_relaxed);
  }
  activity_ = a;
  counters_.activity.store(a, std::memory_order_relaxed);
  return now;
}

void Actor::protocol_error(const Message& m, const char* what) {
  core_.fail(fmt::format("protocol error at actor '{}': {} ({} from {} for register '{}' slot {} piece {})",
                         desc_.name, what, baton::name(m.kind), m.src.str(),
                         m.reg < core_.plan.registers.size() ? core_.plan.registers[m.reg].name : "?",
                         m.slot, m.piece));
}

std::string Actor::describe_wait() const {
  if (retired_) return "retired";
  if (finished_) {
    for (const auto& out : outputs_) {
      if (out->freed < out->written) {
        return fmt::format("finished; waits for acks of '{}' ({} of {} slots in use)",
                           core_.plan.registers[out->reg].name, out->written - out->freed, out->slots);
      }
    }
    return "finished";
  }
  if (held_ >= 0) return fmt::format("held while rank {} comes back", held_);
  if (inflight_ > 0 && desc_.kind != ActorKind::transfer) {
    // Acts enqueued on its stream whose handshakes wait for the stream (a sink has no outputs).
    return fmt::format("waits for its stream to reach {} of its acts (the next: act {})", inflight_,
                       on_stream_.empty() ? acts_ : on_stream_.front()->m.piece);
  }
  if (inflight_ > 0) {
    return fmt::format("transferring: {} pulls from rank {} in flight (next to land: piece {})", inflight_,
                       inputs_[0].producer.rank(), outputs_[0]->written);
  }
  for (const Input& in : inputs_) {
    std::int64_t q = needed_piece(in);
    if (q >= 0 && q >= in.received) {
      const auto& reg = core_.plan.registers[in.reg];
      return fmt::format("starved: waits for piece {} of '{}' from '{}'", q, reg.name,
                         core_.plan.actors[reg.producer].name);
    }
  }
  if (count_mod(acts_, out_group_) == 0) {
    for (const auto& out : outputs_) {
      if (out->written - out->freed >= out->slots) {
        const auto& reg = core_.plan.registers[out->reg];
        std::string readers;
        for (std::size_t c = 0; c < out->consumers.size(); ++c) {
          const auto& consumer = out->consumers[c];
          std::int64_t p = out->freed;
          if (consumer.detached_from == never && consumer.acked <= p) {
            readers += fmt::format("{}'{}'", readers.empty() ? "" : ", ",
                                   core_.plan.actors[reg.consumers[c]].name);
          }
        }
        return fmt::format("back-pressured: all {} slots of '{}' in use, piece {} not yet acked by {}",
                           out->slots, reg.name, out->freed, readers);
      }
    }
  }
  if (lane_ != nullptr && lane_->turn != this && lane_->turn != nullptr) {
    return fmt::format("waits for its turn in lane {}: '{}' (act {}) comes first", lane_->id,
                       lane_->turn->name(), lane_->turn->acts());
  }
  return "ready";
}

}  // namespace baton::detail
