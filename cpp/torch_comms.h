// The torch.distributed side of the cxx bridge (src/ffi/mod.rs): the process groups of one
// DP group, whose collectives the Rust core calls. Declared without torch headers so that
// cargo can compile the bridge; defined in torch_comms.cpp, built against the installed torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "rust/cxx.h"

namespace sdp4bit::ffi {

enum class CommLevel : std::uint8_t;
enum class SumDtype : std::uint8_t;

// An exchange issued by TorchComms::start_all_to_all(_device) and not yet waited for; wait()
// completes it as c10d's Work::wait() does (host buffers: blocks until it has run; CUDA
// buffers over NCCL: the current stream waits for it), copies staged results back and
// rethrows its c10d error.
class PendingExchange {
 public:
  struct State;  // the c10d work and staged tensors, defined with torch in torch_comms.cpp

  explicit PendingExchange(std::unique_ptr<State> state);
  ~PendingExchange();
  PendingExchange(const PendingExchange&) = delete;
  PendingExchange& operator=(const PendingExchange&) = delete;

  void wait();

 private:
  std::unique_ptr<State> state_;
};

// Memory from torch's CUDA caching allocator (the Rust CUDA backend's buffers in the
// extension), returned to the allocator when destroyed.
class TorchDeviceMemory {
 public:
  struct State;  // the allocator's DataPtr, defined with torch in torch_comms.cpp

  explicit TorchDeviceMemory(std::unique_ptr<State> state);
  ~TorchDeviceMemory();
  TorchDeviceMemory(const TorchDeviceMemory&) = delete;
  TorchDeviceMemory& operator=(const TorchDeviceMemory&) = delete;

  std::uint64_t addr() const;

 private:
  std::unique_ptr<State> state_;
};

// `bytes` bytes of CUDA device `device` from torch's caching allocator, for the current stream
// of that device, which must be the calling thread's current device.
std::unique_ptr<TorchDeviceMemory> allocate_torch_device_memory(std::size_t device,
                                                                std::size_t bytes);

// torch.profiler's ranges for the core's collective calls and their phases (under
// torch.autograd.profiler.emit_nvtx, NVTX ranges): opens a range named `name` on the calling
// thread; closes the innermost range the calling thread opened (cpp/profiler_ranges.cpp).
void open_profiler_range(rust::Str name);
void close_profiler_range();

class TorchComms {
 public:
  struct Groups;  // the c10d process groups, defined with torch in torch_comms.cpp

  explicit TorchComms(std::unique_ptr<Groups> groups);
  ~TorchComms();
  TorchComms(const TorchComms&) = delete;
  TorchComms& operator=(const TorchComms&) = delete;

  bool has_level(CommLevel level) const;
  std::size_t rank(CommLevel level) const;
  std::size_t size(CommLevel level) const;
  void all_gather(CommLevel level, rust::Slice<const std::uint8_t> send,
                  rust::Slice<std::uint8_t> recv) const;
  void all_to_all(CommLevel level, rust::Slice<const std::uint8_t> send,
                  rust::Slice<std::uint8_t> recv) const;
  // The all-to-all of host bytes, issued and not waited for: the buffers must stay alive
  // and untouched until the returned exchange's wait() has returned.
  std::unique_ptr<PendingExchange> start_all_to_all(CommLevel level,
                                                    rust::Slice<const std::uint8_t> send,
                                                    rust::Slice<std::uint8_t> recv) const;
  float all_reduce_max(CommLevel level, float value) const;
  // The same exchanges on CUDA memory given by device address, on the current stream of the
  // current CUDA device (the caller sets both).
  void all_gather_device(CommLevel level, std::uint64_t send, std::size_t send_bytes,
                         std::uint64_t recv, std::size_t recv_bytes) const;
  void all_to_all_device(CommLevel level, std::uint64_t send, std::size_t send_bytes,
                         std::uint64_t recv, std::size_t recv_bytes) const;
  // The all-to-all of CUDA memory, issued after the current stream's work and not waited
  // for: the buffers must not be reused before the returned exchange's wait() (which the
  // caller makes with the same stream current), nor freed before the stream has passed it.
  std::unique_ptr<PendingExchange> start_all_to_all_device(CommLevel level, std::uint64_t send,
                                                           std::size_t send_bytes,
                                                           std::uint64_t recv,
                                                           std::size_t recv_bytes) const;
  void reduce_scatter_device(CommLevel level, SumDtype dtype, std::uint64_t send,
                             std::size_t send_numel, std::uint64_t recv,
                             std::size_t recv_numel) const;
  // The MAX all-reduce of the one float at device address `word`, in place.
  void all_reduce_max_device(CommLevel level, std::uint64_t word) const;

 private:
  std::unique_ptr<Groups> groups_;
};

}  // namespace sdp4bit::ffi
