//! The fused passes on the CPU with rayon, parallel over runs of consecutive output groups.
//!
//! Each pass reads its inputs once and writes its outputs once: the per-group work (load,
//! Hadamard, draw uniforms, quantize, dequantize and sum) runs in a per-thread scratch buffer
//! that stays in L1/L2. A parallel task covers about `TASK_ELEMS` elements, so scheduling and
//! per-task set-up are paid once per run rather than once per group. Scratch buffers grow to
//! the largest run once per thread and are reused, so the passes do not allocate in steady
//! state. `bench/cpu.rs` measures every pass against memcpy.

pub mod buffers;
pub mod global_qsgd;
pub mod gradient;
mod host;
pub mod pool;
mod prefetch;
pub mod weight;

pub use host::Host;

use std::cell::RefCell;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Elements one parallel task covers (rounded up to whole groups): enough that per-task set-up
/// (scratch, slab views, layout arithmetic) is small, few enough that a task's data stays in L1
/// and that the slabs a reduction reads are visited in short interleaved pieces (measured on
/// the benchmark: 1024 is as fast as or faster than 8192 on every pass).
const TASK_ELEMS: usize = 1024;

/// Groups of `group_size` elements per parallel task (at least one).
fn run_groups(group_size: usize) -> usize {
    (TASK_ELEMS / group_size).max(1)
}

/// Runs `f` with this thread's scratch split into buffers of `values` and `uniforms` floats.
/// Contents on entry are unspecified.
fn with_scratch<R>(
    values: usize,
    uniforms: usize,
    f: impl FnOnce(&mut [f32], &mut [f32]) -> R,
) -> R {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < values + uniforms {
            buf.resize(values + uniforms, 0.0);
        }
        let (v, u) = buf[..values + uniforms].split_at_mut(values);
        f(v, u)
    })
}
