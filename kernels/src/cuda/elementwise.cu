// Elementwise CUDA kernels: broadcasting binary ops, activations and their gradients, fill,
// strided gathers (transpose, broadcast_to) and the optimizer steps. Grid-stride loops; these
// ops are memory-bound, so where the pointers are 16-byte aligned and the sizes divide, a thread
// moves a 16-byte pack (vec.cuh: one element's arithmetic as in the scalar kernels, the same
// bits), else one element. The op kernels are templates over the element type: float32, and
// bfloat16 computed in float32 (elem.cuh).
#include <cmath>
#include <type_traits>

#include "elem.cuh"
#include "launch.h"
#include "gelu.cuh"
#include "vec.cuh"

namespace baton::cuda::launch {
namespace {

using elem::load;
using elem::store;

constexpr int threads = 256;

unsigned blocks_for(long long n) {
  long long b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  // A grid-stride loop covers the rest; 65535 * 4 blocks keep every SM busy.
  return static_cast<unsigned>(b > 262140 ? 262140 : b);
}

// How a broadcasting op reads one input: at the output's own index (same shape), at the index
// modulo the input's size (the input is the output's trailing axes, broadcast over the leading
// ones: a bias), or through its strides (anything else). Told apart on the host, so the common
// cases skip the per-axis divisions.
struct Access {
  int mode = 2;  // 0: contiguous, 1: trailing (i % modulus), 2: strided
  long long modulus = 1;
};

Access access_of(const Indexing& ix, const long long* strides) {
  long long contiguous = 1;
  int d = ix.ndim - 1;
  for (; d >= 0; --d) {
    if (ix.shape[d] != 1 && strides[d] != contiguous) break;
    contiguous *= ix.shape[d];
  }
  if (d < 0) return {0, 1};
  for (int e = d; e >= 0; --e) {
    if (ix.shape[e] != 1 && strides[e] != 0) return {2, 1};
  }
  return {1, contiguous};
}

__device__ long long strided_a(const Indexing& ix, long long i) {
  long long o = 0;
  for (int d = ix.ndim - 1; d >= 0; --d) {
    const long long k = i % ix.shape[d];
    i /= ix.shape[d];
    o += k * ix.a[d];
  }
  return o;
}

__device__ long long strided_b(const Indexing& ix, long long i) {
  long long o = 0;
  for (int d = ix.ndim - 1; d >= 0; --d) {
    const long long k = i % ix.shape[d];
    i /= ix.shape[d];
    o += k * ix.b[d];
  }
  return o;
}

__device__ __forceinline__ float binary_value(int op, float x, float y) {
  switch (static_cast<Binary>(op)) {
    case Binary::add: return x + y;
    case Binary::sub: return x - y;
    case Binary::mul: return x * y;
    case Binary::div: return x / y;
    default: return (isnan(x) || isnan(y)) ? NAN : (x > y ? x : y);
  }
}

template <class T>
__global__ void binary_kernel(int op, const T* a, const T* b, T* c, Indexing ix, long long n, Access aa, Access ab) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long oa = aa.mode == 0 ? i : aa.mode == 1 ? i % aa.modulus : strided_a(ix, i);
    const long long ob = ab.mode == 0 ? i : ab.mode == 1 ? i % ab.modulus : strided_b(ix, i);
    store(c + i, binary_value(op, load(a + oa), load(b + ob)));
  }
}

// A pack per thread: each input is read at the output's index or, a bias, modulo its size (a
// multiple of the pack, so that a pack never wraps).
template <class T>
__global__ void binary_packed_kernel(int op, const T* a, const T* b, T* c, long long packs, Access aa, Access ab) {
  constexpr int W = vec::width<T>;
  for (long long p = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long i = p * W;
    const auto x = vec::load_pack(a + (aa.mode == 0 ? i : i % aa.modulus));
    const auto y = vec::load_pack(b + (ab.mode == 0 ? i : i % ab.modulus));
    vec::Pack<T> r;
#pragma unroll
    for (int k = 0; k < W; ++k) store(r.e() + k, binary_value(op, load(x.e() + k), load(y.e() + k)));
    vec::store_pack(c + i, r);
  }
}

/// As ops_llm.cpp's: exp(-|x|) never overflows, and the two branches are one function.
__device__ float sigmoid_f(float x) {
  const float z = expf(-fabsf(x));
  const float r = 1.f / (1.f + z);
  return x >= 0.f ? r : z * r;
}

__device__ __forceinline__ float unary_value(int op, float v, float param) {
  switch (static_cast<Unary>(op)) {
    // As the CPU's std::max(x, 0): a NaN stays NaN (torch.relu), -0 stays -0.
    case Unary::relu: return v < 0.f ? 0.f : v;
    case Unary::gelu: return act::gelu(v);
    case Unary::gelu_tanh: return act::gelu_tanh(v);
    case Unary::tanh: return tanhf(v);
    case Unary::sigmoid: return static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(v))));
    // The LLM ops in float, as the CPU's kernels (ops_llm.cpp) compute them in the element
    // type; CUDA's expf, logf and powf are within 2 ulp, sqrtf is exact.
    case Unary::exp: return expf(v);
    case Unary::log: return logf(v);
    case Unary::sqrt: return sqrtf(v);
    case Unary::rsqrt: return 1.f / sqrtf(v);
    case Unary::silu: return v * sigmoid_f(v);
    case Unary::pow: return powf(v, param);
    default: return v * param;
  }
}

template <class T>
__global__ void unary_kernel(int op, const T* x, T* y, long long n, float param) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    store(y + i, unary_value(op, load(x + i), param));
  }
}

template <class T>
__global__ void unary_packed_kernel(int op, const T* x, T* y, long long packs, float param) {
  constexpr int W = vec::width<T>;
  for (long long p = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<long long>(gridDim.x) * blockDim.x) {
    const auto v = vec::load_pack(x + p * W);
    vec::Pack<T> r;
#pragma unroll
    for (int k = 0; k < W; ++k) store(r.e() + k, unary_value(op, load(v.e() + k), param));
    vec::store_pack(y + p * W, r);
  }
}

__device__ __forceinline__ double unary_grad_value(int op, double v, double g, float param) {
  switch (static_cast<UnaryGrad>(op)) {
    case UnaryGrad::relu: return v > 0 ? g : 0;
    case UnaryGrad::gelu: return act::gelu_grad(static_cast<float>(v), static_cast<float>(g));
    case UnaryGrad::gelu_tanh: return act::gelu_tanh_grad(static_cast<float>(v), static_cast<float>(g));
    case UnaryGrad::tanh: return g * (1 - v * v);
    case UnaryGrad::sqrt: return 0.5 * g / v;          // from y = sqrt(x)
    case UnaryGrad::rsqrt: return -0.5 * g * v * v * v;  // from y = x^-1/2
    case UnaryGrad::silu: {
      const double sg = sigmoid_f(static_cast<float>(v));
      return g * sg * (1 + v * (1 - sg));
    }
    case UnaryGrad::pow: return g * param * pow(v, static_cast<double>(param) - 1);
    default: return g * v * (1 - v);
  }
}

template <class T>
__global__ void unary_grad_kernel(int op, const T* x, const T* dy, T* dx, long long n, float param) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    elem::store_d(dx + i, unary_grad_value(op, load(x + i), load(dy + i), param));
  }
}

template <class T>
__global__ void unary_grad_packed_kernel(int op, const T* x, const T* dy, T* dx, long long packs, float param) {
  constexpr int W = vec::width<T>;
  for (long long p = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<long long>(gridDim.x) * blockDim.x) {
    const auto v = vec::load_pack(x + p * W), g = vec::load_pack(dy + p * W);
    vec::Pack<T> r;
#pragma unroll
    for (int k = 0; k < W; ++k) elem::store_d(r.e() + k, unary_grad_value(op, load(v.e() + k), load(g.e() + k), param));
    vec::store_pack(dx + p * W, r);
  }
}

template <class T>
__global__ void fill_kernel(T* y, long long n, float value) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    store(y + i, value);
  }
}

// E: an unsigned integer of the element's size; the gather only moves it.
template <class E>
__global__ void gather_kernel(const E* x, E* y, Indexing ix, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    y[i] = x[strided_a(ix, i)];
  }
}

// A gather whose output's trailing axes read a contiguous run of the input (a transpose that
// keeps the last axis, as the attention heads' [b, t, h, d] <-> [b, h, t, d]; a broadcast of
// rows): the output is rows of `row_packs` 16-byte packs, each row's start in the input found
// through the leading axes (`lead`, strides in packs) once per pack rather than per element.
__global__ void gather_rows_kernel(const uint4* x, uint4* y, Indexing lead, long long row_packs, long long packs) {
  for (long long p = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long row = p / row_packs;
    y[p] = x[strided_a(lead, row) + (p - row * row_packs)];
  }
}

// C: the element type of the copy of the new weights the step also writes (float32, or
// bfloat16 rounded to nearest even: the variable's value as its readers take it, so no copy or
// cast kernel follows), or void for none.
template <class C>
__global__ void adam_kernel(float* w, const float* g, float* m, float* v, C* copy, long long n, AdamConstants k) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float gi = g[i] + k.l2 * w[i];
    const float mi = k.b1 * m[i] + k.one_minus_b1 * gi;
    const float vi = k.b2 * v[i] + k.one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    // No fused multiply-adds: the CPU's loop rounds each operation, and so do we.
    const float wi = __fsub_rn(__fmul_rn(w[i], k.decay),
                               __fdiv_rn(__fmul_rn(k.step_size, mi), __fadd_rn(__fmul_rn(sqrtf(vi), k.inv_bc2_sqrt), k.eps)));
    w[i] = wi;
    if constexpr (!std::is_void_v<C>) store(copy + i, wi);
  }
}

template <class C>
__global__ void sgd_kernel(float* w, const float* g, float* buf, C* copy, long long n, double lr, double mu, double wd,
                           bool nesterov, bool first) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const double wi = w[i];
    double d = static_cast<double>(g[i]) + wd * wi;
    if (buf != nullptr) {
      const double b = first ? d : mu * static_cast<double>(buf[i]) + d;
      buf[i] = static_cast<float>(b);
      d = nesterov ? d + mu * b : b;
    }
    const float next = static_cast<float>(wi - lr * d);
    w[i] = next;
    if constexpr (!std::is_void_v<C>) store(copy + i, next);
  }
}

// Whether a pack of W elements can be read at the output's index for this access: contiguous,
// or a trailing input (a bias) whose size is a multiple of W.
bool packs_whole(const Access& a, int w) { return a.mode == 0 || (a.mode == 1 && a.modulus % w == 0); }

template <class T>
cudaError_t binary_t(Binary op, const T* a, const T* b, T* c, const Indexing& ix, long long n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const Access aa = access_of(ix, ix.a), ab = access_of(ix, ix.b);
  constexpr int w = vec::width<T>;
  if (n % w == 0 && packs_whole(aa, w) && packs_whole(ab, w) && vec::aligned16(a) && vec::aligned16(b) &&
      vec::aligned16(c)) {
    binary_packed_kernel<<<blocks_for(n / w), threads, 0, s>>>(static_cast<int>(op), elem::dev(a), elem::dev(b),
                                                               elem::dev(c), n / w, aa, ab);
  } else {
    binary_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), elem::dev(a), elem::dev(b), elem::dev(c), ix,
                                                    n, aa, ab);
  }
  return cudaGetLastError();
}

template <class T>
cudaError_t unary_t(Unary op, const T* x, T* y, long long n, float param, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  constexpr int w = vec::width<T>;
  if (n % w == 0 && vec::aligned16(x) && vec::aligned16(y)) {
    unary_packed_kernel<<<blocks_for(n / w), threads, 0, s>>>(static_cast<int>(op), elem::dev(x), elem::dev(y), n / w,
                                                              param);
  } else {
    unary_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), elem::dev(x), elem::dev(y), n, param);
  }
  return cudaGetLastError();
}

template <class T>
cudaError_t unary_grad_t(UnaryGrad op, const T* x, const T* dy, T* dx, long long n, cudaStream_t s, float param) {
  if (n == 0) return cudaSuccess;
  constexpr int w = vec::width<T>;
  if (n % w == 0 && vec::aligned16(x) && vec::aligned16(dy) && vec::aligned16(dx)) {
    unary_grad_packed_kernel<<<blocks_for(n / w), threads, 0, s>>>(static_cast<int>(op), elem::dev(x), elem::dev(dy),
                                                                   elem::dev(dx), n / w, param);
  } else {
    unary_grad_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), elem::dev(x), elem::dev(dy),
                                                        elem::dev(dx), n, param);
  }
  return cudaGetLastError();
}

template <class T>
cudaError_t fill_t(T* y, long long n, float value, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  fill_kernel<<<blocks_for(n), threads, 0, s>>>(elem::dev(y), n, value);
  return cudaGetLastError();
}

template <class E>
cudaError_t gather_t(const void* x, void* y, const Indexing& ix, long long n, cudaStream_t s) {
  gather_kernel<E><<<blocks_for(n), threads, 0, s>>>(static_cast<const E*>(x), static_cast<E*>(y), ix, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t binary(Binary op, const float* a, const float* b, float* c, const Indexing& ix, long long n,
                   cudaStream_t s) {
  return binary_t(op, a, b, c, ix, n, s);
}
cudaError_t binary(Binary op, const Bf16* a, const Bf16* b, Bf16* c, const Indexing& ix, long long n, cudaStream_t s) {
  return binary_t(op, a, b, c, ix, n, s);
}

cudaError_t unary(Unary op, const float* x, float* y, long long n, float param, cudaStream_t s) {
  return unary_t(op, x, y, n, param, s);
}
cudaError_t unary(Unary op, const Bf16* x, Bf16* y, long long n, float param, cudaStream_t s) {
  return unary_t(op, x, y, n, param, s);
}

cudaError_t unary_grad(UnaryGrad op, const float* x, const float* dy, float* dx, long long n, cudaStream_t s,
                       float param) {
  return unary_grad_t(op, x, dy, dx, n, s, param);
}
cudaError_t unary_grad(UnaryGrad op, const Bf16* x, const Bf16* dy, Bf16* dx, long long n, cudaStream_t s,
                       float param) {
  return unary_grad_t(op, x, dy, dx, n, s, param);
}

cudaError_t fill(float* y, long long n, float value, cudaStream_t s) { return fill_t(y, n, value, s); }
cudaError_t fill(Bf16* y, long long n, float value, cudaStream_t s) { return fill_t(y, n, value, s); }

cudaError_t gather(const float* x, float* y, const Indexing& ix, long long n, cudaStream_t s) {
  return gather_bytes(x, y, 4, ix, n, s);
}

namespace {

// The rows path of gather_bytes: the output's trailing axes that read the input contiguously
// (as access_of finds them) form rows of `run` elements; where a row is whole 16-byte packs and
// every leading axis's stride a multiple of it (so each row starts on a pack), fills `lead` with
// the leading axes (strides in packs) and returns the packs per row, else 0.
long long rows_of_packs(const Indexing& ix, int elem_bytes, const void* x, const void* y, Indexing& lead) {
  if (!vec::aligned16(x) || !vec::aligned16(y) || elem_bytes <= 0 || 16 % elem_bytes != 0) return 0;
  long long run = 1;
  int d = ix.ndim - 1;
  for (; d >= 0; --d) {
    if (ix.shape[d] != 1 && ix.a[d] != run) break;
    run *= ix.shape[d];
  }
  const long long per_pack = 16 / elem_bytes;
  if (run % per_pack != 0) return 0;
  lead = Indexing{};
  lead.ndim = d + 1;
  for (int e = 0; e <= d; ++e) {
    if (ix.a[e] % run != 0) return 0;
    lead.shape[e] = ix.shape[e];
    lead.a[e] = ix.a[e] / per_pack;
  }
  return run / per_pack;
}

}  // namespace

cudaError_t gather_bytes(const void* x, void* y, int elem_bytes, const Indexing& ix, long long n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  Indexing lead;
  if (const long long row_packs = rows_of_packs(ix, elem_bytes, x, y, lead); row_packs > 0) {
    const long long packs = n * elem_bytes / 16;
    gather_rows_kernel<<<blocks_for(packs), threads, 0, s>>>(static_cast<const uint4*>(x), static_cast<uint4*>(y), lead,
                                                             row_packs, packs);
    return cudaGetLastError();
  }
  switch (elem_bytes) {
    case 2: return gather_t<unsigned short>(x, y, ix, n, s);
    case 4: return gather_t<unsigned int>(x, y, ix, n, s);
    case 8: return gather_t<unsigned long long>(x, y, ix, n, s);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t adam(float* w, const float* g, float* m, float* v, long long n, const AdamConstants& k, WeightCopy copy,
                 cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (copy.data == nullptr) {
    adam_kernel<void><<<blocks_for(n), threads, 0, s>>>(w, g, m, v, nullptr, n, k);
  } else if (copy.bf16) {
    adam_kernel<<<blocks_for(n), threads, 0, s>>>(w, g, m, v, static_cast<__nv_bfloat16*>(copy.data), n, k);
  } else {
    adam_kernel<<<blocks_for(n), threads, 0, s>>>(w, g, m, v, static_cast<float*>(copy.data), n, k);
  }
  return cudaGetLastError();
}

cudaError_t sgd(float* w, const float* g, float* buf, long long n, double lr, double momentum, double weight_decay,
                bool nesterov, bool first, WeightCopy copy, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = blocks_for(n);
  if (copy.data == nullptr) {
    sgd_kernel<void><<<blocks, threads, 0, s>>>(w, g, buf, nullptr, n, lr, momentum, weight_decay, nesterov, first);
  } else if (copy.bf16) {
    sgd_kernel<<<blocks, threads, 0, s>>>(w, g, buf, static_cast<__nv_bfloat16*>(copy.data), n, lr, momentum,
                                          weight_decay, nesterov, first);
  } else {
    sgd_kernel<<<blocks, threads, 0, s>>>(w, g, buf, static_cast<float*>(copy.data), n, lr, momentum, weight_decay,
                                          nesterov, first);
  }
  return cudaGetLastError();
}

}  // namespace baton::cuda::launch
