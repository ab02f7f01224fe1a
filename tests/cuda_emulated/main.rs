//! Bit-identity of every CUDA kernel with the CPU backend, without a GPU: g++ compiles the
//! kernels of `kernels/` unchanged against a host emulation of the CUDA device environment
//! (`tests/kernel_emulator/`, driven by [`emulator`]), and the emulator runs launches whose
//! outputs must be the CPU backend's.
//!
//! One test per codec family, each with fresh random inputs (fixed seed, per family), launch
//! parameters built by the CUDA backend's own `abi` constructors, grids of 1, 2 or 3 blocks
//! (so the grid-stride loops run) or as many blocks as the work units need, warps in forward,
//! reverse or shuffled order. The data hold NaN / Inf groups, signed zeros, denormals, values
//! near `f32::MAX` and odd shard sizes. The families:
//! - gradients, per codec (TLq-HS: H16, H32, H64 with 4/8-bit nearest, H256 over 512- and
//!   768-element groups, 32-element groups; TLq: 96-element groups, 4/8-bit nearest; ZeRO++;
//!   QSDP: 8-bit and 4-bit, nearest and stochastic): topologies 2x2, 2x2 with interleaved
//!   ranks, 1x4, 4x1, 2x3, 3x2 interleaved and two with unequal nodes; P = 1 and 3; all three
//!   passes;
//! - weights, per codec (qwd, qw, qsdp, zeropp) with several bit widths, group sizes and
//!   roundings, W = 1 to 4: encode (also at a bucket index past 2^32 Philox blocks) and apply;
//! - Global-QSGD: absmax, int8 / int16 rounding (stochastic and nearest) and dequantization;
//! - the gradient kernels' bf16 variants (bf16 bucket in, bf16 shard out) beside their fp32
//!   ones in the gradient and Global-QSGD families, and the bf16 conversions.
//!
//! Every gradient and weight case also feeds its decoding kernels corrupt received slabs
//! (negative or infinite scales, infinite offsets, the symmetric code -2^(b-1)), which the
//! kernels decode to NaN where the CPU returns `Error::Decode`: the expected output is the
//! CPU's for the same slabs with those groups made non-finite (scale and offset NaN, codes 0);
//! and unusual but valid metadata (scale -0, a negative NaN, a denormal) that both must decode
//! alike.
//!
//! The default run is a third of each family's cross product that still covers every axis;
//! `SDP4BIT_EMULATOR_FULL=1` runs the whole of it (801 cases). g++ is required (it builds the
//! emulator once for all families): without it the tests fail, unless
//! `SDP4BIT_SKIP_EMULATOR=1`. `SDP4BIT_KERNELS_DIR=DIR` emulates the kernel sources in DIR
//! instead of `kernels/` (e.g. a deliberately broken copy), and `SDP4BIT_TEST_SEED=N` changes
//! the data seed. On failure the family's work directory (case files, outputs, the emulator)
//! is kept and its path printed.

use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::layout::Topology;
use sdp4bit::{Config, GradCodec, Preset, WeightCodec};
use sdp4bit_test_support::random::SplitMix64;

mod divide;
mod emulator;

use emulator::global::{GlobalData, global_case};
use emulator::grad::{convert_case, grad_case};
use emulator::weight::weight_case;
use emulator::{Case, Coverage, emulate_family};

/// The parameter structs of the grouped gradient reduce-scatter with two levels: its family is
/// every kernel taking one of them (by the kernel table), fp32 and bf16 variants alike.
const TWO_LEVEL_GRAD: &[&str] = &["sdp_grad_first", "sdp_grad_second", "sdp_grad_final"];

/// Those of a one-level gradient reduce-scatter (QSDP always runs one level).
const ONE_LEVEL_GRAD: &[&str] = &["sdp_grad_first", "sdp_grad_final"];

/// Those of the conversions of bf16 gradients (the uncompressed routes of a bf16 bucket).
const CONVERT: &[&str] = &["sdp_convert"];

/// Those of the quantized weight all-gather.
const WEIGHT: &[&str] = &["sdp_weight_encode", "sdp_weight_apply"];

/// Global-QSGD's.
const GLOBAL: &[&str] = &["sdp_global"];

/// The kernels whose parameter struct is one of `structs`: what a family's cases must launch.
fn family(structs: &[&str]) -> Vec<Kernel> {
    Kernel::ALL
        .into_iter()
        .filter(|k| structs.contains(&k.params()))
        .collect()
}

#[test]
fn every_kernel_belongs_to_an_emulated_family() {
    let families = [TWO_LEVEL_GRAD, ONE_LEVEL_GRAD, WEIGHT, GLOBAL, CONVERT];
    for kernel in Kernel::ALL {
        assert!(
            families.iter().any(|f| f.contains(&kernel.params())),
            "no emulated family launches {}",
            kernel.name()
        );
    }
}

#[test]
fn tlq_hs_gradients() {
    emulate_family(
        "TLq-HS gradients",
        &family(TWO_LEVEL_GRAD),
        |rand, coverage| grad_cases(GradCodec::TlqHs, rand, coverage),
    );
}

#[test]
fn tlq_gradients() {
    emulate_family(
        "TLq gradients",
        &family(TWO_LEVEL_GRAD),
        |rand, coverage| grad_cases(GradCodec::Tlq, rand, coverage),
    );
}

#[test]
fn zeropp_gradients() {
    emulate_family(
        "ZeRO++ gradients",
        &family(TWO_LEVEL_GRAD),
        |rand, coverage| grad_cases(GradCodec::Zeropp, rand, coverage),
    );
}

#[test]
fn qsdp_gradients() {
    emulate_family(
        "QSDP gradients",
        &family(ONE_LEVEL_GRAD),
        |rand, coverage| grad_cases(GradCodec::Qsdp, rand, coverage),
    );
}

#[test]
fn qwd_weights() {
    emulate_family("qWD weights", &family(WEIGHT), |rand, coverage| {
        weight_cases(WeightCodec::Qwd, rand, coverage)
    });
}

#[test]
fn qw_weights() {
    emulate_family("qW weights", &family(WEIGHT), |rand, coverage| {
        weight_cases(WeightCodec::Qw, rand, coverage)
    });
}

#[test]
fn qsdp_weights() {
    emulate_family("QSDP weights", &family(WEIGHT), |rand, coverage| {
        weight_cases(WeightCodec::Qsdp, rand, coverage)
    });
}

#[test]
fn zeropp_weights() {
    emulate_family("ZeRO++ weights", &family(WEIGHT), |rand, coverage| {
        weight_cases(WeightCodec::Zeropp, rand, coverage)
    });
}

#[test]
fn global_qsgd() {
    emulate_family("Global-QSGD", &family(GLOBAL), global_cases);
}

#[test]
fn gradient_conversions() {
    emulate_family(
        "gradient conversions",
        &family(CONVERT),
        |rand, coverage| {
            let sizes: &[usize] = match coverage {
                Coverage::Full => &[1, 3, 4, 5, 255, 1000, 4097, 10_007, 70_001],
                Coverage::Subset => &[1, 5, 4097, 10_007],
            };
            sizes.iter().map(|&n| convert_case(rand, n)).collect()
        },
    );
}

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

/// Weight codec variants: (name, knobs over the sdp4bit preset). Each family takes the
/// variants of its codec; a variant's index in this table picks its sizes and pipeline chunks.
const WEIGHT_VARIANTS: [(&str, &[(&str, &str)]); 10] = [
    ("qwd", &[]),
    (
        "qwd-8bit-g256",
        &[("weight_bits", "8"), ("weight_group_size", "256")],
    ),
    (
        "qwd-g32-rn",
        &[("weight_group_size", "32"), ("weight_rounding", "nearest")],
    ),
    ("qw", &[("weight_codec", "qw")]),
    (
        "qw-8bit-g96",
        &[
            ("weight_codec", "qw"),
            ("weight_bits", "8"),
            ("weight_group_size", "96"),
        ],
    ),
    ("qsdp", &[("weight_codec", "qsdp")]),
    (
        "qsdp-4bit-g64-rn",
        &[
            ("weight_codec", "qsdp"),
            ("weight_bits", "4"),
            ("weight_group_size", "64"),
            ("weight_rounding", "nearest"),
        ],
    ),
    (
        "qsdp-4bit-g288",
        &[
            ("weight_codec", "qsdp"),
            ("weight_bits", "4"),
            ("weight_group_size", "288"),
        ],
    ),
    ("zeropp", &[("weight_codec", "zeropp")]),
    (
        "zeropp-4bit-g128",
        &[
            ("weight_codec", "zeropp"),
            ("weight_bits", "4"),
            ("weight_group_size", "128"),
        ],
    ),
];

/// Shard lengths of the gradient cases: less than one group, and odd sizes that leave a partial
/// group and padding.
const GRAD_SHARDS: [usize; 3] = [5, 1237, 4099];

/// Shard lengths of the weight cases.
const WEIGHT_SHARDS: [usize; 4] = [7, 2047, 5000, 9000];

/// The sdp4bit preset with `base` and then `extra` knobs.
fn config(base: &[(&'static str, &'static str)], extra: &[(&'static str, String)]) -> Config {
    let knobs = base
        .iter()
        .copied()
        .chain(extra.iter().map(|(k, v)| (*k, v.as_str())));
    Config::from_overrides(Preset::Sdp4bit, knobs).expect("valid config")
}

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
                let config = config(
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

/// The cases of the weight variants of `codec`: every variant at every world size 1 to 4,
/// with every shard size ([`Coverage::Full`]) or one, rotating.
fn weight_cases(codec: WeightCodec, rand: &mut SplitMix64, coverage: Coverage) -> Vec<Case> {
    let mut cases = Vec::new();
    for (vi, (variant, knobs)) in WEIGHT_VARIANTS.iter().enumerate() {
        let combos: Vec<(usize, usize)> = match coverage {
            Coverage::Full => [1, 2, 3, 4]
                .into_iter()
                .flat_map(|w| WEIGHT_SHARDS.map(|s| (w, s)))
                .collect(),
            Coverage::Subset => (1..=4)
                .map(|w| (w, WEIGHT_SHARDS[(vi + w) % WEIGHT_SHARDS.len()]))
                .collect(),
        };
        for (i, (w, shard)) in combos.into_iter().enumerate() {
            // Pipeline chunks change the padding (the gradient codec's groups times P).
            let chunks = 1 + (vi + i) % 3;
            let config = config(knobs, &[("pipeline_chunks", chunks.to_string())]);
            if config.weight.codec != codec {
                continue;
            }
            let name = format!("weight {variant} W={w} S={shard} P={chunks}");
            cases.push(weight_case(name, rand, &config, w, shard, i % 2 == 1));
        }
    }
    cases
}

/// Global-QSGD over buckets of eight sizes ([`Coverage::Full`]) or four, with plain data and
/// with NaN / Inf, and one all-zero bucket.
fn global_cases(rand: &mut SplitMix64, coverage: Coverage) -> Vec<Case> {
    let sizes: &[usize] = match coverage {
        Coverage::Full => &[1, 5, 255, 1000, 4097, 10_007, 70_001, 100_003],
        Coverage::Subset => &[1, 255, 4097, 10_007],
    };
    let mut cases = Vec::new();
    for &numel in sizes {
        for data in [GlobalData::Plain, GlobalData::Specials] {
            cases.push(global_case(rand, numel, data));
        }
    }
    cases.push(global_case(rand, 777, GlobalData::Zeros));
    cases
}
