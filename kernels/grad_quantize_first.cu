// grad_quantize_first: the first pass of the grouped gradient reduce-scatter
// (docs/numerics.md §7.1).
//
// Mirrors backend::cpu::gradient::quantize_first (and quantize_first_run): Hadamard (when the
// spec's block is not 0) + quantize + swizzle of the whole bucket, all P chunks, into
// P * peers1 slabs of the first level. grad_quantize_first_bf16 reads a bf16 bucket, each
// element as its fp32 value (docs/numerics.md §7.5).
//
// Spec: sdp_first_spec<quantizer, Hadamard block, groups per unit> (spec.cuh).
// Work unit: Groups consecutive groups j of one chunk p and destination (x1, x2), handled by one
// warp, grid-stride over the units; the groups are group k = x2 * groups_per_chunk + j of slab
// s = p * peers1 + x1 (chunk p, first-level peer x1). Each lane holds runs of 4 consecutive
// elements (common.cuh): one 16-byte load of fp32 (8 bytes of bf16), one Philox block. The
// loads of all the unit's groups are issued first, then their Philox words drawn (while the
// loads are in flight) when they fit the registers, then group by group the Hadamard
// transform, the statistics, the scale and the codes. Groups longer than a lane's registers
// hold (one per unit) are walked in tiles, loaded twice.
//
// Indexing (the ABI comment of sdp_grad_first; plan::GradLayout, plan::BucketPlan):
//   x2 = k / groups_per_chunk, j = k % groups_per_chunk, z = dests[x1 * peers2 + x2];
//   element e of the group has in-shard offset o = p * chunk_len + j * g + e, value
//   bucket[z * S + o] when o < S (real) else 0 (padding), and Philox index z * S_pad + o.
#include "hadamard.cuh"
#include "quantize.cuh"

// Elements i .. i + 3 of a unit whose first `real` elements are real, as fp32, zeros from the
// `real`-th on (the padding past the shard): one vector load when the run is wholly real and
// aligned, else element by element. The loader of units that are not whole (the last unit of
// a shard, or an unaligned bucket), out of line: a call per run in the loop, not the tests and
// the element-wise code.
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

// This lane's values of the `Rows` rows from row r0 of the unit's group n (group element e at
// unit element n g + e): zeros past the group and past the unit's `real` elements. A whole
// unit (all its groups real, its first element aligned, so every run is) fetches each run with
// one vector load, untested, and leaves a bf16 run unconverted (widen_rows converts it once
// every load of the unit is issued); a NaN makes its Hadamard block's values NaN and its group
// non-finite (scale NaN, codes 0), so its payload reaches no output.
template <class Q, uint32_t Rows, class G>
__device__ __forceinline__ void load_rows(const G* __restrict__ unit, bool whole, uint32_t real, uint32_t n,
                                          uint32_t r0, uint32_t lane, float (&v)[Rows * 4])
{
    using R = sdp_rows<4, Q::group_size>;
#pragma unroll
    for (uint32_t r = 0; r < Rows; ++r) {
        float* x = v + 4 * r;
        const uint32_t i = n * Q::group_size + R::element(r0, 4 * r, lane);
        if (!R::in_group(r0 + r, lane)) {
            x[0] = x[1] = x[2] = x[3] = 0.0f;
        } else if (whole) {
            sdp_grad_fetch4(unit + i, x);
        } else {  // Cold path: a unit not whole, run by run, out of line.
            const float4 part = load_four_of_part(unit, real, i);
            x[0] = part.x;
            x[1] = part.y;
            x[2] = part.z;
            x[3] = part.w;
        }
    }
}

// The values of `Rows` rows that load_rows fetched for a whole unit, widened to fp32 (rows
// outside the group are zeros either way).
template <class G, uint32_t Rows>
__device__ __forceinline__ void widen_rows(float (&v)[Rows * 4])
{
#pragma unroll
    for (uint32_t r = 0; r < Rows; ++r) {
        sdp_grad_widen4_raw<G>(v + 4 * r);
    }
}

// The kernel for a bucket of G (float or sdp_bf16, read as fp32).
template <class Spec, class G>
__device__ __forceinline__ void grad_quantize_first_of(const G* __restrict__ bucket, const uint32_t* __restrict__ dests,
                                                       uint8_t* __restrict__ out, const sdp_grad_first& args)
{
    using Q = typename Spec::quant;
    using R = sdp_rows<4, Q::group_size>;
    constexpr uint32_t g = Q::group_size;
    constexpr uint32_t groups = Spec::groups;
    constexpr uint32_t block = Spec::hadamard_block;
    static_assert(R::tiles == 1 || groups == 1, "one group per unit when a group is walked in tiles");
    const sdp_slab& layout = args.slab;
    const sdp_shards& sh = args.shards;
    const uint32_t lane = sdp_lane();
    const uint32_t gc = args.groups_per_chunk;
    // Unit u = ((p * peers1 + x1) * peers2 + x2) * per_dest + h, with per_dest =
    // ceil(gc / groups): the groups j = groups h + n (n < groups, j < gc) of chunk p for
    // destination (x1, x2); units fit in 32 bits (the launch checks, and there are no more of
    // them than groups). Walked as the digits (p, x1, x2, h): no division in the loop.
    const uint32_t per_dest = (gc + groups - 1) / groups;
    const uint32_t radix[4] = {0, args.peers1, args.peers2, per_dest};
    sdp_unit_walk<4> walk = sdp_unit_walk_of(sh.chunks * args.peers1 * args.peers2 * per_dest, radix);
    for (; walk.at[0] < sh.chunks; sdp_unit_walk_next(walk, radix)) {
        const uint32_t p = walk.at[0];
        const uint32_t x1 = walk.at[1];
        const uint32_t x2 = walk.at[2];
        const uint32_t j0 = groups * walk.at[3];
        const uint32_t present = gc - j0 < groups ? gc - j0 : groups;
        const uint64_t z = __ldg(dests + x1 * args.peers2 + x2);
        uint8_t* slab = sdp_slab_at(out, layout, p * args.peers1 + x1);
        // In-shard offset of the unit's first element, its elements in shard z, and how many
        // of the unit's elements are real (in-shard offset < S; at most groups g, so 32-bit).
        const uint64_t unit_first = p * sh.chunk_len + (uint64_t)j0 * g;
        const G* unit = bucket + z * sh.shard_len + unit_first;
        const uint64_t unit_left = unit_first < sh.shard_len ? sh.shard_len - unit_first : 0;
        const uint32_t real = unit_left < present * g ? (uint32_t)unit_left : present * g;
        const uint64_t unit_index = z * sh.padded_shard_len + unit_first;
        const bool whole = present == groups && real == groups * g && sdp_grad_run_aligned(unit);
        // Where group n's codes, scale and offset go, and its first Philox index.
        auto codes = [&](uint32_t n) { return slab + sdp_codes_offset<Q>(x2 * gc + j0 + n); };
        auto scale = [&](uint32_t n) { return (float*)(slab + sdp_scale_offset<Q>(layout, x2 * gc + j0 + n)); };
        auto offset = [&](uint32_t n) {
            return Q::symmetric ? nullptr : (float*)(slab + sdp_offset_offset<Q>(layout, x2 * gc + j0 + n));
        };
        auto drawn = [&](uint32_t n) {
            return [&, n](uint32_t row, uint32_t(&w)[4]) {
                sdp_run_words<Q, 4>(args.rng, unit_index + n * g, row, lane, w);
            };
        };
        if constexpr (R::tiles == 1) {
            float v[groups][R::count * 4];
#pragma unroll
            for (uint32_t n = 0; n < groups; ++n) {
                if (n < present) {
                    load_rows<Q, R::count>(unit, whole, real, n, 0, lane, v[n]);
                }
            }
            // The Philox words drawn while the loads are in flight, where they fit the
            // registers; else each run's as its codes are computed.
            constexpr bool early = Q::stochastic && groups * R::count * 4 <= 32;
            [[maybe_unused]] uint32_t words[early ? groups : 1][R::count][4];
            if constexpr (early) {
#pragma unroll
                for (uint32_t n = 0; n < groups; ++n) {
#pragma unroll
                    for (uint32_t r = 0; r < R::count; ++r) {
                        sdp_run_words<Q, 4>(args.rng, unit_index + n * g, r, lane, words[n][r]);
                    }
                }
            }
#pragma unroll
            for (uint32_t n = 0; n < groups; ++n) {
                if (n >= present) {
                    break;
                }
                if (whole) {
                    widen_rows<G, R::count>(v[n]);
                }
                if constexpr (block != 0) {
                    sdp_hadamard_forward<block, 4, R::count>(v[n], lane);
                }
                if constexpr (early) {
                    auto held = [&, n](uint32_t row, uint32_t(&w)[4]) {
#pragma unroll
                        for (uint32_t k = 0; k < 4; ++k) {
                            w[k] = words[n][row][k];
                        }
                    };
                    auto row = sdp_rows_of<4>(v[n]);
                    sdp_quantize_held<Q, 4>(row, held, codes(n), scale(n), offset(n), lane);
                } else {
                    auto late = drawn(n);
                    auto row = sdp_rows_of<4>(v[n]);
                    sdp_quantize_held<Q, 4>(row, late, codes(n), scale(n), offset(n), lane);
                }
            }
        } else {
            // Tile from row r0: the real elements of shard z, zeros past S, then the forward
            // Hadamard.
            auto load = [&](uint32_t r0, float(&v)[R::tile_values]) {
                load_rows<Q, R::tile_rows>(unit, whole, real, 0, r0, lane, v);
                if (whole) {
                    widen_rows<G, R::tile_rows>(v);
                }
                if constexpr (block != 0) {
                    sdp_hadamard_forward<block, 4, R::tile_rows>(v, lane);
                }
            };
            auto late = drawn(0);
            sdp_quantize_tiled<Q, 4>(load, late, codes(0), scale(0), offset(0), lane);
        }
    }
    sdp_zero_slabs_padding<Q>(out, layout, (uint64_t)sh.chunks * args.peers1, lane);
}
