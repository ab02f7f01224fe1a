//! Finds the CUDA driver and NVRTC libraries before cudarc touches them.
//!
//! cudarc loads its libraries lazily and panics when a library or one of its symbols is
//! missing. This module repeats cudarc's search (the same names, in the same order, from
//! `cudarc::get_lib_name_candidates`) with libloading and checks that the library cudarc will
//! pick exports every symbol this backend makes cudarc call, so a machine without CUDA gets an
//! [`Error::Cuda`] value naming what was searched, never a panic. Each probe runs once per
//! process; its result is cached.
//!
//! NVRTC opens its builtins library (`libnvrtc-builtins.so.<major>.<minor>`) by name when it
//! first compiles, so the loader's search path decides which one it gets, and a wheel's NVRTC
//! loaded by path finds none. [`nvrtc_library`] therefore loads the builtins from the
//! directory of the NVRTC that was found, by absolute path, before anything compiles: NVRTC's
//! own `dlopen` of that name then returns the library already loaded (the loader matches loaded
//! objects by soname), whatever `LD_LIBRARY_PATH` says.
//!
//! Where NVRTC comes from, in order: the file [`NVRTC_LIBRARY_VAR`] names; the loader's search
//! (cudarc's names); else a `libnvrtc.so.<major>` in the directories [`NVRTC_DIRS_VAR`] lists,
//! which `import sdp4bit` sets to the torch wheels' (`site-packages/nvidia/*/lib`): the one of
//! the driver's major CUDA version, else the newest not newer than it, else the newest. Whatever
//! is found is loaded by path first, so cudarc's search by name then returns it.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
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
        "cuCtxGetStreamPriorityRange",
        "cuModuleLoadData",
        "cuModuleGetFunction",
        "cuLaunchKernel",
        "cuMemsetD8Async",
        "cuMemsetD32Async",
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuMemcpyHtoD_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
        "cuMemHostAlloc",
        "cuMemFreeHost",
        "cuStreamSynchronize",
        "cuStreamCreate",
        "cuStreamCreateWithPriority",
        "cuStreamDestroy_v2",
        "cuStreamWaitEvent",
        "cuEventCreate",
        "cuEventRecord",
        "cuEventQuery",
        "cuEventSynchronize",
        "cuEventDestroy_v2",
        "cuGetErrorString",
        "cuDriverGetVersion",
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
        "nvrtcGetCUBINSize",
        "nvrtcGetCUBIN",
        "nvrtcGetNumSupportedArchs",
        "nvrtcGetSupportedArchs",
        "nvrtcGetProgramLogSize",
        "nvrtcGetProgramLog",
        "nvrtcVersion",
    ],
};

/// The variable naming an NVRTC library to load by absolute path before the loader's search
/// (e.g. `.../site-packages/nvidia/cu13/lib/libnvrtc.so.13`).
pub const NVRTC_LIBRARY_VAR: &str = "SDP4BIT_NVRTC_LIBRARY";

/// The variable listing directories (separated as in `PATH`) searched for NVRTC when the loader
/// finds none; the Python package sets it, if unset, to the `nvidia/*/lib` directories on
/// `sys.path` (`nvidia/cu13/lib`, or `nvidia/cuda_nvrtc/lib` for CUDA 12).
pub const NVRTC_DIRS_VAR: &str = "SDP4BIT_NVRTC_DIRS";

/// The NVRTC this process compiles with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvrtcLibrary {
    /// The file the loader mapped.
    pub path: PathBuf,
    /// `nvrtcVersion`: (major, minor).
    pub version: (u32, u32),
    /// The builtins library loaded for it.
    pub builtins: PathBuf,
}

/// Checks that the CUDA driver library can be loaded and exports what the backend calls.
/// Call before any `cudarc::driver` function.
pub fn driver() -> Result<()> {
    static RESULT: OnceLock<Result<()>> = OnceLock::new();
    RESULT.get_or_init(|| probe(&DRIVER)).clone()
}

/// Checks that the NVRTC library can be loaded and exports what the backend calls, and loads
/// its builtins library (see the module doc). Call before any `cudarc::nvrtc` function.
pub fn nvrtc() -> Result<()> {
    nvrtc_library().map(|_| ())
}

/// The NVRTC library cudarc will use, with its version and the builtins loaded beside it
/// (see the module doc); found once per process.
pub fn nvrtc_library() -> Result<&'static NvrtcLibrary> {
    static RESULT: OnceLock<Result<NvrtcLibrary>> = OnceLock::new();
    RESULT
        .get_or_init(load_nvrtc)
        .as_ref()
        .map_err(Clone::clone)
}

/// Loads the first candidate that loads (as cudarc does) and checks its symbols.
fn probe(lib: &Library) -> Result<()> {
    let (name, library) = first_loadable(lib)?;
    check_symbols(lib, &name, &library)
}

/// The NVRTC of [`NVRTC_LIBRARY_VAR`] if set, else the loader's, else the one of
/// [`NVRTC_DIRS_VAR`] for this driver; its builtins loaded by path. Both libraries stay loaded
/// for the life of the process.
fn load_nvrtc() -> Result<NvrtcLibrary> {
    let named = std::env::var_os(NVRTC_LIBRARY_VAR).map(PathBuf::from);
    let preloaded = match &named {
        Some(path) => Some(preload(path, NVRTC_LIBRARY_VAR)?),
        None => None,
    };
    let (name, library) = match first_loadable(&NVRTC) {
        Ok(found) => found,
        Err(Error::Cuda(loader)) if named.is_none() => {
            let dirs = std::env::var_os(NVRTC_DIRS_VAR);
            let dirs: Vec<PathBuf> = dirs
                .iter()
                .flat_map(std::env::split_paths)
                .filter(|dir| !dir.as_os_str().is_empty())
                .collect();
            let files = nvrtc_files(&dirs);
            let Some(path) = preferred(&files, driver_major()) else {
                return Err(Error::Cuda(format!(
                    "{loader}; nor is a libnvrtc.so.<major> in the directories of \
                     {NVRTC_DIRS_VAR}={dirs:?} (the Python package sets it to the torch \
                     wheels' nvidia/*/lib directories): install the NVRTC of the driver's CUDA \
                     version (pip: nvidia-cuda-nvrtc for CUDA 13, nvidia-cuda-nvrtc-cu12 for \
                     CUDA 12) or set {NVRTC_LIBRARY_VAR} to its path"
                )));
            };
            preload(path, NVRTC_DIRS_VAR)?;
            first_loadable(&NVRTC)?
        }
        Err(e) => return Err(e),
    };
    check_symbols(&NVRTC, &name, &library)?;
    let path = mapped_path(&library, "nvrtcVersion")?;
    if let Some(preloaded) = preloaded
        && !same_file(&preloaded, &path)
    {
        return Err(Error::Cuda(format!(
            "{NVRTC_LIBRARY_VAR} loaded {}, but the loader answers cudarc's first name {name} \
             with {}: unset {NVRTC_LIBRARY_VAR} or remove that library from the search path",
            preloaded.display(),
            path.display()
        )));
    }
    let version = nvrtc_version(&library, &path)?;
    let builtins = load_builtins(&path, version)?;
    std::mem::forget(library);
    Ok(NvrtcLibrary {
        path,
        version,
        builtins,
    })
}

/// Loads the NVRTC at `path` (found through `source`) for the life of the process; returns the
/// file the loader mapped.
fn preload(path: &Path, source: &str) -> Result<PathBuf> {
    // SAFETY: loading the vendor library the user or the wheels named runs its initialisers,
    // as cudarc's own load would.
    let library = unsafe { libloading::Library::new(path) }.map_err(|e| {
        Error::Cuda(format!(
            "the NVRTC {} (from {source}) could not be loaded: {}",
            path.display(),
            with_source(&e)
        ))
    })?;
    let mapped = mapped_path(&library, "nvrtcVersion")?;
    std::mem::forget(library);
    Ok(mapped)
}

/// The `libnvrtc.so.<major>` files in `dirs` (their sonames: not the `.alt` variant, not the
/// builtins), with their major versions, directory by directory, by name within each.
fn nvrtc_files(dirs: &[PathBuf]) -> Vec<(u32, PathBuf)> {
    let mut files = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut found: Vec<(u32, PathBuf)> = entries
            .filter_map(|entry| {
                let path = entry.ok()?.path();
                let major = path.file_name()?.to_str()?.strip_prefix("libnvrtc.so.")?;
                if !major.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                Some((major.parse().ok()?, path))
            })
            .collect();
        found.sort_by(|a, b| a.1.cmp(&b.1));
        files.extend(found);
    }
    files
}

/// The file to load from `files`: the newest major version not newer than the driver's
/// (`driver_major`, when a driver loads), else the newest; the first of equals.
fn preferred(files: &[(u32, PathBuf)], driver_major: Option<u32>) -> Option<&Path> {
    let key = |&&(major, _): &&(u32, PathBuf)| (driver_major.is_none_or(|d| major <= d), major);
    files
        .iter()
        .rev()
        .max_by_key(key)
        .map(|(_, path)| path.as_path())
}

/// The driver's CUDA version (`cuDriverGetVersion`: 1000 * major + 10 * minor).
pub fn driver_version() -> Result<i32> {
    driver()?;
    let mut version = 0;
    // SAFETY: `version` receives one int; cuDriverGetVersion needs no initialisation.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| Error::Cuda(format!("cuDriverGetVersion failed: {e}")))?;
    Ok(version)
}

/// The driver's major CUDA version, when a driver loads.
fn driver_major() -> Option<u32> {
    let version = driver_version().ok()?;
    u32::try_from(version / 1000).ok()
}

/// Calls `nvrtcVersion` of `library` (mapped from `path`).
fn nvrtc_version(library: &libloading::Library, path: &Path) -> Result<(u32, u32)> {
    type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
    // SAFETY: `nvrtcVersion` has this C signature in every NVRTC (checked present above).
    let version = unsafe { library.get::<Version>(b"nvrtcVersion\0") }
        .map_err(|e| Error::Cuda(format!("{}: {}", path.display(), with_source(&e))))?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both out-pointers are valid for one int each.
    let status = unsafe { version(&mut major, &mut minor) };
    match (status, u32::try_from(major), u32::try_from(minor)) {
        (0, Ok(major), Ok(minor)) => Ok((major, minor)),
        _ => Err(Error::Cuda(format!(
            "nvrtcVersion of {} returned status {status} ({major}.{minor})",
            path.display()
        ))),
    }
}

/// Loads `libnvrtc-builtins.so.<major>.<minor>` from the directory of `nvrtc`, or, when that
/// directory has none, where the loader finds it; returns the path it was loaded by (the bare
/// name when the loader searched).
fn load_builtins(nvrtc: &Path, (major, minor): (u32, u32)) -> Result<PathBuf> {
    let name = format!("libnvrtc-builtins.so.{major}.{minor}");
    let beside = nvrtc.parent().unwrap_or(Path::new("/")).join(&name);
    let target: &Path = if beside.exists() {
        &beside
    } else {
        Path::new(&name)
    };
    // SAFETY: loading NVRTC's own builtins library, which NVRTC itself would load next.
    let library = unsafe { libloading::Library::new(target) }.map_err(|e| {
        Error::Cuda(format!(
            "NVRTC {major}.{minor} ({}) needs {name}: there is none beside it and the loader \
             finds none (LD_LIBRARY_PATH={}): {}",
            nvrtc.display(),
            ld_library_path(),
            with_source(&e)
        ))
    })?;
    std::mem::forget(library);
    Ok(target.to_path_buf())
}

/// `Dl_info` of `dladdr(3)`.
#[repr(C)]
struct DlInfo {
    fname: *const c_char,
    fbase: *mut c_void,
    sname: *const c_char,
    saddr: *mut c_void,
}

unsafe extern "C" {
    fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
}

/// The file the loader mapped `library` from, found through the address of its `symbol`.
fn mapped_path(library: &libloading::Library, symbol: &str) -> Result<PathBuf> {
    // SAFETY: the symbol is only looked up; its address is passed to dladdr, never called.
    let address = unsafe { library.get::<*const c_void>(symbol.as_bytes()) }
        .map_err(|e| Error::Cuda(format!("symbol {symbol}: {}", with_source(&e))))?;
    let mut info = DlInfo {
        fname: std::ptr::null(),
        fbase: std::ptr::null_mut(),
        sname: std::ptr::null(),
        saddr: std::ptr::null_mut(),
    };
    // SAFETY: `info` is a valid Dl_info; the address lies in a loaded object.
    let found = unsafe { dladdr(*address, &mut info) };
    if found == 0 || info.fname.is_null() {
        return Err(Error::Cuda(format!(
            "dladdr found no object holding {symbol}"
        )));
    }
    // SAFETY: dladdr returned a NUL-terminated path owned by the loader.
    let path = unsafe { CStr::from_ptr(info.fname) };
    Ok(PathBuf::from(path.to_string_lossy().into_owned()))
}

/// Whether two paths name the same file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The first of cudarc's candidate names of `lib` that loads, with the loaded library.
fn first_loadable(lib: &Library) -> Result<(String, libloading::Library)> {
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
            Ok(library) => return Ok((name.clone(), library)),
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

    /// Only `libnvrtc.so.<major>` files count (not the `.alt` variant, the builtins or the
    /// unversioned link), directory by directory; the pick is the driver's major version, else
    /// the newest not newer than the driver, else the newest, and the first directory's of
    /// equals.
    #[test]
    fn wheel_nvrtc_of_the_drivers_major_version_is_preferred() {
        let root = std::env::temp_dir().join(format!("sdp4bit-probe-{}", std::process::id()));
        let cu13 = root.join("nvidia/cu13/lib");
        let cu12 = root.join("nvidia/cuda_nvrtc/lib");
        let other = root.join("other/lib");
        for (dir, names) in [
            (
                &cu13,
                &[
                    "libnvrtc.so.13",
                    "libnvrtc.alt.so.13",
                    "libnvrtc-builtins.so.13.0",
                ][..],
            ),
            (
                &cu12,
                &["libnvrtc.so.12", "libnvrtc.so", "libnvrtc.so.12.x"][..],
            ),
            (&other, &["libnvrtc.so.13"][..]),
        ] {
            std::fs::create_dir_all(dir).unwrap();
            for name in names {
                std::fs::write(dir.join(name), b"").unwrap();
            }
        }
        let dirs = [
            cu13.clone(),
            root.join("missing"),
            cu12.clone(),
            other.clone(),
        ];
        let files = nvrtc_files(&dirs);
        let (v13, v12) = (cu13.join("libnvrtc.so.13"), cu12.join("libnvrtc.so.12"));
        assert_eq!(
            files,
            [
                (13, v13.clone()),
                (12, v12.clone()),
                (13, other.join("libnvrtc.so.13"))
            ]
        );
        for (driver, wanted) in [
            (Some(12), &v12),
            (Some(13), &v13),
            (Some(14), &v13),
            (Some(11), &v13),
            (None, &v13),
        ] {
            assert_eq!(
                preferred(&files, driver),
                Some(wanted.as_path()),
                "{driver:?}"
            );
        }
        assert_eq!(preferred(&[], Some(13)), None);
        std::fs::remove_dir_all(&root).unwrap();
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
