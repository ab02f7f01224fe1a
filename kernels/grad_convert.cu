// grad_widen_bf16, grad_narrow_bf16, grad_round_bf16: element-wise conversions of gradients
// between bf16 and fp32 (docs/numerics.md §7.5), for the routes that move a bf16 bucket
// without quantizing it (a single rank's copy, the fp32 reduce-scatter of the uncompressed
// route).
//
// Mirrors backend::cpu::Host::convert: dst[i] = D(f32(src[i])), where f32 of a bf16 is exact
// (a NaN comes out quiet) and D rounds to nearest even (sdp_f32_to_bf16).
//
// Spec: sdp_elementwise_spec<(unused), runs per thread> (spec.cuh).
// Work unit: a run of 4 consecutive elements; a thread takes Runs runs per step of its
// grid-stride loop (runs b + k T, T the threads of the grid), all their loads before any
// store; a whole run of aligned buffers is moved with one vector load and one vector store,
// the rest element by element.
#include "spec.cuh"

template <class Spec, class S, class D>
__device__ __forceinline__ void grad_convert_of(const S* __restrict__ src, D* __restrict__ dst,
                                                const sdp_convert& args)
{
    const bool vector = sdp_grad_run_aligned(src) && sdp_grad_run_aligned(dst);
    const uint64_t whole = vector ? args.numel / 4 : 0;
    const uint64_t threads = sdp_thread_count();
    for (uint64_t b = sdp_thread_id(); b < whole; b += Spec::runs * threads) {
        float x[Spec::runs][4];
#pragma unroll
        for (uint32_t k = 0; k < Spec::runs; ++k) {
            if (b + k * threads < whole) {
                sdp_grad_load4(src + 4 * (b + k * threads), x[k]);
            }
        }
#pragma unroll
        for (uint32_t k = 0; k < Spec::runs; ++k) {
            if (b + k * threads < whole) {
                sdp_grad_store4(dst + 4 * (b + k * threads), x[k]);
            }
        }
    }
    // Cold path: a partial last run, or buffers not aligned for vector accesses.
    for (uint64_t i = 4 * whole + sdp_thread_id(); i < args.numel; i += threads) {
        sdp_grad_store1(dst + i, sdp_grad_to_f32(src[i]));
    }
}
