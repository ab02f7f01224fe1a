//! The all-reduce across the groups of hybrid sharding behind the bridge.

use half::bf16;

use super::bridge::TorchComms;
use super::buckets::{ParsedConfig, cuda, span, wrong_memory};
use super::torch_comm::TorchLevels;
use super::{FfiResult, guard, register_profiler_ranges};
use crate::backend::cpu::Host;
use crate::backend::cuda::Cuda;
use crate::collective::CrossGroupAllReduce;

/// [`CrossGroupAllReduce`] for the extension, on host or CUDA buffers (of the CUDA device of
/// this ordinal).
pub(super) enum CrossGroupBucket {
    Host(CrossGroupAllReduce<Host>),
    Cuda(CrossGroupAllReduce<Cuda>, usize),
}

/// Plans the all-reduce of `numel` elements by rank `rank` of the `size` ranks of the groups'
/// communicator, its random streams those of bucket `bucket_id` and DP-world rank
/// `stream_rank`; `device`: the CUDA ordinal its buffers live on, or `None` for host buffers.
fn plan(
    config: &ParsedConfig,
    size: usize,
    rank: usize,
    numel: usize,
    bucket_id: u32,
    stream_rank: usize,
    device: Option<(usize, u64)>,
) -> FfiResult<Box<CrossGroupBucket>> {
    register_profiler_ranges();
    guard("new_cross_group_bucket", || {
        let config = config.config()?;
        Ok(Box::new(match device {
            None => CrossGroupBucket::Host(CrossGroupAllReduce::new(
                config,
                size,
                rank,
                numel,
                bucket_id,
                stream_rank,
            )?),
            Some((device, stream)) => {
                let all_reduce =
                    CrossGroupAllReduce::new(config, size, rank, numel, bucket_id, stream_rank)?;
                // The device's kernels of this all-reduce compile now, not at its first call.
                all_reduce.prepare(&cuda(device, stream)?)?;
                CrossGroupBucket::Cuda(all_reduce, device)
            }
        }))
    })
}

pub(super) fn new_cross_group_bucket(
    config: &ParsedConfig,
    size: usize,
    rank: usize,
    numel: usize,
    bucket_id: u32,
    stream_rank: usize,
) -> FfiResult<Box<CrossGroupBucket>> {
    plan(config, size, rank, numel, bucket_id, stream_rank, None)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn new_cuda_cross_group_bucket(
    config: &ParsedConfig,
    size: usize,
    rank: usize,
    numel: usize,
    bucket_id: u32,
    stream_rank: usize,
    device: usize,
    stream: u64,
) -> FfiResult<Box<CrossGroupBucket>> {
    plan(
        config,
        size,
        rank,
        numel,
        bucket_id,
        stream_rank,
        Some((device, stream)),
    )
}

impl CrossGroupBucket {
    pub(super) fn wire_bytes(&self) -> u64 {
        match self {
            Self::Host(ar) => ar.wire_bytes() as u64,
            Self::Cuda(ar, _) => ar.wire_bytes() as u64,
        }
    }

    pub(super) fn baseline_wire_bytes(&self) -> u64 {
        match self {
            Self::Host(ar) => ar.baseline_wire_bytes() as u64,
            Self::Cuda(ar, _) => ar.baseline_wire_bytes() as u64,
        }
    }

    pub(super) fn run(&self, comms: &TorchComms, data: &mut [f32], step: u64) -> FfiResult<()> {
        guard("CrossGroupBucket::run", || {
            let Self::Host(ar) = self else {
                return Err(wrong_memory("cross-group buffer", "CUDA", "host"));
            };
            let levels = TorchLevels::new(comms)?;
            ar.run_on(&Host, levels.world(), data, step)
        })
    }

    pub(super) fn run_bf16(
        &self,
        comms: &TorchComms,
        data: &mut [u16],
        step: u64,
    ) -> FfiResult<()> {
        guard("CrossGroupBucket::run_bf16", || {
            let Self::Host(ar) = self else {
                return Err(wrong_memory("cross-group buffer", "CUDA", "host"));
            };
            let levels = TorchLevels::new(comms)?;
            let data: &mut [bf16] = bytemuck::cast_slice_mut(data);
            ar.run_on(&Host, levels.world(), data, step)
        })
    }

    pub(super) fn run_cuda(
        &self,
        comms: &TorchComms,
        data: u64,
        bf16: bool,
        stream: u64,
        step: u64,
    ) -> FfiResult<()> {
        guard("CrossGroupBucket::run_cuda", || {
            let Self::Cuda(ar, device) = self else {
                return Err(wrong_memory("cross-group buffer", "host", "CUDA"));
            };
            let backend = cuda(*device, stream)?;
            let levels = TorchLevels::new(comms)?;
            if bf16 {
                // SAFETY: the extension checked that `data` is a contiguous bf16 CUDA tensor of
                // this size on this device and keeps it alive until the Work completes.
                let data = unsafe { span::<half::bf16>(data, ar.numel()) };
                ar.run_on(&backend, levels.world(), data, step)
            } else {
                // SAFETY: as above, for an fp32 tensor.
                let data = unsafe { span::<f32>(data, ar.numel()) };
                ar.run_on(&backend, levels.world(), data, step)
            }
        })
    }
}
