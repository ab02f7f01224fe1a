// The core's profiler ranges (src/collective/phases.rs) as torch.profiler ranges: each one an
// at::RecordFunction of the user scope, as torch.profiler.record_function makes, so they show
// in torch.profiler traces (on the thread that runs the collective: the executor thread, which
// runs each job with its submitter's thread-local state, or the training thread for CUDA
// buckets) and, under torch.autograd.profiler.emit_nvtx, as NVTX ranges in Nsight Systems.

#include <memory>
#include <string_view>
#include <vector>

#include <ATen/record_function.h>

#include "torch_comms.h"

namespace sdp4bit::ffi {

namespace {

// The ranges the calling thread opened, innermost last.
thread_local std::vector<std::unique_ptr<at::RecordFunction>> open_ranges;

}  // namespace

void open_profiler_range(rust::Str name) {
  auto range = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (range->isActive()) {
    // The core's names are static strings, so the view outlives the range.
    range->before(std::string_view(name.data(), name.size()), c10::ArrayRef<const c10::IValue>{});
  }
  open_ranges.push_back(std::move(range));
}

void close_profiler_range() {
  if (!open_ranges.empty()) open_ranges.pop_back();  // ~RecordFunction ends the range
}

}  // namespace sdp4bit::ffi
