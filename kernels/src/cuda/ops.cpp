// The CUDA kernels of the training ops (baton/kernels/ops.h), float32, registered for
// DeviceType::cuda. Each checks shapes on the host, then only enqueues work on its actor's
// stream (KernelContext::stream); nothing here waits for the device. Every launch is checked
// and a failure names the op, the actor and the CUDA error.
#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>

#include "../kernel_args.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/optim.h"
#include "baton/kernels/tensor.h"
#include "common.h"
#include "launch.h"

namespace baton::cuda {

namespace {

using detail::need_input;
using detail::need_output;
using launch::Indexing;

cudaStream_t stream_of(const KernelContext& ctx, const char* op) {
  if (ctx.stream == nullptr) {
    throw std::invalid_argument(fmt::format("{}: a CUDA kernel ran without a CUDA stream (is its actor on a cuda device?)", op));
  }
  ctx.stream->bind();
  return ctx.stream->impl().stream;
}

const float* in_f32(const Tensor& t, const char* op, const char* role) {
  if (t.dtype() != DType::f32) throw std::invalid_argument(fmt::format("{}: {} is {}, expected f32", op, role, t.describe()));
  return static_cast<const float*>(t.raw());
}
float* out_f32(Tensor& t, const char* op, const char* role) {
  if (t.dtype() != DType::f32) throw std::invalid_argument(fmt::format("{}: {} is {}, expected f32", op, role, t.describe()));
  return static_cast<float*>(t.raw());
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

void launched(cudaError_t e, const char* op, const KernelContext& ctx) {
  check(e, op, ctx.stream->owner());
}

std::vector<std::int64_t> strides_of(const Shape& s) {
  std::vector<std::int64_t> st(s.size(), 1);
  for (std::size_t i = s.size(); i-- > 1;) st[i - 1] = st[i] * s[i];
  return st;
}

// x's strides along the dims of `out` (aligned right, numpy rules): 0 where x is broadcast.
void broadcast_strides(const Shape& x, const Shape& out, long long* dst, const char* op, const char* role) {
  const auto st = strides_of(x);
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
void binary(KernelContext& ctx, launch::Binary op, const char* name) {
  const Tensor& a = need_input(ctx, 0, name, "a");
  const Tensor& b = need_input(ctx, 1, name, "b");
  Tensor& c = need_output(ctx, 0, name, "c");
  Indexing ix = indexing_for(c.shape(), name);
  broadcast_strides(a.shape(), c.shape(), ix.a, name, "a");
  broadcast_strides(b.shape(), c.shape(), ix.b, name, "b");
  launched(launch::binary(op, in_f32(a, name, "a"), in_f32(b, name, "b"), out_f32(c, name, "c"), ix, c.numel(),
                          stream_of(ctx, name)),
           name, ctx);
}

void unary(KernelContext& ctx, launch::Unary op, const char* name, float param = 0) {
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  check_same_numel(x, y, name);
  launched(launch::unary(op, in_f32(x, name, "x"), out_f32(y, name, "y"), y.numel(), param, stream_of(ctx, name)), name,
           ctx);
}

void unary_grad(KernelContext& ctx, launch::UnaryGrad op, const char* name) {
  const Tensor& x = need_input(ctx, 0, name, "x");
  const Tensor& dy = need_input(ctx, 1, name, "dy");
  Tensor& dx = need_output(ctx, 0, name, "dx");
  check_same_shape(x, dy, name);
  check_same_shape(x, dx, name);
  launched(launch::unary_grad(op, in_f32(x, name, "x"), in_f32(dy, name, "dy"), out_f32(dx, name, "dx"), dx.numel(),
                              stream_of(ctx, name)),
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

void sum_to(KernelContext& ctx) {
  const char* name = "sum_to";
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  const Shape& xs = x.shape();
  const Shape& ys = y.shape();
  if (ys.size() > xs.size()) {
    throw std::invalid_argument(fmt::format("sum_to: y {} has more axes than x {}", y.describe(), x.describe()));
  }
  const auto st = strides_of(xs);
  Indexing out = indexing_for(xs, name);
  Indexing red;
  long long n_red = 1;
  const std::size_t lead = xs.size() - ys.size();
  for (std::size_t d = 0; d < xs.size(); ++d) {
    const std::int64_t yd = d < lead ? 1 : ys[d - lead];
    if (yd != xs[d] && yd != 1) {
      throw std::invalid_argument(fmt::format("sum_to: y {} is not broadcast-compatible with x {}", y.describe(), x.describe()));
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
  launched(launch::sum_to(in_f32(x, name, "x"), out_f32(y, name, "y"), out, y.numel(), red, n_red, stream_of(ctx, name)),
           name, ctx);
}

void broadcast_to(KernelContext& ctx) {
  const char* name = "broadcast_to";
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  if (x.shape().size() > y.shape().size()) {
    throw std::invalid_argument(fmt::format("broadcast_to: x {} has more axes than y {}", x.describe(), y.describe()));
  }
  Indexing ix = indexing_for(y.shape(), name);
  broadcast_strides(x.shape(), y.shape(), ix.a, name, "x");
  launched(launch::gather(in_f32(x, name, "x"), out_f32(y, name, "y"), ix, y.numel(), stream_of(ctx, name)), name, ctx);
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
    launched(launch::gather(in_f32(x, name, "x"), out_f32(y, name, "y"), ix, y.numel(), stream_of(ctx, name)), name, ctx);
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

void softmax(KernelContext& ctx, bool log, const char* name) {
  const Tensor& x = need_input(ctx, 0, name, "x");
  Tensor& y = need_output(ctx, 0, name, "y");
  check_same_shape(x, y, name);
  auto [rows, cols] = rows_cols(x, name);
  launched(launch::softmax(in_f32(x, name, "x"), out_f32(y, name, "y"), rows, cols, log, stream_of(ctx, name)), name, ctx);
}

void softmax_grad(KernelContext& ctx, bool log, const char* name) {
  const Tensor& y = need_input(ctx, 0, name, "y");
  const Tensor& dy = need_input(ctx, 1, name, "dy");
  Tensor& dx = need_output(ctx, 0, name, "dx");
  check_same_shape(y, dy, name);
  check_same_shape(y, dx, name);
  auto [rows, cols] = rows_cols(y, name);
  launched(launch::softmax_grad(in_f32(y, name, "y"), in_f32(dy, name, "dy"), out_f32(dx, name, "dx"), rows, cols, log,
                                stream_of(ctx, name)),
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
  ~CrossEntropyKernel() override {
    if (scratch_ != nullptr) cudaFree(scratch_);
  }
  void compute(KernelContext& ctx) override {
    const char* name = "softmax_cross_entropy";
    const Tensor& logits = need_input(ctx, 0, name, "logits");
    const Tensor& labels = need_input(ctx, 1, name, "labels");
    Tensor& loss = need_output(ctx, 0, name, "loss");
    check_logits_labels(logits, labels, name);
    if (loss.numel() != 1) throw std::invalid_argument(fmt::format("{}: loss {} must be a scalar", name, loss.describe()));
    cudaStream_t s = stream_of(ctx, name);
    const long long rows = logits.dim(0);
    if (rows > capacity_) {
      if (scratch_ != nullptr) check(cudaFree(scratch_), "cudaFree", ctx.stream->owner());
      scratch_ = nullptr;
      check(cudaMalloc(reinterpret_cast<void**>(&scratch_), static_cast<std::size_t>(rows) * sizeof(double)), "cudaMalloc",
            ctx.stream->owner());
      capacity_ = rows;
    }
    launched(launch::cross_entropy(in_f32(logits, name, "logits"), in_i32(labels, name, "labels"), out_f32(loss, name, "loss"),
                                   scratch_, rows, logits.dim(1), s),
             name, ctx);
  }

 private:
  double* scratch_ = nullptr;
  long long capacity_ = 0;
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

// Without the vocab / vocab_start attributes (a tensor-parallel shard): those stay on the CPU.
void no_vocab_shard(const KernelConfig& cfg, const char* op) {
  if (cfg.attrs.has("vocab") || cfg.attrs.has("vocab_start")) {
    throw std::invalid_argument(fmt::format("{} (actor '{}'): the CUDA kernel has no vocabulary shards (vocab, vocab_start)", op, cfg.actor));
  }
}

void check_table(const Tensor& table, const Tensor& ids, const Tensor& y, const char* name) {
  if (table.shape().size() != 2) throw std::invalid_argument(fmt::format("{}: table {} must be [V, D]", name, table.describe()));
  Shape want = ids.shape();
  want.push_back(table.dim(1));
  if (y.shape() != want) {
    throw std::invalid_argument(fmt::format("{}: ids {} and table {} give rows of {}, not {}", name, ids.describe(),
                                            table.describe(), to_string(want), y.describe()));
  }
}

template <class Fn>
void add_f32(KernelRegistry& reg, const char* op, Fn fn) {
  reg.add_fn(op, DeviceType::cuda, DType::f32, std::function<void(KernelContext&)>(std::move(fn)));
}

}  // namespace

void add_cuda_kernels(KernelRegistry& reg) {
  using launch::Binary;
  using launch::Unary;
  using launch::UnaryGrad;
  constexpr auto cuda = DeviceType::cuda;
  for (DType t : {DType::f32, DType::f64, DType::i32, DType::i64, DType::u8, DType::bf16}) {
    // Copies: within a device, and across host and device (the copy actors of
    // insert_device_copies); cudaMemcpyDefault tells which from the pointers.
    for (const char* op : {"copy", "to_device", "to_host"}) {
      reg.add_fn(op, cuda, t, [op](KernelContext& ctx) { copy_kernel(ctx, op); });
    }
    reg.add_fn("noop", cuda, t, [](KernelContext&) {});
  }
  for (const char* op : {"reshape", "stop_gradient"}) {
    add_f32(reg, op, [op](KernelContext& ctx) { copy_kernel(ctx, op); });
  }
  add_f32(reg, "add", [](KernelContext& c) { binary(c, Binary::add, "add"); });
  add_f32(reg, "sub", [](KernelContext& c) { binary(c, Binary::sub, "sub"); });
  add_f32(reg, "mul", [](KernelContext& c) { binary(c, Binary::mul, "mul"); });
  add_f32(reg, "div", [](KernelContext& c) { binary(c, Binary::div, "div"); });
  add_f32(reg, "maximum", [](KernelContext& c) { binary(c, Binary::maximum, "maximum"); });
  add_f32(reg, "relu", [](KernelContext& c) { unary(c, Unary::relu, "relu"); });
  add_f32(reg, "gelu", [](KernelContext& c) { unary(c, Unary::gelu, "gelu"); });
  add_f32(reg, "tanh", [](KernelContext& c) { unary(c, Unary::tanh, "tanh"); });
  add_f32(reg, "sigmoid", [](KernelContext& c) { unary(c, Unary::sigmoid, "sigmoid"); });
  add_f32(reg, "relu_grad", [](KernelContext& c) { unary_grad(c, UnaryGrad::relu, "relu_grad"); });
  add_f32(reg, "gelu_grad", [](KernelContext& c) { unary_grad(c, UnaryGrad::gelu, "gelu_grad"); });
  add_f32(reg, "tanh_grad", [](KernelContext& c) { unary_grad(c, UnaryGrad::tanh, "tanh_grad"); });
  add_f32(reg, "sigmoid_grad", [](KernelContext& c) { unary_grad(c, UnaryGrad::sigmoid, "sigmoid_grad"); });
  add_f32(reg, "sum_to", sum_to);
  add_f32(reg, "broadcast_to", broadcast_to);
  add_f32(reg, "softmax", [](KernelContext& c) { softmax(c, false, "softmax"); });
  add_f32(reg, "log_softmax", [](KernelContext& c) { softmax(c, true, "log_softmax"); });
  add_f32(reg, "softmax_grad", [](KernelContext& c) { softmax_grad(c, false, "softmax_grad"); });
  add_f32(reg, "log_softmax_grad", [](KernelContext& c) { softmax_grad(c, true, "log_softmax_grad"); });
  add_f32(reg, "softmax_cross_entropy_grad", cross_entropy_grad);
  reg.add("softmax_cross_entropy", cuda, DType::f32, [](const KernelConfig&) { return std::make_unique<CrossEntropyKernel>(); });
  for (DType t : {DType::f32, DType::bf16}) {
    reg.add("matmul", cuda, t, [](const KernelConfig& cfg) {
      return std::make_unique<MatmulKernel>(cfg.attrs.get_int("trans_a", 0) != 0, cfg.attrs.get_int("trans_b", 0) != 0);
    });
  }
  reg.add("transpose", cuda, DType::f32, [](const KernelConfig& cfg) {
    auto it = cfg.attrs.values().find("perm");
    if (it == cfg.attrs.values().end() || !std::holds_alternative<std::vector<std::int64_t>>(it->second)) {
      throw std::invalid_argument(fmt::format("transpose (actor '{}') needs an int list attribute 'perm'", cfg.actor));
    }
    return std::make_unique<TransposeKernel>(std::get<std::vector<std::int64_t>>(it->second));
  });
  reg.add("scale", cuda, DType::f32, [](const KernelConfig& cfg) {
    const auto value = static_cast<float>(cfg.attrs.get_double("value", std::nan("")));
    if (std::isnan(value)) throw std::invalid_argument(fmt::format("scale (actor '{}') needs a double attribute 'value'", cfg.actor));
    return std::make_unique<FunctionKernelF>([value](KernelContext& c) { unary(c, Unary::scale, "scale", value); });
  });
  reg.add("fill", cuda, DType::f32, [](const KernelConfig& cfg) {
    const auto value = static_cast<float>(cfg.attrs.get_double("value", std::nan("")));
    if (!cfg.attrs.has("value")) throw std::invalid_argument(fmt::format("fill (actor '{}') needs a double attribute 'value'", cfg.actor));
    return std::make_unique<FunctionKernelF>([value](KernelContext& c) {
      Tensor& y = need_output(c, 0, "fill", "y");
      launched(launch::fill(out_f32(y, "fill", "y"), y.numel(), value, stream_of(c, "fill")), "fill", c);
    });
  });
  reg.add("layer_norm", cuda, DType::f32, [](const KernelConfig& cfg) {
    const double eps = read_eps(cfg);
    return std::make_unique<FunctionKernelF>([eps](KernelContext& c) {
      const char* name = "layer_norm";
      const Tensor& x = need_input(c, 0, name, "x");
      Tensor& y = need_output(c, 0, name, "y");
      check_same_shape(x, y, name);
      auto [rows, cols] = rows_cols(x, name);
      launched(launch::layer_norm(in_f32(x, name, "x"), out_f32(y, name, "y"), rows, cols, eps, stream_of(c, name)), name, c);
    });
  });
  reg.add("layer_norm_grad", cuda, DType::f32, [](const KernelConfig& cfg) {
    const double eps = read_eps(cfg);
    return std::make_unique<FunctionKernelF>([eps](KernelContext& c) {
      const char* name = "layer_norm_grad";
      const Tensor& x = need_input(c, 0, name, "x");
      const Tensor& dy = need_input(c, 1, name, "dy");
      Tensor& dx = need_output(c, 0, name, "dx");
      check_same_shape(x, dy, name);
      check_same_shape(x, dx, name);
      auto [rows, cols] = rows_cols(x, name);
      launched(launch::layer_norm_grad(in_f32(x, name, "x"), in_f32(dy, name, "dy"), out_f32(dx, name, "dx"), rows, cols, eps,
                                       stream_of(c, name)),
               name, c);
    });
  });
  reg.add("causal_mask", cuda, DType::f32, [](const KernelConfig& cfg) {
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
      launched(launch::causal_mask(in_f32(x, name, "x"), out_f32(y, name, "y"), t == 0 ? 0 : x.numel() / (t * t), t, value,
                                   stream_of(c, name)),
               name, c);
    });
  });
  reg.add("embedding", cuda, DType::f32, [](const KernelConfig& cfg) {
    no_vocab_shard(cfg, "embedding");
    return std::make_unique<FunctionKernelF>([](KernelContext& c) {
      const char* name = "embedding";
      const Tensor& table = need_input(c, 0, name, "table");
      const Tensor& ids = need_input(c, 1, name, "ids");
      Tensor& y = need_output(c, 0, name, "y");
      check_table(table, ids, y, name);
      launched(launch::embedding(in_f32(table, name, "table"), in_i32(ids, name, "ids"), out_f32(y, name, "y"), ids.numel(),
                                 table.dim(1), table.dim(0), stream_of(c, name)),
               name, c);
    });
  });
  reg.add("embedding_grad", cuda, DType::f32, [](const KernelConfig& cfg) {
    no_vocab_shard(cfg, "embedding_grad");
    return std::make_unique<FunctionKernelF>([](KernelContext& c) {
      const char* name = "embedding_grad";
      const Tensor& ids = need_input(c, 0, name, "ids");
      const Tensor& dy = need_input(c, 1, name, "dy");
      Tensor& dtable = need_output(c, 0, name, "dtable");
      check_table(dtable, ids, dy, name);
      launched(launch::embedding_grad(in_i32(ids, name, "ids"), in_f32(dy, name, "dy"), out_f32(dtable, name, "dtable"),
                                      ids.numel(), dtable.dim(1), dtable.dim(0), stream_of(c, name)),
               name, c);
    });
  });
}

void sgd_step(float* w, const float* g, float* momentum_buf, std::int64_t n, const SgdConfig& cfg, std::int64_t step,
              double lr, Stream& stream) {
  if (step < 1) throw std::invalid_argument(fmt::format("{}: sgd_step at step {} (steps count from 1)", stream.owner(), step));
  if (cfg.nesterov && !(cfg.momentum > 0.0)) throw std::invalid_argument(stream.owner() + ": nesterov needs a positive momentum");
  stream.bind();
  check(launch::sgd(w, g, cfg.momentum != 0.0 ? momentum_buf : nullptr, n, lr, cfg.momentum, cfg.weight_decay, cfg.nesterov,
                    step == 1, stream.impl().stream),
        "sgd", stream.owner());
}

void adam_step(float* w, const float* g, float* m, float* v, std::int64_t n, const AdamConfig& cfg, std::int64_t step,
               double lr, Stream& stream) {
  if (step < 1) throw std::invalid_argument(fmt::format("{}: adam_step at step {} (steps count from 1)", stream.owner(), step));
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
  check(launch::adam(w, g, m, v, n, k, stream.impl().stream), "adam", stream.owner());
}

}  // namespace baton::cuda
