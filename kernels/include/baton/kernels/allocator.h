#pragma once
/// Memory for tensors. Each allocator serves one device and counts what it hands out.
#include <atomic>
#include <cstddef>

#include "baton/kernels/device.h"

namespace baton {

/// Hands out device memory. Thread-safe. Implementations count bytes in use so that runtimes
/// can report register memory per device.
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// Returns memory for `bytes` bytes (64-byte aligned); throws std::bad_alloc on failure.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  virtual Device device() const = 0;
};

/// Host memory, 64-byte aligned (a cache line; enough for AVX-512 loads).
class CpuAllocator final : public Allocator {
 public:
  explicit CpuAllocator(Device d = {}) : device_(d) {}
  void* allocate(std::size_t bytes) override;
  void deallocate(void* p, std::size_t bytes) noexcept override;
  Device device() const override { return device_; }
  std::size_t bytes_in_use() const { return in_use_.load(std::memory_order_relaxed); }
  std::size_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }

  static constexpr std::size_t alignment = 64;

 private:
  Device device_;
  std::atomic<std::size_t> in_use_{0};
  std::atomic<std::size_t> peak_{0};
};

}  // namespace baton
