#pragma once
/// Small values that the ranks of one job share by key (in the spirit of PyTorch's c10d Store):
/// one rank sets a key once, the others get it, waiting for it up to a deadline. What NCCL's
/// unique ids travel by (baton/kernels/nccl.h). run_job backs it with the control plane
/// (transport::ControlClient::publish / fetch); kernels see it in KernelServices::store.
///
///   store.set("nccl/grad", id);                             // on the rank that made it
///   std::string id = store.get("nccl/grad", std::chrono::seconds(60));   // on the others
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

namespace baton {

class Store {
 public:
  virtual ~Store() = default;
  /// Publishes `value` (any bytes) under `key` to every rank. A key is set once. Any thread.
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// The value of `key`, waiting until some rank has set it. Throws std::runtime_error naming
  /// the key if `timeout` passes first or the job ends meanwhile. Any thread.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

/// A Store within one process (tests; several runtimes in one process).
class LocalStore final : public Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard lock(mutex_);
      values_[key] = value;
    }
    cv_.notify_all();
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&] { return values_.count(key) != 0; })) {
      throw std::runtime_error("store: nobody set '" + key + "' within " + std::to_string(timeout.count()) + " ms");
    }
    return values_.at(key);
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

}  // namespace baton
