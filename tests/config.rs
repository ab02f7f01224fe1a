//! Presets, knobs, validation, canonical form and fingerprint of `config` (docs/numerics.md §4).

use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::config::{
    DEFAULT_SEED, ExactParams, GROUP_QUANTUM, GradConfig, KNOBS, MAX_GROUP_SIZE,
    MAX_PIPELINE_CHUNKS, WeightConfig,
};
use sdp4bit::{Config, Error, GradCodec, Preset, Rounding, WeightCodec, hadamard};
use sdp4bit_test_support::random::SplitMix64;

use Rounding::{Nearest, Stochastic};

/// Golden fingerprint of `Config::preset(Preset::Sdp4bit)`. Ranks of different builds compare
/// fingerprints before the first collective, so this value must not change while the preset
/// means the same exchanges: a change means old and new builds refuse to work together. It
/// changed deliberately when the preset's `pipeline_chunks` became `auto` (old builds
/// exchange one chunk, new ones several: they must refuse each other, not hang), and when
/// `exact_params` came in (with tensor parallelism new builds send the replicated parameters
/// exact besides, old ones do not), and when `cross_group_bits` came in (with hybrid sharding
/// new builds all-reduce Global-QSGD integers across the groups, old ones refuse it).
/// (FNV-1a 64 of the canonical string pinned in `canonical_form_of_every_preset`.)
const SDP4BIT_FINGERPRINT: u64 = 0x28c5_7faf_f446_fca0;

/// FNV-1a 64 written out (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn preset_from(name: &str) -> Preset {
    name.parse()
        .unwrap_or_else(|e| panic!("preset {name}: {e}"))
}

fn config_err(r: sdp4bit::Result<impl std::fmt::Debug>) -> String {
    match r {
        Err(Error::Config(msg)) => msg,
        other => panic!("expected a config error, got {other:?}"),
    }
}

/// Asserts that `msg` names every one of `parts`.
fn mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(
            msg.contains(p),
            "error message {msg:?} should mention {p:?}"
        );
    }
}

fn weight(codec: WeightCodec, bits: u8, group_size: usize, rounding: Rounding) -> WeightConfig {
    WeightConfig {
        codec,
        bits,
        group_size,
        rounding,
    }
}

#[test]
fn presets_match_the_documented_table() {
    // docs/numerics.md §4.3: sdp4bit = qwd + tlq-hs; qsdp = qsdp + qsdp; global-qsgd = none +
    // global-qsgd; zeropp = zeropp + zeropp; baseline = none + none.
    let sdp = Config::preset(Preset::Sdp4bit);
    assert_eq!(sdp.weight, weight(WeightCodec::Qwd, 4, 2048, Stochastic));
    assert_eq!(sdp.grad.codec, GradCodec::TlqHs);
    assert_eq!(
        (
            sdp.grad.intra_bits,
            sdp.grad.inter_bits,
            sdp.grad.group_size
        ),
        (8, 4, 128)
    );
    assert_eq!(sdp.grad.hadamard_block, Some(32));
    assert_eq!(sdp.grad.rounding, Stochastic);

    let q = Config::preset(Preset::Qsdp);
    assert_eq!(q.weight, weight(WeightCodec::Qsdp, 8, 1024, Stochastic));
    assert_eq!(q.grad.codec, GradCodec::Qsdp);
    assert_eq!((q.grad.inter_bits, q.grad.group_size), (8, 1024));
    assert_eq!((q.grad.hadamard_block, q.grad.rounding), (None, Stochastic));

    let g = Config::preset(Preset::GlobalQsgd);
    assert_eq!(g.weight.codec, WeightCodec::None);
    assert_eq!(g.grad.codec, GradCodec::GlobalQsgd);
    assert_eq!(
        g.grad.global_bits, None,
        "w = auto (8 while W <= 127, else 16)"
    );
    assert_eq!(g.grad.rounding, Stochastic);

    let z = Config::preset(Preset::Zeropp);
    assert_eq!(z.weight, weight(WeightCodec::Zeropp, 8, 2048, Nearest));
    assert_eq!(z.grad.codec, GradCodec::Zeropp);
    assert_eq!(
        (z.grad.intra_bits, z.grad.inter_bits, z.grad.group_size),
        (4, 4, 128)
    );
    assert_eq!((z.grad.hadamard_block, z.grad.rounding), (None, Nearest));

    let b = Config::preset(Preset::Baseline);
    assert_eq!(
        (b.weight.codec, b.grad.codec),
        (WeightCodec::None, GradCodec::None)
    );

    for &p in Preset::ALL {
        let c = Config::preset(p);
        assert_eq!(c.pipeline_chunks, None, "{p}: chunks chosen per bucket");
        assert_eq!(c.grad_quant_start_step, 0, "{p}");
        assert_eq!(c.seed, DEFAULT_SEED, "{p}");
        assert_eq!(DEFAULT_SEED, 1234);
        c.validate()
            .unwrap_or_else(|e| panic!("preset {p} invalid: {e}"));
        assert_eq!(Config::from_overrides(p, []).unwrap(), c);
    }
    assert_eq!(Preset::ALL.len(), 5);
}

#[test]
fn codec_defaults_and_quant_specs() {
    // Weight codecs (docs/numerics.md §4.1): qw is b=4 g=2048 symmetric SR.
    assert_eq!(
        WeightConfig::defaults(WeightCodec::Qw),
        weight(WeightCodec::Qw, 4, 2048, Stochastic)
    );
    assert_eq!(
        QuantSpec::of_weights(&WeightConfig::defaults(WeightCodec::None)),
        None
    );
    let expect_w = [
        (WeightCodec::Qwd, 4, 2048, true, Stochastic),
        (WeightCodec::Qw, 4, 2048, true, Stochastic),
        (WeightCodec::Qsdp, 8, 1024, false, Stochastic),
        (WeightCodec::Zeropp, 8, 2048, true, Nearest),
    ];
    for (codec, bits, group_size, symmetric, rounding) in expect_w {
        assert_eq!(
            QuantSpec::of_weights(&WeightConfig::defaults(codec)),
            Some(QuantSpec {
                bits,
                group_size,
                symmetric,
                rounding
            }),
            "{codec}"
        );
    }
    // Gradient codecs: (codec, grouped, two-level, intra, inter, group, hadamard, rounding).
    let expect_g = [
        (
            GradCodec::TlqHs,
            true,
            true,
            8,
            4,
            128,
            Some(32),
            Stochastic,
        ),
        (GradCodec::Tlq, true, true, 8, 4, 128, None, Stochastic),
        (GradCodec::Qsdp, true, false, 8, 8, 1024, None, Stochastic),
        (GradCodec::Zeropp, true, true, 4, 4, 128, None, Nearest),
    ];
    for (codec, grouped, two, intra, inter, group, had, rounding) in expect_g {
        let g = GradConfig::defaults(codec);
        assert_eq!(g.codec.is_grouped(), grouped, "{codec}");
        assert_eq!(g.codec.is_two_level(), two, "{codec}");
        assert_eq!(
            (
                g.intra_bits,
                g.inter_bits,
                g.group_size,
                g.hadamard_block,
                g.rounding
            ),
            (intra, inter, group, had, rounding),
            "{codec}"
        );
        for bits in [4, 8] {
            assert_eq!(
                QuantSpec::of_grads(&g, bits),
                QuantSpec {
                    bits,
                    group_size: group,
                    symmetric: codec != GradCodec::Qsdp,
                    rounding
                },
                "{codec}"
            );
        }
    }
    for codec in [GradCodec::None, GradCodec::GlobalQsgd] {
        let g = GradConfig::defaults(codec);
        assert!(!g.codec.is_grouped() && !g.codec.is_two_level(), "{codec}");
        assert_eq!(g.hadamard_block, None);
    }
}

#[test]
fn hadamard_blocks_accepted_are_the_transforms_blocks() {
    let knob = KNOBS.iter().find(|k| k.name == "hadamard_block").unwrap();
    for block in 0..=2 * hadamard::MAX_BLOCK {
        assert_eq!(
            knob.values.accepts(&block.to_string()),
            block == 0 || hadamard::is_supported_block(block),
            "hadamard_block={block}"
        );
    }
}

#[test]
fn names_parse_round_trip() {
    for &c in WeightCodec::ALL {
        assert_eq!(c.to_string().parse::<WeightCodec>().unwrap(), c);
    }
    for &c in GradCodec::ALL {
        assert_eq!(c.to_string().parse::<GradCodec>().unwrap(), c);
    }
    for &p in Preset::ALL {
        assert_eq!(preset_from(&p.to_string()), p);
    }
    for &r in Rounding::ALL {
        assert_eq!(r.to_string().parse::<Rounding>().unwrap(), r);
    }
    let names: Vec<_> = GradCodec::ALL.iter().map(|c| c.name()).collect();
    assert_eq!(
        names,
        ["none", "tlq-hs", "tlq", "qsdp", "global-qsgd", "zeropp"]
    );
    let names: Vec<_> = WeightCodec::ALL.iter().map(|c| c.name()).collect();
    assert_eq!(names, ["none", "qwd", "qw", "qsdp", "zeropp"]);
    // Case and '_' / '-' are forgiven; anything else names the bad value and the choices.
    assert_eq!(preset_from("Global_QSGD"), Preset::GlobalQsgd);
    assert_eq!("TLQ_HS".parse::<GradCodec>().unwrap(), GradCodec::TlqHs);
    let e = "fsdp".parse::<Preset>().unwrap_err();
    mentions(&e, &["fsdp", "sdp4bit", "baseline"]);
}

#[test]
fn every_knob_can_be_set() {
    let set = |p: Preset, kv: &[(&str, &str)]| {
        Config::from_overrides(p, kv.iter().copied()).unwrap_or_else(|e| panic!("{p} {kv:?}: {e}"))
    };
    let c = set(Preset::Sdp4bit, &[("weight_codec", "qw")]);
    assert_eq!(c.weight, WeightConfig::defaults(WeightCodec::Qw));
    let c = set(Preset::Sdp4bit, &[("weight_bits", "8")]);
    assert_eq!(c.weight.bits, 8);
    let c = set(Preset::Sdp4bit, &[("weight_group_size", "1024")]);
    assert_eq!(c.weight.group_size, 1024);
    let c = set(Preset::Sdp4bit, &[("weight_rounding", "nearest")]);
    assert_eq!(c.weight.rounding, Nearest);
    let c = set(Preset::Sdp4bit, &[("grad_codec", "qsdp")]);
    assert_eq!(c.grad, GradConfig::defaults(GradCodec::Qsdp));
    let c = set(Preset::Sdp4bit, &[("grad_intra_bits", "4")]);
    assert_eq!(c.grad.intra_bits, 4);
    let c = set(Preset::Sdp4bit, &[("grad_inter_bits", "8")]);
    assert_eq!(c.grad.inter_bits, 8);
    let c = set(Preset::Sdp4bit, &[("grad_group_size", "256")]);
    assert_eq!(c.grad.group_size, 256);
    let c = set(Preset::Sdp4bit, &[("hadamard_block", "64")]);
    assert_eq!(c.grad.hadamard_block, Some(64));
    let c = set(Preset::Sdp4bit, &[("hadamard_block", "0")]);
    assert_eq!(c.grad.hadamard_block, None, "0 turns Hadamard off");
    let c = set(Preset::Sdp4bit, &[("grad_rounding", "nearest")]);
    assert_eq!(c.grad.rounding, Nearest);
    for (v, want) in [("auto", None), ("8", Some(8)), ("16", Some(16))] {
        let c = set(Preset::GlobalQsgd, &[("global_qsgd_bits", v)]);
        assert_eq!(c.grad.global_bits, want, "global_qsgd_bits={v}");
    }
    let c = set(Preset::Sdp4bit, &[("pipeline_chunks", "4")]);
    assert_eq!(c.pipeline_chunks, Some(4));
    let c = set(Preset::Sdp4bit, &[("pipeline_chunks", "64")]);
    assert_eq!(c.pipeline_chunks, Some(MAX_PIPELINE_CHUNKS));
    let c = set(Preset::Sdp4bit, &[("grad_quant_start_step", "1000")]);
    assert_eq!(c.grad_quant_start_step, 1000);
    let c = set(Preset::Sdp4bit, &[("seed", "18446744073709551615")]);
    assert_eq!(c.seed, u64::MAX);
    for (v, want) in [
        ("none", ExactParams::None),
        ("replicated", ExactParams::Replicated),
        (
            "norms-biases-embeddings",
            ExactParams::NormsBiasesEmbeddings,
        ),
    ] {
        let c = set(Preset::Baseline, &[("exact_params", v)]);
        assert_eq!(c.exact_params, want, "exact_params={v}");
    }
    // Hadamard is allowed on every two-level codec, also tlq and zeropp.
    let c = set(Preset::Zeropp, &[("hadamard_block", "16")]);
    assert_eq!(c.grad.hadamard_block, Some(16));
    let c = set(
        Preset::Sdp4bit,
        &[("grad_codec", "tlq"), ("hadamard_block", "128")],
    );
    assert_eq!(c.grad.hadamard_block, Some(128));
    // Group size bounds.
    let c = set(
        Preset::Qsdp,
        &[("grad_group_size", "65536"), ("weight_group_size", "32")],
    );
    assert_eq!(
        (c.grad.group_size, c.weight.group_size),
        (MAX_GROUP_SIZE, GROUP_QUANTUM)
    );

    // Overrides apply in order; a codec change resets that codec's knobs.
    let c = set(
        Preset::Sdp4bit,
        &[("weight_bits", "8"), ("weight_codec", "qw")],
    );
    assert_eq!(c.weight.bits, 4, "weight_codec must reset weight_bits");
    let c = set(
        Preset::Sdp4bit,
        &[("weight_codec", "qw"), ("weight_bits", "8")],
    );
    assert_eq!(c.weight.bits, 8);
    let c = set(
        Preset::Sdp4bit,
        &[("grad_group_size", "256"), ("grad_codec", "tlq-hs")],
    );
    assert_eq!(
        c.grad.group_size, 128,
        "grad_codec must reset grad_group_size"
    );
    // An invalid intermediate value is fine when a later override fixes it.
    let c = set(
        Preset::Sdp4bit,
        &[("grad_group_size", "100"), ("grad_group_size", "96")],
    );
    assert_eq!(c.grad.group_size, 96);
    // Whitespace around values is tolerated.
    let c = set(Preset::Sdp4bit, &[("seed", " 7 ")]);
    assert_eq!(c.seed, 7);

    // Config::set on a mutable config behaves the same.
    let mut c = Config::preset(Preset::Baseline);
    c.set("grad_codec", "tlq-hs").unwrap();
    c.set("weight_codec", "qwd").unwrap();
    c.set("cross_group_bits", "8").unwrap();
    assert_eq!(c, Config::preset(Preset::Sdp4bit));
    let c = set(Preset::Sdp4bit, &[("cross_group_bits", "exact")]);
    assert_eq!(c.cross_group_bits, None);
    let c = set(Preset::Baseline, &[("cross_group_bits", "16")]);
    assert_eq!(c.cross_group_bits, Some(16));
    // The gradient codec sets the default across the groups: exact without compression, 8
    // bits with it; an explicit value after the codec stands.
    assert_eq!(
        set(Preset::Sdp4bit, &[("grad_codec", "none")]).cross_group_bits,
        None
    );
    assert_eq!(
        set(Preset::Baseline, &[("grad_codec", "tlq-hs")]).cross_group_bits,
        Some(8)
    );
    let c = set(
        Preset::Sdp4bit,
        &[("grad_codec", "none"), ("cross_group_bits", "16")],
    );
    assert_eq!(c.cross_group_bits, Some(16));
    assert_eq!(KNOBS.len(), 16);
}

#[test]
fn bad_values_are_errors_naming_knob_and_value() {
    let fail = |p: Preset, kv: &[(&str, &str)]| -> String {
        config_err(Config::from_overrides(p, kv.iter().copied()))
    };
    // bits 3
    mentions(
        &fail(Preset::Sdp4bit, &[("weight_bits", "3")]),
        &["weight_bits", "3"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("grad_intra_bits", "3")]),
        &["grad_intra_bits", "3"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("grad_inter_bits", "16")]),
        &["grad_inter_bits", "16"],
    );
    mentions(
        &fail(Preset::GlobalQsgd, &[("global_qsgd_bits", "4")]),
        &["global_qsgd_bits", "4"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("weight_bits", "four")]),
        &["weight_bits", "four"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("weight_bits", "300")]),
        &["weight_bits", "300"],
    );
    // group 100 (not a multiple of 32), 0, too large
    mentions(
        &fail(Preset::Sdp4bit, &[("weight_group_size", "100")]),
        &["weight_group_size", "100"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("grad_group_size", "100")]),
        &["grad_group_size", "100"],
    );
    mentions(
        &fail(Preset::Qsdp, &[("grad_group_size", "0")]),
        &["grad_group_size", "0"],
    );
    mentions(
        &fail(Preset::Qsdp, &[("weight_group_size", "65568")]),
        &["weight_group_size", "65568"],
    );
    mentions(
        &fail(Preset::Qsdp, &[("grad_group_size", "-32")]),
        &["grad_group_size", "-32"],
    );
    // hadamard 48; a block that does not divide the group
    mentions(
        &fail(Preset::Sdp4bit, &[("hadamard_block", "48")]),
        &["hadamard_block", "48"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("hadamard_block", "8")]),
        &["hadamard_block", "8"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("hadamard_block", "512")]),
        &["hadamard_block", "512"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("hadamard_block", "256")]),
        &["grad_group_size=128", "hadamard_block=256"],
    );
    mentions(
        &fail(
            Preset::Sdp4bit,
            &[("grad_group_size", "96"), ("hadamard_block", "64")],
        ),
        &["96", "64"],
    );
    // hadamard with qsdp: the knob does not apply to that codec
    mentions(
        &fail(Preset::Qsdp, &[("hadamard_block", "32")]),
        &["hadamard_block", "qsdp"],
    );
    // pipeline_chunks 0 and too many
    mentions(
        &fail(Preset::Sdp4bit, &[("pipeline_chunks", "0")]),
        &["pipeline_chunks", "0"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("pipeline_chunks", "65")]),
        &["pipeline_chunks", "65"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("pipeline_chunks", "x")]),
        &["pipeline_chunks", "x"],
    );
    // unknown knob
    mentions(
        &fail(Preset::Sdp4bit, &[("bogus_knob", "7")]),
        &["bogus_knob", "7"],
    );
    // bad enum values
    mentions(
        &fail(Preset::Sdp4bit, &[("weight_rounding", "up")]),
        &["weight_rounding", "up"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("grad_codec", "fp8")]),
        &["grad_codec", "fp8"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("exact_params", "biases")]),
        &["exact_params", "biases", "norms-biases-embeddings"],
    );
    mentions(
        &fail(Preset::Sdp4bit, &[("weight_codec", "int2")]),
        &["weight_codec", "int2"],
    );
    mentions(&fail(Preset::Sdp4bit, &[("seed", "-1")]), &["seed", "-1"]);
    mentions(
        &fail(Preset::Sdp4bit, &[("grad_quant_start_step", "soon")]),
        &["grad_quant_start_step", "soon"],
    );
}

#[test]
fn knobs_not_applicable_to_the_codec_are_errors() {
    let cases: [(Preset, &str, &str, &str); 12] = [
        (Preset::Baseline, "weight_bits", "4", "none"),
        (Preset::Baseline, "weight_group_size", "2048", "none"),
        (Preset::Baseline, "weight_rounding", "nearest", "none"),
        (Preset::Baseline, "grad_rounding", "nearest", "none"),
        (Preset::Baseline, "grad_inter_bits", "4", "none"),
        (Preset::Baseline, "global_qsgd_bits", "8", "none"),
        (Preset::Qsdp, "grad_intra_bits", "8", "qsdp"),
        (Preset::Qsdp, "hadamard_block", "32", "qsdp"),
        (Preset::GlobalQsgd, "grad_group_size", "128", "global-qsgd"),
        (Preset::GlobalQsgd, "grad_inter_bits", "8", "global-qsgd"),
        (Preset::GlobalQsgd, "hadamard_block", "32", "global-qsgd"),
        (Preset::Sdp4bit, "global_qsgd_bits", "16", "tlq-hs"),
    ];
    for (p, key, value, codec) in cases {
        let mut c = Config::preset(p);
        let msg = config_err(c.set(key, value));
        mentions(&msg, &[key, codec]);
        assert_eq!(
            c,
            Config::preset(p),
            "a rejected set must not change the config"
        );
    }
}

#[test]
fn validate_rejects_hand_built_invalid_configs() {
    let base = Config::preset(Preset::Sdp4bit);
    let mut c = base;
    c.grad = GradConfig {
        hadamard_block: Some(32),
        ..GradConfig::defaults(GradCodec::Qsdp)
    };
    mentions(&config_err(c.validate()), &["hadamard_block=32", "qsdp"]);
    let mut c = base;
    c.weight.bits = 5;
    mentions(&config_err(c.validate()), &["weight_bits=5"]);
    let mut c = base;
    c.grad.inter_bits = 2;
    mentions(&config_err(c.validate()), &["grad_inter_bits=2"]);
    let mut c = Config::preset(Preset::GlobalQsgd);
    c.grad.global_bits = Some(32);
    mentions(&config_err(c.validate()), &["global_qsgd_bits=32"]);
    let mut c = base;
    c.pipeline_chunks = Some(0);
    mentions(&config_err(c.validate()), &["pipeline_chunks=0"]);
    let mut c = base;
    c.weight.group_size = 2048 + 16;
    mentions(&config_err(c.validate()), &["weight_group_size=2064"]);
    // Error text carries the variant's prefix so users see where it came from.
    let e = Config::from_overrides(Preset::Sdp4bit, [("weight_bits", "3")]).unwrap_err();
    assert!(e.to_string().starts_with("invalid sdp4bit config: "), "{e}");
}

#[test]
fn canonical_form_of_every_preset() {
    let want = [
        (
            Preset::Sdp4bit,
            "sdp4bit-config-v1;weight=qwd(bits=4,group=2048,rounding=stochastic);\
             grad=tlq-hs(intra_bits=8,inter_bits=4,group=128,hadamard=32,rounding=stochastic);\
             chunks=auto;grad_start=0;seed=1234;exact=replicated;cross=8",
        ),
        (
            Preset::Qsdp,
            "sdp4bit-config-v1;weight=qsdp(bits=8,group=1024,rounding=stochastic);\
             grad=qsdp(bits=8,group=1024,rounding=stochastic);chunks=auto;grad_start=0;seed=1234;\
             exact=replicated;cross=8",
        ),
        (
            Preset::GlobalQsgd,
            "sdp4bit-config-v1;weight=none;grad=global-qsgd(bits=auto,rounding=stochastic);\
             chunks=auto;grad_start=0;seed=1234;exact=replicated;cross=8",
        ),
        (
            Preset::Zeropp,
            "sdp4bit-config-v1;weight=zeropp(bits=8,group=2048,rounding=nearest);\
             grad=zeropp(intra_bits=4,inter_bits=4,group=128,hadamard=0,rounding=nearest);\
             chunks=auto;grad_start=0;seed=1234;exact=replicated;cross=8",
        ),
        (
            Preset::Baseline,
            "sdp4bit-config-v1;weight=none;grad=none;chunks=auto;grad_start=0;seed=1234;\
             exact=replicated;cross=exact",
        ),
    ];
    for (p, s) in want {
        let c = Config::preset(p);
        assert_eq!(c.to_string(), s, "canonical form of {p}");
        assert_eq!(
            c.fingerprint(),
            fnv1a64(s.as_bytes()),
            "fingerprint = FNV-1a of Display"
        );
    }
    let c = Config::from_overrides(
        Preset::GlobalQsgd,
        [
            ("global_qsgd_bits", "16"),
            ("seed", "9"),
            ("pipeline_chunks", "2"),
            ("exact_params", "norms_biases_embeddings"),
        ],
    )
    .unwrap();
    assert_eq!(
        c.to_string(),
        "sdp4bit-config-v1;weight=none;grad=global-qsgd(bits=16,rounding=stochastic);\
         chunks=2;grad_start=0;seed=9;exact=norms-biases-embeddings;cross=8"
    );
}

#[test]
fn sdp4bit_fingerprint_is_pinned() {
    // Must never change (see SDP4BIT_FINGERPRINT).
    assert_eq!(
        Config::preset(Preset::Sdp4bit).fingerprint(),
        SDP4BIT_FINGERPRINT,
        "the sdp4bit preset's fingerprint changed: ranks of different builds would disagree"
    );
    assert_eq!(
        fnv1a64(Config::preset(Preset::Sdp4bit).to_string().as_bytes()),
        SDP4BIT_FINGERPRINT
    );
}

/// One alternative value per knob (key, value, preset where it applies).
const CHANGES: [(Preset, &str, &str); 25] = [
    (Preset::Sdp4bit, "weight_codec", "qw"),
    (Preset::Sdp4bit, "weight_bits", "8"),
    (Preset::Sdp4bit, "weight_group_size", "1024"),
    (Preset::Sdp4bit, "weight_rounding", "nearest"),
    (Preset::Sdp4bit, "grad_codec", "tlq"),
    (Preset::Sdp4bit, "grad_intra_bits", "4"),
    (Preset::Sdp4bit, "grad_inter_bits", "8"),
    (Preset::Sdp4bit, "grad_group_size", "256"),
    (Preset::Sdp4bit, "hadamard_block", "64"),
    (Preset::Sdp4bit, "hadamard_block", "0"),
    (Preset::Sdp4bit, "grad_rounding", "nearest"),
    (Preset::GlobalQsgd, "global_qsgd_bits", "8"),
    (Preset::GlobalQsgd, "global_qsgd_bits", "16"),
    (Preset::GlobalQsgd, "grad_rounding", "nearest"),
    (Preset::Qsdp, "grad_inter_bits", "4"),
    (Preset::Qsdp, "grad_group_size", "2048"),
    (Preset::Sdp4bit, "pipeline_chunks", "2"),
    (Preset::Sdp4bit, "grad_quant_start_step", "1"),
    (Preset::Sdp4bit, "seed", "1235"),
    (Preset::Baseline, "seed", "0"),
    (Preset::Sdp4bit, "exact_params", "none"),
    (Preset::Zeropp, "exact_params", "norms-biases-embeddings"),
    (Preset::Sdp4bit, "cross_group_bits", "16"),
    (Preset::Sdp4bit, "cross_group_bits", "exact"),
    (Preset::Baseline, "cross_group_bits", "8"),
];

#[test]
fn fingerprint_changes_with_every_knob() {
    for (p, key, value) in CHANGES {
        let base = Config::preset(p);
        let changed = Config::from_overrides(p, [(key, value)])
            .unwrap_or_else(|e| panic!("{p} {key}={value}: {e}"));
        assert_ne!(changed, base, "{p} {key}={value} changed nothing");
        assert_ne!(changed.to_string(), base.to_string(), "{p} {key}={value}");
        assert_ne!(
            changed.fingerprint(),
            base.fingerprint(),
            "{p}: {key}={value} does not change the fingerprint"
        );
    }
    // Every knob of KNOBS is exercised above.
    for k in KNOBS {
        assert!(
            CHANGES.iter().any(|(_, key, _)| *key == k.name),
            "knob {} not covered",
            k.name
        );
    }
    // Setting a knob to its current value keeps the fingerprint.
    let same = Config::from_overrides(
        Preset::Sdp4bit,
        [("grad_group_size", "128"), ("seed", "1234")],
    )
    .unwrap();
    assert_eq!(same.fingerprint(), SDP4BIT_FINGERPRINT);
}

#[test]
fn fingerprint_equal_iff_configs_equal() {
    // Random override sequences: among all valid configs reached, equal fingerprints (and
    // equal canonical forms) must mean equal configs and vice versa.
    let values: [(&str, &[&str]); 15] = [
        ("weight_codec", &["none", "qwd", "qw", "qsdp", "zeropp"]),
        ("weight_bits", &["4", "8"]),
        ("weight_group_size", &["32", "1024", "2048"]),
        ("weight_rounding", &["stochastic", "nearest"]),
        (
            "grad_codec",
            &["none", "tlq-hs", "tlq", "qsdp", "global-qsgd", "zeropp"],
        ),
        ("grad_intra_bits", &["4", "8"]),
        ("grad_inter_bits", &["4", "8"]),
        ("grad_group_size", &["64", "128", "256"]),
        ("hadamard_block", &["0", "16", "32", "64"]),
        ("grad_rounding", &["stochastic", "nearest"]),
        ("global_qsgd_bits", &["auto", "8", "16"]),
        ("pipeline_chunks", &["auto", "1", "2", "3"]),
        ("grad_quant_start_step", &["0", "5"]),
        ("seed", &["1", "2"]),
        (
            "exact_params",
            &["none", "replicated", "norms-biases-embeddings"],
        ),
    ];
    let mut rng = SplitMix64::new(0xc0f1_0001);
    let mut seen: Vec<Config> = Vec::new();
    for _ in 0..3000 {
        let p = Preset::ALL[rng.below(Preset::ALL.len())];
        let mut c = Config::preset(p);
        for _ in 0..rng.below(8) {
            let (k, vs) = values[rng.below(values.len())];
            let _ = c.set(k, vs[rng.below(vs.len())]);
        }
        if c.validate().is_ok() && !seen.contains(&c) {
            seen.push(c);
        }
    }
    assert!(
        seen.len() > 200,
        "only {} distinct configs generated",
        seen.len()
    );
    for (i, a) in seen.iter().enumerate() {
        for b in &seen[i + 1..] {
            assert_ne!(a.to_string(), b.to_string(), "{a:?} vs {b:?}");
            assert_ne!(a.fingerprint(), b.fingerprint(), "{a} vs {b}");
        }
        // The fingerprint is exactly FNV-1a of the canonical form.
        assert_eq!(a.fingerprint(), fnv1a64(a.to_string().as_bytes()));
    }
}

/// Configs where each knob applies: every preset, plus the two-level codec without Hadamard,
/// TLq-HS with groups of 256 (every Hadamard block divides them) and Global-QSGD with a fixed
/// width.
fn knob_table_configs() -> Vec<Config> {
    let mut configs: Vec<Config> = Preset::ALL.iter().map(|&p| Config::preset(p)).collect();
    configs.push(Config::from_overrides(Preset::Sdp4bit, [("grad_codec", "tlq")]).unwrap());
    configs.push(Config::from_overrides(Preset::Sdp4bit, [("grad_group_size", "256")]).unwrap());
    configs.push(Config::from_overrides(Preset::GlobalQsgd, [("global_qsgd_bits", "16")]).unwrap());
    configs
}

#[test]
fn knob_values_report_every_knob_and_set_them_back() {
    for config in knob_table_configs() {
        let values = config.knob_values();
        let names: Vec<_> = values.iter().map(|(name, _)| *name).collect();
        let table: Vec<_> = KNOBS.iter().map(|k| k.name).collect();
        assert_eq!(names, table, "{config}");
        let mut rebuilt = Config::preset(Preset::Baseline);
        for (name, value) in &values {
            match value {
                Some(value) => rebuilt
                    .set(name, value)
                    .unwrap_or_else(|e| panic!("{config}: {name}={value}: {e}")),
                // A knob reported as not applying is refused by set() as such.
                None => {
                    let mut c = config;
                    let error = config_err(c.set(name, "4"));
                    mentions(&error, &[name, "does not apply"]);
                }
            }
        }
        assert_eq!(
            rebuilt, config,
            "knob_values of {config} do not set it back"
        );
    }
}

#[test]
fn knob_table_values_are_the_ones_set_accepts() {
    use sdp4bit::config::KnobValues;
    for knob in KNOBS {
        let using: Vec<Config> = knob_table_configs()
            .into_iter()
            .filter(|c| {
                c.knob_values()
                    .iter()
                    .any(|(n, v)| *n == knob.name && v.is_some())
            })
            .collect();
        assert!(!using.is_empty(), "no config uses {}", knob.name);
        // Accepted by at least one config the knob applies to.
        let accepts = |value: &str| {
            using.iter().any(|&config| {
                let mut c = config;
                c.set(knob.name, value).is_ok() && c.validate().is_ok()
            })
        };
        match knob.values {
            KnobValues::Names(names) => {
                for name in names {
                    assert!(accepts(name), "{}={name}", knob.name);
                }
                assert!(!accepts("no-such-value"), "{}", knob.name);
            }
            KnobValues::Integers(values) => {
                for v in values {
                    assert!(accepts(&v.to_string()), "{}={v}", knob.name);
                }
                let outside = (0..=values.iter().max().unwrap() + 1)
                    .find(|v| !values.contains(v))
                    .unwrap();
                assert!(!accepts(&outside.to_string()), "{}={outside}", knob.name);
            }
            KnobValues::Range {
                min,
                max,
                multiple_of,
            } => {
                assert!(accepts(&min.to_string()), "{}={min}", knob.name);
                if max < u64::MAX {
                    assert!(accepts(&max.to_string()), "{}={max}", knob.name);
                    assert!(!accepts(&(max + multiple_of).to_string()), "{}", knob.name);
                }
                if min > 0 {
                    assert!(!accepts(&(min - 1).to_string()), "{}", knob.name);
                }
                if multiple_of > 1 {
                    assert!(!accepts(&(min + 1).to_string()), "{}", knob.name);
                }
                assert!(!accepts("-1"), "{}", knob.name);
            }
        }
        assert!(!knob.doc.is_empty());
    }
}
