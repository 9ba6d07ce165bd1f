// The built-in CPU kernels the runtime's own tests and benchmarks need. Training kernels
// (matmul, softmax, ...) arrive with the graph compiler.
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "baton/kernels/kernel.h"
#include "kernel_args.h"

namespace baton {

namespace {

constexpr DType all_dtypes[] = {DType::f32, DType::f64, DType::i32, DType::i64, DType::u8, DType::bf16};

using detail::need_input;
using detail::need_output;

void copy_into(const Tensor& in, Tensor& out, const char* op) {
  if (in.nbytes() != out.nbytes()) {
    throw std::invalid_argument(
        fmt::format("{}: input {} and output {} differ in size", op, in.describe(), out.describe()));
  }
  if (in.raw() != out.raw() && in.nbytes() != 0) std::memcpy(out.raw(), in.raw(), in.nbytes());
}

// Copies input 0 to output 0 when both exist: the pass-through of the fixed-cost kernels.
void pass_through(const KernelContext& ctx, const char* op) {
  if (!ctx.inputs.empty() && ctx.inputs[0] != nullptr && !ctx.outputs.empty()) {
    copy_into(*ctx.inputs[0], *ctx.outputs[0], op);
  }
}

template <class T>
void add_kernel(KernelContext& ctx) {
  auto a = need_input(ctx, 0, "add").data<T>();
  auto b = need_input(ctx, 1, "add").data<T>();
  auto out = need_output(ctx, 0, "add").data<T>();
  if (a.size() != out.size() || b.size() != out.size()) {
    throw std::invalid_argument(fmt::format("add: inputs of {} and {} elements into {}", a.size(),
                                            b.size(), out.size()));
  }
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = a[i] + b[i];
}

// Writes piece + offset into every element of every output: a source whose data says which
// piece it is, so consumers can check that they see every piece once and in order.
template <class T>
class FillPieceKernel final : public Kernel {
 public:
  explicit FillPieceKernel(std::int64_t offset) : offset_(offset) {}
  void compute(KernelContext& ctx) override {
    auto v = static_cast<T>(ctx.piece + offset_);
    for (Tensor* out : ctx.outputs) {
      for (auto& x : out->data<T>()) x = v;
    }
  }

 private:
  std::int64_t offset_;
};

// Busy-waits: a compute kernel of a known cost that holds its core, as real compute does.
class SpinKernel final : public Kernel {
 public:
  explicit SpinKernel(std::int64_t ns) : ns_(ns) {}
  void compute(KernelContext& ctx) override {
    auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns_);
    while (std::chrono::steady_clock::now() < until) {
    }
    pass_through(ctx, "spin_ns");
  }

 private:
  std::int64_t ns_;
};

// Waits for its deadline without holding a core, as an accelerator's stream would: lets
// schedule benchmarks show their true shape with more emulated devices than cores.
class SleepKernel final : public Kernel {
 public:
  explicit SleepKernel(std::int64_t ns) : ns_(ns) {}
  void compute(KernelContext& ctx) override {
    std::this_thread::sleep_for(std::chrono::nanoseconds(ns_));
    pass_through(ctx, "sleep_ns");
  }

 private:
  std::int64_t ns_;
};

std::int64_t positive_ns(const KernelConfig& cfg, const char* op) {
  auto ns = cfg.attrs.get_int("ns", -1);
  if (ns < 0) {
    throw std::invalid_argument(
        fmt::format("{} (actor '{}') needs a non-negative integer attribute 'ns'", op, cfg.actor));
  }
  return ns;
}

template <class T>
void add_arithmetic(KernelRegistry& reg) {
  reg.add_fn("add", DeviceType::cpu, dtype_of<T>(), add_kernel<T>);
  reg.add("fill_piece", DeviceType::cpu, dtype_of<T>(), [](const KernelConfig& cfg) {
    return std::make_unique<FillPieceKernel<T>>(cfg.attrs.get_int("offset", 0));
  });
}

}  // namespace

void add_cpu_kernels(KernelRegistry& reg) {
  // The token of a point-to-point move (graph/passes.h, nccl_p2p): written once the register's
  // piece is ready on its device, it tells the receiving rank to post its receive. It holds the
  // piece's number (a receive checks it where it can) and never reads the piece itself.
  reg.add_fn("p2p.token", DeviceType::cpu, DType::i64, [](KernelContext& ctx) {
    need_output(ctx, 0, "p2p.token").data<std::int64_t>()[0] = ctx.piece;
  });
  for (DType t : all_dtypes) {
    reg.add_fn("noop", DeviceType::cpu, t, [](KernelContext&) {});
    reg.add_fn("copy", DeviceType::cpu, t, [](KernelContext& ctx) {
      copy_into(need_input(ctx, 0, "copy"), need_output(ctx, 0, "copy"), "copy");
    });
    reg.add("spin_ns", DeviceType::cpu, t, [](const KernelConfig& cfg) {
      return std::make_unique<SpinKernel>(positive_ns(cfg, "spin_ns"));
    });
    reg.add("sleep_ns", DeviceType::cpu, t, [](const KernelConfig& cfg) {
      return std::make_unique<SleepKernel>(positive_ns(cfg, "sleep_ns"));
    });
  }
  add_arithmetic<float>(reg);
  add_arithmetic<double>(reg);
  add_arithmetic<std::int32_t>(reg);
  add_arithmetic<std::int64_t>(reg);
}

}  // namespace baton
