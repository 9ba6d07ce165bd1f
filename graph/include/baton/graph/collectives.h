#pragma once
/// Collectives made of actors: plan fragments any compiler (or hand-written plan) can add.
///
/// All-reduce over N members, a tensor of n elements cut into N chunks: member j's split actor
/// writes its N chunks; the owner of chunk c (member c) sums chunk c of every member, in member
/// order; every member's concat actor gathers the N sums. Each member sends and receives N-1
/// chunks in each half, as in a ring, in two hops instead of 2(N-1). Members on other ranks are
/// reached through transfer actors (insert_transfers), members on other in-process devices read
/// each other's registers in place. Every member ends with the same bits: each chunk's sum is
/// made once. Kernels: allreduce.split / .sum / .concat (f32, f64; add_collective_kernels).
#include <cstdint>
#include <string>
#include <vector>

#include "baton/actors/plan.h"
#include "baton/kernels/kernel.h"

namespace baton {

struct AllReduceMember {
  Placement where;       // where its split, sum and concat actors run
  RegisterIndex input;   // its register to sum (one piece per act)
  std::string suffix;    // appended to the names of its actors and registers (e.g. "@dp1")
};

/// Adds the all-reduce of the members' inputs (each of `shape` and `dtype`) under `name`;
/// returns the members' result registers (`result_slots` each), in member order.
std::vector<RegisterIndex> add_allreduce(Plan& plan, const std::string& name, const std::vector<AllReduceMember>& members,
                                         const Shape& shape, DType dtype, std::int32_t result_slots = 2);

/// The kernels add_allreduce's actors name.
void add_collective_kernels(KernelRegistry& kernels);

/// Where chunk c of n elements over `parts` members starts (parts + 1 offsets).
std::vector<std::int64_t> chunk_offsets(std::int64_t n, std::int64_t parts);

}  // namespace baton
