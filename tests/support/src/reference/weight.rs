//! The per-element error bounds of one weight all-gather with a quantized weight codec.

use half::bf16;
use sdp4bit::{Config, WeightCodec};

use super::signal::group_quant_bound;
use super::{EPS, FP_SAFETY};

/// Half a bf16 ulp at magnitude `v` (bf16 has 8 significant bits: ulp = 2^(e - 7) for
/// `2^e <= v < 2^(e + 1)`), an upper bound on bf16 round-to-nearest's error for any value
/// of magnitude at most `v`.
fn bf16_half_ulp(v: f64) -> f64 {
    let v = v.abs();
    if v == 0.0 {
        return 0.0;
    }
    let e = ((v.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    2f64.powi(e - 8)
}

/// Per-element bounds on `|param - new|` after one all-gather with a quantized weight codec:
/// `(worst case, mean square)`.
///
/// - direct codecs (qw, qsdp, zeropp): `param = bf16(x')`, `x'` the group quantization of the
///   new weights (zero-padded groups of `g` from each shard's start): quantizer bound `e` of
///   the group ([module docs](super)) plus `bf16_half_ulp(|new| + e)`;
/// - qWD: `d = new - ref` in fp32 (exact for bf16 operands of similar magnitude; we still
///   allow `eps |d|`), `d'` its 4-bit SR quantization, `param = bf16(fl(ref + d'))`, so
///   `|param - new| <= e + eps (|new| + e) + bf16_half_ulp(|new| + 2 e)`.
///
/// Mean square: the quantization error has `E[d^2] <= s^2 / 4` (SR, and RN
/// deterministically), the rest is a deterministic rounding `r`, so by Minkowski
/// `E[err^2] <= (s / 2 + r)^2`.
pub fn weight_bounds(
    config: &Config,
    world: usize,
    reference: &[bf16],
    new: &[bf16],
) -> (Vec<f64>, Vec<f64>) {
    let wc = &config.weight;
    let s_len = new.len() / world;
    let g = wc.group_size;
    let symmetric = wc.codec != WeightCodec::Qsdp;
    let mut bound = vec![0.0; new.len()];
    let mut var = vec![0.0; new.len()];
    for z in 0..world {
        for j in 0..s_len.div_ceil(g) {
            let idx: Vec<usize> = (j * g..((j + 1) * g).min(s_len))
                .map(|o| z * s_len + o)
                .collect();
            let mut x: Vec<f64> = idx
                .iter()
                .map(|&i| match wc.codec {
                    WeightCodec::Qwd => {
                        f64::from(new[i].to_f32()) - f64::from(reference[i].to_f32())
                    }
                    _ => f64::from(new[i].to_f32()),
                })
                .collect();
            // qWD's fp32 difference may round (by at most eps |d|); direct inputs are exact.
            let mut b: Vec<f64> = x
                .iter()
                .map(|d| match wc.codec {
                    WeightCodec::Qwd => EPS * d.abs(),
                    _ => 0.0,
                })
                .collect();
            if x.len() < g {
                x.resize(g, 0.0);
                b.resize(g, 0.0);
            }
            let (main, fp, s) = group_quant_bound(&x, &b, wc.bits, symmetric, wc.rounding);
            for (k, &i) in idx.iter().enumerate() {
                let e = main + fp + b[k];
                let nv = f64::from(new[i].to_f32()).abs();
                let rest = match wc.codec {
                    WeightCodec::Qwd => {
                        FP_SAFETY * EPS * (nv + e) + bf16_half_ulp(nv + 2.0 * e + 2.0 * EPS * nv)
                    }
                    _ => bf16_half_ulp(nv + 2.0 * e),
                };
                bound[i] = e + rest;
                var[i] = (0.5 * s + fp + b[k] + rest).powi(2);
            }
        }
    }
    (bound, var)
}
