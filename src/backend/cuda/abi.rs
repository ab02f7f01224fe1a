//! `#[repr(C)]` mirrors of the parameter structs of `kernels/sdp4bit_abi.h`, and their
//! construction from the crate's plan and codec types.
//!
//! Field order, widths and padding match the header; the sizes are checked at compile time
//! (and the header's `sizeof` values were taken from a C compiler on the same header). Every
//! kernel takes its device pointers first, then one of these structs by value.

use std::mem::size_of;

use crate::codec::quant::QuantSpec;
use crate::codec::slab::SlabLayout;
use crate::codec::weight_encoding::WeightEncoding;
use crate::config::Rounding;
use crate::error::{Error, Result};
use crate::plan::{BucketPlan, GradLayout};
use crate::rng::UniformStream;

/// `struct sdp_quant`: the group quantizer `Q(b, g, mode, rounding)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpQuant {
    /// 4 or 8.
    pub bits: u32,
    /// A multiple of 32.
    pub group_size: u32,
    /// 1: absmax, 0: min-max.
    pub symmetric: u32,
    /// 1: `floor(v + u)`, 0: round half to even.
    pub stochastic: u32,
}

/// `struct sdp_slab`: one slab on the wire.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpSlab {
    /// The quantizer of every group.
    pub quant: SdpQuant,
    /// Groups in the slab.
    pub groups: u64,
    /// Bytes of the slab, padding included.
    pub byte_len: u64,
}

/// `struct sdp_rng`: a Philox4x32-10 stream.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SdpRng {
    /// Low word of the seed.
    pub key_lo: u32,
    /// High word of the seed.
    pub key_hi: u32,
    /// Counter word 2: the optimizer step.
    pub step: u32,
    /// Counter word 3: the stream id.
    pub stream: u32,
}

/// `struct sdp_shards`: shard geometry of one bucket.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpShards {
    /// S: real elements per shard.
    pub shard_len: u64,
    /// S_pad.
    pub padded_shard_len: u64,
    /// S_pad / P.
    pub chunk_len: u64,
    /// P.
    pub chunks: u32,
    /// 0.
    pub reserved: u32,
}

/// `struct sdp_grad_first`: parameters of `grad_quantize_first`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpGradFirst {
    /// The first-level slab layout.
    pub slab: SdpSlab,
    /// Shard geometry.
    pub shards: SdpShards,
    /// The first quantization's stream.
    pub rng: SdpRng,
    /// Peers of the first exchange.
    pub peers1: u32,
    /// Peers of the second exchange (1 when there is none).
    pub peers2: u32,
    /// Gc: groups per destination per chunk.
    pub groups_per_chunk: u32,
    /// Hadamard block, 0 when off.
    pub hadamard_block: u32,
}

/// `struct sdp_grad_second`: parameters of `grad_requantize_second`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpGradSecond {
    /// The first-level slab layout (what was received).
    pub in_slab: SdpSlab,
    /// The second-level slab layout (what is sent).
    pub out_slab: SdpSlab,
    /// Shard geometry.
    pub shards: SdpShards,
    /// The requantization's stream.
    pub rng: SdpRng,
    /// Peers of the first exchange.
    pub peers1: u32,
    /// Peers of the second exchange.
    pub peers2: u32,
    /// Gc.
    pub groups_per_chunk: u32,
    /// This rank's index in the first-level communicator.
    pub my_x1: u32,
    /// The pipeline chunk p.
    pub chunk: u32,
    /// 0.
    pub reserved: u32,
}

/// `struct sdp_grad_final`: parameters of `grad_reduce_final`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpGradFinal {
    /// The last level's slab layout.
    pub slab: SdpSlab,
    /// Shard geometry.
    pub shards: SdpShards,
    /// Peers of the last exchange.
    pub peers: u32,
    /// The pipeline chunk p.
    pub chunk: u32,
    /// Hadamard block, 0 when off.
    pub hadamard_block: u32,
    /// 0.
    pub reserved: u32,
}

/// `struct sdp_weight_encode`: parameters of `weight_encode`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpWeightEncode {
    /// The weight slab layout.
    pub slab: SdpSlab,
    /// The weight quantization's stream.
    pub rng: SdpRng,
    /// Real elements of the shard.
    pub shard_len: u64,
    /// Padded bucket index of the shard's first element.
    pub first_index: u64,
    /// 1: qWD difference, 0: direct.
    pub difference: u32,
    /// 0.
    pub reserved: u32,
}

/// `struct sdp_weight_apply`: parameters of `weight_apply`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpWeightApply {
    /// The weight slab layout.
    pub slab: SdpSlab,
    /// Real elements of one shard.
    pub shard_len: u64,
    /// W.
    pub world: u32,
    /// This rank.
    pub me: u32,
    /// 1: qWD difference, 0: direct.
    pub difference: u32,
    /// 0.
    pub reserved: u32,
}

/// `struct sdp_global`: parameters of the Global-QSGD kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SdpGlobal {
    /// The rounding stream (quantize only).
    pub rng: SdpRng,
    /// Elements.
    pub numel: u64,
    /// The global scale `s = a / K` (quantize, dequantize) when `absmax` is 0.
    pub scale: f32,
    /// K, the largest code magnitude (quantize; dequantize when `absmax` is set).
    pub k: i32,
    /// 1: stochastic rounding, 0: round half to even (quantize only).
    pub stochastic: u32,
    /// Dequantize: the rank blocks of `numel` integers summed in rank order (0 or 1: one).
    pub blocks: u32,
    /// 0, or the device address of the global absmax `a` (one f32): the kernels then scale by
    /// `a / K` read from device memory, with docs/numerics.md §7.2's special cases.
    pub absmax: u64,
    /// Dequantize: 0, or the device address of a u32 (zeroed by the caller) where the first
    /// integer overflow of the sum is recorded as `0xffffffff - (r * numel + i)`, the largest
    /// kept (see [`overflow_from_status`]).
    pub status: u64,
}

/// `struct sdp_convert`: parameters of the gradient conversions (`grad_widen_bf16`,
/// `grad_narrow_bf16`, `grad_round_bf16`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SdpConvert {
    /// Elements.
    pub numel: u64,
}

/// The first overflow `(block, element)` of a sum in rank order that the status word of a
/// dequantize launch summing blocks of `numel` integers holds, or `None` when it is 0.
pub fn overflow_from_status(status: u32, numel: usize) -> Option<(usize, usize)> {
    if status == 0 || numel == 0 {
        return None;
    }
    let key = (u32::MAX - status) as usize;
    Some((key / numel, key % numel))
}

// The sizes `sizeof` gives for the header's structs (x86-64 and aarch64 alike: fixed-width
// fields, natural alignment).
const _: () = assert!(size_of::<SdpQuant>() == 16);
const _: () = assert!(size_of::<SdpSlab>() == 32);
const _: () = assert!(size_of::<SdpRng>() == 16);
const _: () = assert!(size_of::<SdpShards>() == 32);
const _: () = assert!(size_of::<SdpGradFirst>() == 96);
const _: () = assert!(size_of::<SdpGradSecond>() == 136);
const _: () = assert!(size_of::<SdpGradFinal>() == 80);
const _: () = assert!(size_of::<SdpWeightEncode>() == 72);
const _: () = assert!(size_of::<SdpWeightApply>() == 56);
const _: () = assert!(size_of::<SdpGlobal>() == 56);
const _: () = assert!(size_of::<SdpConvert>() == 8);
// A few offsets `offsetof` gives, where padding could hide.
const _: () = assert!(std::mem::offset_of!(SdpGradFirst, rng) == 64);
const _: () = assert!(std::mem::offset_of!(SdpGradFirst, peers1) == 80);
const _: () = assert!(std::mem::offset_of!(SdpGradSecond, peers1) == 112);
const _: () = assert!(std::mem::offset_of!(SdpGradSecond, chunk) == 128);
const _: () = assert!(std::mem::offset_of!(SdpGradFinal, peers) == 64);
const _: () = assert!(std::mem::offset_of!(SdpWeightEncode, difference) == 64);
const _: () = assert!(std::mem::offset_of!(SdpWeightApply, world) == 40);
const _: () = assert!(std::mem::offset_of!(SdpGlobal, scale) == 24);
const _: () = assert!(std::mem::offset_of!(SdpGlobal, absmax) == 40);
const _: () = assert!(std::mem::offset_of!(SdpGlobal, status) == 48);

/// `value` as a `u32` field, or an error naming the field.
pub(crate) fn to_u32(what: &str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| {
        Error::Cuda(format!(
            "{what} = {value} does not fit the kernels' 32-bit parameter"
        ))
    })
}

/// `value` as a `u64` field (lossless on every supported target).
fn to_u64(value: usize) -> u64 {
    value as u64
}

/// Fails unless `index` is a multiple of 4: the kernels draw the four uniforms of a run of 4
/// elements from one Philox block, so every group's first Philox index must start a block
/// (shards, chunks and groups of the plans are multiples of 32).
fn philox_block_start(what: &str, index: u64) -> Result<()> {
    if index.is_multiple_of(4) {
        Ok(())
    } else {
        Err(Error::Buffer(format!(
            "{what} is {index}, not a multiple of 4 (the kernels draw uniforms by Philox block)"
        )))
    }
}

/// 1 for stochastic rounding, 0 for nearest.
fn stochastic(rounding: Rounding) -> u32 {
    u32::from(rounding == Rounding::Stochastic)
}

/// 1 for the qWD difference, 0 for direct weights.
fn difference(encoding: WeightEncoding) -> u32 {
    u32::from(encoding == WeightEncoding::Difference)
}

impl SdpQuant {
    /// The quantizer `spec`.
    pub fn new(spec: &QuantSpec) -> Result<Self> {
        Ok(Self {
            bits: u32::from(spec.bits),
            group_size: to_u32("group size", spec.group_size)?,
            symmetric: u32::from(spec.symmetric),
            stochastic: stochastic(spec.rounding),
        })
    }
}

impl SdpSlab {
    /// The slab `layout`.
    pub fn new(layout: &SlabLayout) -> Result<Self> {
        Ok(Self {
            quant: SdpQuant::new(&layout.spec)?,
            groups: to_u64(layout.groups),
            byte_len: to_u64(layout.byte_len()),
        })
    }
}

impl SdpRng {
    /// The stream `rng`.
    pub fn new(rng: &UniformStream) -> Self {
        let ([key_lo, key_hi], step, stream) = rng.philox_params();
        Self {
            key_lo,
            key_hi,
            step,
            stream,
        }
    }
}

impl SdpShards {
    /// The shard geometry of `plan`.
    pub fn new(plan: &BucketPlan) -> Result<Self> {
        philox_block_start("padded shard length", to_u64(plan.padded_shard_len))?;
        philox_block_start("pipeline chunk length", to_u64(plan.chunk_len()))?;
        Ok(Self {
            shard_len: to_u64(plan.shard_len),
            padded_shard_len: to_u64(plan.padded_shard_len),
            chunk_len: to_u64(plan.chunk_len()),
            chunks: to_u32("pipeline chunks", plan.chunks)?,
            reserved: 0,
        })
    }
}

impl SdpGradFirst {
    /// The first gradient pass of `layout` with stream `rng`.
    pub fn new(layout: &GradLayout, rng: &UniformStream) -> Result<Self> {
        Ok(Self {
            slab: SdpSlab::new(&layout.first.slab)?,
            shards: SdpShards::new(&layout.bucket)?,
            rng: SdpRng::new(rng),
            peers1: to_u32("first-level peers", layout.first.peers)?,
            peers2: to_u32("second-level peers", layout.second_peers())?,
            groups_per_chunk: to_u32("groups per chunk", layout.groups_per_chunk())?,
            hadamard_block: to_u32("Hadamard block", layout.hadamard.unwrap_or(0))?,
        })
    }
}

impl SdpGradSecond {
    /// The requantization of chunk `chunk` by the rank at first-level index `my_x1`; an error
    /// when `layout` has no second level.
    pub fn new(
        layout: &GradLayout,
        my_x1: usize,
        chunk: usize,
        rng: &UniformStream,
    ) -> Result<Self> {
        let second = layout.second.ok_or_else(|| {
            Error::Cuda("grad_requantize_second needs a layout with a second level".into())
        })?;
        Ok(Self {
            in_slab: SdpSlab::new(&layout.first.slab)?,
            out_slab: SdpSlab::new(&second.slab)?,
            shards: SdpShards::new(&layout.bucket)?,
            rng: SdpRng::new(rng),
            peers1: to_u32("first-level peers", layout.first.peers)?,
            peers2: to_u32("second-level peers", second.peers)?,
            groups_per_chunk: to_u32("groups per chunk", layout.groups_per_chunk())?,
            my_x1: to_u32("first-level index", my_x1)?,
            chunk: to_u32("pipeline chunk", chunk)?,
            reserved: 0,
        })
    }
}

impl SdpGradFinal {
    /// The final reduction of chunk `chunk` of `layout`.
    pub fn new(layout: &GradLayout, chunk: usize) -> Result<Self> {
        let last = layout.last();
        Ok(Self {
            slab: SdpSlab::new(&last.slab)?,
            shards: SdpShards::new(&layout.bucket)?,
            peers: to_u32("last-level peers", last.peers)?,
            chunk: to_u32("pipeline chunk", chunk)?,
            hadamard_block: to_u32("Hadamard block", layout.hadamard.unwrap_or(0))?,
            reserved: 0,
        })
    }
}

impl SdpWeightEncode {
    /// The encoding of a shard of `shard_len` real elements whose first element has the
    /// padded bucket index `first_index`.
    pub fn new(
        layout: &SlabLayout,
        encoding: WeightEncoding,
        shard_len: usize,
        first_index: u64,
        rng: &UniformStream,
    ) -> Result<Self> {
        philox_block_start("first Philox index of the weight shard", first_index)?;
        Ok(Self {
            slab: SdpSlab::new(layout)?,
            rng: SdpRng::new(rng),
            shard_len: to_u64(shard_len),
            first_index,
            difference: difference(encoding),
            reserved: 0,
        })
    }
}

impl SdpWeightApply {
    /// The application of all `plan.world` slabs by rank `me`.
    pub fn new(
        layout: &SlabLayout,
        encoding: WeightEncoding,
        plan: &BucketPlan,
        me: usize,
    ) -> Result<Self> {
        Ok(Self {
            slab: SdpSlab::new(layout)?,
            shard_len: to_u64(plan.shard_len),
            world: to_u32("world size", plan.world)?,
            me: to_u32("rank", me)?,
            difference: difference(encoding),
            reserved: 0,
        })
    }
}

impl SdpGlobal {
    /// `global_absmax` over `numel` elements.
    pub fn absmax(numel: usize) -> Self {
        Self::dequantize(numel, 0.0)
    }

    /// `global_quantize_*`: `clamp(R(x / scale), -k, k)` with stream `rng`.
    pub fn quantize(
        numel: usize,
        scale: f32,
        k: i32,
        rounding: Rounding,
        rng: &UniformStream,
    ) -> Self {
        Self {
            rng: SdpRng::new(rng),
            numel: to_u64(numel),
            scale,
            k,
            stochastic: stochastic(rounding),
            blocks: 0,
            absmax: 0,
            status: 0,
        }
    }

    /// `global_dequantize_*`: `f32(sum) * scale`.
    pub fn dequantize(numel: usize, scale: f32) -> Self {
        Self {
            rng: SdpRng::default(),
            numel: to_u64(numel),
            scale,
            k: 0,
            stochastic: 0,
            blocks: 0,
            absmax: 0,
            status: 0,
        }
    }

    /// `global_dequantize_*` summing `blocks` rank blocks of `numel` integers in rank order
    /// before scaling, recording the first overflow at device address `status`.
    pub fn sum_and_dequantize(numel: usize, blocks: u32, status: u64) -> Self {
        Self {
            blocks,
            status,
            ..Self::dequantize(numel, 0.0)
        }
    }

    /// These parameters scaling by `a / k` for the global absmax `a` at device address
    /// `absmax` instead of by `scale`.
    pub fn scaled_by_absmax_at(self, absmax: u64, k: i32) -> Self {
        Self {
            scale: 0.0,
            k,
            absmax,
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Preset};
    use crate::plan::{GradRoute, Topology};

    /// The parameters of a two-level layout carry the plan's numbers.
    #[test]
    fn grad_params_follow_the_layout() {
        let config = Config::preset(Preset::Sdp4bit);
        let topology = Topology::uniform(2, 2).unwrap();
        let route = GradRoute::new(&config, &topology);
        let plan = BucketPlan::new(4 * 1000, 4, &config).unwrap();
        let layout = GradLayout::new(&config, &topology, &route, plan).unwrap();
        let rng = UniformStream::new(0x1_0000_0002, 7, 9);
        let first = SdpGradFirst::new(&layout, &rng).unwrap();
        assert_eq!(
            first.rng,
            SdpRng {
                key_lo: 2,
                key_hi: 1,
                step: 7,
                stream: 9
            }
        );
        assert_eq!(
            (first.peers1, first.peers2, first.hadamard_block),
            (2, 2, 32)
        );
        assert_eq!(
            first.slab.quant,
            SdpQuant {
                bits: 8,
                group_size: 128,
                symmetric: 1,
                stochastic: 1
            }
        );
        assert_eq!(first.shards.padded_shard_len, plan.padded_shard_len as u64);
        assert_eq!(first.groups_per_chunk as usize * 128, plan.chunk_len());
        let second = SdpGradSecond::new(&layout, 1, 0, &rng).unwrap();
        assert_eq!(second.out_slab.quant.bits, 4);
        assert_eq!(
            second.out_slab.byte_len,
            layout.second.unwrap().slab.byte_len() as u64
        );
        let last = SdpGradFinal::new(&layout, 0).unwrap();
        assert_eq!(last.slab, second.out_slab);
        assert_eq!(last.peers, 2);
    }

    /// A one-level layout has no requantization.
    #[test]
    fn second_pass_needs_two_levels() {
        let config = Config::preset(Preset::Qsdp);
        let topology = Topology::uniform(2, 2).unwrap();
        let route = GradRoute::new(&config, &topology);
        let plan = BucketPlan::new(4 * 1024, 4, &config).unwrap();
        let layout = GradLayout::new(&config, &topology, &route, plan).unwrap();
        let rng = UniformStream::new(1, 2, 3);
        assert!(matches!(
            SdpGradSecond::new(&layout, 0, 0, &rng),
            Err(Error::Cuda(_))
        ));
    }
}
