//! The exact answer and the derived error bounds of one gradient reduce-scatter.

use sdp4bit::layout::Topology;
use sdp4bit::{Config, GradCodec, Rounding};

use super::route::{RefRoute, ref_route};
use super::signal::{
    Signal, hadamard_forward_signal, hadamard_inverse_bounds, quantize_signal, sum_signals,
};
use super::{EPS, FP_SAFETY};

/// The exact answer and the derived bounds of one reduce-scatter, indexed by bucket position
/// (shard z holds positions `z * S .. (z + 1) * S`).
#[derive(Debug, Clone)]
pub struct GradRef {
    /// The route the reduce-scatter takes.
    pub route: RefRoute,
    /// `sum_r x_r` in f64.
    pub exact: Vec<f64>,
    /// `((x_0 + x_1) + x_2) + ...` in fp32: what the baseline must return bit for bit.
    pub exact_f32: Vec<f32>,
    /// Worst-case per-element bound on `|shard - exact|`.
    pub bound: Vec<f64>,
    /// Per-element bound on `E[err^2]` (see [`crate::error_stats`]).
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
