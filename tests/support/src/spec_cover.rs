//! The specialisations the presets, the ablations and the knobs produce: every kernel with the
//! constants a configuration gives it on the topologies that set its peer batches, each with its
//! default variant, and every variant of a few of them. The knobs span infinitely many
//! configurations (any group size that is a multiple of 32); the cover takes every value of each
//! discrete knob (bits, symmetry, rounding, Hadamard block, codec, integer width) and group sizes
//! of every shape a kernel distinguishes (a partial row, one row, several rows, the most held in
//! registers, walked in tiles), one knob varied at a time from the presets.

use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::backend::cuda::spec::{
    self, Constants, KernelSpec, Quant, conversion_uses, global_uses, grad_uses, weight_uses,
};
use sdp4bit::backend::cuda::variants::{candidates, default_variant};
use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::collective::global_bits;
use sdp4bit::layout::{BucketPlan, GradLayout, GradRoute, Topology};
use sdp4bit::{Config, GradCodec, Preset, WeightCodec};

use crate::cuda_end_to_end::ABLATIONS;
use crate::setups::cfg;

/// One configuration of the cover: a name, the config and the topology it runs on.
pub struct Covered {
    pub name: String,
    pub config: Config,
    pub topology: Topology,
}

/// Topologies whose peer counts give every peer batch: one level of 4 (batch 4), two levels of
/// 2 (batch 2), 8 ranks in a node (8), 16 nodes of 1 (more peers than a batch: two batches),
/// and a level of one rank in the first and last (batch 1).
fn topologies() -> Vec<(&'static str, Topology)> {
    vec![
        ("1x4", Topology::uniform(4, 1).expect("1x4")),
        ("2x2", Topology::uniform(2, 2).expect("2x2")),
        ("8x2", Topology::uniform(8, 2).expect("8x2")),
        ("1x16", Topology::uniform(1, 16).expect("1x16")),
    ]
}

/// Knob overrides, one axis at a time from a preset: the gradient codecs' group sizes, bits,
/// Hadamard blocks and rounding, the weight codecs' group sizes, bits and rounding.
const KNOB_AXES: &[(Preset, &[(&str, &str)])] = &[
    (
        Preset::Sdp4bit,
        &[("grad_group_size", "32"), ("hadamard_block", "16")],
    ),
    (Preset::Sdp4bit, &[("grad_group_size", "96")]),
    (
        Preset::Sdp4bit,
        &[("grad_group_size", "256"), ("hadamard_block", "256")],
    ),
    (
        Preset::Sdp4bit,
        &[("grad_group_size", "512"), ("hadamard_block", "64")],
    ),
    (
        Preset::Sdp4bit,
        &[("grad_group_size", "2048"), ("hadamard_block", "128")],
    ),
    (Preset::Sdp4bit, &[("grad_group_size", "4096")]),
    (
        Preset::Sdp4bit,
        &[("grad_intra_bits", "4"), ("grad_inter_bits", "8")],
    ),
    (
        Preset::Zeropp,
        &[("grad_intra_bits", "8"), ("grad_rounding", "stochastic")],
    ),
    (
        Preset::Qsdp,
        &[("grad_group_size", "4096"), ("grad_rounding", "nearest")],
    ),
    (Preset::Qsdp, &[("grad_inter_bits", "4")]),
    (Preset::Sdp4bit, &[("weight_group_size", "32")]),
    (
        Preset::Sdp4bit,
        &[("weight_group_size", "256"), ("weight_bits", "8")],
    ),
    (Preset::Sdp4bit, &[("weight_group_size", "4096")]),
    (
        Preset::Qsdp,
        &[
            ("weight_group_size", "4096"),
            ("weight_rounding", "nearest"),
        ],
    ),
    (
        Preset::Zeropp,
        &[("weight_bits", "4"), ("weight_group_size", "96")],
    ),
    (Preset::GlobalQsgd, &[("grad_rounding", "nearest")]),
];

/// Every configuration of the cover: each preset and ablation on each topology of
/// [`topologies`], and each knob axis on the two-level 2x2 and 8x2.
pub fn configurations() -> Vec<Covered> {
    let mut out = Vec::new();
    let presets = [
        Preset::Sdp4bit,
        Preset::Qsdp,
        Preset::GlobalQsgd,
        Preset::Zeropp,
        Preset::Baseline,
    ]
    .map(|p| (p.to_string(), p, &[][..]));
    let ablations = ABLATIONS.map(|(name, p, o)| (name.to_string(), p, o));
    for (name, preset, overrides) in presets.into_iter().chain(ablations) {
        for (topology_name, topology) in topologies() {
            out.push(Covered {
                name: format!("{name} on {topology_name}"),
                config: cfg(preset, overrides),
                topology,
            });
        }
    }
    for (preset, overrides) in KNOB_AXES {
        for (topology_name, topology) in topologies()
            .into_iter()
            .filter(|(n, _)| ["2x2", "8x2"].contains(n))
        {
            out.push(Covered {
                name: format!("{preset} {overrides:?} on {topology_name}"),
                config: cfg(*preset, overrides),
                topology,
            });
        }
    }
    out
}

/// The kernels (with constants) one rank of `covered` launches in both collectives.
pub fn uses(covered: &Covered) -> Vec<(Kernel, Constants)> {
    let Covered {
        config, topology, ..
    } = covered;
    let w = topology.world();
    // Shards of a few groups of every codec.
    let plan = BucketPlan::new(w * 1003, w, config).expect("a plan");
    let mut uses = Vec::new();
    if config.grad.codec.is_grouped() {
        let route = GradRoute::new(config, topology);
        let layout = GradLayout::new(config, topology, &route, plan).expect("W > 1");
        uses.extend(grad_uses(&layout).expect("grad uses"));
    } else if config.grad.codec == GradCodec::GlobalQsgd {
        let bits = global_bits(config, w).expect("Global-QSGD bits");
        uses.extend(global_uses(bits, config.grad.rounding).expect("global uses"));
    } else {
        uses.extend(conversion_uses());
    }
    if config.cross_group_bits.is_some() {
        uses.extend(global_uses(8, sdp4bit::Rounding::Stochastic).expect("cross-group uses"));
    }
    if let Some(quant) = QuantSpec::of_weights(&config.weight) {
        let layout = SlabLayout {
            spec: quant,
            groups: plan.padded_shard_len / quant.group_size,
        };
        let encoding = if config.weight.codec == WeightCodec::Qwd {
            WeightEncoding::Difference
        } else {
            WeightEncoding::Direct
        };
        uses.extend(weight_uses(&layout, encoding, &plan).expect("weight uses"));
    }
    uses
}

/// The constants whose every variant the cover holds: the sdp4bit preset's first pass,
/// requantization, final pass and weight passes, QSDP's gradient passes, Global-QSGD's
/// rounding.
fn variant_anchors() -> Vec<(Kernel, Constants)> {
    let q = |bits, group_size, symmetric, stochastic| Quant {
        bits,
        group_size,
        symmetric,
        stochastic,
    };
    vec![
        (
            Kernel::GradQuantizeFirst,
            Constants::First {
                quant: q(8, 128, true, true),
                hadamard_block: 32,
            },
        ),
        (
            Kernel::GradRequantizeSecond,
            Constants::Second {
                input: q(8, 128, true, true),
                output: q(4, 128, true, true),
                peer_batch: 2,
            },
        ),
        (
            Kernel::GradReduceFinal,
            Constants::Final {
                quant: q(4, 128, true, true),
                hadamard_block: 32,
                peer_batch: 2,
            },
        ),
        (
            Kernel::GradQuantizeFirst,
            Constants::First {
                quant: q(8, 1024, false, true),
                hadamard_block: 0,
            },
        ),
        (
            Kernel::WeightApply,
            Constants::Weight {
                quant: q(4, 256, true, true),
                difference: true,
            },
        ),
        (
            Kernel::GlobalQuantizeI8,
            Constants::Elementwise { stochastic: true },
        ),
    ]
}

/// The cover: every spec of [`configurations`] with its default variant, and every variant of
/// the anchors, each once, sorted by entry name.
pub fn specs() -> Vec<KernelSpec> {
    let mut all: Vec<KernelSpec> = configurations()
        .iter()
        .flat_map(uses)
        .map(|(kernel, constants)| {
            KernelSpec::new(kernel, constants, default_variant(kernel, constants))
                .expect("a default spec")
        })
        .collect();
    for (kernel, constants) in variant_anchors() {
        for variant in candidates(kernel, constants) {
            all.push(KernelSpec::new(kernel, constants, variant).expect("a variant"));
        }
    }
    all.sort_by_key(KernelSpec::entry);
    all.dedup_by_key(|s| s.entry());
    all
}

/// The peer batches of the cover's decoders (the spec module's cap included).
pub fn peer_batches() -> Vec<u32> {
    let mut batches: Vec<u32> = specs()
        .iter()
        .filter_map(|s| match s.constants {
            Constants::Second { peer_batch, .. } | Constants::Final { peer_batch, .. } => {
                Some(peer_batch)
            }
            _ => None,
        })
        .collect();
    batches.sort_unstable();
    batches.dedup();
    assert!(batches.contains(&spec::MAX_PEER_BATCH));
    batches
}
