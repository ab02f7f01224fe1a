//! Topology, bucket padding, gradient routes and the swizzled layout (docs/numerics.md §5): `layout`.

use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::layout::{
    AUTO_MAX_CHUNKS, AUTO_MIN_CHUNK_ELEMS, BucketPlan, GradLayout, GradRoute, Level, Topology,
    auto_chunks, level_size, peer_index,
};
use sdp4bit::{Config, Error, Preset};
use sdp4bit_test_support::random::SplitMix64;

fn cfg(preset: Preset, overrides: &[(&str, &str)]) -> Config {
    Config::from_overrides(preset, overrides.iter().copied())
        .unwrap_or_else(|e| panic!("{preset} {overrides:?}: {e}"))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

// ---------------------------------------------------------------------------------------
// Topology

/// Independent model of docs/numerics.md §5.2: ranks share a node iff their labels are equal; nodes
/// are numbered by first appearance in DP order; a rank's local index is the number of earlier
/// DP ranks on its node.
fn check_topology_against_labels(t: &Topology, labels: &[u64]) {
    let w = labels.len();
    assert_eq!(t.world(), w);
    let mut order: Vec<u64> = Vec::new();
    for l in labels {
        if !order.contains(l) {
            order.push(*l);
        }
    }
    assert_eq!(t.nodes(), order.len(), "labels {labels:?}");
    let sizes: Vec<usize> = order
        .iter()
        .map(|l| labels.iter().filter(|x| *x == l).count())
        .collect();
    let uniform = sizes.iter().all(|&s| s == sizes[0]);
    assert_eq!(
        t.per_node(),
        uniform.then_some(sizes[0]),
        "labels {labels:?}"
    );
    for z in 0..w {
        let node = order.iter().position(|l| *l == labels[z]).unwrap();
        let local = labels[..z].iter().filter(|l| **l == labels[z]).count();
        assert_eq!(t.node_of(z), node, "node of DP rank {z}, labels {labels:?}");
        assert_eq!(
            t.local_of(z),
            local,
            "local index of DP rank {z}, labels {labels:?}"
        );
        assert_eq!(t.rank_at(node, local), z);
        let intra: Vec<usize> = (0..w).filter(|&y| labels[y] == labels[z]).collect();
        assert_eq!(t.intra_group(z), &intra[..], "intra group of {z}");
        if uniform {
            // Ranks with the same local index, one per node, in node order.
            let inter: Vec<usize> = order
                .iter()
                .map(|l| {
                    (0..w)
                        .filter(|&y| labels[y] == *l)
                        .nth(local)
                        .expect("uniform nodes")
                })
                .collect();
            assert_eq!(t.inter_group(z), inter, "inter group of {z}");
        }
    }
}

#[test]
fn uniform_topology() {
    for (m, d) in [(1usize, 1usize), (1, 4), (4, 1), (2, 4), (3, 5), (8, 8)] {
        let t = Topology::uniform(m, d).unwrap();
        assert_eq!((t.world(), t.nodes(), t.per_node()), (m * d, m, Some(d)));
        for z in 0..m * d {
            assert_eq!(
                (t.node_of(z), t.local_of(z)),
                (z / d, z % d),
                "{m}x{d} rank {z}"
            );
            let intra: Vec<usize> = (z / d * d..z / d * d + d).collect();
            assert_eq!(t.intra_group(z), &intra[..]);
            let inter: Vec<usize> = (0..m).map(|n| n * d + z % d).collect();
            assert_eq!(t.inter_group(z), inter);
        }
        let labels: Vec<u64> = (0..m * d).map(|z| (z / d) as u64).collect();
        check_topology_against_labels(&t, &labels);
        // Same thing from global ranks: contiguous ranks, local world size D.
        let global: Vec<u64> = (0..(m * d) as u64).collect();
        assert_eq!(Topology::from_global_ranks(&global, d as u64).unwrap(), t);
    }
    for (m, d) in [(0, 4), (4, 0), (0, 0)] {
        match Topology::uniform(m, d) {
            Err(Error::Topology(msg)) => {
                assert!(msg.contains(&format!("{m} nodes x {d}")), "{msg}")
            }
            other => panic!("uniform({m}, {d}) must be an error: {other:?}"),
        }
    }
}

#[test]
fn topology_from_global_ranks() {
    // DP group interleaved across two nodes of 4 GPUs: global ranks 0,4,1,5,2,6,3,7.
    let t = Topology::from_global_ranks(&[0, 4, 1, 5, 2, 6, 3, 7], 4).unwrap();
    assert_eq!((t.world(), t.nodes(), t.per_node()), (8, 2, Some(4)));
    assert_eq!(
        (0..8).map(|z| t.node_of(z)).collect::<Vec<_>>(),
        [0, 1, 0, 1, 0, 1, 0, 1]
    );
    assert_eq!(
        (0..8).map(|z| t.local_of(z)).collect::<Vec<_>>(),
        [0, 0, 1, 1, 2, 2, 3, 3]
    );
    assert_eq!(t.intra_group(0), &[0, 2, 4, 6]);
    assert_eq!(t.intra_group(5), &[1, 3, 5, 7]);
    assert_eq!(t.inter_group(2), vec![2, 3]);
    assert_eq!(t.rank_at(1, 3), 7);

    // The node that appears first is node 0 even if its label is larger.
    let t = Topology::from_global_ranks(&[8, 9, 10, 11, 0, 1, 2, 3], 4).unwrap();
    assert_eq!(t.node_of(0), 0);
    assert_eq!(t.node_of(4), 1);
    assert_eq!(t.inter_group(1), vec![1, 5]);

    // A DP group that is a subset of the job (tensor parallel = 2): global ranks 0,2,4,6 on
    // nodes of 4 -> two nodes of two DP ranks.
    let t = Topology::from_global_ranks(&[0, 2, 4, 6], 4).unwrap();
    assert_eq!((t.nodes(), t.per_node()), (2, Some(2)));
    assert_eq!(t.intra_group(1), &[0, 1]);

    // One DP rank per node.
    let t = Topology::from_global_ranks(&[12, 3, 7, 8], 4).unwrap();
    assert_eq!((t.nodes(), t.per_node()), (4, Some(1)));
    assert_eq!(
        (0..4).map(|z| t.node_of(z)).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );

    // Unequal nodes: 3 DP ranks on node 0, 1 on node 1.
    let t = Topology::from_global_ranks(&[0, 1, 2, 4], 4).unwrap();
    assert_eq!((t.nodes(), t.per_node()), (2, None));
    assert_eq!(t.intra_group(3), &[3]);
    assert_eq!(t.local_of(2), 2);

    // Arbitrary labels.
    let t = Topology::from_node_labels(&[7, 7, 3, 3, 7, 3]).unwrap();
    assert_eq!(
        (0..6).map(|z| t.node_of(z)).collect::<Vec<_>>(),
        [0, 0, 1, 1, 0, 1]
    );
    check_topology_against_labels(&t, &[7, 7, 3, 3, 7, 3]);
}

#[test]
fn topology_errors() {
    match Topology::from_global_ranks(&[0, 5, 1, 5], 4) {
        Err(Error::Topology(msg)) => {
            assert!(msg.contains("global rank 5 appears twice"), "{msg}")
        }
        other => panic!("duplicate rank accepted: {other:?}"),
    }
    assert!(matches!(
        Topology::from_global_ranks(&[0, 1], 0),
        Err(Error::Topology(msg)) if msg.contains("local_world_size")
    ));
    assert!(matches!(
        Topology::from_global_ranks(&[], 4),
        Err(Error::Topology(_))
    ));
    assert!(matches!(
        Topology::from_node_labels(&[]),
        Err(Error::Topology(_))
    ));
}

#[test]
fn random_topologies_match_the_model() {
    let mut rng = SplitMix64::new(0x7090_0001);
    for _ in 0..500 {
        let w = 1 + rng.below(24);
        let lws = 1 + rng.below(8) as u64;
        // Distinct global ranks drawn from a job of up to 64 ranks, in random DP order.
        let mut pool: Vec<u64> = (0..64).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, rng.below(i + 1));
        }
        let global = &pool[..w];
        let t = Topology::from_global_ranks(global, lws).unwrap();
        let labels: Vec<u64> = global.iter().map(|g| g / lws).collect();
        check_topology_against_labels(&t, &labels);
        assert_eq!(t, Topology::from_node_labels(&labels).unwrap());
    }
}

// ---------------------------------------------------------------------------------------
// BucketPlan

/// Configs covering every grouped/ungrouped combination, odd group sizes and P values.
fn plan_configs() -> Vec<Config> {
    let mut v: Vec<Config> = Preset::ALL.iter().map(|&p| Config::preset(p)).collect();
    let o: [(Preset, &[(&str, &str)]); 12] = [
        (Preset::Sdp4bit, &[("pipeline_chunks", "2")]),
        (Preset::Sdp4bit, &[("pipeline_chunks", "3")]),
        (
            Preset::Sdp4bit,
            &[
                ("pipeline_chunks", "5"),
                ("grad_group_size", "96"),
                ("hadamard_block", "32"),
            ],
        ),
        (
            Preset::Sdp4bit,
            &[
                ("weight_group_size", "160"),
                ("grad_group_size", "256"),
                ("hadamard_block", "256"),
            ],
        ),
        (
            Preset::Sdp4bit,
            &[
                ("grad_codec", "tlq"),
                ("grad_group_size", "224"),
                ("pipeline_chunks", "4"),
            ],
        ),
        (
            Preset::Qsdp,
            &[("pipeline_chunks", "7"), ("weight_group_size", "96")],
        ),
        (
            Preset::Zeropp,
            &[("hadamard_block", "128"), ("grad_group_size", "384")],
        ),
        (Preset::Baseline, &[("pipeline_chunks", "4")]),
        (
            Preset::Baseline,
            &[("weight_codec", "qw"), ("weight_group_size", "2048")],
        ),
        (
            Preset::GlobalQsgd,
            &[("weight_codec", "qwd"), ("pipeline_chunks", "2")],
        ),
        (
            Preset::Baseline,
            &[
                ("grad_codec", "qsdp"),
                ("grad_group_size", "32"),
                ("pipeline_chunks", "64"),
            ],
        ),
        (
            Preset::Sdp4bit,
            &[("hadamard_block", "16"), ("grad_group_size", "32")],
        ),
    ];
    v.extend(o.iter().map(|(p, kv)| cfg(*p, kv)));
    v
}

/// The factors docs/numerics.md §5.1 requires the padded shard to be a multiple of (P enters
/// through the gradient term: only the grouped gradient path cuts shards into P chunks).
fn required_factors(c: &Config) -> Vec<(&'static str, usize)> {
    let mut f = vec![];
    if let Some(s) = QuantSpec::of_weights(&c.weight) {
        f.push(("weight group", s.group_size));
    }
    if c.grad.codec.is_grouped() {
        // P enters only when set; the automatic choice pads as P = 1 does.
        let p = c.pipeline_chunks.unwrap_or(1);
        f.push(("grad group * P", c.grad.group_size * p));
    }
    if let Some(h) = c.grad.hadamard_block {
        f.push(("hadamard block", h));
    }
    f
}

#[test]
fn bucket_padding_for_many_sizes() {
    let shards = [
        1usize, 2, 3, 7, 31, 33, 127, 1001, 2047, 2049, 4097, 12_289, 100_003,
    ];
    let worlds = [1usize, 2, 3, 4, 6, 8, 16];
    for c in plan_configs() {
        for &w in &worlds {
            for &s in &shards {
                let numel = w * s;
                let p = BucketPlan::new(numel, w, &c)
                    .unwrap_or_else(|e| panic!("numel {numel} W {w} {c}: {e}"));
                let ctx = format!("numel {numel}, W {w}, {c}");
                let chunks = c
                    .pipeline_chunks
                    .unwrap_or_else(|| auto_chunks(&c, p.padded_shard_len));
                assert_eq!(
                    (p.numel, p.world, p.shard_len, p.chunks),
                    (numel, w, s, chunks),
                    "{ctx}"
                );
                assert!(p.padded_shard_len >= s, "{ctx}");
                for (what, f) in required_factors(&c) {
                    assert_eq!(
                        p.padded_shard_len % f,
                        0,
                        "{ctx}: padded shard {} is not a multiple of the {what} {f}",
                        p.padded_shard_len
                    );
                }
                if c.grad.codec.is_grouped() {
                    assert_eq!(p.chunk_len() * p.chunks, p.padded_shard_len, "{ctx}");
                    assert_eq!(
                        p.chunk_len() % c.grad.group_size,
                        0,
                        "{ctx}: chunk holds whole groups"
                    );
                }
                if QuantSpec::of_weights(&c.weight).is_none() && !c.grad.codec.is_grouped() {
                    assert_eq!(
                        p.padded_shard_len, s,
                        "{ctx}: nothing grouped, nothing padded"
                    );
                }
                // Padded index and real range.
                for z in [0, w - 1] {
                    assert_eq!(p.padded_index(z, 5), (z * p.padded_shard_len + 5) as u64);
                    assert_eq!(p.real_range(z, 0, p.padded_shard_len), z * s..(z + 1) * s);
                    let tail = p.real_range(z, s, p.padded_shard_len - s);
                    assert!(
                        tail.is_empty(),
                        "{ctx}: padding maps to real elements {tail:?}"
                    );
                    let mid = p.real_range(z, s / 2, s);
                    assert_eq!(mid, z * s + s / 2..(z + 1) * s, "{ctx}");
                }
            }
        }
    }
}

#[test]
fn bucket_padding_is_minimal() {
    // The padded shard is the smallest multiple of the padding unit documented in layout.rs:
    // lcm(weight group, grad group * P, Hadamard block) over the grouped codecs in use, 1
    // (no padding) when none is. Padding beyond that is wasted wire bytes in the weight
    // all-gather (the padded shard is what gets quantized and sent).
    let mut failures = Vec::new();
    for c in plan_configs() {
        let mut terms = Vec::new();
        if let Some(s) = QuantSpec::of_weights(&c.weight) {
            terms.push(s.group_size);
        }
        if c.grad.codec.is_grouped() {
            terms.push(c.grad.group_size * c.pipeline_chunks.unwrap_or(1));
        }
        if let Some(h) = c.grad.hadamard_block {
            terms.push(h);
        }
        let unit = terms.iter().fold(1, |u, &t| lcm(u, t));
        for (s, w) in [(1usize, 2usize), (1000, 3), (4097, 4), (100_003, 1)] {
            let p = BucketPlan::new(s * w, w, &c).unwrap();
            let want = s.div_ceil(unit) * unit;
            if p.padded_shard_len != want {
                failures.push(format!(
                    "{c}: shard {s} padded to {} instead of {want} (unit {unit})",
                    p.padded_shard_len
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "over-padded shards:\n{}",
        failures.join("\n")
    );
}

#[test]
fn bucket_plan_errors_name_the_sizes() {
    let c = Config::preset(Preset::Sdp4bit);
    for (numel, w) in [(10usize, 3usize), (7, 2), (1, 4), (100_001, 8)] {
        match BucketPlan::new(numel, w, &c) {
            Err(Error::Plan(msg)) => assert!(
                msg.contains(&numel.to_string()) && msg.contains(&w.to_string()),
                "error must name {numel} and {w}: {msg}"
            ),
            other => panic!("numel {numel} over W {w} must be a plan error: {other:?}"),
        }
    }
    match BucketPlan::new(0, 4, &c) {
        Err(Error::Plan(msg)) => assert!(msg.contains('0'), "{msg}"),
        other => panic!("an empty bucket must be a plan error: {other:?}"),
    }
    assert!(matches!(BucketPlan::new(8, 0, &c), Err(Error::Plan(_))));
}

// ---------------------------------------------------------------------------------------
// GradRoute and GradLayout

#[test]
fn grad_routes() {
    let sdp = Config::preset(Preset::Sdp4bit);
    let route = |c: &Config, t: &Topology| GradRoute::new(c, t);

    // W == 1: a copy, no exchange.
    let r = route(&sdp, &Topology::uniform(1, 1).unwrap());
    assert_eq!((r.levels.clone(), r.notice.clone()), (vec![], None));
    // D == 1: one inter-node level at the inter-node bits.
    let r = route(&sdp, &Topology::uniform(4, 1).unwrap());
    assert_eq!(r.levels, vec![(Level::Inter, 4)]);
    assert_eq!(r.notice, None);
    // M == 1: one intra-node level at the intra-node bits.
    let r = route(&sdp, &Topology::uniform(1, 4).unwrap());
    assert_eq!(r.levels, vec![(Level::Intra, 8)]);
    // Uniform two-level.
    let r = route(&sdp, &Topology::uniform(2, 4).unwrap());
    assert_eq!(r.levels, vec![(Level::Intra, 8), (Level::Inter, 4)]);
    assert_eq!(r.notice, None);
    // Bits follow the knobs, not constants.
    let c = cfg(
        Preset::Sdp4bit,
        &[("grad_intra_bits", "4"), ("grad_inter_bits", "8")],
    );
    assert_eq!(
        route(&c, &Topology::uniform(3, 2).unwrap()).levels,
        vec![(Level::Intra, 4), (Level::Inter, 8)]
    );
    assert_eq!(
        route(&c, &Topology::uniform(3, 1).unwrap()).levels,
        vec![(Level::Inter, 8)]
    );
    assert_eq!(
        route(&c, &Topology::uniform(1, 3).unwrap()).levels,
        vec![(Level::Intra, 4)]
    );

    // Non-uniform nodes: one level over the world at the inter-node bits, with a notice.
    let uneven = Topology::from_global_ranks(&[0, 1, 2, 4], 4).unwrap();
    let r = route(&sdp, &uneven);
    assert_eq!(r.levels, vec![(Level::World, 4)]);
    let notice = r.notice.expect("a degraded route must say so");
    for part in ["[3, 1]", "4 ranks", "4 bits"] {
        assert!(
            notice.contains(part),
            "notice {notice:?} should mention {part:?}"
        );
    }
    let r = route(&c, &uneven);
    assert_eq!(r.levels, vec![(Level::World, 8)]);

    // QSDP is one level over the world everywhere, at its (inter) bits, without a notice.
    let q = Config::preset(Preset::Qsdp);
    for t in [
        Topology::uniform(2, 4).unwrap(),
        Topology::uniform(1, 4).unwrap(),
        uneven.clone(),
    ] {
        let r = route(&q, &t);
        assert_eq!(r.levels, vec![(Level::World, 8)]);
        assert_eq!(r.notice, None);
    }
    assert_eq!(route(&q, &Topology::uniform(1, 1).unwrap()).levels, vec![]);
    // zeropp: two levels of 4 bits.
    let z = Config::preset(Preset::Zeropp);
    assert_eq!(
        route(&z, &Topology::uniform(2, 2).unwrap()).levels,
        vec![(Level::Intra, 4), (Level::Inter, 4)]
    );
}

fn layout_topologies() -> Vec<Topology> {
    vec![
        Topology::uniform(1, 1).unwrap(),
        Topology::uniform(1, 4).unwrap(),
        Topology::uniform(4, 1).unwrap(),
        Topology::uniform(2, 4).unwrap(),
        Topology::uniform(3, 2).unwrap(),
        Topology::from_global_ranks(&[0, 4, 1, 5, 2, 6, 3, 7], 4).unwrap(),
        Topology::from_global_ranks(&[9, 0, 5, 8, 1, 4], 4).unwrap(), // 3 nodes x 2, shuffled
        Topology::from_global_ranks(&[0, 1, 2, 4], 4).unwrap(),       // uneven
        Topology::from_node_labels(&[1, 2, 2, 3, 3, 3]).unwrap(),     // uneven
    ]
}

#[test]
fn grad_layout_dest_mapping_is_a_bijection() {
    let configs = [
        Config::preset(Preset::Sdp4bit),
        cfg(
            Preset::Sdp4bit,
            &[("pipeline_chunks", "3"), ("grad_group_size", "96")],
        ),
        Config::preset(Preset::Qsdp),
        Config::preset(Preset::Zeropp),
        cfg(
            Preset::Sdp4bit,
            &[("grad_codec", "tlq"), ("pipeline_chunks", "2")],
        ),
    ];
    for c in &configs {
        for t in layout_topologies() {
            let w = t.world();
            let route = GradRoute::new(c, &t);
            let plan = BucketPlan::new(w * 1001, w, c).unwrap();
            let Some(l) = GradLayout::new(c, &t, &route, plan) else {
                assert_eq!(w, 1, "only W == 1 has no layout");
                continue;
            };
            let ctx = format!("{c} on {t:?}");
            assert_ne!(w, 1, "{ctx}");
            assert_eq!(
                (l.first.level, l.first.slab.spec.bits),
                route.levels[0],
                "{ctx}"
            );
            assert_eq!(l.first.peers, level_size(&t, l.first.level), "{ctx}");
            let d2 = l.second_peers();
            match l.second {
                Some(s) => {
                    assert_eq!((s.level, s.slab.spec.bits), route.levels[1], "{ctx}");
                    assert_eq!(s.peers, d2);
                    assert_eq!(s.slab.groups, l.groups_per_chunk(), "{ctx}");
                    assert_eq!(l.last(), s);
                }
                None => {
                    assert_eq!((route.levels.len(), d2), (1, 1), "{ctx}");
                    assert_eq!(l.last(), l.first);
                }
            }
            assert_eq!(l.first.peers * d2, w, "{ctx}: levels must cover the world");
            assert_eq!(
                l.groups_per_chunk(),
                plan.chunk_len() / c.grad.group_size,
                "{ctx}"
            );
            assert_eq!(l.first.slab.groups, l.groups_per_chunk() * d2, "{ctx}");
            assert_eq!(
                l.first.slab.spec,
                QuantSpec::of_grads(&c.grad, route.levels[0].1)
            );
            assert_eq!(l.hadamard, c.grad.hadamard_block);
            assert_eq!(l.bucket, plan);

            let mut hit = vec![0usize; w];
            for x1 in 0..l.first.peers {
                for x2 in 0..d2 {
                    let z = l.dest(x1, x2);
                    assert!(z < w, "{ctx}: dest({x1}, {x2}) = {z} out of range");
                    hit[z] += 1;
                    assert_eq!(peer_index(&t, l.first.level, z), x1, "{ctx}: x1 of {z}");
                    if let Some(s) = l.second {
                        assert_eq!(peer_index(&t, s.level, z), x2, "{ctx}: x2 of {z}");
                    }
                }
            }
            assert!(
                hit.iter().all(|&h| h == 1),
                "{ctx}: dest is not a bijection: {hit:?}"
            );
        }
    }
}

#[test]
fn peer_index_and_level_size() {
    let t = Topology::from_global_ranks(&[0, 4, 1, 5, 2, 6], 4).unwrap(); // 2 nodes x 3
    assert_eq!(level_size(&t, Level::Intra), 3);
    assert_eq!(level_size(&t, Level::Inter), 2);
    assert_eq!(level_size(&t, Level::World), 6);
    for z in 0..6 {
        assert_eq!(peer_index(&t, Level::Intra, z), z / 2);
        assert_eq!(peer_index(&t, Level::Inter, z), z % 2);
        assert_eq!(peer_index(&t, Level::World, z), z);
    }
}

#[test]
fn automatic_chunks_keep_the_padding_of_one_chunk_and_take_the_largest_whole_group_count() {
    // docs/numerics.md §5.4: unset pipeline_chunks picks, per bucket, the largest P up to
    // AUTO_MAX_CHUNKS whose chunks hold whole gradient groups of the shard padded as for
    // P = 1 and at least AUTO_MIN_CHUNK_ELEMS elements; so the bytes are those of P = 1.
    let configs = [
        cfg(Preset::Sdp4bit, &[]),
        cfg(
            Preset::Sdp4bit,
            &[("grad_group_size", "96"), ("hadamard_block", "32")],
        ),
        cfg(Preset::Qsdp, &[]),
        cfg(Preset::Zeropp, &[]),
        cfg(Preset::GlobalQsgd, &[]),
        cfg(Preset::Baseline, &[]),
    ];
    let shards = [
        1usize,
        AUTO_MIN_CHUNK_ELEMS - 1,
        AUTO_MIN_CHUNK_ELEMS,
        2 * AUTO_MIN_CHUNK_ELEMS,
        3 * AUTO_MIN_CHUNK_ELEMS + 5,
        1 << 20,
        1_000_003,
        9 * AUTO_MIN_CHUNK_ELEMS,
        5 << 20,
    ];
    let mut chosen = std::collections::BTreeSet::new();
    for c in configs {
        let one = {
            let mut one = c;
            one.pipeline_chunks = Some(1);
            one
        };
        for s in shards {
            for w in [1usize, 4] {
                let ctx = format!("{c} S={s} W={w}");
                let auto = BucketPlan::new(w * s, w, &c).unwrap();
                let single = BucketPlan::new(w * s, w, &one).unwrap();
                assert_eq!(auto.padded_shard_len, single.padded_shard_len, "{ctx}");
                let fits = |p: usize| {
                    c.grad.codec.is_grouped()
                        && auto.padded_shard_len.is_multiple_of(p * c.grad.group_size)
                        && auto.padded_shard_len / p >= AUTO_MIN_CHUNK_ELEMS
                };
                let p = auto.chunks;
                assert!((1..=AUTO_MAX_CHUNKS).contains(&p), "{ctx}: P = {p}");
                assert!(p == 1 || fits(p), "{ctx}: P = {p} breaks the rule");
                assert!(
                    ((p + 1)..=AUTO_MAX_CHUNKS).all(|q| !fits(q)),
                    "{ctx}: P = {p} is not the largest that fits"
                );
                if c.grad.codec.is_grouped() {
                    assert_eq!(auto.chunk_len() % c.grad.group_size, 0, "{ctx}");
                    chosen.insert(p);
                } else {
                    assert_eq!(p, 1, "{ctx}: no groups, no chunks");
                }
            }
        }
    }
    // The sweep reaches several counts, the largest included.
    assert!(
        chosen.len() >= 4 && chosen.contains(&AUTO_MAX_CHUNKS),
        "{chosen:?}"
    );
}

#[test]
fn an_explicit_chunk_count_is_kept_and_pads_for_it() {
    let c = cfg(Preset::Sdp4bit, &[("pipeline_chunks", "3")]);
    let p = BucketPlan::new(4 * 1000, 4, &c).unwrap();
    assert_eq!(p.chunks, 3);
    assert_eq!(p.padded_shard_len % (3 * 128), 0);
    let c = cfg(Preset::Sdp4bit, &[("pipeline_chunks", "auto")]);
    assert_eq!(c.pipeline_chunks, None);
}
