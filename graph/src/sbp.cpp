#include "baton/graph/sbp.h"

#include <fmt/format.h>

namespace baton {

std::string to_string(const Sbp& s) {
  switch (s.kind) {
    case Sbp::Kind::split:
      return fmt::format("S({})", s.axis);
    case Sbp::Kind::broadcast:
      return "B";
    case Sbp::Kind::partial_sum:
      return "P";
  }
  return "?";
}

}  // namespace baton
