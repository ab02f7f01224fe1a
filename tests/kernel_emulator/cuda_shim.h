// Host emulation of the CUDA device environment the kernels of kernels/ use, so that g++ can
// compile them unchanged and tests/cuda_emulated/ can run them on a machine without a GPU.
// This header is force-included (g++ -include) ahead of every kernels/*.cu translation unit
// and of emulator.cpp.
//
// Emulation model (the scheduler is in emulator.cpp):
// - A launch is gridDim.x blocks of blockDim = (T, 1, 1) threads, T a multiple of 32 (the
//   launch contract of kernels/common.cuh). Each warp runs as 32 cooperative fibers (ucontext)
//   on one OS thread;
//   the warps of a launch run one after another, each to completion, in an order chosen per
//   launch (forward, reverse or shuffled).
// - __shfl_sync, __shfl_xor_sync, __any_sync and __reduce_max_sync are the only points where
//   lanes meet: each lane deposits its value and yields; once all 32 lanes have arrived, each
//   gets the values. All 32 lanes must arrive at the same kind of operation with the full
//   mask; a lane that returns while others wait, or a different operation or mask, fails the
//   case as a divergent warp. (Like PTX on sm_70+, lanes may arrive from different call
//   sites.)
// - Floating point is the host's IEEE binary32 arithmetic with denormals (the emulator checks
//   they are not flushed): the _rn intrinsics are plain operators (the build passes
//   -ffp-contract=off, so nothing is fused into an FMA), __fmaf_rn is libm's exact fmaf, and
//   floorf, rintf, fminf and fmaxf are the host libm's.
//
// Limits:
// - Warps never run concurrently, so races between warps (two warps writing the same bytes,
//   one reading what another writes) go unnoticed unless the warp order changes the result.
//   Between two warp-wide operations the lanes of a warp run one after another in lane order,
//   so lanes of one warp writing the same address also resolve deterministically here.
// - No memory model: nothing needs a fence or __syncwarp here. There is no shared memory,
//   __syncthreads or other block-level primitive, and only what the kernels use is emulated
//   (32-bit shuffles without a width argument, the any-vote, the unsigned max-reduction, a
//   32-bit atomicMax that is plain code because only one lane runs at a time, the 32-bit,
//   uint2, uint4 and float4 loads and stores of the cache-hinted intrinsics): a kernel that
//   starts using anything else fails to compile here. A plain dereference of a vector pointer
//   is not checked for alignment (the kernels use the intrinsics for every vector access).
// - Host libm stands in for the GPU's floorf / rintf / fminf / fmaxf. All are exact IEEE
//   operations, but e.g. which zero fminf returns for (+0, -0) may differ (the kernels
//   canonicalise zeros where it matters). NaN payloads may differ on a GPU (its arithmetic
//   returns the canonical NaN), so the test compares NaNs as NaN-ness only.
// - g++ is not NVRTC: code whose meaning depends on the compiler (undefined behaviour, which
//   the test's UBSan build reports where it can) may behave differently on a GPU.
// - Device memory is host memory: the emulator guards every buffer (a PROT_NONE page after
//   it, canary bytes around it), but reads in the rest of a buffer's 256-byte allocation
//   granule go unnoticed, as they would on a GPU.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <type_traits>

static_assert(FLT_EVAL_METHOD == 0, "the emulation needs binary32 float arithmetic (no excess precision)");

#define __global__
#define __device__
#define __forceinline__ inline
// kernels/common.cuh's out-of-line functions (__noinline__ on the GPU; not a macro for
// __noinline__ itself, which libstdc++ uses in attributes): defined in every translation unit
// that includes them, never inlined.
#define SDP_NOINLINE __attribute__((noinline)) inline
#define __launch_bounds__(...)

// What the host builds of the kernels (shared libraries the emulators load,
// tests/kernel_emulator/host_kernels.h) take from the emulator that loads them: exported from
// it whatever its own symbol visibility.
#define EMU_EXPORT __attribute__((visibility("default")))

// threadIdx, blockIdx, blockDim, gridDim: set by the emulator for the lane that runs.
struct emu_uint3 {
    unsigned x, y, z;
};
extern thread_local EMU_EXPORT emu_uint3 threadIdx, blockIdx, blockDim, gridDim;

// ---------------------------------------------------------------------------------------------
// Warp-wide operations.

enum class emu_warp_op : uint32_t { shfl_idx, shfl_bfly, vote_any, reduce_max };

// Deposits this lane's `value`, waits until all 32 lanes of the warp have deposited theirs
// (with the same `op` and `mask`) and returns the 32 values, indexed by lane; they stay valid
// until this lane's next call.
EMU_EXPORT const uint32_t* emu_warp_exchange(emu_warp_op op, unsigned mask, uint32_t value);

template <class T>
concept emu_word = sizeof(T) == 4 && std::is_trivially_copyable_v<T>;

template <emu_word T>
inline uint32_t emu_bits(T value)
{
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    return bits;
}

template <emu_word T>
inline T emu_from_bits(uint32_t bits)
{
    T value;
    std::memcpy(&value, &bits, 4);
    return value;
}

// The value `var` of lane src_lane % 32.
template <emu_word T>
inline T __shfl_sync(unsigned mask, T var, int src_lane)
{
    const uint32_t* lanes = emu_warp_exchange(emu_warp_op::shfl_idx, mask, emu_bits(var));
    return emu_from_bits<T>(lanes[(unsigned)src_lane % 32]);
}

// The value `var` of lane (this lane) ^ lane_mask, or this lane's own value when that lies
// outside the warp (PTX shfl.bfly).
template <emu_word T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask)
{
    const unsigned lane = threadIdx.x % 32;
    const unsigned src = lane ^ (unsigned)lane_mask;
    const uint32_t* lanes = emu_warp_exchange(emu_warp_op::shfl_bfly, mask, emu_bits(var));
    return emu_from_bits<T>(lanes[src < 32 ? src : lane]);
}

// Non-zero when `predicate` is non-zero on any lane.
inline int __any_sync(unsigned mask, int predicate)
{
    const uint32_t* lanes = emu_warp_exchange(emu_warp_op::vote_any, mask, predicate != 0);
    uint32_t any = 0;
    for (unsigned lane = 0; lane < 32; ++lane) {
        any |= lanes[lane];
    }
    return (int)any;
}

// The largest `value` of the 32 lanes (redux.sync.max.u32), on every lane.
inline unsigned __reduce_max_sync(unsigned mask, unsigned value)
{
    const uint32_t* lanes = emu_warp_exchange(emu_warp_op::reduce_max, mask, value);
    uint32_t largest = 0;
    for (unsigned lane = 0; lane < 32; ++lane) {
        largest = lanes[lane] > largest ? lanes[lane] : largest;
    }
    return largest;
}

// Only one lane of one warp runs at a time, so a plain read-modify-write is atomic.
inline unsigned atomicMax(unsigned* address, unsigned value)
{
    const unsigned old = *address;
    *address = value > old ? value : old;
    return old;
}

// ---------------------------------------------------------------------------------------------
// Vector types and the cache-hinted load / store intrinsics (__ldg, __ldcg, __stcs, __stcg),
// for the types the kernels move in one access. As on the GPU, an access must be aligned to
// its size (a vector type's alignment is its size): a misaligned one is reported with the
// kernel, block and thread, and stops the process (exit status 3) like a memory fault. The
// cache hints mean nothing here: every access is a plain host access.

struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};

inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

template <class T>
concept emu_access = std::is_same_v<T, unsigned> || std::is_same_v<T, float> || std::is_same_v<T, uint2> ||
    std::is_same_v<T, uint4> || std::is_same_v<T, float4>;

// Reports a misaligned access of `bytes` bytes at `address` and stops the process.
[[noreturn]] EMU_EXPORT void emu_misaligned(const void* address, size_t bytes);

template <emu_access T>
inline T emu_load(const T* p)
{
    if ((uintptr_t)p % sizeof(T) != 0) {
        emu_misaligned(p, sizeof(T));
    }
    T value;
    std::memcpy(&value, p, sizeof(T));
    return value;
}

template <emu_access T>
inline void emu_store(T* p, T value)
{
    if ((uintptr_t)p % sizeof(T) != 0) {
        emu_misaligned(p, sizeof(T));
    }
    std::memcpy(p, &value, sizeof(T));
}

template <emu_access T>
inline T __ldg(const T* p) { return emu_load(p); }
template <emu_access T>
inline T __ldcg(const T* p) { return emu_load(p); }
template <emu_access T>
inline void __stcs(T* p, T value) { emu_store(p, value); }
template <emu_access T>
inline void __stcg(T* p, T value) { emu_store(p, value); }

// ---------------------------------------------------------------------------------------------
// Arithmetic intrinsics: IEEE binary32 round-to-nearest-even on the host.

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __uint2float_rn(uint32_t a) { return (float)a; }
inline float __uint_as_float(uint32_t bits) { return emu_from_bits<float>(bits); }
inline uint32_t __float_as_uint(float value) { return emu_bits(value); }
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return (uint32_t)(((uint64_t)a * b) >> 32); }
// fma rounds once (glibc's fmaf is exact); the reciprocal is the IEEE quotient 1 / a.
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
// cvt.rmi.s32.f32 / cvt.rni.s32.f32: round down / half to even, saturating to the int32 range,
// NaN to 0.
inline int emu_float_to_int(float rounded)
{
    if (rounded != rounded) {
        return 0;
    }
    if (rounded >= 2147483648.0f) {
        return INT32_MAX;
    }
    if (rounded < -2147483648.0f) {
        return INT32_MIN;
    }
    return (int)rounded;
}
inline int __float2int_rd(float a) { return emu_float_to_int(floorf(a)); }
inline int __float2int_rn(float a) { return emu_float_to_int(rintf(a)); }
// prmt: byte i of the result is byte (selector nibble i & 7) of the 8 bytes y:x (x bytes 0 to 3).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned selector)
{
    const uint64_t bytes = (uint64_t)y << 32 | x;
    unsigned result = 0;
    for (unsigned i = 0; i < 4; ++i) {
        result |= (unsigned)((bytes >> (8 * ((selector >> (4 * i)) & 7))) & 0xff) << (8 * i);
    }
    return result;
}

// ---------------------------------------------------------------------------------------------
// The launch ABI's parameter structs, ahead of every kernel translation unit.

#include "sdp4bit_abi.h"
