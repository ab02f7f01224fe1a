"""The copies Megatron keeps bit-identical outside the DP group, compared: parameters
replicated across tensor-parallel ranks, and the word embedding tied between the first and
the last pipeline stage."""

from __future__ import annotations

import torch.distributed as dist

from sdp4bit import Sdp4bitError
from sdp4bit.replicas import checksums_across

from .parallel import tensor_parallel_group


def check_replicated_params(models) -> None:
    """Raises :class:`Sdp4bitError`, naming the first parameter that differs and the ranks
    that hold other bits, unless the copies Megatron keeps identical outside the DP group are
    bit-identical: across the tensor-parallel group every parameter without
    ``tensor_model_parallel``, across the embedding group the word embedding tied between the
    first and the last pipeline stage. `models` is a DDP model or a list of model chunks.
    Collective over both groups: call it on every rank at the same point, with the parameters
    gathered (``enable(replica_check_interval=N)`` calls it as the gradient sync starts).
    Compares checksums of the bits (:func:`sdp4bit.replicas.checksums_across`)."""
    from megatron.core import parallel_state

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    named = [(name, p) for model in models for name, p in model.module.named_parameters()]
    tp_group = tensor_parallel_group(models[0])
    if tp_group.size() > 1:
        _check_copies([(n, p) for n, p in named if not getattr(p, "tensor_model_parallel", False)],
                      tp_group, "tensor-parallel")
    tied = [(n, p) for n, p in named if getattr(p, "shared_embedding", False)]
    embedding_group = parallel_state.get_embedding_group(check_initialized=False)
    if (tied and embedding_group is not None
            and dist.get_rank() in dist.get_process_group_ranks(embedding_group)):
        _check_copies(tied, embedding_group, "embedding")


def _check_copies(named: list, group, what: str) -> None:
    """Raises :class:`Sdp4bitError` naming the first of `named` (name, tensor) whose bits
    differ across `group` (the `what` group)."""
    sums = checksums_across([p.detach() for _, p in named], group)
    differs = (sums != sums[0]).any(dim=0).nonzero()
    if len(differs):
        index = int(differs[0])
        ranks = dist.get_process_group_ranks(group)
        others = [ranks[r] for r in range(len(ranks)) if sums[r, index] != sums[0, index]]
        raise Sdp4bitError(
            f"parameter {named[index][0]} differs across the {what} group {ranks}: ranks "
            f"{others} hold other bits than rank {ranks[0]} ({int(differs.numel())} of "
            f"{len(named)} tensors that Megatron keeps identical there differ)")
