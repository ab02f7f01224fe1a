// Device helpers shared by every kernel of this directory: the launch shape, vector memory
// access, Philox4x32-10 and the uniforms of a lane's elements, bf16 conversion, warp
// reductions, the group quantizer and dequantizer, code packing, slab addressing and the
// Walsh-Hadamard butterfly.
//
// Every helper reproduces a piece of the CPU reference (src/rng.rs, src/hadamard.rs,
// src/codec/quant.rs, src/codec/slab.rs) bit for bit. Kernels are compiled by NVRTC with
// --fmad=false --prec-div=true --ftz=false; on top of that all quantize / dequantize / sum /
// Hadamard arithmetic uses the explicit round-to-nearest intrinsics (__fadd_rn, __fsub_rn,
// __fmul_rn, __fdiv_rn), which are never contracted into a fused multiply-add. The explicit
// fused multiply-adds (__fmaf_rn) stand only where their single rounding is exactly the
// operation's (docs/numerics.md §1.4): a sum with a sign, t + u, the division's correction.
//
// Launch contract of every kernel: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic
// shared memory, fewer than 2^32 work units (the kernels split a unit index into slab, group
// and peer indices with 32-bit arithmetic). Kernels loop grid-stride over their work units, so
// every grid size gives the same bytes.
//
// How a warp walks a group. A group of g elements (g a multiple of 32, up to 2^16) is processed
// by one warp in *tiles* of up to 256 elements. Each lane holds *runs* of E consecutive
// elements (E = 4 for the gradient kernels: one 16-byte load or store of fp32; E = 8 for the
// weight kernels: 16 bytes of bf16): a tile is 256 / (32 E) rows of 32 E elements, and lane L
// holds elements [32 E r + E L, 32 E r + E L + E) of row r of the tile in its registers v[E r
// .. E r + E). A run lies wholly inside the group or wholly outside it (g is a multiple of 32),
// so a lane whose run is past the end of the group (a group whose size is not a multiple of 32
// E) just idles for that run. A tile is never cut inside a Hadamard block (blocks are powers of
// two <= 256 dividing g), so the butterfly runs tile by tile. Quantizing needs the group's
// absmax (or min and max) before the first code: a group of one tile (g <= 256) is loaded once,
// a longer group is loaded twice (once for the statistics, once for the codes), which re-reads
// the group's inputs from cache instead of holding up to 2^16 values on chip.
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

#define SDP_BLOCK_THREADS 256
#define SDP_WARP_SIZE 32
#define SDP_FULL_MASK 0xffffffffu
// Elements of one tile, and values of a tile one lane holds (its runs, back to back).
#define SDP_TILE 256
#define SDP_LANE_VALUES (SDP_TILE / SDP_WARP_SIZE)

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
// where a NaN only makes its group non-finite): bf16 NaNs keep their payload unquieted
// (sdp_bf16_low_to_f32_raw), every other value is converted exactly as sdp_grad_load4 does.
__device__ __forceinline__ void sdp_grad_load4_raw(const float* p, float* x)
{
    sdp_load_f32x4(p, x);
}

__device__ __forceinline__ void sdp_grad_load4_raw(const sdp_bf16* p, float* x)
{
    const uint2 w = __ldg((const uint2*)p);
    x[0] = sdp_bf16_low_to_f32_raw(w.x);
    x[1] = sdp_bf16_high_to_f32_raw(w.x);
    x[2] = sdp_bf16_low_to_f32_raw(w.y);
    x[3] = sdp_bf16_high_to_f32_raw(w.y);
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
// Philox4x32-10 (rng::philox4x32_10) and the uniform of element i (rng::UniformStream).

#define SDP_PHILOX_M0 0xD2511F53u
#define SDP_PHILOX_M1 0xCD9E8D57u
#define SDP_PHILOX_W0 0x9E3779B9u
#define SDP_PHILOX_W1 0xBB67AE85u

// The four words of one Philox4x32-10 block.
struct sdp_philox_block {
    uint32_t w0, w1, w2, w3;
};

// Philox4x32-10 of counter (block low, block high, step, stream) under key (key_lo, key_hi):
// ten rounds of the Random123 reference algorithm. Random123's known-answer vector: counter
// {0, 0, 0, 0}, key {0, 0} -> {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}.
__device__ __forceinline__ sdp_philox_block sdp_philox(const sdp_rng& rng, uint64_t block)
{
    uint32_t c0 = (uint32_t)block;
    uint32_t c1 = (uint32_t)(block >> 32);
    uint32_t c2 = rng.step;
    uint32_t c3 = rng.stream;
    uint32_t k0 = rng.key_lo;
    uint32_t k1 = rng.key_hi;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += SDP_PHILOX_W0;
            k1 += SDP_PHILOX_W1;
        }
        const uint32_t hi0 = __umulhi(SDP_PHILOX_M0, c0);
        const uint32_t lo0 = SDP_PHILOX_M0 * c0;
        const uint32_t hi1 = __umulhi(SDP_PHILOX_M1, c2);
        const uint32_t lo1 = SDP_PHILOX_M1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    sdp_philox_block b;
    b.w0 = c0;
    b.w1 = c1;
    b.w2 = c2;
    b.w3 = c3;
    return b;
}

// u = (word >> 8) * 2^-24: exact in fp32, in [0, 1) (rng::word_to_uniform).
__device__ __forceinline__ float sdp_word_to_uniform(uint32_t word)
{
    return __fmul_rn(__uint2float_rn(word >> 8), 1.0f / 16777216.0f);
}

// The uniforms of the 4 consecutive elements whose Philox indices start at `first`, a multiple
// of 4 (every group and run starts at one: shards, chunks and groups are multiples of 32, and
// the launches check the index they are given), into u[0 .. 4): the four words of one block.
__device__ __forceinline__ void sdp_uniforms4(const sdp_rng& rng, uint64_t first, float* u)
{
    const sdp_philox_block b = sdp_philox(rng, first / 4);
    u[0] = sdp_word_to_uniform(b.w0);
    u[1] = sdp_word_to_uniform(b.w1);
    u[2] = sdp_word_to_uniform(b.w2);
    u[3] = sdp_word_to_uniform(b.w3);
}

// The four Philox words of the 4 consecutive elements whose Philox indices start at `first`
// (a multiple of 4, as for sdp_uniforms4), into w[0 .. 4).
__device__ __forceinline__ void sdp_words4(const sdp_rng& rng, uint64_t first, uint32_t* w)
{
    const sdp_philox_block b = sdp_philox(rng, first / 4);
    w[0] = b.w0;
    w[1] = b.w1;
    w[2] = b.w2;
    w[3] = b.w3;
}

// t + u, u = sdp_word_to_uniform(word), as one fused multiply-add: word & ~0xff is u * 2^32
// exactly (at most 24 significant bits), so fma(u * 2^32, 2^-32, t) rounds the exact sum t + u
// once, which is __fadd_rn(t, sdp_word_to_uniform(word)) bit for bit (signed zeros included:
// u = +0 and t = -0 give +0 both ways).
__device__ __forceinline__ float sdp_add_uniform(float t, uint32_t word)
{
    return __fmaf_rn(__uint2float_rn(word & 0xffffff00u), 1.0f / 4294967296.0f, t);
}

// ---------------------------------------------------------------------------------------------
// Division by a scale fixed for many quotients.

// Correctly rounded fp32 division x / s for many x by one s (docs/numerics.md §1.4), as a
// multiply and two fused multiply-adds instead of a division per quotient: with y = RN(1 / s)
// (once per divisor), q0 = RN(x y) and the exact residual r = fma(-q0, s, x),
// q1 = fma(r, y, q0) is RN(x / s) (Markstein's theorem) as long as no step leaves the normal
// range. That is guaranteed for 2^-40 <= |s| < 2^40 and 2^-60 <= |x| < 2^60: the quotient, y
// and x y stay within (2^-100, 2^100), and r is 0 or a multiple of 2^-107 (so exact and never
// subnormal). A divisor is set up with a bound on the |x| it will divide (the group's absmax,
// or max - min), so that the upper limit is checked once per divisor and only the lower one
// per quotient. Every other x or s (zeros, subnormals, huge values, Inf, NaN) takes the plain
// IEEE division. The identity with `/` is checked by tests/cuda_emulated/divide.rs on every
// edge case and 570 million quotients in all.
struct sdp_divisor {
    float s;
    float inverse;
    bool fast;
};

// The divisor s for dividends |x| <= bound (NaN bound: any x).
__device__ __forceinline__ sdp_divisor sdp_divisor_of(float s, float bound)
{
    sdp_divisor d;
    d.s = s;
    d.inverse = __frcp_rn(s);
    const float a = fabsf(s);
    d.fast = a >= 0x1p-40f && a < 0x1p40f && bound < 0x1p60f;
    return d;
}

// The divisor s for dividends without a known bound: sdp_divide_run<N, true> checks both limits
// of |x| per quotient.
__device__ __forceinline__ sdp_divisor sdp_divisor_unbounded(float s)
{
    sdp_divisor d;
    d.s = s;
    d.inverse = __frcp_rn(s);
    const float a = fabsf(s);
    d.fast = a >= 0x1p-40f && a < 0x1p40f;
    return d;
}

// Whether x meets the fast path's per-quotient condition (a NaN does not): the lower limit of
// |x|, and the upper one too for a divisor without a bound (sdp_divisor_unbounded).
template <bool Unbounded>
__device__ __forceinline__ bool sdp_divide_fast(float x)
{
    return fabsf(x) >= 0x1p-60f && (!Unbounded || fabsf(x) < 0x1p60f);
}

// The fast path: RN(x / s) when d.fast and sdp_divide_fast(x).
__device__ __forceinline__ float sdp_divide_markstein(const sdp_divisor& d, float x)
{
    const float q0 = __fmul_rn(x, d.inverse);
    const float r = __fmaf_rn(-q0, d.s, x);
    return __fmaf_rn(r, d.inverse, q0);
}

// The plain division of four values, out of line: the rarely taken path costs a call per four
// values in the loops, not a division sequence per value.
static __device__ SDP_NOINLINE float4 sdp_divide_plain4(float4 x, float s)
{
    return make_float4(__fdiv_rn(x.x, s), __fdiv_rn(x.y, s), __fdiv_rn(x.z, s), __fdiv_rn(x.w, s));
}

// q[i] = RN(x[i] / s) for the N values of x (N a multiple of 4): the fast path, redone with the
// plain division unless its conditions hold for all of them (one branch per run, no path to
// duplicate code into). `Unbounded` for a divisor of sdp_divisor_unbounded.
template <uint32_t N, bool Unbounded = false>
__device__ __forceinline__ void sdp_divide_run(const sdp_divisor& d, const float* x, float* q)
{
    static_assert(N % 4 == 0, "runs of 4 values");
    bool fast = d.fast;
#pragma unroll
    for (uint32_t i = 0; i < N; ++i) {
        fast = fast && sdp_divide_fast<Unbounded>(x[i]);
    }
#pragma unroll
    for (uint32_t i = 0; i < N; ++i) {
        q[i] = sdp_divide_markstein(d, x[i]);
    }
    if (!fast) {  // Cold path: a run outside the fast path's range.
#pragma unroll
        for (uint32_t i = 0; i < N; i += 4) {
            const float4 plain = sdp_divide_plain4(make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]), d.s);
            q[i] = plain.x;
            q[i + 1] = plain.y;
            q[i + 2] = plain.z;
            q[i + 3] = plain.w;
        }
    }
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

// ---------------------------------------------------------------------------------------------
// Tiles of a group, lanes of E consecutive elements (see the header comment).

// Tiles of a group of g elements.
__device__ __forceinline__ uint32_t sdp_tiles(uint32_t g)
{
    return (g + SDP_TILE - 1) / SDP_TILE;
}

// Index in the group of value i (0 .. 7) this lane holds in tile t.
template <uint32_t E>
__device__ __forceinline__ uint32_t sdp_tile_element(uint32_t t, uint32_t i, uint32_t lane)
{
    return t * SDP_TILE + (i / E) * (SDP_WARP_SIZE * E) + lane * E + i % E;
}

// Runs per lane in tile t of a group of g elements that lie inside the group for some lane:
// 256 / (32 E), fewer in the last tile of a group whose size is not a multiple of 256. The
// same on every lane, so code that shuffles may skip the absent runs.
template <uint32_t E>
__device__ __forceinline__ uint32_t sdp_tile_runs(uint32_t g, uint32_t t)
{
    const uint32_t runs = (g - t * SDP_TILE + SDP_WARP_SIZE * E - 1) / (SDP_WARP_SIZE * E);
    return runs < SDP_LANE_VALUES / E ? runs : SDP_LANE_VALUES / E;
}

// Whether run r of this lane in tile t lies inside a group of g elements.
template <uint32_t E>
__device__ __forceinline__ bool sdp_run_in_group(uint32_t g, uint32_t t, uint32_t r, uint32_t lane)
{
    return sdp_tile_element<E>(t, r * E, lane) < g;
}

// ---------------------------------------------------------------------------------------------
// Walsh-Hadamard butterfly of a tile of lanes of 4 fp32 (hadamard::forward / hadamard::inverse).
//
// Stages h = 1, 2, 4, ..., block / 2 in order; at each stage the pair (x[j], x[j + h]) with
// bit h of j clear becomes (a + b, a - b), a = x[j], b = x[j + h]. h = 1, 2 pair values of one
// run (registers of the lane), h = 4 .. 64 the runs of lanes L and L ^ (h / 4) (one shuffle per
// value), h = 128 the two runs of the lane. Lanes whose runs lie past the group hold zeros and
// take part in the shuffles; a block never mixes them with real runs.

// One stage at distance h = 4 .. 64 on the first `runs` runs.
__device__ __forceinline__ void sdp_hadamard_lane_stage(float (&v)[SDP_LANE_VALUES], uint32_t runs, uint32_t h,
                                                        uint32_t lane)
{
    const uint32_t partner = h / 4;
    // Lower lane: a = own, b = other -> a + b; upper lane: a = other, b = own -> a - b, which
    // IEEE defines as a + (-b): the upper lane adds its negated value. fma(own, +-1, other)
    // rounds the exact +-own + other once, which is that sum, in one instruction.
    const float sign = (lane & partner) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (uint32_t i = 0; i < SDP_LANE_VALUES; ++i) {
        if (i < 4 * runs) {
            const float other = __shfl_xor_sync(SDP_FULL_MASK, v[i], partner);
            v[i] = __fmaf_rn(v[i], sign, other);
        }
    }
}

// One stage at distance h = 1, 2 (inside a run) or 128 (between the runs): the pairs (i, i + d)
// of register indices with bit d of i clear, on the first `runs` runs.
template <uint32_t D>
__device__ __forceinline__ void sdp_hadamard_register_stage(float (&v)[SDP_LANE_VALUES], uint32_t runs)
{
#pragma unroll
    for (uint32_t i = 0; i < SDP_LANE_VALUES; ++i) {
        if ((i & D) == 0 && i + D < 4 * runs) {
            const float a = v[i];
            const float b = v[i + D];
            v[i] = __fadd_rn(a, b);
            v[i + D] = __fsub_rn(a, b);
        }
    }
}

// The unnormalised butterfly of every `block`-sized block of tile t of a group of g elements
// (block: 16 .. 256, dividing g). All 32 lanes must call it together.
__device__ __forceinline__ void sdp_hadamard_forward(float (&v)[SDP_LANE_VALUES], uint32_t g, uint32_t t,
                                                     uint32_t block, uint32_t lane)
{
    const uint32_t runs = sdp_tile_runs<4>(g, t);
    sdp_hadamard_register_stage<1>(v, runs);
    sdp_hadamard_register_stage<2>(v, runs);
    for (uint32_t h = 4; h < block && h < 128; h *= 2) {
        sdp_hadamard_lane_stage(v, runs, h, lane);
    }
    if (block > 128) {
        sdp_hadamard_register_stage<4>(v, runs);
    }
}

// 1 / p for a power of two p = 2^n (n < 32), exact: made from the bits of p, whose exponent
// field 127 + n becomes 127 - n (the bits subtracted from 254 << 23), the IEEE quotient 1 / p
// without a division.
__device__ __forceinline__ float sdp_power_of_two_inverse(uint32_t p)
{
    return __uint_as_float(0x7f000000u - __float_as_uint((float)p));
}

// The inverse: the same butterfly, then every element times 1 / block (exact: a power of two).
__device__ __forceinline__ void sdp_hadamard_inverse(float (&v)[SDP_LANE_VALUES], uint32_t g, uint32_t t,
                                                     uint32_t block, uint32_t lane)
{
    sdp_hadamard_forward(v, g, t, block, lane);
    const float scale = sdp_power_of_two_inverse(block);
#pragma unroll
    for (uint32_t i = 0; i < SDP_LANE_VALUES; ++i) {
        v[i] = __fmul_rn(v[i], scale);
    }
}

// ---------------------------------------------------------------------------------------------
// Slab addressing (codec::slab::SlabLayout): [codes of G groups][G scales][G offsets if
// asymmetric][zero padding to 16 bytes].

// Largest code: L = 2^(b-1) - 1 symmetric, 2^b - 1 asymmetric (QuantSpec::max_code).
__device__ __forceinline__ int32_t sdp_max_code(const sdp_quant& q)
{
    return q.symmetric ? (1 << (q.bits - 1)) - 1 : (1 << q.bits) - 1;
}

// Bytes of codes of one group.
__device__ __forceinline__ uint64_t sdp_code_bytes(const sdp_quant& q)
{
    return (uint64_t)q.group_size * q.bits / 8;
}

// Slab `s` of a buffer of equal slabs.
__device__ __forceinline__ uint8_t* sdp_slab_at(uint8_t* buffer, const sdp_slab& layout, uint64_t s)
{
    return buffer + s * layout.byte_len;
}

__device__ __forceinline__ const uint8_t* sdp_slab_at(const uint8_t* buffer, const sdp_slab& layout,
                                                     uint64_t s)
{
    return buffer + s * layout.byte_len;
}

// Byte offsets inside a slab: the codes of group k, its scale, its offset (asymmetric only),
// and the end of the metadata (where the zero padding starts).
__device__ __forceinline__ uint64_t sdp_codes_offset(const sdp_slab& layout, uint64_t k)
{
    return k * sdp_code_bytes(layout.quant);
}

__device__ __forceinline__ uint64_t sdp_scale_offset(const sdp_slab& layout, uint64_t k)
{
    return layout.groups * sdp_code_bytes(layout.quant) + 4 * k;
}

__device__ __forceinline__ uint64_t sdp_offset_offset(const sdp_slab& layout, uint64_t k)
{
    return sdp_scale_offset(layout, layout.groups) + 4 * k;
}

__device__ __forceinline__ uint64_t sdp_meta_end(const sdp_slab& layout)
{
    const uint64_t words = layout.quant.symmetric ? 1 : 2;
    return sdp_scale_offset(layout, 0) + 4 * words * layout.groups;
}

// Zeroes the padding at the end of a slab being written (fewer than 16 bytes).
__device__ __forceinline__ void sdp_zero_slab_padding(uint8_t* slab, const sdp_slab& layout,
                                                      uint32_t lane)
{
    uint8_t* padding = slab + sdp_meta_end(layout);
    if (lane < (uint32_t)(slab + layout.byte_len - padding)) {
        padding[lane] = 0;
    }
}

// Zeroes the padding of the `slabs` slabs of `buffer` being written, a slab per warp of the
// grid: a kernel calls it after its loop over groups (the bytes are disjoint from the groups'),
// so that the loop does not test for each slab's first group. All 32 lanes must call it
// together.
__device__ __forceinline__ void sdp_zero_slabs_padding(uint8_t* buffer, const sdp_slab& layout, uint64_t slabs,
                                                       uint32_t lane)
{
    for (uint64_t s = sdp_warp_id(); s < slabs; s += sdp_warp_count()) {
        sdp_zero_slab_padding(sdp_slab_at(buffer, layout, s), layout, lane);
    }
}

// ---------------------------------------------------------------------------------------------
// Group quantizer (codec::quant::quantize_group).

// Statistics of a group gathered tile by tile: max |x| as bits, min and max (min-max codecs
// only).
struct sdp_group_stats {
    uint32_t abs_bits;
    float lo;
    float hi;
};

__device__ __forceinline__ sdp_group_stats sdp_stats_empty()
{
    sdp_group_stats s;
    s.abs_bits = 0;
    s.lo = __uint_as_float(0x7f800000u);  // +Inf
    s.hi = __uint_as_float(0xff800000u);  // -Inf
    return s;
}

// Folds this lane's values of tile t of a group of g elements into its statistics.
template <uint32_t E>
__device__ __forceinline__ void sdp_stats_add(sdp_group_stats& s, const sdp_quant& q,
                                              const float (&v)[SDP_LANE_VALUES], uint32_t t, uint32_t lane)
{
#pragma unroll
    for (uint32_t i = 0; i < SDP_LANE_VALUES; ++i) {
        if (sdp_run_in_group<E>(q.group_size, t, i / E, lane)) {
            const uint32_t bits = sdp_abs_bits(v[i]);
            s.abs_bits = bits > s.abs_bits ? bits : s.abs_bits;
            if (!q.symmetric) {
                s.lo = fminf(s.lo, v[i]);
                s.hi = fmaxf(s.hi, v[i]);
            }
        }
    }
}

// Combines the statistics of all lanes (every lane gets the group's): the absmax, and min and
// max for min-max codecs only.
__device__ __forceinline__ sdp_group_stats sdp_stats_reduce(const sdp_quant& q, sdp_group_stats s)
{
    s.abs_bits = sdp_warp_max_u32(s.abs_bits);
    if (!q.symmetric) {
        s.lo = sdp_warp_min(s.lo);
        s.hi = sdp_warp_max(s.hi);
    }
    return s;
}

// Scale and offset of a group (GroupMeta), whether its codes are computed (`coded`; false:
// every code is 0) and the divisor of its values: the scale for a coded group, NaN otherwise.
struct sdp_group_meta {
    float scale;
    float offset;
    bool coded;
    sdp_divisor divisor;
};

// The divisor of a group that is not coded: NaN, so that every quotient is NaN and its code 0
// (sdp_code_of), as the group's codes must be.
__device__ __forceinline__ sdp_divisor sdp_divisor_uncoded()
{
    return sdp_divisor_of(sdp_nan(), sdp_nan());
}

// A non-finite group: scale and offset NaN, codes 0 (quant::non_finite_meta).
__device__ __forceinline__ sdp_group_meta sdp_meta_non_finite()
{
    sdp_group_meta m;
    m.scale = sdp_nan();
    m.offset = sdp_nan();
    m.coded = false;
    m.divisor = sdp_divisor_uncoded();
    return m;
}

// quant::symmetric_meta / quant::asymmetric_meta from the group's statistics, for any group, out
// of line (sdp_meta_of takes it for min-max codecs and for absmax outside its fast range). The min-max
// path is only reached when every value is finite, so fminf / fmaxf see no NaN; which zero
// they return for a group holding +0 and -0 does not matter because `+ 0.0` canonicalises -0
// to +0.
static __device__ SDP_NOINLINE sdp_group_meta sdp_meta_general(const sdp_quant& q, const sdp_group_stats& s)
{
    if (s.abs_bits >= 0x7f800000u) {
        return sdp_meta_non_finite();
    }
    const float top = (float)sdp_max_code(q);
    sdp_group_meta m;
    // The largest dividend of the group's codes: |x| <= absmax (symmetric) or
    // x - min <= max - min (min-max; rounding is monotonic).
    float range;
    if (q.symmetric) {
        range = __uint_as_float(s.abs_bits);
        m.scale = __fdiv_rn(range, top);
        m.offset = 0.0f;
        if (!sdp_is_finite(__fmul_rn(m.scale, top))) {
            // absmax at the top of fp32's range: the largest code would decode to Inf.
            return sdp_meta_non_finite();
        }
    } else {
        const float lo = __fadd_rn(s.lo, 0.0f);
        const float hi = __fadd_rn(s.hi, 0.0f);
        range = __fsub_rn(hi, lo);
        m.scale = __fdiv_rn(range, top);
        m.offset = lo;
        if (!sdp_is_finite(m.scale)) {
            return sdp_meta_non_finite();
        }
    }
    m.coded = m.scale != 0.0f;
    m.divisor = m.coded ? sdp_divisor_of(m.scale, range) : sdp_divisor_uncoded();
    return m;
}

// RN(1 / L) for the largest code L of a 4- or 8-bit quantizer (sdp_max_code), 0 for any other
// L: sdp_meta_of's `top_inverse`, which a kernel computes once, before its loop over groups.
__device__ __forceinline__ float sdp_max_code_inverse(int32_t top)
{
    return top == 7     ? __uint_as_float(0x3e124925u)
           : top == 15  ? __uint_as_float(0x3d888889u)
           : top == 127 ? __uint_as_float(0x3c010204u)
           : top == 255 ? __uint_as_float(0x3b808081u)
                        : 0.0f;
}

// sdp_meta_of's fast range of a symmetric group's absmax a: [2^-24, 2^40) (the bits of 2^-24 and
// 2^40).
#define SDP_META_FAST_LOW 0x33800000u
#define SDP_META_FAST_HIGH 0x53800000u

// sdp_meta_general, with the common case inline: for a symmetric group of 4- or 8-bit codes
// (`top_inverse` = sdp_max_code_inverse(L), not 0) whose absmax a lies in [2^-24, 2^40), the
// scale s = RN(a / L) is Markstein's quotient by the divisor L (the largest code, 1 <= L < 2^16,
// and a meet sdp_divisor's conditions, so it is the IEEE division's, docs/numerics.md §1.4). Then 2^-40 < a / L <= a < 2^40 puts s in [2^-40, 2^40): nonzero
// (coded), L s finite (the non-finite checks cannot fire), and s a fast divisor for the
// group's |x| <= a (sdp_divisor_of's conditions). Bit for bit what sdp_meta_general returns.
__device__ __forceinline__ sdp_group_meta sdp_meta_of(const sdp_quant& q, float top_inverse,
                                                     const sdp_group_stats& s)
{
    sdp_divisor by_top;
    by_top.s = (float)sdp_max_code(q);
    by_top.inverse = top_inverse;
    by_top.fast = true;
    if (!q.symmetric || by_top.inverse == 0.0f ||
        s.abs_bits - SDP_META_FAST_LOW >= SDP_META_FAST_HIGH - SDP_META_FAST_LOW) {
        // Cold path: min-max codecs, other code widths, and groups with absmax outside the
        // fast range (zero, tiny, huge, Inf or NaN).
        return sdp_meta_general(q, s);
    }
    sdp_group_meta m;
    m.scale = sdp_divide_markstein(by_top, __uint_as_float(s.abs_bits));
    m.offset = 0.0f;
    m.coded = true;
    m.divisor.s = m.scale;
    m.divisor.inverse = __frcp_rn(m.scale);
    m.divisor.fast = true;
    return m;
}

// R(t) clamped to the integers [bottom, top], where R(v) = floor(v + u) (stochastic, u from the
// Philox word `word`, sdp_add_uniform) or round half to even, and a NaN gives 0. The rounding
// converts straight to an integer (cvt.rmi / cvt.rni: saturating, NaN to 0) and clamps the
// integer, which equals rounding, clamping and converting in fp32 for every value, NaN and Inf
// included (bottom <= 0 <= top).
__device__ __forceinline__ int32_t sdp_round_clamp(bool stochastic, float t, uint32_t word, int32_t bottom,
                                                   int32_t top)
{
    const int32_t rounded = stochastic ? __float2int_rd(sdp_add_uniform(t, word)) : __float2int_rn(t);
    const int32_t low = rounded > bottom ? rounded : bottom;
    return low < top ? low : top;
}

// The code of x in a coded group: R(x / s) (symmetric) or R((x - lo) / s) (asymmetric),
// sdp_round_clamp to [-L, L] or [0, 2^b - 1] (sdp_store_codes keeps its b bits). A NaN code
// becomes 0 (quant::code_bits; never for a coded group), which gives a group that is not coded
// its codes 0: its divisor is NaN (sdp_divisor_uncoded). `t` is the quotient x / s or
// (x - lo) / s (sdp_quotients).
__device__ __forceinline__ int32_t sdp_code_of(const sdp_quant& q, float t, uint32_t word)
{
    const int32_t top = sdp_max_code(q);
    return sdp_round_clamp(q.stochastic, t, word, q.symmetric ? -top : 0, top);
}

// Stores the codes of this lane's run r of tile t (packed little-endian, b bits each: element
// 2k in the low nibble of byte k, or one byte per element) at their place in the group's
// `codes`, as whole words. `c` holds the clamped codes as integers (sdp_code_of), 0 for a run
// not coded. Packing is one multiply-add per code: a symmetric code c in [-L, L] is stored as
// its low b bits, which are those of c + 2^(b-1) (in [1, 2^b - 1]: no carry between fields)
// with the top bit flipped, so the word is (sum of c_k 2^(bk) + sum of 2^(b-1) 2^(bk)) with
// every field's top bit flipped; unsigned codes are below 2^b already. For E = 4 and 4-bit
// codes a run is half a word: lanes 2k and 2k + 1 pair up with one shuffle and lane 2k stores
// the word. All 32 lanes must call it together (with `valid` false for a run past the group).
template <uint32_t E>
__device__ __forceinline__ void sdp_store_codes(uint8_t* codes, const sdp_quant& q, uint32_t t, uint32_t r,
                                                const int32_t (&c)[SDP_LANE_VALUES], bool valid, uint32_t lane)
{
    const uint32_t bits = q.bits;
    // The top bit of every field of a word (the low 16 bits only for a half word).
    const uint32_t tops = !q.symmetric    ? 0u
                          : bits == 8     ? 0x80808080u
                          : E == 4        ? 0x8888u
                                          : 0x88888888u;
    uint32_t lo = tops;
    uint32_t hi = tops;
#pragma unroll
    for (uint32_t k = 0; k < E; ++k) {
        const uint32_t code = (uint32_t)c[r * E + k];
        if (bits == 4) {
            lo += code << (4 * k);
        } else if (k < 4) {
            lo += code << (8 * k);
        } else {
            hi += code << (8 * (k - 4));
        }
    }
    lo ^= tops;
    hi ^= tops;
    uint8_t* run = codes + (uint64_t)sdp_tile_element<E>(t, r * E, lane) * bits / 8;
    if (E == 4 && bits == 4) {
        // 16 bits per lane: the odd lane's half goes to the even lane's high half.
        const uint32_t odd = __shfl_xor_sync(SDP_FULL_MASK, lo, 1);
        if (valid && lane % 2 == 0) {
            __stcs((unsigned int*)run, lo | (odd << 16));
        }
    } else if (valid) {
        if (E == 8 && bits == 8) {
            __stcs((uint2*)run, make_uint2(lo, hi));
        } else {
            __stcs((unsigned int*)run, lo);
        }
    }
}

// Quantizes one group with the whole warp into `codes` (the group's code bytes), `scale` and
// `offset` (null for symmetric slabs), lanes holding runs of E elements; `top_inverse` is
// sdp_max_code_inverse(sdp_max_code(q)), computed by the caller once. `load(t, v)` fills
// this lane's values of tile t (zeros for runs past the group) and is called by all 32 lanes
// together; it may be called twice per tile. `rng` gives the uniform of element e at
// `first_index + e` (stochastic rounding only; drawn for every run, and a group that
// is not coded divides by NaN, so its codes are 0 whatever the uniforms, without a branch).
template <uint32_t E, class Load>
__device__ __forceinline__ void sdp_quantize_group(const sdp_quant& q, float top_inverse, Load& load, const sdp_rng& rng,
                                                   uint64_t first_index, uint8_t* codes, float* scale,
                                                   float* offset, uint32_t lane)
{
    const uint32_t g = q.group_size;
    const uint32_t tiles = sdp_tiles(g);
    float v[SDP_LANE_VALUES];

    sdp_group_stats stats = sdp_stats_empty();
    for (uint32_t t = 0; t < tiles; ++t) {
        load(t, v);
        sdp_stats_add<E>(stats, q, v, t, lane);
    }
    const sdp_group_meta meta = sdp_meta_of(q, top_inverse, sdp_stats_reduce(q, stats));

    for (uint32_t t = 0; t < tiles; ++t) {
        // A one-tile group still holds its values from the statistics pass.
        if (meta.coded && tiles > 1) {
            load(t, v);
        }
        int32_t c[SDP_LANE_VALUES];
        const uint32_t runs = sdp_tile_runs<E>(g, t);
#pragma unroll
        for (uint32_t r = 0; r < SDP_LANE_VALUES / E; ++r) {
            if (r >= runs) {
                break;
            }
            const bool valid = sdp_run_in_group<E>(g, t, r, lane);
            float quotient[E];
            if (valid) {
                float x[E];
#pragma unroll
                for (uint32_t k = 0; k < E; ++k) {
                    x[k] = q.symmetric ? v[r * E + k] : __fsub_rn(v[r * E + k], meta.offset);
                }
                sdp_divide_run<E>(meta.divisor, x, quotient);
            }
            // The Philox words after the quotients: fewer values live at once. Drawn for every
            // run (pure arithmetic): no branch around them.
            uint32_t w[E];
#pragma unroll
            for (uint32_t k = 0; k < E; k += 4) {
                if (q.stochastic) {
                    sdp_words4(rng, first_index + sdp_tile_element<E>(t, r * E + k, lane), w + k);
                } else {
                    w[k] = w[k + 1] = w[k + 2] = w[k + 3] = 0;
                }
            }
#pragma unroll
            for (uint32_t k = 0; k < E; ++k) {
                c[r * E + k] = valid ? sdp_code_of(q, quotient[k], w[k]) : 0;
            }
            sdp_store_codes<E>(codes, q, t, r, c, valid, lane);
        }
    }

    if (lane == 0) {
        *scale = meta.scale;
        if (offset != nullptr) {
            *offset = meta.offset;
        }
    }
}

// Quantizes group k of a slab being written (codes, scale, offset at their slab positions; the
// slab's padding is zeroed by sdp_zero_slabs_padding); `top_inverse` as for sdp_quantize_group.
template <uint32_t E, class Load>
__device__ __forceinline__ void sdp_quantize_slab_group(uint8_t* slab, const sdp_slab& layout, float top_inverse,
                                                        uint64_t k, Load& load, const sdp_rng& rng,
                                                        uint64_t first_index, uint32_t lane)
{
    float* scale = (float*)(slab + sdp_scale_offset(layout, k));
    float* offset = layout.quant.symmetric ? nullptr : (float*)(slab + sdp_offset_offset(layout, k));
    sdp_quantize_group<E>(layout.quant, top_inverse, load, rng, first_index, slab + sdp_codes_offset(layout, k),
                          scale, offset, lane);
}

// ---------------------------------------------------------------------------------------------
// Group dequantizer (codec::quant::dequantize_group, codec::slab::SlabView::decode_group).

// One received group: its codes, scale and offset (0 for symmetric groups).
struct sdp_coded_group {
    const uint8_t* codes;
    float scale;
    float offset;
};

// Group k of a received slab.
__device__ __forceinline__ sdp_coded_group sdp_slab_group(const uint8_t* slab, const sdp_slab& layout,
                                                          uint64_t k)
{
    sdp_coded_group grp;
    grp.codes = slab + sdp_codes_offset(layout, k);
    grp.scale = __ldg((const float*)(slab + sdp_scale_offset(layout, k)));
    grp.offset = layout.quant.symmetric ? 0.0f : __ldg((const float*)(slab + sdp_offset_offset(layout, k)));
    return grp;
}

// Whether a received group's metadata is corrupt: scale negative or infinite, offset infinite.
__device__ __forceinline__ bool sdp_meta_corrupt(const sdp_coded_group& grp)
{
    return grp.scale < 0.0f || sdp_is_inf(grp.scale) || sdp_is_inf(grp.offset);
}

// Zero fields of 4-bit fields: the borrow of (x - 0x11111111) reaches a field's top bit, with
// that bit clear in x, exactly when some field is zero (a borrow only propagates upwards past
// a zero field, so a field above the first zero one may be marked too, but never when none is
// zero). sdp_zero_field_borrows gives those bits of a word before the top bits are selected,
// so the marks of many words can be OR-ed and tested once by sdp_code_marks_found on their
// lowest `fields` fields.
__device__ __forceinline__ uint32_t sdp_zero_field_borrows(uint32_t word)
{
    return (word - 0x11111111u) & ~word;
}

// The bytes 0x80 (the code -128) of a word, at their top bits, among other bits of
// sdp_code_marks_found's ignoring: a byte's low 7 bits plus 0x7f carry into its top bit (and
// never past it) exactly when they are not all zero, so the top bit of the word's byte without
// that carry is set exactly for 0x80. Two instructions and the OR into the marks, which folds
// into the last one (no false positive, unlike the borrow test).
__device__ __forceinline__ uint32_t sdp_byte_0x80_marks(uint32_t word)
{
    return word & ~((word & 0x7f7f7f7fu) + 0x7f7f7f7fu);
}

// Whether the OR-ed marks of b-bit fields (sdp_zero_field_borrows for b = 4, on the word with
// every field's top bit flipped, sdp_byte_0x80_marks for b = 8) show the code -2^(b-1) in
// their lowest `fields` fields.
__device__ __forceinline__ bool sdp_code_marks_found(uint32_t marks, uint32_t bits, uint32_t fields)
{
    const uint32_t tops = bits == 4 ? 0x88888888u : 0x80808080u;
    const uint32_t used = fields * bits >= 32 ? 0xffffffffu : (1u << (fields * bits)) - 1;
    return (marks & tops & used) != 0;
}

// The nibble k (< 8) of `word` as an exact fp32 integer, the nibble read as unsigned and then
// `bias` (0 or 8) subtracted, without shifting the nibble down: nibble j = k % 4 of the low or
// high half stays at bits [4 j, 4 j + 4), which lie in the mantissa of 2^e, e = 23 - 4 j, whose
// last mantissa bit is worth 2^-4j, so (bits of 2^e) | (half & (15 << 4 j)) is exactly
// 2^e + nibble. Subtracting 2^e + bias (exact: an integer plus 2^e, e >= 11) is exact by
// Sterbenz's lemma (both lie in [2^e, 2^(e + 1))) and leaves nibble - bias: one mask, one OR
// and one addition per nibble instead of a shift more; the high half costs one shift for its
// four nibbles.
__device__ __forceinline__ float sdp_nibble_as_float(uint32_t word, uint32_t k, float bias)
{
    const uint32_t half = k < 4 ? word : word >> 16;
    const uint32_t j = k % 4;
    const uint32_t power = (150u - 4 * j) << 23;  // the bits of 2^(23 - 4 j)
    return __fsub_rn(__uint_as_float(power | (half & (0xfu << (4 * j)))), __fadd_rn(__uint_as_float(power), bias));
}

// Byte k of `word` as an exact fp32 integer, signed (symmetric codes) or unsigned: one
// conversion with a byte selector (sm_90's I2F.S8 / I2F.U8 Rd, Rs.Bk), which ptxas makes of a
// byte extract followed by the conversion to fp32. C's shift and mask give the unsigned
// extract; for the signed one NVRTC writes a shift pair that ptxas keeps, so the device build
// states PTX's signed bit-field extract (bfe.s32: bits [8k, 8k + 8) sign-extended) and the
// host emulation the same shift pair.
__device__ __forceinline__ float sdp_byte_as_float(uint32_t word, uint32_t k, bool is_signed)
{
    if (!is_signed) {
        return (float)((word >> (8 * k)) & 0xffu);
    }
    int32_t field;
#ifdef __CUDA_ARCH__
    asm("bfe.s32 %0, %1, %2, 8;" : "=r"(field) : "r"(word), "r"(8 * k));
#else
    field = (int32_t)(word << (24 - 8 * k)) >> 24;
#endif
    return (float)field;
}

// The E codes of this lane's run r of tile t of a group as exact fp32 values: signed nibbles or
// bytes (symmetric) or unsigned ones, read as whole words (a 4-bit run of E = 4 is half of the
// word it shares with the neighbouring lane, which holds codes of the same group). ORs into
// `marks` the marks of its words (sdp_code_marks_found) by which sdp_run_codes_corrupt finds a
// symmetric code -2^(b-1), which the quantizer never writes. A byte is converted in one
// instruction (sdp_byte_as_float); a signed nibble c is decoded as the unsigned nibble of
// c + 8 (the word with every nibble's top bit flipped) minus 8, where the code -8 is the zero
// nibble.
// sdp_run_codes_at gives the byte offset in the group's codes of the run's aligned word and,
// for 4-bit codes, the shift of the run in it.
template <uint32_t E>
__device__ __forceinline__ uint32_t sdp_run_codes_at(const sdp_quant& q, uint32_t t, uint32_t r, uint32_t lane,
                                                     uint32_t& shift)
{
    const uint32_t first = sdp_tile_element<E>(t, r * E, lane);
    if (q.bits == 4) {
        // Byte offset of the run's word, and where in the word its codes start.
        const uint32_t byte = first / 2;
        shift = 8 * (byte & 3u);
        return byte & ~3u;
    }
    shift = 0;
    return first;
}

// The decoding of sdp_load_run_codes from the run's word(s) at `word` (sdp_run_codes_at).
template <uint32_t E>
__device__ __forceinline__ void sdp_decode_run_codes(const sdp_quant& q, const uint8_t* word, uint32_t shift, float* c,
                                                     uint32_t& marks)
{
    uint32_t lo;
    uint32_t hi = 0;
    if (q.bits == 4) {
        lo = __ldg((const unsigned int*)word) >> shift;
    } else if (E == 8) {
        const uint2 w = __ldg((const uint2*)word);
        lo = w.x;
        hi = w.y;
    } else {
        lo = __ldg((const unsigned int*)word);
    }
    if (q.bits == 8) {
        if (q.symmetric) {
            marks |= sdp_byte_0x80_marks(lo);
            if (E == 8) {
                marks |= sdp_byte_0x80_marks(hi);
            }
        }
#pragma unroll
        for (uint32_t k = 0; k < E; ++k) {
            c[k] = sdp_byte_as_float(k < 4 ? lo : hi, k % 4, q.symmetric);
        }
        return;
    }
    float bias = 0.0f;
    if (q.symmetric) {
        lo ^= 0x88888888u;
        bias = 8.0f;
        marks |= sdp_zero_field_borrows(lo);
    }
#pragma unroll
    for (uint32_t k = 0; k < E; ++k) {
        c[k] = sdp_nibble_as_float(lo, k, bias);
    }
}

template <uint32_t E>
__device__ __forceinline__ void sdp_load_run_codes(const sdp_quant& q, const uint8_t* codes, uint32_t t, uint32_t r,
                                                   uint32_t lane, float* c, uint32_t& marks)
{
    uint32_t shift;
    const uint32_t at = sdp_run_codes_at<E>(q, t, r, lane, shift);
    sdp_decode_run_codes<E>(q, codes + at, shift, c, marks);
}

// Whether the marks sdp_load_run_codes<E> OR-ed for runs of a symmetric group show a corrupt
// code: the E fields of a run, in the low word (and the high word, all four of its fields).
template <uint32_t E>
__device__ __forceinline__ bool sdp_run_codes_corrupt(const sdp_quant& q, uint32_t marks)
{
    return q.symmetric && sdp_code_marks_found(marks, q.bits, q.bits == 4 ? E : (E < 4 ? E : 4));
}

// The dequantized value of code c (an exact fp32 integer): c * s (symmetric) or lo + c * s
// (asymmetric).
__device__ __forceinline__ float sdp_dequantize(const sdp_quant& q, const sdp_coded_group& grp, float c)
{
    const float value = __fmul_rn(c, grp.scale);
    return q.symmetric ? value : __fadd_rn(grp.offset, value);
}

// The metadata of one peer's group k that a lane holds for the warp (sdp_sum_peers_tile): its
// scale and offset (0 for symmetric groups), both NaN when the metadata is corrupt
// (sdp_meta_corrupt), so that every value dequantized from them is NaN.
__device__ __forceinline__ sdp_coded_group sdp_peer_meta(const sdp_quant& q, const uint8_t* scale,
                                                         uint64_t to_offset, bool present)
{
    sdp_coded_group grp;
    grp.codes = nullptr;
    grp.scale = present ? __ldg((const float*)scale) : 0.0f;
    grp.offset = present && !q.symmetric ? __ldg((const float*)(scale + to_offset)) : 0.0f;
    if (sdp_meta_corrupt(grp)) {
        grp.scale = sdp_nan();
        grp.offset = sdp_nan();
    }
    return grp;
}

// This lane's values of tile t of the sum over the `peers` consecutive slabs of `recv`, in
// slab order, of dequantize(group k): out = deq(slab 0); out = out + deq(slab 1); ...
// (gradient::sum_groups); zeros for runs past the group. A corrupt group makes the sum NaN:
// corrupt metadata in every lane (lane L loads, checks and holds the scale and offset of peer
// 32 c + L for the peers 32 c .. 32 c + 31, NaN where corrupt, and each peer's are broadcast
// with a shuffle: no load, address or check per peer and lane), a corrupt code in the lane
// that decodes it, which sets `corrupt` (the zero-field marks of every code word are OR-ed and
// tested once): the caller turns the whole group to NaN. Group k of slab s lies one slab
// further than group k of slab s - 1, so its addresses advance by one slab per peer. All 32
// lanes must call it together.
template <uint32_t E>
__device__ __forceinline__ void sdp_sum_peers_tile(const uint8_t* recv, const sdp_slab& layout, uint32_t peers,
                                                   uint64_t k, uint32_t t, uint32_t lane,
                                                   float (&v)[SDP_LANE_VALUES], bool& corrupt)
{
    const sdp_quant& q = layout.quant;
#pragma unroll
    for (uint32_t i = 0; i < SDP_LANE_VALUES; ++i) {
        v[i] = 0.0f;
    }
    // The word of each run of this lane in group k of the current slab.
    const uint8_t* run_codes[SDP_LANE_VALUES / E];
    uint32_t shift[SDP_LANE_VALUES / E];
#pragma unroll
    for (uint32_t r = 0; r < SDP_LANE_VALUES / E; ++r) {
        run_codes[r] = recv + sdp_codes_offset(layout, k) + sdp_run_codes_at<E>(q, t, r, lane, shift[r]);
    }
    // The scale of group k in slab 32 c + lane, for the current block c of 32 peers.
    const uint8_t* lane_scale = recv + sdp_scale_offset(layout, k) + lane * layout.byte_len;
    const uint64_t to_offset = sdp_offset_offset(layout, k) - sdp_scale_offset(layout, k);
    sdp_coded_group held = {nullptr, 0.0f, 0.0f};  // set at s = 0
    uint32_t marks = 0;
    for (uint32_t s = 0; s < peers; ++s) {
        if (s % SDP_WARP_SIZE == 0) {
            held = sdp_peer_meta(q, lane_scale, to_offset, s + lane < peers);
            lane_scale += SDP_WARP_SIZE * layout.byte_len;
        }
        sdp_coded_group grp;
        grp.codes = nullptr;  // the runs' words are in run_codes
        grp.scale = __shfl_sync(SDP_FULL_MASK, held.scale, s % SDP_WARP_SIZE);
        grp.offset = q.symmetric ? 0.0f : __shfl_sync(SDP_FULL_MASK, held.offset, s % SDP_WARP_SIZE);
#pragma unroll
        for (uint32_t r = 0; r < SDP_LANE_VALUES / E; ++r) {
            if (sdp_run_in_group<E>(q.group_size, t, r, lane)) {
                float c[E];
                sdp_decode_run_codes<E>(q, run_codes[r], shift[r], c, marks);
#pragma unroll
                for (uint32_t e = 0; e < E; ++e) {
                    const float x = sdp_dequantize(q, grp, c[e]);
                    v[r * E + e] = s == 0 ? x : __fadd_rn(v[r * E + e], x);
                }
            }
        }
#pragma unroll
        for (uint32_t r = 0; r < SDP_LANE_VALUES / E; ++r) {
            run_codes[r] += layout.byte_len;
        }
    }
    corrupt |= sdp_run_codes_corrupt<E>(q, marks);
}
