"""megatron-core integration: the distributed optimizer's gradient reduce-scatter and
parameter all-gather go through sdp4bit.

``enable(config)`` patches ``_ParamAndGradBucketGroup.start_grad_sync`` and
``start_param_sync`` (megatron-core 0.16 to 0.19): for every bucket group of a DDP model using
the distributed optimizer, each bucket's reduce-scatter and all-gather run as a compressed
collective on sdp4bit's thread and the group's handle is a :class:`BucketGroupHandle`, whose
``wait()`` completes them, so Megatron's ``finish_grad_sync`` / ``finish_param_sync`` and the
overlap machinery work unchanged. Megatron's contract is kept: after grad sync this rank's
shard of each bucket holds the scaled sum over the DP group; after param sync every replica
holds the same parameters, bit for bit.

The modules, one concern each:

- :mod:`.settings`: what ``enable()`` set up; :mod:`.patches`: the replaced methods;
- :mod:`.refusals`: what sdp4bit cannot compress, refused when the model is built;
- :mod:`.ddp`: the DDP model's construction (bucket numbering, exact ranges, groups);
- :mod:`.groups`: sdp4bit's process groups, one set per (DP group, instance), built then;
- :mod:`.exact`: the parameters kept exact (``exact_params``), as ranges of each bucket;
- :mod:`.hybrid`: the all-reduce across distributed-optimizer instances;
- :mod:`.bucket_state`: a bucket group's collectives and step counter, set up at its first
  gradient sync;
- :mod:`.sync`: the patched syncs and their handles;
- :mod:`.checkpoint`: sdp4bit's state in megatron-core's checkpoints, and weights loaded
  outside the optimizer step;
- :mod:`.accounting`: bytes on the wire; :mod:`.replicas`: the copies Megatron keeps
  identical across tensor-parallel ranks and pipeline stages, compared.
"""

from __future__ import annotations

from sdp4bit import Config
from sdp4bit._patching import Patches
from sdp4bit.telemetry import Telemetry, announce

from . import groups as sdp4bit_groups
from .accounting import exact_wire_bytes, wire_bytes
from .bucket_state import BucketGroupState
from .checkpoint import detach, load_state_dict, state_dict
from .ddp import ddp_finish_grad_sync, ddp_init
from .exact import ExactElements
from .patches import GROUP_PATCHES, PATCHES, WRAPPER_PATCHES, restore_all
from .refusals import other_wrapper_classes, refuse_other_wrapper
from .replicas import check_replicated_params
from .settings import Settings, current, install
from .sync import BucketGroupHandle, finish_grad_sync, start_grad_sync, start_param_sync

__all__ = ["BucketGroupHandle", "BucketGroupState", "ExactElements", "check_replicated_params",
           "disable", "enable", "exact_wire_bytes", "is_enabled", "load_state_dict",
           "state_dict", "wire_bytes"]


def enable(config: Config | None, local_world_size: int | None = None,
           iteration=None, telemetry_interval: int = 0, tensorboard_writer=None,
           wandb_writer=None, replica_check_interval: int = 0) -> None:
    """Routes the distributed optimizer's collectives through sdp4bit with `config` (None:
    nothing to do, so that ``enable(config_from_args(args))`` leaves a run without sdp4bit
    flags as it is).

    Call it on every rank before the DDP model is built. `local_world_size` (ranks per node;
    default the launcher's, :func:`sdp4bit.groups.node_size`) defines the intra- and
    inter-node levels. `iteration`, if given, is a function returning the training loop's
    current iteration (one gradient sync per iteration): a bucket group set up after a resume
    from a checkpoint without sdp4bit's state then numbers its random streams from there; the
    model chunk's ``sharded_state_dict`` carries that state (:mod:`.checkpoint`). Every
    `telemetry_interval` steps (0: never) each bucket group reports bytes sent and the
    quantization error of its gradients and parameters against Megatron's exact collectives
    (:mod:`sdp4bit.telemetry`) to rank 0's output (:func:`sdp4bit.telemetry.announce`),
    `tensorboard_writer` and `wandb_writer` (each a writer, or a function returning one, as
    Megatron-LM's getters). Every `replica_check_interval` gradient syncs (0: never; the first
    one included) of the first DDP model built, :func:`check_replicated_params` runs on all of
    them before the sync.
    """
    if config is None:
        return
    description = config.describe()  # raises Sdp4bitError for a bad preset or knob
    if not isinstance(replica_check_interval, int) or replica_check_interval < 0:
        raise ValueError(f"sdp4bit: replica_check_interval must be a non-negative int, got "
                         f"{replica_check_interval!r}")
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    PATCHES.install(_ParamAndGradBucketGroup, "start_grad_sync", start_grad_sync)
    PATCHES.install(_ParamAndGradBucketGroup, "start_param_sync", start_param_sync)
    GROUP_PATCHES.install(_ParamAndGradBucketGroup, "finish_grad_sync", finish_grad_sync)
    PATCHES.install(DistributedDataParallel, "__init__", ddp_init)
    PATCHES.install(DistributedDataParallel, "finish_grad_sync", ddp_finish_grad_sync)
    for wrapper in other_wrapper_classes():
        WRAPPER_PATCHES.setdefault(wrapper.__name__, Patches()).install(
            wrapper, "__init__", refuse_other_wrapper)
    install(Settings(
        config,
        local_world_size,
        iteration=iteration,
        telemetry=Telemetry(telemetry_interval, tensorboard_writer, wandb_writer),
        replica_check_interval=replica_check_interval,
    ))
    announce(f"sdp4bit enabled for megatron-core's distributed optimizer: {description}")


def disable() -> None:
    """Restores Megatron's own collectives: completes sdp4bit's collectives in flight,
    forgets every bucket group's state and closes the process groups sdp4bit built. Call it
    on every rank before ``torch.distributed.destroy_process_group()``."""
    settings = current()
    if settings is not None:
        for bucket_group in settings.bucket_groups:
            del bucket_group._sdp4bit
        for attached in settings.attached:
            detach(attached)
        sdp4bit_groups.close_all(settings)
    restore_all()
    install(None)


def is_enabled() -> bool:
    return current() is not None
