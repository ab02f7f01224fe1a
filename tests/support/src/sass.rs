//! One kernel's SASS from a listing with line information (`nvdisasm -c -gi`): its
//! instructions with their source frames (the line, then each call site it is inlined at), its
//! out-of-line subroutines, and which instructions a warp can reach without diverging.
//!
//! The kernel's section holds the entry point and, after it, the device functions it calls
//! (`$entry$name:`, the compiler's own slow paths `$__internal_N_$name:`). A warp whose lanes
//! agree never takes `BRA.DIV` (the jump to the divergent path of a convergence region), so
//! the code reachable only through it runs on divergent warps alone.

use std::collections::HashMap;

/// A source position of an instruction: a file's base name and a line.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frame {
    pub file: String,
    pub line: u32,
}

/// One instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instruction {
    /// Byte offset in the section.
    pub address: u32,
    /// The opcode with its modifiers (`LDG.E.128.CONSTANT`).
    pub opcode: String,
    /// The guard predicate (`@!P0`), if any.
    pub guard: Option<String>,
    /// The operands as written.
    pub operands: String,
    /// The label a branch or call names.
    pub target: Option<String>,
    /// Its source frames, innermost first (empty when the listing gives none).
    pub frames: Vec<Frame>,
}

impl Instruction {
    /// The opcode without modifiers (`LDG`).
    pub fn base(&self) -> &str {
        self.opcode.split('.').next().unwrap_or_default()
    }

    /// Whether a branch jumps to the divergent path of a convergence region.
    fn is_divergence_branch(&self) -> bool {
        self.opcode.starts_with("BRA.DIV")
    }
}

/// One kernel entry point's code.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    pub instructions: Vec<Instruction>,
    /// Label -> index of the instruction it names.
    labels: HashMap<String, usize>,
    /// `BRX` jump tables: index -> the labels it may jump to.
    jump_tables: HashMap<usize, Vec<String>>,
}

impl Listing {
    /// The code of `entry` in `listing` (`nvdisasm -c`, with or without `-gi`).
    pub fn of_entry(listing: &str, entry: &str) -> Result<Self, String> {
        let mut out = Listing::default();
        let mut inside = false;
        let mut pending: Vec<Frame> = Vec::new();
        let mut frames: Vec<Frame> = Vec::new();
        for raw in listing.lines() {
            let line = raw.trim();
            if let Some(section) = line.strip_prefix(".text.") {
                inside = section.strip_suffix(':') == Some(entry);
                continue;
            }
            if !inside {
                continue;
            }
            if let Some(rest) = line.strip_prefix("//## File \"") {
                pending.extend(frame_of(rest));
                continue;
            }
            if let Some(label) = line.strip_suffix(':') {
                if label.starts_with('$') {
                    // A subroutine starts: no frames carry over from the code before it.
                    frames.clear();
                }
                out.labels.insert(label.to_owned(), out.instructions.len());
                continue;
            }
            let Some((address, text)) = line
                .strip_prefix("/*")
                .and_then(|r| r.split_once("*/"))
                .and_then(|(a, t)| u32::from_str_radix(a, 16).ok().map(|a| (a, t)))
            else {
                continue;
            };
            let text = text.trim().trim_end_matches(';').trim();
            let (guard, text) = match text.split_once(char::is_whitespace) {
                Some((g, rest)) if g.starts_with('@') => (Some(g.to_owned()), rest.trim()),
                _ => (None, text),
            };
            let (opcode, operands) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
            if opcode.is_empty() || opcode == "NOP" {
                continue;
            }
            if !pending.is_empty() {
                frames = std::mem::take(&mut pending);
            }
            let target = operands
                .split("`(")
                .nth(1)
                .and_then(|t| t.split(')').next())
                .map(str::to_owned);
            if let Some(list) = operands.split("BRANCH_TARGETS ").nth(1) {
                let labels = list
                    .split(['"', '*', ')'])
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .map(|l| l.trim().to_owned())
                    .collect();
                out.jump_tables.insert(out.instructions.len(), labels);
            }
            out.instructions.push(Instruction {
                address,
                opcode: opcode.to_owned(),
                guard,
                operands: operands.trim().to_owned(),
                target,
                frames: frames.clone(),
            });
        }
        if out.instructions.is_empty() {
            return Err(format!("the listing has no code for `{entry}`"));
        }
        Ok(out)
    }

    /// The index of the instruction `label` names.
    pub fn label(&self, label: &str) -> Option<usize> {
        self.labels.get(label).copied()
    }

    /// The index of the first instruction of the out-of-line subroutines the entry point
    /// calls (listed after its own code, each from a `$` label); the length when it has none.
    pub fn subroutines_start(&self) -> usize {
        self.labels
            .iter()
            .filter(|(label, _)| label.starts_with('$'))
            .map(|(_, &i)| i)
            .min()
            .unwrap_or(self.instructions.len())
    }

    /// The instructions control can pass to after instruction `i` on a warp whose lanes agree:
    /// the next one unless it ends the path, and the targets of branches and calls (`BRA.DIV`
    /// excluded).
    pub fn successors(&self, i: usize) -> Result<Vec<usize>, String> {
        let ins = &self.instructions[i];
        let conditional = ins.guard.as_deref().is_some_and(|g| g != "@PT");
        let target = || {
            let label = ins
                .target
                .as_deref()
                .ok_or_else(|| format!("{:#x} {}: no target label", ins.address, ins.opcode))?;
            self.label(label)
                .ok_or_else(|| format!("{:#x}: unknown label {label}", ins.address))
        };
        let next = (i + 1 < self.instructions.len()).then_some(i + 1);
        let mut out = Vec::new();
        match ins.base() {
            "BRA" if ins.is_divergence_branch() => out.extend(next),
            "BRA" => {
                out.push(target()?);
                if conditional {
                    out.extend(next);
                }
            }
            "BRX" | "JMX" => {
                let labels = self.jump_tables.get(&i).ok_or_else(|| {
                    format!("{:#x}: an indirect branch without targets", ins.address)
                })?;
                for label in labels {
                    out.push(
                        self.label(label)
                            .ok_or_else(|| format!("{:#x}: unknown label {label}", ins.address))?,
                    );
                }
            }
            "EXIT" | "RET" | "KILL" => {
                if conditional {
                    out.extend(next);
                }
            }
            "CALL" => {
                out.push(target()?);
                out.extend(next);
            }
            _ => out.extend(next),
        }
        Ok(out)
    }

    /// Which instructions a warp whose lanes agree can reach from the entry point.
    pub fn reachable(&self) -> Result<Vec<bool>, String> {
        let mut seen = vec![false; self.instructions.len()];
        let mut stack = vec![0];
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut seen[i], true) {
                continue;
            }
            stack.extend(self.successors(i)?.into_iter().filter(|&s| !seen[s]));
        }
        Ok(seen)
    }

    /// The basic blocks, as ranges of instruction indices: a block starts at the entry, at a
    /// label and after a branch or exit, and runs to the next start (a call returns into its
    /// block).
    pub fn blocks(&self) -> Vec<std::ops::Range<usize>> {
        let n = self.instructions.len();
        let mut starts = vec![false; n + 1];
        starts[0] = true;
        starts[n] = true;
        for &i in self.labels.values() {
            starts[i.min(n)] = true;
        }
        for (i, ins) in self.instructions.iter().enumerate() {
            if matches!(ins.base(), "BRA" | "BRX" | "JMX" | "EXIT" | "RET" | "KILL") {
                starts[i + 1] = true;
            }
        }
        let bounds: Vec<usize> = (0..=n).filter(|&i| starts[i]).collect();
        bounds.windows(2).map(|w| w[0]..w[1]).collect()
    }

    /// The reachable branches that jump back (`(branch, target)` with `target <= branch`):
    /// the loops the code kept.
    pub fn back_edges(&self, reachable: &[bool]) -> Result<Vec<(usize, usize)>, String> {
        let mut out = Vec::new();
        for (i, ins) in self.instructions.iter().enumerate() {
            if !reachable[i] || ins.base() != "BRA" || ins.is_divergence_branch() {
                continue;
            }
            for s in self.successors(i)? {
                if s <= i && Some(s) != (i + 1 < self.instructions.len()).then_some(i + 1) {
                    out.push((i, s));
                }
            }
        }
        Ok(out)
    }
}

/// The frame of `path", line N` (the rest of a `//## File "` comment; an `inlined at` part is
/// the next comment's frame).
fn frame_of(rest: &str) -> Option<Frame> {
    let (path, after) = rest.split_once('"')?;
    let line = after
        .trim_start_matches(", line ")
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    Some(Frame {
        file: crate::gcov::base_name(path).to_owned(),
        line,
    })
}
