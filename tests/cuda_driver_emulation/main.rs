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
//!   ([`end_to_end`]); `end_to_end_capped_grids`: buckets larger than a capped grid covers;
//! - `fault_*`: injected faults are caught ([`faults`]);
//! - the hot path without the host ([`hot_path`]): host synchronisations are counted (and
//!   `end_to_end` finds none inside either collective), Global-QSGD's special buckets and an
//!   overflow of its integer sum on the device;
//! - the buffers come from the allocator the backend is given, and the sdp4bit preset's
//!   device bytes per parameter ([`device_memory`]);
//! - a bucket re-created while its predecessor's step may still run sets up after it, with a
//!   stream-ordered caching allocator ([`set_up`]);
//! - `gpu_suite_runs_on_the_emulation`: `tests/cuda_gpu.rs`, unchanged, in a child process
//!   that finds the emulation as its `libcuda.so` ([`gpu_suite`]).
//!
//! Needs g++ and NVRTC (`.cache/`, see `scripts/env.sh`); `SDP4BIT_CUDA_EMULATION_SEED`
//! repeats a run's delays and warp orders, `SDP4BIT_TEST_SEED` its data.

mod child;
mod comm;
mod device_memory;
mod end_to_end;
mod faults;
mod gpu_suite;
mod hot_path;
mod images;
mod library;
mod self_check;
mod set_up;

use half::bf16;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::setups::cfg;

use end_to_end::{compare_all_gather, compare_reduce_scatter, topologies};
use library::emulation;

/// The data seed: `SDP4BIT_TEST_SEED`, else fixed.
fn data_seed() -> u64 {
    std::env::var("SDP4BIT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5d94_b17e)
}

/// Both collectives of `config` with `P = 1` and `P = 3` on every topology of the sweep; no
/// fault may have been reported.
fn sweep(name: &str, preset: Preset, overrides: &[(&str, &str)]) {
    let seed = data_seed();
    println!("data seed {seed} (SDP4BIT_TEST_SEED={seed} repeats it)");
    let kernels_before = emulation().completed(c"kernel");
    let collectives_before = emulation().completed(c"collective");
    for chunks in ["1", "3"] {
        let mut knobs = overrides.to_vec();
        knobs.push(("pipeline_chunks", chunks));
        let config: Config = cfg(preset, &knobs);
        for (topo_name, topo) in topologies() {
            let w = topo.world();
            let what = format!("{name} P={chunks} {topo_name}");
            compare_reduce_scatter::<f32>(&config, &what, &topo, 307 * w, seed);
            let bf16_buckets = format!("{what} bf16 buckets");
            compare_reduce_scatter::<bf16>(&config, &bf16_buckets, &topo, 307 * w, seed ^ 2);
            compare_all_gather(&config, &what, &topo, 197 * w, seed ^ 1);
        }
    }
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
    sweep(
        "global-qsgd 16-bit",
        Preset::GlobalQsgd,
        &[("global_qsgd_bits", "16")],
    );
}

#[test]
fn end_to_end_zeropp() {
    sweep("zeropp", Preset::Zeropp, &[]);
}

#[test]
fn end_to_end_baseline() {
    sweep("baseline", Preset::Baseline, &[]);
}

/// The ablations: TLq without Hadamard, qW (direct weights), nearest rounding, and
/// quantization starting at step 1 (step 0 reduce-scatters exact fp32).
#[test]
fn end_to_end_ablations() {
    sweep("tlq", Preset::Sdp4bit, &[("grad_codec", "tlq")]);
    sweep("qw", Preset::Sdp4bit, &[("weight_codec", "qw")]);
    sweep(
        "nearest",
        Preset::Sdp4bit,
        &[("grad_rounding", "nearest"), ("weight_rounding", "nearest")],
    );
    sweep(
        "start step 1",
        Preset::Sdp4bit,
        &[("grad_quant_start_step", "1")],
    );
}

/// Buckets larger than a capped grid covers at once: rank 0's device has one multiprocessor,
/// so its launches are capped at 32 blocks (256 groups, or 8192 elements for Global-QSGD) and
/// the kernels' grid-stride loops run several rounds.
#[test]
fn end_to_end_capped_grids() {
    let seed = data_seed();
    let topo = sdp4bit::plan::Topology::uniform(1, 2).expect("one node of two");
    for (name, preset) in [
        ("sdp4bit large", Preset::Sdp4bit),
        ("global-qsgd large", Preset::GlobalQsgd),
    ] {
        let config = cfg(preset, &[]);
        compare_reduce_scatter::<f32>(&config, name, &topo, 2 * 20011, seed);
        compare_reduce_scatter::<bf16>(&config, name, &topo, 2 * 20011, seed ^ 2);
        compare_all_gather(&config, name, &topo, 2 * 20011, seed ^ 1);
    }
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "the emulation reported:\n{faults}");
}
