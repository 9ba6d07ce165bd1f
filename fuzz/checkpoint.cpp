// Fuzzes checkpoint reading (what --resume loads): the first byte picks the file, the rest is its
// content. Even: a safetensors file (header length, JSON header, offsets, dtypes, shapes);
// odd: a checkpoint's index.json beside a valid rank file. Each loads or throws
// std::runtime_error naming the file; a loaded file's tensors fit its bytes.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "baton/graph/checkpoint.h"
#include "baton/graph/safetensors.h"

namespace fs = std::filesystem;

namespace {

const fs::path& scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::path(fs::exists("/dev/shm") ? "/dev/shm" : fs::temp_directory_path()) /
                 fmt::format("baton-fuzz-checkpoint-{}", ::getpid());
    fs::create_directories(d / "step-00000001");
    return d;
  }();
  return dir;
}

void put(const fs::path& path, const std::uint8_t* data, std::size_t size) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                               static_cast<std::streamsize>(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const fs::path step = scratch() / "step-00000001";
  try {
    if (data[0] % 2 == 0) {
      put(step / "rank0.safetensors", data + 1, size - 1);
      const auto contents = baton::safetensors::read(step / "rank0.safetensors");
      for (const auto& [name, tensor] : contents.tensors) {
        if (name.empty() || tensor.numel() < 0) __builtin_trap();
      }
    } else {
      put(step / "index.json", data + 1, size - 1);
      baton::checkpoint::load(step);
    }
  } catch (const std::runtime_error&) {
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
