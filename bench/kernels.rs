//! The model of the CUDA kernels' speed (`bench/results/kernels.md`, docs/kernel-model.md),
//! made without a GPU and checked against the H100's measurements.
//!
//! Run with `bash scripts/bench.sh kernels [--out FILE]` (it installs NVRTC, ptxas and
//! nvdisasm into `.cache/`, `scripts/env.sh`; g++ and gcov come with the system). For each of
//! the 13 kernel rows the H100 timed (`bench/gpu.rs`), the kernels that ran (those of
//! c4b4d29, from git) are compiled as production compiled them, and their dynamic warp
//! instructions per work unit and per warp are counted: a small case of the row's exact
//! configuration and data runs on the kernel emulator built with line coverage, and the line
//! counts are mapped onto the SASS (`sdp4bit_test_support::kernel_count`). With the row's
//! bytes, the unit's dependent round trips to memory (from the SASS) and the resident warps
//! (ptxas), a timing model (memory, issue and serial bounds; two constants fitted to the
//! rows) predicts each row; the report gives the predictions beside the measurements, the
//! leave-one-out errors, the controls of the count and the same predictions for an H200.
//!
//! The same rows are then counted on the current build (`kernels/current.rs`): the working
//! tree's kernels specialised to each row's configuration with the entry point and variant
//! production launches on sm_90, counted by the structure of their unrolled units
//! (`sdp4bit_test_support::specialised_count`) and predicted with the constants fitted to the
//! H100, beside issue 42's targets. Any row that cannot be computed fails the program.

#[path = "kernels/analysis.rs"]
mod analysis;
#[path = "kernels/breakdown.rs"]
mod breakdown;
mod common;
#[path = "kernels/controls.rs"]
mod controls;
#[path = "kernels/current.rs"]
mod current;
#[path = "kernels/current_report.rs"]
mod current_report;
#[path = "kernels/h100_rows.rs"]
mod h100_rows;
#[path = "kernels/report.rs"]
mod report;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use sdp4bit::backend::cuda::probe;
use sdp4bit_test_support::commit_sources::commit_sources;
use sdp4bit_test_support::kernel_resources::CudaTools;

use analysis::{Build, H100_COMMIT, count_row};

/// Everything the report is made of.
fn model(tools: &CudaTools, cache: &Path, scratch: &Path) -> Result<report::Inputs, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sources = commit_sources(
        root,
        H100_COMMIT,
        &["kernels", "tests/kernel_emulator"],
        cache,
    )?;
    let build = Build::of(tools, &sources, cache, scratch)?;
    let rows = std::thread::scope(|s| {
        let handles: Vec<_> = h100_rows::ROWS
            .iter()
            .map(|row| s.spawn(|| count_row(&build, row, scratch)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a row's count panicked".into()))
            })
            .collect::<Result<Vec<_>, String>>()
    })?;
    let controls = controls::run(tools, &build, &rows, scratch)?;
    let current = current::Current::of(tools, root, &h100_rows::ROWS, cache, scratch)?;
    let now = std::thread::scope(|s| {
        let handles: Vec<_> = current
            .rows
            .iter()
            .map(|(row, spec)| s.spawn(|| current::count_row(&current, row, spec, scratch)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a row's count panicked".into()))
            })
            .collect::<Result<Vec<_>, String>>()
    })?;
    let now_controls = controls::current(&current, &now)?;
    Ok(report::Inputs {
        ptxas: tools.ptxas_version()?,
        build,
        rows,
        controls,
        current,
        now,
        now_controls,
        targets: report::targets(root)?,
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let out = match args.as_slice() {
        [] => None,
        [flag, path] if flag == "--out" => Some(PathBuf::from(path)),
        _ => {
            eprintln!("usage: kernels [--out FILE]");
            return ExitCode::from(2);
        }
    };
    let tools = match probe::nvrtc()
        .map_err(|e| e.to_string())
        .and_then(|()| CudaTools::from_env())
    {
        Ok(tools) => tools,
        Err(e) => {
            eprintln!("kernels: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cache = Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/kernel-model");
    let scratch = std::env::temp_dir().join(format!("sdp4bit-kernel-model-{}", std::process::id()));
    let result = [&cache, &scratch]
        .iter()
        .try_for_each(|d| std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display())))
        .and_then(|()| model(&tools, &cache, &scratch))
        .and_then(|inputs| report::write(&inputs));
    let _ = std::fs::remove_dir_all(&scratch);
    match result {
        Ok(text) => {
            print!("{text}");
            if let Some(path) = out
                && let Err(e) = std::fs::write(&path, &text)
            {
                eprintln!("kernels: write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kernels: {e}");
            ExitCode::FAILURE
        }
    }
}
