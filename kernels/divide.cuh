// Division by a scale fixed for many quotients.
#pragma once

#include "common.cuh"

// Correctly rounded fp32 division x / s for many x by one s (docs/numerics.md §1.4), as a
// multiply and two fused multiply-adds instead of a division per quotient: with y = RN(1 / s)
// (once per divisor), q0 = RN(x y) and the exact residual r = fma(-q0, s, x),
// q1 = fma(r, y, q0) is RN(x / s) (Markstein's theorem) as long as no step leaves the normal
// range. That is guaranteed for 2^-40 <= s < 2^40 and 2^-60 <= |x| < 2^60: the quotient, y
// and x y stay within (2^-100, 2^100), and r is 0 or a multiple of 2^-107 (so exact and never
// subnormal). A zero x is exact too (q0 = x, r = +0) if q1 is taken as -fma(-r, y, -q0): RN
// is symmetric, so that is the same rounding for every other x, and it keeps the sign of a -0
// (fma(r, y, q0) = +0 + -0 would be +0). Zeros take the fast path because qWD's differences
// are full of them. A divisor is set up with a bound on the |x| it will divide (the group's
// absmax, or max - min), so that the upper limit is checked once per divisor and only the
// lower one per quotient. Every other x or s (subnormals, huge values, Inf, NaN, a negative or
// zero divisor, which no quantizer has) takes the plain IEEE division. The identity with `/` is checked by tests/cuda_emulated/divide.rs on every
// edge case and 570 million quotients in all.
struct sdp_divisor {
    float s;
    float inverse;
    bool fast;
};

// The divisor s for dividends |x| <= bound (NaN bound: any x).
__device__ __forceinline__ sdp_divisor sdp_divisor_of(float s, float bound)
{
    sdp_divisor d;
    d.s = s;
    d.inverse = __frcp_rn(s);
    d.fast = s >= 0x1p-40f && s < 0x1p40f && bound < 0x1p60f;
    return d;
}

// The divisor s for dividends without a known bound: sdp_divide_run<N, true> checks both limits
// of |x| per quotient.
__device__ __forceinline__ sdp_divisor sdp_divisor_unbounded(float s)
{
    sdp_divisor d;
    d.s = s;
    d.inverse = __frcp_rn(s);
    d.fast = s >= 0x1p-40f && s < 0x1p40f;
    return d;
}

// Whether x meets the fast path's per-quotient condition (a NaN does not): a zero or the lower
// limit of |x|, and the upper one too for a divisor without a bound (sdp_divisor_unbounded).
template <bool Unbounded>
__device__ __forceinline__ bool sdp_divide_fast(float x)
{
    return (fabsf(x) >= 0x1p-60f || x == 0.0f) && (!Unbounded || fabsf(x) < 0x1p60f);
}

// The fast path: RN(x / s) when d.fast and sdp_divide_fast(x).
__device__ __forceinline__ float sdp_divide_markstein(const sdp_divisor& d, float x)
{
    const float q0 = __fmul_rn(x, d.inverse);
    const float r = __fmaf_rn(-q0, d.s, x);
    return -__fmaf_rn(-r, d.inverse, -q0);
}

// The plain division of four values, out of line: the rarely taken path costs a call per four
// values in the loops, not a division sequence per value.
static __device__ SDP_NOINLINE float4 sdp_divide_plain4(float4 x, float s)
{
    return make_float4(__fdiv_rn(x.x, s), __fdiv_rn(x.y, s), __fdiv_rn(x.z, s), __fdiv_rn(x.w, s));
}

// q[i] = RN(x[i] / s) for the N values of x (N a multiple of 4): the fast path, redone with the
// plain division unless its conditions hold for all of them (one branch per run, no path to
// duplicate code into). `Unbounded` for a divisor of sdp_divisor_unbounded.
template <uint32_t N, bool Unbounded = false>
__device__ __forceinline__ void sdp_divide_run(const sdp_divisor& d, const float* x, float* q)
{
    static_assert(N % 4 == 0, "runs of 4 values");
    bool fast = d.fast;
#pragma unroll
    for (uint32_t i = 0; i < N; ++i) {
        fast = fast && sdp_divide_fast<Unbounded>(x[i]);
    }
#pragma unroll
    for (uint32_t i = 0; i < N; ++i) {
        q[i] = sdp_divide_markstein(d, x[i]);
    }
    if (!fast) {  // Cold path: a run outside the fast path's range.
#pragma unroll
        for (uint32_t i = 0; i < N; i += 4) {
            const float4 plain = sdp_divide_plain4(make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]), d.s);
            q[i] = plain.x;
            q[i + 1] = plain.y;
            q[i + 2] = plain.z;
            q[i + 3] = plain.w;
        }
    }
}
