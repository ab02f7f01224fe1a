//! [`GradElement`]: the element types a gradient bucket and its shard may hold (fp32 and
//! bf16), and their exact conversions to and from the fp32 the passes compute in
//! (docs/numerics.md §7.5).

use half::bf16;

use super::Element;

/// An element type of gradient buckets and shards. The passes read every element as its
/// exact fp32 value ([`to_f32`](Self::to_f32)) and write the fp32 result rounded to the
/// type ([`from_f32`](Self::from_f32)), so a bucket of `G` gives the bytes the fp32 bucket of
/// its values gives, rounded once at the end.
pub trait GradElement: Element {
    /// Whether the type is bf16 (the CUDA backend's choice of kernel variant).
    const IS_BF16: bool;

    /// The fp32 value of `self`: exact (bf16 is a truncated fp32; a NaN stays NaN).
    fn to_f32(self) -> f32;
    /// `v` rounded to the type: to nearest, ties to even (bf16); NaN stays NaN, ±Inf stays
    /// ±Inf, finite values past the largest bf16 round to ±Inf.
    fn from_f32(v: f32) -> Self;
    /// The elements as fp32 when they are fp32 (the passes then work in place).
    fn as_f32(values: &[Self]) -> Option<&[f32]>;
    /// The elements as fp32 when they are fp32, to write.
    fn as_f32_mut(values: &mut [Self]) -> Option<&mut [f32]>;
}

impl GradElement for f32 {
    const IS_BF16: bool = false;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }

    fn as_f32(values: &[Self]) -> Option<&[f32]> {
        Some(values)
    }

    fn as_f32_mut(values: &mut [Self]) -> Option<&mut [f32]> {
        Some(values)
    }
}

impl GradElement for bf16 {
    const IS_BF16: bool = true;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16_from_f32(v)
    }

    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }

    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

/// Writes `src` converted to fp32 into `dst` (equal lengths).
pub fn widen_into<G: GradElement>(src: &[G], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// Writes `src` rounded to `G` into `dst` (equal lengths).
pub fn narrow_into<G: GradElement>(src: &[f32], dst: &mut [G]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = G::from_f32(s);
    }
}

/// `bf16::to_f32` bit for bit (NaNs come out quiet), branch-free so loops over it vectorise.
#[inline(always)]
pub(crate) fn bf16_to_f32(b: bf16) -> f32 {
    let bits = u32::from(b.to_bits());
    let quiet = if bits & 0x7FFF > 0x7F80 { 0x40 } else { 0 };
    f32::from_bits((bits | quiet) << 16)
}

/// `bf16::from_f32` bit for bit: round to nearest even by adding `0x7FFF` plus the lowest
/// kept bit before truncating (`half`'s rule, verified on all 2^32 inputs); NaNs keep their
/// high mantissa bits and come out quiet. Branch-free, so loops over it vectorise.
#[inline(always)]
pub(crate) fn bf16_from_f32(v: f32) -> bf16 {
    let x = v.to_bits();
    let bits = if x & 0x7FFF_FFFF > 0x7F80_0000 {
        (x >> 16) | 0x40
    } else {
        x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16
    };
    bf16::from_bits(bits as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free conversions agree with `half` on every bf16 and on a dense sweep of
    /// f32 bit patterns (every exponent, every rounding case, NaNs and infinities).
    #[test]
    fn bf16_conversions_match_half() {
        for bits in 0..=u16::MAX {
            let b = bf16::from_bits(bits);
            assert_eq!(
                bf16_to_f32(b).to_bits(),
                b.to_f32().to_bits(),
                "{bits:#06x}"
            );
        }
        for hi in (0..=u32::MAX >> 16).step_by(7) {
            for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000] {
                let v = f32::from_bits(hi << 16 | lo);
                let want = bf16::from_f32(v).to_bits();
                assert_eq!(bf16_from_f32(v).to_bits(), want, "{:#010x}", v.to_bits());
            }
        }
    }

    /// Every finite bf16 and both infinities survive the round trip through fp32; NaNs stay
    /// NaN.
    #[test]
    fn bf16_round_trips_through_f32() {
        for bits in 0..=u16::MAX {
            let b = bf16::from_bits(bits);
            let back = <bf16 as GradElement>::from_f32(GradElement::to_f32(b));
            if b.is_nan() {
                assert!(back.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(back.to_bits(), bits, "{bits:#06x}");
            }
        }
    }
}
