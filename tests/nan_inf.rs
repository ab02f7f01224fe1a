//! Non-finite inputs (docs/numerics.md §1.5): a group holding NaN or +-Inf stores scale NaN, so
//! every element of that group dequantizes to NaN and nothing else is touched; the caller's
//! found-inf check still fires and is never fooled by a NaN clamped into a finite code.
//!
//! - grouped gradient codecs (TLq-HS, TLq, QSDP, ZeRO++): a NaN / Inf in one group of one
//!   rank's bucket makes exactly the corresponding group of the destination shard NaN
//!   (every element of it; the groups are the codec's gradient groups, which with Hadamard on
//!   contain whole Hadamard blocks, so the transform spreads the NaN only inside the group),
//!   and every other element of every shard stays finite;
//! - Global-QSGD has one scale for the whole bucket (the all-reduced absmax, which a NaN or
//!   Inf makes +Inf), so every shard of the bucket is NaN on every rank;
//! - the baseline sums exactly: the non-finite value reaches only its own element;
//! - weight codecs: a NaN / Inf in one rank's new weights makes exactly that weight group NaN
//!   on every replica (the uncompressed gather copies the value itself).

use half::bf16;
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::{
    bits::bf16_bits,
    cluster::{all_gather_once, reduce_scatter_ok},
    random::{SplitMix64, gaussian_f32, rank_grads},
    setups::cfg,
};

const BAD: [(&str, f32); 3] = [
    ("NaN", f32::NAN),
    ("+Inf", f32::INFINITY),
    ("-Inf", f32::NEG_INFINITY),
];

fn topologies() -> Vec<(&'static str, Topology)> {
    vec![
        ("2x2", Topology::uniform(2, 2).unwrap()),
        ("D=4 x M=2", Topology::uniform(2, 4).unwrap()),
        ("D=3 x M=1", Topology::uniform(1, 3).unwrap()),
        ("D=1 x M=3", Topology::uniform(3, 1).unwrap()),
        ("3+1", Topology::from_node_labels(&[0, 0, 0, 1]).unwrap()),
        (
            "interleaved",
            Topology::from_node_labels(&[0, 1, 0, 1]).unwrap(),
        ),
    ]
}

/// (name, overrides, preset) of a gradient codec.
type Codec = (&'static str, Vec<(&'static str, &'static str)>, Preset);

fn grouped_codecs() -> Vec<Codec> {
    vec![
        ("sdp4bit", vec![], Preset::Sdp4bit),
        ("tlq", vec![("grad_codec", "tlq")], Preset::Sdp4bit),
        ("qsdp", vec![], Preset::Qsdp),
        ("zeropp", vec![], Preset::Zeropp),
    ]
}

#[test]
fn grouped_gradient_codecs_poison_exactly_one_group() {
    let per_rank = 4099; // 32 full groups of 128 and a 3-element tail (4 groups of 1024 + 3)
    let mut case = 0u64;
    for (cname, extra, preset) in grouped_codecs() {
        for p in ["1", "3"] {
            let mut overrides = extra.clone();
            overrides.push(("pipeline_chunks", p));
            let config = cfg(preset, &overrides);
            let g = config.grad.group_size;
            for (tname, topo) in topologies() {
                let w = topo.world();
                for (bname, bad) in BAD {
                    case += 1;
                    let mut rng = SplitMix64::new(case);
                    let numel = w * per_rank;
                    let mut grads = rank_grads(case, w, numel, 1.0);
                    let src = rng.below(w);
                    let dst = rng.below(w);
                    // A random full group, or the partial tail group.
                    let groups = per_rank.div_ceil(g);
                    let j = if case.is_multiple_of(2) {
                        groups - 1
                    } else {
                        rng.below(groups - 1)
                    };
                    let len = g.min(per_rank - j * g);
                    let o = j * g + rng.below(len);
                    grads[src][dst * per_rank + o] = bad;
                    let ctx = format!(
                        "{cname} P={p} {tname}: {bname} at rank {src}, shard {dst}, offset {o} \
                         (group {j})"
                    );
                    let shards = reduce_scatter_ok(&config, &topo, &grads, 0, 3);
                    for (z, shard) in shards.iter().enumerate() {
                        for (k, v) in shard.iter().enumerate() {
                            let in_group = z == dst && k / g == j;
                            if in_group {
                                assert!(v.is_nan(), "{ctx}: shard {z}[{k}] = {v}, want NaN");
                            } else {
                                assert!(v.is_finite(), "{ctx}: shard {z}[{k}] = {v}, want finite");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn global_qsgd_poisons_the_whole_bucket_on_every_rank() {
    // Global-QSGD has a single scale per bucket (the all-reduced absmax), so one non-finite
    // value anywhere makes every element of every shard NaN.
    let config = cfg(Preset::GlobalQsgd, &[]);
    for (tname, topo) in topologies() {
        let w = topo.world();
        for (bname, bad) in BAD {
            let numel = w * 1237;
            let mut grads = rank_grads(7, w, numel, 1.0);
            grads[w - 1][5] = bad;
            let shards = reduce_scatter_ok(&config, &topo, &grads, 0, 0);
            for (z, shard) in shards.iter().enumerate() {
                assert!(
                    shard.iter().all(|v| v.is_nan()),
                    "global-qsgd {tname} {bname}: shard {z} not all NaN"
                );
            }
        }
    }
}

#[test]
fn baseline_propagates_non_finite_only_to_its_element() {
    let config = cfg(Preset::Baseline, &[]);
    for (tname, topo) in topologies() {
        let w = topo.world();
        for (bname, bad) in BAD {
            let numel = w * 1237;
            let mut grads = rank_grads(8, w, numel, 1.0);
            let at = numel - 3;
            grads[0][at] = bad;
            let all = reduce_scatter_ok(&config, &topo, &grads, 0, 0).concat();
            for (i, v) in all.iter().enumerate() {
                if i == at {
                    assert_eq!(v.to_bits(), bad.to_bits(), "{tname} {bname}: element {i}");
                } else {
                    assert!(v.is_finite(), "{tname} {bname}: element {i} = {v}");
                }
            }
        }
    }
}

fn weight_codecs() -> Vec<(&'static str, Config)> {
    vec![
        ("qwd", cfg(Preset::Sdp4bit, &[])),
        ("qw", cfg(Preset::Sdp4bit, &[("weight_codec", "qw")])),
        ("qsdp", cfg(Preset::Qsdp, &[])),
        ("zeropp", cfg(Preset::Zeropp, &[])),
        ("none", cfg(Preset::Baseline, &[])),
    ]
}

#[test]
fn weight_codecs_poison_exactly_one_group_on_every_replica() {
    let mut case = 0u64;
    for (cname, config) in weight_codecs() {
        let g = config.weight.group_size;
        for w in [2usize, 3, 4] {
            let topo = Topology::uniform(1, w).unwrap();
            for per_rank in [2 * 2048 + 77, 1237] {
                for (bname, bad) in BAD {
                    case += 1;
                    let mut rng = SplitMix64::new(1000 + case);
                    let numel = w * per_rank;
                    let init: Vec<bf16> = gaussian_f32(&mut rng, numel, 0.05)
                        .into_iter()
                        .map(bf16::from_f32)
                        .collect();
                    let mut new: Vec<bf16> = init
                        .iter()
                        .map(|v| bf16::from_f32(v.to_f32() + (rng.gaussian() * 1e-3) as f32))
                        .collect();
                    let owner = rng.below(w);
                    let o = rng.below(per_rank);
                    let at = owner * per_rank + o;
                    new[at] = bf16::from_f32(bad);
                    let ctx =
                        format!("{cname} W={w} numel={numel}: {bname} at shard {owner} offset {o}");
                    let replicas: Vec<Vec<bf16>> =
                        all_gather_once(&config, &topo, &init, &new, 0, 1)
                            .into_iter()
                            .map(|x| x.unwrap_or_else(|e| panic!("{ctx}: {e}")))
                            .collect();
                    for (r, params) in replicas.iter().enumerate() {
                        assert_eq!(
                            bf16_bits(params),
                            bf16_bits(&replicas[0]),
                            "{ctx}: replica {r} differs"
                        );
                    }
                    let params = &replicas[0];
                    for (i, v) in params.iter().enumerate() {
                        let (z, k) = (i / per_rank, i % per_rank);
                        if cname == "none" {
                            // Uncompressed: the value itself, only there.
                            assert_eq!(v.to_bits(), new[i].to_bits(), "{ctx}: element {i}");
                        } else if z == owner && k / g == o / g {
                            assert!(v.is_nan(), "{ctx}: element {i} = {v}, want NaN");
                        } else {
                            assert!(v.is_finite(), "{ctx}: element {i} = {v}, want finite");
                        }
                    }
                }
            }
        }
    }
}
