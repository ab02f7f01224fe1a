// Philox4x32-10 (rng::philox4x32_10) and the uniform of element i (rng::UniformStream).
#pragma once

#include "common.cuh"

#define SDP_PHILOX_M0 0xD2511F53u
#define SDP_PHILOX_M1 0xCD9E8D57u
#define SDP_PHILOX_W0 0x9E3779B9u
#define SDP_PHILOX_W1 0xBB67AE85u

// The four words of one Philox4x32-10 block.
struct sdp_philox_block {
    uint32_t w0, w1, w2, w3;
};

// Philox4x32-10 of counter (block low, block high, step, stream) under key (key_lo, key_hi):
// ten rounds of the Random123 reference algorithm. Random123's known-answer vector: counter
// {0, 0, 0, 0}, key {0, 0} -> {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}.
__device__ __forceinline__ sdp_philox_block sdp_philox(const sdp_rng& rng, uint64_t block)
{
    uint32_t c0 = (uint32_t)block;
    uint32_t c1 = (uint32_t)(block >> 32);
    uint32_t c2 = rng.step;
    uint32_t c3 = rng.stream;
    uint32_t k0 = rng.key_lo;
    uint32_t k1 = rng.key_hi;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += SDP_PHILOX_W0;
            k1 += SDP_PHILOX_W1;
        }
        // Each 32 x 32 -> 64-bit product is one wide multiply (IMAD.WIDE.U32) giving both
        // halves, instead of a high and a low multiply.
        const uint64_t p0 = (uint64_t)SDP_PHILOX_M0 * c0;
        const uint64_t p1 = (uint64_t)SDP_PHILOX_M1 * c2;
        c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c1 = (uint32_t)p1;
        c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c3 = (uint32_t)p0;
    }
    sdp_philox_block b;
    b.w0 = c0;
    b.w1 = c1;
    b.w2 = c2;
    b.w3 = c3;
    return b;
}

// The four Philox words of the 4 consecutive elements whose Philox indices start at `first`, a
// multiple of 4 (every group and run starts at one: shards, chunks and groups are multiples of
// 32, and the launches check the index they are given), into w[0 .. 4): element first + k takes
// word k (rng::UniformStream).
__device__ __forceinline__ void sdp_words4(const sdp_rng& rng, uint64_t first, uint32_t* w)
{
    const sdp_philox_block b = sdp_philox(rng, first / 4);
    w[0] = b.w0;
    w[1] = b.w1;
    w[2] = b.w2;
    w[3] = b.w3;
}

// t + u, u = (word >> 8) * 2^-24 (rng::word_to_uniform: exact in fp32, in [0, 1)), as one fused
// multiply-add: word & ~0xff is u * 2^32 exactly (at most 24 significant bits), so
// fma(u * 2^32, 2^-32, t) rounds the exact sum t + u once, which is __fadd_rn(t, u) bit for bit
// (signed zeros included: u = +0 and t = -0 give +0 both ways).
__device__ __forceinline__ float sdp_add_uniform(float t, uint32_t word)
{
    return __fmaf_rn(__uint2float_rn(word & 0xffffff00u), 1.0f / 4294967296.0f, t);
}
