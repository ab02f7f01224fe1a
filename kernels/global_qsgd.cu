// Global-QSGD passes (docs/numerics.md §7.2): the local absmax, the rounding of x / scale to 8- or
// 16-bit integers with one global scale, and the dequantization of the summed integers.
//
// Mirrors backend::cpu::global_qsgd: local_absmax, quantize::<i8 | i16>,
// dequantize::<i8 | i16>. Each kernel has a _bf16 variant that reads a bf16 bucket or writes a
// bf16 shard (docs/numerics.md §7.5; common.cuh's gradient elements).
//
// Spec: sdp_elementwise_spec<stochastic rounding (quantize only), runs per thread> (spec.cuh).
// Work unit: a run of 4 consecutive elements (one Philox block for quantize); a thread takes
// Runs runs per step of its grid-stride loop (runs b + k T, T the threads of the grid, so every
// warp access stays contiguous), all their loads issued before any arithmetic. A run is moved
// with one 16-byte access of fp32 (8 of bf16, and a 4- or 8-byte access of the integers) when
// the buffers are aligned for it and the run is whole, element by element otherwise (the
// rounding and the dequantization take those runs in a second loop). global_absmax reduces each
// warp's elements with a warp reduction and issues one atomicMax per warp.
#include "quantize.cuh"

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
template <class Spec, class G>
__device__ __forceinline__ void global_absmax_of(const G* __restrict__ bucket, uint32_t* __restrict__ abs_bits,
                                                 const sdp_global& args)
{
    const bool vector = sdp_grad_run_aligned(bucket);
    const uint64_t threads = sdp_thread_count();
    uint32_t m = 0;
    for (uint64_t b = sdp_thread_id(); b < global_runs(args); b += Spec::runs * threads) {
        float v[Spec::runs][4];
#pragma unroll
        for (uint32_t k = 0; k < Spec::runs; ++k) {
            const uint64_t run = b + k * threads;
            if (run < global_runs(args)) {
                global_load_run(bucket, args, run, vector, v[k]);
            } else {
                v[k][0] = v[k][1] = v[k][2] = v[k][3] = 0.0f;
            }
        }
#pragma unroll
        for (uint32_t k = 0; k < Spec::runs; ++k) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const uint32_t bits = sdp_abs_bits(v[k][e]);
                m = bits > m ? bits : m;
            }
        }
    }
    m = m < GLOBAL_INF_BITS ? m : GLOBAL_INF_BITS;
    m = sdp_warp_max_u32(m);
    if (sdp_lane() == 0 && m != 0) {
        atomicMax(abs_bits, m);
    }
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
template <class Spec>
__device__ __forceinline__ int32_t global_code(const sdp_global& args, float t, uint32_t word)
{
    return sdp_round_clamp(Spec::stochastic, t, word, -args.k, args.k);
}

// The Philox words of run b (zeros for round half to even).
template <class Spec>
__device__ __forceinline__ void global_words(const sdp_global& args, uint64_t b, uint32_t* w)
{
    if (Spec::stochastic) {
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
template <class Spec, class Code, class G>
__device__ __forceinline__ void global_quantize_checked(const G* __restrict__ bucket, Code* __restrict__ out,
                                                        const sdp_global& args, const GlobalScale& scale,
                                                        uint64_t b)
{
    uint32_t w[4];
    global_words<Spec>(args, b, w);
#pragma unroll 1
    for (uint32_t e = 0; e < 4; ++e) {
        const uint64_t i = 4 * b + e;
        if (i >= args.numel) {
            return;
        }
        const float t = __fdiv_rn(sdp_grad_to_f32(bucket[i]), scale.s);
        out[i] = (Code)(scale.outcome == GLOBAL_SCALED ? global_code<Spec>(args, t, w[e]) : 0);
    }
}

// out[i] = the code of bucket[i] for every element of the bucket, one run of 4 (one Philox
// block: its four uniforms) per thread and run. The main loop takes the whole runs of aligned
// buffers of a launch that scales, Runs per thread and step with their loads and Philox words
// ahead of the arithmetic, dividing by the scale as sdp_divide_run does (a multiplication by
// its reciprocal and two fused multiply-adds where that is the IEEE quotient,
// docs/numerics.md §1.4; the scale bounds no value, so both limits of |x| are checked per
// value); a second loop the rest.
template <class Spec, class Code, class G>
__device__ __forceinline__ void global_quantize_of(const G* __restrict__ bucket, Code* __restrict__ out,
                                                   const sdp_global& args)
{
    const GlobalScale scale = global_scale(args);
    const bool vector = sdp_grad_run_aligned(bucket) && sdp_aligned(out, 4 * sizeof(Code));
    const uint64_t whole = vector && scale.outcome == GLOBAL_SCALED ? args.numel / 4 : 0;
    const sdp_divisor divisor = sdp_divisor_unbounded(scale.s);
    const uint64_t threads = sdp_thread_count();
    for (uint64_t b = sdp_thread_id(); b < whole; b += Spec::runs * threads) {
        // A NaN's payload never reaches a code: raw bf16 conversion.
        float x[Spec::runs][4];
        uint32_t w[Spec::runs][4];
#pragma unroll
        for (uint32_t k = 0; k < Spec::runs; ++k) {
            if (b + k * threads < whole) {
                sdp_grad_fetch4(bucket + 4 * (b + k * threads), x[k]);
            }
        }
#pragma unroll
        for (uint32_t k = 0; k < Spec::runs; ++k) {
            global_words<Spec>(args, b + k * threads, w[k]);
        }
#pragma unroll
        for (uint32_t k = 0; k < Spec::runs; ++k) {
            const uint64_t run = b + k * threads;
            if (run < whole) {
                float t[4];
                sdp_grad_widen4_raw<G>(x[k]);
                sdp_divide_run<4, true>(divisor, x[k], t);
                int32_t c[4];
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) {
                    c[e] = global_code<Spec>(args, t[e], w[k][e]);
                }
                global_store_run(out + 4 * run, c);
            }
        }
    }
    // Cold path: the runs the main loop did not take (unaligned buffers, the last partial run,
    // a launch whose outputs are zeros or NaN).
    for (uint64_t b = whole + sdp_thread_id(); b < global_runs(args); b += threads) {
        global_quantize_checked<Spec>(bucket, out, args, scale, b);
    }
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

// out[i] = f32(sum[i]) * scale (NaN or 0 by global_scale's outcome), where sum[i] is the sum in
// rank order of element i of the `blocks` consecutive blocks of numel integers at `sum` (one
// block when `blocks` is 0 or 1), each partial sum checked: an element whose sum overflows the
// Code is NaN and recorded in the status word.
//
// The main loop takes the whole runs of aligned buffers, Runs per thread and step with the
// first block's loads ahead of the arithmetic, and checks each element's partial sums once, by
// the largest of them offset as below (an element overflows exactly when one of its partial
// sums lies outside the Code); a thread that meets an overflow there goes over its runs of the
// main loop again, element by element, to find each first overflow for the status word.
template <class Spec, class Code, class G>
__device__ __forceinline__ void global_dequantize_of(const Code* __restrict__ sum, G* __restrict__ out,
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
    const uint64_t threads = sdp_thread_count();
    // Each element's partial sums less the Code's smallest value, as unsigned: inside the Code
    // exactly when at most `span`, and a sum below it wraps to above 2^31 (|partial sums| <
    // 2^31 for fewer than 65536 blocks), so the largest of them tells whether any partial sum
    // overflowed.
    const int32_t lowest = -global_code_max<Code>() - 1;
    const uint32_t span = 2 * (uint32_t)global_code_max<Code>() + 1;
    bool overflowed = false;
    for (uint64_t b = sdp_thread_id(); b < whole; b += Spec::runs * threads) {
        int32_t c[Spec::runs][4];
        if (scale.outcome == GLOBAL_SCALED) {
#pragma unroll
            for (uint32_t k = 0; k < Spec::runs; ++k) {
                if (b + k * threads < whole) {
                    global_load_sums(sum + 4 * (b + k * threads), c[k]);
                }
            }
        }
#pragma unroll
        for (uint32_t k = 0; k < Spec::runs; ++k) {
            const uint64_t run = b + k * threads;
            if (run >= whole) {
                break;
            }
            float x[4] = {fill, fill, fill, fill};
            if (scale.outcome == GLOBAL_SCALED) {
                uint32_t acc[4];
                uint32_t reach[4];
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) {
                    acc[e] = (uint32_t)(c[k][e] - lowest);
                    reach[e] = acc[e];
                }
                const Code* block = sum + 4 * run;
                for (uint32_t r = 1; r < blocks; ++r) {
                    block += args.numel;
                    int32_t more[4];
                    global_load_sums(block, more);
#pragma unroll
                    for (uint32_t e = 0; e < 4; ++e) {
                        acc[e] += (uint32_t)more[e];
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
            sdp_grad_store4(out + 4 * run, x);
        }
    }
    // Cold path: element by element, after an overflow there this thread's runs of the main
    // loop again, then the runs it did not take (unaligned buffers, the last partial run).
    if (overflowed) {
        for (uint64_t b = sdp_thread_id(); b < whole; b += threads) {
            global_dequantize_checked(sum, out, args, blocks, scale, fill, b);
        }
    }
    for (uint64_t b = whole + sdp_thread_id(); b < global_runs(args); b += threads) {
        global_dequantize_checked(sum, out, args, blocks, scale, fill, b);
    }
}
