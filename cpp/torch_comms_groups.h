// The definition of TorchComms::Groups, which needs torch; only the extension includes it.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "sdp4bit/cpp/torch_comms.h"

namespace sdp4bit::ffi {

struct TorchComms::Groups {
  c10::intrusive_ptr<c10d::ProcessGroup> world;
  c10::intrusive_ptr<c10d::ProcessGroup> intra;  // null when nodes are unequal
  c10::intrusive_ptr<c10d::ProcessGroup> inter;  // null when nodes are unequal

  // The group of `level`, or an exception naming the missing level.
  const c10::intrusive_ptr<c10d::ProcessGroup>& at(CommLevel level) const;
};

}  // namespace sdp4bit::ffi
