// The torch extension: TorchScript classes and ops over the Rust core (src/ffi).
//
//   torch.classes.sdp4bit.ProcessGroups(world, intra, inter)   names of c10d groups
//       .side_stream(device_index, collective) -> [stream_id, device_index, device_type]
//           collective: "reduce_scatter" or "all_gather"
//   torch.classes.sdp4bit.GradReduceScatter(groups, config, node_labels, numel, bucket_id,
//                                           device, side_stream_handle)
//       .start(bucket, shard, step, side_stream_handle) -> Work
//       .reads_back_integer_sums() / .take_integer_sum_status() / .integer_sum_error(rank,
//       status): Global-QSGD's overflows on CUDA, agreed on by Python (collectives.py)
//   torch.classes.sdp4bit.WeightAllGather(groups, config, node_labels, params, bucket_id,
//                                         side_stream_handle)
//       .start(params, step, side_stream_handle) -> Work
//   torch.classes.sdp4bit.Work.wait() / .is_completed() / .completion_fd()
//   torch.ops.sdp4bit.schema (presets, knobs, limits as JSON) / resolve_config (a config's
//       record as JSON) / plan_wire_bytes / simulate_* (the tests' in-process references,
//       only in a build with SDP4BIT_TEST_OPS: cargo feature test-ops, scripts/build_native.py)
//
// A bucket lives on the CPU or on one CUDA device, and the two run differently:
// - CPU buckets (the Rust core's CPU backend, host exchanges): start() queues the collective
//   on the ProcessGroups' executor thread, which runs them in submission order; wait() blocks
//   until it has run; completion_fd() is a descriptor that becomes readable once it has run
//   (completion_signal.h), for Python to block on without a call into the extension; a Work
//   keeps its tensors alive until it is destroyed.
// - CUDA buckets (the CUDA backend): start() enqueues everything on the calling thread, in
//   program order, and returns without waiting for the device (the order of stream_order.h):
//   the groups' side stream of the device and collective kind (one per device and kind, of
//   sdp4bit's own, never one of torch's pool streams that NCCL may also use: a gradient
//   reduce-scatter's work and a parameter all-gather's do not queue behind each other) waits
//   for the caller's current stream, every kernel, copy and c10d exchange goes on the side
//   stream (Python passes its cudaStream_t as side_stream_handle: the extension is built
//   without CUDA headers), the tensors are recorded on it (record_stream), and a done event
//   follows; Work.wait() makes the stream current at wait() wait for that event,
//   is_completed() queries it. The caller's stream never waits for an exchange before wait().
// A ProcessGroups serves buckets of one kind. Every error reaches Python as a RuntimeError
// whose message starts with "sdp4bit:" and names the problem.
#include <Python.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <torch/version.h>

#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "completion_signal.h"
#include "executor.h"
#include "stream_order.h"
#include "torch_comms_groups.h"
#include "sdp4bit/src/ffi/mod.rs.h"

namespace sdp4bit {
namespace {

// Runs `f`, turning an error of the Rust core (or of c10d) into a torch error.
template <class F>
auto rethrow_as_torch_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "sdp4bit: ", e.what());
  }
}

// Why `t` cannot be the `what` of this bucket, planned on `device`, or "" if it can.
std::string tensor_problem(const char* what, const at::Tensor& t, at::ScalarType dtype,
                           int64_t numel, c10::Device device) {
  if (!t.defined()) return std::string(what) + " is undefined";
  if (t.device() != device) {
    return std::string(what) + " is on " + t.device().str() + ", the bucket was planned on " +
           device.str();
  }
  if (t.scalar_type() != dtype) {
    return std::string(what) + " must be " + c10::toString(dtype) + ", got " +
           c10::toString(t.scalar_type());
  }
  if (!t.is_contiguous()) return std::string(what) + " must be contiguous";
  if (t.numel() != numel) {
    return std::string(what) + " has " + std::to_string(t.numel()) + " elements, the bucket " +
           "was planned for " + std::to_string(numel);
  }
  return "";
}

void check_tensor(const char* what, const at::Tensor& t, at::ScalarType dtype, int64_t numel,
                  c10::Device device) {
  std::string problem = tensor_problem(what, t, dtype, numel, device);
  TORCH_CHECK(problem.empty(), "sdp4bit: ", problem);
}

// The element type of a gradient bucket and its shard: Float or BFloat16, the same for both
// (docs/numerics.md §7.5). An undefined tensor is left to check_tensor to name.
at::ScalarType gradient_dtype(const at::Tensor& bucket, const at::Tensor& shard) {
  if (!bucket.defined() || !shard.defined()) return at::kFloat;
  at::ScalarType dtype = bucket.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "sdp4bit: gradient bucket must be Float or BFloat16, got ", c10::toString(dtype));
  TORCH_CHECK(shard.scalar_type() == dtype, "sdp4bit: gradient shard is ",
              c10::toString(shard.scalar_type()), " but the gradient bucket is ",
              c10::toString(dtype), ": both must be Float or both BFloat16");
  return dtype;
}

// The device named `name` ("cpu", "cuda", "cuda:1"; a bare "cuda" is the current device),
// or the CPU with `problem` set to what is wrong with the name.
c10::Device resolve_device(const std::string& name, std::string& problem) {
  try {
    c10::Device device(name);
    if (!device.is_cpu() && !device.is_cuda()) {
      problem = "buckets live on CPU or CUDA, not " + device.str();
      return c10::Device(at::kCPU);
    }
    if (device.is_cuda() && !device.has_index()) {
      device = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice();
    }
    return device;
  } catch (const std::exception& e) {
    problem = "device '" + name + "' cannot be used: " + e.what();
    return c10::Device(at::kCPU);
  }
}

// Why the CUDA backend cannot run on `device`, or "" if it can (or `device` is the CPU).
std::string device_problem(c10::Device device) {
  if (!device.is_cuda()) return "";
  std::string problem(ffi::cuda_device_problem(static_cast<size_t>(device.index())));
  if (problem.empty()) return "";
  return "CUDA buckets on " + device.str() + " cannot run: " + problem;
}

// Why the kernel check of a CUDA bucket's kernels fails on `device` (a kernel whose bytes differ
// from the host backend's), or "" (also for the CPU). Run before the set-up agreement, so that a
// failure on one rank fails the set-up on every rank.
std::string kernel_check_problem(c10::Device device, const ffi::ParsedConfig& config,
                                 const std::vector<uint64_t>& labels, int64_t rank,
                                 bool weights) {
  if (!device.is_cuda()) return "";
  std::string problem(ffi::cuda_bucket_problem(
      static_cast<size_t>(device.index()), config,
      rust::Slice<const uint64_t>(labels.data(), labels.size()), static_cast<size_t>(rank),
      weights));
  if (problem.empty()) return "";
  return "CUDA buckets on " + device.str() + " cannot run: " + problem;
}

// The order of stream_order.h on torch's streams and events of one device, through the
// device-generic c10 interfaces (c10::Event, c10::impl::VirtualGuardImpl), so that the
// extension builds against CPU-only torch too.
class TorchStreams {
 public:
  using Stream = c10::Stream;
  using Event = c10::Event;
  using Buffer = at::Tensor;

  explicit TorchStreams(c10::Device device) : device_(device) {}

  Stream current() const { return guard().getStream(device_); }

  Event record(const Stream& stream) const {
    Event event(device_.type());
    event.record(stream);
    return event;
  }

  void block(const Event& event, const Stream& stream) const { event.block(stream); }

  bool query(const Event& event) const { return event.query(); }

  // Tensor.record_stream: the caching allocator keeps the memory from other uses until
  // `stream` has passed this point, even if the tensor is freed before (memory torch did not
  // allocate is left to its owner).
  void protect(const Buffer& tensor, const Stream& stream) const {
    guard().recordDataPtrOnStream(tensor.storage().data_ptr(), stream);
  }

  template <class F>
  void with_current(const Stream& stream, F&& f) const {
    c10::StreamGuard on_stream(stream);
    f();
  }

 private:
  c10::impl::VirtualGuardImpl guard() const { return c10::impl::VirtualGuardImpl(device_.type()); }

  c10::Device device_;
};

using DeviceCompletion = SideStreamCompletion<TorchStreams>;

uint64_t device_address(const void* data) { return reinterpret_cast<uint64_t>(data); }

uint32_t checked_bucket_id(int64_t bucket_id) {
  const int64_t max = ffi::max_bucket_id();
  TORCH_CHECK(bucket_id >= 0 && bucket_id <= max, "sdp4bit: bucket_id ", bucket_id,
              " is outside 0..=", max);
  return static_cast<uint32_t>(bucket_id);
}

uint64_t checked_step(int64_t step) {
  TORCH_CHECK(step >= 0, "sdp4bit: step ", step, " is negative");
  return static_cast<uint64_t>(step);
}

std::vector<uint64_t> checked_labels(const std::vector<int64_t>& labels) {
  std::vector<uint64_t> out;
  out.reserve(labels.size());
  for (int64_t label : labels) {
    TORCH_CHECK(label >= 0, "sdp4bit: node label ", label, " is negative");
    out.push_back(static_cast<uint64_t>(label));
  }
  return out;
}

// Whether the interpreter is shutting down. The function is looked up in the interpreter that
// loaded the extension (Py_IsFinalizing from Python 3.13 on, _Py_IsFinalizing before), not
// linked, so that the extension's only Python symbols are the stable ABI's and one build loads
// under every Python 3 minor version (tests/python/test_native.py checks the symbols).
bool interpreter_finalizing() {
  using IsFinalizing = int (*)();
  static const IsFinalizing is_finalizing = [] {
    void* found = dlsym(RTLD_DEFAULT, "Py_IsFinalizing");
    if (found == nullptr) found = dlsym(RTLD_DEFAULT, "_Py_IsFinalizing");
    TORCH_CHECK(found != nullptr,
                "sdp4bit: the interpreter exports neither Py_IsFinalizing nor _Py_IsFinalizing");
    return reinterpret_cast<IsFinalizing>(found);
  }();
  return is_finalizing() != 0;
}

// The profiler state of the thread that submits a job (torch.profiler's callbacks and its
// per-thread record), taken with it to the executor thread, as at::launch takes it to its
// threads, so that the core's ranges of a CPU bucket's collective (cpp/profiler_ranges.cpp) show
// in the trace that was being recorded when start() was called. Only the profiler's state: the
// rest of the submitter's thread-local state (grad mode, Python modes) stays behind.
class SubmittersProfiler {
 public:
  SubmittersProfiler()
      : callbacks_(at::get_record_function_tls_()),
        debug_info_(c10::ThreadLocalDebugInfo::current()) {}

  void run(const std::function<void()>& job) const {
    struct Restore {
      at::RecordFunctionTLS executors;
      ~Restore() { at::set_record_function_tls_(executors); }
    } restore{at::get_record_function_tls_()};
    at::set_record_function_tls_(callbacks_);
    c10::DebugInfoGuard with_profiler(debug_info_);
    job();
  }

 private:
  at::RecordFunctionTLS callbacks_;
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info_;
};

// Releases the GIL (when this thread holds it) while blocking on the executor, so the
// executor and other Python threads never wait for a thread that waits for them; a thread
// other than the finalizing one that would take it back after interpreter shutdown began is
// parked instead of ended (docs/architecture.md, "Waiting, and the GIL at shutdown", says
// why). Methods called from Python run without the GIL already; this covers the calls made
// with it held, such as a Work freed by the garbage collector.
class WithoutGil {
 public:
  WithoutGil() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      // A thread that holds the GIL after shutdown began is the finalizing thread itself,
      // which may always take it back.
      finalizing_thread_ = interpreter_finalizing();
      state_ = PyEval_SaveThread();
    }
  }
  ~WithoutGil() {
    if (state_ == nullptr) return;
    if (!finalizing_thread_ && interpreter_finalizing()) park_forever();
    PyEval_RestoreThread(state_);
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  [[noreturn]] static void park_forever() {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }

  PyThreadState* state_ = nullptr;
  bool finalizing_thread_ = false;
};

// The completion signal of a CPU collective about to be queued (a torch error when the process
// has no descriptor left).
std::shared_ptr<CompletionSignal> new_completion_signal() {
  return rethrow_as_torch_error([] { return std::make_shared<CompletionSignal>(); });
}

// Blocks until `done` is ready, without the GIL only when it has to wait: a collective that
// already completed returns without giving up and retaking the GIL.
void wait_for(const std::shared_future<void>& done) {
  if (done.wait_for(std::chrono::seconds(0)) == std::future_status::ready) return;
  WithoutGil unlocked;
  done.wait();
}

// A tensor's memory as the executor thread sees it. Jobs never hold at::Tensor handles:
// changing a tensor's reference count off the Python thread can need the GIL. The Work
// keeps the tensors alive instead.
template <class T>
struct Span {
  T* data;
  size_t len;

  explicit Span(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())), len(static_cast<size_t>(t.numel())) {}
  rust::Slice<const T> in() const { return {data, len}; }
  rust::Slice<T> out() const { return {data, len}; }
};

template <class T>
rust::Slice<const T> const_slice(const at::Tensor& t) {
  return {static_cast<const T*>(t.data_ptr()), static_cast<size_t>(t.numel())};
}

template <class T>
rust::Slice<T> mut_slice(at::Tensor& t) {
  return {static_cast<T*>(t.data_ptr()), static_cast<size_t>(t.numel())};
}

std::vector<int64_t> wire_pair(const ffi::WireBytes& bytes) {
  return {static_cast<int64_t>(bytes.intra_node), static_cast<int64_t>(bytes.inter_node)};
}

c10::intrusive_ptr<c10d::ProcessGroup> resolve_optional(const std::string& name) {
  if (name.empty()) return {};
  return c10d::resolve_process_group(name);
}

}  // namespace

// The process groups of one DP group, the thread their CPU collectives run on and the side
// streams their CUDA collectives are enqueued on (one per device and collective kind).
class ProcessGroups : public torch::CustomClassHolder {
 public:
  ProcessGroups(const std::string& world, const std::string& intra, const std::string& inter) {
    TORCH_CHECK(!world.empty(), "sdp4bit: the world process group name is empty");
    auto groups = std::make_unique<ffi::TorchComms::Groups>();
    rethrow_as_torch_error([&] {
      groups->world = c10d::resolve_process_group(world);
      groups->intra = resolve_optional(intra);
      groups->inter = resolve_optional(inter);
    });
    nccl_ = groups->world->getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
    comms_ = std::make_unique<ffi::TorchComms>(std::move(groups));
    rank_ = static_cast<int64_t>(comms_->rank(ffi::CommLevel::World));
    size_ = static_cast<int64_t>(comms_->size(ffi::CommLevel::World));
  }

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }

  // The groups' comms; only jobs on the executor and CUDA collectives being enqueued (under
  // issue_mutex_) use them, and none runs after close().
  const ffi::TorchComms& comms() const { return *comms_; }

  // Runs every collective already queued, stops the executor thread and releases the c10d
  // groups. Call it before torch.distributed.destroy_process_group(); collectives started
  // afterwards raise. Idempotent.
  void close() {
    {
      WithoutGil unlocked;
      executor_.shutdown();
    }
    std::lock_guard<std::mutex> lock(issue_mutex_);
    comms_.reset();
  }

  // The side stream of `collective` ("reduce_scatter" or "all_gather") on CUDA device
  // `device_index` as torch.cuda.Stream's constructor takes it:
  // [stream_id, device_index, device_type].
  std::vector<int64_t> side_stream_ids(int64_t device_index, const std::string& collective) {
    TORCH_CHECK(device_index >= 0, "sdp4bit: CUDA device index ", device_index, " is negative");
    TORCH_CHECK(collective == "reduce_scatter" || collective == "all_gather",
                "sdp4bit: no side stream for collective '", collective,
                "' (reduce_scatter or all_gather)");
    c10::Stream stream = side_stream(
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index)),
        collective == "reduce_scatter" ? CollectiveKind::ReduceScatter : CollectiveKind::AllGather);
    c10::StreamData3 ids = stream.pack3();
    return {ids.stream_id, ids.device_index, static_cast<int64_t>(ids.device_type)};
  }

  // The side stream of the collectives of `kind` on `device` (stream_order.h's SideStreams):
  // made the first time, then the same one for every collective of that kind of these groups.
  // Not from torch's stream pools: those hand the same 32 streams per device and priority out
  // round-robin to every caller, ProcessGroupNCCL's communicators among them
  // (ProcessGroupNCCL.cpp, initNCCLComm: getStreamFromPool(is_high_priority_stream)), so a
  // pool stream could be an NCCL stream and the two works would serialise. A stream of
  // sdp4bit's own (cuda_new_side_stream: non-blocking, the device's greatest priority as FSDP2
  // gives its collective streams, never destroyed), which torch takes as an external stream:
  // its id is the raw handle (c10/cuda/CUDAStream.cpp, streamIdType: EXT).
  c10::Stream side_stream(c10::Device device, CollectiveKind kind) {
    std::lock_guard<std::mutex> lock(side_streams_mutex_);
    return rethrow_as_torch_error([&] {
      return side_streams_.get(device.index(), kind, [&] {
        uint64_t raw = ffi::cuda_new_side_stream(static_cast<size_t>(device.index()));
        return c10::Stream(c10::Stream::UNSAFE, device, static_cast<c10::StreamId>(raw));
      });
    });
  }

  // Why a bucket on `device` cannot join these groups, or "": CPU collectives run on the
  // executor thread and CUDA ones on the caller's, so one set of groups serves one kind, or
  // the two kinds' c10d calls could reach the groups in a different order on each rank.
  std::string kind_problem(c10::Device device) {
    std::lock_guard<std::mutex> lock(side_streams_mutex_);
    if (!kind_ || kind_->is_cuda() == device.is_cuda()) return "";
    return "these process groups already serve buckets on " + kind_->str() +
           "; a bucket on " + device.str() +
           " needs its own sdp4bit.ProcessGroups (CPU and CUDA buckets cannot share them)";
  }

  // Records that these groups serve buckets of `device`'s kind (after a bucket's set-up).
  void serve(c10::Device device) {
    std::lock_guard<std::mutex> lock(side_streams_mutex_);
    if (!kind_) kind_ = device.is_cuda() ? c10::Device(c10::DeviceType::CUDA) : device;
  }

  // Enqueues `collective` on the side stream `side` (one of side_stream()'s) on the calling
  // thread, in the order of stream_order.h, with `tensors` recorded on it.
  template <class F>
  DeviceCompletion enqueue_on_side_stream(const c10::Stream& side,
                                          const std::vector<at::Tensor>& tensors,
                                          F&& collective) {
    std::lock_guard<std::mutex> lock(issue_mutex_);
    TORCH_CHECK(comms_, "sdp4bit: these process groups were closed (ProcessGroups.close())");
    return rethrow_as_torch_error([&] {
      return sdp4bit::enqueue_on_side_stream(TorchStreams(side.device()), side, tensors,
                                             std::forward<F>(collective));
    });
  }

  // The CUDA device current on the executor while it runs the jobs of a bucket on `device`
  // (its set-up agreement, a CPU bucket's collectives), whatever device was current when
  // these groups were made: a CUDA bucket's own device when this rank can use it (`usable`);
  // else, for an NCCL group, whose host exchanges are staged through a device (torch_comms.cpp:
  // host_staging), the caller's current one now, as a bare "cuda" is read at set-up; none for
  // other groups.
  std::optional<c10::Device> executor_device(c10::Device device, bool usable) const {
    if (device.is_cuda() && usable) return device;
    if (nccl_) return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice();
    return std::nullopt;
  }

  // Runs `job` on the executor after everything queued before it, with `device` current there
  // (executor_device), and waits for it.
  void run_in_order(std::optional<c10::Device> device, std::function<void()> job) {
    auto done = submit(device, std::move(job));
    wait_for(done);
    rethrow_as_torch_error([&] { done.get(); });
  }

  // Queues `job` on the executor, to run with `device` current there (executor_device) and
  // the submitting thread's profiler state (SubmittersProfiler); `signal`, when given, is
  // notified once it has run.
  std::shared_future<void> submit(std::optional<c10::Device> device, std::function<void()> job,
                                  std::shared_ptr<CompletionSignal> signal = nullptr) {
    return rethrow_as_torch_error([&] {
      return executor_.submit(
          [device, job = std::move(job), profiler = SubmittersProfiler()] {
            c10::OptionalDeviceGuard on_device(device);
            profiler.run(job);
          },
          std::move(signal));
    });
  }

 private:
  std::unique_ptr<ffi::TorchComms> comms_;
  int64_t rank_ = 0;
  int64_t size_ = 0;
  bool nccl_ = false;  // the world group is NCCL's
  std::mutex issue_mutex_;  // CUDA collectives being enqueued, and close()
  std::mutex side_streams_mutex_;
  SideStreams<c10::Stream> side_streams_;
  std::optional<c10::Device> kind_;  // CPU, or CUDA (any index): the buckets' kind
  Executor executor_;  // declared last: joined before the groups are released
};

// The cudaStream_t of `side` as Python read it (torch.cuda.Stream(...).cuda_stream): the
// extension is built without CUDA headers, and c10::Stream has a native handle only from
// torch 2.10 on, where the two are checked to be the same stream.
uint64_t checked_side_stream_handle(const c10::Stream& side, int64_t handle) {
  TORCH_CHECK(handle > 0, "sdp4bit: CUDA side stream handle ", handle, " is not a stream");
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  auto native = reinterpret_cast<uint64_t>(side.native_handle());
  TORCH_CHECK(native == static_cast<uint64_t>(handle), "sdp4bit: stream handle ", handle,
              " is not the groups' side stream on ", side.device().str(), " (", native, ")");
#else
  (void)side;
#endif
  return static_cast<uint64_t>(handle);
}

// A collective in flight, with c10d's Work semantics (torch/csrc/distributed/c10d/Work.hpp).
// A CPU collective: wait() blocks until the executor has run it and rethrows its error;
// completion_fd() becomes readable once it has run (is_completed() is then true), and stays
// open while the Work lives; the Work keeps its tensors and the collective object alive and
// waits for the collective if it is dropped before completing, so nothing it uses is freed
// under the executor thread.
// A CUDA collective (already enqueued, its errors raised by start()): wait() makes the current
// stream of the bucket's device wait for its done event and returns at once; is_completed()
// queries the event; the tensors are protected by record_stream, the collective object (whose
// buffers the side stream uses) is kept alive.
class Work : public torch::CustomClassHolder {
 public:
  Work(std::shared_future<void> done, std::shared_ptr<CompletionSignal> signal,
       std::vector<at::Tensor> keep_alive, c10::intrusive_ptr<torch::CustomClassHolder> owner)
      : done_(std::move(done)),
        signal_(std::move(signal)),
        keep_alive_(std::move(keep_alive)),
        owner_(std::move(owner)) {}

  Work(DeviceCompletion completion, c10::intrusive_ptr<torch::CustomClassHolder> owner)
      : completion_(std::move(completion)), owner_(std::move(owner)) {}

  ~Work() override {
    if (done_.valid()) wait_for(done_);
  }

  void wait() {
    if (completion_) {
      completion_->wait_on_current_stream();
      return;
    }
    wait_for(done_);
    rethrow_as_torch_error([&] { done_.get(); });
  }

  bool is_completed() {
    if (completion_) return completion_->is_completed();
    return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

  // A CPU collective's completion descriptor: readable once the executor has run it. Only a
  // CPU collective blocks in wait(), so a CUDA one has none.
  int64_t completion_fd() {
    TORCH_CHECK(signal_, "sdp4bit: a CUDA collective has no completion descriptor (its wait() "
                "orders the current stream and returns at once)");
    return signal_->fd();
  }

 private:
  std::shared_future<void> done_;                 // CPU collectives
  std::shared_ptr<CompletionSignal> signal_;      // CPU collectives
  std::optional<DeviceCompletion> completion_;    // CUDA collectives
  std::vector<at::Tensor> keep_alive_;
  c10::intrusive_ptr<torch::CustomClassHolder> owner_;
};

// The gradient reduce-scatter of one fp32 or bf16 bucket, on the CPU or on one CUDA device.
class GradReduceScatter : public torch::CustomClassHolder {
 public:
  // `side_stream_handle`: for a CUDA bucket, the cudaStream_t of the groups' reduce-scatter
  // side stream of its device, on which the set-up enqueues its uploads (ignored on the CPU).
  GradReduceScatter(c10::intrusive_ptr<ProcessGroups> groups, const std::string& config,
                    const std::vector<int64_t>& node_labels, int64_t numel, int64_t bucket_id,
                    const std::string& device, int64_t side_stream_handle)
      : groups_(std::move(groups)), numel_(numel), bucket_id_(checked_bucket_id(bucket_id)) {
    TORCH_CHECK(numel > 0, "sdp4bit: bucket size ", numel, " must be positive");
    auto labels = checked_labels(node_labels);
    // A device this rank cannot use fails the set-up on every rank, not just here.
    std::string problem;
    device_ = resolve_device(device, problem);
    if (problem.empty()) problem = groups_->kind_problem(device_);
    if (problem.empty()) problem = device_problem(device_);
    executor_device_ = groups_->executor_device(device_, problem.empty());
    // Parsed once, for the kernel check, the agreement and the plan.
    auto parsed = ffi::parse_config(config);
    if (problem.empty()) {
      problem = kernel_check_problem(device_, *parsed, labels, groups_->rank(), false);
    }
    groups_->run_in_order(executor_device_, [&] {
      ffi::agree_on_setup(groups_->comms(), *parsed, problem, bucket_id_,
                          static_cast<size_t>(numel));
    });
    bucket_ = rethrow_as_torch_error([&] {
      rust::Slice<const uint64_t> nodes(labels.data(), labels.size());
      auto rank = static_cast<size_t>(groups_->rank());
      if (device_.is_cuda()) {
        // The buffers come from torch's caching allocator for the side stream, which alone
        // uses them, and the tables are uploaded on it: memory the allocator took back from
        // an earlier collective on the side stream is written only after that collective
        // (stream_order.h).
        c10::Stream side = groups_->side_stream(device_, kKind);
        uint64_t raw = checked_side_stream_handle(side, side_stream_handle);
        c10::StreamGuard on_side(side);
        return ffi::new_cuda_grad_bucket(*parsed, nodes, rank, static_cast<size_t>(numel),
                                         bucket_id_, static_cast<size_t>(device_.index()), raw);
      }
      return ffi::new_grad_bucket(*parsed, nodes, rank, static_cast<size_t>(numel), bucket_id_);
    });
    shard_len_ = static_cast<int64_t>((*bucket_)->shard_len());
    groups_->serve(device_);
  }

  int64_t shard_len() const { return shard_len_; }

  std::string device() const { return device_.str(); }

  bool quantizes_at(int64_t step) {
    std::lock_guard<std::mutex> lock(mutex_);
    return (*bucket_)->quantizes_at(checked_step(step));
  }

  std::vector<int64_t> wire_bytes(int64_t step) {
    std::lock_guard<std::mutex> lock(mutex_);
    return wire_pair((*bucket_)->wire_bytes(checked_step(step)));
  }

  std::vector<int64_t> baseline_wire_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return wire_pair((*bucket_)->baseline_wire_bytes());
  }

  std::string notice() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::string((*bucket_)->notice());
  }

  // Global-QSGD's integer-sum overflows of a CUDA bucket, which Python agrees on across the
  // ranks before any raises (collectives.py, _IntegerSumAgreement; docs/cuda.md): whether the
  // bucket reads its status back after each step; the status word the copy after an earlier
  // step read, once it has landed (an event query, never a wait; 0 until then or without an
  // overflow); and the error DP rank `rank` raises for its word `status` ("" for none).
  bool reads_back_integer_sums() {
    std::lock_guard<std::mutex> lock(mutex_);
    return (*bucket_)->reads_back_integer_sums();
  }

  int64_t take_integer_sum_status() {
    std::lock_guard<std::mutex> lock(mutex_);
    return rethrow_as_torch_error([&] { return (*bucket_)->take_integer_sum_status(); });
  }

  std::string integer_sum_error(int64_t rank, int64_t status) {
    TORCH_CHECK(rank >= 0 && rank < groups_->size(), "sdp4bit: rank ", rank, " outside the ",
                groups_->size(), "-rank DP group");
    TORCH_CHECK(status >= 0 && status <= UINT32_MAX, "sdp4bit: status word ", status,
                " is not a u32");
    std::lock_guard<std::mutex> lock(mutex_);
    return std::string((*bucket_)->integer_sum_error(static_cast<size_t>(rank),
                                                     static_cast<uint32_t>(status)));
  }

  // `side_stream_handle`: for a CUDA bucket, the cudaStream_t of the groups' reduce-scatter
  // side stream of the bucket's device (ignored on the CPU).
  c10::intrusive_ptr<Work> start(at::Tensor bucket, at::Tensor shard, int64_t step,
                                 int64_t side_stream_handle) {
    at::ScalarType dtype = gradient_dtype(bucket, shard);
    check_tensor("gradient bucket", bucket, dtype, numel_, device_);
    check_tensor("gradient shard", shard, dtype, shard_len_, device_);
    uint64_t at_step = checked_step(step);
    if (dtype == at::kBFloat16) {
      return start_with<uint16_t>(bucket, shard, at_step, side_stream_handle);
    }
    return start_with<float>(bucket, shard, at_step, side_stream_handle);
  }

 private:
  // start() of checked tensors of T (float, or uint16_t for bf16 bit patterns).
  template <class T>
  c10::intrusive_ptr<Work> start_with(at::Tensor bucket, at::Tensor shard, uint64_t at_step,
                                      int64_t side_stream_handle) {
    Span<T> in(bucket), out(shard);
    auto owner = c10::intrusive_ptr<GradReduceScatter>::reclaim_copy(this);
    if (device_.is_cuda()) {
      c10::Stream side = groups_->side_stream(device_, kKind);
      uint64_t raw = checked_side_stream_handle(side, side_stream_handle);
      std::lock_guard<std::mutex> lock(mutex_);
      DeviceCompletion done = groups_->enqueue_on_side_stream(
          side, {bucket, shard}, [&] { run_cuda(in, out, bucket.scalar_type(), raw, at_step); });
      return c10::make_intrusive<Work>(std::move(done), std::move(owner));
    }
    auto signal = new_completion_signal();
    std::shared_future<void> done =
        groups_->submit(executor_device_, [this, in, out, at_step] { run(in, out, at_step); },
                        signal);
    return c10::make_intrusive<Work>(std::move(done), std::move(signal),
                                     std::vector<at::Tensor>{bucket, shard}, std::move(owner));
  }

  // The core reads the bucket while it writes the shard: when the shard is a view into the
  // bucket (Megatron's layout), it writes a scratch shard that is copied over (kept by a CPU
  // bucket; taken per call by a CUDA bucket).
  template <class T>
  static bool aliased(Span<T> bucket, Span<T> shard) {
    const T* b = bucket.data;
    return b < shard.data + shard.len && shard.data < b + bucket.len;
  }

  template <class T>
  void run(Span<T> bucket, Span<T> shard, uint64_t step) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!aliased(bucket, shard)) {
      run_host(bucket.in(), shard.out(), step);
      return;
    }
    std::vector<T>& scratch = scratch_of<T>();
    scratch.resize(shard.len);
    run_host(bucket.in(), rust::Slice<T>(scratch.data(), shard.len), step);
    std::memcpy(shard.data, scratch.data(), shard.len * sizeof(T));
  }

  // The core's host reduce-scatter of fp32, or of bf16 bit patterns.
  void run_host(rust::Slice<const float> bucket, rust::Slice<float> shard, uint64_t step) {
    (*bucket_)->run(groups_->comms(), bucket, shard, step);
  }

  void run_host(rust::Slice<const uint16_t> bucket, rust::Slice<uint16_t> shard, uint64_t step) {
    (*bucket_)->run_bf16(groups_->comms(), bucket, shard, step);
  }

  template <class T>
  std::vector<T>& scratch_of() {
    if constexpr (std::is_same_v<T, float>) {
      return scratch_;
    } else {
      return scratch_bf16_;
    }
  }

  // Enqueues the collective on the current stream (the side stream, whose handle is `raw`);
  // the caller holds mutex_.
  template <class T>
  void run_cuda(Span<T> bucket, Span<T> shard, at::ScalarType dtype, uint64_t raw, uint64_t step) {
    bool bf16 = dtype == at::kBFloat16;
    if (!aliased(bucket, shard)) {
      (*bucket_)->run_cuda(groups_->comms(), device_address(bucket.data),
                           device_address(shard.data), bf16, raw, step);
      return;
    }
    // Taken with the side stream current and given back when this call has enqueued the copy:
    // the caching allocator hands the block only to later allocations on the side stream, so
    // the next call reuses it after this one (as the core's call buffers).
    at::Tensor scratch =
        at::empty({shard_len_}, at::TensorOptions().dtype(dtype).device(device_));
    (*bucket_)->run_cuda(groups_->comms(), device_address(bucket.data),
                         device_address(scratch.data_ptr()), bf16, raw, step);
    at::from_blob(shard.data, {shard_len_}, scratch.options()).copy_(scratch);
  }

  static constexpr CollectiveKind kKind = CollectiveKind::ReduceScatter;

  c10::intrusive_ptr<ProcessGroups> groups_;
  int64_t numel_;
  uint32_t bucket_id_;
  c10::Device device_ = c10::Device(at::kCPU);
  std::optional<c10::Device> executor_device_;  // ProcessGroups::executor_device
  int64_t shard_len_ = 0;
  std::optional<rust::Box<ffi::GradBucket>> bucket_;
  std::vector<float> scratch_;  // CPU buckets: the scratch shard, never seen by Python
  std::vector<uint16_t> scratch_bf16_;  // the same for bf16 buckets
  std::mutex mutex_;
};

// The parameter all-gather of one bf16 bucket, on the CPU or on the params' CUDA device.
class WeightAllGather : public torch::CustomClassHolder {
 public:
  // `side_stream_handle`: for CUDA params, the cudaStream_t of the groups' all-gather side
  // stream of their device (the first qWD reference is copied on it); ignored on the CPU.
  WeightAllGather(c10::intrusive_ptr<ProcessGroups> groups, const std::string& config,
                  const std::vector<int64_t>& node_labels, at::Tensor params, int64_t bucket_id,
                  int64_t side_stream_handle)
      : groups_(std::move(groups)),
        bucket_id_(checked_bucket_id(bucket_id)),
        device_(params.defined() ? params.device() : c10::Device(at::kCPU)) {
    numel_ = params.defined() ? params.numel() : 0;
    std::string problem;
    if (!device_.is_cpu() && !device_.is_cuda()) {
      problem = "param bucket is on " + device_.str() + "; buckets live on CPU or CUDA";
    } else {
      problem = tensor_problem("param bucket", params, at::kBFloat16, numel_, device_);
    }
    if (problem.empty() && numel_ <= 0) problem = "param bucket is empty";
    if (problem.empty()) problem = groups_->kind_problem(device_);
    if (problem.empty()) problem = device_problem(device_);
    executor_device_ = groups_->executor_device(device_, problem.empty());
    auto labels = checked_labels(node_labels);
    // Parsed once, for the kernel check, the agreement and the plan.
    auto parsed = ffi::parse_config(config);
    if (problem.empty()) {
      problem = kernel_check_problem(device_, *parsed, labels, groups_->rank(), true);
    }
    groups_->run_in_order(executor_device_, [&] {
      ffi::agree_on_setup(groups_->comms(), *parsed, problem, bucket_id_,
                          static_cast<size_t>(numel_));
    });
    rust::Slice<const uint64_t> nodes(labels.data(), labels.size());
    auto rank = static_cast<size_t>(groups_->rank());
    if (device_.is_cuda()) {
      // The first qWD reference is copied on the side stream after whatever wrote `params` on
      // the caller's stream, and the caller's stream waits for the copy before it may write
      // `params` again.
      c10::Stream side = groups_->side_stream(device_, kKind);
      uint64_t raw = checked_side_stream_handle(side, side_stream_handle);
      groups_
          ->enqueue_on_side_stream(side, {params}, [&] {
            bucket_ = ffi::new_cuda_weight_bucket(
                *parsed, nodes, rank, bucket_id_, static_cast<size_t>(device_.index()),
                device_address(params.data_ptr()), static_cast<size_t>(numel_), raw);
          })
          .wait_on_current_stream();
    } else {
      bucket_ = rethrow_as_torch_error([&] {
        return ffi::new_weight_bucket(*parsed, nodes, rank, bucket_id_,
                                      const_slice<uint16_t>(params));
      });
    }
    shard_len_ = static_cast<int64_t>((*bucket_)->shard_len());
    groups_->serve(device_);
  }

  int64_t shard_len() const { return shard_len_; }

  std::vector<int64_t> wire_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return wire_pair((*bucket_)->wire_bytes());
  }

  std::vector<int64_t> baseline_wire_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return wire_pair((*bucket_)->baseline_wire_bytes());
  }

  // `side_stream_handle`: for CUDA params, the cudaStream_t of the groups' all-gather side
  // stream of their device (ignored on the CPU).
  c10::intrusive_ptr<Work> start(at::Tensor params, int64_t step, int64_t side_stream_handle) {
    check_tensor("param bucket", params, at::kBFloat16, numel_, device_);
    uint64_t at_step = checked_step(step);
    Span<uint16_t> bits(params);
    auto owner = c10::intrusive_ptr<WeightAllGather>::reclaim_copy(this);
    if (device_.is_cuda()) {
      c10::Stream side = groups_->side_stream(device_, kKind);
      uint64_t raw = checked_side_stream_handle(side, side_stream_handle);
      std::lock_guard<std::mutex> lock(mutex_);
      DeviceCompletion done = groups_->enqueue_on_side_stream(side, {params}, [&] {
        (*bucket_)->run_cuda(groups_->comms(), device_address(bits.data), raw, at_step);
      });
      return c10::make_intrusive<Work>(std::move(done), std::move(owner));
    }
    auto signal = new_completion_signal();
    std::shared_future<void> done = groups_->submit(
        executor_device_,
        [this, bits, at_step] {
          std::lock_guard<std::mutex> lock(mutex_);
          (*bucket_)->run(groups_->comms(), bits.out(), at_step);
        },
        signal);
    return c10::make_intrusive<Work>(std::move(done), std::move(signal),
                                     std::vector<at::Tensor>{params}, std::move(owner));
  }

 private:
  static constexpr CollectiveKind kKind = CollectiveKind::AllGather;

  c10::intrusive_ptr<ProcessGroups> groups_;
  uint32_t bucket_id_;
  c10::Device device_;
  std::optional<c10::Device> executor_device_;  // ProcessGroups::executor_device
  int64_t numel_ = 0;
  int64_t shard_len_ = 0;
  std::optional<rust::Box<ffi::WeightBucket>> bucket_;
  std::mutex mutex_;
};

// The Global-QSGD all-reduce of one fp32 or bf16 buffer across the groups of hybrid sharding
// (docs/numerics.md §7.6), over `groups`, the process groups of the ranks that hold the same
// shard in every group, on the CPU or on one CUDA device.
class CrossGroupAllReduce : public torch::CustomClassHolder {
 public:
  // `stream_rank`: this rank's index in the whole DP world (its random streams');
  // `side_stream_handle`: for a CUDA buffer, the cudaStream_t of the groups' reduce-scatter
  // side stream of its device (ignored on the CPU).
  CrossGroupAllReduce(c10::intrusive_ptr<ProcessGroups> groups, const std::string& config,
                      int64_t numel, int64_t bucket_id, int64_t stream_rank,
                      const std::string& device, int64_t side_stream_handle)
      : groups_(std::move(groups)), numel_(numel), bucket_id_(checked_bucket_id(bucket_id)) {
    TORCH_CHECK(numel > 0, "sdp4bit: cross-group buffer size ", numel, " must be positive");
    TORCH_CHECK(stream_rank >= 0, "sdp4bit: stream rank ", stream_rank, " is negative");
    std::string problem;
    device_ = resolve_device(device, problem);
    if (problem.empty()) problem = groups_->kind_problem(device_);
    if (problem.empty()) problem = device_problem(device_);
    executor_device_ = groups_->executor_device(device_, problem.empty());
    auto parsed = ffi::parse_config(config);
    groups_->run_in_order(executor_device_, [&] {
      ffi::agree_on_setup(groups_->comms(), *parsed, problem, bucket_id_,
                          static_cast<size_t>(numel));
    });
    bucket_ = rethrow_as_torch_error([&] {
      auto size = static_cast<size_t>(groups_->size());
      auto rank = static_cast<size_t>(groups_->rank());
      auto numel_z = static_cast<size_t>(numel);
      auto streams = static_cast<size_t>(stream_rank);
      if (device_.is_cuda()) {
        c10::Stream side = groups_->side_stream(device_, kKind);
        uint64_t raw = checked_side_stream_handle(side, side_stream_handle);
        c10::StreamGuard on_side(side);
        return ffi::new_cuda_cross_group_bucket(*parsed, size, rank, numel_z, bucket_id_,
                                                streams, static_cast<size_t>(device_.index()),
                                                raw);
      }
      return ffi::new_cross_group_bucket(*parsed, size, rank, numel_z, bucket_id_, streams);
    });
    groups_->serve(device_);
  }

  std::string device() const { return device_.str(); }

  int64_t wire_bytes() { return static_cast<int64_t>((*bucket_)->wire_bytes()); }

  int64_t baseline_wire_bytes() {
    return static_cast<int64_t>((*bucket_)->baseline_wire_bytes());
  }

  // All-reduces `data` in place for optimizer step `step`; ordered as
  // GradReduceScatter::start is (a CUDA buffer on the side stream after the current stream's
  // work; a CPU buffer on the executor).
  c10::intrusive_ptr<Work> start(at::Tensor data, int64_t step, int64_t side_stream_handle) {
    TORCH_CHECK(data.scalar_type() == at::kFloat || data.scalar_type() == at::kBFloat16,
                "sdp4bit: the cross-group buffer must be torch.float32 or torch.bfloat16, got ",
                data.scalar_type());
    check_tensor("cross-group buffer", data, data.scalar_type(), numel_, device_);
    uint64_t at_step = checked_step(step);
    bool bf16 = data.scalar_type() == at::kBFloat16;
    auto owner = c10::intrusive_ptr<CrossGroupAllReduce>::reclaim_copy(this);
    if (device_.is_cuda()) {
      c10::Stream side = groups_->side_stream(device_, kKind);
      uint64_t raw = checked_side_stream_handle(side, side_stream_handle);
      std::lock_guard<std::mutex> lock(mutex_);
      DeviceCompletion done = groups_->enqueue_on_side_stream(side, {data}, [&] {
        (*bucket_)->run_cuda(groups_->comms(), device_address(data.data_ptr()), bf16, raw,
                             at_step);
      });
      return c10::make_intrusive<Work>(std::move(done), std::move(owner));
    }
    auto signal = new_completion_signal();
    std::shared_future<void> done =
        bf16 ? submit_host(Span<uint16_t>(data), at_step, signal)
             : submit_host(Span<float>(data), at_step, signal);
    return c10::make_intrusive<Work>(std::move(done), std::move(signal),
                                     std::vector<at::Tensor>{data}, std::move(owner));
  }

 private:
  // Queues the host all-reduce of `data` (fp32, or bf16 bit patterns) on the executor.
  template <class T>
  std::shared_future<void> submit_host(Span<T> data, uint64_t at_step,
                                       const std::shared_ptr<CompletionSignal>& signal) {
    return groups_->submit(
        executor_device_,
        [this, data, at_step] {
          std::lock_guard<std::mutex> lock(mutex_);
          run_host(data.out(), at_step);
        },
        signal);
  }

  void run_host(rust::Slice<float> data, uint64_t step) {
    (*bucket_)->run(groups_->comms(), data, step);
  }

  void run_host(rust::Slice<uint16_t> data, uint64_t step) {
    (*bucket_)->run_bf16(groups_->comms(), data, step);
  }

  static constexpr CollectiveKind kKind = CollectiveKind::ReduceScatter;

  c10::intrusive_ptr<ProcessGroups> groups_;
  int64_t numel_;
  uint32_t bucket_id_;
  c10::Device device_ = c10::Device(at::kCPU);
  std::optional<c10::Device> executor_device_;  // ProcessGroups::executor_device
  std::optional<rust::Box<ffi::CrossGroupBucket>> bucket_;
  std::mutex mutex_;
};

namespace {

// `config` parsed, or a torch error saying why it is invalid.
rust::Box<ffi::ParsedConfig> parse(const std::string& config) {
  auto parsed = ffi::parse_config(config);
  rethrow_as_torch_error([&] { parsed->check(); });
  return parsed;
}

// The config as the Python `Config` caches it (JSON; ParsedConfig::record_json).
std::string resolve_config(const std::string& config) {
  auto parsed = ffi::parse_config(config);
  return std::string(rethrow_as_torch_error([&] { return parsed->record_json(); }));
}

std::string schema() { return std::string(ffi::schema_json()); }

// One line on CUDA device `device`: architecture, driver, NVRTC, and the image its kernels
// loaded as (CUBIN or PTX) and why; or why it cannot run them.
std::string cuda_device_report(int64_t device) {
  TORCH_CHECK(device >= 0, "sdp4bit: CUDA device index ", device, " is negative");
  return std::string(ffi::cuda_device_report(static_cast<size_t>(device)));
}

// The NVRTC the CUDA kernels compile with (version and path), or why none loads.
std::string nvrtc_report() { return std::string(ffi::nvrtc_report()); }

// Runs every kernel of both collectives for `config`, the DP group of `node_labels` and
// `rank` on CUDA device `device` and on the host, and fails naming the first kernel whose
// bytes differ (the check a CUDA bucket runs at its first set-up).
void cuda_kernel_check(int64_t device, const std::string& config,
                       const std::vector<int64_t>& node_labels, int64_t rank) {
  TORCH_CHECK(device >= 0, "sdp4bit: CUDA device index ", device, " is negative");
  TORCH_CHECK(rank >= 0 && rank < static_cast<int64_t>(node_labels.size()), "sdp4bit: rank ",
              rank, " outside the ", node_labels.size(), "-rank DP group");
  auto parsed = parse(config);
  auto labels = checked_labels(node_labels);
  rethrow_as_torch_error([&] {
    ffi::cuda_kernel_check(static_cast<size_t>(device), *parsed,
                           rust::Slice<const uint64_t>(labels.data(), labels.size()),
                           static_cast<size_t>(rank));
  });
}

#ifdef SDP4BIT_TEST_OPS
// The tests' in-process references (cargo feature test-ops).
at::Tensor simulate_grad_reduce_scatter(const std::string& config,
                                        const std::vector<int64_t>& node_labels,
                                        int64_t bucket_id, int64_t step,
                                        const at::Tensor& inputs) {
  auto parsed = parse(config);
  auto labels = checked_labels(node_labels);
  TORCH_CHECK(inputs.dim() == 2 && inputs.size(0) == static_cast<int64_t>(labels.size()),
              "sdp4bit: inputs must be [world, numel] with world = ", labels.size(),
              " node labels, got ", inputs.sizes());
  at::Tensor in = inputs.contiguous();
  check_tensor("inputs", in, at::kFloat, in.numel(), c10::Device(at::kCPU));
  at::Tensor out = at::empty({inputs.size(0), inputs.size(1) / inputs.size(0)}, in.options());
  rethrow_as_torch_error([&] {
    ffi::simulate_grad_reduce_scatter(*parsed, rust::Slice<const uint64_t>(labels.data(), labels.size()),
                                      checked_bucket_id(bucket_id), checked_step(step),
                                      const_slice<float>(in), mut_slice<float>(out));
  });
  return out;
}

at::Tensor simulate_cross_group_all_reduce(const std::string& config, int64_t bucket_id,
                                           int64_t step, const std::vector<int64_t>& stream_ranks,
                                           const at::Tensor& inputs) {
  auto parsed = parse(config);
  TORCH_CHECK(inputs.dim() == 2 && inputs.size(0) == static_cast<int64_t>(stream_ranks.size()),
              "sdp4bit: inputs must be [ranks, numel] with one row per stream rank, got ",
              inputs.sizes());
  std::vector<uint64_t> ranks;
  for (int64_t r : stream_ranks) {
    TORCH_CHECK(r >= 0, "sdp4bit: stream rank ", r, " is negative");
    ranks.push_back(static_cast<uint64_t>(r));
  }
  at::Tensor out = inputs.contiguous().clone();
  check_tensor("inputs", out, at::kFloat, out.numel(), c10::Device(at::kCPU));
  rethrow_as_torch_error([&] {
    ffi::simulate_cross_group_all_reduce(*parsed, checked_bucket_id(bucket_id), checked_step(step),
                                         rust::Slice<const uint64_t>(ranks.data(), ranks.size()),
                                         mut_slice<float>(out));
  });
  return out;
}

at::Tensor simulate_weight_all_gather(const std::string& config,
                                      const std::vector<int64_t>& node_labels, int64_t bucket_id,
                                      int64_t first_step, const at::Tensor& initial,
                                      const at::Tensor& targets) {
  auto parsed = parse(config);
  auto labels = checked_labels(node_labels);
  at::Tensor init = initial.contiguous();
  at::Tensor tgt = targets.contiguous();
  check_tensor("initial", init, at::kBFloat16, init.numel(), c10::Device(at::kCPU));
  check_tensor("targets", tgt, at::kBFloat16, tgt.numel(), c10::Device(at::kCPU));
  TORCH_CHECK(tgt.dim() == 2 && tgt.size(1) == init.numel(),
              "sdp4bit: targets must be [steps, numel], got ", tgt.sizes());
  int64_t world = static_cast<int64_t>(labels.size());
  at::Tensor out = at::empty({tgt.size(0), world, init.numel()}, init.options());
  rethrow_as_torch_error([&] {
    ffi::simulate_weight_all_gather(*parsed, rust::Slice<const uint64_t>(labels.data(), labels.size()),
                                    checked_bucket_id(bucket_id), checked_step(first_step),
                                    const_slice<uint16_t>(init), const_slice<uint16_t>(tgt),
                                    mut_slice<uint16_t>(out));
  });
  return out;
}

#endif  // SDP4BIT_TEST_OPS

// Bytes rank 0 of `node_labels` sends per call for one bucket of `numel` elements, planned
// without communicating: [gradient intra, inter, weight intra, inter], then the same four for
// the uncompressed collectives (fp32 reduce-scatter, bf16 all-gather).
std::vector<int64_t> plan_wire_bytes(const std::string& config,
                                     const std::vector<int64_t>& node_labels, int64_t numel,
                                     int64_t step) {
  auto parsed = parse(config);
  auto labels = checked_labels(node_labels);
  TORCH_CHECK(numel > 0, "sdp4bit: numel ", numel, " must be positive");
  std::vector<uint16_t> zeros(static_cast<size_t>(numel), 0);
  return rethrow_as_torch_error([&] {
    rust::Slice<const uint64_t> nodes(labels.data(), labels.size());
    auto grad = ffi::new_grad_bucket(*parsed, nodes, 0, static_cast<size_t>(numel), 0);
    auto weight = ffi::new_weight_bucket(
        *parsed, nodes, 0, 0, rust::Slice<const uint16_t>(zeros.data(), zeros.size()));
    std::vector<int64_t> out;
    for (const auto& bytes : {grad->wire_bytes(checked_step(step)), weight->wire_bytes(),
                              grad->baseline_wire_bytes(), weight->baseline_wire_bytes()}) {
      auto pair = wire_pair(bytes);
      out.insert(out.end(), pair.begin(), pair.end());
    }
    return out;
  });
}

}  // namespace

TORCH_LIBRARY(sdp4bit, m) {
  m.class_<ProcessGroups>("ProcessGroups")
      .def(torch::init<std::string, std::string, std::string>())
      .def("rank", &ProcessGroups::rank)
      .def("size", &ProcessGroups::size)
      .def("side_stream", &ProcessGroups::side_stream_ids)
      .def("close", &ProcessGroups::close);
  m.class_<Work>("Work")
      .def("wait", &Work::wait)
      .def("is_completed", &Work::is_completed)
      .def("completion_fd", &Work::completion_fd);
  m.class_<GradReduceScatter>("GradReduceScatter")
      .def(torch::init<c10::intrusive_ptr<ProcessGroups>, std::string, std::vector<int64_t>,
                       int64_t, int64_t, std::string, int64_t>())
      .def("start", &GradReduceScatter::start)
      .def("shard_len", &GradReduceScatter::shard_len)
      .def("device", &GradReduceScatter::device)
      .def("quantizes_at", &GradReduceScatter::quantizes_at)
      .def("wire_bytes", &GradReduceScatter::wire_bytes)
      .def("baseline_wire_bytes", &GradReduceScatter::baseline_wire_bytes)
      .def("notice", &GradReduceScatter::notice)
      .def("reads_back_integer_sums", &GradReduceScatter::reads_back_integer_sums)
      .def("take_integer_sum_status", &GradReduceScatter::take_integer_sum_status)
      .def("integer_sum_error", &GradReduceScatter::integer_sum_error);
  m.class_<WeightAllGather>("WeightAllGather")
      .def(torch::init<c10::intrusive_ptr<ProcessGroups>, std::string, std::vector<int64_t>,
                       at::Tensor, int64_t, int64_t>())
      .def("start", &WeightAllGather::start)
      .def("shard_len", &WeightAllGather::shard_len)
      .def("wire_bytes", &WeightAllGather::wire_bytes)
      .def("baseline_wire_bytes", &WeightAllGather::baseline_wire_bytes);
  m.class_<CrossGroupAllReduce>("CrossGroupAllReduce")
      .def(torch::init<c10::intrusive_ptr<ProcessGroups>, std::string, int64_t, int64_t,
                       int64_t, std::string, int64_t>())
      .def("start", &CrossGroupAllReduce::start)
      .def("device", &CrossGroupAllReduce::device)
      .def("wire_bytes", &CrossGroupAllReduce::wire_bytes)
      .def("baseline_wire_bytes", &CrossGroupAllReduce::baseline_wire_bytes);
  m.def("resolve_config(str config) -> str", &resolve_config);
  m.def("schema() -> str", &schema);
  m.def("cuda_device_report(int device) -> str", &cuda_device_report);
  m.def("nvrtc_report() -> str", &nvrtc_report);
  m.def("cuda_kernel_check(int device, str config, int[] node_labels, int rank) -> ()",
        &cuda_kernel_check);
  m.def("plan_wire_bytes(str config, int[] node_labels, int numel, int step) -> int[]",
        &plan_wire_bytes);
#ifdef SDP4BIT_TEST_OPS
  m.def(
      "simulate_grad_reduce_scatter(str config, int[] node_labels, int bucket_id, int step, "
      "Tensor inputs) -> Tensor",
      &simulate_grad_reduce_scatter);
  m.def(
      "simulate_cross_group_all_reduce(str config, int bucket_id, int step, int[] stream_ranks, "
      "Tensor inputs) -> Tensor",
      &simulate_cross_group_all_reduce);
  m.def(
      "simulate_weight_all_gather(str config, int[] node_labels, int bucket_id, int first_step, "
      "Tensor initial, Tensor targets) -> Tensor",
      &simulate_weight_all_gather);
#endif  // SDP4BIT_TEST_OPS
}

}  // namespace sdp4bit
