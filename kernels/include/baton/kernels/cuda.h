#pragma once
/// The CUDA device: whether it can be used, its streams and its memory. This header needs no
/// CUDA headers and exists in every build; without the CUDA path (BATON_HAS_CUDA undefined) or
/// without a driver, availability() says why and everything else throws std::runtime_error.
///
///   if (auto a = baton::cuda::availability(); !a.ok) fmt::print("{}\n", a.reason);
///   auto stream = baton::cuda::Stream::create(baton::Device::parse("cuda:0"), "my-actor");
///   auto alloc = baton::cuda::make_device_allocator(stream->device());
///   baton::Tensor t = baton::Tensor::empty({4, 4}, baton::f32, *alloc);   // device memory
///   baton::cuda::copy(t, host_tensor, *stream);  stream->synchronize();
///
/// Kernels registered for DeviceType::cuda find their actor's stream in KernelContext::stream
/// and only enqueue work on it. The runtime orders what reads their registers by stream order
/// and events (baton/kernels/stream.h), and waits for the stream on the host only where the
/// host must see the data (Stream::when_reached).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "baton/kernels/allocator.h"
#include "baton/kernels/device.h"
#include "baton/kernels/optim.h"
#include "baton/kernels/stream.h"

namespace baton {
class KernelRegistry;
class Tensor;
}  // namespace baton

namespace baton::cuda {

/// Whether CUDA devices can be used in this process, and if not, why: "built without CUDA",
/// "no CUDA driver: cudaErrorInsufficientDriver (35)", "no CUDA device".
struct Availability {
  bool ok = false;
  int devices = 0;
  std::string reason;
};
/// Asked once per process (the answer is cached). Thread-safe.
const Availability& availability();
/// True if this build has the CUDA path (BATON_HAS_CUDA).
bool built_with_cuda();

/// A CUDA stream on one device with the cuBLAS handle that launches on it: what one worker
/// thread enqueues its actors' work on. Move-only owner; the destructor waits for the stream's
/// work, then destroys it (never throws). Methods may be called from one thread at a time,
/// except failure() and idle().
class Stream final : public AsyncStream {
 public:
  /// Throws std::runtime_error naming `owner` (an actor or worker), the CUDA call and its error.
  static std::unique_ptr<Stream> create(Device device, std::string_view owner);
  ~Stream() override;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  Device device() const override { return device_; }
  const std::string& owner() const override { return owner_; }
  /// A cudaEvent_t without timing (cudaEventDisableTiming).
  std::unique_ptr<StreamEvent> make_event() override;
  /// A cudaEvent_t with timing.
  std::unique_ptr<StreamEvent> make_timing_event() override;
  /// cudaEventElapsedTime; nullopt while cudaErrorNotReady.
  std::optional<double> elapsed_ms(const StreamEvent& start, const StreamEvent& end) const override;
  /// cudaEventRecord on this stream.
  void record(StreamEvent& e) override;
  /// cudaStreamWaitEvent: no host wait. `e` may come from a stream of another device.
  void wait(const StreamEvent& e) override;
  /// Calls fn(arg) on a CUDA driver thread once all work enqueued so far has finished
  /// (cudaLaunchHostFunc). fn must not call CUDA; it should only hand a message on. Throws.
  void when_reached(void (*fn)(void*), void* arg) override;
  /// Blocks until the stream's work is done; throws naming the owner if any of it failed.
  void synchronize() override;
  /// Without waiting: "" while the stream's work is running or done, else "<owner>: <the CUDA
  /// error>" once it failed (a device fault is sticky, and then no when_reached callback runs:
  /// the runtime polls this so that such a job fails instead of waiting). Any thread.
  std::string failure() const override;
  /// cudaStreamQuery: the work enqueued so far has finished (or failed). Any thread.
  bool idle() const override;
  /// Makes this stream's device current on the calling thread (cheap when it already is).
  void bind() const override;
  /// cudaStreamBeginCapture (thread-local mode: what this thread calls that cannot be captured
  /// fails and invalidates the capture); end_capture: cudaStreamEndCapture and
  /// cudaGraphInstantiate, throwing (the capture ended) if the capture was invalidated; launch:
  /// cudaGraphLaunch on this stream.
  void begin_capture() override;
  std::unique_ptr<StreamGraph> end_capture() override;
  void launch(StreamGraph& g) override;

  struct Impl;  // the CUDA handles (kernels/src/cuda/common.h)
  Impl& impl() { return *impl_; }

 private:
  Stream(Device device, std::string owner);
  Device device_;
  std::string owner_;
  std::unique_ptr<Impl> impl_;
};

/// Device memory from cudaMalloc, pooled by size: a freed block waits for the next request of
/// the same size (registers are allocated once, with few distinct sizes). The pool returns
/// everything to CUDA when the allocator is destroyed. Throws std::bad_alloc naming the size.
std::unique_ptr<Allocator> make_device_allocator(Device device);

/// What baton holds on one device, process-wide, in bytes: its device allocators
/// (make_device_allocator: registers, kept state such as master weights and optimizer slots,
/// cuBLASLt's workspaces) and the kernels' own scratch (attention's, cuDNN's workspace, the
/// losses' partial sums): `in_use` handed out now, `peak` the most
/// handed out at once since the last reset_peak_device_memory (torch.cuda.max_memory_allocated's
/// counterpart), `reserved` obtained from cudaMalloc and not yet freed (pools included:
/// max_memory_reserved's). Not counted: the CUDA context, and what cuBLAS, cuDNN and NCCL
/// allocate for themselves. All zero in a build without CUDA.
struct DeviceMemoryStats {
  std::int64_t in_use = 0, peak = 0, reserved = 0;
};
DeviceMemoryStats device_memory(Device device);
/// Starts a new peak for device_memory(): peak := in_use.
void reset_peak_device_memory(Device device);
/// Page-locked host memory (cudaMallocHost) for registers that cross to and from a device, so
/// that copies run on the copy engines without a staging copy. The device it reports is `host`.
std::unique_ptr<Allocator> make_pinned_allocator(Device host);

/// Copies src into dst (same byte size; either may be on the host or a device) in `stream`'s
/// order. Throws naming both tensors and the CUDA error.
void copy(Tensor& dst, const Tensor& src, Stream& stream);

/// The optimizer steps of baton/kernels/optim.h on float32 device memory (w, g, buffers of n
/// elements each), enqueued on `stream`, element for element the CPU's arithmetic. `copy`, if
/// given (n elements of f32 or bf16 device memory), receives the new weights in the same pass:
/// the value the variable's readers take (bf16 rounded to nearest even, as convert()), so no
/// copy or cast kernel follows the step. Throws as the CPU versions do, naming the stream's
/// owner (and a copy of another size or dtype).
void sgd_step(float* w, const float* g, float* momentum_buf, std::int64_t n, const SgdConfig& cfg, std::int64_t step,
              double lr, Stream& stream, Tensor* copy = nullptr);
void adam_step(float* w, const float* g, float* m, float* v, std::int64_t n, const AdamConfig& cfg, std::int64_t step,
               double lr, Stream& stream, Tensor* copy = nullptr);

/// One weight of a multi-tensor step: n float32 elements of device memory in each array, and
/// where the step also writes the new weights (`copy`: f32 or bf16 of n elements, as
/// adam_step's; null: nowhere).
struct AdamSlice {
  float* w;
  const float* g;
  float* m;
  float* v;
  std::int64_t n;
  Tensor* copy = nullptr;
};
struct SgdSlice {
  float* w;
  const float* g;
  float* momentum_buf;  ///< may be null when the momentum is 0
  std::int64_t n;
  Tensor* copy = nullptr;
};
/// adam_step / sgd_step over many weights in a few launches (one per 36 weights or 320 chunks
/// of 64 Ki elements, the pointers in the kernel's arguments, as PyTorch's multi_tensor_apply):
/// the per-weight launches of a step cost more than their work for small weights. Every
/// element's arithmetic is adam_step's (sgd_step's), so the results are theirs bit for bit.
/// `grad_scale` (gradient clipping's factor) multiplies each gradient element first, rounded to
/// float as scale() rounds it, so a clipped step is scale() and then the step, bit for bit,
/// without the scaled copy; 1: the gradients as they are. A variable actor group on a CUDA
/// device (graph/src/device_variables.cpp) steps a device's weights with these.
///   std::vector<cuda::AdamSlice> all = {{w1, g1, m1, v1, n1}, {w2, g2, m2, v2, n2, &w2_bf16}};
///   cuda::adam_step_multi(all, cfg, step, lr, stream);
void adam_step_multi(std::span<const AdamSlice> tensors, const AdamConfig& cfg, std::int64_t step, double lr,
                     Stream& stream, float grad_scale = 1.0f);
void sgd_step_multi(std::span<const SgdSlice> tensors, const SgdConfig& cfg, std::int64_t step, double lr,
                    Stream& stream, float grad_scale = 1.0f);

/// dst = src converted element for element between float32 and bfloat16 (or copied, same
/// dtype), both in device memory, on `stream`; rounds to nearest even into bf16. Throws naming
/// both tensors for other dtypes or sizes.
void convert(Tensor& dst, const Tensor& src, Stream& stream);

/// x *= factor on n float32 elements of device memory, enqueued on `stream` (gradient clipping
/// in a variable actor on a CUDA device). The product rounds once, as the CPU's does.
void scale(float* x, std::int64_t n, float factor, Stream& stream);

/// Whether cuDNN's fused attention (what the attention op's CUDA kernels run under attr kernel
/// auto or cudnn) can be used in this process: cuDNN 9 loaded at run time (libcudnn.so.9 as the
/// dynamic loader finds it, BATON_CUDNN_PATH, or PyTorch's wheel), its version, and if not, why.
struct CudnnAttention {
  bool ok = false;
  std::string version;  // "9.19.0"
  std::string reason;   // why not, when !ok
};
/// Asked once per process (cached); thread-safe. In a build without CUDA: "built without CUDA".
const CudnnAttention& cudnn_attention();
/// Builds cuDNN's bf16 attention graphs, forward and backward, for q [b, h, s, d] as far as a
/// machine without a GPU can (every descriptor finalized by cuDNN; from cuDNN 9.8 the operation
/// graphs too; not the engines, which need the device), for a GPU of compute capability `sm`
/// (90: Hopper), with the backward's dq, dk and dv side by side and apart; `h_kv` key and value
/// heads (0: h; fewer, dividing h, for grouped-query heads: then only apart). "" when all
/// finalize, else why not (cuDNN's message). A check for CI machines.
std::string cudnn_attention_check(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, bool causal,
                                  int sm = 90, std::int64_t h_kv = 0);

/// Registers the CUDA kernels (kernels/src/cuda/ops.cpp lists them) for DeviceType::cuda; does
/// nothing in a build without CUDA. KernelRegistry::with_builtin_kernels() calls it.
void add_cuda_kernels(KernelRegistry& reg);
/// Registers the CUDA kernels of the all-reduce's actors (allreduce.slice, .add, .sum, .split,
/// .concat for f32 and f64; baton/graph/collectives.h), so that an all-reduce among actors on
/// CUDA devices of one process runs there; an input on another device (or the host) is copied
/// to the actor's device first. Does nothing without CUDA. baton::add_collective_kernels calls it.
void add_collective_kernels(KernelRegistry& reg);

}  // namespace baton::cuda
