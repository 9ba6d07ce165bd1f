#pragma once
// Small helpers the test files share.
#include <cstddef>
#include <string>

#include <doctest/doctest.h>

#include "baton/actors/plan.h"
#include "baton/kernels/cuda.h"
#include "skip.h"

namespace baton::test {

/// Whether this build has the CUDA path (its kernels registered), as tests of CUDA plans need
/// even without a GPU; if not, skips the test ("built without CUDA; CUDA tests skipped").
inline bool cuda_built() {
  if (!cuda::built_with_cuda()) skip(Missing::cuda_device, "built without CUDA; CUDA tests skipped");
  return cuda::built_with_cuda();
}

/// Whether the CUDA tests can run here; if not, skips the test ("<reason>; CUDA tests skipped").
inline bool cuda_usable() {
  const auto& a = cuda::availability();
  if (!a.ok) skip(Missing::cuda_device, a.reason + "; CUDA tests skipped");
  return a.ok;
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

/// How many times `needle` starts in `haystack`.
inline std::size_t count(const std::string& haystack, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + 1)) ++n;
  return n;
}

/// How many of the plan's actors run op `op`.
inline int count_op(const Plan& plan, const std::string& op) {
  int n = 0;
  for (const ActorDesc& a : plan.actors) n += a.op == op;
  return n;
}

/// The message of the exception `fn` throws as E; fails the test if it throws nothing.
template <class E, class F>
std::string thrown_message(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return {};
}

}  // namespace baton::test
