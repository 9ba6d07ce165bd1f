#pragma once
/// How baton-launch passes its children's output on: split into lines, each line prefixed
/// with the rank ("[3] text"), queued, and written to our own stdout / stderr in pieces that
/// never hold the launcher up for long.
#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>

namespace baton::launch {

/// Splits a byte stream into lines and writes each with a prefix. A line longer than
/// `max_line` is cut (and each piece prefixed), so one rank cannot grow the buffer forever.
class LinePrefixer {
 public:
  static constexpr std::size_t default_max_line = 64 * 1024;

  explicit LinePrefixer(std::string prefix = {}, std::size_t max_line = default_max_line)
      : prefix_(std::move(prefix)), max_line_(max_line) {}

  /// Appends every complete line in `bytes` (with those held from before) to `out`.
  void feed(std::string_view bytes, std::string& out);
  /// End of stream: a partial last line goes out with a newline added.
  void finish(std::string& out);
  bool holds_partial_line() const { return !partial_.empty(); }

 private:
  void emit(std::string_view line, std::string& out) const;

  std::string prefix_;
  std::size_t max_line_;
  std::string partial_;
};

/// One of the launcher's own output descriptors (stdout or stderr). Text queues here; the
/// event loop writes a piece whenever poll() reports POLLOUT. A piece is at most PIPE_BUF
/// bytes and ends at a line break where it can, so a write on a ready pipe does not block
/// and lines of stdout and stderr do not tear when both go to one pipe. If the reader has
/// gone (EPIPE), further output is dropped.
class OutputSink {
 public:
  explicit OutputSink(int fd) : fd_(fd) {}

  int fd() const { return fd_; }
  void append(std::string_view text);
  bool pending() const { return !broken_ && head_ < buffer_.size(); }
  std::size_t queued() const { return broken_ ? 0 : buffer_.size() - head_; }
  /// One write; call when the descriptor polled writable.
  void write_some();
  /// Writes what is queued, waiting for the reader until `deadline` at most.
  void flush(std::chrono::steady_clock::time_point deadline);

 private:
  int fd_;
  std::string buffer_;
  std::size_t head_ = 0;
  bool broken_ = false;
};

}  // namespace baton::launch
