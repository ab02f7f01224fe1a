//! The group quantizer `Q(b, g, mode, rounding)` of docs/numerics.md §1, one group at a time.
//!
//! Order of floating-point operations (fixed, so CPU and GPU agree bit for bit; no fused
//! multiply-add anywhere):
//! - symmetric: `a = max|x|`, `s = a / L`, `q = clamp(R(x / s), -L, L)`, `x' = q * s`;
//! - asymmetric: `lo`, `hi` with -0 canonicalised to +0, `s = (hi - lo) / (2^b - 1)`, `q = clamp(R((x - lo) / s), 0, 2^b - 1)`,
//!   `x' = lo + q * s`;
//! - `R(v)` is `floor(v + u)` (stochastic) or round-half-even (nearest).
//!
//! Special groups: a group holding NaN or ±Inf stores scale NaN (and offset NaN) with zero
//! codes, so it dequantizes to NaN everywhere and nowhere else. A group whose scale is zero
//! (all zeros, a constant asymmetric group, or an absmax so tiny that `a / L` underflows)
//! stores scale 0 and zero codes. A group whose codes could dequantize past fp32's range (an
//! asymmetric range `hi - lo` that overflows, or a symmetric `L * s` that rounds to Inf) is
//! treated as non-finite (NaN), so it still trips the caller's found-inf check.

use crate::config::{GradCodec, GradConfig, Rounding, WeightCodec, WeightConfig};

#[cfg(target_arch = "x86_64")]
mod avx512;

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
    /// The quantizer of a weight codec, `None` for the uncompressed codec.
    pub fn of_weights(weight: &WeightConfig) -> Option<Self> {
        weight.codec.compresses().then_some(Self {
            bits: weight.bits,
            group_size: weight.group_size,
            symmetric: weight.codec != WeightCodec::Qsdp,
            rounding: weight.rounding,
        })
    }

    /// The quantizer of a gradient codec's level running at `bits`.
    pub fn of_grads(grad: &GradConfig, bits: u8) -> Self {
        Self {
            bits,
            group_size: grad.group_size,
            symmetric: grad.codec != GradCodec::Qsdp,
            rounding: grad.rounding,
        }
    }

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
///
/// Runs on AVX-512 when the CPU has it (detected at run time), otherwise on the portable loops
/// (AVX2 in the default x86-64-v3 build); both write the same bytes.
#[inline]
pub fn quantize_group(spec: &QuantSpec, x: &[f32], u: &[f32], codes: &mut [u8]) -> GroupMeta {
    debug_assert_eq!(x.len(), spec.group_size);
    debug_assert_eq!(codes.len(), spec.code_bytes_per_group());
    #[cfg(target_arch = "x86_64")]
    if avx512::detected() {
        return avx512::quantize_group(spec, x, u, codes);
    }
    quantize_group_portable(spec, x, u, codes)
}

/// [`quantize_group`] without the AVX-512 path.
#[inline]
pub(crate) fn quantize_group_portable(
    spec: &QuantSpec,
    x: &[f32],
    u: &[f32],
    codes: &mut [u8],
) -> GroupMeta {
    let (meta, ok) = group_meta(spec, x);
    if ok {
        portable_codes(spec, meta.scale, meta.offset, x, u, codes);
    } else {
        codes.fill(0);
    }
    meta
}

/// The group's scale (and offset); `false` when its codes must all be zero.
#[inline(always)]
fn group_meta(spec: &QuantSpec, x: &[f32]) -> (GroupMeta, bool) {
    if spec.symmetric {
        symmetric_meta(spec, x)
    } else {
        asymmetric_meta(spec, x)
    }
}

/// The codes of a group that has a positive finite `scale` (and `offset`), on any CPU.
#[inline(always)]
fn portable_codes(
    spec: &QuantSpec,
    scale: f32,
    offset: f32,
    x: &[f32],
    u: &[f32],
    codes: &mut [u8],
) {
    let top = spec.max_code() as f32;
    // Symmetric groups skip `x - 0.0`, which is exactly `x` for every finite `x` (-0.0 too).
    // Codes are clamped floats turned into their two's complement bits; round-to-nearest codes
    // of a finite group with a positive finite scale cannot be NaN.
    let sr = |v: f32, r: f32, lo: f32| code_bits((v / scale + r).floor().clamp(lo, top));
    let rn = |v: f32, lo: f32| finite_code_bits((v / scale).round_ties_even().clamp(lo, top));
    match (spec.symmetric, spec.rounding, spec.bits) {
        (true, Rounding::Stochastic, 4) => pack_nibbles(codes, x, u, |v, r| sr(v, r, -top)),
        (true, Rounding::Stochastic, _) => pack_bytes(codes, x, u, |v, r| sr(v, r, -top)),
        (true, Rounding::Nearest, 4) => pack_nibbles(codes, x, x, |v, _| rn(v, -top)),
        (true, Rounding::Nearest, _) => pack_bytes(codes, x, x, |v, _| rn(v, -top)),
        (false, Rounding::Stochastic, 4) => {
            pack_nibbles(codes, x, u, |v, r| sr(v - offset, r, 0.0))
        }
        (false, Rounding::Stochastic, _) => pack_bytes(codes, x, u, |v, r| sr(v - offset, r, 0.0)),
        (false, Rounding::Nearest, 4) => pack_nibbles(codes, x, x, |v, _| rn(v - offset, 0.0)),
        (false, Rounding::Nearest, _) => pack_bytes(codes, x, x, |v, _| rn(v - offset, 0.0)),
    }
}

/// Scale of a symmetric group; `false` when the codes must all be zero.
#[inline(always)]
fn symmetric_meta(spec: &QuantSpec, x: &[f32]) -> (GroupMeta, bool) {
    let bits = abs_bits_max(x);
    if bits_non_finite(bits) {
        return (non_finite_meta(), false);
    }
    let scale = f32::from_bits(bits) / spec.max_code() as f32;
    if !(scale * spec.max_code() as f32).is_finite() {
        // absmax at the top of fp32's range: the largest code would decode to Inf.
        return (non_finite_meta(), false);
    }
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
    // `min`/`max` may return either zero when a group holds both +0 and -0 (the order of
    // evaluation decides); adding +0 canonicalises -0 to +0 and leaves every other value alone,
    // so the stored offset is the same on every build and on the GPU.
    let (lo, hi) = (lo + 0.0, hi + 0.0);
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

/// Elements the packers handle per step: one line of 16 bytes of 4-bit codes.
const PACK: usize = 32;

/// `1.5 * 2^23`: for an integral `c` with `|c| <= 2^22`, `c + MAGIC` is exact and the low bits
/// of its representation are `c` in two's complement (a branch-free, vectorisable `c as i32`).
const MAGIC: f32 = 12_582_912.0;

/// The two's complement bits of an integral code `c` with `|c| <= 2^22`, or of 0 when `c` is
/// NaN: in its low 16 bits equal to `c as i32`, but branch-free and vectorisable.
#[inline(always)]
pub(crate) fn code_bits(c: f32) -> u32 {
    let c = if c.is_nan() { 0.0 } else { c };
    finite_code_bits(c)
}

/// [`code_bits`] for a `c` that cannot be NaN (round-to-nearest codes of a finite group with a
/// positive finite scale): one add instead of three operations.
#[inline(always)]
fn finite_code_bits(c: f32) -> u32 {
    (c + MAGIC).to_bits()
}

/// Packs the codes `code(x[i], u[i])` (their two's complement bits) as nibbles, element `2k`
/// low, `2k + 1` high. `x.len()` is a multiple of [`PACK`] and `codes.len() == x.len() / 2`.
#[inline(always)]
fn pack_nibbles(codes: &mut [u8], x: &[f32], u: &[f32], code: impl Fn(f32, f32) -> u32) {
    for ((line, x), u) in codes
        .chunks_exact_mut(PACK / 2)
        .zip(x.chunks_exact(PACK))
        .zip(u.chunks_exact(PACK))
    {
        let mut bytes = [0u8; PACK];
        for ((b, &v), &r) in bytes.iter_mut().zip(x).zip(u) {
            *b = code(v, r) as u8;
        }
        // Little-endian 16-bit words `code(2k) | code(2k + 1) << 8` -> one byte of two nibbles.
        let words = bytemuck::cast::<[u8; PACK], [u16; PACK / 2]>(bytes);
        for (byte, w) in line.iter_mut().zip(words) {
            let w = u16::from_le(w);
            *byte = ((w & 0x0F) | (w >> 4 & 0xF0)) as u8;
        }
    }
}

/// Stores the codes `code(x[i], u[i])` (their two's complement bits) as one byte each.
#[inline(always)]
fn pack_bytes(codes: &mut [u8], x: &[f32], u: &[f32], code: impl Fn(f32, f32) -> u32) {
    for ((line, x), u) in codes
        .chunks_exact_mut(PACK)
        .zip(x.chunks_exact(PACK))
        .zip(u.chunks_exact(PACK))
    {
        for ((byte, &v), &r) in line.iter_mut().zip(x).zip(u) {
            *byte = code(v, r) as u8;
        }
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
    let min_code = match (spec.symmetric, spec.bits) {
        (true, 4) => decode_nibbles(
            codes,
            out,
            |n| (n << 4) as i8 >> 4,
            |q| f32::from(q) * scale,
            combine,
        ),
        (true, _) => decode_bytes(codes, out, |b| b as i8, |q| f32::from(q) * scale, combine),
        (false, 4) => decode_nibbles(
            codes,
            out,
            |n| n as i8,
            |q| offset + f32::from(q as u8) * scale,
            combine,
        ),
        (false, _) => {
            for (o, &byte) in out.iter_mut().zip(codes) {
                *o = combine(*o, offset + f32::from(byte) * scale);
            }
            0
        }
    };
    !spec.symmetric || i32::from(min_code) >= -spec.max_code()
}

/// Decodes 4-bit codes: each nibble becomes a code by `code`, then `out[i] = combine(out[i],
/// value(code))`. Returns the smallest code.
#[inline(always)]
fn decode_nibbles(
    codes: &[u8],
    out: &mut [f32],
    code: impl Fn(u8) -> i8,
    value: impl Fn(i8) -> f32,
    combine: impl Fn(f32, f32) -> f32,
) -> i8 {
    let mut min = [0i8; PACK];
    for (out, line) in out.chunks_exact_mut(PACK).zip(codes.chunks_exact(PACK / 2)) {
        let q = unpack_nibbles(line, &code);
        for (m, &q) in min.iter_mut().zip(&q) {
            *m = (*m).min(q);
        }
        for (o, &q) in out.iter_mut().zip(&q) {
            *o = combine(*o, value(q));
        }
    }
    min.into_iter().min().unwrap_or(0)
}

/// Decodes 8-bit codes: each byte becomes a code by `code`, then `out[i] = combine(out[i],
/// value(code))`. Returns the smallest code.
#[inline(always)]
fn decode_bytes<T: Copy + Ord + Default>(
    codes: &[u8],
    out: &mut [f32],
    code: impl Fn(u8) -> T,
    value: impl Fn(T) -> f32,
    combine: impl Fn(f32, f32) -> f32,
) -> T {
    let mut min = T::default();
    for (o, &byte) in out.iter_mut().zip(codes) {
        let q = code(byte);
        min = min.min(q);
        *o = combine(*o, value(q));
    }
    min
}

/// The [`PACK`] codes of one 16-byte line of nibbles in element order (element `2k` from the
/// low nibble of byte `k`), each nibble (a value below 16) mapped by `decode`. The nibbles are
/// spread into little-endian 16-bit words `lo | hi << 8`, which are then the codes' bytes in
/// element order (integer lane operations only, so it vectorises).
#[inline(always)]
fn unpack_nibbles(line: &[u8], decode: impl Fn(u8) -> i8) -> [i8; PACK] {
    let line: &[u8; PACK / 2] = line.try_into().expect("a line of PACK / 2 bytes");
    let words: [u16; PACK / 2] = std::array::from_fn(|k| {
        let w = u16::from(line[k]);
        ((w & 0x0F) | (w & 0xF0) << 4).to_le()
    });
    bytemuck::cast::<[u16; PACK / 2], [u8; PACK]>(words).map(decode)
}
