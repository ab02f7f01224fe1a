//! Finds the CUDA driver and NVRTC libraries before cudarc touches them.
//!
//! cudarc loads its libraries lazily and panics when a library or one of its symbols is
//! missing. This module repeats cudarc's search (the same names, in the same order, from
//! `cudarc::get_lib_name_candidates`) with libloading and checks that the library cudarc will
//! pick exports every symbol this backend makes cudarc call, so a machine without CUDA gets an
//! [`Error::Cuda`] value naming what was searched, never a panic. Each probe runs once per
//! process; its result is cached.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// One dynamically loaded library: the base names cudarc searches and the symbols we need.
struct Library {
    /// What the library is, for messages.
    what: &'static str,
    /// Base names passed to `cudarc::get_lib_name_candidates`, in cudarc's order.
    names: &'static [&'static str],
    /// Every symbol the backend (directly or through cudarc's `result` wrappers) calls.
    symbols: &'static [&'static str],
}

/// The CUDA driver (`libcuda`): cudarc's `driver::sys` searches `cuda`, then `nvcuda`.
const DRIVER: Library = Library {
    what: "the CUDA driver library",
    names: &["cuda", "nvcuda"],
    symbols: &[
        "cuInit",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDeviceGetAttribute",
        "cuDevicePrimaryCtxRetain",
        "cuCtxGetCurrent",
        "cuCtxPushCurrent_v2",
        "cuCtxPopCurrent_v2",
        "cuModuleLoadData",
        "cuModuleGetFunction",
        "cuLaunchKernel",
        "cuMemsetD8Async",
        "cuMemsetD32Async",
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuMemcpyHtoD_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
        "cuStreamSynchronize",
        "cuGetErrorString",
    ],
};

/// The runtime compiler (`libnvrtc`): cudarc's `nvrtc::sys` searches `nvrtc`.
const NVRTC: Library = Library {
    what: "the NVRTC library (CUDA runtime compiler)",
    names: &["nvrtc"],
    symbols: &[
        "nvrtcCreateProgram",
        "nvrtcCompileProgram",
        "nvrtcDestroyProgram",
        "nvrtcGetPTXSize",
        "nvrtcGetPTX",
        "nvrtcGetProgramLogSize",
        "nvrtcGetProgramLog",
    ],
};

/// Checks that the CUDA driver library can be loaded and exports what the backend calls.
/// Call before any `cudarc::driver` function.
pub fn driver() -> Result<()> {
    static RESULT: OnceLock<Result<()>> = OnceLock::new();
    RESULT.get_or_init(|| probe(&DRIVER)).clone()
}

/// Checks that the NVRTC library can be loaded and exports what the backend calls. Call
/// before any `cudarc::nvrtc` function.
pub fn nvrtc() -> Result<()> {
    static RESULT: OnceLock<Result<()>> = OnceLock::new();
    RESULT.get_or_init(|| probe(&NVRTC)).clone()
}

/// Loads the first candidate that loads (as cudarc does) and checks its symbols.
fn probe(lib: &Library) -> Result<()> {
    let mut candidates: Vec<String> = Vec::new();
    for name in lib.names {
        for candidate in cudarc::get_lib_name_candidates(name) {
            if !candidates.contains(&candidate) {
                candidates.push(candidate);
            }
        }
    }
    let mut last_error = String::from("no candidate names");
    for name in &candidates {
        // SAFETY: loading a shared library runs its initialisers; these are the same vendor
        // libraries, searched in the same order, that cudarc itself would load next.
        match unsafe { libloading::Library::new(name.as_str()) } {
            Ok(library) => return check_symbols(lib, name, &library),
            Err(e) => last_error = with_source(&e),
        }
    }
    Err(Error::Cuda(format!(
        "{} could not be loaded: searched {candidates:?} (LD_LIBRARY_PATH={}); last error: \
         {last_error}",
        lib.what,
        ld_library_path()
    )))
}

/// Fails naming the first symbol `library` (loaded from `name`) does not export.
fn check_symbols(lib: &Library, name: &str, library: &libloading::Library) -> Result<()> {
    for symbol in lib.symbols {
        // SAFETY: the symbol is only looked up, never called or dereferenced; `*const u8`
        // is a type any exported address can be viewed as.
        if let Err(e) = unsafe { library.get::<*const u8>(*symbol) } {
            return Err(Error::Cuda(format!(
                "{} {name} lacks the symbol {symbol} (too old for CUDA 13?): {}",
                lib.what,
                with_source(&e)
            )));
        }
    }
    Ok(())
}

/// A libloading error with the loader's own message (`dlerror`), which libloading keeps as
/// the error's source.
fn with_source(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    }
}

/// `LD_LIBRARY_PATH` as the loader sees it, for messages.
fn ld_library_path() -> String {
    match std::env::var_os("LD_LIBRARY_PATH") {
        Some(path) => format!("{:?}", path.to_string_lossy()),
        None => "<unset>".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A library that does not exist is an error naming every candidate and the search
    /// path, not a panic.
    #[test]
    fn missing_library_is_an_error() {
        let lib = Library {
            what: "a test library",
            names: &["sdp4bit_no_such_library"],
            symbols: &[],
        };
        let e = probe(&lib).expect_err("no such library");
        let Error::Cuda(message) = e else {
            panic!("wrong variant: {e:?}")
        };
        assert!(
            message.contains("libsdp4bit_no_such_library.so"),
            "{message}"
        );
        assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
    }

    /// The driver probe returns a value on every machine: an error naming `libcuda` where
    /// there is no driver (as on the development machines and CI), `Ok` where there is one.
    #[test]
    fn driver_probe_is_a_value() {
        match driver() {
            Ok(()) => println!("CUDA driver present"),
            Err(Error::Cuda(message)) => {
                assert!(message.contains("libcuda.so"), "{message}");
                println!("no CUDA driver, as expected without a GPU: {message}");
            }
            Err(e) => panic!("wrong variant: {e:?}"),
        }
    }

    /// A library without a symbol the backend needs is refused, naming the symbol.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn missing_symbol_is_an_error() {
        let lib = Library {
            what: "the C library",
            names: &["c"],
            symbols: &["malloc", "sdp4bit_no_such_symbol"],
        };
        // libc is "libc.so.6" on glibc systems, which the cudarc candidates do not name;
        // load it directly so the symbol check itself is exercised.
        // SAFETY: the C library is already loaded into every process; loading it again runs
        // no new initialisers.
        let library = unsafe { libloading::Library::new("libc.so.6") }.expect("glibc");
        let e = check_symbols(&lib, "libc.so.6", &library).expect_err("missing symbol");
        assert!(e.to_string().contains("sdp4bit_no_such_symbol"), "{e}");
    }
}
