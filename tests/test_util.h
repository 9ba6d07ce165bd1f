#pragma once
// Small helpers the test files share.
#include <cstddef>
#include <cstdio>
#include <string>

#include <doctest/doctest.h>

#include "baton/kernels/cuda.h"

namespace baton::test {

/// Whether this build has the CUDA path (its kernels registered), as tests of CUDA plans need
/// even without a GPU; if not, prints "built without CUDA; CUDA tests skipped" (a CTest skip).
inline bool cuda_built() {
  if (!cuda::built_with_cuda()) {
    std::printf("built without CUDA; CUDA tests skipped\n");
    std::fflush(stdout);
  }
  return cuda::built_with_cuda();
}

/// Whether the CUDA tests can run here; if not, prints "<reason>; CUDA tests skipped", which
/// CTest reports as a skip (tests/CMakeLists.txt).
inline bool cuda_usable() {
  const auto& a = cuda::availability();
  if (!a.ok) {
    std::printf("%s; CUDA tests skipped\n", a.reason.c_str());
    std::fflush(stdout);
  }
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
