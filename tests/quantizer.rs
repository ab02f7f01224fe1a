//! The group quantizer of docs/numerics.md §1 (`codec::quant`) and the slab layout on the wire
//! (`codec::slab`), against a reference written here from that page and error bounds derived
//! from the fp32 operation order.

use rayon::prelude::*;
use sdp4bit::Error;
use sdp4bit::Rounding;
use sdp4bit::codec::quant::{GroupMeta, QuantSpec, dequantize_group, quantize_group};
use sdp4bit::codec::slab::{SLAB_ALIGN, SlabLayout};
use sdp4bit::rng::UniformStream;
use sdp4bit_test_support::random::SplitMix64;
use sdp4bit_test_support::reference::EPS;

fn spec(bits: u8, group_size: usize, symmetric: bool, rounding: Rounding) -> QuantSpec {
    QuantSpec {
        bits,
        group_size,
        symmetric,
        rounding,
    }
}

/// Every (bits, symmetric, rounding) combination.
fn all_specs(group_size: usize) -> Vec<QuantSpec> {
    let mut v = Vec::new();
    for bits in [4u8, 8] {
        for symmetric in [true, false] {
            for rounding in [Rounding::Stochastic, Rounding::Nearest] {
                v.push(spec(bits, group_size, symmetric, rounding));
            }
        }
    }
    v
}

fn uniforms(seed: u64, step: u64, n: usize) -> Vec<f32> {
    let mut u = vec![0f32; n];
    UniformStream::new(seed, step, 77).fill(0, &mut u);
    u
}

/// Largest code magnitude of docs/numerics.md §1.1 and §1.2, written independently:
/// `L = 2^(b-1) - 1` symmetric, `N = 2^b - 1` asymmetric.
fn levels(s: &QuantSpec) -> i32 {
    if s.symmetric {
        (1 << (s.bits - 1)) - 1
    } else {
        (1 << s.bits) - 1
    }
}

/// Unpacks codes as docs/numerics.md §1.6 lays them out: 4-bit two's complement (or unsigned,
/// asymmetric) nibbles with element 2k in the low nibble; 8-bit int8 (uint8 asymmetric).
fn unpack(s: &QuantSpec, codes: &[u8]) -> Vec<i32> {
    let mut out = Vec::with_capacity(s.group_size);
    for &byte in codes {
        if s.bits == 4 {
            for nib in [byte & 0xF, byte >> 4] {
                out.push(if s.symmetric && nib >= 8 {
                    i32::from(nib) - 16
                } else {
                    i32::from(nib)
                });
            }
        } else if s.symmetric {
            out.push(i32::from(byte as i8));
        } else {
            out.push(i32::from(byte));
        }
    }
    out
}

/// docs/numerics.md §1 written out with the same fp32 operation order (no FMA): returns (scale,
/// offset, codes). This is the bit-exact reference of what the codec must produce.
fn reference_quantize(s: &QuantSpec, x: &[f32], u: &[f32]) -> (f32, f32, Vec<i32>) {
    let n = levels(s);
    let zeros = vec![0; x.len()];
    if x.iter().any(|v| !v.is_finite()) {
        return (f32::NAN, f32::NAN, zeros);
    }
    let (scale, offset, lo_code, hi_code) = if s.symmetric {
        let a = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        (a / n as f32, 0f32, -n, n)
    } else {
        // -0 canonicalised to +0 (docs/numerics.md §1.2).
        let lo = x.iter().copied().fold(f32::INFINITY, f32::min) + 0.0;
        let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) + 0.0;
        let scale = (hi - lo) / n as f32;
        if !scale.is_finite() {
            return (f32::NAN, f32::NAN, zeros);
        }
        (scale, lo, 0, n)
    };
    if scale == 0.0 {
        return (scale, offset, zeros);
    }
    let codes = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let t = (v - offset) / scale;
            let r = match s.rounding {
                Rounding::Stochastic => (t + u[i]).floor(),
                Rounding::Nearest => t.round_ties_even(),
            };
            (r as i32).clamp(lo_code, hi_code)
        })
        .collect();
    (scale, offset, codes)
}

fn quantize(s: &QuantSpec, x: &[f32], u: &[f32]) -> (GroupMeta, Vec<u8>) {
    let mut codes = vec![0xA5u8; s.code_bytes_per_group()];
    let meta = quantize_group(s, x, u, &mut codes);
    (meta, codes)
}

fn dequantize(s: &QuantSpec, codes: &[u8], meta: GroupMeta) -> (Vec<f32>, bool) {
    let mut out = vec![f32::NAN; s.group_size];
    let ok = dequantize_group(s, codes, meta, &mut out, |_, v| v);
    (out, ok)
}

/// fp32 rounding slack of element `i` on top of `error_bound` (exact arithmetic), derived
/// from the operation order (u = 2^-24, every op rounds to nearest with relative error <= u):
///
/// Symmetric: a = max|x| exact; s = fl(a/L); t = fl(x/s) = (x/s)(1+d1) so |t s - x| <= u |x|;
/// the code q satisfies |q - t| <= 1 (SR: floor(fl(t + r)) is floor(t) or floor(t) + 1, since
/// fl is monotone, floor(t) is representable and t + r < floor(t) + 2 - ulp) or <= 1/2 (RN),
/// and clamping only acts when |t| exceeds L by at most 2uL < 1/2; x' = fl(q s) is off from
/// q s by <= u |q s| <= u |x'| / (1 - u). So |x' - x| <= bound + u (|x| + |x'|).
///
/// Asymmetric: lo, hi exact; s = fl(fl(hi - lo)/N); t = fl(fl(x - lo)/s), so
/// |t s - (x - lo)| <= (2u + u^2)(x - lo); m = fl(q s) is off by <= u q s <= u N s;
/// x' = fl(lo + m) is off by <= u |lo + m| <= u |x'| / (1 - u).
/// So |x' - x| <= bound + u (2 (x - lo) + N s + |x'|).
///
/// The factor (1 + 2^-20) absorbs the second-order terms (u^2 relative) and the f64
/// evaluation of the comparison itself.
fn fp32_slack(s: &QuantSpec, x: &[f32], i: usize, meta: GroupMeta, x_hat: f32) -> f64 {
    let xi = f64::from(x[i]);
    let x_hat = f64::from(x_hat.abs());
    let core = if s.symmetric {
        xi.abs() + x_hat
    } else {
        let lo = f64::from(x.iter().copied().fold(f32::INFINITY, f32::min));
        2.0 * (xi - lo) + f64::from(levels(s)) * f64::from(meta.scale) + x_hat
    };
    EPS * core * (1.0 + 2f64.powi(-20))
}

/// Random group contents covering: gradient-like values, a constant offset (so asymmetric
/// differs from symmetric), all positive, all negative, and heavy outliers.
fn random_group(rng: &mut SplitMix64, g: usize) -> Vec<f32> {
    match rng.below(5) {
        0 => rng.vec_f32(g, |r| r.grad_like()),
        1 => {
            let c = rng.range_f32(-10.0, 10.0);
            rng.vec_f32(g, |r| c + r.gaussian_unpaired() as f32 * 0.01)
        }
        2 => rng.vec_f32(g, |r| r.range_f32(0.5, 3.0)),
        3 => rng.vec_f32(g, |r| r.range_f32(-3e5, -1e3)),
        _ => {
            let mut v = rng.vec_f32(g, |r| r.gaussian_unpaired() as f32);
            let k = rng.below(g);
            v[k] = 1e4 * if rng.below(2) == 0 { 1.0 } else { -1.0 };
            v
        }
    }
}

#[test]
fn codes_and_scales_match_an_independent_reference_bit_for_bit() {
    let mut rng = SplitMix64::new(0x0a17_0001);
    for g in [32usize, 96, 128, 1024, 2048] {
        for s in all_specs(g) {
            for trial in 0..24 {
                let x = random_group(&mut rng, g);
                let u = uniforms(rng.next_u64(), trial, g);
                let (meta, codes) = quantize(&s, &x, &u);
                let (want_scale, want_offset, want_codes) = reference_quantize(&s, &x, &u);
                let ctx = format!("{s:?} trial {trial}");
                assert_eq!(meta.scale.to_bits(), want_scale.to_bits(), "scale, {ctx}");
                if s.symmetric {
                    assert_eq!(meta.offset, 0.0, "symmetric offset must be 0, {ctx}");
                } else {
                    assert_eq!(
                        meta.offset.to_bits(),
                        want_offset.to_bits(),
                        "offset = min, {ctx}"
                    );
                }
                assert_eq!(unpack(&s, &codes), want_codes, "codes, {ctx}");

                // Dequantization is x' = q * s (symmetric) or lo + q * s (asymmetric) in fp32.
                let (out, ok) = dequantize(&s, &codes, meta);
                assert!(ok, "valid codes rejected, {ctx}");
                for (i, (&o, &q)) in out.iter().zip(&want_codes).enumerate() {
                    let want = if s.symmetric {
                        q as f32 * meta.scale
                    } else {
                        meta.offset + q as f32 * meta.scale
                    };
                    assert_eq!(
                        o.to_bits(),
                        want.to_bits(),
                        "dequantized element {i}, {ctx}"
                    );
                }
            }
        }
    }
}

#[test]
fn scale_definitions() {
    // docs/numerics.md §1.1, §1.2: symmetric s = absmax / L with L = 7 (4-bit) or 127 (8-bit);
    // asymmetric s = (hi - lo) / (2^b - 1) with lo stored as the offset.
    let mut rng = SplitMix64::new(0x0a17_0002);
    for _ in 0..200 {
        let g = 32 * (1 + rng.below(8));
        let x = rng.vec_f32(g, |r| r.grad_like());
        let a = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        // -0 canonicalised to +0 (docs/numerics.md §1.2).
        let lo = x.iter().copied().fold(f32::INFINITY, f32::min) + 0.0;
        let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) + 0.0;
        let u = uniforms(3, 0, g);
        for (bits, l, n) in [(4u8, 7f32, 15f32), (8, 127.0, 255.0)] {
            let (m, _) = quantize(&spec(bits, g, true, Rounding::Stochastic), &x, &u);
            assert_eq!(m.scale, a / l, "symmetric {bits}-bit scale");
            let (m, _) = quantize(&spec(bits, g, false, Rounding::Stochastic), &x, &u);
            assert_eq!(m.scale, (hi - lo) / n, "asymmetric {bits}-bit scale");
            assert_eq!(m.offset, lo, "asymmetric offset must be the group minimum");
        }
    }
    for s in all_specs(32) {
        assert_eq!(s.max_code(), levels(&s), "{s:?}");
        assert_eq!(s.code_bytes_per_group(), 32 * usize::from(s.bits) / 8);
        assert_eq!(s.meta_words(), if s.symmetric { 1 } else { 2 });
    }
}

#[test]
fn per_element_error_within_derived_bound() {
    let mut rng = SplitMix64::new(0x0a17_0003);
    for g in [32usize, 160, 2048] {
        for s in all_specs(g) {
            let mut worst = 0f64; // largest err / error_bound seen, to show the bound is tight
            for trial in 0..40 {
                let x = random_group(&mut rng, g);
                let u = uniforms(rng.next_u64(), trial, g);
                let (meta, codes) = quantize(&s, &x, &u);
                let (out, ok) = dequantize(&s, &codes, meta);
                assert!(ok);
                let bound = f64::from(s.error_bound(meta));
                assert_eq!(
                    bound,
                    f64::from(meta.scale)
                        * if s.rounding == Rounding::Stochastic {
                            1.0
                        } else {
                            0.5
                        },
                    "error_bound must be one step (SR) or half a step (RN)"
                );
                for i in 0..g {
                    let err = (f64::from(out[i]) - f64::from(x[i])).abs();
                    let slack = fp32_slack(&s, &x, i, meta, out[i]);
                    assert!(
                        err <= bound + slack,
                        "{s:?} trial {trial} element {i}: x = {:e}, x' = {:e}, |err| = {err:e} > \
                         bound {bound:e} + fp32 slack {slack:e} (scale {:e}, offset {:e})",
                        x[i],
                        out[i],
                        meta.scale,
                        meta.offset
                    );
                    if bound > 0.0 {
                        worst = worst.max(err / bound);
                    }
                }
            }
            // The bound is attained up to sampling: errors reach most of it somewhere.
            assert!(
                worst > 0.9,
                "{s:?}: worst err/bound {worst}, bound not tight?"
            );
        }
    }
}

#[test]
fn zero_and_constant_groups() {
    for s in all_specs(64) {
        let u = uniforms(1, 2, 64);
        let (meta, codes) = quantize(&s, &[0.0; 64], &u);
        assert_eq!(meta.scale, 0.0, "{s:?}: zero group scale");
        assert_eq!(meta.offset, 0.0, "{s:?}: zero group offset");
        assert!(
            codes.iter().all(|&c| c == 0),
            "{s:?}: zero group codes {codes:?}"
        );
        let (out, ok) = dequantize(&s, &codes, meta);
        assert!(
            ok && out.iter().all(|&v| v == 0.0),
            "{s:?}: zero group decodes to {out:?}"
        );

        // -0.0 is a zero too.
        let (meta, codes) = quantize(&s, &[-0.0; 64], &u);
        assert_eq!(meta.scale, 0.0);
        assert!(codes.iter().all(|&c| c == 0));

        // A constant group: asymmetric stores scale 0 and offset = the constant (exact);
        // symmetric has a nonzero scale and the constant is exactly L * s within rounding.
        let c = -3.25f32;
        let (meta, codes) = quantize(&s, &[c; 64], &u);
        let (out, _) = dequantize(&s, &codes, meta);
        if s.symmetric {
            assert_eq!(meta.scale, 3.25 / levels(&s) as f32);
            assert!(
                unpack(&s, &codes).iter().all(|&q| q == -levels(&s)),
                "{s:?}"
            );
        } else {
            assert_eq!((meta.scale, meta.offset), (0.0, c), "{s:?}");
            assert!(codes.iter().all(|&b| b == 0));
            assert!(
                out.iter().all(|&v| v == c),
                "{s:?}: constant group decodes to {out:?}"
            );
        }
    }
    // An absmax so small that a / L underflows to 0: scale 0 and zero codes (documented).
    let tiny = f32::from_bits(1); // smallest subnormal
    let s = spec(4, 32, true, Rounding::Nearest);
    let mut x = [0f32; 32];
    x[3] = tiny;
    let (meta, codes) = quantize(&s, &x, &[]);
    assert_eq!(tiny / 7.0, 0.0, "premise: the scale underflows");
    assert_eq!(meta.scale, 0.0);
    assert!(codes.iter().all(|&c| c == 0));
}

#[test]
fn nibble_order_and_twos_complement_on_hand_built_groups() {
    // 4-bit symmetric, RN, absmax 7 so s = 1 exactly and codes equal the inputs.
    let mut x = [0f32; 32];
    x[..6].copy_from_slice(&[1.0, -2.0, 7.0, -7.0, 0.0, 3.0]);
    x[31] = -1.0;
    let s = spec(4, 32, true, Rounding::Nearest);
    let (meta, codes) = quantize(&s, &x, &[]);
    assert_eq!(meta.scale, 1.0);
    // element 2k in the low nibble, 2k+1 in the high nibble, two's complement:
    // (1, -2) -> 0xE1; (7, -7) -> 0x97; (0, 3) -> 0x30; (0, -1) -> 0xF0.
    assert_eq!(
        &codes[..3],
        &[0xE1, 0x97, 0x30],
        "nibble order / two's complement"
    );
    assert_eq!(
        codes[15], 0xF0,
        "last byte: element 30 low (0), element 31 high (-1 = 0xF)"
    );
    assert!(codes[3..15].iter().all(|&b| b == 0));
    let (out, ok) = dequantize(&s, &codes, meta);
    assert!(ok);
    assert_eq!(&out[..], &x[..]);

    // 4-bit asymmetric: unsigned nibbles, lo = 0, hi = 15 so s = 1.
    let mut x = [0f32; 32];
    x[..4].copy_from_slice(&[0.0, 15.0, 3.0, 12.0]);
    let s = spec(4, 32, false, Rounding::Nearest);
    let (meta, codes) = quantize(&s, &x, &[]);
    assert_eq!((meta.scale, meta.offset), (1.0, 0.0));
    assert_eq!(&codes[..2], &[0xF0, 0xC3]);
    let (out, _) = dequantize(&s, &codes, meta);
    assert_eq!(&out[..], &x[..]);

    // 8-bit symmetric: int8 two's complement, absmax 127 so s = 1.
    let mut x = [0f32; 32];
    x[..4].copy_from_slice(&[-5.0, 127.0, -127.0, 1.0]);
    let s = spec(8, 32, true, Rounding::Nearest);
    let (meta, codes) = quantize(&s, &x, &[]);
    assert_eq!(meta.scale, 1.0);
    assert_eq!(&codes[..4], &[0xFB, 0x7F, 0x81, 0x01]);
    let (out, _) = dequantize(&s, &codes, meta);
    assert_eq!(&out[..], &x[..]);

    // 8-bit asymmetric: uint8, lo = -10, hi = 245 so s = 1 and q = x + 10.
    let mut x = [-10f32; 32];
    x[..3].copy_from_slice(&[245.0, 0.0, 118.0]);
    let s = spec(8, 32, false, Rounding::Nearest);
    let (meta, codes) = quantize(&s, &x, &[]);
    assert_eq!((meta.scale, meta.offset), (1.0, -10.0));
    assert_eq!(&codes[..4], &[255, 10, 128, 0]);
    let (out, _) = dequantize(&s, &codes, meta);
    assert_eq!(&out[..], &x[..]);
}

#[test]
fn nearest_rounding_is_round_half_even() {
    // s = 1 exactly (absmax 7, 4-bit symmetric), so x / s = x and the ties are exact.
    let cases: [(f32, i32); 12] = [
        (0.5, 0),
        (1.5, 2),
        (2.5, 2),
        (3.5, 4),
        (-0.5, 0),
        (-1.5, -2),
        (-2.5, -2),
        (-3.5, -4),
        (0.49999997, 0),
        (0.50000006, 1),
        (6.5, 6),
        (-6.5, -6),
    ];
    let s = spec(4, 32, true, Rounding::Nearest);
    let mut x = [0f32; 32];
    x[31] = 7.0;
    for (i, &(v, _)) in cases.iter().enumerate() {
        x[i] = v;
    }
    let (meta, codes) = quantize(&s, &x, &[]);
    assert_eq!(meta.scale, 1.0);
    let q = unpack(&s, &codes);
    for (i, &(v, want)) in cases.iter().enumerate() {
        assert_eq!(q[i], want, "RN({v}) must round half to even");
    }
    // Same on the asymmetric 8-bit grid: lo = 0, hi = 255, (x - lo) / s = x.
    let s = spec(8, 32, false, Rounding::Nearest);
    let mut x = [0f32; 32];
    x[31] = 255.0;
    let ties = [(0.5f32, 0), (1.5, 2), (2.5, 2), (253.5, 254), (254.5, 254)];
    for (i, &(v, _)) in ties.iter().enumerate() {
        x[i] = v;
    }
    let (meta, codes) = quantize(&s, &x, &[]);
    assert_eq!((meta.scale, meta.offset), (1.0, 0.0));
    let q = unpack(&s, &codes);
    for (i, &(v, want)) in ties.iter().enumerate() {
        assert_eq!(q[i], want, "asymmetric RN({v})");
    }
}

#[test]
fn stochastic_rounding_is_floor_of_v_plus_u() {
    // s = 1 (absmax 7): q = floor(x + u) exactly, for hand-picked (x, u) pairs including
    // u = 0 and the largest uniform 1 - 2^-24.
    let s = spec(4, 32, true, Rounding::Stochastic);
    let top = 1.0 - 2f32.powi(-24);
    let cases: [(f32, f32, i32); 9] = [
        (0.25, 0.0, 0),
        (0.25, 0.74, 0),
        (0.25, 0.75, 1),
        (-0.25, 0.0, -1),
        (-0.25, 0.25, 0),
        // v + u is an fp32 addition (docs/numerics.md §1.4 fixes the float ops): 2 + (1 - 2^-24)
        // rounds to 3 (ulp 2^-22 on [2, 4)), so the code is 3, not floor of the exact sum.
        (2.0, top, 3),
        (0.0, top, 0),
        (6.9, top, 7),
        (-7.0, 0.0, -7),
    ];
    let mut x = [0f32; 32];
    let mut u = [0f32; 32];
    x[31] = 7.0;
    for (i, &(v, r, _)) in cases.iter().enumerate() {
        x[i] = v;
        u[i] = r;
    }
    let (meta, codes) = quantize(&s, &x, &u);
    assert_eq!(meta.scale, 1.0);
    let q = unpack(&s, &codes);
    for (i, &(v, r, want)) in cases.iter().enumerate() {
        assert_eq!(q[i], want, "SR({v}, u = {r}) = floor(v + u)");
    }
}

#[test]
fn non_finite_groups_decode_to_nan() {
    let mut rng = SplitMix64::new(0x0a17_0004);
    for s in all_specs(96) {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
            for _ in 0..4 {
                let mut x = rng.vec_f32(96, |r| r.gaussian_unpaired() as f32);
                let at = rng.below(96);
                x[at] = bad;
                let u = uniforms(5, 6, 96);
                let (meta, codes) = quantize(&s, &x, &u);
                assert!(
                    meta.scale.is_nan(),
                    "{s:?}, {bad} at {at}: scale {}",
                    meta.scale
                );
                if !s.symmetric {
                    assert!(
                        meta.offset.is_nan(),
                        "{s:?}: asymmetric offset must be NaN too"
                    );
                }
                assert!(
                    codes.iter().all(|&c| c == 0),
                    "{s:?}: a non-finite group must not store finite codes"
                );
                let (out, ok) = dequantize(&s, &codes, meta);
                assert!(ok);
                assert!(
                    out.iter().all(|v| v.is_nan()),
                    "{s:?}: {bad} at {at} must make the whole group NaN, got {out:?}"
                );
            }
        }
    }
    // An asymmetric range that overflows fp32 (hi - lo = inf) is treated as non-finite.
    for bits in [4u8, 8] {
        let s = spec(bits, 32, false, Rounding::Nearest);
        let mut x = [0f32; 32];
        x[0] = -3e38;
        x[1] = 3e38;
        let (meta, _) = quantize(&s, &x, &[]);
        assert!(meta.scale.is_nan() && meta.offset.is_nan(), "{meta:?}");
    }
}

#[test]
fn finite_extremes_never_decode_to_inf() {
    // A finite group must decode either to finite values within the derived bound, or (like
    // an asymmetric range that overflows, documented in codec::quant) to an all-NaN group
    // flagged by a NaN scale. A lone +-Inf from a finite input is neither: it is not within
    // any error bound and, unlike NaN, does not mark the whole group.
    let m = f32::MAX;
    let below = f32::from_bits(m.to_bits() - 1);
    let groups: [[f32; 2]; 6] = [
        [m, -m],
        [m, 0.0],
        [below, -below],
        [m / 2.0, -m / 2.0],
        [-m, 1.0],
        [1e38, -2e38],
    ];
    let mut failures = Vec::new();
    for s in all_specs(32) {
        for pair in groups {
            let mut x = [0f32; 32];
            x[..2].copy_from_slice(&pair);
            let u = uniforms(9, 9, 32);
            let (meta, codes) = quantize(&s, &x, &u);
            let (out, ok) = dequantize(&s, &codes, meta);
            assert!(ok);
            if meta.scale.is_nan() {
                assert!(
                    out.iter().all(|v| v.is_nan()),
                    "{s:?} {pair:?}: NaN scale, non-NaN output"
                );
                continue;
            }
            for (i, (&o, &v)) in out.iter().zip(&x).enumerate() {
                let err = (f64::from(o) - f64::from(v)).abs();
                let bound = f64::from(s.error_bound(meta)) + fp32_slack(&s, &x, i, meta, o);
                if !o.is_finite() || err > bound {
                    failures.push(format!(
                        "{s:?} group {pair:?}: element {i} = {v:e} decodes to {o:e} (scale {:e})",
                        meta.scale
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "finite inputs decoded out of bounds:\n{}",
        failures.join("\n")
    );
}

#[test]
fn dequantize_combine_accumulates() {
    let mut rng = SplitMix64::new(0x0a17_0005);
    for s in all_specs(64) {
        let x = rng.vec_f32(64, |r| r.grad_like());
        let u = uniforms(1, 1, 64);
        let (meta, codes) = quantize(&s, &x, &u);
        let (plain, _) = dequantize(&s, &codes, meta);
        let init = rng.vec_f32(64, |r| r.gaussian_unpaired() as f32);
        let mut acc = init.clone();
        assert!(dequantize_group(&s, &codes, meta, &mut acc, |a, v| a + v));
        for i in 0..64 {
            assert_eq!(
                acc[i].to_bits(),
                (init[i] + plain[i]).to_bits(),
                "{s:?} element {i}"
            );
        }
    }
}

#[test]
fn dequantize_flags_the_code_no_symmetric_encoder_writes() {
    for bits in [4u8, 8] {
        let s = spec(bits, 32, true, Rounding::Nearest);
        let meta = GroupMeta {
            scale: 1.0,
            offset: 0.0,
        };
        let n = s.code_bytes_per_group();
        for pos in 0..n {
            for (byte, valid) in if bits == 4 {
                vec![
                    (0x08u8, false),
                    (0x80, false),
                    (0x77, true),
                    (0x99, true),
                    (0x88, false),
                ]
            } else {
                vec![(0x80u8, false), (0x81, true), (0x7F, true)]
            } {
                let mut codes = vec![0u8; n];
                codes[pos] = byte;
                let (_, ok) = dequantize(&s, &codes, meta);
                assert_eq!(ok, valid, "{bits}-bit byte {byte:#04x} at {pos}");
            }
        }
        // Asymmetric codes use the full unsigned range: every byte is valid.
        let s = spec(bits, 32, false, Rounding::Nearest);
        let codes = vec![0xFFu8; s.code_bytes_per_group()];
        let (out, ok) = dequantize(&s, &codes, meta);
        assert!(ok);
        assert!(out.iter().all(|&v| v == levels(&s) as f32));
    }
}

/// Outcome of the unbiasedness check: `Ok` or the first violation found.
///
/// For a fixed group `x` (so a fixed scale s), quantize it `trials` times with independent
/// uniforms (UniformStream with steps 0..trials) and compare the mean of each x'_i with x_i.
///
/// Threshold: every x'_i takes one of two adjacent grid values, so it lies in an interval of
/// width s_eff = s (1 + 2^-20) (grid step after fp32 rounding). By Hoeffding, the mean of n
/// independent draws deviates from its expectation by t or more with probability
/// <= 2 exp(-2 n t^2 / s_eff^2); with t = 3 s_eff / sqrt(n) that is 2 e^-18 = 3.0e-8 per
/// element, the equivalent of a 6-sigma normal bound (sigma <= s/2). Over all elements tested
/// in this file (~3000) a correct quantizer fails with probability < 1e-4 (and the seed is
/// fixed). The expectation itself may differ from x_i deterministically by
/// det_i = s (N + 2) 2^-24 (u is a multiple of 2^-24 and fl(t + u) shifts the rounding
/// threshold by at most half an ulp of N + 1) plus the fp32 slack of [`fp32_slack`].
///
/// The signed mean of (x'_i - x_i) / s over all elements and trials is checked the same way
/// with n * g draws (each normalised to a unit interval): t = 3 / sqrt(n g). This catches a
/// small bias common to all elements that the per-element test cannot see.
fn check_unbiased(
    s: &QuantSpec,
    x: &[f32],
    trials: u64,
    seed: u64,
    quantize_with: impl Fn(&[f32], &[f32], &mut [u8]) -> GroupMeta,
) -> Result<(), String> {
    let g = x.len();
    let mut sum = vec![0f64; g];
    let mut meta0 = None;
    let mut u = vec![0f32; g];
    let mut codes = vec![0u8; s.code_bytes_per_group()];
    let mut out = vec![0f32; g];
    let mut max_abs_out = vec![0f32; g];
    for t in 0..trials {
        UniformStream::new(seed, t, 5).fill(0, &mut u);
        let meta = quantize_with(x, &u, &mut codes);
        // The scale depends only on x: the same in every trial.
        assert_eq!(
            *meta0.get_or_insert(meta),
            meta,
            "scale changed between trials"
        );
        assert!(dequantize_group(s, &codes, meta, &mut out, |_, v| v));
        for i in 0..g {
            sum[i] += f64::from(out[i]);
            max_abs_out[i] = max_abs_out[i].max(out[i].abs());
        }
    }
    let meta = meta0.expect("at least one trial");
    let step = f64::from(meta.scale);
    let s_eff = step * (1.0 + 2f64.powi(-20));
    let n = trials as f64;
    let nlev = f64::from(levels(s));
    let mut signed = 0f64;
    let mut det_sum = 0f64;
    for i in 0..g {
        let mean = sum[i] / n;
        let dev = mean - f64::from(x[i]);
        let det = step * (nlev + 2.0) * EPS + fp32_slack(s, x, i, meta, max_abs_out[i]);
        let thr = 3.0 * s_eff / n.sqrt() + det;
        if dev.abs() > thr {
            return Err(format!(
                "element {i}: x = {:e}, mean of {trials} draws = {mean:e}, bias {:.4} steps > \
                 threshold {:.4} steps",
                x[i],
                dev / step,
                thr / step
            ));
        }
        signed += dev / step;
        det_sum += det / step;
    }
    let avg = signed / g as f64;
    // Hoeffding over the n * g independent normalised draws, plus the mean deterministic bias.
    let thr_all = 3.0 * (1.0 + 2f64.powi(-20)) / (n * g as f64).sqrt() + det_sum / g as f64;
    if avg.abs() > thr_all {
        return Err(format!(
            "mean signed bias over the group {avg:.5} steps > threshold {thr_all:.5} steps"
        ));
    }
    Ok(())
}

/// Random data for the bias test: grad-like values in a group of moderate spread, so most
/// elements have fractional code positions (where rounding bias would show).
fn bias_group(rng: &mut SplitMix64, g: usize) -> Vec<f32> {
    rng.vec_f32(g, |r| r.gaussian_unpaired() as f32 + 0.3)
}

const TRIALS: u64 = 4096;

#[test]
fn stochastic_rounding_is_unbiased() {
    let mut rng = SplitMix64::new(0x0a17_0006);
    for bits in [4u8, 8] {
        for symmetric in [true, false] {
            let s = spec(bits, 352, symmetric, Rounding::Stochastic); // 11 * 32: odd group
            let x = bias_group(&mut rng, s.group_size);
            let result = check_unbiased(&s, &x, TRIALS, 0xb1a5 + u64::from(bits), |x, u, c| {
                quantize_group(&s, x, u, c)
            });
            assert!(
                result.is_ok(),
                "SR {bits}-bit symmetric={symmetric}: {}",
                result.unwrap_err()
            );
        }
    }
}

#[test]
fn unbiasedness_check_has_power() {
    let mut rng = SplitMix64::new(0x0a17_0007);
    for bits in [4u8, 8] {
        for symmetric in [true, false] {
            let sr = spec(bits, 352, symmetric, Rounding::Stochastic);
            let rn = spec(bits, 352, symmetric, Rounding::Nearest);

            // 1. Round-to-nearest on a value where it is biased: absmax L (s = 1) and an element
            //    at 0.3 (RN always gives 0: bias -0.3 steps, threshold ~0.047 steps).
            let mut x = vec![0f32; 352];
            x[0] = levels(&sr) as f32;
            x[1] = 0.3;
            let result =
                check_unbiased(&rn, &x, TRIALS, 1, |x, _, c| quantize_group(&rn, x, &[], c));
            let msg = result.expect_err("RN on 0.3 steps must fail the unbiasedness check");
            assert!(msg.contains("element 1"), "{msg}");
            // ... while SR on the very same group passes.
            check_unbiased(&sr, &x, TRIALS, 1, |x, u, c| quantize_group(&sr, x, u, c))
                .unwrap_or_else(|e| panic!("SR on the RN counterexample: {e}"));

            // 2. RN on random data fails too.
            let x = bias_group(&mut rng, 352);
            assert!(
                check_unbiased(&rn, &x, TRIALS, 2, |x, _, c| quantize_group(&rn, x, &[], c))
                    .is_err(),
                "RN on random data passed the unbiasedness check: no power"
            );

            // 3. A subtly biased SR (uniforms shifted by +0.02, i.e. rounding up 2% too often)
            //    must fail through the aggregate statistic: bias ~0.02 steps vs threshold
            //    3 / sqrt(4096 * 352) = 0.0025 steps.
            let result = check_unbiased(&sr, &x, TRIALS, 3, |x, u, c| {
                let shifted: Vec<f32> = u
                    .iter()
                    .map(|&v| (v + 0.02).min(1.0 - 2f32.powi(-24)))
                    .collect();
                quantize_group(&sr, x, &shifted, c)
            });
            let msg = result.expect_err("SR with a +0.02 shift passed: the check has no power");
            assert!(
                msg.contains("mean signed bias"),
                "expected the aggregate statistic to catch the shift: {msg}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Slab layout

/// The slab layout of docs/numerics.md §6, written independently: `[codes][scales][offsets]`,
/// padded to 16.
fn expected_byte_len(s: &QuantSpec, groups: usize) -> usize {
    let codes = groups * s.group_size * usize::from(s.bits) / 8;
    let meta = groups * 4 * if s.symmetric { 1 } else { 2 };
    (codes + meta).div_ceil(16) * 16
}

#[test]
fn slab_byte_len() {
    assert_eq!(SLAB_ALIGN, 16);
    let cases = [
        // (bits, g, symmetric, groups, bytes)
        (4u8, 32usize, true, 1usize, 32usize), // 16 codes + 4 scale = 20 -> 32
        (4, 32, false, 1, 32),                 // 16 + 8 = 24 -> 32
        (4, 32, true, 3, 64),                  // 48 + 12 = 60 -> 64
        (8, 32, false, 3, 128),                // 96 + 24 = 120 -> 128
        (4, 2048, true, 1, 1040),              // 1024 + 4 -> 1040
        (8, 128, true, 4, 528),                // 512 + 16 = 528
        (8, 1024, false, 5, 5168),             // 5120 + 40 = 5160 -> 5168
        (4, 128, true, 0, 0),
    ];
    for (bits, g, symmetric, groups, bytes) in cases {
        let l = SlabLayout {
            spec: spec(bits, g, symmetric, Rounding::Stochastic),
            groups,
        };
        assert_eq!(l.byte_len(), bytes, "{l:?}");
        assert_eq!(l.codes_len(), groups * g * usize::from(bits) / 8, "{l:?}");
        assert_eq!(l.elements(), groups * g);
    }
    for bits in [4u8, 8] {
        for symmetric in [true, false] {
            for g in (32..=512).step_by(32) {
                for groups in 0..40 {
                    let s = spec(bits, g, symmetric, Rounding::Nearest);
                    let l = SlabLayout { spec: s, groups };
                    assert_eq!(l.byte_len(), expected_byte_len(&s, groups), "{l:?}");
                    assert_eq!(l.byte_len() % 16, 0);
                    assert_eq!(l.codes_len() % 16, 0, "metadata must start 16-aligned");
                }
            }
        }
    }
}

#[test]
fn slab_round_trip_through_slots_and_view() {
    let mut rng = SplitMix64::new(0x0a17_0008);
    for g in [32usize, 96, 160, 2048] {
        for s in all_specs(g) {
            for groups in [0usize, 1, 2, 5, 7] {
                let layout = SlabLayout { spec: s, groups };
                let x: Vec<f32> = (0..groups)
                    .flat_map(|_| random_group(&mut rng, g))
                    .collect();
                let mut u = vec![0f32; x.len()];
                UniformStream::new(rng.next_u64(), 3, 9).fill(0, &mut u);
                // Pre-fill with junk: the padding must come out zeroed.
                let mut slab = vec![0xAAu8; layout.byte_len()];
                layout
                    .par_slots_mut(&mut slab)
                    .enumerate()
                    .for_each(|(k, mut slot)| {
                        slot.quantize(&s, &x[k * g..(k + 1) * g], &u[k * g..(k + 1) * g]);
                    });

                // Byte positions: codes of group k, then all scales, then all offsets (LE).
                let cb = s.code_bytes_per_group();
                let codes_len = groups * cb;
                let meta_end = codes_len + 4 * groups * s.meta_words();
                let mut metas = Vec::new();
                for k in 0..groups {
                    let (meta, codes) =
                        quantize(&s, &x[k * g..(k + 1) * g], &u[k * g..(k + 1) * g]);
                    assert_eq!(
                        &slab[k * cb..(k + 1) * cb],
                        &codes[..],
                        "{layout:?} group {k}"
                    );
                    let at = codes_len + 4 * k;
                    assert_eq!(&slab[at..at + 4], &meta.scale.to_le_bytes(), "scale {k}");
                    if !s.symmetric {
                        let at = codes_len + 4 * groups + 4 * k;
                        assert_eq!(&slab[at..at + 4], &meta.offset.to_le_bytes(), "offset {k}");
                    }
                    metas.push(meta);
                }
                assert!(
                    slab[meta_end..].iter().all(|&b| b == 0),
                    "{layout:?}: padding not zeroed"
                );

                let view = layout.view(&slab).expect("a slab of the right length");
                assert_eq!(view.layout(), layout);
                for (k, meta) in metas.iter().enumerate() {
                    assert_eq!(view.meta(k).unwrap(), *meta);
                    assert_eq!(view.codes(k), &slab[k * cb..(k + 1) * cb]);
                    let mut out = vec![0f32; g];
                    view.decode_group(k, &mut out, |_, v| v).unwrap();
                    let (want, _) = dequantize(&s, view.codes(k), *meta);
                    assert_eq!(out, want, "{layout:?} group {k}");
                }

                // A slab of any other length is a decode error naming both lengths.
                for wrong in [
                    layout.byte_len() + 1,
                    layout.byte_len() + 16,
                    layout.byte_len().saturating_sub(1),
                    layout.byte_len().saturating_sub(16),
                ] {
                    if wrong == layout.byte_len() {
                        continue;
                    }
                    let bytes = vec![0u8; wrong];
                    match layout.view(&bytes) {
                        Err(Error::Decode(msg)) => assert!(
                            msg.contains(&wrong.to_string())
                                && msg.contains(&layout.byte_len().to_string()),
                            "{msg}"
                        ),
                        other => panic!("{layout:?}: {wrong} bytes accepted: {other:?}"),
                    }
                }
            }
        }
    }
}

#[test]
fn slab_runs_write_the_same_bytes_as_slots() {
    // par_runs_mut (runs of consecutive groups, the last one shorter) must produce exactly the
    // bytes par_slots_mut produces, for every run length, and cover every group once.
    let mut rng = SplitMix64::new(0x0a17_0009);
    for g in [32usize, 96, 2048] {
        for s in all_specs(g) {
            for groups in [0usize, 1, 2, 5, 7] {
                let layout = SlabLayout { spec: s, groups };
                let x: Vec<f32> = (0..groups)
                    .flat_map(|_| random_group(&mut rng, g))
                    .collect();
                let mut u = vec![0f32; x.len()];
                UniformStream::new(rng.next_u64(), 4, 1).fill(0, &mut u);
                let mut by_slots = vec![0x3Cu8; layout.byte_len()];
                layout
                    .par_slots_mut(&mut by_slots)
                    .enumerate()
                    .for_each(|(k, mut slot)| {
                        slot.quantize(&s, &x[k * g..(k + 1) * g], &u[k * g..(k + 1) * g]);
                    });
                for run in [1usize, 2, 3, groups.max(1), groups + 5] {
                    let mut by_runs = vec![0xC3u8; layout.byte_len()];
                    let mut seen: Vec<(usize, usize)> = layout
                        .par_runs_mut(&mut by_runs, run)
                        .map(|mut r| {
                            let (first, len) = (r.first, r.len());
                            for i in 0..len {
                                let k = first + i;
                                r.quantize(i, &s, &x[k * g..(k + 1) * g], &u[k * g..(k + 1) * g]);
                            }
                            (first, len)
                        })
                        .collect();
                    seen.sort_unstable();
                    let mut next = 0;
                    for &(first, len) in &seen {
                        assert_eq!(first, next, "{layout:?} run {run}: runs {seen:?}");
                        assert!(len >= 1 && len <= run, "{layout:?} run {run}: {seen:?}");
                        next += len;
                    }
                    assert_eq!(next, groups, "{layout:?} run {run}: runs {seen:?}");
                    assert_eq!(by_runs, by_slots, "{layout:?} run length {run}");
                }
            }
        }
    }
}

#[test]
fn slot_set_meta_writes_scale_and_offset() {
    let s = spec(8, 32, false, Rounding::Nearest);
    let layout = SlabLayout { spec: s, groups: 2 };
    let mut slab = vec![0u8; layout.byte_len()];
    let metas = [
        GroupMeta {
            scale: 0.5,
            offset: -1.25,
        },
        GroupMeta {
            scale: 3.0,
            offset: 7.0,
        },
    ];
    layout
        .par_slots_mut(&mut slab)
        .enumerate()
        .for_each(|(k, mut slot)| slot.set_meta(metas[k]));
    let view = layout.view(&slab).unwrap();
    assert_eq!(view.meta(0).unwrap(), metas[0]);
    assert_eq!(view.meta(1).unwrap(), metas[1]);
    assert_eq!(&slab[64..68], &0.5f32.to_le_bytes());
    assert_eq!(&slab[72..76], &(-1.25f32).to_le_bytes());
}

#[test]
fn asymmetric_offset_of_signed_zeros_is_positive_zero() {
    // min/max of a group holding both -0 and +0 may return either zero depending on the order
    // of evaluation; the quantizer canonicalises to +0 so every build (and the GPU) stores the
    // same offset bits.
    for rounding in [Rounding::Nearest, Rounding::Stochastic] {
        let s = spec(4, 32, false, rounding);
        let u = uniforms(5, 0, 32);
        for (first, second) in [(-0.0f32, 0.0f32), (0.0, -0.0)] {
            let mut x: Vec<f32> = (0..32).map(|i| i as f32).collect();
            x[0] = first;
            x[17] = second;
            let (meta, _) = quantize(&s, &x, &u);
            assert_eq!(
                meta.offset.to_bits(),
                0.0f32.to_bits(),
                "offset {:?}",
                meta.offset
            );
            let mut y: Vec<f32> = (0..32).map(|i| -(i as f32)).collect();
            y[0] = first;
            y[17] = second;
            let (meta, _) = quantize(&s, &y, &u);
            assert_eq!(meta.offset, -31.0);
            assert_eq!(meta.scale.to_bits(), (31.0f32 / 15.0).to_bits());
        }
    }
}
