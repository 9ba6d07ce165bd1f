#pragma once
// Private to the .cu files of kernels/src/cuda: 16-byte packs of elements for the memory-bound
// kernels. A thread per 2-byte element leaves most of the memory system idle (one bf16 load is
// a 2-byte transaction, and the index arithmetic per element costs more than the load); a
// thread per 16-byte pack moves 8 bf16 or 4 float32 elements with one load and one store and
// does its index arithmetic once. Each element's arithmetic stays the scalar kernel's, so a
// packed kernel gives the scalar one's bits; the launchers take the packed path only where every
// pointer is 16-byte aligned and the element counts divide into packs, and the scalar path
// otherwise.
#include <cstdint>

namespace baton::cuda::launch::vec {

/// Elements of T in one 16-byte pack.
template <class T>
constexpr int width = static_cast<int>(16 / sizeof(T));

/// A pack's raw bytes, its elements through e() (a register's bytes seen as T: the 16-bit
/// bfloat16 type has a constructor, which a union member may not have).
template <class T>
struct Pack {
  uint4 raw;
  __device__ __forceinline__ T* e() { return reinterpret_cast<T*>(&raw); }
  __device__ __forceinline__ const T* e() const { return reinterpret_cast<const T*>(&raw); }
};

template <class T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  Pack<T> r;
  r.raw = *reinterpret_cast<const uint4*>(p);
  return r;
}

template <class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& v) {
  *reinterpret_cast<uint4*>(p) = v.raw;
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

}  // namespace baton::cuda::launch::vec
