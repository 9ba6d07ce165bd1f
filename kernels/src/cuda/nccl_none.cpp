// NCCL in a build without it (no CUDA toolkit, or no nccl.h / libnccl): every entry point that
// would call NCCL says so.
#include <stdexcept>

#include "baton/kernels/nccl.h"
#include "baton/kernels/tensor.h"

namespace baton::nccl {

struct Communicator::Impl {};

namespace {
[[noreturn]] void unavailable(const std::string& what) {
  throw std::runtime_error(what + ": baton was built without NCCL (no CUDA toolkit, or no nccl.h and libnccl in it)");
}
}  // namespace

bool built_with_nccl() { return false; }
std::string version() { return "built without NCCL"; }
std::string make_unique_id() { unavailable("ncclGetUniqueId"); }

Communicator::Communicator(std::string name, int nranks, int rank, Device device, WaitSettings wait)
    : name_(std::move(name)), nranks_(nranks), rank_(rank), device_(device), wait_(wait) {}
Communicator::~Communicator() = default;
std::string Communicator::describe() const {
  return "communicator '" + name_ + "' rank " + std::to_string(rank_) + " of " + std::to_string(nranks_) + " on " +
         device_.str();
}
std::unique_ptr<Communicator> Communicator::create(const std::string&, int, int, Device, const std::string& name,
                                                   WaitSettings) {
  unavailable("communicator '" + name + "'");
}
std::vector<std::unique_ptr<Communicator>> Communicator::create_local(const std::string&, int, const std::vector<int>&,
                                                                      const std::vector<Device>&,
                                                                      const std::string& name, WaitSettings) {
  unavailable("communicator '" + name + "'");
}
void Communicator::abort() noexcept {}
std::optional<std::string> Communicator::abort_if_overdue() noexcept { return std::nullopt; }
void Communicator::close(const std::vector<Communicator*>&) noexcept {}
void Communicator::all_reduce(const Tensor&, Tensor&, cuda::Stream&) { unavailable(describe() + ": all_reduce"); }
void Communicator::reduce_scatter(const Tensor&, Tensor&, cuda::Stream&) { unavailable(describe() + ": reduce_scatter"); }
void Communicator::all_gather(const Tensor&, Tensor&, cuda::Stream&) { unavailable(describe() + ": all_gather"); }
void Communicator::send(const Tensor&, int, cuda::Stream&) { unavailable(describe() + ": send"); }
void Communicator::recv(Tensor&, int, cuda::Stream&) { unavailable(describe() + ": recv"); }

}  // namespace baton::nccl
