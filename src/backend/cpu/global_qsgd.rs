//! The passes of Global-QSGD (docs/numerics.md §7.2): the local absmax, the rounding of `x / s` to
//! integers with the global scale `s = a / K`, and the dequantization of the summed integers.

use rayon::prelude::*;

use crate::backend::grad_element::GradElement;
use crate::codec::int_code::IntCode;
use crate::codec::quant::{abs_bits_max, bits_non_finite, code_bits};
use crate::config::Rounding;
use crate::rng::UniformStream;

use super::prefetch::Stream;

/// Elements per parallel task (a multiple of 4, so every task starts a Philox block).
const TASK: usize = 1 << 14;

/// `max |x|` over the bucket, or +Inf when it holds a NaN or Inf (so a MAX all-reduce carries
/// the non-finite flag to every rank whatever the backend does with NaN). Elements are read
/// as their fp32 values (docs/numerics.md §7.5).
pub fn local_absmax<G: GradElement>(bucket: &[G]) -> f32 {
    let bits = bucket
        .par_chunks(TASK)
        .map(|x| match G::as_f32(x) {
            Some(x) => abs_bits_max(x),
            None => x
                .iter()
                .fold(0u32, |m, v| m.max(v.to_f32().to_bits() & 0x7fff_ffff)),
        })
        .max()
        .unwrap_or(0);
    if bits_non_finite(bits) {
        f32::INFINITY
    } else {
        f32::from_bits(bits)
    }
}

/// Elements whose uniforms are drawn together (a stack buffer of 4 KiB).
const BATCH: usize = 1024;

/// `out[i] = clamp(R(x[i] / scale), -k, k)` with uniforms of element `i` of the bucket.
pub fn quantize<G: GradElement, T: IntCode>(
    bucket: &[G],
    scale: f32,
    k: i32,
    rounding: Rounding,
    rng: &UniformStream,
    out: &mut [T],
) {
    let stream = Stream::new(bucket);
    let rule = Rule {
        scale,
        kf: k as f32,
        rounding,
    };
    out.par_chunks_mut(TASK)
        .zip(bucket.par_chunks(TASK))
        .enumerate()
        .for_each(|(t, (codes, x))| quantize_task(t * TASK, x, rule, rng, stream, codes));
}

/// How [`quantize`] maps a value to its integer: `R(x / scale)` clamped to `[-kf, kf]`.
#[derive(Clone, Copy)]
struct Rule {
    scale: f32,
    kf: f32,
    rounding: Rounding,
}

/// One task of [`quantize`]: elements `first .. first + x.len()` of the bucket (`stream`),
/// in batches of `BATCH`, each prefetching the bucket ahead of itself.
fn quantize_task<G: GradElement, T: IntCode>(
    first: usize,
    x: &[G],
    rule: Rule,
    rng: &UniformStream,
    stream: Stream,
    codes: &mut [T],
) {
    let Rule {
        scale,
        kf,
        rounding,
    } = rule;
    let code = |c: f32| T::from_low_bits(code_bits(c));
    let mut u = [0f32; BATCH];
    for (c, (codes, x)) in codes.chunks_mut(BATCH).zip(x.chunks(BATCH)).enumerate() {
        let start = first + c * BATCH;
        stream.prefetch_ahead(start..start + x.len());
        match rounding {
            Rounding::Stochastic => {
                let u = &mut u[..x.len()];
                fill_uniforms(rng, start as u64, u);
                for ((q, &v), &r) in codes.iter_mut().zip(x).zip(&*u) {
                    *q = code((v.to_f32() / scale + r).floor().clamp(-kf, kf));
                }
            }
            Rounding::Nearest => {
                for (q, &v) in codes.iter_mut().zip(x) {
                    *q = code((v.to_f32() / scale).round_ties_even().clamp(-kf, kf));
                }
            }
        }
    }
}

/// The uniforms of elements `first .. first + u.len()` (`first` a multiple of 4; a length that
/// is not is finished element by element).
fn fill_uniforms(rng: &UniformStream, first: u64, u: &mut [f32]) {
    let whole = u.len() / 4 * 4;
    let (head, tail) = u.split_at_mut(whole);
    rng.fill(first, head);
    for (i, r) in tail.iter_mut().enumerate() {
        *r = rng.uniform(first + (whole + i) as u64);
    }
}

/// `out[i] = sum[i] * scale`, rounded to `G`.
pub fn dequantize<T: IntCode, G: GradElement>(sum: &[T], scale: f32, out: &mut [G]) {
    out.par_chunks_mut(TASK)
        .zip(sum.par_chunks(TASK))
        .for_each(|(o, s)| {
            for (o, &q) in o.iter_mut().zip(s) {
                *o = G::from_f32(q.to_f32() * scale);
            }
        });
}
