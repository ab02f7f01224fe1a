// grad_widen_bf16, grad_narrow_bf16, grad_round_bf16: element-wise conversions of gradients
// between bf16 and fp32 (docs/numerics.md §7.5), for the routes that move a bf16 bucket
// without quantizing it (a single rank's copy, the fp32 reduce-scatter of the uncompressed
// route).
//
// Mirrors backend::cpu::Host::convert: dst[i] = D(f32(src[i])), where f32 of a bf16 is exact
// (a NaN comes out quiet) and D rounds to nearest even (sdp_f32_to_bf16).
//
// Launch: blockDim = (256, 1, 1), any gridDim.x >= 1, no dynamic shared memory.
// Work unit: one run of 4 consecutive elements per thread, grid-stride over ceil(numel / 4)
// runs; a whole run of aligned buffers is moved with one vector load and one vector store,
// the rest element by element.
#include "common.cuh"

template <class S, class D>
__device__ __forceinline__ void grad_convert(const S* __restrict__ src, D* __restrict__ dst,
                                             const sdp_convert& args)
{
    const bool vector = sdp_grad_run_aligned(src) && sdp_grad_run_aligned(dst);
    const uint64_t runs = (args.numel + 3) / 4;
    for (uint64_t b = sdp_thread_id(); b < runs; b += sdp_thread_count()) {
        const uint64_t i = 4 * b;
        if (vector && i + 4 <= args.numel) {
            float x[4];
            sdp_grad_load4(src + i, x);
            sdp_grad_store4(dst + i, x);
            continue;
        }
        // Cold path: a partial last run, or buffers not aligned for vector accesses.
#pragma unroll
        for (uint32_t e = 0; e < 4; ++e) {
            if (i + e < args.numel) {
                sdp_grad_store1(dst + i + e, sdp_grad_to_f32(src[i + e]));
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
grad_widen_bf16(const sdp_bf16* __restrict__ src, float* __restrict__ dst, sdp_convert args)
{
    grad_convert(src, dst, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
grad_narrow_bf16(const float* __restrict__ src, sdp_bf16* __restrict__ dst, sdp_convert args)
{
    grad_convert(src, dst, args);
}

extern "C" __global__ void __launch_bounds__(SDP_BLOCK_THREADS, 8)
grad_round_bf16(const sdp_bf16* __restrict__ src, sdp_bf16* __restrict__ dst, sdp_convert args)
{
    grad_convert(src, dst, args);
}
