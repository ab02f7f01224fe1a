//! GPU benchmark of the fused CUDA kernels against a device-to-device copy.
//!
//! Run with `cargo bench --bench gpu` on a host with an NVIDIA GPU, its driver (CUDA 13) and
//! NVRTC on the loader's path (`scripts/test.sh` installs NVRTC into `.cache/`; put its `lib`
//! directory on `LD_LIBRARY_PATH`). `SDP4BIT_BENCH_QUICK=1` shrinks sizes and iterations to a
//! smoke run; `SDP4BIT_BENCH_ONLY=<text>` keeps only the kernel rows whose label contains the
//! text (the copy baseline always runs); `SDP4BIT_BENCH_SECTIONS=kernels` or `=cost` runs one
//! of the two sections (below). Without a driver, NVRTC or a device it prints
//! `skipped: <reason>` and exits 0, unless `SDP4BIT_REQUIRE_GPU=1` turns the skip into a
//! failure.
//!
//! Prints markdown: the device, driver, date and command, then one row per kernel with the
//! bytes it reads and writes per call, the median and fastest time over the timed calls (CUDA
//! events around each call, on one stream kept busy so launch latency is hidden), the
//! achieved bandwidth `(bytes read + bytes written) / median time`, and its ratio to a
//! `cuMemcpyDtoDAsync` of one bucket measured in the same run (counted as read + written,
//! 2x the bytes copied). The target is 0.8x the copy for every fused kernel: a fused pass
//! should cost little more than moving its bytes once.
//!
//! Every kernel runs with the sizes one rank of W = 4 (2 nodes x 2 ranks for the two-level
//! codecs) sees for a 256 MiB bucket: 64 Mi fp32 gradient elements, 128 Mi bf16 parameters.
//! Inputs are generated once on the host and uploaded; received slabs are real encodings made
//! by the CPU backend (the reference), so the decoding kernels see valid scales. Kernels whose
//! traffic per call is below a few L2 caches cycle through several device copies of their
//! buffers (filled by device-to-device copies), so every row measures DRAM traffic like the
//! copy it is compared with.
//!
//! A second section, the per-bucket cost, times the whole sequence of compression kernels one
//! rank runs per step for a bucket of 64 Mi and 256 Mi elements (sdp4bit preset, fp32 and bf16
//! gradients; qWD on bf16 params of the same count), and prints the figures as a `cost-json:`
//! line that `bench/gpu_cost.py` puts against a GEMM step of a GPT layer of that size.
//!
//! Peer kernels (bitsandbytes' blockwise 4-bit quantization, DeepSpeed's quantizer) are
//! Python/torch libraries and are not run here: the torch extension's Python benchmark times
//! them side by side with these kernels.

use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytemuck::Pod;
use cudarc::driver::sys::{self, CUdevice_attribute, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, ValidAsZeroBits,
};
use half::bf16;
use rayon::prelude::*;

use sdp4bit::backend::GradElement;
use sdp4bit::backend::cpu::{global_qsgd, gradient, weight};
use sdp4bit::backend::cuda::{DeviceSpan, Kernels, Stream, dest_table, device_count, probe};
use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::collective::global_k;
use sdp4bit::layout::{BucketPlan, GradLayout, GradRoute, Topology};
use sdp4bit::rng::UniformStream;
use sdp4bit::{Config, Preset, Rounding};

mod common;
use common::{gradients, params, updated, utc_now};

const MIB: usize = 1 << 20;
/// DP ranks of the simulated job (2 nodes x 2 ranks).
const WORLD: usize = 4;
/// The target: every fused kernel at this fraction of the copy's bandwidth or more.
const TARGET: f64 = 0.8;
/// A kernel's buffers are copied until the bytes touched between two uses of the same copy
/// reach this many L2 caches.
const ROTATE_L2_MULTIPLE: usize = 4;

/// The oldest driver (`cuDriverGetVersion`) with every symbol cudarc's CUDA 13 bindings call
/// here: `cuEventElapsedTime_v2` arrived in CUDA 12.8. Older drivers would make cudarc panic.
const MIN_DRIVER_VERSION: i32 = 12080;

/// Errors of the benchmark: driver calls, launches, plans.
type BenchResult<T> = Result<T, Box<dyn Error>>;

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
    /// `SDP4BIT_BENCH_SECTIONS`: the sections to run (`kernels`, `cost`; empty: both).
    sections: String,
}

impl Opts {
    /// The full run, or the quick smoke run when `SDP4BIT_BENCH_QUICK` is set to a non-empty,
    /// non-`0` value.
    fn from_env() -> Self {
        let quick = std::env::var("SDP4BIT_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        let only = std::env::var("SDP4BIT_BENCH_ONLY").unwrap_or_default();
        let sections = std::env::var("SDP4BIT_BENCH_SECTIONS").unwrap_or_default();
        if quick {
            Self {
                bucket_bytes: 16 * MIB,
                warmup: Duration::ZERO,
                iters: 5,
                quick,
                only,
                sections: sections.clone(),
            }
        } else {
            Self {
                bucket_bytes: 256 * MIB,
                warmup: Duration::from_millis(500),
                iters: 51,
                quick,
                only,
                sections,
            }
        }
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
    fn selects_section(&self, name: &str) -> bool {
        self.sections.is_empty() || self.sections.split(',').any(|s| s.trim() == name)
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
    /// The legacy default stream of the primary context: one in-order stream, so cudarc tracks
    /// no events and nothing but the benchmark's own work runs between the timing events.
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    /// Seconds NVRTC compilation and module loading took.
    compile_secs: f64,
}

impl Gpu {
    /// Compiles and loads the kernels on device 0 and opens a stream there.
    fn open() -> BenchResult<Self> {
        let start = Instant::now();
        let kernels = Kernels::get(0)?;
        let compile_secs = start.elapsed().as_secs_f64();
        let context = CudaContext::new(0)?;
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
                // device 0. Every row keeps its buffers alive until `time_calls` has
                // synchronised the stream its launches run on, and no other work writes them.
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

/// Median and fastest of the timed calls of one measurement, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Timing {
    median_ms: f64,
    min_ms: f64,
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
    let mut ms = events
        .iter()
        .map(|(start, end)| start.elapsed_ms(end).map(f64::from))
        .collect::<Result<Vec<_>, DriverError>>()?;
    ms.sort_by(f64::total_cmp);
    Ok(Timing {
        median_ms: ms[ms.len() / 2],
        min_ms: ms[0],
    })
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

/// One row of the table.
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

/// `grad_quantize_first` of the whole bucket of `G`: reads the bucket, writes every slab.
fn grad_first_row<G: GradElement + Pod>(
    gpu: &Gpu,
    opts: &Opts,
    name: &str,
    config: &Config,
) -> BenchResult<Row> {
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
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        let (k, s) = (gpu.kernels, gpu.stream());
        Ok(k.grad_quantize_first(s, &layout, bucket[c], dests, &rng, out[c])?)
    })?;
    Ok(Row {
        name: name.into(),
        read,
        written,
        time,
    })
}

/// `grad_requantize_second` of chunk 0 on rank 0: reads the `D` first-level slabs, writes the
/// `M` second-level slabs.
fn grad_second_row(gpu: &Gpu, opts: &Opts, name: &str, config: &Config) -> BenchResult<Row> {
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
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        let (k, s) = (gpu.kernels, gpu.stream());
        Ok(k.grad_requantize_second(s, &layout, 0, 0, recv[c], dests, &rng, out[c])?)
    })?;
    Ok(Row {
        name: name.into(),
        read,
        written,
        time,
    })
}

/// `grad_reduce_final` of chunk 0 on rank 0: reads the last level's slabs, writes the shard
/// of `G`.
fn grad_final_row<G: GradElement>(
    gpu: &Gpu,
    opts: &Opts,
    name: &str,
    config: &Config,
) -> BenchResult<Row> {
    let layout = grad_layout(config, opts.grad_numel())?;
    let recv_host = cpu_last_recv(&layout, 30)?;
    let shard_len = layout.bucket.shard_len;
    let (read, written) = (recv_host.len(), shard_len * size_of::<G>());
    let copies = gpu.copies(read + written);
    let recvs = gpu.replicate(&recv_host, copies)?;
    let shards = grad_zeroed::<G>(gpu, shard_len, copies)?;
    let (recv, shard) = (gpu.spans(&recvs), gpu.typed_spans::<G>(&shards));
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        let (k, s) = (gpu.kernels, gpu.stream());
        Ok(k.grad_reduce_final(s, &layout, 0, recv[c], shard[c])?)
    })?;
    Ok(Row {
        name: name.into(),
        read,
        written,
        time,
    })
}

/// `weight_encode` (qWD difference) of rank 0's shard: reads the new and the previous bf16
/// shard, writes one slab.
fn weight_encode_row(gpu: &Gpu, opts: &Opts, name: &str, config: &Config) -> BenchResult<Row> {
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
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        let (k, st) = (gpu.kernels, gpu.stream());
        let (n, r) = (new[c], reference[c]);
        Ok(k.weight_encode(st, &layout, enc, first_index, n, r, &rng, out[c])?)
    })?;
    Ok(Row {
        name: name.into(),
        read,
        written,
        time,
    })
}

/// `weight_apply` (qWD difference) of all W slabs into the bf16 bucket on rank 0: reads the
/// slabs, the own previous shard and the other shards' params, writes the whole bucket.
fn weight_apply_row(gpu: &Gpu, opts: &Opts, name: &str, config: &Config) -> BenchResult<Row> {
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
    let buckets = gpu.replicate(&bits(&old), copies)?;
    let (recv, own) = (gpu.spans(&recvs), gpu.bf16_spans(&owns));
    let bucket = gpu.bf16_spans(&buckets);
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        let (k, st) = (gpu.kernels, gpu.stream());
        Ok(k.weight_apply(st, &layout, enc, &plan, 0, recv[c], own[c], bucket[c])?)
    })?;
    Ok(Row {
        name: name.into(),
        read,
        written,
        time,
    })
}

/// `global_absmax` of the whole fp32 bucket (reads it; the 4-byte result is not counted).
fn global_absmax_row(gpu: &Gpu, opts: &Opts, name: &str) -> BenchResult<Row> {
    let numel = opts.grad_numel();
    let read = numel * 4;
    let copies = gpu.copies(read);
    let buckets = gpu.replicate(&gradients(numel, 80), copies)?;
    let words = gpu.zeroed::<u32>(1, copies)?;
    let (bucket, word) = (gpu.spans(&buckets), gpu.spans(&words));
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        Ok(gpu
            .kernels
            .global_absmax(gpu.stream(), bucket[c], word[c])?)
    })?;
    Ok(Row {
        name: name.into(),
        read,
        written: 0,
        time,
    })
}

/// `global_quantize_i8` (stochastic, K for W = 4) of the whole fp32 bucket.
fn global_quantize_row(gpu: &Gpu, opts: &Opts, name: &str) -> BenchResult<Row> {
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
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        let (kernels, s) = (gpu.kernels, gpu.stream());
        Ok(kernels.global_quantize(s, bucket[c], scale, k, sr, &rng, out[c])?)
    })?;
    Ok(Row {
        name: name.into(),
        read,
        written,
        time,
    })
}

/// `global_dequantize_i8` of rank 0's summed int8 shard into fp32.
fn global_dequantize_row(gpu: &Gpu, opts: &Opts, name: &str) -> BenchResult<Row> {
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
    let time = time_calls(gpu, opts, copies, |i| {
        let c = i % copies;
        Ok(gpu
            .kernels
            .global_dequantize(gpu.stream(), sum[c], 1e-5, out[c])?)
    })?;
    Ok(Row {
        name: name.into(),
        read,
        written,
        time,
    })
}

/// A kernel row's measurement.
type RowFn = Box<dyn Fn(&Gpu, &Opts, &str) -> BenchResult<Row>>;

/// One kernel row: its label, the kernel it times (as `kernels/` names it) and how.
struct KernelRow {
    label: &'static str,
    kernel: &'static str,
    measure: RowFn,
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
    let with = |config: Config, f: fn(&Gpu, &Opts, &str, &Config) -> BenchResult<Row>| {
        Box::new(move |gpu: &Gpu, opts: &Opts, name: &str| f(gpu, opts, name, &config)) as RowFn
    };
    let row = |label, kernel, measure| KernelRow {
        label,
        kernel,
        measure,
    };
    vec![
        row(
            "(1) grad first: H32 + 8-bit SR quantize + swizzle (tlq-hs, 2x2)",
            "grad_quantize_first",
            with(sdp, grad_first_row::<f32>),
        ),
        row(
            "(1b) grad first from a bf16 bucket",
            "grad_quantize_first_bf16",
            with(sdp, grad_first_row::<bf16>),
        ),
        row(
            "(2) grad second: dequantize + sum D=2 + 4-bit SR requantize",
            "grad_requantize_second",
            with(sdp, grad_second_row),
        ),
        row(
            "(3) grad last: dequantize + sum M=2 + inverse H32 into shard",
            "grad_reduce_final",
            with(sdp, grad_final_row::<f32>),
        ),
        row(
            "(3b) grad last into a bf16 shard",
            "grad_reduce_final_bf16",
            with(sdp, grad_final_row::<bf16>),
        ),
        row(
            "(4) qWD encode: bf16 new - ref, 4-bit SR g2048",
            "weight_encode",
            with(sdp, weight_encode_row),
        ),
        row(
            "(5) qWD apply: dequantize W=4 slabs + add + bf16 round",
            "weight_apply",
            with(sdp, weight_apply_row),
        ),
        row(
            "(6a) QSDP grad quantize: 8-bit asym SR g1024 (one level, W=4)",
            "grad_quantize_first",
            with(qsdp, grad_first_row::<f32>),
        ),
        row(
            "(6b) QSDP grad dequantize + sum W=4 into shard",
            "grad_reduce_final",
            with(qsdp, grad_final_row::<f32>),
        ),
        row(
            "(7) ZeRO++ grad quantize: 4-bit RN g128 + swizzle (2x2)",
            "grad_quantize_first",
            with(zeropp, grad_first_row::<f32>),
        ),
        row(
            "(8a) Global-QSGD absmax",
            "global_absmax",
            Box::new(global_absmax_row),
        ),
        row(
            "(8b) Global-QSGD quantize: int8 SR, K=31",
            "global_quantize_i8",
            Box::new(global_quantize_row),
        ),
        row(
            "(8c) Global-QSGD dequantize: int8 sum -> fp32 shard",
            "global_dequantize_i8",
            Box::new(global_dequantize_row),
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// Per-bucket cost.

/// Bucket sizes (elements) of the per-bucket cost, and of the quick run's.
const COST_NUMELS: [usize; 2] = [64 << 20, 256 << 20];
const COST_NUMELS_QUICK: [usize; 1] = [1 << 20];

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
}

/// The reduce-scatter's kernels for a bucket of `numel` elements of `G`, in the order one rank
/// runs them, timed as one call. Chunk `c` of the first-level send buffer stands for chunk
/// `c`'s first-level receive buffer, and the second-level send buffer for the last level's
/// receive buffer (the same layouts, valid encodings).
fn reduce_scatter_cost<G: GradElement + Pod>(
    gpu: &Gpu,
    opts: &Opts,
    numel: usize,
) -> BenchResult<Timing> {
    let layout = grad_layout(&Config::preset(Preset::Sdp4bit), numel)?;
    let second = layout.second.ok_or("a two-level layout")?;
    let chunk_bytes = layout.first.peers * layout.first.slab.byte_len();
    let buckets = grad_buffers::<G>(gpu, &gradients(numel, 110), 1)?;
    let firsts = gpu.zeroed::<u8>(first_send_len(&layout), 1)?;
    let seconds = gpu.zeroed::<u8>(second.peers * second.slab.byte_len(), 1)?;
    let shards = grad_zeroed::<G>(gpu, layout.bucket.shard_len, 1)?;
    let dests = gpu.replicate(&dest_table(&layout)?, 1)?;
    let (bucket, shard) = (
        gpu.typed_spans::<G>(&buckets)[0],
        gpu.typed_spans::<G>(&shards)[0],
    );
    let (first, second_out, dests) = (
        gpu.spans(&firsts)[0],
        gpu.spans(&seconds)[0],
        gpu.spans(&dests)[0],
    );
    let (rng_first, rng_second) = (UniformStream::new(1, 1, 8), UniformStream::new(1, 1, 9));
    time_calls(gpu, opts, 1, |_| {
        let (k, s) = (gpu.kernels, gpu.stream());
        k.grad_quantize_first(s, &layout, bucket, dests, &rng_first, first)?;
        for chunk in 0..layout.bucket.chunks {
            // SAFETY: chunk `chunk`'s bytes of the first-level send buffer, inside it.
            let recv = unsafe {
                DeviceSpan::from_raw(first.addr() + (chunk * chunk_bytes) as u64, chunk_bytes)
            };
            k.grad_requantize_second(s, &layout, 0, chunk, recv, dests, &rng_second, second_out)?;
            k.grad_reduce_final(s, &layout, chunk, second_out, shard)?;
        }
        Ok(())
    })
}

/// The all-gather's kernels (qWD) for a bf16 bucket of `numel` elements, timed as one call:
/// the own shard's encoding, then the W received slabs applied to the bucket (every slab a
/// copy of the own one, made once before timing).
fn all_gather_cost(gpu: &Gpu, opts: &Opts, numel: usize) -> BenchResult<Timing> {
    let config = Config::preset(Preset::Sdp4bit);
    let (layout, plan) = weight_layout(&config, numel)?;
    let s = plan.shard_len;
    let old = params(numel, 120);
    let news = gpu.replicate(&bits(&updated(&old[..s], 130)), 1)?;
    let references = gpu.replicate(&bits(&old[..s]), 1)?;
    let buckets = gpu.replicate(&bits(&old), 1)?;
    let recvs = gpu.zeroed::<u8>(WORLD * layout.byte_len(), 1)?;
    let (new, reference) = (gpu.bf16_spans(&news)[0], gpu.bf16_spans(&references)[0]);
    let (bucket, recv) = (gpu.bf16_spans(&buckets)[0], gpu.spans(&recvs)[0]);
    // SAFETY: the first slab of the receive buffer, inside it.
    let own_slab = unsafe { DeviceSpan::from_raw(recv.addr(), layout.byte_len()) };
    let (rng, first_index, enc) = (
        UniformStream::new(1, 1, 10),
        plan.padded_index(0, 0),
        WeightEncoding::Difference,
    );
    gpu.kernels.weight_encode(
        gpu.stream(),
        &layout,
        enc,
        first_index,
        new,
        reference,
        &rng,
        own_slab,
    )?;
    for peer in 1..WORLD {
        let offset = (peer * layout.byte_len()) as u64;
        // SAFETY: slab `peer` and slab 0 of the receive buffer, disjoint, on device 0; the
        // legacy default stream orders the copy after the encoding.
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                recv.addr() + offset,
                recv.addr(),
                layout.byte_len(),
                gpu.stream.cu_stream(),
            )
        }
        .result()?;
    }
    time_calls(gpu, opts, 1, |_| {
        let (k, st) = (gpu.kernels, gpu.stream());
        k.weight_encode(
            st,
            &layout,
            enc,
            first_index,
            new,
            reference,
            &rng,
            own_slab,
        )?;
        Ok(k.weight_apply(st, &layout, enc, &plan, 0, recv, reference, bucket)?)
    })
}

/// Measures the per-bucket cost for every size and gradient type.
fn costs(gpu: &Gpu, opts: &Opts) -> BenchResult<Vec<Cost>> {
    let numels: &[usize] = if opts.quick {
        &COST_NUMELS_QUICK
    } else {
        &COST_NUMELS
    };
    let mut out = Vec::new();
    for &numel in numels {
        let all_gather = all_gather_cost(gpu, opts, numel)?;
        out.push(Cost {
            numel,
            grad: "fp32",
            reduce_scatter: reduce_scatter_cost::<f32>(gpu, opts, numel)?,
            all_gather,
        });
        out.push(Cost {
            numel,
            grad: "bf16",
            reduce_scatter: reduce_scatter_cost::<bf16>(gpu, opts, numel)?,
            all_gather,
        });
    }
    Ok(out)
}

/// Prints the per-bucket cost table and the same figures as one JSON line (`cost-json: `),
/// which `bench/gpu_cost.py` reads to put them against a GEMM step.
fn print_costs(gpu: &Gpu, opts: &Opts) -> BenchResult<()> {
    let costs = costs(gpu, opts)?;
    println!(
        "\n## Per-bucket cost (one rank's compression kernels per step, sdp4bit preset, W = 4 \
         as 2 x 2)\n\nMedian of {} calls, each the rank's whole sequence of launches between two \
         CUDA events; the exchanges are not included. The all-gather is qWD on bf16 params of \
         the bucket's element count.\n",
        opts.iters
    );
    println!(
        "| bucket elements | gradients | reduce-scatter kernels ms | all-gather kernels ms | both ms |"
    );
    println!("|---:|---|---:|---:|---:|");
    let mut json = Vec::new();
    for c in &costs {
        let (rs, ag) = (c.reduce_scatter.median_ms, c.all_gather.median_ms);
        println!(
            "| {} Mi | {} | {rs:.3} | {ag:.3} | {:.3} |",
            c.numel >> 20,
            c.grad,
            rs + ag
        );
        json.push(format!(
            "{{\"numel\": {}, \"grad\": \"{}\", \"reduce_scatter_ms\": {rs:.6}, \"all_gather_ms\": {ag:.6}}}",
            c.numel, c.grad
        ));
    }
    println!(
        "\ncost-json: {{\"device\": \"{}\", \"preset\": \"sdp4bit\", \"world\": \"2x2\", \"rows\": [{}]}}",
        gpu.info.name,
        json.join(", ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Output.

/// The header: device, driver, date and command.
fn print_header(gpu: &Gpu, opts: &Opts) {
    let info = &gpu.info;
    let (major, minor) = info.capability;
    let mut env = String::new();
    if opts.quick {
        env.push_str("SDP4BIT_BENCH_QUICK=1 ");
    }
    if !opts.only.is_empty() {
        env.push_str(&format!("SDP4BIT_BENCH_ONLY={:?} ", opts.only));
    }
    if !opts.sections.is_empty() {
        env.push_str(&format!("SDP4BIT_BENCH_SECTIONS={} ", opts.sections));
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
        "- kernels: NVRTC for {}, compiled and loaded in {:.2} s",
        gpu.kernels.arch(),
        gpu.compile_secs
    );
    println!("- date: {}", utc_now());
    println!("- command: `{env}cargo bench --bench gpu`");
}

/// Prints the kernel table against the copy baseline and the target summary.
fn print_kernels(gpu: &Gpu, opts: &Opts) -> BenchResult<()> {
    let copy = copy_row(gpu, opts)?;
    let base = copy.gbps();
    println!(
        "\n## Fused kernels ({} MiB buckets, W = 4 as 2 nodes x 2 ranks, one rank's call)\n",
        opts.bucket_bytes / MIB
    );
    println!(
        "GB/s = (bytes read + bytes written) / median time, 1e9 bytes; {} timed calls per row \
         after at least {} ms of warm-up, each between two CUDA events on one busy stream. \
         x copy = GB/s / the device-to-device copy of this run ({base:.1} GB/s). Buffers \
         rotated beyond {ROTATE_L2_MULTIPLE} x the L2. Target: {TARGET}x the copy.\n",
        opts.iters,
        opts.warmup.as_millis()
    );
    println!(
        "| row | kernel | read MiB | written MiB | median us | min us | GB/s | x copy | target |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---|");
    print_row(&copy, "-", base, None);
    let mut missed = Vec::new();
    let mut measured = 0;
    for kernel in kernel_rows().iter().filter(|k| opts.selects(k.label)) {
        let row = (kernel.measure)(gpu, opts, kernel.label)?;
        let ok = row.gbps() >= TARGET * base;
        print_row(&row, kernel.kernel, base, Some(ok));
        measured += 1;
        if !ok {
            missed.push(
                kernel
                    .label
                    .split_whitespace()
                    .next()
                    .unwrap_or(kernel.label),
            );
        }
    }
    println!(
        "\n{} of {measured} kernels reach {TARGET}x the copy's bandwidth{}.",
        measured - missed.len(),
        if missed.is_empty() {
            String::new()
        } else {
            format!(" (below: {})", missed.join(", "))
        }
    );
    Ok(())
}

/// One table row of `kernel`; `ok` is whether a kernel row meets the target (`None` for the
/// baseline).
fn print_row(row: &Row, kernel: &str, base: f64, ok: Option<bool>) {
    let mib = |bytes: usize| bytes as f64 / MIB as f64;
    let target = match ok {
        None => "-",
        Some(true) => "met",
        Some(false) => "**missed**",
    };
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

/// The note on peer kernels, which need torch.
fn print_peers() {
    println!(
        "\n## Peer kernels\n\nbitsandbytes' blockwise 4-bit quantization and DeepSpeed's \
         quantizer are Python/torch libraries and are not run by this benchmark, which has \
         no torch: a side-by-side comparison on the same GPU needs a torch environment."
    );
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
    let opts = Opts::from_env();
    let run = || -> BenchResult<()> {
        let gpu = Gpu::open()?;
        print_header(&gpu, &opts);
        if opts.selects_section("kernels") {
            print_kernels(&gpu, &opts)?;
        }
        if opts.selects_section("cost") {
            print_costs(&gpu, &opts)?;
        }
        print_peers();
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
