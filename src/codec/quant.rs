//! The group quantizer `Q(b, g, mode, rounding)` of SPEC §1, one group at a time.
//!
//! Order of floating-point operations (fixed, so CPU and GPU agree bit for bit; no fused
//! multiply-add anywhere):
//! - symmetric: `a = max|x|`, `s = a / L`, `q = clamp(R(x / s), -L, L)`, `x' = q * s`;
//! - asymmetric: `s = (hi - lo) / (2^b - 1)`, `q = clamp(R((x - lo) / s), 0, 2^b - 1)`,
//!   `x' = lo + q * s`;
//! - `R(v)` is `floor(v + u)` (stochastic) or round-half-even (nearest).
//!
//! Special groups: a group holding NaN or ±Inf stores scale NaN (and offset NaN) with zero
//! codes, so it dequantizes to NaN everywhere and nowhere else. A group whose scale is zero
//! (all zeros, a constant asymmetric group, or an absmax so tiny that `a / L` underflows)
//! stores scale 0 and zero codes. An asymmetric group whose range `hi - lo` overflows fp32 is
//! treated as non-finite (NaN), so it still trips the caller's found-inf check.

use crate::config::Rounding;

/// Parameters of one group quantizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    /// Bits per code: 4 or 8.
    pub bits: u8,
    /// Elements per group (a multiple of 32).
    pub group_size: usize,
    /// Symmetric absmax (true) or asymmetric min-max (false).
    pub symmetric: bool,
    /// Stochastic or nearest rounding.
    pub rounding: Rounding,
}

/// Scale and offset of one quantized group (offset is 0 for symmetric groups).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupMeta {
    /// Step between adjacent codes; NaN marks a non-finite group.
    pub scale: f32,
    /// Value of code 0 for asymmetric groups.
    pub offset: f32,
}

impl QuantSpec {
    /// Largest code: `L = 2^(b-1) - 1` symmetric, `2^b - 1` asymmetric.
    pub fn max_code(&self) -> i32 {
        if self.symmetric {
            (1 << (self.bits - 1)) - 1
        } else {
            (1 << self.bits) - 1
        }
    }

    /// Bytes of codes one group occupies.
    pub fn code_bytes_per_group(&self) -> usize {
        self.group_size * usize::from(self.bits) / 8
    }

    /// fp32 metadata words per group: the scale, plus the offset when asymmetric.
    pub fn meta_words(&self) -> usize {
        if self.symmetric { 1 } else { 2 }
    }

    /// Upper bound on `|x' - x|` for an element of a group quantized with `meta`: one code step
    /// for stochastic rounding, half a step for nearest (exact arithmetic; fp32 rounding of
    /// the dequantization adds at most one ulp of the result).
    pub fn error_bound(&self, meta: GroupMeta) -> f32 {
        match self.rounding {
            Rounding::Stochastic => meta.scale,
            Rounding::Nearest => meta.scale * 0.5,
        }
    }
}

/// Largest `|x|` of a group by integer max over the magnitude bits (vectorises); values of
/// `0x7f80_0000` and above mean the group holds an Inf or NaN.
#[inline(always)]
pub fn abs_bits_max(x: &[f32]) -> u32 {
    x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff))
}

/// Whether `abs_bits_max` flags a non-finite value.
#[inline(always)]
pub fn bits_non_finite(abs_bits: u32) -> bool {
    abs_bits >= 0x7f80_0000
}

/// Quantizes one group. `x` and `codes` hold exactly one group; `u` holds its uniforms
/// (ignored, and may be empty, for nearest rounding).
#[inline]
pub fn quantize_group(spec: &QuantSpec, x: &[f32], u: &[f32], codes: &mut [u8]) -> GroupMeta {
    debug_assert_eq!(x.len(), spec.group_size);
    debug_assert_eq!(codes.len(), spec.code_bytes_per_group());
    let (meta, ok) = if spec.symmetric {
        symmetric_meta(spec, x)
    } else {
        asymmetric_meta(spec, x)
    };
    if !ok {
        codes.fill(0);
        return meta;
    }
    let (lo_code, hi_code) = if spec.symmetric {
        (-spec.max_code() as f32, spec.max_code() as f32)
    } else {
        (0.0, spec.max_code() as f32)
    };
    let (scale, offset) = (meta.scale, meta.offset);
    let scaled = move |v: f32| (v - offset) / scale;
    match (spec.rounding, spec.bits) {
        (Rounding::Stochastic, 4) => pack_nibbles(codes, x, u, |v, r| {
            (scaled(v) + r).floor().clamp(lo_code, hi_code)
        }),
        (Rounding::Stochastic, _) => pack_bytes(codes, x, u, |v, r| {
            (scaled(v) + r).floor().clamp(lo_code, hi_code)
        }),
        (Rounding::Nearest, 4) => pack_nibbles(codes, x, x, |v, _| {
            scaled(v).round_ties_even().clamp(lo_code, hi_code)
        }),
        (Rounding::Nearest, _) => pack_bytes(codes, x, x, |v, _| {
            scaled(v).round_ties_even().clamp(lo_code, hi_code)
        }),
    }
    meta
}

/// Scale of a symmetric group; `false` when the codes must all be zero.
#[inline(always)]
fn symmetric_meta(spec: &QuantSpec, x: &[f32]) -> (GroupMeta, bool) {
    let bits = abs_bits_max(x);
    if bits_non_finite(bits) {
        return (non_finite_meta(), false);
    }
    let scale = f32::from_bits(bits) / spec.max_code() as f32;
    let meta = GroupMeta { scale, offset: 0.0 };
    (meta, scale != 0.0)
}

/// Offset and scale of an asymmetric group; `false` when the codes must all be zero.
#[inline(always)]
fn asymmetric_meta(spec: &QuantSpec, x: &[f32]) -> (GroupMeta, bool) {
    if bits_non_finite(abs_bits_max(x)) {
        return (non_finite_meta(), false);
    }
    let (lo, hi) = x
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    let scale = (hi - lo) / spec.max_code() as f32;
    if !scale.is_finite() {
        return (non_finite_meta(), false);
    }
    (GroupMeta { scale, offset: lo }, scale != 0.0)
}

fn non_finite_meta() -> GroupMeta {
    GroupMeta {
        scale: f32::NAN,
        offset: f32::NAN,
    }
}

#[inline(always)]
fn pack_nibbles(codes: &mut [u8], x: &[f32], u: &[f32], code: impl Fn(f32, f32) -> f32) {
    for ((byte, v), r) in codes
        .iter_mut()
        .zip(x.chunks_exact(2))
        .zip(u.chunks_exact(2))
    {
        let lo = code(v[0], r[0]) as i32;
        let hi = code(v[1], r[1]) as i32;
        *byte = ((lo & 0xF) | ((hi & 0xF) << 4)) as u8;
    }
}

#[inline(always)]
fn pack_bytes(codes: &mut [u8], x: &[f32], u: &[f32], code: impl Fn(f32, f32) -> f32) {
    for ((byte, &v), &r) in codes.iter_mut().zip(x).zip(u) {
        *byte = code(v, r) as i32 as u8;
    }
}

/// Decodes one group, combining each dequantized value `x'` into `out` as
/// `out[i] = combine(out[i], x')` (overwrite or accumulate in rank order).
///
/// Returns `false` if a code lies outside the codec's range (only possible for corrupt
/// input: `-2^(b-1)` is never produced by the symmetric quantizer).
#[inline(always)]
pub fn dequantize_group(
    spec: &QuantSpec,
    codes: &[u8],
    meta: GroupMeta,
    out: &mut [f32],
    combine: impl Fn(f32, f32) -> f32,
) -> bool {
    debug_assert_eq!(out.len(), spec.group_size);
    debug_assert_eq!(codes.len(), spec.code_bytes_per_group());
    let (scale, offset) = (meta.scale, meta.offset);
    let value = move |q: i32| (q as f32) * scale;
    let mut min_code = 0i32;
    match (spec.symmetric, spec.bits) {
        (true, 4) => {
            for (pair, &byte) in out.chunks_exact_mut(2).zip(codes) {
                let lo = i32::from(((byte << 4) as i8) >> 4);
                let hi = i32::from((byte as i8) >> 4);
                min_code = min_code.min(lo).min(hi);
                pair[0] = combine(pair[0], value(lo));
                pair[1] = combine(pair[1], value(hi));
            }
        }
        (true, _) => {
            for (o, &byte) in out.iter_mut().zip(codes) {
                let q = i32::from(byte as i8);
                min_code = min_code.min(q);
                *o = combine(*o, value(q));
            }
        }
        (false, 4) => {
            for (pair, &byte) in out.chunks_exact_mut(2).zip(codes) {
                pair[0] = combine(pair[0], offset + value(i32::from(byte & 0xF)));
                pair[1] = combine(pair[1], offset + value(i32::from(byte >> 4)));
            }
        }
        (false, _) => {
            for (o, &byte) in out.iter_mut().zip(codes) {
                *o = combine(*o, offset + value(i32::from(byte)));
            }
        }
    }
    !spec.symmetric || min_code >= -spec.max_code()
}
