//! Exact f64 answers of the collectives and per-element error bounds derived from the
//! quantizers' scales, computed from the exact fp32 inputs.
//!
//! - [`route`]: which route a reduce-scatter takes, modelled independently of `plan`;
//! - [`grad`]: the exact sum and the bounds of one gradient reduce-scatter;
//! - [`weight`]: the bounds of one weight all-gather;
//! - `signal` (private): one buffer's exact values and error bound through the stages below.
//!
//! # How the error bounds are derived
//!
//! Notation: `eps = 2^-24` ([`EPS`]) is the unit roundoff of fp32 round-to-nearest; `fl(x)`
//! is the fp32 result of an operation, `|fl(x) - x| <= eps |x|`. Every quantity below is an
//! upper bound computed in f64 from the exact fp32 inputs (f64 rounding, `2^-53` relative, is
//! ~2^29 times smaller than the fp32 slack terms and is absorbed by the factor-2 safety on
//! them).
//!
//! A *signal* is what one fp32 buffer holds at one stage of the pipeline: per element an exact
//! value `v` (f64, computed from the inputs with exact arithmetic) and a bound `b` on
//! `|fp32 value - v|`. Stages:
//!
//! 1. **Group quantizer** (docs/numerics.md §1) of a group whose fp32 values are `v +- b`:
//!    - symmetric: the fp32 absmax is at most `a = max_i(|v_i| + b_i)`, so the scale
//!      `s = fl(a / L) <= a / L * (1 + eps)`. Codes are `q = clamp(floor(fl(fl(x / s) + u)))`
//!      (SR) or `round(fl(x / s))` (RN). Exactly, `|q - x/s| < 1` (SR) or `<= 1/2` (RN); the
//!      two fp32 roundings before the floor move `x/s` by at most `eps (|x/s| + |x/s + u|) <=
//!      eps (2L + 1)` code steps, and the clamp only moves `q` towards `x/s`. Dequantizing,
//!      `fl(q s)`, adds `eps |q s| <= eps (a + s)`. So, per element,
//!      `|x' - x| <= s (SR) or s/2 (RN) + eps (4 a + 4 s)`.
//!    - asymmetric (min-max): with `lo >= min(v - b)`, `hi <= max(v + b)` and range
//!      `R = hi - lo`, `s <= R / (2^b - 1) * (1 + eps)`. The extra operations `fl(x - lo)` and
//!      `fl(lo + q s)` add `eps R` and `eps (max(|lo|, |hi|) + s)`, so
//!      `|x' - x| <= s (SR) or s/2 (RN) + eps (4 R + 4 s + 2 max(|lo|, |hi|))`.
//!
//!    The new bound is `b + that`. For the *two-level* route the level-2 group is the node's
//!    partial sum, whose exact value `P = sum_r v_r` we know and whose fp32 value is within
//!    `E = sum_r (b_r + level-1 bound_r) + sum slack`; so its scale is bounded by
//!    `max_i(|P_i| + E_i) / L2`: the sum over the node's ranks of (absmax + level-1 bound),
//!    divided by L2, made element-wise (never looser than that).
//! 2. **fp32 sum of k signals in rank order**: `v = sum v_r`, and the sum's rounding adds at
//!    most `(k - 1) eps sum_r (|v_r| + b_r)` (the classical `gamma_{k-1}` bound).
//! 3. **Hadamard forward** (docs/numerics.md §3, unnormalized butterfly over blocks of `B`,
//!    exact fp32 inputs `x`): after stage `t` the error is at most `2 E_{t-1} + eps ||x||_1`,
//!    so after `log2 B` stages `b_i <= (B - 1) eps ||x_block||_1`; `v = H x` exactly.
//! 4. **Hadamard inverse**: the exact inverse `H / B` maps an error vector bounded by `e` to at
//!    most `mean(e over the block)` per output element (each output is `1/B` times a signed
//!    sum of the block); the fp32 butterfly on the inputs `z` adds `(B - 1) eps ||z||_1`,
//!    and `* 1/B` is exact, so `b_out = mean_block(b) + (B - 1) eps mean_block(|v| + b)`.
//!
//! The final per-element bound compares the shard with the exact f64 sum of the inputs.
//! One-level routes are stage 1 for each of the W ranks then stage 2 over W; two-level routes
//! are stage 1 per rank, stage 2 per node, stage 1 again (level 2) per node, stage 2 over the
//! M nodes. **Global-QSGD**: `s = fl(A / K)` with `A` the global absmax and
//! `K = floor((2^(w-1) - 1) / W)`; each rank's integer is within `s + eps (4 A + 4 s)` of
//! `x / s * s`, integers sum exactly, and `fl(sum * s)` adds `eps (|exact| + W s)`: the bound
//! is `W s` plus that slack.
//!
//! Alongside the worst case, every stage also carries the budget of the mean-square bound
//! that [`crate::error_stats`] asserts (its module docs derive it).

pub mod grad;
pub mod route;
mod signal;
pub mod weight;

/// Unit roundoff of fp32 round-to-nearest: `2^-24`.
pub const EPS: f64 = 1.0 / 16_777_216.0;

/// Safety factor on the first-order fp32 slack terms (covers second-order `eps^2` terms and
/// the f64 evaluation of the reference, both below `2^-40` relative).
const FP_SAFETY: f64 = 2.0;
