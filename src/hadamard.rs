//! Walsh-Hadamard smoothing (SPEC §3): the unnormalized Sylvester butterfly and its inverse.
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

#[inline(always)]
fn butterfly<const N: usize>(x: &mut [f32; N]) {
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
}

fn forward_fixed<const N: usize>(data: &mut [f32]) {
    for block in data.chunks_exact_mut(N) {
        butterfly::<N>(block.try_into().expect("chunks_exact yields N elements"));
    }
}

fn inverse_fixed<const N: usize>(data: &mut [f32]) {
    let scale = 1.0 / N as f32;
    for block in data.chunks_exact_mut(N) {
        let block: &mut [f32; N] = block.try_into().expect("chunks_exact yields N elements");
        butterfly::<N>(block);
        for v in block.iter_mut() {
            *v *= scale;
        }
    }
}

/// Applies the forward transform to every `block`-sized block of `data`.
///
/// # Panics
/// If `block` is unsupported or does not divide `data.len()` (callers validate both through
/// the config and the plan, so this is an internal invariant).
pub fn forward(data: &mut [f32], block: usize) {
    assert!(is_supported_block(block) && data.len() % block == 0);
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
    assert!(is_supported_block(block) && data.len() % block == 0);
    match block {
        16 => inverse_fixed::<16>(data),
        32 => inverse_fixed::<32>(data),
        64 => inverse_fixed::<64>(data),
        128 => inverse_fixed::<128>(data),
        _ => inverse_fixed::<256>(data),
    }
}
