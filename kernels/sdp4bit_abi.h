// The launch ABI between the Rust CUDA backend and the kernels in this directory: the
// parameter structs. Each kernel takes its device pointers first, then one parameter struct by
// value (the kernel table, sdp4bit_kernels.h). Fixed-width fields, each with a comment, and no
// implicit padding: build.rs generates the #[repr(C)] Rust mirrors (src/backend/cuda/abi.rs)
// from the struct definitions below, field comments as their docs, and fails the build on a
// struct with padding. A specialised kernel (spec.cuh) still receives every field; the
// configuration it was compiled for is derived from the same struct (src/backend/cuda/spec.rs).
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
    uint16_t bits;  // the high half of the fp32's bits
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
    struct sdp_quant quant;  // the quantizer of every group
    uint64_t groups;         // groups in the slab
    uint64_t byte_len;       // bytes of the slab, padding included
};

// A Philox4x32-10 stream (rng::UniformStream): key = seed (low word first), counter =
// (i / 4 low, i / 4 high, step, stream); element i takes word i % 4, u = (word >> 8) * 2^-24.
struct sdp_rng {
    uint32_t key_lo;  // low word of the seed
    uint32_t key_hi;  // high word of the seed
    uint32_t step;    // counter word 2: the optimizer step
    uint32_t stream;  // counter word 3: the stream id
};

// Shard geometry of one bucket (layout::BucketPlan).
struct sdp_shards {
    uint64_t shard_len;         // S: real elements per shard
    uint64_t padded_shard_len;  // S_pad
    uint64_t chunk_len;         // S_pad / P
    uint32_t chunks;            // P
    uint32_t reserved;          // 0
};

// grad_quantize_first: Hadamard (block != 0) + quantize + swizzle of the whole bucket into
// P * peers1 slabs of out (slab index s = p * peers1 + x1; group k of a slab is
// x2 = k / groups_per_chunk, j = k % groups_per_chunk; destination z = dests[x1 * peers2 + x2];
// element e of the group is padded index z * S_pad + p * chunk_len + j * g + e, real when the
// in-shard offset < S, then read from bucket[z * S + offset], else 0).
// (backend::cpu::gradient::quantize_first) grad_quantize_first_bf16: the same from a bf16
// bucket.
struct sdp_grad_first {
    struct sdp_slab slab;      // the first-level slab layout
    struct sdp_shards shards;  // shard geometry
    struct sdp_rng rng;        // the first quantization's stream
    uint32_t peers1;           // peers of the first exchange
    uint32_t peers2;           // peers of the second exchange (1 when there is none)
    uint32_t groups_per_chunk; // Gc: groups per destination per chunk
    uint32_t hadamard_block;   // 0: off
};

// grad_requantize_second: for chunk p, out slab x2 group j = Q(sum over the peers1 received
// slabs of recv, in order, of dequantize(group x2 * groups_per_chunk + j)); destination
// z = dests[my_x1 * peers2 + x2]. (backend::cpu::gradient::requantize_second)
struct sdp_grad_second {
    struct sdp_slab in_slab;   // the first-level slab layout (what was received)
    struct sdp_slab out_slab;  // the second-level slab layout (what is sent)
    struct sdp_shards shards;  // shard geometry
    struct sdp_rng rng;        // the requantization's stream
    uint32_t peers1;           // peers of the first exchange
    uint32_t peers2;           // peers of the second exchange
    uint32_t groups_per_chunk; // Gc
    uint32_t my_x1;            // this rank's index in the first-level communicator
    uint32_t chunk;            // the pipeline chunk p
    uint32_t reserved;         // 0
};

// grad_reduce_final: group j of chunk p of this rank's shard = inverse Hadamard(sum over the
// peers received slabs of recv, in order, of dequantize(group j)); only the real elements
// (offset < S) are written. (backend::cpu::gradient::reduce_final) grad_reduce_final_bf16: the
// same, each element rounded to bf16 (round to nearest even; NaN stays NaN, Inf stays Inf).
struct sdp_grad_final {
    struct sdp_slab slab;      // the last level's slab layout
    struct sdp_shards shards;  // shard geometry
    uint32_t peers;            // peers of the last exchange
    uint32_t chunk;            // the pipeline chunk p
    uint32_t hadamard_block;   // 0: off
    uint32_t reserved;         // 0
};

// grad_widen_bf16: dst[i] = f32(src[i]); grad_narrow_bf16: dst[i] = bf16_rn(src[i]);
// grad_round_bf16: dst[i] = bf16_rn(f32(src[i])) (NaNs come out quiet), for i < numel.
// (backend::Backend::convert)
struct sdp_convert {
    uint64_t numel;  // elements
};

// weight_encode: bf16 in; x = f32(new_shard) - f32(reference) (difference) or f32(new_shard)
// (direct), zero beyond shard_len, quantized into the slab out; uniforms of element e at
// first_index + e. (backend::cpu::weight::encode_shard)
struct sdp_weight_encode {
    struct sdp_slab slab;  // the weight slab layout
    struct sdp_rng rng;    // the weight quantization's stream
    uint64_t shard_len;    // real elements of the shard
    uint64_t first_index;  // padded bucket index of the shard's first element
    uint32_t difference;   // 1: qWD difference, 0: direct
    uint32_t reserved;     // 0
};

// weight_apply: for every rank z's slab of recv and every real element: difference ->
// params = bf16_rn(ref + d') with ref = own_reference for z == me, else params; direct ->
// params = bf16_rn(x'). (backend::cpu::weight::apply_shards)
struct sdp_weight_apply {
    struct sdp_slab slab;  // the weight slab layout
    uint64_t shard_len;    // real elements of one shard
    uint32_t world;        // W
    uint32_t me;           // this rank
    uint32_t difference;   // 1: qWD difference, 0: direct
    uint32_t reserved;     // 0
};

// global_absmax: *abs_bits = max over the bucket of min(bits & 0x7fffffff, 0x7f800000)
// (atomicMax; the caller zeroes it first): the bits of max |x|, or of +Inf when a NaN or Inf
// is present, so the word read as an f32 is what a MAX all-reduce maximises.
// (backend::cpu::global_qsgd::local_absmax)
//
// global_absmax_bf16, global_quantize_i8_bf16, global_quantize_i16_bf16,
// global_dequantize_i8_bf16, global_dequantize_i16_bf16: the same with a bf16 bucket (read as
// f32) or a bf16 output (each element rounded to bf16).
//
// global_quantize_i8 / global_quantize_i16: out[i] = clamp(R(bucket[i] / s), -k, k),
// uniforms of element i of the bucket.
// global_dequantize_i8 / global_dequantize_i16: out[i] = f32(sum[i]) * s
// (backend::cpu::global_qsgd), where sum[i] is element i of `sum`, or, when `blocks` > 1, the
// sum in rank order of element i of the `blocks` consecutive blocks of numel integers at `sum`
// (collective::sum_in_rank_order), each partial sum checked: an element whose sum overflows is
// NaN, and when `status` is not 0 (the device address of a u32 the caller zeroes) the first
// overflow (r, i) in rank order is recorded there as the largest 0xffffffff - (r * numel + i).
// s is `scale` when `absmax` is 0; otherwise `absmax` is the device address of the global
// absmax a (one f32 the kernels read) and s = a / k, with docs/numerics.md §7.2's special
// cases: a not finite: codes 0 and every output NaN; s = 0: codes 0 and every output 0.
struct sdp_global {
    struct sdp_rng rng;   // the rounding stream (quantize only)
    uint64_t numel;       // elements
    float scale;          // the global scale s = a / k (quantize, dequantize) when absmax is 0
    int32_t k;            // the largest code magnitude (quantize; dequantize when absmax is set)
    uint32_t stochastic;  // 1: stochastic rounding, 0: round half to even (quantize only)
    uint32_t blocks;      // dequantize: the rank blocks summed in rank order (0 or 1: one)
    uint64_t absmax;      // 0, or the device address of the global absmax a (one f32)
    uint64_t status;      // dequantize: 0, or the device address of the overflow status word
};

// The device words a parameter struct addresses besides the kernel's pointer arguments: each
// SDP_WORD(struct, field, written) is a uint64_t field holding 0 or the device address of a
// 4-byte word that the struct's kernels read (written 0) or write (written 1). The CUDA driver
// emulation checks and orders these accesses as it does a pointer argument's.
#define SDP4BIT_STRUCT_WORDS(SDP_WORD) \
    SDP_WORD(sdp_global, absmax, 0)    \
    SDP_WORD(sdp_global, status, 1)
