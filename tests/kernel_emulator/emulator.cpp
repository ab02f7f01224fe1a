// Runs the CUDA kernels of kernels/ on the host, as described by case files that
// tests/cuda_emulated/ writes (the emulation model and its limits: cuda_shim.h).
//
// Usage: emulator DIR JOBS
//   Loads every DIR/*.so (host builds of the specialised kernels the cases launch, made by
//   sdp4bit_test_support::host_kernels, which register themselves: host_kernels.h), runs every
//   DIR/*.case with JOBS worker threads and writes DIR/<name>.out for each case that ran without
//   an emulation error. Exit status 0 when every case ran, 1 otherwise
//   (the errors are on stderr), 2 on bad usage; a memory fault prints where it happened and
//   exits with status 3. Built with UBSan, which reports undefined behaviour and exits with
//   status 1 (after the emulator prints where it happened).
//
// Case file (all integers little-endian):
//   "SDPEMU03"
//   u32 buffer count, then per buffer: u8 is_output, u64 length, the initial bytes
//   u32 launch count, then per launch:
//     u32 name length, the entry point's name
//     u32 grid (gridDim.x), u32 threads per block (blockDim.x, a multiple of 32 up to 1024)
//     u32 warp order (0 forward, 1 reverse, 2 shuffled), u64 shuffle seed
//     u32 pointer count, then per pointer: u32 buffer index, or 0xffffffff for null
//     u32 parameter bytes, then the parameter struct as the Rust side's #[repr(C)] mirror
//       lays it out (its length must equal the C struct's sizeof)
//     u32 address count, then per address: u32 byte offset in the parameter struct, u32 buffer
//       index: the buffer's address is written there as a u64 (an address a parameter struct
//       holds, such as Global-QSGD's status word)
// Output file: the final bytes of every output buffer, in buffer order.
#include "cuda_shim.h"
#include "host_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sanitizer/common_interface_defs.h>
#include <signal.h>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <tuple>
#include <type_traits>
#include <ucontext.h>
#include <unistd.h>
#include <utility>
#include <vector>
#include <dirent.h>
#include <dlfcn.h>

thread_local emu_uint3 threadIdx, blockIdx, blockDim, gridDim;

namespace {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kMaxBlockThreads = 1024;
constexpr uint32_t kFullMask = 0xffffffffu;
constexpr uint32_t kNullPointer = 0xffffffffu;
// Device allocations are 256-byte aligned; every buffer starts on such a boundary.
constexpr size_t kAlignment = 256;
constexpr size_t kLaneStack = 128 * 1024;
constexpr uint8_t kCanary = 0x5b;

size_t page_size()
{
    static const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return page;
}

size_t round_up(size_t n, size_t unit)
{
    return (n + unit - 1) / unit * unit;
}

// ---------------------------------------------------------------------------------------------
// The kernels, by name: the entry points the loaded host builds registered.

struct Registry {
    std::mutex mutex;
    std::vector<const KernelEntry*> entries;
};

// Never destroyed: a library may register while static destructors run elsewhere.
Registry& registry()
{
    static Registry& r = *new Registry;
    return r;
}

const KernelEntry* find_kernel(const std::string& name)
{
    Registry& r = registry();
    std::lock_guard<std::mutex> guard(r.mutex);
    for (const KernelEntry* k : r.entries) {
        if (name == k->name) {
            return k;
        }
    }
    return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Guarded buffers: each buffer gets its own mapping, [guard page][canary][data][canary][guard
// page], the data 256-byte aligned and ending less than 256 bytes before the trailing guard
// page, so an access past the end faults and a stray write next to the data changes a canary.

struct Buffer {
    uint8_t* map = nullptr;
    size_t map_len = 0;
    uint8_t* data = nullptr;
    size_t len = 0;
    bool output = false;

    uint8_t* body() const { return map + page_size(); }
    size_t body_len() const { return map_len - 2 * page_size(); }
};

Buffer guarded_buffer(size_t len)
{
    const size_t page = page_size();
    Buffer b;
    b.len = len;
    b.map_len = round_up(round_up(len, kAlignment) + kAlignment, page) + 2 * page;
    void* map = mmap(nullptr, b.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        std::perror("emulator: mmap");
        std::exit(1);
    }
    b.map = (uint8_t*)map;
    if (mprotect(b.map, page, PROT_NONE) != 0 || mprotect(b.map + b.map_len - page, page, PROT_NONE) != 0) {
        std::perror("emulator: mprotect");
        std::exit(1);
    }
    b.data = b.body() + b.body_len() - round_up(len, kAlignment);
    std::memset(b.body(), kCanary, b.body_len());
    return b;
}

void release(Buffer& b)
{
    munmap(b.map, b.map_len);
    b = Buffer{};
}

// The offset (relative to the data) of the first canary byte that changed, if any.
bool canary_changed(const Buffer& b, long* offset)
{
    for (uint8_t* p = b.body(); p < b.body() + b.body_len(); ++p) {
        if ((p < b.data || p >= b.data + b.len) && *p != kCanary) {
            *offset = (long)(p - b.data);
            return true;
        }
    }
    return false;
}

// ---------------------------------------------------------------------------------------------
// Case files.

struct Launch {
    const KernelEntry* kernel = nullptr;
    uint32_t grid = 0;
    uint32_t threads = 0;
    uint32_t order = 0;
    uint64_t seed = 0;
    std::vector<uint32_t> pointers;
    std::vector<uint8_t> params;
};

struct Case {
    std::vector<Buffer> buffers;
    std::vector<Launch> launches;

    Case() = default;
    Case(const Case&) = delete;
    Case& operator=(const Case&) = delete;
    ~Case()
    {
        for (Buffer& b : buffers) {
            release(b);
        }
    }
};

class Reader {
public:
    explicit Reader(const std::vector<uint8_t>& bytes)
        : p_(bytes.data()), end_(bytes.data() + bytes.size())
    {
    }

    void take(void* out, size_t n)
    {
        if ((size_t)(end_ - p_) < n) {
            throw std::string("case file truncated");
        }
        std::memcpy(out, p_, n);
        p_ += n;
    }

    template <class T>
    T get()
    {
        T v;
        take(&v, sizeof v);
        return v;
    }

    bool at_end() const { return p_ == end_; }

private:
    const uint8_t* p_;
    const uint8_t* end_;
};

// Fills `c` from a case file's bytes; throws a message on malformed input.
void parse_case(const std::vector<uint8_t>& bytes, Case& c)
{
    Reader r(bytes);
    char magic[8];
    r.take(magic, 8);
    if (std::memcmp(magic, "SDPEMU03", 8) != 0) {
        throw std::string("not a case file (bad magic)");
    }
    const uint32_t buffers = r.get<uint32_t>();
    for (uint32_t i = 0; i < buffers; ++i) {
        const bool output = r.get<uint8_t>() != 0;
        const uint64_t len = r.get<uint64_t>();
        c.buffers.push_back(guarded_buffer(len));
        c.buffers.back().output = output;
        r.take(c.buffers.back().data, len);
    }
    const uint32_t launches = r.get<uint32_t>();
    for (uint32_t i = 0; i < launches; ++i) {
        Launch l;
        std::string name(r.get<uint32_t>(), '\0');
        r.take(name.data(), name.size());
        l.kernel = find_kernel(name);
        if (l.kernel == nullptr) {
            throw "launch " + std::to_string(i) + ": no loaded host build has the entry point '" + name + "'";
        }
        l.grid = r.get<uint32_t>();
        l.threads = r.get<uint32_t>();
        l.order = r.get<uint32_t>();
        l.seed = r.get<uint64_t>();
        l.pointers.resize(r.get<uint32_t>());
        for (uint32_t& p : l.pointers) {
            p = r.get<uint32_t>();
            if (p != kNullPointer && p >= buffers) {
                throw "launch " + std::to_string(i) + ": buffer index " + std::to_string(p) + " out of range";
            }
        }
        l.params.resize(r.get<uint32_t>());
        r.take(l.params.data(), l.params.size());
        const uint32_t addresses = r.get<uint32_t>();
        for (uint32_t a = 0; a < addresses; ++a) {
            const uint32_t offset = r.get<uint32_t>();
            const uint32_t buffer = r.get<uint32_t>();
            if (buffer >= buffers || (uint64_t)offset + sizeof(uint64_t) > l.params.size()) {
                throw "launch " + std::to_string(i) + ": address " + std::to_string(a) + " out of range";
            }
            const uint64_t address = (uint64_t)(uintptr_t)c.buffers[buffer].data;
            std::memcpy(l.params.data() + offset, &address, sizeof address);
        }
        if (l.grid == 0 || l.order > 2 || l.threads == 0 || l.threads % kWarpSize != 0 ||
            l.threads > kMaxBlockThreads) {
            throw "launch " + std::to_string(i) + ": bad grid, block size or warp order";
        }
        if (l.pointers.size() != l.kernel->pointers) {
            throw "launch " + std::to_string(i) + " (" + name + "): " + std::to_string(l.pointers.size()) +
                " pointers, the kernel takes " + std::to_string(l.kernel->pointers);
        }
        if (l.params.size() != l.kernel->param_bytes) {
            throw "launch " + std::to_string(i) + " (" + name + "): parameter struct of " +
                std::to_string(l.params.size()) + " bytes, the C struct has " +
                std::to_string(l.kernel->param_bytes) +
                " (the Rust mirror in abi.rs disagrees with sdp4bit_abi.h)";
        }
        c.launches.push_back(std::move(l));
    }
    if (!r.at_end()) {
        throw std::string("trailing bytes after the last launch");
    }
}

// ---------------------------------------------------------------------------------------------
// The warp scheduler: one Worker per OS thread, 32 lane fibers per warp.

enum class LaneState { running, waiting, exited };

const char* op_name(emu_warp_op op)
{
    switch (op) {
    case emu_warp_op::shfl_idx:
        return "__shfl_sync";
    case emu_warp_op::shfl_bfly:
        return "__shfl_xor_sync";
    case emu_warp_op::vote_any:
        return "__any_sync";
    case emu_warp_op::reduce_max:
        return "__reduce_max_sync";
    }
    return "?";
}

struct Worker {
    ucontext_t scheduler;
    ucontext_t lanes[kWarpSize];
    uint8_t* stacks = nullptr;  // kWarpSize stacks, each above a guard page
    size_t stack_stride = 0;
    LaneState state[kWarpSize];
    emu_warp_op op[kWarpSize];
    unsigned mask[kWarpSize];
    unsigned exchanges[kWarpSize];  // exchanges so far; its parity picks the slot bank
    uint32_t slots[2][kWarpSize];
    unsigned lane = 0;  // the lane running now
    // What runs now (also read by the fault handler).
    const char* case_name = "";
    size_t launch_index = 0;
    const Launch* launch = nullptr;
    const Case* current = nullptr;
    void* pointers[kMaxPointers] = {};  // the running launch's pointer arguments
    std::vector<uint8_t> signal_stack;

    Worker()
    {
        stack_stride = page_size() + round_up(kLaneStack, page_size());
        void* map = mmap(nullptr, kWarpSize * stack_stride, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (map == MAP_FAILED) {
            std::perror("emulator: mmap");
            std::exit(1);
        }
        stacks = (uint8_t*)map;
        for (unsigned l = 0; l < kWarpSize; ++l) {
            if (mprotect(stacks + l * stack_stride, page_size(), PROT_NONE) != 0) {
                std::perror("emulator: mprotect");
                std::exit(1);
            }
        }
        // The fault handler runs on its own stack, so that it also reports a lane stack
        // overflow.
        signal_stack.resize(64 * 1024);
        stack_t ss{};
        ss.ss_sp = signal_stack.data();
        ss.ss_size = signal_stack.size();
        if (sigaltstack(&ss, nullptr) != 0) {
            std::perror("emulator: sigaltstack");
            std::exit(1);
        }
    }

    ~Worker()
    {
        stack_t ss{};
        ss.ss_flags = SS_DISABLE;
        sigaltstack(&ss, nullptr);
        munmap(stacks, kWarpSize * stack_stride);
    }
};

thread_local Worker* tl_worker = nullptr;

void lane_main()
{
    Worker& w = *tl_worker;
    w.launch->kernel->call(w.pointers, w.launch->params.data());
    w.state[w.lane] = LaneState::exited;
    // Returning resumes uc_link, the scheduler.
}

std::string lane_list(const Worker& w, LaneState s)
{
    std::string out;
    for (unsigned l = 0; l < kWarpSize; ++l) {
        if (w.state[l] == s) {
            out += (out.empty() ? "" : ",") + std::to_string(l);
        }
    }
    return out;
}

// Makes lane `l` start lane_main on its own stack when next resumed, returning to the
// scheduler at the end. A function of its own: g++ treats getcontext as returning twice, which
// constrains (and warns about) the locals of the function calling it.
__attribute__((noinline)) void start_lane(Worker& w, unsigned l)
{
    ucontext_t& ctx = w.lanes[l];
    getcontext(&ctx);
    ctx.uc_stack.ss_sp = w.stacks + l * w.stack_stride + page_size();
    ctx.uc_stack.ss_size = w.stack_stride - page_size();
    ctx.uc_link = &w.scheduler;
    makecontext(&ctx, lane_main, 0);
    w.state[l] = LaneState::running;
    w.exchanges[l] = 0;
}

// Runs warp `warp` of block `block` of the current launch to completion: every round resumes
// each live lane until it reaches its next warp-wide operation or returns. Returns an error
// message, or an empty string.
std::string run_warp(Worker& w, unsigned block, unsigned warp)
{
    blockIdx = {block, 0, 0};
    for (unsigned l = 0; l < kWarpSize; ++l) {
        start_lane(w, l);
    }
    for (;;) {
        for (unsigned l = 0; l < kWarpSize; ++l) {
            if (w.state[l] != LaneState::exited) {
                w.lane = l;
                threadIdx = {warp * kWarpSize + l, 0, 0};
                w.state[l] = LaneState::running;
                swapcontext(&w.scheduler, &w.lanes[l]);
            }
        }
        unsigned waiting = 0;
        for (unsigned l = 0; l < kWarpSize; ++l) {
            waiting += w.state[l] == LaneState::waiting;
        }
        if (waiting == 0) {
            return {};
        }
        const std::string where = "block " + std::to_string(block) + " warp " + std::to_string(warp) + ": ";
        if (waiting != kWarpSize) {
            return where + "lanes " + lane_list(w, LaneState::exited) + " returned while lanes " +
                lane_list(w, LaneState::waiting) + " wait at a warp-wide operation (divergent warp)";
        }
        for (unsigned l = 1; l < kWarpSize; ++l) {
            if (w.op[l] != w.op[0] || w.mask[l] != w.mask[0]) {
                char msg[160];
                std::snprintf(msg, sizeof msg,
                              "lane 0 is at %s(mask %#x) but lane %u at %s(mask %#x) (divergent warp)",
                              op_name(w.op[0]), w.mask[0], l, op_name(w.op[l]), w.mask[l]);
                return where + msg;
            }
        }
        if (w.mask[0] != kFullMask) {
            return where + op_name(w.op[0]) + " with a partial mask, which the emulator does not model";
        }
    }
}

uint64_t splitmix64(uint64_t& state)
{
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Runs one launch: every warp of the grid in the launch's order. Returns an error message, or
// an empty string.
std::string run_launch(Worker& w, Case& c, const Launch& l)
{
    w.launch = &l;
    for (size_t i = 0; i < l.pointers.size(); ++i) {
        w.pointers[i] = l.pointers[i] == kNullPointer ? nullptr : c.buffers[l.pointers[i]].data;
    }
    blockDim = {l.threads, 1, 1};
    gridDim = {l.grid, 1, 1};
    const unsigned warps_per_block = l.threads / kWarpSize;
    std::vector<uint32_t> warps(l.grid * warps_per_block);
    for (uint32_t i = 0; i < warps.size(); ++i) {
        warps[i] = i;
    }
    if (l.order == 1) {
        std::reverse(warps.begin(), warps.end());
    } else if (l.order == 2) {
        uint64_t state = l.seed;
        for (size_t i = warps.size(); i > 1; --i) {
            std::swap(warps[i - 1], warps[splitmix64(state) % i]);
        }
    }
    for (uint32_t id : warps) {
        std::string err = run_warp(w, id / warps_per_block, id % warps_per_block);
        if (!err.empty()) {
            return err;
        }
    }
    for (size_t i = 0; i < c.buffers.size(); ++i) {
        long offset = 0;
        if (canary_changed(c.buffers[i], &offset)) {
            return "wrote outside buffer " + std::to_string(i) + " (" + std::to_string(c.buffers[i].len) +
                " bytes) at offset " + std::to_string(offset);
        }
    }
    return {};
}

std::vector<uint8_t> read_file(const std::string& path)
{
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        throw "cannot open " + path;
    }
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// Runs the case DIR/NAME.case and writes DIR/NAME.out. Returns an error message, or an empty
// string.
std::string run_case(Worker& w, const std::string& dir, const std::string& name)
{
    Case c;
    try {
        parse_case(read_file(dir + "/" + name + ".case"), c);
    } catch (const std::string& e) {
        return e;
    }
    w.current = &c;
    std::string err;
    for (size_t i = 0; i < c.launches.size() && err.empty(); ++i) {
        w.launch_index = i;
        err = run_launch(w, c, c.launches[i]);
        if (!err.empty()) {
            err = "launch " + std::to_string(i) + " (" + c.launches[i].kernel->name + "): " + err;
        }
    }
    w.current = nullptr;
    w.launch = nullptr;
    if (!err.empty()) {
        return err;
    }
    std::ofstream out(dir + "/" + name + ".out", std::ios::binary);
    for (const Buffer& b : c.buffers) {
        if (b.output) {
            out.write((const char*)b.data, (std::streamsize)b.len);
        }
    }
    return out ? std::string() : "cannot write " + dir + "/" + name + ".out";
}

// A message built without allocating (for the fault handler and the UBSan death callback).
struct Message {
    char text[512];
    size_t len = 0;

    template <class... Args>
    void append(const char* format, Args... args)
    {
        const int n = std::snprintf(text + len, sizeof text - len, format, args...);
        len = std::min(len + (n > 0 ? (size_t)n : 0), sizeof text - 1);
    }

    // Where this thread is emulating: case, launch, block and thread.
    void append_position()
    {
        const Worker* w = tl_worker;
        if (w != nullptr && w->current != nullptr && w->launch != nullptr) {
            append(" in case %s, launch %zu (%s), block %u, thread %u", w->case_name, w->launch_index,
                   w->launch->kernel->name, blockIdx.x, threadIdx.x);
        }
    }

    void print()
    {
        append("\n");
        if (write(STDERR_FILENO, text, len) < 0) {
            _exit(4);
        }
    }
};

// A memory fault: report the position and (for a guard page) the buffer or lane stack, and
// exit. Runs on the worker's signal stack.
void on_fault(int sig, siginfo_t* info, void*)
{
    const uint8_t* addr = (const uint8_t*)info->si_addr;
    Message m;
    m.append("emulator: %s at address %p", sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", (const void*)addr);
    m.append_position();
    if (const Worker* w = tl_worker; w != nullptr && w->current != nullptr) {
        for (size_t i = 0; i < w->current->buffers.size(); ++i) {
            const Buffer& b = w->current->buffers[i];
            if (addr >= b.map && addr < b.map + b.map_len) {
                m.append(": %ld bytes from the start of buffer %zu (%zu bytes)", (long)(addr - b.data), i,
                         b.len);
            }
        }
        if (addr >= w->stacks && addr < w->stacks + kWarpSize * w->stack_stride) {
            m.append(": a lane stack overflowed");
        }
    }
    m.print();
    _exit(3);
}

// UBSan found undefined behaviour in a kernel (its report is printed already) and is about to
// exit: say where.
void on_sanitizer_death()
{
    Message m;
    m.append("emulator: stopped by UBSan");
    m.append_position();
    m.print();
}

}  // namespace

void emu_misaligned(const void* address, size_t bytes)
{
    Message m;
    m.append("emulator: misaligned %zu-byte access at address %p", bytes, address);
    m.append_position();
    m.print();
    _exit(3);
}

bool emu_register_kernels(const KernelEntry* entries, size_t count)
{
    Registry& r = registry();
    std::lock_guard<std::mutex> guard(r.mutex);
    for (size_t i = 0; i < count; ++i) {
        r.entries.push_back(entries + i);
    }
    return true;
}

const uint32_t* emu_warp_exchange(emu_warp_op op, unsigned mask, uint32_t value)
{
    Worker& w = *tl_worker;
    const unsigned lane = w.lane;
    // Two banks: a lane that has read this exchange's values and deposits its next one writes
    // the other bank, which every lane finished reading one exchange ago.
    uint32_t* bank = w.slots[w.exchanges[lane]++ % 2];
    bank[lane] = value;
    w.op[lane] = op;
    w.mask[lane] = mask;
    w.state[lane] = LaneState::waiting;
    swapcontext(&w.lanes[lane], &w.scheduler);
    return bank;
}

int main(int argc, char** argv)
{
    if (argc != 3 || std::atoi(argv[2]) < 1) {
        std::fprintf(stderr, "usage: %s DIR JOBS\n", argv[0]);
        return 2;
    }
    // The kernels are compiled with --ftz=false: denormals must not be flushed here either.
    volatile float tiny = 1e-40f;
    if (tiny * 1.0f == 0.0f) {
        std::fprintf(stderr, "emulator: the host flushes denormals to zero\n");
        return 2;
    }
    const std::string dir = argv[1];
    const unsigned jobs = (unsigned)std::atoi(argv[2]);

    std::vector<std::string> names;
    std::vector<std::string> libraries;
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) {
        std::perror(("emulator: " + dir).c_str());
        return 2;
    }
    auto ends_with = [](const std::string& n, const char* suffix) {
        const size_t len = std::strlen(suffix);
        return n.size() > len && n.compare(n.size() - len, len, suffix) == 0;
    };
    while (dirent* e = readdir(d)) {
        const std::string n = e->d_name;
        if (ends_with(n, ".case")) {
            names.push_back(n.substr(0, n.size() - 5));
        } else if (ends_with(n, ".so")) {
            libraries.push_back(dir + "/" + n);
        }
    }
    closedir(d);
    std::sort(names.begin(), names.end());
    for (const std::string& library : libraries) {
        if (dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
            std::fprintf(stderr, "emulator: cannot load %s: %s\n", library.c_str(), dlerror());
            return 2;
        }
    }

    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
    __sanitizer_set_death_callback(on_sanitizer_death);

    std::atomic<size_t> next{0};
    std::atomic<unsigned> failures{0};
    std::mutex log;
    auto work = [&] {
        Worker w;
        tl_worker = &w;
        for (size_t i = next++; i < names.size(); i = next++) {
            w.case_name = names[i].c_str();
            const std::string err = run_case(w, dir, names[i]);
            if (!err.empty()) {
                std::lock_guard<std::mutex> g(log);
                std::fprintf(stderr, "case %s: %s\n", names[i].c_str(), err.c_str());
                ++failures;
            }
        }
        tl_worker = nullptr;
    };
    std::vector<std::thread> threads;
    for (unsigned j = 0; j < std::min<size_t>(jobs, names.size()); ++j) {
        threads.emplace_back(work);
    }
    for (std::thread& t : threads) {
        t.join();
    }
    std::printf("emulated %zu cases, %u failed to run\n", names.size(), failures.load());
    return failures == 0 ? 0 : 1;
}
