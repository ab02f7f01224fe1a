//! The g++ build of the emulator, `tests/kernel_emulator/emulator.cpp`, once per test process
//! (every test that emulates kernels shares it); the kernels it runs come as host builds of their
//! specialisations that it loads (`sdp4bit_test_support::host_kernels`), so it exports what they
//! take from it (`-rdynamic`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use sdp4bit_test_support::gxx::{compile_in_parallel, kernel_host_flags, link};

/// g++ flags of every translation unit besides [`KERNEL_HOST_FLAGS`]. UBSan (linked too) stops
/// the emulator at undefined behaviour in a kernel: misaligned accesses (which work on x86 but
/// fault on a GPU), out-of-range shifts and float-to-int conversions, signed overflow.
const CXX_FLAGS: [&str; 4] = [
    "-O1",
    "-pthread",
    "-fsanitize=undefined,float-cast-overflow",
    "-fno-sanitize-recover=all",
];

/// The emulator's source directory, `tests/kernel_emulator/`.
fn harness_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kernel_emulator")
}

/// Fails the test unless g++ runs.
pub(crate) fn require_gxx() {
    match Command::new("g++").arg("--version").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!("`g++ --version` failed ({}); g++ is required", out.status),
        Err(e) => panic!(
            "g++ is required to build the CUDA kernel emulator ({e}); install it, or set \
             SDP4BIT_SKIP_EMULATOR=1 to skip this test"
        ),
    }
}

/// The emulator executable built from the kernels in `kernels` (its bytes, to be written
/// into each test's work directory), or the compiler's complaint. The first call builds it;
/// every later call in the process (the kernel directory must not change) waits for and
/// shares that build, failed or not, so the tests never compile twice.
pub(crate) fn emulator_executable(kernels: &Path) -> Result<&'static [u8], String> {
    static BUILT: OnceLock<(PathBuf, Result<Vec<u8>, String>)> = OnceLock::new();
    let (built_from, exe) = BUILT.get_or_init(|| (kernels.to_path_buf(), build_once(kernels)));
    assert_eq!(built_from, kernels, "one kernel directory per test process");
    exe.as_deref().map_err(Clone::clone)
}

/// Builds the emulator in a fresh temporary directory and returns the executable's bytes. The
/// directory is removed after a successful build and kept (and named) after a failed one.
fn build_once(kernels: &Path) -> Result<Vec<u8>, String> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!(
        "sdp4bit-emulator-build-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let exe = build(kernels, &dir)
        .and_then(|exe| std::fs::read(&exe).map_err(|e| format!("read {}: {e}", exe.display())));
    match exe {
        Ok(exe) => {
            let _ = std::fs::remove_dir_all(&dir);
            Ok(exe)
        }
        Err(e) => Err(format!("{e}\n(build directory kept: {})", dir.display())),
    }
}

/// Compiles the emulator with g++ against the kernel headers of `kernels` and links it into
/// `dir/emulator`; an error holds the compiler's output on any error or warning.
fn build(kernels: &Path, dir: &Path) -> Result<PathBuf, String> {
    let harness = harness_dir();
    let shim = harness.join("cuda_shim.h");
    let objects = compile_in_parallel(&[harness.join("emulator.cpp")], dir, |_| {
        kernel_host_flags(&CXX_FLAGS, &shim, &[kernels])
    })
    .map_err(|e| format!("building the kernel emulator failed (warnings are errors):\n{e}"))?;
    let exe = dir.join("emulator");
    let before = ["-pthread", "-fsanitize=undefined", "-rdynamic"];
    link(
        &before,
        &objects,
        &["-ldl"],
        &exe,
        "linking the kernel emulator failed (it needs g++'s UBSan runtime, libubsan)",
    )?;
    Ok(exe)
}
