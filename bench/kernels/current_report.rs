//! The report's sections on the current build: the specialised entry points production
//! launches for the 13 rows, their counts and controls, their predictions against issue 42's
//! targets on an H100 and an H200, and what the model attributes to each change of issue 42
//! item 3.

use std::fmt::Write as _;
use std::process::Command;

use sdp4bit_test_support::digest::Digest;
use sdp4bit_test_support::timing_model::{Call, Constants, Gpu, Prediction, predict};

use crate::analysis::Counted;
use crate::breakdown::{CATEGORIES, DIVERGENCE};
use crate::current::Current;
use crate::report::{H100, H200, Inputs, category_table, target_of};

/// Where the counted kernels come from: the commit the working tree stands on, whether
/// `kernels/` differs from it, and a digest of every file of `kernels/`.
pub fn kernels_identity(current: &Current) -> String {
    let root = current.kernels.parent().unwrap_or(&current.kernels);
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let head = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "no git".to_owned());
    let changed = git(&["status", "--porcelain", "--", "kernels"]).is_some_and(|s| !s.is_empty());
    let mut files: Vec<_> = std::fs::read_dir(&current.kernels)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    let mut digest = Digest::default();
    for file in &files {
        digest.add(file.file_name().unwrap_or_default().as_encoded_bytes());
        digest.add(&std::fs::read(file).unwrap_or_default());
    }
    format!(
        "{head}{}, digest of its files {}",
        if changed {
            " with uncommitted changes to `kernels/`"
        } else {
            ""
        },
        &digest.hex()[..12]
    )
}

pub fn current_build(w: &mut String, inputs: &Inputs) -> Result<(), String> {
    let _ = writeln!(
        w,
        "\n## The current build: the kernels specialised as production launches them\n"
    );
    let _ = writeln!(
        w,
        "Each row's configuration becomes the compile-time constants of a `KernelSpec` (from \
         its parameter struct at the benchmark's size: `Constants::first`, `second`, `last`, \
         `encode`, `apply`, `global`), with the variant production takes on sm_90: the line of \
         `variants::TABLE` for sm_90 (it has none yet), else the default (blocks of 256 \
         threads, the most groups per warp of 4, 2 and 1 whose estimated registers fit 80, and \
         the register budget they need as `__launch_bounds__`). NVRTC compiles the spec's \
         translation unit with the backend's options; its units are the variant's groups per \
         warp (runs of 4 elements per thread for Global-QSGD), its grid as many blocks as the \
         units need, at most the variant's 32 per multiprocessor of 132. Production CUBIN: the \
         CUBIN `backend::cuda::compile::compile_for` makes for the spec, disassembled and \
         compared instruction by instruction (opcode, guard, operands) with the counted code.\n"
    );
    let _ = writeln!(
        w,
        "| row | entry point | groups / unit | threads | blocks / SM (launch bounds) | registers | spill bytes | resident warps | launched warps | production CUBIN |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for (r, (_, spec)) in inputs.now.iter().zip(&inputs.current.rows) {
        let matched = inputs
            .current
            .production
            .get(&r.kernel)
            .ok_or_else(|| format!("{}: no production CUBIN compared", r.kernel))?;
        let production = if matched.differing == 0 {
            format!("the same {} instructions", matched.instructions)
        } else {
            format!(
                "{} of {} instructions differ",
                matched.differing, matched.instructions
            )
        };
        let u = &r.entry.usage;
        let _ = writeln!(
            w,
            "| {} | `{}` | {} | {} | {} | {} | {} | {:.0} | {:.0} | {production} |",
            r.row.label,
            r.kernel,
            spec.variant.units,
            spec.variant.threads,
            spec.variant.min_blocks,
            u.registers,
            u.spill_stores + u.spill_loads,
            r.resident_warps(),
            r.bench.warps,
        );
    }
    if let Some((r, _)) = inputs
        .now
        .iter()
        .zip(&inputs.current.production)
        .find(|(_, (_, m))| m.differing > 0)
    {
        return Err(format!(
            "{}: the counted build is not the CUBIN production compiles",
            r.row.label
        ));
    }
    Ok(())
}

pub fn current_counts(w: &mut String, inputs: &Inputs) {
    let _ = writeln!(w, "\n### Warp instructions of the current build's rows\n");
    let _ = writeln!(
        w,
        "Each row's counting case is its configuration and the benchmark's data as above, cut \
         into whole units of the variant; its outputs equal the CPU backend's bytes in every \
         row. The count per unit is the structural count (next section: each block of the \
         unit's loop once per pass of its region where the runs enter it), the count per warp \
         the code around the loop, the call's count per unit x the benchmark's units + per \
         warp x the warps its grid launches. Round trips: as above, from the SASS walked with \
         these counts.\n"
    );
    let _ = writeln!(
        w,
        "| row | entry point | unit (elements) | case units | per unit | per element | per warp | call (M) | round trips / unit | resident warps |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &inputs.now {
        let per_unit = r.count.unit_instructions();
        let _ = writeln!(
            w,
            "| {} | `{}` | {} | {} | {:.0} | {:.2} | {:.0} | {:.1} | {:.2} | {:.0} |",
            r.row.label,
            r.kernel,
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
    let without = inputs
        .now
        .iter()
        .map(|r| r.count.unattributed.without_frames)
        .max()
        .unwrap_or(0);
    let past_end = inputs
        .now
        .iter()
        .map(|r| r.count.unattributed.outside_functions)
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        w,
        "\nReachable instructions without a source line (NVRTC's division and reciprocal slow \
         paths) count as never run: at most {without} static instructions in a row's entry \
         point. Instructions whose line table names a line past the end of its file (ptxas \
         names a few of `quantize.cuh`'s stores as the kernel file's) take their block's \
         count: at most {past_end} in a row."
    );
}

pub fn current_breakdown(w: &mut String, inputs: &Inputs) {
    let _ = writeln!(
        w,
        "\n### Where a unit's instructions go in the current build\n"
    );
    let _ = writeln!(
        w,
        "As for the kernels the H100 ran, by the function of `kernels/` of the innermost line \
         (a member function by its struct); a unit is the variant's groups (see the table \
         above), so compare per group or per element.\n"
    );
    category_table(w, &inputs.now);
}

pub fn current_controls(w: &mut String, inputs: &Inputs) {
    let _ = writeln!(w, "\n### Controls of the current build's count\n");
    let _ = writeln!(
        w,
        "A build specialised to one configuration unrolls every loop whose trip count is a \
         constant and deletes the copies whose guard is constant false (a Hadamard stage that \
         does not apply to a copy of the stage loop, the pairs a copy of a butterfly does not \
         form). The line mapping gives each copy that is left its share of the line's \
         executions as if every copy were there, so it counts those blocks short: the 36-42% \
         of the specialised controls above. The current build is therefore counted by its \
         structure (`sdp4bit_test_support::specialised_count`): a basic block of the unit's \
         loop runs once per pass of the innermost loop the code kept around it (once per unit, \
         or a kept loop's trips per unit from its backward branch's count) whenever the line \
         mapping has it run at all, and never otherwise; blocks before and after the loop run \
         per warp; cold paths (`// Cold path`) and out-of-line subroutines keep the line \
         mapping, since only some data take them. Loops are the natural loops of the backward \
         branches. The control: the same runs by both counts, block by block.\n"
    );
    let _ = writeln!(
        w,
        "| row | line-mapped per unit | structural per unit | structural / mapped | blocks counted short: instructions, executions missed | blocks counted over: instructions, executions added | per unit moved to the warp | unit's loop, not cold | static count of the unit | entered / static | cold paths and subroutines |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for c in &inputs.now_controls {
        let (stat, entered) = match c.static_unit {
            Some(s) => (format!("{s:.0}"), format!("{:.3}", c.hot / s)),
            None => ("(a kept loop runs)".to_owned(), "-".to_owned()),
        };
        let _ = writeln!(
            w,
            "| {} | {:.0} | {:.0} | {:.3} | {}, {:.0} | {}, {:.0} | {:.1} | {:.0} | {stat} | {entered} | {:.0} |",
            c.label,
            c.mapped,
            c.structural,
            c.structural / c.mapped,
            c.below.0,
            c.below.1,
            c.above.0,
            c.above.1,
            c.moved,
            c.hot,
            c.cold,
        );
    }
    let same: Vec<&str> = inputs
        .now_controls
        .iter()
        .filter(|c| c.below.1 < 0.5 && c.above.1 < 0.5)
        .map(|c| tag(c.label))
        .collect();
    let _ = writeln!(
        w,
        "\nWhere no block is counted short or over, the two counts agree block for block in \
         the unit ({}): the line mapping's assumptions hold there, and the structure adds \
         nothing. Where they differ, the difference per unit by category (structural minus \
         line-mapped):\n",
        if same.is_empty() {
            "no row".to_owned()
        } else {
            same.join(", ")
        }
    );
    for c in &inputs.now_controls {
        let mut parts: Vec<(f64, &str)> = c
            .by_category
            .iter()
            .zip(CATEGORIES.iter())
            .filter(|(d, _)| d.abs() >= 0.5)
            .map(|(d, (name, _))| (*d, *name))
            .collect();
        if parts.is_empty() {
            continue;
        }
        parts.sort_by(|a, b| b.0.abs().total_cmp(&a.0.abs()));
        let listed: Vec<String> = parts
            .iter()
            .map(|(d, name)| format!("{name} {d:+.0}"))
            .collect();
        let _ = writeln!(w, "- {}: {}", c.label, listed.join("; "));
    }
    let _ = writeln!(
        w,
        "\nThe blocks counted short are the Hadamard stages (a block of the in-register stages \
         at 1/5 and of the shuffle stages at 3/5 of its passes: a 32-block has five stages, \
         of which each copy of the stage loop keeps one kind), the stores of lane 0 (the \
         scale, 1/32) and of the even lanes (4-bit codes, 1/2), which a warp issues once \
         whichever lanes take them; the blocks counted over hold lines gcov counts more than \
         once per execution (a call and the code after it on one line, 2; an unrolled loop's \
         header, once per copy and once more, 5/4 for 4 copies). The code moved to the warp \
         is set-up the compiler placed before the loop with a line of the loop. The static \
         count takes every block of the unit outside cold paths, entered or not: what the \
         structural count leaves out of it is the branch sides the data do not take (the \
         element loads of a unit that is not whole, the non-vector path of a misaligned \
         bucket). The structural count is checked on a synthetic kernel whose compiler \
         deletes half of its unrolled copies (`tests/kernel_model.rs`): exact where the line \
         mapping counts half, and equal to it on a kernel with a kept loop."
    );
}

/// A row's tag, `(1)`.
fn tag(label: &str) -> &str {
    label.split_whitespace().next().unwrap_or(label)
}

/// The serial bound's two parts of a call, seconds: the round trips' and the instructions'.
fn serial_parts(gpu: &Gpu, call: &Call, k: &Constants) -> (f64, f64) {
    let warps = call
        .resident_warps
        .min(call.launched_warps / gpu.multiprocessors)
        .max(1.0);
    let scale = call.units / (gpu.multiprocessors * warps);
    (
        scale * call.unit_round_trips * k.latency_s,
        scale * call.unit_instructions * k.cycles_per_instruction / gpu.clock_hz,
    )
}

/// x copy of a prediction: the memory bound over it.
fn copy_ratio(p: &Prediction) -> f64 {
    p.memory_s / p.seconds()
}

pub fn predictions(w: &mut String, inputs: &Inputs, k: &Constants) -> Result<(), String> {
    let _ = writeln!(
        w,
        "\n## Predictions of the current build against issue 42's targets\n"
    );
    let _ = writeln!(
        w,
        "The constants fitted to the kernels the H100 ran (L = {:.0} ns, c = {:.2} cycles) \
         applied to the current build's counts, units, round trips and resident warps; the \
         old build is the table above. x copy: the memory bound over the prediction, the \
         ratio the GPU benchmark reports (bytes over time against the copy's). Target: issue \
         42 item 6 for the row's kernel (`bench/gpu.rs` `TARGETS`: fp32-input kernels 0.75x, \
         bf16-input kernels and the 8-to-4-bit requantization 0.5x, `weight_apply` and \
         Global-QSGD 0.85x). The serial bound is split into its round trips (R L) and its \
         instructions (N c); both in us. These are predictions: no GPU has run the current \
         build.\n",
        k.latency_s * 1e9,
        k.cycles_per_instruction
    );
    let mut misses = Vec::new();
    for (gpu, name) in [(&H100, "H100"), (&H200, "H200")] {
        let _ = writeln!(
            w,
            "\n### {name} (copy {:.2} TB/s)\n",
            gpu.copy_bytes_per_s / 1e12
        );
        let _ = writeln!(
            w,
            "| row | kernel | target | old us | old x copy | new us | new x copy | new / old | memory | issue | serial: round trips + instructions | bound | meets |"
        );
        let _ = writeln!(
            w,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
        );
        for (r, old) in inputs.now.iter().zip(&inputs.rows) {
            let target = target_of(&inputs.targets, r.row.kernel)?;
            let p = predict(gpu, &r.call(), k);
            let q = predict(gpu, &old.call(), k);
            let (trips, instructions) = serial_parts(gpu, &r.call(), k);
            let meets = copy_ratio(&p) >= target;
            if !meets {
                misses.push((name, gpu, r, target));
            }
            let _ = writeln!(
                w,
                "| {} | `{}` | {:.2} | {:.1} | {:.2} | {:.1} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} = {:.1} + {:.1} | {} | {} |",
                r.row.label,
                r.row.kernel,
                target,
                q.seconds() * 1e6,
                copy_ratio(&q),
                p.seconds() * 1e6,
                copy_ratio(&p),
                p.seconds() / q.seconds(),
                p.memory_s * 1e6,
                p.issue_s * 1e6,
                p.serial_s * 1e6,
                trips * 1e6,
                instructions * 1e6,
                p.bound().name(),
                if meets { "yes" } else { "no" },
            );
        }
        let met = inputs
            .now
            .iter()
            .filter(|r| {
                target_of(&inputs.targets, r.row.kernel)
                    .is_ok_and(|t| copy_ratio(&predict(gpu, &r.call(), k)) >= t)
            })
            .count();
        let _ = writeln!(
            w,
            "\n{met} of {} rows meet their targets by the model on the {name}.",
            inputs.now.len()
        );
    }
    let _ = writeln!(
        w,
        "\n### What keeps the rows that miss from their targets\n"
    );
    let _ = writeln!(
        w,
        "For each miss, the bound that sets the prediction and what it would take: the target \
         time is the memory bound over the target; a serial bound is units x (R L + N c / \
         clock) / (132 x W), so it meets the target time with N instructions per unit at \
         most (R and W as they are), W resident warps at least (R and N as they are, W at \
         most 64) or c cycles per instruction at most (the fitted c carries the dependences \
         of the old code, one group at a time; several groups in flight give a warp \
         independent instructions, which may lower it). The issue bound is a floor no c \
         lowers.\n"
    );
    for (name, gpu, r, target) in misses {
        let call = r.call();
        let p = predict(gpu, &call, k);
        let goal = p.memory_s / target;
        let (trips, instructions) = serial_parts(gpu, &call, k);
        let warps = call
            .resident_warps
            .min(call.launched_warps / gpu.multiprocessors)
            .max(1.0);
        // The unit's serial time that meets the goal at these warps, and the warps that meet
        // it at this unit's time.
        let unit_goal = goal * gpu.multiprocessors * warps / call.units;
        let n_goal = (unit_goal - call.unit_round_trips * k.latency_s) * gpu.clock_hz
            / k.cycles_per_instruction;
        let unit_s = call.unit_round_trips * k.latency_s
            + call.unit_instructions * k.cycles_per_instruction / gpu.clock_hz;
        let w_goal = call.units * unit_s / (gpu.multiprocessors * goal);
        let c_goal = (unit_goal - call.unit_round_trips * k.latency_s) * gpu.clock_hz
            / call.unit_instructions;
        let cold = inputs
            .now_controls
            .iter()
            .find(|c| c.label == r.row.label)
            .map_or(0.0, |c| c.cold);
        let issue_goal = goal * gpu.multiprocessors * gpu.issue_per_clock * gpu.clock_hz;
        let limit = match p.bound().name() {
            "serial" => format!(
                "serial {:.1} us, {:.0}% of it the {:.0} instructions per unit (c = {:.2} \
                 cycles each{}) and {:.0}% the {:.2} round trips, on {:.0} resident warps; it \
                 takes at most {:.0} instructions per unit ({:+.0}%), {:.0} resident warps \
                 ({}) or c <= {:.2} cycles{}",
                p.serial_s * 1e6,
                100.0 * instructions / (trips + instructions),
                call.unit_instructions,
                k.cycles_per_instruction,
                if cold > 0.05 * call.unit_instructions {
                    format!(
                        "; {cold:.0} of them in cold paths and subroutines that this row's \
                         data take"
                    )
                } else {
                    String::new()
                },
                100.0 * trips / (trips + instructions),
                call.unit_round_trips,
                warps,
                n_goal.max(0.0),
                100.0 * (n_goal.max(0.0) / call.unit_instructions - 1.0),
                w_goal.ceil(),
                if w_goal > 64.0 {
                    "more than a multiprocessor holds".to_owned()
                } else {
                    format!("{:.1}x the registers' occupancy", w_goal / warps)
                },
                c_goal.max(0.0),
                if p.issue_s > goal {
                    format!(
                        "; the issue bound ({:.1} us) misses too: at most {:.0} M warp \
                         instructions in all ({:+.0}%)",
                        p.issue_s * 1e6,
                        issue_goal / 1e6,
                        100.0 * (issue_goal / call.instructions - 1.0)
                    )
                } else {
                    String::new()
                }
            ),
            "issue" => format!(
                "issue {:.1} us: at most {:.0} M warp instructions in all ({:+.0}%)",
                p.issue_s * 1e6,
                issue_goal / 1e6,
                100.0 * (issue_goal / call.instructions - 1.0)
            ),
            _ => "memory".to_owned(),
        };
        let _ = writeln!(
            w,
            "- {} on the {name}: {:.2}x against {:.2}x, target time {:.1} us; {limit}.",
            r.row.label,
            copy_ratio(&p),
            target,
            goal * 1e6,
        );
    }
    Ok(())
}

/// A call's figures per group of the row (per 128 elements for the element-wise kernels):
/// instructions, convergence bookkeeping, Hadamard instructions, round trips, and the call
/// with one group as its unit.
struct PerGroup {
    groups: f64,
    instructions: f64,
    divergence: f64,
    hadamard: f64,
    round_trips: f64,
    call: Call,
}

fn per_group(r: &Counted) -> PerGroup {
    let groups = r.shape.groups as f64;
    let hadamard = CATEGORIES
        .iter()
        .position(|(name, _)| name.starts_with("Hadamard"))
        .map_or(0.0, |i| r.categories[i]);
    let divergence = CATEGORIES
        .iter()
        .position(|(name, _)| *name == DIVERGENCE)
        .map_or(0.0, |i| r.categories[i]);
    let call = r.call();
    PerGroup {
        groups,
        instructions: call.unit_instructions / groups,
        divergence: divergence / groups,
        hadamard: hadamard / groups,
        round_trips: call.unit_round_trips / groups,
        call: Call {
            units: call.units * groups,
            unit_instructions: call.unit_instructions / groups,
            unit_round_trips: call.unit_round_trips / groups,
            ..call
        },
    }
}

pub fn changes(w: &mut String, inputs: &Inputs, k: &Constants) {
    let _ = writeln!(
        w,
        "\n## What the model attributes to the changes of issue 42 item 3\n"
    );
    let _ = writeln!(
        w,
        "The changes landed together, so each row's predicted effect is the old build's \
         prediction against the new one's. The model can still say which of its terms moved: \
         per group of the row (a unit is 3 groups of `grad_quantize_first` in the old build \
         and the variant's groups in the new), the warp instructions, the convergence-region \
         bookkeeping (`BSSY`, `BSYNC`, `BRA.DIV`, `WARPSYNC`) and the Hadamard's instructions \
         (what compile-time specialisation removes), the round trips (what several groups in \
         flight, the early Philox words, the decoders' batches of peers and `weight_apply`'s \
         hoisted loads remove), the resident warps (what the registers of held groups and of \
         several groups in flight set). The last columns predict the H100 time with one of \
         the three terms taken from the new build and the rest from the old: each alone, \
         against the old and the new prediction.\n"
    );
    let _ = writeln!(
        w,
        "| row | groups / unit old, new | instructions / group old, new | convergence / group old, new | Hadamard / group old, new | round trips / group old, new | resident warps old, new | H100 old us | instructions alone | round trips alone | warps alone | H100 new us |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|");
    for (r, old) in inputs.now.iter().zip(&inputs.rows) {
        let (a, b) = (per_group(old), per_group(r));
        let time = |call: &Call| predict(&H100, call, k).seconds() * 1e6;
        // The old call with one of the new build's terms.
        let instructions_only = Call {
            unit_instructions: b.call.unit_instructions,
            instructions: b.call.instructions,
            ..a.call
        };
        let trips_only = Call {
            unit_round_trips: b.call.unit_round_trips,
            ..a.call
        };
        let warps_only = Call {
            resident_warps: b.call.resident_warps,
            launched_warps: b.call.launched_warps,
            ..a.call
        };
        let _ = writeln!(
            w,
            "| {} | {:.0}, {:.0} | {:.0}, {:.0} | {:.1}, {:.1} | {:.1}, {:.1} | {:.2}, {:.2} | {:.0}, {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.row.label,
            a.groups,
            b.groups,
            a.instructions,
            b.instructions,
            a.divergence,
            b.divergence,
            a.hadamard,
            b.hadamard,
            a.round_trips,
            b.round_trips,
            a.call.resident_warps,
            b.call.resident_warps,
            time(&a.call),
            time(&instructions_only),
            time(&trips_only),
            time(&warps_only),
            time(&b.call),
        );
    }
    let _ = writeln!(
        w,
        "\nA row's time per group stays what its unit's gives (the serial bound is linear in \
         the units), so the per-group call predicts the row's time; the columns of one term \
         alone do not add up to the new time, since the bounds are combined by a maximum and \
         the serial bound multiplies the warps with the rest."
    );
}
