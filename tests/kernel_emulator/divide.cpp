// The kernels' division helpers and their other exact arithmetic (kernels/divide.cuh,
// quantize.cuh, decode.cuh, common.cuh: the metadata of a group, the decoding of a nibble in
// place, the packed bf16 rounding) as plain C functions over arrays, built
// by tests/cuda_emulated/divide.rs into a shared library (with cuda_shim.h force-included, as
// the emulator builds the kernels) and compared there with Rust's `/`.
#include "decode.cuh"
#include "quantize.cuh"

#include <cstddef>
#include <cstdint>
#include <cstring>

extern "C" {

// q[i] = x[i] / s[i] through sdp_divide_run with the divisor sdp_divisor_of(s[i], bound[i]), on
// a run of four copies of x[i] (the caller keeps |x[i]| <= bound[i], or bound[i] NaN or Inf).
void sdp_test_divide(const float* x, const float* s, const float* bound, float* q, size_t n)
{
    for (size_t i = 0; i < n; ++i) {
        const float run[4] = {x[i], x[i], x[i], x[i]};
        float quotients[4];
        sdp_divide_run<4>(sdp_divisor_of(s[i], bound[i]), run, quotients);
        q[i] = quotients[0];
    }
}

// q[i] = x[i] / s for one divisor, through the run helper of 4 quotients (n a multiple of 4).
void sdp_test_divide_runs(const float* x, float s, float bound, float* q, size_t n)
{
    const sdp_divisor d = sdp_divisor_of(s, bound);
    for (size_t i = 0; i + 4 <= n; i += 4) {
        sdp_divide_run<4>(d, x + i, q + i);
    }
}

// q[i] = x[i] / s[4 j] for the run j = i / 4 of x (n a multiple of 4), through sdp_divide_run<4,
// true> with the divisor sdp_divisor_unbounded(s[4 j]): no bound on |x|.
void sdp_test_divide_unbounded(const float* x, const float* s, float* q, size_t n)
{
    for (size_t i = 0; i + 4 <= n; i += 4) {
        sdp_divide_run<4, true>(sdp_divisor_unbounded(s[i]), x + i, q + i);
    }
}

// words[i] = sdp_f32x2_to_bf16x2 of the fp32 bit patterns first + 2 i (low) and first + 2 i + 1
// (high), for i < n.
void sdp_test_bf16x2(uint32_t first, uint32_t* words, size_t n)
{
    for (size_t i = 0; i < n; ++i) {
        const uint32_t lo = first + 2 * (uint32_t)i;
        const uint32_t hi = lo + 1;
        float a;
        float b;
        std::memcpy(&a, &lo, 4);
        std::memcpy(&b, &hi, 4);
        words[i] = sdp_f32x2_to_bf16x2(a, b);
    }
}

// How many (k, bias, half-word) give another value through sdp_nibble_as_float than the nibble
// shifted down and converted, minus bias: every nibble position k < 8, bias 0 and 8, and every
// 16-bit value of the half holding nibble k (the other half a pattern of that value).
uint64_t sdp_test_nibble_mismatches()
{
    const float biases[2] = {0.0f, 8.0f};
    uint64_t mismatches = 0;
    for (uint32_t k = 0; k < 8; ++k) {
        for (const float bias : biases) {
            for (uint32_t v = 0; v < 0x10000u; ++v) {
                const uint32_t other = (v * 0x9e37u) & 0xffffu;
                const uint32_t word = k < 4 ? v | other << 16 : other | v << 16;
                const float want = (float)((word >> (4 * k)) & 0xfu) - bias;
                const float got = sdp_nibble_as_float(word, k, bias);
                if (std::memcmp(&want, &got, 4) != 0) {
                    ++mismatches;
                }
            }
        }
    }
    return mismatches;
}

// Whether two metadata are the same bit for bit (scale, offset, coded and the divisor).
static bool same_meta(const sdp_group_meta& a, const sdp_group_meta& b)
{
    const float fa[4] = {a.scale, a.offset, a.divisor.s, a.divisor.inverse};
    const float fb[4] = {b.scale, b.offset, b.divisor.s, b.divisor.inverse};
    return std::memcmp(fa, fb, sizeof fa) == 0 && a.coded == b.coded && a.divisor.fast == b.divisor.fast;
}

}  // extern "C"

// The symmetric quantizer of groups of 128 `bits`-bit codes (4 or 8) with stochastic rounding,
// as a spec.
template <uint32_t Bits>
using symmetric = sdp_quant_spec<Bits, 128, true, true>;

// How many of the absmax bit patterns first, first + stride, ... (below first + count) give Q
// other metadata through sdp_meta_of (its inline fast path where it applies) than through
// sdp_meta_general.
template <class Q>
static uint64_t meta_mismatches(uint32_t first, uint64_t count, uint32_t stride)
{
    uint64_t mismatches = 0;
    for (uint64_t i = 0; i < count; i += stride) {
        sdp_group_stats s = sdp_stats_empty();
        s.abs_bits = (uint32_t)(first + i);
        if (!same_meta(sdp_meta_of<Q>(s), sdp_meta_general<Q>(s))) {
            ++mismatches;
        }
    }
    return mismatches;
}

extern "C" {

// meta_mismatches of the symmetric quantizer of `bits`-bit codes (4 or 8).
uint64_t sdp_test_meta_mismatches(uint32_t bits, uint32_t first, uint64_t count, uint32_t stride)
{
    return bits == 4 ? meta_mismatches<symmetric<4>>(first, count, stride)
                     : meta_mismatches<symmetric<8>>(first, count, stride);
}

// scale[i]: the scale sdp_meta_of gives a symmetric group of `bits`-bit codes (4 or 8) with
// absmax bits abs_bits[i].
void sdp_test_meta_scales(uint32_t bits, const uint32_t* abs_bits, float* scale, size_t n)
{
    for (size_t i = 0; i < n; ++i) {
        sdp_group_stats s = sdp_stats_empty();
        s.abs_bits = abs_bits[i];
        scale[i] = bits == 4 ? sdp_meta_of<symmetric<4>>(s).scale : sdp_meta_of<symmetric<8>>(s).scale;
    }
}

// sdp_max_code_inverse of the symmetric quantizers of 4- and 8-bit codes, in that order.
void sdp_test_max_code_inverse(float* inverse)
{
    inverse[0] = sdp_max_code_inverse<symmetric<4>>();
    inverse[1] = sdp_max_code_inverse<symmetric<8>>();
}
}
