//! The weight families, one per codec: the all-gather's two kernels (one rank encodes its
//! shard, then applies every rank's slab, also with damaged slabs); their cases and tests.

use sdp4bit::backend::cpu::weight;
use sdp4bit::backend::cuda::abi::{SdpWeightApply, SdpWeightEncode};
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::layout::BucketPlan;
use sdp4bit::rng::Stage;
use sdp4bit::{Config, WeightCodec};

use super::case::{Case, Expect};
use super::data::{bf16_bytes, bf16s, damage, garbage, stream, updated};
use super::preset_config;
use super::sweep::{Coverage, emulate_family};
use sdp4bit_test_support::random::SplitMix64;

/// The weight all-gather's two passes: this rank encodes its shard (at its padded bucket index,
/// or with `high_index` at one whose Philox blocks cross 2^32), then applies every rank's slab,
/// also with damaged slabs.
pub(super) fn weight_case(
    name: String,
    rand: &mut SplitMix64,
    config: &Config,
    w: usize,
    shard_len: usize,
    high_index: bool,
) -> Case {
    let mut case = Case::new(name, rand);
    let spec = QuantSpec::of_weights(&config.weight).expect("a grouped weight codec");
    let g = spec.group_size;
    let encoding = if config.weight.codec == WeightCodec::Qwd {
        WeightEncoding::Difference
    } else {
        WeightEncoding::Direct
    };
    let difference = encoding == WeightEncoding::Difference;
    let plan = BucketPlan::new(w * shard_len, w, config).expect("plan");
    let layout = SlabLayout {
        spec,
        groups: plan.padded_shard_len / g,
    };
    let me = rand.below(w);

    // Encode this rank's shard; direct encodings pass no reference (a null pointer).
    let reference = bf16s(rand, shard_len, g);
    let new = updated(rand, &reference);
    let rng = stream(rand, me, Stage::Weight);
    let first_index = if high_index {
        (1u64 << 34) - 32 * (1 + rand.below(g / 16)) as u64
    } else {
        plan.padded_index(me, 0)
    };
    let mut want = vec![0u8; layout.byte_len()];
    weight::encode_shard(
        layout,
        encoding,
        first_index,
        &new,
        &reference,
        &rng,
        &mut want,
    );
    let new = case.input(bf16_bytes(&new));
    let reference = difference.then(|| case.input(bf16_bytes(&reference)));
    let out = case.output(
        garbage(want.len()),
        format!("weight_encode at index {first_index}"),
        Expect::Slabs(layout),
        want,
    );
    case.launch(
        Kernel::WeightEncode,
        layout.groups as u64,
        &[Some(new), reference, Some(out)],
        &SdpWeightEncode::new(&layout, encoding, shard_len, first_index, &rng).expect("params"),
    );

    // Apply every rank's slab, each the CPU encoding of that rank's update.
    let mut recv = Vec::with_capacity(w * layout.byte_len());
    for z in 0..w {
        let old = bf16s(rand, shard_len, g);
        let new = updated(rand, &old);
        let mut slab = vec![0u8; layout.byte_len()];
        let rng = stream(rand, z, Stage::Weight);
        weight::encode_shard(
            layout,
            encoding,
            plan.padded_index(z, 0),
            &new,
            &old,
            &rng,
            &mut slab,
        );
        recv.extend(slab);
    }
    let own_reference = bf16s(rand, shard_len, g);
    let params = bf16s(rand, plan.numel, g);
    let cpu = |recv: &[u8]| {
        let mut out = params.clone();
        weight::apply_shards(layout, encoding, &plan, me, recv, &own_reference, &mut out)
            .expect("valid slabs");
        bf16_bytes(&out)
    };
    let own = difference.then(|| case.input(bf16_bytes(&own_reference)));
    let (bad, twin) = damage(rand, layout, &recv);
    for (tag, input, want) in [("", &recv, cpu(&recv)), (" damaged", &bad, cpu(&twin))] {
        let input = case.input(input.clone());
        let out = case.output(
            bf16_bytes(&params),
            format!("weight_apply{tag}"),
            Expect::Bf16,
            want,
        );
        case.launch(
            Kernel::WeightApply,
            (w * shard_len.div_ceil(g)) as u64,
            &[Some(input), own, Some(out)],
            &SdpWeightApply::new(&layout, encoding, &plan, me).expect("params"),
        );
    }
    case
}

/// The parameter structs of the quantized weight all-gather: its families launch every kernel
/// taking one of them.
pub(super) const WEIGHT: &[&str] = &["sdp_weight_encode", "sdp_weight_apply"];

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

/// Shard lengths of the weight cases.
const WEIGHT_SHARDS: [usize; 4] = [7, 2047, 5000, 9000];

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
            let config = preset_config(knobs, &[("pipeline_chunks", chunks.to_string())]);
            if config.weight.codec != codec {
                continue;
            }
            let name = format!("weight {variant} W={w} S={shard} P={chunks}");
            cases.push(weight_case(name, rand, &config, w, shard, i % 2 == 1));
        }
    }
    cases
}

#[test]
fn qwd_weights() {
    emulate_family("qWD weights", WEIGHT, |rand, coverage| {
        weight_cases(WeightCodec::Qwd, rand, coverage)
    });
}

#[test]
fn qw_weights() {
    emulate_family("qW weights", WEIGHT, |rand, coverage| {
        weight_cases(WeightCodec::Qw, rand, coverage)
    });
}

#[test]
fn qsdp_weights() {
    emulate_family("QSDP weights", WEIGHT, |rand, coverage| {
        weight_cases(WeightCodec::Qsdp, rand, coverage)
    });
}

#[test]
fn zeropp_weights() {
    emulate_family("ZeRO++ weights", WEIGHT, |rand, coverage| {
        weight_cases(WeightCodec::Zeropp, rand, coverage)
    });
}
