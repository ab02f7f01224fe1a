// The order a device collective's work takes on the streams of its device: the order FSDP2's
// reduce-scatter and Megatron's overlapped gradient reduction give theirs.
//
//   start (on the caller's thread, enqueuing only):
//     ready = event recorded on the caller's current stream       (what produced the inputs)
//     side stream waits for `ready`
//     every input and output buffer is recorded on the side stream (the caching allocator
//       does not hand its memory out again before the side stream has passed this point)
//     the collective's kernels and exchanges are enqueued with the side stream current
//     done = event recorded on the side stream
//   wait():         the stream current at wait() waits for `done` (the host does not block)
//   is_completed(): whether the device has passed `done`
//
// As torch does it (torch 2.11, megatron-core 0.16.1):
// - torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:532-557 (foreach_reduce): the
//   reduce-scatter stream waits for the current stream, the collective is issued inside
//   `with device_handle.stream(reduce_scatter_stream)`, and an event is recorded after it;
//   _fsdp_param_group.py:538 makes the current stream wait for that event later.
// - megatron/core/distributed/param_and_grad_buffer.py:417-433 (start_grad_sync): the
//   communication stream waits for the default stream and the collectives are issued in its
//   stream context; :529-536 (finish_grad_sync) makes the default stream wait for it.
// - torch/csrc/distributed/c10d/Work.hpp:83-98 (synchronize, which ProcessGroupNCCL's wait()
//   does for CUDA work): "the streams of the caller wait for completion"; :67-68 isCompleted()
//   is non-blocking.
//
// The order is written once over a `Device` policy so that it runs on torch's c10 streams and
// events in the extension (TorchStreams in sdp4bit_ops.cpp) and on a model of streams in the
// tests (tests/stream_order/). A `Device` provides, none of them blocking the host:
//   using Stream, Event, Buffer;
//   Stream current() const;                            the caller's current stream
//   Event record(const Stream&) const;                 an event recorded on the stream now
//   void block(const Event&, const Stream&) const;     the stream waits for the event
//   bool query(const Event&) const;                    whether the device has passed it
//   void protect(const Buffer&, const Stream&) const;  the allocator's record_stream
//   template <class F> void with_current(const Stream&, F&&) const;
//                                                      runs F with the stream current
//
// Pipelined collectives (P > 1 chunks, docs/numerics.md §5.4) exchange chunk p while the side
// stream computes chunk p + 1. Inside the collective (the side stream current):
//
//   start_exchange:  the exchange is issued asynchronously on the communicator's own stream,
//                    ordered after the work enqueued on the side stream so far (the pass that
//                    wrote its send buffer); the side stream goes on with the next passes
//   wait():          the side stream waits for the exchange's end (the host does not block);
//                    called before the pass that reads the received chunk and before any pass
//                    writes either buffer again, and before the collective's done event
//
// The exchange buffers are the collective's own, allocated with the side stream current, so the
// caching allocator hands their memory to a later user only on the side stream, after the point
// of the free, which comes after every exchange's wait: the Rust core waits for every exchange
// it starts, also when it returns early with an error (collective::InFlight). For the same
// reason a collective's set-up, which writes its tables into memory the allocator may just
// have taken back from an earlier collective on the side stream (a bucket re-created while
// its predecessor runs), is enqueued on the side stream too, never on the legacy default
// stream, which a side stream from torch's pool does not wait for.
//
// As torch does it: c10d's all-to-all with async_op=True runs on the process group's stream
// after the current stream's work, and Work::wait() makes the current stream wait for it
// (torch 2.11: torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:291-319 and :357-370, Types.hpp:
// 165-168); FSDP2 issues its all-gather so on its all-gather stream and waits for the Work later
// (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:274-282 and :363-364).
//
// A `Device` that runs exchanges provides in addition:
//   using Work;                                         an exchange in flight
//   Work issue_exchange(const Buffer& send, const Buffer& recv) const;
//                                                      issued after the current stream's work
//   void wait_exchange(const Work&) const;              the current stream waits for its end
//
// Each kind of collective has a side stream of its own on each device (SideStreams), so that a
// parameter all-gather's work does not queue behind a gradient reduce-scatter's still in
// flight, nor the reverse, as FSDP2 gives its all-gather and its reduce-scatter streams of
// their own so that they overlap (torch 2.11:
// torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:71-79). The order above holds on
// each; the two kinds share no buffer.
#pragma once

#include <map>
#include <utility>
#include <vector>

namespace sdp4bit {

// The kinds of collective, each on side streams of its own.
enum class CollectiveKind { ReduceScatter, AllGather };

// The side streams of one set of process groups, one per device and kind: made by `make()` (a
// new stream each call) on first use, then the same one, so that a kind's collectives run in
// program order on it and the caching allocator hands the memory they give back only to later
// collectives of that kind.
template <class Stream>
class SideStreams {
 public:
  template <class Make>
  Stream get(int device, CollectiveKind kind, Make&& make) {
    const auto key = std::make_pair(device, kind);
    auto found = streams_.find(key);
    if (found == streams_.end()) found = streams_.emplace(key, make()).first;
    return found->second;
  }

 private:
  std::map<std::pair<int, CollectiveKind>, Stream> streams_;
};

// The completion of a collective enqueued by enqueue_on_side_stream: its done event.
template <class Device>
class SideStreamCompletion {
 public:
  SideStreamCompletion(Device device, typename Device::Event done)
      : device_(std::move(device)), done_(std::move(done)) {}

  // Makes the caller's current stream wait for the collective; returns at once.
  void wait_on_current_stream() const { device_.block(done_, device_.current()); }

  // Whether the device has finished the collective.
  bool is_completed() const { return device_.query(done_); }

 private:
  Device device_;
  typename Device::Event done_;
};

// Enqueues `collective` (a callable that enqueues kernels and exchanges on the current stream)
// on `side`, after everything enqueued so far on the caller's current stream and with
// `buffers` recorded on `side`; the caller's current stream is not made to wait. If
// `collective` throws, the exception propagates and the buffers stay recorded on `side`.
template <class Device, class Collective>
SideStreamCompletion<Device> enqueue_on_side_stream(
    const Device& device, const typename Device::Stream& side,
    const std::vector<typename Device::Buffer>& buffers, Collective&& collective) {
  typename Device::Event ready = device.record(device.current());
  device.block(ready, side);
  for (const auto& buffer : buffers) device.protect(buffer, side);
  device.with_current(side, std::forward<Collective>(collective));
  return SideStreamCompletion<Device>(device, device.record(side));
}

// One exchange of a pipelined collective in flight on the communicator's stream.
template <class Device>
class ExchangeInFlight {
 public:
  ExchangeInFlight(Device device, typename Device::Work work)
      : device_(std::move(device)), work_(std::move(work)) {}

  // Makes the current stream (the side stream) wait for the exchange; returns at once.
  void wait() const { device_.wait_exchange(work_); }

 private:
  Device device_;
  typename Device::Work work_;
};

// Issues the exchange of `send` into `recv` after the work enqueued on the current stream so
// far, without making the current stream wait for it.
template <class Device>
ExchangeInFlight<Device> start_exchange(const Device& device, const typename Device::Buffer& send,
                                        const typename Device::Buffer& recv) {
  return ExchangeInFlight<Device>(device, device.issue_exchange(send, recv));
}

}  // namespace sdp4bit
