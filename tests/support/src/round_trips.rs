//! The dependent memory round trips of a kernel's work unit, read from its SASS: a warp issues
//! in program order and stops at the first instruction that reads a register a global load
//! has not filled yet; every load issued before that point is then in flight together, one
//! round trip. Walking the code in address order, each instruction that reads a register of a
//! pending load (`LDG`, `LD`) is such a wait, after which no load is pending; the round trips
//! per unit are the waits' executions per unit.
//!
//! The walk follows the code's layout, not its branches (a load consumed in the next trip of
//! a loop is not seen), and counts every wait as a round trip to DRAM, hits in L1 or L2
//! included.

use std::collections::BTreeSet;

use crate::sass::{Frame, Instruction, Listing};

/// One place where a warp waits for its loads.
#[derive(Debug, Clone, PartialEq)]
pub struct Wait {
    /// The index of the waiting instruction.
    pub index: usize,
    /// Its executions per unit.
    pub per_unit: f64,
    /// The innermost frame of the first load it waits for.
    pub load: Option<Frame>,
}

/// The waits of `listing` with their executions per unit: `per_unit` is how often each
/// instruction issues, `by_line` how often its own line's work is done (a guarded load whose
/// line never runs, predicated off in a block that runs, fills no register).
pub fn waits(listing: &Listing, per_unit: &[f64], by_line: &[f64]) -> Vec<Wait> {
    let mut out = Vec::new();
    // Registers of the loads issued since the last wait, with the first such load.
    let mut pending: BTreeSet<u32> = BTreeSet::new();
    let mut first_load: Option<usize> = None;
    for (i, ins) in listing.instructions.iter().enumerate() {
        if per_unit[i] <= 0.0 {
            continue;
        }
        let (written, read) = registers(ins);
        if read.iter().any(|r| pending.contains(r)) {
            out.push(Wait {
                index: i,
                per_unit: per_unit[i],
                load: first_load.and_then(|l| listing.instructions[l].frames.first().cloned()),
            });
            pending.clear();
            first_load = None;
        }
        for r in &written {
            pending.remove(r);
        }
        let live = ins.guard.is_none() || by_line[i] > 0.0;
        if matches!(ins.base(), "LDG" | "LD") && live {
            pending.extend(written);
            first_load.get_or_insert(i);
        }
    }
    out
}

/// The general registers an instruction writes and reads (`R2.64` names R2 and R3; a load's
/// destination and a store's data cover the access's width, from the opcode).
fn registers(ins: &Instruction) -> (Vec<u32>, Vec<u32>) {
    let width = if ins.opcode.contains(".128") {
        4
    } else if ins.opcode.contains(".64") {
        2
    } else {
        1
    };
    let store = matches!(ins.base(), "ST" | "STG" | "STS" | "STL");
    let no_destination = store
        || matches!(
            ins.base(),
            "RED" | "REDG" | "BRA" | "BRX" | "RET" | "CALL" | "EXIT"
        );
    let mut written = Vec::new();
    let mut read = Vec::new();
    for (k, operand) in ins.operands.split(',').map(str::trim).enumerate() {
        let regs = registers_in(operand);
        if k == 0 && !no_destination && is_register(operand) {
            written.extend((0..width).map(|w| regs[0].0 + w));
            continue;
        }
        for (r, pair) in regs {
            let n = if pair {
                2
            } else if store && k > 0 {
                width
            } else {
                1
            };
            read.extend((0..n).map(|w| r + w));
        }
    }
    (written, read)
}

/// Whether an operand is one general register (`R4`, `R4.reuse`, `-R4`, `|R4|`).
fn is_register(operand: &str) -> bool {
    let core = operand.trim_matches(|c| c == '-' || c == '|' || c == '!' || c == '~');
    let core = core.strip_suffix(".reuse").unwrap_or(core);
    core.strip_prefix('R')
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The general registers named in an operand, each with whether it names a pair (`.64`).
fn registers_in(operand: &str) -> Vec<(u32, bool)> {
    let bytes = operand.as_bytes();
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let starts = bytes[at] == b'R'
            && (at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_'));
        if starts {
            let digits = bytes[at + 1..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            if digits > 0 {
                let end = at + 1 + digits;
                let n: u32 = operand[at + 1..end].parse().unwrap_or(0);
                let pair = operand[end..].starts_with(".64");
                out.push((n, pair));
                at = end;
                continue;
            }
        }
        at += 1;
    }
    out
}
