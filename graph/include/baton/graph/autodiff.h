#pragma once
/// Reverse-mode autodiff on the logical graph: adds the backward ops as ordinary nodes.
#include <vector>

#include "baton/graph/graph.h"

namespace baton {

/// d(loss)/d(w) for each w in `wrt`, as new nodes of loss's graph. `loss` must be a scalar.
/// `seed` scales the result (the compiler passes 1/M so that M micro-batch gradients sum to the
/// gradient of the global batch's mean loss). A w that loss does not depend on gets an invalid
/// Value. Throws GraphError naming the op when a needed gradient does not exist.
std::vector<Value> gradients(Value loss, const std::vector<Value>& wrt, double seed = 1.0);

}  // namespace baton
