#pragma once
/// Attributes of an op or actor: a small ordered map from names to plain values.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace baton {

using AttrValue = std::variant<std::int64_t, double, std::string, std::vector<std::int64_t>>;

/// Ordered, so that printing and hashing a plan is deterministic.
class Attrs {
 public:
  Attrs() = default;
  Attrs(std::initializer_list<std::pair<const std::string, AttrValue>> init) : values_(init) {}

  Attrs& set(std::string name, AttrValue v) {
    values_[std::move(name)] = std::move(v);
    return *this;
  }
  bool has(std::string_view name) const { return values_.find(name) != values_.end(); }
  /// Typed getters; throw std::invalid_argument naming the attribute if it has another type.
  std::int64_t get_int(std::string_view name, std::int64_t fallback) const;
  double get_double(std::string_view name, double fallback) const;
  std::string get_string(std::string_view name, std::string fallback) const;

  const std::map<std::string, AttrValue, std::less<>>& values() const { return values_; }
  /// "{ns=1000, seed=7}" (empty string for no attributes)
  std::string str() const;
  friend bool operator==(const Attrs&, const Attrs&) = default;

 private:
  std::map<std::string, AttrValue, std::less<>> values_;
};

}  // namespace baton
