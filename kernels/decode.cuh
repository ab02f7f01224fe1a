// The group dequantizer (codec::quant::dequantize_group, codec::slab::SlabView::decode_group)
// for a quantizer Q fixed at compile time (spec.cuh), and the slab-order sum of the same group
// over the slabs of several peers (gradient::sum_groups), with every load of a batch of peers
// (and of several groups) issued before the first value is computed.
#pragma once

#include "slab.cuh"

// Zero fields of 4-bit fields: the borrow of (x - 0x11111111) reaches a field's top bit, with
// that bit clear in x, exactly when some field is zero (a borrow only propagates upwards past
// a zero field, so a field above the first zero one may be marked too, but never when none is
// zero). sdp_zero_field_borrows gives those bits of a word before the top bits are selected,
// so the marks of many words can be OR-ed and tested once by sdp_run_codes_corrupt on their
// lowest fields.
__device__ __forceinline__ uint32_t sdp_zero_field_borrows(uint32_t word)
{
    return (word - 0x11111111u) & ~word;
}

// The bytes 0x80 (the code -128) of a word, at their top bits, among other bits
// sdp_run_codes_corrupt ignores: a byte's low 7 bits plus 0x7f carry into its top bit (and
// never past it) exactly when they are not all zero, so the top bit of the word's byte without
// that carry is set exactly for 0x80. Two instructions and the OR into the marks, which folds
// into the last one (no false positive, unlike the borrow test).
__device__ __forceinline__ uint32_t sdp_byte_0x80_marks(uint32_t word)
{
    return word & ~((word & 0x7f7f7f7fu) + 0x7f7f7f7fu);
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

// Where the codes of a lane's run of E elements lie in its group's codes, read as whole words:
// `words` aligned 32-bit words from byte `offset(element)`, the run's codes from bit
// `shift(element)` of the first (a 4-bit run of E = 4 is half of the word it shares with the
// neighbouring lane, which holds codes of the same group).
template <class Q, uint32_t E>
struct sdp_run_codes {
    static constexpr uint32_t words = Q::bits * E > 32 ? 2 : 1;

    __device__ static __forceinline__ uint32_t offset(uint32_t element)
    {
        return Q::bits == 4 ? (element / 2) & ~3u : element;
    }

    __device__ static __forceinline__ uint32_t shift(uint32_t element)
    {
        return Q::bits == 4 && E == 4 ? 8 * ((element / 2) & 3u) : 0;
    }

    // Loads the run's words at `codes` + offset(element).
    __device__ static __forceinline__ void load(const uint8_t* codes, uint32_t element, uint32_t (&w)[words])
    {
        const uint8_t* at = codes + offset(element);
        if constexpr (words == 2) {
            const uint2 pair = __ldg((const uint2*)at);
            w[0] = pair.x;
            w[1] = pair.y;
        } else {
            w[0] = __ldg((const unsigned int*)at);
        }
    }

    // The E codes of the run as exact fp32 values from its words: signed nibbles or bytes
    // (symmetric) or unsigned ones. ORs into `marks` the marks of its words by which
    // `corrupt` finds a symmetric code -2^(b-1), which the quantizer never writes. A byte is
    // converted in one instruction (sdp_byte_as_float); a signed nibble c is decoded as the
    // unsigned nibble of c + 8 (the word with every nibble's top bit flipped) minus 8, where
    // the code -8 is the zero nibble.
    __device__ static __forceinline__ void decode(const uint32_t (&w)[words], uint32_t element, float (&c)[E],
                                                  uint32_t& marks)
    {
        if constexpr (Q::bits == 8) {
#pragma unroll
            for (uint32_t j = 0; j < words; ++j) {
                if (Q::symmetric) {
                    marks |= sdp_byte_0x80_marks(w[j]);
                }
            }
#pragma unroll
            for (uint32_t k = 0; k < E; ++k) {
                c[k] = sdp_byte_as_float(w[k / 4], k % 4, Q::symmetric);
            }
        } else {
            uint32_t lo = w[0] >> shift(element);
            float bias = 0.0f;
            if (Q::symmetric) {
                lo ^= 0x88888888u;
                bias = 8.0f;
                marks |= sdp_zero_field_borrows(lo);
            }
#pragma unroll
            for (uint32_t k = 0; k < E; ++k) {
                c[k] = sdp_nibble_as_float(lo, k, bias);
            }
        }
    }

    // Whether the marks `decode` OR-ed for runs of a symmetric group show a corrupt code: the
    // E fields of a run, in its first word (and the second word's four).
    __device__ static __forceinline__ bool corrupt(uint32_t marks)
    {
        constexpr uint32_t tops = Q::bits == 4 ? 0x88888888u : 0x80808080u;
        constexpr uint32_t fields = Q::bits == 4 ? E : (E < 4 ? E : 4);
        constexpr uint32_t used = fields * Q::bits >= 32 ? 0xffffffffu : (1u << (fields * Q::bits)) - 1;
        return Q::symmetric && (marks & tops & used) != 0;
    }
};

// The dequantized value of code c (an exact fp32 integer): c * s (symmetric) or lo + c * s
// (asymmetric).
template <class Q>
__device__ __forceinline__ float sdp_dequantize(float c, float scale, float offset)
{
    const float value = __fmul_rn(c, scale);
    return Q::symmetric ? value : __fadd_rn(offset, value);
}

// A received group's scale and offset as loaded (0 for symmetric groups and absent peers).
struct sdp_group_scale {
    float scale;
    float offset;
};

// Group k's scale and offset in `slab`, loaded when `present`.
template <class Q>
__device__ __forceinline__ sdp_group_scale sdp_load_group_scale(const uint8_t* slab, const sdp_slab& layout,
                                                                uint64_t k, bool present)
{
    sdp_group_scale m;
    m.scale = present ? __ldg((const float*)(slab + sdp_scale_offset<Q>(layout, k))) : 0.0f;
    m.offset = present && !Q::symmetric ? __ldg((const float*)(slab + sdp_offset_offset<Q>(layout, k))) : 0.0f;
    return m;
}

// Whether a received group's metadata is corrupt: scale negative or infinite, offset infinite.
__device__ __forceinline__ bool sdp_scale_corrupt(const sdp_group_scale& m)
{
    return m.scale < 0.0f || sdp_is_inf(m.scale) || sdp_is_inf(m.offset);
}

// The group's scale and offset to decode with: both NaN when the metadata is corrupt, so that
// every value dequantized from them is NaN.
__device__ __forceinline__ sdp_group_scale sdp_checked_scale(sdp_group_scale m)
{
    if (sdp_scale_corrupt(m)) {
        m.scale = sdp_nan();
        m.offset = sdp_nan();
    }
    return m;
}

// One peer's group as this lane loads it: the scale and offset, and the code words of the
// lane's runs of `Rows` rows (zeros for runs past the group or an absent peer).
template <class Q, uint32_t E, uint32_t Rows>
struct sdp_peer_group {
    using C = sdp_run_codes<Q, E>;
    sdp_group_scale meta;
    uint32_t words[Rows][C::words];

    // Issues the loads of group k of `slab` for the rows from row r0, when `present`.
    __device__ __forceinline__ void load(const uint8_t* slab, const sdp_slab& layout, uint64_t k, uint32_t r0,
                                         uint32_t lane, bool present)
    {
        using R = sdp_rows<E, Q::group_size>;
        meta = sdp_load_group_scale<Q>(slab, layout, k, present);
        const uint8_t* codes = slab + sdp_codes_offset<Q>(k);
#pragma unroll
        for (uint32_t r = 0; r < Rows; ++r) {
            if (present && R::in_group(r0 + r, lane)) {
                C::load(codes, R::element(r0, r * E, lane), words[r]);
            } else {
#pragma unroll
                for (uint32_t j = 0; j < C::words; ++j) {
                    words[r][j] = 0;
                }
            }
        }
    }

    // Whether the group's metadata is corrupt (sdp_scale_corrupt).
    __device__ __forceinline__ bool meta_corrupt() const
    {
        return sdp_scale_corrupt(meta);
    }

    // The group's scale and offset to decode with (sdp_checked_scale).
    __device__ __forceinline__ sdp_group_scale scale() const
    {
        return sdp_checked_scale(meta);
    }

    // This lane's dequantized values of its run of row r0 + r (in the group) under `m`; ORs the
    // code marks into `marks`.
    __device__ __forceinline__ void row_values(uint32_t r, const sdp_group_scale& m, uint32_t r0, uint32_t lane,
                                               float (&x)[E], uint32_t& marks) const
    {
        float c[E];
        C::decode(words[r], sdp_rows<E, Q::group_size>::element(r0, r * E, lane), c, marks);
#pragma unroll
        for (uint32_t e = 0; e < E; ++e) {
            x[e] = sdp_dequantize<Q>(c[e], m.scale, m.offset);
        }
    }

    // v = x (`first`: the first slab of the sum) or v + x, x the group's dequantized values of
    // this lane's runs in the group; ORs the code marks into `marks`.
    __device__ __forceinline__ void add_to(float (&v)[Rows * E], bool first, uint32_t r0, uint32_t lane,
                                           uint32_t& marks) const
    {
        using R = sdp_rows<E, Q::group_size>;
        const sdp_group_scale m = scale();
#pragma unroll
        for (uint32_t r = 0; r < Rows; ++r) {
            if (R::in_group(r0 + r, lane)) {
                float x[E];
                row_values(r, m, r0, lane, x, marks);
#pragma unroll
                for (uint32_t e = 0; e < E; ++e) {
                    v[r * E + e] = first ? x[e] : __fadd_rn(v[r * E + e], x[e]);
                }
            }
        }
    }
};

// The slab-order sum over the `peers` consecutive slabs of `recv` of dequantize(group k[n]),
// out = deq(slab 0); out = out + deq(slab 1); ... (gradient::sum_groups), for the `Groups`
// groups of a unit (group n only when n < present), this lane's `Rows` rows from row r0 of
// each: zeros for runs past the group. The loads of the first `Batch` peers of every group are
// all issued before any value is computed; further peers follow batch by batch. A corrupt
// group makes its sum NaN: corrupt metadata in every lane, a corrupt code in the lane that
// decodes it, which sets corrupt[n] (the caller turns the whole group to NaN). All 32 lanes
// must call it together.
template <class Q, uint32_t E, uint32_t Rows, uint32_t Batch, uint32_t Groups>
__device__ __forceinline__ void sdp_sum_peers(const uint8_t* recv, const sdp_slab& layout, uint32_t peers,
                                              const uint64_t (&k)[Groups], uint32_t present, uint32_t r0,
                                              uint32_t lane, float (&v)[Groups][Rows * E], bool (&corrupt)[Groups])
{
    uint32_t marks[Groups];
    sdp_peer_group<Q, E, Rows> loaded[Groups][Batch];
#pragma unroll
    for (uint32_t n = 0; n < Groups; ++n) {
        marks[n] = 0;
#pragma unroll
        for (uint32_t i = 0; i < Rows * E; ++i) {
            v[n][i] = 0.0f;
        }
#pragma unroll
        for (uint32_t p = 0; p < Batch; ++p) {
            loaded[n][p].load(recv + p * layout.byte_len, layout, k[n], r0, lane, n < present && p < peers);
        }
    }
#pragma unroll
    for (uint32_t n = 0; n < Groups; ++n) {
#pragma unroll
        for (uint32_t p = 0; p < Batch; ++p) {
            if (n < present && p < peers) {
                loaded[n][p].add_to(v[n], p == 0, r0, lane, marks[n]);
            }
        }
    }
    // Peers past the first batch (more peers than the spec's batch), batch by batch.
    for (uint32_t p0 = Batch; p0 < peers; p0 += Batch) {
#pragma unroll
        for (uint32_t n = 0; n < Groups; ++n) {
            if (n >= present) {
                break;
            }
            sdp_peer_group<Q, E, Rows> more[Batch];
#pragma unroll
            for (uint32_t p = 0; p < Batch; ++p) {
                more[p].load(recv + (p0 + p) * layout.byte_len, layout, k[n], r0, lane, p0 + p < peers);
            }
#pragma unroll
            for (uint32_t p = 0; p < Batch; ++p) {
                if (p0 + p < peers) {
                    more[p].add_to(v[n], false, r0, lane, marks[n]);
                }
            }
        }
    }
#pragma unroll
    for (uint32_t n = 0; n < Groups; ++n) {
        corrupt[n] = sdp_run_codes<Q, E>::corrupt(marks[n]);
    }
}
