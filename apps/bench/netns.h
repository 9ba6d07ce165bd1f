#pragma once
// Two "hosts" on one machine for the benchmarks that go across hosts: network namespaces joined
// by a veth pair (as tests/mp/test_multihost.cpp makes them). Needs root and iproute2; removed
// by the destructor. Traffic stays inside the namespaces.
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace baton::bench {

class NamespacePair {
 public:
  /// Namespaces "batonbench<pid>a" at 10.X.0.1 and "...b" at 10.X.0.2 (X from the pid).
  NamespacePair() {
    if (geteuid() != 0) {
      why_not_ = "needs root to create network namespaces";
      return;
    }
    const int id = static_cast<int>(getpid() % 200) + 20;
    for (int h = 0; h < 2; ++h) {
      names_.push_back(fmt::format("batonbench{}{}", getpid(), h == 0 ? 'a' : 'b'));
      addresses_.push_back(fmt::format("10.{}.0.{}", id, h + 1));
    }
    veths_ = {fmt::format("bb{}a", getpid() % 100000), fmt::format("bb{}b", getpid() % 100000)};
    const std::string& va = veths_[0];
    const std::string& vb = veths_[1];
    const std::vector<std::string> steps = {
        fmt::format("ip netns add {}", names_[0]),
        fmt::format("ip netns add {}", names_[1]),
        fmt::format("ip link add {} type veth peer name {}", va, vb),
        fmt::format("ip link set {} netns {}", va, names_[0]),
        fmt::format("ip link set {} netns {}", vb, names_[1]),
        fmt::format("ip -n {} addr add {}/24 dev {}", names_[0], addresses_[0], va),
        fmt::format("ip -n {} addr add {}/24 dev {}", names_[1], addresses_[1], vb),
        fmt::format("ip -n {} link set {} up", names_[0], va),
        fmt::format("ip -n {} link set {} up", names_[1], vb),
        fmt::format("ip -n {} link set lo up", names_[0]),
        fmt::format("ip -n {} link set lo up", names_[1]),
    };
    for (const auto& s : steps) {
      if (std::system((s + " >/dev/null 2>&1").c_str()) != 0) {
        why_not_ = fmt::format("'{}' failed (iproute2 missing, or no permission for network namespaces)", s);
        return;
      }
    }
    ok_ = true;
  }
  ~NamespacePair() {
    for (const auto& n : names_) std::system(("ip netns del " + n + " >/dev/null 2>&1").c_str());
  }
  NamespacePair(const NamespacePair&) = delete;
  NamespacePair& operator=(const NamespacePair&) = delete;

  bool ok() const { return ok_; }
  const std::string& why_not() const { return why_not_; }
  const std::vector<std::string>& names() const { return names_; }
  /// The veth address of host h (0 or 1), the one the other host reaches it at.
  const std::string& address(int h) const { return addresses_.at(static_cast<std::size_t>(h)); }
  /// Limits each direction of the link between the hosts to `gbit` Gbit/s (a token bucket on
  /// each end, tc's tbf), as a network slower than a host's memory makes it; "" or why not.
  std::string limit_link(double gbit) const {
    for (int h = 0; h < 2; ++h) {
      const std::string cmd = fmt::format("ip netns exec {} tc qdisc add dev {} root tbf rate {}mbit burst 1mb latency 100ms",
                                          names_[static_cast<std::size_t>(h)], veths_[static_cast<std::size_t>(h)],
                                          static_cast<long>(gbit * 1000));
      if (std::system((cmd + " >/dev/null 2>&1").c_str()) != 0) return fmt::format("'{}' failed", cmd);
    }
    return {};
  }
  /// The subnet of the veth pair ("10.X.0.0/24").
  std::string subnet() const { return addresses_.at(0).substr(0, addresses_.at(0).rfind('.')) + ".0/24"; }

 private:
  std::vector<std::string> names_, addresses_, veths_;
  std::string why_not_;
  bool ok_ = false;
};

}  // namespace baton::bench
