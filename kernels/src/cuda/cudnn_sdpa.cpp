// Scaled-dot-product attention by cuDNN's backend graph API (cudnn_graph.h), the library
// loaded at run time and every call made through dlsym's pointers.
//
// The graphs are the ones NVIDIA's cudnn-frontend (v1.23.0, include/cudnn_frontend/) lowers its
// sdpa and sdpa_backward nodes to for cuDNN before 9.21: node/scaled_dot_product_flash_attention.h
// (CompositeSDPANode, CompositeSDPABackwardNode), node/softmax.h (CompositeSoftmaxNode),
// node/diagonal_band_mask.h (CompositeDiagonalBandMaskNode) and utils/attn_score_modifiers.h,
// each operation as node/pointwise.h, matmul.h, reduction.h and reshape.h set it up. cuDNN fuses
// only the graphs whose pattern it recognises, so the operations, their order, the shapes,
// strides and types of the tensors between them are the frontend's, including its oddities (the
// strides of dO * O, K's reshape to float). Newer cuDNN keeps accepting these composite graphs:
// the frontend still builds them when asked for its COMPOSITE implementation.
#include "cudnn_sdpa.h"

#include <cudnn_graph.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common.h"

namespace baton::cuda::cudnn {
namespace {

constexpr const char* library_name = "libcudnn.so.9";

// The library's entry points (all of it this file uses) and whether it can be used at all.
struct Api {
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnGetErrorString) get_error_string = nullptr;
  decltype(&cudnnGetLastErrorString) get_last_error_string = nullptr;
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnDestroy) destroy = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) create_descriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) destroy_descriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) set_attribute = nullptr;
  decltype(&cudnnBackendGetAttribute) get_attribute = nullptr;
  decltype(&cudnnBackendFinalize) finalize = nullptr;
  decltype(&cudnnBackendExecute) execute = nullptr;
  // cudnnGetVersion(): major * 10000 + minor * 100 + patch since cuDNN 9.
  std::int64_t version = 0;
  // Why cuDNN cannot be used; "" when it can.
  std::string unavailable;
};

std::string version_text(std::int64_t v) {
  // cuDNN 8 counted major * 1000 + minor * 100 + patch.
  if (v < 10000) return fmt::format("{}.{}.{}", v / 1000, v / 100 % 10, v % 100);
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

std::string dl_error() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown error";
}

// PyTorch's wheel keeps its cuDNN at site-packages/nvidia/cudnn/lib, outside the loader's path.
std::vector<std::filesystem::path> wheel_candidates() {
  namespace fs = std::filesystem;
  std::vector<fs::path> roots = {"/usr/local/lib", "/usr/lib", "/opt/conda/lib"};
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    roots.push_back(fs::path(home) / ".local" / "lib");
  }
  for (const char* env : {"VIRTUAL_ENV", "CONDA_PREFIX"}) {
    if (const char* prefix = std::getenv(env); prefix != nullptr && *prefix != '\0') roots.push_back(fs::path(prefix) / "lib");
  }
  std::vector<fs::path> out;
  for (const fs::path& root : roots) {
    std::error_code ec;
    std::vector<fs::path> pythons;
    for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().filename().string().starts_with("python3")) pythons.push_back(it->path());
    }
    std::sort(pythons.begin(), pythons.end());
    for (const fs::path& python : pythons) {
      for (const char* site : {"site-packages", "dist-packages"}) {
        fs::path lib = python / site / "nvidia" / "cudnn" / "lib" / library_name;
        if (fs::exists(lib, ec)) out.push_back(std::move(lib));
      }
    }
  }
  return out;
}

void* try_open(const std::filesystem::path& path, std::string& why) {
  if (void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) return lib;
  why += fmt::format("; {}: {}", path.string(), dl_error());
  return nullptr;
}

// BATON_CUDNN_PATH's libcudnn.so.9 (an override: it comes first), else the loader's, else a
// PyTorch wheel's; null with `why` listing what failed.
void* open_library(std::string& why) {
  if (const char* env = std::getenv("BATON_CUDNN_PATH"); env != nullptr && *env != '\0') {
    std::filesystem::path path(env);
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) path /= library_name;
    if (void* lib = try_open(path, why)) return lib;
  }
  if (void* lib = dlopen(library_name, RTLD_NOW | RTLD_LOCAL)) return lib;
  why += fmt::format("; {} not found by the loader: {}", library_name, dl_error());
  const std::vector<std::filesystem::path> wheels = wheel_candidates();
  for (const std::filesystem::path& path : wheels) {
    if (void* lib = try_open(path, why)) return lib;
  }
  if (wheels.empty()) {
    why += "; no PyTorch wheel's nvidia/cudnn/lib under /usr/local/lib, /usr/lib, ~/.local/lib, $VIRTUAL_ENV or "
           "$CONDA_PREFIX (BATON_CUDNN_PATH names one)";
  }
  why.erase(0, why.starts_with("; ") ? 2 : 0);
  return nullptr;
}

template <typename F>
void resolve(void* lib, const char* name, F& fn, std::string& missing) {
  // POSIX guarantees a dlsym result converts to the function pointer it names.
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (fn == nullptr) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", name);
}

void resolve_all(void* lib, Api& a, std::string& missing) {
  resolve(lib, "cudnnGetVersion", a.get_version, missing);
  resolve(lib, "cudnnGetErrorString", a.get_error_string, missing);
  resolve(lib, "cudnnCreate", a.create, missing);
  resolve(lib, "cudnnDestroy", a.destroy, missing);
  resolve(lib, "cudnnSetStream", a.set_stream, missing);
  resolve(lib, "cudnnBackendCreateDescriptor", a.create_descriptor, missing);
  resolve(lib, "cudnnBackendDestroyDescriptor", a.destroy_descriptor, missing);
  resolve(lib, "cudnnBackendSetAttribute", a.set_attribute, missing);
  resolve(lib, "cudnnBackendGetAttribute", a.get_attribute, missing);
  resolve(lib, "cudnnBackendFinalize", a.finalize, missing);
  resolve(lib, "cudnnBackendExecute", a.execute, missing);
  // Optional: without it, failures only lose cuDNN's detailed message.
  std::string ignored;
  resolve(lib, "cudnnGetLastErrorString", a.get_last_error_string, ignored);
}

Api load() {
  Api a;
  void* lib = open_library(a.unavailable);
  if (lib == nullptr) return a;
  a.unavailable.clear();
  std::string missing;
  resolve_all(lib, a, missing);
  if (!missing.empty()) {
    a.unavailable = fmt::format("{} lacks {}", library_name, missing);
    return a;
  }
  a.version = static_cast<std::int64_t>(a.get_version());
  if (a.version < 90000) a.unavailable = fmt::format("cuDNN {} is older than 9.0", version_text(a.version));
  return a;
}

// Loaded once and never unloaded nor destroyed: descriptors that outlive static destruction
// still find cudnnBackendDestroyDescriptor.
const Api& api() {
  static const Api* const loaded = new Api(load());
  return *loaded;
}

// ": <cuDNN's message about the latest failure on this thread>", or "".
std::string last_error_suffix() {
  if (api().get_last_error_string == nullptr) return {};
  std::array<char, 4096> text{};
  api().get_last_error_string(text.data(), text.size());
  const std::string_view message(text.data());
  return message.empty() ? std::string() : fmt::format(": {}", message);
}

std::string failure(cudnnStatus_t s, std::string_view call, std::string_view who) {
  return fmt::format("{}: {} failed: {} ({}){}", who, call, api().get_error_string(s), static_cast<int>(s),
                     last_error_suffix());
}

void check_cudnn(cudnnStatus_t s, std::string_view call, std::string_view who) {
  if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error(failure(s, call, who));
}

// One backend descriptor, destroyed with its owner; `kind` (its type's name) is what failures name.
class Descriptor {
 public:
  Descriptor() = default;
  Descriptor(cudnnBackendDescriptorType_t type, const char* kind, std::string_view who) : kind_(kind) {
    if (const cudnnStatus_t s = api().create_descriptor(type, &desc_); s != CUDNN_STATUS_SUCCESS) {
      throw std::runtime_error(failure(s, fmt::format("cudnnBackendCreateDescriptor({})", kind), who));
    }
  }
  ~Descriptor() { reset(); }
  Descriptor(Descriptor&& other) noexcept : desc_(std::exchange(other.desc_, nullptr)), kind_(other.kind_) {}
  Descriptor& operator=(Descriptor&& other) noexcept {
    if (this != &other) {
      reset();
      desc_ = std::exchange(other.desc_, nullptr);
      kind_ = other.kind_;
    }
    return *this;
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  cudnnBackendDescriptor_t get() const { return desc_; }
  const char* kind() const { return kind_; }

 private:
  void reset() noexcept {
    if (desc_ != nullptr) api().destroy_descriptor(desc_);
    desc_ = nullptr;
  }

  cudnnBackendDescriptor_t desc_ = nullptr;
  const char* kind_ = "";
};

void set_attribute(const Descriptor& d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                   std::int64_t count, const void* values, const char* call, std::string_view who) {
  check_cudnn(api().set_attribute(d.get(), name, type, count, values), call, who);
}

void get_attribute(const Descriptor& d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                   std::int64_t requested, std::int64_t* count, void* values, const char* call, std::string_view who) {
  check_cudnn(api().get_attribute(d.get(), name, type, requested, count, values), call, who);
}

void finalize(const Descriptor& d, std::string_view who) {
  if (const cudnnStatus_t s = api().finalize(d.get()); s != CUDNN_STATUS_SUCCESS) {
    throw std::runtime_error(failure(s, fmt::format("cudnnBackendFinalize({})", d.kind()), who));
  }
}

// The macros put the descriptor type's or the attribute's name in the failure's text.
#define BATON_CUDNN_MAKE(type, who) Descriptor((type), #type, (who))
#define BATON_CUDNN_SET(desc, name, type, count, values, who) \
  set_attribute((desc), (name), (type), (count), (values), "cudnnBackendSetAttribute(" #name ")", (who))
#define BATON_CUDNN_GET(desc, name, type, requested, count, values, who) \
  get_attribute((desc), (name), (type), (requested), (count), (values),  \
                "cudnnBackendGetAttribute(" #name ")", (who))

// The cudnnHandle_t of one graph, made on the device current at construction.
class Handle {
 public:
  explicit Handle(std::string_view who) { check_cudnn(api().create(&handle_), "cudnnCreate", who); }
  ~Handle() {
    if (handle_ != nullptr) api().destroy(handle_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  cudnnHandle_t get() const { return handle_; }

 private:
  cudnnHandle_t handle_ = nullptr;
};

using Dims = std::array<std::int64_t, 4>;

// A tensor of the graph: its unique id (what the variant pack binds) and its descriptor.
struct Tensor {
  std::int64_t uid = 0;
  cudnnBackendDescriptor_t desc = nullptr;
};

// A float the graph takes by value: the variant pack points at `value` on the host.
struct ByValue {
  std::int64_t uid = 0;
  float value = 0;
};

// Matmul's GEMM_M/N/K_OVERRIDE tensors (per-batch sequence lengths); null where unset.
struct Overrides {
  const Tensor* m = nullptr;
  const Tensor* n = nullptr;
  const Tensor* k = nullptr;
};

// The tensors and operations of one operation graph, built as the frontend's nodes build theirs.
// Every descriptor lives as long as the graph (the frontend keeps them all too).
class Graph {
 public:
  explicit Graph(std::string who) : who_(std::move(who)) {}

  const std::string& who() const { return who_; }
  const std::vector<ByValue>& by_value() const { return scalars_; }

  // A tensor in device memory, bound by the variant pack.
  Tensor tensor(std::int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type) {
    return add_tensor(uid, dims, strides, type, false, false);
  }
  // An intermediate that never reaches memory.
  Tensor virtual_tensor(const Dims& dims, const Dims& strides, cudnnDataType_t type) {
    return add_tensor(next_uid_++, dims, strides, type, true, false);
  }
  // graph_properties.h Tensor_attributes(float): pass by value, FLOAT; the Attributes'
  // fill_from_context gives it the other tensors' rank, every dim and stride 1.
  Tensor scalar(float value) {
    const std::int64_t uid = next_uid_++;
    scalars_.push_back({uid, value});
    return add_tensor(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, false, true);
  }

  void unary(cudnnPointwiseMode_t mode, const Tensor& x, const Tensor& y) {
    pointwise(mode, CUDNN_DATA_FLOAT, std::nullopt, x, nullptr, nullptr, y);
  }
  void binary(cudnnPointwiseMode_t mode, const Tensor& x, const Tensor& b, const Tensor& y,
              cudnnDataType_t math = CUDNN_DATA_FLOAT) {
    pointwise(mode, math, std::nullopt, x, &b, nullptr, y);
  }
  // y = mask ? x : b
  void select(const Tensor& x, const Tensor& b, const Tensor& mask, const Tensor& y) {
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, std::nullopt, x, &b, &mask, y);
  }
  // y = the index of each element of x along `axis`.
  void gen_index(const Tensor& x, const Tensor& y, std::int64_t axis, cudnnDataType_t math) {
    pointwise(CUDNN_POINTWISE_GEN_INDEX, math, axis, x, nullptr, nullptr, y);
  }

  void matmul(const Tensor& a, const Tensor& b, const Tensor& c, const Overrides& o = {});
  void reduction(cudnnReduceTensorOp_t op, const Tensor& x, const Tensor& y);
  void reshape(const Tensor& x, const Tensor& y);

  // The finalized operation graph of every operation so far, in the order they were added.
  Descriptor operation_graph(cudnnHandle_t handle) const;

 private:
  Tensor add_tensor(std::int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type, bool is_virtual,
                    bool by_value);
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, std::optional<std::int64_t> axis, const Tensor& x,
                 const Tensor* b, const Tensor* t, const Tensor& y);
  void keep(Descriptor desc, Descriptor op) {
    descriptors_.push_back(std::move(desc));
    operations_.push_back(std::move(op));
  }

  std::string who_;
  // Above the ids the Impls bind by name.
  std::int64_t next_uid_ = 100;
  std::vector<Descriptor> tensors_;
  std::vector<Descriptor> descriptors_;
  std::vector<Descriptor> operations_;
  std::vector<ByValue> scalars_;
};

// cudnn_frontend_Tensor.h TensorBuilder::build: the attributes in its order, alignment 16 (the
// Tensor_attributes default) for every tensor, virtual and by-value flags only when set.
Tensor Graph::add_tensor(std::int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type,
                         bool is_virtual, bool by_value) {
  Descriptor t = BATON_CUDNN_MAKE(CUDNN_BACKEND_TENSOR_DESCRIPTOR, who_);
  const std::int64_t alignment = 16;
  BATON_CUDNN_SET(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, who_);
  BATON_CUDNN_SET(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), who_);
  BATON_CUDNN_SET(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), who_);
  BATON_CUDNN_SET(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, who_);
  BATON_CUDNN_SET(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, who_);
  if (is_virtual) BATON_CUDNN_SET(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, who_);
  if (by_value) BATON_CUDNN_SET(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, who_);
  finalize(t, who_);
  const Tensor out{uid, t.get()};
  tensors_.push_back(std::move(t));
  return out;
}

// node/pointwise.h PointwiseNode::create_cudnn_operations: mode, math precision and (GEN_INDEX)
// axis on the pointwise descriptor; X, Y, then B and T as the mode has them; both alphas 1.
void Graph::pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, std::optional<std::int64_t> axis,
                      const Tensor& x, const Tensor* b, const Tensor* t, const Tensor& y) {
  Descriptor desc = BATON_CUDNN_MAKE(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, who_);
  BATON_CUDNN_SET(desc, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, who_);
  BATON_CUDNN_SET(desc, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, who_);
  if (axis) BATON_CUDNN_SET(desc, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &*axis, who_);
  finalize(desc, who_);

  Descriptor op = BATON_CUDNN_MAKE(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, who_);
  const cudnnBackendDescriptor_t pw = desc.get();
  const float alpha = 1.0f;
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, who_);
  if (b != nullptr) {
    BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b->desc, who_);
  }
  if (t != nullptr) {
    BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t->desc, who_);
  }
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &alpha, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &alpha, who_);
  finalize(op, who_);
  keep(std::move(desc), std::move(op));
}

// node/matmul.h MatmulNode::create_cudnn_operations: float compute; A, B, C, the descriptor,
// then the overrides that are set.
void Graph::matmul(const Tensor& a, const Tensor& b, const Tensor& c, const Overrides& o) {
  Descriptor desc = BATON_CUDNN_MAKE(CUDNN_BACKEND_MATMUL_DESCRIPTOR, who_);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  BATON_CUDNN_SET(desc, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, who_);
  finalize(desc, who_);

  Descriptor op = BATON_CUDNN_MAKE(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, who_);
  const cudnnBackendDescriptor_t mm = desc.get();
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a.desc, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b.desc, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c.desc, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, who_);
  if (o.m != nullptr) {
    BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                    &o.m->desc, who_);
  }
  if (o.n != nullptr) {
    BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                    &o.n->desc, who_);
  }
  if (o.k != nullptr) {
    BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                    &o.k->desc, who_);
  }
  finalize(op, who_);
  keep(std::move(desc), std::move(op));
}

// node/reduction.h ReductionNode::create_cudnn_operations: float compute, the operator, and from
// cuDNN 9.11 the deterministic flag (false: the frontend's default).
void Graph::reduction(cudnnReduceTensorOp_t op_type, const Tensor& x, const Tensor& y) {
  Descriptor desc = BATON_CUDNN_MAKE(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, who_);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  BATON_CUDNN_SET(desc, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, who_);
  BATON_CUDNN_SET(desc, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &op_type, who_);
  if (api().version >= 91100) {
    const bool deterministic = false;
    BATON_CUDNN_SET(desc, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &deterministic, who_);
  }
  finalize(desc, who_);

  Descriptor op = BATON_CUDNN_MAKE(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, who_);
  const cudnnBackendDescriptor_t red = desc.get();
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &red, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, who_);
  finalize(op, who_);
  keep(std::move(desc), std::move(op));
}

// node/reshape.h ReshapeNode::create_cudnn_operations: X and Y only (its mode attribute is
// cuDNN 9.22's; its default, VIEW_ONLY, is what older cuDNN does).
void Graph::reshape(const Tensor& x, const Tensor& y) {
  Descriptor op = BATON_CUDNN_MAKE(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, who_);
  BATON_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, who_);
  finalize(op, who_);
  operations_.push_back(std::move(op));
}

// cudnn_frontend_OperationGraph.h OperationGraphBuilder::build. The handle is optional from cuDNN
// 9.8 only, so it is always set.
Descriptor Graph::operation_graph(cudnnHandle_t handle) const {
  Descriptor g = BATON_CUDNN_MAKE(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, who_);
  std::vector<cudnnBackendDescriptor_t> ops;
  ops.reserve(operations_.size());
  for (const Descriptor& op : operations_) ops.push_back(op.get());
  BATON_CUDNN_SET(g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                  static_cast<std::int64_t>(ops.size()), ops.data(), who_);
  // Null only in check_graphs, without a device (cuDNN 9.8 and later take a graph without one).
  if (handle != nullptr) BATON_CUDNN_SET(g, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, who_);
  finalize(g, who_);
  return g;
}

// The engine configs cuDNN's heuristics (mode A) offer for `graph`, best first
// (cudnn_frontend_Heuristics.h EngineHeuristics_v8: the count, then that many configs).
std::vector<Descriptor> heuristic_configs(const Descriptor& graph, std::string_view who) {
  Descriptor heur = BATON_CUDNN_MAKE(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, who);
  const cudnnBackendDescriptor_t g = graph.get();
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  BATON_CUDNN_SET(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g, who);
  BATON_CUDNN_SET(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, who);
  finalize(heur, who);
  std::int64_t count = 0;
  BATON_CUDNN_GET(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr, who);
  std::vector<Descriptor> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (std::int64_t i = 0; i < count; ++i) {
    configs.push_back(BATON_CUDNN_MAKE(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, who));
    raw.push_back(configs.back().get());
  }
  std::int64_t returned = 0;
  BATON_CUDNN_GET(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned, raw.data(),
                  who);
  configs.resize(static_cast<std::size_t>(std::clamp<std::int64_t>(returned, 0, count)));
  return configs;
}

// One knob setting of an engine config.
struct Knob {
  cudnnBackendKnobType_t type;
  std::int64_t value;
};

// Engine `engine_id` of `graph` (backend/plan_helpers.h create_engine, which first checks the
// id against the graph's engine count).
Descriptor engine_of(const Descriptor& graph, std::int64_t engine_id, std::string_view who) {
  std::int64_t engines = 0;
  BATON_CUDNN_GET(graph, CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT, CUDNN_TYPE_INT64, 1, nullptr, &engines, who);
  if (engine_id >= engines) {
    throw std::runtime_error(fmt::format("{}: the graph has {} engines, not engine {}", who, engines, engine_id));
  }
  Descriptor engine = BATON_CUDNN_MAKE(CUDNN_BACKEND_ENGINE_DESCRIPTOR, who);
  const cudnnBackendDescriptor_t g = graph.get();
  BATON_CUDNN_SET(engine, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g, who);
  BATON_CUDNN_SET(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &engine_id, who);
  finalize(engine, who);
  return engine;
}

// plan_helpers.h set_knob_choices: one knob's type and value.
Descriptor knob_choice(const Knob& knob, std::string_view who) {
  Descriptor choice = BATON_CUDNN_MAKE(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, who);
  BATON_CUDNN_SET(choice, CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &knob.type, who);
  BATON_CUDNN_SET(choice, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &knob.value, who);
  finalize(choice, who);
  return choice;
}

// An engine config of one engine with `knobs` (plan_helpers.h create_engine_config). `parts`
// keeps the engine and knob descriptors alive beside it.
Descriptor engine_config(const Descriptor& graph, std::int64_t engine_id, std::span<const Knob> knobs,
                         std::vector<Descriptor>& parts, std::string_view who) {
  parts.push_back(engine_of(graph, engine_id, who));
  const cudnnBackendDescriptor_t engine = parts.back().get();
  std::vector<cudnnBackendDescriptor_t> choices;
  for (const Knob& knob : knobs) {
    parts.push_back(knob_choice(knob, who));
    choices.push_back(parts.back().get());
  }
  Descriptor config = BATON_CUDNN_MAKE(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, who);
  BATON_CUDNN_SET(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &engine, who);
  BATON_CUDNN_SET(config, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                  static_cast<std::int64_t>(choices.size()), choices.data(), who);
  finalize(config, who);
  return config;
}

// An execution plan of `config`; the status of its finalization (engines that do not take the
// graph fail here) is the caller's to judge.
std::pair<Descriptor, cudnnStatus_t> make_plan(const Descriptor& config, cudnnHandle_t handle, std::string_view who) {
  Descriptor plan = BATON_CUDNN_MAKE(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, who);
  const cudnnBackendDescriptor_t c = config.get();
  // cuDNN before 9.8 documents the handle as required. The frontend's ExecutionPlanBuilder_v8::build
  // (cudnn_frontend_ExecutionPlan.h) stopped setting it in v1.13 for every backend; it is harmless
  // after 9.8, so it is always set here.
  BATON_CUDNN_SET(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, who);
  BATON_CUDNN_SET(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, who);
  const cudnnStatus_t s = api().finalize(plan.get());
  return {std::move(plan), s};
}

// The variant pack's tensors: unique ids and their pointers.
struct Bindings {
  static constexpr std::size_t capacity = 24;
  std::array<std::int64_t, capacity> uids{};
  std::array<void*, capacity> pointers{};
  std::size_t count = 0;

  void add(std::int64_t uid, const void* p) {
    if (count == capacity) throw std::logic_error("cudnn_sdpa: more variant pack tensors than Bindings holds");
    uids[count] = uid;
    // The variant pack's pointers are void*; cuDNN only reads the inputs.
    pointers[count] = const_cast<void*>(p);
    ++count;
  }
};

// A graph, then its execution plan: what a forward or a backward keeps between runs. Declared
// in destruction order's reverse: the plan goes before the graph's descriptors, the handle last.
class Engine {
 public:
  explicit Engine(const std::string& context) : handle_(context), graph_(context) {}

  Graph& graph() { return graph_; }
  const std::string& who() const { return graph_.who(); }
  std::int64_t workspace_bytes() const { return workspace_; }

  // The first of the heuristics' configs that makes a plan (plans.h build_plans with
  // BuildPlanPolicy_t::HEURISTICS_CHOICE).
  void plan_by_heuristics();
  // One engine with fixed knobs instead of the heuristics' choice (graph_interface.h
  // create_execution_plans, when a node overrides the heuristics query).
  void plan_engine(std::int64_t engine_id, std::span<const Knob> knobs);
  // Binds the graph's by-value scalars after `b` and runs the plan on `stream`.
  void execute(Bindings& b, void* workspace, cudaStream_t stream) const;

 private:
  void set_plan(Descriptor plan);

  Handle handle_;
  Graph graph_;
  Descriptor op_graph_;
  std::vector<Descriptor> configs_;
  Descriptor plan_;
  std::int64_t workspace_ = 0;
};

void Engine::plan_by_heuristics() {
  op_graph_ = graph_.operation_graph(handle_.get());
  configs_ = heuristic_configs(op_graph_, who());
  std::string last;
  for (const Descriptor& config : configs_) {
    auto [plan, status] = make_plan(config, handle_.get(), who());
    if (status == CUDNN_STATUS_SUCCESS) return set_plan(std::move(plan));
    last = failure(status, "cudnnBackendFinalize(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)", who());
  }
  if (configs_.empty()) {
    throw std::runtime_error(fmt::format("{}: cuDNN's heuristics offer no engine for the graph{}", who(),
                                         last_error_suffix()));
  }
  throw std::runtime_error(fmt::format("{} (no plan from any of the {} engine configs cuDNN's heuristics offer)",
                                       last, configs_.size()));
}

void Engine::plan_engine(std::int64_t engine_id, std::span<const Knob> knobs) {
  op_graph_ = graph_.operation_graph(handle_.get());
  configs_.push_back(engine_config(op_graph_, engine_id, knobs, configs_, who()));
  auto [plan, status] = make_plan(configs_.back(), handle_.get(), who());
  if (status != CUDNN_STATUS_SUCCESS) {
    throw std::runtime_error(
        failure(status, fmt::format("cudnnBackendFinalize(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR) of engine {}",
                                    engine_id),
                who()));
  }
  set_plan(std::move(plan));
}

void Engine::set_plan(Descriptor plan) {
  plan_ = std::move(plan);
  std::int64_t count = 0;
  BATON_CUDNN_GET(plan_, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &count, &workspace_, who());
  if (workspace_ < 0) {
    throw std::runtime_error(fmt::format("{}: cuDNN reports a workspace of {} bytes", who(), workspace_));
  }
}

// backend/execution_helpers.h create_variant_pack: workspace, pointers, ids; then execute.
void Engine::execute(Bindings& b, void* workspace, cudaStream_t stream) const {
  for (const ByValue& scalar : graph_.by_value()) b.add(scalar.uid, &scalar.value);
  check_cudnn(api().set_stream(handle_.get(), stream), "cudnnSetStream", who());
  Descriptor pack = BATON_CUDNN_MAKE(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, who());
  const auto n = static_cast<std::int64_t>(b.count);
  BATON_CUDNN_SET(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, who());
  BATON_CUDNN_SET(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, b.pointers.data(), who());
  BATON_CUDNN_SET(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, b.uids.data(), who());
  finalize(pack, who());
  check_cudnn(api().execute(handle_.get(), plan_.get(), pack.get()), "cudnnBackendExecute", who());
}

// The ids of the tensors the variant pack binds by name.
namespace uid {
constexpr std::int64_t q = 1, k = 2, v = 3, o = 4, stats = 5, dout = 6, dq = 7, dk = 8, dv = 9;
constexpr std::int64_t softmax_sum = 10, dq_accum = 11, seq_len_q = 12, seq_len_kv = 13;
}  // namespace uid


cudnnDataType_t io_type(Elem e) { return e == Elem::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF; }

// utils/attn_score_modifiers.h get_negative_inf_value: older cuDNN prefers lowest for a masked score.
float negative_infinity(std::int64_t version) {
  return version < 91000 ? std::numeric_limits<float>::lowest() : -std::numeric_limits<float>::infinity();
}

// The dims and strides of the graphs' tensors for one shape (b, h, s, d; s_q = s_kv = s).
struct Layout {
  Dims bhsd, bhsd_strides;      // q, o, do (and k, v without grouped-query heads)
  Dims kv, kv_strides;          // k, v [b, h_kv, s, d]
  Dims kv_t, kv_t_strides;      // k (v) as the backend's matmuls take it: K^T, a view of K's memory
  Dims grad_strides;            // dq: rows grad_ld apart (side by side in dqkv: 3 d)
  Dims kv_grad_strides;         // dk, dv: likewise, over h_kv heads
  Dims scores, score_strides;   // [b, h, s_q, s_kv]
  Dims scores_t_strides;        // [b, h, s_kv, s_q]: the scores transposed in place
  Dims rows, row_strides;       // [b, h, s_q, 1]: stats and other row reductions
  Dims dout_o_strides;          // the frontend's strides for dO * O (h s d, s d, h d, 1)
};

Layout layout_of(const SdpaShape& x) {
  const std::int64_t b = x.b, h = x.h, hk = x.kv_heads(), s = x.s, d = x.d;
  Layout l;
  l.bhsd = {b, h, s, d};
  l.bhsd_strides = {h * s * d, s * d, d, 1};
  l.kv = {b, hk, s, d};
  l.kv_strides = {hk * s * d, s * d, d, 1};
  l.kv_t = {b, hk, d, s};
  l.kv_t_strides = {hk * s * d, s * d, 1, d};
  const std::int64_t ld = x.grad_ld > 0 ? x.grad_ld : 3 * d;
  l.grad_strides = {h * s * ld, s * ld, ld, 1};
  l.kv_grad_strides = {hk * s * ld, s * ld, ld, 1};
  l.scores = {b, h, s, s};
  l.score_strides = {h * s * s, s * s, s, 1};
  l.scores_t_strides = {h * s * s, s * s, 1, s};
  l.rows = {b, h, s, 1};
  l.row_strides = {h * s, s, 1, 1};
  l.dout_o_strides = {h * s * d, s * d, h * d, 1};
  return l;
}

Tensor float_scores(Graph& g, const Layout& l) { return g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_FLOAT); }

// bmm1 and the attention scale (CompositeSDPANode "bmm1", "attn_scale"; the backward's
// "matmul_Q_KT", "mul_s_attn_scale"): scale * q k^T, float.
Tensor scaled_scores(Graph& g, const Layout& l, const Tensor& q, const Tensor& kt, const Tensor& scale,
                     const Overrides& o) {
  const Tensor s = float_scores(g, l);
  g.matmul(q, kt, s, o);
  const Tensor scaled = float_scores(g, l);
  g.binary(CUDNN_POINTWISE_MUL, s, scale, scaled);
  return scaled;
}

// The causal mask: a right bound of 0 on the top-left diagonal (CompositeDiagonalBandMaskNode,
// as sliding_window_mask lowers causal_mask): keep key j <= query i, else -inf. The indices are
// int32 computed at the default (float) precision; the comparison is boolean.
Tensor causal_mask(Graph& g, const Layout& l, const Tensor& x, float neg_inf) {
  const Tensor row = g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_INT32);
  g.gen_index(x, row, 2, CUDNN_DATA_FLOAT);
  const Tensor col = g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_INT32);
  g.gen_index(x, col, 3, CUDNN_DATA_FLOAT);
  const Tensor keep = g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_BOOLEAN);
  g.binary(CUDNN_POINTWISE_CMP_GE, row, col, keep, CUDNN_DATA_BOOLEAN);
  const Tensor masked = float_scores(g, l);
  g.select(x, g.scalar(neg_inf), keep, masked);
  return masked;
}

// attn_score_modifiers.h padding_mask: keep row < seq_len_q[b] and col < seq_len_kv[b], else
// -inf. Only the backward's workaround for older cuDNN uses it (all lengths s).
Tensor padding_mask(Graph& g, const Layout& l, const Tensor& x, const Tensor& seq_q, const Tensor& seq_kv,
                    float neg_inf) {
  const Tensor row = g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_INT32);
  g.gen_index(x, row, 2, CUDNN_DATA_INT32);
  const Tensor col = g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_INT32);
  g.gen_index(x, col, 3, CUDNN_DATA_INT32);
  const Tensor row_in = g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_BOOLEAN);
  g.binary(CUDNN_POINTWISE_CMP_LT, row, seq_q, row_in, CUDNN_DATA_BOOLEAN);
  const Tensor col_in = g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_BOOLEAN);
  g.binary(CUDNN_POINTWISE_CMP_LT, col, seq_kv, col_in, CUDNN_DATA_BOOLEAN);
  const Tensor keep = g.virtual_tensor(l.scores, l.score_strides, CUDNN_DATA_BOOLEAN);
  g.binary(CUDNN_POINTWISE_LOGICAL_AND, row_in, col_in, keep, CUDNN_DATA_BOOLEAN);
  const Tensor masked = float_scores(g, l);
  g.select(x, g.scalar(neg_inf), keep, masked);
  return masked;
}

// CompositeSoftmaxNode with Stats: max, x - max, exp, sum, stats = max + log(sum) into `stats`,
// p = exp / sum. p is virtual in the input's type: "Requirement by cudnn backend to take in bmm2
// aType as i/o type" (CompositeSDPANode).
Tensor softmax_with_stats(Graph& g, const Layout& l, const Tensor& x, const Tensor& stats, cudnnDataType_t io) {
  const Tensor row_max = g.virtual_tensor(l.rows, l.row_strides, CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, x, row_max);
  const Tensor shifted = float_scores(g, l);
  g.binary(CUDNN_POINTWISE_SUB, x, row_max, shifted);
  const Tensor exps = float_scores(g, l);
  g.unary(CUDNN_POINTWISE_EXP, shifted, exps);
  const Tensor row_sum = g.virtual_tensor(l.rows, l.row_strides, CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, exps, row_sum);
  const Tensor log_sum = g.virtual_tensor(l.rows, l.row_strides, CUDNN_DATA_FLOAT);
  g.unary(CUDNN_POINTWISE_LOG, row_sum, log_sum);
  g.binary(CUDNN_POINTWISE_ADD, row_max, log_sum, stats);
  const Tensor p = g.virtual_tensor(l.scores, l.score_strides, io);
  g.binary(CUDNN_POINTWISE_DIV, exps, row_sum, p);
  return p;
}

// CompositeSDPANode::expand_node for sdpa(q, k, v) with generate_stats, attn_scale by value and
// (when causal) causal_mask: bmm1, scale, mask, softmax with stats, bmm2.
void build_forward(Graph& g, const SdpaShape& x, float neg_inf) {
  const Layout l = layout_of(x);
  const cudnnDataType_t io = io_type(x.elem);
  const Tensor q = g.tensor(uid::q, l.bhsd, l.bhsd_strides, io);
  const Tensor kt = g.tensor(uid::k, l.kv_t, l.kv_t_strides, io);
  const Tensor v = g.tensor(uid::v, l.kv, l.kv_strides, io);
  const Tensor o = g.tensor(uid::o, l.bhsd, l.bhsd_strides, io);
  const Tensor stats = g.tensor(uid::stats, l.rows, l.row_strides, CUDNN_DATA_FLOAT);
  Tensor scores = scaled_scores(g, l, q, kt, g.scalar(static_cast<float>(x.scale)), {});
  if (x.causal) scores = causal_mask(g, l, scores, neg_inf);
  const Tensor p = softmax_with_stats(g, l, scores, stats, io);
  g.matmul(p, v, o);
}

// What the backward graph depends on beyond the shape: versions and devices.
struct BackwardOptions {
  float neg_inf = 0;
  // set_deterministic_algorithm(true): the frontend then forces its "dP workspace" graph, dQ
  // straight from dS K, where the other graph accumulates dQ into a float buffer (atomically).
  bool deterministic = true;
  // cuDNN <= 9.15.0 with s % 128 != 0: the frontend adds a padding mask with every sequence's
  // length at s (the lengths in its workspace) to dodge a backend bug.
  bool padding_workaround = false;
  // cuDNN 9.0 to 9.9 with a padding mask: the mask again after the stats are subtracted.
  bool second_padding = false;
  // cuDNN before 9.6 does not zero the float dQ accumulator itself.
  bool zero_dq_accum = false;
};

BackwardOptions backward_options(const SdpaShape& x, std::int64_t version, int sm) {
  BackwardOptions o;
  o.neg_inf = negative_infinity(version);
  // Blackwell's deterministic backward needs cuDNN 9.18; before, it has none.
  o.deterministic = !(sm / 10 == 10 && version < 91800);
  o.padding_workaround = version <= 91500 && x.s % 128 != 0;
  o.second_padding = o.padding_workaround && version < 91000;
  o.zero_dq_accum = !o.deterministic && version < 90600;
  return o;
}

// The backward graph's bound tensors.
struct BackwardIo {
  Tensor q, kt, vt, o, dout, stats, dq, dk, dv, scale;
  std::optional<Tensor> seq_q, seq_kv;

  const Tensor* sq() const { return seq_q ? &*seq_q : nullptr; }
  const Tensor* skv() const { return seq_kv ? &*seq_kv : nullptr; }
};

BackwardIo backward_io(Graph& g, const Layout& l, const SdpaShape& x, const BackwardOptions& opt) {
  const cudnnDataType_t io = io_type(x.elem);
  BackwardIo t;
  t.q = g.tensor(uid::q, l.bhsd, l.bhsd_strides, io);
  t.kt = g.tensor(uid::k, l.kv_t, l.kv_t_strides, io);
  t.vt = g.tensor(uid::v, l.kv_t, l.kv_t_strides, io);
  t.o = g.tensor(uid::o, l.bhsd, l.bhsd_strides, io);
  t.dout = g.tensor(uid::dout, l.bhsd, l.bhsd_strides, io);
  t.stats = g.tensor(uid::stats, l.rows, l.row_strides, CUDNN_DATA_FLOAT);
  t.dq = g.tensor(uid::dq, l.bhsd, l.grad_strides, io);
  t.dk = g.tensor(uid::dk, l.kv, l.kv_grad_strides, io);
  t.dv = g.tensor(uid::dv, l.kv, l.kv_grad_strides, io);
  t.scale = g.scalar(static_cast<float>(x.scale));
  if (opt.padding_workaround) {
    // [b, 1, 1, 1] int32, stride 1 (the frontend's workaround_padding_mask_seq_len_q / _kv).
    t.seq_q = g.tensor(uid::seq_len_q, {x.b, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32);
    t.seq_kv = g.tensor(uid::seq_len_kv, {x.b, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32);
  }
  return t;
}

// "mul_dO_O", "reduce_dO_o", "scale_dropout_inv" (by 1 without dropout): each row's dO . O, the
// softmax_sum the frontend keeps in its workspace as float [b, h, s, 1].
Tensor softmax_sum(Graph& g, const Layout& l, const BackwardIo& t) {
  const Tensor prod = g.virtual_tensor(l.bhsd, l.dout_o_strides, CUDNN_DATA_FLOAT);
  g.binary(CUDNN_POINTWISE_MUL, t.dout, t.o, prod);
  const Tensor rows = g.virtual_tensor(l.rows, l.row_strides, CUDNN_DATA_FLOAT);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, prod, rows);
  const Tensor sum = g.tensor(uid::softmax_sum, l.rows, l.row_strides, CUDNN_DATA_FLOAT);
  g.binary(CUDNN_POINTWISE_MUL, rows, g.scalar(1.0f), sum);
  return sum;
}

// P again from the stats: exp(scale q k^T (masked) - stats) ("matmul_Q_KT" to "exp_s").
Tensor recomputed_probs(Graph& g, const Layout& l, const SdpaShape& x, const BackwardIo& t,
                        const BackwardOptions& opt) {
  Tensor s = scaled_scores(g, l, t.q, t.kt, t.scale, {t.sq(), t.skv(), nullptr});
  if (opt.padding_workaround) s = padding_mask(g, l, s, *t.seq_q, *t.seq_kv, opt.neg_inf);
  const Tensor shifted = float_scores(g, l);
  g.binary(CUDNN_POINTWISE_SUB, s, t.stats, shifted);
  s = shifted;
  if (opt.second_padding) s = padding_mask(g, l, s, *t.seq_q, *t.seq_kv, opt.neg_inf);
  if (x.causal) s = causal_mask(g, l, s, opt.neg_inf);
  const Tensor p = float_scores(g, l);
  g.unary(CUDNN_POINTWISE_EXP, s, p);
  return p;
}

// `x` transposed as a view ("reshape_p", "reshape_dS"): [b, h, s_kv, s_q] in the input's type.
Tensor transposed_scores(Graph& g, const Layout& l, const Tensor& x, cudnnDataType_t io) {
  const Tensor xt = g.virtual_tensor(l.scores, l.scores_t_strides, io);
  g.reshape(x, xt);
  return xt;
}

// dP = dO V^T, dS = (dP - softmax_sum) * P * scale ("matmul_dO_VT" to "mul_dS_attn_scale").
Tensor grad_scores(Graph& g, const Layout& l, const BackwardIo& t, const Tensor& sum, const Tensor& p) {
  const Tensor dp = float_scores(g, l);
  g.matmul(t.dout, t.vt, dp, {t.sq(), t.skv(), nullptr});
  const Tensor centred = float_scores(g, l);
  g.binary(CUDNN_POINTWISE_SUB, dp, sum, centred);
  const Tensor weighted = float_scores(g, l);
  g.binary(CUDNN_POINTWISE_MUL, centred, p, weighted);
  const Tensor ds = float_scores(g, l);
  g.binary(CUDNN_POINTWISE_MUL, weighted, t.scale, ds);
  return ds;
}

// dQ = dS K ("reshape_k" back from K^T, whose output the frontend leaves at the float
// intermediate type, then "matmul_dS_K"); through the float accumulator and "identity_dQ" when
// not deterministic.
void grad_q(Graph& g, const Layout& l, const BackwardIo& t, const Tensor& ds, const BackwardOptions& opt) {
  const Tensor k = g.virtual_tensor(l.kv, l.kv_strides, CUDNN_DATA_FLOAT);
  g.reshape(t.kt, k);
  const Overrides o{t.sq(), nullptr, t.skv()};
  if (opt.deterministic) {
    g.matmul(ds, k, t.dq, o);
    return;
  }
  const Tensor accum = g.tensor(uid::dq_accum, l.bhsd, l.bhsd_strides, CUDNN_DATA_FLOAT);
  g.matmul(ds, k, accum, o);
  g.unary(CUDNN_POINTWISE_IDENTITY, accum, t.dq);
}

// out = a b, a [b, h_q, s_kv, s_q]; with grouped-query heads ("matmul_pT_dO" into dV_fullhead,
// "red_dV_head"; the same for dK) each query head's product goes to a virtual [b, h_q, s, d] in
// the input's type, which a reduction adds up over each kv head's group into `out`.
void grad_kv(Graph& g, const Layout& l, const SdpaShape& x, const BackwardIo& t, const Tensor& a, const Tensor& b,
             const Tensor& out) {
  const Overrides o{t.skv(), nullptr, t.sq()};
  if (x.kv_heads() == x.h) {
    g.matmul(a, b, out, o);
    return;
  }
  const Tensor full = g.virtual_tensor(l.bhsd, l.bhsd_strides, io_type(x.elem));
  g.matmul(a, b, full, o);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
}

// CompositeSDPABackwardNode::expand_node without bias, dropout or alibi: softmax_sum, P,
// dV = P^T dO, dS, dK = dS^T Q, dQ = dS K (the scale is in dS); with grouped-query heads
// (h_k = h_v < h_q) the matmuls read k and v per group and dK, dV add up each group's heads.
void build_backward(Graph& g, const SdpaShape& x, const BackwardOptions& opt) {
  const Layout l = layout_of(x);
  const cudnnDataType_t io = io_type(x.elem);
  const BackwardIo t = backward_io(g, l, x, opt);
  const Tensor sum = softmax_sum(g, l, t);
  const Tensor p = recomputed_probs(g, l, x, t, opt);
  grad_kv(g, l, x, t, transposed_scores(g, l, p, io), t.dout, t.dv);
  const Tensor ds = grad_scores(g, l, t, sum, p);
  grad_kv(g, l, x, t, transposed_scores(g, l, ds, io), t.q, t.dk);
  grad_q(g, l, t, ds, opt);
}

// Blackwell's deterministic backward is not the heuristics' pick: the frontend names the engine
// and its knobs (CompositeSDPABackwardNode::override_heuristics_query).
std::pair<std::int64_t, std::vector<Knob>> blackwell_deterministic_engine(int sm, std::int64_t version) {
  const std::int64_t engine = sm > 103 ? 17 : 5;
  if (version >= 92300) {
    return {engine,
            {{CUDNN_KNOB_TYPE_TILE_M, 3},
             {CUDNN_KNOB_TYPE_TILE_N, 2},
             {CUDNN_KNOB_TYPE_KERNEL_CFG, 2},
             {CUDNN_KNOB_TYPE_STREAM_K, 0},
             {CUDNN_KNOB_TYPE_TILE_CGA_M, 0},
             {CUDNN_KNOB_TYPE_STAGES, 2}}};
  }
  return {engine, {{CUDNN_KNOB_TYPE_KERNEL_CFG, 31}, {CUDNN_KNOB_TYPE_STAGES, 2}}};
}

enum class Pass : std::uint8_t { forward, backward };

// The head sizes cuDNN's BF16/FP16 forward takes, as the frontend checks them before building
// (node/sdpa_support_surface.h validate_sdpa_support_surface); "" when they fit.
std::string forward_limits(const SdpaShape& x, std::int64_t version, int sm) {
  const int major = sm / 10;
  if (major == 8 && version <= 90900 && x.d > 128) return "head size d > 128 needs cuDNN 9.10 or newer on SM 8.x";
  if (major == 9 && version <= 90900 && x.d > 256) return "head size d > 256 needs cuDNN 9.10 or newer on SM 9.x";
  if (major == 10 && version < 90900 && x.d > 128) return "head size d > 128 needs cuDNN 9.9 or newer on SM 10.x";
  if (x.s == 1 && version <= 90900 && x.causal) return "s = 1 with a causal mask needs cuDNN 9.10 or newer";
  if (x.s == 1 && version <= 90900 && major == 10 && x.d > 128) {
    return "s = 1 with head size d > 128 needs cuDNN 9.10 or newer on SM 10.x";
  }
  return {};
}

// The backward's (CompositeSDPABackwardNode::pre_validate_node); "" when the shape fits.
std::string backward_limits(const SdpaShape& x, int sm) {
  const int major = sm / 10;
  if (x.s == 1) return "s_q = s_kv = 1 is not supported";
  // Hopper takes head sizes to 256; Blackwell (9.11+) to 128 when d_qk = d_v; the rest to 128.
  const std::int64_t max_d = major == 9 ? 256 : 128;
  if (x.d > max_d) {
    return fmt::format("head size d = {} is over the backward's {} on SM {}.{}", x.d, max_d, major, sm % 10);
  }
  return {};
}

std::string shape_limits(const SdpaShape& x, Pass pass, std::int64_t version, int sm) {
  if (x.b < 1 || x.h < 1 || x.s < 1 || x.d < 1) return "every dimension must be at least 1";
  if (x.h_kv < 0 || x.h % x.kv_heads() != 0) {
    return fmt::format("{} key and value heads do not divide {} query heads", x.h_kv, x.h);
  }
  if (version == 91000 || version == 91001) {
    return "cuDNN 9.10.0 and 9.10.1 have known bugs in BF16/FP16 attention: use 9.10.2 or newer";
  }
  if (sm < 80) return fmt::format("fused attention needs SM 8.0 (Ampere) or newer, not SM {}.{}", sm / 10, sm % 10);
  if (x.d % 8 != 0) return fmt::format("head size d = {} is not a multiple of 8", x.d);
  return pass == Pass::forward ? forward_limits(x, version, sm) : backward_limits(x, sm);
}

// " h_kv=2" with grouped-query heads, else "".
std::string kv_text(const SdpaShape& x) { return x.kv_heads() == x.h ? "" : fmt::format(" h_kv={}", x.h_kv); }

int current_sm(std::string_view who) {
  int device = 0, major = 0, minor = 0;
  BATON_CUDA_CHECK(cudaGetDevice(&device), who);
  BATON_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), who);
  BATON_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), who);
  return major * 10 + minor;
}

// The library, the device and the shape checked; `context` names `who` and the shape, and is
// what every later failure starts with.
struct Target {
  std::string context;
  std::int64_t version = 0;
  int sm = 0;
};

Target target_of(const SdpaShape& x, const std::string& who, Pass pass) {
  if (const std::string& why = unavailable_reason(); !why.empty()) {
    throw std::runtime_error(fmt::format("{}: cannot use cuDNN: {}", who, why));
  }
  Target t;
  t.version = api().version;
  t.sm = current_sm(who);
  t.context = fmt::format("{}: cuDNN {} attention {} (b={} h={}{} s={} d={} {} {})", who, version_text(t.version),
                          pass == Pass::forward ? "forward" : "backward", x.b, x.h, kv_text(x), x.s, x.d,
                          x.elem == Elem::bf16 ? "bf16" : "f16", x.causal ? "causal" : "full");
  if (const std::string why = shape_limits(x, pass, t.version, t.sm); !why.empty()) {
    throw std::runtime_error(fmt::format("{}: not supported: {}", t.context, why));
  }
  return t;
}

std::int64_t round_up(std::int64_t bytes) { return (bytes + 255) / 256 * 256; }

// The backward's own share of the workspace (the frontend's "fe workspace"), before cuDNN's:
// byte offsets, -1 for what this graph lacks. Each piece starts 256-aligned.
struct Scratch {
  std::int64_t dq_accum = -1;
  std::int64_t softmax_sum = 0;
  std::int64_t seq_lens = -1;
  std::int64_t seq_len_stride = 0;  // seq_len_kv's offset from seq_len_q's
  std::int64_t bytes = 0;
};

Scratch scratch_of(const SdpaShape& x, const BackwardOptions& opt) {
  Scratch sc;
  std::int64_t at = 0;
  if (!opt.deterministic) {
    sc.dq_accum = at;
    at += round_up(x.b * x.h * x.s * x.d * std::int64_t{sizeof(float)});
  }
  sc.softmax_sum = at;
  at += round_up(x.b * x.h * x.s * std::int64_t{sizeof(float)});
  if (opt.padding_workaround) {
    sc.seq_lens = at;
    sc.seq_len_stride = round_up(x.b * std::int64_t{sizeof(std::int32_t)});
    at += 2 * sc.seq_len_stride;
  }
  sc.bytes = at;
  return sc;
}

// The host image of seq_len_q then seq_len_kv (every one s), laid out as in the scratch.
std::vector<std::int32_t> seq_len_image(const SdpaShape& x, const Scratch& sc) {
  if (sc.seq_lens < 0) return {};
  const auto stride = static_cast<std::size_t>(sc.seq_len_stride) / sizeof(std::int32_t);
  std::vector<std::int32_t> image(2 * stride, 0);
  const auto b = static_cast<std::size_t>(x.b);
  std::fill_n(image.begin(), b, static_cast<std::int32_t>(x.s));
  std::fill_n(image.begin() + static_cast<std::ptrdiff_t>(stride), b, static_cast<std::int32_t>(x.s));
  return image;
}

#undef BATON_CUDNN_MAKE
#undef BATON_CUDNN_SET
#undef BATON_CUDNN_GET

}  // namespace

const std::string& unavailable_reason() { return api().unavailable; }

std::string version() { return api().unavailable.empty() ? version_text(api().version) : std::string(); }

std::string check_graphs(const SdpaShape& shape, int sm) {
  if (!api().unavailable.empty()) return "cannot use cuDNN: " + api().unavailable;
  // Every descriptor finalizes as it is made; what needs a device (heuristics, plans) is not made.
  try {
    const std::string who = fmt::format("check of cuDNN {} attention (b={} h={}{} s={} d={} {})",
                                        version_text(api().version), shape.b, shape.h, kv_text(shape), shape.s,
                                        shape.d,
                                        shape.causal ? "causal" : "full");
    if (const std::string why = shape_limits(shape, Pass::forward, api().version, sm); !why.empty()) return why;
    if (const std::string why = shape_limits(shape, Pass::backward, api().version, sm); !why.empty()) return why;
    Graph forward(who + " forward"), backward(who + " backward");
    build_forward(forward, shape, negative_infinity(api().version));
    build_backward(backward, shape, backward_options(shape, api().version, sm));
    if (api().version >= 90800) {
      forward.operation_graph(nullptr);
      backward.operation_graph(nullptr);
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

struct SdpaForward::Impl {
  SdpaShape shape;
  Target target;
  Engine engine;

  Impl(const SdpaShape& s, const std::string& who)
      : shape(s), target(target_of(s, who, Pass::forward)), engine(target.context) {
    build_forward(engine.graph(), shape, negative_infinity(target.version));
    engine.plan_by_heuristics();
  }
};

SdpaForward::SdpaForward(const SdpaShape& shape, std::string who) : impl_(std::make_unique<Impl>(shape, who)) {}

SdpaForward::~SdpaForward() = default;

const SdpaShape& SdpaForward::shape() const { return impl_->shape; }

std::size_t SdpaForward::workspace_bytes() const { return static_cast<std::size_t>(impl_->engine.workspace_bytes()); }

void SdpaForward::run(const void* q, const void* k, const void* v, void* o, float* stats, void* workspace,
                      cudaStream_t stream) {
  Bindings b;
  b.add(uid::q, q);
  b.add(uid::k, k);
  b.add(uid::v, v);
  b.add(uid::o, o);
  b.add(uid::stats, stats);
  impl_->engine.execute(b, workspace, stream);
}

struct SdpaBackward::Impl {
  SdpaShape shape;
  Target target;
  BackwardOptions options;
  Scratch scratch;
  std::vector<std::int32_t> seq_lens;
  Engine engine;

  Impl(const SdpaShape& s, const std::string& who)
      : shape(s),
        target(target_of(s, who, Pass::backward)),
        options(backward_options(s, target.version, target.sm)),
        scratch(scratch_of(s, options)),
        seq_lens(seq_len_image(s, scratch)),
        engine(target.context) {
    build_backward(engine.graph(), shape, options);
    if (options.deterministic && target.sm / 10 == 10) {
      const auto [engine_id, knobs] = blackwell_deterministic_engine(target.sm, target.version);
      engine.plan_engine(engine_id, knobs);
    } else {
      engine.plan_by_heuristics();
    }
  }

  // Binds the scratch tensors and readies them as the frontend's workspace modifications do.
  void bind_scratch(Bindings& b, char* ws, cudaStream_t stream) const;
  // The workspace the sequence lengths were last uploaded to: nothing writes them there after,
  // so they go once per workspace, not every call (a copy from pageable memory cannot be
  // captured into a CUDA graph, and the segments pass captures this kernel's calls).
  mutable const char* seq_lens_at = nullptr;
};

void SdpaBackward::Impl::bind_scratch(Bindings& b, char* ws, cudaStream_t stream) const {
  const std::string& who = engine.who();
  b.add(uid::softmax_sum, ws + scratch.softmax_sum);
  if (scratch.dq_accum >= 0) {
    b.add(uid::dq_accum, ws + scratch.dq_accum);
    if (options.zero_dq_accum) {
      const auto bytes = static_cast<std::size_t>(shape.b * shape.h * shape.s * shape.d) * sizeof(float);
      BATON_CUDA_CHECK(cudaMemsetAsync(ws + scratch.dq_accum, 0, bytes, stream), who);
    }
  }
  if (scratch.seq_lens >= 0) {
    b.add(uid::seq_len_q, ws + scratch.seq_lens);
    b.add(uid::seq_len_kv, ws + scratch.seq_lens + scratch.seq_len_stride);
    if (seq_lens_at != ws) {
      // From pageable memory as the frontend does: the driver stages it before returning.
      BATON_CUDA_CHECK(cudaMemcpyAsync(ws + scratch.seq_lens, seq_lens.data(), seq_lens.size() * sizeof(std::int32_t),
                                       cudaMemcpyHostToDevice, stream),
                       who);
      seq_lens_at = ws;
    }
  }
}

SdpaBackward::SdpaBackward(const SdpaShape& shape, std::string who) : impl_(std::make_unique<Impl>(shape, who)) {}

SdpaBackward::~SdpaBackward() = default;

const SdpaShape& SdpaBackward::shape() const { return impl_->shape; }

std::size_t SdpaBackward::workspace_bytes() const {
  return static_cast<std::size_t>(impl_->scratch.bytes + impl_->engine.workspace_bytes());
}

void SdpaBackward::run(const void* q, const void* k, const void* v, const void* o, const void* dout,
                       const float* stats, void* dq, void* dk, void* dv, void* workspace, cudaStream_t stream) {
  const Impl& impl = *impl_;
  Bindings b;
  b.add(uid::q, q);
  b.add(uid::k, k);
  b.add(uid::v, v);
  b.add(uid::o, o);
  b.add(uid::dout, dout);
  b.add(uid::stats, stats);
  b.add(uid::dq, dq);
  b.add(uid::dk, dk);
  b.add(uid::dv, dv);
  auto* ws = static_cast<char*>(workspace);
  impl.bind_scratch(b, ws, stream);
  void* cudnn_workspace = impl.engine.workspace_bytes() > 0 ? ws + impl.scratch.bytes : nullptr;
  impl.engine.execute(b, cudnn_workspace, stream);
}

}  // namespace baton::cuda::cudnn
