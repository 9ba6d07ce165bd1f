// A Linear layer's products on CUDA with their epilogues, one cuBLASLt call each, as PyTorch's
// F.linear and Transformer Engine do:
//
// - matmul_bias (forward): y = x w + b, the bias added by the product's epilogue
//   (CUBLASLT_EPILOGUE_BIAS) as it writes y, instead of a second pass over y by an add kernel.
//   x and w bf16 with y f32 (a bf16 product that autocast widens before adding an f32 bias) is
//   one product too, its result written in f32: the bias goes onto the f32 accumulator, where the
//   plan without the fusion rounded the product to bf16 first (and a bf16 y is rounded once, where
//   the two ops rounded twice). So on CUDA these results can differ from the CPU's by that
//   rounding (the CPU kernel keeps the two ops' arithmetic, kernels/src/ops_tensor.cpp).
// - matmul_bias_gelu (forward): y = gelu(x w + b) in GELU's tanh form, and the pre-activation
//   x w + b as a second output for the backward (CUBLASLT_EPILOGUE_GELU_AUX_BIAS: cuBLASLt's GELU
//   is the tanh form; the erf form runs apart). x, w, b, y and pre share one dtype.
// - matmul_dgelu_bgrad (backward): the product that read GELU's output, its data gradient
//   dy w^T, times gelu'(pre) (pre the forward's aux), and the GELU's bias gradient, the sum of the
//   result's rows (CUBLASLT_EPILOGUE_DGELU_BGRAD), instead of a gelu_grad pass and a reduction.
// - matmul_bias_grad (backward): dw = x^T dy and db = dy summed over the rows, the bias gradient
//   computed by the epilogue (CUBLASLT_EPILOGUE_BGRADA) as it reads dy, instead of a second pass
//   over dy by a reduction kernel (PyTorch's and Transformer Engine's fused wgrad).
//
// Row-major through column-major cuBLASLt, as MatmulKernel (ops.cpp): a row-major [r, c] matrix
// is the column-major [c, r] matrix of its transpose.
// - Forward: y [rows, n] row-major is y^T [n, rows] = w^T x^T: A is w (column-major [n, k] as
//   stored, or [k, n] transposed under trans_b), B is x (column-major [k, rows]), and the bias
//   is one value per row of D (its n rows).
// - Backward: dw [k, n] row-major is dw^T [n, k] column-major = dy^T x, so A is dy as stored
//   (column-major [n, rows], not transposed), B is x (column-major [k, rows], transposed), and
//   the reduction of A over the product's inner dimension (the rows) is the bias gradient.
//
// The descriptors and the algorithm (cuBLASLt's heuristic) are made once per shape and kept by
// the actor's kernel. Where cuBLASLt offers no algorithm for the epilogue (a dtype or alignment
// it does not fuse), or refuses at run time, the kernel says so once on stderr and computes the
// two ops apart (cuBLAS's product and baton's add or sum_to kernel): never an error.
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "../kernel_args.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/kernel.h"
#include "common.h"
#include "fused.h"
#include "kernel_util.h"

namespace baton::cuda {

namespace {

using util::blas_type;
using util::stream_of;

// The most workspace cuBLASLt's heuristic may ask for (split-k reductions); each actor then
// holds what its algorithm asks for, often nothing.
constexpr std::size_t max_workspace_bytes = std::size_t{32} << 20;

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

/// A column-major product D [m, n] = op(A) op(B) with an epilogue, as cuBLASLt takes it.
struct LtShape {
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  std::int64_t a_rows = 0, a_cols = 0, b_rows = 0, b_cols = 0, d_rows = 0, d_cols = 0;  // as stored
  cudaDataType_t operands = CUDA_R_32F, result = CUDA_R_32F;  // the bias has the result's type
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  std::int64_t aux_ld = 0;  // the epilogue's auxiliary matrix (GELU_AUX): its leading dimension; 0 for none
  bool operator==(const LtShape&) const = default;
};

/// One cuBLASLt product with an epilogue for one actor: its handle, and the descriptors, layouts,
/// algorithm and workspace of the shape it last ran, made when a shape is first seen. A shape
/// that cuBLASLt refuses (no algorithm, an error) is remembered and said once on stderr; the
/// kernel then runs the ops apart.
class LtProduct {
 public:
  LtProduct(std::string actor, Device device, std::string epilogue, std::string apart)
      : actor_(std::move(actor)), device_(device), epilogue_(std::move(epilogue)), apart_(std::move(apart)) {}
  LtProduct(const LtProduct&) = delete;
  LtProduct& operator=(const LtProduct&) = delete;
  ~LtProduct() {
    release_plan();
    if (lt_ != nullptr) cublasLtDestroy(lt_);
  }

  /// Whether `s` can run fused: planned the first time it is seen (false for good once refused;
  /// any error here is a refusal, never the act's failure).
  bool ready(const LtShape& s, const std::string& who) {
    if (ready_ && s == shape_) return true;
    if (std::find(refused_.begin(), refused_.end(), s) != refused_.end()) return false;
    shape_ = s;
    try {
      plan(s, who);
    } catch (const std::exception& e) {
      give_up(e.what());
    }
    return ready_;
  }

  /// D = op(A) op(B) with the epilogue reading or writing `bias` (and `aux`, for a shape with
  /// an auxiliary matrix), on `stream`, for the shape ready() accepted; false (said once, the
  /// shape refused from now on) where cuBLASLt fails.
  bool run(const void* a, const void* b, void* d, void* bias, cudaStream_t stream, void* aux = nullptr) {
    if (const cublasStatus_t st =
            cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
        st != CUBLAS_STATUS_SUCCESS) {
      give_up(fmt::format("setting the bias pointer failed: {}", cublasGetStatusName(st)));
      return false;
    }
    if (shape_.aux_ld > 0) {
      if (const cublasStatus_t st =
              cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux));
          st != CUBLAS_STATUS_SUCCESS) {
        give_up(fmt::format("setting the auxiliary pointer failed: {}", cublasGetStatusName(st)));
        return false;
      }
    }
    const float alpha = 1.f, beta = 0.f;
    const cublasStatus_t st = cublasLtMatmul(lt_, desc_, &alpha, a, layout_a_, b, layout_b_, &beta, d, layout_d_, d,
                                             layout_d_, &algo_, workspace_bytes_ > 0 ? workspace_.raw() : nullptr,
                                             workspace_bytes_, stream);
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    give_up(fmt::format("cublasLtMatmul failed: {} ({})", cublasGetStatusName(st), static_cast<int>(st)));
    return false;
  }

 private:
  void plan(const LtShape& s, const std::string& who) {
    release_plan();
    if (lt_ == nullptr) check(cublasLtCreate(&lt_), "cublasLtCreate", who);
    if (!memory_) memory_ = make_device_allocator(device_);
    check(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate", who);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &s.trans_a, sizeof(s.trans_a)), "TRANSA",
          who);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &s.trans_b, sizeof(s.trans_b)), "TRANSB",
          who);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, &s.epilogue, sizeof(s.epilogue)),
          "EPILOGUE", who);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &s.result, sizeof(s.result)),
          "BIAS_DATA_TYPE", who);
    const auto u64 = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    check(cublasLtMatrixLayoutCreate(&layout_a_, s.operands, u64(s.a_rows), u64(s.a_cols), s.a_rows),
          "cublasLtMatrixLayoutCreate(A)", who);
    check(cublasLtMatrixLayoutCreate(&layout_b_, s.operands, u64(s.b_rows), u64(s.b_cols), s.b_rows),
          "cublasLtMatrixLayoutCreate(B)", who);
    check(cublasLtMatrixLayoutCreate(&layout_d_, s.result, u64(s.d_rows), u64(s.d_cols), s.d_rows),
          "cublasLtMatrixLayoutCreate(D)", who);
    // The heuristic judges the bias pointer's alignment by its value: one aligned to 16 bytes
    // and no more (register slots are), so no algorithm that needs more is chosen.
    void* bias16 = reinterpret_cast<void*>(std::uintptr_t{16});
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias16, sizeof(bias16)),
          "BIAS_POINTER", who);
    if (s.aux_ld > 0) {  // the auxiliary matrix: D's layout and type, judged aligned as the bias
      check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &s.aux_ld, sizeof(s.aux_ld)),
            "EPILOGUE_AUX_LD", who);
      check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &s.result,
                                           sizeof(s.result)),
            "EPILOGUE_AUX_DATA_TYPE", who);
      check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &bias16, sizeof(bias16)),
            "EPILOGUE_AUX_POINTER", who);
    }
    cublasLtMatmulPreference_t pref = nullptr;
    check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate", who);
    const std::size_t ws = max_workspace_bytes;
    const std::uint32_t align = 16;  // the register slots' alignment the kernels check before each call
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, desc_, layout_a_, layout_b_, layout_d_, layout_d_,
                                                             pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      throw std::runtime_error(fmt::format(
          "cuBLASLt has no algorithm for {} of [{}, {}] x [{}, {}] ({} operands, {} result){}", epilogue_, s.a_rows,
          s.a_cols, s.b_rows, s.b_cols, s.operands == CUDA_R_16BF ? "bf16" : "f32",
          s.result == CUDA_R_16BF ? "bf16" : "f32",
          st != CUBLAS_STATUS_SUCCESS ? fmt::format(": {}", cublasGetStatusName(st)) : std::string()));
    }
    if (result.workspaceSize > workspace_bytes_) {
      workspace_ = Tensor();
      workspace_bytes_ = 0;  // until the larger one is there (an allocation that throws refuses the shape)
      workspace_ = Tensor::empty({static_cast<std::int64_t>(result.workspaceSize)}, DType::u8, *memory_);
      workspace_bytes_ = result.workspaceSize;
    }
    algo_ = result.algo;
    ready_ = true;
  }

  /// This shape runs apart from now on (said once per actor on stderr).
  void give_up(const std::string& why) {
    if (refused_.empty()) std::fprintf(stderr, "baton: %s: %s; %s\n", actor_.c_str(), why.c_str(), apart_.c_str());
    refused_.push_back(shape_);
    release_plan();
  }

  void release_plan() {
    if (layout_a_ != nullptr) cublasLtMatrixLayoutDestroy(layout_a_);
    if (layout_b_ != nullptr) cublasLtMatrixLayoutDestroy(layout_b_);
    if (layout_d_ != nullptr) cublasLtMatrixLayoutDestroy(layout_d_);
    if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
    layout_a_ = layout_b_ = layout_d_ = nullptr;
    desc_ = nullptr;
    ready_ = false;
  }

  std::string actor_;
  Device device_;
  std::string epilogue_, apart_;
  cublasLtHandle_t lt_ = nullptr;
  std::unique_ptr<Allocator> memory_;  // declared before the workspace it backs
  Tensor workspace_;
  std::size_t workspace_bytes_ = 0;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr, layout_b_ = nullptr, layout_d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  LtShape shape_;
  bool ready_ = false;
  std::vector<LtShape> refused_;  // shapes cuBLASLt would not take: they run apart
};

/// The forward products with an epilogue, and the backward one that shares their layout:
/// matmul_bias (BIAS), matmul_bias_gelu (GELU_AUX_BIAS: y and the pre-activation, the aux) and
/// matmul_dgelu_bgrad (DGELU_BGRAD: dh = gelu'(pre) (dy w^T) with pre the aux, and the bias
/// gradient db, the sum of dh's rows). cuBLASLt's GELU is the tanh form; the erf form runs apart.
class LinearKernel final : public Kernel {
 public:
  enum class Mode { bias, gelu, dgelu };
  LinearKernel(std::string actor, Device device, bool trans_b, Mode mode, bool tanh)
      : trans_b_(trans_b), mode_(mode), tanh_(tanh), product_(std::move(actor), device, epilogue_name(mode), apart_name(mode)) {}

  void compute(KernelContext& ctx) override {
    const char* name = op_name(mode_);
    // The product's operands (x, w), its result D (y or dh), the bias (b in, or db out) and the
    // auxiliary matrix (pre out, or pre in), by mode.
    const Tensor *x = nullptr, *w = nullptr;
    Tensor* y = nullptr;
    const void* bias = nullptr;
    const void* aux = nullptr;
    baton::detail::LinearDims d;
    if (mode_ == Mode::dgelu) {
      const auto a = baton::detail::dgelu_args(ctx, trans_b_, name);
      x = &a.dy, w = &a.w, y = &a.dh, bias = a.db.raw(), aux = a.pre.raw(), d = a.dims;
    } else {
      const auto a = baton::detail::linear_args(ctx, trans_b_, name);
      x = &a.x, w = &a.w, y = &a.y, bias = a.b.raw(), d = a.dims;
      if (mode_ == Mode::gelu) {
        Tensor& pre = baton::detail::need_output(ctx, 1, name, "pre");
        if (pre.shape() != a.y.shape() || pre.dtype() != a.y.dtype() || a.y.dtype() != a.x.dtype()) {
          throw std::invalid_argument(fmt::format("{}: x {}, y {} and pre {} must share a dtype, y and pre a shape",
                                                  name, a.x.describe(), a.y.describe(), pre.describe()));
        }
        aux = pre.raw();
      }
    }
    if (x->dtype() != DType::f32 && x->dtype() != DType::bf16) {
      throw std::invalid_argument(fmt::format("{}: f32 or bf16, not {}", name, x->describe()));
    }
    cudaStream_t s = stream_of(ctx, name);
    const std::string& who = ctx.stream->owner();
    // GELU_AUX's and DGELU's leading dimension must be a multiple of 8, and cuBLASLt's GELU is the
    // tanh form.
    const bool with_aux = mode_ != Mode::bias;
    const bool fusable = !with_aux || (tanh_ && d.n % 8 == 0 && aligned16(aux));
    if (fusable && d.rows > 0 && d.k > 0 && d.n > 0 && aligned16(x->raw()) && aligned16(w->raw()) &&
        aligned16(y->raw()) && aligned16(bias)) {
      LtShape shape{.trans_a = trans_b_ ? CUBLAS_OP_T : CUBLAS_OP_N,
                    .trans_b = CUBLAS_OP_N,
                    .a_rows = trans_b_ ? d.k : d.n,
                    .a_cols = trans_b_ ? d.n : d.k,
                    .b_rows = d.k,
                    .b_cols = d.rows,
                    .d_rows = d.n,
                    .d_cols = d.rows,
                    .operands = blas_type(x->dtype()),
                    .result = blas_type(y->dtype()),
                    .epilogue = mode_ == Mode::bias   ? CUBLASLT_EPILOGUE_BIAS
                                : mode_ == Mode::gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                                      : CUBLASLT_EPILOGUE_DGELU_BGRAD,
                    .aux_ld = with_aux ? d.n : 0};
      if (product_.ready(shape, who) && product_.run(w->raw(), x->raw(), y->raw(), const_cast<void*>(bias), s,
                                                     const_cast<void*>(aux)))
        return;
    }
    switch (mode_) {
      case Mode::bias: matmul_bias_apart(ctx, trans_b_); break;
      case Mode::gelu: matmul_bias_gelu_apart(ctx, trans_b_, tanh_); break;
      case Mode::dgelu: matmul_dgelu_bgrad_apart(ctx, trans_b_, tanh_); break;
    }
  }

 private:
  static const char* op_name(Mode m) {
    return m == Mode::bias ? "matmul_bias" : m == Mode::gelu ? "matmul_bias_gelu" : "matmul_dgelu_bgrad";
  }
  static const char* epilogue_name(Mode m) {
    return m == Mode::bias   ? "the bias epilogue (BIAS)"
           : m == Mode::gelu ? "the GELU epilogue (GELU_AUX_BIAS)"
                             : "the GELU-gradient epilogue (DGELU_BGRAD)";
  }
  static const char* apart_name(Mode m) {
    return m == Mode::bias   ? "the product and the bias's add run apart"
           : m == Mode::gelu ? "the product, the bias's add and the GELU run apart"
                             : "the product, the GELU's gradient and the bias's sum run apart";
  }

  bool trans_b_;
  Mode mode_;
  bool tanh_;
  LtProduct product_;
};

class LinearGradKernel final : public Kernel {
 public:
  LinearGradKernel(std::string actor, Device device)
      : product_(std::move(actor), device, "the bias-gradient epilogue (BGRADA)",
                 "the product and the bias's sum run apart") {}

  void compute(KernelContext& ctx) override {
    const char* name = "matmul_bias_grad";
    const auto [x, dy, dw, db, d] = baton::detail::linear_grad_args(ctx, name);
    if (dy.dtype() != DType::f32 && dy.dtype() != DType::bf16) {
      throw std::invalid_argument(fmt::format("{}: f32 or bf16, not {}", name, dy.describe()));
    }
    cudaStream_t s = stream_of(ctx, name);
    const std::string& who = ctx.stream->owner();
    if (d.rows > 0 && d.k > 0 && d.n > 0 && aligned16(x.raw()) && aligned16(dy.raw()) && aligned16(dw.raw()) &&
        aligned16(db.raw())) {
      const cudaDataType_t t = blas_type(dy.dtype());
      LtShape shape{.trans_a = CUBLAS_OP_N,
                    .trans_b = CUBLAS_OP_T,
                    .a_rows = d.n,
                    .a_cols = d.rows,
                    .b_rows = d.k,
                    .b_cols = d.rows,
                    .d_rows = d.n,
                    .d_cols = d.k,
                    .operands = t,
                    .result = t,
                    .epilogue = CUBLASLT_EPILOGUE_BGRADA};
      if (product_.ready(shape, who) && product_.run(dy.raw(), x.raw(), dw.raw(), db.raw(), s)) return;
    }
    matmul_bias_grad_apart(ctx);
  }

 private:
  LtProduct product_;
};

}  // namespace

void add_linear_kernels(KernelRegistry& reg) {
  for (DType t : {DType::f32, DType::bf16}) {
    reg.add("matmul_bias_grad", DeviceType::cuda, t, [](const KernelConfig& cfg) {
      return std::make_unique<LinearGradKernel>(std::string(cfg.actor), cfg.device);
    });
    for (auto [op, mode] : {std::pair{"matmul_bias", LinearKernel::Mode::bias},
                            std::pair{"matmul_bias_gelu", LinearKernel::Mode::gelu},
                            std::pair{"matmul_dgelu_bgrad", LinearKernel::Mode::dgelu}}) {
      reg.add(op, DeviceType::cuda, t, [op = op, mode = mode](const KernelConfig& cfg) {
        const bool tanh = mode != LinearKernel::Mode::bias && baton::detail::gelu_tanh(cfg, op);
        return std::make_unique<LinearKernel>(std::string(cfg.actor), cfg.device, cfg.attrs.get_int("trans_b", 0) != 0,
                                              mode, tanh);
      });
    }
  }
}

}  // namespace baton::cuda
