//! Every variant computes the same bytes: cases of the presets' configurations run once with
//! each variant the kernels compile for each launch's constants (units 1, 2, 4, 8 of groups per
//! warp or runs per thread, where they fit; blocks of 128, 256 and 512 threads), while the
//! families run the default variant on every configuration.

use sdp4bit::layout::Topology;

use super::case::Case;
use super::global::{GLOBAL, GlobalData, global_case};
use super::grad::{ONE_LEVEL_GRAD, TWO_LEVEL_GRAD, grad_case};
use super::preset_config;
use super::sweep::{Coverage, emulate_family};
use super::weight::{WEIGHT, weight_case};
use sdp4bit_test_support::random::SplitMix64;

/// More indices than any constants have variants (4 unit counts x 3 block sizes): every variant
/// of every launch runs in some case.
const VARIANTS: usize = 12;

/// The sdp4bit preset's gradients on 2 x 2 and its weights at W = 4, QSDP's gradients (groups of
/// 1024, one level), TLq-HS over groups walked in tiles, and Global-QSGD, each case once per
/// variant index; partial last groups and padding in every one.
fn variant_cases(rand: &mut SplitMix64, coverage: Coverage) -> Vec<Case> {
    let two_by_two = Topology::from_node_labels(&[0, 0, 1, 1]).expect("2x2");
    let one_node = Topology::from_node_labels(&[0, 0, 0, 0]).expect("1x4");
    let grad = |knobs: &[(&'static str, &'static str)]| {
        preset_config(
            knobs,
            &[
                ("weight_codec", "none".into()),
                ("pipeline_chunks", "1".into()),
            ],
        )
    };
    let mut cases = Vec::new();
    for i in 0..VARIANTS {
        let mut add = |case: Case| cases.push(case.with_variant(i));
        add(grad_case(
            "sdp4bit grad".into(),
            rand,
            &grad(&[]),
            &two_by_two,
            1237,
        ));
        add(grad_case(
            "qsdp grad".into(),
            rand,
            &grad(&[("grad_codec", "qsdp")]),
            &one_node,
            2500,
        ));
        if coverage == Coverage::Full {
            add(grad_case(
                "tlq-hs tiled".into(),
                rand,
                &grad(&[("grad_group_size", "4096")]),
                &two_by_two,
                9000,
            ));
        }
        let weights = preset_config(&[], &[]);
        add(weight_case(
            "qwd weights".into(),
            rand,
            &weights,
            4,
            5000,
            false,
        ));
        add(global_case(rand, 10_007, GlobalData::Plain));
    }
    assert!(cases.iter().all(|c| c.specs().count() > 0));
    cases
}

#[test]
fn every_variant_computes_the_same_bytes() {
    let structs: Vec<&str> = [TWO_LEVEL_GRAD, ONE_LEVEL_GRAD, WEIGHT, GLOBAL].concat();
    emulate_family("every variant", &structs, variant_cases);
}
