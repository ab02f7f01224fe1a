//! The profiler ranges of every collective call (`set_profiler_ranges`): on each rank's thread a
//! call is one range holding its phases' ranges, every range closed, also when a call fails.
//! Its own test binary, because the ranges are registered once per process.

use std::cell::RefCell;
use std::sync::Mutex;

use half::bf16;
use sdp4bit::Preset;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{
    Comm, GradReduceScatter, ProfilerRanges, WeightAllGather, set_profiler_ranges,
};
use sdp4bit::layout::Topology;
use sdp4bit_test_support::{random::rank_grads, setups::cfg};

thread_local! {
    /// The ranges this thread has open, innermost last.
    static OPEN: RefCell<Vec<&'static str>> = const { RefCell::new(Vec::new()) };
}

/// Every range closed, as (its name, the ranges it was inside).
static CLOSED: Mutex<Vec<(&'static str, Vec<&'static str>)>> = Mutex::new(Vec::new());

fn open(name: &'static str) {
    OPEN.with(|open| open.borrow_mut().push(name));
}

fn close() {
    OPEN.with(|open| {
        let mut open = open.borrow_mut();
        let name = open.pop().expect("a range is open");
        CLOSED.lock().unwrap().push((name, open.clone()));
    });
}

#[test]
fn each_call_is_a_range_holding_its_phases_all_closed() {
    assert!(set_profiler_ranges(ProfilerRanges { open, close }));
    let topo = Topology::uniform(2, 2).unwrap();
    let config = cfg(Preset::Sdp4bit, &[]);
    let numel = 4 * 4096;
    let grads = rank_grads(5, 4, numel, 1.0);
    let params: Vec<bf16> = (0..numel)
        .map(|i| bf16::from_f32(i as f32 * 1e-4))
        .collect();
    let still_open = LocalCluster::new(topo.clone()).run(|c| {
        let me = c.world.rank();
        let mut rs = GradReduceScatter::new(&config, &topo, me, numel, 3).unwrap();
        let mut shard = vec![0.0; numel / 4];
        let mut ag = WeightAllGather::new(&config, &topo, me, 3, &params).unwrap();
        let mut mine = params.clone();
        rs.run(c, &grads[me], &mut shard, 0).unwrap();
        ag.run(c.world, &mut mine, 1).unwrap();
        // A call that fails (a shard of the wrong length) leaves no range open either.
        let mut short = vec![0.0; numel / 4 - 1];
        assert!(rs.run(c, &grads[me], &mut short, 1).is_err());
        OPEN.with(|open| open.borrow().len())
    });
    assert_eq!(still_open, vec![0; 4]);
    let closed = CLOSED.lock().unwrap();
    for (call, phases) in [
        (
            "sdp4bit.reduce_scatter",
            &[
                "encode",
                "exchange_start",
                "exchange_wait",
                "requantize",
                "decode",
            ][..],
        ),
        (
            "sdp4bit.all_gather",
            &["encode", "exchange_wait", "decode"][..],
        ),
    ] {
        let calls = closed
            .iter()
            .filter(|(n, outer)| *n == call && outer.is_empty());
        assert!(calls.count() >= 4, "{call}: {closed:?}");
        for phase in phases {
            let name = format!("{call}.{phase}");
            let inner: Vec<_> = closed.iter().filter(|(n, _)| *n == name).collect();
            assert!(!inner.is_empty(), "{name} never opened");
            assert!(
                inner.iter().all(|(_, outer)| outer == &[call]),
                "{name}: {inner:?}"
            );
        }
    }
}
