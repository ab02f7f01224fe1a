//! CPU benchmark of the fused codec passes and the in-process collectives.
//!
//! Run with `cargo bench --bench cpu`; `SDP4BIT_BENCH_QUICK=1` shrinks sizes and iterations
//! to a smoke run of a few seconds. Prints markdown: the machine, then one row per fused pass
//! (bytes read + written per call, median time, GB/s and the ratio to the better of a
//! single-threaded and a rayon-parallel memcpy measured in the same run), then the W = 4
//! (2 nodes x 2 ranks) `LocalCluster` collectives against the uncompressed baseline preset.
//!
//! Each pass runs with the sizes one rank of W = 4 sees for a 64 MiB bucket (64 MiB fp32
//! gradient bucket, 64 MiB bf16 param bucket). Passes whose inputs and outputs are smaller
//! than a few L3 caches cycle through several copies of their buffers, so every row measures
//! DRAM traffic like the 64 MiB memcpy it is compared with.

use std::hint::black_box;
use std::time::{Duration, Instant};

use half::bf16;
use rayon::prelude::*;
use sdp4bit::backend::cpu::{global_qsgd, gradient, weight};
use sdp4bit::codec::quant::{GroupMeta, QuantSpec, dequantize_group, quantize_group};
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, GradReduceScatter, WeightAllGather, global_k};
use sdp4bit::layout::{BucketPlan, GradLayout, GradRoute, Topology};
use sdp4bit::rng::UniformStream;
use sdp4bit::{Config, Preset, Rounding, hadamard};

mod common;
use common::{gradients, params, updated, utc_now};

const MIB: usize = 1 << 20;

/// Sizes and repetitions of one run.
#[derive(Debug, Clone)]
struct Opts {
    /// Bytes of the fp32 gradient bucket and of the bf16 param bucket of the pass rows.
    bucket_bytes: usize,
    /// Bytes of the bf16 param bucket of the all-gather rows.
    param_bucket_bytes: usize,
    /// Untimed runs before the timed ones (at least one pass over every buffer copy).
    warmup: usize,
    /// Timed runs; the median is reported.
    iters: usize,
    /// Footprint the rotated buffer copies of a pass must reach (0: no rotation).
    rotate_bytes: usize,
    /// `SDP4BIT_BENCH_ONLY`: run only the rows whose label contains this text (the memcpy
    /// baselines always run; the collective tables run when it is empty or `collective`).
    only: String,
}

impl Opts {
    /// Full run, or the quick smoke run when `SDP4BIT_BENCH_QUICK` is set to a non-empty,
    /// non-`0` value.
    fn from_env() -> (Self, bool) {
        let quick = std::env::var("SDP4BIT_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        let only = std::env::var("SDP4BIT_BENCH_ONLY").unwrap_or_default();
        let opts = if quick {
            Self {
                bucket_bytes: MIB,
                param_bucket_bytes: MIB / 2,
                warmup: 1,
                iters: 3,
                rotate_bytes: 0,
                only,
            }
        } else {
            Self {
                bucket_bytes: 64 * MIB,
                param_bucket_bytes: 32 * MIB,
                warmup: 2,
                iters: 11,
                rotate_bytes: 96 * MIB,
                only,
            }
        };
        (opts, quick)
    }

    /// Whether the row (or table) labelled `name` runs.
    fn selects(&self, name: &str) -> bool {
        name.contains(self.only.as_str())
    }

    /// How many buffer copies a pass moving `traffic` bytes per call cycles through.
    fn copies(&self, traffic: usize) -> usize {
        self.rotate_bytes.div_ceil(traffic.max(1)).max(1)
    }
}

/// Median and fastest of the timed calls of one measurement.
#[derive(Debug, Clone, Copy)]
struct Timing {
    median: Duration,
    min: Duration,
}

/// Times `iters` calls of `f(i)` after `warmup + copies` untimed ones; `i` counts calls from
/// 0 so `f` can pick buffer copy `i % copies`.
fn median_time(opts: &Opts, copies: usize, mut f: impl FnMut(usize)) -> Timing {
    let mut call = 0;
    for _ in 0..opts.warmup + copies {
        f(call);
        call += 1;
    }
    let mut times: Vec<Duration> = (0..opts.iters)
        .map(|_| {
            let start = Instant::now();
            f(call);
            call += 1;
            start.elapsed()
        })
        .collect();
    times.sort();
    Timing {
        median: times[times.len() / 2],
        min: times[0],
    }
}

/// One row of the pass table.
struct Row {
    name: String,
    /// Bytes read per call.
    read: usize,
    /// Bytes written per call.
    written: usize,
    /// Elements per call that the per-element costs refer to (stated in the breakdown).
    elems: usize,
    time: Timing,
}

impl Row {
    /// Bytes read plus bytes written per second at the median time, in GB/s (1e9).
    fn gbps(&self) -> f64 {
        (self.read + self.written) as f64 / self.time.median.as_secs_f64() / 1e9
    }

    /// Median nanoseconds per element.
    fn ns_per_elem(&self) -> f64 {
        self.time.median.as_secs_f64() * 1e9 / self.elems.max(1) as f64
    }
}

/// Formats a byte count in MiB.
fn mib(bytes: usize) -> String {
    format!("{:.2}", bytes as f64 / MIB as f64)
}

/// The memcpy baselines: a single `copy_from_slice` of `bytes` and a rayon copy of the same
/// buffers split into 1 MiB pieces (throughput counts read + written, 2x the bytes copied);
/// plus, for reference only, a rayon loop `dst = src + 0.0` whose ordinary stores pay the
/// write-allocate reads that the passes' stores pay (large memcpys use non-temporal stores).
fn memcpy_rows(opts: &Opts) -> [Row; 3] {
    let n = opts.bucket_bytes / 4;
    let src = gradients(n, 1);
    let mut dst = vec![0f32; n];
    let single = median_time(opts, 1, |_| {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
    });
    let parallel = median_time(opts, 1, |_| {
        dst.par_chunks_mut(MIB / 4)
            .zip(src.par_chunks(MIB / 4))
            .for_each(|(d, s)| d.copy_from_slice(s));
        black_box(&mut dst);
    });
    let cached = median_time(opts, 1, |_| {
        dst.par_chunks_mut(MIB / 4)
            .zip(src.par_chunks(MIB / 4))
            .for_each(|(d, s)| {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = s + 0.0;
                }
            });
        black_box(&mut dst);
    });
    let row = |name: &str, time| Row {
        name: name.into(),
        read: opts.bucket_bytes,
        written: opts.bucket_bytes,
        elems: n,
        time,
    };
    [
        row("memcpy, 1 thread (`copy_from_slice`)", single),
        row("memcpy, rayon (1 MiB pieces)", parallel),
        row(
            "reference: rayon copy loop with ordinary stores (not a baseline)",
            cached,
        ),
    ]
}

/// The 2 nodes x 2 ranks topology every row uses.
fn topology() -> Topology {
    Topology::uniform(2, 2).expect("2 x 2 topology")
}

/// Config of `preset` with overrides applied.
fn config(preset: Preset, overrides: &[(&str, &str)]) -> Config {
    Config::from_overrides(preset, overrides.iter().copied()).expect("valid bench config")
}

/// The gradient layout of `config` on 2 x 2 for a bucket of `numel` fp32 elements.
fn grad_layout(config: &Config, numel: usize) -> GradLayout {
    let topo = topology();
    let route = GradRoute::new(config, &topo);
    let plan = BucketPlan::new(numel, topo.world(), config).expect("bench bucket plans");
    GradLayout::new(config, &topo, &route, plan).expect("W = 4 has an exchange")
}

/// Bytes of the first-level send buffer (all chunks) of `layout`.
fn first_send_len(layout: &GradLayout) -> usize {
    layout.bucket.chunks * layout.first.peers * layout.first.slab.byte_len()
}

/// Row for `quantize_first` of a whole bucket: reads the fp32 bucket, writes every slab.
fn quantize_first_row(opts: &Opts, name: &str, config: &Config) -> Row {
    let numel = opts.bucket_bytes / 4;
    let layout = grad_layout(config, numel);
    let out_len = first_send_len(&layout);
    let copies = opts.copies(numel * 4 + out_len);
    let buckets: Vec<Vec<f32>> = (0..copies)
        .map(|c| gradients(numel, 10 + c as u64))
        .collect();
    let mut outs = vec![vec![0u8; out_len]; copies];
    let rng = UniformStream::new(1, 1, 1);
    let time = median_time(opts, copies, |i| {
        let c = i % copies;
        gradient::quantize_first(&layout, &buckets[c], &rng, &mut outs[c]);
    });
    Row {
        name: name.into(),
        read: numel * 4,
        written: out_len,
        elems: numel,
        time,
    }
}

/// First-level slabs rank 0 would receive: the quantized buckets of its first-level peers.
fn received_first(layout: &GradLayout, numel: usize, seed: u64) -> Vec<u8> {
    let slab = layout.first.slab.byte_len();
    let mut recv = Vec::with_capacity(layout.first.peers * slab);
    for peer in 0..layout.first.peers {
        let bucket = gradients(numel, seed + peer as u64);
        let mut send = vec![0u8; first_send_len(layout)];
        gradient::quantize_first(layout, &bucket, &UniformStream::new(1, 1, 2), &mut send);
        recv.extend_from_slice(&send[..slab]);
    }
    recv
}

/// Second-level slabs rank 0 would receive (each built from real first-level slabs).
fn received_second(layout: &GradLayout, numel: usize, seed: u64) -> Vec<u8> {
    let second = layout.second.expect("two-level layout");
    let mut out = vec![0u8; second.peers * second.slab.byte_len()];
    let recv = received_first(layout, numel, seed);
    let rng = UniformStream::new(1, 1, 3);
    gradient::requantize_second(layout, 0, 0, &recv, &rng, &mut out).expect("valid slabs");
    out
}

/// Row for `requantize_second` of chunk 0 on rank 0.
fn requantize_second_row(opts: &Opts, name: &str, config: &Config) -> Row {
    let numel = opts.bucket_bytes / 4;
    let layout = grad_layout(config, numel);
    let second = layout.second.expect("two-level layout");
    let out_len = second.peers * second.slab.byte_len();
    let in_len = layout.first.peers * layout.first.slab.byte_len();
    let copies = opts.copies(in_len + out_len);
    let recvs: Vec<Vec<u8>> = (0..copies)
        .map(|c| received_first(&layout, numel, 20 + 4 * c as u64))
        .collect();
    let mut outs = vec![vec![0u8; out_len]; copies];
    let rng = UniformStream::new(1, 1, 4);
    let time = median_time(opts, copies, |i| {
        let c = i % copies;
        gradient::requantize_second(&layout, 0, 0, &recvs[c], &rng, &mut outs[c])
            .expect("valid slabs");
    });
    Row {
        name: name.into(),
        read: in_len,
        written: out_len,
        elems: second.peers * second.slab.elements(),
        time,
    }
}

/// Row for `reduce_final` of chunk 0 into rank 0's shard, from the last level's slabs.
fn reduce_final_row(opts: &Opts, name: &str, config: &Config) -> Row {
    let numel = opts.bucket_bytes / 4;
    let layout = grad_layout(config, numel);
    let shard_len = layout.bucket.shard_len;
    let recvs: Vec<Vec<u8>> = match layout.second {
        Some(_) => vec![received_second(&layout, numel, 30)],
        None => vec![received_first(&layout, numel, 30)],
    };
    let in_len = recvs[0].len();
    let copies = opts.copies(in_len + shard_len * 4);
    let recvs: Vec<Vec<u8>> = (0..copies).map(|_| recvs[0].clone()).collect();
    let mut shards = vec![vec![0f32; shard_len]; copies];
    let time = median_time(opts, copies, |i| {
        let c = i % copies;
        gradient::reduce_final(&layout, 0, &recvs[c], &mut shards[c]).expect("valid slabs");
    });
    Row {
        name: name.into(),
        read: in_len,
        written: shard_len * 4,
        elems: shard_len,
        time,
    }
}

/// The weight slab layout and bucket plan of `config` for a bf16 bucket of `numel`.
fn weight_layout(config: &Config, numel: usize) -> (SlabLayout, BucketPlan) {
    let plan = BucketPlan::new(numel, 4, config).expect("bench bucket plans");
    let spec = QuantSpec::of_weights(&config.weight).expect("quantized weight codec");
    let layout = SlabLayout {
        spec,
        groups: plan.padded_shard_len / spec.group_size,
    };
    (layout, plan)
}

/// Row for `encode_shard` (qWD difference) of rank 0's shard of a bf16 bucket.
fn encode_row(opts: &Opts, name: &str, config: &Config) -> Row {
    let numel = opts.bucket_bytes / 2;
    let (layout, plan) = weight_layout(config, numel);
    let s = plan.shard_len;
    let copies = opts.copies(4 * s + layout.byte_len());
    let refs: Vec<Vec<bf16>> = (0..copies).map(|c| params(s, 40 + c as u64)).collect();
    let news: Vec<Vec<bf16>> = refs
        .iter()
        .enumerate()
        .map(|(c, r)| updated(r, 50 + c as u64))
        .collect();
    let mut outs = vec![vec![0u8; layout.byte_len()]; copies];
    let rng = UniformStream::new(1, 1, 5);
    let time = median_time(opts, copies, |i| {
        let c = i % copies;
        let enc = WeightEncoding::Difference;
        weight::encode_shard(
            layout,
            enc,
            plan.padded_index(0, 0),
            &news[c],
            &refs[c],
            &rng,
            &mut outs[c],
        );
    });
    Row {
        name: name.into(),
        read: 4 * s,
        written: layout.byte_len(),
        elems: s,
        time,
    }
}

/// Row for `apply_shards` (qWD difference) of all W slabs into a bf16 bucket on rank 0.
fn apply_row(opts: &Opts, name: &str, config: &Config) -> Row {
    let numel = opts.bucket_bytes / 2;
    let (layout, plan) = weight_layout(config, numel);
    let s = plan.shard_len;
    let old = params(numel, 60);
    let mut recv = vec![0u8; 4 * layout.byte_len()];
    for (z, slab) in recv.chunks_exact_mut(layout.byte_len()).enumerate() {
        let shard = &old[z * s..(z + 1) * s];
        let new = updated(shard, 70 + z as u64);
        let rng = UniformStream::new(1, 1, 6);
        let enc = WeightEncoding::Difference;
        weight::encode_shard(
            layout,
            enc,
            plan.padded_index(z, 0),
            &new,
            shard,
            &rng,
            slab,
        );
    }
    let read = recv.len() + 2 * numel + 2 * s;
    let copies = opts.copies(read + 2 * numel);
    let mut buckets = vec![old.clone(); copies];
    let refs = vec![old[..s].to_vec(); copies];
    let recvs = vec![recv; copies];
    let time = median_time(opts, copies, |i| {
        let c = i % copies;
        let enc = WeightEncoding::Difference;
        weight::apply_shards(layout, enc, &plan, 0, &recvs[c], &refs[c], &mut buckets[c])
            .expect("valid slabs");
    });
    Row {
        name: name.into(),
        read,
        written: 2 * numel,
        elems: numel,
        time,
    }
}

/// Row for Global-QSGD's `local_absmax` of a whole fp32 bucket (read only).
fn global_absmax_row(opts: &Opts, name: &str) -> Row {
    let numel = opts.bucket_bytes / 4;
    let copies = opts.copies(numel * 4);
    let buckets: Vec<Vec<f32>> = (0..copies)
        .map(|c| gradients(numel, 80 + c as u64))
        .collect();
    let time = median_time(opts, copies, |i| {
        black_box(global_qsgd::local_absmax(&buckets[i % copies]));
    });
    Row {
        name: name.into(),
        read: numel * 4,
        written: 0,
        elems: numel,
        time,
    }
}

/// Row for Global-QSGD's 8-bit stochastic quantize of a whole fp32 bucket (W = 4).
fn global_quantize_row(opts: &Opts, name: &str) -> Row {
    let numel = opts.bucket_bytes / 4;
    let copies = opts.copies(numel * 5);
    let buckets: Vec<Vec<f32>> = (0..copies)
        .map(|c| gradients(numel, 80 + c as u64))
        .collect();
    let mut outs = vec![vec![0i8; numel]; copies];
    let k = global_k(8, 4);
    let scale = global_qsgd::local_absmax(&buckets[0]) / k as f32;
    let rng = UniformStream::new(1, 1, 7);
    let time = median_time(opts, copies, |i| {
        let c = i % copies;
        let sr = Rounding::Stochastic;
        global_qsgd::quantize(&buckets[c], scale, k, sr, &rng, &mut outs[c]);
    });
    Row {
        name: name.into(),
        read: numel * 4,
        written: numel,
        elems: numel,
        time,
    }
}

/// Row for Global-QSGD's dequantize of rank 0's summed 8-bit shard (W = 4).
fn global_dequantize_row(opts: &Opts, name: &str) -> Row {
    let s = opts.bucket_bytes / 16;
    let copies = opts.copies(s * 5);
    let sums: Vec<Vec<i8>> = (0..copies)
        .map(|c| (0..s).map(|i| ((i * 7 + c) % 255) as i8).collect())
        .collect();
    let mut outs = vec![vec![0f32; s]; copies];
    let time = median_time(opts, copies, |i| {
        let c = i % copies;
        global_qsgd::dequantize(&sums[c], 1e-5, &mut outs[c]);
    });
    Row {
        name: name.into(),
        read: s,
        written: 4 * s,
        elems: s,
        time,
    }
}

/// A pass row: its label and how to measure it.
type RowFn = Box<dyn Fn(&Opts, &str) -> Row + Send + Sync>;

/// Every pass row, numbered in the order of the report: the sdp4bit gradient passes, the
/// qWD passes, then QSDP's, ZeRO++'s and Global-QSGD's.
fn pass_rows() -> Vec<(&'static str, RowFn)> {
    let sdp = config(Preset::Sdp4bit, &[]);
    let qsdp = config(Preset::Qsdp, &[]);
    let zeropp = config(Preset::Zeropp, &[]);
    vec![
        (
            "(1) grad first: H32 + 8-bit SR quantize + swizzle (tlq-hs, 2x2)",
            Box::new(move |o: &Opts, n: &str| quantize_first_row(o, n, &sdp)),
        ),
        (
            "(2) grad second: dequantize + sum D=2 + 4-bit SR requantize",
            Box::new(move |o: &Opts, n: &str| requantize_second_row(o, n, &sdp)),
        ),
        (
            "(3) grad last: dequantize + sum M=2 + inverse H32 into shard",
            Box::new(move |o: &Opts, n: &str| reduce_final_row(o, n, &sdp)),
        ),
        (
            "(4) qWD encode: bf16 new - ref, 4-bit SR g2048",
            Box::new(move |o: &Opts, n: &str| encode_row(o, n, &sdp)),
        ),
        (
            "(5) qWD apply: dequantize W=4 slabs + add + bf16 round",
            Box::new(move |o: &Opts, n: &str| apply_row(o, n, &sdp)),
        ),
        (
            "(6a) QSDP grad quantize: 8-bit asym SR g1024 (W=4)",
            Box::new(move |o: &Opts, n: &str| quantize_first_row(o, n, &qsdp)),
        ),
        (
            "(6b) QSDP grad dequantize + sum W=4 into shard",
            Box::new(move |o: &Opts, n: &str| reduce_final_row(o, n, &qsdp)),
        ),
        (
            "(7) ZeRO++ grad quantize: 4-bit RN g128 + swizzle (2x2)",
            Box::new(move |o: &Opts, n: &str| quantize_first_row(o, n, &zeropp)),
        ),
        ("(8a) Global-QSGD local absmax", Box::new(global_absmax_row)),
        (
            "(8b) Global-QSGD quantize: int8 SR, K=31",
            Box::new(global_quantize_row),
        ),
        (
            "(8c) Global-QSGD dequantize: int8 sum -> fp32 shard",
            Box::new(global_dequantize_row),
        ),
    ]
}

/// Median over `iters` of the slowest rank's time of one gradient reduce-scatter.
fn time_grad_collective(opts: &Opts, cluster: &LocalCluster, preset: Preset) -> Duration {
    let config = config(preset, &[]);
    let numel = opts.bucket_bytes / 4;
    let topo = cluster.topology().clone();
    let times = cluster.run(|comms| {
        let me = comms.world.rank();
        let mut rs = GradReduceScatter::new(&config, &topo, me, numel, 0).expect("plan");
        let bucket = gradients(numel, 90 + me as u64);
        let mut shard = vec![0f32; numel / topo.world()];
        let mut times = Vec::new();
        for step in 0..(opts.warmup + opts.iters) as u64 {
            comms.world.all_reduce_max(0.0).expect("barrier");
            let start = Instant::now();
            rs.run(comms, &bucket, &mut shard, step)
                .expect("reduce-scatter");
            let local = start.elapsed().as_secs_f32();
            times.push(comms.world.all_reduce_max(local).expect("max"));
        }
        times
    });
    median_secs(&times[0][opts.warmup..])
}

/// Median over `iters` of the slowest rank's time of one param all-gather (the optimizer's
/// update of the own shard happens outside the timed region).
fn time_weight_collective(opts: &Opts, cluster: &LocalCluster, preset: Preset) -> Duration {
    let config = config(preset, &[]);
    let numel = opts.param_bucket_bytes / 2;
    let topo = cluster.topology().clone();
    let times = cluster.run(|comms| {
        let me = comms.world.rank();
        let mut p = params(numel, 100);
        let mut ag = WeightAllGather::new(&config, &topo, me, 0, &p).expect("plan");
        let s = numel / topo.world();
        let mut times = Vec::new();
        for step in 0..(opts.warmup + opts.iters) as u64 {
            let own = &mut p[me * s..(me + 1) * s];
            own.copy_from_slice(&updated(own, 110 + step));
            comms.world.all_reduce_max(0.0).expect("barrier");
            let start = Instant::now();
            ag.run(comms.world, &mut p, step).expect("all-gather");
            let local = start.elapsed().as_secs_f32();
            times.push(comms.world.all_reduce_max(local).expect("max"));
        }
        times
    });
    median_secs(&times[0][opts.warmup..])
}

/// Median of seconds as a duration.
fn median_secs(secs: &[f32]) -> Duration {
    let mut v = secs.to_vec();
    v.sort_by(f32::total_cmp);
    Duration::from_secs_f32(v[v.len() / 2])
}

/// The CPU model from /proc/cpuinfo.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The header: machine, date and command.
fn print_header(quick: bool) {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let env = if quick { "SDP4BIT_BENCH_QUICK=1 " } else { "" };
    println!("# sdp4bit CPU benchmark\n");
    println!(
        "- machine: {} ({cores} cores, {} rayon threads)",
        cpu_model(),
        rayon::current_num_threads()
    );
    println!("- date: {}", utc_now());
    println!("- command: `{env}cargo bench --bench cpu`");
    println!(
        "- build: release, `target-cpu=x86-64-v3` from .cargo/config.toml unless RUSTFLAGS overrides it"
    );
    println!("- SIMD at run time: {}", simd_features());
    if let Ok(only) = std::env::var("SDP4BIT_BENCH_ONLY") {
        println!("- rows: only those matching SDP4BIT_BENCH_ONLY={only:?}");
    }
}

/// The vector extensions the passes can use on this CPU (Philox switches to AVX-512F at run
/// time; the rest is compiled for the build's target CPU).
fn simd_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let yes = |b: bool| if b { "yes" } else { "no" };
        format!(
            "AVX2 {}, AVX-512F {}",
            yes(std::arch::is_x86_feature_detected!("avx2")),
            yes(std::arch::is_x86_feature_detected!("avx512f"))
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "not x86-64 (portable paths)".to_string()
    }
}

/// Prints the pass table against the better memcpy, then the per-core breakdown.
fn print_passes(opts: &Opts) {
    let [single, parallel, cached] = memcpy_rows(opts);
    let base = single.gbps().max(parallel.gbps());
    let which = if parallel.gbps() >= single.gbps() {
        "rayon"
    } else {
        "1-thread"
    };
    println!(
        "\n## Fused passes ({} MiB buckets, W = 4 as 2 nodes x 2 ranks, one rank's call)\n",
        opts.bucket_bytes / MIB
    );
    println!(
        "GB/s = (bytes read + bytes written) / median time, 1e9 bytes. x memcpy = GB/s / the \
         better memcpy of this run ({which}, {base:.2} GB/s). Both cores (rayon), buffers \
         rotated beyond the L3.\n"
    );
    println!("| pass | read MiB | written MiB | median ms | min ms | GB/s | x memcpy |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let fns = pass_rows();
    let mut rows: Vec<(Row, &RowFn)> = Vec::new();
    for (name, measure) in fns.iter().filter(|(name, _)| opts.selects(name)) {
        rows.push((measure(opts, name), measure));
    }
    for row in [&single, &parallel, &cached]
        .into_iter()
        .chain(rows.iter().map(|(r, _)| r))
    {
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
            row.name,
            mib(row.read),
            mib(row.written),
            row.time.median.as_secs_f64() * 1e3,
            row.time.min.as_secs_f64() * 1e3,
            row.gbps(),
            row.gbps() / base
        );
    }
    print_breakdown(opts, &rows);
}

/// Prints where the time of each pass goes: the pass on one core against the sum of its
/// kernels measured alone (one core, data in L2), per element of the pass.
fn print_breakdown(opts: &Opts, rows: &[(Row, &RowFn)]) {
    let kernels = kernel_costs(opts);
    let one_core = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    println!("\n## Where the time goes (ns per element of the pass)\n");
    println!(
        "1 core: the pass on a one-thread pool (same sizes). 2 cores x time: the table above's \
         median x 2 cores. Kernels: each step alone on one core with its data in L2 (table \
         below); the rest of a pass is loads, copies, layout and scheduling.\n"
    );
    println!("| pass | elements | 1 core | 2 cores x time | kernels (one core, in cache) | sum |");
    println!("|---|---:|---:|---:|---|---:|");
    for (row, measure) in rows {
        let single = one_core.install(|| measure(opts, &row.name));
        let parts = recipe(&row.name);
        let sum: f64 = parts
            .iter()
            .map(|(k, times)| times * cost(&kernels, k))
            .sum();
        let list: Vec<String> = parts
            .iter()
            .map(|(k, times)| {
                let n = if *times == 1.0 {
                    String::new()
                } else {
                    format!("{times} x ")
                };
                format!("{n}{k} {:.3}", cost(&kernels, k))
            })
            .collect();
        let (list, sum) = if list.is_empty() {
            ("-".to_string(), "-".to_string())
        } else {
            (list.join(" + "), format!("{sum:.3}"))
        };
        println!(
            "| {} | {} | {:.3} | {:.3} | {list} | {sum} |",
            short(&row.name),
            row.elems,
            single.ns_per_elem(),
            2.0 * row.ns_per_elem(),
        );
    }
    println!("\n| kernel (one core, data in L2) | ns/element |");
    println!("|---|---:|");
    for (name, ns) in &kernels {
        println!("| {name} | {ns:.3} |");
    }
}

/// The label's leading `(n)` tag.
fn short(name: &str) -> &str {
    name.split_whitespace().next().unwrap_or(name)
}

/// The measured kernels a pass is made of (kernel label, times per pass element); steps with
/// no kernel of their own (bf16 conversions, Global-QSGD's rounding) are left out.
fn recipe(name: &str) -> Vec<(&'static str, f64)> {
    match short(name) {
        "(1)" => vec![(PHILOX, 1.0), (H_FWD, 1.0), (Q8_SR, 1.0)],
        "(2)" => vec![(DQ8, 1.0), (DQ8_ADD, 1.0), (PHILOX, 1.0), (Q4_SR, 1.0)],
        "(3)" => vec![(DQ4, 1.0), (DQ4_ADD, 1.0), (H_INV, 1.0)],
        "(4)" => vec![(PHILOX, 1.0), (Q4_SR_2048, 1.0)],
        "(5)" => vec![(DQ4_2048, 1.0)],
        "(6a)" => vec![(PHILOX, 1.0), (Q8_ASYM, 1.0)],
        "(6b)" => vec![(DQ8_ASYM, 1.0), (DQ8_ASYM_ADD, 3.0)],
        "(7)" => vec![(Q4_RN, 1.0)],
        "(8b)" => vec![(PHILOX, 1.0)],
        _ => vec![],
    }
}

const PHILOX: &str = "Philox uniforms";
const H_FWD: &str = "H32 forward";
const H_INV: &str = "H32 inverse";
const Q8_SR: &str = "quantize 8-bit sym SR g128";
const Q4_SR: &str = "quantize 4-bit sym SR g128";
const Q4_RN: &str = "quantize 4-bit sym RN g128";
const Q4_SR_2048: &str = "quantize 4-bit sym SR g2048";
const Q8_ASYM: &str = "quantize 8-bit asym SR g1024";
const DQ8: &str = "dequantize 8-bit sym g128";
const DQ8_ADD: &str = "dequantize-add 8-bit sym g128";
const DQ4: &str = "dequantize 4-bit sym g128";
const DQ4_ADD: &str = "dequantize-add 4-bit sym g128";
const DQ4_2048: &str = "dequantize 4-bit sym g2048";
const DQ8_ASYM: &str = "dequantize 8-bit asym g1024";
const DQ8_ASYM_ADD: &str = "dequantize-add 8-bit asym g1024";

/// The cost of kernel `name` in `kernels`.
fn cost(kernels: &[(&'static str, f64)], name: &str) -> f64 {
    kernels
        .iter()
        .find(|(k, _)| *k == name)
        .map_or(f64::NAN, |(_, ns)| *ns)
}

/// Best-of-5 nanoseconds per element of `reps` calls of `f` over `n` elements (one core).
fn per_element(reps: usize, n: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..reps {
            f();
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    best * 1e9 / (reps * n) as f64
}

/// Every kernel of the breakdown, measured on this thread over 64 Ki elements (256 KiB, in
/// L2) of gradient-like data.
fn kernel_costs(opts: &Opts) -> Vec<(&'static str, f64)> {
    let n = 1 << 16;
    let reps = if opts.iters < 5 { 2 } else { 50 };
    let x = gradients(n, 7);
    let rng = UniformStream::new(1, 2, 3);
    let mut u = vec![0f32; n];
    let mut y = x.clone();
    let mut out = vec![
        (
            PHILOX,
            per_element(reps, n, || rng.fill(0, black_box(&mut u))),
        ),
        (
            H_FWD,
            per_element(reps, n, || hadamard::forward(black_box(&mut y), 32)),
        ),
        (
            H_INV,
            per_element(reps, n, || hadamard::inverse(black_box(&mut y), 32)),
        ),
    ];
    let sr = Rounding::Stochastic;
    let quantizers = [
        (Q8_SR, spec(8, 128, true, sr)),
        (Q4_SR, spec(4, 128, true, sr)),
        (Q4_RN, spec(4, 128, true, Rounding::Nearest)),
        (Q4_SR_2048, spec(4, 2048, true, sr)),
        (Q8_ASYM, spec(8, 1024, false, sr)),
    ];
    for (name, q) in quantizers {
        let (mut codes, _) = quantized(&q, &x, &u);
        let cb = q.code_bytes_per_group();
        let ns = per_element(reps, n, || {
            for ((xg, ug), c) in x
                .chunks_exact(q.group_size)
                .zip(u.chunks_exact(q.group_size))
                .zip(codes.chunks_exact_mut(cb))
            {
                black_box(quantize_group(&q, xg, ug, c));
            }
        });
        out.push((name, ns));
    }
    let dequantizers = [
        (DQ8, DQ8_ADD, spec(8, 128, true, sr)),
        (DQ4, DQ4_ADD, spec(4, 128, true, sr)),
        (
            DQ4_2048,
            "dequantize-add 4-bit sym g2048",
            spec(4, 2048, true, sr),
        ),
        (DQ8_ASYM, DQ8_ASYM_ADD, spec(8, 1024, false, sr)),
    ];
    for (set, add, q) in dequantizers {
        let (codes, metas) = quantized(&q, &x, &u);
        let cb = q.code_bytes_per_group();
        let groups = || codes.chunks_exact(cb).zip(&metas);
        let ns_set = per_element(reps, n, || {
            for (o, (c, m)) in y.chunks_exact_mut(q.group_size).zip(groups()) {
                black_box(dequantize_group(&q, c, *m, o, |_, v| v));
            }
        });
        let ns_add = per_element(reps, n, || {
            for (o, (c, m)) in y.chunks_exact_mut(q.group_size).zip(groups()) {
                black_box(dequantize_group(&q, c, *m, o, |a, v| a + v));
            }
        });
        out.push((set, ns_set));
        out.push((add, ns_add));
    }
    out
}

/// A group quantizer.
fn spec(bits: u8, group_size: usize, symmetric: bool, rounding: Rounding) -> QuantSpec {
    QuantSpec {
        bits,
        group_size,
        symmetric,
        rounding,
    }
}

/// `x` quantized group by group with `q`: the codes and each group's metadata.
fn quantized(q: &QuantSpec, x: &[f32], u: &[f32]) -> (Vec<u8>, Vec<GroupMeta>) {
    let cb = q.code_bytes_per_group();
    let mut codes = vec![0u8; x.len() / q.group_size * cb];
    let metas = x
        .chunks_exact(q.group_size)
        .zip(u.chunks_exact(q.group_size))
        .zip(codes.chunks_exact_mut(cb))
        .map(|((xg, ug), c)| quantize_group(q, xg, ug, c))
        .collect();
    (codes, metas)
}

/// Prints the collective table: each codec against the baseline preset, same run.
fn print_collectives(opts: &Opts) {
    let cluster = LocalCluster::new(topology());
    println!(
        "\n## In-process collectives (LocalCluster, W = 4 = 2 nodes x 2 ranks, slowest rank, median)\n"
    );
    println!(
        "Gradient bucket: {} MiB fp32; param bucket: {} MiB bf16. Ratio = codec time / baseline time (below 1 is faster).\n",
        opts.bucket_bytes / MIB,
        opts.param_bucket_bytes / MIB
    );
    println!("| collective | preset | median ms | ratio to baseline |");
    println!("|---|---|---:|---:|");
    let base = time_grad_collective(opts, &cluster, Preset::Baseline);
    let grad = [
        Preset::Baseline,
        Preset::Sdp4bit,
        Preset::Qsdp,
        Preset::GlobalQsgd,
        Preset::Zeropp,
    ];
    for preset in grad {
        let t = if preset == Preset::Baseline {
            base
        } else {
            time_grad_collective(opts, &cluster, preset)
        };
        print_collective_row("GradReduceScatter", preset, t, base);
    }
    let base = time_weight_collective(opts, &cluster, Preset::Baseline);
    print_collective_row("WeightAllGather", Preset::Baseline, base, base);
    let t = time_weight_collective(opts, &cluster, Preset::Sdp4bit);
    print_collective_row("WeightAllGather (qwd)", Preset::Sdp4bit, t, base);
}

/// One collective row.
fn print_collective_row(what: &str, preset: Preset, t: Duration, base: Duration) {
    println!(
        "| {what} | {preset} | {:.2} | {:.2} |",
        t.as_secs_f64() * 1e3,
        t.as_secs_f64() / base.as_secs_f64()
    );
}

fn main() {
    let (opts, quick) = Opts::from_env();
    print_header(quick);
    print_passes(&opts);
    if opts.selects("collective") {
        print_collectives(&opts);
    }
}
