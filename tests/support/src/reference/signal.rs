//! One fp32 buffer's exact values and error bounds through the stages of a collective
//! (quantize, sum in rank order, Hadamard forward and inverse), as derived in the
//! [module docs](super).

use sdp4bit::Rounding;

use super::{EPS, FP_SAFETY};

/// One fp32 buffer at one pipeline stage (see the [module docs](super)): exact values `v`,
/// worst-case bound `b` on the fp32 error, the SR/RN variance budget `qvar` (sum of `s^2/4`)
/// and the deterministic fp32 part `fp` of `b`.
#[derive(Debug, Clone)]
pub(super) struct Signal {
    pub(super) v: Vec<f64>,
    pub(super) b: Vec<f64>,
    pub(super) qvar: Vec<f64>,
    pub(super) fp: Vec<f64>,
}

impl Signal {
    /// A buffer holding `v` exactly.
    pub(super) fn exact(v: Vec<f64>) -> Self {
        let n = v.len();
        Self {
            v,
            b: vec![0.0; n],
            qvar: vec![0.0; n],
            fp: vec![0.0; n],
        }
    }
}

/// The per-element bound of one quantization of a group with fp32 values within `b` of `v`.
/// Returns `(main, fp, scale_bound)`: the rounding term (`s` SR, `s/2` RN), the fp32 slack
/// and the bound on the scale.
pub(super) fn group_quant_bound(
    v: &[f64],
    b: &[f64],
    bits: u8,
    symmetric: bool,
    rounding: Rounding,
) -> (f64, f64, f64) {
    let (s, fp) = if symmetric {
        let l = f64::from((1u32 << (bits - 1)) - 1);
        let a = v
            .iter()
            .zip(b)
            .map(|(v, b)| v.abs() + b)
            .fold(0.0, f64::max);
        let s = a / l * (1.0 + 2.0 * EPS);
        (s, FP_SAFETY * EPS * (4.0 * a + 4.0 * s))
    } else {
        let levels = f64::from((1u32 << bits) - 1);
        let lo = v
            .iter()
            .zip(b)
            .map(|(v, b)| v - b)
            .fold(f64::INFINITY, f64::min);
        let hi = v
            .iter()
            .zip(b)
            .map(|(v, b)| v + b)
            .fold(f64::NEG_INFINITY, f64::max);
        let range = hi - lo;
        let s = range / levels * (1.0 + 2.0 * EPS);
        let m = lo.abs().max(hi.abs());
        (s, FP_SAFETY * EPS * (4.0 * range + 4.0 * s + 2.0 * m))
    };
    let main = match rounding {
        Rounding::Stochastic => s,
        Rounding::Nearest => 0.5 * s,
    };
    (main, fp, s)
}

/// Stage 1: one quantization of every group of `sig` (one group: the whole signal).
pub(super) fn quantize_signal(sig: &mut Signal, bits: u8, symmetric: bool, rounding: Rounding) {
    let (main, fp, s) = group_quant_bound(&sig.v, &sig.b, bits, symmetric, rounding);
    for i in 0..sig.v.len() {
        sig.b[i] += main + fp;
        sig.fp[i] += fp;
        sig.qvar[i] += s * s / 4.0;
    }
}

/// fp32 sum of `sigs` in order (stage 2).
pub(super) fn sum_signals(sigs: &[&Signal]) -> Signal {
    let n = sigs[0].v.len();
    let k = sigs.len() as f64;
    let mut out = Signal::exact(vec![0.0; n]);
    for i in 0..n {
        let mut mag = 0.0;
        for s in sigs {
            out.v[i] += s.v[i];
            out.b[i] += s.b[i];
            out.qvar[i] += s.qvar[i];
            out.fp[i] += s.fp[i];
            mag += s.v[i].abs() + s.b[i];
        }
        let slack = FP_SAFETY * (k - 1.0) * EPS * mag;
        out.b[i] += slack;
        out.fp[i] += slack;
    }
    out
}

/// Exact (f64) unnormalized Walsh-Hadamard butterfly over blocks of `block`.
fn hadamard_f64(x: &mut [f64], block: usize) {
    for blk in x.chunks_exact_mut(block) {
        let mut h = 1;
        while h < block {
            for base in (0..block).step_by(2 * h) {
                for j in base..base + h {
                    let (a, b) = (blk[j], blk[j + h]);
                    blk[j] = a + b;
                    blk[j + h] = a - b;
                }
            }
            h *= 2;
        }
    }
}

/// Stage 3: the fp32 forward transform of exact inputs `x`.
pub(super) fn hadamard_forward_signal(x: &[f64], block: usize) -> Signal {
    let mut v = x.to_vec();
    hadamard_f64(&mut v, block);
    let mut sig = Signal::exact(v);
    for (i, blk) in x.chunks_exact(block).enumerate() {
        let l1: f64 = blk.iter().map(|v| v.abs()).sum();
        let e = FP_SAFETY * (block as f64 - 1.0) * EPS * l1;
        for k in 0..block {
            sig.b[i * block + k] = e;
            sig.fp[i * block + k] = e;
        }
    }
    sig
}

/// Stage 4: the fp32 inverse transform; returns per-element `(bound, var)` of the output.
pub(super) fn hadamard_inverse_bounds(sig: &Signal, block: usize) -> (Vec<f64>, Vec<f64>) {
    let n = sig.v.len();
    let (mut bound, mut var) = (vec![0.0; n], vec![0.0; n]);
    let bf = block as f64;
    for start in (0..n).step_by(block) {
        let r = start..start + block;
        let mean = |x: &[f64]| x.iter().sum::<f64>() / bf;
        let mag: f64 = sig.v[r.clone()]
            .iter()
            .zip(&sig.b[r.clone()])
            .map(|(v, b)| v.abs() + b)
            .sum::<f64>()
            / bf;
        let round = FP_SAFETY * (bf - 1.0) * EPS * mag;
        let b = mean(&sig.b[r.clone()]) + round;
        let fp = mean(&sig.fp[r.clone()]) + round;
        let qvar = mean(&sig.qvar[r.clone()]) / bf;
        let v = (qvar.sqrt() + fp).powi(2);
        for i in r {
            bound[i] = b;
            var[i] = v;
        }
    }
    (bound, var)
}
