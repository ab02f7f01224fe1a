//! One collective on every rank of an in-process cluster ([`LocalCluster`]), with each rank's
//! result or error.

use half::bf16;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{BucketElement, Comm, CommGroups, GradReduceScatter, WeightAllGather};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Result};

use crate::recorder::{Record, Recorder};

/// Runs one reduce-scatter of `grads[r]` (rank r's bucket) at `step` on a fresh cluster and
/// returns every rank's shard or error. Shards start as NaN so unwritten elements show.
fn reduce_scatter(
    config: &Config,
    topo: &Topology,
    grads: &[Vec<f32>],
    bucket_id: u32,
    step: u64,
) -> Vec<Result<Vec<f32>>> {
    let cluster = LocalCluster::new(topo.clone());
    let numel = grads[0].len();
    let w = topo.world();
    cluster.run(|c| {
        let me = c.world.rank();
        let mut rs = GradReduceScatter::new(config, topo, me, numel, bucket_id)?;
        let mut shard = vec![f32::NAN; numel / w];
        rs.run(c, &grads[me], &mut shard, step)?;
        Ok(shard)
    })
}

/// Runs one reduce-scatter of `grads[r]` (rank r's bucket) at `step` on a fresh cluster and
/// returns every rank's shard, panicking on any rank's error. Shards start as NaN so unwritten
/// elements show.
pub fn reduce_scatter_ok(
    config: &Config,
    topo: &Topology,
    grads: &[Vec<f32>],
    bucket_id: u32,
    step: u64,
) -> Vec<Vec<f32>> {
    reduce_scatter(config, topo, grads, bucket_id, step)
        .into_iter()
        .enumerate()
        .map(|(r, s)| s.unwrap_or_else(|e| panic!("rank {r}: {e} (config {config})")))
        .collect()
}

/// One weight all-gather: every replica starts from `before`, rank r writes `new`'s shard r
/// into its own params, then all-gathers at `step`. Returns each replica's params.
pub fn all_gather_once(
    config: &Config,
    topo: &Topology,
    before: &[bf16],
    new: &[bf16],
    bucket_id: u32,
    step: u64,
) -> Vec<Result<Vec<bf16>>> {
    let cluster = LocalCluster::new(topo.clone());
    let w = topo.world();
    let s = before.len() / w;
    cluster.run(|c| {
        let me = c.world.rank();
        let mut ag = WeightAllGather::new(config, topo, me, bucket_id, before)?;
        let mut params = before.to_vec();
        params[me * s..(me + 1) * s].copy_from_slice(&new[me * s..(me + 1) * s]);
        ag.run(c.world, &mut params, step)?;
        Ok(params)
    })
}

/// Turns what `LocalCluster::run` returns when each rank collects one value per step into
/// one list over ranks per step, panicking with the failing rank's error and `context`.
pub fn per_step<T>(per_rank: Vec<Result<Vec<T>>>, context: &str) -> Vec<Vec<T>> {
    let mut per_rank: Vec<std::vec::IntoIter<T>> = per_rank
        .into_iter()
        .enumerate()
        .map(|(r, x)| {
            x.unwrap_or_else(|e| panic!("rank {r}: {e} ({context})"))
                .into_iter()
        })
        .collect();
    let steps = per_rank.first().map_or(0, |r| r.len());
    (0..steps)
        .map(|_| {
            per_rank
                .iter_mut()
                .map(|r| r.next().expect("every rank ran every step"))
                .collect()
        })
        .collect()
}

/// What one rank saw of one reduce-scatter of `G` gradients: `(shard, world log, intra log,
/// inter log)`.
pub type RankLogs<G = f32> = (Vec<G>, Vec<Record>, Vec<Record>, Vec<Record>);

/// Runs one reduce-scatter per entry of `steps` (fresh objects, `steps[k] = (step, grads)`)
/// through [`Recorder`]s and returns every rank's shards and logs per step.
pub fn reduce_scatter_recorded<G: BucketElement>(
    config: &Config,
    topo: &Topology,
    bucket_id: u32,
    steps: &[(u64, Vec<Vec<G>>)],
) -> Vec<Vec<RankLogs<G>>> {
    let cluster = LocalCluster::new(topo.clone());
    let w = topo.world();
    let per_rank = cluster.run(|c| -> Result<Vec<RankLogs<G>>> {
        let me = c.world.rank();
        let world = Recorder::new(c.world);
        let intra = c.intra.map(Recorder::new);
        let inter = c.inter.map(Recorder::new);
        let groups = CommGroups {
            world: &world,
            intra: intra.as_ref(),
            inter: inter.as_ref(),
        };
        let mut out = Vec::new();
        for (step, grads) in steps {
            let numel = grads[me].len();
            let mut rs = GradReduceScatter::new(config, topo, me, numel, bucket_id)?;
            let mut shard = vec![G::from_f32(f32::NAN); numel / w];
            rs.run(&groups, &grads[me], &mut shard, *step)?;
            out.push((
                shard,
                world.take(),
                intra.as_ref().map_or(Vec::new(), |r| r.take()),
                inter.as_ref().map_or(Vec::new(), |r| r.take()),
            ));
        }
        Ok(out)
    });
    per_step(per_rank, "recorded reduce-scatter")
}
