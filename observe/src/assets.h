#pragma once
// The page's files (observe/ui/), embedded into the binary at build time by
// observe/cmake/embed_assets.cmake: the dashboard works on a cluster without network access.
#include <string_view>

namespace baton::observe::detail {

struct Asset {
  std::string_view path;  // "/index.html"
  std::string_view type;  // its Content-Type
  std::string_view body;
};

/// The asset served at `path`, or null.
const Asset* find_asset(std::string_view path);

}  // namespace baton::observe::detail
