//! The fused passes on the CPU with rayon, parallel over output groups.
//!
//! Each pass reads its inputs once and writes its outputs once: the per-group work (load,
//! Hadamard, draw uniforms, quantize, dequantize and sum) runs in a per-thread scratch buffer
//! that stays in L1. Scratch buffers grow to the largest group once per thread and are reused,
//! so the passes do not allocate in steady state.

pub mod global_qsgd;
pub mod gradient;
pub mod weight;

use std::cell::RefCell;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch split into two buffers of `len` floats each (values and
/// uniforms). Contents on entry are unspecified.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < 2 * len {
            buf.resize(2 * len, 0.0);
        }
        let (values, uniforms) = buf[..2 * len].split_at_mut(len);
        f(values, uniforms)
    })
}
