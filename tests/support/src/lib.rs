//! Support code shared by sdp4bit's integration tests (`tests/*.rs`), one job per module:
//!
//! - [`random`]: the fixed-seed generator and the random buckets the tests draw;
//! - [`bits`]: outputs as bit patterns, digests and bit-exact comparison;
//! - [`setups`]: the configs and topologies the collective sweeps run on;
//! - [`cluster`]: one collective on every rank of an in-process cluster;
//! - [`recorder`]: a `Comm` that records every payload it carries;
//! - [`reference`](mod@reference): exact f64 answers and the error bounds derived from the quantizers;
//! - [`error_stats`]: comparing outputs with a reference and asserting the bounds;
//! - [`kernel_emulator`]: the Rust driver of the g++ CUDA kernel emulator
//!   (`tests/kernel_emulator/`);
//! - [`rust_source`]: the module paths a Rust source file names, for the layering test.
//!
//! The root package depends on this crate as a dev-dependency, so the tests and this crate
//! share one build of `sdp4bit` and its types.

pub mod bits;
pub mod cluster;
pub mod error_stats;
pub mod kernel_emulator;
pub mod random;
pub mod recorder;
pub mod reference;
pub mod rust_source;
pub mod setups;
