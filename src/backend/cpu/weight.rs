//! The two fused passes of the weight all-gather (docs/numerics.md §7.3): encode this rank's shard,
//! then apply every rank's chunk to the whole param bucket.

use half::bf16;
use rayon::prelude::*;

use crate::backend::grad_element::{bf16_from_f32, bf16_to_f32};
use crate::codec::quant::QuantSpec;
use crate::codec::slab::{GroupRun, SlabLayout, SlabView};
use crate::codec::weight_encoding::WeightEncoding;
use crate::config::Rounding;
use crate::error::{Error, Result};
use crate::layout::BucketPlan;
use crate::rng::UniformStream;

use super::prefetch::Stream;
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
    let (new_stream, reference_stream) = (Stream::new(new), Stream::new(reference));
    with_scratch(g, g, |x, u| {
        for i in 0..run.len() {
            let j = run.first + i;
            let start = (j * g).min(new.len());
            let end = ((j + 1) * g).min(new.len());
            let n = end - start;
            new_stream.prefetch_ahead(start..end);
            if encoding == WeightEncoding::Difference {
                reference_stream.prefetch_ahead(start..end);
            }
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
    let (params_stream, reference_stream) = (Stream::new(params), Stream::new(own_reference));
    params
        .par_chunks_mut(plan.shard_len)
        .zip(recv.par_chunks_exact(layout.byte_len()))
        .enumerate()
        .try_for_each(|(z, (shard, bytes))| {
            let view = layout.view(bytes)?;
            let reference =
                (encoding == WeightEncoding::Difference && z == me).then_some(own_reference);
            // What the groups read besides their codes, prefetched ahead of them: the reference,
            // else the shard's params.
            let ahead = match reference {
                Some(_) => reference_stream,
                None => params_stream.skip(z * plan.shard_len),
            };
            shard
                .par_chunks_mut(run * g)
                .enumerate()
                .try_for_each(|(r, dst)| apply_run(&view, encoding, r * run, reference, ahead, dst))
        })
}

/// Applies groups `k0 ..` of one received slab to `dst` (their elements of the shard);
/// `reference` is this rank's own previous shard when `dst` lies in it; `ahead` is the stream,
/// indexed like the shard, that each group prefetches ahead of itself.
fn apply_run(
    view: &SlabView<'_>,
    encoding: WeightEncoding,
    k0: usize,
    reference: Option<&[bf16]>,
    ahead: Stream,
    dst: &mut [bf16],
) -> Result<()> {
    let g = view.layout().spec.group_size;
    with_scratch(g, 0, |d, _| {
        for (i, dst) in dst.chunks_mut(g).enumerate() {
            let j = k0 + i;
            ahead.prefetch_ahead(j * g..j * g + dst.len());
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
