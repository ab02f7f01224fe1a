//! The host's pool of exchange buffers (`backend::cpu::buffers`): a call buffer given back is
//! handed out again, and every collective's results are bit-identical whether its buffers
//! are fresh and zeroed or come back from the pool holding a poison pattern, also with
//! pipelined chunks (P > 1) and with clusters running concurrently on the shared pool. Its
//! own test binary, because the pool is process-wide and one test poisons it.

use half::bf16;
use sdp4bit::backend::Backend;
use sdp4bit::backend::cpu::{Host, buffers};
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, GradReduceScatter, WeightAllGather};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::{
    bits::{bf16_bits, f32_bits},
    cluster::{all_gather_once, reduce_scatter_ok},
    random::{SplitMix64, gaussian_f32, rank_grads},
    setups::cfg,
};

/// Gradient cases: every route kind, one- and two-level, single and pipelined chunks.
fn grad_cases() -> Vec<(&'static str, Config, Topology)> {
    let t22 = Topology::uniform(2, 2).unwrap();
    let t41 = Topology::uniform(4, 1).unwrap();
    vec![
        (
            "sdp4bit 2x2 P=1",
            cfg(Preset::Sdp4bit, &[("pipeline_chunks", "1")]),
            t22.clone(),
        ),
        (
            "sdp4bit 2x2 P=4",
            cfg(Preset::Sdp4bit, &[("pipeline_chunks", "4")]),
            t22.clone(),
        ),
        ("sdp4bit 2x2 auto P", cfg(Preset::Sdp4bit, &[]), t22.clone()),
        (
            "sdp4bit 4x1 P=3",
            cfg(Preset::Sdp4bit, &[("pipeline_chunks", "3")]),
            t41.clone(),
        ),
        (
            "qsdp 2x2 P=2",
            cfg(Preset::Qsdp, &[("pipeline_chunks", "2")]),
            t22.clone(),
        ),
        ("zeropp 2x2", cfg(Preset::Zeropp, &[]), t22.clone()),
        ("global-qsgd 2x2", cfg(Preset::GlobalQsgd, &[]), t22.clone()),
        (
            "global-qsgd 4x1 int16",
            cfg(Preset::GlobalQsgd, &[("global_qsgd_bits", "16")]),
            t41,
        ),
        ("baseline 2x2", cfg(Preset::Baseline, &[]), t22),
    ]
}

/// Held by each test: the pool is process-wide and the first test counts what it holds.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn shard_bits(shards: &[Vec<f32>]) -> Vec<Vec<u32>> {
    shards.iter().map(|s| f32_bits(s)).collect()
}

#[test]
fn call_buffers_are_reused_and_poisoned_reuse_keeps_every_result_bit_identical() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Reuse: a call buffer given back is the next one of its type and length.
    buffers::clear();
    let before = buffers::stats();
    let first = Host.call_buffer::<u8>(4096).unwrap();
    let address = first.as_ptr();
    drop(first);
    assert_eq!(buffers::stats().pooled_bytes, 4096);
    let again = Host.call_buffer::<u8>(4096).unwrap();
    assert_eq!(
        again.as_ptr(),
        address,
        "the pooled buffer is handed out again"
    );
    let other_type = Host.call_buffer::<i8>(4096).unwrap();
    assert_ne!(
        other_type.as_ptr().cast::<u8>(),
        address,
        "another element type is another buffer"
    );
    let after = buffers::stats();
    assert_eq!(after.reused - before.reused, 1);
    assert_eq!(after.allocated - before.allocated, 2);
    drop((again, other_type));
    // Buffers kept across calls are the collective's own, never pooled.
    let pooled = buffers::stats().pooled_bytes;
    drop(Host.alloc::<f32>(1000).unwrap());
    assert_eq!(buffers::stats().pooled_bytes, pooled);
    buffers::clear();
    assert_eq!(buffers::stats().pooled_bytes, 0);

    for (name, config, topo) in grad_cases() {
        let w = topo.world();
        let numel = w * 4099 * 3;
        for step in [0u64, 5] {
            let grads = rank_grads(40 + step, w, numel, 1.0);
            buffers::clear();
            let cold = reduce_scatter_ok(&config, &topo, &grads, 3, step);
            let stats = buffers::stats();
            assert!(
                stats.pooled_bytes > 0 || name.starts_with("baseline"),
                "{name}: pooled"
            );
            for poison in [0xA5u8, 0xFF, 0x7F] {
                buffers::overwrite_pooled(poison);
                let reused_before = buffers::stats().reused;
                let hot = reduce_scatter_ok(&config, &topo, &grads, 3, step);
                if !name.starts_with("baseline") {
                    assert!(
                        buffers::stats().reused > reused_before,
                        "{name}: the second run took its buffers from the pool"
                    );
                }
                assert_eq!(
                    shard_bits(&hot),
                    shard_bits(&cold),
                    "{name}, step {step}, poison {poison:#x}: pooled buffers change the shards"
                );
            }
        }
    }

    for (name, config) in [
        ("qwd", cfg(Preset::Sdp4bit, &[])),
        ("qsdp weights", cfg(Preset::Qsdp, &[])),
        ("baseline weights", cfg(Preset::Baseline, &[])),
    ] {
        let topo = Topology::uniform(2, 2).unwrap();
        let numel = 4 * 4099 * 2;
        let mut rng = SplitMix64::new(77);
        let before: Vec<bf16> = gaussian_f32(&mut rng, numel, 1.0)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let new: Vec<bf16> = before
            .iter()
            .zip(gaussian_f32(&mut rng, numel, 1e-2))
            .map(|(b, d)| bf16::from_f32(b.to_f32() + d))
            .collect();
        buffers::clear();
        let cold: Vec<Vec<u16>> = all_gather_once(&config, &topo, &before, &new, 1, 2)
            .into_iter()
            .map(|p| bf16_bits(&p.unwrap_or_else(|e| panic!("{name}: {e}"))))
            .collect();
        buffers::overwrite_pooled(0xA5);
        let hot: Vec<Vec<u16>> = all_gather_once(&config, &topo, &before, &new, 1, 2)
            .into_iter()
            .map(|p| bf16_bits(&p.unwrap_or_else(|e| panic!("{name}: {e}"))))
            .collect();
        assert_eq!(
            hot, cold,
            "{name}: pooled buffers change the gathered parameters"
        );
    }
}

#[test]
fn pipelined_buckets_on_concurrent_clusters_share_the_pool_safely() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Two clusters (as two streams of buckets) run pipelined reduce-scatters and all-gathers
    // of different bucket sizes step after step on the shared pool; every result must equal
    // the same call's result computed alone.
    let topo = Topology::uniform(2, 2).unwrap();
    let config = cfg(Preset::Sdp4bit, &[("pipeline_chunks", "4")]);
    let sizes = [4 * 4099 * 4, 4 * 2053 * 4];
    let steps = 4u64;
    let expected: Vec<Vec<Vec<Vec<u32>>>> = sizes
        .iter()
        .map(|&numel| {
            (0..steps)
                .map(|step| {
                    let grads = rank_grads(900 + step, 4, numel, 1.0);
                    shard_bits(&reduce_scatter_ok(&config, &topo, &grads, 0, step))
                })
                .collect()
        })
        .collect();
    std::thread::scope(|scope| {
        for (k, &numel) in sizes.iter().enumerate() {
            let (topo, config, expected) = (&topo, &config, &expected);
            scope.spawn(move || {
                let cluster = LocalCluster::new(topo.clone());
                let shards = cluster.run(|c| {
                    let me = c.world.rank();
                    let mut rs = GradReduceScatter::new(config, topo, me, numel, 0).unwrap();
                    let mut params = vec![bf16::from_f32(0.5); numel];
                    let mut ag = WeightAllGather::new(config, topo, me, 1, &params).unwrap();
                    let mut out = Vec::new();
                    for step in 0..steps {
                        let grads = rank_grads(900 + step, 4, numel, 1.0);
                        let mut shard = vec![f32::NAN; numel / 4];
                        rs.run(c, &grads[me], &mut shard, step).unwrap();
                        ag.run(c.world, &mut params, step).unwrap();
                        out.push(f32_bits(&shard));
                    }
                    out
                });
                for step in 0..steps as usize {
                    let got: Vec<Vec<u32>> = shards.iter().map(|r| r[step].clone()).collect();
                    assert_eq!(got, expected[k][step], "bucket {numel}, step {step}");
                }
            });
        }
    });
}
