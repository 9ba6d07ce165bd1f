#include "baton/kernels/tensor.h"

#include <cstring>
#include <new>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "baton/kernels/allocator.h"

namespace baton {

std::int64_t numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) {
    if (d < 0) throw std::invalid_argument(fmt::format("negative extent in shape {}", to_string(s)));
    if (__builtin_mul_overflow(n, d, &n)) {
      throw std::invalid_argument(fmt::format("shape {} has more than 2^63 elements", to_string(s)));
    }
  }
  return n;
}

std::string to_string(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

void* CpuAllocator::allocate(std::size_t bytes) {
  void* p = ::operator new(bytes == 0 ? alignment : bytes, std::align_val_t{alignment});
  auto now = in_use_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  auto peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return p;
}

void CpuAllocator::deallocate(void* p, std::size_t bytes) noexcept {
  ::operator delete(p, std::align_val_t{alignment});
  in_use_.fetch_sub(bytes, std::memory_order_relaxed);
}

Storage::~Storage() {
  if (data == nullptr) return;
  if (allocator != nullptr) {
    allocator->deallocate(data, bytes);
  } else {
    ::operator delete(data, std::align_val_t{CpuAllocator::alignment});
  }
}

namespace {
std::shared_ptr<Storage> make_storage(std::size_t bytes, Allocator* alloc) {
  auto s = std::make_shared<Storage>();
  if (alloc != nullptr) {
    s->data = alloc->allocate(bytes);
    s->device = alloc->device();
    s->allocator = alloc;
  } else {
    s->data = ::operator new(bytes == 0 ? CpuAllocator::alignment : bytes,
                             std::align_val_t{CpuAllocator::alignment});
  }
  s->bytes = bytes;
  return s;
}
}  // namespace

Tensor Tensor::empty(Shape shape, DType dtype) {
  Tensor t;
  t.numel_ = baton::numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = make_storage(t.nbytes(), nullptr);
  return t;
}

Tensor Tensor::empty(Shape shape, DType dtype, Allocator& alloc) {
  Tensor t;
  t.numel_ = baton::numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = make_storage(t.nbytes(), &alloc);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype);
  std::memset(t.raw(), 0, t.nbytes());
  return t;
}

Tensor Tensor::view(Shape shape) const {
  const std::int64_t n = baton::numel(shape);
  if (n != numel_) {
    throw std::invalid_argument(fmt::format("a view of {} as {}: {} elements are not {}", describe(),
                                            to_string(shape), numel_, n));
  }
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  return fmt::format("{}{} on {}", name(dtype_), to_string(shape_), device().str());
}

Tensor Tensor::unallocated(Shape shape, DType dtype) {
  Tensor t;
  t.numel_ = baton::numel(shape);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>();
  return t;
}

void Tensor::throw_unallocated() const {
  throw std::logic_error(fmt::format("tensor {} has no memory (a plan compiled only to be simulated)", describe()));
}

void Tensor::check_type(DType requested) const {
  if (requested != dtype_) {
    throw std::logic_error(fmt::format("tensor {} accessed as {}", describe(), name(requested)));
  }
}

}  // namespace baton
