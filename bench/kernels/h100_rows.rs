//! The 13 kernel rows the H100 timed (`bench/gpu.rs` `kernel_rows()`, results in
//! `bench/results/gpu/README.md`): their measured medians, their bytes, units and grids at the
//! benchmark's sizes (one rank of 2 nodes x 2 ranks, 256 MiB buckets: 64 Mi fp32 gradients,
//! 128 Mi bf16 parameters), and a small case of each with the row's exact configuration and
//! data for the coverage emulator, with the bytes the CPU backend computes for its outputs.
//!
//! The rows are counted on two builds ([`Shape`]): the kernels of c4b4d29 (the code the H100
//! ran, unchanged since e9c1ddd), whose launches take the configuration at run time, with the
//! grids and units of c4b4d29's `backend/cuda/launch.rs`; and the current kernels, specialised
//! to the row's configuration, cut and launched as the current `backend/cuda/launch.rs` does
//! with the variant production takes on sm_90. The parameter structs are the crate's
//! (`backend::cuda::abi`, the layout both builds read).

use half::bf16;

use sdp4bit::backend::GradElement;
use sdp4bit::backend::cpu::{global_qsgd, gradient, weight};
use sdp4bit::backend::cuda::abi::{
    SdpGlobal, SdpGradFinal, SdpGradFirst, SdpGradSecond, SdpQuant, SdpWeightApply, SdpWeightEncode,
};
use sdp4bit::backend::cuda::{Constants, Variant};
use sdp4bit::codec::quant::QuantSpec;
use sdp4bit::codec::slab::SlabLayout;
use sdp4bit::codec::weight_encoding::WeightEncoding;
use sdp4bit::collective::global_k;
use sdp4bit::layout::{BucketPlan, GradLayout, GradRoute, Topology};
use sdp4bit::rng::UniformStream;
use sdp4bit::{Config, Preset, Rounding};
use sdp4bit_test_support::emulator_case::{
    CaseBuffer, CaseFormat, CaseLaunch, EmulatorCase, WarpOrder,
};

use crate::common::{gradients, params, updated};

/// DP ranks of the benchmark (2 nodes x 2 ranks).
const WORLD: usize = 4;
/// The benchmark's bucket: 256 MiB.
const BUCKET_BYTES: usize = 256 << 20;
/// The H100's multiprocessors, which the grids' caps are set per.
pub const MULTIPROCESSORS: u64 = 132;
/// Grid cap of c4b4d29's launches: blocks per multiprocessor, times the H100's 132.
const GRID_CAP: u64 = 32 * MULTIPROCESSORS;
/// Threads of every block of c4b4d29's launches.
const H100_THREADS: u64 = 256;
/// Groups of one work unit of c4b4d29's `grad_quantize_first` (one for its other grouped
/// kernels).
const FIRST_GROUPS_PER_UNIT: u64 = 3;
/// Elements of one run of an element-wise kernel's thread.
const RUN: u64 = 4;
/// The least work units of a counting case.
const CASE_UNITS: u64 = 64;

/// How a build cuts a row's work into units (a warp's step of its grid-stride loop) and
/// launches them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Groups of one unit of a grouped kernel.
    pub groups: u64,
    /// Runs of 4 elements one thread takes per step of an element-wise kernel.
    pub runs: u64,
    /// Threads of a block.
    pub threads: u64,
    /// Blocks launched at most (the kernels loop grid-stride over the rest).
    pub grid_cap: u64,
    /// The case-file format of the build's emulator.
    pub format: CaseFormat,
}

impl Shape {
    /// The shape of a specialised kernel's `variant` on the H100 (its units, threads and grid
    /// cap per multiprocessor), as the current `backend::cuda::launch` launches it.
    pub fn of_variant(variant: &Variant) -> Self {
        Self {
            groups: u64::from(variant.units),
            runs: u64::from(variant.units),
            threads: u64::from(variant.threads),
            grid_cap: MULTIPROCESSORS * u64::from(variant.grid_blocks),
            format: CaseFormat::V3,
        }
    }

    /// Warps of one block.
    pub fn warps_per_block(&self) -> u64 {
        self.threads / 32
    }

    /// Warps of a launch whose grid covers `workers` warps (a grouped kernel's units) or
    /// threads (an element-wise kernel's), `per_block` a block, at most the grid cap.
    fn launched_warps(&self, workers: u64, per_block: u64) -> f64 {
        (workers.div_ceil(per_block).min(self.grid_cap) * self.warps_per_block()) as f64
    }
}
/// What a row launches.
#[derive(Debug, Clone, Copy)]
pub enum Work {
    GradFirst { preset: Preset, bf16: bool },
    GradSecond,
    GradFinal { preset: Preset, bf16: bool },
    WeightEncode,
    WeightApply,
    GlobalAbsmax,
    GlobalQuantize,
    GlobalDequantize,
}

/// One timed row.
#[derive(Debug, Clone, Copy)]
pub struct H100Row {
    /// The row as `bench/results/gpu/README.md` names it.
    pub label: &'static str,
    /// The entry point and its source file in `kernels/`.
    pub kernel: &'static str,
    pub file: &'static str,
    /// The median of the four runs' medians, microseconds.
    pub measured_us: f64,
    pub work: Work,
}

/// The rows, in the README's order, with its medians.
pub const ROWS: [H100Row; 13] = {
    use Work::*;
    let sdp = Preset::Sdp4bit;
    [
        H100Row {
            label: "(1) grad first, tlq-hs 2x2",
            kernel: "grad_quantize_first",
            file: "grad_quantize_first.cu",
            measured_us: 441.6,
            work: GradFirst {
                preset: sdp,
                bf16: false,
            },
        },
        H100Row {
            label: "(1b) grad first, bf16 bucket",
            kernel: "grad_quantize_first_bf16",
            file: "grad_quantize_first.cu",
            measured_us: 451.2,
            work: GradFirst {
                preset: sdp,
                bf16: true,
            },
        },
        H100Row {
            label: "(2) grad second",
            kernel: "grad_requantize_second",
            file: "grad_requantize_second.cu",
            measured_us: 233.5,
            work: GradSecond,
        },
        H100Row {
            label: "(3) grad last",
            kernel: "grad_reduce_final",
            file: "grad_reduce_final.cu",
            measured_us: 102.4,
            work: GradFinal {
                preset: sdp,
                bf16: false,
            },
        },
        H100Row {
            label: "(3b) grad last, bf16 shard",
            kernel: "grad_reduce_final_bf16",
            file: "grad_reduce_final.cu",
            measured_us: 103.2,
            work: GradFinal {
                preset: sdp,
                bf16: true,
            },
        },
        H100Row {
            label: "(4) qWD encode",
            kernel: "weight_encode",
            file: "weight_encode.cu",
            measured_us: 166.0,
            work: WeightEncode,
        },
        H100Row {
            label: "(5) qWD apply",
            kernel: "weight_apply",
            file: "weight_apply.cu",
            measured_us: 267.5,
            work: WeightApply,
        },
        H100Row {
            label: "(6a) QSDP grad quantize",
            kernel: "grad_quantize_first",
            file: "grad_quantize_first.cu",
            measured_us: 246.1,
            work: GradFirst {
                preset: Preset::Qsdp,
                bf16: false,
            },
        },
        H100Row {
            label: "(6b) QSDP grad dequantize + sum",
            kernel: "grad_reduce_final",
            file: "grad_reduce_final.cu",
            measured_us: 98.4,
            work: GradFinal {
                preset: Preset::Qsdp,
                bf16: false,
            },
        },
        H100Row {
            label: "(7) ZeRO++ grad quantize",
            kernel: "grad_quantize_first",
            file: "grad_quantize_first.cu",
            measured_us: 261.0,
            work: GradFirst {
                preset: Preset::Zeropp,
                bf16: false,
            },
        },
        H100Row {
            label: "(8a) Global-QSGD absmax",
            kernel: "global_absmax",
            file: "global_qsgd.cu",
            measured_us: 100.4,
            work: GlobalAbsmax,
        },
        H100Row {
            label: "(8b) Global-QSGD quantize",
            kernel: "global_quantize_i8",
            file: "global_qsgd.cu",
            measured_us: 120.9,
            work: GlobalQuantize,
        },
        H100Row {
            label: "(8c) Global-QSGD dequantize",
            kernel: "global_dequantize_i8",
            file: "global_qsgd.cu",
            measured_us: 34.2,
            work: GlobalDequantize,
        },
    ]
};

/// A row at the benchmark's size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BenchCall {
    /// Bytes read plus bytes written.
    pub bytes: f64,
    /// Work units.
    pub units: f64,
    /// Warps of the launch.
    pub warps: f64,
    /// Elements of one unit (of the bucket, shard or slab the row walks).
    pub unit_elements: f64,
}

/// A counting case: one launch over `units` units, and the bytes its outputs must end as.
pub struct CountingCase {
    pub case: EmulatorCase,
    pub units: u64,
    /// The configuration as a specialised kernel's compile-time constants (derived from the
    /// launch's parameter struct, as production derives them).
    pub constants: Constants,
    /// The CPU backend's bytes of every output buffer, in buffer order.
    pub expected: Vec<Vec<u8>>,
    /// The kernel's configuration as constants, for a build specialised to it (grouped
    /// kernels only).
    pub specialisation: Option<Specialisation>,
}

/// What a wrapper that specialises a grouped kernel to a case's configuration needs.
pub struct Specialisation {
    /// The C statements that set the configuration fields of the parameter struct `a` to the
    /// case's values.
    pub constants: String,
    /// The kernel's pointer parameters as declared, and its parameter struct.
    pub pointers: &'static str,
    pub params: &'static str,
    /// The blocks per multiprocessor of the kernel's `__launch_bounds__`.
    pub min_blocks: u32,
}

/// The statements that set the quantizer `q` of `a` (`field` names it) to `quant`.
fn quant_constants(field: &str, quant: &SdpQuant) -> String {
    format!(
        "a.{field}.bits = {}; a.{field}.group_size = {}; a.{field}.symmetric = {}; \
         a.{field}.stochastic = {};",
        quant.bits, quant.group_size, quant.symmetric, quant.stochastic
    )
}

/// The preset with one pipeline chunk, as the benchmark's kernel rows run it.
fn one_chunk(preset: Preset) -> Config {
    Config::from_overrides(preset, [("pipeline_chunks", "1")]).expect("one chunk is valid")
}

/// The gradient layout of `config` on 2 nodes x 2 ranks for `numel` gradients.
fn grad_layout(config: &Config, numel: usize) -> Result<GradLayout, String> {
    let topology = Topology::uniform(2, 2).map_err(|e| e.to_string())?;
    let route = GradRoute::new(config, &topology);
    let plan = BucketPlan::new(numel, topology.world(), config).map_err(|e| e.to_string())?;
    GradLayout::new(config, &topology, &route, plan).ok_or_else(|| "W = 4 has an exchange".into())
}

/// The weight slab layout and plan of `config` for `numel` bf16 parameters.
fn weight_layout(config: &Config, numel: usize) -> Result<(SlabLayout, BucketPlan), String> {
    let plan = BucketPlan::new(numel, WORLD, config).map_err(|e| e.to_string())?;
    let spec = QuantSpec::of_weights(&config.weight).ok_or("the weight codec quantizes")?;
    let layout = SlabLayout {
        spec,
        groups: plan.padded_shard_len / spec.group_size,
    };
    Ok((layout, plan))
}

/// Bytes of the first-level send buffer (all chunks).
fn first_send_len(layout: &GradLayout) -> usize {
    layout.bucket.chunks * layout.first.peers * layout.first.slab.byte_len()
}

/// Bytes the last level receives: its slabs (the first level's for one level).
fn last_recv_len(layout: &GradLayout) -> usize {
    let last = layout.last();
    last.peers * last.slab.byte_len()
}

/// The kernels' destination table: entry `x1 * peers2 + x2` is the rank at (x1, x2).
fn dest_table(layout: &GradLayout) -> Vec<u32> {
    let peers2 = layout.second_peers();
    (0..layout.first.peers * peers2)
        .map(|i| layout.dest(i / peers2, i % peers2) as u32)
        .collect()
}

/// `groups` groups in units of `per_unit` groups, or 0 unless every unit is whole: counting
/// cases take whole units only (as nearly all are at the benchmark's size).
fn whole_units(groups: u64, per_unit: u64) -> u64 {
    if groups.is_multiple_of(per_unit) {
        groups / per_unit
    } else {
        0
    }
}

/// Units of `grad_quantize_first`: per chunk and destination, the chunk's groups in units of
/// `per_unit`.
fn grad_first_units(layout: &GradLayout, per_unit: u64) -> u64 {
    (layout.bucket.chunks * layout.first.peers * layout.second_peers()) as u64
        * (layout.groups_per_chunk() as u64).div_ceil(per_unit)
}

fn whole_grad_first_units(layout: &GradLayout, per_unit: u64) -> u64 {
    let per_dest = whole_units(layout.groups_per_chunk() as u64, per_unit);
    (layout.bucket.chunks * layout.first.peers * layout.second_peers()) as u64 * per_dest
}

/// Units of `grad_requantize_second`: per second-level peer, the chunk's output groups in
/// units of `per_unit` (c4b4d29: the second level's slab groups, one per unit, the same).
fn grad_second_units(layout: &GradLayout, per_unit: u64) -> u64 {
    let second = layout.second.expect("two levels");
    second.peers as u64 * (layout.groups_per_chunk() as u64).div_ceil(per_unit)
}

fn whole_grad_second_units(layout: &GradLayout, per_unit: u64) -> u64 {
    let second = layout.second.expect("two levels");
    second.peers as u64 * whole_units(layout.groups_per_chunk() as u64, per_unit)
}

fn grad_final_units(layout: &GradLayout, per_unit: u64) -> u64 {
    (layout.last().slab.groups as u64).div_ceil(per_unit)
}

fn whole_grad_final_units(layout: &GradLayout, per_unit: u64) -> u64 {
    whole_units(layout.last().slab.groups as u64, per_unit)
}

/// Units of `weight_apply`: per shard, its real groups in units of `per_unit`.
fn weight_apply_units(layout: &SlabLayout, plan: &BucketPlan, per_unit: u64) -> u64 {
    plan.world as u64 * (plan.shard_len.div_ceil(layout.spec.group_size) as u64).div_ceil(per_unit)
}

fn whole_weight_apply_units(layout: &SlabLayout, plan: &BucketPlan, per_unit: u64) -> u64 {
    let real = plan.shard_len.div_ceil(layout.spec.group_size) as u64;
    plan.world as u64 * whole_units(real, per_unit)
}

/// The smallest size `numel(k)` (k = 1, 2, ...) whose units (`units_of`, 0 for sizes with a
/// unit that is not whole) are at least [`CASE_UNITS`] and a multiple of `per_block`, the warps
/// of a block, and whose plan (`plan_of`) pads no shard, as the benchmark's does not.
fn case_size<T>(
    per_block: u64,
    numel: impl Fn(usize) -> usize,
    layout_of: impl Fn(usize) -> Result<T, String>,
    plan_of: impl Fn(&T) -> &BucketPlan,
    units_of: impl Fn(&T) -> u64,
) -> Result<(usize, T), String> {
    for k in 1..4096 {
        let n = numel(k);
        let layout = layout_of(n)?;
        let units = units_of(&layout);
        let plan = plan_of(&layout);
        if units >= CASE_UNITS
            && units.is_multiple_of(per_block)
            && plan.padded_shard_len == plan.shard_len
        {
            return Ok((n, layout));
        }
    }
    Err(format!(
        "no small case size has whole units, a multiple of {per_block} of them and no padding"
    ))
}

/// `values` as gradient elements of type `G`, as bytes.
fn grad_bytes<G: GradElement>(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| bytemuck::bytes_of(&G::from_f32(v)).to_vec())
        .collect()
}

fn bf16_bits(values: &[bf16]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

/// One launch of blocks of `shape` on the case's buffers (its grid is set by the counting;
/// the kernel's name too, for a specialised build).
fn launch<T: bytemuck::Pod>(
    kernel: &str,
    shape: &Shape,
    pointers: &[CaseBuffer],
    params: &T,
) -> CaseLaunch {
    CaseLaunch {
        kernel: kernel.to_owned(),
        grid: 1,
        threads: shape.threads as u32,
        order: WarpOrder::Forward,
        pointers: pointers.iter().copied().map(Some).collect(),
        params: bytemuck::bytes_of(params).to_vec(),
        addresses: Vec::new(),
    }
}

impl H100Row {
    /// The shape c4b4d29 launched the row with: blocks of 256 threads, at most 32 per
    /// multiprocessor; units of 3 groups (`grad_quantize_first`), of one group (the other
    /// grouped kernels) or of a warp's 128 elements (Global-QSGD).
    pub fn h100_shape(&self) -> Shape {
        Shape {
            groups: match self.work {
                Work::GradFirst { .. } => FIRST_GROUPS_PER_UNIT,
                _ => 1,
            },
            runs: 1,
            threads: H100_THREADS,
            grid_cap: GRID_CAP,
            format: CaseFormat::V2,
        }
    }

    /// The compile-time constants of the row's launch at the benchmark's size, from its
    /// parameter struct as production derives them (`backend::cuda::spec::Constants`).
    pub fn bench_constants(&self) -> Result<Constants, String> {
        let grads = BUCKET_BYTES / 4;
        let rng = UniformStream::new(0, 0, 0);
        let e = |e: sdp4bit::Error| e.to_string();
        let weights = || weight_layout(&one_chunk(Preset::Sdp4bit), BUCKET_BYTES / 2);
        let difference = WeightEncoding::Difference;
        match self.work {
            Work::GradFirst { preset, .. } => {
                let layout = grad_layout(&one_chunk(preset), grads)?;
                Constants::first(&SdpGradFirst::new(&layout, &rng).map_err(e)?)
            }
            Work::GradSecond => {
                let layout = grad_layout(&one_chunk(Preset::Sdp4bit), grads)?;
                Constants::second(&SdpGradSecond::new(&layout, 0, 0, &rng).map_err(e)?)
            }
            Work::GradFinal { preset, .. } => {
                let layout = grad_layout(&one_chunk(preset), grads)?;
                Constants::last(&SdpGradFinal::new(&layout, 0).map_err(e)?)
            }
            Work::WeightEncode => {
                let (layout, plan) = weights()?;
                let p = SdpWeightEncode::new(&layout, difference, plan.shard_len, 0, &rng);
                Constants::encode(&p.map_err(e)?)
            }
            Work::WeightApply => {
                let (layout, plan) = weights()?;
                Constants::apply(&SdpWeightApply::new(&layout, difference, &plan, 0).map_err(e)?)
            }
            Work::GlobalAbsmax => Constants::global(&SdpGlobal::absmax(grads)),
            Work::GlobalQuantize => {
                let k = global_k(8, WORLD);
                let p = SdpGlobal::quantize(grads, 1.0, k, Rounding::Stochastic, &rng);
                Constants::global(&p)
            }
            Work::GlobalDequantize => Constants::global(&SdpGlobal::dequantize(grads / WORLD, 1.0)),
        }
        .map_err(|e| e.to_string())
    }

    /// The row at the benchmark's size, cut and launched as `shape` says.
    pub fn bench_call(&self, shape: &Shape) -> Result<BenchCall, String> {
        let grads = BUCKET_BYTES / 4;
        let grad_size = |bf16: bool| if bf16 { 2 } else { 4 };
        let n = shape.groups;
        let call = |bytes: usize, units: u64, group: usize| BenchCall {
            bytes: bytes as f64,
            units: units as f64,
            warps: shape.launched_warps(units, shape.warps_per_block()),
            unit_elements: (n * group as u64) as f64,
        };
        Ok(match self.work {
            Work::GradFirst { preset, bf16 } => {
                let layout = grad_layout(&one_chunk(preset), grads)?;
                let g = layout.first.slab.spec.group_size;
                let bytes = layout.bucket.numel * grad_size(bf16) + first_send_len(&layout);
                call(bytes, grad_first_units(&layout, n), g)
            }
            Work::GradSecond => {
                let layout = grad_layout(&one_chunk(Preset::Sdp4bit), grads)?;
                let second = layout.second.ok_or("two levels")?;
                let bytes = first_send_len(&layout) + second.peers * second.slab.byte_len();
                let g = second.slab.spec.group_size;
                call(bytes, grad_second_units(&layout, n), g)
            }
            Work::GradFinal { preset, bf16 } => {
                let layout = grad_layout(&one_chunk(preset), grads)?;
                let bytes = last_recv_len(&layout) + layout.bucket.shard_len * grad_size(bf16);
                let g = layout.last().slab.spec.group_size;
                call(bytes, grad_final_units(&layout, n), g)
            }
            Work::WeightEncode => {
                let (layout, plan) = weight_layout(&one_chunk(Preset::Sdp4bit), BUCKET_BYTES / 2)?;
                let bytes = 4 * plan.shard_len + layout.byte_len();
                let g = layout.spec.group_size;
                call(bytes, (layout.groups as u64).div_ceil(n), g)
            }
            Work::WeightApply => {
                let (layout, plan) = weight_layout(&one_chunk(Preset::Sdp4bit), BUCKET_BYTES / 2)?;
                let bytes = WORLD * layout.byte_len() + 4 * plan.numel;
                let units = weight_apply_units(&layout, &plan, n);
                call(bytes, units, layout.spec.group_size)
            }
            Work::GlobalAbsmax | Work::GlobalQuantize | Work::GlobalDequantize => {
                let (numel, bytes) = match self.work {
                    Work::GlobalAbsmax => (grads, 4 * grads),
                    Work::GlobalQuantize => (grads, 5 * grads),
                    _ => (grads / WORLD, 5 * grads / WORLD),
                };
                // A thread's step takes its runs of 4; a warp's step is the unit.
                let unit = 32 * RUN * shape.runs;
                let threads = (numel as u64).div_ceil(RUN).div_ceil(shape.runs);
                BenchCall {
                    bytes: bytes as f64,
                    units: (numel as u64).div_ceil(unit) as f64,
                    warps: shape.launched_warps(threads, shape.threads),
                    unit_elements: unit as f64,
                }
            }
        })
    }

    /// A small case of the row's configuration with the benchmark's data generators, its
    /// units whole units of `shape` and a multiple of its blocks' warps.
    pub fn counting_case(&self, shape: &Shape) -> Result<CountingCase, String> {
        let kernel = self.kernel;
        let mut counting = match self.work {
            Work::GradFirst {
                preset,
                bf16: false,
            } => grad_first_case::<f32>(kernel, shape, preset),
            Work::GradFirst { preset, bf16: true } => {
                grad_first_case::<bf16>(kernel, shape, preset)
            }
            Work::GradSecond => grad_second_case(kernel, shape),
            Work::GradFinal {
                preset,
                bf16: false,
            } => grad_final_case::<f32>(kernel, shape, preset),
            Work::GradFinal { preset, bf16: true } => {
                grad_final_case::<bf16>(kernel, shape, preset)
            }
            Work::WeightEncode => weight_encode_case(kernel, shape),
            Work::WeightApply => weight_apply_case(kernel, shape),
            Work::GlobalAbsmax | Work::GlobalQuantize | Work::GlobalDequantize => {
                global_case(kernel, shape, self.work)
            }
        }?;
        counting.case.format = shape.format;
        Ok(counting)
    }
}

/// Gradient bucket sizes of the counting cases: multiples of the world's 128-element groups.
fn grad_numel(k: usize) -> usize {
    k * WORLD * 1024
}

/// The first-level send buffer the CPU writes for `layout` (seed as `bench/gpu.rs`).
fn cpu_first_send(layout: &GradLayout, seed: u64) -> Vec<u8> {
    let bucket = gradients(layout.bucket.numel, seed);
    let mut send = vec![0u8; first_send_len(layout)];
    gradient::quantize_first(layout, &bucket, &UniformStream::new(1, 1, 2), &mut send);
    send
}

fn grad_first_case<G: GradElement + bytemuck::Pod>(
    kernel: &str,
    shape: &Shape,
    preset: Preset,
) -> Result<CountingCase, String> {
    let config = one_chunk(preset);
    let (numel, layout) = case_size(
        shape.warps_per_block(),
        grad_numel,
        |n| grad_layout(&config, n),
        |l| &l.bucket,
        |l| whole_grad_first_units(l, shape.groups),
    )?;
    let values: Vec<G> = gradients(numel, 10)
        .iter()
        .map(|&v| G::from_f32(v))
        .collect();
    let rng = UniformStream::new(1, 1, 1);
    let mut expected = vec![0u8; first_send_len(&layout)];
    gradient::quantize_first(&layout, &values, &rng, &mut expected);
    let mut case = EmulatorCase::default();
    let bucket = case.input(bytemuck::cast_slice(&values).to_vec());
    let dests = case.input(bytemuck::cast_slice(&dest_table(&layout)).to_vec());
    let out = case.output(vec![0u8; expected.len()]);
    let params = SdpGradFirst::new(&layout, &rng).map_err(|e| e.to_string())?;
    case.launches
        .push(launch(kernel, shape, &[bucket, dests, out], &params));
    let constants = format!(
        "{} a.peers1 = {}; a.peers2 = {}; a.hadamard_block = {};",
        quant_constants("slab.quant", &params.slab.quant),
        params.peers1,
        params.peers2,
        params.hadamard_block
    );
    Ok(CountingCase {
        case,
        units: grad_first_units(&layout, shape.groups),
        constants: Constants::first(&params).map_err(|e| e.to_string())?,
        expected: vec![expected],
        specialisation: Some(Specialisation {
            constants,
            pointers: if size_of::<G>() == 2 {
                "const sdp_bf16* __restrict__ p0, const uint32_t* __restrict__ p1, uint8_t* __restrict__ p2"
            } else {
                "const float* __restrict__ p0, const uint32_t* __restrict__ p1, uint8_t* __restrict__ p2"
            },
            params: "sdp_grad_first",
            min_blocks: 3,
        }),
    })
}

fn grad_second_case(kernel: &str, shape: &Shape) -> Result<CountingCase, String> {
    let config = one_chunk(Preset::Sdp4bit);
    let (_, layout) = case_size(
        shape.warps_per_block(),
        grad_numel,
        |n| grad_layout(&config, n),
        |l| &l.bucket,
        |l| whole_grad_second_units(l, shape.groups),
    )?;
    let second = layout.second.ok_or("two levels")?;
    let recv = cpu_first_send(&layout, 20);
    let rng = UniformStream::new(1, 1, 4);
    let mut expected = vec![0u8; second.peers * second.slab.byte_len()];
    gradient::requantize_second(&layout, 0, 0, &recv, &rng, &mut expected)
        .map_err(|e| e.to_string())?;
    let mut case = EmulatorCase::default();
    let recv = case.input(recv);
    let dests = case.input(bytemuck::cast_slice(&dest_table(&layout)).to_vec());
    let out = case.output(vec![0u8; expected.len()]);
    let params = SdpGradSecond::new(&layout, 0, 0, &rng).map_err(|e| e.to_string())?;
    case.launches
        .push(launch(kernel, shape, &[recv, dests, out], &params));
    let constants = format!(
        "{} {} a.peers1 = {}; a.peers2 = {};",
        quant_constants("in_slab.quant", &params.in_slab.quant),
        quant_constants("out_slab.quant", &params.out_slab.quant),
        params.peers1,
        params.peers2
    );
    Ok(CountingCase {
        case,
        units: grad_second_units(&layout, shape.groups),
        constants: Constants::second(&params).map_err(|e| e.to_string())?,
        expected: vec![expected],
        specialisation: Some(Specialisation {
            constants,
            pointers: "const uint8_t* __restrict__ p0, const uint32_t* __restrict__ p1, uint8_t* __restrict__ p2",
            params: "sdp_grad_second",
            min_blocks: 4,
        }),
    })
}

fn grad_final_case<G: GradElement + bytemuck::Pod>(
    kernel: &str,
    shape: &Shape,
    preset: Preset,
) -> Result<CountingCase, String> {
    let config = one_chunk(preset);
    let (_, layout) = case_size(
        shape.warps_per_block(),
        grad_numel,
        |n| grad_layout(&config, n),
        |l| &l.bucket,
        |l| whole_grad_final_units(l, shape.groups),
    )?;
    // The slabs rank 0 receives at the last level (seed as `bench/gpu.rs`).
    let first = cpu_first_send(&layout, 30);
    let recv = match layout.second {
        None => first,
        Some(second) => {
            let mut out = vec![0u8; second.peers * second.slab.byte_len()];
            let rng = UniformStream::new(1, 1, 3);
            gradient::requantize_second(&layout, 0, 0, &first, &rng, &mut out)
                .map_err(|e| e.to_string())?;
            out
        }
    };
    let mut shard = vec![G::from_f32(0.0); layout.bucket.shard_len];
    gradient::reduce_final(&layout, 0, &recv, &mut shard).map_err(|e| e.to_string())?;
    let mut case = EmulatorCase::default();
    let recv = case.input(recv);
    let out = case.output(vec![0u8; shard.len() * size_of::<G>()]);
    let params = SdpGradFinal::new(&layout, 0).map_err(|e| e.to_string())?;
    case.launches
        .push(launch(kernel, shape, &[recv, out], &params));
    let constants = format!(
        "{} a.peers = {}; a.hadamard_block = {};",
        quant_constants("slab.quant", &params.slab.quant),
        params.peers,
        params.hadamard_block
    );
    Ok(CountingCase {
        case,
        units: grad_final_units(&layout, shape.groups),
        constants: Constants::last(&params).map_err(|e| e.to_string())?,
        expected: vec![bytemuck::cast_slice(&shard).to_vec()],
        specialisation: Some(Specialisation {
            constants,
            pointers: if size_of::<G>() == 2 {
                "const uint8_t* __restrict__ p0, sdp_bf16* __restrict__ p1"
            } else {
                "const uint8_t* __restrict__ p0, float* __restrict__ p1"
            },
            params: "sdp_grad_final",
            min_blocks: 4,
        }),
    })
}

/// Parameter bucket sizes of the weight cases: multiples of the world's 2048-element groups.
fn weight_numel(k: usize) -> usize {
    k * WORLD * 2048
}

fn weight_encode_case(kernel: &str, shape: &Shape) -> Result<CountingCase, String> {
    let config = one_chunk(Preset::Sdp4bit);
    let (_, (layout, plan)) = case_size(
        shape.warps_per_block(),
        weight_numel,
        |n| weight_layout(&config, n),
        |(_, plan)| plan,
        |(layout, _)| whole_units(layout.groups as u64, shape.groups),
    )?;
    let s = plan.shard_len;
    let reference = params(s, 40);
    let new = updated(&reference, 50);
    let (rng, first_index) = (UniformStream::new(1, 1, 5), plan.padded_index(0, 0));
    let encoding = WeightEncoding::Difference;
    let mut expected = vec![0u8; layout.byte_len()];
    weight::encode_shard(
        layout,
        encoding,
        first_index,
        &new,
        &reference,
        &rng,
        &mut expected,
    );
    let mut case = EmulatorCase::default();
    let new = case.input(bf16_bits(&new));
    let reference = case.input(bf16_bits(&reference));
    let out = case.output(vec![0u8; expected.len()]);
    let params =
        SdpWeightEncode::new(&layout, encoding, s, first_index, &rng).map_err(|e| e.to_string())?;
    case.launches
        .push(launch(kernel, shape, &[new, reference, out], &params));
    let constants = format!(
        "{} a.difference = {};",
        quant_constants("slab.quant", &params.slab.quant),
        params.difference
    );
    Ok(CountingCase {
        case,
        units: (layout.groups as u64).div_ceil(shape.groups),
        constants: Constants::encode(&params).map_err(|e| e.to_string())?,
        expected: vec![expected],
        specialisation: Some(Specialisation {
            constants,
            pointers: "const uint16_t* __restrict__ p0, const uint16_t* __restrict__ p1, uint8_t* __restrict__ p2",
            params: "sdp_weight_encode",
            min_blocks: 4,
        }),
    })
}

fn weight_apply_case(kernel: &str, shape: &Shape) -> Result<CountingCase, String> {
    let config = one_chunk(Preset::Sdp4bit);
    let (_, (layout, plan)) = case_size(
        shape.warps_per_block(),
        weight_numel,
        |n| weight_layout(&config, n),
        |(_, plan)| plan,
        |(layout, plan)| whole_weight_apply_units(layout, plan, shape.groups),
    )?;
    let (numel, s) = (plan.numel, plan.shard_len);
    let old = params(numel, 60);
    // One real encoding (shard 0's update) received from every rank, as `bench/gpu.rs` does.
    let mut slab = vec![0u8; layout.byte_len()];
    let (new, encoding) = (updated(&old[..s], 70), WeightEncoding::Difference);
    let rng = UniformStream::new(1, 1, 6);
    weight::encode_shard(layout, encoding, 0, &new, &old[..s], &rng, &mut slab);
    let recv = slab.repeat(WORLD);
    let mut applied = old.clone();
    weight::apply_shards(layout, encoding, &plan, 0, &recv, &old[..s], &mut applied)
        .map_err(|e| e.to_string())?;
    let mut case = EmulatorCase::default();
    let recv = case.input(recv);
    let own = case.input(bf16_bits(&old[..s]));
    let bucket = case.output(bf16_bits(&old));
    let params = SdpWeightApply::new(&layout, encoding, &plan, 0).map_err(|e| e.to_string())?;
    case.launches
        .push(launch(kernel, shape, &[recv, own, bucket], &params));
    let constants = format!(
        "{} a.difference = {};",
        quant_constants("slab.quant", &params.slab.quant),
        params.difference
    );
    Ok(CountingCase {
        case,
        units: weight_apply_units(&layout, &plan, shape.groups),
        constants: Constants::apply(&params).map_err(|e| e.to_string())?,
        expected: vec![bf16_bits(&applied)],
        specialisation: Some(Specialisation {
            constants,
            pointers: "const uint8_t* __restrict__ p0, const uint16_t* __restrict__ p1, uint16_t* p2",
            params: "sdp_weight_apply",
            min_blocks: 4,
        }),
    })
}

fn global_case(kernel: &str, shape: &Shape, work: Work) -> Result<CountingCase, String> {
    let units = 4 * CASE_UNITS;
    let numel = (units * 32 * RUN * shape.runs) as usize;
    let mut case = EmulatorCase::default();
    let global = |p: &SdpGlobal| Constants::global(p).map_err(|e| e.to_string());
    let (expected, constants) = match work {
        Work::GlobalAbsmax => {
            let bucket = gradients(numel, 80);
            let absmax = global_qsgd::local_absmax(&bucket);
            let input = case.input(grad_bytes::<f32>(&bucket));
            let word = case.output(vec![0u8; 4]);
            let params = SdpGlobal::absmax(numel);
            case.launches
                .push(launch(kernel, shape, &[input, word], &params));
            (absmax.to_bits().to_le_bytes().to_vec(), global(&params)?)
        }
        Work::GlobalQuantize => {
            let bucket = gradients(numel, 80);
            let k = global_k(8, WORLD);
            let scale = global_qsgd::local_absmax(&bucket) / k as f32;
            let rng = UniformStream::new(1, 1, 7);
            let mut codes = vec![0i8; numel];
            global_qsgd::quantize(&bucket, scale, k, Rounding::Stochastic, &rng, &mut codes);
            let input = case.input(grad_bytes::<f32>(&bucket));
            let out = case.output(vec![0u8; numel]);
            let params = SdpGlobal::quantize(numel, scale, k, Rounding::Stochastic, &rng);
            case.launches
                .push(launch(kernel, shape, &[input, out], &params));
            (bytemuck::cast_slice(&codes).to_vec(), global(&params)?)
        }
        _ => {
            // Summed int8 codes as `bench/gpu.rs` makes them.
            let top = global_k(8, WORLD) * WORLD as i32;
            let sums: Vec<i8> = gradients(numel, 90)
                .iter()
                .map(|&g| (g * 1e3 * top as f32).clamp(-(top as f32), top as f32) as i8)
                .collect();
            let mut values = vec![0f32; numel];
            global_qsgd::dequantize(&sums, 1e-5, &mut values);
            let input = case.input(bytemuck::cast_slice(&sums).to_vec());
            let out = case.output(vec![0u8; 4 * numel]);
            let params = SdpGlobal::dequantize(numel, 1e-5);
            case.launches
                .push(launch(kernel, shape, &[input, out], &params));
            (bytemuck::cast_slice(&values).to_vec(), global(&params)?)
        }
    };
    Ok(CountingCase {
        case,
        units,
        constants,
        expected: vec![expected],
        specialisation: None,
    })
}
