// The device copies pass (passes.h): copy actors between host and CUDA devices.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/graph/passes.h"

namespace baton::passes {

namespace {

/// Every actor placed on a CUDA device has a CUDA kernel for its op and dtype, or the job is
/// refused here, naming them, rather than when the runtime makes the kernels.
void check_cuda_kernels(const Plan& plan, const KernelRegistry& kernels) {
  std::vector<std::string> missing;
  for (const ActorDesc& a : plan.actors) {
    if (a.where.device.type != DeviceType::cuda) continue;
    std::vector<std::string> ops;
    if (a.kind == ActorKind::accumulate) {
      ops = a.op == "last" ? std::vector<std::string>{"copy"}
                           : std::vector<std::string>{"copy", "add"};
    } else if (a.kind == ActorKind::compute || a.kind == ActorKind::source) {
      ops = {a.op};
    }
    for (const std::string& op : ops) {
      if (!kernels.contains(op, DeviceType::cuda, a.dtype)) {
        missing.push_back(fmt::format("'{}' ({} {})", a.name, op, name(a.dtype)));
      }
    }
  }
  if (missing.empty()) return;
  const std::size_t shown = std::min<std::size_t>(missing.size(), 8);
  throw GraphError(fmt::format(
      "{} actor{} on a CUDA device ha{} no CUDA kernel: {}{}; place {} on the CPU", missing.size(),
      missing.size() == 1 ? "" : "s", missing.size() == 1 ? "s" : "ve",
      fmt::join(missing.begin(), missing.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
      missing.size() > shown ? ", ..." : "", missing.size() == 1 ? "it" : "them"));
}

}  // namespace

Plan device_copies(const Plan& plan, const KernelRegistry& kernels) {
  const bool any_cuda = std::any_of(plan.actors.begin(), plan.actors.end(), [](const ActorDesc& a) {
    return a.where.device.type == DeviceType::cuda;
  });
  if (!any_cuda) return plan;
  check_cuda_kernels(plan, kernels);
  // Data and losses are made and read on the host; copy actors move them (on their own
  // stream, so the copies overlap compute), and what crosses ranks goes through host memory.
  return insert_device_copies(plan);
}

}  // namespace baton::passes
