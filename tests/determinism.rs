//! Counter-based randomness (docs/numerics.md §2): the bytes on the wire and the results are a pure
//! function of (inputs, seed, step, bucket, rank). Every payload of every collective is
//! captured by the support crate's `Recorder`, a `Comm` wrapper around `LocalComm`.
//!
//! - same seed: identical shards and identical send / receive payloads across runs (also
//!   with two clusters running concurrently, and with an object reused across steps versus a
//!   fresh object per step: no state leaks between steps);
//! - different seed, step or bucket id: different codes (stochastic rounding), while the
//!   round-to-nearest codec's bytes do not depend on them at all;
//! - different ranks draw different streams: ranks holding identical gradients send
//!   identical scales but different codes.

use half::bf16;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, GradReduceScatter, WeightAllGather};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::{
    bits::{assert_bits_eq, bf16_bits, f32_bits},
    cluster::{RankLogs, reduce_scatter_recorded},
    random::{SplitMix64, gaussian_f32, rank_grads},
    recorder::{Record, Recorder},
    setups::cfg,
};

/// The configurations and topologies exercised: every route kind.
fn cases() -> Vec<(String, Config, Topology)> {
    let t22 = Topology::uniform(2, 2).unwrap();
    vec![
        (
            "sdp4bit P=3 2x2".into(),
            cfg(Preset::Sdp4bit, &[("pipeline_chunks", "3")]),
            t22.clone(),
        ),
        (
            "tlq D=4 x M=2".into(),
            cfg(Preset::Sdp4bit, &[("grad_codec", "tlq")]),
            Topology::uniform(2, 4).unwrap(),
        ),
        (
            "sdp4bit 3+1".into(),
            cfg(Preset::Sdp4bit, &[]),
            Topology::from_node_labels(&[0, 0, 0, 1]).unwrap(),
        ),
        (
            "sdp4bit D=1 x M=3".into(),
            cfg(Preset::Sdp4bit, &[]),
            Topology::uniform(3, 1).unwrap(),
        ),
        ("qsdp 2x2".into(), cfg(Preset::Qsdp, &[]), t22.clone()),
        (
            "global-qsgd 2x2".into(),
            cfg(Preset::GlobalQsgd, &[]),
            t22.clone(),
        ),
        ("zeropp 2x2".into(), cfg(Preset::Zeropp, &[]), t22),
    ]
}

fn with_seed(config: &Config, seed: u64) -> Config {
    let mut c = *config;
    c.set("seed", &seed.to_string()).unwrap();
    c
}

/// Every payload a rank sent in one run, concatenated per collective kind.
fn sent(logs: &RankLogs) -> Vec<(&'static str, Vec<u8>)> {
    logs.1
        .iter()
        .chain(&logs.2)
        .chain(&logs.3)
        .filter(|r| r.op != "all_reduce_max")
        .map(|r| (r.op, r.send.clone()))
        .collect()
}

fn differing_bytes(a: &[(&'static str, Vec<u8>)], b: &[(&'static str, Vec<u8>)]) -> (usize, usize) {
    assert_eq!(a.len(), b.len());
    let mut diff = 0;
    let mut total = 0;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.0, y.0);
        assert_eq!(x.1.len(), y.1.len());
        total += x.1.len();
        diff += x.1.iter().zip(&y.1).filter(|(p, q)| p != q).count();
    }
    (diff, total)
}

#[test]
fn same_seed_gives_identical_bytes_across_runs() {
    for (name, config, topo) in cases() {
        let w = topo.world();
        let numel = w * 4099;
        let steps: Vec<(u64, Vec<Vec<f32>>)> = (0..2)
            .map(|k| (7 + k, rank_grads(100 + k, w, numel, 1.0)))
            .collect();
        let a = reduce_scatter_recorded(&config, &topo, 5, &steps);
        // The second run concurrently with a third, to perturb thread scheduling.
        let (b, c) = std::thread::scope(|s| {
            let hb = s.spawn(|| reduce_scatter_recorded(&config, &topo, 5, &steps));
            let hc = s.spawn(|| reduce_scatter_recorded(&config, &topo, 5, &steps));
            (hb.join().unwrap(), hc.join().unwrap())
        });
        for other in [&b, &c] {
            for (k, (ra, rb)) in a.iter().zip(other.iter()).enumerate() {
                for (r, (x, y)) in ra.iter().zip(rb).enumerate() {
                    let ctx = format!("{name}: step {k} rank {r}");
                    assert_bits_eq(&x.0, &y.0, &ctx);
                    assert_eq!(x.1, y.1, "{ctx}: world payloads differ");
                    assert_eq!(x.2, y.2, "{ctx}: intra-node payloads differ");
                    assert_eq!(x.3, y.3, "{ctx}: inter-node payloads differ");
                    assert!(!sent(x).is_empty(), "{ctx}: nothing recorded");
                }
            }
        }
    }
}

#[test]
fn seed_step_and_bucket_change_stochastic_codes_only() {
    for (name, config, topo) in cases() {
        let w = topo.world();
        let numel = w * 4099;
        let grads = rank_grads(200, w, numel, 1.0);
        let base = reduce_scatter_recorded(&config, &topo, 5, &[(7, grads.clone())]);
        let variants = [
            (
                "seed",
                reduce_scatter_recorded(&with_seed(&config, 99), &topo, 5, &[(7, grads.clone())]),
            ),
            (
                "step",
                reduce_scatter_recorded(&config, &topo, 5, &[(8, grads.clone())]),
            ),
            (
                "bucket",
                reduce_scatter_recorded(&config, &topo, 6, &[(7, grads.clone())]),
            ),
        ];
        let stochastic = config.grad.rounding == sdp4bit::Rounding::Stochastic;
        for (what, v) in &variants {
            for r in 0..w {
                let (diff, total) = differing_bytes(&sent(&base[0][r]), &sent(&v[0][r]));
                let ctx = format!("{name}: other {what}, rank {r}: {diff} of {total} bytes differ");
                if stochastic {
                    assert!(diff * 20 > total, "{ctx}");
                    let same = base[0][r]
                        .0
                        .iter()
                        .zip(&v[0][r].0)
                        .filter(|(a, b)| a.to_bits() == b.to_bits())
                        .count();
                    assert!(same * 2 < base[0][r].0.len(), "{ctx}: {same} equal outputs");
                } else {
                    // Round-to-nearest uses no random numbers.
                    assert_eq!(diff, 0, "{ctx}");
                    assert_bits_eq(&base[0][r].0, &v[0][r].0, &ctx);
                }
            }
        }
    }
}

#[test]
fn ranks_with_identical_gradients_send_different_codes() {
    for (name, config, topo) in cases() {
        let w = topo.world();
        let numel = w * 4099;
        let one = gaussian_f32(&mut SplitMix64::new(300), numel, 1.0);
        let grads = vec![one; w];
        let logs = reduce_scatter_recorded(&config, &topo, 5, &[(7, grads)]);
        // The first quantized payload of every rank: same layout, same data, own stream.
        let first =
            |r: usize| -> Vec<u8> { sent(&logs[0][r]).into_iter().next().expect("a payload").1 };
        let stochastic = config.grad.rounding == sdp4bit::Rounding::Stochastic;
        let p0 = first(0);
        for r in 1..w {
            let pr = first(r);
            assert_eq!(p0.len(), pr.len());
            let diff = p0.iter().zip(&pr).filter(|(a, b)| a != b).count();
            let ctx = format!(
                "{name}: rank 0 vs rank {r}: {diff} of {} bytes differ",
                p0.len()
            );
            if stochastic {
                assert!(diff * 20 > p0.len(), "{ctx}");
            } else {
                assert_eq!(diff, 0, "{ctx}");
            }
        }
        // Scales (the fp32 words after the codes) are identical for the grouped codecs:
        // only the rounding differs. sdp4bit 2x2: 8-bit, 128-element groups.
        if name.starts_with("sdp4bit P=3") {
            let p1 = first(1);
            let groups = p0.len() / (128 + 4) / 2; // per slab; two slabs (D = 2)
            let slab = p0.len() / 2;
            for s in 0..2 {
                let meta = s * slab + groups * 128..s * slab + groups * 132;
                assert_eq!(p0[meta.clone()], p1[meta], "{name}: scales of slab {s}");
            }
        }
    }
}

/// `steps` reduce-scatters on one object per rank (reuse) or a fresh object per step.
fn run_steps(
    config: &Config,
    topo: &Topology,
    steps: &[(u64, Vec<Vec<f32>>)],
    reuse: bool,
) -> Vec<Vec<Vec<u32>>> {
    let cluster = LocalCluster::new(topo.clone());
    let w = topo.world();
    let numel = steps[0].1[0].len();
    let res = cluster.run(|c| -> sdp4bit::Result<Vec<Vec<u32>>> {
        let me = c.world.rank();
        let mut rs = GradReduceScatter::new(config, topo, me, numel, 2)?;
        let mut out = Vec::new();
        for (step, grads) in steps {
            if !reuse {
                rs = GradReduceScatter::new(config, topo, me, numel, 2)?;
            }
            let mut shard = vec![0.0f32; numel / w];
            rs.run(c, &grads[me], &mut shard, *step)?;
            out.push(f32_bits(&shard));
        }
        Ok(out)
    });
    res.into_iter().map(|x| x.unwrap()).collect()
}

#[test]
fn reused_buffers_equal_fresh_objects() {
    for (name, config, topo) in cases() {
        let w = topo.world();
        // Small then large magnitudes, so stale buffer contents would show.
        let steps: Vec<(u64, Vec<Vec<f32>>)> = [1e3, 1e-3, 1.0]
            .iter()
            .enumerate()
            .map(|(k, &s)| (k as u64, rank_grads(400 + k as u64, w, w * 1237, s)))
            .collect();
        let reused = run_steps(&config, &topo, &steps, true);
        let fresh = run_steps(&config, &topo, &steps, false);
        assert_eq!(reused, fresh, "{name}");
    }
}

/// One qWD all-gather step per `news` entry through a recording world communicator; returns
/// per rank the params after each step and the all-gather payloads.
fn weight_run(
    config: &Config,
    w: usize,
    init: &[bf16],
    news: &[Vec<bf16>],
) -> Vec<(Vec<u16>, Vec<Record>)> {
    let topo = Topology::uniform(1, w).unwrap();
    let s = init.len() / w;
    let cluster = LocalCluster::new(topo.clone());
    cluster
        .run(|c| -> sdp4bit::Result<(Vec<u16>, Vec<Record>)> {
            let me = c.world.rank();
            let rec = Recorder::new(c.world);
            let mut ag = WeightAllGather::new(config, &topo, me, 1, init)?;
            let mut params = init.to_vec();
            let mut bits = Vec::new();
            for (k, new) in news.iter().enumerate() {
                params[me * s..(me + 1) * s].copy_from_slice(&new[me * s..(me + 1) * s]);
                ag.run(&rec, &mut params, 10 + k as u64)?;
                bits.extend(bf16_bits(&params));
            }
            Ok((bits, rec.take()))
        })
        .into_iter()
        .map(|x| x.unwrap())
        .collect()
}

#[test]
fn weight_codecs_are_deterministic_and_seeded() {
    let w = 3;
    let numel = w * 2085;
    let mut rng = SplitMix64::new(500);
    let init: Vec<bf16> = gaussian_f32(&mut rng, numel, 0.02)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let news: Vec<Vec<bf16>> = (0..3)
        .map(|_| {
            init.iter()
                .map(|v| bf16::from_f32(v.to_f32() + (rng.gaussian() * 1e-3) as f32))
                .collect()
        })
        .collect();
    for (name, config) in [
        ("qwd", cfg(Preset::Sdp4bit, &[])),
        ("qw", cfg(Preset::Sdp4bit, &[("weight_codec", "qw")])),
        ("qsdp", cfg(Preset::Qsdp, &[])),
        ("zeropp", cfg(Preset::Zeropp, &[])),
    ] {
        let a = weight_run(&config, w, &init, &news);
        let b = weight_run(&config, w, &init, &news);
        assert_eq!(a, b, "{name}: two runs differ");
        let c = weight_run(&with_seed(&config, 77), w, &init, &news);
        let diff = a[0]
            .1
            .iter()
            .zip(&c[0].1)
            .map(|(x, y)| x.send.iter().zip(&y.send).filter(|(p, q)| p != q).count())
            .sum::<usize>();
        if config.weight.rounding == sdp4bit::Rounding::Stochastic {
            assert!(diff > 0, "{name}: the seed does not change the codes");
        } else {
            assert_eq!(diff, 0, "{name}: round-to-nearest depends on the seed");
        }
        // All replicas equal after every step.
        for r in 1..w {
            assert_eq!(a[r].0, a[0].0, "{name}: replica {r}");
        }
    }
}

#[test]
fn stream_ids_separate_bucket_rank_and_stage() {
    // The stream word packs (bucket, rank, stage) injectively, so no two quantizations of
    // one step share uniforms.
    use sdp4bit::rng::{Stage, stream_id};
    let a = stream_id(3, 1, Stage::Weight).unwrap();
    let b = stream_id(3, 1, Stage::GradFirst).unwrap();
    let c = stream_id(3, 1, Stage::GradSecond).unwrap();
    let d = stream_id(3, 1, Stage::GlobalQsgd).unwrap();
    let e = stream_id(3, 2, Stage::Weight).unwrap();
    let f = stream_id(4, 1, Stage::Weight).unwrap();
    let ids = [a, b, c, d, e, f];
    for i in 0..ids.len() {
        for j in 0..i {
            assert_ne!(ids[i], ids[j], "streams {i} and {j} coincide");
        }
    }
}
