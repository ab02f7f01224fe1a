//! Compiles every kernel source for sm_90 through the backend's own NVRTC path: no warnings,
//! and every kernel the backend launches is an entry point of the PTX; and for sm_75 and
//! sm_120, the oldest and newest targets of NVRTC 13.0. Then assembles the sm_90 PTX
//! with `ptxas` for sm_90 and checks each kernel's resources: no spills or stack, registers
//! within the bound its `__launch_bounds__` sets, and the widths of its streaming loads and
//! stores in the SASS (`nvdisasm`).
//!
//! Needs the NVRTC library and, for the resource checks, ptxas and nvdisasm (no GPU). Without
//! them the tests print why and pass, unless `SDP4BIT_REQUIRE_NVRTC=1` or
//! `SDP4BIT_REQUIRE_PTXAS=1` (both set by `scripts/test.sh` and CI), which turn the skip into a
//! failure naming what is missing.

use std::collections::BTreeSet;

use sdp4bit::Error;
use sdp4bit::backend::cuda::compile::{Arch, compile};
use sdp4bit::backend::cuda::probe;
use sdp4bit::backend::cuda::source::{HEADERS, Kernel, KernelSource, SOURCES};
use sdp4bit_test_support::kernel_resources::{
    CudaTools, KernelResources, Usage, count_sass, parse_ptxas_report,
};

/// Whether NVRTC is usable; `false` (after printing why) when the test should skip.
fn nvrtc_available(test: &str) -> bool {
    match probe::nvrtc() {
        Ok(()) => true,
        Err(e) => {
            let required = std::env::var("SDP4BIT_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
            assert!(!required, "{test}: SDP4BIT_REQUIRE_NVRTC=1 but {e}");
            println!("skipped {test}: {e}");
            false
        }
    }
}

/// The `.cu` files of `kernels/` and the headers, as found on disk.
fn files_on_disk(extension: &str) -> BTreeSet<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels");
    std::fs::read_dir(dir)
        .expect("kernels/ directory")
        .map(|entry| entry.expect("directory entry").file_name())
        .map(|name| name.to_string_lossy().into_owned())
        .filter(|name| name.ends_with(extension))
        .collect()
}

/// The embedded sources are exactly the files of `kernels/` (build.rs lists them; a file left
/// out would be neither compiled nor tested).
#[test]
fn every_kernel_file_is_embedded() {
    let embedded: BTreeSet<String> = SOURCES.iter().map(|s| s.file.to_owned()).collect();
    assert_eq!(embedded, files_on_disk(".cu"));
    for header in files_on_disk(".h").into_iter().chain(files_on_disk(".cuh")) {
        assert!(
            HEADERS.iter().any(|(name, _)| *name == header),
            "kernels/{header} is not handed to NVRTC"
        );
    }
}

/// Every source compiles for sm_90 with an empty log, and its PTX defines every kernel the
/// backend looks up in it.
#[test]
fn every_kernel_compiles_without_warnings() {
    if !nvrtc_available("every_kernel_compiles_without_warnings") {
        return;
    }
    for source in &SOURCES {
        let compiled =
            compile(source, Arch::SM_90).unwrap_or_else(|e| panic!("kernels/{}: {e}", source.file));
        assert!(
            compiled.log.trim().is_empty(),
            "kernels/{} compiled with warnings:\n{}",
            source.file,
            compiled.log
        );
        assert!(
            compiled.ptx.contains(".target sm_90"),
            "kernels/{}: PTX not for sm_90",
            source.file
        );
        for kernel in source.kernels {
            let entry = format!(".entry {}(", kernel.name());
            assert!(
                compiled.ptx.contains(&entry),
                "kernels/{}: no `{entry}` in the PTX",
                source.file
            );
        }
    }
}

/// Every source also compiles for the oldest and the newest architecture NVRTC 13.0 targets
/// (sm_75 and sm_120, docs/cuda.md), which the backend compiles for on such devices: code for
/// sm_80 and newer only (the warp reduction `redux.sync`) has its fallback. ptxas may warn
/// there (launch bounds past sm_75's threads per multiprocessor are ignored).
#[test]
fn every_kernel_compiles_for_the_oldest_and_newest_targets() {
    if !nvrtc_available("every_kernel_compiles_for_the_oldest_and_newest_targets") {
        return;
    }
    const OLDEST: Arch = Arch { major: 7, minor: 5 };
    const NEWEST: Arch = Arch {
        major: 12,
        minor: 0,
    };
    for arch in [OLDEST, NEWEST] {
        for source in &SOURCES {
            let compiled = compile(source, arch)
                .unwrap_or_else(|e| panic!("kernels/{} for {arch}: {e}", source.file));
            assert!(
                compiled.ptx.contains(&format!(".target {arch}")),
                "kernels/{}: PTX not for {arch}",
                source.file
            );
        }
    }
}

/// A source that does not compile is an error value carrying NVRTC's log.
#[test]
fn compile_error_is_a_value_with_the_log() {
    if !nvrtc_available("compile_error_is_a_value_with_the_log") {
        return;
    }
    let broken = KernelSource {
        file: "broken.cu",
        code: "#include \"common.cuh\"\nextern \"C\" __global__ void k() { undeclared_name; }\n",
        kernels: &[],
    };
    match compile(&broken, Arch::SM_90) {
        Err(Error::Cuda(message)) => {
            assert!(message.contains("broken.cu"), "{message}");
            assert!(message.contains("undeclared_name"), "{message}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

/// A warning does not fail the compilation but comes back in the log (so the test above can
/// treat warnings as errors).
#[test]
fn warnings_come_back_in_the_log() {
    if !nvrtc_available("warnings_come_back_in_the_log") {
        return;
    }
    let warning = KernelSource {
        file: "warning.cu",
        code: "extern \"C\" __global__ void k(int* p) { int unused_variable = 1; *p = 0; }\n",
        kernels: &[],
    };
    let compiled = compile(&warning, Arch::SM_90).expect("a warning is not an error");
    assert!(compiled.log.contains("unused_variable"), "{}", compiled.log);
}

/// The parameter list of every entry point in the PTX is what the launches pass (the kernel
/// table's pointers, which `Kernels::launch` checks its arguments against): 64-bit pointers,
/// then one 8-byte-aligned struct of exactly the Rust mirror's size (so the ABI header and
/// `abi.rs` agree with what NVRTC compiled, without a GPU).
#[test]
fn entry_parameters_match_the_abi_mirrors() {
    if !nvrtc_available("entry_parameters_match_the_abi_mirrors") {
        return;
    }
    for source in &SOURCES {
        let ptx = compile(source, Arch::SM_90)
            .unwrap_or_else(|e| panic!("kernels/{}: {e}", source.file))
            .ptx;
        for &kernel in source.kernels {
            let name = kernel.name();
            let start = ptx
                .find(&format!(".entry {name}("))
                .unwrap_or_else(|| panic!("no entry {name}"));
            let list = &ptx[start..start + ptx[start..].find(')').expect("parameter list end")];
            let params: Vec<&str> = list
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with(".param"))
                .collect();
            let (pointers, bytes) = (kernel.pointers().len(), kernel.params_size());
            let mut want: Vec<String> = (0..pointers)
                .map(|i| format!(".param .u64 {name}_param_{i},"))
                .collect();
            want.push(format!(
                ".param .align 8 .b8 {name}_param_{pointers}[{bytes}]"
            ));
            assert_eq!(params, want, "kernels/{}: {name}", source.file);
        }
    }
}

/// The most registers per thread `kernel` may use: what its
/// `__launch_bounds__(SDP_BLOCK_THREADS, B)` leaves (65536 registers per multiprocessor over
/// B blocks of 256 threads, rounded down to the allocation unit of 8), so that B blocks fit a
/// multiprocessor.
fn register_budget(kernel: Kernel) -> u32 {
    let per_thread = 65_536 / (256 * kernel.min_blocks_per_multiprocessor());
    per_thread / 8 * 8
}

/// ptxas and nvdisasm, or `None` (after printing why) when the test should skip.
fn cuda_tools(test: &str) -> Option<CudaTools> {
    match CudaTools::from_env() {
        Ok(tools) => Some(tools),
        Err(e) => {
            let required = std::env::var("SDP4BIT_REQUIRE_PTXAS").is_ok_and(|v| v == "1");
            assert!(!required, "{test}: SDP4BIT_REQUIRE_PTXAS=1 but {e}");
            println!("skipped {test}: {e}");
            None
        }
    }
}

/// Every kernel's resources, compiled and assembled in a fresh directory.
fn every_kernel_resources(tools: &CudaTools, test: &str) -> Vec<(Kernel, KernelResources)> {
    let dir = std::env::temp_dir().join(format!("sdp4bit-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("work directory");
    let mut all = Vec::new();
    for source in &SOURCES {
        let ptx = compile(source, Arch::SM_90)
            .unwrap_or_else(|e| panic!("kernels/{}: {e}", source.file))
            .ptx;
        let resources = tools
            .analyse(source.file, &ptx, &dir)
            .unwrap_or_else(|e| panic!("kernels/{}: {e}", source.file));
        for &kernel in source.kernels {
            let found = resources
                .iter()
                .find(|r| r.name == kernel.name())
                .unwrap_or_else(|| panic!("ptxas reports no {}", kernel.name()));
            all.push((kernel, found.clone()));
        }
    }
    std::fs::remove_dir_all(&dir).expect("remove the work directory");
    all
}

/// Every kernel's resources (when NVRTC and the CUDA tools are there) against what the kernel
/// table and its launch bounds plan: `problems` lists what is wrong with one kernel; the test
/// fails with all of them.
fn check_every_kernel(test: &str, problems: impl Fn(Kernel, &KernelResources) -> Vec<String>) {
    if !nvrtc_available(test) {
        return;
    }
    let Some(tools) = cuda_tools(test) else {
        return;
    };
    let mut failures = Vec::new();
    for (kernel, resources) in every_kernel_resources(&tools, test) {
        for problem in problems(kernel, &resources) {
            failures.push(format!("{}: {problem}", kernel.name()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// No kernel spills or keeps a stack frame, and each stays within its register bound, so the
/// occupancy its launch bounds promise holds without local-memory traffic.
#[test]
fn kernels_fit_their_register_bounds_without_spilling() {
    check_every_kernel(
        "kernels_fit_their_register_bounds_without_spilling",
        |kernel, resources| {
            let usage = &resources.usage;
            let mut problems = Vec::new();
            if usage.uses_local_memory() || resources.sass.local > 0 {
                problems.push(format!(
                    "{} bytes stack, {} bytes spill stores, {} bytes spill loads, {} local \
                     loads/stores in the SASS",
                    usage.stack_frame, usage.spill_stores, usage.spill_loads, resources.sass.local
                ));
            }
            let budget = register_budget(kernel);
            if usage.registers > budget {
                problems.push(format!(
                    "{} registers, the bound is {budget}",
                    usage.registers
                ));
            }
            problems
        },
    );
}

/// Each kernel moves its streaming data in accesses of the widths its line of the kernel table
/// plans (16-byte loads of fp32 and bf16 runs, whole-word code stores, no wider access).
#[test]
fn streaming_accesses_have_their_planned_widths() {
    check_every_kernel(
        "streaming_accesses_have_their_planned_widths",
        |kernel, resources| {
            let widths = (resources.sass.widest_load(), resources.sass.widest_store());
            let planned = (kernel.widest_load_bits(), kernel.widest_store_bits());
            if widths == planned {
                return Vec::new();
            }
            vec![format!(
                "widest global load {} bits and store {} bits, the table plans {} and {}",
                widths.0, widths.1, planned.0, planned.1
            )]
        },
    );
}

/// The ptxas report parser reads registers, stack and spills per entry point, and the
/// occupancy follows the per-warp register allocation.
#[test]
fn reads_a_ptxas_report() {
    let report = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'k' for 'sm_90'\n\
        ptxas info    : Function properties for k\n\
        \x20   16 bytes stack frame, 24 bytes spill stores, 40 bytes spill loads\n\
        ptxas info    : Used 48 registers, used 0 barriers, 16 bytes cumulative stack size\n";
    let kernels = parse_ptxas_report(report).expect("a readable report");
    assert_eq!(kernels.len(), 1);
    assert_eq!(kernels[0].0, "k");
    let usage = &kernels[0].1;
    assert_eq!(
        (
            usage.registers,
            usage.stack_frame,
            usage.spill_stores,
            usage.spill_loads
        ),
        (48, 16, 24, 40)
    );
    assert!(usage.uses_local_memory());
    assert_eq!(usage.occupancy(), 40.0 / 64.0);
    let full = Usage {
        registers: 32,
        ..Usage::default()
    };
    assert_eq!(full.occupancy(), 1.0);
    assert!(parse_ptxas_report("ptxas info    : 0 bytes gmem\n").is_err());
}

/// The SASS counter sees predicated instructions, shuffles and access widths, and skips NOPs.
#[test]
fn counts_sass_instructions() {
    let listing = ".text.k:\n\
        /*0000*/  LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;\n\
        /*0010*/  @!P0 SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;\n\
        /*0020*/  STG.E.U8 desc[UR4][R2.64], R5 ;\n\
        /*0030*/  STL [R1], R5 ;\n\
        /*0040*/  NOP ;\n";
    let counts = &count_sass(listing)["k"];
    assert_eq!(counts.instructions, 4);
    assert_eq!(counts.shuffles, 1);
    assert_eq!(counts.local, 1);
    assert_eq!(counts.widest_load(), 128);
    assert_eq!(counts.widest_store(), 8);
}
