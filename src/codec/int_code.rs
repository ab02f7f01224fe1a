//! The integer codes of Global-QSGD: what each rank rounds `x / s` to and what the
//! reduce-scatter sums (int8, or int16 for large groups).

use crate::codec::sum::SumElement;

/// Integer codes Global-QSGD sums inside the reduce-scatter.
pub trait IntCode: SumElement + Copy {
    /// Width of the integer in bits.
    const BITS: u8;
    /// Converts an already clamped integral value.
    fn from_f32(v: f32) -> Self;
    /// The code whose two's complement bits are the low bits of `bits` (as produced by
    /// `codec::quant::code_bits` from a clamped integral value; equal to `from_f32`).
    fn from_low_bits(bits: u32) -> Self;
    /// The code as a float.
    fn to_f32(self) -> f32;
}

impl IntCode for i8 {
    const BITS: u8 = 8;
    fn from_f32(v: f32) -> Self {
        v as i8
    }
    fn from_low_bits(bits: u32) -> Self {
        bits as i8
    }
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
}

impl IntCode for i16 {
    const BITS: u8 = 16;
    fn from_f32(v: f32) -> Self {
        v as i16
    }
    fn from_low_bits(bits: u32) -> Self {
        bits as i16
    }
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
}
