//! The two fused passes of the weight all-gather (docs/numerics.md §7.3): encode this rank's shard,
//! then apply every rank's chunk to the whole param bucket.

use half::bf16;
use rayon::prelude::*;

use crate::codec::quant::QuantSpec;
use crate::codec::slab::{GroupRun, SlabLayout, SlabView};
use crate::codec::weight_encoding::WeightEncoding;
use crate::config::Rounding;
use crate::error::{Error, Result};
use crate::plan::BucketPlan;
use crate::rng::UniformStream;

use super::{run_groups, with_scratch};

/// Encodes one shard: quantizes `new - reference` (difference) or `new` (direct) computed in
/// fp32, zero-padded to the padded shard, into one slab. `first_index` is the padded bucket
/// index of the shard's first element (the Philox element index).
pub fn encode_shard(
    layout: SlabLayout,
    encoding: WeightEncoding,
    first_index: u64,
    new: &[bf16],
    reference: &[bf16],
    rng: &UniformStream,
    out: &mut [u8],
) {
    let g = layout.spec.group_size;
    layout
        .par_runs_mut(out, run_groups(g))
        .for_each(|run| encode_run(layout.spec, encoding, first_index, new, reference, rng, run));
}

/// One run of [`encode_shard`]: groups `run.first ..` of the shard.
fn encode_run(
    spec: QuantSpec,
    encoding: WeightEncoding,
    first_index: u64,
    new: &[bf16],
    reference: &[bf16],
    rng: &UniformStream,
    mut run: GroupRun<'_>,
) {
    let g = spec.group_size;
    with_scratch(g, g, |x, u| {
        for i in 0..run.len() {
            let j = run.first + i;
            let start = (j * g).min(new.len());
            let end = ((j + 1) * g).min(new.len());
            let n = end - start;
            match encoding {
                WeightEncoding::Difference => {
                    let pairs = new[start..end].iter().zip(&reference[start..end]);
                    for (v, (a, b)) in x.iter_mut().zip(pairs) {
                        *v = bf16_to_f32(*a) - bf16_to_f32(*b);
                    }
                }
                WeightEncoding::Direct => {
                    for (v, a) in x.iter_mut().zip(&new[start..end]) {
                        *v = bf16_to_f32(*a);
                    }
                }
            }
            x[n..].fill(0.0);
            if spec.rounding == Rounding::Stochastic {
                rng.fill(first_index + (j * g) as u64, u);
            }
            run.quantize(i, &spec, x, u);
        }
    });
}

/// Applies the W received slabs (`recv`, in rank order) to the param bucket `params`.
///
/// With [`WeightEncoding::Difference`] every shard `z` becomes `bf16(reference + d')`, where
/// the reference is the current `params` for other ranks' shards and `own_reference` (this
/// rank's copy of its previous shard) for shard `me`; direct encodings set `bf16(x')`.
pub fn apply_shards(
    layout: SlabLayout,
    encoding: WeightEncoding,
    plan: &BucketPlan,
    me: usize,
    recv: &[u8],
    own_reference: &[bf16],
    params: &mut [bf16],
) -> Result<()> {
    layout.check_slabs(recv.len(), plan.world)?;
    if params.len() != plan.numel {
        return Err(Error::Buffer(format!(
            "param bucket has {} elements, the plan expects {}",
            params.len(),
            plan.numel
        )));
    }
    let g = layout.spec.group_size;
    let run = run_groups(g);
    params
        .par_chunks_mut(plan.shard_len)
        .zip(recv.par_chunks_exact(layout.byte_len()))
        .enumerate()
        .try_for_each(|(z, (shard, bytes))| {
            let view = layout.view(bytes)?;
            let reference =
                (encoding == WeightEncoding::Difference && z == me).then_some(own_reference);
            shard
                .par_chunks_mut(run * g)
                .enumerate()
                .try_for_each(|(r, dst)| apply_run(&view, encoding, r * run, reference, dst))
        })
}

/// Applies groups `k0 ..` of one received slab to `dst` (their elements of the shard);
/// `reference` is this rank's own previous shard when `dst` lies in it.
fn apply_run(
    view: &SlabView<'_>,
    encoding: WeightEncoding,
    k0: usize,
    reference: Option<&[bf16]>,
    dst: &mut [bf16],
) -> Result<()> {
    let g = view.layout().spec.group_size;
    with_scratch(g, 0, |d, _| {
        for (i, dst) in dst.chunks_mut(g).enumerate() {
            let j = k0 + i;
            view.decode_group(j, d, |_, v| v)?;
            match (encoding, reference) {
                (WeightEncoding::Difference, Some(reference)) => {
                    let reference = &reference[j * g..j * g + dst.len()];
                    for ((p, r), d) in dst.iter_mut().zip(reference).zip(&*d) {
                        *p = bf16_from_f32(bf16_to_f32(*r) + d);
                    }
                }
                (WeightEncoding::Difference, None) => {
                    for (p, d) in dst.iter_mut().zip(&*d) {
                        *p = bf16_from_f32(bf16_to_f32(*p) + d);
                    }
                }
                (WeightEncoding::Direct, _) => {
                    for (p, d) in dst.iter_mut().zip(&*d) {
                        *p = bf16_from_f32(*d);
                    }
                }
            }
        }
        Ok(())
    })
}

/// `bf16::to_f32` bit for bit (NaNs come out quiet), branch-free so loops over it vectorise.
#[inline(always)]
fn bf16_to_f32(b: bf16) -> f32 {
    let bits = u32::from(b.to_bits());
    let quiet = if bits & 0x7FFF > 0x7F80 { 0x40 } else { 0 };
    f32::from_bits((bits | quiet) << 16)
}

/// `bf16::from_f32` bit for bit: round to nearest even by adding `0x7FFF` plus the lowest
/// kept bit before truncating (`half`'s rule, verified on all 2^32 inputs); NaNs keep their
/// high mantissa bits and come out quiet. Branch-free, so loops over it vectorise.
#[inline(always)]
fn bf16_from_f32(v: f32) -> bf16 {
    let x = v.to_bits();
    let bits = if x & 0x7FFF_FFFF > 0x7F80_0000 {
        (x >> 16) | 0x40
    } else {
        x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16
    };
    bf16::from_bits(bits as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free conversions agree with `half` on every bf16 and on a dense sweep of
    /// f32 bit patterns (every exponent, every rounding case, NaNs and infinities).
    #[test]
    fn bf16_conversions_match_half() {
        for bits in 0..=u16::MAX {
            let b = bf16::from_bits(bits);
            assert_eq!(
                bf16_to_f32(b).to_bits(),
                b.to_f32().to_bits(),
                "{bits:#06x}"
            );
        }
        for hi in (0..=u32::MAX >> 16).step_by(7) {
            for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000] {
                let v = f32::from_bits(hi << 16 | lo);
                let want = bf16::from_f32(v).to_bits();
                assert_eq!(bf16_from_f32(v).to_bits(), want, "{:#010x}", v.to_bits());
            }
        }
    }
}
