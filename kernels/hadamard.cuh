// The Walsh-Hadamard butterfly of the rows a warp holds (hadamard::forward / hadamard::inverse),
// with the block size a compile-time constant, so every stage is straight-line code: no
// run-time predicate encloses a shuffle.
//
// Stages h = 1, 2, 4, ..., block / 2 in order; at each stage the pair (x[j], x[j + h]) with bit
// h of j clear becomes (a + b, a - b), a = x[j], b = x[j + h]. With runs of E elements per lane
// and rows of 32 E (common.cuh): h < E pairs values of one run (registers of the lane),
// E <= h < 32 E the runs of lanes L and L ^ (h / E) (one shuffle per value), h >= 32 E the rows
// r and r + h / (32 E) of the lane. Lanes whose runs lie past the group hold zeros and take part
// in the shuffles; a block never mixes them with real runs. The values each stage computes do
// not depend on which lane computes them, so the bytes are the CPU's.
#pragma once

#include "common.cuh"

// The unnormalised butterfly of every `Block`-sized block of the `Rows` rows this lane holds
// (v[i]: row i / E, element i % E of its run; the first row of a block-aligned tile). Block: a
// power of two from 16 to 256 that divides the group. All 32 lanes must call it together.
template <uint32_t Block, uint32_t E, uint32_t Rows>
__device__ __forceinline__ void sdp_hadamard_forward(float (&v)[Rows * E], uint32_t lane)
{
    static_assert(Block >= 16 && Block <= 256 && (Block & (Block - 1)) == 0, "a block of 16 to 256");
    static_assert(Block <= 32 * E || Rows % (Block / (32 * E)) == 0, "tiles hold whole blocks");
#pragma unroll
    for (uint32_t h = 1; h < Block; h *= 2) {
        if (h < E) {
#pragma unroll
            for (uint32_t i = 0; i < Rows * E; ++i) {
                if ((i % E & h) == 0) {
                    const float a = v[i];
                    const float b = v[i + h];
                    v[i] = __fadd_rn(a, b);
                    v[i + h] = __fsub_rn(a, b);
                }
            }
        } else if (h < 32 * E) {
            // Lower lane: a = own, b = other -> a + b; upper lane: a = other, b = own -> a - b,
            // which IEEE defines as a + (-b): the upper lane adds its negated value.
            // fma(own, +-1, other) rounds the exact +-own + other once, which is that sum, in
            // one instruction.
            const uint32_t partner = h / E;
            const float sign = (lane & partner) != 0 ? -1.0f : 1.0f;
#pragma unroll
            for (uint32_t i = 0; i < Rows * E; ++i) {
                const float other = __shfl_xor_sync(SDP_FULL_MASK, v[i], partner);
                v[i] = __fmaf_rn(v[i], sign, other);
            }
        } else {
            const uint32_t rows = h / (32 * E);
#pragma unroll
            for (uint32_t i = 0; i < Rows * E; ++i) {
                if ((i / E & rows) == 0) {
                    const float a = v[i];
                    const float b = v[i + rows * E];
                    v[i] = __fadd_rn(a, b);
                    v[i + rows * E] = __fsub_rn(a, b);
                }
            }
        }
    }
}

// The inverse: the same butterfly, then every element times 1 / Block (exact: a power of two).
template <uint32_t Block, uint32_t E, uint32_t Rows>
__device__ __forceinline__ void sdp_hadamard_inverse(float (&v)[Rows * E], uint32_t lane)
{
    sdp_hadamard_forward<Block, E, Rows>(v, lane);
    constexpr float scale = 1.0f / Block;
#pragma unroll
    for (uint32_t i = 0; i < Rows * E; ++i) {
        v[i] = __fmul_rn(v[i], scale);
    }
}
