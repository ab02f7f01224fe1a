//! The Rust CUDA backend end to end without a GPU, on an emulated CUDA driver (a shared
//! library built from `tests/cuda_driver_emulation/*.cpp` by [`library`], loaded as
//! `libcuda.so` by this process only; its model and limits: `docs/cuda.md`).
//!
//! Everything above the driver is the product's: probe, NVRTC compilation of `kernels/`,
//! module loading, `Kernels`' launch checks and grid sizing, `DeviceBuffer`, the `Cuda`
//! backend and the collectives over a `Comm<Cuda>` whose exchanges are stream operations
//! ([`comm`]). The kernels run through the host warp emulator, each stream on its own worker
//! thread with random delays, every device access checked against the allocations and for
//! unordered accesses by other streams.
//!
//! - `end_to_end_*`: every preset and ablation, on 2x2, 1x4, 4x1 and unequal nodes, P = 1 and
//!   3, three steps with odd sizes and NaN / Inf: the same bytes as `Host`
//!   (`sdp4bit_test_support::cuda_end_to_end` over [`comm::EmulatedCluster`]);
//!   `end_to_end_capped_grids`: buckets larger than a capped grid covers;
//! - `fault_*`: injected faults are caught ([`faults`]);
//! - the autotune of an architecture the variant table lacks, its record and its switch
//!   ([`autotune`]);
//! - the hot path without the host ([`hot_path`]): host synchronisations are counted (and
//!   the `end_to_end_*` sweeps find none inside either collective), Global-QSGD's special
//!   buckets and an overflow of its integer sum on the device;
//! - the buffers come from the allocator the backend is given, and the sdp4bit preset's
//!   device bytes per parameter ([`device_memory`]);
//! - a bucket re-created while its predecessor's step may still run sets up after it, with a
//!   stream-ordered caching allocator ([`set_up`]);
//! - `gpu_suite_runs_on_the_emulation`, `gpu_collectives_run_on_the_emulation`:
//!   `tests/cuda_gpu.rs` and `tests/cuda_gpu_collectives.rs`, unchanged, in a child process
//!   that finds the emulation as its `libcuda.so` ([`gpu_suite`]).
//!
//! Needs g++ and NVRTC (`.cache/`, see `scripts/env.sh`); `SDP4BIT_CUDA_EMULATION_SEED`
//! repeats a run's delays and warp orders, `SDP4BIT_TEST_SEED` its data.

mod autotune;
mod child;
mod comm;
mod device_memory;
mod faults;
mod gpu_suite;
mod hot_path;
mod images;
mod kernel_check;
mod library;
mod set_up;

use sdp4bit::Preset;
use sdp4bit_test_support::cuda_end_to_end::{
    ABLATIONS, Sweep, compare_collectives, data_seed, topologies,
};
use sdp4bit_test_support::setups::cfg;

use comm::EmulatedCluster;
use library::emulation;

/// Both collectives of the preset with `overrides`, with `P = 1` and `P = 3` on every
/// topology of the sweep; no fault may have been reported.
fn sweep(name: &str, preset: Preset, overrides: &[(&str, &str)]) {
    let seed = data_seed();
    println!("data seed {seed} (SDP4BIT_TEST_SEED={seed} repeats it)");
    let kernels_before = emulation().completed(c"kernel");
    let collectives_before = emulation().completed(c"collective");
    let sweep = Sweep {
        topologies: topologies(),
        grad_shard: 307,
        weight_shard: 197,
        seed,
    };
    sweep.run(EmulatedCluster::new, name, preset, overrides);
    let faults = emulation().take_faults(-1);
    assert!(
        faults.is_empty(),
        "{name}: the emulation reported:\n{faults}"
    );
    // The work really went through the emulated driver (other tests only add to the counts).
    assert!(
        emulation().completed(c"collective") > collectives_before,
        "{name}: no collective ran"
    );
    if preset != Preset::Baseline {
        assert!(
            emulation().completed(c"kernel") > kernels_before,
            "{name}: no kernel ran"
        );
    }
}

#[test]
fn end_to_end_sdp4bit() {
    sweep("sdp4bit", Preset::Sdp4bit, &[]);
}

#[test]
fn end_to_end_qsdp() {
    sweep("qsdp", Preset::Qsdp, &[]);
}

#[test]
fn end_to_end_global_qsgd() {
    sweep("global-qsgd", Preset::GlobalQsgd, &[]);
}

#[test]
fn end_to_end_zeropp() {
    sweep("zeropp", Preset::Zeropp, &[]);
}

#[test]
fn end_to_end_baseline() {
    sweep("baseline", Preset::Baseline, &[]);
}

#[test]
fn end_to_end_ablations() {
    for (name, preset, overrides) in ABLATIONS {
        sweep(name, preset, overrides);
    }
}

/// Buckets larger than a capped grid covers at once: rank 0's device has one multiprocessor,
/// so its launches are capped at 32 blocks (256 groups, or 8192 elements for Global-QSGD) and
/// the kernels' grid-stride loops run several rounds.
#[test]
fn end_to_end_capped_grids() {
    let seed = data_seed();
    let topo = sdp4bit::layout::Topology::uniform(1, 2).expect("one node of two");
    let cluster = EmulatedCluster::new(&topo);
    for (name, preset) in [
        ("sdp4bit large", Preset::Sdp4bit),
        ("global-qsgd large", Preset::GlobalQsgd),
    ] {
        compare_collectives(&cluster, &cfg(preset, &[]), name, 20011, 20011, seed);
    }
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "the emulation reported:\n{faults}");
}
