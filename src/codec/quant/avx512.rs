//! The quantizer on AVX-512F and AVX-512VBMI, taken when the running CPU has them: sixteen
//! elements per vector, bit-identical to the portable loops of [`super`] (the same IEEE
//! operations in the same order: subtraction, division, addition, floor or round-half-even,
//! clamp; docs/numerics.md §1.4).
//!
//! The division stays a true division: `vdivps` on 512-bit vectors cost about 0.04 ns per
//! element on the Zen 5 measured, and the reciprocal route (`q0 = v * RN(1 / s)` refined by two
//! fused multiply-adds, exact by Markstein's theorem away from underflow) measured slower once
//! its range guards were paid (bench/results/cpu.md).

use std::arch::x86_64::{
    __m512, __m512i, _CMP_ORD_Q, _mm512_add_ps, _mm512_and_si512, _mm512_castps_si512,
    _mm512_castsi512_si128, _mm512_castsi512_si256, _mm512_cmp_ps_mask, _mm512_div_ps,
    _mm512_maskz_mov_ps, _mm512_max_ps, _mm512_min_ps, _mm512_permutex2var_epi8,
    _mm512_roundscale_ps, _mm512_set1_epi64, _mm512_set1_ps, _mm512_srli_epi64, _mm512_sub_ps,
    _mm512_ternarylogic_epi64,
};

use super::{GroupMeta, MAGIC, PACK, QuantSpec};
use crate::config::Rounding;

/// Elements per vector.
const LANES: usize = 16;
/// `_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC` and `_MM_FROUND_TO_NEAREST_INT |
/// _MM_FROUND_NO_EXC`: floor and round-half-even without raising exceptions.
const FLOOR: i32 = 0x09;
const NEAREST: i32 = 0x08;

/// Whether the running CPU (and OS) supports AVX-512F and AVX-512VBMI (the byte permute that
/// packs the codes); cached by the standard library.
#[inline]
pub(super) fn detected() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512vbmi")
}

/// [`super::quantize_group`] on AVX-512: the same metadata and the same code bytes as
/// [`super::quantize_group_portable`].
///
/// # Panics
/// If the CPU lacks AVX-512F or AVX-512VBMI (callers check [`detected`] first).
pub(super) fn quantize_group(
    spec: &QuantSpec,
    x: &[f32],
    u: &[f32],
    codes: &mut [u8],
) -> GroupMeta {
    assert!(detected(), "AVX-512 quantizer taken on a CPU without it");
    // SAFETY: the assertion above proves the running CPU supports AVX-512F and AVX-512VBMI,
    // the target features `quantize_group_avx512` enables.
    unsafe { quantize_group_avx512(spec, x, u, codes) }
}

/// The metadata reductions are the portable code compiled with AVX-512 enabled; the codes are
/// [`write_codes`].
#[target_feature(enable = "avx512f,avx512vbmi")]
fn quantize_group_avx512(spec: &QuantSpec, x: &[f32], u: &[f32], codes: &mut [u8]) -> GroupMeta {
    let (meta, ok) = super::group_meta(spec, x);
    if ok {
        write_codes(spec, meta.scale, meta.offset, x, u, codes);
    } else {
        codes.fill(0);
    }
    meta
}

/// The codes of a group with a positive finite `scale` (and `offset`), sixteen lanes at a time.
#[target_feature(enable = "avx512f,avx512vbmi")]
#[inline]
fn write_codes(spec: &QuantSpec, scale: f32, offset: f32, x: &[f32], u: &[f32], codes: &mut [u8]) {
    let top = spec.max_code() as f32;
    let rounder = Rounder {
        scale: _mm512_set1_ps(scale),
        offset: (!spec.symmetric).then(|| _mm512_set1_ps(offset)),
        low: _mm512_set1_ps(if spec.symmetric { -top } else { 0.0 }),
        top: _mm512_set1_ps(top),
        stochastic: spec.rounding == Rounding::Stochastic,
    };
    // Nearest rounding ignores `u` (which may be empty): it reads `x` in its place.
    let u = if rounder.stochastic { u } else { x };
    let (x, _) = x.as_chunks::<PACK>();
    let (u, _) = u.as_chunks::<PACK>();
    if spec.bits == 4 {
        // Byte 0 of every 64-bit lane of `a`, then of `b`.
        let gather = byte_indices(8);
        let (lines, _) = codes.as_chunks_mut::<{ PACK / 2 }>();
        for ((line, x), u) in lines.iter_mut().zip(x).zip(u) {
            let [a, b] = rounder.line(x, u);
            let bytes = _mm512_permutex2var_epi8(nibbles(a), gather, nibbles(b));
            *line = bytemuck::cast(_mm512_castsi512_si128(bytes));
        }
    } else {
        // Byte 0 of every 32-bit lane of `a`, then of `b`.
        let gather = byte_indices(4);
        let (lines, _) = codes.as_chunks_mut::<PACK>();
        for ((line, x), u) in lines.iter_mut().zip(x).zip(u) {
            let [a, b] = rounder.line(x, u);
            let bytes = _mm512_permutex2var_epi8(a, gather, b);
            *line = bytemuck::cast(_mm512_castsi512_si256(bytes));
        }
    }
}

/// The rounding of one group: `clamp(R((x - offset) / s), low, top)` as code bits.
struct Rounder {
    /// The group's scale, positive and finite.
    scale: __m512,
    /// The asymmetric offset; symmetric groups skip the subtraction (exact for finite `x`).
    offset: Option<__m512>,
    low: __m512,
    top: __m512,
    stochastic: bool,
}

impl Rounder {
    /// The code bits of one line of [`PACK`] elements as two vectors of 32-bit lanes (the
    /// low byte of each lane is the code in two's complement).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn line(&self, x: &[f32; PACK], u: &[f32; PACK]) -> [__m512i; 2] {
        let halves = |k: usize| -> (__m512, __m512) {
            let x: [f32; LANES] = x[k * LANES..(k + 1) * LANES].try_into().expect("16 lanes");
            let u: [f32; LANES] = u[k * LANES..(k + 1) * LANES].try_into().expect("16 lanes");
            (bytemuck::cast(x), bytemuck::cast(u))
        };
        let (x0, u0) = halves(0);
        let (x1, u1) = halves(1);
        [self.code_bits(x0, u0), self.code_bits(x1, u1)]
    }

    /// The code bits of sixteen elements `x` with their uniforms `u`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn code_bits(&self, x: __m512, u: __m512) -> __m512i {
        let v = match self.offset {
            Some(offset) => _mm512_sub_ps(x, offset),
            None => x,
        };
        let q = _mm512_div_ps(v, self.scale);
        let c = if self.stochastic {
            let c = _mm512_roundscale_ps::<FLOOR>(_mm512_add_ps(q, u));
            // A NaN code (only from NaN uniforms) becomes 0, as `code_bits` maps it.
            _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(c, c), c)
        } else {
            _mm512_roundscale_ps::<NEAREST>(q)
        };
        let c = _mm512_min_ps(_mm512_max_ps(c, self.low), self.top);
        _mm512_castps_si512(_mm512_add_ps(c, _mm512_set1_ps(MAGIC)))
    }
}

/// The index vector of a two-source byte permute that takes byte 0 of every `stride`-byte lane
/// of the first source, then of the second (source bytes 64 and up).
#[target_feature(enable = "avx512f")]
#[inline]
fn byte_indices(stride: usize) -> __m512i {
    let lanes = 64 / stride;
    let indices: [u8; 64] = std::array::from_fn(|k| {
        let (source, lane) = (k / lanes % 2, k % lanes);
        (64 * source + stride * lane) as u8
    });
    bytemuck::cast(indices)
}

/// Sixteen code bit lanes (elements `2k`, `2k + 1` in the two halves of 64-bit lane `k`) with
/// byte 0 of 64-bit lane `k` holding both codes as nibbles, element `2k` low.
#[target_feature(enable = "avx512f")]
#[inline]
fn nibbles(bits: __m512i) -> __m512i {
    let low = _mm512_and_si512(bits, _mm512_set1_epi64(0x0F));
    let high = _mm512_srli_epi64::<28>(bits);
    // 0xF8 is a | (b & c): the high nibble masked, or-ed with the low one.
    _mm512_ternarylogic_epi64::<0xF8>(low, high, _mm512_set1_epi64(0xF0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::quant::quantize_group_portable;
    use crate::rng::UniformStream;

    /// A small deterministic generator (splitmix64) for test data.
    struct Bits(u64);

    impl Bits {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// A value of kind `kind`: gradient-like, any finite bit pattern (every exponent,
        /// subnormals), tiny, huge, signed zeros, or a non-finite value now and then.
        fn value(&mut self, kind: u64) -> f32 {
            let r = self.next();
            let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
            let unit = (r >> 40) as f32 / 16_777_216.0;
            match kind {
                0 => sign * unit * 1e-3,
                1 => {
                    let v = f32::from_bits((r >> 32) as u32);
                    if v.is_finite() { v } else { 0.0 }
                }
                2 => f32::from_bits((r >> 32) as u32 & 0x807F_FFFF),
                3 => sign * f32::MAX * unit,
                4 => [0.0, -0.0, sign * f32::MIN_POSITIVE, sign * unit][(r >> 8) as usize % 4],
                _ => [f32::NAN, f32::INFINITY, sign * unit, sign * unit][(r >> 8) as usize % 4],
            }
        }

        /// A uniform: mostly Philox-like, sometimes 0, just below 1, or out of range (NaN,
        /// infinite, negative, huge) to exercise the code clamping.
        fn uniform(&mut self) -> f32 {
            let r = self.next();
            match r % 16 {
                0 => 0.0,
                1 => 1.0 - f32::EPSILON / 2.0,
                2 => [f32::NAN, f32::INFINITY, -0.5, 1e30][(r >> 8) as usize % 4],
                _ => (r >> 40) as f32 / 16_777_216.0,
            }
        }
    }

    /// The AVX-512 quantizer writes the portable quantizer's metadata and code bytes for every
    /// format and group size, on groups of every kind (including constant, all-zero, subnormal,
    /// huge and non-finite groups) and with in-range and out-of-range uniforms.
    #[test]
    fn matches_portable_quantizer() {
        if !detected() {
            eprintln!("skipped: this CPU lacks AVX-512F/VBMI");
            return;
        }
        let mut bits = Bits(42);
        let philox = UniformStream::new(7, 3, 11);
        for bits_per_code in [4u8, 8] {
            for symmetric in [true, false] {
                for rounding in [Rounding::Stochastic, Rounding::Nearest] {
                    for group_size in [32usize, 128, 1024, 2048] {
                        let spec = QuantSpec {
                            bits: bits_per_code,
                            group_size,
                            symmetric,
                            rounding,
                        };
                        let groups = 4096 / group_size * 8;
                        for g in 0..groups {
                            let kind = g as u64 % 7;
                            let x: Vec<f32> = match kind {
                                6 => vec![bits.value(0); group_size],
                                _ => (0..group_size).map(|_| bits.value(kind)).collect(),
                            };
                            let mut u = vec![0f32; group_size];
                            if g % 2 == 0 {
                                philox.fill((g * group_size) as u64, &mut u);
                            } else {
                                u.iter_mut().for_each(|v| *v = bits.uniform());
                            }
                            let mut want = vec![0u8; spec.code_bytes_per_group()];
                            let mut got = vec![0xAAu8; spec.code_bytes_per_group()];
                            let m_want = quantize_group_portable(&spec, &x, &u, &mut want);
                            let m_got = quantize_group(&spec, &x, &u, &mut got);
                            let same = |a: f32, b: f32| {
                                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
                            };
                            assert!(
                                same(m_got.scale, m_want.scale)
                                    && same(m_got.offset, m_want.offset),
                                "{spec:?} group {g}: meta {m_got:?} != {m_want:?}"
                            );
                            assert_eq!(got, want, "{spec:?} group {g} (kind {kind})");
                        }
                    }
                }
            }
        }
    }
}
