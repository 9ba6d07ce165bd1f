#include "output.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>

namespace baton::launch {

void LinePrefixer::emit(std::string_view line, std::string& out) const {
  out.append(prefix_);
  out.append(line);
  out.push_back('\n');
}

void LinePrefixer::feed(std::string_view bytes, std::string& out) {
  while (!bytes.empty()) {
    const auto newline = bytes.find('\n');
    if (newline == std::string_view::npos) {
      partial_.append(bytes);
      break;
    }
    if (partial_.empty()) {
      emit(bytes.substr(0, newline), out);
    } else {
      partial_.append(bytes.substr(0, newline));
      emit(partial_, out);
      partial_.clear();
    }
    bytes.remove_prefix(newline + 1);
  }
  while (partial_.size() >= max_line_) {
    emit(std::string_view(partial_).substr(0, max_line_), out);
    partial_.erase(0, max_line_);
  }
}

void LinePrefixer::finish(std::string& out) {
  if (!partial_.empty()) emit(partial_, out);
  partial_.clear();
}

void OutputSink::append(std::string_view text) {
  if (broken_) return;
  if (head_ == buffer_.size()) {
    buffer_.clear();
    head_ = 0;
  }
  buffer_.append(text);
}

void OutputSink::write_some() {
  if (!pending()) return;
  std::size_t size = std::min<std::size_t>(buffer_.size() - head_, PIPE_BUF);
  // End the piece at a line break if one is in it, so a line is written whole.
  if (size < buffer_.size() - head_) {
    const auto last_newline = std::string_view(buffer_).substr(head_, size).rfind('\n');
    if (last_newline != std::string_view::npos) size = last_newline + 1;
  }
  const ssize_t n = ::write(fd_, buffer_.data() + head_, size);
  if (n < 0) {
    if (errno == EINTR || errno == EAGAIN) return;
    broken_ = true;  // EPIPE, EBADF: nobody reads this any more
    buffer_.clear();
    head_ = 0;
    return;
  }
  head_ += static_cast<std::size_t>(n);
  // Keep the buffer from only ever growing at the front.
  if (head_ == buffer_.size()) {
    buffer_.clear();
    head_ = 0;
  } else if (head_ > (1u << 20) && head_ > buffer_.size() / 2) {
    buffer_.erase(0, head_);
    head_ = 0;
  }
}

void OutputSink::flush(std::chrono::steady_clock::time_point deadline) {
  while (pending()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    pollfd p{fd_, POLLOUT, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), INT_MAX)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;
    if (p.revents & (POLLERR | POLLNVAL)) {
      broken_ = true;
      return;
    }
    write_some();
  }
}

}  // namespace baton::launch
