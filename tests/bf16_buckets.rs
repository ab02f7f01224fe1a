//! bf16 gradient buckets (docs/numerics.md §7.5): a bf16 bucket reduce-scattered into a bf16
//! shard sends the bytes the fp32 bucket of its values sends, and its shard is that fp32
//! bucket's shard rounded to bf16 (round to nearest even, NaN stays NaN, Inf stays Inf), byte
//! for byte, on the host backend.
//!
//! Every preset (sdp4bit = TLq-HS, qsdp, global-qsgd, zeropp, baseline), the TLq ablation and
//! the warm-up route (steps before `grad_quant_start_step`) on single-rank, one-level,
//! two-level and non-uniform topologies, P in {1, 3}, odd bucket sizes, with fresh random
//! data per case (fixed seeds), some of it holding NaN, ±Inf, signed zeros, denormals and
//! bf16's largest values.

use half::bf16;
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::cluster::reduce_scatter_recorded;
use sdp4bit_test_support::random::SplitMix64;
use sdp4bit_test_support::recorder::Record;
use sdp4bit_test_support::setups::cfg;

/// Bucket elements per rank: odd sizes, one smaller than any group.
const PER_RANK: [usize; 2] = [1237, 5];

/// The topologies of the sweep.
fn topologies() -> Vec<(&'static str, Topology)> {
    vec![
        ("W=1", Topology::uniform(1, 1).expect("topology")),
        ("D=2 x M=2", Topology::uniform(2, 2).expect("topology")),
        ("D=3 x M=1", Topology::uniform(1, 3).expect("topology")),
        ("D=1 x M=3", Topology::uniform(3, 1).expect("topology")),
        (
            "labels [0,0,0,1]",
            Topology::from_node_labels(&[0, 0, 0, 1]).expect("topology"),
        ),
    ]
}

/// Random bf16 gradients of `numel` elements; with `specials`, some are NaN, ±Inf, signed
/// zeros, denormals or ±bf16::MAX.
fn bf16_grads(rand: &mut SplitMix64, numel: usize, specials: bool) -> Vec<bf16> {
    (0..numel)
        .map(|_| {
            let x = bf16::from_f64(rand.gaussian() * 0.3);
            if !specials {
                return x;
            }
            match rand.below(64) {
                0 => bf16::NAN,
                1 => bf16::INFINITY,
                2 => bf16::NEG_INFINITY,
                3 => bf16::NEG_ZERO,
                4 => bf16::from_bits(rand.below(0x80) as u16 | 1),
                5 => bf16::MAX,
                6 => bf16::MIN,
                _ => x,
            }
        })
        .collect()
}

/// One case: `steps` reduce-scatters of bf16 buckets against the same of their fp32
/// conversions; panics naming the first difference.
fn check_case(config: &Config, topo: &Topology, steps: &[(u64, Vec<Vec<bf16>>)], ctx: &str) {
    let wide: Vec<(u64, Vec<Vec<f32>>)> = steps
        .iter()
        .map(|(step, grads)| {
            let grads = grads
                .iter()
                .map(|g| g.iter().map(|x| x.to_f32()).collect())
                .collect();
            (*step, grads)
        })
        .collect();
    let narrow = reduce_scatter_recorded(config, topo, 3, steps);
    let reference = reduce_scatter_recorded(config, topo, 3, &wide);
    for (k, (narrow, reference)) in narrow.iter().zip(&reference).enumerate() {
        for (r, (n, f)) in narrow.iter().zip(reference).enumerate() {
            let at = format!("{ctx}, step {}, rank {r}", steps[k].0);
            for (level, (a, b)) in [(&n.1, &f.1), (&n.2, &f.2), (&n.3, &f.3)]
                .into_iter()
                .enumerate()
            {
                assert_same_records(a, b, &format!("{at}, communicator {level}"));
            }
            assert_eq!(n.0.len(), f.0.len(), "{at}: shard length");
            for (i, (&got, &want)) in n.0.iter().zip(&f.0).enumerate() {
                let want = bf16::from_f32(want);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{at}: shard element {i}: bf16 bucket {got}, fp32 bucket rounded {want}"
                );
            }
        }
    }
}

/// The two logs record the same operations with the same bytes.
fn assert_same_records(a: &[Record], b: &[Record], ctx: &str) {
    assert_eq!(a.len(), b.len(), "{ctx}: number of exchanges");
    for (j, (a, b)) in a.iter().zip(b).enumerate() {
        assert_eq!(a.op, b.op, "{ctx}: exchange {j}");
        assert!(
            a.send == b.send,
            "{ctx}: exchange {j} ({}) sends other bytes",
            a.op
        );
        assert!(
            a.recv == b.recv,
            "{ctx}: exchange {j} ({}) receives other bytes",
            a.op
        );
    }
}

/// The sweep of one codec over the topologies, P and sizes: two steps per case, from
/// `first_step`.
fn sweep(preset: Preset, extra: &[(&str, &str)], first_step: u64, seed: u64) {
    let mut rand = SplitMix64::new(seed);
    let mut case = 0;
    for (tname, topo) in topologies() {
        let w = topo.world();
        for p in ["1", "3"] {
            let mut overrides = extra.to_vec();
            overrides.push(("pipeline_chunks", p));
            let config = cfg(preset, &overrides);
            for per_rank in PER_RANK {
                case += 1;
                let specials = case % 3 == 0;
                let numel = w * per_rank;
                let steps: Vec<(u64, Vec<Vec<bf16>>)> = (0..2)
                    .map(|k| {
                        let grads = (0..w)
                            .map(|_| bf16_grads(&mut rand, numel, specials))
                            .collect();
                        (first_step + k, grads)
                    })
                    .collect();
                let ctx = format!("{preset} {extra:?}, {tname}, P={p}, numel {numel}");
                check_case(&config, &topo, &steps, &ctx);
            }
        }
    }
}

#[test]
fn sdp4bit_tlq_hs_bf16_equals_fp32_conversion() {
    sweep(Preset::Sdp4bit, &[], 0, 0xB16_0001);
}

#[test]
fn tlq_ablation_bf16_equals_fp32_conversion() {
    sweep(Preset::Sdp4bit, &[("grad_codec", "tlq")], 0, 0xB16_0002);
}

#[test]
fn qsdp_bf16_equals_fp32_conversion() {
    sweep(Preset::Qsdp, &[], 0, 0xB16_0003);
}

#[test]
fn global_qsgd_bf16_equals_fp32_conversion() {
    sweep(Preset::GlobalQsgd, &[], 0, 0xB16_0004);
    sweep(
        Preset::GlobalQsgd,
        &[("global_qsgd_bits", "16"), ("grad_rounding", "nearest")],
        0,
        0xB16_0005,
    );
}

#[test]
fn zeropp_bf16_equals_fp32_conversion() {
    sweep(Preset::Zeropp, &[], 0, 0xB16_0006);
}

#[test]
fn baseline_bf16_equals_fp32_conversion() {
    sweep(Preset::Baseline, &[], 0, 0xB16_0007);
}

/// Steps 0 and 1 before `grad_quant_start_step` = 1 and 2: the first runs the uncompressed
/// route, the second quantizes.
#[test]
fn warm_up_route_bf16_equals_fp32_conversion() {
    sweep(
        Preset::Sdp4bit,
        &[("grad_quant_start_step", "1")],
        0,
        0xB16_0008,
    );
}

/// A bf16 bucket of the wrong length is an error naming the sizes, as an fp32 one is.
#[test]
fn wrong_bf16_lengths_are_errors() {
    let topo = Topology::uniform(1, 1).expect("topology");
    let config = cfg(Preset::Sdp4bit, &[]);
    let cluster = sdp4bit::collective::local::LocalCluster::new(topo.clone());
    let errors = cluster.run(|c| {
        let mut rs = sdp4bit::collective::GradReduceScatter::new(&config, &topo, 0, 64, 0)?;
        let bucket = vec![bf16::ZERO; 63];
        let mut shard = vec![bf16::ZERO; 64];
        rs.run(c, &bucket, &mut shard, 0)
    });
    let message = errors[0].as_ref().expect_err("a short bucket").to_string();
    assert!(
        message.contains("63") && message.contains("64"),
        "{message}"
    );
}
