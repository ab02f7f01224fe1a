//! Host builds of the CUDA kernels with g++: the kernel emulator (`tests/cuda_emulated/`) and
//! the CUDA driver emulation (`tests/cuda_driver_emulation/`) compile `kernels/*.cu` and their
//! own C++ as one object per source, all sources at once.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The g++ flags every host build of the kernels starts with: C++20, no fused multiply-add
/// (`-ffp-contract=off`, as NVRTC's `--fmad=false`), no fast-math, warnings as errors, and
/// CUDA's `#pragma unroll` (meaningless to g++) not warned about. Callers add the optimisation
/// level and their own flags.
pub const KERNEL_HOST_FLAGS: [&str; 7] = [
    "-std=c++20",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unknown-pragmas",
];

/// Compiles every source in parallel, as C++, into `dir` (object `i` of `sources[i]`), with
/// `flags(source)` before the source; returns the objects in the order of `sources`. The error
/// names g++ when it cannot start, and otherwise holds the compiler's output for every source
/// that failed.
pub fn compile_in_parallel(
    sources: &[PathBuf],
    dir: &Path,
    flags: impl Fn(&Path) -> Vec<OsString>,
) -> Result<Vec<PathBuf>, String> {
    let mut compiles = Vec::new();
    for (i, source) in sources.iter().enumerate() {
        let stem = source.file_stem().unwrap_or_default().to_string_lossy();
        let object = dir.join(format!("{i}-{stem}.o"));
        let child = Command::new("g++")
            .args(flags(source))
            .args(["-x", "c++", "-c"])
            .arg(source)
            .arg("-o")
            .arg(&object)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start g++: {e}"))?;
        compiles.push((source, object, child));
    }
    let mut objects = Vec::new();
    let mut errors = String::new();
    for (source, object, child) in compiles {
        let out = child
            .wait_with_output()
            .map_err(|e| format!("wait for g++: {e}"))?;
        if !out.status.success() {
            errors += &format!(
                "g++ failed on {}:\n{}{}\n",
                source.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        objects.push(object);
    }
    if errors.is_empty() {
        Ok(objects)
    } else {
        Err(errors)
    }
}
