// weight_encode: the owner's pass of the quantized weight all-gather (docs/numerics.md §7.3).
//
// Mirrors backend::cpu::weight::encode_shard (and encode_run): quantize this rank's shard,
// x = f32(new) - f32(reference) (qWD, difference = 1) or x = f32(new) (direct), computed in
// fp32 and zero beyond shard_len, into one slab.
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one group j of the slab, handled by one warp (8 per block), grid-stride over the
// slab.groups groups.
//
// Indexing: element e of group j is shard element i = j * g + e, real when i < shard_len,
// else 0 (padding; the slab covers the padded shard); its Philox index is first_index + i.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS)
weight_encode(const uint16_t* __restrict__ new_shard, const uint16_t* __restrict__ reference,
              uint8_t* __restrict__ out, sdp_weight_encode args)
{
    const sdp_slab& layout = args.slab;
    const uint32_t g = layout.quant.group_size;
    const uint32_t lane = sdp_lane();

    for (uint64_t j = sdp_warp_id(); j < layout.groups; j += sdp_warp_count()) {
        // Tile t: the (difference of the) bf16 values as fp32, zeros past shard_len.
        auto load = [&](uint32_t t, uint32_t rows, float (&v)[SDP_TILE_ROWS]) {
#pragma unroll
            for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
                if (r < rows) {
                    const uint64_t i = j * g + sdp_tile_element(t, r, lane);
                    float x = 0.0f;
                    if (i < args.shard_len) {
                        x = sdp_bf16_to_f32(new_shard[i]);
                        if (args.difference) {
                            x = __fsub_rn(x, sdp_bf16_to_f32(reference[i]));
                        }
                    }
                    v[r] = x;
                }
            }
        };
        sdp_quantize_slab_group(out, layout, j, load, args.rng, args.first_index + j * g, lane);
    }
}
