#include <mutex>
#include <stdexcept>

#include <fmt/format.h>

#include "baton/kernels/cuda.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/nccl.h"
#include "baton/kernels/ops.h"
#include "baton/kernels/sim.h"
#include "kernel_args.h"

namespace baton {

namespace {
class FunctionKernel final : public Kernel {
 public:
  explicit FunctionKernel(std::function<void(KernelContext&)> fn) : fn_(std::move(fn)) {}
  void compute(KernelContext& ctx) override { fn_(ctx); }

 private:
  std::function<void(KernelContext&)> fn_;
};
}  // namespace

void KernelRegistry::add(std::string op, DeviceType device, DType dtype, KernelFactory factory) {
  factories_[Key{std::move(op), device, dtype}] = std::move(factory);
}

KernelFactory kernel_of(std::function<void(KernelContext&)> fn) {
  return [fn = std::move(fn)](const KernelConfig&) { return std::make_unique<FunctionKernel>(fn); };
}

void KernelRegistry::add_fn(std::string op, DeviceType device, DType dtype,
                            std::function<void(KernelContext&)> fn) {
  add(std::move(op), device, dtype, kernel_of(std::move(fn)));
}

bool KernelRegistry::contains(std::string_view op, DeviceType device, DType dtype) const {
  if (factories_.find(std::make_tuple(std::string(op), device, dtype)) != factories_.end()) return true;
  // A sim device runs the CPU kernel on its stream (create()).
  if (device == DeviceType::sim) return contains(op, DeviceType::cpu, dtype);
  // bf16 falls back on the float32 kernel (create()).
  return dtype == DType::bf16 && factories_.find(std::make_tuple(std::string(op), device, DType::f32)) != factories_.end();
}

std::unique_ptr<Kernel> KernelRegistry::create(std::string_view op,
                                               const KernelConfig& cfg) const {
  auto it = factories_.find(std::make_tuple(std::string(op), cfg.device.type, cfg.dtype));
  if (it == factories_.end() && cfg.device.type == DeviceType::sim &&
      contains(op, DeviceType::cpu, cfg.dtype)) {
    // No sim kernel of its own: the CPU kernel (of the same device index), enqueued on the
    // actor's sim stream. Its memory is host memory.
    KernelConfig cpu_cfg{cfg.actor, Device{DeviceType::cpu, cfg.device.index}, cfg.dtype, cfg.attrs, cfg.services};
    return sim::on_stream(create(op, cpu_cfg), std::string(cfg.actor));
  }
  if (it == factories_.end() && cfg.dtype == DType::bf16) {
    // No bf16 kernel of its own: the float32 one, through float32 copies (bf16.cpp).
    auto wide = factories_.find(std::make_tuple(std::string(op), cfg.device.type, DType::f32));
    if (wide != factories_.end()) {
      KernelConfig f32_cfg{cfg.actor, cfg.device, DType::f32, cfg.attrs, cfg.services};
      return detail::via_float32(wide->second(f32_cfg), cfg.device);
    }
  }
  if (it == factories_.end()) {
    std::string have;
    for (const auto& [key, f] : factories_) {
      if (std::get<0>(key) == op) {
        have += fmt::format(" {}/{}", name(std::get<1>(key)), name(std::get<2>(key)));
      }
    }
    throw std::invalid_argument(fmt::format(
        "no kernel '{}' for {}/{} (actor '{}'); {}", op, name(cfg.device.type), name(cfg.dtype),
        cfg.actor, have.empty() ? std::string("no variant of that op is registered")
                                : "registered variants:" + have));
  }
  auto kernel = it->second(cfg);
  if (!kernel) {
    throw std::invalid_argument(
        fmt::format("kernel factory for '{}' returned nothing (actor '{}')", op, cfg.actor));
  }
  return kernel;
}

std::string KernelRegistry::describe() const {
  std::string out;
  std::string last;
  for (const auto& [key, f] : factories_) {
    if (std::get<0>(key) != last) {
      if (!last.empty()) out += '\n';
      last = std::get<0>(key);
      out += last + ':';
    }
    out += fmt::format(" {}/{}", name(std::get<1>(key)), name(std::get<2>(key)));
  }
  return out;
}

bool KernelRegistry::contains_op(std::string_view op) const {
  auto it = factories_.lower_bound(std::make_tuple(std::string(op), DeviceType{}, DType{}));
  return it != factories_.end() && std::get<0>(it->first) == op;
}

namespace {
struct ProcessWide {
  std::mutex mutex;
  std::vector<std::tuple<std::string, DeviceType, DType, KernelFactory>> kernels;
};
ProcessWide& process_wide() {
  static ProcessWide p;
  return p;
}
}  // namespace

void KernelRegistry::add_process_wide(std::string op, DeviceType device, DType dtype, KernelFactory factory) {
  ProcessWide& p = process_wide();
  std::lock_guard lock(p.mutex);
  p.kernels.emplace_back(std::move(op), device, dtype, std::move(factory));
}

KernelRegistry KernelRegistry::with_builtin_kernels() {
  KernelRegistry reg;
  {
    ProcessWide& p = process_wide();
    std::lock_guard lock(p.mutex);
    for (const auto& [op, device, dtype, factory] : p.kernels) reg.add(op, device, dtype, factory);
  }
  add_cpu_kernels(reg);
  add_cpu_tensor_ops(reg);
  add_cpu_nn_ops(reg);
  cuda::add_cuda_kernels(reg);
  sim::add_sim_kernels(reg);
  detail::add_cast_kernels(reg);
  nccl::add_nccl_kernels(reg);
  return reg;
}

}  // namespace baton
