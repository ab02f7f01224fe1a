//! The weight all-gather (`WeightAllGather` over `LocalCluster`).
//!
//! - qWD over 1000 simulated optimizer steps (W = 4 as 2 x 2, W = 3): an optimizer holds an
//!   fp32 master copy, adds a small random update every step and writes `bf16(master)` into
//!   its own shard; after every step every replica is bit-identical, and the reconstruction
//!   error `|param - bf16(master)|` is within the one-step bound derived from that step's
//!   difference (4-bit SR scale + bf16 half-ulp, `reference::weight::weight_bounds`), does
//!   not grow (last 100 steps vs first 100) and is far below a direct-quantization (qw) run's.
//! - the direct codecs (qw, qsdp, zeropp): replicas bit-identical and within the bound of a
//!   direct quantization of the new weights, also in mean square (non-vacuous);
//! - the uncompressed codec is a bit-exact gather; W == 1 is a copy for every codec.

use std::time::Instant;

use half::bf16;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, WeightAllGather};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::{
    bits::{bf16_bits, digest},
    cluster::per_step,
    random::{SplitMix64, gaussian_f32},
    reference::weight::weight_bounds,
    setups::cfg,
};

/// Per-step record of one replica.
#[derive(Debug, Clone, Copy)]
struct StepStats {
    digest: u64,
    max_ratio: f64,
    sum_err2: f64,
    n: usize,
}

/// Simulates `steps` optimizer steps with `config`'s weight codec on `topo`; returns
/// `[rank][step]` stats. Every rank derives the same master weights and updates from `seed`
/// (as data-parallel replicas of one model would) and writes only its own shard.
fn simulate(
    config: &Config,
    topo: &Topology,
    per_rank: usize,
    steps: u64,
    seed: u64,
) -> Vec<Vec<StepStats>> {
    let w = topo.world();
    let numel = w * per_rank;
    let cluster = LocalCluster::new(topo.clone());
    let res = cluster.run(|c| -> sdp4bit::Result<Vec<StepStats>> {
        let me = c.world.rank();
        let mut init = SplitMix64::new(seed);
        let mut master: Vec<f32> = gaussian_f32(&mut init, numel, 0.02);
        let mut params: Vec<bf16> = master.iter().map(|&m| bf16::from_f32(m)).collect();
        let mut ag = WeightAllGather::new(config, topo, me, 9, &params)?;
        let own = me * per_rank..(me + 1) * per_rank;
        let mut out = Vec::with_capacity(steps as usize);
        for step in 1..=steps {
            let mut upd = SplitMix64::derive(seed, step);
            for m in master.iter_mut() {
                *m += (upd.gaussian() * 2e-4) as f32;
            }
            let new: Vec<bf16> = master.iter().map(|&m| bf16::from_f32(m)).collect();
            let before = params.clone();
            params[own.clone()].copy_from_slice(&new[own.clone()]);
            ag.run(c.world, &mut params, step)?;
            let (bound, _) = weight_bounds(config, w, &before, &new);
            let mut st = StepStats {
                digest: digest(&bf16_bits(&params)),
                max_ratio: 0.0,
                sum_err2: 0.0,
                n: numel,
            };
            for i in 0..numel {
                let err = (f64::from(params[i].to_f32()) - f64::from(new[i].to_f32())).abs();
                if err > 0.0 {
                    st.max_ratio = st.max_ratio.max(err / bound[i]);
                }
                st.sum_err2 += err * err;
            }
            out.push(st);
        }
        Ok(out)
    });
    res.into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

fn rms(stats: &[StepStats]) -> f64 {
    let (s, n) = stats
        .iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x.sum_err2, n + x.n));
    (s / n as f64).sqrt()
}

#[test]
fn qwd_thousand_steps_identical_replicas_bounded_non_growing_error() {
    const STEPS: u64 = 1000;
    // A small bucket: one full 2048-group and one partial group per shard.
    let per_rank = 2048 + 37;
    for (name, topo) in [
        ("W=4 (2x2)", Topology::uniform(2, 2).unwrap()),
        ("W=3", Topology::uniform(1, 3).unwrap()),
    ] {
        let start = Instant::now();
        let qwd = simulate(&cfg(Preset::Sdp4bit, &[]), &topo, per_rank, STEPS, 42);
        let qw = simulate(
            &cfg(Preset::Sdp4bit, &[("weight_codec", "qw")]),
            &topo,
            per_rank,
            STEPS,
            42,
        );
        for (codec, runs) in [("qwd", &qwd), ("qw", &qw)] {
            for step in 0..STEPS as usize {
                let d0 = runs[0][step].digest;
                for (r, run) in runs.iter().enumerate() {
                    assert_eq!(
                        run[step].digest,
                        d0,
                        "{name} {codec}: replica {r} differs from replica 0 after step {}",
                        step + 1
                    );
                }
            }
        }
        // Replicas are identical, so rank 0's errors are every rank's.
        let q = &qwd[0];
        let worst = q
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.max_ratio.total_cmp(&b.1.max_ratio))
            .unwrap();
        assert!(
            worst.1.max_ratio <= 1.0,
            "{name} qwd: step {} error / one-step bound = {}",
            worst.0 + 1,
            worst.1.max_ratio
        );
        let first = rms(&q[..100]);
        let last = rms(&q[q.len() - 100..]);
        let middle = rms(&q[450..550]);
        let direct = rms(&qw[0]);
        eprintln!(
            "{name}: qwd rms error first 100 steps {first:.3e}, steps 451-550 {middle:.3e}, \
             last 100 {last:.3e}; qw rms {direct:.3e}; max err/bound {:.3}; {:.2?}",
            worst.1.max_ratio,
            start.elapsed()
        );
        // No drift: one step's error is folded into the next difference. A reference that
        // ignored the reconstruction error would random-walk (~sqrt(10) growth here).
        assert!(
            last <= 1.5 * first && middle <= 1.5 * first,
            "{name}: qwd error grows: first 100 steps rms {first:e}, middle {middle:e}, last \
             100 {last:e}"
        );
        assert!(
            first > 0.0,
            "{name}: qwd made no error at all: not quantizing?"
        );
        assert!(
            last * 10.0 < direct,
            "{name}: qwd rms {last:e} is not much below direct qw's {direct:e}"
        );
    }
}

/// One all-gather step per entry of `news` on one object per rank (buffers reused); returns
/// `[step][rank]` params. Every replica starts from `init`.
fn gather_steps(
    config: &Config,
    topo: &Topology,
    init: &[bf16],
    news: &[Vec<bf16>],
) -> Vec<Vec<Vec<bf16>>> {
    let w = topo.world();
    let s = init.len() / w;
    let cluster = LocalCluster::new(topo.clone());
    let res = cluster.run(|c| -> sdp4bit::Result<Vec<Vec<bf16>>> {
        let me = c.world.rank();
        let mut ag = WeightAllGather::new(config, topo, me, 3, init)?;
        let mut params = init.to_vec();
        let mut out = Vec::new();
        for (k, new) in news.iter().enumerate() {
            params[me * s..(me + 1) * s].copy_from_slice(&new[me * s..(me + 1) * s]);
            ag.run(c.world, &mut params, 100 + k as u64)?;
            out.push(params.clone());
        }
        Ok(out)
    });
    per_step(res, &config.to_string())
}

#[test]
fn every_weight_codec_identical_replicas_within_derived_bounds() {
    let start = Instant::now();
    let codecs: [(&str, Config); 5] = [
        ("qwd", cfg(Preset::Sdp4bit, &[])),
        ("qw", cfg(Preset::Sdp4bit, &[("weight_codec", "qw")])),
        ("qsdp", cfg(Preset::Qsdp, &[])),
        ("zeropp", cfg(Preset::Zeropp, &[])),
        ("none", cfg(Preset::Baseline, &[])),
    ];
    let mut case = 0u64;
    for (name, config) in &codecs {
        let (mut sum_err2, mut sum_var, mut sum_energy, mut n) = (0.0, 0.0, 0.0, 0usize);
        for w in [1usize, 2, 3, 4, 6, 8] {
            let topo = Topology::uniform(1, w).unwrap();
            for per_rank in [5usize, 1237, 4099, 2 * 2048 + 1] {
                case += 1;
                let numel = w * per_rank;
                let mut rng = SplitMix64::new(0xa11 ^ (case << 16));
                let sigma = [0.02, 1.0, 300.0][(case % 3) as usize];
                let init: Vec<bf16> = gaussian_f32(&mut rng, numel, sigma)
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect();
                // Three steps: a small update, another, then a large jump.
                let mut news = Vec::new();
                let mut cur: Vec<f32> = init.iter().map(|v| v.to_f32()).collect();
                for scale in [1e-2, 1e-2, 1.0] {
                    for v in cur.iter_mut() {
                        *v += (rng.gaussian() * sigma * scale) as f32;
                    }
                    news.push(cur.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
                }
                let outs = gather_steps(config, &topo, &init, &news);
                let mut before = init.clone();
                for (k, replicas) in outs.iter().enumerate() {
                    let ctx = format!("{name} W={w} numel={numel} sigma={sigma} step {k}");
                    for (r, p) in replicas.iter().enumerate() {
                        assert_eq!(
                            bf16_bits(p),
                            bf16_bits(&replicas[0]),
                            "{ctx}: replica {r} differs from replica 0"
                        );
                    }
                    let params = &replicas[0];
                    let new = &news[k];
                    if *name == "none" || w == 1 {
                        // Uncompressed gather, or a single rank: an exact copy.
                        assert_eq!(bf16_bits(params), bf16_bits(new), "{ctx}: not exact");
                    } else {
                        let (bound, var) = weight_bounds(config, w, &before, new);
                        for i in 0..numel {
                            let got = f64::from(params[i].to_f32());
                            let want = f64::from(new[i].to_f32());
                            let err = (got - want).abs();
                            assert!(
                                err <= bound[i],
                                "{ctx}: element {i}: got {got:e}, new {want:e}, error {err:e} > \
                                 bound {:e}",
                                bound[i]
                            );
                            sum_err2 += err * err;
                            sum_var += var[i];
                            sum_energy += want * want;
                            n += 1;
                        }
                    }
                    before = params.clone();
                }
            }
        }
        if *name != "none" {
            let (mse, mvar, men) = (
                sum_err2 / n as f64,
                sum_var / n as f64,
                sum_energy / n as f64,
            );
            eprintln!("{name}: n={n} mse={mse:.3e} mean var bound={mvar:.3e} mean new^2={men:.3e}");
            assert!(
                mse <= 1.25 * mvar,
                "{name}: mse {mse:e} > 1.25 x bound {mvar:e}"
            );
            assert!(
                mvar < 0.1 * men,
                "{name}: vacuous mean-square bound {mvar:e} vs {men:e}"
            );
            assert!(mse > 0.0, "{name}: no error at all: not quantizing?");
        }
    }
    eprintln!("{case} cases in {:.2?}", start.elapsed());
}

#[test]
fn bad_weight_buffers_are_errors() {
    let config = cfg(Preset::Sdp4bit, &[]);
    let topo = Topology::uniform(2, 2).unwrap();
    let params = vec![bf16::ONE; 4 * 1237 + 1];
    let e = WeightAllGather::new(&config, &topo, 0, 0, &params).unwrap_err();
    assert!(e.to_string().contains("4949"), "{e}");
    let params = vec![bf16::ONE; 4 * 1237];
    let cluster = LocalCluster::new(topo.clone());
    let res = cluster.run(|c| {
        let me = c.world.rank();
        let mut ag = WeightAllGather::new(&config, &topo, me, 0, &params)?;
        let mut wrong = vec![bf16::ONE; 4 * 1237 - 4];
        ag.run(c.world, &mut wrong, 0)
    });
    for x in res {
        let e = x.expect_err("wrong param bucket length");
        let msg = e.to_string();
        assert!(msg.contains("4944") && msg.contains("4948"), "{msg}");
    }
}
