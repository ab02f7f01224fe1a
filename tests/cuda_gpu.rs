//! Bit-identity of every CUDA kernel with the CPU backend (the executable reference), on fresh
//! random data: odd sizes, groups holding NaN / Inf, denormals, values near fp32's limits,
//! P = 1 and 3, the 2x2 (also with interleaved ranks), 1x4 and 4x1 topologies, and every
//! codec's quantizer.
//!
//! Slabs are compared region by region: code bytes exactly, scales and offsets bit for bit
//! (NaN compared as NaN-ness), padding exactly; fp32 and bf16 outputs bit for bit (NaN as
//! NaN-ness). Device buffers are allocated and copied with cudarc's safe API; the kernels run
//! through the backend's launch methods on a cudarc stream.
//!
//! Needs a CUDA driver, a device and NVRTC. Without them each test prints
//! `skipped: <reason>` and passes, unless `SDP4BIT_REQUIRE_GPU=1` turns the skip into a
//! failure. The random seed is printed and can be fixed with `SDP4BIT_TEST_SEED`.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use half::bf16;
use rayon::prelude::*;

use sdp4bit::backend::cpu::{global_qsgd, gradient, weight};
use sdp4bit::backend::cuda::{
    DeviceSpan, Kernels, Stream, absmax_from_bits, dest_table, device_count, probe,
};
use sdp4bit::codec::int_code::IntCode;
use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::collective::global_k;
use sdp4bit::layout::{BucketPlan, GradLayout, GradRoute, Topology};
use sdp4bit::rng::{Stage, UniformStream, stream_id};
use sdp4bit::{Config, Error, Preset, Rounding, WeightCodec};
use sdp4bit_test_support::cuda_cluster::gpu_kernels;

// ---------------------------------------------------------------------------------------------
// The device, or the reason there is none.

/// The kernels of device 0 and a stream of its primary context.
struct Gpu {
    kernels: &'static Kernels,
    stream: Arc<CudaStream>,
}

/// The GPU, or `None` after printing `skipped: <reason>` (a failure instead when
/// `SDP4BIT_REQUIRE_GPU=1`).
fn gpu() -> Option<Gpu> {
    let kernels = gpu_kernels()?;
    let context = CudaContext::new(0).expect("cudarc context of device 0");
    let stream = context.new_stream().expect("a stream");
    Some(Gpu { kernels, stream })
}

impl Gpu {
    fn upload<T: DeviceRepr>(&self, host: &[T]) -> CudaSlice<T> {
        self.stream.clone_htod(host).expect("host to device copy")
    }

    /// A buffer of `len` bytes filled with a pattern no kernel writes, so untouched output
    /// bytes (padding a kernel should zero) show up.
    fn garbage(&self, len: usize) -> CudaSlice<u8> {
        self.upload(&vec![0xA5u8; len])
    }

    fn download<T: DeviceRepr>(&self, device: &CudaSlice<T>) -> Vec<T> {
        let host = self.stream.clone_dtoh(device).expect("device to host copy");
        self.stream.synchronize().expect("stream synchronize");
        host
    }

    /// A span over the whole of `device`.
    fn span<T>(&self, device: &CudaSlice<T>) -> DeviceSpan<T> {
        let (addr, _record) = device.device_ptr(&self.stream);
        // SAFETY: `addr` is a live allocation of `device.len()` elements of `T` on device 0,
        // kept alive by the caller until it has downloaded the results (which synchronises
        // the stream the kernels run on).
        unsafe { DeviceSpan::from_raw(addr, device.len()) }
    }

    /// A span over the whole of `device` (bf16 bit patterns), as bf16.
    fn bf16_span(&self, device: &CudaSlice<u16>) -> DeviceSpan<bf16> {
        let span = self.span(device);
        // SAFETY: as for `span`; bf16 and u16 have the same size and alignment.
        unsafe { DeviceSpan::from_raw(span.addr(), span.len()) }
    }

    fn stream(&self) -> Stream {
        // SAFETY: a live stream of device 0's primary context, alive as long as `self`.
        unsafe { Stream::from_raw(self.stream.cu_stream() as usize) }
    }
}

// ---------------------------------------------------------------------------------------------
// Random data.

/// The seed of this run: `SDP4BIT_TEST_SEED`, else fresh from the clock.
fn seed() -> u64 {
    let seed = std::env::var("SDP4BIT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            now.map_or(0, |d| d.as_nanos() as u64)
        });
    println!("seed {seed} (SDP4BIT_TEST_SEED={seed} repeats this run)");
    seed
}

/// A deterministic generator over the crate's own Philox: uniforms from one stream, 64-bit
/// words from another.
struct Gen {
    rng: UniformStream,
    words: UniformStream,
    next: u64,
}

impl Gen {
    fn new(seed: u64) -> Self {
        Self {
            rng: UniformStream::new(seed, 0, 0),
            words: UniformStream::new(seed, 1, 0),
            next: 0,
        }
    }

    fn uniform(&mut self) -> f32 {
        self.next += 1;
        self.rng.uniform(self.next)
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.uniform() * n as f32) as usize).min(n - 1)
    }

    fn word(&mut self) -> u64 {
        self.next += 1;
        let [a, b, ..] = self.words.block(self.next);
        u64::from(a) | u64::from(b) << 32
    }

    /// `n` values in runs of random length and magnitude (zeros and signed zeros,
    /// denormals, small, moderate, large, up to fp32's maximum); with `specials`, about one
    /// run in 24 ends in a NaN, +Inf or -Inf.
    fn values(&mut self, n: usize, specials: bool) -> Vec<f32> {
        const MAGNITUDES: [f32; 7] = [0.0, 1e-40, 1e-3, 1.0, 3.0e4, 1e30, f32::MAX];
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let run = (1 + self.below(96)).min(n - out.len());
            let m = MAGNITUDES[self.below(MAGNITUDES.len())];
            for _ in 0..run {
                out.push((2.0 * self.uniform() - 1.0) * m);
            }
            if specials && self.below(24) == 0 {
                let last = out.len() - 1;
                out[last] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][self.below(3)];
            }
        }
        out
    }

    /// `n` bf16 values: [`values`](Self::values) rounded to bf16.
    fn bf16s(&mut self, n: usize, specials: bool) -> Vec<bf16> {
        self.values(n, specials)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    }

    /// A stream for `stage` of bucket 3, rank `rank`, at a random step.
    fn stream(&mut self, rank: usize, stage: Stage) -> UniformStream {
        let step = self.word() % 100_000;
        UniformStream::new(
            self.word(),
            step,
            stream_id(3, rank, stage).expect("stream id"),
        )
    }

    /// `count` slabs of `layout`, each the CPU encoding of random values (with NaN / Inf
    /// groups): valid input for the decoding kernels.
    fn slabs(&mut self, layout: SlabLayout, count: usize) -> Vec<u8> {
        let g = layout.spec.group_size;
        let mut out = vec![0u8; count * layout.byte_len()];
        for slab in out.chunks_exact_mut(layout.byte_len()) {
            let x = self.values(layout.elements(), true);
            let mut u = vec![0f32; layout.elements()];
            UniformStream::new(self.word(), 1, 2).fill(0, &mut u);
            layout
                .par_slots_mut(slab)
                .enumerate()
                .for_each(|(k, mut slot)| {
                    slot.quantize(&layout.spec, &x[k * g..][..g], &u[k * g..][..g])
                });
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Comparisons.

fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn assert_f32s(tag: &str, cpu: &[f32], gpu: &[f32]) {
    assert_eq!(cpu.len(), gpu.len(), "{tag}: lengths");
    if let Some(i) = (0..cpu.len()).find(|&i| !same_f32(cpu[i], gpu[i])) {
        panic!(
            "{tag}: element {i}: cpu {:e} ({:#010x}), gpu {:e} ({:#010x})",
            cpu[i],
            cpu[i].to_bits(),
            gpu[i],
            gpu[i].to_bits()
        );
    }
}

fn assert_bf16s(tag: &str, cpu: &[bf16], gpu: &[u16]) {
    assert_eq!(cpu.len(), gpu.len(), "{tag}: lengths");
    let differs = |i: usize| {
        let g = bf16::from_bits(gpu[i]);
        cpu[i].to_bits() != gpu[i] && !(cpu[i].is_nan() && g.is_nan())
    };
    if let Some(i) = (0..cpu.len()).find(|&i| differs(i)) {
        panic!(
            "{tag}: element {i}: cpu {} ({:#06x}), gpu {} ({:#06x})",
            cpu[i],
            cpu[i].to_bits(),
            bf16::from_bits(gpu[i]),
            gpu[i]
        );
    }
}

/// Compares buffers of whole slabs of `layout`: codes exactly, scales and offsets as floats
/// (NaN as NaN-ness), padding exactly; panics naming the slab and group.
fn assert_slabs(tag: &str, layout: SlabLayout, cpu: &[u8], gpu: &[u8]) {
    assert_eq!(cpu.len(), gpu.len(), "{tag}: buffer lengths");
    let code_bytes = layout.spec.code_bytes_per_group();
    let meta_end = layout.codes_len() + 4 * layout.groups * layout.spec.meta_words();
    let word = |b: &[u8], at: usize| f32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    for (s, (c, g)) in cpu
        .chunks_exact(layout.byte_len())
        .zip(gpu.chunks_exact(layout.byte_len()))
        .enumerate()
    {
        if let Some(i) = (0..layout.codes_len()).find(|&i| c[i] != g[i]) {
            let k = i / code_bytes;
            panic!(
                "{tag}: slab {s} group {k}: codes differ at byte {} of the group: cpu {:#04x}, \
                 gpu {:#04x} (cpu scale {:e}, gpu scale {:e})",
                i % code_bytes,
                c[i],
                g[i],
                word(c, layout.codes_len() + 4 * k),
                word(g, layout.codes_len() + 4 * k)
            );
        }
        for at in (layout.codes_len()..meta_end).step_by(4) {
            let (a, b) = (word(c, at), word(g, at));
            if !same_f32(a, b) {
                let index = (at - layout.codes_len()) / 4;
                let (what, k) = if index < layout.groups {
                    ("scale", index)
                } else {
                    ("offset", index - layout.groups)
                };
                panic!("{tag}: slab {s} group {k}: {what} cpu {a:e}, gpu {b:e}");
            }
        }
        assert_eq!(c[meta_end..], g[meta_end..], "{tag}: slab {s}: padding");
    }
}

// ---------------------------------------------------------------------------------------------
// The cases.

/// Gradient configurations covering every grouped codec's quantizers: TLq-HS (8/4-bit, H32),
/// a 256-block Hadamard over 512-element groups (two tiles), TLq, QSDP (asymmetric 8-bit,
/// 1024-element groups), ZeRO++ (4-bit round-to-nearest), and a mixed 4/8-bit nearest TLq.
fn grad_configs(chunks: usize) -> Vec<(String, Config)> {
    let p = chunks.to_string();
    let cases: [(&str, &[(&str, &str)]); 6] = [
        ("tlq-hs", &[("grad_codec", "tlq-hs")]),
        (
            "tlq-hs-g512-h256",
            &[
                ("grad_codec", "tlq-hs"),
                ("grad_group_size", "512"),
                ("hadamard_block", "256"),
            ],
        ),
        ("tlq", &[("grad_codec", "tlq")]),
        ("qsdp", &[("grad_codec", "qsdp")]),
        ("zeropp", &[("grad_codec", "zeropp")]),
        (
            "tlq-4-8-rn",
            &[
                ("grad_codec", "tlq"),
                ("grad_intra_bits", "4"),
                ("grad_inter_bits", "8"),
                ("grad_rounding", "nearest"),
            ],
        ),
    ];
    cases
        .iter()
        .map(|(name, overrides)| {
            let all = overrides
                .iter()
                .copied()
                .chain([("pipeline_chunks", p.as_str())]);
            let config = Config::from_overrides(Preset::Sdp4bit, all).expect("valid config");
            (format!("{name} P={chunks}"), config)
        })
        .collect()
}

/// The topologies of the sweep, as one node label per DP rank: 2 nodes x 2 ranks (two
/// levels), the same with the nodes' ranks interleaved (a destination table that is not a
/// plain transpose), 1 node x 4 ranks (intra-node level only), 4 nodes x 1 rank (inter-node
/// level only).
const TOPOLOGIES: [(&str, &[u64]); 4] = [
    ("2x2", &[0, 0, 1, 1]),
    ("2x2-interleaved", &[0, 1, 0, 1]),
    ("1x4", &[0, 0, 0, 0]),
    ("4x1", &[0, 1, 2, 3]),
];

/// Every gradient layout of the sweep: configs x [`TOPOLOGIES`] x P (1, 3) x shard sizes
/// (less than one group, several groups with a partial one).
fn grad_layouts() -> Vec<(String, GradLayout)> {
    let mut layouts = Vec::new();
    for chunks in [1, 3] {
        for (name, config) in grad_configs(chunks) {
            for (topo, labels) in TOPOLOGIES {
                let topology = Topology::from_node_labels(labels).expect("topology");
                let route = GradRoute::new(&config, &topology);
                let w = topology.world();
                for shard in [45, 2 * config.grad.group_size * chunks + 77] {
                    let plan = BucketPlan::new(w * shard, w, &config).expect("plan");
                    let layout = GradLayout::new(&config, &topology, &route, plan)
                        .expect("W > 1 has an exchange");
                    let tag = format!("{name} {topo} S={shard}");
                    layouts.push((tag, layout));
                }
            }
        }
    }
    layouts
}

/// Weight configurations covering every weight codec's quantizer.
fn weight_configs() -> Vec<(String, Config)> {
    let cases: [(&str, &[(&str, &str)]); 6] = [
        ("qwd", &[("weight_codec", "qwd")]),
        (
            "qwd-8bit-g256",
            &[
                ("weight_codec", "qwd"),
                ("weight_bits", "8"),
                ("weight_group_size", "256"),
            ],
        ),
        ("qw", &[("weight_codec", "qw")]),
        ("qsdp", &[("weight_codec", "qsdp")]),
        (
            "qsdp-4bit-g64",
            &[
                ("weight_codec", "qsdp"),
                ("weight_bits", "4"),
                ("weight_group_size", "64"),
            ],
        ),
        ("zeropp", &[("weight_codec", "zeropp")]),
    ];
    cases
        .iter()
        .map(|(name, overrides)| {
            let config = Config::from_overrides(Preset::Sdp4bit, overrides.iter().copied())
                .expect("valid config");
            (name.to_string(), config)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// Without a driver the whole device surface returns error values (no panic), and the CPU
/// backend is unaffected.
#[test]
fn without_a_driver_everything_is_an_error_value() {
    let Err(reason) = probe::driver() else {
        println!("skipped: a CUDA driver is present");
        return;
    };
    assert!(matches!(reason, Error::Cuda(_)), "{reason:?}");
    assert!(matches!(device_count(), Err(Error::Cuda(_))));
    assert!(matches!(Kernels::get(0), Err(Error::Cuda(_))));
    // The CPU passes still run.
    let rng = UniformStream::new(1, 2, 3);
    let mut out = [0i8; 4];
    global_qsgd::quantize(
        &[0.5, -0.5, 1.0, 0.0],
        0.25,
        3,
        Rounding::Nearest,
        &rng,
        &mut out,
    );
    assert_eq!(out, [2, -2, 3, 0]);
}

/// `grad_quantize_first` writes the CPU's bytes for every layout of the sweep.
#[test]
fn grad_quantize_first_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut data = Gen::new(seed);
    for (tag, layout) in grad_layouts() {
        let tag = format!("quantize_first {tag} seed {seed}");
        let first = layout.first;
        let bucket = data.values(layout.bucket.numel, true);
        let rng = data.stream(1, Stage::GradFirst);
        let mut cpu = vec![0u8; layout.bucket.chunks * first.peers * first.slab.byte_len()];
        gradient::quantize_first(&layout, &bucket, &rng, &mut cpu);

        let d_bucket = gpu.upload(&bucket);
        let d_dests = gpu.upload(&dest_table(&layout).expect("dests"));
        let d_out = gpu.garbage(cpu.len());
        gpu.kernels
            .grad_quantize_first(
                gpu.stream(),
                &layout,
                gpu.span(&d_bucket),
                gpu.span(&d_dests),
                &rng,
                gpu.span(&d_out),
            )
            .unwrap_or_else(|e| panic!("{tag}: {e}"));
        assert_slabs(&tag, first.slab, &cpu, &gpu.download(&d_out));
    }
}

/// `grad_requantize_second` writes the CPU's bytes for every two-level layout, chunk and the
/// first and last first-level index.
#[test]
fn grad_requantize_second_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut data = Gen::new(seed);
    let mut checked = 0;
    for (tag, layout) in grad_layouts() {
        let Some(second) = layout.second else {
            continue;
        };
        let first = layout.first;
        let d_dests = gpu.upload(&dest_table(&layout).expect("dests"));
        for p in 0..layout.bucket.chunks {
            for my_x1 in [0, first.peers - 1] {
                let tag = format!("requantize_second {tag} p={p} x1={my_x1} seed {seed}");
                let recv = data.slabs(first.slab, first.peers);
                let rng = data.stream(my_x1, Stage::GradSecond);
                let mut cpu = vec![0u8; second.peers * second.slab.byte_len()];
                gradient::requantize_second(&layout, my_x1, p, &recv, &rng, &mut cpu)
                    .unwrap_or_else(|e| panic!("{tag}: cpu: {e}"));

                let d_recv = gpu.upload(&recv);
                let d_out = gpu.garbage(cpu.len());
                gpu.kernels
                    .grad_requantize_second(
                        gpu.stream(),
                        &layout,
                        my_x1,
                        p,
                        gpu.span(&d_recv),
                        gpu.span(&d_dests),
                        &rng,
                        gpu.span(&d_out),
                    )
                    .unwrap_or_else(|e| panic!("{tag}: {e}"));
                assert_slabs(&tag, second.slab, &cpu, &gpu.download(&d_out));
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "the sweep has two-level layouts");
}

/// `grad_reduce_final` writes the CPU's shard for every layout and chunk, and leaves the
/// other chunks' elements alone.
#[test]
fn grad_reduce_final_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut data = Gen::new(seed);
    for (tag, layout) in grad_layouts() {
        let last = layout.last();
        let sentinel = data.values(layout.bucket.shard_len, false);
        let mut cpu = sentinel.clone();
        let d_shard = gpu.upload(&sentinel);
        for p in 0..layout.bucket.chunks {
            let tag = format!("reduce_final {tag} p={p} seed {seed}");
            let recv = data.slabs(last.slab, last.peers);
            gradient::reduce_final(&layout, p, &recv, &mut cpu)
                .unwrap_or_else(|e| panic!("{tag}: cpu: {e}"));
            let d_recv = gpu.upload(&recv);
            gpu.kernels
                .grad_reduce_final(
                    gpu.stream(),
                    &layout,
                    p,
                    gpu.span(&d_recv),
                    gpu.span(&d_shard),
                )
                .unwrap_or_else(|e| panic!("{tag}: {e}"));
            assert_f32s(&tag, &cpu, &gpu.download(&d_shard));
        }
    }
}

/// `weight_encode` writes the CPU's slab, and `weight_apply` the CPU's params, for every
/// weight codec, W = 1, 3, 4 and an odd shard length.
#[test]
fn weight_passes_match_cpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut data = Gen::new(seed);
    for (name, config) in weight_configs() {
        let spec = QuantSpec::of_weights(&config.weight).expect("a grouped weight codec");
        let encoding = if config.weight.codec == WeightCodec::Qwd {
            WeightEncoding::Difference
        } else {
            WeightEncoding::Direct
        };
        for w in [1, 3, 4] {
            let shard = 2 * spec.group_size + 333;
            let plan = BucketPlan::new(w * shard, w, &config).expect("plan");
            let layout = SlabLayout {
                spec,
                groups: plan.padded_shard_len / spec.group_size,
            };
            let me = w - 1;
            let tag = format!("{name} W={w} seed {seed}");

            // Encode this rank's shard.
            let new = data.bf16s(shard, true);
            let reference = data.bf16s(shard, true);
            let rng = data.stream(me, Stage::Weight);
            let first_index = plan.padded_index(me, 0);
            let mut cpu = vec![0u8; layout.byte_len()];
            weight::encode_shard(
                layout,
                encoding,
                first_index,
                &new,
                &reference,
                &rng,
                &mut cpu,
            );
            let d_new = gpu.upload(&bits(&new));
            let d_reference = gpu.upload(&bits(&reference));
            let d_out = gpu.garbage(cpu.len());
            gpu.kernels
                .weight_encode(
                    gpu.stream(),
                    &layout,
                    encoding,
                    first_index,
                    gpu.bf16_span(&d_new),
                    gpu.bf16_span(&d_reference),
                    &rng,
                    gpu.span(&d_out),
                )
                .unwrap_or_else(|e| panic!("encode {tag}: {e}"));
            assert_slabs(
                &format!("encode {tag}"),
                layout,
                &cpu,
                &gpu.download(&d_out),
            );

            // Apply every rank's slab (each the CPU encoding of random shards).
            let mut recv = Vec::with_capacity(w * layout.byte_len());
            for z in 0..w {
                let (new, reference) = (data.bf16s(shard, true), data.bf16s(shard, true));
                let rng = data.stream(z, Stage::Weight);
                let mut slab = vec![0u8; layout.byte_len()];
                let first = plan.padded_index(z, 0);
                weight::encode_shard(layout, encoding, first, &new, &reference, &rng, &mut slab);
                recv.extend_from_slice(&slab);
            }
            let own_reference = data.bf16s(shard, true);
            let params = data.bf16s(plan.numel, true);
            let mut cpu = params.clone();
            weight::apply_shards(layout, encoding, &plan, me, &recv, &own_reference, &mut cpu)
                .unwrap_or_else(|e| panic!("apply {tag}: cpu: {e}"));
            let d_recv = gpu.upload(&recv);
            let d_own = gpu.upload(&bits(&own_reference));
            let d_params = gpu.upload(&bits(&params));
            gpu.kernels
                .weight_apply(
                    gpu.stream(),
                    &layout,
                    encoding,
                    &plan,
                    me,
                    gpu.span(&d_recv),
                    gpu.bf16_span(&d_own),
                    gpu.bf16_span(&d_params),
                )
                .unwrap_or_else(|e| panic!("apply {tag}: {e}"));
            assert_bf16s(&format!("apply {tag}"), &cpu, &gpu.download(&d_params));
        }
    }
}

fn bits(values: &[bf16]) -> Vec<u16> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Global-QSGD: the absmax (NaN / Inf flagged as +Inf), the 8- and 16-bit rounding with both
/// roundings, and the dequantization, on odd sizes.
#[test]
fn global_qsgd_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut data = Gen::new(seed);
    for numel in [1, 255, 10_007, 100_003] {
        for specials in [false, true] {
            let tag = format!("numel {numel} specials {specials} seed {seed}");
            let bucket = data.values(numel, specials);
            let d_bucket = gpu.upload(&bucket);
            let cpu_absmax = global_qsgd::local_absmax(&bucket);
            let d_bits = gpu.upload(&[0xDEAD_BEEFu32]);
            gpu.kernels
                .global_absmax(gpu.stream(), gpu.span(&d_bucket), gpu.span(&d_bits))
                .unwrap_or_else(|e| panic!("absmax {tag}: {e}"));
            let gpu_absmax = absmax_from_bits(gpu.download(&d_bits)[0]);
            assert_eq!(cpu_absmax.to_bits(), gpu_absmax.to_bits(), "absmax {tag}");

            check_global::<i8>(&gpu, &mut data, &tag, &bucket, cpu_absmax, 2);
            check_global::<i8>(&gpu, &mut data, &tag, &bucket, cpu_absmax, 127);
            check_global::<i16>(&gpu, &mut data, &tag, &bucket, cpu_absmax, 3);
            check_global::<i16>(&gpu, &mut data, &tag, &bucket, cpu_absmax, 1000);
        }
    }
}

/// Quantize (both roundings) and dequantize with `T` for a world of `w`.
fn check_global<T: IntCode + DeviceRepr + Default>(
    gpu: &Gpu,
    data: &mut Gen,
    tag: &str,
    bucket: &[f32],
    absmax: f32,
    w: usize,
) {
    let k = global_k(T::BITS, w);
    // A non-finite absmax never reaches the rounding in the collective; any finite scale
    // still exercises NaN / Inf inputs here.
    let scale = if absmax.is_finite() && absmax > 0.0 {
        absmax / k as f32
    } else {
        0.37
    };
    let tag = format!("{tag} {}-bit W={w}", T::BITS);
    let d_bucket = gpu.upload(bucket);
    for rounding in [Rounding::Stochastic, Rounding::Nearest] {
        let rng = data.stream(0, Stage::GlobalQsgd);
        let mut cpu = vec![T::default(); bucket.len()];
        global_qsgd::quantize(bucket, scale, k, rounding, &rng, &mut cpu);
        let d_out = gpu.upload(&vec![T::from_f32(1.0); bucket.len()]);
        gpu.kernels
            .global_quantize(
                gpu.stream(),
                gpu.span(&d_bucket),
                scale,
                k,
                rounding,
                &rng,
                gpu.span(&d_out),
            )
            .unwrap_or_else(|e| panic!("quantize {tag}: {e}"));
        let out = gpu.download(&d_out);
        if let Some(i) = (0..cpu.len()).find(|&i| cpu[i] != out[i]) {
            panic!(
                "quantize {tag} {rounding:?}: element {i} ({:e}): cpu {:?}, gpu {:?}",
                bucket[i], cpu[i], out[i]
            );
        }
    }
    let top = (k as usize * w) as f32;
    let sums: Vec<T> = (0..bucket.len())
        .map(|_| T::from_f32(((2.0 * data.uniform() - 1.0) * top).round()))
        .collect();
    let mut cpu = vec![0f32; sums.len()];
    global_qsgd::dequantize(&sums, scale, &mut cpu);
    let d_sums = gpu.upload(&sums);
    let d_out = gpu.upload(&vec![f32::NAN; sums.len()]);
    gpu.kernels
        .global_dequantize(gpu.stream(), gpu.span(&d_sums), scale, gpu.span(&d_out))
        .unwrap_or_else(|e| panic!("dequantize {tag}: {e}"));
    assert_f32s(&format!("dequantize {tag}"), &cpu, &gpu.download(&d_out));
}

/// A received group no encoder produces (negative or infinite scale, or the symmetric code
/// -2^(b-1)) decodes to NaN on the GPU, where the CPU returns `Error::Decode`: the GPU result
/// equals the CPU's on the same slabs with that group's scale set to NaN (the non-finite
/// marker).
#[test]
fn corrupt_groups_decode_to_nan() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut data = Gen::new(seed);
    for (tag, layout) in grad_layouts() {
        let last = layout.last();
        let spec = last.slab.spec;
        let kinds: &[&str] = if spec.symmetric {
            &["negative scale", "infinite scale", "minimum code"]
        } else {
            &["negative scale", "infinite scale"]
        };
        for &kind in kinds {
            let tag = format!("reduce_final {tag} {kind} seed {seed}");
            let recv = data.slabs(last.slab, last.peers);
            // A group holding real elements of chunk 0 (padding groups are never decoded).
            let plan = layout.bucket;
            let real_groups = plan
                .shard_len
                .min(plan.chunk_len())
                .div_ceil(spec.group_size);
            let (peer, k) = (data.below(last.peers), data.below(real_groups));
            let slab = peer * last.slab.byte_len();
            let scale_at = slab + last.slab.codes_len() + 4 * k;
            let mut corrupt = recv.clone();
            match kind {
                "negative scale" => set_f32(&mut corrupt, scale_at, -1.0),
                "infinite scale" => set_f32(&mut corrupt, scale_at, f32::INFINITY),
                _ => {
                    // The first code of the group becomes -2^(b-1): nibble 0x8 or byte 0x80,
                    // with a finite scale so only the code is wrong.
                    set_f32(&mut corrupt, scale_at, 1.0);
                    let code = slab + k * spec.code_bytes_per_group();
                    corrupt[code] = if spec.bits == 4 {
                        (corrupt[code] & 0xF0) | 0x08
                    } else {
                        0x80
                    };
                }
            }
            assert!(
                gradient::reduce_final(
                    &layout,
                    0,
                    &corrupt,
                    &mut vec![0.0; layout.bucket.shard_len]
                )
                .is_err(),
                "{tag}: the CPU rejects the corrupt group"
            );
            let mut marked = recv.clone();
            set_f32(&mut marked, scale_at, f32::NAN);
            let mut cpu = vec![0f32; layout.bucket.shard_len];
            gradient::reduce_final(&layout, 0, &marked, &mut cpu)
                .unwrap_or_else(|e| panic!("{tag}: cpu: {e}"));
            let d_recv = gpu.upload(&corrupt);
            let d_shard = gpu.upload(&vec![0f32; layout.bucket.shard_len]);
            gpu.kernels
                .grad_reduce_final(
                    gpu.stream(),
                    &layout,
                    0,
                    gpu.span(&d_recv),
                    gpu.span(&d_shard),
                )
                .unwrap_or_else(|e| panic!("{tag}: {e}"));
            assert_f32s(&tag, &cpu, &gpu.download(&d_shard));
        }
    }
}

fn set_f32(bytes: &mut [u8], at: usize, value: f32) {
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

/// A launch from a thread with no current CUDA context works (the backend makes the device's
/// primary context current for the call) and leaves the thread without one.
#[test]
fn launch_from_a_thread_without_a_context() {
    let Some(gpu) = gpu() else { return };
    let sums: Vec<i8> = (0..1000).map(|i| (i % 200 - 100) as i8).collect();
    let mut cpu = vec![0f32; sums.len()];
    global_qsgd::dequantize(&sums, 0.25, &mut cpu);
    let d_sums = gpu.upload(&sums);
    let d_out = gpu.upload(&vec![0f32; sums.len()]);
    gpu.stream.synchronize().expect("uploads done");
    let (kernels, stream) = (gpu.kernels, gpu.stream());
    let (sums_span, out_span) = (gpu.span(&d_sums), gpu.span(&d_out));
    std::thread::spawn(move || {
        let current = cudarc::driver::result::ctx::get_current().expect("cuCtxGetCurrent");
        assert_eq!(current, None, "a new thread has no current context");
        kernels
            .global_dequantize(stream, sums_span, 0.25, out_span)
            .expect("launch");
        let current = cudarc::driver::result::ctx::get_current().expect("cuCtxGetCurrent");
        assert_eq!(
            current, None,
            "the launch restored the thread's (empty) context"
        );
    })
    .join()
    .expect("thread");
    assert_f32s(
        "dequantize from another thread",
        &cpu,
        &gpu.download(&d_out),
    );
}

/// Buffers that do not match the plan, misaligned or overlapping buffers and out-of-range
/// indices are errors before anything is launched; the cache returns the same kernels.
#[test]
fn bad_launches_are_errors() {
    let Some(gpu) = gpu() else { return };
    assert!(std::ptr::eq(gpu.kernels, Kernels::get(0).expect("cached")));
    let (_, layout) = grad_layouts()
        .into_iter()
        .find(|(_, l)| l.second.is_some())
        .expect("a two-level layout");
    let first = layout.first;
    let rng = UniformStream::new(1, 2, 3);
    let bucket = gpu.upload(&vec![0f32; layout.bucket.numel]);
    let dests = gpu.upload(&dest_table(&layout).expect("dests"));
    let out_len = layout.bucket.chunks * first.peers * first.slab.byte_len();
    let out = gpu.upload(&vec![0u8; out_len + 16]);
    let out_span = gpu.span(&out);
    // SAFETY: sub-ranges of the live allocation `out`; nothing is launched with them.
    let (exact, short, misaligned) = unsafe {
        (
            DeviceSpan::<u8>::from_raw(out_span.addr(), out_len),
            DeviceSpan::<u8>::from_raw(out_span.addr(), out_len - 16),
            DeviceSpan::<u8>::from_raw(out_span.addr() + 1, out_len),
        )
    };
    let launch = |out: DeviceSpan<u8>, bucket: DeviceSpan<f32>| {
        gpu.kernels
            .grad_quantize_first(gpu.stream(), &layout, bucket, gpu.span(&dests), &rng, out)
    };
    let bucket_span = gpu.span(&bucket);
    launch(exact, bucket_span).expect("the right buffers launch");
    assert!(matches!(launch(short, bucket_span), Err(Error::Buffer(_))));
    assert!(matches!(
        launch(misaligned, bucket_span),
        Err(Error::Buffer(_))
    ));
    // SAFETY: the output viewed as the input; nothing is launched with it.
    let aliased = unsafe { DeviceSpan::<f32>::from_raw(out_span.addr(), layout.bucket.numel) };
    assert!(matches!(launch(exact, aliased), Err(Error::Buffer(_))));
    let recv = gpu.upload(&vec![0u8; first.peers * first.slab.byte_len()]);
    let second = layout.second.expect("two levels");
    let send = gpu.upload(&vec![0u8; second.peers * second.slab.byte_len()]);
    let requantize = |my_x1: usize, chunk: usize| {
        gpu.kernels.grad_requantize_second(
            gpu.stream(),
            &layout,
            my_x1,
            chunk,
            gpu.span(&recv),
            gpu.span(&dests),
            &rng,
            gpu.span(&send),
        )
    };
    assert!(matches!(requantize(first.peers, 0), Err(Error::Buffer(_))));
    assert!(matches!(
        requantize(0, layout.bucket.chunks),
        Err(Error::Buffer(_))
    ));
    gpu.stream.synchronize().expect("the valid launch ran");
}
