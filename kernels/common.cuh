// Device helpers shared by every kernel of this directory: the launch shape and the walk of a
// grid-stride loop, vector memory access, float bits, bf16 conversion, gradient elements and
// warp reductions. The other headers hold one job each: spec.cuh (the compile-time
// configuration a kernel body is instantiated with), philox.cuh (Philox4x32-10 and the
// uniforms), divide.cuh (correctly rounded division by a group's scale), hadamard.cuh (the
// Walsh-Hadamard butterfly of a warp's rows), slab.cuh (slab addressing), quantize.cuh (the group
// quantizer) and decode.cuh (the group dequantizer and the sum over peers).
//
// Every helper reproduces a piece of the CPU reference (src/rng.rs, src/hadamard.rs,
// src/codec/quant.rs, src/codec/slab.rs) bit for bit. Kernels are compiled by NVRTC with
// --fmad=false --prec-div=true --ftz=false; on top of that all quantize / dequantize / sum /
// Hadamard arithmetic uses the explicit round-to-nearest intrinsics (__fadd_rn, __fsub_rn,
// __fmul_rn, __fdiv_rn), which are never contracted into a fused multiply-add. The explicit
// fused multiply-adds (__fmaf_rn) stand only where their single rounding is exactly the
// operation's (docs/numerics.md §1.4): a sum with a sign, t + u, the division's correction.
//
// Specialisation. A kernel is a template body (one per .cu file and kernel family) instantiated
// with a spec (spec.cuh) whose constants are the configuration of one launch: group size, bits,
// symmetric or asymmetric, rounding, Hadamard block, peer batch, groups per warp. The Rust backend
// (src/backend/cuda/spec.rs) writes, per configuration a job uses, one `extern "C"` wrapper with
// the variant's __launch_bounds__ that calls the body with its spec, and compiles it at first use.
// The parameter struct still carries every value at run time; the spec is derived from it, so the
// two always agree. Nothing in a body tests a configuration at run time.
//
// Launch contract of every kernel: blockDim = (T, 1, 1) with T a multiple of 32 (the variant's
// threads per block), any gridDim.x >= 1, no dynamic shared memory, fewer than 2^32 work units
// (the kernels split a unit index into slab, group and peer indices with 32-bit arithmetic).
// Kernels loop grid-stride over their work units, so every grid and block size gives the same
// bytes.
//
// How a warp holds a group. A group of g elements (g a multiple of 32, up to 2^16) is processed
// by one warp in *rows* of 32 E elements: lane L holds the run of E consecutive elements
// [32 E r + E L, 32 E r + E L + E) of row r (E = 4 for the gradient kernels: one 16-byte load of
// fp32 or 8 bytes of bf16; E = 8 for the weight kernels: 16 bytes of bf16). Only a group's last
// row can be partial (g not a multiple of 32 E); a lane whose run lies past the group holds zeros
// there. A warp loads all rows of its groups at once (several groups per warp unit: their loads
// are all issued before any arithmetic) when they fit its registers (spec.cuh's
// SDP_LANE_VALUES_MAX); a longer group is walked in tiles of rows, loaded twice when quantized
// (once for the statistics, once for the codes), which re-reads the group's inputs from cache
// instead of holding up to 2^16 values on chip. A tile never cuts a Hadamard block (blocks are
// powers of two <= 256 dividing g).
//
// Decoding corrupt input (a received slab that no encoder can have produced) cannot report an
// error from a kernel, so it produces NaN instead, which the caller's found-inf / NaN check
// catches: a group whose scale is negative or infinite, whose offset is infinite, or
// (symmetric) that holds the code -2^(b-1), dequantizes to NaN in every element. The CPU
// reference rejects exactly these groups with Error::Decode (codec::slab::SlabView::meta and
// codec::quant::dequantize_group). The check rides along with the decoding (each lane checks
// the codes it decodes, one vote per group), so every code byte is read once.
//
// Alignment: every slab pointer a kernel receives (a buffer start plus a multiple of the slab's
// byte_len) must be 4-byte aligned (slabs are 16-byte multiples and device allocations are
// 256-byte aligned, so this holds for any buffer the host allocates); codes are loaded and
// stored as whole 32- or 64-bit words, scales and offsets as fp32. Element data (fp32
// gradients, bf16 weights, Global-QSGD integers) needs only its type's alignment: a run is
// moved with one 16-byte (or 8-, 4-byte) access when its address is aligned to that width and
// the run is wholly real, element by element otherwise (a shard starting mid-vector, the
// shard's last partial run).
#pragma once

#include "sdp4bit_abi.h"

// An out-of-line device function (the host emulation defines its own).
#ifndef SDP_NOINLINE
#define SDP_NOINLINE __noinline__
#endif

// ---------------------------------------------------------------------------------------------
// Launch shape and work distribution.

#define SDP_WARP_SIZE 32
#define SDP_FULL_MASK 0xffffffffu

// Lane of this thread in its warp.
__device__ __forceinline__ uint32_t sdp_lane()
{
    return threadIdx.x % SDP_WARP_SIZE;
}

// Global index of this thread's warp, and the number of warps in the grid: the grid-stride
// loop over group-sized work units is `for (u = sdp_warp_id(); u < n; u += sdp_warp_count())`.
__device__ __forceinline__ uint64_t sdp_warp_id()
{
    return ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / SDP_WARP_SIZE;
}

__device__ __forceinline__ uint64_t sdp_warp_count()
{
    return (uint64_t)gridDim.x * blockDim.x / SDP_WARP_SIZE;
}

// Global index of this thread, and the number of threads in the grid (element-wise kernels).
__device__ __forceinline__ uint64_t sdp_thread_id()
{
    return (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ uint64_t sdp_thread_count()
{
    return (uint64_t)gridDim.x * blockDim.x;
}

// A warp's walk over the units u < units < 2^32 of a grid-stride loop as mixed-radix digits
// (d[0] the most significant, digit i < radix[i] for i > 0; radix[0] is not used): each step
// adds the warp count as digits, an addition and a carry per digit instead of a division per
// index. The walk starts at the warp's first unit and has passed the last one exactly when
// d[0] >= units / (radix[1] ... radix[N-1]).
template <uint32_t N>
struct sdp_unit_walk {
    uint32_t at[N];
    uint32_t step[N];
};

// `value` as digits of `radix`.
template <uint32_t N>
__device__ __forceinline__ void sdp_digits_of(uint32_t value, const uint32_t (&radix)[N], uint32_t (&d)[N])
{
#pragma unroll
    for (uint32_t i = N - 1; i > 0; --i) {
        d[i] = value % radix[i];
        value /= radix[i];
    }
    d[0] = value;
}

template <uint32_t N>
__device__ __forceinline__ sdp_unit_walk<N> sdp_unit_walk_of(uint32_t units, const uint32_t (&radix)[N])
{
    sdp_unit_walk<N> w;
    if (units == 0) {  // No unit (and a radix may be 0): start past the end.
#pragma unroll
        for (uint32_t i = 0; i < N; ++i) {
            w.at[i] = i == 0 ? 0xffffffffu : 0;
            w.step[i] = 0;
        }
        return w;
    }
    // Clamped to `units`: a warp starting or stepping past the last unit only needs to end
    // past it.
    const uint64_t first = sdp_warp_id() < units ? sdp_warp_id() : units;
    const uint64_t step = sdp_warp_count() < units ? sdp_warp_count() : units;
    sdp_digits_of((uint32_t)first, radix, w.at);
    sdp_digits_of((uint32_t)step, radix, w.step);
    return w;
}

// The next unit of the walk: at += step, digit by digit with carries.
template <uint32_t N>
__device__ __forceinline__ void sdp_unit_walk_next(sdp_unit_walk<N>& w, const uint32_t (&radix)[N])
{
    uint32_t carry = 0;
#pragma unroll
    for (uint32_t i = N - 1; i > 0; --i) {
        w.at[i] += w.step[i] + carry;
        carry = w.at[i] >= radix[i] ? 1 : 0;
        w.at[i] -= carry != 0 ? radix[i] : 0;
    }
    w.at[0] += w.step[0] + carry;
}
// ---------------------------------------------------------------------------------------------
// Vector memory access. Every access wider than an element goes through the CUDA intrinsics
// (__ldg: read-only inputs; __ldcg: data the same kernel also writes, read through L2, which is
// coherent with the kernel's own stores; __stcs: streamed outputs, evicted first), which the
// host emulation checks for their alignment as the GPU faults on it.

// Whether `p` is aligned to `bytes` (a power of two).
__device__ __forceinline__ bool sdp_aligned(const void* p, uint32_t bytes)
{
    return ((unsigned long long)p & (bytes - 1)) == 0;
}

// Four fp32 at p (16-byte aligned), read-only.
__device__ __forceinline__ void sdp_load_f32x4(const float* p, float* x)
{
    const float4 f = __ldg((const float4*)p);
    x[0] = f.x;
    x[1] = f.y;
    x[2] = f.z;
    x[3] = f.w;
}

// Four fp32 to p (16-byte aligned).
__device__ __forceinline__ void sdp_store_f32x4(float* p, const float* x)
{
    __stcs((float4*)p, make_float4(x[0], x[1], x[2], x[3]));
}

// Eight 16-bit values at p (16-byte aligned) as four little-endian words (value 2k in the low
// half of word k); read-only, or through L2 when `coherent` (data the kernel writes too).
__device__ __forceinline__ uint4 sdp_load_u16x8(const uint16_t* p, bool coherent)
{
    return coherent ? __ldcg((const uint4*)p) : __ldg((const uint4*)p);
}

__device__ __forceinline__ void sdp_store_u16x8(uint16_t* p, uint4 words)
{
    __stcg((uint4*)p, words);
}

// Half `h` (0 or 1) of a word.
__device__ __forceinline__ uint16_t sdp_half(uint32_t word, uint32_t h)
{
    return (uint16_t)(word >> (16 * h));
}

// Word k of four.
__device__ __forceinline__ uint32_t sdp_word_of(uint4 w, uint32_t k)
{
    return k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w;
}

// ---------------------------------------------------------------------------------------------
// Float bit helpers.

// The canonical NaN Rust's f32::NAN has (0x7fc00000): what the quantizer stores as the scale
// and offset of a non-finite group, so the slab bytes equal the CPU's.
__device__ __forceinline__ float sdp_nan()
{
    return __uint_as_float(0x7fc00000u);
}

// |x| as bits: 0x7f800000 and above is Inf or NaN (codec::quant::abs_bits_max).
__device__ __forceinline__ uint32_t sdp_abs_bits(float x)
{
    return __float_as_uint(x) & 0x7fffffffu;
}

__device__ __forceinline__ bool sdp_is_finite(float x)
{
    return sdp_abs_bits(x) < 0x7f800000u;
}

__device__ __forceinline__ bool sdp_is_inf(float x)
{
    return sdp_abs_bits(x) == 0x7f800000u;
}

// ---------------------------------------------------------------------------------------------
// bf16 (weight::bf16_to_f32 and weight::bf16_from_f32, which equal the `half` crate).

// bf16 -> f32: a 16-bit shift; a NaN comes out quiet (half's to_f32 sets the quiet bit).
__device__ __forceinline__ float sdp_bf16_to_f32(uint16_t b)
{
    uint32_t bits = b;
    if ((bits & 0x7fffu) > 0x7f80u) {
        bits |= 0x40u;
    }
    return __uint_as_float(bits << 16);
}

// bf16 -> f32 of the halves of a word (element 2k in the low half of word k) without quieting
// a NaN: for values whose NaN payload never reaches an output (the encoder's inputs, where a
// NaN only makes its group non-finite), a single shift or mask each.
__device__ __forceinline__ float sdp_bf16_low_to_f32_raw(uint32_t word)
{
    return __uint_as_float(word << 16);
}

__device__ __forceinline__ float sdp_bf16_high_to_f32_raw(uint32_t word)
{
    return __uint_as_float(word & 0xffff0000u);
}

// f32 -> bf16, round to nearest even: add 0x7fff plus the lowest kept bit, then truncate; a NaN
// keeps its high mantissa bits and comes out quiet.
__device__ __forceinline__ uint16_t sdp_f32_to_bf16(float v)
{
    const uint32_t x = __float_as_uint(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((x >> 16) | 0x40u);
    }
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// f32 -> bf16 of two values packed in a word (lo in the low half), each exactly as
// sdp_f32_to_bf16: the rounding addition leaves the bf16 in the high half of a 32-bit value
// (or, for a NaN, the value with its quiet bit set: 0x00400000 is 0x40 in the high half), and
// one byte permutation takes both high halves.
__device__ __forceinline__ uint32_t sdp_f32x2_to_bf16x2(float lo, float hi)
{
    const float v[2] = {lo, hi};
    uint32_t r[2];
#pragma unroll
    for (uint32_t k = 0; k < 2; ++k) {
        const uint32_t x = __float_as_uint(v[k]);
        r[k] = v[k] != v[k] ? x | 0x00400000u : x + 0x7fffu + ((x >> 16) & 1u);
    }
    return __byte_perm(r[0], r[1], 0x7632);
}

// ---------------------------------------------------------------------------------------------
// Gradient elements (backend::GradElement, docs/numerics.md §7.5): a bucket or shard holds fp32
// or bf16 (sdp_bf16); the passes read each element as its fp32 value (sdp_bf16_to_f32) and
// round what they write to the element type (sdp_f32_to_bf16).

// Whether the run of four elements at p may be read or written at once (4-element aligned).
template <class G>
__device__ __forceinline__ bool sdp_grad_run_aligned(const G* p)
{
    return sdp_aligned(p, 4 * sizeof(G));
}

// Four elements at p (sdp_grad_run_aligned), read-only, as fp32.
__device__ __forceinline__ void sdp_grad_load4(const float* p, float* x)
{
    sdp_load_f32x4(p, x);
}

__device__ __forceinline__ void sdp_grad_load4(const sdp_bf16* p, float* x)
{
    const uint2 w = __ldg((const uint2*)p);
    x[0] = sdp_bf16_to_f32(sdp_half(w.x, 0));
    x[1] = sdp_bf16_to_f32(sdp_half(w.x, 1));
    x[2] = sdp_bf16_to_f32(sdp_half(w.y, 0));
    x[3] = sdp_bf16_to_f32(sdp_half(w.y, 1));
}

// sdp_grad_load4 for values whose NaN payload never reaches an output (a quantizer's inputs,
// where a NaN only makes its group non-finite), in two steps so that the loads of many runs are
// in flight before any is used: sdp_grad_fetch4 issues the load, leaving a bf16 run's two words
// in x[0] and x[1] as they are; sdp_grad_widen4_raw, called once every load is issued, makes
// them the four values (bf16 NaNs keep their payload unquieted, sdp_bf16_low_to_f32_raw; every
// other value converted exactly as sdp_grad_load4 does). For fp32 the fetch is the load and the
// widening nothing.
__device__ __forceinline__ void sdp_grad_fetch4(const float* p, float* x)
{
    sdp_load_f32x4(p, x);
}

__device__ __forceinline__ void sdp_grad_fetch4(const sdp_bf16* p, float* x)
{
    const uint2 w = __ldg((const uint2*)p);
    x[0] = __uint_as_float(w.x);
    x[1] = __uint_as_float(w.y);
}

template <class G>
__device__ __forceinline__ void sdp_grad_widen4_raw(float* x)
{
    if constexpr (sizeof(G) == 2) {
        const uint32_t low = __float_as_uint(x[0]);
        const uint32_t high = __float_as_uint(x[1]);
        x[0] = sdp_bf16_low_to_f32_raw(low);
        x[1] = sdp_bf16_high_to_f32_raw(low);
        x[2] = sdp_bf16_low_to_f32_raw(high);
        x[3] = sdp_bf16_high_to_f32_raw(high);
    }
}

// One element as fp32.
__device__ __forceinline__ float sdp_grad_to_f32(float v)
{
    return v;
}

__device__ __forceinline__ float sdp_grad_to_f32(sdp_bf16 v)
{
    return sdp_bf16_to_f32(v.bits);
}

// Four fp32 values rounded to the element type, to p (sdp_grad_run_aligned).
__device__ __forceinline__ void sdp_grad_store4(float* p, const float* x)
{
    sdp_store_f32x4(p, x);
}

__device__ __forceinline__ void sdp_grad_store4(sdp_bf16* p, const float* x)
{
    __stcs((uint2*)p, make_uint2(sdp_f32x2_to_bf16x2(x[0], x[1]), sdp_f32x2_to_bf16x2(x[2], x[3])));
}

// One fp32 value rounded to the element type, to p.
__device__ __forceinline__ void sdp_grad_store1(float* p, float v)
{
    *p = v;
}

__device__ __forceinline__ void sdp_grad_store1(sdp_bf16* p, float v)
{
    p->bits = sdp_f32_to_bf16(v);
}
// ---------------------------------------------------------------------------------------------
// Warp reductions (every lane gets the result; all 32 lanes must call them together).

// The unsigned maximum: one warp-wide reduction instruction (redux.sync, sm_80 and newer; the
// host emulation has it too) instead of five shuffles and maxima, which older devices (sm_75)
// keep.
__device__ __forceinline__ uint32_t sdp_warp_max_u32(uint32_t v)
{
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    return __reduce_max_sync(SDP_FULL_MASK, v);
#else
    for (uint32_t m = SDP_WARP_SIZE / 2; m > 0; m /= 2) {
        const uint32_t other = __shfl_xor_sync(SDP_FULL_MASK, v, m);
        v = other > v ? other : v;
    }
    return v;
#endif
}

// Min and max of finite values (the only ones the quantizer's min-max path uses).
__device__ __forceinline__ float sdp_warp_min(float v)
{
    for (uint32_t m = SDP_WARP_SIZE / 2; m > 0; m /= 2) {
        v = fminf(v, __shfl_xor_sync(SDP_FULL_MASK, v, m));
    }
    return v;
}

__device__ __forceinline__ float sdp_warp_max(float v)
{
    for (uint32_t m = SDP_WARP_SIZE / 2; m > 0; m /= 2) {
        v = fmaxf(v, __shfl_xor_sync(SDP_FULL_MASK, v, m));
    }
    return v;
}
