// grad_reduce_final: the last pass of the grouped gradient reduce-scatter (docs/numerics.md §7.1).
//
// Mirrors backend::cpu::gradient::reduce_final (and sum_groups): for chunk p, dequantize the
// slabs received at the last level, sum them in slab order, invert the Hadamard transform
// (when hadamard_block != 0) and write the real elements of chunk p of this rank's shard.
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one group j of the chunk (slab.groups groups per slab), handled by one warp
// (8 per block), grid-stride over the slab.groups groups.
//
// Indexing: group j covers in-shard offsets o = p * chunk_len + j * g + e (e < g); it reads
// group j of each of the `peers` slabs of recv and writes shard[o] for every o < S (shard
// points at this rank's S-element shard). Groups wholly in the padding (first offset >= S)
// are skipped, as on the CPU; the last real group may be partial (S not a multiple of g).
//
// A corrupt input group (see common.cuh) writes NaN to every real element of the group; the
// CPU returns Error::Decode there.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS)
grad_reduce_final(const uint8_t* __restrict__ recv, float* __restrict__ shard, sdp_grad_final args)
{
    const sdp_slab& layout = args.slab;
    const sdp_shards& sh = args.shards;
    const uint32_t g = layout.quant.group_size;
    const uint32_t lane = sdp_lane();

    for (uint64_t j = sdp_warp_id(); j < layout.groups; j += sdp_warp_count()) {
        // In-shard offset of the group's first element.
        const uint64_t first = args.chunk * sh.chunk_len + j * g;
        if (first >= sh.shard_len) {
            continue;
        }
        const bool corrupt = sdp_any_peer_corrupt(recv, layout, args.peers, j, lane);

        for (uint32_t t = 0; t < sdp_tiles(g); ++t) {
            const uint32_t rows = sdp_tile_rows(g, t);
            float v[SDP_TILE_ROWS] = {};
            sdp_sum_peers_tile(recv, layout, args.peers, j, corrupt, t, rows, lane, v);
            if (args.hadamard_block != 0) {
                sdp_hadamard_inverse(v, rows, args.hadamard_block, lane);
            }
#pragma unroll
            for (uint32_t r = 0; r < SDP_TILE_ROWS; ++r) {
                const uint64_t o = first + sdp_tile_element(t, r, lane);
                if (r < rows && o < sh.shard_len) {
                    shard[o] = v[r];
                }
            }
        }
    }
}
