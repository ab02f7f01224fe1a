"""DistributedDataParallel's construction and its finish_grad_sync while sdp4bit is enabled:
what the model cannot use refused, buckets numbered, the exact ranges recorded, the process
groups built, sdp4bit's state attached to the chunk's checkpoints and loads."""

from __future__ import annotations

import inspect

from sdp4bit import Sdp4bitError, limits

from . import checkpoint
from . import groups as sdp4bit_groups
from .exact import exact_params, merged_ranges
from .patches import PATCHES
from .refusals import refuse_buffer_dtypes, refuse_ddp_config
from .replicas import check_replicated_params
from .settings import Settings, current


def ddp_init(self, *args, **kwargs):
    """DistributedDataParallel.__init__, after refusing what sdp4bit cannot compress; then
    numbers its buckets (:func:`_number_buckets`), records where each bucket's exact
    parameters lie, builds the process groups its bucket groups will share and attaches sdp4bit's
    checkpoint state and load hooks to its model chunk (checkpoint.py)."""
    original = PATCHES.original("__init__")
    settings = current()
    if settings is None:
        return original(self, *args, **kwargs)
    arguments = inspect.signature(original).bind(self, *args, **kwargs).arguments
    refuse_ddp_config(arguments["ddp_config"], arguments["module"])
    original(self, *args, **kwargs)
    refuse_buffer_dtypes(self, settings.config)
    _number_buckets(settings, self)
    sdp4bit_groups.create_for_model(settings, self)
    settings.models.append(self)
    settings.attached.append(checkpoint.attach(self))


def _number_buckets(settings: Settings, ddp) -> None:
    """Numbers the buckets of `ddp` in buffer order, counting on from earlier models (model
    chunks), so the numbering (which seeds each bucket's random streams) does not depend on
    how buckets are grouped or when they first communicate. The bucket of the word embedding
    tied across pipeline stages (megatron-core gives it a bucket of its own, laid out alike on
    the first and the last stage) takes the largest id on both stages, so that their
    all-gathers give the same bits. Each bucket also records its exact parameters (the
    ``exact_params`` knob) and the ranges of the bucket they lie in."""
    tied_id = limits().max_bucket_id
    exact = exact_params(ddp, settings.config.resolved.exact_params)
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        for bucket in buffer.buckets:
            if any(getattr(p, "shared_embedding", False) for p in bucket.params_list):
                bucket_id = tied_id
            else:
                bucket_id = settings.next_bucket_id
                settings.next_bucket_id += 1
                if bucket_id == tied_id:
                    raise Sdp4bitError(
                        f"more than {tied_id} DDP buckets: sdp4bit's random streams number "
                        f"buckets up to {tied_id - 1} (and {tied_id}, the tied word "
                        "embedding's); make the buckets larger (bucket_size)")
            bucket.sdp4bit_bucket_id = bucket_id
            bucket.sdp4bit_exact_params = [p for p in bucket.params_list if p in exact]
            starts = {p: buffer.param_index_map[p][0] - bucket.offset
                      for p in bucket.sdp4bit_exact_params}
            bucket.sdp4bit_exact = merged_ranges((starts[p], starts[p] + p.numel())
                                                 for p in bucket.sdp4bit_exact_params)


def ddp_finish_grad_sync(self, *args, **kwargs):
    """DistributedDataParallel.finish_grad_sync, after :func:`check_replicated_params` on every
    `replica_check_interval`-th call for the first model: finalize_model_grads calls it on every
    rank after the pipeline schedule, when each stage's forward has gathered every parameter
    and no rank waits for another's activations."""
    settings = current()
    if (settings is not None and settings.replica_check_interval and settings.models
            and self is settings.models[0]):
        if settings.replica_checks % settings.replica_check_interval == 0:
            check_replicated_params(settings.models)
        settings.replica_checks += 1
    return PATCHES.original("finish_grad_sync")(self, *args, **kwargs)
