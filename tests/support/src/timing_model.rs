//! A kernel's time from its bytes, its warp instructions and the serial phases of its work
//! units, on a GPU described by a few numbers.
//!
//! Three bounds, the largest of which is the prediction:
//!
//! - memory: the bytes read and written over the bandwidth a device-to-device copy reaches
//!   (read + written) on the same GPU;
//! - issue: the warp instructions over what the multiprocessors issue (4 schedulers of one
//!   instruction per clock each) at an issue efficiency;
//! - serial: a warp takes its units one after another, each `R` dependent round trips to
//!   memory of latency `L` and `N` warp instructions `c` cycles apart, so a multiprocessor
//!   finishes at most `resident warps / (R L + N c / clock)` units per second.

/// The GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpu {
    pub multiprocessors: f64,
    pub clock_hz: f64,
    /// Warp instructions one multiprocessor issues per clock at most.
    pub issue_per_clock: f64,
    /// A device-to-device copy's bytes read + written per second.
    pub copy_bytes_per_s: f64,
}

/// One kernel call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Call {
    /// Bytes read plus bytes written.
    pub bytes: f64,
    /// Warp instructions in all.
    pub instructions: f64,
    /// Work units (what one warp takes per step of its grid-stride loop).
    pub units: f64,
    /// Warp instructions of one unit.
    pub unit_instructions: f64,
    /// Dependent round trips to memory of one unit.
    pub unit_round_trips: f64,
    /// Warps resident on one multiprocessor (registers and block size).
    pub resident_warps: f64,
    /// Warps of the launch.
    pub launched_warps: f64,
}

/// The constants the serial and issue bounds need.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Constants {
    /// Loaded memory latency, seconds.
    pub latency_s: f64,
    /// Average cycles between two instructions of one warp.
    pub cycles_per_instruction: f64,
    /// The fraction of the issue rate a kernel reaches.
    pub issue_efficiency: f64,
}

/// The bound that sets a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Memory,
    Issue,
    Serial,
}

impl Bound {
    pub fn name(self) -> &'static str {
        match self {
            Bound::Memory => "memory",
            Bound::Issue => "issue",
            Bound::Serial => "serial",
        }
    }
}

/// The three bounds of one call, seconds, and the largest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub memory_s: f64,
    pub issue_s: f64,
    pub serial_s: f64,
}

impl Prediction {
    /// The predicted time.
    pub fn seconds(&self) -> f64 {
        self.memory_s.max(self.issue_s).max(self.serial_s)
    }

    /// The bound that sets it.
    pub fn bound(&self) -> Bound {
        let t = self.seconds();
        if t == self.serial_s {
            Bound::Serial
        } else if t == self.issue_s {
            Bound::Issue
        } else {
            Bound::Memory
        }
    }
}

/// The bounds of `call` on `gpu`.
pub fn predict(gpu: &Gpu, call: &Call, k: &Constants) -> Prediction {
    let memory_s = call.bytes / gpu.copy_bytes_per_s;
    let issue_rate = gpu.multiprocessors * gpu.issue_per_clock * gpu.clock_hz * k.issue_efficiency;
    let issue_s = call.instructions / issue_rate;
    // Warps at work on one multiprocessor: as many as fit, or as many as were launched.
    let warps = call
        .resident_warps
        .min(call.launched_warps / gpu.multiprocessors)
        .max(1.0);
    let unit_s = call.unit_round_trips * k.latency_s
        + call.unit_instructions * k.cycles_per_instruction / gpu.clock_hz;
    let serial_s = call.units * unit_s / (gpu.multiprocessors * warps);
    Prediction {
        memory_s,
        issue_s,
        serial_s,
    }
}

/// The ranges searched for the fitted constants (the issue efficiency is given).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Search {
    pub latency_s: (f64, f64, f64),
    pub cycles_per_instruction: (f64, f64, f64),
    pub issue_efficiency: f64,
}

/// Sum over the rows of ln(predicted / measured)^2.
pub fn squared_log_error(gpu: &Gpu, rows: &[(Call, f64)], k: &Constants) -> f64 {
    rows.iter()
        .map(|(call, measured)| (predict(gpu, call, k).seconds() / measured).ln().powi(2))
        .sum()
}

/// The latency and cycles per instruction (on the grids of `search`: start, end, step) that
/// minimise [`squared_log_error`] over `rows` (call, measured seconds).
pub fn fit(gpu: &Gpu, rows: &[(Call, f64)], search: &Search) -> Constants {
    let steps = |(start, end, step): (f64, f64, f64)| {
        let n = ((end - start) / step).round() as usize;
        (0..=n).map(move |i| start + step * i as f64)
    };
    let mut best = (f64::INFINITY, None);
    for latency_s in steps(search.latency_s) {
        for cycles_per_instruction in steps(search.cycles_per_instruction) {
            let k = Constants {
                latency_s,
                cycles_per_instruction,
                issue_efficiency: search.issue_efficiency,
            };
            let error = squared_log_error(gpu, rows, &k);
            if error < best.0 {
                best = (error, Some(k));
            }
        }
    }
    best.1.expect("a non-empty search grid")
}

/// Each row's prediction by the constants fitted to the other rows.
pub fn leave_one_out(gpu: &Gpu, rows: &[(Call, f64)], search: &Search) -> Vec<f64> {
    (0..rows.len())
        .map(|left| {
            let others: Vec<(Call, f64)> = rows
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != left)
                .map(|(_, r)| *r)
                .collect();
            predict(gpu, &rows[left].0, &fit(gpu, &others, search)).seconds()
        })
        .collect()
}
