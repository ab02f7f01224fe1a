//! Counter-based random numbers: Philox4x32-10 keyed and countered as docs/numerics.md §2 says.
//!
//! Key = the 64-bit training seed (low word first). Counter = `(i / 4` low 32 bits,
//! `i / 4` high 32 bits, `step`, `stream)` where `i` is the element index inside the (padded)
//! bucket. Element `i` takes word `i % 4` and turns it into `u = (word >> 8) * 2^-24`, a
//! uniform float in `[0, 1)` that the GPU kernels reproduce bit for bit.

use crate::error::{Error, Result};

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// One Philox4x32-10 block: ten rounds of the Random123 reference algorithm.
#[inline(always)]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let p0 = u64::from(M0) * u64::from(c0);
        let p1 = u64::from(M1) * u64::from(c2);
        (c0, c1, c2, c3) = (
            ((p1 >> 32) as u32) ^ c1 ^ k0,
            p1 as u32,
            ((p0 >> 32) as u32) ^ c3 ^ k1,
            p0 as u32,
        );
    }
    [c0, c1, c2, c3]
}

/// Which quantization in the pipeline a random stream feeds; part of the stream id so the
/// stages of one step never share random numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Stage {
    /// The weight (or weight-difference) quantization before the all-gather.
    Weight = 0,
    /// The first gradient quantization (before the first all-to-all).
    GradFirst = 1,
    /// The gradient requantization between the two levels.
    GradSecond = 2,
    /// Global-QSGD's integer rounding.
    GlobalQsgd = 3,
    /// The integer rounding of the all-reduce across the groups of hybrid sharding.
    CrossGroup = 4,
}

/// Largest bucket id a stream can encode.
pub const MAX_BUCKET_ID: u32 = (1 << 12) - 1;
/// Largest rank a stream can encode.
pub const MAX_STREAM_RANK: usize = (1 << 16) - 1;

/// Packs (bucket id, rank, stage) into the 32-bit stream word: `bucket << 20 | rank << 4 | stage`.
pub fn stream_id(bucket: u32, rank: usize, stage: Stage) -> Result<u32> {
    if bucket > MAX_BUCKET_ID {
        return Err(Error::Plan(format!(
            "bucket id {bucket} exceeds the {MAX_BUCKET_ID} the random stream can encode"
        )));
    }
    if rank > MAX_STREAM_RANK {
        return Err(Error::Plan(format!(
            "rank {rank} exceeds the {MAX_STREAM_RANK} the random stream can encode"
        )));
    }
    Ok((bucket << 20) | ((rank as u32) << 4) | stage as u32)
}

/// The uniforms of one (seed, step, stream): a pure function of the element index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UniformStream {
    key: [u32; 2],
    step: u32,
    stream: u32,
}

/// Number of Philox blocks the portable path computes together: 16 blocks give 64 uniforms,
/// four independent AVX2 vectors of 64-bit lanes per state word pair (enough to hide the
/// multiply latency). Tails use batches of [`HALF`] blocks.
const LANES: usize = 16;
/// The smaller batch for tails (32 uniforms).
const HALF: usize = 8;

impl UniformStream {
    /// The stream of `seed` at optimizer `step` (low 32 bits) for `stream` (see [`stream_id`]).
    pub fn new(seed: u64, step: u64, stream: u32) -> Self {
        Self {
            key: [seed as u32, (seed >> 32) as u32],
            step: step as u32,
            stream,
        }
    }

    /// The Philox key (seed, low word first) and the two fixed counter words `step` and
    /// `stream`: everything a GPU kernel needs to draw the same uniforms (the CUDA backend
    /// passes them in its launch parameters).
    pub fn philox_params(&self) -> ([u32; 2], u32, u32) {
        (self.key, self.step, self.stream)
    }

    /// The four raw Philox words of block `block` (elements `4 * block .. 4 * block + 4`).
    #[inline]
    pub fn block(&self, block: u64) -> [u32; 4] {
        philox4x32_10(
            [block as u32, (block >> 32) as u32, self.step, self.stream],
            self.key,
        )
    }

    /// The uniform of element `index`.
    pub fn uniform(&self, index: u64) -> f32 {
        word_to_uniform(self.block(index / 4)[(index % 4) as usize])
    }

    /// Writes the uniforms of elements `first .. first + out.len()`; `first` and `out.len()`
    /// must be multiples of 4 (group sizes are multiples of 32, so every group qualifies).
    ///
    /// Whole batches of 64 uniforms (128 where they fit) run on AVX-512 when the CPU has it
    /// (detected at run time), the rest on the portable path; both produce the same bits.
    #[inline]
    pub fn fill(&self, first: u64, out: &mut [f32]) {
        debug_assert!(first.is_multiple_of(4) && out.len().is_multiple_of(4));
        #[cfg(target_arch = "x86_64")]
        if avx512::detected() {
            let whole = out.len() / avx512::BATCH * avx512::BATCH;
            let (head, tail) = out.split_at_mut(whole);
            avx512::fill(self, first / 4, head);
            self.fill_portable(first + whole as u64, tail);
            return;
        }
        self.fill_portable(first, out);
    }

    /// [`fill`](Self::fill) without the AVX-512 path: batches of [`LANES`], then of [`HALF`]
    /// blocks, then one padded batch for the last blocks (a trailing partial block, which the
    /// contract excludes, is left untouched).
    pub(crate) fn fill_portable(&self, first: u64, out: &mut [f32]) {
        let mut block = first / 4;
        let mut batches = out.chunks_exact_mut(4 * LANES);
        for batch in &mut batches {
            self.fill_batch::<LANES>(block, batch);
            block += LANES as u64;
        }
        let mut halves = batches.into_remainder().chunks_exact_mut(4 * HALF);
        for batch in &mut halves {
            self.fill_batch::<HALF>(block, batch);
            block += HALF as u64;
        }
        let tail = halves.into_remainder();
        let whole = tail.len() / 4 * 4;
        if whole > 0 {
            let mut full = [0f32; 4 * HALF];
            self.fill_batch::<HALF>(block, &mut full);
            tail[..whole].copy_from_slice(&full[..whole]);
        }
    }

    /// Writes the uniforms of the `N` consecutive Philox blocks from `first_block` to `out`
    /// (`4 * N` floats) in element order.
    #[inline(always)]
    fn fill_batch<const N: usize>(&self, first_block: u64, out: &mut [f32]) {
        let (q0, q1) = self.rounds::<N>(first_block);
        for ((quad, q0), q1) in out[..4 * N].chunks_exact_mut(4).zip(q0).zip(q1) {
            quad[0] = word_to_uniform(q0 as u32);
            quad[1] = word_to_uniform((q0 >> 32) as u32);
            quad[2] = word_to_uniform(q1 as u32);
            quad[3] = word_to_uniform((q1 >> 32) as u32);
        }
    }

    /// The ten Philox rounds of `N` consecutive blocks. Block `b`'s state `(c0, c1, c2, c3)`
    /// is kept as two 64-bit lanes `q0 = c0 | c1 << 32`, `q1 = c2 | c3 << 32`, so a round is
    /// `q0' = rot32(lo(q1) * M1) ^ (q0 >> 32) ^ k0`, `q1' = rot32(lo(q0) * M0) ^ (q1 >> 32) ^ k1`
    /// (a 32x32->64 multiply, a half swap, a shift and two xors per lane, which the compiler
    /// vectorises across the `N` blocks).
    #[inline(always)]
    fn rounds<const N: usize>(&self, first_block: u64) -> ([u64; N], [u64; N]) {
        let mut q0 = [0u64; N];
        for (lane, q) in q0.iter_mut().enumerate() {
            *q = first_block + lane as u64;
        }
        let mut q1 = [u64::from(self.step) | u64::from(self.stream) << 32; N];
        let [mut k0, mut k1] = self.key;
        for round in 0..10 {
            if round > 0 {
                k0 = k0.wrapping_add(W0);
                k1 = k1.wrapping_add(W1);
            }
            for lane in 0..N {
                let p0 = (q0[lane] & 0xFFFF_FFFF) * u64::from(M0);
                let p1 = (q1[lane] & 0xFFFF_FFFF) * u64::from(M1);
                q0[lane] = p1.rotate_left(32) ^ (q0[lane] >> 32) ^ u64::from(k0);
                q1[lane] = p0.rotate_left(32) ^ (q1[lane] >> 32) ^ u64::from(k1);
            }
        }
        (q0, q1)
    }
}

/// Philox on AVX-512F, used when the running CPU has it: `C` chains of eight blocks, each chain
/// two vectors of eight 64-bit lanes, `q0 = c0 | c1 << 32` and `q1 = c2 | c3 << 32` per block
/// exactly as in [`UniformStream::rounds`]. A round is one 32x32->64 multiply (`vpmuludq`), one
/// half swap (`vpshufd`), one shift and one three-way xor (`vpternlogq`) per vector, a chain of
/// dependent instructions: the chains are independent, so the CPU overlaps them. Batches of
/// [`WIDE_CHAINS`] chains, then one of [`CHAINS`] for the rest. Integer operations only, so the
/// uniforms are bit-identical to the portable path.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, __m512i, _mm512_add_epi64, _mm512_cvtepi32_ps, _mm512_mul_epu32, _mm512_mul_ps,
        _mm512_permutex2var_epi64, _mm512_set_epi64, _mm512_set1_epi64, _mm512_set1_ps,
        _mm512_shuffle_epi32, _mm512_srli_epi32, _mm512_srli_epi64, _mm512_ternarylogic_epi64,
        _mm512_unpackhi_epi64, _mm512_unpacklo_epi64,
    };

    use super::{M0, M1, UniformStream, W0, W1};

    /// Chains of the smallest batch (16 Philox blocks).
    const CHAINS: usize = 2;
    /// Chains of the main batches (32 Philox blocks).
    const WIDE_CHAINS: usize = 4;
    /// Uniforms per chain (eight Philox blocks).
    const PER_CHAIN: usize = 32;
    /// Uniforms of the smallest batch: `fill` takes multiples of it.
    pub(super) const BATCH: usize = CHAINS * PER_CHAIN;

    /// Whether the running CPU (and OS) supports AVX-512F; cached by the standard library.
    #[inline]
    pub(super) fn detected() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Writes the uniforms of blocks `first_block ..` to `out` (a multiple of [`BATCH`] long).
    ///
    /// # Panics
    /// If the CPU lacks AVX-512F (callers check [`detected`] first).
    pub(super) fn fill(stream: &UniformStream, first_block: u64, out: &mut [f32]) {
        assert!(detected(), "AVX-512F path taken on a CPU without it");
        // SAFETY: the assertion above proves the running CPU supports AVX-512F, the only
        // target feature `fill_avx512` enables.
        unsafe { fill_avx512(stream, first_block, out) }
    }

    #[target_feature(enable = "avx512f")]
    fn fill_avx512(stream: &UniformStream, first_block: u64, out: &mut [f32]) {
        let mut block = first_block;
        let mut wide = out.chunks_exact_mut(WIDE_CHAINS * PER_CHAIN);
        for batch in &mut wide {
            write_batch::<WIDE_CHAINS>(stream, block, batch);
            block += (WIDE_CHAINS * PER_CHAIN / 4) as u64;
        }
        for batch in wide.into_remainder().chunks_exact_mut(BATCH) {
            write_batch::<CHAINS>(stream, block, batch);
            block += (BATCH / 4) as u64;
        }
    }

    /// Writes the `C * 32` uniforms of blocks `first_block .. first_block + 8 * C` to `out`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn write_batch<const C: usize>(stream: &UniformStream, first_block: u64, out: &mut [f32]) {
        let words = batch_words::<C>(stream, first_block);
        for (w, o) in words.iter().flatten().zip(out.chunks_exact_mut(16)) {
            o.copy_from_slice(&bytemuck::cast::<__m512, [f32; 16]>(*w));
        }
    }

    /// The uniforms of blocks `first_block .. first_block + 8 * C`, in element order (chain
    /// `c` holds blocks `8c .. 8c + 8`, as two vectors of sixteen).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn batch_words<const C: usize>(stream: &UniformStream, first_block: u64) -> [[__m512; 2]; C] {
        let lanes = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
        let upper = u64::from(stream.step) | u64::from(stream.stream) << 32;
        let upper = _mm512_set1_epi64(upper as i64);
        let mut chains = [[upper; 2]; C];
        for (c, chain) in chains.iter_mut().enumerate() {
            let first = first_block.wrapping_add(8 * c as u64);
            chain[0] = _mm512_add_epi64(_mm512_set1_epi64(first as i64), lanes);
        }
        let [mut k0, mut k1] = stream.key;
        for round in 0..10 {
            if round > 0 {
                k0 = k0.wrapping_add(W0);
                k1 = k1.wrapping_add(W1);
            }
            let keys = [
                _mm512_set1_epi64(i64::from(k0)),
                _mm512_set1_epi64(i64::from(k1)),
            ];
            for chain in chains.iter_mut() {
                *chain = round_of(*chain, keys);
            }
        }
        let (lo, hi) = (
            _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0),
            _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4),
        );
        let mut words = [[_mm512_set1_ps(0.0); 2]; C];
        for (pair, [q0, q1]) in words.iter_mut().zip(chains) {
            // Blocks 0, 2, 4, 6 and 1, 3, 5, 7 as (c0 c1 c2 c3), then back in block order.
            let even = _mm512_unpacklo_epi64(q0, q1);
            let odd = _mm512_unpackhi_epi64(q0, q1);
            pair[0] = to_uniforms(_mm512_permutex2var_epi64(even, lo, odd));
            pair[1] = to_uniforms(_mm512_permutex2var_epi64(even, hi, odd));
        }
        words
    }

    /// One Philox round of eight blocks: `q0' = swap(lo(q1) * M1) ^ (q0 >> 32) ^ k0`,
    /// `q1' = swap(lo(q0) * M0) ^ (q1 >> 32) ^ k1`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn round_of([q0, q1]: [__m512i; 2], [k0, k1]: [__m512i; 2]) -> [__m512i; 2] {
        let p0 = _mm512_mul_epu32(q0, _mm512_set1_epi64(i64::from(M0)));
        let p1 = _mm512_mul_epu32(q1, _mm512_set1_epi64(i64::from(M1)));
        // 0xB1 swaps the two 32-bit halves of every 64-bit lane; 0x96 is a ^ b ^ c.
        let swap1 = _mm512_shuffle_epi32::<0xB1>(p1);
        let swap0 = _mm512_shuffle_epi32::<0xB1>(p0);
        [
            _mm512_ternarylogic_epi64::<0x96>(swap1, _mm512_srli_epi64::<32>(q0), k0),
            _mm512_ternarylogic_epi64::<0x96>(swap0, _mm512_srli_epi64::<32>(q1), k1),
        ]
    }

    /// `(word >> 8) * 2^-24` for sixteen words (exact: the shifted words fit in 24 bits).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn to_uniforms(words: __m512i) -> __m512 {
        let ints = _mm512_srli_epi32::<8>(words);
        _mm512_mul_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(1.0 / 16_777_216.0))
    }
}

/// `u = (word >> 8) * 2^-24`: exact in fp32, in `[0, 1)`.
#[inline(always)]
pub fn word_to_uniform(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / 16_777_216.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 batches (when this CPU has them) and the portable batches agree bit for
    /// bit with the scalar reference [`UniformStream::uniform`].
    #[test]
    fn vector_paths_match_scalar() {
        let streams = [
            UniformStream::new(0, 0, 0),
            UniformStream::new(u64::MAX, u64::from(u32::MAX), u32::MAX),
            UniformStream::new(
                0x1234_5678_9ABC_DEF0,
                77,
                stream_id(5, 3, Stage::GradSecond).unwrap(),
            ),
        ];
        // Starts straddling the 2^32-block boundary exercise the carry into the counter's
        // second word.
        let starts = [0u64, 4, 1 << 20, (1u64 << 34) - 64, u64::MAX / 4 * 4 - 1024];
        for s in &streams {
            for &first in &starts {
                for len in [4usize, 32, 36, 64, 68, 128, 192, 196, 256, 1028] {
                    let want: Vec<u32> = (0..len as u64)
                        .map(|i| s.uniform(first.wrapping_add(i)).to_bits())
                        .collect();
                    let mut portable = vec![0f32; len];
                    s.fill_portable(first, &mut portable);
                    let mut dispatched = vec![0f32; len];
                    s.fill(first, &mut dispatched);
                    let bits = |v: &[f32]| v.iter().map(|u| u.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&portable), want, "portable, first {first}, len {len}");
                    assert_eq!(
                        bits(&dispatched),
                        want,
                        "dispatched, first {first}, len {len}"
                    );
                }
            }
        }
    }
}
