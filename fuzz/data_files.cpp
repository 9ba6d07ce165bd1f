// Fuzzes the data-file readers with arbitrary file contents: the digits CSV (plain or gzip,
// told apart by content) and the text corpus. Each loads or throws std::runtime_error naming
// the file; a loaded set is consistent (one label per row, labels in range).
#include <sys/mman.h>
#include <unistd.h>

#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "baton/kernels/data.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // An in-memory file, so the fuzzer never touches the disk.
  const int fd = ::memfd_create("fuzz-data", 0);
  if (fd < 0) return 0;
  for (std::size_t at = 0; at < size;) {
    const ssize_t n = ::write(fd, data + at, size - at);
    if (n <= 0) break;
    at += static_cast<std::size_t>(n);
  }
  const std::string path = fmt::format("/proc/self/fd/{}", fd);
  try {
    const auto set = baton::data::load_digits(path);
    if (set.labels.dim(0) != set.rows()) __builtin_trap();
    for (const auto label : set.labels.data<std::int32_t>()) {
      if (label < 0 || label >= set.num_classes) __builtin_trap();
    }
  } catch (const std::runtime_error&) {
  }
  try {
    const auto corpus = baton::data::load_text(path);
    for (const auto id : corpus.ids) {
      if (id < 0 || id >= corpus.vocab_size()) __builtin_trap();
    }
  } catch (const std::runtime_error&) {
  }
  ::close(fd);
  return 0;
}
