//! `GradReduceScatter<Cuda>` and `WeightAllGather<Cuda>` over [`EmulatedCluster`] against the
//! same collectives on `Host` over `LocalCluster`: the same bytes on every rank, step after
//! step (the objects and their buffers reused), qWD replicas bit-identical, and no host
//! synchronisation inside either collective (set-up excluded). The reduce-scatter runs on fp32
//! and on bf16 buckets (the kernels' bf16 variants, docs/numerics.md §7.5).

use half::bf16;
use sdp4bit::backend::cuda::{Cuda, DeviceBuffer};
use sdp4bit::backend::{Backend, Element, GradElement};
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{BucketElement, GradReduceScatter, WeightAllGather};
use sdp4bit::plan::Topology;
use sdp4bit::{Config, WeightCodec};
use sdp4bit_test_support::random::SplitMix64;

use super::comm::{EmulatedCluster, Rank};
use super::library::emulation;

/// Steps each object runs (fresh data each step, buffers reused).
pub const STEPS: u64 = 3;

/// The topologies of the sweep: 2x2, 1x4 (four nodes of one rank), 4x1 (one node of four),
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

/// Copies `host` into a new device buffer (synchronously, on the legacy default stream).
pub fn upload<T: Element>(rank: &Rank<'_>, host: &[T]) -> DeviceBuffer<T> {
    let mut buffer = rank.backend.alloc::<T>(host.len()).expect("device buffer");
    overwrite(&mut buffer, host);
    buffer
}

/// Copies `host` into `buffer` (as long) synchronously, on the legacy default stream.
pub fn overwrite<T: Element>(buffer: &mut DeviceBuffer<T>, host: &[T]) {
    let span = Cuda::dst(buffer);
    assert_eq!(span.len(), host.len(), "overwrite lengths");
    if !host.is_empty() {
        // SAFETY: the buffer holds `host.len()` elements of T on the device whose context is
        // current; the copy is synchronous.
        unsafe { cudarc::driver::result::memcpy_htod_sync(span.addr(), host) }.expect("upload");
    }
}

/// Waits for the rank's stream, then copies `buffer` back.
pub fn download<T: Element + Default>(rank: &Rank<'_>, buffer: &DeviceBuffer<T>) -> Vec<T> {
    rank.stream.synchronize().expect("stream synchronize");
    let span = Cuda::src(buffer);
    let mut host = vec![T::default(); span.len()];
    if !host.is_empty() {
        // SAFETY: the buffer holds `host.len()` elements of T on this rank's device, whose
        // context is current; the copy is synchronous.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, span.addr()) }
            .expect("download");
    }
    host
}

/// Fails when the calling rank's thread waited for the device (a stream, context or event
/// synchronisation, a synchronous copy, memset or free) since the emulation's counts were last
/// taken: the collectives only enqueue work.
fn assert_no_host_sync(name: &str, collective: &str, rank: usize, step: usize) {
    let syncs = emulation().take_host_syncs();
    assert!(
        syncs.is_empty(),
        "{name}: rank {rank} step {step}: the {collective} waited on the host for the device: {syncs:?}"
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
pub fn compare_reduce_scatter<G: BucketElement + Default>(
    config: &Config,
    name: &str,
    topo: &Topology,
    numel: usize,
    seed: u64,
) {
    let w = topo.world();
    let data = grad_data::<G>(seed, w, numel);
    let bucket_id = 3;
    let host = LocalCluster::new(topo.clone()).run(|c| {
        let me = sdp4bit::collective::Comm::rank(c.world);
        let mut rs = GradReduceScatter::new(config, topo, me, numel, bucket_id)
            .unwrap_or_else(|e| panic!("{name}: host plan: {e}"));
        let mut shard = vec![G::from_f32(f32::NAN); rs.plan().shard_len];
        let mut out = Vec::new();
        for (step, grads) in data.iter().enumerate() {
            rs.run(c, &grads[me], &mut shard, step as u64)
                .unwrap_or_else(|e| panic!("{name}: host step {step}: {e}"));
            out.push(shard.clone());
        }
        out
    });
    let cuda = EmulatedCluster::new(topo).run(|rank| {
        let me = sdp4bit::collective::Comm::rank(rank.comms.world);
        let mut rs =
            GradReduceScatter::with_backend(&rank.backend, config, topo, me, numel, bucket_id)
                .unwrap_or_else(|e| panic!("{name}: CUDA plan: {e}"));
        let shard_len = rs.plan().shard_len;
        let mut shard = upload(rank, &vec![G::from_f32(f32::NAN); shard_len]);
        let mut out = Vec::new();
        for (step, grads) in data.iter().enumerate() {
            let bucket = upload(rank, &grads[me]);
            let _set_up = emulation().take_host_syncs();
            rs.run_on(
                &rank.backend,
                &rank.comms,
                Cuda::src(&bucket),
                Cuda::dst(&mut shard),
                step as u64,
            )
            .unwrap_or_else(|e| panic!("{name}: CUDA step {step}: {e}"));
            assert_no_host_sync(name, "reduce-scatter", me, step);
            out.push(download(rank, &shard));
        }
        out
    });
    for (r, (want, got)) in host.iter().zip(&cuda).enumerate() {
        for (step, (want, got)) in want.iter().zip(got).enumerate() {
            assert_eq!(
                canonical(got),
                canonical(want),
                "{name}: rank {r} step {step}: the CUDA shard differs from the host's"
            );
        }
    }
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
pub fn compare_all_gather(config: &Config, name: &str, topo: &Topology, numel: usize, seed: u64) {
    let (before, steps) = weight_data(seed, numel);
    let bucket_id = 5;
    let own = |params: &mut [bf16], new: &[bf16], me: usize, s: usize| {
        params[me * s..(me + 1) * s].copy_from_slice(&new[me * s..(me + 1) * s]);
    };
    let host = LocalCluster::new(topo.clone()).run(|c| {
        let me = sdp4bit::collective::Comm::rank(c.world);
        let mut ag = WeightAllGather::new(config, topo, me, bucket_id, &before)
            .unwrap_or_else(|e| panic!("{name}: host plan: {e}"));
        let s = ag.plan().shard_len;
        let mut params = before.clone();
        let mut out = Vec::new();
        for (step, new) in steps.iter().enumerate() {
            own(&mut params, new, me, s);
            ag.run(c.world, &mut params, step as u64)
                .unwrap_or_else(|e| panic!("{name}: host step {step}: {e}"));
            out.push(params.clone());
        }
        out
    });
    let cuda = EmulatedCluster::new(topo).run(|rank| {
        let me = sdp4bit::collective::Comm::rank(rank.comms.world);
        let mut params = upload(rank, &before);
        let mut ag = WeightAllGather::with_backend(
            &rank.backend,
            config,
            topo,
            me,
            bucket_id,
            Cuda::src(&params),
        )
        .unwrap_or_else(|e| panic!("{name}: CUDA plan: {e}"));
        let s = ag.plan().shard_len;
        let mut out = Vec::new();
        for (step, new) in steps.iter().enumerate() {
            let mut host_params = download(rank, &params);
            own(&mut host_params, new, me, s);
            overwrite(&mut params, &host_params);
            let _set_up = emulation().take_host_syncs();
            ag.run_on(
                &rank.backend,
                rank.comms.world,
                Cuda::dst(&mut params),
                step as u64,
            )
            .unwrap_or_else(|e| panic!("{name}: CUDA step {step}: {e}"));
            assert_no_host_sync(name, "all-gather", me, step);
            out.push(download(rank, &params));
        }
        out
    });
    let bits = |x: &[bf16]| -> Vec<u16> {
        x.iter()
            .map(|v| if v.is_nan() { 0x7fc0 } else { v.to_bits() })
            .collect()
    };
    for (r, (want, got)) in host.iter().zip(&cuda).enumerate() {
        for (step, (want, got)) in want.iter().zip(got).enumerate() {
            assert_eq!(
                bits(got),
                bits(want),
                "{name}: rank {r} step {step}: the CUDA replica differs from the host's"
            );
        }
    }
    if config.weight.codec == WeightCodec::Qwd {
        for (r, replica) in cuda.iter().enumerate().skip(1) {
            for (step, (got, first)) in replica.iter().zip(&cuda[0]).enumerate() {
                assert_eq!(
                    bits(got),
                    bits(first),
                    "{name}: qWD replicas 0 and {r} differ at step {step}"
                );
            }
        }
    }
}
