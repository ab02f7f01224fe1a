// The host build of the kernels, run by tests/kernel_emulator's warp scheduler: that file is
// included here whole (its `main` renamed out of the way), so a launch of the emulated driver
// runs exactly the fibers, warp orders, divergence checks and fault reports that the
// per-launch emulator tests run. Built with cuda_shim.h force-included, like the emulator.
#define main sdp4bit_kernel_emulator_main
#include "../kernel_emulator/emulator.cpp"
#undef main

#include "model.h"

namespace emu {
namespace {

std::vector<HostKernel> make_host_kernels()
{
    std::vector<HostKernel> kernels;
    for (const KernelEntry& k : kKernels) {
        kernels.push_back(HostKernel{k.name, k.params, k.pointers, k.param_bytes, k.written, &k});
    }
    return kernels;
}

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

const HostKernel* find_host_kernel(const std::string& name)
{
    // Never destroyed: a stream's worker thread may still run a queued launch while the process
    // exits (a test that abandons work), after static destructors would have freed the table.
    static const std::vector<HostKernel>& kernels = *new std::vector<HostKernel>(make_host_kernels());
    for (const HostKernel& k : kernels) {
        if (name == k.name) {
            return &k;
        }
    }
    return nullptr;
}

Outcome run_kernel(const HostKernel& kernel, unsigned grid, void* const* pointers,
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
    launch.order = order;
    launch.seed = seed;
    launch.params = params;
    w.case_name = "of the emulated CUDA driver";
    w.current = &view;
    w.launch = &launch;
    for (unsigned i = 0; i < kernel.pointers; ++i) {
        w.pointers[i] = pointers[i];
    }
    blockDim = {kBlockThreads, 1, 1};
    gridDim = {grid, 1, 1};
    std::vector<uint32_t> warps(static_cast<size_t>(grid) * kWarpsPerBlock);
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
        std::string err = run_warp(w, id / kWarpsPerBlock, id % kWarpsPerBlock);
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
