//! The CUDA hot path without the host: the emulation's count of host synchronisations (which
//! the `end_to_end_*` sweeps assert is zero inside every collective) counts what it must,
//! Global-QSGD's special buckets (all zeros, NaN, Inf) give the host's shards from a scale the
//! kernels read in device memory, and an overflow of its integer sum on the device is reported
//! with the host's error and leaves NaN for the framework's found-inf check, also when the
//! status word is read back through pinned memory without any host synchronisation (the torch
//! extension's way).

use cudarc::driver::CudaContext;
use cudarc::driver::result as driver;
use cudarc::driver::sys;
use sdp4bit::backend::Backend;
use sdp4bit::backend::cuda::{Cuda, DeviceBuffer, StatusReadback, Stream};
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, GradReduceScatter, sum_in_rank_order};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};
use sdp4bit_test_support::cuda_cluster::{DeviceCluster, download, upload};
use sdp4bit_test_support::setups::cfg;

use super::child::{assert_child_passed, run_isolated};
use super::comm::{EmulatedCluster, Rank};
use super::library::emulation;

/// Every kind of host synchronisation is counted, against the thread that made it only, and
/// work that is only enqueued is not.
#[test]
fn host_synchronisations_are_counted_per_thread() {
    emulation();
    let context = CudaContext::new(0).expect("the primary context");
    context.bind_to_thread().expect("bind the context");
    let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking).expect("stream");
    let host = vec![1.5f32; 64];
    let mut back = vec![0.0f32; 64];
    let _earlier = emulation().take_host_syncs();
    // SAFETY: a live stream and 256 bytes of device memory of the current context; every
    // operation on them is synchronised before the memory is freed and `host` dropped.
    let (enqueued_only, counted) = unsafe {
        let device = driver::malloc_sync(256).expect("device memory");
        driver::memcpy_htod_async(device, &host, stream).expect("an asynchronous upload");
        driver::memset_d8_async(device, 0, 16, stream).expect("an asynchronous memset");
        let event =
            driver::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).expect("an event");
        driver::event::record(event, stream).expect("record");
        driver::stream::wait_event(
            driver::stream::null(),
            event,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
        .expect("a stream wait");
        let enqueued_only = emulation().take_host_syncs();
        driver::event::synchronize(event).expect("event synchronize");
        driver::stream::synchronize(stream).expect("stream synchronize");
        driver::ctx::synchronize().expect("context synchronize");
        driver::memcpy_dtoh_sync(&mut back, device).expect("a download");
        driver::free_sync(device).expect("free");
        driver::event::destroy(event).expect("destroy the event");
        driver::stream::destroy(stream).expect("destroy the stream");
        (enqueued_only, emulation().take_host_syncs())
    };
    let other_thread = std::thread::scope(|s| {
        s.spawn(|| emulation().take_host_syncs())
            .join()
            .expect("thread")
    });
    assert!(
        enqueued_only.is_empty(),
        "enqueued work was counted as a synchronisation: {enqueued_only:?}"
    );
    assert_eq!(
        counted,
        [
            "cuEventSynchronize",
            "cuStreamSynchronize",
            "cuCtxSynchronize",
            "cuMemcpyDtoH",
            "cuMemFree"
        ]
    );
    assert!(
        other_thread.is_empty(),
        "another thread saw this thread's synchronisations: {other_thread:?}"
    );
}

/// Global-QSGD of `grads[rank]` (one step) on the host and on the emulated devices: every
/// rank's shard on both, with no host synchronisation inside the device run.
fn global_qsgd_both(config: &Config, topo: &Topology, grads: &[Vec<f32>]) -> [Vec<Vec<f32>>; 2] {
    let numel = grads[0].len();
    let host = LocalCluster::new(topo.clone()).run(|c| {
        let me = c.world.rank();
        let mut rs = GradReduceScatter::new(config, topo, me, numel, 9).expect("host plan");
        let mut shard = vec![f32::NAN; rs.plan().shard_len];
        rs.run(c, &grads[me], &mut shard, 0).expect("host step");
        shard
    });
    let device = EmulatedCluster::new(topo).run(|rank| {
        let me = rank.comms.world.rank();
        let mut rs = GradReduceScatter::with_backend(&rank.backend, config, topo, me, numel, 9)
            .expect("device plan");
        let mut shard = upload(rank, &vec![f32::NAN; rs.plan().shard_len]);
        let bucket = upload(rank, &grads[me]);
        let _set_up = emulation().take_host_syncs();
        run_device(rank, &mut rs, &bucket, &mut shard).expect("device step");
        let syncs = emulation().take_host_syncs();
        assert!(syncs.is_empty(), "rank {me} waited on the host: {syncs:?}");
        rs.check_integer_sums(&rank.backend).expect("no overflow");
        download(rank, &shard)
    });
    [host, device]
}

fn run_device(
    rank: &Rank<'_>,
    rs: &mut GradReduceScatter<Cuda>,
    bucket: &DeviceBuffer<f32>,
    shard: &mut DeviceBuffer<f32>,
) -> sdp4bit::Result<()> {
    rs.run_on(
        &rank.backend,
        &rank.comms,
        Cuda::src(bucket),
        Cuda::dst(shard),
        0,
    )
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// An all-zero bucket (every shard 0), a NaN and an Inf on one rank (every shard NaN on every
/// rank, what the found-inf check sees), and a bucket whose absmax / K underflows (all 0): the
/// host's bits exactly, the scale read by the kernels from the all-reduced device word.
#[test]
fn global_qsgd_special_buckets_match_the_host() {
    let topo = Topology::uniform(1, 3).expect("one node of three");
    let config: Config = cfg(Preset::GlobalQsgd, &[]);
    let numel = 3 * 101;
    let plain = |scale: f32| -> Vec<Vec<f32>> {
        (0..3)
            .map(|r| {
                (0..numel)
                    .map(|i| ((i * 7 + r * 13) % 29) as f32 * scale - 14.0 * scale)
                    .collect()
            })
            .collect()
    };
    let mut with_nan = plain(1.0);
    with_nan[1][17] = f32::NAN;
    let mut with_inf = plain(1.0);
    with_inf[2][250] = f32::NEG_INFINITY;
    let cases = [
        ("all zeros", vec![vec![0.0f32; numel]; 3], Some(0.0f32)),
        ("a NaN on rank 1", with_nan, None),
        ("-Inf on rank 2", with_inf, None),
        ("absmax / K underflows", plain(f32::from_bits(1)), Some(0.0)),
    ];
    for (name, grads, fill) in cases {
        let [host, device] = global_qsgd_both(&config, &topo, &grads);
        for (r, (h, d)) in host.iter().zip(&device).enumerate() {
            assert_eq!(bits(d), bits(h), "{name}: rank {r}: device != host");
            match fill {
                Some(v) => assert!(d.iter().all(|&x| x == v), "{name}: rank {r}: {d:?}"),
                None => assert!(d.iter().all(|x| x.is_nan()), "{name}: rank {r}: {d:?}"),
            }
        }
    }
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "the emulation reported:\n{faults}");
}

/// Codes corrupted on the way (every launch of the int8 rounding flips bit 6 of its first
/// code, so element 0's codes of K = 63 become 127 on both ranks): rank 0's sum of element 0
/// overflows, its shard element is NaN, and `check_integer_sums` returns the error the host's
/// sum in rank order returns for the same blocks; rank 1's shard is unaffected.
#[test]
fn global_qsgd_device_sum_overflow_is_reported() {
    let Some(output) = run_isolated(
        "hot_path::global_qsgd_device_sum_overflow_is_reported",
        &[],
        overflow_scenario,
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// Two ranks' Global-QSGD gradients whose element 0 overflows rank 0's int8 sum once every
/// launch of the int8 rounding flips bit 6 of its first code (element 0 holds the absmax, so its
/// code is K = 63 whatever the rounding, and 127 once flipped).
fn overflowing_grads(numel: usize) -> Vec<Vec<f32>> {
    (0..2)
        .map(|r| {
            (0..numel)
                .map(|i| {
                    if i == 0 {
                        2.0
                    } else {
                        ((i + r) % 5) as f32 * 0.25
                    }
                })
                .collect()
        })
        .collect()
}

/// The error the host's sum in rank order returns when both ranks send 127 as the first code of
/// a `shard_len`-element block.
fn host_overflow_error(shard_len: usize) -> String {
    let mut want_blocks = vec![vec![0i8; shard_len]; 2];
    want_blocks[0][0] = 127;
    want_blocks[1][0] = 127;
    let mut recv = vec![0i8; shard_len];
    sum_in_rank_order(
        want_blocks
            .iter()
            .map(|b| bytemuck::cast_slice::<i8, u8>(b)),
        &mut recv,
        0,
    )
    .expect_err("127 + 127 overflows int8")
    .to_string()
}

/// The elements of the Global-QSGD bucket whose sum overflows.
const OVERFLOW_NUMEL: usize = 2 * 64;

/// One node of two ranks running Global-QSGD, with every launch of the int8 rounding corrupted
/// from now on, so that rank 0's sum overflows at element 0 ([`overflowing_grads`]).
fn overflow_cluster() -> (Topology, Config) {
    let topo = Topology::uniform(1, 2).expect("one node of two");
    emulation().corrupt_kernel_output(Some(c"global_quantize_i8"), 0, 0x40);
    (topo, cfg(Preset::GlobalQsgd, &[]))
}

/// `rank`'s plan of the overflowing bucket, a zeroed shard and the rank's gradients, on the
/// device.
fn overflowing_bucket(
    rank: &Rank<'_>,
    topo: &Topology,
    config: &Config,
) -> (
    GradReduceScatter<Cuda>,
    DeviceBuffer<f32>,
    DeviceBuffer<f32>,
) {
    let me = rank.comms.world.rank();
    let rs = GradReduceScatter::with_backend(&rank.backend, config, topo, me, OVERFLOW_NUMEL, 2)
        .expect("device plan");
    let shard = upload(rank, &vec![0.0f32; rs.plan().shard_len]);
    let bucket = upload(rank, &overflowing_grads(OVERFLOW_NUMEL)[me]);
    (rs, shard, bucket)
}

fn overflow_scenario() {
    let (topo, config) = overflow_cluster();
    let results = EmulatedCluster::new(&topo).run(|rank| {
        let (mut rs, mut shard, bucket) = overflowing_bucket(rank, &topo, &config);
        let shard_len = rs.plan().shard_len;
        run_device(rank, &mut rs, &bucket, &mut shard).expect("the step itself is enqueued");
        let checked = rs.check_integer_sums(&rank.backend);
        let again = rs.check_integer_sums(&rank.backend);
        (download(rank, &shard), checked, again, shard_len)
    });
    emulation().corrupt_kernel_output(None, 0, 0);
    let (shard0, checked0, again0, s) = &results[0];
    assert!(
        shard0[0].is_nan(),
        "the overflowing element is NaN: {}",
        shard0[0]
    );
    assert!(
        shard0[1..].iter().all(|x| x.is_finite()),
        "only element 0 overflows"
    );
    let device_error = checked0.as_ref().expect_err("rank 0's sum overflowed");
    assert_eq!(device_error.to_string(), host_overflow_error(*s));
    assert!(
        again0.is_ok(),
        "the status is cleared once reported: {again0:?}"
    );
    let (shard1, checked1, _, _) = &results[1];
    assert!(checked1.is_ok(), "rank 1's sums fit: {checked1:?}");
    assert!(shard1.iter().all(|x| x.is_finite()), "rank 1: {shard1:?}");
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "the emulation reported:\n{faults}");
}

/// The same overflow read back as the torch extension reads it: after the step, the status
/// word is copied on the stream into pinned host memory and cleared, and the host polls an
/// event until the copy has landed, never waiting for the device (no host synchronisation is
/// counted from the step to the last poll). Rank 0's word gives the host's error, once; the
/// next readback (after another step without the corruption) reads 0; rank 1 reads 0
/// throughout. Rank 1's plan turns rank 0's word into the same error (the extension raises it
/// on every rank once they agree on it).
#[test]
fn global_qsgd_overflow_is_read_back_without_waiting() {
    let Some(output) = run_isolated(
        "hot_path::global_qsgd_overflow_is_read_back_without_waiting",
        &[],
        readback_scenario,
    ) else {
        return;
    };
    assert_child_passed(&output);
}

/// Starts a readback of `rs`'s status word on `rank`'s stream and polls it until it lands.
fn read_back(
    rank: &Rank<'_>,
    rs: &mut GradReduceScatter<Cuda>,
    readback: &mut StatusReadback,
) -> u32 {
    let status = rs
        .integer_sum_status()
        .expect("Global-QSGD on a device has a status word");
    // SAFETY: the rank's live stream of the device's primary context.
    let stream = unsafe { Stream::from_raw(rank.stream.cu_stream() as usize) };
    assert!(readback.start(stream, status).expect("enqueue the copy"));
    assert!(
        !readback.start(stream, status).expect("a second start"),
        "a readback not yet taken is not restarted"
    );
    loop {
        if let Some(word) = readback.take().expect("query the copy") {
            return word;
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

fn readback_scenario() {
    let (topo, config) = overflow_cluster();
    let results = EmulatedCluster::new(&topo).run(|rank| {
        let me = rank.comms.world.rank();
        let (mut rs, mut shard, bucket) = overflowing_bucket(rank, &topo, &config);
        let mut readback = StatusReadback::new(rank.backend.kernels()).expect("pinned word");
        let shard_len = rs.plan().shard_len;
        let _set_up = emulation().take_host_syncs();
        run_device(rank, &mut rs, &bucket, &mut shard).expect("the step itself is enqueued");
        let word = read_back(rank, &mut rs, &mut readback);
        let first = rs.integer_sum_error(me, word);
        // Each rank's copy landed after its corrupted launch ran: once both have, the
        // corruption goes before the second step is enqueued.
        rank.comms.world.all_reduce_max(0.0).expect("meet");
        if me == 0 {
            emulation().corrupt_kernel_output(None, 0, 0);
        }
        rank.comms.world.all_reduce_max(0.0).expect("meet");
        run_device(rank, &mut rs, &bucket, &mut shard).expect("a clean step");
        let second = read_back(rank, &mut rs, &mut readback);
        let second = rs.integer_sum_error(me, second);
        let syncs = emulation().take_host_syncs();
        // Before the buffers are freed (the peers' reads of them included).
        rank.stream.synchronize().expect("stream synchronize");
        rank.comms.world.all_reduce_max(0.0).expect("meet");
        (first, second, syncs, shard_len, word)
    });
    let (first0, second0, syncs0, s, word0) = &results[0];
    let error = first0.as_ref().expect_err("rank 0's sum overflowed");
    assert_eq!(error.to_string(), host_overflow_error(*s));
    let peer = GradReduceScatter::new(&config, &topo, 1, OVERFLOW_NUMEL, 2).expect("rank 1's plan");
    let agreed = peer.integer_sum_error(0, *word0);
    assert_eq!(
        agreed.expect_err("rank 0's word on rank 1").to_string(),
        host_overflow_error(*s)
    );
    assert!(
        second0.is_ok(),
        "the status was cleared by the copy: {second0:?}"
    );
    let (first1, second1, syncs1, ..) = &results[1];
    assert!(
        first1.is_ok() && second1.is_ok(),
        "rank 1's sums fit: {first1:?} {second1:?}"
    );
    for (rank, syncs) in [(0, syncs0), (1, syncs1)] {
        assert!(
            syncs.is_empty(),
            "rank {rank} waited on the host: {syncs:?}"
        );
    }
    let faults = emulation().take_faults(-1);
    assert!(faults.is_empty(), "the emulation reported:\n{faults}");
}

/// Pipelined chunks whose exchanges run on side streams, through a communicator that forgets
/// to order the compute stream after them: the passes reading a chunk's receive buffer race
/// with the exchange writing it, which the emulation reports (so the end-to-end sweep, where
/// none is reported, shows that every event wait is there).
#[test]
fn a_missing_exchange_wait_is_caught() {
    let Some(output) = run_isolated(
        "hot_path::a_missing_exchange_wait_is_caught",
        &[],
        missing_wait_scenario,
    ) else {
        return;
    };
    assert_child_passed(&output);
}

fn missing_wait_scenario() {
    let topo = Topology::uniform(2, 2).expect("2x2");
    let config: Config = cfg(Preset::Sdp4bit, &[("pipeline_chunks", "3")]);
    let numel = 4 * 307;
    let grads = vec![vec![0.5f32; numel]; 4];
    let results = EmulatedCluster::new(&topo)
        .without_exchange_waits()
        .run(|rank| {
            let me = rank.comms.world.rank();
            let mut rs =
                GradReduceScatter::with_backend(&rank.backend, &config, &topo, me, numel, 4)
                    .expect("device plan");
            let mut shard = upload(rank, &vec![0.0f32; rs.plan().shard_len]);
            let bucket = upload(rank, &grads[me]);
            run_device(rank, &mut rs, &bucket, &mut shard).map_err(|e| e.to_string())
        });
    let faults = emulation().take_faults(-1);
    assert!(
        faults.contains("race on") && faults.contains("collective all_to_all"),
        "no race between an exchange and the passes was reported:\n{faults}\n{results:?}"
    );
    assert!(
        results.iter().any(Result::is_err),
        "the racing launch was refused on some rank: {results:?}"
    );
}
