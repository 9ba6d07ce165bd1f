#pragma once
// Small helpers the test files share.
#include <cstddef>
#include <string>

#include <doctest/doctest.h>

namespace baton::test {

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
