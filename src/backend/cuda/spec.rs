//! The compile-time configuration of one kernel launch (`kernels/spec.cuh`) and the entry point
//! that instantiates the kernel's body with it.
//!
//! A [`KernelSpec`] is a kernel of the table, the [`Constants`] its body is specialised on
//! (derived from the launch's parameter struct, so the compiled constants are always the
//! struct's values) and a [`Variant`], how the work is cut and launched (every variant computes
//! the same bytes). Its [`entry`](KernelSpec::entry) name spells all three and
//! [`from_entry`](KernelSpec::from_entry) reads them back, so a tool that meets the name in a
//! CUBIN (the driver emulation, a profiler's report) can rebuild its source;
//! [`source`](KernelSpec::source) is the translation unit NVRTC compiles: the kernel's `.cu`
//! file and one `extern "C"` wrapper with the variant's `__launch_bounds__`.

use std::fmt::{self, Write as _};

use super::abi::{
    AbiParams, SdpConvert, SdpGlobal, SdpGradFinal, SdpGradFirst, SdpGradSecond, SdpQuant,
    SdpWeightApply, SdpWeightEncode,
};
use super::source::Kernel;
use crate::codec::slab::SlabLayout;
use crate::codec::weight_encoding::WeightEncoding;
use crate::config::Rounding;
use crate::error::{Error, Result};
use crate::layout::{BucketPlan, GradLayout};
use crate::rng::UniformStream;

/// The group quantizer as compile-time constants (`sdp_quant_spec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quant {
    /// Bits per code: 4 or 8.
    pub bits: u32,
    /// Elements per group: a multiple of 32, at most 65536.
    pub group_size: u32,
    /// Absmax (true) or min-max codes.
    pub symmetric: bool,
    /// Stochastic rounding (true) or round half to even.
    pub stochastic: bool,
}

impl Quant {
    /// The quantizer of a launch's parameter struct; an error for one no kernel compiles.
    fn of(q: &SdpQuant) -> Result<Self> {
        let quant = Self {
            bits: q.bits,
            group_size: q.group_size,
            symmetric: q.symmetric != 0,
            stochastic: q.stochastic != 0,
        };
        let valid = matches!(quant.bits, 4 | 8)
            && quant.group_size >= 32
            && quant.group_size <= 65536
            && quant.group_size.is_multiple_of(32)
            && q.symmetric <= 1
            && q.stochastic <= 1;
        if valid {
            Ok(quant)
        } else {
            Err(Error::Cuda(format!(
                "no kernel quantizes with {q:?}: codes of 4 or 8 bits, groups of 32 k <= 65536"
            )))
        }
    }

    /// Rows of 32 `lane_elements` elements a group takes (`sdp_rows::count`).
    pub fn rows(self, lane_elements: u32) -> u32 {
        self.group_size.div_ceil(32 * lane_elements)
    }

    /// Whether a warp holds a whole group in registers (`sdp_rows::tiles == 1`): at most 64
    /// values per lane (`SDP_LANE_VALUES_MAX`).
    pub fn held(self, lane_elements: u32) -> bool {
        self.rows(lane_elements) * lane_elements <= HELD_VALUES
    }

    fn key(self) -> String {
        format!(
            "b{}g{}{}{}",
            self.bits,
            self.group_size,
            if self.symmetric { 's' } else { 'a' },
            if self.stochastic { 'r' } else { 'n' }
        )
    }

    fn parse(key: &str) -> Option<Self> {
        let rest = key.strip_prefix('b')?;
        let (bits, rest) = rest.split_once('g')?;
        let (group, flags) = rest.split_at(rest.len().checked_sub(2)?);
        let mut flags = flags.chars();
        Some(Self {
            bits: bits.parse().ok()?,
            group_size: group.parse().ok()?,
            symmetric: match flags.next()? {
                's' => true,
                'a' => false,
                _ => return None,
            },
            stochastic: match flags.next()? {
                'r' => true,
                'n' => false,
                _ => return None,
            },
        })
    }

    fn type_name(self) -> String {
        format!(
            "sdp_quant_spec<{}, {}, {}, {}>",
            self.bits, self.group_size, self.symmetric, self.stochastic
        )
    }
}

/// What a kernel's body is specialised on, per kernel family (`kernels/spec.cuh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Constants {
    /// `grad_quantize_first`: the first level's quantizer and Hadamard block (0: off).
    First { quant: Quant, hadamard_block: u32 },
    /// `grad_requantize_second`: the received and the second level's quantizers, and the
    /// peers decoded at once.
    Second {
        input: Quant,
        output: Quant,
        peer_batch: u32,
    },
    /// `grad_reduce_final`: the last level's quantizer, Hadamard block and peer batch.
    Final {
        quant: Quant,
        hadamard_block: u32,
        peer_batch: u32,
    },
    /// `weight_encode`, `weight_apply`: the weight quantizer and the qWD difference.
    Weight { quant: Quant, difference: bool },
    /// The element-wise kernels: stochastic rounding (Global-QSGD's quantize only).
    Elementwise { stochastic: bool },
}

/// The most peers a decoder loads at once (`peer_batch`); more are summed batch after batch.
pub const MAX_PEER_BATCH: u32 = 8;
/// The peer batch of a group walked in tiles: fewer loads held with the tile's values.
const TILED_PEER_BATCH: u32 = 2;

/// Registers per lane a decoder keeps for the loads of one batch of peers.
const PEER_LOAD_REGISTERS: u32 = 32;

/// The peer batch for `peers` slabs of groups of `quant`: the next power of two, at most
/// [`MAX_PEER_BATCH`], and at most as many peers as [`PEER_LOAD_REGISTERS`] hold the scale
/// and code words of (one word per row of the group held, or of a tile); 2 for groups walked
/// in tiles.
fn peer_batch(peers: u32, quant: Quant) -> u32 {
    let cap = if quant.held(4) {
        let per_peer = 1 + quant.rows(4);
        (PEER_LOAD_REGISTERS / per_peer).clamp(1, MAX_PEER_BATCH)
    } else {
        TILED_PEER_BATCH
    };
    let cap = 1 << cap.ilog2();
    peers.max(1).next_power_of_two().min(cap)
}

/// 0 or 1 as a bool; an error naming `what` otherwise.
fn flag(what: &str, value: u32) -> Result<bool> {
    match value {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(Error::Cuda(format!("{what} is {value}, not 0 or 1"))),
    }
}

/// A Hadamard block a kernel compiles: 0 (off) or a power of two from 16 to 256 dividing the
/// group.
fn hadamard(block: u32, quant: Quant) -> Result<u32> {
    let valid = block == 0
        || (block.is_power_of_two()
            && (16..=256).contains(&block)
            && quant.group_size.is_multiple_of(block));
    if valid {
        Ok(block)
    } else {
        Err(Error::Cuda(format!(
            "no kernel applies a Hadamard block of {block} to groups of {}",
            quant.group_size
        )))
    }
}

impl Constants {
    /// The constants of a `grad_quantize_first` launch.
    pub fn first(p: &SdpGradFirst) -> Result<Self> {
        let quant = Quant::of(&p.slab.quant)?;
        Ok(Self::First {
            quant,
            hadamard_block: hadamard(p.hadamard_block, quant)?,
        })
    }

    /// The constants of a `grad_requantize_second` launch.
    pub fn second(p: &SdpGradSecond) -> Result<Self> {
        let (input, output) = (Quant::of(&p.in_slab.quant)?, Quant::of(&p.out_slab.quant)?);
        if input.group_size != output.group_size {
            return Err(Error::Cuda(format!(
                "grad_requantize_second needs one group size for both levels, not {} and {}",
                input.group_size, output.group_size
            )));
        }
        Ok(Self::Second {
            input,
            output,
            peer_batch: peer_batch(p.peers1, input),
        })
    }

    /// The constants of a `grad_reduce_final` launch.
    pub fn last(p: &SdpGradFinal) -> Result<Self> {
        let quant = Quant::of(&p.slab.quant)?;
        Ok(Self::Final {
            quant,
            hadamard_block: hadamard(p.hadamard_block, quant)?,
            peer_batch: peer_batch(p.peers, quant),
        })
    }

    /// The constants of a `weight_encode` launch.
    pub fn encode(p: &SdpWeightEncode) -> Result<Self> {
        Ok(Self::Weight {
            quant: Quant::of(&p.slab.quant)?,
            difference: flag("the weight encoding's difference", p.difference)?,
        })
    }

    /// The constants of a `weight_apply` launch.
    pub fn apply(p: &SdpWeightApply) -> Result<Self> {
        Ok(Self::Weight {
            quant: Quant::of(&p.slab.quant)?,
            difference: flag("the weight encoding's difference", p.difference)?,
        })
    }

    /// The constants of a Global-QSGD launch.
    pub fn global(p: &SdpGlobal) -> Result<Self> {
        Ok(Self::Elementwise {
            stochastic: flag("Global-QSGD's stochastic rounding", p.stochastic)?,
        })
    }

    /// The constants of a conversion.
    pub fn convert() -> Self {
        Self::Elementwise { stochastic: false }
    }

    /// Elements of one lane's run: 4 for the gradient kernels, 8 for the weight kernels, 4
    /// for the element-wise kernels (a thread's run).
    pub fn lane_elements(self) -> u32 {
        match self {
            Self::Weight { .. } => 8,
            _ => 4,
        }
    }

    /// The quantizer whose groups a warp walks (the output's for the requantization), or
    /// `None` for the element-wise kernels.
    pub fn groups(self) -> Option<Quant> {
        match self {
            Self::First { quant, .. } | Self::Final { quant, .. } | Self::Weight { quant, .. } => {
                Some(quant)
            }
            Self::Second { output, .. } => Some(output),
            Self::Elementwise { .. } => None,
        }
    }

    /// The kernel families these constants belong to: the parameter struct they come from.
    fn params(self) -> &'static [&'static str] {
        match self {
            Self::First { .. } => &["sdp_grad_first"],
            Self::Second { .. } => &["sdp_grad_second"],
            Self::Final { .. } => &["sdp_grad_final"],
            Self::Weight { .. } => &["sdp_weight_encode", "sdp_weight_apply"],
            Self::Elementwise { .. } => &["sdp_global", "sdp_convert"],
        }
    }

    fn key(self) -> String {
        match self {
            Self::First {
                quant,
                hadamard_block,
            } => format!("{}_h{hadamard_block}", quant.key()),
            Self::Second {
                input,
                output,
                peer_batch,
            } => format!("{}_{}_p{peer_batch}", input.key(), output.key()),
            Self::Final {
                quant,
                hadamard_block,
                peer_batch,
            } => format!("{}_h{hadamard_block}_p{peer_batch}", quant.key()),
            Self::Weight { quant, difference } => {
                format!("{}_{}", quant.key(), if difference { 'd' } else { 'w' })
            }
            Self::Elementwise { stochastic } => (if stochastic { "r" } else { "n" }).into(),
        }
    }

    fn parse(params: &str, key: &str) -> Option<Self> {
        let parts: Vec<&str> = key.split('_').collect();
        let number = |part: &str, prefix: char| part.strip_prefix(prefix)?.parse::<u32>().ok();
        Some(match (params, &parts[..]) {
            ("sdp_grad_first", [q, h]) => Self::First {
                quant: Quant::parse(q)?,
                hadamard_block: number(h, 'h')?,
            },
            ("sdp_grad_second", [i, o, p]) => Self::Second {
                input: Quant::parse(i)?,
                output: Quant::parse(o)?,
                peer_batch: number(p, 'p')?,
            },
            ("sdp_grad_final", [q, h, p]) => Self::Final {
                quant: Quant::parse(q)?,
                hadamard_block: number(h, 'h')?,
                peer_batch: number(p, 'p')?,
            },
            ("sdp_weight_encode" | "sdp_weight_apply", [q, d]) => Self::Weight {
                quant: Quant::parse(q)?,
                difference: match *d {
                    "d" => true,
                    "w" => false,
                    _ => return None,
                },
            },
            ("sdp_global" | "sdp_convert", [r]) => Self::Elementwise {
                stochastic: match *r {
                    "r" => true,
                    "n" => false,
                    _ => return None,
                },
            },
            _ => return None,
        })
    }

    /// The spec type of `kernels/spec.cuh` with `units` groups per warp (or runs per thread).
    fn type_name(self, units: u32) -> String {
        match self {
            Self::First {
                quant,
                hadamard_block,
            } => format!(
                "sdp_first_spec<{}, {hadamard_block}, {units}>",
                quant.type_name()
            ),
            Self::Second {
                input,
                output,
                peer_batch,
            } => format!(
                "sdp_second_spec<{}, {}, {peer_batch}, {units}>",
                input.type_name(),
                output.type_name()
            ),
            Self::Final {
                quant,
                hadamard_block,
                peer_batch,
            } => format!(
                "sdp_final_spec<{}, {hadamard_block}, {peer_batch}, {units}>",
                quant.type_name()
            ),
            Self::Weight { quant, difference } => format!(
                "sdp_weight_spec<{}, {difference}, {units}>",
                quant.type_name()
            ),
            Self::Elementwise { stochastic } => {
                format!("sdp_elementwise_spec<{stochastic}, {units}>")
            }
        }
    }
}

/// A launch's parameter struct, and the constants it gives its kernel's body.
pub trait Specialised: AbiParams {
    /// The constants of a launch with these parameters (an error for parameters no kernel
    /// compiles).
    fn constants(&self) -> Result<Constants>;
}

impl Specialised for SdpGradFirst {
    fn constants(&self) -> Result<Constants> {
        Constants::first(self)
    }
}

impl Specialised for SdpGradSecond {
    fn constants(&self) -> Result<Constants> {
        Constants::second(self)
    }
}

impl Specialised for SdpGradFinal {
    fn constants(&self) -> Result<Constants> {
        Constants::last(self)
    }
}

impl Specialised for SdpWeightEncode {
    fn constants(&self) -> Result<Constants> {
        Constants::encode(self)
    }
}

impl Specialised for SdpWeightApply {
    fn constants(&self) -> Result<Constants> {
        Constants::apply(self)
    }
}

impl Specialised for SdpGlobal {
    fn constants(&self) -> Result<Constants> {
        Constants::global(self)
    }
}

impl Specialised for SdpConvert {
    fn constants(&self) -> Result<Constants> {
        Ok(Constants::convert())
    }
}

/// How a kernel's work is cut and launched. Every variant computes the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Groups one warp takes per step of its grid-stride loop (the grouped kernels), or runs of
    /// 4 elements one thread takes (the element-wise kernels): 1, 2, 4 or 8.
    pub units: u32,
    /// Threads per block: 128, 256 or 512.
    pub threads: u32,
    /// Blocks per multiprocessor the register budget is set for (`__launch_bounds__`'s
    /// second argument): at least 1, at most 2048 threads in all.
    pub min_blocks: u32,
    /// Blocks launched per multiprocessor at most (the grid's cap; the kernels loop
    /// grid-stride over the rest). Not compiled in.
    pub grid_blocks: u32,
}

impl Variant {
    /// Fails unless the variant is one the kernels compile for `constants`: a group walked in
    /// tiles takes one group per unit, the groups of a unit hold at most 64 values per lane,
    /// and the blocks the register budget is set for fit a multiprocessor (2048 threads).
    pub fn check(self, constants: Constants) -> Result<()> {
        let e = constants.lane_elements();
        let valid = matches!(self.units, 1 | 2 | 4 | 8)
            && matches!(self.threads, 128 | 256 | 512)
            && self.min_blocks >= 1
            && self.threads * self.min_blocks <= MAX_THREADS_PER_MULTIPROCESSOR
            && (1..=64).contains(&self.grid_blocks)
            && constants.groups().is_none_or(|q| {
                self.units == 1 || (q.held(e) && self.units * q.rows(e) * e <= HELD_VALUES)
            });
        if valid {
            Ok(())
        } else {
            Err(Error::Cuda(format!(
                "no kernel compiles the variant {self:?} of {}",
                constants.key()
            )))
        }
    }

    fn key(self) -> String {
        format!("u{}t{}m{}", self.units, self.threads, self.min_blocks)
    }

    fn parse(key: &str) -> Option<Self> {
        let rest = key.strip_prefix('u')?;
        let (units, rest) = rest.split_once('t')?;
        let (threads, blocks) = rest.split_once('m')?;
        Some(Self {
            units: units.parse().ok()?,
            threads: threads.parse().ok()?,
            min_blocks: blocks.parse().ok()?,
            grid_blocks: DEFAULT_GRID_BLOCKS,
        })
    }
}

/// Threads one multiprocessor holds (sm_80 to sm_120), which bounds blocks x threads.
const MAX_THREADS_PER_MULTIPROCESSOR: u32 = 2048;

/// Values per lane the groups of one unit may hold (`SDP_LANE_VALUES_MAX`).
const HELD_VALUES: u32 = 64;

/// The grid cap of a variant read back from an entry name, which does not spell it.
pub const DEFAULT_GRID_BLOCKS: u32 = 32;

/// One specialised kernel: a kernel of the table, its constants and its variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    /// The kernel.
    pub kernel: Kernel,
    /// What its body is specialised on.
    pub constants: Constants,
    /// How it is cut and launched.
    pub variant: Variant,
}

impl KernelSpec {
    /// `kernel` with `constants` and `variant`, checked against each other.
    pub fn new(kernel: Kernel, constants: Constants, variant: Variant) -> Result<Self> {
        if !constants.params().contains(&kernel.params()) {
            return Err(Error::Cuda(format!(
                "{} takes a {}, not constants {constants:?}",
                kernel.name(),
                kernel.params()
            )));
        }
        variant.check(constants)?;
        Ok(Self {
            kernel,
            constants,
            variant,
        })
    }

    /// The `extern "C"` name of the entry point: `KERNEL__CONSTANTS__VARIANT`, for example
    /// `grad_quantize_first__b8g128sr_h32__u4t256m3` (the grid cap is not compiled in).
    pub fn entry(&self) -> String {
        format!(
            "{}__{}__{}",
            self.kernel.name(),
            self.constants.key(),
            self.variant.key()
        )
    }

    /// The spec an entry name spells ([`entry`](Self::entry)), with the default grid cap, or
    /// `None` for a name no spec writes.
    pub fn from_entry(entry: &str) -> Option<Self> {
        let mut parts = entry.split("__");
        let (name, constants, variant) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let kernel = Kernel::ALL.into_iter().find(|k| k.name() == name)?;
        let constants = Constants::parse(kernel.params(), constants)?;
        Self::new(kernel, constants, Variant::parse(variant)?).ok()
    }

    /// The `extern "C"` wrapper that instantiates the kernel's body with this spec, without the
    /// `#include` of its source ([`source`](Self::source) adds it).
    pub fn wrapper(&self) -> String {
        let kernel = self.kernel;
        let mut parameters = String::new();
        let mut arguments = String::new();
        for p in kernel.pointers() {
            let _ = write!(parameters, "{}* {}, ", p.element, p.name);
            let _ = write!(arguments, "{}, ", p.name);
        }
        format!(
            "extern \"C\" __global__ void __launch_bounds__({threads}, {blocks})\n\
             {entry}({parameters}{params} args)\n{{\n    {body}<{spec}>({arguments}args);\n}}\n",
            threads = self.variant.threads,
            blocks = self.variant.min_blocks,
            entry = self.entry(),
            params = kernel.params(),
            body = kernel.body(),
            spec = self.constants.type_name(self.variant.units),
        )
    }

    /// The translation unit NVRTC compiles for this spec: the kernel's `.cu` file (handed to
    /// NVRTC in memory with the headers) and the wrapper.
    pub fn source(&self) -> String {
        format!("#include \"{}\"\n\n{}", self.kernel.file(), self.wrapper())
    }
}

// The kernels a bucket launches, with their constants, for its set-up to compile them before its
// first step (`Kernels::prepare_uses`). The constants do not depend on the random streams, the
// chunk or the rank, so any of them gives the bucket's.

/// The grouped gradient reduce-scatter of `layout`: the first pass, the requantization (two
/// levels) and the final pass, the first and final passes for fp32 and for bf16 buckets.
pub fn grad_uses(layout: &GradLayout) -> Result<Vec<(Kernel, Constants)>> {
    let rng = UniformStream::new(0, 0, 0);
    let first = Constants::first(&SdpGradFirst::new(layout, &rng)?)?;
    let last = Constants::last(&SdpGradFinal::new(layout, 0)?)?;
    let mut uses = vec![
        (Kernel::GradQuantizeFirst, first),
        (Kernel::GradQuantizeFirstBf16, first),
        (Kernel::GradReduceFinal, last),
        (Kernel::GradReduceFinalBf16, last),
    ];
    if layout.second.is_some() {
        let second = Constants::second(&SdpGradSecond::new(layout, 0, 0, &rng)?)?;
        uses.push((Kernel::GradRequantizeSecond, second));
    }
    Ok(uses)
}

/// Global-QSGD with `bits`-bit integers (8 or 16) and `rounding`: the absmax, the rounding and
/// the dequantization, for fp32 and bf16 buckets.
pub fn global_uses(bits: u8, rounding: Rounding) -> Result<Vec<(Kernel, Constants)>> {
    let (quantize, dequantize) = match bits {
        8 => (
            [Kernel::GlobalQuantizeI8, Kernel::GlobalQuantizeI8Bf16],
            [Kernel::GlobalDequantizeI8, Kernel::GlobalDequantizeI8Bf16],
        ),
        16 => (
            [Kernel::GlobalQuantizeI16, Kernel::GlobalQuantizeI16Bf16],
            [Kernel::GlobalDequantizeI16, Kernel::GlobalDequantizeI16Bf16],
        ),
        _ => {
            return Err(Error::Cuda(format!(
                "Global-QSGD kernels exist for 8- and 16-bit integers, not {bits}-bit"
            )));
        }
    };
    let rng = UniformStream::new(0, 0, 0);
    let rounded = Constants::global(&SdpGlobal::quantize(0, 0.0, 1, rounding, &rng))?;
    let plain = Constants::global(&SdpGlobal::dequantize(0, 0.0))?;
    Ok([Kernel::GlobalAbsmax, Kernel::GlobalAbsmaxBf16]
        .into_iter()
        .chain(dequantize)
        .map(|k| (k, plain))
        .chain(quantize.into_iter().map(|k| (k, rounded)))
        .collect())
}

/// The conversions of the routes that move gradients without quantizing them.
pub fn conversion_uses() -> Vec<(Kernel, Constants)> {
    [
        Kernel::GradWidenBf16,
        Kernel::GradNarrowBf16,
        Kernel::GradRoundBf16,
    ]
    .into_iter()
    .map(|k| (k, Constants::convert()))
    .collect()
}

/// The weight all-gather with slabs of `layout` encoded as `encoding`: the encoding and the
/// application.
pub fn weight_uses(
    layout: &SlabLayout,
    encoding: WeightEncoding,
    plan: &BucketPlan,
) -> Result<Vec<(Kernel, Constants)>> {
    let rng = UniformStream::new(0, 0, 0);
    let encode = SdpWeightEncode::new(layout, encoding, plan.shard_len, 0, &rng)?;
    let apply = SdpWeightApply::new(layout, encoding, plan, 0)?;
    Ok(vec![
        (Kernel::WeightEncode, Constants::encode(&encode)?),
        (Kernel::WeightApply, Constants::apply(&apply)?),
    ])
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.entry())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quant(bits: u32, group_size: u32, symmetric: bool, stochastic: bool) -> Quant {
        Quant {
            bits,
            group_size,
            symmetric,
            stochastic,
        }
    }

    fn variant(units: u32) -> Variant {
        Variant {
            units,
            threads: 256,
            min_blocks: 3,
            grid_blocks: DEFAULT_GRID_BLOCKS,
        }
    }

    /// Every kind of constants survives the round trip through its entry name.
    #[test]
    fn entry_names_read_back() {
        let q = quant(8, 128, true, true);
        let specs = [
            (
                Kernel::GradQuantizeFirstBf16,
                Constants::First {
                    quant: q,
                    hadamard_block: 32,
                },
            ),
            (
                Kernel::GradRequantizeSecond,
                Constants::Second {
                    input: q,
                    output: quant(4, 128, true, false),
                    peer_batch: 4,
                },
            ),
            (
                Kernel::GradReduceFinal,
                Constants::Final {
                    quant: quant(8, 1024, false, true),
                    hadamard_block: 0,
                    peer_batch: 8,
                },
            ),
            (
                Kernel::WeightApply,
                Constants::Weight {
                    quant: quant(4, 2048, true, true),
                    difference: true,
                },
            ),
            (
                Kernel::GlobalQuantizeI16,
                Constants::Elementwise { stochastic: true },
            ),
            (Kernel::GradNarrowBf16, Constants::convert()),
        ];
        for (kernel, constants) in specs {
            let spec = KernelSpec::new(kernel, constants, variant(1)).unwrap();
            assert_eq!(KernelSpec::from_entry(&spec.entry()), Some(spec), "{spec}");
            assert!(
                spec.source()
                    .contains(&format!("void __launch_bounds__(256, 3)\n{spec}("))
            );
        }
        assert_eq!(
            KernelSpec::new(Kernel::GradQuantizeFirst, specs_first(), variant(4))
                .unwrap()
                .entry(),
            "grad_quantize_first__b8g128sr_h32__u4t256m3"
        );
        for bad in [
            "grad_quantize_first",
            "grad_quantize_first__b8g128sr_h32",
            "grad_quantize_first__b8g128sx_h32__u4t256m3",
            "nothing__n__u1t256m3",
            "global_absmax__n__u3t256m3",
            "grad_quantize_first__b8g128sr_h32__u4t256m3__more",
        ] {
            assert_eq!(KernelSpec::from_entry(bad), None, "{bad}");
        }
    }

    fn specs_first() -> Constants {
        Constants::First {
            quant: quant(8, 128, true, true),
            hadamard_block: 32,
        }
    }

    /// The wrapper passes every pointer of the kernel table and instantiates the body.
    #[test]
    fn wrapper_instantiates_the_body() {
        let spec = KernelSpec::new(Kernel::GradQuantizeFirst, specs_first(), variant(4)).unwrap();
        assert_eq!(
            spec.source(),
            "#include \"grad_quantize_first.cu\"\n\n\
             extern \"C\" __global__ void __launch_bounds__(256, 3)\n\
             grad_quantize_first__b8g128sr_h32__u4t256m3(const float* bucket, \
             const uint32_t* dests, uint8_t* out, sdp_grad_first args)\n{\n    \
             grad_quantize_first_of<sdp_first_spec<sdp_quant_spec<8, 128, true, true>, 32, 4>>\
             (bucket, dests, out, args);\n}\n"
        );
    }

    /// Constants and variants the kernels cannot compile are errors, not specs.
    #[test]
    fn impossible_specs_are_errors() {
        let tiled = Constants::First {
            quant: quant(8, 4096, true, true),
            hadamard_block: 0,
        };
        assert!(KernelSpec::new(Kernel::GradQuantizeFirst, tiled, variant(1)).is_ok());
        assert!(KernelSpec::new(Kernel::GradQuantizeFirst, tiled, variant(2)).is_err());
        assert!(KernelSpec::new(Kernel::GradReduceFinal, specs_first(), variant(1)).is_err());
        let mut bad = variant(3);
        assert!(KernelSpec::new(Kernel::GradQuantizeFirst, specs_first(), bad).is_err());
        bad = Variant {
            threads: 96,
            ..variant(1)
        };
        assert!(KernelSpec::new(Kernel::GradQuantizeFirst, specs_first(), bad).is_err());
        let q = SdpQuant {
            bits: 5,
            group_size: 128,
            symmetric: 1,
            stochastic: 1,
        };
        assert!(Quant::of(&q).is_err());
        assert!(hadamard(64, quant(8, 96, true, true)).is_err());
        assert_eq!(peer_batch(3, quant(4, 128, true, true)), 4);
        assert_eq!(peer_batch(16, quant(4, 128, true, true)), MAX_PEER_BATCH);
        assert_eq!(peer_batch(16, quant(4, 4096, true, true)), TILED_PEER_BATCH);
        // Rows held with every peer's words: fewer peers at once for longer groups.
        assert_eq!(peer_batch(8, quant(8, 1024, false, true)), 2);
        assert_eq!(peer_batch(8, quant(8, 2048, false, true)), 1);
    }
}
