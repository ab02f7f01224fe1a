//! Compiles every specialisation of the cover (`sdp4bit_test_support::spec_cover`: what the
//! presets, the ablations and the knobs produce, and every variant of a few) for sm_90 through
//! the backend's own NVRTC path: no warnings, the entry point in the PTX with the parameters the
//! launches pass; and a sample for sm_75 and sm_120, the oldest and newest targets of NVRTC
//! 13.0. Then assembles the sm_90 PTX with `ptxas` for sm_90 and checks each specialisation's
//! resources: no spills or stack, registers within the bound its `__launch_bounds__` sets, and
//! the widths of its streaming loads and stores in the SASS (`nvdisasm`).
//!
//! Needs the NVRTC library and, for the resource checks, ptxas and nvdisasm (no GPU). Without
//! them the tests print why and pass, unless `SDP4BIT_REQUIRE_NVRTC=1` or
//! `SDP4BIT_REQUIRE_PTXAS=1` (both set by `scripts/test.sh` and CI), which turn the skip into a
//! failure naming what is missing.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use rayon::prelude::*;
use sdp4bit::Error;
use sdp4bit::backend::cuda::compile::{Arch, Compiled, Target, compile, compile_program};
use sdp4bit::backend::cuda::probe;
use sdp4bit::backend::cuda::source::{HEADERS, Kernel, SOURCES};
use sdp4bit::backend::cuda::spec::{Constants, KernelSpec};
use sdp4bit_test_support::kernel_resources::{
    CudaTools, KernelResources, Usage, count_sass, parse_ptxas_report,
};
use sdp4bit_test_support::spec_cover;

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

/// Every spec of the cover compiled for sm_90 (once per test process, in parallel).
fn cover() -> &'static [(KernelSpec, Compiled)] {
    static COVER: OnceLock<Vec<(KernelSpec, Compiled)>> = OnceLock::new();
    COVER.get_or_init(|| {
        spec_cover::specs()
            .into_par_iter()
            .map(|spec| {
                let compiled =
                    compile(&spec, Arch::SM_90).unwrap_or_else(|e| panic!("{spec}: {e}"));
                (spec, compiled)
            })
            .collect()
    })
}

/// Every spec of the cover compiles for sm_90 with an empty log, and its PTX defines the entry
/// point the backend looks up in it.
#[test]
fn every_specialisation_compiles_without_warnings() {
    if !nvrtc_available("every_specialisation_compiles_without_warnings") {
        return;
    }
    let cover = cover();
    println!("{} specialisations", cover.len());
    for (spec, compiled) in cover {
        assert!(
            compiled.log.trim().is_empty(),
            "{spec} compiled with warnings:\n{}",
            compiled.log
        );
        assert!(
            compiled.ptx.contains(".target sm_90"),
            "{spec}: PTX not for sm_90"
        );
        let entry = format!(".entry {}(", spec.entry());
        assert!(
            compiled.ptx.contains(&entry),
            "{spec}: no `{entry}` in the PTX"
        );
    }
    // The cover holds every kernel of the table and every peer batch.
    for kernel in Kernel::ALL {
        assert!(
            cover.iter().any(|(s, _)| s.kernel == kernel),
            "the cover has no specialisation of {}",
            kernel.name()
        );
    }
    assert_eq!(spec_cover::peer_batches(), vec![1, 2, 4, 8]);
}

/// Specialisations also compile for the oldest and the newest architecture NVRTC 13.0 targets
/// (sm_75 and sm_120, docs/cuda.md), which the backend compiles for on such devices: code for
/// sm_80 and newer only (the warp reduction `redux.sync`) has its fallback. One spec per kernel
/// of the table. ptxas may warn there (launch bounds past sm_75's threads per multiprocessor are
/// ignored).
#[test]
fn specialisations_compile_for_the_oldest_and_newest_targets() {
    if !nvrtc_available("specialisations_compile_for_the_oldest_and_newest_targets") {
        return;
    }
    const OLDEST: Arch = Arch { major: 7, minor: 5 };
    const NEWEST: Arch = Arch {
        major: 12,
        minor: 0,
    };
    let mut sample: Vec<KernelSpec> = Vec::new();
    for spec in spec_cover::specs() {
        if !sample.iter().any(|s| s.kernel == spec.kernel) {
            sample.push(spec);
        }
    }
    sample.par_iter().for_each(|spec| {
        for arch in [OLDEST, NEWEST] {
            let compiled = compile(spec, arch).unwrap_or_else(|e| panic!("{spec} for {arch}: {e}"));
            assert!(
                compiled.ptx.contains(&format!(".target {arch}")),
                "{spec}: PTX not for {arch}"
            );
        }
    });
}

/// A program that does not compile is an error value carrying NVRTC's log.
#[test]
fn compile_error_is_a_value_with_the_log() {
    if !nvrtc_available("compile_error_is_a_value_with_the_log") {
        return;
    }
    let code = "#include \"common.cuh\"\nextern \"C\" __global__ void k() { undeclared_name; }\n";
    match compile_program("broken", code, Target::Cubin(Arch::SM_90)) {
        Err(Error::Cuda(message)) => {
            assert!(message.contains("broken"), "{message}");
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
    let code = "extern \"C\" __global__ void k(int* p) { int unused_variable = 1; *p = 0; }\n";
    let compiled = compile_program("warning", code, Target::Cubin(Arch::SM_90))
        .expect("a warning is not an error");
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
    for (spec, compiled) in cover() {
        let name = spec.entry();
        let ptx = &compiled.ptx;
        let start = ptx
            .find(&format!(".entry {name}("))
            .unwrap_or_else(|| panic!("no entry {name}"));
        let list = &ptx[start..start + ptx[start..].find(')').expect("parameter list end")];
        let params: Vec<&str> = list
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with(".param"))
            .collect();
        let (pointers, bytes) = (spec.kernel.pointers().len(), spec.kernel.params_size());
        let mut want: Vec<String> = (0..pointers)
            .map(|i| format!(".param .u64 {name}_param_{i},"))
            .collect();
        want.push(format!(
            ".param .align 8 .b8 {name}_param_{pointers}[{bytes}]"
        ));
        assert_eq!(params, want, "{name}");
    }
}

/// The most registers per thread `spec` may use: what its `__launch_bounds__(T, B)` leaves
/// (65536 registers per multiprocessor over B blocks of T threads, rounded down to the
/// allocation unit of 8, at most 255), so that B blocks fit a multiprocessor.
fn register_budget(spec: &KernelSpec) -> u32 {
    let per_thread = 65_536 / (spec.variant.threads * spec.variant.min_blocks);
    (per_thread / 8 * 8).min(255)
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

/// Every spec's resources, assembled in a fresh directory (once per test process).
fn every_spec_resources(tools: &CudaTools) -> &'static [(KernelSpec, KernelResources)] {
    static RESOURCES: OnceLock<Vec<(KernelSpec, KernelResources)>> = OnceLock::new();
    RESOURCES.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("sdp4bit-resources-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("work directory");
        let all = cover()
            .par_iter()
            .map(|(spec, compiled)| {
                let name = spec.entry();
                let resources = tools
                    .analyse(&name, &compiled.ptx, &dir)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                let found = resources
                    .iter()
                    .find(|r| r.name == name)
                    .unwrap_or_else(|| panic!("ptxas reports no {name}"));
                (*spec, found.clone())
            })
            .collect();
        std::fs::remove_dir_all(&dir).expect("remove the work directory");
        all
    })
}

/// Every spec's resources (when NVRTC and the CUDA tools are there) against what the kernel
/// table and its launch bounds plan: `problems` lists what is wrong with one spec; the test
/// fails with all of them.
fn check_every_spec(test: &str, problems: impl Fn(&KernelSpec, &KernelResources) -> Vec<String>) {
    if !nvrtc_available(test) {
        return;
    }
    let Some(tools) = cuda_tools(test) else {
        return;
    };
    let mut failures = Vec::new();
    for (spec, resources) in every_spec_resources(&tools) {
        for problem in problems(spec, resources) {
            failures.push(format!("{spec}: {problem}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// No specialisation spills or keeps a stack frame, and each stays within its register bound,
/// so the occupancy its launch bounds promise holds without local-memory traffic: no local
/// loads or stores in its own code (a function it calls out of line on a cold path, such as the
/// division's slow path, may save registers there, which costs only when that path runs).
#[test]
fn specialisations_fit_their_register_bounds_without_spilling() {
    check_every_spec(
        "specialisations_fit_their_register_bounds_without_spilling",
        |spec, resources| {
            let usage = &resources.usage;
            let mut problems = Vec::new();
            if usage.uses_local_memory() || resources.sass.local > 0 {
                problems.push(format!(
                    "{} bytes stack, {} bytes spill stores, {} bytes spill loads, {} local \
                     loads/stores in the SASS",
                    usage.stack_frame, usage.spill_stores, usage.spill_loads, resources.sass.local
                ));
            }
            let budget = register_budget(spec);
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

/// The widths in bits of `spec`'s widest global load and store: its kernel's line of the kernel
/// table, but where the constants move less: a weight slab's codes are a word of eight 4-bit
/// codes (64 bits of 8-bit ones) per lane, which is the encoding's widest store and the widest
/// load of an application of direct weights (which reads no old params).
fn planned_widths(spec: &KernelSpec) -> (u32, u32) {
    let kernel = spec.kernel;
    let table = (kernel.widest_load_bits(), kernel.widest_store_bits());
    match spec.constants {
        Constants::Weight { quant, difference } => {
            let codes = quant.bits * 8;
            match kernel {
                Kernel::WeightEncode => (table.0, codes),
                _ if !difference => (codes, table.1),
                _ => table,
            }
        }
        _ => table,
    }
}

/// Each specialisation moves its streaming data in accesses of the widths its kernel's line of
/// the kernel table plans (16-byte loads of fp32 and bf16 runs, whole-word code stores, no
/// wider access), as its constants need them.
#[test]
fn streaming_accesses_have_their_planned_widths() {
    check_every_spec(
        "streaming_accesses_have_their_planned_widths",
        |spec, resources| {
            let widths = (resources.sass.widest_load(), resources.sass.widest_store());
            let planned = planned_widths(spec);
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

/// The ptxas report parser reads registers, stack and spills per entry point (not those of a
/// function it calls, listed after it), and the occupancy follows the per-warp register
/// allocation.
#[test]
fn reads_a_ptxas_report() {
    let report = "ptxas info    : 0 bytes gmem\n\
        ptxas info    : Compiling entry function 'k' for 'sm_90'\n\
        ptxas info    : Function properties for k\n\
        \x20   16 bytes stack frame, 24 bytes spill stores, 40 bytes spill loads\n\
        ptxas info    : Used 48 registers, used 0 barriers, 16 bytes cumulative stack size\n\
        ptxas info    : Function properties for _Z4cold\n\
        \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
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
        /*0040*/  NOP ;\n\
        .type $k$cold,@function\n\
        /*0050*/  STL [R1+0x4], R16 ;\n\
        /*0060*/  LDL R16, [R1+0x4] ;\n";
    let counts = &count_sass(listing)["k"];
    assert_eq!(counts.instructions, 6);
    assert_eq!(counts.shuffles, 1);
    assert_eq!(counts.local, 1);
    assert_eq!(counts.local_in_calls, 2);
    assert_eq!(counts.widest_load(), 128);
    assert_eq!(counts.widest_store(), 8);
}
