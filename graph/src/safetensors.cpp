// The safetensors format: see safetensors.h. The checks follow the reference implementation's
// (safetensors/src/tensor.rs): a header within the file and under 100 MB, offsets that tile the
// data exactly, and every byte count matching its dtype and shape.
#include "baton/graph/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>

#include <boost/json.hpp>
#include <fmt/format.h>

namespace baton::safetensors {

namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes; baton writes its tensors' memory as it is");

struct Name {
  DType dtype;
  const char* text;
};
constexpr Name names[] = {{DType::f32, "F32"}, {DType::f64, "F64"}, {DType::i32, "I32"}, {DType::i64, "I64"}, {DType::u8, "U8"}, {DType::bf16, "BF16"}, {DType::f16, "F16"}};
constexpr const char* read_names = "F32, F64, F16, BF16, I32, I64, U8";

/// A dtype as the file stores it: baton's own, or F16, which baton reads as f32 (every half is a
/// float exactly; baton's f16 tensors are storage for the wire, and are written as F16).
struct Stored {
  DType dtype;            // the tensor read() returns
  std::uint64_t bytes;    // per element in the file
  bool f16 = false;
};

const char* dtype_name(DType t) {
  for (const Name& n : names) {
    if (n.dtype == t) return n.text;
  }
  return nullptr;
}

std::optional<Stored> stored_of_name(std::string_view s) {
  if (s == "F16") return Stored{DType::f32, 2, true};
  for (const Name& n : names) {
    if (s == n.text) return Stored{n.dtype, size_of(n.dtype)};
  }
  return std::nullopt;
}

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {}", path.string(), what));
}

/// A POSIX file descriptor that closes itself.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(const std::filesystem::path& path, int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail(path, fmt::format("cannot write: {}", std::strerror(errno)));
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

/// A non-negative integer of the header, or nullopt.
std::optional<std::uint64_t> unsigned_of(const boost::json::value& v) {
  if (v.is_uint64()) return v.get_uint64();
  if (v.is_int64() && v.get_int64() >= 0) return static_cast<std::uint64_t>(v.get_int64());
  return std::nullopt;
}

struct Entry {
  std::string name;
  Stored stored;
  Shape shape;
  std::uint64_t begin, end;
};

}  // namespace

float half_to_float(std::uint16_t h) { return to_float(float16{h}); }

const Tensor* Contents::find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

void write(const std::filesystem::path& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata) {
  boost::json::object header;
  if (!metadata.empty()) {
    boost::json::object meta;
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const char* dt = dtype_name(t.dtype());
    if (dt == nullptr) fail(path, fmt::format("tensor '{}': safetensors has no name for {}", name, t.describe()));
    if (name == "__metadata__" || header.contains(name)) {
      fail(path, fmt::format("tensor '{}': the name is {}", name, name == "__metadata__" ? "reserved" : "used twice"));
    }
    boost::json::array shape;
    for (std::int64_t d : t.shape()) shape.push_back(d);
    header[name] = {{"dtype", dt}, {"shape", std::move(shape)}, {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = boost::json::serialize(header);
  // Spaces up to a multiple of 8, as the reference writer does, so the data starts aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * i));

  Fd f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0) fail(path, fmt::format("cannot create: {}", std::strerror(errno)));
  write_all(path, f.fd, length, sizeof length);
  write_all(path, f.fd, text.data(), text.size());
  for (const auto& [name, t] : tensors) {
    if (t.nbytes() > 0) write_all(path, f.fd, t.raw(), t.nbytes());
  }
  if (::fsync(f.fd) != 0) fail(path, fmt::format("cannot fsync: {}", std::strerror(errno)));
  const int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) fail(path, fmt::format("cannot close: {}", std::strerror(errno)));
}

Contents read(const std::filesystem::path& path) {
  std::error_code ec;
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) fail(path, fmt::format("cannot read: {}", ec.message()));
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, fmt::format("cannot open: {}", std::strerror(errno)));
  if (size < 8) fail(path, fmt::format("{} bytes is too short for a safetensors file (an 8-byte header length first)", size));
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(length[i]) << (8 * i);
  if (n > size - 8) {
    fail(path, fmt::format("the header length {} runs past the end of the file ({} bytes): truncated, or not a "
                           "safetensors file", n, size));
  }
  if (n > max_header_bytes) fail(path, fmt::format("the header length {} is over the cap of {} bytes", n, max_header_bytes));
  if (n < 2) fail(path, fmt::format("the header length {} cannot hold a JSON object", n));
  std::string text(static_cast<std::size_t>(n), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(n))) fail(path, "cannot read the header");
  boost::system::error_code jec;
  boost::json::value header = boost::json::parse(text, jec);
  if (jec) fail(path, fmt::format("the header is not valid JSON ({})", jec.message()));
  if (!header.is_object()) fail(path, "the header is not a JSON object");

  const std::uint64_t data_size = size - 8 - n;
  Contents out;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.as_object()) {
    const std::string name(key);
    if (name == "__metadata__") {
      if (!value.is_object()) fail(path, "__metadata__ is not a JSON object");
      for (const auto& [k, v] : value.as_object()) {
        if (!v.is_string()) fail(path, fmt::format("__metadata__ '{}' is not a string", std::string(k)));
        out.metadata[std::string(k)] = std::string(v.as_string());
      }
      continue;
    }
    auto bad = [&](const std::string& what) { fail(path, fmt::format("tensor '{}': {}", name, what)); };
    const boost::json::object* o = value.if_object();
    if (o == nullptr) bad("its entry is not a JSON object");
    const boost::json::value* dt = o->if_contains("dtype");
    const boost::json::value* shape = o->if_contains("shape");
    const boost::json::value* offsets = o->if_contains("data_offsets");
    if (dt == nullptr || !dt->is_string()) bad("no dtype string");
    const std::string dt_text(dt->as_string());
    const auto stored = stored_of_name(dt_text);
    if (!stored) bad(fmt::format("dtype '{}' is not one baton reads ({})", dt_text, read_names));
    if (shape == nullptr || !shape->is_array()) bad("no shape array");
    Entry e{name, *stored, {}, 0, 0};
    // The element count, checked for overflow: a hostile shape must not wrap to a small size.
    std::uint64_t elements = 1;
    for (const auto& d : shape->as_array()) {
      const auto extent = unsigned_of(d);
      if (!extent || *extent > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        bad(fmt::format("shape {} is not a list of non-negative integers", boost::json::serialize(*shape)));
      }
      if (*extent != 0 && elements > std::numeric_limits<std::uint64_t>::max() / *extent) {
        bad(fmt::format("shape {} overflows", boost::json::serialize(*shape)));
      }
      elements *= *extent;
      e.shape.push_back(static_cast<std::int64_t>(*extent));
    }
    if (offsets == nullptr || !offsets->is_array() || offsets->as_array().size() != 2 ||
        !unsigned_of(offsets->as_array()[0]) || !unsigned_of(offsets->as_array()[1])) {
      bad("data_offsets is not a pair of non-negative integers");
    }
    e.begin = *unsigned_of(offsets->as_array()[0]);
    e.end = *unsigned_of(offsets->as_array()[1]);
    if (e.begin > e.end || e.end > data_size) {
      bad(fmt::format("data_offsets [{}, {}] are outside the {} bytes of data", e.begin, e.end, data_size));
    }
    const std::uint64_t elem = stored->bytes;
    if (elements > std::numeric_limits<std::uint64_t>::max() / elem || elements * elem != e.end - e.begin) {
      bad(fmt::format("{} {} needs {} bytes but data_offsets [{}, {}] hold {}", dt_text, to_string(e.shape),
                      elements > std::numeric_limits<std::uint64_t>::max() / elem ? std::string("more than 2^64")
                                                                                   : std::to_string(elements * elem),
                      e.begin, e.end, e.end - e.begin));
    }
    entries.push_back(std::move(e));
  }
  // The tensors must tile the data: back to back from 0 to its end.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (e.begin < at) fail(path, fmt::format("tensors '{}' and '{}' overlap", entries[i - 1].name, e.name));
    if (e.begin > at) fail(path, fmt::format("bytes {}..{} of the data belong to no tensor (before '{}')", at, e.begin, e.name));
    at = e.end;
  }
  if (at != data_size) {
    fail(path, fmt::format("the file has {} bytes of data but its tensors end at {}{}", data_size, at,
                           at < data_size ? " (trailing bytes)" : ""));
  }
  for (const Entry& e : entries) {
    Tensor t = Tensor::empty(e.shape, e.stored.dtype);
    const std::uint64_t bytes = e.end - e.begin;
    if (bytes > 0) {
      // F16 is read into the second half of the f32 tensor's memory and widened from the front:
      // element i's float ends at 4 (i + 1), never past the half it came from (2 n + 2 (i + 1)).
      char* to = static_cast<char*>(t.raw()) + (t.nbytes() - bytes);
      in.seekg(static_cast<std::streamoff>(8 + n + e.begin));
      if (!in.read(to, static_cast<std::streamsize>(bytes))) fail(path, fmt::format("tensor '{}': cannot read its bytes", e.name));
      if (e.stored.f16) {
        float* f = t.data<float>().data();
        for (std::size_t i = 0, count = static_cast<std::size_t>(t.numel()); i < count; ++i) {
          std::uint16_t h;
          std::memcpy(&h, to + 2 * i, 2);
          f[i] = half_to_float(h);
        }
      }
    }
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace baton::safetensors
