//! Codec choices, presets and knobs: the one place where a configuration is built and validated.
//!
//! A [`Config`] starts from a [`Preset`] (which only picks defaults) and is refined with
//! `key=value` overrides ([`Config::set`]) of the knobs of [`KNOBS`], where each knob is
//! defined once: its name, accepted values, doc, the codecs it applies to, how it is read and
//! written. [`Config::validate`] checks the whole config; errors name the knob and the bad
//! value. [`Config::fingerprint`] is a stable 64-bit hash of the canonical form
//! ([`fmt::Display`]), so ranks can check that they agree before the first collective.

use std::fmt;
use std::hash::Hasher;
use std::str::FromStr;

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

/// Knobs of the gradient codec. Which knobs apply depends on the codec (see [`KNOBS`]).
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
    /// The all-reduce across the groups of hybrid sharding (docs/numerics.md §7.6):
    /// Global-QSGD with integers of this width, or `None` for the exact fp32 all-reduce.
    pub cross_group_bits: Option<u8>,
}

/// Largest group size accepted for any codec.
pub const MAX_GROUP_SIZE: usize = 1 << 16;
/// Largest number of pipeline chunks per bucket.
pub const MAX_PIPELINE_CHUNKS: usize = 64;
/// Group sizes must be multiples of this (one 16-byte line of 4-bit codes, 8 Philox blocks).
pub const GROUP_QUANTUM: usize = 32;
/// Default seed of every preset.
pub const DEFAULT_SEED: u64 = 1234;
/// The value of a knob left for the core to choose (`pipeline_chunks`, `global_qsgd_bits`).
pub const AUTO: &str = "auto";
/// The value of `cross_group_bits` that keeps the all-reduce across groups exact.
pub const EXACT: &str = "exact";

/// `cross_group_bits` as the gradient codec sets it: 8-bit Global-QSGD integers across the
/// groups when the reduce-scatter compresses, exact (fp32) when it does not.
pub fn cross_group_default(codec: GradCodec) -> Option<u8> {
    codec.compresses().then_some(8)
}

impl WeightCodec {
    /// Whether the all-gather is compressed (every codec but `none`).
    pub fn compresses(self) -> bool {
        self != Self::None
    }

    /// Whether every rank keeps a reference copy of the weights between steps (qWD's previous
    /// values), which integrations that free gathered parameters (ZeRO-3, FSDP2) cannot.
    pub fn keeps_reference(self) -> bool {
        self == Self::Qwd
    }
}

impl GradCodec {
    /// Whether the reduce-scatter is compressed (every codec but `none`).
    pub fn compresses(self) -> bool {
        self != Self::None
    }

    /// Whether this codec quantizes groups and exchanges them with all-to-alls.
    pub fn is_grouped(self) -> bool {
        matches!(self, Self::TlqHs | Self::Tlq | Self::Qsdp | Self::Zeropp)
    }

    /// Whether the codec runs two levels (intra-node, then inter-node) when the topology allows.
    pub fn is_two_level(self) -> bool {
        matches!(self, Self::TlqHs | Self::Tlq | Self::Zeropp)
    }
}

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
            cross_group_bits: cross_group_default(g),
        }
    }

    /// Builds a config from a preset and `(knob, value)` overrides applied in order, then
    /// validates it. Knob names are those of [`KNOBS`].
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

    /// Sets the knob of [`KNOBS`] named `key` from its textual value. A knob the current codecs
    /// do not use is an error rather than silently ignored; the value's range is checked by
    /// [`Config::validate`], so an override may pass through a value a later one corrects.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let knob = KNOBS.iter().find(|k| k.name == key).ok_or_else(|| {
            Error::Config(format!(
                "unknown knob '{key}' (value '{value}'); known knobs: {}",
                KNOBS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
            ))
        })?;
        knob.applies_to(self)
            .map_err(|codec| Error::Config(format!("knob '{key}' does not apply to {codec}")))?;
        (knob.set)(self, value.trim()).map_err(|e| Error::Config(format!("{key}='{value}': {e}")))
    }

    /// Checks every knob and every cross-knob rule, naming the first bad value: a knob that
    /// applies holds one of its accepted values, one that does not holds its codec's default.
    pub fn validate(&self) -> Result<()> {
        let defaults = Config {
            weight: WeightConfig::defaults(self.weight.codec),
            grad: GradConfig::defaults(self.grad.codec),
            ..*self
        };
        for knob in KNOBS {
            let value = (knob.get)(self);
            match knob.applies_to(self) {
                // `auto` leaves the value to the core: nothing to check.
                Ok(()) if value != AUTO && !knob.values.accepts(&value) => {
                    return Err(Error::Config(format!(
                        "{}={value} is not supported; allowed: {}",
                        knob.name, knob.values
                    )));
                }
                Err(codec) if value != (knob.get)(&defaults) => {
                    return Err(Error::Config(format!(
                        "{}={value} does not apply to {codec}",
                        knob.name
                    )));
                }
                _ => {}
            }
        }
        let grad = &self.grad;
        if let Some(block) = grad.hadamard_block
            && !grad.group_size.is_multiple_of(block)
        {
            return Err(Error::Config(format!(
                "grad_group_size={} must be a multiple of hadamard_block={block}",
                grad.group_size
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

    /// The value of every knob of [`KNOBS`] in this config, in its textual form, or `None`
    /// where the configured codecs do not use the knob.
    pub fn knob_values(&self) -> Vec<(&'static str, Option<String>)> {
        KNOBS
            .iter()
            .map(|knob| {
                let value = knob.applies_to(self).is_ok().then(|| (knob.get)(self));
                (knob.name, value)
            })
            .collect()
    }
}

/// The values a knob accepts, for front ends that present knobs as typed, documented fields
/// (the Python config, the Megatron flags, the DeepSpeed section); [`Config::validate`] checks
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

impl KnobValues {
    /// Whether `value` (text) is one of these.
    pub fn accepts(&self, value: &str) -> bool {
        match *self {
            Self::Names(names) => names.contains(&value),
            Self::Integers(values) => value.parse().is_ok_and(|v| values.contains(&v)),
            Self::Range {
                min,
                max,
                multiple_of,
            } => value
                .parse::<u64>()
                .is_ok_and(|v| (min..=max).contains(&v) && v.is_multiple_of(multiple_of)),
        }
    }
}

impl fmt::Display for KnobValues {
    /// As the Python config, the flags' help and docs/configuration.md show them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Names(names) => f.write_str(&names.join(", ")),
            Self::Integers(values) => {
                let values: Vec<String> = values.iter().map(u64::to_string).collect();
                f.write_str(&values.join(", "))
            }
            Self::Range {
                min,
                max,
                multiple_of,
            } => {
                match max {
                    u64::MAX => write!(f, "{min} or more")?,
                    _ => write!(f, "{min} to {max}")?,
                }
                match multiple_of {
                    1 => Ok(()),
                    _ => write!(f, ", multiple of {multiple_of}"),
                }
            }
        }
    }
}

/// Which configs a knob applies to. Where it does not, it keeps its codec's default, cannot
/// be set and reads as `None` in [`Config::knob_values`].
#[derive(Debug, Clone, Copy)]
pub enum Applies {
    /// Every config.
    Always,
    /// Configs whose weight codec passes the test.
    Weight(fn(WeightCodec) -> bool),
    /// Configs whose gradient codec passes the test.
    Grad(fn(GradCodec) -> bool),
}

/// One knob, the only place it is defined: its name, the values it accepts, what it does,
/// the configs it applies to, how its text is read into a config and how it is written.
#[derive(Debug, Clone, Copy)]
pub struct Knob {
    /// The name used in `key=value` overrides, Megatron flags (`--sdp4bit-<name>` with
    /// dashes) and the DeepSpeed config section.
    pub name: &'static str,
    /// What values it accepts.
    pub values: KnobValues,
    /// One sentence on what it does.
    pub doc: &'static str,
    /// Which configs use it.
    pub applies: Applies,
    /// Reads a trimmed value into the config, or says why it cannot be read.
    set: fn(&mut Config, &str) -> std::result::Result<(), String>,
    /// The knob's value as text, as `set` reads it.
    get: fn(&Config) -> String,
}

impl Knob {
    /// `Ok` when the knob applies to `config`, else the codec it does not apply to.
    fn applies_to(&self, config: &Config) -> std::result::Result<(), String> {
        match self.applies {
            Applies::Always => Ok(()),
            Applies::Weight(uses) if uses(config.weight.codec) => Ok(()),
            Applies::Grad(uses) if uses(config.grad.codec) => Ok(()),
            Applies::Weight(_) => Err(format!("weight codec '{}'", config.weight.codec)),
            Applies::Grad(_) => Err(format!("gradient codec '{}'", config.grad.codec)),
        }
    }
}

/// Parses a knob's value.
fn parse<T: FromStr>(value: &str) -> std::result::Result<T, String>
where
    T::Err: fmt::Display,
{
    value.parse().map_err(|e: T::Err| e.to_string())
}

/// Parses a value that may be [`AUTO`] (`None`).
fn parse_auto<T: FromStr>(value: &str) -> std::result::Result<Option<T>, String>
where
    T::Err: fmt::Display,
{
    match value {
        AUTO => Ok(None),
        _ => parse(value).map(Some),
    }
}

/// Writes a value that may be [`AUTO`] (`None`).
fn show_auto(value: Option<impl fmt::Display>) -> String {
    value.map_or(AUTO.to_string(), |v| v.to_string())
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

/// Every knob, codecs first (setting a codec resets that side's knobs to the codec's
/// defaults, so codecs are applied before the knobs they reset).
pub const KNOBS: &[Knob] = &[
    Knob {
        name: "weight_codec",
        values: KnobValues::Names(&["none", "qwd", "qw", "qsdp", "zeropp"]),
        doc: "codec of the parameter all-gather; resets the other weight knobs to its defaults",
        applies: Applies::Always,
        set: |c, v| {
            c.weight = WeightConfig::defaults(parse(v)?);
            Ok(())
        },
        get: |c| c.weight.codec.to_string(),
    },
    Knob {
        name: "grad_codec",
        values: KnobValues::Names(&["none", "tlq-hs", "tlq", "qsdp", "global-qsgd", "zeropp"]),
        doc: "codec of the gradient reduce-scatter; resets the other gradient knobs and \
              cross_group_bits to its defaults",
        applies: Applies::Always,
        set: |c, v| {
            c.grad = GradConfig::defaults(parse(v)?);
            c.cross_group_bits = cross_group_default(c.grad.codec);
            Ok(())
        },
        get: |c| c.grad.codec.to_string(),
    },
    Knob {
        name: "weight_bits",
        values: BITS,
        doc: "bits per weight code",
        applies: Applies::Weight(WeightCodec::compresses),
        set: |c, v| {
            c.weight.bits = parse(v)?;
            Ok(())
        },
        get: |c| c.weight.bits.to_string(),
    },
    Knob {
        name: "weight_group_size",
        values: GROUP_SIZES,
        doc: "weights sharing one quantization scale",
        applies: Applies::Weight(WeightCodec::compresses),
        set: |c, v| {
            c.weight.group_size = parse(v)?;
            Ok(())
        },
        get: |c| c.weight.group_size.to_string(),
    },
    Knob {
        name: "weight_rounding",
        values: ROUNDINGS,
        doc: "rounding of the weight codes",
        applies: Applies::Weight(WeightCodec::compresses),
        set: |c, v| {
            c.weight.rounding = parse(v)?;
            Ok(())
        },
        get: |c| c.weight.rounding.to_string(),
    },
    Knob {
        name: "grad_intra_bits",
        values: BITS,
        doc: "bits per gradient code inside a node (first level of two-level codecs)",
        applies: Applies::Grad(GradCodec::is_two_level),
        set: |c, v| {
            c.grad.intra_bits = parse(v)?;
            Ok(())
        },
        get: |c| c.grad.intra_bits.to_string(),
    },
    Knob {
        name: "grad_inter_bits",
        values: BITS,
        doc: "bits per gradient code between nodes (and of one-level routes)",
        applies: Applies::Grad(GradCodec::is_grouped),
        set: |c, v| {
            c.grad.inter_bits = parse(v)?;
            Ok(())
        },
        get: |c| c.grad.inter_bits.to_string(),
    },
    Knob {
        name: "grad_group_size",
        values: GROUP_SIZES,
        doc: "gradients sharing one quantization scale",
        applies: Applies::Grad(GradCodec::is_grouped),
        set: |c, v| {
            c.grad.group_size = parse(v)?;
            Ok(())
        },
        get: |c| c.grad.group_size.to_string(),
    },
    Knob {
        name: "hadamard_block",
        values: KnobValues::Integers(&[0, 16, 32, 64, 128, 256]),
        doc: "Walsh-Hadamard block applied before the first gradient quantization (0: off)",
        applies: Applies::Grad(GradCodec::is_two_level),
        set: |c, v| {
            c.grad.hadamard_block = Some(parse(v)?).filter(|&block| block != 0);
            Ok(())
        },
        get: |c| c.grad.hadamard_block.unwrap_or(0).to_string(),
    },
    Knob {
        name: "grad_rounding",
        values: ROUNDINGS,
        doc: "rounding of the gradient codes",
        applies: Applies::Grad(GradCodec::compresses),
        set: |c, v| {
            c.grad.rounding = parse(v)?;
            Ok(())
        },
        get: |c| c.grad.rounding.to_string(),
    },
    Knob {
        name: "global_qsgd_bits",
        values: KnobValues::Names(&[AUTO, "8", "16"]),
        doc: "Global-QSGD integer width (auto: 8 up to 127 ranks, else 16)",
        applies: Applies::Grad(|codec| codec == GradCodec::GlobalQsgd),
        set: |c, v| {
            c.grad.global_bits = parse_auto(v)?;
            Ok(())
        },
        get: |c| show_auto(c.grad.global_bits),
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
        applies: Applies::Always,
        set: |c, v| {
            c.pipeline_chunks = parse_auto(v)?;
            Ok(())
        },
        get: |c| show_auto(c.pipeline_chunks),
    },
    Knob {
        name: "grad_quant_start_step",
        values: ANY_U64,
        doc: "gradient reduction from which gradients are compressed (uncompressed before): \
              the optimizer step in Megatron and ZeRO 1, the reduction in ZeRO 2 (one per \
              micro-step) and the gradient sync in FSDP2",
        applies: Applies::Always,
        set: |c, v| {
            c.grad_quant_start_step = parse(v)?;
            Ok(())
        },
        get: |c| c.grad_quant_start_step.to_string(),
    },
    Knob {
        name: "seed",
        values: ANY_U64,
        doc: "seed of the stochastic-rounding random streams",
        applies: Applies::Always,
        set: |c, v| {
            c.seed = parse(v)?;
            Ok(())
        },
        get: |c| c.seed.to_string(),
    },
    Knob {
        name: "exact_params",
        values: KnobValues::Names(&["none", "replicated", "norms-biases-embeddings"]),
        doc: "parameters whose gradients and values travel exact beside the compressed bucket \
              (megatron-core): none, those replicated across tensor-parallel ranks, or those plus \
              every norm, bias and embedding table",
        applies: Applies::Always,
        set: |c, v| {
            c.exact_params = parse(v)?;
            Ok(())
        },
        get: |c| c.exact_params.to_string(),
    },
    Knob {
        name: "cross_group_bits",
        values: KnobValues::Names(&[EXACT, "8", "16"]),
        doc: "the gradient all-reduce across the groups of hybrid sharding (Megatron's \
              distributed-optimizer instances, FSDP2's replicate dimension): Global-QSGD \
              integers of 8 or 16 bits summed by the all-reduce, or exact (fp32); default 8 when \
              grad_codec compresses, exact when it is none",
        applies: Applies::Always,
        set: |c, v| {
            c.cross_group_bits = match v {
                EXACT => None,
                _ => Some(parse(v)?),
            };
            Ok(())
        },
        get: |c| {
            c.cross_group_bits
                .map_or(EXACT.to_string(), |b| b.to_string())
        },
    },
];

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
        if w.codec.compresses() {
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
            ";chunks={};grad_start={};seed={};exact={};cross={}",
            self.pipeline_chunks
                .map_or("auto".to_string(), |p| p.to_string()),
            self.grad_quant_start_step,
            self.seed,
            self.exact_params,
            self.cross_group_bits
                .map_or(EXACT.to_string(), |b| b.to_string())
        )
    }
}
