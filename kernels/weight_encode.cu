// weight_encode: the owner's pass of the quantized weight all-gather (docs/numerics.md §7.3).
//
// Mirrors backend::cpu::weight::encode_shard (and encode_run): quantize this rank's shard,
// x = f32(new) - f32(reference) (qWD, the spec's difference) or x = f32(new) (direct),
// computed in fp32 and zero beyond shard_len, into one slab.
//
// Spec: sdp_weight_spec<quantizer, difference, groups per unit> (spec.cuh).
// Work unit: Groups consecutive groups j of the slab, handled by one warp, grid-stride over
// ceil(slab.groups / Groups) units. Each lane holds runs of 8 consecutive elements
// (common.cuh): one 16-byte load of each input where aligned, two Philox blocks, one word of
// 4-bit codes. A group of up to 2048 elements is held in registers as its bf16 vectors in one
// pass (the loads of all its rows, and of the unit's other groups, issued first); a longer one
// is walked in tiles, loaded twice.
//
// Indexing: element e of group j is shard element i = j * g + e, real when i < shard_len,
// else 0 (padding; the slab covers the padded shard); its Philox index is first_index + i.
#include "quantize.cuh"

// The bf16 value of element e of a vector of 8 as fp32, a NaN kept as it is (only NaN-ness
// matters here: a NaN makes its group non-finite, scale NaN and codes 0, whatever its payload).
__device__ __forceinline__ float element_of(uint4 words, uint32_t e)
{
    const uint32_t word = sdp_word_of(words, e / 2);
    return e % 2 == 0 ? sdp_bf16_low_to_f32_raw(word) : sdp_bf16_high_to_f32_raw(word);
}

// Eight fp32 values.
struct f32x8 {
    float4 low;
    float4 high;
};

// Shard elements i .. i + 7 as fp32 (the difference from the reference when `Difference`), one
// by one, zeros past shard_len: the fallback of an unaligned or partial run, out of line (a
// call per run in the loop, not the element-by-element code).
template <bool Difference>
static __device__ SDP_NOINLINE f32x8 load_eight(const uint16_t* __restrict__ new_shard,
                                                const uint16_t* __restrict__ reference, uint64_t shard_len,
                                                uint64_t i)
{
    float x[8];
#pragma unroll
    for (uint32_t e = 0; e < 8; ++e) {
        x[e] = 0.0f;
        if (i + e < shard_len) {
            x[e] = sdp_bf16_low_to_f32_raw(new_shard[i + e]);
            if (Difference) {
                x[e] = __fsub_rn(x[e], sdp_bf16_low_to_f32_raw(reference[i + e]));
            }
        }
    }
    return f32x8{make_float4(x[0], x[1], x[2], x[3]), make_float4(x[4], x[5], x[6], x[7])};
}

// This lane's runs of the `Rows` rows from row r0 of group j as loaded: the new and reference
// bf16 vectors of the runs that go by vector (wholly real and aligned), the rest read element
// by element when their values are asked for (zeros past the group and past shard_len). The
// values (the difference when `Difference`) are computed from the held vectors each time they
// are asked for, twice per group: half the registers of holding them as fp32.
template <class Spec, uint32_t Rows>
struct held_runs {
    using Q = typename Spec::quant;
    using R = sdp_rows<8, Q::group_size>;
    uint4 n[Rows];
    uint4 r[Rows];
    bool vector[Rows];
    uint64_t first;  // shard element of element 0 of row r0 of this lane's runs' group
    uint32_t r0;

    // Issues the vector loads.
    __device__ __forceinline__ void load(const uint16_t* __restrict__ new_shard, const uint16_t* __restrict__ reference,
                                         const sdp_weight_encode& args, uint64_t j, uint32_t row0, uint32_t lane)
    {
        first = j * Q::group_size;
        r0 = row0;
#pragma unroll
        for (uint32_t t = 0; t < Rows; ++t) {
            const uint64_t i = first + R::element(r0, 8 * t, lane);
            vector[t] = R::in_group(r0 + t, lane) && i + 8 <= args.shard_len && sdp_aligned(new_shard + i, 16) &&
                        (!Spec::difference || sdp_aligned(reference + i, 16));
            n[t] = vector[t] ? sdp_load_u16x8(new_shard + i, false) : make_uint4(0, 0, 0, 0);
            r[t] = vector[t] && Spec::difference ? sdp_load_u16x8(reference + i, false) : make_uint4(0, 0, 0, 0);
        }
    }

    // This lane's 8 values of row r0 + t.
    __device__ __forceinline__ void values(const uint16_t* __restrict__ new_shard, const uint16_t* __restrict__ reference,
                                           const sdp_weight_encode& args, uint32_t t, uint32_t lane, float (&x)[8]) const
    {
        if (vector[t]) {
#pragma unroll
            for (uint32_t e = 0; e < 8; ++e) {
                x[e] = element_of(n[t], e);
                if (Spec::difference) {
                    x[e] = __fsub_rn(x[e], element_of(r[t], e));
                }
            }
        } else if (R::in_group(r0 + t, lane)) {  // Cold path: an unaligned or partial run.
            const f32x8 part = load_eight<Spec::difference>(new_shard, reference, args.shard_len,
                                                            first + R::element(r0, 8 * t, lane));
            x[0] = part.low.x;
            x[1] = part.low.y;
            x[2] = part.low.z;
            x[3] = part.low.w;
            x[4] = part.high.x;
            x[5] = part.high.y;
            x[6] = part.high.z;
            x[7] = part.high.w;
        } else {
#pragma unroll
            for (uint32_t e = 0; e < 8; ++e) {
                x[e] = 0.0f;
            }
        }
    }
};

template <class Spec>
__device__ __forceinline__ void weight_encode_of(const uint16_t* __restrict__ new_shard,
                                                 const uint16_t* __restrict__ reference, uint8_t* __restrict__ out,
                                                 const sdp_weight_encode& args)
{
    using Q = typename Spec::quant;
    using R = sdp_rows<8, Q::group_size>;
    constexpr uint32_t g = Q::group_size;
    constexpr uint32_t groups = Spec::groups;
    static_assert(R::tiles == 1 || groups == 1, "one group per unit when a group is walked in tiles");
    const sdp_slab& layout = args.slab;
    const uint32_t lane = sdp_lane();
    const uint64_t units = (layout.groups + groups - 1) / groups;

    for (uint64_t u = sdp_warp_id(); u < units; u += sdp_warp_count()) {
        const uint64_t j0 = u * groups;
        const uint32_t present = layout.groups - j0 < groups ? (uint32_t)(layout.groups - j0) : groups;
        auto codes = [&](uint32_t n) { return out + sdp_codes_offset<Q>(j0 + n); };
        auto scale = [&](uint32_t n) { return (float*)(out + sdp_scale_offset<Q>(layout, j0 + n)); };
        auto offset = [&](uint32_t n) {
            return Q::symmetric ? nullptr : (float*)(out + sdp_offset_offset<Q>(layout, j0 + n));
        };
        auto drawn = [&](uint32_t n) {
            return [&, n](uint32_t row, uint32_t(&w)[8]) {
                sdp_run_words<Q, 8>(args.rng, args.first_index + (j0 + n) * g, row, lane, w);
            };
        };
        if constexpr (R::tiles == 1) {
            held_runs<Spec, R::count> held[groups];
#pragma unroll
            for (uint32_t n = 0; n < groups; ++n) {
                if (n < present) {
                    held[n].load(new_shard, reference, args, j0 + n, 0, lane);
                }
            }
#pragma unroll
            for (uint32_t n = 0; n < groups; ++n) {
                if (n >= present) {
                    break;
                }
                auto row = [&, n](uint32_t t, float(&x)[8]) { held[n].values(new_shard, reference, args, t, lane, x); };
                auto late = drawn(n);
                sdp_quantize_held<Q, 8>(row, late, codes(n), scale(n), offset(n), lane);
            }
        } else {
            auto load = [&](uint32_t r0, float(&v)[R::tile_values]) {
                held_runs<Spec, R::tile_rows> tile;
                tile.load(new_shard, reference, args, j0, r0, lane);
#pragma unroll
                for (uint32_t t = 0; t < R::tile_rows; ++t) {
                    float x[8];
                    tile.values(new_shard, reference, args, t, lane, x);
#pragma unroll
                    for (uint32_t e = 0; e < 8; ++e) {
                        v[8 * t + e] = x[e];
                    }
                }
            };
            auto late = drawn(0);
            sdp_quantize_tiled<Q, 8>(load, late, codes(0), scale(0), offset(0), lane);
        }
    }
    sdp_zero_slabs_padding<Q>(out, layout, 1, lane);
}
