// Fuzzes what baton-launch reads from users: host files (OpenMPI's format), --hosts lists and
// HOST:PORT endpoints. Each either parses or throws its error type naming the input.
#include <string>
#include <string_view>

#include "baton/transport/control.h"
#include "plan.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    for (const auto& h : baton::launch::parse_hostfile(text, "fuzz-hosts")) {
      if (h.host.empty()) __builtin_trap();  // a parsed entry always names a host
    }
  } catch (const baton::launch::UsageError&) {
  }
  try {
    baton::launch::parse_host_list(text);
  } catch (const baton::launch::UsageError&) {
  }
  try {
    baton::transport::parse_endpoint(std::string(text));
  } catch (const baton::transport::TransportError&) {
  }
  return 0;
}
