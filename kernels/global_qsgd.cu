// Global-QSGD passes (docs/numerics.md §7.2): the local absmax, the rounding of x / scale to 8- or
// 16-bit integers with one global scale, and the dequantization of the summed integers.
//
// Mirrors backend::cpu::global_qsgd: local_absmax, quantize::<i8 | i16>,
// dequantize::<i8 | i16>. Each kernel has a _bf16 variant that reads a bf16 bucket or writes a
// bf16 shard (docs/numerics.md §7.5; common.cuh's gradient elements).
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one run of 4 consecutive elements per thread (one Philox block for quantize),
// grid-stride over ceil(numel / 4) runs; a run is moved with one 16-byte access of fp32 (8 of
// bf16, and a 4- or 8-byte access of the integers) when the buffers are aligned for it and the
// run is whole, element by element otherwise (the rounding and the dequantization take those
// runs in a second loop). global_absmax reduces each warp's elements with a warp reduction and
// issues one atomicMax per warp.
#include "common.cuh"

// Runs of 4 elements of a bucket of numel elements.
__device__ __forceinline__ uint64_t global_runs(const sdp_global& args)
{
    return (args.numel + 3) / 4;
}

// The fp32 values of run b of `x` (zeros past numel): one 16-byte load when `vector`.
template <class G>
__device__ __forceinline__ void global_load_run(const G* __restrict__ x, const sdp_global& args, uint64_t b,
                                                bool vector, float* v)
{
    if (vector && 4 * b + 4 <= args.numel) {
        sdp_grad_load4(x + 4 * b, v);
        return;
    }
#pragma unroll
    for (uint32_t e = 0; e < 4; ++e) {
        v[e] = 4 * b + e < args.numel ? sdp_grad_to_f32(x[4 * b + e]) : 0.0f;
    }
}

// The bits of +Inf: global_absmax's word for a bucket holding a NaN or Inf.
#define GLOBAL_INF_BITS 0x7f800000u

// global_absmax(bucket, abs_bits): *abs_bits = max over the bucket of min(bits & 0x7fffffff,
// +Inf's bits), the caller zeroes it first: the f32 max |x|, or +Inf when a NaN or Inf is
// present (local_absmax), which a MAX all-reduce of the word as an f32 maximises.
template <class G>
__device__ __forceinline__ void global_absmax_of(const G* __restrict__ bucket, uint32_t* __restrict__ abs_bits,
                                                 const sdp_global& args)
{
    const bool vector = sdp_grad_run_aligned(bucket);
    uint32_t m = 0;
    for (uint64_t b = sdp_thread_id(); b < global_runs(args); b += sdp_thread_count()) {
        float v[4];
        global_load_run(bucket, args, b, vector, v);
#pragma unroll
        for (uint32_t e = 0; e < 4; ++e) {
            const uint32_t bits = sdp_abs_bits(v[e]);
            m = bits > m ? bits : m;
        }
    }
    m = m < GLOBAL_INF_BITS ? m : GLOBAL_INF_BITS;
    m = sdp_warp_max_u32(m);
    if (sdp_lane() == 0 && m != 0) {
        atomicMax(abs_bits, m);
    }
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
global_absmax(const float* __restrict__ bucket, uint32_t* __restrict__ abs_bits, sdp_global args)
{
    global_absmax_of(bucket, abs_bits, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
global_absmax_bf16(const sdp_bf16* __restrict__ bucket, uint32_t* __restrict__ abs_bits, sdp_global args)
{
    global_absmax_of(bucket, abs_bits, args);
}

// What a launch scales by (docs/numerics.md §7.2 steps 2 and 4): `scale`, or a / k for the
// global absmax a the launch reads from device memory, where a not finite makes every output
// NaN and a / k = 0 every output 0 (in both cases every code is 0, so the integer sum stays 0).
enum GlobalOutcome : uint32_t { GLOBAL_SCALED = 0, GLOBAL_ZEROS = 1, GLOBAL_NANS = 2 };

struct GlobalScale {
    float s;
    GlobalOutcome outcome;
};

__device__ __forceinline__ GlobalScale global_scale(const sdp_global& args)
{
    if (args.absmax == 0) {
        return GlobalScale{args.scale, GLOBAL_SCALED};
    }
    const float a = *reinterpret_cast<const float*>(args.absmax);
    if (!sdp_is_finite(a)) {
        return GlobalScale{0.0f, GLOBAL_NANS};
    }
    const float s = __fdiv_rn(a, (float)args.k);
    return s == 0.0f ? GlobalScale{0.0f, GLOBAL_ZEROS} : GlobalScale{s, GLOBAL_SCALED};
}

// The code of quotient t = x / scale: clamp(R(t), -k, k) with R = floor(t + u) (stochastic, u
// from the Philox word `word`) or round half to even; a NaN code becomes 0 (quantize_task and
// quant::code_bits).
__device__ __forceinline__ int32_t global_code(const sdp_global& args, float t, uint32_t word)
{
    return sdp_round_clamp(args.stochastic != 0, t, word, -args.k, args.k);
}

// The Philox words of run b (zeros for round half to even).
__device__ __forceinline__ void global_words(const sdp_global& args, uint64_t b, uint32_t* w)
{
    if (args.stochastic) {
        sdp_words4(args.rng, 4 * b, w);
    } else {
        w[0] = w[1] = w[2] = w[3] = 0;
    }
}

// The 4 codes of a whole run at `out` (4-aligned): one 4-byte (int8) or 8-byte (int16) store.
__device__ __forceinline__ void global_store_run(int8_t* out, const int32_t* c)
{
    uint32_t word = 0;
#pragma unroll
    for (uint32_t e = 0; e < 4; ++e) {
        word |= ((uint32_t)c[e] & 0xffu) << (8 * e);
    }
    __stcs((unsigned int*)out, word);
}

__device__ __forceinline__ void global_store_run(int16_t* out, const int32_t* c)
{
    const uint32_t lo = ((uint32_t)c[0] & 0xffffu) | ((uint32_t)c[1] << 16);
    const uint32_t hi = ((uint32_t)c[2] & 0xffffu) | ((uint32_t)c[3] << 16);
    __stcs((uint2*)out, make_uint2(lo, hi));
}

// Cold path: the codes of run b element by element (the run may be partial or unaligned):
// every code 0 unless the launch scales (global_scale's outcome), else x / scale by the plain
// division.
template <class Code, class G>
__device__ __forceinline__ void global_quantize_checked(const G* __restrict__ bucket, Code* __restrict__ out,
                                                        const sdp_global& args, const GlobalScale& scale,
                                                        uint64_t b)
{
    uint32_t w[4];
    global_words(args, b, w);
#pragma unroll 1
    for (uint32_t e = 0; e < 4; ++e) {
        const uint64_t i = 4 * b + e;
        if (i >= args.numel) {
            return;
        }
        const float t = __fdiv_rn(sdp_grad_to_f32(bucket[i]), scale.s);
        out[i] = (Code)(scale.outcome == GLOBAL_SCALED ? global_code(args, t, w[e]) : 0);
    }
}

// out[i] = the code of bucket[i] for every element of the bucket, one run of 4 (one Philox
// block: its four uniforms) per thread and step. The main loop takes the whole runs of aligned
// buffers of a launch that scales, dividing by the scale as sdp_divide_run does (a
// multiplication by its reciprocal and two fused multiply-adds where that is the IEEE
// quotient, docs/numerics.md §1.4; the scale bounds no value, so both limits of |x| are
// checked per value); a second loop the rest.
template <class Code, class G>
__device__ __forceinline__ void global_quantize(const G* __restrict__ bucket, Code* __restrict__ out,
                                                const sdp_global& args)
{
    const GlobalScale scale = global_scale(args);
    const bool vector = sdp_grad_run_aligned(bucket) && sdp_aligned(out, 4 * sizeof(Code));
    const uint64_t whole = vector && scale.outcome == GLOBAL_SCALED ? args.numel / 4 : 0;
    const sdp_divisor divisor = sdp_divisor_unbounded(scale.s);
    uint64_t b = sdp_thread_id();
    for (; b < whole; b += sdp_thread_count()) {
        // A NaN's payload never reaches a code: raw bf16 conversion.
        float x[4];
        sdp_grad_load4_raw(bucket + 4 * b, x);
        float t[4];
        sdp_divide_run<4, true>(divisor, x, t);
        uint32_t w[4];
        global_words(args, b, w);
        int32_t c[4];
#pragma unroll
        for (uint32_t e = 0; e < 4; ++e) {
            c[e] = global_code(args, t[e], w[e]);
        }
        global_store_run(out + 4 * b, c);
    }
    // Cold path: the runs the main loop did not take (unaligned buffers, the last partial run,
    // a launch whose outputs are zeros or NaN).
    for (; b < global_runs(args); b += sdp_thread_count()) {
        global_quantize_checked(bucket, out, args, scale, b);
    }
}

// global_quantize_i8 / global_quantize_i16(bucket, out).
extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
global_quantize_i8(const float* __restrict__ bucket, int8_t* __restrict__ out, sdp_global args)
{
    global_quantize(bucket, out, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
global_quantize_i16(const float* __restrict__ bucket, int16_t* __restrict__ out, sdp_global args)
{
    global_quantize(bucket, out, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
global_quantize_i8_bf16(const sdp_bf16* __restrict__ bucket, int8_t* __restrict__ out, sdp_global args)
{
    global_quantize(bucket, out, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
global_quantize_i16_bf16(const sdp_bf16* __restrict__ bucket, int16_t* __restrict__ out, sdp_global args)
{
    global_quantize(bucket, out, args);
}

// The 4 integers of the whole, aligned run at `run` (one 4- or 8-byte load).
__device__ __forceinline__ void global_load_sums(const int8_t* __restrict__ run, int32_t* c)
{
    const uint32_t word = __ldg((const unsigned int*)run);
#pragma unroll
    for (uint32_t e = 0; e < 4; ++e) {
        c[e] = (int32_t)(word << (24 - 8 * e)) >> 24;
    }
}

__device__ __forceinline__ void global_load_sums(const int16_t* __restrict__ run, int32_t* c)
{
    const uint2 w = __ldg((const uint2*)run);
    c[0] = (int32_t)(w.x << 16) >> 16;
    c[1] = (int32_t)w.x >> 16;
    c[2] = (int32_t)(w.y << 16) >> 16;
    c[3] = (int32_t)w.y >> 16;
}

// The largest and smallest value of a Code.
template <class Code>
__device__ __forceinline__ int32_t global_code_max()
{
    return sizeof(Code) == 1 ? 127 : 32767;
}

template <class Code>
__device__ __forceinline__ bool global_outside(int32_t v)
{
    return v > global_code_max<Code>() || v < -global_code_max<Code>() - 1;
}

// Records that the sum of element i overflowed when block r was added: the status word keeps
// the largest 0xffffffff - (r * numel + i), so the smallest (r, i), the first overflow of a
// sum in rank order (collective::sum_in_rank_order), is what it names; 0 means none.
__device__ __forceinline__ void global_record_overflow(const sdp_global& args, uint32_t r, uint64_t i)
{
    if (args.status != 0) {
        atomicMax(reinterpret_cast<unsigned int*>(args.status), 0xffffffffu - (uint32_t)(r * args.numel + i));
    }
}

// Cold path: run b of the output element by element, each element the sum in rank order of
// its `blocks` blocks with every partial sum checked: an overflow makes it NaN and is recorded.
template <class Code, class G>
__device__ __forceinline__ void global_dequantize_checked(const Code* __restrict__ sum, G* __restrict__ out,
                                                          const sdp_global& args, uint32_t blocks,
                                                          const GlobalScale& scale, float fill, uint64_t b)
{
#pragma unroll 1
    for (uint32_t e = 0; e < 4; ++e) {
        const uint64_t i = 4 * b + e;
        if (i >= args.numel) {
            return;
        }
        float x = fill;
        if (scale.outcome == GLOBAL_SCALED) {
            int32_t acc = sum[i];
            uint32_t r = 1;
#pragma unroll 1
            for (; r < blocks; ++r) {
                acc += sum[(uint64_t)r * args.numel + i];
                if (global_outside<Code>(acc)) {
                    global_record_overflow(args, r, i);
                    break;
                }
            }
            x = r < blocks ? sdp_nan() : __fmul_rn((float)acc, scale.s);
        }
        sdp_grad_store1(out + i, x);
    }
}

// out[i] = f32(sum[i]) * scale (NaN or 0 by global_scale's outcome), one run of 4 per thread
// and step, where sum[i] is the sum in rank order of element i of the `blocks` consecutive
// blocks of numel integers at `sum` (one block when `blocks` is 0 or 1), each partial sum
// checked: an element whose sum overflows the Code is NaN and recorded in the status word.
//
// The main loop takes the whole runs of aligned buffers and checks each element's partial
// sums once, by the largest of them offset as below (an element overflows exactly when one
// of its partial sums lies outside the Code); a thread that meets an overflow there goes
// over its runs again after it, element by element, to find each first overflow for the
// status word.
template <class Code, class G>
__device__ __forceinline__ void global_dequantize(const Code* __restrict__ sum, G* __restrict__ out,
                                                  const sdp_global& args)
{
    const uint32_t blocks = args.blocks > 1 ? args.blocks : 1;
    // Every block is aligned like the first when numel is a multiple of a run.
    const bool vector = sdp_grad_run_aligned(out) && sdp_aligned(sum, 4 * sizeof(Code)) &&
        (blocks == 1 || args.numel % 4 == 0);
    const GlobalScale scale = global_scale(args);
    const float fill = scale.outcome == GLOBAL_NANS ? sdp_nan() : 0.0f;
    // The runs the main loop takes: every whole run when the buffers are aligned.
    const uint64_t whole = vector ? args.numel / 4 : 0;
    bool overflowed = false;
    uint64_t b = sdp_thread_id();
    for (; b < whole; b += sdp_thread_count()) {
        float x[4] = {fill, fill, fill, fill};
        if (scale.outcome == GLOBAL_SCALED) {
            // Each element's partial sums less the Code's smallest value, as unsigned: inside
            // the Code exactly when at most `span`, and a sum below it wraps to above 2^31
            // (|partial sums| < 2^31 for fewer than 65536 blocks), so the largest of them
            // tells whether any partial sum overflowed.
            const int32_t lowest = -global_code_max<Code>() - 1;
            const uint32_t span = 2 * (uint32_t)global_code_max<Code>() + 1;
            int32_t c[4];
            global_load_sums(sum + 4 * b, c);
            uint32_t acc[4];
            uint32_t reach[4];
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                acc[e] = (uint32_t)(c[e] - lowest);
                reach[e] = acc[e];
            }
            const Code* block = sum + 4 * b;
            // Unrolled only where `blocks` is a compile-time constant (the kernel model's
            // wrapper); a runtime count stays a loop.
#pragma unroll
            for (uint32_t r = 1; r < blocks; ++r) {
                block += args.numel;
                global_load_sums(block, c);
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) {
                    acc[e] += (uint32_t)c[e];
                    reach[e] = acc[e] > reach[e] ? acc[e] : reach[e];
                }
            }
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const bool outside = reach[e] > span;
                overflowed |= outside;
                x[e] = outside ? sdp_nan() : __fmul_rn((float)((int32_t)acc[e] + lowest), scale.s);
            }
        }
        sdp_grad_store4(out + 4 * b, x);
    }
    // Cold path: element by element, after an overflow there this thread's runs of the main
    // loop again (last first), then the runs it did not take (unaligned buffers, the last
    // partial run).
    if (overflowed) {
        for (uint64_t again = b; again >= sdp_thread_count();) {
            again -= sdp_thread_count();
            global_dequantize_checked(sum, out, args, blocks, scale, fill, again);
        }
    }
    for (; b < global_runs(args); b += sdp_thread_count()) {
        global_dequantize_checked(sum, out, args, blocks, scale, fill, b);
    }
}

// global_dequantize_i8 / global_dequantize_i16(sum, out). The int16 kernel's peer loop needs
// 40 registers (six blocks of 256 threads per multiprocessor) to run without spilling.
extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
global_dequantize_i8(const int8_t* __restrict__ sum, float* __restrict__ out, sdp_global args)
{
    global_dequantize(sum, out, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 6)
global_dequantize_i16(const int16_t* __restrict__ sum, float* __restrict__ out, sdp_global args)
{
    global_dequantize(sum, out, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
global_dequantize_i8_bf16(const int8_t* __restrict__ sum, sdp_bf16* __restrict__ out, sdp_global args)
{
    global_dequantize(sum, out, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 6)
global_dequantize_i16_bf16(const int16_t* __restrict__ sum, sdp_bf16* __restrict__ out, sdp_global args)
{
    global_dequantize(sum, out, args);
}
