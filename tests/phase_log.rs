//! The opt-in phase timing (`SDP4BIT_PHASE_LOG`): one JSON line per call and rank, whose
//! phases add up to no more than the call's total. Its own test binary, because it sets the
//! environment variable for the whole process.

use half::bf16;
use sdp4bit::Preset;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, GradReduceScatter, PHASE_LOG_ENV, WeightAllGather};
use sdp4bit::layout::Topology;
use sdp4bit_test_support::{random::rank_grads, setups::cfg};

const PHASES: [&str; 7] = [
    "first_pass",
    "first_start",
    "first_wait",
    "second_pass",
    "second_start",
    "second_wait",
    "last_pass",
];

/// The number after `"key": ` in a log line.
fn field(line: &str, key: &str) -> f64 {
    let at = line
        .find(&format!("\"{key}\": "))
        .unwrap_or_else(|| panic!("{key} missing in {line}"));
    let rest = &line[at + key.len() + 4..];
    let end = rest.find([',', '}']).expect("a value ends");
    rest[..end].trim().parse().expect("a number")
}

#[test]
fn phase_log_writes_one_line_per_call_and_rank_with_phases_within_the_total() {
    let dir = std::env::temp_dir().join(format!("sdp4bit-phase-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // SAFETY: set before any thread of this test binary reads the environment.
    unsafe { std::env::set_var(PHASE_LOG_ENV, &dir) };
    let topo = Topology::uniform(2, 2).unwrap();
    let config = cfg(Preset::Sdp4bit, &[("pipeline_chunks", "2")]);
    let numel = 4 * 8192;
    let grads = rank_grads(3, 4, numel, 1.0);
    let params: Vec<bf16> = (0..numel)
        .map(|i| bf16::from_f32(i as f32 * 1e-4))
        .collect();
    LocalCluster::new(topo.clone()).run(|c| {
        let me = c.world.rank();
        let mut rs = GradReduceScatter::new(&config, &topo, me, numel, 9).unwrap();
        let mut shard = vec![0.0; numel / 4];
        let mut ag = WeightAllGather::new(&config, &topo, me, 9, &params).unwrap();
        let mut mine = params.clone();
        for step in 0..3 {
            rs.run(c, &grads[me], &mut shard, step).unwrap();
            ag.run(c.world, &mut mine, step).unwrap();
        }
    });
    for rank in 0..4 {
        for (kind, chunks, busy) in [
            (
                "reduce_scatter",
                2.0,
                &["first_pass", "second_pass", "last_pass"][..],
            ),
            ("all_gather", 1.0, &["first_pass", "last_pass"][..]),
        ] {
            let path = dir.join(format!("{kind}-bucket9-rank{rank}.jsonl"));
            let text = std::fs::read_to_string(&path).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), 3, "{kind} rank {rank}: {text}");
            for line in lines {
                assert_eq!(field(line, "chunks"), chunks, "{line}");
                let total = field(line, "total_ms");
                let sum: f64 = PHASES.iter().map(|p| field(line, &format!("{p}_ms"))).sum();
                assert!(
                    sum <= total + 1e-3,
                    "phases {sum} ms exceed the total {total}: {line}"
                );
                for p in busy {
                    assert!(
                        field(line, &format!("{p}_ms")) > 0.0,
                        "{p} not timed: {line}"
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
