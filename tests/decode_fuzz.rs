//! Every decode entry point returns `Ok` or `Err` on arbitrary bytes and never panics:
//! `SlabLayout::view` + `SlabView::decode_group`, and the collective-level receive paths
//! `backend::cpu::gradient::{requantize_second, reduce_final}` and
//! `backend::cpu::weight::apply_shards`. Where the bytes have the right length, an oracle
//! written here from docs/numerics.md §1 and §8 predicts exactly which inputs are corrupt (a
//! negative or infinite scale, an infinite offset, or the symmetric code -2^(b-1) that no encoder
//! writes) and what the valid ones decode to.

use half::bf16;
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, RngSeed};
use rayon::prelude::*;
use sdp4bit::backend::cpu::gradient::{quantize_first, reduce_final, requantize_second};
use sdp4bit::backend::cpu::weight::{apply_shards, encode_shard};
use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::layout::{BucketPlan, GradLayout, GradRoute, Topology};
use sdp4bit::rng::UniformStream;
use sdp4bit::{Config, Error, Preset, Rounding};
use sdp4bit_test_support::random::SplitMix64;

fn pt_config() -> PtConfig {
    PtConfig {
        cases: 256,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0xdec0_de00),
        ..PtConfig::default()
    }
}

// ---------------------------------------------------------------------------------------
// Oracle

/// What decoding one group must give.
#[derive(Debug, PartialEq)]
enum Expect {
    /// Corrupt metadata or codes.
    Corrupt,
    /// The dequantized values.
    Values(Vec<f32>),
}

fn read_f32(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// The decode of group `k` (docs/numerics.md §1, §8) of a slab of exactly `layout.byte_len()`
/// bytes.
fn oracle(layout: &SlabLayout, slab: &[u8], k: usize) -> Expect {
    let s = &layout.spec;
    let cb = s.group_size * usize::from(s.bits) / 8;
    let codes_len = layout.groups * cb;
    let scale = read_f32(slab, codes_len + 4 * k);
    let offset = if s.symmetric {
        0.0
    } else {
        read_f32(slab, codes_len + 4 * layout.groups + 4 * k)
    };
    if scale < 0.0 || scale.is_infinite() || offset.is_infinite() {
        return Expect::Corrupt;
    }
    let mut q = Vec::with_capacity(s.group_size);
    for &byte in &slab[k * cb..(k + 1) * cb] {
        match (s.bits, s.symmetric) {
            (4, true) => {
                for nib in [byte & 0xF, byte >> 4] {
                    q.push(if nib >= 8 {
                        i32::from(nib) - 16
                    } else {
                        i32::from(nib)
                    });
                }
            }
            (4, false) => q.extend([i32::from(byte & 0xF), i32::from(byte >> 4)]),
            (_, true) => q.push(i32::from(byte as i8)),
            (_, false) => q.push(i32::from(byte)),
        }
    }
    let min_code = -(1 << (s.bits - 1));
    if s.symmetric && q.contains(&min_code) {
        return Expect::Corrupt;
    }
    Expect::Values(
        q.iter()
            .map(|&c| {
                if s.symmetric {
                    c as f32 * scale
                } else {
                    offset + c as f32 * scale
                }
            })
            .collect(),
    )
}

fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn is_decode_err<T: std::fmt::Debug>(r: &sdp4bit::Result<T>) -> bool {
    matches!(r, Err(Error::Decode(_)))
}

// ---------------------------------------------------------------------------------------
// Byte generation

/// Interesting fp32 values to plant as scales / offsets.
const SPECIAL: [f32; 10] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    -1.0,
    -0.0,
    0.0,
    1e-45,
    f32::MAX,
    -f32::MIN_POSITIVE,
    0.125,
];

/// A valid slab of `layout` (random data quantized with random uniforms), with every group's
/// contents drawn from a few shapes (normal, zeros, NaN) so both metas and codes vary.
fn valid_slab(layout: &SlabLayout, rng: &mut SplitMix64) -> Vec<u8> {
    let g = layout.spec.group_size;
    let mut x: Vec<f32> = (0..layout.elements()).map(|_| rng.grad_like()).collect();
    for k in 0..layout.groups {
        match rng.below(8) {
            0 => x[k * g..(k + 1) * g].fill(0.0),
            1 => x[k * g + rng.below(g)] = f32::NAN,
            _ => {}
        }
    }
    let mut u = vec![0f32; x.len()];
    UniformStream::new(rng.next_u64(), 1, 2).fill(0, &mut u);
    let mut slab = vec![0u8; layout.byte_len()];
    let spec = layout.spec;
    layout
        .par_slots_mut(&mut slab)
        .enumerate()
        .for_each(|(k, mut slot)| {
            slot.quantize(&spec, &x[k * g..(k + 1) * g], &u[k * g..(k + 1) * g])
        });
    slab
}

/// A mutation of a slab: a random byte, a special value planted as a scale or offset, or the
/// forbidden symmetric code planted in the codes.
#[derive(Debug, Clone, Copy)]
enum Mutation {
    Byte {
        at: u32,
        value: u8,
    },
    Meta {
        group: u32,
        offset: bool,
        special: u8,
    },
    MinCode {
        at: u32,
        high_nibble: bool,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<u32>(), any::<u8>()).prop_map(|(at, value)| Mutation::Byte { at, value }),
        (any::<u32>(), any::<bool>(), 0..SPECIAL.len() as u8).prop_map(
            |(group, offset, special)| Mutation::Meta {
                group,
                offset,
                special
            }
        ),
        (any::<u32>(), any::<bool>())
            .prop_map(|(at, high_nibble)| Mutation::MinCode { at, high_nibble }),
    ]
}

fn apply_mutation(layout: &SlabLayout, slab: &mut [u8], m: Mutation) {
    if slab.is_empty() || layout.groups == 0 {
        return;
    }
    let g = layout.groups;
    let codes_len = layout.codes_len();
    match m {
        Mutation::Byte { at, value } => {
            let n = slab.len();
            slab[at as usize % n] = value;
        }
        Mutation::Meta {
            group,
            offset,
            special,
        } => {
            let k = group as usize % g;
            let base = if offset && !layout.spec.symmetric {
                codes_len + 4 * g
            } else {
                codes_len
            };
            slab[base + 4 * k..base + 4 * k + 4]
                .copy_from_slice(&SPECIAL[special as usize].to_le_bytes());
        }
        Mutation::MinCode { at, high_nibble } => {
            let i = at as usize % codes_len;
            if layout.spec.bits == 4 {
                slab[i] = if high_nibble {
                    (slab[i] & 0x0F) | 0x80
                } else {
                    (slab[i] & 0xF0) | 0x08
                };
            } else {
                slab[i] = 0x80;
            }
        }
    }
}

/// How the bytes handed to a decoder are made.
#[derive(Debug, Clone)]
enum Bytes {
    /// Valid slabs with mutations.
    Mutated(Vec<Mutation>),
    /// Exactly the right length, random content.
    Random,
    /// Arbitrary length and content.
    Arbitrary(Vec<u8>),
    /// Valid slabs, then truncated or extended by `delta` bytes (never 0).
    WrongLength(i16),
}

fn bytes_strategy() -> impl Strategy<Value = Bytes> {
    prop_oneof![
        4 => proptest::collection::vec(mutation(), 0..6).prop_map(Bytes::Mutated),
        2 => Just(Bytes::Random),
        1 => proptest::collection::vec(any::<u8>(), 0..3000).prop_map(Bytes::Arbitrary),
        1 => (-64i16..64).prop_filter("nonzero", |d| *d != 0).prop_map(Bytes::WrongLength),
    ]
}

/// `count` slabs of `layout` back to back, made as `how` says; returns the buffer and
/// whether its length is the expected `count * byte_len`.
fn make_buffer(layout: &SlabLayout, count: usize, how: &Bytes, seed: u64) -> (Vec<u8>, bool) {
    let mut rng = SplitMix64::new(seed);
    let len = count * layout.byte_len();
    match how {
        Bytes::Random => (rng.bytes(len), true),
        Bytes::Arbitrary(b) => (b.clone(), b.len() == len),
        Bytes::Mutated(ms) => {
            let mut buf = Vec::with_capacity(len);
            let mut slabs: Vec<Vec<u8>> =
                (0..count).map(|_| valid_slab(layout, &mut rng)).collect();
            for (i, m) in ms.iter().enumerate() {
                if count > 0 {
                    let s = (seed as usize + i) % count;
                    apply_mutation(layout, &mut slabs[s], *m);
                }
            }
            for s in slabs {
                buf.extend_from_slice(&s);
            }
            (buf, true)
        }
        Bytes::WrongLength(delta) => {
            let mut buf: Vec<u8> = (0..count)
                .flat_map(|_| valid_slab(layout, &mut rng))
                .collect();
            let new_len = (len as i64 + i64::from(*delta)).max(0) as usize;
            buf.resize(new_len, 0x5a);
            (buf, new_len == len)
        }
    }
}

// ---------------------------------------------------------------------------------------
// SlabLayout::view + decode_group

fn layout_strategy() -> impl Strategy<Value = SlabLayout> {
    (
        prop_oneof![Just(4u8), Just(8u8)],
        any::<bool>(),
        1usize..=12,
        0usize..=6,
    )
        .prop_map(|(bits, symmetric, g32, groups)| SlabLayout {
            spec: QuantSpec {
                bits,
                group_size: 32 * g32,
                symmetric,
                rounding: Rounding::Stochastic,
            },
            groups,
        })
}

proptest! {
    #![proptest_config(pt_config())]

    #[test]
    fn slab_decode_is_total_and_matches_oracle(
        layout in layout_strategy(),
        how in bytes_strategy(),
        seed in any::<u64>(),
        wrong_layout in any::<bool>(),
    ) {
        let (bytes, right_len) = make_buffer(&layout, 1, &how, seed);
        // Optionally decode with a different codec layout than the bytes were made for.
        let decode_layout = if wrong_layout {
            let mut l = layout;
            l.spec.symmetric = !l.spec.symmetric;
            if seed % 2 == 0 {
                l.spec.bits = 12 - l.spec.bits; // 4 <-> 8
            }
            l
        } else {
            layout
        };
        let right_len = right_len && decode_layout.byte_len() == bytes.len();
        match decode_layout.view(&bytes) {
            Err(e) => {
                prop_assert!(!right_len, "a slab of the right length was rejected: {e}");
                prop_assert!(matches!(e, Error::Decode(_)), "{e:?}");
            }
            Ok(view) => {
                prop_assert!(right_len, "{} bytes accepted for a {}-byte layout", bytes.len(), decode_layout.byte_len());
                let g = decode_layout.spec.group_size;
                for k in 0..decode_layout.groups {
                    let mut out = vec![0f32; g];
                    let r = view.decode_group(k, &mut out, |_, v| v);
                    match oracle(&decode_layout, &bytes, k) {
                        Expect::Corrupt => prop_assert!(is_decode_err(&r), "group {k}: corrupt input gave {r:?}"),
                        Expect::Values(want) => {
                            prop_assert!(r.is_ok(), "group {k}: valid input rejected: {r:?}");
                            for i in 0..g {
                                prop_assert!(same_f32(out[i], want[i]), "group {k} element {i}: {} vs {}", out[i], want[i]);
                            }
                            let meta = view.meta(k).unwrap();
                            prop_assert!(same_f32(meta.scale, read_f32(&bytes, decode_layout.codes_len() + 4 * k)));
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Gradient receive paths

#[derive(Debug, Clone)]
struct GradCase {
    config: Config,
    topology: Topology,
    shard: usize,
}

fn grad_case(two_level_only: bool) -> impl Strategy<Value = GradCase> {
    let codecs = if two_level_only {
        vec!["tlq-hs", "tlq", "zeropp"]
    } else {
        vec!["tlq-hs", "tlq", "zeropp", "qsdp"]
    };
    (
        proptest::sample::select(codecs),
        1usize..=3,
        prop_oneof![Just(32usize), Just(64), Just(96)],
        0usize..7,
        prop_oneof![3 => 1usize..400, 1 => 8000usize..20_000],
    )
        .prop_map(move |(codec, chunks, group, topo, shard)| {
            let chunks = chunks.to_string();
            let group = group.to_string();
            let config = Config::from_overrides(
                Preset::Sdp4bit,
                [
                    ("weight_codec", "none"),
                    ("grad_codec", codec),
                    ("grad_group_size", group.as_str()),
                    ("pipeline_chunks", chunks.as_str()),
                ],
            )
            .expect("valid config");
            let topology = match (two_level_only, topo) {
                (true, t) => Topology::uniform(2 + t % 2, 2 + t / 2 % 2).unwrap(),
                (false, 0) => Topology::uniform(2, 2).unwrap(),
                (false, 1) => Topology::uniform(1, 3).unwrap(),
                (false, 2) => Topology::uniform(3, 1).unwrap(),
                (false, 3) => Topology::from_global_ranks(&[0, 1, 2, 4], 4).unwrap(),
                (false, 4) => Topology::from_global_ranks(&[0, 4, 1, 5, 2, 6], 4).unwrap(),
                (false, 5) => Topology::uniform(3, 2).unwrap(),
                _ => Topology::uniform(2, 1).unwrap(),
            };
            GradCase {
                config,
                topology,
                shard,
            }
        })
}

fn grad_layout(c: &GradCase) -> GradLayout {
    let w = c.topology.world();
    let route = GradRoute::new(&c.config, &c.topology);
    let plan = BucketPlan::new(w * c.shard, w, &c.config).unwrap();
    GradLayout::new(&c.config, &c.topology, &route, plan).expect("W > 1")
}

proptest! {
    #![proptest_config(pt_config())]

    #[test]
    fn requantize_second_is_total(
        case in grad_case(true),
        how in bytes_strategy(),
        seed in any::<u64>(),
        pick in any::<u32>(),
    ) {
        let layout = grad_layout(&case);
        let second = layout.second.expect("two-level topology");
        let first = layout.first;
        let my_x1 = pick as usize % first.peers;
        let p = (pick as usize / 7) % layout.bucket.chunks;
        let (recv, right_len) = make_buffer(&first.slab, first.peers, &how, seed);
        let mut out = vec![0u8; second.peers * second.slab.byte_len()];
        let rng = UniformStream::new(seed, 3, 4);
        let r = requantize_second(&layout, my_x1, p, &recv, &rng, &mut out);
        if right_len {
            // Every group of every received slab is read: corrupt iff any one is.
            let corrupt = recv
                .chunks_exact(first.slab.byte_len())
                .any(|s| (0..first.slab.groups).any(|k| oracle(&first.slab, s, k) == Expect::Corrupt));
            if corrupt {
                prop_assert!(is_decode_err(&r), "corrupt receive buffer gave {r:?}");
            } else {
                prop_assert!(r.is_ok(), "valid receive buffer rejected: {r:?}");
                // The output is a valid second-level send buffer.
                for s in out.chunks_exact(second.slab.byte_len()) {
                    for k in 0..second.slab.groups {
                        prop_assert!(oracle(&second.slab, s, k) != Expect::Corrupt, "requantized group {k} is corrupt");
                    }
                }
            }
        }
    }

    #[test]
    fn reduce_final_is_total_and_sums_in_rank_order(
        case in grad_case(false),
        how in bytes_strategy(),
        seed in any::<u64>(),
        pick in any::<u32>(),
    ) {
        let layout = grad_layout(&case);
        let last = layout.last();
        let plan = layout.bucket;
        let p = pick as usize % plan.chunks;
        let (recv, right_len) = make_buffer(&last.slab, last.peers, &how, seed);
        let mut shard = vec![0f32; plan.shard_len];
        let r = reduce_final(&layout, p, &recv, &mut shard);
        if right_len {
            // Groups covering real elements of chunk p are read; the rest is padding.
            let g = last.slab.spec.group_size;
            let start = (p * plan.chunk_len()).min(plan.shard_len);
            let end = ((p + 1) * plan.chunk_len()).min(plan.shard_len);
            let read = (end - start).div_ceil(g);
            let slabs: Vec<&[u8]> = recv.chunks_exact(last.slab.byte_len()).collect();
            let mut corrupt = false;
            let mut want = vec![0f32; read * g];
            for j in 0..read {
                for (s, slab) in slabs.iter().enumerate() {
                    match oracle(&last.slab, slab, j) {
                        Expect::Corrupt => corrupt = true,
                        Expect::Values(v) => {
                            for i in 0..g {
                                let acc = &mut want[j * g + i];
                                *acc = if s == 0 { v[i] } else { *acc + v[i] };
                            }
                        }
                    }
                }
            }
            if corrupt {
                prop_assert!(is_decode_err(&r), "corrupt receive buffer gave {r:?}");
            } else {
                prop_assert!(r.is_ok(), "valid receive buffer rejected: {r:?}");
                if let Some(block) = layout.hadamard {
                    sdp4bit::hadamard::inverse(&mut want, block);
                }
                for i in start..end {
                    prop_assert!(same_f32(shard[i], want[i - start]), "shard element {i}: {} vs {}", shard[i], want[i - start]);
                }
                prop_assert!(shard[..start].iter().chain(&shard[end..]).all(|&v| v == 0.0), "wrote outside chunk {p}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Weight receive path

#[derive(Debug, Clone)]
struct WeightCase {
    config: Config,
    world: usize,
    shard: usize,
    me: usize,
}

fn weight_case() -> impl Strategy<Value = WeightCase> {
    (
        proptest::sample::select(vec!["qwd", "qw", "qsdp", "zeropp"]),
        prop_oneof![Just(32usize), Just(64), Just(160)],
        any::<bool>(),
        1usize..=4,
        prop_oneof![3 => 1usize..300, 1 => 8000usize..20_000],
        any::<u32>(),
    )
        .prop_map(|(codec, group, four_bits, world, shard, me)| {
            let group = group.to_string();
            let bits = if four_bits { "4" } else { "8" };
            let config = Config::from_overrides(
                Preset::Baseline,
                [
                    ("weight_codec", codec),
                    ("weight_group_size", group.as_str()),
                    ("weight_bits", bits),
                ],
            )
            .expect("valid config");
            WeightCase {
                config,
                world,
                shard,
                me: me as usize % world,
            }
        })
}

fn bf16_vec(rng: &mut SplitMix64, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.gaussian_unpaired() as f32))
        .collect()
}

proptest! {
    #![proptest_config(pt_config())]

    #[test]
    fn apply_shards_is_total_and_matches_oracle(
        case in weight_case(),
        how in bytes_strategy(),
        seed in any::<u64>(),
    ) {
        let c = &case.config;
        let (w, s) = (case.world, case.shard);
        let plan = BucketPlan::new(w * s, w, c).unwrap();
        let spec = QuantSpec::of_weights(&c.weight).unwrap();
        let layout = SlabLayout { spec, groups: plan.padded_shard_len / spec.group_size };
        let encoding = if c.weight.codec == sdp4bit::WeightCodec::Qwd {
            WeightEncoding::Difference
        } else {
            WeightEncoding::Direct
        };
        let mut rng = SplitMix64::new(seed ^ 0x77);
        let own_reference = bf16_vec(&mut rng, s);
        let before = bf16_vec(&mut rng, w * s);
        let mut params = before.clone();
        let (recv, right_len) = make_buffer(&layout, w, &how, seed);
        let r = apply_shards(layout, encoding, &plan, case.me, &recv, &own_reference, &mut params);
        if right_len {
            let g = spec.group_size;
            let read = s.div_ceil(g);
            let mut corrupt = false;
            let mut want = before.clone();
            for (z, slab) in recv.chunks_exact(layout.byte_len()).enumerate() {
                for j in 0..read {
                    match oracle(&layout, slab, j) {
                        Expect::Corrupt => corrupt = true,
                        Expect::Values(v) => {
                            for i in j * g..((j + 1) * g).min(s) {
                                let d = v[i - j * g];
                                want[z * s + i] = match encoding {
                                    WeightEncoding::Direct => bf16::from_f32(d),
                                    WeightEncoding::Difference if z == case.me => {
                                        bf16::from_f32(own_reference[i].to_f32() + d)
                                    }
                                    WeightEncoding::Difference => bf16::from_f32(before[z * s + i].to_f32() + d),
                                };
                            }
                        }
                    }
                }
            }
            if corrupt {
                prop_assert!(is_decode_err(&r), "corrupt receive buffer gave {r:?}");
            } else {
                prop_assert!(r.is_ok(), "valid receive buffer rejected: {r:?}");
                for i in 0..w * s {
                    prop_assert!(
                        params[i].to_bits() == want[i].to_bits() || (params[i].is_nan() && want[i].is_nan()),
                        "param {i}: {} vs {}", params[i], want[i]
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Targeted corruption through every entry point

/// What to plant in an otherwise valid buffer.
#[derive(Debug, Clone, Copy)]
enum Plant {
    Nothing,
    NanScale,
    Scale(f32),
    Offset(f32),
    MinCode,
}

const PLANTS: [Plant; 8] = [
    Plant::Nothing,
    Plant::NanScale,
    Plant::Scale(-1.0),
    Plant::Scale(f32::INFINITY),
    Plant::Scale(f32::NEG_INFINITY),
    Plant::Offset(f32::INFINITY),
    Plant::Offset(f32::NEG_INFINITY),
    Plant::MinCode,
];

/// Plants `what` into group `k` of slab `slab` of `buf`; returns whether the result must be a
/// decode error (`None` when the plant does not apply to this layout).
fn plant(layout: &SlabLayout, buf: &mut [u8], slab: usize, k: usize, what: Plant) -> Option<bool> {
    let base = slab * layout.byte_len();
    let codes_len = layout.codes_len();
    let cb = layout.spec.code_bytes_per_group();
    let scale_at = base + codes_len + 4 * k;
    let offset_at = base + codes_len + 4 * layout.groups + 4 * k;
    match what {
        Plant::Nothing => Some(false),
        Plant::NanScale => {
            buf[scale_at..scale_at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
            if !layout.spec.symmetric {
                buf[offset_at..offset_at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
            }
            buf[base + k * cb..base + (k + 1) * cb].fill(0);
            Some(false) // what the encoder writes for a non-finite group: valid, decodes to NaN
        }
        Plant::Scale(v) => {
            buf[scale_at..scale_at + 4].copy_from_slice(&v.to_le_bytes());
            Some(true)
        }
        Plant::Offset(v) => {
            if layout.spec.symmetric {
                return None;
            }
            buf[offset_at..offset_at + 4].copy_from_slice(&v.to_le_bytes());
            Some(true)
        }
        Plant::MinCode => {
            if !layout.spec.symmetric {
                return None;
            }
            let i = base + k * cb + cb / 2;
            buf[i] = if layout.spec.bits == 4 {
                (buf[i] & 0xF0) | 0x08
            } else {
                0x80
            };
            Some(true)
        }
    }
}

#[test]
fn planted_corruption_is_rejected_by_every_entry_point() {
    let mut rng = SplitMix64::new(0xbad_5eed);
    let mut checked = [0usize; 2]; // [accepted, rejected] cases, to prove both paths ran
    for codec in ["tlq-hs", "zeropp", "qsdp"] {
        let config = Config::from_overrides(
            Preset::Sdp4bit,
            [
                ("weight_codec", "none"),
                ("grad_codec", codec),
                ("pipeline_chunks", "2"),
            ],
        )
        .unwrap();
        let topology = Topology::uniform(2, 2).unwrap();
        let case = GradCase {
            config,
            topology: topology.clone(),
            shard: 300,
        };
        let layout = grad_layout(&case);
        let plan = layout.bucket;
        // Real first-level send buffers of all 4 ranks, then the receive buffer of rank 0.
        let buckets: Vec<Vec<f32>> = (0..4)
            .map(|_| rng.vec_f32(4 * 300, |r| r.grad_like()))
            .collect();
        let first = layout.first;
        let sends: Vec<Vec<u8>> = buckets
            .iter()
            .enumerate()
            .map(|(z, b)| {
                let mut out = vec![0u8; plan.chunks * first.peers * first.slab.byte_len()];
                quantize_first(&layout, b, &UniformStream::new(1, 1, z as u32), &mut out);
                out
            })
            .collect();
        let slab_len = first.slab.byte_len();
        let me = 0usize;
        // Chunk 0 (for a one-level route, reduce_final reads only the groups of chunk 0 that
        // cover real elements; requantize_second reads every group).
        let p = 0usize;
        let read = match layout.second {
            Some(_) => first.slab.groups,
            None => plan
                .chunk_len()
                .min(plan.shard_len)
                .div_ceil(first.slab.spec.group_size),
        };
        let ranks: Vec<usize> = (0..first.peers)
            .map(|x1| match first.level {
                sdp4bit::layout::Level::Intra => topology.rank_at(0, x1),
                sdp4bit::layout::Level::World => x1,
                sdp4bit::layout::Level::Inter => topology.rank_at(x1, 0),
            })
            .collect();
        let recv_first: Vec<u8> = ranks
            .iter()
            .flat_map(|&src| {
                let slab = p * first.peers + me;
                sends[src][slab * slab_len..(slab + 1) * slab_len].to_vec()
            })
            .collect();

        for what in PLANTS {
            for (slab, k) in [(0usize, 0usize), (first.peers - 1, read - 1)] {
                let mut buf = recv_first.clone();
                let Some(bad) = plant(&first.slab, &mut buf, slab, k, what) else {
                    continue;
                };
                let r = match layout.second {
                    Some(second) => {
                        let mut out = vec![0u8; second.peers * second.slab.byte_len()];
                        requantize_second(
                            &layout,
                            0,
                            p,
                            &buf,
                            &UniformStream::new(2, 2, 2),
                            &mut out,
                        )
                    }
                    None => {
                        let mut shard = vec![0f32; plan.shard_len];
                        reduce_final(&layout, p, &buf, &mut shard)
                    }
                };
                assert_eq!(
                    is_decode_err(&r),
                    bad,
                    "{codec}: {what:?} in slab {slab} group {k}: {r:?}"
                );
                assert!(bad || r.is_ok(), "{codec}: {what:?}: {r:?}");
                checked[usize::from(bad)] += 1;
            }
        }
        // The last level too (for two-level codecs, a valid requantized buffer).
        let last = layout.last();
        let recv_last: Vec<u8> = (0..last.peers)
            .flat_map(|_| valid_slab(&last.slab, &mut rng))
            .collect();
        for what in PLANTS {
            let mut buf = recv_last.clone();
            let Some(bad) = plant(&last.slab, &mut buf, last.peers - 1, 0, what) else {
                continue;
            };
            let mut shard = vec![0f32; plan.shard_len];
            let r = reduce_final(&layout, 0, &buf, &mut shard);
            assert_eq!(
                is_decode_err(&r),
                bad,
                "{codec} reduce_final: {what:?}: {r:?}"
            );
            assert!(bad || r.is_ok());
            if matches!(what, Plant::NanScale) {
                let block = layout.hadamard.unwrap_or(1);
                assert!(
                    shard[..block].iter().all(|v| v.is_nan()),
                    "NaN group must reach the shard"
                );
            }
            checked[usize::from(bad)] += 1;
        }
    }

    // Weights: real encoded shards of every rank.
    for codec in ["qwd", "qw", "qsdp", "zeropp"] {
        let config = Config::from_overrides(Preset::Baseline, [("weight_codec", codec)]).unwrap();
        let (w, s) = (3usize, 5000usize);
        let plan = BucketPlan::new(w * s, w, &config).unwrap();
        let spec = QuantSpec::of_weights(&config.weight).unwrap();
        let layout = SlabLayout {
            spec,
            groups: plan.padded_shard_len / spec.group_size,
        };
        let encoding = if codec == "qwd" {
            WeightEncoding::Difference
        } else {
            WeightEncoding::Direct
        };
        let params = bf16_vec(&mut rng, w * s);
        let newer = bf16_vec(&mut rng, w * s);
        let mut recv = vec![0u8; w * layout.byte_len()];
        for (z, out) in recv.chunks_exact_mut(layout.byte_len()).enumerate() {
            let shard = &newer[z * s..(z + 1) * s];
            let reference = &params[z * s..(z + 1) * s];
            encode_shard(
                layout,
                encoding,
                plan.padded_index(z, 0),
                shard,
                reference,
                &UniformStream::new(3, 3, z as u32),
                out,
            );
        }
        let own_reference = params[..s].to_vec();
        for what in PLANTS {
            for (slab, k) in [(0usize, 0usize), (w - 1, s.div_ceil(spec.group_size) - 1)] {
                let mut buf = recv.clone();
                let Some(bad) = plant(&layout, &mut buf, slab, k, what) else {
                    continue;
                };
                let mut out = params.clone();
                let r = apply_shards(layout, encoding, &plan, 0, &buf, &own_reference, &mut out);
                assert_eq!(
                    is_decode_err(&r),
                    bad,
                    "{codec} apply_shards: {what:?} in slab {slab} group {k}: {r:?}"
                );
                assert!(bad || r.is_ok());
                checked[usize::from(bad)] += 1;
            }
        }
    }
    assert!(
        checked[0] >= 20 && checked[1] >= 40,
        "too few cases exercised: {checked:?}"
    );
}

#[test]
fn wrong_length_receive_buffers_are_rejected() {
    // A receive buffer that is not exactly `peers * slab_len` bytes cannot have come from the
    // matching all-to-all / all-gather; it must be a decode error naming the sizes, never a
    // silent partial decode (which would leave stale or uninitialised values in the output).
    let mut failures = Vec::new();
    let case = GradCase {
        config: Config::from_overrides(Preset::Sdp4bit, [("weight_codec", "none")]).unwrap(),
        topology: Topology::uniform(2, 2).unwrap(),
        shard: 256,
    };
    let layout = grad_layout(&case);
    let first = layout.first;
    let second = layout.second.unwrap();
    let mut rng = SplitMix64::new(0x1e57);
    let full_first: Vec<u8> = (0..first.peers)
        .flat_map(|_| valid_slab(&first.slab, &mut rng))
        .collect();
    let full_last: Vec<u8> = (0..second.peers)
        .flat_map(|_| valid_slab(&second.slab, &mut rng))
        .collect();
    for delta in [
        -(first.slab.byte_len() as i64),
        -16,
        -1,
        1,
        16,
        first.slab.byte_len() as i64,
    ] {
        let len = (full_first.len() as i64 + delta) as usize;
        let mut recv = full_first.clone();
        recv.resize(len, 0);
        let mut out = vec![0u8; second.peers * second.slab.byte_len()];
        let r = requantize_second(&layout, 0, 0, &recv, &UniformStream::new(1, 1, 1), &mut out);
        if !is_decode_err(&r) {
            failures.push(format!(
                "requantize_second with {len} of {} bytes: {r:?}",
                full_first.len()
            ));
        }
    }
    for delta in [
        -(second.slab.byte_len() as i64),
        -1,
        1,
        second.slab.byte_len() as i64,
    ] {
        let len = (full_last.len() as i64 + delta) as usize;
        let mut recv = full_last.clone();
        recv.resize(len, 0);
        let mut shard = vec![0f32; 256];
        let r = reduce_final(&layout, 0, &recv, &mut shard);
        if !is_decode_err(&r) {
            failures.push(format!(
                "reduce_final with {len} of {} bytes: {r:?}",
                full_last.len()
            ));
        }
    }
    let config = Config::preset(Preset::Sdp4bit);
    let plan = BucketPlan::new(3 * 100, 3, &config).unwrap();
    let spec = QuantSpec::of_weights(&config.weight).unwrap();
    let wl = SlabLayout {
        spec,
        groups: plan.padded_shard_len / spec.group_size,
    };
    let full: Vec<u8> = (0..3).flat_map(|_| valid_slab(&wl, &mut rng)).collect();
    for delta in [-(wl.byte_len() as i64), -1, 1, wl.byte_len() as i64] {
        let len = (full.len() as i64 + delta) as usize;
        let mut recv = full.clone();
        recv.resize(len, 0);
        let reference = vec![bf16::ZERO; 100];
        let mut params = vec![bf16::ONE; 300];
        let r = apply_shards(
            wl,
            WeightEncoding::Difference,
            &plan,
            0,
            &recv,
            &reference,
            &mut params,
        );
        if !is_decode_err(&r) {
            failures.push(format!(
                "apply_shards with {len} of {} bytes: {r:?}",
                full.len()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "wrong-length receive buffers accepted:\n{}",
        failures.join("\n")
    );
}
