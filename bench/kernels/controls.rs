//! Controls of the count, which must agree with a static count of the same code:
//!
//! - a kernel whose work unit has no run-time loop and no branch besides its cold paths
//!   (`global_quantize_i8`): its count per unit against the instructions of its grid-stride
//!   loop outside cold blocks;
//! - builds specialised to a row's configuration (the kernel compiled once more as a device
//!   function called by a wrapper that sets the configuration as constants, so the compiler
//!   folds every configuration branch and unrolls every loop of a unit): the same run's counts
//!   mapped onto that code, against its loop body outside cold blocks. They also show what the
//!   specialisation alone saves.
//!
//! The specialised builds are also counted by their structure
//! (`sdp4bit_test_support::specialised_count`), which must agree with the static count where
//! the line mapping falls short for the copies the compiler deleted.
//!
//! The current build's controls ([`current`]): each row's structural count against the line
//! mapping of the same runs, with the blocks where they differ, and against the static count
//! of its unit.
//!
//! Cold blocks are the blocks of `kernels/` opened by a `// Cold path` comment, which valid,
//! aligned data never enters; an instruction is cold when one of its frames lies in one.

use std::collections::HashMap;
use std::path::Path;

use sdp4bit_test_support::kernel_count::{KernelUnit, compile, count};
use sdp4bit_test_support::kernel_resources::CudaTools;
use sdp4bit_test_support::sass::Listing;
use sdp4bit_test_support::specialised_count::{cold_index, is_cold, structural};

use crate::analysis::{Build, Counted};
use crate::breakdown::by_category;
use crate::current::Current;
use crate::h100_rows::Specialisation;

/// One control: the dynamic count per unit against the static one.
pub struct Control {
    /// What is counted.
    pub what: String,
    /// The dynamic count per unit (the mapping of the row's runs).
    pub dynamic: f64,
    /// The static count: the loop body's instructions outside cold blocks that a warp whose
    /// lanes agree reaches; `None` when the loop holds another loop.
    pub static_count: Option<f64>,
    /// The structural count per unit of the loop outside cold blocks (specialised builds).
    pub structural: Option<f64>,
    /// The production build's dynamic count per unit for the same row.
    pub production: f64,
}

/// The rows whose specialised builds are controls: (6a) keeps every copy of its unrolled
/// loops; (1) and (3) show what the count misses where the compiler deletes copies (their
/// groups of 128 leave a lane's second run past the group, a constant once specialised).
const SPECIALISED: [&str; 3] = ["(1) ", "(3) ", "(6a) "];

/// The name of every specialised wrapper's entry point.
const WRAPPER: &str = "specialised";

/// Runs every control.
pub fn run(
    tools: &CudaTools,
    build: &Build,
    rows: &[Counted],
    scratch: &Path,
) -> Result<Vec<Control>, String> {
    let row = |prefix: &str| {
        rows.iter()
            .find(|r| r.row.label.starts_with(prefix))
            .ok_or_else(|| format!("no row {prefix}"))
    };
    let mut out = Vec::new();
    let plain = row("(8b) ")?;
    let unit = build.unit(plain.row.file)?;
    out.push(Control {
        what: format!(
            "`{}` (production: no run-time loop or branch in a unit but cold paths)",
            plain.row.kernel
        ),
        dynamic: in_loop(&plain.entry.listing, &plain.count.per_unit)?,
        static_count: Some(static_loop_body(&plain.entry.listing, &unit.sources)?),
        structural: None,
        production: plain.count.unit_instructions(),
    });
    for tag in SPECIALISED {
        let counted = row(tag)?;
        let case = counted.row.counting_case(&counted.shape)?;
        let specialisation = case
            .specialisation
            .as_ref()
            .ok_or_else(|| format!("row {tag} has no specialisation"))?;
        let text = wrapper(specialisation, counted.row.file, counted.row.kernel);
        let unit = compile(
            tools,
            &KernelUnit {
                dir: build.kernels.clone(),
                name: format!("{WRAPPER}.cu"),
                text,
            },
            scratch,
            &build.cache,
        )?;
        let entry = unit.entry(WRAPPER)?;
        let dynamic = count(
            &unit,
            &entry,
            &build.emulator,
            &case.case,
            case.units,
            scratch,
        )?;
        let by_structure = structural(&entry.listing, &dynamic, &cold_index(&unit.sources))?;
        out.push(Control {
            what: format!(
                "`{}` of row {} specialised to its configuration",
                counted.row.kernel, counted.row.label
            ),
            dynamic: in_loop(&entry.listing, &dynamic.per_unit)?,
            static_count: static_loop_body(&entry.listing, &unit.sources).ok(),
            structural: Some(by_structure.hot_loop().0),
            production: counted.count.unit_instructions(),
        });
    }
    Ok(out)
}

/// The wrapper of `kernel` (of `file`) specialised by `s`: the kernel source included with its
/// entry points turned into device functions, then an entry point that sets the constants and
/// calls it.
fn wrapper(s: &Specialisation, file: &str, kernel: &str) -> String {
    let arguments: Vec<String> = (0..s.pointers.split(',').count())
        .map(|i| format!("p{i}"))
        .collect();
    format!(
        "#define __global__ __device__ __forceinline__\n#define __launch_bounds__(...)\n\
         #include \"{file}\"\n#undef __global__\n#undef __launch_bounds__\n\
         extern \"C\" __attribute__((global)) __attribute__((launch_bounds(256, {blocks}))) \
         void {WRAPPER}({pointers}, {params} a)\n{{\n    {constants}\n    {kernel}({arguments}, a);\n}}\n",
        blocks = s.min_blocks,
        pointers = s.pointers,
        params = s.params,
        constants = s.constants,
        arguments = arguments.join(", "),
    )
}

/// The instructions of the grid-stride loop of `listing`: its outermost kept loop.
fn grid_stride_loop(listing: &Listing) -> Result<std::ops::RangeInclusive<usize>, String> {
    let reachable = listing.reachable()?;
    let edges = listing.back_edges(&reachable)?;
    let &(to, from) = edges
        .iter()
        .min_by_key(|(_, target)| *target)
        .ok_or("no grid-stride loop")?;
    Ok(from..=to)
}

/// The executions per unit (`per_unit`, one per instruction) of the grid-stride loop's
/// instructions.
pub fn in_loop(listing: &Listing, per_unit: &[f64]) -> Result<f64, String> {
    Ok(per_unit[grid_stride_loop(listing)?].iter().sum())
}

/// The instructions of the grid-stride loop of `listing` that a warp whose lanes agree reaches
/// and that lie outside cold blocks; an error when the loop holds another loop.
pub fn static_loop_body(
    listing: &Listing,
    sources: &HashMap<String, String>,
) -> Result<f64, String> {
    let reachable = listing.reachable()?;
    let edges = listing.back_edges(&reachable)?;
    let (from, to) = grid_stride_loop(listing)?.into_inner();
    if edges
        .iter()
        .any(|&(b, t)| (b, t) != (to, from) && t >= from && b <= to)
    {
        return Err("the grid-stride loop holds another loop".into());
    }
    let cold = cold_index(sources);
    let hot = (from..=to)
        .filter(|&i| reachable[i] && !is_cold(&listing.instructions[i], &cold))
        .count();
    Ok(hot as f64)
}

/// A control of the current build's count of one row.
pub struct CurrentControl {
    pub label: &'static str,
    /// Warp instructions per unit by the line mapping and by the structure (the count).
    pub mapped: f64,
    pub structural: f64,
    /// The blocks the line mapping counts below their passes: their instructions, and the
    /// executions per unit it misses there.
    pub below: (usize, f64),
    /// The blocks it counts above them: their instructions, and the executions it adds.
    pub above: (usize, f64),
    /// What it counts per unit in blocks that run per warp (before or after the unit's loop)
    /// or in a kept loop that never runs: the structural count has none of it per unit.
    pub moved: f64,
    /// Structural minus line-mapped instructions per unit, by category
    /// (`crate::breakdown::CATEGORIES`).
    pub by_category: Vec<f64>,
    /// The unit's loop outside cold paths: structural count per unit, and the static count of
    /// its blocks (every one a warp whose lanes agree can reach, entered or not) where no kept
    /// inner loop runs.
    pub hot: f64,
    pub static_unit: Option<f64>,
    /// Per unit in cold paths and out-of-line subroutines (line-mapped in both counts).
    pub cold: f64,
}

/// The controls of the current build's rows.
pub fn current(build: &Current, rows: &[Counted]) -> Result<Vec<CurrentControl>, String> {
    rows.iter()
        .map(|r| {
            let (mapped, structure) = r
                .structure
                .as_ref()
                .ok_or_else(|| format!("{}: not counted by its structure", r.row.label))?;
            let unit = build.unit(&r.kernel)?;
            let mut below = (0, 0.0);
            let mut above = (0, 0.0);
            let mut moved = 0.0;
            for b in &structure.blocks {
                let n = b.instructions.len();
                let gap = (b.counted - b.mapped) * n as f64;
                if b.counted > b.mapped + 1e-6 {
                    below = (below.0 + n, below.1 + gap);
                } else if b.mapped > b.counted + 1e-6 && b.counted > 0.0 {
                    above = (above.0 + n, above.1 - gap);
                } else if b.mapped > b.counted + 1e-6 {
                    moved -= gap;
                }
            }
            let difference: Vec<f64> = structure
                .count
                .per_unit
                .iter()
                .zip(&mapped.per_unit)
                .map(|(s, m)| s - m)
                .collect();
            Ok(CurrentControl {
                label: r.row.label,
                mapped: mapped.unit_instructions(),
                structural: r.count.unit_instructions(),
                below,
                above,
                moved,
                by_category: by_category(&r.entry.listing, &difference, &unit.sources),
                hot: structure.hot_loop().0,
                static_unit: structure.static_unit(),
                cold: structure.cold(),
            })
        })
        .collect()
}
