// matmul_bias_grad on CUDA: a Linear layer's weight gradient dw = x^T dy and bias gradient
// db = dy summed over the rows in one cuBLASLt product, the bias gradient computed by the
// product's epilogue (CUBLASLT_EPILOGUE_BGRADA) as it reads dy, instead of a second pass over
// dy by a reduction kernel (PyTorch's and Transformer Engine's fused wgrad).
//
// Row-major through column-major cuBLASLt, as MatmulKernel (ops.cpp): dw [k, n] row-major is
// dw^T [n, k] column-major = dy^T x, so the product's A is dy as stored (column-major [n, rows],
// not transposed), its B is x (column-major [k, rows], transposed), and the reduction of A over
// the product's inner dimension (the rows) is the bias gradient, of A's n rows.
//
// The descriptors and the algorithm (cuBLASLt's heuristic) are made once per shape and kept
// by the actor's kernel. Where cuBLASLt offers no algorithm for the epilogue (a dtype or
// alignment it does not fuse), or refuses at run time, the kernel says so once on stderr and
// computes the two ops apart (cuBLAS's product and baton's sum_to kernel): the same values to
// rounding, never an error.
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

using util::stream_of;

// The most workspace cuBLASLt's heuristic may ask for (split-k reductions); each actor then
// holds what its algorithm asks for, often nothing.
constexpr std::size_t max_workspace_bytes = std::size_t{32} << 20;

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

class LinearGradKernel final : public Kernel {
 public:
  LinearGradKernel(std::string actor, Device device) : actor_(std::move(actor)), device_(device) {}
  LinearGradKernel(const LinearGradKernel&) = delete;
  LinearGradKernel& operator=(const LinearGradKernel&) = delete;
  ~LinearGradKernel() override {
    release_plan();
    if (lt_ != nullptr) cublasLtDestroy(lt_);
  }

  void compute(KernelContext& ctx) override {
    const char* name = "matmul_bias_grad";
    const auto [x, dy, dw, db, d] = baton::detail::linear_grad_args(ctx, name);
    if (dy.dtype() != DType::f32 && dy.dtype() != DType::bf16) {
      throw std::invalid_argument(fmt::format("{} (actor '{}'): f32 or bf16, not {}", name, actor_, dy.describe()));
    }
    cudaStream_t s = stream_of(ctx, name);
    if (d.rows > 0 && d.k > 0 && d.n > 0 && fused(d, dy.dtype(), ctx) &&
        aligned16(x.raw()) && aligned16(dy.raw()) && aligned16(dw.raw()) && aligned16(db.raw())) {
      void* bias = db.raw();
      check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
            "cublasLtMatmulDescSetAttribute(BIAS_POINTER)", ctx.stream->owner());
      const float alpha = 1.f, beta = 0.f;
      const cublasStatus_t st =
          cublasLtMatmul(lt_, desc_, &alpha, dy.raw(), layout_a_, x.raw(), layout_b_, &beta, dw.raw(), layout_d_,
                         dw.raw(), layout_d_, &algo_, workspace_bytes_ > 0 ? workspace_.raw() : nullptr,
                         workspace_bytes_, s);
      if (st == CUBLAS_STATUS_SUCCESS) return;
      give_up(fmt::format("cublasLtMatmul failed: {} ({})", cublasGetStatusName(st), static_cast<int>(st)));
    }
    matmul_bias_grad_apart(ctx);
  }

 private:
  struct Key {
    std::int64_t rows = -1, k = -1, n = -1;
    DType dtype = DType::f32;
    bool operator==(const Key&) const = default;
  };

  /// Whether the fused product can run for this shape: its descriptors and algorithm, made the
  /// first time the shape is seen (false for good for a shape cuBLASLt has refused; any error
  /// here is a refusal, never the act's failure).
  bool fused(const baton::detail::LinearGradDims& d, DType dtype, KernelContext& ctx) {
    const Key key{d.rows, d.k, d.n, dtype};
    if (ready_ && key == key_) return true;
    if (std::find(refused_.begin(), refused_.end(), key) != refused_.end()) return false;
    key_ = key;
    try {
      plan(d, dtype, ctx.stream->owner());
    } catch (const std::exception& e) {
      give_up(e.what());
    }
    return ready_;
  }

  void plan(const baton::detail::LinearGradDims& d, DType dtype, const std::string& who) {
    release_plan();
    if (lt_ == nullptr) {
      check(cublasLtCreate(&lt_), "cublasLtCreate", who);
      memory_ = make_device_allocator(device_);
    }
    const cudaDataType_t t = dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasOperation_t no = CUBLAS_OP_N, yes = CUBLAS_OP_T;
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BGRADA;
    check(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate", who);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &no, sizeof(no)), "TRANSA", who);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &yes, sizeof(yes)), "TRANSB", who);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)), "EPILOGUE",
          who);
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &t, sizeof(t)), "BIAS_DATA_TYPE",
          who);
    const auto u64 = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    check(cublasLtMatrixLayoutCreate(&layout_a_, t, u64(d.n), u64(d.rows), d.n), "cublasLtMatrixLayoutCreate(A)", who);
    check(cublasLtMatrixLayoutCreate(&layout_b_, t, u64(d.k), u64(d.rows), d.k), "cublasLtMatrixLayoutCreate(B)", who);
    check(cublasLtMatrixLayoutCreate(&layout_d_, t, u64(d.n), u64(d.k), d.n), "cublasLtMatrixLayoutCreate(D)", who);
    // The heuristic judges the bias pointer's alignment by its value: one aligned to 16 bytes
    // and no more (register slots are), so no algorithm that needs more is chosen.
    void* bias16 = reinterpret_cast<void*>(std::uintptr_t{16});
    check(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias16, sizeof(bias16)),
          "BIAS_POINTER", who);
    cublasLtMatmulPreference_t pref = nullptr;
    check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate", who);
    const std::size_t ws = max_workspace_bytes;
    const std::uint32_t align = 16;  // the register slots' alignment this kernel checks before each call
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
          "cuBLASLt has no algorithm for the bias-gradient epilogue (BGRADA) of {} x {} x {} in {}{}", d.n, d.k, d.rows,
          name(dtype), st != CUBLAS_STATUS_SUCCESS ? fmt::format(": {}", cublasGetStatusName(st)) : std::string()));
    }
    if (result.workspaceSize > workspace_bytes_) {
      workspace_ = Tensor();
      workspace_ = Tensor::empty({static_cast<std::int64_t>(result.workspaceSize)}, DType::u8, *memory_);
      workspace_bytes_ = result.workspaceSize;
    }
    algo_ = result.algo;
    ready_ = true;
  }

  /// This shape runs apart from now on (said once per actor on stderr).
  void give_up(const std::string& why) {
    if (refused_.empty()) {
      std::fprintf(stderr, "baton: %s: %s; the product and the bias's sum run apart\n", actor_.c_str(), why.c_str());
    }
    refused_.push_back(key_);
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
  cublasLtHandle_t lt_ = nullptr;
  std::unique_ptr<Allocator> memory_;  // declared before the workspace it backs
  Tensor workspace_;
  std::size_t workspace_bytes_ = 0;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr, layout_b_ = nullptr, layout_d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  Key key_;
  bool ready_ = false;
  std::vector<Key> refused_;  // shapes cuBLASLt would not take: they run apart
};

}  // namespace

void add_linear_grad_kernels(KernelRegistry& reg) {
  for (DType t : {DType::f32, DType::bf16}) {
    reg.add("matmul_bias_grad", DeviceType::cuda, t, [](const KernelConfig& cfg) {
      return std::make_unique<LinearGradKernel>(std::string(cfg.actor), cfg.device);
    });
  }
}

}  // namespace baton::cuda
