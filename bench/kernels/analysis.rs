//! Counting the H100 rows: the kernels of c4b4d29 compiled as production compiled them, each
//! row's case run twice on the coverage emulator (its outputs checked against the CPU's), its
//! instructions per unit and per warp, their categories and the unit's round trips. The same
//! count of a row on another build ([`count_case`]) serves the current kernels
//! (`crate::current`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sdp4bit_test_support::host_coverage::{CoverageEmulator, EmulatorSources};
use sdp4bit_test_support::kernel_count::{
    CompiledUnit, DynamicCount, Entry, KernelUnit, compile, count,
};
use sdp4bit_test_support::kernel_resources::{CudaTools, Usage};
use sdp4bit_test_support::round_trips::{Wait, waits};
use sdp4bit_test_support::specialised_count::{StructuralCount, cold_index, structural};
use sdp4bit_test_support::timing_model::Call;

use crate::breakdown::by_category;
use crate::h100_rows::{BenchCall, CountingCase, H100Row, Shape};

/// The commit whose kernels ran on the H100 (unchanged since e9c1ddd, which it ran).
pub const H100_COMMIT: &str = "c4b4d29";

/// Resident warps and blocks of one sm_90 multiprocessor at most, and its registers.
const MAX_WARPS: u32 = 64;
const MAX_BLOCKS: u32 = 32;
const REGISTERS: u32 = 65536;

/// Warps resident on one multiprocessor for a kernel of `usage` in blocks of `per_block` warps:
/// whole blocks, as many as its registers allow (allocated per warp in units of 256).
pub fn resident_warps(usage: &Usage, per_block: u32) -> f64 {
    let per_warp = (usage.registers.max(1) * 32).div_ceil(256) * 256;
    let blocks = (REGISTERS / per_warp / per_block).min(MAX_BLOCKS);
    f64::from((blocks * per_block).min(MAX_WARPS / per_block * per_block))
}

/// The kernel translation units of a kernel directory (every `.cu`), compiled.
pub struct Build {
    pub kernels: PathBuf,
    /// The cache directory of the builds.
    pub cache: PathBuf,
    pub units: HashMap<String, CompiledUnit>,
    pub emulator: CoverageEmulator,
}

impl Build {
    /// Compiles every `.cu` of `dir/kernels` with NVRTC and the coverage emulator of them
    /// with `dir/tests/kernel_emulator`.
    pub fn of(tools: &CudaTools, dir: &Path, cache: &Path, scratch: &Path) -> Result<Self, String> {
        let kernels = dir.join("kernels");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&kernels)
            .map_err(|e| format!("{}: {e}", kernels.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "cu"))
            .collect();
        files.sort();
        let emulator = CoverageEmulator::build(
            &EmulatorSources {
                harness: dir.join("tests/kernel_emulator"),
                kernels: kernels.clone(),
                units: files.clone(),
            },
            cache,
        )?;
        let mut units = HashMap::new();
        for file in &files {
            let name = file
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let text =
                std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
            let unit = KernelUnit {
                dir: kernels.clone(),
                name: name.clone(),
                text,
            };
            units.insert(name, compile(tools, &unit, scratch, cache)?);
        }
        Ok(Self {
            kernels,
            cache: cache.to_path_buf(),
            units,
            emulator,
        })
    }

    /// The compiled unit of source `file`.
    pub fn unit(&self, file: &str) -> Result<&CompiledUnit, String> {
        self.units
            .get(file)
            .ok_or_else(|| format!("no compiled unit {file}"))
    }
}

/// One counted row.
pub struct Counted {
    pub row: H100Row,
    /// The entry point counted.
    pub kernel: String,
    /// How the build cuts the row into units and launches them.
    pub shape: Shape,
    pub bench: BenchCall,
    pub entry: Entry,
    /// The count the model takes: the line mapping (c4b4d29's build), or the structural count
    /// of a specialised build (`structure`).
    pub count: DynamicCount,
    /// A specialised build's line-mapped count and its structural count, which `count` is.
    pub structure: Option<(DynamicCount, StructuralCount)>,
    /// Warp instructions per unit by category (`crate::breakdown::CATEGORIES`).
    pub categories: Vec<f64>,
    /// The waits of one unit for its loads.
    pub waits: Vec<Wait>,
    /// Units of the counting case.
    pub case_units: u64,
}

impl Counted {
    /// Dependent round trips of one unit.
    pub fn round_trips(&self) -> f64 {
        self.waits.iter().map(|w| w.per_unit).sum()
    }

    /// Resident warps per multiprocessor (the registers ptxas gives, the build's blocks).
    pub fn resident_warps(&self) -> f64 {
        resident_warps(&self.entry.usage, self.shape.warps_per_block() as u32)
    }

    /// Warp instructions of the benchmark's call.
    pub fn call_instructions(&self) -> f64 {
        self.count
            .call_instructions(self.bench.units, self.bench.warps)
    }

    /// The call as the timing model takes it.
    pub fn call(&self) -> Call {
        Call {
            bytes: self.bench.bytes,
            instructions: self.call_instructions(),
            units: self.bench.units,
            unit_instructions: self.count.unit_instructions(),
            unit_round_trips: self.round_trips(),
            resident_warps: self.resident_warps(),
            launched_warps: self.bench.warps,
        }
    }
}

/// Counts `row` on `build` (c4b4d29's kernels, the shape it launched them with): its case
/// run twice, its outputs checked against the CPU's.
pub fn count_row(build: &Build, row: &H100Row, scratch: &Path) -> Result<Counted, String> {
    let shape = row.h100_shape();
    let case = row.counting_case(&shape)?;
    count_case(
        build.unit(row.file)?,
        row.kernel,
        &build.emulator,
        row,
        &shape,
        &case,
        false,
        scratch,
    )
}

/// Counts the entry point `kernel` of `unit` on `row`'s counting case `case` (cut as `shape`
/// says, its launch naming the entry point) run twice on `emulator`, its outputs checked
/// against the CPU's; the row at the benchmark's size cut as `shape` says. A `specialised`
/// build's unit is counted by its structure (`sdp4bit_test_support::specialised_count`).
#[allow(clippy::too_many_arguments)]
pub fn count_case(
    unit: &CompiledUnit,
    kernel: &str,
    emulator: &CoverageEmulator,
    row: &H100Row,
    shape: &Shape,
    case: &CountingCase,
    specialised: bool,
    scratch: &Path,
) -> Result<Counted, String> {
    let entry = unit.entry(kernel)?;
    let mapped = count(unit, &entry, emulator, &case.case, case.units, scratch)?;
    let (counted, structure) = if specialised {
        let s = structural(&entry.listing, &mapped, &cold_index(&unit.sources))?;
        (s.count.clone(), Some((mapped, s)))
    } else {
        (mapped, None)
    };
    let outputs = case.case.outputs(&counted.output)?;
    for (i, (got, want)) in outputs.iter().zip(&case.expected).enumerate() {
        if got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "{}: the emulated {kernel} wrote other bytes than the CPU backend in output {i} \
                 (first at byte {at})",
                row.label
            ));
        }
    }
    // The line table sometimes names a header's line as the kernel file's, past that file's
    // end (ptxas 13.0 for a few stores of the current kernels): such instructions take their
    // block's count. Any other line outside the host build's functions is an error.
    let past_end = entry
        .listing
        .instructions
        .iter()
        .filter(|i| {
            i.frames.iter().any(|f| {
                unit.sources
                    .get(&f.file)
                    .is_some_and(|text| f.line as usize > text.lines().count())
            })
        })
        .count();
    let unattributed = counted.unattributed;
    if unattributed.outside_functions > past_end {
        return Err(format!(
            "{}: {} reachable instructions have lines outside every function of the host build",
            row.label, unattributed.outside_functions
        ));
    }
    let categories = by_category(&entry.listing, &counted.per_unit, &unit.sources);
    let waits = waits(&entry.listing, &counted.per_unit, &counted.per_unit_by_line);
    Ok(Counted {
        row: *row,
        kernel: kernel.to_owned(),
        shape: *shape,
        bench: row.bench_call(shape)?,
        entry,
        count: counted,
        structure,
        categories,
        waits,
        case_units: case.units,
    })
}
