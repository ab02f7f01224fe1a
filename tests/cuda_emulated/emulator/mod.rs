//! The Rust driver of the CUDA kernel emulator (`tests/kernel_emulator/`), beside its only user
//! (compiled into this test alone, not into the shared support crate): g++ compiles the
//! kernels of `kernels/` unchanged against a host emulation of the CUDA device environment
//! (each warp runs as 32 cooperative fibers that meet at every shuffle and vote; see
//! `cuda_shim.h` for the model and its limits), and the emulator runs launches generated here
//! from the CPU backend, writing the outputs for comparison.
//!
//! - `grad`, `weight`, `global`: each kernel family's cases, built from the CPU backend (the
//!   launch parameters from the CUDA backend's own `abi` constructors, so the `#[repr(C)]`
//!   mirrors are checked against the C structs too), the parameter structs whose kernels the
//!   family launches, and its tests (one per codec); each launch is the specialisation of its
//!   parameters with the default variant, compiled for the host from the entry point the
//!   backend writes (`sdp4bit_test_support::host_kernels`);
//! - `data`: the random inputs (special values, damaged slabs);
//! - [`Case`]: buffers, launches and the expected outputs; the case file;
//! - `compare`: the first difference between an emulated output and the CPU's;
//! - `compile`: the g++ build, once per test process;
//! - `sweep`: runs one family's cases and reports the differences;
//! - `variants`: cases of the presets' configurations with every variant of each launch.
//!
//! Outputs are compared as `tests/cuda_gpu.rs` does on a GPU: codes and padding byte for byte,
//! scales, offsets, fp32 and bf16 values bit for bit with NaN compared as NaN-ness. The
//! emulator itself fails a case on a divergent warp, an out-of-bounds access (guard pages
//! and canaries around every buffer) or undefined behaviour (UBSan), naming the case, launch
//! and thread.

mod case;
mod compare;
mod compile;
mod data;
mod global;
mod grad;
mod sweep;
mod variants;
mod weight;

use sdp4bit::{Config, Preset};

/// The sdp4bit preset with `base` and then `extra` knobs.
fn preset_config(
    base: &[(&'static str, &'static str)],
    extra: &[(&'static str, String)],
) -> Config {
    let knobs = base
        .iter()
        .copied()
        .chain(extra.iter().map(|(k, v)| (*k, v.as_str())));
    Config::from_overrides(Preset::Sdp4bit, knobs).expect("valid config")
}
