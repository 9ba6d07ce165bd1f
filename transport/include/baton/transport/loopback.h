#pragma once
/// Ranks inside one process, joined by a Link that copies with memcpy: for tests of
/// everything above the transport (several Runtimes of one job in one process, under TSan)
/// without UCX. One delivery thread per hub plays every rank's progress thread.
#include <cstdint>
#include <memory>

#include "baton/transport/link.h"

namespace baton::transport {

class LoopbackHub {
 public:
  /// shares_memory false: the ends say they share no memory (Link::shares_memory_with), as
  /// ranks on different hosts, so no piece is read in place.
  explicit LoopbackHub(std::uint32_t world_size, bool shares_memory = true);
  ~LoopbackHub();  // stop()
  LoopbackHub(const LoopbackHub&) = delete;
  LoopbackHub& operator=(const LoopbackHub&) = delete;

  /// Rank r's end of the hub.
  Link& link(std::uint32_t rank);
  /// Starts delivering (set every rank's handler first).
  void start();
  /// Stops delivering; what is still queued is dropped.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace baton::transport
