//! Shared helpers of the collective-algorithm tests: a fixed-seed generator, the topologies
//! every sweep covers, drivers that run the collectives on a [`LocalCluster`], and the f64
//! references that turn the exact inputs into per-element error bounds.
//!
//! # How the error bounds are derived
//!
//! Notation: `eps = 2^-24` is the unit roundoff of fp32 round-to-nearest; `fl(x)` is the fp32
//! result of an operation, `|fl(x) - x| <= eps |x|`. Every quantity below is an upper bound
//! computed in f64 from the exact fp32 inputs (f64 rounding, `2^-53` relative, is ~2^29 times
//! smaller than the fp32 slack terms and is absorbed by the factor-2 safety on them).
//!
//! A *signal* is what one fp32 buffer holds at one stage of the pipeline: per element an exact
//! value `v` (f64, computed from the inputs with exact arithmetic) and a bound `b` on
//! `|fp32 value - v|`. Stages:
//!
//! 1. **Group quantizer** (SPEC §1) of a group whose fp32 values are `v +- b`:
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
//!    `max_i(|P_i| + E_i) / L2` — the brief's "(sum over the node's ranks of (absmax +
//!    level-1 bound)) / L2", made element-wise (never looser than that).
//! 2. **fp32 sum of k signals in rank order**: `v = sum v_r`, and the sum's rounding adds at
//!    most `(k - 1) eps sum_r (|v_r| + b_r)` (the classical `gamma_{k-1}` bound).
//! 3. **Hadamard forward** (SPEC §3, unnormalized butterfly over blocks of `B`, exact fp32
//!    inputs `x`): after stage `t` the error is at most `2 E_{t-1} + eps ||x||_1`, so after
//!    `log2 B` stages `b_i <= (B - 1) eps ||x_block||_1`; `v = H x` exactly.
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
//! # Mean-square bound (teeth for the SR and RN codecs)
//!
//! The worst-case bound above is loose by design (e.g. with Hadamard on it charges every
//! output the *mean* of the transformed-domain errors, which are `sqrt(B)` times the data),
//! so on its own a broken collective that returned zeros could pass it. Every quantized
//! codec is therefore also checked in mean square. For SR a quantization error `d` has
//! `E[d | inputs] = 0` and `E[d^2] = f (1 - f) s^2 <= s^2 / 4`, and errors of different
//! quantizations are martingale differences (each stage's rounding uses fresh, independent
//! Philox uniforms), so their variances add. With Hadamard on, Parseval on the orthogonal
//! `H / sqrt(B)` makes the block-mean of `E[err^2]` exactly `1/B` times the transformed-domain
//! block-mean. Hence `E[err_i^2] <= var_i = (sqrt(sum s^2/4 [block-mean / B]) + fp_i)^2`
//! where `fp_i` is the deterministic fp32 slack. RN has `d^2 <= s^2 / 4` deterministically;
//! the cross terms of different ranks' errors vanish in expectation over the independent
//! symmetric random inputs the tests draw, so the same `var` bounds the expected MSE. A test
//! asserts `mean(err^2) <= 1.25 mean(var)` over >= 2048 elements (the 25% is room for the
//! sample mean's fluctuation, which at that size is a few percent of `mean(var)`; for uniform
//! fractional parts the expectation itself is about `2/3 mean(var)`) and that the bound is
//! not vacuous: `mean(var) < 0.1 mean(sum_r x_r^2)` (the inputs' energy, which a collective
//! returning zeros would show as its MSE).

#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use half::bf16;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, GradReduceScatter, WeightAllGather};
use sdp4bit::plan::Topology;
use sdp4bit::{Config, GradCodec, Preset, Result, Rounding, WeightCodec};

/// Unit roundoff of fp32 round-to-nearest.
pub const EPS: f64 = 1.0 / 16_777_216.0;

/// Safety factor on the first-order fp32 slack terms (covers second-order `eps^2` terms and
/// the f64 evaluation of the reference, both below `2^-40` relative).
const FP_SAFETY: f64 = 2.0;

// ------------------------------------------------------------------------------------------
// Random data
// ------------------------------------------------------------------------------------------

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fixed-seed, good enough for test data.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
    spare: Option<f64>,
}

impl SplitMix64 {
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

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal by Box-Muller (both outputs used).
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

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
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

/// A stable digest of a byte slice (SipHash with fixed keys).
pub fn digest<T: Hash + ?Sized>(x: &T) -> u64 {
    let mut h = DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

pub fn bf16_bits(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

pub fn f32_bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

// ------------------------------------------------------------------------------------------
// Configs and topologies
// ------------------------------------------------------------------------------------------

/// `Config::from_overrides`, unwrapped with the overrides in the message.
pub fn cfg(preset: Preset, overrides: &[(&str, &str)]) -> Config {
    Config::from_overrides(preset, overrides.iter().copied())
        .unwrap_or_else(|e| panic!("config {preset} {overrides:?}: {e}"))
}

/// `(D, M)`: ranks per node and nodes, every factorisation of W in {1, 2, 3, 4, 6, 8} the
/// brief names (D = 1 and M = 1 included).
pub const FACTORS: [(usize, usize); 16] = [
    (1, 1),
    (1, 2),
    (2, 1),
    (1, 3),
    (3, 1),
    (2, 2),
    (1, 4),
    (4, 1),
    (3, 2),
    (2, 3),
    (6, 1),
    (1, 6),
    (2, 4),
    (4, 2),
    (8, 1),
    (1, 8),
];

/// Every uniform `D x M` topology of [`FACTORS`], a non-uniform one (3 + 1 ranks), another
/// non-uniform one (1 + 2, arbitrary labels) and an interleaved uniform one (DP ranks 0, 2 on
/// one node, 1, 3 on the other), each with a name for failure messages.
pub fn all_topologies() -> Vec<(String, Topology)> {
    let mut out: Vec<(String, Topology)> = FACTORS
        .iter()
        .map(|&(d, m)| {
            (
                format!("D={d} x M={m}"),
                Topology::uniform(m, d).expect("uniform topology"),
            )
        })
        .collect();
    for (name, labels) in [
        ("labels [0,0,0,1] (non-uniform)", vec![0u64, 0, 0, 1]),
        ("labels [7,3,3] (non-uniform)", vec![7, 3, 3]),
        ("labels [0,1,0,1] (interleaved 2x2)", vec![0, 1, 0, 1]),
    ] {
        out.push((
            name.to_string(),
            Topology::from_node_labels(&labels).expect("labelled topology"),
        ));
    }
    out
}

// ------------------------------------------------------------------------------------------
// Drivers
// ------------------------------------------------------------------------------------------

/// Runs one reduce-scatter of `grads[r]` (rank r's bucket) at `step` on a fresh cluster and
/// returns every rank's shard or error. Shards start as NaN so unwritten elements show.
pub fn reduce_scatter(
    config: &Config,
    topo: &Topology,
    grads: &[Vec<f32>],
    bucket_id: u32,
    step: u64,
) -> Vec<Result<Vec<f32>>> {
    let cluster = LocalCluster::new(topo.clone());
    let numel = grads[0].len();
    let w = topo.world();
    cluster.run(|c| {
        let me = c.world.rank();
        let mut rs = GradReduceScatter::new(config, topo, me, numel, bucket_id)?;
        let mut shard = vec![f32::NAN; numel / w];
        rs.run(c, &grads[me], &mut shard, step)?;
        Ok(shard)
    })
}

/// [`reduce_scatter`], panicking on any rank's error.
pub fn reduce_scatter_ok(
    config: &Config,
    topo: &Topology,
    grads: &[Vec<f32>],
    bucket_id: u32,
    step: u64,
) -> Vec<Vec<f32>> {
    reduce_scatter(config, topo, grads, bucket_id, step)
        .into_iter()
        .enumerate()
        .map(|(r, s)| s.unwrap_or_else(|e| panic!("rank {r}: {e} (config {config})")))
        .collect()
}

/// One weight all-gather: every replica starts from `before`, rank r writes `new`'s shard r
/// into its own params, then all-gathers at `step`. Returns each replica's params.
pub fn all_gather_once(
    config: &Config,
    topo: &Topology,
    before: &[bf16],
    new: &[bf16],
    bucket_id: u32,
    step: u64,
) -> Vec<Result<Vec<bf16>>> {
    let cluster = LocalCluster::new(topo.clone());
    let w = topo.world();
    let s = before.len() / w;
    cluster.run(|c| {
        let me = c.world.rank();
        let mut ag = WeightAllGather::new(config, topo, me, bucket_id, before)?;
        let mut params = before.to_vec();
        params[me * s..(me + 1) * s].copy_from_slice(&new[me * s..(me + 1) * s]);
        ag.run(c.world, &mut params, step)?;
        Ok(params)
    })
}

// ------------------------------------------------------------------------------------------
// Reference: signals and bounds
// ------------------------------------------------------------------------------------------

/// One fp32 buffer at one pipeline stage (see the module docs): exact values `v`, worst-case
/// bound `b` on the fp32 error, the SR/RN variance budget `qvar` (sum of `s^2/4`) and the
/// deterministic fp32 part `fp` of `b`.
#[derive(Debug, Clone)]
struct Signal {
    v: Vec<f64>,
    b: Vec<f64>,
    qvar: Vec<f64>,
    fp: Vec<f64>,
}

impl Signal {
    fn exact(v: Vec<f64>) -> Self {
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
pub fn group_quant_bound(
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

fn quantize_signal(sig: &mut Signal, bits: u8, symmetric: bool, rounding: Rounding) {
    let (main, fp, s) = group_quant_bound(&sig.v, &sig.b, bits, symmetric, rounding);
    for i in 0..sig.v.len() {
        sig.b[i] += main + fp;
        sig.fp[i] += fp;
        sig.qvar[i] += s * s / 4.0;
    }
}

/// fp32 sum of `sigs` in order (stage 2).
fn sum_signals(sigs: &[&Signal]) -> Signal {
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
pub fn hadamard_f64(x: &mut [f64], block: usize) {
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
fn hadamard_forward_signal(x: &[f64], block: usize) -> Signal {
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
fn hadamard_inverse_bounds(sig: &Signal, block: usize) -> (Vec<f64>, Vec<f64>) {
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

/// The gradient route SPEC §0/§4/§5 prescribes, derived independently of `plan::GradRoute`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefRoute {
    /// W == 1.
    Copy,
    /// fp32 reduce-scatter (baseline codec, or before `grad_quant_start_step`).
    Exact,
    /// Global-QSGD with `bits`-bit integers.
    Global { bits: u8 },
    /// One all-to-all over all W ranks at `bits`.
    OneLevel { bits: u8 },
    /// Intra-node at `intra` bits, then inter-node at `inter` bits.
    TwoLevel { intra: u8, inter: u8 },
}

pub fn ref_route(config: &Config, topo: &Topology, step: u64) -> RefRoute {
    let g = &config.grad;
    let w = topo.world();
    if w == 1 {
        return RefRoute::Copy;
    }
    if g.codec == GradCodec::None || step < config.grad_quant_start_step {
        return RefRoute::Exact;
    }
    match g.codec {
        GradCodec::GlobalQsgd => RefRoute::Global {
            bits: g.global_bits.unwrap_or(if w <= 127 { 8 } else { 16 }),
        },
        GradCodec::Qsdp => RefRoute::OneLevel { bits: g.inter_bits },
        _ => match topo.per_node() {
            None => RefRoute::OneLevel { bits: g.inter_bits },
            Some(d) if d == w => RefRoute::OneLevel { bits: g.intra_bits },
            Some(1) => RefRoute::OneLevel { bits: g.inter_bits },
            Some(_) => RefRoute::TwoLevel {
                intra: g.intra_bits,
                inter: g.inter_bits,
            },
        },
    }
}

/// The exact answer and the derived bounds of one reduce-scatter, indexed by bucket position
/// (shard z holds positions `z * S .. (z + 1) * S`).
#[derive(Debug, Clone)]
pub struct GradRef {
    pub route: RefRoute,
    /// `sum_r x_r` in f64.
    pub exact: Vec<f64>,
    /// `((x_0 + x_1) + x_2) + ...` in fp32: what the baseline must return bit for bit.
    pub exact_f32: Vec<f32>,
    /// Worst-case per-element bound on `|shard - exact|`.
    pub bound: Vec<f64>,
    /// Per-element bound on `E[err^2]` (module docs).
    pub var: Vec<f64>,
    /// `sum_r |x_r|`.
    pub l1: Vec<f64>,
    /// `sum_r x_r^2`.
    pub energy: Vec<f64>,
}

/// Computes [`GradRef`] of `config` on `topo` at `step` from every rank's exact bucket.
pub fn grad_reference(config: &Config, topo: &Topology, grads: &[Vec<f32>], step: u64) -> GradRef {
    let w = topo.world();
    let numel = grads[0].len();
    assert_eq!(numel % w, 0);
    let s_len = numel / w;
    let route = ref_route(config, topo, step);
    let mut exact = vec![0.0f64; numel];
    let mut exact_f32 = grads[0].clone();
    let mut l1 = vec![0.0f64; numel];
    let mut energy = vec![0.0f64; numel];
    for (r, g) in grads.iter().enumerate() {
        for i in 0..numel {
            let x = f64::from(g[i]);
            exact[i] += x;
            l1[i] += x.abs();
            energy[i] += x * x;
            if r > 0 {
                exact_f32[i] += g[i];
            }
        }
    }
    let mut bound = vec![0.0f64; numel];
    let mut var = vec![0.0f64; numel];
    match route {
        RefRoute::Copy | RefRoute::Exact => {}
        RefRoute::Global { bits } => {
            let a = grads
                .iter()
                .flat_map(|g| g.iter())
                .fold(0.0f32, |m, v| m.max(v.abs()));
            let k = ((1usize << (bits - 1)) - 1) / w;
            let s = f64::from(a / k as f32);
            let a = f64::from(a);
            let wf = w as f64;
            let per_rank_main = match config.grad.rounding {
                Rounding::Stochastic => s,
                Rounding::Nearest => 0.5 * s,
            };
            let per_rank_fp = FP_SAFETY * EPS * (4.0 * a + 4.0 * s);
            for i in 0..numel {
                let fp = wf * per_rank_fp + FP_SAFETY * EPS * (exact[i].abs() + wf * s);
                bound[i] = wf * per_rank_main + fp;
                var[i] = ((wf * s * s / 4.0).sqrt() + fp).powi(2);
            }
        }
        RefRoute::OneLevel { .. } | RefRoute::TwoLevel { .. } => {
            let gc = &config.grad;
            let g = gc.group_size;
            let symmetric = gc.codec != GradCodec::Qsdp;
            let rounding = gc.rounding;
            let nodes: Vec<Vec<usize>> = (0..topo.nodes())
                .map(|n| topo.intra_group(topo.rank_at(n, 0)).to_vec())
                .collect();
            for z in 0..w {
                for j in 0..s_len.div_ceil(g) {
                    let signals: Vec<Signal> = (0..w)
                        .map(|r| {
                            let x: Vec<f64> = (0..g)
                                .map(|k| {
                                    let o = j * g + k;
                                    if o < s_len {
                                        f64::from(grads[r][z * s_len + o])
                                    } else {
                                        0.0
                                    }
                                })
                                .collect();
                            match gc.hadamard_block {
                                Some(block) => hadamard_forward_signal(&x, block),
                                None => Signal::exact(x),
                            }
                        })
                        .collect();
                    let total = match route {
                        RefRoute::OneLevel { bits } => {
                            let q: Vec<Signal> = signals
                                .into_iter()
                                .map(|mut s| {
                                    quantize_signal(&mut s, bits, symmetric, rounding);
                                    s
                                })
                                .collect();
                            sum_signals(&q.iter().collect::<Vec<_>>())
                        }
                        RefRoute::TwoLevel { intra, inter } => {
                            let q: Vec<Signal> = signals
                                .into_iter()
                                .map(|mut s| {
                                    quantize_signal(&mut s, intra, symmetric, rounding);
                                    s
                                })
                                .collect();
                            let partials: Vec<Signal> = nodes
                                .iter()
                                .map(|members| {
                                    let mut p = sum_signals(
                                        &members.iter().map(|&r| &q[r]).collect::<Vec<_>>(),
                                    );
                                    quantize_signal(&mut p, inter, symmetric, rounding);
                                    p
                                })
                                .collect();
                            sum_signals(&partials.iter().collect::<Vec<_>>())
                        }
                        _ => unreachable!(),
                    };
                    let (gb, gv) = match gc.hadamard_block {
                        Some(block) => hadamard_inverse_bounds(&total, block),
                        None => (
                            total.b.clone(),
                            total
                                .qvar
                                .iter()
                                .zip(&total.fp)
                                .map(|(q, f)| (q.sqrt() + f).powi(2))
                                .collect(),
                        ),
                    };
                    for k in 0..g {
                        let o = j * g + k;
                        if o < s_len {
                            bound[z * s_len + o] = gb[k];
                            var[z * s_len + o] = gv[k];
                        }
                    }
                }
            }
        }
    }
    GradRef {
        route,
        exact,
        exact_f32,
        bound,
        var,
        l1,
        energy,
    }
}

/// Summary of a comparison of shards with a [`GradRef`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ErrStats {
    pub n: usize,
    /// Largest `|err| / bound` (0 when every error is 0).
    pub max_ratio: f64,
    /// Where it happened: (bucket index, shard value, exact, bound).
    pub worst: (usize, f64, f64, f64),
    pub sum_err2: f64,
    pub sum_var: f64,
    pub sum_bound: f64,
    pub sum_l1: f64,
    pub sum_energy: f64,
    pub non_finite: usize,
}

impl ErrStats {
    pub fn mse(&self) -> f64 {
        self.sum_err2 / self.n as f64
    }
    pub fn mean_var(&self) -> f64 {
        self.sum_var / self.n as f64
    }
    pub fn mean_energy(&self) -> f64 {
        self.sum_energy / self.n as f64
    }
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
/// `min_n` elements, the mean-square bound and its non-vacuity (module docs).
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

/// Asserts two shard sets are bit-identical (NaN-safe), naming the first difference.
pub fn assert_bits_eq(got: &[f32], want: &[f32], ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{ctx}: element {i} of {} differs: got {:e} ({:#010x}), want {:e} ({:#010x})",
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

// ------------------------------------------------------------------------------------------
// Weight references
// ------------------------------------------------------------------------------------------

/// Half a bf16 ulp at magnitude `v` (bf16 has 8 significant bits: ulp = 2^(e - 7) for
/// `2^e <= v < 2^(e + 1)`), an upper bound on bf16 round-to-nearest's error for any value
/// of magnitude at most `v`.
pub fn bf16_half_ulp(v: f64) -> f64 {
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
///   the group (module docs) plus `bf16_half_ulp(|new| + e)`;
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

// ------------------------------------------------------------------------------------------
// A recording communicator
// ------------------------------------------------------------------------------------------

/// One collective call as a [`Recorder`] saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub op: &'static str,
    /// Bytes this rank passed in.
    pub send: Vec<u8>,
    /// Bytes this rank got back.
    pub recv: Vec<u8>,
}

/// A [`Comm`] that forwards to `inner` and records every payload (sent and received bytes).
#[derive(Debug)]
pub struct Recorder<'a, C: Comm> {
    pub inner: &'a C,
    pub log: std::cell::RefCell<Vec<Record>>,
}

impl<'a, C: Comm> Recorder<'a, C> {
    pub fn new(inner: &'a C) -> Self {
        Self {
            inner,
            log: std::cell::RefCell::new(Vec::new()),
        }
    }

    pub fn take(&self) -> Vec<Record> {
        std::mem::take(&mut *self.log.borrow_mut())
    }

    fn push(&self, op: &'static str, send: &[u8], recv: &[u8]) {
        self.log.borrow_mut().push(Record {
            op,
            send: send.to_vec(),
            recv: recv.to_vec(),
        });
    }
}

impl<C: Comm> Comm for Recorder<'_, C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.inner.all_gather(send, recv)?;
        self.push("all_gather", send, recv);
        Ok(())
    }

    fn all_to_all(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.inner.all_to_all(send, recv)?;
        self.push("all_to_all", send, recv);
        Ok(())
    }

    fn all_reduce_max(&self, value: f32) -> Result<f32> {
        let out = self.inner.all_reduce_max(value)?;
        self.push("all_reduce_max", &value.to_le_bytes(), &out.to_le_bytes());
        Ok(out)
    }

    fn reduce_scatter_sum<T: sdp4bit::collective::SumElement>(
        &self,
        send: &[T],
        recv: &mut [T],
    ) -> Result<()> {
        self.inner.reduce_scatter_sum(send, recv)?;
        self.push(
            "reduce_scatter",
            bytemuck::cast_slice(send),
            bytemuck::cast_slice(recv),
        );
        Ok(())
    }
}

/// Every rank's records of one reduce-scatter: `(shard, world log, intra log, inter log)`.
pub type RankLogs = (Vec<f32>, Vec<Record>, Vec<Record>, Vec<Record>);

/// Turns what `LocalCluster::run` returns when each rank collects one value per step into
/// one list over ranks per step, panicking with the failing rank's error and `context`.
pub fn per_step<T>(per_rank: Vec<Result<Vec<T>>>, context: &str) -> Vec<Vec<T>> {
    let mut per_rank: Vec<std::vec::IntoIter<T>> = per_rank
        .into_iter()
        .enumerate()
        .map(|(r, x)| {
            x.unwrap_or_else(|e| panic!("rank {r}: {e} ({context})"))
                .into_iter()
        })
        .collect();
    let steps = per_rank.first().map_or(0, |r| r.len());
    (0..steps)
        .map(|_| {
            per_rank
                .iter_mut()
                .map(|r| r.next().expect("every rank ran every step"))
                .collect()
        })
        .collect()
}

/// Runs one reduce-scatter per entry of `steps` (fresh objects, `steps[k] = (step, grads)`)
/// through [`Recorder`]s and returns every rank's shards and logs per step.
pub fn reduce_scatter_recorded(
    config: &Config,
    topo: &Topology,
    bucket_id: u32,
    steps: &[(u64, Vec<Vec<f32>>)],
) -> Vec<Vec<RankLogs>> {
    let cluster = LocalCluster::new(topo.clone());
    let w = topo.world();
    let per_rank = cluster.run(|c| -> Result<Vec<RankLogs>> {
        let me = c.world.rank();
        let world = Recorder::new(c.world);
        let intra = c.intra.map(Recorder::new);
        let inter = c.inter.map(Recorder::new);
        let groups = sdp4bit::collective::CommGroups {
            world: &world,
            intra: intra.as_ref(),
            inter: inter.as_ref(),
        };
        let mut out = Vec::new();
        for (step, grads) in steps {
            let numel = grads[me].len();
            let mut rs = GradReduceScatter::new(config, topo, me, numel, bucket_id)?;
            let mut shard = vec![f32::NAN; numel / w];
            rs.run(&groups, &grads[me], &mut shard, *step)?;
            out.push((
                shard,
                world.take(),
                intra.as_ref().map_or(Vec::new(), |r| r.take()),
                inter.as_ref().map_or(Vec::new(), |r| r.take()),
            ));
        }
        Ok(out)
    });
    per_step(per_rank, "recorded reduce-scatter")
}
