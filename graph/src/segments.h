#pragma once
// The kernel of a segment (passes/segments.cpp): the acts of several actors of one device's
// stream run as one act, and on a stream that can capture, as one CUDA graph launched again at
// every act whose tensors lie where a captured act's did.
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "baton/kernels/kernel.h"

namespace baton::detail {

/// Where a member's input comes from: the segment's input `index`, or (from_output) the
/// segment's output `index`, which an earlier member wrote in the same act, read through a view
/// of shape `view` where the member's actor read it through view actors (a reshape without a
/// copy; plan.h), as is where `view` is empty.
struct SegmentSource {
  bool from_output = false;
  std::size_t index = 0;
  std::optional<Shape> view;
};

/// One folded actor: its name, op, dtype and attributes (its kernel is made from them as its
/// own actor's was), its inputs' sources and the segment outputs it writes, in port order.
struct SegmentMember {
  std::string actor;
  std::string op;
  DType dtype = DType::f32;
  Attrs attrs;
  std::vector<SegmentSource> inputs;
  std::vector<std::size_t> outputs;
};

/// The segment's kernel: each act runs the members' kernels in order on the actor's stream.
/// On an asynchronous device, an act whose input and output tensors lie where an
/// earlier act's lay (the register slots go round with the piece number, so they repeat) is
/// captured the second time it is seen (the first ran eagerly, so lazy set-ups such as a
/// kernel's scratch memory or cuBLAS's workspace are done) and launched as that graph from then
/// on. A capture that fails (a kernel that synchronises or allocates device memory) makes the
/// segment run eagerly for the rest of the run, said once on stderr.
KernelFactory segment_kernel(std::shared_ptr<const KernelRegistry> kernels, std::vector<SegmentMember> members);

}  // namespace baton::detail
