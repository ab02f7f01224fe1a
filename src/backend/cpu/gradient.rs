//! The three fused passes of the grouped gradient reduce-scatter (SPEC §5).

use rayon::prelude::*;

use crate::config::Rounding;
use crate::error::Result;
use crate::hadamard;
use crate::plan::GradLayout;
use crate::rng::UniformStream;

use super::with_scratch;

/// First pass: Hadamard (when on) + quantize + swizzle of the whole bucket, all P chunks, into
/// `out` (`P * first.peers` slabs of the first level).
pub fn quantize_first(layout: &GradLayout, bucket: &[f32], rng: &UniformStream, out: &mut [u8]) {
    let first = layout.first;
    let spec = first.slab.spec;
    let g = spec.group_size;
    let gc = layout.groups_per_chunk();
    let plan = layout.bucket;
    out.par_chunks_mut(first.slab.byte_len())
        .enumerate()
        .for_each(|(s, slab)| {
            let (p, x1) = (s / first.peers, s % first.peers);
            first
                .slab
                .par_slots_mut(slab)
                .enumerate()
                .for_each(|(k, mut slot)| {
                    let (x2, j) = (k / gc, k % gc);
                    let z = layout.dest(x1, x2);
                    let offset = p * plan.chunk_len() + j * g;
                    with_scratch(g, |x, u| {
                        let real = plan.real_range(z, offset, g);
                        let n = real.len();
                        x[..n].copy_from_slice(&bucket[real]);
                        x[n..].fill(0.0);
                        if let Some(block) = layout.hadamard {
                            hadamard::forward(x, block);
                        }
                        if spec.rounding == Rounding::Stochastic {
                            rng.fill(plan.padded_index(z, offset), u);
                        }
                        slot.quantize(&spec, x, u);
                    });
                });
        });
}

/// Second pass for chunk `p`: dequantize the `first.peers` received slabs, sum them in rank
/// order and requantize at the second level into `out` (`second.peers` slabs). `my_x1` is
/// this rank's index in the first-level communicator.
pub fn requantize_second(
    layout: &GradLayout,
    my_x1: usize,
    p: usize,
    recv: &[u8],
    rng: &UniformStream,
    out: &mut [u8],
) -> Result<()> {
    let first = layout.first;
    let second = layout
        .second
        .expect("requantize_second needs a second level");
    let spec = second.slab.spec;
    let g = spec.group_size;
    let gc = layout.groups_per_chunk();
    let plan = layout.bucket;
    let in_len = first.slab.byte_len();
    out.par_chunks_mut(second.slab.byte_len())
        .enumerate()
        .try_for_each(|(x2, slab)| {
            second
                .slab
                .par_slots_mut(slab)
                .enumerate()
                .try_for_each(|(j, mut slot)| {
                    with_scratch(g, |x, u| {
                        sum_group(recv, in_len, first.slab, x2 * gc + j, x)?;
                        let z = layout.dest(my_x1, x2);
                        if spec.rounding == Rounding::Stochastic {
                            let offset = p * plan.chunk_len() + j * g;
                            rng.fill(plan.padded_index(z, offset), u);
                        }
                        slot.quantize(&spec, x, u);
                        Ok(())
                    })
                })
        })
}

/// Last pass for chunk `p`: dequantize the slabs received at the last level, sum them in rank
/// order, invert the Hadamard transform and write the real elements of chunk `p` of this
/// rank's shard (`shard.len() == S`).
pub fn reduce_final(layout: &GradLayout, p: usize, recv: &[u8], shard: &mut [f32]) -> Result<()> {
    let last = layout.last();
    let g = last.slab.spec.group_size;
    let chunk = layout.bucket.chunk_len();
    let start = (p * chunk).min(shard.len());
    let end = ((p + 1) * chunk).min(shard.len());
    let in_len = last.slab.byte_len();
    shard[start..end]
        .par_chunks_mut(g)
        .enumerate()
        .try_for_each(|(j, dst)| {
            let finish = |x: &mut [f32]| -> Result<()> {
                sum_group(recv, in_len, last.slab, j, x)?;
                if let Some(block) = layout.hadamard {
                    hadamard::inverse(x, block);
                }
                Ok(())
            };
            if dst.len() == g {
                finish(dst)
            } else {
                with_scratch(g, |x, _| {
                    finish(x)?;
                    dst.copy_from_slice(&x[..dst.len()]);
                    Ok(())
                })
            }
        })
}

/// `out = sum over slabs s (in order) of dequantize(group k of slab s)`, where `recv` holds
/// slabs of `slab_len` bytes laid out by `layout`.
fn sum_group(
    recv: &[u8],
    slab_len: usize,
    layout: crate::codec::slab::SlabLayout,
    k: usize,
    out: &mut [f32],
) -> Result<()> {
    for (s, bytes) in recv.chunks_exact(slab_len).enumerate() {
        let view = layout.view(bytes)?;
        if s == 0 {
            view.decode_group(k, out, |_, v| v)?;
        } else {
            view.decode_group(k, out, |acc, v| acc + v)?;
        }
    }
    Ok(())
}
