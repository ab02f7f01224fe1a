//! Config parsing and the per-bucket collectives behind the bridge.

use half::bf16;

use super::bridge::{TorchComms, WireBytes};
use super::torch_comm::TorchLevels;
use super::torch_memory::TorchCachingAllocator;
use super::{FfiResult, guard, register_profiler_ranges};
use crate::backend::cpu::Host;
use crate::backend::cuda::{
    Allocator, Cuda, DeviceSpan, Kernels, StatusReadback, Stream, new_priority_stream, probe,
};
use crate::collective::{self, Comm, GradReduceScatter, WeightAllGather};
use crate::config::{Config, Preset};
use crate::error::{Error, Result};
use crate::kernel_check::{Collective, check_bucket, check_bucket_once};
use crate::layout::Topology;

/// A config spec as the core parsed it: the validated [`Config`], or why it is invalid. The
/// set-up agreement takes part with an invalid one, so that every rank fails at once naming
/// this one; every other use returns its error.
pub(super) struct ParsedConfig(Result<Config>);

/// Parses `preset[;knob=value]*`; never fails (see [`ParsedConfig`]).
pub(super) fn parse_config(spec: &str) -> Box<ParsedConfig> {
    let parsed = guard("parse_config", || Ok(parse(spec)));
    Box::new(ParsedConfig(
        parsed.unwrap_or_else(|panic| Err(Error::Config(panic))),
    ))
}

fn parse(spec: &str) -> Result<Config> {
    let mut parts = spec.split(';').map(str::trim).filter(|p| !p.is_empty());
    let preset: Preset = parts
        .next()
        .ok_or_else(|| Error::Config("empty config: expected a preset name".to_string()))?
        .parse()
        .map_err(Error::Config)?;
    let overrides = parts
        .map(|part| {
            part.split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| Error::Config(format!("'{part}' is not of the form knob=value")))
        })
        .collect::<Result<Vec<_>>>()?;
    Config::from_overrides(preset, overrides)
}

impl ParsedConfig {
    /// The config, or why the spec is invalid.
    pub(super) fn config(&self) -> Result<&Config> {
        self.0.as_ref().map_err(Clone::clone)
    }

    /// Why the spec is invalid, as an error.
    pub(super) fn check(&self) -> FfiResult<()> {
        self.config().map(|_| ()).map_err(|e| e.to_string())
    }
}

/// The topology of a DP group from each rank's node label.
fn topology(node_labels: &[u64]) -> Result<Topology> {
    Topology::from_node_labels(node_labels)
}

/// The buffers of the extension's CUDA buckets come from torch's caching allocator.
static TORCH_ALLOCATOR: TorchCachingAllocator = TorchCachingAllocator;

/// The CUDA backend of device `device` on the raw stream `stream` (the side stream of the
/// bucket's process groups, current on the calling thread), with buffers from torch.
pub(super) fn cuda(device: usize, stream: u64) -> Result<Cuda> {
    let kernels = Kernels::get(device)?;
    // SAFETY: the extension passes a stream of torch's pool on `device`, which torch never
    // destroys.
    let stream = unsafe { Stream::from_raw(stream as usize) };
    Ok(Cuda::new(kernels, stream).with_allocator(Allocator::Given(&TORCH_ALLOCATOR)))
}

/// `len` elements of `T` at device address `addr`.
///
/// # Safety
/// `addr` must be the data of a contiguous CUDA tensor of `len` elements on the backend's
/// device that the extension keeps alive until the collective completes.
pub(super) unsafe fn span<T>(addr: u64, len: usize) -> DeviceSpan<T> {
    // SAFETY: forwarded to the caller.
    unsafe { DeviceSpan::from_raw(addr, len) }
}

/// Why `device` cannot run the collectives (no driver, no such device, a compile failure),
/// or an empty string when its kernels are ready.
pub(super) fn cuda_device_problem(device: usize) -> String {
    guard("cuda_device_problem", || Kernels::get(device).map(|_| ()))
        .err()
        .unwrap_or_default()
}

/// A new side stream of `device` for the extension's process groups ([`new_priority_stream`]),
/// as its raw `CUstream`.
pub(super) fn cuda_new_side_stream(device: usize) -> FfiResult<u64> {
    guard("cuda_new_side_stream", || {
        Ok(new_priority_stream(Kernels::get(device)?)?.handle() as u64)
    })
}

/// [`Kernels::describe`] of `device`, or why its kernels cannot load.
pub(super) fn cuda_device_report(device: usize) -> String {
    match guard("cuda_device_report", || Kernels::get(device)) {
        Ok(kernels) => kernels.describe(),
        Err(problem) => format!("CUDA device {device} cannot run the kernels: {problem}"),
    }
}

/// The NVRTC the kernels compile with (`13.0 (path)`), or why none loads.
pub(super) fn nvrtc_report() -> String {
    match guard("nvrtc_report", probe::nvrtc_library) {
        Ok(nvrtc) => format!(
            "{}.{} ({})",
            nvrtc.version.0,
            nvrtc.version.1,
            nvrtc.path.display()
        ),
        Err(problem) => format!("not found: {problem}"),
    }
}

/// Why the kernel check of a CUDA bucket fails (see the bridge's declaration), or "".
pub(super) fn cuda_bucket_problem(
    device: usize,
    config: &ParsedConfig,
    node_labels: &[u64],
    rank: usize,
    weights: bool,
) -> String {
    guard("cuda_bucket_problem", || {
        let (Ok(config), Ok(topology)) = (config.config(), topology(node_labels)) else {
            return Ok(());
        };
        let collective = if weights {
            Collective::WeightAllGather
        } else {
            Collective::GradReduceScatter
        };
        check_bucket_once(Kernels::get(device)?, collective, config, &topology, rank)
    })
    .err()
    .unwrap_or_default()
}

/// [`check_bucket`] of both collectives on `device`.
pub(super) fn cuda_kernel_check(
    device: usize,
    config: &ParsedConfig,
    node_labels: &[u64],
    rank: usize,
) -> FfiResult<()> {
    guard("cuda_kernel_check", || {
        let kernels = Kernels::get(device)?;
        let topology = topology(node_labels)?;
        for collective in [Collective::GradReduceScatter, Collective::WeightAllGather] {
            check_bucket(kernels, collective, config.config()?, &topology, rank)?;
        }
        Ok(())
    })
}

/// [`GradReduceScatter`] for the extension, on host or CUDA buffers.
pub(super) enum GradBucket {
    Host(GradReduceScatter<Host>),
    /// Planned on the CUDA device of this ordinal; Global-QSGD's integer-sum status read back
    /// without waiting (docs/cuda.md).
    Cuda(GradReduceScatter<Cuda>, usize, Option<StatusReadback>),
}

/// Calls `$body` with `$rs` bound to the collective of either backend.
macro_rules! either {
    ($bucket:expr, $rs:ident => $body:expr) => {
        match $bucket {
            GradBucket::Host($rs) => $body,
            GradBucket::Cuda($rs, ..) => $body,
        }
    };
}

pub(super) fn new_grad_bucket(
    config: &ParsedConfig,
    node_labels: &[u64],
    rank: usize,
    numel: usize,
    bucket_id: u32,
) -> FfiResult<Box<GradBucket>> {
    register_profiler_ranges();
    guard("new_grad_bucket", || {
        let topology = topology(node_labels)?;
        GradReduceScatter::new(config.config()?, &topology, rank, numel, bucket_id)
            .map(|rs| Box::new(GradBucket::Host(rs)))
    })
}

pub(super) fn new_cuda_grad_bucket(
    config: &ParsedConfig,
    node_labels: &[u64],
    rank: usize,
    numel: usize,
    bucket_id: u32,
    device: usize,
    stream: u64,
) -> FfiResult<Box<GradBucket>> {
    register_profiler_ranges();
    guard("new_cuda_grad_bucket", || {
        let topology = topology(node_labels)?;
        // Planning allocates for the current stream, the side stream `stream`, and enqueues
        // its uploads there, after whatever used that memory before.
        let backend = cuda(device, stream)?;
        let mut rs = GradReduceScatter::with_backend(
            &backend,
            config.config()?,
            &topology,
            rank,
            numel,
            bucket_id,
        )?;
        let sums = match rs.integer_sum_status() {
            Some(_) => Some(StatusReadback::new(backend.kernels())?),
            None => None,
        };
        Ok(Box::new(GradBucket::Cuda(rs, device, sums)))
    })
}

impl GradBucket {
    pub(super) fn shard_len(&self) -> usize {
        either!(self, rs => rs.plan().shard_len)
    }

    pub(super) fn quantizes_at(&self, step: u64) -> bool {
        either!(self, rs => rs.quantizes_at(step))
    }

    pub(super) fn wire_bytes(&self, step: u64) -> WireBytes {
        either!(self, rs => rs.wire_bytes(step).into())
    }

    pub(super) fn baseline_wire_bytes(&self) -> WireBytes {
        either!(self, rs => rs.baseline_wire_bytes().into())
    }

    pub(super) fn notice(&self) -> String {
        either!(self, rs => rs.notice().unwrap_or_default().to_string())
    }

    pub(super) fn run(
        &mut self,
        comms: &TorchComms,
        bucket: &[f32],
        shard: &mut [f32],
        step: u64,
    ) -> FfiResult<()> {
        guard("GradBucket::run", || {
            let GradBucket::Host(rs) = self else {
                return Err(wrong_memory("gradient bucket", "CUDA", "host"));
            };
            let levels = TorchLevels::new(comms)?;
            rs.run(&levels.groups(), bucket, shard, step)
        })
    }

    pub(super) fn run_bf16(
        &mut self,
        comms: &TorchComms,
        bucket: &[u16],
        shard: &mut [u16],
        step: u64,
    ) -> FfiResult<()> {
        guard("GradBucket::run_bf16", || {
            let GradBucket::Host(rs) = self else {
                return Err(wrong_memory("gradient bucket", "CUDA", "host"));
            };
            let levels = TorchLevels::new(comms)?;
            let bucket: &[bf16] = bytemuck::cast_slice(bucket);
            let shard: &mut [bf16] = bytemuck::cast_slice_mut(shard);
            rs.run(&levels.groups(), bucket, shard, step)
        })
    }

    pub(super) fn run_cuda(
        &mut self,
        comms: &TorchComms,
        bucket: u64,
        shard: u64,
        bf16: bool,
        stream: u64,
        step: u64,
    ) -> FfiResult<()> {
        guard("GradBucket::run_cuda", || {
            let GradBucket::Cuda(rs, device, sums) = self else {
                return Err(wrong_memory("gradient bucket", "host", "CUDA"));
            };
            let plan = *rs.plan();
            let backend = cuda(*device, stream)?;
            let levels = TorchLevels::new(comms)?;
            if bf16 {
                // SAFETY: the extension checked that both tensors are contiguous bf16 CUDA
                // tensors of these sizes on this device and keeps them alive until the Work
                // completes.
                let (bucket, shard) = unsafe {
                    (
                        span::<half::bf16>(bucket, plan.numel),
                        span(shard, plan.shard_len),
                    )
                };
                rs.run_on(&backend, &levels.groups(), bucket, shard, step)?;
            } else {
                // SAFETY: as above, for fp32 tensors.
                let (bucket, shard) =
                    unsafe { (span::<f32>(bucket, plan.numel), span(shard, plan.shard_len)) };
                rs.run_on(&backend, &levels.groups(), bucket, shard, step)?;
            }
            if let (Some(sums), Some(status)) = (sums.as_mut(), rs.integer_sum_status()) {
                // SAFETY: `stream` is the live side stream the passes were enqueued on.
                sums.start(unsafe { Stream::from_raw(stream as usize) }, status)?;
            }
            Ok(())
        })
    }

    /// Whether this bucket reads Global-QSGD's integer-sum status back after each step (a CUDA
    /// Global-QSGD bucket).
    pub(super) fn reads_back_integer_sums(&self) -> bool {
        matches!(self, GradBucket::Cuda(_, _, Some(_)))
    }

    /// The integer-sum status word the copy enqueued after an earlier step read, once that
    /// copy has completed, else 0 (also for other buckets): never waits for the device (the
    /// overflowing shard elements are NaN meanwhile, which the framework's found-inf check
    /// sees).
    pub(super) fn take_integer_sum_status(&mut self) -> FfiResult<u32> {
        guard("GradBucket::take_integer_sum_status", || {
            let GradBucket::Cuda(_, _, Some(sums)) = self else {
                return Ok(0);
            };
            Ok(sums.take()?.unwrap_or(0))
        })
    }

    /// The host path's error for DP rank `rank`'s integer-sum status word `status`, or an empty
    /// string when it records no overflow.
    pub(super) fn integer_sum_error(&self, rank: usize, status: u32) -> String {
        either!(self, rs => rs.integer_sum_error(rank, status))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }
}
/// [`WeightAllGather`] for the extension, on host or CUDA buffers; host params cross the
/// bridge as bf16 bit patterns, CUDA params as a device address.
pub(super) enum WeightBucket {
    Host(WeightAllGather<Host>),
    /// Planned on the CUDA device of this ordinal.
    Cuda(WeightAllGather<Cuda>, usize),
}

/// Calls `$body` with `$ag` bound to the collective of either backend.
macro_rules! either_weight {
    ($bucket:expr, $ag:ident => $body:expr) => {
        match $bucket {
            WeightBucket::Host($ag) => $body,
            WeightBucket::Cuda($ag, _) => $body,
        }
    };
}

pub(super) fn new_weight_bucket(
    config: &ParsedConfig,
    node_labels: &[u64],
    rank: usize,
    bucket_id: u32,
    params: &[u16],
) -> FfiResult<Box<WeightBucket>> {
    register_profiler_ranges();
    guard("new_weight_bucket", || {
        let topology = topology(node_labels)?;
        let params: &[bf16] = bytemuck::cast_slice(params);
        WeightAllGather::new(config.config()?, &topology, rank, bucket_id, params)
            .map(|ag| Box::new(WeightBucket::Host(ag)))
    })
}

#[allow(clippy::too_many_arguments)]
pub(super) fn new_cuda_weight_bucket(
    config: &ParsedConfig,
    node_labels: &[u64],
    rank: usize,
    bucket_id: u32,
    device: usize,
    params: u64,
    numel: usize,
    stream: u64,
) -> FfiResult<Box<WeightBucket>> {
    register_profiler_ranges();
    guard("new_cuda_weight_bucket", || {
        let topology = topology(node_labels)?;
        let backend = cuda(device, stream)?;
        // SAFETY: the extension checked that `params` is a contiguous bf16 CUDA tensor of
        // `numel` elements on `device`, alive for this call (the copy of the reference is
        // ordered on `stream` before any later use of the tensor on it).
        let params = unsafe { span(params, numel) };
        WeightAllGather::with_backend(
            &backend,
            config.config()?,
            &topology,
            rank,
            bucket_id,
            params,
        )
        .map(|ag| Box::new(WeightBucket::Cuda(ag, device)))
    })
}

impl WeightBucket {
    pub(super) fn shard_len(&self) -> usize {
        either_weight!(self, ag => ag.plan().shard_len)
    }

    pub(super) fn wire_bytes(&self) -> WireBytes {
        either_weight!(self, ag => ag.wire_bytes().into())
    }

    pub(super) fn baseline_wire_bytes(&self) -> WireBytes {
        either_weight!(self, ag => ag.baseline_wire_bytes().into())
    }

    pub(super) fn run(
        &mut self,
        comms: &TorchComms,
        params: &mut [u16],
        step: u64,
    ) -> FfiResult<()> {
        guard("WeightBucket::run", || {
            let WeightBucket::Host(ag) = self else {
                return Err(wrong_memory("param bucket", "CUDA", "host"));
            };
            let levels = TorchLevels::new(comms)?;
            ag.run(levels.world(), bytemuck::cast_slice_mut(params), step)
        })
    }

    pub(super) fn run_cuda(
        &mut self,
        comms: &TorchComms,
        params: u64,
        stream: u64,
        step: u64,
    ) -> FfiResult<()> {
        guard("WeightBucket::run_cuda", || {
            let WeightBucket::Cuda(ag, device) = self else {
                return Err(wrong_memory("param bucket", "host", "CUDA"));
            };
            let backend = cuda(*device, stream)?;
            let levels = TorchLevels::new(comms)?;
            // SAFETY: the extension checked that `params` is a contiguous bf16 CUDA tensor of
            // the planned size on this device and keeps it alive until the Work completes.
            let params = unsafe { span(params, ag.plan().numel) };
            ag.run_on(&backend, levels.world(), params, step)
        })
    }
}

/// The error for a bucket planned in `planned` memory but run with `given` buffers.
pub(super) fn wrong_memory(what: &str, planned: &str, given: &str) -> Error {
    Error::Buffer(format!(
        "this {what} was planned for {planned} memory but was run with {given} tensors"
    ))
}

pub(super) fn agree_on_setup(
    comms: &TorchComms,
    config: &ParsedConfig,
    local_error: &str,
    bucket_id: u32,
    numel: usize,
) -> FfiResult<()> {
    guard("agree_on_setup", || {
        let levels = TorchLevels::new(comms)?;
        let world = levels.world();
        let local = Error::Buffer(local_error.to_string());
        let setup = match local_error {
            "" => config.0.as_ref(),
            _ => Err(&local),
        };
        collective::check_setup_agrees(world, setup, bucket_id, numel).map_err(|e| match e {
            Error::Comm(message) => Error::Comm(format!(
                "{message} [DP rank {} of {}]",
                Comm::<Host>::rank(world),
                Comm::<Host>::size(world)
            )),
            other => other,
        })
    })
}
