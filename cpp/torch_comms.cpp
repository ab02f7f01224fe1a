// TorchComms: the Rust core's exchanges over c10d process groups (gloo for CPU tensors).
// Each call wraps the core's buffers as tensors without copying, issues the collective and
// waits for it; c10d errors (timeouts, a peer that left) propagate as exceptions, which the
// cxx bridge hands to Rust as errors.
#include "torch_comms_groups.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "sdp4bit/src/ffi/mod.rs.h"

namespace sdp4bit::ffi {

namespace {

at::Tensor wrap_bytes(const std::uint8_t* data, std::size_t len) {
  return at::from_blob(const_cast<std::uint8_t*>(data), {static_cast<int64_t>(len)},
                       at::TensorOptions().dtype(at::kByte).device(at::kCPU));
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

}  // namespace

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
  at::Tensor in = wrap_bytes(send.data(), send.size());
  at::Tensor out = wrap_bytes(recv.data(), recv.size());
  groups_->at(level)->_allgather_base(out, in)->wait();
}

void TorchComms::all_to_all(CommLevel level, rust::Slice<const std::uint8_t> send,
                            rust::Slice<std::uint8_t> recv) const {
  at::Tensor in = wrap_bytes(send.data(), send.size());
  at::Tensor out = wrap_bytes(recv.data(), recv.size());
  std::vector<int64_t> equal_splits;
  groups_->at(level)->alltoall_base(out, in, equal_splits, equal_splits)->wait();
}

float TorchComms::all_reduce_max(CommLevel level, float value) const {
  std::vector<at::Tensor> tensors{at::full({1}, value, at::TensorOptions().dtype(at::kFloat))};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  groups_->at(level)->allreduce(tensors, options)->wait();
  return tensors[0].item<float>();
}

}  // namespace sdp4bit::ffi
