#pragma once
/// Host memory that the processes of one host read from one another. The runtime places the
/// slots of registers that a transfer on another rank reads in it (SharedSegments), and a
/// transfer on a rank of the same host copies a piece straight out of the producer's slot
/// (PeerSegments): one copy, where a payload through UCX's shared-memory transports is copied
/// twice (into the FIFO and out of it: baton leaves CMA out, data_plane.cpp says why).
///
/// Segments are memfd files, mapped by a peer through /proc/<pid>/fd/<fd>: nothing to clean up
/// after a crash (no names under /dev/shm, no size limit of its mount), and a peer's mapping
/// stays valid when the writer dies (its pages live as long as a mapping does), so a lost rank
/// is reported by the runtime's deadlines, not by a SIGBUS or a UCX abort.
/// Knows only bytes, as the rest of transport/.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace baton::transport {

/// Where bytes of a segment lie, as a peer process finds them.
struct SharedLocation {
  std::uint32_t pid = 0;   // the owning process
  std::int32_t fd = -1;    // its segment's file descriptor there
  std::uint64_t offset = 0;
  /// The owner's random mark, in its segments' names: a peer maps only the segment it was
  /// told of, even where pids or descriptors are reused (or name another process, as they can
  /// across PID namespaces).
  std::uint64_t nonce = 0;
};

/// One process's shareable memory: a bump allocator over memfd segments of at least
/// `segment_bytes` each (pages are committed only when touched, so a segment's unused tail costs
/// nothing). Nothing is freed before the whole is destroyed: it holds memory that lives as long
/// as a run (register slots). Thread-safe; locate() takes no lock (a producer calls it for every
/// piece it announces).
class SharedSegments {
 public:
  static constexpr std::size_t alignment = 64;  // as CpuAllocator's
  /// allocate() throws past this many segments (the 64 MiB default gives 64 GiB).
  static constexpr std::size_t max_segments = 1024;
  explicit SharedSegments(std::string who, std::size_t segment_bytes = std::size_t{64} << 20);
  ~SharedSegments();
  SharedSegments(const SharedSegments&) = delete;
  SharedSegments& operator=(const SharedSegments&) = delete;

  /// `bytes` (aligned to `alignment`), zero-filled. Throws TransportError naming the call that
  /// failed (memfd_create, ftruncate, mmap) or max_segments.
  void* allocate(std::size_t bytes);
  /// Where [p, p + bytes) lies, if all of it is in one of these segments.
  std::optional<SharedLocation> locate(const void* p, std::size_t bytes) const;
  /// Bytes handed out so far, and bytes of the segments (committed or not).
  std::size_t bytes_allocated() const;
  std::size_t bytes_reserved() const;

 private:
  struct Segment {
    int fd = -1;
    std::byte* base = nullptr;
    std::size_t size = 0;
    std::size_t used = 0;
  };
  std::string who_;
  std::size_t segment_bytes_;
  std::uint64_t nonce_;
  std::uint32_t pid_;  // getpid() once: it is a system call each time
  mutable std::mutex mutex_;  // allocate() and the byte counts
  // Filled in order; a segment's fd, base and size are written before `count_` publishes it and
  // never change after, so locate() reads them without the lock.
  std::unique_ptr<Segment[]> segments_;
  std::atomic<std::size_t> count_{0};
};

/// A peer's segment as this process maps it (PeerSegments::segment).
struct PeerSegment {
  SharedLocation key;  // pid, fd and nonce name it; offset unused
  const std::byte* base = nullptr;
  std::size_t size = 0;
  bool is(const SharedLocation& at) const { return base != nullptr && at.pid == key.pid && at.fd == key.fd && at.nonce == key.nonce; }
  /// The `bytes` at `at.offset`; throws TransportError if they run past the segment's end.
  const std::byte* at(const SharedLocation& at, std::size_t bytes) const;
};

/// The segments of other processes this one reads, mapped read-only on first use and kept until
/// destroyed. Thread-safe.
class PeerSegments {
 public:
  PeerSegments() = default;
  ~PeerSegments();
  PeerSegments(const PeerSegments&) = delete;
  PeerSegments& operator=(const PeerSegments&) = delete;

  /// The `bytes` at `at` in a peer's segment. Throws TransportError naming what failed: the
  /// process or descriptor is not there or not readable (another user, /proc mounted with
  /// hidepid), it is not the segment named (SharedLocation::nonce), or the range runs past its
  /// end.
  const std::byte* map(const SharedLocation& at, std::size_t bytes) { return segment(at).at(at, bytes); }
  /// The whole segment `at` names, mapped on first use (same errors but the range's), for a
  /// reader that keeps it and finds its pieces without a lock.
  PeerSegment segment(const SharedLocation& at);
  /// Maps the page tables of [p, p + bytes) of a mapping now (MADV_POPULATE_READ), so that the
  /// first copy out of it does not take a fault per page. Only a hint: where the kernel has
  /// no such advice (before Linux 5.14) the pages fault in as they are read.
  static void prefault(const std::byte* p, std::size_t bytes);

 private:
  std::mutex mutex_;
  std::map<std::tuple<std::uint32_t, std::int32_t, std::uint64_t>, PeerSegment> mappings_;  // by pid, fd, nonce
};

}  // namespace baton::transport
