//! GPU benchmark of the fused CUDA kernels against a device-to-device copy, the sweep of their
//! variants, and what compression costs beside a GEMM.
//!
//! Run with `cargo bench --bench gpu` on a host with an NVIDIA GPU, its driver (CUDA 13) and
//! NVRTC on the loader's path (`scripts/test.sh` installs NVRTC into `.cache/`; put its `lib`
//! directory on `LD_LIBRARY_PATH`). Without a driver, NVRTC or a device it prints
//! `skipped: <reason>` and exits 0, unless `SDP4BIT_REQUIRE_GPU=1` turns the skip into a
//! failure. The environment:
//!
//! - `SDP4BIT_BENCH_QUICK=1`: smaller sizes and fewer calls, a smoke run;
//! - `SDP4BIT_BENCH_ONLY=<text>`: only the kernel rows whose label contains the text (the copy
//!   baseline always runs);
//! - `SDP4BIT_BENCH_SECTIONS=a,b`: the sections to run, of `kernels`, `cost`, `concurrent`,
//!   `sweep` and `profile` (below; by default all but `profile`);
//! - `SDP4BIT_BENCH_VARIANTS=ENTRY[:GRID],...`: launch these specialisations (entry names as
//!   `KernelSpec::entry` writes them, with their grid cap in blocks per multiprocessor, 32 when
//!   left out) instead of the production ones: the GPU kit profiles the sweep's choices so;
//! - `SDP4BIT_BENCH_REPORT=PATH`: the report the sweep's `TABLE` lines name (by default
//!   `bench/results/gpu/<date>-<gpu>-sweep.md`);
//! - `SDP4BIT_BENCH_BUCKET_MIB=N`: the bucket size in MiB instead of 256 (16 quick), for smoke
//!   runs on the CUDA driver emulation.
//!
//! Prints markdown: the device, driver, date and command and the device-to-device copy
//! (`cuMemcpyDtoDAsync` of one bucket, counted as read + written, 2x the bytes copied), then the
//! sections. Every kernel row runs with the sizes one rank of W = 4 (2 nodes x 2 ranks for the
//! two-level codecs) sees for a 256 MiB bucket: 64 Mi fp32 gradient elements, 128 Mi bf16
//! parameters. Inputs are generated once on the host and uploaded; received slabs are real
//! encodings made by the CPU backend (the reference), so the decoding kernels see valid scales.
//! Kernels whose traffic per call is below a few L2 caches cycle through several device copies
//! of their buffers (filled by device-to-device copies), so every row measures DRAM traffic like
//! the copy it is compared with. Times are CUDA events around each call, on one stream kept busy
//! so launch latency is hidden.
//!
//! - `kernels`: one row per kernel with the bytes it reads and writes per call, the median and
//!   fastest time over the timed calls, the achieved bandwidth `(bytes read + bytes written) /
//!   median time`, its ratio to the copy, and issue 42's target for the kernel ([`TARGETS`]).
//! - `cost`: the whole sequence of compression kernels one rank runs per step for a bucket of
//!   64 Mi and 256 Mi elements (sdp4bit preset, fp32 and bf16 gradients; qWD on bf16 params of
//!   the same count), against the time its bytes take at the copy's bandwidth
//!   ([`SEQUENCE_TARGET`]), and as a `cost-json:` line that `bench/gpu_cost.py` puts against a
//!   GEMM step of a GPT layer of that size.
//! - `concurrent`: the GEMM step of that GPT layer (its 12 bf16 products at 8192 tokens, through
//!   cuBLAS loaded at run time) on a compute stream, beside the 64 Mi bucket's compression
//!   sequence on sdp4bit's side stream (`new_priority_stream`), each alone and both together,
//!   timed with CUDA events: the GEMM's slowdown is what a user pays, since the kernels share the
//!   multiprocessors. A `concurrent-json:` line; without cuBLAS the section says so and goes on.
//! - `sweep`: for each row, every candidate variant of its kernel and constants
//!   (`variants::candidates`): run once on garbage-filled outputs and byte-compared with the
//!   production variant's output (any difference fails the run, naming the row and the
//!   variant), then timed in two passes; per row a table and the fastest variant against the
//!   production one and the target, then the lines of `variants::TABLE` to commit and a
//!   `sweep-json:` line.
//! - `profile`: each row's kernel launched once with the variant it runs with here, for `ncu`
//!   (the kit's `ncu` stage), and a `profile-json:` line naming each launch's entry point.
//!
//! Peer kernels (bitsandbytes' blockwise 4-bit quantization, DeepSpeed's quantizer) are
//! Python/torch libraries and are not run here: the torch extension's Python benchmark times
//! them side by side with these kernels.

use std::error::Error;
use std::ffi::{c_int, c_void};
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytemuck::Pod;
use cudarc::cublas::{CudaBlas, result as cublas, sys as cublas_sys};
use cudarc::driver::sys::{self, CUdevice_attribute, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError,
    ValidAsZeroBits,
};
use half::bf16;
use rayon::prelude::*;

use sdp4bit::backend::GradElement;
use sdp4bit::backend::cpu::{global_qsgd, gradient, weight};
use sdp4bit::backend::cuda::abi::{
    SdpGlobal, SdpGradFinal, SdpGradFirst, SdpGradSecond, SdpWeightApply, SdpWeightEncode,
};
use sdp4bit::backend::cuda::compile::Arch;
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::backend::cuda::variants::candidates;
use sdp4bit::backend::cuda::{
    Constants, DeviceSpan, KernelSpec, Kernels, Stream, dest_table, device_count,
    new_priority_stream, probe,
};
use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::collective::global_k;
use sdp4bit::layout::{BucketPlan, GradLayout, GradRoute, Topology};
use sdp4bit::rng::UniformStream;
use sdp4bit::{Config, Preset, Rounding};

use sdp4bit_test_support::host_kernels::install_emulation_builder;

mod common;
use common::{gradients, params, updated, utc_now};

const MIB: usize = 1 << 20;
/// DP ranks of the simulated job (2 nodes x 2 ranks).
const WORLD: usize = 4;
/// A kernel's buffers are copied until the bytes touched between two uses of the same copy
/// reach this many L2 caches.
const ROTATE_L2_MULTIPLE: usize = 4;

/// The oldest driver (`cuDriverGetVersion`) with every symbol cudarc's CUDA 13 bindings call
/// here: `cuEventElapsedTime_v2` arrived in CUDA 12.8. Older drivers would make cudarc panic.
const MIN_DRIVER_VERSION: i32 = 12080;

/// Issue 42's targets (item 6): each kernel's bandwidth as a fraction of the copy's in the same
/// run, by kernel. 0.75x for the fp32 gradient path (quantizing the fp32 bucket, decoding into
/// the fp32 shard; QSDP's and ZeRO++'s rows run the same kernels), 0.5x for the bf16 path,
/// qWD's encoding (bf16 input) and the 8-to-4-bit requantization, 0.85x for `weight_apply` and
/// Global-QSGD's kernels. `sdp4bit/kernel_times.py` (`TARGETS`) holds the same figures for the
/// cost model; `tests/python/test_gpu_kit.py` checks that the two agree.
const TARGETS: [(&str, f64); 10] = [
    ("grad_quantize_first", 0.75),
    ("grad_reduce_final", 0.75),
    ("grad_quantize_first_bf16", 0.5),
    ("grad_reduce_final_bf16", 0.5),
    ("weight_encode", 0.5),
    ("grad_requantize_second", 0.5),
    ("weight_apply", 0.85),
    ("global_absmax", 0.85),
    ("global_quantize_i8", 0.85),
    ("global_dequantize_i8", 0.85),
];

/// Issue 42's target for one rank's whole per-bucket sequence: within this multiple of the
/// time its bytes (every kernel's reads and writes) take at the copy's bandwidth.
const SEQUENCE_TARGET: f64 = 1.5;

/// The sections, in the order they run.
const SECTIONS: [&str; 5] = ["kernels", "cost", "concurrent", "sweep", "profile"];
/// The sections a run without `SDP4BIT_BENCH_SECTIONS` runs: `profile` only makes sense under
/// a profiler.
const DEFAULT_SECTIONS: [&str; 4] = ["kernels", "cost", "concurrent", "sweep"];

/// Errors of the benchmark: driver calls, launches, plans, a variant that computes other bytes.
type BenchResult<T> = Result<T, Box<dyn Error>>;

/// Issue 42's target for `kernel` (a fraction of the copy's bandwidth).
fn target(kernel: Kernel) -> BenchResult<f64> {
    TARGETS
        .iter()
        .find(|(name, _)| *name == kernel.name())
        .map(|&(_, fraction)| fraction)
        .ok_or_else(|| format!("issue 42 sets no target for {}", kernel.name()).into())
}

// ---------------------------------------------------------------------------------------------
// Options.

/// Sizes and repetitions of one run.
#[derive(Debug, Clone)]
struct Opts {
    /// Bytes of the fp32 gradient bucket, of the bf16 param bucket and of the copy baseline.
    bucket_bytes: usize,
    /// Untimed warm-up per row (clocks, TLBs): rounds of one call per buffer copy until this
    /// much time has passed, at least one round.
    warmup: Duration,
    /// Timed calls; the median is reported.
    iters: usize,
    /// `SDP4BIT_BENCH_QUICK` is set.
    quick: bool,
    /// `SDP4BIT_BENCH_ONLY`: run only the kernel rows whose label contains this text.
    only: String,
    /// `SDP4BIT_BENCH_SECTIONS` as given (empty: the default sections).
    sections_env: String,
    /// The sections to run.
    sections: Vec<&'static str>,
    /// `SDP4BIT_BENCH_VARIANTS`: the specialisations to launch instead of the production ones.
    variants: String,
    /// `SDP4BIT_BENCH_REPORT`: the report the sweep's table lines name.
    report: String,
    /// `SDP4BIT_BENCH_BUCKET_MIB` as given.
    bucket_env: String,
}

impl Opts {
    /// The full run, or the quick smoke run when `SDP4BIT_BENCH_QUICK` is set to a non-empty,
    /// non-`0` value; an error for an unknown section or a bad bucket size.
    fn from_env() -> BenchResult<Self> {
        let var = |name| std::env::var(name).unwrap_or_default();
        let quick = std::env::var("SDP4BIT_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        let sections_env = var("SDP4BIT_BENCH_SECTIONS");
        let wanted: Vec<&str> = sections_env
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if let Some(bad) = wanted.iter().find(|s| !SECTIONS.contains(s)) {
            return Err(format!(
                "SDP4BIT_BENCH_SECTIONS names {bad:?}; the sections are {}",
                SECTIONS.join(", ")
            )
            .into());
        }
        let sections = SECTIONS
            .into_iter()
            .filter(|s| {
                if wanted.is_empty() {
                    DEFAULT_SECTIONS.contains(s)
                } else {
                    wanted.contains(s)
                }
            })
            .collect();
        let bucket_env = var("SDP4BIT_BENCH_BUCKET_MIB");
        let bucket_bytes = match bucket_env.trim() {
            "" if quick => 16 * MIB,
            "" => 256 * MIB,
            mib => match mib.parse::<usize>() {
                Ok(n) if n >= 1 => n * MIB,
                _ => {
                    return Err(format!(
                        "SDP4BIT_BENCH_BUCKET_MIB={mib:?}: a whole number of MiB, at least 1"
                    )
                    .into());
                }
            },
        };
        Ok(Self {
            bucket_bytes,
            warmup: if quick {
                Duration::ZERO
            } else {
                Duration::from_millis(500)
            },
            iters: if quick { 5 } else { 51 },
            quick,
            only: var("SDP4BIT_BENCH_ONLY"),
            sections_env,
            sections,
            variants: var("SDP4BIT_BENCH_VARIANTS"),
            report: var("SDP4BIT_BENCH_REPORT"),
            bucket_env,
        })
    }

    /// fp32 gradient elements of the bucket.
    fn grad_numel(&self) -> usize {
        self.bucket_bytes / 4
    }

    /// bf16 parameter elements of the bucket.
    fn param_numel(&self) -> usize {
        self.bucket_bytes / 2
    }

    /// Whether the row labelled `name` runs.
    fn selects(&self, name: &str) -> bool {
        name.contains(self.only.as_str())
    }

    /// Whether the section `name` runs.
    fn runs(&self, name: &str) -> bool {
        self.sections.contains(&name)
    }
}

// ---------------------------------------------------------------------------------------------
// The device.

/// Why this host cannot run the benchmark (no driver, no NVRTC, no device), or `None`.
fn skip_reason() -> Option<String> {
    match device_count().and_then(|n| probe::nvrtc().map(|()| n)) {
        Err(e) => Some(e.to_string()),
        Ok(0) => Some("the CUDA driver sees no device".into()),
        Ok(_) => None,
    }
}

/// What the header reports about the device.
#[derive(Debug, Clone)]
struct DeviceInfo {
    /// `cuDeviceGetName`.
    name: String,
    /// Compute capability (major, minor).
    capability: (i32, i32),
    /// `cuDriverGetVersion`: 1000 * major + 10 * minor.
    driver_version: i32,
    /// Streaming multiprocessors.
    multiprocessors: i32,
    /// Bytes of L2 cache.
    l2_bytes: usize,
    /// Bytes of device memory.
    memory_bytes: usize,
}

impl DeviceInfo {
    /// Queries the device of `context`.
    fn query(context: &Arc<CudaContext>) -> BenchResult<Self> {
        let attribute = |a| context.attribute(a);
        let mut driver_version = 0;
        // SAFETY: `cuDriverGetVersion` writes one int through the pointer; the driver library
        // is loaded (the probe found it and cudarc initialised it).
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result()?;
        Ok(Self {
            name: context.name()?,
            capability: context.compute_capability()?,
            driver_version,
            multiprocessors: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )?,
            l2_bytes: usize::try_from(attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
            )?)
            .unwrap_or(0),
            memory_bytes: context.total_mem()?,
        })
    }
}

/// The kernels of device 0, a cudarc context and stream on its primary context, and what the
/// header reports.
struct Gpu {
    kernels: &'static Kernels,
    context: Arc<CudaContext>,
    /// The legacy default stream of the primary context: one in-order stream on which every
    /// section but `concurrent` runs, so nothing but the benchmark's own work runs between the
    /// timing events.
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    /// Seconds taken to open the kernels (the device probed, NVRTC checked; kernels compile at
    /// first use).
    compile_secs: f64,
}

impl Gpu {
    /// Opens the kernels of device 0 and a stream there.
    fn open() -> BenchResult<Self> {
        // Where the driver is the emulated one (tests/cuda_driver_emulation: a smoke run of
        // this benchmark without a GPU), it needs the builder of the kernels' host builds;
        // nothing happens on a real driver.
        install_emulation_builder();
        let start = Instant::now();
        let kernels = Kernels::get(0)?;
        let compile_secs = start.elapsed().as_secs_f64();
        let context = CudaContext::new(0)?;
        // SAFETY: the benchmark orders its streams itself: buffers are made and filled on the
        // legacy default stream, which is synchronised before another stream uses them, and the
        // `concurrent` section synchronises the context before its buffers are dropped. cudarc's
        // own events (made once a second stream exists) would add waits between the streams
        // timed there.
        unsafe { context.disable_event_tracking() };
        let stream = context.default_stream();
        let info = DeviceInfo::query(&context)?;
        if info.driver_version < MIN_DRIVER_VERSION {
            return Err(format!(
                "the CUDA driver reports version {}; the timing events need {MIN_DRIVER_VERSION} \
                 or newer (cuEventElapsedTime_v2, which cudarc calls for CUDA 13)",
                info.driver_version
            )
            .into());
        }
        Ok(Self {
            kernels,
            context,
            stream,
            info,
            compile_secs,
        })
    }

    /// The stream as the backend takes it.
    fn stream(&self) -> Stream {
        // SAFETY: the legacy default stream (handle 0) of device 0's primary context, in which
        // the kernels are loaded.
        unsafe { Stream::from_raw(self.stream.cu_stream() as usize) }
    }

    /// `copies` device buffers holding `host`: uploaded once, then copied device to device.
    fn replicate<T: DeviceRepr>(
        &self,
        host: &[T],
        copies: usize,
    ) -> BenchResult<Vec<CudaSlice<T>>> {
        let first = self.stream.clone_htod(host)?;
        let mut all = Vec::with_capacity(copies.max(1));
        for _ in 1..copies {
            all.push(self.stream.clone_dtod(&first)?);
        }
        all.push(first);
        Ok(all)
    }

    /// `copies` zeroed device buffers of `len` elements.
    fn zeroed<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        copies: usize,
    ) -> BenchResult<Vec<CudaSlice<T>>> {
        (0..copies.max(1))
            .map(|_| Ok(self.stream.alloc_zeros(len)?))
            .collect()
    }

    /// A span over each of `buffers`.
    fn spans<T>(&self, buffers: &[CudaSlice<T>]) -> Vec<DeviceSpan<T>> {
        buffers
            .iter()
            .map(|buffer| {
                let (addr, _record) = buffer.device_ptr(&self.stream);
                // SAFETY: `addr` is a live allocation of `buffer.len()` elements of `T` on
                // device 0. Every row keeps its buffers alive until the stream its launches run
                // on is synchronised, and no other work writes them.
                unsafe { DeviceSpan::from_raw(addr, buffer.len()) }
            })
            .collect()
    }

    /// A span over each of `buffers` (bf16 bit patterns), as bf16.
    fn bf16_spans(&self, buffers: &[CudaSlice<u16>]) -> Vec<DeviceSpan<bf16>> {
        self.spans(buffers)
            .into_iter()
            // SAFETY: as for `spans`; bf16 and u16 have the same size and alignment.
            .map(|span| unsafe { DeviceSpan::from_raw(span.addr(), span.len()) })
            .collect()
    }

    /// A span of `T` over each of `buffers` (the bytes of whole elements).
    fn typed_spans<T>(&self, buffers: &[CudaSlice<u8>]) -> Vec<DeviceSpan<T>> {
        self.spans(buffers)
            .into_iter()
            // SAFETY: as for `spans`; the buffers were filled (or zeroed) as elements of `T`
            // and cudarc's allocations are aligned for any element type.
            .map(|span| unsafe { DeviceSpan::from_raw(span.addr(), span.len() / size_of::<T>()) })
            .collect()
    }

    /// How many copies of its buffers a kernel moving `traffic` bytes per call cycles
    /// through, so that `ROTATE_L2_MULTIPLE` L2 caches' worth of other data passes between
    /// two uses of the same copy.
    fn copies(&self, traffic: usize) -> usize {
        (ROTATE_L2_MULTIPLE * self.info.l2_bytes)
            .div_ceil(traffic.max(1))
            .max(1)
    }

    /// Enqueues setting the `bytes` bytes at `addr` to `byte`.
    fn fill(&self, region: Region, byte: u8) -> BenchResult<()> {
        self.context.bind_to_thread()?;
        // SAFETY: `region` is device memory of a live buffer of the row being measured (its
        // spans' contract), on the context made current above.
        unsafe { sys::cuMemsetD8Async(region.addr, byte, region.bytes, self.stream.cu_stream()) }
            .result()?;
        Ok(())
    }

    /// Enqueues a device-to-device copy of `bytes` bytes from `src` to `dst`.
    fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> BenchResult<()> {
        self.context.bind_to_thread()?;
        // SAFETY: both ranges are live device buffers of the row being measured, disjoint, on
        // the context made current above.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.cu_stream()) }.result()?;
        Ok(())
    }

    /// The bytes of `region`, once the stream has reached this point.
    fn download(&self, region: Region) -> BenchResult<Vec<u8>> {
        let mut host = vec![0u8; region.bytes];
        self.context.bind_to_thread()?;
        self.stream.synchronize()?;
        // SAFETY: `host` holds `region.bytes` bytes; the device range is a live buffer of the
        // row being measured; the synchronous copy completes before the call returns.
        unsafe {
            sys::cuMemcpyDtoH_v2(
                host.as_mut_ptr().cast::<c_void>(),
                region.addr,
                region.bytes,
            )
        }
        .result()?;
        Ok(host)
    }
}

/// Makes the kernels launch the specialisations `SDP4BIT_BENCH_VARIANTS` names; returns them.
fn apply_variants(gpu: &Gpu, opts: &Opts) -> BenchResult<Vec<KernelSpec>> {
    let mut set = Vec::new();
    for item in opts
        .variants
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let (entry, grid) = item.split_once(':').unwrap_or((item, ""));
        let mut spec = KernelSpec::from_entry(entry).ok_or_else(|| {
            format!("SDP4BIT_BENCH_VARIANTS names {entry:?}, which no specialisation spells")
        })?;
        if !grid.is_empty() {
            spec.variant.grid_blocks = grid.parse().map_err(|_| {
                format!("SDP4BIT_BENCH_VARIANTS: {item:?} has no whole grid cap after ':'")
            })?;
        }
        gpu.kernels
            .set_variant(spec.kernel, spec.constants, spec.variant)?;
        set.push(spec);
    }
    Ok(set)
}

// ---------------------------------------------------------------------------------------------
// Timing.

/// Enqueues `n` calls `launch(call)`, `launch(call + 1)`, ..., advancing `call`.
fn enqueue(
    launch: &mut impl FnMut(usize) -> BenchResult<()>,
    call: &mut usize,
    n: usize,
) -> BenchResult<()> {
    for _ in 0..n {
        launch(*call)?;
        *call += 1;
    }
    Ok(())
}

/// The timed calls of one measurement, in milliseconds.
#[derive(Debug, Clone)]
struct Timing {
    median_ms: f64,
    min_ms: f64,
    /// Every timed call, sorted.
    samples: Vec<f64>,
}

impl Timing {
    /// The median and minimum of `samples`.
    fn of(mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        Self {
            median_ms: median(&samples),
            min_ms: samples.first().copied().unwrap_or(f64::NAN),
            samples,
        }
    }
}

/// The median of sorted `values` (the mean of the middle two for an even count).
fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Warms up with rounds of `copies` untimed calls of `launch(i)` (waiting after each) for
/// `opts.warmup`, queues one more untimed round, then `iters` calls each between two CUDA
/// events, all enqueued back to back before waiting, so the stream never idles and launch
/// latency stays out of the events' interval. `i` counts calls from 0, so `launch` can pick
/// buffer copy `i % copies`.
fn time_calls(
    gpu: &Gpu,
    opts: &Opts,
    copies: usize,
    mut launch: impl FnMut(usize) -> BenchResult<()>,
) -> BenchResult<Timing> {
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let events = (0..opts.iters)
        .map(|_| Ok((gpu.context.new_event(timed)?, gpu.context.new_event(timed)?)))
        .collect::<Result<Vec<_>, DriverError>>()?;
    let mut call = 0;
    let warmup = Instant::now();
    loop {
        enqueue(&mut launch, &mut call, copies)?;
        gpu.stream.synchronize()?;
        if warmup.elapsed() >= opts.warmup {
            break;
        }
    }
    // Queued ahead, so the first timed call does not start on an idle stream.
    enqueue(&mut launch, &mut call, copies)?;
    for (start, end) in &events {
        start.record(&gpu.stream)?;
        enqueue(&mut launch, &mut call, 1)?;
        end.record(&gpu.stream)?;
    }
    gpu.stream.synchronize()?;
    gpu.context.check_err()?;
    let ms = events
        .iter()
        .map(|(start, end)| start.elapsed_ms(end).map(f64::from))
        .collect::<Result<Vec<_>, DriverError>>()?;
    Ok(Timing::of(ms))
}

// ---------------------------------------------------------------------------------------------
// Host data.

/// The bit patterns of `values`, as the device buffers hold them.
fn bits(values: &[bf16]) -> Vec<u16> {
    values.par_iter().map(|v| v.to_bits()).collect()
}

// ---------------------------------------------------------------------------------------------
// Plans.

/// The gradient layout of `config` on 2 nodes x 2 ranks for a bucket of `numel` fp32.
fn grad_layout(config: &Config, numel: usize) -> BenchResult<GradLayout> {
    let topology = Topology::uniform(2, 2)?;
    let route = GradRoute::new(config, &topology);
    let plan = BucketPlan::new(numel, topology.world(), config)?;
    GradLayout::new(config, &topology, &route, plan).ok_or_else(|| "W = 4 has an exchange".into())
}

/// Bytes of the first-level send buffer (all chunks) of `layout`.
fn first_send_len(layout: &GradLayout) -> usize {
    layout.bucket.chunks * layout.first.peers * layout.first.slab.byte_len()
}

/// The first-level send buffer the CPU backend writes for one bucket of random gradients.
/// With one pipeline chunk (the kernel rows' configs) it is also a valid first-level receive
/// buffer (`first.peers` slabs of the same layout).
fn cpu_first_send(layout: &GradLayout, seed: u64) -> Vec<u8> {
    let bucket = gradients(layout.bucket.numel, seed);
    let mut send = vec![0u8; first_send_len(layout)];
    gradient::quantize_first(layout, &bucket, &UniformStream::new(1, 1, 2), &mut send);
    send
}

/// The slabs rank 0 receives at the last level: the CPU's requantization of a first-level
/// receive buffer (two levels), or a first-level receive buffer (one level).
fn cpu_last_recv(layout: &GradLayout, seed: u64) -> BenchResult<Vec<u8>> {
    let first = cpu_first_send(layout, seed);
    let Some(second) = layout.second else {
        return Ok(first);
    };
    let mut out = vec![0u8; second.peers * second.slab.byte_len()];
    gradient::requantize_second(layout, 0, 0, &first, &UniformStream::new(1, 1, 3), &mut out)?;
    Ok(out)
}

/// The weight slab layout and bucket plan of `config` for a bf16 bucket of `numel`.
fn weight_layout(config: &Config, numel: usize) -> BenchResult<(SlabLayout, BucketPlan)> {
    let plan = BucketPlan::new(numel, WORLD, config)?;
    let spec = QuantSpec::of_weights(&config.weight).ok_or("the weight codec quantizes")?;
    let layout = SlabLayout {
        spec,
        groups: plan.padded_shard_len / spec.group_size,
    };
    Ok((layout, plan))
}

// ---------------------------------------------------------------------------------------------
// Rows.

/// Device memory a row's call writes, as the sweep's byte compare reads it back: filled with
/// garbage before the compared call, or, where the call also reads it (in place), restored from
/// a pristine copy.
#[derive(Debug, Clone, Copy)]
struct Region {
    addr: u64,
    bytes: usize,
    /// The address of a pristine copy of the region's input, for an in-place call.
    pristine: Option<u64>,
}

impl Region {
    /// The bytes of `span`, an output only.
    fn of<T>(span: DeviceSpan<T>) -> Self {
        Self {
            addr: span.addr(),
            bytes: span.len() * size_of::<T>(),
            pristine: None,
        }
    }

    /// The bytes of `span`, updated in place from what `pristine` holds.
    fn in_place<T>(span: DeviceSpan<T>, pristine: DeviceSpan<T>) -> Self {
        Self {
            pristine: Some(pristine.addr()),
            ..Self::of(span)
        }
    }
}

/// One kernel row's call, ready to launch: what every section needs of it.
struct Site<'a> {
    /// The kernel the call launches and the constants of its launch (its specialisation is
    /// these with the variant `Kernels::variant` gives).
    kernel: Kernel,
    constants: Constants,
    /// Bytes read and written per call.
    read: usize,
    written: usize,
    /// Elements the call processes (of the bucket, the shard or the slabs it writes).
    elements: usize,
    /// Copies of its buffers the calls rotate through.
    copies: usize,
    /// What the call on copy 0 writes.
    outputs: Vec<Region>,
    /// Enqueues call `i`, on copy `i % copies`, on the benchmark's stream.
    launch: &'a mut dyn FnMut(usize) -> BenchResult<()>,
}

/// What a section does with a row's call (once per row).
type Visit<'v> = &'v mut dyn FnMut(Site<'_>) -> BenchResult<()>;

/// One row of the kernel table.
struct Row {
    name: String,
    /// Bytes read per call.
    read: usize,
    /// Bytes written per call.
    written: usize,
    time: Timing,
}

impl Row {
    /// Bytes read plus bytes written per second at the median time, in GB/s (1e9).
    fn gbps(&self) -> f64 {
        (self.read + self.written) as f64 / (self.time.median_ms * 1e-3) / 1e9
    }
}

/// The baseline: `cuMemcpyDtoDAsync` of one bucket (read + written = 2x the bytes copied).
fn copy_row(gpu: &Gpu, opts: &Opts) -> BenchResult<Row> {
    let n = opts.bucket_bytes / 4;
    let copies = gpu.copies(2 * opts.bucket_bytes);
    let src = gpu.replicate(&gradients(n, 1), copies)?;
    let mut dst = gpu.zeroed::<f32>(n, copies)?;
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        Ok(gpu.stream.memcpy_dtod(&src[c], &mut dst[c])?)
    })?;
    Ok(Row {
        name: format!(
            "baseline: device-to-device copy of {} MiB (`cuMemcpyDtoDAsync`)",
            opts.bucket_bytes / MIB
        ),
        read: opts.bucket_bytes,
        written: opts.bucket_bytes,
        time,
    })
}

/// `values` as `G` in device memory, `copies` times (the bytes of the elements).
fn grad_buffers<G: GradElement + Pod>(
    gpu: &Gpu,
    values: &[f32],
    copies: usize,
) -> BenchResult<Vec<CudaSlice<u8>>> {
    let typed: Vec<G> = values.par_iter().map(|&v| G::from_f32(v)).collect();
    gpu.replicate(bytemuck::cast_slice::<G, u8>(&typed), copies)
}

/// `copies` zeroed device buffers of `len` elements of `G` (as bytes).
fn grad_zeroed<G: GradElement>(
    gpu: &Gpu,
    len: usize,
    copies: usize,
) -> BenchResult<Vec<CudaSlice<u8>>> {
    gpu.zeroed::<u8>(len * size_of::<G>(), copies)
}

/// `fp32` for an fp32 gradient element, `bf16` for a bf16 one: the kernel of `G`.
fn grad_kernel<G: GradElement>(fp32: Kernel, bf16: Kernel) -> Kernel {
    if G::IS_BF16 { bf16 } else { fp32 }
}

/// `grad_quantize_first` of the whole bucket of `G`: reads the bucket, writes every slab.
fn grad_first_row<G: GradElement + Pod>(
    gpu: &Gpu,
    opts: &Opts,
    config: &Config,
    visit: Visit<'_>,
) -> BenchResult<()> {
    let layout = grad_layout(config, opts.grad_numel())?;
    let (read, written) = (
        layout.bucket.numel * size_of::<G>(),
        first_send_len(&layout),
    );
    let copies = gpu.copies(read + written);
    let buckets = grad_buffers::<G>(gpu, &gradients(layout.bucket.numel, 10), copies)?;
    let outs = gpu.zeroed::<u8>(written, copies)?;
    let dests = gpu.replicate(&dest_table(&layout)?, 1)?;
    let bucket = gpu.typed_spans::<G>(&buckets);
    let (out, dests) = (gpu.spans(&outs), gpu.spans(&dests)[0]);
    let rng = UniformStream::new(1, 1, 1);
    let constants = Constants::first(&SdpGradFirst::new(&layout, &rng)?)?;
    let mut launch = |i: usize| -> BenchResult<()> {
        let c = i % copies;
        let (k, s) = (gpu.kernels, gpu.stream());
        Ok(k.grad_quantize_first(s, &layout, bucket[c], dests, &rng, out[c])?)
    };
    visit(Site {
        kernel: grad_kernel::<G>(Kernel::GradQuantizeFirst, Kernel::GradQuantizeFirstBf16),
        constants,
        read,
        written,
        elements: layout.bucket.numel,
        copies,
        outputs: vec![Region::of(out[0])],
        launch: &mut launch,
    })
}

/// `grad_requantize_second` of chunk 0 on rank 0: reads the `D` first-level slabs, writes the
/// `M` second-level slabs.
fn grad_second_row(gpu: &Gpu, opts: &Opts, config: &Config, visit: Visit<'_>) -> BenchResult<()> {
    let layout = grad_layout(config, opts.grad_numel())?;
    let second = layout.second.ok_or("a two-level layout")?;
    let recv_host = cpu_first_send(&layout, 20);
    let (read, written) = (recv_host.len(), second.peers * second.slab.byte_len());
    let copies = gpu.copies(read + written);
    let recvs = gpu.replicate(&recv_host, copies)?;
    let outs = gpu.zeroed::<u8>(written, copies)?;
    let dests = gpu.replicate(&dest_table(&layout)?, 1)?;
    let (recv, out, dests) = (gpu.spans(&recvs), gpu.spans(&outs), gpu.spans(&dests)[0]);
    let rng = UniformStream::new(1, 1, 4);
    let constants = Constants::second(&SdpGradSecond::new(&layout, 0, 0, &rng)?)?;
    let mut launch = |i: usize| -> BenchResult<()> {
        let c = i % copies;
        let (k, s) = (gpu.kernels, gpu.stream());
        Ok(k.grad_requantize_second(s, &layout, 0, 0, recv[c], dests, &rng, out[c])?)
    };
    visit(Site {
        kernel: Kernel::GradRequantizeSecond,
        constants,
        read,
        written,
        elements: second.peers * second.slab.elements(),
        copies,
        outputs: vec![Region::of(out[0])],
        launch: &mut launch,
    })
}

/// `grad_reduce_final` of chunk 0 on rank 0: reads the last level's slabs, writes the shard
/// of `G`.
fn grad_final_row<G: GradElement>(
    gpu: &Gpu,
    opts: &Opts,
    config: &Config,
    visit: Visit<'_>,
) -> BenchResult<()> {
    let layout = grad_layout(config, opts.grad_numel())?;
    let recv_host = cpu_last_recv(&layout, 30)?;
    let shard_len = layout.bucket.shard_len;
    let (read, written) = (recv_host.len(), shard_len * size_of::<G>());
    let copies = gpu.copies(read + written);
    let recvs = gpu.replicate(&recv_host, copies)?;
    let shards = grad_zeroed::<G>(gpu, shard_len, copies)?;
    let (recv, shard) = (gpu.spans(&recvs), gpu.typed_spans::<G>(&shards));
    let constants = Constants::last(&SdpGradFinal::new(&layout, 0)?)?;
    let mut launch = |i: usize| -> BenchResult<()> {
        let c = i % copies;
        let (k, s) = (gpu.kernels, gpu.stream());
        Ok(k.grad_reduce_final(s, &layout, 0, recv[c], shard[c])?)
    };
    visit(Site {
        kernel: grad_kernel::<G>(Kernel::GradReduceFinal, Kernel::GradReduceFinalBf16),
        constants,
        read,
        written,
        elements: shard_len,
        copies,
        outputs: vec![Region::of(shard[0])],
        launch: &mut launch,
    })
}

/// `weight_encode` (qWD difference) of rank 0's shard: reads the new and the previous bf16
/// shard, writes one slab.
fn weight_encode_row(gpu: &Gpu, opts: &Opts, config: &Config, visit: Visit<'_>) -> BenchResult<()> {
    let (layout, plan) = weight_layout(config, opts.param_numel())?;
    let s = plan.shard_len;
    let (read, written) = (4 * s, layout.byte_len());
    let copies = gpu.copies(read + written);
    let reference_host = params(s, 40);
    let news = gpu.replicate(&bits(&updated(&reference_host, 50)), copies)?;
    let references = gpu.replicate(&bits(&reference_host), copies)?;
    let outs = gpu.zeroed::<u8>(written, copies)?;
    let (new, reference) = (gpu.bf16_spans(&news), gpu.bf16_spans(&references));
    let out = gpu.spans(&outs);
    let (rng, first_index) = (UniformStream::new(1, 1, 5), plan.padded_index(0, 0));
    let enc = WeightEncoding::Difference;
    let constants = Constants::encode(&SdpWeightEncode::new(&layout, enc, s, first_index, &rng)?)?;
    let mut launch = |i: usize| -> BenchResult<()> {
        let c = i % copies;
        let (k, st) = (gpu.kernels, gpu.stream());
        let (n, r) = (new[c], reference[c]);
        Ok(k.weight_encode(st, &layout, enc, first_index, n, r, &rng, out[c])?)
    };
    visit(Site {
        kernel: Kernel::WeightEncode,
        constants,
        read,
        written,
        elements: s,
        copies,
        outputs: vec![Region::of(out[0])],
        launch: &mut launch,
    })
}

/// `weight_apply` (qWD difference) of all W slabs into the bf16 bucket on rank 0: reads the
/// slabs, the own previous shard and the other shards' params, writes the whole bucket (in
/// place: the sweep's byte compare restores it from a pristine copy first).
fn weight_apply_row(gpu: &Gpu, opts: &Opts, config: &Config, visit: Visit<'_>) -> BenchResult<()> {
    let (layout, plan) = weight_layout(config, opts.param_numel())?;
    let (numel, s) = (plan.numel, plan.shard_len);
    let old = params(numel, 60);
    // One real encoding (shard 0's update), received from every rank: any valid slab of the
    // layout decodes at the same speed.
    let mut slab = vec![0u8; layout.byte_len()];
    let (new, enc) = (updated(&old[..s], 70), WeightEncoding::Difference);
    let rng = UniformStream::new(1, 1, 6);
    weight::encode_shard(layout, enc, 0, &new, &old[..s], &rng, &mut slab);
    let recv_host = slab.repeat(WORLD);
    // Shard 0 is read from the own reference, shards 1..W from the params.
    let (read, written) = (recv_host.len() + 2 * numel, 2 * numel);
    let copies = gpu.copies(read + written);
    let recvs = gpu.replicate(&recv_host, copies)?;
    let owns = gpu.replicate(&bits(&old[..s]), copies)?;
    // One more copy of the bucket, never written: the byte compare's pristine input.
    let buckets = gpu.replicate(&bits(&old), copies + 1)?;
    let (recv, own) = (gpu.spans(&recvs), gpu.bf16_spans(&owns));
    let bucket = gpu.bf16_spans(&buckets);
    let constants = Constants::apply(&SdpWeightApply::new(&layout, enc, &plan, 0)?)?;
    let mut launch = |i: usize| -> BenchResult<()> {
        let c = i % copies;
        let (k, st) = (gpu.kernels, gpu.stream());
        Ok(k.weight_apply(st, &layout, enc, &plan, 0, recv[c], own[c], bucket[c])?)
    };
    visit(Site {
        kernel: Kernel::WeightApply,
        constants,
        read,
        written,
        elements: numel,
        copies,
        outputs: vec![Region::in_place(bucket[0], bucket[copies])],
        launch: &mut launch,
    })
}

/// `global_absmax` of the whole fp32 bucket (reads it; the 4-byte result is not counted).
fn global_absmax_row(gpu: &Gpu, opts: &Opts, visit: Visit<'_>) -> BenchResult<()> {
    let numel = opts.grad_numel();
    let read = numel * 4;
    let copies = gpu.copies(read);
    let buckets = gpu.replicate(&gradients(numel, 80), copies)?;
    let words = gpu.zeroed::<u32>(1, copies)?;
    let (bucket, word) = (gpu.spans(&buckets), gpu.spans(&words));
    let constants = Constants::global(&SdpGlobal::absmax(numel))?;
    let mut launch = |i: usize| -> BenchResult<()> {
        let c = i % copies;
        Ok(gpu
            .kernels
            .global_absmax(gpu.stream(), bucket[c], word[c])?)
    };
    visit(Site {
        kernel: Kernel::GlobalAbsmax,
        constants,
        read,
        written: 0,
        elements: numel,
        copies,
        outputs: vec![Region::of(word[0])],
        launch: &mut launch,
    })
}

/// `global_quantize_i8` (stochastic, K for W = 4) of the whole fp32 bucket.
fn global_quantize_row(gpu: &Gpu, opts: &Opts, visit: Visit<'_>) -> BenchResult<()> {
    let numel = opts.grad_numel();
    let (read, written) = (numel * 4, numel);
    let copies = gpu.copies(read + written);
    let host = gradients(numel, 80);
    let k = global_k(8, WORLD);
    let scale = global_qsgd::local_absmax(&host) / k as f32;
    let buckets = gpu.replicate(&host, copies)?;
    let outs = gpu.zeroed::<i8>(numel, copies)?;
    let (bucket, out) = (gpu.spans(&buckets), gpu.spans(&outs));
    let (rng, sr) = (UniformStream::new(1, 1, 7), Rounding::Stochastic);
    let constants = Constants::global(&SdpGlobal::quantize(numel, scale, k, sr, &rng))?;
    let mut launch = |i: usize| -> BenchResult<()> {
        let c = i % copies;
        let (kernels, s) = (gpu.kernels, gpu.stream());
        Ok(kernels.global_quantize(s, bucket[c], scale, k, sr, &rng, out[c])?)
    };
    visit(Site {
        kernel: Kernel::GlobalQuantizeI8,
        constants,
        read,
        written,
        elements: numel,
        copies,
        outputs: vec![Region::of(out[0])],
        launch: &mut launch,
    })
}

/// `global_dequantize_i8` of rank 0's summed int8 shard into fp32.
fn global_dequantize_row(gpu: &Gpu, opts: &Opts, visit: Visit<'_>) -> BenchResult<()> {
    let s = opts.grad_numel() / WORLD;
    let (read, written) = (s, 4 * s);
    let copies = gpu.copies(read + written);
    let top = global_k(8, WORLD) * WORLD as i32;
    let sums_host: Vec<i8> = gradients(s, 90)
        .par_iter()
        .map(|&g| (g * 1e3 * top as f32).clamp(-(top as f32), top as f32) as i8)
        .collect();
    let sums = gpu.replicate(&sums_host, copies)?;
    let outs = gpu.zeroed::<f32>(s, copies)?;
    let (sum, out) = (gpu.spans(&sums), gpu.spans(&outs));
    let constants = Constants::global(&SdpGlobal::dequantize(s, 1e-5))?;
    let mut launch = |i: usize| -> BenchResult<()> {
        let c = i % copies;
        Ok(gpu
            .kernels
            .global_dequantize(gpu.stream(), sum[c], 1e-5, out[c])?)
    };
    visit(Site {
        kernel: Kernel::GlobalDequantizeI8,
        constants,
        read,
        written,
        elements: s,
        copies,
        outputs: vec![Region::of(out[0])],
        launch: &mut launch,
    })
}

/// How a kernel row sets up its call and hands it to a section.
type RowFn = Box<dyn Fn(&Gpu, &Opts, Visit<'_>) -> BenchResult<()>>;

/// One kernel row: its label and how its call is set up.
struct KernelRow {
    label: &'static str,
    run: RowFn,
}

impl KernelRow {
    /// The row's tag: "(1)", "(1b)", ...
    fn tag(&self) -> &'static str {
        self.label.split_whitespace().next().unwrap_or(self.label)
    }

    /// Sets the row's call up and hands it to `f`; returns what `f` returned.
    fn with_site<R>(
        &self,
        gpu: &Gpu,
        opts: &Opts,
        mut f: impl FnMut(Site<'_>) -> BenchResult<R>,
    ) -> BenchResult<R> {
        let mut out = None;
        (self.run)(gpu, opts, &mut |site| {
            out = Some(f(site)?);
            Ok(())
        })?;
        out.ok_or_else(|| format!("row {} set up no call", self.tag()).into())
    }
}

/// Every kernel row, in the order of the CPU benchmark, with the bf16 variants of the
/// gradient kernels after their fp32 rows.
fn kernel_rows() -> Vec<KernelRow> {
    // One pipeline chunk, so that every row's call covers the whole bucket (a chunk of the
    // first-level send buffer is then the whole of it, and a valid receive buffer).
    let one_chunk = |preset| {
        Config::from_overrides(preset, [("pipeline_chunks", "1")]).expect("one chunk is valid")
    };
    let (sdp, qsdp, zeropp) = (
        one_chunk(Preset::Sdp4bit),
        one_chunk(Preset::Qsdp),
        one_chunk(Preset::Zeropp),
    );
    let with = |config: Config, f: fn(&Gpu, &Opts, &Config, Visit<'_>) -> BenchResult<()>| {
        Box::new(move |gpu: &Gpu, opts: &Opts, visit: Visit<'_>| f(gpu, opts, &config, visit))
            as RowFn
    };
    let row = |label, run| KernelRow { label, run };
    vec![
        row(
            "(1) grad first: H32 + 8-bit SR quantize + swizzle (tlq-hs, 2x2)",
            with(sdp, grad_first_row::<f32>),
        ),
        row(
            "(1b) grad first from a bf16 bucket",
            with(sdp, grad_first_row::<bf16>),
        ),
        row(
            "(2) grad second: dequantize + sum D=2 + 4-bit SR requantize",
            with(sdp, grad_second_row),
        ),
        row(
            "(3) grad last: dequantize + sum M=2 + inverse H32 into shard",
            with(sdp, grad_final_row::<f32>),
        ),
        row(
            "(3b) grad last into a bf16 shard",
            with(sdp, grad_final_row::<bf16>),
        ),
        row(
            "(4) qWD encode: bf16 new - ref, 4-bit SR g2048",
            with(sdp, weight_encode_row),
        ),
        row(
            "(5) qWD apply: dequantize W=4 slabs + add + bf16 round",
            with(sdp, weight_apply_row),
        ),
        row(
            "(6a) QSDP grad quantize: 8-bit asym SR g1024 (one level, W=4)",
            with(qsdp, grad_first_row::<f32>),
        ),
        row(
            "(6b) QSDP grad dequantize + sum W=4 into shard",
            with(qsdp, grad_final_row::<f32>),
        ),
        row(
            "(7) ZeRO++ grad quantize: 4-bit RN g128 + swizzle (2x2)",
            with(zeropp, grad_first_row::<f32>),
        ),
        row("(8a) Global-QSGD absmax", Box::new(global_absmax_row)),
        row(
            "(8b) Global-QSGD quantize: int8 SR, K=31",
            Box::new(global_quantize_row),
        ),
        row(
            "(8c) Global-QSGD dequantize: int8 sum -> fp32 shard",
            Box::new(global_dequantize_row),
        ),
    ]
}

/// The kernel rows `SDP4BIT_BENCH_ONLY` selects.
fn selected_rows(opts: &Opts) -> Vec<KernelRow> {
    kernel_rows()
        .into_iter()
        .filter(|row| opts.selects(row.label))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Section `kernels`.

/// Prints the kernel table against the copy baseline and the target summary.
fn print_kernels(gpu: &Gpu, opts: &Opts, copy: &Row) -> BenchResult<()> {
    let base = copy.gbps();
    println!(
        "\n## Fused kernels ({} MiB buckets, W = 4 as 2 nodes x 2 ranks, one rank's call)\n",
        opts.bucket_bytes / MIB
    );
    println!(
        "GB/s = (bytes read + bytes written) / median time, 1e9 bytes; {} timed calls per row \
         after at least {} ms of warm-up, each between two CUDA events on one busy stream. \
         x copy = GB/s / the device-to-device copy of this run ({base:.1} GB/s). Buffers \
         rotated beyond {ROTATE_L2_MULTIPLE} x the L2. Each kernel launches its production \
         variant. Target (issue 42): 0.75x the copy for the fp32 gradient path, 0.5x for the \
         bf16 path, qWD's encoding and the 8-to-4-bit requantization, 0.85x for weight_apply \
         and Global-QSGD.\n",
        opts.iters,
        opts.warmup.as_millis()
    );
    println!(
        "| row | kernel | read MiB | written MiB | median us | min us | GB/s | x copy | target |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---|");
    print_row(copy, "-", base, "-");
    let mut missed = Vec::new();
    let mut measured = 0;
    for kernel_row in selected_rows(opts) {
        let (kernel, row) = kernel_row.with_site(gpu, opts, |site| {
            let time = time_calls(gpu, opts, site.copies, site.launch)?;
            let row = Row {
                name: kernel_row.label.into(),
                read: site.read,
                written: site.written,
                time,
            };
            Ok((site.kernel, row))
        })?;
        let fraction = target(kernel)?;
        let ok = row.gbps() >= fraction * base;
        let verdict = if ok { "met" } else { "**missed**" };
        print_row(&row, kernel.name(), base, &format!("{fraction}x {verdict}"));
        measured += 1;
        if !ok {
            missed.push(kernel_row.tag());
        }
    }
    println!(
        "\n{} of {measured} kernels reach their targets{}.",
        measured - missed.len(),
        if missed.is_empty() {
            String::new()
        } else {
            format!(" (below: {})", missed.join(", "))
        }
    );
    Ok(())
}

/// One table row of `kernel` with its target cell.
fn print_row(row: &Row, kernel: &str, base: f64, target: &str) {
    let mib = |bytes: usize| bytes as f64 / MIB as f64;
    println!(
        "| {} | {kernel} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | {target} |",
        row.name,
        mib(row.read),
        mib(row.written),
        row.time.median_ms * 1e3,
        row.time.min_ms * 1e3,
        row.gbps(),
        row.gbps() / base
    );
}

// ---------------------------------------------------------------------------------------------
// Section `cost`: the per-bucket sequence.

/// Bucket sizes (elements) of the per-bucket cost, and of the quick run's.
const COST_NUMELS: [usize; 2] = [64 << 20, 256 << 20];
const COST_NUMELS_QUICK: [usize; 1] = [1 << 20];

/// A sequence of launches one rank runs per step, with its buffers.
trait Sequence {
    /// Bytes its kernels read and write, summed over the sequence.
    fn bytes(&self) -> usize;
    /// Enqueues the sequence on `stream`.
    fn enqueue(&self, kernels: &Kernels, stream: Stream) -> BenchResult<()>;
}

/// The reduce-scatter's kernels for a bucket of `G` (sdp4bit preset, 2 x 2), in the order one
/// rank runs them. Chunk `c` of the first-level send buffer stands for chunk `c`'s first-level
/// receive buffer, and the second-level send buffer for the last level's receive buffer (the
/// same layouts, valid encodings).
struct ReduceScatter<G> {
    layout: GradLayout,
    bucket: DeviceSpan<G>,
    dests: DeviceSpan<u32>,
    first: DeviceSpan<u8>,
    second: DeviceSpan<u8>,
    shard: DeviceSpan<G>,
    rngs: (UniformStream, UniformStream),
    /// The memory the spans point to.
    _buffers: (Vec<CudaSlice<u8>>, Vec<CudaSlice<u32>>),
}

impl<G: GradElement + Pod> ReduceScatter<G> {
    fn new(gpu: &Gpu, numel: usize) -> BenchResult<Self> {
        let layout = grad_layout(&Config::preset(Preset::Sdp4bit), numel)?;
        let second = layout.second.ok_or("a two-level layout")?;
        let buckets = grad_buffers::<G>(gpu, &gradients(numel, 110), 1)?;
        let firsts = gpu.zeroed::<u8>(first_send_len(&layout), 1)?;
        let seconds = gpu.zeroed::<u8>(second.peers * second.slab.byte_len(), 1)?;
        let shards = grad_zeroed::<G>(gpu, layout.bucket.shard_len, 1)?;
        let dests = gpu.replicate(&dest_table(&layout)?, 1)?;
        Ok(Self {
            bucket: gpu.typed_spans::<G>(&buckets)[0],
            dests: gpu.spans(&dests)[0],
            first: gpu.spans(&firsts)[0],
            second: gpu.spans(&seconds)[0],
            shard: gpu.typed_spans::<G>(&shards)[0],
            rngs: (UniformStream::new(1, 1, 8), UniformStream::new(1, 1, 9)),
            layout,
            _buffers: (
                [buckets, firsts, seconds, shards]
                    .into_iter()
                    .flatten()
                    .collect(),
                dests,
            ),
        })
    }

    /// Bytes of one first-level chunk (its `first.peers` slabs).
    fn chunk_bytes(&self) -> usize {
        self.layout.first.peers * self.layout.first.slab.byte_len()
    }
}

impl<G: GradElement + Pod> Sequence for ReduceScatter<G> {
    fn bytes(&self) -> usize {
        let l = &self.layout;
        let g = size_of::<G>();
        // The first pass reads the bucket and writes every chunk; per chunk the second reads
        // the chunk and writes the second-level slabs, which the final pass reads; the final
        // passes write the shard.
        l.bucket.numel * g
            + first_send_len(l)
            + l.bucket.chunks * (self.chunk_bytes() + 2 * self.second.len())
            + l.bucket.shard_len * g
    }

    fn enqueue(&self, k: &Kernels, s: Stream) -> BenchResult<()> {
        let l = &self.layout;
        k.grad_quantize_first(s, l, self.bucket, self.dests, &self.rngs.0, self.first)?;
        let chunk_bytes = self.chunk_bytes();
        for chunk in 0..l.bucket.chunks {
            // SAFETY: chunk `chunk`'s bytes of the first-level send buffer, inside it.
            let recv = unsafe {
                DeviceSpan::from_raw(
                    self.first.addr() + (chunk * chunk_bytes) as u64,
                    chunk_bytes,
                )
            };
            let (dests, rng, out) = (self.dests, &self.rngs.1, self.second);
            k.grad_requantize_second(s, l, 0, chunk, recv, dests, rng, out)?;
            k.grad_reduce_final(s, l, chunk, self.second, self.shard)?;
        }
        Ok(())
    }
}

/// The all-gather's kernels (qWD) for a bf16 bucket: the own shard's encoding, then the W
/// received slabs applied to the bucket (every slab a copy of the own one, made once).
struct AllGather {
    layout: SlabLayout,
    plan: BucketPlan,
    new: DeviceSpan<bf16>,
    reference: DeviceSpan<bf16>,
    bucket: DeviceSpan<bf16>,
    recv: DeviceSpan<u8>,
    rng: UniformStream,
    /// The memory the spans point to.
    _buffers: (Vec<CudaSlice<u16>>, Vec<CudaSlice<u8>>),
}

impl AllGather {
    fn new(gpu: &Gpu, numel: usize) -> BenchResult<Self> {
        let config = Config::preset(Preset::Sdp4bit);
        let (layout, plan) = weight_layout(&config, numel)?;
        let s = plan.shard_len;
        let old = params(numel, 120);
        let news = gpu.replicate(&bits(&updated(&old[..s], 130)), 1)?;
        let references = gpu.replicate(&bits(&old[..s]), 1)?;
        let buckets = gpu.replicate(&bits(&old), 1)?;
        let recvs = gpu.zeroed::<u8>(WORLD * layout.byte_len(), 1)?;
        let gather = Self {
            new: gpu.bf16_spans(&news)[0],
            reference: gpu.bf16_spans(&references)[0],
            bucket: gpu.bf16_spans(&buckets)[0],
            recv: gpu.spans(&recvs)[0],
            rng: UniformStream::new(1, 1, 10),
            layout,
            plan,
            _buffers: (
                [news, references, buckets].into_iter().flatten().collect(),
                recvs,
            ),
        };
        gather.encode(gpu.kernels, gpu.stream())?;
        for peer in 1..WORLD {
            let bytes = gather.layout.byte_len();
            let own = gather.recv.addr();
            gpu.copy_dtod(own + (peer * bytes) as u64, own, bytes)?;
        }
        gpu.stream.synchronize()?;
        Ok(gather)
    }

    /// Enqueues the own shard's encoding into slab 0 of the receive buffer.
    fn encode(&self, k: &Kernels, s: Stream) -> BenchResult<()> {
        // SAFETY: the first slab of the receive buffer, inside it.
        let own_slab = unsafe { DeviceSpan::from_raw(self.recv.addr(), self.layout.byte_len()) };
        let first_index = self.plan.padded_index(0, 0);
        let enc = WeightEncoding::Difference;
        let (new, reference) = (self.new, self.reference);
        Ok(k.weight_encode(
            s,
            &self.layout,
            enc,
            first_index,
            new,
            reference,
            &self.rng,
            own_slab,
        )?)
    }
}

impl Sequence for AllGather {
    fn bytes(&self) -> usize {
        let (s, numel, slab) = (self.plan.shard_len, self.plan.numel, self.layout.byte_len());
        // The encoding reads the new and the previous shard and writes a slab; the application
        // reads the W slabs, the own previous shard and the other shards, and writes the bucket.
        (4 * s + slab) + (WORLD * slab + 2 * numel + 2 * numel)
    }

    fn enqueue(&self, k: &Kernels, s: Stream) -> BenchResult<()> {
        self.encode(k, s)?;
        let enc = WeightEncoding::Difference;
        let (recv, reference, bucket) = (self.recv, self.reference, self.bucket);
        Ok(k.weight_apply(s, &self.layout, enc, &self.plan, 0, recv, reference, bucket)?)
    }
}

/// One rank's compression kernels per step for one bucket under the sdp4bit preset on
/// 2 nodes x 2 ranks, exchanges excluded.
struct Cost {
    numel: usize,
    /// The gradient bucket's element type.
    grad: &'static str,
    /// The reduce-scatter's passes: first-level quantization of the bucket, then per chunk the
    /// second-level requantization and the final decoding into the shard.
    reduce_scatter: Timing,
    /// The all-gather's passes on a bf16 bucket of as many elements: qWD encoding of the own
    /// shard and applying the W slabs.
    all_gather: Timing,
    /// Bytes both sequences read and write.
    bytes: usize,
}

impl Cost {
    /// Milliseconds of both sequences.
    fn ms(&self) -> f64 {
        self.reduce_scatter.median_ms + self.all_gather.median_ms
    }

    /// Milliseconds the bytes take at `copy_gbps`.
    fn copy_ms(&self, copy_gbps: f64) -> f64 {
        self.bytes as f64 / (copy_gbps * 1e9) * 1e3
    }
}

/// Times `sequence` on the benchmark's stream.
fn time_sequence(gpu: &Gpu, opts: &Opts, sequence: &dyn Sequence) -> BenchResult<Timing> {
    time_calls(gpu, opts, 1, |_| {
        sequence.enqueue(gpu.kernels, gpu.stream())
    })
}

/// The per-bucket cost of `numel` elements, fp32 and bf16 gradients.
fn costs_of(gpu: &Gpu, opts: &Opts, numel: usize) -> BenchResult<Vec<Cost>> {
    let gather = AllGather::new(gpu, numel)?;
    let all_gather = time_sequence(gpu, opts, &gather)?;
    let fp32 = ReduceScatter::<f32>::new(gpu, numel)?;
    let bf16 = ReduceScatter::<bf16>::new(gpu, numel)?;
    Ok(vec![
        Cost {
            numel,
            grad: "fp32",
            reduce_scatter: time_sequence(gpu, opts, &fp32)?,
            all_gather: all_gather.clone(),
            bytes: fp32.bytes() + gather.bytes(),
        },
        Cost {
            numel,
            grad: "bf16",
            reduce_scatter: time_sequence(gpu, opts, &bf16)?,
            all_gather,
            bytes: bf16.bytes() + gather.bytes(),
        },
    ])
}

/// The bucket sizes of the per-bucket cost.
fn cost_numels(opts: &Opts) -> &'static [usize] {
    if opts.quick {
        &COST_NUMELS_QUICK
    } else {
        &COST_NUMELS
    }
}

/// Prints the per-bucket cost table and the same figures as one JSON line (`cost-json: `),
/// which `bench/gpu_cost.py` reads to put them against a GEMM step.
fn print_costs(gpu: &Gpu, opts: &Opts, copy_gbps: f64) -> BenchResult<()> {
    let mut costs = Vec::new();
    for &numel in cost_numels(opts) {
        costs.extend(costs_of(gpu, opts, numel)?);
    }
    println!(
        "\n## Per-bucket cost (one rank's compression kernels per step, sdp4bit preset, W = 4 \
         as 2 x 2)\n\nMedian of {} calls, each the rank's whole sequence of launches between two \
         CUDA events; the exchanges are not included. The all-gather is qWD on bf16 params of \
         the bucket's element count. Bytes: every kernel's reads and writes; at copy speed: \
         those bytes at this run's device-to-device copy ({copy_gbps:.1} GB/s). Target (issue \
         42): the sequence within {SEQUENCE_TARGET}x of its bytes at copy speed.\n",
        opts.iters
    );
    println!(
        "| bucket elements | gradients | reduce-scatter kernels ms | all-gather kernels ms | \
         both ms | bytes MiB | at copy speed ms | x the copy's time | target |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---|");
    let mut json = Vec::new();
    for c in &costs {
        let (rs, ag) = (c.reduce_scatter.median_ms, c.all_gather.median_ms);
        let (at_copy, ratio) = (c.copy_ms(copy_gbps), c.ms() / c.copy_ms(copy_gbps));
        println!(
            "| {} Mi | {} | {rs:.3} | {ag:.3} | {:.3} | {:.1} | {at_copy:.3} | {ratio:.2} | {} |",
            c.numel >> 20,
            c.grad,
            c.ms(),
            c.bytes as f64 / MIB as f64,
            verdict(ratio <= SEQUENCE_TARGET),
        );
        json.push(format!(
            "{{\"numel\": {}, \"grad\": \"{}\", \"reduce_scatter_ms\": {rs:.6}, \
             \"all_gather_ms\": {ag:.6}, \"bytes\": {}}}",
            c.numel, c.grad, c.bytes
        ));
    }
    println!(
        "\ncost-json: {{\"device\": {}, \"preset\": \"sdp4bit\", \"world\": \"2x2\", \
         \"copy_gbps\": {copy_gbps:.3}, \"sequence_target\": {SEQUENCE_TARGET}, \"rows\": [{}]}}",
        json_str(&gpu.info.name),
        json.join(", ")
    );
    Ok(())
}

/// `met` or `**missed**`.
fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "**missed**" }
}

/// `text` as a JSON string.
fn json_str(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

// ---------------------------------------------------------------------------------------------
// Section `concurrent`: a GEMM beside the compression kernels.

/// Tokens of the GEMM step's micro-batch (bench/gpu_cost.py's default).
const GEMM_TOKENS: usize = 8192;
/// Calls per load and round; two rounds.
const CONCURRENT_REPS: usize = 31;
const CONCURRENT_REPS_QUICK: usize = 5;

/// The hidden size of a GPT layer of about `params` parameters (12 h^2), a multiple of 64
/// (`bench/gpu_cost.py`'s `layer_hidden`).
fn layer_hidden(params: usize) -> usize {
    let h = ((params as f64 / 12.0).sqrt() / 64.0).round() as usize;
    h.max(1) * 64
}

/// (in, out) of the layer's four linear layers: QKV, attention output, MLP up and down.
fn layer_shapes(hidden: usize) -> [(usize, usize); 4] {
    [
        (hidden, 3 * hidden),
        (hidden, hidden),
        (hidden, 4 * hidden),
        (4 * hidden, hidden),
    ]
}

/// The forward and backward products of a GPT layer's linear layers on one micro-batch, bf16
/// through cuBLAS (`cublasGemmEx`, fp32 accumulation) on their own stream, as torch's
/// `matmul` runs them (row-major operands: Y = X W^T, dX = dY W, dW = dY^T X).
struct GemmStep {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    hidden: usize,
    tokens: usize,
    /// X, W and dY of the largest layer, one after the other (random bf16).
    x: u64,
    w: u64,
    dy: u64,
    /// Y, dX and dW (written).
    y: u64,
    dx: u64,
    dw: u64,
    /// The memory the addresses point to.
    _buffers: Vec<CudaSlice<u16>>,
}

impl GemmStep {
    fn new(gpu: &Gpu, hidden: usize, tokens: usize) -> BenchResult<Self> {
        let stream = gpu.context.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let (act, weights) = (tokens * 4 * hidden, 4 * hidden * hidden);
        let operands = gpu.replicate(&bits(&params(2 * act + weights, 140)), 1)?;
        let results = gpu.zeroed::<u16>(2 * act + weights, 1)?;
        gpu.stream.synchronize()?;
        let (o, r) = (
            gpu.spans(&operands)[0].addr(),
            gpu.spans(&results)[0].addr(),
        );
        let at = |base: u64, elements: usize| base + 2 * elements as u64;
        Ok(Self {
            blas,
            stream,
            hidden,
            tokens,
            x: o,
            w: at(o, act),
            dy: at(o, act + weights),
            y: r,
            dx: at(r, act),
            dw: at(r, act + weights),
            _buffers: [operands, results].into_iter().flatten().collect(),
        })
    }

    /// Floating-point operations of one step: 6 x tokens x 12 h^2.
    fn flops(&self) -> f64 {
        6.0 * self.tokens as f64 * 12.0 * (self.hidden * self.hidden) as f64
    }

    /// `C (m x n) = op(A) op(B)` in cuBLAS's column-major terms, bf16 in and out.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        (a, lda): (u64, usize),
        (b, ldb): (u64, usize),
        (c, ldc): (u64, usize),
    ) -> BenchResult<()> {
        use cublas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let op = |t| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let int = |v: usize| c_int::try_from(v).map_err(|_| format!("GEMM dimension {v}"));
        let (alpha, beta) = (1f32, 0f32);
        let bf16 = cublas_sys::cudaDataType_t::CUDA_R_16BF;
        // SAFETY: the handle is live and bound to `self.stream`; `a`, `b` and `c` are device
        // buffers of this step holding at least the column-major matrices the dimensions and
        // leading dimensions describe (sized by `new` for the largest layer); alpha and beta
        // are host fp32 scalars (the default pointer mode) for CUBLAS_COMPUTE_32F.
        unsafe {
            cublas::gemm_ex(
                *self.blas.handle(),
                op(ta),
                op(tb),
                int(m)?,
                int(n)?,
                int(k)?,
                std::ptr::from_ref(&alpha).cast(),
                a as *const c_void,
                bf16,
                int(lda)?,
                b as *const c_void,
                bf16,
                int(ldb)?,
                std::ptr::from_ref(&beta).cast(),
                c as *mut c_void,
                bf16,
                int(ldc)?,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    /// Enqueues the step's 12 products on its stream.
    fn enqueue(&self) -> BenchResult<()> {
        let t = self.tokens;
        for (fan_in, fan_out) in layer_shapes(self.hidden) {
            // Forward: Y^T (out x T) = W (in x out)^T X^T (in x T).
            self.gemm(
                (true, false),
                (fan_out, t, fan_in),
                (self.w, fan_in),
                (self.x, fan_in),
                (self.y, fan_out),
            )?;
            // Input gradient: dX^T (in x T) = W^T... as stored: (in x out) dY^T (out x T).
            self.gemm(
                (false, false),
                (fan_in, t, fan_out),
                (self.w, fan_in),
                (self.dy, fan_out),
                (self.dx, fan_in),
            )?;
            // Weight gradient: dW^T (in x out) = X^T (in x T) dY (T x out).
            self.gemm(
                (false, true),
                (fan_in, fan_out, t),
                (self.x, fan_in),
                (self.dy, fan_out),
                (self.dw, fan_in),
            )?;
        }
        Ok(())
    }
}

/// What runs in one measurement of the `concurrent` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    Gemm,
    Compression,
    Both,
}

/// Windows of one call: from the start event to the GEMM stream's end and to the side stream's
/// end (0 when it ran nothing), in milliseconds.
type Windows = Vec<(f64, f64)>;

/// Records `event` on the raw `stream`.
fn record(event: &CudaEvent, stream: sys::CUstream) -> BenchResult<()> {
    // SAFETY: a live event and a live stream of the benchmark's context.
    unsafe { sys::cuEventRecord(event.cu_event(), stream) }.result()?;
    Ok(())
}

/// Makes the raw `stream` wait for `event`.
fn wait(stream: sys::CUstream, event: &CudaEvent) -> BenchResult<()> {
    // SAFETY: a live event and a live stream of the benchmark's context.
    unsafe { sys::cuStreamWaitEvent(stream, event.cu_event(), 0) }.result()?;
    Ok(())
}

/// Runs `reps` calls of `load`: each call records a start event on the GEMM stream, which the
/// side stream waits for before the compression sequence; the GEMM stream waits for the side
/// stream's end before the next call, so calls never overlap each other. Everything is
/// enqueued before the host waits.
fn run_load(
    gpu: &Gpu,
    gemm: &GemmStep,
    compression: &[&dyn Sequence],
    side: Stream,
    load: Load,
    reps: usize,
) -> BenchResult<Windows> {
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let new = || gpu.context.new_event(timed);
    let events = (0..reps)
        .map(|_| Ok((new()?, new()?, new()?)))
        .collect::<Result<Vec<_>, DriverError>>()?;
    let (g, s) = (gemm.stream.cu_stream(), side.handle() as sys::CUstream);
    gpu.context.bind_to_thread()?;
    for (start, gemm_end, side_end) in &events {
        record(start, g)?;
        if load != Load::Gemm {
            wait(s, start)?;
            for sequence in compression {
                sequence.enqueue(gpu.kernels, side)?;
            }
            record(side_end, s)?;
        }
        if load != Load::Compression {
            gemm.enqueue()?;
        }
        record(gemm_end, g)?;
        if load != Load::Gemm {
            wait(g, side_end)?;
        }
    }
    gemm.stream.synchronize()?;
    gpu.context.check_err()?;
    events
        .iter()
        .map(|(start, gemm_end, side_end)| {
            let side = if load == Load::Gemm {
                0.0
            } else {
                f64::from(start.elapsed_ms(side_end)?)
            };
            Ok((f64::from(start.elapsed_ms(gemm_end)?), side))
        })
        .collect()
}

/// The medians of one gradient type's measurement.
struct Concurrent {
    grad: &'static str,
    gemm_ms: f64,
    gemm_beside_ms: f64,
    compression_ms: f64,
    compression_beside_ms: f64,
    both_ms: f64,
}

/// Prints the GEMM step alone, the compression sequence alone and both together, for fp32 and
/// bf16 gradients, and a `concurrent-json:` line.
fn print_concurrent(gpu: &Gpu, opts: &Opts) -> BenchResult<()> {
    let numel = cost_numels(opts)[0];
    let hidden = layer_hidden(numel);
    println!(
        "\n## A GEMM beside the compression kernels ({} Mi elements, sdp4bit, W = 4 as 2 x 2)\n",
        numel >> 20
    );
    // SAFETY: loading a library runs its initialisers; cuBLAS's are the vendor's own.
    if !unsafe { cublas_sys::is_culib_present() } {
        println!(
            "skipped: no cuBLAS library (libcublas.so, libcublas.so.13, ...) on the loader's \
             path; the GPU kit puts the one torch ships (site-packages/nvidia/*/lib) or the \
             CUDA toolkit's there"
        );
        println!("\nconcurrent-json: {{\"skipped\": \"no cuBLAS library\"}}");
        return Ok(());
    }
    let reps = if opts.quick {
        CONCURRENT_REPS_QUICK
    } else {
        CONCURRENT_REPS
    };
    let gemm = GemmStep::new(gpu, hidden, GEMM_TOKENS)?;
    let side = new_priority_stream(gpu.kernels)?;
    let gather = AllGather::new(gpu, numel)?;
    let fp32 = ReduceScatter::<f32>::new(gpu, numel)?;
    let bf16 = ReduceScatter::<bf16>::new(gpu, numel)?;
    gpu.stream.synchronize()?;
    let mut rows = Vec::new();
    for (grad, scatter) in [("fp32", &fp32 as &dyn Sequence), ("bf16", &bf16)] {
        let compression = [scatter, &gather as &dyn Sequence];
        // Warm-up: cuBLAS's handle and heuristics, the kernels' modules, the clocks.
        run_load(gpu, &gemm, &compression, side, Load::Both, 3)?;
        let (mut alone, mut beside, mut compressed) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..2 {
            alone.extend(run_load(gpu, &gemm, &compression, side, Load::Gemm, reps)?);
            beside.extend(run_load(gpu, &gemm, &compression, side, Load::Both, reps)?);
            compressed.extend(run_load(
                gpu,
                &gemm,
                &compression,
                side,
                Load::Compression,
                reps,
            )?);
        }
        let med = |values: Vec<f64>| Timing::of(values).median_ms;
        rows.push(Concurrent {
            grad,
            gemm_ms: med(alone.iter().map(|w| w.0).collect()),
            gemm_beside_ms: med(beside.iter().map(|w| w.0).collect()),
            compression_ms: med(compressed.iter().map(|w| w.1).collect()),
            compression_beside_ms: med(beside.iter().map(|w| w.1).collect()),
            both_ms: med(beside.iter().map(|w| w.0.max(w.1)).collect()),
        });
    }
    gpu.context.synchronize()?;
    println!(
        "The forward and backward bf16 products of a GPT layer's four linear layers (hidden \
         {hidden}, {:.1} M parameters, {GEMM_TOKENS} tokens: 12 `cublasGemmEx` calls, fp32 \
         accumulation) on a compute stream, and one rank's compression kernels for the bucket \
         (the reduce-scatter's and the all-gather's, as the per-bucket cost) on sdp4bit's side \
         stream (`new_priority_stream`: non-blocking, the context's highest priority), started \
         together by an event. Medians of {} calls per load (two rounds of {reps}, each call \
         between CUDA events); slowdown = the GEMM step beside the compression over the GEMM \
         step alone, minus 1. Exposed = how much longer both take than the GEMM alone, as a \
         share of the compression alone (0%: the compression hides entirely under the GEMM).\n",
        12.0 * (hidden * hidden) as f64 / 1e6,
        2 * reps
    );
    println!(
        "| gradients | GEMM step alone ms | TFLOP/s | GEMM beside compression ms | GEMM slowdown \
         | compression alone ms | compression beside GEMM ms | both done ms | exposed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut json = Vec::new();
    for r in &rows {
        let slowdown = 100.0 * (r.gemm_beside_ms / r.gemm_ms - 1.0);
        let exposed = 100.0 * (r.both_ms - r.gemm_ms) / r.compression_ms;
        println!(
            "| {} | {:.3} | {:.0} | {:.3} | {slowdown:+.1}% | {:.3} | {:.3} | {:.3} | \
             {exposed:.0}% |",
            r.grad,
            r.gemm_ms,
            gemm.flops() / (r.gemm_ms * 1e-3) / 1e12,
            r.gemm_beside_ms,
            r.compression_ms,
            r.compression_beside_ms,
            r.both_ms
        );
        json.push(format!(
            "{{\"grad\": \"{}\", \"gemm_ms\": {:.6}, \"gemm_beside_ms\": {:.6}, \
             \"compression_ms\": {:.6}, \"compression_beside_ms\": {:.6}, \"both_ms\": {:.6}}}",
            r.grad,
            r.gemm_ms,
            r.gemm_beside_ms,
            r.compression_ms,
            r.compression_beside_ms,
            r.both_ms
        ));
    }
    println!(
        "\nconcurrent-json: {{\"device\": {}, \"numel\": {numel}, \"hidden\": {hidden}, \
         \"tokens\": {GEMM_TOKENS}, \"rows\": [{}]}}",
        json_str(&gpu.info.name),
        json.join(", ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Section `sweep`.

/// Timed calls per variant and pass (two passes), and the quick run's.
const SWEEP_ITERS: usize = 31;
const SWEEP_ITERS_QUICK: usize = 5;
/// Warm-up per variant and pass (the GPU is busy from one variant to the next).
const SWEEP_WARMUP: Duration = Duration::from_millis(25);
/// The garbage the production variant's reference call writes over, and the one every
/// compared call writes over: a byte a call leaves unwritten differs.
const GARBAGE: [u8; 2] = [0xA5, 0x5A];
/// The least speed-up over the production variant that counts beyond the timing noise.
const MIN_GAIN: f64 = 0.01;

/// One variant's times over both passes.
#[derive(Debug, Clone)]
struct Swept {
    spec: KernelSpec,
    median_ms: f64,
    min_ms: f64,
    /// The difference of the two passes' medians over the median.
    spread: f64,
}

impl Swept {
    /// The variant's key in its entry name (`u4t256m3`) and its grid cap.
    fn name(&self) -> String {
        let entry = self.spec.entry();
        let key = entry.rsplit("__").next().unwrap_or(&entry);
        format!("{key} g{}", self.spec.variant.grid_blocks)
    }
}

/// One row's sweep.
struct SweepRow {
    tag: &'static str,
    label: &'static str,
    read: usize,
    written: usize,
    elements: usize,
    target: f64,
    compile_secs: f64,
    /// Every variant; the production one first.
    swept: Vec<Swept>,
}

impl SweepRow {
    fn production(&self) -> &Swept {
        &self.swept[0]
    }

    fn fastest(&self) -> &Swept {
        self.swept
            .iter()
            .min_by(|a, b| a.median_ms.total_cmp(&b.median_ms))
            .unwrap_or(self.production())
    }

    /// The fastest variant where it beats the production one by more than both's spread (at
    /// least [`MIN_GAIN`]), else the production one.
    fn chosen(&self) -> &Swept {
        let (fastest, production) = (self.fastest(), self.production());
        let noise = (fastest.spread + production.spread).max(MIN_GAIN);
        if production.median_ms / fastest.median_ms - 1.0 > noise {
            fastest
        } else {
            production
        }
    }

    /// Bandwidth as a fraction of the copy's at `ms`.
    fn x_copy(&self, ms: f64, copy_gbps: f64) -> f64 {
        (self.read + self.written) as f64 / (ms * 1e-3) / 1e9 / copy_gbps
    }
}

/// Sets `site`'s outputs to garbage (or restores an in-place output), runs call 0 and reads
/// the outputs back.
fn call_once(gpu: &Gpu, site: &mut Site<'_>, garbage: u8) -> BenchResult<Vec<Vec<u8>>> {
    for &region in &site.outputs {
        match region.pristine {
            Some(src) => gpu.copy_dtod(region.addr, src, region.bytes)?,
            None => gpu.fill(region, garbage)?,
        }
    }
    (site.launch)(0)?;
    site.outputs
        .iter()
        .map(|&region| gpu.download(region))
        .collect()
}

/// How `got` differs from `want`, or `None` where they are the same bytes.
fn difference(want: &[Vec<u8>], got: &[Vec<u8>]) -> Option<String> {
    const CHUNK: usize = 1 << 20;
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if w.len() != g.len() {
            return Some(format!("output {i} has {} bytes, not {}", g.len(), w.len()));
        }
        let (count, first) = w
            .par_chunks(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .enumerate()
            .map(|(c, (a, b))| {
                let differing = a.iter().zip(b).filter(|(x, y)| x != y).count();
                let first = a.iter().zip(b).position(|(x, y)| x != y);
                (differing, first.map(|p| c * CHUNK + p))
            })
            .reduce(
                || (0, None),
                |(n, a), (m, b)| (n + m, a.into_iter().chain(b).min()),
            );
        if let Some(at) = first {
            return Some(format!(
                "{count} of {} bytes of output {i} differ, the first at byte {at}: {:#04x} \
                 instead of {:#04x}",
                w.len(),
                g[at],
                w[at]
            ));
        }
    }
    None
}

/// Sweeps one row: every candidate variant compiled, byte-compared with the production
/// variant's output, then timed in two passes (the second in reverse order); the production
/// variant is restored at the end.
fn sweep_row(gpu: &Gpu, opts: &Opts, row: &KernelRow, mut site: Site<'_>) -> BenchResult<SweepRow> {
    let kernels = gpu.kernels;
    let (kernel, constants) = (site.kernel, site.constants);
    let production = kernels.variant(kernel, constants);
    let mut variants = vec![production];
    for v in candidates(kernel, constants) {
        if !variants.contains(&v) {
            variants.push(v);
        }
    }
    let specs = variants
        .iter()
        .map(|&v| KernelSpec::new(kernel, constants, v))
        .collect::<Result<Vec<_>, _>>()?;
    let start = Instant::now();
    kernels.prepare(&specs)?;
    let compile_secs = start.elapsed().as_secs_f64();

    let named = |spec: &KernelSpec| format!("{spec} (grid {} per SM)", spec.variant.grid_blocks);
    kernels.set_variant(kernel, constants, production)?;
    let reference = call_once(gpu, &mut site, GARBAGE[0])?;
    if let Some(d) = difference(&reference, &call_once(gpu, &mut site, GARBAGE[1])?) {
        return Err(format!(
            "sweep {}: the production variant {} wrote other bytes over other garbage ({d}): \
             it leaves output bytes unwritten or is not deterministic",
            row.tag(),
            named(&specs[0])
        )
        .into());
    }
    for spec in &specs[1..] {
        kernels.set_variant(kernel, constants, spec.variant)?;
        if let Some(d) = difference(&reference, &call_once(gpu, &mut site, GARBAGE[1])?) {
            kernels.set_variant(kernel, constants, production)?;
            return Err(format!(
                "sweep {} ({}): variant {} differs from the production variant {}: {d}",
                row.tag(),
                row.label,
                named(spec),
                named(&specs[0])
            )
            .into());
        }
    }

    let timing = Opts {
        warmup: SWEEP_WARMUP,
        iters: if opts.quick {
            SWEEP_ITERS_QUICK
        } else {
            SWEEP_ITERS
        },
        ..opts.clone()
    };
    let mut samples = vec![(Vec::new(), [0.0f64; 2]); specs.len()];
    for pass in 0..2 {
        let order: Vec<usize> = if pass == 0 {
            (0..specs.len()).collect()
        } else {
            (0..specs.len()).rev().collect()
        };
        for i in order {
            kernels.set_variant(kernel, constants, specs[i].variant)?;
            let t = time_calls(gpu, &timing, site.copies, &mut *site.launch)?;
            samples[i].0.extend_from_slice(&t.samples);
            samples[i].1[pass] = t.median_ms;
        }
    }
    kernels.set_variant(kernel, constants, production)?;
    let swept = specs
        .iter()
        .zip(samples)
        .map(|(&spec, (all, passes))| {
            let t = Timing::of(all);
            Swept {
                spec,
                spread: (passes[0] - passes[1]).abs() / t.median_ms,
                median_ms: t.median_ms,
                min_ms: t.min_ms,
            }
        })
        .collect();
    Ok(SweepRow {
        tag: row.tag(),
        label: row.label,
        read: site.read,
        written: site.written,
        elements: site.elements,
        target: target(kernel)?,
        compile_secs,
        swept,
    })
}

/// The report the `TABLE` lines name: `SDP4BIT_BENCH_REPORT`, else one named after the date
/// and the GPU.
fn report_path(gpu: &Gpu, opts: &Opts) -> String {
    if !opts.report.is_empty() {
        return opts.report.clone();
    }
    let name = gpu.info.name.to_lowercase();
    let name = name.strip_prefix("nvidia ").unwrap_or(&name);
    let slug: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let date: String = utc_now().chars().take(10).collect();
    format!(
        "bench/results/gpu/{date}-{}-sweep.md",
        slug.trim_matches('-')
    )
}

/// `arch` as a Rust expression of `variants.rs`.
fn arch_expr(arch: Arch) -> String {
    if arch == Arch::SM_90 {
        "Arch::SM_90".into()
    } else {
        format!("Arch {{ major: {}, minor: {} }}", arch.major, arch.minor)
    }
}

/// A `Measured` line of `variants::TABLE` for `spec`.
fn table_line(spec: &KernelSpec, report: &str) -> String {
    format!(
        "Measured {{ kernel: Kernel::{:?}, constants: Constants::{:?}, variant: {:?}, report: {} }},",
        spec.kernel,
        spec.constants,
        spec.variant,
        json_str(report)
    )
}

/// One variant as a JSON object.
fn swept_json(s: &Swept) -> String {
    format!(
        "{{\"entry\": {}, \"grid_blocks\": {}, \"median_us\": {:.3}, \"min_us\": {:.3}, \
         \"spread\": {:.4}}}",
        json_str(&s.spec.entry()),
        s.spec.variant.grid_blocks,
        s.median_ms * 1e3,
        s.min_ms * 1e3,
        s.spread
    )
}

/// Prints one row's table of variants.
fn print_sweep_row(row: &SweepRow, copy_gbps: f64) {
    let production = row.production();
    let entry = production.spec.entry();
    let constants = entry.split("__").nth(1).unwrap_or("");
    println!("\n### {}\n", row.label);
    println!(
        "`{}` with constants `{constants}`: {:.2} MiB read + {:.2} MiB written per call, {} \
         elements; {} variants compiled and loaded in {:.1} s, each writing the production \
         variant's bytes.\n",
        production.spec.kernel.name(),
        row.read as f64 / MIB as f64,
        row.written as f64 / MIB as f64,
        row.elements,
        row.swept.len(),
        row.compile_secs
    );
    println!(
        "| variant | units | threads | min blocks | grid/SM | median us | min us | spread | GB/s \
         | x copy | vs production |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let (fastest, chosen) = (row.fastest().spec, row.chosen().spec);
    for s in &row.swept {
        let v = s.spec.variant;
        let mut name = format!("`{}`", s.name());
        for (is, what) in [
            (s.spec == production.spec, "production"),
            (s.spec == fastest, "fastest"),
            (s.spec == chosen && chosen != production.spec, "chosen"),
        ] {
            if is {
                name.push_str(&format!(" ({what})"));
            }
        }
        let gbps = (row.read + row.written) as f64 / (s.median_ms * 1e-3) / 1e9;
        println!(
            "| {name} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1}% | {gbps:.1} | {:.2} | {:.2} |",
            v.units,
            v.threads,
            v.min_blocks,
            v.grid_blocks,
            s.median_ms * 1e3,
            s.min_ms * 1e3,
            100.0 * s.spread,
            gbps / copy_gbps,
            production.median_ms / s.median_ms
        );
    }
}

/// The per-bucket sequence (fp32 gradients) with the production variants and with `chosen`
/// set, in milliseconds, and its bytes' time at copy speed.
fn sequence_with(
    gpu: &Gpu,
    opts: &Opts,
    chosen: &[KernelSpec],
    copy_gbps: f64,
) -> BenchResult<(f64, f64, f64)> {
    let numel = cost_numels(opts)[0];
    let gather = AllGather::new(gpu, numel)?;
    let scatter = ReduceScatter::<f32>::new(gpu, numel)?;
    let time = |gpu: &Gpu| -> BenchResult<f64> {
        Ok(time_sequence(gpu, opts, &scatter)?.median_ms
            + time_sequence(gpu, opts, &gather)?.median_ms)
    };
    let production: Vec<KernelSpec> = chosen
        .iter()
        .map(|s| gpu.kernels.spec(s.kernel, s.constants))
        .collect::<Result<_, _>>()?;
    let before = time(gpu)?;
    for s in chosen {
        gpu.kernels.set_variant(s.kernel, s.constants, s.variant)?;
    }
    let after = time(gpu);
    for s in &production {
        gpu.kernels.set_variant(s.kernel, s.constants, s.variant)?;
    }
    let at_copy = (scatter.bytes() + gather.bytes()) as f64 / (copy_gbps * 1e9) * 1e3;
    Ok((before, after?, at_copy))
}

/// Sweeps every selected row, prints the tables, the summary, the `TABLE` lines and the
/// `sweep-json:` line.
fn print_sweep(gpu: &Gpu, opts: &Opts, copy_gbps: f64) -> BenchResult<()> {
    let started = Instant::now();
    let iters = if opts.quick {
        SWEEP_ITERS_QUICK
    } else {
        SWEEP_ITERS
    };
    println!(
        "\n## Sweep of the kernel variants ({} MiB buckets as the kernel rows, W = 4 as 2 x 2, \
         one rank's call)\n",
        opts.bucket_bytes / MIB
    );
    println!(
        "For each row, every candidate variant of its kernel and constants \
         (`variants::candidates`; the production variant is the table's or the default): one \
         call on outputs filled with garbage, byte-compared with the production variant's \
         output (which was checked to write the same bytes over other garbage; an output the \
         kernel also reads is restored first), then timed in two passes (the second in reverse \
         order), each {iters} calls between CUDA events after {} ms of warm-up, buffers rotated \
         beyond {ROTATE_L2_MULTIPLE} x the L2 ({:.0} MiB). Median and min over both passes' \
         calls; spread = the difference of the passes' medians over the median. x copy against \
         this run's device-to-device copy ({copy_gbps:.1} GB/s, {}).",
        SWEEP_WARMUP.as_millis(),
        gpu.info.l2_bytes as f64 / MIB as f64,
        gpu.info.name
    );
    let mut rows = Vec::new();
    for kernel_row in selected_rows(opts) {
        let row =
            kernel_row.with_site(gpu, opts, |site| sweep_row(gpu, opts, &kernel_row, site))?;
        print_sweep_row(&row, copy_gbps);
        rows.push(row);
    }
    let variants: usize = rows.iter().map(|r| r.swept.len()).sum();
    println!(
        "\n### Sweep summary\n\nA variant is chosen where it beats the production variant by \
         more than the two's spreads (at least {:.0}%). Target (issue 42): 0.75x the copy for \
         the fp32 gradient path, 0.5x for the bf16 path, qWD's encoding and the 8-to-4-bit \
         requantization, 0.85x for weight_apply and Global-QSGD.\n",
        100.0 * MIN_GAIN
    );
    println!(
        "| row | kernel | production | us | x copy | fastest | us | x copy | speed-up | target \
         | met: production / fastest |"
    );
    println!("|---|---|---|---:|---:|---|---:|---:|---:|---:|---|");
    let (mut met_production, mut met_fastest, mut faster) = (0, 0, 0);
    for r in &rows {
        let (p, f) = (r.production(), r.fastest());
        let (xp, xf) = (
            r.x_copy(p.median_ms, copy_gbps),
            r.x_copy(f.median_ms, copy_gbps),
        );
        met_production += usize::from(xp >= r.target);
        met_fastest += usize::from(xf >= r.target);
        faster += usize::from(r.chosen().spec != p.spec);
        println!(
            "| {} | {} | `{}` | {:.1} | {xp:.2} | `{}`{} | {:.1} | {xf:.2} | {:.2} | {} | {} / {} |",
            r.tag,
            p.spec.kernel.name(),
            p.name(),
            p.median_ms * 1e3,
            f.name(),
            if r.chosen().spec == f.spec && f.spec != p.spec {
                " (chosen)"
            } else {
                ""
            },
            f.median_ms * 1e3,
            p.median_ms / f.median_ms,
            r.target,
            verdict(xp >= r.target),
            verdict(xf >= r.target)
        );
    }
    let chosen: Vec<KernelSpec> = rows.iter().map(|r| r.chosen().spec).collect();
    if !rows.is_empty() {
        let (before, after, at_copy) = sequence_with(gpu, opts, &chosen, copy_gbps)?;
        println!(
            "\nPer-bucket sequence (the cost section's, {} Mi elements, fp32 gradients): {:.3} ms \
             with the production variants, {:.3} ms with the chosen ones; its bytes take {:.3} \
             ms at copy speed: {:.2}x and {:.2}x of that (target {SEQUENCE_TARGET}x: {} / {}).",
            cost_numels(opts)[0] >> 20,
            before,
            after,
            at_copy,
            before / at_copy,
            after / at_copy,
            verdict(before / at_copy <= SEQUENCE_TARGET),
            verdict(after / at_copy <= SEQUENCE_TARGET)
        );
    }
    let report = report_path(gpu, opts);
    println!(
        "\nLines of `TABLE` in src/backend/cuda/variants.rs for {} ({}), each row's chosen \
         variant, naming the report `{report}`:\n",
        gpu.kernels.arch(),
        gpu.info.name
    );
    println!("```rust\n({}, &[", arch_expr(gpu.kernels.arch()));
    let mut seen = Vec::new();
    for spec in &chosen {
        if !seen.contains(&(spec.kernel, spec.constants)) {
            seen.push((spec.kernel, spec.constants));
            println!("    {}", table_line(spec, &report));
        }
    }
    println!("]),\n```");
    println!(
        "\nsweep: {variants} variants of {} rows byte-equal to the production kernels in {:.0} \
         s; {met_fastest} of {} rows meet their targets at the fastest variant (production: \
         {met_production}); {faster} rows have a variant faster beyond the noise.",
        rows.len(),
        started.elapsed().as_secs_f64(),
        rows.len()
    );
    let json_rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"row\": {}, \"label\": {}, \"kernel\": {}, \"read\": {}, \"written\": {}, \
                 \"elements\": {}, \"target\": {}, \"production\": {}, \"fastest\": {}, \
                 \"chosen\": {}, \"variants\": [{}]}}",
                json_str(r.tag),
                json_str(r.label),
                json_str(r.production().spec.kernel.name()),
                r.read,
                r.written,
                r.elements,
                r.target,
                swept_json(r.production()),
                swept_json(r.fastest()),
                swept_json(r.chosen()),
                r.swept
                    .iter()
                    .map(swept_json)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
        .collect();
    println!(
        "\nsweep-json: {{\"device\": {}, \"arch\": \"{}\", \"copy_gbps\": {copy_gbps:.3}, \
         \"bucket_bytes\": {}, \"report\": {}, \"rows\": [{}]}}",
        json_str(&gpu.info.name),
        gpu.kernels.arch(),
        opts.bucket_bytes,
        json_str(&report),
        json_rows.join(", ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Section `profile`.

/// Launches each selected row's kernel once, with the variant it runs with here, and prints
/// which entry point each launch was (`profile-json:`), for a profiler to attribute its
/// measurements to rows.
fn print_profile(gpu: &Gpu, opts: &Opts) -> BenchResult<()> {
    println!(
        "\n## Profile launches\n\nEach row's kernel launched once (no warm-up, nothing timed), \
         for `ncu`:\n"
    );
    println!("| row | entry point | grid/SM | elements | bytes |");
    println!("|---|---|---:|---:|---:|");
    let mut json = Vec::new();
    for row in selected_rows(opts) {
        let (spec, elements, bytes) = row.with_site(gpu, opts, |site| {
            let spec = gpu.kernels.spec(site.kernel, site.constants)?;
            (site.launch)(0)?;
            gpu.stream.synchronize()?;
            Ok((spec, site.elements, site.read + site.written))
        })?;
        println!(
            "| {} | `{spec}` | {} | {elements} | {bytes} |",
            row.tag(),
            spec.variant.grid_blocks
        );
        json.push(format!(
            "{{\"row\": {}, \"label\": {}, \"entry\": {}, \"grid_blocks\": {}, \"elements\": \
             {elements}, \"bytes\": {bytes}}}",
            json_str(row.tag()),
            json_str(row.label),
            json_str(&spec.entry()),
            spec.variant.grid_blocks
        ));
    }
    gpu.context.check_err()?;
    println!(
        "\nprofile-json: {{\"device\": {}, \"rows\": [{}]}}",
        json_str(&gpu.info.name),
        json.join(", ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Output.

/// The header: device, driver, date and command.
fn print_header(gpu: &Gpu, opts: &Opts, variants: &[KernelSpec]) {
    let info = &gpu.info;
    let (major, minor) = info.capability;
    let mut env = String::new();
    if opts.quick {
        env.push_str("SDP4BIT_BENCH_QUICK=1 ");
    }
    if !opts.only.is_empty() {
        env.push_str(&format!("SDP4BIT_BENCH_ONLY={:?} ", opts.only));
    }
    if !opts.sections_env.is_empty() {
        env.push_str(&format!("SDP4BIT_BENCH_SECTIONS={} ", opts.sections_env));
    }
    if !opts.bucket_env.is_empty() {
        env.push_str(&format!("SDP4BIT_BENCH_BUCKET_MIB={} ", opts.bucket_env));
    }
    if !opts.variants.is_empty() {
        env.push_str("SDP4BIT_BENCH_VARIANTS=... ");
    }
    println!("# sdp4bit GPU benchmark\n");
    println!(
        "- device: {} (ordinal 0), compute capability {major}.{minor}, {} SMs, {:.0} MiB L2, \
         {:.1} GiB memory",
        info.name,
        info.multiprocessors,
        info.l2_bytes as f64 / MIB as f64,
        info.memory_bytes as f64 / (1u64 << 30) as f64
    );
    println!(
        "- driver: CUDA {}.{} (`cuDriverGetVersion` = {})",
        info.driver_version / 1000,
        info.driver_version % 1000 / 10,
        info.driver_version
    );
    println!(
        "- kernels: NVRTC for {}, specialised and compiled at first use ({}; opened in {:.2} s)",
        gpu.kernels.arch(),
        gpu.kernels.target().target,
        gpu.compile_secs
    );
    if !variants.is_empty() {
        let names: Vec<String> = variants
            .iter()
            .map(|s| format!("`{s}` grid {}", s.variant.grid_blocks))
            .collect();
        println!(
            "- variants set (SDP4BIT_BENCH_VARIANTS): {}",
            names.join(", ")
        );
    }
    println!("- date: {}", utc_now());
    println!("- command: `{env}cargo bench --bench gpu`");
}

/// The note on peer kernels, which need torch.
fn print_peers() {
    println!(
        "\n## Peer kernels\n\nbitsandbytes' blockwise 4-bit quantization and DeepSpeed's \
         quantizer are Python/torch libraries and are not run by this benchmark, which has \
         no torch: a side-by-side comparison on the same GPU needs a torch environment."
    );
}

/// Runs the selected sections.
fn run(opts: &Opts) -> BenchResult<()> {
    let gpu = Gpu::open()?;
    let variants = apply_variants(&gpu, opts)?;
    print_header(&gpu, opts, &variants);
    let timed = ["kernels", "cost", "concurrent", "sweep"];
    let copy = if timed.iter().any(|s| opts.runs(s)) {
        let copy = copy_row(&gpu, opts)?;
        println!(
            "- device-to-device copy: {:.1} GB/s (read + written; {} MiB, median {:.1} us of {} \
             calls)",
            copy.gbps(),
            opts.bucket_bytes / MIB,
            copy.time.median_ms * 1e3,
            opts.iters
        );
        Some(copy)
    } else {
        None
    };
    let copy_gbps = copy.as_ref().map_or(f64::NAN, Row::gbps);
    if let Some(copy) = copy.as_ref().filter(|_| opts.runs("kernels")) {
        print_kernels(&gpu, opts, copy)?;
    }
    if opts.runs("cost") {
        print_costs(&gpu, opts, copy_gbps)?;
    }
    if opts.runs("concurrent") {
        print_concurrent(&gpu, opts)?;
    }
    if opts.runs("sweep") {
        print_sweep(&gpu, opts, copy_gbps)?;
    }
    if opts.runs("profile") {
        print_profile(&gpu, opts)?;
    }
    if opts.runs("kernels") {
        print_peers();
    }
    Ok(())
}

fn main() -> ExitCode {
    if let Some(reason) = skip_reason() {
        if std::env::var("SDP4BIT_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            eprintln!("error: SDP4BIT_REQUIRE_GPU=1 but {reason}");
            return ExitCode::FAILURE;
        }
        println!("skipped: {reason}");
        return ExitCode::SUCCESS;
    }
    match Opts::from_env().and_then(|opts| run(&opts)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
