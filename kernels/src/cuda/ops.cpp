// The CUDA kernels of the training ops (baton/kernels/ops.h), float32 (the ops that move
// bytes, dropout and the reductions also float64), registered for DeviceType::cuda (the
// all-reduce's: collectives.cpp). The elementwise, row-wise and byte-moving ops also have
// native bfloat16 kernels (bf16 in and out, float32 math inside: launch.h's Bf16), so that
// KernelRegistry does not run them through float32 copies; the fused ops (bias + GELU,
// attention) and the multi-tensor optimizer steps are in fused.cpp. Each checks shapes on the host, then only enqueues work on
// its actor's stream (KernelContext::stream); nothing here waits for the device. Every launch
// is checked and a failure names the op, the actor and the CUDA error.
#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../kernel_args.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/optim.h"
#include "baton/kernels/tensor.h"
#include "common.h"
#include "fused.h"
#include "kernel_util.h"
#include "launch.h"

namespace baton::cuda {

namespace {

using detail::need_input;
using detail::need_output;
using launch::Indexing;
using util::at_elem;
using util::check_same_dtype;
using util::launched;
using util::Scratch;
using util::stream_of;

const float* in_f32(const Tensor& t, const char* op, const char* role) {
  if (t.dtype() != DType::f32) throw std::invalid_argument(fmt::format("{}: {} is {}, expected f32", op, role, t.describe()));
  return static_cast<const float*>(t.raw());
}
float* out_f32(Tensor& t, const char* op, const char* role) {
  if (t.dtype() != DType::f32) throw std::invalid_argument(fmt::format("{}: {} is {}, expected f32", op, role, t.describe()));
  return static_cast<float*>(t.raw());
}
// The element types of the float kernels: float32 and bfloat16 (launch::Bf16).
template <class E>
constexpr DType dtype_for() {
  return std::is_same_v<E, launch::Bf16> ? DType::bf16 : DType::f32;
}
template <class E>
const E* in_as(const Tensor& t, const char* op, const char* role) {
  if (t.dtype() != dtype_for<E>()) {
    throw std::invalid_argument(fmt::format("{}: {} is {}, expected {}", op, role, t.describe(), name(dtype_for<E>())));
  }
  return static_cast<const E*>(t.raw());
}
template <class E>
E* out_as(Tensor& t, const char* op, const char* role) {
  if (t.dtype() != dtype_for<E>()) {
    throw std::invalid_argument(fmt::format("{}: {} is {}, expected {}", op, role, t.describe(), name(dtype_for<E>())));
  }
  return static_cast<E*>(t.raw());
}

const int* in_i32(const Tensor& t, const char* op, const char* role) {
  if (t.dtype() != DType::i32) throw std::invalid_argument(fmt::format("{}: {} is {}, expected i32", op, role, t.describe()));
  return static_cast<const int*>(t.raw());
}

class FunctionKernelF final : public Kernel {
 public:
  explicit FunctionKernelF(std::function<void(KernelContext&)> fn) : fn_(std::move(fn)) {}
  void compute(KernelContext& ctx) override { fn_(ctx); }

 private:
  std::function<void(KernelContext&)> fn_;
};

std::vector<std::int64_t> strides_of(const Shape& s) {
  std::vector<std::int64_t> st(s.size(), 1);
  for (std::size_t i = s.size(); i-- > 1;) st[i - 1] = st[i] * s[i];
  return st;
}

// x's strides along the dims of `out` (aligned right, numpy rules): 0 where x is broadcast.
void broadcast_strides(const Shape& x, const Shape& out, long long* dst, const char* op, const char* role) {
  const auto st = strides_of(x);
  // More axes than the output: `lead` below would wrap and every stride read as broadcast.
  if (x.size() > out.size()) {
    throw std::invalid_argument(fmt::format("{}: {} of shape {} does not broadcast to {}", op, role, to_string(x), to_string(out)));
  }
  const std::size_t lead = out.size() - x.size();
  for (std::size_t d = 0; d < out.size(); ++d) {
    if (d < lead) {
      dst[d] = 0;
      continue;
    }
    const std::int64_t xd = x[d - lead];
    if (xd != out[d] && xd != 1) {
      throw std::invalid_argument(fmt::format("{}: {} of shape {} does not broadcast to {}", op, role, to_string(x), to_string(out)));
    }
    dst[d] = xd == out[d] ? st[d - lead] : 0;
  }
}

Indexing indexing_for(const Shape& out, const char* op) {
  if (out.size() > static_cast<std::size_t>(launch::max_dims)) {
    throw std::invalid_argument(fmt::format("{}: {} has more than {} axes", op, to_string(out), launch::max_dims));
  }
  Indexing ix;
  ix.ndim = static_cast<int>(out.size());
  for (std::size_t d = 0; d < out.size(); ++d) ix.shape[d] = out[d];
  return ix;
}

void check_same_numel(const Tensor& a, const Tensor& b, const char* op) {
  if (a.numel() != b.numel()) {
    throw std::invalid_argument(fmt::format("{}: {} and {} differ in size", op, a.describe(), b.describe()));
  }
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* op) {
  if (a.shape() != b.shape()) {
    throw std::invalid_argument(fmt::format("{}: {} and {} differ in shape", op, a.describe(), b.describe()));
  }
}

std::pair<long long, long long> rows_cols(const Tensor& x, const char* op) {
  if (x.shape().empty()) throw std::invalid_argument(fmt::format("{}: needs at least one axis, got {}", op, x.describe()));
  const long long cols = x.shape().back();
  return {cols == 0 ? 0 : x.numel() / cols, cols};
}


// c = a (op) b with numpy broadcasting.
template <class E>
void binary(KernelContext& ctx, launch::Binary op, const char* name) {
  const Tensor& a = need_input(ctx, 0, name, "a");
  const Tensor& b = need_input(ctx, 1, name, "b");
  Tensor& c = need_output(ctx, 0, name, "c");
  Indexing ix = indexing_for(c.shape(), name);
  broadcast_strides(a.shape(), c.shape(), ix.a, name, "a");
  broadcast_strides(b.shape(), c.shape(), ix.b, name, "b");
  launched(launch::binary(op, in_as<E>(a, name, "a"), in_as<E>(b, name, "b"), out_as<E>(c, name, "c"), ix, c.numel(),
                          stream_of(ctx, name)),
           name, ctx);
}

template <class E>
void unary(KernelContext& ctx, launch::Unary op, const char* name, float param = 0) {
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  check_same_numel(x, y, name);
  launched(launch::unary(op, in_as<E>(x, name, "x"), out_as<E>(y, name, "y"), y.numel(), param, stream_of(ctx, name)),
           name, ctx);
}

template <class E>
void unary_grad(KernelContext& ctx, launch::UnaryGrad op, const char* name, float param = 0) {
  const Tensor& x = need_input(ctx, 0, name, "x");
  const Tensor& dy = need_input(ctx, 1, name, "dy");
  Tensor& dx = need_output(ctx, 0, name, "dx");
  check_same_shape(x, dy, name);
  check_same_shape(x, dx, name);
  launched(launch::unary_grad(op, in_as<E>(x, name, "x"), in_as<E>(dy, name, "dy"), out_as<E>(dx, name, "dx"),
                              dx.numel(), stream_of(ctx, name), param),
           name, ctx);
}

void copy_kernel(KernelContext& ctx, const char* name) {
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  if (x.nbytes() != y.nbytes()) {
    throw std::invalid_argument(fmt::format("{}: {} and {} differ in size", name, x.describe(), y.describe()));
  }
  stream_of(ctx, name);
  copy(y, x, *ctx.stream);
}

void broadcast_to(KernelContext& ctx) {
  const char* name = "broadcast_to";
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  if (x.shape().size() > y.shape().size()) {
    throw std::invalid_argument(fmt::format("broadcast_to: x {} has more axes than y {}", x.describe(), y.describe()));
  }
  check_same_dtype(x, y, name);
  Indexing ix = indexing_for(y.shape(), name);
  broadcast_strides(x.shape(), y.shape(), ix.a, name, "x");
  launched(launch::gather_bytes(x.raw(), y.raw(), static_cast<int>(size_of(y.dtype())), ix, y.numel(),
                                stream_of(ctx, name)),
           name, ctx);
}

class TransposeKernel final : public Kernel {
 public:
  explicit TransposeKernel(std::vector<std::int64_t> perm) : perm_(std::move(perm)) {}
  void compute(KernelContext& ctx) override {
    const char* name = "transpose";
    const Tensor& x = need_input(ctx, 0, name, "x");
    Tensor& y = need_output(ctx, 0, name, "y");
    const Shape& xs = x.shape();
    if (perm_.size() != xs.size() || y.shape().size() != xs.size()) {
      throw std::invalid_argument(fmt::format("transpose: perm of {} axes for x {} into y {}", perm_.size(), x.describe(), y.describe()));
    }
    const auto st = strides_of(xs);
    Indexing ix = indexing_for(y.shape(), name);
    for (std::size_t i = 0; i < perm_.size(); ++i) {
      const auto p = perm_[i];
      if (p < 0 || static_cast<std::size_t>(p) >= xs.size() || y.shape()[i] != xs[static_cast<std::size_t>(p)]) {
        throw std::invalid_argument(fmt::format("transpose: bad perm for x {} into y {}", x.describe(), y.describe()));
      }
      ix.a[i] = st[static_cast<std::size_t>(p)];
    }
    check_same_dtype(x, y, name);
    launched(launch::gather_bytes(x.raw(), y.raw(), static_cast<int>(size_of(y.dtype())), ix, y.numel(),
                                  stream_of(ctx, name)),
             name, ctx);
  }

 private:
  std::vector<std::int64_t> perm_;
};

// Row-major products through column-major cuBLAS: C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T, which reads both operands in place (no transposes are copied).
class MatmulKernel final : public Kernel {
 public:
  MatmulKernel(bool trans_a, bool trans_b) : trans_a_(trans_a), trans_b_(trans_b) {}
  void compute(KernelContext& ctx) override {
    const char* name = "matmul";
    const Tensor& a = need_input(ctx, 0, name, "a");
    const Tensor& b = need_input(ctx, 1, name, "b");
    Tensor& c = need_output(ctx, 0, name, "c");
    const baton::detail::MatmulDims dims = baton::detail::matmul_dims(a, b, c, trans_a_, trans_b_);
    const std::int64_t m = dims.m, k = dims.k, n = dims.n;
    const bool shared_b = dims.shared_b;
    std::int64_t batches = dims.batches;
    auto fail = [&](const std::string& why) {
      return std::invalid_argument(fmt::format("matmul (trans_a={}, trans_b={}): a {}, b {}, c {}: {}", int(trans_a_),
                                               int(trans_b_), a.describe(), b.describe(), c.describe(), why));
    };
    // One a shared b and an untransposed a: the batch is just more rows of one product.
    std::int64_t rows = m;
    if (shared_b && !trans_a_) {
      rows = batches * m;
      batches = 1;
    }
    for (std::int64_t d : {rows, n, k, batches}) {
      if (d > INT_MAX) throw fail("an extent exceeds cuBLAS's 32-bit int");
    }
    cudaStream_t s = stream_of(ctx, name);
    (void)s;
    const float alpha = 1.f, beta = 0.f;
    const int M = static_cast<int>(rows), N = static_cast<int>(n), K = static_cast<int>(k);
    if (M == 0 || N == 0) return;
    const bool bf16 = c.dtype() == DType::bf16;
    if (bf16 && (a.dtype() != DType::bf16 || b.dtype() != DType::bf16)) {
      throw fail("a bf16 product needs bf16 operands");
    }
    if (K == 0) {
      if (bf16) {
        check(cudaMemsetAsync(c.raw(), 0, c.nbytes(), s), "cudaMemsetAsync", ctx.stream->owner());  // bf16 zero: all bits 0
      } else {
        launched(launch::fill(out_f32(c, name, "c"), c.numel(), 0.f, s), name, ctx);
      }
      return;
    }
    const cublasOperation_t op_b = trans_b_ ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = trans_a_ ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int ldb = trans_b_ ? K : N;
    const int lda = trans_a_ ? M : K;
    const long long stride_a = static_cast<long long>(M) * K;
    const long long stride_b = shared_b ? 0 : static_cast<long long>(K) * N;
    const long long stride_c = static_cast<long long>(M) * N;
    if (bf16) {
      // Tensor cores: bf16 operands and result, float32 accumulation (as torch's bf16 matmul).
      check(cublasGemmStridedBatchedEx(ctx.stream->impl().blas, op_b, op_a, N, M, K, &alpha, b.raw(), CUDA_R_16BF, ldb,
                                       stride_b, a.raw(), CUDA_R_16BF, lda, stride_a, &beta, c.raw(), CUDA_R_16BF, N,
                                       stride_c, static_cast<int>(batches), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmStridedBatchedEx", ctx.stream->owner());
      return;
    }
    check(cublasSgemmStridedBatched(ctx.stream->impl().blas, op_b, op_a, N, M, K, &alpha, in_f32(b, name, "b"), ldb,
                                    stride_b, in_f32(a, name, "a"), lda, stride_a, &beta, out_f32(c, name, "c"), N,
                                    stride_c, static_cast<int>(batches)),
          "cublasSgemmStridedBatched", ctx.stream->owner());
  }

 private:
  bool trans_a_, trans_b_;
};

template <class E>
void softmax(KernelContext& ctx, bool log, const char* name) {
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  check_same_shape(x, y, name);
  auto [rows, cols] = rows_cols(x, name);
  launched(launch::softmax(in_as<E>(x, name, "x"), out_as<E>(y, name, "y"), rows, cols, log, stream_of(ctx, name)), name,
           ctx);
}

template <class E>
void softmax_grad(KernelContext& ctx, bool log, const char* name) {
  const Tensor& y = need_input(ctx, 0, name, "y");
  const Tensor& dy = need_input(ctx, 1, name, "dy");
  Tensor& dx = need_output(ctx, 0, name, "dx");
  check_same_shape(y, dy, name);
  check_same_shape(y, dx, name);
  auto [rows, cols] = rows_cols(y, name);
  launched(launch::softmax_grad(in_as<E>(y, name, "y"), in_as<E>(dy, name, "dy"), out_as<E>(dx, name, "dx"), rows, cols,
                                log, stream_of(ctx, name)),
           name, ctx);
}

void check_logits_labels(const Tensor& logits, const Tensor& labels, const char* name) {
  if (logits.shape().size() != 2 || labels.shape().size() != 1 || labels.dim(0) != logits.dim(0)) {
    throw std::invalid_argument(fmt::format("{}: logits {} must be [N, C] and labels {} [N]", name, logits.describe(), labels.describe()));
  }
}

// A label outside [0, C) cannot throw from the device: its row's loss and gradient are NaN.
class CrossEntropyKernel final : public Kernel {
 public:
  void compute(KernelContext& ctx) override {
    const char* name = "softmax_cross_entropy";
    const Tensor& logits = need_input(ctx, 0, name, "logits");
    const Tensor& labels = need_input(ctx, 1, name, "labels");
    Tensor& loss = need_output(ctx, 0, name, "loss");
    check_logits_labels(logits, labels, name);
    if (loss.numel() != 1) throw std::invalid_argument(fmt::format("{}: loss {} must be a scalar", name, loss.describe()));
    cudaStream_t s = stream_of(ctx, name);
    const long long rows = logits.dim(0);
    auto* parts = static_cast<double*>(scratch_.get(static_cast<std::size_t>(rows) * sizeof(double), ctx));
    launched(launch::cross_entropy(in_f32(logits, name, "logits"), in_i32(labels, name, "labels"), out_f32(loss, name, "loss"),
                                   parts, rows, logits.dim(1), s),
             name, ctx);
  }

 private:
  util::Scratch scratch_;  // the rows' losses, summed in a fixed order
};

void cross_entropy_grad(KernelContext& ctx) {
  const char* name = "softmax_cross_entropy_grad";
  const Tensor& logits = need_input(ctx, 0, name, "logits");
  const Tensor& labels = need_input(ctx, 1, name, "labels");
  const Tensor& dloss = need_input(ctx, 2, name, "dloss");
  Tensor& dlogits = need_output(ctx, 0, name, "dlogits");
  check_logits_labels(logits, labels, name);
  check_same_shape(logits, dlogits, name);
  if (dloss.numel() != 1) throw std::invalid_argument(fmt::format("{}: dloss {} must be a scalar", name, dloss.describe()));
  launched(launch::cross_entropy_grad(in_f32(logits, name, "logits"), in_i32(labels, name, "labels"),
                                      in_f32(dloss, name, "dloss"), out_f32(dlogits, name, "dlogits"), logits.dim(0),
                                      logits.dim(1), stream_of(ctx, name)),
           name, ctx);
}

double read_eps(const KernelConfig& cfg) { return cfg.attrs.get_double("eps", 1e-5); }

void check_table(const Tensor& table, const Tensor& ids, const Tensor& y, const char* name) {
  if (table.shape().size() != 2) throw std::invalid_argument(fmt::format("{}: table {} must be [V, D]", name, table.describe()));
  Shape want = ids.shape();
  want.push_back(table.dim(1));
  if (y.shape() != want) {
    throw std::invalid_argument(fmt::format("{}: ids {} and table {} give rows of {}, not {}", name, ids.describe(),
                                            table.describe(), to_string(want), y.describe()));
  }
}

// ---- dropout ---------------------------------------------------------------------------------

// The CPU's mask (ops_nn.cpp) element for element: the same threshold and scale, made here in
// double exactly as there, and the same counter-based hash on the device.
template <class T>
class DropoutKernel final : public Kernel {
 public:
  DropoutKernel(double p, std::int64_t seed)
      : seed_(seed),
        threshold_(static_cast<unsigned long long>(std::ceil(p * 9007199254740992.0))),
        scale_(p < 1.0 ? static_cast<T>(1.0 / (1.0 - p)) : T(0)) {}
  void compute(KernelContext& ctx) override {
    const char* name = "dropout";
    const Tensor& x = need_input(ctx, 0, name, "x");
    Tensor& y = need_output(ctx, 0, name, "y");
    check_same_shape(x, y, name);
    if (x.dtype() != dtype_of<T>() || y.dtype() != dtype_of<T>()) {
      throw std::invalid_argument(fmt::format("dropout: x {} and y {} must be {}", x.describe(), y.describe(), baton::name(dtype_of<T>())));
    }
    launched(launch::dropout(static_cast<const T*>(x.raw()), static_cast<T*>(y.raw()), x.numel(), seed_, ctx.piece,
                             threshold_, scale_, stream_of(ctx, name)),
             name, ctx);
  }

 private:
  std::int64_t seed_;
  unsigned long long threshold_;
  T scale_;
};

// ---- slices and concatenation (any element type: they move bytes) ---------------------------

using baton::detail::normalise_axis;
using baton::detail::product;

// slice: y = x's window [start, start + y's extent) along the axis; slice_grad: dx = 0 but that
// window, which is dy. The same checks and words as the CPU kernel.
class SliceKernel final : public Kernel {
 public:
  SliceKernel(bool grad, std::int64_t axis, std::int64_t start) : grad_(grad), axis_(axis), start_(start) {}
  void compute(KernelContext& ctx) override {
    const char* op = grad_ ? "slice_grad" : "slice";
    const Tensor& in = need_input(ctx, 0, op);
    Tensor& out = need_output(ctx, 0, op);
    check_same_dtype(in, out, op);
    const Tensor& whole = grad_ ? out : in;
    const Tensor& part = grad_ ? in : out;
    const Shape& ws = whole.shape();
    const Shape& ps = part.shape();
    auto fail = [&](const char* why) {
      return std::invalid_argument(fmt::format("{} (axis {}, start {}): {} {} and {} {}: {}", op, axis_, start_,
                                               grad_ ? "dx" : "x", whole.describe(), grad_ ? "dy" : "y",
                                               part.describe(), why));
    };
    if (ws.size() != ps.size() || ws.empty()) throw fail("ranks differ or are 0");
    const std::size_t ax = normalise_axis(axis_, ws.size(), op, whole);
    for (std::size_t i = 0; i < ws.size(); ++i) {
      if (i != ax && ws[i] != ps[i]) throw fail("extents differ off the axis");
    }
    if (start_ < 0 || start_ + ps[ax] > ws[ax]) throw fail("the window leaves the axis");
    const std::int64_t outer = product(ws, 0, ax);
    const std::int64_t inner = product(ws, ax + 1, ws.size());
    const std::int64_t whole_run = ws[ax] * inner;
    const std::int64_t part_run = ps[ax] * inner;
    const int elem = static_cast<int>(size_of(in.dtype()));
    cudaStream_t s = stream_of(ctx, op);
    if (grad_) {
      if (out.nbytes() > 0) launched(cudaMemsetAsync(out.raw(), 0, out.nbytes(), s), op, ctx);
      launched(launch::copy_runs(in.raw(), at_elem(out, start_ * inner), elem, outer, part_run, part_run, whole_run, s), op,
               ctx);
    } else {
      launched(launch::copy_runs(at_elem(in, start_ * inner), out.raw(), elem, outer, part_run, whole_run, part_run, s), op,
               ctx);
    }
  }

 private:
  bool grad_;
  std::int64_t axis_, start_;
};

class ConcatKernel final : public Kernel {
 public:
  explicit ConcatKernel(std::int64_t axis) : axis_(axis) {}
  void compute(KernelContext& ctx) override {
    const char* op = "concat";
    Tensor& y = need_output(ctx, 0, op);
    const Shape& ys = y.shape();
    for (std::size_t k = 0; k < ctx.inputs.size(); ++k) check_same_dtype(need_input(ctx, k, op), y, op);
    const baton::detail::ConcatDims d = baton::detail::concat_dims(ctx, y, axis_);
    const std::size_t ax = d.axis;
    const std::int64_t outer = d.outer, inner = d.inner;
    const int elem = static_cast<int>(size_of(y.dtype()));
    cudaStream_t s = stream_of(ctx, op);
    std::int64_t offset = 0;  // of the current input's window within a row of y
    for (const Tensor* x : ctx.inputs) {
      const std::int64_t run = x->shape()[ax] * inner;
      launched(launch::copy_runs(x->raw(), at_elem(y, offset), elem, outer, run, run, ys[ax] * inner, s), op, ctx);
      offset += run;
    }
  }

 private:
  std::int64_t axis_;
};

// ---- reductions over axes --------------------------------------------------------------------

// The index spaces of x reduced onto `kept` (x's shape with the reduced axes as 1, aligned
// right as in numpy): `out` walks kept's elements in row-major order (y's layout, with or
// without the reduced axes), `red` the reduced elements of each; returns red's size.
long long reduce_indexing(const Shape& xs, const Shape& kept, Indexing& out, Indexing& red, const char* op,
                          const Tensor& x, const Tensor& y) {
  if (kept.size() > xs.size()) {
    throw std::invalid_argument(fmt::format("{}: y {} has more axes than x {}", op, y.describe(), x.describe()));
  }
  const auto st = strides_of(xs);
  out = indexing_for(xs, op);
  red = Indexing{};
  long long n_red = 1;
  const std::size_t lead = xs.size() - kept.size();
  for (std::size_t d = 0; d < xs.size(); ++d) {
    const std::int64_t yd = d < lead ? 1 : kept[d - lead];
    if (yd != xs[d] && yd != 1) {
      throw std::invalid_argument(fmt::format("{}: y {} does not broadcast to x {}", op, y.describe(), x.describe()));
    }
    if (yd == xs[d]) {
      out.a[d] = st[d];
    } else {
      out.shape[d] = 1;
      out.a[d] = 0;
      red.shape[red.ndim] = xs[d];
      red.a[red.ndim] = st[d];
      ++red.ndim;
      n_red *= xs[d];
    }
  }
  return n_red;
}

// sum_to: x summed onto y's shape (which broadcasts to x's): a bias's gradient.
void sum_to(KernelContext& ctx) {
  const char* name = "sum_to";
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  check_same_dtype(x, y, name);
  Indexing out, red;
  const long long n_red = reduce_indexing(x.shape(), y.shape(), out, red, name, x, y);
  cudaStream_t s = stream_of(ctx, name);
  if (x.dtype() == DType::f64) {
    launched(launch::reduce(launch::Reduce::sum, static_cast<const double*>(x.raw()), static_cast<double*>(y.raw()), out,
                            y.numel(), red, n_red, 1.0, s),
             name, ctx);
  } else if (x.dtype() == DType::bf16) {
    launched(launch::reduce(launch::Reduce::sum, in_as<launch::Bf16>(x, name, "x"), out_as<launch::Bf16>(y, name, "y"),
                            out, y.numel(), red, n_red, 1.0, s),
             name, ctx);
  } else {
    launched(launch::reduce(launch::Reduce::sum, in_f32(x, name, "x"), out_f32(y, name, "y"), out, y.numel(), red, n_red,
                            1.0, s),
             name, ctx);
  }
}

// sum, mean and max over `axes` (all when empty), with or without keepdims, as the CPU's
// ReduceKernel: the same shape checks, double accumulation, a mean times 1 / count.
class ReduceKernel final : public Kernel {
 public:
  ReduceKernel(const char* op, std::vector<std::int64_t> axes, bool keepdims)
      : op_(op), axes_(std::move(axes)), keepdims_(keepdims) {}
  void compute(KernelContext& ctx) override {
    const Tensor& x = need_input(ctx, 0, op_, "x");
    Tensor& y = need_output(ctx, 0, op_, "y");
    const std::size_t rank = x.shape().size();
    std::vector<bool> reduced(rank, axes_.empty());
    for (std::int64_t a : axes_) {
      const std::size_t i = normalise_axis(a, rank, op_, x);
      if (reduced[i]) throw std::invalid_argument(fmt::format("{}: axis {} listed twice for {}", op_, a, x.describe()));
      reduced[i] = true;
    }
    Shape kept = x.shape(), dropped;
    for (std::size_t i = 0; i < rank; ++i) {
      if (reduced[i]) {
        kept[i] = 1;
      } else {
        dropped.push_back(x.shape()[i]);
      }
    }
    if (y.shape() != (keepdims_ ? kept : dropped)) {
      throw std::invalid_argument(fmt::format("{} (keepdims={}): x {} reduces to {}, not y {}", op_, int(keepdims_),
                                              x.describe(), to_string(keepdims_ ? kept : dropped), y.describe()));
    }
    Indexing out, red;
    const long long n_red = reduce_indexing(x.shape(), kept, out, red, op_, x, y);
    // numel(x) / numel(y) elements fall on each output (0 / 0 = NaN for a mean of nothing).
    const double count = y.numel() == 0 ? 1.0 : static_cast<double>(x.numel()) / static_cast<double>(y.numel());
    const double factor = std::string_view(op_) == "mean" ? 1.0 / count : 1.0;
    const auto mode = std::string_view(op_) == "max" ? launch::Reduce::max : launch::Reduce::sum;
    check_same_dtype(x, y, op_);
    cudaStream_t s = stream_of(ctx, op_);
    if (x.dtype() == DType::f64) {
      launched(launch::reduce(mode, static_cast<const double*>(x.raw()), static_cast<double*>(y.raw()), out, y.numel(),
                              red, n_red, factor, s),
               op_, ctx);
    } else {
      launched(launch::reduce(mode, in_f32(x, op_, "x"), out_f32(y, op_, "y"), out, y.numel(), red, n_red, factor, s),
               op_, ctx);
    }
  }

 private:
  const char* op_;
  std::vector<std::int64_t> axes_;
  bool keepdims_;
};

std::vector<std::int64_t> int_list_or_empty(const KernelConfig& cfg, const char* op, const char* name) {
  auto it = cfg.attrs.values().find(name);
  if (it == cfg.attrs.values().end()) return {};
  if (const auto* v = std::get_if<std::vector<std::int64_t>>(&it->second)) return *v;
  throw std::invalid_argument(fmt::format("{} (actor '{}'): attribute '{}' is not an int list", op, cfg.actor, name));
}

bool flag(const KernelConfig& cfg, const char* op, const char* name) {
  const auto v = cfg.attrs.get_int(name, 0);
  if (v != 0 && v != 1) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): attribute '{}' must be 0 or 1, not {}", op, cfg.actor, name, v));
  }
  return v == 1;
}

std::int64_t required_int(const KernelConfig& cfg, const char* op, const char* name) {
  if (!cfg.attrs.has(name)) throw std::invalid_argument(fmt::format("{} (actor '{}') needs an integer attribute '{}'", op, cfg.actor, name));
  return cfg.attrs.get_int(name, 0);
}

// ---- losses ----------------------------------------------------------------------------------

void check_scalar(const Tensor& t, const char* op, const char* role) {
  if (!t.shape().empty()) throw std::invalid_argument(fmt::format("{}: {} must be a scalar [], got {}", op, role, t.describe()));
}

class MseKernel final : public Kernel {
 public:
  void compute(KernelContext& ctx) override {
    const char* name = "mse";
    const Tensor& pred = need_input(ctx, 0, name, "pred");
    const Tensor& target = need_input(ctx, 1, name, "target");
    Tensor& loss = need_output(ctx, 0, name, "loss");
    check_same_shape(pred, target, name);
    check_scalar(loss, name, "loss");
    cudaStream_t s = stream_of(ctx, name);
    auto* partial = static_cast<double*>(scratch_.get(launch::mean_parts * sizeof(double), ctx));
    launched(launch::mse(in_f32(pred, name, "pred"), in_f32(target, name, "target"), out_f32(loss, name, "loss"), partial,
                         pred.numel(), s),
             name, ctx);
  }

 private:
  Scratch scratch_;
};

void mse_grad(KernelContext& ctx) {
  const char* name = "mse_grad";
  const Tensor& pred = need_input(ctx, 0, name, "pred");
  const Tensor& target = need_input(ctx, 1, name, "target");
  const Tensor& dloss = need_input(ctx, 2, name, "dloss");
  Tensor& dpred = need_output(ctx, 0, name, "dpred");
  check_same_shape(pred, target, name);
  check_same_shape(pred, dpred, name);
  check_scalar(dloss, name, "dloss");
  launched(launch::mse_grad(in_f32(pred, name, "pred"), in_f32(target, name, "target"), in_f32(dloss, name, "dloss"),
                            out_f32(dpred, name, "dpred"), pred.numel(), stream_of(ctx, name)),
           name, ctx);
}

// ---- vocabulary shards -----------------------------------------------------------------------

// The entries [start, start + n) of a vocabulary [0, vocab) a table or logits hold; unsharded
// (no attributes): the tensor's own entries. Read and checked as the CPU's VocabRange.
struct VocabRange {
  std::int64_t start = 0;
  std::int64_t vocab = -1;  // -1: the tensor's own entries
  static VocabRange read(const KernelConfig& cfg, const char* op) {
    VocabRange r;
    r.start = cfg.attrs.get_int("vocab_start", 0);
    r.vocab = cfg.attrs.get_int("vocab", -1);
    if (cfg.attrs.has("vocab_start") != cfg.attrs.has("vocab") || (r.vocab >= 0 && (r.start < 0 || r.vocab < 1))) {
      throw std::invalid_argument(fmt::format(
          "{} (actor '{}'): a shard of a vocabulary needs both attributes vocab >= 1 and vocab_start >= 0, got {}", op,
          cfg.actor, cfg.attrs.str()));
    }
    return r;
  }
  // Checks that `entries` fit; returns the size of the whole vocabulary.
  std::int64_t check(const char* op, std::int64_t entries, const Tensor& t, const char* role) const {
    if (vocab < 0) return entries;
    if (start + entries > vocab) {
      throw std::invalid_argument(fmt::format("{}: {} {} holds entries [{}, {}) of a vocabulary of only {}", op, role,
                                              t.describe(), start, start + entries, vocab));
    }
    return vocab;
  }
};

void check_per_row(const Tensor& logits, const Tensor& per_row, const char* op, const char* role, std::int64_t cols) {
  const Shape want = cols == 0 ? Shape{logits.dim(0)} : Shape{logits.dim(0), cols};
  if (per_row.shape() != want) {
    throw std::invalid_argument(fmt::format("{}: {} {} must be {} for logits {}", op, role, per_row.describe(),
                                            to_string(want), logits.describe()));
  }
}

// A label outside the vocabulary cannot throw from the device: its row's stats are NaN.
class VocabCeStatsKernel final : public Kernel {
 public:
  VocabCeStatsKernel(VocabRange range, bool grad) : range_(range), grad_(grad) {}
  void compute(KernelContext& ctx) override {
    const char* name = grad_ ? "vocab_parallel_ce_stats_grad" : "vocab_parallel_ce_stats";
    const Tensor& logits = need_input(ctx, 0, name, "logits");
    const Tensor& labels = need_input(ctx, 1, name, "labels");
    const Tensor& row_max = need_input(ctx, 2, name, "row_max");
    check_logits_labels(logits, labels, name);
    check_per_row(logits, row_max, name, "row_max", 0);
    const std::int64_t vocab = range_.check(name, logits.dim(1), logits, "logits");
    cudaStream_t s = stream_of(ctx, name);
    if (!grad_) {
      Tensor& stats = need_output(ctx, 0, name, "stats");
      check_per_row(logits, stats, name, "stats", 2);
      launched(launch::vocab_ce_stats(in_f32(logits, name, "logits"), in_i32(labels, name, "labels"),
                                      in_f32(row_max, name, "row_max"), out_f32(stats, name, "stats"), logits.dim(0),
                                      logits.dim(1), range_.start, vocab, s),
               name, ctx);
      return;
    }
    const Tensor& dstats = need_input(ctx, 3, name, "dstats");
    Tensor& dlogits = need_output(ctx, 0, name, "dlogits");
    check_per_row(logits, dstats, name, "dstats", 2);
    check_same_shape(logits, dlogits, name);
    launched(launch::vocab_ce_stats_grad(in_f32(logits, name, "logits"), in_i32(labels, name, "labels"),
                                         in_f32(row_max, name, "row_max"), in_f32(dstats, name, "dstats"),
                                         out_f32(dlogits, name, "dlogits"), logits.dim(0), logits.dim(1), range_.start,
                                         vocab, s),
             name, ctx);
  }

 private:
  VocabRange range_;
  bool grad_;
};

class VocabCeLossKernel final : public Kernel {
 public:
  void compute(KernelContext& ctx) override {
    const char* name = "vocab_parallel_ce_loss";
    const Tensor& stats = need_input(ctx, 0, name, "stats");
    const Tensor& row_max = need_input(ctx, 1, name, "row_max");
    Tensor& loss = need_output(ctx, 0, name, "loss");
    if (stats.shape().size() != 2 || stats.dim(1) != 2 || row_max.shape() != Shape{stats.dim(0)}) {
      throw std::invalid_argument(fmt::format("{}: stats must be [N, 2] and row_max [N], got {} and {}", name,
                                              stats.describe(), row_max.describe()));
    }
    check_scalar(loss, name, "loss");
    cudaStream_t s = stream_of(ctx, name);
    auto* partial = static_cast<double*>(scratch_.get(launch::mean_parts * sizeof(double), ctx));
    launched(launch::vocab_ce_loss(in_f32(stats, name, "stats"), in_f32(row_max, name, "row_max"),
                                   out_f32(loss, name, "loss"), partial, stats.dim(0), s),
             name, ctx);
  }

 private:
  Scratch scratch_;
};

void vocab_ce_loss_grad(KernelContext& ctx) {
  const char* name = "vocab_parallel_ce_loss_grad";
  const Tensor& stats = need_input(ctx, 0, name, "stats");
  const Tensor& dloss = need_input(ctx, 1, name, "dloss");
  Tensor& dstats = need_output(ctx, 0, name, "dstats");
  if (stats.shape().size() != 2 || stats.dim(1) != 2) {
    throw std::invalid_argument(fmt::format("{}: stats must be [N, 2], got {}", name, stats.describe()));
  }
  check_scalar(dloss, name, "dloss");
  check_same_shape(stats, dstats, name);
  launched(launch::vocab_ce_loss_grad(in_f32(stats, name, "stats"), in_f32(dloss, name, "dloss"),
                                      out_f32(dstats, name, "dstats"), stats.dim(0), stream_of(ctx, name)),
           name, ctx);
}

// embedding / embedding_grad, whole or one shard of the vocabulary. An id outside the
// vocabulary cannot throw from the device: it gives a zero row and no gradient. The gradient
// sorts the positions by row instead of adding atomically, so it is the CPU's sum, bit for bit.
class EmbeddingKernel final : public Kernel {
 public:
  EmbeddingKernel(VocabRange range, bool grad) : range_(range), grad_(grad) {}
  void compute(KernelContext& ctx) override {
    const char* name = grad_ ? "embedding_grad" : "embedding";
    if (!grad_) {
      const Tensor& table = need_input(ctx, 0, name, "table");
      const Tensor& ids = need_input(ctx, 1, name, "ids");
      Tensor& y = need_output(ctx, 0, name, "y");
      check_table(table, ids, y, name);
      const std::int64_t vocab = range_.check(name, table.dim(0), table, "table");
      cudaStream_t s = stream_of(ctx, name);
      if (table.dtype() == DType::bf16) {
        launched(launch::embedding(in_as<launch::Bf16>(table, name, "table"), in_i32(ids, name, "ids"),
                                   out_as<launch::Bf16>(y, name, "y"), ids.numel(), table.dim(1), table.dim(0),
                                   range_.start, vocab, s),
                 name, ctx);
        return;
      }
      launched(launch::embedding(in_f32(table, name, "table"), in_i32(ids, name, "ids"), out_f32(y, name, "y"), ids.numel(),
                                 table.dim(1), table.dim(0), range_.start, vocab, s),
               name, ctx);
      return;
    }
    const Tensor& ids = need_input(ctx, 0, name, "ids");
    const Tensor& dy = need_input(ctx, 1, name, "dy");
    Tensor& dtable = need_output(ctx, 0, name, "dtable");
    check_table(dtable, ids, dy, name);
    const std::int64_t vocab = range_.check(name, dtable.dim(0), dtable, "dtable");
    if (ids.numel() > INT_MAX || dtable.dim(0) >= INT_MAX) {
      throw std::invalid_argument(fmt::format("{}: ids {} or dtable {} exceed the sort's 32-bit counts", name,
                                              ids.describe(), dtable.describe()));
    }
    cudaStream_t s = stream_of(ctx, name);
    const std::size_t bytes = launch::embedding_grad_scratch(ids.numel(), dtable.dim(0));
    void* scratch = scratch_.get(bytes, ctx);
    launched(launch::embedding_grad(in_i32(ids, name, "ids"), in_f32(dy, name, "dy"), out_f32(dtable, name, "dtable"),
                                    ids.numel(), dtable.dim(1), dtable.dim(0), range_.start, vocab, scratch, bytes, s),
             name, ctx);
  }

 private:
  VocabRange range_;
  bool grad_;
  Scratch scratch_;  // the sort's keys, positions and temporary storage
};

// The kernels of one float element type E (float32 or bfloat16): the elementwise and row-wise
// ops, whose bf16 kernels compute in float32 and round once.
template <class E>
void add_float_kernels(KernelRegistry& reg) {
  using launch::Binary;
  using launch::Unary;
  using launch::UnaryGrad;
  constexpr auto cuda = DeviceType::cuda;
  constexpr DType dt = dtype_for<E>();
  auto fn = [&reg](const char* op, std::function<void(KernelContext&)> f) { reg.add_fn(op, cuda, dt, std::move(f)); };
  fn("add", [](KernelContext& c) { binary<E>(c, Binary::add, "add"); });
  fn("sub", [](KernelContext& c) { binary<E>(c, Binary::sub, "sub"); });
  fn("mul", [](KernelContext& c) { binary<E>(c, Binary::mul, "mul"); });
  fn("div", [](KernelContext& c) { binary<E>(c, Binary::div, "div"); });
  fn("maximum", [](KernelContext& c) { binary<E>(c, Binary::maximum, "maximum"); });
  fn("relu", [](KernelContext& c) { unary<E>(c, Unary::relu, "relu"); });
  // GELU's form from the "approximate" attribute (erf, or tanh).
  reg.add("gelu", cuda, dt, [](const KernelConfig& cfg) {
    const Unary op = baton::detail::gelu_tanh(cfg, "gelu") ? Unary::gelu_tanh : Unary::gelu;
    return std::make_unique<FunctionKernelF>([op](KernelContext& c) { unary<E>(c, op, "gelu"); });
  });
  fn("tanh", [](KernelContext& c) { unary<E>(c, Unary::tanh, "tanh"); });
  fn("sigmoid", [](KernelContext& c) { unary<E>(c, Unary::sigmoid, "sigmoid"); });
  fn("relu_grad", [](KernelContext& c) { unary_grad<E>(c, UnaryGrad::relu, "relu_grad"); });
  reg.add("gelu_grad", cuda, dt, [](const KernelConfig& cfg) {
    const UnaryGrad op = baton::detail::gelu_tanh(cfg, "gelu_grad") ? UnaryGrad::gelu_tanh : UnaryGrad::gelu;
    return std::make_unique<FunctionKernelF>([op](KernelContext& c) { unary_grad<E>(c, op, "gelu_grad"); });
  });
  fn("tanh_grad", [](KernelContext& c) { unary_grad<E>(c, UnaryGrad::tanh, "tanh_grad"); });
  fn("sigmoid_grad", [](KernelContext& c) { unary_grad<E>(c, UnaryGrad::sigmoid, "sigmoid_grad"); });
  // The LLM ops' elementwise part (ops_llm.cpp has the CPU's).
  fn("exp", [](KernelContext& c) { unary<E>(c, Unary::exp, "exp"); });
  fn("log", [](KernelContext& c) { unary<E>(c, Unary::log, "log"); });
  fn("sqrt", [](KernelContext& c) { unary<E>(c, Unary::sqrt, "sqrt"); });
  fn("rsqrt", [](KernelContext& c) { unary<E>(c, Unary::rsqrt, "rsqrt"); });
  fn("silu", [](KernelContext& c) { unary<E>(c, Unary::silu, "silu"); });
  fn("sqrt_grad", [](KernelContext& c) { unary_grad<E>(c, UnaryGrad::sqrt, "sqrt_grad"); });
  fn("rsqrt_grad", [](KernelContext& c) { unary_grad<E>(c, UnaryGrad::rsqrt, "rsqrt_grad"); });
  fn("silu_grad", [](KernelContext& c) { unary_grad<E>(c, UnaryGrad::silu, "silu_grad"); });
  fn("softmax", [](KernelContext& c) { softmax<E>(c, false, "softmax"); });
  fn("log_softmax", [](KernelContext& c) { softmax<E>(c, true, "log_softmax"); });
  fn("softmax_grad", [](KernelContext& c) { softmax_grad<E>(c, false, "softmax_grad"); });
  fn("log_softmax_grad", [](KernelContext& c) { softmax_grad<E>(c, true, "log_softmax_grad"); });
  reg.add("scale", cuda, dt, [](const KernelConfig& cfg) {
    const auto value = static_cast<float>(cfg.attrs.get_double("value", std::nan("")));
    if (std::isnan(value)) throw std::invalid_argument(fmt::format("scale (actor '{}') needs a double attribute 'value'", cfg.actor));
    return std::make_unique<FunctionKernelF>([value](KernelContext& c) { unary<E>(c, Unary::scale, "scale", value); });
  });
  for (const char* op : {"pow", "pow_grad"}) {
    reg.add(op, cuda, dt, [op](const KernelConfig& cfg) {
      const double p = cfg.attrs.get_double("exponent", 1.0);
      if (!std::isfinite(p)) {
        throw std::invalid_argument(fmt::format("{} (actor '{}'): exponent {} is not finite", op, cfg.actor, p));
      }
      const auto e = static_cast<float>(p);
      const bool grad = std::string_view(op) == "pow_grad";
      return std::make_unique<FunctionKernelF>([e, grad](KernelContext& c) {
        if (grad) {
          unary_grad<E>(c, UnaryGrad::pow, "pow_grad", e);
        } else {
          unary<E>(c, Unary::pow, "pow", e);
        }
      });
    });
  }
  reg.add("fill", cuda, dt, [](const KernelConfig& cfg) {
    const auto value = static_cast<float>(cfg.attrs.get_double("value", std::nan("")));
    if (!cfg.attrs.has("value")) throw std::invalid_argument(fmt::format("fill (actor '{}') needs a double attribute 'value'", cfg.actor));
    return std::make_unique<FunctionKernelF>([value](KernelContext& c) {
      Tensor& y = need_output(c, 0, "fill", "y");
      launched(launch::fill(out_as<E>(y, "fill", "y"), y.numel(), value, stream_of(c, "fill")), "fill", c);
    });
  });
  reg.add("layer_norm", cuda, dt, [](const KernelConfig& cfg) {
    const double eps = read_eps(cfg);
    return std::make_unique<FunctionKernelF>([eps](KernelContext& c) {
      const char* name = "layer_norm";
      const Tensor& x = need_input(c, 0, name, "x");
      Tensor& y = need_output(c, 0, name, "y");
      check_same_shape(x, y, name);
      auto [rows, cols] = rows_cols(x, name);
      launched(launch::layer_norm(in_as<E>(x, name, "x"), out_as<E>(y, name, "y"), rows, cols, eps, stream_of(c, name)),
               name, c);
    });
  });
  reg.add("layer_norm_grad", cuda, dt, [](const KernelConfig& cfg) {
    const double eps = read_eps(cfg);
    return std::make_unique<FunctionKernelF>([eps](KernelContext& c) {
      const char* name = "layer_norm_grad";
      const Tensor& x = need_input(c, 0, name, "x");
      const Tensor& dy = need_input(c, 1, name, "dy");
      Tensor& dx = need_output(c, 0, name, "dx");
      check_same_shape(x, dy, name);
      check_same_shape(x, dx, name);
      auto [rows, cols] = rows_cols(x, name);
      launched(launch::layer_norm_grad(in_as<E>(x, name, "x"), in_as<E>(dy, name, "dy"), out_as<E>(dx, name, "dx"), rows,
                                       cols, eps, stream_of(c, name)),
               name, c);
    });
  });
  reg.add("causal_mask", cuda, dt, [](const KernelConfig& cfg) {
    const auto value = static_cast<float>(cfg.attrs.get_double("value", -std::numeric_limits<double>::infinity()));
    return std::make_unique<FunctionKernelF>([value](KernelContext& c) {
      const char* name = "causal_mask";
      const Tensor& x = need_input(c, 0, name, "x");
      Tensor& y = need_output(c, 0, name, "y");
      check_same_shape(x, y, name);
      const Shape& s = x.shape();
      if (s.size() < 2 || s[s.size() - 1] != s[s.size() - 2]) {
        throw std::invalid_argument(fmt::format("causal_mask: x {} must be [..., T, T]", x.describe()));
      }
      const long long t = s.back();
      launched(launch::causal_mask(in_as<E>(x, name, "x"), out_as<E>(y, name, "y"), t == 0 ? 0 : x.numel() / (t * t), t,
                                   value, stream_of(c, name)),
               name, c);
    });
  });
}

}  // namespace

void matmul_bias_grad_apart(KernelContext& ctx) {
  const auto [x, dy, dw, db, d] = baton::detail::linear_grad_args(ctx, "matmul_bias_grad");
  // The two ops as the plan had them before its fusion: the product of the 2-D views, then the sum.
  const Tensor x2 = x.view({d.rows, d.k}), dy2 = dy.view({d.rows, d.n});
  const Tensor* product_in[] = {&x2, &dy2};
  Tensor* product_out[] = {&dw};
  KernelContext product{product_in, product_out, ctx.piece, ctx.stream, ctx.async_stream};
  MatmulKernel(true, false).compute(product);
  const Tensor* sum_in[] = {&dy};
  Tensor* sum_out[] = {&db};
  KernelContext sum{sum_in, sum_out, ctx.piece, ctx.stream, ctx.async_stream};
  sum_to(sum);
}

void matmul_bias_apart(KernelContext& ctx, bool trans_b) {
  const char* name = "matmul_bias";
  const auto [x, w, b, y, d] = baton::detail::linear_args(ctx, trans_b, name);
  if (d.rows == 0 || d.n == 0) return;
  cudaStream_t s = stream_of(ctx, name);
  const std::string& who = ctx.stream->owner();
  // The product by cuBLAS (float32 accumulation) written in y's dtype, which may be f32 for bf16
  // operands (then, as in the fused product, the product is not rounded to bf16 first: the CPU's
  // kernel rounds it, as the unfused plan did), then the bias added in place by add's kernel.
  if (d.k == 0) {
    check(cudaMemsetAsync(y.raw(), 0, y.nbytes(), s), "cudaMemsetAsync", who);  // 0 in f32 and bf16: all bits 0
  } else {
    const float alpha = 1.f, beta = 0.f;
    const int N = static_cast<int>(d.n), M = static_cast<int>(d.rows), K = static_cast<int>(d.k);
    check(cublasGemmEx(ctx.stream->impl().blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha,
                       w.raw(), util::blas_type(w.dtype()), trans_b ? K : N, x.raw(), util::blas_type(x.dtype()), K, &beta,
                       y.raw(), util::blas_type(y.dtype()), N,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx", who);
  }
  Tensor y2 = y.view({d.rows, d.n});
  const Tensor* add_in[] = {&y2, &b};
  Tensor* add_out[] = {&y2};
  KernelContext add{add_in, add_out, ctx.piece, ctx.stream, ctx.async_stream};
  if (y.dtype() == DType::bf16) {
    binary<launch::Bf16>(add, launch::Binary::add, "add");
  } else {
    binary<float>(add, launch::Binary::add, "add");
  }
}

void matmul_bias_gelu_apart(KernelContext& ctx, bool trans_b, bool tanh) {
  const char* name = "matmul_bias_gelu";
  Tensor& y = need_output(ctx, 0, name, "y");
  Tensor& pre = need_output(ctx, 1, name, "pre");
  Tensor* sum_out[] = {&pre};
  KernelContext sum{ctx.inputs, sum_out, ctx.piece, ctx.stream, ctx.async_stream};
  matmul_bias_apart(sum, trans_b);
  const Tensor* gelu_in[] = {&pre};
  Tensor* gelu_out[] = {&y};
  KernelContext gelu{gelu_in, gelu_out, ctx.piece, ctx.stream, ctx.async_stream};
  const launch::Unary op = tanh ? launch::Unary::gelu_tanh : launch::Unary::gelu;
  if (y.dtype() == DType::bf16) {
    unary<launch::Bf16>(gelu, op, "gelu");
  } else {
    unary<float>(gelu, op, "gelu");
  }
}

void matmul_dgelu_bgrad_apart(KernelContext& ctx, bool trans_b, bool tanh) {
  const char* name = "matmul_dgelu_bgrad";
  const auto [dy, w, pre, dh, db, d] = baton::detail::dgelu_args(ctx, trans_b, name);
  const Tensor* product_in[] = {&dy, &w};
  Tensor* product_out[] = {&dh};
  KernelContext product{product_in, product_out, ctx.piece, ctx.stream, ctx.async_stream};
  MatmulKernel(false, trans_b).compute(product);
  const Tensor* grad_in[] = {&pre, &dh};
  Tensor* grad_out[] = {&dh};  // elementwise: each element read before it is written
  KernelContext grad{grad_in, grad_out, ctx.piece, ctx.stream, ctx.async_stream};
  const launch::UnaryGrad op = tanh ? launch::UnaryGrad::gelu_tanh : launch::UnaryGrad::gelu;
  if (dh.dtype() == DType::bf16) {
    unary_grad<launch::Bf16>(grad, op, "gelu_grad");
  } else {
    unary_grad<float>(grad, op, "gelu_grad");
  }
  const Tensor* sum_in[] = {&dh};
  Tensor* sum_out[] = {&db};
  KernelContext sum{sum_in, sum_out, ctx.piece, ctx.stream, ctx.async_stream};
  sum_to(sum);
}

void add_cuda_kernels(KernelRegistry& reg) {
  constexpr auto cuda = DeviceType::cuda;
  for (DType t : {DType::f32, DType::f64, DType::i32, DType::i64, DType::u8, DType::bf16}) {
    // Copies: within a device, and across host and device (the copy actors of
    // insert_device_copies); cudaMemcpyDefault tells which from the pointers.
    for (const char* op : {"copy", "to_device", "to_host"}) {
      reg.add_fn(op, cuda, t, [op](KernelContext& ctx) { copy_kernel(ctx, op); });
    }
    reg.add_fn("noop", cuda, t, [](KernelContext&) {});
  }
  add_float_kernels<float>(reg);
  add_float_kernels<launch::Bf16>(reg);
  // The ops that move bytes (and sum_to): every float type.
  for (DType t : {DType::f32, DType::f64, DType::bf16}) {
    for (const char* op : {"reshape", "stop_gradient"}) reg.add_fn(op, cuda, t, [op](KernelContext& ctx) { copy_kernel(ctx, op); });
    reg.add_fn("sum_to", cuda, t, sum_to);
    reg.add_fn("broadcast_to", cuda, t, broadcast_to);
    reg.add("transpose", cuda, t, [](const KernelConfig& cfg) {
      auto it = cfg.attrs.values().find("perm");
      if (it == cfg.attrs.values().end() || !std::holds_alternative<std::vector<std::int64_t>>(it->second)) {
        throw std::invalid_argument(fmt::format("transpose (actor '{}') needs an int list attribute 'perm'", cfg.actor));
      }
      return std::make_unique<TransposeKernel>(std::get<std::vector<std::int64_t>>(it->second));
    });
    for (auto [op, grad] : {std::pair{"slice", false}, std::pair{"slice_grad", true}}) {
      reg.add(op, cuda, t, [op = op, grad = grad](const KernelConfig& cfg) {
        return std::make_unique<SliceKernel>(grad, required_int(cfg, op, "axis"), required_int(cfg, op, "start"));
      });
    }
    reg.add("concat", cuda, t, [](const KernelConfig& cfg) {
      return std::make_unique<ConcatKernel>(required_int(cfg, "concat", "axis"));
    });
  }
  reg.add_fn("softmax_cross_entropy_grad", cuda, DType::f32, cross_entropy_grad);
  reg.add("softmax_cross_entropy", cuda, DType::f32, [](const KernelConfig&) { return std::make_unique<CrossEntropyKernel>(); });
  for (DType t : {DType::f32, DType::bf16}) {
    reg.add("matmul", cuda, t, [](const KernelConfig& cfg) {
      return std::make_unique<MatmulKernel>(cfg.attrs.get_int("trans_a", 0) != 0, cfg.attrs.get_int("trans_b", 0) != 0);
    });
  }
  for (auto [op, grad] : {std::pair{"embedding", false}, std::pair{"embedding_grad", true}}) {
    reg.add(op, cuda, DType::f32, [op = op, grad = grad](const KernelConfig& cfg) {
      return std::make_unique<EmbeddingKernel>(VocabRange::read(cfg, op), grad);
    });
  }
  // The bf16 lookup is a gather; its gradient (a sort and sums) stays the float32 kernel's.
  reg.add("embedding", cuda, DType::bf16, [](const KernelConfig& cfg) {
    return std::make_unique<EmbeddingKernel>(VocabRange::read(cfg, "embedding"), false);
  });
  for (auto [op, grad] : {std::pair{"vocab_parallel_ce_stats", false}, std::pair{"vocab_parallel_ce_stats_grad", true}}) {
    reg.add(op, cuda, DType::f32, [op = op, grad = grad](const KernelConfig& cfg) {
      return std::make_unique<VocabCeStatsKernel>(VocabRange::read(cfg, op), grad);
    });
  }
  reg.add("vocab_parallel_ce_loss", cuda, DType::f32, [](const KernelConfig&) { return std::make_unique<VocabCeLossKernel>(); });
  reg.add_fn("vocab_parallel_ce_loss_grad", cuda, DType::f32, vocab_ce_loss_grad);
  reg.add("mse", cuda, DType::f32, [](const KernelConfig&) { return std::make_unique<MseKernel>(); });
  reg.add_fn("mse_grad", cuda, DType::f32, mse_grad);
  for (const char* op : {"sum", "mean", "max"}) {
    for (DType t : {DType::f32, DType::f64}) {
      reg.add(op, cuda, t, [op](const KernelConfig& cfg) {
        return std::make_unique<ReduceKernel>(op, int_list_or_empty(cfg, op, "axes"), flag(cfg, op, "keepdims"));
      });
    }
  }
  auto dropout = [](const KernelConfig& cfg) {
    // torch.nn.Dropout's default p, as the CPU.
    const double p = cfg.attrs.get_double("p", 0.5);
    const std::int64_t seed = cfg.attrs.get_int("seed", 0);
    if (!(p >= 0.0 && p <= 1.0)) {
      throw std::invalid_argument(fmt::format("dropout (actor '{}'): attribute p must be in [0, 1], got {}", cfg.actor, p));
    }
    return std::pair{p, seed};
  };
  reg.add("dropout", cuda, DType::f32, [dropout](const KernelConfig& cfg) {
    auto [p, seed] = dropout(cfg);
    return std::make_unique<DropoutKernel<float>>(p, seed);
  });
  reg.add("dropout", cuda, DType::f64, [dropout](const KernelConfig& cfg) {
    auto [p, seed] = dropout(cfg);
    return std::make_unique<DropoutKernel<double>>(p, seed);
  });
  add_fused_kernels(reg);
  add_llm_kernels(reg);
  add_decode_kernels(reg);
  add_linear_kernels(reg);
}

launch::WeightCopy weight_copy(Tensor* copy, std::int64_t n, const Stream& stream) {
  if (copy == nullptr) return {};
  if ((copy->dtype() != DType::f32 && copy->dtype() != DType::bf16) || copy->numel() != n) {
    throw std::invalid_argument(fmt::format("{}: the optimizer's copy of a weight of {} elements into {}: f32 or bf16 "
                                            "of the same size",
                                            stream.owner(), n, copy->describe()));
  }
  return {copy->raw(), copy->dtype() == DType::bf16};
}

void sgd_step(float* w, const float* g, float* momentum_buf, std::int64_t n, const SgdConfig& cfg, std::int64_t step,
              double lr, Stream& stream, Tensor* copy) {
  if (step < 1) throw std::invalid_argument(fmt::format("{}: sgd_step at step {} (steps count from 1)", stream.owner(), step));
  if (cfg.nesterov && !(cfg.momentum > 0.0)) throw std::invalid_argument(stream.owner() + ": nesterov needs a positive momentum");
  const launch::WeightCopy out = weight_copy(copy, n, stream);
  stream.bind();
  check(launch::sgd(w, g, cfg.momentum != 0.0 ? momentum_buf : nullptr, n, lr, cfg.momentum, cfg.weight_decay, cfg.nesterov,
                    step == 1, out, stream.impl().stream),
        "sgd", stream.owner());
}

void adam_step(float* w, const float* g, float* m, float* v, std::int64_t n, const AdamConfig& cfg, std::int64_t step,
               double lr, Stream& stream, Tensor* copy) {
  if (step < 1) throw std::invalid_argument(fmt::format("{}: adam_step at step {} (steps count from 1)", stream.owner(), step));
  const launch::WeightCopy out = weight_copy(copy, n, stream);
  // The constants exactly as baton/kernels/optim.cpp makes them, so each element matches.
  const double t = static_cast<double>(step);
  launch::AdamConstants k{static_cast<float>(cfg.beta1),
                          static_cast<float>(cfg.beta2),
                          static_cast<float>(1.0 - cfg.beta1),
                          static_cast<float>(1.0 - cfg.beta2),
                          static_cast<float>(lr / (1.0 - std::pow(cfg.beta1, t))),
                          static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(cfg.beta2, t))),
                          static_cast<float>(cfg.eps),
                          static_cast<float>(cfg.decoupled ? 1.0 - lr * cfg.weight_decay : 1.0),
                          static_cast<float>(cfg.decoupled ? 0.0 : cfg.weight_decay)};
  stream.bind();
  check(launch::adam(w, g, m, v, n, k, out, stream.impl().stream), "adam", stream.owner());
}

}  // namespace baton::cuda
