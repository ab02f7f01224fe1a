//! The emulated CUDA driver library: built with g++ once per test process from
//! `tests/cuda_driver_emulation/*.cpp` (with `tests/kernel_emulator/`'s warp scheduler), then
//! loaded so that cudarc and the backend's probe find it as `libcuda.so`; it runs the host
//! builds of the specialised kernels the backend loads, which the builder installed here makes
//! on demand (`sdp4bit_test_support::host_kernels`).
//!
//! Loading: the library's soname is `libcuda.so`, the first name cudarc (and
//! `backend::cuda::probe`) asks the dynamic loader for. Once it is loaded by path with
//! `RTLD_GLOBAL`, the loader answers a later `dlopen("libcuda.so")` with it (it matches
//! loaded objects by soname), so nothing in the product changes and no environment variable
//! has to be set before the process starts. Only the processes that call [`emulation`] see it.
//!
//! A child process of these tests gets the built library's path in [`LIBRARY_VAR`] and loads
//! that instead of building its own.

use std::ffi::{CStr, OsString, c_char, c_int, c_void};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW, Symbol};
use sdp4bit::backend::cuda::probe;
use sdp4bit_test_support::gxx::{compile_in_parallel, kernel_host_flags, link};
use sdp4bit_test_support::host_kernels::install_emulation_builder;

/// g++ flags of every translation unit besides [`KERNEL_HOST_FLAGS`]: position-independent,
/// only the driver API exported.
const CXX_FLAGS: [&str; 4] = ["-O1", "-pthread", "-fPIC", "-fvisibility=hidden"];

/// The kernel emulator's UBSan flags (undefined behaviour in a kernel stops the process), for
/// the kernels and the warp scheduler; the driver's own model is built without them, which
/// saves a fifth of the build.
const SANITIZE: [&str; 2] = [
    "-fsanitize=undefined,float-cast-overflow",
    "-fno-sanitize-recover=all",
];

/// Whether `source` runs kernel code (the warp scheduler around the host builds).
fn runs_kernel_code(source: &Path) -> bool {
    source.ends_with("kernels.cpp")
}

/// The variable that hands a built library to a child test process.
pub const LIBRARY_VAR: &str = "SDP4BIT_CUDA_EMULATION_LIBRARY";

/// The loaded emulation: its path and its test-only entry points.
pub struct Emulation {
    path: PathBuf,
    library: Library,
}

/// Builds (first call) and loads the emulated driver; every later call returns it. Panics with
/// the compiler's output when the build fails.
pub fn emulation() -> &'static Emulation {
    static EMULATION: OnceLock<Result<Emulation, String>> = OnceLock::new();
    EMULATION
        .get_or_init(build_and_load)
        .as_ref()
        .unwrap_or_else(|e| panic!("the emulated CUDA driver: {e}"))
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn build_and_load() -> Result<Emulation, String> {
    let built = std::env::var_os(LIBRARY_VAR);
    let path = match &built {
        Some(built) => PathBuf::from(built),
        None => build_in_temp_dir()?,
    };
    // SAFETY: the library was built from this repository's sources; its initialisers only
    // set up static state.
    let library = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| format!("load {}: {e}", path.display()))?;
    install_emulation_builder();
    // In the parent process (a child may run without NVRTC on purpose), once the driver is
    // loaded, since the probe asks it which NVRTC to prefer.
    if built.is_none() {
        require_nvrtc();
    }
    Ok(Emulation { path, library })
}

/// Stops the process, with one line saying what to run, when NVRTC cannot be loaded: nearly
/// every test of this binary needs it, and would otherwise fail with the probe's error each.
fn require_nvrtc() {
    if let Err(e) = probe::nvrtc() {
        // Straight to the process's stderr: the test harness captures `eprintln!`.
        let _ = writeln!(
            std::io::stderr(),
            "error: the CUDA driver emulation tests need NVRTC: run `source scripts/env.sh && \
             sdp4bit_nvrtc` once (bash scripts/test.sh does), which installs it into .cache/, \
             where cargo test finds it ({e})"
        );
        std::process::exit(1);
    }
}

/// The prefix of the build directories, followed by the building process's id.
const DIR_PREFIX: &str = "sdp4bit-cuda-driver-";

/// Builds the library in a fresh temporary directory; returns its path. The directory stays
/// while the process (and its children) may load the library; later runs remove those of
/// processes that have ended.
fn build_in_temp_dir() -> Result<PathBuf, String> {
    remove_stale_dirs();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    build(&dir)
}

/// Removes the build directories of processes that no longer run.
fn remove_stale_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(DIR_PREFIX)
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Compiles every source in parallel and links `dir/libcuda.so`.
fn build(dir: &Path) -> Result<PathBuf, String> {
    let kernels = root().join("kernels");
    let emulation = root().join("tests/cuda_driver_emulation");
    let shim = root().join("tests/kernel_emulator/cuda_shim.h");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&emulation)
        .map_err(|e| format!("{}: {e}", emulation.display()))?
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "cpp"))
        .collect();
    sources.sort();
    let objects = compile_in_parallel(&sources, dir, |source| {
        let mut flags = kernel_host_flags(&CXX_FLAGS, &shim, &[&kernels]);
        if runs_kernel_code(source) {
            flags.extend(SANITIZE.iter().map(OsString::from));
        }
        flags
    })
    .map_err(|e| format!("building it failed (g++ is required; warnings are errors):\n{e}"))?;
    let library = dir.join("libcuda.so");
    let before = [
        "-shared",
        "-pthread",
        "-fsanitize=undefined",
        "-Wl,-soname,libcuda.so",
        "-Wl,--no-undefined",
    ];
    link(&before, &objects, &[], &library, "linking it failed")?;
    for object in objects {
        let _ = std::fs::remove_file(object);
    }
    Ok(library)
}

impl Emulation {
    /// The library's path (`<dir>/libcuda.so`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn symbol<T>(&self, name: &[u8]) -> Symbol<T> {
        // SAFETY: every name looked up here is an entry point of extension.cpp or
        // collectives.cpp, and `T` is its exact C signature.
        unsafe { self.library.get(name) }.unwrap_or_else(|e| panic!("emulation symbol: {e}"))
    }

    /// Takes (removes) the faults the emulation reported for `device` (all when negative), one
    /// per line; empty when there are none.
    pub fn take_faults(&self, device: i32) -> String {
        let take =
            self.symbol::<unsafe extern "C" fn(c_int) -> *mut c_char>(b"sdp4bit_emu_take_faults\0");
        let free = self.symbol::<unsafe extern "C" fn(*mut c_char)>(b"sdp4bit_emu_free\0");
        // SAFETY: the function returns NULL or a NUL-terminated string the caller frees with
        // sdp4bit_emu_free, done here once it is copied.
        unsafe {
            let text = take(device);
            if text.is_null() {
                return String::new();
            }
            let taken = CStr::from_ptr(text).to_string_lossy().into_owned();
            free(text);
            taken
        }
    }

    /// Takes (clears) the calls of the calling thread that blocked it until device work had
    /// run since it last took them: stream, context and event synchronisations, synchronous
    /// copies (every copy into host memory, which is pageable), memsets and frees, one name
    /// per call.
    pub fn take_host_syncs(&self) -> Vec<String> {
        let take =
            self.symbol::<unsafe extern "C" fn() -> *mut c_char>(b"sdp4bit_emu_take_host_syncs\0");
        let free = self.symbol::<unsafe extern "C" fn(*mut c_char)>(b"sdp4bit_emu_free\0");
        // SAFETY: the function returns NULL or a NUL-terminated string the caller frees with
        // sdp4bit_emu_free, done here once it is copied.
        unsafe {
            let text = take();
            if text.is_null() {
                return Vec::new();
            }
            let taken = CStr::from_ptr(text).to_string_lossy().into_owned();
            free(text);
            taken.lines().map(str::to_owned).collect()
        }
    }

    /// Operations of `kind` ("kernel", "copy", "memset", "collective", ...) completed so far.
    pub fn completed(&self, kind: &CStr) -> u64 {
        let completed =
            self.symbol::<unsafe extern "C" fn(*const c_char) -> u64>(b"sdp4bit_emu_completed\0");
        // SAFETY: `kind` is a NUL-terminated string that outlives the call.
        unsafe { completed(kind.as_ptr()) }
    }

    /// Injects a kernel fault: every later launch of `kernel` flips the bits `mask` of byte
    /// `byte` of its output; `None` removes it (see extension.cpp).
    pub fn corrupt_kernel_output(&self, kernel: Option<&CStr>, byte: u64, mask: u8) {
        let corrupt = self.symbol::<unsafe extern "C" fn(*const c_char, u64, u8)>(
            b"sdp4bit_emu_corrupt_kernel_output\0",
        );
        // SAFETY: `kernel` is NULL or a NUL-terminated string that outlives the call.
        unsafe { corrupt(kernel.map_or(std::ptr::null(), CStr::as_ptr), byte, mask) }
    }

    /// Makes `cuStreamIsCapturing` report a CUDA graph being captured on `stream` (or no
    /// longer); panics for a stream that is not live.
    pub fn set_capturing(&self, stream: *mut c_void, capturing: bool) {
        let set = self.symbol::<unsafe extern "C" fn(*mut c_void, c_int) -> c_int>(
            b"sdp4bit_emu_set_capturing\0",
        );
        // SAFETY: the emulation checks that `stream` is live before touching it.
        let status = unsafe { set(stream, c_int::from(capturing)) };
        assert_eq!(
            status, 0,
            "sdp4bit_emu_set_capturing: {stream:?} is not a live stream"
        );
    }

    /// A new communicator of `size` ranks (see collectives.cpp).
    pub fn comm_create(&self, size: usize) -> *mut c_void {
        let create =
            self.symbol::<unsafe extern "C" fn(c_int) -> *mut c_void>(b"sdp4bit_emu_comm_create\0");
        let size = c_int::try_from(size).expect("communicator size");
        // SAFETY: plain value arguments; the result is an opaque handle or NULL.
        let comm = unsafe { create(size) };
        assert!(!comm.is_null(), "sdp4bit_emu_comm_create({size})");
        comm
    }

    /// Enqueues one rank's part of a collective (see collectives.cpp); the CUresult as an int.
    ///
    /// # Safety
    /// `comm` comes from [`Emulation::comm_create`]; `stream` is a live stream of the current
    /// context; the buffers are device memory of its device (the driver checks).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn comm_enqueue(
        &self,
        comm: *mut c_void,
        rank: usize,
        kind: i32,
        dtype: i32,
        send: (u64, usize),
        recv: (u64, usize),
        stream: *mut c_void,
    ) -> i32 {
        type Enqueue = unsafe extern "C" fn(
            *mut c_void,
            c_int,
            c_int,
            c_int,
            u64,
            usize,
            u64,
            usize,
            *mut c_void,
        ) -> c_int;
        let enqueue = self.symbol::<Enqueue>(b"sdp4bit_emu_comm_enqueue\0");
        let rank = c_int::try_from(rank).expect("rank");
        // SAFETY: per this function's contract.
        unsafe {
            enqueue(
                comm, rank, kind, dtype, send.0, send.1, recv.0, recv.1, stream,
            )
        }
    }
}
