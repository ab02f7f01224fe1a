// TorchComms: the Rust core's exchanges over c10d process groups. Each call wraps the core's
// buffers as tensors without copying, issues the collective and waits for it (or, for
// start_all_to_all, returns the pending work for the core to wait on later); c10d errors
// (timeouts, a peer that left) propagate as exceptions, which the cxx bridge hands to Rust as
// errors.
//
// Where a buffer lives and what the group's backend reaches can differ: an NCCL group only
// takes CUDA tensors, so host buffers (the set-up check, Global-QSGD's absmax) travel through
// a tensor on the group's CUDA device; a gloo group's exchanges of CUDA buffers travel through
// host copies (for tests on one GPU; production runs use NCCL, which reads device memory).
#include "torch_comms_groups.h"

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "sdp4bit/src/ffi/mod.rs.h"
#include "stream_order.h"

namespace sdp4bit::ffi {

namespace {

at::Tensor wrap(std::uint64_t addr, std::size_t numel, at::ScalarType dtype,
                c10::Device device) {
  return at::from_blob(reinterpret_cast<void*>(addr), {static_cast<int64_t>(numel)},
                       at::TensorOptions().dtype(dtype).device(device));
}

at::Tensor wrap_host_bytes(const std::uint8_t* data, std::size_t len) {
  return wrap(reinterpret_cast<std::uint64_t>(data), len, at::kByte, c10::Device(at::kCPU));
}

// The current CUDA device of the calling thread: the bucket's, which the extension makes
// current (its stream guard on the caller's thread, ProcessGroups::executor_device's guard on
// the executor's).
c10::Device current_cuda_device() {
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice();
}

at::ScalarType scalar_type(SumDtype dtype) {
  switch (dtype) {
    case SumDtype::Float32:
      return at::kFloat;
    case SumDtype::Int8:
      return at::kChar;
    case SumDtype::Int16:
      return at::kShort;
  }
  throw std::runtime_error("sdp4bit: unknown reduce-scatter element type");
}

const char* level_name(CommLevel level) {
  switch (level) {
    case CommLevel::World:
      return "world";
    case CommLevel::Intra:
      return "intra-node";
    case CommLevel::Inter:
      return "inter-node";
  }
  return "unknown";
}

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;
using Backend = c10d::ProcessGroup::BackendType;

// Runs `collective(out, in)` on tensors the group's backend can read: `in` and `out` as they
// are, or staged on `device` (copied there, exchanged, copied back into `out`).
template <class F>
void exchange_on(const at::Tensor& in, const at::Tensor& out, std::optional<c10::Device> device,
                 F&& collective) {
  if (!device) {
    collective(out, in);
    return;
  }
  at::Tensor staged_in = in.to(*device);
  at::Tensor staged_out = at::empty_like(out, out.options().device(*device));
  collective(staged_out, staged_in);
  out.copy_(staged_out);
}

// Where host buffers must be staged for `group`: its CUDA device when it is NCCL-only.
std::optional<c10::Device> host_staging(const Group& group) {
  if (group->getBackendType() == Backend::NCCL) return current_cuda_device();
  return std::nullopt;
}

// Where CUDA buffers must be staged for `group`: the host when it is gloo-only.
std::optional<c10::Device> device_staging(const Group& group) {
  if (group->getBackendType() == Backend::GLOO) return c10::Device(at::kCPU);
  return std::nullopt;
}

void all_gather_tensors(const Group& group, const at::Tensor& in, const at::Tensor& out,
                        std::optional<c10::Device> staging) {
  exchange_on(in, out, staging, [&](at::Tensor o, at::Tensor i) {
    group->_allgather_base(o, i)->wait();
  });
}

// An equal-split all-to-all of `in` into `out`, issued with c10d's default options, whose
// asyncOp is true (torch 2.11 torch/csrc/distributed/c10d/Types.hpp:165-168): an NCCL group
// runs it on its own stream after the current stream's work, gloo on its own threads.
c10::intrusive_ptr<c10d::Work> issue_all_to_all(const Group& group, at::Tensor out,
                                                at::Tensor in) {
  std::vector<int64_t> equal_splits;
  return group->alltoall_base(out, in, equal_splits, equal_splits);
}

// The exchanges of stream_order.h's pipelined collectives over one c10d group: issued as
// above, completed by Work::wait(), which for NCCL makes the current stream wait for the
// exchange without blocking the host (ProcessGroupNCCL.hpp:291-319, :357-370) and for gloo
// blocks until it has run.
//
// c10d's own protection of the buffers (record_stream on its stream, or the tensors it stashes
// until wait() with TORCH_NCCL_AVOID_RECORD_STREAMS, ProcessGroupNCCL.hpp:181-186 and
// :490-500) does not reach the core's buffers: they are wrapped with from_blob, and the caching
// allocator skips record_stream for memory it did not hand out through that pointer
// (c10/cuda/CUDACachingAllocator.cpp, recordStream: "If a tensor is not allocated by this
// instance, simply skip"), while a stashed wrapper keeps nothing alive. They stay safe as
// stream_order.h says: allocated with the side stream current, and reused only after the side
// stream's wait for the exchange, which the core always enqueues.
struct C10dExchanges {
  using Buffer = at::Tensor;
  using Work = c10::intrusive_ptr<c10d::Work>;

  Group group;

  Work issue_exchange(const at::Tensor& send, const at::Tensor& recv) const {
    return issue_all_to_all(group, recv, send);
  }
  void wait_exchange(const Work& work) const { work->wait(); }
};

void all_to_all_tensors(const Group& group, const at::Tensor& in, const at::Tensor& out,
                        std::optional<c10::Device> staging) {
  exchange_on(in, out, staging,
              [&](at::Tensor o, at::Tensor i) { issue_all_to_all(group, o, i)->wait(); });
}

}  // namespace

struct PendingExchange::State {
  std::optional<ExchangeInFlight<C10dExchanges>> flight;
  at::Tensor staged_in;   // kept alive while the exchange reads it (staged exchanges only)
  at::Tensor staged_out;  // copied into `out` once the exchange has completed
  at::Tensor out;
};

PendingExchange::PendingExchange(std::unique_ptr<State> state) : state_(std::move(state)) {}

PendingExchange::~PendingExchange() = default;

void PendingExchange::wait() {
  state_->flight->wait();
  if (state_->staged_out.defined()) state_->out.copy_(state_->staged_out);
}

namespace {

// Starts the all-to-all of `in` into `out` on `group` (staged on `staging` when given: copied
// there now, copied back into `out` by wait()).
std::unique_ptr<PendingExchange> start_exchange_on(const Group& group, const at::Tensor& in,
                                                   const at::Tensor& out,
                                                   std::optional<c10::Device> staging) {
  auto state = std::make_unique<PendingExchange::State>();
  state->out = out;
  C10dExchanges exchanges{group};
  if (staging) {
    state->staged_in = in.to(*staging);
    state->staged_out = at::empty_like(out, out.options().device(*staging));
    state->flight.emplace(start_exchange(exchanges, state->staged_in, state->staged_out));
  } else {
    state->flight.emplace(start_exchange(exchanges, in, out));
  }
  return std::make_unique<PendingExchange>(std::move(state));
}

}  // namespace

struct TorchDeviceMemory::State {
  c10::DataPtr memory;
};

TorchDeviceMemory::TorchDeviceMemory(std::unique_ptr<State> state) : state_(std::move(state)) {}

TorchDeviceMemory::~TorchDeviceMemory() = default;

std::uint64_t TorchDeviceMemory::addr() const {
  return reinterpret_cast<std::uint64_t>(state_->memory.get());
}

// The allocator behind torch.empty(..., device="cuda"): it serves the current device and
// associates the block with the current stream (the extension makes both the bucket's device
// and its groups' side stream), and counts it in torch.cuda.memory_allocated.
std::unique_ptr<TorchDeviceMemory> allocate_torch_device_memory(std::size_t device,
                                                                std::size_t bytes) {
  c10::Device current = current_cuda_device();
  if (static_cast<std::size_t>(current.index()) != device) {
    throw std::runtime_error("sdp4bit: device memory for cuda:" + std::to_string(device) +
                             " was asked for while " + current.str() + " is current");
  }
  // The caching allocator exists only once torch has initialised CUDA (torch.cuda's lazy
  // init); a process whose first CUDA work is an sdp4bit bucket has not done that yet.
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  auto state = std::make_unique<TorchDeviceMemory::State>();
  state->memory = c10::GetAllocator(c10::DeviceType::CUDA)->allocate(bytes);
  if (state->memory.get() == nullptr) {
    throw std::runtime_error("sdp4bit: torch's CUDA allocator returned no memory for " +
                             std::to_string(bytes) + " bytes");
  }
  return std::make_unique<TorchDeviceMemory>(std::move(state));
}

TorchComms::TorchComms(std::unique_ptr<Groups> groups) : groups_(std::move(groups)) {}

TorchComms::~TorchComms() = default;

const c10::intrusive_ptr<c10d::ProcessGroup>& TorchComms::Groups::at(CommLevel level) const {
  const c10::intrusive_ptr<c10d::ProcessGroup>* group = nullptr;
  switch (level) {
    case CommLevel::World:
      group = &world;
      break;
    case CommLevel::Intra:
      group = &intra;
      break;
    case CommLevel::Inter:
      group = &inter;
      break;
  }
  if (group == nullptr || !*group) {
    throw std::runtime_error(std::string("sdp4bit: no ") + level_name(level) +
                             " process group was set up");
  }
  return *group;
}

bool TorchComms::has_level(CommLevel level) const {
  switch (level) {
    case CommLevel::World:
      return static_cast<bool>(groups_->world);
    case CommLevel::Intra:
      return static_cast<bool>(groups_->intra);
    case CommLevel::Inter:
      return static_cast<bool>(groups_->inter);
  }
  return false;
}

std::size_t TorchComms::rank(CommLevel level) const {
  return static_cast<std::size_t>(groups_->at(level)->getRank());
}

std::size_t TorchComms::size(CommLevel level) const {
  return static_cast<std::size_t>(groups_->at(level)->getSize());
}

void TorchComms::all_gather(CommLevel level, rust::Slice<const std::uint8_t> send,
                            rust::Slice<std::uint8_t> recv) const {
  const Group& group = groups_->at(level);
  all_gather_tensors(group, wrap_host_bytes(send.data(), send.size()),
                     wrap_host_bytes(recv.data(), recv.size()), host_staging(group));
}

void TorchComms::all_to_all(CommLevel level, rust::Slice<const std::uint8_t> send,
                            rust::Slice<std::uint8_t> recv) const {
  const Group& group = groups_->at(level);
  all_to_all_tensors(group, wrap_host_bytes(send.data(), send.size()),
                     wrap_host_bytes(recv.data(), recv.size()), host_staging(group));
}

std::unique_ptr<PendingExchange> TorchComms::start_all_to_all(
    CommLevel level, rust::Slice<const std::uint8_t> send,
    rust::Slice<std::uint8_t> recv) const {
  const Group& group = groups_->at(level);
  return start_exchange_on(group, wrap_host_bytes(send.data(), send.size()),
                           wrap_host_bytes(recv.data(), recv.size()), host_staging(group));
}

float TorchComms::all_reduce_max(CommLevel level, float value) const {
  const Group& group = groups_->at(level);
  c10::Device device = host_staging(group).value_or(c10::Device(at::kCPU));
  std::vector<at::Tensor> tensors{
      at::full({1}, value, at::TensorOptions().dtype(at::kFloat).device(device))};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  group->allreduce(tensors, options)->wait();
  return tensors[0].item<float>();
}

void TorchComms::all_gather_device(CommLevel level, std::uint64_t send, std::size_t send_bytes,
                                   std::uint64_t recv, std::size_t recv_bytes) const {
  const Group& group = groups_->at(level);
  c10::Device device = current_cuda_device();
  all_gather_tensors(group, wrap(send, send_bytes, at::kByte, device),
                     wrap(recv, recv_bytes, at::kByte, device), device_staging(group));
}

void TorchComms::all_to_all_device(CommLevel level, std::uint64_t send, std::size_t send_bytes,
                                   std::uint64_t recv, std::size_t recv_bytes) const {
  const Group& group = groups_->at(level);
  c10::Device device = current_cuda_device();
  all_to_all_tensors(group, wrap(send, send_bytes, at::kByte, device),
                     wrap(recv, recv_bytes, at::kByte, device), device_staging(group));
}

// A pipelined chunk's exchange: issued after the current stream's (the side stream's) work so
// far, running while the side stream computes the next chunk; wait() makes the side stream wait
// for it (stream_order.h). A gloo group stages through the host: the send buffer is copied now
// (waiting for the side stream), wait() blocks for the exchange and copies the result back on
// the side stream.
std::unique_ptr<PendingExchange> TorchComms::start_all_to_all_device(
    CommLevel level, std::uint64_t send, std::size_t send_bytes, std::uint64_t recv,
    std::size_t recv_bytes) const {
  const Group& group = groups_->at(level);
  c10::Device device = current_cuda_device();
  return start_exchange_on(group, wrap(send, send_bytes, at::kByte, device),
                           wrap(recv, recv_bytes, at::kByte, device), device_staging(group));
}

// Global-QSGD's absmax word stays in device memory: NCCL reduces it on the current stream (the
// work's wait() orders that stream after it, without blocking the host); a gloo group reduces
// a host copy.
void TorchComms::all_reduce_max_device(CommLevel level, std::uint64_t word) const {
  const Group& group = groups_->at(level);
  at::Tensor value = wrap(word, 1, at::kFloat, current_cuda_device());
  std::optional<c10::Device> staging = device_staging(group);
  std::vector<at::Tensor> tensors{staging ? value.to(*staging) : value};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  group->allreduce(tensors, options)->wait();
  if (staging) value.copy_(tensors[0]);
}

// An all-to-all, then the sum of the W received blocks on the device: floats left to right in
// rank order ((b0 + b1) + b2 ...), as the host path sums, integers (exact in any order, never
// overflowing by Global-QSGD's bound) in one reduction kernel. The same bits as the in-process
// collective whatever the backend's own reduction order, for the bytes of a direct-send
// reduce-scatter (and for any element type, NCCL having no 16-bit integer sum).
void TorchComms::reduce_scatter_device(CommLevel level, SumDtype dtype, std::uint64_t send,
                                       std::size_t send_numel, std::uint64_t recv,
                                       std::size_t recv_numel) const {
  const Group& group = groups_->at(level);
  c10::Device device = current_cuda_device();
  at::ScalarType type = scalar_type(dtype);
  at::Tensor in = wrap(send, send_numel, type, device);
  at::Tensor out = wrap(recv, recv_numel, type, device);
  at::Tensor blocks = at::empty_like(in);
  all_to_all_tensors(group, in, blocks, device_staging(group));
  auto size = static_cast<int64_t>(send_numel / recv_numel);
  at::Tensor per_rank = blocks.view({size, static_cast<int64_t>(recv_numel)});
  if (dtype != SumDtype::Float32) {
    at::sum_out(out, per_rank, {0}, /*keepdim=*/false, type);
    return;
  }
  out.copy_(per_rank[0]);
  for (int64_t r = 1; r < size; ++r) out.add_(per_rank[r]);
}

}  // namespace sdp4bit::ffi
