//! The three fused passes of the grouped gradient reduce-scatter (docs/numerics.md §7.1).
//!
//! Each pass is parallel over runs of consecutive output groups (`run_groups`); a run
//! is processed group by group in a per-thread scratch buffer, so every input byte is read once
//! and every output byte written once.

use rayon::prelude::*;

use crate::backend::grad_element::{GradElement, narrow_into, widen_into};
use crate::codec::slab::{GroupRun, SlabLayout};
use crate::config::Rounding;
use crate::error::Result;
use crate::hadamard;
use crate::layout::GradLayout;
use crate::rng::UniformStream;

use super::prefetch::Stream;
use super::{run_groups, with_scratch};

/// The largest group, in bytes of the bucket, whose input the first pass prefetches ahead
/// (`prefetch`): measured on the Intel Xeon guest, prefetching made the 512-byte groups of
/// sdp4bit's and ZeRO++'s first passes 8% and 27% faster and QSDP's 4 KiB groups, quantized in
/// place, 15% slower (bench/results/cpu.md).
const PREFETCH_MAX_GROUP_BYTES: usize = 2048;

/// First pass: Hadamard (when on) + quantize + swizzle of the whole bucket, all P chunks, into
/// `out` (`P * first.peers` slabs of the first level). Each element is read as its fp32 value
/// (docs/numerics.md §7.5).
pub fn quantize_first<G: GradElement>(
    layout: &GradLayout,
    bucket: &[G],
    rng: &UniformStream,
    out: &mut [u8],
) {
    let chunk_bytes = layout.first.peers * layout.first.slab.byte_len();
    for (p, chunk) in out.chunks_exact_mut(chunk_bytes).enumerate() {
        quantize_first_chunk(layout, p, bucket, rng, chunk);
    }
}

/// The first pass of chunk `p` alone, into `out` (the `first.peers` slabs of chunk `p`, the
/// bytes [`quantize_first`] writes at `p * first.peers` slabs).
pub fn quantize_first_chunk<G: GradElement>(
    layout: &GradLayout,
    p: usize,
    bucket: &[G],
    rng: &UniformStream,
    out: &mut [u8],
) {
    let first = layout.first;
    let g = first.slab.spec.group_size;
    out.par_chunks_mut(first.slab.byte_len())
        .enumerate()
        .for_each(|(x1, slab)| {
            first
                .slab
                .par_runs_mut(slab, run_groups(g))
                .for_each(|run| quantize_first_run(layout, p, x1, bucket, rng, run));
        });
}

/// One run of [`quantize_first`]: the groups `run.first ..` of the slab for chunk `p` and
/// first-level peer `x1`.
fn quantize_first_run<G: GradElement>(
    layout: &GradLayout,
    p: usize,
    x1: usize,
    bucket: &[G],
    rng: &UniformStream,
    mut run: GroupRun<'_>,
) {
    let spec = layout.first.slab.spec;
    let g = spec.group_size;
    let gc = layout.groups_per_chunk();
    let plan = layout.bucket;
    let stream = Stream::new(bucket);
    with_scratch(g, g, |x, u| {
        for i in 0..run.len() {
            let k = run.first + i;
            let (x2, j) = (k / gc, k % gc);
            let z = layout.dest(x1, x2);
            let offset = p * plan.chunk_len() + j * g;
            let range = plan.real_range(z, offset, g);
            if g * size_of::<G>() <= PREFETCH_MAX_GROUP_BYTES {
                stream.prefetch_ahead(range.clone());
            }
            let real = &bucket[range];
            if spec.rounding == Rounding::Stochastic {
                rng.fill(plan.padded_index(z, offset), u);
            }
            if layout.hadamard.is_none()
                && real.len() == g
                && let Some(real) = G::as_f32(real)
            {
                // A whole fp32 group needs no transform and no padding: quantize it in place.
                run.quantize(i, &spec, real, u);
                continue;
            }
            widen_into(real, &mut x[..real.len()]);
            x[real.len()..].fill(0.0);
            if let Some(block) = layout.hadamard {
                hadamard::forward(x, block);
            }
            run.quantize(i, &spec, x, u);
        }
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
    let second = layout
        .second
        .expect("requantize_second needs a second level");
    let g = second.slab.spec.group_size;
    let first = layout.first;
    first.slab.check_slabs(recv.len(), first.peers)?;
    out.par_chunks_mut(second.slab.byte_len())
        .enumerate()
        .try_for_each(|(x2, slab)| {
            second
                .slab
                .par_runs_mut(slab, run_groups(g))
                .try_for_each(|run| requantize_run(layout, my_x1, p, x2, recv, rng, run))
        })
}

/// One run of [`requantize_second`]: sums the run's groups of every received slab into the
/// scratch, then requantizes them group by group.
fn requantize_run(
    layout: &GradLayout,
    my_x1: usize,
    p: usize,
    x2: usize,
    recv: &[u8],
    rng: &UniformStream,
    mut run: GroupRun<'_>,
) -> Result<()> {
    let second = layout.second.expect("checked by requantize_second");
    let spec = second.slab.spec;
    let g = spec.group_size;
    let plan = layout.bucket;
    let first_group = x2 * layout.groups_per_chunk() + run.first;
    let z = layout.dest(my_x1, x2);
    with_scratch(run.len() * g, g, |sum, u| {
        sum_groups(recv, layout.first.slab, first_group, sum)?;
        for (i, x) in sum.chunks_exact(g).enumerate() {
            if spec.rounding == Rounding::Stochastic {
                let offset = p * plan.chunk_len() + (run.first + i) * g;
                rng.fill(plan.padded_index(z, offset), u);
            }
            run.quantize(i, &spec, x, u);
        }
        Ok(())
    })
}

/// Last pass for chunk `p`: dequantize the slabs received at the last level, sum them in rank
/// order, invert the Hadamard transform and write the real elements of chunk `p` of this
/// rank's shard (`shard.len() == S`), each rounded to `G` (docs/numerics.md §7.5).
pub fn reduce_final<G: GradElement>(
    layout: &GradLayout,
    p: usize,
    recv: &[u8],
    shard: &mut [G],
) -> Result<()> {
    let last = layout.last();
    let g = last.slab.spec.group_size;
    last.slab.check_slabs(recv.len(), last.peers)?;
    let run = run_groups(g);
    let chunk = layout.bucket.chunk_len();
    let start = (p * chunk).min(shard.len());
    let end = ((p + 1) * chunk).min(shard.len());
    shard[start..end]
        .par_chunks_mut(run * g)
        .enumerate()
        .try_for_each(|(r, dst)| {
            let finish = |x: &mut [f32]| -> Result<()> {
                sum_groups(recv, last.slab, r * run, x)?;
                if let Some(block) = layout.hadamard {
                    hadamard::inverse(x, block);
                }
                Ok(())
            };
            let whole = dst.len() % g == 0;
            match G::as_f32_mut(dst) {
                Some(dst) if whole => finish(dst),
                _ => {
                    let groups = dst.len().div_ceil(g);
                    with_scratch(groups * g, 0, |x, _| {
                        finish(x)?;
                        narrow_into(&x[..dst.len()], dst);
                        Ok(())
                    })
                }
            }
        })
}

/// `out = sum over slabs s (in order) of dequantize(groups k0 .. k0 + out.len() / g of slab
/// s)`, where `recv` holds slabs laid out by `layout` (the partial sums of each element are
/// taken in slab order, as the per-group definition does). Runs are short (`TASK_ELEMS`), so
/// the far-apart slabs are read in short interleaved pieces that keep all their streams in the
/// hardware prefetcher.
fn sum_groups(recv: &[u8], layout: SlabLayout, k0: usize, out: &mut [f32]) -> Result<()> {
    let g = layout.spec.group_size;
    for (s, bytes) in recv.chunks_exact(layout.byte_len()).enumerate() {
        let view = layout.view(bytes)?;
        for (i, x) in out.chunks_exact_mut(g).enumerate() {
            if s == 0 {
                view.decode_group(k0 + i, x, |_, v| v)?;
            } else {
                view.decode_group(k0 + i, x, |acc, v| acc + v)?;
            }
        }
    }
    Ok(())
}
