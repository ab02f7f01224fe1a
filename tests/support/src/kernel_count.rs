//! Dynamic warp-instruction counts of one compiled kernel entry point: the code that runs,
//! counted per work unit and per warp.
//!
//! A kernel is a translation unit (its text and name, as NVRTC compiles it, including files of
//! a kernel directory) and an entry point. [`compile`] builds the unit as the backend does
//! (NVRTC for sm_90, `--fmad=false --prec-div=true --ftz=false --std=c++17 -default-device`,
//! `ptxas -v`) and once more with `-lineinfo` (`ptxas -lineinfo`, `nvdisasm -c -gi`), cached;
//! [`CompiledUnit::entry`] checks that both hold the same code for an entry point. [`count`]
//! runs one emulator case of that kernel twice on the coverage emulator
//! ([`crate::host_coverage`]), with a grid of one unit per warp and with one block over the
//! same units; maps each run's line counts onto the SASS ([`crate::dynamic_count`])
//! and splits every instruction's executions into a part per warp (the code before and after
//! the grid-stride loop) and a part per unit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::cache_entry::{private_dir, write_entry};
use crate::digest::Digest;
use crate::dynamic_count::{
    Executions, LoopIndex, Unattributed, split_per_warp_and_unit, warp_executions,
};
use crate::emulator_case::EmulatorCase;
use crate::host_coverage::CoverageEmulator;
use crate::kernel_resources::{CudaTools, KernelResources, Usage, count_sass, parse_ptxas_report};
use crate::sass::Listing;
use crate::source_loops::source_loops;

/// A kernel translation unit as NVRTC compiles it.
#[derive(Debug, Clone)]
pub struct KernelUnit {
    /// The directory its `#include`s are found in.
    pub dir: PathBuf,
    /// Its file name (NVRTC's program name, which the line information gives).
    pub name: String,
    /// Its text.
    pub text: String,
}

/// A compiled translation unit: its SASS listings and ptxas's report, and the sources its
/// frames may name with their loops.
#[derive(Debug, Clone)]
pub struct CompiledUnit {
    /// `nvdisasm -c -gi` of the `-lineinfo` build.
    lined: String,
    /// `nvdisasm -c` of the build without line information.
    plain: String,
    /// `ptxas -v` of that build.
    report: String,
    /// Every source file by base name: the unit and the files of its directory.
    pub sources: HashMap<String, String>,
    /// The loops of every source.
    pub loops: LoopIndex,
}

/// One entry point of a compiled unit: its SASS with line information and its resources.
#[derive(Debug, Clone)]
pub struct Entry {
    pub listing: Listing,
    /// ptxas's report (the build without line information).
    pub usage: Usage,
}

/// Compiles `unit` as the backend does (and once more with line information) in a directory of its own in `scratch`,
/// or takes the listings and report of an earlier compilation of the same sources with the
/// same tools from `cache`.
pub fn compile(
    tools: &CudaTools,
    unit: &KernelUnit,
    scratch: &Path,
    cache: &Path,
) -> Result<CompiledUnit, String> {
    let mut sources = HashMap::from([(unit.name.clone(), unit.text.clone())]);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&unit.dir)
        .map_err(|e| format!("{}: {e}", unit.dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            path.is_file() && [".cu", ".cuh", ".h"].iter().any(|x| name.ends_with(x))
        })
        .collect();
    files.sort();
    let mut digest = Digest::default();
    digest.add(unit.name.as_bytes()).add(unit.text.as_bytes());
    digest.add(tools.ptxas_version()?.as_bytes());
    for path in &files {
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        digest.add(name.as_bytes()).add(text.as_bytes());
        sources.entry(name).or_insert(text);
    }
    let entry = cache.join(format!("nvrtc-{}", digest.hex()));
    let read = |name: &str| std::fs::read_to_string(entry.join(name));
    let (lined, plain, report) = match (read("lined.sass"), read("plain.sass"), read("ptxas.txt")) {
        (Ok(lined), Ok(plain), Ok(report)) => (lined, plain, report),
        _ => {
            let stem = unit.name.trim_end_matches(".cu");
            let work = private_dir(scratch, "nvrtc-")?;
            let (report, plain) =
                tools.report_and_listing(stem, &nvrtc(unit, false)?, work.path())?;
            let lined =
                tools.disassemble_with_lines(&unit.name, &nvrtc(unit, true)?, work.path())?;
            write_entry(
                &entry,
                &[
                    ("lined.sass", &lined),
                    ("plain.sass", &plain),
                    ("ptxas.txt", &report),
                ],
            )?;
            (lined, plain, report)
        }
    };
    let mut loops = LoopIndex::new();
    for (name, text) in &sources {
        loops.insert(
            name.clone(),
            source_loops(text).map_err(|e| format!("{name}: {e}"))?,
        );
    }
    Ok(CompiledUnit {
        lined,
        plain,
        report,
        sources,
        loops,
    })
}

impl CompiledUnit {
    /// The resources of every entry point (the build without line information).
    pub fn resources(&self) -> Result<Vec<KernelResources>, String> {
        let counts = count_sass(&self.plain);
        parse_ptxas_report(&self.report)?
            .into_iter()
            .map(|(name, usage)| {
                let sass = counts
                    .get(&name)
                    .cloned()
                    .ok_or_else(|| format!("no SASS of {name}"))?;
                Ok(KernelResources { name, usage, sass })
            })
            .collect()
    }

    /// The code of the entry point `name` in the build without line information (the one
    /// ptxas reported on).
    pub fn plain_listing(&self, name: &str) -> Result<Listing, String> {
        Listing::of_entry(&self.plain, name)
    }

    /// The entry point `name`; an error unless the builds with and without line information
    /// hold the same code for it.
    pub fn entry(&self, name: &str) -> Result<Entry, String> {
        let usage = parse_ptxas_report(&self.report)?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, usage)| usage)
            .ok_or_else(|| format!("ptxas reports no entry point {name}"))?;
        let listing = Listing::of_entry(&self.lined, name)?;
        let plain = Listing::of_entry(&self.plain, name)?;
        let opcodes = |l: &Listing| {
            l.instructions
                .iter()
                .map(|i| i.opcode.clone())
                .collect::<Vec<_>>()
        };
        if opcodes(&plain) != opcodes(&listing) {
            return Err(format!(
                "{name}: the -lineinfo build is not the same code ({} and {} instructions)",
                listing.instructions.len(),
                plain.instructions.len()
            ));
        }
        Ok(Entry { listing, usage })
    }
}

/// NVRTC's PTX of `unit` for sm_90 with the backend's options (and `-lineinfo`).
fn nvrtc(unit: &KernelUnit, line_info: bool) -> Result<String, String> {
    let mut options = vec!["--std=c++17".to_owned(), "-default-device".to_owned()];
    if line_info {
        options.push("-lineinfo".to_owned());
    }
    let options = cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        fmad: Some(false),
        options,
        include_paths: vec![unit.dir.display().to_string()],
        arch: Some("sm_90"),
        name: Some(unit.name.clone()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(&unit.text, options)
        .map(|ptx| ptx.to_src())
        .map_err(|e| format!("NVRTC ({}): {e:?}", unit.name))
}

/// Issues of every instruction of a compiled entry point per warp of the launch and per work
/// unit, and the estimates through each instruction's own line per unit (see
/// [`Executions`]).
#[derive(Debug, Clone)]
pub struct DynamicCount {
    pub per_warp: Vec<f64>,
    pub per_unit: Vec<f64>,
    pub per_unit_by_line: Vec<f64>,
    /// What the two runs could not attribute (the larger of the two).
    pub unattributed: Unattributed,
    /// The output file of the run with one unit per warp.
    pub output: Vec<u8>,
}

impl DynamicCount {
    /// Warp instructions of one unit.
    pub fn unit_instructions(&self) -> f64 {
        self.per_unit.iter().sum()
    }

    /// Warp instructions of one warp outside its units.
    pub fn warp_instructions(&self) -> f64 {
        self.per_warp.iter().sum()
    }

    /// Warp instructions of a launch of `warps` warps over `units` units.
    pub fn call_instructions(&self, units: f64, warps: f64) -> f64 {
        units * self.unit_instructions() + warps * self.warp_instructions()
    }
}

/// Counts `entry` of `unit` on `case`, whose single launch of the entry point covers `units`
/// work units (a multiple of the warps of its blocks; the launch's grid is replaced). The two
/// runs happen in `scratch`.
pub fn count(
    unit: &CompiledUnit,
    entry: &Entry,
    emulator: &CoverageEmulator,
    case: &EmulatorCase,
    units: u64,
    scratch: &Path,
) -> Result<DynamicCount, String> {
    let per_block = match case.launches.as_slice() {
        [launch] if launch.threads >= 32 && launch.threads.is_multiple_of(32) => {
            u64::from(launch.threads / 32)
        }
        _ => return Err("a counting case has one launch of whole warps".into()),
    };
    if units == 0 || !units.is_multiple_of(per_block) {
        return Err(format!(
            "a counting case covers a multiple of its blocks' {per_block} warps in work units, \
             not {units}"
        ));
    }
    let grids = [units / per_block, 1];
    let encoded = grids
        .iter()
        .map(|&grid| {
            let mut regridded = case.clone();
            regridded.launches[0].grid = u32::try_from(grid).map_err(|e| e.to_string())?;
            regridded.encode()
        })
        .collect::<Result<Vec<_>, String>>()?;
    let runs: Vec<Result<(Executions, Vec<u8>), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = encoded
            .iter()
            .map(|file| {
                s.spawn(move || {
                    let (coverage, output) = emulator.run(file, scratch)?;
                    let coverage = coverage.with_lambda_spans(&unit.sources);
                    Ok((
                        warp_executions(&entry.listing, &coverage, &unit.loops)?,
                        output,
                    ))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a counting run panicked".into()))
            })
            .collect()
    });
    let mut runs = runs.into_iter();
    let (a, output) = runs.next().expect("two runs")?;
    let (b, _) = runs.next().expect("two runs")?;
    let warps = grids.map(|g| (g * per_block) as f64);
    let (per_warp, per_unit) =
        split_per_warp_and_unit([&a.issued, &b.issued], warps, units as f64)?;
    let (_, per_unit_by_line) =
        split_per_warp_and_unit([&a.by_line, &b.by_line], warps, units as f64)?;
    Ok(DynamicCount {
        per_warp,
        per_unit,
        per_unit_by_line,
        unattributed: Unattributed {
            without_frames: a
                .unattributed
                .without_frames
                .max(b.unattributed.without_frames),
            outside_functions: a
                .unattributed
                .outside_functions
                .max(b.unattributed.outside_functions),
        },
        output,
    })
}
