//! sdp4bit: 4-bit communication for sharded data parallelism.
//!
//! The Rust core of a Megatron-LM / DeepSpeed plugin that replaces ZeRO's weight all-gather
//! and gradient reduce-scatter with compressed versions: SDP4Bit (qWD weights, TLq-HS
//! gradients), QSDP, Global-QSGD, ZeRO++-style and uncompressed baselines. What they compute is
//! specified in `docs/numerics.md`; this crate knows nothing of Python or torch.
//!
//! Layers, bottom up; each names only the layers below it, so no two modules import each
//! other (`tests/layering` checks):
//! - [`error`]: the error type;
//! - one layer whose modules name none of each other: [`config`] (codec choices, presets,
//!   knobs, validation and the cross-rank fingerprint), [`rng`] (Philox4x32-10) and
//!   [`hadamard`] (the Walsh-Hadamard butterfly);
//! - [`codec`]: the group quantizer, the byte layout of a slab on the wire, and the small types
//!   the backends and the collectives share (what a weight slab encodes, Global-QSGD's integer
//!   codes, the element types a reduce-scatter sums);
//! - [`layout`]: topology, padding and the swizzled layout;
//! - [`backend`]: the [`Backend`](backend::Backend) trait the collectives run over, and its two
//!   implementations, which name neither each other nor the collectives:
//!   - [`backend::cpu`]: the fused passes with rayon (the executable reference);
//!   - [`backend::cuda`]: the same passes as CUDA kernels (NVRTC at first use, launched on the
//!     caller's stream); without a driver or GPU it reports an error value;
//! - [`collective`]: every algorithm once, over the [`collective::Comm`] trait, plus an
//!   in-process `Comm` for tests and benchmarks;
//! - [`kernel_check`]: a CUDA bucket's kernels against the host's bytes before its first step;
//! - `ffi` (feature `ffi`): the cxx bridge the torch extension in `cpp/` links against.

pub mod backend;
pub mod codec;
pub mod collective;
pub mod config;
pub mod error;
#[cfg(feature = "ffi")]
mod ffi;
pub mod hadamard;
pub mod kernel_check;
pub mod layout;
pub mod rng;

pub use config::{Config, ExactParams, GradCodec, Preset, Rounding, WeightCodec};
pub use error::{Error, Result};
