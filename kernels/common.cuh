// Device helpers shared by every kernel of this directory: the launch shape, Philox4x32-10 and
// the uniform of element i, bf16 conversion, warp reductions, the group quantizer and
// dequantizer, nibble packing, slab addressing and the warp Walsh-Hadamard butterfly.
//
// Every helper reproduces a piece of the CPU reference (src/rng.rs, src/hadamard.rs,
// src/codec/quant.rs, src/codec/slab.rs) bit for bit. Kernels are compiled by NVRTC with
// --fmad=false --prec-div=true --ftz=false; on top of that all quantize / dequantize / sum /
// Hadamard arithmetic uses the explicit round-to-nearest intrinsics (__fadd_rn, __fsub_rn,
// __fmul_rn, __fdiv_rn), which are never contracted into a fused multiply-add.
//
// Launch contract of every kernel: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic
// shared memory. Kernels loop grid-stride over their work units, so every grid size gives the
// same bytes.
//
// How a warp walks a group. A group of g elements (g a multiple of 32, up to 2^16) is
// processed by one warp in *tiles* of up to 256 elements: tile t holds elements
// [256 t, 256 t + 256) of the group as up to 8 *rows* of 32; lane L holds element
// 256 t + 32 r + L of row r in register v[r]. A tile is never cut inside a Hadamard block
// (blocks are powers of two <= 256 dividing g), so the butterfly runs tile by tile.
// Quantizing needs the group's absmax (or min and max) before the first code: a group of one
// tile (g <= 256) is loaded once, a longer group is loaded twice (once for the statistics,
// once for the codes), which re-reads the group's inputs from cache instead of holding up to
// 2^16 values on chip.
//
// Decoding corrupt input (a received slab that no encoder can have produced) cannot report an
// error from a kernel, so it produces NaN instead, which the caller's found-inf / NaN check
// catches: a group whose scale is negative or infinite, whose offset is infinite, or
// (symmetric) that holds the code -2^(b-1), dequantizes to NaN in every element. The CPU
// reference rejects exactly these groups with Error::Decode (codec::slab::SlabView::meta and
// codec::quant::dequantize_group).
//
// Alignment: every slab pointer a kernel receives (a buffer start plus a multiple of the slab's
// byte_len) must be 4-byte aligned (slabs are 16-byte multiples and device allocations are
// 256-byte aligned, so this holds for any buffer the host allocates); codes are stored as
// 32-bit words and scales and offsets as fp32.
#pragma once

#include "sdp4bit_abi.h"

// ---------------------------------------------------------------------------------------------
// Launch shape and work distribution.

#define SDP_BLOCK_THREADS 256
#define SDP_WARP_SIZE 32
#define SDP_FULL_MASK 0xffffffffu
// Elements of one tile, and rows of 32 elements per tile (see the header comment).
#define SDP_TILE 256
#define SDP_TILE_ROWS 8

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

// Word `word` (0 .. 3) of a block.
__device__ __forceinline__ uint32_t sdp_philox_pick(const sdp_philox_block& b, uint32_t word)
{
    return word == 0 ? b.w0 : word == 1 ? b.w1 : word == 2 ? b.w2 : b.w3;
}

// u = (word >> 8) * 2^-24: exact in fp32, in [0, 1) (rng::word_to_uniform).
__device__ __forceinline__ float sdp_word_to_uniform(uint32_t word)
{
    return __fmul_rn(__uint2float_rn(word >> 8), 1.0f / 16777216.0f);
}

// The uniform of element i of the stream: word i % 4 of block i / 4.
__device__ __forceinline__ float sdp_uniform(const sdp_rng& rng, uint64_t i)
{
    return sdp_word_to_uniform(sdp_philox_pick(sdp_philox(rng, i / 4), (uint32_t)(i % 4)));
}

// The uniforms of the valid rows of a tile whose element (r, lane) has Philox index
// tile_first + 32 r + lane, into u[r]. When tile_first is a multiple of 4 (every group of the
// plans: padded shards are multiples of 32) the tile's up to 64 Philox blocks are computed
// once each, two per lane (lane L: blocks L and L + 32 of the tile, block B covering row B / 8,
// lanes 4 (B % 8) .. 4 (B % 8) + 3), and every lane fetches its word from the block's holder
// with four shuffles; otherwise each lane computes its own element's block. All 32 lanes must
// call it together.
__device__ __forceinline__ void sdp_tile_uniforms(const sdp_rng& rng, uint64_t tile_first, uint32_t rows,
                                                  uint32_t lane, float (&u)[SDP_TILE_ROWS])
{
    if (tile_first % 4 != 0) {
#pragma unroll
        for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
            if (r < rows) {
                u[r] = sdp_uniform(rng, tile_first + r * SDP_WARP_SIZE + lane);
            }
        }
        return;
    }
    const uint64_t first_block = tile_first / 4;
    sdp_philox_block held[2] = {};
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
        const uint32_t block = lane + h * SDP_WARP_SIZE;
        if (block / 8 < rows) {
            held[h] = sdp_philox(rng, first_block + block);
        }
    }
#pragma unroll
    for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
        if (r < rows) {
            // Block r * 8 + lane / 4 is held by lane (r % 4) * 8 + lane / 4 in held[r / 4].
            const sdp_philox_block& b = held[r / 4];
            const uint32_t holder = (r % 4) * 8 + lane / 4;
            sdp_philox_block mine;
            mine.w0 = __shfl_sync(SDP_FULL_MASK, b.w0, holder);
            mine.w1 = __shfl_sync(SDP_FULL_MASK, b.w1, holder);
            mine.w2 = __shfl_sync(SDP_FULL_MASK, b.w2, holder);
            mine.w3 = __shfl_sync(SDP_FULL_MASK, b.w3, holder);
            u[r] = sdp_word_to_uniform(sdp_philox_pick(mine, lane % 4));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Warp reductions (every lane gets the result; all 32 lanes must call them together).

__device__ __forceinline__ uint32_t sdp_warp_max_u32(uint32_t v)
{
    for (uint32_t m = SDP_WARP_SIZE / 2; m > 0; m /= 2) {
        const uint32_t other = __shfl_xor_sync(SDP_FULL_MASK, v, m);
        v = other > v ? other : v;
    }
    return v;
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
// Tiles of a group.

// Tiles of a group of g elements.
__device__ __forceinline__ uint32_t sdp_tiles(uint32_t g)
{
    return (g + SDP_TILE - 1) / SDP_TILE;
}

// Rows of 32 elements in tile t of a group of g elements (8, or fewer in the last tile).
__device__ __forceinline__ uint32_t sdp_tile_rows(uint32_t g, uint32_t t)
{
    const uint32_t rows = (g - t * SDP_TILE) / SDP_WARP_SIZE;
    return rows < SDP_TILE_ROWS ? rows : SDP_TILE_ROWS;
}

// Index in the group of the element lane `lane` holds in row r of tile t.
__device__ __forceinline__ uint32_t sdp_tile_element(uint32_t t, uint32_t r, uint32_t lane)
{
    return t * SDP_TILE + r * SDP_WARP_SIZE + lane;
}

// ---------------------------------------------------------------------------------------------
// Walsh-Hadamard butterfly of a tile (hadamard::forward / hadamard::inverse).
//
// Stages h = 1, 2, 4, ..., block / 2 in order; at each stage the pair (x[j], x[j + h]) with
// bit h of j clear becomes (a + b, a - b), a = x[j], b = x[j + h]. Inside a row (h < 32) the
// partner is lane ^ h; across rows (h >= 32) it is row r + h / 32 of the same lane. `rows` is
// a multiple of block / 32 (when block > 32), so pairs never leave the tile's valid rows.

// One stage at distance h < 32 on every valid row.
__device__ __forceinline__ void sdp_hadamard_lane_stage(float (&v)[SDP_TILE_ROWS], uint32_t rows,
                                                        uint32_t h, uint32_t lane)
{
    const bool upper = (lane & h) != 0;
#pragma unroll
    for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
        if (r < rows) {
            const float other = __shfl_xor_sync(SDP_FULL_MASK, v[r], h);
            // Lower lane: a = own, b = other -> a + b; upper lane: a = other, b = own -> a - b.
            v[r] = upper ? __fsub_rn(other, v[r]) : __fadd_rn(v[r], other);
        }
    }
}

// One stage at distance 32 * HR (HR = 1, 2, 4 rows) on every valid row.
template <uint32_t HR>
__device__ __forceinline__ void sdp_hadamard_row_stage(float (&v)[SDP_TILE_ROWS], uint32_t rows)
{
#pragma unroll
    for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
        if ((r & HR) == 0 && r < rows) {
            const float a = v[r];
            const float b = v[r + HR];
            v[r] = __fadd_rn(a, b);
            v[r + HR] = __fsub_rn(a, b);
        }
    }
}

// The unnormalised butterfly of every `block`-sized block of the tile (block: 16 .. 256).
__device__ __forceinline__ void sdp_hadamard_forward(float (&v)[SDP_TILE_ROWS], uint32_t rows,
                                                     uint32_t block, uint32_t lane)
{
    for (uint32_t h = 1; h < block && h < SDP_WARP_SIZE; h *= 2) {
        sdp_hadamard_lane_stage(v, rows, h, lane);
    }
    if (block > 32) {
        sdp_hadamard_row_stage<1>(v, rows);
    }
    if (block > 64) {
        sdp_hadamard_row_stage<2>(v, rows);
    }
    if (block > 128) {
        sdp_hadamard_row_stage<4>(v, rows);
    }
}

// The inverse: the same butterfly, then every element times 1 / block (exact: a power of two).
__device__ __forceinline__ void sdp_hadamard_inverse(float (&v)[SDP_TILE_ROWS], uint32_t rows,
                                                     uint32_t block, uint32_t lane)
{
    sdp_hadamard_forward(v, rows, block, lane);
    const float scale = __fdiv_rn(1.0f, (float)block);
#pragma unroll
    for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
        if (r < rows) {
            v[r] = __fmul_rn(v[r], scale);
        }
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

// Zeroes the padding at the end of a slab being written (fewer than 16 bytes); the warp that
// writes group 0 of the slab calls it.
__device__ __forceinline__ void sdp_zero_slab_padding(uint8_t* slab, const sdp_slab& layout,
                                                      uint32_t lane)
{
    const uint64_t pad_start = sdp_meta_end(layout);
    if (pad_start + lane < layout.byte_len) {
        slab[pad_start + lane] = 0;
    }
}

// ---------------------------------------------------------------------------------------------
// Group quantizer (codec::quant::quantize_group).

// Statistics of a group gathered tile by tile: max |x| as bits, min and max.
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

// Folds the valid rows of a tile into this lane's statistics.
__device__ __forceinline__ void sdp_stats_add(sdp_group_stats& s, const float (&v)[SDP_TILE_ROWS],
                                              uint32_t rows)
{
#pragma unroll
    for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
        if (r < rows) {
            const uint32_t bits = sdp_abs_bits(v[r]);
            s.abs_bits = bits > s.abs_bits ? bits : s.abs_bits;
            s.lo = fminf(s.lo, v[r]);
            s.hi = fmaxf(s.hi, v[r]);
        }
    }
}

// Combines the statistics of all lanes (every lane gets the group's).
__device__ __forceinline__ sdp_group_stats sdp_stats_reduce(sdp_group_stats s)
{
    s.abs_bits = sdp_warp_max_u32(s.abs_bits);
    s.lo = sdp_warp_min(s.lo);
    s.hi = sdp_warp_max(s.hi);
    return s;
}

// Scale and offset of a group (GroupMeta) and whether its codes are computed (`coded`; false:
// every code is 0).
struct sdp_group_meta {
    float scale;
    float offset;
    bool coded;
};

// A non-finite group: scale and offset NaN, codes 0 (quant::non_finite_meta).
__device__ __forceinline__ sdp_group_meta sdp_meta_non_finite()
{
    sdp_group_meta m;
    m.scale = sdp_nan();
    m.offset = sdp_nan();
    m.coded = false;
    return m;
}

// quant::symmetric_meta / quant::asymmetric_meta from the group's statistics. The min-max
// path is only reached when every value is finite, so fminf / fmaxf see no NaN; which zero
// they return for a group holding +0 and -0 does not matter because `+ 0.0` canonicalises -0
// to +0.
__device__ __forceinline__ sdp_group_meta sdp_meta_of(const sdp_quant& q, const sdp_group_stats& s)
{
    if (s.abs_bits >= 0x7f800000u) {
        return sdp_meta_non_finite();
    }
    const float top = (float)sdp_max_code(q);
    sdp_group_meta m;
    if (q.symmetric) {
        m.scale = __fdiv_rn(__uint_as_float(s.abs_bits), top);
        m.offset = 0.0f;
        if (!sdp_is_finite(__fmul_rn(m.scale, top))) {
            // absmax at the top of fp32's range: the largest code would decode to Inf.
            return sdp_meta_non_finite();
        }
    } else {
        const float lo = __fadd_rn(s.lo, 0.0f);
        const float hi = __fadd_rn(s.hi, 0.0f);
        m.scale = __fdiv_rn(__fsub_rn(hi, lo), top);
        m.offset = lo;
        if (!sdp_is_finite(m.scale)) {
            return sdp_meta_non_finite();
        }
    }
    m.coded = m.scale != 0.0f;
    return m;
}

// The code of x in a coded group: R(x / s) (symmetric) or R((x - lo) / s) (asymmetric), with
// R(v) = floor(v + u) (stochastic) or round half to even, clamped to [-L, L] or [0, 2^b - 1].
// A NaN code becomes 0 (quant::code_bits; cannot happen for a coded group, kept for parity).
__device__ __forceinline__ int32_t sdp_code_of(const sdp_quant& q, const sdp_group_meta& m, float x,
                                               float u)
{
    const float v = q.symmetric ? x : __fsub_rn(x, m.offset);
    const float t = __fdiv_rn(v, m.scale);
    float c = q.stochastic ? floorf(__fadd_rn(t, u)) : rintf(t);
    if (c != c) {
        return 0;
    }
    const float top = (float)sdp_max_code(q);
    const float bottom = q.symmetric ? -top : 0.0f;
    c = fminf(fmaxf(c, bottom), top);
    return (int32_t)c;
}

// Stores the codes of one row of 32 consecutive elements (lane L holds element L's code) at
// `row` as little-endian 32-bit words: 8 nibbles per word (element 2k in the low nibble of
// byte k) or 4 bytes per word. `row` must be 4-byte aligned.
__device__ __forceinline__ void sdp_store_code_row(uint8_t* row, int32_t code, uint32_t bits,
                                                   uint32_t lane)
{
    const uint32_t per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1;
    uint32_t word = ((uint32_t)code & mask) << (bits * (lane % per_word));
    for (uint32_t m = 1; m < per_word; m *= 2) {
        word |= __shfl_xor_sync(SDP_FULL_MASK, word, m);
    }
    if (lane % per_word == 0) {
        *(uint32_t*)(row + lane * bits / 8) = word;
    }
}

// Quantizes one group with the whole warp into `codes` (the group's code bytes), `scale` and
// `offset` (null for symmetric slabs). `load(t, rows, v)` fills the valid rows of tile t of the
// group's values (lane L: element 256 t + 32 r + L in v[r]) and is called by all 32 lanes
// together; it may be called twice per tile. `rng` gives the uniform of element e at
// `first_index + e` (stochastic rounding only; drawn only for coded groups, as on the CPU the
// uniforms of an uncoded group are unused).
template <class Load>
__device__ __forceinline__ void sdp_quantize_group(const sdp_quant& q, Load& load, const sdp_rng& rng,
                                                   uint64_t first_index, uint8_t* codes, float* scale,
                                                   float* offset, uint32_t lane)
{
    const uint32_t g = q.group_size;
    const uint32_t tiles = sdp_tiles(g);
    float v[SDP_TILE_ROWS] = {};

    sdp_group_stats stats = sdp_stats_empty();
    for (uint32_t t = 0; t < tiles; ++t) {
        load(t, sdp_tile_rows(g, t), v);
        sdp_stats_add(stats, v, sdp_tile_rows(g, t));
    }
    const sdp_group_meta meta = sdp_meta_of(q, sdp_stats_reduce(stats));

    for (uint32_t t = 0; t < tiles; ++t) {
        const uint32_t rows = sdp_tile_rows(g, t);
        // A one-tile group still holds its values from the statistics pass.
        if (meta.coded && tiles > 1) {
            load(t, rows, v);
        }
        float u[SDP_TILE_ROWS] = {};
        if (meta.coded && q.stochastic) {
            sdp_tile_uniforms(rng, first_index + t * SDP_TILE, rows, lane, u);
        }
#pragma unroll
        for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
            if (r < rows) {
                const int32_t code = meta.coded ? sdp_code_of(q, meta, v[r], u[r]) : 0;
                const uint32_t row_first = sdp_tile_element(t, r, 0);
                sdp_store_code_row(codes + (uint64_t)row_first * q.bits / 8, code, q.bits, lane);
            }
        }
    }

    if (lane == 0) {
        *scale = meta.scale;
        if (offset != nullptr) {
            *offset = meta.offset;
        }
    }
}

// Quantizes group k of a slab being written (codes, scale, offset at their slab positions) and,
// for k == 0, zeroes the slab's padding.
template <class Load>
__device__ __forceinline__ void sdp_quantize_slab_group(uint8_t* slab, const sdp_slab& layout,
                                                        uint64_t k, Load& load, const sdp_rng& rng,
                                                        uint64_t first_index, uint32_t lane)
{
    float* scale = (float*)(slab + sdp_scale_offset(layout, k));
    float* offset = layout.quant.symmetric ? nullptr : (float*)(slab + sdp_offset_offset(layout, k));
    sdp_quantize_group(layout.quant, load, rng, first_index, slab + sdp_codes_offset(layout, k), scale,
                       offset, lane);
    if (k == 0) {
        sdp_zero_slab_padding(slab, layout, lane);
    }
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
    grp.scale = *(const float*)(slab + sdp_scale_offset(layout, k));
    grp.offset = layout.quant.symmetric ? 0.0f : *(const float*)(slab + sdp_offset_offset(layout, k));
    return grp;
}

// Whether a group's codes hold the symmetric code -2^(b-1) (nibble 0x8 or byte 0x80), which
// the quantizer never writes. All 32 lanes must call it together.
__device__ __forceinline__ bool sdp_has_min_code(const sdp_quant& q, const uint8_t* codes, uint32_t lane)
{
    const uint64_t n = sdp_code_bytes(q);
    bool found = false;
    for (uint64_t i = lane; i < n; i += SDP_WARP_SIZE) {
        const uint32_t b = codes[i];
        found |= q.bits == 4 ? ((b & 0xfu) == 0x8u || (b >> 4) == 0x8u) : b == 0x80u;
    }
    return __any_sync(SDP_FULL_MASK, found) != 0;
}

// Whether a received group is corrupt (see the header comment): scale negative or infinite,
// offset infinite, or a symmetric group holding the code -2^(b-1). All 32 lanes must call it
// together.
__device__ __forceinline__ bool sdp_group_corrupt(const sdp_quant& q, const sdp_coded_group& grp,
                                                  uint32_t lane)
{
    if (grp.scale < 0.0f || sdp_is_inf(grp.scale) || sdp_is_inf(grp.offset)) {
        return true;
    }
    return q.symmetric && sdp_has_min_code(q, grp.codes, lane);
}

// The code of element e: a sign-extended nibble or byte (symmetric) or an unsigned one.
__device__ __forceinline__ int32_t sdp_load_code(const sdp_quant& q, const uint8_t* codes, uint32_t e)
{
    if (q.bits == 4) {
        const uint32_t byte = codes[e / 2];
        const uint32_t nibble = (e % 2 == 0) ? (byte & 0xfu) : (byte >> 4);
        return q.symmetric ? ((int32_t)(nibble << 28) >> 28) : (int32_t)nibble;
    }
    const uint32_t byte = codes[e];
    return q.symmetric ? (int32_t)(int8_t)byte : (int32_t)byte;
}

// The dequantized element e: q * s (symmetric) or lo + q * s (asymmetric).
__device__ __forceinline__ float sdp_dequantize(const sdp_quant& q, const sdp_coded_group& grp, uint32_t e)
{
    const float value = __fmul_rn((float)sdp_load_code(q, grp.codes, e), grp.scale);
    return q.symmetric ? value : __fadd_rn(grp.offset, value);
}

// Whether group k is corrupt in any of the `peers` consecutive slabs of `recv`; a sum over the
// peers then is NaN in every element. All 32 lanes must call it together.
__device__ __forceinline__ bool sdp_any_peer_corrupt(const uint8_t* recv, const sdp_slab& layout,
                                                     uint32_t peers, uint64_t k, uint32_t lane)
{
    bool corrupt = false;
    for (uint32_t s = 0; s < peers && !corrupt; ++s) {
        corrupt = sdp_group_corrupt(layout.quant, sdp_slab_group(sdp_slab_at(recv, layout, s), layout, k),
                                    lane);
    }
    return corrupt;
}

// The valid rows of tile t of the sum over the `peers` consecutive slabs of `recv`, in slab
// order, of dequantize(group k): out = deq(slab 0); out = out + deq(slab 1); ...
// (gradient::sum_groups). A corrupt group (see sdp_any_peer_corrupt) sums to NaN everywhere.
__device__ __forceinline__ void sdp_sum_peers_tile(const uint8_t* recv, const sdp_slab& layout,
                                                   uint32_t peers, uint64_t k, bool corrupt, uint32_t t,
                                                   uint32_t rows, uint32_t lane,
                                                   float (&v)[SDP_TILE_ROWS])
{
    if (corrupt) {
#pragma unroll
        for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
            v[r] = sdp_nan();
        }
        return;
    }
    for (uint32_t s = 0; s < peers; ++s) {
        const sdp_coded_group grp = sdp_slab_group(sdp_slab_at(recv, layout, s), layout, k);
#pragma unroll
        for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
            if (r < rows) {
                const float x = sdp_dequantize(layout.quant, grp, sdp_tile_element(t, r, lane));
                v[r] = s == 0 ? x : __fadd_rn(v[r], x);
            }
        }
    }
}
