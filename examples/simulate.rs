//! The main job until the Megatron integration lands: a CPU simulation of sharded data
//! parallelism on 2 nodes x 2 ranks (threads, in-process communicators), running a few
//! optimizer steps per preset and printing, for each, the bytes each rank puts on the wire
//! against the uncompressed collectives and the error the codecs introduce.
//!
//! Each step: every rank draws a heavy-tailed gradient bucket (Gaussian plus outlier
//! channels, as in transformer gradients), the bucket is reduce-scattered, each rank takes an
//! SGD step on its fp32 master shard, writes the bf16 result into its shard of the param
//! bucket and the bucket is all-gathered. Errors are measured against the exact fp32 sum and
//! the exact bf16 parameters; replicas are checked bit-identical after every step.
//!
//! Usage: `cargo run --release --example simulate -- [--nodes M] [--per-node D]
//! [--numel N] [--steps T]`

use std::time::Instant;

use half::bf16;
use sdp4bit::collective::local::LocalCluster;
use sdp4bit::collective::{Comm, GradReduceScatter, WeightAllGather, WireBytes, check_ranks_agree};
use sdp4bit::layout::Topology;
use sdp4bit::{Config, Preset};

struct Args {
    nodes: usize,
    per_node: usize,
    numel: usize,
    steps: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        nodes: 2,
        per_node: 2,
        numel: 1 << 22,
        steps: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let parsed: usize = value.parse().map_err(|e| format!("{flag} {value}: {e}"))?;
        match flag.as_str() {
            "--nodes" => args.nodes = parsed,
            "--per-node" => args.per_node = parsed,
            "--numel" => args.numel = parsed,
            "--steps" => args.steps = parsed as u64,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let w = args.nodes * args.per_node;
    args.numel = args.numel.div_ceil(w) * w;
    Ok(args)
}

/// splitmix64: a small deterministic generator for the synthetic gradients.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn gaussian(&mut self) -> f32 {
        let u1 = ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// A transformer-like gradient: N(0, 1e-3) with every 97th "channel" 50x larger.
fn gradient(rank: usize, step: u64, numel: usize) -> Vec<f32> {
    let mut rng = SplitMix(((rank as u64) << 32) ^ step.wrapping_mul(0x2545_F491_4F6C_DD1D));
    (0..numel)
        .map(|i| {
            let outlier = if (i % 4096) % 97 == 0 { 50.0 } else { 1.0 };
            1e-3 * outlier * rng.gaussian()
        })
        .collect()
}

#[derive(Default)]
struct Report {
    grad: WireBytes,
    grad_baseline: WireBytes,
    weight: WireBytes,
    weight_baseline: WireBytes,
    grad_rel_rms: f64,
    weight_max_err: f32,
    seconds: f64,
}

fn run_preset(preset: Preset, args: &Args) -> Result<Report, sdp4bit::Error> {
    let config = Config::preset(preset);
    let topology = Topology::uniform(args.nodes, args.per_node)?;
    let w = topology.world();
    let (numel, shard) = (args.numel, args.numel / w);
    let init: Vec<bf16> = (0..numel)
        .map(|i| bf16::from_f32(((i % 1000) as f32 - 500.0) * 1e-4))
        .collect();
    let cluster = LocalCluster::new(topology.clone());
    let start = Instant::now();
    let per_rank = cluster.run(|comms| -> Result<(Report, Vec<bf16>), sdp4bit::Error> {
        let me = comms.world.rank();
        check_ranks_agree(comms.world, &config, 0, numel)?;
        let mut reduce = GradReduceScatter::new(&config, &topology, me, numel, 0)?;
        let mut gather = WeightAllGather::new(&config, &topology, me, 1, &init)?;
        let mut params = init.clone();
        let mut master: Vec<f32> = params[me * shard..(me + 1) * shard]
            .iter()
            .map(|p| p.to_f32())
            .collect();
        let mut shard_grad = vec![0f32; shard];
        let mut report = Report::default();
        let (mut err2, mut ref2) = (0f64, 0f64);
        for step in 0..args.steps {
            let grads: Vec<Vec<f32>> = (0..w).map(|r| gradient(r, step, numel)).collect();
            reduce.run(comms, &grads[me], &mut shard_grad, step)?;
            for (i, g) in shard_grad.iter().enumerate() {
                let exact: f32 = grads.iter().map(|b| b[me * shard + i]).sum();
                err2 += f64::from(g - exact).powi(2);
                ref2 += f64::from(exact).powi(2);
            }
            for ((m, g), p) in master
                .iter_mut()
                .zip(&shard_grad)
                .zip(&mut params[me * shard..(me + 1) * shard])
            {
                *m -= 0.1 * g;
                *p = bf16::from_f32(*m);
            }
            gather.run(comms.world, &mut params, step)?;
            let own = &params[me * shard..(me + 1) * shard];
            for (p, m) in own.iter().zip(&master) {
                let err = (p.to_f32() - bf16::from_f32(*m).to_f32()).abs();
                report.weight_max_err = report.weight_max_err.max(err);
            }
        }
        report.grad = reduce.wire_bytes(config.grad_quant_start_step);
        report.grad_baseline = reduce.baseline_wire_bytes();
        report.weight = gather.wire_bytes();
        report.weight_baseline = gather.baseline_wire_bytes();
        report.grad_rel_rms = (err2 / ref2.max(f64::MIN_POSITIVE)).sqrt();
        Ok((report, params))
    });
    let seconds = start.elapsed().as_secs_f64();
    let mut results = per_rank.into_iter().collect::<Result<Vec<_>, _>>()?;
    if results.iter().any(|(_, p)| *p != results[0].1) {
        return Err(sdp4bit::Error::Comm(
            "replicas disagree after the all-gather".into(),
        ));
    }
    let (mut report, _) = results.swap_remove(0);
    report.seconds = seconds;
    Ok(report)
}

/// Bytes per rank, normalised to the `(W - 1) * S` elements an uncompressed reduce-scatter or
/// all-gather sends (baseline: 32 bits for fp32, 16 for bf16).
fn effective_bits(bytes: u64, shard: usize, world: usize) -> f64 {
    8.0 * bytes as f64 / (shard * (world - 1).max(1)) as f64
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("simulate: {e}");
            std::process::exit(2);
        }
    };
    let (m, d) = (args.nodes, args.per_node);
    let w = m * d;
    let shard = args.numel / w;
    println!(
        "sdp4bit CPU simulation: {m} nodes x {d} ranks, bucket {} elements ({} MiB fp32 grads, \
         {} MiB bf16 params), {} steps, rayon threads {}",
        args.numel,
        (args.numel * 4) >> 20,
        (args.numel * 2) >> 20,
        args.steps,
        rayon::current_num_threads()
    );
    println!();
    println!(
        "| preset | grad MiB intra / inter (baseline) | grad bits/elem | grad bytes saved | weight MiB (baseline) | weight bits/elem | weight bytes saved | grad rel. RMS error | weight max abs error | wall s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut failed = false;
    for preset in Preset::ALL {
        match run_preset(*preset, &args) {
            Ok(r) => {
                let saved = |c: u64, b: u64| {
                    if b == 0 {
                        "-".to_string()
                    } else {
                        format!("{:.1}%", 100.0 * (1.0 - c as f64 / b as f64))
                    }
                };
                println!(
                    "| {} | {:.2} / {:.2} ({:.2} / {:.2}) | {:.2} | {} | {:.2} ({:.2}) | {:.2} | {} | {:.4} | {:.2e} | {:.1} |",
                    preset,
                    mib(r.grad.intra_node),
                    mib(r.grad.inter_node),
                    mib(r.grad_baseline.intra_node),
                    mib(r.grad_baseline.inter_node),
                    effective_bits(r.grad.total(), shard, w),
                    saved(r.grad.total(), r.grad_baseline.total()),
                    mib(r.weight.total()),
                    mib(r.weight_baseline.total()),
                    effective_bits(r.weight.total(), shard, w),
                    saved(r.weight.total(), r.weight_baseline.total()),
                    r.grad_rel_rms,
                    r.weight_max_err,
                    r.seconds
                );
            }
            Err(e) => {
                failed = true;
                println!("| {preset} | error: {e} |");
            }
        }
    }
    println!();
    println!(
        "MiB: bytes one rank sends per step to peers on its node / on other nodes. bits/elem: \
         those bytes over the (W-1)*S elements an uncompressed collective sends (32 for fp32 \
         gradients, 16 for bf16 weights). Two-level codecs forward a node's partial sums, so \
         their intra-node traffic carries M times more elements at 8 bits and their inter-node \
         traffic 4 bits per element."
    );
    if failed {
        std::process::exit(1);
    }
}
