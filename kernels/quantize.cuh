// The group quantizer (codec::quant::quantize_group) for a quantizer Q fixed at compile time
// (spec.cuh): the statistics of a group held by a warp, its scale and offset, the codes, and
// their packing and stores. Two ways to walk a group: held in registers, all rows at once
// (sdp_quantize_held), or, for a group longer than a lane's registers hold, tile by tile with
// the inputs loaded twice (sdp_quantize_tiled).
#pragma once

#include "divide.cuh"
#include "philox.cuh"
#include "slab.cuh"

// Statistics of a group: max |x| as bits, min and max (min-max codecs only).
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

// Folds this lane's values of the `Rows` rows from row r0 of a group into its statistics:
// `row(r, x)` gives this lane's E values of row r0 + r (sdp_rows' layout); runs past the group
// do not count.
template <class Q, uint32_t E, uint32_t Rows, class Row>
__device__ __forceinline__ void sdp_stats_add(sdp_group_stats& s, Row& row, uint32_t r0, uint32_t lane)
{
    using R = sdp_rows<E, Q::group_size>;
#pragma unroll
    for (uint32_t r = 0; r < Rows; ++r) {
        if (R::in_group(r0 + r, lane)) {
            float x[E];
            row(r, x);
#pragma unroll
            for (uint32_t e = 0; e < E; ++e) {
                const uint32_t bits = sdp_abs_bits(x[e]);
                s.abs_bits = bits > s.abs_bits ? bits : s.abs_bits;
                if (!Q::symmetric) {
                    s.lo = fminf(s.lo, x[e]);
                    s.hi = fmaxf(s.hi, x[e]);
                }
            }
        }
    }
}

// The values of `v`, a lane's runs of consecutive rows (sdp_rows' layout), as the `row(r, x)`
// that sdp_stats_add, sdp_encode_rows and sdp_quantize_held take.
template <uint32_t E, uint32_t N>
__device__ __forceinline__ auto sdp_rows_of(const float (&v)[N])
{
    return [&v](uint32_t r, float(&x)[E]) {
#pragma unroll
        for (uint32_t e = 0; e < E; ++e) {
            x[e] = v[r * E + e];
        }
    };
}

// Combines the statistics of all lanes (every lane gets the group's): the absmax, and min and
// max for min-max codecs only.
template <class Q>
__device__ __forceinline__ sdp_group_stats sdp_stats_reduce(sdp_group_stats s)
{
    s.abs_bits = sdp_warp_max_u32(s.abs_bits);
    if (!Q::symmetric) {
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

// quant::symmetric_meta / quant::asymmetric_meta from the group's statistics, for any group: the
// path of min-max codecs, inline (every group takes it), and of symmetric groups whose absmax
// lies outside sdp_meta_of's fast range, out of line (sdp_meta_general). The min-max path is only
// reached when every value is finite, so fminf / fmaxf see no NaN; which zero they return for a
// group holding +0 and -0 does not matter because `+ 0.0` canonicalises -0 to +0.
template <class Q>
__device__ __forceinline__ sdp_group_meta sdp_meta_any(const sdp_group_stats& s)
{
    if (s.abs_bits >= 0x7f800000u) {
        return sdp_meta_non_finite();
    }
    const float top = (float)Q::max_code;
    sdp_group_meta m;
    // The largest dividend of the group's codes: |x| <= absmax (symmetric) or
    // x - min <= max - min (min-max; rounding is monotonic).
    float range;
    if (Q::symmetric) {
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

// sdp_meta_any out of line: the cold path of symmetric groups. The statistics come by value
// (three registers): a reference would put them in local memory for the call.
template <class Q>
static __device__ SDP_NOINLINE sdp_group_meta sdp_meta_general(sdp_group_stats s)
{
    return sdp_meta_any<Q>(s);
}

// RN(1 / L) for the largest code L of a symmetric 4- or 8-bit quantizer (7 or 127).
template <class Q>
__device__ __forceinline__ float sdp_max_code_inverse()
{
    static_assert(Q::symmetric, "the fast path of symmetric groups");
    return Q::bits == 4 ? __uint_as_float(0x3e124925u) : __uint_as_float(0x3c010204u);
}

// sdp_meta_of's fast range of a symmetric group's absmax a: [2^-24, 2^40) (the bits of 2^-24 and
// 2^40).
#define SDP_META_FAST_LOW 0x33800000u
#define SDP_META_FAST_HIGH 0x53800000u

// sdp_meta_general, with the common case inline: for a symmetric group whose absmax a lies in
// [2^-24, 2^40), the scale s = RN(a / L) is Markstein's quotient by the divisor L (the largest
// code, 1 <= L < 2^16, and a meet sdp_divisor's conditions, so it is the IEEE division's,
// docs/numerics.md §1.4). Then 2^-40 < a / L <= a < 2^40 puts s in [2^-40, 2^40): nonzero
// (coded), L s finite (the non-finite checks cannot fire), and s a fast divisor for the
// group's |x| <= a (sdp_divisor_of's conditions). Bit for bit what sdp_meta_general returns.
template <class Q>
__device__ __forceinline__ sdp_group_meta sdp_meta_of(const sdp_group_stats& s)
{
    if constexpr (!Q::symmetric) {
        return sdp_meta_any<Q>(s);
    } else {
        if (s.abs_bits - SDP_META_FAST_LOW >= SDP_META_FAST_HIGH - SDP_META_FAST_LOW) {
            // Cold path: absmax outside the fast range (zero, tiny, huge, Inf or NaN).
            return sdp_meta_general<Q>(s);
        }
        sdp_divisor by_top;
        by_top.s = (float)Q::max_code;
        by_top.inverse = sdp_max_code_inverse<Q>();
        by_top.fast = true;
        sdp_group_meta m;
        m.scale = sdp_divide_markstein(by_top, __uint_as_float(s.abs_bits));
        m.offset = 0.0f;
        m.coded = true;
        m.divisor.s = m.scale;
        m.divisor.inverse = __frcp_rn(m.scale);
        m.divisor.fast = true;
        return m;
    }
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
// sdp_round_clamp to [-L, L] or [0, 2^b - 1] (sdp_store_run_codes keeps its b bits). A NaN code
// becomes 0 (quant::code_bits; never for a coded group), which gives a group that is not coded
// its codes 0: its divisor is NaN (sdp_divisor_uncoded). `t` is the quotient x / s or
// (x - lo) / s.
template <class Q>
__device__ __forceinline__ int32_t sdp_code_of(float t, uint32_t word)
{
    return sdp_round_clamp(Q::stochastic, t, word, Q::symmetric ? -Q::max_code : 0, Q::max_code);
}

// The Philox words of this lane's run of row `row` of a group whose element 0 has Philox index
// `first` (one Philox block per 4 elements); zeros for round half to even, which draws none.
template <class Q, uint32_t E>
__device__ __forceinline__ void sdp_run_words(const sdp_rng& rng, uint64_t first, uint32_t row, uint32_t lane,
                                              uint32_t (&w)[E])
{
#pragma unroll
    for (uint32_t k = 0; k < E; k += 4) {
        if (Q::stochastic) {
            sdp_words4(rng, first + row * 32 * E + lane * E + k, w + k);
        } else {
            w[k] = w[k + 1] = w[k + 2] = w[k + 3] = 0;
        }
    }
}

// Stores the codes of this lane's run whose first element is `element` of the group (packed
// little-endian, b bits each: element 2k in the low nibble of byte k, or one byte per element)
// at their place in the group's `codes`, as whole words. `c` holds the clamped codes as
// integers (sdp_code_of). Packing is one multiply-add per code: a symmetric code c in [-L, L]
// is stored as its low b bits, which are those of c + 2^(b-1) (in [1, 2^b - 1]: no carry
// between fields) with the top bit flipped, so the word is (sum of c_k 2^(bk) + sum of 2^(b-1)
// 2^(bk)) with every field's top bit flipped; unsigned codes are below 2^b already. For E = 4
// and 4-bit codes a run is half a word: lanes 2k and 2k + 1 pair up with one shuffle and lane
// 2k stores the word. All 32 lanes must call it together (with `valid` false for a run past
// the group).
template <class Q, uint32_t E>
__device__ __forceinline__ void sdp_store_run_codes(uint8_t* codes, uint32_t element, const int32_t (&c)[E],
                                                    bool valid, uint32_t lane)
{
    // The top bit of every field of a word (the low 16 bits only for a half word).
    constexpr uint32_t tops = !Q::symmetric  ? 0u
                              : Q::bits == 8 ? 0x80808080u
                              : E == 4       ? 0x8888u
                                             : 0x88888888u;
    uint32_t lo = tops;
    uint32_t hi = tops;
#pragma unroll
    for (uint32_t k = 0; k < E; ++k) {
        const uint32_t code = (uint32_t)c[k];
        if (Q::bits == 4) {
            lo += code << (4 * k);
        } else if (k < 4) {
            lo += code << (8 * k);
        } else {
            hi += code << (8 * (k - 4));
        }
    }
    lo ^= tops;
    hi ^= tops;
    uint8_t* run = codes + element * Q::bits / 8;
    if (E == 4 && Q::bits == 4) {
        // 16 bits per lane: the odd lane's half goes to the even lane's high half.
        const uint32_t odd = __shfl_xor_sync(SDP_FULL_MASK, lo, 1);
        if (valid && lane % 2 == 0) {
            __stcs((unsigned int*)run, lo | (odd << 16));
        }
    } else if (valid) {
        if (E == 8 && Q::bits == 8) {
            __stcs((uint2*)run, make_uint2(lo, hi));
        } else {
            __stcs((unsigned int*)run, lo);
        }
    }
}

// The codes of the `Rows` rows from row r0 of a group (`row` as for sdp_stats_add) under
// `meta`, stored into the group's `codes`. `words(row, w)` gives this lane's Philox words of a
// row of the group (sdp_run_words, or words drawn earlier). Rows past the group are skipped.
// All 32 lanes must call it together.
template <class Q, uint32_t E, uint32_t Rows, class Row, class Words>
__device__ __forceinline__ void sdp_encode_rows(Row& row, const sdp_group_meta& meta, Words& words, uint8_t* codes,
                                                uint32_t r0, uint32_t lane)
{
    using R = sdp_rows<E, Q::group_size>;
#pragma unroll
    for (uint32_t r = 0; r < Rows; ++r) {
        if (r0 + r >= R::count) {
            break;
        }
        const bool valid = R::in_group(r0 + r, lane);
        float quotient[E];
        if (valid) {
            float x[E];
            row(r, x);
#pragma unroll
            for (uint32_t k = 0; k < E; ++k) {
                x[k] = Q::symmetric ? x[k] : __fsub_rn(x[k], meta.offset);
            }
            sdp_divide_run<E>(meta.divisor, x, quotient);
        }
        uint32_t w[E];
        words(r0 + r, w);
        int32_t c[E];
#pragma unroll
        for (uint32_t k = 0; k < E; ++k) {
            c[k] = valid ? sdp_code_of<Q>(quotient[k], w[k]) : 0;
        }
        sdp_store_run_codes<Q, E>(codes, (r0 + r) * 32 * E + lane * E, c, valid, lane);
    }
}

// Writes the group's scale (and offset) from lane 0.
template <class Q>
__device__ __forceinline__ void sdp_store_meta(const sdp_group_meta& meta, float* scale, float* offset, uint32_t lane)
{
    if (lane == 0) {
        *scale = meta.scale;
        if (!Q::symmetric) {
            *offset = meta.offset;
        }
    }
}

// Quantizes a group the warp holds (all sdp_rows<E, g>::count rows; `row` as for sdp_stats_add,
// zeros for runs past the group) into `codes`, `scale` and `offset` (null for symmetric slabs).
// `words` as for sdp_encode_rows. All 32 lanes must call it together.
template <class Q, uint32_t E, class Row, class Words>
__device__ __forceinline__ void sdp_quantize_held(Row& row, Words& words, uint8_t* codes, float* scale, float* offset,
                                                  uint32_t lane)
{
    constexpr uint32_t rows = sdp_rows<E, Q::group_size>::count;
    sdp_group_stats stats = sdp_stats_empty();
    sdp_stats_add<Q, E, rows>(stats, row, 0, lane);
    const sdp_group_meta meta = sdp_meta_of<Q>(sdp_stats_reduce<Q>(stats));
    sdp_encode_rows<Q, E, rows>(row, meta, words, codes, 0, lane);
    sdp_store_meta<Q>(meta, scale, offset, lane);
}

// Quantizes a group longer than a lane's registers hold, tile by tile: `load(r0, v)` fills this
// lane's values of the tile of sdp_rows' tile_rows rows from row r0 (zeros past the group) and
// is called by all 32 lanes together, twice per tile (for the statistics, then for the codes).
template <class Q, uint32_t E, class Load, class Words>
__device__ __forceinline__ void sdp_quantize_tiled(Load& load, Words& words, uint8_t* codes, float* scale,
                                                   float* offset, uint32_t lane)
{
    using R = sdp_rows<E, Q::group_size>;
    float v[R::tile_values];
    auto row = sdp_rows_of<E>(v);
    sdp_group_stats stats = sdp_stats_empty();
    for (uint32_t r0 = 0; r0 < R::count; r0 += R::tile_rows) {
        load(r0, v);
        sdp_stats_add<Q, E, R::tile_rows>(stats, row, r0, lane);
    }
    const sdp_group_meta meta = sdp_meta_of<Q>(sdp_stats_reduce<Q>(stats));
    for (uint32_t r0 = 0; r0 < R::count; r0 += R::tile_rows) {
        load(r0, v);
        sdp_encode_rows<Q, E, R::tile_rows>(row, meta, words, codes, r0, lane);
    }
    sdp_store_meta<Q>(meta, scale, offset, lane);
}
