//! What a quantized weight slab encodes: the new weights themselves or their difference from
//! the previous parameters.

/// What a weight chunk encodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightEncoding {
    /// The weights themselves (qw, qsdp, zeropp): `param = bf16(x')`.
    Direct,
    /// The difference from the previous parameters (qWD): `param = bf16(param + d')`.
    Difference,
}
