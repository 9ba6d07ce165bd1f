#include "baton/transport/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "baton/transport/link.h"

namespace baton::transport {

namespace {

// The name every segment carries, with its owner's nonce (readlink of a memfd gives
// "/memfd:<name> (deleted)"): a peer maps only what is one.
std::string segment_name(std::uint64_t nonce) { return fmt::format("baton-registers-{:016x}", nonce); }

std::uint64_t random_nonce() {
  std::random_device device;
  return (std::uint64_t{device()} << 32) ^ device();
}

std::size_t page_size() {
  static const auto bytes = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return bytes;
}

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

}  // namespace

SharedSegments::SharedSegments(std::string who, std::size_t segment_bytes)
    : who_(std::move(who)), segment_bytes_(round_up(std::max<std::size_t>(segment_bytes, 1), page_size())),
      nonce_(random_nonce()),
      pid_(static_cast<std::uint32_t>(::getpid())),
      segments_(std::make_unique<Segment[]>(max_segments)) {}

SharedSegments::~SharedSegments() {
  for (std::size_t i = 0; i < count_.load(std::memory_order_acquire); ++i) {
    ::munmap(segments_[i].base, segments_[i].size);
    ::close(segments_[i].fd);
  }
}

void* SharedSegments::allocate(std::size_t bytes) {
  const std::size_t need = round_up(std::max<std::size_t>(bytes, 1), alignment);
  std::lock_guard lock(mutex_);
  std::size_t n = count_.load(std::memory_order_relaxed);
  if (n == 0 || segments_[n - 1].size - segments_[n - 1].used < need) {
    if (n == max_segments) {
      throw TransportError(fmt::format("{}: shared register memory: {} segments in use, the most", who_, n));
    }
    const std::size_t size = round_up(std::max(need, segment_bytes_), page_size());
    const int fd = ::memfd_create(segment_name(nonce_).c_str(), MFD_CLOEXEC);
    if (fd < 0) {
      throw TransportError(fmt::format("{}: shared register memory: memfd_create: {}", who_, std::strerror(errno)));
    }
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      const int e = errno;
      ::close(fd);
      throw TransportError(fmt::format("{}: shared register memory: ftruncate to {} bytes: {}", who_, size,
                                       std::strerror(e)));
    }
    void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw TransportError(fmt::format("{}: shared register memory: mmap of {} bytes: {}", who_, size,
                                       std::strerror(e)));
    }
    segments_[n] = Segment{fd, static_cast<std::byte*>(base), size, 0};
    count_.store(++n, std::memory_order_release);
  }
  Segment& s = segments_[n - 1];
  std::byte* p = s.base + s.used;
  s.used += need;
  return p;
}

std::optional<SharedLocation> SharedSegments::locate(const void* p, std::size_t bytes) const {
  const auto* b = static_cast<const std::byte*>(p);
  const std::size_t n = count_.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    const Segment& s = segments_[i];
    if (b >= s.base && b < s.base + s.size && bytes <= static_cast<std::size_t>(s.base + s.size - b)) {
      return SharedLocation{pid_, s.fd, static_cast<std::uint64_t>(b - s.base),
                            nonce_};
    }
  }
  return std::nullopt;
}

std::size_t SharedSegments::bytes_allocated() const {
  std::lock_guard lock(mutex_);
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < count_.load(std::memory_order_relaxed); ++i) bytes += segments_[i].used;
  return bytes;
}

std::size_t SharedSegments::bytes_reserved() const {
  std::lock_guard lock(mutex_);
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < count_.load(std::memory_order_relaxed); ++i) bytes += segments_[i].size;
  return bytes;
}

void PeerSegments::prefault(const std::byte* p, std::size_t bytes) {
#ifdef MADV_POPULATE_READ
  if (bytes == 0) return;
  const auto page = page_size();
  const auto begin = reinterpret_cast<std::uintptr_t>(p) / page * page;
  const auto end = reinterpret_cast<std::uintptr_t>(p) + bytes;
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ);
#else
  (void)p, (void)bytes;
#endif
}

PeerSegments::~PeerSegments() {
  for (const auto& [key, m] : mappings_) ::munmap(const_cast<std::byte*>(m.base), m.size);
}

const std::byte* PeerSegment::at(const SharedLocation& where, std::size_t bytes) const {
  if (where.offset > size || bytes > size - where.offset) {
    throw TransportError(fmt::format("process {} named bytes [{}, {}) of its register segment (fd {}), which has {}",
                                     where.pid, where.offset, where.offset + bytes, where.fd, size));
  }
  return base + where.offset;
}

PeerSegment PeerSegments::segment(const SharedLocation& at) {
  std::lock_guard lock(mutex_);
  auto it = mappings_.find({at.pid, at.fd, at.nonce});
  if (it == mappings_.end()) {
    const std::string path = fmt::format("/proc/{}/fd/{}", at.pid, at.fd);
    auto refuse = [&](const std::string& why) {
      return TransportError(fmt::format("cannot map the register memory of process {} ({}): {} (a transfer between "
                                        "ranks of one host reads its producer's slot there; "
                                        "BATON_SHARED_REGISTERS=0, or RuntimeSettings::shared_registers = false, "
                                        "sends pieces through the data plane instead)",
                                        at.pid, path, why));
    };
    char target[256] = {};
    const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
    if (n < 0) throw refuse(fmt::format("readlink: {}", std::strerror(errno)));
    const std::string expected = "/memfd:" + segment_name(at.nonce);
    if (std::strncmp(target, expected.c_str(), expected.size()) != 0) {
      throw refuse(fmt::format("it is '{}', not the register segment it named ('{}')", target, expected));
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw refuse(fmt::format("open: {}", std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
      const int e = errno;
      ::close(fd);
      throw refuse(fmt::format("fstat: {}", st.st_size <= 0 ? "empty" : std::strerror(e)));
    }
    const auto size = static_cast<std::size_t>(st.st_size);
    void* base = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    const int e = errno;
    ::close(fd);  // the mapping keeps the segment
    if (base == MAP_FAILED) throw refuse(fmt::format("mmap of {} bytes: {}", size, std::strerror(e)));
    it = mappings_
             .emplace(std::tuple{at.pid, at.fd, at.nonce},
                      PeerSegment{SharedLocation{at.pid, at.fd, 0, at.nonce}, static_cast<const std::byte*>(base), size})
             .first;
  }
  return it->second;
}

}  // namespace baton::transport
