// grad_requantize_second: the middle pass of the two-level gradient reduce-scatter
// (docs/numerics.md §7.1).
//
// Mirrors backend::cpu::gradient::requantize_second (and requantize_run, sum_groups): for
// chunk p, dequantize the peers1 slabs received at the first level, sum them in slab order
// and requantize the sum at the second level into peers2 slabs (still in the Hadamard domain).
//
// Spec: sdp_second_spec<received quantizer, second-level quantizer, peer batch, groups per
// unit> (spec.cuh); both levels share the group size g (config::GradConfig::group_size).
// Work unit: Groups consecutive output groups j of one output slab x2, handled by one warp,
// grid-stride over the peers2 * ceil(groups_per_chunk / Groups) units. Each lane holds runs of 4
// consecutive elements (common.cuh). The scales and code words of the first peer batch of every
// group of the unit are loaded before any is decoded (decode.cuh).
//
// Indexing (the ABI comment of sdp_grad_second; plan::GradLayout):
//   input: group x2 * groups_per_chunk + j of each of the peers1 slabs of recv (in_slab);
//   output: group j of slab x2 of out (out_slab, groups_per_chunk groups);
//   z = dests[my_x1 * peers2 + x2]; element e has Philox index
//   z * S_pad + p * chunk_len + j * g + e.
//
// A corrupt input group (see common.cuh) makes the sum NaN where a lane finds it, so the
// output group is a non-finite group (scale NaN, codes 0); the CPU returns Error::Decode there.
#include "decode.cuh"
#include "quantize.cuh"

template <class Spec>
__device__ __forceinline__ void grad_requantize_second_of(const uint8_t* __restrict__ recv,
                                                          const uint32_t* __restrict__ dests,
                                                          uint8_t* __restrict__ out, const sdp_grad_second& args)
{
    using In = typename Spec::in;
    using Q = typename Spec::out;
    using R = sdp_rows<4, Q::group_size>;
    constexpr uint32_t g = Q::group_size;
    constexpr uint32_t groups = Spec::groups;
    static_assert(In::group_size == g, "both levels share the group size");
    static_assert(R::tiles == 1 || groups == 1, "one group per unit when a group is walked in tiles");
    const sdp_slab& layout = args.out_slab;
    const sdp_shards& sh = args.shards;
    const uint32_t lane = sdp_lane();
    const uint32_t gc = args.groups_per_chunk;
    // Unit u = x2 * per_slab + h (units fit in 32 bits, the launch checks), the output groups
    // j = groups h + n < gc of slab x2, walked as the digits (x2, h): no division in the loop.
    const uint32_t per_slab = (gc + groups - 1) / groups;
    const uint32_t radix[2] = {0, per_slab};
    sdp_unit_walk<2> walk = sdp_unit_walk_of(args.peers2 * per_slab, radix);
    for (; walk.at[0] < args.peers2; sdp_unit_walk_next(walk, radix)) {
        const uint32_t x2 = walk.at[0];
        const uint32_t j0 = groups * walk.at[1];
        const uint32_t present = gc - j0 < groups ? gc - j0 : groups;
        const uint64_t z = __ldg(dests + (args.my_x1 * args.peers2 + x2));
        uint8_t* slab = sdp_slab_at(out, layout, x2);
        // The input groups (below the units' count, so 32-bit indices) and the first Philox
        // index of each output group.
        uint64_t k_in[groups];
#pragma unroll
        for (uint32_t n = 0; n < groups; ++n) {
            k_in[n] = x2 * gc + j0 + n;
        }
        const uint64_t first_index = z * sh.padded_shard_len + args.chunk * sh.chunk_len + (uint64_t)j0 * g;
        auto codes = [&](uint32_t n) { return slab + sdp_codes_offset<Q>(j0 + n); };
        auto scale = [&](uint32_t n) { return (float*)(slab + sdp_scale_offset<Q>(layout, j0 + n)); };
        auto offset = [&](uint32_t n) {
            return Q::symmetric ? nullptr : (float*)(slab + sdp_offset_offset<Q>(layout, j0 + n));
        };
        auto drawn = [&](uint32_t n) {
            return [&, n](uint32_t row, uint32_t(&w)[4]) {
                sdp_run_words<Q, 4>(args.rng, first_index + n * g, row, lane, w);
            };
        };
        if constexpr (R::tiles == 1) {
            // The slab-order sums; a NaN first value in the lane that finds a corrupt code (its
            // first run lies in the group, as the run of the code does), which makes the group
            // non-finite (corrupt metadata makes every value NaN).
            float v[groups][R::count * 4];
            bool corrupt[groups];
            sdp_sum_peers<In, 4, R::count, Spec::peer_batch, groups>(recv, args.in_slab, args.peers1, k_in, present, 0,
                                                                    lane, v, corrupt);
#pragma unroll
            for (uint32_t n = 0; n < groups; ++n) {
                if (n >= present) {
                    break;
                }
                v[n][0] = corrupt[n] ? sdp_nan() : v[n][0];
                auto row = sdp_rows_of<4>(v[n]);
                auto late = drawn(n);
                sdp_quantize_held<Q, 4>(row, late, codes(n), scale(n), offset(n), lane);
            }
        } else {
            // Tile from row r0: the sums as above.
            auto load = [&](uint32_t r0, float(&v)[R::tile_values]) {
                float sums[1][R::tile_values];
                bool corrupt[1];
                sdp_sum_peers<In, 4, R::tile_rows, Spec::peer_batch, 1>(recv, args.in_slab, args.peers1, k_in, 1, r0,
                                                                       lane, sums, corrupt);
#pragma unroll
                for (uint32_t i = 0; i < R::tile_values; ++i) {
                    v[i] = sums[0][i];
                }
                v[0] = corrupt[0] ? sdp_nan() : v[0];
            };
            auto late = drawn(0);
            sdp_quantize_tiled<Q, 4>(load, late, codes(0), scale(0), offset(0), lane);
        }
    }
    sdp_zero_slabs_padding<Q>(out, layout, args.peers2, lane);
}
