//! The record of a device's tuned variants on disk ([`super::autotune`] writes it, a device's
//! kernels read it when they load), beside the kernel cache and keyed as its images are, so
//! that a restart and the node's other ranks do not tune again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::cache;
use super::compile::{Arch, Target};
use super::source::Kernel;
use super::spec::{Constants, KernelSpec, Variant};
use super::variants::in_table;

/// Whether a device of `arch` is tuned at set-up: its architecture is not in the table and
/// `SDP4BIT_KERNEL_AUTOTUNE` is not `0`.
pub fn enabled(arch: Arch) -> bool {
    let off = std::env::var("SDP4BIT_KERNEL_AUTOTUNE").is_ok_and(|v| v.trim() == "0");
    !off && !in_table(arch)
}

/// The file the tuned variants of the device named `device_name` are recorded in (compiled
/// for `target` by NVRTC `nvrtc` under driver `driver`), or `None` without a cache directory.
pub fn record_file(
    device_name: &str,
    target: Target,
    nvrtc: (u32, u32),
    driver: i32,
) -> Option<PathBuf> {
    let dir = cache::directory()?;
    let key = cache::key(
        &format!("tuned variants of {device_name}"),
        target,
        nvrtc,
        driver,
    );
    Some(dir.join(format!("{key}.variants")))
}

/// The variants recorded in `path`: one line per kernel and constants, `ENTRY GRID_BLOCKS`.
/// Lines that no spec writes are ignored (a file of another build).
pub fn read_record(path: &Path) -> HashMap<(Kernel, Constants), Variant> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let (entry, grid) = line.split_once(' ')?;
            let spec = KernelSpec::from_entry(entry)?;
            let variant = Variant {
                grid_blocks: grid.trim().parse().ok()?,
                ..spec.variant
            };
            variant.check(spec.constants).ok()?;
            Some(((spec.kernel, spec.constants), variant))
        })
        .collect()
}

/// Adds `spec` (with its grid cap) to the record at `path`: the file rewritten through a
/// temporary file renamed into place, under the cache's lock of the file, so concurrent ranks
/// keep each other's lines.
pub fn record(path: &Path, spec: &KernelSpec) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let _lock = cache::lock(dir, &name)?;
    let mut lines: Vec<String> = std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect();
    let entry = spec.entry();
    // Another line of the same kernel and constants (another rank's choice) gives way.
    let prefix = entry
        .rsplit_once("__")
        .map_or(entry.as_str(), |(head, _)| head);
    lines.retain(|l| !l.starts_with(&format!("{prefix}__")));
    let line = format!("{entry} {}", spec.variant.grid_blocks);
    lines.push(line);
    cache::write_atomically(dir, &name, (lines.join("\n") + "\n").as_bytes())
}
