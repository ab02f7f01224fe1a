// Global-QSGD passes (docs/numerics.md §7.2): the local absmax, the rounding of x / scale to 8- or
// 16-bit integers with one global scale, and the dequantization of the summed integers.
//
// Mirrors backend::cpu::global_qsgd: local_absmax, quantize::<i8 | i16>,
// dequantize::<i8 | i16>.
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one element per thread (absmax, dequantize) or one Philox block of 4 consecutive
// elements per thread (quantize), grid-stride over numel (uint64). global_absmax reduces each
// warp's elements with shuffles and issues one atomicMax per warp.
#include "common.cuh"

// global_absmax(bucket, abs_bits): *abs_bits = max over the bucket of (bits & 0x7fffffff), the
// caller zeroes it first; >= 0x7f800000 means a NaN or Inf is present (local_absmax returns
// +Inf then).
extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS)
global_absmax(const float* __restrict__ bucket, uint32_t* __restrict__ abs_bits, sdp_global args)
{
    uint32_t m = 0;
    for (uint64_t i = sdp_thread_id(); i < args.numel; i += sdp_thread_count()) {
        const uint32_t bits = sdp_abs_bits(bucket[i]);
        m = bits > m ? bits : m;
    }
    m = sdp_warp_max_u32(m);
    if (sdp_lane() == 0 && m != 0) {
        atomicMax(abs_bits, m);
    }
}

// The code of x: clamp(R(x / scale), -k, k) with R = floor(x / scale + u) (stochastic) or
// round half to even; a NaN code becomes 0 (quantize_task and quant::code_bits).
__device__ __forceinline__ int32_t global_code(const sdp_global& args, float x, float u)
{
    const float t = __fdiv_rn(x, args.scale);
    float c = args.stochastic ? floorf(__fadd_rn(t, u)) : rintf(t);
    if (c != c) {
        return 0;
    }
    const float k = (float)args.k;
    c = fminf(fmaxf(c, -k), k);
    return (int32_t)c;
}

// out[i] = the code of bucket[i] for the elements of one Philox block, i = 4 b .. 4 b + 3 (the
// last block may be partial): one block gives the four uniforms.
template <class Code>
__device__ __forceinline__ void global_quantize_block(const float* bucket, Code* out, const sdp_global& args,
                                                      uint64_t b)
{
    const sdp_philox_block words = args.stochastic ? sdp_philox(args.rng, b) : sdp_philox_block{};
#pragma unroll
    for (uint32_t w = 0; w < 4; ++w) {
        const uint64_t i = 4 * b + w;
        if (i < args.numel) {
            const float u = sdp_word_to_uniform(sdp_philox_pick(words, w));
            out[i] = (Code)global_code(args, bucket[i], u);
        }
    }
}

// global_quantize_i8 / global_quantize_i16(bucket, out): work unit = one Philox block of four
// consecutive elements per thread, grid-stride over ceil(numel / 4) blocks.
extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS)
global_quantize_i8(const float* __restrict__ bucket, int8_t* __restrict__ out, sdp_global args)
{
    for (uint64_t b = sdp_thread_id(); b < (args.numel + 3) / 4; b += sdp_thread_count()) {
        global_quantize_block(bucket, out, args, b);
    }
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS)
global_quantize_i16(const float* __restrict__ bucket, int16_t* __restrict__ out, sdp_global args)
{
    for (uint64_t b = sdp_thread_id(); b < (args.numel + 3) / 4; b += sdp_thread_count()) {
        global_quantize_block(bucket, out, args, b);
    }
}

// global_dequantize_i8 / global_dequantize_i16(sum, out): out[i] = f32(sum[i]) * scale.
extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS)
global_dequantize_i8(const int8_t* __restrict__ sum, float* __restrict__ out, sdp_global args)
{
    for (uint64_t i = sdp_thread_id(); i < args.numel; i += sdp_thread_count()) {
        out[i] = __fmul_rn((float)sum[i], args.scale);
    }
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS)
global_dequantize_i16(const int16_t* __restrict__ sum, float* __restrict__ out, sdp_global args)
{
    for (uint64_t i = sdp_thread_id(); i < args.numel; i += sdp_thread_count()) {
        out[i] = __fmul_rn((float)sum[i], args.scale);
    }
}
