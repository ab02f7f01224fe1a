//! The gradient families: the grouped reduce-scatter's three kernels per codec (one rank's
//! first pass over its bucket, then per pipeline chunk the requantization on two-level routes
//! and the final reduction of what its peers send it, each also with damaged received slabs),
//! and the bf16 conversions; their cases, the parameter structs each family launches, and one
//! test per family.

use half::bf16;
use sdp4bit::backend::cpu::gradient;
use sdp4bit::backend::cuda::abi::{SdpConvert, SdpGradFinal, SdpGradFirst, SdpGradSecond};
use sdp4bit::backend::cuda::dest_table;
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::backend::{narrow_into, widen_into};
use sdp4bit::layout::{BucketPlan, GradLayout, GradRoute, Topology, peer_index};
use sdp4bit::rng::Stage;
use sdp4bit::{Config, GradCodec};

use super::case::{Case, Expect};
use super::data::{bf16_bytes, bf16s, damage, f32_bytes, garbage, plain, stream, values};
use super::preset_config;
use super::sweep::{Coverage, emulate_family};
use sdp4bit_test_support::random::SplitMix64;

/// One rank's view of the grouped gradient reduce-scatter: its first pass over the whole
/// bucket, then per chunk the requantization (two-level routes) and the final reduction of
/// what its peers send it, each also with damaged received slabs.
pub(super) fn grad_case(
    name: String,
    rand: &mut SplitMix64,
    config: &Config,
    topology: &Topology,
    shard_len: usize,
) -> Case {
    let mut case = Case::new(name, rand);
    let w = topology.world();
    let plan = BucketPlan::new(w * shard_len, w, config).expect("plan");
    let route = GradRoute::new(config, topology);
    let layout = GradLayout::new(config, topology, &route, plan).expect("W > 1 has an exchange");
    let first = layout.first;
    let g = config.grad.group_size;
    let me = rand.below(w);
    let my_x1 = peer_index(topology, first.level, me);
    let dests: Vec<u8> = dest_table(&layout)
        .expect("destination table")
        .iter()
        .flat_map(|d| d.to_le_bytes())
        .collect();
    let dests = case.input(dests);

    // The first pass of this rank's bucket.
    let bucket = values(rand, plan.numel, g);
    let rng = stream(rand, me, Stage::GradFirst);
    let mut own = vec![0u8; plan.chunks * first.peers * first.slab.byte_len()];
    gradient::quantize_first(&layout, &bucket, &rng, &mut own);
    let input = case.input(f32_bytes(&bucket));
    let out = case.output(
        garbage(own.len()),
        "grad_quantize_first".into(),
        Expect::Slabs(first.slab),
        own.clone(),
    );
    case.launch(
        Kernel::GradQuantizeFirst,
        (plan.chunks * first.peers * first.slab.groups) as u64,
        &[Some(input), Some(dests), Some(out)],
        &SdpGradFirst::new(&layout, &rng).expect("params"),
    );

    // The same pass over a bf16 bucket (the bf16 kernel variant).
    let bucket16 = bf16s(rand, plan.numel, g);
    let mut own16 = vec![0u8; own.len()];
    gradient::quantize_first(&layout, &bucket16, &rng, &mut own16);
    let input16 = case.input(bf16_bytes(&bucket16));
    let out16 = case.output(
        garbage(own16.len()),
        "grad_quantize_first_bf16".into(),
        Expect::Slabs(first.slab),
        own16,
    );
    case.launch(
        Kernel::GradQuantizeFirstBf16,
        (plan.chunks * first.peers * first.slab.groups) as u64,
        &[Some(input16), Some(dests), Some(out16)],
        &SdpGradFirst::new(&layout, &rng).expect("params"),
    );

    // What every first-level peer's first pass sends: this rank's own, the others' of their
    // own random buckets.
    let sent: Vec<Vec<u8>> = (0..first.peers)
        .map(|x1| {
            if x1 == my_x1 {
                return own.clone();
            }
            let bucket = values(rand, plan.numel, g);
            let mut out = vec![0u8; own.len()];
            gradient::quantize_first(
                &layout,
                &bucket,
                &stream(rand, x1, Stage::GradFirst),
                &mut out,
            );
            out
        })
        .collect();

    let len = first.slab.byte_len();
    for p in 0..plan.chunks {
        let k = p * first.peers + my_x1;
        let recv: Vec<u8> = sent
            .iter()
            .flat_map(|o| &o[k * len..(k + 1) * len])
            .copied()
            .collect();
        let last_recv = match layout.second {
            None => recv,
            Some(second) => {
                let rng = stream(rand, me, Stage::GradSecond);
                let params = SdpGradSecond::new(&layout, my_x1, p, &rng).expect("params");
                let cpu = |recv: &[u8]| {
                    let mut out = vec![0u8; second.peers * second.slab.byte_len()];
                    gradient::requantize_second(&layout, my_x1, p, recv, &rng, &mut out)
                        .expect("valid slabs");
                    out
                };
                let want = cpu(&recv);
                let (bad, twin) = damage(rand, first.slab, &recv);
                for (tag, input, want) in
                    [("", &recv, want.clone()), (" damaged", &bad, cpu(&twin))]
                {
                    let input = case.input(input.clone());
                    let out = case.output(
                        garbage(want.len()),
                        format!("grad_requantize_second p={p}{tag}"),
                        Expect::Slabs(second.slab),
                        want,
                    );
                    case.launch(
                        Kernel::GradRequantizeSecond,
                        (second.peers * second.slab.groups) as u64,
                        &[Some(input), Some(dests), Some(out)],
                        &params,
                    );
                }
                // Stand-in for what the second-level peers send: this rank's own slabs.
                want
            }
        };

        // The final reduction of chunk p into a shard holding a sentinel elsewhere.
        let last = layout.last();
        let sentinel = plain(rand, plan.shard_len);
        let cpu = |recv: &[u8]| {
            let mut shard = sentinel.clone();
            gradient::reduce_final(&layout, p, recv, &mut shard).expect("valid slabs");
            f32_bytes(&shard)
        };
        let (bad, twin) = damage(rand, last.slab, &last_recv);
        for (tag, input, want) in [
            ("", &last_recv, cpu(&last_recv)),
            (" damaged", &bad, cpu(&twin)),
        ] {
            let input = case.input(input.clone());
            let out = case.output(
                f32_bytes(&sentinel),
                format!("grad_reduce_final p={p}{tag}"),
                Expect::F32,
                want,
            );
            case.launch(
                Kernel::GradReduceFinal,
                last.slab.groups as u64,
                &[Some(input), Some(out)],
                &SdpGradFinal::new(&layout, p).expect("params"),
            );
        }

        // The same into a bf16 shard (the bf16 kernel variant).
        let sentinel16: Vec<bf16> = sentinel.iter().map(|&x| bf16::from_f32(x)).collect();
        let cpu16 = |recv: &[u8]| {
            let mut shard = sentinel16.clone();
            gradient::reduce_final(&layout, p, recv, &mut shard).expect("valid slabs");
            bf16_bytes(&shard)
        };
        for (tag, input, want) in [
            ("", &last_recv, cpu16(&last_recv)),
            (" damaged", &bad, cpu16(&twin)),
        ] {
            let input = case.input(input.clone());
            let out = case.output(
                bf16_bytes(&sentinel16),
                format!("grad_reduce_final_bf16 p={p}{tag}"),
                Expect::Bf16,
                want,
            );
            case.launch(
                Kernel::GradReduceFinalBf16,
                last.slab.groups as u64,
                &[Some(input), Some(out)],
                &SdpGradFinal::new(&layout, p).expect("params"),
            );
        }
    }
    case
}

/// The conversions of gradients between bf16 and fp32 over `numel` elements (special values
/// included): widen, round to bf16, and bf16 through fp32 back to bf16 (a partial last run
/// when `numel` is not a multiple of 4 is taken element by element).
fn convert_case(rand: &mut SplitMix64, numel: usize) -> Case {
    let mut case = Case::new(format!("gradient conversions n={numel}"), rand);
    let params = SdpConvert {
        numel: numel as u64,
    };
    let narrow = bf16s(rand, numel, 64);
    let wide = values(rand, numel, 64);
    let mut widened = vec![0f32; numel];
    widen_into(&narrow, &mut widened);
    let mut narrowed = vec![bf16::ZERO; numel];
    narrow_into(&wide, &mut narrowed);
    let mut rounded = vec![bf16::ZERO; numel];
    narrow_into(&widened, &mut rounded);
    for (kernel, input, out_width, expect, want) in [
        (
            Kernel::GradWidenBf16,
            bf16_bytes(&narrow),
            4,
            Expect::F32,
            f32_bytes(&widened),
        ),
        (
            Kernel::GradNarrowBf16,
            f32_bytes(&wide),
            2,
            Expect::Bf16,
            bf16_bytes(&narrowed),
        ),
        (
            Kernel::GradRoundBf16,
            bf16_bytes(&narrow),
            2,
            Expect::Bf16,
            bf16_bytes(&rounded),
        ),
    ] {
        let input = case.input(input);
        let out = case.output(
            garbage(out_width * numel),
            kernel.name().into(),
            expect,
            want,
        );
        case.launch(kernel, numel as u64, &[Some(input), Some(out)], &params);
    }
    case
}

/// The parameter structs of the grouped gradient reduce-scatter with two levels: its family is
/// every kernel taking one of them (by the kernel table), fp32 and bf16 variants alike.
pub(super) const TWO_LEVEL_GRAD: &[&str] = &["sdp_grad_first", "sdp_grad_second", "sdp_grad_final"];

/// Those of a one-level gradient reduce-scatter (QSDP always runs one level).
pub(super) const ONE_LEVEL_GRAD: &[&str] = &["sdp_grad_first", "sdp_grad_final"];

/// Those of the conversions of bf16 gradients (the uncompressed routes of a bf16 bucket).
const CONVERT: &[&str] = &["sdp_convert"];

/// Gradient codec variants: (name, knobs over the sdp4bit preset with weights off, so the
/// padding is the gradient codec's own). Each family takes the variants of its codec; a
/// variant's index in this table picks its shard sizes in the default subset.
const GRAD_VARIANTS: [(&str, &[(&str, &str)]); 13] = [
    ("tlq-hs", &[]),
    ("tlq-hs-h16", &[("hadamard_block", "16")]),
    (
        "tlq-hs-g256-h64-4/8-rn",
        &[
            ("grad_group_size", "256"),
            ("hadamard_block", "64"),
            ("grad_intra_bits", "4"),
            ("grad_inter_bits", "8"),
            ("grad_rounding", "nearest"),
        ],
    ),
    (
        "tlq-hs-g512-h256",
        &[("grad_group_size", "512"), ("hadamard_block", "256")],
    ),
    (
        "tlq-hs-g768-h256",
        &[("grad_group_size", "768"), ("hadamard_block", "256")],
    ),
    (
        "tlq-hs-g32-4/4",
        &[("grad_group_size", "32"), ("grad_intra_bits", "4")],
    ),
    (
        "tlq-g96",
        &[("grad_codec", "tlq"), ("grad_group_size", "96")],
    ),
    (
        "tlq-4/8-rn",
        &[
            ("grad_codec", "tlq"),
            ("grad_intra_bits", "4"),
            ("grad_inter_bits", "8"),
            ("grad_rounding", "nearest"),
        ],
    ),
    (
        "tlq-8/8-rn-g160",
        &[
            ("grad_codec", "tlq"),
            ("grad_inter_bits", "8"),
            ("grad_group_size", "160"),
            ("grad_rounding", "nearest"),
        ],
    ),
    ("zeropp", &[("grad_codec", "zeropp")]),
    ("qsdp", &[("grad_codec", "qsdp")]),
    (
        "qsdp-4bit-g64-rn",
        &[
            ("grad_codec", "qsdp"),
            ("grad_inter_bits", "4"),
            ("grad_group_size", "64"),
            ("grad_rounding", "nearest"),
        ],
    ),
    (
        "qsdp-4bit-g320",
        &[
            ("grad_codec", "qsdp"),
            ("grad_inter_bits", "4"),
            ("grad_group_size", "320"),
        ],
    ),
];

/// Topologies as one node label per DP rank: two levels (2x2, also with the nodes' ranks
/// interleaved, 2x3, 3x2 interleaved), the intra-node level only (1x4), the inter-node level
/// only (4x1), and unequal nodes (one level over all ranks).
const TOPOLOGIES: [(&str, &[u64]); 8] = [
    ("2x2", &[0, 0, 1, 1]),
    ("2x2-interleaved", &[0, 1, 0, 1]),
    ("1x4", &[0, 0, 0, 0]),
    ("4x1", &[0, 1, 2, 3]),
    ("2x3", &[0, 0, 0, 1, 1, 1]),
    ("3x2-interleaved", &[0, 1, 0, 1, 2, 2]),
    ("uneven-2+1", &[0, 0, 1]),
    ("uneven-2+3", &[0, 1, 1, 0, 1]),
];

/// Shard lengths of the gradient cases: less than one group, and odd sizes that leave a partial
/// group and padding.
const GRAD_SHARDS: [usize; 3] = [5, 1237, 4099];

/// The cases of the gradient variants of `codec`: every variant on every topology at P = 1
/// and 3, with every shard size ([`Coverage::Full`]) or two of the three, rotating.
fn grad_cases(codec: GradCodec, rand: &mut SplitMix64, coverage: Coverage) -> Vec<Case> {
    let mut cases = Vec::new();
    for (vi, (variant, knobs)) in GRAD_VARIANTS.iter().enumerate() {
        for (ti, (topo, labels)) in TOPOLOGIES.iter().enumerate() {
            let topology = Topology::from_node_labels(labels).expect("topology");
            let combos: Vec<(usize, usize)> = match coverage {
                Coverage::Full => [1, 3]
                    .into_iter()
                    .flat_map(|p| GRAD_SHARDS.map(|s| (p, s)))
                    .collect(),
                Coverage::Subset => {
                    let shard = |i: usize| GRAD_SHARDS[i % GRAD_SHARDS.len()];
                    vec![(1, shard(vi + ti)), (3, shard(vi + ti + 1))]
                }
            };
            for (chunks, shard) in combos {
                let config = preset_config(
                    knobs,
                    &[
                        ("weight_codec", "none".into()),
                        ("pipeline_chunks", chunks.to_string()),
                    ],
                );
                if config.grad.codec != codec {
                    continue;
                }
                let name = format!("grad {variant} {topo} P={chunks} S={shard}");
                cases.push(grad_case(name, rand, &config, &topology, shard));
            }
        }
    }
    cases
}

#[test]
fn tlq_hs_gradients() {
    emulate_family("TLq-HS gradients", TWO_LEVEL_GRAD, |rand, coverage| {
        grad_cases(GradCodec::TlqHs, rand, coverage)
    });
}
#[test]
fn tlq_gradients() {
    emulate_family("TLq gradients", TWO_LEVEL_GRAD, |rand, coverage| {
        grad_cases(GradCodec::Tlq, rand, coverage)
    });
}
#[test]
fn zeropp_gradients() {
    emulate_family("ZeRO++ gradients", TWO_LEVEL_GRAD, |rand, coverage| {
        grad_cases(GradCodec::Zeropp, rand, coverage)
    });
}
#[test]
fn qsdp_gradients() {
    emulate_family("QSDP gradients", ONE_LEVEL_GRAD, |rand, coverage| {
        grad_cases(GradCodec::Qsdp, rand, coverage)
    });
}
#[test]
fn gradient_conversions() {
    emulate_family("gradient conversions", CONVERT, |rand, coverage| {
        let sizes: &[usize] = match coverage {
            Coverage::Full => &[1, 3, 4, 5, 255, 1000, 4097, 10_007, 70_001],
            Coverage::Subset => &[1, 5, 4097, 10_007],
        };
        sizes.iter().map(|&n| convert_case(rand, n)).collect()
    });
}
