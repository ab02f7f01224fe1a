//! [`Host`]: the [`Backend`] of host memory, running the passes of this module with rayon.

use std::ops::Range;

use half::bf16;

use super::buffers::HostBuffer;
use super::{global_qsgd, gradient, pool, weight};
use crate::backend::device::{Backend, Element, GlobalScale, global_scale};
use crate::backend::grad_element::GradElement;
use crate::codec::int_code::IntCode;
use crate::codec::slab::SlabLayout;
use crate::codec::sum::SumElement;
use crate::codec::weight_encoding::WeightEncoding;
use crate::config::Rounding;
use crate::error::{Error, Result, check_len};
use crate::layout::{BucketPlan, GradLayout};
use crate::rng::UniformStream;

/// Host memory: buffers are vectors ([`HostBuffer`]; a call's come from the process-wide pool
/// of [`super::buffers`]), views are slices, passes run synchronously with rayon on the pool
/// of [`pool::pass_threads`] threads.
#[derive(Debug, Clone, Copy, Default)]
pub struct Host;

impl Backend for Host {
    type Src<'a, T: Element> = &'a [T];
    type Dst<'a, T: Element> = &'a mut [T];
    type Buffer<T: Element> = HostBuffer<T>;
    /// The host passes compute destinations from the layout itself.
    type GradTables = ();

    /// A zeroed vector of its own.
    fn alloc<T: Element>(&self, len: usize) -> Result<HostBuffer<T>> {
        Ok(HostBuffer::owned(len))
    }

    /// A vector from the pool of [`super::buffers`] (the bytes of its last use, or zeros):
    /// the host passes and exchanges of a call have completed when the call returns, and it
    /// goes back to the pool when the call drops it then.
    fn call_buffer<T: Element>(&self, len: usize) -> Result<HostBuffer<T>> {
        Ok(HostBuffer::pooled(len))
    }

    fn src<T: Element>(buffer: &HostBuffer<T>) -> &[T] {
        buffer
    }

    fn dst<T: Element>(buffer: &mut HostBuffer<T>) -> &mut [T] {
        buffer
    }

    fn sub<'a, T>(src: &'a [T], range: Range<usize>) -> &'a [T]
    where
        T: Element + 'a,
    {
        &src[range]
    }

    fn read<'b, T: Element>(dst: &'b &mut [T]) -> &'b [T] {
        dst
    }

    fn reborrow<'b, T: Element>(dst: &'b mut &mut [T]) -> &'b mut [T] {
        dst
    }

    fn len<T: Element>(src: &[T]) -> usize {
        src.len()
    }

    fn as_bytes<'a, T>(src: &'a [T]) -> &'a [u8]
    where
        T: Element + 'a,
    {
        bytemuck::cast_slice(src)
    }

    fn as_bytes_mut<'a, T>(dst: &'a mut [T]) -> &'a mut [u8]
    where
        T: Element + 'a,
    {
        bytemuck::cast_slice_mut(dst)
    }

    fn copy<T: Element>(&self, src: &[T], dst: &mut [T]) -> Result<()> {
        check_len("copy destination", dst.len(), src.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn convert<S: GradElement, D: GradElement>(&self, src: &[S], dst: &mut [D]) -> Result<()> {
        check_len("conversion destination", dst.len(), src.len())?;
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = D::from_f32(s.to_f32());
        }
        Ok(())
    }

    fn fill(&self, dst: &mut [f32], value: f32) -> Result<()> {
        dst.fill(value);
        Ok(())
    }

    fn grad_tables(&self, _layout: &GradLayout) -> Result<()> {
        Ok(())
    }

    fn quantize_first<G: GradElement>(
        &self,
        layout: &GradLayout,
        _tables: &(),
        bucket: &[G],
        rng: &UniformStream,
        out: &mut [u8],
    ) -> Result<()> {
        pool::install(|| gradient::quantize_first(layout, bucket, rng, out));
        Ok(())
    }

    fn first_pass_by_chunk(&self) -> bool {
        true
    }

    fn quantize_first_chunk<G: GradElement>(
        &self,
        layout: &GradLayout,
        _tables: &(),
        chunk: usize,
        bucket: &[G],
        rng: &UniformStream,
        out: &mut [u8],
    ) -> Result<()> {
        if chunk >= layout.bucket.chunks {
            return Err(Error::Plan(format!(
                "chunk {chunk} of a bucket of {} chunks",
                layout.bucket.chunks
            )));
        }
        let chunk_bytes = layout.first.peers * layout.first.slab.byte_len();
        check_len("first-pass chunk buffer", out.len(), chunk_bytes)?;
        pool::install(|| gradient::quantize_first_chunk(layout, chunk, bucket, rng, out));
        Ok(())
    }

    fn requantize_second(
        &self,
        layout: &GradLayout,
        _tables: &(),
        my_x1: usize,
        chunk: usize,
        recv: &[u8],
        rng: &UniformStream,
        out: &mut [u8],
    ) -> Result<()> {
        pool::install(|| gradient::requantize_second(layout, my_x1, chunk, recv, rng, out))
    }

    fn reduce_final<G: GradElement>(
        &self,
        layout: &GradLayout,
        chunk: usize,
        recv: &[u8],
        shard: &mut [G],
    ) -> Result<()> {
        pool::install(|| gradient::reduce_final(layout, chunk, recv, shard))
    }

    fn weight_encode(
        &self,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        first_index: u64,
        new: &[bf16],
        reference: &[bf16],
        rng: &UniformStream,
        out: &mut [u8],
    ) -> Result<()> {
        pool::install(|| {
            weight::encode_shard(*layout, encoding, first_index, new, reference, rng, out)
        });
        Ok(())
    }

    fn weight_apply(
        &self,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        plan: &BucketPlan,
        me: usize,
        recv: &[u8],
        own_reference: &[bf16],
        params: &mut [bf16],
    ) -> Result<()> {
        pool::install(|| {
            weight::apply_shards(*layout, encoding, plan, me, recv, own_reference, params)
        })
    }

    fn global_absmax<G: GradElement>(&self, bucket: &[G], word: &mut [f32]) -> Result<()> {
        check_len("absmax word", word.len(), 1)?;
        word[0] = pool::install(|| global_qsgd::local_absmax(bucket));
        Ok(())
    }

    fn global_quantize<G: GradElement, T: IntCode + Element>(
        &self,
        bucket: &[G],
        absmax: &[f32],
        k: i32,
        rounding: Rounding,
        rng: &UniformStream,
        out: &mut [T],
    ) -> Result<()> {
        check_len("absmax word", absmax.len(), 1)?;
        match global_scale(absmax[0], k) {
            GlobalScale::Scaled(scale) => {
                pool::install(|| global_qsgd::quantize(bucket, scale, k, rounding, rng, out))
            }
            GlobalScale::Zeros | GlobalScale::Nans => out.fill(T::zeroed()),
        }
        Ok(())
    }

    fn global_sum_dequantize<T: IntCode + SumElement + Element, G: GradElement>(
        &self,
        blocks: &[T],
        world: usize,
        absmax: &[f32],
        k: i32,
        status: &mut [u32],
        shard: &mut [G],
    ) -> Result<()> {
        let n = shard.len();
        check_len("integer blocks", blocks.len(), world * n)?;
        check_len("integer sum status word", status.len(), 1)?;
        check_len("absmax word", absmax.len(), 1)?;
        let scale = match global_scale(absmax[0], k) {
            GlobalScale::Scaled(scale) => scale,
            GlobalScale::Zeros => {
                shard.fill(G::from_f32(0.0));
                return Ok(());
            }
            GlobalScale::Nans => {
                shard.fill(G::from_f32(f32::NAN));
                return Ok(());
            }
        };
        let Some(first) = blocks.get(..n) else {
            return Ok(());
        };
        let mut sum = first.to_vec();
        let mut overflowed = vec![false; n];
        for (r, block) in blocks.chunks_exact(n).enumerate().skip(1) {
            for (i, (acc, &v)) in sum.iter_mut().zip(block).enumerate() {
                if overflowed[i] {
                    continue;
                }
                match T::checked_sum(*acc, v) {
                    Some(total) => *acc = total,
                    None => {
                        overflowed[i] = true;
                        let key = u32::try_from(r * n + i).unwrap_or(u32::MAX);
                        status[0] = status[0].max(u32::MAX - key);
                    }
                }
            }
        }
        pool::install(|| global_qsgd::dequantize(&sum, scale, shard));
        for (x, _) in shard.iter_mut().zip(&overflowed).filter(|(_, o)| **o) {
            *x = G::from_f32(f32::NAN);
        }
        Ok(())
    }

    fn take_sum_status(&self, status: &mut [u32]) -> Result<u32> {
        check_len("integer sum status word", status.len(), 1)?;
        Ok(std::mem::take(&mut status[0]))
    }

    fn global_dequantize<T: IntCode + Element, G: GradElement>(
        &self,
        sum: &[T],
        absmax: &[f32],
        k: i32,
        shard: &mut [G],
    ) -> Result<()> {
        check_len("absmax word", absmax.len(), 1)?;
        match global_scale(absmax[0], k) {
            GlobalScale::Scaled(scale) => {
                pool::install(|| global_qsgd::dequantize(sum, scale, shard))
            }
            GlobalScale::Zeros => shard.fill(G::from_f32(0.0)),
            GlobalScale::Nans => shard.fill(G::from_f32(f32::NAN)),
        }
        Ok(())
    }
}
