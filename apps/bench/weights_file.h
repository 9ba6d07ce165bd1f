#pragma once
// Initial weights handed from baton-bench-train to its references, so that PyTorch and LibTorch
// train from baton's starting point. A little-endian binary file:
//   "BATONW1\n", u32 count, then per tensor: u32 name length, the name, u32 rank, i64 dims[rank],
//   float32 data (row-major, baton's layout: a Linear weight is [in, out]).
// torch_reference.py reads the same format (read_weights()).
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace baton::bench {

struct NamedArray {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

inline constexpr char weights_magic[] = "BATONW1\n";

inline void write_weights(const std::string& path,
                          const std::map<std::string, NamedArray>& arrays) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + path);
  auto u32 = [&](std::uint32_t v) { out.write(reinterpret_cast<const char*>(&v), sizeof v); };
  out.write(weights_magic, sizeof weights_magic - 1);
  u32(static_cast<std::uint32_t>(arrays.size()));
  for (const auto& [name, a] : arrays) {
    u32(static_cast<std::uint32_t>(name.size()));
    out.write(name.data(), static_cast<std::streamsize>(name.size()));
    u32(static_cast<std::uint32_t>(a.shape.size()));
    out.write(reinterpret_cast<const char*>(a.shape.data()),
              static_cast<std::streamsize>(a.shape.size() * 8));
    out.write(reinterpret_cast<const char*>(a.data.data()),
              static_cast<std::streamsize>(a.data.size() * 4));
  }
  if (!out) throw std::runtime_error("writing " + path + " failed");
}

inline std::map<std::string, NamedArray> read_weights(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read the weights file " + path);
  char magic[sizeof weights_magic - 1];
  in.read(magic, sizeof magic);
  if (!in || std::memcmp(magic, weights_magic, sizeof magic) != 0) {
    throw std::runtime_error(path + " is not a baton weights file (no BATONW1 header)");
  }
  auto u32 = [&] {
    std::uint32_t v = 0;
    in.read(reinterpret_cast<char*>(&v), sizeof v);
    return v;
  };
  std::map<std::string, NamedArray> out;
  const std::uint32_t count = u32();
  for (std::uint32_t i = 0; i < count && in; ++i) {
    std::string name(u32(), '\0');
    in.read(name.data(), static_cast<std::streamsize>(name.size()));
    NamedArray a;
    a.shape.resize(u32());
    in.read(reinterpret_cast<char*>(a.shape.data()),
            static_cast<std::streamsize>(a.shape.size() * 8));
    std::int64_t n = 1;
    for (auto d : a.shape) {
      if (d < 0 || d > (std::int64_t{1} << 32))
        throw std::runtime_error(path + ": tensor " + name + " has a bad shape");
      n *= d;
    }
    a.data.resize(static_cast<std::size_t>(n));
    in.read(reinterpret_cast<char*>(a.data.data()), static_cast<std::streamsize>(n * 4));
    out.emplace(std::move(name), std::move(a));
  }
  if (!in) throw std::runtime_error(path + " ends early");
  return out;
}

}  // namespace baton::bench
