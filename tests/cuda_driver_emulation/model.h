// The emulated driver's model of devices, contexts, memory, streams, events and modules, shared
// by the entry points (api_*.cpp) and the machinery behind them. One mutex (Driver::mutex)
// guards all of it; functions documented "locked" expect the caller to hold it.
//
// Ordering is tracked with vector clocks: every stream has an id, every operation on a stream a
// sequence number (1, 2, ... in enqueue order), and every operation carries a clock whose entry
// for stream t is the number of t's operations that are ordered before it (by stream order,
// event waits, the legacy default stream's implicit synchronisation, or a host synchronisation
// seen by the enqueuing thread). An operation runs once every stream has completed the
// operations its clock names, and two accesses to the same bytes race when at least one writes
// and neither operation's clock covers the other.
#pragma once

#include "cuda_api.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

namespace emu {

// ---------------------------------------------------------------------------------------------
// Vector clocks.

// Entry t: how many operations of stream t are ordered before the holder.
using Clock = std::vector<uint64_t>;

// `into` becomes the entry-wise maximum of both.
void join(Clock& into, const Clock& from);

// Whether operation `seq` of stream `stream` is ordered before a holder of `clock`.
bool covers(const Clock& clock, uint32_t stream, uint64_t seq);

// ---------------------------------------------------------------------------------------------
// Devices and contexts.

struct Context;
struct Stream;

struct Device {
    int ordinal = 0;
    int multiprocessors = 1;
    // Compute capability major.minor.
    int compute_major = 9;
    int compute_minor = 0;
    Context* primary = nullptr;
};

struct Context {
    Device* device = nullptr;
    // cuDevicePrimaryCtxRetain calls not yet released.
    int retained = 0;
    // The first fault of an operation on this context's streams (an illegal address, a failed
    // launch): every later call that reports asynchronous errors returns it, as on a GPU.
    CUresult sticky = CUDA_SUCCESS;
    Stream* legacy = nullptr;
    // Streams that synchronise with the legacy default stream: created without
    // CU_STREAM_NON_BLOCKING.
    std::vector<Stream*> blocking;
};

// ---------------------------------------------------------------------------------------------
// Memory.

// An access of an operation to device memory: bytes [begin, end).
struct Allocation;
struct Access {
    Allocation* allocation = nullptr;
    uint64_t begin = 0;
    uint64_t end = 0;
    bool write = false;
};

// An access kept on its allocation, against which later operations are checked for races.
struct AccessRecord {
    uint32_t stream = 0;
    uint64_t seq = 0;
    uint64_t begin = 0;
    uint64_t end = 0;
    bool write = false;
    std::shared_ptr<const std::string> what;
};

// One cuMemAlloc. Device memory lies at the end of its own mapping, 256-byte aligned, between canary bytes and
// inaccessible guard pages (tests/kernel_emulator's layout).
struct Allocation {
    uint64_t id = 0;
    uint64_t base = 0;
    size_t size = 0;
    uint8_t* map = nullptr;
    size_t map_len = 0;
    // The owning device.
    Device* device = nullptr;
    // Freed (possibly still queued for release by a stream): no new operation may use it.
    bool freed = false;
    std::vector<AccessRecord> records;
};

// One cuMemHostAlloc: page-locked host memory, which a copy to the host writes asynchronously
// (on its stream, after the call returns) instead of before returning.
struct PinnedHost {
    size_t size = 0;
    // The copies into it, by stream id and sequence number, for cuMemFreeHost's check.
    std::vector<std::pair<uint32_t, uint64_t>> writers;
};

// ---------------------------------------------------------------------------------------------
// Streams, operations and events.

// What an operation's execution reports: a fault (sticky on its context) or success.
struct Outcome {
    CUresult code = CUDA_SUCCESS;
    std::string message;
};

struct Op {
    // What kind of operation this is, for the counters of completed operations ("kernel",
    // "copy", "memset", "event record", "event wait", "host function", "allocation", "free").
    const char* kind = "";
    Stream* stream = nullptr;
    uint64_t seq = 0;
    Clock clock;
    std::vector<Access> accesses;
    // For messages: "kernel grad_quantize_first", "cuMemcpyDtoDAsync of 96 bytes", ...
    std::shared_ptr<const std::string> what;
    // Runs on the stream's worker thread, without the driver lock.
    std::function<Outcome()> run;
    // Runs with the driver lock held once the operation has completed (events, frees).
    std::function<void()> complete;
};

enum class StreamKind { legacy, created };

struct Stream {
    uint32_t id = 0;
    Context* ctx = nullptr;
    StreamKind kind = StreamKind::created;
    bool blocking = true;
    // Lower is higher, within [kGreatestStreamPriority, 0] (0: cuStreamCreate's).
    int priority = 0;
    // The clock the next operation starts from.
    Clock clock;
    // The clock of the last operation enqueued: what synchronising with the stream learns.
    Clock last;
    uint64_t enqueued = 0;
    std::deque<std::unique_ptr<Op>> queue;
    // cuStreamDestroy was called: the worker drains the queue and exits.
    bool destroyed = false;
    // The worker's random delays (splitmix64 state).
    uint64_t rng = 0;
    // A CUDA graph is being captured on it (set by a test: sdp4bit_emu_set_capturing).
    bool capturing = false;
};

struct Event {
    Context* ctx = nullptr;
    unsigned flags = 0;
    bool recorded = false;
    // The record operation of the latest cuEventRecord.
    uint32_t stream = 0;
    uint64_t seq = 0;
    Clock clock;
    // When that record operation ran (for cuEventElapsedTime).
    std::chrono::steady_clock::time_point time;
};

// ---------------------------------------------------------------------------------------------
// Modules.

struct HostKernel;

// One kernel of a loaded module (a PTX `.entry` or a CUBIN's function symbol), bound to the host
// build of the kernel of that name.
struct Function {
    struct Module* module = nullptr;
    std::string name;
    const HostKernel* host = nullptr;
    // Byte offset and size of each parameter in the parameter block, as the image declares them.
    std::vector<std::pair<size_t, size_t>> params;
    size_t param_bytes = 0;
    // Threads per block the entry allows (.maxntid), 0 when it does not say.
    unsigned max_threads = 0;
};

struct Module {
    Context* ctx = nullptr;
    std::vector<std::unique_ptr<Function>> functions;
};

// Reads the kernels of a CUBIN (an ELF image for one real architecture) into `module` for a
// device of `device`'s compute capability (cubin.cpp); empty, or why the driver refuses it and
// the result code it returns.
std::string parse_cubin(const uint8_t* image, const Device& device, Module& module, CUresult* code);

// ---------------------------------------------------------------------------------------------
// The driver.

struct Driver {
    std::mutex mutex;
    // Notified whenever an operation completes or a stream is destroyed.
    std::condition_variable progress;
    bool initialized = false;
    uint64_t seed = 0;
    // Longest random delay before an operation runs, in microseconds.
    unsigned max_delay_us = 0;
    std::vector<std::unique_ptr<Device>> devices;
    std::vector<std::unique_ptr<Context>> contexts;
    // Every stream ever created, by id (never freed: records and clocks name them).
    std::vector<std::unique_ptr<Stream>> streams;
    // Operations completed per stream id.
    std::vector<uint64_t> completed;
    std::vector<std::unique_ptr<Event>> events;
    std::vector<std::unique_ptr<Module>> modules;
    // Live pinned host allocations by address.
    std::map<uint64_t, PinnedHost> pinned;
    // Live handles by kind: what a handle argument is checked against.
    std::unordered_set<const void*> live_streams;
    std::unordered_set<const void*> live_events;
    std::unordered_set<const void*> live_modules;
    std::unordered_set<const void*> live_functions;
    // Operations completed so far, by kind.
    std::map<std::string, uint64_t> completed_by_kind;
    // An injected kernel fault (sdp4bit_emu_corrupt_kernel_output): every later launch of the
    // kernel of this name (none when empty) flips `corrupt_mask` in byte `corrupt_byte` of what
    // its first written pointer argument points to, after the kernel ran.
    std::string corrupt_kernel;
    uint64_t corrupt_byte = 0;
    uint8_t corrupt_mask = 0;
};

// The one driver of the process (never destroyed, so worker threads may outlive exit).
Driver& driver();

// ---------------------------------------------------------------------------------------------
// Faults (faults.cpp).

// Records a fault (a detected race, a bad pointer, a kernel fault, ...): printed to stderr at
// once and kept until a test takes it (sdp4bit_emu_take_faults); faults nobody took fail the
// process at exit. `device` is the device it concerns, -1 for none.
void report_fault(int device, const std::string& message);

// Removes and returns (one per line) the faults of `device`, of every device when negative.
std::string take_faults(int device);

// Installs the exit check (once).
void install_exit_check();

// Counts a call that blocks the calling thread until device work has run (a stream, context or
// event synchronisation, a synchronous copy, memset or free, a copy into pageable host memory)
// against the calling thread (extension.cpp: sdp4bit_emu_take_host_syncs). Not locked.
void count_host_sync(const char* call);

// The driver's CUDA version cuDriverGetVersion reports (api_context.cpp).
int emulated_driver_version();

// ---------------------------------------------------------------------------------------------
// Memory (memory.cpp). All locked.

// A new device allocation of `bytes` (> 0) on `device`, filled with a garbage byte pattern.
Allocation* allocate_device(Device* device, size_t bytes);
// The live allocation holding address `addr`, or null.
Allocation* find_allocation(uint64_t addr);
// Checks that [addr, addr + bytes) lies inside one live allocation of `device`; returns it, or
// null with `why` explaining.
Allocation* check_range(uint64_t addr, size_t bytes, const Device* device, std::string& why);
// Where `addr` lies, for messages ("12 bytes past the end of allocation #3 (96 bytes)").
std::string describe_address(uint64_t addr);
// Marks the allocation freed (no new operation may use it).
void retire(Allocation* allocation);
// Makes a retired allocation inaccessible and keeps its addresses from reuse for a while.
void release(Allocation* allocation);
// "allocation #3 (96 bytes on device 0)".
std::string name_allocation(const Allocation& allocation);

// ---------------------------------------------------------------------------------------------
// Streams (streams.cpp). All locked.

// A new stream of `ctx` with its worker thread.
// The greatest stream priority (an H100's; the least is 0).
constexpr int kGreatestStreamPriority = -5;
Stream* create_stream(Context* ctx, StreamKind kind, bool blocking);
// The stream a handle names with `current` as the calling thread's current context (0 and
// CU_STREAM_LEGACY: its legacy default stream), or null when the handle is not a live stream
// of that context.
Stream* resolve_stream(CUstream handle, Context* current);
// "stream #4 (created, device 1)".
std::string name_stream(const Stream& stream);

// Checks `op`'s accesses against every earlier access of the same bytes; on a race reports it
// and returns CUDA_ERROR_ILLEGAL_STATE without enqueuing. Otherwise enqueues `op` on `stream`
// (its clock joined with the calling thread's knowledge, and with the blocking streams' for the
// legacy stream), records its accesses and returns CUDA_SUCCESS. `seq_out`, when given,
// receives the operation's sequence number.
CUresult enqueue(Stream* stream, std::unique_ptr<Op> op, uint64_t* seq_out = nullptr);
// Blocks (releasing the lock) until operation `seq` of stream id `stream` has completed, then
// adds `clock` (that operation's clock) to the calling thread's clock. Reports a fault and
// returns CUDA_ERROR_LAUNCH_TIMEOUT when nothing completes for minutes (a deadlock).
CUresult wait_for(std::unique_lock<std::mutex>& lock, uint32_t stream, uint64_t seq, Clock clock);
// Whether operation `seq` of stream id `stream` has completed; when it has, the calling thread
// learns its clock `clock`.
bool learn_if_complete(uint32_t stream, uint64_t seq, const Clock& clock);
// The calling thread's clock.
Clock& host_clock();
// Whether every operation recorded on `allocation` is ordered before the calling thread now;
// otherwise `why` names one that is not.
bool host_knows_all(const Allocation& allocation, std::string& why);
// Whether the calling thread is running a host function enqueued with cuLaunchHostFunc.
bool in_host_function();

// ---------------------------------------------------------------------------------------------
// Contexts (api_context.cpp). All locked.

// The calling thread's current context, or null.
Context* current_context();
// What every entry point checks first: the driver is initialised and the caller is not a host
// function (CUDA_ERROR_NOT_PERMITTED, reported as a fault).
CUresult entry_check(const char* call);
// entry_check, then a current context that is active and has no sticky error (else the error
// to return); `*ctx` receives it.
CUresult context_check(const char* call, Context** ctx);

// ---------------------------------------------------------------------------------------------
// Kernels (kernels.cpp).

// The host build of one entry point of a specialised kernel (run through
// tests/kernel_emulator's warp scheduler).
struct HostKernel {
    const char* name;
    // The C name of its parameter struct.
    const char* params;
    // Leading pointer parameters, then one parameter struct of `param_bytes`.
    unsigned pointers;
    size_t param_bytes;
    // Bit i: pointer parameter i is written (its pointee is not const in the kernel's
    // prototype).
    unsigned written;
    // The emulator's entry (opaque here).
    const void* entry;
};

// The host build of the entry point named `name`, or null: a registered one, else one the
// builder the tests installed (sdp4bit_emu_set_host_builder) builds now; a failed build is
// reported as a fault.
const HostKernel* find_host_kernel(const std::string& name, int device);

// Runs `grid` blocks of `threads` threads (a multiple of 32) of `kernel` on the calling thread
// with the given pointer arguments (inside `allocations`, whose canaries are checked
// afterwards) and parameter struct bytes, the warps in the order `order` (0 forward, 1
// reverse, 2 shuffled with `seed`). A divergent warp or a changed canary ends it with
// CUDA_ERROR_LAUNCH_FAILED; a memory fault inside the kernel (a guard page) stops the process
// with a message naming the kernel, block and thread, as tests/kernel_emulator does.
Outcome run_kernel(const HostKernel& kernel, unsigned grid, unsigned threads, void* const* pointers,
                   const std::vector<const Allocation*>& allocations, const std::vector<uint8_t>& params,
                   unsigned order, uint64_t seed);

// Installs the handler of memory faults inside kernels running on stream workers (every other
// fault goes to the handler installed before). Called once, by cuInit.
void install_fault_handler();

}  // namespace emu
