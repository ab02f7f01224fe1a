// grad_reduce_final: the last pass of the grouped gradient reduce-scatter (docs/numerics.md §7.1).
//
// Mirrors backend::cpu::gradient::reduce_final (and sum_groups): for chunk p, dequantize the
// slabs received at the last level, sum them in slab order, invert the Hadamard transform
// (when hadamard_block != 0) and write the real elements of chunk p of this rank's shard.
// grad_reduce_final_bf16 writes a bf16 shard, each element rounded (docs/numerics.md §7.5).
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one group j of the chunk (slab.groups groups per slab), handled by one warp
// (8 per block), grid-stride over the slab.groups groups. Each lane holds runs of 4
// consecutive elements (common.cuh) and stores them with one 16-byte store where aligned.
//
// Indexing: group j covers in-shard offsets o = p * chunk_len + j * g + e (e < g); it reads
// group j of each of the `peers` slabs of recv and writes shard[o] for every o < S (shard
// points at this rank's S-element shard). Groups wholly in the padding (first offset >= S)
// are skipped, as on the CPU; the last real group may be partial (S not a multiple of g).
//
// A corrupt input group (see common.cuh) writes NaN to every real element of the group; the
// CPU returns Error::Decode there. Lanes check the codes they decode and the warp votes once
// the group is written: a corrupt group is then overwritten with NaN.
#include "common.cuh"

// Cold path, out of line: the first n (< 4, or 4 for an unaligned run) of the 4 values of a
// run to `run`, element by element.
template <class G>
static __device__ SDP_NOINLINE void store_run_elements(G* run, uint32_t n, float4 v)
{
    const float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (uint32_t e = 0; e < 4; ++e) {
        if (e < n) {
            sdp_grad_store1(run + e, x[e]);
        }
    }
}

// Writes this lane's values of tile t of the group starting at in-shard offset `first` to
// the real elements of the shard (offset < S): one 16-byte (fp32) or 8-byte (bf16) store per
// wholly real, aligned run.
template <class G>
__device__ __forceinline__ void store_tile(G* shard, uint64_t shard_len, uint32_t g, uint64_t first,
                                           uint32_t t, uint32_t lane, const float (&v)[SDP_LANE_VALUES])
{
#pragma unroll
    for (uint32_t r = 0; r < SDP_LANE_VALUES / 4; ++r) {
        if (!sdp_run_in_group<4>(g, t, r, lane)) {
            continue;
        }
        const uint64_t o = first + sdp_tile_element<4>(t, 4 * r, lane);
        if (o + 4 <= shard_len && sdp_grad_run_aligned(shard + o)) {
            sdp_grad_store4(shard + o, v + 4 * r);
        } else {  // Cold path: an unaligned or partial run.
            const uint32_t n = o + 4 <= shard_len ? 4 : (uint32_t)(shard_len > o ? shard_len - o : 0);
            store_run_elements(shard + o, n, make_float4(v[4 * r], v[4 * r + 1], v[4 * r + 2], v[4 * r + 3]));
        }
    }
}

// Cold path, out of line: NaN to every real element of the group starting at in-shard offset
// `first` (a corrupt group). All 32 lanes must call it together.
template <class G>
static __device__ SDP_NOINLINE void store_group_nan(G* shard, uint64_t shard_len, uint32_t g, uint64_t first,
                                                    uint32_t lane)
{
    float v[SDP_LANE_VALUES];
#pragma unroll
    for (uint32_t i = 0; i < SDP_LANE_VALUES; ++i) {
        v[i] = sdp_nan();
    }
    for (uint32_t t = 0; t < sdp_tiles(g); ++t) {
        store_tile(shard, shard_len, g, first, t, lane, v);
    }
}

// The kernel for a shard of G (float or sdp_bf16, each element rounded to it).
template <class G>
__device__ __forceinline__ void grad_reduce_final_of(const uint8_t* __restrict__ recv, G* __restrict__ shard,
                                                     const sdp_grad_final& args)
{
    const sdp_slab& layout = args.slab;
    const sdp_shards& sh = args.shards;
    const uint32_t g = layout.quant.group_size;
    const uint32_t lane = sdp_lane();
    const uint64_t step = sdp_warp_count();

    for (uint64_t j = sdp_warp_id(); j < layout.groups; j += step) {
        // In-shard offset of the group's first element.
        const uint64_t first = args.chunk * sh.chunk_len + j * g;
        if (first >= sh.shard_len) {
            continue;
        }
        bool corrupt = false;
        for (uint32_t t = 0; t < sdp_tiles(g); ++t) {
            float v[SDP_LANE_VALUES];
            sdp_sum_peers_tile<4>(recv, layout, args.peers, j, t, lane, v, corrupt);
            if (args.hadamard_block != 0) {
                sdp_hadamard_inverse(v, g, t, args.hadamard_block, lane);
            }
            store_tile(shard, sh.shard_len, g, first, t, lane, v);
        }
        if (__any_sync(SDP_FULL_MASK, corrupt)) {  // Cold path: a corrupt group.
            store_group_nan(shard, sh.shard_len, g, first, lane);
        }
    }
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 4)
grad_reduce_final(const uint8_t* __restrict__ recv, float* __restrict__ shard, sdp_grad_final args)
{
    grad_reduce_final_of(recv, shard, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 4)
grad_reduce_final_bf16(const uint8_t* __restrict__ recv, sdp_bf16* __restrict__ shard, sdp_grad_final args)
{
    grad_reduce_final_of(recv, shard, args);
}
