//! `GradReduceScatter<Cuda>` and `WeightAllGather<Cuda>` on a [`DeviceCluster`] against the
//! same collectives on `Host` over `LocalCluster`: the same bytes on every rank, step after
//! step (the objects and their buffers reused, NaN / Inf in one step), qWD replicas
//! bit-identical, and, where the cluster counts them, no host synchronisation inside either
//! collective (set-up excluded). The reduce-scatter runs on fp32 and on bf16 buckets (the
//! kernels' bf16 variants, docs/numerics.md §7.5).

use half::bf16;
use sdp4bit::backend::Backend;
use sdp4bit::backend::GradElement;
use sdp4bit::backend::cuda::Cuda;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{BucketElement, Comm, GradReduceScatter, WeightAllGather};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset, WeightCodec};

use crate::cuda_cluster::{DeviceCluster, download, overwrite, upload};
use crate::random::SplitMix64;
use crate::setups::cfg;

/// Steps each object runs (fresh data each step, buffers reused).
const STEPS: u64 = 3;

/// The data seed: `SDP4BIT_TEST_SEED`, else fixed.
pub fn data_seed() -> u64 {
    std::env::var("SDP4BIT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5d94_b17e)
}

/// The topologies of the sweeps: 2x2, 1x4 (four nodes of one rank), 4x1 (one node of four),
/// and two with unequal nodes.
pub fn topologies() -> Vec<(&'static str, Topology)> {
    vec![
        ("2x2", Topology::uniform(2, 2).expect("2x2")),
        ("1x4", Topology::uniform(4, 1).expect("1x4")),
        ("4x1", Topology::uniform(1, 4).expect("4x1")),
        (
            "nodes 3+1",
            Topology::from_node_labels(&[0, 0, 0, 1]).expect("3+1"),
        ),
        (
            "nodes 1+2",
            Topology::from_node_labels(&[7, 3, 3]).expect("1+2"),
        ),
    ]
}

/// Knob overrides of a preset, as `Config::from_overrides` takes them.
pub type Overrides = &'static [(&'static str, &'static str)];

/// The configurations the sweeps run besides the presets: TLq without Hadamard, qW (direct
/// weights), nearest rounding, quantization from step 1 (step 0 reduce-scatters exact fp32)
/// and 16-bit Global-QSGD.
pub const ABLATIONS: [(&str, Preset, Overrides); 5] = [
    ("tlq", Preset::Sdp4bit, &[("grad_codec", "tlq")]),
    ("qw", Preset::Sdp4bit, &[("weight_codec", "qw")]),
    (
        "nearest",
        Preset::Sdp4bit,
        &[("grad_rounding", "nearest"), ("weight_rounding", "nearest")],
    ),
    (
        "start step 1",
        Preset::Sdp4bit,
        &[("grad_quant_start_step", "1")],
    ),
    (
        "global-qsgd 16-bit",
        Preset::GlobalQsgd,
        &[("global_qsgd_bits", "16")],
    ),
];

/// Both collectives of one preset (with knob overrides) with P = 1 and P = 3 on every
/// topology, each on a fresh cluster; the elements per rank are odd, so last groups are
/// partial.
pub struct Sweep {
    pub topologies: Vec<(&'static str, Topology)>,
    /// Shard elements of the reduce-scatter.
    pub grad_shard: usize,
    /// Shard elements of the all-gather.
    pub weight_shard: usize,
    pub seed: u64,
}

impl Sweep {
    /// Runs the sweep on the clusters `cluster` makes; panics naming the first difference.
    pub fn run<C: DeviceCluster>(
        &self,
        cluster: impl Fn(&Topology) -> C,
        name: &str,
        preset: Preset,
        overrides: &[(&str, &str)],
    ) {
        for chunks in ["1", "3"] {
            let mut knobs = overrides.to_vec();
            knobs.push(("pipeline_chunks", chunks));
            let config = cfg(preset, &knobs);
            for (topo_name, topo) in &self.topologies {
                let what = format!("{name} P={chunks} {topo_name}");
                let (grad, weight) = (self.grad_shard, self.weight_shard);
                compare_collectives(&cluster(topo), &config, &what, grad, weight, self.seed);
            }
        }
    }
}

/// The reduce-scatter of fp32 and of bf16 buckets of `grad_shard` elements per rank and the
/// all-gather of `weight_shard` elements per rank, on `cluster` and on the host.
pub fn compare_collectives<C: DeviceCluster>(
    cluster: &C,
    config: &Config,
    name: &str,
    grad_shard: usize,
    weight_shard: usize,
    seed: u64,
) {
    let w = cluster.topology().world();
    compare_reduce_scatter::<f32, _>(cluster, config, name, grad_shard * w, seed);
    let bf16_buckets = format!("{name} bf16 buckets");
    compare_reduce_scatter::<bf16, _>(cluster, config, &bf16_buckets, grad_shard * w, seed ^ 2);
    compare_all_gather(cluster, config, name, weight_shard * w, seed ^ 1);
}

/// Runs step `step` of rank `me`'s collective (`what` names both): panics on its error and,
/// where the cluster counts them, on a wait for the device inside it (the collectives only
/// enqueue work; what the rank's thread did before is not counted).
fn device_step<C: DeviceCluster>(
    cluster: &C,
    what: &str,
    me: usize,
    step: usize,
    run: impl FnOnce() -> sdp4bit::Result<()>,
) {
    let _set_up = cluster.take_host_syncs();
    run().unwrap_or_else(|e| panic!("{what}: CUDA step {step}: {e}"));
    let syncs = cluster.take_host_syncs().unwrap_or_default();
    assert!(
        syncs.is_empty(),
        "{what}: rank {me} step {step} waited on the host for the device: {syncs:?}"
    );
}

/// A gradient bucket: gaussian values of several scales, with NaN, +Inf and -Inf placed at
/// random when `specials`.
fn bucket(rng: &mut SplitMix64, numel: usize, specials: bool) -> Vec<f32> {
    let scale = [1e-3, 1.0, 300.0][rng.below(3)];
    let mut out: Vec<f32> = (0..numel)
        .map(|_| (rng.gaussian() * scale) as f32)
        .collect();
    if specials && numel > 0 {
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let at = rng.below(numel);
            out[at] = special;
        }
    }
    out
}

/// The fp32 bit patterns of the values, with every NaN made one NaN (payloads are not part of
/// the contract).
fn canonical<G: GradElement>(values: &[G]) -> Vec<u32> {
    values
        .iter()
        .map(|v| v.to_f32())
        .map(|v| if v.is_nan() { 0x7fc0_0000 } else { v.to_bits() })
        .collect()
}

/// Asserts that `got` has `want`'s bits (NaN as NaN), naming the first differing element and
/// how many differ.
fn assert_same<G: GradElement>(got: &[G], want: &[G], what: &str) {
    let (got, want) = (canonical(got), canonical(want));
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let differ: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    if let Some(&i) = differ.first() {
        let value = |bits: u32| f32::from_bits(bits);
        panic!(
            "{what}: {} of {} elements differ, the first at {i}: got {:e} ({:#010x}), the host \
             {:e} ({:#010x})",
            differ.len(),
            got.len(),
            value(got[i]),
            got[i],
            value(want[i]),
            want[i]
        );
    }
}

/// Asserts that every rank's output of every step (`[rank][step]`) is the host's.
fn assert_ranks_same<G: GradElement>(device: &[Vec<Vec<G>>], host: &[Vec<Vec<G>>], what: &str) {
    for (r, (got, want)) in device.iter().zip(host).enumerate() {
        for (step, (got, want)) in got.iter().zip(want).enumerate() {
            assert_same(got, want, &format!("{what} of rank {r} step {step}"));
        }
    }
}

/// `[step][rank]` data of a run: `STEPS` steps of one bucket per rank, rounded to `G`.
fn grad_data<G: GradElement>(seed: u64, world: usize, numel: usize) -> Vec<Vec<Vec<G>>> {
    let mut rng = SplitMix64::new(seed);
    (0..STEPS)
        .map(|step| {
            (0..world)
                .map(|_| {
                    let values = bucket(&mut rng, numel, step == 1);
                    values.into_iter().map(G::from_f32).collect()
                })
                .collect()
        })
        .collect()
}

/// Runs the reduce-scatter of `G` buckets on both backends and compares every rank's shard of
/// every step.
fn compare_reduce_scatter<G: BucketElement, C: DeviceCluster>(
    cluster: &C,
    config: &Config,
    name: &str,
    numel: usize,
    seed: u64,
) {
    let topo = cluster.topology();
    let what = format!("{name}: the reduce-scatter");
    let data = grad_data::<G>(seed, topo.world(), numel);
    let bucket_id = 3;
    let host = LocalCluster::new(topo.clone()).run(|c| {
        let me = c.world.rank();
        let mut rs = GradReduceScatter::new(config, topo, me, numel, bucket_id)
            .unwrap_or_else(|e| panic!("{what}: host plan: {e}"));
        let mut shard = vec![G::from_f32(f32::NAN); rs.plan().shard_len];
        let mut out = Vec::new();
        for (step, grads) in data.iter().enumerate() {
            rs.run(c, &grads[me], &mut shard, step as u64)
                .unwrap_or_else(|e| panic!("{what}: host step {step}: {e}"));
            out.push(shard.clone());
        }
        out
    });
    let device = cluster.run(|rank| {
        let me = rank.comms.world.rank();
        let mut rs =
            GradReduceScatter::with_backend(&rank.backend, config, topo, me, numel, bucket_id)
                .unwrap_or_else(|e| panic!("{what}: CUDA plan: {e}"));
        let shard_len = rs.plan().shard_len;
        let mut shard = upload(rank, &vec![G::from_f32(f32::NAN); shard_len]);
        let mut out = Vec::new();
        for (step, grads) in data.iter().enumerate() {
            let bucket = upload(rank, &grads[me]);
            device_step(cluster, &what, me, step, || {
                rs.run_on(
                    &rank.backend,
                    &rank.comms,
                    Cuda::src(&bucket),
                    Cuda::dst(&mut shard),
                    step as u64,
                )
            });
            out.push(download(rank, &shard));
        }
        out
    });
    assert_ranks_same(&device, &host, &format!("{what}: the CUDA shard"));
}

/// `[step]` new bucket values (every rank writes its own shard of them).
fn weight_data(seed: u64, numel: usize) -> (Vec<bf16>, Vec<Vec<bf16>>) {
    let mut rng = SplitMix64::new(seed);
    let mut draw = |specials: bool| -> Vec<bf16> {
        bucket(&mut rng, numel, specials)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    };
    let before = draw(false);
    let steps = (0..STEPS).map(|step| draw(step == 1)).collect();
    (before, steps)
}

/// Runs the all-gather on both backends and compares every replica of every step; qWD
/// replicas must also agree with each other bit for bit.
fn compare_all_gather<C: DeviceCluster>(
    cluster: &C,
    config: &Config,
    name: &str,
    numel: usize,
    seed: u64,
) {
    let topo = cluster.topology();
    let what = format!("{name}: the all-gather");
    let (before, steps) = weight_data(seed, numel);
    let bucket_id = 5;
    let own = |params: &mut [bf16], new: &[bf16], me: usize, s: usize| {
        params[me * s..(me + 1) * s].copy_from_slice(&new[me * s..(me + 1) * s]);
    };
    let host = LocalCluster::new(topo.clone()).run(|c| {
        let me = c.world.rank();
        let mut ag = WeightAllGather::new(config, topo, me, bucket_id, &before)
            .unwrap_or_else(|e| panic!("{what}: host plan: {e}"));
        let s = ag.plan().shard_len;
        let mut params = before.clone();
        let mut out = Vec::new();
        for (step, new) in steps.iter().enumerate() {
            own(&mut params, new, me, s);
            ag.run(c.world, &mut params, step as u64)
                .unwrap_or_else(|e| panic!("{what}: host step {step}: {e}"));
            out.push(params.clone());
        }
        out
    });
    let device = cluster.run(|rank| {
        let me = rank.comms.world.rank();
        let mut params = upload(rank, &before);
        let mut ag = WeightAllGather::with_backend(
            &rank.backend,
            config,
            topo,
            me,
            bucket_id,
            Cuda::src(&params),
        )
        .unwrap_or_else(|e| panic!("{what}: CUDA plan: {e}"));
        let s = ag.plan().shard_len;
        let mut out = Vec::new();
        for (step, new) in steps.iter().enumerate() {
            let mut host_params = download(rank, &params);
            own(&mut host_params, new, me, s);
            overwrite(rank, &mut params, &host_params);
            device_step(cluster, &what, me, step, || {
                ag.run_on(
                    &rank.backend,
                    rank.comms.world,
                    Cuda::dst(&mut params),
                    step as u64,
                )
            });
            out.push(download(rank, &params));
        }
        out
    });
    assert_ranks_same(&device, &host, &format!("{what}: the CUDA replica"));
    if config.weight.codec == WeightCodec::Qwd {
        for (r, replica) in device.iter().enumerate().skip(1) {
            for (step, (got, first)) in replica.iter().zip(&device[0]).enumerate() {
                let what = format!("{what}: qWD replica {r} step {step} against replica 0");
                assert_same(got, first, &what);
            }
        }
    }
}
