//! Counter-based random numbers: Philox4x32-10 keyed and countered as SPEC §2 says.
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

/// Number of Philox blocks computed together by [`UniformStream::fill`]; 8 blocks give 32
/// uniforms, one vectorised batch.
const LANES: usize = 8;

impl UniformStream {
    /// The stream of `seed` at optimizer `step` (low 32 bits) for `stream` (see [`stream_id`]).
    pub fn new(seed: u64, step: u64, stream: u32) -> Self {
        Self {
            key: [seed as u32, (seed >> 32) as u32],
            step: step as u32,
            stream,
        }
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
    #[inline]
    pub fn fill(&self, first: u64, out: &mut [f32]) {
        debug_assert!(first % 4 == 0 && out.len() % 4 == 0);
        let mut block = first / 4;
        let mut batches = out.chunks_exact_mut(4 * LANES);
        for batch in &mut batches {
            self.fill_batch(block, batch);
            block += LANES as u64;
        }
        for quad in batches.into_remainder().chunks_exact_mut(4) {
            let words = self.block(block);
            for (u, w) in quad.iter_mut().zip(words) {
                *u = word_to_uniform(w);
            }
            block += 1;
        }
    }

    /// [`LANES`] Philox blocks side by side, written so the compiler vectorises the rounds.
    #[inline(always)]
    fn fill_batch(&self, first_block: u64, out: &mut [f32]) {
        let mut c0 = [0u32; LANES];
        let mut c1 = [0u32; LANES];
        let mut c2 = [self.step; LANES];
        let mut c3 = [self.stream; LANES];
        for lane in 0..LANES {
            let b = first_block + lane as u64;
            c0[lane] = b as u32;
            c1[lane] = (b >> 32) as u32;
        }
        let [mut k0, mut k1] = self.key;
        for round in 0..10 {
            if round > 0 {
                k0 = k0.wrapping_add(W0);
                k1 = k1.wrapping_add(W1);
            }
            for lane in 0..LANES {
                let p0 = u64::from(M0) * u64::from(c0[lane]);
                let p1 = u64::from(M1) * u64::from(c2[lane]);
                let n0 = ((p1 >> 32) as u32) ^ c1[lane] ^ k0;
                let n2 = ((p0 >> 32) as u32) ^ c3[lane] ^ k1;
                c1[lane] = p1 as u32;
                c3[lane] = p0 as u32;
                c0[lane] = n0;
                c2[lane] = n2;
            }
        }
        for lane in 0..LANES {
            out[4 * lane] = word_to_uniform(c0[lane]);
            out[4 * lane + 1] = word_to_uniform(c1[lane]);
            out[4 * lane + 2] = word_to_uniform(c2[lane]);
            out[4 * lane + 3] = word_to_uniform(c3[lane]);
        }
    }
}

/// `u = (word >> 8) * 2^-24`: exact in fp32, in `[0, 1)`.
#[inline(always)]
pub fn word_to_uniform(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / 16_777_216.0)
}
