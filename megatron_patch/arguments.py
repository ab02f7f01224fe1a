"""Megatron-LM command-line flags for sdp4bit.

``add_arguments(parser)`` adds an ``sdp4bit`` argument group (usable as Megatron-LM's
``extra_args_provider``); ``config_from_args(args)`` turns the parsed flags into an
:class:`sdp4bit.Config`, or None when sdp4bit is off:

    --sdp4bit                         the SDP4Bit preset (qWD weights, TLq-HS gradients)
    --sdp4bit-preset NAME             one of the core's presets (sdp4bit.presets())
    --sdp4bit-<knob> VALUE            every knob of the core (sdp4bit.knobs()), its name with
                                      dashes, e.g. --sdp4bit-grad-inter-bits 4,
                                      --sdp4bit-weight-codec qw (ablations), --sdp4bit-seed 7
    --sdp4bit-ranks-per-node N        ranks per node (default: LOCAL_WORLD_SIZE)
    --sdp4bit-telemetry-interval N    report bytes and quantization error every N iterations
    --sdp4bit-replica-check-interval N
                                      every N iterations, check that the copies of parameters
                                      Megatron keeps identical across tensor-parallel ranks and
                                      pipeline stages are (megatron_core.check_replicated_params)
"""

from __future__ import annotations

import argparse

from sdp4bit import Config, knobs, presets


def _flag(knob_name: str) -> str:
    return "--sdp4bit-" + knob_name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the sdp4bit flags to `parser` (Megatron-LM's extra_args_provider signature)."""
    group = parser.add_argument_group("sdp4bit", "4-bit weight and gradient communication")
    group.add_argument("--sdp4bit", action="store_true",
                       help="compress the distributed optimizer's collectives with SDP4Bit")
    group.add_argument("--sdp4bit-preset", choices=presets(),
                       help="use this preset (implies --sdp4bit)")
    for knob in knobs():
        group.add_argument(_flag(knob.name), dest=f"sdp4bit_{knob.name}",
                           help=f"{knob.doc} ({knob.accepted()})")
    group.add_argument("--sdp4bit-ranks-per-node", type=int,
                       help="ranks per node (default: LOCAL_WORLD_SIZE)")
    group.add_argument("--sdp4bit-telemetry-interval", type=int, default=0,
                       help="every N iterations, log bytes sent and the quantization error "
                            "against an exact collective (costs one uncompressed collective "
                            "on those iterations; 0 = off)")
    group.add_argument("--sdp4bit-replica-check-interval", type=int, default=0,
                       help="every N iterations, check that the parameters Megatron keeps "
                            "identical across tensor-parallel ranks and the word embedding "
                            "tied across pipeline stages hold the same bits, naming the first "
                            "that differs (0 = off)")
    return parser


def config_from_args(args: argparse.Namespace) -> Config | None:
    """The config the flags ask for (validated by the Rust core), or None when sdp4bit is off.

    Raises ValueError for contradictory flags and Sdp4bitError for invalid knob values."""
    preset = getattr(args, "sdp4bit_preset", None)
    if getattr(args, "sdp4bit", False) and preset not in (None, "sdp4bit"):
        raise ValueError(f"--sdp4bit selects the sdp4bit preset; it contradicts "
                         f"--sdp4bit-preset {preset} (give one of them)")
    if getattr(args, "sdp4bit", False):
        preset = "sdp4bit"
    overrides = {knob.name: getattr(args, f"sdp4bit_{knob.name}") for knob in knobs()
                 if getattr(args, f"sdp4bit_{knob.name}", None) is not None}
    if preset is None:
        if overrides:
            flags = ", ".join(_flag(name) for name in overrides)
            raise ValueError(f"{flags} given without --sdp4bit or --sdp4bit-preset")
        return None
    return Config.from_knobs(preset, overrides).validate()  # raises Sdp4bitError naming the knob
