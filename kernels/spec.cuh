// The compile-time configuration a kernel body is instantiated with, and the shape of a group in
// a warp's registers that follows from it.
//
// src/backend/cuda/spec.rs derives a spec from a launch's parameter struct (so the constants are
// always the struct's values) and writes the wrapper that instantiates the body with it; the
// type names and the order of their arguments below are what it writes. A spec holds what
// decides the code's shape: the quantizer's bits, group size, symmetry and rounding, the Hadamard
// block, the peer batch of a decoder and the groups (or runs) one warp (or thread) takes per step
// of its grid-stride loop. Values that only move addresses (shard lengths, chunk indices, the
// peers of the first pass's unit walk) stay run-time fields of the struct.
#pragma once

#include "common.cuh"

// The group quantizer Q(b, g, mode, rounding) (sdp_quant, codec::quant::QuantSpec).
template <uint32_t Bits, uint32_t GroupSize, bool Symmetric, bool Stochastic>
struct sdp_quant_spec {
    static_assert(Bits == 4 || Bits == 8, "codes of 4 or 8 bits");
    static_assert(GroupSize >= 32 && GroupSize <= 65536 && GroupSize % 32 == 0, "groups of 32 k elements");
    static constexpr uint32_t bits = Bits;
    static constexpr uint32_t group_size = GroupSize;
    static constexpr bool symmetric = Symmetric;
    // floor(v + u) when true, round half to even otherwise.
    static constexpr bool stochastic = Stochastic;
    // The largest code L: 2^(b-1) - 1 symmetric, 2^b - 1 asymmetric (QuantSpec::max_code).
    static constexpr int32_t max_code = Symmetric ? (1 << (Bits - 1)) - 1 : (1 << Bits) - 1;
    // Bytes of one group's codes.
    static constexpr uint32_t code_bytes = GroupSize * Bits / 8;
};

// grad_quantize_first: the first level's quantizer, the Hadamard block (0: off) and the groups
// of one chunk and destination a warp takes per unit.
template <class Quant, uint32_t HadamardBlock, uint32_t Groups>
struct sdp_first_spec {
    using quant = Quant;
    static constexpr uint32_t hadamard_block = HadamardBlock;
    static constexpr uint32_t groups = Groups;
};

// grad_requantize_second: the received first-level quantizer, the second level's, the peers
// decoded at once (a power of two; more peers are summed batch after batch) and the output
// groups a warp takes per unit.
template <class In, class Out, uint32_t PeerBatch, uint32_t Groups>
struct sdp_second_spec {
    using in = In;
    using out = Out;
    static constexpr uint32_t peer_batch = PeerBatch;
    static constexpr uint32_t groups = Groups;
};

// grad_reduce_final: the last level's quantizer, the Hadamard block (0: off), the peer batch
// and the groups a warp takes per unit.
template <class Quant, uint32_t HadamardBlock, uint32_t PeerBatch, uint32_t Groups>
struct sdp_final_spec {
    using quant = Quant;
    static constexpr uint32_t hadamard_block = HadamardBlock;
    static constexpr uint32_t peer_batch = PeerBatch;
    static constexpr uint32_t groups = Groups;
};

// weight_encode and weight_apply: the weight quantizer, the qWD difference (or direct weights)
// and the groups a warp takes per unit.
template <class Quant, bool Difference, uint32_t Groups>
struct sdp_weight_spec {
    using quant = Quant;
    static constexpr bool difference = Difference;
    static constexpr uint32_t groups = Groups;
};

// The element-wise kernels (Global-QSGD, the bf16 conversions): stochastic rounding (the
// quantize kernels only) and the runs of 4 elements a thread takes per step.
template <bool Stochastic, uint32_t Runs>
struct sdp_elementwise_spec {
    static constexpr bool stochastic = Stochastic;
    static constexpr uint32_t runs = Runs;
};

// Values one lane holds of a group it has in registers at once: a group longer than this per
// lane is walked in tiles of SDP_LANE_TILE_VALUES values per lane (common.cuh).
#define SDP_LANE_VALUES_MAX 64u
#define SDP_LANE_TILE_VALUES 32u

// The rows of a group of `Group` elements whose lanes hold runs of E elements: 32 E elements
// each, the last one partial when Group is not a multiple of 32 E; and the tiles a warp walks
// it in: all rows at once when they fit SDP_LANE_VALUES_MAX, else tiles of `tile_rows` rows
// (1024 elements, so a tile never cuts a Hadamard block).
template <uint32_t E, uint32_t Group>
struct sdp_rows {
    static_assert(E == 4 || E == 8, "runs of 4 or 8 elements");
    static constexpr uint32_t count = (Group + 32 * E - 1) / (32 * E);
    // Lanes whose run of the last row lies in the group.
    static constexpr uint32_t last_lanes = (Group - 32 * E * (count - 1)) / E;
    static constexpr uint32_t tile_rows = count * E <= SDP_LANE_VALUES_MAX ? count : SDP_LANE_TILE_VALUES / E;
    static constexpr uint32_t tiles = (count + tile_rows - 1) / tile_rows;
    // Values a lane holds of one tile.
    static constexpr uint32_t tile_values = tile_rows * E;

    // Whether this lane's run of row r lies in the group: every run of a row before the last,
    // the first `last_lanes` runs of the last, none past it (a compile-time answer for a
    // constant r but in a partial last row).
    __device__ static __forceinline__ bool in_group(uint32_t r, uint32_t lane)
    {
        return r + 1 < count || (r + 1 == count && (last_lanes == 32 || lane < last_lanes));
    }

    // Index in the group of value i of this lane's runs of the tile whose first row is r0.
    __device__ static __forceinline__ uint32_t element(uint32_t r0, uint32_t i, uint32_t lane)
    {
        return (r0 + i / E) * 32 * E + lane * E + i % E;
    }
};
