// The launch ABI between the Rust CUDA backend (src/backend/cuda/abi.rs mirrors every struct
// here with #[repr(C)]) and the kernels in this directory. Each kernel takes its device
// pointers first, then one parameter struct by value. Fixed-width fields only; the struct
// layouts must stay identical on both sides (the Rust side checks sizes at compile time).
//
// Numerics: docs/numerics.md; every kernel must produce the bytes the CPU backend
// (src/backend/cpu) produces for the same inputs.
#pragma once

#ifdef __CUDACC_RTC__
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef unsigned short uint16_t;
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef short int16_t;
#else
#include <stdint.h>
#endif

// A bf16 gradient element (backend::GradElement): its 16 bits, the high half of the fp32 of
// the same value. Gradient kernels come in an fp32 variant and a bf16 variant (the name ends
// in _bf16) that reads and writes sdp_bf16 elements and is otherwise the same
// (docs/numerics.md §7.5).
struct sdp_bf16 {
    uint16_t bits;
};

// The group quantizer Q(b, g, mode, rounding) (codec::quant::QuantSpec).
struct sdp_quant {
    uint32_t bits;        // 4 or 8
    uint32_t group_size;  // a multiple of 32
    uint32_t symmetric;   // 1: absmax, 0: min-max
    uint32_t stochastic;  // 1: floor(v + u), 0: round half to even
};

// One slab on the wire (codec::slab::SlabLayout): [codes][scales][offsets if asym], padded to
// 16 bytes; scales and offsets little-endian fp32.
struct sdp_slab {
    struct sdp_quant quant;
    uint64_t groups;
    uint64_t byte_len;
};

// A Philox4x32-10 stream (rng::UniformStream): key = seed (low word first), counter =
// (i / 4 low, i / 4 high, step, stream); element i takes word i % 4, u = (word >> 8) * 2^-24.
struct sdp_rng {
    uint32_t key_lo;
    uint32_t key_hi;
    uint32_t step;
    uint32_t stream;
};

// Shard geometry of one bucket (plan::BucketPlan).
struct sdp_shards {
    uint64_t shard_len;         // S: real elements per shard
    uint64_t padded_shard_len;  // S_pad
    uint64_t chunk_len;         // S_pad / P
    uint32_t chunks;            // P
    uint32_t reserved;          // 0
};

// grad_quantize_first(const float* bucket, const uint32_t* dests, uint8_t* out, params):
// Hadamard (block != 0) + quantize + swizzle of the whole bucket into P * peers1 slabs
// (slab index s = p * peers1 + x1; group k of a slab is x2 = k / groups_per_chunk,
// j = k % groups_per_chunk; destination z = dests[x1 * peers2 + x2]; element e of the group is
// padded index z * S_pad + p * chunk_len + j * g + e, real when the in-shard offset < S, then
// read from bucket[z * S + offset], else 0). (backend::cpu::gradient::quantize_first)
struct sdp_grad_first {
    struct sdp_slab slab;
    struct sdp_shards shards;
    struct sdp_rng rng;
    uint32_t peers1;
    uint32_t peers2;
    uint32_t groups_per_chunk;
    uint32_t hadamard_block;  // 0: off
};

// grad_quantize_first_bf16(const sdp_bf16* bucket, ...): the same from a bf16 bucket.

// grad_requantize_second(const uint8_t* recv, const uint32_t* dests, uint8_t* out, params):
// for chunk p, out slab x2 group j = Q(sum over the peers1 received slabs, in order, of
// dequantize(group x2 * groups_per_chunk + j)); destination z = dests[my_x1 * peers2 + x2].
// (backend::cpu::gradient::requantize_second)
struct sdp_grad_second {
    struct sdp_slab in_slab;
    struct sdp_slab out_slab;
    struct sdp_shards shards;
    struct sdp_rng rng;
    uint32_t peers1;
    uint32_t peers2;
    uint32_t groups_per_chunk;
    uint32_t my_x1;
    uint32_t chunk;  // p
    uint32_t reserved;
};

// grad_reduce_final(const uint8_t* recv, float* shard, params): group j of chunk p of this
// rank's shard = inverse Hadamard(sum over the peers received slabs, in order, of
// dequantize(group j)); only the real elements (offset < S) are written.
// (backend::cpu::gradient::reduce_final)
// grad_reduce_final_bf16(const uint8_t* recv, sdp_bf16* shard, params): the same, each
// element rounded to bf16 (round to nearest even; NaN stays NaN, Inf stays Inf).
struct sdp_grad_final {
    struct sdp_slab slab;
    struct sdp_shards shards;
    uint32_t peers;
    uint32_t chunk;           // p
    uint32_t hadamard_block;  // 0: off
    uint32_t reserved;
};

// grad_widen_bf16(const sdp_bf16* src, float* dst, params): dst[i] = f32(src[i]);
// grad_narrow_bf16(const float* src, sdp_bf16* dst, params): dst[i] = bf16_rn(src[i]);
// grad_round_bf16(const sdp_bf16* src, sdp_bf16* dst, params): dst[i] = bf16_rn(f32(src[i]))
// (NaNs come out quiet), for i < numel. (backend::Backend::convert)
struct sdp_convert {
    uint64_t numel;
};

// weight_encode(const uint16_t* new_shard, const uint16_t* reference, uint8_t* out, params):
// bf16 in; x = f32(new) - f32(reference) (difference) or f32(new) (direct), zero beyond
// shard_len, quantized into one slab; uniforms of element e at first_index + e.
// (backend::cpu::weight::encode_shard)
struct sdp_weight_encode {
    struct sdp_slab slab;
    struct sdp_rng rng;
    uint64_t shard_len;
    uint64_t first_index;
    uint32_t difference;  // 1: qWD, 0: direct
    uint32_t reserved;
};

// weight_apply(const uint8_t* recv, const uint16_t* own_reference, uint16_t* params, params):
// for every rank z's slab and every real element: difference -> params = bf16_rn(ref + d')
// with ref = own_reference for z == me, else params; direct -> params = bf16_rn(x').
// (backend::cpu::weight::apply_shards)
struct sdp_weight_apply {
    struct sdp_slab slab;
    uint64_t shard_len;
    uint32_t world;
    uint32_t me;
    uint32_t difference;
    uint32_t reserved;
};

// global_absmax(const float* bucket, uint32_t* abs_bits, params): *abs_bits = max over the
// bucket of min(bits & 0x7fffffff, 0x7f800000) (atomicMax; the caller zeroes it first): the
// bits of max |x|, or of +Inf when a NaN or Inf is present, so the word read as an f32 is
// what a MAX all-reduce maximises. (backend::cpu::global_qsgd::local_absmax)
//
// global_absmax_bf16, global_quantize_i8_bf16, global_quantize_i16_bf16,
// global_dequantize_i8_bf16, global_dequantize_i16_bf16: the same with a bf16 bucket (read as
// f32) or a bf16 output (each element rounded to bf16).
//
// global_quantize_i8 / global_quantize_i16(const float* bucket, int8_t*/int16_t* out, params):
// out[i] = clamp(R(x[i] / s), -k, k), uniforms of element i of the bucket.
// global_dequantize_i8 / global_dequantize_i16(const int8_t*/int16_t* sum, float* out, params):
// out[i] = f32(sum[i]) * s (backend::cpu::global_qsgd), where sum[i] is element i of `sum`, or,
// when `blocks` > 1, the sum in rank order of element i of the `blocks` consecutive blocks of
// numel integers at `sum` (collective::sum_in_rank_order), each partial sum checked: an element
// whose sum overflows is NaN, and when `status` is not 0 (the device address of a u32 the
// caller zeroes) the first overflow (r, i) in rank order is recorded there as the largest
// 0xffffffff - (r * numel + i).
// s is `scale` when `absmax` is 0; otherwise `absmax` is the device address of the global
// absmax a (one f32 the kernels read) and s = a / k, with docs/numerics.md §7.2's special
// cases: a not finite: codes 0 and every output NaN; s = 0: codes 0 and every output 0.
struct sdp_global {
    struct sdp_rng rng;
    uint64_t numel;
    float scale;
    int32_t k;
    uint32_t stochastic;
    uint32_t blocks;
    uint64_t absmax;
    uint64_t status;
};
