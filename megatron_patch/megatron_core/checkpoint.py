"""sdp4bit's state in megatron-core's checkpoints, and weights loaded outside the optimizer
step.

What a resumed run needs of sdp4bit's state is each bucket group's step counter: it numbers
the random streams (rounding, Hadamard signs) and decides ``grad_quant_start_step``. The
qWD references are not saved: they are re-established from the loaded parameters, which are
what the uninterrupted run's references hold after its last all-gather (the reconstructed
parameters, identical on every replica), and the exact elements' part of the compressed
path is always 0 (:class:`~.exact.ExactElements`). While sdp4bit is enabled,
the ``sharded_state_dict`` of each model chunk built carries the counters as a
``ShardedObject`` (``SHARDED_KEY``), so that a checkpoint written with megatron-core's
``dist_checkpointing``, as Megatron-LM writes it, holds them, and its ``load_state_dict``
restores them (:func:`attach`). Every load of the chunk's weights marks its bucket groups:
before their next collective each re-establishes its references from the parameters every
replica then holds, or raises if the replicas differ."""

from __future__ import annotations

from sdp4bit import Sdp4bitError

from .parallel import bucket_groups
from .settings import current

#: The key of sdp4bit's entry in a model chunk's sharded state dict.
SHARDED_KEY = "sdp4bit"
VERSION = 1


def _chunk(ddp_model) -> int:
    """`ddp_model`'s index among the DDP models built since enable (its model chunk)."""
    settings = current()
    for index, model in enumerate(settings.models if settings is not None else ()):
        if model is ddp_model:
            return index
    raise Sdp4bitError("this DDP model was built before megatron_patch.megatron_core.enable(); "
                       "enable sdp4bit first, then build the model")


def state_dict(ddp_model) -> dict:
    """What a checkpoint must hold for a resumed run to continue bit for bit: each bucket
    group's step counter, by its first bucket's id (the same on every rank of a pipeline
    stage). The model chunk's ``sharded_state_dict`` carries it already (:func:`attach`);
    save it yourself only with a checkpoint of another kind."""
    settings = current()
    steps = {}
    for bucket_group in bucket_groups(ddp_model):
        state = getattr(bucket_group, "_sdp4bit", None)
        first = getattr(bucket_group.buckets[0], "sdp4bit_bucket_id", None)
        if state is not None:
            steps[first] = state.grad_step
        elif settings is not None and first in settings.resume_steps:
            steps[first] = settings.resume_steps[first]
    return {"version": VERSION, "grad_steps": steps}


def load_state_dict(saved: dict) -> None:
    """Restores the step counters of :func:`state_dict` (after :func:`enable`): bucket groups
    set up already continue from them, the others start there."""
    settings = current()
    if settings is None:
        raise Sdp4bitError("load_state_dict needs sdp4bit enabled first")
    if not isinstance(saved, dict) or saved.get("version") != VERSION:
        version = saved.get("version") if isinstance(saved, dict) else saved
        raise Sdp4bitError(f"unknown sdp4bit state version {version!r}")
    steps = {int(k): int(v) for k, v in saved["grad_steps"].items()}
    for bucket_group in settings.bucket_groups:
        first = bucket_group._sdp4bit.grad[0].bucket_id
        if first in steps:
            bucket_group._sdp4bit.grad_step = steps.pop(first)
    settings.resume_steps.update(steps)


def _model(ddp_model):
    """The model chunk inside `ddp_model`'s wrappers (DDP, Float16Module): what Megatron-LM's
    save_checkpoint and load_checkpoint unwrap to and call ``sharded_state_dict`` and
    ``load_state_dict`` on."""
    from megatron.core.transformer.module import Float16Module

    model = ddp_model.module
    while isinstance(model, Float16Module):
        model = model.module
    return model


def attach(ddp_model) -> list:
    """Puts sdp4bit's state into the checkpoints of `ddp_model`'s model chunk and watches its
    loads: its ``sharded_state_dict`` gains a ``ShardedObject`` under ``SHARDED_KEY`` (one per
    pipeline stage and model chunk, written by the first rank of the stage, the others its
    replicas); its ``load_state_dict`` takes that entry out and restores the counters
    (:func:`load_state_dict`), and marks the set-up bucket groups (their weights changed
    outside the optimizer step: the next collective re-establishes qWD's references,
    bucket_state.py). Returns what :func:`detach` undoes."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = _model(ddp_model)
    chunk = _chunk(ddp_model)
    own_sharded_state_dict = model.sharded_state_dict

    def sharded_state_dict(prefix: str = "", *args, **kwargs):
        sharded = own_sharded_state_dict(prefix, *args, **kwargs)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        replica = (parallel_state.get_tensor_model_parallel_rank(),
                   parallel_state.get_data_parallel_rank(with_context_parallel=True))
        sharded[prefix + SHARDED_KEY] = ShardedObject(
            f"{prefix}sdp4bit.chunk{chunk}", state_dict(ddp_model), (stages,), (stage,),
            replica_id=replica)
        return sharded

    def take_state(module, state, prefix, *args):
        saved = state.pop(prefix + SHARDED_KEY, None)
        if saved is not None:
            load_state_dict(saved)

    def loaded(module, incompatible_keys):
        for bucket_group in bucket_groups(ddp_model):
            found = getattr(bucket_group, "_sdp4bit", None)
            if found is not None:
                found.stale = True

    model.sharded_state_dict = sharded_state_dict
    return [model, model.register_load_state_dict_pre_hook(take_state),
            model.register_load_state_dict_post_hook(loaded)]


def detach(attached: list) -> None:
    """Undoes :func:`attach`."""
    model, *hooks = attached
    del model.sharded_state_dict
    for hook in hooks:
        hook.remove()
