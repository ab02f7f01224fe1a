//! Static performance model of the CUDA kernels for an H100 SXM, without a GPU: the table of
//! `bench/results/kernels.md`.
//!
//! Run with `bash scripts/bench.sh kernels [--out FILE]` (it installs NVRTC, ptxas and
//! nvdisasm into `.cache/`, `scripts/env.sh`). Nothing runs on a GPU: every figure comes from
//! the compiled code.
//!
//! Per kernel, from the production build (NVRTC 13.0 with the backend's options, `ptxas -v`
//! for sm_90, `nvdisasm`): registers, spills, occupancy, static shuffle and vote counts and the
//! widest global load and store. Then, for one representative configuration per kernel, the
//! kernel's source is compiled again as a device function called by a wrapper kernel that
//! passes the configuration as constants, so the compiler folds every configuration branch
//! and unrolls the loops over tiles and peers; the instructions of the wrapper's grid-stride
//! loop body (one work unit: one group, or one run of 4 elements per lane) are counted in its
//! SASS. That count includes the cold paths (unaligned fallbacks, the division slow-path
//! calls), so it bounds the instructions a warp issues per unit from above.
//!
//! The model (stated in the output): a kernel reaches the smaller of HBM bandwidth, its
//! instruction-issue bound (4 warp instructions per clock per multiprocessor, 132
//! multiprocessors at 1.98 GHz, every instruction of the loop body issued once per unit) and
//! its latency bound (the bytes its resident warps have in flight, one unit's loads per warp,
//! against HBM bandwidth times a 700 ns loaded latency).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use sdp4bit::backend::cuda::compile::{Arch, compile};
use sdp4bit::backend::cuda::probe;
use sdp4bit::backend::cuda::source::{KernelSource, SOURCES};
use sdp4bit_test_support::kernel_resources::{CudaTools, KernelResources, count_sass};

/// H100 SXM HBM3 bandwidth, bytes per second.
const HBM_BYTES_PER_S: f64 = 3.35e12;
/// Multiprocessors of an H100 SXM.
const MULTIPROCESSORS: f64 = 132.0;
/// Its boost clock, Hz.
const CLOCK_HZ: f64 = 1.98e9;
/// Warp instructions one multiprocessor issues per clock (4 schedulers).
const ISSUE_PER_CLOCK: f64 = 4.0;
/// Loaded HBM latency assumed by the latency bound, seconds.
const LATENCY_S: f64 = 700e-9;
/// Resident warps of one multiprocessor at full occupancy.
const MAX_WARPS: f64 = 64.0;

/// One kernel's representative configuration for the instruction count.
struct Model {
    /// The entry point.
    kernel: &'static str,
    /// The configuration, in words.
    config: &'static str,
    /// The C statements that set the fields of `a`, the kernel's parameter struct, that select
    /// code paths (bits, group size, codec, rounding, Hadamard block, the peers summed); the others stay
    /// launch-time values as in production.
    params: &'static str,
    /// The pointer parameters of the kernel, as declared.
    pointers: &'static str,
    /// The pointer arguments passed on.
    arguments: &'static str,
    /// The parameter struct's type.
    struct_name: &'static str,
    /// The `__launch_bounds__` of the production kernel.
    min_blocks: u32,
    /// Elements one warp handles per iteration of the grid-stride loop.
    elements_per_unit: f64,
    /// Bytes read and written per element (inputs + outputs, metadata included).
    bytes_per_element: f64,
    /// Bytes one warp loads per unit.
    loaded_per_unit: f64,
    /// Bytes one warp has in flight: what it loads per unit, or per group for a unit of
    /// several groups handled one after another.
    in_flight_per_warp: f64,
}

/// The configurations: the presets' defaults, a node of 8 GPUs (8 first-level peers) and 4
/// nodes (4 last-level peers); weight groups of 256 (one tile; the default 2048 reads each
/// tile twice, once for the statistics, from cache).
const MODELS: [Model; 20] = [
    Model {
        kernel: "grad_quantize_first",
        config: "TLq-HS first level: 8-bit, g = 128, Hadamard 32, stochastic, 3 groups per unit",
        params: "a.slab.quant.bits = 8; a.slab.quant.group_size = 128; a.slab.quant.symmetric = 1; a.slab.quant.stochastic = 1; a.peers1 = 8;  a.hadamard_block = 32;",
        pointers: "const float* __restrict__ p0, const uint32_t* __restrict__ p1, uint8_t* __restrict__ p2",
        arguments: "p0, p1, p2",
        struct_name: "sdp_grad_first",
        min_blocks: 3,
        elements_per_unit: 3.0 * 128.0,
        bytes_per_element: 4.0 + 1.0 + 4.0 / 128.0,
        loaded_per_unit: 3.0 * 128.0 * 4.0,
        in_flight_per_warp: 128.0 * 4.0,
    },
    Model {
        kernel: "grad_requantize_second",
        config: "TLq-HS: 8 peers of 8-bit in, 4-bit out, g = 128, stochastic",
        params: "a.in_slab.quant.bits = 8; a.in_slab.quant.group_size = 128; a.in_slab.quant.symmetric = 1; a.in_slab.quant.stochastic = 1; a.out_slab.quant.bits = 4; a.out_slab.quant.group_size = 128; a.out_slab.quant.symmetric = 1; a.out_slab.quant.stochastic = 1; a.peers1 = 8;",
        pointers: "const uint8_t* __restrict__ p0, const uint32_t* __restrict__ p1, uint8_t* __restrict__ p2",
        arguments: "p0, p1, p2",
        struct_name: "sdp_grad_second",
        min_blocks: 4,
        elements_per_unit: 128.0,
        bytes_per_element: 8.0 * (1.0 + 4.0 / 128.0) + 0.5 + 4.0 / 128.0,
        loaded_per_unit: 128.0 * 8.0,
        in_flight_per_warp: 128.0 * 8.0,
    },
    Model {
        kernel: "grad_reduce_final",
        config: "TLq-HS last level: 4 peers of 4-bit, g = 128, inverse Hadamard 32",
        params: "a.slab.quant.bits = 4; a.slab.quant.group_size = 128; a.slab.quant.symmetric = 1; a.slab.quant.stochastic = 1; a.peers = 4; a.hadamard_block = 32;",
        pointers: "const uint8_t* __restrict__ p0, float* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_grad_final",
        min_blocks: 4,
        elements_per_unit: 128.0,
        bytes_per_element: 4.0 * (0.5 + 4.0 / 128.0) + 4.0,
        loaded_per_unit: 128.0 * 4.0 * 0.5,
        in_flight_per_warp: 128.0 * 4.0 * 0.5,
    },
    Model {
        kernel: "weight_encode",
        config: "qWD: bf16 difference, 4-bit, g = 256, stochastic",
        params: "a.slab.quant.bits = 4; a.slab.quant.group_size = 256; a.slab.quant.symmetric = 1; a.slab.quant.stochastic = 1; a.difference = 1;",
        pointers: "const uint16_t* __restrict__ p0, const uint16_t* __restrict__ p1, uint8_t* __restrict__ p2",
        arguments: "p0, p1, p2",
        struct_name: "sdp_weight_encode",
        min_blocks: 4,
        elements_per_unit: 256.0,
        bytes_per_element: 2.0 + 2.0 + 0.5 + 4.0 / 256.0,
        loaded_per_unit: 256.0 * 4.0,
        in_flight_per_warp: 256.0 * 4.0,
    },
    Model {
        kernel: "weight_apply",
        config: "qWD: 4-bit difference onto bf16 params, g = 256",
        params: "a.slab.quant.bits = 4; a.slab.quant.group_size = 256; a.slab.quant.symmetric = 1; a.slab.quant.stochastic = 1; a.difference = 1;",
        pointers: "const uint8_t* __restrict__ p0, const uint16_t* __restrict__ p1, uint16_t* p2",
        arguments: "p0, p1, p2",
        struct_name: "sdp_weight_apply",
        min_blocks: 4,
        elements_per_unit: 256.0,
        bytes_per_element: 0.5 + 4.0 / 256.0 + 2.0 + 2.0,
        loaded_per_unit: 256.0 * 2.5,
        in_flight_per_warp: 256.0 * 2.5,
    },
    Model {
        kernel: "global_absmax",
        config: "fp32 bucket",
        params: "",
        pointers: "const float* __restrict__ p0, uint32_t* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 4.0,
        loaded_per_unit: 128.0 * 4.0,
        in_flight_per_warp: 128.0 * 4.0,
    },
    Model {
        kernel: "global_quantize_i8",
        config: "fp32 to int8, stochastic",
        params: "a.stochastic = 1;",
        pointers: "const float* __restrict__ p0, int8_t* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 4.0 + 1.0,
        loaded_per_unit: 128.0 * 4.0,
        in_flight_per_warp: 128.0 * 4.0,
    },
    Model {
        kernel: "global_quantize_i16",
        config: "fp32 to int16, stochastic",
        params: "a.stochastic = 1;",
        pointers: "const float* __restrict__ p0, int16_t* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 4.0 + 2.0,
        loaded_per_unit: 128.0 * 4.0,
        in_flight_per_warp: 128.0 * 4.0,
    },
    Model {
        kernel: "global_dequantize_i8",
        config: "8 peers of int8, summed with overflow checks, to fp32",
        params: "a.blocks = 8;",
        pointers: "const int8_t* __restrict__ p0, float* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 8.0 * 1.0 + 4.0,
        loaded_per_unit: 8.0 * 128.0,
        in_flight_per_warp: 8.0 * 128.0,
    },
    Model {
        kernel: "global_dequantize_i16",
        config: "8 peers of int16, summed with overflow checks, to fp32",
        params: "a.blocks = 8;",
        pointers: "const int16_t* __restrict__ p0, float* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 6,
        elements_per_unit: 128.0,
        bytes_per_element: 8.0 * 2.0 + 4.0,
        loaded_per_unit: 8.0 * 128.0 * 2.0,
        in_flight_per_warp: 8.0 * 128.0 * 2.0,
    },
    Model {
        kernel: "grad_quantize_first_bf16",
        config: "TLq-HS first level from a bf16 bucket: 8-bit, g = 128, Hadamard 32, stochastic, 3 groups per unit",
        params: "a.slab.quant.bits = 8; a.slab.quant.group_size = 128; a.slab.quant.symmetric = 1; a.slab.quant.stochastic = 1; a.peers1 = 8;  a.hadamard_block = 32;",
        pointers: "const sdp_bf16* __restrict__ p0, const uint32_t* __restrict__ p1, uint8_t* __restrict__ p2",
        arguments: "p0, p1, p2",
        struct_name: "sdp_grad_first",
        min_blocks: 3,
        elements_per_unit: 3.0 * 128.0,
        bytes_per_element: 2.0 + 1.0 + 4.0 / 128.0,
        loaded_per_unit: 3.0 * 128.0 * 2.0,
        in_flight_per_warp: 128.0 * 2.0,
    },
    Model {
        kernel: "grad_reduce_final_bf16",
        config: "TLq-HS last level into a bf16 shard: 4 peers of 4-bit, g = 128, inverse Hadamard 32",
        params: "a.slab.quant.bits = 4; a.slab.quant.group_size = 128; a.slab.quant.symmetric = 1; a.slab.quant.stochastic = 1; a.peers = 4; a.hadamard_block = 32;",
        pointers: "const uint8_t* __restrict__ p0, sdp_bf16* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_grad_final",
        min_blocks: 4,
        elements_per_unit: 128.0,
        bytes_per_element: 4.0 * (0.5 + 4.0 / 128.0) + 2.0,
        loaded_per_unit: 128.0 * 4.0 * 0.5,
        in_flight_per_warp: 128.0 * 4.0 * 0.5,
    },
    Model {
        kernel: "global_absmax_bf16",
        config: "bf16 bucket",
        params: "",
        pointers: "const sdp_bf16* __restrict__ p0, uint32_t* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 2.0,
        loaded_per_unit: 128.0 * 2.0,
        in_flight_per_warp: 128.0 * 2.0,
    },
    Model {
        kernel: "global_quantize_i8_bf16",
        config: "bf16 to int8, stochastic",
        params: "a.stochastic = 1;",
        pointers: "const sdp_bf16* __restrict__ p0, int8_t* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 2.0 + 1.0,
        loaded_per_unit: 128.0 * 2.0,
        in_flight_per_warp: 128.0 * 2.0,
    },
    Model {
        kernel: "global_quantize_i16_bf16",
        config: "bf16 to int16, stochastic",
        params: "a.stochastic = 1;",
        pointers: "const sdp_bf16* __restrict__ p0, int16_t* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 2.0 + 2.0,
        loaded_per_unit: 128.0 * 2.0,
        in_flight_per_warp: 128.0 * 2.0,
    },
    Model {
        kernel: "global_dequantize_i8_bf16",
        config: "8 peers of int8, summed with overflow checks, to bf16",
        params: "a.blocks = 8;",
        pointers: "const int8_t* __restrict__ p0, sdp_bf16* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 8.0 * 1.0 + 2.0,
        loaded_per_unit: 8.0 * 128.0,
        in_flight_per_warp: 8.0 * 128.0,
    },
    Model {
        kernel: "global_dequantize_i16_bf16",
        config: "8 peers of int16, summed with overflow checks, to bf16",
        params: "a.blocks = 8;",
        pointers: "const int16_t* __restrict__ p0, sdp_bf16* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_global",
        min_blocks: 6,
        elements_per_unit: 128.0,
        bytes_per_element: 8.0 * 2.0 + 2.0,
        loaded_per_unit: 8.0 * 128.0 * 2.0,
        in_flight_per_warp: 8.0 * 128.0 * 2.0,
    },
    Model {
        kernel: "grad_widen_bf16",
        config: "bf16 gradients to fp32 (uncompressed route)",
        params: "",
        pointers: "const sdp_bf16* __restrict__ p0, float* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_convert",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 2.0 + 4.0,
        loaded_per_unit: 128.0 * 2.0,
        in_flight_per_warp: 128.0 * 2.0,
    },
    Model {
        kernel: "grad_narrow_bf16",
        config: "fp32 gradients rounded to bf16 (uncompressed route)",
        params: "",
        pointers: "const float* __restrict__ p0, sdp_bf16* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_convert",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 4.0 + 2.0,
        loaded_per_unit: 128.0 * 4.0,
        in_flight_per_warp: 128.0 * 4.0,
    },
    Model {
        kernel: "grad_round_bf16",
        config: "bf16 through fp32 to bf16 (single-rank copy)",
        params: "",
        pointers: "const sdp_bf16* __restrict__ p0, sdp_bf16* __restrict__ p1",
        arguments: "p0, p1",
        struct_name: "sdp_convert",
        min_blocks: 8,
        elements_per_unit: 128.0,
        bytes_per_element: 2.0 + 2.0,
        loaded_per_unit: 128.0 * 2.0,
        in_flight_per_warp: 128.0 * 2.0,
    },
];

/// The source of `kernels/<file>` turned into device functions (its `__global__` and
/// `__launch_bounds__` removed), then a wrapper kernel `analysis` that calls `model.kernel`
/// with the model's constant parameters.
fn specialised_source(code: &str, model: &Model) -> String {
    format!(
        "#undef __global__\n#define __global__ __device__ __forceinline__\n\
         #undef __launch_bounds__\n#define __launch_bounds__(...)\n{code}\n\
         #undef __global__\n#undef __launch_bounds__\n\
         extern \"C\" __attribute__((global)) __attribute__((launch_bounds(256, {blocks}))) \
         void analysis({pointers}, {name} a)\n{{\n    {params}\n    {kernel}({arguments}, a);\n}}\n",
        blocks = model.min_blocks,
        pointers = model.pointers,
        name = model.struct_name,
        params = model.params,
        kernel = model.kernel,
        arguments = model.arguments,
    )
}

/// One instruction of a SASS listing: its opcode and, in a listing with line information
/// (`nvdisasm -gi`), the source lines it comes from (file base name and line), innermost first,
/// then each call site it is inlined at.
struct Instruction {
    opcode: String,
    frames: Vec<(String, u32)>,
}

/// The instructions of the grid-stride loop body of `function` in `nvdisasm -c` output: from
/// the target of the outermost backward branch before the first unconditional EXIT to that
/// branch. An error when the body still holds a loop (the count would not be per unit).
fn loop_body(listing: &str, function: &str) -> Result<Vec<Instruction>, String> {
    enum Item {
        Label(String),
        Instruction {
            instruction: Instruction,
            target: Option<String>,
            predicated: bool,
        },
    }
    let mut items = Vec::new();
    let mut inside = false;
    // The `//## File` comments since the last instruction: its frames, innermost first (an
    // instruction without them has the previous one's).
    let mut pending: Vec<(String, u32)> = Vec::new();
    let mut frames: Vec<(String, u32)> = Vec::new();
    for line in listing.lines() {
        let trimmed = line.trim();
        if let Some(section) = trimmed.strip_prefix(".text.") {
            inside = section.strip_suffix(':') == Some(function);
            continue;
        }
        if !inside {
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix("//## File \"") {
            pending.extend(source_location(rest));
            continue;
        }
        if let Some(label) = trimmed.strip_suffix(':').filter(|l| l.starts_with(".L")) {
            items.push(Item::Label(label.to_owned()));
            continue;
        }
        let Some((_, instruction)) = trimmed.strip_prefix("/*").and_then(|r| r.split_once("*/"))
        else {
            continue;
        };
        let mut words = instruction.split_whitespace().peekable();
        let predicated = words.peek().is_some_and(|w| w.starts_with('@'));
        if predicated {
            words.next();
        }
        let opcode = words.next().unwrap_or_default().to_owned();
        if opcode.is_empty() || opcode == "NOP" {
            continue;
        }
        if !pending.is_empty() {
            frames = std::mem::take(&mut pending);
        }
        let target = instruction
            .split("`(")
            .nth(1)
            .and_then(|t| t.split(')').next())
            .map(str::to_owned);
        items.push(Item::Instruction {
            instruction: Instruction {
                opcode,
                frames: frames.clone(),
            },
            target,
            predicated,
        });
    }
    let exit = items
        .iter()
        .position(|i| matches!(i, Item::Instruction { instruction, predicated: false, .. } if instruction.opcode == "EXIT"))
        .ok_or_else(|| format!("{function}: no unconditional EXIT"))?;
    let label_at = |name: &str| {
        items
            .iter()
            .position(|i| matches!(i, Item::Label(l) if l == name))
    };
    // Backward branches before the exit: (branch index, target index).
    let backward: Vec<(usize, usize)> = items[..exit]
        .iter()
        .enumerate()
        .filter_map(|(at, item)| match item {
            Item::Instruction {
                instruction,
                target: Some(t),
                ..
            } if instruction.opcode.starts_with("BRA") => {
                label_at(t).filter(|&l| l < at).map(|l| (at, l))
            }
            _ => None,
        })
        .collect();
    let &(branch, head) = backward
        .iter()
        .min_by_key(|&&(_, head)| head)
        .ok_or_else(|| format!("{function}: no grid-stride loop"))?;
    if backward
        .iter()
        .any(|&(at, _)| at != branch && at > head && at < branch)
    {
        return Err(format!("{function}: the loop body holds an inner loop"));
    }
    Ok(items
        .drain(head..=branch)
        .filter_map(|item| match item {
            Item::Instruction { instruction, .. } => Some(instruction),
            Item::Label(_) => None,
        })
        .collect())
}

/// The base name and line of `path", line N...` (the rest of a `//## File "` comment).
fn source_location(rest: &str) -> Option<(String, u32)> {
    let (path, after) = rest.split_once('"')?;
    let line = after
        .trim_start_matches(", line ")
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    let base = path.rsplit('/').next().unwrap_or(path);
    Some((base.to_owned(), line))
}

/// Where the instructions of a work unit go: the categories of the breakdown, each with the
/// functions of `kernels/` whose instructions it counts (by the innermost source line of each
/// instruction). The kernel's own function (unit index, addresses, its load and store code,
/// the loop) and anything unlisted fall into the last two rows.
const CATEGORIES: [(&str, &[&str]); 12] = [
    (
        "Philox rounds",
        &["sdp_philox", "sdp_words4", "sdp_uniforms4", "global_words"],
    ),
    (
        "uniform add, rounding, clamp",
        &[
            "sdp_add_uniform",
            "sdp_word_to_uniform",
            "sdp_code_of",
            "sdp_round_clamp",
            "global_code",
        ],
    ),
    (
        "division by the scale (fast path, fallback calls)",
        &[
            "sdp_divide_run",
            "sdp_divide_markstein",
            "sdp_divide_fast",
            "sdp_divide_plain4",
            "sdp_divisor_unbounded",
        ],
    ),
    (
        "scale and reciprocal (per group)",
        &[
            "sdp_meta_of",
            "sdp_meta_general",
            "sdp_meta_non_finite",
            "sdp_max_code_inverse",
            "sdp_divisor_uncoded",
            "sdp_divisor_of",
            "sdp_is_finite",
        ],
    ),
    (
        "statistics (absmax, warp reduction)",
        &[
            "sdp_stats_add",
            "sdp_stats_reduce",
            "sdp_stats_empty",
            "sdp_warp_max_u32",
            "sdp_warp_min",
            "sdp_warp_max",
            "sdp_abs_bits",
        ],
    ),
    (
        "Hadamard (shuffles, butterflies)",
        &[
            "sdp_hadamard_forward",
            "sdp_hadamard_inverse",
            "sdp_hadamard_lane_stage",
            "sdp_hadamard_register_stage",
            "sdp_power_of_two_inverse",
        ],
    ),
    (
        "code packing and stores",
        &[
            "sdp_store_codes",
            "sdp_zero_slab_padding",
            "sdp_zero_slabs_padding",
        ],
    ),
    (
        "quantizer control (tiles, runs, their branches)",
        &["sdp_quantize_group"],
    ),
    (
        "decoding (code loads, corrupt checks, dequantize, peer sums)",
        &[
            "sdp_load_run_codes",
            "sdp_run_codes_at",
            "sdp_decode_run_codes",
            "sdp_run_codes_corrupt",
            "sdp_zero_field_borrows",
            "sdp_byte_0x80_marks",
            "sdp_code_marks_found",
            "sdp_nibble_as_float",
            "sdp_byte_as_float",
            "sdp_peer_meta",
            "sdp_dequantize",
            "sdp_sum_peers_tile",
            "sdp_slab_group",
            "sdp_meta_corrupt",
            "sdp_is_inf",
        ],
    ),
    (
        "element loads and stores (with their unaligned / tail fallbacks)",
        &[
            "sdp_load_f32x4",
            "sdp_grad_load4",
            "sdp_grad_load4_raw",
            "sdp_store_f32x4",
            "sdp_load_u16x8",
            "sdp_store_u16x8",
            "sdp_bf16_to_f32",
            "sdp_bf16_low_to_f32_raw",
            "sdp_bf16_high_to_f32_raw",
            "sdp_f32_to_bf16",
            "sdp_f32x2_to_bf16x2",
            "sdp_grad_store4",
            "sdp_grad_store1",
            "sdp_half",
            "sdp_word_of",
            "sdp_aligned",
            "load_run",
            "load_four",
            "load_four_of_part",
            "element_of",
            "store_tile",
            "store_run_elements",
            "store_group_nan",
            "global_store_run",
            "global_quantize_checked",
            "apply_run",
        ],
    ),
    (
        "unit index and addresses",
        &[
            "sdp_udiv_of",
            "sdp_udiv_quotient",
            "sdp_warp_id",
            "sdp_warp_count",
            "sdp_unit_walk_of",
            "sdp_unit_walk_next",
            "sdp_digits_of",
            "sdp_lane",
            "sdp_slab_at",
            "sdp_codes_offset",
            "sdp_scale_offset",
            "sdp_offset_offset",
            "sdp_meta_end",
            "sdp_code_bytes",
            "sdp_max_code",
            "sdp_tiles",
            "sdp_tile_element",
            "sdp_tile_runs",
            "sdp_run_in_group",
            "sdp_quantize_slab_group",
        ],
    ),
    ("the kernel's own code (index, loads, loop)", &[]),
];

/// The function of `source` that line `line` (1-based) lies in: the name of the last
/// definition that starts at or before it (a line beginning with `__device__`, `static
/// __device__` or, for kernels, `extern "C"` with the name on the next line).
fn function_at(source: &str, line: u32) -> Option<String> {
    let lines: Vec<&str> = source.lines().collect();
    let mut name = None;
    for (i, text) in lines.iter().enumerate().take(line as usize) {
        let header = if text.starts_with("extern \"C\"") {
            lines.get(i + 1).copied()
        } else if text.starts_with("__device__") || text.starts_with("static __device__") {
            Some(*text)
        } else {
            None
        };
        if let Some(found) = header
            .and_then(|h| h.split('(').next())
            .and_then(|h| h.split_whitespace().last())
        {
            name = Some(found.to_owned());
        }
    }
    name
}

/// The marker that opens a cold block in `kernels/`: a line holding it and an opening brace
/// starts a block (to its matching closing brace) that valid, aligned data never enters.
const COLD_MARKER: &str = "// Cold path";

/// The lines (1-based) inside the cold blocks of `source` (the opening line excluded: its
/// condition runs on every path).
fn cold_lines(source: &str) -> std::collections::BTreeSet<u32> {
    let mut cold = std::collections::BTreeSet::new();
    let lines: Vec<&str> = source.lines().collect();
    for (start, text) in lines.iter().enumerate() {
        if !text.contains(COLD_MARKER) {
            continue;
        }
        let mut depth = 0i32;
        for (i, line) in lines.iter().enumerate().skip(start) {
            let mut code = line.split("//").next().unwrap_or("");
            if i == start {
                // `} else {`: the brace that closes the previous block is not this one's.
                code = code.trim_start().trim_start_matches('}');
            }
            depth += code.matches('{').count() as i32 - code.matches('}').count() as i32;
            if i > start {
                cold.insert(i as u32 + 1);
            }
            if depth <= 0 && i > start {
                break;
            }
        }
    }
    cold
}

/// A source of the analysis build and what the breakdown needs of it.
struct Source {
    text: String,
    cold: std::collections::BTreeSet<u32>,
}

/// Instructions per category (in the order of [`CATEGORIES`]) of a loop body whose frames
/// name `analysis.cu` (the specialised source, `code`) or the headers in `kernels`, and how
/// many of them are cold (some frame inside a cold block).
fn breakdown(body: &[Instruction], code: &str, kernels: &Path) -> Result<(Vec<u32>, u32), String> {
    let mut sources: std::collections::BTreeMap<String, Source> = std::collections::BTreeMap::new();
    let mut counts = vec![0u32; CATEGORIES.len()];
    let mut cold = 0;
    for instruction in body {
        for (file, _) in &instruction.frames {
            if !sources.contains_key(file) {
                let text = if file == "analysis.cu" {
                    code.to_owned()
                } else {
                    std::fs::read_to_string(kernels.join(file))
                        .map_err(|e| format!("read kernels/{file}: {e}"))?
                };
                let cold = cold_lines(&text);
                sources.insert(file.clone(), Source { text, cold });
            }
        }
        let function = instruction
            .frames
            .first()
            .and_then(|(file, line)| function_at(&sources[file].text, *line));
        let category = function
            .as_deref()
            .and_then(|f| CATEGORIES.iter().position(|(_, fs)| fs.contains(&f)))
            .unwrap_or(CATEGORIES.len() - 1);
        counts[category] += 1;
        if instruction
            .frames
            .iter()
            .any(|(file, line)| sources[file].cold.contains(line))
        {
            cold += 1;
        }
    }
    Ok((counts, cold))
}

/// The specialised source compiled as the production build is (NVRTC's options of
/// `sdp4bit::backend::cuda::compile`) plus `-lineinfo`, the headers from `kernels`.
fn compile_with_line_info(code: &str, kernels: &Path) -> Result<String, String> {
    let options = cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        fmad: Some(false),
        options: vec![
            "--std=c++17".to_owned(),
            "-default-device".to_owned(),
            "-lineinfo".to_owned(),
        ],
        include_paths: vec![kernels.display().to_string()],
        arch: Some("sm_90"),
        name: Some("analysis.cu".to_owned()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(code, options)
        .map(|ptx| ptx.to_src())
        .map_err(|e| format!("NVRTC (-lineinfo build): {e:?}"))
}

/// One row of the table.
struct Row<'a> {
    model: &'a Model,
    resources: KernelResources,
    body: u32,
    /// Loop-body instructions per category of [`CATEGORIES`].
    breakdown: Vec<u32>,
    /// Loop-body instructions in cold blocks ([`COLD_MARKER`]).
    cold: u32,
}

impl Row<'_> {
    /// Warp instructions per element (upper bound).
    fn instructions_per_element(&self) -> f64 {
        f64::from(self.body) / self.model.elements_per_unit
    }

    /// Bytes per second the issue bound allows.
    fn issue_bound(&self) -> f64 {
        self.issue_bound_of(self.body)
    }

    /// Bytes per second the issue bound allows at `body` instructions per unit.
    fn issue_bound_of(&self, body: u32) -> f64 {
        MULTIPROCESSORS * ISSUE_PER_CLOCK * CLOCK_HZ * self.model.elements_per_unit
            / f64::from(body)
            * self.model.bytes_per_element
    }

    /// The estimate when only the instructions outside cold blocks issue (valid, aligned
    /// data).
    fn hot_estimate(&self) -> f64 {
        (self
            .issue_bound_of(self.body - self.cold)
            .min(self.latency_bound())
            / HBM_BYTES_PER_S)
            .min(1.0)
    }

    /// Bytes in flight per multiprocessor at the kernel's occupancy.
    fn in_flight(&self) -> f64 {
        self.resources.usage.occupancy() * MAX_WARPS * self.model.in_flight_per_warp
    }

    /// Bytes per second the latency bound allows (the read traffic scaled to all traffic).
    fn latency_bound(&self) -> f64 {
        let read_rate = self.in_flight() * MULTIPROCESSORS / LATENCY_S;
        let read_share = self.model.loaded_per_unit
            / (self.model.bytes_per_element * self.model.elements_per_unit);
        read_rate / read_share
    }

    /// The estimated fraction of HBM bandwidth.
    fn estimate(&self) -> f64 {
        (self.issue_bound().min(self.latency_bound()) / HBM_BYTES_PER_S).min(1.0)
    }
}

/// Compiles, assembles and counts every kernel; the markdown report.
fn report(tools: &CudaTools, dir: &Path) -> Result<String, String> {
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut rows = Vec::new();
    for model in &MODELS {
        let source = SOURCES
            .iter()
            .find(|s| s.kernels.iter().any(|k| k.name() == model.kernel))
            .ok_or_else(|| format!("no source defines {}", model.kernel))?;
        let ptx = compile(source, Arch::SM_90).map_err(|e| e.to_string())?.ptx;
        let resources = tools
            .analyse(source.file, &ptx, dir)?
            .into_iter()
            .find(|r| r.name == model.kernel)
            .ok_or_else(|| format!("ptxas reports no {}", model.kernel))?;
        let code = specialised_source(source.code, model);
        let specialised = KernelSource {
            file: "analysis.cu",
            code: Box::leak(code.into_boxed_str()),
            kernels: &[],
        };
        let compiled = compile(&specialised, Arch::SM_90).map_err(|e| e.to_string())?;
        if !compiled.log.is_empty() {
            return Err(format!(
                "{}: the analysis build warned:\n{}",
                model.kernel, compiled.log
            ));
        }
        let listing = tools.disassemble("analysis.cu", &compiled.ptx, dir)?;
        let counts = count_sass(&listing);
        if counts.get("analysis").is_none_or(|c| c.local > 0) {
            return Err(format!("{}: the analysis build spills", model.kernel));
        }
        let body = loop_body(&listing, "analysis")
            .map_err(|e| format!("{} ({}): {e}", model.kernel, model.config))?
            .len() as u32;
        // The same build with line information, for the breakdown; it must be the same code.
        let lined = tools.disassemble_with_lines(
            "analysis.cu",
            &compile_with_line_info(specialised.code, &kernels)?,
            dir,
        )?;
        let lined_body = loop_body(&lined, "analysis")
            .map_err(|e| format!("{} (-lineinfo build): {e}", model.kernel))?;
        if lined_body.len() as u32 != body {
            return Err(format!(
                "{}: the -lineinfo build has {} loop-body instructions, the plain one {body}",
                model.kernel,
                lined_body.len()
            ));
        }
        let (breakdown, cold) = breakdown(&lined_body, specialised.code, &kernels)?;
        rows.push(Row {
            model,
            resources,
            body,
            breakdown,
            cold,
        });
    }

    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "# CUDA kernels: static resources and a bandwidth model (H100 SXM)\n"
    );
    let _ = writeln!(
        w,
        "**Static analysis only, made without a GPU; the H100's measurements \
         (`bench/results/gpu/`) contradict its estimates for the grouped gradient kernels.** \
         Every figure is read from the compiled code (NVRTC 13.0 with the backend's options, \
         `ptxas -v --gpu-name sm_90`, SASS from `nvdisasm`) and put through the model below.\n"
    );
    let _ = writeln!(w, "- machine: {} (no GPU)", machine());
    let _ = writeln!(
        w,
        "- date: {}",
        humantime::format_rfc3339_seconds(std::time::SystemTime::now())
    );
    let _ = writeln!(
        w,
        "- command: `bash scripts/bench.sh kernels --out bench/results/kernels.md`"
    );
    let _ = writeln!(w, "- ptxas: {}\n", tools.ptxas_version()?);
    let _ = writeln!(w, "## Resources of the production build\n");
    let _ = writeln!(
        w,
        "Registers, spills and occupancy from ptxas (blocks of 256 threads, occupancy = resident \
         warps / 64 as the registers allow); shuffles and votes are static counts (each \
         instruction of the code once); load and store widths are the widest global accesses \
         in the SASS.\n"
    );
    let _ = writeln!(
        w,
        "| kernel | registers | spill bytes (store / load) | occupancy | SHFL | VOTE | widest load | widest store |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|---:|");
    for row in &rows {
        let (u, s) = (&row.resources.usage, &row.resources.sass);
        let _ = writeln!(
            w,
            "| `{}` | {} | {} / {} | {:.1}% | {} | {} | {} bit | {} |",
            row.model.kernel,
            u.registers,
            u.spill_stores,
            u.spill_loads,
            100.0 * u.occupancy(),
            s.shuffles,
            s.votes,
            s.widest_load(),
            match s.widest_store() {
                0 => "none (atomic)".to_owned(),
                bits => format!("{bits} bit"),
            }
        );
    }
    let _ = writeln!(w, "\n## Bandwidth model\n");
    let _ = writeln!(
        w,
        "Per kernel, one representative configuration; the kernel is compiled once more with \
         that configuration as constants (a wrapper kernel), and the instructions of its \
         grid-stride loop body, one work unit, are counted in the SASS, cold paths included \
         (an upper bound on what a warp issues per unit in the loop body). A function the \
         compiler keeps out of line counts as its call only, not its body: the compiler's own \
         division slow path, and the kernels' out-of-line fallbacks (the exact division for \
         scales or values outside the fast path's range, element-wise loads of unaligned or \
         partial runs, the general metadata of a group whose absmax lies outside [2^-24, \
         2^40): zero, tiny, huge or non-finite), which valid, aligned buckets of ordinary \
         gradients and weights do not reach. Likewise Global-QSGD's \
         dequantization: its grid-stride loop (the one counted) takes the whole runs of aligned \
         buffers, and a second loop after it the rest (unaligned buffers, the last partial run \
         and, only after an overflow of the integer sum, the element-wise re-scan for the status \
         word), which aligned buckets without an overflow do not enter. The estimate is the \
         smallest of:\n\n\
         - HBM3: {hbm:.2} TB/s, for the bytes the kernel reads and writes per element;\n\
         - issue: {mp} multiprocessors x {issue} warp instructions per clock x {clock:.2} GHz, \
           every loop-body instruction issued once per unit;\n\
         - latency: bytes in flight = resident warps x the bytes one unit loads (one \
           group's for a unit of several groups, which a warp handles one after another), \
           against {hbm:.2} TB/s x {lat:.0} ns loaded latency / {mp} multiprocessors = \
           {need:.1} KB per multiprocessor.\n\n\
         It ignores dual issue, instruction cache misses, partial waves, L2 effects and the \
         launch itself, and it assumes the clock holds under load.\n",
        hbm = HBM_BYTES_PER_S / 1e12,
        mp = MULTIPROCESSORS,
        issue = ISSUE_PER_CLOCK,
        clock = CLOCK_HZ / 1e9,
        lat = LATENCY_S * 1e9,
        need = HBM_BYTES_PER_S * LATENCY_S / MULTIPROCESSORS / 1024.0,
    );
    let _ = writeln!(
        w,
        "| kernel | configuration | bytes / element | loop body (instructions / unit) | instructions / element | issue bound | in flight per SM | latency bound | estimate (of HBM) |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for row in &rows {
        let _ = writeln!(
            w,
            "| `{}` | {} | {:.2} | {} / {} elements | {:.2} | {:.2} TB/s | {:.1} KB | {:.2} TB/s | **{:.0}%** |",
            row.model.kernel,
            row.model.config,
            row.model.bytes_per_element,
            row.body,
            row.model.elements_per_unit,
            row.instructions_per_element(),
            row.issue_bound() / 1e12,
            row.in_flight() / 1024.0,
            row.latency_bound() / 1e12,
            100.0 * row.estimate(),
        );
    }
    write_breakdown(w, &rows);
    let below: Vec<String> = rows
        .iter()
        .filter(|r| r.estimate() < 0.8)
        .map(|r| {
            let bound = if r.issue_bound() <= r.latency_bound() {
                "issue"
            } else {
                "latency"
            };
            format!("`{}` ({bound})", r.model.kernel)
        })
        .collect();
    let _ = writeln!(
        w,
        "\nBelow the 80% target by this model: {}.",
        if below.is_empty() {
            "none".to_owned()
        } else {
            below.join(", ")
        }
    );
    for row in rows.iter().filter(|r| r.estimate() < 0.8) {
        let _ = writeln!(w, "\n{}", what_bounds(row));
        if let Some((_, note)) = BOUND_NOTES.iter().find(|(k, _)| *k == row.model.kernel) {
            let _ = writeln!(w, "\n{note}");
        }
    }
    Ok(out)
}

/// What keeps a kernel below 80% without a change of its numerics (printed only while it is).
const BOUND_NOTES: [(&str, &str); 2] = [
    (
        "grad_quantize_first_bf16",
        "It runs the same quantizer as `grad_quantize_first` over half the input bytes (3.03 per \
     element instead of 5.03), so 80% of HBM allows 151 instructions per group of 128 where \
     the quantizer alone needs about 184, all fixed by the numerics (docs/numerics.md §1, \
     §7.5): one Philox block (52), the uniform add, rounding and clamp of 4 values (25), 4 \
     divisions by the scale as a multiply and two fused multiply-adds each, with their range \
     test and the call of the out-of-line fallback (31), the group's scale and its correctly \
     rounded reciprocal, with the call of the out-of-line general case (24), the \
     Hadamard block of 32 (36), the absmax (8) and the packing and store (8). No \
     rearrangement of the control reaches 80% by this model; the kernel is bound by issue, \
     not by memory, at about half of HBM bandwidth. The floor's conversion to an integer is \
     one instruction (`cvt.rmi`); a round-down addition of 1.5 x 2^23 instead takes two (the \
     addition and the integer's extraction).",
    ),
    (
        "grad_reduce_final_bf16",
        "It decodes, sums and inverts the Hadamard transform exactly as `grad_reduce_final` \
         (228 instructions per group, 100%) but writes half the bytes (4.12 per element instead \
         of 6.12), so 80% of HBM allows 205 instructions per group of 128 where the arithmetic \
         the numerics fix (docs/numerics.md §7.1, §7.5) takes about 195: the decoding of 4 \
         peers (126; per peer the code word's load 4, the corrupt-code marks 3, 4 nibbles \
         decoded in place 12, 4 multiplications by the scale and 4 additions to the sum 8, the \
         scale's broadcast 2; the peers' scales loaded and checked once per group), the \
         inverse Hadamard block of 32 with its scaling by 1/32 (45) and the rounding of 4 \
         values to bf16 with their packed store (24). The group's index, range test, corrupt \
         vote, loop and the calls of the out-of-line stores take the other 56; the kernel is \
         bound by issue, not by memory, at two thirds of HBM bandwidth.",
    ),
];

/// For a kernel below 80%: the loop body that 80% would allow and its largest categories.
fn what_bounds(row: &Row<'_>) -> String {
    let allowed = MULTIPROCESSORS
        * ISSUE_PER_CLOCK
        * CLOCK_HZ
        * row.model.elements_per_unit
        * row.model.bytes_per_element
        / (0.8 * HBM_BYTES_PER_S);
    let mut largest: Vec<(usize, u32)> = row.breakdown.iter().copied().enumerate().collect();
    largest.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
    let parts: Vec<String> = largest
        .iter()
        .take(4)
        .map(|&(i, n)| format!("{} {n}", CATEGORIES[i].0))
        .collect();
    format!(
        "`{}`: {} instructions per unit where 80% allows {:.0}; the largest categories: {}.",
        row.model.kernel,
        row.body,
        allowed.floor(),
        parts.join(", ")
    )
}

/// The breakdown table: a column per group kernel (the Global-QSGD kernels are left out).
fn write_breakdown(w: &mut String, rows: &[Row<'_>]) {
    let group: Vec<&Row<'_>> = rows
        .iter()
        .filter(|r| r.model.struct_name != "sdp_global")
        .collect();
    let _ = writeln!(w, "\n## Where the loop-body instructions go\n");
    let _ = writeln!(
        w,
        "The same specialised builds compiled once more with line information (NVRTC \
         `-lineinfo`, `ptxas -lineinfo`, `nvdisasm -gi`; the loop bodies are checked to be \
         the same length), each loop-body instruction attributed to the function of \
         `kernels/` its innermost source line lies in, and the functions grouped as below \
         (per work unit, all paths counted).\n"
    );
    let mut header = "| category |".to_owned();
    let mut rule = "|---|".to_owned();
    for row in &group {
        header += &format!(" `{}` |", row.model.kernel);
        rule += "---:|";
    }
    let _ = writeln!(w, "{header}\n{rule}");
    for (i, (category, _)) in CATEGORIES.iter().enumerate() {
        let mut line = format!("| {category} |");
        for row in &group {
            line += &format!(" {} |", row.breakdown[i]);
        }
        let _ = writeln!(w, "{line}");
    }
    let mut total = "| **all paths** (the model's count) |".to_owned();
    let mut cold = "| of which in cold blocks |".to_owned();
    let mut hot = "| the path of valid, aligned data (all - cold) |".to_owned();
    let mut estimate = "| estimate on that path (of HBM) |".to_owned();
    for row in &group {
        total += &format!(" **{}** |", row.body);
        cold += &format!(" {} |", row.cold);
        hot += &format!(" {} |", row.body - row.cold);
        estimate += &format!(" {:.0}% |", 100.0 * row.hot_estimate());
    }
    let _ = writeln!(w, "{total}\n{cold}\n{hot}\n{estimate}");
    let _ = writeln!(
        w,
        "\nCold blocks are the blocks of `kernels/` opened by a `{COLD_MARKER}` comment; an \
         instruction is cold when one of its source frames (the line, or a call site it is \
         inlined at) lies inside one. The verdict below uses all paths."
    );
}

/// The host this ran on: its CPU model and core count.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {cores} cores")
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let out = match args.as_slice() {
        [] => None,
        [flag, path] if flag == "--out" => Some(PathBuf::from(path)),
        _ => {
            eprintln!("usage: kernels [--out FILE]");
            return ExitCode::from(2);
        }
    };
    let tools = match probe::nvrtc()
        .map_err(|e| e.to_string())
        .and_then(|()| CudaTools::from_env())
    {
        Ok(tools) => tools,
        Err(e) => {
            eprintln!("kernels: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dir = std::env::temp_dir().join(format!("sdp4bit-kernel-model-{}", std::process::id()));
    let result = std::fs::create_dir_all(&dir)
        .map_err(|e| e.to_string())
        .and_then(|()| report(&tools, &dir));
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Ok(text) => {
            print!("{text}");
            if let Some(path) = out
                && let Err(e) = std::fs::write(&path, &text)
            {
                eprintln!("kernels: write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kernels: {e}");
            ExitCode::FAILURE
        }
    }
}
