//! The phases of one collective call (the passes, the start of each exchange and the time
//! spent waiting for it): profiler ranges around each, and opt-in wall-clock timing, for
//! finding where a step's time goes.
//!
//! Ranges: where the embedding process registered [`ProfilerRanges`] (the torch extension
//! registers torch.profiler's), each call is a range named `sdp4bit.<kind>` holding one range
//! per phase, `sdp4bit.<kind>.<phase>` (`encode`, `exchange_start`, `exchange_wait`,
//! `requantize`, `second_exchange_start`, `second_exchange_wait`, `decode`).
//!
//! Timing: off unless the environment variable [`PHASE_LOG_ENV`] names a directory when the
//! collective is planned; then every call appends one JSON line to
//! `<dir>/<kind>-bucket<id>-rank<z>.jsonl`: `{"chunks": P, "total_ms": .., "<phase>_ms": ..,
//! ...}`. With neither, a phase costs two branches.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;
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

/// Which collective a call is, as ranges and logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CollectiveKind {
    /// The gradient reduce-scatter.
    ReduceScatter,
    /// The weight all-gather.
    AllGather,
    /// The gradient all-reduce across the groups of hybrid sharding.
    CrossGroupAllReduce,
}

impl CollectiveKind {
    /// Its name in logs and ranges.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::ReduceScatter => "reduce_scatter",
            Self::AllGather => "all_gather",
            Self::CrossGroupAllReduce => "cross_group_all_reduce",
        }
    }

    /// The range of a whole call, then one per phase in [`PHASES`]' order.
    fn ranges(self) -> &'static [&'static str; PHASES.len() + 1] {
        macro_rules! ranges {
            ($kind:literal) => {
                [
                    concat!("sdp4bit.", $kind),
                    concat!("sdp4bit.", $kind, ".encode"),
                    concat!("sdp4bit.", $kind, ".exchange_start"),
                    concat!("sdp4bit.", $kind, ".exchange_wait"),
                    concat!("sdp4bit.", $kind, ".requantize"),
                    concat!("sdp4bit.", $kind, ".second_exchange_start"),
                    concat!("sdp4bit.", $kind, ".second_exchange_wait"),
                    concat!("sdp4bit.", $kind, ".decode"),
                ]
            };
        }
        const REDUCE_SCATTER: [&str; PHASES.len() + 1] = ranges!("reduce_scatter");
        const ALL_GATHER: [&str; PHASES.len() + 1] = ranges!("all_gather");
        const CROSS_GROUP: [&str; PHASES.len() + 1] = ranges!("cross_group_all_reduce");
        match self {
            Self::ReduceScatter => &REDUCE_SCATTER,
            Self::AllGather => &ALL_GATHER,
            Self::CrossGroupAllReduce => &CROSS_GROUP,
        }
    }
}

/// The embedding process's profiler: `open` starts a named range on the calling thread,
/// `close` ends the innermost one that thread opened.
#[derive(Debug, Clone, Copy)]
pub struct ProfilerRanges {
    /// Starts a range.
    pub open: fn(&'static str),
    /// Ends the innermost open range of the calling thread.
    pub close: fn(),
}

static PROFILER_RANGES: OnceLock<ProfilerRanges> = OnceLock::new();

/// Registers the profiler every collective call opens its ranges in, once per process; returns
/// whether these were registered (false: others were, and stay).
pub fn set_profiler_ranges(ranges: ProfilerRanges) -> bool {
    PROFILER_RANGES.set(ranges).is_ok()
}

/// An open profiler range, closed when dropped (also when a phase fails or panics).
struct OpenRange(&'static ProfilerRanges);

impl OpenRange {
    fn open(name: &'static str) -> Option<Self> {
        PROFILER_RANGES.get().map(|ranges| {
            (ranges.open)(name);
            Self(ranges)
        })
    }
}

impl Drop for OpenRange {
    fn drop(&mut self) {
        (self.0.close)();
    }
}

/// Where one collective object's phase times go, when timing is on.
#[derive(Debug, Clone)]
pub(crate) struct PhaseLog {
    path: PathBuf,
}

impl PhaseLog {
    /// The log of collective `kind` for bucket `bucket_id` of DP rank `rank`, if
    /// [`PHASE_LOG_ENV`] is set.
    pub(crate) fn from_env(kind: CollectiveKind, bucket_id: u32, rank: usize) -> Option<Self> {
        let dir = std::env::var_os(PHASE_LOG_ENV)?;
        let kind = kind.name();
        Some(Self {
            path: PathBuf::from(dir).join(format!("{kind}-bucket{bucket_id}-rank{rank}.jsonl")),
        })
    }
}

/// One call: its profiler range (closed when the clock is dropped) and its phase times,
/// running totals written to the log when the call ends.
pub(crate) struct PhaseClock<'a> {
    kind: CollectiveKind,
    log: Option<&'a PhaseLog>,
    start: Instant,
    totals_ms: [f64; PHASES.len()],
    _call: Option<OpenRange>,
}

impl<'a> PhaseClock<'a> {
    /// Starts a call of collective `kind` (timed when `log` is given).
    pub(crate) fn start(kind: CollectiveKind, log: Option<&'a PhaseLog>) -> Self {
        Self {
            kind,
            log,
            start: Instant::now(),
            totals_ms: [0.0; PHASES.len()],
            _call: OpenRange::open(kind.ranges()[0]),
        }
    }

    /// Runs `f` inside the profiler range of `phase`, adding its wall time to `phase` when
    /// timing is on.
    pub(crate) fn time<R>(&mut self, phase: Phase, f: impl FnOnce() -> R) -> R {
        let slot = PHASES
            .iter()
            .position(|(p, _)| *p == phase)
            .expect("every phase is listed");
        let _range = OpenRange::open(self.kind.ranges()[slot + 1]);
        if self.log.is_none() {
            return f();
        }
        let begin = Instant::now();
        let result = f();
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
