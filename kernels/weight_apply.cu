// weight_apply: every rank's pass of the quantized weight all-gather (docs/numerics.md §7.3).
//
// Mirrors backend::cpu::weight::apply_shards (and apply_run): decode the `world` received
// slabs (slab z encodes shard z) into the whole bf16 param bucket:
//   difference: params = bf16_rn(f32(ref) + d'), ref = own_reference for shard me, else the
//               current params (the live model parameters);
//   direct:     params = bf16_rn(x').
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one group j of one shard z, handled by one warp (8 per block), grid-stride over
// world * ceil(shard_len / g) groups (the groups holding real elements; the rest of each
// slab is padding and is not read, as on the CPU). Unit u is z = u / real_groups,
// j = u % real_groups. Each lane holds runs of 8 consecutive elements (common.cuh): one word
// of 4-bit codes, one 16-byte load and store of params where aligned.
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
#include "common.cuh"

// The new params of this lane's run of 8 elements at shard element i of shard z (values d,
// decoded): bf16_rn(ref + d) or bf16_rn(d), written where i + e < shard_len.
__device__ __forceinline__ void apply_run(const uint16_t* __restrict__ own_reference, uint16_t* shard,
                                          const sdp_weight_apply& args, bool own, uint64_t i, const float* d)
{
    const uint16_t* ref = own ? own_reference : shard;
    const bool vector = i + 8 <= args.shard_len && sdp_aligned(shard + i, 16) &&
                        (!args.difference || sdp_aligned(ref + i, 16));
    if (vector) {
        uint4 old = make_uint4(0, 0, 0, 0);
        if (args.difference) {
            old = sdp_load_u16x8(ref + i, !own);
        }
        uint32_t w[4];
#pragma unroll
        for (uint32_t k = 0; k < 4; ++k) {
            uint32_t word = 0;
#pragma unroll
            for (uint32_t h = 0; h < 2; ++h) {
                float x = d[2 * k + h];
                if (args.difference) {
                    x = __fadd_rn(sdp_bf16_to_f32(sdp_half(sdp_word_of(old, k), h)), x);
                }
                word |= (uint32_t)sdp_f32_to_bf16(x) << (16 * h);
            }
            w[k] = word;
        }
        sdp_store_u16x8(shard + i, make_uint4(w[0], w[1], w[2], w[3]));
    } else {  // Cold path: an unaligned or partial run, element by element.
#pragma unroll
        for (uint32_t e = 0; e < 8; ++e) {
            if (i + e < args.shard_len) {
                float x = d[e];
                if (args.difference) {
                    x = __fadd_rn(sdp_bf16_to_f32(ref[i + e]), x);
                }
                shard[i + e] = sdp_f32_to_bf16(x);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 4)
weight_apply(const uint8_t* __restrict__ recv, const uint16_t* __restrict__ own_reference, uint16_t* params,
             sdp_weight_apply args)
{
    const sdp_slab& layout = args.slab;
    const sdp_quant& q = layout.quant;
    const uint32_t g = q.group_size;
    const uint32_t lane = sdp_lane();
    const uint64_t real_groups = (args.shard_len + g - 1) / g;
    const uint64_t units = (uint64_t)args.world * real_groups;

    for (uint64_t u = sdp_warp_id(); u < units; u += sdp_warp_count()) {
        // Units fit in 32 bits (the launch checks), so the index arithmetic is 32-bit.
        const uint64_t z = (uint32_t)u / (uint32_t)real_groups;
        const uint64_t j = (uint32_t)u % (uint32_t)real_groups;
        const sdp_coded_group grp = sdp_slab_group(sdp_slab_at(recv, layout, z), layout, j);
        bool corrupt = sdp_meta_corrupt(grp);
        const bool own = args.difference && z == args.me;
        uint16_t* shard = params + z * args.shard_len;

        for (uint32_t t = 0; t < sdp_tiles(g); ++t) {
            const uint64_t i = j * g + sdp_tile_element<8>(t, 0, lane);
            if (!sdp_run_in_group<8>(g, t, 0, lane)) {
                continue;
            }
            // Every code of the group is checked, those of the padding too (as on the CPU).
            float c[8];
            uint32_t marks = 0;
            sdp_load_run_codes<8>(q, grp.codes, t, 0, lane, c, marks);
            corrupt |= sdp_run_codes_corrupt<8>(q, marks);
            if (i < args.shard_len) {
                float d[8];
#pragma unroll
                for (uint32_t e = 0; e < 8; ++e) {
                    d[e] = sdp_dequantize(q, grp, c[e]);
                }
                apply_run(own_reference, shard, args, own, i, d);
            }
        }
        if (__any_sync(SDP_FULL_MASK, corrupt)) {  // Cold path: a corrupt group.
            const uint16_t nan = sdp_f32_to_bf16(sdp_nan());
            for (uint32_t t = 0; t < sdp_tiles(g); ++t) {
                const uint64_t i = j * g + sdp_tile_element<8>(t, 0, lane);
#pragma unroll
                for (uint32_t e = 0; e < 8; ++e) {
                    if (sdp_run_in_group<8>(g, t, 0, lane) && i + e < args.shard_len) {
                        shard[i + e] = nan;
                    }
                }
            }
        }
    }
}
