// The CUDA device in a build without a CUDA toolkit: every entry point says so.
#include <stdexcept>

#include "baton/kernels/cuda.h"
#include "baton/kernels/tensor.h"

namespace baton::cuda {

struct Stream::Impl {};

namespace {
[[noreturn]] void unavailable(std::string_view what) {
  throw std::runtime_error(std::string(what) + ": baton was built without CUDA (BATON_WITH_CUDA off or no toolkit found)");
}
}  // namespace

const Availability& availability() {
  static const Availability a{false, 0, "built without CUDA"};
  return a;
}
bool built_with_cuda() { return false; }
const CudnnAttention& cudnn_attention() {
  static const CudnnAttention a{false, "", "built without CUDA"};
  return a;
}
std::string cudnn_attention_check(std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, int, std::int64_t) {
  return "built without CUDA";
}

Stream::Stream(Device device, std::string owner) : device_(device), owner_(std::move(owner)) {}
Stream::~Stream() = default;
std::unique_ptr<Stream> Stream::create(Device device, std::string_view owner) {
  unavailable(std::string(owner) + ": a stream on " + device.str());
}
std::unique_ptr<StreamEvent> Stream::make_event() { unavailable(owner_); }
void Stream::record(StreamEvent&) { unavailable(owner_); }
std::unique_ptr<StreamEvent> Stream::make_timing_event() { unavailable(owner_); }
std::optional<double> Stream::elapsed_ms(const StreamEvent&, const StreamEvent&) const { return std::nullopt; }
void Stream::wait(const StreamEvent&) { unavailable(owner_); }
bool Stream::idle() const { return true; }
void Stream::when_reached(void (*)(void*), void*) { unavailable(owner_); }
void Stream::synchronize() { unavailable(owner_); }
std::string Stream::failure() const { return {}; }
void Stream::bind() const { unavailable(owner_); }
void Stream::begin_capture() { unavailable(owner_); }
std::unique_ptr<StreamGraph> Stream::end_capture() { unavailable(owner_); }
void Stream::launch(StreamGraph&) { unavailable(owner_); }

std::unique_ptr<Allocator> make_device_allocator(Device device) { unavailable("memory on " + device.str()); }
DeviceMemoryStats device_memory(Device) { return {}; }
void reset_peak_device_memory(Device) {}
std::unique_ptr<Allocator> make_pinned_allocator(Device) { unavailable("pinned host memory"); }
void copy(Tensor&, const Tensor&, Stream&) { unavailable("copy"); }
void sgd_step(float*, const float*, float*, std::int64_t, const SgdConfig&, std::int64_t, double, Stream&, Tensor*) {
  unavailable("sgd_step");
}
void adam_step(float*, const float*, float*, float*, std::int64_t, const AdamConfig&, std::int64_t, double, Stream&,
               Tensor*) {
  unavailable("adam_step");
}
void adam_step_multi(std::span<const AdamSlice>, const AdamConfig&, std::int64_t, double, Stream&, float) {
  unavailable("adam_step_multi");
}
void sgd_step_multi(std::span<const SgdSlice>, const SgdConfig&, std::int64_t, double, Stream&, float) {
  unavailable("sgd_step_multi");
}
void scale(float*, std::int64_t, float, Stream&) { unavailable("scale"); }
void convert(Tensor&, const Tensor&, Stream&) { unavailable("convert"); }
void add_cuda_kernels(KernelRegistry&) {}
void add_collective_kernels(KernelRegistry&) {}

}  // namespace baton::cuda
