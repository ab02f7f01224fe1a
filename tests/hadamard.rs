//! The Walsh-Hadamard smoothing of docs/numerics.md §3 against an explicit Sylvester matrix in f64.

use sdp4bit::hadamard::{MAX_BLOCK, MIN_BLOCK, forward, inverse, is_supported_block};
use sdp4bit_test_support::random::SplitMix64;
use sdp4bit_test_support::reference::EPS;

const BLOCKS: [usize; 5] = [16, 32, 64, 128, 256];

/// Entry (i, j) of the Sylvester Hadamard matrix `H_n = [[H, H], [H, -H]]`:
/// `(-1)^popcount(i & j)`.
fn h(i: usize, j: usize) -> f64 {
    if (i & j).count_ones().is_multiple_of(2) {
        1.0
    } else {
        -1.0
    }
}

/// `H_n x` in f64. Not exact in general (inputs of very different exponents), but a
/// recursive f64 sum of n terms is off by at most `(n - 1) 2^-53 sum|x|` (+ second order);
/// [`f64_margin`] adds that, so the f32 bounds below stay rigorous.
fn sylvester(x: &[f32]) -> Vec<f64> {
    let n = x.len();
    (0..n)
        .map(|i| (0..n).map(|j| h(i, j) * f64::from(x[j])).sum())
        .collect()
}

/// `gamma_k = k u / (1 - k u)`, Higham's bound for k chained roundings, u = 2^-24.
fn gamma(k: usize) -> f64 {
    let ku = k as f64 * EPS;
    ku / (1.0 - ku)
}

/// Rounding error of the f64 references (the Sylvester sum and the f64 `sum |x|` used in the
/// bound): each is a recursive sum of at most n terms, off by at most `n 2^-53 sum|x|`
/// (1 + O(2^-45)); twice that covers both, with room for second-order terms.
fn f64_margin(n: usize, abs_sum: f64) -> f64 {
    2.0 * n as f64 * 2f64.powi(-52) * abs_sum
}

fn random_block(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    match rng.below(3) {
        0 => rng.vec_f32(n, |r| r.gaussian_unpaired() as f32),
        1 => rng.vec_f32(n, |r| r.grad_like()),
        _ => rng.vec_f32(n, |r| r.range_f32(-1e6, 1e6)),
    }
}

#[test]
fn supported_block_predicate() {
    assert_eq!((MIN_BLOCK, MAX_BLOCK), (16, 256));
    for b in 0..=1024usize {
        let want = BLOCKS.contains(&b);
        assert_eq!(is_supported_block(b), want, "is_supported_block({b})");
    }
    assert!(!is_supported_block(usize::MAX));
    assert!(!is_supported_block(1 << 40));
}

#[test]
fn sylvester_reference_is_orthogonal() {
    // Guard on the test's own reference: H_n H_n = n I.
    for n in BLOCKS {
        for i in 0..n {
            for k in 0..n {
                let dot: f64 = (0..n).map(|j| h(i, j) * h(j, k)).sum();
                assert_eq!(
                    dot,
                    if i == k { n as f64 } else { 0.0 },
                    "H_{n} row {i} col {k}"
                );
            }
        }
    }
}

#[test]
fn forward_matches_sylvester_matrix() {
    let mut rng = SplitMix64::new(0x4ada_0001);
    for n in BLOCKS {
        let k = n.trailing_zeros() as usize; // butterfly stages
        for trial in 0..40 {
            let x = random_block(&mut rng, n);
            let mut y = x.clone();
            forward(&mut y, n);
            let want = sylvester(&x);
            // Each output is a +/- sum of the n inputs evaluated as a binary tree of depth
            // k = log2 n, so |fl - exact| <= gamma_k * sum_j |x_j| (Higham, Thm 4.2 / eq. 4.4).
            let abs_sum: f64 = x.iter().map(|v| f64::from(v.abs())).sum();
            let bound = gamma(k) * abs_sum + f64_margin(n, abs_sum);
            for i in 0..n {
                let err = (f64::from(y[i]) - want[i]).abs();
                assert!(
                    err <= bound,
                    "block {n} trial {trial} output {i}: forward {} vs H x {} (err {err:e} > bound {bound:e})",
                    y[i],
                    want[i]
                );
            }
        }
    }
}

/// The textbook butterfly of docs/numerics.md §3 / `hadamard.rs`: stages h = 1, 2, 4, ..., n/2 in
/// this order, each replacing (a, b) = (x[j], x[j + h]) by (a + b, a - b). CPU and GPU must follow
/// exactly this order so their results agree bit for bit.
fn textbook_butterfly(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for base in (0..n).step_by(2 * h) {
            for j in base..base + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

#[test]
fn forward_and_inverse_follow_the_textbook_stage_order_bit_for_bit() {
    // Rounding depends on the order of additions, so this pins the operation order the CUDA
    // kernels reproduce (a reordered butterfly can stay within the error bound above and still
    // break CPU/GPU bit-exactness).
    let mut rng = SplitMix64::new(0x4ada_0005);
    for n in BLOCKS {
        for blocks in [1usize, 3] {
            for _ in 0..50 {
                let x = random_block(&mut rng, n * blocks);
                let mut got = x.clone();
                forward(&mut got, n);
                let mut got_inv = x.clone();
                inverse(&mut got_inv, n);
                for b in 0..blocks {
                    let mut want = x[b * n..(b + 1) * n].to_vec();
                    textbook_butterfly(&mut want);
                    for i in 0..n {
                        assert_eq!(
                            got[b * n + i].to_bits(),
                            want[i].to_bits(),
                            "forward block {n}, element {i}: {} vs textbook {}",
                            got[b * n + i],
                            want[i]
                        );
                        let want_inv = want[i] * (1.0 / n as f32);
                        assert_eq!(
                            got_inv[b * n + i].to_bits(),
                            want_inv.to_bits(),
                            "inverse block {n}, element {i}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn forward_is_exact_on_small_integers() {
    // Integers with |x| <= 2^10: every partial sum has |.| <= 256 * 2^10 = 2^18 < 2^24, so each
    // f32 addition is exact and the result must equal H x exactly; inverse returns x exactly
    // (the sums are exact again and 1/n is a power of two).
    let mut rng = SplitMix64::new(0x4ada_0002);
    for n in BLOCKS {
        for _ in 0..20 {
            let x: Vec<f32> = (0..n)
                .map(|_| (rng.below(2049) as i32 - 1024) as f32)
                .collect();
            let mut y = x.clone();
            forward(&mut y, n);
            let want = sylvester(&x);
            for i in 0..n {
                assert_eq!(f64::from(y[i]), want[i], "block {n} output {i}");
            }
            inverse(&mut y, n);
            assert_eq!(
                y, x,
                "inverse(forward(x)) != x for small integers, block {n}"
            );
        }
    }
}

#[test]
fn basis_vectors_give_matrix_columns() {
    for n in BLOCKS {
        for j in 0..n {
            let mut e = vec![0f32; n];
            e[j] = 1.0;
            forward(&mut e, n);
            for (i, &v) in e.iter().enumerate() {
                assert_eq!(f64::from(v), h(i, j), "H_{n}[{i}][{j}]");
            }
        }
    }
}

#[test]
fn inverse_matches_scaled_sylvester_and_round_trips() {
    let mut rng = SplitMix64::new(0x4ada_0003);
    for n in BLOCKS {
        let k = n.trailing_zeros() as usize;
        for trial in 0..40 {
            let x = random_block(&mut rng, n);

            // inverse alone = (1/n) H x: the butterfly error is gamma_k * sum|x| and the
            // multiplication by 1/n (a power of two) is exact for these magnitudes.
            let mut z = x.clone();
            inverse(&mut z, n);
            let want = sylvester(&x);
            let abs_sum: f64 = x.iter().map(|v| f64::from(v.abs())).sum();
            for i in 0..n {
                let err = (f64::from(z[i]) - want[i] / n as f64).abs();
                let bound = (gamma(k) * abs_sum + f64_margin(n, abs_sum)) / n as f64;
                assert!(
                    err <= bound,
                    "block {n} inverse output {i}: err {err:e} > {bound:e}"
                );
            }

            // Round trip: y = fl(Hx) = Hx + e1 with |e1_i| <= g * sum|x|; then
            // fl(H y) = H y + e2 with |e2_i| <= g * sum|y|. So n * x_hat - n * x = H e1 + e2
            // and |x_hat_i - x_i| <= g * (sum|x| + sum|y| / n), g = gamma_k.
            let mut y = x.clone();
            forward(&mut y, n);
            let y_abs_sum: f64 = y.iter().map(|v| f64::from(v.abs())).sum();
            let mut back = y.clone();
            inverse(&mut back, n);
            let bound =
                gamma(k) * (abs_sum + y_abs_sum / n as f64) + f64_margin(n, abs_sum + y_abs_sum);
            for i in 0..n {
                let err = (f64::from(back[i]) - f64::from(x[i])).abs();
                assert!(
                    err <= bound,
                    "block {n} trial {trial}: inverse(forward(x))[{i}] = {} vs {} (err {err:e} > {bound:e})",
                    back[i],
                    x[i]
                );
            }
        }
    }
}

#[test]
fn blocks_are_transformed_independently() {
    let mut rng = SplitMix64::new(0x4ada_0004);
    for n in BLOCKS {
        for blocks in [1usize, 2, 3, 7] {
            let x = random_block(&mut rng, n * blocks);
            let mut all = x.clone();
            forward(&mut all, n);
            let mut all_inv = x.clone();
            inverse(&mut all_inv, n);
            for b in 0..blocks {
                let mut one = x[b * n..(b + 1) * n].to_vec();
                forward(&mut one, n);
                assert_eq!(
                    &all[b * n..(b + 1) * n],
                    &one[..],
                    "block {b} of {blocks} (size {n}) depends on its neighbours (forward)"
                );
                let mut one = x[b * n..(b + 1) * n].to_vec();
                inverse(&mut one, n);
                assert_eq!(&all_inv[b * n..(b + 1) * n], &one[..], "inverse block {b}");
            }
        }
    }
}

#[test]
fn empty_input_is_a_no_op() {
    for n in BLOCKS {
        let mut v: Vec<f32> = Vec::new();
        forward(&mut v, n);
        inverse(&mut v, n);
        assert!(v.is_empty());
    }
}

#[test]
fn smoothing_spreads_an_outlier() {
    // The purpose of the smoothing (docs/numerics.md §3): one outlier of size A in a block of n
    // becomes n values of size A (plus the small entries), so the block's absmax relative to its
    // RMS drops from ~sqrt(n) to ~1.
    let n = 32;
    let mut x = vec![0f32; n];
    x[5] = 1000.0;
    forward(&mut x, n);
    assert!(x.iter().all(|v| v.abs() == 1000.0), "{x:?}");
}

#[test]
#[should_panic]
fn forward_rejects_unsupported_block() {
    let mut v = vec![0f32; 48];
    forward(&mut v, 48);
}

#[test]
#[should_panic]
fn forward_rejects_length_not_multiple_of_block() {
    let mut v = vec![0f32; 48];
    forward(&mut v, 32);
}

#[test]
#[should_panic]
fn inverse_rejects_unsupported_block() {
    let mut v = vec![0f32; 512];
    inverse(&mut v, 512);
}
