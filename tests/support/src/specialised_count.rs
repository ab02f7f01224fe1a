//! The count of a specialised build's work unit from its structure, with the line-mapped count
//! ([`crate::kernel_count::count`]) deciding only which code a unit runs.
//!
//! A build specialised to one configuration unrolls every loop of a unit whose trip count is a
//! compile-time constant, and the compiler deletes each copy whose guard is a constant false
//! there (a Hadamard stage that does not apply to this copy of the stage loop, the pairs of a
//! butterfly a copy does not form). The line mapping gives every copy of a line its share of
//! the line's executions, so the copies left take too small a share: a block of them comes
//! out at a fraction of the passes that run it. Here a basic block of the unit's grid-stride
//! loop instead runs once per pass of the innermost loop the code kept around it (once per
//! unit, or the kept loop's trips per unit, which the count of its backward branch gives),
//! whenever the line mapping says that a unit enters it at all (its count is not 0); a block
//! that no unit enters runs never. That is a static count of the path the case takes. It also
//! counts code that only some lanes run (lane 0's scale store, the even lanes' code stores) as
//! the warp's issue that it is, and mends lines that gcov counts more than once per execution
//! (a call and the code after it on one line, a loop's header in each unrolled copy).
//!
//! Two kinds of code keep the line mapping: the cold paths of `kernels/` (blocks opened by a
//! `// Cold path` comment, [`cold_lines`]), which only some data take, and the out-of-line
//! subroutines the unit calls. Code outside the grid-stride loop runs per warp: its count per
//! unit goes to the warp (the run with one unit per warp gives both together).
//!
//! Loops are the natural loops of the backward branches: a branch's target and every block
//! that reaches the branch without passing through the target. The grid-stride loop is the
//! outermost loop of the entry point with the most work per unit by the line mapping (a
//! kernel may have a second one after it, a cold loop for the elements the first leaves).
//!
//! The assumption: a block that a unit enters, outside cold paths, runs on every pass of its
//! region. [`StructuralCount::blocks`] lists each block with both counts, to check.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;

use crate::kernel_count::DynamicCount;
use crate::sass::{Instruction, Listing};

/// Executions per unit below this are none (the split into per-warp and per-unit parts leaves
/// rounding noise).
const NONE: f64 = 1e-6;

/// The marker that opens a cold block in `kernels/`.
pub const COLD_MARKER: &str = "// Cold path";

/// Where a block lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// In the grid-stride loop, outside any loop the code kept inside it.
    Unit,
    /// In a loop the code kept inside the grid-stride loop.
    InnerLoop,
    /// In a cold path inside the grid-stride loop (line-mapped).
    Cold,
    /// In an out-of-line subroutine (line-mapped).
    Subroutine,
    /// Before or after the grid-stride loop (per warp).
    Outside,
}

/// One basic block and its counts per unit.
#[derive(Debug, Clone, PartialEq)]
pub struct CountedBlock {
    pub instructions: Range<usize>,
    pub place: Place,
    /// Passes of its region per unit: 1 in the unit, a kept loop's trips per unit.
    pub passes: f64,
    /// The line-mapped count per unit.
    pub mapped: f64,
    /// The structural count per unit.
    pub counted: f64,
}

/// A unit counted by its structure.
#[derive(Debug, Clone)]
pub struct StructuralCount {
    /// The count: per unit from the structure, per warp with the code outside the loop.
    pub count: DynamicCount,
    /// Every reachable block.
    pub blocks: Vec<CountedBlock>,
}

impl StructuralCount {
    /// Instructions per unit of the grid-stride loop outside its cold paths, by the structure
    /// and by the line mapping.
    pub fn hot_loop(&self) -> (f64, f64) {
        self.sum(|b| matches!(b.place, Place::Unit | Place::InnerLoop))
    }

    /// Instructions per unit of the cold paths and subroutines (line-mapped in both).
    pub fn cold(&self) -> f64 {
        self.sum(|b| matches!(b.place, Place::Cold | Place::Subroutine))
            .0
    }

    /// The instructions of the unit's own blocks outside cold paths, whether a unit enters
    /// them or not (the static count of a straight-line unit), or `None` when a loop the code
    /// kept inside the grid-stride loop runs.
    pub fn static_unit(&self) -> Option<f64> {
        let runs_inner = self
            .blocks
            .iter()
            .any(|b| b.place == Place::InnerLoop && b.passes > NONE);
        (!runs_inner).then(|| {
            self.blocks
                .iter()
                .filter(|b| b.place == Place::Unit)
                .map(|b| b.instructions.len() as f64)
                .sum()
        })
    }

    /// Σ over the blocks that `keep` selects of (structural, line-mapped) instructions per unit.
    fn sum(&self, keep: impl Fn(&CountedBlock) -> bool) -> (f64, f64) {
        self.blocks
            .iter()
            .filter(|b| keep(b))
            .fold((0.0, 0.0), |(s, m), b| {
                let n = b.instructions.len() as f64;
                (s + n * b.counted, m + n * b.mapped)
            })
    }
}

/// The lines (1-based) inside the cold blocks of `source` (the opening line excluded: its
/// condition runs on every path).
pub fn cold_lines(source: &str) -> BTreeSet<u32> {
    let mut cold = BTreeSet::new();
    let lines: Vec<&str> = source.lines().collect();
    for (start, text) in lines.iter().enumerate() {
        if !text.contains(COLD_MARKER) {
            continue;
        }
        let mut depth = 0i32;
        for (i, line) in lines.iter().enumerate().skip(start) {
            let mut code = line.split("//").next().unwrap_or("");
            if i == start {
                // `} else {`: the brace that closes the previous block is not this one's.
                code = code.trim_start().trim_start_matches('}');
            }
            depth += code.matches('{').count() as i32 - code.matches('}').count() as i32;
            if i > start {
                cold.insert(i as u32 + 1);
            }
            if depth <= 0 && i > start {
                break;
            }
        }
    }
    cold
}

/// The cold lines of every source, by base name.
pub fn cold_index(sources: &HashMap<String, String>) -> HashMap<String, BTreeSet<u32>> {
    sources
        .iter()
        .map(|(name, text)| (name.clone(), cold_lines(text)))
        .collect()
}

/// Whether one of an instruction's frames lies in a cold block.
pub fn is_cold(ins: &Instruction, cold: &HashMap<String, BTreeSet<u32>>) -> bool {
    ins.frames.iter().any(|f| {
        cold.get(f.file.as_str())
            .is_some_and(|lines| lines.contains(&f.line))
    })
}

/// The control flow between the reachable basic blocks of a listing.
struct Flow {
    blocks: Vec<Range<usize>>,
    /// The block of each instruction.
    block_of: Vec<usize>,
    predecessors: Vec<Vec<usize>>,
    successors: Vec<Vec<usize>>,
}

impl Flow {
    fn of(listing: &Listing, reachable: &[bool]) -> Result<Self, String> {
        let blocks = listing.blocks();
        let mut block_of = vec![0; listing.instructions.len()];
        for (k, b) in blocks.iter().enumerate() {
            for i in b.clone() {
                block_of[i] = k;
            }
        }
        let mut predecessors = vec![Vec::new(); blocks.len()];
        let mut successors = vec![Vec::new(); blocks.len()];
        for (k, b) in blocks.iter().enumerate() {
            if b.is_empty() || !reachable[b.start] {
                continue;
            }
            for s in listing.successors(b.end - 1)? {
                predecessors[block_of[s]].push(k);
                successors[k].push(block_of[s]);
            }
        }
        Ok(Self {
            blocks,
            block_of,
            predecessors,
            successors,
        })
    }

    /// Whether every path from the entry to the block of `branch` passes the block of
    /// `target` (the mark of a loop's head).
    fn dominates(&self, target: usize, branch: usize) -> bool {
        let (head, latch) = (self.block_of[target], self.block_of[branch]);
        if head == 0 || head == latch {
            return true;
        }
        let mut seen = vec![false; self.blocks.len()];
        let mut stack = vec![0];
        while let Some(b) = stack.pop() {
            if b == head || std::mem::replace(&mut seen[b], true) {
                continue;
            }
            if b == latch {
                return false;
            }
            stack.extend(self.successors[b].iter().copied());
        }
        true
    }

    /// The natural loop of the backward branch `branch` -> `target`: its blocks.
    fn natural_loop(&self, branch: usize, target: usize) -> BTreeSet<usize> {
        let head = self.block_of[target];
        let mut body = BTreeSet::from([head]);
        let mut stack = vec![self.block_of[branch]];
        while let Some(b) = stack.pop() {
            if body.insert(b) {
                stack.extend(self.predecessors[b].iter().copied());
            }
        }
        body
    }
}

/// The structural count of `listing`'s unit from the line-mapped count `mapped` of the same
/// code; `cold` holds the cold lines of every source its frames name ([`cold_index`]).
pub fn structural(
    listing: &Listing,
    mapped: &DynamicCount,
    cold: &HashMap<String, BTreeSet<u32>>,
) -> Result<StructuralCount, String> {
    let reachable = listing.reachable()?;
    let flow = Flow::of(listing, &reachable)?;
    // Every kept loop with its latch (the backward branch); a backward jump whose target does
    // not dominate it is no loop's.
    let loops: Vec<(usize, BTreeSet<usize>)> = listing
        .back_edges(&reachable)?
        .into_iter()
        .filter(|&(branch, target)| flow.dominates(target, branch))
        .map(|(branch, target)| (branch, flow.natural_loop(branch, target)))
        .collect();
    let subroutines = listing.subroutines_start();
    // The grid-stride loop: of the entry point's outermost loops, the one with the most work
    // per unit (a kernel may have a second, cold one after it for the rest of its elements).
    let work = |body: &BTreeSet<usize>| -> f64 {
        body.iter()
            .map(|&k| flow.blocks[k].len() as f64 * mapped.per_unit[flow.blocks[k].start])
            .sum()
    };
    let grid_stride = loops
        .iter()
        .filter(|(latch, body)| {
            *latch < subroutines
                && !loops
                    .iter()
                    .any(|(_, other)| other.len() > body.len() && body.is_subset(other))
        })
        .max_by(|a, b| work(&a.1).total_cmp(&work(&b.1)))
        .ok_or("no grid-stride loop")?;
    // The loops kept inside it (others, such as a per-warp loop after it or a subroutine's,
    // are not the unit's).
    let inner: Vec<&(usize, BTreeSet<usize>)> = loops
        .iter()
        .filter(|(latch, body)| *latch != grid_stride.0 && body.is_subset(&grid_stride.1))
        .collect();
    let mut per_unit = mapped.per_unit.clone();
    let mut per_warp = mapped.per_warp.clone();
    let mut blocks = Vec::new();
    for (k, block) in flow.blocks.iter().enumerate() {
        let first = block.start;
        if block.is_empty() || !reachable[first] {
            continue;
        }
        let issued = mapped.per_unit[first];
        let cold_share = block
            .clone()
            .filter(|&i| is_cold(&listing.instructions[i], cold))
            .count();
        let (place, passes) = if first >= subroutines {
            (Place::Subroutine, issued)
        } else if !grid_stride.1.contains(&k) {
            (Place::Outside, 0.0)
        } else if 2 * cold_share > block.len() {
            (Place::Cold, issued)
        } else {
            let around = inner
                .iter()
                .filter(|(_, body)| body.contains(&k))
                .min_by_key(|(_, body)| body.len());
            match around {
                Some(&&(latch, _)) => (Place::InnerLoop, mapped.per_unit[latch]),
                None => (Place::Unit, 1.0),
            }
        };
        let counted = match place {
            Place::Subroutine | Place::Cold => issued,
            Place::Unit | Place::InnerLoop if issued > NONE => passes,
            _ => 0.0,
        };
        for i in block.clone() {
            if place == Place::Outside {
                per_warp[i] = mapped.per_warp[i] + mapped.per_unit[i];
            }
            per_unit[i] = counted;
        }
        blocks.push(CountedBlock {
            instructions: block.clone(),
            place,
            passes,
            mapped: issued,
            counted,
        });
    }
    Ok(StructuralCount {
        count: DynamicCount {
            per_warp,
            per_unit,
            ..mapped.clone()
        },
        blocks,
    })
}
