// weight_encode: the owner's pass of the quantized weight all-gather (docs/numerics.md §7.3).
//
// Mirrors backend::cpu::weight::encode_shard (and encode_run): quantize this rank's shard,
// x = f32(new) - f32(reference) (qWD, difference = 1) or x = f32(new) (direct), computed in
// fp32 and zero beyond shard_len, into one slab.
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one group j of the slab, handled by one warp (8 per block), grid-stride over the
// slab.groups groups. Each lane holds runs of 8 consecutive elements (common.cuh): one
// 16-byte load of each input where aligned, two Philox blocks, one word of 4-bit codes.
//
// Indexing: element e of group j is shard element i = j * g + e, real when i < shard_len,
// else 0 (padding; the slab covers the padded shard); its Philox index is first_index + i.
#include "common.cuh"

// The bf16 value of element e of a vector of 8 as fp32, a NaN kept as it is (only NaN-ness
// matters here: a NaN makes its group non-finite, scale NaN and codes 0, whatever its payload).
__device__ __forceinline__ float element_of(uint4 words, uint32_t e)
{
    const uint32_t word = sdp_word_of(words, e / 2);
    return e % 2 == 0 ? sdp_bf16_low_to_f32_raw(word) : sdp_bf16_high_to_f32_raw(word);
}

// Shard elements i .. i + 3 as fp32 (the difference from the reference when `difference`), one
// by one, zeros past shard_len: the fallback of load_run, out of line (a call per four
// elements in the loop, not the element-by-element code).
static __device__ SDP_NOINLINE float4 load_four(const uint16_t* __restrict__ new_shard,
                                                const uint16_t* __restrict__ reference, uint64_t shard_len,
                                                bool difference, uint64_t i)
{
    float x[4];
#pragma unroll
    for (uint32_t e = 0; e < 4; ++e) {
        x[e] = 0.0f;
        if (i + e < shard_len) {
            x[e] = sdp_bf16_low_to_f32_raw(new_shard[i + e]);
            if (difference) {
                x[e] = __fsub_rn(x[e], sdp_bf16_low_to_f32_raw(reference[i + e]));
            }
        }
    }
    return make_float4(x[0], x[1], x[2], x[3]);
}

// This lane's run of 8 elements starting at shard element i as fp32 (the difference from the
// reference when `difference`), zeros past shard_len.
__device__ __forceinline__ void load_run(const uint16_t* __restrict__ new_shard, const uint16_t* __restrict__ reference,
                                         const sdp_weight_encode& args, uint64_t i, float* x)
{
    const bool vector = i + 8 <= args.shard_len && sdp_aligned(new_shard + i, 16) &&
                        (!args.difference || sdp_aligned(reference + i, 16));
    if (vector) {
        const uint4 n = sdp_load_u16x8(new_shard + i, false);
        const uint4 r = args.difference ? sdp_load_u16x8(reference + i, false) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (uint32_t e = 0; e < 8; ++e) {
            x[e] = element_of(n, e);
            if (args.difference) {
                x[e] = __fsub_rn(x[e], element_of(r, e));
            }
        }
    } else {  // Cold path: an unaligned or partial run, element by element, out of line.
        const float4 low = load_four(new_shard, reference, args.shard_len, args.difference, i);
        const float4 high = load_four(new_shard, reference, args.shard_len, args.difference, i + 4);
        x[0] = low.x;
        x[1] = low.y;
        x[2] = low.z;
        x[3] = low.w;
        x[4] = high.x;
        x[5] = high.y;
        x[6] = high.z;
        x[7] = high.w;
    }
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 4)
weight_encode(const uint16_t* __restrict__ new_shard, const uint16_t* __restrict__ reference,
              uint8_t* __restrict__ out, sdp_weight_encode args)
{
    const sdp_slab& layout = args.slab;
    const uint32_t g = layout.quant.group_size;
    const uint32_t lane = sdp_lane();
    const float top_inverse = sdp_max_code_inverse(sdp_max_code(layout.quant));

    for (uint64_t j = sdp_warp_id(); j < layout.groups; j += sdp_warp_count()) {
        // Tile t: the (difference of the) bf16 values as fp32, zeros past shard_len.
        auto load = [&](uint32_t t, float (&v)[SDP_LANE_VALUES]) {
            if (sdp_run_in_group<8>(g, t, 0, lane)) {
                load_run(new_shard, reference, args, j * g + sdp_tile_element<8>(t, 0, lane), v);
            } else {
#pragma unroll
                for (uint32_t e = 0; e < 8; ++e) {
                    v[e] = 0.0f;
                }
            }
        };
        sdp_quantize_slab_group<8>(out, layout, top_inverse, j, load, args.rng, args.first_index + j * g, lane);
    }
    sdp_zero_slabs_padding(out, layout, 1, lane);
}
