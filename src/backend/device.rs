//! The [`Backend`] trait: where a collective's buffers live and how the fused passes run on
//! them. The collectives of [`crate::collective`] are written once over it;
//! [`Host`](super::cpu::Host) (host memory, slices) and [`Cuda`](super::cuda::Cuda) (device
//! memory, kernels on a stream) implement it.

use std::fmt::Debug;
use std::ops::Range;

use half::bf16;

use super::GradElement;
use crate::codec::int_code::IntCode;
use crate::codec::slab::SlabLayout;
use crate::codec::sum::SumElement;
use crate::codec::weight_encoding::WeightEncoding;
use crate::config::Rounding;
use crate::error::{Error, Result};
use crate::layout::{BucketPlan, GradLayout};
use crate::rng::UniformStream;

/// Element types a backend buffer holds.
pub trait Element: bytemuck::Pod + Send + Sync + Debug + 'static {}

impl<T: bytemuck::Pod + Send + Sync + Debug + 'static> Element for T {}

/// Memory of one kind (host or one CUDA device) and the fused passes of the collectives
/// (docs/numerics.md §7) on it.
///
/// Each pass mirrors the function of `backend::cpu` of the same name argument for argument;
/// a backend other than the CPU must reproduce the CPU's bytes. Passes may run asynchronously
/// (the CUDA backend enqueues on a stream); a [`crate::collective::Comm`] over the same backend
/// orders its exchanges after them.
pub trait Backend: Debug {
    /// A read-only view of `T`s (host: `&[T]`).
    type Src<'a, T: Element>: Copy;
    /// A writable view of `T`s (host: `&mut [T]`).
    type Dst<'a, T: Element>;
    /// A buffer: kept by a collective across calls ([`alloc`](Self::alloc)) or taken for one
    /// call ([`call_buffer`](Self::call_buffer)); its memory is given back when dropped.
    type Buffer<T: Element>: Debug + Send;
    /// Per-bucket constant data of the gradient passes (the CUDA destination table).
    type GradTables: Debug + Send;

    /// A buffer of `len` elements (contents unspecified) to keep across calls (a bucket's
    /// qWD reference); nothing may use it any more when it is dropped.
    fn alloc<T: Element>(&self, len: usize) -> Result<Self::Buffer<T>>;
    /// A buffer of `len` elements (contents unspecified) for one call of a collective, which
    /// drops it once every pass and exchange using it is enqueued and every exchange on it
    /// completed ([`crate::collective::InFlight::wait`]). Its memory then goes only to work
    /// ordered after that work (on a device: stream-ordered reuse, `backend::cuda::alloc`),
    /// so the buckets that run one after another share their exchange buffers instead of
    /// each keeping its own.
    fn call_buffer<T: Element>(&self, len: usize) -> Result<Self::Buffer<T>>;
    /// The whole of `buffer`, to read.
    fn src<T: Element>(buffer: &Self::Buffer<T>) -> Self::Src<'_, T>;
    /// The whole of `buffer`, to write.
    fn dst<T: Element>(buffer: &mut Self::Buffer<T>) -> Self::Dst<'_, T>;
    /// Elements `range` of `src` (panics when out of range, as slicing does).
    fn sub<'a, T>(src: Self::Src<'a, T>, range: Range<usize>) -> Self::Src<'a, T>
    where
        T: Element + 'a;
    /// `dst`, to read for as long as it is borrowed.
    fn read<'b, T: Element>(dst: &'b Self::Dst<'_, T>) -> Self::Src<'b, T>;
    /// `dst`, lent out for a shorter time.
    fn reborrow<'b, T: Element>(dst: &'b mut Self::Dst<'_, T>) -> Self::Dst<'b, T>;
    /// Elements in `src`.
    fn len<T: Element>(src: Self::Src<'_, T>) -> usize;
    /// The bytes of `src`.
    fn as_bytes<'a, T>(src: Self::Src<'a, T>) -> Self::Src<'a, u8>
    where
        T: Element + 'a;
    /// The bytes of `dst`.
    fn as_bytes_mut<'a, T>(dst: Self::Dst<'a, T>) -> Self::Dst<'a, u8>
    where
        T: Element + 'a;

    /// Copies `src` into `dst` (equal lengths).
    fn copy<T: Element>(&self, src: Self::Src<'_, T>, dst: Self::Dst<'_, T>) -> Result<()>;
    /// `dst[i] = D::from_f32(src[i].to_f32())` (equal lengths): a gradient copied, widened
    /// to fp32 or rounded from it (docs/numerics.md §7.5).
    fn convert<S: GradElement, D: GradElement>(
        &self,
        src: Self::Src<'_, S>,
        dst: Self::Dst<'_, D>,
    ) -> Result<()>;
    /// Sets every element of `dst` to `value`.
    fn fill(&self, dst: Self::Dst<'_, f32>, value: f32) -> Result<()>;

    /// The per-bucket tables of `layout`'s gradient passes. A backend that compiles its passes
    /// (CUDA) compiles those of `layout` here, at set-up, so that no step compiles.
    fn grad_tables(&self, layout: &GradLayout) -> Result<Self::GradTables>;
    /// Readies the passes of Global-QSGD with `bits`-bit integers and `rounding` (compiles
    /// them, for a backend that does), at set-up.
    fn prepare_global(&self, _bits: u8, _rounding: Rounding) -> Result<()> {
        Ok(())
    }
    /// Readies the conversions of the routes that do not quantize gradients, at set-up.
    fn prepare_conversions(&self) -> Result<()> {
        Ok(())
    }
    /// Readies the weight passes of slabs of `layout` encoded as `encoding`, at set-up.
    fn prepare_weights(
        &self,
        _layout: &SlabLayout,
        _encoding: WeightEncoding,
        _plan: &BucketPlan,
    ) -> Result<()> {
        Ok(())
    }
    /// `cpu::gradient::quantize_first`.
    fn quantize_first<G: GradElement>(
        &self,
        layout: &GradLayout,
        tables: &Self::GradTables,
        bucket: Self::Src<'_, G>,
        rng: &UniformStream,
        out: Self::Dst<'_, u8>,
    ) -> Result<()>;
    /// Whether [`quantize_first_chunk`](Self::quantize_first_chunk) is implemented: the first
    /// pass then runs chunk by chunk, each chunk's while the one before it is exchanged.
    /// Backends without it run [`quantize_first`](Self::quantize_first) once per bucket and
    /// overlap only the later passes with the exchanges.
    fn first_pass_by_chunk(&self) -> bool {
        false
    }
    /// The first pass of pipeline chunk `chunk` alone (`cpu::gradient::quantize_first_chunk`):
    /// `out` receives chunk `chunk`'s `first.peers` slabs, the bytes
    /// [`quantize_first`](Self::quantize_first) writes at that chunk's place. Called only when
    /// [`first_pass_by_chunk`](Self::first_pass_by_chunk) is true.
    #[allow(clippy::too_many_arguments)]
    fn quantize_first_chunk<G: GradElement>(
        &self,
        layout: &GradLayout,
        tables: &Self::GradTables,
        chunk: usize,
        bucket: Self::Src<'_, G>,
        rng: &UniformStream,
        out: Self::Dst<'_, u8>,
    ) -> Result<()> {
        let _ = (layout, tables, bucket, rng, out);
        Err(Error::Plan(format!(
            "this backend runs the first pass on whole buckets only (chunk {chunk} was asked for)"
        )))
    }
    /// `cpu::gradient::requantize_second` for pipeline chunk `chunk`.
    #[allow(clippy::too_many_arguments)]
    fn requantize_second(
        &self,
        layout: &GradLayout,
        tables: &Self::GradTables,
        my_x1: usize,
        chunk: usize,
        recv: Self::Src<'_, u8>,
        rng: &UniformStream,
        out: Self::Dst<'_, u8>,
    ) -> Result<()>;
    /// `cpu::gradient::reduce_final` for pipeline chunk `chunk`.
    fn reduce_final<G: GradElement>(
        &self,
        layout: &GradLayout,
        chunk: usize,
        recv: Self::Src<'_, u8>,
        shard: Self::Dst<'_, G>,
    ) -> Result<()>;

    /// `cpu::weight::encode_shard` (`reference` is ignored by direct encodings).
    #[allow(clippy::too_many_arguments)]
    fn weight_encode(
        &self,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        first_index: u64,
        new: Self::Src<'_, bf16>,
        reference: Self::Src<'_, bf16>,
        rng: &UniformStream,
        out: Self::Dst<'_, u8>,
    ) -> Result<()>;
    /// `cpu::weight::apply_shards` (`own_reference` is ignored by direct encodings).
    #[allow(clippy::too_many_arguments)]
    fn weight_apply(
        &self,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        plan: &BucketPlan,
        me: usize,
        recv: Self::Src<'_, u8>,
        own_reference: Self::Src<'_, bf16>,
        params: Self::Dst<'_, bf16>,
    ) -> Result<()>;

    /// `cpu::global_qsgd::local_absmax` written into `word` (one f32: `max |x|`, or +Inf when
    /// the bucket holds a NaN or Inf), which the communicator's `all_reduce_max_in_place`
    /// then maximises over the ranks; nothing comes back to the host.
    fn global_absmax<G: GradElement>(
        &self,
        bucket: Self::Src<'_, G>,
        word: Self::Dst<'_, f32>,
    ) -> Result<()>;
    /// `cpu::global_qsgd::quantize` at the scale `s = a / k` of the global absmax `a`, the one
    /// f32 of `absmax`, by [`global_scale`]: every code 0 when it says [`GlobalScale::Nans`]
    /// or [`GlobalScale::Zeros`].
    #[allow(clippy::too_many_arguments)]
    fn global_quantize<G: GradElement, T: IntCode + Element>(
        &self,
        bucket: Self::Src<'_, G>,
        absmax: Self::Src<'_, f32>,
        k: i32,
        rounding: Rounding,
        rng: &UniformStream,
        out: Self::Dst<'_, T>,
    ) -> Result<()>;
    /// Whether Global-QSGD's collective sums its integers with this backend's
    /// [`global_sum_dequantize`](Self::global_sum_dequantize) over the blocks an all-to-all
    /// delivered, rather than with the communicator's reduce-scatter (which returns an
    /// overflow as an error at once) and [`global_dequantize`](Self::global_dequantize): a
    /// device sums and checks without the host, recording an overflow in a status word.
    fn sums_exchanged_blocks(&self) -> bool {
        false
    }
    /// The sum in rank order of the `world` blocks of `blocks` (block `r` from rank `r`, each
    /// `shard.len()` integers), each partial sum checked for overflow as
    /// `collective::sum_in_rank_order` checks, then
    /// [`global_dequantize`](Self::global_dequantize) of it. An element whose sum overflows is
    /// NaN and the first overflow `(r, i)` in rank order is recorded in `status` (one u32: it
    /// keeps the largest `u32::MAX - (r * shard.len() + i)`, 0 when none;
    /// [`take_sum_status`](Self::take_sum_status) reads it). Sums are checked only when the
    /// scale is [`GlobalScale::Scaled`] (the other cases write every element regardless).
    #[allow(clippy::too_many_arguments)]
    fn global_sum_dequantize<T: IntCode + SumElement + Element, G: GradElement>(
        &self,
        blocks: Self::Src<'_, T>,
        world: usize,
        absmax: Self::Src<'_, f32>,
        k: i32,
        status: Self::Dst<'_, u32>,
        shard: Self::Dst<'_, G>,
    ) -> Result<()>;
    /// The status word of [`global_sum_dequantize`](Self::global_sum_dequantize), set to zero
    /// afterwards; waits for the passes enqueued before.
    fn take_sum_status(&self, status: Self::Dst<'_, u32>) -> Result<u32>;
    /// `cpu::global_qsgd::dequantize` at the scale of the global absmax in `absmax` (as
    /// [`global_quantize`](Self::global_quantize)): every element NaN for
    /// [`GlobalScale::Nans`], 0 for [`GlobalScale::Zeros`].
    fn global_dequantize<T: IntCode + Element, G: GradElement>(
        &self,
        sum: Self::Src<'_, T>,
        absmax: Self::Src<'_, f32>,
        k: i32,
        shard: Self::Dst<'_, G>,
    ) -> Result<()>;
}

/// What Global-QSGD scales by, from the global absmax `a` and K (docs/numerics.md §7.2 steps 2
/// and 4; `kernels/global_qsgd.cu`'s `global_scale` is the same rule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GlobalScale {
    /// `s = a / K`, positive and finite.
    Scaled(f32),
    /// `a / K` is 0 (an all-zero bucket, or `a` so small that the division underflows): every
    /// shard is all zeros.
    Zeros,
    /// `a` is not finite (a NaN or Inf in some rank's bucket): every shard is all NaN.
    Nans,
}

/// The [`GlobalScale`] of global absmax `absmax` and largest code `k`.
pub fn global_scale(absmax: f32, k: i32) -> GlobalScale {
    if !absmax.is_finite() {
        return GlobalScale::Nans;
    }
    let s = absmax / k as f32;
    if s == 0.0 {
        GlobalScale::Zeros
    } else {
        GlobalScale::Scaled(s)
    }
}
