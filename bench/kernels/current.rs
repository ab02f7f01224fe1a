//! The current build: the working tree's kernels, specialised to each row's configuration as
//! production launches them on an H100 (sm_90): the entry point `KernelSpec` writes for the
//! row's constants (derived from its parameter struct at the benchmark's size) with the variant
//! production takes there (sm_90's table, else the default), compiled as
//! `backend::cuda::compile` compiles it (checked against the CUBIN it makes), its work cut into
//! the variant's units and launched on the variant's grid. Each row's counting case is the
//! H100 build's configuration and data cut into those units, run on the coverage emulator of
//! the current harness with the host builds of the same entry points linked in.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use sdp4bit::backend::cuda::compile::compile_for;
use sdp4bit::backend::cuda::source::Kernel;
use sdp4bit::backend::cuda::variants::{default_variant, table_variant};
use sdp4bit::backend::cuda::{Arch, KernelSpec, Target};
use sdp4bit_test_support::cache_entry::write_entry;
use sdp4bit_test_support::digest::Digest;
use sdp4bit_test_support::host_coverage::{CoverageEmulator, EmulatorSources};
use sdp4bit_test_support::host_kernels::translation_unit;
use sdp4bit_test_support::kernel_count::{CompiledUnit, KernelUnit, compile};
use sdp4bit_test_support::kernel_resources::CudaTools;
use sdp4bit_test_support::sass::Listing;

use crate::analysis::{Counted, count_case};
use crate::h100_rows::{H100Row, Shape};

/// The specialised entry point production launches for `row` on an H100.
pub fn spec_of(row: &H100Row) -> Result<KernelSpec, String> {
    let kernel = Kernel::ALL
        .into_iter()
        .find(|k| k.name() == row.kernel)
        .ok_or_else(|| format!("{}: no kernel {} in the table", row.label, row.kernel))?;
    let constants = row.bench_constants()?;
    let variant = table_variant(Arch::SM_90, kernel, constants)
        .unwrap_or_else(|| default_variant(kernel, constants));
    KernelSpec::new(kernel, constants, variant).map_err(|e| format!("{}: {e}", row.label))
}

/// Whether the counted code is the code production launches: the SASS of the CUBIN
/// `backend::cuda::compile::compile_for` makes for the spec against the counted build's.
pub struct ProductionMatch {
    /// Instructions of the counted build's entry point.
    pub instructions: usize,
    /// Of them, those that differ from the production CUBIN's at the same place (opcode,
    /// guard or operands), plus any the two listings do not share.
    pub differing: usize,
}

/// The current kernels compiled and emulated for a set of rows.
pub struct Current {
    /// The kernel directory (the working tree's `kernels/`).
    pub kernels: PathBuf,
    /// Each row with the spec production launches for it.
    pub rows: Vec<(H100Row, KernelSpec)>,
    /// The compiled translation unit of each distinct spec, by entry point.
    pub units: HashMap<String, CompiledUnit>,
    /// Each spec's production CUBIN against the counted build, by entry point.
    pub production: BTreeMap<String, ProductionMatch>,
    pub emulator: CoverageEmulator,
}

impl Current {
    /// Compiles the specs of `rows` from the kernels and emulator harness of the working tree
    /// `root` (builds cached in `cache`, work in `scratch`).
    pub fn of(
        tools: &CudaTools,
        root: &Path,
        rows: &[H100Row],
        cache: &Path,
        scratch: &Path,
    ) -> Result<Self, String> {
        let kernels = root.join("kernels");
        let rows: Vec<(H100Row, KernelSpec)> = rows
            .iter()
            .map(|row| spec_of(row).map(|spec| (*row, spec)))
            .collect::<Result<_, _>>()?;
        let mut distinct: Vec<KernelSpec> = Vec::new();
        for (_, spec) in &rows {
            if !distinct.contains(spec) {
                distinct.push(*spec);
            }
        }
        let emulator = CoverageEmulator::build(
            &EmulatorSources {
                harness: root.join("tests/kernel_emulator"),
                kernels: kernels.clone(),
                units: host_units(&distinct, cache)?,
            },
            cache,
        )?;
        let compiled: Vec<Result<(String, CompiledUnit, ProductionMatch), String>> =
            std::thread::scope(|s| {
                let handles: Vec<_> = distinct
                    .iter()
                    .map(|spec| {
                        let kernels = &kernels;
                        s.spawn(move || {
                            let entry = spec.entry();
                            let unit = compile(
                                tools,
                                &KernelUnit {
                                    dir: kernels.clone(),
                                    name: entry.clone(),
                                    text: spec.source(),
                                },
                                scratch,
                                cache,
                            )?;
                            let production = production_match(spec, &unit, scratch)?;
                            Ok((entry, unit, production))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err("a compilation panicked".into()))
                    })
                    .collect()
            });
        let mut units = HashMap::new();
        let mut production = BTreeMap::new();
        for result in compiled {
            let (entry, unit, matched) = result?;
            units.insert(entry.clone(), unit);
            production.insert(entry, matched);
        }
        Ok(Self {
            kernels,
            rows,
            units,
            production,
            emulator,
        })
    }

    /// The compiled unit of the entry point `entry`.
    pub fn unit(&self, entry: &str) -> Result<&CompiledUnit, String> {
        self.units
            .get(entry)
            .ok_or_else(|| format!("no compiled unit of {entry}"))
    }
}

/// The host translation units of `specs` for the coverage emulator, one per kernel source
/// (`host_kernels::translation_unit`: the source, the specs' wrappers and their registration),
/// written once into a directory of `cache` named by their digest; their paths.
fn host_units(specs: &[KernelSpec], cache: &Path) -> Result<Vec<PathBuf>, String> {
    let mut by_file: BTreeMap<&str, Vec<KernelSpec>> = BTreeMap::new();
    for spec in specs {
        by_file.entry(spec.kernel.file()).or_default().push(*spec);
    }
    let texts: Vec<(String, String)> = by_file
        .iter()
        .map(|(file, specs)| {
            let stem = file.trim_end_matches(".cu");
            (format!("host-{stem}.cpp"), translation_unit(specs))
        })
        .collect();
    let mut digest = Digest::default();
    for (name, text) in &texts {
        digest.add(name.as_bytes()).add(text.as_bytes());
    }
    let dir = cache.join(format!("host-units-{}", digest.hex()));
    if !texts.iter().all(|(name, _)| dir.join(name).is_file()) {
        write_entry(&dir, &texts)?;
    }
    Ok(texts.iter().map(|(name, _)| dir.join(name)).collect())
}

/// The production CUBIN of `spec` (`compile_for` for sm_90, the backend's own NVRTC call)
/// disassembled and compared, instruction by instruction, with the counted build's code.
fn production_match(
    spec: &KernelSpec,
    unit: &CompiledUnit,
    scratch: &Path,
) -> Result<ProductionMatch, String> {
    let entry = spec.entry();
    let compiled = compile_for(spec, Target::Cubin(Arch::SM_90)).map_err(|e| e.to_string())?;
    let cubin = scratch.join(format!("{entry}-production.cubin"));
    std::fs::write(&cubin, &compiled.cubin).map_err(|e| format!("{}: {e}", cubin.display()))?;
    let nvdisasm = std::env::var_os("SDP4BIT_CUDA_BIN")
        .map(|dir| PathBuf::from(dir).join("nvdisasm"))
        .ok_or("SDP4BIT_CUDA_BIN is not set")?;
    let out = Command::new(&nvdisasm)
        .arg("-c")
        .arg(&cubin)
        .output()
        .map_err(|e| format!("start {}: {e}", nvdisasm.display()))?;
    let _ = std::fs::remove_file(&cubin);
    if !out.status.success() {
        return Err(format!(
            "nvdisasm of {entry}'s production CUBIN failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let production = Listing::of_entry(&String::from_utf8_lossy(&out.stdout), &entry)?;
    let counted = unit.plain_listing(&entry)?;
    let key = |l: &Listing| {
        l.instructions
            .iter()
            .map(|i| (i.guard.clone(), i.opcode.clone(), i.operands.clone()))
            .collect::<Vec<_>>()
    };
    let (a, b) = (key(&counted), key(&production));
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    Ok(ProductionMatch {
        instructions: a.len(),
        differing,
    })
}

/// Counts `row` on the current build with the spec production launches for it: the row's
/// counting case cut into the variant's units, launching the spec's entry point.
pub fn count_row(
    current: &Current,
    row: &H100Row,
    spec: &KernelSpec,
    scratch: &Path,
) -> Result<Counted, String> {
    let shape = Shape::of_variant(&spec.variant);
    let mut case = row.counting_case(&shape)?;
    if case.constants != spec.constants {
        return Err(format!(
            "{}: the counting case's constants {:?} are not the benchmark's {:?}",
            row.label, case.constants, spec.constants
        ));
    }
    let entry = spec.entry();
    case.case.launches[0].kernel = entry.clone();
    count_case(
        current.unit(&entry)?,
        &entry,
        &current.emulator,
        row,
        &shape,
        &case,
        true,
        scratch,
    )
}
