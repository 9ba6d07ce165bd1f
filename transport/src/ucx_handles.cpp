#include "ucx_handles.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "baton/transport/link.h"

namespace baton::transport::ucx {

void fail(std::string_view call, ucs_status_t status, std::string_view context) {
  throw TransportError(fmt::format("{}: {} ({})", call, ucs_status_string(status), context));
}

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void FileDescriptor::reset() noexcept {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
}

Context::Context(std::uint64_t features, const std::vector<std::pair<std::string, std::string>>& config,
                 std::string_view who) {
  ucp_config_t* raw_config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &raw_config); s != UCS_OK) {
    fail("ucp_config_read", s, who);
  }
  std::unique_ptr<ucp_config_t, decltype(&ucp_config_release)> owned(raw_config, &ucp_config_release);
  std::string applied;
  for (const auto& [name, value] : config) {
    if (ucs_status_t s = ucp_config_modify(owned.get(), name.c_str(), value.c_str()); s != UCS_OK) {
      fail(fmt::format("ucp_config_modify({}={})", name, value), s, who);
    }
    applied += fmt::format("{}{}={}", applied.empty() ? "" : ", ", name, value);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = features;
  if (ucs_status_t s = ucp_init(&params, owned.get(), &handle_); s != UCS_OK) {
    handle_ = nullptr;
    fail(applied.empty() ? std::string("ucp_init") : fmt::format("ucp_init({})", applied), s, who);
  }
}

Context& Context::operator=(Context&& other) noexcept {
  if (this != &other) {
    reset();
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void Context::reset() noexcept {
  if (handle_ != nullptr) ucp_cleanup(std::exchange(handle_, nullptr));
}

Worker::Worker(const Context& context, std::string_view who) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Several threads progress it, one at a time (DataPlane's ucx_mutex).
  params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  if (ucs_status_t s = ucp_worker_create(context.get(), &params, &handle_); s != UCS_OK) {
    handle_ = nullptr;
    fail("ucp_worker_create", s, who);
  }
}

Worker& Worker::operator=(Worker&& other) noexcept {
  if (this != &other) {
    reset();
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void Worker::reset() noexcept {
  if (handle_ != nullptr) ucp_worker_destroy(std::exchange(handle_, nullptr));
}

std::string Worker::address(std::string_view who) const {
  ucp_address_t* address = nullptr;
  std::size_t length = 0;
  if (ucs_status_t s = ucp_worker_get_address(handle_, &address, &length); s != UCS_OK) {
    fail("ucp_worker_get_address", s, who);
  }
  std::string bytes(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(handle_, address);
  return bytes;
}

int Worker::event_fd(std::string_view who) const {
  int fd = -1;
  if (ucs_status_t s = ucp_worker_get_efd(handle_, &fd); s != UCS_OK) fail("ucp_worker_get_efd", s, who);
  return fd;
}

std::size_t Worker::max_am_header(std::string_view who) const {
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  if (ucs_status_t s = ucp_worker_query(handle_, &attr); s != UCS_OK) fail("ucp_worker_query", s, who);
  return attr.max_am_header;
}

Endpoint::Endpoint(const Worker& worker, const std::string& peer_address, std::string_view who)
    : worker_(worker.get()) {
  if (peer_address.empty()) fail("ucp_ep_create", UCS_ERR_INVALID_ADDR, fmt::format("{}: empty address", who));
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  // PEER: a peer that dies fails the requests to it (the data plane reports them and the job
  // ends naming that rank). With NONE, UCX aborts the whole process instead, e.g. when its
  // shared-memory copy (CMA) finds the peer gone: the surviving rank died of SIGABRT with a UCX
  // backtrace, and the launcher blamed it (found by the fault test, tests/mp/test_faults.cpp).
  params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  if (ucs_status_t s = ucp_ep_create(worker_, &params, &handle_); s != UCS_OK) {
    handle_ = nullptr;
    fail("ucp_ep_create", s, who);
  }
}

Endpoint& Endpoint::operator=(Endpoint&& other) noexcept {
  if (this != &other) {
    reset();
    handle_ = std::exchange(other.handle_, nullptr);
    worker_ = std::exchange(other.worker_, nullptr);
  }
  return *this;
}

ucs_status_ptr_t Endpoint::close() {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = 0;  // flush mode: UCP_EP_CLOSE_FLAG_FORCE needs UCP_ERR_HANDLING_MODE_PEER
  return ucp_ep_close_nbx(std::exchange(handle_, nullptr), &param);
}

void Endpoint::reset() noexcept {
  if (handle_ == nullptr) return;
  ucs_status_ptr_t request = close();
  if (!UCS_PTR_IS_PTR(request)) return;
  // Only reached when the owner never closed us itself (an exception part-way through
  // connect()): the worker is ours on this thread, progress it for a bounded time.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (ucp_request_check_status(request) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker_);
  }
  ucp_request_free(request);
}

std::string Endpoint::transports() const {
  if (handle_ == nullptr) return {};
  char* text = nullptr;
  std::size_t length = 0;
  FILE* stream = open_memstream(&text, &length);
  if (stream == nullptr) return {};
  ucp_ep_print_info(handle_, stream);
  std::fclose(stream);
  std::string info(text, length);
  std::free(text);

  // Lines look like "#   lane[0]:  3:sysv/memory.0 md[2]   -> md[2]/sysv/sysdev[255] am am_bw#0":
  // keep "sysv/memory" (resource "<index>:<transport>/<device>.<path index>").
  std::vector<std::string> names;
  std::istringstream lines(info);
  for (std::string line; std::getline(lines, line);) {
    auto lane = line.find("lane[");
    if (lane == std::string::npos) continue;
    auto colon = line.find(':', lane);
    if (colon == std::string::npos) continue;
    auto start = line.find_first_not_of(' ', colon + 1);
    if (start == std::string::npos) continue;
    auto end = line.find(' ', start);
    std::string resource = line.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (auto index_end = resource.find(':'); index_end != std::string::npos) resource.erase(0, index_end + 1);
    if (auto path = resource.rfind('.'); path != std::string::npos && resource.find('/') < path) {
      resource.erase(path);
    }
    bool seen = false;
    for (const auto& n : names) seen = seen || n == resource;
    if (!seen && !resource.empty()) names.push_back(resource);
  }
  std::string joined;
  for (const auto& n : names) joined += (joined.empty() ? "" : ", ") + n;
  return joined;
}

}  // namespace baton::transport::ucx
