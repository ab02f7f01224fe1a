"""Megatron-LM command-line flags for sdp4bit.

``add_arguments(parser)`` adds an ``sdp4bit`` argument group (usable as Megatron-LM's
``extra_args_provider``); ``config_from_args(args)`` turns the parsed flags into an
:class:`Sdp4bitConfig`, or None when sdp4bit is off:

    --sdp4bit                         the SDP4Bit preset (qWD weights, TLq-HS gradients)
    --sdp4bit-preset NAME             sdp4bit | qsdp | global-qsgd | zeropp | baseline
    --sdp4bit-weight-codec NAME       ablations: none | qwd | qw | qsdp | zeropp
    --sdp4bit-grad-codec NAME         ablations: none | tlq-hs | tlq | qsdp | global-qsgd | zeropp
    --sdp4bit-<knob> VALUE            every other knob (bits, group sizes, Hadamard block,
                                      rounding, pipeline chunks, ...)
    --sdp4bit-seed N                  the random streams' seed
    --sdp4bit-grad-quant-start-iter N gradients are sent uncompressed before iteration N
    --sdp4bit-ranks-per-node N        ranks per node (default: LOCAL_WORLD_SIZE)
    --sdp4bit-telemetry-interval N    report bytes and quantization error every N iterations
"""

from __future__ import annotations

import argparse

from .config import PRESETS, Sdp4bitConfig

#: (flag suffix, knob, help) for every knob with its own flag; codecs first, since setting a
#: codec resets that side's knobs to the codec's defaults.
_KNOB_FLAGS = (
    ("weight-codec", "weight_codec", "weight codec: none|qwd|qw|qsdp|zeropp"),
    ("grad-codec", "grad_codec", "gradient codec: none|tlq-hs|tlq|qsdp|global-qsgd|zeropp"),
    ("weight-bits", "weight_bits", "weight code width (4 or 8)"),
    ("weight-group-size", "weight_group_size", "elements per weight quantization group"),
    ("weight-rounding", "weight_rounding", "stochastic|nearest"),
    ("grad-intra-bits", "grad_intra_bits", "gradient bits inside a node"),
    ("grad-inter-bits", "grad_inter_bits", "gradient bits between nodes"),
    ("grad-group-size", "grad_group_size", "elements per gradient quantization group"),
    ("hadamard-block", "hadamard_block", "Hadamard block size (16-256, 0 = off)"),
    ("grad-rounding", "grad_rounding", "stochastic|nearest"),
    ("global-qsgd-bits", "global_qsgd_bits", "Global-QSGD integer width: auto|8|16"),
    ("pipeline-chunks", "pipeline_chunks", "chunks each gradient bucket is sent in"),
    ("grad-quant-start-iter", "grad_quant_start_step",
     "iteration from which gradients are compressed (uncompressed before)"),
    ("seed", "seed", "seed of the stochastic-rounding random streams"),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the sdp4bit flags to `parser` (Megatron-LM's extra_args_provider signature)."""
    group = parser.add_argument_group("sdp4bit", "4-bit weight and gradient communication")
    group.add_argument("--sdp4bit", action="store_true",
                       help="compress the distributed optimizer's collectives with SDP4Bit")
    group.add_argument("--sdp4bit-preset", choices=PRESETS,
                       help="use this preset (implies --sdp4bit)")
    for suffix, knob, text in _KNOB_FLAGS:
        group.add_argument(f"--sdp4bit-{suffix}", dest=f"sdp4bit_{knob}", help=text)
    group.add_argument("--sdp4bit-ranks-per-node", type=int,
                       help="ranks per node (default: LOCAL_WORLD_SIZE)")
    group.add_argument("--sdp4bit-telemetry-interval", type=int, default=0,
                       help="every N iterations, log bytes sent and the quantization error "
                            "against an exact collective (costs one uncompressed collective "
                            "on those iterations; 0 = off)")
    return parser


def config_from_args(args: argparse.Namespace) -> Sdp4bitConfig | None:
    """The config the flags ask for (validated by the Rust core), or None when sdp4bit is off.

    Raises ValueError for contradictory flags and Sdp4bitError for invalid knob values."""
    preset = getattr(args, "sdp4bit_preset", None)
    if getattr(args, "sdp4bit", False) and preset not in (None, "sdp4bit"):
        raise ValueError(f"--sdp4bit selects the sdp4bit preset; it contradicts "
                         f"--sdp4bit-preset {preset} (give one of them)")
    if getattr(args, "sdp4bit", False):
        preset = "sdp4bit"
    knobs = {knob: getattr(args, f"sdp4bit_{knob}") for _, knob, _ in _KNOB_FLAGS
             if getattr(args, f"sdp4bit_{knob}", None) is not None}
    if preset is None:
        if knobs:
            flags = ", ".join(f"--sdp4bit-{s}" for s, k, _ in _KNOB_FLAGS if k in knobs)
            raise ValueError(f"{flags} given without --sdp4bit or --sdp4bit-preset")
        return None
    config = Sdp4bitConfig(preset, knobs)
    config.describe()  # validates: raises Sdp4bitError naming the knob
    return config
