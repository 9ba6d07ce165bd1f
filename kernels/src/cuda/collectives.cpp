// The CUDA kernels of the all-reduce's actors (baton/graph/collectives.h): slices, splits and
// gathers are cudaMemcpyAsync (which crosses devices by itself), the adds a kernel on the
// actor's device, each element's sum in the CPU's order so every member gets the CPU's bits.
#include <memory>
#include <string>
#include <string_view>

#include "../kernel_args.h"
#include "baton/kernels/cuda.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/tensor.h"
#include "common.h"
#include "kernel_util.h"
#include "launch.h"

namespace baton::cuda {

namespace {

using baton::detail::need_input;
using baton::detail::need_output;
using util::at_elem;
using util::check_same_dtype;
using util::launched;
using util::Scratch;
using util::stream_of;

// The bytes of `t` from element `offset`, as the actor's device can read them in a kernel: in
// place when they are on that device (or managed), else first copied (cudaMemcpyDefault: from
// another device or the host) into `scratch`, in the stream's order.
const void* readable(const Tensor& t, std::int64_t offset, std::size_t bytes, Scratch& scratch, KernelContext& ctx) {
  const void* p = at_elem(t, offset);
  if (bytes == 0) return p;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    // Not sticky, but the next launch's cudaGetLastError would report it: clear it, and copy.
    cudaGetLastError();
    attr.type = cudaMemoryTypeUnregistered;
  }
  const bool here = (attr.type == cudaMemoryTypeDevice && attr.device == ctx.stream->device().index) ||
                    attr.type == cudaMemoryTypeManaged;
  if (here) return p;
  void* local = scratch.get(bytes, ctx);
  check(cudaMemcpyAsync(local, p, bytes, cudaMemcpyDefault, ctx.stream->impl().stream), "cudaMemcpyAsync",
        ctx.stream->owner());
  return local;
}

// Elements [offset, offset + count) of `t`, or an error naming the actor (as the CPU's window()).
void check_window(const Tensor& t, std::int64_t offset, std::int64_t count, std::string_view actor) {
  if (offset < 0 || offset + count > t.numel()) {
    throw std::runtime_error(fmt::format("{}: elements [{}, {}) lie outside its input of {}", actor, offset, offset + count,
                                         t.numel()));
  }
}

template <class T>
void check_dtype_is(const Tensor& t, std::string_view actor) {
  if (t.dtype() != dtype_of<T>()) {
    throw std::invalid_argument(fmt::format("{}: {} is not {}", actor, t.describe(), baton::name(dtype_of<T>())));
  }
}

/// out = input[offset, offset + out's size).
class AllreduceSlice final : public Kernel {
 public:
  AllreduceSlice(std::string_view actor, std::int64_t offset) : actor_(actor), offset_(offset) {}
  void compute(KernelContext& ctx) override {
    const Tensor& in = need_input(ctx, 0, "allreduce.slice");
    Tensor& out = need_output(ctx, 0, "allreduce.slice");
    check_same_dtype(in, out, "allreduce.slice");
    check_window(in, offset_, out.numel(), actor_);
    cudaStream_t s = stream_of(ctx, "allreduce.slice");
    if (out.nbytes() == 0) return;
    launched(cudaMemcpyAsync(out.raw(), at_elem(in, offset_), out.nbytes(), cudaMemcpyDefault, s), "allreduce.slice", ctx);
  }

 private:
  std::string actor_;
  std::int64_t offset_;
};

/// out = partial[from or 0, ...) + own[offset, ...), in T, as the CPU.
template <class T>
class AllreduceAdd final : public Kernel {
 public:
  AllreduceAdd(std::string_view actor, std::int64_t offset, std::int64_t from) : actor_(actor), offset_(offset), from_(from) {}
  void compute(KernelContext& ctx) override {
    const char* name = "allreduce.add";
    const Tensor& a = need_input(ctx, 0, name, "partial");
    const Tensor& b = need_input(ctx, 1, name, "own");
    Tensor& out = need_output(ctx, 0, name);
    for (const Tensor* t : {&a, &b, static_cast<const Tensor*>(&out)}) check_dtype_is<T>(*t, actor_);
    const std::int64_t n = out.numel();
    const std::int64_t from = from_ < 0 ? 0 : from_;
    check_window(a, from, n, actor_);
    check_window(b, offset_, n, actor_);
    cudaStream_t s = stream_of(ctx, name);
    const auto bytes = static_cast<std::size_t>(n) * sizeof(T);
    const auto* pa = static_cast<const T*>(readable(a, from, bytes, scratch_a_, ctx));
    const auto* pb = static_cast<const T*>(readable(b, offset_, bytes, scratch_b_, ctx));
    launched(launch::add(pa, pb, static_cast<T*>(out.raw()), n, s), name, ctx);
  }

 private:
  std::string actor_;
  std::int64_t offset_, from_;
  Scratch scratch_a_, scratch_b_;
};

/// out = in_0 + in_1 + ... left to right, in T, over elements [offset, offset + out's) of each
/// input (the two-hop all-reduce's owner sum, the direct all-reduce's and reduce-scatter's).
template <class T>
class AllreduceSum final : public Kernel {
 public:
  AllreduceSum(std::string_view actor, std::int64_t offset) : actor_(actor), offset_(offset) {}
  void compute(KernelContext& ctx) override {
    const char* name = "allreduce.sum";
    Tensor& out = need_output(ctx, 0, name);
    check_dtype_is<T>(out, actor_);
    if (ctx.inputs.empty()) throw std::invalid_argument(fmt::format("{}: allreduce.sum of no inputs", actor_));
    for (std::size_t j = 0; j < ctx.inputs.size(); ++j) {
      const Tensor& in = need_input(ctx, j, name);
      check_dtype_is<T>(in, actor_);
      if (offset_ < 0 || offset_ + out.numel() > in.numel()) {
        throw std::invalid_argument(fmt::format("{}: elements [{}, {}) lie outside input {} {}", actor_, offset_,
                                                offset_ + out.numel(), j, in.describe()));
      }
    }
    cudaStream_t s = stream_of(ctx, name);
    if (out.nbytes() == 0) return;
    auto* o = static_cast<T*>(out.raw());
    launched(cudaMemcpyAsync(o, at_elem(*ctx.inputs[0], offset_), out.nbytes(), cudaMemcpyDefault, s), name, ctx);
    for (std::size_t j = 1; j < ctx.inputs.size(); ++j) {
      const auto* in = static_cast<const T*>(readable(*ctx.inputs[j], offset_, out.nbytes(), scratch_, ctx));
      launched(launch::add(o, in, o, out.numel(), s), name, ctx);
    }
  }

 private:
  std::string actor_;
  std::int64_t offset_;
  Scratch scratch_;
};

/// The outputs, in order, are consecutive windows of the input.
void allreduce_split(KernelContext& ctx) {
  const char* name = "allreduce.split";
  const Tensor& in = need_input(ctx, 0, name);
  std::int64_t at = 0;
  for (std::size_t k = 0; k < ctx.outputs.size(); ++k) {
    const Tensor& o = need_output(ctx, k, name);
    check_same_dtype(in, o, name);
    at += o.numel();
  }
  if (at > in.numel()) {
    throw std::invalid_argument(fmt::format("{}: the outputs hold {} elements, more than input {}", name, at, in.describe()));
  }
  cudaStream_t s = stream_of(ctx, name);
  at = 0;
  for (Tensor* o : ctx.outputs) {
    if (o->nbytes() > 0) launched(cudaMemcpyAsync(o->raw(), at_elem(in, at), o->nbytes(), cudaMemcpyDefault, s), name, ctx);
    at += o->numel();
  }
}

/// The output is the inputs one after another (each may be on another device: plain copies).
void allreduce_concat(KernelContext& ctx) {
  const char* name = "allreduce.concat";
  Tensor& out = need_output(ctx, 0, name);
  std::int64_t at = 0;
  for (std::size_t k = 0; k < ctx.inputs.size(); ++k) {
    const Tensor& in = need_input(ctx, k, name);
    check_same_dtype(in, out, name);
    at += in.numel();
  }
  if (at != out.numel()) {
    throw std::invalid_argument(fmt::format("{}: the inputs hold {} elements, output {}", name, at, out.describe()));
  }
  cudaStream_t s = stream_of(ctx, name);
  at = 0;
  for (const Tensor* in : ctx.inputs) {
    if (in->nbytes() > 0) launched(cudaMemcpyAsync(at_elem(out, at), in->raw(), in->nbytes(), cudaMemcpyDefault, s), name, ctx);
    at += in->numel();
  }
}

template <class T>
void add_collectives_for(KernelRegistry& reg) {
  constexpr auto cuda = DeviceType::cuda;
  constexpr DType dt = dtype_of<T>();
  reg.add("allreduce.slice", cuda, dt, [](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    return std::make_unique<AllreduceSlice>(cfg.actor, cfg.attrs.get_int("offset", 0));
  });
  reg.add("allreduce.add", cuda, dt, [](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
    return std::make_unique<AllreduceAdd<T>>(cfg.actor, cfg.attrs.get_int("offset", 0), cfg.attrs.get_int("from", -1));
  });
  reg.add("allreduce.sum", cuda, dt,
          [](const KernelConfig& cfg) -> std::unique_ptr<Kernel> {
            return std::make_unique<AllreduceSum<T>>(cfg.actor, cfg.attrs.get_int("offset", 0));
          });
  reg.add_fn("allreduce.split", cuda, dt, allreduce_split);
  reg.add_fn("allreduce.concat", cuda, dt, allreduce_concat);
}

}  // namespace

void add_collective_kernels(KernelRegistry& reg) {
  add_collectives_for<float>(reg);
  add_collectives_for<double>(reg);
}

}  // namespace baton::cuda
