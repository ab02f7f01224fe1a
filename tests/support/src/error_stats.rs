//! Comparing reduce-scatter outputs with their [`GradRef`] and asserting the derived bounds.
//!
//! # Mean-square bound (teeth for the SR and RN codecs)
//!
//! The worst-case bound of [`crate::reference`] is loose by design (e.g. with Hadamard on it
//! charges every output the *mean* of the transformed-domain errors, which are `sqrt(B)` times
//! the data), so on its own a broken collective that returned zeros could pass it. Every
//! quantized codec is therefore also checked in mean square. For SR a quantization error `d`
//! has `E[d | inputs] = 0` and `E[d^2] = f (1 - f) s^2 <= s^2 / 4`, and errors of different
//! quantizations are martingale differences (each stage's rounding uses fresh, independent
//! Philox uniforms), so their variances add. With Hadamard on, Parseval on the orthogonal
//! `H / sqrt(B)` makes the block-mean of `E[err^2]` exactly `1/B` times the transformed-domain
//! block-mean. Hence `E[err_i^2] <= var_i = (sqrt(sum s^2/4 [block-mean / B]) + fp_i)^2`
//! where `fp_i` is the deterministic fp32 slack. RN has `d^2 <= s^2 / 4` deterministically;
//! the cross terms of different ranks' errors vanish in expectation over the independent
//! symmetric random inputs the tests draw, so the same `var` bounds the expected MSE.
//! [`assert_within`] asserts `mean(err^2) <= 1.25 mean(var)` over >= `min_n` elements (the
//! 25% is room for the sample mean's fluctuation, which at 2048 elements is a few percent of
//! `mean(var)`; for uniform fractional parts the expectation itself is about `2/3 mean(var)`)
//! and that the bound is not vacuous: `mean(var) < 0.1 mean(sum_r x_r^2)` (the inputs'
//! energy, which a collective returning zeros would show as its MSE).

use crate::reference::grad::GradRef;

/// Summary of a comparison of shards with a [`GradRef`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ErrStats {
    /// Elements compared.
    pub n: usize,
    /// Largest `|err| / bound` (0 when every error is 0).
    pub max_ratio: f64,
    /// Where it happened: (bucket index, shard value, exact, bound).
    pub worst: (usize, f64, f64, f64),
    /// Sum of the squared errors of the finite outputs.
    pub sum_err2: f64,
    /// Sum of the mean-square bounds ([`GradRef::var`]).
    pub sum_var: f64,
    /// Sum of the worst-case bounds ([`GradRef::bound`]).
    pub sum_bound: f64,
    /// Sum of [`GradRef::l1`].
    pub sum_l1: f64,
    /// Sum of [`GradRef::energy`].
    pub sum_energy: f64,
    /// Outputs that are NaN or infinite.
    pub non_finite: usize,
}

impl ErrStats {
    /// Mean squared error.
    pub fn mse(&self) -> f64 {
        self.sum_err2 / self.n as f64
    }
    /// Mean of the mean-square bounds.
    pub fn mean_var(&self) -> f64 {
        self.sum_var / self.n as f64
    }
    /// Mean energy of the inputs (`sum_r x_r^2` per element).
    pub fn mean_energy(&self) -> f64 {
        self.sum_energy / self.n as f64
    }
    /// Merges the statistics of another comparison into these.
    pub fn add(&mut self, o: &ErrStats) {
        if o.max_ratio > self.max_ratio {
            self.max_ratio = o.max_ratio;
            self.worst = o.worst;
        }
        self.n += o.n;
        self.sum_err2 += o.sum_err2;
        self.sum_var += o.sum_var;
        self.sum_bound += o.sum_bound;
        self.sum_l1 += o.sum_l1;
        self.sum_energy += o.sum_energy;
        self.non_finite += o.non_finite;
    }
    /// One line describing the statistics, for failure messages.
    pub fn summary(&self) -> String {
        format!(
            "n={} max err/bound={:.3e} at {:?} (index, got, exact, bound); mse={:.3e} \
             mean var bound={:.3e} (mse/var={:.3}); mean bound={:.3e} mean sum|x|={:.3e} \
             mean energy={:.3e}; non-finite={}",
            self.n,
            self.max_ratio,
            self.worst,
            self.mse(),
            self.mean_var(),
            self.mse() / self.mean_var(),
            self.sum_bound / self.n as f64,
            self.sum_l1 / self.n as f64,
            self.mean_energy(),
            self.non_finite
        )
    }
}

/// Compares every rank's shard with the reference.
pub fn compare(reference: &GradRef, shards: &[Vec<f32>]) -> ErrStats {
    let mut st = ErrStats::default();
    let s_len = shards[0].len();
    for (z, shard) in shards.iter().enumerate() {
        assert_eq!(shard.len(), s_len);
        for (o, &got) in shard.iter().enumerate() {
            let i = z * s_len + o;
            let (exact, bound) = (reference.exact[i], reference.bound[i]);
            st.n += 1;
            if !got.is_finite() {
                st.non_finite += 1;
                st.max_ratio = f64::INFINITY;
                st.worst = (i, f64::from(got), exact, bound);
                continue;
            }
            let err = (f64::from(got) - exact).abs();
            let ratio = if err == 0.0 { 0.0 } else { err / bound };
            if ratio > st.max_ratio {
                st.max_ratio = ratio;
                st.worst = (i, f64::from(got), exact, bound);
            }
            st.sum_err2 += err * err;
            st.sum_var += reference.var[i];
            st.sum_bound += bound;
            st.sum_l1 += reference.l1[i];
            st.sum_energy += reference.energy[i];
        }
    }
    st
}

/// Asserts the deterministic bound on every element, and, when the case has at least
/// `min_n` elements, the mean-square bound and its non-vacuity ([module docs](self)).
pub fn assert_within(st: &ErrStats, min_n: usize, ctx: &str) {
    assert_within_opts(st, min_n, true, ctx);
}

/// [`assert_within`], optionally without the non-vacuity check (for inputs, such as heavy
/// outliers, on which a codec's honest mean-square bound is close to the signal itself).
pub fn assert_within_opts(st: &ErrStats, min_n: usize, non_vacuous: bool, ctx: &str) {
    assert_eq!(
        st.non_finite,
        0,
        "{ctx}: non-finite output; {}",
        st.summary()
    );
    assert!(
        st.max_ratio <= 1.0,
        "{ctx}: error exceeds the derived bound; {}",
        st.summary()
    );
    if st.n >= min_n {
        assert!(
            !non_vacuous || st.mean_var() < 0.1 * st.mean_energy(),
            "{ctx}: vacuous mean-square bound; {}",
            st.summary()
        );
        assert!(
            st.mse() <= 1.25 * st.mean_var(),
            "{ctx}: mean-square error exceeds the derived bound; {}",
            st.summary()
        );
    }
}
