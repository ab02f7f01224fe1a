//! Helpers shared by the unit-level integration tests (rng, hadamard, quantizer, config,
//! plan, decode_fuzz): a tiny deterministic generator so every test draws fresh data from a
//! fixed seed without adding dependencies.
#![allow(dead_code)]

/// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit generator good enough for test data.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[0, n)` (n > 0); the modulo bias is irrelevant for test data.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[lo, hi)`, rounded to f32.
    pub fn range_f32(&mut self, lo: f64, hi: f64) -> f32 {
        (lo + (hi - lo) * self.next_f64()) as f32
    }

    /// Standard normal by Box-Muller.
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A "gradient-like" value: normal times a random power of two in `[2^-20, 2^4]`, with
    /// an occasional outlier 100x larger, so groups have varied absmax and spread.
    pub fn grad_like(&mut self) -> f32 {
        let exp = self.below(25) as i32 - 20;
        let mut v = self.normal() * 2f64.powi(exp);
        if self.below(64) == 0 {
            v *= 100.0;
        }
        v as f32
    }

    /// A vector of `n` values drawn by `f`.
    pub fn vec_f32(&mut self, n: usize, mut f: impl FnMut(&mut Self) -> f32) -> Vec<f32> {
        (0..n).map(|_| f(self)).collect()
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// The unit roundoff of fp32 round-to-nearest: `u = 2^-24`.
pub const U32: f64 = 1.0 / 16_777_216.0;
