// Elementwise CUDA kernels: broadcasting binary ops, activations and their gradients, fill,
// strided gathers (transpose, broadcast_to) and the optimizer steps. Grid-stride loops,
// one thread per element; these ops are memory-bound, so simple is fast enough. The op kernels
// are templates over the element type: float32, and bfloat16 computed in float32 (elem.cuh).
#include <cmath>

#include "elem.cuh"
#include "launch.h"

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

template <class T>
__global__ void binary_kernel(int op, const T* a, const T* b, T* c, Indexing ix, long long n, Access aa, Access ab) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long oa = aa.mode == 0 ? i : aa.mode == 1 ? i % aa.modulus : strided_a(ix, i);
    const long long ob = ab.mode == 0 ? i : ab.mode == 1 ? i % ab.modulus : strided_b(ix, i);
    const float x = load(a + oa), y = load(b + ob);
    float r;
    switch (static_cast<Binary>(op)) {
      case Binary::add: r = x + y; break;
      case Binary::sub: r = x - y; break;
      case Binary::mul: r = x * y; break;
      case Binary::div: r = x / y; break;
      default: r = (isnan(x) || isnan(y)) ? NAN : (x > y ? x : y); break;
    }
    store(c + i, r);
  }
}

/// As ops_llm.cpp's: exp(-|x|) never overflows, and the two branches are one function.
__device__ float sigmoid_f(float x) {
  const float z = expf(-fabsf(x));
  const float r = 1.f / (1.f + z);
  return x >= 0.f ? r : z * r;
}

__device__ float gelu(float x) { return static_cast<float>(0.5 * x * (1.0 + erf(x * 0.70710678118654752440))); }

template <class T>
__global__ void unary_kernel(int op, const T* x, T* y, long long n, float param) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float v = load(x + i);
    float r;
    switch (static_cast<Unary>(op)) {
      // As the CPU's std::max(x, 0): a NaN stays NaN (torch.relu), -0 stays -0.
      case Unary::relu: r = v < 0.f ? 0.f : v; break;
      case Unary::gelu: r = gelu(v); break;
      case Unary::tanh: r = tanhf(v); break;
      case Unary::sigmoid: r = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(v)))); break;
      // The LLM ops in float, as the CPU's kernels (ops_llm.cpp) compute them in the element
      // type; CUDA's expf, logf and powf are within 2 ulp, sqrtf is exact.
      case Unary::exp: r = expf(v); break;
      case Unary::log: r = logf(v); break;
      case Unary::sqrt: r = sqrtf(v); break;
      case Unary::rsqrt: r = 1.f / sqrtf(v); break;
      case Unary::silu: r = v * sigmoid_f(v); break;
      case Unary::pow: r = powf(v, param); break;
      default: r = v * param; break;
    }
    store(y + i, r);
  }
}

template <class T>
__global__ void unary_grad_kernel(int op, const T* x, const T* dy, T* dx, long long n, float param) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const double v = load(x + i), g = load(dy + i);
    double r;
    switch (static_cast<UnaryGrad>(op)) {
      case UnaryGrad::relu: r = v > 0 ? g : 0; break;
      case UnaryGrad::gelu: {
        // d/dx x Phi(x) = Phi(x) + x phi(x)
        const double cdf = 0.5 * (1.0 + erf(v * 0.70710678118654752440));
        const double pdf = 0.39894228040143267794 * exp(-0.5 * v * v);
        r = g * (cdf + v * pdf);
        break;
      }
      case UnaryGrad::tanh: r = g * (1 - v * v); break;
      case UnaryGrad::sqrt: r = 0.5 * g / v; break;          // from y = sqrt(x)
      case UnaryGrad::rsqrt: r = -0.5 * g * v * v * v; break;  // from y = x^-1/2
      case UnaryGrad::silu: {
        const double sg = sigmoid_f(static_cast<float>(v));
        r = g * sg * (1 + v * (1 - sg));
        break;
      }
      case UnaryGrad::pow: r = g * param * pow(v, static_cast<double>(param) - 1); break;
      default: r = g * v * (1 - v); break;
    }
    elem::store_d(dx + i, r);
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

__global__ void adam_kernel(float* w, const float* g, float* m, float* v, long long n, AdamConstants k) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float gi = g[i] + k.l2 * w[i];
    const float mi = k.b1 * m[i] + k.one_minus_b1 * gi;
    const float vi = k.b2 * v[i] + k.one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    // No fused multiply-adds: the CPU's loop rounds each operation, and so do we.
    w[i] = __fsub_rn(__fmul_rn(w[i], k.decay),
                     __fdiv_rn(__fmul_rn(k.step_size, mi), __fadd_rn(__fmul_rn(sqrtf(vi), k.inv_bc2_sqrt), k.eps)));
  }
}

__global__ void sgd_kernel(float* w, const float* g, float* buf, long long n, double lr, double mu, double wd,
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
    w[i] = static_cast<float>(wi - lr * d);
  }
}

template <class T>
cudaError_t binary_t(Binary op, const T* a, const T* b, T* c, const Indexing& ix, long long n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  binary_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), elem::dev(a), elem::dev(b), elem::dev(c), ix, n,
                                                  access_of(ix, ix.a), access_of(ix, ix.b));
  return cudaGetLastError();
}

template <class T>
cudaError_t unary_t(Unary op, const T* x, T* y, long long n, float param, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  unary_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), elem::dev(x), elem::dev(y), n, param);
  return cudaGetLastError();
}

template <class T>
cudaError_t unary_grad_t(UnaryGrad op, const T* x, const T* dy, T* dx, long long n, cudaStream_t s, float param) {
  if (n == 0) return cudaSuccess;
  unary_grad_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), elem::dev(x), elem::dev(dy), elem::dev(dx),
                                                      n, param);
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

cudaError_t gather_bytes(const void* x, void* y, int elem_bytes, const Indexing& ix, long long n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  switch (elem_bytes) {
    case 2: return gather_t<unsigned short>(x, y, ix, n, s);
    case 4: return gather_t<unsigned int>(x, y, ix, n, s);
    case 8: return gather_t<unsigned long long>(x, y, ix, n, s);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t adam(float* w, const float* g, float* m, float* v, long long n, const AdamConstants& k, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  adam_kernel<<<blocks_for(n), threads, 0, s>>>(w, g, m, v, n, k);
  return cudaGetLastError();
}

cudaError_t sgd(float* w, const float* g, float* buf, long long n, double lr, double momentum, double weight_decay,
                bool nesterov, bool first, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  sgd_kernel<<<blocks_for(n), threads, 0, s>>>(w, g, buf, n, lr, momentum, weight_decay, nesterov, first);
  return cudaGetLastError();
}

}  // namespace baton::cuda::launch
