//! The route a gradient reduce-scatter takes (docs/numerics.md §5.3, §7), modelled
//! independently of `layout::GradRoute`.

use sdp4bit::layout::Topology;
use sdp4bit::{Config, GradCodec};

/// The route of one reduce-scatter and the bits of its quantizations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefRoute {
    /// W == 1.
    Copy,
    /// fp32 reduce-scatter (baseline codec, or before `grad_quant_start_step`).
    Exact,
    /// Global-QSGD with `bits`-bit integers.
    Global {
        /// Integer width.
        bits: u8,
    },
    /// One all-to-all over all W ranks at `bits`.
    OneLevel {
        /// Bits of the only quantization.
        bits: u8,
    },
    /// Intra-node at `intra` bits, then inter-node at `inter` bits.
    TwoLevel {
        /// Bits of the first (intra-node) quantization.
        intra: u8,
        /// Bits of the second (inter-node) quantization.
        inter: u8,
    },
}

/// The route `config` takes on `topo` at optimizer step `step`.
pub fn ref_route(config: &Config, topo: &Topology, step: u64) -> RefRoute {
    let g = &config.grad;
    let w = topo.world();
    if w == 1 {
        return RefRoute::Copy;
    }
    if g.codec == GradCodec::None || step < config.grad_quant_start_step {
        return RefRoute::Exact;
    }
    match g.codec {
        GradCodec::GlobalQsgd => RefRoute::Global {
            bits: g.global_bits.unwrap_or(if w <= 127 { 8 } else { 16 }),
        },
        GradCodec::Qsdp => RefRoute::OneLevel { bits: g.inter_bits },
        _ => match topo.per_node() {
            None => RefRoute::OneLevel { bits: g.inter_bits },
            Some(d) if d == w => RefRoute::OneLevel { bits: g.intra_bits },
            Some(1) => RefRoute::OneLevel { bits: g.inter_bits },
            Some(_) => RefRoute::TwoLevel {
                intra: g.intra_bits,
                inter: g.inter_bits,
            },
        },
    }
}
