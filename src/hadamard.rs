//! Walsh-Hadamard smoothing (docs/numerics.md §3): the unnormalized Sylvester butterfly and its
//! inverse.
//!
//! The butterfly runs stages `h = 1, 2, 4, ..., n/2`, each replacing `(a, b)` at distance `h`
//! by `(a + b, a - b)`; the inverse is the same butterfly followed by a multiplication by
//! `1/n` (exact: a power of two). The CUDA kernels follow the same stage order so results
//! are bit-identical.

/// Smallest supported block.
pub const MIN_BLOCK: usize = 16;
/// Largest supported block.
pub const MAX_BLOCK: usize = 256;

/// Whether `block` is a power of two in `[MIN_BLOCK, MAX_BLOCK]`.
pub fn is_supported_block(block: usize) -> bool {
    block.is_power_of_two() && (MIN_BLOCK..=MAX_BLOCK).contains(&block)
}

/// The textbook butterfly of one block: stages `h = 1, 2, 4, ..., N/2` in order, each
/// replacing `(a, b) = (x[j], x[j + h])` by `(a + b, a - b)`; the inverse then multiplies by
/// `scale`. The vector path ([`lanes`]) performs exactly these operations on every element.
#[cfg(any(test, not(all(target_arch = "x86_64", target_feature = "avx"))))]
#[inline(always)]
fn butterfly<const N: usize>(x: &mut [f32; N], scale: Option<f32>) {
    let mut h = 1;
    while h < N {
        for base in (0..N).step_by(2 * h) {
            for j in base..base + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    if let Some(scale) = scale {
        for v in x.iter_mut() {
            *v *= scale;
        }
    }
}

/// Runs [`butterfly`] on every `N`-element block of `data`, portably.
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx")))]
fn transform_blocks<const N: usize>(data: &mut [f32], scale: Option<f32>) {
    for block in data.chunks_exact_mut(N) {
        butterfly::<N>(
            block.try_into().expect("chunks_exact yields N elements"),
            scale,
        );
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
use lanes::transform_blocks;

/// AVX path, compiled when the build enables AVX (`.cargo/config.toml` targets x86-64-v3): a
/// block is `N / 8` vectors of 8 lanes. Stages 1, 2 and 4 pair lanes inside a vector (a lane
/// permute, an add, a subtract and a blend keeping `a + b` in the lower and `a - b` in the
/// upper lane of each pair, operands in the textbook order); stages from 8 up pair whole
/// vectors, so every element sees the same IEEE operations as [`butterfly`].
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
mod lanes {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_blend_ps, _mm256_mul_ps, _mm256_permute_ps,
        _mm256_permute2f128_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_sub_ps,
    };

    /// Vectors in the largest block.
    const MAX_VECTORS: usize = super::MAX_BLOCK / 8;

    /// Runs the butterfly on every `N`-element block of `data`.
    pub(super) fn transform_blocks<const N: usize>(data: &mut [f32], scale: Option<f32>) {
        // SAFETY: this module is compiled only when AVX is enabled for the whole build
        // (`cfg(target_feature = "avx")`), so every CPU this binary runs on has AVX.
        unsafe { transform_avx::<N>(data, scale) }
    }

    #[target_feature(enable = "avx")]
    fn transform_avx<const N: usize>(data: &mut [f32], scale: Option<f32>) {
        for block in data.chunks_exact_mut(N) {
            butterfly::<N>(block, scale);
        }
    }

    /// Stages 1, 2 and 4 on one vector of 8 consecutive elements.
    #[target_feature(enable = "avx")]
    #[inline]
    fn lane_stages(x: __m256) -> __m256 {
        // Stage 1: lanes 1, 3, 5, 7 are the upper elements of their pairs.
        let p = _mm256_permute_ps::<0b10_11_00_01>(x);
        let x = _mm256_blend_ps::<0b1010_1010>(_mm256_add_ps(x, p), _mm256_sub_ps(p, x));
        // Stage 2: lanes 2, 3, 6, 7 are upper.
        let p = _mm256_permute_ps::<0b01_00_11_10>(x);
        let x = _mm256_blend_ps::<0b1100_1100>(_mm256_add_ps(x, p), _mm256_sub_ps(p, x));
        // Stage 4: the upper 128-bit half is upper.
        let p = _mm256_permute2f128_ps::<0x01>(x, x);
        _mm256_blend_ps::<0b1111_0000>(_mm256_add_ps(x, p), _mm256_sub_ps(p, x))
    }

    /// The butterfly of one `N`-element block (then `* scale` for the inverse).
    #[target_feature(enable = "avx")]
    #[inline]
    fn butterfly<const N: usize>(x: &mut [f32], scale: Option<f32>) {
        let n = N / 8;
        let mut v = [_mm256_setzero_ps(); MAX_VECTORS];
        for (v, lane) in v.iter_mut().zip(x[..N].chunks_exact(8)) {
            *v = lane_stages(bytemuck::pod_read_unaligned(bytemuck::cast_slice(lane)));
        }
        let mut h = 1;
        while h < n {
            for base in (0..n).step_by(2 * h) {
                for j in base..base + h {
                    let (a, b) = (v[j], v[j + h]);
                    v[j] = _mm256_add_ps(a, b);
                    v[j + h] = _mm256_sub_ps(a, b);
                }
            }
            h *= 2;
        }
        if let Some(scale) = scale {
            let s = _mm256_set1_ps(scale);
            for v in &mut v[..n] {
                *v = _mm256_mul_ps(*v, s);
            }
        }
        for (v, lane) in v.iter().zip(x[..N].chunks_exact_mut(8)) {
            lane.copy_from_slice(bytemuck::cast_slice(std::slice::from_ref(v)));
        }
    }
}

fn forward_fixed<const N: usize>(data: &mut [f32]) {
    transform_blocks::<N>(data, None);
}

fn inverse_fixed<const N: usize>(data: &mut [f32]) {
    transform_blocks::<N>(data, Some(1.0 / N as f32));
}

/// Applies the forward transform to every `block`-sized block of `data`.
///
/// # Panics
/// If `block` is unsupported or does not divide `data.len()` (callers validate both through
/// the config and the plan, so this is an internal invariant).
pub fn forward(data: &mut [f32], block: usize) {
    assert!(is_supported_block(block) && data.len().is_multiple_of(block));
    match block {
        16 => forward_fixed::<16>(data),
        32 => forward_fixed::<32>(data),
        64 => forward_fixed::<64>(data),
        128 => forward_fixed::<128>(data),
        _ => forward_fixed::<256>(data),
    }
}

/// Applies the inverse transform (butterfly, then `* 1/block`) to every block of `data`.
///
/// # Panics
/// Under the same conditions as [`forward`].
pub fn inverse(data: &mut [f32], block: usize) {
    assert!(is_supported_block(block) && data.len().is_multiple_of(block));
    match block {
        16 => inverse_fixed::<16>(data),
        32 => inverse_fixed::<32>(data),
        64 => inverse_fixed::<64>(data),
        128 => inverse_fixed::<128>(data),
        _ => inverse_fixed::<256>(data),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transform in use (vector path on AVX builds) is bit-identical to the textbook
    /// butterfly for every block size, signed zeros and infinities included; NaN results only
    /// have to be NaN (Rust, like CUDA, leaves the sign and payload of a NaN result unspecified,
    /// and the optimiser may swap the operands of an addition).
    #[test]
    fn vector_path_matches_textbook_butterfly() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let specials = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
        ];
        let data: Vec<f32> = (0..4096)
            .map(|i| match next() % 16 {
                0 => specials[i % specials.len()],
                1 => f32::from_bits(next() as u32),
                _ => ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e3,
            })
            .collect();
        for block in [16usize, 32, 64, 128, 256] {
            for inverse in [false, true] {
                let mut got = data.clone();
                let mut want = data.clone();
                let scale = inverse.then_some(1.0 / block as f32);
                if inverse {
                    super::inverse(&mut got, block);
                } else {
                    forward(&mut got, block);
                }
                for chunk in want.chunks_exact_mut(block) {
                    match block {
                        16 => butterfly::<16>(chunk.try_into().unwrap(), scale),
                        32 => butterfly::<32>(chunk.try_into().unwrap(), scale),
                        64 => butterfly::<64>(chunk.try_into().unwrap(), scale),
                        128 => butterfly::<128>(chunk.try_into().unwrap(), scale),
                        _ => butterfly::<256>(chunk.try_into().unwrap(), scale),
                    }
                }
                let bits = |v: &[f32]| {
                    v.iter()
                        .map(|x| {
                            if x.is_nan() {
                                f32::NAN.to_bits()
                            } else {
                                x.to_bits()
                            }
                        })
                        .collect::<Vec<_>>()
                };
                assert_eq!(bits(&got), bits(&want), "block {block}, inverse {inverse}");
            }
        }
    }
}
