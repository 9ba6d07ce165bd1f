#pragma once
/// The tensor value: shape, dtype, device and shared storage.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "baton/kernels/device.h"
#include "baton/kernels/dtype.h"

namespace baton {

class Allocator;

using Shape = std::vector<std::int64_t>;

/// Number of elements of a shape ({} is a scalar: 1 element). Throws on a negative extent.
std::int64_t numel(const Shape& s);
/// "[2, 3]"
std::string to_string(const Shape& s);

/// A block of device memory, freed through the allocator that made it.
struct Storage {
  void* data = nullptr;
  std::size_t bytes = 0;
  Device device{};
  Allocator* allocator = nullptr;  // null: plain aligned host memory

  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage();
};

/// A dense, row-major tensor. Copying a Tensor copies the handle, not the data (like
/// torch.Tensor); two handles may share one Storage. A default-constructed Tensor is
/// undefined (`defined() == false`): kernels see one for an input that has no piece yet.
class Tensor {
 public:
  Tensor() = default;

  /// Uninitialised host memory of the given shape.
  static Tensor empty(Shape shape, DType dtype);
  /// Memory from `alloc` (and on its device).
  static Tensor empty(Shape shape, DType dtype, Allocator& alloc);
  static Tensor zeros(Shape shape, DType dtype);
  /// A shape and dtype without memory: a weight of a plan compiled only to be simulated
  /// (TrainConfig::plan_only), so that a model larger than this machine compiles. Defined, but
  /// its data() throws std::logic_error naming it.
  static Tensor unallocated(Shape shape, DType dtype);
  /// Another handle to the same memory, seen as `shape` (as many elements; else
  /// std::invalid_argument): a reshape without a copy (the plan's views, plan.h).
  Tensor view(Shape shape) const;

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device{}; }
  std::int64_t numel() const { return numel_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel_) * size_of(dtype_); }
  std::int64_t dim(int i) const { return shape_.at(static_cast<std::size_t>(i)); }

  void* raw() { return storage_ ? storage_->data : nullptr; }
  const void* raw() const { return storage_ ? storage_->data : nullptr; }

  /// Typed view of the elements; throws std::logic_error if T does not match dtype().
  template <class T>
  std::span<T> data() {
    check_type(dtype_of<T>());
    check_memory();
    return {static_cast<T*>(raw()), static_cast<std::size_t>(numel_)};
  }
  template <class T>
  std::span<const T> data() const {
    check_type(dtype_of<T>());
    check_memory();
    return {static_cast<const T*>(raw()), static_cast<std::size_t>(numel_)};
  }

  /// "f32[2, 3] on cpu:0"
  std::string describe() const;
  /// True if both handles point at the same memory.
  bool shares_storage_with(const Tensor& other) const { return storage_ == other.storage_; }

 private:
  void check_type(DType requested) const;
  void check_memory() const {
    if (storage_ && storage_->data == nullptr && numel_ > 0) throw_unallocated();
  }
  [[noreturn]] void throw_unallocated() const;

  std::shared_ptr<Storage> storage_;
  Shape shape_;
  std::int64_t numel_ = 0;
  DType dtype_ = DType::f32;
};

}  // namespace baton
