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

/// The flags of one host build of the kernels: [`KERNEL_HOST_FLAGS`], then the build's `own`,
/// then `shim` (the CUDA stand-ins) included first and each of `include_dirs` on the path.
pub fn kernel_host_flags(own: &[&str], shim: &Path, include_dirs: &[&Path]) -> Vec<OsString> {
    let mut flags: Vec<OsString> = KERNEL_HOST_FLAGS
        .iter()
        .chain(own)
        .map(OsString::from)
        .collect();
    flags.extend(["-include".into(), shim.as_os_str().to_owned()]);
    for dir in include_dirs {
        flags.extend(["-I".into(), dir.as_os_str().to_owned()]);
    }
    flags
}

/// Links `objects` with g++ into `output`: `before` ahead of the objects, `after` behind them
/// (libraries). The error starts with `failure` and holds g++'s output.
pub fn link(
    before: &[&str],
    objects: &[PathBuf],
    after: &[&str],
    output: &Path,
    failure: &str,
) -> Result<(), String> {
    let out = Command::new("g++")
        .args(before)
        .args(objects)
        .args(after)
        .arg("-o")
        .arg(output)
        .output()
        .map_err(|e| format!("run g++ to link: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{failure}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

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
