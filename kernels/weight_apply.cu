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
// j = u % real_groups.
//
// Indexing: element e of group j of shard z is shard element i = j * g + e, written when
// i < shard_len (the last group may be partial) to params[z * shard_len + i];
// own_reference is indexed by i (this rank's previous shard, shard_len elements).
//
// A corrupt group (see common.cuh) decodes to NaN, so its elements become bf16 NaN; the CPU
// returns Error::Decode there.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS)
weight_apply(const uint8_t* __restrict__ recv, const uint16_t* __restrict__ own_reference,
             uint16_t* __restrict__ params, sdp_weight_apply args)
{
    const sdp_slab& layout = args.slab;
    const sdp_quant& q = layout.quant;
    const uint32_t g = q.group_size;
    const uint32_t lane = sdp_lane();
    const uint64_t real_groups = (args.shard_len + g - 1) / g;
    const uint64_t units = (uint64_t)args.world * real_groups;

    for (uint64_t u = sdp_warp_id(); u < units; u += sdp_warp_count()) {
        const uint64_t z = u / real_groups;
        const uint64_t j = u % real_groups;
        const uint8_t* slab = sdp_slab_at(recv, layout, z);
        sdp_coded_group grp = sdp_slab_group(slab, layout, j);
        if (sdp_group_corrupt(q, grp, lane)) {
            grp.scale = sdp_nan();
        }
        const bool own = args.difference && z == args.me;
        uint16_t* shard = params + z * args.shard_len;

        for (uint32_t e = lane; e < g; e += SDP_WARP_SIZE) {
            const uint64_t i = j * g + e;
            if (i >= args.shard_len) {
                break;
            }
            const float d = sdp_dequantize(q, grp, e);
            float x = d;
            if (args.difference) {
                const uint16_t ref = own ? own_reference[i] : shard[i];
                x = __fadd_rn(sdp_bf16_to_f32(ref), d);
            }
            shard[i] = sdp_f32_to_bf16(x);
        }
    }
}
