// Slab addressing (codec::slab::SlabLayout): [codes of G groups][G scales][G offsets if
// asymmetric][zero padding to 16 bytes], for a slab whose quantizer Q is a spec (spec.cuh) and
// whose group count and byte length are the run-time `sdp_slab`'s.
#pragma once

#include "spec.cuh"

// Slab `s` of a buffer of equal slabs.
__device__ __forceinline__ uint8_t* sdp_slab_at(uint8_t* buffer, const sdp_slab& layout, uint64_t s)
{
    return buffer + s * layout.byte_len;
}

__device__ __forceinline__ const uint8_t* sdp_slab_at(const uint8_t* buffer, const sdp_slab& layout,
                                                     uint64_t s)
{
    return buffer + s * layout.byte_len;
}

// Byte offsets inside a slab: the codes of group k, its scale, its offset (asymmetric only),
// and the end of the metadata (where the zero padding starts).
template <class Q>
__device__ __forceinline__ uint64_t sdp_codes_offset(uint64_t k)
{
    return k * Q::code_bytes;
}

template <class Q>
__device__ __forceinline__ uint64_t sdp_scale_offset(const sdp_slab& layout, uint64_t k)
{
    return layout.groups * Q::code_bytes + 4 * k;
}

template <class Q>
__device__ __forceinline__ uint64_t sdp_offset_offset(const sdp_slab& layout, uint64_t k)
{
    return sdp_scale_offset<Q>(layout, layout.groups) + 4 * k;
}

template <class Q>
__device__ __forceinline__ uint64_t sdp_meta_end(const sdp_slab& layout)
{
    return sdp_scale_offset<Q>(layout, 0) + 4 * (Q::symmetric ? 1 : 2) * layout.groups;
}

// Zeroes the padding of the `slabs` slabs of `buffer` being written (fewer than 16 bytes each),
// a slab per warp of the grid: a kernel calls it after its loop over groups (the bytes are
// disjoint from the groups'), so that the loop does not test for each slab's first group. All
// 32 lanes must call it together.
template <class Q>
__device__ __forceinline__ void sdp_zero_slabs_padding(uint8_t* buffer, const sdp_slab& layout, uint64_t slabs,
                                                       uint32_t lane)
{
    const uint64_t start = sdp_meta_end<Q>(layout);
    for (uint64_t s = sdp_warp_id(); s < slabs; s += sdp_warp_count()) {
        if (start + lane < layout.byte_len) {
            sdp_slab_at(buffer, layout, s)[start + lane] = 0;
        }
    }
}
