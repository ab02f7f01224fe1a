//! The kernel model's machinery (`bench/kernels.rs`, docs/kernel-model.md): its cache entries
//! made by concurrent threads, the readers of gcov's JSON, of C++ loops and of SASS listings, the case-file writer, the mapping of line
//! counts onto instructions, the round trips and the timing model on hand-made inputs; and
//! the whole count of a tiny synthetic kernel with a loop of known trip count, compiled with
//! NVRTC and run on the coverage emulator.
//!
//! The same count of a synthetic kernel whose compiler deletes half of its unrolled copies, on
//! the current emulator harness (case format SDPEMU03, blocks of 128 threads, the kernel
//! registered as the host builds of specialised kernels register theirs): the structural
//! count of a specialised build is exact there, the line mapping counts half.
//!
//! The last two tests need NVRTC, ptxas and nvdisasm, g++ and gcov, and git history (the
//! emulator's harness of c4b4d29); without the CUDA tools they print why and pass unless
//! `SDP4BIT_REQUIRE_NVRTC=1` or `SDP4BIT_REQUIRE_PTXAS=1` (set by `scripts/test.sh`).

use std::collections::HashMap;
use std::path::Path;

use sdp4bit::backend::cuda::probe;
use sdp4bit_test_support::cache_entry::{make_entry, private_dir};
use sdp4bit_test_support::commit_sources::commit_sources;
use sdp4bit_test_support::dynamic_count::{LoopIndex, split_per_warp_and_unit, warp_executions};
use sdp4bit_test_support::emulator_case::{CaseFormat, CaseLaunch, EmulatorCase, WarpOrder};
use sdp4bit_test_support::gcov::Coverage;
use sdp4bit_test_support::host_coverage::{CoverageEmulator, EmulatorSources};
use sdp4bit_test_support::json::Json;
use sdp4bit_test_support::kernel_count::{KernelUnit, compile, count};
use sdp4bit_test_support::kernel_resources::CudaTools;
use sdp4bit_test_support::round_trips::waits;
use sdp4bit_test_support::sass::Listing;
use sdp4bit_test_support::source_loops::{block_end, source_loops};
use sdp4bit_test_support::specialised_count::{Place, cold_index, structural};
use sdp4bit_test_support::timing_model::{
    Bound, Call, Constants, Gpu, Search, fit, leave_one_out, predict,
};

/// Threads that make the same cache entry at once (as the model's rows do) each fill a
/// directory of their own: every maker sees only its own files, the entry holds one maker's
/// files whole, and no staging directory stays (a name made of the process id, as the
/// directories were named before, fails it).
#[test]
fn concurrent_makers_of_a_cache_entry_never_share_a_directory() {
    let parent = private_dir(&std::env::temp_dir(), "sdp4bit-cache-entry-").expect("a directory");
    let entry = parent.path().join("entry");
    let barrier = std::sync::Barrier::new(8);
    std::thread::scope(|s| {
        for maker in 0..8u8 {
            let (entry, barrier) = (&entry, &barrier);
            s.spawn(move || {
                barrier.wait();
                make_entry(entry, |staging| {
                    std::fs::write(staging.join("first"), [maker; 4096])
                        .map_err(|e| e.to_string())?;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    std::fs::write(staging.join("second"), [maker]).map_err(|e| e.to_string())?;
                    let names = std::fs::read_dir(staging)
                        .map_err(|e| e.to_string())?
                        .count();
                    let first = std::fs::read(staging.join("first")).map_err(|e| e.to_string())?;
                    let own = first.iter().filter(|&&b| b == maker).count();
                    assert_eq!(
                        (names, own),
                        (2, 4096),
                        "maker {maker}: a shared staging directory"
                    );
                    Ok(())
                })
                .expect("the entry is made");
            });
        }
    });
    let second = std::fs::read(entry.join("second")).expect("a whole entry");
    let first = std::fs::read(entry.join("first")).expect("a whole entry");
    assert_eq!(first, vec![second[0]; 4096], "one maker's files");
    let left: Vec<_> = std::fs::read_dir(parent.path())
        .expect("read")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, ["entry"], "staging directories left behind");
}

#[test]
fn json_reads_what_gcov_writes() {
    let doc = Json::parse(r#" {"a": [1, 2.5e1, true, null], "b": {"c": "x\"\u0041\n"}} "#)
        .expect("valid JSON");
    let items = doc.get("a").expect("a").items();
    assert_eq!(items[0].as_u64(), Some(1));
    assert_eq!(items[1].as_u64(), Some(25));
    assert_eq!(items[2], Json::Bool(true));
    assert_eq!(items[3], Json::Null);
    let c = doc.get("b").and_then(|b| b.get("c")).and_then(Json::as_str);
    assert_eq!(c, Some("x\"A\n"));
    for bad in ["{", "[1,]", "{\"a\" 1}", "1 2", "\"open"] {
        assert!(Json::parse(bad).is_err(), "{bad}");
    }
}

/// A gcov report of `f` (lines 1-4, called 8 times) and a lambda on line 6 that gcc reports
/// as one line, in `k.cu`.
const GCOV: &str = r#"{"files": [{"file": "/x/k.cu", "functions": [
  {"start_line": 1, "end_line": 4, "start_column": 1, "execution_count": 8},
  {"start_line": 6, "end_line": 6, "start_column": 15, "execution_count": 3}],
 "lines": [{"line_number": 2, "count": 8}, {"line_number": 3, "count": 24},
           {"line_number": 7, "count": 3}]}]}
{"files": [{"file": "/y/k.cu", "functions": [
  {"start_line": 1, "end_line": 4, "start_column": 1, "execution_count": 2}],
 "lines": [{"line_number": 3, "count": 6}]}]}"#;

#[test]
fn coverage_sums_units_and_finds_functions() {
    let source = "void f() {\n  a;\n  b;\n}\nvoid g() {\n  auto l = [&]() {\n    c;\n  };\n}\n";
    let coverage = Coverage::from_json(GCOV)
        .expect("gcov JSON")
        .with_lambda_spans(&HashMap::from([("k.cu".to_owned(), source.to_owned())]));
    assert!(coverage.has_file("k.cu") && !coverage.has_file("other.cu"));
    assert_eq!(coverage.line("k.cu", 3), Some(30), "summed over reports");
    assert_eq!(coverage.function_at("k.cu", 3).map(|f| f.calls), Some(10));
    // The lambda's span runs to its closing brace, and its lines are its own.
    let lambda = coverage.function_at("k.cu", 7).expect("the lambda");
    assert_eq!((lambda.start, lambda.end, lambda.calls), (6, 8, 3));
    // A line without a count of its own takes the nearest counted line of its function.
    assert_eq!(coverage.count_near("k.cu", 4), Some(30));
    assert_eq!(coverage.count_near("k.cu", 12), None);
}

#[test]
fn loops_are_found_with_their_breaks() {
    let source = "void f() {\n\
                  for (int i = 0; i < n; ++i) { // for (\n\
                    while (x) {\n\
                      if (y) { break; }\n\
                    }\n\
                    if (z) {\n\
                      break;\n\
                    }\n\
                  }\n\
                  s = \"for (;;) {\";\n\
                }\n";
    let loops = source_loops(source).expect("braced loops");
    assert_eq!(loops.len(), 2);
    assert_eq!(
        (loops[0].header, loops[0].last, loops[0].breaks.clone()),
        (2, 9, vec![7])
    );
    assert_eq!(
        (loops[1].header, loops[1].last, loops[1].breaks.clone()),
        (3, 5, vec![4])
    );
    assert!(loops[0].holds(9) && !loops[0].holds(10));
    assert!(
        source_loops("for (;;) x();").is_err(),
        "a loop without braces is refused"
    );
    assert_eq!(block_end(source, 1, 1), Some(11));
}

/// A listing in the shape of `nvdisasm -c -gi`: a kept loop at line 5 around line 6, an
/// unrolled loop's two copies of line 9, a convergence region whose divergent path a warp
/// whose lanes agree never takes, and an out-of-line function.
const LISTING: &str = r#"
	.section	.text.k,"ax",@progbits
.text.k:
	//## File "/s/k.cu", line 4
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
	//## File "/s/k.cu", line 6
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   FADD R3, R2, R3 ;
	//## File "/s/k.cu", line 5
        /*0030*/                   ISETP.NE.AND P0, PT, R2, RZ, PT ;
        /*0040*/               @P0 BRA `(.L_x_0) ;
	//## File "/s/k.cu", line 9
        /*0050*/                   FMUL R3, R3, 2 ;
        /*0060*/                   FMUL R3, R3, 2 ;
        /*0070*/                   BRA.DIV UR4, `(.L_x_1) ;
        /*0080*/                   SHFL.BFLY PT, R3, R3, 0x1, 0x1f ;
.L_x_2:
        /*0090*/                   CALL.REL.NOINC `($k$g) ;
        /*00a0*/                   EXIT ;
.L_x_1:
        /*00b0*/                   WARPSYNC.COLLECTIVE R5, `(.L_x_2) ;
        /*00c0*/                   BRA `(.L_x_2) ;
$k$g:
	//## File "/s/k.cu", line 12
        /*00d0*/                   RET.REL.NODEC R6 `(k) ;
.text.other:
        /*0000*/                   EXIT ;
"#;

/// The source of [`LISTING`]: `k` with a kept loop (5-7) and an unrolled one (8-10), and
/// `g`, out of line.
const SOURCE: &str = "\n\n\nvoid k() {\n  for (int t = 0; t < n; ++t) {\n    x += in[t];\n  }\n  for (int i = 0; i < 2; ++i) {\n    x *= 2;\n  }\n  g(); }\nvoid g() {}\n";

/// Counts for [`SOURCE`]: `k` called 32 times (one warp), the kept loop entered once per call
/// and 5 trips, the unrolled one 2 trips; `g` called 32 times.
const SOURCE_GCOV: &str = r#"{"files": [{"file": "k.cu", "functions": [
  {"start_line": 4, "end_line": 11, "start_column": 1, "execution_count": 32},
  {"start_line": 12, "end_line": 12, "start_column": 1, "execution_count": 32}],
 "lines": [{"line_number": 4, "count": 32}, {"line_number": 5, "count": 192},
           {"line_number": 6, "count": 160}, {"line_number": 8, "count": 96},
           {"line_number": 9, "count": 64}, {"line_number": 11, "count": 32},
           {"line_number": 12, "count": 32}]}]}"#;

#[test]
fn listings_give_frames_flow_and_blocks() {
    let listing = Listing::of_entry(LISTING, "k").expect("the entry");
    let ins = &listing.instructions;
    assert_eq!(ins.len(), 14);
    assert_eq!(ins[1].opcode, "LDG.E");
    assert_eq!(ins[1].frames[0].file, "k.cu");
    assert_eq!(ins[4].guard.as_deref(), Some("@P0"));
    assert_eq!(ins[13].frames[0].line, 12, "a subroutine's own frames");
    let reachable = listing.reachable().expect("flow");
    assert!(reachable[..11].iter().all(|r| *r), "{reachable:?}");
    assert!(!reachable[11] && !reachable[12], "the divergent path");
    assert!(reachable[13], "the called function");
    assert_eq!(listing.back_edges(&reachable).expect("flow"), vec![(4, 1)]);
    let blocks = listing.blocks();
    assert_eq!(blocks[0], 0..1);
    assert_eq!(blocks[1], 1..5, "the loop's block");
    assert!(Listing::of_entry(LISTING, "missing").is_err());
}

#[test]
fn line_counts_map_onto_kept_and_unrolled_loops() {
    let listing = Listing::of_entry(LISTING, "k").expect("the entry");
    let coverage = Coverage::from_json(SOURCE_GCOV).expect("gcov JSON");
    let loops: LoopIndex =
        HashMap::from([("k.cu".to_owned(), source_loops(SOURCE).expect("loops"))]);
    let runs = warp_executions(&listing, &coverage, &loops).expect("mapping");
    let n = &runs.issued;
    assert_eq!(n[0], 1.0, "once per warp");
    // The kept loop: its body and its condition inside it run 5 times.
    assert_eq!(&n[1..5], &[5.0; 4]);
    // Two copies of the unrolled loop's line, each run once: 2 trips over 2 copies.
    assert_eq!(&n[5..7], &[1.0, 1.0]);
    // Never taken: the divergent path; the subroutine runs once per call.
    assert_eq!(&n[11..13], &[0.0, 0.0]);
    assert_eq!(n[13], 1.0);
    assert_eq!(runs.unattributed.without_frames, 0);
}

#[test]
fn executions_split_into_per_warp_and_per_unit() {
    // 3 per warp and 7 per unit: 8 warps over 64 units, and 64 warps over them.
    let a = [3.0 * 8.0 + 7.0 * 64.0];
    let b = [3.0 * 64.0 + 7.0 * 64.0];
    let (per_warp, per_unit) = split_per_warp_and_unit([&a, &b], [8.0, 64.0], 64.0).expect("split");
    assert!((per_warp[0] - 3.0).abs() < 1e-12 && (per_unit[0] - 7.0).abs() < 1e-12);
    assert!(split_per_warp_and_unit([&a, &b], [8.0, 8.0], 64.0).is_err());
}

#[test]
fn waits_end_where_a_load_is_used() {
    let listing = Listing::of_entry(
        ".text.k:\n\
         /*0000*/ LDG.E.128 R4, desc[UR4][R2.64] ;\n\
         /*0010*/ LDG.E R8, desc[UR4][R2.64+0x10] ;\n\
         /*0020*/ FADD R9, R7, R1 ;\n\
         /*0030*/ FADD R10, R8, R1 ;\n\
         /*0040*/ @P0 LDG.E R11, desc[UR4][R2.64] ;\n\
         /*0050*/ FADD R12, R11, R1 ;\n\
         /*0060*/ LDG.E R13, desc[UR4][R2.64] ;\n\
         /*0070*/ STG.E desc[UR4][R2.64], R13 ;\n",
        "k",
    )
    .expect("listing");
    let per_unit = [1.0; 8];
    // The first use of the 128-bit load's last register waits for both loads; the guarded
    // load never runs by its line; a store of a loaded register waits too.
    let by_line = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0];
    let found: Vec<usize> = waits(&listing, &per_unit, &by_line)
        .iter()
        .map(|w| w.index)
        .collect();
    assert_eq!(found, vec![2, 7]);
}

#[test]
fn case_files_follow_the_emulator_format() {
    let mut case = EmulatorCase::default();
    let input = case.input(vec![1, 2]);
    let output = case.output(vec![0; 3]);
    case.launches.push(CaseLaunch {
        kernel: "k".into(),
        grid: 2,
        threads: 256,
        order: WarpOrder::Shuffled(9),
        pointers: vec![Some(input), None, Some(output)],
        params: vec![7; 4],
        addresses: vec![(0, output)],
    });
    let mut want = b"SDPEMU02".to_vec();
    want.extend(2u32.to_le_bytes());
    want.extend([0u8]);
    want.extend(2u64.to_le_bytes());
    want.extend([1, 2, 1]);
    want.extend(3u64.to_le_bytes());
    want.extend([0, 0, 0]);
    want.extend(1u32.to_le_bytes());
    want.extend(1u32.to_le_bytes());
    want.extend(b"k");
    for v in [2u32, 2] {
        want.extend(v.to_le_bytes());
    }
    want.extend(9u64.to_le_bytes());
    for v in [3u32, 0, u32::MAX, 1, 4] {
        want.extend(v.to_le_bytes());
    }
    want.extend([7; 4]);
    for v in [1u32, 0, 1] {
        want.extend(v.to_le_bytes());
    }
    assert_eq!(case.encode(), Ok(want.clone()));
    // The current emulator's format: the threads per block after the grid.
    case.format = CaseFormat::V3;
    // The grid ends after the magic (8), the buffers (4 + 11 + 12), the launch count (4), the
    // name (4 + 1) and the grid (4).
    let grid_end = 48;
    let mut v3 = b"SDPEMU03".to_vec();
    v3.extend(&want[8..grid_end]);
    v3.extend(256u32.to_le_bytes());
    v3.extend(&want[grid_end..]);
    assert_eq!(case.encode(), Ok(v3));
    case.launches[0].threads = 128;
    assert!(case.encode().is_ok());
    case.format = CaseFormat::V2;
    assert!(
        case.encode().is_err(),
        "SDPEMU02 launches blocks of 256 only"
    );
    assert_eq!(
        case.outputs(&[5, 6, 7]).expect("three bytes"),
        vec![&[5u8, 6, 7][..]]
    );
    assert!(case.outputs(&[5, 6]).is_err());
}

/// A GPU of round numbers: 10 multiprocessors at 1 GHz issuing 4 per clock, copies at 1 TB/s.
const GPU: Gpu = Gpu {
    multiprocessors: 10.0,
    clock_hz: 1e9,
    issue_per_clock: 4.0,
    copy_bytes_per_s: 1e12,
};

fn call(bytes: f64, units: f64, unit_instructions: f64, round_trips: f64) -> Call {
    Call {
        bytes,
        instructions: units * unit_instructions,
        units,
        unit_instructions,
        unit_round_trips: round_trips,
        resident_warps: 20.0,
        launched_warps: 1e6,
    }
}

#[test]
fn the_three_bounds_on_hand_computed_inputs() {
    let k = Constants {
        latency_s: 500e-9,
        cycles_per_instruction: 4.0,
        issue_efficiency: 1.0,
    };
    // 1e9 bytes: 1 ms of memory. 1e5 units of 400 instructions: 4e7 / 4e10 per s = 1 ms of
    // issue. Serial: 1e5 x (2 x 0.5 us + 400 x 4 ns) / (10 x 20) = 1.3 ms.
    let p = predict(&GPU, &call(1e9, 1e5, 400.0, 2.0), &k);
    assert!((p.memory_s - 1e-3).abs() < 1e-12);
    assert!((p.issue_s - 1e-3).abs() < 1e-12);
    assert!((p.serial_s - 1.3e-3).abs() < 1e-12);
    assert_eq!((p.seconds(), p.bound()), (p.serial_s, Bound::Serial));
    // The serial bound moves the prediction: no round trips and a short unit leave the
    // memory bound.
    let memory = predict(&GPU, &call(1e9, 1e5, 100.0, 0.0), &k);
    assert_eq!(memory.bound(), Bound::Memory);
    assert!((memory.seconds() - 1e-3).abs() < 1e-12);
    let slower = Constants {
        latency_s: 5e-6,
        ..k
    };
    let serial = predict(&GPU, &call(1e9, 1e5, 100.0, 1.0), &slower);
    assert_eq!(serial.bound(), Bound::Serial);
    assert!((serial.seconds() - 1e5 * (5e-6 + 400e-9) / 200.0).abs() < 1e-12);
    // Fewer launched warps than fit leave the multiprocessors underused.
    let few = Call {
        launched_warps: 50.0,
        ..call(0.0, 1e3, 100.0, 1.0)
    };
    let p = predict(&GPU, &few, &k);
    assert!((p.serial_s - 1e3 * (500e-9 + 400e-9) / (10.0 * 5.0)).abs() < 1e-12);
}

#[test]
fn the_fit_recovers_known_constants_and_leaves_rows_out() {
    let truth = Constants {
        latency_s: 600e-9,
        cycles_per_instruction: 6.0,
        issue_efficiency: 1.0,
    };
    // Rows that the serial bound sets, in different mixes of round trips and instructions.
    let rows: Vec<(Call, f64)> = [(1.0, 2000.0), (8.0, 500.0), (20.0, 3000.0), (3.0, 800.0)]
        .iter()
        .map(|&(trips, n)| {
            let c = call(1e6, 1e5, n, trips);
            (c, predict(&GPU, &c, &truth).seconds())
        })
        .collect();
    let search = Search {
        latency_s: (100e-9, 1000e-9, 50e-9),
        cycles_per_instruction: (1.0, 10.0, 0.5),
        issue_efficiency: 1.0,
    };
    let k = fit(&GPU, &rows, &search);
    assert!((k.latency_s - 600e-9).abs() < 1e-12 && (k.cycles_per_instruction - 6.0).abs() < 1e-12);
    let held = leave_one_out(&GPU, &rows, &search);
    for ((_, measured), predicted) in rows.iter().zip(&held) {
        assert!((predicted / measured - 1.0).abs() < 1e-9);
    }
}

/// The synthetic kernel of [`tiny_kernel_count_follows_its_trip_count`]: per unit (a warp's
/// step) a kept loop of `trips + 1` trips (never none, so that the compiler does not version
/// the unit's loop on a zero trip count) and an unrolled loop of 4.
const TINY_CU: &str = r#"#include "sdp4bit_abi.h"

extern "C" __global__ void __launch_bounds__(256, 8)
tiny(const float* __restrict__ in, float* __restrict__ out, struct tiny_params p)
{
    const uint32_t lane = threadIdx.x % 32;
    const uint64_t warps = (uint64_t)gridDim.x * blockDim.x / 32;
    for (uint64_t u = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; u < p.units; u += warps) {
        float acc = 0.0f;
#pragma unroll 1
        for (uint32_t t = 0; t <= p.trips; ++t) {
            acc = __fadd_rn(__fmul_rn(acc, 0.5f), in[u * 32 + lane]);
        }
#pragma unroll
        for (uint32_t k = 0; k < 4; ++k) {
            acc = __fmul_rn(acc, 1.5f);
        }
        out[u * 32 + lane] = acc;
    }
}
"#;

/// The launch ABI and kernel table of the synthetic kernel, in the shape of `kernels/`.
const TINY_ABI: &str = r#"#pragma once
#ifdef __CUDACC_RTC__
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif
struct tiny_params {
    uint64_t units;
    uint32_t trips;
    uint32_t reserved;
};
#define SDP_KERNEL(name, params, widest_load, widest_store, ...) \
    extern "C" __global__ void name(__VA_ARGS__, struct params args);
#include "sdp4bit_kernels.h"
#undef SDP_KERNEL
"#;

const TINY_TABLE: &str = "SDP_KERNEL(tiny, tiny_params, 32, 32, const float* in, float* out)\n";

/// The commit whose emulator harness the counts run on (as the kernel model's).
const HARNESS_COMMIT: &str = "c4b4d29";

/// Whether NVRTC and the CUDA tools are usable; `None` (after printing why) to skip.
fn cuda_tools(test: &str) -> Option<CudaTools> {
    let tools = probe::nvrtc()
        .map_err(|e| e.to_string())
        .and_then(|()| CudaTools::from_env());
    match tools {
        Ok(tools) => Some(tools),
        Err(e) => {
            let required = ["SDP4BIT_REQUIRE_NVRTC", "SDP4BIT_REQUIRE_PTXAS"]
                .iter()
                .any(|v| std::env::var(v).is_ok_and(|x| x == "1"));
            assert!(!required, "{test}: the CUDA tools are required but {e}");
            println!("skipped {test}: {e}");
            None
        }
    }
}

#[test]
fn tiny_kernel_count_follows_its_trip_count() {
    let Some(tools) = cuda_tools("tiny_kernel_count_follows_its_trip_count") else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work =
        std::env::temp_dir().join(format!("sdp4bit-kernel-model-tiny-{}", std::process::id()));
    let kernels = work.join("kernels");
    std::fs::create_dir_all(&kernels).expect("work directory");
    for (name, text) in [
        ("tiny.cu", TINY_CU),
        ("sdp4bit_abi.h", TINY_ABI),
        ("sdp4bit_kernels.h", TINY_TABLE),
    ] {
        std::fs::write(kernels.join(name), text).expect("write a source");
    }
    let cache = root.join(".cache/kernel-model");
    std::fs::create_dir_all(&cache).expect("cache directory");
    let harness = commit_sources(root, HARNESS_COMMIT, &["tests/kernel_emulator"], &cache)
        .expect("the emulator of the H100's commit")
        .join("tests/kernel_emulator");
    let emulator = CoverageEmulator::build(
        &EmulatorSources {
            harness,
            kernels: kernels.clone(),
            units: vec![kernels.join("tiny.cu")],
        },
        &work,
    )
    .expect("coverage emulator");
    let unit = compile(
        &tools,
        &KernelUnit {
            dir: kernels.clone(),
            name: "tiny.cu".into(),
            text: TINY_CU.into(),
        },
        &work,
        &work,
    )
    .expect("NVRTC");
    let entry = unit.entry("tiny").expect("the entry point");
    let units = 64u64;
    let counted = |trips: u32| {
        let mut case = EmulatorCase::default();
        let input = case.input(vec![0u8; (units * 32 * 4) as usize]);
        let output = case.output(vec![0u8; (units * 32 * 4) as usize]);
        let mut params = units.to_le_bytes().to_vec();
        params.extend(trips.to_le_bytes());
        params.extend(0u32.to_le_bytes());
        case.launches.push(CaseLaunch {
            kernel: "tiny".into(),
            grid: 1,
            threads: 256,
            order: WarpOrder::Forward,
            pointers: vec![Some(input), Some(output)],
            params,
            addresses: Vec::new(),
        });
        count(&unit, &entry, &emulator, &case, units, &work).expect("count")
    };
    let (short, long) = (counted(5), counted(9));
    // The kept loop's body: the instructions of its backward branch's loop.
    let reachable = entry.listing.reachable().expect("flow");
    let edges = entry.listing.back_edges(&reachable).expect("flow");
    let (branch, target) = *edges
        .iter()
        .max_by_key(|(_, target)| *target)
        .expect("the trip loop kept");
    let body = (branch - target + 1) as f64;
    let grew = long.unit_instructions() - short.unit_instructions();
    assert!(
        (grew - 4.0 * body).abs() < 0.5,
        "4 more trips add {grew} instructions per unit, the loop has {body}"
    );
    // Counted by its structure (as a specialised build is), the kept loop's blocks run its
    // trips per unit, which its backward branch's count gives: the same growth.
    let cold = cold_index(&unit.sources);
    let by_structure = |c| structural(&entry.listing, c, &cold).expect("structure");
    let (short_s, long_s) = (by_structure(&short), by_structure(&long));
    let grew_s = long_s.count.unit_instructions() - short_s.count.unit_instructions();
    assert!(
        (grew_s - grew).abs() < 0.5,
        "by structure {grew_s}, by line {grew}"
    );
    assert!(
        short_s
            .blocks
            .iter()
            .any(|b| b.place == Place::InnerLoop && (b.passes - 6.0).abs() < 1e-6),
        "the trip loop's blocks run 6 passes per unit"
    );
    // Outside the trip loop the count is the same, and the code around the grid-stride loop
    // is per warp.
    assert!((short.warp_instructions() - long.warp_instructions()).abs() < 1e-9);
    assert!(short.warp_instructions() > 0.0);
    let _ = std::fs::remove_dir_all(&work);
}

/// The synthetic kernel of [`specialised_count_is_exact_where_copies_are_deleted`]: per unit
/// an unrolled loop of 16 copies whose body only the even copies keep (a guard that is a
/// constant in each copy, as a Hadamard stage's is), three dependent operations each.
const COPIES_CU: &str = r#"#include "sdp4bit_abi.h"

extern "C" __global__ void __launch_bounds__(128, 8)
copies(const float* __restrict__ in, float* __restrict__ out, struct tiny_params p)
{
    const uint32_t lane = threadIdx.x % 32;
    const uint64_t warps = (uint64_t)gridDim.x * blockDim.x / 32;
    for (uint64_t u = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; u < p.units; u += warps) {
        float acc = in[u * 32 + lane];
#pragma unroll
        for (uint32_t k = 0; k < 16; ++k) {
            if (k % 2 == 0) {
                acc = __fmul_rn(acc, 1.5f);
                acc = __fadd_rn(acc, 0.25f);
                acc = __fmul_rn(acc, 0.75f);
            }
        }
        out[u * 32 + lane] = acc;
    }
}
"#;

/// The host translation unit of `copies` for the current emulator: the kernel registered as
/// `sdp4bit_test_support::host_kernels` registers a specialised entry point.
const COPIES_HOST: &str = "#include \"host_kernels.h\"\n#include \"copies.cu\"\n\
                           SDP_HOST_KERNELS(SDP_HOST_KERNEL(copies, tiny_params))\n";

#[test]
fn specialised_count_is_exact_where_copies_are_deleted() {
    let Some(tools) = cuda_tools("specialised_count_is_exact_where_copies_are_deleted") else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = std::env::temp_dir().join(format!(
        "sdp4bit-kernel-model-copies-{}",
        std::process::id()
    ));
    let kernels = work.join("kernels");
    std::fs::create_dir_all(&kernels).expect("work directory");
    for (name, text) in [
        ("copies.cu", COPIES_CU),
        ("sdp4bit_abi.h", TINY_ABI),
        ("sdp4bit_kernels.h", TINY_TABLE),
        ("host-copies.cpp", COPIES_HOST),
    ] {
        std::fs::write(kernels.join(name), text).expect("write a source");
    }
    let emulator = CoverageEmulator::build(
        &EmulatorSources {
            harness: root.join("tests/kernel_emulator"),
            kernels: kernels.clone(),
            units: vec![kernels.join("host-copies.cpp")],
        },
        &work,
    )
    .expect("coverage emulator of the current harness");
    let unit = compile(
        &tools,
        &KernelUnit {
            dir: kernels.clone(),
            name: "copies.cu".into(),
            text: COPIES_CU.into(),
        },
        &work,
        &work,
    )
    .expect("NVRTC");
    let entry = unit.entry("copies").expect("the entry point");
    let units = 64u64;
    let input: Vec<f32> = (0..units * 32).map(|i| i as f32 * 0.01 - 3.0).collect();
    let mut case = EmulatorCase::default();
    case.format = CaseFormat::V3;
    let in_buffer = case.input(input.iter().flat_map(|x| x.to_le_bytes()).collect());
    let out_buffer = case.output(vec![0u8; input.len() * 4]);
    let mut params = units.to_le_bytes().to_vec();
    params.extend([0u8; 8]);
    case.launches.push(CaseLaunch {
        kernel: "copies".into(),
        grid: 1,
        threads: 128,
        order: WarpOrder::Forward,
        pointers: vec![Some(in_buffer), Some(out_buffer)],
        params,
        addresses: Vec::new(),
    });
    let mapped = count(&unit, &entry, &emulator, &case, units, &work).expect("count");
    // The kernel's arithmetic, IEEE single precision rounded to nearest at every step.
    let expected: Vec<u8> = input
        .iter()
        .flat_map(|&x| {
            let mut acc = x;
            for _ in 0..8 {
                acc = ((acc * 1.5) + 0.25) * 0.75;
            }
            acc.to_le_bytes()
        })
        .collect();
    assert_eq!(
        case.outputs(&mapped.output).expect("one output"),
        vec![&expected[..]]
    );
    let by_structure =
        structural(&entry.listing, &mapped, &cold_index(&unit.sources)).expect("structure");
    // The even copies' operations: 8 copies of 3, once per unit each.
    let arithmetic = |per_unit: &[f64]| -> (usize, f64) {
        entry
            .listing
            .instructions
            .iter()
            .zip(per_unit)
            .filter(|(i, _)| matches!(i.base(), "FMUL" | "FADD"))
            .fold((0, 0.0), |(n, sum), (_, &x)| (n + 1, sum + x))
    };
    let (kept, structural_runs) = arithmetic(&by_structure.count.per_unit);
    let (_, mapped_runs) = arithmetic(&mapped.per_unit);
    assert_eq!(kept, 24, "the compiler keeps the 8 even copies");
    assert!(
        (structural_runs - 24.0).abs() < 1e-6,
        "by structure {structural_runs} per unit"
    );
    assert!(
        mapped_runs < 0.75 * 24.0,
        "the line mapping gives the 8 copies left the share of 16: {mapped_runs}"
    );
    // Straight-line: the unit's loop by structure is its static count.
    let (hot, _) = by_structure.hot_loop();
    assert_eq!(by_structure.static_unit(), Some(hot));
    assert!(mapped.unit_instructions() < hot);
    let _ = std::fs::remove_dir_all(&work);
}
