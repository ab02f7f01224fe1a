//! The gradient reduce-scatter (`GradReduceScatter` over `LocalCluster`) against an exact f64
//! reference with per-element error bounds derived from the quantizers (the support crate's
//! `reference` module derives them).
//!
//! Every preset (sdp4bit = TLq-HS, qsdp, global-qsgd, zeropp, baseline) and the TLq ablation
//! run on every topology of `setups::all_topologies` (W in {1, 2, 3, 4, 6, 8}, every D x M
//! factorisation, non-uniform and interleaved node layouts), P in {1, 3}, odd bucket sizes
//! (W * 1237, W * 4099 and W * 5, the last smaller than one group), two steps per object
//! with fresh data (the buffers are reused). The baseline is bit-exact against the fp32
//! rank-order sum, W == 1 is an exact copy, and every quantized codec stays within its
//! worst-case bound element by element and within its (non-vacuous) mean-square bound.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use half::bf16;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, CommGroups, GradReduceScatter, WeightAllGather};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Error, Preset};
use sdp4bit_test_support::{
    bits::assert_bits_eq,
    cluster::{per_step, reduce_scatter_ok, reduce_scatter_recorded},
    error_stats::{ErrStats, assert_within, compare},
    random::rank_grads,
    reference::grad::grad_reference,
    reference::route::{RefRoute, ref_route},
    setups::{FACTORS, all_topologies, cfg},
};

/// Bucket elements per rank of the sweeps: odd sizes, one smaller than any group.
const PER_RANK: [usize; 3] = [1237, 4099, 5];

/// Runs `data.len()` steps (`first_step`, `first_step + 1`, ...) on one `GradReduceScatter`
/// per rank, reusing its buffers; returns `[step][rank]` shards.
fn run_steps(
    config: &Config,
    topo: &Topology,
    data: &[Vec<Vec<f32>>],
    bucket_id: u32,
    first_step: u64,
) -> Vec<Vec<Vec<f32>>> {
    let cluster = LocalCluster::new(topo.clone());
    let w = topo.world();
    let numel = data[0][0].len();
    let per_rank = cluster.run(|c| -> sdp4bit::Result<Vec<Vec<f32>>> {
        let me = c.world.rank();
        let mut rs = GradReduceScatter::new(config, topo, me, numel, bucket_id)?;
        let mut out = Vec::new();
        for (k, grads) in data.iter().enumerate() {
            let mut shard = vec![f32::NAN; numel / w];
            rs.run(c, &grads[me], &mut shard, first_step + k as u64)?;
            out.push(shard);
        }
        Ok(out)
    });
    per_step(per_rank, &format!("config {config}"))
}

/// Scale of the gradients of case `i`: tiny, unit and large, so bounds are checked across
/// magnitudes (they are all relative to the data).
fn sigma_of(i: u64) -> f64 {
    [1e-4, 1.0, 30.0][(i % 3) as usize]
}

/// The sweep of one gradient codec over every topology, P and size.
fn sweep(preset: Preset, extra: &[(&str, &str)], seed: u64) {
    let start = Instant::now();
    let mut total = ErrStats::default();
    let mut case = 0u64;
    for (tname, topo) in all_topologies() {
        let w = topo.world();
        for p in ["1", "3"] {
            let mut overrides = extra.to_vec();
            overrides.push(("pipeline_chunks", p));
            let config = cfg(preset, &overrides);
            for per_rank in PER_RANK {
                case += 1;
                let numel = w * per_rank;
                let sigma = sigma_of(case);
                let data: Vec<Vec<Vec<f32>>> = (0..2)
                    .map(|k| rank_grads(seed ^ (case << 8) ^ k, w, numel, sigma))
                    .collect();
                let first_step = 11 + case;
                let bucket_id = (case % 7) as u32;
                let outs = run_steps(&config, &topo, &data, bucket_id, first_step);
                for (k, shards) in outs.iter().enumerate() {
                    let step = first_step + k as u64;
                    let ctx = format!(
                        "{preset} {extra:?} {tname} P={p} numel={numel} (W x {per_rank}) \
                         sigma={sigma:e} step={step}"
                    );
                    let reference = grad_reference(&config, &topo, &data[k], step);
                    match reference.route {
                        RefRoute::Copy => {
                            assert_bits_eq(&shards[0], &data[k][0], &format!("{ctx}: W=1 copy"))
                        }
                        RefRoute::Exact => {
                            let all: Vec<f32> = shards.concat();
                            assert_bits_eq(&all, &reference.exact_f32, &ctx);
                        }
                        _ => {
                            let st = compare(&reference, shards);
                            assert_within(&st, 2048, &ctx);
                            total.add(&st);
                        }
                    }
                }
            }
        }
    }
    if total.n > 0 {
        let ctx = format!("{preset} {extra:?}: all cases together");
        assert_within(&total, 2048, &ctx);
        // The worst-case bound itself is non-vacuous (well below what returning zeros, an
        // error of |sum| <= sum |x|, would need) for every codec without Hadamard. With
        // Hadamard on it charges each output the block mean of transformed-domain errors,
        // sqrt(32) times the data's scale, so it is loose by design there and the
        // mean-square check (asserted non-vacuous above) carries the teeth.
        if cfg(preset, extra).grad.hadamard_block.is_none() {
            assert!(
                total.sum_bound < 0.5 * total.sum_l1,
                "{ctx}: vacuous worst-case bound; {}",
                total.summary()
            );
        }
    }
    eprintln!(
        "{preset} {extra:?}: {case} cases in {:.2?}; {}",
        start.elapsed(),
        total.summary()
    );
}

#[test]
fn sdp4bit_tlq_hs_within_derived_bounds() {
    sweep(Preset::Sdp4bit, &[], 0x5d94_0001);
}

#[test]
fn tlq_ablation_within_derived_bounds() {
    sweep(Preset::Sdp4bit, &[("grad_codec", "tlq")], 0x5d94_0002);
}

#[test]
fn qsdp_within_derived_bounds() {
    sweep(Preset::Qsdp, &[], 0x5d94_0003);
}

#[test]
fn global_qsgd_within_derived_bounds() {
    sweep(Preset::GlobalQsgd, &[], 0x5d94_0004);
}

#[test]
fn zeropp_within_derived_bounds() {
    sweep(Preset::Zeropp, &[], 0x5d94_0005);
}

#[test]
fn baseline_is_bit_exact_rank_order_fp32_sum() {
    // The sweep asserts bit equality with ((x_0 + x_1) + x_2) + ... for every case.
    sweep(Preset::Baseline, &[], 0x5d94_0006);
}

#[test]
fn quantized_codecs_actually_quantize() {
    // Guards the sweeps against a codec silently running the exact path: the quantized
    // output must differ from the fp32 sum in most elements.
    let topo = Topology::uniform(2, 2).unwrap();
    let grads = rank_grads(77, 4, 4 * 4099, 1.0);
    for (preset, extra) in [
        (Preset::Sdp4bit, vec![]),
        (Preset::Sdp4bit, vec![("grad_codec", "tlq")]),
        (Preset::Qsdp, vec![]),
        (Preset::GlobalQsgd, vec![]),
        (Preset::Zeropp, vec![]),
    ] {
        let config = cfg(preset, &extra);
        let shards = reduce_scatter_ok(&config, &topo, &grads, 0, 0);
        let reference = grad_reference(&config, &topo, &grads, 0);
        let all = shards.concat();
        let same = all
            .iter()
            .zip(&reference.exact_f32)
            .filter(|(a, b)| a.to_bits() == b.to_bits())
            .count();
        assert!(
            same * 10 < all.len(),
            "{preset} {extra:?}: {same} of {} elements equal the exact fp32 sum",
            all.len()
        );
    }
}

#[test]
fn grad_quant_start_step_switches_from_exact_to_quantized() {
    for (preset, extra) in [
        (Preset::Sdp4bit, vec![("pipeline_chunks", "3")]),
        (Preset::Qsdp, vec![]),
        (Preset::GlobalQsgd, vec![]),
        (Preset::Zeropp, vec![]),
    ] {
        for (tname, topo) in [
            ("2x2", Topology::uniform(2, 2).unwrap()),
            ("3+1", Topology::from_node_labels(&[0, 0, 0, 1]).unwrap()),
        ] {
            let mut overrides = extra.clone();
            overrides.push(("grad_quant_start_step", "5"));
            let config = cfg(preset, &overrides);
            let w = topo.world();
            // Large enough that the padded quantized traffic is below the fp32 traffic even
            // with P = 3 (shards pad to lcm(2048, 3 * 128) = 6144 elements).
            let numel = w * 4099;
            let data: Vec<Vec<Vec<f32>>> =
                (0..4).map(|k| rank_grads(900 + k, w, numel, 0.5)).collect();
            // Steps 3, 4 (before the start) and 5, 6 (from it on) on one object per rank.
            let outs = run_steps(&config, &topo, &data, 3, 3);
            let probe = GradReduceScatter::new(&config, &topo, 0, numel, 3).unwrap();
            for (k, shards) in outs.iter().enumerate() {
                let step = 3 + k as u64;
                let ctx = format!("{preset} {tname} start=5 step={step}");
                let reference = grad_reference(&config, &topo, &data[k], step);
                let all = shards.concat();
                if step < 5 {
                    assert_eq!(reference.route, RefRoute::Exact);
                    assert!(!probe.quantizes_at(step), "{ctx}");
                    assert_eq!(probe.wire_bytes(step), probe.baseline_wire_bytes(), "{ctx}");
                    assert_bits_eq(&all, &reference.exact_f32, &ctx);
                } else {
                    assert!(probe.quantizes_at(step), "{ctx}");
                    assert!(
                        probe.wire_bytes(step).total() < probe.baseline_wire_bytes().total(),
                        "{ctx}"
                    );
                    let differ = all
                        .iter()
                        .zip(&reference.exact_f32)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert!(
                        differ * 2 > all.len(),
                        "{ctx}: only {differ} elements differ"
                    );
                    assert_within(&compare(&reference, shards), 2048, &ctx);
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Bad inputs
// ------------------------------------------------------------------------------------------

fn assert_err_names(err: &Error, needles: &[&str], ctx: &str) {
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "{ctx}: error '{msg}' does not name '{n}'");
    }
}

#[test]
fn bad_plans_are_errors_naming_the_sizes() {
    let topo = Topology::uniform(2, 2).unwrap();
    for preset in [
        Preset::Sdp4bit,
        Preset::Qsdp,
        Preset::GlobalQsgd,
        Preset::Zeropp,
        Preset::Baseline,
    ] {
        let config = cfg(preset, &[]);
        let e = GradReduceScatter::new(&config, &topo, 0, 4 * 1237 + 2, 0).unwrap_err();
        assert!(matches!(e, Error::Plan(_)), "{preset}: {e:?}");
        assert_err_names(&e, &["4950", "4"], &format!("{preset}: numel % W"));
        let e = GradReduceScatter::new(&config, &topo, 0, 0, 0).unwrap_err();
        assert!(matches!(e, Error::Plan(_)), "{preset}: {e:?}");
        let e = GradReduceScatter::new(&config, &topo, 4, 4 * 1237, 0).unwrap_err();
        assert_err_names(&e, &["4"], &format!("{preset}: rank >= W"));
        let e = GradReduceScatter::new(&config, &topo, 0, 4 * 1237, 4096).unwrap_err();
        assert_err_names(&e, &["4096"], &format!("{preset}: bucket id"));
    }
}

#[test]
fn wrong_buffer_lengths_are_errors_on_every_rank() {
    for preset in [
        Preset::Sdp4bit,
        Preset::Qsdp,
        Preset::GlobalQsgd,
        Preset::Zeropp,
        Preset::Baseline,
    ] {
        let config = cfg(preset, &[]);
        for topo in [
            Topology::uniform(2, 2).unwrap(),
            Topology::uniform(1, 1).unwrap(),
        ] {
            let w = topo.world();
            let numel = w * 1237;
            let cluster = LocalCluster::new(topo.clone());
            // (bucket length, shard length, the two sizes the error must name)
            let cases = [
                (numel - 1, numel / w, numel - 1, numel),
                (numel + w, numel / w, numel + w, numel),
                (numel, numel / w - 1, numel / w - 1, numel / w),
                (numel, numel / w + 3, numel / w + 3, numel / w),
            ];
            for (blen, slen, got, want) in cases {
                let start = Instant::now();
                let res = cluster.run(|c| {
                    let me = c.world.rank();
                    let mut rs = GradReduceScatter::new(&config, &topo, me, numel, 0)?;
                    let bucket = vec![1.0f32; blen];
                    let mut shard = vec![0.0f32; slen];
                    rs.run(c, &bucket, &mut shard, 0)
                });
                assert!(start.elapsed() < Duration::from_secs(10));
                for (r, x) in res.iter().enumerate() {
                    let e = x.as_ref().expect_err("wrong length must fail");
                    assert!(matches!(e, Error::Buffer(_)), "{preset} rank {r}: {e:?}");
                    assert_err_names(
                        e,
                        &[&got.to_string(), &want.to_string()],
                        &format!("{preset} W={w} rank {r}"),
                    );
                }
            }
        }
    }
}

#[test]
fn missing_level_communicator_is_an_error_on_every_rank() {
    let config = cfg(Preset::Sdp4bit, &[]);
    let topo = Topology::uniform(2, 2).unwrap();
    let cluster = LocalCluster::new(topo.clone());
    let res = cluster.run(|c| {
        let me = c.world.rank();
        let groups = CommGroups {
            world: c.world,
            intra: None,
            inter: c.inter,
        };
        let mut rs = GradReduceScatter::new(&config, &topo, me, 4 * 1237, 0)?;
        let mut shard = vec![0.0f32; 1237];
        rs.run(&groups, &vec![0.0; 4 * 1237], &mut shard, 0)
    });
    for x in res {
        let e = x.expect_err("missing intra communicator");
        assert_err_names(&e, &["intra-node"], "missing intra comm");
    }
}

/// Runs a reduce-scatter in which rank `odd` plans `numel_odd` elements and every other rank
/// `numel`, on a watchdog thread; returns every rank's result, or `None` if the cluster has
/// not returned within `limit` (the cluster thread is then left behind; it ends when the
/// communicator's own timeout fires or the test process exits).
fn mismatched_run(
    config: Config,
    topo: Topology,
    odd: &'static [usize],
    numel: usize,
    numel_odd: usize,
    limit: Duration,
) -> Option<Vec<sdp4bit::Result<()>>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let cluster = LocalCluster::new(topo.clone());
        let w = topo.world();
        let res = cluster.run(|c| {
            let me = c.world.rank();
            let n = if odd.contains(&me) { numel_odd } else { numel };
            let mut rs = GradReduceScatter::new(&config, &topo, me, n, 0)?;
            let grads = vec![0.25f32; n];
            let mut shard = vec![0.0f32; n / w];
            rs.run(c, &grads, &mut shard, 0)
        });
        let _ = tx.send(res);
    });
    rx.recv_timeout(limit).ok()
}

#[test]
fn sizes_mismatched_across_ranks_fail_on_every_rank_one_level() {
    // Every route whose first collective spans all ranks of the world or of every node: the
    // mismatch is seen by each rank's first collective, so every rank must return an error.
    // (preset, overrides, topology, the ranks that plan a different bucket)
    type Case = (
        Preset,
        Vec<(&'static str, &'static str)>,
        Topology,
        &'static [usize],
    );
    let cases: Vec<Case> = vec![
        (
            Preset::Baseline,
            vec![],
            Topology::uniform(2, 2).unwrap(),
            &[0],
        ),
        (
            Preset::GlobalQsgd,
            vec![],
            Topology::uniform(2, 2).unwrap(),
            &[2],
        ),
        (Preset::Qsdp, vec![], Topology::uniform(2, 2).unwrap(), &[1]),
        (
            Preset::Sdp4bit,
            vec![],
            Topology::from_node_labels(&[0, 0, 0, 1]).unwrap(),
            &[3],
        ),
        (
            Preset::Sdp4bit,
            vec![],
            Topology::uniform(1, 4).unwrap(),
            &[0],
        ),
        (
            Preset::Zeropp,
            vec![],
            Topology::uniform(4, 1).unwrap(),
            &[0],
        ),
        // Two-level, but a mismatched rank on every node: every intra-node exchange fails.
        (
            Preset::Sdp4bit,
            vec![],
            Topology::uniform(2, 2).unwrap(),
            &[0, 2],
        ),
    ];
    for (preset, extra, topo, odd) in cases {
        let w = topo.world();
        let config = cfg(preset, &extra);
        // 2048 more elements per shard: a different padded shard for every codec.
        let res = mismatched_run(
            config,
            topo,
            odd,
            w * 1237,
            w * (1237 + 2048),
            Duration::from_secs(20),
        )
        .unwrap_or_else(|| panic!("{preset} W={w} odd={odd:?}: ranks hung"));
        for (r, x) in res.iter().enumerate() {
            let e = x
                .as_ref()
                .expect_err("a cross-rank size mismatch must be an error");
            assert!(matches!(e, Error::Comm(_)), "{preset} rank {r}: {e:?}");
            assert!(
                e.to_string().contains("bytes"),
                "{preset} rank {r}: error '{e}' does not name the byte counts"
            );
        }
    }
}

#[test]
fn sizes_mismatched_across_ranks_fail_on_every_rank_two_level() {
    // One rank of a 2 x 2 two-level route plans a different bucket. Its node's intra-node
    // exchange fails on both of that node's ranks, but the other node's ranks pass their
    // intra-node exchange and then wait in the inter-node one for peers that have already
    // returned. Every rank must get an error, never a hang.
    let config = cfg(Preset::Sdp4bit, &[]);
    let topo = Topology::uniform(2, 2).unwrap();
    let limit = Duration::from_secs(15);
    let res = mismatched_run(config, topo, &[0], 4 * 1237, 4 * (1237 + 2048), limit);
    let res = res.unwrap_or_else(|| {
        panic!(
            "sdp4bit 2x2 with rank 0's bucket mismatched: the ranks of node 1 did not return \
             within {limit:?} (they wait for the inter-node all-to-all until \
             LocalGroup::TIMEOUT, 120 s); see the report"
        )
    });
    for (r, x) in res.iter().enumerate() {
        assert!(x.is_err(), "rank {r} succeeded despite the mismatch");
    }
}

// ------------------------------------------------------------------------------------------
// Bytes on the wire
// ------------------------------------------------------------------------------------------

/// Bytes one slab of `groups` groups of `g` `bits`-bit codes (`meta` fp32 words per group)
/// takes on the wire (docs/numerics.md §6: codes, then scales/offsets, 16-byte aligned).
fn slab_bytes(groups: usize, g: usize, bits: usize, meta: usize) -> u64 {
    ((groups * g * bits / 8 + 4 * meta * groups).div_ceil(16) * 16) as u64
}

#[test]
fn wire_bits_per_element_match_the_ideal_values() {
    // Large buckets: the per-element bits of docs/numerics.md §9 within padding.
    let per_rank = 2048 * 72; // a multiple of lcm(2048, 3 * 128): no padding for P = 1, 3
    for p in ["1", "3"] {
        let config = cfg(Preset::Sdp4bit, &[("pipeline_chunks", p)]);
        for (d, m) in [(2, 2), (4, 2), (2, 4), (8, 1), (1, 8), (3, 2)] {
            let topo = Topology::uniform(m, d).unwrap();
            let w = d * m;
            let numel = w * per_rank;
            let rs = GradReduceScatter::new(&config, &topo, 0, numel, 0).unwrap();
            let s = rs.plan().shard_len as f64;
            assert_eq!(rs.plan().padded_shard_len, rs.plan().shard_len);
            let wb = rs.wire_bytes(0);
            let ctx = format!("sdp4bit D={d} M={m} P={p}");
            // Intra-node: 8-bit codes + one fp32 scale per 128, for the M shards of every
            // intra-node peer; or, with M == 1, everything is one intra-node level.
            if d > 1 {
                let intra = wb.intra_node as f64 * 8.0 / ((d - 1) as f64 * m as f64 * s);
                assert!((intra - 8.25).abs() < 1e-9, "{ctx}: intra {intra} bits");
            } else {
                assert_eq!(wb.intra_node, 0, "{ctx}");
            }
            if m > 1 {
                let inter = wb.inter_node as f64 * 8.0 / ((m - 1) as f64 * s);
                assert!((inter - 4.25).abs() < 1e-9, "{ctx}: inter {inter} bits");
            } else {
                assert_eq!(wb.inter_node, 0, "{ctx}");
            }
            let base = rs.baseline_wire_bytes();
            assert_eq!(
                base.total() as f64 * 8.0,
                32.0 * (w - 1) as f64 * s,
                "{ctx}"
            );
            let params = vec![bf16::ZERO; numel];
            let ag = WeightAllGather::new(&config, &topo, 0, 0, &params).unwrap();
            let bits = ag.wire_bytes().total() as f64 * 8.0 / ((w - 1) as f64 * s);
            // One slab of S / 2048 groups, aligned to 16 bytes (the only padding here).
            let slab = slab_bytes(per_rank / 2048, 2048, 4, 1);
            assert_eq!(ag.wire_bytes().total(), (w - 1) as u64 * slab, "{ctx}");
            assert!(
                (bits - (4.0 + 32.0 / 2048.0)).abs() < 1e-3,
                "{ctx}: weights {bits}"
            );
            let base = ag.baseline_wire_bytes().total() as f64 * 8.0 / ((w - 1) as f64 * s);
            assert_eq!(base, 16.0, "{ctx}");
        }
    }
    // Other codecs and the degraded routes, at the bits docs/numerics.md §4.2 gives them.
    let numel_per = 2048 * 64;
    // (preset, overrides, node labels, intra bits, inter bits, shards per intra-node message:
    // M for a two-level route, whose intra-node slab carries every node's shard, else 1)
    for (preset, extra, labels, intra_bits, inter_bits, shards) in [
        (
            Preset::Qsdp,
            vec![],
            vec![0u64, 0, 1, 1],
            8.0 + 64.0 / 1024.0,
            8.0625,
            1.0,
        ),
        (Preset::Zeropp, vec![], vec![0, 0, 1, 1], 4.25, 4.25, 2.0),
        (Preset::GlobalQsgd, vec![], vec![0, 0, 1, 1], 8.0, 8.0, 1.0),
        (Preset::Sdp4bit, vec![], vec![0, 0, 0, 1], 4.25, 4.25, 1.0),
        (
            Preset::Sdp4bit,
            vec![("grad_codec", "tlq")],
            vec![0, 0, 0, 1],
            4.25,
            4.25,
            1.0,
        ),
    ] {
        let config = cfg(preset, &extra);
        let topo = Topology::from_node_labels(&labels).unwrap();
        let w = labels.len();
        let rs = GradReduceScatter::new(&config, &topo, 0, w * numel_per, 0).unwrap();
        let wb = rs.wire_bytes(0);
        let s = numel_per as f64;
        let same = (topo.intra_group(0).len() - 1) as f64;
        let other = (w - topo.intra_group(0).len()) as f64;
        let ctx = format!("{preset} {extra:?} labels {labels:?}");
        let intra = wb.intra_node as f64 * 8.0 / (same * shards * s);
        // A two-level route sends inter-node to the M - 1 same-local-index peers only.
        let inter_peers = if shards > 1.0 {
            (topo.nodes() - 1) as f64
        } else {
            other
        };
        let inter = wb.inter_node as f64 * 8.0 / (inter_peers * s);
        assert!((intra - intra_bits).abs() < 1e-9, "{ctx}: intra {intra}");
        assert!((inter - inter_bits).abs() < 1e-9, "{ctx}: inter {inter}");
    }
}

#[test]
fn wire_bytes_equal_the_bytes_actually_sent() {
    // The accounting of wire_bytes against what the collectives really carry, including the
    // padding of small buckets: each all-to-all sends (peers - 1) of its `peers` blocks.
    for (preset, extra) in [
        (Preset::Sdp4bit, vec![("pipeline_chunks", "3")]),
        (Preset::Sdp4bit, vec![]),
        (Preset::Qsdp, vec![]),
        (Preset::Zeropp, vec![]),
        (Preset::GlobalQsgd, vec![]),
        (Preset::Baseline, vec![]),
    ] {
        let config = cfg(preset, &extra);
        for (tname, topo) in all_topologies() {
            let w = topo.world();
            if w == 1 {
                continue;
            }
            for per_rank in [5, 1237] {
                let numel = w * per_rank;
                let grads = rank_grads(5, w, numel, 1.0);
                let logs = reduce_scatter_recorded(&config, &topo, 0, &[(0, grads)]);
                for (r, (_, world, intra, inter)) in logs[0].iter().enumerate() {
                    let rs = GradReduceScatter::new(&config, &topo, r, numel, 0).unwrap();
                    let want = rs.wire_bytes(0);
                    let ctx = format!("{preset} {extra:?} {tname} numel={numel} rank {r}");
                    let mut got_intra = 0u64;
                    let mut got_inter = 0u64;
                    for rec in intra.iter().filter(|x| x.op == "all_to_all") {
                        let d = topo.intra_group(r).len();
                        got_intra += (rec.send.len() / d * (d - 1)) as u64;
                    }
                    for rec in inter.iter().filter(|x| x.op == "all_to_all") {
                        let m = topo.nodes();
                        got_inter += (rec.send.len() / m * (m - 1)) as u64;
                    }
                    for rec in world
                        .iter()
                        .filter(|x| x.op == "all_to_all" || x.op == "reduce_scatter")
                    {
                        let block = rec.send.len() / w;
                        for peer in (0..w).filter(|&p| p != r) {
                            if topo.node_of(peer) == topo.node_of(r) {
                                got_intra += block as u64;
                            } else {
                                got_inter += block as u64;
                            }
                        }
                    }
                    assert_eq!(
                        (got_intra, got_inter),
                        (want.intra_node, want.inter_node),
                        "{ctx}"
                    );
                    // And the slab sizes of docs/numerics.md §6 for the grouped codecs' exchanges.
                    if preset == Preset::Sdp4bit
                        && matches!(ref_route(&config, &topo, 0), RefRoute::TwoLevel { .. })
                    {
                        let s_pad = rs.plan().padded_shard_len;
                        let p = rs.plan().chunks;
                        let gc = s_pad / p / 128;
                        let m = topo.nodes();
                        let rec = &intra[0];
                        let d = topo.intra_group(r).len();
                        assert_eq!(
                            rec.send.len() as u64,
                            d as u64 * slab_bytes(gc * m, 128, 8, 1),
                            "{ctx}"
                        );
                        let rec = &inter[0];
                        assert_eq!(
                            rec.send.len() as u64,
                            m as u64 * slab_bytes(gc, 128, 4, 1),
                            "{ctx}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn non_uniform_nodes_log_a_notice_and_uniform_ones_do_not() {
    let config = cfg(Preset::Sdp4bit, &[]);
    let topo = Topology::from_node_labels(&[0, 0, 0, 1]).unwrap();
    let rs = GradReduceScatter::new(&config, &topo, 0, 4 * 1237, 0).unwrap();
    let notice = rs.notice().expect("non-uniform nodes must log a notice");
    assert!(notice.contains("unequal"), "{notice}");
    assert!(notice.contains('4'), "{notice}");
    for (d, m) in FACTORS {
        let topo = Topology::uniform(m, d).unwrap();
        let rs = GradReduceScatter::new(&config, &topo, 0, d * m * 1237, 0).unwrap();
        assert!(rs.notice().is_none(), "D={d} M={m}: {:?}", rs.notice());
    }
}

// ------------------------------------------------------------------------------------------
// Pipelined chunks: the same bytes as one chunk
// ------------------------------------------------------------------------------------------

/// The topologies of the pipeline tests: every route shape (two levels, intra only, inter
/// only, one level over the world on unequal nodes, W = 2).
fn pipeline_topologies() -> Vec<(&'static str, Topology)> {
    vec![
        ("2x2", Topology::uniform(2, 2).unwrap()),
        ("4x1", Topology::uniform(1, 4).unwrap()),
        ("1x4", Topology::uniform(4, 1).unwrap()),
        ("2x3", Topology::uniform(3, 2).unwrap()),
        (
            "unequal",
            Topology::from_node_labels(&[0, 0, 0, 1]).unwrap(),
        ),
        ("2x1", Topology::uniform(1, 2).unwrap()),
    ]
}

#[test]
fn pipelined_chunks_give_the_bytes_of_one_chunk() {
    // docs/numerics.md §5.4: with the padding of one chunk, P chunks in flight (each chunk's
    // exchanges overlapping its neighbours' passes) reduce to the same bits as P = 1, for
    // every route shape and grouped codec, two steps per object (buffers reused).
    // A multiple of 3 * 8 * 2048 (groups are at most 2048 here): no padding for any P.
    let per_rank = 3 * 8 * 2048;
    for (preset, extra) in [
        (Preset::Sdp4bit, vec![]),
        (Preset::Qsdp, vec![]),
        (Preset::Zeropp, vec![]),
        (Preset::Sdp4bit, vec![("grad_codec", "tlq")]),
    ] {
        for (tname, topo) in pipeline_topologies() {
            let w = topo.world();
            let numel = w * per_rank;
            let data: Vec<Vec<Vec<f32>>> = (0..2)
                .map(|k| rank_grads(0x9e11 ^ k ^ (w as u64) << 8, w, numel, 1.0))
                .collect();
            let with = |p: &str| {
                let mut overrides = extra.clone();
                overrides.push(("pipeline_chunks", p));
                cfg(preset, &overrides)
            };
            let one = run_steps(&with("1"), &topo, &data, 3, 40);
            for p in ["2", "3", "4", "8"] {
                let config = with(p);
                let rs = GradReduceScatter::new(&config, &topo, 0, numel, 3).unwrap();
                assert_eq!(rs.plan().chunks.to_string(), p);
                assert_eq!(rs.plan().padded_shard_len, per_rank, "{preset} P={p}");
                let piped = run_steps(&config, &topo, &data, 3, 40);
                for (k, (a, b)) in piped.iter().zip(&one).enumerate() {
                    for (r, (x, y)) in a.iter().zip(b).enumerate() {
                        let ctx = format!("{preset} {extra:?} {tname} P={p} step {k} rank {r}");
                        assert_bits_eq(x, y, &ctx);
                    }
                }
            }
        }
    }
}

#[test]
fn automatic_chunks_pipeline_large_buckets_with_the_bytes_of_one_chunk() {
    // Unset pipeline_chunks: a large bucket is cut into several chunks in flight, and the
    // result is bit-identical to P = 1 (what the convergence study measured).
    let per_rank = 1 << 20;
    for (tname, topo) in [
        ("2x2", Topology::uniform(2, 2).unwrap()),
        ("4x1", Topology::uniform(1, 4).unwrap()),
    ] {
        let w = topo.world();
        let numel = w * per_rank;
        let data = vec![rank_grads(0xa070 ^ w as u64, w, numel, 1.0)];
        let auto = cfg(Preset::Sdp4bit, &[]);
        let rs = GradReduceScatter::new(&auto, &topo, 0, numel, 1).unwrap();
        assert!(rs.plan().chunks > 1, "{tname}: P = {}", rs.plan().chunks);
        let piped = run_steps(&auto, &topo, &data, 1, 7);
        let one = run_steps(
            &cfg(Preset::Sdp4bit, &[("pipeline_chunks", "1")]),
            &topo,
            &data,
            1,
            7,
        );
        for (r, (x, y)) in piped[0].iter().zip(&one[0]).enumerate() {
            assert_bits_eq(x, y, &format!("{tname} auto P rank {r}"));
        }
    }
}

#[test]
fn local_exchanges_in_flight_complete_on_wait_and_reject_a_second_call() {
    // The in-process Comm's asynchronous all-to-all: every rank publishes, computes, waits;
    // a second call on the same communicator while one is in flight is an error.
    let cluster = LocalCluster::new(Topology::uniform(1, 3).unwrap());
    let results = cluster.run(|c| -> sdp4bit::Result<(Vec<u8>, String)> {
        let me = c.world.rank() as u8;
        let send: Vec<u8> = (0..3).map(|to| 10 * me + to).collect();
        let (mut first, mut recv, mut other) = (vec![0u8; 3], vec![0u8; 3], vec![0u8; 3]);
        let flight = c.world.start_all_to_all(&send, &mut first)?;
        let refused = c
            .world
            .start_all_to_all(&send, &mut other)
            .expect_err("a second exchange in flight must be refused")
            .to_string();
        flight.wait()?;
        assert_eq!(first.len(), 3);
        c.world.start_all_to_all(&send, &mut recv)?.wait()?;
        assert_eq!(first, recv, "the same exchange twice");
        Ok((recv, refused))
    });
    for (r, result) in results.into_iter().enumerate() {
        let (recv, refused) = result.unwrap();
        let want: Vec<u8> = (0..3).map(|from| 10 * from + r as u8).collect();
        assert_eq!(recv, want, "rank {r}");
        assert!(refused.contains("in flight"), "{refused}");
    }
}
