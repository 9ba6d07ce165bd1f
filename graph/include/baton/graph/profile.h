#pragma once
/// Measured op costs, for balancing pipeline stages (TrainConfig::balance = "profile"):
/// estimates by multiply-adds miss what a matrix product of a given shape really costs next to
/// a softmax, a layer norm or a GELU; timing each kernel on its real shapes does not.
///
///   auto costs = baton::profile_op_costs(g, *params);
///   // costs[id]: the median seconds of node id's kernel; 0 for leaves
#include <vector>

#include "baton/graph/compile.h"
#include "baton/graph/graph.h"

namespace baton {

struct ProfileOptions {
  /// Timed runs of each kernel (after one that fills the caches); the median counts.
  int repeats = 5;
  /// Only the nodes marked here (by id; empty: every node).
  std::vector<bool> only;
};

/// Runs the graph's nodes (those profiled and what they read) once on the CPU kernels, op by op
/// in id order (a topological order: the forward pass, then the backward pass), with the
/// weights in `params` and made-up inputs (floats uniform in [-1, 1], integers 0: a valid index
/// for an embedding or a label), timing each op's kernel; returns the seconds per node (0 for
/// inputs, variables and constants, and for nodes not profiled). On one machine and one thread:
/// what balances stages of equal devices. Throws GraphError naming an op whose kernel fails.
std::vector<double> profile_op_costs(const Graph& g, const ParameterStore& params, const ProfileOptions& options = {});

}  // namespace baton
