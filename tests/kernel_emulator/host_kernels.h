// The host builds of specialised kernels, as the emulators run them: a shared library built by
// g++ from the entry points src/backend/cuda/spec.rs writes (sdp4bit_test_support::host_kernels)
// registers each of them, with what the emulators need to know of it, when it is loaded.
//
// A translation unit of such a library includes this header, the kernel sources and the
// wrappers, then lists its entry points: `SDP_HOST_KERNELS(SDP_HOST_KERNEL(name, params) ...)`.
#pragma once

#include <cstddef>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// The emulator's view of one entry point.
struct KernelEntry {
    const char* name;
    // The C name of its parameter struct.
    const char* params;
    unsigned pointers;
    size_t param_bytes;
    // Bit i: pointer parameter i is written (its pointee is not const).
    unsigned written;
    void (*call)(void* const* p, const void* params);
};

// The most pointer parameters an entry point may take.
constexpr unsigned kMaxPointers = 4;

// Makes `count` entries at `entries` known to the emulator that loaded the library (they stay
// valid while it is loaded). Returns true.
__attribute__((visibility("default"))) bool emu_register_kernels(const KernelEntry* entries, size_t count);

template <class P>
P emu_params_of(const void* bytes)
{
    P params;
    std::memcpy(&params, bytes, sizeof params);
    return params;
}

// What the emulator needs of an entry point, read from its prototype: its leading pointer
// parameters and its parameter struct.
template <class Function>
struct Signature;

template <class... Args>
struct Signature<void (*)(Args...)> {
    static constexpr unsigned pointers = sizeof...(Args) - 1;
    template <size_t i>
    using Arg = std::tuple_element_t<i, std::tuple<Args...>>;
    using Params = Arg<pointers>;
};

// Calls `kernel` with the pointers `p` and the parameter struct whose bytes are at `params`.
template <auto kernel, size_t... i>
void call_kernel(void* const* p, const void* params, std::index_sequence<i...>)
{
    using S = Signature<decltype(kernel)>;
    kernel(static_cast<typename S::template Arg<i>>(p[i])..., emu_params_of<typename S::Params>(params));
}

// The pointer parameters of `kernel` whose pointee is not const, as bits.
template <auto kernel, size_t... i>
constexpr unsigned written_pointers(std::index_sequence<i...>)
{
    using S = Signature<decltype(kernel)>;
    static_assert((std::is_pointer_v<typename S::template Arg<i>> && ...), "pointers first, then one struct");
    return (0u | ... | ((std::is_const_v<std::remove_pointer_t<typename S::template Arg<i>>> ? 0u : 1u) << i));
}

template <auto kernel>
constexpr KernelEntry kernel_entry(const char* name, const char* params)
{
    using S = Signature<decltype(kernel)>;
    static_assert(S::pointers <= kMaxPointers, "at most kMaxPointers pointer parameters");
    return {name, params, S::pointers, sizeof(typename S::Params),
            written_pointers<kernel>(std::make_index_sequence<S::pointers>()),
            [](void* const* p, const void* a) { call_kernel<kernel>(p, a, std::make_index_sequence<S::pointers>()); }};
}

// One entry of the list SDP_HOST_KERNELS registers.
#define SDP_HOST_KERNEL(name, params) kernel_entry<&name>(#name, #params),

// Registers the translation unit's entry points when the library is loaded.
#define SDP_HOST_KERNELS(...)                                                               \
    namespace {                                                                             \
    const KernelEntry sdp_host_entries[] = {__VA_ARGS__};                                   \
    [[maybe_unused]] const bool sdp_host_registered =                                       \
        emu_register_kernels(sdp_host_entries, sizeof sdp_host_entries / sizeof(KernelEntry)); \
    }
