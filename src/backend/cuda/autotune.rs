//! The autotune of a GPU architecture the variant table lacks
//! ([`TABLE`](super::variants::TABLE)): at a bucket's set-up, each of its kernels runs every
//! candidate variant ([`candidates`]) on synthetic buffers of the bucket's geometry on the
//! bucket's stream, timed with CUDA events, and the fastest is chosen for the device
//! ([`Kernels::set_variant`]) and recorded on disk beside the kernel cache, keyed by the device,
//! the driver, the NVRTC and the kernel sources, so that a restart and the node's other ranks do
//! not tune again.
//!
//! Never on the hot path: only the set-up of a bucket tunes, once per kernel and constants in a
//! process (then never again on the node). Never while a CUDA graph is being captured on the
//! bucket's stream: the defaults are used, untuned. `SDP4BIT_KERNEL_AUTOTUNE=0` turns it off.
//! Ranks may choose different variants: every variant computes the same bytes. Global-QSGD's
//! element-wise kernels and the conversions keep their defaults (their set-up does not know the
//! bucket's size); the GPU kit's sweep times their variants.

use cudarc::driver::result as driver;
use cudarc::driver::sys;

use half::bf16;

use super::abi::{SdpGradFinal, SdpGradFirst, SdpGradSecond, SdpWeightApply, SdpWeightEncode};
use super::alloc::DeviceBuffer;
use super::backend::Cuda;
use super::launch::{DeviceSpan, Stream};
use super::module::{Kernels, driver_error};
use super::source::Kernel;
use super::spec::{Constants, KernelSpec, Variant};
use super::tuned::{self, record};
use super::variants::candidates;
use crate::backend::Backend;
use crate::codec::slab::SlabLayout;
use crate::codec::weight_encoding::WeightEncoding;
use crate::error::{Error, Result};
use crate::layout::{BucketPlan, GradLayout};
use crate::rng::UniformStream;

/// Launches before the timed ones of each candidate (module load, clocks, caches).
const WARM_UP: usize = 2;
/// Timed launches of each candidate; the median counts.
const TIMED: usize = 5;

/// A CUDA event with timing, destroyed when dropped.
struct TimingEvent {
    kernels: &'static Kernels,
    raw: sys::CUevent,
}

impl TimingEvent {
    fn new(kernels: &'static Kernels) -> Result<Self> {
        let raw = kernels.with_context(|| {
            driver::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(driver_error("cuEventCreate"))
        })?;
        Ok(Self { kernels, raw })
    }

    fn record(&self, stream: Stream) -> Result<()> {
        self.kernels.with_context(|| {
            // SAFETY: a live event and a live stream of the current context.
            unsafe { driver::event::record(self.raw, stream.raw()) }
                .map_err(driver_error("cuEventRecord"))
        })
    }

    /// Milliseconds from `start` to this event, once both have fired (waits for this one).
    fn since(&self, start: &TimingEvent) -> Result<f32> {
        self.kernels.with_context(|| {
            // SAFETY: live events of the current context, both recorded.
            unsafe {
                driver::event::synchronize(self.raw).map_err(driver_error("cuEventSynchronize"))?;
                driver::event::elapsed(start.raw, self.raw)
                    .map_err(driver_error("cuEventElapsedTime"))
            }
        })
    }
}

impl Drop for TimingEvent {
    fn drop(&mut self) {
        let raw = self.raw;
        let _ = self.kernels.with_context(|| {
            // SAFETY: the event was created by `new` and is destroyed once, after its last use.
            unsafe { driver::event::destroy(raw) }.map_err(driver_error("cuEventDestroy"))
        });
    }
}

/// Whether a CUDA graph is being captured on `stream`.
fn capturing(kernels: &Kernels, stream: Stream) -> Result<bool> {
    kernels.with_context(|| {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream of the current context; `status` receives its state.
        unsafe { sys::cuStreamIsCapturing(stream.raw(), &mut status) }
            .result()
            .map_err(driver_error("cuStreamIsCapturing"))?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    })
}

impl Cuda {
    /// Whether one of `kernels` is to be tuned on this backend's device now: the device is
    /// tuned ([`tuned::enabled`]), a variant of it is not chosen yet, and no graph is being captured on
    /// the stream (whose work, the tuning's fills included, would go into the graph).
    fn wants_tuning(&self, kernels: &[(Kernel, Constants)]) -> Result<bool> {
        let device = self.kernels();
        if !tuned::enabled(device.arch()) || kernels.iter().all(|&(k, c)| device.is_chosen(k, c)) {
            return Ok(false);
        }
        Ok(!capturing(device, self.stream())?)
    }

    /// Tunes `kernel` with `constants` on this backend's device when
    /// [`wants_tuning`](Self::wants_tuning) says so: `launch` runs
    /// the kernel once on the tuning buffers (with the variant [`Kernels::variant`] gives); each
    /// candidate is compiled, run [`WARM_UP`] times and [`TIMED`] times between events, and the
    /// one of the smallest median is chosen and recorded.
    pub(crate) fn tune(
        &self,
        kernel: Kernel,
        constants: Constants,
        mut launch: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        if !self.wants_tuning(&[(kernel, constants)])? {
            return Ok(());
        }
        let (kernels, stream) = (self.kernels(), self.stream());
        let all = candidates(kernel, constants);
        let specs = all
            .iter()
            .map(|&v| KernelSpec::new(kernel, constants, v))
            .collect::<Result<Vec<_>>>()?;
        kernels.prepare(&specs)?;
        let (start, end) = (TimingEvent::new(kernels)?, TimingEvent::new(kernels)?);
        let mut best: Option<(f32, Variant)> = None;
        for &variant in &all {
            kernels.set_variant(kernel, constants, variant)?;
            for _ in 0..WARM_UP {
                launch()?;
            }
            let mut times = Vec::with_capacity(TIMED);
            for _ in 0..TIMED {
                start.record(stream)?;
                launch()?;
                end.record(stream)?;
                times.push(end.since(&start)?);
            }
            times.sort_by(f32::total_cmp);
            let median = times[TIMED / 2];
            if best.is_none_or(|(ms, _)| median < ms) {
                best = Some((median, variant));
            }
        }
        let (_, variant) = best.ok_or_else(|| Error::Cuda("no variant to tune".into()))?;
        kernels.set_variant(kernel, constants, variant)?;
        if let Some(path) = tuned::record_file(
            kernels.device_name(),
            kernels.target().target,
            kernels.nvrtc_version(),
            kernels.driver_version(),
        ) {
            // The record only saves the next process the tuning: not writing it is no error.
            let _ = record(&path, &KernelSpec::new(kernel, constants, variant)?);
        }
        Ok(())
    }

    /// Tunes the grouped gradient passes of `layout` (`dests` its destination table): the first
    /// pass of an fp32 and of a bf16 bucket of constant values, the requantization (two levels)
    /// and the final pass into an fp32 and a bf16 shard, each on what the pass before wrote
    /// (valid slabs), chunk 0, as rank 0 of its first-level group.
    pub(crate) fn tune_grad(&self, layout: &GradLayout, dests: &DeviceBuffer<u32>) -> Result<()> {
        let rng = UniformStream::new(0, 0, 0);
        let first = Constants::first(&SdpGradFirst::new(layout, &rng)?)?;
        let second = match layout.second {
            Some(_) => Some(Constants::second(&SdpGradSecond::new(layout, 0, 0, &rng)?)?),
            None => None,
        };
        let last = Constants::last(&SdpGradFinal::new(layout, 0)?)?;
        let mut passes = vec![
            (Kernel::GradQuantizeFirst, first),
            (Kernel::GradQuantizeFirstBf16, first),
            (Kernel::GradReduceFinal, last),
            (Kernel::GradReduceFinalBf16, last),
        ];
        passes.extend(second.map(|c| (Kernel::GradRequantizeSecond, c)));
        if !self.wants_tuning(&passes)? {
            return Ok(());
        }
        let (k, s) = (self.kernels(), self.stream());
        let numel = layout.bucket.numel;
        let bucket = self.constant_f32(numel)?;
        let bucket16 = self.constant_bf16(numel)?;
        let sent = self.call_buffer::<u8>(
            layout.bucket.chunks * layout.first.peers * layout.first.slab.byte_len(),
        )?;
        let out = sent.span();
        let dests = dests.span();
        self.tune(Kernel::GradQuantizeFirstBf16, first, || {
            k.grad_quantize_first::<bf16>(s, layout, bucket16.span(), dests, &rng, out)
        })?;
        self.tune(Kernel::GradQuantizeFirst, first, || {
            k.grad_quantize_first::<f32>(s, layout, bucket.span(), dests, &rng, out)
        })?;
        // SAFETY: chunk 0's first-level slabs, the start of `sent`.
        let chunk0 = unsafe {
            DeviceSpan::<u8>::from_raw(
                out.addr(),
                layout.first.peers * layout.first.slab.byte_len(),
            )
        };
        let mut second_out = None;
        if let (Some(level), Some(constants)) = (layout.second, second) {
            let buffer = self.call_buffer::<u8>(level.peers * level.slab.byte_len())?;
            let out2 = buffer.span();
            self.tune(Kernel::GradRequantizeSecond, constants, || {
                k.grad_requantize_second(s, layout, 0, 0, chunk0, dests, &rng, out2)
            })?;
            second_out = Some(buffer);
        }
        let received = second_out.as_ref().map_or(chunk0, DeviceBuffer::span);
        let shard = self.call_buffer::<f32>(layout.bucket.shard_len)?;
        let shard16 = self.call_buffer::<bf16>(layout.bucket.shard_len)?;
        self.tune(Kernel::GradReduceFinal, last, || {
            k.grad_reduce_final::<f32>(s, layout, 0, received, shard.span())
        })?;
        self.tune(Kernel::GradReduceFinalBf16, last, || {
            k.grad_reduce_final::<bf16>(s, layout, 0, received, shard16.span())
        })?;
        Ok(())
    }

    /// Tunes the weight passes of slabs of `layout` encoded as `encoding` for `plan`: the
    /// encoding of a shard of constant values (against a constant reference for qWD), then the
    /// application of W copies of its slab to a bucket of constant values.
    pub(crate) fn tune_weights(
        &self,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        plan: &BucketPlan,
    ) -> Result<()> {
        let rng = UniformStream::new(0, 0, 0);
        let encode = SdpWeightEncode::new(layout, encoding, plan.shard_len, 0, &rng)?;
        let apply = SdpWeightApply::new(layout, encoding, plan, 0)?;
        let (encode, apply) = (Constants::encode(&encode)?, Constants::apply(&apply)?);
        if !self.wants_tuning(&[(Kernel::WeightEncode, encode), (Kernel::WeightApply, apply)])? {
            return Ok(());
        }
        let (k, s) = (self.kernels(), self.stream());
        let new = self.constant_bf16(plan.shard_len)?;
        let reference = self.call_buffer::<bf16>(plan.shard_len)?;
        self.fill_bytes(reference.span(), 0x3b)?;
        let slab = self.call_buffer::<u8>(layout.byte_len())?;
        self.tune(Kernel::WeightEncode, encode, || {
            k.weight_encode(
                s,
                layout,
                encoding,
                0,
                new.span(),
                reference.span(),
                &rng,
                slab.span(),
            )
        })?;
        let received = self.call_buffer::<u8>(plan.world * layout.byte_len())?;
        for z in 0..plan.world {
            // SAFETY: slab z of the receive buffer, inside it.
            let to = unsafe {
                DeviceSpan::<u8>::from_raw(
                    received.addr() + (z * layout.byte_len()) as u64,
                    layout.byte_len(),
                )
            };
            self.copy(slab.span(), to)?;
        }
        let params = self.constant_bf16(plan.numel)?;
        self.tune(Kernel::WeightApply, apply, || {
            k.weight_apply(
                s,
                layout,
                encoding,
                plan,
                0,
                received.span(),
                reference.span(),
                params.span(),
            )
        })
    }

    /// `len` fp32 of a constant, normal value (0.01): every group quantizes by the fast path.
    fn constant_f32(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        let buffer = self.call_buffer::<f32>(len)?;
        self.fill(buffer.span(), 0.01)?;
        Ok(buffer)
    }

    /// `len` bf16 of a constant, normal value (0x3c3c, about 0.0115).
    fn constant_bf16(&self, len: usize) -> Result<DeviceBuffer<bf16>> {
        let buffer = self.call_buffer::<bf16>(len)?;
        self.fill_bytes(buffer.span(), 0x3c)?;
        Ok(buffer)
    }

    /// Sets every byte of `dst` to `byte`, on the backend's stream.
    fn fill_bytes<T>(&self, dst: DeviceSpan<T>, byte: u8) -> Result<()> {
        let stream = self.stream().raw();
        self.kernels().with_context(|| {
            // SAFETY: `dst` is device memory of this context (the DeviceSpan contract) and the
            // stream belongs to it.
            unsafe { driver::memset_d8_async(dst.addr(), byte, dst.len() * size_of::<T>(), stream) }
                .map_err(driver_error("cuMemsetD8Async"))
        })
    }
}
