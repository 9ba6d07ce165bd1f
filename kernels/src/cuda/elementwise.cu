// Elementwise CUDA kernels: broadcasting binary ops, activations and their gradients, fill,
// strided gathers (transpose, broadcast_to) and the optimizer steps. Grid-stride loops,
// one thread per element; these ops are memory-bound, so simple is fast enough.
#include <cmath>

#include "launch.h"

namespace baton::cuda::launch {
namespace {

constexpr int threads = 256;

unsigned blocks_for(long long n) {
  long long b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  // A grid-stride loop covers the rest; 65535 * 4 blocks keep every SM busy.
  return static_cast<unsigned>(b > 262140 ? 262140 : b);
}

__device__ void offsets(const Indexing& ix, long long i, long long& oa, long long& ob) {
  oa = 0;
  ob = 0;
  for (int d = ix.ndim - 1; d >= 0; --d) {
    const long long k = i % ix.shape[d];
    i /= ix.shape[d];
    oa += k * ix.a[d];
    ob += k * ix.b[d];
  }
}

__global__ void binary_kernel(int op, const float* a, const float* b, float* c, Indexing ix, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    long long oa, ob;
    offsets(ix, i, oa, ob);
    const float x = a[oa], y = b[ob];
    float r;
    switch (static_cast<Binary>(op)) {
      case Binary::add: r = x + y; break;
      case Binary::sub: r = x - y; break;
      case Binary::mul: r = x * y; break;
      case Binary::div: r = x / y; break;
      default: r = (isnan(x) || isnan(y)) ? NAN : (x > y ? x : y); break;
    }
    c[i] = r;
  }
}

__device__ float gelu(float x) { return static_cast<float>(0.5 * x * (1.0 + erf(x * 0.70710678118654752440))); }

__global__ void unary_kernel(int op, const float* x, float* y, long long n, float param) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const float v = x[i];
    float r;
    switch (static_cast<Unary>(op)) {
      // As the CPU's std::max(x, 0): a NaN stays NaN (torch.relu), -0 stays -0.
      case Unary::relu: r = v < 0.f ? 0.f : v; break;
      case Unary::gelu: r = gelu(v); break;
      case Unary::tanh: r = tanhf(v); break;
      case Unary::sigmoid: r = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(v)))); break;
      default: r = v * param; break;
    }
    y[i] = r;
  }
}

__global__ void unary_grad_kernel(int op, const float* x, const float* dy, float* dx, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const double v = x[i], g = dy[i];
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
      default: r = g * v * (1 - v); break;
    }
    dx[i] = static_cast<float>(r);
  }
}

__global__ void fill_kernel(float* y, long long n, float value) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    y[i] = value;
  }
}

__global__ void gather_kernel(const float* x, float* y, Indexing ix, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    long long oa, ob;
    offsets(ix, i, oa, ob);
    y[i] = x[oa];
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

}  // namespace

cudaError_t binary(Binary op, const float* a, const float* b, float* c, const Indexing& ix, long long n,
                   cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  binary_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), a, b, c, ix, n);
  return cudaGetLastError();
}

cudaError_t unary(Unary op, const float* x, float* y, long long n, float param, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  unary_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), x, y, n, param);
  return cudaGetLastError();
}

cudaError_t unary_grad(UnaryGrad op, const float* x, const float* dy, float* dx, long long n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  unary_grad_kernel<<<blocks_for(n), threads, 0, s>>>(static_cast<int>(op), x, dy, dx, n);
  return cudaGetLastError();
}

cudaError_t fill(float* y, long long n, float value, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  fill_kernel<<<blocks_for(n), threads, 0, s>>>(y, n, value);
  return cudaGetLastError();
}

cudaError_t gather(const float* x, float* y, const Indexing& ix, long long n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  gather_kernel<<<blocks_for(n), threads, 0, s>>>(x, y, ix, n);
  return cudaGetLastError();
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
