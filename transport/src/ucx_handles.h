#pragma once
// Move-only owners of the C handles the UCX data plane holds (DESIGN.md section 4): the ucp
// context, the ucp worker, one endpoint per peer, and plain file descriptors. Destructors never
// throw; the owner's member order (context, worker, endpoints) is the teardown order reversed.
// Private to transport/src.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>

namespace baton::transport::ucx {

/// Throws TransportError "<call>: <UCX status string> (<context>)"; context names the rank
/// and, where there is one, the peer.
[[noreturn]] void fail(std::string_view call, ucs_status_t status, std::string_view context);

/// A file descriptor (eventfd, epoll); closed on destruction.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() { reset(); }
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;

  int get() const { return fd_; }
  void reset() noexcept;

 private:
  int fd_ = -1;
};

/// ucp_context_h: the transports UCX may use and the features asked of them.
class Context {
 public:
  Context() = default;
  /// `config`: UCX settings (name without UCX_, value) over those of the environment. `who` goes
  /// into error messages ("rank 2").
  Context(std::uint64_t features, const std::vector<std::pair<std::string, std::string>>& config,
          std::string_view who);
  ~Context() { reset(); }
  Context(Context&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Context& operator=(Context&& other) noexcept;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  ucp_context_h get() const { return handle_; }
  void reset() noexcept;

 private:
  ucp_context_h handle_ = nullptr;
};

/// ucp_worker_h in UCS_THREAD_MODE_SINGLE: one thread at a time may touch it (the data plane's
/// progress thread once it runs; the constructing thread before that).
class Worker {
 public:
  Worker() = default;
  Worker(const Context& context, std::string_view who);
  ~Worker() { reset(); }
  Worker(Worker&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  Worker& operator=(Worker&& other) noexcept;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  ucp_worker_h get() const { return handle_; }
  /// This worker's address as opaque bytes (what a peer's Endpoint is created from).
  std::string address(std::string_view who) const;
  /// The file descriptor that becomes readable when the armed worker has events.
  int event_fd(std::string_view who) const;
  /// The largest active-message header ucp_am_send_nbx accepts.
  std::size_t max_am_header(std::string_view who) const;
  void reset() noexcept;

 private:
  ucp_worker_h handle_ = nullptr;
};

/// ucp_ep_h to one peer, created from the peer worker's address, error handling mode NONE
/// (UCP_ERR_HANDLING_MODE_PEER would rule out the shared-memory transports; peer failure is the
/// control plane's to detect).
class Endpoint {
 public:
  Endpoint() = default;
  Endpoint(const Worker& worker, const std::string& peer_address, std::string_view who);
  /// Closes the endpoint if close() was never called: flush mode, progressing the worker on
  /// this thread for at most about a second.
  ~Endpoint() { reset(); }
  Endpoint(Endpoint&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)), worker_(std::exchange(other.worker_, nullptr)) {}
  Endpoint& operator=(Endpoint&& other) noexcept;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  ucp_ep_h get() const { return handle_; }
  explicit operator bool() const { return handle_ != nullptr; }
  /// Starts a flush-mode close and gives the handle up: returns the close request to progress
  /// (and ucp_request_free), nullptr if the close completed at once, or an error pointer.
  ucs_status_ptr_t close();
  /// ucp_ep_print_info's lanes as "sysv/memory, cma/memory" (best effort; empty if none).
  std::string transports() const;
  void reset() noexcept;

 private:
  ucp_ep_h handle_ = nullptr;
  ucp_worker_h worker_ = nullptr;
};

}  // namespace baton::transport::ucx
