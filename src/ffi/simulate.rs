//! In-process runs of the collectives over all W ranks: the reference the extension's
//! multi-process results are compared with, byte for byte.

use half::bf16;

use super::buckets::ParsedConfig;
use super::{FfiResult, guard};
use crate::backend::cpu::Host;
use crate::collective::local::{LocalCluster, LocalGroup};
use crate::collective::{Comm, CrossGroupAllReduce, GradReduceScatter, WeightAllGather};
use crate::error::{Error, Result, check_len};
use crate::layout::Topology;

pub(super) fn simulate_grad_reduce_scatter(
    config: &ParsedConfig,
    node_labels: &[u64],
    bucket_id: u32,
    step: u64,
    inputs: &[f32],
    outputs: &mut [f32],
) -> FfiResult<()> {
    guard("simulate_grad_reduce_scatter", || {
        let topology = Topology::from_node_labels(node_labels)?;
        let w = topology.world();
        if !inputs.len().is_multiple_of(w) {
            return Err(Error::Buffer(format!(
                "{} input elements are not {w} equal buckets",
                inputs.len()
            )));
        }
        let numel = inputs.len() / w;
        check_len("outputs", outputs.len(), numel)?;
        let shard_len = numel / w;
        let cluster = LocalCluster::new(topology.clone());
        let shards = cluster.run(|comms| -> Result<Vec<f32>> {
            let z = comms.world.rank();
            let mut rs = GradReduceScatter::new(config.config()?, &topology, z, numel, bucket_id)?;
            let mut shard = vec![0.0; shard_len];
            rs.run(comms, &inputs[z * numel..(z + 1) * numel], &mut shard, step)?;
            Ok(shard)
        });
        for (z, shard) in shards.into_iter().enumerate() {
            outputs[z * shard_len..(z + 1) * shard_len].copy_from_slice(&shard?);
        }
        Ok(())
    })
}

pub(super) fn simulate_weight_all_gather(
    config: &ParsedConfig,
    node_labels: &[u64],
    bucket_id: u32,
    first_step: u64,
    initial: &[u16],
    targets: &[u16],
    outputs: &mut [u16],
) -> FfiResult<()> {
    guard("simulate_weight_all_gather", || {
        let topology = Topology::from_node_labels(node_labels)?;
        let (w, numel) = (topology.world(), initial.len());
        if numel == 0 || !targets.len().is_multiple_of(numel) {
            return Err(Error::Buffer(format!(
                "{} target elements are not whole buckets of {numel}",
                targets.len()
            )));
        }
        let steps = targets.len() / numel;
        check_len("outputs", outputs.len(), steps * w * numel)?;
        let initial: &[bf16] = bytemuck::cast_slice(initial);
        let targets: &[bf16] = bytemuck::cast_slice(targets);
        let cluster = LocalCluster::new(topology.clone());
        let per_rank = cluster.run(|comms| -> Result<Vec<bf16>> {
            let z = comms.world.rank();
            let mut ag = WeightAllGather::new(config.config()?, &topology, z, bucket_id, initial)?;
            let shard = ag.plan().shard_len;
            let mut params = initial.to_vec();
            let mut history = Vec::with_capacity(steps * numel);
            for (t, target) in targets.chunks_exact(numel).enumerate() {
                let mine = z * shard..(z + 1) * shard;
                params[mine.clone()].copy_from_slice(&target[mine]);
                ag.run(comms.world, &mut params, first_step + t as u64)?;
                history.extend_from_slice(&params);
            }
            Ok(history)
        });
        let outputs: &mut [bf16] = bytemuck::cast_slice_mut(outputs);
        for (z, history) in per_rank.into_iter().enumerate() {
            for (t, params) in history?.chunks_exact(numel).enumerate() {
                let at = (t * w + z) * numel;
                outputs[at..at + numel].copy_from_slice(params);
            }
        }
        Ok(())
    })
}

/// The cross-group all-reduce of `n = stream_ranks.len()` ranks (rank `r` rounding with the
/// streams of DP-world rank `stream_ranks[r]`): `data` is their n buffers back to back, each
/// replaced by that rank's result.
pub(super) fn simulate_cross_group_all_reduce(
    config: &ParsedConfig,
    bucket_id: u32,
    step: u64,
    stream_ranks: &[u64],
    data: &mut [f32],
) -> FfiResult<()> {
    guard("simulate_cross_group_all_reduce", || {
        let n = stream_ranks.len();
        if n == 0 || !data.len().is_multiple_of(n) {
            return Err(Error::Buffer(format!(
                "{} elements are not {n} equal buffers",
                data.len()
            )));
        }
        let numel = data.len() / n;
        let group = LocalGroup::new(n);
        let config = config.config()?;
        std::thread::scope(|s| {
            let runs: Vec<_> = data
                .chunks_exact_mut(numel)
                .enumerate()
                .map(|(r, buffer)| {
                    let comm = group.comm(r);
                    let stream_rank = stream_ranks[r] as usize;
                    s.spawn(move || -> Result<()> {
                        CrossGroupAllReduce::<Host>::new(
                            config,
                            n,
                            r,
                            numel,
                            bucket_id,
                            stream_rank,
                        )?
                        .run_on(&Host, &comm, buffer, step)
                    })
                })
                .collect();
            runs.into_iter().try_for_each(|run| {
                run.join()
                    .map_err(|_| Error::Comm("a simulated rank panicked".into()))?
            })
        })
    })
}
