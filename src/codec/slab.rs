//! The slab layout on the wire (docs/numerics.md §6): what one rank sends one peer is a single
//! contiguous byte range `[codes of its G groups][G scales][G offsets, asymmetric only]`,
//! zero-padded to a multiple of 16 bytes. Scales and offsets are little-endian fp32.
//!
//! Group sizes are multiples of 32, so the codes region is itself a multiple of 16 bytes and
//! the metadata starts 16-byte aligned relative to the slab.

use rayon::iter::Either;
use rayon::prelude::*;

use crate::codec::quant::{GroupMeta, QuantSpec, quantize_group};
use crate::error::{Error, Result};

/// Alignment of every slab, in bytes.
pub const SLAB_ALIGN: usize = 16;

/// The layout of one slab: `groups` groups quantized with `spec`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlabLayout {
    /// The quantizer of every group in the slab.
    pub spec: QuantSpec,
    /// Number of groups.
    pub groups: usize,
}

/// Read access to a received slab whose length has been checked.
#[derive(Debug, Clone, Copy)]
pub struct SlabView<'a> {
    layout: SlabLayout,
    codes: &'a [u8],
    scales: &'a [u8],
    offsets: &'a [u8],
}

/// Write access to one group of a slab being filled.
#[derive(Debug)]
pub struct GroupSlot<'a> {
    /// The group's codes.
    pub codes: &'a mut [u8],
    scale: &'a mut [u8],
    offset: Option<&'a mut [u8]>,
}

impl SlabLayout {
    /// Bytes of codes in the slab.
    pub fn codes_len(&self) -> usize {
        self.groups * self.spec.code_bytes_per_group()
    }

    /// Total bytes, padding included.
    pub fn byte_len(&self) -> usize {
        let raw = self.codes_len() + 4 * self.groups * self.spec.meta_words();
        raw.div_ceil(SLAB_ALIGN) * SLAB_ALIGN
    }

    /// Elements the slab encodes.
    pub fn elements(&self) -> usize {
        self.groups * self.spec.group_size
    }

    /// Checks that a receive buffer holds exactly `count` slabs of this layout.
    pub fn check_slabs(&self, buffer_len: usize, count: usize) -> Result<()> {
        if buffer_len == count * self.byte_len() {
            Ok(())
        } else {
            Err(Error::Decode(format!(
                "receive buffer of {buffer_len} bytes does not hold {count} slabs of {} bytes",
                self.byte_len()
            )))
        }
    }

    /// Checks that `slab` is exactly one slab of this layout and returns a view of it.
    pub fn view<'a>(&self, slab: &'a [u8]) -> Result<SlabView<'a>> {
        if slab.len() != self.byte_len() {
            return Err(Error::Decode(format!(
                "slab of {} bytes does not match the {}-byte layout of {} groups of {} {}-bit {} codes",
                slab.len(),
                self.byte_len(),
                self.groups,
                self.spec.group_size,
                self.spec.bits,
                if self.spec.symmetric {
                    "symmetric"
                } else {
                    "asymmetric"
                },
            )));
        }
        let (codes, meta) = slab.split_at(self.codes_len());
        let (scales, rest) = meta.split_at(4 * self.groups);
        let offsets = if self.spec.symmetric {
            &rest[..0]
        } else {
            &rest[..4 * self.groups]
        };
        Ok(SlabView {
            layout: *self,
            codes,
            scales,
            offsets,
        })
    }

    /// Splits a slab buffer (exactly [`byte_len`](Self::byte_len) bytes) into per-group slots
    /// that can be filled in parallel; the padding is zeroed.
    pub fn par_slots_mut<'a>(
        &self,
        slab: &'a mut [u8],
    ) -> impl IndexedParallelIterator<Item = GroupSlot<'a>> + 'a {
        assert_eq!(slab.len(), self.byte_len(), "slab buffer sized by the plan");
        let code_bytes = self.spec.code_bytes_per_group();
        let (codes, meta) = slab.split_at_mut(self.codes_len());
        let (scales, rest) = meta.split_at_mut(4 * self.groups);
        let slots = codes
            .par_chunks_mut(code_bytes)
            .zip(scales.par_chunks_mut(4));
        if self.spec.symmetric {
            rest.fill(0);
            Either::Left(slots.map(|(codes, scale)| GroupSlot {
                codes,
                scale,
                offset: None,
            }))
        } else {
            let (offsets, pad) = rest.split_at_mut(4 * self.groups);
            pad.fill(0);
            Either::Right(
                slots
                    .zip(offsets.par_chunks_mut(4))
                    .map(|((codes, scale), offset)| GroupSlot {
                        codes,
                        scale,
                        offset: Some(offset),
                    }),
            )
        }
    }
}

/// Write access to a run of consecutive groups of a slab being filled (see
/// [`SlabLayout::par_runs_mut`]): one parallel task's worth of groups.
#[derive(Debug)]
pub struct GroupRun<'a> {
    /// Index in the slab of the run's first group.
    pub first: usize,
    code_bytes: usize,
    codes: &'a mut [u8],
    scales: &'a mut [u8],
    offsets: Option<&'a mut [u8]>,
}

impl GroupRun<'_> {
    /// Groups in the run.
    pub fn len(&self) -> usize {
        self.scales.len() / 4
    }

    /// Whether the run holds no group.
    pub fn is_empty(&self) -> bool {
        self.scales.is_empty()
    }

    /// Quantizes the group `x` (uniforms `u`) with `spec` into the run's group `i` (slab group
    /// `first + i`).
    #[inline]
    pub fn quantize(&mut self, i: usize, spec: &QuantSpec, x: &[f32], u: &[f32]) {
        let codes = &mut self.codes[i * self.code_bytes..(i + 1) * self.code_bytes];
        let meta = quantize_group(spec, x, u, codes);
        self.scales[4 * i..4 * i + 4].copy_from_slice(&meta.scale.to_le_bytes());
        if let Some(offsets) = self.offsets.as_deref_mut() {
            offsets[4 * i..4 * i + 4].copy_from_slice(&meta.offset.to_le_bytes());
        }
    }
}

impl SlabLayout {
    /// Splits a slab buffer (exactly [`byte_len`](Self::byte_len) bytes) into runs of `run`
    /// consecutive groups (the last may be shorter) that can be filled in parallel; the
    /// padding is zeroed. Coarser than [`par_slots_mut`](Self::par_slots_mut), so per-task
    /// costs are paid once per run instead of once per group.
    pub fn par_runs_mut<'a>(
        &self,
        slab: &'a mut [u8],
        run: usize,
    ) -> impl IndexedParallelIterator<Item = GroupRun<'a>> + 'a {
        assert_eq!(slab.len(), self.byte_len(), "slab buffer sized by the plan");
        assert!(run > 0, "a run holds at least one group");
        let code_bytes = self.spec.code_bytes_per_group();
        let (codes, meta) = slab.split_at_mut(self.codes_len());
        let (scales, rest) = meta.split_at_mut(4 * self.groups);
        let runs = codes
            .par_chunks_mut(run * code_bytes)
            .zip(scales.par_chunks_mut(4 * run))
            .enumerate();
        let make = move |(r, (codes, scales)), offsets| GroupRun {
            first: r * run,
            code_bytes,
            codes,
            scales,
            offsets,
        };
        if self.spec.symmetric {
            rest.fill(0);
            Either::Left(runs.map(move |item| make(item, None)))
        } else {
            let (offsets, pad) = rest.split_at_mut(4 * self.groups);
            pad.fill(0);
            Either::Right(
                runs.zip(offsets.par_chunks_mut(4 * run))
                    .map(move |(item, offsets)| make(item, Some(offsets))),
            )
        }
    }
}

impl GroupSlot<'_> {
    /// Quantizes the group `x` (uniforms `u`) with `spec` into this slot.
    #[inline]
    pub fn quantize(&mut self, spec: &QuantSpec, x: &[f32], u: &[f32]) {
        let meta = quantize_group(spec, x, u, self.codes);
        self.set_meta(meta);
    }

    /// Stores the group's scale (and offset when asymmetric).
    #[inline]
    pub fn set_meta(&mut self, meta: GroupMeta) {
        self.scale.copy_from_slice(&meta.scale.to_le_bytes());
        if let Some(offset) = self.offset.as_deref_mut() {
            offset.copy_from_slice(&meta.offset.to_le_bytes());
        }
    }
}

impl<'a> SlabView<'a> {
    /// The layout this view was checked against.
    pub fn layout(&self) -> SlabLayout {
        self.layout
    }

    /// Codes of group `k`.
    #[inline]
    pub fn codes(&self, k: usize) -> &'a [u8] {
        let n = self.layout.spec.code_bytes_per_group();
        &self.codes[k * n..(k + 1) * n]
    }

    /// Scale and offset of group `k`, rejecting values the quantizer never writes (a negative
    /// or infinite scale, an infinite offset) as corruption.
    #[inline]
    pub fn meta(&self, k: usize) -> Result<GroupMeta> {
        let scale = read_f32(self.scales, k);
        let offset = if self.layout.spec.symmetric {
            0.0
        } else {
            read_f32(self.offsets, k)
        };
        if scale < 0.0 || scale.is_infinite() || offset.is_infinite() {
            return Err(Error::Decode(format!(
                "group {k} has scale {scale} and offset {offset}, which no encoder produces"
            )));
        }
        Ok(GroupMeta { scale, offset })
    }

    /// Dequantizes group `k` into `out` with `combine` (see [`crate::codec::quant::dequantize_group`]),
    /// failing on corrupt metadata or codes.
    #[inline]
    pub fn decode_group(
        &self,
        k: usize,
        out: &mut [f32],
        combine: impl Fn(f32, f32) -> f32,
    ) -> Result<()> {
        let meta = self.meta(k)?;
        let spec = &self.layout.spec;
        if crate::codec::quant::dequantize_group(spec, self.codes(k), meta, out, combine) {
            Ok(())
        } else {
            Err(Error::Decode(format!(
                "group {k} holds the code {}, outside the symmetric {}-bit range",
                -spec.max_code() - 1,
                spec.bits
            )))
        }
    }
}

#[inline(always)]
fn read_f32(bytes: &[u8], k: usize) -> f32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[4 * k..4 * k + 4]);
    f32::from_le_bytes(word)
}
