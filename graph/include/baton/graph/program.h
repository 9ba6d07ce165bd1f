#pragma once
// A graph's forward pass compiled once for the CPU and run many times, for serving's decode
// steps (apps/serve): a step is a few milliseconds, so a plan's set-up per run (actors, threads,
// handshakes: what evaluate() pays each call) would cost more than the step. One kernel per node
// for the program's life (kernels keep state between runs: paged_attention's KV cache), the
// nodes run in their topological order on the caller's thread, and every intermediate lives in
// a buffer reused once its last reader ran, allocated once.
//
// What it is not: the actor plan. It runs one device's forward pass (or a pipeline stage's
// part of it) in one thread; baton-serve's stages across ranks (apps/serve/pipeline.h) drive
// one Program per stage and row count, with their own protocol over the job's data plane.
//
//   Program step(g, {logits}, params);
//   step.input("tokens").data<std::int32_t>()[0] = 42;   // inputs are written in place
//   const Tensor& out = step.run()[0];                    // valid until the next run
//
// On an asynchronous device (a CUDA GPU, or a `sim` device in tests) the kernels are the
// device's, enqueued in order on one stream of the program's; the weights are uploaded at
// construction (and by set_params), the intermediates live in device memory, input() is a host
// tensor copied to the device at each run, and run() returns host copies of the fetches once
// the stream has finished. Inputs given at construction (a KV cache) are used where they are:
// the caller allocates them on the device (device_allocator()), and the kernels keep them there.
//
//   Program gpu(g, {logits}, params, {{"cache.k.0", k0}}, registry, Device::parse("cuda:0"));
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "baton/graph/compile.h"
#include "baton/kernels/allocator.h"
#include "baton/kernels/kernel.h"
#include "baton/kernels/stream.h"

namespace baton {

class Program {
 public:
  /// Compiles what `fetches` need. Variables read `params` (kept; set_params() swaps them).
  /// Throws GraphError for an op without a CPU kernel of its dtype or a variable `params`
  /// lacks or holds in another shape or dtype.
  /// `inputs`: tensors some inputs read from the start instead of zeros the program allocates
  /// (state several programs share, such as a KV cache: allocated once, by the caller).
  /// `device`: where the kernels run (a CPU device by default; see above for CUDA and sim); the
  /// ops need kernels there (GraphError naming the node otherwise).
  Program(Graph& g, const std::vector<Value>& fetches, std::shared_ptr<const ParameterStore> params,
          const std::map<std::string, Tensor>& inputs = {},
          const KernelRegistry& kernels = KernelRegistry::with_builtin_kernels(), Device device = Device{});
  ~Program();
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;

  /// The tensor an input node reads; write it before run(). Throws GraphError for a name that
  /// is no input of the program.
  Tensor& input(const std::string& name);
  /// Runs every node once; returns the fetched values (the program's buffers: valid until the
  /// next run). A kernel's exception propagates, prefixed with the node's name.
  const std::vector<Tensor>& run();
  /// New weights, checked as at construction; the kernels (and their state) stay.
  void set_params(std::shared_ptr<const ParameterStore> params);
  /// Bytes of the intermediates' buffers (inputs and weights not counted).
  std::size_t buffer_bytes() const { return buffer_bytes_; }
  Device device() const { return device_; }
  /// On an asynchronous device: capture the steps' kernels into one graph (a CUDA graph; a sim
  /// stream's recorded work) at the second run, and launch that graph from then on, one launch a
  /// run instead of one per kernel. The first run is eager, so that kernels make their lazy
  /// allocations and uploads before the capture; the inputs' copies down and the fetches'
  /// copies up stay outside the graph (they read and write the host tensors), and new weights
  /// (set_params) are written into the same device memory, so the graph stays right. Where the
  /// capture fails (a kernel that synchronises, waits on an event or allocates device memory),
  /// the program says so once on stderr, graph_status() says why, and it runs its kernels one
  /// by one as before. No effect on a CPU device. Off by default.
  void use_graphs(bool on) { graphs_ = on; }
  /// "off", "eager" (a CPU device), "waiting" (before the capture), "captured", or
  /// "refused: <why>".
  std::string graph_status() const;
  /// Runs that launched the captured graph.
  std::int64_t graph_launches() const { return graph_launches_; }
  /// An allocator of the program's device's memory (host memory on a CPU or sim device), for
  /// the inputs a caller gives at construction.
  static std::unique_ptr<Allocator> device_allocator(Device device);

 private:
  struct Step;
  void bind(const ParameterStore& params);
  /// The constructor's parts: each needed node's value (inputs, given or allocated; views'
  /// roots in `root`) and the ids of the nodes that compute, in order; then their steps, each
  /// with its kernel and an output buffer reused once its last reader ran.
  std::vector<int> place_nodes(const std::map<std::string, Tensor>& inputs, const KernelRegistry& kernels,
                               std::vector<int>& root);
  void make_steps(const std::vector<int>& computed, const std::vector<int>& root, const KernelRegistry& kernels);
  /// The copy kernel `op` (to_device / to_host) for `dt`, made once, on an asynchronous device.
  void add_copy_kernel(const KernelRegistry& kernels, const char* op, DType dt);
  bool on_stream() const { return stream_ != nullptr; }
  /// Runs `op` (to_device / to_host) from `src` into `dst` on the program's stream.
  void copy(const char* op, const Tensor& src, Tensor& dst);
  /// Each step's kernel, in order (enqueued on a device's stream).
  void run_steps();
  /// The second run's capture of run_steps() into graph_ (or graph_refused_ saying why not).
  void capture();

  Graph& g_;
  std::shared_ptr<const ParameterStore> params_;
  Device device_;
  // Declared before every tensor and kernel of the program: destroyed after them (the tensors'
  // device memory goes back to alloc_; the stream waits for its work first).
  std::unique_ptr<AsyncStream> stream_;  // null on a CPU device
  std::unique_ptr<Allocator> alloc_;     // device memory (null on a CPU or sim device)
  std::vector<bool> needed_;
  std::vector<Step> steps_;
  std::map<int, Tensor> values_;  // node id -> its tensor (inputs, variables, buffers, views)
  std::map<std::string, int> inputs_;
  std::vector<int> fetch_ids_;
  std::vector<Tensor> fetched_;
  std::size_t buffer_bytes_ = 0;
  std::map<int, Tensor> host_inputs_;        // input node -> the host tensor input() returns
  std::map<int, Tensor> device_weights_;     // variable node -> its copy on the device
  bool graphs_ = false;
  std::int64_t runs_ = 0, graph_launches_ = 0;
  std::unique_ptr<StreamGraph> graph_;
  std::string graph_refused_;
  std::map<std::pair<std::string, DType>, std::unique_ptr<Kernel>> copy_kernels_;  // (op, dtype)
};

}  // namespace baton
