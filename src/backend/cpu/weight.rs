//! The two fused passes of the weight all-gather (SPEC §4, §5): encode this rank's shard,
//! then apply every rank's chunk to the whole param bucket.

use half::bf16;
use rayon::prelude::*;

use crate::codec::slab::SlabLayout;
use crate::config::Rounding;
use crate::error::Result;
use crate::plan::BucketPlan;
use crate::rng::UniformStream;

use super::with_scratch;

/// What a weight chunk encodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightEncoding {
    /// The weights themselves (qw, qsdp, zeropp): `param = bf16(x')`.
    Direct,
    /// The difference from the previous parameters (qWD): `param = bf16(param + d')`.
    Difference,
}

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
    let spec = layout.spec;
    let g = spec.group_size;
    layout
        .par_slots_mut(out)
        .enumerate()
        .for_each(|(j, mut slot)| {
            with_scratch(g, |x, u| {
                let start = (j * g).min(new.len());
                let end = ((j + 1) * g).min(new.len());
                let n = end - start;
                match encoding {
                    WeightEncoding::Difference => {
                        for ((v, a), b) in x
                            .iter_mut()
                            .zip(&new[start..end])
                            .zip(&reference[start..end])
                        {
                            *v = a.to_f32() - b.to_f32();
                        }
                    }
                    WeightEncoding::Direct => {
                        for (v, a) in x.iter_mut().zip(&new[start..end]) {
                            *v = a.to_f32();
                        }
                    }
                }
                x[n..].fill(0.0);
                if spec.rounding == Rounding::Stochastic {
                    rng.fill(first_index + (j * g) as u64, u);
                }
                slot.quantize(&spec, x, u);
            });
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
    let g = layout.spec.group_size;
    let slab_len = layout.byte_len();
    params
        .par_chunks_mut(plan.shard_len)
        .zip(recv.par_chunks_exact(slab_len))
        .enumerate()
        .try_for_each(|(z, (shard, bytes))| {
            let view = layout.view(bytes)?;
            shard
                .par_chunks_mut(g)
                .enumerate()
                .try_for_each(|(j, dst)| {
                    with_scratch(g, |d, _| {
                        view.decode_group(j, d, |_, v| v)?;
                        match encoding {
                            WeightEncoding::Difference if z == me => {
                                let reference = &own_reference[j * g..j * g + dst.len()];
                                for ((p, r), d) in dst.iter_mut().zip(reference).zip(&*d) {
                                    *p = bf16::from_f32(r.to_f32() + d);
                                }
                            }
                            WeightEncoding::Difference => {
                                for (p, d) in dst.iter_mut().zip(&*d) {
                                    *p = bf16::from_f32(p.to_f32() + d);
                                }
                            }
                            WeightEncoding::Direct => {
                                for (p, d) in dst.iter_mut().zip(&*d) {
                                    *p = bf16::from_f32(*d);
                                }
                            }
                        }
                        Ok(())
                    })
                })
        })
}
