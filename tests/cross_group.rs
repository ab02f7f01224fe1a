//! The Global-QSGD all-reduce across the groups of hybrid sharding (docs/numerics.md §7.6),
//! over the in-process communicator: every group ends with the same bits, equal to a scalar
//! reference built from the spec (global absmax, stochastic rounding at `absmax / K` with
//! each rank's own stream, integer sum, one multiplication), within `n` scales of the exact
//! sum; the largest codes of every rank sum without overflow (the in-process sums are
//! checked); a NaN anywhere makes every result NaN; bad plans are refused naming the problem.

use half::bf16;
use sdp4bit::backend::GradElement;
use sdp4bit::backend::cpu::Host;
use sdp4bit::collective::local::LocalGroup;
use sdp4bit::collective::{CrossGroupAllReduce, global_k};
use sdp4bit::rng::{Stage, UniformStream, stream_id};
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::random::SplitMix64;

const BUCKET: u32 = 7;
const STEP: u64 = 11;

fn config(bits: &str) -> Config {
    Config::from_overrides(
        Preset::Sdp4bit,
        [("cross_group_bits", bits), ("seed", "99")],
    )
    .unwrap()
}

/// The stream rank of group member `r` (its index in the whole DP world: here 10 + 3 r).
fn stream_rank(r: usize) -> usize {
    10 + 3 * r
}

/// Each rank's result of the all-reduce of `data` (one buffer per rank).
fn all_reduce<G: GradElement + Send>(config: &Config, data: Vec<Vec<G>>) -> Vec<Vec<G>> {
    let n = data.len();
    let group = LocalGroup::new(n);
    std::thread::scope(|s| {
        let handles: Vec<_> = data
            .into_iter()
            .enumerate()
            .map(|(r, mut buffer)| {
                let comm = group.comm(r);
                s.spawn(move || {
                    let plan = CrossGroupAllReduce::<Host>::new(
                        config,
                        n,
                        r,
                        buffer.len(),
                        BUCKET,
                        stream_rank(r),
                    )
                    .unwrap();
                    plan.run_on(&Host, &comm, &mut buffer[..], STEP).unwrap();
                    buffer
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The spec's result, element by element, from every rank's values (as f32).
fn reference(config: &Config, bits: u8, data: &[Vec<f32>]) -> Vec<f32> {
    let n = data.len();
    let k = global_k(bits, n);
    let absmax = data.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    let scale = absmax / k as f32;
    let streams: Vec<UniformStream> = (0..n)
        .map(|r| {
            let id = stream_id(BUCKET, stream_rank(r), Stage::CrossGroup).unwrap();
            UniformStream::new(config.seed, STEP, id)
        })
        .collect();
    (0..data[0].len())
        .map(|i| {
            let sum: i64 = (0..n)
                .map(|r| {
                    let u = streams[r].uniform(i as u64);
                    (data[r][i] / scale + u).floor().clamp(-k as f32, k as f32) as i64
                })
                .sum();
            sum as f32 * scale
        })
        .collect()
}

fn random_data(n: usize, numel: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            (0..numel)
                .map(|_| (rng.uniform() * 2.0 - 1.0) as f32 * 0.01)
                .collect()
        })
        .collect()
}

#[test]
fn every_group_gets_the_references_bits_within_n_scales_of_the_sum() {
    for (n, bits) in [(2, "8"), (3, "8"), (4, "16"), (5, "8")] {
        let config = config(bits);
        let data = random_data(n, 96 * n, n as u64);
        let got = all_reduce(&config, data.clone());
        let want = reference(&config, bits.parse().unwrap(), &data);
        let k = global_k(bits.parse().unwrap(), n);
        let absmax = data.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        for (r, result) in got.iter().enumerate() {
            let same = result
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "n = {n}, {bits} bits: rank {r} differs from the reference"
            );
        }
        for (i, value) in want.iter().enumerate() {
            let exact: f32 = data.iter().map(|d| d[i]).sum();
            // Each of the n roundings moves a value by less than one scale.
            assert!(
                (value - exact).abs() <= n as f32 * absmax / k as f32 * 1.0001,
                "n = {n}"
            );
        }
    }
}

#[test]
fn bf16_buffers_are_read_and_written_as_their_f32_values() {
    let config = config("8");
    let data = random_data(2, 192, 5);
    let rounded: Vec<Vec<f32>> = data
        .iter()
        .map(|d| d.iter().map(|&v| bf16::from_f32(v).to_f32()).collect())
        .collect();
    let as_bf16: Vec<Vec<bf16>> = rounded
        .iter()
        .map(|d| d.iter().map(|&v| bf16::from_f32(v)).collect())
        .collect();
    let want = reference(&config, 8, &rounded);
    for result in all_reduce(&config, as_bf16) {
        let same = result
            .iter()
            .zip(&want)
            .all(|(a, b)| *a == bf16::from_f32(*b));
        assert!(same);
    }
}

#[test]
fn each_rank_rounds_with_a_stream_of_its_own() {
    // The stream word carries the rank's index in the whole DP world, so ranks holding the
    // same values draw different uniforms almost everywhere (and still agree on the result).
    let config = config("8");
    let one = random_data(1, 192, 6).remove(0);
    let streams: Vec<UniformStream> = (0..2)
        .map(|r| {
            let id = stream_id(BUCKET, stream_rank(r), Stage::CrossGroup).unwrap();
            UniformStream::new(config.seed, STEP, id)
        })
        .collect();
    let differ = (0..192).filter(|&i| {
        streams[0].uniform(i as u64).to_bits() != streams[1].uniform(i as u64).to_bits()
    });
    assert!(differ.count() > 180);
    let got = all_reduce(&config, vec![one.clone(), one]);
    assert_eq!(got[0], got[1]);
}

#[test]
fn a_nan_anywhere_makes_every_result_nan() {
    let config = config("8");
    let mut data = random_data(3, 96, 7);
    data[1][40] = f32::NAN;
    for result in all_reduce(&config, data) {
        assert!(result.iter().all(|v| v.is_nan()));
    }
}

#[test]
fn bad_plans_are_refused_naming_the_problem() {
    let refuse = |config: &Config, size, numel| {
        CrossGroupAllReduce::<Host>::new(config, size, 0, numel, BUCKET, 0)
            .unwrap_err()
            .to_string()
    };
    assert!(refuse(&config("exact"), 2, 64).contains("cross_group_bits=exact"));
    assert!(refuse(&config("8"), 3, 64).contains("multiple of the group count"));
    assert!(refuse(&config("8"), 128, 128).contains("serves at most 127 groups"));
    assert!(
        Config::from_overrides(Preset::Sdp4bit, [("cross_group_bits", "4")])
            .unwrap_err()
            .to_string()
            .contains("cross_group_bits=4")
    );
    assert_eq!(Config::preset(Preset::Baseline).cross_group_bits, None);
    assert_eq!(Config::preset(Preset::Sdp4bit).cross_group_bits, Some(8));
}

#[test]
fn the_largest_codes_sum_without_overflow() {
    // Every rank at +a or -a at the same positions: every code is +-K and every sum +-n K,
    // which the checked in-process sums accept (K = floor((2^(w-1) - 1) / n)), and the result
    // is exactly +-n a there.
    for (n, bits) in [(2, "8"), (5, "8"), (127, "8"), (3, "16")] {
        let config = config(bits);
        let a = 0.5f32;
        let data: Vec<Vec<f32>> = (0..n)
            .map(|_| {
                (0..2 * n)
                    .map(|i| if i % 2 == 0 { a } else { -a })
                    .collect()
            })
            .collect();
        for result in all_reduce(&config, data) {
            for (i, value) in result.iter().enumerate() {
                let want = if i % 2 == 0 {
                    n as f32 * a
                } else {
                    -(n as f32) * a
                };
                assert!(
                    (value - want).abs() <= want.abs() * 1e-6,
                    "n = {n}: {value} vs {want}"
                );
            }
        }
    }
}
