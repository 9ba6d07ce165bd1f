#pragma once
// The benchmarks' output: one flat JSON object per line on stdout, with the keys every baton
// benchmark shares ("bench", "case", "value", "unit", and "reference" / "ratio" where measured).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace baton::bench {

inline std::string json_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
    } else {
      out += c;
    }
  }
  return out;
}

/// JsonLine("actors", "same_thread_hop").add("value", 54.7).add("unit", "ns/hop").print();
class JsonLine {
 public:
  JsonLine(std::string_view bench, std::string_view case_name) : bench_(bench) {
    add("bench", bench);
    add("case", case_name);
  }
  JsonLine& add(std::string_view key, std::string_view v) { return raw(key, fmt::format("\"{}\"", json_escape(v))); }
  JsonLine& add(std::string_view key, const char* v) { return add(key, std::string_view(v)); }
  JsonLine& add(std::string_view key, const std::string& v) { return add(key, std::string_view(v)); }
  JsonLine& add(std::string_view key, double v) {
    // JSON has no inf or nan; a non-finite measurement is a bug in the benchmark, so say so.
    if (!std::isfinite(v)) {
      fmt::print(stderr, "baton-bench-{}: key '{}' is not finite ({}); printed as null\n", bench_, key, v);
      return raw(key, "null");
    }
    return raw(key, fmt::format("{:.6g}", v));
  }
  JsonLine& add(std::string_view key, std::int64_t v) { return raw(key, fmt::format("{}", v)); }
  JsonLine& add(std::string_view key, int v) { return add(key, std::int64_t{v}); }
  JsonLine& add(std::string_view key, std::uint64_t v) { return raw(key, fmt::format("{}", v)); }
  void print() const {
    fmt::print(stdout, "{{{}}}\n", body_);
    std::fflush(stdout);
  }

 private:
  JsonLine& raw(std::string_view key, std::string_view value) {
    if (!body_.empty()) body_ += ", ";
    body_ += fmt::format("\"{}\": {}", json_escape(key), value);
    return *this;
  }
  std::string bench_;
  std::string body_;
};

}  // namespace baton::bench
