//! The random inputs of the emulator cases: values with every kind of special group, updated
//! weights, random streams, and received slabs damaged the way no encoder writes them.

use half::bf16;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::rng::{Stage, UniformStream, stream_id};

use sdp4bit_test_support::random::SplitMix64;

/// A fair coin.
fn coin(rand: &mut SplitMix64) -> bool {
    rand.next_u64() & 1 == 1
}

/// One of `items`, uniformly.
fn pick<T: Copy>(rand: &mut SplitMix64, items: &[T]) -> T {
    items[rand.below(items.len())]
}

/// Uniform in [-1, 1) with 24 random bits.
fn signed(rand: &mut SplitMix64) -> f32 {
    (rand.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// A NaN with one of several payloads and signs.
fn nan(rand: &mut SplitMix64) -> f32 {
    f32::from_bits(pick(
        rand,
        &[
            0x7FC0_0000,
            0xFFC0_0000,
            0x7F80_0001,
            0xFFFF_FFFF,
            0x7FC1_2345,
        ],
    ))
}

/// `n` finite values in (-3, 3), e.g. a sentinel the kernels must overwrite or leave.
pub(crate) fn plain(rand: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| 3.0 * signed(rand)).collect()
}

/// `n` values in runs of `run` (a group size), each run plain or special: zeros, signed
/// zeros, a NaN (assorted payloads), an Inf, denormals, tiny or huge magnitudes (the scale
/// underflows or overflows), a single `±f32::MAX`, a constant, non-negative values with -0,
/// magnitudes spread over 60 decades, a single outlier, the smallest denormals (a zero scale).
pub(crate) fn values(rand: &mut SplitMix64, n: usize, run: usize) -> Vec<f32> {
    let mut v = plain(rand, n);
    for lo in (0..n).step_by(run.max(1)) {
        let hi = (lo + run).min(n);
        let i = lo + rand.below(hi - lo);
        match rand.below(16) {
            0 => v[lo..hi].fill(0.0),
            1 => v[lo..hi]
                .iter_mut()
                .for_each(|x| *x = if coin(rand) { 0.0 } else { -0.0 }),
            2 => v[i] = nan(rand),
            3 => v[i] = pick(rand, &[f32::INFINITY, f32::NEG_INFINITY]),
            4 => v[lo..hi]
                .iter_mut()
                .for_each(|x| *x = f32::from_bits(rand.next_u64() as u32 & 0x807F_FFFF)),
            5 => v[lo..hi].iter_mut().for_each(|x| *x *= 1e-38),
            6 => v[lo..hi].iter_mut().for_each(|x| *x *= 1.1e38),
            7 => v[i] = pick(rand, &[f32::MAX, -f32::MAX]),
            8 => {
                let c = signed(rand);
                v[lo..hi].fill(c);
            }
            9 => v[lo..hi]
                .iter_mut()
                .for_each(|x| *x = if rand.below(3) == 0 { -0.0 } else { x.abs() }),
            10 => v[lo..hi]
                .iter_mut()
                .for_each(|x| *x *= 10f32.powi(rand.below(61) as i32 - 30)),
            11 => v[i] = 1e4 * signed(rand),
            // The smallest denormals: absmax / L rounds to a zero scale, values non-zero.
            12 => v[lo..hi].iter_mut().for_each(|x| {
                *x = f32::from_bits(rand.below(4) as u32 | if coin(rand) { 0x8000_0000 } else { 0 })
            }),
            _ => {}
        }
    }
    v
}

/// [`values`] rounded to bf16.
pub(crate) fn bf16s(rand: &mut SplitMix64, n: usize, run: usize) -> Vec<bf16> {
    values(rand, n, run)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// Updated weights: mostly `old` plus a small step, some unchanged, some arbitrary.
pub(crate) fn updated(rand: &mut SplitMix64, old: &[bf16]) -> Vec<bf16> {
    old.iter()
        .map(|&x| match rand.below(8) {
            0 => x,
            1 => bf16::from_f32(100.0 * signed(rand)),
            _ => bf16::from_f32(x.to_f32() + 0.01 * signed(rand)),
        })
        .collect()
}

/// The stream of `stage` for `rank` of bucket 7, under a random seed and step.
pub(crate) fn stream(rand: &mut SplitMix64, rank: usize, stage: Stage) -> UniformStream {
    let step = rand.next_u64() % 100_000;
    UniformStream::new(
        rand.next_u64(),
        step,
        stream_id(7, rank, stage).expect("stream id"),
    )
}

/// The little-endian bytes of fp32 values.
pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The little-endian bytes of bf16 values.
pub(crate) fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// A fresh output buffer: a byte pattern no kernel writes, so untouched bytes show up.
pub(crate) fn garbage(len: usize) -> Vec<u8> {
    vec![0xA5; len]
}

/// Damages a few groups of the slabs in `recv` (slabs of `layout`) the way no encoder writes
/// them: a negative or infinite scale, an infinite offset, the symmetric code -2^(b-1) (also
/// with a NaN scale). Before that, gives a few groups unusual but valid metadata (scale -0, a
/// negative NaN, the smallest denormal, zero with non-zero codes; a NaN offset). Returns the
/// damaged slabs and their twin in which each damaged group is a non-finite group (scale and
/// offset NaN, codes 0): what the kernels decode a corrupt group to (kernels/common.cuh), so
/// the CPU backend's output for the twin is the kernels' expected output.
pub(crate) fn damage(rand: &mut SplitMix64, layout: SlabLayout, recv: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let spec = layout.spec;
    let len = layout.byte_len();
    let slabs = recv.len() / len;
    let code_bytes = spec.code_bytes_per_group();
    let codes_at = |s: usize, k: usize| s * len + k * code_bytes;
    let scale_at = |s: usize, k: usize| s * len + layout.codes_len() + 4 * k;
    let offset_at = |s: usize, k: usize| scale_at(s, k) + 4 * layout.groups;
    let put =
        |bytes: &mut [u8], at: usize, v: f32| bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());

    let mut bad = recv.to_vec();
    for _ in 0..1 + rand.below(2) {
        let (s, k) = (rand.below(slabs), rand.below(layout.groups));
        match rand.below(4) {
            0 => put(&mut bad, scale_at(s, k), -0.0),
            1 => put(&mut bad, scale_at(s, k), f32::from_bits(0xFFC0_0001)),
            2 => put(&mut bad, scale_at(s, k), f32::from_bits(1)),
            _ if spec.symmetric => put(&mut bad, scale_at(s, k), 0.0),
            _ => put(&mut bad, offset_at(s, k), f32::NAN),
        }
    }
    let mut twin = bad.clone();
    for _ in 0..1 + rand.below(3) {
        let (s, k) = (rand.below(slabs), rand.below(layout.groups));
        let negative = -pick(rand, &[f32::from_bits(1), 1e-30, 0.5, 3.0e38]);
        match rand.below(4) {
            0 => put(&mut bad, scale_at(s, k), negative),
            1 => put(
                &mut bad,
                scale_at(s, k),
                pick(rand, &[f32::INFINITY, f32::NEG_INFINITY]),
            ),
            kind if spec.symmetric => {
                // The code -2^(b-1) at element e: nibble 0x8 or byte 0x80.
                let e = rand.below(spec.group_size);
                let at = codes_at(s, k);
                if spec.bits == 4 {
                    let byte = &mut bad[at + e / 2];
                    *byte = if e.is_multiple_of(2) {
                        (*byte & 0xF0) | 0x08
                    } else {
                        (*byte & 0x0F) | 0x80
                    };
                } else {
                    bad[at + e] = 0x80;
                }
                if kind == 3 {
                    put(&mut bad, scale_at(s, k), f32::NAN);
                }
            }
            _ => put(
                &mut bad,
                offset_at(s, k),
                pick(rand, &[f32::INFINITY, f32::NEG_INFINITY]),
            ),
        }
        twin[codes_at(s, k)..codes_at(s, k) + code_bytes].fill(0);
        put(&mut twin, scale_at(s, k), f32::NAN);
        if !spec.symmetric {
            put(&mut twin, offset_at(s, k), f32::NAN);
        }
    }
    (bad, twin)
}
