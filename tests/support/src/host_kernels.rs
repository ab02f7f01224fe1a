//! Host builds of specialised kernels for both CUDA emulations: g++ compiles the entry points
//! the product writes ([`KernelSpec::wrapper`], the same text NVRTC compiles) with the kernel
//! sources against `tests/kernel_emulator/cuda_shim.h` into a shared library that registers them
//! with the emulator that loads it (`tests/kernel_emulator/host_kernels.h`).
//!
//! - [`build`]: one library holding a set of specs (the kernel emulator's cases of one family);
//! - [`install_emulation_builder`]: hands the emulated CUDA driver a builder it calls for an
//!   entry point it has no host build of (a CUBIN the backend compiled for a spec at first use),
//!   which builds that spec alone, cached on disk by its source so that later processes (child
//!   test processes, later runs) load it without compiling.

use std::collections::BTreeSet;
use std::ffi::{CStr, c_char, c_int};
use std::fmt::Write as _;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sdp4bit::backend::cuda::KernelSpec;
use sdp4bit::backend::cuda::source::{HEADERS, SOURCES};

use crate::gxx::{compile_in_parallel, kernel_host_flags, link};

/// g++ flags of a host build besides [`KERNEL_HOST_FLAGS`]: position-independent, and UBSan,
/// which stops the emulator at undefined behaviour in a kernel (misaligned accesses, which work
/// on x86 but fault on a GPU, out-of-range shifts and float-to-int conversions, signed
/// overflow).
const CXX_FLAGS: [&str; 5] = [
    "-O1",
    "-pthread",
    "-fPIC",
    "-fsanitize=undefined,float-cast-overflow",
    "-fno-sanitize-recover=all",
];

/// Entry points per translation unit of a library (the units compile in parallel).
const SPECS_PER_UNIT: usize = 6;

/// The emulator's sources, `tests/kernel_emulator/`.
pub fn emulator_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernel_emulator")
}

/// The kernel sources, `kernels/`.
pub fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels")
}

/// One translation unit of a host build: the registration header, each kernel source the specs
/// need once, their wrappers and the list that registers them.
pub fn translation_unit(specs: &[KernelSpec]) -> String {
    let mut unit = String::from("#include \"host_kernels.h\"\n");
    let files: BTreeSet<&str> = specs.iter().map(|s| s.kernel.file()).collect();
    for file in files {
        let _ = writeln!(unit, "#include \"{file}\"");
    }
    for spec in specs {
        unit.push('\n');
        unit.push_str(&spec.wrapper());
    }
    unit.push_str("\nSDP_HOST_KERNELS(\n");
    for spec in specs {
        let _ = writeln!(
            unit,
            "    SDP_HOST_KERNEL({}, {})",
            spec.entry(),
            spec.kernel.params()
        );
    }
    unit.push_str(")\n");
    unit
}

/// Builds the library `dir/NAME.so` of `specs` (each once) from the kernel sources in `kernels`;
/// returns its path, or the compiler's output.
pub fn build(
    specs: &[KernelSpec],
    kernels: &Path,
    dir: &Path,
    name: &str,
) -> Result<PathBuf, String> {
    let mut unique: Vec<KernelSpec> = Vec::new();
    for spec in specs {
        if !unique.iter().any(|u| u.entry() == spec.entry()) {
            unique.push(*spec);
        }
    }
    let mut sources = Vec::new();
    for (i, chunk) in unique.chunks(SPECS_PER_UNIT).enumerate() {
        let path = dir.join(format!("{name}-{i}.cpp"));
        std::fs::write(&path, translation_unit(chunk))
            .map_err(|e| format!("write {}: {e}", path.display()))?;
        sources.push(path);
    }
    let shim = emulator_dir().join("cuda_shim.h");
    let emulator = emulator_dir();
    let objects = compile_in_parallel(&sources, dir, |_| {
        kernel_host_flags(&CXX_FLAGS, &shim, &[kernels, &emulator])
    })
    .map_err(|e| format!("building the host kernels failed (warnings are errors):\n{e}"))?;
    let library = dir.join(format!("{name}.so"));
    let before = ["-shared", "-pthread", "-fsanitize=undefined"];
    link(
        &before,
        &objects,
        &[],
        &library,
        "linking the host kernels failed",
    )?;
    Ok(library)
}

/// The library of `spec` alone, built into `cache` unless a build of the same sources is there
/// already (another process's).
fn cached_build(spec: &KernelSpec, cache: &Path) -> Result<PathBuf, String> {
    let mut hasher = DefaultHasher::new();
    translation_unit(&[*spec]).hash(&mut hasher);
    for (name, text) in HEADERS
        .iter()
        .copied()
        .chain(SOURCES.iter().map(|s| (s.file, s.code)))
    {
        (name, text).hash(&mut hasher);
    }
    for file in ["cuda_shim.h", "host_kernels.h"] {
        std::fs::read(emulator_dir().join(file))
            .map_err(|e| format!("read {file}: {e}"))?
            .hash(&mut hasher);
    }
    let name = format!("{}-{:016x}", spec.entry(), hasher.finish());
    let library = cache.join(format!("{name}.so"));
    if library.is_file() {
        return Ok(library);
    }
    // Built in a directory of its own and renamed into place, so a concurrent builder of the
    // same spec never loads half a library.
    let work = cache.join(format!(
        ".{name}.{}.{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&work).map_err(|e| format!("create {}: {e}", work.display()))?;
    let built = build(&[*spec], &kernels_dir(), &work, "kernel")?;
    std::fs::rename(&built, &library).map_err(|e| format!("place {}: {e}", library.display()))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(library)
}

/// Where [`install_emulation_builder`]'s builds go: `SDP4BIT_HOST_KERNEL_CACHE`, else a
/// directory of the system's temporary one, shared by the test processes of a machine.
fn cache_dir() -> &'static Path {
    static CACHE: OnceLock<PathBuf> = OnceLock::new();
    CACHE.get_or_init(|| {
        std::env::var_os("SDP4BIT_HOST_KERNEL_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("sdp4bit-host-kernels"))
    })
}

/// The builder the emulated driver calls: the library of the entry point `entry` into `path`
/// (NUL-terminated, at most `capacity` bytes); 0 on success, else 1 with the error in `path`.
extern "C" fn build_entry(entry: *const c_char, path: *mut c_char, capacity: usize) -> c_int {
    // SAFETY: the emulated driver passes a NUL-terminated name.
    let entry = unsafe { CStr::from_ptr(entry) }.to_string_lossy();
    let (status, text) = match KernelSpec::from_entry(&entry) {
        Some(spec) => match cached_build(&spec, cache_dir()) {
            Ok(library) => (0, library.to_string_lossy().into_owned()),
            Err(e) => (1, e),
        },
        None => (
            1,
            format!("{entry} is not an entry point a KernelSpec writes"),
        ),
    };
    let bytes = text.as_bytes();
    let n = bytes.len().min(capacity.saturating_sub(1));
    // SAFETY: the emulated driver passes a buffer of `capacity` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), path, n);
        *path.add(n) = 0;
    }
    status
}

/// The signature of the builder the emulated driver takes.
type Builder = extern "C" fn(*const c_char, *mut c_char, usize) -> c_int;

/// Hands the emulated CUDA driver, when the process has loaded it as `libcuda.so`, the builder
/// of the host builds of entry points it meets (cached as `cache_dir` says). Does nothing where
/// the driver is a real one (it has no such entry point) or none is loaded.
pub fn install_emulation_builder() {
    // RTLD_NOLOAD (glibc's value): a handle of the loaded libcuda.so, never a new load.
    const RTLD_NOLOAD: c_int = 4;
    // SAFETY: the library is already loaded (or this fails); nothing runs on this open.
    let Ok(driver) = (unsafe {
        libloading::os::unix::Library::open(
            Some("libcuda.so"),
            RTLD_NOLOAD | libloading::os::unix::RTLD_NOW,
        )
    }) else {
        return;
    };
    // SAFETY: the emulation's setter takes a builder of this signature (cuda_api.h).
    let setter = unsafe { driver.get::<extern "C" fn(Builder)>(b"sdp4bit_emu_set_host_builder\0") };
    if let Ok(setter) = setter {
        setter(build_entry);
    }
}
