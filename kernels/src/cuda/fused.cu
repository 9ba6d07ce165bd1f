// Fused elementwise kernels: bias + GELU (forward and backward) in one pass, float32 and bfloat16
// (elem.cuh), with the unfused kernels' arithmetic (elementwise.cu), and the multi-tensor
// optimizer steps: one launch over many weights, each element's arithmetic that of the
// one-tensor kernels (adam(), sgd()).
#include <cmath>
#include <initializer_list>

#include "elem.cuh"
#include "launch_fused.h"
#include "gelu.cuh"
#include "vec.cuh"

namespace baton::cuda::launch {
namespace {

using elem::load;

constexpr int threads = 256;

unsigned blocks_for(long long n) {
  long long b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b > 262140 ? 262140 : b);
}


// GELU (of the form tanh_form names) of the sum rounded to float, as the add's output.
template <bool tanh_form>
__device__ __forceinline__ float bias_gelu_value(float x, float b) {
  return act::gelu_of<tanh_form>(x + b);
}

// gelu_grad's formula at z = x + b.
template <bool tanh_form>
__device__ __forceinline__ float bias_gelu_grad_value(float x, float b, float g) {
  return act::gelu_grad_of<tanh_form>(x + b, g);
}

template <bool tanh_form, class T>
__global__ void bias_gelu_kernel(const T* x, const T* b, T* y, long long n, long long cols) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    elem::store(y + i, bias_gelu_value<tanh_form>(load(x + i), load(b + i % cols)));
  }
}

template <bool tanh_form, class T>
__global__ void bias_gelu_grad_kernel(const T* x, const T* b, const T* dy, T* dx, long long n, long long cols) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    elem::store(dx + i, bias_gelu_grad_value<tanh_form>(load(x + i), load(b + i % cols), load(dy + i)));
  }
}

// 16-byte packs (vec.cuh), for cols a multiple of the pack: a pack's bias is one contiguous pack.
template <bool tanh_form, class T>
__global__ void bias_gelu_packed_kernel(const T* x, const T* b, T* y, long long packs, long long cols) {
  constexpr int W = vec::width<T>;
  for (long long p = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i = p * W;
    const auto xv = vec::load_pack(x + i), bv = vec::load_pack(b + i % cols);
    vec::Pack<T> r;
#pragma unroll
    for (int k = 0; k < W; ++k) elem::store(r.e() + k, bias_gelu_value<tanh_form>(load(xv.e() + k), load(bv.e() + k)));
    vec::store_pack(y + i, r);
  }
}

template <bool tanh_form, class T>
__global__ void bias_gelu_grad_packed_kernel(const T* x, const T* b, const T* dy, T* dx, long long packs, long long cols) {
  constexpr int W = vec::width<T>;
  for (long long p = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i = p * W;
    const auto xv = vec::load_pack(x + i), bv = vec::load_pack(b + i % cols), gv = vec::load_pack(dy + i);
    vec::Pack<T> r;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      elem::store(r.e() + k, bias_gelu_grad_value<tanh_form>(load(xv.e() + k), load(bv.e() + k), load(gv.e() + k)));
    }
    vec::store_pack(dx + i, r);
  }
}

template <class T>
bool packed(long long n, long long cols, std::initializer_list<const void*> pointers) {
  if (cols % vec::width<T> != 0 || n % cols != 0) return false;
  for (const void* p : pointers) {
    if (!vec::aligned16(p)) return false;
  }
  return true;
}

template <class T, bool tanh_form>
cudaError_t bias_gelu_form(const T* x, const T* b, T* y, long long n, long long cols, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (cols <= 0) return cudaErrorInvalidValue;
  constexpr int w = vec::width<T>;
  if (packed<T>(n, cols, {x, b, y})) {
    bias_gelu_packed_kernel<tanh_form><<<blocks_for(n / w), threads, 0, s>>>(elem::dev(x), elem::dev(b), elem::dev(y), n / w, cols);
  } else {
    bias_gelu_kernel<tanh_form><<<blocks_for(n), threads, 0, s>>>(elem::dev(x), elem::dev(b), elem::dev(y), n, cols);
  }
  return cudaGetLastError();
}

template <class T, bool tanh_form>
cudaError_t bias_gelu_grad_form(const T* x, const T* b, const T* dy, T* dx, long long n, long long cols, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (cols <= 0) return cudaErrorInvalidValue;
  constexpr int w = vec::width<T>;
  if (packed<T>(n, cols, {x, b, dy, dx})) {
    bias_gelu_grad_packed_kernel<tanh_form><<<blocks_for(n / w), threads, 0, s>>>(elem::dev(x), elem::dev(b), elem::dev(dy),
                                                                       elem::dev(dx), n / w, cols);
  } else {
    bias_gelu_grad_kernel<tanh_form><<<blocks_for(n), threads, 0, s>>>(elem::dev(x), elem::dev(b), elem::dev(dy), elem::dev(dx), n,
                                                            cols);
  }
  return cudaGetLastError();
}

template <class T>
cudaError_t bias_gelu_t(const T* x, const T* b, T* y, long long n, long long cols, bool tanh, cudaStream_t s) {
  return tanh ? bias_gelu_form<T, true>(x, b, y, n, cols, s) : bias_gelu_form<T, false>(x, b, y, n, cols, s);
}

template <class T>
cudaError_t bias_gelu_grad_t(const T* x, const T* b, const T* dy, T* dx, long long n, long long cols, bool tanh,
                             cudaStream_t s) {
  return tanh ? bias_gelu_grad_form<T, true>(x, b, dy, dx, n, cols, s)
              : bias_gelu_grad_form<T, false>(x, b, dy, dx, n, cols, s);
}

// ---- multi-tensor optimizer steps -------------------------------------------------------------

// One launch's tensors and its blocks: block i steps chunk chunk[i] (multi_chunk elements) of
// tensor tensor[i]; copy[t] (copy_kind[t]: 0 none, 1 float32, 2 bfloat16) is where tensor t's
// new weights are also written (WeightCopy). Passed by value as the kernel's arguments (about
// 3.4 KB, under the 4 KB every CUDA version takes).
struct AdamArgs {
  float* w[multi_tensors];
  const float* g[multi_tensors];
  float* m[multi_tensors];
  float* v[multi_tensors];
  void* copy[multi_tensors];
  long long n[multi_tensors];
  unsigned char copy_kind[multi_tensors];
  unsigned char tensor[multi_blocks];
  int chunk[multi_blocks];
};
struct SgdArgs {
  float* w[multi_tensors];
  const float* g[multi_tensors];
  float* buf[multi_tensors];
  void* copy[multi_tensors];
  long long n[multi_tensors];
  unsigned char copy_kind[multi_tensors];
  unsigned char tensor[multi_blocks];
  int chunk[multi_blocks];
};
static_assert(multi_tensors <= 255, "a block names its tensor in one byte");
static_assert(sizeof(AdamArgs) + sizeof(AdamConstants) + sizeof(float) < 4000, "kernel arguments stay under 4 KB");
static_assert(sizeof(SgdArgs) + 64 < 4000, "kernel arguments stay under 4 KB");

unsigned char copy_kind(const WeightCopy& c) { return c.data == nullptr ? 0 : c.bf16 ? 2 : 1; }

// The weights' copy, as adam_kernel's store (elem.cuh): float32 as it is, bf16 rounded once.
__device__ __forceinline__ void store_copy(void* copy, unsigned char kind, long long i, float w) {
  if (kind == 1) {
    elem::store(static_cast<float*>(copy) + i, w);
  } else if (kind == 2) {
    elem::store(static_cast<__nv_bfloat16*>(copy) + i, w);
  }
}

// The gradient as the step reads it: scaled by the clipping factor first, as scale() does
// (one float product), or as it is.
__device__ __forceinline__ float scaled(const float* g, long long i, float grad_scale) {
  return grad_scale == 1.f ? g[i] : __fmul_rn(g[i], grad_scale);
}

__global__ void adam_multi_kernel(AdamArgs a, AdamConstants k, float grad_scale) {
  const int t = a.tensor[blockIdx.x];
  const long long begin = static_cast<long long>(a.chunk[blockIdx.x]) * multi_chunk;
  const long long end = begin + multi_chunk < a.n[t] ? begin + multi_chunk : a.n[t];
  float* w = a.w[t];
  const float* g = a.g[t];
  float* m = a.m[t];
  float* v = a.v[t];
  void* copy = a.copy[t];
  const unsigned char kind = a.copy_kind[t];
  for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
    // adam_kernel's arithmetic (elementwise.cu), operation for operation.
    const float gi = scaled(g, i, grad_scale) + k.l2 * w[i];
    const float mi = k.b1 * m[i] + k.one_minus_b1 * gi;
    const float vi = k.b2 * v[i] + k.one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float wi = __fsub_rn(__fmul_rn(w[i], k.decay),
                               __fdiv_rn(__fmul_rn(k.step_size, mi), __fadd_rn(__fmul_rn(sqrtf(vi), k.inv_bc2_sqrt), k.eps)));
    w[i] = wi;
    store_copy(copy, kind, i, wi);
  }
}

__global__ void sgd_multi_kernel(SgdArgs a, double lr, double mu, double wd, bool nesterov, bool first,
                                 float grad_scale) {
  const int t = a.tensor[blockIdx.x];
  const long long begin = static_cast<long long>(a.chunk[blockIdx.x]) * multi_chunk;
  const long long end = begin + multi_chunk < a.n[t] ? begin + multi_chunk : a.n[t];
  float* w = a.w[t];
  const float* g = a.g[t];
  float* buf = a.buf[t];
  void* copy = a.copy[t];
  const unsigned char kind = a.copy_kind[t];
  for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
    // sgd_kernel's arithmetic (elementwise.cu).
    const double wi = w[i];
    double d = static_cast<double>(scaled(g, i, grad_scale)) + wd * wi;
    if (buf != nullptr) {
      const double b = first ? d : mu * static_cast<double>(buf[i]) + d;
      buf[i] = static_cast<float>(b);
      d = nesterov ? d + mu * b : b;
    }
    const float out = static_cast<float>(wi - lr * d);
    w[i] = out;
    store_copy(copy, kind, i, out);
  }
}

// Packs tensors and their chunks into launches of at most multi_tensors tensors and
// multi_blocks blocks; `set(args, slot, tensor)` writes a tensor's pointers into a slot and
// `launch(args, blocks)` enqueues one launch.
template <class Args, class Pointers, class Set, class Launch>
cudaError_t pack_and_launch(const Pointers* list, long long count, Set set, Launch launch) {
  Args args{};
  int tensors = 0, blocks = 0;
  auto flush = [&]() -> cudaError_t {
    const int b = blocks;
    tensors = 0;
    blocks = 0;
    return b == 0 ? cudaSuccess : launch(args, b);
  };
  for (long long t = 0; t < count; ++t) {
    const Pointers& p = list[t];
    if (p.n <= 0) continue;
    if (tensors == multi_tensors) {
      if (cudaError_t e = flush(); e != cudaSuccess) return e;
    }
    int slot = tensors++;
    set(args, slot, p);
    const long long chunks = (p.n + multi_chunk - 1) / multi_chunk;
    for (long long c = 0; c < chunks; ++c) {
      if (blocks == multi_blocks) {
        // The launch is full: the rest of this tensor's chunks go into the next, as its slot 0.
        if (cudaError_t e = flush(); e != cudaSuccess) return e;
        slot = tensors++;
        set(args, slot, p);
      }
      args.tensor[blocks] = static_cast<unsigned char>(slot);
      args.chunk[blocks] = static_cast<int>(c);
      ++blocks;
    }
  }
  return flush();
}

}  // namespace

cudaError_t bias_gelu(const float* x, const float* b, float* y, long long n, long long cols, bool tanh,
                      cudaStream_t s) {
  return bias_gelu_t(x, b, y, n, cols, tanh, s);
}
cudaError_t bias_gelu(const Bf16* x, const Bf16* b, Bf16* y, long long n, long long cols, bool tanh, cudaStream_t s) {
  return bias_gelu_t(x, b, y, n, cols, tanh, s);
}
cudaError_t bias_gelu_grad(const float* x, const float* b, const float* dy, float* dx, long long n, long long cols,
                           bool tanh, cudaStream_t s) {
  return bias_gelu_grad_t(x, b, dy, dx, n, cols, tanh, s);
}
cudaError_t bias_gelu_grad(const Bf16* x, const Bf16* b, const Bf16* dy, Bf16* dx, long long n, long long cols,
                           bool tanh, cudaStream_t s) {
  return bias_gelu_grad_t(x, b, dy, dx, n, cols, tanh, s);
}

cudaError_t adam_multi(const AdamPointers* tensors, long long count, const AdamConstants& k, float grad_scale,
                       cudaStream_t s) {
  return pack_and_launch<AdamArgs>(
      tensors, count,
      [](AdamArgs& a, int slot, const AdamPointers& p) {
        a.w[slot] = p.w;
        a.g[slot] = p.g;
        a.m[slot] = p.m;
        a.v[slot] = p.v;
        a.n[slot] = p.n;
        a.copy[slot] = p.copy.data;
        a.copy_kind[slot] = copy_kind(p.copy);
      },
      [&](const AdamArgs& a, int blocks) {
        adam_multi_kernel<<<static_cast<unsigned>(blocks), threads, 0, s>>>(a, k, grad_scale);
        return cudaGetLastError();
      });
}

cudaError_t sgd_multi(const SgdPointers* tensors, long long count, double lr, double momentum, double weight_decay,
                      bool nesterov, bool first, float grad_scale, cudaStream_t s) {
  return pack_and_launch<SgdArgs>(
      tensors, count,
      [](SgdArgs& a, int slot, const SgdPointers& p) {
        a.w[slot] = p.w;
        a.g[slot] = p.g;
        a.buf[slot] = p.buf;
        a.n[slot] = p.n;
        a.copy[slot] = p.copy.data;
        a.copy_kind[slot] = copy_kind(p.copy);
      },
      [&](const SgdArgs& a, int blocks) {
        sgd_multi_kernel<<<static_cast<unsigned>(blocks), threads, 0, s>>>(a, lr, momentum, weight_decay, nesterov, first,
                                                                           grad_scale);
        return cudaGetLastError();
      });
}

}  // namespace baton::cuda::launch
