//! Hadamard smoothing (docs/numerics.md §3) on heavy-tailed gradients: TLq-HS (H32 on) against TLq
//! (off) at the same bits on the same fresh data.
//!
//! The gradients model a flattened weight-gradient matrix with rows of `HIDDEN` elements:
//! gaussian noise plus a few outlier channels (columns, the same on every rank, as in a real
//! model) about 100x larger. Without smoothing an outlier sets the absmax scale of its whole
//! 128-element group, so every other element of that group is rounded on a grid ~100x too
//! coarse; H32 spreads the outlier over its 32-element block, and by Parseval the inverse
//! transform divides the transformed-domain RMS error by sqrt(32). Both codecs must stay
//! within their derived bounds, TLq-HS must have at least 1.5x lower RMS error (averaged
//! over several buckets and routes), and on plain gaussian data it must not be worse by
//! more than a little.

use sdp4bit::Preset;
use sdp4bit::layout::Topology;
use sdp4bit_test_support::{
    cluster::reduce_scatter_ok,
    error_stats::{assert_within_opts, compare},
    random::SplitMix64,
    reference::grad::grad_reference,
    setups::cfg,
};

const HIDDEN: usize = 1024;
const OUTLIER_CHANNELS: usize = 4;
const OUTLIER_SCALE: f64 = 100.0;

/// Every rank's bucket: N(0, sigma^2) plus `OUTLIER_CHANNELS` columns at 100x.
fn heavy_tailed(seed: u64, w: usize, numel: usize, sigma: f64, outliers: bool) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(seed);
    let channels: Vec<usize> = (0..OUTLIER_CHANNELS).map(|_| rng.below(HIDDEN)).collect();
    (0..w)
        .map(|_| {
            (0..numel)
                .map(|i| {
                    let scale = if outliers && channels.contains(&(i % HIDDEN)) {
                        OUTLIER_SCALE
                    } else {
                        1.0
                    };
                    (rng.gaussian() * sigma * scale) as f32
                })
                .collect()
        })
        .collect()
}

/// `(sum of squared errors of TLq-HS, of TLq, elements)` over `buckets` fresh buckets.
fn compare_codecs(topo: &Topology, buckets: u64, outliers: bool, seed: u64) -> (f64, f64, usize) {
    let hs = cfg(Preset::Sdp4bit, &[]);
    let tlq = cfg(Preset::Sdp4bit, &[("grad_codec", "tlq")]);
    assert_eq!(hs.grad.hadamard_block, Some(32));
    assert_eq!(tlq.grad.hadamard_block, None);
    assert_eq!(
        (hs.grad.intra_bits, hs.grad.inter_bits, hs.grad.group_size),
        (
            tlq.grad.intra_bits,
            tlq.grad.inter_bits,
            tlq.grad.group_size
        ),
        "same bits and groups"
    );
    let w = topo.world();
    let numel = w * 12_345;
    let (mut e_hs, mut e_tlq, mut n) = (0.0, 0.0, 0);
    for b in 0..buckets {
        let grads = heavy_tailed(seed + b, w, numel, 1e-3, outliers);
        for (config, acc) in [(&hs, &mut e_hs), (&tlq, &mut e_tlq)] {
            let shards = reduce_scatter_ok(config, topo, &grads, b as u32, 17 + b);
            let reference = grad_reference(config, topo, &grads, 17 + b);
            let st = compare(&reference, &shards);
            // With 100x outliers TLq's honest mean-square bound is close to the data's
            // energy, so only the gaussian runs demand a non-vacuous bound; the 1.5x
            // comparison is the teeth here.
            assert_within_opts(
                &st,
                2048,
                !outliers,
                &format!("{config} bucket {b} outliers={outliers}"),
            );
            *acc += st.sum_err2;
        }
        n += numel;
    }
    (e_hs, e_tlq, n)
}

fn routes() -> Vec<(&'static str, Topology)> {
    vec![
        (
            "2x2 (8-bit intra, 4-bit inter)",
            Topology::uniform(2, 2).unwrap(),
        ),
        ("D=4 x M=2", Topology::uniform(2, 4).unwrap()),
        (
            "D=1 x M=4 (one 4-bit level)",
            Topology::uniform(4, 1).unwrap(),
        ),
        (
            "D=4 x M=1 (one 8-bit level)",
            Topology::uniform(1, 4).unwrap(),
        ),
    ]
}

#[test]
fn hadamard_lowers_error_on_outlier_channels() {
    let (mut all_hs, mut all_tlq) = (0.0, 0.0);
    for (i, (name, topo)) in routes().into_iter().enumerate() {
        let (e_hs, e_tlq, n) = compare_codecs(&topo, 4, true, 0xbad0 + 100 * i as u64);
        let (rms_hs, rms_tlq) = ((e_hs / n as f64).sqrt(), (e_tlq / n as f64).sqrt());
        eprintln!(
            "{name}: outlier channels: rms error TLq-HS {rms_hs:.3e}, TLq {rms_tlq:.3e}, \
             ratio {:.2}",
            rms_tlq / rms_hs
        );
        assert!(
            rms_tlq >= 1.5 * rms_hs,
            "{name}: TLq-HS rms {rms_hs:e} is not 1.5x below TLq's {rms_tlq:e}"
        );
        all_hs += e_hs;
        all_tlq += e_tlq;
    }
    assert!(all_tlq >= 2.25 * all_hs, "averaged over every route");
}

#[test]
fn hadamard_does_not_hurt_gaussian_gradients() {
    for (i, (name, topo)) in routes().into_iter().enumerate() {
        let (e_hs, e_tlq, n) = compare_codecs(&topo, 2, false, 0x600d + 100 * i as u64);
        let (rms_hs, rms_tlq) = ((e_hs / n as f64).sqrt(), (e_tlq / n as f64).sqrt());
        eprintln!(
            "{name}: gaussian: rms error TLq-HS {rms_hs:.3e}, TLq {rms_tlq:.3e}, ratio {:.2}",
            rms_tlq / rms_hs
        );
        // Gaussian blocks stay gaussian under H32 (variance x32, undone by the inverse), so
        // the errors should match; allow 25%.
        assert!(
            rms_hs <= 1.25 * rms_tlq,
            "{name}: TLq-HS rms {rms_hs:e} much worse than TLq's {rms_tlq:e} on gaussian data"
        );
    }
}
