//! Helpers shared by the CPU and GPU benchmarks: deterministic synthetic data and the date
//! stamp of a run.

use half::bf16;
use rayon::prelude::*;

/// Deterministic pseudo-random gradients: uniform in `[-1, 1) * 1e-3` with one outlier of
/// 100x every 997 elements (so group scales vary as in real gradients).
pub fn gradients(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut s = seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(c as u64 + 1);
            let base = c << 16;
            for (i, x) in chunk.iter_mut().enumerate() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32;
                let outlier = if (base + i) % 997 == 0 { 100.0 } else { 1.0 };
                *x = (2.0 * u - 1.0) * 1e-3 * outlier;
            }
        });
    v
}

/// Deterministic bf16 parameters of magnitude about 0.02.
pub fn params(n: usize, seed: u64) -> Vec<bf16> {
    gradients(n, seed)
        .par_iter()
        .map(|&g| bf16::from_f32(g * 20.0))
        .collect()
}

/// `a + small update` as the optimizer would write it.
pub fn updated(a: &[bf16], seed: u64) -> Vec<bf16> {
    let d = gradients(a.len(), seed);
    a.par_iter()
        .zip(&d)
        .map(|(p, d)| bf16::from_f32(p.to_f32() - d * 1e-2))
        .collect()
}

/// The current UTC time to the second (RFC 3339), for the header of a run.
pub fn utc_now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}
