//! Compiles every kernel source for sm_90 through the backend's own NVRTC path: no warnings,
//! and every kernel the backend launches is an entry point of the PTX.
//!
//! Needs the NVRTC library (no GPU). Without it the tests print why and pass, unless
//! `SDP4BIT_REQUIRE_NVRTC=1` (set by `scripts/test.sh` and CI), which turns the skip into a
//! failure naming the libraries searched.

use std::collections::BTreeSet;

use sdp4bit::Error;
use sdp4bit::backend::cuda::abi::{
    SdpGlobal, SdpGradFinal, SdpGradFirst, SdpGradSecond, SdpWeightApply, SdpWeightEncode,
};
use sdp4bit::backend::cuda::compile::{Arch, compile};
use sdp4bit::backend::cuda::probe;
use sdp4bit::backend::cuda::source::{HEADERS, Kernel, KernelSource, SOURCES};

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

/// The embedded sources are exactly the files of `kernels/` (a new .cu must be registered in
/// `source.rs`, or it would be neither compiled nor tested).
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

/// The launch signature the backend uses for `kernel`: device pointers, then the parameter
/// struct's size (its `#[repr(C)]` mirror in `abi`).
fn signature(kernel: Kernel) -> (usize, usize) {
    match kernel {
        Kernel::GradQuantizeFirst => (3, size_of::<SdpGradFirst>()),
        Kernel::GradRequantizeSecond => (3, size_of::<SdpGradSecond>()),
        Kernel::GradReduceFinal => (2, size_of::<SdpGradFinal>()),
        Kernel::WeightEncode => (3, size_of::<SdpWeightEncode>()),
        Kernel::WeightApply => (3, size_of::<SdpWeightApply>()),
        Kernel::GlobalAbsmax
        | Kernel::GlobalQuantizeI8
        | Kernel::GlobalQuantizeI16
        | Kernel::GlobalDequantizeI8
        | Kernel::GlobalDequantizeI16 => (2, size_of::<SdpGlobal>()),
    }
}

/// The parameter list of every entry point in the PTX is what the launches pass: 64-bit
/// pointers, then one 8-byte-aligned struct of exactly the Rust mirror's size (so the ABI
/// header and `abi.rs` agree with what NVRTC compiled, without a GPU).
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
            let (pointers, bytes) = signature(kernel);
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
