"""Runs an unmodified Megatron-LM training script with the sdp4bit flags:

    torchrun ... -m megatron_patch pretrain_gpt.py --sdp4bit [--sdp4bit-...] <Megatron flags>

Before the script runs, Megatron-LM's ``parse_args`` is wrapped so that its parser also gets
the sdp4bit flags (:mod:`megatron_patch.arguments`, composed with the script's own
``extra_args_provider``) and, once the flags are parsed, they are checked (contradictions,
Megatron-LM flags sdp4bit cannot run with, the node size: the job stops there, on every rank,
before any process group exists) and sdp4bit is enabled for the distributed optimizer (before
any model is built), numbering its random streams by ``args.iteration`` so that a resumed run
continues where it stopped. Its start-up line shows once per job: on rank 0 (the launcher's
``RANK``, as the process group does not exist yet), and not again when the script parses the
same flags a second time. Scripts that build their own parser can instead call
:func:`megatron_patch.arguments.add_arguments` and :func:`megatron_patch.megatron_core.enable`
themselves (the one-import usage in the README).
"""

from __future__ import annotations

import functools
import sys

from sdp4bit._launch import run_script

from . import megatron_core
from .arguments import add_arguments, config_from_args, ranks_per_node

# The config and options the wrapped parse_args last enabled sdp4bit with (Megatron-LM may
# parse its arguments more than once per job), or None.
_enabled_with = None


def _compose(extra_args_provider):
    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_arguments(parser)

    return provider


def _wrap(parse_args):
    @functools.wraps(parse_args)
    def parse_args_with_sdp4bit(extra_args_provider=None, *args, **kwargs):
        global _enabled_with
        parsed = parse_args(_compose(extra_args_provider), *args, **kwargs)
        config = config_from_args(parsed)  # raises for what the arguments already refuse
        if config is None:
            return parsed
        options = dict(local_world_size=ranks_per_node(parsed),
                       telemetry_interval=parsed.sdp4bit_telemetry_interval,
                       replica_check_interval=parsed.sdp4bit_replica_check_interval)
        enabled_with = (config.spec(), sorted(options.items()))
        if megatron_core.is_enabled() and _enabled_with == enabled_with:
            return parsed
        megatron_core.enable(config, iteration=_megatron_iteration,
                             tensorboard_writer=_megatron_tensorboard_writer,
                             wandb_writer=_megatron_wandb_writer, **options)
        _enabled_with = enabled_with
        return parsed

    parse_args_with_sdp4bit.sdp4bit_original = parse_args
    return parse_args_with_sdp4bit


def _megatron_iteration() -> int:
    from megatron.training.global_vars import get_args

    return int(getattr(get_args(), "iteration", 0) or 0)


def _megatron_tensorboard_writer():
    from megatron.training.global_vars import get_tensorboard_writer

    return get_tensorboard_writer()


def _megatron_wandb_writer():
    from megatron.training.global_vars import get_wandb_writer

    return get_wandb_writer()


def install() -> None:
    """Wraps ``megatron.training.arguments.parse_args`` and every already-imported
    ``megatron.training`` module's reference to it (``initialize`` imports it by name)."""
    import megatron.training.arguments as arguments

    original = getattr(arguments.parse_args, "sdp4bit_original", arguments.parse_args)
    wrapped = _wrap(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.training") and getattr(module, "parse_args", None) is original:
            module.parse_args = wrapped
    arguments.parse_args = wrapped


def main(argv: list[str]) -> None:
    """``python -m megatron_patch SCRIPT [ARGS...]``: runs SCRIPT as ``__main__``, with its
    directory first on ``sys.path`` as ``python SCRIPT`` has it, so that the Megatron-LM
    checkout the script lives in provides ``megatron.training`` from any working directory."""
    run_script("megatron_patch", __doc__, argv, _install_from_the_checkout)


def _install_from_the_checkout() -> None:
    """:func:`install`, or one line saying where Megatron-LM's training package must come from."""
    try:
        install()
    except ModuleNotFoundError as error:
        raise SystemExit(
            f"megatron_patch: cannot import Megatron-LM's megatron.training ({error}): run a "
            "script of a Megatron-LM checkout, or put the checkout on PYTHONPATH") from error
