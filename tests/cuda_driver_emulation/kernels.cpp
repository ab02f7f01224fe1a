// The host builds of the kernels, run by tests/kernel_emulator's warp scheduler: that file is
// included here whole (its `main` renamed out of the way), so a launch of the emulated driver
// runs exactly the fibers, warp orders, divergence checks and fault reports that the
// per-launch emulator tests run. Built with cuda_shim.h force-included, like the emulator. The
// entry points themselves come from shared libraries built on demand: the first time a module's
// entry point has no registered host build, the builder the tests installed
// (sdp4bit_emu_set_host_builder; sdp4bit_test_support::host_kernels) builds the library of that
// specialisation, which registers it when loaded here.
#define main sdp4bit_kernel_emulator_main
#include "../kernel_emulator/emulator.cpp"
#undef main

#include "model.h"

#include <dlfcn.h>
#include <map>

namespace emu {
namespace {

// The builder of host builds, or null: (entry name, path buffer, its size) -> 0 with the
// library's path in the buffer, or non-zero with an error there.
using HostBuilder = int (*)(const char* entry, char* path, size_t capacity);
std::atomic<HostBuilder> host_builder{nullptr};

// The worker of the calling stream thread (created on its first launch, kept for the thread's
// life).
Worker& thread_worker()
{
    thread_local Worker worker;
    tl_worker = &worker;
    return worker;
}

struct sigaction previous_segv, previous_bus;

// A fault inside a kernel is reported by the emulator's handler (which stops the process);
// any other goes to the handler that was installed before.
void on_signal(int sig, siginfo_t* info, void* context)
{
    if (tl_worker != nullptr && tl_worker->launch != nullptr) {
        on_fault(sig, info, context);
    }
    const struct sigaction& previous = sig == SIGSEGV ? previous_segv : previous_bus;
    if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
        previous.sa_sigaction(sig, info, context);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN && previous.sa_handler != nullptr) {
        previous.sa_handler(sig);
        return;
    }
    // Default action: restore it and return, so the faulting access repeats and kills.
    signal(sig, SIG_DFL);
}

}  // namespace

const HostKernel* find_host_kernel(const std::string& name, int device)
{
    // Never destroyed: a stream's worker thread may still run a queued launch while the process
    // exits (a test that abandons work), after static destructors would have freed the table.
    static std::map<std::string, HostKernel>& known = *new std::map<std::string, HostKernel>;
    static std::mutex mutex;
    std::lock_guard<std::mutex> guard(mutex);
    if (const auto it = known.find(name); it != known.end()) {
        return &it->second;
    }
    const KernelEntry* k = find_kernel(name);
    if (k == nullptr) {
        const HostBuilder build = host_builder.load();
        if (build == nullptr) {
            report_fault(device, "cuModuleGetFunction: no host build of " + name + " and no builder installed");
            return nullptr;
        }
        // The host builds take the warp scheduler's symbols from this library: make them
        // global, as they are not when the process loaded it by name, RTLD_LOCAL, as cudarc
        // does (promoting a loaded library keeps it and its state).
        static const bool global = [] {
            Dl_info self{};
            return dladdr(reinterpret_cast<void*>(&emu_register_kernels), &self) != 0 &&
                dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL) != nullptr;
        }();
        if (!global) {
            report_fault(device, "cuModuleGetFunction: cannot make the emulation's symbols global: " +
                                     std::string(dlerror()));
            return nullptr;
        }
        char path[4096];
        if (build(name.c_str(), path, sizeof path) != 0) {
            report_fault(device, "cuModuleGetFunction: building the host build of " + name + " failed: " + path);
            return nullptr;
        }
        if (dlopen(path, RTLD_NOW | RTLD_LOCAL) == nullptr) {
            report_fault(device, "cuModuleGetFunction: cannot load " + std::string(path) + ": " + dlerror());
            return nullptr;
        }
        k = find_kernel(name);
        if (k == nullptr) {
            report_fault(device, "cuModuleGetFunction: " + std::string(path) + " does not register " + name);
            return nullptr;
        }
    }
    return &known.emplace(name, HostKernel{k->name, k->params, k->pointers, k->param_bytes, k->written, k})
                .first->second;
}

Outcome run_kernel(const HostKernel& kernel, unsigned grid, unsigned threads, void* const* pointers,
                   const std::vector<const Allocation*>& allocations, const std::vector<uint8_t>& params,
                   unsigned order, uint64_t seed)
{
    Worker& w = thread_worker();
    // The emulator's view of the launch: the allocations as its guarded buffers (the same
    // layout), for the canary check and for the fault handler's messages.
    Case view;
    for (const Allocation* a : allocations) {
        Buffer b;
        b.map = a->map;
        b.map_len = a->map_len;
        b.data = reinterpret_cast<uint8_t*>(a->base);
        b.len = a->size;
        view.buffers.push_back(b);
    }
    Launch launch;
    launch.kernel = static_cast<const KernelEntry*>(kernel.entry);
    launch.grid = grid;
    launch.threads = threads;
    launch.order = order;
    launch.seed = seed;
    launch.params = params;
    w.case_name = "of the emulated CUDA driver";
    w.current = &view;
    w.launch = &launch;
    for (unsigned i = 0; i < kernel.pointers; ++i) {
        w.pointers[i] = pointers[i];
    }
    blockDim = {threads, 1, 1};
    gridDim = {grid, 1, 1};
    const unsigned warps_per_block = threads / kWarpSize;
    std::vector<uint32_t> warps(static_cast<size_t>(grid) * warps_per_block);
    for (uint32_t i = 0; i < warps.size(); ++i) {
        warps[i] = i;
    }
    if (order == 1) {
        std::reverse(warps.begin(), warps.end());
    } else if (order == 2) {
        uint64_t state = seed;
        for (size_t i = warps.size(); i > 1; --i) {
            std::swap(warps[i - 1], warps[splitmix64(state) % i]);
        }
    }
    Outcome outcome;
    for (uint32_t id : warps) {
        std::string err = run_warp(w, id / warps_per_block, id % warps_per_block);
        if (!err.empty()) {
            outcome = {CUDA_ERROR_LAUNCH_FAILED, "kernel " + std::string(kernel.name) + ": " + err};
            break;
        }
    }
    for (size_t i = 0; i < view.buffers.size() && outcome.code == CUDA_SUCCESS; ++i) {
        long offset = 0;
        if (canary_changed(view.buffers[i], &offset)) {
            outcome = {CUDA_ERROR_LAUNCH_FAILED, "kernel " + std::string(kernel.name) + " wrote outside " +
                                                     name_allocation(*allocations[i]) + " at offset " +
                                                     std::to_string(offset)};
        }
    }
    w.launch = nullptr;
    w.current = nullptr;
    // The allocations belong to the driver: the view must not unmap them.
    view.buffers.clear();
    return outcome;
}

void install_fault_handler()
{
    struct sigaction sa{};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, &previous_segv);
    sigaction(SIGBUS, &sa, &previous_bus);
    __sanitizer_set_death_callback(on_sanitizer_death);
}

}  // namespace emu

extern "C" {

// Installs the builder of host builds (sdp4bit_test_support::host_kernels): called by the tests'
// processes once the emulated driver is loaded.
SDP4BIT_EXPORT void sdp4bit_emu_set_host_builder(emu::HostBuilder builder)
{
    emu::host_builder.store(builder);
}

}  // extern "C"
