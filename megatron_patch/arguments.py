"""Megatron-LM command-line flags for sdp4bit.

``add_arguments(parser)`` adds an ``sdp4bit`` argument group (usable as Megatron-LM's
``extra_args_provider``); ``config_from_args(args)`` turns the parsed flags into an
:class:`sdp4bit.Config`, or None when sdp4bit is off, and refuses, as the arguments are parsed,
what they already decide sdp4bit cannot run with; ``ranks_per_node(args)`` is the node size:

    --sdp4bit                         the SDP4Bit preset (qWD weights, TLq-HS gradients)
    --sdp4bit-preset NAME             one of the core's presets (sdp4bit.presets())
    --sdp4bit-<knob> VALUE            every knob of the core (sdp4bit.knobs()), its name with
                                      dashes, e.g. --sdp4bit-grad-inter-bits 4,
                                      --sdp4bit-weight-codec qw (ablations), --sdp4bit-seed 7
    --sdp4bit-ranks-per-node N        ranks per node (default: the launcher's LOCAL_WORLD_SIZE,
                                      LOCAL_SIZE or SLURM's tasks per node)
    --sdp4bit-telemetry-interval N    report bytes and quantization error every N iterations
    --sdp4bit-replica-check-interval N
                                      every N iterations, check that the copies of parameters
                                      Megatron keeps identical across tensor-parallel ranks and
                                      pipeline stages are (megatron_core.check_replicated_params)
"""

from __future__ import annotations

import argparse

from sdp4bit import Config, Sdp4bitError, knobs, presets
from sdp4bit.groups import NODE_SIZE_VARIABLES, node_size

#: The flag that sets the node size, which errors about it name.
RANKS_PER_NODE = "--sdp4bit-ranks-per-node"


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
    group.add_argument(RANKS_PER_NODE, type=int,
                       help="ranks per node (default: the first of the launcher variables "
                            f"{', '.join(NODE_SIZE_VARIABLES)} that is set)")
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

    Raises ValueError for contradictory flags and Sdp4bitError for invalid knob values. Where
    sdp4bit is on, also raises what would otherwise stop the job only once it runs: Sdp4bitError
    for Megatron-LM flags sdp4bit cannot run with (:func:`refusals`), ValueError when the node
    size is unknown (:func:`ranks_per_node`)."""
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
    config = Config.from_knobs(preset, overrides).validate()  # raises Sdp4bitError naming the knob
    problems = refusals(args, config)
    if problems:
        raise Sdp4bitError("sdp4bit cannot run with these Megatron-LM flags: "
                           + "; ".join(problems))
    ranks_per_node(args)
    return config


def ranks_per_node(args: argparse.Namespace) -> int:
    """The ranks per node: ``--sdp4bit-ranks-per-node``, else the launcher's (torchrun's
    ``LOCAL_WORLD_SIZE``, DeepSpeed's ``LOCAL_SIZE``, SLURM's tasks per node,
    :func:`sdp4bit.groups.node_size`); ValueError naming the flag when neither says."""
    return node_size(getattr(args, "sdp4bit_ranks_per_node", None), RANKS_PER_NODE)


def refusals(args: argparse.Namespace, config: Config) -> list[str]:
    """What the parsed Megatron-LM flags `args` already decide sdp4bit with `config` cannot
    compress, one line each naming the flag and what to change: the refusals megatron-core's
    integration makes when the model is built (docs/megatron.md), raised here before the job
    starts. A flag the namespace lacks (a script with a parser of its own) decides nothing;
    the model-level refusals still apply."""
    def flag(name: str) -> bool | None:
        return getattr(args, name, None)

    problems = []
    if flag("use_distributed_optimizer") is False:
        problems.append("without --use-distributed-optimizer there is no reduce-scatter or "
                        "all-gather for sdp4bit to compress: pass --use-distributed-optimizer")
    for name, given in (("use_torch_fsdp2", "--use-torch-fsdp2"),
                        ("use_megatron_fsdp", "--use-megatron-fsdp"),
                        ("use_custom_fsdp", "--use-custom-fsdp")):
        if flag(name):
            problems.append(f"{given} runs collectives sdp4bit does not compress: drop it and "
                            "use --use-distributed-optimizer (or sdp4bit.fsdp, outside Megatron)")
    if flag("fp8_param_gather"):
        problems.append("--fp8-param-gather all-gathers FP8 parameters; sdp4bit compresses bf16 "
                        "parameters: drop --fp8-param-gather")
    if flag("reuse_grad_buf_for_mxfp8_param_ag"):
        problems.append("--reuse-grad-buf-for-mxfp8-param-ag gathers MXFP8 parameters through "
                        "the gradient buffer, which sdp4bit does not compress: drop it")
    if flag("fp16") and flag("accumulate_allreduce_grads_in_fp32") is False:
        problems.append("--fp16 without --accumulate-allreduce-grads-in-fp32 reduces fp16 "
                        "gradients; sdp4bit reduces fp32 or bf16 ones: train with --bf16 or "
                        "pass --accumulate-allreduce-grads-in-fp32")
    if config.compresses_weights and flag("bf16") is False:
        dtype = "fp16" if flag("fp16") else "fp32"
        problems.append(f"the weight codec all-gathers bf16 parameters and these are {dtype}: "
                        "train with --bf16, or pass --sdp4bit-weight-codec none")
    return problems
