//! How often each SASS instruction of a kernel runs, estimated from a host run's line counts
//! (`gcov`) through the instruction's source frames (`nvdisasm -gi`).
//!
//! An instruction whose frames are line `L0` of function `f0`, inlined at line `L1` of `f1`,
//! ..., inlined at line `Ln` of the entry point (or of an out-of-line function) runs
//!
//! ```text
//!   count(L0) / (calls(f0) u0)  x  count(L1) / (calls(f1) u1)  x ...  x  count(Ln) / un
//! ```
//!
//! times per lane: each factor is how often the line runs per call of its function (for a
//! call site, the calls it makes), the last how often it runs in all, and `uk` is the number
//! of copies the compiler made of line `Lk` in this inline instance: the product of the trip
//! counts of the loops around `Lk` in `fk` that it unrolled (a loop it kept has a backward
//! branch at its header line in the same instance; a trip count is the loop's trips over its
//! entries, from the -O0 counts of its header, its body and its `break`s, rounded up to whole
//! copies). The header line of a kept loop counts both its entries and its trips: an
//! instruction of it inside the loop takes the trips' share, one outside (the test before the
//! first trip) the entries'. Frames in files the host build did not compile (NVRTC's own
//! headers, a wrapper of another name) are dropped: their code runs once per execution of the
//! line that calls it. A line gcov does not report (no code of its own in the host build, such
//! as a device-only `asm`) takes the count of the nearest reported line of its function.
//!
//! The instructions of one basic block run equally often; each block takes the estimate most
//! of its unguarded instructions have.
//!
//! The estimate assumes that every inline instance of a function runs as often per call as
//! its average, that the lanes of a warp agree (a warp instruction is 32 lane executions; code
//! that only some lanes run is undercounted by their share), and that the compiler kept every
//! copy of an unrolled loop's body, alike in size: a copy it deleted because its guard is a
//! constant there (a run past the group in a build specialised to g = 128) still takes its
//! share, so such code is undercounted.

use std::collections::HashMap;

use crate::gcov::Coverage;
use crate::sass::{Frame, Listing};
use crate::source_loops::SourceLoop;

/// Lanes of a warp.
const WARP: f64 = 32.0;

/// The loops of every source file the frames may name, by base name.
pub type LoopIndex = HashMap<String, Vec<SourceLoop>>;

/// What the estimate could not attribute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unattributed {
    /// Reachable instructions without a frame in a file the host build compiled.
    pub without_frames: usize,
    /// Reachable instructions whose line lies outside every function of the host build.
    pub outside_functions: usize,
}

/// Warp executions of the instructions of a kernel in one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Executions {
    /// Each instruction's estimate through its own line (0 for code a warp whose lanes agree
    /// cannot reach): how often its work is done.
    pub by_line: Vec<f64>,
    /// Each instruction's issues: the count of its basic block.
    pub issued: Vec<f64>,
    /// What could not be attributed.
    pub unattributed: Unattributed,
}

/// The warp executions of every instruction of `listing` in the run `coverage` describes.
pub fn warp_executions(
    listing: &Listing,
    coverage: &Coverage,
    loops: &LoopIndex,
) -> Result<Executions, String> {
    let reachable = listing.reachable()?;
    let frames: Vec<Vec<Frame>> = listing
        .instructions
        .iter()
        .map(|ins| {
            ins.frames
                .iter()
                .filter(|f| coverage.has_file(&f.file))
                .cloned()
                .collect()
        })
        .collect();
    let kept = listing
        .back_edges(&reachable)?
        .into_iter()
        .map(|(branch, target)| Kept {
            frames: &frames[branch],
            from: target,
            to: branch,
        })
        .collect();
    let shares = Shares {
        coverage,
        loops,
        kept,
    };
    let mut out = vec![0.0; listing.instructions.len()];
    let mut missing = Unattributed::default();
    for (i, frames) in frames.iter().enumerate() {
        if !reachable[i] {
            continue;
        }
        if frames.is_empty() {
            missing.without_frames += 1;
            continue;
        }
        match lane_executions(i, frames, coverage, &shares)? {
            Some(n) => out[i] = n / WARP,
            None => missing.outside_functions += 1,
        }
    }
    let mut issued = out.clone();
    for block in listing.blocks() {
        let count = block_count(&out[block.clone()]);
        issued[block].fill(count);
    }
    Ok(Executions {
        by_line: out,
        issued,
        unattributed: missing,
    })
}

/// The executions of a basic block, whose instructions all run as often, from their
/// estimates: the value most of them have (the larger on a tie), since a line's count
/// misleads for the few instructions the compiler moved or merged across lines (a load that
/// both sides of a branch share takes the line of one) and for guarded ones (an instruction
/// of an `if` turned into a predicate issues whenever its block runs).
fn block_count(estimates: &[f64]) -> f64 {
    let same = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
    let mut best = (0usize, 0.0f64);
    for &v in estimates {
        let votes = estimates.iter().filter(|&&w| same(v, w)).count();
        if votes > best.0 || (votes == best.0 && v > best.1) {
            best = (votes, v);
        }
    }
    best.1
}

/// Lane executions of instruction `at` with `frames` (innermost first), or `None` when a line
/// lies outside every function the host build compiled.
fn lane_executions(
    at: usize,
    frames: &[Frame],
    coverage: &Coverage,
    shares: &Shares<'_>,
) -> Result<Option<f64>, String> {
    let mut n = 1.0;
    for (k, frame) in frames.iter().enumerate() {
        let Some(count) = coverage.count_near(&frame.file, frame.line) else {
            return Ok(None);
        };
        let own = (k == 0).then_some(at);
        let line = count as f64 * shares.of(frame, &frames[k + 1..], own)?;
        if k + 1 == frames.len() {
            n *= line;
        } else {
            let calls = coverage
                .function_at(&frame.file, frame.line)
                .map_or(0, |f| f.calls);
            if calls == 0 {
                return Ok(Some(0.0));
            }
            n *= line / calls as f64;
        }
    }
    Ok(Some(n))
}

/// A backward branch the code kept: its frames and the instructions of its loop.
struct Kept<'a> {
    frames: &'a [Frame],
    from: usize,
    to: usize,
}

/// The share of a line's executions that one instruction of one inline instance has.
struct Shares<'a> {
    coverage: &'a Coverage,
    loops: &'a LoopIndex,
    kept: Vec<Kept<'a>>,
}

impl Shares<'_> {
    /// The share of the executions of `frame`'s line that one copy of it in the instance
    /// inlined at `chain` has: over the loops around the line in its own function (not one a
    /// lambda is defined in), 1 / copies for each loop the code unrolled; and for the own
    /// line of instruction `at` (`None` for a call site) that is the header line of a loop the
    /// code kept, the share of the trips (inside the kept loop) or of the entries (outside
    /// it) in the line's count, which gcov gives for both.
    fn of(&self, frame: &Frame, chain: &[Frame], at: Option<usize>) -> Result<f64, String> {
        let (Some(loops), Some(function)) = (
            self.loops.get(&frame.file),
            self.coverage.function_at(&frame.file, frame.line),
        ) else {
            return Ok(1.0);
        };
        let around = |l: &&SourceLoop| {
            l.holds(frame.line) && function.start <= l.header && l.last <= function.end
        };
        let mut share = 1.0;
        for l in loops.iter().filter(around) {
            let trips = self.trips(&frame.file, l)?;
            let mut kept = self.kept(&frame.file, l, loops, chain).peekable();
            if kept.peek().is_none() {
                share /= trips.copies();
            } else if let Some(at) = at
                && l.header == frame.line
                && trips.entries > 0.0
            {
                // Inside one of the loop's kept copies (one per copy of an outer unrolled
                // loop), or before it.
                let inside = kept.any(|k| k.from <= at && at <= k.to);
                share *= if inside { trips.body } else { trips.entries } / trips.header;
            }
        }
        Ok(share)
    }

    /// The backward branches that keep the loop `l` of `file` in the instance at `chain`:
    /// those whose own line (their innermost frame) lies in `l` and in no loop inside it,
    /// inlined at `chain`.
    fn kept<'s>(
        &'s self,
        file: &'s str,
        l: &'s SourceLoop,
        loops: &'s [SourceLoop],
        chain: &'s [Frame],
    ) -> impl Iterator<Item = &'s Kept<'s>> + 's {
        let innermost = |line: u32| {
            loops
                .iter()
                .filter(|other| other.holds(line))
                .max_by_key(|other| other.header)
        };
        self.kept.iter().filter(move |k| {
            k.frames.split_first().is_some_and(|(own, outer)| {
                own.file == file
                    && innermost(own.line).is_some_and(|inner| inner == l)
                    && outer == chain
            })
        })
    }

    /// How often the loop `l` of `file` was entered and how often its body was: the body's
    /// first line of its own (not in an inner loop or a lambda) runs once per trip, and the
    /// header's count is entries + trips - breaks (the -O0 code evaluates the condition on
    /// entry and after each trip that does not break). A body that is only an inner loop
    /// enters it once per trip.
    fn trips(&self, file: &str, l: &SourceLoop) -> Result<Trips, String> {
        let header = self
            .coverage
            .line(file, l.header)
            .ok_or_else(|| format!("{file}:{}: a loop whose header has no count", l.header))?
            as f64;
        let loops = &self.loops[file];
        let function = self.coverage.function_at(file, l.header);
        let own = |line: &u32| {
            let nested = loops
                .iter()
                .any(|inner| inner != l && inner.holds(*line) && l.holds(inner.header));
            !nested && self.coverage.function_at(file, *line) == function
        };
        let body = match (l.header + 1..=l.last)
            .filter(own)
            .find_map(|line| self.coverage.line(file, line))
        {
            Some(count) => count as f64,
            None => {
                // The first loop directly inside `l` (in no other loop inside it).
                let inner = loops
                    .iter()
                    .filter(|inner| *inner != l && l.holds(inner.header))
                    .find(|inner| {
                        !loops.iter().any(|mid| {
                            mid != l
                                && mid != *inner
                                && l.holds(mid.header)
                                && mid.holds(inner.header)
                        })
                    })
                    .ok_or_else(|| {
                        format!("{file}:{}: a loop whose body has no count", l.header)
                    })?;
                self.trips(file, inner)?.entries
            }
        };
        let breaks: u64 = l
            .breaks
            .iter()
            .filter_map(|&b| self.coverage.line(file, b))
            .sum();
        Ok(Trips {
            header,
            body,
            entries: header - body + breaks as f64,
        })
    }
}

/// The counts of a loop in a run.
struct Trips {
    /// Executions of its header line.
    header: f64,
    /// Trips: executions of its body.
    body: f64,
    /// Entries into the loop.
    entries: f64,
}

impl Trips {
    /// The copies of the body an unrolled loop has: its trips per entry, rounded up (a loop
    /// that leaves early by a `break` keeps the copies of its longest trip); 1 for a loop that
    /// never ran.
    fn copies(&self) -> f64 {
        if self.entries <= 0.0 {
            return 1.0;
        }
        (self.body / self.entries - 1e-9).ceil().max(1.0)
    }
}

/// Per-warp and per-unit executions of every instruction from two runs of the same work
/// units with different grids: run `k` has `warps[k]` warps and `units` units, and each
/// instruction runs `per_warp * warps + per_unit * units` times in all.
pub fn split_per_warp_and_unit(
    runs: [&[f64]; 2],
    warps: [f64; 2],
    units: f64,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    if warps[0] == warps[1] || units <= 0.0 {
        return Err("two runs of different warp counts over some units are needed".into());
    }
    let (a, b) = (runs[0], runs[1]);
    let per_warp: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y) / (warps[0] - warps[1]))
        .collect();
    let per_unit = a
        .iter()
        .zip(&per_warp)
        .map(|(x, w)| (x - w * warps[0]) / units)
        .collect();
    Ok((per_warp, per_unit))
}
