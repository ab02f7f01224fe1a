//! Support code shared by sdp4bit's integration tests (`tests/`), one job per module:
//!
//! - [`random`]: the fixed-seed generator and the random buckets the tests draw;
//! - [`bits`]: outputs as bit patterns, digests and bit-exact comparison;
//! - [`setups`]: the configs and topologies the collective sweeps run on;
//! - [`cluster`]: one collective on every rank of an in-process cluster;
//! - [`recorder`]: a `Comm` that records every payload it carries;
//! - [`reference`](mod@reference): exact f64 answers and the error bounds derived from the
//!   quantizers;
//! - [`error_stats`]: comparing outputs with a reference and asserting the bounds;
//! - [`cuda_cluster`]: the `Cuda` backend on in-process ranks, one thread and stream each;
//! - [`cuda_end_to_end`]: both collectives on such ranks against the host, byte for byte;
//! - [`gxx`]: host builds of the kernels with g++ (both CUDA emulations);
//! - [`host_kernels`]: the host builds of specialised kernels those emulations run;
//! - [`spec_cover`]: the specialisations the presets, ablations and knobs produce;
//! - [`kernel_resources`]: registers, spills and SASS instruction counts of the compiled
//!   kernels (ptxas, nvdisasm);
//! - the kernel model (`bench/kernels.rs`, docs/kernel-model.md): [`kernel_count`], dynamic
//!   warp-instruction counts of a kernel from its SASS ([`sass`]) and a host run's line counts
//!   ([`emulator_case`], [`host_coverage`], [`gcov`] with [`json`], [`source_loops`],
//!   [`dynamic_count`]), builds cached by [`digest`] and
//!   made whole or not at all by [`cache_entry`], older kernels from git by
//!   [`commit_sources`]; [`round_trips`], the dependent loads of a work unit; [`timing_model`],
//!   a kernel's time from its bytes, instructions and serial phases.
//!
//! The root package depends on this crate as a dev-dependency, so the tests and this crate
//! share one build of `sdp4bit` and its types. Every test binary waits for this crate to
//! build, so code with a single user lives beside that user instead: the kernel emulator's
//! driver in `tests/cuda_emulated/emulator/`, the Rust path reader in `tests/layering/`.

pub mod bits;
pub mod cache_entry;
pub mod cluster;
pub mod commit_sources;
pub mod cuda_cluster;
pub mod cuda_end_to_end;
pub mod digest;
pub mod dynamic_count;
pub mod emulator_case;
pub mod error_stats;
pub mod gcov;
pub mod gxx;
pub mod host_coverage;
pub mod host_kernels;
pub mod json;
pub mod kernel_count;
pub mod kernel_resources;
pub mod random;
pub mod recorder;
pub mod reference;
pub mod round_trips;
pub mod sass;
pub mod setups;
pub mod source_loops;
pub mod spec_cover;
pub mod specialised_count;
pub mod timing_model;
