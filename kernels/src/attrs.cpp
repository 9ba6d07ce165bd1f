#include "baton/kernels/attrs.h"

#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace baton {

namespace {
template <class T>
const T* find_typed(const std::map<std::string, AttrValue, std::less<>>& m, std::string_view name,
                    const char* wanted) {
  auto it = m.find(name);
  if (it == m.end()) return nullptr;
  if (const T* v = std::get_if<T>(&it->second)) return v;
  throw std::invalid_argument(fmt::format("attribute '{}' is not {}", name, wanted));
}
}  // namespace

std::int64_t Attrs::get_int(std::string_view name, std::int64_t fallback) const {
  const auto* v = find_typed<std::int64_t>(values_, name, "an integer");
  return v ? *v : fallback;
}

double Attrs::get_double(std::string_view name, double fallback) const {
  auto it = values_.find(name);
  if (it != values_.end()) {
    if (const auto* i = std::get_if<std::int64_t>(&it->second)) return static_cast<double>(*i);
  }
  const auto* v = find_typed<double>(values_, name, "a number");
  return v ? *v : fallback;
}

std::string Attrs::get_string(std::string_view name, std::string fallback) const {
  const auto* v = find_typed<std::string>(values_, name, "a string");
  return v ? *v : fallback;
}

std::string Attrs::str() const {
  if (values_.empty()) return {};
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : values_) {
    if (!first) out += ", ";
    first = false;
    out += k;
    out += '=';
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, std::string>) {
            out += fmt::format("\"{}\"", x);
          } else if constexpr (std::is_same_v<T, std::vector<std::int64_t>>) {
            out += fmt::format("[{}]", fmt::join(x, ","));
          } else if constexpr (std::is_same_v<T, double>) {
            // Always with a point or exponent, so 1.0 never prints like the integer 1.
            std::string text = fmt::format("{}", x);
            if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
            out += text;
          } else {
            out += fmt::format("{}", x);
          }
        },
        v);
  }
  out += '}';
  return out;
}

}  // namespace baton
