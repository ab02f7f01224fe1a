//! Global-QSGD never overflows its integer reduce-scatter (docs/numerics.md §7.2):
//! `K = floor((2^(w-1) - 1) / W)`, so W codes of magnitude at most K sum within the integer
//! type. The in-process communicator sums with checked integer adds and fails on overflow, so
//! running the real collective with adversarial inputs (every rank at +absmax or -absmax at the
//! same positions: every code is +-K and every sum +-W K) proves it. The width is 8 bits while
//! W <= 127 and 16 bits beyond; forcing 8 bits for W = 128 is a clear error.

use sdp4bit::collective::local::LocalGroup;
use sdp4bit::collective::{Comm, GradReduceScatter, global_k};
use sdp4bit::layout::Topology;
use sdp4bit::rng::{Stage, UniformStream, stream_id};
use sdp4bit::{Config, Error, Preset};
use sdp4bit_test_support::{
    cluster::{reduce_scatter_ok, reduce_scatter_recorded},
    error_stats::{assert_within, compare},
    random::{SplitMix64, rank_grads},
    reference::grad::grad_reference,
    reference::route::RefRoute,
    setups::cfg,
};

/// Rank buckets where position `i % 4 == 0` holds `+a` and `i % 4 == 1` holds `-a` on every
/// rank (so those codes are all +K / -K), the rest small random values.
fn adversarial(w: usize, numel: usize, a: f32, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64::new(seed);
    (0..w)
        .map(|_| {
            (0..numel)
                .map(|i| match i % 4 {
                    0 => a,
                    1 => -a,
                    _ => ((rng.uniform() * 2.0 - 1.0) * 0.9 * f64::from(a)) as f32,
                })
                .collect()
        })
        .collect()
}

/// Runs Global-QSGD on W ranks (one node of W) at `step` and checks the result against the
/// derived bound; returns rank 0's integer payloads (received sums, sent codes) as bytes.
fn run_and_check(
    config: &Config,
    w: usize,
    grads: &[Vec<f32>],
    step: u64,
    ctx: &str,
) -> (Vec<u8>, Vec<u8>) {
    let topo = Topology::uniform(1, w).unwrap();
    let logs = reduce_scatter_recorded(config, &topo, 1, &[(step, grads.to_vec())]);
    let shards: Vec<Vec<f32>> = logs[0].iter().map(|x| x.0.clone()).collect();
    let reference = grad_reference(config, &topo, grads, step);
    assert!(matches!(reference.route, RefRoute::Global { .. }), "{ctx}");
    let st = compare(&reference, &shards);
    assert_eq!(st.non_finite, 0, "{ctx}: {}", st.summary());
    assert!(st.max_ratio <= 1.0, "{ctx}: {}", st.summary());
    let rs = logs[0][0]
        .1
        .iter()
        .find(|r| r.op == "reduce_scatter")
        .expect("Global-QSGD reduce-scatters integers");
    (rs.recv.clone(), rs.send.clone())
}

#[test]
fn local_comm_integer_reduce_scatter_is_checked() {
    // The premise of this file: the in-process reduce-scatter fails instead of wrapping.
    let group = LocalGroup::new(2);
    let res: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let c = group.comm(r);
                s.spawn(move || {
                    let send = [100i8, 1];
                    let mut recv = [0i8; 1];
                    c.reduce_scatter_sum(&send, &mut recv)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let e = res[0].as_ref().expect_err("100 + 100 overflows int8");
    assert!(e.to_string().contains("overflow"), "{e}");
    // Rank 1's own element (1 + 1) fits, but the failure aborts the whole communicator, so
    // rank 1 fails too, with the overflow named as the reason.
    let e = res[1]
        .as_ref()
        .expect_err("a failed collective aborts every rank");
    assert!(e.to_string().contains("overflow"), "{e}");
}

#[test]
fn w127_int8_adversarial_codes_at_k_never_overflow() {
    let w = 127;
    let config = cfg(Preset::GlobalQsgd, &[]);
    assert_eq!(global_k(8, w), 1);
    let numel = w * 64;
    let a = 3.75f32;
    let grads = adversarial(w, numel, a, 1);
    let rs =
        GradReduceScatter::new(&config, &Topology::uniform(1, w).unwrap(), 0, numel, 1).unwrap();
    // 8-bit integers on the wire: one byte per element per peer.
    assert_eq!(rs.wire_bytes(0).total(), ((w - 1) * 64) as u64);
    let (recv, _) = run_and_check(&config, w, &grads, 0, "W=127 int8");
    // The +a / -a positions sum to exactly +127 / -127 = +-W K: the int8 extremes.
    assert_eq!(recv.len(), 64);
    for (i, &b) in recv.iter().enumerate() {
        match i % 4 {
            0 => assert_eq!(b as i8, 127, "element {i}"),
            1 => assert_eq!(b as i8, -127, "element {i}"),
            _ => {}
        }
    }
}

/// An absmax `a` for which `fl(a / fl(a / K)) > K`: a value of exactly `a` lands above K
/// after the fp32 division, so only the clamp keeps its code at K.
fn absmax_above_k(k: i32) -> f32 {
    let kf = k as f32;
    let mut a = 1.0f32;
    for _ in 0..1 << 23 {
        if a / (a / kf) > kf {
            return a;
        }
        a = f32::from_bits(a.to_bits() + 1);
    }
    panic!("no fp32 absmax in [1, 2) with a / (a / {k}) > {k}");
}

/// A step and an element at which rank `rank`'s Philox uniform (docs/numerics.md §2, stream of
/// bucket `bucket`, Global-QSGD stage) pushes `floor(fl(a / s) + u)` above K for `x = a`.
fn step_where_unclamped_code_exceeds_k(
    config: &Config,
    bucket: u32,
    rank: usize,
    numel: usize,
    a: f32,
    k: i32,
) -> (u64, usize) {
    let kf = k as f32;
    let v = a / (a / kf);
    let stream = stream_id(bucket, rank, Stage::GlobalQsgd).unwrap();
    let mut u = vec![0.0f32; numel];
    for step in 0..20_000u64 {
        UniformStream::new(config.seed, step, stream).fill(0, &mut u);
        if let Some(i) = u.iter().position(|&u| (v + u).floor() > kf) {
            return (step, i);
        }
    }
    panic!("no uniform close enough to 1 in 20000 steps of {numel} elements");
}

#[test]
fn codes_clamp_at_k_where_fp32_division_lands_above_it() {
    // W = 18 at 8 bits: K = 7, 18 * 7 = 126 fits but a code of 8 would not be a valid
    // Global-QSGD code (W of them overflow); W = 200 at 16 bits: K = 163.
    for (w, bits) in [(18usize, 8u8), (200, 16)] {
        let k = global_k(bits, w);
        let a = absmax_above_k(k);
        let config = cfg(
            Preset::GlobalQsgd,
            &[("global_qsgd_bits", if bits == 8 { "8" } else { "16" })],
        );
        let numel = w * 256;
        let (step, at) = step_where_unclamped_code_exceeds_k(&config, 1, 0, numel, a, k);
        let grads: Vec<Vec<f32>> = (0..w).map(|_| vec![a; numel]).collect();
        let ctx = format!("W={w} {bits}-bit a={a:e} step {step} element {at}");
        let (recv, sent) = run_and_check(&config, w, &grads, step, &ctx);
        let code = |bytes: &[u8], i: usize| -> i32 {
            if bits == 8 {
                i32::from(bytes[i] as i8)
            } else {
                i32::from(i16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
            }
        };
        assert_eq!(
            code(&sent, at),
            k,
            "{ctx}: rank 0's code must be clamped to K"
        );
        let want = (w as i32) * k;
        for i in 0..numel / w {
            assert_eq!(code(&recv, i), want, "{ctx}: summed code {i} must be W K");
        }
    }
}

#[test]
fn w128_picks_int16_automatically() {
    let w = 128;
    let config = cfg(Preset::GlobalQsgd, &[]);
    assert_eq!(config.grad.global_bits, None);
    assert_eq!(global_k(16, w), 255);
    let numel = w * 32;
    let rs =
        GradReduceScatter::new(&config, &Topology::uniform(1, w).unwrap(), 0, numel, 1).unwrap();
    // 16-bit integers on the wire: two bytes per element per peer.
    assert_eq!(rs.wire_bytes(0).total(), ((w - 1) * 32 * 2) as u64);
    let grads = adversarial(w, numel, 0.5, 2);
    let (recv, _) = run_and_check(&config, w, &grads, 0, "W=128 auto");
    assert_eq!(recv.len(), 64, "int16 payload");
    let first = i16::from_le_bytes([recv[0], recv[1]]);
    assert_eq!(first, 128 * 255, "W K = 32640 <= 32767");
}

#[test]
fn int8_is_an_error_beyond_127_ranks() {
    let config = cfg(Preset::GlobalQsgd, &[("global_qsgd_bits", "8")]);
    for w in [128usize, 200] {
        let e = GradReduceScatter::new(&config, &Topology::uniform(1, w).unwrap(), 0, w * 4, 0)
            .unwrap_err();
        assert!(matches!(e, Error::Plan(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("127") && msg.contains(&w.to_string()),
            "the error must name the 127-rank limit and W={w}: {msg}"
        );
    }
    // 127 is still served.
    GradReduceScatter::new(&config, &Topology::uniform(1, 127).unwrap(), 0, 127 * 4, 0).unwrap();
}

#[test]
fn w200_int16_adversarial_and_random() {
    let w = 200;
    let config = cfg(Preset::GlobalQsgd, &[]);
    assert_eq!(global_k(16, w), 163);
    let numel = w * 16;
    let (recv, _) = run_and_check(
        &config,
        w,
        &adversarial(w, numel, 7.0, 3),
        0,
        "W=200 adversarial",
    );
    assert_eq!(
        i16::from_le_bytes([recv[0], recv[1]]),
        200 * 163,
        "W K = 32600"
    );
    let grads = rank_grads(4, w, numel, 1.0);
    run_and_check(&config, w, &grads, 0, "W=200 gaussian");
}

#[test]
fn explicit_16_bits_for_a_small_world_and_non_uniform_nodes() {
    // global_qsgd_bits=16 with W = 8, and Global-QSGD on a non-uniform layout (it only uses
    // the world communicator).
    let config = cfg(Preset::GlobalQsgd, &[("global_qsgd_bits", "16")]);
    let topo = Topology::uniform(2, 4).unwrap();
    let grads = rank_grads(6, 8, 8 * 1237, 1.0);
    let shards = reduce_scatter_ok(&config, &topo, &grads, 0, 0);
    let reference = grad_reference(&config, &topo, &grads, 0);
    assert_eq!(reference.route, RefRoute::Global { bits: 16 });
    assert_within(&compare(&reference, &shards), 2048, "W=8 16-bit");
    let config = cfg(Preset::GlobalQsgd, &[]);
    let topo = Topology::from_node_labels(&[0, 0, 0, 1]).unwrap();
    let grads = rank_grads(7, 4, 4 * 1237, 1.0);
    let shards = reduce_scatter_ok(&config, &topo, &grads, 0, 0);
    let reference = grad_reference(&config, &topo, &grads, 0);
    assert_within(&compare(&reference, &shards), 2048, "3+1 8-bit");
}

#[test]
fn all_zero_bucket_is_exactly_zero() {
    let config = cfg(Preset::GlobalQsgd, &[]);
    let topo = Topology::uniform(1, 3).unwrap();
    let grads = vec![vec![0.0f32; 3 * 100]; 3];
    for shard in reduce_scatter_ok(&config, &topo, &grads, 0, 0) {
        assert!(shard.iter().all(|v| v.to_bits() == 0), "{shard:?}");
    }
}
