//! The kernel check a CUDA bucket runs before its first step: it passes for every preset and
//! ablation, topology and pipeline depth on the emulated device, launching the kernels the
//! bucket uses; it runs once per device, collective, config, topology and rank; and a kernel
//! fault injected into the emulation (one wrong byte in a kernel's output) is caught and named
//! with the device, driver, byte index and both values. `SDP4BIT_CUDA_KERNEL_CHECK=0` turns it
//! off. The scenarios with a fault or a cache to observe run in child processes.

use sdp4bit::backend::cuda::Kernels;
use sdp4bit::kernel_check::{Collective, KERNEL_CHECK_VAR, check_bucket, check_bucket_once};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::cuda_end_to_end::topologies;
use sdp4bit_test_support::setups::cfg;

use super::child::{assert_child_passed, run_isolated};
use super::library::emulation;

const COLLECTIVES: [Collective; 2] = [Collective::GradReduceScatter, Collective::WeightAllGather];

/// Every preset and ablation the end-to-end sweep runs, on every topology, P = 1 and 3, ranks
/// 0 and the last, both collectives: the device's bytes equal the host's, and kernels ran.
#[test]
fn kernel_check_passes_for_every_codec_and_topology() {
    emulation();
    let kernels = Kernels::get(0).expect("the kernels load");
    let before = emulation().completed(c"kernel");
    let presets: [(Preset, &[(&str, &str)]); 8] = [
        (Preset::Sdp4bit, &[]),
        (Preset::Qsdp, &[]),
        (Preset::GlobalQsgd, &[]),
        (Preset::GlobalQsgd, &[("global_qsgd_bits", "16")]),
        (Preset::Zeropp, &[]),
        (Preset::Baseline, &[]),
        (
            Preset::Sdp4bit,
            &[("grad_codec", "tlq"), ("weight_codec", "qw")],
        ),
        (
            Preset::Sdp4bit,
            &[("grad_rounding", "nearest"), ("weight_rounding", "nearest")],
        ),
    ];
    for (preset, knobs) in presets {
        for chunks in ["1", "3"] {
            let mut knobs = knobs.to_vec();
            knobs.push(("pipeline_chunks", chunks));
            let config: Config = cfg(preset, &knobs);
            for (name, topology) in topologies() {
                for rank in [0, topology.world() - 1] {
                    for collective in COLLECTIVES {
                        check_bucket(kernels, collective, &config, &topology, rank).unwrap_or_else(
                            |e| panic!("{preset} {knobs:?} {name} rank {rank} {collective:?}: {e}"),
                        );
                    }
                }
            }
        }
    }
    assert!(
        emulation().completed(c"kernel") > before,
        "the kernel check launched no kernel"
    );
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "the emulation reported:\n{faults}");
}

/// The two values of "wrote 0xAB at byte N of its output, the host backend 0xCD".
fn reported_bytes(message: &str) -> (u8, u8) {
    let hex = |after: &str| {
        let at = message.find(after).expect(after) + after.len();
        u8::from_str_radix(&message[at + 2..at + 4], 16).expect("a hex byte")
    };
    (hex(" wrote "), hex(" the host backend "))
}

/// A kernel made to write one wrong byte (the emulation flips bits of its output after it
/// ran) fails the check, which names that kernel, the device, the driver, the byte and both
/// values; with the fault removed the check passes. Each kernel of the sdp4bit (2x2, so both
/// gradient levels) and Global-QSGD buckets is faulted in turn.
#[test]
fn kernel_check_names_an_injected_kernel_fault() {
    let Some(output) = run_isolated(
        "kernel_check::kernel_check_names_an_injected_kernel_fault",
        &[],
        || {
            emulation();
            let kernels = Kernels::get(0).expect("the kernels load");
            let topology = Topology::uniform(2, 2).expect("2x2");
            let cases: [(Preset, Collective, &std::ffi::CStr, u64); 7] = [
                (
                    Preset::Sdp4bit,
                    Collective::GradReduceScatter,
                    c"grad_quantize_first",
                    70,
                ),
                (
                    Preset::Sdp4bit,
                    Collective::GradReduceScatter,
                    c"grad_requantize_second",
                    5,
                ),
                (
                    Preset::Sdp4bit,
                    Collective::GradReduceScatter,
                    c"grad_reduce_final",
                    401,
                ),
                (
                    Preset::Sdp4bit,
                    Collective::WeightAllGather,
                    c"weight_encode",
                    33,
                ),
                (
                    Preset::Sdp4bit,
                    Collective::WeightAllGather,
                    c"weight_apply",
                    1000,
                ),
                (
                    Preset::GlobalQsgd,
                    Collective::GradReduceScatter,
                    c"global_quantize_i8",
                    9,
                ),
                (
                    Preset::GlobalQsgd,
                    Collective::GradReduceScatter,
                    c"global_dequantize_i8",
                    12,
                ),
            ];
            for (preset, collective, kernel, byte) in cases {
                let config: Config = cfg(preset, &[]);
                let name = kernel.to_str().unwrap();
                emulation().corrupt_kernel_output(Some(kernel), byte, 0x10);
                let e = check_bucket(kernels, collective, &config, &topology, 1)
                    .expect_err("the injected fault is caught");
                emulation().corrupt_kernel_output(None, 0, 0);
                let message = e.to_string();
                println!("{name}: {message}");
                for needle in [
                    format!("kernel {name} on CUDA device 0 (sm_90, driver 13.0)"),
                    format!("at byte {byte} of its output"),
                    format!("({KERNEL_CHECK_VAR}=0 skips this check)"),
                ] {
                    assert!(message.contains(&needle), "{needle:?} not in: {message}");
                }
                let (device, host) = reported_bytes(&message);
                assert_eq!(device ^ host, 0x10, "{message}");
                check_bucket(kernels, collective, &config, &topology, 1)
                    .unwrap_or_else(|e| panic!("{name} without the fault: {e}"));
            }
            let faults = emulation().take_faults(-1);
            assert!(faults.is_empty(), "the emulation reported:\n{faults}");
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// `check_bucket_once` runs the kernels at the first set-up of a key only (another rank's
/// bucket is a new key).
#[test]
fn kernel_check_runs_once() {
    let Some(output) = run_isolated("kernel_check::kernel_check_runs_once", &[], || {
        emulation();
        let kernels = Kernels::get(0).expect("the kernels load");
        let topology = Topology::uniform(2, 2).expect("2x2");
        let config: Config = cfg(Preset::Sdp4bit, &[]);
        let check = || {
            check_bucket_once(
                kernels,
                Collective::GradReduceScatter,
                &config,
                &topology,
                1,
            )
        };
        let before = emulation().completed(c"kernel");
        check().expect("the first check passes");
        let first = emulation().completed(c"kernel");
        assert!(first > before, "the first set-up launched no kernel");
        check().expect("cached");
        assert_eq!(
            emulation().completed(c"kernel"),
            first,
            "the second set-up ran kernels"
        );
        // Another rank's bucket is checked again.
        check_bucket_once(
            kernels,
            Collective::GradReduceScatter,
            &config,
            &topology,
            2,
        )
        .expect("rank 2");
        assert!(emulation().completed(c"kernel") > first);
    }) else {
        return;
    };
    assert_child_passed(&output);
}

/// With `SDP4BIT_CUDA_KERNEL_CHECK=0`, `check_bucket_once` runs no kernel, so even a faulty
/// kernel passes it, while `check_bucket` itself still catches the fault.
#[test]
fn kernel_check_can_be_turned_off() {
    let Some(output) = run_isolated(
        "kernel_check::kernel_check_can_be_turned_off",
        &[(KERNEL_CHECK_VAR, Some("0"))],
        || {
            emulation();
            let kernels = Kernels::get(0).expect("the kernels load");
            let topology = Topology::uniform(2, 2).expect("2x2");
            let config: Config = cfg(Preset::Sdp4bit, &[]);
            emulation().corrupt_kernel_output(Some(c"grad_reduce_final"), 3, 0x01);
            let before = emulation().completed(c"kernel");
            check_bucket_once(
                kernels,
                Collective::GradReduceScatter,
                &config,
                &topology,
                0,
            )
            .expect("turned off");
            assert_eq!(emulation().completed(c"kernel"), before, "kernels ran");
            let e = check_bucket(
                kernels,
                Collective::GradReduceScatter,
                &config,
                &topology,
                0,
            )
            .expect_err("check_bucket itself still checks");
            assert!(e.to_string().contains("grad_reduce_final"), "{e}");
            emulation().corrupt_kernel_output(None, 0, 0);
        },
    ) else {
        return;
    };
    assert_child_passed(&output);
}
