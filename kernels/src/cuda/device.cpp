// The CUDA device: availability, streams, pooled device memory and pinned host memory.
#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "baton/kernels/tensor.h"
#include "common.h"
#include "convert.h"
#include "launch.h"

namespace baton::cuda {

const Availability& availability() {
  // Asked once: cudaGetDeviceCount is the call that reports a missing driver (error 35) or a
  // machine without a GPU, and its answer does not change while the process runs.
  static const Availability a = [] {
    Availability r;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      r.reason = fmt::format("no CUDA driver: {} ({})", cudaGetErrorName(e), static_cast<int>(e));
      if (e != cudaErrorInsufficientDriver && e != cudaErrorNoDevice) r.reason += std::string(": ") + cudaGetErrorString(e);
      return r;
    }
    if (n == 0) {
      r.reason = "no CUDA device";
      return r;
    }
    r.ok = true;
    r.devices = n;
    return r;
  }();
  return a;
}

bool built_with_cuda() { return true; }

Stream::Stream(Device device, std::string owner)
    : device_(device), owner_(std::move(owner)), impl_(std::make_unique<Impl>()) {}

std::unique_ptr<Stream> Stream::create(Device device, std::string_view owner) {
  if (device.type != DeviceType::cuda) {
    throw std::invalid_argument(fmt::format("{}: a CUDA stream on {}, which is not a CUDA device", owner, device.str()));
  }
  const auto& a = availability();
  if (!a.ok) throw std::runtime_error(fmt::format("{}: cannot use {}: {}", owner, device.str(), a.reason));
  if (device.index >= a.devices) {
    throw std::runtime_error(fmt::format("{}: {} does not exist ({} CUDA devices)", owner, device.str(), a.devices));
  }
  std::unique_ptr<Stream> s(new Stream(device, std::string(owner)));
  const std::string& who = s->owner_;
  s->bind();
  BATON_CUDA_CHECK(cudaStreamCreateWithFlags(&s->impl_->stream, cudaStreamNonBlocking), who);
  BATON_CUDA_CHECK(cublasCreate(&s->impl_->blas), who);
  BATON_CUDA_CHECK(cublasSetStream(s->impl_->blas, s->impl_->stream), who);
  // Full float32 products: no TF32 unless asked for, so that results match the CPU's.
  BATON_CUDA_CHECK(cublasSetMathMode(s->impl_->blas, CUBLAS_DEFAULT_MATH), who);
  return s;
}

Stream::~Stream() {
  if (!impl_) return;
  // Work still queued may read or write memory that is freed next: wait for it first.
  cudaSetDevice(device_.index);
  if (impl_->stream != nullptr) cudaStreamSynchronize(impl_->stream);
  if (impl_->blas != nullptr) cublasDestroy(impl_->blas);
  if (impl_->stream != nullptr) cudaStreamDestroy(impl_->stream);
}

void Stream::bind() const {
  // Asks the runtime rather than remembering what we set last: other calls switch the current
  // device behind our back (the allocators' cudaSetDevice, ~Stream), and a remembered value
  // would then skip the switch, creating a stream or cuBLAS handle on, or launching from, the
  // wrong device. cudaGetDevice reads a thread-local; no driver round trip.
  int current = -1;
  BATON_CUDA_CHECK(cudaGetDevice(&current), owner_);
  if (current != device_.index) BATON_CUDA_CHECK(cudaSetDevice(device_.index), owner_);
}

namespace {
struct Event final : StreamEvent {
  cudaEvent_t event = nullptr;
  int device = 0;
  ~Event() override {
    if (event != nullptr) cudaEventDestroy(event);
  }
};

const Event& cuda_event(const StreamEvent& e, const std::string& who) {
  const auto* ev = dynamic_cast<const Event*>(&e);
  if (ev == nullptr) throw std::invalid_argument(fmt::format("{}: an event of another kind of stream (not CUDA)", who));
  return *ev;
}
}  // namespace

std::unique_ptr<StreamEvent> Stream::make_event() {
  bind();
  auto e = std::make_unique<Event>();
  e->device = device_.index;
  BATON_CUDA_CHECK(cudaEventCreateWithFlags(&e->event, cudaEventDisableTiming), owner_);
  return e;
}

std::unique_ptr<StreamEvent> Stream::make_timing_event() {
  bind();
  auto e = std::make_unique<Event>();
  e->device = device_.index;
  BATON_CUDA_CHECK(cudaEventCreateWithFlags(&e->event, cudaEventDefault), owner_);
  return e;
}

std::optional<double> Stream::elapsed_ms(const StreamEvent& start, const StreamEvent& end) const {
  float ms = 0;
  const cudaError_t e = cudaEventElapsedTime(&ms, cuda_event(start, owner_).event, cuda_event(end, owner_).event);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not ready (or never recorded): not an error of the stream's
    return std::nullopt;
  }
  return static_cast<double>(ms);
}

void Stream::record(StreamEvent& e) {
  const Event& ev = cuda_event(e, owner_);
  bind();
  BATON_CUDA_CHECK(cudaEventRecord(ev.event, impl_->stream), owner_);
}

void Stream::wait(const StreamEvent& e) {
  const Event& ev = cuda_event(e, owner_);
  bind();
  BATON_CUDA_CHECK(cudaStreamWaitEvent(impl_->stream, ev.event, 0), owner_);
}

bool Stream::idle() const {
  std::lock_guard lock(impl_->capture_mutex);
  if (impl_->capturing) return false;  // the captured work has not run (nor been launched)
  return cudaStreamQuery(impl_->stream) != cudaErrorNotReady;
}

void Stream::when_reached(void (*fn)(void*), void* arg) {
  BATON_CUDA_CHECK(cudaLaunchHostFunc(impl_->stream, fn, arg), owner_);
}

void Stream::synchronize() { BATON_CUDA_CHECK(cudaStreamSynchronize(impl_->stream), owner_); }

namespace {

struct CudaGraph final : StreamGraph {
  cudaGraphExec_t exec = nullptr;
  ~CudaGraph() override {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
};

}  // namespace

void Stream::begin_capture() {
  bind();
  std::lock_guard lock(impl_->capture_mutex);
  BATON_CUDA_CHECK(cudaStreamBeginCapture(impl_->stream, cudaStreamCaptureModeThreadLocal), owner_);
  impl_->capturing = true;
}

std::unique_ptr<StreamGraph> Stream::end_capture() {
  bind();
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaSuccess;
  {
    std::lock_guard lock(impl_->capture_mutex);
    e = cudaStreamEndCapture(impl_->stream, &graph);
    impl_->capturing = false;
  }
  if (e != cudaSuccess || graph == nullptr) {
    (void)cudaGetLastError();  // a failed capture's error is not sticky: clear it
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw std::runtime_error(fmt::format("{}: the capture is invalid: {} ({})", owner_, cudaGetErrorName(e),
                                         cudaGetErrorString(e)));
  }
  auto g = std::make_unique<CudaGraph>();
  const cudaError_t made = cudaGraphInstantiate(&g->exec, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) {
    (void)cudaGetLastError();
    g->exec = nullptr;
    throw std::runtime_error(fmt::format("{}: cudaGraphInstantiate failed: {} ({})", owner_, cudaGetErrorName(made),
                                         cudaGetErrorString(made)));
  }
  return g;
}

void Stream::launch(StreamGraph& g) {
  auto* graph = dynamic_cast<CudaGraph*>(&g);
  if (graph == nullptr || graph->exec == nullptr) {
    throw std::invalid_argument(owner_ + ": launch of a graph that is not a CUDA stream's");
  }
  bind();
  BATON_CUDA_CHECK(cudaGraphLaunch(graph->exec, impl_->stream), owner_);
}

std::string Stream::failure() const {
  std::lock_guard lock(impl_->capture_mutex);
  if (impl_->capturing) return {};  // known once the capture has ended
  const cudaError_t e = cudaStreamQuery(impl_->stream);
  if (e == cudaSuccess || e == cudaErrorNotReady) return {};
  return fmt::format("{}: its CUDA work failed: {} ({}): {}", owner_, cudaGetErrorName(e), static_cast<int>(e),
                     cudaGetErrorString(e));
}

namespace {

// device_memory()'s counters, one set per device index.
struct Counters {
  std::mutex mutex;
  std::int64_t in_use = 0, peak = 0, reserved = 0;
};

Counters* counters(Device d) {
  static std::array<Counters, Device::max_index + 1> all;
  return d.index < all.size() ? &all[d.index] : nullptr;
}

void count(Device d, std::int64_t in_use, std::int64_t reserved) noexcept {
  Counters* c_or_null = counters(d);
  if (c_or_null == nullptr) return;
  Counters& c = *c_or_null;
  std::lock_guard lock(c.mutex);
  c.in_use += in_use;
  c.reserved += reserved;
  c.peak = std::max(c.peak, c.in_use);
}

}  // namespace

void count_device_bytes(int index, std::int64_t bytes) noexcept {
  if (bytes == 0 || index < 0 || index > Device::max_index) return;
  count(Device{DeviceType::cuda, static_cast<std::uint8_t>(index)}, bytes, bytes);
}

namespace {

// Pooled by exact size: registers are allocated once per plan, in few sizes, and a plan made
// again (a test, a second run) gets its blocks back without cudaMalloc's device-wide sync.
class DeviceAllocator final : public Allocator {
 public:
  // The counters first, so that they outlive every allocator (function-local statics are
  // destroyed in the reverse order of their construction).
  explicit DeviceAllocator(Device d) : device_(d) { (void)counters(d); }
  ~DeviceAllocator() override {
    cudaSetDevice(device_.index);
    for (auto& [bytes, blocks] : free_) {
      for (void* p : blocks) cudaFree(p);
      count(device_, 0, -static_cast<std::int64_t>(bytes * blocks.size()));
    }
  }
  void* allocate(std::size_t bytes) override {
    const std::size_t size = bytes == 0 ? 256 : bytes;
    {
      std::lock_guard lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        count(device_, static_cast<std::int64_t>(size), 0);
        return p;
      }
    }
    void* p = nullptr;
    cudaSetDevice(device_.index);
    if (cudaError_t e = cudaMalloc(&p, size); e != cudaSuccess) {
      cudaGetLastError();  // clear it: an allocation failure is not sticky
      throw std::runtime_error(fmt::format("cudaMalloc of {} bytes on {} failed: {}", size, device_.str(),
                                           cudaGetErrorString(e)));
    }
    count(device_, static_cast<std::int64_t>(size), static_cast<std::int64_t>(size));
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    const std::size_t size = bytes == 0 ? 256 : bytes;
    {
      std::lock_guard lock(mutex_);
      free_[size].push_back(p);
    }
    count(device_, -static_cast<std::int64_t>(size), 0);
  }
  Device device() const override { return device_; }

 private:
  Device device_;
  std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> free_;
};

class PinnedAllocator final : public Allocator {
 public:
  explicit PinnedAllocator(Device host) : host_(host) {}
  void* allocate(std::size_t bytes) override {
    void* p = nullptr;
    if (cudaError_t e = cudaMallocHost(&p, bytes == 0 ? 64 : bytes); e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(fmt::format("cudaMallocHost of {} bytes failed: {}", bytes, cudaGetErrorString(e)));
    }
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override { cudaFreeHost(p); }
  Device device() const override { return host_; }

 private:
  Device host_;
};

}  // namespace

DeviceMemoryStats device_memory(Device device) {
  Counters* c = counters(device);
  if (c == nullptr) return {};
  std::lock_guard lock(c->mutex);
  return {c->in_use, c->peak, c->reserved};
}

void reset_peak_device_memory(Device device) {
  Counters* c = counters(device);
  if (c == nullptr) return;
  std::lock_guard lock(c->mutex);
  c->peak = c->in_use;
}

std::unique_ptr<Allocator> make_device_allocator(Device device) {
  const auto& a = availability();
  if (!a.ok) throw std::runtime_error(fmt::format("memory on {}: {}", device.str(), a.reason));
  return std::make_unique<DeviceAllocator>(device);
}

std::unique_ptr<Allocator> make_pinned_allocator(Device host) {
  const auto& a = availability();
  if (!a.ok) throw std::runtime_error("pinned host memory: " + a.reason);
  return std::make_unique<PinnedAllocator>(host);
}

void copy(Tensor& dst, const Tensor& src, Stream& stream) {
  if (dst.nbytes() != src.nbytes()) {
    throw std::invalid_argument(fmt::format("{}: copy from {} into {}: sizes differ", stream.owner(), src.describe(),
                                            dst.describe()));
  }
  if (src.nbytes() == 0) return;
  stream.bind();
  // cudaMemcpyDefault: unified addressing tells host from device (and one device from another).
  BATON_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDefault, stream.impl().stream),
                   fmt::format("{} (copy {} -> {})", stream.owner(), src.describe(), dst.describe()));
}

void scale(float* x, std::int64_t n, float factor, Stream& stream) {
  if (n == 0) return;
  stream.bind();
  BATON_CUDA_CHECK(launch::unary(launch::Unary::scale, x, x, n, factor, stream.impl().stream),
                   fmt::format("{} (scale of {} elements)", stream.owner(), n));
}

void convert(Tensor& dst, const Tensor& src, Stream& stream) {
  auto kind = [](DType t) { return t == DType::f32 ? 0 : t == DType::bf16 ? 1 : -1; };
  if (dst.numel() != src.numel() || kind(dst.dtype()) < 0 || kind(src.dtype()) < 0) {
    throw std::invalid_argument(fmt::format("{}: convert {} into {}: same size, f32 or bf16 only", stream.owner(),
                                            src.describe(), dst.describe()));
  }
  stream.bind();
  BATON_CUDA_CHECK(launch::convert(src.raw(), kind(src.dtype()), dst.raw(), kind(dst.dtype()), src.numel(),
                                   stream.impl().stream),
                   fmt::format("{} (convert {} -> {})", stream.owner(), src.describe(), dst.describe()));
}

}  // namespace baton::cuda
