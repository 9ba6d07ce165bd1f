#pragma once
/// Kernels and the registry that finds them by (op, device type, dtype).
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "baton/kernels/attrs.h"
#include "baton/kernels/device.h"
#include "baton/kernels/dtype.h"
#include "baton/kernels/tensor.h"

namespace baton {

class AsyncStream;
namespace cuda {
class Stream;
}
namespace nccl {
class Communicators;
}
class Store;

/// What a kernel sees when its actor acts. The tensors are the register slots themselves: a
/// kernel reads its inputs in place and writes its outputs in place. An input pointer is null
/// when the actor's input has no piece for this act yet (an input with a delay, at its start).
struct KernelContext {
  std::span<const Tensor* const> inputs;
  std::span<Tensor* const> outputs;
  /// The act's sequence number: for a source, the piece it writes.
  std::int64_t piece = 0;
  /// The actor's CUDA stream (baton/kernels/cuda.h) when it runs on a CUDA device, else null:
  /// a CUDA kernel only enqueues its work there.
  cuda::Stream* stream = nullptr;
  /// The actor's stream on any asynchronous device (CUDA or sim; baton/kernels/stream.h), else
  /// null. On a CUDA device it is `stream`.
  AsyncStream* async_stream = nullptr;
};

/// One kernel instance per actor, created when a plan is instantiated; it may keep state
/// between acts (an RNG, a running sum). compute() runs on the actor's worker thread only.
class Kernel {
 public:
  virtual ~Kernel() = default;
  /// Throws to fail the job: the runtime reports the actor's name, the piece and what().
  virtual void compute(KernelContext& ctx) = 0;
  /// Memory the kernel keeps that its output `output` may be (RegisterDesc::kernel_memory: the
  /// register's one slot is then this tensor, not bytes the runtime allocates): a weight that
  /// its optimizer updates in place, read where it lies. The handshakes keep the kernel's next
  /// write and the readers of its last one apart, as for any slot. Empty: none (the runtime
  /// allocates the slot as usual).
  virtual Tensor owned_output(std::size_t /*output*/) { return {}; }
};

/// What the runtime of one run offers its kernels beyond their actor's registers: the job's
/// shared values and NCCL communicators. Owned by the runtime; valid while it lives.
struct KernelServices {
  /// The job rank this runtime plays.
  std::uint16_t rank = 0;
  /// Values shared with the job's other ranks (baton/kernels/store.h); null in a job of one rank.
  Store* store = nullptr;
  /// This run's NCCL communicators, made on first use (baton/kernels/nccl.h).
  nccl::Communicators* nccl = nullptr;
  /// Set once the run has failed: a kernel that waits (for a peer, a device) gives up early.
  const std::atomic<bool>* failed = nullptr;
};

/// What a factory knows about the actor it makes a kernel for.
struct KernelConfig {
  std::string_view actor;
  Device device;
  DType dtype;
  const Attrs& attrs;
  /// Null where a kernel is made outside a runtime (tests of single kernels).
  const KernelServices* services = nullptr;
};

using KernelFactory = std::function<std::unique_ptr<Kernel>(const KernelConfig&)>;

/// The factory of a stateless kernel: each actor's kernel calls `fn`.
KernelFactory kernel_of(std::function<void(KernelContext&)> fn);

/// Kernels by (op, device type, dtype). A registry is a plain object: build one with the
/// built-in kernels and add your own (tests add checking kernels this way).
///
///   auto reg = baton::KernelRegistry::with_builtin_kernels();
///   reg.add_fn("double_it", DeviceType::cpu, f32, [](KernelContext& c) { ... });
class KernelRegistry {
 public:
  void add(std::string op, DeviceType device, DType dtype, KernelFactory factory);
  /// Registers a stateless kernel function.
  void add_fn(std::string op, DeviceType device, DType dtype,
              std::function<void(KernelContext&)> fn);

  bool contains(std::string_view op, DeviceType device, DType dtype) const;
  /// Whether any variant of `op` is registered.
  bool contains_op(std::string_view op) const;
  /// Makes the kernel for an actor; throws std::invalid_argument naming the op, device and
  /// dtype, and the variants that do exist, if there is none.
  std::unique_ptr<Kernel> create(std::string_view op, const KernelConfig& cfg) const;
  /// "add: cpu/f32 cpu/f64 ..." one line per op.
  std::string describe() const;

  /// A registry holding every built-in kernel (builtin_kernels.cpp lists them), and the
  /// kernels added process-wide (add_process_wide).
  static KernelRegistry with_builtin_kernels();
  /// Adds a kernel to every registry with_builtin_kernels() makes from now on (the kernels of
  /// an op a user registers, baton/graph/op_registry.h). Thread-safe.
  static void add_process_wide(std::string op, DeviceType device, DType dtype, KernelFactory factory);

 private:
  using Key = std::tuple<std::string, DeviceType, DType>;
  std::map<Key, KernelFactory, std::less<>> factories_;
};

/// Adds the built-in CPU kernels: noop, copy, add, fill_piece, spin_ns, sleep_ns.
void add_cpu_kernels(KernelRegistry& reg);

}  // namespace baton
