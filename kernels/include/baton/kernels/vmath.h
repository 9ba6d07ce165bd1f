#pragma once
// Vectorised float32 math for the CPU kernels: GELU and its gradient (ops_nn.cpp's gelu,
// gelu_grad, bias_gelu, bias_gelu_grad) and exp (softmax, log-softmax and the cross-entropy's
// rows). A scalar erfc per element made GELU a fifth of the CPU GPT's step (68 of 344 ms at
// d 256, T 128, batch 8).
//
// exp is SLEEF's (Debian's libsleef, 1 ulp): its "cinz" functions (no FMA) are one function in
// every vector width, so the results depend neither on the machine's vector unit (AVX: 8 lanes,
// else SSE2: 4; every x86-64 has SSE2) nor on where an element falls in a tensor (a
// tensor-parallel shard computes its elements as the whole tensor would). erfc is a Chebyshev
// fit around that exp (relative error below 1.2e-7; SLEEF's own erfc was barely faster than the
// C library's). The rest is the scalar formula's float operations in its order:
// y = 0.5 x erfc(-x / sqrt 2); dx = dy (0.5 erfc(-x / sqrt 2) + x e^(-x^2 / 2) / sqrt(2 pi)).
// Without SLEEF (another architecture) the scalar formula runs, with std::erfc and std::exp.
#include <cstddef>

namespace baton::vmath {

/// y[i] = gelu(x[i] + b[i % cols]), or gelu(x[i]) where b is null. y may be x (in place).
void gelu(const float* x, const float* b, std::size_t cols, float* y, std::size_t n);

/// dx[i] = gelu'(x[i] + b[i % cols]) dy[i] (b null: gelu'(x[i]) dy[i]). dx may be x or dy.
void gelu_grad(const float* x, const float* b, std::size_t cols, const float* dy, float* dx, std::size_t n);

/// y[i] = exp(x[i] - shift) (softmax's and the cross-entropy's rows: shift is the row's
/// maximum). SLEEF's exp (1 ulp), the same bits on every path that has it; the C library's
/// std::exp on the scalar path. y may be x.
void exp_shifted(const float* x, float shift, float* y, std::size_t n);

/// Which code runs here: "avx" (8 lanes), "sse2" (4 lanes) or "scalar" (built without SLEEF),
/// the best this machine has unless the environment's BATON_VMATH names another (to compare
/// them in a benchmark; one this machine or build lacks makes the first GELU throw, naming it).
const char* path();

/// For the tests: the same functions on a path of the caller's choice ("avx", "sse2", or
/// "scalar": the formula with the C library's erfc and exp, as built without SLEEF); false
/// where this machine or build has no such path.
bool gelu_on(const char* path, const float* x, const float* b, std::size_t cols, float* y, std::size_t n);
bool gelu_grad_on(const char* path, const float* x, const float* b, std::size_t cols, const float* dy, float* dx,
                  std::size_t n);
bool exp_shifted_on(const char* path, const float* x, float shift, float* y, std::size_t n);

}  // namespace baton::vmath
