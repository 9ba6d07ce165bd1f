// A segment's kernel (segments.h): its members' kernels in turn, captured into stream graphs.
#include "segments.h"

#include <atomic>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "baton/graph/passes.h"
#include "baton/kernels/stream.h"

namespace baton {

namespace {

std::atomic<std::int64_t> captured{0}, launched{0}, refused{0};

}  // namespace

passes::SegmentGraphs passes::segment_graphs() { return {captured.load(), launched.load(), refused.load()}; }

namespace detail {

namespace {

/// The most graphs one segment keeps: one per pattern of slots its registers go round (piece p
/// is in slot p % slots, so the pattern repeats after the lcm of its registers' slot counts,
/// a few in a plan). Past it, acts with new addresses run eagerly.
constexpr std::size_t max_graphs = 32;

class SegmentKernel final : public Kernel {
 public:
  SegmentKernel(std::string actor, std::vector<SegmentMember> members, std::vector<std::unique_ptr<Kernel>> kernels)
      : actor_(std::move(actor)), members_(std::move(members)), kernels_(std::move(kernels)) {}

  void compute(KernelContext& ctx) override {
    AsyncStream* s = ctx.async_stream;
    if (s == nullptr || !refusal_.empty()) return run(ctx);
    std::vector<const void*>& key = key_;  // reused: no allocation on an act that launches a graph
    key.clear();
    for (const Tensor* t : ctx.inputs) key.push_back(t == nullptr ? nullptr : t->raw());
    for (const Tensor* t : ctx.outputs) key.push_back(t == nullptr ? nullptr : t->raw());
    if (auto it = captured_.find(key); it != captured_.end()) {
      s->launch(*it->second);
      ++launched;
      return;
    }
    if (captured_.size() >= max_graphs) return run(ctx);
    if (seen_.insert(key).second) {
      // Seen once: run eagerly. Slots repeat, so the keys are few; if they do not, stop looking.
      if (seen_.size() > 4 * max_graphs) give_up("its tensors' addresses do not repeat from act to act");
      return run(ctx);
    }
    seen_.erase(key);
    std::unique_ptr<StreamGraph> g = capture(ctx, *s);
    if (!g) return run(ctx);  // nothing of the failed capture ran
    s->launch(*g);
    ++launched;
    captured_.emplace(key, std::move(g));
  }

 private:
  /// The members' kernels in turn, each with its own ports.
  void run(KernelContext& ctx) {
    for (std::size_t m = 0; m < members_.size(); ++m) {
      const SegmentMember& member = members_[m];
      in_.clear();
      out_.clear();
      views_.resize(member.inputs.size());
      for (std::size_t i = 0; i < member.inputs.size(); ++i) {
        const SegmentSource& src = member.inputs[i];
        if (!src.from_output) {
          in_.push_back(ctx.inputs[src.index]);
        } else if (!src.view) {
          in_.push_back(ctx.outputs[src.index]);
        } else {
          views_[i] = ctx.outputs[src.index]->view(*src.view);  // the same bytes, the reader's shape
          in_.push_back(&views_[i]);
        }
      }
      for (std::size_t o : member.outputs) out_.push_back(ctx.outputs[o]);
      KernelContext c{in_, out_, ctx.piece, ctx.stream, ctx.async_stream};
      try {
        kernels_[m]->compute(c);
      } catch (const std::exception& e) {
        throw std::runtime_error(fmt::format("{} (in segment '{}'): {}", member.actor, actor_, e.what()));
      }
    }
  }

  /// run() captured on `s`, or null (and the segment eager from now on) where that failed.
  std::unique_ptr<StreamGraph> capture(KernelContext& ctx, AsyncStream& s) {
    std::string why;
    std::unique_ptr<StreamGraph> g;
    try {
      s.begin_capture();
      try {
        run(ctx);
      } catch (const std::exception& e) {
        why = e.what();  // what cannot be captured, or a real error the eager run meets again
      }
      try {
        g = s.end_capture();
      } catch (const std::exception& e) {
        if (why.empty()) why = e.what();
      }
    } catch (const std::exception& e) {
      why = e.what();  // the stream cannot capture at all
    }
    if (why.empty()) {
      ++captured;
      return g;
    }
    give_up("its capture into a graph failed: " + why);
    return nullptr;
  }

  /// No more captures in this run, and why (once on stderr).
  void give_up(const std::string& why) {
    refusal_ = why;
    seen_.clear();
    ++refused;
    fmt::print(stderr, "baton: segment '{}' runs its {} kernels one by one: {}\n", actor_, members_.size(), why);
  }

  std::string actor_;
  std::vector<SegmentMember> members_;
  std::vector<std::unique_ptr<Kernel>> kernels_;
  std::vector<const void*> key_;  // this act's tensors' addresses
  std::vector<Tensor> views_;  // a member's inputs read through views, for the member's act
  std::vector<const Tensor*> in_;
  std::vector<Tensor*> out_;
  std::map<std::vector<const void*>, std::unique_ptr<StreamGraph>> captured_;
  std::set<std::vector<const void*>> seen_;
  std::string refusal_;
};

}  // namespace

KernelFactory segment_kernel(std::shared_ptr<const KernelRegistry> kernels, std::vector<SegmentMember> members) {
  return [kernels = std::move(kernels), members = std::move(members)](const KernelConfig& kc) -> std::unique_ptr<Kernel> {
    std::vector<std::unique_ptr<Kernel>> made;
    for (const SegmentMember& m : members) {
      made.push_back(kernels->create(m.op, KernelConfig{m.actor, kc.device, m.dtype, m.attrs, kc.services}));
    }
    return std::make_unique<SegmentKernel>(std::string(kc.actor), members, std::move(made));
  };
}

}  // namespace detail

}  // namespace baton
