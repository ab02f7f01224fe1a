//! Opt-in wall-clock timing of the phases of one collective call (the passes, the start of
//! each exchange and the time spent waiting for it), for finding where a step's time goes on a
//! real or emulated cluster.
//!
//! Off unless the environment variable [`PHASE_LOG_ENV`] names a directory when the collective
//! is planned; then every call appends one JSON line to `<dir>/<kind>-bucket<id>-rank<z>.jsonl`:
//! `{"chunks": P, "total_ms": .., "<phase>_ms": .., ...}`. Off, a phase costs one branch.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// The environment variable that turns phase timing on: a directory for the logs.
pub const PHASE_LOG_ENV: &str = "SDP4BIT_PHASE_LOG";

/// A phase of a collective call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The first gradient quantization (all chunks), or the weight encode.
    FirstPass,
    /// Issuing the first-level exchanges.
    FirstStart,
    /// Blocked waiting for the first-level exchanges (a blocking exchange counts here whole).
    FirstWait,
    /// The requantization between the levels.
    SecondPass,
    /// Issuing the second-level exchanges.
    SecondStart,
    /// Blocked waiting for the second-level exchanges.
    SecondWait,
    /// The last dequantize-sum, or the weight apply (and qWD's reference copy).
    LastPass,
}

const PHASES: [(Phase, &str); 7] = [
    (Phase::FirstPass, "first_pass"),
    (Phase::FirstStart, "first_start"),
    (Phase::FirstWait, "first_wait"),
    (Phase::SecondPass, "second_pass"),
    (Phase::SecondStart, "second_start"),
    (Phase::SecondWait, "second_wait"),
    (Phase::LastPass, "last_pass"),
];

/// Where one collective object's phase times go, when timing is on.
#[derive(Debug, Clone)]
pub(crate) struct PhaseLog {
    path: PathBuf,
}

impl PhaseLog {
    /// The log of collective `kind` ("reduce_scatter", "all_gather") for bucket `bucket_id`
    /// of DP rank `rank`, if [`PHASE_LOG_ENV`] is set.
    pub(crate) fn from_env(kind: &str, bucket_id: u32, rank: usize) -> Option<Self> {
        let dir = std::env::var_os(PHASE_LOG_ENV)?;
        Some(Self {
            path: PathBuf::from(dir).join(format!("{kind}-bucket{bucket_id}-rank{rank}.jsonl")),
        })
    }
}

/// The phase times of one call: running totals, written to the log when the call ends.
#[derive(Debug)]
pub(crate) struct PhaseClock<'a> {
    log: Option<&'a PhaseLog>,
    start: Instant,
    totals_ms: [f64; PHASES.len()],
}

impl<'a> PhaseClock<'a> {
    /// Starts timing a call (a no-op clock when `log` is `None`).
    pub(crate) fn start(log: Option<&'a PhaseLog>) -> Self {
        Self {
            log,
            start: Instant::now(),
            totals_ms: [0.0; PHASES.len()],
        }
    }

    /// Runs `f`, adding its wall time to `phase` when timing is on.
    pub(crate) fn time<R>(&mut self, phase: Phase, f: impl FnOnce() -> R) -> R {
        if self.log.is_none() {
            return f();
        }
        let begin = Instant::now();
        let result = f();
        let slot = PHASES
            .iter()
            .position(|(p, _)| *p == phase)
            .expect("every phase is listed");
        self.totals_ms[slot] += begin.elapsed().as_secs_f64() * 1e3;
        result
    }

    /// Appends this call's line to the log (errors writing it are ignored: timing must never
    /// fail a collective).
    pub(crate) fn finish(self, chunks: usize) {
        let Some(log) = self.log else {
            return;
        };
        let mut line = format!(
            "{{\"chunks\": {chunks}, \"total_ms\": {:.4}",
            self.start.elapsed().as_secs_f64() * 1e3
        );
        for ((_, name), ms) in PHASES.iter().zip(self.totals_ms) {
            line.push_str(&format!(", \"{name}_ms\": {ms:.4}"));
        }
        line.push_str("}\n");
        if let Ok(mut file) = OpenOptions::new().create(true).append(true).open(&log.path) {
            let _ = file.write_all(line.as_bytes());
        }
    }
}
