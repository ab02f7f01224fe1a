//! Fixed-seed random test data: a tiny generator (no dependency) and the gradient buckets the
//! collective tests draw from it.

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fixed-seed, good enough for test data.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
    /// The second output of the last Box-Muller transform of [`gaussian`](Self::gaussian).
    spare: Option<f64>,
}

impl SplitMix64 {
    /// The generator of `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            state: seed,
            spare: None,
        }
    }

    /// A generator for a sub-case, decorrelated from the parent seed.
    pub fn derive(seed: u64, tag: u64) -> Self {
        let mut g = Self::new(seed ^ tag.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        g.next_u64();
        g
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The high 32 bits of the next word.
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[0, n)` (n > 0); the modulo bias is irrelevant for test data.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[lo, hi)`, rounded to f32.
    pub fn range_f32(&mut self, lo: f64, hi: f64) -> f32 {
        (lo + (hi - lo) * self.uniform()) as f32
    }

    /// Standard normal by Box-Muller, both outputs used: every other call returns the spare
    /// output of the previous transform.
    pub fn gaussian(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some(r * t.sin());
        r * t.cos()
    }

    /// Standard normal by one Box-Muller transform per call (its cosine output only, two
    /// uniforms per value): a different sequence from [`gaussian`](Self::gaussian)'s.
    pub fn gaussian_unpaired(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A "gradient-like" value: normal times a random power of two in `[2^-20, 2^4]`, with
    /// an occasional outlier 100x larger, so groups have varied absmax and spread.
    pub fn grad_like(&mut self) -> f32 {
        let exp = self.below(25) as i32 - 20;
        let mut v = self.gaussian_unpaired() * 2f64.powi(exp);
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

/// `n` fp32 samples of N(0, sigma^2).
pub fn gaussian_f32(rng: &mut SplitMix64, n: usize, sigma: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.gaussian() * sigma) as f32).collect()
}

/// One fresh gaussian gradient bucket per rank.
pub fn rank_grads(seed: u64, world: usize, numel: usize, sigma: f64) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(seed);
    (0..world)
        .map(|_| gaussian_f32(&mut rng, numel, sigma))
        .collect()
}
