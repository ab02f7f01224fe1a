//! Typed launches of every kernel, one method of [`Kernels`] per kernel, mirroring the CPU
//! passes of `backend::cpu` argument for argument.
//!
//! A launch checks the buffer sizes against the plan, builds the kernel's parameter struct
//! (`abi`), derives from it the specialisation to launch ([`KernelSpec`]: the struct's
//! configuration as constants, and the device's variant for them), checks its arguments against
//! the kernel's line of the kernel table (pointer count, element sizes, struct), and enqueues the
//! kernel on the caller's stream with `cuLaunchKernel`: no allocation, no host synchronisation,
//! no wait for the result (a specialisation not prepared at set-up is compiled first). Buffers
//! are raw device pointers ([`DeviceSpan`]) so the torch extension can pass
//! `tensor.data_ptr()` and its current stream ([`Stream`]). Errors are values; the kernels
//! themselves cannot report errors, so corrupt received slabs decode to NaN where the CPU
//! returns `Error::Decode` (see `kernels/common.cuh`).

use std::ffi::c_void;
use std::marker::PhantomData;

use half::bf16;

use super::abi::{
    AbiParams, SdpConvert, SdpGlobal, SdpGradFinal, SdpGradFirst, SdpGradSecond, SdpWeightApply,
    SdpWeightEncode, to_u32,
};
use super::module::{Kernels, driver_error};
use super::source::Kernel;
use super::spec::{Constants, KernelSpec};
use crate::backend::GradElement;
use crate::codec::int_code::IntCode;
use crate::codec::slab::{SLAB_ALIGN, SlabLayout};
use crate::codec::weight_encoding::WeightEncoding;
use crate::config::Rounding;
use crate::error::{Error, Result};
use crate::layout::{BucketPlan, GradLayout};
use crate::rng::UniformStream;
use cudarc::driver::result as driver;
use cudarc::driver::sys;

/// A CUDA stream of the device's primary context, given as its raw handle (`CUstream`,
/// `cudaStream_t`: the two are the same object), such as torch's current stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream(usize);

impl Stream {
    /// The stream whose raw handle is `handle` (`0` is the legacy default stream).
    ///
    /// # Safety
    /// `handle` must be `0`, a per-thread default stream constant, or a live stream created
    /// in the primary context of the device whose [`Kernels`] launch on it, and must stay
    /// live until the work launched on it has completed.
    pub unsafe fn from_raw(handle: usize) -> Self {
        Self(handle)
    }

    /// The raw handle, as [`from_raw`](Self::from_raw) takes it (for a communicator that
    /// enqueues on the stream itself).
    pub fn handle(self) -> usize {
        self.0
    }

    /// The driver handle.
    pub(super) fn raw(self) -> sys::CUstream {
        self.0 as sys::CUstream
    }
}

/// `len` elements of type `T` in device memory, given by their raw address.
///
/// A span a launch writes must not overlap any span the same launch reads (checked).
#[derive(Debug)]
pub struct DeviceSpan<T> {
    addr: u64,
    len: usize,
    _element: PhantomData<fn() -> T>,
}

impl<T> Clone for DeviceSpan<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DeviceSpan<T> {}

impl<T> DeviceSpan<T> {
    /// The `len` elements at device address `addr` (a `CUdeviceptr`, or torch's
    /// `data_ptr()`).
    ///
    /// # Safety
    /// `addr .. addr + len * size_of::<T>()` must be device memory of the device whose
    /// [`Kernels`] launch with it (or memory that device can access), valid for reads and for
    /// the writes of the launches it is passed to as an output, until those launches have
    /// completed on their stream; nothing else may write it meanwhile.
    pub unsafe fn from_raw(addr: u64, len: usize) -> Self {
        Self {
            addr,
            len,
            _element: PhantomData,
        }
    }

    /// The device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the span holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the span.
    fn bytes(&self) -> u64 {
        (self.len * size_of::<T>()) as u64
    }

    /// Checks length, alignment (`align` bytes, at least `T`'s) and non-null address.
    fn check(&self, what: &str, len: usize, align: usize) -> Result<()> {
        if self.len != len {
            return Err(Error::Buffer(format!(
                "{what} has {} elements, the plan expects {len}",
                self.len
            )));
        }
        let align = align.max(align_of::<T>()) as u64;
        if self.addr == 0 || !self.addr.is_multiple_of(align) {
            return Err(Error::Buffer(format!(
                "{what} at device address {:#x} is not {align}-byte aligned (or is null)",
                self.addr
            )));
        }
        Ok(())
    }

    /// The first `len` elements of `span` (at most its length).
    fn first(span: Self, len: usize) -> Self {
        Self {
            addr: span.addr,
            len: len.min(span.len),
            _element: PhantomData,
        }
    }

    /// The byte range of the span.
    fn range(&self) -> (u64, u64) {
        (self.addr, self.addr + self.bytes())
    }

    /// The span as a kernel's pointer argument.
    fn arg(&self) -> Arg {
        Arg {
            addr: self.addr,
            element_bytes: size_of::<T>(),
        }
    }
}

/// A pointer argument of a launch: a device address (0 for one the kernel does not use) and
/// the size of the elements it points to.
#[derive(Debug, Clone, Copy)]
struct Arg {
    addr: u64,
    element_bytes: usize,
}

/// Fails when the written range `out` overlaps any of the read ranges `inputs`.
fn check_disjoint(what: &str, out: (u64, u64), inputs: &[(u64, u64)]) -> Result<()> {
    let overlaps = |&(start, end): &(u64, u64)| start < out.1 && out.0 < end;
    if inputs.iter().any(overlaps) {
        return Err(Error::Buffer(format!(
            "{what} overlaps one of the launch's input buffers"
        )));
    }
    Ok(())
}

/// The destination table of `layout` for the kernels' `dests` argument: entry
/// `x1 * second_peers + x2` is the DP rank with first-level index `x1` and second-level index
/// `x2`. Upload it once per bucket into a device buffer of `u32`.
pub fn dest_table(layout: &GradLayout) -> Result<Vec<u32>> {
    let peers2 = layout.second_peers();
    (0..layout.first.peers * peers2)
        .map(|i| to_u32("destination rank", layout.dest(i / peers2, i % peers2)))
        .collect()
}

/// `max |x|` from the bits `global_absmax` leaves (`bits & 0x7fffffff`, capped at +Inf's,
/// maximised over the bucket): `+Inf` when a NaN or Inf was present, as
/// `cpu::global_qsgd::local_absmax` returns.
pub fn absmax_from_bits(bits: u32) -> f32 {
    if crate::codec::quant::bits_non_finite(bits) {
        f32::INFINITY
    } else {
        f32::from_bits(bits)
    }
}

impl Kernels {
    /// The specialisation of `kernel` for `constants` with this device's variant for them.
    pub fn spec(&self, kernel: Kernel, constants: Constants) -> Result<KernelSpec> {
        KernelSpec::new(kernel, constants, self.variant(kernel, constants))
    }

    /// Enqueues `spec` with work for `workers` warps (a grouped kernel: its units of groups) or
    /// threads (an element-wise kernel: its steps of runs), the pointer arguments `pointers` and
    /// the parameter struct `params`, after checking them against the kernel's line of the kernel
    /// table: as many pointers, each to elements of the declared size, and the declared struct.
    /// The grid covers the workers, at most the variant's blocks per multiprocessor.
    fn launch<P: AbiParams>(
        &self,
        spec: KernelSpec,
        stream: Stream,
        workers: u64,
        pointers: &[Arg],
        params: &P,
    ) -> Result<()> {
        let kernel = spec.kernel;
        check_args::<P>(kernel, pointers)?;
        if workers == 0 {
            return Ok(());
        }
        if workers > u64::from(u32::MAX) {
            return Err(Error::Buffer(format!(
                "{} over {workers} work units: the kernels index at most 2^32 - 1 (split the bucket)",
                kernel.name()
            )));
        }
        let variant = spec.variant;
        let per_block = match spec.constants {
            Constants::Elementwise { .. } => u64::from(variant.threads),
            _ => u64::from(variant.threads / 32),
        };
        let cap = u64::from(self.multiprocessors()) * u64::from(variant.grid_blocks);
        // At most `cap` (a u32 times 64), so the conversion cannot fail.
        let grid = u32::try_from(workers.div_ceil(per_block).min(cap)).unwrap_or(u32::MAX);
        let function = self.function(&spec)?;
        // The driver reads each argument's value through a pointer to it.
        let mut addrs = [0u64; Kernel::MAX_POINTERS];
        let mut params = *params;
        let mut args = [std::ptr::null_mut::<c_void>(); Kernel::MAX_POINTERS + 1];
        for (i, arg) in pointers.iter().enumerate() {
            addrs[i] = arg.addr;
            args[i] = std::ptr::from_mut(&mut addrs[i]).cast();
        }
        args[pointers.len()] = std::ptr::from_mut(&mut params).cast();
        let args = &mut args[..=pointers.len()];
        self.with_context(|| {
            // SAFETY: the function handle comes from a module loaded in this device's primary
            // context, which is current; `args` points to one value per kernel parameter (the
            // count checked above against the kernel table, from whose line the entry point's
            // parameters are written), of the parameter's size (device pointers as u64, the
            // #[repr(C)] mirror of the parameter struct), alive for the call (the driver copies
            // them); the device buffers are valid per the `DeviceSpan::from_raw` and
            // `Stream::from_raw` contracts and sized by the checks of the caller.
            unsafe {
                driver::launch_kernel(
                    function,
                    (grid, 1, 1),
                    (variant.threads, 1, 1),
                    0,
                    stream.raw(),
                    args,
                )
            }
            .map_err(|e| {
                Error::Cuda(format!(
                    "launch of {spec} on device {} failed: {e}",
                    self.ordinal()
                ))
            })
        })
    }

    /// `grad_quantize_first` (= `cpu::gradient::quantize_first`): Hadamard (when on) +
    /// quantize + swizzle of the whole `bucket` (`numel` fp32, or bf16 with
    /// `grad_quantize_first_bf16`) into `out` (`P * first.peers` first-level slabs, 16-byte
    /// aligned). `dests` is [`dest_table`] of `layout` in device memory.
    pub fn grad_quantize_first<G: GradElement>(
        &self,
        stream: Stream,
        layout: &GradLayout,
        bucket: DeviceSpan<G>,
        dests: DeviceSpan<u32>,
        rng: &UniformStream,
        out: DeviceSpan<u8>,
    ) -> Result<()> {
        let first = layout.first;
        let chunks = layout.bucket.chunks;
        bucket.check("gradient bucket", layout.bucket.numel, 1)?;
        check_dests(layout, &dests)?;
        out.check(
            "first-level send buffer",
            chunks * first.peers * first.slab.byte_len(),
            SLAB_ALIGN,
        )?;
        check_disjoint(
            "first-level send buffer",
            out.range(),
            &[bucket.range(), dests.range()],
        )?;
        let params = SdpGradFirst::new(layout, rng)?;
        let kernel = grad_variant::<G>(Kernel::GradQuantizeFirst, Kernel::GradQuantizeFirstBf16);
        let spec = self.spec(kernel, Constants::first(&params)?)?;
        // The kernel's work units: per chunk, first-level peer and second-level peer, the
        // chunk's Gc groups for that destination in units of the variant's groups.
        let units = u64::from(params.shards.chunks)
            * u64::from(params.peers1)
            * u64::from(params.peers2)
            * u64::from(params.groups_per_chunk).div_ceil(u64::from(spec.variant.units));
        self.launch(
            spec,
            stream,
            units,
            &[bucket.arg(), dests.arg(), out.arg()],
            &params,
        )
    }

    /// `grad_requantize_second` (= `cpu::gradient::requantize_second`) for chunk `chunk`:
    /// dequantize the `first.peers` received slabs of `recv`, sum them in rank order and
    /// requantize into `out` (`second.peers` second-level slabs). `my_x1` is this rank's index
    /// in the first-level communicator; an error when `layout` has one level.
    #[allow(clippy::too_many_arguments)]
    pub fn grad_requantize_second(
        &self,
        stream: Stream,
        layout: &GradLayout,
        my_x1: usize,
        chunk: usize,
        recv: DeviceSpan<u8>,
        dests: DeviceSpan<u32>,
        rng: &UniformStream,
        out: DeviceSpan<u8>,
    ) -> Result<()> {
        let params = SdpGradSecond::new(layout, my_x1, chunk, rng)?;
        let (first, second) = (layout.first, layout.last());
        check_index("first-level index", my_x1, first.peers)?;
        check_index("pipeline chunk", chunk, layout.bucket.chunks)?;
        recv.check(
            "first-level receive buffer",
            first.peers * first.slab.byte_len(),
            SLAB_ALIGN,
        )?;
        check_dests(layout, &dests)?;
        out.check(
            "second-level send buffer",
            second.peers * second.slab.byte_len(),
            SLAB_ALIGN,
        )?;
        check_disjoint(
            "second-level send buffer",
            out.range(),
            &[recv.range(), dests.range()],
        )?;
        let spec = self.spec(Kernel::GradRequantizeSecond, Constants::second(&params)?)?;
        let units = second.peers as u64
            * u64::from(params.groups_per_chunk).div_ceil(u64::from(spec.variant.units));
        self.launch(
            spec,
            stream,
            units,
            &[recv.arg(), dests.arg(), out.arg()],
            &params,
        )
    }

    /// `grad_reduce_final` (= `cpu::gradient::reduce_final`) for chunk `chunk`: dequantize the
    /// slabs received at the last level (`recv`), sum them in rank order, invert the
    /// Hadamard transform and write the real elements of chunk `chunk` of this rank's `shard`
    /// (`S` fp32, or bf16 rounded to nearest even with `grad_reduce_final_bf16`; the other
    /// chunks are left alone).
    pub fn grad_reduce_final<G: GradElement>(
        &self,
        stream: Stream,
        layout: &GradLayout,
        chunk: usize,
        recv: DeviceSpan<u8>,
        shard: DeviceSpan<G>,
    ) -> Result<()> {
        let last = layout.last();
        check_index("pipeline chunk", chunk, layout.bucket.chunks)?;
        recv.check(
            "last-level receive buffer",
            last.peers * last.slab.byte_len(),
            SLAB_ALIGN,
        )?;
        shard.check("gradient shard", layout.bucket.shard_len, 1)?;
        check_disjoint("gradient shard", shard.range(), &[recv.range()])?;
        let params = SdpGradFinal::new(layout, chunk)?;
        let kernel = grad_variant::<G>(Kernel::GradReduceFinal, Kernel::GradReduceFinalBf16);
        let spec = self.spec(kernel, Constants::last(&params)?)?;
        let units = (last.slab.groups as u64).div_ceil(u64::from(spec.variant.units));
        self.launch(spec, stream, units, &[recv.arg(), shard.arg()], &params)
    }

    /// `weight_encode` (= `cpu::weight::encode_shard`): quantizes `new - reference`
    /// (difference) or `new` (direct), computed in fp32 from bf16 and zero-padded, into the
    /// slab `out`. `new` is the shard (`S` elements); `reference` has `S` elements for
    /// [`WeightEncoding::Difference`] and is ignored (any span, empty allowed) for direct
    /// encodings. `first_index` is the padded bucket index of the shard's first element.
    #[allow(clippy::too_many_arguments)]
    pub fn weight_encode(
        &self,
        stream: Stream,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        first_index: u64,
        new: DeviceSpan<bf16>,
        reference: DeviceSpan<bf16>,
        rng: &UniformStream,
        out: DeviceSpan<u8>,
    ) -> Result<()> {
        let shard_len = new.len();
        if shard_len > layout.elements() {
            return Err(Error::Buffer(format!(
                "weight shard of {shard_len} elements does not fit the slab's {} elements",
                layout.elements()
            )));
        }
        new.check("new weight shard", shard_len, 1)?;
        // The second input is filled in for difference encodings; an empty range overlaps nothing.
        let mut inputs = [new.range(), (0, 0)];
        let reference_arg = match encoding {
            WeightEncoding::Difference => {
                reference.check("reference shard", shard_len, 1)?;
                inputs[1] = reference.range();
                reference.arg()
            }
            WeightEncoding::Direct => Arg {
                addr: 0,
                ..reference.arg()
            },
        };
        out.check("weight send buffer", layout.byte_len(), SLAB_ALIGN)?;
        check_disjoint("weight send buffer", out.range(), &inputs)?;
        let params = SdpWeightEncode::new(layout, encoding, shard_len, first_index, rng)?;
        let spec = self.spec(Kernel::WeightEncode, Constants::encode(&params)?)?;
        let units = (layout.groups as u64).div_ceil(u64::from(spec.variant.units));
        self.launch(
            spec,
            stream,
            units,
            &[new.arg(), reference_arg, out.arg()],
            &params,
        )
    }

    /// `weight_apply` (= `cpu::weight::apply_shards`): applies the `W` received slabs
    /// (`recv`, in rank order) to the whole param bucket `params` (`numel` bf16): with
    /// [`WeightEncoding::Difference`] shard `z` becomes `bf16(reference + d')`, the reference
    /// being `own_reference` (`S` elements, this rank's previous shard) for `z == me` and the
    /// current params otherwise; direct encodings set `bf16(x')` (`own_reference` is ignored
    /// and may be empty).
    #[allow(clippy::too_many_arguments)]
    pub fn weight_apply(
        &self,
        stream: Stream,
        layout: &SlabLayout,
        encoding: WeightEncoding,
        plan: &BucketPlan,
        me: usize,
        recv: DeviceSpan<u8>,
        own_reference: DeviceSpan<bf16>,
        params: DeviceSpan<bf16>,
    ) -> Result<()> {
        check_index("rank", me, plan.world)?;
        if plan.shard_len > layout.elements() {
            return Err(Error::Buffer(format!(
                "weight shard of {} elements does not fit the slab's {} elements",
                plan.shard_len,
                layout.elements()
            )));
        }
        recv.check(
            "weight receive buffer",
            plan.world * layout.byte_len(),
            SLAB_ALIGN,
        )?;
        params.check("param bucket", plan.numel, 1)?;
        let mut inputs = [recv.range(), (0, 0)];
        let reference_arg = match encoding {
            WeightEncoding::Difference => {
                own_reference.check("own reference shard", plan.shard_len, 1)?;
                inputs[1] = own_reference.range();
                own_reference.arg()
            }
            WeightEncoding::Direct => Arg {
                addr: 0,
                ..own_reference.arg()
            },
        };
        check_disjoint("param bucket", params.range(), &inputs)?;
        let args = SdpWeightApply::new(layout, encoding, plan, me)?;
        let spec = self.spec(Kernel::WeightApply, Constants::apply(&args)?)?;
        let g = layout.spec.group_size;
        let per_shard = (plan.shard_len.div_ceil(g) as u64).div_ceil(u64::from(spec.variant.units));
        self.launch(
            spec,
            stream,
            plan.world as u64 * per_shard,
            &[recv.arg(), reference_arg, params.arg()],
            &args,
        )
    }

    /// `global_absmax` (= `cpu::global_qsgd::local_absmax`, in bits): zeroes `abs_bits` (one
    /// `u32`) on the stream, then leaves in it the maximum over `bucket` of
    /// `bits & 0x7fffffff` capped at +Inf's bits, which are the bits of the CPU's value (read
    /// as an f32, what a MAX all-reduce maximises); [`absmax_from_bits`] reads it on the host.
    /// A bf16 bucket (`global_absmax_bf16`) is read as fp32.
    pub fn global_absmax<G: GradElement>(
        &self,
        stream: Stream,
        bucket: DeviceSpan<G>,
        abs_bits: DeviceSpan<u32>,
    ) -> Result<()> {
        bucket.check("gradient bucket", bucket.len(), 1)?;
        abs_bits.check("absmax word", 1, 1)?;
        check_disjoint("absmax word", abs_bits.range(), &[bucket.range()])?;
        self.with_context(|| {
            // SAFETY: `abs_bits` is one u32 of device memory (the `DeviceSpan::from_raw`
            // contract), the context is current and `stream` belongs to it.
            unsafe { driver::memset_d8_async(abs_bits.addr, 0, 4, stream.raw()) }
                .map_err(driver_error("cuMemsetD8Async"))
        })?;
        let params = SdpGlobal::absmax(bucket.len());
        let kernel = grad_variant::<G>(Kernel::GlobalAbsmax, Kernel::GlobalAbsmaxBf16);
        let spec = self.spec(kernel, Constants::global(&params)?)?;
        self.launch(
            spec,
            stream,
            elementwise_threads(bucket.len(), spec),
            &[bucket.arg(), abs_bits.arg()],
            &params,
        )
    }

    /// `global_quantize_i8` / `_i16` (= `cpu::global_qsgd::quantize::<T>`):
    /// `out[i] = clamp(R(bucket[i] / scale), -k, k)` with the uniforms of element `i` (a bf16
    /// bucket, `_bf16`, read as fp32).
    #[allow(clippy::too_many_arguments)]
    pub fn global_quantize<G: GradElement, T: IntCode>(
        &self,
        stream: Stream,
        bucket: DeviceSpan<G>,
        scale: f32,
        k: i32,
        rounding: Rounding,
        rng: &UniformStream,
        out: DeviceSpan<T>,
    ) -> Result<()> {
        let params = SdpGlobal::quantize(bucket.len(), scale, k, rounding, rng);
        self.launch_global_quantize(stream, bucket, params, &[], out)
    }

    /// [`global_quantize`](Self::global_quantize) at the scale `s = a / k` of the global
    /// absmax `a` the kernel reads from `absmax` (one f32 of device memory, written by work
    /// ordered before on `stream`), so the host never waits for it: every code is 0 when `a`
    /// is not finite or `s` is 0 (docs/numerics.md §7.2).
    #[allow(clippy::too_many_arguments)]
    pub fn global_quantize_scaled_by<G: GradElement, T: IntCode>(
        &self,
        stream: Stream,
        bucket: DeviceSpan<G>,
        absmax: DeviceSpan<f32>,
        k: i32,
        rounding: Rounding,
        rng: &UniformStream,
        out: DeviceSpan<T>,
    ) -> Result<()> {
        absmax.check("global absmax word", 1, 1)?;
        check_positive_k(k)?;
        let params = SdpGlobal::quantize(bucket.len(), 0.0, k, rounding, rng)
            .scaled_by_absmax_at(absmax.addr(), k);
        self.launch_global_quantize(stream, bucket, params, &[absmax.range()], out)
    }

    fn launch_global_quantize<G: GradElement, T: IntCode>(
        &self,
        stream: Stream,
        bucket: DeviceSpan<G>,
        params: SdpGlobal,
        read: &[(u64, u64)],
        out: DeviceSpan<T>,
    ) -> Result<()> {
        let kernel = match T::BITS {
            8 => grad_variant::<G>(Kernel::GlobalQuantizeI8, Kernel::GlobalQuantizeI8Bf16),
            16 => grad_variant::<G>(Kernel::GlobalQuantizeI16, Kernel::GlobalQuantizeI16Bf16),
            bits => return Err(int_width_error(bits)),
        };
        bucket.check("gradient bucket", bucket.len(), 1)?;
        out.check("integer send buffer", bucket.len(), 1)?;
        let mut inputs = vec![bucket.range()];
        inputs.extend_from_slice(read);
        check_disjoint("integer send buffer", out.range(), &inputs)?;
        let spec = self.spec(kernel, Constants::global(&params)?)?;
        self.launch(
            spec,
            stream,
            elementwise_threads(bucket.len(), spec),
            &[bucket.arg(), out.arg()],
            &params,
        )
    }

    /// `global_dequantize_i8` / `_i16` (= `cpu::global_qsgd::dequantize::<T>`):
    /// `out[i] = f32(sum[i]) * scale` (rounded to bf16 for a bf16 `out`, `_bf16`).
    pub fn global_dequantize<T: IntCode, G: GradElement>(
        &self,
        stream: Stream,
        sum: DeviceSpan<T>,
        scale: f32,
        out: DeviceSpan<G>,
    ) -> Result<()> {
        let params = SdpGlobal::dequantize(sum.len(), scale);
        self.launch_global_dequantize(stream, sum, params, &[], out)
    }

    /// [`global_dequantize`](Self::global_dequantize) at the scale `s = a / k` of the global
    /// absmax `a` the kernel reads from `absmax`: every output is NaN when `a` is not finite
    /// and 0 when `s` is 0 (docs/numerics.md §7.2).
    pub fn global_dequantize_scaled_by<T: IntCode, G: GradElement>(
        &self,
        stream: Stream,
        sum: DeviceSpan<T>,
        absmax: DeviceSpan<f32>,
        k: i32,
        out: DeviceSpan<G>,
    ) -> Result<()> {
        absmax.check("global absmax word", 1, 1)?;
        check_positive_k(k)?;
        let params = SdpGlobal::dequantize(sum.len(), 0.0).scaled_by_absmax_at(absmax.addr(), k);
        self.launch_global_dequantize(stream, sum, params, &[absmax.range()], out)
    }

    /// `global_dequantize_i8` / `_i16` of the sum in rank order of the `world` blocks of
    /// `blocks` (block `r` from rank `r`, each `out.len()` integers), at the scale of the
    /// global absmax in `absmax` (as [`global_dequantize_scaled_by`](Self::global_dequantize_scaled_by)):
    /// the reduce-scatter's sum and the dequantization in one pass. An element whose sum
    /// overflows `T` (checked after each addition, as `collective::sum_in_rank_order` checks)
    /// is NaN, and the first overflow in rank order is recorded in `status` (one u32 the
    /// caller zeroes; [`overflow_from_status`](super::abi::overflow_from_status) reads it).
    #[allow(clippy::too_many_arguments)]
    pub fn global_sum_dequantize<T: IntCode, G: GradElement>(
        &self,
        stream: Stream,
        blocks: DeviceSpan<T>,
        world: usize,
        absmax: DeviceSpan<f32>,
        k: i32,
        status: DeviceSpan<u32>,
        out: DeviceSpan<G>,
    ) -> Result<()> {
        let numel = out.len();
        let total = world.checked_mul(numel).filter(|&n| n < u32::MAX as usize);
        if world == 0 || total.is_none() {
            return Err(Error::Buffer(format!(
                "Global-QSGD sums {world} blocks of {numel} integers: at most 2^32 - 2 in all"
            )));
        }
        blocks.check("integer blocks", world * numel, 1)?;
        absmax.check("global absmax word", 1, 1)?;
        status.check("integer sum status word", 1, 1)?;
        check_positive_k(k)?;
        check_disjoint(
            "integer sum status word",
            status.range(),
            &[blocks.range(), absmax.range()],
        )?;
        let params =
            SdpGlobal::sum_and_dequantize(numel, to_u32("world size", world)?, status.addr())
                .scaled_by_absmax_at(absmax.addr(), k);
        let blocks_start = DeviceSpan::<T>::first(blocks, numel);
        self.launch_global_dequantize(
            stream,
            blocks_start,
            params,
            &[blocks.range(), absmax.range(), status.range()],
            out,
        )
    }

    fn launch_global_dequantize<T: IntCode, G: GradElement>(
        &self,
        stream: Stream,
        sum: DeviceSpan<T>,
        params: SdpGlobal,
        read: &[(u64, u64)],
        out: DeviceSpan<G>,
    ) -> Result<()> {
        let kernel = match T::BITS {
            8 => grad_variant::<G>(Kernel::GlobalDequantizeI8, Kernel::GlobalDequantizeI8Bf16),
            16 => grad_variant::<G>(Kernel::GlobalDequantizeI16, Kernel::GlobalDequantizeI16Bf16),
            bits => return Err(int_width_error(bits)),
        };
        sum.check("integer receive buffer", sum.len(), 1)?;
        out.check("gradient shard", sum.len(), 1)?;
        let mut inputs = vec![sum.range()];
        inputs.extend_from_slice(read);
        check_disjoint("gradient shard", out.range(), &inputs)?;
        let spec = self.spec(kernel, Constants::global(&params)?)?;
        self.launch(
            spec,
            stream,
            elementwise_threads(sum.len(), spec),
            &[sum.arg(), out.arg()],
            &params,
        )
    }
}

impl Kernels {
    /// Compiles (or reads from the cache) and loads the specialisations of `uses` (kernels and
    /// their constants, [`spec::grad_uses`](super::spec::grad_uses) and the like) with this
    /// device's variants: what a bucket's set-up calls, so that no step compiles.
    pub fn prepare_uses(&self, uses: &[(Kernel, Constants)]) -> Result<()> {
        let specs = uses
            .iter()
            .map(|&(kernel, constants)| self.spec(kernel, constants))
            .collect::<Result<Vec<_>>>()?;
        self.prepare(&specs)
    }
}

impl Kernels {
    /// `grad_widen_bf16` / `grad_narrow_bf16` / `grad_round_bf16` (= `Host::convert`):
    /// `dst[i] = D::from_f32(src[i].to_f32())`. Only conversions that involve bf16 have a
    /// kernel; an fp32 copy is a memory copy (an error here).
    pub fn grad_convert<S: GradElement, D: GradElement>(
        &self,
        stream: Stream,
        src: DeviceSpan<S>,
        dst: DeviceSpan<D>,
    ) -> Result<()> {
        let kernel = match (S::IS_BF16, D::IS_BF16) {
            (true, false) => Kernel::GradWidenBf16,
            (false, true) => Kernel::GradNarrowBf16,
            (true, true) => Kernel::GradRoundBf16,
            (false, false) => {
                return Err(Error::Cuda(
                    "no conversion kernel between fp32 buffers: copy them".into(),
                ));
            }
        };
        src.check("conversion source", src.len(), 1)?;
        dst.check("conversion destination", src.len(), 1)?;
        check_disjoint("conversion destination", dst.range(), &[src.range()])?;
        let spec = self.spec(kernel, Constants::convert())?;
        self.launch(
            spec,
            stream,
            elementwise_threads(src.len(), spec),
            &[src.arg(), dst.arg()],
            &SdpConvert {
                numel: src.len() as u64,
            },
        )
    }
}

/// Fails unless `pointers` and a `P` are what the kernel table declares for `kernel`: as many
/// pointers, each to elements of the declared size, and the declared struct.
fn check_args<P: AbiParams>(kernel: Kernel, pointers: &[Arg]) -> Result<()> {
    let declared = kernel.pointers();
    let sizes_agree = pointers
        .iter()
        .zip(declared)
        .all(|(arg, pointer)| arg.element_bytes == pointer.element_bytes);
    if pointers.len() == declared.len() && sizes_agree && P::C_NAME == kernel.params() {
        return Ok(());
    }
    Err(Error::Cuda(format!(
        "launch of {}: the arguments ({pointers:?}, a {}) are not what \
         kernels/sdp4bit_kernels.h declares ({declared:?}, a {})",
        kernel.name(),
        P::C_NAME,
        kernel.params()
    )))
}

/// The threads an element-wise kernel over `numel` elements has work for: its runs of 4, the
/// variant's runs per thread each.
fn elementwise_threads(numel: usize, spec: KernelSpec) -> u64 {
    (numel as u64)
        .div_ceil(4)
        .div_ceil(u64::from(spec.variant.units))
}

/// `fp32` for an fp32 gradient element, `bf16` for a bf16 one: the kernel variant of `G`.
fn grad_variant<G: GradElement>(fp32: Kernel, bf16: Kernel) -> Kernel {
    if G::IS_BF16 { bf16 } else { fp32 }
}

/// Fails unless `k` (Global-QSGD's largest code) is positive.
fn check_positive_k(k: i32) -> Result<()> {
    if k > 0 {
        Ok(())
    } else {
        Err(Error::Plan(format!(
            "Global-QSGD's largest code K must be positive, got {k}"
        )))
    }
}

/// Checks the `dests` table's length against `layout`.
fn check_dests(layout: &GradLayout, dests: &DeviceSpan<u32>) -> Result<()> {
    dests.check(
        "destination table",
        layout.first.peers * layout.second_peers(),
        1,
    )
}

/// Fails unless `index < count`.
fn check_index(what: &str, index: usize, count: usize) -> Result<()> {
    if index < count {
        Ok(())
    } else {
        Err(Error::Buffer(format!(
            "{what} {index} is not below {count}"
        )))
    }
}

/// The error for an integer type no Global-QSGD kernel handles.
fn int_width_error(bits: u8) -> Error {
    Error::Cuda(format!(
        "Global-QSGD kernels exist for 8- and 16-bit integers, not {bits}-bit"
    ))
}

#[cfg(test)]
mod tests {
    use super::{Arg, check_args};
    use crate::backend::cuda::abi::{SdpConvert, SdpGlobal};
    use crate::backend::cuda::source::Kernel;

    /// A launch's arguments are checked against the kernel table: the pointers' count and
    /// element sizes, and the parameter struct.
    #[test]
    fn launch_arguments_follow_the_kernel_table() {
        let arg = |element_bytes| Arg {
            addr: 256,
            element_bytes,
        };
        let widen = Kernel::GradWidenBf16;
        assert!(check_args::<SdpConvert>(widen, &[arg(2), arg(4)]).is_ok());
        let e = check_args::<SdpConvert>(widen, &[arg(4), arg(4)]).unwrap_err();
        assert!(e.to_string().contains("grad_widen_bf16"), "{e}");
        assert!(check_args::<SdpConvert>(widen, &[arg(2)]).is_err());
        assert!(check_args::<SdpConvert>(widen, &[arg(2), arg(4), arg(1)]).is_err());
        assert!(check_args::<SdpGlobal>(widen, &[arg(2), arg(4)]).is_err());
    }
}
