// A file descriptor that becomes readable once a job on the executor has completed, so a
// Python thread can block on it with its own call (select.poll), which gives up the GIL in
// CPython's code and ends cleanly at interpreter shutdown, instead of polling the job's future.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <system_error>

namespace sdp4bit {

// An eventfd that the executor writes once, after the job's future is ready, and nobody reads:
// it stays readable from then on, so any number of waits see it, and a wait that starts after
// the write returns at once. Shared (std::shared_ptr) by the executor's queue entry and the
// Work, so the descriptor stays open until the executor has written it and the Work is gone,
// and is closed exactly once, by the destructor.
class CompletionSignal {
 public:
  // Throws std::system_error when the process cannot make another descriptor.
  CompletionSignal() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (fd_ < 0) {
      throw std::system_error(errno, std::generic_category(),
                              "no eventfd for a collective's completion");
    }
  }

  ~CompletionSignal() { close(fd_); }

  CompletionSignal(const CompletionSignal&) = delete;
  CompletionSignal& operator=(const CompletionSignal&) = delete;

  // The descriptor: readable once notify() has run. Valid while this object lives.
  int fd() const { return fd_; }

  // Makes the descriptor readable. Called once; the counter (1) cannot overflow, so the write
  // fails only when interrupted, and is then retried.
  void notify() noexcept {
    const uint64_t one = 1;
    while (write(fd_, &one, sizeof one) < 0 && errno == EINTR) {
    }
  }

 private:
  int fd_;
};

}  // namespace sdp4bit
