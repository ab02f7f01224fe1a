//! The kernel emulator built with line coverage: the host translation units of the kernels and
//! the emulator's harness (`emulator.cpp`, `cuda_shim.h`), compiled with g++ as
//! `tests/cuda_emulated/emulator/compile.rs` builds them, but at `-O0` (no inlining, so every
//! call is counted where it is made, and lines keep their own counts), without UBSan's checks
//! (see [`FLAGS`]) and with `--coverage -fprofile-update=atomic`; and runs of single cases, each
//! with its own counts (`GCOV_PREFIX`).
//!
//! The units are linked into the emulator, whatever the harness: c4b4d29's dispatches to the
//! kernels it declares, the current one registers the entry points of host builds
//! (`host_kernels.h`, included from the harness directory) when they are loaded, which a unit
//! linked in does at start-up ([`crate::host_kernels::translation_unit`] writes such units).
//!
//! Builds are kept in a cache directory under a digest of everything that goes into them
//! (sources, headers, flags, the compiler's version).

use std::path::{Component, Path, PathBuf};
use std::process::Command;

use crate::cache_entry::{make_entry, private_dir};
use crate::digest::Digest;
use crate::gcov::Coverage;
use crate::gxx::{KERNEL_HOST_FLAGS, compile_in_parallel, kernel_host_flags, link};

/// g++ flags besides [`KERNEL_HOST_FLAGS`]: those of the emulator's test build at `-O0` for
/// `-O1`, without UBSan's checks (which split lines into blocks that gcov then counts more
/// than once: a lambda's line that reads captures runs twice by gcov's count), and with
/// coverage. The link still takes UBSan's runtime, which the harness calls.
const FLAGS: [&str; 4] = ["-O0", "-pthread", "--coverage", "-fprofile-update=atomic"];

/// What else the build does besides [`FLAGS`] (the include path of the harness, `-ldl` for
/// the harness that loads libraries), in the digest of a build.
const LINK_RECIPE: [&str; 2] = ["-I harness", "-ldl"];

/// What the emulator is built from.
#[derive(Debug, Clone)]
pub struct EmulatorSources {
    /// The harness directory: `emulator.cpp` and `cuda_shim.h` (force-included).
    pub harness: PathBuf,
    /// The include directory of the kernels (`-I`).
    pub kernels: PathBuf,
    /// The kernels' host translation units.
    pub units: Vec<PathBuf>,
}

/// A built coverage emulator.
#[derive(Debug, Clone)]
pub struct CoverageEmulator {
    /// The build directory: the executable and the `.gcno` files.
    dir: PathBuf,
}

impl CoverageEmulator {
    /// The emulator of `sources`, built into (or found in) `cache`.
    pub fn build(sources: &EmulatorSources, cache: &Path) -> Result<Self, String> {
        let dir = cache.join(format!("emulator-coverage-{}", digest(sources)?));
        if dir.join("emulator").is_file() {
            return Ok(Self { dir });
        }
        make_entry(&dir, |staging| build_into(sources, staging))?;
        if !dir.join("emulator").is_file() {
            return Err(format!("no emulator in {}", dir.display()));
        }
        Ok(Self { dir })
    }

    /// Runs the case file `case` in `scratch` (a fresh directory is made in it) and returns
    /// the run's counts and the output file.
    pub fn run(&self, case: &[u8], scratch: &Path) -> Result<(Coverage, Vec<u8>), String> {
        let run = private_dir(scratch, "coverage-run-")?;
        let (cases, data) = (run.path().join("cases"), run.path().join("data"));
        for d in [&cases, &data] {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        self.run_in(case, &cases, &data)
    }

    fn run_in(
        &self,
        case: &[u8],
        cases: &Path,
        data: &Path,
    ) -> Result<(Coverage, Vec<u8>), String> {
        std::fs::write(cases.join("run.case"), case).map_err(|e| format!("write case: {e}"))?;
        // The counts go to GCOV_PREFIX + the directory the object was compiled in (a sibling
        // of `self.dir`, renamed to it) less its first GCOV_PREFIX_STRIP components:
        // `data/<object>.gcda`.
        let strip = self
            .dir
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .count();
        let out = Command::new(self.dir.join("emulator"))
            .arg(cases)
            .arg("1")
            .env("GCOV_PREFIX", data)
            .env("GCOV_PREFIX_STRIP", strip.to_string())
            .output()
            .map_err(|e| format!("start the coverage emulator: {e}"))?;
        // libgcov reports a count file it cannot write on stderr and still exits with 0.
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() || stderr.contains("profiling:") {
            return Err(format!(
                "the coverage emulator failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                stderr
            ));
        }
        for entry in std::fs::read_dir(&self.dir).map_err(|e| e.to_string())? {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.extension().is_some_and(|x| x == "gcno") {
                let to = data.join(path.file_name().expect("a file name"));
                // Every object linked in writes its counts at exit, run or not.
                if !to.with_extension("gcda").is_file() {
                    return Err(format!(
                        "the coverage emulator wrote no {}",
                        to.with_extension("gcda").display()
                    ));
                }
                std::fs::copy(&path, &to).map_err(|e| format!("{}: {e}", to.display()))?;
            }
        }
        let output =
            std::fs::read(cases.join("run.out")).map_err(|e| format!("read output: {e}"))?;
        Ok((Coverage::of_run(data)?, output))
    }
}

/// Compiles and links the emulator into `dir`.
fn build_into(sources: &EmulatorSources, dir: &Path) -> Result<(), String> {
    let mut units = sources.units.clone();
    units.push(sources.harness.join("emulator.cpp"));
    let shim = sources.harness.join("cuda_shim.h");
    let objects = compile_in_parallel(&units, dir, |_| {
        kernel_host_flags(&FLAGS, &shim, &[&sources.kernels, &sources.harness])
    })
    .map_err(|e| format!("building the coverage emulator failed:\n{e}"))?;
    let before = ["-pthread", "-fsanitize=undefined", "--coverage"];
    link(
        &before,
        &objects,
        &["-ldl"],
        &dir.join("emulator"),
        "linking the coverage emulator failed",
    )
}

/// A digest of everything a build depends on: the flags, g++'s version, every file of the
/// harness and kernel directories and every unit (base names and contents, so that the same
/// sources in another directory share a build).
fn digest(sources: &EmulatorSources) -> Result<String, String> {
    let mut hash = Digest::default();
    for flag in KERNEL_HOST_FLAGS.iter().chain(&FLAGS).chain(&LINK_RECIPE) {
        hash.add(flag.as_bytes());
    }
    let version = Command::new("g++")
        .arg("--version")
        .output()
        .map_err(|e| format!("g++ is needed for the coverage emulator: {e}"))?;
    hash.add(&version.stdout);
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in [&sources.harness, &sources.kernels] {
        for entry in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.is_file() {
                files.push(path);
            }
        }
    }
    files.sort();
    files.extend(sources.units.iter().cloned());
    for file in &files {
        hash.add(file.file_name().unwrap_or_default().as_encoded_bytes());
        hash.add(&std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?);
    }
    Ok(hash.hex())
}
