//! [`Cuda`]: the [`Backend`] of one CUDA device. Buffers are device allocations
//! ([`DeviceBuffer`], from the backend's [`Allocator`]), views are [`DeviceSpan`]s, and every pass is a kernel launch (or an
//! async copy / memset) on the caller's stream, so the collectives of
//! [`crate::collective`] run on device memory unchanged.
//!
//! No pass waits for the device: Global-QSGD's kernels read the all-reduced absmax from
//! device memory (docs/cuda.md).

use std::ops::Range;

use cudarc::driver::result as driver;
use cudarc::driver::sys;
use half::bf16;

use super::alloc::{Allocator, DeviceBuffer};
use super::launch::{DeviceSpan, Stream, dest_table};
use super::module::{Kernels, driver_error};
use super::spec;
use crate::backend::{Backend, Element, GradElement};
use crate::codec::int_code::IntCode;
use crate::codec::slab::SlabLayout;
use crate::codec::sum::SumElement;
use crate::codec::weight_encoding::WeightEncoding;
use crate::config::Rounding;
use crate::error::{Result, check_len};
use crate::layout::{BucketPlan, GradLayout};
use crate::rng::UniformStream;

/// The kernels of one device, the stream the passes are enqueued on and the allocator the
/// buffers come from.
#[derive(Debug, Clone, Copy)]
pub struct Cuda {
    kernels: &'static Kernels,
    stream: Stream,
    allocator: Allocator,
}

impl Cuda {
    /// Passes on `kernels`' device, enqueued on `stream` (a stream of that device's primary
    /// context, see [`Stream::from_raw`]), with buffers from the driver.
    pub fn new(kernels: &'static Kernels, stream: Stream) -> Self {
        Self {
            kernels,
            stream,
            allocator: Allocator::Driver,
        }
    }

    /// The same backend with buffers from `allocator`.
    pub fn with_allocator(self, allocator: Allocator) -> Self {
        Self { allocator, ..self }
    }

    /// The kernels (and device) the passes run with.
    pub fn kernels(&self) -> &'static Kernels {
        self.kernels
    }

    /// The stream the passes are enqueued on.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// The destination table of `layout` in device memory, uploaded on the backend's stream,
    /// like every pass: memory an allocator tied to that stream (torch's) hands out may still be
    /// used by work enqueued there before, which a synchronous copy (ordered on the legacy
    /// default stream only) could overtake.
    fn upload_dest_table(&self, layout: &GradLayout) -> Result<DeviceBuffer<u32>> {
        let table = dest_table(layout)?;
        let buffer = DeviceBuffer::<u32>::new(self.kernels, self.allocator, table.len())?;
        if !table.is_empty() {
            let stream = self.stream.raw();
            self.kernels.with_context(|| {
                // SAFETY: the buffer holds `table.len()` u32s in this context and `stream`
                // belongs to it; a copy from pageable host memory reads `table` before it
                // returns, so dropping `table` afterwards is sound.
                unsafe { driver::memcpy_htod_async(buffer.addr(), &table, stream) }
                    .map_err(driver_error("cuMemcpyHtoDAsync"))
            })?;
        }
        Ok(buffer)
    }

    /// Copies `src` into the device memory `dst` (of `src.len()` elements), synchronously:
    /// ordered after the work already enqueued on the legacy default stream, and done when it
    /// returns.
    pub fn upload<T: Element>(&self, src: &[T], dst: DeviceSpan<T>) -> Result<()> {
        check_len("upload destination", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.kernels.with_context(|| {
            // SAFETY: `dst` is `src.len()` elements of device memory of this context (the
            // DeviceSpan contract); the copy is synchronous, so `src` outlives it.
            unsafe { driver::memcpy_htod_sync(dst.addr(), src) }
                .map_err(driver_error("cuMemcpyHtoD"))
        })
    }

    /// The elements of `src` once every pass enqueued on this backend's stream before the
    /// call has run (synchronises the stream).
    pub fn download<T: Element>(&self, src: DeviceSpan<T>) -> Result<Vec<T>> {
        let mut out = vec![bytemuck::Zeroable::zeroed(); src.len()];
        let stream = self.stream.raw();
        self.kernels.with_context(|| {
            // SAFETY: `src` is `out.len()` elements of device memory of this context; the
            // stream is synchronised before `out` is read or dropped.
            unsafe {
                if !out.is_empty() {
                    driver::memcpy_dtoh_async(&mut out, src.addr(), stream)
                        .map_err(driver_error("cuMemcpyDtoHAsync"))?;
                }
                driver::stream::synchronize(stream).map_err(driver_error("cuStreamSynchronize"))
            }
        })?;
        Ok(out)
    }
}

/// The span of elements `range` of `span` (panics when out of range, as slicing does).
fn sub_span<T>(span: DeviceSpan<T>, range: Range<usize>) -> DeviceSpan<T> {
    assert!(
        range.start <= range.end && range.end <= span.len(),
        "range {range:?} out of a device span of {} elements",
        span.len()
    );
    // SAFETY: a sub-range of a valid span is valid under the same contract.
    unsafe {
        DeviceSpan::from_raw(
            span.addr() + (range.start * size_of::<T>()) as u64,
            range.len(),
        )
    }
}

/// The bytes of `span`.
fn byte_span<T>(span: DeviceSpan<T>) -> DeviceSpan<u8> {
    // SAFETY: the same memory, seen as bytes.
    unsafe { DeviceSpan::from_raw(span.addr(), span.len() * size_of::<T>()) }
}

impl Backend for Cuda {
    type Src<'a, T: Element> = DeviceSpan<T>;
    type Dst<'a, T: Element> = DeviceSpan<T>;
    type Buffer<T: Element> = DeviceBuffer<T>;
    /// The destination table of the layout in device memory.
    type GradTables = DeviceBuffer<u32>;

    fn alloc<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::new(self.kernels, self.allocator, len)
    }

    /// `DeviceBuffer::take` for this backend's stream.
    fn call_buffer<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::take(self.kernels, self.allocator, self.stream, len)
    }

    fn src<T: Element>(buffer: &DeviceBuffer<T>) -> DeviceSpan<T> {
        buffer.span()
    }

    fn dst<T: Element>(buffer: &mut DeviceBuffer<T>) -> DeviceSpan<T> {
        buffer.span()
    }

    fn sub<'a, T>(src: DeviceSpan<T>, range: Range<usize>) -> DeviceSpan<T>
    where
        T: Element + 'a,
    {
        sub_span(src, range)
    }

    fn read<T: Element>(dst: &DeviceSpan<T>) -> DeviceSpan<T> {
        *dst
    }

    fn reborrow<T: Element>(dst: &mut DeviceSpan<T>) -> DeviceSpan<T> {
        *dst
    }

    fn len<T: Element>(src: DeviceSpan<T>) -> usize {
        src.len()
    }

    fn as_bytes<'a, T>(src: DeviceSpan<T>) -> DeviceSpan<u8>
    where
        T: Element + 'a,
    {
        byte_span(src)
    }

    fn as_bytes_mut<'a, T>(dst: DeviceSpan<T>) -> DeviceSpan<u8>
    where
        T: Element + 'a,
    {
        byte_span(dst)
    }

    fn copy<T: Element>(&self, src: DeviceSpan<T>, dst: DeviceSpan<T>) -> Result<()> {
        check_len("copy destination", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let stream = self.stream.raw();
        self.kernels.with_context(|| {
            // SAFETY: both spans are device memory of this context (the DeviceSpan contract)
            // of `src.len()` elements; `stream` belongs to the context.
            unsafe {
                driver::memcpy_dtod_async(
                    dst.addr(),
                    src.addr(),
                    src.len() * size_of::<T>(),
                    stream,
                )
            }
            .map_err(driver_error("cuMemcpyDtoDAsync"))
        })
    }

    fn convert<S: GradElement, D: GradElement>(
        &self,
        src: DeviceSpan<S>,
        dst: DeviceSpan<D>,
    ) -> Result<()> {
        check_len("conversion destination", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        if !S::IS_BF16 && !D::IS_BF16 {
            // SAFETY: both are fp32 (the only GradElement that is not bf16), the same device
            // memory.
            let (src, dst) = unsafe {
                (
                    DeviceSpan::<f32>::from_raw(src.addr(), src.len()),
                    DeviceSpan::<f32>::from_raw(dst.addr(), dst.len()),
                )
            };
            return self.copy(src, dst);
        }
        self.kernels.grad_convert(self.stream, src, dst)
    }

    fn fill(&self, dst: DeviceSpan<f32>, value: f32) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let stream = self.stream.raw();
        self.kernels.with_context(|| {
            // SAFETY: `dst` is `len` f32s of device memory of this context; `stream` belongs
            // to it.
            unsafe { sys::cuMemsetD32Async(dst.addr(), value.to_bits(), dst.len(), stream) }
                .result()
                .map_err(driver_error("cuMemsetD32Async"))
        })
    }

    /// The destination table (uploaded on the backend's stream), after the layout's kernels are
    /// compiled (and tuned, on a device the variant table lacks).
    fn grad_tables(&self, layout: &GradLayout) -> Result<DeviceBuffer<u32>> {
        self.kernels.prepare_uses(&spec::grad_uses(layout)?)?;
        let tables = self.upload_dest_table(layout)?;
        self.tune_grad(layout, &tables)?;
        Ok(tables)
    }

    fn prepare_global(&self, bits: u8, rounding: Rounding) -> Result<()> {
        self.kernels
            .prepare_uses(&spec::global_uses(bits, rounding)?)
    }

    fn prepare_conversions(&self) -> Result<()> {
        self.kernels.prepare_uses(&spec::conversion_uses())
    }

    fn prepare_weights(
        &self,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        plan: &BucketPlan,
    ) -> Result<()> {
        self.kernels
            .prepare_uses(&spec::weight_uses(layout, encoding, plan)?)?;
        self.tune_weights(layout, encoding, plan)
    }

    fn quantize_first<G: GradElement>(
        &self,
        layout: &GradLayout,
        tables: &DeviceBuffer<u32>,
        bucket: DeviceSpan<G>,
        rng: &UniformStream,
        out: DeviceSpan<u8>,
    ) -> Result<()> {
        self.kernels
            .grad_quantize_first(self.stream, layout, bucket, tables.span(), rng, out)
    }

    fn requantize_second(
        &self,
        layout: &GradLayout,
        tables: &DeviceBuffer<u32>,
        my_x1: usize,
        chunk: usize,
        recv: DeviceSpan<u8>,
        rng: &UniformStream,
        out: DeviceSpan<u8>,
    ) -> Result<()> {
        self.kernels.grad_requantize_second(
            self.stream,
            layout,
            my_x1,
            chunk,
            recv,
            tables.span(),
            rng,
            out,
        )
    }

    fn reduce_final<G: GradElement>(
        &self,
        layout: &GradLayout,
        chunk: usize,
        recv: DeviceSpan<u8>,
        shard: DeviceSpan<G>,
    ) -> Result<()> {
        self.kernels
            .grad_reduce_final(self.stream, layout, chunk, recv, shard)
    }

    fn weight_encode(
        &self,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        first_index: u64,
        new: DeviceSpan<bf16>,
        reference: DeviceSpan<bf16>,
        rng: &UniformStream,
        out: DeviceSpan<u8>,
    ) -> Result<()> {
        self.kernels.weight_encode(
            self.stream,
            layout,
            encoding,
            first_index,
            new,
            reference,
            rng,
            out,
        )
    }

    fn weight_apply(
        &self,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        plan: &BucketPlan,
        me: usize,
        recv: DeviceSpan<u8>,
        own_reference: DeviceSpan<bf16>,
        params: DeviceSpan<bf16>,
    ) -> Result<()> {
        self.kernels.weight_apply(
            self.stream,
            layout,
            encoding,
            plan,
            me,
            recv,
            own_reference,
            params,
        )
    }

    fn global_absmax<G: GradElement>(
        &self,
        bucket: DeviceSpan<G>,
        word: DeviceSpan<f32>,
    ) -> Result<()> {
        // SAFETY: the same device memory; the kernel leaves the bits of a non-negative f32 or
        // +Inf in it.
        let bits = unsafe { DeviceSpan::<u32>::from_raw(word.addr(), word.len()) };
        self.kernels.global_absmax(self.stream, bucket, bits)
    }

    fn global_quantize<G: GradElement, T: IntCode + Element>(
        &self,
        bucket: DeviceSpan<G>,
        absmax: DeviceSpan<f32>,
        k: i32,
        rounding: Rounding,
        rng: &UniformStream,
        out: DeviceSpan<T>,
    ) -> Result<()> {
        self.kernels
            .global_quantize_scaled_by(self.stream, bucket, absmax, k, rounding, rng, out)
    }

    fn sums_exchanged_blocks(&self) -> bool {
        true
    }

    fn global_sum_dequantize<T: IntCode + SumElement + Element, G: GradElement>(
        &self,
        blocks: DeviceSpan<T>,
        world: usize,
        absmax: DeviceSpan<f32>,
        k: i32,
        status: DeviceSpan<u32>,
        shard: DeviceSpan<G>,
    ) -> Result<()> {
        self.kernels
            .global_sum_dequantize(self.stream, blocks, world, absmax, k, status, shard)
    }

    fn take_sum_status(&self, status: DeviceSpan<u32>) -> Result<u32> {
        check_len("integer sum status word", status.len(), 1)?;
        let word = self.download(status)?;
        let stream = self.stream.raw();
        self.kernels.with_context(|| {
            // SAFETY: `status` is one u32 of device memory of this context; `stream` belongs
            // to it.
            unsafe { sys::cuMemsetD32Async(status.addr(), 0, 1, stream) }
                .result()
                .map_err(driver_error("cuMemsetD32Async"))
        })?;
        Ok(word[0])
    }

    fn global_dequantize<T: IntCode + Element, G: GradElement>(
        &self,
        sum: DeviceSpan<T>,
        absmax: DeviceSpan<f32>,
        k: i32,
        shard: DeviceSpan<G>,
    ) -> Result<()> {
        self.kernels
            .global_dequantize_scaled_by(self.stream, sum, absmax, k, shard)
    }
}
