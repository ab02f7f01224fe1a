//! The markdown report: the production build's resources, each row's dynamic counts and
//! their breakdown, the controls, the fitted timing model against the H100's rows with its
//! leave-one-out errors, the same predictions for an H200; then the current build's
//! specialised kernels counted and predicted by the same constants beside issue 42's targets,
//! with the controls of their count and the attribution of the changes; and the model's terms
//! per row of the current build in the table `scripts/gpu_kit.py` reads.

use std::fmt::Write as _;

use sdp4bit_test_support::timing_model::{
    Call, Constants, Gpu, Prediction, Search, fit, leave_one_out, predict,
};

use crate::analysis::{Build, Counted, H100_COMMIT};
use crate::breakdown::CATEGORIES;
use crate::controls::{Control, CurrentControl};
use crate::current::Current;
use crate::current_report::{
    changes, current_breakdown, current_build, current_controls, current_counts, predictions,
};

/// The H100 SXM the rows ran on: its copy moved 2958.9 to 2962.1 GB/s (read + written) in
/// the same runs (`bench/results/gpu/README.md`).
pub const H100: Gpu = Gpu {
    multiprocessors: 132.0,
    clock_hz: 1.98e9,
    issue_per_clock: 4.0,
    copy_bytes_per_s: 2960e9,
};

/// The H200 this workplace lends: the same processor; a device-to-device copy moved about
/// 4.3 TB/s read + written there (`/work/.library/device/KINDS.md`, 2026-10-28).
pub const H200: Gpu = Gpu {
    multiprocessors: 132.0,
    clock_hz: 1.98e9,
    issue_per_clock: 4.0,
    copy_bytes_per_s: 4.3e12,
};

/// The fitted constants' search: loaded latency 200 ns to 2 us, 1 to 30 cycles between a
/// warp's instructions; the issue bound at the full issue rate (the warps' own stalls are the
/// serial bound's, so the issue bound is a ceiling of the multiprocessors' throughput).
pub const SEARCH: Search = Search {
    latency_s: (200e-9, 2000e-9, 5e-9),
    cycles_per_instruction: (1.0, 30.0, 0.05),
    issue_efficiency: 1.0,
};

/// The same search with the latency held at a loaded DRAM latency of the H100 (700 ns), to
/// show what the rows say of the fitted one.
pub const DRAM_LATENCY: Search = Search {
    latency_s: (700e-9, 700e-9, 1e-9),
    ..SEARCH
};

/// A prediction within this factor of the measurement is the target.
const TARGET: f64 = 0.30;

/// Why a row lies outside the target, by its tag: the report fails on a row outside it that
/// has no entry here.
const RESIDUALS: [(&str, &str); 0] = [];

/// The review's hand count for row (1) (`shared/notes/kernel-review.md`): warp instructions
/// per group of 128.
const REVIEW_ROW1_PER_GROUP: f64 = 530.0;

/// Everything the report is made of.
pub struct Inputs {
    pub ptxas: String,
    pub build: Build,
    pub rows: Vec<Counted>,
    pub controls: Vec<Control>,
    /// The current build, its rows (in the order of `rows`) and their controls.
    pub current: Current,
    pub now: Vec<Counted>,
    pub now_controls: Vec<CurrentControl>,
    /// Issue 42's targets by kernel, as `bench/gpu.rs` holds them ([`targets`]).
    pub targets: Vec<(String, f64)>,
}

/// Issue 42's targets (item 6), each kernel's bandwidth as a fraction of the copy's, read from
/// `bench/gpu.rs` (its `TARGETS`, which the GPU benchmark judges its rows by and
/// `tests/python/test_gpu_kit.py` checks against `sdp4bit/kernel_times.py`), so that the model
/// judges its predictions by the same figures.
pub fn targets(root: &std::path::Path) -> Result<Vec<(String, f64)>, String> {
    let path = root.join("bench/gpu.rs");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let start = text
        .find("const TARGETS: [(&str, f64);")
        .ok_or("bench/gpu.rs has no TARGETS")?;
    let end = start
        + text[start..]
            .find("];")
            .ok_or("bench/gpu.rs: TARGETS unclosed")?;
    let mut out = Vec::new();
    for line in text[start..end].lines().skip(1) {
        let line = line.trim().trim_end_matches(',');
        let Some(pair) = line.strip_prefix("(\"").and_then(|l| l.strip_suffix(')')) else {
            continue;
        };
        let (name, fraction) = pair
            .split_once("\", ")
            .ok_or_else(|| format!("bench/gpu.rs: unreadable target `{line}`"))?;
        let fraction: f64 = fraction
            .parse()
            .map_err(|e| format!("bench/gpu.rs: target `{line}`: {e}"))?;
        out.push((name.to_owned(), fraction));
    }
    if out.is_empty() {
        return Err("bench/gpu.rs: TARGETS holds no target".into());
    }
    Ok(out)
}

/// The target of `kernel` (a kernel-table name).
pub fn target_of(targets: &[(String, f64)], kernel: &str) -> Result<f64, String> {
    targets
        .iter()
        .find(|(name, _)| name == kernel)
        .map(|&(_, t)| t)
        .ok_or_else(|| format!("issue 42 sets no target for {kernel} (bench/gpu.rs TARGETS)"))
}

/// The report.
pub fn write(inputs: &Inputs) -> Result<String, String> {
    let rows: Vec<(Call, f64)> = inputs
        .rows
        .iter()
        .map(|r| (r.call(), r.row.measured_us * 1e-6))
        .collect();
    let constants = fit(&H100, &rows, &SEARCH);
    let held_out = leave_one_out(&H100, &rows, &SEARCH);
    let at_dram = fit(&H100, &rows, &DRAM_LATENCY);
    let mut w = String::new();
    header(&mut w, inputs);
    resources(&mut w, inputs)?;
    counts(&mut w, inputs);
    breakdown(&mut w, inputs);
    controls(&mut w, inputs);
    model(&mut w, &rows, &constants, &at_dram);
    validation(&mut w, inputs, &constants, &held_out)?;
    h200(&mut w, inputs, &constants);
    current_build(&mut w, inputs)?;
    current_counts(&mut w, inputs);
    current_breakdown(&mut w, inputs);
    current_controls(&mut w, inputs);
    predictions(&mut w, inputs, &constants)?;
    changes(&mut w, inputs, &constants);
    terms(&mut w, inputs, &constants)?;
    Ok(w)
}

fn header(w: &mut String, inputs: &Inputs) {
    let _ = writeln!(
        w,
        "# CUDA kernels: dynamic instruction counts and a timing model, against the H100\n\n\
         Made without a GPU from the kernels that ran on the H100 (`kernels/` at {H100_COMMIT}, \
         unchanged since e9c1ddd, which the H100 ran): each bench row's warp instructions \
         counted in the SASS of the production build as a run of the row's configuration \
         executes it, then a timing model of bytes, instructions and the serial phases of a \
         work unit, its two constants fitted to the 13 rows the H100 timed \
         (`bench/results/gpu/README.md`). The same rows are then counted on the current \
         build, the kernels specialised to each row's configuration as production launches \
         them on an H100 or H200, and predicted by the same constants beside issue 42's \
         targets: a prediction, which no GPU has measured yet. Method and its limits: \
         [docs/kernel-model.md](../../docs/kernel-model.md).\n"
    );
    let _ = writeln!(w, "- machine: {} (no GPU)", machine());
    let _ = writeln!(w, "- date: {}", crate::common::utc_now());
    let _ = writeln!(
        w,
        "- command: `bash scripts/bench.sh kernels --out bench/results/kernels.md`"
    );
    let _ = writeln!(
        w,
        "- compilers: NVRTC 13.0 with the backend's options for sm_90; {}; g++ {} (the \
         coverage emulator, `-O0 --coverage`)",
        inputs.ptxas,
        gxx_version()
    );
    let _ = writeln!(
        w,
        "- current build: `kernels/` of the working tree ({}), emulator harness \
         `tests/kernel_emulator/` of the same tree\n",
        crate::current_report::kernels_identity(&inputs.current)
    );
}

fn resources(w: &mut String, inputs: &Inputs) -> Result<(), String> {
    let _ = writeln!(
        w,
        "## Resources of the production build the H100 ran ({H100_COMMIT})\n"
    );
    let _ = writeln!(
        w,
        "Registers, spills and occupancy from ptxas (blocks of 256 threads, occupancy = \
         resident warps / 64 as the registers allow); shuffles and votes are static counts \
         (each instruction of the code once); load and store widths are the widest global \
         accesses in the SASS.\n"
    );
    let _ = writeln!(
        w,
        "| kernel | registers | spill bytes (store / load) | occupancy | SHFL | VOTE | widest load | widest store |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut files: Vec<&String> = inputs.build.units.keys().collect();
    files.sort();
    for file in files {
        for r in inputs.build.units[file].resources()? {
            let (u, s) = (&r.usage, &r.sass);
            let _ = writeln!(
                w,
                "| `{}` | {} | {} / {} | {:.1}% | {} | {} | {} bit | {} |",
                r.name,
                u.registers,
                u.spill_stores,
                u.spill_loads,
                100.0 * u.occupancy(),
                s.shuffles,
                s.votes,
                s.widest_load(),
                match s.widest_store() {
                    0 => "none (atomic)".to_owned(),
                    bits => format!("{bits} bit"),
                }
            );
        }
    }
    Ok(())
}

fn counts(w: &mut String, inputs: &Inputs) {
    let _ = writeln!(w, "\n## Dynamic warp instructions of the rows\n");
    let _ = writeln!(
        w,
        "A unit is what one warp takes per step of its grid-stride loop (3 groups for \
         `grad_quantize_first`, a group for the other grouped kernels, 128 elements for \
         Global-QSGD). Each row's small case (its configuration and the benchmark's data \
         generators, the outputs checked byte for byte against the CPU backend) ran twice on \
         the coverage emulator, with one unit per warp and with 8 warps for all units, which \
         splits every instruction's executions into a part per unit and a part per warp (the \
         code around the loop). The call's count is per unit x the benchmark's units + per \
         warp x the warps its grid launches. Round trips: the unit's dependent waits for its \
         global loads in the SASS (`sdp4bit_test_support::round_trips`).\n"
    );
    let _ = writeln!(
        w,
        "| row | kernel | unit (elements) | case units | per unit | per element | per warp | call (M) | round trips / unit | resident warps |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &inputs.rows {
        let per_unit = r.count.unit_instructions();
        let _ = writeln!(
            w,
            "| {} | `{}` | {} | {} | {:.0} | {:.2} | {:.0} | {:.1} | {:.2} | {:.0} |",
            r.row.label,
            r.row.kernel,
            r.bench.unit_elements,
            r.case_units,
            per_unit,
            per_unit / r.bench.unit_elements,
            r.count.warp_instructions(),
            r.call_instructions() / 1e6,
            r.round_trips(),
            r.resident_warps(),
        );
    }
    if let Some(first) = inputs.rows.first() {
        let per_group = first.count.unit_instructions() / 3.0;
        let _ = writeln!(
            w,
            "\nRow (1): {per_group:.0} warp instructions per group of 128 ({:.2} per element); \
             the review's hand count was about {REVIEW_ROW1_PER_GROUP:.0} (4.2 per element, \
             +-25%), {:+.0}% from this count.",
            per_group / 128.0,
            100.0 * (REVIEW_ROW1_PER_GROUP / per_group - 1.0)
        );
    }
    let unattributed: usize = inputs
        .rows
        .iter()
        .map(|r| r.count.unattributed.without_frames)
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        w,
        "\nReachable instructions without a source line (NVRTC's own division and reciprocal \
         slow paths, called for operands outside the fast range only) are counted as never \
         run: at most {unattributed} static instructions in a row's entry point."
    );
}

fn breakdown(w: &mut String, inputs: &Inputs) {
    let _ = writeln!(w, "\n## Where a unit's instructions go\n");
    let _ = writeln!(
        w,
        "Warp instructions per unit by the function of `kernels/` their innermost source line \
         lies in, grouped; the convergence-region bookkeeping by opcode.\n"
    );
    category_table(w, &inputs.rows);
}

/// The table of `rows`' instructions per unit by category.
pub fn category_table(w: &mut String, rows: &[Counted]) {
    let mut head = "| category |".to_owned();
    let mut rule = "|---|".to_owned();
    for r in rows {
        head += &format!(" {} |", r.row.label.split_whitespace().next().unwrap_or(""));
        rule += "---:|";
    }
    let _ = writeln!(w, "{head}\n{rule}");
    for (i, (name, _)) in CATEGORIES.iter().enumerate() {
        let mut line = format!("| {name} |");
        for r in rows {
            line += &format!(" {:.0} |", r.categories[i]);
        }
        let _ = writeln!(w, "{line}");
    }
    let mut total = "| **all** |".to_owned();
    for r in rows {
        total += &format!(" **{:.0}** |", r.count.unit_instructions());
    }
    let _ = writeln!(w, "{total}");
}

fn controls(w: &mut String, inputs: &Inputs) {
    let _ = writeln!(w, "\n## Controls of the count\n");
    let _ = writeln!(
        w,
        "The count per unit against a static count of the same code: the instructions of the \
         grid-stride loop that a warp whose lanes agree reaches, outside the cold blocks of \
         `kernels/` (`// Cold path`, which valid, aligned data never enters), where that loop \
         is straight-line code. The production `global_quantize_i8` has no run-time loop or \
         branch in its unit; the specialised builds set the row's configuration as constants \
         in a wrapper (the old static model's method), so the compiler folds every \
         configuration branch and unrolls the unit's loops; the same runs' counts are mapped \
         onto them (only the loop's instructions counted).\n"
    );
    let _ = writeln!(
        w,
        "| control | count per unit | static count | count / static | structural count | structural / static | production count per unit |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|");
    for c in &inputs.controls {
        let (stat, ratio) = match c.static_count {
            Some(s) => (format!("{s:.0}"), format!("{:.3}", c.dynamic / s)),
            None => ("(not straight-line)".to_owned(), "-".to_owned()),
        };
        let (structural, structural_ratio) = match (c.structural, c.static_count) {
            (Some(n), Some(s)) => (format!("{n:.0}"), format!("{:.3}", n / s)),
            (Some(n), None) => (format!("{n:.0}"), "-".to_owned()),
            _ => ("-".to_owned(), "-".to_owned()),
        };
        let _ = writeln!(
            w,
            "| {} | {:.0} | {stat} | {ratio} | {structural} | {structural_ratio} | {:.0} |",
            c.what, c.dynamic, c.production
        );
    }
    let _ = writeln!(w, "\n{}", controls_reading(inputs));
}

/// What the controls show, with their numbers.
fn controls_reading(inputs: &Inputs) -> String {
    let control = |tag: &str| inputs.controls.iter().find(|c| c.what.contains(tag));
    let off = |c: &Control| {
        c.static_count
            .map_or(0.0, |s| 100.0 * (c.dynamic / s - 1.0))
    };
    let (Some(plain), Some(whole), Some(first), Some(last)) = (
        inputs.controls.first(),
        control("(6a)"),
        control("(1)"),
        control("(3)"),
    ) else {
        return String::new();
    };
    let stat = |c: &Control| c.static_count.unwrap_or(f64::NAN);
    let structural = |c: &Control| {
        c.structural
            .zip(c.static_count)
            .map_or(0.0, |(n, s)| 100.0 * (n / s - 1.0))
    };
    format!(
        "The production `global_quantize_i8` ({:+.1}%) and the specialised (6a) ({:+.1}%), \
         where the compiler keeps every copy of the unit's unrolled loops, agree with their \
         static counts. The specialised (1) ({:+.0}%) and (3) ({:+.0}%) fall short for a reason \
         the production builds do not share: with groups of 128 a lane's second run of a tile \
         lies past the group, a constant once the configuration is, so the compiler deletes \
         that copy of the runs loop, while the count still gives each copy of a line its share \
         of the line's executions. In production the runs are a run-time value and every copy \
         stays; only lines under a guard that is constant in some copies lose a share there (the \
         Hadamard register stages' `(i & D) == 0 && i + D < 4 runs`, about 8 of row (1)'s 470 \
         instructions per group). Counted by their structure instead (each block of the \
         unit's loop once per pass of its region when the runs enter it, \
         `sdp4bit_test_support::specialised_count`, the count the current build's rows take \
         below), the specialised (1), (3) and (6a) come within {:+.1}%, {:+.1}% and {:+.1}% of \
         their static counts: the deleted copies no longer count short, and what remains is \
         code of the loop that the runs never enter (the static count takes every branch's \
         side). The static counts also show what specialisation alone would \
         save: row (1)'s unit is {:.0} instructions specialised against {:.0} counted in \
         production ({:.1}x), row (3)'s {:.0} against {:.0} ({:.1}x), row (6a)'s {:.0} against \
         {:.0} ({:.1}x).",
        off(plain),
        off(whole),
        off(first),
        off(last),
        structural(first),
        structural(last),
        structural(whole),
        stat(first),
        first.production,
        first.production / stat(first),
        stat(last),
        last.production,
        last.production / stat(last),
        stat(whole),
        whole.production,
        whole.production / stat(whole),
    )
}

fn model(w: &mut String, rows: &[(Call, f64)], k: &Constants, at_dram: &Constants) {
    let _ = writeln!(w, "\n## The timing model\n");
    let _ = writeln!(
        w,
        "The predicted time of a call is the largest of three bounds:\n\n\
         - memory: bytes read + written / the copy bandwidth the same GPU reached (H100: \
           {copy:.0} GB/s);\n\
         - issue: warp instructions / ({mp} multiprocessors x {ipc} instructions per clock x \
           {clock:.2} GHz x {eff:.2});\n\
         - serial: units x (R L + N c / clock) / ({mp} x W), a warp taking its units one \
           after another: R the unit's dependent round trips, L their latency, N its warp \
           instructions, c the cycles between two of a warp's instructions, W the warps \
           resident on a multiprocessor (at most those launched).\n",
        copy = H100.copy_bytes_per_s / 1e9,
        mp = H100.multiprocessors,
        ipc = H100.issue_per_clock,
        clock = H100.clock_hz / 1e9,
        eff = k.issue_efficiency,
    );
    let _ = writeln!(
        w,
        "The issue bound is held at the full rate: the warps' own stalls are the serial \
         bound's, so the issue bound is only the multiprocessors' ceiling. L and c are fitted \
         to the 13 rows (least squares of log(predicted / measured) on a grid of {:.0} ns and \
         {:.2} cycles):\n",
        SEARCH.latency_s.2 * 1e9,
        SEARCH.cycles_per_instruction.2,
    );
    let _ = writeln!(
        w,
        "| fit | L | c | rows within +-30% | worst predicted / measured |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|");
    for (name, constants) in [("both free (the model)", k), ("L held at 700 ns", at_dram)] {
        let ratios: Vec<f64> = rows
            .iter()
            .map(|(call, measured)| predict(&H100, call, constants).seconds() / measured)
            .collect();
        let within = ratios.iter().filter(|r| (*r - 1.0).abs() <= TARGET).count();
        let worst = ratios
            .iter()
            .copied()
            .max_by(|a, b| a.ln().abs().total_cmp(&b.ln().abs()))
            .unwrap_or(1.0);
        let _ = writeln!(
            w,
            "| {name} | {:.0} ns | {:.2} | {within} of {} | {worst:.2} |",
            constants.latency_s * 1e9,
            constants.cycles_per_instruction,
            rows.len(),
        );
    }
    let _ = writeln!(
        w,
        "\n{}",
        plausibility(k).replace("{}", &format!("{:.2}", at_dram.cycles_per_instruction))
    );
}

/// How the fitted constants compare with what is known of the H100.
fn plausibility(k: &Constants) -> String {
    format!(
        "**L = {:.0} ns, c = {:.2} cycles.** c lies between a dependent ALU instruction's 4-6 \
         cycles and a shuffle's 20-30, as the average over a mix of both (and of the waits \
         for a busy scheduler) should. L is below the 600-900 ns of loaded HBM latency \
         published for the H100: it is the average latency of the waits the SASS shows, and \
         many of them are not DRAM round trips: the destination table (`dests`, a few words \
         every warp reads, an L1 hit), a group's second pass over the tiles its first pass \
         loaded a moment before (L2 or L1), a group's scale that 32 neighbouring warps read \
         from one 128-byte line, the next run's code words in the line after the previous \
         run's. Held at 700 ns, the fit moves c to {{}} and misses more rows (the table \
         above): the rows cannot tell a long latency from slow issue apart within their \
         spread, which is why L is read as the waits' effective latency and not as the HBM's.",
        k.latency_s * 1e9,
        k.cycles_per_instruction,
    )
}

fn validation(
    w: &mut String,
    inputs: &Inputs,
    k: &Constants,
    held_out: &[f64],
) -> Result<(), String> {
    let _ = writeln!(w, "\n## The 13 H100 rows\n");
    let _ = writeln!(
        w,
        "Measured: the median of the four runs' medians. Predicted with the constants above; \
         leave one out: predicted with constants fitted to the other 12 rows. The bounds in \
         us.\n"
    );
    let _ = writeln!(
        w,
        "| row | kernel | measured us | predicted us | predicted / measured | leave one out | memory | issue | serial | bound |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut outside = Vec::new();
    for (r, &loo) in inputs.rows.iter().zip(held_out) {
        let p = predict(&H100, &r.call(), k);
        let measured = r.row.measured_us * 1e-6;
        let ratio = p.seconds() / measured;
        if (ratio - 1.0).abs() > TARGET {
            outside.push(r);
        }
        let _ = writeln!(
            w,
            "| {} | `{}` | {:.1} | {:.1} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {} |",
            r.row.label,
            r.row.kernel,
            r.row.measured_us,
            p.seconds() * 1e6,
            ratio,
            loo / measured,
            p.memory_s * 1e6,
            p.issue_s * 1e6,
            p.serial_s * 1e6,
            p.bound().name(),
        );
    }
    let held: Vec<f64> = inputs
        .rows
        .iter()
        .zip(held_out)
        .map(|(r, loo)| loo / (r.row.measured_us * 1e-6))
        .collect();
    let (low, high) = held.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| {
        (lo.min(x), hi.max(x))
    });
    let _ = writeln!(
        w,
        "\n{} of {} rows within +-{:.0}%. Left out of the fit, each row's prediction lies \
         between {low:.2} and {high:.2} of its measurement ({} of {} within +-{:.0}%): the two \
         constants are not tuned to single rows.",
        inputs.rows.len() - outside.len(),
        inputs.rows.len(),
        100.0 * TARGET,
        held.iter().filter(|x| (*x - 1.0).abs() <= TARGET).count(),
        held.len(),
        100.0 * TARGET,
    );
    for r in outside {
        let tag = r.row.label.split_whitespace().next().unwrap_or("");
        let explanation = RESIDUALS
            .iter()
            .find(|(t, _)| *t == tag)
            .map(|(_, text)| *text)
            .ok_or_else(|| {
                format!(
                    "row {tag} lies outside +-30% and RESIDUALS explains no such residual; \
                     the report up to it (the model's inputs and fit):\n{w}"
                )
            })?;
        let _ = writeln!(w, "\n{tag}: {explanation}");
    }
    Ok(())
}

fn h200(w: &mut String, inputs: &Inputs, k: &Constants) {
    let _ = writeln!(
        w,
        "\n## The same rows on an H200: the baseline of the next GPU run\n"
    );
    let _ = writeln!(
        w,
        "The H200 has the H100's processor (132 multiprocessors, the same clock) and faster \
         memory: a copy moved about {:.1} TB/s there. Same constants, so only the memory \
         bound moves (assuming the same loaded latency).\n",
        H200.copy_bytes_per_s / 1e12
    );
    let _ = writeln!(
        w,
        "| row | kernel | H100 measured us | H200 predicted us | memory | issue | serial | bound | x copy |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|---:|---|---:|");
    for r in &inputs.rows {
        let p: Prediction = predict(&H200, &r.call(), k);
        let _ = writeln!(
            w,
            "| {} | `{}` | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.2} |",
            r.row.label,
            r.row.kernel,
            r.row.measured_us,
            p.seconds() * 1e6,
            p.memory_s * 1e6,
            p.issue_s * 1e6,
            p.serial_s * 1e6,
            p.bound().name(),
            p.memory_s / p.seconds(),
        );
    }
}

/// The table `scripts/gpu_kit.py` reads: per row its bytes and the two bounds that do not
/// depend on the memory, so that a run's report puts the model beside each row with that
/// run's copy bandwidth. The rows are the current build's, which the next GPU run launches.
fn terms(w: &mut String, inputs: &Inputs, k: &Constants) -> Result<(), String> {
    let _ = writeln!(w, "\n## Model terms per bench row\n");
    let _ = writeln!(
        w,
        "Read by the GPU kit (`scripts/gpu_kit.py`, `model_estimates`): a run's prediction of \
         a row is the largest of bytes / that run's copy bandwidth, the issue bound and the \
         serial bound (L = {:.0} ns, c = {:.2}). The terms are those of the current build, the \
         specialised entry point each row launches on sm_90 (named here), which the next GPU \
         run times; those of the kernels the H100 ran are in the tables of the 13 H100 rows \
         above.\n",
        k.latency_s * 1e9,
        k.cycles_per_instruction
    );
    let _ = writeln!(w, "| model row | kernel | bytes | issue us | serial us |");
    let _ = writeln!(w, "|---|---|---:|---:|---:|");
    for (r, old) in inputs.now.iter().zip(&inputs.rows) {
        if r.bench.bytes != old.bench.bytes {
            return Err(format!(
                "{}: the current build moves {} bytes, the H100's {}",
                r.row.label, r.bench.bytes, old.bench.bytes
            ));
        }
        let p = predict(&H100, &r.call(), k);
        let _ = writeln!(
            w,
            "| {} | `{}` | {:.0} | {:.2} | {:.2} |",
            r.row.label.split_whitespace().next().unwrap_or(""),
            r.kernel,
            r.bench.bytes,
            p.issue_s * 1e6,
            p.serial_s * 1e6,
        );
    }
    Ok(())
}

/// The host this ran on: its CPU model and core count.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {cores} cores")
}

/// g++'s version line.
fn gxx_version() -> String {
    std::process::Command::new("g++")
        .arg("-dumpfullversion")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned())
}
