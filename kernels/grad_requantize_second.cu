// grad_requantize_second: the middle pass of the two-level gradient reduce-scatter
// (docs/numerics.md §7.1).
//
// Mirrors backend::cpu::gradient::requantize_second (and requantize_run, sum_groups): for
// chunk p, dequantize the peers1 slabs received at the first level, sum them in slab order
// and requantize the sum at the second level into peers2 slabs (still in the Hadamard domain).
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one output group, handled by one warp (8 per block), grid-stride over the
// peers2 * groups_per_chunk output groups. Unit u is group j = u % groups_per_chunk of output
// slab x2 = u / groups_per_chunk. Each lane holds runs of 4 consecutive elements (common.cuh).
//
// Indexing (the ABI comment of sdp_grad_second; plan::GradLayout):
//   input: group x2 * groups_per_chunk + j of each of the peers1 slabs of recv (in_slab);
//   output: group j of slab x2 of out (out_slab, groups_per_chunk groups);
//   z = dests[my_x1 * peers2 + x2]; element e has Philox index
//   z * S_pad + p * chunk_len + j * g + e.
// Both levels share the group size g (config::GradConfig::group_size): g is read from
// out_slab, in_slab's must equal it.
//
// A corrupt input group (see common.cuh) makes the sum NaN where a lane finds it, so the
// output group is a non-finite group (scale NaN, codes 0); the CPU returns Error::Decode there.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 4)
grad_requantize_second(const uint8_t* __restrict__ recv, const uint32_t* __restrict__ dests,
                       uint8_t* __restrict__ out, sdp_grad_second args)
{
    const sdp_slab& in = args.in_slab;
    const sdp_slab& layout = args.out_slab;
    const sdp_shards& sh = args.shards;
    const uint32_t g = layout.quant.group_size;
    const uint32_t lane = sdp_lane();
    const float top_inverse = sdp_max_code_inverse(sdp_max_code(layout.quant));
    const uint32_t gc = args.groups_per_chunk;
    // Unit u = x2 * gc + j (units fit in 32 bits, the launch checks), walked as the digits
    // (x2, j): no division in the loop.
    const uint32_t radix[2] = {0, gc};
    sdp_unit_walk<2> walk = sdp_unit_walk_of(args.peers2 * gc, radix);
    for (; walk.at[0] < args.peers2; sdp_unit_walk_next(walk, radix)) {
        const uint32_t x2 = walk.at[0];
        const uint32_t j = walk.at[1];
        // The input group (below the units' count) and the destination: 32-bit indices.
        const uint32_t k_in = x2 * gc + j;
        const uint64_t z = __ldg(dests + (args.my_x1 * args.peers2 + x2));

        // Tile t: the slab-order sum of the peers' dequantized values; a NaN first value in
        // the lane that finds a corrupt code (its first run lies in the group, as the run of
        // the code does), which makes the group non-finite (sdp_sum_peers_tile makes every
        // value NaN for corrupt metadata).
        auto load = [&](uint32_t t, float (&v)[SDP_LANE_VALUES]) {
            bool corrupt = false;
            sdp_sum_peers_tile<4>(recv, in, args.peers1, k_in, t, lane, v, corrupt);
            v[0] = corrupt ? sdp_nan() : v[0];
        };
        const uint64_t first_index = z * sh.padded_shard_len + args.chunk * sh.chunk_len + (uint64_t)j * g;
        sdp_quantize_slab_group<4>(sdp_slab_at(out, layout, x2), layout, top_inverse, j, load, args.rng, first_index,
                                   lane);
    }
    sdp_zero_slabs_padding(out, layout, args.peers2, lane);
}
