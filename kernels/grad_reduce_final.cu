// grad_reduce_final: the last pass of the grouped gradient reduce-scatter (docs/numerics.md §7.1).
//
// Mirrors backend::cpu::gradient::reduce_final (and sum_groups): for chunk p, dequantize the
// slabs received at the last level, sum them in slab order, invert the Hadamard transform
// (when the spec's block is not 0) and write the real elements of chunk p of this rank's shard.
// grad_reduce_final_bf16 writes a bf16 shard, each element rounded (docs/numerics.md §7.5).
//
// Spec: sdp_final_spec<quantizer, Hadamard block, peer batch, groups per unit> (spec.cuh).
// Work unit: Groups consecutive groups j of the chunk (slab.groups groups per slab), handled by
// one warp, grid-stride over ceil(slab.groups / Groups) units. Each lane holds runs of 4
// consecutive elements (common.cuh) and stores them with one 16-byte store (8 of bf16) where
// aligned. The scales and code words of the first peer batch of every group of the unit are
// loaded before any is decoded (decode.cuh).
//
// Indexing: group j covers in-shard offsets o = p * chunk_len + j * g + e (e < g); it reads
// group j of each of the `peers` slabs of recv and writes shard[o] for every o < S (shard
// points at this rank's S-element shard). Groups wholly in the padding (first offset >= S)
// are skipped, as on the CPU; the last real group may be partial (S not a multiple of g).
//
// A corrupt input group (see common.cuh) writes NaN to every real element of the group; the
// CPU returns Error::Decode there. Lanes check the codes they decode and the warp votes once
// the group is written: a corrupt group is then overwritten with NaN.
#include "decode.cuh"
#include "hadamard.cuh"

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

// Writes this lane's values of the `Rows` rows from row r0 of the group starting at in-shard
// offset `first` to the real elements of the shard (offset < S): one 16-byte (fp32) or 8-byte
// (bf16) store per wholly real, aligned run.
template <class Q, uint32_t Rows, class G>
__device__ __forceinline__ void store_rows(G* shard, uint64_t shard_len, uint64_t first, uint32_t r0, uint32_t lane,
                                           const float (&v)[Rows * 4])
{
    using R = sdp_rows<4, Q::group_size>;
#pragma unroll
    for (uint32_t r = 0; r < Rows; ++r) {
        if (!R::in_group(r0 + r, lane)) {
            continue;
        }
        const uint64_t o = first + R::element(r0, 4 * r, lane);
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
template <class Q, class G>
static __device__ SDP_NOINLINE void store_group_nan(G* shard, uint64_t shard_len, uint64_t first, uint32_t lane)
{
    using R = sdp_rows<4, Q::group_size>;
    float v[R::tile_values];
#pragma unroll
    for (uint32_t i = 0; i < R::tile_values; ++i) {
        v[i] = sdp_nan();
    }
    for (uint32_t r0 = 0; r0 < R::count; r0 += R::tile_rows) {
        store_rows<Q, R::tile_rows>(shard, shard_len, first, r0, lane, v);
    }
}

// The kernel for a shard of G (float or sdp_bf16, each element rounded to it).
template <class Spec, class G>
__device__ __forceinline__ void grad_reduce_final_of(const uint8_t* __restrict__ recv, G* __restrict__ shard,
                                                     const sdp_grad_final& args)
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
    // Groups holding real elements: the rest of the chunk's slab is padding, skipped.
    const uint64_t chunk_first = args.chunk * sh.chunk_len;
    const uint64_t chunk_real = chunk_first < sh.shard_len ? sh.shard_len - chunk_first : 0;
    const uint64_t real_groups = (chunk_real + g - 1) / g < layout.groups ? (chunk_real + g - 1) / g : layout.groups;
    const uint64_t units = (real_groups + groups - 1) / groups;

    for (uint64_t u = sdp_warp_id(); u < units; u += sdp_warp_count()) {
        const uint64_t j0 = u * groups;
        const uint32_t present = real_groups - j0 < groups ? (uint32_t)(real_groups - j0) : groups;
        uint64_t k[groups];
#pragma unroll
        for (uint32_t n = 0; n < groups; ++n) {
            k[n] = j0 + n;
        }
        // In-shard offset of group n's first element.
        auto first = [&](uint32_t n) { return chunk_first + (j0 + n) * g; };
        if constexpr (R::tiles == 1) {
            float v[groups][R::count * 4];
            bool corrupt[groups];
            sdp_sum_peers<Q, 4, R::count, Spec::peer_batch, groups>(recv, layout, args.peers, k, present, 0, lane, v,
                                                                   corrupt);
#pragma unroll
            for (uint32_t n = 0; n < groups; ++n) {
                if (n >= present) {
                    break;
                }
                if constexpr (block != 0) {
                    sdp_hadamard_inverse<block, 4, R::count>(v[n], lane);
                }
                store_rows<Q, R::count>(shard, sh.shard_len, first(n), 0, lane, v[n]);
                if (__any_sync(SDP_FULL_MASK, corrupt[n])) {  // Cold path: a corrupt group.
                    store_group_nan<Q>(shard, sh.shard_len, first(n), lane);
                }
            }
        } else {
            bool any_corrupt = false;
            for (uint32_t r0 = 0; r0 < R::count; r0 += R::tile_rows) {
                float v[1][R::tile_values];
                bool corrupt[1];
                sdp_sum_peers<Q, 4, R::tile_rows, Spec::peer_batch, 1>(recv, layout, args.peers, k, 1, r0, lane, v,
                                                                      corrupt);
                if constexpr (block != 0) {
                    sdp_hadamard_inverse<block, 4, R::tile_rows>(v[0], lane);
                }
                store_rows<Q, R::tile_rows>(shard, sh.shard_len, first(0), r0, lane, v[0]);
                any_corrupt |= corrupt[0];
            }
            if (__any_sync(SDP_FULL_MASK, any_corrupt)) {  // Cold path: a corrupt group.
                store_group_nan<Q>(shard, sh.shard_len, first(0), lane);
            }
        }
    }
}
