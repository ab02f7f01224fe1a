// weight_apply: every rank's pass of the quantized weight all-gather (docs/numerics.md §7.3).
//
// Mirrors backend::cpu::weight::apply_shards (and apply_run): decode the `world` received
// slabs (slab z encodes shard z) into the whole bf16 param bucket:
//   difference: params = bf16_rn(f32(ref) + d'), ref = own_reference for shard me, else the
//               current params (the live model parameters);
//   direct:     params = bf16_rn(x').
//
// Spec: sdp_weight_spec<quantizer, difference, groups per unit> (spec.cuh).
// Work unit: Groups consecutive groups j of one shard z, handled by one warp, grid-stride over
// world * ceil(real_groups / Groups) units, real_groups = ceil(shard_len / g) (the groups holding
// real elements; the rest of each slab is padding and is not read, as on the CPU). Each lane
// holds runs of 8 consecutive elements (common.cuh): one word of 4-bit codes, one 16-byte load
// and store of params where aligned. The scale, the code words and the old params of every row
// of the unit's groups are loaded before any is decoded (a group of up to 2048 elements; a
// longer one tile by tile).
//
// Indexing: element e of group j of shard z is shard element i = j * g + e, written when
// i < shard_len (the last group may be partial) to params[z * shard_len + i];
// own_reference is indexed by i (this rank's previous shard, shard_len elements).
//
// A corrupt group (see common.cuh) decodes to NaN, so its elements become bf16 NaN; the CPU
// returns Error::Decode there. Lanes check the codes they decode and the warp votes once the
// group is written: a corrupt group is then overwritten with NaN.
//
// `params` is read and written by this kernel (each element by the lane that writes it), so it
// is not declared __restrict__ and is read through L2 (__ldcg), never the read-only path,
// which is only correct for data nothing writes during the kernel.
#include "decode.cuh"

// Cold path: the new params of an unaligned or partial run of 8 elements at shard element i
// (values d, decoded), element by element where i + e < shard_len.
template <bool Difference>
static __device__ SDP_NOINLINE void apply_elements(const uint16_t* ref, uint16_t* shard, uint64_t shard_len,
                                                   uint64_t i, float4 low, float4 high)
{
    const float d[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
    for (uint32_t e = 0; e < 8; ++e) {
        if (i + e < shard_len) {
            float x = d[e];
            if (Difference) {
                x = __fadd_rn(sdp_bf16_to_f32(ref[i + e]), x);
            }
            shard[i + e] = sdp_f32_to_bf16(x);
        }
    }
}

// bf16_rn(ref + d) (difference) or bf16_rn(d) of a vector of 8, packed as it is stored.
template <bool Difference>
__device__ __forceinline__ uint4 apply_vector(uint4 old, const float (&d)[8])
{
    uint32_t w[4];
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
        uint32_t word = 0;
#pragma unroll
        for (uint32_t h = 0; h < 2; ++h) {
            float x = d[2 * k + h];
            if (Difference) {
                x = __fadd_rn(sdp_bf16_to_f32(sdp_half(sdp_word_of(old, k), h)), x);
            }
            word |= (uint32_t)sdp_f32_to_bf16(x) << (16 * h);
        }
        w[k] = word;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// One group's loads for this lane: the scale (and offset), the code words of its runs of `Rows`
// rows and the old params of each run (for the difference), with which runs go by vector.
template <class Spec, uint32_t Rows>
struct group_loads {
    using Q = typename Spec::quant;
    using R = sdp_rows<8, Q::group_size>;
    sdp_peer_group<Q, 8, Rows> codes;
    uint4 old[Rows];
    bool vector[Rows];

    // Issues the loads of group j of shard z from row r0.
    __device__ __forceinline__ void load(const uint8_t* __restrict__ recv, const uint16_t* __restrict__ own_reference,
                                         uint16_t* params, const sdp_weight_apply& args, uint64_t z, uint64_t j,
                                         uint32_t r0, uint32_t lane)
    {
        codes.load(sdp_slab_at(recv, args.slab, z), args.slab, j, r0, lane, true);
        const bool own = Spec::difference && z == args.me;
        const uint16_t* ref = own ? own_reference : params + z * args.shard_len;
        uint16_t* shard = params + z * args.shard_len;
#pragma unroll
        for (uint32_t t = 0; t < Rows; ++t) {
            const uint64_t i = j * Q::group_size + R::element(r0, 8 * t, lane);
            vector[t] = R::in_group(r0 + t, lane) && i + 8 <= args.shard_len && sdp_aligned(shard + i, 16) &&
                        (!Spec::difference || sdp_aligned(ref + i, 16));
            old[t] = vector[t] && Spec::difference ? sdp_load_u16x8(ref + i, !own) : make_uint4(0, 0, 0, 0);
        }
    }

    // Decodes and writes the group's real elements; returns whether the group's metadata is
    // corrupt or this lane found a corrupt code (every code of the group is checked, those of
    // the padding too, as on the CPU).
    __device__ __forceinline__ bool apply(const uint16_t* __restrict__ own_reference, uint16_t* params,
                                          const sdp_weight_apply& args, uint64_t z, uint64_t j, uint32_t r0,
                                          uint32_t lane) const
    {
        const bool own = Spec::difference && z == args.me;
        const uint16_t* ref = own ? own_reference : params + z * args.shard_len;
        uint16_t* shard = params + z * args.shard_len;
        const sdp_group_scale m = codes.scale();
        uint32_t marks = 0;
#pragma unroll
        for (uint32_t t = 0; t < Rows; ++t) {
            if (!R::in_group(r0 + t, lane)) {
                continue;
            }
            float d[8];
            codes.row_values(t, m, r0, lane, d, marks);
            const uint64_t i = j * Q::group_size + R::element(r0, 8 * t, lane);
            if (i >= args.shard_len) {
                continue;
            }
            if (vector[t]) {
                sdp_store_u16x8(shard + i, apply_vector<Spec::difference>(old[t], d));
            } else {  // Cold path: an unaligned or partial run, element by element.
                apply_elements<Spec::difference>(ref, shard, args.shard_len, i, make_float4(d[0], d[1], d[2], d[3]),
                                                 make_float4(d[4], d[5], d[6], d[7]));
            }
        }
        return codes.meta_corrupt() || sdp_run_codes<Q, 8>::corrupt(marks);
    }
};

// Cold path, out of line: NaN to every real element of group j of shard z (a corrupt group).
template <class Q>
static __device__ SDP_NOINLINE void store_group_nan(uint16_t* shard, uint64_t shard_len, uint64_t j, uint32_t lane)
{
    using R = sdp_rows<8, Q::group_size>;
    const uint16_t nan = sdp_f32_to_bf16(sdp_nan());
    for (uint32_t r = 0; r < R::count; ++r) {
        const uint64_t i = j * Q::group_size + R::element(r, 0, lane);
#pragma unroll
        for (uint32_t e = 0; e < 8; ++e) {
            if (R::in_group(r, lane) && i + e < shard_len) {
                shard[i + e] = nan;
            }
        }
    }
}

template <class Spec>
__device__ __forceinline__ void weight_apply_of(const uint8_t* __restrict__ recv,
                                                const uint16_t* __restrict__ own_reference, uint16_t* params,
                                                const sdp_weight_apply& args)
{
    using Q = typename Spec::quant;
    using R = sdp_rows<8, Q::group_size>;
    constexpr uint32_t g = Q::group_size;
    constexpr uint32_t groups = Spec::groups;
    static_assert(R::tiles == 1 || groups == 1, "one group per unit when a group is walked in tiles");
    const uint32_t lane = sdp_lane();
    const uint64_t real_groups = (args.shard_len + g - 1) / g;
    const uint64_t per_shard = (real_groups + groups - 1) / groups;
    const uint64_t units = (uint64_t)args.world * per_shard;

    for (uint64_t u = sdp_warp_id(); u < units; u += sdp_warp_count()) {
        // Units fit in 32 bits (the launch checks), so the index arithmetic is 32-bit.
        const uint64_t z = (uint32_t)u / (uint32_t)per_shard;
        const uint64_t j0 = (uint32_t)u % (uint32_t)per_shard * groups;
        const uint32_t present = real_groups - j0 < groups ? (uint32_t)(real_groups - j0) : groups;
        uint16_t* shard = params + z * args.shard_len;
        if constexpr (R::tiles == 1) {
            group_loads<Spec, R::count> loads[groups];
#pragma unroll
            for (uint32_t n = 0; n < groups; ++n) {
                if (n < present) {
                    loads[n].load(recv, own_reference, params, args, z, j0 + n, 0, lane);
                }
            }
#pragma unroll
            for (uint32_t n = 0; n < groups; ++n) {
                if (n >= present) {
                    break;
                }
                const bool corrupt = loads[n].apply(own_reference, params, args, z, j0 + n, 0, lane);
                if (__any_sync(SDP_FULL_MASK, corrupt)) {  // Cold path: a corrupt group.
                    store_group_nan<Q>(shard, args.shard_len, j0 + n, lane);
                }
            }
        } else {
            bool corrupt = false;
            for (uint32_t r0 = 0; r0 < R::count; r0 += R::tile_rows) {
                group_loads<Spec, R::tile_rows> loads;
                loads.load(recv, own_reference, params, args, z, j0, r0, lane);
                corrupt |= loads.apply(own_reference, params, args, z, j0, r0, lane);
            }
            if (__any_sync(SDP_FULL_MASK, corrupt)) {  // Cold path: a corrupt group.
                store_group_nan<Q>(shard, args.shard_len, j0, lane);
            }
        }
    }
}
