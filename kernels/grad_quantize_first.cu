// grad_quantize_first: the first pass of the grouped gradient reduce-scatter
// (docs/numerics.md §7.1).
//
// Mirrors backend::cpu::gradient::quantize_first (and quantize_first_run): Hadamard (when
// hadamard_block != 0) + quantize + swizzle of the whole bucket, all P chunks, into
// P * peers1 slabs of the first level. grad_quantize_first_bf16 reads a bf16 bucket, each
// element as its fp32 value (docs/numerics.md §7.5).
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: up to GROUPS_PER_UNIT consecutive groups j of one chunk p and destination (x1, x2),
// handled one after another by one warp (8 per block), grid-stride over the units; the groups
// are group k = x2 * groups_per_chunk + j of slab s = p * peers1 + x1 (chunk p, first-level
// peer x1). Each lane holds runs of 4 consecutive elements (common.cuh): one 16-byte load, one
// Philox block.
//
// Indexing (the ABI comment of sdp_grad_first; plan::GradLayout, plan::BucketPlan):
//   x2 = k / groups_per_chunk, j = k % groups_per_chunk, z = dests[x1 * peers2 + x2];
//   element e of the group has in-shard offset o = p * chunk_len + j * g + e, value
//   bucket[z * S + o] when o < S (real) else 0 (padding), and Philox index z * S_pad + o.
#include "common.cuh"

// Groups per work unit: the unit's index, destination, slab, shard offsets and real elements
// are worked out once for that many groups. Three fit the 80 registers of three blocks per
// multiprocessor (four spill).
#define GROUPS_PER_UNIT 3u

// Elements i .. i + 3 of a unit whose first `real` elements are real, as fp32, zeros from the
// `real`-th on (the padding past the shard): one vector load when the run is wholly real and
// aligned, else element by element. The loader of units that are not whole (sdp_grad_first's
// last unit of a shard, or an unaligned bucket), out of line: a call per run in the loop, not
// the tests and the element-wise code.
template <class G>
static __device__ SDP_NOINLINE float4 load_four_of_part(const G* __restrict__ unit, uint32_t real, uint32_t i)
{
    float x[4];
    if (i + 4 <= real && sdp_grad_run_aligned(unit + i)) {
        sdp_grad_load4(unit + i, x);
    } else {
#pragma unroll
        for (uint32_t k = 0; k < 4; ++k) {
            x[k] = i + k < real ? sdp_grad_to_f32(unit[i + k]) : 0.0f;
        }
    }
    return make_float4(x[0], x[1], x[2], x[3]);
}

// The kernel for a bucket of G (float or sdp_bf16, read as fp32).
template <class G>
__device__ __forceinline__ void grad_quantize_first_of(const G* __restrict__ bucket, const uint32_t* __restrict__ dests,
                                                       uint8_t* __restrict__ out, const sdp_grad_first& args)
{
    const sdp_slab& layout = args.slab;
    const sdp_shards& sh = args.shards;
    const uint32_t g = layout.quant.group_size;
    const uint32_t lane = sdp_lane();
    const uint32_t gc = args.groups_per_chunk;
    const float top_inverse = sdp_max_code_inverse(sdp_max_code(layout.quant));
    // Unit u = ((p * peers1 + x1) * peers2 + x2) * per_dest + h, with per_dest =
    // ceil(gc / GROUPS_PER_UNIT): the groups j = GROUPS_PER_UNIT h + n (n < GROUPS_PER_UNIT,
    // j < gc) of chunk p for destination (x1, x2); units fit in 32 bits (the launch checks, and
    // there are no more of them than groups). Walked as the digits (p, x1, x2, h): no division
    // in the loop.
    const uint32_t per_dest = (gc + GROUPS_PER_UNIT - 1) / GROUPS_PER_UNIT;
    const uint32_t radix[4] = {0, args.peers1, args.peers2, per_dest};
    sdp_unit_walk<4> walk = sdp_unit_walk_of(sh.chunks * args.peers1 * args.peers2 * per_dest, radix);
    for (; walk.at[0] < sh.chunks; sdp_unit_walk_next(walk, radix)) {
        const uint32_t p = walk.at[0];
        const uint32_t x1 = walk.at[1];
        const uint32_t x2 = walk.at[2];
        const uint64_t z = __ldg(dests + x1 * args.peers2 + x2);
        uint8_t* slab = sdp_slab_at(out, layout, p * args.peers1 + x1);
        // In-shard offset of the unit's first element, its elements in shard z, and how many
        // of the unit's elements are real (in-shard offset < S; at most GROUPS_PER_UNIT g, so
        // 32-bit).
        const uint64_t unit_first = p * sh.chunk_len + (uint64_t)(GROUPS_PER_UNIT * walk.at[3]) * g;
        const G* unit_elements = bucket + z * sh.shard_len + unit_first;
        const uint64_t unit_left = unit_first < sh.shard_len ? sh.shard_len - unit_first : 0;
        const uint32_t unit_real = unit_left < GROUPS_PER_UNIT * g ? (uint32_t)unit_left : GROUPS_PER_UNIT * g;
        const uint64_t unit_index = z * sh.padded_shard_len + unit_first;
        // A whole unit (all its groups real, its first element 16-byte aligned, so every run
        // is: g is a multiple of 32) loads each run with one vector load, untested.
        const bool whole = unit_real == GROUPS_PER_UNIT * g && sdp_grad_run_aligned(unit_elements);
#pragma unroll
        for (uint32_t n = 0; n < GROUPS_PER_UNIT; ++n) {
            const uint32_t j = GROUPS_PER_UNIT * walk.at[3] + n;
            if (j >= gc) {
                break;
            }
            // Tile t: the real elements of shard z, zeros past S, then the forward Hadamard.
            auto load = [&](uint32_t t, float (&v)[SDP_LANE_VALUES]) {
#pragma unroll
                for (uint32_t r = 0; r < SDP_LANE_VALUES / 4; ++r) {
                    float* x = v + 4 * r;
                    const uint32_t e = sdp_tile_element<4>(t, 4 * r, lane);
                    const uint32_t i = n * g + e;
                    if (e >= g) {  // A run past the group (its last tile): zeros.
                        x[0] = x[1] = x[2] = x[3] = 0.0f;
                    } else if (whole) {
                        // A NaN makes its Hadamard block's values NaN and its group
                        // non-finite (scale NaN, codes 0): its payload reaches no output.
                        sdp_grad_load4_raw(unit_elements + i, x);
                    } else {  // Cold path: a unit not whole, run by run, out of line.
                        const float4 part = load_four_of_part(unit_elements, unit_real, i);
                        x[0] = part.x;
                        x[1] = part.y;
                        x[2] = part.z;
                        x[3] = part.w;
                    }
                }
                if (args.hadamard_block != 0) {
                    sdp_hadamard_forward(v, g, t, args.hadamard_block, lane);
                }
            };
            sdp_quantize_slab_group<4>(slab, layout, top_inverse, x2 * gc + j, load, args.rng, unit_index + n * g, lane);
        }
    }
    sdp_zero_slabs_padding(out, layout, (uint64_t)sh.chunks * args.peers1, lane);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 3)
grad_quantize_first(const float* __restrict__ bucket, const uint32_t* __restrict__ dests,
                    uint8_t* __restrict__ out, sdp_grad_first args)
{
    grad_quantize_first_of(bucket, dests, out, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 3)
grad_quantize_first_bf16(const sdp_bf16* __restrict__ bucket, const uint32_t* __restrict__ dests,
                         uint8_t* __restrict__ out, sdp_grad_first args)
{
    grad_quantize_first_of(bucket, dests, out, args);
}
