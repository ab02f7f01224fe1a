//! Codec choices, presets and knobs: the one place where a configuration is built and validated.
//!
//! A [`Config`] starts from a [`Preset`] (which only picks defaults) and is refined with
//! `key=value` overrides ([`Config::set`]). Every value is validated when it is set and the
//! whole config again by [`Config::validate`]; errors name the knob and the bad value.
//! [`Config::fingerprint`] is a stable 64-bit hash of the canonical form ([`fmt::Display`]),
//! so ranks can check that they agree before the first collective.

use std::fmt;
use std::hash::Hasher;
use std::str::FromStr;

use crate::codec::quant::QuantSpec;
use crate::error::{Error, Result};

/// How a real value is rounded to an integer code (docs/numerics.md §1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rounding {
    /// `floor(v + u)` with `u ~ U[0, 1)` from Philox: unbiased.
    Stochastic,
    /// Round to nearest, ties to even: biased, used by ablations and ZeRO++-style codecs.
    Nearest,
}

/// Codec for the bf16 parameter all-gather after each optimizer step (docs/numerics.md §4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightCodec {
    /// Uncompressed bf16 all-gather.
    None,
    /// SDP4Bit qWD: quantized difference from the previous parameters.
    Qwd,
    /// Direct symmetric quantization of the weights (the paper's qW ablation).
    Qw,
    /// QSDP: direct asymmetric (min-max) quantization.
    Qsdp,
    /// ZeRO++ qwZ-like: direct symmetric quantization with round-to-nearest.
    Zeropp,
}

/// Codec for the fp32 gradient reduce-scatter (docs/numerics.md §4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GradCodec {
    /// Uncompressed fp32 reduce-scatter.
    None,
    /// SDP4Bit TLq-HS: Hadamard, 8-bit intra-node, 4-bit inter-node.
    TlqHs,
    /// Two-level quantization without Hadamard (ablation).
    Tlq,
    /// QSDP: one-level asymmetric quantization over all ranks.
    Qsdp,
    /// Global-QSGD: one global scale, integers summed by a native reduce-scatter.
    GlobalQsgd,
    /// ZeRO++ qgZ-like: two-level 4-bit with round-to-nearest.
    Zeropp,
}

/// Which parameters an integration keeps out of the codecs, sending their gradient sums and
/// values exact beside the compressed bucket (docs/megatron.md, "Parameters kept exact"). The
/// core only validates it and agrees it across ranks (it is part of the fingerprint); the
/// megatron-core integration acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExactParams {
    /// Every parameter is compressed.
    None,
    /// Parameters replicated across tensor-parallel ranks (the default), which Megatron keeps
    /// bit-identical there.
    Replicated,
    /// Those, every norm and bias (1-D parameters) and the embedding tables.
    NormsBiasesEmbeddings,
}

/// Named starting points; a preset only chooses defaults, every knob stays settable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preset {
    /// qwd + tlq-hs.
    Sdp4bit,
    /// qsdp + qsdp.
    Qsdp,
    /// none + global-qsgd.
    GlobalQsgd,
    /// zeropp + zeropp.
    Zeropp,
    /// none + none.
    Baseline,
}

/// Knobs of the weight codec. Meaningless (and not part of the fingerprint) for `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeightConfig {
    /// Which codec.
    pub codec: WeightCodec,
    /// Bits per code (4 or 8).
    pub bits: u8,
    /// Elements sharing one scale.
    pub group_size: usize,
    /// Rounding of the codes.
    pub rounding: Rounding,
}

/// Knobs of the gradient codec. Which knobs apply depends on the codec (see [`Config::set`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GradConfig {
    /// Which codec.
    pub codec: GradCodec,
    /// Bits of the intra-node (first) level of two-level codecs.
    pub intra_bits: u8,
    /// Bits of traffic that crosses nodes: the second level of two-level codecs and the only
    /// level of one-level paths (QSDP, and two-level codecs degraded to one level).
    pub inter_bits: u8,
    /// Elements sharing one scale (both levels).
    pub group_size: usize,
    /// Walsh-Hadamard block applied before the first quantization, `None` when off.
    pub hadamard_block: Option<usize>,
    /// Rounding of the codes.
    pub rounding: Rounding,
    /// Integer width of Global-QSGD (8 or 16); `None` picks 8 while W <= 127, else 16.
    pub global_bits: Option<u8>,
}

/// A complete, validated configuration shared by every rank of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Config {
    /// Weight all-gather codec.
    pub weight: WeightConfig,
    /// Gradient reduce-scatter codec.
    pub grad: GradConfig,
    /// Pipeline chunks P per bucket, or `None` (the default) to let the plan choose P per
    /// bucket without changing its bytes (docs/numerics.md §5.4).
    pub pipeline_chunks: Option<usize>,
    /// Optimizer iteration from which gradients are quantized; earlier steps use the
    /// uncompressed fp32 reduce-scatter (a configured warm-up, not a fallback).
    pub grad_quant_start_step: u64,
    /// Training seed: the Philox key of every stochastic rounding.
    pub seed: u64,
    /// Parameters sent exact by the integrations that support it.
    pub exact_params: ExactParams,
}

/// Largest group size accepted for any codec.
pub const MAX_GROUP_SIZE: usize = 1 << 16;
/// Largest number of pipeline chunks per bucket.
pub const MAX_PIPELINE_CHUNKS: usize = 64;
/// Group sizes must be multiples of this (one 16-byte line of 4-bit codes, 8 Philox blocks).
pub const GROUP_QUANTUM: usize = 32;
/// Default seed of every preset.
pub const DEFAULT_SEED: u64 = 1234;

impl WeightConfig {
    /// The defaults of each weight codec (docs/numerics.md §4.1).
    pub fn defaults(codec: WeightCodec) -> Self {
        let (bits, group_size, rounding) = match codec {
            WeightCodec::None => (16, 0, Rounding::Nearest),
            WeightCodec::Qwd | WeightCodec::Qw => (4, 2048, Rounding::Stochastic),
            WeightCodec::Qsdp => (8, 1024, Rounding::Stochastic),
            WeightCodec::Zeropp => (8, 2048, Rounding::Nearest),
        };
        Self {
            codec,
            bits,
            group_size,
            rounding,
        }
    }

    /// The group quantizer this codec applies, `None` for the uncompressed codec.
    pub fn quant_spec(&self) -> Option<QuantSpec> {
        match self.codec {
            WeightCodec::None => None,
            codec => Some(QuantSpec {
                bits: self.bits,
                group_size: self.group_size,
                symmetric: codec != WeightCodec::Qsdp,
                rounding: self.rounding,
            }),
        }
    }
}

impl GradConfig {
    /// The defaults of each gradient codec (docs/numerics.md §4.2).
    pub fn defaults(codec: GradCodec) -> Self {
        let base = Self {
            codec,
            intra_bits: 8,
            inter_bits: 4,
            group_size: 128,
            hadamard_block: None,
            rounding: Rounding::Stochastic,
            global_bits: None,
        };
        match codec {
            GradCodec::TlqHs => Self {
                hadamard_block: Some(32),
                ..base
            },
            GradCodec::Tlq | GradCodec::GlobalQsgd => base,
            GradCodec::None => Self {
                intra_bits: 32,
                inter_bits: 32,
                group_size: 0,
                rounding: Rounding::Nearest,
                ..base
            },
            GradCodec::Qsdp => Self {
                intra_bits: 8,
                inter_bits: 8,
                group_size: 1024,
                ..base
            },
            GradCodec::Zeropp => Self {
                intra_bits: 4,
                inter_bits: 4,
                rounding: Rounding::Nearest,
                ..base
            },
        }
    }

    /// Whether this codec quantizes groups and exchanges them with all-to-alls.
    pub fn is_grouped(&self) -> bool {
        matches!(
            self.codec,
            GradCodec::TlqHs | GradCodec::Tlq | GradCodec::Qsdp | GradCodec::Zeropp
        )
    }

    /// Whether the codec runs two levels (intra-node, then inter-node) when the topology allows.
    pub fn is_two_level(&self) -> bool {
        matches!(
            self.codec,
            GradCodec::TlqHs | GradCodec::Tlq | GradCodec::Zeropp
        )
    }

    /// The quantizer of a level running at `bits`.
    pub fn quant_spec(&self, bits: u8) -> QuantSpec {
        QuantSpec {
            bits,
            group_size: self.group_size,
            symmetric: self.codec != GradCodec::Qsdp,
            rounding: self.rounding,
        }
    }
}

impl Config {
    /// The configuration a preset stands for, with the default seed.
    pub fn preset(preset: Preset) -> Self {
        let (w, g) = match preset {
            Preset::Sdp4bit => (WeightCodec::Qwd, GradCodec::TlqHs),
            Preset::Qsdp => (WeightCodec::Qsdp, GradCodec::Qsdp),
            Preset::GlobalQsgd => (WeightCodec::None, GradCodec::GlobalQsgd),
            Preset::Zeropp => (WeightCodec::Zeropp, GradCodec::Zeropp),
            Preset::Baseline => (WeightCodec::None, GradCodec::None),
        };
        Self {
            weight: WeightConfig::defaults(w),
            grad: GradConfig::defaults(g),
            pipeline_chunks: None,
            grad_quant_start_step: 0,
            seed: DEFAULT_SEED,
            exact_params: ExactParams::Replicated,
        }
    }

    /// Builds a config from a preset and `(knob, value)` overrides applied in order, then
    /// validates it. Knob names are those of [`Config::set`].
    pub fn from_overrides<'a>(
        preset: Preset,
        overrides: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self> {
        let mut config = Self::preset(preset);
        for (key, value) in overrides {
            config.set(key, value)?;
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets one knob from its textual value.
    ///
    /// Knobs: `weight_codec` (none|qwd|qw|qsdp|zeropp; resets the weight knobs to that
    /// codec's defaults), `weight_bits`, `weight_group_size`, `weight_rounding`
    /// (stochastic|nearest), `grad_codec` (none|tlq-hs|tlq|qsdp|global-qsgd|zeropp; resets the
    /// gradient knobs), `grad_intra_bits`, `grad_inter_bits`, `grad_group_size`,
    /// `hadamard_block` (0 = off), `grad_rounding`, `global_qsgd_bits` (auto|8|16),
    /// `pipeline_chunks`, `grad_quant_start_step`, `seed`, `exact_params`
    /// (none|replicated|norms-biases-embeddings). A knob the current codec does not use is an
    /// error rather than silently ignored.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let w = self.weight.codec;
        let g = self.grad.codec;
        let grouped_weight = w != WeightCodec::None;
        match key {
            "weight_codec" => self.weight = WeightConfig::defaults(parse(key, value)?),
            "grad_codec" => self.grad = GradConfig::defaults(parse(key, value)?),
            "weight_bits" => {
                require(grouped_weight, key, "weight codec", w)?;
                self.weight.bits = parse_bits(key, value, &[4, 8])?;
            }
            "weight_group_size" => {
                require(grouped_weight, key, "weight codec", w)?;
                self.weight.group_size = parse(key, value)?;
            }
            "weight_rounding" => {
                require(grouped_weight, key, "weight codec", w)?;
                self.weight.rounding = parse(key, value)?;
            }
            "grad_intra_bits" => {
                require(self.grad.is_two_level(), key, "gradient codec", g)?;
                self.grad.intra_bits = parse_bits(key, value, &[4, 8])?;
            }
            "grad_inter_bits" => {
                require(self.grad.is_grouped(), key, "gradient codec", g)?;
                self.grad.inter_bits = parse_bits(key, value, &[4, 8])?;
            }
            "grad_group_size" => {
                require(self.grad.is_grouped(), key, "gradient codec", g)?;
                self.grad.group_size = parse(key, value)?;
            }
            "hadamard_block" => {
                require(self.grad.is_two_level(), key, "gradient codec", g)?;
                let block: usize = parse(key, value)?;
                self.grad.hadamard_block = (block != 0).then_some(block);
            }
            "grad_rounding" => {
                require(g != GradCodec::None, key, "gradient codec", g)?;
                self.grad.rounding = parse(key, value)?;
            }
            "global_qsgd_bits" => {
                require(g == GradCodec::GlobalQsgd, key, "gradient codec", g)?;
                self.grad.global_bits = match value {
                    "auto" => None,
                    _ => Some(parse_bits(key, value, &[8, 16])?),
                };
            }
            "pipeline_chunks" => {
                self.pipeline_chunks = match value {
                    "auto" => None,
                    _ => Some(parse(key, value)?),
                }
            }
            "grad_quant_start_step" => self.grad_quant_start_step = parse(key, value)?,
            "seed" => self.seed = parse(key, value)?,
            "exact_params" => self.exact_params = parse(key, value)?,
            _ => {
                return Err(Error::Config(format!(
                    "unknown knob '{key}' (value '{value}'); known knobs: {}",
                    KNOBS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
                )));
            }
        }
        Ok(())
    }

    /// Checks every knob and every cross-knob rule, naming the first bad value.
    pub fn validate(&self) -> Result<()> {
        if let Some(spec) = self.weight.quant_spec() {
            check_bits("weight_bits", spec.bits, &[4, 8])?;
            check_group("weight_group_size", spec.group_size)?;
        }
        if self.grad.is_grouped() {
            check_bits("grad_intra_bits", self.grad.intra_bits, &[4, 8])?;
            check_bits("grad_inter_bits", self.grad.inter_bits, &[4, 8])?;
            check_group("grad_group_size", self.grad.group_size)?;
        }
        if let Some(block) = self.grad.hadamard_block {
            if !self.grad.is_two_level() {
                return Err(Error::Config(format!(
                    "hadamard_block={block} is only supported by two-level gradient codecs, not {}",
                    self.grad.codec
                )));
            }
            if !crate::hadamard::is_supported_block(block) {
                return Err(Error::Config(format!(
                    "hadamard_block={block} must be a power of two from 16 to 256"
                )));
            }
            if !self.grad.group_size.is_multiple_of(block) {
                return Err(Error::Config(format!(
                    "grad_group_size={} must be a multiple of hadamard_block={block}",
                    self.grad.group_size
                )));
            }
        }
        if let Some(bits) = self.grad.global_bits {
            check_bits("global_qsgd_bits", bits, &[8, 16])?;
        }
        if let Some(chunks) = self.pipeline_chunks
            && !(1..=MAX_PIPELINE_CHUNKS).contains(&chunks)
        {
            return Err(Error::Config(format!(
                "pipeline_chunks={chunks} must be between 1 and {MAX_PIPELINE_CHUNKS} (or auto)"
            )));
        }
        Ok(())
    }

    /// Stable 64-bit FNV-1a hash of the canonical form; equal on every rank iff the configs
    /// agree, and unchanged across runs, machines and builds.
    pub fn fingerprint(&self) -> u64 {
        let mut hasher = fnv::FnvHasher::default();
        hasher.write(self.to_string().as_bytes());
        hasher.finish()
    }
}

/// The values a knob accepts, for front ends that present knobs as typed, documented fields
/// (the Python config, the Megatron flags, the DeepSpeed section); [`Config::set`] checks
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnobValues {
    /// One of these names.
    Names(&'static [&'static str]),
    /// One of these integers.
    Integers(&'static [u64]),
    /// An integer from `min` to `max` that is a multiple of `multiple_of`.
    Range {
        /// Smallest value.
        min: u64,
        /// Largest value.
        max: u64,
        /// Step between accepted values.
        multiple_of: u64,
    },
}

/// One knob of [`Config::set`]: its name, the values it accepts and what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knob {
    /// The name used in `key=value` overrides, Megatron flags (`--sdp4bit-<name>` with
    /// dashes) and the DeepSpeed config section.
    pub name: &'static str,
    /// What values it accepts.
    pub values: KnobValues,
    /// One sentence on what it does.
    pub doc: &'static str,
}

const GROUP_SIZES: KnobValues = KnobValues::Range {
    min: GROUP_QUANTUM as u64,
    max: MAX_GROUP_SIZE as u64,
    multiple_of: GROUP_QUANTUM as u64,
};
const BITS: KnobValues = KnobValues::Integers(&[4, 8]);
const ROUNDINGS: KnobValues = KnobValues::Names(&["stochastic", "nearest"]);
const ANY_U64: KnobValues = KnobValues::Range {
    min: 0,
    max: u64::MAX,
    multiple_of: 1,
};

/// Every knob [`Config::set`] accepts, codecs first (setting a codec resets that side's knobs
/// to the codec's defaults, so codecs are applied before the knobs they reset).
pub const KNOBS: &[Knob] = &[
    Knob {
        name: "weight_codec",
        values: KnobValues::Names(&["none", "qwd", "qw", "qsdp", "zeropp"]),
        doc: "codec of the parameter all-gather; resets the other weight knobs to its defaults",
    },
    Knob {
        name: "grad_codec",
        values: KnobValues::Names(&["none", "tlq-hs", "tlq", "qsdp", "global-qsgd", "zeropp"]),
        doc: "codec of the gradient reduce-scatter; resets the other gradient knobs to its defaults",
    },
    Knob {
        name: "weight_bits",
        values: BITS,
        doc: "bits per weight code",
    },
    Knob {
        name: "weight_group_size",
        values: GROUP_SIZES,
        doc: "weights sharing one quantization scale",
    },
    Knob {
        name: "weight_rounding",
        values: ROUNDINGS,
        doc: "rounding of the weight codes",
    },
    Knob {
        name: "grad_intra_bits",
        values: BITS,
        doc: "bits per gradient code inside a node (first level of two-level codecs)",
    },
    Knob {
        name: "grad_inter_bits",
        values: BITS,
        doc: "bits per gradient code between nodes (and of one-level routes)",
    },
    Knob {
        name: "grad_group_size",
        values: GROUP_SIZES,
        doc: "gradients sharing one quantization scale",
    },
    Knob {
        name: "hadamard_block",
        values: KnobValues::Integers(&[0, 16, 32, 64, 128, 256]),
        doc: "Walsh-Hadamard block applied before the first gradient quantization (0: off)",
    },
    Knob {
        name: "grad_rounding",
        values: ROUNDINGS,
        doc: "rounding of the gradient codes",
    },
    Knob {
        name: "global_qsgd_bits",
        values: KnobValues::Names(&["auto", "8", "16"]),
        doc: "Global-QSGD integer width (auto: 8 up to 127 ranks, else 16)",
    },
    Knob {
        name: "pipeline_chunks",
        values: KnobValues::Range {
            min: 1,
            max: MAX_PIPELINE_CHUNKS as u64,
            multiple_of: 1,
        },
        doc: "chunks each gradient bucket is exchanged in, pipelined (default auto: chosen per \
              bucket among the counts that leave its bytes unchanged)",
    },
    Knob {
        name: "grad_quant_start_step",
        values: ANY_U64,
        doc: "optimizer step from which gradients are compressed (uncompressed before)",
    },
    Knob {
        name: "seed",
        values: ANY_U64,
        doc: "seed of the stochastic-rounding random streams",
    },
    Knob {
        name: "exact_params",
        values: KnobValues::Names(&["none", "replicated", "norms-biases-embeddings"]),
        doc: "parameters whose gradients and values travel exact beside the compressed bucket \
              (megatron-core): none, those replicated across tensor-parallel ranks, or those plus \
              every norm, bias and embedding table",
    },
];

impl Config {
    /// The value of every knob of [`KNOBS`] in this config, in its textual form, or `None`
    /// where the configured codec does not use the knob.
    pub fn knob_values(&self) -> Vec<(&'static str, Option<String>)> {
        let (w, g) = (&self.weight, &self.grad);
        let weighted = w.codec != WeightCodec::None;
        let grouped = g.is_grouped();
        let two_level = g.is_two_level();
        KNOBS
            .iter()
            .map(|knob| {
                let value = match knob.name {
                    "weight_codec" => Some(w.codec.to_string()),
                    "grad_codec" => Some(g.codec.to_string()),
                    "weight_bits" => weighted.then(|| w.bits.to_string()),
                    "weight_group_size" => weighted.then(|| w.group_size.to_string()),
                    "weight_rounding" => weighted.then(|| w.rounding.to_string()),
                    "grad_intra_bits" => two_level.then(|| g.intra_bits.to_string()),
                    "grad_inter_bits" => grouped.then(|| g.inter_bits.to_string()),
                    "grad_group_size" => grouped.then(|| g.group_size.to_string()),
                    "hadamard_block" => {
                        two_level.then(|| g.hadamard_block.unwrap_or(0).to_string())
                    }
                    "grad_rounding" => (g.codec != GradCodec::None).then(|| g.rounding.to_string()),
                    "global_qsgd_bits" => (g.codec == GradCodec::GlobalQsgd)
                        .then(|| g.global_bits.map_or("auto".to_string(), |b| b.to_string())),
                    "pipeline_chunks" => Some(
                        self.pipeline_chunks
                            .map_or("auto".to_string(), |p| p.to_string()),
                    ),
                    "grad_quant_start_step" => Some(self.grad_quant_start_step.to_string()),
                    "seed" => Some(self.seed.to_string()),
                    "exact_params" => Some(self.exact_params.to_string()),
                    other => unreachable!("knob {other} has no value"),
                };
                (knob.name, value)
            })
            .collect()
    }
}

fn require(applies: bool, key: &str, what: &str, codec: impl fmt::Display) -> Result<()> {
    if applies {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "knob '{key}' does not apply to {what} '{codec}'"
        )))
    }
}

fn parse<T: FromStr>(key: &str, value: &str) -> Result<T>
where
    T::Err: fmt::Display,
{
    value
        .trim()
        .parse()
        .map_err(|e| Error::Config(format!("{key}='{value}': {e}")))
}

fn parse_bits(key: &str, value: &str, allowed: &[u8]) -> Result<u8> {
    let bits = parse(key, value)?;
    check_bits(key, bits, allowed)?;
    Ok(bits)
}

fn check_bits(key: &str, bits: u8, allowed: &[u8]) -> Result<()> {
    if allowed.contains(&bits) {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "{key}={bits} is not supported; allowed: {allowed:?}"
        )))
    }
}

fn check_group(key: &str, group: usize) -> Result<()> {
    if group == 0 || !group.is_multiple_of(GROUP_QUANTUM) || group > MAX_GROUP_SIZE {
        return Err(Error::Config(format!(
            "{key}={group} must be a positive multiple of {GROUP_QUANTUM} and at most {MAX_GROUP_SIZE}"
        )));
    }
    Ok(())
}

macro_rules! named_enum {
    ($ty:ident, $what:literal, $($variant:ident => $name:literal),+ $(,)?) => {
        impl $ty {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The canonical lowercase name used in flags, configs and fingerprints.
            pub fn name(self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> std::result::Result<Self, String> {
                let wanted = s.trim().to_ascii_lowercase().replace('_', "-");
                $ty::ALL
                    .iter()
                    .copied()
                    .find(|v| v.name() == wanted)
                    .ok_or_else(|| {
                        let names: Vec<_> = $ty::ALL.iter().map(|v| v.name()).collect();
                        format!("unknown {} '{}'; expected one of {}", $what, s, names.join(", "))
                    })
            }
        }
    };
}

named_enum!(Rounding, "rounding", Stochastic => "stochastic", Nearest => "nearest");
named_enum!(WeightCodec, "weight codec",
    None => "none", Qwd => "qwd", Qw => "qw", Qsdp => "qsdp", Zeropp => "zeropp");
named_enum!(GradCodec, "gradient codec",
    None => "none", TlqHs => "tlq-hs", Tlq => "tlq", Qsdp => "qsdp",
    GlobalQsgd => "global-qsgd", Zeropp => "zeropp");
named_enum!(ExactParams, "exact_params value",
    None => "none", Replicated => "replicated", NormsBiasesEmbeddings => "norms-biases-embeddings");
named_enum!(Preset, "preset",
    Sdp4bit => "sdp4bit", Qsdp => "qsdp", GlobalQsgd => "global-qsgd",
    Zeropp => "zeropp", Baseline => "baseline");

impl fmt::Display for Config {
    /// The canonical form hashed by [`Config::fingerprint`]: every knob that affects the
    /// bytes on the wire, and nothing that does not.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = &self.weight;
        write!(f, "sdp4bit-config-v1;weight={}", w.codec)?;
        if w.codec != WeightCodec::None {
            write!(
                f,
                "(bits={},group={},rounding={})",
                w.bits, w.group_size, w.rounding
            )?;
        }
        let g = &self.grad;
        write!(f, ";grad={}", g.codec)?;
        match g.codec {
            GradCodec::None => {}
            GradCodec::GlobalQsgd => {
                let bits = g.global_bits.map_or("auto".to_string(), |b| b.to_string());
                write!(f, "(bits={bits},rounding={})", g.rounding)?;
            }
            GradCodec::Qsdp => write!(
                f,
                "(bits={},group={},rounding={})",
                g.inter_bits, g.group_size, g.rounding
            )?,
            _ => write!(
                f,
                "(intra_bits={},inter_bits={},group={},hadamard={},rounding={})",
                g.intra_bits,
                g.inter_bits,
                g.group_size,
                g.hadamard_block.unwrap_or(0),
                g.rounding
            )?,
        }
        write!(
            f,
            ";chunks={};grad_start={};seed={};exact={}",
            self.pipeline_chunks
                .map_or("auto".to_string(), |p| p.to_string()),
            self.grad_quant_start_step,
            self.seed,
            self.exact_params
        )
    }
}
