//! The element types a reduce-scatter sums: fp32 gradients and Global-QSGD's integer codes,
//! each with an addition that reports integer overflow.

/// Element types a reduce-scatter can sum: fp32 gradients and Global-QSGD's integers.
pub trait SumElement: bytemuck::Pod + Send + Sync + PartialEq + std::fmt::Debug {
    /// Name used in error messages.
    const DTYPE: &'static str;
    /// `a + b`, or `None` when an integer sum overflows.
    fn checked_sum(a: Self, b: Self) -> Option<Self>;
}

impl SumElement for f32 {
    const DTYPE: &'static str = "float32";
    fn checked_sum(a: Self, b: Self) -> Option<Self> {
        Some(a + b)
    }
}

impl SumElement for i8 {
    const DTYPE: &'static str = "int8";
    fn checked_sum(a: Self, b: Self) -> Option<Self> {
        a.checked_add(b)
    }
}

impl SumElement for i16 {
    const DTYPE: &'static str = "int16";
    fn checked_sum(a: Self, b: Self) -> Option<Self> {
        a.checked_add(b)
    }
}
